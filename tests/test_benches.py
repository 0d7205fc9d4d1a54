"""Every bench script runs, in its smallest setting (the tiny model, one or two steps, TRL's side
included), and prints its result: a bench that cannot run cannot back a number in README. The numbers
themselves are not checked here (the machine is shared; README's come from full-size runs)."""
import os
import re
import sys

import pytest

from conftest import ROOT, run

pytestmark = pytest.mark.slow
SMALL = ["--steps", "2", "--prompts", "2", "--G", "2", "--length", "8"]  # one step after the warm-up one


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model  # 2048 positions: the benches' offline engines' max length


@pytest.fixture(scope="module")
def shared(server):
    """The session's server, for the benches that would each start their own the same way (bench/common.serving
    hands it out; a bench pushes its model's weights before it measures)."""
    return {"NANOGRPO_BENCH_SERVER": f"{server['port']}:{server['proc'].pid}"}


def bench(name: str, *args: str, timeout: int = 600, env: dict | None = None) -> str:
    proc = run([sys.executable, os.path.join(ROOT, "bench", name), *args], timeout=timeout,
               env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_step_breakdown_with_a_comparison(model, shared):
    out = bench("step_breakdown.py", "--model", model, *SMALL, "--compare=--async_generation", env=shared)
    assert "generate" in out and "step time --async_generation / base:" in out


def test_scaling(model, shared):
    out = bench("scaling.py", "--model", model, "--steps", "2", "--prompts", "2", "--runs", "1:2:8,2:2:8", env=shared)
    rows = [line.split() for line in out.splitlines() if line.split()[:3] in (["1", "2", "8"], ["2", "2", "8"])]
    assert "vs base" in out and len(rows) == 2 and rows[0][-2] == "1.00"  # the base run over itself


def test_learning(model, shared):
    out = bench("learning.py", "--model", model, "--seeds", "42", "42", "--env", "calculator", "--", "--max_steps",
                "1", "--prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "32",
                "--eval_num_prompts", "2", env=shared)  # room for the opened call and a few tokens of the model's
    assert out.count("seed 42: accuracy") == 2 and re.search(r"tool calls \d\.\d\d -> \d\.\d\d", out)
    assert "improved in" in out and "of 2 seeds" in out  # one seed twice: how much a run repeats
    # one number is a count of runs: a seed given for one (42 runs, hours) is refused and --seed is named
    proc = run([sys.executable, os.path.join(ROOT, "bench", "learning.py"), "--seeds", "42"], timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "give --seed 42" in proc.stderr and "seeds 42 to 83" in proc.stderr


def test_multi_turn(model, shared):
    out = bench("multi_turn.py", "--model", model, "--env", "guess", "--steps", "2", "--prompts", "2", "--G", "2",
                "--length", "96", env=shared)  # room for an opened call, its answer and a turn after it
    assert "multi-turn generation vs vllm.LLM, steps after the first" in out


def test_logprob_memory(model):
    out = bench("logprob_memory.py", "--model", model, "--batch", "2", "--prompt", "8", "--completion", "8")
    assert "chunked / logits" in out and "train_checkpointing / train" in out


def test_limits(model, shared):
    out = bench("limits.py", "--model", model, *SMALL, "--side_by_side", "", "entropy_coef=0.01", env=shared)
    assert "weight push (vs vLLM's reload)" in out and "generate (vs vllm.LLM)" in out
    assert "the defaults" in out and "entropy_coef=0.01" in out


def test_request_latency(shared):
    out = bench("request_latency.py", "--models", "tiny", "--pollings", "shipped", "--requests", "2", "--pushes", "1",
                "--idle", "0.5", env=shared)
    assert "2 requests" in out and "1 pushes" in out and "idle server, CPU" in out


def test_server_repeat(model, shared):
    out = bench("server_repeat.py", "--model", model, "--repeats", "1", "--prompts", "2", "--G", "2", "--length", "8",
                env=shared)
    assert re.search(r"alone, again \(1\): +same tokens +\d/4 +same log-probs +\d/\d", out), out
    assert "next to another request (1):" in out


def test_vs_trl_runs_trl_and_nanogrpo(model, shared):
    out = bench("vs_trl.py", "--model", model, *SMALL, "--trl_gradient_checkpointing", "true", "--nanogrpo", "",
                timeout=1200, env=shared)
    assert "TRL 1.16.0, gradient checkpointing true" in out and "nanogrpo (defaults) / gradient checkpointing true" in out


def test_loss_parity_with_trl_on_every_setting():
    out = bench("loss_parity.py", timeout=900)
    total = out.split("_compute_loss")[1].split(" cases")[0].split()[-1]
    assert int(total) > 1000 and f"{total} of {total} cases equal to 1e-10" in out, out


def test_fsdp_memory(model):
    out = bench("fsdp_memory.py", "--model", model, "--micro_batches", "2", "--micro_batch_size", "1", "--length", "8",
                "--phases", "save,resume")  # save loads, runs the backward and the step first
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert list(rows) == ["save", "resume"], out
