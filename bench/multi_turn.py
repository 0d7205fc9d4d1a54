"""A multi-turn step's generation against vLLM's offline engine doing the same turn-by-turn requests. One
invocation runs, one after the other (never at once: they share the CPU):

  1. tools.tool_rollout (the rollout of --tools and --env) with an environment, against vllm_server.py, for
     --steps steps of --prompts rows x G trajectories: every turn is a request per live trajectory (each with a
     seed of its own), sent together; then the tools run and the chat template renders the next turn. Each turn
     is recorded. The embedded environments run with `prefill` on: each call turn starts with the call's opening
     (their turn_prefix), so that any model's turns (a tiny random one's, the base SmolLM2's, which writes no call
     of its own) continue calls and come after the tools' answers.
  2. the limit: vllm.LLM (no HTTP server, no trainer, no tools, no template) in a fresh process, replaying
     the recorded turns in order, each turn's prompts in one call, each completion forced to the length it had
     (ignore_eos, min_tokens).

It prints, per step after the first (which warms up), the rollout's wall time, the replay's and the ratio.

    .venv/bin/python bench/multi_turn.py [--env guess --steps 3 --prompts 8 --G 8 --length 160]
"""
import argparse
import os
import sys
import tempfile

from common import ROOT, replay_if_asked, replayed, serving, timed, workload_arguments

sys.path.insert(0, os.path.join(ROOT, "bench"))


class Recording:
    """The server's client, recording each turn's requests (one per live trajectory, sent together): their prompts and
    the length of every sample."""

    def __init__(self, client):
        self.client, self.requests = client, []

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        samples = self.client.generate_each(prompts, max_tokens, seeds, **sampling)
        self.requests.append({"prompts": prompts, "lengths": [len(s["token_ids"]) for s in samples], "n": 1})
        return samples


def rollouts(model: str, port: int, env: str, steps: int, prompts: int, G: int, length: int) -> list[dict]:
    """Each step: {"seconds": the rollout's wall time, "requests": what it asked the server, "turns", "calls"}."""
    from transformers import AutoTokenizer
    from config import EMBEDDED_ENVIRONMENTS
    from data import load_rows
    from rollout import RolloutContext
    from tools import load_callables, tool_rollout
    from vllm_client import VLLMClient
    factory = load_callables(EMBEDDED_ENVIRONMENTS.get(env, (env,))[0], "--env")[0]
    if hasattr(factory, "prefill"):  # an embedded environment: its call turns opened, whatever the model
        factory = type(factory.__name__, (factory,), {"prefill": True})
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = load_rows("none", "train", "", "", 0, 0, num_starts=steps * prompts) if env == "guess" else \
        load_rows("arithmetic", "train", "", "", steps * prompts, 0)
    out = []
    for step in range(steps):
        client = Recording(VLLMClient(port=port))
        ctx = RolloutContext(client, tokenizer, G, dict(max_tokens=length, temperature=1.0), seed=step)
        seconds, episodes = timed(tool_rollout, rows[step * prompts:(step + 1) * prompts], ctx, env_factory=factory)
        out.append({"seconds": seconds, "requests": client.requests, "turns": len(client.requests),
                    "calls": sum(e.info["tool_calls"] for e in episodes) / len(episodes),
                    "model_tokens": sum(sum(e.sampled) for e in episodes) / len(episodes)})
    return out


def replay(model: str, steps: list[dict]) -> list[float]:
    """Each step's requests through vllm.LLM, in order: its seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from limits import offline_engine
    llm = offline_engine(model)

    def run(request):
        prompts = [p for p in request["prompts"] for _ in range(request["n"])]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     [SamplingParams(max_tokens=max(n, 1), min_tokens=n, ignore_eos=True, temperature=1.0, logprobs=0)
                      for n in request["lengths"]], use_tqdm=False)

    run(next(r for step in steps for r in step["requests"]))  # warm-up (main() checked there is one)
    return [timed(lambda: [run(r) for r in step["requests"]])[0] for step in steps]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p, steps=3)
    p.set_defaults(length=160)
    p.add_argument("--env", default="guess", help="an embedded environment (calculator, guess) or module:factory")
    p.add_argument("--replay", help=argparse.SUPPRESS)  # the limit's own process: a file of recorded steps
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    from embedded import resolve_model
    model = resolve_model(a.model)
    replay_if_asked(a.replay, replay, model)
    with tempfile.TemporaryDirectory() as tmp:
        with serving(model, tmp) as server:
            steps = rollouts(model, server["port"], a.env, a.steps, a.prompts, a.G, a.length)
        if not any(step["requests"] for step in steps):
            raise SystemExit(f"no trajectory went on after its given first turn: raise --length ({a.length})")
        limit = replayed(__file__, ["--model", a.model], steps, tmp)
    print(f"{a.model} | --env {a.env} | {a.prompts} rows x G={a.G}, up to {a.length} tokens per trajectory | "
          f"{os.cpu_count()} CPUs")
    print(f"  {'step':>4s} {'turns':>5s} {'calls':>5s} {'tokens':>6s} {'rollout':>8s} {'vllm.LLM':>8s} {'ratio':>6s}")
    for i, (step, best) in enumerate(zip(steps, limit)):
        print(f"  {i + 1:4d} {step['turns']:5d} {step['calls']:5.2f} {step['model_tokens']:6.1f} "
              f"{step['seconds']:7.2f}s {best:7.2f}s {step['seconds'] / best:6.2f}" + ("  (warm-up)" if i == 0 else ""))
    later = list(zip(steps, limit))[1:] or list(zip(steps, limit))
    ours, best = sum(s["seconds"] for s, _ in later), sum(b for _, b in later)
    print(f"  multi-turn generation vs vllm.LLM, steps after the first: {ours:.2f}s / {best:.2f}s = {ours / best:.2f}")
