"""Stopping what a test or bench started: the whole tree, also a child in a session of its own that
ignores SIGTERM (as a torchrun rank stuck in a collective does), and nothing else."""
import os
import signal
import subprocess
import sys
import time

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
