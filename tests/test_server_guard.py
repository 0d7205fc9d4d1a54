"""guard.ServerGuard's decisions in one process, with a stand-in for the server (its health and
its weight transfer): wait and carry on when it comes back, save and stop when it cannot take the
weights again. tests/test_operations.py kills and restarts the real server under torchrun."""
import json
import os
from types import SimpleNamespace

import pytest

from conftest import ROOT, launcher, run
from config import UsageError
from guard import ServerGone, ServerGuard
from vllm_client import ServerLost


class Server:
    """Answers health checks while `up`; `connects` lists what each join of the weight transfer does."""

    def __init__(self, connects=(), pushes=()):
        self.base, self.up, self.saved = "http://127.0.0.1:8123", True, []
        self.connects, self.push_outcomes, self.pushes = list(connects), list(pushes), 0

    def wait_for_health(self, timeout: float):
        if not self.up:
            raise UsageError("not answering")

    def connect(self):
        outcome = self.connects.pop(0) if self.connects else None
        if outcome:
            raise outcome

    def push(self):
        self.pushes += 1
        outcome = self.push_outcomes.pop(0) if self.push_outcomes else None
        if outcome:
            raise outcome

    def save(self) -> str:
        self.saved.append(f"out/checkpoint-{len(self.saved) + 1}")
        return self.saved[-1]


def guard(server: Server, timeout: float = 5) -> ServerGuard:
    return ServerGuard(server, server, timeout, on_gone=server.save)


def lost_once(server: Server):
    calls = []

    def call():
        calls.append(1)
        if len(calls) == 1:
            raise ServerLost("connection refused")
        return "episodes"
    return call


def test_a_stop_request_while_waiting_for_a_lost_server_saves_and_stops_at_once():
    """A preempted job: its server dies first, then SIGTERM arrives; the trainer has seconds, not the time-out."""
    import time
    server = Server()
    server.up = False
    g = ServerGuard(server, server, 300, on_gone=server.save, stop_requested=lambda: True)
    started = time.monotonic()
    with pytest.raises(ServerGone, match="stopped by a signal while waiting for the vLLM server. Saved "
                                         "out/checkpoint-1: continue with --resume_from_checkpoint latest"):
        g.run(lost_once(server))
    assert time.monotonic() - started < 5 and server.saved == ["out/checkpoint-1"]


def test_a_stop_signal_that_ended_a_wait_saves_on_every_rank_and_ends_the_run():
    """A wait the signal ended (config.Interrupted: a rollout, the reward functions) is no error and no lost server:
    the guard saves with signal=True (a checkpoint of the state as it is) and ends the run with SignalStop (exit 0).
    A call that returned while a signal was pending ends the run the same way, after it."""
    from config import Interrupted, SignalStop
    saved = []

    def save(signal: bool = False) -> str:
        saved.append(signal)
        return "out/checkpoint-3"

    def interrupted():
        raise Interrupted("a stop signal arrived during the rollout")
    g = ServerGuard(Server(), Server(), 300, on_gone=save, stop_requested=lambda: True)
    for call in (interrupted, lambda: "episodes"):
        with pytest.raises(SignalStop, match="stopped by a signal. Saved out/checkpoint-3: continue with "
                                             "--resume_from_checkpoint latest"):
            g.run(call)
    assert saved == [True, True] and g.reconnects == 0


def test_a_lost_server_that_comes_back_gets_the_weights_and_the_call_runs_again():
    server = Server(connects=[ServerLost("the new server is still starting its engine"), None],
                    pushes=[ServerLost("lost again during the push"), None])
    g = guard(server)
    assert g.run(lost_once(server)) == "episodes"
    assert g.reconnects == 1 and server.pushes == 2 and server.saved == [] and server.connects == []


def test_a_server_that_does_not_come_back_is_given_up_after_saving():
    server = Server()
    server.up = False
    with pytest.raises(ServerGone, match="did not answer within 0s. Saved out/checkpoint-1: continue with "
                                         "--resume_from_checkpoint latest once the server is back \\(same --model, "
                                         "port 8123\\); raise --vllm_server_timeout"):
        guard(server, timeout=0).run(lost_once(server))
    assert server.saved == ["out/checkpoint-1"] and server.pushes == 0


@pytest.mark.parametrize("error, shown", [
    (UsageError("--vllm_group_port 29551: the port is in use on this machine (Address already in use); choose a free one"),
     "--vllm_group_port 29551: the port is in use"),
    (KeyError("weight_transfer_config"), "KeyError: 'weight_transfer_config'")])
def test_a_server_back_but_unable_to_take_the_weights_saves_the_run_and_says_why(error, shown):
    """Before, the port taken while the server was away ended the run with exit code 2 and no checkpoint."""
    server = Server(connects=[error])
    with pytest.raises(ServerGone) as e:
        guard(server).run(lost_once(server))
    message = str(e.value)
    assert message.startswith("could not join the weight transfer of the vLLM server at http://127.0.0.1:8123 again")
    assert shown in message and "Saved out/checkpoint-1" in message and "--resume_from_checkpoint latest" in message
    assert "--vllm_group_port may change when resuming" in message
    assert server.saved == ["out/checkpoint-1"] and server.pushes == 0


def test_a_server_back_that_refuses_the_weights_saves_the_run_and_says_why():
    server = Server(pushes=[RuntimeError("400 Bad Request: no parameter named model.layers.0.mlp.up_proj.weight")])
    with pytest.raises(ServerGone, match="could not push the weights into the vLLM server at http://127.0.0.1:8123 "
                                         "again: RuntimeError: 400 Bad Request: no parameter named .*Saved "
                                         "out/checkpoint-1"):
        guard(server).run(lost_once(server))
    assert server.saved == ["out/checkpoint-1"]


def test_a_call_that_keeps_losing_the_server_stops_after_three_attempts():
    server = Server()

    def always_lost():
        raise ServerLost("engine died")
    with pytest.raises(ServerGone, match="failed 3 times in a row \\(last: engine died\\). Saved out/checkpoint-1"):
        guard(server).run(always_lost)
    assert server.pushes == 3 and server.saved == ["out/checkpoint-1"]


@pytest.mark.parametrize("reads_before_failing", [0, 1, 4])
def test_a_push_that_fails_still_reads_every_weight_once(reads_before_failing):
    """Under FSDP2 reading a weight is a gather every rank takes part in: rank 0 must read them all, once,
    whether the server was lost before the push read anything (a hang before), halfway, or at the end."""
    from weight_sync import WeightSync
    read = []

    class Weights:
        def __iter__(self):
            for name in ("embed", "layer0", "layer1", "head"):
                read.append(name)
                yield name, None

    class BrokenEngine:
        def __init__(self, source):
            self.source = source

        def send_weights(self):
            weights = iter(self.source) if reads_before_failing else None
            for _ in range(reads_before_failing):
                next(weights)
            raise ServerLost("connection refused")
    paused = []  # the server's requests wait during a push, and go on after it, also when it fails
    client = SimpleNamespace(pause=lambda: paused.append(True), resume=lambda: paused.append(False))
    sync = WeightSync(client=client, source=Weights(), rank=1, group_host="127.0.0.1", group_port=0)  # joins nothing
    sync.engine = BrokenEngine(sync.source)  # as on rank 0 after joining
    for _ in range(2):  # the second push must not take the first one's iteration for its own
        read.clear()
        with pytest.raises(ServerLost):
            sync.push()
        assert read == ["embed", "layer0", "layer1", "head"] and paused[-2:] == [True, False]


def test_every_rank_waits_and_probes_again_when_rank_0_loses_the_server(tmp_path):
    """Under torchrun: rank 0 loses the server inside the sync probe, whose other ranks are already in a
    collective. Before, rank 0's next collective met theirs (a hang or garbage); now all reconnect once."""
    out = tmp_path / "ranks.json"
    proc = run([*launcher(2), os.path.join(ROOT, "tests", "guard_ranks.py"), str(out)], timeout=180,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert [r["reconnects"] for r in ranks] == [1, 1] and [r["pushes"] for r in ranks] == [1, 1]
    assert [r["probes"] for r in ranks] == [2, 0]  # rank 0 alone asks the server
    assert ranks[0]["probe"]["sync_probe_diff_max"] < 1e-9 and ranks[0]["probe"] == ranks[1]["probe"]
    # an error on rank 1 alone: both save, rank 1 raises it, rank 0 says where it is
    assert [r["saved"] for r in ranks] == [1, 1]
    assert ranks[0]["stopped"].startswith("RunStopped: another rank stopped with an error")
    assert "Saved out/checkpoint-1" in ranks[0]["stopped"]
    assert ranks[1]["stopped"] == "RuntimeError: vLLM server /v1/completions answered 400: maximum context length is 512 tokens"
    # the server's config, read on every rank before the guard exists, lost on rank 0 alone: every rank raises
    assert [r.get("config") for r in ranks] == ["ServerLost: connection refused",
                                                 "ServerLost: reading the server's config: the server was lost on another rank"]


def test_an_error_that_waiting_cannot_mend_saves_the_run_and_raises_it(capsys):
    """Before, a 4xx (a server restarted with a smaller --max-model-len) or a rollout function that raised
    stopped the run without saving: with the default --save_steps 0, everything was lost."""
    server = Server()

    def refused():
        raise RuntimeError("vLLM server /v1/completions answered 400: maximum context length is 512 tokens")
    with pytest.raises(RuntimeError, match="answered 400"):
        guard(server).run(refused)
    assert server.saved == ["out/checkpoint-1"] and server.pushes == 0
    assert "Saved out/checkpoint-1: continue with --resume_from_checkpoint latest" in capsys.readouterr().out
    nothing = ServerGuard(server, server, 5, on_gone=lambda: None)  # before the first step: nothing to keep
    with pytest.raises(RuntimeError):
        nothing.run(refused)
    assert "No step was done since the start, nothing new to save" in capsys.readouterr().out


def test_free_ports_are_outside_the_range_the_kernel_hands_out():
    """Ports for the server and the weight transfer are drawn below the ephemeral range, so a socket bound to port
    0 in between (gloo's, vLLM's) can never take one; they are distinct and free."""
    import socket
    import utils
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = utils.free_ports(50)
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
