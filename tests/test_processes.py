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
