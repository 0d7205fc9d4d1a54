"""Shared fixtures: a tiny random model with the SmolLM2 tokenizer, and the real vLLM server on it."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen):
    """Stop exactly the process group we started (the server's workers included)."""
    import utils
    utils.stop_process_group(proc)


def collated(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0):
    """Model inputs and completion mask of (prompt, completion) token lists, as rollout.collate makes them."""
    from rollout import collate, sampled_episode
    inputs, tokens = collate([sampled_episode({}, p, c) for p, c in zip(prompts, completions)], pad_id)
    return inputs, tokens["mask"]


def make_tiny_model(path, num_heads: int = 1, max_positions: int = 1024) -> str:
    """A random 2-layer Llama (head_dim 64: vLLM's CPU attention rejects 16) with tied embeddings and the
    SmolLM2 tokenizer; 3 M parameters with one head."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from config import default_model_path
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads, head_dim=64,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # one constant hidden dimension, and EOS favoured along it: P(EOS) ~ 0.1 per token, so
        E = model.model.embed_tokens.weight  # completions end at different lengths and brevity is learnable
        E[:, 0] = 1.0
        E[config.eos_token_id, 0] = 2.1
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@contextlib.contextmanager
def running_server(model: str, log_path, *extra: str, port: int | None = None):
    """The real vllm_server.py on a free loopback port (or `port`), fp32 so log-probs can be compared
    tightly; stopped (its whole process group) on exit, also when the test fails."""
    port = port or free_port()
    log = open(log_path, "w+")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "vllm_server.py"), "--model", model, "--port", str(port),
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    from config import UsageError
    from vllm_server import VLLMClient
    client = VLLMClient(port=port, api_key=extra[extra.index("--api-key") + 1] if "--api-key" in extra else None)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.wait_for_health(timeout=2)
                break
            except UsageError:  # not answering yet
                pass
        if proc.poll() is not None or client.model_name is None:
            log.seek(0)
            raise RuntimeError("vllm_server.py did not start:\n" + log.read()[-5000:])
        yield {"port": port, "model": model, "proc": proc}
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """The server on the tiny model, shared by the tests of a session."""
    with running_server(tiny_model, tmp_path_factory.mktemp("server") / "server.log") as s:
        yield s


def train_args(server, out, *args) -> list[str]:
    return [os.path.join(ROOT, "train.py"), "--model", server["model"], "--vllm_server_port", str(server["port"]),
            "--vllm_group_port", str(free_port()), "--output_dir", str(out), "--eval_steps", "0", *args]  # evaluate where asked


def launcher(nproc: int) -> list[str]:
    """torchrun with `nproc` processes on a free rendezvous port, or plain python for one."""
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
            if nproc > 1 else [sys.executable])


def run_train(server, out, *args, nproc=2, check=True, env=None, **kwargs):
    """train.py on the tiny model against `server`: under torchrun with `nproc` processes (gloo), or plain
    python for 1. Returns the process and the metrics of each step (or only the process, if not `check`)."""
    proc = subprocess.run([*launcher(nproc), *train_args(server, out, *args)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), **kwargs)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, [json.loads(line) for line in open(out / "metrics.jsonl")]
