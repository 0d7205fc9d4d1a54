"""A server started with --api-key: every route but /health wants the key, routes training does not use
are not there at all, and the trainer sends the key from VLLM_API_KEY (or says that it needs it)."""
import pytest
import requests

from conftest import run_train, running_server

pytestmark = pytest.mark.slow
KEY = "test-key-4711"


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    with running_server(tiny_model, tmp_path_factory.mktemp("keyed") / "server.log", "--api-key", KEY) as s:
        yield s


def test_the_key_guards_every_route_and_unused_routes_are_closed(keyed_server):
    base, auth = f"http://127.0.0.1:{keyed_server['port']}", {"Authorization": f"Bearer {KEY}"}
    assert requests.get(base + "/health", timeout=10).status_code == 200  # for load balancers and the trainer's wait
    for method, path in [("get", "/v1/models"), ("post", "/v1/completions"), ("get", "/server_info"),
                         ("post", "/update_weights"), ("post", "/init_weight_transfer_engine"), ("post", "/reset_prefix_cache")]:
        assert getattr(requests, method)(base + path, timeout=10).status_code == 401, path
        wrong = {"Authorization": "Bearer not-the-key"}
        assert getattr(requests, method)(base + path, headers=wrong, timeout=10).status_code == 401, path
    assert requests.get(base + "/v1/models", headers=auth, timeout=10).status_code == 200
    for path in ("/collective_rpc", "/sleep", "/wake_up", "/pause", "/invocations", "/v1/load_lora_adapter"):
        assert requests.post(base + path, headers=auth, timeout=10).status_code == 404, path  # not exposed at all


def test_the_trainer_sends_the_key_and_says_when_it_is_missing(keyed_server, tmp_path):
    args = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "2", "--prompts_per_step", "2",
            "--max_completion_length", "4", "--max_steps", "1", "--bf16", "false", "--no_save_model"]
    proc = run_train(keyed_server, tmp_path / "nokey", *args, nproc=1, check=False, env={"VLLM_API_KEY": ""})
    assert proc.returncode != 0 and "VLLM_API_KEY" in proc.stderr and "step 1/1" not in proc.stdout
    _, metrics = run_train(keyed_server, tmp_path / "key", *args, nproc=1, env={"VLLM_API_KEY": KEY})
    assert len(metrics) == 1 and metrics[0]["sync_probe_diff_max"] < 1e-4
    assert KEY not in open(tmp_path / "key" / "metrics.jsonl").read()
