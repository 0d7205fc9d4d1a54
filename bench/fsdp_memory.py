"""Peak memory of each trainer rank, FSDP2 against DDP, 2 processes (gloo, this machine's CPU): what a rank
holds at most while it

  load    loads the policy and wraps it as train.py does (utils.load_model, distribute);
  backward  then runs the forward and backward of one optimizer step's --micro_batches micro-batches
          (train.accumulate_gradients, on random completions of --length tokens);
  step    then takes the optimizer step (train.optimizer_step, AdamW);
  save    then writes a checkpoint as train.py does (checkpoints.save_checkpoint: optimizer state gathered);
  resume  loads it, then restores the optimizer from that checkpoint as a resume does (load_checkpoint,
          restore_training_state).

Each phase runs in fresh processes, one after the other; the number is each rank's peak RSS (ru_maxrss)
less its RSS after the imports, the mean of the two ranks, in GiB. glibc is told to give every block of
64 KiB or more back to the system when it is freed (MALLOC_MMAP_THRESHOLD_), so that the peak is what was
alive at once, not what the allocator kept for later. For scale it prints the model's fp32
size: a full copy of weights, of gradients and of AdamW's two moments is 1x, 1x and 2x that.

    .venv/bin/python bench/fsdp_memory.py [--model smollm2-135m] [--micro_batches 4] [--micro_batch_size 1]
                                          [--phases load,backward,step,save,resume]

The default micro-batches are small, so that the model's state (weights, gradients, AdamW), not the
activations, is what the peaks show.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PHASES = ("load", "backward", "step", "save", "resume")


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


def worker(a):
    """One rank of one phase: prints a JSON line {rank, growth} on every rank."""
    from contextlib import nullcontext

    import torch
    from transformers import AutoTokenizer
    from checkpoints import load_checkpoint, restore_training_state, save_checkpoint
    from config import Config
    from embedded import resolve_model
    from models import distribute, load_model, lr_factor
    from rollout import collate, sampled_episode
    from train import accumulate_gradients, optimizer_step
    from utils import setup_distributed
    rank, _, world_size, device, _ = setup_distributed()
    start = rss_gib()
    cfg = Config(fsdp=a.mode == "fsdp", micro_batch_size=a.micro_batch_size, bf16=False, max_completion_length=a.length)
    path = resolve_model(a.model)
    policy = load_model(path, device, cfg.fsdp)
    policy.config.use_cache = False
    model = distribute(policy, device, cfg.fsdp, False, world_size)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    if a.phase in ("backward", "step", "save"):
        g = torch.Generator().manual_seed(rank)
        n = a.micro_batches * a.micro_batch_size
        episodes = [sampled_episode({}, torch.randint(3, 1000, (32,), generator=g).tolist(),
                                    torch.randint(3, 1000, (a.length,), generator=g).tolist()) for _ in range(n)]
        inputs, tokens = collate(episodes, 0)
        data = dict(inputs=inputs, loss_mask=tokens["mask"], advantages=torch.randn(n, generator=g), old_logp=None,
                    ref_logp=None, sampler_logp=None, keep=None)
        accumulate_gradients(model, data, cfg, world_size, nullcontext())
    if a.phase in ("step", "save"):
        optimizer_step(optimizer, scheduler, [p for p in policy.parameters() if p.requires_grad], 1.0)
    if a.phase == "save":  # also what the resume phase reads
        save_checkpoint(a.checkpoint, 1, model, optimizer, scheduler, AutoTokenizer.from_pretrained(path), vars(cfg),
                        rank == 0, 0)
    if a.phase == "resume":
        state = load_checkpoint(os.path.join(a.checkpoint, "checkpoint-1"))
        restore_training_state(state, model, optimizer, scheduler, rank, world_size)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20 - start
    os.write(1, ("RESULT " + json.dumps({"rank": rank, "growth": growth}) + "\n").encode())  # one write: ranks share stdout


def run(mode: str, phase: str, a, checkpoint: str) -> list[float]:
    from common import free_port
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), os.path.abspath(__file__), "--worker", "--mode", mode, "--phase", phase,
                          "--model", a.model, "--micro_batches", str(a.micro_batches), "--micro_batch_size",
                          str(a.micro_batch_size), "--length", str(a.length), "--checkpoint", checkpoint],
                         capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536"))
    results = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or len(results) != 2:
        raise RuntimeError(f"{mode} {phase} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return [r["growth"] for r in sorted(results, key=lambda r: r["rank"])]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--micro_batch_size", type=int, default=1)
    p.add_argument("--length", type=int, default=32, help="completion tokens (after a 32-token prompt)")
    p.add_argument("--phases", default=",".join(PHASES), help="the phases to run, of " + ",".join(PHASES)
                   + " (save covers the ones before it; resume reads what save wrote)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        from utils import run_and_exit
        run_and_exit(worker, a)  # torn down without an abort at exit (see utils.run_and_exit); does not return
    phases = [phase for phase in PHASES if phase in a.phases.split(",")]
    if not phases or set(a.phases.split(",")) - set(PHASES) or ("resume" in phases and "save" not in phases):
        p.error(f"--phases {a.phases}: a comma-separated list of {','.join(PHASES)}; resume needs save")
    from embedded import resolve_model
    from transformers import AutoConfig
    import torch
    model = resolve_model(a.model)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        size = sum(t.numel() for t in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())
    print(f"{a.model}: {size * 4 / 2 ** 30:.2f} GiB in fp32 | 2 processes | {a.micro_batches} micro-batches of "
          f"{a.micro_batch_size} x (32 + {a.length}) tokens | fp32")
    print(f"  {'phase':8s} {'DDP GiB':>8s} {'FSDP2 GiB':>9s} {'FSDP2/DDP':>9s}   (peak RSS growth, mean of the 2 ranks; "
          "rank 0 / rank 1)")
    with tempfile.TemporaryDirectory() as tmp:
        peaks = {}
        for mode in ("ddp", "fsdp"):
            folder = os.path.join(tmp, mode)
            for phase in phases:
                peaks[mode, phase] = run(mode, phase, a, folder)
        for phase in phases:
            ddp, fsdp = (sum(peaks[m, phase]) / 2 for m in ("ddp", "fsdp"))
            ranks = "   ".join(f"{m} {peaks[m, phase][0]:.2f} / {peaks[m, phase][1]:.2f}" for m in ("ddp", "fsdp"))
            print(f"  {phase:8s} {ddp:8.2f} {fsdp:9.2f} {fsdp / ddp:9.2f}   {ranks}")
