"""What users train on: datasets as TRL has them (text or chat prompts, any columns, answers optional),
reward functions with TRL's signature, reward models, and loud failures of the user's functions."""
import json
import math
import os

import pytest
import torch

from config import RunStopped, UsageError
from conftest import ROOT, run_train
from data import encode_prompt, load_rows
from embedded import default_model_path
from rewards import load_reward_func
from scorer import RewardScorer

GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")
SYSTEM = "You answer in as few words as you can."


def chat_dataset(path, n: int = 16) -> str:
    """A TRL conversational dataset: a system and a user turn, no answer column, two extra columns."""
    with open(path, "w") as f:
        for i in range(n):
            target = 10 + 5 * (i % 4)
            f.write(json.dumps({"prompt": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": f"Say hello in about {target} characters."}],
                                "target_len": target, "kind": "count" if i % 2 else "chat"}) + "\n")
    return str(path)


def rows_of(path, prompt="", answer="answer"):
    return load_rows(str(path), "train", prompt, answer, 0, 0)


# ----------------------------------------------------------------------------- datasets

def test_chat_prompts_keep_their_messages_and_every_column(tmp_path):
    rows = rows_of(chat_dataset(tmp_path / "chat.jsonl"))
    assert rows[1]["prompt"][0] == {"role": "system", "content": SYSTEM} and rows[1]["kind"] == "count"
    assert rows[1]["target_len"] == 15 and "answer" not in rows[1]  # no answer column: none made up


def test_prompt_column_defaults_to_prompt_then_question(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi?", "question": "no", "solution": "x #### 7"}) + "\n")
    rows = rows_of(tmp_path / "p.jsonl", answer="solution")
    assert (rows[0]["prompt"], rows[0]["answer"], rows[0]["solution"]) == ("Hi?", "x #### 7", "x #### 7")  # as it is
    assert rows_of(GSM8K)[0]["prompt"] == rows_of(GSM8K)[0]["question"]  # GSM8K has question/answer


@pytest.mark.parametrize("prompt, message", [
    ([{"content": "no role"}], "a list of chat messages"),
    (42, "the prompt is int 42"),
    ("", "non-empty text"),
])
def test_a_prompt_that_is_neither_text_nor_messages_names_the_row(tmp_path, prompt, message):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    with pytest.raises(ValueError, match="row 1, column 'prompt'") as e:
        rows_of(tmp_path / "d.jsonl")
    assert message in str(e.value)


def test_chat_prompts_go_through_the_chat_template_with_the_system_prompt():
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.decode(encode_prompt(tokenizer, user, "Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert encode_prompt(tokenizer, user) == encode_prompt(tokenizer, "What is 2 + 2?")  # text = one user turn
    own = [{"role": "system", "content": "Mine."}] + user  # a conversation's own system turn wins
    assert tokenizer.decode(encode_prompt(tokenizer, own, "Be brief.")).count("system") == 1
    forced = user + [{"role": "assistant", "content": "The answer is"}]  # a last assistant turn is continued
    assert tokenizer.decode(encode_prompt(tokenizer, forced)).endswith("<|im_start|>assistant\nThe answer is")


# ----------------------------------------------------------------------------- reward functions

def test_a_function_that_cannot_take_the_arguments_is_refused_at_start():
    with pytest.raises(ValueError, match=r"tests.helpers:old_style: old_style\(completions, answers\) cannot be called"):
        load_reward_func("tests.helpers:old_style", ["prompt", "answer"])
    with pytest.raises(ValueError, match="missing a required argument: 'answer'"):
        load_reward_func("accuracy", ["prompt", "target_len"])  # a dataset without answers
    assert load_reward_func("accuracy", ["prompt", "answer", "more"])


def test_scorer_passes_trls_arguments_and_turns_none_into_nan(tmp_path):
    rows = rows_of(chat_dataset(tmp_path / "chat.jsonl", n=4))
    names = [f"tests.trl_rewards:{f}" for f in ("reward_len", "close_to_target", "async_brevity", "count_only")]
    scorer = RewardScorer(names, list(rows[0]))
    try:
        texts = ["Hello there!", "Hi", "Hello, hello, hello, hello!", "Hey you"]
        length, close, brevity, count = scorer(rows, texts, [[1, 2, 3]] * 4, step=3)
        assert length == [-abs(20 - len(t)) / 20 for t in texts]
        assert close == [max(0.0, 1 - abs(len(t) - r["target_len"]) / 40) for t, r in zip(texts, rows)]
        assert brevity == [1 - 3 / 16] * 4
        assert math.isnan(count[0]) and count[1] == 1.0 and math.isnan(count[2]) and count[3] == 1.0
        assert scorer.failures == 0
    finally:
        scorer.close()


def test_overlong_penalty_is_dapos_soft_punishment_with_the_lengths_of_the_flags():
    """0 up to max - buffer tokens, then linearly down to -1 at max, -1 beyond (DAPO, eq. 13), through the scorer
    process with the lengths bound from the command line; the default buffer is a fifth of the max."""
    from config import parse_config
    cfg = parse_config(["--reward_funcs", "overlong_penalty", "--max_completion_length", "10",
                        "--overlong_buffer_length", "4"])
    assert cfg.reward_options()["overlong_penalty"] == {"max_length": 10, "buffer_length": 4}
    assert parse_config(["--max_completion_length", "40"]).reward_options()["overlong_penalty"]["buffer_length"] == 8
    scorer = RewardScorer(cfg.reward_names(), ["prompt"], options=cfg.reward_options())
    try:
        ids = [[7] * n for n in range(13)]
        (got,) = scorer([{"prompt": "p"}] * 13, ["c"] * 13, ids)
        want = [0.0 if n <= 6 else -1.0 if n >= 10 else (6 - n) / 4 for n in range(13)]
        assert got == want and got[8] == -0.5
    finally:
        scorer.close()


def test_failures_are_counted_reported_once_and_stop_the_run_when_nothing_scores(capfd):
    rows = [{"prompt": "p", "answer": "3"}] * 2
    scorer = RewardScorer(["accuracy", "tests.helpers:raises_on_x", "tests.helpers:hangs_on_x"], ["prompt", "answer"],
                          timeout=5)
    try:
        assert scorer(rows, ["\\boxed{3}", "fine"], [[1], [2]]) == [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        acc, partial, hang = scorer(rows, ["\\boxed{3}", "BAD"], [[1], [2]])
        assert acc == [1.0, 0.0] and partial[0] == 1.0 and math.isnan(partial[1])  # only the sample that raised
        assert scorer.failures == 1
        acc, partial, hang = scorer(rows, ["HANG", "BAD"], [[1], [2]])  # abandoned after its time-out, not waited for
        assert all(math.isnan(v) for v in hang) and scorer.failures == 1 + 1 + 2
        assert scorer(rows, ["\\boxed{3}", "x"], [[1], [2]])[2] == [1.0, 1.0]  # the scorer works again after the hang
        err = capfd.readouterr().err
        assert err.count("reward function tests.helpers:raises_on_x failed on 1 of 2") == 1  # reported once
        assert "ValueError: BAD" in err and "did not finish within 5 s" in err
    finally:
        scorer.close()
    scorer = RewardScorer(["tests.helpers:raises"], ["prompt", "answer"])
    try:
        with pytest.raises(RuntimeError, match="(?s)failed on every completion of its first batch.*a broken reward"):
            scorer(rows, ["a", "b"], [[1], [2]])
    finally:
        scorer.close()


def test_log_extra_gives_one_value_per_completion_or_stops_the_run():
    rows = [{"prompt": "p"}] * 3
    scorer = RewardScorer(["tests.helpers:logs_extra"], ["prompt"])
    try:
        scorer(rows, ["a", "bb", "cccc"], [[1]] * 3)
        assert scorer.extra == {"length": [1, 2, 4]} and scorer.metrics == {"mean_length": 7 / 3}
        scorer(rows, ["a", "BAD", "cccc"], [[1]] * 3)  # retried one by one: the one that raised logged nothing
        assert scorer.extra == {"length": [1, None, 4]} and scorer.failures == 1
    finally:
        scorer.close()
    scorer = RewardScorer(["tests.helpers:logs_extra_short"], ["prompt"])
    try:
        with pytest.raises(RunStopped, match="log_extra\\('length', ...\\) with 1 values for 3 completions"):
            scorer(rows, ["a", "bb", "cccc"], [[1]] * 3)
    finally:
        scorer.close()


@pytest.mark.parametrize("fn, message", [("returns_one", "returned list of length 1 for 2 completions"),
                                         ("returns_text", "not a number or None"),
                                         ("raises_on_x_else_text", "not a number or None")])
def test_a_function_returning_what_cannot_be_rewards_stops_with_its_name(fn, message):
    """Also when the batch raised and the completions are retried one at a time (raises_on_x_else_text)."""
    scorer = RewardScorer([f"tests.helpers:{fn}"], ["prompt"])
    try:
        with pytest.raises(RunStopped, match=f"reward function tests.helpers:{fn} .*{message}"):
            scorer([{"prompt": "p"}] * 2, ["a", "BAD"], [[1], [2]])
    finally:
        scorer.close()


def test_a_reward_model_folder_scores_prompt_and_completion(tmp_path):
    """A tiny random sequence-classification model: the batched, padded scores equal each text scored alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=32, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    rows = [{"prompt": "What is 1 + 1?"}, {"prompt": [{"role": "user", "content": "Hi"}]}]
    completions = [" It is 2, I think, or maybe three.", "Hello"]
    scorer = RewardScorer([str(tmp_path / "rm")], ["prompt"])
    try:
        scores = scorer(rows, completions, [[1], [2]])[0]
    finally:
        scorer.close()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                         tokenize=False)
    with torch.no_grad():
        alone = [model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                 for t in ("What is 1 + 1?" + completions[0], chat)]
    assert scores == pytest.approx(alone, abs=1e-5) and scores[0] != scores[1]


def test_a_reward_model_path_that_is_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no config.json there; a path names a reward model"):
        RewardScorer([str(tmp_path)], ["prompt"])


# ----------------------------------------------------------------------------- rollouts

@pytest.mark.parametrize("loss_type, mode", [("dapo", "token_truncate"), ("grpo", "sequence_mask"),
                                             ("dr_grpo", "token_mask")])
def test_tokens_the_policy_did_not_sample_get_no_loss_and_no_importance_weight(loss_type, mode):
    """A completion that starts with forced tokens (marked unsampled, with a made-up sampler log-prob)
    gives the gradient of the same episode with those tokens moved into its prompt."""
    from contextlib import nullcontext
    from transformers import LlamaConfig, LlamaForCausalLM
    from config import Config
    from rollout import Episode, collate
    from train import accumulate_gradients
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    prompts, prefix = [[5, 6, 7], [8, 9]], [30, 31]
    sampled = [[1, 2, 3], [4, 10, 11, 12]]
    logps = [[-4.0, -4.3, -3.9], [-4.2, -4.1, -4.4, -3.8]]  # near the random model's: IS weights inside the cap
    forced = [Episode({}, p, prefix + c, [False] * 2 + [True] * len(c), [0.0, 0.0] + lp, "stop")
              for p, c, lp in zip(prompts, sampled, logps)]
    moved = [Episode({}, p + prefix, c, [True] * len(c), lp, "stop") for p, c, lp in zip(prompts, sampled, logps)]
    cfg = Config(loss_type=loss_type, micro_batch_size=1, max_completion_length=6, vllm_importance_sampling_mode=mode,
                 vllm_importance_sampling_clip_max=3.0)
    grads, tokens_seen = [], []
    for episodes in (forced, moved):
        inputs, tokens = collate(episodes, pad_id=0)
        data = dict(inputs=inputs, loss_mask=tokens["sampled"], advantages=torch.tensor([1.0, -0.5], dtype=torch.float64),
                    old_logp=None, ref_logp=None, sampler_logp=tokens["sampler_logp"].double(), keep=None)
        model.zero_grad()
        sums, _ = accumulate_gradients(model, data, cfg, 1, nullcontext())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        tokens_seen.append(sums["tokens"])
    assert tokens_seen == [7, 7] and grads[0].abs().max() > 1e-6
    assert (grads[0] - grads[1]).abs().max() < 1e-10


def test_a_rollout_that_breaks_the_contract_says_how():
    from rollout import Episode, RolloutContext, load_rollout, run_rollout
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    ctx = RolloutContext(None, None, 2, {}, 0)
    good = [Episode(rows[i // 2], [1], [2], [True], [-1.0], "stop") for i in range(4)]
    assert run_rollout(lambda r, c: good, rows, ctx) == good
    with pytest.raises(ValueError, match="returned 3 episodes for 2 rows; it must return a list of 2"):
        run_rollout(lambda r, c: good[1:], rows, ctx)
    with pytest.raises(ValueError, match="episode 1 is not of row 0"):
        run_rollout(lambda r, c: [good[0], good[2], good[1], good[3]], rows, ctx)
    bad = [Episode(rows[i // 2], [1], [2, 3], [True], [-1.0], "stop") for i in range(4)]
    with pytest.raises(ValueError, match="2 completion_ids, 1 sampled flags and 1 logprobs"):
        run_rollout(lambda r, c: bad, rows, ctx)
    with pytest.raises(ValueError, match="--rollout tests.rollouts:nope: could not load it"):
        load_rollout("tests.rollouts:nope")
    with pytest.raises(ValueError, match="--rollout tests.rollouts: give module:function"):
        load_rollout("tests.rollouts")


# ----------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_trl_reward_module_trains_on_a_chat_dataset_without_answers(server, tmp_path):
    names = ",".join(f"tests.trl_rewards:{f}" for f in ("reward_len", "close_to_target", "async_brevity", "count_only"))
    proc, metrics = run_train(server, tmp_path / "out", "--dataset", chat_dataset(tmp_path / "chat.jsonl"),
                              "--reward_funcs", names, "--num_generations", "4", "--prompts_per_step", "4",
                              "--max_completion_length", "12", "--max_steps", "2", "--bf16", "false", "--no_save_model")
    assert len(metrics) == 2 and all(m["scorer_failures"] == 0 for m in metrics), proc.stderr[-3000:]
    assert all(math.isfinite(m["rewards/tests.trl_rewards:close_to_target"]) for m in metrics)
    assert all(0 < m["rewards/tests.trl_rewards:count_only_nan_frac"] < 1 for m in metrics)  # None for "chat" rows
    rollouts = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert len(rollouts) == 2 * 4 * 4
    for r in rollouts:  # the prompt as the model saw it, and the row's columns
        assert r["prompt"].startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") and "[{'role'" not in r["prompt"]
        assert f"about {r['columns']['target_len']} characters" in r["prompt"] and r["columns"]["kind"] in ("count", "chat")


@pytest.mark.slow
def test_a_rollout_that_forces_a_prefix_trains_and_the_sync_check_skips_it(server, tmp_path):
    from tests.rollouts import PREFIX
    proc, metrics = run_train(server, tmp_path / "out", "--dataset", GSM8K, "--rollout", "tests.rollouts:forced_prefix",
                              "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
                              "--max_completion_length", "8", "--max_steps", "2", "--bf16", "false", "--no_save_model",
                              "--async_generation", "--eval_steps", "2", "--eval_dataset", GSM8K, "--eval_num_prompts", "2")
    steps = [m for m in metrics if "loss" in m]  # the others: the evaluation before training
    assert len(steps) == 2 and all(math.isfinite(m["loss"]) for m in steps) and "eval/reward" in steps[-1]
    # the forced tokens carry a made-up log-prob of 0.0: compared, they would differ by whole nats. Step 1 was
    # sampled by the weights it trains (fp32 both sides: equal); async, step 2 by those one update before
    assert steps[0]["sampler_logprob_diff_max"] < 1e-4 and steps[1]["sampler_logprob_diff_max"] < 0.1
    rollouts = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert {r["split"] for r in rollouts} == {"train", "eval"}  # evaluation goes through the rollout too
    assert all(r["completion"].startswith(PREFIX) for r in rollouts)


@pytest.mark.slow
def test_a_reward_function_that_always_raises_stops_the_run_at_step_1(server, tmp_path):
    proc = run_train(server, tmp_path / "out", "--dataset", GSM8K, "--reward_funcs", "format,tests.helpers:raises",
                     "--num_generations", "2", "--prompts_per_step", "2", "--max_completion_length", "4",
                     "--max_steps", "3", "--bf16", "false", nproc=1, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]  # a foreseen stop: README's exit code, one `stopped:` line
    assert "stopped: reward function tests.helpers:raises failed on every completion of its first batch" in proc.stderr
    assert "RuntimeError: a broken reward function" in proc.stderr and "step 1/3" not in proc.stdout
    assert "train.py" not in proc.stderr  # the function's own traceback, none of ours


@pytest.mark.slow
def test_a_reward_function_that_fails_on_everything_mid_run_warns_and_stops_the_run(server, tmp_path):
    """A judge that scores the first step and then fails on every completion: the run warns once, goes on
    with the other function (unscored_frac stays 0: brevity still scores), and stops after
    --max_unscored_steps steps in a row, saying so in one line (exit code 3)."""
    proc = run_train(server, tmp_path / "out", "--reward_funcs", "tests.helpers:brevity,tests.helpers:judge_down_after_first_call",
                     "--num_generations", "2", "--prompts_per_step", "2", "--max_completion_length", "4",
                     "--max_steps", "6", "--max_unscored_steps", "2", "--bf16", "false", nproc=1, check=False)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("warning: reward function tests.helpers:judge_down_after_first_call failed on every "
                             "completion of step 2") == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: reward function tests.helpers:judge_down_after_first_call failed on every "
                           "completion in 2 steps in a row (up to step 3)"), proc.stderr[-3000:]
    assert last.endswith(f"Saved {tmp_path / 'out'}/checkpoint-2: continue with --resume_from_checkpoint latest.")
    assert os.listdir(tmp_path / "out" / "checkpoint-2")  # the steps that trained are kept (--save_steps 0)
    metrics = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]  # step 3 stopped before training on it
    judge = "rewards/tests.helpers:judge_down_after_first_call_nan_frac"
    assert [m[judge] for m in metrics] == [0.0, 1.0] and [m["unscored_frac"] for m in metrics] == [0.0, 0.0]


@pytest.mark.slow
def test_a_tokenizer_without_a_pad_token_trains(server, tmp_path):
    """Llama 3's and Mistral's tokenizers have no pad token; the padded positions are masked, any id does."""
    import shutil
    from transformers import AutoTokenizer
    model = tmp_path / "no-pad"
    shutil.copytree(server["model"], model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model)
    assert AutoTokenizer.from_pretrained(model).pad_token_id is None
    _, metrics = run_train(server, tmp_path / "out", "--model", str(model), "--reward_funcs", "tests.helpers:brevity",
                           "--num_generations", "4", "--prompts_per_step", "2", "--max_completion_length", "8",
                           "--max_steps", "2", "--bf16", "false", nproc=1)
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["sync_probe_diff_max"] < 1e-4
    # the batches were padded (prompts and completions of several lengths), and the trainer's log-probs of every
    # sampled token equal the sampler's in fp32: no padded position leaked into a real one
    assert all(m["completion_length_min"] < m["completion_length_max"] for m in metrics)
    assert max(m["sampler_logprob_diff_max"] for m in metrics) < 1e-4, [m["sampler_logprob_diff_max"] for m in metrics]


@pytest.mark.slow
def test_a_dataset_in_the_hubs_layout_evaluates_on_its_eval_split_and_a_parquet_file_loads(server, tmp_path):
    """A hub dataset is read by datasets.load_dataset(name, split=...); a folder in a hub repository's layout (the
    hub itself is out of reach here) is read by the same call: its train split trains, --eval_split names the
    held-out one. Its .parquet files also load one by one, as a local --dataset."""
    import datasets
    from data import load_rows
    data = tmp_path / "org-name" / "data"
    data.mkdir(parents=True)
    for split, n in (("train", 8), ("validation", 3)):
        datasets.Dataset.from_list([{"question": f"{split} question {i}", "answer": str(i)} for i in range(n)]) \
            .to_parquet(data / f"{split}-00000-of-00001.parquet")
    _, metrics = run_train(server, tmp_path / "out", "--dataset", str(data.parent), "--eval_split", "validation",
                           "--eval_steps", "1", "--eval_num_prompts", "3", "--reward_funcs", "tests.helpers:brevity",
                           "--num_generations", "2", "--prompts_per_step", "2", "--max_completion_length", "4",
                           "--max_steps", "1", "--bf16", "false", "--no_save_model", nproc=1)
    ledger = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    asked = {split: {r["columns"]["question"] for r in ledger if r["split"] == split} for split in ("train", "eval")}
    assert asked["eval"] == {f"validation question {i}" for i in range(3)}
    assert asked["train"] and all(q.startswith("train question") for q in asked["train"])
    rows = load_rows(str(data / "train-00000-of-00001.parquet"), "train", "", "answer", 0, 0)
    assert [(r["prompt"], r["answer"]) for r in rows] == [(f"train question {i}", str(i)) for i in range(8)]
    with pytest.raises(UsageError, match='the folder could not be read as a dataset .Unknown split "test"'):
        load_rows(str(data.parent), "test", "", "answer", 0, 0)  # --eval_split left at its default: said so
