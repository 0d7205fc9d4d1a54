"""--dry_run: every check runs and is reported in one line, nothing is trained or saved, and each failure it
exists to catch stops it with exit code 2 naming its check."""
import os
import re
import shutil
import sys

import pytest
import requests
import torch

from conftest import free_port, launcher, run, run_all, run_train, train_args
from test_bad_input import starts_fail
from test_tools import SMOLLM2_TEMPLATE
from vllm_client import VLLMClient

pytestmark = pytest.mark.slow
CHECKS = ["output folder", "tokenizer", "tasks", "server", "reward functions", "models", "weight push", "sync probe",
          "rollout", "rewards", "memory"]
SMALL = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
         "--max_completion_length", "16", "--bf16", "false", "--micro_batch_size", "4"]


def served_adapters(server) -> list[str]:
    cards = requests.get(f"http://127.0.0.1:{server['port']}/v1/models", timeout=30).json()["data"]
    return [card["id"] for card in cards if card.get("parent")]


def check_lines(stdout: str) -> dict[str, str]:
    """{check: its line} of the lines a dry run printed."""
    return {m[2].strip(): m[0] for m in re.finditer(r"^  (ok|FAIL) +(\D+?) +\d+\.\d s.*$", stdout, re.M)}


def another_lora_run(server) -> tuple[VLLMClient, dict]:
    """The server as another LoRA run with --max_staleness 1 leaves it after two steps: its base weights (the tiny
    model's), its adapters policy-1 and policy-2 (the newer samples, the older may still sample a batch ahead), and
    the user's adapter. Returns a client and, by adapter, the server's log-probs of a probe."""
    from transformers import AutoModelForCausalLM
    from models import add_lora
    from weight_sync import AdapterSync, AdapterWeights, ServerWeights, WeightSync
    client = VLLMClient(port=server["port"])
    client.wait_for_health(30)
    lora = add_lora(AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32), 4, 16.0, 0.0,
                    "all-linear")
    version = [1]
    sync = AdapterSync(client, AdapterWeights(lora), 0, lambda: version[0], keep=2, base=WeightSync(
        client, ServerWeights(lora, torch.float32, merge_lora=False), 0, "127.0.0.1", free_port()))
    for step in (1, 2):
        version[0] = step
        with torch.no_grad():  # a step: the adapter changes
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        sync.push()
    return client, samples_of(client, ["policy-1", "policy-2", "user"])


def samples_of(client: VLLMClient, adapters: list[str]) -> dict[str, list[float]]:
    """{adapter: the server's log-probs of a probe with it}."""
    probe = {}
    for name in adapters:
        client.model_name = name
        probe[name] = client.prompt_logprobs(list(range(100, 140)))
    return probe


def test_a_dry_run_checks_every_part_and_changes_nothing(server, tmp_path):
    """Two processes, FSDP2, LoRA pushed as an adapter, a reference model: every check passes, in the order of a
    run's start and first step; the output folder holds the report alone. The server is another LoRA run's: the
    dry run's adapter has a name of its own, and the other run's adapters and the user's compute as before. Before, the
    dry run pushed policy-0 and unloaded all but the newest two adapters the server had (a batch ahead of the other
    run lost its adapter), the user's too."""
    out = tmp_path / "out"
    client, before = another_lora_run(server)
    proc = run_train(server, out, *SMALL, "--dry_run", "--fsdp", "--use_peft", "--beta", "0.04", check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = check_lines(proc.stdout)
    assert list(lines) == CHECKS and all(line.startswith("  ok") for line in lines.values()), proc.stdout
    assert "the LoRA adapter alone, as dry-run-" in lines["weight push"], lines["weight push"]
    assert "once per connection" in lines["weight push"]
    assert samples_of(client, list(before)) == before
    dry = re.search(r"as (dry-run-[0-9a-f]{8})-N", lines["weight push"])[1]
    assert f"{dry}-0" in served_adapters(server)
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


def test_a_two_process_dry_run_whose_transfer_port_is_taken_stops_every_rank_at_once(server, tmp_path):
    """--vllm_group_port taken: rank 0 cannot join the server's weight transfer. Every rank fails the weight push check,
    rank 0 saying why, and the run ends (exit 2 on each rank). Before, rank 0 went to the check's verdict (a collective)
    while rank 1 went on to push (FSDP2 gathers): both hung until the collective time-out (30 minutes)."""
    import socket
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):  # listening: another program's
        proc = run_train(server, tmp_path / "out", *SMALL, "--dry_run", "--fsdp", "--vllm_group_port", str(port),
                         check=False)
    assert proc.returncode != 0 and "FAIL  weight push" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"error (rank 0): dry run: `weight push` failed: --vllm_group_port {port}: the port is in use" in proc.stderr
    assert "error (rank 1): dry run: `weight push` failed: joining the weight transfer failed on another rank" in \
        proc.stderr, proc.stderr[-3000:]


def test_weights_that_rank_0_alone_cannot_read_stop_every_rank_at_once(server, tiny_model, tmp_path):
    """FSDP2, two processes: rank 0 alone reads the weights, and the folder's model.safetensors is cut short. With
    --dry_run every rank fails the models check (exit 2), rank 0 saying which folder it cannot read; without, rank 0
    says so and the other rank stops; each run ends within seconds of the read. Before, the dry run's rank 0 went to
    the check's verdict (a collective) while rank 1 waited in the broadcast of rank 0's weights: both hung until the
    collective time-out (30 minutes); a run without --dry_run ended with rank 0's SafetensorError traceback and
    rank 1's from gloo ("Connection closed by peer")."""
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model, damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(2000)  # a copy cut short: its header says more than the file holds
    runs = {"dry": ["--dry_run"], "plain": []}
    cmds = [[*launcher(2), *train_args(server, tmp_path / name, *SMALL, "--fsdp", "--model", str(damaged), *args)]
            for name, args in runs.items()]
    dry, plain = run_all(cmds, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))  # (a hang: TimeoutExpired)
    unreadable = f"the weights in {damaged} cannot be read (SafetensorError: "
    lines = check_lines(dry.stdout)
    assert list(lines) == CHECKS[:CHECKS.index("models") + 1] and lines["models"].startswith("  FAIL"), dry.stdout
    assert float(re.search(r"(\d+\.\d) s", lines["models"])[1]) < 60  # the check, the verdict's wait included
    assert f"error (rank 0): dry run: `models` failed: {unreadable}" in dry.stderr, dry.stderr[-3000:]
    assert f"error (rank 1): dry run: `models` failed: reading the weights in {damaged} failed on another rank" \
        in dry.stderr, dry.stderr[-3000:]
    assert "FAIL  models" in (tmp_path / "dry" / "dry_run.txt").read_text()
    assert f"error (rank 0): {unreadable}" in plain.stderr, plain.stderr[-3000:]
    assert f"stopped (rank 1): reading the weights in {damaged} failed on another rank" in plain.stderr
    assert plain.stderr.count("Traceback") == 1, plain.stderr[-5000:]  # torchrun's own (ChildFailedError) alone
    assert dry.returncode != 0 and plain.returncode != 0
