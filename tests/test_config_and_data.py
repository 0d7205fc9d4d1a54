import dataclasses
import json
import os
import subprocess
import sys

import config
import embedded
from config import Config, parse_config
from vllm_server import step_kv_cache_bytes
from conftest import ROOT
from data import load_rows

GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


def test_cli_sets_every_kind_of_field():
    cfg = parse_config(["--beta", "0.04", "--bf16", "false", "--model", "x/y", "--num_generations", "4", "--top_p", "0.9"])
    assert (cfg.beta, cfg.bf16, cfg.model, cfg.num_generations, cfg.top_p) == (0.04, False, "x/y", 4, 0.9)
    assert parse_config(["--no_save_model"]).save_model is False
    assert parse_config(["--save_model"]).save_model is True
    # defaults survive the parser unchanged (no None -> 'None', no inverted bools), with the embedded task's own
    assert parse_config([]) == Config(**config.EMBEDDED_TASKS["arithmetic"])


def test_an_embedded_task_sets_its_flags_unless_they_are_given():
    sums = config.EMBEDDED_TASKS["arithmetic"]
    assert (sums["reward_funcs"], sums["reward_weights"]) == ("boxed_accuracy,format,accuracy", "1,0,1")
    assert "\\boxed{" in sums["system_prompt"]  # the prompt and the reward ask for the same answer
    mine = parse_config(["--reward_funcs", "accuracy", "--system_prompt", "Be brief."])
    assert (mine.reward_funcs, mine.reward_weights, mine.system_prompt) == ("accuracy", "", "Be brief.")  # its weights
    assert parse_config(["--reward_weights", "1,0.5,0"]).reward_weights == "1,0.5,0"  # go with its functions
    own = parse_config(["--dataset", "train.jsonl"])
    assert (own.reward_funcs, own.reward_weights, own.system_prompt) == ("accuracy,format", "", "")
    calc = parse_config(["--env", "calculator"])  # an environment's conversation is its own
    assert (calc.reward_funcs, calc.system_prompt, calc.max_completion_length) == ("accuracy", "", 128)


def test_bf16_is_auto_unless_told():
    assert Config().bf16 == "auto"
    told = [["--bf16"], ["--bf16", "AUTO"], ["--bf16", "false"], ["--no_bf16"], ["--bf16", "yes"]]
    assert [parse_config(argv).bf16 for argv in told] == [True, "auto", False, False, True]


def test_zero_std_groups_are_dropped_by_default_only_where_the_gradient_stays_the_same():
    drops = lambda *argv: parse_config(list(argv)).drops_zero_std_groups()
    assert Config().drop_zero_std_groups == "auto" and drops()  # beta 0: their loss is 0, and so is its gradient
    assert not drops("--beta", "0.04") and not drops("--entropy_coef", "0.01") and not drops("--loss_type", "bnpo")
    assert drops("--beta", "0.04", "--drop_zero_std_groups") and not drops("--no_drop_zero_std_groups")


def test_auto_keeps_groups_without_signal_for_an_objective_that_is_not_zero_there(monkeypatch):
    """A loss whose per-token term does not vanish with the advantage (a penalty of its own) says so in its row of
    grpo.LOSSES: auto then keeps every group, since dropping one would drop that term's gradient."""
    import dataclasses
    import grpo
    monkeypatch.setitem(grpo.LOSSES, "penalized", dataclasses.replace(grpo.LOSSES["dapo"], zero_without_advantage=False))
    assert parse_config(["--loss_type", "dapo"]).drops_zero_std_groups()
    assert not parse_config(["--loss_type", "penalized"]).drops_zero_std_groups()


def test_cpu_server_computes_in_bf16_only_where_the_cpu_has_it():
    """vLLM's own default would be bf16 on any x86 CPU (emulated, ~100x slower than fp32 without avx512_bf16)."""
    import torch
    from vllm_server import flag_value, serve_args
    flags = {word for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")) for word in line.split()}
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})  # x86's bf16 instructions, or ARM's
    assert config.native_bf16(torch.device("cpu")) == native, sorted(f for f in flags if "bf16" in f or "amx" in f)
    assert flag_value(serve_args(["--model", "org/name"]), "--dtype") == ("bfloat16" if native else "float32")
    for told, dtype in ((["--dtype", "bfloat16"], "bfloat16"), (["--dtype=float16"], "float16")):
        completed = serve_args(["--model", "org/name", *told])  # the user's choice is kept, and the only one
        assert flag_value(completed, "--dtype") == dtype and sum(a.startswith("--dtype") for a in completed) == 1


def test_train_help_lists_the_flags_with_their_whole_comments():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True, text=True,
                         check=True)
    for flag in ("--num_generations", "--max_completion_length", "--learning_rate", "--beta", "--epsilon", "--temperature"):
        assert flag in out.stdout
    from config import _field_comments
    comments = _field_comments()
    assert set(comments) == {f.name for f in dataclasses.fields(Config)}  # every flag has its help
    assert comments["answer_column"].endswith('(the built-in accuracy reads "#### 42" as 42)')  # a comment on 2 lines
    assert comments["eval_steps"].endswith("N = also every N steps; 0 = never")
    assert comments["num_generations"] == "G: completions per prompt; the group for the advantage baseline"


def test_runs_evaluate_before_and_after_training_where_a_held_out_set_is_at_hand():
    assert Config().evaluates() and Config().eval_every() == Config().max_steps  # the embedded task's held-out split
    assert not Config(dataset="train.jsonl").evaluates()  # a local file has no held-out split
    assert Config(dataset="train.jsonl", eval_dataset="test.jsonl").evaluates()
    assert not Config(dataset="org/name").evaluates() and Config(dataset="org/name", eval_steps=5).evaluates()
    assert not Config(eval_steps=0).evaluates() and Config(eval_steps=5).eval_every() == 5
    assert Config(eval_pass_k="8,4").pass_k() == [1, 4, 8]  # pass@1 always: the summary's accuracy


def test_embedded_task_is_seeded_and_answers_are_right():
    rows = embedded.arithmetic_problems(50, seed=1)
    assert rows == embedded.arithmetic_problems(50, seed=1) != embedded.arithmetic_problems(50, seed=2)
    for r in rows:
        a, b = r["prompt"].removeprefix("What is ").split("?")[0].split(" + ")
        assert int(r["answer"]) == int(a) + int(b)


def test_gsm8k_jsonl_loads_with_its_answers_as_they_are_and_accuracy_reads_them():
    from rewards import accuracy, reference_answers
    rows = load_rows(GSM8K, "train", "question", "answer", 0, 0)
    with open(GSM8K) as f:
        first = json.loads(f.readline())
    assert len(rows) > 1000 and rows[0]["question"] == first["question"]
    assert rows[0]["answer"] == first["answer"]  # the column as it is: "... #### 72"
    final = first["answer"].split("####")[-1].strip()
    assert reference_answers(rows[0]["answer"]) == [final]
    assert accuracy([f"so \\boxed{{{final}}}", "\\boxed{-1}"], [rows[0]["answer"]] * 2) == [1.0, 0.0]


def test_every_column_reaches_rewards_as_it_is_and_the_answer_column_replaces_nothing(tmp_path):
    import pytest
    from config import UsageError
    from rewards import accuracy
    data = tmp_path / "lists.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "half of 1?", "answer": ["1/2", "0.5"], "level": 3},
        {"prompt": "2 + 2?", "answer": 4, "level": 1}]) + "\n")
    rows = load_rows(str(data), "train", "", "answer", 0, 0)
    assert rows[0]["answer"] == ["1/2", "0.5"] and rows[1]["answer"] == 4 and rows[0]["level"] == 3
    assert accuracy(["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{4}"], [rows[0]["answer"]] * 2 + [4]) \
        == [1.0, 1.0, 1.0]
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "p", "answer": "their own", "solution": "42"}) + "\n")
    with pytest.raises(UsageError, match="has a column 'answer' of its own"):
        load_rows(str(both), "train", "", "solution", 0, 0)
    solution_only = tmp_path / "solution.jsonl"
    solution_only.write_text(json.dumps({"prompt": "p", "solution": ["42", "42.0"]}) + "\n")
    row, = load_rows(str(solution_only), "train", "", "solution", 0, 0)
    assert row["solution"] == row["answer"] == ["42", "42.0"]


def test_batches_sampled_ahead_come_back_from_a_checkpoint_per_step_and_rank():
    """--max_staleness K: a checkpoint keeps each rank's share of every batch sampled ahead; a resume with another
    process count gets each step's rows whole and in order; a step not every rank saved is left out; a checkpoint
    of one batch ahead (the format before K) still reads."""
    from rollout import Episode, ahead_from_json, episodes_to_json
    G, rows = 2, {j: [{"prompt": f"step {j} prompt {i}"} for i in range(2)] for j in (3, 4)}  # a prompt per rank

    def share(j: int, rank: int) -> list:
        return [Episode(rows[j][rank], [1], [j, rank, g], [True] * 3, [-0.5] * 3, "stop") for g in range(G)]
    lines = [json.dumps({str(j): [j - 2, episodes_to_json(share(j, rank))] for j in (3, 4)}) for rank in (0, 1)]
    one = ahead_from_json(lines, 3, lambda j: rows[j], 0, G)  # one process: both ranks' shares
    assert sorted(one) == [3, 4] and one[4][0] == 2
    assert [e.completion_ids for e in one[4][1]] == [[4, 0, 0], [4, 0, 1], [4, 1, 0], [4, 1, 1]]
    assert [e.row for e in one[4][1]] == [rows[4][0]] * 2 + [rows[4][1]] * 2
    second = ahead_from_json(lines, 3, lambda j: rows[j][1:], 1, G)  # rank 1 of two
    assert [e.completion_ids for e in second[3][1]] == [[3, 1, 0], [3, 1, 1]]
    lines[1] = json.dumps({"3": json.loads(lines[1])["3"]})  # rank 1 saved step 3 alone
    assert sorted(ahead_from_json(lines, 3, lambda j: rows[j], 0, G)) == [3]
    old = [json.dumps([1, episodes_to_json(share(3, rank))]) for rank in (0, 1)]
    assert list(ahead_from_json(old, 3, lambda j: rows[j], 0, G)) == [3]
    assert ahead_from_json([json.dumps(None)] * 2, 3, lambda j: rows[j], 0, G) == {}


def test_the_servers_kv_cache_is_sized_to_what_a_step_samples_at_once(tmp_path):
    """run.sh starts the server with a KV cache for one step (K steps with --max_staleness K), not vLLM's 2 GiB:
    sequences x (prompt bound + completion, in 128-token blocks) x the model's bytes per token."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, layers, KV heads, head size, bf16
    cfg = parse_config(["--prompts_per_step", "8", "--num_generations", "8", "--max_prompt_length", "100",
                        "--max_completion_length", "128"])
    assert cfg.kv_cache_bytes(str(tmp_path), 2, 2048) == 64 * 256 * per_token
    assert cfg.kv_cache_bytes(str(tmp_path), 4, 2048) == 64 * 256 * per_token * 2
    ahead = parse_config(["--prompts_per_step", "8", "--num_generations", "8", "--max_prompt_length", "100",
                          "--max_completion_length", "128", "--async_generation", "--max_staleness", "3"])
    assert ahead.kv_cache_bytes(str(tmp_path), 2, 2048) == 3 * 64 * 256 * per_token
    assert cfg.kv_cache_bytes(str(tmp_path), 2, 10**6) == 10**6 * per_token  # one longest sequence at least
    server = ["--model", str(tmp_path), "--max-model-len", "2048"]  # run.sh's: the dtype the server computes in
    assert step_kv_cache_bytes(cfg, [*server, "--dtype", "float32"]) == 64 * 256 * per_token * 2
    assert step_kv_cache_bytes(cfg, [*server, "--dtype", "bfloat16"]) == 64 * 256 * per_token
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
                                                                      "hidden_size": 64, "head_dim": 32}}))
    assert cfg.kv_cache_bytes(str(tmp_path), 2, 2048) == 64 * 256 * (2 * 2 * 4 * 32 * 2)  # a VLM's text model
    (tmp_path / "config.json").write_text("{}")
    assert cfg.kv_cache_bytes(str(tmp_path), 2, 2048) is None  # vLLM's default then


def test_gradient_checkpointing_is_on_by_default_and_a_model_without_it_trains_without_unless_asked(capsys):
    """The default turns it on where the model has it; on a model without it, a warning and no checkpointing; the flag
    given explicitly asks for it anyway, and transformers says the model cannot."""
    import pytest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
    from models import checkpoint_activations

    class WithoutCheckpointing(PreTrainedModel):
        config_class = PretrainedConfig
        supports_gradient_checkpointing = False

        def __init__(self, config):
            super().__init__(config)
            self.layer = torch.nn.Linear(2, 2)

    tiny = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaForCausalLM(tiny)
    assert checkpoint_activations(llama, parse_config([])) and llama.is_gradient_checkpointing
    assert not checkpoint_activations(LlamaForCausalLM(tiny), parse_config(["--no_gradient_checkpointing"]))
    capsys.readouterr()
    assert not checkpoint_activations(WithoutCheckpointing(PretrainedConfig()), parse_config([]))
    assert "WithoutCheckpointing has no gradient checkpointing: it trains without" in capsys.readouterr().out
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        checkpoint_activations(WithoutCheckpointing(PretrainedConfig()), parse_config(["--gradient_checkpointing"]))
