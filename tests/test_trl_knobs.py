"""TRL's later GRPO knobs against float64 loops written here: GDPO's aggregation, adaptive entropy control, the KL
as the loss weighs it, TR-DPO's reference update and the fp32 lm head. Each against TRL's own code too:
bench/loss_parity.py."""
import json
import math
import re
from contextlib import nullcontext

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from config import Config
from conftest import run_train
from grpo import EntropyBonus, LossParams, batch_advantages, group_normalized, grpo_loss, without_signal
from rewards import weighted_rewards


def tiny_llama(seed: int = 0, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                        tie_word_embeddings=tied))


def test_gdpo_normalizes_each_reward_in_its_group_then_the_weighted_sum_over_the_batch():
    """normalize_then_sum: per group and function (r - mean) / (std + 1e-4) over the scored ones, the weighted sum
    over the scored functions (NaN where none scored), then (s - batch mean) / (batch std + 1e-4); 0 if unscored."""
    g = torch.Generator().manual_seed(0)
    G, k = 4, 3
    matrix = torch.rand(12, k, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1], dtype=torch.float64)
    matrix[1, 0] = math.nan  # one function did not score one completion
    matrix[6] = math.nan  # no function scored this one
    matrix[8:12, 2] = 0.5  # a function that agrees within a group
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    normalized = [[math.nan] * k for _ in range(12)]
    for group in range(3):
        for j in range(k):
            scored = [i for i in range(group * G, group * G + G) if not math.isnan(matrix[i, j])]
            mean = sum(matrix[i, j].item() for i in scored) / len(scored)
            std = math.sqrt(sum((matrix[i, j].item() - mean) ** 2 for i in scored) / (len(scored) - 1))
            for i in scored:
                normalized[i][j] = (matrix[i, j].item() - mean) / (std + 1e-4)
    summed = [math.nan if all(math.isnan(x) for x in row) else
              sum(w * x for w, x in zip(weights.tolist(), row) if not math.isnan(x)) for row in normalized]
    scored = [s for s in summed if not math.isnan(s)]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((s - mean) ** 2 for s in scored) / (len(scored) - 1))
    expected = [0.0 if math.isnan(s) else (s - mean) / (std + 1e-4) for s in summed]

    got_summed = weighted_rewards(group_normalized(matrix, G), weights)
    got = batch_advantages(got_summed, mean, std)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    assert got[6] == 0 and not torch.isnan(got).any()
    assert abs(got_summed.nansum().item()) < 1e-9  # each function's normalized rewards sum to 0 in every group
    inf = matrix.clone()
    inf[0, 1] = math.inf  # a reward function that returned inf: loud (non-finite), not silently 0
    summed = weighted_rewards(group_normalized(inf, G), weights)
    assert not batch_advantages(summed, summed.nanmean().item(), 1.0).isfinite().all()


def test_gdpo_finds_signal_where_the_weighted_sums_agree_but_the_functions_do_not():
    """Rewards (2, 0) and (0, 1) weighted 1 and 2 both sum to 2: no signal for GRPO, but GDPO normalizes each
    function first, and their advantages differ. A group where every function agrees has none for either."""
    matrix = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert without_signal(weighted_rewards(matrix, weights), 2).tolist() == [True, True]
    assert without_signal(matrix, 2).tolist() == [False, True]
    summed = weighted_rewards(group_normalized(matrix, 2), weights)
    assert summed[0] < 0 < summed[1] and summed[2] == summed[3] == 0
    # a rank that drew nothing this round (--dynamic_sampling: the others still wanted groups)
    assert without_signal(torch.zeros(0), 2).shape == without_signal(torch.zeros(0, 2), 2).shape == (0,)


def test_adaptive_entropy_moves_the_coefficient_and_applies_it_only_at_or_below_the_target():
    cfg = Config(entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_delta=0.02, entropy_coef_min=0.0,
                 entropy_coef_max=0.04, entropy_target=0.5)
    bonus = EntropyBonus(cfg)
    applied, coefs = [], []
    for entropy in (0.7, 0.3, 0.4, 0.5, 0.9, 0.9):
        applied.append(bonus.applied())
        bonus.update(entropy)
        coefs.append(bonus.coef)
    assert applied == [0.0, 0.0, 0.02, 0.04, 0.04, 0.0]  # none before a measurement, then by the last step's entropy
    assert [round(c, 12) for c in coefs] == [0.0, 0.02, 0.04, 0.04, 0.02, 0.0]  # within [min, max]
    again = EntropyBonus(cfg, bonus.state_dict())  # a checkpoint's state
    assert (again.coef, again.last_entropy) == (bonus.coef, bonus.last_entropy)
    fixed = EntropyBonus(Config(entropy_coef=0.01))
    fixed.update(0.0)
    assert fixed.applied() == 0.01 and fixed.metrics() == {"entropy_coef": 0.01}


def test_adaptive_entropy_through_update_sees_each_steps_entropy_and_applies_it_to_the_next():
    """train.update: the first step applies no bonus (no entropy measured yet); its entropy is below the target, so
    the second applies the coefficient: its loss is the first's minus coef * the mean entropy of its tokens."""
    from metrics import StepTimer
    from rollout import collate, sampled_episode
    from train import update
    model = tiny_llama().double()
    cfg = Config(loss_type="dapo", steps_per_generation=2, max_completion_length=3, bf16=False, entropy_coef=0.3,
                 use_adaptive_entropy=True, entropy_coef_delta=0.1, entropy_target=100.0,
                 vllm_importance_sampling_correction=False, max_grad_norm=0)
    inputs, tokens = collate([sampled_episode({}, [5, 6], [7, 8, 9]) for _ in range(2)], 0)
    data = dict(inputs=inputs, loss_mask=tokens["mask"], advantages=torch.zeros(2, dtype=torch.float64), old_logp=None,
                ref_logp=None, keep=None, sampler_logp=None, entropy_mask=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    bonus = EntropyBonus(cfg)
    sums, norms, _ = update(model, optimizer, scheduler, list(model.parameters()), data, 0, cfg, 1, nullcontext(),
                            StepTimer(), bonus)
    # two identical rows, one per step: the first step's loss is 0 (advantages 0, no bonus), the second's the bonus
    mean_entropy = sums["trained_entropy"] / sums["trained_tokens"]
    assert abs(sums["loss"] - -0.4 * mean_entropy) < 1e-6  # coef 0.3 + 0.1 after the first step (fp32 entropies)
    assert abs(bonus.coef - 0.5) < 1e-12 and abs(bonus.last_entropy - mean_entropy) < 1e-12


def test_the_kl_in_the_loss_is_k3_times_the_ratio_with_the_bias_correction():
    g = torch.Generator().manual_seed(1)
    B, C = 3, 4
    logp = -torch.rand(B, C, generator=g, dtype=torch.float64)
    old, ref = logp + 0.2 * torch.randn(B, C, generator=g), logp + 0.3 * torch.randn(B, C, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    for correction in (True, False):
        cfg = Config(beta=0.04, use_bias_correction_kl=correction)
        t = dict(advantages=torch.ones(B, dtype=torch.float64), loss_mask=mask, old_logp=old, ref_logp=ref)
        _, stats = grpo_loss(logp, t, mask, LossParams.of(cfg))
        plain = in_loss = 0.0
        for b in range(B):
            for t in range(C):
                if mask[b, t]:
                    d = (ref[b, t] - logp[b, t]).item()
                    k3 = math.exp(d) - d - 1
                    plain += k3
                    in_loss += k3 * (math.exp((logp[b, t] - old[b, t]).item()) if correction else 1.0)
        assert abs(stats["kl"].item() - plain) < 1e-12 and abs(stats["kl_in_loss"].item() - in_loss) < 1e-12


def test_tr_dpo_mixes_the_policy_into_the_reference():
    from models import mix_into_reference
    policy, ref = tiny_llama(0), tiny_llama(1)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    mix_into_reference(policy, ref, 0.6)
    for (name, r), p in zip(ref.named_parameters(), policy.parameters()):
        assert torch.allclose(r, 0.6 * p + 0.4 * before[name], atol=1e-6), name
    assert all(not p.requires_grad or p.grad is None for p in ref.parameters())


def test_the_fp32_lm_head_computes_the_logits_of_the_bf16_forward_in_fp32():
    """Under bf16 autocast: with the flag, the log-probs are log_softmax of fp32 hidden @ fp32 weight (the
    forward's own hidden states, taken with a hook); without it, of the bf16 product, far from that."""
    from logprobs import completion_logprobs
    from models import hf_model
    model = tiny_llama(2, tied=False)
    ids = torch.tensor([[3, 9, 14, 15, 26, 5]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    seen = {}
    model.model.norm.register_forward_hook(lambda m, a, out: seen.update(hidden=out))
    got = {}
    for fp32 in (True, False):
        hf_model(model).fp32_lm_head = fp32
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got[fp32] = completion_logprobs(model, inputs, 3, 1.0)[0]
    hidden = seen["hidden"][:, -4:-1].float()  # the positions before the 3 completion tokens
    reference = torch.log_softmax(hidden @ model.lm_head.weight.float().T, dim=-1).gather(-1, ids[:, -3:, None])[..., 0]
    assert (got[True] - reference).abs().max() < 1e-6
    assert (got[False] - reference).abs().max() > 1e-4  # bf16 logits: what the flag changes


@pytest.mark.slow
def test_gdpo_adaptive_entropy_tr_dpo_the_kl_metric_and_eval_generations_in_a_two_step_fsdp_run(server, tmp_path):
    """Two ranks under FSDP2, two steps of two passes each (4 optimizer steps), through the real server: the ledger's
    advantages are GDPO's of its rewards over both ranks; the entropy coefficient rose 0.01 per optimizer step (the
    entropy is below the target); off-policy passes weigh the KL by the ratio; the checkpoint's reference (mixed
    shard by shard) moved toward the policy; evaluation sampled --num_generations_eval completions per prompt."""
    from safetensors.torch import load_file
    out = tmp_path / "out"
    _, metrics = run_train(server, out, "--reward_funcs", "tests.helpers:brevity,format", "--reward_weights", "1,2",
                           "--multi_objective_aggregation", "normalize_then_sum", "--use_adaptive_entropy",
                           "--entropy_coef", "0.01", "--entropy_coef_delta", "0.01", "--entropy_target", "100",
                           "--beta", "0.04", "--num_iterations", "2", "--sync_ref_model", "--ref_model_sync_steps", "1",
                           "--ref_model_mixup_alpha", "0.5", "--num_generations", "4", "--prompts_per_step", "4",
                           "--max_completion_length", "8", "--max_steps", "2", "--learning_rate", "3e-3",
                           "--bf16", "false", "--save_steps", "2", "--eval_steps", "-1", "--eval_num_prompts", "4",
                           "--num_generations_eval", "2", "--eval_pass_k", "1,2", "--fsdp")
    train = [m for m in metrics if "loss" in m]
    assert [round(m["entropy_coef"], 9) for m in train] == [0.03, 0.05]
    assert all(m["kl_in_loss"] != m["kl"] and m["kl"] > 0 for m in train[1:])  # step 1's first pass: ratio 1
    rows = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    step1 = sorted((r for r in rows if r["split"] == "train" and r["step"] == 1), key=lambda r: (r["rank"],))
    matrix = torch.tensor([list(r["rewards"].values()) for r in step1], dtype=torch.float64)  # brevity, format
    summed = weighted_rewards(group_normalized(matrix, 4), torch.tensor([1.0, 2.0], dtype=torch.float64))
    expected = batch_advantages(summed, summed.mean().item(), summed.std().item())
    assert torch.allclose(torch.tensor([r["advantage"] for r in step1], dtype=torch.float64), expected, atol=1e-5)
    evals = [r for r in rows if r["split"] == "eval"]
    assert len(evals) == 2 * 4 * 2  # before and after: 4 prompts x 2
    folder = out / "checkpoint-2"
    initial, policy = load_file(f"{server['model']}/model.safetensors"), load_file(folder / "model" / "model.safetensors")
    reference = load_file(folder / "reference" / "model" / "model.safetensors")
    for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        moved, between = (reference[name] - initial[name]).norm(), (reference[name] - policy[name]).norm()
        assert moved > 0 and between < (policy[name] - initial[name]).norm(), name


@pytest.mark.slow
def test_a_regex_constrains_every_completion_and_the_fp32_head_trains_in_bf16(server, tmp_path):
    """--vllm_structured_outputs_regex: every completion matches it; the sampler's log-probs are of the constrained
    distribution, above the policy's, so the importance weights pi_old / pi_vLLM fall below 1. With
    --cast_lm_head_to_fp32 under bf16 the two steps train."""
    out = tmp_path / "out"
    _, metrics = run_train(server, out, "--vllm_structured_outputs_regex", "(yes|no|maybe)", "--cast_lm_head_to_fp32",
                           "--bf16", "true", "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4",
                           "--prompts_per_step", "2", "--max_completion_length", "8", "--max_steps", "2",
                           "--learning_rate", "1e-3", "--no_save_model", nproc=1)
    rows = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    assert len(rows) == 16 and all(re.fullmatch("(yes|no|maybe)", r["completion"]) for r in rows), rows
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    assert all(m["is_ratio/mean"] < 0.9 for m in metrics), [m["is_ratio/mean"] for m in metrics]


def test_a_resume_takes_the_reference_the_checkpoint_kept(tmp_path):
    """--sync_ref_model saves the moved reference in the checkpoint (reference/model); build_models loads it on
    resume, and the starting model's weights where the checkpoint has none (a run without --sync_ref_model)."""
    from models import build_models
    start, policy, moved = (tiny_llama(seed) for seed in (0, 1, 2))
    start.save_pretrained(tmp_path / "start")
    policy.save_pretrained(tmp_path / "ckpt" / "model")
    cfg = Config(beta=0.04, sync_ref_model=True, bf16=False, gradient_checkpointing=False)
    name = "model.layers.0.mlp.up_proj.weight"
    weight = lambda m: dict(m.named_parameters())[name]  # noqa: E731
    for kept, expected in ((False, start), (True, moved)):
        if kept:
            moved.save_pretrained(tmp_path / "ckpt" / "reference" / "model")
        loaded, _, ref = build_models(cfg, str(tmp_path / "start"), False, str(tmp_path / "ckpt"), torch.device("cpu"), 1)
        assert torch.equal(weight(loaded), weight(policy)) and torch.equal(weight(ref), weight(expected)), kept


def test_a_constant_entropy_coefficient_is_the_flags_also_after_a_resume():
    """Only adaptive control takes its coefficient from the checkpoint; a run resumed with another --entropy_coef
    applies (and logs) the flag's."""
    bonus = EntropyBonus(Config(entropy_coef=0.02), {"coef": 0.01, "last_entropy": 0.3})
    assert bonus.applied() == 0.02 and bonus.metrics() == {"entropy_coef": 0.02}
    adaptive = EntropyBonus(Config(entropy_coef=0.02, use_adaptive_entropy=True), {"coef": 0.01, "last_entropy": 0.1})
    assert adaptive.applied() == 0.01


def test_the_fp32_head_refuses_a_lora_adapter_on_the_head_it_would_skip():
    from config import UsageError
    from logprobs import completion_logprobs
    from models import add_lora, hf_model
    model = add_lora(tiny_llama(3, tied=False), 4, 8.0, 0.0, "lm_head,q_proj")
    hf_model(model).fp32_lm_head = True
    ids = torch.tensor([[3, 9, 14, 15]])
    with pytest.raises(UsageError, match="lora_target_modules"):
        completion_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 2, 1.0)
