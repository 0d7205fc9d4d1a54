"""What the bench scripts share: a server of their own, a train.py run against it, and the peak
memory of a process tree. Every process is started in its own session and stopped by its group."""
import contextlib
import json
import os
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
    import utils
    return utils.free_ports()[0]


class PeakRSS(threading.Thread):
    """Samples the summed resident memory of a process and all its descendants every `interval` s (by
    parent, not by process group: torchrun starts its workers in sessions of their own); `.peak` in GiB."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.done = pid, interval, 0.0, threading.Event()
        self.start()

    def run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.done.is_set():
            parent, rss = {}, {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{pid}/statm") as f:
                        rss[int(pid)] = int(f.read().split()[1]) * page
                except (OSError, ValueError, IndexError):  # the process ended meanwhile
                    pass
            tree, grew = {self.pid}, True
            while grew:
                found = {pid for pid, ppid in parent.items() if ppid in tree} - tree
                tree, grew = tree | found, bool(found)
            self.peak = max(self.peak, sum(rss.get(pid, 0) for pid in tree) / 2 ** 30)
            self.done.wait(self.interval)

    def stop(self) -> float:
        self.done.set()
        self.join()
        return self.peak


def on_cores(cores: set[int] | None) -> dict:
    """Popen arguments that keep a process tree on `cores` (None: anywhere), its OpenMP threads one per core."""
    if cores is None:
        return {}
    return dict(preexec_fn=lambda: os.sched_setaffinity(0, cores),
                env={**os.environ, "OMP_NUM_THREADS": str(len(cores)),
                     "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cores)))})


def split_cores() -> tuple[set[int], set[int]]:
    """This machine's cores in two halves: the server's and the trainer's."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split_cores needs at least 2 cores")
    return set(cores[:len(cores) // 2]), set(cores[len(cores) // 2:])


SHARED_SERVER = "NANOGRPO_BENCH_SERVER"  # "port:pid" of a running vllm_server.py that serving() hands out


def step_kv_cache_bytes(model: str, prompts: int, G: int, length: int, prompt_bound: int) -> int | None:
    """The KV cache run.sh gives the server for steps of `prompts` x G completions of up to `length` tokens after
    prompts of up to `prompt_bound` (train.py's --max_prompt_length)."""
    import vllm_server
    from config import Config
    cfg = Config(prompts_per_step=prompts, num_generations=G, max_completion_length=length,
                 max_prompt_length=prompt_bound)
    return vllm_server.step_kv_cache_bytes(cfg, ["--model", model, "--max-model-len", "2048"])


@contextlib.contextmanager
def serving(model: str, workdir: str, *flags: str, cores: set[int] | None = None, lora_rank: int = 0,
            kv_cache_bytes: int | None = None):
    """vllm_server.py on `model` (eager; its default dtype: bf16 where the CPU has it, else fp32) on a free port, on
    `cores` (None: all), with LoRA on for adapters up to `lora_rank` (0: off), with a KV cache of `kv_cache_bytes`
    (None: the server's default);
    yields {"port", "pid" (of its process group), "memory": PeakRSS}. With $NANOGRPO_BENCH_SERVER set (the tests
    run every bench's smallest setting against one server of theirs), that server instead, if it serves `model`
    (with LoRA up to `lora_rank`) and nothing else is asked of it (`flags`, `cores`)."""
    from config import UsageError
    from utils import stop_process_group
    from vllm_client import VLLMClient
    if os.environ.get(SHARED_SERVER) and not flags and cores is None:
        port, pid = map(int, os.environ[SHARED_SERVER].split(":"))
        client = VLLMClient(port=port)
        client.wait_for_health(timeout=30)
        if os.path.realpath(client.model_name) != os.path.realpath(model):
            raise RuntimeError(f"${SHARED_SERVER} serves {client.model_name}, not {model}")
        if lora_rank > ((client.server_config().get("lora_config") or {}).get("max_lora_rank") or 0):
            raise RuntimeError(f"${SHARED_SERVER} does not take LoRA adapters of rank {lora_rank}")
        memory = PeakRSS(pid)
        try:
            yield {"port": port, "pid": pid, "memory": memory, "shared": True}
        finally:
            memory.stop()
        return
    port = free_port()
    log = open(os.path.join(workdir, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "vllm_server.py"), "--model", model, "--port", str(port),
                             "--enforce-eager", "--max-model-len", "2048", *flags,
                             *(["--kv-cache-memory-bytes", str(kv_cache_bytes)] if kv_cache_bytes else []),
                             *(["--enable-lora", "--max-lora-rank", str(lora_rank)] if lora_rank else [])],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **on_cores(cores))
    memory = PeakRSS(proc.pid)
    try:
        client, deadline = VLLMClient(port=port), time.monotonic() + 900
        while True:  # healthy, or a clear error if the server exits or never answers
            try:
                client.wait_for_health(timeout=5)
                break
            except UsageError:  # not answering yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm_server.py did not start; see {log.name}") from None
        yield {"port": port, "pid": proc.pid, "memory": memory}
    finally:
        memory.stop()
        stop_process_group(proc, timeout=60)
        log.close()


def train(model: str, port: int, out: str, steps: int, prompts: int, G: int, length: int, nproc: int = 1,
          flags: tuple = (), cores: set[int] | None = None) -> tuple[list[dict], float]:
    """train.py against the server on `port`, on `cores` (None: all): the metrics of each step and the
    trainer's peak memory (GiB, all ranks). Raises with the end of its output if it fails."""
    from utils import stop_process_group
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                 str(free_port())] if nproc > 1 else [sys.executable])
    with open(os.path.join(os.path.dirname(out), f"{os.path.basename(out)}.log"), "w+") as log:
        proc = subprocess.Popen([*launcher, os.path.join(ROOT, "train.py"), "--model", model, "--vllm_server_port", str(port),
                                 "--vllm_group_port", str(free_port()), "--output_dir", out, "--max_steps", str(steps),
                                 "--prompts_per_step", str(prompts), "--num_generations", str(G), "--max_completion_length",
                                 str(length), "--no_save_model", *flags],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **on_cores(cores))
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


def replay_if_asked(path: str | None, fn, model: str):
    """In the process replayed() starts (its --replay FILE): print fn(model, the recorded payload) as the RESULT
    line, and exit."""
    if path:
        with open(path) as f:
            print("RESULT " + json.dumps(fn(model, json.load(f))))
        sys.exit(0)


def replayed(script: str, argv: list[str], payload, workdir: str):
    """`script` run again in a fresh process (a limit whose engine must not share this one) as
    `script ARGV --replay FILE`, FILE holding `payload` as JSON: the value it prints on its RESULT line."""
    recorded = os.path.join(workdir, "recorded.json")
    with open(recorded, "w") as f:
        json.dump(payload, f)
    proc = subprocess.run([sys.executable, os.path.abspath(script), *argv, "--replay", recorded],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the replay failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))
