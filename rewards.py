"""Reward functions, by name, and a scorer that runs them safely.

A reward function takes the completions (decoded text) and the reference answers of a batch and
returns one float per completion, or NaN for "not scored". Add your own to REWARD_FUNCS, or keep
it in your own module and pass --reward_funcs accuracy,my_module:my_reward. The scorer runs them in a separate process so that a function that hangs
(math-verify on pathological input) or raises never hangs or kills training: its samples get NaN.
"""
import importlib
import math
import multiprocessing as mp
import os
import re

MATH_TIMEOUT = 2  # seconds math-verify may spend parsing or comparing one completion (pathological input)
BOXED_NUMBER = re.compile(r"\\boxed\{\s*-?[\d,]*\.?\d+\s*\}")


def accuracy(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 if the completion's final answer is mathematically equal to the reference (math-verify:
    a \\boxed{} answer first, else the last expression), else 0.0."""
    from math_verify import parse, verify
    out = []
    for completion, answer in zip(completions, answers):  # math-verify gives up on a sample after its timeouts (s)
        gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=MATH_TIMEOUT)
        out.append(float(bool(gold) and verify(gold, parse(completion, parsing_timeout=MATH_TIMEOUT),
                                               timeout_seconds=MATH_TIMEOUT)))
    return out


def format(completions: list[str], answers: list[str]) -> list[float]:  # noqa: A001 - TRL's name for it
    """1.0 if the completion gives a number in \\boxed{} exactly once."""
    return [float(len(BOXED_NUMBER.findall(c)) == 1) for c in completions]


def tag_count(completions: list[str], answers: list[str]) -> list[float]:
    """0.25 for each of <think>, </think>, <answer>, </answer> that appears exactly once."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [sum(0.25 for t in tags if c.count(t) == 1) for c in completions]


def postprocess_rewards(matrix, names: list[str]):
    """Hook between scoring and weighting: the (N completions, k functions) reward matrix in, the same
    shape out; NaN means "not scored" and adds nothing to the total. The identity by default; edit it
    to reshape a channel without touching the loop, e.g.
        matrix[:, names.index("format")] *= 0.5                   # down-weight one function
        matrix[:, names.index("accuracy")].clamp_(min=0, max=1)   # clip a noisy one"""
    return matrix


REWARD_FUNCS = {"accuracy": accuracy, "format": format, "tag_count": tag_count}


def get_reward_func(name: str):
    """A function from REWARD_FUNCS, or your own as "module:function" (importable from the working folder)."""
    if ":" in name:
        module, fn = name.split(":", 1)
        return getattr(importlib.import_module(module), fn)
    return REWARD_FUNCS[name]


def _own_session():
    """The scorer process leaves the trainer's process group: Ctrl-C in the terminal and torchrun's SIGTERM
    (sent to each worker's group) are for the trainer, which finishes scoring, saves and stops. The process
    still ends with the trainer: its task pipe closes."""
    os.setsid()


def _score_one(name: str, completions: list[str], answers: list[str]) -> list[float]:
    """Runs in the scorer's process: per-sample errors become NaN, the rest of the batch is kept."""
    fn = get_reward_func(name)
    try:
        return [float(x) for x in fn(completions, answers)]
    except Exception:
        out = []
        for c, a in zip(completions, answers):
            try:
                out.append(float(fn([c], [a])[0]))
            except Exception:
                out.append(math.nan)
        return out


class RewardScorer:
    """scores(completions, answers) -> list of k lists (one per function) of N floats, NaN = not scored."""

    def __init__(self, names: list[str], timeout: float = 60.0):
        for name in names:
            try:
                get_reward_func(name)
            except KeyError:
                raise ValueError(f"unknown reward function {name!r} in --reward_funcs: use one of {sorted(REWARD_FUNCS)} "
                                 "or your own as module:function") from None
            except (ImportError, AttributeError) as e:
                raise ValueError(f"--reward_funcs {name}: could not load it ({type(e).__name__}: {e}); give "
                                 "module:function with the module importable from the working folder") from None
        self.names, self.timeout = names, timeout
        self.failures = 0  # function calls that hung or crashed the scorer process
        self._pool = None

    def _start(self):
        # spawn, not fork: math-verify's timeouts use signals, which work in a process's main thread
        self._pool = mp.get_context("spawn").Pool(1, initializer=_own_session)

    def __call__(self, completions: list[str], answers: list[str]) -> list[list[float]]:
        scores = []
        for name in self.names:
            if self._pool is None:
                self._start()
            try:
                scores.append(self._pool.apply_async(_score_one, (name, completions, answers)).get(timeout=self.timeout))
            except Exception:  # hung or crashed: this function's batch is unscored; start a fresh process
                self.failures += 1
                scores.append([math.nan] * len(completions))
                self._pool.terminate()
                self._pool = None
        return scores

    def close(self):
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
