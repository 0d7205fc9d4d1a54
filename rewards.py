"""Reward functions, by name, and a scorer that runs them safely.

A reward function has the signature of TRL's GRPOTrainer, so one written for TRL runs unchanged:

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

one call per batch, one value per completion. `prompts[i]` is the prompt of completion i as the dataset
has it (text, or a list of chat messages); `completions[i]` is the completion: text for a text prompt,
[{"role": "assistant", "content": text}] for a chat prompt; `completion_ids[i]` its token ids. Every
other column of the dataset arrives as a keyword list of the same length (`answer=[...]`,
`solution=[...]`), and so do `trainer_state` (`.global_step`, `.max_steps`), `log_metric(name, value)`
and `log_extra(column, values)` as in TRL. A function names the arguments it needs and takes the rest
with `**kwargs`; it returns None for a completion it does not score (it then adds nothing to the
reward). `async def` functions run concurrently.

--reward_funcs names them: the built-ins in REWARD_FUNCS, your own as module:function (importable from
the working folder), or a reward model as the path of a local Hugging Face sequence-classification
folder, written with a slash (./my_rm): it scores prompt + completion as TRL does.

Functions run in a separate process, so that one that hangs (math-verify on pathological input) cannot
hang training: a call that outlives its time-out is abandoned and its samples are not scored. A call
that raises is retried one completion at a time; the completions that still raise are not scored.
Either way the lost scores are counted (`scorer_failures`) and the first traceback of each function is
printed; a function that fails on every completion of its first batch stops the run with its error.
"""
import asyncio
import contextlib
import ctypes
import functools
import importlib
import inspect
import itertools
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import traceback
from multiprocessing import resource_tracker
from types import ModuleType, SimpleNamespace

from config import STOP, Interrupted, RunStopped, UsageError

MATH_TIMEOUT = 2  # seconds math-verify may spend parsing or comparing one completion (pathological input)
BOXED_NUMBER = re.compile(r"\\boxed\{\s*-?[\d,]*\.?\d+\.?\s*\}")  # a full stop after it too, as accuracy reads it


def completion_text(completion) -> str:
    """A completion's text: the completion itself, or its last message's content (chat datasets); "" for no message
    (a trajectory whose environment failed before the model's first turn) or a message without content."""
    if isinstance(completion, str):
        return completion
    return (completion[-1].get("content") or "") if completion else ""


def as_completion(prompt, completion):
    """A completion as the reward functions get it: text for a text prompt, messages for a chat prompt (a text one as
    one assistant message) or a multi-turn one; no message at all (a trajectory whose environment failed before
    the model's first turn, which gets no reward anyway: tools.environment_rewards) as one empty assistant message,
    a valid empty answer, so that no function fails on it (TRL's examples read completion[0]["content"])."""
    if isinstance(completion, list):
        return completion or [{"role": "assistant", "content": ""}]
    return completion if isinstance(prompt, str) else [{"role": "assistant", "content": completion}]


NUMBER = re.compile(r"-?(?:\d[\d,]*)?\.?\d+")


def final_answer(text: str) -> str:
    """What a completion answers: the content of its last \\boxed{}, else its last number; "" if it has
    neither, or if its last \\boxed{ is never closed (an answer cut off is no answer)."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth = 0
        for end in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start + len("\\boxed{"):end].strip()
        return ""
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def reference_answers(answer) -> list[str]:
    """The acceptable answers of a row's `answer`: the items of a list, or the one value; GSM8K's
    "... #### 42" is 42."""
    out = []
    for a in answer if isinstance(answer, (list, tuple)) else [answer]:
        if a is not None:
            text = str(a)
            out.append(text.split("####")[-1].strip().replace(",", "") if "####" in text else text.strip())
    return out


def accuracy(completions, answer, **kwargs) -> list[float]:
    """1.0 if the completion's final answer is mathematically equal (math-verify) to the reference in the
    `answer` column (to one of them, if it holds a list; GSM8K's "#### 42" is 42), else 0.0. A numeric
    reference (GSM8K, the embedded task) needs a number as the final answer (final_answer: the last
    \\boxed{}, else the last number), so that restating the question ("13 + 14 is a classic puzzle") or
    boxing an expression that equals the answer earns nothing; any other reference (LaTeX: \\frac{1}{2},
    x^2) is matched by math-verify's own extraction: a \\boxed{} answer first, else the last expression."""
    return [float(any(_matches(completion_text(completion), ref) for ref in reference_answers(refs)))
            for completion, refs in zip(completions, answer)]


def boxed_accuracy(completions, answer, **kwargs) -> list[float]:
    """accuracy, counted only for an answer given in one \\boxed{} (a plain last number, or the answer boxed twice,
    earns nothing): the reward of a task whose prompt asks for the box (the embedded one), so that answering
    plainly, or writing the box again and again, is never worth learning. Unlike accuracy + format, it never
    rewards a wrong answer for its box (README: The default run)."""
    return [score if completion_text(completion).count("\\boxed{") == 1 else 0.0
            for score, completion in zip(accuracy(completions, answer), completions)]


@functools.lru_cache(maxsize=4096)  # boxed_accuracy asks what accuracy asks; a group's samples often repeat
def _matches(text: str, ref: str) -> bool:
    """Whether a completion's final answer equals one reference answer (math-verify, with its timeouts)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException
    gold = parse(ref if "$" in ref or "\\boxed" in ref else f"${ref}$", parsing_timeout=MATH_TIMEOUT)
    if NUMBER.fullmatch(ref):
        number = final_answer(text).strip("$ ").rstrip(".").replace(",", "")  # "12." is 12; ".5" is not 5
        if not NUMBER.fullmatch(number):
            return False
        text = f"${number}$"
    target = [t for t in parse(text, parsing_timeout=MATH_TIMEOUT) if _tower_height(t) < 3]
    for g, t in itertools.product(gold, target):  # math-verify's own loop, but the first time-out ends it
        try:
            if verify(g, t, timeout_seconds=MATH_TIMEOUT, raise_on_error=True):
                return True
        except TimeoutException:  # (its alarm fires only after the arithmetic running then, e.g. a huge power)
            return False
        except Exception:  # this pair cannot be compared: as math-verify, not equal
            continue
    return False


def _tower_height(expr) -> int:
    """How many numbers stack as exponents in a parsed answer (10^{10^{10}}: 2). A tower of 3 is no answer
    anyone means, and comparing it runs arithmetic in C that math-verify's time-out cannot stop (10 s and
    more, where 2 is at most 2.5 s): it is not compared."""
    from sympy import Basic, Pow
    if not isinstance(expr, Basic):
        return 0  # math-verify's string form
    below = max((_tower_height(a) for a in expr.args), default=0)
    return max(below, 1 + _tower_height(expr.exp)) if isinstance(expr, Pow) and expr.is_number else below


def format(completions, **kwargs) -> list[float]:  # noqa: A001 - TRL's name for it
    """1.0 if the completion gives a number in \\boxed{} exactly once ("\\boxed{12}"; "\\boxed{12.}" too, which
    accuracy reads as 12)."""
    return [float(len(BOXED_NUMBER.findall(completion_text(c))) == 1) for c in completions]


def choice(completions, answer, choices, **kwargs) -> list[float]:
    """1.0 if the completion chooses the row's `answer` among its `choices` (a list of words or phrases): the
    content of its last \\boxed{} if it has one, else the choice it names first (a whole word, any case); 0.0 if
    it names none. For classification and multiple-choice tasks (the embedded parity task)."""
    out = []
    for completion, ref, options in zip(completions, answer, choices):
        text = completion_text(completion)
        boxed = final_answer(text) if "\\boxed{" in text else None
        if boxed is not None:
            chosen = boxed.strip(" .").lower()
        else:
            found = [(m.start(), c) for c in options
                     for m in [re.search(rf"(?<!\w){re.escape(str(c))}(?!\w)", text, re.IGNORECASE)] if m]
            chosen = str(min(found)[1]).lower() if found else None
        out.append(float(chosen is not None and chosen == str(ref).strip().lower()))
    return out


def tag_count(completions, **kwargs) -> list[float]:
    """0.25 for each of <think>, </think>, <answer>, </answer> that appears exactly once."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [sum(0.25 for t in tags if completion_text(c).count(t) == 1) for c in completions]


def overlong_penalty(completion_ids, max_length: int, buffer_length: int, **kwargs) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476): 0 for a completion of up to max_length - buffer_length
    tokens, then down linearly to -1 at max_length, -1 beyond (TRL: get_soft_overlong_punishment). The lengths
    are --overlong_max_length and --overlong_buffer_length."""
    start = max_length - buffer_length
    return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / buffer_length) for ids in completion_ids]


def weighted_rewards(matrix, weights, own=None):
    """(N, k) rewards of k functions (NaN = not scored), their weights ((k,), or (N, k): each row's task's), and
    own (N, k) (None: all), the columns that are each row's (its task's) -> (N,) weighted sums of each row's own
    columns that scored it; NaN for a completion none of them scored (it has no reward: the advantages leave it
    out of its group's statistics and give it 0, as TRL does)."""
    if own is not None:
        matrix = matrix.where(own, float("nan"))  # another task's column adds nothing, whatever it holds
    scored = ~matrix.isnan()
    return (matrix * weights).nansum(dim=1).where(scored.any(dim=1), float("nan"))


def postprocess_rewards(matrix, names: list[str], tasks: list[str]):
    """Hook between scoring and weighting: the (N completions, k functions) reward matrix in, the same shape
    out; NaN means "not scored" and adds nothing to the total. `tasks[i]` is the task of completion i (in a
    mixture, its `task` column; else the dataset's name); a row's reward is taken from its own task's columns
    only, so another task's column of a row (NaN) may hold anything. The identity by default; edit it, or name
    your own with --reward_postprocess module:function, to reshape a channel without touching the loop, e.g.
        matrix[:, names.index("format")] *= 0.5                   # down-weight one function
        matrix[:, names.index("accuracy")].clamp_(min=0, max=1)   # clip a noisy one
        hard = torch.tensor([t == "gsm8k" for t in tasks])
        matrix[hard, names.index("accuracy")] *= 2                # one task's rows count twice"""
    return matrix


def load_postprocess(spec: str):
    """The reward matrix's hook: postprocess_rewards, or --reward_postprocess module:function, checked to take
    (matrix, names, tasks); UsageError saying what to change."""
    if not spec:
        return postprocess_rewards
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UsageError(f"--reward_postprocess {spec}: could not load it ({type(e).__name__}: {e}); give "
                         "module:function with the module importable from the working folder") from None
    try:
        inspect.signature(fn).bind(None, [], [])
    except TypeError as e:
        raise UsageError(f"--reward_postprocess {spec}: {name}{inspect.signature(fn)} cannot be called as "
                         f"f(matrix, names, tasks) ({e})") from None
    except ValueError:  # no signature to inspect (a builtin)
        pass
    return fn


def postprocessed(hook, matrix, names: list[str], tasks: list[str]):
    """hook(matrix, names, tasks) (postprocess_rewards, or --reward_postprocess), checked: RunStopped if it raises or
    returns other than a float tensor of the matrix's shape. A batch without rows (a rank with nothing to score)
    is not shown to it."""
    if not len(matrix):
        return matrix
    try:
        out = hook(matrix.clone(), names, tasks)
    except Exception as e:
        raise RunStopped(f"the reward postprocess hook {getattr(hook, '__name__', hook)} raised {type(e).__name__}: "
                         f"{e}") from e
    if not hasattr(out, "shape") or tuple(out.shape) != tuple(matrix.shape) or not out.is_floating_point():
        raise RunStopped(f"the reward postprocess hook {getattr(hook, '__name__', hook)} returned "
                         f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))} for a float matrix of shape "
                         f"{tuple(matrix.shape)}; return a float tensor of the same shape (NaN = not scored)")
    return out.float()


REWARD_FUNCS = {"accuracy": accuracy, "boxed_accuracy": boxed_accuracy, "format": format, "choice": choice,
                "tag_count": tag_count, "overlong_penalty": overlong_penalty}
EXTRA_ARGUMENTS = ("trainer_state", "log_metric", "log_extra")  # TRL's, besides the dataset's columns


def is_reward_model(name: str) -> bool:
    """A path (it has a slash), never a built-in or module:function (module names are dotted)."""
    return "/" in name or os.sep in name


def get_reward_func(name: str, options: dict | None = None):
    """A function from REWARD_FUNCS, or your own as "module:function" (importable from the working folder), with
    the keyword arguments `options[name]` bound if there are any (a built-in's settings from the command line)."""
    if ":" in name:
        module, fn = name.split(":", 1)
        fn = getattr(importlib.import_module(module), fn)
    else:
        fn = REWARD_FUNCS[name]
    return functools.partial(fn, **options[name]) if options and name in options else fn


def load_reward_func(name: str, columns: list[str], options: dict | None = None, rollout_fields: bool = False):
    """The function named `name`, checked to accept what the scorer passes it; UsageError saying what to change.
    `rollout_fields`: a custom rollout may give more (its episodes' extra), so an argument it names beyond the
    columns is not missing."""
    try:
        fn = get_reward_func(name, options)
    except KeyError:
        raise UsageError(f"unknown reward function {name!r} in --reward_funcs: use one of {sorted(REWARD_FUNCS)}, your "
                         "own as module:function, or a reward model folder as a path (./my_rm)") from None
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--reward_funcs {name}: could not load it ({type(e).__name__}: {e}); give module:function "
                         "with the module importable from the working folder") from None
    passed = ["prompts", "completions", "completion_ids", *[c for c in columns if c != "prompt"], *EXTRA_ARGUMENTS]
    try:
        signature = inspect.signature(fn)
        (signature.bind_partial if rollout_fields else signature.bind)(**dict.fromkeys(passed))
    except TypeError as e:
        raise UsageError(f"--reward_funcs {name}: {fn.__name__}{inspect.signature(fn)} cannot be called with the "
                         f"arguments a reward function gets ({e}): keyword lists {', '.join(passed)}. Write it as "
                         f"{fn.__name__}(prompts, completions, **kwargs), naming the dataset columns it needs"
                         ) from None
    except ValueError:  # no signature to inspect (a builtin); it will be called and judged by its results
        pass
    return fn


def named_parameters(fn) -> set[str] | None:
    """The keyword arguments a user's function names; None if it takes **kwargs (or has no signature to read)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


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
    if named is not None:  # without **kwargs: the columns and a rollout's extra fields that it names, no others
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
    """Processes started inside are born with SIGINT blocked (a thread's signal mask survives fork and exec), until
    they leave the trainer's session (_scorer_process). Only this thread blocks it: the trainer's own Ctrl-C still
    reaches its handler, through another thread or when the block ends. (Ignoring SIGINT instead, which also
    survives exec, is process-wide: a Ctrl-C meanwhile was lost.) The resource tracker unblocks SIGINT when it
    starts, so it starts first."""
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
    - a session of its own: Ctrl-C in the terminal and torchrun's SIGTERM (sent to each worker's group) are for
      the trainer, which finishes scoring, saves and stops; and the trainer stops the scorer together with what a
      reward function started (a code sandbox, a judge's client) by signalling that group (RewardScorer.stop);
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
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the trainer died before the line above
        os.killpg(0, signal.SIGKILL)


class RewardModel:
    """A local sequence-classification folder as a reward function: the first logit of the prompt and
    completion as one text (chat prompts through the model's chat template), as TRL scores them."""

    def __init__(self, path: str, device, batch_size: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"--reward_funcs {path}: no config.json there; a path names a reward model, a local "
                             "Hugging Face sequence-classification folder")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # it scores each text at its last real token
        self.device, self.batch_size, self.torch = device, batch_size, torch

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        texts = [p + c if isinstance(p, str) else self.tokenizer.apply_chat_template(p + c, tokenize=False)
                 for p, c in zip(prompts, completions)]
        out = []
        with self.torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                inputs = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                        padding_side="right", add_special_tokens=False).to(self.device)
                out += self.model(**inputs).logits[:, 0].float().tolist()
        return out


class RewardScorer:
    """scorer(rows, completions, completion_ids, step, own) -> k lists (one per function) of N floats, NaN = not
    scored. rows[i] is the dataset row of completion i; own (N, k), if given, says which functions score which
    completions (a mixture's tasks each have their own; the others stay NaN). `columns`, the rows' columns (or
    each function's), are checked against every function's signature at start."""

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
                         for name in names if name not in self.models}  # (mixture.load_mixture checked them)
        self.failures = 0  # (function, completion) scores lost: the function raised, or hung
        self.failed = dict.fromkeys(names, 0)  # the same, of each function in the last call
        self.attempted = dict.fromkeys(names, 0)  # the completions each function was to score in the last call
        self.calls, self.reported = dict.fromkeys(names, 0), set()
        self.metrics, self.extra = {}, {}  # what functions logged with log_metric / log_extra in the last call
        self.seconds = {}  # each function's time in the last call that ran it (async ones: their joint call)
        self._pool = None

    def start(self):
        """Start the scorer process now, without waiting for it (its imports overlap the trainer's start-up); else
        the first call starts it. Nothing to start if no function runs in it (reward models run here)."""
        if self._pool is None and any(name not in self.models for name in self.names):
            # spawn, not fork: math-verify's timeouts use signals, which work in a process's main thread
            with _ctrl_c_held_back_from_children(), _main_module_not_inherited():
                self._pool = mp.get_context("spawn").Pool(1, initializer=_scorer_process)
            self._pid_of = self._pool.apply_async(os.getpid)  # also its process group's id

    def stop(self, busy: bool = False):
        """End the scorer process and everything it started (its process group). A `busy` one (hung in a
        reward function) is killed at once; an idle one first takes the pool's sign to finish (killed while it
        waits for work, it would leave the pool's task queue locked), then what it left running is killed."""
        if self._pool is None:
            return
        try:
            group = self._pid_of.get(timeout=120)  # at once, unless the process is still starting
        except Exception:  # it died starting: the pool's end below is all there is to do
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
        except Exception as e:  # hung, or the process died: these functions' batches are unscored; a fresh process
            self.stop(busy=True)
            why = (f"did not finish within {self.timeout:g} s" if isinstance(e, mp.TimeoutError)
                   else f"crashed the scorer process ({type(e).__name__}: {e})")
            return [_unscored(len(batch["completions"]), f"{why}\n") for _, batch in jobs]

    def _answer(self, result):
        """The scorer process's answer, waited for up to --reward_timeout (mp.TimeoutError), or until a stop signal
        (config.Interrupted)."""
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
        called = [name for name in self.names if which[name]]  # none for a rank without prompts, or not its task's
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
                for column, values in results[name]["extra"].items():  # log_extra: None where it did not score
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
        """Count and report a function's failures; stop on a bug (bad output, or nothing scored in its first batch)."""
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

    def __del__(self):  # a run stopped by an error ends its scorer process too (run_and_exit collects main's objects)
        if hasattr(self, "_pool"):  # (not if __init__ stopped first)
            self.stop()
