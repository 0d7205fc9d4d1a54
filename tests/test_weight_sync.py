"""What a push sends, without a server: the LoRA adapter alone is the adapter peft saves (names, values, config), and
a run that cannot push it says why at start. The pushes themselves, through the real server: test_scale_out.py."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load, load_file

from config import Config
from conftest import make_tiny_model
from models import add_lora, load_model
from weight_sync import AdapterWeights, adapter_refused


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    model = add_lora(load_model(make_tiny_model(tmp_path_factory.mktemp("tiny")), "cpu"), 4, 16.0, 0.0, "all-linear")
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter: B is no longer 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def test_the_adapter_push_is_what_peft_saves(lora_model, tmp_path):
    payload = AdapterWeights(lora_model).payload(is_main=True)
    assert AdapterWeights(lora_model).payload(is_main=False) is None  # only rank 0 sends
    lora_model.save_pretrained(tmp_path)
    saved, sent = load_file(tmp_path / "adapter_model.safetensors"), load(payload)
    assert sent.keys() == saved.keys() and len(sent) == 2 * 7 * 2  # A and B of 7 linear layers in 2 decoder layers
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    header = json.loads(payload[8:8 + int.from_bytes(payload[:8], "little")])  # the server reads it so
    config = json.loads(header["__metadata__"]["adapter_config"])
    on_disk = json.load(open(tmp_path / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 16.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(on_disk["target_modules"])


def test_a_skipped_adapter_tensor_is_left_out(lora_model, monkeypatch):
    """The fault the sync-check test injects (NANOGRPO_FAULT_SKIP_WEIGHT): the probe must catch the push without it."""
    monkeypatch.setenv("NANOGRPO_FAULT_SKIP_WEIGHT", "model.layers.1.mlp.down_proj.weight")
    sent = load(AdapterWeights(lora_model).payload(is_main=True))
    assert len(sent) == 2 * 7 * 2 - 2 and not any("layers.1.mlp.down_proj" in k for k in sent)


def test_why_the_adapter_alone_cannot_be_pushed(lora_model):
    cfg = Config(use_peft=True, lora_r=4)
    assert adapter_refused(cfg, {"max_lora_rank": 16}, lora_model) == ""
    assert "server runs without LoRA: start it with --enable-lora --max-lora-rank 4" in adapter_refused(cfg, None,
                                                                                                      lora_model)
    assert "--lora_r 4 is above the server's --max-lora-rank 1" in adapter_refused(cfg, {"max_lora_rank": 1},
                                                                                  lora_model)
    ahead = Config(use_peft=True, lora_r=4, async_generation=True, max_staleness=64)  # 65 adapters in use at once
    assert "--max_staleness 64 needs 65 adapters on the server, which keeps 64 of a run at most" in adapter_refused(
        ahead, {"max_lora_rank": 16}, lora_model)
    assert adapter_refused(dataclasses.replace(ahead, max_staleness=63), {"max_lora_rank": 16}, lora_model) == ""
    norm = lora_model.get_base_model().model.norm.weight
    norm.requires_grad_(True)  # a weight that trains outside the adapter cannot travel with it
    try:
        assert "model.norm.weight trains outside the adapter" in adapter_refused(cfg, {"max_lora_rank": 16},
                                                                                 lora_model)
    finally:
        norm.requires_grad_(False)
