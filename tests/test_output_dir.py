"""One output folder, one run: a second run into a folder in use stops at once; a new run never mixes with an
earlier run's output; a run resumed from an older checkpoint moves the later ones (and the logs as they were)
aside, so that `latest` cannot jump back to an abandoned run; a run resumed from another folder's checkpoint
starts its own folder with the logs up to that checkpoint and never prunes what was there."""
import contextlib
import errno
import fcntl
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from config import STOP, SignalStop, UsageError
from conftest import ROOT
from checkpoints import StopRequest, check_checkpoint, find_checkpoint, prepare_output_dir
from utils import OutputLock


def fake_checkpoint(out, step: int):
    os.makedirs(out / f"checkpoint-{step}")
    (out / f"checkpoint-{step}" / "checkpoint.json").write_text(json.dumps({"step": step, "config": {}}))


def logs(out, steps: list[int]):
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (out / name).write_text("".join(json.dumps({"step": s, "name": name}) + "\n" for s in steps))


def steps_in(path) -> list[int]:
    return [json.loads(line)["step"] for line in open(path)]


def visible(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if n != ".lock")


HOLD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from checkpoints import prepare_output_dir
lock = prepare_output_dir(sys.argv[2], None)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_run_into_a_folder_in_use_stops_and_the_folder_is_free_after(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, ROOT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UsageError, match=f"is in use by another run \\(pid {holder.pid} on .*choose another"):
            prepare_output_dir(str(tmp_path), None)
    finally:
        holder.kill()
        holder.wait()
    prepare_output_dir(str(tmp_path), None).close()  # the kernel freed it with the process


def test_a_filesystem_without_flock_is_locked_by_the_renewed_lock_file(tmp_path, monkeypatch, capsys):
    """NFSv3 without lockd (ENOLCK) or Lustre mounted noflock (ENOSYS): before, the start crashed with a traceback.
    Now it says so in one line and the lock file alone keeps a second run out while the first renews it."""
    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(OutputLock, "RENEW_S", 0.05)
    first = prepare_output_dir(str(tmp_path), None)
    assert capsys.readouterr().out.count("is on a filesystem without flock (No locks available)") == 1
    mtime = os.stat(tmp_path / ".lock").st_mtime_ns
    time.sleep(0.3)
    assert os.stat(tmp_path / ".lock").st_mtime_ns > mtime  # renewed
    with pytest.raises(UsageError, match=f"in use by another run \\(pid {os.getpid()} on .*, which renewed its lock "
                                         "0 s ago\\).*If that run has ended .*delete .*\\.lock"):
        prepare_output_dir(str(tmp_path), None)
    first.close()
    assert not os.path.exists(tmp_path / ".lock")  # free
    prepare_output_dir(str(tmp_path), None).close()


HOLD_ON_NODE = """
import fcntl, socket, sys, time
sys.path.insert(0, sys.argv[1])
socket.gethostname = lambda: sys.argv[3]  # a run on another node: its lock names that node
if sys.argv[5] == "localflock":  # Lustre localflock: its flock holds on its own node, and is not seen on this one
    fcntl.flock = lambda f, op: None
from utils import OutputLock
OutputLock.RENEW_S = float(sys.argv[4])
lock = OutputLock(sys.argv[2])
print("locked", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def run_on_another_node(out, flock: str, renew_s: float):
    """A process holding `out` as a run on node-b would, renewing its lock every `renew_s` s."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_ON_NODE, ROOT, str(out), "node-b", str(renew_s), flock],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_requeue_on_another_node_waits_for_its_dead_runs_lock_to_go_stale_and_takes_it_over(tmp_path, monkeypatch,
                                                                                            capsys):
    """A run killed (kill -9, a node lost) and requeued on another node at once: before, the start stopped with
    exit 2 (the lock renewed less than a minute ago), which a scheduler does not requeue, and the job was lost.
    Now it says it waits, one line, sees no renewal for 4 periods, and takes the lock over."""
    monkeypatch.setattr(OutputLock, "RENEW_S", 1.0)
    with run_on_another_node(tmp_path, "flock", 1.0) as holder:
        holder.kill()  # no clean exit: its lock stays, naming it
        holder.wait()
    started = time.monotonic()
    prepare_output_dir(str(tmp_path), None).close()
    waited, said = time.monotonic() - started, capsys.readouterr().out
    assert 2.0 < waited < 8.0  # until 4 s after its last renewal: not at once, and not much longer
    assert len(re.findall(f"names pid {holder.pid} on node-b, renewed [01] s ago: waiting up to [34] s", said)) == 1
    assert re.search(f"was left by pid {holder.pid} on node-b, not renewed for [4-6] s: taken over", said)
    assert not os.path.exists(tmp_path / ".lock")  # ours, and released


@pytest.mark.parametrize("flock, clock_ahead_s", [("localflock", 0), ("flock", 0), ("localflock", 120)])
def test_a_lock_another_node_keeps_renewing_still_stops_the_start(tmp_path, monkeypatch, capsys, flock, clock_ahead_s):
    """Where flock does not reach the other node (Lustre localflock), its renewal is what tells its run is alive:
    the start that waits for its lock stops at the first renewal. Where it does (NFS), a flock held by another node
    is watched the same way (a lost node's lock outlives it on the file server), and its renewal stops the start.
    With this node's clock 120 s ahead of the other's, the lock looked stale at once and was taken over from its live
    run: now renewals are watched for 2 periods whatever the clocks say. (Without flock at all, the renewal alone
    counts too: test_a_filesystem_without_flock_is_locked_by_the_renewed_lock_file.)"""
    monkeypatch.setattr(OutputLock, "RENEW_S", 1.0)
    clock = time.time
    monkeypatch.setattr(time, "time", lambda: clock() + clock_ahead_s)
    with run_on_another_node(tmp_path, flock, 1.0) as holder:
        started = time.monotonic()
        with pytest.raises(UsageError, match=f"in use by another run \\(pid {holder.pid} on node-b, which renewed its "
                                             "lock [01] s ago\\): wait for it to end, or choose another --output_dir"):
            prepare_output_dir(str(tmp_path), None)
        assert time.monotonic() - started < 3.5  # at its renewal, not when it would have gone stale
        assert (tmp_path / ".lock").read_text() == f"pid {holder.pid} on node-b\n"  # untouched
    assert capsys.readouterr().out.count("waiting up to") == 1


FLOCK_OF_A_LOST_NODE = """
import fcntl, os, sys, time
with open(sys.argv[1], "w") as f:
    f.write("pid 4242 on node-b\\n")
    f.flush()
    os.utime(sys.argv[1], (time.time() - 600, time.time() - 600))
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize("freed_after_s", [1.5, None])
def test_a_requeue_after_a_lost_node_waits_for_the_file_server_to_free_its_flock(tmp_path, monkeypatch, capsys,
                                                                                 freed_after_s):
    """On NFS, flock is a lock held on the server: a lost node's stays there until its lease ends (~90 s, NFSv4).
    Before, any flock held meant a live run: the requeue on another node stopped at once (exit 2). Now a flock held
    for another node's lock that is not renewed is tried again until it is freed (then the lock is taken over), up
    to the stale window plus a lease (said in one line); held past that, the start stops and says how to free it.
    The file server is played by a process that holds the flock of node-b's lock, last renewed 10 minutes ago."""
    monkeypatch.setattr(OutputLock, "RENEW_S", 0.5)
    monkeypatch.setattr(OutputLock, "NFS_LEASE_S", 2.0)  # bound: 4 renewals (2 s) + the lease = 4 s
    server = subprocess.Popen([sys.executable, "-c", FLOCK_OF_A_LOST_NODE, str(tmp_path / ".lock"),
                               str(freed_after_s or 600)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "locked\n"
        started = time.monotonic()
        if freed_after_s:
            prepare_output_dir(str(tmp_path), None).close()
        else:
            with pytest.raises(UsageError, match="--output_dir .* is locked by pid 4242 on node-b, which has not "
                                                 "renewed its lock in the 4 s this start watched it while its flock "
                                                 "stayed held: .*its node may be lost.* If no run uses the folder, "
                                                 f"delete {tmp_path / '.lock'}$"):
                prepare_output_dir(str(tmp_path), None)
        waited = time.monotonic() - started
    finally:
        server.kill()
        server.wait()
    said = capsys.readouterr().out
    assert said.count("names pid 4242 on node-b, renewed 600 s ago, and its flock is held (by its run, or by the "
                      "file server for a lost node until its lease ends): waiting up to 4 s") == 1
    if freed_after_s:
        assert 1.0 < waited < 3.5  # when the flock was freed, not at once and not at the bound
        assert re.search("was left by pid 4242 on node-b, not renewed for 60[0-3] s: taken over", said)
        assert os.listdir(tmp_path) == []  # ours, and released
    else:
        assert 4.0 <= waited < 6.0
        assert (tmp_path / ".lock").read_text() == "pid 4242 on node-b\n"  # untouched


@pytest.mark.parametrize("call", ["link", "rename"])
def test_a_lock_put_in_place_by_a_call_whose_nfs_reply_was_lost_is_ours(tmp_path, monkeypatch, call):
    """NFS over a lossy network: the server did link(2) (or rename(2)), its reply was lost, and the retransmitted
    call failed (EEXIST; ENOENT). Before, the start judged its own lock as another run's and stopped, naming its own
    pid, with the lock left behind (link), or crashed with a traceback (rename). Now it sees the lock in place is
    its own file and runs. rename: the lock it replaces is this node's, of a process gone."""
    done, lost = getattr(os, call), {"link": errno.EEXIST, "rename": errno.ENOENT}[call]

    def reply_lost(source, target):
        done(source, target)
        raise OSError(lost, os.strerror(lost))
    if call == "rename":
        (tmp_path / ".lock").write_text(f"pid 999999999 on {socket.gethostname()}\n")
    monkeypatch.setattr(os, call, reply_lost)
    lock = prepare_output_dir(str(tmp_path), None)
    assert (tmp_path / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    lock.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("call", ["link", "rename"])
def test_a_signal_as_the_lock_is_put_in_place_leaves_no_lock(tmp_path, monkeypatch, call):
    """A stop signal while the run starts raises config.SignalStop from checkpoints.StopRequest's handler. Arriving
    just after the lock was put in place (link; rename, over a lock of this node whose process is gone), before the
    run had registered it, it left the lock behind: the next start on another node waited for it. Now the lock is
    registered before it is put in place, and the way out removes it."""
    done = getattr(os, call)

    def then_a_signal(source, target):
        done(source, target)
        os.kill(os.getpid(), signal.SIGTERM)
    if call == "rename":
        (tmp_path / ".lock").write_text(f"pid 999999999 on {socket.gethostname()}\n")
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        StopRequest()  # as train.py's first line
        monkeypatch.setattr(os, call, then_a_signal)
        with pytest.raises(SignalStop, match="stopped by a signal while the run was starting"):
            prepare_output_dir(str(tmp_path), None)
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
        STOP.clear()
    assert os.listdir(tmp_path) == [] and OutputLock.held == []


def no_flock(f, op):
    raise OSError(errno.ENOLCK, "No locks available")


def race(out, go, done, results):
    """One start of several released at once: says whether it got the folder, and holds it until `done`. Its
    fstat(2) takes 0.2 s, as on a slow NFS server: every start looks at the lock before any takes it."""
    fstat = os.fstat
    os.fstat = lambda fd: (time.sleep(0.2), fstat(fd))[1]
    go.wait()
    try:
        lock = prepare_output_dir(str(out), None)
    except UsageError as e:
        results.put(("refused", str(e)))
        return
    results.put(("locked", os.getpid()))
    done.wait()
    lock.close()


@pytest.mark.parametrize("before", ["no lock", "a dead run's stale lock"])
def test_starts_racing_without_flock_leave_one_run(tmp_path, monkeypatch, before):
    """Without flock, the lock was read, then truncated and written: starts that read it at the same moment all
    took it. Now it is put in place by link(2), which one alone can do, and a stale one is replaced by the one start
    that claimed it (an exclusive create)."""
    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(OutputLock, "RENEW_S", 1.0)
    fork = multiprocessing.get_context("fork")
    if before != "no lock":
        (tmp_path / ".lock").write_text("pid 4242 on node-b\n")
        os.utime(tmp_path / ".lock", (time.time() - 600, time.time() - 600))
    go, done, results = fork.Event(), fork.Event(), fork.Queue()
    starts = [fork.Process(target=race, args=(tmp_path, go, done, results)) for _ in range(4)]
    for start in starts:
        start.start()
    go.set()
    outcomes = sorted(results.get(timeout=60) for _ in starts)
    done.set()
    for start in starts:
        start.join(timeout=30)
    assert [what for what, _ in outcomes] == ["locked", "refused", "refused", "refused"], outcomes
    winner = outcomes[0][1]  # each other start saw its lock renewed, or its claim on the stale one
    assert all(f"in use by another run (pid {winner} on" in said or "is being taken over by another start" in said
               for _, said in outcomes[1:]), outcomes
    assert not os.path.exists(tmp_path / ".lock")


def test_a_stale_lock_is_taken_over_after_two_renewal_periods_and_one_of_this_node_at_once(tmp_path, monkeypatch,
                                                                                              capsys):
    """A lock of another node not renewed for a minute (by the file's time) is watched for 2 renewal periods, no
    more: the file's time alone cannot tell a dead run from a clock that differs from ours. One of this node whose
    process is gone (flock is free) is taken over at once and without a word."""
    monkeypatch.setattr(OutputLock, "RENEW_S", 0.5)
    (tmp_path / ".lock").write_text("pid 4242 on another-node\n")
    os.utime(tmp_path / ".lock", (time.time() - 120, time.time() - 120))
    started = time.monotonic()
    prepare_output_dir(str(tmp_path), None).close()
    waited, said = time.monotonic() - started, capsys.readouterr().out
    assert 1.0 <= waited < 3.0
    assert said.count("names pid 4242 on another-node, renewed 120 s ago: waiting up to 1 s") == 1
    assert re.search("was left by pid 4242 on another-node, not renewed for 12[01] s: taken over", said)
    (tmp_path / ".lock").write_text(f"pid 999999999 on {socket.gethostname()}\n")  # this node's, its process gone
    prepare_output_dir(str(tmp_path), None).close()
    assert capsys.readouterr().out == ""


def test_a_filesystem_without_hard_links_is_refused_in_one_line(tmp_path, monkeypatch):
    """The lock is put in place by link(2): exFAT, or SMB without its unix extensions, cannot. Said, not a traceback."""
    def no_link(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(UsageError, match="is on a filesystem without hard links \\(Operation not permitted\\), which "
                                         "its lock needs: choose another --output_dir"):
        prepare_output_dir(str(tmp_path), None)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_a_run_whose_lock_was_taken_over_leaves_the_new_one_in_place(tmp_path):
    """A run frozen for minutes (SIGSTOP, a hung mount) can find its lock taken over: before, its close removed the
    lock of the run that took it (the file it had open said its own name)."""
    first = prepare_output_dir(str(tmp_path), None)
    os.rename(tmp_path / ".lock", tmp_path / "set-aside")  # as a start that found it stale does
    (tmp_path / ".lock").write_text("pid 4242 on node-b\n")
    first.close()
    assert (tmp_path / ".lock").read_text() == "pid 4242 on node-b\n"


def test_a_new_run_refuses_an_earlier_runs_output_and_touches_nothing(tmp_path):
    logs(tmp_path, [0, 1])
    with pytest.raises(UsageError, match=r"holds an earlier run's output \(metrics.jsonl, rollouts.jsonl\): "
                                         "continue that run with --resume_from_checkpoint latest"):
        prepare_output_dir(str(tmp_path), None)
    assert steps_in(tmp_path / "metrics.jsonl") == [0, 1]
    (tmp_path / "metrics.jsonl").write_text(""), (tmp_path / "rollouts.jsonl").write_text("")  # died at its start
    (tmp_path / "server.log").write_text("not ours")
    prepare_output_dir(str(tmp_path), None).close()
    os.makedirs(tmp_path / "model")
    fake_checkpoint(tmp_path, 3)
    with pytest.raises(UsageError, match=r"\(checkpoint-3, model\)"):
        prepare_output_dir(str(tmp_path), None)


def test_resuming_an_older_checkpoint_moves_the_later_ones_and_their_logs_aside(tmp_path, capsys):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    logs(tmp_path, [0, 1, 2, 3, 4, 5, 6, 7])  # the run went on to step 7, then was abandoned
    prepare_output_dir(str(tmp_path), str(tmp_path / "checkpoint-2"), 2).close()
    aside = [n for n in visible(tmp_path) if n.startswith("abandoned-after-step-2-")]
    assert len(aside) == 1 and f"are in {tmp_path / aside[0]}" in capsys.readouterr().out
    assert visible(tmp_path) == sorted(["checkpoint-2", "metrics.jsonl", "rollouts.jsonl", aside[0]])
    assert sorted(os.listdir(tmp_path / aside[0])) == ["checkpoint-4", "checkpoint-6", "metrics.jsonl",
                                                       "rollouts.jsonl"]
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert steps_in(tmp_path / name) == [0, 1, 2] and steps_in(tmp_path / aside[0] / name) == list(range(8))
    assert find_checkpoint("latest", str(tmp_path)) == str(tmp_path / "checkpoint-2")  # not the abandoned 6
    prepare_output_dir(str(tmp_path), str(tmp_path / "checkpoint-2"), 2).close()  # again: nothing more to move
    assert len([n for n in visible(tmp_path) if n.startswith("abandoned")]) == 1


def test_resuming_latest_after_a_crash_keeps_the_log_records_written_after_it(tmp_path, capsys):
    """A crash at step 57 with the last checkpoint at 50: before, the resume cut the logs back to step 50 and kept
    no copy of steps 51-57, often what explains the crash. Now the logs as they were are kept aside, as the
    abandoned checkpoints are; a resume with nothing after its step sets nothing aside."""
    from checkpoints import went_past
    fake_checkpoint(tmp_path, 50)
    logs(tmp_path, list(range(1, 58)))
    with open(tmp_path / "rollouts.jsonl", "a") as f:
        f.write('{"step": 58, "prompt": "cut sh')  # killed while writing
    prepare_output_dir(str(tmp_path), str(tmp_path / "checkpoint-50"), 50).close()
    aside = [n for n in visible(tmp_path) if n.startswith("abandoned-after-step-50-")]
    said = capsys.readouterr().out
    assert len(aside) == 1 and f"are in {tmp_path / aside[0]}" in said and f"and all in {tmp_path / aside[0]}" in said
    assert sorted(os.listdir(tmp_path / aside[0])) == ["metrics.jsonl", "rollouts.jsonl"]
    assert steps_in(tmp_path / aside[0] / "metrics.jsonl") == list(range(1, 58))
    assert (tmp_path / aside[0] / "rollouts.jsonl").read_text().endswith('"cut sh')
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert steps_in(tmp_path / name) == list(range(1, 51))
    prepare_output_dir(str(tmp_path), str(tmp_path / "checkpoint-50"), 50).close()  # again: nothing went further
    assert len([n for n in visible(tmp_path) if n.startswith("abandoned")]) == 1
    assert not went_past(tmp_path / "metrics.jsonl", 50) and went_past(tmp_path / "metrics.jsonl", 49)
    big = tmp_path / "big.jsonl"  # lines longer than the block read from the end
    big.write_text("".join(json.dumps({"step": s, "x": "y" * 300}) + "\n" for s in (1, 2, 3)))
    assert [went_past(big, s, block=64) for s in (2, 3)] == [True, False]
    (tmp_path / "empty.jsonl").write_text("")
    assert not went_past(tmp_path / "empty.jsonl", 0)


def test_a_checkpoint_set_aside_resumes_into_another_folder_and_the_refusal_says_so(tmp_path):
    """Before, resuming a checkpoint of abandoned-after-step-2-.../ into its parent folder was refused with advice
    to delete the main run's checkpoints."""
    for step in (2, 4):
        fake_checkpoint(tmp_path, step)
    logs(tmp_path, [0, 1, 2, 3, 4])
    prepare_output_dir(str(tmp_path), str(tmp_path / "checkpoint-2"), 2).close()
    aside = tmp_path / [n for n in visible(tmp_path) if n.startswith("abandoned")][0]
    with pytest.raises(UsageError, match="holds the run that .*checkpoint-4 was set aside from: resume it into another "
                                         "--output_dir, which starts with its logs up to its step"):
        prepare_output_dir(str(tmp_path), str(aside / "checkpoint-4"), 4)
    prepare_output_dir(str(tmp_path / "b"), str(aside / "checkpoint-4"), 4).close()
    assert steps_in(tmp_path / "b" / "metrics.jsonl") == [0, 1, 2, 3, 4]


def test_a_resume_says_that_a_dataset_file_was_edited(tmp_path):
    from dataclasses import asdict

    from config import parse_config
    from mixture import resume_signature
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1 + 1", "answer": "2"}\n')
    config = asdict(parse_config(["--dataset", str(data)])) | resume_signature(parse_config(["--dataset", str(data)]))
    os.makedirs(tmp_path / "checkpoint-8")
    (tmp_path / "checkpoint-8" / "checkpoint.json").write_text(json.dumps({"step": 8, "config": config}))
    assert check_checkpoint(str(tmp_path / "checkpoint-8"), config) == (8, [])
    data.write_text('{"prompt": "1 + 2", "answer": "3"}\n')
    now = config | resume_signature(parse_config(["--dataset", str(data)]))
    assert check_checkpoint(str(tmp_path / "checkpoint-8"), now)[1] == [
        f"--dataset file {data} edited since the checkpoint (another content hash)"]


def test_a_collective_waits_longer_than_a_rank_may_wait_for_the_server():
    """gloo's 30 min: a --vllm_server_timeout above it stopped the other ranks, waiting in a collective, first."""
    from config import parse_config
    assert parse_config([]).collective_timeout() == 1800
    assert parse_config(["--vllm_server_timeout", "3600"]).collective_timeout() > 3600
    assert parse_config(["--vllm_request_timeout", "7200"]).collective_timeout() > 7200


def test_resuming_another_folders_checkpoint_starts_this_folder_with_its_logs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    for step in (2, 4):
        fake_checkpoint(a, step)
    logs(a, [0, 1, 2, 3, 4])
    prepare_output_dir(str(b), str(a / "checkpoint-2"), 2).close()
    assert visible(b) == ["metrics.jsonl", "rollouts.jsonl"] and steps_in(b / "metrics.jsonl") == [0, 1, 2]
    assert visible(a) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl", "rollouts.jsonl"]  # untouched
    assert steps_in(a / "metrics.jsonl") == [0, 1, 2, 3, 4]
    c = tmp_path / "c"
    c.mkdir()
    fake_checkpoint(c, 9)  # another run's checkpoints: never pruned by this one, never mixed with it
    with pytest.raises(UsageError, match=r"\(checkpoint-9\): choose another --output_dir, or delete them"):
        prepare_output_dir(str(c), str(a / "checkpoint-2"), 2)
    assert visible(c) == ["checkpoint-9"]


def test_a_resume_names_every_flag_it_changes_and_refuses_one_that_breaks_the_run(tmp_path):
    """A resumed run's own flags apply from the next step; the ones it changed are said (a new default, such as
    the embedded task's rewards, changes under a checkpoint too), not taken silently. The run's address and the
    optimizer's settings (said where the optimizer is restored) are not listed."""
    from dataclasses import asdict

    from config import Config, parse_config
    saved = asdict(Config(system_prompt="", reward_funcs="accuracy,format", max_steps=16))
    os.makedirs(tmp_path / "checkpoint-8")
    (tmp_path / "checkpoint-8" / "checkpoint.json").write_text(json.dumps({"step": 8, "config": saved}))
    now = asdict(parse_config(["--max_steps", "16", "--vllm_server_port", "9999", "--learning_rate", "1e-5"]))
    step, changed = check_checkpoint(str(tmp_path / "checkpoint-8"), now)
    assert step == 8 and changed == [f"--system_prompt '' -> {now['system_prompt']!r}",
                                     f"--reward_funcs 'accuracy,format' -> {now['reward_funcs']!r}",
                                     f"--reward_weights '' -> {now['reward_weights']!r}",
                                     "--lr_scheduler_type 'constant' -> 'linear'"]  # (the learning rate: not listed)
    assert check_checkpoint(str(tmp_path / "checkpoint-8"), saved) == (8, [])
    with pytest.raises(UsageError, match="cannot resume from .* exactly: --seed 42 -> 7"):
        check_checkpoint(str(tmp_path / "checkpoint-8"), saved | {"seed": 7})
    # the adapter is loaded with its saved config: before, a changed LoRA flag was said to apply, and did not
    lora = saved | {"use_peft": True}
    (tmp_path / "checkpoint-8" / "checkpoint.json").write_text(json.dumps({"step": 8, "config": lora}))
    for flag, value in (("lora_r", 64), ("lora_alpha", 1.0), ("lora_target_modules", "q_proj"), ("lora_dropout", 0.3)):
        with pytest.raises(UsageError, match=f"exactly: --{flag} {lora[flag]!r} -> {value!r}"):
            check_checkpoint(str(tmp_path / "checkpoint-8"), lora | {flag: value})
    assert check_checkpoint(str(tmp_path / "checkpoint-8"), lora) == (8, [])
    (tmp_path / "checkpoint-8" / "checkpoint.json").write_text(json.dumps({"step": 8, "config": saved}))
    assert check_checkpoint(str(tmp_path / "checkpoint-8"), saved | {"lora_r": 64})[1] == ["--lora_r 16 -> 64"]
