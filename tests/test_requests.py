"""vllm_server.VLLMClient against a stand-in HTTP server: a slow request is not a lost server (it may take as
long as its work does, while the server answers /health), a server that stops answering /health during a
request is lost after --vllm_server_timeout, and --vllm_request_timeout stops a request that takes longer."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import vllm_server
from config import RunStopped, UsageError
from vllm_server import ServerLost, VLLMClient


class StandIn(BaseHTTPRequestHandler):
    work_s = 0.0  # how long /v1/completions takes
    healthy = True  # /health answers; else it hangs as a stopped process does

    def do_GET(self):
        if self.path == "/health":
            while not self.healthy:
                time.sleep(0.05)
            self.send_response(200)
            self.end_headers()
        else:  # not a vLLM server: no model list
            self.send_response(404)
            self.end_headers()

    def do_POST(self):
        time.sleep(self.work_s)
        body = json.dumps({"choices": [{"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(vllm_server, "HEALTH_EVERY_S", 0.2)
    handler = type("Handler", (StandIn,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, httpd.server_address[1]
    handler.healthy = True
    httpd.shutdown()
    httpd.server_close()


def test_a_request_longer_than_the_server_timeout_is_not_a_lost_server(stand_in):
    handler, port = stand_in
    handler.work_s = 2.0  # before, a request silent for the client's fixed time-out was a lost server
    client = VLLMClient(port=port, server_timeout=0.5)
    assert client.generate([[1, 2]], n=1, max_tokens=4)[0]["token_ids"] == [5]


def test_a_server_silent_on_health_during_a_request_is_lost(stand_in):
    handler, port = stand_in
    handler.work_s, handler.healthy = 30.0, False  # stopped: the request and /health hang
    client = VLLMClient(port=port, server_timeout=1)
    t = time.monotonic()
    with pytest.raises(ServerLost, match="stopped answering /health .*while the request ran"):
        client.generate([[1, 2]], n=1, max_tokens=4)
    assert time.monotonic() - t < 20  # found by /health, not by the 30 s request


def test_a_request_longer_than_the_request_timeout_stops_the_run(stand_in):
    handler, port = stand_in
    handler.work_s = 5.0
    client = VLLMClient(port=port, request_timeout=0.5)
    with pytest.raises(RunStopped, match="has not answered /v1/completions within --vllm_request_timeout 0.5s, while it "
                                         "still answers /health.*raise it, or 0 for none"):
        client.generate([[1, 2]], n=1, max_tokens=4)


def test_another_program_answering_health_is_not_taken_for_the_server(stand_in):
    """Before, /v1/models was read outside the wait: its error escaped the server guard (and skipped the save)."""
    _, port = stand_in
    with pytest.raises(UsageError, match="within 1s \\(/health answers, but /v1/models: .*Start one with"):
        VLLMClient(port=port).wait_for_health(timeout=1)
