"""Bad input fails at start with a message that names what to change: flags, data, model, rewards,
server, ports and the output folder. The last group runs the real train.py / vllm_server.py."""
import contextlib
import json
import os
import socket
import sys

import pytest

import embedded
from config import Config, parse_config
from conftest import ROOT, free_port, run_all, train_args
from data import load_rows
from scorer import RewardScorer

GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


@pytest.mark.parametrize("args, message", [
    (["--num_generations", "1"], "needs at least 2 completions"),
    (["--reward_weights", "1,2"], "one weight per function"),
    (["--reward_weights", "a,b"], "comma-separated numbers"),
    (["--reward_funcs", ""], "name at least one reward function"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--top_p", "0"], "--top_p must be in"),
    (["--lr_scheduler_type", "step"], "constant, linear or cosine"),
    (["--loss_type", "ppo"], "use grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo"),
    (["--loss_type", "cispo"], "an absolute bound"),
    (["--loss_type", "luspo"], "use it with --importance_sampling_level sequence"),
    (["--loss_type", "vespo", "--importance_sampling_level", "sequence"], "leave --importance_sampling_level token"),
    (["--loss_type", "vespo", "--vllm_importance_sampling_mode", "sequence_mask"], "token_truncate or token_mask"),
    (["--importance_sampling_level", "seq"], "use token or sequence"),
    (["--top_entropy_quantile", "0"], "must be in (0, 1]"),
    (["--entropy_coef", "0.01", "--drop_zero_std_groups"], "the entropy bonus gives them one"),
    (["--reward_funcs", "accuracy,overlong_penalty", "--overlong_buffer_length", "100"], "must be in [1, the max"),
    (["--reward_funcs", "overlong_penalty", "--overlong_max_length", "100"], "overlong_penalty would never penalise"),
    (["--scale_rewards", "std"], "group, batch or none"),
    (["--max_completion_length", "0"], "--max_completion_length must be at least 1"),
    (["--steps_per_generation", "5"], "must divide the completions per rank"),
    (["--delta", "1.1"], "--delta 1.1 must be 0 (off) or above"),
    (["--vllm_importance_sampling_clip_max", "0.5"], "the bounds must hold 1"),
    (["--vllm_importance_sampling_cap", "0.5"], "the bounds must hold 1"),  # TRL's old name, still taken
    (["--report_to", "tensorboard"], "use none or wandb"),
    (["--lora_r", "8"], "only apply to LoRA training: add --use_peft"),
    (["--use_peft", "--lora_dropout", "1"], "--lora_dropout in [0, 1)"),
    (["--save_steps", "-1"], "--save_steps and --save_total_limit must be >= 0"),
    (["--max_unscored_steps", "-1"], "--max_unscored_steps must be >= 0"),
    (["--reward_timeout", "0"], "--reward_timeout must be > 0 (seconds)"),
    (["--fsdp"], "launch with torchrun"),
    (["--async_generation", "--vllm_importance_sampling_correction", "false"], "needs the importance-sampling correction"),
    (["--async_generation", "--max_staleness", "0"], "--max_staleness 0: the batches sampled ahead, at least 1"),
    (["--max_staleness", "2"], "above 1 it needs --async_generation"),
    (["--eval_steps", "5", "--eval_pass_k", "16"], "each k must be between 1 and --num_generations_eval (4)"),
    (["--eval_steps", "-2"], "--eval_steps must be -1 (before and after training), 0 (never) or N > 0"),
    (["--eval_steps", "5", "--dataset", GSM8K], "it has no held-out split; give --eval_dataset"),
    (["--dataset", "none"], "--dataset none: only an --env makes its own prompts"),
    (["--vision_learning_rate", "1e-3"], "applies to a vision tower that trains: add --freeze_vision_tower false"),
])
def test_bad_flags_fail_with_a_message_naming_the_flag(args, message, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="invalid configuration") as e:
        parse_config(args).validate(world_size=1)
    assert message in str(e.value)


def test_prompts_must_divide_over_ranks():
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        Config(prompts_per_step=3).validate(world_size=2)


@pytest.mark.parametrize("args, message", [
    (["--lerning_rate", "1e-5"], "unrecognized arguments: --lerning_rate"),
    (["--bf16", "maybe"], "expected true, false or auto, got 'maybe'"),
    (["--save_model", "maybe"], "expected true or false, got 'maybe'"),
    (["--max_steps", "ten"], "invalid int value: 'ten'"),
])
def test_unparsable_command_lines_say_which_argument(args, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(args)
    assert message in capsys.readouterr().err


def rows_of(path, prompt="question", answer="answer"):
    return load_rows(str(path), "train", prompt, answer, 0, 0)


def test_dataset_without_the_prompt_or_answer_column_names_the_flag():
    with pytest.raises(ValueError, match="no column 'prompt'.*set --prompt_column"):
        rows_of(GSM8K, prompt="prompt")
    with pytest.raises(ValueError, match="no column 'solution'.*set --answer_column"):
        rows_of(GSM8K, answer="solution")


def test_dataset_file_missing_empty_malformed_or_of_unknown_type(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        rows_of(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="is an empty file"):
        rows_of(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(ValueError, match="not a readable jsonl file.*one JSON object per line"):
        rows_of(tmp_path / "bad.jsonl")
    (tmp_path / "data.csv").write_text("question,answer\nq,1\n")
    with pytest.raises(ValueError, match="unknown file type .csv; use .json, .jsonl or .parquet"):
        rows_of(tmp_path / "data.csv")
    (tmp_path / "one.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    assert rows_of(tmp_path / "one.jsonl") == [{"question": "q", "answer": "1", "prompt": "q"}]  # and a good file loads


def test_hub_dataset_that_cannot_be_loaded_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not be loaded from the Hugging Face hub.*local .jsonl"):
        load_rows("nobody/no-such-dataset", "train", "question", "answer", 0, 0)


def test_model_path_that_does_not_exist_or_is_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        embedded.resolve_model(str(tmp_path / "missing-model"))
    with pytest.raises(ValueError, match="without config.json"):
        embedded.resolve_model(str(tmp_path))
    assert embedded.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_or_unimportable_reward_functions():
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'.*accuracy"):
        RewardScorer(["acuracy"], ["prompt"])
    with pytest.raises(ValueError, match="no_such_module:fn.*could not load it.*ModuleNotFoundError"):
        RewardScorer(["accuracy", "no_such_module:fn"], ["prompt", "answer"])
    with pytest.raises(ValueError, match="tests.helpers:nope.*AttributeError"):
        RewardScorer(["tests.helpers:nope"], ["prompt"])


# ----------------------------------------------------------------------------- the real scripts

def start_fails(args: list[str], *, timeout=300, python=(sys.executable,)) -> str:
    """Run a script that must fail at start, as a user's mistake: its message as the last line of stderr,
    `error: ...`, no traceback, exit code 2. Returns that line."""
    return starts_fail([args], timeout=timeout, python=python)[0]


def starts_fail(arg_lists: list[list[str]], *, timeout=300, python=(sys.executable,)) -> list[str]:
    """start_fails for each of `arg_lists`, all run at once: their last lines."""
    lines = []
    for proc in run_all([[*python, *args] for args in arg_lists], timeout, env=dict(os.environ, OMP_NUM_THREADS="1")):
        assert proc.returncode == 2, proc.args[-6:] + [proc.stdout[-2000:] + proc.stderr[-3000:]]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines.append(proc.stderr.strip().splitlines()[-1])
        assert lines[-1].startswith("error: "), proc.stderr[-3000:]
    return lines


def offline_train_args(tiny_model, out, *args):
    """train.py flags for a run whose server is nowhere: it must fail before it would need one."""
    return train_args({"model": tiny_model, "port": free_port()}, out, "--vllm_server_timeout", "1", *args)


@pytest.mark.slow
def test_a_mistake_found_at_start_is_one_line_and_exit_code_2(tiny_model, tmp_path):
    (tmp_path / "no_prompt.jsonl").write_text(json.dumps({"text": "2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "2 + 2?", "answer": \n')
    cases = [  # a flag, a missing file, a missing column, an unreadable file
        (["--num_generations", "1"], "error: invalid configuration: --num_generations 1: GRPO needs at least 2"),
        (["--dataset", str(tmp_path / "nope.jsonl")], "no such file"),
        (["--dataset", str(tmp_path / "no_prompt.jsonl")], "has no column 'question'"),
        (["--dataset", str(tmp_path / "broken.jsonl")], "not a readable jsonl file"),
    ]
    errors = starts_fail([offline_train_args(tiny_model, tmp_path / f"out{i}", *args) for i, (args, _) in enumerate(cases)])
    for (args, message), error in zip(cases, errors):
        assert message in error, args


@pytest.mark.slow
def test_tools_and_environments_that_cannot_work_stop_at_start(tiny_model, tmp_path):
    from test_tools import SMOLLM2_TEMPLATE
    (tmp_path / "plain.jinja").write_text(SMOLLM2_TEMPLATE)
    cases = [
        (["--env", "tests.helpers:nope"], "--env tests.helpers:nope: could not load it"),
        (["--env", "tests.helpers:NoReset"], "NoReset has no reset(**row) method"),
        (["--tools", "tests.helpers:undocumented"], "needs type hints and a Google-style docstring"),
        (["--tools", "tests.helpers:add", "--chat_template", str(tmp_path / "plain.jinja")],
         "does not render the tools' schema, the call, so the model would never see its tools"),
        (["--env", "tests.helpers:Guess", "--rollout", "tests.rollouts:forced_prefix"], "give one or the other"),
        (["--env", "tests.helpers:Guess", "--tools", "tests.helpers:guess"], "two tools are named 'guess'"),
    ]
    errors = starts_fail([offline_train_args(tiny_model, tmp_path / f"out{i}", *args) for i, (args, _) in enumerate(cases)])
    for (args, message), error in zip(cases, errors):
        assert message in error, args


@pytest.mark.slow
def test_prompts_longer_than_max_prompt_length(tiny_model, tmp_path):
    err = start_fails(offline_train_args(tiny_model, tmp_path / "out", "--max_prompt_length", "8"))
    assert "tokens > --max_prompt_length 8: raise it" in err


@pytest.mark.slow
def test_no_server_at_the_address(tiny_model, tmp_path):
    err = start_fails(offline_train_args(tiny_model, tmp_path / "out"))
    assert "no vLLM server answered" in err and "--vllm_server_port" in err


@pytest.mark.slow
def test_output_dir_that_is_not_writable(tiny_model, tmp_path):
    (tmp_path / "a_file").write_text("")
    err = start_fails(offline_train_args(tiny_model, tmp_path / "a_file" / "out"))
    assert "is not a writable folder" in err and "no vLLM server" not in err  # checked first, before the server


@pytest.mark.slow
def test_output_dir_with_an_earlier_runs_checkpoints(tiny_model, tmp_path):
    old = tmp_path / "out" / "checkpoint-3"
    old.mkdir(parents=True)
    (old / "checkpoint.json").write_text(json.dumps({"step": 3}))
    err = start_fails(offline_train_args(tiny_model, tmp_path / "out"))
    assert "holds an earlier run's output (checkpoint-3)" in err and "--resume_from_checkpoint latest" in err
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-3"]  # and nothing was touched (the lock is gone)


@pytest.mark.slow
def test_fsdp_without_torchrun(tiny_model, tmp_path):
    err = start_fails(offline_train_args(tiny_model, tmp_path / "out", "--fsdp"))
    assert "--fsdp shards the model over processes: launch with torchrun" in err


@contextlib.contextmanager
def busy_port():
    """A loopback port something listens on, for as long as the block runs."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


@pytest.mark.slow
def test_weight_transfer_port_in_use(server, tmp_path):
    with busy_port() as port:
        args = train_args(server, tmp_path / "out", "--max_steps", "1")
        args[args.index("--vllm_group_port") + 1] = str(port)
        err = start_fails(args)
    assert f"--vllm_group_port {port}: the port is in use" in err


@pytest.mark.slow
def test_an_adapter_the_server_cannot_take_stops_at_start(server, tmp_path):
    """--lora_sync adapter asks for the adapter alone; the session's server takes ranks up to 16."""
    err = start_fails(train_args(server, tmp_path / "out", "--max_steps", "1", "--use_peft", "--lora_r", "32",
                                 "--lora_sync", "adapter"))
    assert "--lora_r 32 is above the server's --max-lora-rank 16: restart it with --max-lora-rank 32" in err, err
    assert "or push merged weights with --lora_sync merged" in err


@pytest.mark.slow
def test_server_port_in_use(tiny_model):
    with busy_port() as port:
        err = start_fails([os.path.join(ROOT, "vllm_server.py"), "--model", tiny_model, "--port", str(port)], timeout=120)
    assert f"--port {port}: the port is in use" in err
