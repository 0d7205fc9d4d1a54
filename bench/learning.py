"""Does the default run learn the task? Starts one vllm_server.py, runs train.py with its defaults (the
embedded model on the embedded arithmetic task) once per seed against it, and prints the held-out
evaluation before and after training for each seed: the mean of each reward over the held-out prompts x
samples (accuracy is pass@1), then their mean and spread over the seeds, and each run's wall time (server
start not included: the server is started once). With --env, an embedded environment (README: Environments
and tools) instead, also printing the held-out tool calls per trajectory and the share of them that worked
(well-formed: read, a known tool, right arguments), before and after; for the guess game also the mean number of
guesses to find the number (a game not found counts as 6) and the share of games won.

    .venv/bin/python bench/learning.py                    # seeds 42, 43, 44: the default run 3 times
    .venv/bin/python bench/learning.py --env calculator   # three-digit sums with a calculator (the tool model)
    .venv/bin/python bench/learning.py --env guess        # the embedded guess game, 3 times
    .venv/bin/python bench/learning.py -- --dataset shapes   # the embedded vision task (its VLM), 3 times
    .venv/bin/python bench/learning.py -- --dataset arithmetic,parity   # a mixture: each task's rewards
    .venv/bin/python bench/learning.py --seeds 5                   # seeds 42 to 46
    .venv/bin/python bench/learning.py --seed 43                   # seed 43 once
    .venv/bin/python bench/learning.py --seeds 42 42 42            # one seed 3 times: how much a run repeats
    .venv/bin/python bench/learning.py --seeds 1 -- --learning_rate 1e-5   # after --: any train.py flags
    .venv/bin/python bench/learning.py --seeds 42 42 --server_args="--dtype float32"   # vllm serve flags
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
    """train.py with its defaults and `flags`: its metrics rows (the evaluations among them) and wall time."""
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
        return [json.loads(line) for line in f if line.strip()], time.perf_counter() - t


def guesses_to_find(out: str, step: int, most: int = 5) -> tuple[float, float]:
    """The embedded guess game's held-out games at the evaluation of `step`: the share in which the number was found,
    and the mean number of guesses it took to find it, a game not found counting as `most` + 1 (one more than the
    rounds of calls it may make)."""
    import json
    import re
    counts = []
    with open(os.path.join(out, "rollouts.jsonl")) as f:
        for record in map(json.loads, f):
            if record["split"] == "eval" and record["step"] == step:
                answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", record["completion"], re.S)
                counts.append(answers.index("found it") + 1 if "found it" in answers else most + 1)
    return sum(c <= most for c in counts) / len(counts), statistics.mean(counts)


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"mean {statistics.mean(values):+.3f}  std {sd:.3f}  min {min(values):+.3f}  max {max(values):+.3f}"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # --seed is not --seeds
    p.add_argument("--seeds", type=int, nargs="+",
                   help="one number: that many runs (20 at most), with seeds 42, 43, ...; several: those seeds, "
                        "repeats allowed")
    p.add_argument("--seed", type=int, help="one seed, run once")
    p.add_argument("--model", default="", help="default: the model the flags run (the embedded one)")
    p.add_argument("--keep", default="", help="a folder to keep the runs in (logs, metrics, rollouts); default: none")
    p.add_argument("--env", default="", help="an embedded environment (calculator, guess) or module:factory")
    p.add_argument("--server_args", default="", help="vllm serve flags for the server, e.g. --dtype float32")
    p.add_argument("flags", nargs="*", help="train.py flags, after --")
    args = p.parse_args()
    given = args.seeds or [3]  # the default: 3 runs
    if args.seed is not None:
        if args.seeds is not None or args.seed < 0:
            p.error(f"--seed {args.seed}: one seed (0 or more), run once; not with --seeds")
        seeds = [args.seed]
    elif len(given) == 1:  # a number of runs, seeds 42, 43, ...
        n = given[0]
        if not 1 <= n <= 20:  # a seed given for a count would be hours of runs
            p.error(f"--seeds {n} is a number of runs, 1 to 20" + (f" ({n}: seeds 42 to {41 + n})" if n > 20 else "")
                    + f". For seed {n} once, give --seed {n}; for it several times, --seeds {n} {n} {n}")
        seeds = list(range(42, 42 + n))
    else:
        if min(given) < 0:
            p.error(f"--seeds {' '.join(map(str, given))}: seeds are 0 or more")
        seeds = given
    from config import parse_config
    from embedded import resolve_model
    flags = [*(["--env", args.env] if args.env else []), *args.flags]
    model = args.model or parse_config(flags).model  # e.g. the embedded VLM for --dataset shapes
    flags = ["--model", model, *flags]
    results = {}  # reward name -> [(before, after) per seed]
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, serving(resolve_model(model), args.keep or tmp,
                                                            *shlex.split(args.server_args)) as server:
        work = args.keep or tmp
        print(f"train.py defaults + {shlex.join(flags)}, seeds {seeds}, server flags: {args.server_args or 'none'}")
        for i, seed in enumerate(seeds):
            rows, seconds = run(server["port"], os.path.join(work, f"run{i + 1}-seed{seed}"), seed, flags)
            evals, steps = [r for r in rows if "eval/reward" in r], [r for r in rows if "loss" in r]
            first, last = evals[0], evals[-1]
            line = []
            per_task = any(k.startswith("eval/task/") for k in first)  # a mixture: each task's own rewards
            for key in sorted(k for k in first if k.startswith("eval/task/" if per_task else "eval/rewards/")
                              and "/rewards/" in k):
                name = key.removeprefix("eval/task/" if per_task else "eval/rewards/").replace("/rewards/", "/")
                results.setdefault(name, []).append((first[key], last[key]))
                line.append(f"{name} {first[key]:.3f} -> {last[key]:.3f} ({last[key] - first[key]:+.3f})")
            if "eval/tools/calls" in first:  # held out: tool calls per trajectory, and the share that worked
                calls = [(r["eval/tools/calls"], 1 - (r["eval/tools/failed_calls"] + r.get("eval/tools/timeouts", 0))
                          / max(r["eval/tools/calls"], 1e-9)) for r in (first, last)]  # (a time-out did not work)
                line.append(f"tool calls {calls[0][0]:.2f} -> {calls[1][0]:.2f} (well-formed {calls[0][1]:.2f} -> "
                            f"{calls[1][1]:.2f})")
                results.setdefault("calls", []).append((calls[0][0], calls[1][0]))
            if args.env == "guess":  # the game: guesses to find the number (not found: 6)
                (found, guesses), (found_after, guesses_after) = [
                    guesses_to_find(os.path.join(work, f"run{i + 1}-seed{seed}"), r["step"]) for r in (first, last)]
                line.append(f"found {found:.2f} -> {found_after:.2f}, guesses to find it {guesses:.2f} -> "
                            f"{guesses_after:.2f}")
                results.setdefault("guesses", []).append((guesses, guesses_after))
            print(f"seed {seed}: {', '.join(line)} | steps {first['step']} -> {last['step']}, "
                  f"{int(last['eval/num_prompts'])} prompts | {seconds / 60:.1f} min", flush=True)
    for name, pairs in results.items():
        gains = [b - a for a, b in pairs]
        print(f"{name:8s} before {statistics.mean(a for a, _ in pairs):.3f}, after {statistics.mean(b for _, b in pairs):.3f}"
              f" | gain {spread(gains)} | rose in {sum(g > 0 for g in gains)} of {len(gains)} seeds")
