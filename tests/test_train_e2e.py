"""train.py under torchrun (2 processes, gloo) against the real server, on the tiny model."""
import glob
import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_train
from metrics import pass_at_k

pytestmark = pytest.mark.slow
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")


def test_two_process_run_learns_keeps_server_in_sync_and_saves(server, tmp_path):
    steps = 20
    proc, metrics = run_train(
        server, tmp_path / "out", "--dataset", GSM8K, "--reward_funcs", "tests.helpers:brevity",
        "--num_generations", "4", "--prompts_per_step", "8", "--max_completion_length", "16", "--max_steps", str(steps),
        "--learning_rate", "5e-3", "--beta", "0.04", "--bf16", "false", "--micro_batch_size", "3", "--temperature", "1.0")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert sum(f"step {s}/{steps}" in proc.stdout for s in range(1, steps + 1)) == steps  # one console line per step
    # after every sync the server's log-probs of what it sampled equal the trainer's (fp32 on both sides)
    assert max(m["sampler_logprob_diff_max"] for m in metrics) < 1e-4, [m["sampler_logprob_diff_max"] for m in metrics]
    assert max(m["sync_probe_diff_max"] for m in metrics) < 1e-4  # and so does the fixed probe, after every push
    # the reward this tiny model can learn goes up
    first, last = sum(m["reward"] for m in metrics[:5]) / 5, sum(m["reward"] for m in metrics[-5:]) / 5
    assert last > first + 0.1, [round(m["reward"], 3) for m in metrics]
    assert metrics[-1]["kl"] > 0  # the reference model is in the loss
    # weights changed, and the saved folder is a model transformers loads
    saved = load_file(tmp_path / "out" / "model" / "model.safetensors")
    initial = load_file(os.path.join(server["model"], "model.safetensors"))
    assert any(not torch.equal(saved[k], initial[k]) for k in initial)
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")


NO_CORRECTION = ["--vllm_importance_sampling_correction", "false"]  # the sampler is not the policy: no weight of 1


@pytest.mark.parametrize("loss_type, extra", [
    ("grpo", ["--scale_rewards", "batch", "--gradient_checkpointing"]),
    ("bnpo", ["--mask_truncated_completions", "--drop_zero_std_groups", "--micro_batch_size", "2"]),
    ("dr_grpo", ["--scale_rewards", "none", "--delta", "4", "--top_k", "5000", "--min_p", "0.0001", *NO_CORRECTION]),
    ("dapo", ["--epsilon_high", "0.28"]),
    ("cispo", ["--epsilon_high", "5", "--off_policy_mask_threshold", "0", "--repetition_penalty", "1.1"]),
    ("sapo", ["--importance_sampling_level", "sequence", "--entropy_coef", "0.01"]),
    ("luspo", ["--importance_sampling_level", "sequence", "--vllm_importance_sampling_mode", "sequence_mask"]),
    ("vespo", ["--vllm_importance_sampling_mode", "token_mask", "--top_entropy_quantile", "0.5"]),
])
def test_each_loss_type_trains_through_the_server(server, tmp_path, loss_type, extra):
    proc, metrics = run_train(server, tmp_path / "out", "--loss_type", loss_type, *extra, "--reward_funcs",
                              "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "2",
                              "--max_completion_length", "8", "--max_steps", "2", "--learning_rate", "1e-3",
                              "--bf16", "false", "--no_save_model", nproc=1)
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    assert any(m["grad_norm"] > 0 for m in metrics)
    diff = max(m["sampler_logprob_diff_max"] for m in metrics)
    if any(flag in extra for flag in ("--top_k", "--min_p", "--repetition_penalty")):
        assert diff > 1e-3  # the sampler's distribution is no longer the policy's, and the metric shows it
    else:
        assert diff < 1e-4
    if "--top_entropy_quantile" in extra:  # a pass before training finds the step's high-entropy half
        assert all(m["old_logprob_pass"] == 1 and 0.3 < m["policy_masked_frac"] < 0.7 for m in metrics)
    else:
        assert all(m["old_logprob_pass"] == 0 and m["policy_masked_frac"] < 1 for m in metrics)
    # the flags reached the loss: step 1's, from the ledger's rewards and lengths, in closed form
    rows = [r for r in map(json.loads, open(tmp_path / "out" / "rollouts.jsonl")) if r["step"] == 1]
    closed, dapo = step_1_loss(loss_type, extra, rows, metrics[0]["entropy"])
    if closed is None:  # cispo, vespo: -A log pi per token, whose log-probs the ledger does not hold
        assert abs(metrics[0]["loss"] - dapo) > 1e-3, (metrics[0]["loss"], dapo)
        return
    # completions of one length would make most forms 0 alike (a group's advantages sum to 0); and each form must
    # differ from the default's (dapo), and dapo's from 0: a flag ignored would show
    assert len({r["completion_tokens"] for r in rows}) > 1
    assert abs(dapo) > 1e-3 and (loss_type == "dapo" or abs(closed - dapo) > 1e-3), (closed, dapo)
    assert abs(metrics[0]["loss"] - closed) < 1e-4, (metrics[0]["loss"], closed, dapo)


def step_1_loss(loss_type: str, flags: list[str], rows: list[dict], entropy: float) -> tuple[float | None, float]:
    """Step 1's loss as the flags define it, written out from the ledger (8 rows in the order the step sampled them,
    one process; bnpo's micro-batches are --micro_batch_size rows of the groups it keeps, in the order of the step's
    shuffle: train.update's torch.randperm seeded by --seed (42) + 1000 x step 0 + iteration 0).
    On-policy every ratio is 1 (and the sampler's correction 1, or off), so a token's policy term is -A (sapo:
    -sigmoid(0) 4 / tau A = -2 A / tau), and the loss types differ only in how they normalise the sum. Checks the
    ledger's advantages against --scale_rewards on the way. Returns the loss (None where it needs log-probs) and
    the default loss type's (dapo)."""
    groups = {}  # (in the order of their first rows: a step's groups are consecutive)
    for r in rows:
        groups.setdefault(r["prompt_index"], []).append(r)
    scale = flags[flags.index("--scale_rewards") + 1] if "--scale_rewards" in flags else "group"
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    terms, lengths, kept, N = [], [], [], len(rows)
    for group in groups.values():
        rs = torch.tensor([r["reward"] for r in group], dtype=torch.float64)
        std = {"group": rs.std().item(), "batch": rewards.std().item(), "none": 0.0}[scale]
        for r, reward in zip(group, rs):
            advantage = (reward - rs.mean()).item() / (std + 1e-4 if scale != "none" else 1.0)
            assert abs(advantage - r["advantage"]) < 1e-5, (advantage, r["advantage"], scale)
            masked = "--mask_truncated_completions" in flags and r["finish_reason"] == "length"
            tau = 1.0 if advantage > 0 else 1.05  # sapo's temperatures (the defaults)
            terms.append(-2 * advantage / tau if loss_type == "sapo" else -advantage)
            lengths.append(0 if masked else r["completion_tokens"])
            kept.append(not ("--drop_zero_std_groups" in flags and rs.std().item() < 1e-6))
    total = sum(t * n for t, n in zip(terms, lengths))
    size = int(flags[flags.index("--micro_batch_size") + 1]) if "--micro_batch_size" in flags else 16
    shuffled = torch.randperm(N, generator=torch.Generator().manual_seed(42)).tolist()  # as train.update draws it
    run = [(terms[i], lengths[i]) for i in shuffled if kept[i]]  # bnpo: each micro-batch's token mean, averaged
    micro = [run[i:i + size] for i in range(0, len(run), size)]
    bnpo = sum(sum(t * n for t, n in m) / max(sum(n for _, n in m), 1) for m in micro) / len(micro)
    closed = {"grpo": sum(t for t, n in zip(terms, lengths) if n) / N, "sapo": sum(t for t, n in zip(terms, lengths) if n) / N,
              "bnpo": bnpo, "dr_grpo": total / (N * 8), "dapo": total / sum(lengths), "luspo": total / N}.get(loss_type)
    if "--entropy_coef" in flags:
        closed -= float(flags[flags.index("--entropy_coef") + 1]) * entropy
    return closed, total / sum(lengths)


def test_dynamic_sampling_fills_the_batch_with_groups_whose_rewards_differ(server, tmp_path):
    """Prompts of an even length get reward 0 (tests.helpers:brevity_on_some_prompts): their groups have no signal
    and make way for groups of extra rounds, on two ranks that each fill their share (seeded: the same rows and
    rounds every run)."""
    proc, metrics = run_train(server, tmp_path / "out", "--dynamic_sampling", "--dynamic_sampling_max_rounds", "4",
                              "--reward_funcs", "tests.helpers:brevity_on_some_prompts", "--num_generations", "4",
                              "--prompts_per_step", "4", "--max_completion_length", "8", "--max_steps", "3",
                              "--learning_rate", "1e-3", "--bf16", "false", "--no_save_model")
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert sum(m["dynamic_sampling/rounds"] for m in metrics) > 0  # some step had to draw more
    for m in metrics:
        step = [r for r in records if r["step"] == m["step"]]
        assert len(step) == 16  # 4 groups of 4, as without dynamic sampling
        groups = {}
        for r in step:
            groups.setdefault((r["rank"], r["prompt_index"]), []).append(r["reward"])
        without = sum(len(set(g)) == 1 for g in groups.values())
        assert len(groups) == 4 and without == m["dynamic_sampling/groups_without_signal"]
        assert m["dynamic_sampling/groups_drawn"] >= 4 + 2 * (m["dynamic_sampling/rounds"] > 0)
        assert without == 0 or m["dynamic_sampling/rounds"] == 4
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)


def test_dropping_groups_without_signal_by_default_changes_no_update_also_for_a_rank_left_without_rows(server,
                                                                                                        tmp_path):
    """--drop_zero_std_groups auto (the default, beta 0) skips the groups whose rewards agree: under FSDP2 on two
    ranks, where some step leaves a rank no group with signal (it joins the other's micro-batches with weight 0),
    the updates are those of the run that computes every group. A run in which no group ever has signal trains no
    token: its per-token metrics are nan, not 0."""
    run = ["--fsdp", "--reward_funcs", "tests.helpers:brevity_on_some_prompts", "--num_generations", "4",
           "--prompts_per_step", "4", "--max_completion_length", "8", "--max_steps", "4", "--learning_rate", "1e-3",
           "--bf16", "false", "--no_save_model", "--dataset", GSM8K]
    auto_proc, dropped = run_train(server, tmp_path / "auto", *run)
    _, every = run_train(server, tmp_path / "all", *run, "--drop_zero_std_groups", "false")
    records = [json.loads(line) for line in open(tmp_path / "auto" / "rollouts.jsonl")]
    groups = {}
    for r in records:
        groups.setdefault((r["step"], r["rank"]), {}).setdefault(r["prompt_index"], set()).add(r["reward"])
    idle = {step for (step, rank), g in groups.items() if all(len(v) == 1 for v in g.values())}
    assert idle and idle != {1, 2, 3, 4}, groups  # a rank had nothing to train in some steps, not in all
    for a, b in zip(dropped, every):
        for key in ("reward", "loss", "grad_norm", "completion_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    assert all(m["grad_norm"] > 0 for m in dropped)
    # the tiny model never boxes a number: every group's rewards are 0
    none_proc, none = run_train(server, tmp_path / "none", *run, "--reward_funcs", "format", "--max_steps", "2")
    assert all(m["frac_zero_std_groups"] == 1 and m["grad_norm"] == 0 and m["loss"] == 0 for m in none)
    assert all(m["entropy"] is None and m["sampler_logprob_diff_mean"] is None for m in none)  # nan: null in JSON
    assert "every group's rewards agreed" in none_proc.stdout  # said, once
    # beta 0: no reference, so no KL is reported (not a KL of 0), on the console or in the metrics
    assert all("kl" not in m for m in dropped + none) and "| kl " not in auto_proc.stdout
    assert none_proc.stdout.count("warning: in the first") == 1 and "warning: in the first" not in auto_proc.stdout


def test_off_policy_updates_freeze_old_logprobs_and_clip(server, tmp_path):
    # two passes over each batch, one update each, at a large learning rate: the second pass sees ratios away
    # from 1 only against the log-probs frozen before the first (recomputed, they would be 1 again)
    _, metrics = run_train(server, tmp_path / "mu2", "--num_iterations", "2", "--steps_per_generation", "1",
                           "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "2",
                           "--max_completion_length", "8", "--max_steps", "2", "--learning_rate", "3e-2",
                           "--bf16", "false", "--no_save_model", "--micro_batch_size", "2", nproc=1)
    assert all(m["old_logprob_pass"] == 1 for m in metrics)
    assert metrics[-1]["optimizer_steps"] == 2 * 2
    assert max(m["clip_ratio/region"] for m in metrics) > 0
    assert max(m["sampler_logprob_diff_max"] for m in metrics) < 1e-4  # the old pass equals the sampler: still in sync
    # on-policy (the default): no old pass, and the clip cannot act. And the default evaluation on the embedded
    # task: before training and after the last step, compared in the run's last line
    proc, metrics = run_train(server, tmp_path / "mu1", "--reward_funcs", "tests.helpers:brevity,format",
                              "--num_generations", "4", "--prompts_per_step", "2", "--max_completion_length", "8",
                              "--max_steps", "2", "--learning_rate", "3e-2", "--bf16", "false", "--no_save_model",
                              "--eval_steps", "-1", "--eval_num_prompts", "3", nproc=1)
    evals = [m for m in metrics if "eval/reward" in m]
    assert [m["step"] for m in evals] == [0, 2] and all(m["eval/num_prompts"] == 3 for m in evals)
    brevity, fmt = ([m[f"eval/rewards/{name}"] for m in evals] for name in ("tests.helpers:brevity", "format"))
    assert proc.stdout.strip().splitlines()[-1] == (
        f"held-out tests.helpers:brevity {brevity[0]:.2f} -> {brevity[1]:.2f}, format {fmt[0]:.2f} -> {fmt[1]:.2f} "
        "(3 problems x 4 samples, steps 0 -> 2)")
    metrics = [m for m in metrics if "loss" in m]
    assert all(m["old_logprob_pass"] == 0 and m["clip_ratio/region"] == 0 for m in metrics)
    # the two evaluations differ only by the weights: the same problems, and the same samples where the weights
    # did not change (--learning_rate 1e-12: too small to change what the fp32 weights sample)
    proc, _ = run_train(server, tmp_path / "lr0", "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4",
                        "--prompts_per_step", "2", "--max_completion_length", "8", "--max_steps", "1",
                        "--learning_rate", "1e-12", "--bf16", "false", "--no_save_model", "--eval_steps", "-1",
                        "--eval_num_prompts", "3", nproc=1)
    for run, same in (("mu1", False), ("lr0", True)):
        evals = [(r["step"], r["prompt"], r["completion"]) for r in map(json.loads, open(tmp_path / run / "rollouts.jsonl"))
                 if r["split"] == "eval"]
        before, after = ([e[1:] for e in evals if e[0] == step] for step in (0, max(e[0] for e in evals)))
        assert len(before) == len(after) == 12 and [p for p, _ in before] == [p for p, _ in after]
        assert (before == after) == same, run
    assert all(0.5 < m["is_ratio/mean"] < 2 and m["is_ratio/dropped_frac"] == 0 for m in metrics)
    assert max(m["sampler_logprob_diff_max"] for m in metrics) < 1e-4


def test_completions_too_long_for_the_server_fail_at_start_saying_what_to_change(server, tmp_path):
    proc = run_train(server, tmp_path / "out", "--max_completion_length", "2000", "--max_steps", "1", nproc=1, check=False)
    assert proc.returncode != 0 and "--max-model-len" in proc.stderr and "step 1/" not in proc.stdout


LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "16", "--lora_dropout", "0"]


@pytest.mark.parametrize("skipped, flags, tolerance, every", [
    ("model.layers.1.mlp.down_proj.weight", ["--bf16", "false"], 1e-3, 1),
    ("model.layers.1.mlp.down_proj.weight", ["--bf16", "false", "--fsdp", "--sync_check_steps", "2"], 1e-3, 2),
    ("model.layers.1.mlp.down_proj.weight", ["--bf16", "false", *LORA], 1e-3, 1),  # its adapter, pushed alone
    ("model.embed_tokens.weight", ["--bf16", "true", "--learning_rate", "0.1"], 0.5, 1),  # the server computes in fp32
], ids=["ddp", "fsdp_every_2_steps", "lora", "bf16"])
def test_sync_check_stops_a_run_whose_push_skipped_a_weight(server, tmp_path, skipped, flags, tolerance, every):
    """A push that leaves one weight out, under each way of training: a probe checked after a push (every
    --sync_check_steps) stops the run, at the default tolerance (1e-3 where trainer and server both compute in
    fp32, else 0.5), at the first step the weight has moved enough (one update of one matrix may move the
    probe's log-probs by less than 1e-3), before that step's console line (its metrics, without a probe, are
    logged by the stop's save)."""
    proc = run_train(server, tmp_path / "out", "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4",
                     "--prompts_per_step", "2", "--max_completion_length", "8", "--max_steps", "4", "--learning_rate",
                     "5e-2", *flags, nproc=2, check=False, env={"NANOGRPO_FAULT_SKIP_WEIGHT": skipped})
    assert proc.returncode != 0, proc.stdout[-2000:]
    found = re.search(r"weight sync check failed after step (\d+): .* on average > (\S+)\. .*a weight not pushed",
                      proc.stderr, re.S)
    assert found and float(found[2]) == tolerance, proc.stderr[-3000:]
    step = int(found[1])
    assert step % every == 0 and f"step {step}/4" not in proc.stdout
    records = list(map(json.loads, open(tmp_path / "out" / "metrics.jsonl")))  # the step stopped at: no probe
    assert [m["step"] for m in records] in (list(range(1, step)), list(range(1, step + 1)))
    assert [("sync_probe_diff_mean" in m) for m in records[:step - 1]] == [(s + 1) % every == 0 for s in range(step - 1)]


def test_evaluation_rollout_ledger_plot_and_wandb_table(server, tmp_path):
    """The embedded task's held-out split evaluated before training, every 2 steps and at the end (5 prompts,
    uneven over 2 ranks, 4 completions each). Every completion is in rollouts.jsonl; from it alone the
    advantages, the evaluation's mean reward and its pass@k are recomputed and must equal what was logged."""
    out = tmp_path / "out"
    proc, metrics = run_train(
        server, out, "--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
        "--max_completion_length", "8", "--max_steps", "3", "--bf16", "false", "--eval_steps", "2",
        "--eval_num_prompts", "5", "--num_generations_eval", "4", "--eval_pass_k", "1,2,4", "--report_to", "wandb",
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    assert [m["step"] for m in metrics if "reward" in m] == [1, 2, 3]
    evals = {m["step"]: m for m in metrics if "eval/reward" in m}
    assert sorted(evals) == [0, 2, 3] and all(m["eval/num_prompts"] == 5 for m in evals.values())
    assert "eval at step 2 | reward" in proc.stdout and "] 100% " in proc.stdout  # the progress bar filled

    ledger = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    train = [r for r in ledger if r["split"] == "train"]
    assert len(train) == 3 * 16 and {r["policy_version"] for r in train if r["step"] == 3} == {2}
    assert all(r["finish_reason"] in ("stop", "length") and 0 <= r["completion_tokens"] <= 8 for r in ledger)
    for step in (1, 2, 3):  # the advantage of each completion, from the rewards of its group
        for prompt in {r["prompt_index"] for r in train if r["step"] == step}:
            group = [r for r in train if r["step"] == step and r["prompt_index"] == prompt]
            rewards = torch.tensor([r["reward"] for r in group], dtype=torch.float64)
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-4)
    for step, m in evals.items():  # pass@k and the mean reward, from the evaluation's completions
        records = [r for r in ledger if r["split"] == "eval" and r["step"] == step]
        assert len(records) == 20 and len({r["prompt_index"] for r in records}) == 5
        assert m["eval/reward"] == pytest.approx(sum(r["reward"] for r in records) / 20, abs=1e-6)
        correct = [sum(r["rewards"]["tests.helpers:brevity"] >= 1 for r in records if r["prompt_index"] == p) for p in range(5)]
        for k in (1, 2, 4):
            assert m[f"eval/pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in correct) / 5, abs=1e-9)
    assert evals[0]["eval/pass@1"] <= evals[0]["eval/pass@2"] <= evals[0]["eval/pass@4"]

    assert open(out / "metrics.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n" and "plotted" in proc.stdout
    tables = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "**" / "*.json"),
                       recursive=True)
    assert any("train" in t for t in tables) and any("eval" in t for t in tables), tables


def test_more_processes_than_evaluation_prompts(server, tmp_path):
    """Two processes, one held-out prompt: the rank without one takes part in the evaluation with nothing."""
    proc, metrics = run_train(server, tmp_path / "out", "--reward_funcs", "tests.helpers:brevity", "--num_generations",
                              "2", "--prompts_per_step", "2", "--max_completion_length", "4", "--max_steps", "1",
                              "--bf16", "false", "--no_save_model", "--eval_steps", "-1", "--eval_num_prompts", "1")
    evals = [m for m in metrics if "eval/reward" in m]
    assert [m["step"] for m in evals] == [0, 1] and all(m["eval/num_prompts"] == 1 for m in evals)
    assert proc.stdout.strip().splitlines()[-1].endswith("(1 problems x 4 samples, steps 0 -> 1)")
