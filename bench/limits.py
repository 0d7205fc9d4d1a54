"""nanogrpo's phases against what this machine can do at best on the same work. One invocation runs,
one after the other (never two at once: they share the CPU):

  1. train.py against its own server (bf16), which records each step's prompts and completion lengths;
  2. the generation limit: vLLM's offline engine (vllm.LLM, no HTTP server, no trainer) on the same
     prompts, each completion forced to the length it had (ignore_eos, min_tokens = max_tokens);
  3. the training limit: the model's forward and backward on the same sequences in the same
     micro-batches (longest first, padding trimmed), bf16 autocast, loss = the sum of the logits:
     no log-softmax, no GRPO loss, no optimizer (train.py's optimizer time is taken out of its phase);
  4. the sync limit: the weights cast to the server's dtype, packed into buckets of the push's size,
     copied once, and unpacked into a second copy of the model (serialize + copy + load).

It prints, for the steps after the first, each phase's mean time, its limit's and the ratio.

    .venv/bin/python bench/limits.py [--steps 4 --prompts 8 --G 8 --length 128]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import ROOT, mean, serving, steady, timed, train, workload_arguments

MICRO_BATCH_SIZE = 16  # train.py's default
BUCKET_MB = 64  # train.py's --weight_sync_bucket_mb default


def workloads(rollouts: str, model: str, steps: list[int]) -> dict[int, list[tuple[list[int], list[int]]]]:
    """{step: [(prompt ids, completion ids of the recorded length)]} from train.py's rollouts.jsonl. The
    completion's ids are its text re-encoded, cut or padded to the length it had: the cost is the same."""
    from transformers import AutoTokenizer
    from utils import encode_prompt
    tokenizer = AutoTokenizer.from_pretrained(model)
    out = {s: [] for s in steps}
    with open(rollouts) as f:
        for r in map(json.loads, f):
            if r["split"] == "train" and r["step"] in out:
                ids = tokenizer(r["completion"], add_special_tokens=False)["input_ids"][:r["completion_tokens"]]
                ids += [tokenizer.eos_token_id] * (r["completion_tokens"] - len(ids))
                out[r["step"]].append((encode_prompt(tokenizer, r["prompt"]), ids))
    return out


def generation_limit(model: str, work: dict) -> dict[int, float]:
    import vllm_server  # noqa: F401  the server's CPU settings (threads on all cores, KV cache size)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", vllm_server.cpu_binding(os.cpu_count(), 1))
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=2048, enable_chunked_prefill=False, seed=0)

    def generate(batch):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in batch],
                            [SamplingParams(max_tokens=len(c), min_tokens=len(c), ignore_eos=True, temperature=1.0, logprobs=0)
                             for _, c in batch], use_tqdm=False)

    generate(next(iter(work.values())))  # warm-up
    return {s: timed(generate, batch)[0] for s, batch in work.items()}


def training_limit(model: str, work: dict) -> dict[int, float]:
    import torch
    from utils import collate, length_sorted, load_model, trim_padding
    policy = load_model(model, torch.device("cpu"))

    def forward_backward(batch):
        ids, attention, completion = collate([p for p, _ in batch], [c for _, c in batch], 0)
        C = completion.shape[1]
        for s in length_sorted(torch.arange(len(batch)), attention.sum(dim=1), MICRO_BATCH_SIZE):
            x, m, c = trim_padding(ids[s], attention[s], C)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = policy(input_ids=x, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                                logits_to_keep=c + 1, use_cache=False).logits
                logits.sum().backward()
        policy.zero_grad(set_to_none=True)

    forward_backward(next(iter(work.values())))  # warm-up
    return {s: timed(forward_backward, batch)[0] for s, batch in work.items()}


def sync_limit(model: str, repeats: int = 3) -> float:
    import torch
    from utils import load_model
    from vllm_server import bucket_plan
    source = list(load_model(model, torch.device("cpu")).parameters())
    target = [p.detach().to(torch.bfloat16) for p in source]  # the server's copy
    plan = bucket_plan([p.numel() * 2 for p in source], BUCKET_MB * 2 ** 20)

    def push():
        for bucket in plan:
            packed = torch.cat([source[i].detach().to(torch.bfloat16).flatten().view(torch.uint8) for i in bucket])
            received, offset = packed.clone(), 0
            for i in bucket:
                n = target[i].numel() * 2
                target[i].copy_(received[offset:offset + n].view(torch.bfloat16).view(target[i].shape))
                offset += n

    push()  # warm-up
    return min(timed(push)[0] for _ in range(repeats))


def in_subprocess(part: str, model: str, workload_file: str) -> dict:
    """Each limit in a fresh process: nothing of one (vLLM's engine, autograd buffers) slows the next."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", part, "--model", model, "--workload",
                          workload_file], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"the {part} limit failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--part", choices=["generate", "train", "sync"], help=argparse.SUPPRESS)  # a limit's own process
    p.add_argument("--workload", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.part:
        work = {int(k): v for k, v in json.load(open(a.workload)).items()}
        result = {"generate": generation_limit, "train": training_limit}.get(a.part, lambda m, w: sync_limit(m))(a.model, work)
        print("RESULT " + json.dumps(result))
        sys.exit(0)

    sys.path.insert(0, ROOT)
    from utils import resolve_model
    model = resolve_model(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        with serving(model, tmp) as server:
            metrics, _ = train(model, server["port"], os.path.join(tmp, "out"), a.steps, a.prompts, a.G, a.length)
        rows = steady(metrics)
        steps = [m["step"] for m in rows]
        workload_file = os.path.join(tmp, "workload.json")
        with open(workload_file, "w") as f:
            json.dump(workloads(os.path.join(tmp, "out", "rollouts.jsonl"), model, steps), f)
        limits = {part: in_subprocess(part, model, workload_file) for part in ("generate", "train", "sync")}
    ours = {"generate": mean(rows, "time/generate"), "train": mean(rows, "time/train") - mean(rows, "time/optimizer"),
            "sync": mean(rows, "time/sync")}
    best = {"generate": sum(limits["generate"][str(s)] for s in steps) / len(steps),
            "train": sum(limits["train"][str(s)] for s in steps) / len(steps), "sync": limits["sync"]}
    print(f"{a.model} | 1 process | {a.prompts} prompts x G={a.G}, up to {a.length} tokens (mean "
          f"{mean(rows, 'completion_length'):.0f}) | steps {steps[0]}-{steps[-1]} | bf16")
    print(f"  {'phase':28s} {'nanogrpo':>9s} {'limit':>9s} {'ratio':>6s}")
    names = {"generate": "generate (vs vllm.LLM)", "train": "forward+backward (vs bare)", "sync": "weight push (vs copy)"}
    for phase in ("generate", "train", "sync"):
        print(f"  {names[phase]:28s} {ours[phase]:8.2f}s {best[phase]:8.2f}s {ours[phase] / best[phase]:6.2f}")
