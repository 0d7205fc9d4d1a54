"""The multi-turn rollouts' rules (README: Environments and tools): independent samples, calls in the order written,
async environments, deadlines, what gets no reward, TRL's reset contract, token-exact agents that fork instead of
stopping; with stand-ins for the server where the point is the rollout, the real server where it is the server."""
import asyncio
import json
import math
import threading
import time

import pytest

from embedded import default_model_path
from rollout import RolloutContext, episodes_to_json
from tests.helpers import Echo
from tool_calls import reader_for
from tools import environment_rewards, tool_rollout


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_path())


def call_text(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class Scripted:
    """A stand-in for the server's client: each turn of each trajectory is answer(its context as text), then the
    end-of-turn token (`end`, else eos); each request's max_tokens and seed are recorded, a list per turn."""

    def __init__(self, tokenizer, answer, end: int | None = None):
        self.tokenizer, self.answer, self.turns = tokenizer, answer, []
        self.end = tokenizer.eos_token_id if end is None else end

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        self.turns.append({"max_tokens": list(max_tokens), "seeds": list(seeds)})
        out = []
        for p in prompts:
            ids = self.tokenizer(self.answer(self.tokenizer.decode(p)))["input_ids"] + [self.end]
            out.append(dict(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


def tool_answers(episode) -> list[str]:
    return [m["content"] for m in episode.messages if m["role"] == "tool"]


def test_every_turn_of_every_trajectory_has_its_own_seed_in_range_and_its_own_room(tokenizer):
    """Two tool turns of 2 rows x G=3: each request (one per trajectory and turn) has a seed no other has, within
    int64 however large the call's seed, and asks for the room its own trajectory has left."""
    def answer(context):  # trajectories of different lengths: the k-th of a row echoes k words
        if context.count("<tool_response>") >= 2:
            return "done"
        k = answer.calls = getattr(answer, "calls", 0) + 1
        return call_text("echo", text=" ".join(["word"] * (k % 3 + 1)))
    client = Scripted(tokenizer, answer)
    for seed in (1, 2 ** 70):  # a seed past int64, as a dynamic-sampling round of a large --seed makes
        client.turns = []
        ctx = RolloutContext(client, tokenizer, 3, dict(max_tokens=300, temperature=1.0), seed=seed)
        episodes = tool_rollout([{"prompt": "a"}, {"prompt": "b"}], ctx, env_factory=Echo, max_iterations=3)
        seeds = [s for turn in client.turns for s in turn["seeds"]]
        assert len(client.turns) == 3 and len(seeds) == 18 and len(set(seeds)) == 18
        assert all(0 <= s < 2 ** 63 - 1000 for s in seeds)
        for i, e in enumerate(episodes):  # each turn asked for what was left after the tokens before it
            starts = [j for j, s in enumerate(e.sampled) if s and (j == 0 or not e.sampled[j - 1])]
            assert [turn["max_tokens"][i] for turn in client.turns] == [300 - j for j in starts]
        assert len(set(client.turns[1]["max_tokens"])) > 1


@pytest.mark.slow
def test_the_trajectories_of_a_group_draw_from_streams_of_their_own_on_the_real_server(server, tokenizer):
    """After a first turn that is the same for all (a call of echo with each trajectory's own number), the G second
    turns come from the server: their contexts differ by a digit, and on the tiny near-uniform model a shared
    random stream would draw the same tokens for all of them. Each draws its own; the same call repeats exactly."""
    from vllm_client import VLLMClient

    class FirstTurnEchoes:
        def __init__(self):
            self.client, self.turn = VLLMClient(port=server["port"]), 0
            self.client.wait_for_health(60)

        def generate_each(self, prompts, max_tokens, seeds, **sampling):
            self.turn += 1
            if self.turn > 1:
                return self.client.generate_each(prompts, max_tokens, seeds, **sampling)
            ids = [tokenizer(call_text("echo", text=str(k)))["input_ids"] + [2] for k in range(len(prompts))]
            return [dict(token_ids=i, logprobs=[math.nan] * len(i), finish_reason="stop") for i in ids]

    def second_turns():
        ctx = RolloutContext(FirstTurnEchoes(), tokenizer, 6, dict(max_tokens=120, temperature=1.0), seed=7)
        return [tuple(e.completion_ids[e.sampled.index(True, e.sampled.index(False)):])
                for e in tool_rollout([{"prompt": "Echo."}], ctx, env_factory=Echo, max_iterations=1)]
    first = second_turns()
    assert all(len(t) >= 2 for t in first)
    assert len({t[:2] for t in first}) == 6, first  # no two share their first two tokens (of 49,152)
    assert second_turns() == first


def test_a_trajectory_is_exact_under_a_template_whose_turns_end_with_a_token_of_their_own(tokenizer):
    """A Gemma-style template (tests/test_tools.py), whose turns end with <end_of_turn>, not eos: a trajectory of two
    tool turns reads as the template renders its conversation, the model's turns as sampled (each ending with
    <end_of_turn>) and between them the template's text, from the newline after <end_of_turn> on."""
    from tests.test_tools import gemma_style
    gemma = gemma_style(tokenizer)
    client = Scripted(gemma, lambda context: "done" if context.count("<start_of_turn>tool") >= 2 else
                      call_text("echo", text="word"), end=gemma.convert_tokens_to_ids("<end_of_turn>"))
    ctx = RolloutContext(client, gemma, 2, dict(max_tokens=300, temperature=1.0), seed=1)
    for e in tool_rollout([{"prompt": "Echo twice."}], ctx, env_factory=Echo, max_iterations=3):
        assert tool_answers(e) == ["word", "word"]
        rendered = gemma.apply_chat_template([{"role": "user", "content": "Echo twice."}] + e.messages, tokenize=False)
        assert gemma.decode(e.prompt_ids + e.completion_ids) == rendered.removesuffix("\n")


class Files:
    """write(path, text) then read(path): a later call uses what an earlier one left in the environment."""

    def reset(self, **row):
        self.files = {}
        return ""

    def write(self, path: str, text: str) -> str:
        """Write a file.

        Args:
            path: its name
            text: its content
        """
        time.sleep(0.3)
        self.files[path] = text
        return "written"

    def read(self, path: str) -> str:
        """Read a file.

        Args:
            path: its name
        """
        return self.files[path] if path in self.files else "error: no such file"

    def hang(self) -> str:
        """Never answer."""
        time.sleep(60)
        return "woke"


def test_the_calls_of_a_turn_run_in_the_order_written_and_share_one_deadline(tokenizer):
    write_read = call_text("write", path="a", text="hello") + call_text("read", path="a")
    client = Scripted(tokenizer, lambda context: "done" if "<tool_response>" in context else write_read)
    ctx = RolloutContext(client, tokenizer, 2, dict(max_tokens=300, temperature=1.0), seed=1)
    for e in tool_rollout([{"prompt": "Write, then read."}], ctx, env_factory=Files, max_iterations=1):
        assert tool_answers(e) == ["written", "hello"]
    three_hangs = call_text("hang") * 3 + call_text("read", path="a")
    client.answer = lambda context: "done" if "<tool_response>" in context else three_hangs
    started = time.monotonic()
    episodes = tool_rollout([{"prompt": "Wait."}], ctx, env_factory=Files, max_iterations=1, timeout=1.0)
    assert time.monotonic() - started < 2.5  # one deadline for the turn, not one per hung call
    for e in episodes:
        assert tool_answers(e) == ["error: the tool hang did not answer within 1 s"] + [
            f"error: the tool {n} was not called: the call before it did not answer in time"
            for n in ("hang", "hang", "read")]


class AsyncCounter:
    """Async reset, tool and get_reward, which must share one event loop."""

    async def reset(self, **row):
        await asyncio.sleep(0.01)
        self.loop, self.count = asyncio.get_running_loop(), 0
        return " Count with bump."

    async def bump(self) -> str:
        """Count one more."""
        await asyncio.sleep(0.01)
        self.count += 1
        return f"count {self.count}"

    async def get_reward(self) -> float:
        return 0.25 * self.count if asyncio.get_running_loop() is self.loop else -1.0


def test_async_tools_reset_and_get_reward_are_awaited(tokenizer):
    client = Scripted(tokenizer, lambda context: "done" if "<tool_response>" in context else call_text("bump") * 2)
    ctx = RolloutContext(client, tokenizer, 2, dict(max_tokens=300, temperature=1.0), seed=1)
    for e in tool_rollout([{"prompt": "Count."}], ctx, env_factory=AsyncCounter):
        assert "Count with bump." in tokenizer.decode(e.prompt_ids)
        assert tool_answers(e) == ["count 1", "count 2"]
        assert e.info["environment_error"] is None and e.info["environment_reward"] == 0.5


class Stuck:
    """Async tools of three kinds: wait() awaits forever, block() blocks its event loop with time.sleep (as a
    synchronous client inside `async def` would; asyncio cannot interrupt it), quick() answers at once. Which ones a
    trajectory calls is its row's prompt. get_reward says whether it runs on the loop reset ran on."""
    cancelled = []  # (prompt, time.monotonic()) of each trajectory whose wait() was cancelled

    async def reset(self, prompt, **row):
        self.prompt, self.loop = prompt, asyncio.get_running_loop()
        return ""

    async def wait(self) -> str:
        """Wait for ever."""
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            Stuck.cancelled.append((self.prompt, time.monotonic()))
            raise
        return "woke"

    async def block(self) -> str:
        """Block the event loop."""
        time.sleep(4)
        return "unblocked"

    async def quick(self) -> str:
        """Answer at once."""
        await asyncio.sleep(0)
        return "quick"

    async def get_reward(self) -> float:
        return 1.0 if asyncio.get_running_loop() is self.loop else -1.0


def test_an_async_call_past_its_deadline_is_cancelled_and_one_that_blocks_holds_up_its_own_trajectory_alone(
        tokenizer):
    """One turn of three rows under a deadline of 1 s: a tool that awaits for ever is cancelled then (the task ends:
    nothing keeps running or waiting for it); one that blocks its event loop for 4 s holds up the calls of its own
    trajectory alone (its get_reward misses its deadline too), not the quick calls of the others, which answer on
    time on the loop their reset ran on. The calls that got no answer are counted as time-outs, apart from the
    malformed calls, and every thread the rollout started ends (the blocked one when its tool returns)."""
    from tools import trajectory_metrics
    calls = {"wait": call_text("wait") + call_text("quick"), "block": call_text("block"),
             "fine": call_text("quick") + "<tool_call>{not json</tool_call>"}
    client = Scripted(tokenizer, lambda context: "done" if "<tool_response>" in context else
                      next(c for row, c in calls.items() if f"Row {row}." in context))
    ctx = RolloutContext(client, tokenizer, 2, dict(max_tokens=300, temperature=1.0), seed=1)
    reader = reader_for("hermes", tokenizer, [], "smollm2-135m")  # chosen at start, as a run chooses it
    threads, Stuck.cancelled = set(threading.enumerate()), []
    started = time.monotonic()
    episodes = tool_rollout([{"prompt": f"Row {row}."} for row in calls], ctx, env_factory=Stuck, max_iterations=1,
                            timeout=1.0, reader=reader)
    assert time.monotonic() - started < 3.5  # the tools' deadline, then get_reward's; not the 4 s block
    assert [tool_answers(e) for e in episodes[::2]] == [
        ["error: the tool wait did not answer within 1 s",
         "error: the tool quick was not called: the call before it did not answer in time"],
        ["error: the tool block did not answer within 1 s"],
        ["quick", "error: the tool call '<tool_call>{not json</tool_call>' could not be read; a call is written as "
                  "'<tool_call>\\n{\"name\": \"add\", \"arguments\": {\"a\": 7, \"b\": 7}}\\n</tool_call>'"]]
    assert [prompt for prompt, _ in Stuck.cancelled] == ["Row wait."] * 2
    assert all(t - started < 1.6 for _, t in Stuck.cancelled)  # at the deadline, not when the rollout ends (2 s)
    rewards = [(e.info["environment_reward"], e.info["environment_error"]) for e in episodes]
    assert rewards[:2] == rewards[4:] == [(1.0, None)] * 2
    assert all(r is None and "get_reward did not return within 1 s" in error for r, error in rewards[2:4])
    assert [(e.info["tool_timeouts"], e.info["failed_tool_calls"]) for e in episodes[::2]] == [(2, 0), (1, 0), (0, 1)]
    metrics = trajectory_metrics(episodes)
    assert [metrics[f"tools/{k}"] for k in ("calls", "failed_calls", "timeouts")] == pytest.approx([10 / 6, 2 / 6, 1])
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - threads  # the rollout's threads, its loops' too, have all ended


class Slow:
    """A factory or a get_reward that hangs, each on its trajectories of the row "hang"."""

    def __init__(self, hang_in: str):
        self.hang_in = hang_in

    def reset(self, prompt, **row):
        self.prompt = prompt
        return ""

    def get_reward(self):
        if self.prompt == "hang" and self.hang_in == "get_reward":
            time.sleep(60)
        return {"none": None, "text": "high"}.get(self.prompt, 1.0)


def slow_factory(hangs: list):
    """A factory whose k-th call hangs if hangs[k]."""
    def make():
        if hangs.pop(0):
            time.sleep(60)
        return Slow("factory")
    return make


def test_factories_resets_and_rewards_run_under_one_deadline_and_what_gets_no_reward(tokenizer, capfd):
    from scorer import RewardScorer
    client = Scripted(tokenizer, lambda context: "done")
    ctx = RolloutContext(client, tokenizer, 3, dict(max_tokens=30, temperature=1.0), seed=1)
    rows = [{"prompt": p} for p in ("hang", "fine", "none", "text")]
    started = time.monotonic()
    episodes = tool_rollout(rows, ctx, env_factory=lambda: Slow("get_reward"), timeout=1.0)
    assert time.monotonic() - started < 2.5  # three hung get_reward calls cost one deadline
    info = [e.info for e in episodes]
    assert all("get_reward did not return within 1 s" in i["environment_error"] for i in info[:3])
    assert [i["environment_reward"] for i in info[3:9]] == [1.0] * 3 + [None] * 3  # None: not applicable
    assert all(i["environment_error"] is None for i in info[3:9])
    assert all("returned 'high', a str: return a number, or None" in i["environment_error"] for i in info[9:])
    scorer = RewardScorer([], ["prompt"])
    functions = [[0.5] * 12]  # a reward function that scores every completion
    scores = environment_rewards(episodes, functions, scorer, ["Slow"], ["Slow"] * 12)
    assert [math.isnan(v) for v in scores[0]] == [True] * 3 + [False] * 6 + [True] * 3  # failed: no reward at all
    assert [math.isnan(v) for v in scores[1]] == [True] * 3 + [False] * 3 + [True] * 6  # None: this column only
    assert scorer.failures == 6 and capfd.readouterr().err.count("the environment failed on a trajectory") == 1
    started = time.monotonic()
    episodes = tool_rollout(rows[1:2], ctx, env_factory=slow_factory([False, True, False]), timeout=1.0)
    assert time.monotonic() - started < 2.5  # a factory that hangs holds up nothing (the factories run at once)
    assert sum("factory and reset did not return within 1 s" in (e.info["environment_error"] or "")
               for e in episodes) == 1 and sum(e.info["environment_reward"] == 1.0 for e in episodes) == 2


class Quiz:
    """reset names the dataset's own columns (question, answer), not the "prompt" nanogrpo adds from question."""

    def reset(self, question, answer):
        self.answer = answer
        return f" ({question})"

    def get_reward(self) -> float:
        return float(self.answer)


def test_a_reset_that_names_its_columns_gets_those(tokenizer):
    ctx = RolloutContext(Scripted(tokenizer, lambda c: "done"), tokenizer, 2, dict(max_tokens=30, temperature=1.0),
                         seed=1)
    row = {"question": "What is 1 + 1?", "answer": "2", "prompt": "What is 1 + 1?"}  # as load_rows gives it
    for e in tool_rollout([row], ctx, env_factory=Quiz):
        assert e.info["environment_error"] is None and e.info["environment_reward"] == 2.0
        assert "(What is 1 + 1?)" in tokenizer.decode(e.prompt_ids)


def test_reset_text_that_makes_a_prompt_too_long_is_the_environments_error(tokenizer):
    class Verbose:
        def reset(self, **row):
            return " word" * 200
    ctx = RolloutContext(Scripted(tokenizer, lambda c: "done"), tokenizer, 2, dict(max_tokens=30, temperature=1.0),
                         seed=1, max_prompt_length=100)
    for e in tool_rollout([{"prompt": "Hi."}], ctx, env_factory=Verbose):
        assert "prompt has 2" in e.info["environment_error"] and "> --max_prompt_length 100" in \
            e.info["environment_error"] and e.completion_ids == []


def test_a_deeply_nested_tool_call_is_a_malformed_call_the_model_reads(tokenizer):
    reader = reader_for("hermes", tokenizer, [], "smollm2-135m")
    content, calls, errors = reader.read("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>")
    assert calls == [] and len(errors) == 1 and "could not be read" in errors[0]


def test_a_mixture_of_datasets_under_one_env_takes_the_envs_flags_not_a_tasks():
    from config import parse_config
    from mixture import parse_tasks
    alone = parse_config(["--dataset", "arithmetic", "--env", "calculator"])
    for t in parse_tasks(parse_config(["--dataset", "arithmetic,parity", "--env", "calculator"])):
        assert (t.system_prompt, t.reward_funcs) == (alone.system_prompt, alone.reward_funcs) == ("", "accuracy")


# ----------------------------------------------------------------------------- agents, on the real server

def agent_ctx(server, tokenizer, G: int, max_tokens: int = 40):
    from vllm_client import VLLMClient
    client = VLLMClient(port=server["port"])
    client.wait_for_health(60)
    return RolloutContext(client, tokenizer, G, dict(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                                                     min_p=0.0, repetition_penalty=1.0), seed=3)


@pytest.mark.slow
def test_an_agents_calls_are_token_exact_by_construction_and_an_edited_history_forks(server, tokenizer):
    """Two calls, the first answer passed back as the SDK message it came as: the second call continues the
    trajectory in token ids, so the server's re-scoring of the whole trajectory equals the sampler's log-probs of
    every token the model wrote (fp32), whatever words the random model wrote. A second call that does not continue
    the first starts a new sample (counted), and the run goes on."""
    from agents import agent_rollout
    from tests.helpers import free_two_call_agent, unchained_agent
    ctx = agent_ctx(server, tokenizer, G=4)
    episodes = agent_rollout([{"prompt": "Say something."}, {"prompt": "Another thing."}], ctx,
                             agent=free_two_call_agent, timeout=60)
    for e in episodes:
        assert "environment_error" not in e.info and e.info["forks"] == 0 and e.info["tool_calls"] == 1
        assert sum(e.sampled) >= 2
        theirs = ctx.client.prompt_logprobs(e.prompt_ids + e.completion_ids)[len(e.prompt_ids) - 1:]
        diffs = [abs(a - b) for a, b, s in zip(theirs, e.logprobs, e.sampled) if s]
        assert max(diffs) < 1e-4, diffs
        assert "Are you sure?" in tokenizer.decode(e.completion_ids)
    json.dumps(episodes_to_json(episodes))  # the SDK's message object is kept as a dict (an async checkpoint)
    for e in agent_rollout([{"prompt": "Hi"}], ctx, agent=unchained_agent, timeout=60):
        assert e.info["forks"] == 1 and "Be brief." in tokenizer.decode(e.prompt_ids)  # the sample since the fork
        first, = e.info["earlier_samples"]  # and the one before it, which trains too
        assert "Be brief." not in tokenizer.decode(first["prompt_ids"]) and sum(first["sampled"]) >= 1


async def says_high(client, row):
    await client.chat.completions.create(model=client.model, max_tokens=2,
                                         messages=[{"role": "user", "content": "Hi"}])
    return "high"


async def blocks(client, row):
    """Blocks its thread (a synchronous SDK would) on the rows that say so."""
    await client.chat.completions.create(model=client.model, max_tokens=2,
                                         messages=[{"role": "user", "content": "Hi"}])
    if row["prompt"] == "block":
        time.sleep(4)
    return 1.0


async def talks_long(client, row):
    """One long answer: the server's time, not the agent's."""
    await client.chat.completions.create(model=client.model, messages=[{"role": "user", "content": "Talk."}],
                                         extra_body={"min_tokens": 300, "ignore_eos": True})
    return 1.0


@pytest.mark.slow
def test_an_agent_that_returns_no_number_or_blocks_gets_no_reward_and_holds_up_no_other(server, tokenizer):
    from agents import agent_rollout
    ctx = agent_ctx(server, tokenizer, G=2)
    for e in agent_rollout([{"prompt": "Hi"}], ctx, agent=says_high, timeout=60):
        assert "the agent returned 'high', a str" in e.info["environment_error"]
    started = time.monotonic()
    episodes = agent_rollout([{"prompt": "block"}, {"prompt": "go"}], ctx, agent=blocks, timeout=1.0)
    assert time.monotonic() - started < 3.5  # the blocked agents are abandoned at their limit
    assert all("ran longer than 1 s of its own time" in e.info["environment_error"] for e in episodes[:2])
    assert all(e.info["environment_reward"] == 1.0 for e in episodes[2:])
    started = time.monotonic()
    episodes = agent_rollout([{"prompt": "Talk."}], agent_ctx(server, tokenizer, G=2, max_tokens=300), agent=talks_long,
                             timeout=0.3)
    assert time.monotonic() - started > 0.6  # the server took longer than the agent's limit, which it does not count
    assert all(e.info["environment_reward"] == 1.0 and len(e.completion_ids) == 300 for e in episodes)


# ----------------------------------------------------------------------------- through train.py

@pytest.mark.slow
def test_failed_environments_get_no_reward_and_a_rollouts_extra_fields_reach_the_reward_functions(server, tmp_path):
    """A mixture on 2 ranks: an environment without get_reward whose reset or turn_prefix raises on some rows (their
    trajectories get no reward, though a reward function scores every completion; they reach the functions as an
    empty answer, which TRL's reward_len, weighted 0 here, reads as completion[0]: each failure is counted once, as
    the environment's), and a custom rollout whose episodes carry an extra field that a reward function names (its
    reward is that field)."""
    from conftest import run_train
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("fine", "break it", "crash it", "fine too")))
    mixture = tmp_path / "mixture.json"
    mixture.write_text(json.dumps({"tasks": [
        {"name": "fragile", "dataset": str(rows), "env": "tests.helpers:Fragile",
         "reward_funcs": "tests.helpers:always_one,tests.trl_rewards:reward_len", "reward_weights": "1,0"},
        {"name": "secret", "dataset": str(rows), "rollout": "tests.helpers:with_secret",
         "reward_funcs": "tests.helpers:reads_secret"}]}))
    _, metrics = run_train(server, tmp_path / "out", "--dataset", str(mixture), "--num_generations", "2",
                           "--prompts_per_step", "4", "--max_completion_length", "8", "--max_steps", "3", "--bf16",
                           "false", "--no_save_model")
    failed = sum(m.get("environment_failures", 0) + m.get("eval/environment_failures", 0) for m in metrics)
    assert failed > 0 and [m["scorer_failures"] for m in metrics if "scorer_failures" in m][-1] == failed
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    fragile = [r for r in records if r["columns"]["task"] == "fragile"]
    secret = [r for r in records if r["columns"]["task"] == "secret"]
    assert fragile and secret
    for r in fragile:
        broken = "break" in r["prompt"] or "crash" in r["prompt"]
        assert r["reward"] == (None if broken else 1.0), r
    assert sorted({r["reward"] for r in secret}) == [0.0, 0.25]


@pytest.mark.slow
def test_reset_gets_the_datasets_columns_and_get_reward_none_is_not_applicable(server, tmp_path):
    """Two datasets under one environment (a mixture adds a `task` column) and a --seed whose request seeds would
    pass int64: reset(self, prompt, answer) runs unchanged, and a get_reward() of None leaves the reward
    functions' reward in place."""
    from conftest import run_train
    for name, answers in (("a", ["1", "none"]), ("b", ["none", "2"])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"Say {x}.", "answer": x}) + "\n"
                                                        for x in answers * 2))
    _, metrics = run_train(server, tmp_path / "out", "--dataset", f"a={tmp_path / 'a.jsonl'},b={tmp_path / 'b.jsonl'}",
                           "--env", "tests.helpers:Strict", "--reward_funcs", "tests.helpers:always_one",
                           "--num_generations", "2", "--prompts_per_step", "4", "--max_completion_length", "8",
                           "--max_steps", "2", "--bf16", "false", "--no_save_model", "--seed", "10000000000",
                           "--dynamic_sampling", "--dynamic_sampling_max_rounds", "1")
    assert all(m["environment_failures"] == 0 and m["scorer_failures"] == 0 for m in metrics)
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert records and all(r["reward"] == (1.0 if r["columns"]["answer"] == "none" else 1.5) for r in records)
    assert all(r["rewards"]["Strict"] is None for r in records if r["columns"]["answer"] == "none")
