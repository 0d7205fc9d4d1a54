"""The server's POST /load_adapter (vllm_server.py serves it): a LoRA adapter sent as safetensors bytes, which
the server writes to a folder of its own and serves under the name it was sent (vLLM's own route loads only
from a folder the server can read, and cannot tell the adapters a user serves from those a trainer pushed).
The server replaces, unloads and deletes only adapters it wrote: a user's (--lora-modules, a LoRA resolver)
and their folders stay as they are. The body is bounded by vllm_server.py's --max-adapter-mb; an adapter vLLM
refuses answers 422 with vLLM's reason (the trainer stops saying so; a 5xx would be a lost server to it,
waited for). vLLM and Starlette are imported inside the functions: the trainer reads MAX_KEEP without them."""
import asyncio
import atexit
import contextlib
import functools
import json
import math
import os
import re
import shutil
import tempfile

from config import UsageError

# /load_adapter's ?name=: a folder name, never a path.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
MAX_KEEP = 64  # /load_adapter's ?keep= at most: the trainer sends --max_staleness + 1
DEFAULT_MAX_ADAPTER_MB = "1024"  # --max-adapter-mb: the largest adapter /load_adapter takes
WRITE_BYTES = 8 * 2**20  # /load_adapter writes the body in pieces of this size, each on a thread


@functools.cache
def adapter_folder() -> str:
    """The server's own folder for the adapters it is sent, removed when it exits."""
    folder = tempfile.mkdtemp(prefix="nanogrpo-adapters-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def own_adapters(app) -> dict[str, str]:
    """The adapters this server wrote (name -> its folder, oldest first): the only ones it replaces, unloads
    or deletes. A user's adapters (--lora-modules, a LoRA resolver) are not among them, nor their folders."""
    if not hasattr(app.state, "nanogrpo_adapters"):
        app.state.nanogrpo_adapters = {}
    return app.state.nanogrpo_adapters


def adapter_series(name: str) -> str:
    """The series of an adapter's name, its name without a trailing -N: one trainer's pushes (policy-1,
    policy-2, ...) are one series, a dry run's (dry-run-3fa9c2d1-0) another."""
    return re.sub(r"-[0-9]+$", "", name)


def json_answer(status: int, body: dict):
    from starlette.responses import JSONResponse
    return JSONResponse(body, status_code=status)


async def load_adapter(request):
    """POST /load_adapter?name=NAME&keep=K: a peft adapter (safetensors, its adapter_config.json in the
    metadata) goes to a folder of this server's and is loaded under NAME (--enable-lora), in place of the one
    it loaded under NAME before (whose folder goes). Of its own adapters of NAME's series (adapter_series) the
    newest K stay, the others are unloaded and their folders removed; adapters it did not write are never
    replaced (409), unloaded or deleted. A bad name, keep or body answers 400, a body above --max-adapter-mb
    413, an adapter vLLM refuses 422 with its reason: the trainer stops saying so (a 5xx would be read as a
    lost server, and waited for)."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest
    models, own = request.app.state.openai_serving_models, own_adapters(request.app)
    name, keep = request.query_params.get("name", ""), request.query_params.get("keep", "1")
    why = None
    if not ADAPTER_NAME.fullmatch(name) or not re.fullmatch(r"[0-9]{1,3}", keep) or not 1 <= int(keep) <= MAX_KEEP:
        why = 400, f"give ?name= (up to 100 letters, digits, . _ -) and ?keep= (a count from 1 to {MAX_KEEP})"
    elif name in models.lora_requests and name not in own:
        why = 409, (f"the server serves an adapter named {name} that it did not write (--lora-modules or a LoRA "
                    "resolver): it stays as it is; push under another name")
    if why:
        # Read the body to its end, so that a client still sending gets the answer, not a reset connection.
        async for _ in request.stream():
            pass
        return json_answer(why[0], {"error": why[1]})
    folder, loaded = await asyncio.to_thread(tempfile.mkdtemp, prefix=f"{name}-", dir=adapter_folder()), False
    try:
        why = await write_adapter(request, folder, os.environ.get("NANOGRPO_MAX_ADAPTER_MB", DEFAULT_MAX_ADAPTER_MB))
        if why:
            return json_answer(why[0], {"error": why[1]})
        done = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=folder,
                                                                     load_inplace=name in own))
        # vLLM's ErrorResponse: a rank above --max-lora-rank, a corrupt adapter, ...
        if not isinstance(done, str):
            status = done.error.code if done.error.code < 500 else 503 if models.engine_client.errored else 422
            return json_answer(status, {"error": worker_error(done.error.message)})
        loaded = True
    finally:
        if not loaded:
            await asyncio.to_thread(shutil.rmtree, folder, True)
    replaced = own.pop(name, None)
    own[name] = folder  # inserted last, as the newest
    if replaced:
        await asyncio.to_thread(shutil.rmtree, replaced, True)
    await unload_older(models, own, adapter_series(name), int(keep))
    return json_answer(200, {"loaded": name})


async def write_adapter(request, folder: str, max_mb: str) -> tuple[int, str] | None:
    """The body into `folder` as vLLM loads a peft adapter: adapter_model.safetensors, and adapter_config.json
    from its metadata. Written in pieces, each on a thread (the server answers /health meanwhile), up to
    `max_mb`; a longer body is read to its end (the client, still sending, then gets the answer) and not kept.
    (status, why) if refused."""
    path, size, piece, limit = os.path.join(folder, "adapter_model.safetensors"), 0, bytearray(), float(max_mb) * 2**20
    with open(path, "wb") as f:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                continue  # read and counted to the end, but not kept
            piece += chunk
            if len(piece) >= WRITE_BYTES:
                await asyncio.to_thread(f.write, piece)
                piece = bytearray()
        if size <= limit:
            await asyncio.to_thread(f.write, piece)
    if size > limit:
        return 413, (f"the adapter is {size / 2**20:.1f} MB, above the server's --max-adapter-mb {max_mb}: restart it "
                     "with a larger one")
    config = await asyncio.to_thread(adapter_config_of, path)
    if config is None:
        return 400, ("the body is not a peft adapter as the trainer sends it: safetensors, its adapter_config.json "
                     "as adapter_config in the metadata")
    await asyncio.to_thread(write_text, os.path.join(folder, "adapter_config.json"), config)
    return None


def adapter_config_of(path: str) -> str | None:
    """The adapter_config.json in the metadata of a safetensors file (an 8-byte length, then a JSON header),
    as weight_sync.AdapterWeights puts it there; None if the file is not so."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 2 <= length <= min(os.path.getsize(path) - 8, 100 * 2**20):
            return None
        header = f.read(length)
    with contextlib.suppress(ValueError, TypeError, KeyError):
        config = json.loads(header)["__metadata__"]["adapter_config"]
        if isinstance(json.loads(config), dict):
            return config
    return None


def worker_error(message: str) -> str:
    """The reason in vLLM's message about a LoRA adapter a worker could not load: "Call to add_lora method
    failed: Worker failed with error 'LoRA rank 32 is greater than max_lora_rank 16.', please check the stack
    trace above for the root cause" -> "LoRA rank 32 is greater than max_lora_rank 16." (other messages as
    they are)."""
    found = re.search(r"Worker failed with error '(.*)', please check the stack trace", message, re.S)
    return found[1] if found else message.removeprefix("Call to add_lora method failed: ")


def write_text(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)


async def unload_older(models, own: dict[str, str], series: str, keep: int):
    """Unload this server's adapters of `series` but the newest `keep` (batches sampled ahead may still use
    those), and remove their folders."""
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest
    for old in [name for name in own if adapter_series(name) == series][:-keep]:
        folder, loaded = own.pop(old, None), models.lora_requests.get(old)
        if folder is None:  # unloaded meanwhile by a push that ran at the same time
            continue
        if loaded is not None and loaded.lora_path == folder:
            await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=old))
            await models.engine_client.remove_lora(loaded.lora_int_id)
        await asyncio.to_thread(shutil.rmtree, folder, True)


def max_adapter_mb(value: str) -> str:
    """--max-adapter-mb, checked: a number of MB above 0."""
    with contextlib.suppress(ValueError):
        if 0 < float(value) < math.inf:
            return value
    raise UsageError(f"--max-adapter-mb {value}: the largest LoRA adapter the server takes (POST /load_adapter), in "
                     f"MB: give a number above 0 (default {DEFAULT_MAX_ADAPTER_MB})")


def take_max_adapter_mb(argv: list[str]) -> list[str]:
    """`argv` without vllm_server.py's flag --max-adapter-mb N (or =N), which vLLM's parser does not know; its
    value, checked, goes to the route through the environment (read in every API server process)."""
    rest, value, i = [], DEFAULT_MAX_ADAPTER_MB, 0
    while i < len(argv):
        if argv[i] == "--max-adapter-mb" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--max-adapter-mb="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    os.environ["NANOGRPO_MAX_ADAPTER_MB"] = max_adapter_mb(value)
    return rest
