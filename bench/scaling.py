"""How nanogrpo's step time grows: 1 against 2 trainer processes, G of 4, 8 and 16, completion lengths
of 64, 128 and 256 tokens (8 prompts per step otherwise), each run against the same server, one after
the other. Prints each run's phases (mean over the steps after the first; "other" is the rest of the
step: batching, logging, waiting for the other rank) and its step time over the base run's (1 process,
G=8, 128 tokens).

    .venv/bin/python bench/scaling.py [--steps 3] [--runs 1:8:128,2:8:128] [-- more train.py flags]
"""
import argparse
import os
import tempfile

from common import PHASES, mean, serving, steady, train

RUNS = "1:8:128,2:8:128,1:4:128,1:16:128,1:8:64,1:8:256"  # processes:G:completion length; the first is the base

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--runs", default=RUNS, help="comma-separated processes:G:length; the first is the base")
    p.add_argument("train_flags", nargs="*", help="more train.py flags for every run, after --")
    a = p.parse_args()
    from embedded import resolve_model
    model = resolve_model(a.model)
    print(f"{a.model} | {a.prompts} prompts per step | {a.steps} steps per run | flags {' '.join(a.train_flags) or '(defaults)'}")
    print(f"  {'procs':>5s} {'G':>3s} {'max len':>7s} {'mean len':>8s} " + " ".join(f"{p:>8s}" for p in PHASES)
          + f" {'other':>8s} {'step':>7s} {'vs base':>7s} {'peak GiB':>8s}")
    base = None
    with tempfile.TemporaryDirectory() as tmp, serving(model, tmp) as server:
        for i, (nproc, G, length) in enumerate(tuple(map(int, run.split(":"))) for run in a.runs.split(",")):
            metrics, peak = train(model, server["port"], os.path.join(tmp, f"run{i}"), a.steps, a.prompts, G, length, nproc,
                                  tuple(a.train_flags))
            rows = steady(metrics)
            step = mean(rows, "time/step")
            base = base or step
            other = step - sum(mean(rows, f"time/{p}") for p in PHASES)
            print(f"  {nproc:5d} {G:3d} {length:7d} {mean(rows, 'completion_length'):8.0f} "
                  + " ".join(f"{mean(rows, f'time/{p}'):7.2f}s" for p in PHASES)
                  + f" {other:7.2f}s {step:6.1f}s {step / base:7.2f} {peak:8.1f}", flush=True)
