"""Peak memory of the no-grad log-prob pass, three ways: "logits" is the usual way (the model's logits,
then an fp32 log-softmax and a gather); "plain" is logprobs.completion_logprobs with the head applied to all
positions at once (chunk_size None); "chunked" applies it 32 positions at a time, which is what
logprobs.completion_logprobs does without grad (pi_old, reference, probe). Then the training pass (forward
and backward through logprobs.completion_logprobs) without and with --gradient_checkpointing. Each path runs
in its own process; the number is the growth of the process's peak RSS during the pass. Everything computes in bf16
autocast where the CPU has bf16 natively, else in fp32, as train.py does by default (limits.compute_dtype).

    .venv/bin/python bench/logprob_memory.py [--model smollm2-135m] [--batch 16] [--completion 256]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import nullcontext

from limits import compute_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(path: str, model: str, batch: int, prompt: int, completion: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import embedded
    import logprobs
    import models
    m = models.load_model(embedded.resolve_model(model), "cpu")
    m.config.use_cache = False
    m.train(path.startswith("train"))  # as in train.py: transformers checkpoints only in train mode
    if path == "train_checkpointing":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = {"input_ids": torch.randint(3, m.config.vocab_size, (batch, prompt + completion))}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if compute_dtype() == torch.bfloat16 else nullcontext()
    with autocast, torch.set_grad_enabled(path.startswith("train")):
        if path == "logits":
            logits = m(**inputs).logits[:, -completion - 1:-1].float()
            logits.log_softmax(-1).gather(-1, inputs["input_ids"][:, -completion:, None])
        else:
            logps, _ = logprobs.completion_logprobs(m, inputs, completion, 1.0, 32 if path == "chunked" else None)
    if path.startswith("train"):
        logps.mean().backward()
    seconds = time.perf_counter() - t
    return {"path": path, "peak_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
            "seconds": seconds}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--one", default="")
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.model, a.batch, a.prompt, a.completion)))
        sys.exit()
    results = {}
    for path in ("logits", "plain", "chunked", "train", "train_checkpointing"):
        out = subprocess.run([sys.executable, __file__, "--one", path, "--model", a.model, "--batch", str(a.batch),
                              "--prompt", str(a.prompt), "--completion", str(a.completion)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[path] = json.loads(out)
        print(f"{path:19s} peak RSS growth {results[path]['peak_growth_mb']:8.0f} MB   {results[path]['seconds']:.2f} s")
    def ratio(path: str, base: str, key: str) -> str:  # a tiny model's pass may not grow the peak at all
        return f"{results[path][key] / results[base][key]:.2f}x" if results[base][key] > 0 else "n/a (no growth)"
    for path, base in (("plain", "logits"), ("chunked", "logits"), ("train_checkpointing", "train")):
        print(f"{path} / {base}: memory {ratio(path, base, 'peak_growth_mb')}, time {ratio(path, base, 'seconds')}")
    print(f"(batch {a.batch}, {a.prompt} prompt + {a.completion} completion tokens, "
          f"{str(compute_dtype()).removeprefix('torch.')})")
