"""bench/gpu_trainer.py, the trainer's side of a step on a GPU (issue 60), smoke-tested on the CPU through
bench/gpu_check.sh, the script that prepares the device call: the tiny model, with the packages the GPU image lacks
unimportable. What is checked is the bench's own arithmetic, which a broken bench would not have: tokens counted as
sent, parameters counted once, each ratio the quotient of the numbers printed, MFU = 6 x parameters x tokens / time /
peak. Not slow: it starts no server and no torchrun (its process group of one lives in its process); a few seconds
past the imports. (Not in tests/test_benches.py: every test there is marked slow by its pytestmark.)"""
import json
import os
import re
import sys

from conftest import ROOT, run
from test_benches import quotient

TINY = dict(vocab=512, hidden=64, intermediate=128, layers=2, kv=2 * 16)  # bench/gpu_trainer.SHAPES["tiny"]; kv heads


def tiny_parameters(vocab: int, hidden: int, intermediate: int, layers: int, kv: int) -> int:
    """A Qwen2 model's parameters, its tied head counted once: the embedding, per layer q, k, v (with biases), o, the
    MLP's three matrices and two norms, then the final norm."""
    layer = hidden * hidden + hidden + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden + layers * layer + hidden


def within_rounding(printed: str, value: float, relative: float) -> bool:
    """Whether `printed` (a percentage rounded to its digits) can be `value` known to within `relative`."""
    half = 0.5 * 10 ** -len(printed.rstrip("%").split(".")[1])
    return abs(float(printed.rstrip("%")) - value) <= half + relative * value


def test_gpu_trainer_bench_on_the_cpu_counts_what_it_sends(tmp_path):
    proc = run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--cpu"], timeout=300, cwd=ROOT,
               env=dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table, result = (tmp_path / "gpu_trainer.md").read_text(), json.loads((tmp_path / "gpu_trainer.json").read_text())
    assert table in proc.stdout and (tmp_path / "log.txt").read_text() == proc.stdout  # printed and kept as written
    params = tiny_parameters(**TINY)
    assert f"tiny: {params} parameters" in table  # the tied embedding and head once
    m = result["models"]["tiny"]
    tokens = m["sequences"] * m["prompt"] + sum(m["lengths"])  # sent: every prompt and completion token, no padding
    assert len(m["lengths"]) == m["sequences"] and f"{tokens} tokens per step" in table
    assert all(m["completion_min"] <= n <= m["completion_max"] for n in m["lengths"]) and len(set(m["lengths"])) > 1
    peak, matmul = (re.search(rf"{what} (\S+) TFLOP/s", table)[1] for what in ("Peak used:", "measured matmul peak"))
    assert peak == matmul and "no nominal peak for cpu" in table  # a CPU's MFU is against its measured matmul peak

    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| tiny")]
    assert [r[1:3] for r in rows] == [["bare transformers", "on"], ["trainer", "on"], ["bare transformers", "off"],
                                      ["trainer", "off"], ["trainer, FSDP2", "on"]]
    bare = {}
    for _, run_name, checkpointing, sent, per_s, mfu, of_matmul, gib, time_ratio, memory_ratio in rows:
        assert int(sent) == tokens, run_name
        # MFU from the printed tokens/s (rounded to 1) and peak (4 digits): 6 x parameters x tokens/s / peak
        relative = 0.5 / float(per_s) + 0.5 * 10 ** -len(peak.split(".")[1]) / float(peak)
        for printed, against in ((mfu, peak), (of_matmul, matmul)):
            assert within_rounding(printed, 100 * 6 * params * float(per_s) / (float(against) * 1e12), 2 * relative)
        if run_name == "bare transformers":
            bare[checkpointing] = per_s
            assert time_ratio == "-"
        else:  # time per step trainer / bare, the same tokens: bare's tokens/s over the trainer's
            assert quotient(time_ratio, bare[checkpointing], per_s), (run_name, time_ratio, bare, per_s)
        assert gib == memory_ratio == "-"  # no GPU memory to read on a CPU
    for row in result["rows"]:  # the JSON's numbers: a step is its backward and its optimizer step; tokens/s the mean
        assert all(abs(s - b - o) < 1e-9 for s, b, o in zip(row["seconds"], row["backward_s"], row["optimizer_s"]))
        mean = sum(row["seconds"]) / len(row["seconds"])
        assert len(row["seconds"]) == m["steps"] and abs(row["tokens_per_s"] * mean - tokens) < 1e-6 * tokens


def test_gpu_check_prints_a_device_call_within_the_tools_limits():
    proc = run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--call"], timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    call = json.loads(proc.stdout)
    assert len(call["command"]) <= 2000 and call["timeout_s"] <= 480 and call["carry"] == []
    assert "python3 bench/gpu_trainer.py --out \"$OUT\"" in call["command"]  # its table and JSON come back from $OUT
    timeout = int(re.search(r"timeout (\d+) python3", call["command"])[1])
    assert timeout < call["timeout_s"]  # the bench stops before the call does: its log and rows still come back
