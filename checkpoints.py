"""What a run leaves on disk and how it continues: the output folder (locked, checked before the first step),
the saved model, checkpoints written atomically with everything an exact resume needs, finding and restoring
them, and a stop request (SIGTERM, Ctrl-C) that saves one before the run ends. Not here: the logs
(metrics.py), which flags a resume may change (config.py's fields say so).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from config import STOP, RunStopped, SignalStop, UsageError
from metrics import LOGS, keep_steps_up_to
from models import full_tensor, hf_model, sharded_parameters
from utils import OutputLock, gather_lines, print0, sum_over_ranks, text_of_rank0
from weight_sync import ServerWeights


# -----------------------------------------------------------------------------
# writing a folder atomically, and the model a run leaves

def fsync_folder(path: str, files: bool = True):
    """Make a folder durable: its files' contents (`files`) and its entries reach the disk, so that after a
    power loss a renamed folder is never there with empty files."""
    for folder, _, names in os.walk(path) if files else [(path, [], [])]:
        for name in [*names, "."]:  # "." syncs the folder's own entries
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
    for name, weight in ServerWeights(model, torch.float32):  # all ranks gather; rank 0 keeps each weight
        if is_main:
            state[name] = weight.cpu()
    if is_main:
        replace_folder(os.path.join(output_dir, "model"),
                       lambda d: (hf_model(model).save_pretrained(d, state_dict=state), tokenizer.save_pretrained(d)))
    return folders + [os.path.join(output_dir, "model")]


# -----------------------------------------------------------------------------
# checkpoints: all a run needs to continue exactly, in an output folder that is checked and locked first

CHECKPOINT = re.compile(r"checkpoint-(\d+)")

# A resumed run must match these flags: they decide the weights and the order of the prompts ("tasks": a
# mixture's sources and weights, mixture.py), and how optimizer steps map to steps (the schedule).
RESUME_MUST_MATCH = ("model", "dataset", "tasks", "dataset_split", "num_arithmetic_problems", "seed",
                     "prompts_per_step", "num_generations", "use_peft", "freeze_vision_tower",
                     "num_iterations", "steps_per_generation")
LORA_MUST_MATCH = ("lora_r", "lora_alpha", "lora_target_modules", "lora_dropout")  # the adapter's config


def checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoints in `output_dir`, oldest first (a folder is complete once renamed from
    .tmp)."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := CHECKPOINT.fullmatch(name)) and os.path.isfile(os.path.join(output_dir, name, "checkpoint.json"))]
    return [path for _, path in sorted(found)]


OUTPUTS = ("metrics.jsonl", "rollouts.jsonl", "model", "adapter")  # what a run leaves, besides checkpoints


def prepare_output_dir(output_dir: str, resume: str | None, step: int = 0, dry_run: bool = False):
    """Rank 0, at start (not at the first save, hours later). The folder must be writable, and it is locked
    for the run: a second run into it stops (utils.OutputLock: a lock of another node is watched for up to a
    minute, or while its flock is held up to 2.5 minutes, so that a requeue is not stopped by its dead run's
    lock). A new run does not mix with an earlier run's output there (`dry_run`: these checks alone, the
    folder's content is left as it is). A run resumed from a checkpoint of this folder keeps the logs up to
    its step; if the run went further, the logs as they were and the checkpoints after it are moved aside
    (set_aside_after), so that `latest` never jumps back to them. Resumed from another folder's checkpoint,
    this folder starts as a new run's, with the logs up to the checkpoint copied in. Returns the lock: held
    while it is open (the kernel frees it when the process ends)."""
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
    if dry_run:
        return lock
    aside = set_aside_after(output_dir, step) if same_folder else None
    for name in LOGS:
        source = os.path.join(os.path.dirname(os.path.abspath(resume)) if resume else output_dir, name)
        if resume and os.path.exists(source) and (torn := keep_steps_up_to(source, step,
                                                                            os.path.join(output_dir, name))):
            print(f"warning: dropped {torn} line(s) of {source} cut short by an earlier run's end (a kill or a full "
                  "disk while writing); the records before them are kept" + (f", and all in {aside}" if aside else ""),
                  flush=True)
    if aside:
        print(f"resuming from step {step} of a run that went further: its logs as they were, and its checkpoints after "
              f"step {step} if any, are in {aside} (`latest` would resume those)", flush=True)
    return lock


def set_aside_after(output_dir: str, step: int) -> str | None:
    """Before a run resumes from step `step` in its own folder: if the run there went further (a checkpoint
    after `step`, or a log record after it or cut short: the records a crash leaves, which often explain it),
    make output_dir/abandoned-after-step-{step}-{time} with hard links (else copies) of the logs as they are,
    and move those checkpoints into it; returns that folder (None if the run went no further)."""
    later = [path for path in checkpoints(output_dir) if int(CHECKPOINT.fullmatch(os.path.basename(path))[1]) > step]
    logs = [path for name in LOGS if os.path.exists(path := os.path.join(output_dir, name))]
    if not later and not any(went_past(path, step) for path in logs):
        return None
    aside = os.path.join(output_dir, f"abandoned-after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside)
    for path in logs:  # linked before the logs are cut back to `step` (into a new file)
        try:
            os.link(path, os.path.join(aside, os.path.basename(path)))
        except OSError:
            shutil.copyfile(path, os.path.join(aside, os.path.basename(path)))
    for path in reversed(later):
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    return aside


def went_past(path: str, step: int, block: int = 1 << 20) -> bool:
    """Whether a JSONL log (its records in the order of their steps) ends after `step`, or in a line cut
    short."""
    last = last_record(path, block)
    return last is not None and (last == {} or last["step"] > step)


def last_record(path: str, block: int = 1 << 20) -> dict | None:
    """The last record of a JSONL log, read from the end (rollouts.jsonl can be large): None if there is none,
    {} if its last line is cut short (not whole JSON)."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        # Read back until the last line is whole (it ends in one newline, unless it was cut short).
        while end > 0 and tail.count(b"\n") < 2:
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
    return text_of_rank0(str(int("eval/reward" in (last_record(os.path.join(output_dir, "metrics.jsonl"))
                                                   or {})))) == "1"


def find_checkpoint(spec: str, output_dir: str) -> str:
    """--resume_from_checkpoint: "latest" (the newest complete one in output_dir) or a checkpoint folder.
    Called on every rank; rank 0 finds it, and every rank must see it. On NFS a folder's listing can lag
    behind another node's by a minute: ranks that resumed from different steps would drift apart without a
    word."""
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
        raise UsageError(f"--resume_from_checkpoint {spec}: {path} (as rank 0 sees it) is not there for {unseen} "
                         "of the processes: put --output_dir on a filesystem that every node shares, or let it "
                         "catch up")
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
    """{"cpu": (world_size, n), and "cuda" on GPUs}: the torch RNG states of every rank (dropout draws from
    them)."""
    mine = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    if not dist.is_initialized():
        return {k: v.unsqueeze(0) for k, v in mine.items()}
    every = {k: [torch.empty_like(v) for _ in range(dist.get_world_size())] for k, v in mine.items()}
    for k, v in mine.items():
        dist.all_gather(every[k], v)  # CPU tensors, which go over gloo
    return {k: torch.stack(v) for k, v in every.items()}


def save_checkpoint(output_dir: str, step: int, model, optimizer, scheduler, tokenizer, config: dict, is_main: bool,
                    keep: int, extra: dict | None = None, reference=None) -> str:
    """output_dir/checkpoint-{step}: the model (model/, or adapter/ with LoRA), trainer_state.pt (optimizer,
    scheduler, RNG of every rank, step, `extra`), checkpoint.json (step, config, git revision) and, where
    training moves it (--sync_ref_model), the `reference` model (reference/model). Written into
    checkpoint-{step}.tmp, flushed to the disk and renamed when complete, so a crash, kill -9, full disk or
    power loss at any moment leaves the earlier checkpoints as they were; then only the newest `keep` are kept
    (0 = all). A complete checkpoint of this step already there holds this state (the one the run resumed
    from, and it stopped before training; or saved, and the server then lost): it is kept, never deleted and
    rewritten (on NFS a file of it still memory-mapped would stay behind, and the new one could not take its
    name). Called on every rank (FSDP2 gathers); rank 0 writes. A failed write raises on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    path = os.path.join(output_dir, f"checkpoint-{step}")
    if sum_over_ranks({"there": is_main and os.path.isfile(os.path.join(path, "checkpoint.json"))})["there"]:
        return path  # rank 0's view, shared with all: another node's may lag behind
    staging = path + ".tmp"
    # FSDP2: the weights a forward left gathered become shards again.
    sharded_parameters(getattr(model, "module", model))
    # The whole optimizer state, on rank 0's CPU.
    optim = get_optimizer_state_dict(getattr(model, "module", model), optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rngs = rng_states()
    error = None
    try:
        if is_main:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        save_model(model, tokenizer, staging, is_main, merged=False)
        if reference is not None:
            save_model(reference, tokenizer, os.path.join(staging, "reference"), is_main)
        if is_main:
            torch.save({"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rngs,
                        **(extra or {})}, os.path.join(staging, "trainer_state.pt"))
            # checkpoint.json is written last: a folder that has it is complete.
            with open(os.path.join(staging, "checkpoint.json"), "w") as f:
                json.dump({"step": step, "git_revision": git_revision(), "world_size": len(rngs["cpu"]),
                           "config": config}, f, indent=1)
            fsync_folder(staging)  # complete on the disk before it takes its name and older ones go
            shutil.rmtree(path, ignore_errors=True)
            os.replace(staging, path)
            fsync_folder(output_dir, files=False)
    # A full disk, say (an OSError, or the writer's own error): the earlier checkpoints are untouched.
    except Exception as e:
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
    """Delete all but the newest `keep` checkpoints (0 = keep all). One that cannot be deleted (say a file
    held open on NFS) is reported and left, and the run goes on: the newest checkpoint is complete either
    way."""
    for old in checkpoints(output_dir)[:-keep] if keep > 0 else []:
        try:
            shutil.rmtree(old)
        except OSError as e:
            print(f"warning: could not delete the old checkpoint {old} ({e}); the run goes on, and the newest "
                  "checkpoint is complete. Delete it by hand", flush=True)


RESUME_MAY_MOVE = ("resume_from_checkpoint", "output_dir", "vllm_server_host", "vllm_server_port", "vllm_group_host",
                   "vllm_group_port", "learning_rate", "vision_learning_rate", "adam_beta1", "adam_beta2",
                   "weight_decay")  # where the run is, and what restore_training_state reports as changed


def check_checkpoint(path: str, config: dict) -> tuple[int, list[str]]:
    """The step of a checkpoint, after checking that this run continues the one that wrote it, and the other
    flags this run changes (e.g. ["--max_steps 24 -> 48"]), to be said: they apply from the next step."""
    with open(os.path.join(path, "checkpoint.json")) as f:
        saved = json.load(f)
    # The LoRA flags matter only with LoRA.
    must_match = RESUME_MUST_MATCH + (LORA_MUST_MATCH if config.get("use_peft") else ())
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
    # Sharded, rank 0 reads the moments (memory-mapped) and sends them one tensor at a time; each keeps its
    # part.
    sharded = isinstance(model, FSDPModule)
    saved = state["optimizer"] if rank == 0 or not sharded else {}
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
        torch.set_rng_state(rng["cpu"][rank].clone())  # a copy of the row, with storage of its own
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"][rank].clone())
    else:
        print0(f"warning: the checkpoint was written by {len(rng['cpu'])} processes, this run has {world_size}: the "
               "random state of dropout is not restored (everything else is)")
    return list(dict.fromkeys(changed))


# -----------------------------------------------------------------------------
# stopping: SIGTERM and Ctrl-C save a checkpoint first

class StopRequest:
    """SIGTERM or SIGINT (Ctrl-C) asks the run to save a checkpoint and stop; a second SIGINT stops at once.
    (torchrun's ranks run in sessions of their own: a terminal's Ctrl-C reaches them through torchrun, which
    passes on the first only.) Made first thing: while the run starts (`at_once`, until the loop's guard can
    save), a signal ends it there, with nothing to save (the output folder's lock is released on the way out).
    Then it sets config.STOP, which ends the step's waits (a rollout, the reward functions:
    config.Interrupted), and the guard or the next `requested()` saves and stops. `requested()` is a
    collective: every rank gets the same answer."""

    def __init__(self):
        # flag: this rank got a signal; stopping: some rank did (as known at the last check).
        self.flag = self.stopping = False
        self.at_once = True
        STOP.clear()
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True
        STOP.set()
        if self.at_once:
            self.at_once = False  # raised once, so that what runs on the way out is not cut short again
            raise SignalStop("stopped by a signal while the run was starting; nothing was trained, nothing saved")

    def requested(self) -> bool:
        self.stopping = sum_over_ranks({"stop": self.flag})["stop"] > 0
        return self.stopping


class Saver:
    """What a run saves, and when. `save(steps_done)` writes checkpoint-{steps_done} (every rank: FSDP2
    gathers; rank 0 writes) with the reward scorer's failures, the entropy bonus's state and, with
    --async_generation, the batches sampled ahead (`ahead`, set once it exists). `on_stop` is what the server
    guard calls when the run must stop (the server gone, an error on a rank, a signal): the metrics of a step
    that updated the weights but was not logged yet (`unlogged`) are logged first, then the steps done since
    the start are saved, if any; at a signal in the loop (`in_loop`), also none (its state: after step 0's
    evaluation, say)."""

    def __init__(self, cfg, run_config: dict, model, optimizer, scheduler, tokenizer, reference, scorer, bonus, logger,
                 start_step: int, is_main: bool):
        self.cfg, self.run_config, self.is_main, self.start_step = cfg, run_config, is_main, start_step
        self.model, self.optimizer, self.scheduler, self.tokenizer = model, optimizer, scheduler, tokenizer
        self.reference = reference if cfg.sync_ref_model else None  # TR-DPO moves it, so it is saved too
        self.scorer, self.bonus, self.logger = scorer, bonus, logger
        self.ahead = None  # rollout.SampledAhead, with --async_generation
        self.unlogged = {}
        self.in_loop = False  # True once the loop runs (after the starting point's evaluation)

    def save(self, steps_done: int, wait_for_ahead: bool = False) -> str:
        # The batches sampled ahead are waited for (at a stop, only those done are kept), and every rank's are
        # kept in rank order (the step's prompts in order), so that a resumed run, with any number of
        # processes, trains on what an uninterrupted one would.
        extra = {**sum_over_ranks({"scorer_failures": self.scorer.failures}), "entropy_bonus": self.bonus.state_dict()}
        if self.ahead is not None:
            extra["presampled"] = gather_lines([self.ahead.to_json(steps_done, wait_for_ahead)])
        path = save_checkpoint(self.cfg.output_dir, steps_done, self.model, self.optimizer, self.scheduler,
                               self.tokenizer, self.run_config, self.is_main, self.cfg.save_total_limit, extra,
                               reference=self.reference)
        print0(f"saved {path}")
        return path

    def on_stop(self, signal: bool = False) -> str | None:
        if self.unlogged:
            self.logger.log(self.unlogged)
        steps_done = self.scheduler.last_epoch // (self.cfg.num_iterations * self.cfg.steps_per_generation)
        return self.save(steps_done) if steps_done > self.start_step or signal and self.in_loop else None
