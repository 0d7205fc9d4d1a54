"""Logs and checkpoints survive the way runs end: a record of metrics.jsonl or rollouts.jsonl cut short by a kill
or a full disk never blocks a resume or the plot, and a write that does not fit leaves no half record behind; a
checkpoint is on the disk before older ones are pruned, and one that cannot be pruned does not stop the run."""
import json
import math
import os
import subprocess
import sys

from conftest import ROOT
from checkpoints import prepare_output_dir
from metrics import MetricsLogger, finite_json
from plot import draw, had_reference, plot_run, read_jsonl


def write(path, steps: list[int], torn: str = ""):
    with open(path, "w") as f:
        f.writelines(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in steps)
        f.write(torn)


def test_a_torn_last_line_is_dropped_on_resume_and_said(tmp_path, capsys):
    write(tmp_path / "metrics.jsonl", [1, 2, 3], torn='{"step": 4, "rew')  # killed while writing step 4
    write(tmp_path / "rollouts.jsonl", [1, 2, 3])
    lock = prepare_output_dir(str(tmp_path), str(tmp_path / "checkpoint-2"), 2)  # resumed from checkpoint-2
    logger = MetricsLogger(str(tmp_path), True)
    logger.log({"step": 3, "reward": 0.5})
    logger.close(), lock.close()
    said = capsys.readouterr().out
    assert "dropped 1 line(s) of" in said and "metrics.jsonl" in said and "rollouts.jsonl" not in said
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(tmp_path / "rollouts.jsonl")] == [1, 2]


def drawn(fig, panel: int) -> dict[str, list]:
    """{label: (steps, values)} of the lines drawn in one of the figure's four panels."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[panel].lines}


def test_the_plot_skips_a_torn_line(tmp_path):
    write(tmp_path / "metrics.jsonl", [1, 2], torn='{"step": 3, "rew')
    assert plot_run(str(tmp_path)) == str(tmp_path / "metrics.png") and os.path.getsize(tmp_path / "metrics.png")
    assert drawn(draw(read_jsonl(tmp_path / "metrics.jsonl")), 0) == {"train": ([1, 2], [0.1, 0.2])}


def test_the_plot_says_there_is_no_kl_without_a_reference_model(tmp_path):
    without = [{"step": s, "reward": 0.5, "kl": 0.0, "entropy": 1.0} for s in (1, 2, 3)]
    assert not had_reference(without) and had_reference(without[:1] + [{"step": 2, "kl": 1e-4}])
    # a step that trained no token (every group's rewards agreed, and were dropped) measured no KL or entropy: nan,
    # which metrics.jsonl holds as null
    without.append(json.loads(finite_json({"step": 4, "reward": 0.5, "kl": math.nan, "entropy": math.nan})))
    assert without[-1]["kl"] is None and not had_reference(without)
    for fig in (draw(without), draw(without, reference=False)):  # judged from the log, or said
        assert list(drawn(fig, 2)) == ["entropy"] and fig.axes[2].get_title() == "entropy (per token)"
        assert [t.get_text() for t in fig.axes[2].texts] == ["no KL: no reference model (--beta 0)"]
    with_kl = draw(without[:1] + [{"step": 2, "reward": 0.5, "kl": 1e-4, "entropy": 1.0}])
    assert drawn(with_kl, 2)["KL to the reference"] == ([1, 2], [0.0, 1e-4]) and not with_kl.axes[2].texts
    assert draw([{"step": 1, "eval/reward": 0.5}]) is None  # no training step yet: nothing to draw


FILL = """
import sys
sys.path.insert(0, sys.argv[1])
from metrics import MetricsLogger
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


def test_a_checkpoint_is_on_the_disk_before_it_counts_and_an_old_one_held_open_is_reported(tiny_model, tmp_path,
                                                                                          monkeypatch, capsys):
    """Every file of a new checkpoint and the folders are fsynced before the older checkpoints are pruned; an old
    checkpoint that cannot be deleted (a file held open on NFS) is reported as that, and the save succeeds."""
    import shutil
    import torch
    from transformers import AutoTokenizer
    from checkpoints import save_checkpoint
    from models import load_model
    model = load_model(tiny_model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = (model, optimizer, scheduler, AutoTokenizer.from_pretrained(tiny_model), {"seed": 1}, True, 1)
    out = str(tmp_path / "out")
    save_checkpoint(out, 1, *args)
    synced, fsync, rmtree = [], os.fsync, shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))

    def held_open(path, *a, **kw):
        if path.endswith("checkpoint-1"):
            raise OSError(16, "Device or resource busy")
        return rmtree(path, *a, **kw)
    monkeypatch.setattr(shutil, "rmtree", held_open)
    path = save_checkpoint(out, 2, *args)
    said = capsys.readouterr().out
    assert "warning: could not delete the old checkpoint" in said and "checkpoint-1" in said
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2"]
    assert torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)["step"] == 2
    staged = [p.replace(".tmp", "") for p in synced]
    files = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    assert set(files) <= set(staged) and path in staged and out in staged  # the files, the folder, its parent


def test_a_save_never_deletes_the_checkpoint_of_its_own_step(tiny_model, tmp_path, monkeypatch):
    """A run resumed from checkpoint-2 and stopped (SIGTERM) in its first step saves step 2 again. Before, the save
    deleted checkpoint-2 and renamed the new one in: on NFS its memory-mapped trainer_state.pt stays behind as a
    .nfsXXXX file, the rename fails, the error path deletes the new copy, and no checkpoint is left. Now the
    complete checkpoint of that step, which holds this very state, is kept as it is."""
    import shutil
    import torch
    from transformers import AutoTokenizer
    from checkpoints import checkpoints, save_checkpoint
    from models import load_model
    model = load_model(tiny_model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = (model, optimizer, scheduler, AutoTokenizer.from_pretrained(tiny_model), {"seed": 1}, True, 1)
    out = str(tmp_path / "out")
    path = save_checkpoint(out, 2, *args)
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True, mmap=True)  # as a resume holds it
    inode, rmtree = os.stat(os.path.join(path, "trainer_state.pt")).st_ino, shutil.rmtree

    def as_on_nfs(target, *a, **kw):  # an open file of a deleted folder stays as .nfsXXXX: the folder stays too
        if os.path.abspath(target) == os.path.abspath(path):
            rmtree(target, *a, **kw)
            os.makedirs(target)
            open(os.path.join(target, ".nfs0000000000000001"), "w").close()
            if not kw.get("ignore_errors"):
                raise OSError(16, "Device or resource busy")
            return
        return rmtree(target, *a, **kw)
    monkeypatch.setattr(shutil, "rmtree", as_on_nfs)
    assert save_checkpoint(out, 2, *args) == path
    assert checkpoints(out) == [path] and os.stat(os.path.join(path, "trainer_state.pt")).st_ino == inode
    assert state["step"] == 2 and sorted(os.listdir(out)) == ["checkpoint-2"]


def test_logs_are_strict_json_without_nan_or_inf(tmp_path):
    """A step with no token to average (is_ratio/min was Infinity) or a completion not scored (NaN) is written as
    null: strict readers (jq, JavaScript, json.loads refusing the constants) take every line."""
    logger = MetricsLogger(str(tmp_path), True)
    logger.log({"step": 1, "is_ratio/min": float("inf"), "reward": float("nan"), "loss": 0.5})
    logger.log_rollouts([{"step": 1, "rewards": {"a": float("nan"), "b": 1.0}, "reward": float("-inf")}])
    logger.close()

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    rollout = json.loads((tmp_path / "rollouts.jsonl").read_text(), parse_constant=refuse)
    assert metrics == {"step": 1, "is_ratio/min": None, "reward": None, "loss": 0.5}
    assert rollout == {"step": 1, "rewards": {"a": None, "b": 1.0}, "reward": None}
