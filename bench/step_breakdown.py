"""Where a training step's time goes: starts vllm_server.py on the model, runs train.py for a few
steps, and prints the mean time of each phase over the steps after the first (which warms up):
generate, score, old/ref log-probs, train (forward + backward + optimizer) and weight sync, which
together make train.py's time/step.

    .venv/bin/python bench/step_breakdown.py                              # SmolLM2, 8 prompts x G=8, 128 tokens, bf16
    .venv/bin/python bench/step_breakdown.py --nproc 2 -- --beta 0.04     # after --: any train.py flags
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PHASES = ("generate", "score", "old_ref", "train", "sync")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str, steps: int, prompts: int, G: int, length: int, nproc: int, train_flags: list[str], workdir: str) -> list[dict]:
    """The metrics of each step of a train.py run against a server of its own (stopped by its process group)."""
    from utils import stop_process_group
    from vllm_server import VLLMClient
    port = free_port()
    log = open(os.path.join(workdir, "server.log"), "w")
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "vllm_server.py"), "--model", model, "--port", str(port),
                               "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        VLLMClient(port=port).wait_for_health(600)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                     str(free_port())] if nproc > 1 else [sys.executable])
        out = os.path.join(workdir, "out")
        subprocess.run([*launcher, os.path.join(ROOT, "train.py"), "--model", model, "--vllm_server_port", str(port),
                        "--vllm_group_port", str(free_port()), "--output_dir", out, "--max_steps", str(steps),
                        "--prompts_per_step", str(prompts), "--num_generations", str(G), "--max_completion_length",
                        str(length), "--no_save_model", *train_flags], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    finally:
        stop_process_group(server, timeout=60)
        log.close()


def breakdown(metrics: list[dict]) -> dict[str, float]:
    """Mean seconds per phase over the steps after the first."""
    rows = [m for m in metrics if "time/step" in m][1:] or [m for m in metrics if "time/step" in m]
    return {p: sum(m[f"time/{p}"] for m in rows) / len(rows) for p in (*PHASES, "step")}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("train_flags", nargs="*", help="more train.py flags, after --")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        metrics = run(a.model, a.steps, a.prompts, a.G, a.length, a.nproc, a.train_flags, tmp)
        wall = time.perf_counter() - t
    mean = breakdown(metrics)
    tokens = sum(m["completion_length"] for m in metrics[1:]) / max(len(metrics) - 1, 1) * a.prompts * a.G
    print(f"{a.model} | {a.nproc} process(es) | {a.prompts} prompts x G={a.G}, up to {a.length} tokens "
          f"(mean {tokens / (a.prompts * a.G):.0f}) | {a.steps} steps, {wall:.0f}s with server start | "
          f"flags {' '.join(a.train_flags) or '(defaults)'}")
    for phase in (*PHASES, "step"):
        print(f"  {phase:9s} {mean[phase]:7.2f} s  {100 * mean[phase] / mean['step']:5.1f}%")
