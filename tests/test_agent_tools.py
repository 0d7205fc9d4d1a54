"""OpenAI tool calling for agents and the end of a turn (issue 59, items 4 and 5): an agent that passes
`tools=[...]` gets `message.tool_calls` read by the run's parser and finish_reason "tool_calls", and its next call,
with that message and `role: "tool"` results, continues the sample token-exact; every turn (tool turns and agents'
answers) ends at the chat template's end-of-turn token, also where it is not the model's eos. On the real server
(the tiny model, and the embedded tool model, which writes its calls itself), a stand-in where the point is the
rollout's request."""
import asyncio
import functools
import json
import math
import os
from types import SimpleNamespace

import pytest

from agents import RecordingClient, agent_episode, agent_rollout
from embedded import Calculator, default_model_path, three_digit_problems
from rollout import RolloutContext
from tool_calls import reader_for
from tools import call_id, end_of_turn_id, tool_rollout, tool_schemas
from vllm_client import VLLMClient

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)


def ctx_of(client, tokenizer, G: int, max_tokens: int) -> RolloutContext:
    return RolloutContext(client, tokenizer, G, dict(max_tokens=max_tokens, **SAMPLING), seed=5)


@pytest.mark.slow
def test_a_turn_ends_at_the_templates_end_of_turn_token_on_the_server(server, tmp_path):
    """1) generate's stop_token_ids reach the server: a sample stops at the token named, kept as its last. 2) An
    agent of a model whose template ends turns with <|eot_id|>, not its eos (the tiny model with Llama 3.1's
    template and tokens), biased to write only <|eot_id|>: each answer is that one token, and the second call
    continues the sample. Before, the server sampled on past the end of the turn to max_tokens."""
    from transformers import AutoTokenizer
    from tests.agents_with_tools import biased_to_the_end_of_turn
    from tests.test_tool_calls import llama_model
    client = VLLMClient(port=server["port"])
    client.wait_for_health(60)
    free, = client.generate([[1, 2, 3]], 1, 12, seed=7, **SAMPLING)
    ids = free["token_ids"]
    at = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j] and ids[j] != 2)  # not eos, not seen before
    stopped, = client.generate([[1, 2, 3]], 1, 12, seed=7, stop_token_ids=[ids[at]], **SAMPLING)
    assert stopped["token_ids"] == ids[:at + 1] and stopped["finish_reason"] == "stop", (ids, stopped)

    llama = AutoTokenizer.from_pretrained(llama_model(server["model"], tmp_path / "llama"))
    end = end_of_turn_id(llama)
    assert llama.convert_ids_to_tokens(end) == "<|eot_id|>" and end != llama.eos_token_id
    e, = agent_rollout([{"prompt": "p", "end_of_turn": end}], ctx_of(client, llama, 1, 40),
                       agent=biased_to_the_end_of_turn, timeout=60)
    assert "environment_error" not in e.info and e.info["forks"] == 0, e.info
    assert [t for t, s in zip(e.completion_ids, e.sampled) if s] == [end, end] and e.finish_reason == "stop"


class StopsWhereTold:
    """A stand-in for the server whose model writes a call of add(2, 3), the end of the turn and then more, as a
    model may: it stops at a token of the request's stop_token_ids, as vLLM does (else at eos)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate_each(self, prompts, max_tokens, seeds, stop_token_ids=(), **sampling):
        t = self.tokenizer
        ids = t('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')["input_ids"] + \
            t.convert_tokens_to_ids(["<end_of_turn>"]) + t("and on it goes")["input_ids"] + [t.eos_token_id]
        ids = next((ids[:j + 1] for j, i in enumerate(ids) if i in stop_token_ids), ids)
        return [dict(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")] * len(prompts)


def test_a_tool_turn_asks_the_server_to_stop_at_the_templates_end_of_turn():
    """A Gemma-style template (<end_of_turn> is not eos): the turn the rollout keeps ends at <end_of_turn>, followed
    by the template's tokens for the tool's answer. Before, the request named no stop token, and the model's words
    after the end of its turn were trained as part of it."""
    from transformers import AutoTokenizer
    from tests.test_tools import add, gemma_style
    gemma = gemma_style(AutoTokenizer.from_pretrained(default_model_path()))
    reader = reader_for("auto", gemma, tool_schemas([add]), "gemma-style")
    e, = tool_rollout([{"prompt": "What is 2 + 3?"}], ctx_of(StopsWhereTold(gemma), gemma, 1, 200), tools=[add],
                      max_iterations=1, reader=reader)
    first_turn = gemma.decode(e.completion_ids[:e.sampled.index(False)])
    assert first_turn.endswith("</tool_call><end_of_turn>") and e.info["tool_calls"] == 1, first_turn
    assert gemma.decode(e.completion_ids).count("and on it goes") == 0


def test_an_agents_call_with_tools_where_no_parser_reads_the_template_is_its_error_saying_why():
    """A model whose chat template writes no tool calls (SmolLM2's own): the round trip finds no parser, the run
    goes on (an agent may call no tools), and a call with tools is the agent's error, naming --tool_call_parser,
    before any request (the client's port has no server)."""
    from conftest import free_port
    from transformers import AutoTokenizer
    from tests.agents_with_tools import calculator_agent
    from tests.test_tools import SMOLLM2_TEMPLATE
    plain = AutoTokenizer.from_pretrained(default_model_path())
    plain.chat_template = SMOLLM2_TEMPLATE
    client = VLLMClient(port=free_port())
    client.model_name = "m"
    e, = agent_rollout(three_digit_problems(0, seed=0, split="test")[:1], ctx_of(client, plain, 1, 40),
                       agent=calculator_agent, timeout=60)
    assert "the run reads no tool call of the model's chat template" in e.info["environment_error"]
    assert "--tool_call_parser" in e.info["environment_error"].splitlines()[-1]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The server on the embedded tool model, with vLLM's own tool-call parsing on its chat route (the flags of
    vllm serve)."""
    from conftest import running_server
    from embedded import tool_model_path
    with running_server(tool_model_path(), tmp_path_factory.mktemp("tool-server") / "server.log",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.mark.slow
def test_an_agent_gets_tool_calls_and_continues_its_sample_with_their_results(tool_server):
    """verifiers' ToolEnv loop (tests.agents_with_tools) on the embedded tool model, its answers sent back as the
    SDK's objects and as dicts: the calls the model writes come as message.tool_calls with finish_reason
    "tool_calls", and each next call (the answer, the tool's result) continues the sample: no fork, the results'
    tokens given (sampled=False), none of the model's. Before, an agent got no tool call back, and ran one turn.
    Also vLLM's own chat route, started with --enable-auto-tool-choice --tool-call-parser hermes, reads them."""
    import openai
    from transformers import AutoTokenizer
    from tests import agents_with_tools
    client = VLLMClient(port=tool_server["port"])
    client.wait_for_health(60)
    tokenizer = AutoTokenizer.from_pretrained(tool_server["model"])
    reader = reader_for("auto", tokenizer, [agents_with_tools.CALCULATE], "the tool model")
    rows = three_digit_problems(0, seed=0, split="test")[:2]
    for agent in (agents_with_tools.calculator_agent, agents_with_tools.calculator_agent_with_dicts):
        agents_with_tools.ANSWERS.clear()
        episodes = agent_rollout(rows, ctx_of(client, tokenizer, 4, 200), agent=agent, timeout=120, reader=reader)
        assert all("environment_error" not in e.info and e.info["forks"] == 0 for e in episodes), \
            [e.info for e in episodes]
        called = [e for e in episodes if e.info["tool_calls"] > 0]  # a second call: the first answer called a tool
        assert called and agents_with_tools.ANSWERS, agent.__name__
        assert all(finish == "tool_calls" and names == ["calculate"] for finish, names in agents_with_tools.ANSWERS)
        for e in called:
            given = tokenizer.decode([t for t, s in zip(e.completion_ids, e.sampled) if not s])
            sampled = tokenizer.decode([t for t, s in zip(e.completion_ids, e.sampled) if s])
            assert "<tool_response>" in given and "<tool_response>" not in sampled and "<tool_call>" in sampled
            assert e.messages[1]["role"] == "tool" and e.messages[1]["content"] in given
            assert all(math.isnan(p) for p, s in zip(e.logprobs, e.sampled) if not s)

    own = openai.OpenAI(base_url=client.base + "/v1", api_key="none").chat.completions.create(
        model=client.model_name, messages=[{"role": "user", "content": rows[0]["prompt"] + Calculator().reset()}],
        tools=[agents_with_tools.CALCULATE], n=8, max_tokens=48, seed=0)
    calls = [c for c in own.choices if c.message.tool_calls]
    assert calls and all(c.finish_reason == "tool_calls" for c in calls), [c.message for c in own.choices]
    assert json.loads(calls[0].message.tool_calls[0].function.arguments)["expression"]


@pytest.mark.slow
def test_a_tool_calling_agent_trains_without_forks(tool_server, tmp_path):
    """The ToolEnv-style agent trains 2 steps on 2 ranks on the embedded tool model: agents/forks 0, calls made
    (tools/calls > 0: an agent's second call follows a tool call), the tools' answers given, not trained
    (completion_length/environment > 0), each trajectory's reward its own."""
    from conftest import run_train
    proc, metrics = run_train(tool_server, tmp_path / "out", "--env", "tests.agents_with_tools:calculator_agent",
                              "--dataset", "three_digit", "--reward_funcs", "", "--num_generations", "4",
                              "--prompts_per_step", "2", "--max_completion_length", "200", "--max_steps", "2",
                              "--bf16", "false", "--no_save_model")
    assert "tool calls: hermes" in proc.stdout, proc.stdout[-2000:]  # the run's parser, from its round trip
    assert len(metrics) == 2 and all(m["agents/forks"] == 0 and math.isfinite(m["rewards/calculator_agent"])
                                     for m in metrics), metrics
    assert any(m["tools/calls"] > 0 for m in metrics) and all(m["completion_length/environment"] >= 0
                                                              for m in metrics)
    assert any(m["completion_length/environment"] > 0 for m in metrics)
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert len(records) == 16 and {r["reward"] for r in records} <= {0.0, 1.0}


class ServerRoutes:
    """A stand-in for vLLM's chat and completion routes under an agent's RecordingClient (no server): each answers
    `text` (the model's tokens) with `finish`, the chat route with vLLM's own reading of `calls` as
    message.tool_calls (as it does with tool_choice "required"); `routes` records the route of each request."""

    def __init__(self, tokenizer, text: str, finish: str = "stop", calls: tuple = ()):
        self.tokenizer, self.text, self.finish, self.calls, self.routes = tokenizer, text, finish, calls, []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.chat_route))
        self.completions = SimpleNamespace(create=self.completion_route)

    def ids(self) -> list[int]:
        return self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id] * (
            self.finish == "stop")

    async def chat_route(self, **request):
        import openai
        self.routes.append("chat")
        ids = self.ids()
        response = openai.types.chat.ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
                "index": 0, "finish_reason": self.finish,
                "logprobs": {"content": [{"token": "t", "logprob": -1.0, "bytes": None, "top_logprobs": []}
                                         for _ in ids]},
                "message": {"role": "assistant", "content": None if self.calls else self.text, "tool_calls": [
                    {"id": "chatcmpl-tool-1", "type": "function", "function": c} for c in self.calls]}}]})
        response.prompt_token_ids, response.choices[0].token_ids = [1, 2, 3], ids
        return response

    async def completion_route(self, **request):
        self.routes.append("completions")
        ids = self.ids()
        return SimpleNamespace(id="y", created=0, model="m", usage=None, choices=[SimpleNamespace(
            text=self.text, finish_reason=self.finish, token_ids=ids, logprobs=SimpleNamespace(
                token_logprobs=[-1.0] * len(ids)))])


def client_on(routes: ServerRoutes, tokenizer, reader):
    """An agent's RecordingClient whose requests go to `routes`."""
    server = SimpleNamespace(model_name="m", instance="", base="http://127.0.0.1:9", api_key="", request_timeout=0)
    client = RecordingClient(server, tokenizer, dict(max_tokens=100, **SAMPLING), 0, 0, reader)
    client._client = routes
    return client


@functools.cache
def tool_tokenizer_and_reader():
    from transformers import AutoTokenizer
    from tests.agents_with_tools import CALCULATE
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates", "chatml_tools.jinja")) as f:
        tokenizer.chat_template = f.read()
    return tokenizer, reader_for("auto", tokenizer, [CALCULATE], "m")


CALL_TEXT = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 2"}}\n</tool_call>'


def test_the_agents_sdks_unset_arguments_leave_its_calls_one_sample():
    """The OpenAI Agents SDK's keywords, NOT_GIVEN (or None) where unset, in a ToolEnv-like loop of two calls: the
    second continues the sample (completion route, forks 0), and a turn that only calls tools keeps content "" in
    the episode's messages (a TRL-style reward reads completion[-1]["content"]). Before, tool_choice=NOT_GIVEN
    counted as a constraint: both calls went to the chat route, forks 1; and the answer had no content key."""
    import openai
    from tests.agents_with_tools import CALCULATE
    tokenizer, reader = tool_tokenizer_and_reader()
    routes = ServerRoutes(tokenizer, CALL_TEXT)
    client = client_on(routes, tokenizer, reader)
    sdk = dict(tool_choice=openai.NOT_GIVEN, reasoning_effort=openai.NOT_GIVEN, parallel_tool_calls=openai.NOT_GIVEN,
               stream=False, store=openai.NOT_GIVEN, response_format=openai.NOT_GIVEN, max_tokens=openai.NOT_GIVEN,
               top_logprobs=None, n=openai.NOT_GIVEN)
    messages = [{"role": "user", "content": "1+2?"}]
    message = asyncio.run(client.chat.completions.create(model="m", messages=messages, tools=[CALCULATE],
                                                         **sdk)).choices[0].message
    assert agent_episode({}, [call for call in client.calls], 100).messages[-1]["content"] == ""
    messages += [{"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in message.tool_calls]},
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"}]
    asyncio.run(client.chat.completions.create(model="m", messages=messages, tools=[CALCULATE], **sdk))
    assert routes.routes == ["chat", "completions"] and client.forks == 0, (routes.routes, client.forks)
    assert agent_episode({}, client.calls, 100).messages[0]["content"] == ""


def test_a_required_tool_choice_keeps_vllms_calls_and_a_cut_answer_has_none():
    """tool_choice "required" (vLLM's chat route samples calls as a JSON list and reads them): the agent gets
    vLLM's calls, with the trajectory's ids, finish_reason "tool_calls". An answer cut at max_tokens (finish
    "length") returns no tool_calls, on either route. Before, the run's reader re-read the JSON list as no call
    (content the list's text, finish "stop"), and a call cut at max_tokens came back as one to make."""
    from tests.agents_with_tools import CALCULATE
    tokenizer, reader = tool_tokenizer_and_reader()
    call = {"name": "calculate", "arguments": '{"expression": "1 + 2"}'}
    routes = ServerRoutes(tokenizer, '[{"name": "calculate", "parameters": {"expression": "1 + 2"}}]', calls=(call,))
    client = client_on(routes, tokenizer, reader)
    choice = asyncio.run(client.chat.completions.create(messages=[{"role": "user", "content": "1+2?"}],
                                                        tools=[CALCULATE], tool_choice="required")).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].id == call_id(0), choice
    assert choice.message.tool_calls[0].function.model_dump() == call
    for route_calls in ((), (call,)):  # the completion route's answer (read by the run's reader), the chat route's
        routes = ServerRoutes(tokenizer, CALL_TEXT, finish="length", calls=route_calls)
        client = client_on(routes, tokenizer, reader)
        choice = asyncio.run(client.chat.completions.create(
            messages=[{"role": "user", "content": "1+2?"}], tools=[CALCULATE],
            **({"tool_choice": "required"} if route_calls else {}))).choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls, choice


# The construct of DeepSeek-V3's published template: a call's arguments joined to text with +, as the OpenAI API writes
# them (JSON text); the round trip's call gives a dict, on which the template fails with a TypeError.
DEEPSEEK_LIKE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<U>{{ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' and 'tool_calls' in message %}{% for tool in message['tool_calls'] %}"
    "{{ '<A><calls>' + tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + '\\n```' }}"
    "{% endfor %}{% elif message['role'] == 'assistant' %}<A>{{ message['content'] }}<end>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<A>{% endif %}")


def test_an_agent_run_starts_where_the_round_trip_fails_in_the_template():
    """A template that fails on the round trip's call (DeepSeek-V3's construct: TypeError): the run's start
    (Mixture.read_tool_calls) and agent_rollout without a reader go on, and an agent's call with tools is its error
    saying why. Before, the TypeError stopped the run with a traceback."""
    from conftest import free_port
    from transformers import AutoTokenizer
    from mixture import Mixture, Task
    from tests.agents_with_tools import calculator_agent
    deepseek = AutoTokenizer.from_pretrained(default_model_path())
    deepseek.chat_template = DEEPSEEK_LIKE
    client = VLLMClient(port=free_port())
    client.model_name = "m"
    rows = three_digit_problems(0, seed=0, split="test")[:1]
    task = Task(name="a", dataset="x", reward_funcs="", env="tests.agents_with_tools:calculator_agent", rows=rows,
                eval_rows=rows, env_reward="calculator_agent")
    task.rollout_fn = functools.partial(agent_rollout, agent=calculator_agent, timeout=60)
    said = Mixture([task], mixed=False).read_tool_calls("auto", deepseek, "deepseek-like")
    assert "no parser reads the chat template's calls" in said and task.rollout_fn.keywords["unread"], said
    for rollout in (task.rollout_fn, functools.partial(agent_rollout, agent=calculator_agent, timeout=60)):
        e, = rollout(rows, ctx_of(client, deepseek, 1, 40))
        assert "the run reads no tool call of the model's chat template (TypeError" in e.info["environment_error"]
