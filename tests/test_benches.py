"""Every bench script runs, in its smallest setting (the tiny model, one or two steps, TRL's side
included), and prints its result: a bench that cannot run cannot back a number in README. Speeds are not
checked here (the machine is shared; README's come from full-size runs); what is checked is a property of each
bench's numbers that a broken bench would not have: a ratio that is the quotient of the numbers it names, counts
that match the workload, phases that add up to the step, a repeat that repeats."""
import concurrent.futures
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


# The benches that need no server, by test: the script and its arguments after --model.
SERVERLESS = {"test_logprob_memory": ["logprob_memory.py", "--batch", "2", "--prompt", "8", "--completion", "8"],
              "test_fsdp_memory": ["fsdp_memory.py", "--micro_batches", "2", "--micro_batch_size", "1", "--length", "8",
                                   "--phases", "save,resume"]}  # save loads, runs the backward and the step first


@pytest.fixture(scope="module")
def serverless(model, request) -> dict:
    """The runs of the SERVERLESS benches whose tests are in this session, all at once: each mostly starts
    processes that import and load a model, about one core each, so on 2 cores the two took 60 s together against
    90 s one after the other. Each test reads its own bench's output; a bench that failed fails its test."""
    chosen = [item.name for item in request.session.items if item.module is request.module and item.name in SERVERLESS]
    with concurrent.futures.ThreadPoolExecutor(len(chosen)) as pool:
        return {name: pool.submit(bench, SERVERLESS[name][0], "--model", model, *SERVERLESS[name][1:])
                for name in chosen}


def bench(name: str, *args: str, timeout: int = 600, env: dict | None = None) -> str:
    proc = run([sys.executable, os.path.join(ROOT, "bench", name), *args], timeout=timeout,
               env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def quotient(ratio: str, a: str, b: str) -> bool:
    """Whether a printed ratio can be the quotient a / b of two printed numbers, given the digits each was
    rounded to (0.22 / 0.14 printed as 1.62: 1.57 from the rounded numbers)."""
    half = lambda x: 0.5 * 10 ** -len(x.split(".")[1]) if "." in x else 0.5
    r, x, y = (float(v.rstrip("sx")) for v in (ratio, a, b))
    hr, hx, hy = (half(v.rstrip("sx")) for v in (ratio, a, b))
    return y - hy > 0 and (x - hx) / (y + hy) - hr <= r <= (x + hx) / (y - hy) + hr


def phases(out: str, run: str) -> dict[str, float]:
    """step_breakdown's table of one run: phase -> seconds."""
    table = out.split(f"{run}: mean over steps")[1].split("step ")[0]
    return {line.split()[0]: float(line.split()[1]) for line in table.splitlines()[1:] if line.strip()}


def test_step_breakdown_with_a_comparison(model, shared):
    out = bench("step_breakdown.py", "--model", model, *SMALL, "--compare=--async_generation", env=shared)
    assert out.count(", 4 per step;") == 2  # 2 prompts x G=2, in each run
    for flags in ("base", "--async_generation"):  # the phases add up to the step (the optimizer is within train)
        times = phases(out, flags)
        step = float(out.split(f"{flags}: mean over steps")[1].split("  step")[1].split()[0])
        assert abs(sum(t for k, t in times.items() if k != "optimizer") - step) <= 0.01 * len(times), (flags, times)
    ratio = re.search(r"step time --async_generation / base: (\S+);", out)[1]
    steps = re.findall(r"\n  step +(\S+) s", out)
    assert quotient(ratio, steps[1], steps[0]), (ratio, steps)


def test_scaling(model, shared):
    out = bench("scaling.py", "--model", model, "--steps", "2", "--prompts", "2", "--runs", "1:2:8,2:2:8", env=shared)
    rows = [line.split() for line in out.splitlines() if line.split()[:3] in (["1", "2", "8"], ["2", "2", "8"])]
    assert "vs base" in out and len(rows) == 2 and rows[0][-2] == "1.00"  # the base run over itself
    for row in rows:  # the phases add up to the step (each rounded to 0.01 s, the step to 0.1 s)
        assert abs(sum(float(t.rstrip("s")) for t in row[4:11]) - float(row[11].rstrip("s"))) <= 0.05 + 0.005 * 7, row
    assert quotient(rows[1][-2], rows[1][11], rows[0][11])  # vs base: this run's step over the base run's
    assert float(rows[1][-1]) > float(rows[0][-1])  # two trainers hold two models: more memory than one


def test_learning(model, shared):
    out = bench("learning.py", "--model", model, "--seeds", "42", "42", "--env", "calculator", "--", "--max_steps",
                "1", "--prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "32",
                "--eval_num_prompts", "2", env=shared)
    assert out.count("seed 42: accuracy") == 2 and re.search(r"tool calls \d\.\d\d -> \d\.\d\d \(well-formed ", out)
    runs = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("seed 42: accuracy")]
    assert runs[0] == runs[1]  # a seed repeats its run: before, after, tool calls
    assert out.count("(2 problems x 4 samples, steps 0 -> 1)") == 2  # --eval_num_prompts 2
    assert "rose in" in out and "of 2 seeds" in out  # one seed twice: how much a run repeats
    # one number is a count of runs: a seed given for one (42 runs, hours) is refused and --seed is named
    proc = run([sys.executable, os.path.join(ROOT, "bench", "learning.py"), "--seeds", "42"], timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "give --seed 42" in proc.stderr and "seeds 42 to 83" in proc.stderr


def test_multi_turn(model, shared):
    out = bench("multi_turn.py", "--model", model, "--env", "guess", "--steps", "2", "--prompts", "2", "--G", "2",
                "--length", "96", env=shared)  # room for an opened call (the bench opens them), its answer and a turn
    assert "multi-turn generation vs vllm.LLM, steps after the first" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 and all(1 <= int(r[1]) and 0 < float(r[3]) <= 96 for r in rows), rows  # turns, tokens
    ratio, a, b = re.search(r"steps after the first: (\S+) / (\S+) = (\S+)", out).group(3, 1, 2)
    assert quotient(rows[1][6], rows[1][4], rows[1][5]) and quotient(ratio, a, b) and (a, b) == tuple(rows[1][4:6])


def test_logprob_memory(serverless):
    out = serverless["test_logprob_memory"].result()
    assert "chunked / logits" in out and "train_checkpointing / train" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "peak RSS growth" in line}
    for a, b in (("chunked", "logits"), ("train_checkpointing", "train")):  # the ratios are of the rows above
        memory, time = re.search(rf"{a} / {b}: memory (\S+)x, time (\S+)x", out).groups()
        assert quotient(memory, rows[a][4], rows[b][4]), (a, b, memory)
        assert float(rows[b][6]) < 0.01 or quotient(time, rows[a][6], rows[b][6]), (a, b, time)
    assert float(rows["train"][4]) > float(rows["logits"][4])  # a backward holds more than log-probs alone


def test_limits(model, shared):
    out = bench("limits.py", "--model", model, *SMALL, "--side_by_side", "", "entropy_coef=0.01", env=shared)
    assert "weight push (vs vLLM's reload)" in out and "generate (vs vllm.LLM)" in out
    assert "the defaults" in out and "entropy_coef=0.01" in out
    for line in out.splitlines():  # each ratio is nanogrpo's time over the limit's, where that is measurable
        cells = re.findall(r"(\d+\.\d+)s", line)
        if len(cells) == 2 and float(cells[1]) >= 0.02:
            assert quotient(line.split()[-1], *cells), line


def test_request_latency(shared):
    out = bench("request_latency.py", "--models", "tiny", "--pollings", "shipped", "--requests", "2", "--pushes", "1",
                "--idle", "0.5", env=shared)
    assert "2 requests" in out and "1 pushes" in out and "idle server, CPU" in out
    for what in ("2 requests", "1 pushes"):
        median, p90, top = map(float, re.search(rf"{what} +median +(\S+) +p90 +(\S+) +max +(\S+)", out).groups())
        assert 0 < median <= p90 <= top, what
    assert float(re.search(r"idle server, CPU +(\S+) cores", out)[1]) < 0.5  # an idle server does not spin


def test_sample_streams(model, shared):
    out = bench("sample_streams.py", "--model", model, "--prompts", "3", "--G", "4", "--length", "8", "--repeats", "1",
                env=shared)
    one, per_prompt = (re.search(rf"{way} +median +(\S+) s +the same prompt's two groups sample alike: (\w+)", out)
                       for way in ("one request", "a request per prompt"))
    assert one[2] == "True" and per_prompt[2] == "False", out  # one request: the j-th samples share a stream
    assert quotient(re.search(r"a request per prompt / one request: (\S+)", out)[1], per_prompt[1], one[1]), out


def test_server_repeat(model, shared):
    out = bench("server_repeat.py", "--model", model, "--repeats", "1", "--prompts", "2", "--G", "2", "--length", "8",
                env=shared)
    # the test server computes in fp32: a repeated request samples the same tokens, alone or next to another
    assert re.search(r"alone, again \(1\): +same tokens +4/4 +same log-probs +4/4", out), out
    assert re.search(r"next to another request \(1\): +same tokens +4/4", out), out


def test_vs_trl_runs_trl_and_nanogrpo(model, shared):
    out = bench("vs_trl.py", "--model", model, *SMALL, "--trl_gradient_checkpointing", "true", "--nanogrpo", "",
                timeout=1200, env=shared)
    assert "TRL 1.16.0, gradient checkpointing true" in out and "nanogrpo (defaults) / gradient checkpointing true" in out
    runs = {name: (float(step), float(peak)) for name, step, peak in
            re.findall(r"\('([^']+)', ([\d.]+), ([\d.]+), 'reward", out)}
    (step, trainer), (trl_step, trl_peak) = runs["nanogrpo (defaults)"], runs["TRL 1.16.0, gradient checkpointing true"]
    server = float(re.search(r"vLLM server: peak ([\d.]+) GiB", out)[1])
    assert "its KV cache: the shared server's own" in out  # not a size this bench did not give it
    ratios = re.search(r"gradient checkpointing true: step ([\d.]+), memory: trainer ([\d.]+) trainer \+ server ([\d.]+)",
                       out)
    assert ratios, out
    assert abs(float(ratios[1]) - step / trl_step) < 0.006
    assert abs(float(ratios[2]) - trainer / trl_peak) < 0.006 and abs(float(ratios[3]) - (trainer + server) / trl_peak) < 0.02


def test_lora_sync(model, shared):
    out = bench("lora_sync.py", "--model", model, *SMALL, "--lora_r", "4", env=shared)
    times = {how: re.search(rf"{how} +push +(\S+) s +generate +(\S+) s +step +(\S+) s", out).groups()
             for how in ("adapter", "merged")}
    for i, what in enumerate(("push", "generate", "step")):  # each ratio is the quotient of the runs' times
        ratio = re.search(rf"adapter / merged, {what}: (\S+)", out)[1]
        assert quotient(ratio, times["adapter"][i], times["merged"][i]), (what, ratio, times)
    counted = re.search(r"bytes of one push, \S+ \(32-bit\): adapter (\S+) MB, merged (\S+) MB", out)
    assert counted and float(counted[1]) < float(counted[2]), out  # the test server computes in fp32
    assert "Llama-2-70B (bf16, on paper): adapter 98.8 MB, merged 128.5 GB" in out  # r=4: a quarter of r=16's


def test_loss_parity_with_trl_on_every_setting():
    out = bench("loss_parity.py", timeout=900)
    total = out.split("_compute_loss")[1].split(" cases")[0].split()[-1]
    assert int(total) > 1000 and f"{total} of {total} cases equal to 1e-10" in out, out
    for row in ("adaptive entropy", "the kl metric", "multi_objective_aggregation"):
        assert int(out.split(row)[1].split(" cases")[0].split()[-1]) > 0, (row, out)


def test_fsdp_memory(serverless):
    out = serverless["test_fsdp_memory"].result()
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert list(rows) == ["save", "resume"], out
    for phase, (_, ddp, fsdp, ratio, _, r0, _, r1, _, f0, _, f1) in rows.items():
        assert quotient(ratio, fsdp, ddp) and 0 < float(ddp) < 2, (phase, rows[phase])  # a 3 M model: MBs
        for mean, (a, b) in ((ddp, (r0, r1)), (fsdp, (f0, f1))):  # the mean of the two ranks
            assert abs(float(mean) - (float(a) + float(b)) / 2) <= 0.011, rows[phase]
