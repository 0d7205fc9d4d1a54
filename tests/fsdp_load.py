"""Run by tests/test_invariance.py under torchrun: FSDP2 trains the model in the folder, though only rank 0 reads
it. Loads MODEL_DIR as train.py does (utils.load_model with fsdp: rank 0 reads, the other ranks build the model
on the meta device; models.distribute shards it from rank 0's copy), as it is ("plain"), with a fresh LoRA adapter
("lora") or with one to continue from ("adapter=DIR"), and compares with a plain load on every rank: every
parameter (gathered), every buffer (rotary frequencies are not in the state dict), the logits of a forward; tied
weights stay one parameter. Checks the cases one after another in one launch, and prints "ok RANK CASE" (the case's
name: plain, lora or adapter) after each that passed. Usage: fsdp_load.py MODEL_DIR CASE..."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import add_lora, distribute, full_tensor, load_model  # noqa: E402
from utils import run_and_exit, setup_distributed


def build(path: str, device, fsdp: bool, case: str):
    model = load_model(path, device, fsdp)
    if case != "plain":
        saved = case.split("=", 1)[1] if case.startswith("adapter=") else None  # the adapter to continue from
        torch.manual_seed(0)  # a fresh adapter: rank 0's random lora_A is the one every rank must get
        model = add_lora(model, 4, 8, 0.0, "q_proj,v_proj", saved)
    return distribute(model, device, fsdp, False, 2 if fsdp else 1)  # not DDP: the plain model as it loads


def main(path: str, cases: list[str]):
    rank, _, _, device, _ = setup_distributed()
    for case in cases:
        check(path, case, device)
        # one write of the whole line: the ranks share stdout, and print() may split a line in two writes
        os.write(1, f"ok {rank} {case.split('=')[0]}\n".encode())


def check(path: str, case: str, device):
    """The sharded model of `case` is the plain one; an AssertionError says what differs."""
    plain, sharded = build(path, device, False, case), build(path, device, True, case)
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
    if case != "plain":
        adapters = [n for n in names if "lora_" in n]
        assert adapters and all(p.requires_grad for n, p in sharded.named_parameters() if n in adapters)


if __name__ == "__main__":
    run_and_exit(main, sys.argv[1], sys.argv[2:])
