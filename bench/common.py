"""What the bench scripts share: a server of their own, a train.py run against it, and the peak
memory of a process tree. Every process is started in its own session and stopped by its group."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PHASES = ("generate", "score", "old_ref", "train", "sync", "probe")  # train.py's time/<phase>, within time/step


def workload_arguments(parser, steps: int = 4):
    """The flags every comparison shares: the model and one step's work."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRSS(threading.Thread):
    """Samples the summed resident memory of a process group every `interval` s; `.peak` in GiB."""

    def __init__(self, pgid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pgid, self.interval, self.peak, self.done = pgid, interval, 0.0, threading.Event()
        self.start()

    def run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.done.is_set():
            total = 0
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if os.getpgid(int(pid)) == self.pgid:
                        with open(f"/proc/{pid}/statm") as f:
                            total += int(f.read().split()[1]) * page
                except (OSError, ValueError, IndexError):  # the process ended meanwhile
                    pass
            self.peak = max(self.peak, total / 2 ** 30)
            self.done.wait(self.interval)

    def stop(self) -> float:
        self.done.set()
        self.join()
        return self.peak


@contextlib.contextmanager
def serving(model: str, workdir: str, *flags: str):
    """vllm_server.py on `model` (bf16, eager) on a free port; yields {"port", "memory": PeakRSS}."""
    from utils import stop_process_group
    from vllm_server import VLLMClient
    port = free_port()
    log = open(os.path.join(workdir, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "vllm_server.py"), "--model", model, "--port", str(port),
                             "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048", *flags],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    memory = PeakRSS(proc.pid)
    try:
        VLLMClient(port=port).wait_for_health(900)
        yield {"port": port, "memory": memory}
    finally:
        memory.stop()
        stop_process_group(proc, timeout=60)
        log.close()


def train(model: str, port: int, out: str, steps: int, prompts: int, G: int, length: int, nproc: int = 1,
          flags: tuple = ()) -> tuple[list[dict], float]:
    """train.py against the server on `port`: the metrics of each step and the trainer's peak memory (GiB,
    all ranks). Raises with the end of its output if it fails."""
    from utils import stop_process_group
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                 str(free_port())] if nproc > 1 else [sys.executable])
    with open(os.path.join(os.path.dirname(out), f"{os.path.basename(out)}.log"), "w+") as log:
        proc = subprocess.Popen([*launcher, os.path.join(ROOT, "train.py"), "--model", model, "--vllm_server_port", str(port),
                                 "--vllm_group_port", str(free_port()), "--output_dir", out, "--max_steps", str(steps),
                                 "--prompts_per_step", str(prompts), "--num_generations", str(G), "--max_completion_length",
                                 str(length), "--no_save_model", *flags],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        memory = PeakRSS(proc.pid)
        try:
            proc.wait()
        finally:
            peak = memory.stop()
            stop_process_group(proc)
        if proc.returncode:
            log.seek(0)
            raise RuntimeError(f"train.py failed ({proc.returncode}):\n{log.read()[-4000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()], peak


def steady(metrics: list[dict]) -> list[dict]:
    """The training steps after the first (which warms up), or the first if it is all there is."""
    rows = [m for m in metrics if "time/step" in m]
    return rows[1:] or rows


def mean(rows: list[dict], key: str) -> float:
    return sum(m[key] for m in rows) / len(rows)


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t = time.perf_counter()
    value = fn(*args, **kwargs)
    return time.perf_counter() - t, value
