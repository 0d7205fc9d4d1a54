"""Run by tests/test_server_guard.py under torchrun (2 processes, gloo): the server is lost while rank 0
asks it for the sync probe, and every rank must still take part in the same collectives, wait for the
server, push and probe again. Then a call fails on rank 1 alone with an error that waiting cannot mend:
every rank saves and stops. Last, the server's config read before any guard exists fails on rank 0 alone: every rank
raises. Rank 0 writes [what happened on each rank] as JSON to the file given."""
import json
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from guard import ServerGuard  # noqa: E402
from logprobs import completion_logprobs  # noqa: E402
from utils import setup_distributed, teardown_distributed
from vllm_client import ServerLost, on_every_rank  # noqa: E402
from weight_sync import Probe, check_sync

rank, _, world_size, _, is_main = setup_distributed()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, head_dim=16)).double()
probe_ids = list(range(3, 13))


class Server:
    """A stand-in: lost during rank 0's first probe, then back; it computes with the trainer's weights."""
    base = "http://127.0.0.1:8123"

    def __init__(self):
        self.probes, self.pushes = 0, 0

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        self.probes += 1
        if self.probes == 1:
            raise ServerLost("connection refused")
        x = torch.tensor([ids])
        with torch.no_grad():
            return completion_logprobs(model, {"input_ids": x, "attention_mask": torch.ones_like(x)}, len(ids) - 1,
                                       1.0)[0][0].tolist()

    def wait_for_health(self, timeout: float):
        pass

    def connect(self):
        pass

    def push(self):
        self.pushes += 1


server = Server()
saved = []
guard = ServerGuard(server, server, 5, on_gone=lambda: saved.append(1) or "out/checkpoint-1")
probe = guard.run(check_sync, server, model, Probe(probe_ids), nullcontext(), is_main, 1e-6, 1)
mine = {"probe": probe, "reconnects": guard.reconnects, "pushes": server.pushes, "probes": server.probes}


def refused():
    if rank == 1:
        raise RuntimeError("vLLM server /v1/completions answered 400: maximum context length is 512 tokens")
    return "episodes"


try:
    guard.run(refused)
except Exception as e:
    mine["stopped"] = f"{type(e).__name__}: {e}"
mine["saved"] = len(saved)


def config_lost_on_rank_0():
    if rank == 0:
        raise ServerLost("connection refused")
    return {"lora_config": None}


try:  # before the guard exists (weight_sync.server_sync): every rank raises, none goes on into a collective alone
    on_every_rank(config_lost_on_rank_0, "reading the server's config")
except Exception as e:
    mine["config"] = f"{type(e).__name__}: {e}"
dist.barrier()
everyone = [None] * world_size
dist.all_gather_object(everyone, mine)
if is_main:
    with open(sys.argv[1], "w") as f:
        json.dump(everyone, f)
teardown_distributed()
