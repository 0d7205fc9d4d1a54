"""The trainer's link to the vLLM server: connect_server waits for it and checks the prompts fit, and
ServerGuard makes the calls to it safe on every rank: it waits for a lost or restarted server, pushes the
weights again and repeats the call; a server that does not come back, or an error on any rank, saves the run
first on every rank and then stops it. The client is in vllm_client.py, the weight transfer it drives in
weight_sync.py."""
import os
import time

import torch
import torch.distributed as dist

from config import Config, Interrupted, RunStopped, SignalStop, UsageError
from vllm_client import ServerLost, VLLMClient


class ServerGone(RunStopped):
    """The server did not come back within the timeout (after the run's work was saved)."""


class ServerGuard:
    """Runs the trainer's calls to the server, and its calls that may stop the run, on every rank. If the
    server was lost on any rank (killed, restarted, its engine died: ServerLost), every rank waits for it,
    joins the weight transfer again, pushes the current weights (a restarted server serves the model from
    disk: nothing is sampled before), and runs the call again on every rank (it may hold collectives: FSDP2
    gathers, a sync push). If it is not back within `timeout` seconds, or a call fails `attempts` times in a
    row, or any other error is raised on any rank (a RunStopped too: a foreseen stop), every rank runs
    `on_gone()` (saves a checkpoint) and the run stops; at once if `stop_requested()` (a preempted job's
    server dies first, its trainer has seconds to live). A stop signal on any rank (`stop_requested()`, or a
    wait it ended: config.Interrupted) is seen when the call ends: every rank runs `on_gone(signal=True)` and
    the run ends with SignalStop (exit code 0)."""

    def __init__(self, client, sync, timeout: float, on_gone, attempts: int = 3, stop_requested=lambda: False):
        self.client, self.sync, self.timeout, self.on_gone, self.attempts = client, sync, timeout, on_gone, attempts
        self.stop_requested = stop_requested
        self.reconnects = 0  # times the server was lost and found again (a metric)

    def run(self, fn, *args, **kwargs):
        for attempt in range(self.attempts):
            failure = None
            try:
                return_value, error = fn(*args, **kwargs), None
            except ServerLost as e:
                # The message, not the exception: its frames would keep the broken transfer alive.
                return_value, error = None, str(e)
            except Interrupted:  # a stop signal ended the wait: every rank sees the stop below
                return_value, error = None, None
            # What waiting cannot mend: the server refused a request, a rollout raised, ...
            except Exception as e:
                return_value, error, failure = None, None, e
            lost, failed, stopping = self._anywhere(error is not None, failure is not None, self.stop_requested())
            if failed:
                self._stop_for(failure)
            if stopping and not lost:  # if lost, the wait for the server sees the stop at once, and says so
                raise SignalStop(f"stopped by a signal. {self._saved(signal=True)}")
            if not lost:
                return return_value
            self._reconnect(error)
        self._give_up(f"a call to the server failed {self.attempts} times in a row "
                      f"(last: {error or 'on another rank'})")

    def _stop_for(self, failure: Exception | None):
        """An error on some rank that stops the run: every rank saves (the run's work is not lost with the
        default --save_steps 0), then the rank that had it raises it, the others say where it is."""
        try:
            saved = self._saved()
        except Exception as e:
            saved = f"Could not save a checkpoint ({e})"
        if failure is None:
            raise RunStopped(f"another rank stopped with an error (see its message). {saved}.")
        if isinstance(failure, RunStopped):  # a foreseen stop: its message says why, and now what was saved
            raise RunStopped(f"{str(failure).rstrip('.')}. {saved}.") from None
        print(f"[rank {os.environ.get('RANK', 0)}] stopped by an error (below). {saved}.", flush=True)
        raise failure

    def _saved(self, signal: bool = False) -> str:
        # None if nothing was done since the start (or the resume) that a checkpoint would keep.
        path = self.on_gone(signal=True) if signal else self.on_gone()
        return (f"Saved {path}: continue with --resume_from_checkpoint latest" if path else
                "No step was done since the start, nothing new to save")

    def _reconnect(self, error):
        print(f"[rank {os.environ.get('RANK', 0)}] lost the vLLM server at {self.client.base} "
              f"({error or 'on another rank'}); waiting up to {self.timeout:.0f}s for it", flush=True)
        deadline = time.monotonic() + self.timeout
        while True:
            # Every rank waits (each samples from the server), 2 s at a time, so that a stop request is seen
            # soon.
            try:
                self.client.wait_for_health(min(max(deadline - time.monotonic(), 0), 2))
                back = True
            except UsageError:  # the server does not answer, or not with our key
                back = False
            waiting, late, stopping = self._anywhere(not back, time.monotonic() > deadline, self.stop_requested())
            if stopping:
                raise ServerGone(f"stopped by a signal while waiting for the vLLM server. {self._saved()}")
            if late:
                self._give_up(f"the vLLM server at {self.client.base} did not answer within {self.timeout:.0f}s")
            if waiting:
                continue
            if self._joined(self.sync.connect, "join the weight transfer of") and \
                    self._joined(self.sync.push, "push the weights into"):
                self.reconnects += 1
                if int(os.environ.get("RANK", 0)) == 0:
                    print(f"the vLLM server is back; pushed the weights (reconnect {self.reconnects})", flush=True)
                return

    def _joined(self, fn, what: str) -> bool:
        """fn() on every rank: True if it worked everywhere, False if the server was lost again somewhere
        (wait for it again). Any other error (the server is back but cannot take our weights: its
        transfer port taken meanwhile, another backend or model) saves the run and stops it."""
        try:
            fn()
            problem = None
        except ServerLost:
            problem = ""
        except Exception as e:
            problem = (str(e) if isinstance(e, UsageError) else "") or f"{type(e).__name__}: {e}"
        if self._anywhere(bool(problem)):
            self._give_up(f"could not {what} the vLLM server at {self.client.base} again: "
                          f"{problem or 'on another rank'}", "flags such as --vllm_group_port may change when resuming")
        return not self._anywhere(problem is not None)

    def _give_up(self, why: str, hint: str = "raise --vllm_server_timeout to wait longer"):
        saved, port = self._saved(), self.client.base.rsplit(":", 1)[1]
        raise ServerGone(f"{why}. {saved} once the server is back (same --model, port {port}); {hint}.")

    @staticmethod
    def _anywhere(*flags: bool):
        """Whether each flag is true on any rank (a collective): a bool, or a tuple for several flags."""
        t = torch.tensor([float(f) for f in flags])
        if dist.is_initialized():
            dist.all_reduce(t)
        anywhere = tuple(bool(x > 0) for x in t)
        return anywhere if len(flags) > 1 else anywhere[0]


def connect_server(cfg: Config, longest_prompt: int) -> tuple[VLLMClient, torch.dtype, int]:
    """The client of the server at --vllm_server_host/port (waited for), the dtype it computes in and its max
    model length. Stops at once if the longest prompt and completion do not fit it."""
    # VLLM_API_KEY: the server's --api-key.
    client = VLLMClient(cfg.vllm_server_host, cfg.vllm_server_port, os.environ.get("VLLM_API_KEY"),
                        cfg.vllm_request_timeout, cfg.vllm_server_timeout)
    client.wait_for_health(cfg.vllm_server_timeout)
    server_dtype, max_model_len = client.server_dtype_and_max_len()
    if longest_prompt + cfg.max_completion_length > max_model_len:
        raise UsageError(f"the longest prompt ({longest_prompt} tokens) + --max_completion_length "
                         f"{cfg.max_completion_length} exceeds the server's max model length {max_model_len}: lower "
                         "them or restart the server with a larger --max-model-len")
    return client, server_dtype, max_model_len
