"""Where a training step's time goes: starts vllm_server.py on the model, runs train.py for a few
steps, and prints the mean time of each phase over the steps after the first (which warms up):
generate, score, old/ref log-probs, train (forward + backward, and the optimizer within it), weight
sync (the push) and the sync probe, which with the rest of the loop ("other": batching, logging,
waiting for other ranks) make train.py's time/step. With --compare FLAGS, a second run with those flags against the same
server, and the ratio of their step times. With --split_cores the server runs on one half of the cores
and the trainer on the other, as when each has devices of its own (async generation can overlap them).

    .venv/bin/python bench/step_breakdown.py                              # SmolLM2, 8 prompts x G=8, 128 tokens
    .venv/bin/python bench/step_breakdown.py --nproc 2 -- --beta 0.04     # after --: any train.py flags
    .venv/bin/python bench/step_breakdown.py --compare=--async_generation    # "=": the value starts with --
    .venv/bin/python bench/step_breakdown.py --split_cores --compare=--async_generation
"""
import argparse
import os
import shlex
import tempfile

from common import PHASES, mean, serving, split_cores, steady, train, workload_arguments


def report(title: str, metrics: list[dict], peak: float, prompts: int, G: int):
    rows = steady(metrics)
    step = mean(rows, "time/step")
    print(f"{title}: mean over steps {rows[0]['step']}-{rows[-1]['step']}, completions of "
          f"{mean(rows, 'completion_length'):.0f} tokens on average, {prompts * G} per step; trainer peak RSS {peak:.1f} GiB")
    for phase in PHASES:
        print(f"  {phase:10s} {mean(rows, f'time/{phase}'):7.2f} s  {100 * mean(rows, f'time/{phase}') / step:5.1f}%")
        if phase == "train":
            print(f"   optimizer {mean(rows, 'time/optimizer'):7.2f} s")
    other = step - sum(mean(rows, f"time/{p}") for p in PHASES)
    print(f"  {'other':10s} {other:7.2f} s  {100 * other / step:5.1f}%\n  {'step':10s} {step:7.2f} s")
    return step, max(mean(rows, "time/generate"), mean(rows, "time/train"))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--compare", default=None, help="train.py flags of a second run, compared with the first")
    p.add_argument("--split_cores", action="store_true", help="server and trainer on separate halves of the cores")
    p.add_argument("train_flags", nargs="*", help="more train.py flags for every run, after --")
    a = p.parse_args()
    from embedded import resolve_model
    model = resolve_model(a.model)
    print(f"{a.model} | {a.nproc} process(es) | {a.prompts} prompts x G={a.G}, up to {a.length} tokens | {a.steps} steps "
          f"| flags {' '.join(a.train_flags) or '(defaults)'}")
    server_cores, trainer_cores = split_cores() if a.split_cores else (None, None)
    if a.split_cores:
        print(f"server on cores {sorted(server_cores)}, trainer on cores {sorted(trainer_cores)}")
    with tempfile.TemporaryDirectory() as tmp, serving(model, tmp, cores=server_cores) as server:
        runs = [("base", a.train_flags)] + ([(a.compare, a.train_flags + shlex.split(a.compare))] if a.compare else [])
        steps = []
        for i, (title, flags) in enumerate(runs):
            metrics, peak = train(model, server["port"], os.path.join(tmp, f"run{i}"), a.steps, a.prompts, a.G, a.length,
                                  a.nproc, tuple(flags), trainer_cores)
            steps.append(report(title, metrics, peak, a.prompts, a.G))
        print(f"server peak RSS {server['memory'].peak:.1f} GiB")
    if a.compare:
        print(f"step time {a.compare} / base: {steps[1][0] / steps[0][0]:.2f}; "
              f"{a.compare} step / max(generate, train) of base: {steps[1][0] / steps[0][1]:.2f}")
