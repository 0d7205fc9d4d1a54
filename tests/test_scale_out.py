"""DDP, FSDP2, LoRA and two nodes, each under torchrun (gloo) against the real server on the tiny model:
training changes the weights, the server computes with exactly the trainer's weights after every push,
and what is saved is what the server runs; a push that fails on rank 0 fails on every rank (FSDP2, LoRA)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ROOT, die_with_parent, free_port, launcher, make_tiny_model, run, run_train, running_server,
                      stop, train_args)
from utils import free_ports
from vllm_client import VLLMClient

pytestmark = pytest.mark.slow
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "16", "--lora_dropout", "0", "--save_merged_model"]
SMALL_RUN = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
             "--max_completion_length", "8", "--max_steps", "3", "--bf16", "false", "--beta", "0.04", "--micro_batch_size", "3"]


def logprobs(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        return torch.log_softmax(model(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]


def check_saved_run(server, out, metrics, lora: bool, tolerance: float = 1e-4, adapter: str | None = None):
    """The probe matched after every push (to `tolerance`: the trainer may compute in bf16, the server in
    fp32); the saved model differs from the start and is exactly what the server runs (fp32 weights; with the
    `adapter` pushed alone, the server's base with it)."""
    from transformers import AutoModelForCausalLM
    assert len(metrics) == 3 and all(m["grad_norm"] > 0 for m in metrics)
    assert max(m["sync_probe_diff_max"] for m in metrics) < tolerance, [m["sync_probe_diff_max"] for m in metrics]
    assert max(m["sampler_logprob_diff_max"] for m in metrics) < tolerance
    saved, initial = load_file(out / "model" / "model.safetensors"), load_file(os.path.join(server["model"], "model.safetensors"))
    assert saved.keys() == initial.keys()
    assert any(not torch.equal(saved[k], initial[k]) for k in initial)
    probe = list(range(100, 140))
    merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    client = VLLMClient(port=server["port"])
    client.wait_for_health(60)
    client.model_name = adapter or client.model_name
    server_logprobs = torch.tensor(client.prompt_logprobs(probe))
    assert (logprobs(merged, probe) - server_logprobs).abs().max() < 1e-4
    if lora:  # the adapter on the base model computes what the merged model computes
        from peft import PeftModel
        assert any(k != "model.embed_tokens.weight" and torch.equal(saved[k], initial[k]) for k in initial)  # norms stay
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32),
                                            out / "adapter")
        assert (logprobs(adapted, probe) - logprobs(merged, probe)).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "ddp_lora_merged", "fsdp_lora"])
def test_parallel_modes_train_keep_the_server_in_sync_and_save_what_it_runs(server, tmp_path, mode):
    """The session's server runs with LoRA on (--enable-lora): a LoRA run pushes its adapter alone, FSDP2 gathering
    the adapter only, and the server samples with it (the probe after every push, at fp32's 1e-4); or, with
    --lora_sync merged, every weight with the adapter merged in."""
    flags = {"ddp": [], "fsdp": ["--fsdp", "--gradient_checkpointing"], "fsdp_lora": ["--fsdp", *LORA],
             "ddp_lora_merged": [*LORA, "--gradient_checkpointing", "--lora_sync", "merged"]}[mode]
    lr = "5e-2" if "lora" in mode else "1e-2"
    proc, metrics = run_train(server, tmp_path / "out", *SMALL_RUN, "--learning_rate", lr, *flags)
    assert ("FSDP2" if "fsdp" in mode else "DDP") in proc.stdout and ("LoRA" in proc.stdout) == ("lora" in mode)
    pushed = {"fsdp_lora": "| pushes the LoRA adapter alone\n", "ddp_lora_merged": "| pushes all weights, LoRA merged\n"}
    assert pushed.get(mode, "| pushes all weights\n") in proc.stdout, proc.stdout[-2000:]
    assert metrics[-1]["kl"] > 0  # the reference (a copy, or the base with the adapter off) is in the loss
    check_saved_run(server, tmp_path / "out", metrics, lora="lora" in mode, adapter="policy-3" * (mode == "fsdp_lora"))


def test_a_push_that_fails_on_rank_0_fails_on_every_rank_and_never_hangs_them(server, tmp_path):
    """FSDP2 with the LoRA adapter pushed alone, 2 processes (tests/adapter_push_ranks.py): the server lost before the
    first push and back 3 s later (every rank reconnects once, the push goes through, the probe matches), refusing the
    adapter (every rank saves and stops, rank 0 with vLLM's reason), lost for good (every rank saves and stops after
    --vllm_server_timeout 3 s). Before, rank 0 left the push while the other ranks went on to gather the adapter:
    every rank hung until the collective time-out."""
    out, (group_port, dead_port) = tmp_path / "ranks.json", free_ports(2)
    script = os.path.join(ROOT, "tests", "adapter_push_ranks.py")
    proc = run([*launcher(2), script, server["model"], str(server["port"]), str(group_port), str(dead_port), str(out)],
               timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = json.loads(out.read_text())
    assert [r["pushed"] for r in ranks] == ["the LoRA adapter alone"] * 2
    back = [r["lost, then back"] for r in ranks]
    assert [(b["result"], b["reconnects"], b["model_name"]) for b in back] == [("ok", 1, "policy-0")] * 2, back
    assert max(b["seconds"] for b in back) < 40, back  # a wait of about 3 s, not the collective time-out (60 s)
    probe = ranks[0]["probe"]["result"]
    assert probe == ranks[1]["probe"]["result"] and probe["sync_probe_diff_max"] < 1e-4, probe
    assert ranks[0]["adapter_effect"] > 1e-2  # the adapter pushed is not a zero one: the probe sees it
    refused = [r["refused"] for r in ranks]
    assert refused[0]["result"].startswith("RunStopped: the vLLM server refused the LoRA adapter policy-1 (422): LoRA "
                                           "rank 32 is greater than max_lora_rank 16"), refused
    assert refused[1]["result"].startswith("RunStopped: the adapter push failed on another rank"), refused
    assert all("Saved out/checkpoint-1" in r["result"] and r["saved"] == 1 and r["seconds"] < 40 for r in refused)
    gone = [r["lost for good"] for r in ranks]
    assert all(g["result"].startswith(f"ServerGone: the vLLM server at http://127.0.0.1:{dead_port} did not answer "
                                      "within 3s. Saved out/checkpoint-1") for g in gone), gone
    assert all(g["saved"] == 2 and g["seconds"] < 40 for g in gone), gone


def test_two_nodes_on_loopback(server, tmp_path):
    """Two torchrun launchers, one per 'node', rendezvous on 127.0.0.1; the policy is sharded across them,
    with FSDP2's bf16 mixed precision (bf16 gathers and compute, fp32 weights and gradient reduction)."""
    port, out = free_port(), tmp_path / "out"
    args = train_args(server, out, *SMALL_RUN, "--learning_rate", "1e-2", "--fsdp", "--bf16", "true")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(r),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                              preexec_fn=die_with_parent)
             for r in (0, 1)]
    try:
        results = [node.communicate(timeout=900) for node in nodes]
    finally:
        for node in nodes:
            stop(node)
    for node, (stdout, stderr) in zip(nodes, results):
        assert node.returncode == 0, stdout[-3000:] + stderr[-5000:]
    assert "2 process(es)" in results[0][0] and "FSDP2" in results[0][0]
    check_saved_run(server, out, [json.loads(line) for line in open(out / "metrics.jsonl")], lora=False, tolerance=0.5)


def test_server_weights_merge_lora_like_peft_and_meet_vllms_weight_source_contract(tiny_model):
    """What the sync sends for a LoRA model: the base model's names, W + B A * scaling, in the asked dtype,
    checked by vLLM's own nccl trainer engine (the GPU path) against the metadata the server is sent."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
    from models import add_lora
    from weight_sync import ServerWeights
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    names = [name for name, _ in model.named_parameters()]
    base_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    lora = add_lora(model, 4, 8.0, 0.0, "q_proj,down_proj")
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at zero; make the update real
    source = ServerWeights(lora, torch.float32)
    sent = dict(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
    assert list(sent) == names
    want = lora.merge_and_unload().state_dict()
    assert max((sent[k] - want[k]).abs().max().item() for k in names) < 1e-6
    assert (sent["model.layers.0.self_attn.q_proj.weight"] - base_q).abs().max() > 1e-3  # the adapter is in it
    NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, packed=True,
                        packed_buffer_size_bytes=2**20, rank=0)  # the arguments WeightSync passes exist
    assert "nccl" in WeightTransferTrainerFactory._registry


def test_fsdp_run_against_a_tensor_parallel_server(tmp_path):
    """A server with --tensor-parallel-size 2: each of its workers holds half of each layer and joins the
    weight transfer; the server still computes exactly what the trainer computes after every push."""
    model = make_tiny_model(tmp_path / "two-heads", num_heads=2)  # tensor parallelism splits the heads
    with running_server(model, tmp_path / "server.log", "--tensor-parallel-size", "2") as tp_server:
        assert VLLMClient(port=tp_server["port"]).num_workers() == 2
        _, metrics = run_train(tp_server, tmp_path / "out", *SMALL_RUN, "--learning_rate", "1e-2", "--fsdp")
        check_saved_run(tp_server, tmp_path / "out", metrics, lora=False)
