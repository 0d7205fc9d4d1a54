"""Task mixtures (README: Task mixtures): several datasets or environments in one run, each scored by its own
reward functions.

A task is one source of prompts: a dataset (or an environment that makes its prompts) with a name, a sampling
weight, its reward functions and their weights, and optionally its own rollout, environment, tools and system
prompt. A run with one --dataset is a mixture of one task and runs as it always did. Several are named so:

    --dataset arithmetic:0.7,compare:0.3          # source[:weight],... (name=source to name one)
    --dataset mixture.yaml                        # a YAML or JSON file with a list `tasks:` (TASK_KEYS)
    --env calc=embedded:Calculator,guess=embedded:Guess --dataset data.jsonl
                                                  # TRL's form: each row's `environment` column picks its task

Sampling: each step draws the task of each of its prompts by the weights, seeded by the step (a resumed run
draws the same), and takes each task's next prompts from that task's own shuffled order. A group is the G
completions of one prompt, so it never mixes tasks. Every row of a mixture carries its task's name in a `task`
column.

Rewards: the reward matrix has a column for each reward function of any task (their union), then one for each
environment's get_reward(). A function scores only the rows of its tasks; the other rows stay NaN there (not
scored, as a function's None). rewards.postprocess_rewards sees the matrix and each row's task, and a row's
reward is the weighted sum of its own task's columns with its task's weights.
"""
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from agents import agent_rollout_for, is_agent
from config import (EMBEDDED_ENVIRONMENTS, EMBEDDED_TASKS, NO_DATASET, NO_DATASET_STARTS, UsageError, is_mixture_spec,
                    split_weight)
from data import encode_prompt, epoch_order, load_rows, step_prompt_indices
from metrics import pass_at_k
from rewards import is_reward_model, load_reward_func
from rollout import generate, load_rollout, run_rollout, slot_seed
from tool_calls import reader_for
from tools import probe_trajectory, tool_rollout_for, trajectory_metrics
from utils import sum_over_ranks
from vision import prompt_lengths, vision_probe, vision_rollout
from weight_sync import Probe


@dataclass
class Task:
    """One source of a mixture, as given (the keys of a mixture file), then loaded (load_mixture)."""
    name: str
    dataset: str
    weight: float = 1.0  # sampling weight; the weights of a mixture need not sum to 1
    reward_funcs: str = ""  # comma-separated, as --reward_funcs ("" = --reward_funcs)
    reward_weights: str = ""  # one per function ("" = all 1.0, or --reward_weights with --reward_funcs)
    rollout: str = ""  # module:function ("" = --rollout)
    env: str = ""  # module:factory or an embedded environment ("" = --env, unless a mixture names several)
    tools: str = ""  # module:function,... ("" = --tools)
    system_prompt: str = ""  # ("" = --system_prompt)
    prompt_column: str = ""
    answer_column: str = "answer"
    dataset_split: str = "train"
    eval_dataset: str = ""  # its held-out rows ("" = the embedded task's own, else none)
    eval_split: str = "test"
    environment: str = ""  # TRL's form: this task is the rows whose `environment` column is this
    # The fields below are filled by load_mixture.
    rows: list = field(default_factory=list, repr=False)
    eval_rows: list = field(default_factory=list, repr=False)
    rollout_fn: object = None
    env_reward: str | None = None  # its environment's get_reward() column (the class's name), if it has one
    schemas: list | None = None  # its tools' JSON schemas (multi-turn), else None
    tool_parser: str = ""  # the parser that reads its model's tool calls (Mixture.read_tool_calls), once chosen


TASK_KEYS = [f.name for f in dataclasses.fields(Task) if f.name not in ("rows", "eval_rows", "rollout_fn", "env_reward",
                                                                          "schemas", "tool_parser", "environment")]


def is_mixture(cfg) -> bool:
    """Whether the flags name several tasks (or one in a mixture's form): --dataset with a comma, a weight or
    a name, or a mixture file; --env with names (TRL's dict of environments)."""
    return "=" in cfg.env or is_mixture_spec(cfg.dataset)


def parse_tasks(cfg) -> list[Task]:
    """The tasks the flags name, not yet loaded: UsageError naming the source for a weight that does not parse
    or is not positive, two tasks of one name, an unknown key in a mixture file."""
    globals_ = {k: getattr(cfg, k) for k in TASK_KEYS if hasattr(cfg, k)}
    if "=" in cfg.env:  # TRL's form: a dict of environments, the dataset's `environment` column picks one
        tasks, own = [], []  # each task is scored by the flags' reward functions
        for part in (p.strip() for p in cfg.env.split(",") if p.strip()):
            name, eq, factory = part.partition("=")
            if not eq or not name.strip() or not factory.strip():
                raise UsageError(f"--env {cfg.env}: give name=module:factory,... (TRL's dict of environments), each "
                                 "name a value of the dataset's `environment` column")
            # Weight NaN: the task is drawn by its share of the dataset's rows.
            tasks.append(Task(**{**globals_, "name": name.strip(), "env": factory.strip(),
                                 "environment": name.strip(), "weight": math.nan}))
    elif is_mixture_spec(cfg.dataset) and cfg.dataset.endswith((".yaml", ".yml", ".json")):
        own = [{**_task_defaults(entry, cfg), **entry} for entry in _read_mixture_file(cfg.dataset)]
        tasks = [Task(**{**globals_, **entry}) for entry in own]
    elif is_mixture_spec(cfg.dataset):
        tasks, own = [], []  # own: what each task brings itself (its entry, an embedded task's rewards)
        for part in (p.strip() for p in cfg.dataset.split(",")):
            if not part:
                raise UsageError(f"--dataset {cfg.dataset}: an empty source between commas; give source[:weight],...")
            name, eq, spec = part.partition("=") if "=" in part and not os.path.exists(part) else ("", "", part)
            source, weight = (spec, None) if os.path.exists(spec) else split_weight(spec)
            if weight is None and ":" in spec and not os.path.exists(spec):  # a weight that is no number
                source, _, weight = spec.rpartition(":")
            # With --env, an embedded task's preset does not apply.
            own.append(_task_defaults({"dataset": source.strip(), "env": cfg.env}, cfg))
            tasks.append(Task(**{**globals_, **own[-1], "name": name.strip() or source_name(source),
                                 "dataset": source.strip(), "weight": _parse_weight(weight or "1", source.strip())}))
    else:  # one dataset (an embedded task's flags are set by config.parse_config, unless given)
        return [Task(**{**globals_, "name": source_name(cfg.dataset)})]
    if cfg.eval_dataset and "=" not in cfg.env:
        raise UsageError("--eval_dataset with a mixture of datasets: give each task its own eval_dataset in a "
                         "mixture file (README: Task mixtures)")
    names = [t.name for t in tasks]
    for name in names:
        if not name or any(c in name for c in "/,:= "):
            raise UsageError(f"task name {name!r}: a name is a word without / , : = or spaces (it names metrics, "
                             "task/<name>/reward); name the task, e.g. gsm8k=./train.jsonl")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"two tasks are named {twice[0]!r}: name each, e.g. --dataset easy=./a.jsonl,hard=./b.jsonl "
                         "or `name:` in a mixture file")
    for flag in ("reward_funcs", "reward_weights"):  # refused where every task brings its own rewards
        if cfg.gives(flag) and own and all("reward_funcs" in o for o in own):
            raise UsageError(f"--{flag} {getattr(cfg, flag)} scores none of the tasks: each has its own "
                             f"({', '.join(f'{t.name}: {t.reward_funcs}' for t in tasks)}); to change a task's, give "
                             "it reward_funcs in a mixture file (README: Task mixtures)")
    for t in tasks:
        if t.env in EMBEDDED_ENVIRONMENTS:
            t.env = EMBEDDED_ENVIRONMENTS[t.env][0]
    return tasks


def _task_defaults(entry: dict, cfg) -> dict:
    """What a mixture's task gets unless its entry says otherwise: an embedded environment's own reward
    functions, or (without an env) an embedded task's own rewards and, unless --system_prompt is given, its
    system prompt (config.EMBEDDED_ENVIRONMENTS, EMBEDDED_TASKS). A preset's reward weights go with its
    functions only."""
    if entry.get("env"):
        preset = EMBEDDED_ENVIRONMENTS.get(entry["env"], ("", {}))[1]
    else:
        preset = EMBEDDED_TASKS.get(entry.get("dataset"), {})
    out = {"system_prompt": preset["system_prompt"]} if "system_prompt" in preset and not cfg.system_prompt else {}
    if "reward_funcs" in preset and "reward_funcs" not in entry:
        out |= {"reward_funcs": preset["reward_funcs"], "reward_weights": preset.get("reward_weights", "")}
    return out


def source_name(dataset: str) -> str:
    """A task's name from its source: an embedded name as it is, a file's stem, a hub dataset's last part."""
    return os.path.splitext(os.path.basename(dataset.rstrip("/")))[0] if "/" in dataset or "." in dataset \
        else dataset


def _parse_weight(text, source: str) -> float:
    try:
        weight = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"task {source}: weight {text!r} is not a number; give a positive number, e.g. "
                         f"{source}:0.5") from None
    if not weight > 0 or math.isinf(weight):
        raise UsageError(f"task {source}: weight {text!r} must be a positive number (a task with weight 0 is one to "
                         "leave out of the mixture)")
    return weight


def _read_mixture_file(path: str) -> list[dict]:
    """The `tasks:` of a mixture file, each a dict of TASK_KEYS with `dataset` (or an `env` that makes its
    prompts)."""
    if not os.path.isfile(path):
        raise UsageError(f"--dataset {path}: no such mixture file")
    try:
        with open(path) as f:
            if path.endswith(".json"):
                spec = json.load(f)
            else:
                import yaml
                spec = yaml.safe_load(f)
    except Exception as e:
        raise UsageError(f"--dataset {path}: not a readable mixture file ({type(e).__name__}: {e})") from None
    entries = spec.get("tasks") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"--dataset {path}: a mixture file holds `tasks:`, a list of tasks, each with a dataset and "
                         f"any of {', '.join(k for k in TASK_KEYS if k != 'dataset')}")
    out = []
    for i, entry in enumerate(entries):
        where = f"task {entry.get('name', i + 1)} in {path}"
        unknown = sorted(set(entry) - set(TASK_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r}; a task takes {', '.join(TASK_KEYS)}")
        if "dataset" not in entry and not entry.get("env"):
            raise UsageError(f"{where}: give its dataset (or an env, with dataset: none)")
        entry = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in entry.items() if v is not None}
        entry.setdefault("dataset", NO_DATASET)
        entry = {k: v if k == "weight" else str(v) for k, v in entry.items()}
        entry["name"] = entry.get("name") or source_name(entry["dataset"])
        entry["weight"] = _parse_weight(entry.get("weight", 1), entry["name"])
        out.append(entry)
    return out


class Mixture:
    """The loaded tasks of a run: their rows (all of them in one list, task by task), the reward columns, and
    what each task's rows are scored and weighted with. names: the k reward columns; own (T, k): the columns
    of each task; weights (T, k): each task's weight of each of its columns (0 elsewhere)."""

    def __init__(self, tasks: list[Task], mixed: bool):
        # mixed: several tasks, or one in a mixture's form; such a run logs per-task metrics.
        self.tasks, self.mixed = tasks, mixed
        self.index_of = {t.name: i for i, t in enumerate(tasks)}
        functions = list(dict.fromkeys(n for t in tasks for n in _names(t.reward_funcs)))
        self.env_names = list(dict.fromkeys(t.env_reward for t in tasks if t.env_reward))
        self.functions, self.names = functions, functions + self.env_names
        self.own = torch.zeros(len(tasks), len(self.names), dtype=torch.bool)
        self.weights = torch.zeros(len(tasks), len(self.names))
        for i, t in enumerate(tasks):
            for name, w in zip(_names(t.reward_funcs) + [t.env_reward] * bool(t.env_reward), _weights(t)):
                self.own[i, self.names.index(name)] = True
                self.weights[i, self.names.index(name)] = w
        self.first = torch.tensor([self.names.index((_names(t.reward_funcs) + [t.env_reward])[0]) for t in tasks])
        self.rows = [row for t in tasks for row in t.rows]
        self.offsets = [sum(len(t.rows) for t in tasks[:i]) for i in range(len(tasks))]
        self.eval_rows = [row for t in tasks for row in t.eval_rows]
        # TRL's form (NaN weights): each task is drawn as often as the dataset has its rows.
        share = torch.tensor([len(t.rows) for t in tasks], dtype=torch.float64)
        self.draw_weights = torch.tensor([share[i] if math.isnan(t.weight) else t.weight for i, t in enumerate(tasks)],
                                         dtype=torch.float64)
        self._counts = {}  # seed -> [(T,) prompts drawn of each task before step s, for s = 0, 1, ...]
        self._orders = {}  # (task, seed) -> {epoch: its order}

    def task_index(self, rows: list[dict]) -> torch.Tensor:
        """(N,) the task of each row."""
        return torch.tensor([self.index_of[row["task"]] if self.mixed else 0 for row in rows], dtype=torch.long)

    def names_of(self, tasks: torch.Tensor) -> list[str]:
        return [self.tasks[t].name for t in tasks.tolist()]

    def env_reward_of(self, tasks: torch.Tensor) -> list[str | None]:
        return [self.tasks[t].env_reward for t in tasks.tolist()]

    def own_of(self, episodes: list) -> torch.Tensor:
        """(N, k) which reward columns belong to each episode's task."""
        return self.own[self.task_index([e.row for e in episodes])]

    def weighting(self, episodes: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, k) each episode's task's reward weights, and (N, k) its task's columns
        (rewards.weighted_rewards)."""
        tasks = self.task_index([e.row for e in episodes])
        return self.weights[tasks], self.own[tasks]

    def sync_probe(self, tokenizer, processor) -> Probe:
        """The fixed trajectory the server scores after pushes, to catch a sync that silently went wrong: the
        first task's first prompt, with its system prompt and tools (a tool call, as the multi-turn rollout
        renders it), or its image (a vision-language model), then a fixed answer."""
        first, row = self.tasks[0], self.rows[0]
        answer = " Let me think. 12 + 7 = 19, so the answer is \\boxed{19}."
        if first.schemas:
            return Probe(probe_trajectory(tokenizer, row["prompt"], first.system_prompt, first.schemas))
        if processor:
            return vision_probe(processor, row, first.system_prompt, answer)
        return Probe(encode_prompt(tokenizer, row["prompt"], first.system_prompt) + tokenizer(answer)["input_ids"])

    def describe(self) -> str:
        """For the start line: `rewards ['accuracy', 'format'] x [1.0, 1.0]` (and the parser of its tool calls,
        the system prompt, if there are), or each task's weight, rewards and parser."""
        if not self.mixed:
            system, parser = self.tasks[0].system_prompt, self.tasks[0].tool_parser
            return (f"rewards {self.names} x {self.weights[0].tolist()}"
                    + (f" | tool calls: {parser}" if parser else "") + (f' | system "{system}"' if system else ""))
        share = (self.draw_weights / self.draw_weights.sum()).tolist()
        return "tasks " + ", ".join(f"{t.name} {p:.2f} {[n for n, o in zip(self.names, self.own[i]) if o]}"
                                    + (f" calls: {t.tool_parser}" if t.tool_parser else "")
                                    for i, (t, p) in enumerate(zip(self.tasks, share)))

    @property
    def calls_tools(self) -> bool:
        """Whether a task runs the multi-turn rollout (--tools, --env) or an agent, whose model calls tools."""
        return any(t.schemas is not None or (t.env and is_agent(t.env)) for t in self.tasks)

    def read_tool_calls(self, parser: str, tokenizer, model: str) -> str:
        """Give each multi-turn task the reader of its model's tool calls: parser `parser` (--tool_call_parser), or
        with auto the one that reads back a call the chat template writes, proven by that round trip
        (tool_calls.reader_for: a one-line UsageError where it fails). Returns what each reads, for its check."""
        said = []
        for task in self.tasks:
            agent = task.env and is_agent(task.env)
            if task.schemas is None and not agent:  # a user's or the single-turn rollout: no calls to read here
                continue
            with _about(task, self.mixed):
                try:
                    reader = reader_for(parser, tokenizer, task.schemas, model)
                except Exception as e:  # the round trip may also fail in the template (DeepSeek-V3's: str + dict)
                    if not agent or (parser != "auto" and isinstance(e, UsageError)):
                        raise
                    # An agent may call no tools: its calls with tools=[...] raise, saying why (agents.py).
                    unread = str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e}"
                    task.rollout_fn = functools.partial(task.rollout_fn, unread=unread)
                    said.append((f"{task.name}: " if self.mixed else "") + "no parser reads the chat template's "
                                "calls: an agent's call with tools raises")
                    continue
            task.rollout_fn, task.tool_parser = functools.partial(task.rollout_fn, reader=reader), reader.name
            said.append((f"{task.name}: " if self.mixed else "") + f"{reader.name} reads back the call the chat "
                        f"template writes as {reader.example[:80]!r}")
        return "; ".join(said)

    def summary_names(self) -> dict[str, list[str]]:
        """The reward functions of the run's last line (metrics.eval_summary), under their metrics' prefix:
        all of them under eval/, or in a mixture each task's own under eval/task/<name>/."""
        if not self.mixed:
            return {"eval": self.names}
        return {f"eval/task/{t.name}": [n for n, o in zip(self.names, self.own[i]) if o]
                for i, t in enumerate(self.tasks) if t.eval_rows}

    def longest_prompt(self, tokenizer, processor, limit: int) -> int:
        """The longest prompt in tokens of any task's rows, with its system prompt and tools (every image is
        read); UsageError if it is over `limit` (--max_prompt_length)."""
        longest = max(max(prompt_lengths(tokenizer, processor, t.rows + t.eval_rows, t.system_prompt, t.schemas))
                      for t in self.tasks)
        if longest > limit:
            raise UsageError(f"the longest prompt has {longest} tokens > --max_prompt_length {limit}: raise it (and "
                             "the server's --max-model-len) or drop the long prompts from the dataset")
        return longest

    def columns_of(self, name: str) -> list[str]:
        """The columns of the rows that reward function `name` scores (what its signature is checked
        against)."""
        return list(dict.fromkeys(c for i, t in enumerate(self.tasks) if self.own[i, self.names.index(name)]
                                  for c in (t.rows[0] if t.rows else {})))

    # ------------------------------------------------------------------ sampling
    def step_rows(self, step: int, prompts_per_step: int, seed: int) -> list[int]:
        """The rows (indices into self.rows) of step `step` (0-based), over all ranks. Each prompt's task is
        drawn by the weights (a generator seeded by seed and step), and each task's prompts come in its own
        seeded order, epoch after epoch, from where the steps before left it: the rows depend only on (seed,
        step)."""
        if len(self.tasks) == 1:
            return step_prompt_indices(step, len(self.rows), prompts_per_step, seed)
        drawn = self._drawn_before(step, prompts_per_step, seed).clone()  # (T,)
        out = []
        for t in self._draw(step, prompts_per_step, seed).tolist():
            n = len(self.tasks[t].rows)
            epoch, pos = divmod(int(drawn[t]), n)
            out.append(self.offsets[t] + self._order(t, seed, epoch)[pos])
            drawn[t] += 1
        return out

    def _order(self, t: int, seed: int, epoch: int) -> list[int]:
        """Task t's shuffled order of its rows in `epoch` (data.epoch_order), the last two of each task and
        seed kept: a step takes prompts of every task, in turn."""
        key = (t, seed)
        if epoch not in self._orders.setdefault(key, {}):
            self._orders[key] = {e: o for e, o in self._orders[key].items() if e == epoch - 1}
            self._orders[key][epoch] = epoch_order(len(self.tasks[t].rows), seed + 7_919 * t, epoch)
        return self._orders[key][epoch]

    def _draw(self, step: int, prompts_per_step: int, seed: int) -> torch.Tensor:
        """(prompts_per_step,) the task of each prompt of `step`."""
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2 ** 63)
        return torch.multinomial(self.draw_weights, prompts_per_step, replacement=True, generator=generator)

    def _drawn_before(self, step: int, prompts_per_step: int, seed: int) -> torch.Tensor:
        counts = self._counts.setdefault(seed, [torch.zeros(len(self.tasks), dtype=torch.long)])
        # Each step's draw once, from the first step on (a resumed run draws them all again).
        while len(counts) <= step:
            s = len(counts) - 1
            counts.append(counts[-1] + torch.bincount(self._draw(s, prompts_per_step, seed), minlength=len(self.tasks)))
        return counts[step]

    # ------------------------------------------------------------------ rollouts
    def rollout(self, rows: list[dict], ctx) -> list:
        """The rollout of a batch of several tasks (rollout.py's contract): each task's rollout on its rows,
        with its system prompt, all at once (the server batches them); the episodes in the order of the
        rows."""
        G, parts = ctx.num_generations, {}
        for i, t in enumerate(self.task_index(rows).tolist()):
            parts.setdefault(t, []).append(i)

        # Each task gets a seed of its own, so that no two tasks' sample slots share a random stream.
        def run(t: int, positions: list[int]) -> list:
            task = self.tasks[t]
            return run_rollout(task.rollout_fn, [rows[i] for i in positions],
                               dataclasses.replace(ctx, system_prompt=task.system_prompt, seed=slot_seed(ctx.seed, t)))
        if len(parts) <= 1:  # one task (or none: a rank without evaluation prompts), as one call
            t, positions = next(iter(parts.items()), (0, []))
            return run(t, positions)
        with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
            done = {t: pool.submit(run, t, positions) for t, positions in parts.items()}
            episodes = [None] * (len(rows) * G)
            for t, positions in parts.items():
                for j, e in enumerate(done[t].result()):
                    episodes[positions[j // G] * G + j % G] = e
        return episodes

    # ------------------------------------------------------------------ metrics
    def eval_metrics(self, rows: list[dict], matrix: torch.Tensor, rewards: torch.Tensor, lengths: torch.Tensor,
                     n: int, pass_k: list[int]) -> dict:
        """An evaluation's metrics over all ranks (`rows`: this rank's, n completions each): the mean reward,
        each function's mean over the completions of its tasks (not scored = 0), pass@k (correct: the task's
        first reward function >= 1) and the mean length; per task too (eval/task/<name>/...) in a mixture."""
        t = self.task_index(rows)  # (prompts,)
        correct = (matrix[torch.arange(len(matrix)), self.first[t.repeat_interleave(n)]] >= 1).view(-1, n).sum(dim=1)
        values = matrix.nan_to_num(0.0)
        sums = {"length": lengths.sum()}
        for i in range(len(self.tasks)):
            mine = t == i
            completions = mine.repeat_interleave(n)
            sums |= {f"{i}/prompts": mine.sum(), f"{i}/reward": rewards[completions].nansum(),
                     **{f"{i}/{j}": values[completions, j].sum() for j in self.own[i].nonzero().flatten().tolist()},
                     **{f"{i}/pass@{k}": sum(pass_at_k(n, c, k) for c in correct[mine].tolist()) for k in pass_k}}
        s = sum_over_ranks(sums)

        def summary(prefix: str, tasks: list[int]) -> dict:
            prompts = sum(s[f"{i}/prompts"] for i in tasks)
            out = {f"{prefix}/reward": sum(s[f"{i}/reward"] for i in tasks) / max(prompts * n, 1)}
            for j, name in enumerate(self.names):
                owners = [i for i in tasks if self.own[i, j]]
                if owners:
                    out[f"{prefix}/rewards/{name}"] = (sum(s[f"{i}/{j}"] for i in owners)
                                                       / max(sum(s[f"{i}/prompts"] for i in owners) * n, 1))
            return out | {f"{prefix}/pass@{k}": sum(s[f"{i}/pass@{k}"] for i in tasks) / max(prompts, 1)
                          for k in pass_k} | {f"{prefix}/num_prompts": prompts}
        out = summary("eval", list(range(len(self.tasks))))
        out["eval/completion_length"] = s["length"] / max(out["eval/num_prompts"] * n, 1)
        for i, task in enumerate(self.tasks if self.mixed else []):
            if task.eval_rows:
                out |= summary(f"eval/task/{task.name}", [i])
        return out

    def trajectory_metrics(self, episodes: list) -> dict:
        """tools.trajectory_metrics over the trajectories of the tasks with tools or an environment; {} if
        none has."""
        if not any(task.tools or task.env for task in self.tasks):
            return {}
        t = self.task_index([e.row for e in episodes]).tolist()
        return trajectory_metrics([e for e, i in zip(episodes, t) if self.tasks[i].tools or self.tasks[i].env])

    def metrics(self, episodes: list, rewards: torch.Tensor, matrix: torch.Tensor, zero_std: torch.Tensor,
                G: int) -> dict:
        """Over all ranks: the trajectories' metrics of the tasks with tools or an environment
        (tools.trajectory_metrics), and in a mixture per task: `task/<name>/prompts` (this step's),
        `task/<name>/reward` (the mean over its scored completions), `task/<name>/rewards/<fn>` for each of
        its functions (the mean over the completions it scored), `task/<name>/frac_zero_std_groups`."""
        t = self.task_index([e.row for e in episodes])  # (N,)
        out = self.trajectory_metrics(episodes)
        if not self.mixed:
            return out
        sums = {}
        for i, task in enumerate(self.tasks):
            mine = t == i
            r = rewards[mine]
            sums |= {f"{i}/n": int(mine.sum()), f"{i}/scored": (~r.isnan()).sum(), f"{i}/reward": r.nansum(),
                     f"{i}/zero_std": zero_std[mine].sum()}
            for j in self.own[i].nonzero().flatten().tolist():
                column = matrix[mine, j]
                sums |= {f"{i}/r/{j}": column.nansum(), f"{i}/n/{j}": (~column.isnan()).sum()}
        s = sum_over_ranks(sums)
        for i, task in enumerate(self.tasks):
            key = f"task/{task.name}"
            out[f"{key}/prompts"] = s[f"{i}/n"] / G
            if s[f"{i}/n"]:
                out[f"{key}/reward"] = s[f"{i}/reward"] / s[f"{i}/scored"] if s[f"{i}/scored"] else math.nan
                out[f"{key}/frac_zero_std_groups"] = s[f"{i}/zero_std"] / s[f"{i}/n"]
                for j in self.own[i].nonzero().flatten().tolist():
                    n = s[f"{i}/n/{j}"]
                    out[f"{key}/rewards/{self.names[j]}"] = s[f"{i}/r/{j}"] / n if n else math.nan
        return out


def _names(spec: str) -> list[str]:
    return [n.strip() for n in spec.split(",") if n.strip()]


def _weights(task: Task) -> list[float]:
    """The weights of a task's reward columns: its functions' (reward_weights, else 1.0 each), 1.0 for its
    environment's reward."""
    names = _names(task.reward_funcs)
    if len(set(names)) < len(names):
        raise UsageError(f"task {task.name}: reward_funcs {task.reward_funcs!r} names a function twice; give it once, "
                         "with the sum of its weights")
    try:
        weights = [float(w) for w in task.reward_weights.split(",")] if task.reward_weights.strip() else \
            [1.0] * len(names)
    except ValueError:
        raise UsageError(f"task {task.name}: reward_weights {task.reward_weights!r}: use comma-separated numbers, "
                         "e.g. 1.0,0.5") from None
    if len(weights) != len(names):
        raise UsageError(f"task {task.name}: {len(weights)} reward_weights for {len(names)} reward_funcs: give one "
                         "weight per function")
    return weights + [1.0] * bool(task.env_reward)


@contextmanager
def _about(task: Task, mixed: bool):
    """A UsageError inside names the task (in a mixture)."""
    try:
        yield
    except UsageError as e:
        raise UsageError(f"task {task.name}: {e}" if mixed else str(e)) from None


def load_mixture(cfg, tokenizer, processor=None) -> Mixture:
    """The tasks the flags name, loaded: their training and held-out rows (a mixture's tagged with `task`),
    their rollouts (multi-turn with tools or an environment), their reward functions checked against their
    columns. A mistake is a one-line UsageError naming the task: a source that cannot be loaded, an unknown
    reward function, a task with fewer rows than one step takes."""
    tasks, mixed = parse_tasks(cfg), is_mixture(cfg)
    load = functools.cache(lambda dataset, split, prompt, answer, starts: load_rows(
        dataset, split, prompt, answer, cfg.num_arithmetic_problems, cfg.seed, num_starts=starts))
    for task in tasks:
        with _about(task, mixed):
            if task.env and "=" in task.env:
                raise UsageError(f"env {task.env}: one environment per task (module:factory)")
            if task.rollout and (task.tools or task.env):
                raise UsageError("a rollout replaces the rollout that runs tools and an env: give one or the other")
            if task.dataset == NO_DATASET and not task.env:
                raise UsageError(f"dataset {NO_DATASET}: only an env makes its own prompts; name a dataset, or the env")
            loaded = load(task.dataset, task.dataset_split, task.prompt_column, task.answer_column, NO_DATASET_STARTS)
            # A `task` column of the dataset's own? Else it is the mixture's column, which reset does not get.
            had_task = bool(loaded) and "task" in loaded[0]
            task.rows = _rows_of(task, task.dataset, loaded, mixed)
            if dataclasses.replace(cfg, dataset=task.dataset, eval_dataset=task.eval_dataset, env="").evaluates():
                if not task.eval_dataset and os.path.isfile(task.dataset):
                    raise UsageError(f"--eval_steps with a local dataset {task.dataset}: it has no held-out split; "
                                     "give its eval_dataset (a .jsonl/.json/.parquet file with the same columns; in a "
                                     "mixture, a task's key in a mixture file)")
                source = task.eval_dataset or task.dataset
                rows = load(source, task.eval_split, task.prompt_column, task.answer_column, cfg.eval_num_prompts)
                task.eval_rows = _rows_of(task, source, rows, mixed, held_out=True)[:cfg.eval_num_prompts]
            if mixed and len(task.rows) < cfg.prompts_per_step:
                raise UsageError(f"{len(task.rows)} rows, fewer than one step takes (--prompts_per_step "
                                 f"{cfg.prompts_per_step}): a step drawn from it alone would repeat prompts; give "
                                 "it more rows, or lower --prompts_per_step")
            if task.env and is_agent(task.env):  # an OpenAI-client agent: it calls the server itself
                task.rollout_fn, task.env_reward, task.schemas = agent_rollout_for(cfg, task.env, task.tools,
                                                                                   processor is not None)
            # The multi-turn rollout: the model calls tools, an environment answers.
            elif task.tools or task.env:
                task.rollout_fn, task.env_reward, task.schemas = tool_rollout_for(
                    cfg, tokenizer, processor is not None, task.tools, task.env, _names(task.reward_funcs),
                    omit=("environment",) * bool(task.environment) + ("task",) * (mixed and not had_task))
            else:
                # The user's rollout, or one request per prompt: with images, or of text.
                task.rollout_fn = (load_rollout(task.rollout) if task.rollout else
                                   vision_rollout if processor else generate)
                if not _names(task.reward_funcs):
                    raise UsageError("no reward functions: name reward_funcs (see rewards.py)")
            _weights(task)  # checks that they parse, one per function
            for name in _names(task.reward_funcs):
                if not is_reward_model(name):
                    load_reward_func(name, list(task.rows[0]), cfg.reward_options(),
                                     rollout_fields=bool(task.rollout))  # a custom rollout may add fields
    if "=" in cfg.env:  # TRL's form: every row (held out too) names one of the environments
        known = [t.environment for t in tasks]
        evaluated = [(cfg.eval_dataset or cfg.dataset, cfg.eval_split, cfg.eval_num_prompts)] \
            if any(t.eval_rows for t in tasks) else []
        for dataset, split, starts in [(cfg.dataset, cfg.dataset_split, NO_DATASET_STARTS), *evaluated]:
            for i, row in enumerate(load(dataset, split, cfg.prompt_column, cfg.answer_column, starts)):
                if row.get("environment") not in known:
                    raise UsageError(f"dataset {dataset}, row {i}: environment {row.get('environment')!r} is not one "
                                     f"of --env's {known}; each row's `environment` column names the environment it "
                                     "runs in")
    return Mixture(tasks, mixed)


def _rows_of(task: Task, dataset: str, rows: list[dict], mixed: bool, held_out: bool = False) -> list[dict]:
    """A task's rows of a loaded dataset: those whose `environment` is the task's (TRL's form; held-out rows
    need not have every environment's), each with the task's name in a `task` column (in a mixture)."""
    if task.environment:
        rows = [row for row in rows if row.get("environment") == task.environment]
        if not rows and not held_out:
            raise UsageError(f"no row of dataset {dataset} has environment {task.environment!r}")
    if not mixed:
        return rows
    if any("task" in row and row["task"] != task.name for row in rows):
        raise UsageError(f"dataset {task.dataset} has a column 'task', which a mixture sets to the task's name; "
                         "rename that column")
    return [{**row, "task": task.name} for row in rows]


def resume_signature(cfg) -> dict:
    """What of the data a resumed run shares with the run it continues: a mixture's tasks (a mixture file can
    change between them), each task's name, source and weight, in order (none for one dataset: --dataset says
    it all); and the content hash of each local dataset file (an edited file is said on resume)."""
    tasks = parse_tasks(cfg) if is_mixture(cfg) else []
    files = [path for path in [t.dataset for t in tasks] or [cfg.dataset] if os.path.isfile(path)]
    return {"dataset_files": {path: file_hash(path) for path in files}} | ({} if not tasks else {"tasks": [
        {"name": t.name, "dataset": t.dataset, "split": t.dataset_split, "environment": t.environment,
         "weight": None if math.isnan(t.weight) else t.weight} for t in tasks]})


def file_hash(path: str) -> str:
    """The sha256 of a file's content, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
