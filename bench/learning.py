"""Does the default run learn the task? Starts one vllm_server.py, runs train.py with its defaults (the
embedded model on the embedded arithmetic task) once per seed against it, and prints the held-out
evaluation before and after training for each seed: accuracy (pass@1: the accuracy reward's mean over
the held-out problems x samples) and the format reward, then their mean and spread over the seeds,
and each run's wall time (server start not included: the server is started once).

    .venv/bin/python bench/learning.py                    # seeds 42, 43, 44: the default run 3 times
    .venv/bin/python bench/learning.py --seeds 1 -- --learning_rate 1e-5   # after --: any train.py flags
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, free_port, serving


def run(port: int, out: str, seed: int, flags: list[str]) -> tuple[list[dict], float]:
    """train.py with its defaults and `flags`: its evaluations (metrics rows with eval/ keys) and wall time."""
    import json

    from utils import stop_process_group
    t = time.perf_counter()
    with open(out + ".log", "w+") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--vllm_server_port", str(port),
                                 "--vllm_group_port", str(free_port()), "--output_dir", out, "--seed", str(seed),
                                 "--no_save_model", *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait()
        finally:
            stop_process_group(proc)
        if proc.returncode:
            log.seek(0)
            raise RuntimeError(f"train.py failed ({proc.returncode}):\n{log.read()[-4000:]}")
        log.seek(0)
        print(" ", log.read().strip().splitlines()[-1], flush=True)  # train.py's summary line
    with open(os.path.join(out, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, filter(str.strip, f)) if "eval/reward" in r]
    return evals, time.perf_counter() - t


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"mean {statistics.mean(values):+.3f}  std {sd:.3f}  min {min(values):+.3f}  max {max(values):+.3f}"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="runs, with seeds 42, 43, ...")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--keep", default="", help="a folder to keep the runs in (logs, metrics, rollouts); default: none")
    p.add_argument("flags", nargs="*", help="train.py flags, after --")
    args = p.parse_args()
    keys = {"accuracy": "eval/rewards/accuracy", "format": "eval/rewards/format"}
    results = {name: [] for name in keys}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, serving(args.model, args.keep or tmp) as server:
        work = args.keep or tmp
        print(f"train.py defaults{' + ' + shlex.join(args.flags) if args.flags else ''}, {args.seeds} seed(s)")
        for seed in range(42, 42 + args.seeds):
            evals, seconds = run(server["port"], os.path.join(work, f"seed{seed}"), seed,
                                 ["--model", args.model, *args.flags])
            first, last = evals[0], evals[-1]
            line = []
            for name, key in keys.items():
                results[name].append((first[key], last[key]))
                line.append(f"{name} {first[key]:.3f} -> {last[key]:.3f} ({last[key] - first[key]:+.3f})")
            print(f"seed {seed}: {', '.join(line)} | steps {first['step']} -> {last['step']}, "
                  f"{int(last['eval/num_prompts'])} problems | {seconds / 60:.1f} min", flush=True)
    for name, pairs in results.items():
        gains = [b - a for a, b in pairs]
        print(f"{name:8s} before {statistics.mean(a for a, _ in pairs):.3f}, after {statistics.mean(b for _, b in pairs):.3f}"
              f" | gain {spread(gains)} | improved in {sum(g > 0 for g in gains)} of {len(gains)} seeds")
