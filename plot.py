"""A picture of a run: reward (and the evaluation's, and each task's in a mixture), each reward function, KL
and completion lengths over the steps, from output_dir/metrics.jsonl. train.py draws it at the end; for any
run folder:

    python plot.py out            # writes out/metrics.png
"""
import json
import os
import sys


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL log, read line by line; a line that is not whole JSON (a record cut short by a
    kill or a full disk) is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def had_reference(train: list[dict]) -> bool:
    """Whether a run's steps had a reference model, judged from them: a KL other than 0 at some step (with a
    reference, only the first step's is 0: the policy starts as the reference; null: no token trained that
    step; a run without one logs no KL, or, logged by an older version, 0)."""
    return any((r.get("kl") or 0) > 0 for r in train)


def plot_run(output_dir: str, reference: bool | None = None) -> str | None:
    """Writes output_dir/metrics.png and returns its path; None if no step has been logged yet. `reference`:
    whether the run had a reference model (--beta > 0); None: judged from the log (a KL of 0 at every
    step)."""
    fig = draw(read_jsonl(os.path.join(output_dir, "metrics.jsonl")), reference)
    if fig is None:
        return None
    fig.suptitle(os.path.abspath(output_dir))
    out = os.path.join(output_dir, "metrics.png")
    fig.savefig(out + ".tmp.png", dpi=100)
    os.replace(out + ".tmp.png", out)  # a reader never sees half a picture
    return out


def draw(rows: list[dict], reference: bool | None = None):
    """The figure of a run's log records (four panels), or None if no step was logged. A matplotlib Figure of
    its own, not pyplot's: nothing global, no display (matplotlib is imported here, by a run that draws)."""
    from matplotlib.figure import Figure
    train, evals = [r for r in rows if "reward" in r], [r for r in rows if "eval/reward" in r]
    if not train:
        return None

    def series(rs, key):
        return [r["step"] for r in rs if key in r], [r[key] for r in rs if key in r]

    fig = Figure(figsize=(11, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    ax = axes[0, 0]
    ax.plot(*series(train, "reward"), label="train")
    if evals:
        ax.plot(*series(evals, "eval/reward"), "o-", label="held-out")
    tasks = sorted({k.split("/")[1] for r in train for k in r if k.startswith("task/") and k.endswith("/prompts")})
    # In a mixture, each task's reward (its own functions and weights), and its held-out one.
    for task in tasks:
        line, = ax.plot(*series(train, f"task/{task}/reward"), alpha=0.7, label=task)
        if evals:
            ax.plot(*series(evals, f"eval/task/{task}/reward"), "o--", color=line.get_color(),
                    label=f"{task} (held-out)")
    ax.set_title("reward" + (" (and each task's)" if tasks else ""))
    ax = axes[0, 1]
    for key in sorted(k for k in train[-1] if k.startswith("rewards/") and not k.endswith(("_std", "_nan_frac"))):
        name = key.removeprefix("rewards/")
        line, = ax.plot(*series(train, key), label=name)
        if evals:  # the held-out evaluation of the same function: dots joined in the same colour
            ax.plot(*series(evals, "eval/" + key), "o--", color=line.get_color(), label=f"{name} (held-out)")
    ax.set_title("reward of each function (dots: held-out)")
    ax = axes[1, 0]
    reference = had_reference(train) if reference is None else reference
    if reference:
        ax.plot(*series(train, "kl"), label="KL to the reference")
    else:  # no KL term to draw: a flat 0 would read as a KL that stayed 0
        ax.text(0.5, 0.92, "no KL: no reference model (--beta 0)", transform=ax.transAxes, ha="center",
                color="gray")
    ax.plot(*series(train, "entropy"), label="entropy")
    ax.set_title("KL and entropy (per token)" if reference else "entropy (per token)")
    ax = axes[1, 1]
    for suffix, label in (("", "mean"), ("_min", "min"), ("_max", "max")):
        ax.plot(*series(train, f"completion_length{suffix}"), label=label)
    ax.set_title("completion length (tokens)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return fig


if __name__ == "__main__":
    for folder in sys.argv[1:] or ["out"]:
        print(plot_run(folder) or f"{folder}: no steps logged yet")
