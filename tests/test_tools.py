"""Tools and environments (tools.py): the embedded model's tool template, parsing calls, running tools, the tokens
a tool turn appends, and multi-turn trajectories through the real server, token-exact."""
import math
import time

import pytest
import torch

from config import UsageError
from embedded import default_model_path
from tools import TrajectoryLoop, appended_ids, call_tools, check_tool_template, end_of_turn_id, tool_schemas

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


def test_tools_answer_with_their_result_or_an_error_and_a_hung_one_is_abandoned():
    tools = {"add": add, "hangs": hangs}
    calls = [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "sub", "arguments": {}},
             {"name": "add", "arguments": {"a": 1, "c": 2}}, {"name": "hangs", "arguments": {"seconds": 30}}]
    answers = [answers[0] for answers in call_tools([([c], tools, TrajectoryLoop()) for c in calls], 1.0)]  # each
    out, outcomes = [text for text, _ in answers], [outcome for _, outcome in answers]  # its own trajectory
    assert out[0] == "5" and "there is no tool 'sub'" in out[1] and "unexpected keyword argument 'c'" in out[2]
    assert out[3] == "error: the tool hangs did not answer within 1 s"  # its thread is a daemon: it holds nothing up
    assert outcomes == ["answered", "failed", "failed", "timed out"]  # tools/failed_calls, tools/timeouts
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


# Gemma's turns, whose end is <end_of_turn>, not the tokenizer's eos: the assistant is "model", a call is written in
# the Hermes format and a tool's answer is a turn of its own.
GEMMA_STYLE_TEMPLATE = (
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] or '' }}{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>\n{{ call['function'] | tojson }}\n</tool_call>{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_style(tokenizer):
    """The tests' tokenizer with Gemma's turn tokens (special, not eos) and a template that ends turns with them."""
    gemma = type(tokenizer).from_pretrained(default_model_path())
    gemma.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    gemma.chat_template = GEMMA_STYLE_TEMPLATE
    return gemma


def test_the_end_of_a_turn_is_the_templates_end_of_turn_token_not_eos(tokenizer):
    """A Gemma-style template: the model's turn ends with <end_of_turn>, and what a tool turn appends starts right
    after it (the newline the template writes there included), not after the eos that this template never writes."""
    gemma = gemma_style(tokenizer)
    end = gemma.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn_id(gemma) == end != gemma.eos_token_id and end_of_turn_id(tokenizer) == tokenizer.eos_token_id
    schemas = tool_schemas([add])
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    suffix = appended_ids(gemma, messages, [{"role": "tool", "name": "add", "content": "5"}], schemas)
    assert gemma.decode(suffix) == "\n<start_of_turn>tool\n5<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
def test_tools_and_an_environment_train_through_the_server_and_its_reward_is_a_column(server, tmp_path):
    """--tools and --env (tests.helpers.Guess, written as TRL's documentation writes environments) through the
    multi-turn rollout on 2 ranks, in Llama 3.1's format (the tiny model with Llama's template and tokens,
    tests/test_tool_calls.py): auto picks vLLM's llama3_json parser (the start line says so), and the calls in that
    format (every turn opens with one) are read, made (their answers are in the trajectories) and trained. The
    environment's get_reward() is a reward column named after its class, beside the reward functions, which get
    the completion as messages."""
    import json
    from conftest import run_train
    from tests.test_tool_calls import llama_model
    model = llama_model(server["model"], tmp_path / "llama")
    proc, metrics = run_train(server, tmp_path / "out", "--model", model, "--tools", "tests.helpers:add", "--env",
                              "tests.test_tool_calls:GuessInLlamaCalls", "--reward_funcs", "tests.helpers:brevity",
                              "--num_generations", "4", "--prompts_per_step", "2", "--max_completion_length", "64",
                              "--max_steps", "2", "--bf16", "false", "--no_save_model")
    assert "tool calls: llama3_json" in proc.stdout, proc.stdout[-2000:]
    assert len(metrics) == 2 and all(m["rewards/GuessInLlamaCalls"] == 0.0 for m in metrics)  # 11 is never it
    assert all(m["tools/calls"] > 0 and m["tools/failed_calls"] < m["tools/calls"] for m in metrics)
    assert all(m["completion_length/model"] > 0 and m["completion_length/environment"] > 0 for m in metrics)
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert len(records) == 16 and all(set(r["rewards"]) == {"tests.helpers:brevity", "GuessInLlamaCalls"}
                                      for r in records)
    assert all("Guess my number" in r["prompt"] and '"name": "guess"' in r["prompt"] for r in records)
    assert any('ipython\n\n"lower"' in r["completion"] for r in records)  # guess(11)'s answer, as Llama's turn


@pytest.mark.slow
def test_the_embedded_guess_game_needs_no_dataset_and_the_sync_probe_is_a_tool_trajectory(server, tmp_path):
    """--env guess on 2 ranks: no dataset (its reset makes the prompts from the rows' seeds), its reward the only
    column, evaluated on held-out seeds; the weight-sync probe is a multi-turn trajectory and matches in fp32."""
    import json
    from conftest import run_train
    _, metrics = run_train(server, tmp_path / "out", "--env", "guess", "--num_generations", "4", "--prompts_per_step",
                           "2", "--max_completion_length", "24", "--max_steps", "2", "--bf16", "false",
                           "--no_save_model", "--eval_steps", "-1", "--eval_num_prompts", "2")
    metrics = [m for m in metrics if "loss" in m]  # the training steps (the evaluation before them has a row too)
    assert len(metrics) == 2 and all(m["rewards/Guess"] == 0.0 and m["sync_probe_diff_max"] < 1e-4 for m in metrics)
    assert all(m["tools/groups_with_different_prompts"] == 0 for m in metrics)
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert {r["split"] for r in records} == {"train", "eval"} and all(set(r["rewards"]) == {"Guess"} for r in records)
    assert all("I am thinking of a whole number" in r["prompt"] for r in records)
    evals = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl") if "eval/reward" in line]
    assert len(evals) == 2 and evals[0]["eval/num_prompts"] == 2


def test_an_agents_trajectory_is_its_calls_from_its_last_new_sample_on():
    from agents import agent_episode
    calls = [dict(messages=[{"role": "user", "content": "q"}], answer={"role": "assistant", "content": "a"},
                  prompt_ids=[1, 2, 3], ids=[4, 5], logprobs=[-0.1, -0.2], finish="stop", new_sample=True),
             dict(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                            {"role": "user", "content": "sure?"}], answer={"role": "assistant", "content": "b"},
                  prompt_ids=[1, 2, 3, 4, 5, 6, 7],
                  ids=[8, 9], logprobs=[-0.3, -0.4], finish="stop", new_sample=False)]
    e = agent_episode({"prompt": "q"}, calls, budget=10)
    assert e.prompt_ids == [1, 2, 3] and e.completion_ids == [4, 5, 6, 7, 8, 9] and e.finish_reason == "stop"
    assert e.sampled == [True, True, False, False, True, True]
    assert e.logprobs[:2] == [-0.1, -0.2] and math.isnan(e.logprobs[2]) and e.logprobs[4:] == [-0.3, -0.4]
    assert e.messages == [{"role": "assistant", "content": "a"}, {"role": "user", "content": "sure?"},
                          {"role": "assistant", "content": "b"}]
    cut = agent_episode({"prompt": "q"}, calls, budget=5)
    assert cut.completion_ids == [4, 5, 6, 7, 8] and cut.finish_reason == "length"
    calls[1] = dict(calls[1], prompt_ids=[1, 2, 3, 4, 55, 6, 7], new_sample=True)  # an edited history: a new sample
    e = agent_episode({"prompt": "q"}, calls, budget=10)
    assert (e.prompt_ids, e.completion_ids, e.sampled) == ([1, 2, 3, 4, 55, 6, 7], [8, 9], [True, True])
    assert e.messages == [{"role": "assistant", "content": "b"}]
    assert e.info["earlier_samples"] == [dict(prompt_ids=[1, 2, 3], completion_ids=[4, 5], sampled=[True, True],
                                              logprobs=[-0.1, -0.2], finish_reason="stop")]


def test_each_sample_of_a_forked_trajectory_trains_with_its_advantage():
    from rollout import Episode, collate, training_samples
    earlier = dict(prompt_ids=[1, 2], completion_ids=[3], sampled=[True], logprobs=[-0.5], finish_reason="stop")
    episodes = [Episode({"k": 0}, [1], [5, 6], [True, True], [-0.1, -0.2], "stop"),
                Episode({"k": 1}, [1, 2, 3, 4], [7], [True], [-0.3], "length", info={"earlier_samples": [earlier]})]
    samples, of = training_samples(episodes)
    assert of.tolist() == [0, 1, 1] and samples[0] is episodes[0] and samples[2] is episodes[1]
    assert samples[1].row == {"k": 1} and samples[1].completion_ids == [3] and samples[1].finish_reason == "stop"
    advantages = torch.tensor([0.5, -1.0])
    assert advantages[of].tolist() == [0.5, -1.0, -1.0]
    inputs, tokens = collate(samples, 0)
    assert tokens["sampled"].sum(dim=1).tolist() == [2, 1, 1]


@pytest.mark.slow
def test_openai_client_agents_train_and_an_unchained_one_forks(server, tmp_path):
    """Agents written with the plain openai package (tests.helpers) through the real server on 2 ranks: their calls
    become trajectories, their return value a reward column named after them; two calls that do not chain start a
    new sample (agents/forks), and the run goes on."""
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
    _, metrics = run_train(server, tmp_path / "unchained", "--env", "tests.helpers:unchained_agent", *args)
    assert [m["agents/forks"] for m in metrics] == [8, 8]  # every trajectory of the 2 x 4 of a step


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

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        return [dict(token_ids=[2], logprobs=[-0.5], finish_reason="stop")] * len(prompts)


def test_an_environment_that_raises_or_hangs_gives_its_trajectory_no_reward_and_holds_nothing_up(tokenizer, capfd):
    from scorer import RewardScorer
    from rollout import RolloutContext
    from tools import environment_rewards, tool_rollout
    ctx = RolloutContext(EndsAtOnce(), tokenizer, 2, dict(max_tokens=8, temperature=1.0), seed=1)
    rows = [{"prompt": "raise"}, {"prompt": "hang"}, {"prompt": "fine"}]
    t = time.monotonic()
    episodes = tool_rollout(rows, ctx, env_factory=Flaky, timeout=1.0)
    assert time.monotonic() - t < 30  # the hung resets were abandoned after their second
    assert "no game today" in episodes[0].info["environment_error"]
    assert "did not return within 1 s" in episodes[2].info["environment_error"]
    assert episodes[4].info["environment_error"] is None and episodes[4].info["environment_reward"] == 1.0
    assert episodes[4].completion_ids == [2] and episodes[0].completion_ids == []
    # the reward functions get a failed trajectory as an empty answer (accuracy's text; TRL's completion[0]), which
    # they score; the failure is the environment's, counted once and reported as its own, not the functions'
    scorer = RewardScorer(["accuracy", "tests.trl_rewards:reward_len"], ["prompt", "answer"])
    try:
        functions = scorer([{**e.row, "answer": "1"} for e in episodes], [e.messages for e in episodes],
                           [e.completion_ids for e in episodes])
    finally:
        scorer.close()
    assert not any(math.isnan(v) for column in functions for v in column) and scorer.failures == 0
    scores = environment_rewards(episodes, functions, scorer, ["Flaky"], ["Flaky"] * len(episodes))
    assert all([math.isnan(v) for v in column] == [True] * 4 + [False] * 2 for column in scores)
    assert scorer.failures == 4 and scorer.failed == {"accuracy": 0, "tests.trl_rewards:reward_len": 0, "Flaky": 4}
    err = capfd.readouterr().err
    assert "no game today" in err and "reward function" not in err


def test_environment_tokens_get_no_gradient():
    """Trajectories whose completions hold the environment's tokens (sampled=False) between the model's turns, through
    collate and the training step as train.py runs them (importance weights against the sampler, a KL penalty):
    the gradient equals that of a loss written out over the model's tokens alone, token by token."""
    from contextlib import nullcontext
    from transformers import LlamaConfig, LlamaForCausalLM
    from config import Config
    from rollout import Episode, collate
    from grpo import loss_mask_of
    from train import accumulate_gradients
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    turns = [([5, 6], [(1, True), (2, True), (30, False), (31, False), (3, True)]),
             ([7], [(4, True), (40, False), (41, False), (42, False), (8, True), (9, True)]),
             ([8, 9, 10], [(11, True), (12, True)])]
    episodes = [Episode({}, p, [t for t, _ in c], [s for _, s in c], [math.nan] * len(c), "stop") for p, c in turns]
    inputs, tokens = collate(episodes, pad_id=0)
    P, C = inputs["input_ids"].shape[1] - tokens["mask"].shape[1], tokens["mask"].shape[1]
    with torch.no_grad():  # the sampler's log-probs: the policy's, off by a little; NaN on the environment's tokens
        logits = model(**inputs).logits.double()
        exact = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, inputs["input_ids"][:, P:, None])[..., 0]
    sampler = torch.where(tokens["sampled"] > 0, exact - 0.05 * torch.arange(C), torch.full_like(exact, math.nan))
    ref = exact - 0.3 * torch.rand(exact.shape)
    adv = torch.tensor([1.0, -0.5, 0.7], dtype=torch.float64)
    cfg = Config(micro_batch_size=2, bf16=False, beta=0.04, use_bias_correction_kl=False, loss_type="grpo")
    loss_mask = loss_mask_of(tokens["sampled"], torch.zeros(3, dtype=torch.bool), False)
    data = dict(inputs=inputs, loss_mask=loss_mask, advantages=adv, old_logp=None, ref_logp=ref, sampler_logp=sampler)
    accumulate_gradients(model, data, cfg, 1, nullcontext())
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp_all = torch.log_softmax(model(**inputs).logits.double()[:, P - 1:-1], -1)
    loss = 0.0
    for i, e in enumerate(episodes):  # the model's tokens only, one at a time
        model_tokens = [t for t in range(len(e.completion_ids)) if e.sampled[t]]
        for t in model_tokens:
            logp = logp_all[i, t, e.completion_ids[t]]
            is_weight = min(math.exp(exact[i, t] - sampler[i, t]), 2.0)  # token_truncate at 2
            kl = torch.exp(ref[i, t] - logp) - (ref[i, t] - logp) - 1
            loss = loss + (-adv[i] * is_weight * torch.exp(logp - logp.detach()) + 0.04 * kl) / len(model_tokens)
    (loss / len(episodes)).backward()
    diffs = [(a - p.grad).abs().max().item() for a, p in zip(ours, model.parameters())]
    assert max(diffs) < 1e-6 and max(a.abs().max() for a in ours) > 1e-2, diffs  # the IS weights are fp32


class GuessesFive:
    """A stand-in for the server's client: a first turn calls guess(5), a later one ends the trajectory; a turn
    the environment started with the call's opening (Guess.turn_prefix) is given the rest of guess(5)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        call = '<tool_call>{"name": "guess", "arguments": {"number": 5}}</tool_call>'
        out = []
        for p in prompts:
            context = self.tokenizer.decode(p)  # a turn that starts with the call's opening gets its end
            text = "5}}\n</tool_call>" if context.endswith('"number": ') else "done" if "<tool_response>" in \
                context else call
            ids = self.tokenizer(text)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(dict(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


class SameStartForNobody:
    """reset ignores the row: every trajectory starts with another prompt."""
    calls = 0

    def reset(self, **row) -> str:
        SameStartForNobody.calls += 1
        return f"Start number {SameStartForNobody.calls}."


class Silent:
    def reset(self, **row):
        return None


def test_an_environment_without_a_dataset_starts_each_group_from_its_rows_seed(tokenizer, capsys):
    """--dataset none: the rows are seeds, the embedded guess game's reset makes the prompt (the same for a group,
    with one secret); a reset that ignores the row is warned about once and counted; one that says nothing when
    there is no prompt is an environment error."""
    from data import load_rows
    from embedded import Guess
    from rollout import RolloutContext
    from tools import tool_rollout, trajectory_metrics
    rows = load_rows("none", "train", "", "", 0, 0, num_starts=4)
    assert rows == [{"prompt": "", "seed": k} for k in range(4)]
    assert load_rows("none", "test", "", "", 0, 0, num_starts=2)[0]["seed"] == 10 ** 9  # held-out starts
    ctx = RolloutContext(GuessesFive(tokenizer), tokenizer, 3, dict(max_tokens=200, temperature=1.0), seed=1)
    episodes = tool_rollout(rows, ctx, env_factory=Guess)
    for g in range(4):
        group = episodes[3 * g:3 * g + 3]
        assert len({tuple(e.prompt_ids) for e in group}) == 1 and "I am thinking of a whole number" in \
            tokenizer.decode(group[0].prompt_ids)
        secret = Guess()
        secret.reset(seed=g)
        found = secret.secret == 5
        assert all(e.info["environment_reward"] == float(found) and e.info["tool_calls"] == 1 for e in group)
        answer = "found it" if found else "higher" if secret.secret > 5 else "lower"
        assert answer in tokenizer.decode(group[0].completion_ids)
    assert trajectory_metrics(episodes)["tools/groups_with_different_prompts"] == 0
    # a batch sampled ahead (--async_generation) comes back from a checkpoint as it was: messages, rewards, masks
    import json
    from rollout import episodes_to_json, presampled_from_json
    back = presampled_from_json([json.dumps([3, episodes_to_json(episodes)])], rows, 0, 3)
    assert back[0] == 3 and [repr(e) for e in back[1]] == [repr(e) for e in episodes]
    episodes = tool_rollout(rows, ctx, env_factory=SameStartForNobody)
    for _ in range(2):
        assert trajectory_metrics(episodes)["tools/groups_with_different_prompts"] == 4
    assert capsys.readouterr().err.count("started the G trajectories of one row with different prompts") == 1
    episodes = tool_rollout(rows[:1], ctx, env_factory=Silent)
    assert all("returned no text, and the row has no prompt" in e.info["environment_error"] for e in episodes)


class OpeningFails:
    def reset(self, **row):
        return "Guess."

    def turn_prefix(self):
        raise RuntimeError("no opening")


def test_an_environments_turn_prefix_is_given_not_sampled_and_the_model_continues_it(tokenizer):
    """Guess with `prefill` (for a model that writes no call by itself; the embedded tool model does) starts every
    turn until the number is found with the opening of a guess call (turn_prefix): its
    tokens are in the trajectory as given (sampled=False, no log-prob), the model's own tokens close the call,
    and the call is read from both; a turn_prefix that raises is the trajectory's environment error."""
    import math
    import random
    from embedded import Guess, call_opening
    from rollout import RolloutContext
    from tools import tool_rollout
    five = next(seed for seed in range(100) if random.Random(seed).randint(1, 10) == 5)  # Guess draws so
    rows = [{"prompt": "", "seed": seed} for seed in (0, five, 1)]
    ctx = RolloutContext(GuessesFive(tokenizer), tokenizer, 2, dict(max_tokens=300, temperature=1.0), seed=1)
    Prefilled = type("Prefilled", (Guess,), {"prefill": True})
    episodes = tool_rollout(rows, ctx, env_factory=Prefilled, max_iterations=2)
    opening = tokenizer.encode(call_opening("guess", "number"), add_special_tokens=False)
    founds = []
    for k, e in enumerate(episodes):
        game = Guess()
        game.reset(**rows[k // 2])
        founds.append(game.secret == 5)
        given = [t for t, s in zip(e.completion_ids, e.sampled) if not s]
        own = [t for t, s in zip(e.completion_ids, e.sampled) if s]
        assert e.completion_ids[:len(opening)] == opening and not any(e.sampled[:len(opening)])
        assert all(math.isnan(p) == (not s) for p, s in zip(e.logprobs, e.sampled))
        turns = 1 + (0 if founds[-1] else 2)  # found: one guess, then "done"; not: a guess a turn, 3 turns
        assert tokenizer.decode(own).count("5}}\n</tool_call>") == (1 if founds[-1] else 3)
        assert tokenizer.decode(given).count(call_opening("guess", "number")) == turns
        assert e.messages[0]["tool_calls"] == [{"type": "function", "id": "call00000", "function": {
            "name": "guess", "arguments": {"number": 5}}}]
        assert e.info["tool_calls"] == (1 if founds[-1] else 2)
        assert e.info["environment_reward"] == float(founds[-1])
    assert founds == [False, False, True, True, False, False]
    short = RolloutContext(ctx.client, tokenizer, 2, dict(max_tokens=len(opening) - 2, temperature=1.0), seed=1)
    for e in tool_rollout(rows[:1], short, env_factory=Prefilled):  # no room for the model: the opening, cut, is all
        assert (e.finish_reason, e.completion_ids, e.sampled) == ("length", opening[:-2], [False] * len(opening[:-2]))
        assert e.messages == [{"role": "assistant", "content": tokenizer.decode(opening[:-2])}]
    episodes = tool_rollout(rows[:1], ctx, env_factory=OpeningFails)
    assert all("RuntimeError: no opening" in e.info["environment_error"] for e in episodes)
    episodes = tool_rollout(rows[:1], ctx, env_factory=lambda: type("NumberOpening", (OpeningFails,), {
        "turn_prefix": lambda self: 5})())
    assert all("turn_prefix() returned a int" in e.info["environment_error"] for e in episodes)


def test_the_embedded_environments_and_the_flags_they_bring():
    from config import parse_config
    from embedded import Calculator, Guess
    c = Calculator()
    assert c.calculate("13 + 14") == "27" and c.calculate("(2 + 3) * 4 / 8") == "2.5"
    with pytest.raises(ValueError, match="only numbers"):
        c.calculate("__import__('os').getcwd()")
    g = Guess()
    g.reset(seed=7)
    secret = g.secret
    wrong = secret % 10 + 1
    assert g.guess(wrong) == ("higher" if wrong < secret else "lower")
    assert (g.guess(secret), g.guess(secret), g.get_reward()) == ("found it", "you found it already", 0.9)
    g.reset(seed=7)
    assert g.secret == secret and g.get_reward() == 0.0
    secrets = [(g.reset(prompt=f"game {k}"), g.secret)[1] for k in [0, 1, 2, 3, 4, 5, 0]]  # rows without a seed
    assert len(set(secrets)) > 1 and secrets[0] == secrets[-1]  # the row draws the number
    cfg = parse_config(["--env", "guess"])
    assert (cfg.env, cfg.dataset, cfg.reward_funcs) == ("embedded:Guess", "none", "")
    cfg = parse_config(["--env", "guess", "--dataset", "my.jsonl", "--max_completion_length=64"])
    assert (cfg.dataset, cfg.max_completion_length) == ("my.jsonl", 64)  # the flags given win
    assert parse_config(["--env", "guess", "--max_completion", "50"]).max_completion_length == 50  # abbreviated too
    calc = parse_config(["--env", "calculator"])
    assert (calc.model, calc.dataset, calc.reward_funcs) == ("smollm2-135m-tools", "three_digit", "accuracy")


def test_tools_of_one_name_are_refused_and_schemas_are_made_once():
    from embedded import Guess
    from tools import _schema, environment_tools

    def guess(number: int) -> str:
        """Guess.

        Args:
            number: a number
        """
        return ""
    with pytest.raises(UsageError, match="two tools are named 'guess'"):
        tool_schemas([guess] + environment_tools(Guess()))
    tool_schemas(environment_tools(Guess()))
    made = _schema.cache_info().misses
    assert tool_schemas(environment_tools(Guess())) == tool_schemas(environment_tools(Guess()))
    assert _schema.cache_info().misses == made


def test_the_sync_probe_of_a_tool_run_is_a_multi_turn_trajectory(tokenizer):
    from tools import probe_trajectory
    text = tokenizer.decode(probe_trajectory(tokenizer, "What is 12 + 7?", "", tool_schemas([add])))
    assert text.index('"name": "add"') < text.index("What is 12 + 7?") < text.index('<tool_call>\n{"name": "add"') \
        < text.index("<tool_response>\n19\n</tool_response>") < text.index("So the answer is \\boxed{19}.<|im_end|>")
