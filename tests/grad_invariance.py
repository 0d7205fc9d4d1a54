"""Run by tests/test_invariance.py (under torchrun or plain python): the gradient of one optimizer
step on a fixed global batch, computed by train.accumulate_gradients with this process's share,
written to a file by rank 0. Usage: grad_invariance.py JOBS_FILE, a JSON list of jobs, each
[LOSS_TYPE, MICRO_BATCH_SIZE, OUT_FILE, OPTION...]: one launch computes many gradients, each on a fresh
model built after re-seeding, so each is the gradient a launch of its own gives (a launch costs seconds of
imports; a job, a fraction of one). Rank 0 prints "job I: ..." as a job starts, so a failure shows its job.
options: checkpointing (gradient checkpointing), fsdp (FSDP2 instead of DDP), uneven (rows 4-6 are
dropped, as zero-std groups are, so rank 0 runs 2 micro-batches of 2 and rank 1 one), sgd or adamw (then the
step is taken too, by train.optimizer_step with --max_grad_norm's clipping: the file holds a dict of the
gradient, the weights before and after, and the norm it returned), and NAME=VALUE (a Config field, e.g.
epsilon_high=5 or max_grad_norm=0.01; top_entropy_quantile makes the high-entropy mask of the step as train.py
does: each rank's entropies, the quantile over all ranks)."""
import json
import os
import sys
from contextlib import nullcontext

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import Config  # noqa: E402
from logprobs import no_grad_logprobs, take  # noqa: E402
from models import distribute, full_tensor
from rollout import collate, sampled_episode  # noqa: E402
from train import accumulate_gradients, high_entropy_mask, optimizer_step  # noqa: E402
from utils import run_and_exit, setup_distributed


def main(jobs_file: str):
    rank, _, world_size, device, is_main = setup_distributed()  # one process group for every job
    with open(jobs_file) as f:
        jobs = json.load(f)
    for i, (loss_type, micro_batch_size, out, *options) in enumerate(jobs):
        if is_main:
            print(f"job {i}: {loss_type} {micro_batch_size} {' '.join(options)}", flush=True)
        grad = gradient(loss_type, int(micro_batch_size), options, rank, world_size, device)
        if is_main:
            torch.save(grad, out)


def gradient(loss_type: str, micro_batch_size: int, options: list[str], rank: int, world_size: int, device):
    """The gradient of the step (every parameter's, flattened into one tensor), on every rank; with sgd or adamw
    in `options`, a dict of it and the step taken with it."""
    checkpointing = "checkpointing" in options
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # a fixed global batch of 8 completions: prompts of 2-4 tokens, completions of 1-6 tokens
    g = torch.Generator().manual_seed(1)
    N, C = 8, 6
    prompts = [torch.randint(3, 64, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(N)]
    completions = [torch.randint(3, 64, (int(torch.randint(1, C + 1, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(N)]
    inputs, tokens = collate([sampled_episode({}, p, c) for p, c in zip(prompts, completions)], 0)
    completion_mask = tokens["mask"]
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    ref_logp = -torch.rand(N, completion_mask.shape[1], generator=g, dtype=torch.float64) * 3
    sampler_logp = -torch.rand(N, completion_mask.shape[1], generator=g, dtype=torch.float64) * 6  # IS weights in play
    share = slice(rank * N // world_size, (rank + 1) * N // world_size)
    keep = torch.tensor([True] * 4 + [False] * 3 + [True]) if "uneven" in options else None
    data = dict(inputs=take(inputs, share), loss_mask=completion_mask[share], advantages=advantages[share],
                ref_logp=ref_logp[share], old_logp=None, sampler_logp=sampler_logp[share],
                keep=None if keep is None else keep[share])
    settings = dict(o.split("=", 1) for o in options if "=" in o)
    cfg = Config(loss_type=loss_type, micro_batch_size=micro_batch_size, beta=0.04, max_completion_length=C, bf16=False,
                 **{k: type(getattr(Config(), k))(v) for k, v in settings.items()})
    model = distribute(model, device, "fsdp" in options, False, world_size)
    if cfg.top_entropy_quantile < 1:
        entropy = no_grad_logprobs(model, data["inputs"], C, cfg.temperature, micro_batch_size, nullcontext())[1]
        data["entropy_mask"] = high_entropy_mask(entropy, data["loss_mask"], cfg.top_entropy_quantile)
    accumulate_gradients(model, data, cfg, world_size, nullcontext())
    flat = lambda tensors: torch.cat([full_tensor(t).flatten() for t in tensors])  # FSDP2: gathered on every rank
    grad = flat(p.grad for p in model.parameters())
    if not {"sgd", "adamw"} & set(options):
        return grad
    before = flat(p.detach() for p in model.parameters())
    optimizer = (torch.optim.SGD(model.parameters(), lr=1.0) if "sgd" in options  # the step is the clipped gradient
                 else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    norm = optimizer_step(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                          list(model.parameters()), cfg.max_grad_norm)
    return {"grad": grad, "before": before, "after": flat(p.detach() for p in model.parameters()), "norm": norm}


if __name__ == "__main__":  # as train.py ends: no abort at exit after FSDP2 (utils.run_and_exit)
    run_and_exit(main, sys.argv[1])
