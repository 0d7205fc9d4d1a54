"""Reward functions: the built-ins, by name, and how a name becomes a function.

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
folder, written with a slash (./my_rm; RewardModel): it scores prompt + completion as TRL does.

scorer.py calls them, in a process of their own, so that one that hangs or raises cannot hang or stop
training. Their scores make a matrix (N completions x k functions): postprocess_rewards (or
--reward_postprocess) may reshape it, and weighted_rewards sums each row with --reward_weights.
"""
import functools
import importlib
import inspect
import itertools
import os
import re

from config import RunStopped, UsageError

MATH_TIMEOUT = 2  # seconds math-verify may spend parsing or comparing one completion (pathological input)
# A number in \boxed{}, with a full stop after it too, as accuracy reads it.
BOXED_NUMBER = re.compile(r"\\boxed\{\s*-?[\d,]*\.?\d+\.?\s*\}")


def completion_text(completion) -> str:
    """A completion's text: the completion itself, or its last message's content (chat datasets); "" for no
    message (a trajectory whose environment failed before the model's first turn) or a message without
    content."""
    if isinstance(completion, str):
        return completion
    return (completion[-1].get("content") or "") if completion else ""


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
    """accuracy, counted only for an answer given in one \\boxed{} (a plain last number, or the answer boxed
    twice, earns nothing): the reward of a task whose prompt asks for the box (the embedded one), so that
    answering plainly, or writing the box again and again, is never worth learning. Unlike accuracy + format,
    it never rewards a wrong answer for its box (README: The default run)."""
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
        except TimeoutException:  # its alarm fires only after the arithmetic running then (a huge power, say)
            return False
        except Exception:  # this pair cannot be compared: not equal, as math-verify says
            continue
    return False


def _tower_height(expr) -> int:
    """How many numbers stack as exponents in a parsed answer (10^{10^{10}}: 2). A tower of 3 is no answer
    anyone means, and comparing it runs arithmetic in C that math-verify's time-out cannot stop (10 s and
    more, where 2 is at most 2.5 s): it is not compared."""
    from sympy import Basic, Pow
    if not isinstance(expr, Basic):
        return 0  # math-verify's string form of an answer: no tower
    below = max((_tower_height(a) for a in expr.args), default=0)
    return max(below, 1 + _tower_height(expr.exp)) if isinstance(expr, Pow) and expr.is_number else below


def format(completions, **kwargs) -> list[float]:  # noqa: A001 - TRL's name for it
    """1.0 if the completion gives a number in \\boxed{} exactly once ("\\boxed{12}"; "\\boxed{12.}" too,
    which accuracy reads as 12)."""
    return [float(len(BOXED_NUMBER.findall(completion_text(c))) == 1) for c in completions]


def choice(completions, answer, choices, **kwargs) -> list[float]:
    """1.0 if the completion chooses the row's `answer` among its `choices` (a list of words or phrases): the
    content of its last \\boxed{} if it has one, else the choice it names first (a whole word, any case); 0.0
    if it names none. For classification and multiple-choice tasks (the embedded parity task)."""
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
    """DAPO's soft overlong punishment (arXiv:2503.14476): 0 for a completion of up to max_length -
    buffer_length tokens, then down linearly to -1 at max_length, -1 beyond (TRL:
    get_soft_overlong_punishment). The lengths are --overlong_max_length and --overlong_buffer_length."""
    start = max_length - buffer_length
    return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / buffer_length) for ids in completion_ids]


def weighted_rewards(matrix, weights, own=None):
    """(N, k) rewards of k functions (NaN = not scored), their weights ((k,), or (N, k): each row's task's),
    and own (N, k) (None: all), the columns that are each row's (its task's) -> (N,) weighted sums of each
    row's own columns that scored it; NaN for a completion none of them scored (it has no reward: the
    advantages leave it out of its group's statistics and give it 0, as TRL does)."""
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
    """hook(matrix, names, tasks) (postprocess_rewards, or --reward_postprocess), checked: RunStopped if it
    raises or returns other than a float tensor of the matrix's shape. A batch without rows (a rank with
    nothing to score) is not shown to it."""
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
    """A function from REWARD_FUNCS, or your own as "module:function" (importable from the working folder),
    with the keyword arguments `options[name]` bound if there are any (a built-in's settings from the command
    line)."""
    if ":" in name:
        module, fn = name.split(":", 1)
        fn = getattr(importlib.import_module(module), fn)
    else:
        fn = REWARD_FUNCS[name]
    return functools.partial(fn, **options[name]) if options and name in options else fn


def load_reward_func(name: str, columns: list[str], options: dict | None = None, rollout_fields: bool = False):
    """The function named `name`, checked to accept what the scorer passes it; UsageError saying what to
    change. `rollout_fields`: a custom rollout may give more (its episodes' extra), so an argument it names
    beyond the columns is not missing."""
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
    """The keyword arguments a user's function names; None if it takes **kwargs (or has no signature to
    read)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


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
        # The model scores each text at its last token that is not padding.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
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

