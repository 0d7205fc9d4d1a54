"""The policy and its reference as they train: loading a model, LoRA (peft), a vision-language model's frozen
vision tower, DDP or FSDP2 wrapping, reading full weights out of FSDP2 shards, and the optimizer with its
learning-rate schedule. Not here: the log-probs the models compute (logprobs.py), the weights' way to the
server (weight_sync.py).
"""
import math
import re
import os
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.fsdp import FSDPModule

from config import Config, RunStopped, UsageError
from utils import all_reduce, print0


def load_model(path: str, device, fsdp: bool = False, dtype=torch.float32):
    """A causal LM from a Hugging Face folder, on `device`. With FSDP2 (`fsdp`) only rank 0 reads the weights,
    on the CPU; the other ranks build the same model on the meta device (no memory), and `distribute` gives
    every rank its shard from rank 0's copy: no rank but the first ever holds the whole model. A read that
    failed on any rank stops every rank here, together (stop_unless_every_rank_read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one line per step on the console, no loading bars
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model, error = None, None
    # The ranks that read the weights: all of them, or under FSDP2 rank 0 alone.
    if not (fsdp and dist.is_initialized() and dist.get_rank() > 0):
        try:
            model = auto.from_pretrained(path, dtype=dtype)
        except Exception as e:  # a file cut short, say: every rank must hear of it, not wait for the weights
            error = e
    stop_unless_every_rank_read(error, path)
    if model is None:  # FSDP2, on a rank other than the first
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype)
    return model if fsdp else model.to(device)


# A weight file missing, cut short or damaged: the user's to replace (a UsageError, not a traceback).
WEIGHT_FILE_ERRORS = (OSError, SafetensorError)


def stop_unless_every_rank_read(error: Exception | None, path: str):
    """A collective every rank runs after reading the weights (under FSDP2 rank 0 alone reads), before any
    other: if the read failed on any rank, every rank raises here, the one that failed saying why. Before,
    under FSDP2 rank 0 alone stopped, and a dry run's check took it to its verdict (a collective) while the
    other ranks waited in shard_from_rank0's broadcast of its weights: every rank hung until the collective
    time-out (30 minutes)."""
    failed_anywhere = bool(all_reduce(torch.tensor([float(error is not None)]), dist.ReduceOp.MAX) > 0)
    if isinstance(error, WEIGHT_FILE_ERRORS):
        raise UsageError(f"the weights in {path} cannot be read ({type(error).__name__}: {error}): copy or download "
                         "the model's files again (one cut short or damaged, e.g. by an interrupted copy?)") from error
    if error is not None:  # an error not foreseen: its traceback says more
        raise error
    if failed_anywhere:
        raise RunStopped(f"reading the weights in {path} failed on another rank (its message says why)")


def disable_dropout(model):
    """Dropout off in every forward (--disable_dropout): nn.Dropout modules (LoRA's lora_dropout among them)
    drop nothing, and attention modules' dropout rates are 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def hf_model(model):
    """The transformers model inside DDP and peft wrappers (FSDP2 shards the module in place)."""
    model = getattr(model, "module", model)  # unwraps DDP
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # unwraps peft


def add_lora(model, r: int, alpha: float, dropout: float, target_modules: str, saved: str | None = None,
             exclude: list[str] | None = None):
    """Wrap `model` in a peft LoRA model: only the adapter trains; the base weights stay frozen. `saved`:
    an adapter folder to continue from (its own r, alpha and targets); `exclude`: modules (and all inside
    them) that get no adapter (a VLM's frozen vision tower)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    if saved:
        return PeftModel.from_pretrained(model, saved, is_trainable=True)
    targets = target_modules if target_modules == "all-linear" else [m.strip() for m in target_modules.split(",")]
    skip = "|".join(re.escape(name) for name in exclude or [])
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                                            exclude_modules=rf"^({skip})\..*" if skip else None, task_type="CAUSAL_LM"))


def distribute(model, device, fsdp: bool, bf16: bool, world_size: int, trainable: bool = True):
    """FSDP2: every decoder layer its own shard group, then the root (embeddings, norm, head), so a
    forward all-gathers one layer at a time; with bf16 the gathered weights are bf16 and gradients are
    reduced in fp32. The model comes from load_model(fsdp=True): rank 0's copy (on the CPU) is the source,
    sent one tensor at a time, and each rank keeps its shard (shard_from_rank0). Otherwise DDP (a full
    copy per rank) for a trained model on several ranks."""
    if fsdp:
        if not dist.is_initialized():
            raise UsageError("--fsdp needs torch.distributed: launch with torchrun (e.g. torchrun --nproc_per_node 2 "
                             "train.py --fsdp)")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
        with shard_from_rank0(model, device):
            layer_classes = set(getattr(model, "_no_split_modules", None) or [])  # e.g. {"LlamaDecoderLayer"}
            for module in model.modules():
                if type(module).__name__ in layer_classes:
                    fully_shard(module, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        return model
    if world_size > 1 and trainable:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # No buffer is trained, so no forward broadcasts them: no-grad forwards make no collective.
        return DDP(model, broadcast_buffers=False)
    return model


def gradient_sync(model, last: bool):
    """A context for one micro-batch's backward. DDP reduces the gradients over ranks on the `last`
    micro-batch of an optimizer step only; before that they accumulate locally, in the full copy every rank
    has anyway. FSDP2 reduce-scatters every micro-batch's gradients, so that a rank only ever accumulates its
    shard: a gradient kept unreduced until the last micro-batch would be a whole unsharded copy
    (bench/fsdp_memory.py)."""
    return model.no_sync() if hasattr(model, "no_sync") and not last else nullcontext()  # DDP has no_sync


def sharded_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """named_parameters() of a model that FSDP2 may have left gathered: after a forward, the root's
    weights stay gathered (in the compute dtype, bf16 with mixed precision); reshard to read the fp32
    shards."""
    if isinstance(model, FSDPModule):
        model.reshard()
    return list(model.named_parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: FSDP2 shards (DTensors) are all-gathered, a collective every rank must join."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


VISION_MODULES = ("vision_model", "vision_tower", "visual", "connector", "multi_modal_projector", "mm_projector")


def freeze_vision_tower(model) -> list[str]:
    """Keep a VLM's vision encoder and connector as loaded (--freeze_vision_tower): no gradient, so no
    optimizer state, and the weight sync sends them once. Returns the frozen modules' names (LoRA leaves them
    out)."""
    frozen = [name for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_MODULES]
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    return frozen


def parameter_groups(model, learning_rate: float, vision_learning_rate: float) -> list[dict]:
    """The optimizer's parameter groups: a VLM's trained vision encoder and connector at vision_learning_rate
    (0: learning_rate), everything else that trains at learning_rate. One group for a text model."""
    vision, other = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts = name.split(".")
            (vision if any(part in VISION_MODULES for part in parts) else other).append(p)
    if not vision:
        if vision_learning_rate:
            raise UsageError("--vision_learning_rate: this model has no vision tower that trains (a text-only model); "
                             "drop the flag")
        return [{"params": other, "lr": learning_rate}]
    return [{"params": other, "lr": learning_rate}, {"params": vision, "lr": vision_learning_rate or learning_rate}]


def checkpoint_activations(policy, cfg) -> bool:
    """Gradient checkpointing (--gradient_checkpointing, on by default as in TRL): each layer's activations
    are recomputed in the backward instead of kept. A model without it trains without under the default (a
    warning); the flag given explicitly asks for it anyway (transformers then says it cannot). Returns whether
    it is on."""
    if cfg.gradient_checkpointing and (policy.supports_gradient_checkpointing or cfg.gives("gradient_checkpointing")):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return True
    if cfg.gradient_checkpointing:  # the default, asked of a model without it
        print0(f"warning: {type(policy).__name__} has no gradient checkpointing: it trains without (more memory)")
    return False


def build_models(cfg: Config, model_path: str, vlm: bool, resume: str | None, device, world_size: int):
    """The policy (its parameters: the trainable ones and the frozen), the model that trains it (FSDP2 shards
    per layer, else DDP copies), and the frozen reference for the KL penalty: None at beta 0, and with LoRA,
    whose reference is the same model with the adapter switched off."""
    policy = load_model(os.path.join(resume, "model") if resume and not cfg.use_peft else model_path, device, cfg.fsdp)
    policy.config.use_cache = False
    checkpoint_activations(policy, cfg)
    # A VLM's vision tower stays as loaded (--freeze_vision_tower).
    frozen = freeze_vision_tower(policy) if vlm and cfg.freeze_vision_tower else []
    if cfg.use_peft:  # train a LoRA adapter; the base weights stay frozen and serve as the reference
        policy = add_lora(policy, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                          os.path.join(resume, "adapter") if resume else None, exclude=frozen)
    # The server samples without dropout: train that policy, whose log-probs are then pi_old's.
    if cfg.disable_dropout:
        disable_dropout(policy)
    model = distribute(policy, device, cfg.fsdp, cfg.bf16, world_size)
    ref_model = None
    if cfg.beta > 0 and not cfg.use_peft:  # a checkpoint's own, where training moved it (--sync_ref_model)
        saved = os.path.join(resume or "", "reference", "model")
        ref_model = distribute(load_model(saved if resume and os.path.isdir(saved) else model_path, device,
                                          cfg.fsdp).eval().requires_grad_(False), device, cfg.fsdp, cfg.bf16,
                               world_size, trainable=False)
    for m in (policy, ref_model):  # the flag is read by logprobs.completion_logprobs
        if m is not None:
            hf_model(m).fp32_lm_head = cfg.cast_lm_head_to_fp32
    return policy, model, ref_model


@torch.no_grad()
def mix_into_reference(model, ref_model, alpha: float):
    """TR-DPO's soft update of the reference model (--sync_ref_model, as TRL): ref = alpha * policy
    + (1 - alpha) * ref, parameter by parameter. Both are sharded alike under FSDP2 (each rank mixes its
    shards); under DDP every rank mixes its full copies, which stay equal."""
    pairs = zip(sharded_parameters(ref_model), sharded_parameters(getattr(model, "module", model)), strict=True)
    for (_, ref), (_, p) in pairs:  # under FSDP2, the fp32 shards, not a copy a forward left gathered
        ref.mul_(1.0 - alpha).add_(p, alpha=alpha)


def build_optimizer(policy, cfg: Config):
    """AdamW (a VLM's trained vision tower can have its own learning rate) and the schedule of lr_factor."""
    optimizer = torch.optim.AdamW(parameter_groups(policy, cfg.learning_rate, cfg.vision_learning_rate),
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


def lr_factor(step: int, cfg: Config) -> float:
    """LR multiplier at optimizer step `step` (0-based; a round makes num_iterations *
    steps_per_generation)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    total = cfg.max_steps * cfg.num_iterations * cfg.steps_per_generation
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    factors = {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}
    return factors[cfg.lr_scheduler_type]


@contextmanager
def shard_from_rank0(model, device):
    """Around fully_shard, which keeps each rank's part of the tensors it finds: rank 0 holds the model's
    weights (load_model), the other ranks an empty model on the meta device. Their shards are then allocated
    on `device` and every rank gets its part of rank 0's weights, one tensor at a time, and rank 0's buffers
    (rotary frequencies are not in the state dict). Rank 0's whole copy is freed at the end."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    rank0 = dist.get_rank() == 0
    weights = model.state_dict() if rank0 else {}  # rank 0's full tensors, which sharding would drop
    yield
    if not rank0:
        model.to_empty(device=device)  # keeps tied weights one parameter
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


@contextmanager
def reference_model(model, ref_model):
    """The model that gives reference log-probs: the frozen copy, or with LoRA the policy itself with
    its adapter switched off (the base weights; no second copy in memory)."""
    if ref_model is not None:
        yield ref_model
    else:
        with getattr(model, "module", model).disable_adapter():
            yield model
