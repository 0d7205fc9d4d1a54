"""Tools and environments (tools.py): the embedded model's tool template, parsing calls, running tools, the tokens
a tool turn appends, and multi-turn trajectories through the real server, token-exact."""
import math
import time

import pytest
import torch

from config import UsageError, default_model_path
from tools import DaemonThreads, appended_ids, call_tools, check_tool_template, parse_tool_calls, tool_schemas

SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
                    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>"
                    "\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
                    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def hangs(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_path())


def test_the_embedded_template_renders_as_smollm2s_without_tools_and_shows_tools_with_them(tokenizer):
    conversations = [[{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == \
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                              chat_template=SMOLLM2_TEMPLATE)
    check_tool_template(tokenizer, "smollm2-135m")  # renders tools, calls, results; only appends
    original = type(tokenizer).from_pretrained(default_model_path())
    original.chat_template = SMOLLM2_TEMPLATE
    with pytest.raises(UsageError, match="does not render the tools' schema, the call, so the model"):
        check_tool_template(original, "smollm2-135m")
    rewriting = tokenizer.chat_template.replace("(message['content'] or '')",
                                                "(message['content'] or '') + ('' if loop.last else ' (earlier)')")
    original.chat_template = rewriting  # an assistant turn changes once a later turn exists
    with pytest.raises(UsageError, match="renders a conversation differently once a tool turn is added"):
        check_tool_template(original, "a model")


def test_tool_calls_are_parsed_and_malformed_ones_become_errors_for_the_model():
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": add}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    content, calls, errors = parse_tool_calls(text)
    assert content == "Let me add."
    assert calls == [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1}}]
    assert len(errors) == 2 and "could not be read" in errors[0] and "not a JSON object" in errors[1]
    assert parse_tool_calls("no call here") == ("no call here", [], [])


def test_tools_answer_with_their_result_or_an_error_and_a_hung_one_is_abandoned():
    tools = {"add": add, "hangs": hangs}
    calls = [({"name": "add", "arguments": {"a": 2, "b": 3}}, tools), ({"name": "sub", "arguments": {}}, tools),
             ({"name": "add", "arguments": {"a": 1, "c": 2}}, tools), ({"name": "hangs", "arguments": {"seconds": 30}}, tools)]
    out = call_tools(calls, 1.0, DaemonThreads())  # the hung call's thread is a daemon: it holds nothing up
    assert out[0] == "5" and "there is no tool 'sub'" in out[1] and "unexpected keyword argument 'c'" in out[2]
    assert out[3] == "error: the tool hangs did not answer within 1 s"
    with pytest.raises(UsageError, match="Google-style docstring"):
        tool_schemas([lambda x: x])


def test_a_tool_turn_appends_exactly_the_templates_tokens_after_the_models_end_of_turn(tokenizer):
    schemas = tool_schemas([add])
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    new = [{"role": "tool", "name": "add", "content": "5"}]
    suffix = appended_ids(tokenizer, messages, new, schemas)
    full = tokenizer.apply_chat_template(messages + new, tools=schemas, add_generation_prompt=True, tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    assert full[-len(suffix):] == suffix and full[-len(suffix) - 1] == tokenizer.eos_token_id
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                                       "<|im_start|>assistant\n"


@pytest.mark.slow
def test_tools_and_an_environment_train_through_the_server_and_its_reward_is_a_column(server, tmp_path):
    """--tools and --env (tests.helpers.Guess, written as TRL's documentation writes environments) through the
    multi-turn rollout on 2 ranks: the environment's get_reward() is a reward column named after its class, beside
    the reward functions, which get the completion as messages."""
    import json
    from conftest import run_train
    _, metrics = run_train(server, tmp_path / "out", "--tools", "tests.helpers:add", "--env", "tests.helpers:Guess",
                           "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "2",
                           "--max_completion_length", "24", "--max_steps", "2", "--bf16", "false", "--no_save_model")
    assert len(metrics) == 2 and all(m["rewards/Guess"] == 0.0 for m in metrics)  # the random model never guesses
    assert all(m["completion_length/model"] > 0 and m["completion_length/environment"] >= 0 for m in metrics)
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert len(records) == 16 and all(set(r["rewards"]) == {"tests.helpers:brevity", "Guess"} for r in records)
    assert all("Guess my number" in r["prompt"] and '"name": "guess"' in r["prompt"] for r in records)


def test_an_agents_calls_make_one_trajectory_only_if_each_continues_the_one_before():
    from tools import agent_episode
    calls = [dict(messages=[{"role": "user", "content": "q"}], content="a", prompt_ids=[1, 2, 3], ids=[4, 5],
                  logprobs=[-0.1, -0.2], finish="stop"),
             dict(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                            {"role": "user", "content": "sure?"}], content="b", prompt_ids=[1, 2, 3, 4, 5, 6, 7],
                  ids=[8, 9], logprobs=[-0.3, -0.4], finish="stop")]
    e = agent_episode({"prompt": "q"}, calls, budget=10)
    assert e.prompt_ids == [1, 2, 3] and e.completion_ids == [4, 5, 6, 7, 8, 9] and e.finish_reason == "stop"
    assert e.sampled == [True, True, False, False, True, True]
    assert e.logprobs[:2] == [-0.1, -0.2] and math.isnan(e.logprobs[2]) and e.logprobs[4:] == [-0.3, -0.4]
    assert e.messages == [{"role": "assistant", "content": "a"}, {"role": "user", "content": "sure?"},
                          {"role": "assistant", "content": "b"}]
    cut = agent_episode({"prompt": "q"}, calls, budget=5)
    assert cut.completion_ids == [4, 5, 6, 7, 8] and cut.finish_reason == "length"
    calls[1]["prompt_ids"] = [1, 2, 3, 4, 55, 6, 7]  # the answer came back as other tokens
    with pytest.raises(ValueError, match="call 2 does not continue its trajectory: its prompt differs from the "
                                         "previous prompt and answer at token 4 of 5"):
        agent_episode({"prompt": "q"}, calls, budget=10)


@pytest.mark.slow
def test_openai_client_agents_train_and_an_unchained_one_is_refused(server, tmp_path):
    """Agents written with the plain openai package (tests.helpers) through the real server on 2 ranks: their calls
    become trajectories, their return value a reward column named after them; two calls that do not chain stop
    the run with a message that names the call."""
    import json
    from conftest import run_train
    args = ["--reward_funcs", "", "--num_generations", "4", "--prompts_per_step", "2", "--max_completion_length", "24",
            "--max_steps", "2", "--bf16", "false", "--no_save_model"]
    for agent in ("one_call_agent", "two_call_agent"):
        _, metrics = run_train(server, tmp_path / agent, "--env", f"tests.helpers:{agent}", *args)
        assert len(metrics) == 2 and all(math.isfinite(m[f"rewards/{agent}"]) and m["unscored_frac"] == 0
                                         for m in metrics), agent
        assert all(m["grad_norm"] > 0 for m in metrics)
        records = [json.loads(line) for line in open(tmp_path / agent / "metrics.jsonl")]
        assert records[-1]["tools/calls"] == (1.0 if agent == "two_call_agent" else 0.0)
    proc = run_train(server, tmp_path / "unchained", "--env", "tests.helpers:unchained_agent", *args, check=False)
    assert proc.returncode != 0 and "the agent's call 2 does not continue its trajectory" in proc.stderr


class Flaky:
    """An environment whose reset raises on the prompt "raise" and hangs on "hang"."""

    def reset(self, prompt, **kwargs) -> str:
        if prompt == "raise":
            raise RuntimeError("no game today")
        if prompt == "hang":
            time.sleep(60)
        return ""

    def get_reward(self) -> float:
        return 1.0


class EndsAtOnce:
    """A stand-in for the server's client: every completion is the end-of-turn token."""

    def generate(self, prompts, n, **sampling):
        return [dict(token_ids=[2], logprobs=[-0.5], finish_reason="stop")] * (len(prompts) * n)


def test_an_environment_that_raises_or_hangs_gives_its_trajectory_no_reward_and_holds_nothing_up(tokenizer, capfd):
    from rewards import RewardScorer
    from rollout import RolloutContext
    from tools import environment_rewards, tool_rollout
    ctx = RolloutContext(EndsAtOnce(), tokenizer, 2, dict(max_tokens=8, temperature=1.0), seed=1)
    rows = [{"prompt": "raise"}, {"prompt": "hang"}, {"prompt": "fine"}]
    t = time.monotonic()
    episodes = tool_rollout(rows, ctx, env_factory=Flaky, timeout=1.0)
    assert time.monotonic() - t < 30  # the hung resets were abandoned after their second
    assert "no game today" in episodes[0].extra["environment_error"]
    assert "did not return within 1 s" in episodes[2].extra["environment_error"]
    assert episodes[4].extra["environment_error"] is None and episodes[4].extra["environment_reward"] == 1.0
    assert episodes[4].completion_ids == [2] and episodes[0].completion_ids == []
    scorer = RewardScorer([], ["prompt"])
    scores = environment_rewards(episodes, [], scorer, "Flaky")
    assert [math.isnan(v) for v in scores[0]] == [True] * 4 + [False] * 2 and scorer.failures == 4
    assert scorer.failed["Flaky"] == 4 and "no game today" in capfd.readouterr().err
