"""Tools and environments, TRL 1.16's contract (README: Environments and tools).

A tool is a typed Python function with a Google-style docstring: its JSON schema (transformers'
get_json_schema) goes to the chat template, which shows it to the model; the model calls it in the
template's format (Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` for Qwen and the embedded
model, Llama's JSON, Mistral's [TOOL_CALLS], ...), read by the parser of that format that vLLM or transformers
ships (tool_calls.py: --tool_call_parser, chosen by a round trip through the template); the results come back as
`tool` messages, rendered by the template. An environment is a factory of instances whose public
methods are tools, with `reset(**row)` (which may return text for the last user message), an
optional `get_reward()`, and (ours) an optional `turn_prefix()`: text each model turn starts with, given,
not sampled (open_turns). Any of them may be async.

What this file holds: loading tools, their schemas, the checks a chat template must pass (it renders
tools, calls and results, and adding a turn only appends tokens), running the
user's code under deadlines (a trajectory's calls in the order written), the token ids a new turn appends
to a trajectory (never re-tokenizing what the model wrote), and the multi-turn rollout.
"""
import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import math
import sys
import threading
import time
import traceback

from jinja2 import TemplateError

from config import UsageError
from data import prompt_messages
from rewards import named_parameters
from rollout import Episode, RolloutContext, slot_seed
from tool_calls import UNREAD, CallReader, reader_for
from utils import print0, sum_over_ranks


def load_callables(spec: str, flag: str) -> list:
    """module:f,module:g (importable from the working folder) -> the functions; UsageError naming the one that
    fails."""
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        module, _, fn = name.partition(":")
        try:
            out.append(getattr(importlib.import_module(module), fn))
        except (ImportError, AttributeError, ValueError) as e:
            raise UsageError(f"{flag} {name}: could not load it ({type(e).__name__}: {e}); give module:function with "
                             "the module importable from the working folder") from None
    return out


def tool_schemas(tools: list) -> list[dict]:
    """The JSON schema of each tool, as the chat template gets it; UsageError saying what a tool lacks, or
    naming two tools of one name (the model could only ever call one of them)."""
    names = [tool.__name__ for tool in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"two tools are named {twice[0]!r} (--tools and the environment's public methods share one "
                         "namespace, as the model calls a tool by name): rename one")
    return [_schema(getattr(tool, "__func__", tool)) for tool in tools]  # a method's schema is its function's


@functools.cache
def _schema(tool) -> dict:
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(tool)
    except Exception as e:
        raise UsageError(f"tool {getattr(tool, '__qualname__', tool)}: {e}. A tool needs type hints and a "
                         "Google-style docstring that describes every argument (Args: name: what it is)") from None


def environment_tools(instance) -> list:
    """The public methods of an environment instance, as TRL finds them: functions of its class (inherited
    ones too), not starting with '_', but reset and get_reward (and turn_prefix, ours: tools.start_turn); by
    name."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward", "turn_prefix")]


def render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_tool_template(tokenizer, model: str):
    """A one-line UsageError unless the model's chat template shows the model its tools (the schema), renders
    a call in an assistant turn and a tool's result, and only appends tokens when a tool turn is added."""
    def probe(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b
    schema = tool_schemas([probe])
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": call_id(0), "function": {"name": "probe", "arguments": {"a": 1729, "b": 4104}}}]}
    conversation = [{"role": "user", "content": "What is their sum?"}, call,
                    {"role": "tool", "name": "probe", "tool_call_id": call_id(0), "content": "5833"}]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=schema, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that refuses the tool role or the tool_calls field
        text = f"({type(e).__name__}: {e})"
    missing = [what for what, part in (("the tools' schema", "Add two numbers"), ("the call", "1729"),
                                       ("the result", "5833")) if part not in text]
    if missing:
        raise UsageError(f"the chat template of {model} does not render {', '.join(missing)}, so the model would never "
                         "see its tools: give a template that does with --chat_template FILE (templates/"
                         "chatml_tools.jinja is the embedded model's, Hermes style)")
    before = render(tokenizer, conversation[:2], schema, False)
    if render(tokenizer, conversation, schema, True)[:len(before)] != before:
        raise UsageError(f"the chat template of {model} renders a conversation differently once a tool turn is added, "
                         "so a trajectory's tokens would not be the ones the model saw: give one that only appends "
                         "(--chat_template FILE)")


def probe_trajectory(tokenizer, prompt, system_prompt: str, schemas: list[dict]) -> list[int]:
    """A fixed multi-turn trajectory for the weight-sync probe: the prompt with the tools, a call to the first
    tool, its answer and a last assistant turn, as the chat template renders them."""
    name = schemas[0]["function"]["name"]
    return render(tokenizer, prompt_messages(prompt, system_prompt) + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "id": call_id(0), "function": {"name": name, "arguments": {}}}]},
        {"role": "tool", "name": name, "tool_call_id": call_id(0), "content": "19"},
        {"role": "assistant", "content": "So the answer is \\boxed{19}."}], schemas, False)


def call_id(k: int) -> str:
    """The id of a trajectory's k-th call, in its assistant message and in its answer's tool message: nine letters
    and digits (Mistral's templates take no other), the same in every run (a template may render it)."""
    return f"call{k:05d}"


# -----------------------------------------------------------------------------
# running the user's code (tools, an environment's methods) so that none can hold up a step

class PastDeadline(Exception):
    """A coroutine of the user's did not finish by its deadline and was cancelled (run_together: it is
    late)."""


class TrajectoryLoop:
    """The event loop of one trajectory's coroutines (its async tools, reset, turn_prefix and get_reward),
    started at the first of them in a daemon thread of its own and stopped with close() when the trajectory
    ends. An async environment keeps one loop from its reset to its get_reward (it may hold loop-bound
    objects, a client, across its methods). A loop per trajectory, not one for the run: a coroutine that
    blocks its loop (time.sleep inside `async def`, which asyncio cannot interrupt) holds up its own
    trajectory alone, whose environment is stuck anyway, while every other trajectory's async calls go on. An
    async --tools function runs on the loop of the trajectory that calls it."""

    def __init__(self):
        self.loop, self.closed, self._lock = None, False, threading.Lock()

    def run(self, awaitable, deadline: float):
        """The awaitable's value, awaited on this loop until `deadline` (time.monotonic()); PastDeadline then,
        when its task is cancelled: an await that never returns ends there, a blocked loop at its next await.
        PastDeadline at once after close(): a factory abandoned at its deadline that returns later starts no
        loop nothing stops."""
        with self._lock:
            if self.closed:
                raise PastDeadline
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=_serve, args=(self.loop,), daemon=True).start()
        # A coroutine runs as it is: cancelled before its first step, it is closed (inside a wrapper, it would
        # never be awaited).
        future = asyncio.run_coroutine_threadsafe(
            awaitable if asyncio.iscoroutine(awaitable) else _awaited(awaitable), self.loop)
        concurrent.futures.wait([future], max(deadline - time.monotonic(), 0))
        if not future.done():
            future.cancel()
            raise PastDeadline
        return future.result()

    def close(self):
        """Stop the loop, if it started: its thread then cancels what still runs on it (a call past its
        deadline, a task the environment started) and ends, as asyncio.run ends (a blocked one once its call
        returns)."""
        with self._lock:
            self.closed = True
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.loop.stop)


def _serve(loop: asyncio.AbstractEventLoop):
    """A TrajectoryLoop's thread: run the loop until it is stopped, then cancel its tasks and close it."""
    asyncio.set_event_loop(loop)
    loop.run_forever()
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


async def _awaited(awaitable):
    return await awaitable


def call_user(fn, loop: TrajectoryLoop, deadline: float, /, *args, **kwargs):
    """fn(*args, **kwargs), awaited on the trajectory's `loop` until `deadline` if it returns an awaitable (an
    async tool, reset, turn_prefix or get_reward; PastDeadline after it). Positional-only: a tool's arguments
    take any name."""
    out = fn(*args, **kwargs)
    return loop.run(out, deadline) if inspect.isawaitable(out) else out


def run_together(jobs: list, timeout: float, what: str) -> list[tuple[object, str | None]]:
    """Each job on a daemon thread of its own, all at once, under one deadline `timeout` s from now, which
    each job gets as its one argument (time.monotonic(): call_user cancels a coroutine then): per job (its
    value, None), or (None, its traceback) if it raised, or (None, "`what` did not return within ...") if it
    had not returned by then or raised PastDeadline. A job past the deadline is abandoned: its thread runs on,
    but nothing waits for it, not even the process's exit (a pool's threads would hold it)."""
    deadline = time.monotonic() + timeout
    futures = [concurrent.futures.Future() for _ in jobs]
    for job, future in zip(jobs, futures):
        threading.Thread(target=_settle, args=(future, functools.partial(job, deadline)), daemon=True).start()
    concurrent.futures.wait(futures, timeout)
    return [(None, f"{what} did not return within {timeout:g} s (--tool_timeout)\n")
            if not f.done() or isinstance(f.exception(), PastDeadline) else
            (None, "".join(traceback.format_exception(f.exception()))) if f.exception() else (f.result(), None)
            for f in futures]


def _settle(future: concurrent.futures.Future, job):
    try:
        future.set_result(job())
    except BaseException as e:
        future.set_exception(e)


ANSWERED, FAILED, TIMED_OUT = "answered", "failed", "timed out"  # what became of a tool call (call_tools)


def call_tools(turns: list[tuple[list[dict], dict, TrajectoryLoop]], timeout: float) -> list[list[tuple[str, str]]]:
    """The tool calls of one turn of several trajectories, each (its calls, its {name: tool}, its loop): a
    trajectory's calls one after another in the order the model wrote them (a call may use what the one before
    left in the environment), the trajectories side by side, all under one deadline `timeout` s from now. Each
    call's answer is (the text of a tool message, ANSWERED, FAILED or TIMED_OUT): the tool's result, or an
    error the model reads: a tool that raises, is unknown or gets wrong arguments (FAILED), or one that has
    not answered by the deadline (TIMED_OUT, an async one cancelled then; the calls after it are not made, and
    time out with it)."""
    answers, late = [[] for _ in turns], threading.Event()

    def in_order(calls, tools, loop, out, deadline):
        for call in calls:
            if late.is_set():
                return
            out.append(_answer(call, tools, loop, deadline))
    run_together([functools.partial(in_order, calls, tools, loop, out)
                  for (calls, tools, loop), out in zip(turns, answers)], timeout, "a tool")
    late.set()
    done = [list(out) for out in answers]  # the calls that had answered by the deadline
    return [out + [(f"error: the tool {call['name']} did not answer within {timeout:g} s" if k == 0 else
                    f"error: the tool {call['name']} was not called: the call before it did not answer in time",
                    TIMED_OUT) for k, call in enumerate(calls[len(out):])] for (calls, _, _), out in zip(turns, done)]


def _answer(call: dict, tools: dict, loop: TrajectoryLoop, deadline: float) -> tuple[str, str]:
    if call["name"] not in tools:
        return f"error: there is no tool {call['name']!r}; the tools are {', '.join(sorted(tools))}", FAILED
    try:
        return str(call_user(tools[call["name"]], loop, deadline, **call["arguments"])), ANSWERED
    except PastDeadline:  # too late: call_tools answers for this call and the ones after it
        raise
    except Exception as e:
        return f"error: {type(e).__name__}: {e}", FAILED


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn in the chat template, which need not be the tokenizer's eos
    (ChatML's <|im_end|> is SmolLM2's eos; Gemma's <end_of_turn> and Llama-3's <|eot_id|> are not): the first
    special token the template writes after an assistant message's content, as a rendering of one shows; eos
    if it writes none."""
    mark = "nanogrpo's end-of-turn probe"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": mark}],
                                         tokenize=False)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} | set(
        tokenizer.all_special_ids)
    after = tokenizer.encode(text[text.rindex(mark) + len(mark):], add_special_tokens=False)
    return next((i for i in after if i in special), tokenizer.eos_token_id)


def appended_ids(tokenizer, messages: list[dict], new: list[dict], tools: list[dict] | None,
                 ended_with: int | None = None) -> list[int] | None:
    """The token ids that follow the model's last turn (the last of `messages`) when the messages `new` are added
    and the next turn starts: the template's rendering of `messages + new` past that of `messages`, cut after
    the token the model's turn ended with: `ended_with`, the last token it sampled, where the template writes it
    in that turn (Gemma 4 ends a call turn with <|tool_response>, gpt-oss with <|call|>), else the template's
    end-of-turn token (tools.end_of_turn_id; ChatML's <|im_end|>, Llama 3's <|eot_id|>). A token the model ended
    with that the template writes only as the next turn's opening (GLM's <|observation|>) is not added twice.
    None if the longer rendering does not begin with the shorter (the template rewrites history: the
    trajectory's tokens would no longer be what the model saw), or the template refuses the conversation
    (Llama 3.1's takes one call per turn)."""
    try:
        before = render(tokenizer, messages, tools, False)
        after = render(tokenizer, messages + new, tools, True)
        turn = len(render(tokenizer, messages[:-1], tools, True)) if ended_with is not None else 0
    except TemplateError:  # the template's raise_exception
        return None
    if after[:len(before)] != before:
        return None
    end = end_of_turn_id(tokenizer) if ended_with is None or ended_with not in before[turn:] else ended_with
    ends = [i for i, t in enumerate(before) if t == end and i >= turn]
    suffix = after[ends[-1] + 1 if ends else len(before):]
    return suffix[1:] if not ends and ended_with is not None and suffix[:1] == [ended_with] else suffix


def open_turns(runs: list[dict], tokenizer, budget: int, timeout: float):
    """Give each live trajectory's next turn its environment's opening, if it has turn_prefix() and that
    returns text (e.g. the start of a tool call, for a model that writes none by itself): its tokens join the
    trajectory as given, not sampled (sampled=False), and the model continues from them. If they leave no
    room, what fits is the last turn ("length"). A turn_prefix that raises, or has not returned within
    `timeout` s (one deadline for all), ends its trajectory with an environment error."""
    opening = [r for r in runs if r["live"] and callable(getattr(r["env"], "turn_prefix", None))]
    for r, (prefix, error) in zip(opening, run_together([functools.partial(call_user, r["env"].turn_prefix, r["loop"])
                                                         for r in opening], timeout, "turn_prefix")):
        if error is None and prefix is not None and not isinstance(prefix, str):
            error = f"turn_prefix() returned a {type(prefix).__name__}; return text, or '' for none\n"
        if error is not None:
            r["live"], r["error"] = False, error
            continue
        ids = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
        if len(r["ids"]) + len(ids) >= budget:  # the prefix is cut to what fits, as the model's turn would be
            ids = ids[:budget - len(r["ids"])]
            r["messages"].append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
            r["finish"], r["live"] = "length", False
        r["ids"] += ids
        r["sampled"] += [False] * len(ids)
        r["logprobs"] += [math.nan] * len(ids)


def start_trajectories(rows: list[dict], ctx: RolloutContext, tools: list, env_factory, omit: tuple,
                       timeout: float) -> list[dict]:
    """Each trajectory's start: a fresh environment (env_factory()) reset with its row's columns but `omit` (a
    reset without **row gets those it names: `def reset(self, question, answer)` runs as it is), whose text,
    if any, ends the prompt's last user message. The factories and resets run side by side under one deadline
    `timeout` s from now; one that raises or misses it is the trajectory's environment error (it gets no
    reward). Each trajectory gets its event loop (TrajectoryLoop), which tool_rollout closes when the
    trajectories end."""
    G = ctx.num_generations

    def start(row, loop, deadline):
        env = env_factory()
        named = named_parameters(env.reset)  # None if it takes **row
        return env, call_user(env.reset, loop, deadline, **{k: v for k, v in row.items()
                                                            if k not in omit and (named is None or k in named)})
    slots, loops = range(len(rows) * G), [TrajectoryLoop() for _ in range(len(rows) * G)]
    started = run_together([functools.partial(start, rows[i // G], loops[i]) for i in slots], timeout,
                           "the environment's factory and reset") if env_factory else [(None, None) for _ in slots]
    runs = []
    for i, (value, error) in enumerate(started):
        env, observation = value or (None, None)
        row = rows[i // G]
        messages = prompt_messages(row["prompt"], ctx.system_prompt)
        if error is None and observation:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
        elif error is None and env is not None and not row["prompt"]:
            error = ("reset(**row) returned no text, and the row has no prompt (--dataset none): there it must return "
                     "the prompt, the same for the same seed\n")
        fns = list(tools) + (environment_tools(env) if env is not None else [])
        schemas = tool_schemas(fns)
        prompt_ids = render(ctx.tokenizer, messages, schemas, True)
        if error is None and ctx.max_prompt_length and len(prompt_ids) > ctx.max_prompt_length:
            error = (f"with reset's text the prompt has {len(prompt_ids)} tokens > --max_prompt_length "
                     f"{ctx.max_prompt_length}: raise it (and the server's --max-model-len), or shorten that text\n")
        runs.append(dict(row=row, slot=i, env=env, loop=loops[i], tools={f.__name__: f for f in fns},
                         schemas=schemas, messages=messages, start=len(messages), prompt_ids=prompt_ids, ids=[],
                         sampled=[], logprobs=[], finish="stop", live=error is None, error=error, calls=0,
                         failed_calls=0, timeouts=0, rewritten=False))
    return runs


def tool_rollout(rows: list[dict], ctx: RolloutContext, tools: list = (), env_factory=None, max_iterations: int = 5,
                 timeout: float = 30.0, omit: tuple = (), reader: CallReader | None = None) -> list[Episode]:
    """The multi-turn rollout (rollout.py's contract): G trajectories per row, advancing turn by turn
    together. A trajectory's tokens are its prompt, then each model turn as sampled (sampled=True) and the
    tokens the chat template adds for the tools' answers and the next turn (sampled=False: no loss, no
    importance weight), up to max_tokens in all; a turn that would pass it is cut and marked "length". Each
    model turn is a request of its own, with a seed of its own (rollout.slot_seed: no two turns of a step
    share a random stream) and the room its trajectory has left; a turn's requests are sent together, so the
    server batches them. Each trajectory gets a fresh environment (env_factory()), so a repeated call repeats.
    Tools, reset, turn_prefix and get_reward may be async (awaited on the trajectory's own event loop,
    TrajectoryLoop); each of them runs under a deadline of `timeout` s shared by all trajectories of that
    moment. The model's calls are read by `reader` (tool_calls.py; the run's is chosen at start, by
    --tool_call_parser); None: the parser that reads back a call the chat template writes (auto)."""
    runs = start_trajectories(rows, ctx, tools, env_factory, omit, timeout)
    try:
        if reader is None and runs:
            reader = reader_for("auto", ctx.tokenizer, runs[0]["schemas"], "the model")
        take_turns(runs, ctx, max_iterations, timeout, reader)
        rewards = environment_rewards_of(runs, timeout)
    # The loops end with their trajectories, also when the server was lost (the rollout then runs again).
    finally:
        for r in runs:
            r["loop"].close()
    return mark_groups_with_different_prompts([
        Episode(r["row"], r["prompt_ids"], r["ids"], r["sampled"], r["logprobs"], r["finish"],
                messages=r["messages"][r["start"]:],
                info={"tool_calls": r["calls"], "failed_tool_calls": r["failed_calls"], "tool_timeouts": r["timeouts"],
                      "template_rewrote_history": r["rewritten"],
                      "environment_error": error or r["error"], "environment_reward": reward})
        for r, (reward, error) in zip(runs, rewards)], ctx.num_generations)


def take_turns(runs: list[dict], ctx: RolloutContext, max_iterations: int, timeout: float, reader: CallReader):
    """The trajectories' turns, in place (tool_rollout): each live trajectory's model turn from the server,
    its calls as `reader` reads them, then their answers and the template's tokens for them, until no trajectory
    calls a tool, has room or turns left."""
    tokenizer, budget, end_of_turn = ctx.tokenizer, ctx.sampling["max_tokens"], end_of_turn_id(ctx.tokenizer)
    sampling = {k: v for k, v in ctx.sampling.items() if k != "max_tokens"}
    for turn in range(max_iterations + 1):
        for r in runs:
            r["turn_start"] = len(r["ids"])
        open_turns(runs, tokenizer, budget, timeout)
        live = [r for r in runs if r["live"]]
        if not live:
            break
        # A turn ends at the template's end-of-turn token, also where it is not the model's eos (Llama 3's
        # <|eot_id|>, Gemma's <end_of_turn>): past it the server would sample what no turn of the template holds.
        samples = ctx.client.generate_each([r["prompt_ids"] + r["ids"] for r in live],
                                           [budget - len(r["ids"]) for r in live],
                                           [slot_seed(ctx.seed, turn, r["slot"]) for r in live],
                                           stop_token_ids=[end_of_turn], **sampling)
        pending = []
        for r, s in zip(live, samples):
            room = budget - len(r["ids"])
            ids = s["token_ids"][:room]
            r["ids"] += ids
            r["sampled"] += [True] * len(ids)
            r["logprobs"] += s["logprobs"][:room]
            # The parser reads the turn's text to decide which tools to call, special tokens and all (formats mark
            # calls with them); the trajectory keeps the tokens as sampled.
            prefix = tokenizer.decode(r["prompt_ids"] + r["ids"][:r["turn_start"]], skip_special_tokens=False) \
                if reader.needs_prefix else ""
            turn_text = tokenizer.decode(r["ids"][r["turn_start"]:], skip_special_tokens=False)
            content, calls, errors = reader.read(turn_text, r["schemas"], prefix)
            r["messages"].append({"role": "assistant", "content": content, **({"tool_calls": [
                {"type": "function", "id": call_id(r["calls"] + k), "function": c} for k, c in enumerate(calls)]}
                if calls else {})})
            if s["finish_reason"] == "length" or len(s["token_ids"]) > room:
                r["finish"], r["live"] = "length", False
            elif not (calls or errors) or turn == max_iterations:
                r["live"] = False
            else:
                pending.append((r, calls, errors))
        answers = call_tools([(calls, r["tools"], r["loop"]) for r, calls, _ in pending], timeout)
        for (r, calls, errors), answered in zip(pending, answers):
            # Each answer names its call by id (an error's, one of its own), as templates that check ids want.
            first, r["calls"] = r["calls"], r["calls"] + len(calls) + len(errors)
            r["failed_calls"] += len(errors) + sum(outcome == FAILED for _, outcome in answered)
            r["timeouts"] += sum(outcome == TIMED_OUT for _, outcome in answered)
            new = [{"role": "tool", "name": name, "tool_call_id": call_id(first + k), "content": a}
                   for k, (name, a) in enumerate([(c["name"], a) for c, (a, _) in zip(calls, answered)]
                                                 + [("error", e) for e in errors])]
            suffix, r["messages"][-1] = answered_ids(tokenizer, r["messages"], new, r["schemas"],
                                                     r["ids"][-1] if r["ids"] else None, first + len(calls), errors)
            if suffix is None and errors:  # no rendering lets the model read its error: the call failed, counted
                r["live"] = False
            elif suffix is None:  # the template rewrote history or refused the turn: end it where it is exact
                r["live"], r["rewritten"] = False, True
            elif len(r["ids"]) + len(suffix) >= budget:  # no room left for the model's next turn
                r["finish"], r["live"] = "length", False
            else:
                r["messages"] += new
                r["ids"] += suffix
                r["sampled"] += [False] * len(suffix)
                r["logprobs"] += [math.nan] * len(suffix)


def answered_ids(tokenizer, messages: list[dict], new: list[dict], schemas: list[dict] | None, ended_with: int | None,
                 first_error: int, errors: list[str]) -> tuple[list[int] | None, dict]:
    """appended_ids of the tools' answers `new`, where the model must read each error of a call it wrote that could not
    be read (ids first_error, ...): as the turn is, or else with a placeholder call ("error", the error's id) for each
    in the model's turn (templates that take a tool message only as a call's answer drop or refuse it otherwise).
    Returns (the ids, the model's turn as rendered); (None, the turn) where no rendering holds every error."""
    turn = messages[-1]
    placed = {**turn, "tool_calls": turn.get("tool_calls", []) + [
        {"type": "function", "id": call_id(first_error + k), "function": {"name": "error", "arguments": {}}}
        for k in range(len(errors))]}
    for tried in [turn, placed] if errors else [turn]:
        suffix = appended_ids(tokenizer, messages[:-1] + [tried], new, schemas, ended_with)
        if suffix is not None and (not errors or tokenizer.decode(suffix).count(UNREAD) >= len(errors)):
            return suffix, tried
    return None, turn


def environment_rewards_of(runs: list[dict], timeout: float) -> list[tuple[float | None, str | None]]:
    """Each trajectory's get_reward(), all side by side under one deadline: (reward, None), (None, None) where
    the environment has no get_reward, failed before or says None (not applicable: no reward in its column
    alone), (None, the error) where it raises, misses the deadline or returns something that is not a
    number."""
    scored = [r for r in runs if r["error"] is None and callable(getattr(r["env"], "get_reward", None))]
    results = dict(zip(map(id, scored), run_together([functools.partial(call_user, r["env"].get_reward, r["loop"])
                                                      for r in scored], timeout, "get_reward")))
    return [reward_value(*results.get(id(r), (None, None)), "get_reward()") for r in runs]


def reward_value(value, error: str | None, what: str) -> tuple[float | None, str | None]:
    """What an environment's get_reward() or an agent returned, as (a reward or None, None) or (None, the
    error): a number, or None (not applicable); anything else is an error (the trajectory gets no reward)."""
    if error is not None:
        return None, error
    if value is None:
        return None, None
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value), None
    except (TypeError, ValueError):
        return None, f"{what} returned {value!r:.200}, a {type(value).__name__}: return a number, or None where it " \
                     "does not apply\n"


def mark_groups_with_different_prompts(episodes: list[Episode], G: int) -> list[Episode]:
    """Mark the first episode of each group of G whose prompts are not all the same (reset(**row) or an agent
    started them differently): GRPO compares the group as answers to one prompt (trajectory_metrics warns)."""
    for g in range(0, len(episodes), G):
        group = [e for e in episodes[g:g + G] if not e.info.get("environment_error")]
        if any(e.prompt_ids != group[0].prompt_ids for e in group):
            episodes[g].info["group_prompts_differ"] = True
    return episodes


def tool_rollout_for(cfg, tokenizer, vision: bool, tools_spec: str, env: str, reward_funcs: list[str],
                     omit: tuple = ()):
    """The multi-turn rollout of a task's tools (module:function,...) and environment (module:factory), its
    parts checked at start (one-line UsageErrors): (the rollout function, the environment's reward name (its
    class) if it has get_reward(), else None, the tools' schemas). reset(**row) gets the row's columns but
    `omit` (those nanogrpo added). The settings of every rollout come from cfg."""
    if vision:
        raise UsageError(f"{'--env' if env else '--tools'} with a vision-language model: multi-turn rollouts take "
                         "text-only models for now; train the VLM without them")
    tools, factory, reward_name = load_callables(tools_spec, "--tools"), None, None
    schemas = tool_schemas(tools)
    if env:
        module, _, name = env.partition(":")
        factory = load_callables(env, "--env")[0] if name else None
        if factory is None:
            raise UsageError(f"--env {env}: give module:factory (a class, or a function returning an instance)")
        try:
            probe = factory()
        except Exception as e:
            raise UsageError(f"--env {env}: making an instance raised {type(e).__name__}: {e}") from None
        if not callable(getattr(probe, "reset", None)):
            raise UsageError(f"--env {env}: {type(probe).__name__} has no reset(**row) method (it starts each "
                             "trajectory, and may return text for the prompt's last user message)")
        schemas = tool_schemas(tools + environment_tools(probe))
        reward_name = type(probe).__name__ if callable(getattr(probe, "get_reward", None)) else None
    check_tool_template(tokenizer, cfg.model)
    if not reward_funcs and not reward_name:
        raise UsageError("nothing gives a reward: name --reward_funcs, or give the environment a get_reward() method")
    rollout = functools.partial(tool_rollout, tools=tools, env_factory=factory,
                                max_iterations=cfg.max_tool_calling_iterations, timeout=cfg.tool_timeout, omit=omit)
    return rollout, reward_name, schemas


def read_chat_template(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"--chat_template {path}: cannot read it ({e.strerror}); give a Jinja template file") from None


def environment_rewards(episodes: list[Episode], scores: list[list[float]], scorer, columns: list[str],
                        column_of: list[str | None]) -> list[list[float]]:
    """The reward functions' scores (k lists) and a column per environment reward (`columns`, each named after
    its class): each trajectory's get_reward() in its environment's column (`column_of[i]`; None: no
    environment reward; a reward of None: not applicable, NaN there alone), NaN in the others. An episode
    whose environment failed (its factory, reset, turn_prefix or get_reward raised or timed out; an agent
    anywhere) gets NaN in every column, whatever its task's reward sources: no reward, like a failing reward
    function (counted in scorer.failures and scorer.failed[its column], the first error printed once)."""
    scores = [list(column) for column in scores] + [
        [e.info.get("environment_reward") if of == name else None for e, of in zip(episodes, column_of)]
        for name in columns]
    scorer.failed |= dict.fromkeys(columns, 0)
    scorer.attempted |= {name: column_of.count(name) for name in columns}
    for i, e in enumerate(episodes):
        if e.info.get("environment_error"):
            for column in scores:
                column[i] = math.nan
            scorer.failures += 1
            if column_of[i] is not None:
                scorer.failed[column_of[i]] += 1
            if "environment" not in scorer.reported:
                scorer.reported.add("environment")
                print(f"the environment failed on a trajectory (no reward for it; counted in scorer_failures; only "
                      f"its first error is shown):\n{e.info['environment_error']}", file=sys.stderr, flush=True)
    return [[math.nan if v is None else v for v in column] for column in scores]


def trajectory_metrics(episodes: list[Episode]) -> dict:
    """Over all ranks: tool calls per trajectory (each call the model wrote, read or not), those that failed
    (the parser could not read it, an unknown tool, wrong arguments, the tool raised) and those that timed out
    (no answer by --tool_timeout: the late call and the calls after it in its turn, not made), the completion
    tokens the model wrote and those the tools and the chat template added, trajectories ended because the
    template rewrote history or refused a turn (appended_ids), environments that failed, groups whose prompts
    differ (warned once: GRPO's baseline then compares answers to different prompts), agents' calls that started
    a new sample (an edited history)."""
    t = sum_over_ranks({"n": len(episodes), "calls": sum(e.info.get("tool_calls", 0) for e in episodes),
                        "failed_calls": sum(e.info.get("failed_tool_calls", 0) for e in episodes),
                        "timeouts": sum(e.info.get("tool_timeouts", 0) for e in episodes),
                        "model": sum(sum(e.sampled) for e in episodes),
                        "all": sum(len(e.completion_ids) for e in episodes),
                        "rewritten": sum(bool(e.info.get("template_rewrote_history")) for e in episodes),
                        "failed": sum(bool(e.info.get("environment_error")) for e in episodes),
                        "differ": sum(bool(e.info.get("group_prompts_differ")) for e in episodes),
                        "forks": sum(e.info.get("forks", 0) for e in episodes)})
    if t["differ"] and not _warned:
        _warned.append(True)
        print0(f"warning: in {t['differ']:g} group(s) the environment (reset(**row)) or the agent started the "
               "G trajectories of one row with different prompts, and GRPO compares them as answers to one prompt. "
               "Make the start depend on the row alone (with --dataset none, on its seed). Counted in "
               "tools/groups_with_different_prompts", file=sys.stderr)
    n = max(t["n"], 1.0)
    return {"tools/calls": t["calls"] / n, "tools/failed_calls": t["failed_calls"] / n,
            "tools/timeouts": t["timeouts"] / n,
            "completion_length/model": t["model"] / n, "completion_length/environment": (t["all"] - t["model"]) / n,
            "tools/template_rewrote_history": t["rewritten"], "environment_failures": t["failed"],
            "tools/groups_with_different_prompts": t["differ"], "agents/forks": t["forks"]}


_warned = []  # trajectory_metrics warned about groups with different prompts (once per run)
