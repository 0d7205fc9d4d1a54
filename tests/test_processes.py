"""Stopping what a test or bench started: the whole tree, also a child in a session of its own that
ignores SIGTERM (as a torchrun rank stuck in a collective does), and nothing else."""
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest

from utils import descendants, stop_process_group

# a parent (like torchrun) that starts a child in its own session; the child ignores SIGTERM
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(600)"], start_new_session=True, stdout=sys.stdout)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_process_group_stops_a_child_in_its_own_session_and_nothing_else():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    proc = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert proc.stdout.readline().strip() == "ready"
        (child, _), = descendants(proc.pid)
        assert os.getsid(child) == child != proc.pid  # out of the group that killpg reaches
        stop_process_group(proc, timeout=1)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is not None and not alive(child)
        assert bystander.poll() is None  # not ours to stop
    finally:
        for p in (proc, bystander):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
        bystander.wait()


CASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupted_case.py")


def test_a_test_run_stopped_with_sigterm_stops_what_its_fixtures_started(tmp_path):
    """pytest killed by a CI's time-out or a user: the fixtures' teardown still runs (as on Ctrl-C), so no server
    or torchrun rank outlives the run."""
    pid_file = tmp_path / "pid"
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{CASE}::test_holds_a_tree_until_stopped"], start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, NANOGRPO_TEST_PID_FILE=str(pid_file)))
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = int(pid_file.read_text())
        while not descendants(tree) and time.monotonic() < deadline:  # the tree's child is starting
            time.sleep(0.1)
        (child, _), = descendants(tree)
        os.kill(inner.pid, signal.SIGTERM)
        output = inner.communicate(timeout=60)[0]
        assert not alive(tree) and not alive(child), output[-3000:]
    finally:
        stop_process_group(inner, timeout=1)


def test_a_process_left_running_after_the_tests_is_killed_listed_and_fails_the_run():
    inner = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"{CASE}::test_forgets_a_process"], capture_output=True, text=True, timeout=120)
    assert "1 passed" in inner.stdout and inner.returncode == 1
    assert "processes started by the tests were still running after them (killed now; the run fails):" in inner.stderr
    pid = int(inner.stderr.split("(killed now; the run fails):")[1].split()[0])
    assert "sleep 600" in inner.stderr and not alive(pid)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode(errors="replace").split("=", 1) for e in f.read().split(b"\0") if b"=" in e)


def run_sh(way: str, tiny_model: str, out, env: dict) -> str:
    """run.sh on the tiny model, stopped the `way` named (Ctrl-C once it trains, a server that fails to start, a
    --dry_run that ends by itself); checks what that way leaves and returns the key its server got."""
    from conftest import ROOT, die_with_parent, stop
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "run.sh"), "--model", tiny_model, "--reward_funcs",
                             "tests.helpers:brevity", "--num_generations", "2", "--prompts_per_step", "2",
                             "--max_completion_length", "8", "--max_steps", "500", "--eval_steps", "0",
                             "--no_save_model", "--output_dir", str(out), *["--dry_run"] * (way == "dry run")],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=die_with_parent,
                            env=env | ({"SERVER_ARGS": "--no-such-flag"} if way == "server fails" else {}), cwd=ROOT)
    server = trainer = None
    try:
        deadline = time.monotonic() + 300
        while not (server and (trainer or way != "ctrl-c")) and proc.poll() is None and \
                time.monotonic() < deadline:
            tree = {pid: cmdline(pid) for pid, _ in descendants(proc.pid)}
            server = server or next((p for p, c in tree.items() if "vllm_server.py" in c and "setsid" not in c), None)
            trainer = next((p for p, c in tree.items() if "train.py" in c), None)
            time.sleep(0.1)
        assert server, proc.communicate(timeout=60)[0][-3000:]
        key = environ_of(server)["VLLM_API_KEY"]
        assert len(key) >= 24 and (trainer is None or environ_of(trainer)["VLLM_API_KEY"] == key)
        tree = [proc.pid] + [pid for pid, _ in descendants(proc.pid)]
        assert not [c for c in map(cmdline, tree) if key in c]  # on no command line
        if way == "ctrl-c":  # early: as the run starts (its reward process too)
            while not (out / "metrics.jsonl").exists() and proc.poll() is None:
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGINT)  # the terminal's foreground group: run.sh and the trainer
        output = proc.communicate(timeout=300)[0]
        deadline = time.monotonic() + 30
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(server) and (way == "ctrl-c" or (proc.returncode == 0) == (way == "dry run")), output[-3000:]
        said = {"ctrl-c": "stopped by a signal", "server fails": "the vLLM server exited; its log:",
                "dry run": "dry run passed: 11 checks"}[way]
        assert said in output, output[-3000:]
        if way == "dry run":
            assert sorted(os.listdir(out)) == ["dry_run.txt", "server.log"]
        return key
    finally:
        stop(proc)
        if server and alive(server):
            os.killpg(server, signal.SIGKILL)


@pytest.mark.slow
def test_run_sh_gives_each_run_a_fresh_key_in_the_environment_and_stops_its_server_on_every_way_out(tiny_model,
                                                                                                    tmp_path):
    """run.sh as a user runs it: a key of its own for each run, handed to the server and the trainer in their
    environment (a command line is readable by every local user); the server it started is gone when the run is
    stopped with Ctrl-C (which the server, in a session of its own, does not get), and when the server itself
    fails to start (a flag vLLM does not know: it exits while importing, and run.sh shows its log), and after a
    --dry_run (which passes, and leaves its report and the server's log alone in the output folder). The three
    runs go at once, each in its own folder and process group: one after the other, their setup.sh checks and
    server starts took 200 s, at once 110 s (2 loaded cores)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"} | {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                                          "OMP_NUM_THREADS": "1"}
    ways = ("ctrl-c", "server fails", "dry run")
    with concurrent.futures.ThreadPoolExecutor(len(ways)) as pool:
        runs = [pool.submit(run_sh, way, tiny_model, tmp_path / way.replace(" ", "-"), env) for way in ways]
    keys = [run.result() for run in runs]
    assert len(set(keys)) == 3  # fresh for each run
