"""
nanogrpo: GRPO (DeepSeekMath, arXiv:2402.03300) in one file. A vLLM server samples G completions per
prompt; this script scores them, normalizes the rewards within each group, takes a clipped
policy-gradient step with an optional KL penalty, and pushes the new weights into the server.

Launch (start the server first, see README):
    python train.py                                         # 1 process, the embedded defaults
    torchrun --nproc_per_node 2 train.py --bf16 false      # N processes on one machine
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --nproc_per_node 8 train.py ...   # N nodes

What this implements, and the defaults we chose:
  - advantages: A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4), the same for every token
    of completion i. A group is the G completions of one prompt and lives on one rank.
  - loss: the clipped surrogate of PPO per token,
        min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A),   rho = pi / pi_old,
    minus beta * KL(pi || pi_ref) with Schulman's k3 estimator exp(ref - logp) - (ref - logp) - 1.
  - aggregation: the sum over every completion token of the step, divided by the number of those
    tokens over all ranks (DAPO's token-level mean, TRL's default). Long and short completions
    weigh per token, and the gradient does not depend on how the batch is split into micro-batches
    or ranks.
  - one optimizer step per generation round, so the update is on-policy: pi_old is the policy
    that sampled, and its log-probs are the detached log-probs of the training forward itself
    (rho = 1 in value, the clip inactive; no extra forward pass). The server's own log-probs of the
    sampled tokens are compared with them every step (`sampler_logprob_diff`): a sync check.
  - beta = 0 by default (as in TRL, DAPO and Dr. GRPO): no reference model is loaded.
"""
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from config import Config, parse_config
from rewards import RewardScorer
from utils import (MetricsLogger, all_reduce, sum_over_ranks, collate, completion_logprobs, encode_prompt, full_weights, load_model,
                   barrier, load_rows, print0, resolve_model, save_model, setup_distributed, step_prompt_indices,
                   teardown_distributed)
from vllm_server import VLLMClient


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", batch_std: float = 1.0,
                     eps: float = 1e-4) -> torch.Tensor:
    """(N,) rewards of N / G consecutive groups -> (N,) advantages r - group mean, divided by the group's
    std ("group", GRPO), by the std of the whole batch over all ranks ("batch", `batch_std`), or by
    nothing ("none", Dr. GRPO: no difficulty bias from low-variance groups)."""
    grouped = rewards.view(-1, group_size)  # (N/G, G)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)  # unbiased std, as in TRL
    elif scale == "batch":
        adv = adv / (batch_std + eps)
    return adv.view(-1)


def token_weights(mask: torch.Tensor, loss_type: str, num_seqs: float, num_tokens: float, max_completion_length: int,
                  num_micro_batches: int) -> torch.Tensor:
    """(B, C) weight of each completion token in the loss of one optimizer step. `num_seqs` and
    `num_tokens` count the sequences and tokens of the step over all ranks, `num_micro_batches` the
    micro-batches over all ranks; summing weight * per-token loss over every micro-batch of every
    rank gives the step's loss:
      grpo     (1/N) sum_i (1/|o_i|) sum_t     mean over sequences of each sequence's token mean
      bnpo     mean over micro-batches of each micro-batch's token mean (depends on the split)
      dr_grpo  1/(N * max_completion_length) sum_i sum_t   (Dr. GRPO: no length bias)
      dapo     1/(sum_i |o_i|) sum_i sum_t                 (DAPO: every token of the step alike)"""
    mask = mask.to(torch.float64)
    if loss_type == "grpo":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / num_seqs
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1) / num_micro_batches
    if loss_type == "dr_grpo":
        return mask / (num_seqs * max_completion_length)
    if loss_type == "dapo":
        return mask / max(num_tokens, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def grpo_loss(logp, old_logp, advantages, mask, weights, epsilon_low: float, epsilon_high: float, delta: float = 0.0,
              beta: float = 0.0, ref_logp=None):
    """Clipped surrogate with a k3 KL penalty: sum over tokens of weights * per-token loss.

    logp, old_logp, ref_logp, mask, weights: (B, C) per completion token; advantages: (B,).
    delta > 0 also caps the ratio of the unclipped term at delta (two-sided clipping, INTELLECT-2).
    Returns the loss (a scalar to backpropagate) and a dict of masked sums for metrics.
    """
    ratio = torch.exp(logp - old_logp)  # (B, C)
    adv = advantages.unsqueeze(1)  # (B, 1)
    unclipped = torch.clamp(ratio, max=delta) if delta > 0 else ratio
    per_token = -torch.min(unclipped * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    kl = torch.zeros_like(logp)
    if beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3: unbiased, always >= 0
        per_token = per_token + beta * kl
    mask = mask.to(logp.dtype)
    low, high = (ratio < 1 - epsilon_low) & (adv < 0), (ratio > 1 + epsilon_high) & (adv > 0)
    stats = {"kl": (kl * mask).sum(), "clip_low": (low * mask).sum(), "clip_high": (high * mask).sum(),
             "clip_region": (((ratio < 1 - epsilon_low) | (ratio > 1 + epsilon_high)) * mask).sum()}
    return (per_token * weights).sum(), {k: v.detach() for k, v in stats.items()}


def accumulate_gradients(model, data: dict, cfg: Config, world_size: int, autocast) -> dict:
    """Backpropagate the loss of one optimizer step on this rank's share `data` (tensors over its
    completions: input_ids, attention_mask, loss_mask, advantages, ref_logp or None), micro-batch by
    micro-batch. Token weights count the step over all ranks, so the gradient after DDP's averaging
    is the same however the step is split over micro-batches and ranks (except bnpo, by definition).
    Returns sums of per-token statistics over this rank's tokens, and the on-policy log-probs."""
    device = next(model.parameters()).device
    mask, n = data["loss_mask"], len(data["loss_mask"])
    micro = [slice(i, i + cfg.micro_batch_size) for i in range(0, n, cfg.micro_batch_size)]
    counts = sum_over_ranks({"seqs": n, "tokens": mask.sum(), "micro": len(micro)})
    C = mask.shape[1]
    sums, logps = {}, []
    for j, s in enumerate(micro):
        sync = j == len(micro) - 1 or world_size == 1  # DDP all-reduces gradients on the last micro-batch only
        with (nullcontext() if sync else model.no_sync()), autocast:
            logp = completion_logprobs(model, data["input_ids"][s].to(device), data["attention_mask"][s].to(device), C,
                                       cfg.temperature)  # (b, C)
            old_logp = logp.detach()  # on-policy: pi_old is the policy that sampled (see docstring)
            weights = token_weights(mask[s], cfg.loss_type, counts["seqs"], counts["tokens"], cfg.max_completion_length,
                                    counts["micro"]).to(device) * world_size  # DDP averages gradients over ranks
            ref = None if data["ref_logp"] is None else data["ref_logp"][s].to(device)
            loss, stats = grpo_loss(logp, old_logp, data["advantages"][s].to(device), mask[s].to(device), weights,
                                    cfg.epsilon, cfg.eps_high, cfg.delta, cfg.beta, ref)
            loss.backward()
        for k, v in {**stats, "loss": loss.detach() / world_size}.items():
            sums[k] = sums.get(k, 0.0) + v.item()
        logps.append(old_logp.float().cpu())
    return sums, torch.cat(logps)


def lr_factor(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[cfg.lr_scheduler_type]


def main(cfg: Config):
    # -------------------------------------------------------------------------- setup
    rank, local_rank, world_size, device, is_main = setup_distributed()
    cfg.validate(world_size)
    torch.manual_seed(cfg.seed + rank)
    G = cfg.num_generations
    prompts_per_rank = cfg.prompts_per_step // world_size

    from transformers import AutoTokenizer
    model_path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = load_rows(cfg.dataset, cfg.dataset_split, cfg.prompt_column, cfg.answer_column, cfg.num_arithmetic_problems, cfg.seed)
    prompt_ids = [encode_prompt(tokenizer, r["question"], cfg.system_prompt) for r in rows]  # chat template applied
    longest = max(map(len, prompt_ids))
    if longest > cfg.max_prompt_length:
        raise ValueError(f"the longest prompt has {longest} tokens > --max_prompt_length {cfg.max_prompt_length}: raise "
                         "it (and the server's --max-model-len) or drop the long prompts from the dataset")
    scorer = RewardScorer(cfg.reward_names())
    reward_weights = torch.tensor(cfg.reward_weight_list())  # (k,)

    policy = load_model(model_path, device)
    policy.config.use_cache = False
    model = DDP(policy) if world_size > 1 else policy
    ref_model = None
    if cfg.beta > 0:  # frozen reference for the KL penalty
        ref_model = load_model(model_path, device).eval().requires_grad_(False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else nullcontext()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))

    client = VLLMClient(cfg.vllm_server_host, cfg.vllm_server_port)
    client.wait_for_health(cfg.vllm_server_timeout)
    server_dtype, max_model_len = client.server_dtype_and_max_len()
    if is_main:  # rank 0 owns the weight-transfer group and pushes; DDP keeps every rank's copy equal
        client.init_weight_transfer(cfg.vllm_group_host, cfg.vllm_group_port)
        client.push_weights(full_weights(model, server_dtype), cfg.weight_sync_bucket_mb)  # server = our step-0 policy
    barrier()  # no rank samples while weights are being pushed
    if max_model_len < cfg.max_prompt_length + cfg.max_completion_length:
        raise ValueError(f"the server's max model length {max_model_len} < --max_prompt_length {cfg.max_prompt_length} "
                         f"+ --max_completion_length {cfg.max_completion_length}: lower them or start the server "
                         "with a larger --max-model-len")
    logger = MetricsLogger(cfg.output_dir, is_main, cfg.report_to, vars(cfg), cfg.wandb_project, cfg.run_name)
    print0(f"nanogrpo | model {cfg.model} | {world_size} process(es) on {device.type} | {cfg.prompts_per_step} prompts x "
           f"G={G} = {cfg.prompts_per_step * G} completions per step ({prompts_per_rank * G} per rank) | "
           f"rewards {cfg.reward_names()} x {reward_weights.tolist()} | beta {cfg.beta} | bf16 {cfg.bf16}")

    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        # ---------------------------------------------------------------------- sample
        indices = step_prompt_indices(step, len(rows), cfg.prompts_per_step, cfg.seed)
        mine = indices[rank * prompts_per_rank:(rank + 1) * prompts_per_rank]
        batch, prompts = [rows[i] for i in mine], [prompt_ids[i] for i in mine]
        samples = client.generate(prompts, n=G, max_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                  top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                                  repetition_penalty=cfg.repetition_penalty)  # prompt-major: prompt i has [i*G, (i+1)*G)
        prompt_of = [prompts[i // G] for i in range(len(samples))]
        completions = [s["token_ids"] for s in samples]
        t_gen = time.perf_counter()

        # ---------------------------------------------------------------------- score
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        answers = [batch[i // G]["answer"] for i in range(len(samples))]
        reward_matrix = torch.tensor(scorer(texts, answers)).T  # (N, k), NaN = not scored
        rewards = (reward_matrix.nan_to_num(0.0) * reward_weights).sum(dim=1)  # (N,)
        t_score = time.perf_counter()

        # ---------------------------------------------------------------------- advantages
        r = sum_over_ranks({"n": len(rewards), "sum": rewards.sum(), "sq": (rewards ** 2).sum()})
        batch_std = math.sqrt(max(r["sq"] - r["sum"] ** 2 / r["n"], 0.0) / max(r["n"] - 1, 1))  # over all ranks
        advantages = group_advantages(rewards, G, cfg.scale_rewards, batch_std)  # (N,)

        # ---------------------------------------------------------------------- ref log-probs
        input_ids, attention_mask, completion_mask = collate(prompt_of, completions, tokenizer.pad_token_id)
        truncated = torch.tensor([s["finish_reason"] == "length" for s in samples])  # (N,)
        loss_mask = completion_mask * ~truncated.unsqueeze(1) if cfg.mask_truncated_completions else completion_mask
        C = completion_mask.shape[1]
        ref_logp = None
        if ref_model is not None:
            with torch.no_grad(), autocast:
                ref_logp = torch.cat([completion_logprobs(ref_model, input_ids[i:i + cfg.micro_batch_size].to(device),
                                                          attention_mask[i:i + cfg.micro_batch_size].to(device), C,
                                                          cfg.temperature).cpu()
                                      for i in range(0, len(samples), cfg.micro_batch_size)])  # (N, C)
        t_ref = time.perf_counter()

        # ---------------------------------------------------------------------- loss and step
        model.train()
        sums, logp = accumulate_gradients(model, dict(input_ids=input_ids, attention_mask=attention_mask,
                                                      loss_mask=loss_mask, advantages=advantages, ref_logp=ref_logp),
                                          cfg, world_size, autocast)
        sampler_logp = torch.tensor([x["logprobs"] + [0.0] * (C - len(x["logprobs"])) for x in samples])  # (N, C)
        diff = (logp - sampler_logp).abs() * completion_mask  # the server's log-probs vs ours, same weights
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        t_train = time.perf_counter()

        # ---------------------------------------------------------------------- sync weights
        if is_main:
            client.push_weights(full_weights(model, server_dtype), cfg.weight_sync_bucket_mb)
        barrier()  # no rank samples again before the server has the new weights
        t_sync = time.perf_counter()

        # ---------------------------------------------------------------------- log
        lengths = completion_mask.sum(dim=1).float()
        t = sum_over_ranks({"n": len(samples), "reward": rewards.sum(), "reward_sq": (rewards ** 2).sum(),
                            **{f"rewards/{name}": reward_matrix[:, i].nansum() for i, name in enumerate(cfg.reward_names())},
                            "reward_nan": reward_matrix.isnan().sum(), "groups": len(batch),
                            "zero_std_groups": (rewards.view(-1, G).std(dim=1) < 1e-6).sum(),
                            "length": completion_mask.sum(), "truncated": truncated.sum(), "tokens": completion_mask.sum(),
                            "loss_tokens": loss_mask.sum(), "diff": diff.sum(), **sums})
        N, T, L = t["n"], t["tokens"], t["loss_tokens"]
        metrics = {"step": step + 1, "reward": t["reward"] / N,
                   "reward_std": math.sqrt(max(t["reward_sq"] / N - (t["reward"] / N) ** 2, 0.0)),
                   **{f"rewards/{name}": t[f"rewards/{name}"] / N for name in cfg.reward_names()},
                   "reward_nan_frac": t["reward_nan"] / (N * len(reward_weights)), "scorer_failures": scorer.failures,
                   "frac_zero_std_groups": t["zero_std_groups"] / t["groups"],
                   "completion_length": t["length"] / N, "truncated_frac": t["truncated"] / N,
                   "completion_length_min": -all_reduce(-lengths.min(), dist.ReduceOp.MAX).item(),
                   "completion_length_max": all_reduce(lengths.max(), dist.ReduceOp.MAX).item(),
                   "kl": t["kl"] / max(L, 1), "clip_ratio/low": t["clip_low"] / max(L, 1),
                   "clip_ratio/high": t["clip_high"] / max(L, 1), "clip_ratio/region": t["clip_region"] / max(L, 1),
                   "loss": t["loss"], "grad_norm": grad_norm.item(), "sampler_logprob_diff_mean": t["diff"] / T,
                   "sampler_logprob_diff_max": all_reduce(diff.max(), dist.ReduceOp.MAX).item(),
                   "lr": scheduler.get_last_lr()[0],
                   "time/generate": t_gen - t0, "time/score": t_score - t_gen, "time/ref": t_ref - t_score,
                   "time/train": t_train - t_ref, "time/sync": t_sync - t_train, "time/step": t_sync - t0}
        logger.log(metrics)
        print0(f"step {step + 1}/{cfg.max_steps} | reward {metrics['reward']:.3f} ±{metrics['reward_std']:.3f} | "
               + " ".join(f"{name} {metrics[f'rewards/{name}']:.2f}" for name in cfg.reward_names())
               + f" | kl {metrics['kl']:.4f} | len {metrics['completion_length']:.0f} | "
               f"gen {t_gen - t0:.1f}s train {t_train - t_ref:.1f}s sync {t_sync - t_train:.1f}s")

    # -------------------------------------------------------------------------- save
    if is_main and cfg.save_model:
        save_model(model, tokenizer, os.path.join(cfg.output_dir, "model"))
        print0(f"saved {os.path.join(cfg.output_dir, 'model')}")
    logger.close()
    scorer.close()


if __name__ == "__main__":
    cfg = parse_config()
    try:
        main(cfg)
    finally:
        teardown_distributed()
