"""
The math of GRPO as pure functions of tensors: advantages from rewards, each token's weight in the loss, the
loss itself and its masks and importance weights. No collectives, no I/O, and the loss never reads the config:
train.py calls it with its step's tensors, the counts it summed over the ranks and the loss's numbers
(LossParams; EntropyBonus alone keeps its flags from the config);
tests/test_math.py calls them with hand-made tensors against loops over tokens, bench/loss_parity.py against
TRL's own code.

A --loss_type is one row of LOSSES: an objective (the per-token term, a function) and an aggregation (how a
step's terms become one number, token_weights). A new loss is one function and one row (docs/your_own.md: Add
a loss). README: "Loss choices" has the formulas, docs/loss_choices.md why each default is what it is.
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch


def group_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) rewards of N / G consecutive groups (NaN = not scored) -> (N/G,) each group's unbiased std over
    its scored completions (as TRL), 0 for a group with fewer than two; NaN for a group with an infinite
    reward."""
    grouped = rewards.view(-1, group_size)  # (N/G, G)
    scored = ~grouped.isnan()
    squares = (grouped - grouped.nanmean(dim=1, keepdim=True)).where(scored, 0.0).pow(2).sum(dim=1)
    return (squares / (scored.sum(dim=1) - 1).clamp(min=1)).sqrt()


def without_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N/G,) whether each group's rewards all agree (their advantages are 0): of (N,) rewards, or of every
    column of an (N, k) reward matrix (GDPO normalizes each function's rewards in the group). A group with an
    infinite reward has a NaN std: it is not one of them, so it reaches the loss, and the loss's non-finite
    check stops the run."""
    columns = (rewards if rewards.dim() == 2 else rewards.unsqueeze(1)).T  # (k, N)
    return torch.stack([group_std(column, group_size) < 1e-6 for column in columns]).all(dim=0)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", batch_std: float = 1.0,
                     eps: float = 1e-4) -> torch.Tensor:
    """(N,) rewards of N / G consecutive groups -> (N,) advantages r - group mean, divided by the group's
    std ("group", GRPO), by the std of the whole batch over all ranks ("batch", `batch_std`), or by
    nothing ("none", Dr. GRPO: no difficulty bias from low-variance groups). A completion that was not
    scored (NaN) stays out of its group's mean and std and gets advantage 0 (TRL does the same)."""
    grouped = rewards.view(-1, group_size)  # (N/G, G)
    adv = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (group_std(rewards, group_size).unsqueeze(1) + eps)
    elif scale == "batch":
        adv = adv / (batch_std + eps)
    return adv.view(-1).where(~rewards.isnan(), 0.0)


def group_normalized(matrix: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GDPO's first step (--multi_objective_aggregation normalize_then_sum): (N, k) rewards of k functions
    (NaN = not scored) -> (N, k), each function's rewards minus their group's mean, over their group's std +
    eps (a group with one scored completion: 0), so that no function's scale drowns the others before they are
    weighted and summed. NaN stays NaN (adds nothing to the weighted sum); an infinite reward stays infinite
    (loud downstream)."""
    mean = matrix.view(-1, group_size, matrix.shape[1]).nanmean(dim=1)  # (N/G, k)
    std = torch.stack([group_std(column, group_size) for column in matrix.T], dim=1)  # (N/G, k)
    normalized = (matrix - mean.repeat_interleave(group_size, dim=0)) / (std.repeat_interleave(group_size, dim=0) + eps)
    return normalized.where(~matrix.isinf(), matrix)


def batch_advantages(rewards: torch.Tensor, mean: float, std: float, eps: float = 1e-4) -> torch.Tensor:
    """GDPO's last step: (N,) summed group-normalized rewards -> (N,) advantages (r - mean) / (std + eps), the
    batch's mean and std over all ranks; 0 where not scored (NaN). An infinite reward stays non-finite (the
    loss's check stops the run), as in group_advantages."""
    return ((rewards - mean) / (std + eps)).where(~rewards.isnan(), 0.0)


class EntropyBonus:
    """The entropy bonus's coefficient, step by step: --entropy_coef; or, with --use_adaptive_entropy,
    Skywork-OR1's adaptive control as TRL has it. The coefficient starts at --entropy_coef and after every
    optimizer step moves by --entropy_coef_delta, up while the step's mean entropy of its trained tokens (over
    all ranks) is at or below --entropy_target, down while above, within [--entropy_coef_min,
    --entropy_coef_max]. A step applies it only if the step before measured an entropy at or below the target
    (none before the first). Checkpoints keep the state."""

    def __init__(self, cfg, state: dict | None = None):
        self.adaptive, self.fixed, self.target = cfg.use_adaptive_entropy, cfg.entropy_coef, cfg.entropy_target
        self.delta, self.low, self.high = cfg.entropy_coef_delta, cfg.entropy_coef_min, cfg.entropy_coef_max
        self.coef, self.last_entropy = cfg.entropy_coef, math.inf
        if state and self.adaptive:  # a constant coefficient is the flag's, also on resume
            self.coef, self.last_entropy = state["coef"], state["last_entropy"]

    def applied(self) -> float:
        """The coefficient of the next optimizer step's bonus."""
        if not self.adaptive:
            return self.fixed
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float):
        """After an optimizer step: `entropy` is the mean entropy of the tokens it trained, over all ranks."""
        if self.adaptive:
            step = self.delta if entropy <= self.target else -self.delta
            self.coef = min(max(self.coef + step, self.low), self.high)
            self.last_entropy = entropy

    def metrics(self) -> dict:
        return {"entropy_coef": self.coef} if self.adaptive or self.coef else {}

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}


# -----------------------------------------------------------------------------
# The loss of one micro-batch: sum over its tokens of weight * per-token term. A --loss_type is an objective
# (the per-token term) and an aggregation (each token's weight: how the step's terms become one number), one
# row of LOSSES.

@dataclass(frozen=True)
class LossParams:
    """The numbers the loss uses, each the flag of the same name (config.py says what each does)."""
    loss_type: str = "dapo"
    epsilon: float = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float = 0.2  # resolved: the flag's -1 ("same as epsilon") arrives as epsilon
    delta: float = 0.0
    beta: float = 0.0
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    vllm_importance_sampling_kl: bool = False
    off_policy_mask_threshold: float = -1.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0  # this optimizer step's entropy bonus coefficient (EntropyBonus.applied)
    max_completion_length: int = 256  # dr_grpo divides by it

    @classmethod
    def of(cls, cfg) -> "LossParams":
        """The run's loss parameters, from its config."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)} | {"epsilon_high": cfg.eps_high})


@dataclass(frozen=True)
class StepCounts:
    """What the aggregations divide by, each counted over all ranks."""
    sequences: float  # completions in this optimizer step
    tokens: float  # loss tokens in this optimizer step
    micro_batches: float  # micro-batches in this optimizer step (bnpo)
    # DDP and FSDP average gradients over ranks, so each rank's weights are this many times larger.
    ranks: int = 1
    round_tokens: float | None = None  # loss tokens in the whole generation round (dapo); None: this step's
    steps_per_generation: int = 1  # optimizer steps per round; in dapo they share its tokens (as TRL)


def token_weights(mask: torch.Tensor, aggregation: str, n: StepCounts, max_completion_length: int) -> torch.Tensor:
    """(B, C) weight of each completion token of a micro-batch in the loss of one optimizer step. Summing
    weight * per-token term over every micro-batch of every rank, and averaging over the ranks as DDP does,
    gives the step's loss; this is the loss's whole normalisation, ranks and micro-batches included (the
    entropy bonus is its own mean over the step's trained tokens, train.accumulate_gradients):
      grpo     (1/N) sum_i (1/|o_i|) sum_t     mean over sequences of each sequence's token mean
      bnpo     mean over micro-batches of each micro-batch's token mean (depends on the split)
      dr_grpo  1/(N * max_completion_length) sum_i sum_t   (Dr. GRPO: no length bias)
      dapo     1/(sum_i |o_i|) sum_i sum_t                 (DAPO: every token of the step alike; the round's
                                                             tokens / steps_per_generation, as TRL)
      luspo    (1/N) sum_i sum_t                           (LUSPO: each sequence by its length)"""
    mask = mask.to(torch.float64)
    if aggregation == "luspo":
        weights = mask / n.sequences
    elif aggregation == "grpo":
        weights = mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / n.sequences
    elif aggregation == "bnpo":
        weights = mask / mask.sum().clamp(min=1) / n.micro_batches
    elif aggregation == "dr_grpo":
        weights = mask / (n.sequences * max_completion_length)
    elif aggregation == "dapo":
        tokens = n.tokens if n.round_tokens is None else n.round_tokens / n.steps_per_generation
        weights = mask / max(tokens, 1.0)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    return weights * n.ranks


def clipped_objective(logp, ratio, adv, t: dict, p: LossParams):
    """PPO's clipped surrogate: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); --delta > 0 also caps the
    unclipped rho at delta (INTELLECT-2)."""
    unclipped = torch.clamp(ratio, max=p.delta) if p.delta > 0 else ratio
    per_token = -torch.min(unclipped * adv, torch.clamp(ratio, 1 - p.epsilon, 1 + p.epsilon_high) * adv)
    # The per-token term, and the tokens where the clip acts, low and high.
    return per_token, (ratio < 1 - p.epsilon) & (adv < 0), (ratio > 1 + p.epsilon_high) & (adv > 0)


def cispo_objective(logp, ratio, adv, t: dict, p: LossParams):
    """CISPO (MiniMax-M1): -sg(min(rho, eps_high)) A logp: the importance weight is clipped, not the
    update."""
    return -torch.clamp(ratio, max=p.epsilon_high).detach() * adv * logp, None, ratio > p.epsilon_high


def sapo_objective(logp, ratio, adv, t: dict, p: LossParams):
    """SAPO: -sigmoid(tau (rho - 1)) 4 / tau A, a soft gate instead of a clip, tau by the sign of A."""
    tau = torch.where(adv > 0, adv.new_tensor(p.sapo_temperature_pos), adv.new_tensor(p.sapo_temperature_neg))
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv, None, None


def vespo_objective(logp, ratio, adv, t: dict, p: LossParams):
    """VESPO: -sg(phi(w)) A logp, phi(w) = e^lam w^k e^(-lam w) of the sequence ratio w = pi / pi_vLLM (k, lam
    by the sign of A). The sampler correction is inside w, so LOSSES's row says the loss must not apply it
    again."""
    w = vespo_weights((logp - t["old_logp"]).detach(), adv, t["loss_mask"], t.get("is_weight"), p)
    return -w * adv * logp, None, None


@dataclass(frozen=True)
class Loss:
    # (logp, ratio, adv, t, p) -> the per-token term (B, C), and where it clipped low and high (each or None).
    objective: Callable
    aggregation: str  # how token_weights normalises: grpo | bnpo | dr_grpo | dapo | luspo
    own_sampler_weight: bool = False  # the objective applies the sampler correction itself (t["is_weight"])
    # The per-token term is 0 wherever the advantage is 0, so groups without signal may be skipped (the default
    # --drop_zero_std_groups auto does): an objective with a term of its own (a penalty) must say False.
    zero_without_advantage: bool = True


LOSSES = {  # --loss_type: its objective and its aggregation, as TRL pairs them
    "grpo": Loss(clipped_objective, "grpo"),
    "bnpo": Loss(clipped_objective, "bnpo"),
    "dr_grpo": Loss(clipped_objective, "dr_grpo"),
    "dapo": Loss(clipped_objective, "dapo"),
    "luspo": Loss(clipped_objective, "luspo"),  # GSPO's sequence ratio (config checks it), weighed by length
    "cispo": Loss(cispo_objective, "dapo"),
    "sapo": Loss(sapo_objective, "grpo"),
    "vespo": Loss(vespo_objective, "dapo", own_sampler_weight=True),
}


def loss_mask_of(sampled: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """(N, C) tokens that carry loss: every token the policy sampled, or, with mask_truncated (DAPO's overlong
    filtering), none of a completion cut at max_completion_length, whose reward judged an unfinished
    answer."""
    return sampled * ~truncated.unsqueeze(1) if mask_truncated else sampled


def grpo_loss(logp, t: dict, weights, p: LossParams, entropy=None, entropy_weights=None):
    """The policy loss with a k3 KL penalty and an entropy bonus: sum over tokens of weights * per-token loss
    (README: Loss choices). Returns the loss (a scalar to backpropagate) and a dict of masked sums.

    logp, weights, entropy, entropy_weights: (B, C) per completion token. `t` holds the micro-batch's other
    inputs: advantages (B,); loss_mask and, each (B, C) or None, old_logp (None: on-policy, pi_old = pi),
    ref_logp (beta > 0), sampler_logp, is_weight (the sampler correction pi_old / pi_vLLM), entropy_mask
    (--top_entropy_quantile). The ratio rho = pi / pi_old is per token, or with importance_sampling_level
    "sequence" (GSPO) one per sequence: exp of the mean of its tokens' log-ratios. The per-token term is
    LOSSES[p.loss_type]'s objective. is_weight multiplies the policy term, and the KL term only with
    vllm_importance_sampling_kl; use_bias_correction_kl multiplies the KL term by rho (DeepSeek-V3.2, TRL's
    default). Masks on the policy term only: off_policy_mask_threshold drops sequences with A < 0 whose mean
    log(pi_vLLM / pi) is above it (DeepSeek-V3.2), entropy_mask keeps the high-entropy tokens. entropy_coef
    subtracts coef * sum of entropy_weights * entropy."""
    loss_fn, mask, is_weight = LOSSES[p.loss_type], t["loss_mask"], t.get("is_weight")
    t = {**t, "old_logp": logp.detach() if t.get("old_logp") is None else t["old_logp"]}
    log_ratio = logp - t["old_logp"]  # (B, C)
    if p.importance_sampling_level == "sequence":
        m = mask.to(logp.dtype)
        log_ratio = (log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)  # (B, C), or (B, 1)
    adv = t["advantages"].unsqueeze(1)  # (B, 1)
    per_token, low, high = loss_fn.objective(logp, ratio, adv, t, p)
    kept = torch.ones_like(logp)  # tokens whose policy term counts
    if p.off_policy_mask_threshold >= 0:
        sampler_logp = t["old_logp"] if t.get("sampler_logp") is None else t["sampler_logp"]
        kept = kept * off_policy_mask(logp, sampler_logp, adv, mask, p.off_policy_mask_threshold)
    if t.get("entropy_mask") is not None:
        kept = kept * t["entropy_mask"]
    per_token = per_token * kept
    if is_weight is not None and not loss_fn.own_sampler_weight:
        per_token = per_token * is_weight
    if p.beta > 0:  # at beta 0 there is no reference, and no KL is reported (as in TRL)
        ref_logp = t["ref_logp"]
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3: unbiased, always >= 0
        kl_in_loss = kl * ratio if p.use_bias_correction_kl else kl  # TRL logs its mean as kl
        kl_term = kl_in_loss * is_weight if is_weight is not None and p.vllm_importance_sampling_kl else kl_in_loss
        per_token = per_token + p.beta * kl_term
    loss = (per_token * weights).sum()
    if p.entropy_coef != 0:
        loss = loss - p.entropy_coef * (entropy * entropy_weights).sum()
    mask = mask.to(logp.dtype)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    stats = {"clip_low": ((none if low is None else low) * mask).sum(),
             "clip_high": ((none if high is None else high) * mask).sum(),
             "clip_region": (((ratio < 1 - p.epsilon) | (ratio > 1 + p.epsilon_high)) * mask).sum(),
             "policy_masked": ((kept == 0) * mask).sum(),
             **({"kl": (kl * mask).sum(), "kl_in_loss": (kl_in_loss * mask).sum()} if p.beta > 0 else {})}
    return loss, {k: v.detach() for k, v in stats.items()}


def off_policy_mask(logp, sampler_logp, adv, mask, threshold: float) -> torch.Tensor:
    """(B, 1) DeepSeek-V3.2's off-policy sequence mask: 0 for a sequence with a negative advantage whose mean
    log(pi_vLLM / pi) over its tokens is above `threshold` (a failure the policy has moved far from, which
    it learns little from), else 1. A sampler log-prob that is not known (NaN) adds nothing to the mean."""
    m = mask.to(logp.dtype)
    kl = (sampler_logp - logp.detach()).nan_to_num(0.0)
    mean_kl = (kl * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
    return ((adv >= 0) | (mean_kl <= threshold)).to(logp.dtype)


@torch.no_grad()
def vespo_weights(token_log_ratio, adv, mask, is_weight, p: LossParams) -> torch.Tensor:
    """(B, 1) VESPO's gamma weight phi(w) = exp(lam + k log w - lam w) (1 at w = 1) of each sequence's ratio
    w = prod_t pi / pi_vLLM: the product of its tokens' pi / pi_old and of the sampler correction
    `is_weight` (pi_old / pi_vLLM, token modes), in log space, clamped to [1e-8, e^20] as TRL does."""
    m = mask.to(token_log_ratio.dtype)
    log_w = (token_log_ratio.clamp(-20, 20) * m).sum(dim=1, keepdim=True)
    # is_weight is 0 where a mask mode dropped the token (its log becomes the lower clamp), and 1 where the
    # sampler's log-prob is unknown.
    if is_weight is not None:
        log_w = log_w + (is_weight.log().clamp(math.log(1e-8), 20) * m).sum(dim=1, keepdim=True)
    log_w = log_w.clamp(math.log(1e-8), 20)
    positive = adv >= 0
    k = torch.where(positive, adv.new_tensor(p.vespo_k_pos), adv.new_tensor(p.vespo_k_neg))
    lam = torch.where(positive, adv.new_tensor(p.vespo_lambda_pos), adv.new_tensor(p.vespo_lambda_neg))
    lam = lam.clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, posinf=0.0, neginf=0.0)


def sampler_is_weights(old_logp, sampler_logp, mask, mode: str, clip_min: float, clip_max: float):
    """Importance weights pi_old / pi_sampler that correct for the sampler (vLLM) not computing
    exactly the trainer's distribution (other kernels, bf16, a stale weight). Per token, or per
    sequence (the product over its tokens); "truncate" clamps the weight to [clip_min, clip_max] (TIS), "mask"
    drops tokens or sequences whose ratio is outside it (as TRL). A sampler log-prob that is not known
    (NaN: a rollout that did not have it) counts as ratio 1, as in TRL. (B, C) inputs -> (B, C) weights
    and the raw ratios ((B, C) or (B, 1)) before truncation, for metrics."""
    log_ratio = (old_logp - sampler_logp).where((mask > 0) & ~sampler_logp.isnan(), 0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        weight = ratio.clamp(min=clip_min, max=clip_max)
    else:
        weight = ratio * ((ratio >= clip_min) & (ratio <= clip_max))
    return weight.expand_as(old_logp) * mask, ratio
