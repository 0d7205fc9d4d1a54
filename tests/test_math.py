"""The GRPO math against naive per-element loops written here, in float64."""
import itertools
import math
import os
import re

import pytest
import torch
from transformers import LlamaForCausalLM

from config import Config
from models import lr_factor
from grpo import LOSSES, LossParams, StepCounts, group_advantages, grpo_loss, token_weights
from conftest import collated
from data import step_prompt_indices
from embedded import arithmetic_problems
from metrics import pass_at_k
from vllm_client import bucket_plan


def test_group_advantages_match_naive_loop_in_each_scaling_mode():
    torch.manual_seed(0)
    G = 4
    rewards = torch.rand(12, dtype=torch.float64)
    rewards[4:8] = 0.5  # a group with equal rewards: advantage 0, not NaN
    for scale in ("group", "batch", "none"):
        got = group_advantages(rewards, G, scale, batch_std=0.3)
        for g in range(3):
            r = rewards[g * G:(g + 1) * G].tolist()
            mean = sum(r) / G
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
            divisor = {"group": std + 1e-4, "batch": 0.3 + 1e-4, "none": 1.0}[scale]
            for i in range(G):
                assert abs(got[g * G + i].item() - (r[i] - mean) / divisor) < 1e-12
        assert torch.all(got[4:8] == 0)


def test_unscored_completions_stay_out_of_their_group_and_get_advantage_zero():
    """NaN = no function scored it: its group's mean and std are over the scored ones (a naive loop here), its
    advantage is 0. With rewards [1, 1, 1, 0-as-unscored] it used to get -1.5, and with rewards that are never
    positive an unscored completion (0) was the best of its group."""
    from rewards import weighted_rewards
    from grpo import group_std
    nan = math.nan
    matrix = torch.tensor([[1.0, nan], [1.0, 0.5], [nan, nan], [0.0, 1.0],  # partly scored rows add what they have
                           [-2.0, nan], [-1.0, nan], [nan, nan], [-3.0, nan],  # rewards never positive
                           [nan, nan], [nan, nan], [0.4, nan], [nan, nan]], dtype=torch.float64)  # one scored
    rewards = weighted_rewards(matrix, torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert rewards[:4].tolist()[:2] == [1.0, 2.0] and rewards[2].isnan() and rewards[3] == 2.0
    G = 4
    for scale in ("group", "batch", "none"):
        got = group_advantages(rewards, G, scale, batch_std=0.7)
        for g in range(3):
            r = [x for x in rewards[g * G:(g + 1) * G].tolist() if not math.isnan(x)]
            mean = sum(r) / len(r)
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / max(len(r) - 1, 1))
            divisor = {"group": std + 1e-4, "batch": 0.7 + 1e-4, "none": 1.0}[scale]
            for i in range(G):
                x = rewards[g * G + i].item()
                assert abs(got[g * G + i].item() - (0.0 if math.isnan(x) else (x - mean) / divisor)) < 1e-12
        assert got[2] == got[6] == 0 and got[8:].abs().max() == 0 and not got.isnan().any()
        assert got[4:8].argmax() != 2  # the unscored one is not the best of a group whose rewards are all negative
    assert group_std(rewards, G)[2] == 0  # one scored completion: no signal (drop_zero_std_groups drops it)
    inf = torch.tensor([1.0, math.inf, 0.0, 1.0])  # a reward bug stays visible: the loss goes NaN, not zero
    assert group_advantages(inf, 4).isnan().any()
    # ... also when every reward of a group is inf: it is not a group without signal, which would be dropped
    # (--drop_zero_std_groups) or replaced (--dynamic_sampling) without a word
    from grpo import without_signal
    all_inf = torch.tensor([math.inf] * 4 + [2.0] * 4 + [1.0, math.nan, math.nan, math.nan])
    assert without_signal(all_inf, 4).tolist() == [False, True, True] and group_std(all_inf, 4)[0].isnan()


def test_scoring_watch_warns_once_and_stops_after_steps_in_a_row_with_a_function_down(capsys):
    from config import RunStopped
    from metrics import ScoringWatch
    watch = ScoringWatch(["accuracy", "judge"], limit=3)
    scored, unscored = torch.tensor([1.0, 0.0]), torch.tensor([math.nan, math.nan])
    both = {"accuracy": 2, "judge": 2}  # the completions each was to score
    watch.update({"accuracy": 0, "judge": 2}, both, scored, 1)  # the judge failed on both completions
    watch.update({"accuracy": 0, "judge": 0}, both, scored, 2)  # back: the count starts again
    watch.update({"accuracy": 0, "judge": 2}, both, scored, 3)
    watch.update({"accuracy": 0, "judge": 0}, {"accuracy": 2, "judge": 0}, scored, 4)  # none of its task: no verdict
    watch.update({"accuracy": 0, "judge": 2}, both, scored, 5)
    assert capsys.readouterr().out.count("warning: reward function judge failed on every completion of step 1") == 1
    with pytest.raises(RunStopped, match="judge failed on every completion in 3 steps in a row \\(up to step 6\\)"):
        watch.update({"accuracy": 0, "judge": 2}, both, scored, 6)
    mixture = ScoringWatch(["accuracy", "judge"], limit=2)  # a mixture: the judge scores one of the two completions
    mixture.update({"accuracy": 0, "judge": 1}, {"accuracy": 1, "judge": 1}, scored, 1)  # and fails on it
    assert "judge failed on every completion of step 1" in capsys.readouterr().out
    with pytest.raises(RunStopped, match="judge failed on every completion in 2 steps"):
        mixture.update({"accuracy": 0, "judge": 1}, {"accuracy": 1, "judge": 1}, scored, 2)
    nothing = ScoringWatch(["accuracy"], limit=2)
    nothing.update({"accuracy": 0}, {"accuracy": 2}, unscored, 1)  # None for every completion: not a failure, but
    assert "no reward function scored any completion of step 1" in capsys.readouterr().out  # nothing learned
    with pytest.raises(RunStopped, match="no reward function scored any completion in 2 steps"):
        nothing.update({"accuracy": 0}, {"accuracy": 2}, unscored, 2)
    never = ScoringWatch(["judge"], limit=0)
    for step in range(10):
        never.update({"judge": 2}, {"judge": 2}, scored, step)  # 0 = never stop


def test_scoring_watch_warns_once_of_a_run_whose_rewards_all_agreed_from_its_start(capsys):
    from metrics import ScoringWatch
    learned = ScoringWatch(["accuracy"], limit=3)  # signal at first, then steps in which every group agrees
    for step, frac in enumerate([0.5, 1.0, 1.0, 1.0, 1.0, 1.0], start=1):  # (a run that learned the easy ones)
        learned.signal(frac, step, last=step == 6)
    assert "warning" not in capsys.readouterr().out
    never = ScoringWatch(["accuracy"], limit=3)
    for step in range(1, 8):
        never.signal(1.0, step, last=step == 7)
    assert capsys.readouterr().out.count("in the first 3 steps (up to step 3) every group's rewards agreed") == 1
    short = ScoringWatch(["accuracy"], limit=3)  # a run of 2 steps, both alike: said at its last step
    short.signal(1.0, 11, last=False)  # (a resumed run: its steps count from where it continued)
    assert "warning" not in capsys.readouterr().out
    short.signal(1.0, 12, last=True)
    assert "in the first 2 steps (up to step 12)" in capsys.readouterr().out
    late = ScoringWatch(["accuracy"], limit=3)  # signal in its first step only: no warning
    late.signal(0.9, 1, last=False)
    late.signal(1.0, 2, last=True)
    assert "warning" not in capsys.readouterr().out


def loss_of(logp, old, adv, mask, weights, cfg: Config, ref=None, is_weight=None, sampler=None, entropy=None,
            entropy_mask=None, entropy_weights=None):
    """grpo.grpo_loss on one micro-batch's tensors, given as the tests below name them."""
    t = dict(advantages=adv, loss_mask=mask, old_logp=old, ref_logp=ref, is_weight=is_weight, sampler_logp=sampler,
             entropy_mask=entropy_mask)
    return grpo_loss(logp, t, weights, LossParams.of(cfg), entropy, entropy_weights)


def spec(**options) -> Config:
    """The loss options of a test: clip range [0.8, 1.28], no KL bias correction, unless given."""
    return Config(**{"epsilon": 0.2, "epsilon_high": 0.28, "use_bias_correction_kl": False, **options})


def naive_loss(logp, old, ref, adv, mask, weights, eps_low, eps_high, delta, beta):
    total, kl_sum, low, high, region = 0.0, 0.0, 0, 0, 0
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            a = adv[b]
            unclipped = min(ratio, delta) if delta > 0 else ratio
            clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
            objective = min(unclipped * a, clipped_ratio * a)
            kl = math.exp(ref[b][t] - logp[b][t]) - (ref[b][t] - logp[b][t]) - 1 if beta > 0 else 0.0
            total += weights[b][t] * -(objective - beta * kl)
            kl_sum += kl
            low += ratio < 1 - eps_low and a < 0
            high += ratio > 1 + eps_high and a > 0
            region += ratio < 1 - eps_low or ratio > 1 + eps_high
    return total, kl_sum, low, high, region


def test_grpo_loss_matches_naive_loop_with_clipping_delta_and_kl():
    torch.manual_seed(0)
    B, C = 4, 5
    logp = (torch.randn(B, C, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.8  # ratios far from 1: clip and delta act
    ref = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    weights = torch.rand(B, C, dtype=torch.float64) * mask
    for beta in (0.0, 0.04):
        for delta in (0.0, 1.5):
            loss, stats = loss_of(logp, old, adv, mask, weights, spec(delta=delta, beta=beta), ref)
            want, kl, low, high, region = naive_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(),
                                                     mask.tolist(), weights.tolist(), 0.2, 0.28, delta, beta)
            assert abs(loss.item() - want) < 1e-6
            assert abs(stats["kl"].item() - kl) < 1e-6 if beta else "kl" not in stats  # beta 0: no reference
            assert (stats["clip_low"].item(), stats["clip_high"].item(), stats["clip_region"].item()) == (low, high, region)
            assert low > 0 and high > 0
    # delta bites: with a positive advantage and a ratio above delta, the loss differs
    assert loss_of(logp, old, adv, mask, weights, spec(delta=1.5))[0].item() != \
        loss_of(logp, old, adv, mask, weights, spec())[0].item()


def test_sequence_level_ratio_matches_naive_loop_with_its_gradient():
    """GSPO: each sequence's ratio is exp(mean over its tokens of log pi - log pi_old), clipped as one; the
    loss and the gradient of every log-prob against a loop over sequences and tokens (float64)."""
    torch.manual_seed(1)
    B, C = 4, 5
    logp = (torch.randn(B, C, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.4
    ref = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    weights = torch.rand(B, C, dtype=torch.float64) * mask

    def naive(lp, beta, delta):
        total = 0.0
        for b in range(B):
            tokens = [t for t in range(C) if mask[b][t]]
            ratio = torch.exp(sum(lp[b][t] - old[b][t] for t in tokens) / len(tokens))
            unclipped = torch.clamp(ratio, max=delta) if delta > 0 else ratio
            objective = torch.min(unclipped * adv[b], torch.clamp(ratio, 0.8, 1.28) * adv[b])
            for t in tokens:
                kl = torch.exp(ref[b][t] - lp[b][t]) - (ref[b][t] - lp[b][t]) - 1
                total = total + weights[b][t] * (-objective + beta * kl)
        return total
    for beta in (0.0, 0.04):
        for delta in (0.0, 1.1):
            loss, stats = loss_of(logp, old, adv, mask, weights,
                                    spec(delta=delta, beta=beta, importance_sampling_level="sequence"), ref)
            (grad,) = torch.autograd.grad(loss, logp)
            lp = logp.detach().clone().requires_grad_()
            want = naive(lp, beta, delta)
            (want_grad,) = torch.autograd.grad(want, lp)
            assert abs(loss.item() - want.item()) < 1e-12 and torch.allclose(grad, want_grad, atol=1e-12)
            assert grad[mask == 0].abs().max() == 0  # padding gets no gradient
    token_level = loss_of(logp, old, adv, mask, weights, spec())[0]
    sequence = spec(importance_sampling_level="sequence")
    assert abs(token_level.item() - loss_of(logp, old, adv, mask, weights, sequence)[0].item()) > 1e-6
    # a clipped sequence counts all its tokens in the clip metrics
    far = logp.detach() - 1.0  # every ratio e: above 1 + eps_high
    _, stats = loss_of(logp, far, adv, mask, weights, sequence)
    assert stats["clip_region"].item() == mask.sum().item() and stats["clip_high"].item() == 3 + 1


def test_cispo_and_sapo_match_naive_loops_with_their_gradients():
    """CISPO (MiniMax-M1): -sg(min(rho, eps_high)) A logp; SAPO: -sigmoid(tau (rho - 1)) 4 / tau A with tau by the
    sign of A; per token and per sequence, with the KL term; loss and gradient against loops in float64."""
    torch.manual_seed(2)
    B, C = 4, 5
    logp = (torch.randn(B, C, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 1.0  # some ratios above the CISPO cap
    ref = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    weights = torch.rand(B, C, dtype=torch.float64) * mask

    def naive(lp, loss_type, level, beta):
        total = 0.0
        for b in range(B):
            tokens = [t for t in range(C) if mask[b][t]]
            seq_ratio = torch.exp(sum(lp[b][t] - old[b][t] for t in tokens) / len(tokens))
            for t in tokens:
                ratio = seq_ratio if level == "sequence" else torch.exp(lp[b][t] - old[b][t])
                if loss_type == "cispo":
                    policy = -min(ratio.item(), 2.5) * adv[b] * lp[b][t]  # a number: no gradient through the weight
                else:
                    tau = 1.0 if adv[b] > 0 else 1.05
                    policy = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv[b]
                kl = torch.exp(ref[b][t] - lp[b][t]) - (ref[b][t] - lp[b][t]) - 1
                total = total + weights[b][t] * (policy + beta * kl)
        return total
    for loss_type in ("cispo", "sapo"):
        for level in ("token", "sequence"):
            for beta in (0.0, 0.04):
                options = spec(epsilon_high=2.5, beta=beta, importance_sampling_level=level, loss_type=loss_type)
                loss, stats = loss_of(logp, old, adv, mask, weights, options, ref)
                (grad,) = torch.autograd.grad(loss, logp)
                lp = logp.detach().clone().requires_grad_()
                want = naive(lp, loss_type, level, beta)
                (want_grad,) = torch.autograd.grad(want, lp)
                assert abs(loss.item() - want.item()) < 1e-12, (loss_type, level, beta)
                assert torch.allclose(grad, want_grad, atol=1e-12), (loss_type, level, beta)
    _, stats = loss_of(logp, old, adv, mask, weights, spec(epsilon_high=2.5, loss_type="cispo"))
    assert stats["clip_high"].item() == ((torch.exp(logp - old) > 2.5) * mask).sum().item() > 0  # capped weights


def test_kl_bias_correction_and_the_sampler_weight_match_a_loop_with_their_gradients():
    """The sampler correction w (pi_old / pi_vLLM) weights the policy term (as TRL); the KL term too only with
    --vllm_importance_sampling_kl. --use_bias_correction_kl multiplies the KL term by rho, which changes its
    gradient also on-policy (rho = 1 in value)."""
    torch.manual_seed(3)
    B, C = 3, 4
    logp = (torch.randn(B, C, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    ref = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.3
    w = torch.rand(B, C, dtype=torch.float64) * 2
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    weights = torch.rand(B, C, dtype=torch.float64) * mask
    for offset, correction, kl_weighted in itertools.product((0.0, 0.3), (False, True), (False, True)):
        old = logp.detach() + offset  # offset 0: on-policy
        options = spec(beta=0.1, use_bias_correction_kl=correction, vllm_importance_sampling_kl=kl_weighted)
        loss, _ = loss_of(logp, old, adv, mask, weights, options, ref, w)
        (grad,) = torch.autograd.grad(loss, logp)
        lp = logp.detach().clone().requires_grad_()
        total = 0.0
        for b, t in itertools.product(range(B), range(C)):
            if mask[b][t]:
                ratio = torch.exp(lp[b][t] - old[b][t])
                policy = -torch.min(ratio * adv[b], torch.clamp(ratio, 0.8, 1.28) * adv[b]) * w[b][t]
                kl = torch.exp(ref[b][t] - lp[b][t]) - (ref[b][t] - lp[b][t]) - 1
                kl = kl * (ratio if correction else 1) * (w[b][t] if kl_weighted else 1)
                total = total + weights[b][t] * (policy + 0.1 * kl)
        (want_grad,) = torch.autograd.grad(total, lp)
        assert abs(loss.item() - total.item()) < 1e-12 and torch.allclose(grad, want_grad, atol=1e-12)
    on_policy = [torch.autograd.grad(loss_of(logp, logp.detach(), adv, mask, weights,
                                               spec(beta=0.1, use_bias_correction_kl=c), ref)[0], logp)[0]
                 for c in (False, True)]
    assert not torch.allclose(*on_policy)  # the correction's gradient differs even where rho = 1


def test_vespo_matches_a_loop_with_its_gradient():
    """VESPO: -sg(phi(w)) A logp, phi(w) = exp(lam + k log w - lam w) of the sequence ratio w = prod pi / pi_old
    times the sampler correction (token weights, 0 where masked: clamped at 1e-8 in log space), k and lam by the
    sign of A; with and without the correction and the KL term, loss and gradient against a loop in float64."""
    torch.manual_seed(5)
    B, C = 4, 5
    logp = (torch.randn(B, C, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.2
    ref = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    weights = torch.rand(B, C, dtype=torch.float64) * mask
    is_weight = (torch.rand(B, C, dtype=torch.float64) + 0.5) * mask
    is_weight[1, 2] = 0.0  # a token the mask mode dropped
    for w, beta in itertools.product((None, is_weight), (0.0, 0.04)):
        options = spec(loss_type="vespo", beta=beta, use_bias_correction_kl=False)
        loss, _ = loss_of(logp, old, adv, mask, weights, options, ref, w)
        (grad,) = torch.autograd.grad(loss, logp)
        lp = logp.detach().clone().requires_grad_()
        total = 0.0
        for b in range(B):
            tokens = [t for t in range(C) if mask[b][t]]
            log_w = sum((lp[b][t] - old[b][t]).item() for t in tokens)
            if w is not None:
                log_w += sum(max(math.log(w[b][t]) if w[b][t] > 0 else -math.inf, math.log(1e-8)) for t in tokens)
            k, lam = (2.0, 3.0) if adv[b] >= 0 else (3.0, 2.0)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))  # a number: no gradient through it
            for t in tokens:
                kl = torch.exp(ref[b][t] - lp[b][t]) - (ref[b][t] - lp[b][t]) - 1
                total = total + weights[b][t] * (-phi * adv[b] * lp[b][t] + beta * kl)
        (want_grad,) = torch.autograd.grad(total, lp)
        assert abs(loss.item() - total.item()) < 1e-12 and torch.allclose(grad, want_grad, atol=1e-12), (w is None, beta)


def test_the_off_policy_mask_the_entropy_mask_and_the_entropy_bonus_match_a_loop():
    """--off_policy_mask_threshold drops the policy term of sequences with A < 0 whose mean log(pi_vLLM / pi)
    (unknown sampler log-probs count 0) is above it; the entropy mask keeps the policy term of its tokens; the KL
    term stays on every token (as TRL). The bonus subtracts coef * sum of its weights * entropy, with gradient."""
    torch.manual_seed(6)
    B, C = 4, 4
    logp = (torch.randn(B, C, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    entropy = (torch.rand(B, C, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.1
    ref = logp.detach() + torch.randn(B, C, dtype=torch.float64) * 0.3
    sampler = logp.detach() + torch.tensor([[0.5], [0.5], [-0.5], [0.05]], dtype=torch.float64)
    sampler[1, 1] = math.nan  # unknown: adds 0 to its sequence's sum
    adv = torch.tensor([1.0, -1.0, -0.5, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    weights = torch.rand(B, C, dtype=torch.float64) * mask
    entropy_mask = torch.rand(B, C) > 0.4
    bonus_weights = (mask * entropy_mask).double() / (mask * entropy_mask).sum()
    options = spec(beta=0.04, off_policy_mask_threshold=0.1, entropy_coef=0.01, use_bias_correction_kl=False)
    loss, stats = loss_of(logp, old, adv, mask, weights, options, ref, None, sampler, entropy, entropy_mask,
                            bonus_weights)
    grads = torch.autograd.grad(loss, (logp, entropy))
    lp, h = logp.detach().clone().requires_grad_(), entropy.detach().clone().requires_grad_()
    total, masked = 0.0, 0
    for b in range(B):
        tokens = [t for t in range(C) if mask[b][t]]
        mean_kl = sum(0.0 if math.isnan(sampler[b][t]) else (sampler[b][t] - lp[b][t]).item()
                      for t in tokens) / len(tokens)
        dropped = adv[b] < 0 and mean_kl > 0.1
        for t in tokens:
            ratio = torch.exp(lp[b][t] - old[b][t])
            keep = not dropped and bool(entropy_mask[b][t])
            masked += not keep
            policy = -torch.min(ratio * adv[b], torch.clamp(ratio, 0.8, 1.28) * adv[b]) * keep
            kl = torch.exp(ref[b][t] - lp[b][t]) - (ref[b][t] - lp[b][t]) - 1
            total = total + weights[b][t] * (policy + 0.04 * kl) - 0.01 * bonus_weights[b][t] * h[b][t]
    want = torch.autograd.grad(total, (lp, h))
    assert abs(loss.item() - total.item()) < 1e-12 and stats["policy_masked"].item() == masked
    assert all(torch.allclose(g, w, atol=1e-12) for g, w in zip(grads, want))
    # the off-policy mask dropped sequences 1 (mean KL (0.5 * 3) / 4 > 0.1) and not 2 (KL < 0) nor 3 (0.05)
    assert 4 <= masked < int(mask.sum())


def test_high_entropy_mask_keeps_the_top_quantile_of_the_tokens_of_the_step():
    """The (1 - rho)-quantile of the entropies of the masked tokens, interpolated as torch.quantile; tokens at or
    above it are kept, padding never."""
    from train import high_entropy_mask
    torch.manual_seed(7)
    entropy, mask = torch.rand(6, 9), torch.rand(6, 9) > 0.3
    for rho in (0.2, 0.5, 1.0):
        threshold = torch.quantile(entropy[mask], 1 - rho)
        got = high_entropy_mask(entropy, mask, rho)
        assert torch.equal(got, (entropy >= threshold) & mask), rho
        assert abs(got.sum().item() - rho * mask.sum().item()) <= 1
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()
    # where (1 - rho)(n - 1) is whole (rho 0.7, 21 tokens: 6), TRL's float32 torch.quantile lands on the 7th smallest
    # and keeps it: 15 tokens (float64 lands a hair past it and keeps 14)
    entropy, mask = torch.rand(3, 7), torch.ones(3, 7, dtype=torch.bool)
    assert high_entropy_mask(entropy, mask, 0.7).sum() == 15
    assert high_entropy_mask(entropy.double(), mask, 0.7).sum() == 15
    for n in range(1, 40):  # against torch.quantile itself, float32, at every position
        values = torch.rand(n)
        for rho in (0.04, 0.28, 0.3, 0.7, 0.72, 0.96):
            assert torch.equal(high_entropy_mask(values[None], torch.ones(1, n), rho)[0],
                               values >= torch.quantile(values, 1 - rho)), (n, rho)


def test_dynamic_sampling_keeps_groups_with_signal_and_draws_until_it_has_enough():
    """Groups (G = 2) whose rewards all agree make way for the groups of extra rounds, in the order drawn, until
    there are as many with signal as the batch had; after max_rounds the rest is filled with groups without."""
    from train import Scored, keep_groups_with_signal

    def batch(rewards, first_row):  # episode names say where they are from
        n = len(rewards)
        return Scored([f"e{first_row + i // 2}.{i % 2}" for i in range(n)], [f"t{first_row + i // 2}" for i in range(n)],
                      torch.tensor(rewards).unsqueeze(1), torch.tensor(rewards), list(range(first_row, first_row + n // 2)))
    first = batch([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 0)  # rows 0 (no signal), 1 (signal), 2 (no signal)
    more = {1: batch([1.0, 0.0, 1.0, 1.0, 0.5, 0.5], 10), 2: batch([0.25, 0.5, 3.0, 3.0, 0.0, 0.0], 20)}
    calls = []

    def draw(k, wanted):
        calls.append((k, wanted))
        return more[k]
    kept, metrics = keep_groups_with_signal(first, draw, 2, max_rounds=3)
    assert calls == [(1, True), (2, True)] and kept.rows == [1, 10, 20]
    assert kept.episodes == ["e1.0", "e1.1", "e10.0", "e10.1", "e20.0", "e20.1"] and kept.rewards.tolist() == [0, 1, 1, 0, .25, .5]
    assert metrics == {"dynamic_sampling/rounds": 2, "dynamic_sampling/groups_drawn": 9,
                       "dynamic_sampling/groups_without_signal": 0}
    calls.clear()
    kept, metrics = keep_groups_with_signal(first, draw, 2, max_rounds=1)  # short: filled with groups without
    assert calls == [(1, True)] and kept.rows == [1, 10, 0] and metrics["dynamic_sampling/groups_without_signal"] == 1
    kept, metrics = keep_groups_with_signal(more[2], draw, 2, max_rounds=0)
    assert kept.rows == [20, 21, 22] and metrics["dynamic_sampling/rounds"] == 0
    full = batch([1.0, 0.0, 0.0, 1.0], 30)
    calls.clear()
    assert keep_groups_with_signal(full, draw, 2, max_rounds=3)[0].rows == [30, 31] and calls == []


def naive_weights(mask, loss_type, micro_batches, max_len):
    """Each token's weight in the step's loss, from the definitions, with the step's sequences split
    into `micro_batches` (lists of row indices)."""
    rows = [i for mb in micro_batches for i in mb]
    n = len(rows)
    tokens = sum(sum(mask[i]) for i in rows)
    w = {}
    for mb in micro_batches:
        mb_tokens = sum(sum(mask[i]) for i in mb)
        for i in mb:
            for t in range(len(mask[i])):
                if mask[i][t]:
                    w[i, t] = {"grpo": 1 / (sum(mask[i]) * n), "bnpo": 1 / (mb_tokens * len(micro_batches)),
                               "dr_grpo": 1 / (n * max_len), "dapo": 1 / tokens, "luspo": 1 / n,
                               "cispo": 1 / tokens, "vespo": 1 / tokens, "sapo": 1 / (sum(mask[i]) * n)}[loss_type]
    return w


def test_token_weights_match_the_definitions_for_each_loss_type():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    splits = [[0, 1], [2, 3]]
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"):
        want = naive_weights(mask.tolist(), loss_type, splits, 6)
        for mb in splits:
            got = token_weights(mask[mb], LOSSES[loss_type].aggregation,
                                StepCounts(sequences=4, tokens=float(mask.sum()), micro_batches=2), 6)
            for r, i in enumerate(mb):
                for t in range(4):
                    assert abs(got[r, t].item() - want.get((i, t), 0.0)) < 1e-12, (loss_type, i, t)
        if loss_type != "bnpo":  # the weights of a whole step sum to 1 per sequence-or-token average
            assert abs(sum(want.values()) - {"grpo": 1, "dr_grpo": 10 / 24, "dapo": 1, "luspo": 10 / 4, "cispo": 1,
                                             "sapo": 1, "vespo": 1}[loss_type]) < 1e-12


def test_on_policy_loss_gradient_is_advantage_weighted_logprob_gradient():
    # with old = logp.detach() the ratio is 1 and d(loss)/d(logp) = -A * weight on every unmasked token
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = loss_of(logp, logp.detach(), adv, mask, mask / 3, spec(epsilon_high=0.2))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]], dtype=torch.float64))


def test_collate_aligns_completions_in_one_column():
    from rollout import Episode, collate
    episodes = [Episode({}, [5, 6, 7], [1, 2], [True, False], [-0.5, 0.0], "stop"),
                Episode({}, [8], [3, 4, 9], [True] * 3, [-1.0, -2.0, -3.0], "length")]
    inputs, tokens = collate(episodes, pad_id=0)
    ids, attn, cmask = inputs["input_ids"], inputs["attention_mask"], tokens["mask"]
    assert ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert cmask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert tokens["sampled"].tolist() == [[1, 0, 0], [1, 1, 1]]  # a forced token is a completion token, not sampled
    assert tokens["sampler_logp"].tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]]


def test_step_prompt_indices_cover_each_epoch_once_and_are_reproducible():
    n, per_step = 10, 5
    first_epoch = step_prompt_indices(0, n, per_step, 3) + step_prompt_indices(1, n, per_step, 3)
    assert sorted(first_epoch) == list(range(n))
    assert step_prompt_indices(1, n, per_step, 3) == step_prompt_indices(1, n, per_step, 3)
    assert step_prompt_indices(2, n, per_step, 3) != step_prompt_indices(0, n, per_step, 3)  # a new permutation


def test_bucket_plan_packs_in_order_and_keeps_big_tensors_alone():
    assert bucket_plan([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert [i for b in bucket_plan([3] * 7, 10) for i in b] == list(range(7))


def test_lr_schedules():
    cfg = Config(max_steps=10, warmup_steps=2, lr_scheduler_type="linear")
    assert [lr_factor(s, cfg) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert abs(lr_factor(6, cfg) - 0.5) < 1e-12
    cfg.lr_scheduler_type = "cosine"
    assert abs(lr_factor(6, cfg) - 0.5) < 1e-12 and lr_factor(2, cfg) == 1.0
    assert abs(lr_factor(4, cfg) - 0.5 * (1 + math.cos(math.pi / 4))) < 1e-12  # 0.854, where linear is 0.75
    # a step of the run is num_iterations x steps_per_generation optimizer steps: the decay spans all 20 of
    # them, as transformers' schedules with 20 training steps (after the warmup, where theirs starts at 0)
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup
    for kind, theirs in (("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)):
        cfg = Config(max_steps=5, num_iterations=2, steps_per_generation=2, warmup_steps=2, lr_scheduler_type=kind)
        reference = theirs(torch.optim.SGD([torch.zeros(1)], lr=1.0), 2, 20).lr_lambdas[0]
        assert all(abs(lr_factor(s, cfg) - reference(s)) < 1e-12 for s in range(2, 21)), kind
        assert lr_factor(19, cfg) > 0 and abs(lr_factor(20, cfg)) < 1e-12  # the last update still learns


def naive_is_weights(old, sampler, mask, mode, clip_min, clip_max):
    B, C = len(old), len(old[0])
    w = [[0.0] * C for _ in range(B)]
    for b in range(B):
        seq_ratio = math.exp(sum(old[b][t] - sampler[b][t] for t in range(C) if mask[b][t]))
        for t in range(C):
            if not mask[b][t]:
                continue
            ratio = seq_ratio if mode.startswith("sequence") else math.exp(old[b][t] - sampler[b][t])
            if mode.endswith("truncate"):
                w[b][t] = min(max(ratio, clip_min), clip_max)
            else:
                w[b][t] = ratio if clip_min <= ratio <= clip_max else 0.0
    return w


def test_sampler_is_weights_match_naive_loop_in_each_mode():
    from grpo import sampler_is_weights
    torch.manual_seed(0)
    old = -torch.rand(3, 4, dtype=torch.float64) * 2
    sampler = old + torch.randn(3, 4, dtype=torch.float64) * 0.6
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        for bounds in ((0.0, 1.5), (0.7, 1.5), (0.7, math.inf)):
            got, ratio = sampler_is_weights(old, sampler, mask, mode, *bounds)
            want = naive_is_weights(old.tolist(), sampler.tolist(), mask.tolist(), mode, *bounds)
            assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12), (mode, bounds)
            assert ratio.shape == ((3, 1) if mode.startswith("sequence") else (3, 4))
    # a sampler log-prob that is not known (NaN) weighs its token as if the sampler were the policy (ratio 1)
    unknown = sampler.clone()
    unknown[1, 2] = unknown[0, 0] = math.nan
    for mode in ("token_truncate", "token_mask"):
        got, _ = sampler_is_weights(old, unknown, mask, mode, 0.0, 1.5)
        known = sampler_is_weights(old, sampler, mask, mode, 0.0, 1.5)[0]
        assert got[1, 2] == got[0, 0] == 1 and not got.isnan().any()
        assert torch.equal(got[2], known[2]) and got[0, 1] == known[0, 1]
    got, ratio = sampler_is_weights(old, unknown, mask, "sequence_truncate", 0.0, 1e9)
    assert abs(ratio[0, 0].item() - math.exp((old[0, 1] - sampler[0, 1]).item())) < 1e-12  # the known tokens only
    # the modes and bounds really differ on this data: something is truncated, dropped, raised to the minimum
    assert (sampler_is_weights(old, sampler, mask, "token_mask", 0.0, 1.5)[0] == 0)[mask > 0].any()
    assert (sampler_is_weights(old, sampler, mask, "token_truncate", 0.0, 1.5)[0] == 1.5).any()
    assert (sampler_is_weights(old, sampler, mask, "token_truncate", 0.7, 1.5)[0] == 0.7).any()


def test_dropping_zero_std_groups_keeps_the_gradient_exact_without_kl():
    from contextlib import nullcontext
    from transformers import LlamaConfig, LlamaForCausalLM
    from config import Config
    from train import accumulate_gradients
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    inputs, cmask = collated([[5, 6], [7], [8, 9], [10]], [[1, 2, 3], [4], [11, 12], [13, 14, 15]])
    adv = torch.tensor([0.0, 0.0, 1.0, -1.0], dtype=torch.float64)  # the first group has no signal
    grads = []
    for keep in (None, torch.tensor([False, False, True, True])):
        model.zero_grad()
        data = dict(inputs=inputs, loss_mask=cmask, advantages=adv, old_logp=None, ref_logp=None, sampler_logp=None,
                    keep=keep)
        sums, _ = accumulate_gradients(model, data, Config(micro_batch_size=1, bf16=False), 1, nullcontext())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert sums["tokens"] == (9 if keep is None else 5)  # the dropped rows were not run
    assert grads[0].abs().max() > 1e-4 and (grads[0] - grads[1]).abs().max() < 1e-12
    # every group without signal: nothing runs, and the step's metrics still come out (not a KeyError): the loss
    # is 0, what is measured per trained token is nan (not measured), not a made-up 0
    from metrics import training_metrics
    data["keep"] = torch.zeros(4, dtype=torch.bool)
    sums, _ = accumulate_gradients(model, data, Config(micro_batch_size=1, bf16=False), 1, nullcontext())
    metrics = training_metrics(sums, [torch.tensor(0.0)], cmask.sum(dim=1).float(), torch.zeros(4), torch.zeros(4, 3),
                               torch.zeros(4, 3))
    assert sums == {} and metrics["loss"] == 0 and metrics["completion_length"] == 9 / 4
    assert all(math.isnan(metrics[k]) for k in ("kl", "entropy", "clip_ratio/low", "sampler_logprob_diff_mean"))
    # a run without a reference (beta 0) reports no KL at all
    assert "kl" not in training_metrics(sums, [torch.tensor(0.0)], cmask.sum(dim=1).float(), torch.zeros(4),
                                        torch.zeros(4, 3), torch.zeros(4, 3), kl=False)


def test_truncated_completions_carry_no_loss_when_masked():
    from grpo import loss_mask_of
    cmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    truncated = torch.tensor([True, False, False])
    got = loss_mask_of(cmask, truncated, True)
    for i in range(3):
        for t in range(3):
            assert got[i, t] == (0 if truncated[i] else cmask[i, t])
    assert torch.equal(loss_mask_of(cmask, truncated, False), cmask)
    # and the dapo normalisation then counts only the tokens that carry loss
    w = token_weights(got, "dapo", StepCounts(3, float(got.sum()), 1), 3)
    assert abs(w.sum().item() - 1) < 1e-12 and w[0].sum() == 0


def tiny_model(kind: str):
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16)
    if kind == "llama":  # logits = lm_head(hidden), tied to the embeddings
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)).double()
    if kind == "scaled":  # logits scaled after the head, under no config name: found by the numeric check
        return ScaledLlama(LlamaConfig(**shape)).double()
    # soft-capped logits (30 tanh(z / 30)): the lm_head cannot be swapped, the model's own logits are used
    return Gemma2ForCausalLM(Gemma2Config(**shape, final_logit_softcapping=3.0)).double()


class ScaledLlama(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


@pytest.mark.parametrize("kind", ["llama", "gemma2", "scaled"])
def test_completion_logprobs_and_their_gradient_match_a_naive_loop(kind):
    """The one log-prob implementation, with grad (training) and without (pi_old, reference, probe) in
    several chunk sizes, against log-softmax written out token by token over the model's own logits, and
    its gradient against autograd through those logits."""
    from logprobs import completion_logprobs, has_plain_lm_head
    model = tiny_model(kind)
    assert has_plain_lm_head(model) == (kind == "llama")
    inputs, cmask = collated([[5, 6, 7], [8]], [[1, 2, 3, 4, 9], [3, 4]])
    ids, attn = inputs["input_ids"], inputs["attention_mask"]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits  # (2, 9, V)
    P, T = ids.shape[1] - 5, 0.7
    expected_logp, expected_entropy = torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            z = [x / T for x in logits[b, P - 1 + t].tolist()]  # the logits before completion token t
            lse = math.log(sum(math.exp(x) for x in z))
            expected_logp[b, t] = z[ids[b, P + t]] - lse
            expected_entropy[b, t] = -sum(math.exp(x - lse) * (x - lse) for x in z)
    w = torch.randn(2, 5, dtype=torch.float64) * cmask
    z = logits[:, P - 1:-1] / T
    naive = torch.log_softmax(z, dim=-1).gather(-1, ids[:, P:, None]).squeeze(-1)
    expected_grad = torch.autograd.grad((naive * w).sum(), list(model.parameters()))
    logp, entropy = completion_logprobs(model, inputs, 5, T)
    grad = torch.autograd.grad((logp * w).sum(), list(model.parameters()))
    assert logp.requires_grad and not entropy.requires_grad  # the entropy is a metric, without gradient
    assert (logp - expected_logp).abs().max() < 1e-10 and (entropy - expected_entropy).abs().max() < 1e-10
    assert max((g - e).abs().max().item() for g, e in zip(grad, expected_grad)) < 1e-10
    assert max(e.abs().max().item() for e in expected_grad) > 1e-3
    with torch.no_grad():
        for chunk in (1, 2, 5, 8, None):
            logp, entropy = completion_logprobs(model, inputs, 5, T, chunk)
            assert (logp - expected_logp).abs().max() < 1e-10 and (entropy - expected_entropy).abs().max() < 1e-10
    assert model.get_output_embeddings() is model.lm_head and isinstance(model.lm_head, torch.nn.Linear)  # restored


def test_disable_dropout_makes_the_training_forward_deterministic():
    """LoRA's dropout (and the model's) in the training forward made pi_old, the importance weights and the
    sync metrics noisy; --disable_dropout (the default) turns every dropout off, LoRA's included."""
    from logprobs import completion_logprobs
    from models import add_lora, disable_dropout
    model = tiny_model("llama")
    model.config.attention_dropout = 0.3
    model = add_lora(model, 4, 8.0, 0.5, "all-linear")
    for module in model.modules():  # LoRA's B starts at 0; a nonzero B lets its dropout show
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight)
    inputs, _ = collated([[5, 6, 7], [8]], [[1, 2, 3, 4, 9], [3, 4]])
    model.train()
    with torch.no_grad():
        noisy = [completion_logprobs(model, inputs, 5, 1.0)[0] for _ in range(2)]
        assert (noisy[0] - noisy[1]).abs().max() > 1e-3
        disable_dropout(model)
        quiet = [completion_logprobs(model, inputs, 5, 1.0)[0] for _ in range(2)]
        model.eval()
        assert torch.equal(quiet[0], quiet[1]) and torch.equal(quiet[0], completion_logprobs(model, inputs, 5, 1.0)[0])


def test_pass_at_k_is_the_chance_that_k_draws_include_a_correct_one():
    """The closed form against its definition: the share of all k-subsets of the n samples that hold a correct one."""
    for n in range(1, 9):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)


def test_embedded_task_holds_out_a_test_split():
    train, test = arithmetic_problems(5000, seed=0), arithmetic_problems(0, seed=0, split="test")
    assert len(test) == len({r["prompt"] for r in test}) and abs(len(test) - 400 / 8) <= 3  # ~1 pair in 8, each once
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in train}) + len(test) == 20 * 20  # every other pair shows up in training
    easy = sum(max(map(int, r["prompt"][8:].split("?")[0].split(" + "))) < 10 for r in train)
    assert 0.45 < easy / len(train) < 0.55  # half easy (both numbers below 10), half harder


def test_trimmed_length_sorted_micro_batches_give_the_full_width_logprobs():
    """no_grad_logprobs runs micro-batches of similar lengths without their padding columns; each
    completion's log-probs must be those of the whole collated batch."""
    from contextlib import nullcontext
    from transformers import LlamaConfig, LlamaForCausalLM
    from logprobs import completion_logprobs, no_grad_logprobs, take, trim_padding
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    prompts = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14], [15]]
    completions = [[1], [2, 3, 4, 16, 17, 18], [19, 20], [21, 22, 23], [24, 25, 26, 27]]
    inputs, cmask = collated(prompts, completions)
    with torch.no_grad():
        full = completion_logprobs(model, inputs, 6, 0.7)[0].float() * cmask
    for size in (1, 2, 3, 5):
        assert ((no_grad_logprobs(model, inputs, 6, 0.7, size, nullcontext())[0] - full) * cmask).abs().max() < 1e-6, size
    # the widths kept: rows 0 and 4 need 4 prompt columns (row 0's) and 4 completion columns (row 4's)
    t, c = trim_padding(take(inputs, [0, 4]), 6)
    assert c == 4 and t["input_ids"].shape == (2, 8)
    assert torch.equal(t["attention_mask"].sum(dim=1), inputs["attention_mask"][[0, 4]].sum(dim=1))
    t, c = trim_padding(take(inputs, [1, 2]), 6)
    assert c == 6 and t["input_ids"].shape == (2, 8)  # prompts of 1 and 2 tokens: 2 of the 4 prompt columns


def test_sampled_logprobs_and_their_gradient_match_the_plain_log_softmax():
    """The chunked autograd function against log_softmax + gather and autograd through them, in fp64,
    with a temperature, chunks that do not divide the length, and a non-contiguous (sliced) input."""
    from logprobs import SampledLogprobs
    torch.manual_seed(0)
    logits = torch.randn(3, 8, 50, dtype=torch.float64, requires_grad=True)
    targets, w = torch.randint(0, 50, (3, 7)), torch.randn(3, 7, dtype=torch.float64)
    z = logits[:, :-1] / 0.7
    plain = torch.log_softmax(z, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (expected,) = torch.autograd.grad((plain * w).sum(), logits)
    for rows, own in ((1, False), (3, False), (16, False), (3, True)):
        fresh = logits[:, :-1] * 1  # own_logits: new logits nothing else keeps, as the head's output
        logp, entropy = SampledLogprobs.apply(fresh if own else logits[:, :-1], targets, 0.7, rows, False, own)
        (grad,) = torch.autograd.grad((logp * w).sum(), logits)
        assert logp.dtype == torch.float64 and not entropy.requires_grad
        assert (logp - plain).abs().max() < 1e-12 and (grad - expected).abs().max() < 1e-12, rows
        p = torch.softmax(z, dim=-1)
        assert (entropy - -(p * p.log()).sum(-1)).abs().max() < 1e-12
        assert torch.equal(fresh, grad[:, :-1]) == own  # own logits: the gradient was written over them
    assert torch.autograd.gradcheck(lambda x: SampledLogprobs.apply(x, targets[:1, :3], 1.3, 2)[0], logits[:1, :3].detach().clone().requires_grad_())


def test_the_entropy_bonus_gradient_matches_autograd_through_the_plain_entropy():
    """With entropy_grad the entropy carries its gradient: against -(p log p).sum() with autograd, in fp64,
    for a loss on both outputs (the policy term and the bonus), chunked and not."""
    from logprobs import SampledLogprobs
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 40, dtype=torch.float64, requires_grad=True)
    targets, w, u = torch.randint(0, 40, (2, 6)), torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    logq = torch.log_softmax(logits / 1.3, dim=-1)
    plain_h = -(logq.exp() * logq).sum(-1)
    (expected,) = torch.autograd.grad((logq.gather(-1, targets[..., None]).squeeze(-1) * w + plain_h * u).sum(), logits)
    for rows, own in ((1, False), (4, False), (16, False), (4, True)):
        logp, entropy = SampledLogprobs.apply(logits * 1 if own else logits, targets, 1.3, rows, True, own)
        assert entropy.requires_grad and (entropy - plain_h).abs().max() < 1e-12
        (grad,) = torch.autograd.grad((logp * w + entropy * u).sum(), logits)
        assert (grad - expected).abs().max() < 1e-12, rows
    assert torch.autograd.gradcheck(lambda x: SampledLogprobs.apply(x, targets[:1, :3], 0.7, 2, True)[1],
                                    logits[:1, :3].detach().clone().requires_grad_())


def test_dapo_divides_each_step_by_the_rounds_tokens_over_its_steps_as_trl():
    """--steps_per_generation S with dapo: each optimizer step divides its token sum by the generation batch's tokens
    / S (TRL's num_items_in_batch), so every token of the batch weighs the same whichever step it lands in. TRL's
    example: completions of 3, 2, 1 and 0 tokens, S = 2, on-policy: rows 0 and 1 (A = 1, -1) give -(3 - 2) / 3.
    Through train.update: completions of 3, 2, 1, 1 tokens (no split into two steps of 2 rows has equal counts),
    advantages 1, 1, -1, 1: the two steps' losses add up to -(3 + 2 - 1 + 1) / (7 / 2) whatever the split."""
    from contextlib import nullcontext
    from transformers import LlamaConfig, LlamaForCausalLM
    from config import Config
    from metrics import StepTimer
    from rollout import collate, sampled_episode
    from grpo import EntropyBonus
    from train import accumulate_gradients, update
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    cfg = Config(loss_type="dapo", steps_per_generation=2, max_completion_length=3, bf16=False,
                 vllm_importance_sampling_correction=False, max_grad_norm=0)

    def batch(lengths, advantages):
        inputs, tokens = collate([sampled_episode({}, [5, 6], list(range(7, 7 + n))) for n in lengths], 0)
        return dict(inputs=inputs, loss_mask=tokens["mask"], advantages=torch.tensor(advantages, dtype=torch.float64),
                    old_logp=None, ref_logp=None, keep=None, sampler_logp=None, entropy_mask=None)

    sums, _ = accumulate_gradients(model, batch([3, 2], [1.0, -1.0]), cfg, 1, nullcontext(), round_tokens=6)
    assert abs(sums["loss"] - -1 / 3) < 1e-12
    model.zero_grad()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: both steps on-policy
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for step in range(3):  # other seeds, other splits
        sums, norms, _ = update(model, optimizer, scheduler, list(model.parameters()), batch([3, 2, 1, 1], [1.0, 1.0, -1.0, 1.0]),
                                step, cfg, 1, nullcontext(), StepTimer(), EntropyBonus(cfg))
        assert len(norms) == 2 and abs(sums["loss"] - -5 / 3.5) < 1e-12, sums["loss"]


def test_the_worked_example_of_adding_a_loss_runs_as_written(monkeypatch):
    """docs/your_own.md "Add a loss": its objective and row, run as written in grpo.py's namespace, register a new
    --loss_type, and its own test (the doc's second block) passes against its naive loop."""
    import grpo
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "your_own.md")).read()
    section = doc.split("## Add a loss", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the section has the loss and its test"
    monkeypatch.setitem(grpo.LOSSES, "gpg", None)  # (the row is taken out again after the test)
    exec(blocks[0], dict(vars(grpo)))
    assert grpo.LOSSES["gpg"].aggregation == "dapo"
    namespace = {}
    exec(blocks[1], namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests
    for test in tests:
        test()
    # Through the trainer: one optimizer step of --loss_type gpg on a tiny model, micro-batches of one completion,
    # against the same loop on the model's own log-probs (the token mean spans the micro-batches).
    from contextlib import nullcontext
    from transformers import LlamaConfig
    from logprobs import completion_logprobs
    from train import accumulate_gradients
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
    inputs, cmask = collated([[5, 6], [7], [8, 9]], [[1, 2, 3], [4], [11, 12]])
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    cfg = Config(loss_type="gpg", micro_batch_size=1, bf16=False)
    data = dict(inputs=inputs, loss_mask=cmask, advantages=adv, old_logp=None, ref_logp=None, sampler_logp=None,
                keep=None)
    sums, _ = accumulate_gradients(model, data, cfg, 1, nullcontext())
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp = completion_logprobs(model, inputs, cmask.shape[1], cfg.temperature)[0]
    naive = sum(-adv[i] * logp[i, t] for i in range(3) for t in range(cmask.shape[1]) if cmask[i, t]) / cmask.sum()
    naive.backward()
    assert abs(sums["loss"] - naive.item()) < 1e-12  # (PPO's surrogate has the same gradient on-policy, not value)
    assert max((g - p.grad).abs().max().item() for g, p in zip(got, model.parameters())) < 1e-12
    assert max(g.abs().max().item() for g in got) > 1e-4


def test_the_loss_takes_every_per_token_and_per_completion_tensor_of_the_step_and_refuses_other_shapes():
    """A loss's new input is one key of the step's data (train.step_data): (N, C) is cut to the micro-batch's
    rows and columns, (N,) to its rows; a tensor of another shape would be cut wrongly, so it is refused."""
    from train import loss_inputs
    mask = torch.ones(4, 5)
    data = dict(inputs={"input_ids": torch.zeros(4, 9)}, loss_mask=mask, advantages=torch.arange(4.0), keep=None,
                my_token_input=torch.arange(20.0).view(4, 5), my_row_input=torch.arange(4.0) * 10, old_logp=None)
    got = loss_inputs(data, torch.tensor([3, 1]), 2, "cpu")
    assert set(got) == {"loss_mask", "advantages", "my_token_input", "my_row_input"}
    assert got["my_token_input"].tolist() == [[15.0, 16.0], [5.0, 6.0]] and got["my_row_input"].tolist() == [30, 10]
    with pytest.raises(ValueError, match=r"data\['per_row_features'\] has shape \(4, 3\)"):
        loss_inputs(data | {"per_row_features": torch.zeros(4, 3)}, torch.tensor([0]), 2, "cpu")
