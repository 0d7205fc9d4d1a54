"""Mechanisms that train.py uses but that are not the GRPO algorithm itself, in sections:
data, log-probs, distributed (and the models' wrappers), weights out (sync, probe, saving),
checkpoints, logging.
"""
import collections
import dataclasses
import datetime
import errno
import fcntl
import functools
import gc
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager, nullcontext, suppress

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from config import DEFAULT_DATASET, NO_DATASET, RunStopped, UsageError, run_main
from plot import read_jsonl


# -----------------------------------------------------------------------------
# data: the embedded task, datasets from files or the hub, prompts, the sampling order

def arithmetic_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """The embedded task: sums of two numbers from 1 to 20, answer in \\boxed{}, half of them easy (both
    numbers below 10) and half harder (one of 10 or more). One pair in eight is held out: "test" gives those
    (each once, in a seeded order; `n` is ignored), "train" draws n problems from the others, easy and
    harder alike often. SmolLM2-135M gets the easy ones right often enough for GRPO to have a signal from
    the first step, and the harder ones leave room to improve (README: "The default run")."""
    def question(a, b):
        return {"prompt": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.", "answer": str(a + b)}
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    held_out = [p for p in pairs if (7 * p[0] + p[1]) % 8 == 0]
    rng = random.Random(seed)
    if split == "test":
        rng.shuffle(held_out)
        return [question(a, b) for a, b in held_out]
    train = [p for p in pairs if (7 * p[0] + p[1]) % 8]
    easy, harder = [p for p in train if max(p) < 10], [p for p in train if max(p) >= 10]
    return [question(*rng.choice(easy if rng.random() < 0.5 else harder)) for _ in range(n)]


def parity_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """An embedded task to mix with arithmetic (README: Task mixtures): is a number from 1 to 999 even or odd, the
    answer scored by rewards.choice (no \\boxed{}). The multiples of 11 are held out: "test" gives those (each once,
    in a seeded order; `n` is ignored), "train" draws n of the others."""
    def question(k):
        return {"prompt": f"Is {k} even or odd?", "answer": "even" if k % 2 == 0 else "odd", "choices": ["even", "odd"]}
    rng = random.Random(seed)
    if split == "test":
        held_out = [k for k in range(11, 1000, 11)]
        rng.shuffle(held_out)
        return [question(k) for k in held_out]
    train = [k for k in range(1, 1000) if k % 11]
    return [question(rng.choice(train)) for _ in range(n)]


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_prompt(prompt, where: str):
    """A prompt is text or a list of chat messages ({"role", "content"}); ValueError naming the row otherwise."""
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and m.get("role") in CHAT_ROLES
                                                   and "content" in m for m in prompt):
        return
    raise UsageError(f"{where}: the prompt is {type(prompt).__name__} {repr(prompt)[:80]}; a prompt is non-empty text, "
                     f"or a list of chat messages like [{{\"role\": \"user\", \"content\": \"...\"}}] (roles: "
                     f"{', '.join(CHAT_ROLES)})")


def load_rows(dataset: str, split: str, prompt_column: str, answer_column: str, num_arithmetic: int,
              seed: int, num_starts: int = 0) -> list[dict]:
    """The rows of the embedded task, a local json/jsonl/parquet file or a hub dataset (or a local folder in its
    layout, read the same way), every column kept as it is, with the prompt also under "prompt" (text, or a list
    of chat messages) and the reference answer, if the dataset has one, under "answer" (the built-in accuracy
    reads GSM8K's "... #### 42" as 42). With no dataset ("none": an environment makes the prompts), `num_starts`
    rows {"prompt": "", "seed": k} for its reset(**row), the held-out ones ("test") with seeds no training row has."""
    if dataset == DEFAULT_DATASET:
        return arithmetic_problems(num_arithmetic, seed, "test" if split == "test" else "train")
    if dataset == "parity":
        return parity_problems(num_arithmetic, seed, "test" if split == "test" else "train")
    if dataset == "shapes":  # the embedded vision task
        from vision import shape_problems
        return shape_problems(num_arithmetic, seed, "test" if split == "test" else "train")
    if dataset == NO_DATASET:
        first = 10 ** 9 if split == "test" else 0
        return [{"prompt": "", "seed": first + k} for k in range(num_starts)]
    import datasets
    if os.path.isfile(dataset):
        ext = os.path.splitext(dataset)[1].lstrip(".")
        kind = {"json": "json", "jsonl": "json", "parquet": "parquet"}.get(ext)
        if kind is None:
            raise UsageError(f"--dataset {dataset}: unknown file type .{ext}; use .json, .jsonl or .parquet")
        if os.path.getsize(dataset) == 0:
            raise UsageError(f"--dataset {dataset} is an empty file")
        try:
            data = datasets.load_dataset(kind, data_files=dataset, split="train")
        except Exception as e:  # datasets wraps the parser's error; show that one
            raise UsageError(f"--dataset {dataset}: not a readable {ext} file ({e.__cause__ or e}); a .jsonl file "
                             "has one JSON object per line") from e
    elif not os.path.isdir(dataset) and (os.path.exists(dataset) or dataset.endswith((".json", ".jsonl", ".parquet"))):
        raise UsageError(f"--dataset {dataset}: no such file")
    else:  # a hub dataset, or a folder laid out as one (a clone of its repository: its files name the splits)
        try:
            data = datasets.load_dataset(dataset, split=split)
        except Exception as e:
            if os.path.isdir(dataset):
                raise UsageError(f"--dataset {dataset} (split {split}): the folder could not be read as a dataset "
                                 f"({e}). Its data files name the splits (data/train-*.parquet, test.jsonl, ...); "
                                 "check --dataset_split and --eval_split") from e
            raise UsageError(f"--dataset {dataset} (split {split}) could not be loaded from the Hugging Face hub: {e}. "
                             "Check the name, --dataset_split and the connection, or give a local "
                             ".jsonl/.json/.parquet file") from e
    columns = data.column_names
    prompt_column = prompt_column or ("prompt" if "prompt" in columns else "question")
    if prompt_column not in columns:
        raise UsageError(f"dataset {dataset} has no column {prompt_column!r} (it has {columns}); set --prompt_column")
    if answer_column and answer_column not in columns and answer_column != "answer":  # the default is optional
        raise UsageError(f"dataset {dataset} has no column {answer_column!r} (it has {columns}); set --answer_column, "
                         "or --answer_column '' for a dataset without reference answers")
    if answer_column not in ("", "answer") and "answer" in columns:
        raise UsageError(f"--answer_column {answer_column}: dataset {dataset} has a column 'answer' of its own, which "
                         f"this would replace; rename one of them, or name the column your reward reads "
                         f"(answer=..., {answer_column}=...) and drop --answer_column")
    rows = []
    for i, row in enumerate(data):  # every column as it is; the answer column also as `answer`
        check_prompt(row[prompt_column], f"dataset {dataset}, row {i}, column {prompt_column!r}")
        rows.append({**row, "prompt": row[prompt_column]} | (
            {"answer": row[answer_column]} if answer_column in row else {}))
    if not rows:
        raise UsageError(f"dataset {dataset} (split {split}) is empty")
    return rows


def columns_of(row: dict) -> dict:
    """A row's columns besides its prompt, as they reach reward functions and rollouts.jsonl."""
    return {k: v for k, v in row.items() if k != "prompt"}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021): the chance
    that k of the n, drawn without replacement, include a correct one: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_messages(prompt, system_prompt: str = "") -> list[dict]:
    """A prompt, text or chat messages, as chat messages; --system_prompt goes first unless it has its own."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(tokenizer, prompt, system_prompt: str = "", tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt, text or chat messages, through the chat template (a last assistant message
    is continued, as a forced start of the completion); --system_prompt goes first unless it has its own;
    the tools' schemas where the template shows them."""
    messages = prompt_messages(prompt, system_prompt)
    if tokenizer.chat_template:
        go_on = messages[-1]["role"] == "assistant"
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=not go_on,
                                            continue_final_message=go_on, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if not isinstance(prompt, str):
        raise UsageError("the dataset's prompts are chat messages, but the model's tokenizer has no chat template; use "
                         "text prompts or a model with a chat template")
    return tokenizer((system_prompt + "\n\n" if system_prompt else "") + prompt)["input_ids"]


def encode_prompts(tokenizer, prompts: list, system_prompt: str = "", tools: list[dict] | None = None) -> list[list[int]]:
    """encode_prompt of each prompt, each distinct one once (the embedded task repeats a few hundred questions)."""
    done = {}
    for prompt in prompts:
        key = json.dumps(prompt, sort_keys=True, default=str)
        if key not in done:
            done[key] = encode_prompt(tokenizer, prompt, system_prompt, tools)
    return [done[json.dumps(prompt, sort_keys=True, default=str)] for prompt in prompts]


def step_prompt_indices(step: int, num_rows: int, prompts_per_step: int, seed: int) -> list[int]:
    """The rows of optimizer step `step` (0-based), over all ranks: a fresh seeded permutation per
    epoch, so the order depends only on (seed, step) and a run can resume exactly."""
    out = []
    for k in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, pos = divmod(k, num_rows)
        out.append(last_epoch_orders(num_rows, seed, epoch)[pos])
    return out


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The rows' order in `epoch`: a permutation seeded by seed + epoch."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


last_epoch_orders = functools.lru_cache(maxsize=2)(epoch_order)  # a step spans at most two epochs


# -----------------------------------------------------------------------------
# log-probs: batches of model inputs and the one log-prob implementation

def take(batch, rows):
    """The rows `rows` of every tensor in a (nested) dict of per-row tensors; None stays None."""
    if isinstance(batch, dict):
        return {k: take(v, rows) for k, v in batch.items()}
    return None if batch is None else batch[rows]


class PerPrompt:
    """A model input held once per prompt and read as one row per episode: row i is values[index[i]]. The G
    episodes of a group share their prompt's pixels, so a batch holds each image once; taking rows (a
    micro-batch) copies nothing, and .to(device) makes the rows the forward needs, for that micro-batch only."""

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
    d H / d z = -softmax(z) (log softmax(z) + H) / temperature; without it the entropy is a metric, no grad."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, rows: int | None = None, entropy_grad: bool = False):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        rows = rows or max(1, (2 ** 26 if logits.is_cuda else 2 ** 20) // logits.shape[-1])
        logp, entropy, lse = (torch.empty(targets.shape, dtype=dtype, device=logits.device) for _ in range(3))
        for b in range(targets.shape[0]):
            for i in range(0, targets.shape[1], rows):
                z = logits[b, i:i + rows].to(dtype) / temperature  # (rows, V): fits in cache
                s = torch.logsumexp(z, dim=-1)
                logp[b, i:i + rows] = z.gather(-1, targets[b, i:i + rows, None]).squeeze(-1) - s
                entropy[b, i:i + rows] = s - (torch.softmax(z, dim=-1) * z).sum(dim=-1)  # H = lse - sum_v p_v z_v
                lse[b, i:i + rows] = s
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.rows, ctx.entropy_grad = temperature, rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        rows, grad = ctx.rows, torch.zeros_like(logits)
        for b in range(targets.shape[0]):
            for i in range(0, targets.shape[1], rows):
                g = grad_logp[b, i:i + rows, None]
                logp = logits[b, i:i + rows].to(lse.dtype) / ctx.temperature - lse[b, i:i + rows, None]  # (rows, V)
                d = torch.exp(logp)  # p
                if ctx.entropy_grad:  # dH/dz = -p (log p + H)
                    d = d * (logp + entropy[b, i:i + rows, None]).mul_(-grad_entropy[b, i:i + rows, None]) - d * g
                else:
                    d = d.mul_(-g)
                grad[b, i:i + rows] = d.scatter_add_(-1, targets[b, i:i + rows, None], g) / ctx.temperature
        return grad, None, None, None, None


def logprobs_and_entropy(logits_of, targets: torch.Tensor, temperature: float, chunk_size: int | None = 32,
                         entropy_grad: bool = False):
    """SampledLogprobs of positions whose logits are `logits_of(i, j)` (B, j - i, V) for j - i positions
    from i: (B, C) log-probs of `targets` (B, C) and (B, C) entropies (with their gradient if entropy_grad).
    Without grad, `chunk_size` positions at a time, so the (B, C, V) logits never exist at once; with grad
    (or chunk_size None), all at once: one matmul and one gradient of the head instead of one per chunk."""
    C = targets.shape[1]
    step = C if torch.is_grad_enabled() or not chunk_size else chunk_size
    parts = [SampledLogprobs.apply(logits_of(i, min(i + step, C)), targets[:, i:i + step], temperature, None,
                                   entropy_grad) for i in range(0, C, step)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


class _LogprobHead(torch.nn.Module):
    """Stands in for the lm_head during one forward: returns (B, C, 2) log-probs and entropies of the
    completion tokens `targets` instead of the (B, C + 1, V) logits."""

    def __init__(self, head, targets, temperature: float, chunk_size: int | None, entropy_grad: bool):
        super().__init__()
        self.head, self.targets, self.temperature, self.chunk_size = head, targets, temperature, chunk_size
        self.entropy_grad = entropy_grad

    def forward(self, hidden):  # (B, C + 1, H): the hidden states before each completion token, and the last
        logp, entropy = logprobs_and_entropy(lambda i, j: self.head(hidden[:, i:j]), self.targets, self.temperature,
                                             self.chunk_size, self.entropy_grad)
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
        model.eval()  # no dropout: the probe draws no random numbers (a resumed run's RNG stays in step)
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
    """A vision-language model's inputs without a real image (no pixel_values, or only the zero images that pad
    them), with one blank image that no token shows: the vision tower then runs in every forward, so under FSDP2
    every rank gathers the same modules, and under DDP a trained tower gets a (zero) gradient on every rank. The
    log-probs are those without it. Idefics3's layout: pixel_values (B, images, 3, H, W)."""
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
    inputs = with_idle_image(hf, {k: v.to(v.values.device) if isinstance(v, PerPrompt) else v  # its rows
                                  for k, v in inputs.items()})
    targets, head = inputs["input_ids"][:, -C:], hf.get_output_embeddings()
    plain = has_plain_lm_head(model)
    if plain:
        hf.set_output_embeddings(_LogprobHead(head, targets, temperature, chunk_size, entropy_grad))
    try:
        out = model(**inputs, position_ids=positions(inputs), logits_to_keep=C + 1, use_cache=False).logits
    finally:
        hf.set_output_embeddings(head)
    if plain:  # (B, C, 2)
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


# -----------------------------------------------------------------------------
# distributed: process groups, collectives, the model wrapped in DDP or FSDP2 (and LoRA), processes

def setup_distributed(timeout_s: float = 1800):
    """Returns rank, local_rank, world_size, device, is_main. Works under torchrun and plain python. A collective
    waits up to `timeout_s` for the other ranks."""
    if "RANK" not in os.environ:  # plain `python train.py`
        return 0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"), True
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device,  # small CPU tensors (metrics) go over gloo
                                timeout=datetime.timedelta(seconds=timeout_s))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank, local_rank, world_size, device, rank == 0


def teardown_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def run_and_exit(main, *args):
    """config.run_main(main, *args) (a start-up mistake: one line, exit code 2), then the process groups are
    destroyed and the process ends without Python's interpreter shutdown. gloo's worker threads outlive
    destroy_process_group while FSDP2's DTensors still reference their group, and a worker that frees a finished
    collective (whose tensors are Python objects) takes the GIL: during interpreter shutdown that aborts the
    process (SIGABRT, "terminate called without an active exception"), after a run that saved everything. An
    unforeseen error keeps its traceback and Python's usual exit."""
    try:
        run_main(main, *args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        release_locks()  # the output folder is free for the next run (after kill -9, its lock goes stale)
        gc.collect()  # main()'s objects that an exception's frames hold in a cycle end now, with their finalizers
        teardown_distributed()  # (the reward scorer's process pool); os._exit below runs none
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) of a tensor over all ranks, in place; identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def sum_over_ranks(values: dict) -> dict[str, float]:
    """{name: number or 0-d tensor} -> {name: float}, each summed over all ranks in one collective. The values
    are summed by position: the names must be the same, in the same order, on every rank (checked: a hash h of
    them goes along as h and h^2, and sum(h)^2 = ranks * sum(h^2) only if every rank's h is the same)."""
    h = float(zlib.crc32("\0".join(values).encode()) % 1024)
    total = all_reduce(torch.tensor([float(v) for v in values.values()] + [h, h * h], dtype=torch.float64))
    if dist.is_initialized() and total[-2] ** 2 != dist.get_world_size() * total[-1]:
        raise RuntimeError(f"sum_over_ranks: the ranks summed different names (this rank: {list(values)}); every "
                           "rank must pass the same names in the same order")
    return dict(zip(values, total[:-2].tolist()))


def extremes_over_ranks(values: dict) -> dict[str, float]:
    """{name: number}: names ending in _min get the minimum over all ranks, the others the maximum."""
    sign = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in values], dtype=torch.float64)
    total = all_reduce(torch.tensor([float(v) for v in values.values()], dtype=torch.float64) * sign, dist.ReduceOp.MAX)
    return dict(zip(values, (total * sign).tolist()))


def quantile_over_ranks(values: torch.Tensor, q: float) -> float:
    """The q-quantile (interpolated linearly, as torch.quantile, which refuses > 2^24 values) of the 1-D CPU
    tensors `values` of all ranks together, on every rank; nan if there are none."""
    values = values.detach().double().flatten()
    if dist.is_initialized():
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, torch.tensor([len(values)]))
        longest = max(int(n) for n in sizes)
        parts = [torch.zeros(longest, dtype=torch.float64) for _ in sizes]
        dist.all_gather(parts, torch.cat([values, values.new_zeros(longest - len(values))]))
        values = torch.cat([part[:int(n)] for part, n in zip(parts, sizes)])
    if not len(values):
        return math.nan
    v, position = values.sort().values, q * (len(values) - 1)
    low = math.floor(position)
    return float(v[low] + (position - low) * (v[min(low + 1, len(v) - 1)] - v[low]))


def barrier():
    if dist.is_initialized():
        dist.barrier()


def load_model(path: str, device, fsdp: bool = False, dtype=torch.float32):
    """A causal LM from a Hugging Face folder, on `device`. With FSDP2 (`fsdp`) only rank 0 reads the weights, on
    the CPU; the other ranks build the same model on the meta device (no memory), and `distribute` gives every
    rank its shard from rank 0's copy: no rank but the first ever holds the whole model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one line per step on the console, no loading bars
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM  # a VLM or not
    if fsdp and dist.is_initialized() and dist.get_rank() > 0:
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype)
    model = auto.from_pretrained(path, dtype=dtype)
    return model if fsdp else model.to(device)


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
    model = getattr(model, "module", model)  # DDP
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


def add_lora(model, r: int, alpha: float, dropout: float, target_modules: str, saved: str | None = None,
             exclude: list[str] | None = None):
    """Wrap `model` in a peft LoRA model: only the adapter trains; the base weights stay frozen. `saved`:
    an adapter folder to continue from (its own r, alpha and targets); `exclude`: modules (and all inside them)
    that get no adapter (a VLM's frozen vision tower)."""
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
        return DDP(model, broadcast_buffers=False)  # no buffer is trained; no collective in no-grad forwards
    return model


@contextmanager
def shard_from_rank0(model, device):
    """Around fully_shard, which keeps each rank's part of the tensors it finds: rank 0 holds the model's weights
    (load_model), the other ranks an empty model on the meta device. Their shards are then allocated on `device`
    and every rank gets its part of rank 0's weights, one tensor at a time, and rank 0's buffers (rotary
    frequencies are not in the state dict). Rank 0's whole copy is freed at the end."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    rank0 = dist.get_rank() == 0
    weights = model.state_dict() if rank0 else {}  # rank 0's full tensors, which sharding would drop
    yield
    if not rank0:
        model.to_empty(device=device)  # keeps tied weights one parameter
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def gradient_sync(model, last: bool):
    """A context for one micro-batch's backward. DDP reduces the gradients over ranks on the `last` micro-batch
    of an optimizer step only; before that they accumulate locally, in the full copy every rank has anyway.
    FSDP2 reduce-scatters every micro-batch's gradients, so that a rank only ever accumulates its shard: a
    gradient kept unreduced until the last micro-batch would be a whole unsharded copy (bench/fsdp_memory.py)."""
    return model.no_sync() if hasattr(model, "no_sync") and not last else nullcontext()  # DDP has no_sync


@contextmanager
def reference_model(model, ref_model):
    """The model that gives reference log-probs: the frozen copy, or with LoRA the policy itself with
    its adapter switched off (the base weights; no second copy in memory)."""
    if ref_model is not None:
        yield ref_model
    else:
        with getattr(model, "module", model).disable_adapter():
            yield model


def sharded_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """named_parameters() of a model that FSDP2 may have left gathered: after a forward, the root's
    weights stay gathered (in the compute dtype, bf16 with mixed precision); reshard to read the fp32 shards."""
    if isinstance(model, FSDPModule):
        model.reshard()
    return list(model.named_parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: FSDP2 shards (DTensors) are all-gathered, a collective every rank must join."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now, drawn below the kernel's ephemeral range: one drawn there stays free
    until it is used, as no socket bound to port 0 (gloo's, vLLM's, any client's) is given it meanwhile."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw, ports = random.SystemRandom(), []
    while len(ports) < n:
        port = draw.randrange(max(1024, low - 20000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))  # without SO_REUSEADDR: a port still in TIME_WAIT is not taken
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in ports and port != 29500:  # 29500: torchrun's default rendezvous
            ports.append(port)
    return ports


def stop_process_group(proc, timeout: float = 30):
    """Stop exactly what we started as `proc` (start_new_session=True: a server with its engine and workers,
    a torchrun with its ranks): SIGTERM to its group, SIGKILL after `timeout` seconds; then SIGKILL to any of
    its descendants still alive in a session of their own (torchrun starts each rank in one: a rank stuck
    in a collective outlives a torchrun that was killed)."""
    if proc.poll() is None:
        family = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid, started in family:
            if _stat(pid)[1] == started:  # the same process, not a new one with a reused pid
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, start time) of a process; (0, 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError):
        return 0, 0


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `pid`."""
    parents = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()} if os.path.isdir("/proc") else {}
    found, frontier = [], [pid]
    while frontier:
        children = [(p, started) for p, (parent, started) in parents.items() if parent in frontier]
        found += children
        frontier = [p for p, _ in children]
    return found


def cpu_seconds_of_group(pgid: int) -> float:
    """User + system CPU time so far of every process in process group `pgid` (all their threads)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError):  # the process ended meanwhile
            pass
    return total / os.sysconf("SC_CLK_TCK")


# -----------------------------------------------------------------------------
# weights out: to the server (sync, probe) and to disk

WeightMeta = collections.namedtuple("WeightMeta", "name dtype shape")


def lora_delta(layer) -> torch.Tensor:
    """The update a peft LoRA layer adds to its base weight: sum over active adapters of B A * scaling."""
    if any(getattr(layer, "use_dora", {}).get(a) for a in layer.active_adapters):
        raise UsageError("DoRA adapters cannot be merged for the weight sync: train plain LoRA")
    delta = sum((full_tensor(layer.lora_B[a].weight) @ full_tensor(layer.lora_A[a].weight)) * layer.scaling[a]
                for a in layer.active_adapters)
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


class ServerWeights:
    """The policy's weights as the server's plain model names them, one tensor at a time: Hugging Face
    names, LoRA merged into its base weight (the server runs the base architecture), FSDP2 shards
    gathered one tensor at a time (a collective: every rank iterates, in the same order), in `dtype`.
    `metadata()` lists (name, dtype, shape) without gathering. This is the WeightSource interface of
    vLLM's trainer-side weight-transfer engines, so the same object feeds our gloo and vLLM's nccl.
    A weight that cannot change (frozen and without a LoRA adapter: a VLM's frozen vision tower, the base
    weights around LoRA layers) is sent by the first push only."""

    def __init__(self, model, dtype: torch.dtype):
        self.model, self.dtype = hf_model(model), dtype
        skip = os.environ.get("NANOGRPO_FAULT_SKIP_WEIGHT")  # fault injection for the sync-check test: push without it
        sharded_parameters(getattr(model, "module", model))
        # named_parameters lists a tied lm_head once, under the embedding's name, as the server expects
        self.params = [(name, p) for name, p in self.model.named_parameters()
                       if "lora_" not in name and name.replace(".base_layer", "") != skip]
        self.changing = [(name, p) for name, p in self.params if p.requires_grad or name.endswith(".base_layer.weight")]
        self.pushed = False  # after the first push, only the weights that can change

    def _sent(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.changing if self.pushed else self.params

    def send_all_next(self):
        """The next push sends every weight again (to a server that was restarted, or that may hold others)."""
        self.pushed = False

    def metadata(self) -> list[WeightMeta]:
        return [WeightMeta(name.replace(".base_layer", ""), self.dtype, tuple(p.shape)) for name, p in self._sent()]

    def __iter__(self):
        params, self.pushed = self._sent(), True  # when reading begins: rank 0 does not read to the end
        for name, p in params:
            weight = full_tensor(p.detach())
            if name.endswith(".base_layer.weight"):  # a LoRA layer: W + B A * alpha / r
                weight = weight + lora_delta(self.model.get_submodule(name.removesuffix(".base_layer.weight")))
            yield name.replace(".base_layer", ""), weight.to(self.dtype)


@dataclasses.dataclass
class Probe:
    """A fixed token sequence that the server and the trainer both score (check_sync). A vision-language model's
    also has its pixel inputs, and its messages with the images, which the server renders itself (chat route)."""
    ids: list[int]
    model_inputs: dict = dataclasses.field(default_factory=dict)  # tensors with a leading dimension of 1
    messages: list | None = None


def check_sync(client, model, probe: Probe, autocast, is_main: bool, tolerance: float, step: int) -> dict:
    """The mean and max |log-prob difference| between the server and `model` on a fixed token sequence,
    on every rank: a deterministic check that the server computes with the weights we pushed. Every rank
    runs the forward (FSDP2 gathers); rank 0 asks the server. Stops the run if the mean is above `tolerance`."""
    ids = torch.tensor([probe.ids])
    ours = no_grad_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), **probe.model_inputs},
                            len(probe.ids) - 1, 1.0, 1, autocast)[0][0]  # (P - 1,) log-probs of the one row
    diff, error = torch.zeros(1), None
    if is_main:
        try:
            theirs = (client.prompt_logprobs(probe.ids) if probe.messages is None
                      else client.chat_prompt_logprobs(probe.messages, probe.ids))
            diff = (ours - torch.tensor(theirs)).abs()
        except Exception as e:  # e.g. the server was lost: the other ranks are in the sum below, so join it first
            error = e
    probe = sum_over_ranks({"sync_probe_diff_mean": diff.mean(), "sync_probe_diff_max": diff.max()})  # rank 0's
    if error:
        raise error
    if probe["sync_probe_diff_mean"] > tolerance:
        raise RunStopped(
            f"weight sync check failed after step {step}: the server's log-probs of a fixed probe differ from the "
            f"trainer's by {probe['sync_probe_diff_mean']:.4g} on average > {tolerance:g}. The server is not "
            "computing with the weights we trained. Likely causes: a weight not pushed or pushed under a name the "
            "server does not map (LoRA or FSDP prefixes), a tied lm_head the server did not refresh, a stale prefix "
            "or vision-encoder cache, or a server started with another model or dtype. If the dtypes differ on "
            "purpose, raise --sync_check_tolerance.")
    return probe


def fsync_folder(path: str, files: bool = True):
    """Make a folder durable: its files' contents (`files`) and its entries reach the disk, so that after a power
    loss a renamed folder is never there with empty files."""
    for folder, _, names in os.walk(path) if files else [(path, [], [])]:
        for name in [*names, "."]:  # "." : the folder's own entries
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def replace_folder(out: str, write):
    """Call write(folder) on a temporary folder, then rename it to `out`: a crash never leaves a
    half-written folder where a complete one was."""
    staging, old = out.rstrip("/") + ".tmp", out.rstrip("/") + ".old"
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    fsync_folder(staging)
    if os.path.exists(out):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old)
    else:
        os.replace(staging, out)


def save_model(model, tokenizer, output_dir: str, is_main: bool, merged: bool = True) -> list[str]:
    """Called on every rank (FSDP2 gathers). Writes output_dir/model, a Hugging Face folder that
    transformers and vLLM load (with LoRA: the merged weights, if `merged`), and with LoRA
    output_dir/adapter, a peft folder. Returns the folders written."""
    folders = []
    peft_model = getattr(model, "module", model)
    if hasattr(peft_model, "disable_adapter"):
        adapter = {name: full_tensor(p.detach()).cpu() for name, p in sharded_parameters(peft_model) if "lora_" in name}
        if is_main:
            replace_folder(os.path.join(output_dir, "adapter"),
                           lambda d: (peft_model.save_pretrained(d, state_dict=adapter), tokenizer.save_pretrained(d)))
        folders.append(os.path.join(output_dir, "adapter"))
        if not merged:
            return folders
    state = {}
    for name, weight in ServerWeights(model, torch.float32):  # every rank gathers; rank 0 keeps
        if is_main:
            state[name] = weight.cpu()
    if is_main:
        replace_folder(os.path.join(output_dir, "model"),
                       lambda d: (hf_model(model).save_pretrained(d, state_dict=state), tokenizer.save_pretrained(d)))
    return folders + [os.path.join(output_dir, "model")]


# -----------------------------------------------------------------------------
# checkpoints: everything a run needs to continue exactly, written atomically

CHECKPOINT = re.compile(r"checkpoint-(\d+)")

RESUME_MUST_MATCH = ("model", "dataset", "tasks", "dataset_split", "num_arithmetic_problems", "seed",
                     "prompts_per_step", "num_generations", "use_peft", "freeze_vision_tower",  # what decides the
                     # weights and the order of the prompts ("tasks": a mixture's sources and weights, mixture.py)
                     "num_iterations", "steps_per_generation")  # how optimizer steps map to steps (the schedule)
LORA_MUST_MATCH = ("lora_r", "lora_alpha", "lora_target_modules", "lora_dropout")  # the saved adapter's own config


def checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoints in `output_dir`, oldest first (a folder is complete once renamed from .tmp)."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := CHECKPOINT.fullmatch(name)) and os.path.isfile(os.path.join(output_dir, name, "checkpoint.json"))]
    return [path for _, path in sorted(found)]


OUTPUTS = ("metrics.jsonl", "rollouts.jsonl", "model", "adapter")  # what a run leaves, besides checkpoints
LOGS = ("metrics.jsonl", "rollouts.jsonl")


def prepare_output_dir(output_dir: str, resume: str | None, step: int = 0):
    """Rank 0, at start (not at the first save, hours later). The folder must be writable, and it is locked for
    the run: a second run into it stops at once. A new run does not mix with an earlier run's output there. A run
    resumed from a checkpoint of this folder keeps the logs up to its step; if the run went further, the logs as
    they were and the checkpoints after it are moved aside (set_aside_after), so that `latest` never jumps back
    to them. Resumed from another folder's checkpoint, this folder starts as a new run's, with the logs up to the
    checkpoint copied in. Returns the lock: held while it is open (the kernel frees it when the process ends)."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir):
            pass
    except OSError as e:
        raise UsageError(f"--output_dir {output_dir} is not a writable folder ({e.strerror}): choose another") from None
    lock = OutputLock(output_dir)
    same_folder = resume is not None and os.path.samefile(os.path.dirname(os.path.abspath(resume)), output_dir)
    if not same_folder:
        earlier = [name for name in sorted(os.listdir(output_dir), key=lambda n: (not CHECKPOINT.fullmatch(n), n))
                   if CHECKPOINT.fullmatch(name) or name in OUTPUTS
                   and not (name in LOGS and os.path.getsize(os.path.join(output_dir, name)) == 0)]
        if earlier:
            lock.close()
            if resume and os.path.abspath(resume).startswith(os.path.join(os.path.abspath(output_dir), "")):
                raise UsageError(f"--output_dir {output_dir} holds the run that {resume} was set aside from: resume it "
                                 "into another --output_dir, which starts with its logs up to its step")
            raise UsageError(f"--output_dir {output_dir} holds an earlier run's output ({', '.join(earlier)}): "
                             + ("continue that run with --resume_from_checkpoint latest, " if resume is None else "")
                             + "choose another --output_dir, or delete them")
    aside = set_aside_after(output_dir, step) if same_folder else None
    for name in LOGS:
        source = os.path.join(os.path.dirname(os.path.abspath(resume)) if resume else output_dir, name)
        if resume and os.path.exists(source) and (torn := keep_steps_up_to(source, step, os.path.join(output_dir, name))):
            print(f"warning: dropped {torn} line(s) of {source} cut short by an earlier run's end (a kill or a full "
                  "disk while writing); the records before them are kept" + (f", and all in {aside}" if aside else ""),
                  flush=True)
    if aside:
        print(f"resuming from step {step} of a run that went further: its logs as they were, and its checkpoints after "
              f"step {step} if any, are in {aside} (`latest` would resume those)", flush=True)
    return lock


class OutputLock:
    """output_dir/.lock while a run uses the folder: a second run into it stops at once, on this node or another.
    flock(2) frees it the moment its process ends, however it ends. The file names the run (pid and host) and the
    run renews its time every RENEW_S s: where flock is missing (NFSv3 without lockd: ENOLCK; Lustre mounted
    noflock: ENOSYS) or holds on one node only (Lustre localflock), a lock of another node (or of a dead process of
    this one) that was not renewed for STALE_S s is left by a run that is gone, and is taken over. close() (or
    release_locks(), as the process ends) removes it."""

    RENEW_S, STALE_S = 15, 60
    held: list["OutputLock"] = []

    def __init__(self, output_dir: str):
        self.path, self.me = os.path.join(output_dir, ".lock"), f"pid {os.getpid()} on {socket.gethostname()}"
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except BlockingIOError:  # held by a live process (of this node, or of any where flock spans nodes)
            self.file.seek(0)
            owner = self.file.read().strip() or "starting"
            self.file.close()
            raise UsageError(f"--output_dir {output_dir} is in use by another run ({owner}): wait for it to end, or "
                             "choose another --output_dir") from None
        except OSError as e:  # no flock on this filesystem: the renewed time alone tells a live run
            print(f"warning: {output_dir} is on a filesystem without flock ({e.strerror}): it is locked by the time of "
                  f"{self.path}, renewed every {self.RENEW_S} s", flush=True)
            flocked = False
        self.file.seek(0)
        owner, age = self.file.read().strip(), time.time() - os.fstat(self.file.fileno()).st_mtime
        pid, _, host = owner.removeprefix("pid ").partition(" on ")
        gone = host == socket.gethostname() and (flocked or not os.path.exists(f"/proc/{pid}"))
        if owner and not gone and age < self.STALE_S:
            self.file.close()
            raise UsageError(f"--output_dir {output_dir} is in use by another run ({owner}, which renewed its lock "
                             f"{age:.0f} s ago): wait for it to end, or choose another --output_dir. If that run has "
                             f"ended (it is renewed every {self.RENEW_S} s), delete {self.path}")
        if owner and not gone:
            print(f"warning: {self.path} was left by {owner}, not renewed for {age:.0f} s: taken over", flush=True)
        self.file.truncate(0)
        self.file.write(self.me + "\n")
        self.file.flush()
        self.stop = threading.Event()
        threading.Thread(target=self._renew, daemon=True).start()
        OutputLock.held.append(self)

    def _renew(self):
        while not self.stop.wait(self.RENEW_S):
            with suppress(OSError):
                os.utime(self.file.fileno())

    def close(self):
        """The folder is free: the file goes (if it is still ours), then the flock."""
        if self in OutputLock.held:
            OutputLock.held.remove(self)
            self.stop.set()
            with suppress(OSError):
                self.file.seek(0)
                if self.file.read().strip() == self.me:
                    os.unlink(self.path)
            self.file.close()


def release_locks():
    for lock in list(OutputLock.held):
        lock.close()


def set_aside_after(output_dir: str, step: int) -> str | None:
    """Before a run resumes from step `step` in its own folder: if the run there went further (a checkpoint after
    `step`, or a log record after it or cut short: the records a crash leaves, which often explain it), make
    output_dir/abandoned-after-step-{step}-{time} with hard links (else copies) of the logs as they are, and move
    those checkpoints into it; returns that folder (None if the run went no further)."""
    later = [path for path in checkpoints(output_dir) if int(CHECKPOINT.fullmatch(os.path.basename(path))[1]) > step]
    logs = [path for name in LOGS if os.path.exists(path := os.path.join(output_dir, name))]
    if not later and not any(went_past(path, step) for path in logs):
        return None
    aside = os.path.join(output_dir, f"abandoned-after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside)
    for path in logs:  # linked first: the logs are cut back to `step` (a new file) only after
        try:
            os.link(path, os.path.join(aside, os.path.basename(path)))
        except OSError:
            shutil.copyfile(path, os.path.join(aside, os.path.basename(path)))
    for path in reversed(later):
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    return aside


def went_past(path: str, step: int, block: int = 1 << 20) -> bool:
    """Whether a JSONL log (its records in the order of their steps) ends after `step`, or in a line cut short."""
    last = last_record(path, block)
    return last is not None and (last == {} or last["step"] > step)


def last_record(path: str, block: int = 1 << 20) -> dict | None:
    """The last record of a JSONL log, read from the end (rollouts.jsonl can be large): None if there is none, {}
    if its last line is cut short (not whole JSON)."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        while end > 0 and tail.count(b"\n") < 2:  # the last line, whole (it ends in one newline, if not cut short)
            start = max(end - block, 0)
            f.seek(start)
            tail, end = f.read(end - start) + tail, start
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1] if tail.strip() else b""
    try:
        return None if not last else json.loads(last) if tail.endswith(b"\n") else {}
    except ValueError:
        return {}


def evaluated_last(output_dir: str) -> bool:
    """Whether metrics.jsonl ends with an evaluation, as rank 0 reads it (every rank gets its answer)."""
    return text_of_rank0(str(int("eval/reward" in (last_record(os.path.join(output_dir, "metrics.jsonl")) or {})))) == "1"


def find_checkpoint(spec: str, output_dir: str) -> str:
    """--resume_from_checkpoint: "latest" (the newest complete one in output_dir) or a checkpoint folder. Called
    on every rank; rank 0 finds it, and every rank must see it. On NFS a folder's listing can lag behind another
    node's by a minute: ranks that resumed from different steps would drift apart without a word."""
    found = ["", ""]  # the checkpoint, or what is wrong
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            found[0] = newest_or_given_checkpoint(spec, output_dir)
        except UsageError as e:
            found[1] = str(e)
    path, error = json.loads(text_of_rank0(json.dumps(found)))
    if error:
        raise UsageError(error)
    if unseen := int(sum_over_ranks({"unseen": not os.path.isfile(os.path.join(path, "checkpoint.json"))})["unseen"]):
        raise UsageError(f"--resume_from_checkpoint {spec}: {path} (as rank 0 sees it) is not there for {unseen} of the "
                         "processes: put --output_dir on a filesystem that every node shares, or let it catch up")
    return path


def newest_or_given_checkpoint(spec: str, output_dir: str) -> str:
    if spec == "latest":
        found = checkpoints(output_dir)
        if not found:
            raise UsageError(f"--resume_from_checkpoint latest: no checkpoint in {output_dir}; train with "
                             "--save_steps N to write some, or give a checkpoint folder")
        return found[-1]
    if not os.path.isfile(os.path.join(spec, "checkpoint.json")):
        raise UsageError(f"--resume_from_checkpoint {spec}: not a checkpoint folder (no checkpoint.json); give "
                         f"output_dir/checkpoint-N or latest")
    return spec


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rng_states() -> dict[str, torch.Tensor]:
    """{"cpu": (world_size, n), and "cuda" on GPUs}: the torch RNG states of every rank (dropout draws from them)."""
    mine = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    if not dist.is_initialized():
        return {k: v.unsqueeze(0) for k, v in mine.items()}
    every = {k: [torch.empty_like(v) for _ in range(dist.get_world_size())] for k, v in mine.items()}
    for k, v in mine.items():
        dist.all_gather(every[k], v)  # CPU tensors: gloo
    return {k: torch.stack(v) for k, v in every.items()}


def save_checkpoint(output_dir: str, step: int, model, optimizer, scheduler, tokenizer, config: dict, is_main: bool,
                    keep: int, extra: dict | None = None) -> str:
    """output_dir/checkpoint-{step}: the model (model/, or adapter/ with LoRA), trainer_state.pt (optimizer,
    scheduler, RNG of every rank, step, `extra`) and checkpoint.json (step, config, git revision). Written
    into checkpoint-{step}.tmp, flushed to the disk and renamed when complete, so a crash, kill -9, full disk or
    power loss at any moment leaves the earlier checkpoints as they were; then only the newest `keep` are kept
    (0 = all). A complete checkpoint of this step already there holds this state (the one the run resumed from,
    and it stopped before training; or saved, and the server then lost): it is kept, never deleted and rewritten
    (on NFS a file of it still memory-mapped would stay behind, and the new one could not take its name).
    Called on every rank (FSDP2 gathers); rank 0 writes. A failed write raises on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    path = os.path.join(output_dir, f"checkpoint-{step}")
    if sum_over_ranks({"there": is_main and os.path.isfile(os.path.join(path, "checkpoint.json"))})["there"]:
        return path  # rank 0's view, shared: another node's may lag behind
    staging = path + ".tmp"
    sharded_parameters(getattr(model, "module", model))  # FSDP2: weights a forward left gathered are shards again
    optim = get_optimizer_state_dict(getattr(model, "module", model), optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # rank 0 gets it
    rngs = rng_states()
    error = None
    try:
        if is_main:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        save_model(model, tokenizer, staging, is_main, merged=False)
        if is_main:
            torch.save({"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rngs,
                        **(extra or {})}, os.path.join(staging, "trainer_state.pt"))
            with open(os.path.join(staging, "checkpoint.json"), "w") as f:  # written last: the folder is complete
                json.dump({"step": step, "git_revision": git_revision(), "world_size": len(rngs["cpu"]),
                           "config": config}, f, indent=1)
            fsync_folder(staging)  # complete on the disk before it takes its name and older ones go
            shutil.rmtree(path, ignore_errors=True)
            os.replace(staging, path)
            fsync_folder(output_dir, files=False)
    except Exception as e:  # e.g. a full disk (OSError, or the writer's own error): earlier checkpoints are untouched
        shutil.rmtree(staging, ignore_errors=True)
        error = e
    if sum_over_ranks({"failed": error is not None})["failed"]:
        raise RunStopped(f"could not write checkpoint {path}: {error or 'failed on rank 0'}. The earlier "
                           f"checkpoints in {output_dir} are intact; free disk space and resume with "
                           "--resume_from_checkpoint latest") from error
    if is_main:
        prune_checkpoints(output_dir, keep)
    return path


def prune_checkpoints(output_dir: str, keep: int):
    """Delete all but the newest `keep` checkpoints (0 = keep all). One that cannot be deleted (say a file held
    open on NFS) is reported and left, and the run goes on: the newest checkpoint is complete either way."""
    for old in checkpoints(output_dir)[:-keep] if keep > 0 else []:
        try:
            shutil.rmtree(old)
        except OSError as e:
            print(f"warning: could not delete the old checkpoint {old} ({e}); the run goes on, and the newest "
                  "checkpoint is complete. Delete it by hand", flush=True)


RESUME_MAY_MOVE = ("resume_from_checkpoint", "output_dir", "vllm_server_host", "vllm_server_port", "vllm_group_host",
                   "vllm_group_port", "learning_rate", "vision_learning_rate", "adam_beta1", "adam_beta2",
                   "weight_decay")  # where the run is, and what restore_training_state reports itself


def check_checkpoint(path: str, config: dict) -> tuple[int, list[str]]:
    """The step of a checkpoint, after checking that this run continues the one that wrote it, and the other
    flags this run changes (e.g. ["--max_steps 24 -> 48"]), to be said: they apply from the next step."""
    with open(os.path.join(path, "checkpoint.json")) as f:
        saved = json.load(f)
    must_match = RESUME_MUST_MATCH + (LORA_MUST_MATCH if config.get("use_peft") else ())  # (else they do nothing)
    changed = [f"--{k} {saved['config'].get(k)!r} -> {config.get(k)!r}" for k in must_match
               if saved["config"].get(k) != config.get(k)]
    if changed:
        raise UsageError(f"cannot resume from {path} exactly: {', '.join(changed)}. Use the checkpoint's values "
                         "(see its checkpoint.json), or start a new run")
    edited = [f"--dataset file {path} edited since the checkpoint (another content hash)"
              for path, digest in saved["config"].get("dataset_files", {}).items()
              if config.get("dataset_files", {}).get(path, digest) != digest]
    return saved["step"], edited + [f"--{k} {saved['config'][k]!r} -> {v!r}" for k, v in config.items()
                                    if k in saved["config"] and saved["config"][k] != v
                                    and k not in RESUME_MAY_MOVE + ("dataset_files",)]


def load_checkpoint(path: str) -> dict:
    """trainer_state.pt of a checkpoint (tensors and plain values only: weights_only), memory-mapped: the
    optimizer's moments are read where they are used (restore_training_state: rank 0)."""
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True, mmap=True)


def restore_training_state(state: dict, model, optimizer, scheduler, rank: int, world_size: int) -> list[str]:
    """Optimizer (whatever the sharding), scheduler and this rank's RNG from a checkpoint's trainer state. The
    optimizer's moments and the schedule's position come from the checkpoint; its hyperparameters (learning
    rate, betas, weight decay, eps) are this run's, as built from the flags. Returns what changed, e.g.
    ["learning_rate 5e-05 -> 1e-05"]."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    keys = {"initial_lr": "learning_rate", "betas": "adam_beta1/2", "weight_decay": "weight_decay", "eps": "adam eps"}
    ours = [{k: g[k] for k in keys} for g in optimizer.param_groups]
    sharded = isinstance(model, FSDPModule)  # then rank 0 reads the moments (memory-mapped) and sends them a tensor
    saved = state["optimizer"] if rank == 0 or not sharded else {}  # at a time, and each rank keeps its part
    set_optimizer_state_dict(getattr(model, "module", model), optimizer, saved,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded))
    scheduler.load_state_dict(state["scheduler"])  # its base_lrs are the checkpoint's too
    plain = lambda v: list(v) if isinstance(v, tuple) else v  # the checkpoint's betas come back as a list
    changed = [f"{keys[k]} {plain(g[k])} -> {plain(mine[k])}" for g, mine in zip(optimizer.param_groups, ours)
               for k in keys if plain(g[k]) != plain(mine[k])]
    for g, mine in zip(optimizer.param_groups, ours):
        g.update(mine)
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for g, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        g["lr"] = base * fn(scheduler.last_epoch)  # where the schedule is now, at this run's peak
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    rng = state["rng"]
    if len(rng["cpu"]) == world_size:
        torch.set_rng_state(rng["cpu"][rank].clone())  # a row of the stack: its own storage
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"][rank].clone())
    else:
        print0(f"warning: the checkpoint was written by {len(rng['cpu'])} processes, this run has {world_size}: the "
               "random state of dropout is not restored (everything else is)")
    return list(dict.fromkeys(changed))


class StopRequest:
    """SIGTERM or SIGINT (Ctrl-C) asks the run to save a checkpoint and stop at the next safe point;
    a second SIGINT stops at once. (torchrun's ranks run in sessions of their own: a terminal's Ctrl-C reaches
    them through torchrun, which passes on the first only.) `requested()` is a collective: every rank gets the
    same answer."""

    def __init__(self):
        self.flag = self.stopping = False  # this rank got a signal / some rank did (known at the last check)
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True

    def requested(self) -> bool:
        self.stopping = sum_over_ranks({"stop": self.flag})["stop"] > 0
        return self.stopping


# -----------------------------------------------------------------------------
# logging: the console, metrics.jsonl, rollouts.jsonl, wandb; the check that stops a run gone non-finite

def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def progress(done: int, total: int, seconds: float, width: int = 20) -> str:
    """A progress bar with elapsed and remaining time: "[########------------] 40% 2m05s<3m08s"."""
    fill = round(width * done / max(total, 1))
    left = seconds / max(done, 1) * (total - done)
    clock = lambda t: f"{int(t // 60)}m{int(t % 60):02d}s"  # noqa: E731
    return f"[{'#' * fill}{'-' * (width - fill)}] {100 * done / max(total, 1):.0f}% {clock(seconds)}<{clock(left)}"


def merge_stats(total: dict, new: dict):
    """Add `new` into `total` in place: names ending in _max keep the maximum, _min the minimum, others add up."""
    for k, v in new.items():
        if k not in total:
            total[k] = v
        else:
            total[k] = (max(total[k], v) if k.endswith("_max") else min(total[k], v) if k.endswith("_min")
                        else total[k] + v)


def named_rewards(row: torch.Tensor, names: list[str]) -> dict:
    """One completion's rewards as {function name: value}, None for not scored (NaN is not JSON)."""
    return {name: None if math.isnan(v) else v for name, v in zip(names, row.tolist())}


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """On rank 0, each key's mean over the ranks that have it (ranks may have different keys); {} elsewhere."""
    parts = [json.loads(line) for line in gather_lines([json.dumps(values)])]
    keys = dict.fromkeys(k for part in parts for k in part)
    return {k: sum(p[k] for p in parts if k in p) / sum(k in p for p in parts) for k in keys}


def text_of_rank0(text: str) -> str:
    """Rank 0's `text`, on every rank (the others' is not read). As byte tensors, as gather_lines."""
    if not dist.is_initialized():
        return text
    data = torch.tensor(list(text.encode()) if dist.get_rank() == 0 else [], dtype=torch.uint8)
    size = torch.tensor([len(data)])
    dist.broadcast(size, src=0)
    data = data if dist.get_rank() == 0 else torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return data.numpy().tobytes().decode()


def gather_lines(lines: list[str]) -> list[str]:
    """Every rank's lines, in rank order, on rank 0 (the other ranks get []): the lengths go to every rank, the
    text only to rank 0. As byte tensors, which gloo and the CPU side of "cpu:gloo,cuda:nccl" carry."""
    if not dist.is_initialized():
        return lines
    text = bytearray("".join(line + "\n" for line in lines).encode())
    data = torch.frombuffer(text, dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)]))
    longest = max(int(n) for n in sizes)
    padded = torch.cat([data, torch.zeros(longest - len(data), dtype=torch.uint8)])
    if dist.get_rank() != 0:
        dist.gather(padded, dst=0)
        return []
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.gather(padded, parts, dst=0)
    return [line for part, n in zip(parts, sizes) for line in part[:int(n)].numpy().tobytes().decode().splitlines()]


def keep_steps_up_to(path: str, step: int, to: str | None = None) -> int:
    """Write the records of a JSONL log up to `step` (dropping those after it, which a resumed run writes again,
    and any line that is not whole JSON: a record cut short by a kill or a full disk) to `to` (default: in
    place), through a copy that then takes its name. Reads a line at a time: rollouts.jsonl can be large.
    Returns how many cut lines were dropped."""
    to = to or path
    torn = 0
    with open(path) as f, open(to + ".tmp", "w") as out:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if record["step"] <= step:
                out.write(line.rstrip("\n") + "\n")
    os.replace(to + ".tmp", to)
    return torn


def append_lines(f, lines: list[str]):
    """Append whole lines to `f` (a file opened "ab" without buffering) in one write. If the write fails (a full
    disk, a size limit), the file is cut back to where it was and the error raised: a log never ends in half a
    record."""
    data = "".join(line + "\n" for line in lines).encode()
    end = f.seek(0, os.SEEK_END)
    try:
        if f.write(data) != len(data):
            raise OSError(errno.ENOSPC, f"only part of a record could be written to {f.name}")
    except BaseException:
        f.truncate(end)
        raise


def finite_json(record) -> str:
    """JSON that strict readers take (jq, JavaScript, pandas with strict parsing): a number that is not finite
    (NaN: not scored or nothing to average, inf) is written as null."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return [clean(v) for v in x] if isinstance(x, (list, tuple)) else x
    return json.dumps(clean(record), allow_nan=False, default=describe)


def describe(value) -> str:
    """A value JSON has no form for, as rollouts.jsonl shows it: an image by its size, bytes by their count."""
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return f"<image {value.mode} {value.size[0]}x{value.size[1]}>"
    return f"<{len(value)} bytes>" if isinstance(value, (bytes, bytearray)) else str(value)


class MetricsLogger:
    """metrics.jsonl (one JSON object per step), rollouts.jsonl (every completion: prompt, completion, each reward,
    advantage, finish reason, the policy version that sampled it), and optionally wandb with a completions table.
    Only rank 0 writes; log_rollouts is a collective (the other ranks send theirs)."""

    def __init__(self, output_dir: str, is_main: bool, report_to: str = "none", config: dict | None = None,
                 project: str = "nanogrpo", run_name: str = ""):
        self.file = self.rollouts = self.wandb = None
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)  # prepare_output_dir has cut a resumed run's logs back to its step
        self.file, self.rollouts = (open(os.path.join(output_dir, name), "ab", buffering=0) for name in LOGS)
        if report_to == "wandb":
            import wandb
            self.wandb = wandb.init(project=project, name=run_name or None, config=config)

    def log(self, metrics: dict):
        if self.file is not None:
            append_lines(self.file, [finite_json(metrics)])
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["step"])

    def log_rollouts(self, records: list[dict]):
        """Called on every rank with its own records."""
        lines = gather_lines([finite_json(r) for r in records])
        if self.rollouts is None:
            return
        append_lines(self.rollouts, lines)
        if self.wandb is not None and lines:
            import wandb
            rows = [json.loads(line) for line in lines]
            columns = ["step", "split", "prompt", "completion", *rows[0]["rewards"], "reward", "advantage"]
            table = wandb.Table(columns=columns, data=[[r["step"], r["split"], r["prompt"], r["completion"],
                                                        *r["rewards"].values(), r["reward"], r.get("advantage")]
                                                       for r in rows])
            self.wandb.log({f"{rows[0]['split']}/completions": table}, step=rows[0]["step"])

    def close(self):
        for f in (self.file, self.rollouts):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()


def eval_summary(output_dir: str, groups: dict[str, list[str]], samples: int) -> str | None:
    """One line comparing the run's first and last evaluation in output_dir/metrics.jsonl (a resumed run's
    too), e.g. `held-out accuracy 0.18 -> 0.41, format 0.10 -> 0.80 (52 problems x 4 samples, steps 0 -> 12)`;
    `groups`: the reward functions to show under each metric prefix ({"eval": names}, or in a mixture
    {"eval/task/<name>": its functions}, each shown as `<name>: ...`); None with fewer than two evaluations."""
    evals = [r for r in read_jsonl(os.path.join(output_dir, "metrics.jsonl")) if "eval/reward" in r]
    if len(evals) < 2:
        return None
    first, last = evals[0], evals[-1]
    parts = []
    for prefix, names in groups.items():
        change = ", ".join(f"{name} {first[f'{prefix}/rewards/{name}']:.2f} -> {last[f'{prefix}/rewards/{name}']:.2f}"
                           for name in names if f"{prefix}/rewards/{name}" in first)
        parts.append(change if prefix == "eval" else f"{prefix.rsplit('/', 1)[-1]}: {change}")
    return (f"held-out {'; '.join(parts)} ({int(last['eval/num_prompts'])} problems x {samples} samples, "
            f"steps {first['step']} -> {last['step']})")


class StepTimer:
    """Seconds spent in each phase of a step: lap(name) adds the time since the last lap to `name`;
    `with within(name)` adds the time of the block to `name` as a part of the phase around it."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds = {}

    def lap(self, name: str):
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    @contextmanager
    def within(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": self.last - self.start}


def mean_and_std(total: float, squares: float, n: float) -> tuple[float, float]:
    mean = total / max(n, 1.0)
    return mean, math.sqrt(max(squares / max(n, 1.0) - mean ** 2, 0.0))


def reward_metrics(rewards: torch.Tensor, reward_matrix: torch.Tensor, names: list[str], zero_std: torch.Tensor,
                   failures: int, own: torch.Tensor | None = None) -> dict:
    """The step's rewards over all ranks: the weighted sum's mean and std over the completions that have one and
    the share that has none (`unscored_frac`: no function scored them), each function's mean and std over the
    completions it scored and the share it did not score (NaN) of those it was to score (`own` (N, k): in a
    mixture, the rows of its tasks; else all), the share of groups without signal (`zero_std`, per completion),
    and the reward functions' failures so far."""
    own = torch.ones_like(reward_matrix, dtype=torch.bool) if own is None else own
    scored = ~reward_matrix.isnan() & own
    r = reward_matrix.where(scored, 0.0)
    t = sum_over_ranks({"n": len(rewards), "scored": (~rewards.isnan()).sum(), "reward": rewards.nansum(),
                        "sq": rewards.pow(2).nansum(), "zero_std": zero_std.sum(), "failures": failures,
                        **{f"r/{name}": r[:, i].sum() for i, name in enumerate(names)},
                        **{f"sq/{name}": r[:, i].pow(2).sum() for i, name in enumerate(names)},
                        **{f"n/{name}": scored[:, i].sum() for i, name in enumerate(names)},
                        **{f"own/{name}": own[:, i].sum() for i, name in enumerate(names)}})
    metrics = dict(zip(("reward", "reward_std"), mean_and_std(t["reward"], t["sq"], t["scored"])))
    metrics["unscored_frac"] = 1 - t["scored"] / t["n"]
    for name in names:  # NaN for a function none of whose tasks' rows this step has (a mixture)
        metrics[f"rewards/{name}"], metrics[f"rewards/{name}_std"] = mean_and_std(t[f"r/{name}"], t[f"sq/{name}"],
                                                                                   t[f"n/{name}"]) \
            if t[f"own/{name}"] else (math.nan, math.nan)
        metrics[f"rewards/{name}_nan_frac"] = 1 - t[f"n/{name}"] / t[f"own/{name}"] if t[f"own/{name}"] else math.nan
    return {**metrics, "frac_zero_std_groups": t["zero_std"] / t["n"], "scorer_failures": t["failures"]}


class ScoringWatch:
    """Stops a run that goes on learning from nothing: counts the steps in a row in which a reward function
    failed (raised, hung) on every completion over all ranks (a judge whose endpoint went down), or in which
    no completion got any reward. The first such step of each prints a warning; `limit` steps in a row stop
    the run (0 = never). A function that returns None for every completion is not failing: it chose not to.
    `signal` warns of steps whose rewards were all alike."""

    NOTHING = "(no function)"

    def __init__(self, names: list[str], limit: int):
        self.limit, self.streak, self.warned = limit, dict.fromkeys([*names, self.NOTHING], 0), set()
        self.steps = self.agreed = 0  # steps of this run; of them, the last ones in a row whose groups all agreed

    def signal(self, frac_zero_std_groups: float, step: int, last: bool, first: int = 3):
        """Warns once when every group's rewards agreed in each of the run's `first` steps (or in every step of a
        shorter run): no advantage, so the policy has learned nothing from its rewards (TRL goes on without a
        word). Not later: a run that has learned may well see steps in which every group agrees."""
        self.steps += 1
        self.agreed = self.agreed + 1 if frac_zero_std_groups >= 1 else 0
        if self.agreed == self.steps and (self.agreed == first or last) and "signal" not in self.warned:
            self.warned.add("signal")
            print0(f"warning: in the first {self.agreed} steps (up to step {step}) every group's rewards agreed "
                   "(frac_zero_std_groups 1): no advantage, so nothing is learned from the rewards. They do not "
                   "tell this model's completions apart: check the reward functions on a few completions (rollouts"
                   ".jsonl), make the task fit the model, or raise --num_generations or --temperature")

    def update(self, failed: dict[str, int], attempted: dict[str, int], rewards: torch.Tensor, step: int):
        """failed[name] of attempted[name] completions (those of its tasks) this step, on this rank."""
        t = sum_over_ranks({"n": len(rewards), f"down/{self.NOTHING}": rewards.isnan().sum(),
                            f"of/{self.NOTHING}": len(rewards),
                            **{f"down/{name}": failed[name] for name in self.streak if name != self.NOTHING},
                            **{f"of/{name}": attempted[name] for name in self.streak if name != self.NOTHING}})
        for name in self.streak:
            if not t[f"of/{name}"]:  # no completion of its tasks this step: nothing to judge it by
                continue
            self.streak[name] = self.streak[name] + 1 if t[f"down/{name}"] == t[f"of/{name}"] else 0
            what = (f"reward function {name} failed on every completion" if name != self.NOTHING
                    else "no reward function scored any completion")
            if self.streak[name] and name not in self.warned:
                self.warned.add(name)
                print0(f"warning: {what} of step {step}: those completions teach nothing (unscored_frac, "
                       f"rewards/<name>_nan_frac, scorer_failures). The run stops after --max_unscored_steps "
                       f"{self.limit} such steps in a row.")
            if self.limit and self.streak[name] >= self.limit:
                raise RunStopped(f"{what} in {self.streak[name]} steps in a row (up to step {step}); nothing was "
                                 "learned from them. Fix the function (or the service it calls), or raise "
                                 "--max_unscored_steps (0 = never stop).")


def training_metrics(sums: dict, grad_norms: list[torch.Tensor], lengths: torch.Tensor, truncated: torch.Tensor,
                     diff: torch.Tensor, compared: torch.Tensor, kl: bool = True) -> dict:
    """The step's completions and updates over all ranks: lengths and truncation; the loss terms per token
    trained (`sums`: accumulate_gradients' sums of per-token statistics; the KL to the reference if `kl`,
    i.e. the run has a reference); the updates' loss and gradient
    norm; the sync comparison with the sampler (`diff` of the `compared` tokens); the importance ratios
    pi_old / pi_sampler before truncation or masking."""
    sums = dict(sums)
    ext = extremes_over_ranks({"length_min": lengths.min(), "length_max": lengths.max(), "diff_max": diff.max(),
                               **{k: sums.pop(k) for k in ("is_ratio_min", "is_ratio_max") if k in sums}})
    t = sum_over_ranks({"n": len(lengths), "length": lengths.sum(), "truncated": truncated.sum(), "diff": diff.sum(),
                        "compared": compared.sum(), **sums})
    N, T, norms = t["n"], t.get("tokens", 0.0), [g.item() for g in grad_norms]
    per_token = lambda k: t.get(k, 0.0) / T if T else math.nan  # nan: no token trained (every group dropped)
    metrics = {"completion_length": t["length"] / N, "completion_length_min": ext["length_min"],
               "completion_length_max": ext["length_max"], "truncated_frac": t["truncated"] / N,
               **({"kl": per_token("kl")} if kl else {}), "entropy": per_token("entropy"),
               **{f"clip_ratio/{k}": per_token(f"clip_{k}") for k in ("low", "high", "region")},
               "policy_masked_frac": per_token("policy_masked"),  # off-policy and high-entropy masks
               "loss": t.get("loss", 0.0) / len(norms), "grad_norm": sum(norms) / len(norms),
               "skipped_updates": sum(not math.isfinite(g) for g in norms),
               "sampler_logprob_diff_mean": t["diff"] / t["compared"] if t["compared"] else math.nan,
               "sampler_logprob_diff_max": ext["diff_max"] if t["compared"] else math.nan}
    if "is_ratio" in t and t["tokens"] > 0:
        metrics |= {"is_ratio/mean": t["is_ratio"] / T, "is_ratio/min": ext["is_ratio_min"],
                    "is_ratio/max": ext["is_ratio_max"], "is_ratio/dropped_frac": t["is_dropped"] / T}
    return metrics


def rollout_records(episodes, texts: list[str], reward_matrix: torch.Tensor, names: list[str], rewards: torch.Tensor,
                    tokenizer, prompt_index: list[int], extra: dict | None = None, advantages=None,
                    **fields) -> list[dict]:
    """One rollouts.jsonl record per episode: `fields` (step, split, policy version, rank), the prompt as the
    model saw it, the row's other columns, the completion, each reward (None = not scored), their weighted
    sum, the advantage, and what reward functions logged with log_extra."""
    return [{**fields, "prompt_index": prompt_index[i], "prompt": tokenizer.decode(e.prompt_ids),
             "columns": columns_of(e.row), "completion": texts[i], "rewards": named_rewards(reward_matrix[i], names),
             "reward": None if rewards[i].isnan() else rewards[i].item(),
             **({} if advantages is None else {"advantage": advantages[i].item()}),
             "finish_reason": e.finish_reason, "completion_tokens": len(e.completion_ids),
             **{column: values[i] for column, values in (extra or {}).items()}}
            for i, e in enumerate(episodes)]


def console_line(metrics: dict, names: list[str], max_steps: int) -> str:
    """step 3/12 | reward 0.412 ±0.301 | accuracy 0.25 format 0.16 | kl 0.0012 | len 31 | gen 16.1s score ...;
    in a mixture, each task's reward after the functions' (| arithmetic 0.41 parity 0.30); kl only with a
    reference model."""
    tasks = [k.split("/")[1] for k in metrics if k.startswith("task/") and k.endswith("/prompts")]
    return (f"step {metrics['step']}/{max_steps} | reward {metrics['reward']:.3f} ±{metrics['reward_std']:.3f} | "
            + " ".join(f"{name} {metrics[f'rewards/{name}']:.2f}" for name in names)
            + "".join(f"{' |' if i == 0 else ''} {t} {metrics.get(f'task/{t}/reward', math.nan):.2f}"
                      for i, t in enumerate(tasks))
            + (f" | kl {metrics['kl']:.4f}" if "kl" in metrics else "") + f" | len {metrics['completion_length']:.0f} | "
            + " ".join(f"{short} {metrics[f'time/{phase}']:.1f}s" for short, phase in (
                ("gen", "generate"), ("score", "score"), ("logp", "old_ref"), ("train", "train"), ("sync", "sync"))))


def check_finite(skipped: int, bad_steps: int, step: int, limit: int = 3) -> int:
    """Steps in a row, up to `step`, with an update skipped for a NaN/inf loss or gradient; stops the run at
    `limit` of them (the weights have not changed since). `skipped` is the same on every rank: so is the stop."""
    bad_steps = bad_steps + 1 if skipped else 0
    if skipped:
        print0(f"step {step}: the loss or gradient was not finite (NaN/inf) in {skipped} update(s), skipped")
    if bad_steps == limit:
        raise RunStopped(
            f"the loss or gradient was not finite in {bad_steps} steps in a row (up to step {step}); stopping. Their "
            "updates were skipped: the weights are those from before them. Likely causes: a reward function "
            "returning inf, a learning rate too high for the model, fp16/bf16 overflow.")
    return bad_steps
