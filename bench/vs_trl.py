"""nanogrpo against TRL's GRPOTrainer on the same configuration, one after the other in one invocation:
SmolLM2-135M, the embedded arithmetic task and its two rewards, 8 prompts x G=8, up to 128 completion
tokens, micro-batches of 16, learning rate 3e-5 (constant), AdamW betas (0.9, 0.99), beta 0, loss dapo,
bf16 where the CPU has it natively and fp32 elsewhere (both), the same number of steps. TRL runs in its own
virtual environment (bench/.venv-trl, made on first use from PyPI: trl 1.16.0 with the torch and transformers of
requirements.txt) and generates with transformers (its vLLM modes need CUDA); by default with gradient checkpointing
(TRL's default) and without. nanogrpo runs against its own vLLM server, as is and with --async_generation; the
server's KV cache holds one step, as run.sh sizes it.

Prints the mean step time over the steps after the first, the peak resident memory of each run (all its
processes; nanogrpo's trainer and server apart), and each nanogrpo run's step time and peak memory (the
trainer's, and the trainer's + the server's) over TRL's.

    .venv/bin/python bench/vs_trl.py [--steps 4] [--trl_gradient_checkpointing true,false] [--nanogrpo "" "--async_generation"]
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from common import ROOT, PeakRSS, mean, serving, steady, step_kv_cache_bytes, train, workload_arguments
from limits import compute_dtype

VENV = os.path.join(ROOT, "bench", ".venv-trl")
PROMPT_BOUND = 128  # tokens: train.py's --max_prompt_length (the arithmetic prompts are shorter), for the KV cache
TRL_PACKAGES = ["trl==1.16.0", "torch==2.13.0", "transformers==5.19.0", "datasets==5.2.0", "math-verify==0.9.0"]


def trl_python() -> str:
    python = os.path.join(VENV, "bin", "python")
    if subprocess.run([python, "-c", "import trl"], capture_output=True).returncode if os.path.exists(python) else True:
        print(f"making {VENV} ({' '.join(TRL_PACKAGES)}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        uv = os.path.join(os.path.dirname(sys.executable), "uv")  # as setup.sh installs (several times faster)
        links = ["--find-links", os.environ["PIP_FIND_LINKS"]] if os.environ.get("PIP_FIND_LINKS") else []
        if not (os.path.exists(uv) and subprocess.run([uv, "pip", "install", "-q", "--compile-bytecode", "--python", python,
                                                       *links, *TRL_PACKAGES]).returncode == 0):
            subprocess.run([python, "-m", "pip", "install", "-q", *TRL_PACKAGES], check=True)
    return python


def run_trl(model: str, a, checkpointing: str) -> tuple[dict, float]:
    from utils import stop_process_group
    proc = subprocess.Popen([trl_python(), os.path.join(ROOT, "bench", "trl_grpo.py"), "--model", model, "--steps", str(a.steps),
                             "--prompts", str(a.prompts), "--G", str(a.G), "--length", str(a.length),
                             "--gradient_checkpointing", checkpointing, "--micro_batch_size", str(min(16, a.prompts * a.G))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    memory = PeakRSS(proc.pid)
    try:
        out, err = proc.communicate()
    finally:
        peak = memory.stop()
        stop_process_group(proc)
    if proc.returncode:
        raise RuntimeError(f"TRL failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1]), peak


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--trl_gradient_checkpointing", default="true,false")
    p.add_argument("--nanogrpo", nargs="*", default=["", "--async_generation"], help="train.py flags of each nanogrpo run")
    a = p.parse_args()
    from embedded import resolve_model
    model = resolve_model(a.model)
    results = []  # (name, step seconds, peak GiB, note)
    for checkpointing in a.trl_gradient_checkpointing.split(","):
        trl, peak = run_trl(model, a, checkpointing)
        times = trl["step_times"][1:] or trl["step_times"]
        results.append((f"TRL 1.16.0, gradient checkpointing {checkpointing}", sum(times) / len(times), peak,
                        f"reward {' '.join(f'{r:.2f}' for r in trl['reward'])}"))
        print(results[-1], flush=True)
    kv = step_kv_cache_bytes(model, a.prompts, a.G, a.length, PROMPT_BOUND)  # as run.sh sizes it
    with tempfile.TemporaryDirectory() as tmp, serving(model, tmp, kv_cache_bytes=kv) as server:
        for i, flags in enumerate(a.nanogrpo):
            metrics, peak = train(model, server["port"], os.path.join(tmp, f"run{i}"), a.steps, a.prompts, a.G, a.length,
                                  flags=("--max_prompt_length", str(PROMPT_BOUND), *shlex.split(flags)))
            results.append((f"nanogrpo {flags or '(defaults)'}", mean(steady(metrics), "time/step"), peak,
                            "reward " + " ".join(f"{m['reward']:.2f}" for m in metrics if "reward" in m)))  # not evals
            print(results[-1], flush=True)
        server_peak, kv_note = server["memory"].peak, ("the shared server's own" if server.get("shared")
                                                      else f"{kv / 2 ** 30:.2f} GiB, one step's")
    print(f"\n{a.model} | {a.prompts} prompts x G={a.G}, up to {a.length} tokens | {a.steps} steps, mean over steps 2-{a.steps}"
          f" | {str(compute_dtype()).removeprefix('torch.')} | {os.cpu_count()} CPUs")
    print(f"  {'run':52s} {'s/step':>7s} {'peak GiB':>8s}")
    for name, step, peak, note in results:
        print(f"  {name:52s} {step:7.1f} {peak:8.1f}   {note}")
    print(f"  (nanogrpo's vLLM server: peak {server_peak:.2f} GiB; its KV cache: {kv_note})")
    for name, step, peak, _ in results:
        if name.startswith("nanogrpo"):
            print(f"  {name} / " + ", ".join(f"{t[0].split(', ')[1]}: step {step / t[1]:.2f}, memory: trainer {peak / t[2]:.2f}"
                                             f" trainer + server {(peak + server_peak) / t[2]:.2f}"
                                             for t in results if t[0].startswith("TRL")))
