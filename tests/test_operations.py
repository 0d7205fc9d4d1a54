"""Checkpoints and resume under the real trainer and server: a resumed run continues exactly, kill -9
while saving and a full disk leave the earlier checkpoints intact, SIGTERM saves and stops every rank,
a server killed mid-run is waited for (or the run is saved)."""
import glob
import json
import os
import re
import resource
import signal
import subprocess
import time

import pytest
import torch

from conftest import ROOT, die_with_parent, free_port, launcher, run_train, running_server, stop, train_args
from tests.helpers import WaitsWhenAsked

pytestmark = pytest.mark.slow
RUN = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
       "--max_completion_length", "8", "--bf16", "false", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
       "--micro_batch_size", "3"]
COMPARED = ("reward", "reward_std", "loss", "kl", "grad_norm", "completion_length", "entropy", "lr", "sync_probe_diff_max")


def metrics_of(out) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, open(out / "metrics.jsonl"))}


@pytest.mark.parametrize("mode", [["--beta", "0.04", "--async_generation"],
                                  ["--fsdp", "--use_peft", "--lora_dropout", "0.2", "--lora_r", "4", "--disable_dropout",
                                   "false"]],
                         ids=["ddp_async", "fsdp_lora_dropout"])
def test_resumed_run_continues_exactly(server, tmp_path, mode):
    """4 steps in one go vs 2 steps, then a new process resuming from checkpoint-2: the same prompts, the
    same samples (seeded server requests), the same updates; the metrics of steps 3 and 4 agree. With async
    generation the checkpoint holds the batch sampled ahead, by the weights of step 1; resumed without async
    generation, the run samples afresh instead."""
    run_train(server, tmp_path / "a", *RUN, *mode, "--max_steps", "4", "--save_steps", "1", "--save_total_limit", "0")
    assert set(os.listdir(tmp_path / "a")) == {*(f"checkpoint-{s}" for s in range(1, 5)), "metrics.jsonl",
                                               "rollouts.jsonl", "metrics.png", "adapter" if "--use_peft" in mode else "model"}
    state = json.load(open(tmp_path / "a" / "checkpoint-2" / "checkpoint.json"))
    assert state["step"] == 2 and state["config"]["max_steps"] == 4 and state["world_size"] == 2 and state["git_revision"]
    run_train(server, tmp_path / "b", *RUN, *mode, "--max_steps", "2", "--save_steps", "2")
    proc, _ = run_train(server, tmp_path / "b", *RUN, *mode, "--max_steps", "4", "--save_steps", "2",
                        "--resume_from_checkpoint", "latest")
    assert "resuming from" in proc.stdout and "step 3/4" in proc.stdout and "step 1/4" not in proc.stdout
    a, b = metrics_of(tmp_path / "a"), metrics_of(tmp_path / "b")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in COMPARED:
            if key == "kl" and "--beta" not in mode:  # no reference, no KL
                assert key not in a[step] and key not in b[step]
                continue
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key, a[step][key], b[step][key])
    assert a[3]["loss"] != a[4]["loss"]  # the steps differ: the comparison can fail
    # and where they end: the same weights and optimizer state (the state at step 2 is not: a change shows)
    same_state(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4", other=tmp_path / "a" / "checkpoint-2")
    ledger = {run: [(r["step"], r["rank"], r["prompt_index"], r["completion"], r["reward"], r["policy_version"])
                    for r in map(json.loads, open(tmp_path / run / "rollouts.jsonl"))] for run in ("a", "b")}
    assert ledger["b"] == ledger["a"] and len(ledger["a"]) == 4 * 16  # the same completions, none twice
    # the policy that sampled each step: the one before it, or async (after the first step) the one before that
    stale = "--async_generation" in mode
    assert {(r[0], r[5]) for r in ledger["a"]} == {(s, max(s - 1 - stale, 0)) for s in range(1, 5)}
    if stale:  # trained on samples of older weights: the sampler's log-probs differ from ours, the fixed probe does not
        assert min(a[s]["sampler_logprob_diff_max"] for s in (2, 3, 4)) > 1e-3 > a[1]["sampler_logprob_diff_max"]
        assert max(m["sync_probe_diff_max"] for m in a.values()) < 1e-4
        # the same checkpoint resumed without async generation: steps 3 and 4 sample on-policy, the batch
        # sampled ahead (by older weights) is not used
        mode_sync = [f for f in mode if f != "--async_generation"]
        # and with other optimizer settings, which apply (the moments are the checkpoint's)
        proc, _ = run_train(server, tmp_path / "c", *RUN, *mode_sync, "--max_steps", "4", "--save_steps", "4",
                            "--learning_rate", "5e-3", "--adam_beta1", "0.8", "--adam_beta2", "0.95", "--weight_decay",
                            "0.1", "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2"))
        for change in ("learning_rate 0.01 -> 0.005", "adam_beta1/2 [0.9, 0.99] -> [0.8, 0.95]", "weight_decay 0.0 -> 0.1"):
            assert f"{change} (this run's flag applies)" in proc.stdout, proc.stdout[-2000:]
        groups = torch.load(tmp_path / "c" / "checkpoint-4" / "trainer_state.pt", weights_only=True)["optimizer"]["param_groups"]
        assert all((g["lr"], list(g["betas"]), g["weight_decay"]) == (5e-3, [0.8, 0.95], 0.1) for g in groups), groups
        c = metrics_of(tmp_path / "c")
        rows = [r for r in map(json.loads, open(tmp_path / "c" / "rollouts.jsonl")) if r["step"] >= 3]
        assert {(r["step"], r["policy_version"]) for r in rows} == {(3, 2), (4, 3)} and len(rows) == 2 * 16
        assert {r["completion"] for r in rows if r["step"] == 3} != {r[3] for r in ledger["a"] if r[0] == 3}
        assert c[3]["lr"] == 5e-3 and a[3]["lr"] == 1e-2
        assert max(c[s]["sampler_logprob_diff_max"] for s in (3, 4)) < 1e-4
        # resumed by one process instead of two: the batch sampled ahead by the two ranks is step 3's, whole and
        # in order, and step 3 ends where the uninterrupted run's did (up to the order of the gradient's sums).
        # (Step 4's samples differ: each rank seeds its own requests, and here one process asks for both shares.)
        run_train(server, tmp_path / "d", *RUN, *mode, "--max_steps", "3", "--save_steps", "3",
                  "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2"), nproc=1)
        d = [(r["prompt_index"], r["completion"], r["policy_version"])
             for r in map(json.loads, open(tmp_path / "d" / "rollouts.jsonl")) if r["step"] == 3]
        assert d == [(r[2], r[3], r[5]) for r in ledger["a"] if r[0] == 3] and len(d) == 16
        same_state(tmp_path / "a" / "checkpoint-3", tmp_path / "d" / "checkpoint-3", other=tmp_path / "a" / "checkpoint-2")


def test_k_batches_ahead_are_trained_at_their_staleness_and_a_resume_trains_on_the_saved_ones(server, tmp_path):
    """--max_staleness 2: the server samples two batches ahead, and pushes land while it samples them. Each step
    trains on the batch sampled two policy versions before (the first ones: as old as the run), the server still
    computes with the pushed weights (the probe after every push), and a checkpoint keeps both batches in flight:
    a run resumed from it, with 2 processes, trains steps 3 and 4 on them as the uninterrupted run did, to the same
    weights and optimizer state. Resumed by one process with --max_staleness 1, step 3's batch (2 versions old) is
    dropped, said, counted and sampled afresh. FSDP2 + LoRA adapter pushes work the same."""
    k2 = [*RUN, "--async_generation", "--max_staleness", "2"]
    run_train(server, tmp_path / "a", *k2, "--max_steps", "4", "--save_steps", "1", "--save_total_limit", "0")
    a = metrics_of(tmp_path / "a")
    assert [a[s]["staleness"] for s in range(1, 5)] == [0, 1, 2, 2]
    assert not any(m["stale_batches_dropped"] for m in a.values())
    assert max(m["sync_probe_diff_max"] for m in a.values()) < 1e-4  # the pushes reached the server
    assert min(a[s]["sampler_logprob_diff_max"] for s in (2, 3, 4)) > 1e-3  # trained on older weights' samples
    ledger = [(r["step"], r["rank"], r["prompt_index"], r["completion"], r["policy_version"])
              for r in map(json.loads, open(tmp_path / "a" / "rollouts.jsonl"))]
    assert {(r[0], r[4]) for r in ledger} == {(1, 0), (2, 0), (3, 0), (4, 1)}
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "trainer_state.pt", weights_only=False)["presampled"]
    assert [sorted(json.loads(line)) for line in saved] == [["2", "3"]] * 2  # each rank's share of steps 3 and 4

    proc, _ = run_train(server, tmp_path / "b", *k2, "--max_steps", "4", "--save_steps", "4",
                        "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2"))
    b = metrics_of(tmp_path / "b")
    for step in (3, 4):
        for key in COMPARED:
            if key != "kl":
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert [r for r in map(json.loads, open(tmp_path / "b" / "rollouts.jsonl")) if r["step"] >= 3] and \
        [(r["step"], r["rank"], r["prompt_index"], r["completion"], r["policy_version"])
         for r in map(json.loads, open(tmp_path / "b" / "rollouts.jsonl")) if r["step"] >= 3] == \
        [r for r in ledger if r[0] >= 3]
    same_state(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4", other=tmp_path / "a" / "checkpoint-2")

    proc, _ = run_train(server, tmp_path / "c", *RUN, "--async_generation", "--max_steps", "3",
                        "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2"), nproc=1)
    assert "dropped step 3's batch sampled ahead: 2 policy versions old > --max_staleness 1" in proc.stdout
    c = metrics_of(tmp_path / "c")
    assert c[3]["stale_batches_dropped"] == 1 and c[3]["staleness"] == 0  # sampled afresh, by the current weights

    # FSDP2 + LoRA pushing the adapter alone: batches under way keep sampling with the adapter they started with
    # (the server keeps the newest K + 1), and the probe after every push sees the newest
    _, lora = run_train(server, tmp_path / "lora", *k2, "--max_steps", "3", "--fsdp", "--use_peft", "--lora_r", "4",
                        "--no_save_model")
    assert [m["staleness"] for m in lora] == [0, 1, 2] and max(m["sync_probe_diff_max"] for m in lora) < 1e-4


def saved_state(checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint's weights (model/ or adapter/) and optimizer state, flat: name -> tensor."""
    from safetensors.torch import load_file
    flat = {}
    for folder in ("model", "adapter"):
        for name in glob.glob(os.path.join(checkpoint, folder, "*.safetensors")):
            flat |= {f"{folder}/{k}": v for k, v in load_file(name).items()}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        elif isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
            flat[prefix] = torch.as_tensor(value, dtype=torch.float64)
    walk("optimizer", torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)["optimizer"])
    return flat


def same_state(a, b, other):
    """Checkpoints a and b hold the same weights and optimizer state (to float32's sums in another order), and
    `other` does not (the comparison can fail). To 1e-5 (an optimizer step is 1e-2): the sampler's log-probs, in the
    importance weights, carry the server's float rounding, which depends on how it batched the requests of the
    moment (a request per prompt, from every rank), and Adam divides a weight's gradient by its own scale, so a
    weight whose gradient is nearly 0 can move by a few 1e-6 more in one run than in the other (seen: 1.7e-6)."""
    x, y, z = saved_state(a), saved_state(b), saved_state(other)
    assert x.keys() == y.keys() and any(k.startswith("optimizer/state/") for k in x) and len(x) > 10
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert any(not torch.allclose(z[k], x[k], rtol=1e-4, atol=1e-5) for k in x if k.startswith("model") or
               k.startswith("adapter"))


def test_resume_refuses_a_run_that_would_not_continue_exactly(server, tmp_path):
    run_train(server, tmp_path / "out", *RUN, "--max_steps", "1", "--save_steps", "1", nproc=1)
    proc = run_train(server, tmp_path / "out", *RUN, "--max_steps", "2", "--resume_from_checkpoint", "latest", "--seed", "7",
                     nproc=1, check=False)
    assert proc.returncode != 0 and "--seed 42 -> 7" in proc.stderr and "step 2/2" not in proc.stdout
    proc = run_train(server, tmp_path / "empty", *RUN, "--resume_from_checkpoint", "latest", nproc=1, check=False)
    assert proc.returncode != 0 and "no checkpoint in" in proc.stderr


def complete_checkpoints_load(out):
    """The names of the complete checkpoints; each has its sidecar, training state and a model that loads."""
    from transformers import AutoModelForCausalLM
    names = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-") and not n.endswith(".tmp"))
    for name in names:
        assert json.load(open(out / name / "checkpoint.json"))["step"] == int(name.split("-")[1])
        torch.load(out / name / "trainer_state.pt", weights_only=True)
        AutoModelForCausalLM.from_pretrained(out / name / "model")
    return names


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    return [int(p) for p, pp in (line.split() for line in out.splitlines()[1:]) if int(pp) == pid]


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


def group_members(pgid: int) -> list[str]:
    """The command lines of the live (not zombie) processes of process group `pgid`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(open(f"/proc/{pid}/cmdline").read().replace("\0", " "))
        except OSError:
            continue
    return found


def test_kill_9_while_saving_leaves_the_earlier_checkpoints_intact(server, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([*launcher(1), *train_args(server, out, *RUN, "--max_steps", "200", "--save_steps", "1",
                                                      "--save_total_limit", "3")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    started = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # wait for a save in progress after a complete one
            names = os.listdir(out) if os.path.isdir(out) else []
            if any(n.startswith("checkpoint-") and not n.endswith(".tmp") for n in names):
                if started is None:  # the reward scorer (in a session of its own) and multiprocessing's tracker
                    started = children(proc.pid)
                elif any(n.endswith(".tmp") for n in names):
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.002)
    finally:
        stop(proc)
    assert proc.returncode == -signal.SIGKILL, "the run ended before a save could be interrupted"
    deadline = time.monotonic() + 30
    while alive(started) and time.monotonic() < deadline:  # what the trainer started ends with it
        time.sleep(0.5)
    assert started and not alive(started)
    names = complete_checkpoints_load(out)
    assert names and any(n.endswith(".tmp") for n in os.listdir(out))  # killed mid-save, and the others are whole
    last = int(names[-1].split("-")[1])
    for name in ("metrics.jsonl", "rollouts.jsonl"):  # and as if the kill had cut a record short
        with open(out / name, "a") as f:
            f.write('{"step": 99, "cut')
    proc, metrics = run_train(server, out, *RUN, "--max_steps", str(last + 1), "--resume_from_checkpoint", "latest",
                              nproc=1)  # every line of metrics.jsonl whole again
    assert metrics[-1]["step"] == last + 1 and proc.stdout.count("dropped 1 line(s) of") == 2


def test_full_disk_while_saving_keeps_the_earlier_checkpoint_and_says_so(server, tmp_path):
    out = tmp_path / "out"
    run_train(server, out, *RUN, "--max_steps", "1", "--save_steps", "1", nproc=1)
    # files may not grow past 1 MB: the next checkpoint's model cannot be written (EFBIG, like ENOSPC)
    proc = run_train(server, out, *RUN, "--max_steps", "2", "--save_steps", "1", "--resume_from_checkpoint", "latest",
                     "--no_save_model", nproc=1, check=False,
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20)))
    assert proc.returncode != 0 and "could not write checkpoint" in proc.stderr and "intact" in proc.stderr
    assert complete_checkpoints_load(out) == ["checkpoint-1"]  # whole, and no half-written checkpoint-2 left behind
    assert sorted(os.listdir(out)) == ["checkpoint-1", "metrics.jsonl", "metrics.png", "model", "rollouts.jsonl"]


def test_sigterm_saves_a_checkpoint_and_stops_every_rank(server, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([*launcher(2), *train_args(server, out, *RUN, "--max_steps", "500")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and \
                not (os.path.exists(out / "metrics.jsonl") and len(open(out / "metrics.jsonl").readlines()) >= 2):
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # to torchrun, which passes it to its workers
        stdout, stderr = proc.communicate(timeout=120)
        time.sleep(1)
        with pytest.raises(ProcessLookupError):  # nothing of the run is left: no rank hangs in a collective
            os.killpg(proc.pid, 0)
    finally:
        stop(proc)
    names = complete_checkpoints_load(out)
    assert len(names) == 1 and int(names[0].split("-")[1]) >= 2, (names, stdout[-2000:], stderr[-3000:])
    assert "stopped by a signal" in stdout, stdout[-2000:] + stderr[-3000:]


def test_ctrl_c_saves_and_stops_during_scoring_and_a_second_one_stops_at_once(server, tmp_path, monkeypatch):
    """Ctrl-C in a terminal signals its foreground process group: torchrun, which passes it to its ranks (each in
    a session of its own), or train.py run as one process. Once, under torchrun, while step 2's reward function hangs
    (a judge that stopped answering; --reward_timeout 600): the scoring is abandoned, and every rank saves step 1 and
    stops within 20 s. Twice at once, one process held in step 2's rollout: it stops, and the checkpoints it leaves
    are whole."""
    for presses in (1, 2):
        out, gate = tmp_path / f"pressed-{presses}", tmp_path / f"gate-{presses}"
        monkeypatch.setenv("NANOGRPO_TEST_GATE", str(gate))
        held = (["--reward_funcs", "tests.helpers:hangs_at_call_2", "--reward_timeout", "600"] if presses == 1 else
                ["--rollout", "tests.helpers:gated_at_call_2"])
        proc = start_run(server, out, *RUN, "--max_steps", "500", "--save_steps", "1", *held, nproc=3 - presses)
        stdout, stderr, took = stopped_when_waiting(proc, gate, signal.SIGINT, presses)
        # the state saved is step 1's: the stop comes before step 2 changes the weights (--save_steps 1 had saved it)
        assert complete_checkpoints_load(out) == ["checkpoint-1"], stderr[-3000:]
        assert took < 20, (took, stdout[-2000:], stderr[-3000:])
        if presses == 1:
            assert f"stopped by a signal. Saved {out}/checkpoint-1: continue with --resume_from_checkpoint latest" \
                in stdout, stdout[-2000:] + stderr[-3000:]  # (torchrun's own exit code is 1 after a signal)


def stopped_when_waiting(proc, gate, signum, times: int = 1) -> tuple[str, str, float]:
    """Once the run waits at the gate (`gate`.waiting exists), send `signum` to its process group `times` times at
    once; (stdout, stderr, seconds from the signal to the end of every process of the run)."""
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{gate}.waiting") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        time.sleep(1)  # every rank at the gate, or waiting for the one that is
        start = time.monotonic()
        for _ in range(times):
            os.killpg(proc.pid, signum)
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=120)
        while group_members(proc.pid) and time.monotonic() < start + 60:  # (one on its way out)
            time.sleep(0.2)
        took = time.monotonic() - start
        assert not group_members(proc.pid), group_members(proc.pid)  # nothing of the run is left
    finally:
        stop(proc)
    return stdout, stderr, took


def test_sigterm_during_a_slow_tool_turn_or_evaluation_saves_within_20_s(server, tmp_path, monkeypatch):
    """A stop is seen wherever it arrives, not when the phase ends. 1) Every rank's tool call blocks (a slow tool,
    --tool_timeout 300) from step 2 or 3 on. 2) Rank 0's evaluation after step 1 blocks, while rank 1 has finished
    its share and waits for rank 0. Each time SIGTERM ends the run within 20 s, exit code 0, with a checkpoint of the
    last completed step and its metrics logged (wandb's run finished too); before, the run waited for the phase to end
    (a tool: up to 300 s).
    (torchrun's own exit code after a signal is 1; the ranks' is 0.)"""
    tool = tmp_path / "tool-gate"
    monkeypatch.setenv("NANOGRPO_TEST_GATE", str(tool))
    proc = start_run(server, tmp_path / "tool", *RUN, "--env", "tests.helpers:WaitsWhenAsked", "--max_steps", "500",
                     "--max_tool_calling_iterations", "1", "--tool_timeout", "300", "--max_completion_length", "96",
                     "--vllm_structured_outputs_regex", re.escape(WaitsWhenAsked.CALL))
    wait_for_steps(proc, tmp_path / "tool", 1)
    open(tool, "w").close()  # from the next tool call on, every call blocks
    stdout, stderr, took = stopped_when_waiting(proc, tool, signal.SIGTERM)
    done = max(metrics_of(tmp_path / "tool"))
    assert took < 20 and "stopped by a signal. Saved" in stdout, (took, stdout[-2000:], stderr[-3000:])
    assert complete_checkpoints_load(tmp_path / "tool") == [f"checkpoint-{done}"] and done >= 1
    assert all(m["tools/calls"] > 0 for m in metrics_of(tmp_path / "tool").values())  # the model called the tool

    evaluation = tmp_path / "eval-gate"
    monkeypatch.setenv("NANOGRPO_TEST_GATE", str(evaluation))
    monkeypatch.setenv("NANOGRPO_TEST_GATE_CALL", "3")  # rank 0's calls: evaluation, step 1, evaluation
    monkeypatch.setenv("NANOGRPO_TEST_GATE_RANK", "0")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    proc = start_run(server, tmp_path / "eval", *RUN, "--max_steps", "500", "--rollout", "tests.helpers:gated_at_call_2",
                     "--eval_steps", "1", "--eval_num_prompts", "4", "--num_generations_eval", "2", "--eval_pass_k", "1",
                     "--report_to", "wandb")
    stdout, stderr, took = stopped_when_waiting(proc, evaluation, signal.SIGTERM)
    assert took < 20 and "stopped by a signal. Saved" in stdout, (took, stdout[-2000:], stderr[-3000:])
    assert complete_checkpoints_load(tmp_path / "eval") == ["checkpoint-1"]
    records = [json.loads(line) for line in open(tmp_path / "eval" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1] and "loss" in records[1] and "eval/reward" not in records[1]
    # wandb's run was finished on the way out: unfinished, its offline record holds nothing (7 bytes)
    record, = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert os.path.getsize(record) > 1000, os.path.getsize(record)


def test_a_signal_while_the_run_starts_ends_it_there_and_frees_the_output_folder(tiny_model, tmp_path):
    """SIGTERM while the run waits for a server that is not there yet (after it took the output folder): the run ends
    at once, exit code 0, nothing saved, and the folder's lock is released. Before, the signal came before its handler
    and killed the process, leaving the lock behind."""
    out = tmp_path / "out"
    proc = start_run({"port": free_port(), "model": tiny_model}, out, "--vllm_server_timeout", "120", nproc=1)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(out / ".lock") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)
        assert proc.poll() is None, proc.communicate()
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        stop(proc)
    assert proc.returncode == 0 and took < 20 and "stopped by a signal while the run was starting" in stdout, \
        (took, stdout[-2000:], stderr[-3000:])
    assert os.listdir(out) == []  # no lock left, nothing written


def output_of(proc) -> str:
    """What a run printed, once stopped (for a message: a run waiting at a gate would never end by itself)."""
    stop(proc)
    stdout, stderr = proc.communicate(timeout=60)
    return stdout[-3000:] + stderr[-5000:]


def start_run(server, out, *args, nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen([*launcher(nproc), *train_args(server, out, *args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=die_with_parent)


def wait_for_steps(proc, out, n: int):
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and \
            not (os.path.exists(out / "metrics.jsonl") and len(open(out / "metrics.jsonl").readlines()) >= n):
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before the server could be killed"


def test_a_server_restarted_or_lost_mid_run_is_waited_for_and_else_the_run_is_saved(tiny_model, tmp_path, monkeypatch):
    """1) The server is killed (SIGKILL, engine and all) during a 2-process FSDP2 run that pushes its LoRA adapter alone
    and samples two batches ahead (--max_staleness 2) of a tool environment: in the middle of step 2's batch, its
    first turns answered and rank 0's tool call waiting; then it is started again on the same port and the tool
    answers. Before, a turn of that batch could be sampled by the new server (from the model on disk, or another
    adapter) and trained without a word. Now every request of a batch names the policy and server instance it started
    with: another instance answers, every rank reconnects, the base and the adapter are pushed, the batch is sampled
    again, and the sync probe after every step (fp32: 1e-4) shows the server computing with the trainer's weights.
    2) The server is killed for good: the run saves a checkpoint and stops with a message saying what to do."""
    out, port, gate = tmp_path / "restart", free_port(), tmp_path / "gate"
    monkeypatch.setenv("NANOGRPO_TEST_GATE", str(gate))
    monkeypatch.setenv("NANOGRPO_TEST_GATE_CALL", "9")  # a rank's 8 trajectories per batch: the 2nd batch's first call
    monkeypatch.setenv("NANOGRPO_TEST_GATE_RANK", "0")
    lora = ("--enable-lora", "--max-lora-rank", "16")
    # the trainer starts first: it waits for the server's health while the server starts
    proc = start_run({"model": tiny_model, "port": port}, out, *RUN, "--fsdp", "--use_peft", "--max_steps", "4",
                     "--async_generation", "--max_staleness", "2", "--env", "tests.helpers:WaitsWhenAsked",
                     "--max_tool_calling_iterations", "1", "--max_completion_length", "96",
                     "--vllm_structured_outputs_regex", re.escape(WaitsWhenAsked.CALL), "--vllm_server_timeout", "300")
    try:
        with running_server(tiny_model, tmp_path / "server1.log", *lora, port=port) as first:
            deadline = time.monotonic() + 300
            while not os.path.exists(f"{gate}.waiting") and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None and os.path.exists(f"{gate}.waiting"), output_of(proc)
            os.killpg(first["proc"].pid, signal.SIGKILL)
            first["proc"].wait()
        with running_server(tiny_model, tmp_path / "server2.log", *lora, port=port) as second:
            open(f"{gate}.open", "w").close()
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
            assert "lost the vLLM server" in stdout and "the vLLM server is back" in stdout, stdout[-3000:]
            metrics = list(map(json.loads, open(out / "metrics.jsonl")))
            # one restart, one reconnect: the batches it cut short are sampled again without another
            assert [m["step"] for m in metrics] == [1, 2, 3, 4] and metrics[-1]["server_reconnects"] == 1, stdout
            assert all(m["tools/calls"] > 0 for m in metrics)  # the model called the tool
            assert max(m["sync_probe_diff_max"] for m in metrics) < 1e-4

            out = tmp_path / "gone"
            proc = start_run(second, out, *RUN, "--max_steps", "50", "--vllm_server_timeout", "5")
            wait_for_steps(proc, out, 2)
            os.killpg(second["proc"].pid, signal.SIGKILL)
            stdout, stderr = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode != 0 and "did not answer within 5s" in stderr and "--resume_from_checkpoint latest" in stderr, \
        stdout[-2000:] + stderr[-4000:]
    # a foreseen stop: each rank's one line, no traceback of ours (torchrun adds its own summary)
    assert "stopped (rank 0): " in stderr and "stopped (rank 1): " in stderr and 'train.py", line' not in stderr
    names = complete_checkpoints_load(out)
    assert len(names) == 1 and int(names[0].split("-")[1]) >= 2


def test_a_preempted_run_whose_server_died_first_saves_and_stops_within_seconds(tiny_model, tmp_path):
    """Preemption sends SIGTERM to the server and the trainer together; the server dies first. The trainer, waiting
    for it (--vllm_server_timeout 300), sees the stop request, saves the steps done and exits long before torchrun
    would kill it (30 s after the signal)."""
    out, port = tmp_path / "out", free_port()
    # the trainer starts first: it waits for the server's health while the server starts
    proc = start_run({"model": tiny_model, "port": port}, out, *RUN, "--max_steps", "50",
                     "--vllm_server_timeout", "300")
    try:
        with running_server(tiny_model, tmp_path / "server.log", port=port) as server:
            wait_for_steps(proc, out, 2)
            os.killpg(server["proc"].pid, signal.SIGKILL)
            time.sleep(3)  # the ranks find the server gone and wait for it
            os.kill(proc.pid, signal.SIGTERM)
            started = time.monotonic()
            stdout, stderr = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert time.monotonic() - started < 25, stdout[-2000:] + stderr[-4000:]
    assert "lost the vLLM server" in stdout and "stopped by a signal while waiting for the vLLM server" in stderr, \
        stdout[-2000:] + stderr[-4000:]
    names = complete_checkpoints_load(out)
    assert len(names) == 1 and int(names[0].split("-")[1]) >= 2


def test_a_server_with_another_model_refuses_the_weights_and_the_run_says_so(tiny_model, tmp_path):
    """The server runs a model of other shapes (two heads, not one): vLLM cannot load the pushed weights. Before,
    its HTTP 500 was a lost server (waited for, three times) while rank 0 blocked in the next bucket's
    broadcast for gloo's 600 s; now the server takes every bucket, answers with its error, and the run stops at
    the first push saying so (nothing to save before the first step)."""
    from conftest import make_tiny_model
    other, port = make_tiny_model(tmp_path / "two-heads", num_heads=2), free_port()
    # the trainer starts first: it waits for the server's health while the server starts
    proc = start_run({"model": tiny_model, "port": port}, tmp_path / "out", *RUN, "--max_steps", "2",
                     "--weight_sync_bucket_mb", "0.5")  # several buckets: the error comes after the first
    try:
        with running_server(other, tmp_path / "server.log", port=port) as server:
            stdout, stderr = proc.communicate(timeout=900)
            assert server["proc"].poll() is None  # the server is still up
    finally:
        stop(proc)
    assert proc.returncode != 0 and "the vLLM server cannot take these weights" in stderr, stderr[-4000:]
    assert "stopped (rank 0): " in stderr and "lost the vLLM server" not in stdout
    assert "No step was done since the start, nothing new to save" in stdout + stderr
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")]


def weights_of(folder) -> dict:
    from safetensors.torch import load_file
    return load_file(folder / "model" / "model.safetensors")


def test_a_nan_loss_skips_the_update_and_several_in_a_row_stop_the_run(server, tmp_path):
    """A reward function returning inf makes the loss NaN: that update is skipped (the weights stay as they were)
    and the run goes on (steps 2 and 3; step 4 trains again, and the count starts over). Three such steps in a row
    (5, 6, 7) stop it with a message; every checkpoint it wrote holds finite weights."""
    out = tmp_path / "out"
    proc = run_train(server, out, *RUN, "--reward_funcs", "tests.helpers:inf_on_calls", "--save_steps", "1",
                     "--save_total_limit", "0", "--max_steps", "8", nproc=1, check=False,
                     env={"NANOGRPO_TEST_INF_CALLS": "2,3,5,6,7"})
    assert proc.returncode == 3 and "not finite in 3 steps in a row (up to step 7)" in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: the loss") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.endswith(f"Saved {out}/checkpoint-7: continue with --resume_from_checkpoint latest."), last
    assert [m["skipped_updates"] for m in metrics_of(out).values()] == [0, 1, 1, 0, 1, 1, 1]  # step 7 logged too
    names = complete_checkpoints_load(out)
    assert names == [f"checkpoint-{k}" for k in range(1, 8)]  # the stop saved step 7: its weights are good
    w = {k: weights_of(out / f"checkpoint-{k}") for k in (1, 3, 4, 6, 7)}
    assert all(torch.equal(w[1][name], w[3][name]) for name in w[1])  # skipped: unchanged
    assert not all(torch.equal(w[3][name], w[4][name]) for name in w[3])  # step 4 trained again
    assert all(torch.equal(w[4][name], w[6][name]) and torch.equal(w[4][name], w[7][name]) for name in w[4])
    assert all(t.isfinite().all() for name in names for t in weights_of(out / name).values())


def test_an_error_on_one_rank_outside_the_server_calls_saves_on_every_rank(server, tmp_path):
    """A --reward_postprocess hook raises on rank 1 alone, at step 2. Before, rank 1 exited at once and rank 0 died
    in its next collective: with the default --save_steps 0, step 1 was lost. Now both ranks save step 1, rank 1
    says what failed, rank 0 says where it is, and the run continues from the checkpoint."""
    out = tmp_path / "out"
    proc = run_train(server, out, *RUN, "--reward_postprocess", "tests.helpers:fails_on_rank_1_at_call_2",
                     "--max_steps", "3", check=False)
    saved = f"Saved {out}/checkpoint-1: continue with --resume_from_checkpoint latest."
    assert proc.returncode != 0 and (f"stopped (rank 1): the reward postprocess hook fails_on_rank_1_at_call_2 raised "
                                     f"ValueError: a hook that fails on one rank. {saved}") in proc.stderr, proc.stderr
    assert f"stopped (rank 0): another rank stopped with an error (see its message). {saved}" in proc.stderr
    assert complete_checkpoints_load(out) == ["checkpoint-1"] and list(metrics_of(out)) == [1]
    _, metrics = run_train(server, out, *RUN, "--max_steps", "3", "--resume_from_checkpoint", "latest")
    assert [m["step"] for m in metrics] == [1, 2, 3]


def test_every_rank_resumes_from_the_checkpoint_rank_0_finds(server, tmp_path):
    """`latest` on NFS after a quick requeue: rank 1's listing of the folder lags and misses checkpoint-4. Before,
    rank 1 resumed from step 2 and rank 0 from step 4, and their collectives no longer matched; now rank 0 finds
    the checkpoint and every rank takes it. A checkpoint some rank cannot see at all stops the start."""
    out = tmp_path / "out"
    run_train(server, out, *RUN, "--max_steps", "4", "--save_steps", "2")
    resumed = [*launcher(2), os.path.join(ROOT, "tests", "lagging_listing.py"),
               *train_args(server, out, *RUN, "--max_steps", "6", "--save_steps", "2", "--resume_from_checkpoint", "latest")]
    env = dict(os.environ, OMP_NUM_THREADS="1", NANOGRPO_TEST_HIDDEN="checkpoint-4")
    proc = subprocess.run(resumed, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resuming from {out}/checkpoint-4 after step 4; --max_steps 4 -> 6 (this run's flag applies)\n" in proc.stdout
    assert list(metrics_of(out)) == [1, 2, 3, 4, 5, 6]
    env["NANOGRPO_TEST_HIDDEN"] = "checkpoint.json"  # every file of it, as a node not sharing the folder
    proc = subprocess.run(resumed, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and (f"{out}/checkpoint-6 (as rank 0 sees it) is not there for 1 of the processes: "
                                     "put --output_dir on a filesystem that every node shares") in proc.stderr, proc.stderr


def test_a_resumed_run_evaluates_the_starting_point_and_the_last_step_once(server, tmp_path, monkeypatch):
    """1) SIGTERM while step 1 samples: the run saves checkpoint-0 (after the step-0 evaluation). Before, resuming it
    evaluated step 0 again and logged it twice. 2) A stop after the last step's update (its push failed: the server
    gone) saves that step and logs its metrics, but its evaluation never ran. Before, resuming it ran nothing: no
    final evaluation, no summary. Now it evaluates, once."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    monkeypatch.setenv("NANOGRPO_TEST_GATE", str(gate))
    evaluated = ["--eval_steps", "2", "--eval_num_prompts", "4", "--num_generations_eval", "2", "--eval_pass_k", "1",
                 "--max_steps", "2", "--save_steps", "2"]
    proc = start_run(server, out, *RUN, *evaluated, "--rollout", "tests.helpers:gated_at_call_2")
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{gate}.waiting") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1)
        open(f"{gate}.open", "w").close()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert complete_checkpoints_load(out) == ["checkpoint-0"], stdout[-2000:] + stderr[-3000:]
    run_train(server, out, *RUN, *evaluated, "--resume_from_checkpoint", "latest")
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1, 2] and "eval/reward" in records[-1]
    # the log as a stop in the last push leaves it: step 2's metrics without its evaluation
    records[-1] = {k: v for k, v in records[-1].items() if not k.startswith("eval/") and k != "time/eval"}
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for resume in range(2):  # the second resume finds the evaluation logged: not again
        proc, metrics = run_train(server, out, *RUN, *evaluated, "--resume_from_checkpoint", "latest")
        assert [m["step"] for m in metrics] == [0, 1, 2, 2] and "eval/reward" in metrics[-1]
        assert ("eval at step 2 |" in proc.stdout) == (resume == 0), proc.stdout
        assert proc.stdout.strip().splitlines()[-1].startswith("held-out"), proc.stdout  # the summary, steps 0 -> 2
