"""--dry_run: every check runs and is reported in one line, nothing is trained or saved, and each failure it
exists to catch stops it with exit code 2 naming its check."""
import os
import re
import sys

import pytest

from conftest import run, run_train, train_args
from test_bad_input import starts_fail
from test_tools import SMOLLM2_TEMPLATE

pytestmark = pytest.mark.slow
CHECKS = ["output folder", "tokenizer", "tasks", "server", "reward functions", "models", "weight push", "sync probe",
          "rollout", "rewards", "memory"]
SMALL = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
         "--max_completion_length", "16", "--bf16", "false", "--micro_batch_size", "4"]


def check_lines(stdout: str) -> dict[str, str]:
    """{check: its line} of the lines a dry run printed."""
    return {m[2].strip(): m[0] for m in re.finditer(r"^  (ok|FAIL) +(\D+?) +\d+\.\d s.*$", stdout, re.M)}


def test_a_dry_run_checks_every_part_and_changes_nothing(server, tmp_path):
    """Two processes, FSDP2, LoRA pushed as an adapter, a reference model: every check passes, in the order of a
    run's start and first step; the output folder holds the report alone; the server serves no adapter after."""
    out = tmp_path / "out"
    proc = run_train(server, out, *SMALL, "--dry_run", "--fsdp", "--use_peft", "--beta", "0.04", check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = check_lines(proc.stdout)
    assert list(lines) == CHECKS and all(line.startswith("  ok") for line in lines.values()), proc.stdout
    assert "the LoRA adapter alone" in lines["weight push"] and "once per connection" in lines["weight push"]
    probe = float(re.search(r"trainer's to (\S+) on average", lines["sync probe"])[1])
    assert probe < 1e-4  # the session's server is fp32
    assert "4 completions of" in lines["rollout"] and "brevity" in lines["rewards"]
    peak = float(re.search(r"peak (\S+) GiB", lines["memory"])[1])
    longest = int(re.search(r"the longest prompt (\d+)$", lines["tasks"])[1])
    assert 0.1 < peak < 20 and f"of 4 x {longest + 16} tokens" in lines["memory"]  # the longest prompt + 16
    assert f"dry run passed: {len(CHECKS)} checks" in proc.stdout
    assert os.listdir(out) == ["dry_run.txt"]  # no metrics, rollouts, checkpoint or model
    report = (out / "dry_run.txt").read_text()
    assert all(line in report for line in lines.values()) and "--dry_run" in report.splitlines()[0]
    assert "step 1/" not in proc.stdout


def test_each_failure_names_its_check_and_exits_2(server, tiny_model, tmp_path):
    """A folder holding an earlier run, a template that cannot show the tools, a reward function that raises, a
    server that cannot take the adapter: each stops the dry run at its check, exit code 2, the checks before it ok."""
    (tmp_path / "plain.jinja").write_text(SMOLLM2_TEMPLATE)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    cases = [
        (earlier, [], "output folder", "holds an earlier run's output (metrics.jsonl)"),
        (tmp_path / "tools", ["--tools", "tests.helpers:add", "--chat_template", str(tmp_path / "plain.jinja")],
         "tasks", "does not render the tools' schema"),
        (tmp_path / "lora", ["--use_peft", "--lora_r", "32", "--lora_sync", "adapter"], "weight push",
         "--lora_r 32 is above the server's --max-lora-rank 16"),
    ]
    errors = starts_fail([train_args(server, out, *SMALL, "--dry_run", *args) for out, args, _, _ in cases])
    for (out, args, check, message), error in zip(cases, errors):
        assert error.startswith(f"error: dry run: `{check}` failed: ") and message in error, (args, error)
    assert sorted(os.listdir(earlier)) == ["dry_run.txt", "metrics.jsonl"]  # the earlier run's file as it was
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert "FAIL  output folder" in (earlier / "dry_run.txt").read_text()

    # a reward function that raises: its traceback is shown, then the one line
    args = [a if a != "tests.helpers:brevity" else "tests.helpers:raises" for a in SMALL]
    proc = run([sys.executable, *train_args(server, tmp_path / "raises", *args, "--dry_run")], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: dry run: `rewards` failed: reward function "
                                                           "tests.helpers:raises failed on every completion")
    assert "a broken reward function" in proc.stderr
    lines = check_lines(proc.stdout)
    assert list(lines) == CHECKS[:CHECKS.index("rewards") + 1] and lines["rewards"].startswith("  FAIL")
