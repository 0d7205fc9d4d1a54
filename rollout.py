"""Rollouts: how dataset rows become episodes, the unit every later part of a step works on.

An Episode is one completion of one prompt with everything the step needs from it. The rollout
function turns a batch of rows into episodes through the server; training, evaluation and the
async prefetch all call it. The default, `generate`, samples G completions of each prompt in one
request. `--rollout module:function` replaces it with your own, of the same signature:

    def my_rollout(rows: list[dict], ctx: RolloutContext) -> list[Episode]

The contract:
  - ctx.num_generations episodes per row, row by row (row i's are episodes [i*G, (i+1)*G)): they
    are its group, whose rewards are compared;
  - sample through ctx.client with ctx.sampling and ctx.seed: the same call then gives the same
    episodes, and the trainer calls it again, as it is, when the server reconnects (so no side
    effects beyond its result);
  - completion_ids are every token after the prompt; `sampled` marks those the policy sampled:
    only they get loss and importance weights and are compared with the server's log-probs. Mark
    tokens the policy did not sample (a forced prefix, a tool's output) False; `logprobs` holds the
    sampler's log-prob of each sampled token, NaN where it is not known (that token then gets no
    importance weight, ratio 1, and no sync comparison), any number for the tokens not sampled;
  - `extra` holds fields for the reward functions (TRL's rollout_func fields): each key reaches them as a
    keyword list beside the row's columns; it may not be the name of a column.
Samples that must be independent (the G of a group) must not share a random stream: vLLM seeds every prompt of
one request alike, so give each its own seed (slot_seed) in a request of its own (client.generate_each), or
sample them as the n of one prompt.
"""
import base64
import dataclasses
import functools
import hashlib
import importlib
import json
import math
from dataclasses import dataclass, field

import torch

from config import UsageError
from data import encode_prompt
from logprobs import PerPrompt
from rewards import EXTRA_ARGUMENTS
from utils import InThread, print0, unless_stopped
from vllm_client import ServerLost


@dataclass
class Episode:
    row: dict  # the dataset row it came from (every column)
    prompt_ids: list[int]  # the prompt as the model sees it (chat template applied)
    completion_ids: list[int]  # every token after the prompt
    sampled: list[bool]  # per completion token: whether the policy sampled it; only those get loss, an
                         # importance weight and the sync check
    logprobs: list[float]  # per completion token: the sampler's log-prob; NaN = not known (meaningless where
                           # not sampled)
    finish_reason: str  # "stop" or "length" (cut at max_tokens)
    model_inputs: dict = field(default_factory=dict)  # the model's extra inputs for this prompt (images)
    messages: list | None = None  # the completion as chat messages (assistant and tool turns), for the
                                  # rewards (None: one assistant message, its decoded text)
    extra: dict = field(default_factory=dict)  # values for the reward functions: each key reaches them as a
                                               # keyword list, beside the row's columns (TRL's rollout_func
                                               # fields); JSON-serialisable, as checkpoints keep it
    info: dict = field(default_factory=dict)  # what a multi-turn rollout records for the trainer, not the
                                              # reward functions: tool_calls, environment_reward (its column;
                                              # None: not applicable), environment_error (no reward at all),
                                              # earlier_samples (training_samples), ...; JSON-serialisable


@dataclass
class RolloutContext:
    client: object  # vllm_client.VLLMClient
    tokenizer: object
    num_generations: int  # G: episodes per row
    sampling: dict  # the requests' sampling parameters (Config.sampling: max_tokens, temperature, ...)
    seed: int  # the seed of this call's sampling
    system_prompt: str = ""
    processor: object = None  # a vision-language model's processor (vision.py), else None
    max_prompt_length: int = 0  # tokens; a prompt an environment made longer is its error (0: no limit)

    def encode(self, prompt) -> list[int]:
        """Token ids of a row's prompt (text or chat messages), as the trainer encodes it."""
        return encode_prompt(self.tokenizer, prompt, self.system_prompt)


# Request seeds stay below int64's limit, with room for the seed + j vLLM gives a request's j-th sample.
SEED_LIMIT = 2 ** 62


def slot_seed(seed: int, *place) -> int:
    """The seed of one sample slot of a call (e.g. trajectory i's turn t: slot_seed(ctx.seed, t, i)), in
    range: a hash of the call's seed and the place, so no two slots share a random stream (vLLM gives every
    prompt of a request its seed, so prompts with streams of their own go in requests of their own)."""
    digest = hashlib.blake2b(repr((seed, *place)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def sampled_episode(row: dict, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float] | None = None,
                    finish_reason: str = "stop") -> Episode:
    """An episode whose every completion token the policy sampled; `logprobs`: the sampler's (None: not known,
    NaN each, which weights those tokens as if the sampler were the policy)."""
    return Episode(row, prompt_ids, completion_ids, [True] * len(completion_ids),
                   [math.nan] * len(completion_ids) if logprobs is None else logprobs, finish_reason)


def generate(rows: list[dict], ctx: RolloutContext) -> list[Episode]:
    """The default rollout: G completions of each row's prompt, a request per prompt, all sent at once (the
    server batches them). vLLM gives the j-th sample of a request its seed + j: one request for all prompts
    would give the j-th samples of every group one random stream; a request per prompt, seeded by its place
    (slot_seed), gives every sample of the call its own (bench/sample_streams.py: as fast as one request)."""
    prompts, G = [ctx.encode(row["prompt"]) for row in rows], ctx.num_generations
    calls = [InThread(ctx.client.generate, [prompt], n=G, seed=slot_seed(ctx.seed, i), **ctx.sampling)
             for i, prompt in enumerate(prompts)]
    samples = [s for call in calls for s in call.result()]
    return [sampled_episode(rows[i // G], prompts[i // G], s["token_ids"], s["logprobs"], s["finish_reason"])
            for i, s in enumerate(samples)]


def load_rollout(name: str):
    """The user's rollout function named module:function (--rollout); UsageError saying what to change."""
    module, _, fn = name.partition(":")
    if not module or not fn:
        raise UsageError(f"--rollout {name}: give module:function, e.g. my_rollouts:rollout for the function rollout "
                         "in my_rollouts.py in the working folder")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise UsageError(f"--rollout {name}: could not load it ({type(e).__name__}: {e}); give module:function "
                         "with the module importable from the working folder") from None


def run_rollout(fn, rows: list[dict], ctx: RolloutContext) -> list[Episode]:
    """fn(rows, ctx), checked against the contract: ValueError saying which part it breaks. Every request of
    the call samples the policy of the moment it starts (the client pinned: VLLMClient.pinned), however long
    it runs. It runs on a thread of its own, so that a stop signal ends the wait for it at once, whatever it
    waits for (config.Interrupted: the server's samples, a slow tool or environment, an agent, a user's
    rollout); it is then abandoned."""
    # Every request of this call samples the policy of now: the client pinned (a test's stand-in client, which
    # has no pinned(), is used as it is).
    name, pin = getattr(fn, "__name__", repr(fn)), getattr(ctx.client, "pinned", None)
    ctx = dataclasses.replace(ctx, client=pin()) if pin else ctx
    episodes, G = unless_stopped(InThread(fn, rows, ctx), f"the rollout {name}"), ctx.num_generations
    if not isinstance(episodes, list) or len(episodes) != len(rows) * G:
        raise ValueError(f"rollout {name} returned {len(episodes) if hasattr(episodes, '__len__') else episodes!r} "
                         f"episodes for {len(rows)} rows; it must return a list of {G} (--num_generations) per row")
    for i, e in enumerate(episodes):
        if not isinstance(e, Episode):
            raise ValueError(f"rollout {name}: item {i} is a {type(e).__name__}, not a rollout.Episode")
        if not (len(e.completion_ids) == len(e.sampled) == len(e.logprobs)):
            raise ValueError(f"rollout {name}: episode {i} has {len(e.completion_ids)} completion_ids, "
                             f"{len(e.sampled)} sampled flags and {len(e.logprobs)} logprobs; give one of each per "
                             "completion token")
        taken = sorted(set(e.extra) & {*e.row, "prompts", "completions", "completion_ids", *EXTRA_ARGUMENTS})
        if taken:
            raise ValueError(f"rollout {name}: episode {i}'s extra {taken[0]!r} is also a column of its row or an "
                             "argument every reward function gets; name it otherwise")
        if e.row is not rows[i // G] and e.row != rows[i // G]:
            raise ValueError(f"rollout {name}: episode {i} is not of row {i // G}; return {G} episodes per row, in the "
                             "order of the rows")
    return episodes


def training_samples(episodes: list[Episode]) -> tuple[list[Episode], torch.Tensor]:
    """What trains: each episode, after the samples its trajectory made before it (info["earlier_samples"]: an
    agent's calls before an edited history, agents.py), which train with the episode's advantage. (the
    samples, (S,) the episode of each)."""
    samples, of = [], []
    for i, e in enumerate(episodes):
        for earlier in e.info.get("earlier_samples", ()):
            samples.append(Episode(e.row, **earlier))
            of.append(i)
        samples.append(e)
        of.append(i)
    return samples, torch.tensor(of, dtype=torch.long)


def episodes_to_json(episodes: list[Episode]) -> list[dict]:
    """Episodes without their rows (the trainer knows them), for a checkpoint; model inputs (tensors) as
    tensor_to_json gives them, once for the episodes that share them (the G of a group: {"same_as": i})."""
    first = {}  # id of a model_inputs dict -> the first episode that has it
    out = []
    for i, e in enumerate(episodes):
        shared = first.setdefault(id(e.model_inputs), i) if e.model_inputs else i
        fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in ("row", "model_inputs")}
        out.append({**fields, "model_inputs": {"same_as": shared} if shared != i else
                    {k: tensor_to_json(v) for k, v in e.model_inputs.items()}})
    return out


def tensor_to_json(t: torch.Tensor) -> dict:
    """A tensor as JSON: its dtype, shape and raw bytes in base64 (exact, unlike a list of decimals)."""
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "base64": base64.b64encode(raw.numpy().tobytes()).decode()}


def tensor_from_json(d: dict) -> torch.Tensor:
    raw = bytearray(base64.b64decode(d["base64"]))
    dtype = getattr(torch, d["dtype"])
    return (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(d["shape"])


def presampled_from_json(lines: list[str] | None, rows: list[dict], first: int, G: int) -> tuple | None:
    """A checkpoint's batch sampled ahead, (policy version, episodes), as every rank saved it (one JSON line
    per rank, in rank order: the step's rows in order) -> the version and the episodes of `rows`, which are
    the step's rows from `first` on; so any number of processes can resume it. None if there is none."""
    saved = [json.loads(line) for line in lines or []]
    if not saved or not saved[0]:
        return None
    parts = [part for _, part in saved]  # a record's "same_as" index counts within its rank's part
    records = [(r, part) for part in parts for r in part][first * G:(first + len(rows)) * G]
    inputs = {}  # id of a saved record -> its model inputs, made once
    for r, part in records:
        source = part[r["model_inputs"]["same_as"]] if "same_as" in r.get("model_inputs", {}) else r
        if id(source) not in inputs:
            inputs[id(source)] = {k: tensor_from_json(v) for k, v in source.get("model_inputs", {}).items()}
        inputs[id(r)] = inputs[id(source)]
    return saved[0][0], [Episode(row=rows[i // G], **{**r, "model_inputs": inputs[id(r)]})
                         for i, (r, _) in enumerate(records)]


def collate(episodes: list[Episode], pad_id: int) -> tuple[dict, dict]:
    """Episodes as one batch: the model's inputs {input_ids, attention_mask, and each episode's extra
    inputs concatenated}, prompts left-padded and completions right-padded so every completion starts
    at the same column, and per completion token (N, C): `mask` (a completion token), `sampled`
    (sampled by the policy) and `sampler_logp`."""
    P, C = max(len(e.prompt_ids) for e in episodes), max(1, max(len(e.completion_ids) for e in episodes))
    N = len(episodes)
    input_ids = torch.full((N, P + C), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((N, P + C), dtype=torch.long)
    sampled, sampler_logp = torch.zeros((N, C), dtype=torch.bool), torch.zeros((N, C))
    for i, e in enumerate(episodes):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        input_ids[i, P - p:P + c] = torch.tensor(e.prompt_ids + e.completion_ids)
        attention_mask[i, P - p:P + c] = 1
        sampled[i, :c] = torch.tensor(e.sampled, dtype=torch.bool)
        sampler_logp[i, :c] = torch.tensor(e.logprobs, dtype=torch.float32)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **stack_model_inputs(episodes)}
    mask = attention_mask[:, P:].clone()
    return inputs, {"mask": mask, "sampled": sampled.long() * mask, "sampler_logp": sampler_logp}


def stack_model_inputs(episodes: list[Episode]) -> dict:
    """The episodes' extra model inputs as one batch, a row per episode (logprobs.PerPrompt: episodes that
    share an input, the G of a group, share its one copy). Each is a tensor of one row for its prompt (leading
    dimension 1), such as Idefics3's pixel_values (1, images, 3, H, W). Rows of unequal shape are padded with
    zeros to the largest (Idefics3 skips all-zero images, as its own processor pads a batch), and an episode
    without an input gets zeros of its shape (a prompt without an image, beside ones with). ValueError for an
    input that is not one row per prompt (e.g. Qwen2-VL's flattened patches) or one per token
    (token_type_ids)."""
    keys = list(dict.fromkeys(k for e in episodes for k in e.model_inputs))
    out = {}
    for k in keys:
        values = [e.model_inputs.get(k) for e in episodes]
        present = list({id(v): v for v in values if v is not None}.values())  # each shared tensor once
        if k in PER_TOKEN_INPUTS or any(not torch.is_tensor(v) or v.dim() < 1 or v.shape[0] != 1 for v in present):
            shapes = sorted({tuple(v.shape) if torch.is_tensor(v) else type(v).__name__ for v in present}, key=str)
            raise ValueError(f"model input {k!r} has shape(s) {shapes}: each episode's model_inputs must be tensors "
                             "of one row for its prompt (leading dimension 1), such as pixel_values (1, images, 3, H, "
                             "W); inputs whose rows are not one per prompt (flattened image patches) or that have a "
                             "value per token (token_type_ids) are not supported")
        if any(v.dim() != present[0].dim() for v in present):
            raise ValueError(f"model input {k!r} has tensors of {sorted({v.dim() for v in present})} dimensions "
                             "across episodes; give every episode the same layout")
        shape = [max(v.shape[d] for v in present) for d in range(present[0].dim())]
        # A row per distinct tensor, and a last row of zeros for the episodes without this input.
        unique = present[0].new_zeros([len(present) + 1, *shape[1:]])
        for u, v in enumerate(present):
            unique[(u, *(slice(0, n) for n in v.shape[1:]))] = v[0]
        row = {id(v): u for u, v in enumerate(present)}
        out[k] = PerPrompt(unique, torch.tensor([len(present) if v is None else row[id(v)] for v in values]))
    return out


# Inputs with a value per token would need the padding of input_ids, so they are not supported.
PER_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")


def ahead_from_json(lines: list[str] | None, step: int, rows_of, first: int, G: int) -> dict[int, tuple]:
    """A checkpoint's batches sampled ahead, as every rank saved them (one JSON line per rank, in rank order:
    {step: [policy version, its episodes]}; a checkpoint of one batch ahead: [version, episodes] of `step`) ->
    {step: (version, this rank's episodes)}: `rows_of(step)` are this rank's rows of the step, from `first` on
    (so any number of processes can resume them). A step that not every rank saved is left out."""
    saved = [json.loads(line) for line in lines or []]
    saved = [{str(step): s} if isinstance(s, list) else s or {} for s in saved]
    steps = set.intersection(*map(set, saved)) if saved else set()
    return {int(j): presampled_from_json([json.dumps(s[j]) for s in saved], rows_of(int(j)), first, G) for j in steps}


class SampledAhead:
    """The batches the server samples while the trainer trains (--async_generation), K steps ahead at most
    (--max_staleness; K = 0: none, each batch is sampled when its step starts). `launch(step)` starts the
    requests of steps step+1 .. step+K not under way yet, each with the policy version of now; `take(step)`
    returns the step's (version, episodes), sampled ahead or now. K = 1: `settle(step)` waits for the batch
    ahead before each push, so that one policy samples it; K > 1: pushes land while batches are sampled (the
    server pauses their requests), and a batch's version is that of its start. A batch more than K rounds old
    (a checkpoint's, resumed with a smaller K) is dropped and sampled again, said and counted. `sample(step)`
    makes the call that samples the step's batch, `guard` runs it (a server lost meanwhile: sampled again,
    with the weights of then), `version()` is the policy version (optimizer steps), `per_round` optimizer
    steps per round. `probe_alone`: the server has LoRA on (see before_probe)."""

    def __init__(self, K: int, sample, guard, version, per_round: int, restored: dict | None = None,
                 probe_alone: bool = False):
        self.K, self.sample, self.guard, self.version, self.per_round = K, sample, guard, version, per_round
        self.probe_alone = probe_alone
        self.batches = dict(restored or {})  # step -> (version, episodes, or the InThread sampling them)
        self.launched_at = {}  # step -> the guard's reconnects when its batch was launched
        self.dropped, self.staleness = 0, 0.0

    def take(self, step: int) -> tuple[int, list]:
        """(It stays until the next step's: a stop before this step's update saves it.)"""
        for done in [j for j in self.batches if j < step]:
            del self.batches[done]
        version, batch = self._done(step) if step in self.batches else (None, None)
        if batch is not None and self.version() - version > self.K * self.per_round:
            self.dropped += 1
            print0(f"dropped step {step + 1}'s batch sampled ahead: {(self.version() - version) / self.per_round:g} "
                   f"policy versions old > --max_staleness {self.K}; sampled again (counted: stale_batches_dropped)")
            batch = None
        if batch is None:
            version, batch = self.version(), self.guard.run(self.sample(step))
        self.staleness = (self.version() - version) / self.per_round
        self.batches[step] = version, batch
        return version, batch

    def launch(self, step: int):
        for ahead in range(step + 1, step + self.K + 1):
            if ahead not in self.batches:
                self.batches[ahead] = self.version(), InThread(self.sample(ahead))
                self.launched_at[ahead] = self.guard.reconnects

    def settle(self, step: int):
        if self.K == 1 and step + 1 in self.batches:
            self.batches[step + 1] = self._done(step + 1)

    def before_probe(self):
        """K > 1 on a server with LoRA on: wait for the batches under way. vLLM's CPU LoRA layer fails on
        prompt log-probs (the sync probe's) computed next to other requests (an einsum over mismatched rows
        kills the engine); without LoRA on, the probe runs beside them."""
        if self.probe_alone and self.K > 1:
            self.finished(wait=True)

    def finished(self, wait: bool) -> dict[int, tuple]:
        """{step: (version, episodes)} of the batches sampled ahead (for a checkpoint): every one, waited for,
        or (not `wait`: a stop, the server maybe gone) those whose requests have ended."""
        for step, (version, batch) in list(self.batches.items()):
            if wait and isinstance(batch, InThread):  # every rank waits for the same steps: a collective
                self.batches[step] = self._done(step)
            # Not waiting: the batches this rank has finished.
            elif isinstance(batch, InThread) and batch.wait(0) and batch.error is None:
                self.batches[step] = version, batch.result()
        return {step: b for step, b in sorted(self.batches.items()) if not isinstance(b[1], InThread)}

    def to_json(self, step: int, wait: bool) -> str:
        """This rank's share of the batches sampled ahead for steps `step` on (finished(wait)), as a
        checkpoint keeps it: {step: [version, episodes]} (ahead_from_json reads it)."""
        return json.dumps({j: (v, episodes_to_json(e)) for j, (v, e) in self.finished(wait).items() if j >= step})

    def metrics(self) -> dict:
        return {"staleness": self.staleness, "stale_batches_dropped": self.dropped} if self.K else {}

    def _done(self, step: int) -> tuple[int, list]:
        """The step's batch with its requests ended; sampled again with the weights of now if the server was
        lost. A batch that lost the server which the guard has found again since it was launched is sampled
        again at once, without another reconnect (one restart: one reconnect and push, whatever number of
        batches it cut short)."""
        version, batch = self.batches[step]
        if isinstance(batch, InThread):
            reconnects = self.guard.reconnects
            batch.wait(None)  # a stop signal ends its rollout too (config.Interrupted)
            found_again = reconnects > self.launched_at.get(step, reconnects) and isinstance(batch.error, ServerLost)
            batch = self.guard.run(self.sample(step) if found_again else batch.result)
            version = version if self.guard.reconnects == reconnects and not found_again else self.version()
        return version, batch


class StepRollouts:
    """Which rows this rank samples at each step, and the calls that sample them: the same rows and seeds on a
    resume, with any number of processes, and repeatable (the server guard runs a call again after a
    reconnect). `ctx`: the rollout's context, its seed replaced by each call's."""

    def __init__(self, mixture, ctx: RolloutContext, cfg, rank: int, world_size: int):
        self.mixture, self.ctx, self.rank, self.world_size = mixture, ctx, rank, world_size
        self.seed, self.prompts_per_step, self.per_rank = (cfg.seed, cfg.prompts_per_step,
                                                           cfg.prompts_per_step // world_size)
        self.num_generations_eval = cfg.num_generations_eval

    def rows_of(self, step: int, extra_round: int = 0) -> list[int]:
        """This rank's rows (indices) of `step`, or of its extra sampling round (--dynamic_sampling)."""
        # The step's rows over all ranks, drawn task by task (mixture.step_rows); this rank takes its slice.
        indices = self.mixture.step_rows(step, self.prompts_per_step, self.seed + 1_000_003 * extra_round)
        return indices[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def call(self, step: int, extra_round: int = 0):
        """The call that samples this rank's episodes of `step` (G per row, row by row)."""
        # One seed per step, rank and extra round, within int64 (SEED_LIMIT).
        seed = ((self.seed * 1_000_000 + step) * 1000 + self.rank + extra_round * 10 ** 15) % SEED_LIMIT
        rows = [self.mixture.rows[i] for i in self.rows_of(step, extra_round)]
        return functools.partial(run_rollout, self.mixture.rollout, rows, dataclasses.replace(self.ctx, seed=seed))

    def evaluation(self) -> tuple[list[int], functools.partial]:
        """This rank's share of the evaluation rows (indices) and the call that samples them, with the same
        seeds every time (two evaluations differ only by the weights)."""
        mine = list(range(self.rank, len(self.mixture.eval_rows), self.world_size))
        seed = ((self.seed * 1_000_000 + 999_999) * 1000 + self.rank) % SEED_LIMIT
        ctx = dataclasses.replace(self.ctx, num_generations=self.num_generations_eval, seed=seed)
        return mine, functools.partial(run_rollout, self.mixture.rollout,
                                       [self.mixture.eval_rows[i] for i in mine], ctx)

    def first_of_each_task(self):
        """--dry_run's rollout: the call that samples G episodes of each task's first row (rank 0 alone)."""
        rows = [task.rows[0] for task in self.mixture.tasks if self.rank == 0]
        return functools.partial(run_rollout, self.mixture.rollout, rows, dataclasses.replace(self.ctx, seed=self.seed))
