"""Run by tests/test_invariance.py under torchrun: FSDP2 trains the model in the folder, though only rank 0 reads
it. Loads MODEL_DIR as train.py does (utils.load_model with fsdp: rank 0 reads, the other ranks build the model
on the meta device; utils.distribute shards it from rank 0's copy), with a fresh LoRA adapter ("lora") or one to
continue from ("adapter DIR"), and compares with a plain load on every rank: every parameter (gathered), every
buffer (rotary frequencies are not in the state dict), the logits of a forward; tied weights stay one parameter.
Prints "ok RANK" on success. Usage: fsdp_load.py MODEL_DIR [lora | adapter DIR]"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from utils import add_lora, distribute, full_tensor, load_model, run_and_exit, setup_distributed  # noqa: E402


def build(path: str, device, fsdp: bool, options: list[str]):
    model = load_model(path, device, fsdp)
    if options:
        torch.manual_seed(0)  # a fresh adapter: rank 0's random lora_A is the one every rank must get
        model = add_lora(model, 4, 8, 0.0, "q_proj,v_proj", options[1] if options[0] == "adapter" else None)
    return distribute(model, device, fsdp, False, 2 if fsdp else 1)  # not DDP: the plain model as it loads


def main(path: str, options: list[str]):
    rank, _, _, device, _ = setup_distributed()
    plain, sharded = build(path, device, False, options), build(path, device, True, options)
    names = [n for n, _ in plain.named_parameters()]
    assert names == [n for n, _ in sharded.named_parameters()], "other parameters"
    for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters()):
        assert torch.equal(p.detach(), full_tensor(q.detach())), name
    for (name, b), (_, c) in zip(plain.named_buffers(), sharded.named_buffers(), strict=True):
        assert torch.equal(b, c), name
    lm_head = plain.get_output_embeddings()
    assert lm_head.weight is plain.get_input_embeddings().weight, "the test model ties its embeddings"
    assert len(names) == len(list(plain.named_parameters(remove_duplicate=False))) - 1
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, sharded(input_ids=ids).logits, atol=1e-5)
    if options:
        adapters = [n for n in names if "lora_" in n]
        assert adapters and all(p.requires_grad for n, p in sharded.named_parameters() if n in adapters)
    print("ok", rank, flush=True)


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1], sys.argv[2:])
