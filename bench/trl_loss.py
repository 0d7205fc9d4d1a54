"""TRL's own GRPOTrainer._compute_loss on the cases bench/loss_parity.py writes, for that script, which runs
this in TRL's virtual environment (bench/.venv-trl). The trainer object is built without its __init__ (no
model, no data): the attributes _compute_loss reads are set from each case, its forward returns the case's
log-probs and entropies (leaf tensors, so their gradients come back), and a one-process accelerator stands in
for accelerate's. The sampler importance weight TRL computes in _generate_and_score_completions (outside
_compute_loss) is restated here as TRL 1.16.0 writes it.

    bench/.venv-trl/bin/python bench/trl_loss.py CASES_FILE OUT_FILE
"""
import collections
import inspect
import math
import sys
import textwrap
from types import SimpleNamespace

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd


class OneProcess:
    """accelerate's collectives for one process: what _compute_loss calls, each the identity."""
    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def sampler_weight(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16.0's vllm_importance_sampling_ratio (grpo_trainer.py, _generate_and_score_completions)."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def float64_nanstd(tensor: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """TRL 1.16.0's nanstd (trl/trainer/utils.py) with Bessel's factor count / (count - 1) in float64: TRL's divides
    two int64 tensors, which gives float32 (4 / 3 = 1.33333337), so its stds are off by ~1e-8 relative."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True).double()
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan")))
    variance = variance * correction
    return torch.sqrt(variance if keepdim else variance.squeeze(dim) if dim is not None else variance.squeeze())


def trl_advantages(case: dict, std=nanstd) -> torch.Tensor:
    """TRL 1.16.0's own advantage code (both multi_objective_aggregation branches), cut out of
    _generate_and_score_completions by its first and last lines and run on the case's reward matrix, with TRL's
    nanstd or `std`."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    first = "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)"
    last = "advantages = torch.nan_to_num(advantages, nan=0.0)"
    start = source.index(first)
    block = source[source.rindex("\n", 0, start) + 1:source.index(last) + len(last)]
    trainer = SimpleNamespace(multi_objective_aggregation=case["aggregation"], scale_rewards=case["scale_rewards"],
                              reward_weights=case["weights"], reward_funcs=[None] * len(case["weights"]))
    scope = {"torch": torch, "nanstd": std, "self": trainer, "rewards_per_func": case["matrix"],
             "num_generations": case["G"], "device": "cpu"}
    exec(textwrap.dedent(block), scope)
    return scope["advantages"]


def trl_loss(t: dict, case: dict) -> tuple[float, torch.Tensor, torch.Tensor, dict]:
    args = GRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, **case["trl"])
    logp = t["logp"].clone().requires_grad_()
    entropy = t["entropy"].clone().requires_grad_()
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.args, trainer.accelerator = args, OneProcess()
    trainer.model = SimpleNamespace(training=True)
    trainer._metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    trainer.loss_type, trainer.beta = args.loss_type, args.beta
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.entropy_coef, trainer.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    trainer._last_world_entropy, trainer._entropy_window_stats = case.get("last_entropy", math.inf), None
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, args.vllm_importance_sampling_correction
    trainer.vllm_importance_sampling_mode = args.vllm_importance_sampling_mode
    trainer.max_completion_length, trainer.current_gradient_accumulation_steps = args.max_completion_length, 1
    trainer.aux_loss_enabled = False
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    mask = t["mask"]
    old = t["old_logp"] if case["off_policy"] else t["logp"]  # on-policy: TRL's old log-probs are the policy's
    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long), "prompt_mask": torch.ones(len(mask), 1),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask,
              "advantages": t["advantages"], "num_items_in_batch": mask.sum(),
              "old_per_token_logps": t["old_logp"] if case["off_policy"] else None,
              "sampling_per_token_logps": t["sampler_logp"]}
    if args.beta != 0.0:
        inputs["ref_per_token_logps"] = t["ref_logp"]
    if args.vllm_importance_sampling_correction:
        inputs["importance_sampling_ratio"] = sampler_weight(old, t["sampler_logp"], mask,
                                                             args.vllm_importance_sampling_mode,
                                                             args.vllm_importance_sampling_clip_min,
                                                             args.vllm_importance_sampling_clip_max)
    loss = trainer._compute_loss(None, inputs)
    d_logp, d_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
    metrics = {"kl": trainer._metrics["train"]["kl"][0]} if args.beta != 0.0 else {}
    if args.use_adaptive_entropy:  # the controller after this (one-micro-batch) optimizer step
        metrics |= {"entropy_coef": trainer.entropy_coef, "last_entropy": trainer._last_world_entropy}
    return loss.item(), d_logp, torch.zeros_like(entropy) if d_entropy is None else d_entropy, metrics


if __name__ == "__main__":
    data = torch.load(sys.argv[1])
    torch.save({"losses": [trl_loss(data["tensors"], case) for case in data["cases"]],
                "advantages": [trl_advantages(case, float64_nanstd) for case in data["advantage_cases"]],
                "advantages_as_is": [trl_advantages(case) for case in data["advantage_cases"]]}, sys.argv[2])
