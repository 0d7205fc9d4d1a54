"""Run by tests/test_scale_out.py under torchrun (2 processes, gloo): FSDP2 training a LoRA adapter that is pushed
alone (weight_sync.server_sync, as train.py builds it) to the real server. A push that fails on rank 0 must fail on
every rank at the same point, so that the guard's collectives meet, in each of three cases:
  lost, then back: the server is lost before the first push (every rank's client finds nothing at its address, as
    after a kill: it is pointed at a port where nothing listens) and back 3 s later: every rank waits for it,
    reconnects once, and the push (base weights, then the adapter) goes through: the probe matches;
  refused: the server refuses the adapter (its rank 32 is above the server's --max-lora-rank 16): every rank saves
    and stops, rank 0 with the server's reason;
  lost for good: every rank saves and stops after --vllm_server_timeout (3 s).
Before, rank 0 raised out of the push while the other ranks went on into the adapter's gathers, and every rank
hung until the collective time-out (60 s here, 30 minutes in a run).
Usage: adapter_push_ranks.py MODEL_DIR SERVER_PORT GROUP_PORT DEAD_PORT OUT_JSON; rank 0 writes what happened on
each rank to OUT_JSON."""
import dataclasses
import json
import os
import sys
import threading
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import Config  # noqa: E402
from guard import ServerGuard, connect_server  # noqa: E402
from models import build_models  # noqa: E402
from utils import setup_distributed, teardown_distributed  # noqa: E402
from weight_sync import AdapterWeights, Probe, check_sync, server_sync  # noqa: E402

model_dir, port, group_port, dead_port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
rank, _, world_size, device, is_main = setup_distributed(timeout_s=60)
cfg = Config(model=model_dir, use_peft=True, lora_r=4, lora_alpha=16.0, lora_dropout=0.0, fsdp=True, bf16=False,
             beta=0.0, vllm_server_port=port, vllm_group_port=group_port, vllm_server_timeout=60)
client, server_dtype, _ = connect_server(cfg, 10)
base_name = client.model_name
_, model, _ = build_models(cfg, model_dir, False, None, device, world_size)
with torch.no_grad():  # a trained adapter (B is 0 at first): the server's samples depend on it
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.to_local().normal_(std=0.5, generator=torch.Generator().manual_seed(rank))
version = [0]
sync, pushed = server_sync(cfg, client, model, server_dtype, rank, version=lambda: version[0])
saved, mine = [], {"pushed": pushed}


def save(*signal) -> str:
    saved.append(1)
    return "out/checkpoint-1"


def outcome(guard: ServerGuard, fn, *args) -> dict:
    started = time.monotonic()
    try:
        fn_result = guard.run(fn, *args)
        result = "ok" if fn_result is None else fn_result
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    return {"result": result, "seconds": time.monotonic() - started, "reconnects": guard.reconnects,
            "saved": len(saved), "model_name": client.model_name}


def lose_the_server(back_after_s: float | None):
    """Every request of this rank's client finds nothing at its address, until `back_after_s` have passed."""
    real, client.base = client.base, f"http://127.0.0.1:{dead_port}"
    if back_after_s is not None:
        threading.Timer(back_after_s, setattr, (client, "base", real)).start()


lose_the_server(back_after_s=3)
mine["lost, then back"] = outcome(ServerGuard(client, sync, 60, on_gone=save), sync.push)
probe = list(range(100, 140))
mine["probe"] = outcome(ServerGuard(client, sync, 60, on_gone=save), check_sync, client, model, Probe(probe),
                        nullcontext(), is_main, 1e-4, 1)
if is_main:  # how much the adapter changes the server's log-probs: the probe's match is not the base's
    adapted, client.model_name = client.prompt_logprobs(probe), base_name
    mine["adapter_effect"] = max(abs(a - b) for a, b in zip(adapted, client.prompt_logprobs(probe)))
    client.model_name = "policy-0"

version[0] = 1
_, model_32, _ = build_models(dataclasses.replace(cfg, lora_r=32), model_dir, False, None, device, world_size)
sync.source = AdapterWeights(model_32, server_dtype)  # the base weights are the same (and already sent)
mine["refused"] = outcome(ServerGuard(client, sync, 60, on_gone=save), sync.push)

version[0] = 2
sync.source = AdapterWeights(model, server_dtype)
sync.connect()  # the next push sends the base weights first: the server is lost before it
lose_the_server(back_after_s=None)
mine["lost for good"] = outcome(ServerGuard(client, sync, 3, on_gone=save), sync.push)

everyone = [None] * world_size
dist.all_gather_object(everyone, mine)
if is_main:
    with open(out, "w") as f:
        json.dump(everyone, f)
teardown_distributed()
