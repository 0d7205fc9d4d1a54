import json
import os
import subprocess
import sys

import pytest

from config import Config, parse_config
from conftest import ROOT
import utils

GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


def test_cli_sets_every_kind_of_field():
    cfg = parse_config(["--beta", "0.04", "--bf16", "false", "--model", "x/y", "--num_generations", "4", "--top_p", "0.9"])
    assert (cfg.beta, cfg.bf16, cfg.model, cfg.num_generations, cfg.top_p) == (0.04, False, "x/y", 4, 0.9)
    assert parse_config(["--no_save_model"]).save_model is False
    assert parse_config(["--save_model"]).save_model is True
    assert parse_config([]) == Config()  # defaults survive the parser unchanged (no None -> 'None', no inverted bools)


@pytest.mark.parametrize("args, message", [
    (["--num_generations", "1"], "num_generations"),
    (["--reward_weights", "1,2,3"], "one weight per function"),
    (["--reward_weights", "a,b"], "comma-separated numbers"),
    (["--temperature", "0"], "temperature"),
    (["--lr_scheduler_type", "step"], "constant, linear or cosine"),
    (["--reward_funcs", ""], "reward_funcs"),
])
def test_bad_config_fails_with_a_message_naming_the_flag(args, message):
    with pytest.raises(ValueError, match=message):
        parse_config(args).validate(world_size=1)


def test_prompts_must_divide_over_ranks():
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        Config(prompts_per_step=3).validate(world_size=2)


def test_train_help_lists_the_flags():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True, text=True, check=True)
    for flag in ("--num_generations", "--max_completion_length", "--learning_rate", "--beta", "--epsilon", "--temperature"):
        assert flag in out.stdout


def test_embedded_task_is_seeded_and_answers_are_right():
    rows = utils.arithmetic_problems(50, seed=1)
    assert rows == utils.arithmetic_problems(50, seed=1) != utils.arithmetic_problems(50, seed=2)
    for r in rows:
        a, b = r["question"].removeprefix("What is ").split("?")[0].split(" + ")
        assert int(r["answer"]) == int(a) + int(b)


def test_gsm8k_jsonl_loads_with_final_answers():
    rows = utils.load_rows(GSM8K, "train", "question", "answer", 0, 0)
    with open(GSM8K) as f:
        first = json.loads(f.readline())
    assert len(rows) > 1000 and rows[0]["question"] == first["question"]
    assert rows[0]["answer"] == first["answer"].split("####")[-1].strip()
    assert all(r["answer"].lstrip("-").replace(".", "").isdigit() for r in rows[:200])


def test_missing_column_and_missing_file_say_what_to_set(tmp_path):
    with pytest.raises(ValueError, match="--prompt_column"):
        utils.load_rows(GSM8K, "train", "prompt", "answer", 0, 0)
    with pytest.raises(ValueError, match="no such file"):
        utils.load_rows(str(tmp_path / "nope.jsonl"), "train", "q", "a", 0, 0)
    one_row = tmp_path / "one.jsonl"
    one_row.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    assert utils.load_rows(str(one_row), "train", "question", "answer", 0, 0) == [{"question": "q", "answer": "1"}]


def test_model_path_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        utils.resolve_model(str(tmp_path / "missing-model"))
    assert utils.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
