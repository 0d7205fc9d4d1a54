"""The scorer: RewardScorer calls the reward functions (rewards.py) on a batch of completions and returns
their scores, one list per function, NaN where a function did not score. Also the process they run in and its
signals.

Functions run in a separate process, so that one that hangs (math-verify on pathological input) cannot
hang training: a call that outlives its time-out is abandoned and its samples are not scored. A call
that raises is retried one completion at a time; the completions that still raise are not scored.
Either way the lost scores are counted (`scorer_failures`) and the first traceback of each function is
printed; a function that fails on every completion of its first batch stops the run with its error.

The process is spawned, in a session of its own, with the trainer's secrets out of its environment; it ends
with the trainer, and takes what it started along (_scorer_process). Reward models (a folder) run in the
trainer.
"""
import asyncio
import contextlib
import ctypes
import inspect
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing import resource_tracker
from types import ModuleType, SimpleNamespace

from config import STOP, Interrupted, RunStopped, UsageError
from rewards import EXTRA_ARGUMENTS, RewardModel, get_reward_func, is_reward_model, load_reward_func, named_parameters


def as_completion(prompt, completion):
    """A completion as the reward functions get it: text for a text prompt, messages for a chat prompt (a text
    one as one assistant message) or a multi-turn one; no message at all (a trajectory whose environment
    failed before the model's first turn, which gets no reward anyway: tools.environment_rewards) as one empty
    assistant message, a valid empty answer, so that no function fails on it (TRL's examples read
    completion[0]["content"])."""
    if isinstance(completion, list):
        return completion or [{"role": "assistant", "content": ""}]
    return completion if isinstance(prompt, str) else [{"role": "assistant", "content": completion}]


def _checked(out, n: int) -> list[float]:
    """A function's result as n floats (None -> NaN = not scored); TypeError if it is not that."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != n:
        length = f" of length {len(out)}" if hasattr(out, "__len__") else ""
        raise TypeError(f"returned {type(out).__name__}{length} for {n} completions; return a list with one float "
                        "(or None) per completion")
    try:
        return [math.nan if v is None else float(v) for v in out]
    except (TypeError, ValueError) as e:
        raise TypeError(f"returned a value that is not a number or None ({e}); return one float (or None) per "
                        "completion") from None


class BadOutput(Exception):
    """A function ran but returned something that cannot be a reward: a bug to fix, never to skip."""


def _checked_extra(extra: dict, n: int) -> dict:
    """log_extra's columns, each one value per completion; TypeError if not."""
    for column, values in extra.items():
        if len(values) != n:
            raise TypeError(f"called log_extra({column!r}, ...) with {len(values)} values for {n} completions; give "
                            "one value per completion")
    return extra


async def _score_one(fn, batch: dict, n: int) -> dict:
    """{scores, failed (completions that raised), traceback (the first, or ""), metrics, extra}: the whole
    batch in one call, and one completion at a time if that raises. A return value (or log_extra) that
    cannot be rewards is BadOutput, in either case."""
    lists, metrics = {k: v for k, v in batch.items() if k != "trainer_state"}, {}
    named = named_parameters(fn)
    # A function without **kwargs gets only the columns and rollout fields it names.
    if named is not None:
        lists = {k: v for k, v in lists.items() if k in named}

    async def scored(kwargs: dict, k: int) -> tuple[list[float], dict]:
        extra = {}
        out = fn(**kwargs, trainer_state=batch["trainer_state"],
                 log_metric=lambda key, value: metrics.setdefault(key, []).append(float(value)),
                 log_extra=lambda column, values: extra.setdefault(column, []).extend(values))
        out = await out if inspect.isawaitable(out) else out
        try:
            return _checked(out, k), _checked_extra(extra, k)
        except TypeError as e:
            raise BadOutput(str(e)) from None

    try:
        scores, extra = await scored(lists, n)
        return {"scores": scores, "failed": 0, "traceback": "", "metrics": metrics, "extra": extra}
    except BadOutput:
        raise
    except Exception:
        first = traceback.format_exc()
    scores, failed, extras = [], 0, []
    for i in range(n):
        try:
            one, extra = await scored({k: v[i:i + 1] for k, v in lists.items()}, 1)
        except BadOutput:
            raise
        except Exception:
            one, extra = [math.nan], {}
            failed += 1
        scores += one
        extras.append(extra)
    columns = dict.fromkeys(c for e in extras for c in e)
    return {"scores": scores, "failed": failed, "traceback": first if failed else "", "metrics": metrics,
            "extra": {c: [e[c][0] if c in e else None for e in extras] for c in columns}}


def _unscored(n: int, why: str) -> dict:
    """The result of a function that scored none of n completions, and why."""
    return {"scores": [math.nan] * n, "failed": n, "traceback": why, "metrics": {}, "extra": {}}


def _score(jobs: list[tuple[str, dict]], options: dict) -> list[dict]:
    """Runs in the scorer's process: each job's function on its batch (one sync function, or every async one,
    which run concurrently): per function {scores, failed, traceback, metrics, extra} or {error}."""
    async def one(name, batch):
        try:
            result = await _score_one(get_reward_func(name, options), batch, len(batch["completions"]))
        except BadOutput as e:
            return {"error": f"reward function {name} {e}"}
        return {**result, "metrics": {k: sum(v) / len(v) for k, v in result["metrics"].items()}}

    async def all_of():
        return await asyncio.gather(*[one(name, batch) for name, batch in jobs])
    return asyncio.run(all_of())


SECRETS = ("VLLM_API_KEY", "WANDB_API_KEY")  # the trainer's; reward functions are user code and need neither


@contextlib.contextmanager
def _ctrl_c_held_back_from_children():
    """Processes started inside are born with SIGINT blocked (a thread's signal mask survives fork and exec),
    until they leave the trainer's session (_scorer_process). Only this thread blocks it: the trainer's own
    Ctrl-C still reaches its handler, through another thread or when the block ends. (Ignoring SIGINT instead,
    which also survives exec, is process-wide: a Ctrl-C meanwhile was lost.) The resource tracker unblocks
    SIGINT when it starts, so it starts first."""
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def _main_module_not_inherited():
    """spawn's children import the parent's __main__ module before anything else (for train.py: torch,
    transformers and the trainer's modules, 4 s before the first score and 0.3 GB with torch and transformers
    alone). The scorer needs nothing of it (reward functions are imported by name): what starts inside sees an
    empty __main__."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _scorer_process():
    """Set-up of the scorer process, which runs the user's reward functions:
    - a session of its own: Ctrl-C in the terminal and torchrun's SIGTERM (sent to each worker's group) are
      for the trainer, which finishes scoring, saves and stops; and the trainer stops the scorer together with
      what a reward function started (a code sandbox, a judge's client) by signalling that group
      (RewardScorer.stop);
    - it ends with the trainer even when the trainer is killed (SIGKILL) mid-call (Linux: the parent's death
      signals it, and it takes its group along); an idle scorer also ends when its task pipe closes;
    - the trainer's secrets are not in its environment (nor in what it starts).
    It was born with Ctrl-C blocked (RewardScorer.start): until setsid it is in the trainer's group, which a
    terminal's Ctrl-C reaches; it killed a scorer still starting, and the pool's end then waited forever. One
    that came meanwhile is dropped (ignoring a signal discards it), and Ctrl-C is Python's again."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    for name in SECRETS:
        os.environ.pop(name, None)
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    with contextlib.suppress(OSError, AttributeError):
        # PR_SET_PDEATHSIG: the kernel sends this process SIGTERM when the trainer dies.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() == 1:  # the trainer died before the line above
        os.killpg(0, signal.SIGKILL)


class RewardScorer:
    """scorer(rows, completions, completion_ids, step, own) -> k lists (one per function) of N floats, NaN =
    not scored. rows[i] is the dataset row of completion i; own (N, k), if given, says which functions score
    which completions (a mixture's tasks each have their own; the others stay NaN). `columns`, the rows'
    columns (or each function's), are checked against every function's signature at start."""

    def __init__(self, names: list[str], columns: list[str] | dict[str, list[str]], device="cpu", max_steps: int = 0,
                 timeout: float = 60.0, options: dict | None = None):
        columns = columns if isinstance(columns, dict) else dict.fromkeys(names, columns)
        taken = [c for cs in columns.values() for c in cs
                 if c in ("prompts", "completions", "completion_ids", *EXTRA_ARGUMENTS)]
        if taken:
            raise UsageError(f"the dataset has a column named {taken[0]!r}, the name of an argument every reward "
                             "function gets from nanogrpo (as in TRL); rename the column")
        self.names, self.timeout, self.max_steps, self.options = names, timeout, max_steps, options or {}
        self.models = {name: RewardModel(name, device) for name in names if is_reward_model(name)}
        self.is_async = {name: inspect.iscoroutinefunction(load_reward_func(name, columns[name], self.options,
                                                                            rollout_fields=True))
                         for name in names if name not in self.models}  # mixture.load_mixture checked them
        self.failures = 0  # (function, completion) scores lost because the function raised or hung
        self.failed = dict.fromkeys(names, 0)  # the same count, per function, in the last call
        self.attempted = dict.fromkeys(names, 0)  # the completions each function was to score last call
        self.calls, self.reported = dict.fromkeys(names, 0), set()
        self.metrics, self.extra = {}, {}  # what the functions logged (log_metric, log_extra) last call
        self.seconds = {}  # each function's time in the last call that ran it (async ones: their joint call)
        self._pool = None

    def start(self):
        """Start the scorer process now, without waiting for it (its imports overlap the trainer's start-up);
        else the first call starts it. Nothing to start if no function runs in it (reward models run here)."""
        if self._pool is None and any(name not in self.models for name in self.names):
            # Spawned, not forked: math-verify's timeouts use signals, which work only in a main thread.
            with _ctrl_c_held_back_from_children(), _main_module_not_inherited():
                self._pool = mp.get_context("spawn").Pool(1, initializer=_scorer_process)
            self._pid_of = self._pool.apply_async(os.getpid)  # also the id of its process group

    def stop(self, busy: bool = False):
        """End the scorer process and everything it started (its process group). A `busy` one (hung in a
        reward function) is killed at once; an idle one first takes the pool's sign to finish (killed while it
        waits for work, it would leave the pool's task queue locked), then what it left running is killed."""
        if self._pool is None:
            return
        try:
            group = self._pid_of.get(timeout=120)  # known at once, unless the process is still starting
        except Exception:  # it died while starting: ending the pool below is all there is to do
            group = None
        if busy and group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self._pool.terminate()
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self._pool = None

    def _run(self, jobs: list[tuple[str, dict]]) -> list[dict]:
        self.start()
        try:
            return self._answer(self._pool.apply_async(_score, (jobs, self.options)))
        except Interrupted:  # a stop signal: the functions' work is abandoned with their process
            self.stop(busy=True)
            raise
        # Hung, or the process died: these functions' batches are unscored; the next call starts a new
        # process.
        except Exception as e:
            self.stop(busy=True)
            why = (f"did not finish within {self.timeout:g} s" if isinstance(e, mp.TimeoutError)
                   else f"crashed the scorer process ({type(e).__name__}: {e})")
            return [_unscored(len(batch["completions"]), f"{why}\n") for _, batch in jobs]

    def _answer(self, result):
        """The scorer process's answer, waited for up to --reward_timeout (mp.TimeoutError), or until a stop
        signal (config.Interrupted)."""
        deadline = time.monotonic() + self.timeout
        while not result.ready():
            if STOP.is_set():
                raise Interrupted("a stop signal arrived while the reward functions ran")
            result.wait(min(0.2, max(deadline - time.monotonic(), 0)))
            if time.monotonic() > deadline and not result.ready():
                raise mp.TimeoutError
        return result.get(0)

    def __call__(self, rows: list[dict], completions: list, completion_ids: list[list[int]], step: int = 0,
                 own=None) -> list[list[float]]:
        self.metrics, self.extra = {}, {}
        n = len(rows)
        prompts = [r["prompt"] for r in rows]
        completions = [as_completion(p, c) for p, c in zip(prompts, completions)]
        own = own.tolist() if hasattr(own, "tolist") else own
        which = {name: [i for i in range(n) if own is None or own[i][j]] for j, name in enumerate(self.names)}

        def batch_of(name):  # the completions `name` scores, with their rows' columns
            rs = [rows[i] for i in which[name]]
            return {"prompts": [prompts[i] for i in which[name]], "completions": [completions[i] for i in which[name]],
                    "completion_ids": [completion_ids[i] for i in which[name]],
                    **{k: [r.get(k) for r in rs] for k in dict.fromkeys(k for r in rs for k in r) if k != "prompt"},
                    "trainer_state": SimpleNamespace(global_step=step, max_steps=self.max_steps)}
        results = {}
        # Only the functions with completions to score: none on a rank without prompts, or of another task.
        called = [name for name in self.names if which[name]]
        sync = [name for name in called if name not in self.models and not self.is_async[name]]
        for names in [[name] for name in sync] + [[name for name in called if self.is_async.get(name)]]:
            if names:
                t = time.perf_counter()
                results |= dict(zip(names, self._run([(name, batch_of(name)) for name in names])))
                self.seconds |= dict.fromkeys(names, time.perf_counter() - t)
        for name in called:
            if name in self.models:
                t = time.perf_counter()
                results[name] = self._score_model(name, self.models[name], batch_of(name))
                self.seconds[name] = time.perf_counter() - t
        out = []
        for name in self.names:
            self.attempted[name], self.failed[name] = len(which[name]), 0
            scores = [math.nan] * n
            if name in results:
                self._account(name, results[name], len(which[name]))
                for i, score in zip(which[name], results[name]["scores"]):
                    scores[i] = score
                # Each log_extra column holds None where this function did not score.
                for column, values in results[name]["extra"].items():
                    full = self.extra.setdefault(column, [None] * n)
                    for i, value in zip(which[name], values):
                        full[i] = value
            out.append(scores)
        return out

    def _score_model(self, name: str, model: RewardModel, batch: dict) -> dict:
        try:
            scores = _checked(model(**batch), len(batch["completions"]))
            return {"scores": scores, "failed": 0, "traceback": "", "metrics": {}, "extra": {}}
        except Exception:
            return _unscored(len(batch["completions"]), traceback.format_exc())

    def _account(self, name: str, result: dict, n: int):
        """Count and report a function's failures; stop on a bug (bad output, or nothing scored in its first
        batch)."""
        if "error" in result:
            raise RunStopped(result["error"])
        self.calls[name] += 1
        self.failures += result["failed"]
        self.failed[name] = result["failed"]
        self.metrics |= result["metrics"]
        if result["failed"] == n and self.calls[name] == 1:
            raise RunStopped(f"reward function {name} failed on every completion of its first batch, so it would "
                             f"never score anything; its error:\n{result['traceback']}")
        if result["failed"] and name not in self.reported:
            self.reported.add(name)
            print(f"reward function {name} failed on {result['failed']} of {n} completions (not scored; counted in "
                  f"scorer_failures; only its first error is shown):\n{result['traceback']}", file=sys.stderr,
                  flush=True)

    def close(self):
        self.stop()

    # A run stopped by an error ends its scorer process too (run_and_exit collects main's objects).
    def __del__(self):
        if hasattr(self, "_pool"):  # absent if __init__ stopped first
            self.stop()
