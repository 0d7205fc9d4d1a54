"""OpenAI-client agents (README: Environments and tools): `--env module:agent` names an async function

    async def agent(client, row) -> float | None

that calls `client.chat.completions.create(...)` as agent code does with the `openai` package, against the
training server, and returns its reward (a column named after it; None: not applicable). Its calls make one
trajectory, token-exact by construction: a call whose messages are the previous call's, the answer it returned
and new messages is sent as token ids (the previous prompt, the sampled ids, the chat template's ids of the
new messages) through the completion route, so nothing the model wrote is ever re-tokenized. A call whose
history was edited (messages that are not what was sent and returned) starts a new sample (counted in
agents/forks); each sample of a trajectory trains with the trajectory's reward.

Each agent runs in a thread and an event loop of its own, so one that blocks (a synchronous SDK, `requests`)
holds up no other; its time limit counts its own time, not the server's generation.
"""
import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import math
import threading
import time
import traceback
from types import SimpleNamespace


from config import RunStopped, UsageError
from rollout import Episode, RolloutContext, slot_seed
from tool_calls import CallReader, reader_for
from tools import (appended_ids, call_id, end_of_turn_id, load_callables, mark_groups_with_different_prompts,
                   reward_value)
from vllm_client import HEALTH_EVERY_S, INSTANCE_HEADER, ServerLost, structured


def is_agent(env: str) -> bool:
    """Whether --env names an agent (an async function) rather than an environment's factory."""
    return ":" in env and inspect.iscoroutinefunction(load_callables(env, "--env")[0])


def agent_rollout_for(cfg, env: str, tools_spec: str, vision: bool):
    """The rollout of the agent `env` names, as tools.tool_rollout_for returns one: (rollout, its reward
    column (the agent's name), no schemas); one-line UsageErrors for what an agent cannot have."""
    if tools_spec:
        raise UsageError(f"--env {env} is an agent, which calls its own tools: drop --tools")
    if vision:
        raise UsageError(f"--env {env} with a vision-language model: agents take text-only models for now")
    agent = load_callables(env, "--env")[0]
    return functools.partial(agent_rollout, agent=agent,
                             timeout=cfg.tool_timeout * (cfg.max_tool_calling_iterations + 1)), agent.__name__, None


def as_message(message) -> dict:
    """A chat message as a plain dict without empty fields (None, []), whether a dict or an SDK object
    (`messages.append(response.choices[0].message)`), its tool calls too (verifiers puts the SDK's in a dict)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    # vLLM answers with "tool_calls": [] where there are none.
    message = {k: v for k, v in dict(message).items() if v is not None and v != []}
    if "tool_calls" in message:
        message["tool_calls"] = [call.model_dump() if hasattr(call, "model_dump") else dict(call)
                                 for call in message["tool_calls"]]
    return message


def for_template(message) -> dict:
    """as_message, with each tool call as chat templates take one: {"type", "id", "function": {"name", "arguments":
    a dict}} (the OpenAI API writes arguments as JSON text)."""
    message = as_message(message)
    if "tool_calls" in message:
        message["tool_calls"] = [{"type": "function", "id": call.get("id"), "function": {
            "name": call["function"]["name"], "arguments": _arguments(call["function"].get("arguments"))}}
            for call in message["tool_calls"]]
    return message


def _arguments(arguments):
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def same_history(sent: list, ours: list) -> bool:
    """Whether the messages an agent sent are the ones of `ours`, as for_template reads them: a message whose content
    is None, "" or absent (an answer that only calls tools), its calls' arguments as JSON text or a dict."""
    def key(message):
        message = for_template(message)
        return {**message, "content": message.get("content") or ""}
    return len(sent) == len(ours) and all(key(a) == key(b) for a, b in zip(sent, ours))


# vLLM's request fields that say how the chat route renders a prompt.
CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
             "add_generation_prompt", "continue_final_message", "documents", "reasoning_effort", "include_reasoning",
             "mm_processor_kwargs", "media_io_kwargs")
# A call with any of these is rendered by the server, and starts a new sample. So is one whose tool_choice is
# "required" or names a tool: vLLM's chat route makes that a constraint on what is sampled.
RENDERING = {"chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
             "reasoning_effort"}
REFUSED = {"stream": "streams", "top_logprobs": "asks for top_logprobs", "stream_options": "streams",
           "prompt_logprobs": "asks for prompt_logprobs", "echo": "echoes its prompt"}


class RecordingClient:
    """The client an agent gets: `client.chat.completions.create(messages=..., ...)` as the `openai` package
    has it (an openai.AsyncOpenAI underneath), against the training server, with the run's sampling settings,
    a seed per call and the rest of --max_completion_length as max_tokens. It records the token ids and
    log-probs of every call, in the order the calls were made (calls at once, asyncio.gather, each have their
    place and random stream), from which the trajectory is built. Every answer must come from the server
    instance and the policy (model name) the rollout started with: another instance (a restart), or a 404 for
    the policy's adapter, marks the client `lost` (the trainer waits for the server and runs the rollout
    again), whatever the agent does with the error. `client.model` is the served model's name.

    A call with `tools=[...]` is answered as vLLM's chat route answers with --enable-auto-tool-choice: the calls
    in the model's answer, read by `reader` (the run's, tool_calls.py), in `message.tool_calls`, and finish_reason
    "tool_calls" (none in an answer cut at max_tokens); with tool_choice "required" or a tool's name, the calls
    vLLM's chat route reads itself. A next call that sends that message back (a dict or the SDK object) and
    `role: "tool"` messages continues the sample. Arguments left unset (NOT_GIVEN, None) are not given. Every
    answer ends at the chat template's end-of-turn token (tools.end_of_turn_id), also where it is not the model's
    eos. `unread`: why the run has no reader (a call with tools is then the agent's
    error)."""

    def __init__(self, server, tokenizer, sampling: dict, seed: int, max_prompt_length: int = 0,
                 reader: CallReader | None = None, unread: str = ""):
        self.model, self.calls, self.forks, self.lost, self.too_long = server.model_name, [], 0, None, None
        self._tokenizer, self._sampling, self._seed, self._max_prompt = tokenizer, sampling, seed, max_prompt_length
        self._instance, self._reader, self._unread, self.tool_calls = server.instance, reader, unread, 0
        self._end_of_turn = end_of_turn_id(tokenizer)
        # The special tokens a turn may end with (the end of turn, Gemma 4's <|tool_response>, gpt-oss's <|call|>).
        self._special = set(tokenizer.all_special_ids) | {
            i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        import httpx  # with openai, ~1 s to import: only runs with an agent pay for it
        import openai
        self._openai = openai
        # --vllm_request_timeout (0: none); agent_rollout watches /health meanwhile.
        self._limit = server.request_timeout or None
        self._client = openai.AsyncOpenAI(
            base_url=server.base + "/v1", api_key=server.api_key or "none", max_retries=0, timeout=self._limit,
            http_client=httpx.AsyncClient(timeout=self._limit, event_hooks={"response": [self._check_answer]}))
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        self.started, self.server_seconds, self.waiting_since, self.in_flight = time.monotonic(), 0.0, None, 0

    def own_seconds(self) -> float:
        """The time the agent has run, less the time its calls waited for the server (one or several at
        once)."""
        now, since = time.monotonic(), self.waiting_since
        return now - self.started - self.server_seconds - (now - since if since is not None else 0.0)

    async def _check_answer(self, response):
        """An answer from another instance of the server (restarted: it computes with the model on disk), or a
        404 for the policy's name (its adapter gone with a restart), is a lost server, not the agent's
        error."""
        instance = response.headers.get(INSTANCE_HEADER, self._instance)
        if self._instance and instance != self._instance:
            self.lost = f"{response.request.url.path}: the server restarted (another instance answered an agent's call)"
        elif response.status_code == 404:
            self.lost = f"{response.request.url.path}: the server does not serve {self.model!r} (404) any more"
        if self.lost:
            raise ServerLost(self.lost)

    async def _create(self, messages: list, **kwargs):
        # What the agent leaves unset, as the OpenAI SDK's callers write it (the Agents SDK: NOT_GIVEN; others: None),
        # is not set here either: it renders nothing and constrains nothing (the call continues its sample).
        kwargs = {k: v for k, v in kwargs.items()
                  if v is not None and not isinstance(v, self._openai.NotGiven | self._openai.Omit)}
        n, tools = kwargs.pop("n", 1), kwargs.pop("tools", None)
        if n != 1:
            raise ValueError("an agent's call samples one answer (n=1); call again for another")
        refused = [f"{k}: the call {why}" for k, why in REFUSED.items() if kwargs.get(k)]
        if refused:
            raise ValueError(f"nanogrpo's agent client cannot take {refused[0]}, which training cannot use; drop it")
        if tools and self._reader is None:
            raise ValueError(f"an agent's call with tools: the run reads no tool call of the model's chat template "
                             f"({self._unread}); name the parser with --tool_call_parser")
        messages, k = [as_message(m) for m in messages], len(self.calls)
        self.calls.append(None)  # keeps its place in the order the calls are made; filled when answered
        constrained = kwargs.get("tool_choice") not in (None, "auto", "none")
        by_server = RENDERING & set(kwargs) or constrained
        prompt_ids = None if by_server else self._continued(k, messages, tools)
        s, last = self._sampling, self.calls[k - 1] if k else None
        # The tokens this sample has used so far, which the rest of --max_completion_length leaves out.
        used = len(prompt_ids) - last["sample_prompt"] if prompt_ids is not None else 0
        asked = kwargs.pop("max_completion_tokens", None) or kwargs.pop("max_tokens", None) or s["max_tokens"]
        extra = kwargs.pop("extra_body", None) or {}
        # The answer ends at the template's end of turn, unless the agent asks for no end (ignore_eos).
        stop = [*(extra.get("stop_token_ids") or []), *[self._end_of_turn] * (not extra.get("ignore_eos"))]
        sampling = dict(temperature=s["temperature"], top_p=s["top_p"], seed=slot_seed(self._seed, k),
                        max_tokens=min(asked, max(s["max_tokens"] - used, 1)),
                        extra_body={**extra, "return_token_ids": True, "stop_token_ids": stop,
                                    "top_k": s["top_k"], "min_p": s["min_p"],
                                    "repetition_penalty": s["repetition_penalty"],
                                    **structured(s.get("structured_outputs_regex", ""))})
        for key in ("model", "temperature", "top_p", "seed", "logprobs"):
            # The run's settings decide these (the agent may still ask for fewer tokens than are left).
            kwargs.pop(key, None)
        with self._at_server():
            if prompt_ids is None:
                # An edited history (or one the server renders): a new sample starts here.
                self.forks += k > 0
                response = await self._client.chat.completions.create(
                    model=self.model, messages=messages, tools=tools or self._openai.NOT_GIVEN, n=1, logprobs=True,
                    **sampling, **kwargs)
                choice = response.choices[0]
                call = dict(prompt_ids=list(response.prompt_token_ids),
                            logprobs=[t.logprob for t in choice.logprobs.content])
                if self._max_prompt and len(call["prompt_ids"]) > self._max_prompt:
                    raise ValueError(f"an agent's call has a prompt of {len(call['prompt_ids'])} tokens > "
                                     f"--max_prompt_length {self._max_prompt}: raise it, or shorten the agent's "
                                     "messages")
                call["sample_prompt"] = len(call["prompt_ids"])
            else:
                response, call = await self._continue(prompt_ids, sampling, kwargs)
                call["sample_prompt"] = last["sample_prompt"]
                choice = response.choices[0]
        ids, finish = list(choice.token_ids), choice.finish_reason
        if tools and constrained:
            answer, failed = self._servers_answer(choice), 0
        elif tools:
            answer, failed = self._answer(choice, ids, tools, call["prompt_ids"])
        else:
            answer, failed = as_message({"role": "assistant", "content": choice.message.content}), 0
        self.calls[k] = dict(call, messages=messages, ids=ids, finish=finish, new_sample=prompt_ids is None,
                             answer=answer, failed_calls=failed)
        return response

    def _answer(self, choice, ids: list[int], tools: list, prompt_ids: list[int]) -> tuple[dict, int]:
        """The answer of a call with tools, as vLLM's chat route gives it with --enable-auto-tool-choice: the calls
        that the run's reader reads in the sampled tokens (decoded with their special tokens: formats mark calls
        with them) in choice.message.tool_calls, its text without them as the content (None if there is none),
        finish_reason "tool_calls"; the whole text as the content if it holds no call it can read. Each call's id
        is the trajectory's next (tools.call_id). Returns (the message, as_message reads it; the calls it could
        not read)."""
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        prefix = self._tokenizer.decode(prompt_ids, skip_special_tokens=False) if self._reader.needs_prefix else ""
        content, calls, errors = self._reader.read(text, tools, prefix)
        message = {"role": "assistant", "content": content or None}
        if choice.finish_reason == "length":  # cut at max_tokens: what it wrote is no call to make, as vLLM's answer
            calls, errors = [], []
        if calls:
            message["tool_calls"] = [{"type": "function", "id": call_id(self.tool_calls + n), "function": {
                "name": c["name"], "arguments": json.dumps(c["arguments"])}} for n, c in enumerate(calls)]
            self.tool_calls += len(calls)
            choice.finish_reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        else:
            message["content"] = self._tokenizer.decode(ids, skip_special_tokens=True)
        choice.message = self._openai.types.chat.ChatCompletionMessage.model_validate(message)
        return as_message(message), len(errors)

    def _servers_answer(self, choice) -> dict:
        """The answer of a call whose tool_choice is "required" or names a tool: vLLM's chat route samples only calls
        then, and reads them itself (message.tool_calls), kept with the trajectory's next ids (tools.call_id) and
        finish_reason "tool_calls"; none where the answer was cut at max_tokens."""
        calls = [] if choice.finish_reason == "length" else choice.message.tool_calls or []
        message = {"role": "assistant", "content": choice.message.content or None}
        if calls:
            message["tool_calls"] = [{"type": "function", "id": call_id(self.tool_calls + n), "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for n, c in enumerate(calls)]
            self.tool_calls += len(calls)
            choice.finish_reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        choice.message = self._openai.types.chat.ChatCompletionMessage.model_validate(message)
        return as_message(message)

    @contextlib.contextmanager
    def _at_server(self):
        """While one or more calls wait for the server: that time is not the agent's own. A call whose
        connection failed or that the server answered with a 5xx marks the server lost, a call past
        --vllm_request_timeout the run stopped, whatever the agent does with the error it then sees."""
        if self.in_flight == 0:
            self.waiting_since = time.monotonic()
        self.in_flight += 1
        try:
            yield
        except self._openai.APITimeoutError:
            self.too_long = (f"an agent's call to the vLLM server took longer than --vllm_request_timeout "
                             f"{self._limit:g}s, while it still answers /health: raise it, or 0 for no limit")
            raise
        except (self._openai.APIConnectionError, self._openai.InternalServerError) as e:
            self.lost = self.lost or f"an agent's request to the server failed: {type(e).__name__}: {e}"
            raise
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.server_seconds += time.monotonic() - self.waiting_since
                self.waiting_since = None

    def _continued(self, k: int, messages: list[dict], tools: list | None) -> list[int] | None:
        """The prompt ids of call k if it continues call k - 1 (its messages begin with that call's and the
        answer it returned, unchanged): the ids the server saw and sampled (and the end-of-turn token, given,
        after an answer cut at max_tokens), and the chat template's ids of what follows. None for a first
        call, one whose history was edited, or one made while call k - 1 still waits for its answer (calls at
        once: each its own sample)."""
        last, end = self.calls[k - 1] if k else None, self._end_of_turn
        if last is None:
            return None
        before = last["messages"] + [last["answer"]]
        if len(messages) <= len(before) or not same_history(messages[:len(before)], before):
            return None
        # A turn the model ended itself with a special token (its end of turn, Gemma 4's <|tool_response>) is
        # followed by what the template writes after that token; any other (cut at max_tokens, or by a stop
        # string, or at the model's eos where it is not the end of turn) gets the end-of-turn token, given.
        ids = last["ids"]
        ended_with = ids[-1] if last["finish"] != "length" and ids and ids[-1] in self._special and (
            ids[-1] != self._tokenizer.eos_token_id or ids[-1] == end) else None
        rendered = [for_template(m) for m in before]
        rendered[-1]["content"] = rendered[-1].get("content") or ""
        suffix = appended_ids(self._tokenizer, rendered, [for_template(m) for m in messages[len(before):]], tools,
                              ended_with)
        ended = ids if ended_with is not None or ids[-1:] == [end] else ids + [end]
        return None if suffix is None else last["prompt_ids"] + ended + suffix

    async def _continue(self, prompt_ids: list[int], sampling: dict, kwargs: dict) -> tuple:
        """A call as token ids through the completion route, answered as the chat route would answer it. Every
        other argument the agent gave (stop, penalties, logit_bias, response_format, ...) goes as it is:
        vLLM's completion route takes every sampling field its chat route takes."""
        extra = {**sampling.pop("extra_body"), **{k: v for k, v in kwargs.items() if k not in CHAT_ONLY}}
        out = await self._client.completions.create(model=self.model, prompt=prompt_ids, logprobs=0, extra_body=extra,
                                                    **sampling)
        choice = out.choices[0]
        response = self._openai.types.chat.ChatCompletion.model_validate({
            "id": out.id, "object": "chat.completion", "created": out.created, "model": out.model,
            "choices": [{"index": 0, "finish_reason": choice.finish_reason, "logprobs": None,
                         "message": {"role": "assistant", "content": choice.text}}],
            "usage": out.usage.model_dump() if out.usage else None})
        response.choices[0].token_ids = list(choice.token_ids)
        return response, dict(prompt_ids=prompt_ids, logprobs=choice.logprobs.token_logprobs)


def agent_episode(row: dict, calls: list[dict], budget: int) -> Episode:
    """The trajectory of an agent's recorded calls: one sample from each new sample on (the first call, or one
    whose history was edited): that call's prompt, then each answer as sampled and the tokens the next call's
    prompt adds (sampled=False), cut at `budget` tokens after the prompt ("length"). The episode is the last
    sample; the ones before are its info["earlier_samples"], which train with its advantage
    (rollout.training_samples)."""
    starts = [k for k, call in enumerate(calls) if call["new_sample"]] + [len(calls)]
    samples = [sample_of(calls[a:b], budget) for a, b in zip(starts, starts[1:])]
    episode = Episode(row, **samples[-1])
    messages = calls[-1]["messages"][len(calls[starts[-2]]["messages"]):]
    # An answer that only calls tools keeps content "" (as_message drops None): rewards read completion[-1]["content"].
    episode.messages = [{**m, "content": m.get("content") or ""} if m.get("role") == "assistant" else m
                        for m in messages + [calls[-1]["answer"]]]
    episode.info = {"earlier_samples": samples[:-1]} if len(samples) > 1 else {}
    return episode


def sample_of(calls: list[dict], budget: int) -> dict:
    """The Episode fields of one sample's calls (the first starts it, each next one continues it)."""
    ids, sampled, logprobs, context = [], [], [], calls[0]["prompt_ids"]
    for call in calls:
        added = call["prompt_ids"][len(context):]
        ids += added + call["ids"]
        sampled += [False] * len(added) + [True] * len(call["ids"])
        logprobs += [math.nan] * len(added) + call["logprobs"]
        context = call["prompt_ids"] + call["ids"]
    finish = "length" if len(ids) > budget or calls[-1]["finish"] == "length" else "stop"
    return dict(prompt_ids=calls[0]["prompt_ids"], completion_ids=ids[:budget], sampled=sampled[:budget],
                logprobs=logprobs[:budget], finish_reason=finish)


def agent_rollout(rows: list[dict], ctx: RolloutContext, agent=None, timeout: float = 300.0,
                  reader: CallReader | None = None, unread: str = "") -> list[Episode]:
    """G runs of `agent(client, row)` per row, all at once (their requests meet in the server's batches), each
    in a thread and event loop of its own with a RecordingClient seeded by its place, so a repeated call
    repeats. What the agent returns is its reward. An agent that raises, returns something that is not a
    number or None, or runs longer than `timeout` s of its own time (the server's generation not counted) gets
    no reward. The server is held to the contract of every rollout: if any call was answered by another
    instance, lost its connection or found the policy's name gone, or the server stops answering /health
    (asked every HEALTH_EVERY_S) for --vllm_server_timeout, this raises ServerLost (the trainer waits for the
    server and runs this again). The calls an agent's model writes, where it passes tools, are read by `reader`
    (the run's: Mixture.read_tool_calls); None: the parser that reads back a call the chat template writes (auto),
    unless `unread` says why none does."""
    G = ctx.num_generations
    if reader is None and not unread:
        try:
            reader = reader_for("auto", ctx.tokenizer, [], "the model")
        except Exception as e:  # no parser reads the template's calls, or the template fails on the round trip's
            unread = f"{type(e).__name__}: {e}"
    clients = [RecordingClient(ctx.client, ctx.tokenizer, ctx.sampling, slot_seed(ctx.seed, i), ctx.max_prompt_length,
                               reader, unread) for i in range(len(rows) * G)]
    futures = [concurrent.futures.Future() for _ in clients]
    for i, (client, future) in enumerate(zip(clients, futures)):
        threading.Thread(target=_run_agent, args=(agent, client, rows[i // G], future), daemon=True).start()
    late, watch = set(), HealthWatch(ctx.client)
    while pending := [i for i, f in enumerate(futures) if not f.done() and i not in late]:
        late |= {i for i in pending if clients[i].own_seconds() > timeout}
        concurrent.futures.wait([futures[i] for i in pending], 0.1, concurrent.futures.FIRST_COMPLETED)
        watch.check()
    lost = [c.lost for c in clients if c.lost] + [str(f.exception()) for f in futures
                                                  if f.done() and isinstance(f.exception(), ServerLost)]
    if lost:
        raise ServerLost(lost[0])
    if too_long := [c.too_long for c in clients if c.too_long]:
        raise RunStopped(too_long[0])
    episodes = []
    for i, (client, future) in enumerate(zip(clients, futures)):
        calls = [call for call in client.calls if call is not None]  # a call that raised has no answer
        reward, error = (None, f"the agent ran longer than {timeout:g} s of its own time (--tool_timeout x "
                               "(--max_tool_calling_iterations + 1))\n") if i in late else \
            reward_value(*future.result(), "the agent")
        if not calls and error is None:
            error = "the agent made no call to client.chat.completions.create\n"
        if error is not None:
            prompt_ids = calls[0]["prompt_ids"] if calls else ctx.encode(rows[i // G]["prompt"])
            episodes.append(Episode(rows[i // G], prompt_ids, [], [], [], "stop", messages=[],
                                    info={"environment_error": error}))
            continue
        episode = agent_episode(rows[i // G], calls, ctx.sampling["max_tokens"])
        episode.info |= {"tool_calls": len(calls) - 1, "environment_reward": reward, "forks": client.forks,
                         "failed_tool_calls": sum(call["failed_calls"] for call in calls)}
        episodes.append(episode)
    return mark_groups_with_different_prompts(episodes, G)


class HealthWatch:
    """While agents run (their requests have no time limit: a long generation is not a lost server), the
    server's /health every HEALTH_EVERY_S s, as VLLMClient does during its own requests: check() raises
    ServerLost if another instance answers (restarted) or none has for --vllm_server_timeout s."""

    def __init__(self, client):
        self.client, self.asked = client, time.monotonic()
        self.answered = self.asked

    def check(self):
        now = time.monotonic()
        if now - self.asked < HEALTH_EVERY_S:
            return
        self.asked, instance = now, self.client.health()
        if instance and self.client.instance and instance != self.client.instance:
            raise ServerLost("the server restarted while agents ran (another instance answers /health)")
        if instance is not None:
            self.answered = now
        elif now - self.answered > self.client.server_timeout:
            raise ServerLost(f"the server stopped answering /health ({now - self.answered:.0f}s > "
                             "--vllm_server_timeout) while agents ran")


def _run_agent(agent, client: RecordingClient, row: dict, future: concurrent.futures.Future):
    """One agent's run, in this thread's own event loop: (its return value, None), or (None, its traceback); a
    lost server is the future's exception (ServerLost)."""
    async def run():
        try:
            return await agent(client, row), None
        finally:
            await client._client.close()
    try:
        future.set_result(asyncio.run(run()))
    except (client._openai.APIConnectionError, client._openai.InternalServerError) as e:
        future.set_exception(ServerLost(f"an agent's request to the server failed: {e}"))
    except Exception:
        future.set_result((None, traceback.format_exc()))
