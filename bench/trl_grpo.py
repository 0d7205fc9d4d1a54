"""TRL's GRPOTrainer on nanogrpo's embedded task and rewards, for bench/vs_trl.py, which runs it in
its own virtual environment (bench/.venv-trl). Prints one JSON line: the wall time of each optimizer
step, and the reward and completion length TRL logged for it. TRL computes in bf16 where the CPU has it natively,
else in fp32, as nanogrpo's --bf16 auto does (config.native_bf16: emulated bf16 is ~100x slower).

    bench/.venv-trl/bin/python bench/trl_grpo.py --model FOLDER [--steps 4 --prompts 8 --G 8 --length 128]
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import native_bf16  # noqa: E402
from embedded import arithmetic_problems  # noqa: E402
from rewards import accuracy, format  # noqa: E402 - TRL's signature: they run in TRL as they are


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--micro_batch_size", type=int, default=16)
    p.add_argument("--gradient_checkpointing", choices=["true", "false"], default="true")  # TRL's default: true
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = arithmetic_problems(5000, 42)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends, self.logs = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    completions = a.prompts * a.G
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=native_bf16(torch.device("cpu")), max_steps=a.steps, learning_rate=3e-5,
            lr_scheduler_type="constant",
            adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
            num_generations=a.G, max_completion_length=a.length, temperature=1.0, seed=42,
            per_device_train_batch_size=a.micro_batch_size, gradient_accumulation_steps=completions // a.micro_batch_size,
            gradient_checkpointing=a.gradient_checkpointing == "true", logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        timer = StepTimes()
        trainer = GRPOTrainer(model=a.model, reward_funcs=[accuracy, format], args=config, train_dataset=data,
                              callbacks=[timer])
        trainer.train()
    logged = [m for m in timer.logs if "reward" in m]
    print(json.dumps({"step_times": [b - e for e, b in zip(timer.ends, timer.ends[1:])],
                      "reward": [m["reward"] for m in logged],
                      "completion_length": [m.get("completions/mean_length") for m in logged]}))
