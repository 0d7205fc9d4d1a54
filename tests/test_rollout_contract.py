"""Rollouts held to the server contract: every sample of a step has a random stream of its own, every request of a
rollout samples the policy it started with (tool turns while pushes land, --max_staleness K), and OpenAI-client agents as every rollout (agents.py): calls at once each with
their place and random stream, every sampling argument honoured on the token route, the budget and the prompt limit
counting what the model reads; a restarted server or a policy name gone is a lost server (the rollout is run again),
whatever the agent does with the error. A stand-in server where the point is the client's check, the real one
elsewhere."""
import asyncio
import functools
import http.server
import json
import threading
import time

import pytest

from agents import agent_rollout
from conftest import free_port
from embedded import default_model_path
from rollout import RolloutContext, generate, run_rollout
from tools import tool_rollout
from vllm_client import INSTANCE_HEADER, ServerLost, VLLMClient

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_path())


def ctx_of(client, tokenizer, G: int = 1, max_tokens: int = 40, max_prompt_length: int = 0) -> RolloutContext:
    return RolloutContext(client, tokenizer, G, dict(max_tokens=max_tokens, **SAMPLING), seed=5,
                          max_prompt_length=max_prompt_length)


async def two_at_once(client, row):
    """Two calls at once (asyncio.gather) on the same messages: 3 and then 5 tokens asked."""
    messages = [{"role": "user", "content": "Say something."}]
    a, b = await asyncio.gather(*(client.chat.completions.create(
        model=client.model, messages=messages, max_tokens=m, extra_body={"ignore_eos": True}) for m in (3, 5)))
    return float(a.choices[0].token_ids != b.choices[0].token_ids[:3])


async def biased_follow_up(client, row):
    """A first answer, then a follow-up continued as token ids, with a logit_bias that makes every token id 28 and a
    long question: its reward is the number of tokens the follow-up was allowed (it ignores the end of turn)."""
    messages = [{"role": "user", "content": "Hi"}]
    first = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
    messages += [first.choices[0].message, {"role": "user", "content": "Tell me more, " * 2}]
    second = await client.chat.completions.create(model=client.model, messages=messages, logit_bias={"28": 100},
                                                  extra_body={"ignore_eos": True})
    return float(len(second.choices[0].token_ids))


@pytest.mark.slow
def test_calls_at_once_each_have_a_stream_and_a_place_and_the_token_route_honours_every_argument(server, tokenizer):
    """1) Two calls at once: before, both got the same seed (the same answer), and the second to finish raised a
    TypeError in the client's bookkeeping, so the agent silently got no reward. Now each has its own stream, both are
    recorded in the order made (each its own sample: neither continues the other). 2) A follow-up sent as token ids
    keeps its logit_bias (before, dropped on that route), and is allowed what the sample has left after the new
    messages (before, they were not counted). 3) A prompt above --max_prompt_length is the agent's error."""
    client = VLLMClient(port=server["port"])
    client.wait_for_health(60)
    e, = agent_rollout([{"prompt": "p"}], ctx_of(client, tokenizer), agent=two_at_once, timeout=60)
    assert "environment_error" not in e.info and e.info["environment_reward"] == 1.0 and e.info["forks"] == 1
    first, = e.info["earlier_samples"]
    assert sum(first["sampled"]) == 3 and sum(e.sampled) == 5 and first["prompt_ids"] == e.prompt_ids

    e, = agent_rollout([{"prompt": "p"}], ctx_of(client, tokenizer, max_tokens=60), agent=biased_follow_up, timeout=60)
    assert "environment_error" not in e.info and e.info["forks"] == 0, e.info
    answer = [t for t, s in zip(e.completion_ids, e.sampled) if s]
    second = answer[-int(e.info["environment_reward"]):]
    assert second == [28] * len(second), tokenizer.decode(e.completion_ids)
    assert len(e.completion_ids) == 60  # the follow-up had exactly the room left: first answer + new messages + it

    e, = agent_rollout([{"prompt": "p"}], ctx_of(client, tokenizer, max_prompt_length=5), agent=biased_follow_up,
                       timeout=60)
    assert "> --max_prompt_length 5" in e.info["environment_error"]


class StandIn(http.server.BaseHTTPRequestHandler):
    """A server that answers every call as another instance (restarted), 404 (the policy's adapter gone), 500 (its
    engine died), or not for 30 s (hangs) while its /health names another instance."""
    answer = "restarted"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.answer == "hangs":
            time.sleep(30)
        status = {"gone": 404, "died": 500}.get(self.answer, 200)
        self.reply(status, "the one we pushed to" if status != 200 else "another",
                   {"error": {"message": "The model `policy-3` does not exist.", "code": status}})

    def do_GET(self):  # /health
        self.reply(200, "another", {})

    def reply(self, status: int, instance: str, answer: dict):
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header(INSTANCE_HEADER, instance)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


async def forgiving(client, row):
    """An agent that takes any error of its call as an answer it can live with."""
    try:
        await client.chat.completions.create(model=client.model, messages=[{"role": "user", "content": "Hi"}])
    except Exception:
        pass
    return 1.0


def test_a_restarted_server_or_a_policy_gone_is_a_lost_server_whatever_the_agent_does(tokenizer, monkeypatch):
    """Before, an agent's own client never looked at the server instance: a restarted server's answer (from the model
    on disk) trained; a 404 for the policy's adapter, a 500 (the engine died) or no server at all was the agent's
    error, or nothing if the agent caught it (a trajectory cut short, trained with the agent's reward); a call that
    hung waited 600 s, and then forever. Now each is a lost server (ServerLost: the trainer reconnects, pushes and
    runs the rollout again), also when the agent swallows the error; /health is watched while agents run (another
    instance there: lost at once), and a call past --vllm_request_timeout stops the run, as generate's would."""
    import agents
    from config import RunStopped
    monkeypatch.setattr(agents, "HEALTH_EVERY_S", 0.5)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        for StandIn.answer, port, expected in [("restarted", None, "restarted"), ("gone", None, "404"),
                                               ("died", None, "500"), ("nobody", free_port(), "failed"),
                                               ("hangs", None, "another instance answers /health")]:
            client = VLLMClient(port=port or httpd.server_address[1])
            client.model_name, client.instance = "policy-3", "the one we pushed to"
            started = time.monotonic()
            with pytest.raises(ServerLost, match=expected):
                agent_rollout([{"prompt": "p"}], ctx_of(client, tokenizer, G=2), agent=forgiving, timeout=60)
            assert time.monotonic() - started < 10, StandIn.answer
        StandIn.answer = "hangs"
        client = VLLMClient(port=httpd.server_address[1], request_timeout=1)
        client.model_name, client.instance = "policy-3", "another"  # /health is the one we pushed to
        with pytest.raises(RunStopped, match="took longer than --vllm_request_timeout 1s"):
            agent_rollout([{"prompt": "p"}], ctx_of(client, tokenizer, G=1), agent=forgiving, timeout=60)
    finally:
        httpd.shutdown()
        httpd.server_close()


class Completions(http.server.BaseHTTPRequestHandler):
    """A server whose every completion is a call of the tool `push` then the end of the turn; it records the model
    each request named."""
    answer, models = [], []

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Completions.models.append(request["model"])
        ids = Completions.answer
        body = json.dumps({"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop",
                                        "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]}).encode()
        self.send_response(200)
        self.send_header(INSTANCE_HEADER, "the one we pushed to")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_every_turn_of_a_rollout_samples_the_policy_it_started_with_while_pushes_land(tokenizer):
    """--max_staleness K with adapter sync: a push lands (the client now names policy-2) while a batch's tool turns
    are under way. Before, each turn named the client's model of its moment: turn 2 was sampled by policy-2 and
    trained as policy-1's. Now the rollout's client is pinned when it starts: every turn names policy-1."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = VLLMClient(port=httpd.server_address[1])
    client.model_name, client.instance = "policy-1", "the one we pushed to"

    def push(note: str) -> str:
        """A tool whose call is when the trainer's next push lands.

        Args:
            note: anything
        """
        client.model_name = "policy-2"  # as AdapterSync.push sets it, on the trainer's main thread
        return "pushed"
    Completions.answer = tokenizer('<tool_call>\n{"name": "push", "arguments": {"note": "x"}}\n</tool_call>')[
        "input_ids"] + [tokenizer.eos_token_id]
    try:
        episodes = run_rollout(functools.partial(tool_rollout, tools=[push], max_iterations=2), [{"prompt": "p"}],
                               ctx_of(client, tokenizer, max_tokens=200))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert episodes[0].info["tool_calls"] == 2 and len(Completions.models) == 3  # three turns, two pushes between
    assert Completions.models == ["policy-1"] * 3 and client.model_name == "policy-2"


@pytest.mark.slow
def test_every_sample_of_the_default_rollout_has_its_own_random_stream(server, tokenizer):
    """The same prompt twice in one call, G=3: before, the call was one request, whose j-th sample of every prompt
    had the seed + j: the two groups were the same samples. Now each prompt's request has a seed of its own."""
    client = VLLMClient(port=server["port"])
    client.wait_for_health(60)
    episodes = generate([{"prompt": "Say something."}] * 2, ctx_of(client, tokenizer, G=3, max_tokens=8))
    groups = [[e.completion_ids for e in episodes[g * 3:(g + 1) * 3]] for g in range(2)]
    assert groups[0] != groups[1], groups  # (before, equal: the j-th samples shared a stream)
    assert generate([{"prompt": "Say something."}] * 2, ctx_of(client, tokenizer, G=3, max_tokens=8)) == episodes
