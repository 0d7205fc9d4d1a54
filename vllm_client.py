"""The trainer's side of the wire to vllm_server.py: the client (VLLMClient: health, completions of token ids,
the chat route, LoRA adapters, the weight-transfer routes), the errors it raises (ServerLost: the server is
gone, wait for it; ServerRefused: it is up and refuses what it was sent), raise_on_every_rank, and the sender
of a gloo weight push (GlooWeightSender). Also what both sides of the wire share, which the server imports
from here: the default ports, the header that names a server instance, how the weights are cut into buckets
(bucket_plan, tensor_nbytes), the gloo group they travel in (gloo_group), and check_port_free. Not here: the
server (vllm_server.py), which weights are pushed and when (weight_sync.py: ServerWeights, WeightSync,
AdapterSync), waiting for a lost server (guard.py).

The wire protocol of a gloo weight push (trainer rank 0 = gloo rank 0, vLLM worker w = rank 1 + w), as
weight_sync.WeightSync.push and GlooWeightSender.send_weights drive it; the server's half, which receives the
buckets, is vllm_server.register_gloo_backend. Once per connection, POST /init_weight_transfer_engine forms
the gloo group (GlooWeightSender.__init__); then, per push:
  0. POST /pause?mode=keep&clear_cache=false (requests under way wait; POST /resume after step 3, also when
     the push fails)
  1. POST /start_weight_update
  2. POST /update_weights {names, dtype_names, shapes, bucket_bytes}, answered only after the
     worker has received every bucket, while the trainer broadcasts the buckets: the tensors in
     `names` order, concatenated as raw bytes and cut into buckets by `bucket_plan`.
  3. POST /finish_weight_update, then POST /reset_prefix_cache?reset_running_requests=true and
     /reset_encoder_cache (cached KV and encoded images of old weights are stale; paused requests are
     recomputed).
"""
import contextlib
import copy
import json
import math
import socket
import time
from datetime import timedelta

import requests
import torch
import torch.distributed as dist
from urllib3.connection import HTTPConnection

from config import RunStopped, UsageError
from utils import InThread, all_reduce

DEFAULT_PORT = 8000
DEFAULT_GROUP_PORT = 51216  # the TCP port of the trainer<->server weight-transfer rendezvous
HEALTH_EVERY_S = 10  # while a request runs, the client asks the server's /health this often
INSTANCE_HEADER = "X-Nanogrpo-Server-Instance"  # names the server process on every answer, so a restart shows


# -----------------------------------------------------------------------------
# the wire format, shared by both sides (vllm_server.py imports it from here)

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
        # The socket listens on `address` alone; detached, it is the store's from now on.
        listen_fd = socket.create_server((address, port), family=family, backlog=128).detach()
    store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s),
                          master_listen_fd=listen_fd)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def check_port_free(host: str, port: int, flag: str):
    """A clear error now if something already listens on `port`, rather than a bind error deep in a
    library."""
    with socket.socket() as s:
        # Connections still closing on the port (TIME_WAIT) do not count as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"{flag} {port}: the port is in use on {host or 'this machine'} ({e.strerror}); choose a "
                             "free one") from None


# -----------------------------------------------------------------------------
# trainer side

class ServerLost(ConnectionError):
    """The server stopped answering (killed, restarting, its engine died) or the weight transfer broke:
    the trainer can wait for it, push its weights again and carry on (guard.ServerGuard)."""


class ServerRefused(RuntimeError):
    """The server answered a request with a 4xx: it is up, and refuses what it was sent (waiting will not mend
    it). `reason`: its message, on one line."""

    def __init__(self, path: str, status: int, text: str):
        super().__init__(f"vLLM server {path} answered {status}: {text[:2000]}")
        self.status, self.reason = status, reason_of(text)


def reason_of(text: str) -> str:
    """The message of a server's error answer ({"error": "..."} from this file's routes, {"error": {"message":
    ...}} from vLLM's), on one line of at most 500 characters."""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        error = json.loads(text)["error"]
        text = error if isinstance(error, str) else error["message"]
    return " ".join(str(text).split())[:500]


def raise_on_every_rank(error: Exception | None, what: str):
    """A collective at the end of a push (or of joining the weight transfer), which every rank calls: it
    raises on every rank if it failed on any, else on none. The rank that had `error` raises it; the others
    raise ServerLost if only the server was lost (the guard waits for it), else RunStopped. Each rank's next
    collective is then the same one: a rank that raised alone met the other ranks' next collective (FSDP2's
    gathers of the adapter) with its own (the guard's), and every rank hung until the collective time-out."""
    kind = 0 if error is None else 1 if isinstance(error, ServerLost) else 2
    worst = int(all_reduce(torch.tensor([kind]), dist.ReduceOp.MAX))
    if error is not None:
        raise error
    if worst == 1:
        raise ServerLost(f"{what}: the server was lost on another rank")
    if worst == 2:
        raise RunStopped(f"{what} failed on another rank (its message says why)")


def on_every_rank(fn, what: str):
    """fn() on every rank, ending as raise_on_every_rank does: if it raised on any rank, it raises on every
    rank, so that no rank goes on into a collective the others never reach. Returns fn's result."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # a server lost or refusing on this rank alone
        error = e
    raise_on_every_rank(error, what)
    return result


# The routes a call may repeat after a reconnect: they change nothing on the server.
REPEATABLE = ("/v1/completions", "/v1/chat/completions")


class KeepAliveAdapter(requests.adapters.HTTPAdapter):
    """Connections with TCP keep-alive: a request whose connection carries nothing any more (the server's host
    died, or its address went to a replacement) fails within about two minutes, as the peer answers the probes
    with a reset or not at all; without them it would wait forever, a long generation being silent anyway."""

    # Idle 60 s, then 4 probes 15 s apart (Linux).
    OPTIONS = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [
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
        self.base, self.api_key = f"http://{host}:{port}", api_key  # agents' OpenAI clients get the key too
        self.session, self.health_session = requests.Session(), requests.Session()
        for session in (self.session, self.health_session):  # pools for many requests at once (generate_each)
            session.mount("http://", KeepAliveAdapter(pool_maxsize=4096))
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.request_timeout, self.server_timeout = request_timeout, server_timeout
        self.group = None  # the weight-transfer process group, after init_weight_transfer
        self.model_name = self.instance = None  # the server's model and instance, set by wait_for_health

    def _post(self, path: str, json: dict | None = None) -> dict:
        return self._request("POST", path, json=json)

    def _get(self, path: str, **params) -> dict:
        return self._request("GET", path, params=params)

    def _request(self, method: str, path: str, **kwargs) -> dict:
        """_request_once, and once more if the connection broke before an answer and the call can be repeated
        (a GET, or a sampling route: seeded, it repeats exactly). A pooled connection may break so when the
        server closes it, idle for its keep-alive time (5 s), just as the client sends on it; if the server is
        really gone, the second try fails too (ServerLost)."""
        try:
            return self._request_once(method, path, **kwargs)
        except ServerLost as e:
            if not isinstance(e.__cause__, requests.ConnectionError) or not (method == "GET" or path in REPEATABLE):
                raise
        return self._request_once(method, path, **kwargs)

    def _request_once(self, method: str, path: str, **kwargs) -> dict:
        """One call, which may take as long as its work does (a batch of long generations is not a lost
        server). While it runs, /health is asked every HEALTH_EVERY_S: a server silent there for
        `server_timeout` s is lost (ServerLost: the trainer waits for it). A call longer than
        `request_timeout` (0: no limit) stops the run."""
        call = InThread(self.session.request, method, self.base + path, **kwargs)
        started = answered = time.monotonic()
        limit = self.request_timeout or math.inf
        while not call.wait(min(HEALTH_EVERY_S, max(limit - (time.monotonic() - started), 0) + 0.01)):
            now = time.monotonic()
            if self.request_timeout and now - started > self.request_timeout:
                raise RunStopped(f"the vLLM server has not answered {path} within --vllm_request_timeout "
                                 f"{self.request_timeout:g}s, while it still answers /health: the work is slower than "
                                 "that limit (long generations, a large model, a slow machine); raise it, or 0 for "
                                 "none")
            instance = self.health()
            if instance and self.instance and instance != self.instance:  # the server of this request is gone
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
        return r.json() if r.content else {}  # the cache routes answer without a body

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
                        # The instance that gets our weights next; another one answering later is a restart.
                        self.instance = models.headers.get(INSTANCE_HEADER)
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
        """This client as it is now, for one rollout: the same connections, but the policy's model name (an
        adapter's, policy-N) and the server instance of now, kept while pushes and reconnects change this
        client's. Every request of the rollout samples that policy, and an answer from another instance is a
        lost server (the rollout is sampled again), never a sample of another policy (--max_staleness K:
        pushes land mid-rollout)."""
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
                 seed: int | None = None, structured_outputs_regex: str = "",
                 stop_token_ids: list[int] | None = None) -> list[dict]:
        """n completions of each prompt (token ids). Returns len(prompts) * n dicts, prompt-major:
        {token_ids, logprobs (the sampler's, per token), finish_reason ('stop' or 'length')}.
        With a `seed` the samples depend only on it and the weights, not on what else the server runs; every
        prompt gets that seed (the j-th of n seed + j): for streams of their own, see generate_each. A
        `structured_outputs_regex`: every completion matches it (vLLM's structured outputs). `stop_token_ids`:
        tokens that end a completion besides the model's eos (a chat template's end of turn), kept as its last."""
        if not prompts:
            return []
        body = dict(model=self.model_name, prompt=prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                    top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                    logprobs=0, return_token_ids=True, skip_special_tokens=False, stop_token_ids=stop_token_ids or [],
                    **structured(structured_outputs_regex))
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        assert len(choices) == len(prompts) * n, f"asked for {len(prompts) * n} completions, got {len(choices)}"
        return [dict(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"],
                     finish_reason=c["finish_reason"]) for c in choices]

    def generate_each(self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], **sampling):
        """One completion of each prompt, each a request of its own with its own max_tokens and seed, all sent
        at once (the server batches them), as generate returns them."""
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
                    logprobs=True, return_token_ids=True, skip_special_tokens=False,
                    **structured(structured_outputs_regex))
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
        (assistant) message; `token_ids`: the trainer's rendering, which the server's must equal
        (ValueError)."""
        body = dict(model=self.model_name, messages=messages, max_tokens=1, temperature=1.0, prompt_logprobs=0,
                    return_token_ids=True, add_generation_prompt=False, continue_final_message=True)
        answer = self._post("/v1/chat/completions", body)
        if answer["prompt_token_ids"] != token_ids:
            raise ValueError(f"the server rendered the sync probe as {len(answer['prompt_token_ids'])} tokens, the "
                             f"trainer as {len(token_ids)}: the server must render chats and images as the model "
                             "folder's processor does")
        return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], answer["prompt_logprobs"][1:])]

    def load_adapter(self, name: str, adapter: bytes, keep: int = 1):
        """Make the server sample with a LoRA adapter (a peft adapter as safetensors bytes, its
        adapter_config.json in the metadata) under `name` (e.g. policy-3), keeping the newest `keep` of those
        it was sent of the same series (policy-...; POST /load_adapter: the server writes it to a folder of
        its own, so the trainer needs no filesystem shared with it). Requests then name it as their model. An
        adapter the server refuses (a corrupt one, a rank above its --max-lora-rank, a name one of its user's
        adapters has) stops the run, saying why."""
        try:
            self._request("POST", "/load_adapter", params={"name": name, "keep": keep}, data=adapter,
                          headers={"Content-Type": "application/octet-stream"})
        except ServerRefused as e:
            raise RunStopped(f"the vLLM server refused the LoRA adapter {name} ({e.status}): {e.reason}") from None
        self.model_name = name

    def num_workers(self) -> int:
        """vLLM worker processes (tensor x pipeline x data parallel): each joins the weight transfer."""
        return self._get("/get_world_size")["world_size"]

    # vLLM's weight-sync control routes (the VLLMWeightSyncClient protocol of its trainer-side engines).
    def init_weight_transfer_engine(self, init_info: dict):
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict):
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None):
        self._post("/finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def pause(self):
        """Freeze the requests under way (they go on after resume()) and start no step: the weights can
        change."""
        # The caches are kept here: push() resets them once the new weights are in.
        self._request("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})

    def resume(self):
        self._post("/resume")

    def reset_prefix_cache(self):
        """Forget cached KV; requests under way (paused) are preempted, and recomputed with the new
        weights."""
        if not self._request("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})["success"]:
            raise RuntimeError("the vLLM server could not reset its prefix cache (blocks still held)")

    def reset_encoder_cache(self):
        """Forget the vision encoder's outputs: vLLM keeps them by image, and reset_prefix_cache leaves
        them."""
        self._post("/reset_encoder_cache")


class GlooWeightSender:
    """Trainer side of our gloo backend: this process is rank 0 of a gloo group with every vLLM
    worker, and broadcasts the weights packed into buckets (the wire protocol: this module's docstring)."""

    def __init__(self, client: VLLMClient, source, address: str, port: int, world_size: int, bucket_bytes: int):
        self.client, self.source, self.bucket_bytes = client, source, bucket_bytes
        init_info = dict(master_address=address, master_port=port, rank_offset=1, world_size=world_size)
        # The workers block inside the request until the group forms, so the request runs on a thread.
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
        weights = iter(self.source)  # one tensor at a time, so a bucket is the most this process holds
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
        """Send one bucket; if the server answers /update_weights before it is through, that answer is an
        error (it will not take the bucket), raised instead of waiting for the broadcast's time-out."""
        try:
            work = self.group.broadcast(data, 0)
            while not work.is_completed() and not answer.wait(0.001):
                pass
        except RuntimeError as e:  # gloo raises this when a worker went away
            raise ServerLost(f"weight transfer: {e}") from e
        # The server answered before this bucket was through: an error raises here; otherwise this was the
        # last bucket, and the server has them all.
        if not work.is_completed():
            self._check(answer)
        try:
            work.wait()
        except RuntimeError as e:
            raise ServerLost(f"weight transfer: {e}") from e

    def _check(self, answer):
        """The server's answer to /update_weights (once). An error from a server that is still up means it
        cannot take these weights (another model, other shapes), which waiting for it will not mend."""
        try:
            answer.result()
        except ServerLost as e:
            if not self.client.healthy():
                raise
            raise RunStopped(f"the vLLM server cannot take these weights: {e}. Start it with the trainer's --model "
                             f"(the same architecture and sizes)") from None
