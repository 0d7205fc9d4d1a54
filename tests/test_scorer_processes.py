"""The reward scorer's process runs user code: what a reward function starts ends with it, when the function
times out, when the run closes the scorer and when the trainer is killed, and it does not see the trainer's
secrets."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from config import RunStopped
from scorer import RewardScorer

HANGS = "tests.helpers:starts_a_child_and_hangs"


def gone(pids: list[int], within: float = 20) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in pids):
            return True
        time.sleep(0.1)
    return False


def pids_from(path) -> tuple[list[int], str]:
    deadline = time.monotonic() + 60
    while not (os.path.exists(path) and open(path).read()) and time.monotonic() < deadline:
        time.sleep(0.1)
    scorer, child, secret = open(path).read().split()
    return [int(scorer), int(child)], secret


def run_script(tmp_path, body: str) -> str:
    """`body` run as a trainer's script of its own (the repository on its path): its output; it must exit 0."""
    script = tmp_path / "trainer.py"
    script.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + body)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_reward_that_times_out_leaves_nothing_running_and_sees_no_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGRPO_TEST_PID_FILE", str(tmp_path / "pids"))
    monkeypatch.setenv("VLLM_API_KEY", "secret-key")
    scorer = RewardScorer([HANGS], ["prompt"], timeout=5)
    try:  # a function that scores none of its first batch stops the run (after stopping the scorer)
        with pytest.raises(RunStopped, match="did not finish within 5 s"):
            scorer([{"prompt": "p"}], ["c"], [[1]])
    finally:
        scorer.close()
    pids, secret = pids_from(tmp_path / "pids")
    assert secret == "none"
    assert gone(pids), "the scorer process or the reward's child outlived the time-out"


def test_a_stop_signal_ends_the_wait_for_a_hung_reward_function_and_kills_what_it_started(tmp_path, monkeypatch):
    """config.STOP set (a stop signal) while a reward function hangs under --reward_timeout 600: the wait ends within
    a second (config.Interrupted: the run saves and stops), and the scorer process and its child are gone."""
    import threading
    from config import STOP, Interrupted
    monkeypatch.setenv("NANOGRPO_TEST_PID_FILE", str(tmp_path / "pids"))
    scorer = RewardScorer([HANGS], ["prompt"], timeout=600)
    timer = threading.Timer(0, lambda: (pids_from(tmp_path / "pids"), STOP.set()))  # once the function runs
    try:
        timer.start()
        with pytest.raises(Interrupted, match="while the reward functions ran"):
            scorer([{"prompt": "p"}], ["c"], [[1]])
    finally:
        timer.join()
        STOP.clear()
        scorer.close()
    assert gone(pids_from(tmp_path / "pids")[0], within=10), "the scorer process or the reward's child outlived the stop"


KILLED = """
import sys
sys.path.insert(0, sys.argv[1])
from config import RunStopped
from scorer import RewardScorer
RewardScorer([sys.argv[2]], ["prompt"], timeout=600)([{"prompt": "p"}], ["c"], [[1]])
"""


def test_the_scorer_and_what_it_started_end_when_the_trainer_is_killed(tmp_path):
    trainer = subprocess.Popen([sys.executable, "-c", KILLED, ROOT, HANGS], start_new_session=True,
                               env=dict(os.environ, NANOGRPO_TEST_PID_FILE=str(tmp_path / "pids")))
    try:
        pids, _ = pids_from(tmp_path / "pids")  # the reward function is running
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        assert gone(pids), "the scorer process or the reward's child outlived the killed trainer"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
        if os.path.exists(tmp_path / "pids"):
            for pid in map(int, open(tmp_path / "pids").read().split()[:2]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_the_scorer_process_does_not_import_the_trainers_script(tmp_path):
    """spawn's children import the parent's main script first: for train.py, torch and transformers (~4 s, ~0.3 GB)
    before the first score. The scorer needs nothing of it; it scores all the same."""
    out = run_script(tmp_path, "import torch\nfrom scorer import RewardScorer\n"
                               "if __name__ == '__main__':\n"
                               "    scorer = RewardScorer(['accuracy'], ['prompt', 'answer'])\n"
                               "    print(scorer([{'prompt': '2 + 2?', 'answer': '4'}], ['\\\\boxed{4}'], [[1]], 0))\n"
                               "    maps = open(f'/proc/{scorer._pid_of.get(timeout=60)}/maps').read()\n"
                               "    print('torch' in maps, 'libtorch' in open('/proc/self/maps').read())\n"
                               "    scorer.stop()\n")
    assert out.splitlines() == ["[[1.0]]", "False True"], out


def test_a_ctrl_c_as_the_scorer_starts_reaches_the_trainer_and_not_the_scorer(tmp_path):
    """The scorer process is born with Ctrl-C held back until it has a session of its own (a terminal's Ctrl-C
    killed it as it started); the trainer's Ctrl-C meanwhile still reaches the trainer's handler, with other
    threads running (as a trainer has). Ignoring SIGINT for the start lost it: the run went on."""
    out = run_script(tmp_path, "import os, signal, subprocess, sys, threading, time\n"
                               "from scorer import RewardScorer, _ctrl_c_held_back_from_children\n"
                               "got = []\n"
                               "signal.signal(signal.SIGINT, lambda *_: got.append('stop'))\n"
                               "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
                               "with _ctrl_c_held_back_from_children():\n"
                               "    os.kill(os.getpid(), signal.SIGINT)\n"
                               "    child = subprocess.run([sys.executable, '-c', 'import signal; "
                               "print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))'], capture_output=True, "
                               "text=True).stdout.strip()\n"
                               "time.sleep(0.5)\n"
                               "scorer = RewardScorer(['tests.helpers:ctrl_c_is_pythons'], ['prompt'])\n"
                               "print(got, child, scorer([{'prompt': 'a'}], ['b'], [[1]], 0))\n"
                               "scorer.stop()\n")
    assert out.strip() == "['stop'] True [[1.0]]", out
