"""Vision-language models: nanogrpo's generation and training with images against what this machine can do at
best on the same work (by default the embedded VLM on the embedded shapes task). One invocation runs, one after
the other (never at once: they share the CPU):

  1. generation: vision.vision_rollout (the rollout of a VLM) through vllm_server.py's chat route, for --steps
     steps of --prompts rows x G; each step's conversations and completion lengths are recorded;
  2. its limit: vllm.LLM.chat in a fresh process (no HTTP server, no trainer) on the same conversations, each
     sample forced to the length it had (ignore_eos, min_tokens = max_tokens);
  3. training: each step's episodes through train.py's accumulate_gradients, and beside it (alternating, in one
     process) the bare model's forward and backward on the same micro-batches with the same pixel inputs
     (loss = the sum of the logits: no log-softmax, no GRPO loss);
  4. memory: the pixel bytes a collated batch holds against G copies per prompt.

It prints, per step after the first (which warms up), each time, its limit's and the ratio.

    .venv/bin/python bench/vision.py [--model smollm2-vision --steps 4 --prompts 8 --G 8 --length 12]
"""
import argparse
import os
import sys
import tempfile
from contextlib import nullcontext

from common import ROOT, replay_if_asked, replayed, serving, timed, workload_arguments

sys.path.insert(0, os.path.join(ROOT, "bench"))
MICRO_BATCH_SIZE = 16  # train.py's default


class Recording:
    """The server's client, recording each chat request: its messages, n and the length of every sample."""

    def __init__(self, client):
        self.client, self.requests = client, []

    def chat(self, messages, n, **sampling):
        ids, samples = self.client.chat(messages, n, **sampling)
        self.requests.append({"messages": messages, "lengths": [len(s["token_ids"]) for s in samples]})
        return ids, samples


def rollouts(model: str, port: int, steps: int, prompts: int, G: int, length: int):
    """Each step's (seconds, recorded requests, episodes) of vision_rollout against the server."""
    from data import load_rows
    from rollout import RolloutContext
    from vision import load_processor, vision_rollout
    from vllm_client import VLLMClient
    processor = load_processor(model)
    rows = load_rows("shapes", "train", "", "answer", steps * prompts, 0)
    out = []
    for step in range(steps):
        client = Recording(VLLMClient(port=port))
        ctx = RolloutContext(client, processor.tokenizer, G, dict(max_tokens=length, temperature=1.0), seed=step,
                             processor=processor)
        seconds, episodes = timed(vision_rollout, rows[step * prompts:(step + 1) * prompts], ctx)
        out.append((seconds, client.requests, episodes))
    return out


def generation_limit(model: str, steps: list[list[dict]]) -> list[float]:
    """Each step's conversations through vllm.LLM.chat, each sample its own request forced to its length."""
    from vllm import SamplingParams
    from limits import offline_engine
    llm = offline_engine(model, limit_mm_per_prompt={"image": 4})

    def run(requests):
        conversations = [r["messages"] for r in requests for _ in r["lengths"]]
        params = [SamplingParams(max_tokens=max(n, 1), min_tokens=n, ignore_eos=True, temperature=1.0, logprobs=0)
                  for r in requests for n in r["lengths"]]
        llm.chat(conversations, params, use_tqdm=False)

    run(steps[0])  # warm-up
    return [timed(run, requests)[0] for requests in steps]


def training(model: str, batches: list[list]) -> tuple[list[float], list[float]]:
    """Each batch of episodes through accumulate_gradients and through the bare forward+backward, alternating
    which goes first: (nanogrpo's seconds, the bare model's seconds) per batch."""
    import torch
    from config import Config
    from limits import compute_dtype
    from logprobs import length_sorted, positions, take, to_device, trim_padding
    from models import load_model
    from rollout import collate
    from train import accumulate_gradients
    policy = load_model(model, torch.device("cpu"))
    policy.config.use_cache = False
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if compute_dtype() == torch.bfloat16 else nullcontext()

    def bare(episodes):
        inputs, tokens = collate(episodes, 0)
        C = tokens["mask"].shape[1]
        for s in length_sorted(torch.arange(len(episodes)), inputs["attention_mask"].sum(dim=1), MICRO_BATCH_SIZE):
            part, c = trim_padding(take(inputs, s), C)
            part = to_device(part, "cpu")
            with autocast:
                logits = policy(**part, position_ids=positions(part), logits_to_keep=c + 1, use_cache=False).logits
                logits.sum().backward()
        policy.zero_grad(set_to_none=True)

    def nanogrpo(episodes):
        inputs, tokens = collate(episodes, 0)
        data = dict(inputs=inputs, loss_mask=tokens["mask"], advantages=torch.randn(len(episodes)), old_logp=None,
                    ref_logp=None, sampler_logp=tokens["sampler_logp"], keep=None)
        accumulate_gradients(policy, data, Config(micro_batch_size=MICRO_BATCH_SIZE), 1, autocast)
        policy.zero_grad(set_to_none=True)

    bare(batches[0]), nanogrpo(batches[0])  # warm-up
    ours, limit = [], []
    for i, episodes in enumerate(batches):
        for fn in ((bare, nanogrpo) if i % 2 else (nanogrpo, bare)):
            (limit if fn is bare else ours).append(timed(fn, episodes)[0])
    return ours, limit


def pixel_bytes(episodes) -> tuple[int, int]:
    """(bytes of pixel inputs a collated batch holds, bytes with a copy per episode)."""
    from rollout import collate
    inputs, _ = collate(episodes, 0)
    held = sum(v.values.nbytes for k, v in inputs.items() if k not in ("input_ids", "attention_mask"))
    dense = sum(v.values[0].nbytes * len(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask"))
    return held, dense


def ratio_line(what: str, ours: list[float], limit: list[float]) -> str:
    later = list(zip(ours, limit))[1:] or list(zip(ours, limit))
    a, b = sum(x for x, _ in later), sum(y for _, y in later)
    return f"  {what}, steps after the first: {a:.2f}s / {b:.2f}s = {a / b:.2f}"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.set_defaults(model="smollm2-vision", length=12)
    p.add_argument("--replay", help=argparse.SUPPRESS)  # the limit's own process: a file of recorded requests
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    from embedded import resolve_model
    model = resolve_model(a.model)
    replay_if_asked(a.replay, generation_limit, model)
    with tempfile.TemporaryDirectory() as tmp:
        with serving(model, tmp) as server:
            steps = rollouts(model, server["port"], a.steps, a.prompts, a.G, a.length)
        replayed_seconds = replayed(__file__, ["--model", a.model], [requests for _, requests, _ in steps], tmp)
    ours, bare = training(model, [episodes for _, _, episodes in steps])
    held, dense = pixel_bytes(steps[0][2])
    print(f"{a.model} | {a.prompts} prompts with an image x G={a.G}, up to {a.length} tokens | {os.cpu_count()} CPUs")
    print(f"  {'step':>4s} {'rollout':>8s} {'vllm.LLM':>8s} {'ratio':>6s} {'train':>7s} {'bare':>7s} {'ratio':>6s}")
    for i, ((seconds, _, _), best, t, b) in enumerate(zip(steps, replayed_seconds, ours, bare)):
        print(f"  {i + 1:4d} {seconds:7.2f}s {best:7.2f}s {seconds / best:6.2f} {t:6.2f}s {b:6.2f}s {t / b:6.2f}"
              + ("  (warm-up)" if i == 0 else ""))
    print(ratio_line("generation with images vs vllm.LLM", [s for s, _, _ in steps], replayed_seconds))
    print(ratio_line("forward+backward with images vs the bare model's", ours, bare))
    print(f"  pixel inputs of a step's batch: {held / 2**20:.2f} MiB held, {dense / 2**20:.2f} MiB with a copy per "
          f"episode ({dense / held:.1f}x)")
