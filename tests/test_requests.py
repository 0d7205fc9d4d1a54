"""vllm_client.VLLMClient against a stand-in HTTP server: a slow request is not a lost server (it may take as
long as its work does, while the server answers /health), a server that stops answering /health during a
request is lost after --vllm_server_timeout, and --vllm_request_timeout stops a request that takes longer; an
answer from a restarted server, or a replacement's /health while a request waits, is a lost server at once."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import vllm_client
from config import RunStopped, UsageError
from vllm_client import ServerLost, VLLMClient


class StandIn(BaseHTTPRequestHandler):
    work_s = 0.0  # how long /v1/completions takes
    healthy = True  # /health answers; else it hangs as a stopped process does
    instance = "A"  # the server's instance, as its answers name it

    def do_GET(self):
        if self.path == "/health":
            while not self.healthy:
                time.sleep(0.05)
            self.send_response(200)
            self.send_header(vllm_client.INSTANCE_HEADER, self.instance)
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
        self.send_header(vllm_client.INSTANCE_HEADER, self.instance)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(vllm_client, "HEALTH_EVERY_S", 0.2)
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


def test_an_answer_from_a_restarted_server_is_a_lost_server(stand_in):
    """The client knows the instance it found (and pushed weights into); a server restarted since answers from the
    model on disk: that answer is refused as a lost server, so the guard pushes the weights and asks again."""
    handler, port = stand_in
    client = VLLMClient(port=port)
    client.instance = "A"  # as wait_for_health found it
    assert client.generate([[1, 2]], n=1, max_tokens=4)[0]["token_ids"] == [5]
    handler.instance = "B"
    with pytest.raises(ServerLost, match="the server restarted \\(another instance answered\\): it computes with the "
                                         "model on disk"):
        client.generate([[1, 2]], n=1, max_tokens=4)


def test_a_request_whose_server_was_replaced_does_not_wait_forever(stand_in):
    """A request's connection carries nothing any more, and a new instance of the server answers /health at the
    same address. Before, each of its answers reset the wait, forever; now the request is lost at the first."""
    handler, port = stand_in
    handler.work_s, handler.instance = 30.0, "B"  # the request never comes back; a replacement answers /health
    client = VLLMClient(port=port, server_timeout=300)
    client.instance = "A"
    t = time.monotonic()
    with pytest.raises(ServerLost, match="restarted while the request ran \\(another instance answers /health\\)"):
        client.generate([[1, 2]], n=1, max_tokens=4)
    assert time.monotonic() - t < 10


def test_the_client_s_connections_probe_a_silent_peer(stand_in):
    """TCP keep-alive on every connection of the client: a connection to a host that died, or whose address went
    to another machine, fails after the probes instead of holding a request forever."""
    import socket
    _, port = stand_in
    client = VLLMClient(port=port)
    conn = client.session.get_adapter(client.base).poolmanager.connection_from_url(client.base)._new_conn()
    conn.connect()  # a connection as the client's requests open them
    sock = conn.sock
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
    conn.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/update_weights"])
def test_a_connection_broken_before_the_answer_repeats_a_sampling_call_only(stand_in, path):
    """A pooled connection the server closes (idle for its keep-alive time) just as the client sends on it breaks
    without an answer. Before, that was a lost server: the run waited, pushed the weights again and repeated the
    rollout. A sampling call (seeded: it repeats exactly) is now sent once more; a weight update is not (the server
    may have begun it), and stays a lost server."""
    import socket
    import struct
    handler, port = stand_in
    posts = []

    def do_POST(self):
        posts.append(self.path)
        if len(posts) == 1:  # the first: the connection is reset with no answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        StandIn.do_POST(self)
    handler.do_POST = do_POST
    client = VLLMClient(port=port)
    if path == "/update_weights":
        with pytest.raises(ServerLost, match="ConnectionError"):
            client.update_weights({})
        assert posts == [path]
    else:
        assert client.generate([[1, 2]], n=1, max_tokens=4)[0]["token_ids"] == [5]
        assert posts == [path, path]
