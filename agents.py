"""OpenAI-client agents (README: Environments and tools): `--env module:agent` names an async function

    async def agent(client, row) -> float | None

that calls `client.chat.completions.create(...)` as agent code does with the `openai` package, against the training
server, and returns its reward (a column named after it; None: not applicable). Its calls make one trajectory,
token-exact by construction: a call whose messages are the previous call's, the answer it returned and new messages
is sent as token ids (the previous prompt, the sampled ids, the chat template's ids of the new messages) through
the completion route, so nothing the model wrote is ever re-tokenized. A call whose history was edited (messages
that are not what was sent and returned) starts a new sample (counted in agents/forks); each sample of a
trajectory trains with the trajectory's reward.

Each agent runs in a thread and an event loop of its own, so one that blocks (a synchronous SDK, `requests`) holds
up no other; its time limit counts its own time, not the server's generation.
"""
import asyncio
import concurrent.futures
import functools
import inspect
import math
import threading
import time
import traceback
from types import SimpleNamespace


from config import UsageError
from rollout import Episode, RolloutContext, slot_seed
from tools import appended_ids, load_callables, mark_groups_with_different_prompts, reward_value
from vllm_server import ServerLost, structured


def is_agent(env: str) -> bool:
    """Whether --env names an agent (an async function) rather than an environment's factory."""
    return ":" in env and inspect.iscoroutinefunction(load_callables(env, "--env")[0])


def agent_rollout_for(cfg, env: str, tools_spec: str, vision: bool):
    """The rollout of the agent `env` names, as tools.tool_rollout_for returns one: (rollout, its reward column (the
    agent's name), no schemas); one-line UsageErrors for what an agent cannot have."""
    if tools_spec:
        raise UsageError(f"--env {env} is an agent, which calls its own tools: drop --tools")
    if vision:
        raise UsageError(f"--env {env} with a vision-language model: agents take text-only models for now")
    agent = load_callables(env, "--env")[0]
    return functools.partial(agent_rollout, agent=agent,
                             timeout=cfg.tool_timeout * (cfg.max_tool_calling_iterations + 1)), agent.__name__, None


def as_message(message) -> dict:
    """A chat message as a plain dict without empty fields (None, []), whether a dict or an SDK object
    (`messages.append(response.choices[0].message)`)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    return {k: v for k, v in dict(message).items() if v is not None and v != []}  # vLLM answers "tool_calls": []


class RecordingClient:
    """The client an agent gets: `client.chat.completions.create(messages=..., ...)` as the `openai` package has it
    (an openai.AsyncOpenAI underneath), against the training server, with the run's sampling settings, a seed per
    call and the rest of --max_completion_length as max_tokens. It records the token ids and log-probs of every
    call, from which the trajectory is built. `client.model` is the served model's name."""

    def __init__(self, server, tokenizer, sampling: dict, seed: int):
        self.model, self.calls, self.forks = server.model_name, [], 0
        self._tokenizer, self._sampling, self._seed = tokenizer, sampling, seed
        import openai  # ~1 s to import: only runs with an agent pay it
        self._openai = openai
        self._client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=server.api_key or "none", max_retries=0)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        self.started, self.server_seconds, self.waiting_since = time.monotonic(), 0.0, None

    def own_seconds(self) -> float:
        """The time the agent has run, less the time its calls waited for the server."""
        now = time.monotonic()
        return now - self.started - self.server_seconds - (now - self.waiting_since if self.waiting_since else 0.0)

    async def _create(self, messages: list, n: int = 1, tools: list | None = None, **kwargs):
        if n != 1:
            raise ValueError("an agent's call samples one answer (n=1); call again for another")
        messages = [as_message(m) for m in messages]
        s, room = self._sampling, max(self._sampling["max_tokens"] - trajectory_length(self.calls), 1)
        asked = kwargs.get("max_completion_tokens") or kwargs.get("max_tokens") or room
        sampling = dict(temperature=s["temperature"], top_p=s["top_p"], seed=slot_seed(self._seed, len(self.calls)),
                        max_tokens=min(asked, room),
                        extra_body={**(kwargs.pop("extra_body", None) or {}), "return_token_ids": True,
                                    "top_k": s["top_k"], "min_p": s["min_p"],
                                    "repetition_penalty": s["repetition_penalty"],
                                    **structured(s.get("structured_outputs_regex", ""))})
        for k in ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "logprobs"):
            kwargs.pop(k, None)  # the run's settings decide (the agent may ask for fewer tokens than are left)
        prompt_ids = self._continued(messages, tools)
        self.waiting_since = time.monotonic()
        try:
            if prompt_ids is None:
                self.forks += bool(self.calls)  # an edited history: a new sample starts here
                response = await self._client.chat.completions.create(
                    model=self.model, messages=messages, tools=tools or self._openai.NOT_GIVEN, n=1, logprobs=True,
                    **sampling, **kwargs)
                choice = response.choices[0]
                call = dict(prompt_ids=list(response.prompt_token_ids), content=choice.message.content,
                            logprobs=[t.logprob for t in choice.logprobs.content])
            else:
                response, call = await self._continue(prompt_ids, sampling, kwargs.get("stop"))
                choice = response.choices[0]
        finally:
            self.server_seconds += time.monotonic() - self.waiting_since
            self.waiting_since = None
        self.calls.append(dict(call, messages=messages, ids=list(choice.token_ids), finish=choice.finish_reason,
                               new_sample=prompt_ids is None))
        return response

    def _continued(self, messages: list[dict], tools: list | None) -> list[int] | None:
        """The prompt ids of a call that continues the one before (its messages begin with that call's and the answer
        it returned, unchanged): the ids the server saw and sampled (and the end-of-turn token, given, after an
        answer cut at max_tokens), and the chat template's ids of what follows. None for a first call, or one
        whose history was edited."""
        if not self.calls:
            return None
        last, eos = self.calls[-1], self._tokenizer.eos_token_id
        before = last["messages"] + [as_message({"role": "assistant", "content": last["content"]})]
        if len(messages) <= len(before) or messages[:len(before)] != before:
            return None
        suffix = appended_ids(self._tokenizer, before, messages[len(before):], tools)
        ended = last["ids"] if last["ids"][-1:] == [eos] else last["ids"] + [eos]
        return None if suffix is None else last["prompt_ids"] + ended + suffix

    async def _continue(self, prompt_ids: list[int], sampling: dict, stop) -> tuple:
        """A call as token ids through the completion route, answered as the chat route would answer it."""
        out = await self._client.completions.create(model=self.model, prompt=prompt_ids, logprobs=0,
                                                    stop=stop or self._openai.NOT_GIVEN, **sampling)
        choice = out.choices[0]
        response = self._openai.types.chat.ChatCompletion.model_validate({
            "id": out.id, "object": "chat.completion", "created": out.created, "model": out.model,
            "choices": [{"index": 0, "finish_reason": choice.finish_reason, "logprobs": None,
                         "message": {"role": "assistant", "content": choice.text}}],
            "usage": out.usage.model_dump() if out.usage else None})
        response.choices[0].token_ids = list(choice.token_ids)
        return response, dict(prompt_ids=prompt_ids, content=choice.text, logprobs=choice.logprobs.token_logprobs)


def trajectory_length(calls: list[dict]) -> int:
    """Tokens of the sample the calls are making, after its prompt: every answer since its first call (the first, or
    one whose history was edited) and the messages between them."""
    if not calls:
        return 0
    first = next(call for call in reversed(calls) if call["new_sample"])
    return len(calls[-1]["prompt_ids"]) + len(calls[-1]["ids"]) - len(first["prompt_ids"])


def agent_episode(row: dict, calls: list[dict], budget: int) -> Episode:
    """The trajectory of an agent's recorded calls: one sample from each new sample on (the first call, or one whose
    history was edited): that call's prompt, then each answer as sampled and the tokens the next call's prompt
    adds (sampled=False), cut at `budget` tokens after the prompt ("length"). The episode is the last sample; the
    ones before are its info["earlier_samples"], which train with its advantage (rollout.training_samples)."""
    starts = [k for k, call in enumerate(calls) if call["new_sample"]] + [len(calls)]
    samples = [sample_of(calls[a:b], budget) for a, b in zip(starts, starts[1:])]
    episode = Episode(row, **samples[-1])
    messages = calls[-1]["messages"][len(calls[starts[-2]]["messages"]):]
    episode.messages = messages + [{"role": "assistant", "content": calls[-1]["content"]}]
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


def agent_rollout(rows: list[dict], ctx: RolloutContext, agent=None, timeout: float = 300.0) -> list[Episode]:
    """G runs of `agent(client, row)` per row, all at once (their requests meet in the server's batches), each in a
    thread and event loop of its own with a RecordingClient seeded by its place, so a repeated call repeats. What
    the agent returns is its reward. An agent that raises, returns something that is not a number or None, or runs
    longer than `timeout` s of its own time (the server's generation not counted) gets no reward; one whose calls
    lost the server raises ServerLost (the trainer waits for it and runs this again)."""
    G = ctx.num_generations
    clients = [RecordingClient(ctx.client, ctx.tokenizer, ctx.sampling, slot_seed(ctx.seed, i))
               for i in range(len(rows) * G)]
    futures = [concurrent.futures.Future() for _ in clients]
    for i, (client, future) in enumerate(zip(clients, futures)):
        threading.Thread(target=_run_agent, args=(agent, client, rows[i // G], future), daemon=True).start()
    late = set()
    while pending := [i for i, f in enumerate(futures) if not f.done() and i not in late]:
        late |= {i for i in pending if clients[i].own_seconds() > timeout}
        concurrent.futures.wait([futures[i] for i in pending], 0.1, concurrent.futures.FIRST_COMPLETED)
    lost = [f.exception() for f in futures if f.done() and isinstance(f.exception(), ServerLost)]
    if lost:
        raise lost[0]
    episodes = []
    for i, (client, future) in enumerate(zip(clients, futures)):
        calls = list(client.calls)
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
        episode.info |= {"tool_calls": len(calls) - 1, "environment_reward": reward, "forks": client.forks}
        episodes.append(episode)
    return mark_groups_with_different_prompts(episodes, G)


def _run_agent(agent, client: RecordingClient, row: dict, future: concurrent.futures.Future):
    """One agent's run, in this thread's own event loop: (its return value, None), or (None, its traceback); a lost
    server is the future's exception (ServerLost)."""
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
