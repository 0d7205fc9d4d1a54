"""The data: the rows of a dataset (a file, a folder, the hub, or an embedded task), prompts as chat messages
and through the chat template, and the order in which a run samples them (seeded, the same on resume). Not
here: the embedded tasks themselves (embedded.py), the batches of model inputs (logprobs.py, rollout.collate).
"""
import functools
import json
import os

import torch

from config import DEFAULT_DATASET, NO_DATASET, UsageError
from embedded import arithmetic_problems, parity_problems, shape_problems, three_digit_problems


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_prompt(prompt, where: str):
    """A prompt is text or a list of chat messages ({"role", "content"}); ValueError naming the row
    otherwise."""
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
    """The rows of the embedded task, a local json/jsonl/parquet file or a hub dataset (or a local folder in
    its layout, read the same way), every column kept as it is, with the prompt also under "prompt" (text, or
    a list of chat messages) and the reference answer, if the dataset has one, under "answer" (the built-in
    accuracy reads GSM8K's "... #### 42" as 42). With no dataset ("none": an environment makes the prompts),
    `num_starts` rows {"prompt": "", "seed": k} for its reset(**row), the held-out ones ("test") with seeds no
    training row has."""
    if dataset == DEFAULT_DATASET:
        return arithmetic_problems(num_arithmetic, seed, "test" if split == "test" else "train")
    if dataset == "parity":
        return parity_problems(num_arithmetic, seed, "test" if split == "test" else "train")
    if dataset == "three_digit":  # the calculator's task
        return three_digit_problems(num_arithmetic, seed, "test" if split == "test" else "train")
    if dataset == "shapes":  # the embedded vision task
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
    # The default answer column is optional; one named by the flag must be there.
    if answer_column and answer_column not in columns and answer_column != "answer":
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


def encode_prompts(tokenizer, prompts: list, system_prompt: str = "",
                   tools: list[dict] | None = None) -> list[list[int]]:
    """encode_prompt of each prompt, each distinct one once (the embedded task repeats a few hundred
    questions)."""
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
