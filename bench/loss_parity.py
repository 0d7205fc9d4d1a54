"""nanogrpo's loss against TRL 1.16.0's GRPOTrainer._compute_loss, on the same float64 tensors: every loss type,
both importance-sampling levels, beta 0 and 0.04 with and without the KL bias correction, delta on and off,
every sampler importance-sampling mode and none, on- and off-policy, the masks (off-policy sequences,
high-entropy tokens with the entropy bonus) and adaptive entropy control. For each case: the loss and its gradient
with respect to the log-probs and the entropies, the kl metric, the entropy controller's state after the step,
which must agree to 1e-10. And the advantages of both multi_objective_aggregation modes (GRPO, GDPO) against
TRL's own lines of _generate_and_score_completions. TRL runs in its own virtual environment (bench/.venv-trl,
made on first use, see vs_trl.py) through bench/trl_loss.py.

Compared on one micro-batch in one process, where TRL's normalisations and ours mean the same thing. Across
micro-batches and ranks they differ by design (README: Loss choices): ours are split-invariant (the step's token
and sequence counts over all ranks), TRL's bnpo, high-entropy threshold and entropy bonus are per micro-batch.
Settings that mean different things are listed, not compared.

    .venv/bin/python bench/loss_parity.py [--tolerance 1e-10]
"""
import argparse
import dataclasses
import itertools
import math
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import Config  # noqa: E402
from grpo import (LOSSES, EntropyBonus, LossParams, StepCounts, grpo_loss, sampler_is_weights,  # noqa: E402
                  token_weights)
from rewards import weighted_rewards  # noqa: E402
from train import Scored, high_entropy_mask, step_advantages  # noqa: E402

from vs_trl import ROOT, trl_python  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
IS_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
MASKS = {"none": {}, "off-policy mask": {"off_policy_mask_threshold": 0.02},
         "high-entropy tokens + bonus": {"top_entropy_quantile": 0.4, "entropy_coef": 0.01},
         # (1 - 0.84) x (26 tokens - 1) is 4: a quantile that lands exactly on a token, which TRL's float32
         # torch.quantile keeps (22 tokens) and a float64 one leaves out (21)
         "high-entropy tokens at an exact quantile position": {"top_entropy_quantile": 0.84}}
NOT_COMPARED = {  # (setting, why): where the two trainers mean different things
    "luspo at token level": "nanogrpo refuses it (LUSPO is GSPO's sequence ratio; TRL warns and goes on)",
    "vespo at sequence level": "nanogrpo refuses it (VESPO builds its own sequence weight; TRL warns and goes on)",
    "vespo with sequence_* sampler modes": "both refuse it",
    "--vllm_importance_sampling_kl true": "TRL has no such option: it never weights the KL term by the sampler ratio",
    "sapo's default temperature 1.05": "TRL makes the temperatures float32 (torch.where of two Python numbers), "
                                       "1.0499999523 for 1.05 (3e-8 apart in the loss); compared with 1.125, which "
                                       "float32 holds exactly",
    "cast_lm_head_to_fp32, sync_ref_model, num_generations_eval, vllm_structured_outputs_regex":
        "not in the loss's formula: they change what reaches it (log-probs, the reference, the samples); "
        "tests/test_trl_knobs.py and their two-step runs check them",
    "several micro-batches or ranks": "normalised over the step here, per micro-batch in TRL (bnpo, the high-entropy "
                                      "threshold, the entropy bonus): split-invariant here by design",
}


def tensors(B: int = 6, C: int = 7) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, C)
    for b, n in enumerate((7, 3, 5, 1, 6, 4)):
        mask[b, n:] = 0
    logp = -torch.rand(B, C, generator=g, dtype=torch.float64) * 3 - 0.1
    old = logp + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3  # ratios that clip
    sampler = old + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.15  # weights that truncate or mask
    sampler[2, 1] = float("nan")  # a token whose sampler log-prob is unknown
    return {"logp": logp, "old_logp": old, "sampler_logp": sampler,
            "ref_logp": logp + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3,
            "entropy": torch.rand(B, C, generator=g, dtype=torch.float64) * 4,
            "advantages": torch.tensor([1.2, -0.7, 0.4, -1.5, 0.0, -0.3], dtype=torch.float64), "mask": mask.double()}


def cases(C: int) -> list[dict]:
    out = []
    for loss_type, level, (beta, bias), delta, mode, off_policy, masks in itertools.product(
            LOSS_TYPES, ("token", "sequence"), ((0.0, True), (0.04, True), (0.04, False)), (0.0, 1.5), IS_MODES,
            (False, True), MASKS):
        if (delta and loss_type in ("cispo", "sapo", "vespo") or loss_type == "luspo" and level == "token"
                or loss_type == "vespo" and (level == "sequence" or mode.startswith("sequence"))):
            continue  # delta means nothing there; the others are in NOT_COMPARED
        shared = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, use_bias_correction_kl=bias,
                      epsilon=0.2, epsilon_high=5.0 if loss_type == "cispo" else 0.28,
                      vllm_importance_sampling_correction=mode != "off",
                      vllm_importance_sampling_mode="token_truncate" if mode == "off" else mode,
                      vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.3,
                      max_completion_length=C, sapo_temperature_pos=1.0, sapo_temperature_neg=1.125, **MASKS[masks])
        ours = dict(shared, delta=delta)
        trl = dict(shared, delta=delta or None,
                   off_policy_mask_threshold=shared.get("off_policy_mask_threshold"))
        out.append({"name": (loss_type, level, beta, bias, delta, mode, off_policy, masks), "ours": ours, "trl": trl,
                    "off_policy": off_policy})
    # adaptive entropy control (Skywork-OR1): the bonus applies or not by the last step's entropy, and the
    # coefficient moves up or down by this step's (the entropies' mean is about 2 nats)
    for loss_type, target, applies, quantile in itertools.product(LOSS_TYPES, (1.0, 3.0), (True, False), (1.0, 0.4)):
        shared = dict(loss_type=loss_type, importance_sampling_level="sequence" if loss_type == "luspo" else "token",
                      epsilon=0.2, epsilon_high=5.0 if loss_type == "cispo" else 0.28, max_completion_length=C,
                      sapo_temperature_neg=1.125, vllm_importance_sampling_correction=False, entropy_coef=0.01,
                      use_adaptive_entropy=True, entropy_target=target, entropy_coef_delta=0.004,
                      top_entropy_quantile=quantile)
        out.append({"name": (loss_type, "adaptive entropy", target, applies, quantile), "ours": shared,
                    "trl": shared, "off_policy": True, "last_entropy": target - 0.5 if applies else target + 0.5})
    return out


def advantage_cases() -> list[dict]:
    """Reward matrices (N = 3 groups of 4, k = 3 functions, float64) for both multi_objective_aggregation modes:
    with unscored entries, a completion no function scored, a function that agrees within a group."""
    g = torch.Generator().manual_seed(1)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    matrices = [torch.rand(12, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1]) for _ in range(3)]
    matrices[1][1, 0], matrices[1][6] = float("nan"), float("nan")
    matrices[2][8:12, 2], matrices[2][0:3, 1] = 0.5, float("nan")  # agrees; scored once in its group
    out = []
    for i, matrix in enumerate(matrices):
        for aggregation, scale in (("sum_then_normalize", "group"), ("sum_then_normalize", "batch"),
                                   ("sum_then_normalize", "none"), ("normalize_then_sum", "group")):
            out.append({"name": (aggregation, scale, i), "matrix": matrix, "weights": weights, "G": 4,
                        "aggregation": aggregation, "scale_rewards": scale})
    return out


def our_advantages(case: dict) -> torch.Tensor:
    """train.step_advantages: what the loop computes from a step's reward matrix (one process)."""
    cfg = Config(multi_objective_aggregation=case["aggregation"], scale_rewards=case["scale_rewards"])
    rewards = weighted_rewards(case["matrix"], case["weights"])
    return step_advantages(Scored([], [], case["matrix"], rewards, []), (case["weights"], None), case["G"], cfg)[0]


def our_loss(t: dict, case: dict) -> tuple[float, torch.Tensor, torch.Tensor, dict]:
    """What train.accumulate_gradients computes on one micro-batch in one process (an optimizer step: the adaptive
    entropy control's update after it, as train.update), and the metrics TRL logs too."""
    cfg = Config(**case["ours"])
    bonus = EntropyBonus(cfg, {"coef": cfg.entropy_coef, "last_entropy": case.get("last_entropy", math.inf)})
    cfg = dataclasses.replace(cfg, entropy_coef=bonus.applied())
    logp, entropy = t["logp"].clone().requires_grad_(), t["entropy"].clone().requires_grad_()
    mask = t["mask"]
    old = t["old_logp"] if case["off_policy"] else logp.detach()
    is_weight = None
    if cfg.vllm_importance_sampling_correction:
        is_weight, _ = sampler_is_weights(old, t["sampler_logp"], mask, cfg.vllm_importance_sampling_mode,
                                          cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    weights = token_weights(mask, LOSSES[cfg.loss_type].aggregation, StepCounts(len(mask), float(mask.sum()), 1),
                            cfg.max_completion_length)
    entropy_mask = None if cfg.top_entropy_quantile == 1 else high_entropy_mask(t["entropy"], mask,
                                                                                cfg.top_entropy_quantile)
    trained = mask if entropy_mask is None else mask * entropy_mask  # the bonus's tokens
    inputs = dict(advantages=t["advantages"], loss_mask=mask, old_logp=old, ref_logp=t["ref_logp"], is_weight=is_weight,
                  sampler_logp=t["sampler_logp"], entropy_mask=entropy_mask)
    loss, stats = grpo_loss(logp, inputs, weights, LossParams.of(cfg), entropy, trained / trained.sum().clamp(min=1))
    d_logp, d_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
    metrics = {"kl": (stats["kl_in_loss"] / mask.sum()).item()} if cfg.beta > 0 else {}
    if bonus.adaptive:
        bonus.update(((t["entropy"] * trained).sum() / trained.sum().clamp(min=1)).item())
        metrics |= {"entropy_coef": bonus.coef, "last_entropy": bonus.last_entropy}
    return loss.item(), d_logp, torch.zeros_like(entropy) if d_entropy is None else d_entropy, metrics


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tolerance", type=float, default=1e-10)
    a = p.parse_args()
    t = tensors()
    todo, advantage_todo = cases(t["mask"].shape[1]), advantage_cases()
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"tensors": t, "cases": todo, "advantage_cases": advantage_todo}, os.path.join(tmp, "cases.pt"))
        subprocess.run([trl_python(), os.path.join(ROOT, "bench", "trl_loss.py"), os.path.join(tmp, "cases.pt"),
                        os.path.join(tmp, "trl.pt")], check=True)
        theirs = torch.load(os.path.join(tmp, "trl.pt"))
    worst, failed = {}, []

    def compare(row: str, name, value: float, trl_value: float, diff: float):
        worst[row] = max(worst.get(row, 0.0), diff)
        if not diff <= a.tolerance:
            failed.append((name, value, trl_value, diff))

    for case, (trl_value, trl_dlogp, trl_dentropy, trl_metrics) in zip(todo, theirs["losses"]):
        value, dlogp, dentropy, metrics = our_loss(t, case)
        assert metrics.keys() == trl_metrics.keys(), (case["name"], metrics, trl_metrics)
        row = "adaptive" if case["trl"].get("use_adaptive_entropy") else case["name"][0]
        compare(row, case["name"], value, trl_value, max(
            abs(value - trl_value), (dlogp - trl_dlogp).abs().max().item(), (dentropy - trl_dentropy).abs().max().item(),
            *(abs(metrics[k] - trl_metrics[k]) for k in ("entropy_coef", "last_entropy") if k in metrics)))
        if "kl" in metrics:
            compare("kl metric", case["name"] + ("kl metric",), metrics["kl"], trl_metrics["kl"],
                    abs(metrics["kl"] - trl_metrics["kl"]))
    as_is = 0.0  # against TRL's nanstd as it is, whose Bessel factor is float32
    for case, trl_adv, trl_as_is in zip(advantage_todo, theirs["advantages"], theirs["advantages_as_is"]):
        adv = our_advantages(case)
        compare("advantages", case["name"], adv.sum().item(), trl_adv.sum().item(), (adv - trl_adv).abs().max().item())
        as_is = max(as_is, (adv - trl_as_is).abs().max().item())
    counts = {row: sum(1 for c in todo if (c["name"][0] if not c["trl"].get("use_adaptive_entropy") else "adaptive")
                       == row) for row in LOSS_TYPES + ("adaptive",)}
    counts["kl metric"] = sum(c["trl"]["beta"] > 0 for c in todo if "beta" in c["trl"])
    counts["advantages"] = len(advantage_todo)
    total = len(todo) + len(advantage_todo)
    print(f"nanogrpo vs TRL 1.16.0 GRPOTrainer._compute_loss and its advantages, float64: {total} cases")
    described = {"adaptive": "adaptive entropy: loss, gradient, the coefficient and entropy after the step",
                 "kl metric": "the kl metric (with beta > 0; ours: kl_in_loss), in those above",
                 "advantages": "advantages, both multi_objective_aggregation modes (TRL's own code)"}
    for row, n in counts.items():
        print(f"  {described.get(row, row):8s} {n:4d} cases, largest difference {worst[row]:.1e}")
    print(f"    (with TRL's nanstd as it is, whose n / (n - 1) is a float32 division: {as_is:.1e}; here with that "
          "factor in float64)")
    print("not compared as such, by design:")
    for setting, why in NOT_COMPARED.items():
        print(f"  {setting}: {why}")
    for name, value, trl_value, diff in failed[:20]:
        print(f"DIFFERENT {name}: ours {value:.12g}, TRL {trl_value:.12g}, difference {diff:.2e}")
    print(f"{total - len(failed)} of {total} cases equal to {a.tolerance:g}")
    sys.exit(1 if failed else 0)
