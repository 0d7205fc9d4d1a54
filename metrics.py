"""What a run reports: the console line, metrics.jsonl and rollouts.jsonl (one line per step, written so a
crash never tears them), wandb, the step's metrics built from its sums, evaluation's pass@k, and the checks
that stop a run whose loss goes non-finite or whose reward functions stop scoring. Not here: the plot of a
finished run (plot.py).
"""
import errno
import json
import math
import os
import time
from contextlib import contextmanager

import torch

from config import RunStopped
from data import columns_of
from plot import read_jsonl
from utils import CLOSE_AT_EXIT, extremes_over_ranks, gather_lines, print0, sum_over_ranks

LOGS = ("metrics.jsonl", "rollouts.jsonl")  # the logs a run writes in its output folder, a JSON record a line


def progress(done: int, total: int, seconds: float, width: int = 20) -> str:
    """A progress bar with elapsed and remaining time: "[########------------] 40% 2m05s<3m08s"."""
    fill = round(width * done / max(total, 1))
    left = seconds / max(done, 1) * (total - done)
    clock = lambda t: f"{int(t // 60)}m{int(t % 60):02d}s"  # noqa: E731
    return f"[{'#' * fill}{'-' * (width - fill)}] {100 * done / max(total, 1):.0f}% {clock(seconds)}<{clock(left)}"


def merge_stats(total: dict, new: dict):
    """Add `new` into `total` in place: names ending in _max keep the maximum, _min the minimum, others add
    up."""
    for k, v in new.items():
        if k not in total:
            total[k] = v
        else:
            total[k] = (max(total[k], v) if k.endswith("_max") else min(total[k], v) if k.endswith("_min")
                        else total[k] + v)


def named_rewards(row: torch.Tensor, names: list[str]) -> dict:
    """One completion's rewards as {function name: value}, None for not scored (NaN is not JSON)."""
    return {name: None if math.isnan(v) else v for name, v in zip(names, row.tolist())}


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """On rank 0, each key's mean over the ranks that have it (ranks may have different keys); {}
    elsewhere."""
    parts = [json.loads(line) for line in gather_lines([json.dumps(values)])]
    keys = dict.fromkeys(k for part in parts for k in part)
    return {k: sum(p[k] for p in parts if k in p) / sum(k in p for p in parts) for k in keys}


def keep_steps_up_to(path: str, step: int, to: str | None = None) -> int:
    """Write the records of a JSONL log up to `step` (dropping those after it, which a resumed run writes
    again, and any line that is not whole JSON: a record cut short by a kill or a full disk) to `to` (default:
    in place), through a copy that then takes its name. Reads a line at a time: rollouts.jsonl can be large.
    Returns how many cut lines were dropped."""
    to = to or path
    torn = 0
    with open(path) as f, open(to + ".tmp", "w") as out:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if record["step"] <= step:
                out.write(line.rstrip("\n") + "\n")
    os.replace(to + ".tmp", to)
    return torn


def append_lines(f, lines: list[str]):
    """Append whole lines to `f` (a file opened "ab" without buffering) in one write. If the write fails (a
    full disk, a size limit), the file is cut back to where it was and the error raised: a log never ends in
    half a record."""
    data = "".join(line + "\n" for line in lines).encode()
    end = f.seek(0, os.SEEK_END)
    try:
        if f.write(data) != len(data):
            raise OSError(errno.ENOSPC, f"only part of a record could be written to {f.name}")
    except BaseException:
        f.truncate(end)
        raise


def finite_json(record) -> str:
    """JSON that strict readers take (jq, JavaScript, pandas with strict parsing): a number that is not finite
    (NaN: not scored or nothing to average, inf) is written as null."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return [clean(v) for v in x] if isinstance(x, (list, tuple)) else x
    return json.dumps(clean(record), allow_nan=False, default=describe)


def describe(value) -> str:
    """A value JSON has no form for, as rollouts.jsonl shows it: an image by its size, bytes by their
    count."""
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"<image {value.mode} {value.size[0]}x{value.size[1]}>"
    return f"<{len(value)} bytes>" if isinstance(value, (bytes, bytearray)) else str(value)


class MetricsLogger:
    """metrics.jsonl (one JSON object per step), rollouts.jsonl (every completion: prompt, completion, each
    reward, advantage, finish reason, the policy version that sampled it), and optionally wandb with a
    completions table. Only rank 0 writes; log_rollouts is a collective (the other ranks send theirs)."""

    def __init__(self, output_dir: str, is_main: bool, report_to: str = "none", config: dict | None = None,
                 project: str = "nanogrpo", run_name: str = ""):
        self.file = self.rollouts = self.wandb = None
        if not is_main:
            return
        # prepare_output_dir has already cut a resumed run's logs back to its step: they are appended to.
        os.makedirs(output_dir, exist_ok=True)
        self.file, self.rollouts = (open(os.path.join(output_dir, name), "ab", buffering=0) for name in LOGS)
        if report_to == "wandb":
            import wandb
            self.wandb = wandb.init(project=project, name=run_name or None, config=config)
        # A run that stops mid-step (a signal, the server gone) still finishes wandb's run.
        CLOSE_AT_EXIT.append(self.close)

    def log(self, metrics: dict):
        if self.file is not None:
            append_lines(self.file, [finite_json(metrics)])
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["step"])

    def log_rollouts(self, records: list[dict]):
        """Called on every rank with its own records."""
        lines = gather_lines([finite_json(r) for r in records])
        if self.rollouts is None:
            return
        append_lines(self.rollouts, lines)
        if self.wandb is not None and lines:
            import wandb
            rows = [json.loads(line) for line in lines]
            columns = ["step", "split", "prompt", "completion", *rows[0]["rewards"], "reward", "advantage"]
            table = wandb.Table(columns=columns, data=[[r["step"], r["split"], r["prompt"], r["completion"],
                                                        *r["rewards"].values(), r["reward"], r.get("advantage")]
                                                       for r in rows])
            self.wandb.log({f"{rows[0]['split']}/completions": table}, step=rows[0]["step"])

    def close(self):
        for f in (self.file, self.rollouts):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None  # finished once, though the run's end and run_and_exit both close it


def eval_summary(output_dir: str, groups: dict[str, list[str]], samples: int) -> str | None:
    """One line comparing the run's first and last evaluation in output_dir/metrics.jsonl (a resumed run's
    too), e.g. `held-out accuracy 0.18 -> 0.41, format 0.10 -> 0.80 (52 problems x 4 samples, steps 0 -> 12)`;
    `groups`: the reward functions to show under each metric prefix ({"eval": names}, or in a mixture
    {"eval/task/<name>": its functions}, each shown as `<name>: ...`); None with fewer than two
    evaluations."""
    evals = [r for r in read_jsonl(os.path.join(output_dir, "metrics.jsonl")) if "eval/reward" in r]
    if len(evals) < 2:
        return None
    first, last = evals[0], evals[-1]
    parts = []
    for prefix, names in groups.items():
        change = ", ".join(f"{name} {first[f'{prefix}/rewards/{name}']:.2f} -> {last[f'{prefix}/rewards/{name}']:.2f}"
                           for name in names if f"{prefix}/rewards/{name}" in first)
        parts.append(change if prefix == "eval" else f"{prefix.rsplit('/', 1)[-1]}: {change}")
    return (f"held-out {'; '.join(parts)} ({int(last['eval/num_prompts'])} problems x {samples} samples, "
            f"steps {first['step']} -> {last['step']})")


class StepTimer:
    """Seconds spent in each phase of a step: lap(name) adds the time since the last lap to `name`;
    `with within(name)` adds the time of the block to `name` as a part of the phase around it."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds = {}

    def lap(self, name: str):
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    @contextmanager
    def within(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": self.last - self.start}


def mean_and_std(total: float, squares: float, n: float) -> tuple[float, float]:
    mean = total / max(n, 1.0)
    return mean, math.sqrt(max(squares / max(n, 1.0) - mean ** 2, 0.0))


def reward_metrics(rewards: torch.Tensor, reward_matrix: torch.Tensor, names: list[str], zero_std: torch.Tensor,
                   failures: int, own: torch.Tensor | None = None) -> dict:
    """The step's rewards over all ranks: the weighted sum's mean and std over the completions that have one
    and the share that has none (`unscored_frac`: no function scored them), each function's mean and std over
    the completions it scored and the share it did not score (NaN) of those it was to score (`own` (N, k): in
    a mixture, the rows of its tasks; else all), the share of groups without signal (`zero_std`, per
    completion), and the reward functions' failures so far."""
    own = torch.ones_like(reward_matrix, dtype=torch.bool) if own is None else own
    scored = ~reward_matrix.isnan() & own
    r = reward_matrix.where(scored, 0.0)
    t = sum_over_ranks({"n": len(rewards), "scored": (~rewards.isnan()).sum(), "reward": rewards.nansum(),
                        "sq": rewards.pow(2).nansum(), "zero_std": zero_std.sum(), "failures": failures,
                        **{f"r/{name}": r[:, i].sum() for i, name in enumerate(names)},
                        **{f"sq/{name}": r[:, i].pow(2).sum() for i, name in enumerate(names)},
                        **{f"n/{name}": scored[:, i].sum() for i, name in enumerate(names)},
                        **{f"own/{name}": own[:, i].sum() for i, name in enumerate(names)}})
    metrics = dict(zip(("reward", "reward_std"), mean_and_std(t["reward"], t["sq"], t["scored"])))
    metrics["unscored_frac"] = 1 - t["scored"] / t["n"]
    for name in names:  # NaN for a function whose tasks have no rows in this step (a mixture)
        metrics[f"rewards/{name}"], metrics[f"rewards/{name}_std"] = mean_and_std(t[f"r/{name}"], t[f"sq/{name}"],
                                                                                   t[f"n/{name}"]) \
            if t[f"own/{name}"] else (math.nan, math.nan)
        metrics[f"rewards/{name}_nan_frac"] = 1 - t[f"n/{name}"] / t[f"own/{name}"] if t[f"own/{name}"] else math.nan
    return {**metrics, "frac_zero_std_groups": t["zero_std"] / t["n"], "scorer_failures": t["failures"]}


class ScoringWatch:
    """Stops a run that goes on learning from nothing: counts the steps in a row in which a reward function
    failed (raised, hung) on every completion over all ranks (a judge whose endpoint went down), or in which
    no completion got any reward. The first such step of each prints a warning; `limit` steps in a row stop
    the run (0 = never). A function that returns None for every completion is not failing: it chose not to.
    `signal` warns of steps whose rewards were all alike."""

    NOTHING = "(no function)"

    def __init__(self, names: list[str], limit: int):
        self.limit, self.streak, self.warned = limit, dict.fromkeys([*names, self.NOTHING], 0), set()
        # The steps of this run, and the last of them in a row in which every group's rewards agreed.
        self.steps = self.agreed = 0

    def signal(self, frac_zero_std_groups: float, step: int, last: bool, first: int = 3):
        """Warns once when every group's rewards agreed in each of the run's `first` steps (or in every step
        of a shorter run): no advantage, so the policy has learned nothing from its rewards (TRL goes on
        without a word). Not later: a run that has learned may well see steps in which every group agrees."""
        self.steps += 1
        self.agreed = self.agreed + 1 if frac_zero_std_groups >= 1 else 0
        if self.agreed == self.steps and (self.agreed == first or last) and "signal" not in self.warned:
            self.warned.add("signal")
            print0(f"warning: in the first {self.agreed} steps (up to step {step}) every group's rewards agreed "
                   "(frac_zero_std_groups 1): no advantage, so nothing is learned from the rewards. They do not "
                   "tell this model's completions apart: check the reward functions on a few completions (rollouts"
                   ".jsonl), make the task fit the model, or raise --num_generations or --temperature")

    def update(self, failed: dict[str, int], attempted: dict[str, int], rewards: torch.Tensor, step: int):
        """failed[name] of attempted[name] completions (those of its tasks) this step, on this rank."""
        t = sum_over_ranks({"n": len(rewards), f"down/{self.NOTHING}": rewards.isnan().sum(),
                            f"of/{self.NOTHING}": len(rewards),
                            **{f"down/{name}": failed[name] for name in self.streak if name != self.NOTHING},
                            **{f"of/{name}": attempted[name] for name in self.streak if name != self.NOTHING}})
        for name in self.streak:
            if not t[f"of/{name}"]:  # no completion of its tasks this step: nothing to judge it by
                continue
            self.streak[name] = self.streak[name] + 1 if t[f"down/{name}"] == t[f"of/{name}"] else 0
            what = (f"reward function {name} failed on every completion" if name != self.NOTHING
                    else "no reward function scored any completion")
            if self.streak[name] and name not in self.warned:
                self.warned.add(name)
                print0(f"warning: {what} of step {step}: those completions teach nothing (unscored_frac, "
                       f"rewards/<name>_nan_frac, scorer_failures). The run stops after --max_unscored_steps "
                       f"{self.limit} such steps in a row.")
            if self.limit and self.streak[name] >= self.limit:
                raise RunStopped(f"{what} in {self.streak[name]} steps in a row (up to step {step}); nothing was "
                                 "learned from them. Fix the function (or the service it calls), or raise "
                                 "--max_unscored_steps (0 = never stop).")


def training_metrics(sums: dict, grad_norms: list[torch.Tensor], lengths: torch.Tensor, truncated: torch.Tensor,
                     diff: torch.Tensor, compared: torch.Tensor, kl: bool = True) -> dict:
    """The step's completions and updates over all ranks: lengths and truncation; the loss terms per token
    trained (`sums`: accumulate_gradients' sums of per-token statistics; the KL to the reference if `kl`,
    i.e. the run has a reference); the updates' loss and gradient
    norm; the sync comparison with the sampler (`diff` of the `compared` tokens); the importance ratios
    pi_old / pi_sampler before truncation or masking."""
    sums = dict(sums)
    ext = extremes_over_ranks({"length_min": lengths.min(), "length_max": lengths.max(), "diff_max": diff.max(),
                               **{k: sums.pop(k) for k in ("is_ratio_min", "is_ratio_max") if k in sums}})
    t = sum_over_ranks({"n": len(lengths), "length": lengths.sum(), "truncated": truncated.sum(), "diff": diff.sum(),
                        "compared": compared.sum(), **sums})
    N, T, norms = t["n"], t.get("tokens", 0.0), [g.item() for g in grad_norms]
    per_token = lambda k: t.get(k, 0.0) / T if T else math.nan  # NaN if no token trained (all dropped)
    metrics = {"completion_length": t["length"] / N, "completion_length_min": ext["length_min"],
               "completion_length_max": ext["length_max"], "truncated_frac": t["truncated"] / N,
               **({"kl": per_token("kl"), "kl_in_loss": per_token("kl_in_loss")} if kl else {}),
               "entropy": per_token("entropy"),
               **{f"clip_ratio/{k}": per_token(f"clip_{k}") for k in ("low", "high", "region")},
               "policy_masked_frac": per_token("policy_masked"),  # by the off-policy and high-entropy masks
               "loss": t.get("loss", 0.0) / len(norms), "grad_norm": sum(norms) / len(norms),
               "skipped_updates": sum(not math.isfinite(g) for g in norms),
               "sampler_logprob_diff_mean": t["diff"] / t["compared"] if t["compared"] else math.nan,
               "sampler_logprob_diff_max": ext["diff_max"] if t["compared"] else math.nan}
    if "is_ratio" in t and t["tokens"] > 0:
        metrics |= {"is_ratio/mean": t["is_ratio"] / T, "is_ratio/min": ext["is_ratio_min"],
                    "is_ratio/max": ext["is_ratio_max"], "is_ratio/dropped_frac": t["is_dropped"] / T}
    return metrics


def rollout_records(episodes, texts: list[str], reward_matrix: torch.Tensor, names: list[str], rewards: torch.Tensor,
                    tokenizer, prompt_index: list[int], extra: dict | None = None, advantages=None,
                    **fields) -> list[dict]:
    """One rollouts.jsonl record per episode: `fields` (step, split, policy version, rank), the prompt as the
    model saw it, the row's other columns, the completion, each reward (None = not scored), their weighted
    sum, the advantage, and what reward functions logged with log_extra."""
    return [{**fields, "prompt_index": prompt_index[i], "prompt": tokenizer.decode(e.prompt_ids),
             "columns": columns_of(e.row), "completion": texts[i], "rewards": named_rewards(reward_matrix[i], names),
             "reward": None if rewards[i].isnan() else rewards[i].item(),
             **({} if advantages is None else {"advantage": advantages[i].item()}),
             "finish_reason": e.finish_reason, "completion_tokens": len(e.completion_ids),
             **{column: values[i] for column, values in (extra or {}).items()}}
            for i, e in enumerate(episodes)]


def eval_line(step: int, metrics: dict, pass_k: list[int], tasks: list[str]) -> str:
    """An evaluation's console line; a mixture's tasks too: `| arithmetic reward 0.61 pass@1 0.08 ...`."""
    return (f"eval at step {step} | reward {metrics['eval/reward']:.3f} | "
            + " ".join(f"pass@{k} {metrics[f'eval/pass@{k}']:.3f}" for k in pass_k)
            + "".join(f" | {t} reward {metrics[f'eval/task/{t}/reward']:.3f} pass@1 "
                      f"{metrics[f'eval/task/{t}/pass@1']:.3f}" for t in tasks if f"eval/task/{t}/reward" in metrics))


def console_line(metrics: dict, names: list[str], max_steps: int) -> str:
    """step 3/12 | reward 0.412 ±0.301 | accuracy 0.25 format 0.16 | kl 0.0012 | len 31 | gen 16.1s score ...;
    in a mixture, each task's reward after the functions' (| arithmetic 0.41 parity 0.30); kl only with a
    reference model."""
    tasks = [k.split("/")[1] for k in metrics if k.startswith("task/") and k.endswith("/prompts")]
    return (f"step {metrics['step']}/{max_steps} | reward {metrics['reward']:.3f} ±{metrics['reward_std']:.3f} | "
            + " ".join(f"{name} {metrics[f'rewards/{name}']:.2f}" for name in names)
            + "".join(f"{' |' if i == 0 else ''} {t} {metrics.get(f'task/{t}/reward', math.nan):.2f}"
                      for i, t in enumerate(tasks))
            + (f" | kl {metrics['kl']:.4f}" if "kl" in metrics else "")
            + f" | len {metrics['completion_length']:.0f} | "
            + " ".join(f"{short} {metrics[f'time/{phase}']:.1f}s" for short, phase in (
                ("gen", "generate"), ("score", "score"), ("logp", "old_ref"), ("train", "train"), ("sync", "sync"))))


def check_finite(skipped: int, bad_steps: int, step: int, limit: int = 3) -> int:
    """Steps in a row, up to `step`, with an update skipped for a NaN/inf loss or gradient; stops the run at
    `limit` of them (the weights have not changed since). `skipped` is the same on every rank: so is the
    stop."""
    bad_steps = bad_steps + 1 if skipped else 0
    if skipped:
        print0(f"step {step}: the loss or gradient was not finite (NaN/inf) in {skipped} update(s), skipped")
    if bad_steps == limit:
        raise RunStopped(
            f"the loss or gradient was not finite in {bad_steps} steps in a row (up to step {step}); stopping. Their "
            "updates were skipped: the weights are those from before them. Likely causes: a reward function "
            "returning inf, a learning rate too high for the model, fp16/bf16 overflow.")
    return bad_steps


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021): the chance
    that k of the n, drawn without replacement, include a correct one: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
