"""Run by tests/test_processes.py in a pytest of its own (named on its command line; not collected otherwise):
a test holding a process tree (like the server fixture), stopped with SIGTERM mid-test, and a test that forgets a
process it started."""
import os
import subprocess
import sys
import time

import pytest

from conftest import stop

TREE = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"  # a parent and its child


@pytest.fixture
def tree():
    proc = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True)
    try:
        yield proc
    finally:
        stop(proc)


def test_holds_a_tree_until_stopped(tree):
    with open(os.environ["NANOGRPO_TEST_PID_FILE"], "w") as f:
        f.write(str(tree.pid))
    time.sleep(600)


def test_forgets_a_process():
    subprocess.Popen(["sleep", "600"], start_new_session=True)
