"""The server's /load_adapter without a server (adapter_route.py): its flag, the series a push keeps, what it reads
from a body. The route itself, on the real server: test_server.py."""
import os

import pytest
import safetensors.torch
import torch

from adapter_route import adapter_config_of, adapter_series, take_max_adapter_mb
from config import UsageError


def test_the_max_adapter_flag_is_taken_out_for_vllm_and_checked(monkeypatch):
    monkeypatch.delenv("NANOGRPO_MAX_ADAPTER_MB", raising=False)
    assert take_max_adapter_mb(["--model", "m", "--max-adapter-mb", "16", "--port", "1"]) == ["--model", "m", "--port",
                                                                                              "1"]
    assert os.environ["NANOGRPO_MAX_ADAPTER_MB"] == "16"
    assert take_max_adapter_mb(["--max-adapter-mb=0.5", "--model", "m"]) == ["--model", "m"]
    assert os.environ["NANOGRPO_MAX_ADAPTER_MB"] == "0.5"
    assert take_max_adapter_mb(["--model", "m"]) == ["--model", "m"] and os.environ["NANOGRPO_MAX_ADAPTER_MB"] == "1024"
    for bad in ("0", "-3", "lots", "inf", "nan"):
        with pytest.raises(UsageError, match=f"^--max-adapter-mb {bad}: the largest LoRA adapter the server takes"):
            take_max_adapter_mb(["--max-adapter-mb", bad])


def test_a_push_keeps_its_own_series_and_the_body_must_carry_its_config(tmp_path):
    assert [adapter_series(n) for n in ("policy-3", "policy-12", "dry-run-1a2b0c3d-0", "user", "v-2-x")] == [
        "policy", "policy", "dry-run-1a2b0c3d", "user", "v-2-x"]
    good, plain, cut = tmp_path / "good", tmp_path / "plain", tmp_path / "cut"
    tensors = {"a": torch.ones(2, 3)}
    good.write_bytes(safetensors.torch.save(tensors, metadata={"adapter_config": '{"r": 4}'}))
    plain.write_bytes(safetensors.torch.save(tensors))  # no config: vLLM could not load it
    cut.write_bytes(good.read_bytes()[:20])  # its header cut short
    assert adapter_config_of(str(good)) == '{"r": 4}'
    assert [adapter_config_of(str(p)) for p in (plain, cut)] == [None, None]
    for body in (b"", b"\xff" * 8 + b"{}", (2).to_bytes(8, "little") + b"[]", b"not an adapter at all"):
        (tmp_path / "bad").write_bytes(body)
        assert adapter_config_of(str(tmp_path / "bad")) is None, body
