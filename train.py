"""
nanogrpo: GRPO (DeepSeekMath, arXiv:2402.03300) in one file. A vLLM server samples G completions per
prompt; this script scores them, normalizes the rewards within each group, takes a clipped
policy-gradient step with an optional KL penalty, and pushes the new weights into the server.

Launch (start the server first, see README):
    python train.py                                         # 1 process, the embedded defaults
    torchrun --nproc_per_node 2 train.py --bf16 false      # N processes on one machine (DDP)
    torchrun --nproc_per_node 2 train.py --fsdp --use_peft  # FSDP2-sharded, training a LoRA adapter
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --nproc_per_node 8 train.py ...   # N nodes

What this implements, and the defaults we chose (README: "Loss choices" has the formulas; grpo.py the math, as
pure functions of tensors):
  - advantages: A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4), the same for every token of
    completion i (--scale_rewards group; batch and none are options). A group is the G completions
    of one prompt and lives on one rank, so group statistics need no collective.
  - loss: PPO's clipped surrogate per token, min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A),
    rho = pi / pi_old, minus beta * KL(pi || pi_ref) with Schulman's k3 estimator
    exp(ref - logp) - (ref - logp) - 1 (unbiased, never negative).
  - aggregation: --loss_type dapo, the sum over the completion tokens of the optimizer step divided by the
    round's tokens over all ranks (per --steps_per_generation step: as TRL). Every token weighs the same, and
    the gradient does not depend on how the step is split into micro-batches or ranks.
  - on-policy by default: one pass, one optimizer step per generation round. pi_old is then the policy that
    sampled, its log-probs the detached ones of the training forward: rho = 1 in value, the clip metrics 0.
    With --num_iterations > 1 or --steps_per_generation > 1 pi_old gets its own no-grad pass before the first
    update.
  - importance sampling against the sampler, on by default: every token is weighted by
    pi_old / pi_vLLM, truncated at 2 (TIS), since vLLM never computes exactly our distribution
    (other kernels, bf16). The same log-prob difference is logged as a sync check.
  - beta = 0 by default (as in TRL, DAPO and Dr. GRPO): no reference model is loaded.
  - --async_generation: the server samples the next step's batch, with the weights before this step's update,
    while the trainer trains on this one: a step costs about max(generate, train), not their sum. Each batch
    is one update stale (the importance weights correct it); --max_staleness K: up to K batches under way.
"""
import dataclasses
import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from checkpoints import (Saver, StopRequest, check_checkpoint, evaluated_last, find_checkpoint, load_checkpoint,
                         prepare_output_dir, restore_training_state, save_model)
from config import Config, native_bf16, parse_config
from embedded import resolve_model
from grpo import (LOSSES, EntropyBonus, LossParams, StepCounts, batch_advantages, group_advantages, group_normalized,
                  grpo_loss, loss_mask_of, sampler_is_weights, token_weights, without_signal)
from guard import ServerGuard, connect_server
from logprobs import completion_logprobs, length_sorted, no_grad_logprobs, take, to_device, trim_padding
from metrics import (MetricsLogger, ScoringWatch, StepTimer, check_finite, console_line, eval_line, eval_summary,
                     mean_over_ranks, merge_stats, progress, reward_metrics, rollout_records, training_metrics)
from mixture import load_mixture, resume_signature
from models import build_models, build_optimizer, full_tensor, gradient_sync, mix_into_reference, reference_model
from plot import plot_run
from preflight import Preflight, largest_update, sampled, scored
from rewards import load_postprocess, postprocessed, weighted_rewards
from rollout import RolloutContext, SampledAhead, StepRollouts, ahead_from_json, collate, training_samples
from scorer import RewardScorer
from tools import environment_rewards
from utils import (barrier, extremes_over_ranks, moments_over_ranks, print0, quantile_over_ranks, run_and_exit,
                   set_malloc_thresholds, setup_distributed, sum_over_ranks)
from vision import load_tokenizer
from weight_sync import check_sync, server_sync, weight_bytes


# -----------------------------------------------------------------------------
# one step, in the order of the method: sample (rollout.StepRollouts, through the server), score, advantages,
# old / ref log-probs, loss and step; then the loop in main() syncs the weights, logs and saves

@dataclass
class Scored:
    """A step's batch on this rank, scored: G episodes per row, row by row."""
    episodes: list  # rollout.Episode each: prompt and completion ids, sampled-token mask, sampler log-probs
    texts: list[str]  # each completion, decoded
    reward_matrix: torch.Tensor  # (N, k): each reward function's reward (NaN: not scored)
    rewards: torch.Tensor  # (N,): their weighted sum (NaN: nothing scored)
    rows: list[int]  # the rows sampled (indices), one per group of G


def score(episodes: list, rows: list[int], optimizer_steps: int, tokenizer, mixture, scorer, postprocess) -> Scored:
    """Every reward function on the completions of its tasks' rows (in the scorer's process), each
    environment's get_reward() as a column of its own, the --reward_postprocess hook, then the weighted
    sum."""
    # One decode per completion: no episodes give no texts (batch_decode([]) would give [""]).
    texts = [tokenizer.decode(e.completion_ids, skip_special_tokens=True) for e in episodes]
    # A multi-turn episode is scored on its messages, a single-turn one on its text.
    completions = [text if e.messages is None else e.messages for e, text in zip(episodes, texts)]
    tasks = mixture.task_index([e.row for e in episodes])  # (N,) the task of each, which picks its columns
    scores = scorer([{**e.row, **e.extra} for e in episodes], completions, [e.completion_ids for e in episodes],
                    optimizer_steps, mixture.own[tasks])  # each function scores its own tasks' rows only
    # Each trajectory's get_reward() is a column; an episode whose environment failed gets no reward at all.
    scores = environment_rewards(episodes, scores, scorer, mixture.env_names, mixture.env_reward_of(tasks))
    # The reward matrix (N, k): one column per reward function.
    reward_matrix = torch.tensor(scores, dtype=torch.float32).T.reshape(len(texts), len(mixture.names))
    # Then the --reward_postprocess hook; a column of another task's function is NaN (not scored).
    reward_matrix = postprocessed(postprocess, reward_matrix, mixture.names, mixture.names_of(tasks))
    reward_matrix = reward_matrix.where(mixture.own[tasks], float("nan"))
    rewards = weighted_rewards(reward_matrix, mixture.weights[tasks], mixture.own[tasks])
    return Scored(episodes, texts, reward_matrix, rewards, rows)

def step_advantages(batch: Scored, weighting: tuple, G: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) advantages (0: not scored) and (N,) whether each completion's group has no signal (advantages 0).
    GRPO: the weighted sum of the rewards normalized in its group. GDPO (--multi_objective_aggregation
    normalize_then_sum): each function's rewards normalized in the group, then weighed and summed
    (`weighting`: each row's weights and own columns, rewards.weighted_rewards), then normalized over the
    batch of all ranks (as TRL)."""
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        summed = weighted_rewards(group_normalized(batch.reward_matrix, G), *weighting)
        zero_std = without_signal(batch.reward_matrix, G).repeat_interleave(G)
        return batch_advantages(summed, *moments_over_ranks(summed)), zero_std
    # --scale_rewards batch divides by the std of the whole batch, over all ranks (a collective).
    batch_std = moments_over_ranks(batch.rewards)[1] if cfg.scale_rewards == "batch" else 1.0
    advantages = group_advantages(batch.rewards, G, cfg.scale_rewards, batch_std)
    return advantages, without_signal(batch.rewards, G).repeat_interleave(G)

def old_and_ref_logprobs(model, ref_model, inputs: dict, loss_mask: torch.Tensor, cfg: Config, autocast,
                         off_policy: bool) -> tuple:
    """No-grad passes before the first update: pi_old's log-probs (off-policy only: on-policy the training
    forward's detached log-probs are pi_old, and rho = 1), the high-entropy token mask (--top_entropy_quantile
    < 1, from pi_old's entropies), the reference's log-probs (beta > 0; with LoRA the adapter is switched
    off). Each (N, C) or None."""
    C, old_logp, ref_logp, entropy_mask = loss_mask.shape[1], None, None, None
    if off_policy or cfg.top_entropy_quantile < 1:
        old_logp, entropy = no_grad_logprobs(model, inputs, C, cfg.temperature, cfg.micro_batch_size, autocast)
        old_logp = old_logp if off_policy else None
        if cfg.top_entropy_quantile < 1:  # train on the step's high-entropy tokens only
            entropy_mask = high_entropy_mask(entropy, loss_mask, cfg.top_entropy_quantile)
    if cfg.beta > 0:
        with reference_model(model, ref_model) as ref:
            ref_logp = no_grad_logprobs(ref, inputs, C, cfg.temperature, cfg.micro_batch_size, autocast)[0]
    return old_logp, ref_logp, entropy_mask

def step_data(inputs: dict, tokens: dict, loss_mask: torch.Tensor, advantages: torch.Tensor, old_logp, ref_logp,
              entropy_mask, keep) -> dict:
    """What the loss and step take (update, accumulate_gradients): this rank's tensors over its S completions. A
    loss that needs another input gets it here as one more key, per token (S, C) or per completion (S,); the
    --dry_run's memory check builds its batch here too."""
    return dict(inputs=inputs, loss_mask=loss_mask, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                sampler_logp=tokens["sampler_logp"], entropy_mask=entropy_mask, keep=keep)


def accumulate_gradients(model, data: dict, cfg: Config, world_size: int, autocast, round_tokens: float | None = None,
                         params: LossParams | None = None) -> tuple[dict, torch.Tensor]:
    """Backpropagate the loss of one optimizer step on this rank's share `data`, micro-batch by
    micro-batch. `data` holds tensors over this rank's completions: inputs (the model's, a dict),
    loss_mask, advantages, and old_logp, ref_logp, sampler_logp, entropy_mask (each or None), and optionally
    `keep` (rows to run; the others still count in the normalisation). Every other tensor in it reaches the
    loss too, cut to the micro-batch (a new per-token input of a loss is one more key). Token weights count
    the step over all ranks (grpo.token_weights), so the gradient after DDP's averaging is the same however
    the step is split over micro-batches and ranks (except bnpo, by definition). Every rank runs as many
    micro-batches (FSDP2 gathers weights in each forward, DDP reduces in the last backward): a rank with fewer
    rows runs its first row again with weight 0. `round_tokens`: the generation round's tokens over all ranks,
    which dapo shares among its --steps_per_generation steps (default: this step's alone). `params`: the
    loss's numbers (default: the config's). Returns sums of per-token statistics over this rank's tokens, and
    the policy's log-probs (N, C)."""
    device = next(model.parameters()).device
    params = params or LossParams.of(cfg)
    loss = LOSSES[params.loss_type]
    mask = data["loss_mask"]
    C = mask.shape[1]
    rows = torch.arange(len(mask))[data["keep"]] if data.get("keep") is not None else torch.arange(len(mask))
    if loss.aggregation == "bnpo":  # bnpo normalises per micro-batch, so each must stay a random draw
        micro = [rows[i:i + cfg.micro_batch_size] for i in range(0, len(rows), cfg.micro_batch_size)]
    else:  # similar lengths together, so little padding is computed (the order leaves the gradient the same)
        micro = length_sorted(rows, data["inputs"]["attention_mask"].sum(dim=1), cfg.micro_batch_size)
    # The tokens the entropy bonus acts on: all of them, or the high-entropy ones (--top_entropy_quantile).
    bonus_mask = mask if data.get("entropy_mask") is None else mask * data["entropy_mask"]
    counts = sum_over_ranks({"seqs": len(mask), "tokens": mask.sum(), "micro": len(micro), "bonus": bonus_mask.sum()})
    step_counts = StepCounts(counts["seqs"], counts["tokens"], counts["micro"], world_size, round_tokens,
                             cfg.steps_per_generation if round_tokens is not None else 1)
    num_micro = int(extremes_over_ranks({"micro_max": len(micro)})["micro_max"])
    sums, logps = {}, torch.zeros(mask.shape)
    for j in range(num_micro):
        padding = j >= len(micro)  # this rank has run all its rows; keep in step with the others
        s = torch.arange(1) if padding else micro[j]
        inputs, c = trim_padding(take(data["inputs"], s), C)  # cut to the c <= C columns these rows use
        t = loss_inputs(data, s, c, device)  # the loss's tensors of these rows: (b, c) or (b,)
        t["loss_mask"] = t["loss_mask"] * (not padding)  # a padding run counts no token
        with gradient_sync(model, j == num_micro - 1):  # DDP reduces on the last micro-batch only
            # Autocast covers the forward alone, so the backward runs without its bf16 copies of the weights.
            with autocast:
                logp, entropy = completion_logprobs(model, to_device(inputs, device), c, cfg.temperature,
                                                    entropy_grad=params.entropy_coef != 0)  # (b, c), fp32
            # pi_old: the policy before this round's first update. On-policy it is the current policy,
            # whose detached log-probs are these; off-policy the loop computed them before updating.
            if t.get("old_logp") is None:
                t["old_logp"] = logp.detach()
            m = t["loss_mask"]
            weights = token_weights(m, loss.aggregation, step_counts, params.max_completion_length).to(device)
            bonus_weights = bonus_mask[s, :c].to(device) * (world_size * (not padding) / max(counts["bonus"], 1.0))
            extra = {}
            # Importance sampling against the sampler: each token weighted by pi_old / pi_vLLM, truncated.
            if cfg.vllm_importance_sampling_correction and t.get("sampler_logp") is not None:
                t["is_weight"], ratio = sampler_is_weights(t["old_logp"].float(), t["sampler_logp"], m,
                                                           cfg.vllm_importance_sampling_mode,
                                                           cfg.vllm_importance_sampling_clip_min,
                                                           cfg.vllm_importance_sampling_clip_max)
                r = ratio.expand_as(m) * m
                extra = {"is_ratio": r.sum(), "is_ratio_max": r.max(),
                         "is_ratio_min": torch.where(m > 0, r, torch.inf).min(),
                         "is_dropped": ((t["is_weight"] == 0) & (m > 0)).sum()}
            loss_value, stats = grpo_loss(logp, t, weights, params, entropy, bonus_weights)
            loss_value.backward()
        trained = bonus_mask[s, :c].to(device) * (not padding)  # the tokens the bonus acts on
        stats = {**stats, **extra, "entropy": (entropy.detach() * m).sum(), "tokens": m.sum(),
                 "trained_entropy": (entropy.detach() * trained).sum(), "trained_tokens": trained.sum(),
                 "loss": loss_value.detach() / world_size}
        merge_stats(sums, {k: v.item() for k, v in stats.items()})  # every rank that ran has the same keys
        if not padding:
            logps[s, :c] = logp.detach().float().cpu()
    return sums, logps

def loss_inputs(data: dict, rows: torch.Tensor, c: int, device) -> dict:
    """The tensors of `data` the loss reads, of `rows`: per-token ones (N, C, ...) cut to the first c completion
    columns, per-completion ones (N,) as they are. The model's inputs and `keep` are not the loss's; None stays
    out. A tensor of another shape is refused with its name: cut wrongly, it would reach the loss silently."""
    N, C = data["loss_mask"].shape
    inputs = {}
    for k, v in data.items():
        if not isinstance(v, torch.Tensor) or k == "keep":
            continue
        if v.dim() >= 2 and tuple(v.shape[:2]) == (N, C):
            inputs[k] = v[rows, :c].to(device)
        elif tuple(v.shape) == (N,):
            inputs[k] = v[rows].to(device)
        else:
            raise ValueError(f"the step's data[{k!r}] has shape {tuple(v.shape)}: the loss takes tensors of shape "
                             f"({N}, {C}, ...) per token or ({N},) per completion")
    return inputs


def optimizer_step(optimizer, scheduler, params, max_grad_norm: float) -> torch.Tensor:
    """Clip the gradient, step (unless it is NaN/inf: the weights and optimizer state stay good), clear it.
    Returns the gradient norm before clipping, the same on every rank (that of the reduced gradient)."""
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf")))
    if norm.isfinite():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return norm

def update(model, optimizer, scheduler, trainable: list, data: dict, step: int, cfg: Config, world_size: int,
           autocast, timer, bonus: EntropyBonus, ref_model=None) -> tuple[dict, list, torch.Tensor]:
    """The optimizer steps of one generation round: num_iterations passes over `data`, each in
    steps_per_generation shuffled parts, one optimizer step per part, dapo's divided by the round's tokens /
    parts (as TRL). Each step applies the entropy bonus's coefficient of then, and after it the bonus's
    adaptive control sees the step's entropy and TR-DPO (--sync_ref_model) mixes the policy into `ref_model`
    every --ref_model_sync_steps. Returns the summed statistics, each step's gradient norm, and the first
    pass's log-probs (N, C) (the sync check's)."""
    sums, grad_norms, first_pass_logp = {}, [], torch.zeros(data["loss_mask"].shape)
    round_tokens = sum_over_ranks({"tokens": data["loss_mask"].sum()})["tokens"]
    params = LossParams.of(cfg)
    for iteration in range(cfg.num_iterations):
        seed = cfg.seed + step * 1000 + iteration
        order = torch.randperm(len(data["loss_mask"]), generator=torch.Generator().manual_seed(seed))
        for part in order.chunk(cfg.steps_per_generation):
            # The entropy bonus's coefficient at this optimizer step (the adaptive one moves between steps).
            step_params = dataclasses.replace(params, entropy_coef=bonus.applied())
            part_sums, logp = accumulate_gradients(model, take(data, part), cfg, world_size, autocast, round_tokens,
                                                   step_params)
            merge_stats(sums, part_sums)
            with timer.within("optimizer"):  # counted within time/train as well
                grad_norms.append(optimizer_step(optimizer, scheduler, trainable, cfg.max_grad_norm))
            if bonus.adaptive:  # it follows the mean entropy of the tokens this step trained, over all ranks
                t = sum_over_ranks({k: part_sums[k] for k in ("trained_entropy", "trained_tokens")})
                bonus.update(t["trained_entropy"] / max(t["trained_tokens"], 1.0))
            if cfg.sync_ref_model and scheduler.last_epoch % cfg.ref_model_sync_steps == 0:
                mix_into_reference(model, ref_model, cfg.ref_model_mixup_alpha)
            if iteration == 0:
                first_pass_logp[part] = logp
    return sums, grad_norms, first_pass_logp

def sampler_diff(tokens: dict, keep, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sync check of every step: |logp - the sampler's log-prob| (N, C) of the tokens compared (the
    sampled ones whose sampler log-prob is known, in rows that trained: `keep`, None = all), and those tokens
    (N, C)."""
    compared = tokens["sampled"] * ~tokens["sampler_logp"].isnan() * (1 if keep is None else keep.unsqueeze(1))
    return (logp - tokens["sampler_logp"]).abs().where(compared > 0, 0.0), compared

def main(cfg: Config):
    # -------------------------------------------------------------------------- setup
    # SIGTERM or Ctrl-C: before the first weight push the run stops at once; from it on, it saves, then stops.
    stop = StopRequest()
    rank, local_rank, world_size, device, is_main = setup_distributed(cfg.collective_timeout())
    cfg.validate(world_size)
    cfg.bf16 = native_bf16(device) if cfg.bf16 == "auto" else cfg.bf16  # fp32 where bf16 is emulated (slow)
    # auto: groups without signal are dropped where the gradient stays the same without them.
    cfg.drop_zero_std_groups = cfg.drops_zero_std_groups()
    torch.manual_seed(cfg.seed + rank)
    # Freed activations go back to the kernel instead of leaving holes between the gradients (docs/memory.md).
    set_malloc_thresholds(4 * 2**20, 0)
    G = cfg.num_generations
    # With --dry_run each build below is a check, and the run stops before training (preflight.py).
    checks = Preflight(cfg.dry_run, cfg.output_dir, is_main)
    with checks("output folder"):
        resume = find_checkpoint(cfg.resume_from_checkpoint, cfg.output_dir) if cfg.resume_from_checkpoint else None
        run_config = dataclasses.asdict(cfg) | resume_signature(cfg)  # as checkpoints keep it, tasks included
        # A resumed run must be able to continue the checkpoint's run exactly: checked now.
        resume_step, changed_flags = check_checkpoint(resume, run_config) if resume else (0, [])
        # The output folder must be writable, locked for this run alone, and hold no earlier run's output to
        # mix with: a problem is said now, not at the first save.
        output_lock = prepare_output_dir(cfg.output_dir, resume, resume_step, cfg.dry_run) if is_main else None
        checks.say(f"{cfg.output_dir}" + (f", resumes {resume} after step {resume_step}" if resume else ""))
    with checks("tokenizer"):
        model_path = resolve_model(cfg.model)  # the embedded model's folder, a local folder or a hub id
        processor, tokenizer = load_tokenizer(cfg, model_path)  # processor: a VLM's, else None
        # Padding is masked, so any id will do (Llama 3 has no pad token).
        pad_id = 0 if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        checks.say(f"{model_path}" + (", with its image processor" if processor else ""))
    # The tasks (mixture.py; one dataset is one task): their rows, their rollout (rows to episodes through the
    # server; tools and environments: tools.py), their reward functions, and the held-out rows.
    with checks("tasks"):
        mixture = load_mixture(cfg, tokenizer, processor)  # a template that cannot render tools stops here
        # The longest prompt through the chat template, image tokens included. Every image is read now, so a
        # bad one stops the run here, as does a prompt over --max_prompt_length.
        longest = mixture.longest_prompt(tokenizer, processor, cfg.max_prompt_length)
        checks.say(f"{mixture.describe()} | {len(mixture.rows)} rows, {len(mixture.eval_rows)} held out | the longest "
                   f"prompt {longest}")
    if mixture.calls_tools:  # the parser of the model's calls reads back one its chat template writes (tool_calls.py)
        with checks("tool calls"):
            checks.say(mixture.read_tool_calls(cfg.tool_call_parser, tokenizer, cfg.model))
    with checks("server"):
        # Waits for the server, and checks that the longest prompt and a completion fit in its context.
        client, server_dtype, max_len = connect_server(cfg, longest)
        checks.say(f"{client.base}, our key | {server_dtype} | {longest} + {cfg.max_completion_length} <= {max_len}")
    with checks("reward functions"):
        # Each reward function's signature is checked against the dataset's columns now.
        scorer = RewardScorer(mixture.functions, {name: mixture.columns_of(name) for name in mixture.functions},
                              device, cfg.max_steps, cfg.reward_timeout, cfg.reward_options())
        postprocess = load_postprocess(cfg.reward_postprocess)  # a hook on the reward matrix (rewards.py)
        checks.say(", ".join(mixture.names) + " take the dataset's columns")
    names = mixture.names  # k reward columns: every task's functions, then each environment's get_reward()
    ctx = RolloutContext(client, tokenizer, G, cfg.sampling(), cfg.seed, cfg.system_prompt, processor,
                         cfg.max_prompt_length)  # sampling: max_tokens, temperature, top_p, top_k, ...
    # Which rows each step samples on this rank, and the calls that sample them.
    rollouts = StepRollouts(mixture, ctx, cfg, rank, world_size)
    score_batch = functools.partial(score, tokenizer=tokenizer, mixture=mixture, scorer=scorer, postprocess=postprocess)

    with checks("models"):
        state = load_checkpoint(resume) if resume else {"step": 0}  # optimizer, scheduler, RNG, step
        policy, model, ref_model = build_models(cfg, model_path, processor is not None, resume, device, world_size)
        trainable = [p for p in policy.parameters() if p.requires_grad]
        optimizer, scheduler = build_optimizer(policy, cfg)
        if resume:
            changed = restore_training_state(state, model, optimizer, scheduler, rank, world_size)
            scorer.failures = state["scorer_failures"] if is_main else 0  # rank 0 saved all ranks' sum
            print0(f"resuming from {resume} after step {state['step']}"
                   + "".join(f"; {change} (this run's flag applies)" for change in changed + changed_flags))
        checks.say(f"{sum(p.numel() for p in trainable):,} trainable parameters on {device}, beta {cfg.beta}")
    off_policy = cfg.num_iterations > 1 or cfg.steps_per_generation > 1  # then pi_old needs its own pass
    updates_per_round = cfg.num_iterations * cfg.steps_per_generation  # optimizer steps per loop step
    # The entropy bonus: a constant coefficient, or an adaptive one (kept in checkpoints).
    bonus = EntropyBonus(cfg, state.get("entropy_bonus"))
    # Autocast without its cache of bf16 weight copies: a forward uses each weight once (casting costs
    # little), and the cache would hold a bf16 copy of the model through it: 0.2 GB of the trainer's peak on
    # the 135M model.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if cfg.bf16 else nullcontext()

    # A fixed probe the server scores after pushes catches a sync gone silently wrong (a VLM's has an image).
    sync_probe = mixture.sync_probe(tokenizer, processor)
    sync_tolerance = cfg.probe_tolerance(exact=server_dtype == torch.float32 and not cfg.bf16)
    logger = MetricsLogger(cfg.output_dir, is_main and not cfg.dry_run, cfg.report_to, run_config, cfg.wandb_project,
                           cfg.run_name)
    saver = Saver(cfg, run_config, model, optimizer, scheduler, processor or tokenizer, ref_model, scorer, bonus,
                  logger, state["step"], is_main)

    scorer.start()  # its process imports the reward functions while the first push and samples are under way
    # The weights go to the server in its names and dtype (LoRA merged, or the adapter alone). FSDP2's shards
    # are gathered one tensor at a time, so every rank takes part; rank 0 alone sends.
    with checks("weight push"):
        sync, pushed = server_sync(cfg, client, model, server_dtype, rank, version=lambda: scheduler.last_epoch)
        # guard.run(fn) runs the calls to the server, and every call that may stop the run, on every rank
        # together. If the server dies or restarts, it waits for it, pushes the current weights and repeats
        # the call. If it does not come back, or a call raises on any rank (such as a stop the code itself
        # decides: a judge that is gone, a loss that is not finite), or a stop signal came, every rank saves
        # the steps done (saver.on_stop), then the run stops.
        guard = ServerGuard(client, sync, cfg.vllm_server_timeout, on_gone=saver.on_stop,
                            stop_requested=lambda: stop.flag)
        # From here a stop signal is seen by the guard's calls (and their waits), which save first.
        stop.at_once = False
        # The server now holds our step-0 policy (a LoRA adapter starts at zero, but its names must map).
        guard.run(sync.push)
        barrier()  # no rank samples while weights are being pushed
        checks.say(f"{pushed}: {weight_bytes(model, server_dtype, 'adapter' in pushed) / 2**20:,.1f} MB per push"
                   + (f" (the base, {weight_bytes(model, server_dtype) / 2**20:,.1f} MB, once per connection)"
                      if "adapter" in pushed else ""))
    parallel = "FSDP2" if cfg.fsdp else "DDP" if world_size > 1 else "single process"
    print0(f"nanogrpo | model {cfg.model} | {world_size} process(es) on {device.type} | {cfg.prompts_per_step} prompts "
           f"x G={G} = {cfg.prompts_per_step * G} completions per step ({rollouts.per_rank * G} per rank) | "
           f"{mixture.describe()} | loss {cfg.loss_type} | beta {cfg.beta} | bf16 {cfg.bf16} | "
           f"{parallel}{' + LoRA' if cfg.use_peft else ''} | pushes {pushed}")

    if cfg.dry_run:  # a first step's parts, each a check, on one prompt per task; then stop (preflight.py)
        with checks("sync probe"):
            probe = guard.run(check_sync, client, model, sync_probe, autocast, is_main, sync_tolerance, 0)
            checks.say(f"the server's log-probs are the trainer's to {probe['sync_probe_diff_mean']:.2g} on average "
                       f"(at most {sync_tolerance:g})")
        with checks("rollout"):  # rank 0 samples G completions of each task's first prompt
            episodes = guard.run(rollouts.first_of_each_task())
            checks.say(sampled(episodes, [t.name for t in mixture.tasks]))
        with checks("rewards"):
            checks.say(scored(guard.run(score_batch, episodes, [], scheduler.last_epoch).reward_matrix, names, scorer))
        with checks("memory"):  # one update on --micro_batch_size completions of a step's largest shape
            checks.say(largest_update(old_and_ref_logprobs, step_data, update, model, ref_model, optimizer, scheduler,
                                      trainable, sync_probe, longest, pad_id, cfg, world_size, autocast, off_policy,
                                      device))
        return checks.passed()  # the scorer's process ends when main's objects are freed

    ahead = None  # --async_generation: up to --max_staleness K batches sampled ahead (a checkpoint's too)
    if cfg.async_generation:
        saved = ahead_from_json(state.get("presampled"), state["step"],
                                lambda j: [mixture.rows[i] for i in rollouts.rows_of(j)], rank * rollouts.per_rank, G)
        ahead = saver.ahead = SampledAhead(cfg.max_staleness, rollouts.call, guard, lambda: scheduler.last_epoch,
                                           updates_per_round, saved,
                                           probe_alone=bool(guard.run(client.server_config).get("lora_config")))

    # Evaluate the starting point, to compare with. A run resumed after its last step evaluates only if a stop
    # came before that step's evaluation.
    evaluation = functools.partial(evaluate, rollouts, score_batch, guard, logger, mixture, cfg)
    if mixture.eval_rows and (resume is None or state["step"] == cfg.max_steps and not evaluated_last(cfg.output_dir)):
        metrics = {"step": state["step"], **evaluation(scheduler.last_epoch)}
        logger.log(metrics)
        print0(eval_line(state["step"], metrics, cfg.pass_k(), [t.name for t in mixture.tasks]))
    # bad_steps: the steps in a row whose loss was not finite; t_start: for the progress bar.
    bad_steps, t_start = 0, time.perf_counter()
    # Counts the steps in a row with a reward function down (or no reward at all); warns of rewards all alike.
    scoring = ScoringWatch(names, cfg.max_unscored_steps)
    saver.in_loop, warned_short = True, []
    for step in range(state["step"], cfg.max_steps):
        timer = StepTimer()
        # ---------------------------------------------------------------------- sample
        # G completions of each of this rank's prompts, row by row; `version`: the policy that sampled them
        # (optimizer steps). With --async_generation the batch was sampled during the steps before (all but
        # the first), and the server samples the next K while we train, after the last step too: the last
        # checkpoint keeps them, so that a run continued from it goes on as if never stopped.
        if ahead is not None:
            version, episodes = ahead.take(step)
            ahead.launch(step)
        else:
            version, episodes = scheduler.last_epoch, guard.run(rollouts.call(step))
        timer.lap("generate")

        # ---------------------------------------------------------------------- score
        batch = guard.run(score_batch, episodes, rollouts.rows_of(step), scheduler.last_epoch)  # (N, k), (N,)
        # --max_unscored_steps steps in a row with a reward function down (or none scored) stop the run.
        guard.run(scoring.update, scorer.failed, scorer.attempted, batch.rewards, step + 1)
        # --dynamic_sampling (DAPO): groups whose rewards all agree make way for more, sampled now.
        batch, dynamic = dynamic_sampling(batch, step, rollouts, score_batch, guard, cfg, scheduler.last_epoch,
                                          warned_short)
        timer.lap("score")

        # ---------------------------------------------------------------------- advantages
        # (N,) each: an advantage is 0 where not scored; zero_std marks completions of groups without signal.
        advantages, zero_std = step_advantages(batch, mixture.weighting(batch.episodes), G, cfg)

        # ---------------------------------------------------------------------- old / ref log-probs
        # What trains: the episodes, and the samples an agent made before editing its history; (S,) `of` says
        # which episode each sample belongs to (its advantage).
        samples, of = training_samples(batch.episodes)
        inputs, tokens = collate(samples, pad_id)  # the model's inputs; (S, C) mask, sampled, logp
        truncated = torch.tensor([e.finish_reason == "length" for e in samples])  # (S,)
        loss_mask = loss_mask_of(tokens["sampled"], truncated, cfg.mask_truncated_completions)  # (S, C)
        # Off-policy (several updates per generation batch), pi_old is frozen before the first update.
        old_logp, ref_logp, entropy_mask = old_and_ref_logprobs(model, ref_model, inputs, loss_mask, cfg, autocast,
                                                                off_policy)
        timer.lap("old_ref")

        # ---------------------------------------------------------------------- loss and step
        if stop.requested():  # saved before the weights change: the checkpoint holds this step's start
            saver.save(step)
            break
        model.train()
        data = step_data(inputs, tokens, loss_mask, advantages[of], old_logp, ref_logp, entropy_mask,
                         keep=~zero_std[of] if cfg.drop_zero_std_groups else None)
        sums, grad_norms, first_pass_logp = update(model, optimizer, scheduler, trainable, data, step, cfg, world_size,
                                                   autocast, timer, bonus, ref_model)
        # The server's log-probs of what it sampled vs ours for the same weights: a sync check.
        diff, compared = sampler_diff(tokens, data["keep"], first_pass_logp if old_logp is None else old_logp)
        timer.lap("train")

        # ---------------------------------------------------------------------- metrics (after the update, a
        # stop up to the log line logs them before it saves, so that no step is missing in metrics.jsonl)
        metrics = {**mean_over_ranks(scorer.metrics), "step": step + 1,  # reward functions' log_metric first
                   **reward_metrics(batch.rewards, batch.reward_matrix, names, zero_std, scorer.failures,
                                    mixture.own_of(batch.episodes)),
                   **mixture.metrics(batch.episodes, batch.rewards, batch.reward_matrix, zero_std, G),
                   **training_metrics(sums, grad_norms, tokens["mask"].sum(dim=1).float(), truncated, diff, compared,
                                      kl=cfg.beta > 0),
                   **dynamic, **(ahead.metrics() if ahead is not None else {}), **bonus.metrics(),
                   "lr": scheduler.get_last_lr()[0], "optimizer_steps": scheduler.last_epoch,
                   "old_logprob_pass": int(off_policy or cfg.top_entropy_quantile < 1)}
        saver.unlogged = dict(metrics)
        logger.log_rollouts(rollout_records(batch.episodes, batch.texts, batch.reward_matrix, names, batch.rewards,
                                            tokenizer, [batch.rows[i // G] for i in range(len(batch.episodes))],
                                            scorer.extra, advantages, step=step + 1, split="train",
                                            policy_version=version, rank=rank))
        bad_steps = guard.run(check_finite, sum(not g.isfinite() for g in grad_norms), bad_steps, step + 1)

        # ---------------------------------------------------------------------- sync weights
        if ahead is not None:  # K = 1: the next batch is sampled with the weights before this update: wait for it
            ahead.settle(step)
        timer.lap("generate")
        guard.run(sync.push)
        barrier()  # no rank samples again before the server has the new weights
        timer.lap("sync")
        probe = {}
        if cfg.sync_check_steps and (step + 1) % cfg.sync_check_steps == 0:  # stops if the weights differ
            if ahead is not None:
                ahead.before_probe()
            probe = guard.run(check_sync, client, model, sync_probe, autocast, is_main, sync_tolerance, step + 1)
        timer.lap("probe")

        # ---------------------------------------------------------------------- log
        metrics |= {**probe, "server_reconnects": guard.reconnects, **timer.metrics()}
        if mixture.eval_rows and ((step + 1) % cfg.eval_every() == 0 or step + 1 == cfg.max_steps):
            t_eval = time.perf_counter()
            metrics |= evaluation(scheduler.last_epoch)
            metrics["time/eval"] = time.perf_counter() - t_eval
        logger.log(metrics)
        saver.unlogged = {}
        print0(console_line(metrics, names, cfg.max_steps) + " | "
               + progress(step + 1 - state["step"], cfg.max_steps - state["step"], time.perf_counter() - t_start))
        # Warns once if every group's rewards agreed in each of the first steps (nothing to learn from).
        scoring.signal(metrics["frac_zero_std_groups"], step + 1, last=step + 1 == cfg.max_steps)
        if "eval/reward" in metrics:
            print0(eval_line(step + 1, metrics, cfg.pass_k(), [t.name for t in mixture.tasks]))

        # ---------------------------------------------------------------------- checkpoint
        if stop.requested() or (cfg.save_steps and ((step + 1) % cfg.save_steps == 0 or step + 1 == cfg.max_steps)):
            saver.save(step + 1, wait_for_ahead=not stop.stopping)
        if stop.stopping:
            break

    # -------------------------------------------------------------------------- save
    if stop.stopping:
        print0("stopped by a signal; continue with --resume_from_checkpoint latest")
    elif cfg.save_model:  # every rank takes part, since FSDP2 gathers the shards; rank 0 writes
        saved = save_model(model, processor or tokenizer, cfg.output_dir, is_main,
                           cfg.save_merged_model or not cfg.use_peft)
        print0(f"saved {', '.join(saved)}")
    logger.close()
    if is_main and (picture := plot_run(cfg.output_dir, reference=cfg.beta > 0)):
        print0(f"plotted {picture}")
    if is_main and (summary := eval_summary(cfg.output_dir, mixture.summary_names(), cfg.num_generations_eval)):
        print0(summary)  # the last line: what the run learned, on problems it never trained on
    scorer.close()
    if output_lock:
        output_lock.close()  # the folder is free for another run
    barrier()  # no rank tears the process group down while another uses it (else gloo aborts at exit)

# -----------------------------------------------------------------------------
# the optional mechanisms: evaluation, DAPO's dynamic sampling, the high-entropy token mask

def evaluate(rollouts: StepRollouts, score_batch, guard, logger, mixture, cfg: Config, optimizer_steps: int) -> dict:
    """Mean rewards and pass@k on the evaluation prompts, through the server (each rank its share). The
    requests carry the same seeds every time, so two evaluations differ only by the weights."""
    n, mine, call = cfg.num_generations_eval, *rollouts.evaluation()
    episodes = guard.run(call)
    batch = guard.run(score_batch, episodes, mine, optimizer_steps)
    updates_per_round = cfg.num_iterations * cfg.steps_per_generation
    logger.log_rollouts(rollout_records(episodes, batch.texts, batch.reward_matrix, mixture.names, batch.rewards,
                                        rollouts.ctx.tokenizer, [mine[i // n] for i in range(len(episodes))],
                                        split="eval", step=optimizer_steps // updates_per_round,
                                        policy_version=optimizer_steps, rank=rollouts.rank))
    lengths = torch.tensor([len(e.completion_ids) for e in episodes], dtype=torch.float32)
    # A prompt passes where its task's first reward function gives >= 1; a mixture also reports each task.
    eval_rows = [mixture.eval_rows[i] for i in mine]
    return mixture.eval_metrics(eval_rows, batch.reward_matrix, batch.rewards, lengths, n, cfg.pass_k()) | {
        f"eval/{name}": value for name, value in mixture.trajectory_metrics(episodes).items()}

def dynamic_sampling(batch: Scored, step: int, rollouts: StepRollouts, score_batch, guard, cfg: Config,
                     optimizer_steps: int, warned: list) -> tuple[Scored, dict]:
    """--dynamic_sampling (DAPO): the step's scored batch with its groups whose rewards all agree replaced by
    groups of extra rounds, sampled and scored now (keep_groups_with_signal); without it, the batch as it is.
    A batch that stays short of groups with signal is said once (`warned`) and counted."""
    if not cfg.dynamic_sampling:
        return batch, {}
    draw = functools.partial(draw_round, step=step, rollouts=rollouts, score_batch=score_batch, guard=guard,
                             optimizer_steps=optimizer_steps)
    batch, metrics = keep_groups_with_signal(batch, draw, cfg.num_generations, cfg.dynamic_sampling_max_rounds,
                                             by_column=cfg.multi_objective_aggregation == "normalize_then_sum")
    if metrics["dynamic_sampling/groups_without_signal"] and not warned:
        warned.append(step)
        print0(f"warning: --dynamic_sampling found too few groups with signal in {cfg.dynamic_sampling_max_rounds} "
               f"extra rounds at step {step + 1}; the batch was filled with groups without (no policy gradient). "
               "Counted in dynamic_sampling/groups_without_signal; raise the flag or make the task easier")
    return batch, metrics


def draw_round(extra_round: int, wanted: bool, step: int, rollouts: StepRollouts, score_batch, guard,
               optimizer_steps: int) -> Scored:
    """Extra round `extra_round` of `step`'s sampling, scored. Every rank runs every round (the guard's calls
    are collectives); a rank that has enough groups already (not `wanted`) samples nothing."""
    episodes = guard.run(rollouts.call(step, extra_round) if wanted else list)
    return guard.run(score_batch, episodes, rollouts.rows_of(step, extra_round) if wanted else [], optimizer_steps)


def keep_groups_with_signal(batch: Scored, draw, G: int, max_rounds: int,
                            by_column: bool = False) -> tuple[Scored, dict]:
    """DAPO's dynamic sampling on this rank's scored batch. A group whose rewards (by_column: each function's,
    GDPO) all agree has no signal (its advantages are 0); more groups come from draw(k, wanted), which samples
    and scores extra round k (an empty batch unless `wanted`: every rank takes part in every round, also one
    that has enough), until every rank has as many groups with signal as it started with, or after max_rounds
    rounds. Returns that many groups, those with signal first (in the order drawn), any shortfall filled with
    groups without, and the rounds' metrics."""
    want, rounds, parts = len(batch.episodes) // G, 0, [batch]
    have = int(groups_with_signal(batch, G, by_column).sum())
    while rounds < max_rounds and sum_over_ranks({"short": max(want - have, 0)})["short"] > 0:
        rounds += 1
        parts.append(draw(rounds, have < want))
        have += int(groups_with_signal(parts[-1], G, by_column).sum())
    drawn = Scored(sum((b.episodes for b in parts), []), sum((b.texts for b in parts), []),
                   torch.cat([b.reward_matrix for b in parts]), torch.cat([b.rewards for b in parts]),
                   sum((b.rows for b in parts), []))
    signal = groups_with_signal(drawn, G, by_column)  # (groups,)
    groups = (signal.nonzero().flatten().tolist() + (~signal).nonzero().flatten().tolist())[:want]
    kept = [g * G + i for g in groups for i in range(G)]
    t = sum_over_ranks({"drawn": len(drawn.rows), "without_signal": sum(not signal[g] for g in groups)})
    batch = Scored([drawn.episodes[i] for i in kept], [drawn.texts[i] for i in kept], drawn.reward_matrix[kept],
                   drawn.rewards[kept], [drawn.rows[g] for g in groups])
    return batch, {"dynamic_sampling/rounds": rounds, "dynamic_sampling/groups_drawn": t["drawn"],
                   "dynamic_sampling/groups_without_signal": t["without_signal"]}


def groups_with_signal(batch: Scored, G: int, by_column: bool) -> torch.Tensor:
    """(groups,) whether each group's rewards differ (by_column: any function's, GDPO normalizes each)."""
    return ~without_signal(batch.reward_matrix if by_column else batch.rewards, G)

def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(N, C) the tokens of `mask` whose entropy is among the top `quantile` of the step's tokens over all
    ranks (Beyond the 80/20 Rule: the forking tokens, rho = 0.2): entropy >= the (1 - rho)-quantile, as
    TRL."""
    threshold = quantile_over_ranks(entropy[mask > 0], 1 - quantile)
    return (entropy >= threshold) & (mask > 0)

if __name__ == "__main__":
    run_and_exit(main, parse_config())  # a mistake found at start prints one line and exits with code 2
