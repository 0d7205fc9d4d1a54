"""metrics.jsonl and rollouts.jsonl survive the way runs end: a record cut short by a kill or a full disk never
blocks a resume or the plot, and a write that does not fit leaves no half record behind."""
import json
import os
import subprocess
import sys

from conftest import ROOT
from plot import plot_run, read_jsonl
from utils import MetricsLogger


def write(path, steps: list[int], torn: str = ""):
    with open(path, "w") as f:
        f.writelines(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in steps)
        f.write(torn)


def test_a_torn_last_line_is_dropped_on_resume_and_said(tmp_path, capsys):
    write(tmp_path / "metrics.jsonl", [1, 2, 3], torn='{"step": 4, "rew')  # killed while writing step 4
    write(tmp_path / "rollouts.jsonl", [1, 2, 3])
    logger = MetricsLogger(str(tmp_path), True, resume_step=2)  # resumed from checkpoint-2
    logger.log({"step": 3, "reward": 0.5})
    logger.close()
    said = capsys.readouterr().out
    assert "dropped 1 line(s) of" in said and "metrics.jsonl" in said and "rollouts.jsonl" not in said
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(tmp_path / "rollouts.jsonl")] == [1, 2]


def test_the_plot_skips_a_torn_line(tmp_path):
    write(tmp_path / "metrics.jsonl", [1, 2], torn='{"step": 3, "rew')
    assert plot_run(str(tmp_path)) == str(tmp_path / "metrics.png")


FILL = """
import sys
sys.path.insert(0, sys.argv[1])
from utils import MetricsLogger
logger = MetricsLogger(sys.argv[2], True)
try:
    for step in range(1, 1000):
        logger.log({"step": step, "text": "x" * 300})
except OSError as e:
    print("stopped at", step, e.errno)
"""


def test_a_record_that_does_not_fit_leaves_no_half_record(tmp_path):
    """Files may not grow past 4000 bytes (EFBIG, as a full disk gives ENOSPC): the record that does not fit is
    not written at all."""
    proc = subprocess.run([sys.executable, "-c", FILL, ROOT, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE,
                                                                                (4000, 4000)))
    assert proc.stdout.startswith("stopped at"), proc.stdout + proc.stderr
    text = open(tmp_path / "metrics.jsonl").read()
    assert text.endswith("\n") and len(text) <= 4000
    steps = [json.loads(line)["step"] for line in text.splitlines()]  # every line whole
    assert steps == list(range(1, len(steps) + 1)) and int(proc.stdout.split()[2]) == len(steps) + 1
