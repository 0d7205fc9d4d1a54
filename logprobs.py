"""Per-token log-probs and entropies of completions: the one implementation every forward of the trainer uses
(the training pass, pi_old, the reference, the sync probe), and the batches of model inputs it takes.
Not here: the loss that uses them (grpo.py), the sampler's log-probs (vllm_server.py, rollout.py).
"""

import torch

from config import UsageError
from models import hf_model



def take(batch, rows):
    """The rows `rows` of every tensor in a (nested) dict of per-row tensors; None stays None."""
    if isinstance(batch, dict):
        return {k: take(v, rows) for k, v in batch.items()}
    return None if batch is None else batch[rows]


class PerPrompt:
    """A model input held once per prompt and read as one row per episode: row i is values[index[i]]. The G
    episodes of a group share their prompt's pixels, so a batch holds each image once; taking rows (a
    micro-batch) copies nothing, and .to(device) makes the rows the forward needs, for that micro-batch
    only."""

    def __init__(self, values: torch.Tensor, index: torch.Tensor):
        self.values, self.index = values, index  # (U, ...) one per prompt; (N,) the row of each episode

    def __getitem__(self, rows) -> "PerPrompt":
        return PerPrompt(self.values, self.index[rows])

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple:
        return (len(self.index), *self.values.shape[1:])

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.values[self.index].to(*args, **kwargs)


def to_device(inputs: dict, device) -> dict:
    """The model inputs as tensors on `device` (a PerPrompt input becomes its rows)."""
    return {k: v.to(device) for k, v in inputs.items()}


def trim_padding(inputs: dict, num_completion_tokens: int) -> tuple[dict, int]:
    """A micro-batch of collated model inputs without the columns none of its rows uses: the left padding
    common to all its prompts and the right padding past its longest completion. Positions count
    from each row's first token, so the log-probs are those of the full width. Returns the inputs
    and the number of completion columns kept (the first ones)."""
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    P = input_ids.shape[1] - num_completion_tokens
    used = attention_mask.bool().any(dim=0)  # (P + C,)
    first = int(used.int().argmax())  # every prompt has a token, so first <= P - 1
    c = max(1, int(used[P:].sum()))  # completions are right-padded: the used completion columns come first
    return {**inputs, "input_ids": input_ids[:, first:P + c], "attention_mask": attention_mask[:, first:P + c]}, c


def length_sorted(rows: torch.Tensor, lengths: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`rows` in chunks of `size`, longest first, so each chunk pads to lengths close to its own (and
    the first one shows the peak memory)."""
    rows = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    return [rows[i:i + size] for i in range(0, len(rows), size)]


class SampledLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature) at the target ids, and the entropy of each softmax, of
    (B, T, V) logits and (B, T) targets, in fp32 (fp64 for fp64 logits), `rows` positions at a time (by
    default ~2^20 numbers on a CPU, whose cache they fit, ~2^26 on a GPU): no fp32 (B, T, V) copy of the
    logits is ever made. The backward builds the logits' gradient the same way:
    d logp / d z = (onehot(target) - softmax(z)) / temperature, and with entropy_grad (an entropy bonus)
    d H / d z = -softmax(z) (log softmax(z) + H) / temperature; without it the entropy is a metric, no grad.
    With `own_logits` (logits made for this call alone: the head's output, which nothing else saves) the
    backward writes that gradient over the logits, a chunk at a time, so a micro-batch never holds two (B, T,
    V) tensors."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, rows: int | None = None, entropy_grad: bool = False,
                own_logits: bool = False):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        rows = rows or max(1, (2 ** 26 if logits.is_cuda else 2 ** 20) // logits.shape[-1])
        logp, entropy, lse = (torch.empty(targets.shape, dtype=dtype, device=logits.device) for _ in range(3))
        for b in range(targets.shape[0]):
            for i in range(0, targets.shape[1], rows):
                z = logits[b, i:i + rows].to(dtype) / temperature  # (rows, V): fits in cache
                s = torch.logsumexp(z, dim=-1)
                logp[b, i:i + rows] = z.gather(-1, targets[b, i:i + rows, None]).squeeze(-1) - s
                # H = lse - sum_v p_v z_v
                entropy[b, i:i + rows] = s - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
                lse[b, i:i + rows] = s
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.rows, ctx.entropy_grad, ctx.own_logits = temperature, rows, entropy_grad, own_logits
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        rows, grad = ctx.rows, logits if ctx.own_logits else torch.empty_like(logits)
        for b in range(targets.shape[0]):
            for i in range(0, targets.shape[1], rows):
                g = grad_logp[b, i:i + rows, None]
                # (rows, V) log-probs of every token of the vocabulary
                logp = logits[b, i:i + rows].to(lse.dtype) / ctx.temperature - lse[b, i:i + rows, None]
                d = torch.exp(logp)  # p, the probabilities
                if ctx.entropy_grad:  # dH/dz = -p (log p + H)
                    d = d * (logp + entropy[b, i:i + rows, None]).mul_(-grad_entropy[b, i:i + rows, None]) - d * g
                else:
                    d = d.mul_(-g)
                grad[b, i:i + rows] = d.scatter_add_(-1, targets[b, i:i + rows, None], g) / ctx.temperature
        return grad, None, None, None, None, None


def logprobs_and_entropy(logits_of, targets: torch.Tensor, temperature: float, chunk_size: int | None = 32,
                         entropy_grad: bool = False, own_logits: bool = False):
    """SampledLogprobs of positions whose logits are `logits_of(i, j)` (B, j - i, V) for j - i positions
    from i: (B, C) log-probs of `targets` (B, C) and (B, C) entropies (with their gradient if entropy_grad;
    own_logits: logits_of makes new logits that nothing else keeps, which the backward may overwrite).
    Without grad, `chunk_size` positions at a time, so the (B, C, V) logits never exist at once; with grad
    (or chunk_size None), all at once: one matmul and one gradient of the head instead of one per chunk."""
    C = targets.shape[1]
    step = C if torch.is_grad_enabled() or not chunk_size else chunk_size
    parts = [SampledLogprobs.apply(logits_of(i, min(i + step, C)), targets[:, i:i + step], temperature, None,
                                   entropy_grad, own_logits) for i in range(0, C, step)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


class _LogprobHead(torch.nn.Module):
    """Stands in for the lm_head during one forward: returns (B, C, 2) log-probs and entropies of the
    completion tokens `targets` instead of the (B, C + 1, V) logits."""

    def __init__(self, head, targets, temperature: float, chunk_size: int | None, entropy_grad: bool, fp32: bool):
        super().__init__()
        self.head, self.targets, self.temperature, self.chunk_size = head, targets, temperature, chunk_size
        self.entropy_grad, self.fp32 = entropy_grad, fp32

    def logits(self, hidden):  # (B, n, H) -> (B, n, V)
        if not self.fp32:
            return self.head(hidden)
        # --cast_lm_head_to_fp32 (ScaleRL): outside autocast, fp32 hidden states times the fp32 weight (under
        # FSDP2 with bf16, the weight as gathered, which is bf16).
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.head.bias is None else self.head.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.head.weight.float(), bias)

    # hidden: (B, C + 1, H), the hidden states before each completion token, and the last.
    def forward(self, hidden):
        logp, entropy = logprobs_and_entropy(lambda i, j: self.logits(hidden[:, i:j]), self.targets, self.temperature,
                                             self.chunk_size, self.entropy_grad, own_logits=True)
        return torch.stack([logp, entropy], dim=-1)


def has_plain_lm_head(model) -> bool:
    """Whether the model's logits are what its output embedding returns (Llama, Qwen, Mistral, SmolLM, ...),
    with nothing after it: no soft-capping (Gemma 2), scaling (Cohere, Granite) or anything else, whatever the
    config calls it. Checked numerically, once per model, on a short probe: the logits of a forward against
    the head's output in that same forward. Under FSDP2 this is a forward, so every rank checks at once."""
    hf = hf_model(model)
    if not hasattr(hf, "_plain_lm_head"):
        seen = {}
        hook = hf.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.update(head=out))
        vocab = hf.config.get_text_config().vocab_size
        ids = torch.arange(4, device=next(model.parameters()).device).unsqueeze(0) % vocab  # (1, 4)
        training = model.training
        model.eval()  # no dropout, so the probe draws no random numbers (a resumed run's RNG stays in step)
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        finally:
            hook.remove()
            model.train(training)
        head = seen.get("head")
        hf._plain_lm_head = (head is not None and head.shape == logits.shape
                             and torch.equal(head.to(logits.dtype), logits))
    return hf._plain_lm_head


def positions(inputs: dict) -> torch.Tensor:
    """Position ids counting from each sequence's first token (prompts are left-padded), as in vLLM."""
    return (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)


def with_idle_image(hf, inputs: dict) -> dict:
    """A vision-language model's inputs without a real image (no pixel_values, or only the zero images that
    pad them), with one blank image that no token shows: the vision tower then runs in every forward, so under
    FSDP2 every rank gathers the same modules, and under DDP a trained tower gets a (zero) gradient on every
    rank. The log-probs are those without it. Idefics3's layout: pixel_values (B, images, 3, H, W)."""
    vision = getattr(hf.config, "vision_config", None)
    if vision is None or ("pixel_values" in inputs and inputs["pixel_values"].any()):
        return inputs
    B, size, device = len(inputs["input_ids"]), vision.image_size, inputs["input_ids"].device
    pixels = torch.zeros(B, 1, 3, size, size, device=device)
    mask = torch.zeros(B, 1, size, size, dtype=torch.long, device=device)
    pixels[0], mask[0] = 1.0, 1
    return {**inputs, "pixel_values": pixels, "pixel_attention_mask": mask}


def completion_logprobs(model, inputs: dict, num_completion_tokens: int, temperature: float,
                        chunk_size: int | None = 32, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs (B, C) of the completion part (the last C columns) of collated episodes under
    `model`, called with their model inputs, and the entropy (B, C) of each of those next-token
    distributions, gradient-free unless entropy_grad (an entropy bonus in the loss). The one
    log-prob implementation: training (with grad), pi_old, reference, probe and tests (without).
    The forward goes through `model` itself, so DDP, FSDP2 and peft do what they do in any forward; for
    that forward the lm_head is replaced by one that returns log-probs (see logprobs_and_entropy).
    A model that changes the logits after its head (soft-capping, scaling) returns its logits instead."""
    C, hf = num_completion_tokens, hf_model(model)
    # A per-prompt input becomes its rows, one per episode.
    inputs = with_idle_image(hf, {k: v.to(v.values.device) if isinstance(v, PerPrompt) else v
                                  for k, v in inputs.items()})
    targets, head = inputs["input_ids"][:, -C:], hf.get_output_embeddings()
    plain, fp32 = has_plain_lm_head(model), getattr(hf, "fp32_lm_head", False)  # set by build_models
    if fp32 and not plain:
        raise UsageError("--cast_lm_head_to_fp32: this model changes its logits after the lm head (soft-capping or "
                         "scaling), so its head's output is not the logits; leave the flag out")
    # A LoRA adapter on the head, say, which the fp32 product would skip.
    if fp32 and not isinstance(head, torch.nn.Linear):
        raise UsageError(f"--cast_lm_head_to_fp32 computes the head as one linear layer, but it is a "
                         f"{type(head).__name__}: take lm_head out of --lora_target_modules, or leave the flag out")
    if plain:
        hf.set_output_embeddings(_LogprobHead(head, targets, temperature, chunk_size, entropy_grad, fp32))
    try:
        out = model(**inputs, position_ids=positions(inputs), logits_to_keep=C + 1, use_cache=False).logits
    finally:
        hf.set_output_embeddings(head)
    if plain:  # out: (B, C, 2), the log-probs and entropies
        return out[..., 0], out[..., 1] if entropy_grad else out[..., 1].detach()
    return logprobs_and_entropy(lambda i, j: out[:, i:j], targets, temperature, chunk_size, entropy_grad)


def no_grad_logprobs(model, inputs: dict, num_completion_tokens: int, temperature: float, micro_batch_size: int,
                     autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_logprobs of a whole batch in micro-batches of similar lengths, each without its padding,
    without grad and without dropout (eval mode: these are the fixed pi_old / reference / probe values),
    on the CPU: (N, C) log-probs and (N, C) entropies, meaningless past each completion."""
    device, training = next(model.parameters()).device, model.training
    N, lengths = len(inputs["input_ids"]), inputs["attention_mask"].sum(dim=1)
    logp, entropy = torch.zeros(N, num_completion_tokens), torch.zeros(N, num_completion_tokens)
    model.eval()
    try:
        with torch.no_grad(), autocast:
            for s in length_sorted(torch.arange(N), lengths, micro_batch_size):
                part, c = trim_padding(take(inputs, s), num_completion_tokens)
                logp[s, :c], entropy[s, :c] = (x.float().cpu() for x in
                                               completion_logprobs(model, to_device(part, device), c, temperature))
        return logp, entropy
    finally:
        model.train(training)
