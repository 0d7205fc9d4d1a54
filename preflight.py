"""--dry_run: the run's start-up and the parts of its first step, each a named check that prints one line with
its result and time, in about a minute; nothing is trained or saved. train.py's main() wraps each build in
`with checks(name):` (without --dry_run that does nothing), then, with it, runs the parts of a step on one
prompt per task (main's `if cfg.dry_run:` block) and stops. The first check that fails stops every rank with
exit code 2 and its name; the lines go to the output folder's dry_run.txt, the only file a dry run writes
there. What this file holds: the checks' bookkeeping (Preflight), what the rollout and rewards checks say, the
memory check's batch and step (train.py's own passes, handed in) and its peak."""
import contextlib
import dataclasses
import os
import resource
import sys
import time
import traceback

import torch

from config import RunStopped, UsageError
from grpo import EntropyBonus
from metrics import StepTimer
from rollout import Episode, collate
from utils import all_reduce, extremes_over_ranks

REPORT = "dry_run.txt"


class Preflight:
    """checks(name) -> a context around one check: with --dry_run it is timed and printed (rank 0) as
    ` ok name 1.2 s what it found` (what `say` was given inside) or ` FAIL name ...`, and the ranks agree on
    it (a failure anywhere stops every rank: UsageError naming the check); without, a plain block."""

    def __init__(self, on: bool, output_dir: str, is_main: bool):
        self.on, self.output_dir, self.is_main = on, output_dir, is_main
        self.lines, self.detail, self.t_start = [], "", time.perf_counter()

    def __call__(self, name: str):
        return self._check(name) if self.on else contextlib.nullcontext()

    def say(self, detail: str):
        """What the check in progress found, for its line."""
        self.detail = detail

    @contextlib.contextmanager
    def _check(self, name: str):
        self.detail, t, failure = "", time.perf_counter(), None
        try:
            yield
        except Exception as e:  # a foreseen stop says why in one line; anything else keeps its traceback too
            failure = str(e) if isinstance(e, (UsageError, RunStopped)) else f"{type(e).__name__}: {e}"
            if isinstance(e, torch.OutOfMemoryError):
                failure = ("out of memory: lower --micro_batch_size, keep gradient checkpointing on (the default), "
                           f"or use --fsdp or --use_peft ({failure})")
            elif not isinstance(e, (UsageError, RunStopped)):
                traceback.print_exc()
        failed_anywhere = bool(all_reduce(torch.tensor([float(failure is not None)])) > 0)
        self._line(f"  {'FAIL' if failed_anywhere else 'ok':<5} {name:<17} {time.perf_counter() - t:6.1f} s  "
                   + ("" if failed_anywhere else self.detail))
        if failed_anywhere:
            self.write_report(f"dry run failed at `{name}`")
            failure = (failure or "on another rank (see its message)").strip()
            if "\n" in failure:  # e.g. with a traceback: whole on stderr, its first line in the error line
                print(failure, file=sys.stderr, flush=True)
            raise UsageError(f"dry run: `{name}` failed: {failure.splitlines()[0].rstrip(':')}")

    def _line(self, line: str):
        if self.is_main:
            print(line, flush=True)
            self.lines.append(line)

    def passed(self):
        """The last line, when every check passed."""
        self.write_report(f"dry run passed: {sum(1 for line in self.lines if 'ok' in line[:8])} checks in "
                          f"{time.perf_counter() - self.t_start:.0f} s; nothing was trained or saved")

    def write_report(self, last: str):
        """The lines so far and `last` in output_dir/dry_run.txt (if the folder is there: its check may have
        failed)."""
        self._line(last)
        if self.is_main and os.path.isdir(self.output_dir):
            with contextlib.suppress(OSError), open(os.path.join(self.output_dir, REPORT), "w") as f:
                f.write("\n".join([" ".join(sys.argv), *self.lines]) + "\n")


def sampled(episodes: list, task_names: list[str]) -> str:
    """What a rollout of one prompt per task made, for its line; an environment that failed stops the
    check."""
    if not episodes:  # on a rank other than the first
        return ""
    failed = [e for e in episodes if e.info.get("environment_error")]
    if failed:
        raise UsageError(f"the environment failed in {len(failed)} of {len(episodes)} episodes; the first error:\n"
                         f"{failed[0].info['environment_error']}")
    lengths = [len(e.completion_ids) for e in episodes]
    calls = sum(e.info.get("tool_calls", 0) for e in episodes)
    return (f"{len(episodes)} completions of {', '.join(task_names)}: {min(lengths)} to {max(lengths)} tokens, "
            f"{sum(e.finish_reason == 'length' for e in episodes)} cut at --max_completion_length"
            + (f", {calls} tool calls" if any("tool_calls" in e.info for e in episodes) else ""))


def scored(matrix: torch.Tensor, names: list[str], scorer) -> str:
    """The mean of each reward column on the samples and each function's time, for its line. A function that
    failed on any sample stops the check (its error is printed above): a run would lose those scores."""
    if not len(matrix):  # on a rank other than the first
        return ""
    for name in names:
        if scorer.failed.get(name):
            raise UsageError(f"reward function {name} failed on {scorer.failed[name]} of {scorer.attempted[name]} "
                             "samples (its error is above)")
    return " | ".join(f"{name} {matrix[:, j].nanmean().item():.2f}"
                      + (f" in {scorer.seconds[name]:.1f} s" if name in scorer.seconds else "")
                      for j, name in enumerate(names))


def largest_episode(prompt_ids: list[int], model_inputs: dict, prompt_tokens: int, completion_tokens: int) -> Episode:
    """An episode of the largest shape a step can see: a prompt (its ids, a VLM's images) cut or filled to
    `prompt_tokens` with its last token, and a completion of `completion_tokens` such tokens, every one
    sampled. Made for the memory it takes, not for what it says."""
    fill = prompt_ids[-1]
    prompt = prompt_ids if model_inputs else prompt_ids[:prompt_tokens]  # a VLM's image tokens stay whole
    prompt = prompt + [fill] * max(0, prompt_tokens - len(prompt))
    return Episode(row={}, prompt_ids=prompt, completion_ids=[fill] * completion_tokens,
                   sampled=[True] * completion_tokens, logprobs=[-1.0] * completion_tokens, finish_reason="length",
                   model_inputs=model_inputs)


def largest_update(old_and_ref_logprobs, step_data, update, model, ref_model, optimizer, scheduler, trainable: list,
                   probe, longest: int, pad_id: int, cfg, world_size: int, autocast, off_policy: bool, device) -> str:
    """The memory check: train.py's own passes of a step (`old_and_ref_logprobs`: pi_old and the reference
    where the flags ask for them; `step_data`: the loss's batch; `update`: one optimizer step) on
    --micro_batch_size copies of the largest episode a step can see (the sync probe's prompt made `longest`
    tokens, a full completion). Returns its line: shape and peak."""
    episode = largest_episode(probe.ids, probe.model_inputs, longest, cfg.max_completion_length)
    inputs, tokens = collate([episode] * cfg.micro_batch_size, pad_id)
    old_logp, ref_logp, entropy_mask = old_and_ref_logprobs(model, ref_model, inputs, tokens["sampled"], cfg, autocast,
                                                            off_policy)
    model.train()
    data = step_data(inputs, tokens, tokens["sampled"], torch.linspace(-1, 1, cfg.micro_batch_size), old_logp,
                     ref_logp, entropy_mask, keep=None)
    # One optimizer step, with the entropy bonus where adaptive control may turn it on, that moves no
    # reference.
    coef = cfg.entropy_coef or (cfg.entropy_coef_max if cfg.use_adaptive_entropy else 0.0)
    one_step = dataclasses.replace(cfg, num_iterations=1, steps_per_generation=1, sync_ref_model=False,
                                   use_adaptive_entropy=False, entropy_coef=coef)
    update(model, optimizer, scheduler, trainable, data, 0, one_step, world_size, autocast, StepTimer(),
           EntropyBonus(one_step))
    return f"one update of {cfg.micro_batch_size} x {inputs['input_ids'].shape[1]} tokens: {peak_memory(device)}"


def peak_memory(device: torch.device) -> str:
    """The most a rank has held so far (the largest over the ranks, a collective), of the device's total: on a
    GPU, torch's allocations and the card's memory; on a CPU, the process's peak resident memory and the
    machine's."""
    if device.type == "cuda":
        peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"peak {extremes_over_ranks({'peak': peak})['peak'] / 2**30:.2f} GiB on a rank, of {total / 2**30:.1f} GiB"
