"""The generation server; the trainer's side of the wire is vllm_client.py.

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
  - POST /load_adapter (adapter_route.py): a LoRA adapter sent as bytes, served under its name; this file's
    flag `--max-adapter-mb` (default 1024) bounds it;
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

The server's half of a gloo weight push is register_gloo_backend: each worker receives the buckets and loads
them through vLLM's layerwise reload. The order of the calls, the trainer's half, is in vllm_client.py's
docstring; the trainer's client (VLLMClient) and what both sides share (the ports, INSTANCE_HEADER,
bucket_plan, gloo_group) are in vllm_client.py.
"""
import functools
import hmac
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch

from adapter_route import load_adapter, take_max_adapter_mb
from config import DEFAULT_MODEL, UsageError, native_bf16, run_main
from embedded import resolve_model
from utils import set_malloc_thresholds
from vllm_client import DEFAULT_PORT, INSTANCE_HEADER, bucket_plan, check_port_free, gloo_group, tensor_nbytes


# -----------------------------------------------------------------------------
# server side: the gloo weight-transfer backend, registered in every vLLM process that imports
# this module (the API server runs main(); the workers import WorkerExtension below)
# (the trainer's side of a push, and the order of its calls: vllm_client.py)

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
    """HTTP middleware of the server (vLLM's --middleware). Every other route vLLM would serve answers 404
    (its dev mode also opens /collective_rpc, /sleep, /pause, ...: arbitrary calls into the workers). With
    --api-key (or VLLM_API_KEY) every route but /health wants `Authorization: Bearer <key>`; vLLM's own check
    covers /v1 only. Every answer names this instance of the server (INSTANCE_HEADER): the trainer sees a
    restart at once."""
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


SPIN_AFTER_READ_S = 0.002  # a queue reader spins this long after a message before it waits (vLLM: 1 s)
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
    except (ImportError, AttributeError):  # a vLLM version without them: nothing to change
        return
    # A waiting reader looks at the queue every recheck_s (vLLM reads this setting at every wait).
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = max(1, round(recheck_s * 1000))
    # vLLM's own __init__, also if this function patched it before.
    init = getattr(SpinCondition.__init__, "__wrapped__", SpinCondition.__init__)

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
    """What a CPU server's processes need beyond vLLM's defaults: little busy polling, and freed memory reused
    (each push's buckets and the reload's new layer tensors would otherwise fault in fresh pages every
    time)."""
    if os.environ.get("NANOGRPO_VLLM_POLLING") != "1":
        wait_briefly_instead_of_spinning()
    keep_freed_memory()


if os.environ.get("NANOGRPO_CPU_SERVER") == "1":
    # A process of a CPU server started by main(): processes that vLLM spawns re-import the server's script.
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
    for i, a in enumerate(argv):  # the embedded model's name becomes its converted folder
        if a == "--model" and i + 1 < len(argv):
            argv[i + 1] = resolve_model(argv[i + 1])
        elif a.startswith("--model="):
            argv[i] = "--model=" + resolve_model(a.split("=", 1)[1])
    defaults = {"--host": "127.0.0.1", "--port": str(DEFAULT_PORT), "--logprobs-mode": "processed_logprobs",
                "--worker-extension-cls": "vllm_server.WorkerExtension",
                # On GPUs, vLLM's nccl (GPU to GPU); on CPUs, our gloo.
                "--weight-transfer-config": json.dumps({"backend": "nccl" if torch.cuda.is_available() else "gloo"})}
    if not torch.cuda.is_available():
        # vLLM's "auto" computes a float32 model in bf16 on every x86 CPU, also where bf16 is emulated (~100x
        # slower), so the default here follows the CPU.
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
    """Config.kv_cache_bytes for the server `argv` starts (completed by serve_args): its model, dtype and
    maximum model length (run.sh's and the benches' --kv-cache-memory-bytes)."""
    argv = serve_args(argv)
    dtype_bytes = 4 if flag_value(argv, "--dtype") in ("float32", "float") else 2
    return cfg.kv_cache_bytes(flag_value(argv, "--model"), dtype_bytes, int(flag_value(argv, "--max-model-len")))


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = take_max_adapter_mb(argv)  # this file's own flag, which vLLM's parser does not know
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # enables the weight-transfer and cache routes
    if flag_value(argv, "--kv-cache-memory-bytes") is None:  # the variable, if set, would win over the flag
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, vLLM on CPU sizes it by all RAM
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
    # The workers import this module. No empty entry: it would put each child's working folder on its path.
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
    # The server's instance, the same in every process of it: a restart shows as another one.
    os.environ["NANOGRPO_SERVER_INSTANCE"] = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    uvloop.run(run_server(args))


if __name__ == "__main__":
    run_main(main)
