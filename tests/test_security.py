"""A server started with --api-key: every route but /health wants the key, routes training does not use
are not there at all, and the trainer sends the key from VLLM_API_KEY (or says that it needs it)."""
import itertools
import os

import pytest
import requests

from conftest import run_train, running_server
from vllm_server import TRAINING_ROUTES

pytestmark = pytest.mark.slow
KEY = "test-key-4711"


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    with running_server(tiny_model, tmp_path_factory.mktemp("keyed") / "server.log", "--api-key", KEY) as s:
        yield s


def test_the_key_guards_every_route_and_unused_routes_are_closed(keyed_server):
    base, auth = f"http://127.0.0.1:{keyed_server['port']}", {"Authorization": f"Bearer {KEY}"}
    assert requests.get(base + "/health", timeout=10).status_code == 200  # for load balancers and the trainer's wait
    assert len(TRAINING_ROUTES) > 10
    for path, method in itertools.product(TRAINING_ROUTES - {"/health"}, ("get", "post")):  # the server's own list
        assert getattr(requests, method)(base + path, timeout=10).status_code == 401, path
        wrong = {"Authorization": "Bearer not-the-key"}
        assert getattr(requests, method)(base + path, headers=wrong, timeout=10).status_code == 401, path
    assert requests.get(base + "/v1/models", headers=auth, timeout=10).status_code == 200
    assert requests.post(base + "/reset_encoder_cache", headers=auth, timeout=10).status_code == 200  # every push
    for path in ("/collective_rpc", "/sleep", "/wake_up", "/abort_requests", "/invocations", "/v1/load_lora_adapter"):
        assert requests.post(base + path, headers=auth, timeout=10).status_code == 404, path  # not exposed at all


def test_the_openai_chat_route_answers_the_plain_openai_client_with_the_key(keyed_server):
    """/v1/chat/completions, as OpenAI-client agents call it: 401 without the key, 200 with it, and with vLLM's
    extras (the token ids of the prompt and of each choice, their log-probs) for a trainer that records them."""
    import openai
    base = f"http://127.0.0.1:{keyed_server['port']}/v1"
    request = dict(model=keyed_server["model"], messages=[{"role": "user", "content": "What is 2 + 3?"}],
                   max_tokens=4, n=2, seed=1, logprobs=True, extra_body={"return_token_ids": True})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="not-the-key").chat.completions.create(**request)
    answer = openai.OpenAI(base_url=base, api_key=KEY).chat.completions.create(**request)
    assert len(answer.choices) == 2 and answer.prompt_token_ids
    for choice in answer.choices:
        assert 1 <= len(choice.token_ids) <= 4 and len(choice.logprobs.content) == len(choice.token_ids)


def test_the_trainer_sends_the_key_and_says_when_it_is_missing(keyed_server, tmp_path):
    args = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "2", "--prompts_per_step", "2",
            "--max_completion_length", "4", "--max_steps", "1", "--bf16", "false", "--no_save_model"]
    proc = run_train(keyed_server, tmp_path / "nokey", *args, nproc=1, check=False, env={"VLLM_API_KEY": ""})
    assert proc.returncode != 0 and "VLLM_API_KEY" in proc.stderr and "step 1/1" not in proc.stdout
    # --dry_run with a wrong key: its `server` check fails, in one line, exit code 2
    proc = run_train(keyed_server, tmp_path / "wrong", *args, "--dry_run", nproc=1, check=False,
                     env={"VLLM_API_KEY": "not-the-key"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: dry run: `server` failed: the vLLM server at http://127.0.0.1:{keyed_server['port']} was started "
        "with --api-key: the key in VLLM_API_KEY is not one of its keys"), proc.stderr[-2000:]
    assert "  FAIL  server" in proc.stdout and "  ok    tasks" in proc.stdout
    # the key is written nowhere (logs, rollouts, the checkpoint), and the reward functions (user code, in a
    # process of their own) see neither it nor wandb's
    seen = tmp_path / "seen"
    args = [{"tests.helpers:brevity": "tests.helpers:sees_secrets"}.get(a, a) for a in args[:-1]]  # saves the model
    env = {"VLLM_API_KEY": KEY, "WANDB_API_KEY": "wandb-secret", "NANOGRPO_TEST_PID_FILE": str(seen)}
    _, metrics = run_train(keyed_server, tmp_path / "key", *args, "--save_steps", "1", nproc=1, env=env)
    assert len(metrics) == 1 and metrics[0]["sync_probe_diff_max"] < 1e-4 and seen.read_text() == "none none"
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "key") for f in files]
    assert any(f.endswith("rollouts.jsonl") for f in written) and any("checkpoint-1" in f for f in written)
    for path in written:
        assert KEY.encode() not in open(path, "rb").read(), path


def test_the_servers_processes_do_not_import_from_their_working_folder(keyed_server):
    """vllm_server.py puts its own folder on PYTHONPATH for vLLM's workers, and nothing empty: an empty entry
    is the working folder of every process the server starts, whatever module lies there."""
    import os
    from utils import descendants
    pids = [keyed_server["proc"].pid] + [pid for pid, _ in descendants(keyed_server["proc"].pid)]
    seen = 0
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        if b"PYTHONPATH" in env:  # the launcher's own is its parent's; its children got the one it set
            seen += pid != keyed_server["proc"].pid
            assert b"" not in env[b"PYTHONPATH"].split(os.pathsep.encode()), env[b"PYTHONPATH"]
    assert seen >= 1  # vLLM's engine process at least


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                found.append(local.split(":")[0])
    return found


def test_the_weight_transfer_rendezvous_listens_on_its_address_only():
    """The trainer hosts the weight transfer's rendezvous on --vllm_group_host (127.0.0.1 by default): not on
    every interface of the machine, where anyone could join the group and read or replace the weights."""
    import socket
    import subprocess
    from conftest import free_port
    from vllm_client import gloo_group
    port = free_port()
    group = gloo_group("127.0.0.1", port, 0, 1, timeout_s=10)
    assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    for other in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split():
        if ":" not in other:  # another interface of this machine: refused
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=5).close()
    del group
