"""The generation server and the small client the trainer uses to talk to it.

The server is vLLM's own OpenAI-compatible server, started with the same flags as `vllm serve`:

    python vllm_server.py --model smollm2-135m --port 8000 --enforce-eager
    python vllm_server.py --model Qwen/Qwen2.5-1.5B-Instruct --tensor-parallel-size 2   # GPUs

What this file adds to plain `vllm serve`, and nothing else:
  - vLLM's weight-transfer routes (/init_weight_transfer_engine, /start_weight_update,
    /update_weights, /finish_weight_update), /pause and /resume, /reset_prefix_cache and /reset_encoder_cache,
    enabled through VLLM_SERVER_DEV_MODE=1;
  - a `gloo` weight-transfer backend, so weights can be pushed without CUDA (vLLM's own backends
    need it): the default without GPUs. With GPUs the default is vLLM's `nccl`; gloo works there
    too (host memory over TCP). The trainer uses whichever the server runs;
  - POST /load_adapter (adapter_route.py): a LoRA adapter sent as bytes, served under its name; this file's flag
    `--max-adapter-mb` (default 1024) bounds it;
  - defaults for training: bound to 127.0.0.1, the sampler's log-probs after temperature
    (`--logprobs-mode processed_logprobs`), the embedded model name `smollm2-135m`;
  - on CPUs, vLLM's processes tuned to leave the cores to the work: their message queues spin 2 ms
    instead of 1 s and are re-checked every 20 ms (`wait_briefly_instead_of_spinning`), and freed
    memory is kept for reuse (`keep_freed_memory`).

It serves only the routes training uses, and the OpenAI chat route (/v1/chat/completions, for
OpenAI-client agents and evaluation tools; the rest of vLLM's dev routes answer 404), binds
127.0.0.1 unless told otherwise, and with `--api-key KEY` wants the key on every route but
/health (the trainer sends VLLM_API_KEY). Even so, do not expose it to networks you do not trust:
the weight-transfer routes let a key holder replace the weights, and the weight-transfer port
(the trainer's --vllm_group_port) has no key.

The wire protocol of a gloo weight push (trainer rank 0 = gloo rank 0, vLLM worker w = rank 1 + w):
  0. POST /pause?mode=keep&clear_cache=false (requests under way wait; POST /resume after step 3, also when
     the push fails)
  1. POST /start_weight_update
  2. POST /update_weights {names, dtype_names, shapes, bucket_bytes}, answered only after the
     worker has received every bucket, while the trainer broadcasts the buckets: the tensors in
     `names` order, concatenated as raw bytes and cut into buckets by `bucket_plan`.
  3. POST /finish_weight_update, then POST /reset_prefix_cache?reset_running_requests=true and
     /reset_encoder_cache (cached KV and encoded images of old weights are stale; paused requests are recomputed).
"""
import contextlib
import copy
import functools
import gc
import hmac
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import requests
import torch
import torch.distributed as dist
from urllib3.connection import HTTPConnection

from adapter_route import load_adapter, take_max_adapter_mb
from config import DEFAULT_MODEL, RunStopped, UsageError, native_bf16, run_main
from embedded import resolve_model
from utils import InThread, all_reduce, set_malloc_thresholds

DEFAULT_PORT = 8000
DEFAULT_GROUP_PORT = 51216  # the TCP port of the trainer<->server weight-transfer rendezvous
HEALTH_EVERY_S = 10  # while a request runs, the client asks the server's /health this often
INSTANCE_HEADER = "X-Nanogrpo-Server-Instance"  # names the server process on every answer: a restart is seen


# -----------------------------------------------------------------------------
# the wire format, shared by both sides

def bucket_plan(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors that travel together: consecutive tensors up to `bucket_bytes`
    per bucket; a tensor larger than a bucket travels alone."""
    buckets, current, size = [], [], 0
    for i, n in enumerate(nbytes):
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def tensor_nbytes(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float = 600):
    """A gloo process group of its own (not torch's default group, which torchrun and vLLM use
    for their own ranks), rendezvousing through a TCPStore that rank 0 hosts on `address` only: given an
    address, TCPStore itself would listen on every interface, open to anyone who can reach the machine."""
    listen_fd = None
    if rank == 0:
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        listen_fd = socket.create_server((address, port), family=family, backlog=128).detach()  # the store's now
    store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s),
                          master_listen_fd=listen_fd)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


# -----------------------------------------------------------------------------
# trainer side

class ServerLost(ConnectionError):
    """The server stopped answering (killed, restarting, its engine died) or the weight transfer broke:
    the trainer can wait for it, push its weights again and carry on (guard.ServerGuard)."""


class ServerRefused(RuntimeError):
    """The server answered a request with a 4xx: it is up, and refuses what it was sent (waiting will not mend it).
    `reason`: its message, on one line."""

    def __init__(self, path: str, status: int, text: str):
        super().__init__(f"vLLM server {path} answered {status}: {text[:2000]}")
        self.status, self.reason = status, reason_of(text)


def reason_of(text: str) -> str:
    """The message of a server's error answer ({"error": "..."} from this file's routes, {"error": {"message": ...}}
    from vLLM's), on one line of at most 500 characters."""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        error = json.loads(text)["error"]
        text = error if isinstance(error, str) else error["message"]
    return " ".join(str(text).split())[:500]


def raise_on_every_rank(error: Exception | None, what: str):
    """A collective at the end of a push (or of joining the weight transfer), which every rank calls: it raises on
    every rank if it failed on any, else on none. The rank that had `error` raises it; the others raise ServerLost if
    only the server was lost (the guard waits for it), else RunStopped. Each rank's next collective is then the same
    one: a rank that raised alone met the other ranks' next collective (FSDP2's gathers of the adapter) with its own
    (the guard's), and every rank hung until the collective time-out."""
    kind = 0 if error is None else 1 if isinstance(error, ServerLost) else 2
    worst = int(all_reduce(torch.tensor([kind]), dist.ReduceOp.MAX))
    if error is not None:
        raise error
    if worst == 1:
        raise ServerLost(f"{what}: the server was lost on another rank")
    if worst == 2:
        raise RunStopped(f"{what} failed on another rank (its message says why)")


REPEATABLE = ("/v1/completions", "/v1/chat/completions")  # routes a call may repeat: nothing changes on the server


class KeepAliveAdapter(requests.adapters.HTTPAdapter):
    """Connections with TCP keep-alive: a request whose connection carries nothing any more (the server's host
    died, or its address went to a replacement) fails within about two minutes, as the peer answers the probes
    with a reset or not at all; without them it would wait forever, a long generation being silent anyway."""

    OPTIONS = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [  # idle 60 s, then 4 probes 15 s apart (Linux)
        (socket.IPPROTO_TCP, getattr(socket, name), value) for name, value in
        (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 15), ("TCP_KEEPCNT", 4)) if hasattr(socket, name)]

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, socket_options=HTTPConnection.default_socket_options + self.OPTIONS, **kwargs)


def structured(regex: str) -> dict:
    """The request fields of vLLM's structured outputs for a regular expression ("": none)."""
    return {"structured_outputs": {"regex": regex}} if regex else {}


class VLLMClient:
    """What the trainer needs from the server: health, completions of token ids, weight pushes."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, api_key: str | None = None,
                 request_timeout: float = 0, server_timeout: float = 300):
        self.base, self.api_key = f"http://{host}:{port}", api_key  # the key also goes to agents' OpenAI clients
        self.session, self.health_session = requests.Session(), requests.Session()
        for session in (self.session, self.health_session):  # many requests at once (generate_each)
            session.mount("http://", KeepAliveAdapter(pool_maxsize=4096))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.request_timeout, self.server_timeout = request_timeout, server_timeout
        self.group = None  # the weight-transfer process group, after init_weight_transfer
        self.model_name = self.instance = None  # the server's, as found by wait_for_health

    def _post(self, path: str, json: dict | None = None) -> dict:
        return self._request("POST", path, json=json)

    def _get(self, path: str, **params) -> dict:
        return self._request("GET", path, params=params)

    def _request(self, method: str, path: str, **kwargs) -> dict:
        """_request_once, and once more if the connection broke before an answer and the call can be repeated (a GET,
        or a sampling route: seeded, it repeats exactly). A pooled connection may break so when the server closes it,
        idle for its keep-alive time (5 s), just as the client sends on it; if the server is really gone, the second
        try fails too (ServerLost)."""
        try:
            return self._request_once(method, path, **kwargs)
        except ServerLost as e:
            if not isinstance(e.__cause__, requests.ConnectionError) or not (method == "GET" or path in REPEATABLE):
                raise
        return self._request_once(method, path, **kwargs)

    def _request_once(self, method: str, path: str, **kwargs) -> dict:
        """One call, which may take as long as its work does (a batch of long generations is not a lost server).
        While it runs, /health is asked every HEALTH_EVERY_S: a server silent there for `server_timeout` s is lost
        (ServerLost: the trainer waits for it). A call longer than `request_timeout` (0: no limit) stops the run."""
        call = InThread(self.session.request, method, self.base + path, **kwargs)
        started = answered = time.monotonic()
        limit = self.request_timeout or math.inf
        while not call.wait(min(HEALTH_EVERY_S, max(limit - (time.monotonic() - started), 0) + 0.01)):
            now = time.monotonic()
            if self.request_timeout and now - started > self.request_timeout:
                raise RunStopped(f"the vLLM server has not answered {path} within --vllm_request_timeout "
                                 f"{self.request_timeout:g}s, while it still answers /health: the work is slower than "
                                 "that limit (long generations, a large model, a slow machine); raise it, or 0 for none")
            instance = self.health()
            if instance and self.instance and instance != self.instance:  # this request's server is gone
                raise ServerLost(f"{path}: the server restarted while the request ran (another instance answers "
                                 "/health)")
            if instance is not None:
                answered = time.monotonic()
            elif now - answered > self.server_timeout:
                raise ServerLost(f"{path}: the server stopped answering /health ({now - answered:.0f}s > "
                                 f"--vllm_server_timeout) while the request ran")
        try:
            r = call.result()
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            raise ServerLost(f"{path}: {type(e).__name__}: {e}") from e
        if self.instance and r.headers.get(INSTANCE_HEADER, self.instance) != self.instance:
            raise ServerLost(f"{path}: the server restarted (another instance answered): it computes with the model on "
                             "disk, not with the weights the trainer pushed")
        if r.status_code >= 500:  # the engine died or the server is going down
            raise ServerLost(f"vLLM server {path} answered {r.status_code}: {r.text[:500]}")
        if r.status_code != 200:
            raise ServerRefused(path, r.status_code, r.text)
        return r.json() if r.content else {}  # the cache routes answer with no body

    def wait_for_health(self, timeout: float = 300):
        """Wait until the server answers /health and names its model on /v1/models; a clear error if it does
        not within `timeout` s (a server that dies in between, or another program on the port, is waited for).
        From then on an answer from another instance of the server (restarted since) is a lost server."""
        deadline, problem = time.monotonic() + timeout, ""
        while True:
            if self.healthy():
                try:
                    models = self.session.get(self.base + "/v1/models", timeout=30)
                    if models.status_code != 401:
                        self.model_name = models.json()["data"][0]["id"]
                        self.instance = models.headers.get(INSTANCE_HEADER)  # the one that gets our weights next
                        return
                except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
                    problem = f" (/health answers, but /v1/models: {type(e).__name__}: {str(e)[:200]})"
                else:
                    raise UsageError(f"the vLLM server at {self.base} was started with --api-key: " + (
                        "the key in VLLM_API_KEY is not one of its keys" if "Authorization" in self.session.headers
                        else "set VLLM_API_KEY to its key for the trainer"))
            if time.monotonic() > deadline:
                raise UsageError(
                    f"no vLLM server answered at {self.base}/health within {timeout:.0f}s{problem}. Start one with "
                    "`python vllm_server.py --model <model> --port <port>`, or fix --vllm_server_host/"
                    "--vllm_server_port (or raise --vllm_server_timeout if it is still loading).")
            time.sleep(1)

    def pinned(self) -> "VLLMClient":
        """This client as it is now, for one rollout: the same connections, but the policy's model name (an adapter's,
        policy-N) and the server instance of now, kept while pushes and reconnects change this client's. Every
        request of the rollout samples that policy, and an answer from another instance is a lost server (the
        rollout is sampled again), never a sample of another policy (--max_staleness K: pushes land mid-rollout)."""
        return copy.copy(self)

    def healthy(self) -> bool:
        """Whether the server answers /health now (its engine is alive)."""
        return self.health() is not None

    def health(self) -> str | None:
        """The instance of the server that answers /health now ("" if it does not say), None if none does."""
        try:
            r = self.health_session.get(self.base + "/health", timeout=5)
        except requests.RequestException:
            return None
        return r.headers.get(INSTANCE_HEADER, "") if r.status_code == 200 else None

    def server_config(self) -> dict:
        """The server's vLLM config (model, parallel and weight-transfer settings) as JSON."""
        return self._get("/server_info", config_format="json")["vllm_config"]

    def server_dtype_and_max_len(self) -> tuple[torch.dtype, int]:
        """The dtype the server computes in (weights are pushed in it) and its max model length."""
        model_config = self.server_config()["model_config"]
        return getattr(torch, str(model_config["dtype"]).removeprefix("torch.")), int(model_config["max_model_len"])

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, structured_outputs_regex: str = "") -> list[dict]:
        """n completions of each prompt (token ids). Returns len(prompts) * n dicts, prompt-major:
        {token_ids, logprobs (the sampler's, per token), finish_reason ('stop' or 'length')}.
        With a `seed` the samples depend only on it and the weights, not on what else the server runs; every prompt
        gets that seed (the j-th of n seed + j): for streams of their own, see generate_each. A
        `structured_outputs_regex`: every completion matches it (vLLM's structured outputs)."""
        if not prompts:
            return []
        body = dict(model=self.model_name, prompt=prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                    top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                    logprobs=0, return_token_ids=True, skip_special_tokens=False, **structured(structured_outputs_regex))
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        assert len(choices) == len(prompts) * n, f"asked for {len(prompts) * n} completions, got {len(choices)}"
        return [dict(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"],
                     finish_reason=c["finish_reason"]) for c in choices]

    def generate_each(self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], **sampling):
        """One completion of each prompt, each a request of its own with its own max_tokens and seed, all sent at
        once (the server batches them), as generate returns them."""
        calls = [InThread(self.generate, [p], 1, m, seed=s, **sampling) for p, m, s in zip(prompts, max_tokens, seeds)]
        return [call.result()[0] for call in calls]

    def chat(self, messages: list[dict], n: int, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = -1, min_p: float = 0.0, repetition_penalty: float = 1.0,
             seed: int | None = None, structured_outputs_regex: str = "") -> tuple[list[int], list[dict]]:
        """n completions of one conversation through the chat route (which takes images, as image_url parts),
        rendered by the server's chat template: (the prompt's token ids as the server expanded them, the
        samples as generate returns them)."""
        body = dict(model=self.model_name, messages=messages, n=n, max_tokens=max_tokens, temperature=temperature,
                    top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                    logprobs=True, return_token_ids=True, skip_special_tokens=False, **structured(structured_outputs_regex))
        answer = self._post("/v1/chat/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        assert len(choices) == n, f"asked for {n} completions, got {len(choices)}"
        return answer["prompt_token_ids"], [dict(token_ids=c["token_ids"], logprobs=[
            t["logprob"] for t in c["logprobs"]["content"]], finish_reason=c["finish_reason"]) for c in choices]

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The server's log-prob of each token of `token_ids` given the ones before (the first has none)."""
        body = dict(model=self.model_name, prompt=[token_ids], max_tokens=1, temperature=1.0, prompt_logprobs=0,
                    return_token_ids=True)
        pl = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], pl[1:])]

    def chat_prompt_logprobs(self, messages: list[dict], token_ids: list[int]) -> list[float]:
        """prompt_logprobs of a conversation (with images) that the server renders itself, continuing its last
        (assistant) message; `token_ids`: the trainer's rendering, which the server's must equal (ValueError)."""
        body = dict(model=self.model_name, messages=messages, max_tokens=1, temperature=1.0, prompt_logprobs=0,
                    return_token_ids=True, add_generation_prompt=False, continue_final_message=True)
        answer = self._post("/v1/chat/completions", body)
        if answer["prompt_token_ids"] != token_ids:
            raise ValueError(f"the server rendered the sync probe as {len(answer['prompt_token_ids'])} tokens, the "
                             f"trainer as {len(token_ids)}: the server must render chats and images as the model "
                             "folder's processor does")
        return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], answer["prompt_logprobs"][1:])]

    def load_adapter(self, name: str, adapter: bytes, keep: int = 1):
        """Make the server sample with a LoRA adapter (a peft adapter as safetensors bytes, its adapter_config.json in
        the metadata) under `name` (e.g. policy-3), keeping the newest `keep` of those it was sent of the same series
        (policy-...; POST /load_adapter: the server writes it to a folder of its own, so the trainer needs no
        filesystem shared with it). Requests then name it as their model. An adapter the server refuses (a corrupt
        one, a rank above its --max-lora-rank, a name one of its user's adapters has) stops the run, saying why."""
        try:
            self._request("POST", "/load_adapter", params={"name": name, "keep": keep}, data=adapter,
                          headers={"Content-Type": "application/octet-stream"})
        except ServerRefused as e:
            raise RunStopped(f"the vLLM server refused the LoRA adapter {name} ({e.status}): {e.reason}") from None
        self.model_name = name

    def num_workers(self) -> int:
        """vLLM worker processes (tensor x pipeline x data parallel): each joins the weight transfer."""
        return self._get("/get_world_size")["world_size"]

    # vLLM's weight-sync control routes (the VLLMWeightSyncClient protocol of its trainer-side engines)
    def init_weight_transfer_engine(self, init_info: dict):
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict):
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None):
        self._post("/finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def pause(self):
        """Freeze the requests under way (they go on after resume()) and start no step: the weights can change."""
        self._request("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})  # push() resets them

    def resume(self):
        self._post("/resume")

    def reset_prefix_cache(self):
        """Forget cached KV; requests under way (paused) are preempted, and recomputed with the new weights."""
        if not self._request("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})["success"]:
            raise RuntimeError("the vLLM server could not reset its prefix cache (blocks still held)")

    def reset_encoder_cache(self):
        """Forget the vision encoder's outputs: vLLM keeps them by image, and reset_prefix_cache leaves them."""
        self._post("/reset_encoder_cache")


class GlooWeightSender:
    """Trainer side of our gloo backend: this process is rank 0 of a gloo group with every vLLM
    worker, and broadcasts the weights packed into buckets (see the wire protocol above)."""

    def __init__(self, client: VLLMClient, source, address: str, port: int, world_size: int, bucket_bytes: int):
        self.client, self.source, self.bucket_bytes = client, source, bucket_bytes
        init_info = dict(master_address=address, master_port=port, rank_offset=1, world_size=world_size)
        # the workers block inside the request until the group forms, so the request runs on a thread
        thread = InThread(client.init_weight_transfer_engine, init_info)
        self.group = gloo_group(address, port, 0, world_size)
        thread.result()

    def send_weights(self):
        meta = self.source.metadata()
        update_info = dict(names=[m.name for m in meta],
                           dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                           shapes=[list(m.shape) for m in meta], bucket_bytes=self.bucket_bytes)
        self.client.start_weight_update()
        answer = InThread(self.client.update_weights, update_info)  # answered once every bucket has arrived
        weights = iter(self.source)  # one tensor at a time: a bucket is the most this process holds
        for bucket in bucket_plan([tensor_nbytes(list(m.shape), m.dtype) for m in meta], self.bucket_bytes):
            parts = []
            for i in bucket:
                name, tensor = next(weights)
                if (name, tuple(tensor.shape), tensor.dtype) != (meta[i].name, meta[i].shape, meta[i].dtype):
                    raise RuntimeError(f"the weights iterate out of step with their metadata at {name}: the server "
                                       "would cut the bytes into the wrong tensors")
                parts.append(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
            self._broadcast(torch.cat(parts), answer)
        if answer.wait(None):
            self._check(answer)
        self.client.finish_weight_update()

    def _broadcast(self, data: torch.Tensor, answer):
        """Send one bucket; if the server answers /update_weights before it is through, that answer is an error
        (it will not take the bucket), raised instead of waiting for the broadcast's time-out."""
        try:
            work = self.group.broadcast(data, 0)
            while not work.is_completed() and not answer.wait(0.001):
                pass
        except RuntimeError as e:  # gloo: a worker went away
            raise ServerLost(f"weight transfer: {e}") from e
        if not work.is_completed():  # the server answered before this bucket was through: an error raises here,
            self._check(answer)  # else (the last bucket) it has them all
        try:
            work.wait()
        except RuntimeError as e:
            raise ServerLost(f"weight transfer: {e}") from e

    def _check(self, answer):
        """The server's answer to /update_weights (once). An error from a server that is still up means it cannot
        take these weights (another model, other shapes), which waiting for it will not mend."""
        try:
            answer.result()
        except ServerLost as e:
            if not self.client.healthy():
                raise
            raise RunStopped(f"the vLLM server cannot take these weights: {e}. Start it with the trainer's --model "
                             f"(the same architecture and sizes)") from None


class WeightSync:
    """Pushes the trainer's weights into the server. Built and called on every trainer rank, since
    reading sharded weights is a collective; rank 0 alone talks to the server. The transport is the
    one the server was started with (--weight-transfer-config): our `gloo` (any machine: host memory
    over TCP) or vLLM's `nccl` (GPU to GPU); the code that calls it is the same.
    `source`: (name, tensor) pairs in the server's names and dtype, with metadata() (weight_sync.ServerWeights)."""

    def __init__(self, client: VLLMClient, source, rank: int, group_host: str, group_port: int, bucket_mb: float = 64):
        self.client, self.source, self.rank, self.engine = client, _Resumable(source), rank, None
        self.group_host, self.group_port, self.bucket_bytes = group_host, group_port, int(bucket_mb * 2**20)
        self.connect()

    def connect(self):
        """Join the server's weight transfer (rank 0); again after the server restarted. The next push sends every
        weight, also those that do not change (on every rank: FSDP2 gathers each one). Every rank calls it, and it
        fails on every rank or on none (raise_on_every_rank): a rank that went on would push alone."""
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
        self.engine = None  # a previous group, with its rendezvous store, goes first: the port is reused
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
        """Make the server compute with the current weights. Every rank calls it, and it fails on every rank or on
        none (raise_on_every_rank). Rank 0 sends; the other ranks read the weights (FSDP2: gathers) in the same
        order. If the push fails on rank 0 (ServerLost, or any error), before reading the weights or halfway,
        rank 0 still reads the rest of them, so that every rank has taken part in the same gathers."""
        self.source.begin()
        error = None
        if self.engine is not None:
            try:
                self.client.pause()  # requests under way (--max_staleness above 1) wait: no step sees half the weights
                self.engine.send_weights()
                self.client.reset_prefix_cache()  # cached KV of the old weights is stale
                self.client.reset_encoder_cache()  # and so are images encoded by the old vision tower (VLMs)
                self.client.resume()
            except Exception as e:
                error = e
                with contextlib.suppress(Exception):  # a server still there goes on; the error says what went wrong
                    self.client.resume()
        elif self.rank == 0:
            error = ServerLost("the weight transfer is not joined")
        self.source.finish()  # what this push has not read: all of it on the other ranks
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


# -----------------------------------------------------------------------------
# server side: the gloo weight-transfer backend, registered in every vLLM process that imports
# this module (the API server runs main(); the workers import WorkerExtension below)

def register_gloo_backend():
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if "gloo" in WeightTransferEngineFactory._registry:
        return

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        bucket_bytes: int

    class GlooWeightTransferEngine(WeightTransferEngine):
        """Receives packed buckets over gloo and loads them through vLLM's layerwise reload,
        the path that also re-runs the CPU weight repacking after new weights arrive."""
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def init_transfer_engine(self, info: GlooInitInfo):
            pc = self.parallel_config
            rank = info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
            self.group = gloo_group(info.master_address, info.master_port, rank, info.world_size)

        def start_weight_update(self):
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict):
            self.receive_weights(self.parse_update_info(update_info))  # the base class also syncs CUDA

        def receive_weights(self, info: GlooUpdateInfo):
            """Every bucket is received, also after one failed to load (another model's shapes): the trainer
            is never left blocked in a broadcast, and the error is the answer to /update_weights."""
            dtypes = [getattr(torch, d) for d in info.dtype_names]
            nbytes = [tensor_nbytes(s, d) for s, d in zip(info.shapes, dtypes)]
            error = None
            for bucket in bucket_plan(nbytes, info.bucket_bytes):
                packed = torch.empty(sum(nbytes[i] for i in bucket), dtype=torch.uint8)
                self.group.broadcast(packed, 0).wait()
                weights, offset = [], 0
                for i in bucket:
                    raw = packed[offset:offset + nbytes[i]]
                    weights.append((info.names[i], raw.view(dtypes[i]).view(info.shapes[i])))
                    offset += nbytes[i]
                if error is None:
                    try:
                        self.model.load_weights(weights)
                    except Exception as e:
                        error = e
            if error is not None:
                raise RuntimeError(f"this server's model cannot load the weights it was sent ({type(error).__name__}: "
                                   f"{error}); its weights are now partly replaced: restart it") from error

        def finish_weight_update(self):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            finalize_layerwise_reload(self.model, self.model_config)
            # With tied embeddings, vLLM on CPU keeps a separately packed copy of lm_head for the
            # logits that the reload does not refresh: the outputs would silently keep the old
            # embedding. Repack it from the new weight.
            lm_head = getattr(self.model, "lm_head", None)
            if self.device.type == "cpu" and lm_head is not None and hasattr(lm_head, "cpu_linear"):
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
                dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)

        def shutdown(self):
            self.group = None

    WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)


# -----------------------------------------------------------------------------
# server side: only the routes training uses, and the API key on all of them

TRAINING_ROUTES = {"/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/server_info",
                   "/get_world_size", "/metrics",
                   "/version", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                   "/finish_weight_update", "/shutdown_weight_transfer_engine", "/reset_prefix_cache",
                   "/reset_encoder_cache", "/load_adapter", "/pause", "/resume"}


async def route_guard(request, call_next):
    """HTTP middleware of the server (vLLM's --middleware). Every other route vLLM would serve answers 404 (its
    dev mode also opens /collective_rpc, /sleep, /pause, ...: arbitrary calls into the workers). With --api-key
    (or VLLM_API_KEY) every route but /health wants `Authorization: Bearer <key>`; vLLM's own check covers /v1 only.
    Every answer names this instance of the server (INSTANCE_HEADER): the trainer sees a restart at once."""
    from starlette.responses import JSONResponse
    path, instance = request.url.path, {INSTANCE_HEADER: os.environ.get("NANOGRPO_SERVER_INSTANCE", "")}
    if path not in TRAINING_ROUTES:
        return JSONResponse({"error": f"{path} is not served here (vllm_server.py serves only what training uses)"},
                            status_code=404, headers=instance)
    keys = [k for k in os.environ.get("NANOGRPO_SERVER_API_KEYS", "").split("\n") if k]
    if keys and path != "/health":
        given = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
        if not any(hmac.compare_digest(given, key.encode()) for key in keys):
            return JSONResponse({"error": "Unauthorized"}, status_code=401, headers=instance)
    response = await (load_adapter(request) if path == "/load_adapter" else call_next(request))
    response.headers.update(instance)
    return response


class WorkerExtension:
    """Passed as --worker-extension-cls so that each vLLM worker imports this module (and so
    registers the gloo backend) before it builds its weight-transfer engine."""


SPIN_AFTER_READ_S = 0.002  # a message-queue reader spins this long after a message before it waits (vLLM: 1 s)
RECHECK_S = 0.02  # a waiting reader looks at the queue itself this often, notified or not (vLLM: 5 s)


def wait_briefly_instead_of_spinning(spin_s: float = SPIN_AFTER_READ_S, recheck_s: float = RECHECK_S):
    """vLLM's engine and workers read their shared-memory message queues in a busy loop (sched_yield) for
    1 s after each message. On a GPU machine that costs a spare core; on a CPU server it takes the cores that
    compute (a weight push's four requests: two such loops took ~1.5 of 2 cores, 1.2-1.7 s per push against
    0.7-0.9 s without). Here a reader spins for `spin_s` after a message, then waits on the queue's
    notification socket, and also looks at the queue every `recheck_s`: the socket loses notifications
    (the writer publishes with a high-water mark of 1, and a second message within ~1 ms of the first goes
    unannounced), which vLLM's 1 s spin hides and a waiting reader would find only at vLLM's 5 s re-check
    (SHM_READER_RECHECK_INTERVAL_MS): requests stalled in multiples of 5 s. The short spin catches such
    bursts; the re-check bounds any other lost notification; an idle reader wakes 1 / recheck_s times a
    second to read one flag. NANOGRPO_VLLM_POLLING=1 in the server's environment keeps vLLM's own polling."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        SpinCondition = shm_broadcast.SpinCondition
    except (ImportError, AttributeError):  # a vLLM without them: nothing to change
        return
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = max(1, round(recheck_s * 1000))  # read at every wait
    init = getattr(SpinCondition.__init__, "__wrapped__", SpinCondition.__init__)  # vLLM's own, if patched before

    @functools.wraps(init)
    def briefly_spinning_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = spin_s

    SpinCondition.__init__ = briefly_spinning_init


def keep_freed_memory(limit_bytes: int = 2**30) -> bool:
    """Make glibc keep freed blocks of up to `limit_bytes` for reuse. By default it hands every block of more
    than 32 MB back to the kernel when freed (they are mmap'd), so the next one of that size faults in fresh
    zeroed pages: on a CPU that costs more than the work done in them (a 64 MB bucket of a weight push: ~20 ms
    to fault in, ~5 ms to fill). The price: up to `limit_bytes` of freed memory stays with the process."""
    return set_malloc_thresholds(limit_bytes, limit_bytes)


def tune_cpu_server_process():
    """What a CPU server's processes need beyond vLLM's defaults: little busy polling, and freed memory reused (each
    push's buckets and the reload's new layer tensors would otherwise fault in fresh pages every time)."""
    if os.environ.get("NANOGRPO_VLLM_POLLING") != "1":
        wait_briefly_instead_of_spinning()
    keep_freed_memory()


if os.environ.get("NANOGRPO_CPU_SERVER") == "1":
    # a process of a CPU server started by main(): processes that vLLM spawns re-import the server's script
    tune_cpu_server_process()
if "vllm" in sys.modules:  # imported inside a vLLM process (a worker loads it as its extension)
    register_gloo_backend()


def flag_value(argv: list[str], *flags: str, default: str | None = None) -> str | None:
    """The value of a command-line flag (`--flag value` or `--flag=value`), the last one given."""
    found = default
    for i, a in enumerate(argv):
        for f in flags:
            if a == f and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(f + "="):
                found = a.split("=", 1)[1]
    return found


def num_workers_of(argv: list[str]) -> int:
    """Worker processes that `vllm serve` flags ask for: tensor x pipeline parallel size."""
    return int(flag_value(argv, "--tensor-parallel-size", "-tp", default="1")) * \
        int(flag_value(argv, "--pipeline-parallel-size", "-pp", default="1"))


def check_port_free(host: str, port: int, flag: str):
    """A clear error now if something already listens on `port`, rather than a bind error deep in a library."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections closing on it (TIME_WAIT) do not count
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"{flag} {port}: the port is in use on {host or 'this machine'} ({e.strerror}); choose a "
                             "free one") from None


def cpu_binding(num_cpus: int, num_workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each worker an equal, separate range of cores: "0-3", "0-1|2-3"."""
    per = max(1, num_cpus // num_workers)
    return "|".join(f"{w * per}-{w * per + per - 1}" for w in range(num_workers))


def serve_args(argv: list[str]) -> list[str]:
    """`vllm serve` flags completed with nanogrpo's defaults (the user's flags win)."""
    argv = list(argv)

    def has(flag):
        return any(a == flag or a.startswith(flag + "=") for a in argv)

    if not has("--model") and not (argv and not argv[0].startswith("-")):
        argv += ["--model", DEFAULT_MODEL]
    for i, a in enumerate(argv):  # the embedded model's name -> its converted folder
        if a == "--model" and i + 1 < len(argv):
            argv[i + 1] = resolve_model(argv[i + 1])
        elif a.startswith("--model="):
            argv[i] = "--model=" + resolve_model(a.split("=", 1)[1])
    defaults = {"--host": "127.0.0.1", "--port": str(DEFAULT_PORT), "--logprobs-mode": "processed_logprobs",
                "--worker-extension-cls": "vllm_server.WorkerExtension",
                # GPUs: vLLM's nccl (GPU to GPU); CPUs: our gloo
                "--weight-transfer-config": json.dumps({"backend": "nccl" if torch.cuda.is_available() else "gloo"})}
    if not torch.cuda.is_available():
        # vLLM's "auto" computes a float32 model in bf16 on every x86 CPU, also where bf16 is emulated (~100x slower)
        defaults["--dtype"] = "bfloat16" if native_bf16(torch.device("cpu")) else "float32"
    for flag, value in defaults.items():
        if not has(flag):
            argv += [flag, value]
    if not torch.cuda.is_available() and not has("--enable-chunked-prefill") and not has("--no-enable-chunked-prefill"):
        # A prompt prefilled in chunks "un-draws" its seeded random numbers by rewinding the generator's
        # offset, which CPU generators do not have: the engine dies. Seeded requests (the trainer's) need
        # whole prefills on CPU.
        argv.append("--no-enable-chunked-prefill")
    return argv


def step_kv_cache_bytes(cfg, argv: list[str]) -> int | None:
    """Config.kv_cache_bytes for the server `argv` starts (completed by serve_args): its model, dtype and maximum
    model length (run.sh's and the benches' --kv-cache-memory-bytes)."""
    argv = serve_args(argv)
    dtype_bytes = 4 if flag_value(argv, "--dtype") in ("float32", "float") else 2
    return cfg.kv_cache_bytes(flag_value(argv, "--model"), dtype_bytes, int(flag_value(argv, "--max-model-len")))


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = take_max_adapter_mb(argv)  # this file's flag: vLLM's parser does not know it
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # enables the weight-transfer and cache routes
    if flag_value(argv, "--kv-cache-memory-bytes") is None:  # (the variable, if set, wins over the flag)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, vLLM on CPU sizes it from all RAM
    if not torch.cuda.is_available() and num_workers_of(argv) <= os.cpu_count() <= 4:
        # vLLM's "auto" keeps one core for its front end; on a small CPU, generating on all cores is
        # ~1.4x faster (measured, 2 cores), and the trainer is idle while the server generates.
        # With tensor/pipeline parallelism each worker gets its own share of the cores ("0|1").
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(os.cpu_count(), num_workers_of(argv)))
    if os.environ.get("NANOGRPO_VLLM_POLLING", "0") not in ("0", "1"):
        raise UsageError(f"NANOGRPO_VLLM_POLLING={os.environ['NANOGRPO_VLLM_POLLING']}: set it to 1 (vLLM's own "
                         "polling of its message queues) or 0 / leave it unset (vllm_server.py's, on CPUs)")
    if not torch.cuda.is_available():
        os.environ["NANOGRPO_CPU_SERVER"] = "1"  # read by this module in every process of the server
        tune_cpu_server_process()
    here = os.path.dirname(os.path.abspath(__file__))
    # workers import this module; no empty entry (it would put each child's working folder on its import path)
    paths = [here, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    sys.path.insert(0, here)
    argv = serve_args(argv)
    check_port_free(flag_value(argv, "--host"), int(flag_value(argv, "--port")), "--port")

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    argv += ["--middleware", "vllm_server.route_guard"]
    register_gloo_backend()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(
        description="vLLM server for nanogrpo (same flags as `vllm serve`)"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    os.environ["NANOGRPO_SERVER_API_KEYS"] = "\n".join(args.api_key or [os.environ.get("VLLM_API_KEY", "")])
    os.environ["NANOGRPO_SERVER_INSTANCE"] = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"  # every process
    uvloop.run(run_server(args))


if __name__ == "__main__":
    run_main(main)
