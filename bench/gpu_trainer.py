"""The trainer's side of a step on one GPU, with no server: what train.py's loss-and-step phase costs against the
bare model doing the same work (issue 60). For each model, a random one of a real shape (Qwen2.5-0.5B and -1.5B
dimensions, built from a config in code and saved to a temporary folder; nothing is downloaded), one batch of
synthetic completions (--sequences of them: a --prompt token prompt, completions of --completion_min to
--completion_max tokens, lengths drawn once per model) goes through:

  trainer          models.build_models (the model loaded and wrapped as a run does: fp32 weights, gradient
                   checkpointing as set, the chunked log-prob head of logprobs.py) and models.build_optimizer (AdamW),
                   then per step train.accumulate_gradients (the dapo loss, importance sampling against made-up
                   sampler log-probs, micro-batches of --micro_batch_size, longest first, padding trimmed) and
                   train.optimizer_step (clipping at 1.0, AdamW), in bf16 autocast as train.py makes it;
  trainer, FSDP2   the same with --fsdp: a process group of one, started in this process as torchrun's would be
                   (utils.setup_distributed: gloo for CPU tensors, NCCL for CUDA ones);
  bare             the transformers model alone, loaded from the same folder: per micro-batch (the same ones) its
                   forward under the same autocast with logits for the completion tokens only (logits_to_keep),
                   loss = minus the mean log-prob of the completion tokens (fp32 log-softmax of the logits, the usual
                   way), backward; then torch.optim.AdamW's step. The limit the trainer is held to.

Per run it prints tokens per second (every token sent, prompt and completion, no padding), the model FLOP
utilisation, MFU = 6 x parameters (each counted once, the tied head too) x tokens / time / the card's dense bf16
peak (the usual estimate: no attention term, no recomputation of checkpointed layers; the tied head is counted
for every token although it runs on completion tokens only, which overstates MFU by about 7% at 0.5B and 4% at
1.5B), beside it the same against this card's measured matmul peak (an 8192^3 bf16 product), the peak GPU memory
(torch's max_memory_allocated, weights and AdamW state included), and for the trainer's runs the ratios
trainer / bare of the time per step and of the peak memory, against the bare run with the same checkpointing.
The bare run materialises the full-vocabulary fp32 log-softmax of its micro-batch (as a plain transformers loss
does), which the trainer's chunked head never holds: its memory is a generous limit, so read the trainer's
memory beside the weights and AdamW state too.
The goal (issue 60): time <= 1.15 x bare, and with checkpointing on, memory <= bare. The table is markdown (the one
docs/performance.md takes); --out also writes it and a JSON file there, after every run (a run cut short keeps the
rows done). A run that fails is a row that says why; the script then exits 1.

    python3 bench/gpu_trainer.py --out DIR                     # on a GPU: both models, every setting
    .venv/bin/python bench/gpu_trainer.py --device cpu --tiny  # a tiny model on the CPU in seconds (the smoke test)

On the CPU there is no nominal peak (MFU is against the measured matmul peak) and no GPU memory to read, and the
dtype follows config.native_bf16 (fp32 where bf16 is emulated), as train.py's. bench/gpu_check.sh makes the device
call; it imports nothing that the GPU image lacks (train.py's imports: torch, safetensors, requests; transformers
in models.py).
"""
import argparse
import datetime
import functools
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.utils import logging as hf_logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, from the repository root
from config import Config, UsageError, native_bf16
from grpo import loss_mask_of
from logprobs import length_sorted, take, to_device, trim_padding
from models import build_models, build_optimizer
from rollout import collate, sampled_episode
from train import accumulate_gradients, optimizer_step
from utils import free_ports, run_and_exit, setup_distributed

# Qwen2.5's released configs (config.json of Qwen/Qwen2.5-0.5B and -1.5B), random weights: the shapes decide the cost.
QWEN25 = dict(vocab_size=151936, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", use_cache=False)
SHAPES = {
    "qwen2.5-0.5b": dict(QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "qwen2.5-1.5b": dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12),
    "tiny": dict(QWEN25, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256),  # --tiny: the smoke test's
}
# Dense bf16 tensor-core peaks from NVIDIA's data sheets (the sparse figures are twice these), by device name.
NOMINAL_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
                ("A100", 312e12))
# (name, FSDP2, gradient checkpointing): each trainer run; a bare run per checkpointing value goes with them.
SETTINGS = {"checkpointing": ("trainer", False, True), "no_checkpointing": ("trainer", False, False),
            "fsdp2": ("trainer, FSDP2", True, True)}
WORKLOAD = dict(sequences=32, micro_batch_size=4, prompt=256, completion_min=512, completion_max=1024, steps=3)
TINY_WORKLOAD = dict(sequences=8, micro_batch_size=4, prompt=16, completion_min=8, completion_max=32, steps=1)
COLUMNS = ("model", "run", "checkpointing", "tokens/step", "tokens/s", "MFU", "of matmul peak", "peak GiB",
           "time / bare", "memory / bare")


# -----------------------------------------------------------------------------
# the card, the model, the batch

def card(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def nominal_peak(device: torch.device) -> float | None:
    """The card's dense bf16 peak in FLOP/s, None for a CPU or a card not in NOMINAL_BF16."""
    name = card(device)
    return next((flops for key, flops in NOMINAL_BF16 if key in name), None) if device.type == "cuda" else None


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in `dtype` (8192^3 on a GPU, 512^3 on a CPU), the mean of timed products after
    warm-ups: what this card does at best, beside its data sheet's figure."""
    n, warm, timed = (8192, 3, 10) if device.type == "cuda" else (512, 2, 5)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(warm):
        a @ b
    synchronize(device)
    t = time.perf_counter()
    for _ in range(timed):
        a @ b
    synchronize(device)
    return 2 * n ** 3 * timed / (time.perf_counter() - t)


def save_random_model(name: str, folder: str, device: torch.device) -> int:
    """A Qwen2 model of SHAPES[name] with random weights (built on `device`, where it is fast), saved in bf16 to
    `folder` as a Hugging Face model folder (models.load_model reads it in fp32, as a run does). Returns its number
    of parameters, the tied embedding counted once."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[name]), dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    return params


def synthetic_batch(vocab: int, w: dict, seed: int = 0) -> tuple[dict, list[int]]:
    """train.py's batch of one step (data for accumulate_gradients, as main() builds it) of w["sequences"]
    completions of random tokens: a prompt of w["prompt"] tokens and a completion of a random length in
    [completion_min, completion_max], each token sampled by the policy with a made-up sampler log-prob (so the
    importance weights against the sampler, on by default, are computed). Returns the data and the lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(w["completion_min"], w["completion_max"] + 1, (w["sequences"],), generator=g).tolist()
    episodes = [sampled_episode({}, torch.randint(vocab, (w["prompt"],), generator=g).tolist(),
                                torch.randint(vocab, (n,), generator=g).tolist(),
                                (-3 * torch.rand(n, generator=g)).tolist()) for n in lengths]
    inputs, tokens = collate(episodes, pad_id=0)
    truncated = torch.zeros(len(episodes), dtype=torch.bool)  # every completion finished: all of them train
    data = dict(inputs=inputs, loss_mask=loss_mask_of(tokens["sampled"], truncated, False),
                advantages=torch.randn(len(episodes), generator=g), old_logp=None, ref_logp=None, keep=None,
                sampler_logp=tokens["sampler_logp"], entropy_mask=None)
    return data, lengths


# -----------------------------------------------------------------------------
# one step, the trainer's and the bare model's: (seconds of the forwards and backwards, seconds of the optimizer)

def trainer_step(model, optimizer, scheduler, trainable: list, data: dict, cfg: Config, autocast, device):
    t = time.perf_counter()
    accumulate_gradients(model, data, cfg, 1, autocast)
    synchronize(device)
    backward = time.perf_counter() - t
    optimizer_step(optimizer, scheduler, trainable, cfg.max_grad_norm)
    synchronize(device)
    return backward, time.perf_counter() - t - backward


def bare_step(model, optimizer, data: dict, micro_batch_size: int, autocast, device):
    """The bare model's forward and backward on the trainer's micro-batches (longest first, padding trimmed, as
    accumulate_gradients cuts them), loss = minus the mean log-prob of the step's completion tokens; AdamW's step."""
    t = time.perf_counter()
    inputs, mask = data["inputs"], data["loss_mask"]
    C, tokens = mask.shape[1], mask.sum()
    for rows in length_sorted(torch.arange(len(mask)), inputs["attention_mask"].sum(dim=1), micro_batch_size):
        part, c = trim_padding(take(inputs, rows), C)
        part, m = to_device(part, device), mask[rows, :c].to(device)
        with autocast:
            logits = model(**part, logits_to_keep=c + 1, use_cache=False).logits[:, :-1]  # (b, c, V)
        logp = logits.float().log_softmax(-1).gather(-1, part["input_ids"][:, -c:, None]).squeeze(-1)  # (b, c)
        (-(logp * m).sum() / tokens).backward()
    synchronize(device)
    backward = time.perf_counter() - t
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return backward, time.perf_counter() - t - backward


def measure(step, steps: int, device: torch.device) -> dict:
    """step() once to warm up (kernels chosen, AdamW's state made), then `steps` times, timed; the peak GPU memory
    over all of them (the model's weights and AdamW's state included)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()
    times = [step() for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    return {"backward_s": [b for b, _ in times], "optimizer_s": [o for _, o in times],
            "seconds": [b + o for b, o in times], "peak_gib": peak}


def run_trainer(folder: str, data: dict, fsdp: bool, checkpointing: bool, w: dict, bf16: bool, device) -> dict:
    """The trainer's model, optimizer and step as train.py builds them (the run's flags that matter here)."""
    cfg = Config(model=folder, fsdp=fsdp, gradient_checkpointing=checkpointing, bf16=bf16,
                 micro_batch_size=w["micro_batch_size"], max_completion_length=w["completion_max"])
    policy, model, _ = build_models(cfg, folder, False, None, device, 1)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(policy, cfg)
    # train.main's autocast: the forward in bf16, without a cache of bf16 weight copies.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if bf16 else nullcontext()
    model.train()
    return measure(lambda: trainer_step(model, optimizer, scheduler, trainable, data, cfg, autocast, device),
                   w["steps"], device)


def run_bare(folder: str, data: dict, checkpointing: bool, w: dict, bf16: bool, device) -> dict:
    """The transformers model alone (fp32 weights, the same checkpointing) and plain AdamW, under the trainer's
    autocast: no cache of bf16 weight copies, whose memory would count against the bare model alone."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=Config.learning_rate)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if bf16 else nullcontext()
    return measure(lambda: bare_step(model, optimizer, data, w["micro_batch_size"], autocast, device), w["steps"],
                   device)


def released(device: torch.device):
    """What a run left on the GPU (its model, optimizer, activations; FSDP2's hooks hold the model in cycles) freed
    before the next one is built and measured. On a CPU no memory is measured, and a collection takes ~0.5 s."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# -----------------------------------------------------------------------------
# the numbers of a run, the table, the files

def summarized(row: dict, tokens: int, params: int, peak: float, matmul: float, bare: dict | None = None) -> dict:
    """A measured run's rates: tokens/s over the mean step, MFU against `peak` and `matmul` (FLOP/s), and, for a
    trainer's run, the ratios to its `bare` run: time per step, peak memory."""
    if row.get("error"):
        return row
    seconds = sum(row["seconds"]) / len(row["seconds"])
    flops = 6 * params * tokens / seconds
    row |= {"tokens": tokens, "mean_s": seconds, "tokens_per_s": tokens / seconds, "mfu": flops / peak,
            "mfu_of_matmul": flops / matmul}
    if bare and not bare.get("error"):
        row["time_vs_bare"] = seconds / bare["mean_s"]
        if row["peak_gib"] is not None:
            row["memory_vs_bare"] = row["peak_gib"] / bare["peak_gib"]
    return row


def table_row(row: dict) -> str:
    def number(key: str, form: str) -> str:
        return "-" if row.get(key) is None else format(row[key], form)
    if row.get("error"):
        cells = [f"failed: {row['error']}"] + ["-"] * 6
    else:
        cells = [str(row["tokens"]), number("tokens_per_s", ".0f"), f"{100 * row['mfu']:.2f}%",
                 f"{100 * row['mfu_of_matmul']:.2f}%", number("peak_gib", ".2f"), number("time_vs_bare", ".2f"),
                 number("memory_vs_bare", ".2f")]
    on = "on" if row["checkpointing"] else "off"
    return "| " + " | ".join([row["model"], row["run"], on, *cells]) + " |"


def report(result: dict) -> str:
    """The markdown: what was measured, how, on what; then the table."""
    r = result
    dtype = "bf16 autocast" if r["bf16"] else "fp32 (bf16 is not native here)"
    peak = (f"MFU against the card's dense bf16 peak, {r['nominal_peak_tflops']:.4g} TFLOP/s"
            if r["nominal_peak_tflops"] else f"no nominal peak for {r['card']}: MFU against the measured matmul peak")
    lines = [f"{r['card']}, {r['date']}, torch {r['torch']}, transformers {r['transformers']}: {dtype}, fp32 weights, "
             f"AdamW. `{r['command']}`", "",
             f"Peak used: {r['peak_tflops']:.4g} TFLOP/s ({peak}); measured matmul peak "
             f"{r['matmul_peak_tflops']:.4g} TFLOP/s ({r['matmul']}). MFU = 6 x parameters x tokens / time / peak.", ""]
    for name, m in r["models"].items():
        lines.append(f"- {name}: {m['params']} parameters; {m['sequences']} sequences per step, prompt {m['prompt']} + "
                     f"completions of {min(m['lengths'])}..{max(m['lengths'])} tokens "
                     f"(mean {sum(m['lengths']) / len(m['lengths']):.0f}), {m['tokens']} tokens per step, "
                     f"micro-batches of {m['micro_batch_size']}; timed: the mean of {m['steps']} step(s) after a "
                     "warm-up step")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + [table_row(row) for row in r["rows"]]) + "\n"


def write(result: dict, out: str | None):
    if out:
        with open(os.path.join(out, "gpu_trainer.md"), "w") as f:
            f.write(report(result))
        with open(os.path.join(out, "gpu_trainer.json"), "w") as f:
            json.dump(result, f, indent=1)


# -----------------------------------------------------------------------------

def model_runs(name: str, w: dict, settings: list[str], result: dict, device, out: str | None):
    """Every setting's trainer run on model `name`, each after the bare run it is compared with (one per
    checkpointing value), each appended to result["rows"] as it is done (and written to `out`)."""
    with tempfile.TemporaryDirectory() as folder:
        params = save_random_model(name, folder, device)
        data, lengths = synthetic_batch(SHAPES[name]["vocab_size"], w)
        tokens = int(data["inputs"]["attention_mask"].sum())  # sent: every prompt and completion token, no padding
        result["models"][name] = {"params": params, "lengths": lengths, "tokens": tokens, **w}
        rates = functools.partial(summarized, tokens=tokens, params=params, peak=result["peak_tflops"] * 1e12,
                                  matmul=result["matmul_peak_tflops"] * 1e12)
        bare = {}
        for setting in settings:
            run, fsdp, checkpointing = SETTINGS[setting]
            if checkpointing not in bare:
                bare[checkpointing] = rates(measured(name, "bare transformers", False, checkpointing, device, lambda:
                                                     run_bare(folder, data, checkpointing, w, result["bf16"], device)))
                record(bare[checkpointing], result, out)
            row = measured(name, run, fsdp, checkpointing, device,
                           lambda: run_trainer(folder, data, fsdp, checkpointing, w, result["bf16"], device))
            record(rates(row, bare=bare[checkpointing]), result, out)


def measured(model: str, run: str, fsdp: bool, checkpointing: bool, device, measure_run) -> dict:
    """A row of the table: measure_run()'s numbers, or why it failed (its traceback printed; the others still run)."""
    row = {"model": model, "run": run, "fsdp": fsdp, "checkpointing": checkpointing}
    print(f"{model}: {run}, checkpointing {'on' if checkpointing else 'off'} ...", flush=True)
    try:
        row |= measure_run()
    except Exception as e:
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    released(device)
    return row


def record(row: dict, result: dict, out: str | None):
    result["rows"].append(row)
    print(table_row(row), flush=True)
    write(result, out)


def main(a):
    # A process group of one, as torchrun's rank 0 of 1 would start it (FSDP2 needs one; the others run in it too).
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_ports()[0])})
    _, _, _, device, _ = setup_distributed()
    hf_logging.disable_progress_bar()  # the log holds the rows, no saving and loading bars
    if device.type != a.device:
        raise UsageError(f"--device {a.device}, but torch sees {device.type}: run with --device {device.type}"
                         + (" (or with CUDA_VISIBLE_DEVICES= for the CPU)" if device.type == "cuda" else ""))
    bf16 = native_bf16(device)  # as train.py's --bf16 auto: fp32 on a CPU that emulates bf16
    matmul = matmul_peak(device, torch.bfloat16 if bf16 else torch.float32)
    w = {**(TINY_WORKLOAD if a.tiny else WORKLOAD), **{k: v for k, v in vars(a).items() if k in WORKLOAD and v}}
    nominal = nominal_peak(device)
    result = {"card": card(device), "device": device.type, "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "transformers": transformers.__version__, "bf16": bf16,
              "command": " ".join(["python3", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "nominal_peak_tflops": nominal and nominal / 1e12, "matmul_peak_tflops": matmul / 1e12,
              "matmul": f"{'8192' if device.type == 'cuda' else '512'}^3, {'bf16' if bf16 else 'fp32'}",
              "peak_tflops": (nominal or matmul) / 1e12, "models": {}, "rows": []}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    print(f"{result['card']}: matmul peak {result['matmul_peak_tflops']:.4g} TFLOP/s", flush=True)
    for name in ["tiny"] if a.tiny else a.models.split(","):
        model_runs(name, w, a.settings.split(","), result, device, a.out)
    print("\n" + report(result), flush=True)
    failed = [f"{r['model']} {r['run']} (checkpointing {'on' if r['checkpointing'] else 'off'})"
              for r in result["rows"] if r.get("error")]
    if failed:
        print(f"failed: {'; '.join(failed)}: the tracebacks are above", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (the CPU smoke test)")
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"of {','.join(SETTINGS)}")
    p.add_argument("--out", default=None, help="a folder for gpu_trainer.md and gpu_trainer.json")
    for key, value in WORKLOAD.items():
        p.add_argument(f"--{key}", type=int, default=None,
                       help=f"default {value} ({TINY_WORKLOAD[key]} with --tiny)")
    a = p.parse_args()
    if set(a.settings.split(",")) - set(SETTINGS):
        p.error(f"--settings {a.settings}: a comma-separated list of {','.join(SETTINGS)}")
    if not a.tiny and set(a.models.split(",")) - set(SHAPES):
        p.error(f"--models {a.models}: a comma-separated list of {','.join(SHAPES)}")
    run_and_exit(main, a)  # the process group torn down without gloo's abort at exit (utils.run_and_exit)
