"""The policy's weights on their way to the server: every weight in the server's names and dtype, LoRA merged,
FSDP2 shards gathered one tensor at a time (ServerWeights) and their push over the transport the server runs
(WeightSync: our gloo, or vLLM's nccl), or a LoRA adapter alone (AdapterWeights) and its push over the
server's /load_adapter (AdapterSync); which of them a run pushes (server_sync); and the probe that checks the
server computes with them (check_sync). Not here: the client and the gloo sender, with the wire protocol of a
push (vllm_client.py), saving to disk (checkpoints.py).
"""
import collections
import contextlib
import dataclasses
import gc
import json
import math
import os
import secrets

import safetensors.torch
import torch

from adapter_route import MAX_KEEP
from config import RunStopped, UsageError
from logprobs import no_grad_logprobs
from models import full_tensor, hf_model, sharded_parameters
from utils import print0, sum_over_ranks, text_of_rank0
from vllm_client import GlooWeightSender, ServerLost, VLLMClient, check_port_free, on_every_rank, raise_on_every_rank


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
    weights around LoRA layers) is sent by the first push only. Without `merge_lora`, the base weights alone
    (the server's base under an adapter pushed by itself): nothing changes after the first push."""

    def __init__(self, model, dtype: torch.dtype, merge_lora: bool = True):
        self.model, self.dtype, self.merge_lora = hf_model(model), dtype, merge_lora
        # Fault injection for the sync-check test: the push leaves this weight out.
        skip = os.environ.get("NANOGRPO_FAULT_SKIP_WEIGHT")
        sharded_parameters(getattr(model, "module", model))
        # named_parameters lists a tied lm_head once, under the embedding's name, as the server expects.
        self.params = [(name, p) for name, p in self.model.named_parameters()
                       if "lora_" not in name and name.replace(".base_layer", "") != skip]
        self.changing = [(name, p) for name, p in self.params
                         if merge_lora and (p.requires_grad or name.endswith(".base_layer.weight"))]
        self.pushed = False  # once True, a push sends only the weights that can change

    def _sent(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.changing if self.pushed else self.params

    def send_all_next(self):
        """The next push sends every weight again (to a server that was restarted, or that may hold
        others)."""
        self.pushed = False

    def metadata(self) -> list[WeightMeta]:
        return [WeightMeta(name.replace(".base_layer", ""), self.dtype, tuple(p.shape)) for name, p in self._sent()]

    def __iter__(self):
        # Marked pushed when reading begins, since rank 0 may not read to the end.
        params, self.pushed = self._sent(), True
        for name, p in params:
            weight = full_tensor(p.detach())
            if self.merge_lora and name.endswith(".base_layer.weight"):  # a LoRA layer: W + B A * alpha / r
                weight = weight + lora_delta(self.model.get_submodule(name.removesuffix(".base_layer.weight")))
            yield name.replace(".base_layer", ""), weight.to(self.dtype)


class WeightSync:
    """Pushes the trainer's weights into the server. Built and called on every trainer rank, since
    reading sharded weights is a collective; rank 0 alone talks to the server. The transport is the
    one the server was started with (--weight-transfer-config): our `gloo` (any machine: host memory
    over TCP) or vLLM's `nccl` (GPU to GPU); the code that calls it is the same.
    `source`: (name, tensor) pairs in the server's names and dtype, with metadata() (ServerWeights above)."""

    def __init__(self, client: VLLMClient, source, rank: int, group_host: str, group_port: int, bucket_mb: float = 64):
        self.client, self.source, self.rank, self.engine = client, _Resumable(source), rank, None
        self.group_host, self.group_port, self.bucket_bytes = group_host, group_port, int(bucket_mb * 2**20)
        self.connect()

    def connect(self):
        """Join the server's weight transfer (rank 0); again after the server restarted. The next push sends
        every weight, also those that do not change (on every rank: FSDP2 gathers each one). Every rank calls
        it, and it fails on every rank or on none (raise_on_every_rank): a rank that went on would push
        alone."""
        getattr(self.source.source, "send_all_next", lambda: None)()
        error = None
        if self.rank == 0:
            try:
                self._join()
            except Exception as e:  # e.g. the port of --vllm_group_port taken, the server lost
                error = e
        raise_on_every_rank(error, "joining the weight transfer")

    def _join(self):
        """Rank 0's part of connect(): the transfer the server's config names (our gloo, or vLLM's nccl)."""
        self.engine = None  # a previous group, with its rendezvous store, goes first, as the port is reused
        gc.collect()
        check_port_free("", self.group_port, "--vllm_group_port")  # rank 0 hosts the rendezvous there
        config = self.client.server_config()
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        world_size = 1 + self.client.num_workers()
        if backend == "gloo":
            self.engine = GlooWeightSender(self.client, self.source, self.group_host, self.group_port, world_size,
                                           self.bucket_bytes)
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            init_info = NCCLTrainerInitInfo(master_address=self.group_host, master_port=self.group_port,
                                            world_size=world_size, packed=True,
                                            packed_buffer_size_bytes=self.bucket_bytes, rank=0)
            self.engine = WeightTransferTrainerFactory.trainer_init(init_info, client=self.client, source=self.source)
        else:
            raise UsageError(f"the server's weight-transfer backend is {backend!r}; nanogrpo pushes weights with "
                             "'gloo' or 'nccl': start the server with --weight-transfer-config "
                             "'{\"backend\": \"gloo\"}' (the default of vllm_server.py) or '{\"backend\": \"nccl\"}' "
                             "(GPUs)")

    def push(self):
        """Make the server compute with the current weights. Every rank calls it, and it fails on every rank
        or on none (raise_on_every_rank). Rank 0 sends; the other ranks read the weights (FSDP2: gathers) in
        the same order. If the push fails on rank 0 (ServerLost, or any error), before reading the weights or
        halfway, rank 0 still reads the rest of them, so that every rank has taken part in the same
        gathers."""
        self.source.begin()
        error = None
        if self.engine is not None:
            try:
                # Requests under way (--max_staleness above 1) wait, so that no step sees half the weights.
                self.client.pause()
                self.engine.send_weights()
                self.client.reset_prefix_cache()  # cached KV of the old weights is stale
                self.client.reset_encoder_cache()  # as are images encoded by the old vision tower (VLMs)
                self.client.resume()
            except Exception as e:
                error = e
                # A server still there goes on with its requests; the error says what went wrong.
                with contextlib.suppress(Exception):
                    self.client.resume()
        elif self.rank == 0:
            error = ServerLost("the weight transfer is not joined")
        self.source.finish()  # reads what this push has not: on the other ranks, all of it
        raise_on_every_rank(error, "the weight push")


class _Resumable:
    """A weight source that remembers how far a push has read it, so that the push can be finished
    (see WeightSync.push)."""

    def __init__(self, source):
        self.source, self.iteration = source, None

    def metadata(self):
        return self.source.metadata()

    def begin(self):
        self.iteration = None  # nothing read yet

    def __iter__(self):
        self.iteration = iter(self.source)
        return self.iteration

    def finish(self):
        """Read what this push has not read: all of it if it never began reading."""
        for _ in self.iteration if self.iteration is not None else self.source:
            pass


class AdapterWeights:
    """The LoRA adapter alone, as peft saves it and vLLM loads it: its tensors under peft's names, in `dtype`
    (the server's), FSDP2 shards gathered (a collective: every rank calls payload(); the base weights are
    never read), and its adapter_config.json."""

    def __init__(self, model, dtype: torch.dtype = torch.float32):
        self.model, self.dtype = getattr(model, "module", model), dtype  # the peft model
        # The sync-check test's fault injection, as in ServerWeights.
        self.skip = os.environ.get("NANOGRPO_FAULT_SKIP_WEIGHT", "").removesuffix(".weight")

    def payload(self, is_main: bool) -> bytes | None:
        """Rank 0: the adapter as safetensors bytes, its config in the metadata; other ranks: None."""
        from peft import get_peft_model_state_dict  # as models.add_lora: only LoRA runs import peft
        state = {name: full_tensor(p.detach()).cpu() for name, p in sharded_parameters(self.model) if "lora_" in name}
        if not is_main:
            return None
        tensors = {name: t.to(self.dtype).contiguous()
                   for name, t in get_peft_model_state_dict(self.model, state_dict=state).items()
                   if not (self.skip and f"{self.skip}.lora_" in name)}
        config = self.model.peft_config["default"].to_dict()
        return safetensors.torch.save(tensors, metadata={"adapter_config": json.dumps(config, default=sorted)})


class AdapterSync:
    """Pushes the LoRA adapter alone (--lora_sync adapter) to a server with vLLM's LoRA on, named after its
    series and the policy version (`version()`: optimizer steps): policy-3. Every rank calls push() (FSDP2
    gathers the adapter, never the base), and it fails on every rank or on none; rank 0 sends it (source:
    AdapterWeights) and every rank's client names it in its requests. The server keeps the newest `keep` of
    the series and never touches another series (a dry run's has a name of its own). The first push after
    connecting also sends the base weights through `base` (a WeightSync): another run may have changed
    them."""

    def __init__(self, client: VLLMClient, source, rank: int, version, base: WeightSync, keep: int = 1,
                 series: str = "policy"):
        self.client, self.source, self.rank, self.version, self.base, self.base_sent = (client, source, rank, version,
                                                                                        base, False)
        # The adapters the server keeps: batches sampled ahead (--max_staleness) may still use older ones.
        self.keep = keep
        self.series = series

    def connect(self):
        self.base.connect()
        self.base_sent = False

    def push(self):
        if not self.base_sent:
            self.base.push()  # raises on every rank or on none
            self.base_sent = True
        name, error = f"{self.series}-{self.version()}", None
        try:
            adapter = self.source.payload(self.rank == 0)  # every rank takes part: FSDP2 gathers the adapter
            if self.rank == 0:
                self.client.load_adapter(name, adapter, self.keep)
                self.client.reset_prefix_cache()
        except Exception as e:
            error = e
        raise_on_every_rank(error, "the adapter push")
        self.client.model_name = name


def server_sync(cfg, client, model, server_dtype: torch.dtype, rank: int, version):
    """How the weights reach the server, and a phrase that says it: with --use_peft the adapter alone
    (AdapterSync) where --lora_sync and the server allow it, else every weight, LoRA merged in
    (WeightSync: gloo or NCCL broadcasts). --lora_sync adapter that cannot be stops the run at start.
    A dry run's adapters get a series of their own (dry-run-<8 hex digits>-N, drawn by rank 0): the server may
    be another run's, whose adapters (policy-N) stay as they are (a push unloads only older ones of its own
    series)."""
    if cfg.use_peft and cfg.lora_sync != "merged":
        config = on_every_rank(client.server_config, "reading the server's config")  # before any guard exists
        why = adapter_refused(cfg, config.get("lora_config"), model)
        if not why:
            base = WeightSync(client, ServerWeights(model, server_dtype, merge_lora=False), rank, cfg.vllm_group_host,
                              cfg.vllm_group_port, cfg.weight_sync_bucket_mb)
            # Rank 0 draws a dry run's series, and every rank uses it.
            series = text_of_rank0(f"dry-run-{secrets.token_hex(4)}") if cfg.dry_run else "policy"
            return (AdapterSync(client, AdapterWeights(model, server_dtype), rank, version, base,
                                keep=cfg.max_staleness + 1, series=series),
                    "the LoRA adapter alone" + (f", as {series}-N" if cfg.dry_run else ""))
        if cfg.lora_sync == "adapter":
            raise UsageError(f"--lora_sync adapter: {why}; or push merged weights with --lora_sync merged")
        print0(f"LoRA: the weights are pushed merged, since {why}")
    return (WeightSync(client, ServerWeights(model, server_dtype), rank, cfg.vllm_group_host, cfg.vllm_group_port,
                       cfg.weight_sync_bucket_mb), "all weights" + (", LoRA merged" if cfg.use_peft else ""))


def weight_bytes(model, dtype: torch.dtype, adapter: bool = False) -> int:
    """The bytes of a push of every weight of the server's model (ServerWeights' first push), or of the LoRA
    adapter alone, in `dtype`."""
    if adapter:
        return sum(p.numel() for name, p in hf_model(model).named_parameters() if "lora_" in name) * dtype.itemsize
    return sum(math.prod(meta.shape) for meta in ServerWeights(model, dtype).metadata()) * dtype.itemsize


def adapter_refused(cfg, lora: dict | None, model) -> str:
    """Why the adapter alone cannot be pushed to a server with this LoRA config (None: without LoRA), or
    ""."""
    others = [name for name, p in hf_model(model).named_parameters() if p.requires_grad and "lora_" not in name]
    if not lora:
        return f"the server runs without LoRA: start it with --enable-lora --max-lora-rank {cfg.lora_r}"
    if cfg.lora_r > lora["max_lora_rank"]:
        return (f"--lora_r {cfg.lora_r} is above the server's --max-lora-rank {lora['max_lora_rank']}: restart it "
                f"with --max-lora-rank {cfg.lora_r} or more")
    if cfg.max_staleness + 1 > MAX_KEEP:  # the batches sampled ahead each keep their adapter on the server
        return (f"--max_staleness {cfg.max_staleness} needs {cfg.max_staleness + 1} adapters on the server, which "
                f"keeps {MAX_KEEP} of a run at most")
    return f"{others[0]} trains outside the adapter" if others else ""


@dataclasses.dataclass
class Probe:
    """A fixed token sequence that the server and the trainer both score (check_sync). A vision-language
    model's also has its pixel inputs, and its messages with the images, which the server renders itself (chat
    route)."""
    ids: list[int]
    model_inputs: dict = dataclasses.field(default_factory=dict)  # tensors with a leading dimension of 1
    messages: list | None = None


def check_sync(client, model, probe: Probe, autocast, is_main: bool, tolerance: float, step: int) -> dict:
    """The mean and max |log-prob difference| between the server and `model` on a fixed token sequence,
    on every rank: a deterministic check that the server computes with the weights we pushed. Every rank
    runs the forward (FSDP2 gathers); rank 0 asks the server. Stops the run if the mean is above
    `tolerance`."""
    ids = torch.tensor([probe.ids])
    ours = no_grad_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), **probe.model_inputs},
                            len(probe.ids) - 1, 1.0, 1, autocast)[0][0]  # (P - 1,) log-probs of the one row
    diff, error = torch.zeros(1), None
    if is_main:
        try:
            theirs = (client.prompt_logprobs(probe.ids) if probe.messages is None
                      else client.chat_prompt_logprobs(probe.messages, probe.ids))
            diff = (ours - torch.tensor(theirs)).abs()
        # The server lost, say: the other ranks wait in the sum below, so this rank joins it before raising.
        except Exception as e:
            error = e
    # Rank 0's numbers, on every rank (the others add zeros).
    probe = sum_over_ranks({"sync_probe_diff_mean": diff.mean(), "sync_probe_diff_max": diff.max()})
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
