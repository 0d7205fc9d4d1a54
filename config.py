"""nanogrpo's configuration: one dataclass, every field a command-line flag of the same name; the flags the
embedded tasks and environments run with (their code is in embedded.py); the errors that stop a run with one
line.

Flag names follow TRL's GRPOConfig wherever TRL has the same knob. This module is the bottom floor: it imports
no module of the project and nothing heavy at import, so `python train.py --help` answers at once.
"""
import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import threading
import typing
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"  # the embedded model; any other value is a hub id or a folder
EMBEDDED_VLM = "smollm2-vision"  # the embedded VLM: SmolLM2 with a small vision tower (embedded.py)
TOOL_MODEL = "smollm2-135m-tools"  # the embedded model taught the environments' tool calls (embedded.py)

DEFAULT_DATASET = "arithmetic"  # the embedded, procedurally generated task (embedded.arithmetic_problems)

NO_DATASET = "none"  # an environment makes the prompts: rows are seeds for its reset (data.load_rows)
# With --dataset none the training rows are this many seeds 0, 1, ...: a fixed number, not one derived from
# --max_steps, which a resume may change.
NO_DATASET_STARTS = 2 ** 16


def loss_types() -> dict:
    """grpo.LOSSES: each --loss_type's objective and aggregation. Imported when asked, not with this file:
    grpo imports torch, which the processes that read this file and never train (the reward functions') do
    without."""
    from grpo import LOSSES
    return LOSSES


class UsageError(ValueError):
    """A mistake in the flags or the inputs, found before training starts (a flag, a file, a column, the
    server's address): train.py and vllm_server.py print its message as one line and exit with code 2, as
    argparse does for a flag it cannot parse. Every other error keeps its traceback."""


class RunStopped(RuntimeError):
    """A stop mid-run that the code foresees and explains: the server gone and not back, the loss non-finite
    step after step, a reward function that returns what cannot be rewards or no longer scores anything, the
    server computing with other weights than ours. Printed as `stopped: ...` (the message says what was saved
    and what to do) with exit code 3, without a traceback of our code."""


class SignalStop(BaseException):
    """A stop signal (SIGTERM, the first Ctrl-C) ended the run, after it saved what it had (the message says
    what): printed by rank 0 as it is, with exit code 0, as a stop seen at the end of a step. Not an
    Exception, as KeyboardInterrupt is not: no handler of errors (a dry run's check, a reward function's)
    takes it for one."""


class Interrupted(Exception):
    """A stop signal arrived while the step waited (for a rollout, the reward functions): what it waited for
    is abandoned, and the run saves its last completed step and stops (guard.ServerGuard)."""


STOP = threading.Event()  # set by a stop signal (checkpoints.StopRequest); it ends the step's waits


def run_main(main, *args):
    """main(*args), with a UsageError printed as one line, `error: ...`, and exit code 2, a RunStopped as
    `stopped: ...` and exit code 3 (no traceback), a SignalStop as its message and exit code 0; every other
    error keeps its traceback."""
    where = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    try:
        main(*args)
    except UsageError as e:
        print(f"error{where}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RunStopped as e:
        print(f"stopped{where}: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except SignalStop as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(e, flush=True)
        sys.exit(0)


@dataclass
class Config:
    # model and data
    model: str = DEFAULT_MODEL  # "smollm2-135m" (embedded), a Hugging Face model id, or a local folder
    dataset: str = DEFAULT_DATASET  # "arithmetic" (embedded), a hub dataset name (or a local folder laid out
                                    # as one), or a local .json/.jsonl/.parquet file; "none" with an --env
                                    # that makes its prompts; "parity", "shapes": embedded tasks (each sets
                                    # the flags of EMBEDDED_TASKS not given); a mixture of several:
                                    # source[:weight],... or a mixture file, .yaml/.json (README: Task
                                    # mixtures)
    dataset_split: str = "train"  # split of a hub dataset
    prompt_column: str = ""  # column with the prompt: text or chat messages; "" = "prompt", else "question"
    answer_column: str = "answer"  # column of the reference answer, optional; the reward functions get it
                                   # as `answer` too (the built-in accuracy reads "#### 42" as 42)
    system_prompt: str = ""  # optional system message before every prompt; "" = the model's default
    max_prompt_length: int = 512  # tokens; a longer prompt is an error at start (it says what to change)
    num_arithmetic_problems: int = 5000  # size of the embedded task's training set (arithmetic, shapes)
    # generation (on the vLLM server)
    num_generations: int = 8  # G: completions per prompt; the group for the advantage baseline
    prompts_per_step: int = 6  # prompts per optimizer step, over all ranks (so G * this completions); tuned*
    max_completion_length: int = 40  # tokens per completion; longer ones are cut ("length" finish); tuned*
    temperature: float = 1.0  # sampling temperature; the trainer's log-probs use the same one
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = -1  # sample from the k most likely tokens; -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one; 0 = off
    repetition_penalty: float = 1.0  # > 1 discourages repeated tokens; 1.0 = off
    vllm_structured_outputs_regex: str = ""  # every completion matches this regular expression (the server's
                                             # structured outputs); "" = off. README: Loss choices, on what it
                                             # does to the importance weights
    rollout: str = ""  # your own rollout function, module:function (README: Rollouts); "" = rollout.generate
    tools: str = ""  # tools the model may call, module:function,... (README: Environments and tools)
    env: str = ""  # an environment, module:factory: one instance per trajectory, whose public methods are
                   # its tools; or an embedded one: calculator, guess (each sets the flags of
                   # EMBEDDED_ENVIRONMENTS not given); or several, name=factory,... (TRL's dict): each row's
                   # `environment` column picks one
    max_tool_calling_iterations: int = 5  # tool rounds per trajectory (TRL: no limit)
    tool_timeout: float = 30.0  # seconds a tool call may take; then it answers with an error
    tool_call_parser: str = "auto"  # what reads the model's tool calls: a name `vllm serve --tool-call-parser`
                                    # takes (hermes, llama3_json, mistral, openai, glm45, gemma4, ...), hf
                                    # (transformers' parse_response), or auto: the one that reads back a call the
                                    # chat template writes (README: Environments and tools)
    chat_template: str = ""  # a Jinja chat template file instead of the model's (e.g. one that renders tools)
    async_generation: bool = False  # sample step t+1 while step t trains, with older weights (1 step stale)
    max_staleness: int = 1  # with --async_generation: K, the batches sampled ahead. K = 1: each batch comes
                            # from one policy (the push waits for it); K > 1: up to K in flight, and pushes
                            # land while they are sampled (the server pauses them), so a batch's tokens may
                            # come from up to K policies; a batch older than K is dropped and counted
    # GRPO
    beta: float = 0.0  # KL penalty coefficient (k3 estimator); 0 = no reference model is loaded
    sync_ref_model: bool = False  # TR-DPO, as TRL (needs beta > 0): every --ref_model_sync_steps optimizer
                                  # steps the reference moves toward the policy:
                                  # ref = alpha * policy + (1 - alpha) * ref
    ref_model_mixup_alpha: float = 0.6  # TR-DPO: the alpha of ref = alpha * policy + (1 - alpha) * ref
    ref_model_sync_steps: int = 512  # TR-DPO: mix the policy into the reference every N optimizer steps
    epsilon: float = 0.2  # clip range of the ratio: [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float = -1.0  # upper clip; -1 = same as epsilon (DAPO's clip-higher uses e.g. 0.28)
    delta: float = 0.0  # also cap the unclipped ratio at delta (two-sided clip, INTELLECT-2; e.g. 4); 0 = off
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo | vespo
                             # (README: Loss choices; grpo.LOSSES)
    sapo_temperature_pos: float = 1.0  # sapo: the gate's temperature for tokens with positive advantage
    sapo_temperature_neg: float = 1.05  # sapo: the gate's temperature for advantages <= 0
    vespo_k_pos: float = 2.0  # vespo: k of the gamma weight w^k e^(-lambda w), for positive advantages
    vespo_lambda_pos: float = 3.0  # vespo: its decay lambda, for positive advantages
    vespo_k_neg: float = 3.0  # vespo: k for negative advantages
    vespo_lambda_neg: float = 2.0  # vespo: lambda for negative advantages
    importance_sampling_level: str = "token"  # token | sequence (GSPO): the ratio pi / pi_old per token or
                                              # per sequence (its tokens' geometric mean), clipped as one
    scale_rewards: str = "group"  # group | batch | none: whose std divides the advantages (none: no division)
    multi_objective_aggregation: str = "sum_then_normalize"  # weigh and sum the rewards, then normalize the
                                                # sum in the group | normalize_then_sum (GDPO): normalize each
                                                # function's rewards in the group, weigh and sum them,
                                                # normalize over the batch
    num_iterations: int = 1  # mu: passes over each generation batch (> 1 makes updates off-policy)
    steps_per_generation: int = 1  # optimizer steps per generation batch, each on a slice (> 1: off-policy)
    vllm_importance_sampling_correction: bool = True  # weight tokens by pi_old / pi_vLLM (the sampler)
    vllm_importance_sampling_mode: str = "token_truncate"  # token_truncate | token_mask | sequence_truncate
                                                           # | sequence_mask
    vllm_importance_sampling_kl: bool = False  # weight the KL term by the sampler correction too (off in TRL)
    use_bias_correction_kl: bool = True  # multiply the KL term by pi / pi_old (DeepSeek-V3.2; TRL's default)
    vllm_importance_sampling_clip_min: float = 0.0  # the sampler weight's floor: truncate modes clamp to it,
                                                    # mask modes drop tokens (sequences) below it; 0 = none
    vllm_importance_sampling_clip_max: float = 2.0  # the sampler weight's ceiling: truncate modes clamp to it,
                                                    # mask modes drop tokens (sequences) above it; inf = none
    vllm_importance_sampling_cap: float = -1.0  # deprecated (as in TRL): the old name of
                                                # --vllm_importance_sampling_clip_max
    off_policy_mask_threshold: float = -1.0  # drop from the policy term sequences with negative advantage
                                             # whose mean log(pi_vLLM / pi) exceeds this (DeepSeek-V3.2);
                                             # < 0 = off
    top_entropy_quantile: float = 1.0  # train the policy term on the top rho of the step's tokens by entropy
                                       # (Beyond the 80/20 Rule, rho = 0.2); 1 = all
    entropy_coef: float = 0.0  # entropy bonus: the loss minus coef * the mean entropy of the trained tokens
    use_adaptive_entropy: bool = False  # Skywork-OR1, as TRL: after each optimizer step the coefficient moves
                                        # by --entropy_coef_delta, up while the step's entropy is at or below
                                        # --entropy_target, down while above; it applies only at or below it
    entropy_coef_min: float = 0.0  # adaptive: the coefficient's floor
    entropy_coef_max: float = 1.0  # adaptive: its ceiling
    entropy_coef_delta: float = 0.005  # adaptive: its move per optimizer step
    entropy_target: float = 0.2  # adaptive: the mean entropy of the trained tokens to hold (nats per token)
    dynamic_sampling: bool = False  # DAPO: replace groups whose rewards all agree by more, sampled until the
                                    # batch is filled with groups whose rewards differ
    dynamic_sampling_max_rounds: int = 3  # --dynamic_sampling: at most this many extra rounds per step
    drop_zero_std_groups: bool | str = "auto"  # skip the forward/backward of groups with equal rewards: true
                                              # | false | auto = where the gradient stays exactly the same
                                              # (beta 0, no entropy bonus, not bnpo)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length get no loss (DAPO)
    reward_funcs: str = "accuracy,format"  # comma-separated names from rewards.py
    reward_weights: str = ""  # comma-separated floats, one per reward function; "" = all 1.0
    reward_postprocess: str = ""  # module:function(matrix, names, tasks) -> matrix, run on the (N, k) reward
                                  # matrix before weighting; "" = rewards.postprocess_rewards (the identity)
    overlong_max_length: int = 0  # overlong_penalty: -1 at this many tokens; 0 = --max_completion_length
    overlong_buffer_length: int = 0  # overlong_penalty: it falls from 0 to -1 over this many tokens before
                                     # that length; 0 = a fifth of it
    max_unscored_steps: int = 5  # stop after this many steps in a row in which a reward function failed on
                                 # every completion, or none was scored; 0 = never
    reward_timeout: float = 60  # seconds the reward functions may take on one batch; then the batch goes
                                # unscored (a slow judge)
    # optimization
    max_steps: int = 36  # optimizer steps (= generation rounds); tuned*
    learning_rate: float = 5e-5  # peak AdamW learning rate; tuned* (TRL's default is 1e-6, for larger
                                 # models); the embedded arithmetic task sets 7e-5, linear (EMBEDDED_TASKS)
    lr_scheduler_type: str = "constant"  # constant | linear | cosine (decay to 0 at max_steps)
    warmup_steps: int = 0  # linear warmup from 0
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.99  # AdamW beta2
    max_grad_norm: float = 1.0  # gradient clipping; 0 = off
    micro_batch_size: int = 16  # completions per forward/backward pass (memory knob; never changes the math)
    disable_dropout: bool = True  # no dropout in the training forward (the model's and LoRA's): the policy
                                  # trained is the one that sampled (README: Loss choices)
    cast_lm_head_to_fp32: bool = False  # the lm head's matmul in fp32 under --bf16 (ScaleRL): the logits,
                                        # log-probs and their gradient without bf16 rounding
    gradient_checkpointing: bool = True  # recompute activations in the backward: less memory (docs/memory.md)
    bf16: bool | str = "auto"  # bf16 autocast, fp32 master weights: true | false | auto = where the
                               # hardware computes in bf16 (GPU, avx512_bf16)
    seed: int = 42  # data order, and the server's sampling: each request carries a seed derived from it
    # scale-out and LoRA
    fsdp: bool = False  # shard the policy (and reference) with FSDP2 per decoder layer instead of DDP copies;
                        # needs torchrun
    use_peft: bool = False  # train a LoRA adapter, not all weights; the reference is the base (adapter off)
    lora_r: int = 16  # LoRA rank
    lora_alpha: float = 32.0  # LoRA scaling numerator: the update is B A * lora_alpha / lora_r
    lora_dropout: float = 0.05  # dropout on the adapter's input while training (off with --disable_dropout)
    lora_target_modules: str = "all-linear"  # comma-separated module names (e.g. q_proj,v_proj) or all-linear
    lora_sync: str = "auto"  # what a push sends: adapter (the adapter alone; the server runs --enable-lora),
                             # merged (every weight, the adapter merged in), auto: the adapter where the
                             # server can take it
    save_merged_model: bool = False  # with --use_peft, also save the merged model (output_dir/model)
    freeze_vision_tower: bool = True  # a vision-language model's vision encoder and connector stay as loaded
                                      # (not trained, no LoRA adapter, pushed once); false trains them too
    vision_learning_rate: float = 0.0  # peak learning rate of a trained vision encoder and connector (as
                                       # LLaVA's mm_projector_lr); 0 = --learning_rate
    # server
    vllm_server_host: str = "127.0.0.1"  # where vllm_server.py listens
    vllm_server_port: int = 8000  # the --port of vllm_server.py
    vllm_server_timeout: float = 300  # seconds to wait for the server at start, or to come back mid-run
    vllm_request_timeout: float = 0  # seconds a request may take; 0 = no limit (/health finds a dead server)
    vllm_group_host: str = "127.0.0.1"  # rank 0's address as the server sees it (weight-sync rendezvous)
    vllm_group_port: int = 51216  # TCP port of that rendezvous, hosted by trainer rank 0
    weight_sync_bucket_mb: float = 64  # weights leave the trainer packed in buckets of this size
    sync_check_steps: int = 1  # compare a fixed probe's log-probs with the server's every N steps; 0 = never
    sync_check_tolerance: float = -1.0  # stop if the probe's mean |log-prob diff| (nats) is above this;
                                        # -1 = 1e-3 in fp32, 0.5 in bf16
    # evaluation (through the same server, on prompts training never sees)
    eval_steps: int = -1  # -1 = before training and at the end, if there is a held-out set (below); N = also
                          # every N steps; 0 = never
    eval_dataset: str = ""  # "" = the held-out split: the embedded task's own, or (with --eval_steps N)
                            # --eval_split of a hub --dataset
    eval_split: str = "test"  # split of the hub dataset to evaluate on
    eval_num_prompts: int = 64  # the first N prompts of the evaluation set, the same ones every time
    num_generations_eval: int = 4  # completions per evaluation prompt (n of pass@k; TRL: --num_generations)
    eval_pass_k: str = "1,4"  # comma-separated k of pass@k (unbiased estimator); a completion is correct
                              # where its task's first reward function gives >= 1
    # output
    output_dir: str = "out"  # metrics.jsonl and the final model folder go here
    save_model: bool = True  # save at the end: output_dir/model (a Hugging Face folder), or
                             # output_dir/adapter with LoRA
    save_steps: int = 0  # write output_dir/checkpoint-N every N steps and at the end (model, optimizer,
                         # RNG...); 0 = never
    save_total_limit: int = 2  # keep the newest N checkpoints; 0 = keep all
    resume_from_checkpoint: str = ""  # continue a run exactly: a checkpoint folder, or "latest" in output_dir
    report_to: str = "none"  # none | wandb
    wandb_project: str = "nanogrpo"  # with --report_to wandb
    run_name: str = ""  # wandb run name; "" = wandb's default
    dry_run: bool = False  # check in about a minute what would fail at step 1 or hang (server, template,
                           # rewards, a push with the probe, a step's peak memory), then stop; nothing is
                           # trained or saved
    # (not a flag) the flags given on the command line, set by parse_config; None in a Config made in code
    given: typing.ClassVar[frozenset | None] = None

    def gives(self, name: str) -> bool:
        """Whether flag `name` was given on the command line (an embedded task's own value was not), or, in a
        Config made in code, differs from its default (so --reward_funcs accuracy,format, the default's value,
        given to tasks with rewards of their own is refused, not ignored)."""
        return name in self.given if self.given is not None else getattr(self, name) != getattr(Config, name)

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high < 0 else self.epsilon_high

    def reward_names(self) -> list[str]:
        return [n.strip() for n in self.reward_funcs.split(",") if n.strip()]

    def sampling(self) -> dict:
        """The sampling parameters of every request to the server."""
        return dict(max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                    structured_outputs_regex=self.vllm_structured_outputs_regex)

    def probe_tolerance(self, exact: bool) -> float:
        """--sync_check_tolerance, or by default 1e-3 where both sides compute in fp32 (`exact`), else 0.5."""
        return self.sync_check_tolerance if self.sync_check_tolerance >= 0 else (1e-3 if exact else 0.5)

    def kv_cache_bytes(self, model_dir: str, dtype_bytes: int, max_model_len: int, block: int = 128) -> int | None:
        """The server's KV cache for what a step samples at once: every sequence at its longest (the prompt
        bound + a full completion, in blocks of `block` tokens), --max_staleness batches with
        --async_generation, and one sequence of `max_model_len` at least; an evaluation larger than that runs
        in waves. From the model's config.json (a VLM's text model); None if it does not say."""
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                c = json.load(f)
            c = c.get("text_config", c)
            heads = c["num_attention_heads"]
            per_token = (2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads)
                         * (c.get("head_dim") or c["hidden_size"] // heads) * dtype_bytes)
        except (OSError, KeyError, TypeError, ValueError):
            return None
        sequences = self.prompts_per_step * self.num_generations * (self.max_staleness if self.async_generation else 1)
        longest = -(-(self.max_prompt_length + self.max_completion_length) // block) * block
        return max(sequences * longest, max_model_len) * per_token

    def pass_k(self) -> list[int]:
        """The k of pass@k, 1 always among them (pass@1 is the summary's accuracy)."""
        return sorted({1, *(int(k) for k in self.eval_pass_k.split(",") if k.strip())})

    def evaluates(self) -> bool:
        """Whether the run evaluates: --eval_steps N > 0, or -1 (the default) where a held-out set is at hand
        without asking (the embedded task's, or --eval_dataset); a hub dataset's split is loaded only when
        asked."""
        at_hand = self.dataset in (DEFAULT_DATASET, NO_DATASET, *EMBEDDED_TASKS) or bool(self.eval_dataset)
        if is_mixture_spec(self.dataset) or "=" in self.env:  # each task has its own (mixture.load_mixture)
            return self.eval_steps != 0
        return self.eval_steps > 0 or (self.eval_steps == -1 and at_hand)

    def eval_every(self) -> int:
        """Evaluate after every this many steps (and always after the last)."""
        return self.eval_steps if self.eval_steps > 0 else self.max_steps

    def drops_zero_std_groups(self) -> bool:
        """--drop_zero_std_groups, auto resolved: on where it changes nothing in the gradient. A group whose
        rewards agree has zero advantages, so its policy term is 0 (for the objectives whose row in grpo.LOSSES
        says so); but not its KL term (beta > 0) or entropy bonus, and bnpo normalises per micro-batch, which
        dropping rows reshapes."""
        if self.drop_zero_std_groups == "auto":
            loss = loss_types()[self.loss_type]
            return (self.beta == 0 and self.entropy_coef == 0 and not self.use_adaptive_entropy
                    and loss.aggregation != "bnpo" and loss.zero_without_advantage)
        return self.drop_zero_std_groups

    def collective_timeout(self) -> float:
        """Seconds a collective may wait for a rank (gloo's default is 30 min): longer than a rank can spend
        on one call to the server while the others wait for it (--vllm_server_timeout for a lost server, one
        request)."""
        return max(1800.0, self.vllm_server_timeout + 300, self.vllm_request_timeout + 300)

    def reward_options(self) -> dict:
        """The settings of built-in reward functions, by name (bound as keyword arguments)."""
        longest = self.overlong_max_length or self.max_completion_length
        buffer = self.overlong_buffer_length or longest // 5  # DAPO's ratio: 4096 of 20480 tokens
        return {"overlong_penalty": {"max_length": longest, "buffer_length": buffer}}

    def reward_weight_list(self) -> list[float]:
        if not self.reward_weights.strip():
            return [1.0] * len(self.reward_names())
        return [float(w) for w in self.reward_weights.split(",")]

    def validate(self, world_size: int = 1):
        """Raise UsageError with a message that says what to change."""
        errors = []
        if self.num_generations < 2:
            errors.append(f"--num_generations {self.num_generations}: GRPO needs at least 2 completions per prompt "
                          "to compare them; use 2 or more (8 is typical)")
        if self.prompts_per_step < 1 or self.prompts_per_step % world_size:
            errors.append(f"--prompts_per_step {self.prompts_per_step} must be a positive multiple of the number of "
                          f"processes ({world_size}): each rank samples whole groups")
        for name in ("max_completion_length", "max_steps", "micro_batch_size", "max_prompt_length"):
            if getattr(self, name) < 1:
                errors.append(f"--{name} must be at least 1")
        if self.beta < 0:
            errors.append(f"--beta {self.beta} must be >= 0")
        if self.epsilon <= 0 or self.eps_high <= 0:
            errors.append("--epsilon and --epsilon_high must be > 0 (epsilon_high -1 means 'same as epsilon')")
        if self.temperature <= 0:
            errors.append("--temperature must be > 0 (GRPO needs sampled, different completions)")
        if not 0 < self.top_p <= 1:
            errors.append("--top_p must be in (0, 1]")
        if self.learning_rate <= 0:
            errors.append("--learning_rate must be > 0")
        if self.delta < 0 or 0 < self.delta <= 1 + self.eps_high:
            errors.append(f"--delta {self.delta} must be 0 (off) or above 1 + epsilon_high ({1 + self.eps_high})")
        if self.importance_sampling_level not in ("token", "sequence"):
            errors.append(f"--importance_sampling_level {self.importance_sampling_level!r}: use token or sequence")
        if self.loss_type not in loss_types():
            errors.append(f"--loss_type {self.loss_type!r}: use {', '.join(loss_types())} (grpo.LOSSES)")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            errors.append("--loss_type vespo weighs each sequence by its own sequence ratio: leave "
                          "--importance_sampling_level token")
        if self.loss_type == "vespo" and self.vllm_importance_sampling_mode.startswith("sequence"):
            errors.append("--loss_type vespo takes the sampler correction token by token into its sequence weight: use "
                          "--vllm_importance_sampling_mode token_truncate or token_mask (as TRL)")
        if self.loss_type == "vespo" and min(self.vespo_lambda_pos, self.vespo_lambda_neg) <= 0:
            errors.append("--vespo_lambda_pos and --vespo_lambda_neg must be > 0")
        if self.dynamic_sampling_max_rounds < 1:
            errors.append("--dynamic_sampling_max_rounds must be at least 1")
        if not 0 < self.top_entropy_quantile <= 1:
            errors.append(f"--top_entropy_quantile {self.top_entropy_quantile:g} must be in (0, 1] (1 = every token)")
        if (self.entropy_coef != 0 or self.use_adaptive_entropy) and self.drop_zero_std_groups is True:
            errors.append("--drop_zero_std_groups skips groups whose loss has no gradient, but the entropy bonus "
                          "gives them one: drop one of them")
        if self.use_adaptive_entropy and not (0 <= self.entropy_coef_min <= self.entropy_coef_max
                                              and self.entropy_coef_delta >= 0):
            errors.append("--use_adaptive_entropy needs 0 <= --entropy_coef_min <= --entropy_coef_max and "
                          "--entropy_coef_delta >= 0")
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            errors.append(f"--multi_objective_aggregation {self.multi_objective_aggregation!r}: use "
                          "sum_then_normalize or normalize_then_sum (GDPO)")
        elif self.multi_objective_aggregation == "normalize_then_sum" and self.gives("scale_rewards"):
            errors.append("--multi_objective_aggregation normalize_then_sum normalizes each reward in its group and "
                          "their sum over the batch (as TRL): --scale_rewards does not apply; leave it out")
        if self.sync_ref_model and (self.beta == 0 or self.use_peft):
            errors.append("--sync_ref_model moves the reference model toward the policy, but there is none to move: "
                          + ("set --beta > 0" if self.beta == 0 else "with --use_peft the reference is the base "
                             "model itself (as TRL, not supported); train all weights"))
        if self.sync_ref_model and not (0 < self.ref_model_mixup_alpha <= 1 and self.ref_model_sync_steps >= 1):
            errors.append("--sync_ref_model needs 0 < --ref_model_mixup_alpha <= 1 and --ref_model_sync_steps >= 1")
        if self.vllm_structured_outputs_regex:
            try:
                re.compile(self.vllm_structured_outputs_regex)
            except re.error as e:
                errors.append(f"--vllm_structured_outputs_regex {self.vllm_structured_outputs_regex!r} is not a "
                              f"regular expression: {e}")
        if self.loss_type == "cispo" and self.eps_high <= 1:
            errors.append(f"--loss_type cispo caps the importance weight at --epsilon_high, an absolute bound (now "
                          f"{self.eps_high:g}, which would cap every weight below 1): set it, e.g. --epsilon_high 5 "
                          "(ScaleRL's choice)")
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            errors.append("--loss_type luspo is GSPO's loss with each sequence weighed by its length: use it with "
                          "--importance_sampling_level sequence")
        if self.loss_type == "sapo" and min(self.sapo_temperature_pos, self.sapo_temperature_neg) <= 0:
            errors.append("--sapo_temperature_pos and --sapo_temperature_neg must be > 0")
        if self.scale_rewards not in ("group", "batch", "none"):
            errors.append(f"--scale_rewards {self.scale_rewards!r}: use group, batch or none")
        if self.repetition_penalty <= 0 or not 0 <= self.min_p < 1 or self.top_k == 0:
            errors.append("--repetition_penalty must be > 0, --min_p in [0, 1), --top_k -1 (off) or >= 1")
        if self.num_iterations < 1 or self.steps_per_generation < 1:
            errors.append("--num_iterations and --steps_per_generation must be at least 1")
        elif self.prompts_per_step % world_size == 0 and (self.prompts_per_step // world_size * self.num_generations) \
                % self.steps_per_generation:
            errors.append(f"--steps_per_generation {self.steps_per_generation} must divide the completions per rank "
                          f"({self.prompts_per_step // world_size * self.num_generations} = prompts_per_step / "
                          "processes * num_generations)")
        modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
        if self.vllm_importance_sampling_mode not in modes:
            errors.append(f"--vllm_importance_sampling_mode {self.vllm_importance_sampling_mode!r}: use "
                          "token_truncate, token_mask, sequence_truncate or sequence_mask")
        if self.async_generation and not self.vllm_importance_sampling_correction:
            errors.append("--async_generation trains on completions sampled by the previous weights, which needs the "
                          "importance-sampling correction: drop --vllm_importance_sampling_correction false")
        if self.max_staleness < 1 or self.max_staleness > 1 and not self.async_generation:
            errors.append(f"--max_staleness {self.max_staleness}: the batches sampled ahead, at least 1; above 1 it "
                          "needs --async_generation")
        if self.vllm_importance_sampling_cap >= 0:  # TRL's old name is still taken, with a warning
            if int(os.environ.get("RANK", 0)) == 0:
                print("warning: --vllm_importance_sampling_cap is deprecated (as in TRL): use "
                      "--vllm_importance_sampling_clip_max", file=sys.stderr, flush=True)
            self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_cap = (
                self.vllm_importance_sampling_cap, -1)
        if not 0 <= self.vllm_importance_sampling_clip_min < 1 < self.vllm_importance_sampling_clip_max:
            errors.append(f"--vllm_importance_sampling_clip_min {self.vllm_importance_sampling_clip_min:g} and "
                          f"--vllm_importance_sampling_clip_max {self.vllm_importance_sampling_clip_max:g}: the bounds "
                          "must hold 1 (a weight of 1 is no correction), min >= 0")
        if self.lr_scheduler_type not in ("constant", "linear", "cosine"):
            errors.append(f"--lr_scheduler_type {self.lr_scheduler_type!r}: use constant, linear or cosine")
        if self.report_to not in ("none", "wandb"):
            errors.append(f"--report_to {self.report_to!r}: use none or wandb")
        if "overlong_penalty" in self.reward_names():
            lengths = self.reward_options()["overlong_penalty"]
            if not 0 < lengths["buffer_length"] <= lengths["max_length"] or self.overlong_max_length < 0:
                errors.append(f"--overlong_buffer_length {lengths['buffer_length']} must be in [1, the max length "
                              f"{lengths['max_length']}] (--overlong_max_length, 0 = --max_completion_length)")
            elif lengths["max_length"] - lengths["buffer_length"] >= self.max_completion_length:
                errors.append(f"overlong_penalty would never penalise: completions stop at --max_completion_length "
                              f"{self.max_completion_length}, before its penalty starts at "
                              f"{lengths['max_length'] - lengths['buffer_length']} tokens; lower --overlong_max_length")
        if not self.reward_names() and not self.env and not is_mixture_spec(self.dataset):
            errors.append("--reward_funcs is empty: name at least one reward function (see rewards.py)")
        if NO_DATASET in (self.dataset, self.eval_dataset) and not self.env:
            errors.append(f"--dataset {NO_DATASET}: only an --env makes its own prompts (its reset(**row) gets a seed "
                          "and returns the prompt); name a dataset, or the environment")
        if self.rollout and (self.tools or self.env):
            errors.append("--rollout replaces the rollout that runs --tools and --env: give one or the other")
        if self.max_tool_calling_iterations < 0 or self.tool_timeout <= 0:
            errors.append("--max_tool_calling_iterations must be >= 0 and --tool_timeout > 0")
        try:
            weights = self.reward_weight_list()
            if len(weights) != len(self.reward_names()):
                errors.append(f"--reward_weights has {len(weights)} values but --reward_funcs names "
                              f"{len(self.reward_names())} functions: give one weight per function")
        except ValueError:
            errors.append(f"--reward_weights {self.reward_weights!r}: use comma-separated numbers, e.g. 1.0,0.5")
        lora_flags = [f"--{f.name}" for f in dataclasses.fields(self) if f.name.startswith("lora_")
                      or f.name == "save_merged_model" if getattr(self, f.name) != f.default]
        if lora_flags and not self.use_peft:
            errors.append(f"{', '.join(lora_flags)} only apply to LoRA training: add --use_peft, or drop them")
        if self.lora_sync not in ("auto", "adapter", "merged"):
            errors.append(f"--lora_sync {self.lora_sync!r}: choose auto, adapter or merged")
        if self.use_peft and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            errors.append("--lora_r must be >= 1, --lora_alpha > 0 and --lora_dropout in [0, 1)")
        if self.eval_steps < -1 or self.eval_num_prompts < 1 or self.num_generations_eval < 1:
            errors.append("--eval_steps must be -1 (before and after training), 0 (never) or N > 0 (also every N "
                          "steps); --eval_num_prompts and --num_generations_eval >= 1")
        try:
            if any(not 1 <= k <= self.num_generations_eval for k in self.pass_k()):
                errors.append(f"--eval_pass_k {self.eval_pass_k}: each k must be between 1 and --num_generations_eval "
                              f"({self.num_generations_eval})")
        except ValueError:
            errors.append(f"--eval_pass_k {self.eval_pass_k!r}: use comma-separated integers, e.g. 1,8")
        if self.eval_steps > 0 and not self.eval_dataset and os.path.isfile(self.dataset) \
                and not is_mixture_spec(self.dataset):
            errors.append(f"--eval_steps with a local --dataset {self.dataset}: it has no held-out split; give "
                          "--eval_dataset (a .jsonl/.json/.parquet file with the same columns)")
        if self.fsdp and "RANK" not in os.environ:
            errors.append("--fsdp shards the model over processes: launch with torchrun --nproc_per_node N (README: "
                          "FSDP2 and LoRA), or drop --fsdp")
        if self.vision_learning_rate < 0:
            errors.append("--vision_learning_rate must be >= 0 (0: the same as --learning_rate)")
        if self.vision_learning_rate > 0 and self.freeze_vision_tower:
            errors.append("--vision_learning_rate applies to a vision tower that trains: add --freeze_vision_tower "
                          "false, or drop --vision_learning_rate")
        if self.num_arithmetic_problems < 1:
            errors.append("--num_arithmetic_problems must be at least 1")
        if self.vllm_server_timeout < 0 or self.vllm_request_timeout < 0:
            errors.append("--vllm_server_timeout and --vllm_request_timeout must be >= 0 (seconds; a request: 0 = no "
                          "limit)")
        if self.max_unscored_steps < 0:
            errors.append("--max_unscored_steps must be >= 0 (0 = never stop)")
        if self.reward_timeout <= 0:
            errors.append("--reward_timeout must be > 0 (seconds)")
        if self.save_steps < 0 or self.save_total_limit < 0:
            errors.append("--save_steps and --save_total_limit must be >= 0 (0 = never / keep all)")
        if errors:
            raise UsageError("invalid configuration: " + errors[0] if len(errors) == 1 else
                             "invalid configuration:\n  - " + "\n  - ".join(errors))


@functools.lru_cache(maxsize=8)  # read once at start (validate, evaluates and mixture.py all ask)
def is_mixture_spec(dataset: str) -> bool:
    """Whether --dataset names a mixture of tasks (mixture.py): a mixture file (.yaml/.yml, or a .json that
    holds one object with `tasks`), or, when it is no file or folder, sources with a comma, a weight
    (source:0.5) or a name (name=source)."""
    if dataset.endswith((".yaml", ".yml")):
        return True
    if os.path.exists(dataset):
        if not (dataset.endswith(".json") and os.path.isfile(dataset)):
            return False
        with open(dataset) as f:  # a mixture file, or a dataset of records
            if '"tasks"' not in f.read(1024):
                return False
            f.seek(0)
            try:
                spec = json.load(f)
            except ValueError:  # not one JSON document: JSON lines
                return False
        return isinstance(spec, dict) and isinstance(spec.get("tasks"), list) and all(
            isinstance(task, dict) for task in spec["tasks"])
    return "," in dataset or "=" in dataset or split_weight(dataset)[1] is not None


def split_weight(spec: str) -> tuple[str, str | None]:
    """"source:0.5" -> ("source", "0.5"); ("source", None) if what follows the last colon is no number."""
    source, colon, weight = spec.rpartition(":")
    try:
        float(weight)
    except ValueError:
        return spec, None
    return (source, weight.strip()) if colon and source else (spec, None)


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _parse_bool_or_auto(s: str) -> bool | str:
    if s.lower() == "auto":
        return "auto"
    try:
        return _parse_bool(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got {s!r}") from None


def _field_comments() -> dict[str, str]:
    """The trailing comment of each field above, used as its --help text; it goes on in comment lines
    indented deeper than the field."""
    comments, field = {}, None
    with open(os.path.abspath(__file__)) as f:
        for line in f:
            text = line.strip()
            if field and text.startswith("#") and len(line) - len(line.lstrip()) > 4:
                comments[field] += " " + text.lstrip("# ")
                continue
            name, _, rest = text.partition(":")
            field = name if name.isidentifier() and "  # " in rest else None
            if field:
                comments[field] = rest.split("  # ", 1)[1]
    return {name: help.replace("%", "%%") for name, help in comments.items()}  # argparse %-formats help texts


TUNED = ("tuned*: these defaults were tuned for the embedded run (bash run.sh: SmolLM2-135M on the embedded "
         "arithmetic task, on 2 CPU cores within 10 minutes), so that its held-out accuracy rises; for your model and "
         "data, start from TRL's or your paper's values (README: The default run).")


def parse_config(argv: list[str] | None = None) -> Config:
    """Config from the command line: `--name value` for every field; bools take `--bf16 false` or
    `--no_bf16`."""
    argv = sys.argv[1:] if argv is None else argv
    args = vars(_parser().parse_args(argv))
    given = vars(_parser(defaults=False).parse_args(argv))  # abbreviated flags too, as argparse takes them
    flags = {}  # an embedded environment's or task's flags, where they are not given
    if args["env"] in EMBEDDED_ENVIRONMENTS:  # an embedded environment: its factory and flags
        args["env"], flags = EMBEDDED_ENVIRONMENTS[args["env"]]
    if not args["env"]:  # a task's flags only without an --env, which makes its own conversation
        flags = flags | EMBEDDED_TASKS.get(args["dataset"], {})
    if "reward_funcs" in given:  # your functions: a preset's weights were for its own, so they are dropped
        flags = {name: value for name, value in flags.items() if name != "reward_weights"}
    args |= {name: value for name, value in flags.items() if name not in given}
    cfg = Config(**args)
    cfg.given = frozenset(given)
    return cfg


def _parser(defaults: bool = True) -> argparse.ArgumentParser:
    """The command line's parser: a flag for every Config field; without defaults, it parses to only the flags
    given."""
    parser = argparse.ArgumentParser(description="nanogrpo: GRPO training with a vLLM server.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, epilog=TUNED)
    comments = _field_comments()
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        kind, default = hints[f.name], f.default if defaults else argparse.SUPPRESS
        if kind is bool or kind == bool | str:  # bool | str: true, false or "auto"
            parser.add_argument(f"--{f.name}", type=_parse_bool if kind is bool else _parse_bool_or_auto, nargs="?",
                                const=True, default=default, help=comments.get(f.name, ""))
            parser.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=argparse.SUPPRESS,
                                **({} if defaults else {"default": argparse.SUPPRESS}))
        else:
            parser.add_argument(f"--{f.name}", type=kind, default=default, help=comments.get(f.name, ""))
    return parser


# The embedded environments (embedded.py; README: Environments and tools): --env NAME runs the factory with
# these flags, unless they are given.
EMBEDDED_ENVIRONMENTS = {
    # Both run on the embedded tool model, which writes its calls (embedded.build_tool_model), for 10 short
    # steps (README: Environments and tools). The calculator's reward is the answer's accuracy alone: with
    # format's point for a boxed answer, a wrong answer written at once scored above a call that went wrong,
    # and the first step taught the model to stop calling.
    "calculator": ("embedded:Calculator", {"model": TOOL_MODEL, "dataset": "three_digit", "reward_funcs": "accuracy",
                                           "learning_rate": 3e-5, "prompts_per_step": 4, "max_steps": 10,
                                           "max_completion_length": 128, "eval_num_prompts": 32}),
    "guess": ("embedded:Guess", {"model": TOOL_MODEL, "dataset": NO_DATASET, "reward_funcs": "", "learning_rate": 3e-5,
                                 "prompts_per_step": 4, "max_steps": 10, "max_completion_length": 192,
                                 "eval_num_prompts": 32}),
}

# The embedded tasks: --dataset NAME runs with these flags, unless they are given (not with an --env, which
# makes its own conversation and is scored by its own rewards).
EMBEDDED_TASKS = {
    # Sums (embedded.arithmetic_problems), answered in \boxed{} after the sum is written out, as the system
    # prompt shows (the model adds far better after "13 + 14 = " than right after "\boxed{"). A right answer
    # earns 1, and 1 more in the box; a wrong one, boxed or not, earns nothing; format is reported beside
    # them. A learning rate that decays to 0 keeps what the first steps learn (README: The default run).
    DEFAULT_DATASET: {"system_prompt": "Write the sum first, then the answer in \\boxed{}, like this: 12 + 9 = 21, so "
                                       "the answer is \\boxed{21}.",
                      "reward_funcs": "boxed_accuracy,format,accuracy", "reward_weights": "1,0,1",
                      "learning_rate": 7e-5, "lr_scheduler_type": "linear"},
    # Is a number even or odd (embedded.parity_problems)? The first of the two words in the answer is scored.
    "parity": {"reward_funcs": "choice"},
    # Sums of three-digit numbers (embedded.three_digit_problems): the calculator's task (--env calculator).
    "three_digit": {},
    # The embedded vision task (embedded.shape_problems): a small VLM learns to name the colour of a shape in
    # a picture.
    "shapes": {"model": EMBEDDED_VLM, "reward_funcs": "embedded:named_colour", "max_completion_length": 12,
               "max_steps": 30, "num_arithmetic_problems": 1000, "freeze_vision_tower": False},
}


# -----------------------------------------------------------------------------
# what --bf16 auto resolves to

def native_bf16(device) -> bool:
    """Whether `device` computes in bf16 at full speed: CUDA GPUs with bf16 (Ampere on), CPUs with
    avx512_bf16/AMX or ARM's bf16. Elsewhere bf16 is emulated: ~100x slower than fp32 on an AVX2-only
    CPU (measured), so `--bf16 auto` and the server's default dtype use fp32 there."""
    import torch
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()

