"""Tools and environments, TRL 1.16's contract (README: Environments and tools).

A tool is a typed Python function with a Google-style docstring: its JSON schema (transformers'
get_json_schema) goes to the chat template, which shows it to the model; the model calls it in the
template's format, here Hermes / Qwen2.5's, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
the results come back as `tool` messages. An environment is a factory of instances whose public
methods are tools, with `reset(**row)` (which may return text for the last user message), an
optional `get_reward()`, and (ours) an optional `turn_prefix()`: text each model turn starts with, given,
not sampled (start_turn).

What this file holds: loading tools, their schemas, the checks a chat template must pass (it renders
tools, calls and results, and adding a turn only appends tokens), parsing calls out of a turn, running
them with a time-out, and the token ids a new turn appends to a trajectory (never re-tokenizing what the
model wrote).
"""
import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import json
import math
import re
import sys
import threading
import traceback
from types import SimpleNamespace

from config import UsageError
from rollout import Episode, RolloutContext
from utils import prompt_messages, sum_over_ranks

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def load_callables(spec: str, flag: str) -> list:
    """module:f,module:g (importable from the working folder) -> the functions; UsageError naming the one that fails."""
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
    """The JSON schema of each tool, as the chat template gets it; UsageError saying what a tool lacks, or naming
    two tools of one name (the model could only ever call one of them)."""
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
    """The public methods of an environment instance, as TRL finds them: functions of its class (inherited ones
    too), not starting with '_', but reset and get_reward (and turn_prefix, ours: tools.start_turn); by name."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward", "turn_prefix")]


def render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_tool_template(tokenizer, model: str):
    """A one-line UsageError unless the model's chat template shows the model its tools (the schema), renders a
    call in an assistant turn and a tool's result, and only appends tokens when a tool turn is added."""
    def probe(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b
    schema = tool_schemas([probe])
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "probe", "arguments": {"a": 1729, "b": 4104}}}]}
    conversation = [{"role": "user", "content": "What is their sum?"}, call,
                    {"role": "tool", "name": "probe", "content": "5833"}]
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
    """A fixed multi-turn trajectory for the weight-sync probe: the prompt with the tools, a call to the first tool,
    its answer and a last assistant turn, as the chat template renders them."""
    name = schemas[0]["function"]["name"]
    return render(tokenizer, prompt_messages(prompt, system_prompt) + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {}}}]},
        {"role": "tool", "name": name, "content": "19"},
        {"role": "assistant", "content": "So the answer is \\boxed{19}."}], schemas, False)


def parse_tool_calls(text: str) -> tuple[str, list[dict], list[str]]:
    """An assistant turn's text -> (its content without the calls, the calls [{name, arguments}], and one error
    message per call that does not parse, for the model to read as the tool's answer)."""
    calls, errors = [], []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('it is not {"name": ..., "arguments": {...}}')
            arguments = call.get("arguments") or {}
            if not isinstance(arguments, dict):
                raise ValueError("its arguments are not a JSON object")
            calls.append({"name": call["name"], "arguments": arguments})
        except ValueError as e:  # json.JSONDecodeError is one
            errors.append(f"error: the tool call {body[:200]!r} could not be read ({e})")
    return TOOL_CALL.sub("", text).strip(), calls, errors


class DaemonThreads:
    """submit() as concurrent.futures executors have it, each call on a daemon thread of its own: a tool that hangs
    is abandoned after its time-out and never holds the process at exit (a ThreadPoolExecutor's threads would)."""

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()

        def run():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)
        threading.Thread(target=run, daemon=True).start()
        return future


def call_tools(calls: list[tuple[dict, dict]], timeout: float, pool: DaemonThreads) -> list[str]:
    """Run (call, {name: tool}) pairs concurrently; each result as the text of a tool message. A tool that raises,
    is unknown, gets wrong arguments or outlives `timeout` seconds answers with an error the model reads (a hung
    one is abandoned: its thread runs on, the trajectory does not wait)."""
    def run(call, tools):
        if call["name"] not in tools:
            return f"error: there is no tool {call['name']!r}; the tools are {', '.join(sorted(tools))}"
        return str(tools[call["name"]](**call["arguments"]))
    futures = [pool.submit(run, call, tools) for call, tools in calls]
    out = []
    for (call, _), future in zip(calls, futures):
        try:
            out.append(future.result(timeout=timeout))
        except concurrent.futures.TimeoutError:
            out.append(f"error: the tool {call['name']} did not answer within {timeout:g} s")
        except Exception as e:
            out.append(f"error: {type(e).__name__}: {e}")
    return out


def appended_ids(tokenizer, messages: list[dict], new: list[dict], tools: list[dict] | None) -> list[int] | None:
    """The token ids that follow the model's last turn (which ends with its end-of-turn token) when the messages
    `new` are added and the next turn starts: the template's rendering of `messages + new` past that of `messages`,
    cut after its last end-of-turn token. None if the longer rendering does not begin with the shorter (the
    template rewrites history: the trajectory's tokens would no longer be what the model saw)."""
    before = render(tokenizer, messages, tools, False)
    after = render(tokenizer, messages + new, tools, True)
    if after[:len(before)] != before:
        return None
    ends = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    return after[ends[-1] + 1 if ends else len(before):]


def sample_each(ctx: RolloutContext, contexts: list[list[int]], max_tokens: int, seed: int) -> list[dict]:
    """One completion of each of `contexts` (token ids), in as few requests as their repeats allow: identical
    contexts are one prompt with n = their count (with one seed, two requests for the same ids would get the
    same sample), so a turn is one request when every context is distinct, or all repeat equally."""
    positions = {}
    for i, c in enumerate(contexts):
        positions.setdefault(tuple(c), []).append(i)
    by_count = {}
    for c, where in positions.items():
        by_count.setdefault(len(where), []).append(c)
    out = [None] * len(contexts)
    for n, unique in sorted(by_count.items()):
        samples = ctx.client.generate([list(c) for c in unique], n=n, seed=seed + n,
                                      **{**ctx.sampling, "max_tokens": max_tokens})
        for j, c in enumerate(unique):
            for k, i in enumerate(positions[c]):
                out[i] = samples[j * n + k]
    return out


def start_turn(r: dict, tokenizer, budget: int, pool, timeout: float):
    """Give the model's next turn the environment's opening, if it has turn_prefix() and it returns text (e.g.
    the start of a tool call, for a model that writes none by itself): its tokens join the trajectory as given,
    not sampled (sampled=False), and the model continues from them. If they leave no room, what fits is the
    last turn ("length"); if turn_prefix raises, the trajectory ends with an environment error."""
    if r["env"] is None or not callable(getattr(r["env"], "turn_prefix", None)):
        return
    try:
        prefix = pool.submit(r["env"].turn_prefix).result(timeout=timeout)
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"turn_prefix() returned a {type(prefix).__name__}; return text, or '' for none")
    except concurrent.futures.TimeoutError:
        r["live"], r["error"] = False, f"turn_prefix did not return within {timeout:g} s (--tool_timeout)\n"
        return
    except Exception:
        r["live"], r["error"] = False, traceback.format_exc()
        return
    ids = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    if len(r["ids"]) + len(ids) >= budget:  # what fits is the turn, as the model's own would be cut
        ids = ids[:budget - len(r["ids"])]
        r["messages"].append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        r["finish"], r["live"] = "length", False
    r["ids"] += ids
    r["sampled"] += [False] * len(ids)
    r["logprobs"] += [math.nan] * len(ids)


def tool_rollout(rows: list[dict], ctx: RolloutContext, tools: list = (), env_factory=None, max_iterations: int = 5,
                 timeout: float = 30.0) -> list[Episode]:
    """The multi-turn rollout (rollout.py's contract): G trajectories per row, advancing turn by turn together,
    one request per turn for all that are still going. A trajectory's tokens are its prompt, then each model turn
    as sampled (sampled=True) and the tokens the chat template adds for the tools' answers and the next turn
    (sampled=False: no loss, no importance weight), up to max_tokens in all; a turn that would pass it is cut and
    marked "length". Each trajectory gets a fresh environment (env_factory()), so a repeated call repeats."""
    G, tokenizer, budget = ctx.num_generations, ctx.tokenizer, ctx.sampling["max_tokens"]
    pool = DaemonThreads()  # resets, tools and rewards run concurrently, each with a time-out
    envs = [env_factory() if env_factory else None for _ in range(len(rows) * G)]
    resets = [pool.submit(env.reset, **rows[i // G]) if env is not None else None for i, env in enumerate(envs)]
    runs = []
    for i, (env, reset) in enumerate(zip(envs, resets)):
        row, error = rows[i // G], None
        messages = prompt_messages(row["prompt"], ctx.system_prompt)
        if reset is not None:
            try:
                observation = reset.result(timeout=timeout)
                if observation:
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
                elif not row["prompt"]:
                    error = ("reset(**row) returned no text, and the row has no prompt (--dataset none): there it "
                             "must return the prompt, the same for the same seed\n")
            except concurrent.futures.TimeoutError:
                error = f"the environment's reset did not return within {timeout:g} s (--tool_timeout)\n"
            except Exception:
                error = traceback.format_exc()
        fns = list(tools) + (environment_tools(env) if env is not None else [])
        schemas = tool_schemas(fns)
        runs.append(dict(row=row, env=env, tools={f.__name__: f for f in fns}, schemas=schemas, messages=messages,
                         start=len(messages), prompt_ids=render(tokenizer, messages, schemas, True), ids=[],
                         sampled=[], logprobs=[], finish="stop", live=error is None, error=error, calls=0,
                         rewritten=False))
    for turn in range(max_iterations + 1):
        for r in runs:
            if r["live"]:
                r["turn_start"] = len(r["ids"])
                start_turn(r, tokenizer, budget, pool, timeout)
        live = [r for r in runs if r["live"]]
        if not live:
            break
        samples = sample_each(ctx, [r["prompt_ids"] + r["ids"] for r in live],
                              max(budget - len(r["ids"]) for r in live), ctx.seed * 1000 + turn * 97)
        pending = []
        for r, s in zip(live, samples):
            room = budget - len(r["ids"])
            ids = s["token_ids"][:room]
            r["ids"] += ids
            r["sampled"] += [True] * len(ids)
            r["logprobs"] += s["logprobs"][:room]
            text = tokenizer.decode(r["ids"][r["turn_start"]:], skip_special_tokens=True)
            content, calls, errors = parse_tool_calls(text)
            r["messages"].append({"role": "assistant", "content": content, **({"tool_calls": [
                {"type": "function", "function": c} for c in calls]} if calls else {})})
            if s["finish_reason"] == "length" or len(s["token_ids"]) > room:
                r["finish"], r["live"] = "length", False
            elif not (calls or errors) or turn == max_iterations:
                r["live"] = False
            else:
                pending.append((r, calls, errors))
        answers = iter(call_tools([(c, r["tools"]) for r, calls, _ in pending for c in calls], timeout, pool))
        for r, calls, errors in pending:
            r["calls"] += len(calls)
            new = ([{"role": "tool", "name": c["name"], "content": next(answers)} for c in calls]
                   + [{"role": "tool", "name": "error", "content": e} for e in errors])
            suffix = appended_ids(tokenizer, r["messages"], new, r["schemas"])
            if suffix is None:  # the template rewrote history: end the trajectory where it is exact
                r["live"], r["rewritten"] = False, True
            elif len(r["ids"]) + len(suffix) >= budget:  # no room left for the model's next turn
                r["finish"], r["live"] = "length", False
            else:
                r["messages"] += new
                r["ids"] += suffix
                r["sampled"] += [False] * len(suffix)
                r["logprobs"] += [math.nan] * len(suffix)
    episodes = []
    for r in runs:
        extra = {"tool_calls": r["calls"], "template_rewrote_history": r["rewritten"], "environment_error": r["error"]}
        if r["env"] is not None and hasattr(r["env"], "get_reward") and r["error"] is None:
            try:
                extra["environment_reward"] = float(pool.submit(r["env"].get_reward).result(timeout=timeout))
            except concurrent.futures.TimeoutError:
                extra["environment_error"] = f"get_reward did not return within {timeout:g} s (--tool_timeout)\n"
            except Exception:
                extra["environment_error"] = traceback.format_exc()
        episodes.append(Episode(r["row"], r["prompt_ids"], r["ids"], r["sampled"], r["logprobs"], r["finish"],
                                messages=r["messages"][r["start"]:], extra=extra))
    return mark_groups_with_different_prompts(episodes, G)


def mark_groups_with_different_prompts(episodes: list[Episode], G: int) -> list[Episode]:
    """Mark the first episode of each group of G whose prompts are not all the same (reset(**row) or an agent
    started them differently): GRPO compares the group as answers to one prompt (trajectory_metrics warns)."""
    for g in range(0, len(episodes), G):
        group = [e for e in episodes[g:g + G] if not e.extra.get("environment_error")]
        if any(e.prompt_ids != group[0].prompt_ids for e in group):
            episodes[g].extra["group_prompts_differ"] = True
    return episodes


def tool_rollout_for(cfg, tokenizer, vision: bool, tools_spec: str, env: str, reward_funcs: list[str]):
    """The multi-turn rollout of a task's tools (module:function,...) and environment (module:factory), its parts
    checked at start (one-line UsageErrors): (the rollout function, the environment's reward name (its class) if it
    has get_reward(), else None, the tools' schemas). The settings of every rollout come from cfg."""
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
        if inspect.iscoroutinefunction(factory):  # an OpenAI-client agent: async def agent(client, row)
            if tools:
                raise UsageError(f"--env {env} is an agent, which calls its own tools: drop --tools")
            rollout = functools.partial(agent_rollout, agent=factory,
                                        timeout=cfg.tool_timeout * (cfg.max_tool_calling_iterations + 1))
            return rollout, factory.__name__, None
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
                                max_iterations=cfg.max_tool_calling_iterations, timeout=cfg.tool_timeout)
    return rollout, reward_name, schemas


def read_chat_template(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"--chat_template {path}: cannot read it ({e.strerror}); give a Jinja template file") from None


def environment_rewards(episodes: list[Episode], scores: list[list[float]], scorer, columns: list[str],
                        column_of: list[str | None]) -> list[list[float]]:
    """The reward functions' scores (k lists) and a column per environment reward (`columns`, each named after its
    class): each trajectory's get_reward() in its environment's column (`column_of[i]`; None: no environment
    reward), NaN in the others. An episode whose environment raised (in reset or get_reward; an agent anywhere)
    gets NaN in every column: no reward, like a failing reward function (counted in scorer.failures and
    scorer.failed[its column], the first traceback printed once)."""
    scores = [list(column) for column in scores] + [
        [e.extra.get("environment_reward", math.nan) if of == name else math.nan
         for e, of in zip(episodes, column_of)] for name in columns]
    scorer.failed |= dict.fromkeys(columns, 0)
    scorer.attempted |= {name: column_of.count(name) for name in columns}
    for i, e in enumerate(episodes):
        if e.extra.get("environment_error"):
            for column in scores:
                column[i] = math.nan
            scorer.failures += 1
            if column_of[i] is not None:
                scorer.failed[column_of[i]] += 1
            if "environment" not in scorer.reported:
                scorer.reported.add("environment")
                print(f"the environment failed on a trajectory (no reward for it; counted in scorer_failures; only "
                      f"its first error is shown):\n{e.extra['environment_error']}", file=sys.stderr, flush=True)
    return [[math.nan if v is None else v for v in column] for column in scores]


def trajectory_metrics(episodes: list[Episode], is_main: bool) -> dict:
    """Over all ranks: tool calls per trajectory, the completion tokens the model wrote and those the tools and the
    chat template added, trajectories ended because the template rewrote history, environments that failed, groups
    whose prompts differ (warned once: GRPO's baseline then compares answers to different prompts)."""
    t = sum_over_ranks({"n": len(episodes), "calls": sum(e.extra.get("tool_calls", 0) for e in episodes),
                        "model": sum(sum(e.sampled) for e in episodes),
                        "all": sum(len(e.completion_ids) for e in episodes),
                        "rewritten": sum(bool(e.extra.get("template_rewrote_history")) for e in episodes),
                        "failed": sum(bool(e.extra.get("environment_error")) for e in episodes),
                        "differ": sum(bool(e.extra.get("group_prompts_differ")) for e in episodes)})
    if t["differ"] and is_main and not _warned:
        _warned.append(True)
        print(f"warning: in {t['differ']:g} group(s) the environment (reset(**row)) or the agent started the "
              "G trajectories of one row with different prompts, and GRPO compares them as answers to one prompt. "
              "Make the start depend on the row alone (with --dataset none, on its seed). Counted in "
              "tools/groups_with_different_prompts", file=sys.stderr, flush=True)
    n = max(t["n"], 1.0)
    return {"tools/calls": t["calls"] / n, "completion_length/model": t["model"] / n,
            "completion_length/environment": (t["all"] - t["model"]) / n,
            "tools/template_rewrote_history": t["rewritten"], "environment_failures": t["failed"],
            "tools/groups_with_different_prompts": t["differ"]}


_warned = []  # trajectory_metrics warned about groups with different prompts (once per run)


# -----------------------------------------------------------------------------
# OpenAI-client agents: an async function that gets a client and a row and calls client.chat.completions.create

class RecordingClient:
    """The client an agent gets: `client.chat.completions.create(messages=..., ...)` as the `openai` package has it
    (an openai.AsyncOpenAI underneath), against the training server, with the run's sampling settings, a seed per
    call and the rest of --max_completion_length as max_tokens; it records the token ids and log-probs of every
    call (vLLM's return_token_ids and logprobs), from which the trajectory is built. `client.model` is the name."""

    def __init__(self, server, sampling: dict, seed: int):
        import openai
        self.model, self.calls, self._sampling, self._seed = server.model_name, [], sampling, seed
        self._client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=server.api_key or "none", max_retries=0)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, messages: list[dict], n: int = 1, **kwargs):
        if n != 1:
            raise ValueError("an agent's call samples one answer (n=1); call again for another")
        s, used = self._sampling, trajectory_length(self.calls)
        extra = {**(kwargs.pop("extra_body", None) or {}), "return_token_ids": True, "top_k": s["top_k"],
                 "min_p": s["min_p"], "repetition_penalty": s["repetition_penalty"]}
        kwargs.update(model=self.model, messages=messages, n=1, seed=self._seed + len(self.calls), logprobs=True,
                      temperature=s["temperature"], top_p=s["top_p"], max_tokens=max(s["max_tokens"] - used, 1),
                      extra_body=extra)
        kwargs.pop("max_completion_tokens", None)
        response = await self._client.chat.completions.create(**kwargs)
        choice = response.choices[0]
        self.calls.append(dict(messages=list(messages), content=choice.message.content,
                               prompt_ids=list(response.prompt_token_ids), ids=list(choice.token_ids),
                               logprobs=[t.logprob for t in choice.logprobs.content], finish=choice.finish_reason))
        return response


def trajectory_length(calls: list[dict]) -> int:
    """Tokens after the first call's prompt: every answer and the messages between them."""
    return len(calls[-1]["prompt_ids"]) + len(calls[-1]["ids"]) - len(calls[0]["prompt_ids"]) if calls else 0


def agent_episode(row: dict, calls: list[dict], budget: int) -> Episode:
    """The trajectory of an agent's recorded calls: the first call's prompt, then each answer as sampled and the
    tokens the next call's prompt adds (sampled=False). Each call's prompt must begin with the previous prompt and
    answer, token for token (else the server re-tokenized what the model wrote, and the trajectory would not be
    what it saw: ValueError naming the call). Cut at `budget` tokens after the prompt ("length")."""
    ids, sampled, logprobs, context = [], [], [], calls[0]["prompt_ids"]
    for k, call in enumerate(calls):
        if call["prompt_ids"][:len(context)] != context:
            at = next(i for i, (a, b) in enumerate(zip(call["prompt_ids"], context + [-1])) if a != b)
            raise ValueError(f"the agent's call {k + 1} does not continue its trajectory: its prompt differs from the "
                             f"previous prompt and answer at token {at} of {len(context)} (the chat template rendered "
                             "the earlier turns as other tokens than the model's). Pass the earlier messages back as "
                             "they were, or keep each call's conversation apart")
        added = call["prompt_ids"][len(context):]
        ids += added + call["ids"]
        sampled += [False] * len(added) + [True] * len(call["ids"])
        logprobs += [math.nan] * len(added) + call["logprobs"]
        context = call["prompt_ids"] + call["ids"]
    finish = "length" if len(ids) > budget or calls[-1]["finish"] == "length" else "stop"
    messages = calls[-1]["messages"][len(calls[0]["messages"]):] + [{"role": "assistant",
                                                                     "content": calls[-1]["content"]}]
    return Episode(row, calls[0]["prompt_ids"], ids[:budget], sampled[:budget], logprobs[:budget], finish,
                   messages=messages)


def agent_rollout(rows: list[dict], ctx: RolloutContext, agent=None, timeout: float = 300.0) -> list[Episode]:
    """G runs of `agent(client, row)` per row, all at once (their requests meet in the server's batches), each with
    a RecordingClient seeded by its place, so a repeated call repeats. What the agent returns, if a number, is its
    reward (a column named after it). An agent that raises or outlives `timeout` seconds gets no reward; one whose
    calls lost the server raises ServerLost (the trainer waits for it and runs this again)."""
    import openai
    from vllm_server import ServerLost
    G = ctx.num_generations

    async def one(row, seed):
        client = RecordingClient(ctx.client, ctx.sampling, seed)
        try:
            reward = await asyncio.wait_for(agent(client, row), timeout)
            return client.calls, reward, None
        except openai.APIConnectionError as e:
            raise ServerLost(f"an agent's request to the server failed: {e}") from None
        except Exception:
            return client.calls, None, traceback.format_exc()

    async def every():
        return await asyncio.gather(*[one(rows[i // G], ctx.seed * 1000 + i) for i in range(len(rows) * G)])
    episodes = []
    for i, (calls, reward, error) in enumerate(asyncio.run(every())):
        if not calls and error is None:
            error = "the agent made no call to client.chat.completions.create\n"
        if error is not None:
            prompt_ids = calls[0]["prompt_ids"] if calls else ctx.encode(rows[i // G]["prompt"])
            episodes.append(Episode(rows[i // G], prompt_ids, [], [], [], "stop", messages=[],
                                    extra={"environment_error": error}))
            continue
        episode = agent_episode(rows[i // G], calls, ctx.sampling["max_tokens"])
        episode.extra = {"tool_calls": len(calls) - 1, "environment_reward": None if reward is None else float(reward)}
        episodes.append(episode)
    return mark_groups_with_different_prompts(episodes, G)
