"""nanogrpo's loss against TRL 1.16.0's GRPOTrainer._compute_loss, on the same float64 tensors: every loss type,
both importance-sampling levels, beta 0 and 0.04 with and without the KL bias correction, delta on and off,
every sampler importance-sampling mode and none, on- and off-policy, and the masks (off-policy sequences,
high-entropy tokens with the entropy bonus). For each case: the loss and its gradient with respect to the
log-probs and the entropies, which must agree to 1e-10. TRL runs in its own virtual environment (bench/.venv-trl,
made on first use, see vs_trl.py) through bench/trl_loss.py.

Compared on one micro-batch in one process, where TRL's normalisations and ours mean the same thing. Across
micro-batches and ranks they differ by design (README: Loss choices): ours are split-invariant (the step's token
and sequence counts over all ranks), TRL's bnpo, high-entropy threshold and entropy bonus are per micro-batch.
Settings that mean different things are listed, not compared.

    .venv/bin/python bench/loss_parity.py [--tolerance 1e-10]
"""
import argparse
import itertools
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import Config  # noqa: E402
from grpo import grpo_loss, sampler_is_weights, token_weights  # noqa: E402
from train import high_entropy_mask  # noqa: E402

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
    return out


def our_loss(t: dict, case: dict) -> tuple[float, torch.Tensor, torch.Tensor]:
    """What train.accumulate_gradients computes on one micro-batch in one process."""
    cfg = Config(**case["ours"])
    logp, entropy = t["logp"].clone().requires_grad_(), t["entropy"].clone().requires_grad_()
    mask = t["mask"]
    old = t["old_logp"] if case["off_policy"] else logp.detach()
    is_weight = None
    if cfg.vllm_importance_sampling_correction:
        is_weight, _ = sampler_is_weights(old, t["sampler_logp"], mask, cfg.vllm_importance_sampling_mode,
                                          cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    weights = token_weights(mask, cfg.loss_type, len(mask), float(mask.sum()), cfg.max_completion_length, 1)
    entropy_mask = None if cfg.top_entropy_quantile == 1 else high_entropy_mask(t["entropy"], mask,
                                                                                cfg.top_entropy_quantile)
    bonus = mask if entropy_mask is None else mask * entropy_mask
    loss, _ = grpo_loss(logp, old, t["advantages"], mask, weights, cfg, t["ref_logp"], is_weight, t["sampler_logp"],
                        entropy, entropy_mask, bonus / bonus.sum().clamp(min=1))
    d_logp, d_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
    return loss.item(), d_logp, torch.zeros_like(entropy) if d_entropy is None else d_entropy


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tolerance", type=float, default=1e-10)
    a = p.parse_args()
    t = tensors()
    todo = cases(t["mask"].shape[1])
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"tensors": t, "cases": todo}, os.path.join(tmp, "cases.pt"))
        subprocess.run([trl_python(), os.path.join(ROOT, "bench", "trl_loss.py"), os.path.join(tmp, "cases.pt"),
                        os.path.join(tmp, "trl.pt")], check=True)
        theirs = torch.load(os.path.join(tmp, "trl.pt"))
    worst, failed = {}, []
    for case, (trl_value, trl_dlogp, trl_dentropy) in zip(todo, theirs):
        value, dlogp, dentropy = our_loss(t, case)
        diff = max(abs(value - trl_value), (dlogp - trl_dlogp).abs().max().item(),
                   (dentropy - trl_dentropy).abs().max().item())
        worst[case["name"][0]] = max(worst.get(case["name"][0], 0.0), diff)
        if not diff <= a.tolerance:
            failed.append((case["name"], value, trl_value, diff))
    print(f"nanogrpo vs TRL 1.16.0 GRPOTrainer._compute_loss, float64, loss and gradient (log-probs, entropies): "
          f"{len(todo)} cases")
    for loss_type in LOSS_TYPES:
        n = sum(c["name"][0] == loss_type for c in todo)
        print(f"  {loss_type:8s} {n:4d} cases, largest difference {worst[loss_type]:.1e}")
    print("not compared as such, by design:")
    for setting, why in NOT_COMPARED.items():
        print(f"  {setting}: {why}")
    for name, value, trl_value, diff in failed[:20]:
        print(f"DIFFERENT {name}: ours {value:.12g}, TRL {trl_value:.12g}, difference {diff:.2e}")
    print(f"{len(todo) - len(failed)} of {len(todo)} cases equal to {a.tolerance:g}")
    sys.exit(1 if failed else 0)
