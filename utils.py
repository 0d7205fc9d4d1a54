"""What the trainer and the tools around it share and that has no subject of its own: the process group and
its collectives (sum_over_ranks, print0, ...), free ports, the processes a test or script starts, the lock on
the output folder, a call on a thread of its own (InThread). Not here: the models and their wrappers
(models.py), log-probs (logprobs.py), checkpoints (checkpoints.py), the data (data.py), what a run reports
(metrics.py), the weights on their way to the server (weight_sync.py).
"""
import ctypes
import datetime
import fcntl
import functools
import gc
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from contextlib import suppress

import torch
import torch.distributed as dist

from config import STOP, Interrupted, UsageError, run_main


# -----------------------------------------------------------------------------
# distributed: the process group, its collectives, rank 0's prints

def setup_distributed(timeout_s: float = 1800):
    """Returns rank, local_rank, world_size, device, is_main. Works under torchrun and plain python. A
    collective waits up to `timeout_s` for the other ranks."""
    if "RANK" not in os.environ:  # plain `python train.py`
        return 0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"), True
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # Small CPU tensors (the metrics' sums) go over gloo, the GPU's over NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device,
                                timeout=datetime.timedelta(seconds=timeout_s))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return rank, local_rank, world_size, device, rank == 0


def teardown_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


# What a run must close however it ends (its metrics logger: wandb's run); run_and_exit closes them.
CLOSE_AT_EXIT: list = []


def run_and_exit(main, *args):
    """config.run_main(main, *args) (a start-up mistake: one line, exit code 2), then the process groups are
    destroyed and the process ends without Python's interpreter shutdown. gloo's worker threads outlive
    destroy_process_group while FSDP2's DTensors still reference their group, and a worker that frees a
    finished collective (whose tensors are Python objects) takes the GIL: during interpreter shutdown that
    aborts the process (SIGABRT, "terminate called without an active exception"), after a run that saved
    everything. An unforeseen error keeps its traceback and Python's usual exit."""
    try:
        run_main(main, *args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        # However main ended, a stop by a signal or a foreseen one included.
        for close in reversed(CLOSE_AT_EXIT):
            with suppress(Exception):
                close()
        release_locks()  # the output folder is free for the next run (after kill -9, its lock goes stale)
        # main()'s objects that an exception's frames hold in a cycle end now, with their finalizers (the
        # reward scorer's process pool): os._exit below runs none.
        gc.collect()
        teardown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) of a tensor over all ranks, in place; identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def sum_over_ranks(values: dict) -> dict[str, float]:
    """{name: number or 0-d tensor} -> {name: float}, each summed over all ranks in one collective. The values
    are summed by position: the names must be the same, in the same order, on every rank (checked: a hash h of
    them goes along as h and h^2, and sum(h)^2 = ranks * sum(h^2) only if every rank's h is the same)."""
    h = float(zlib.crc32("\0".join(values).encode()) % 1024)
    total = all_reduce(torch.tensor([float(v) for v in values.values()] + [h, h * h], dtype=torch.float64))
    if dist.is_initialized() and total[-2] ** 2 != dist.get_world_size() * total[-1]:
        raise RuntimeError(f"sum_over_ranks: the ranks summed different names (this rank: {list(values)}); every "
                           "rank must pass the same names in the same order")
    return dict(zip(values, total[:-2].tolist()))


def extremes_over_ranks(values: dict) -> dict[str, float]:
    """{name: number}: names ending in _min get the minimum over all ranks, the others the maximum."""
    sign = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in values], dtype=torch.float64)
    total = all_reduce(torch.tensor([float(v) for v in values.values()], dtype=torch.float64) * sign, dist.ReduceOp.MAX)
    return dict(zip(values, (total * sign).tolist()))


def quantile_over_ranks(values: torch.Tensor, q: float) -> float:
    """The q-quantile of the 1-D CPU tensors `values` of all ranks together, on every rank; nan if there are
    none. Computed as torch.quantile computes it in float32 (TRL's high-entropy threshold), without its limit
    of 2^24 values (past it the float32 position is within a value or two of exact): the position q (n - 1) is
    a float32 product, so where it is whole in exact arithmetic (q = 0.3, 21 values) it lands on a value,
    where float64 would land a hair past it and leave that value out."""
    values = values.detach().float().flatten()
    if dist.is_initialized():
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, torch.tensor([len(values)]))
        longest = max(int(n) for n in sizes)
        parts = [torch.zeros(longest) for _ in sizes]
        dist.all_gather(parts, torch.cat([values, values.new_zeros(longest - len(values))]))
        values = torch.cat([part[:int(n)] for part, n in zip(parts, sizes)])
    if not len(values):
        return math.nan
    v, position = values.sort().values, torch.tensor(q, dtype=torch.float32) * (len(values) - 1)
    low = min(int(position), len(v) - 1)  # past 2^24 values, the float32 position can round past the end
    return float(torch.lerp(v[low], v[min(low + 1, len(v) - 1)], position - low))


def moments_over_ranks(values: torch.Tensor) -> tuple[float, float]:
    """The mean and unbiased std of `values` over all ranks, NaN entries left out (--scale_rewards batch,
    GDPO), in float64 and in two passes (the std from the deviations from the mean: no cancellation for large
    rewards)."""
    values = values.double()
    t = sum_over_ranks({"n": (~values.isnan()).sum(), "sum": values.nansum()})
    mean = t["sum"] / max(t["n"], 1)
    squares = sum_over_ranks({"sq": (values - mean).pow(2).nansum()})["sq"]
    return mean, math.sqrt(squares / max(t["n"] - 1, 1))


def barrier():
    if dist.is_initialized():
        dist.barrier()


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def text_of_rank0(text: str) -> str:
    """Rank 0's `text`, on every rank (the others' is not read). As byte tensors, as gather_lines."""
    if not dist.is_initialized():
        return text
    data = torch.tensor(list(text.encode()) if dist.get_rank() == 0 else [], dtype=torch.uint8)
    size = torch.tensor([len(data)])
    dist.broadcast(size, src=0)
    data = data if dist.get_rank() == 0 else torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return data.numpy().tobytes().decode()


def gather_lines(lines: list[str]) -> list[str]:
    """Every rank's lines, in rank order, on rank 0 (the other ranks get []): the lengths go to every rank,
    the text only to rank 0. As byte tensors, which gloo and the CPU side of "cpu:gloo,cuda:nccl" carry."""
    if not dist.is_initialized():
        return lines
    text = bytearray("".join(line + "\n" for line in lines).encode())
    data = torch.frombuffer(text, dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)]))
    longest = max(int(n) for n in sizes)
    padded = torch.cat([data, torch.zeros(longest - len(data), dtype=torch.uint8)])
    if dist.get_rank() != 0:
        dist.gather(padded, dst=0)
        return []
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.gather(padded, parts, dst=0)
    return [line for part, n in zip(parts, sizes) for line in part[:int(n)].numpy().tobytes().decode().splitlines()]


# -----------------------------------------------------------------------------
# processes: free ports, stopping what a test or script started, the output folder's lock

def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now, drawn below the kernel's ephemeral range: one drawn there stays
    free until it is used, as no socket bound to port 0 (gloo's, vLLM's, any client's) is given it
    meanwhile."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw, ports = random.SystemRandom(), []
    while len(ports) < n:
        port = draw.randrange(max(1024, low - 20000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))  # without SO_REUSEADDR: a port still in TIME_WAIT is not taken
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in ports and port != 29500:  # 29500: torchrun's default rendezvous
            ports.append(port)
    return ports


def stop_process_group(proc, timeout: float = 30):
    """Stop exactly what we started as `proc` (start_new_session=True: a server with its engine and workers,
    a torchrun with its ranks): SIGTERM to its group, SIGKILL after `timeout` seconds; then SIGKILL to any of
    its descendants still alive in a session of their own (torchrun starts each rank in one: a rank stuck
    in a collective outlives a torchrun that was killed)."""
    if proc.poll() is None:
        family = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid, started in family:
            if _stat(pid)[1] == started:  # the same process, not a new one with a reused pid
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, start time) of a process; (0, 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError):
        return 0, 0


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `pid`."""
    parents = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()} if os.path.isdir("/proc") else {}
    found, frontier = [], [pid]
    while frontier:
        children = [(p, started) for p, (parent, started) in parents.items() if parent in frontier]
        found += children
        frontier = [p for p, _ in children]
    return found


def cpu_seconds_of_group(pgid: int) -> float:
    """User + system CPU time so far of every process in process group `pgid` (all their threads)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime: user and system CPU time
        except (OSError, ValueError):  # the process ended meanwhile
            pass
    return total / os.sysconf("SC_CLK_TCK")


class OutputLock:
    """output_dir/.lock while a run uses the folder: a second run into it stops, on this node or another, and
    a requeue is not stopped by the lock of its own run that died. The file names the run (pid and host); it
    is written under a name of our own and put in place by link(2), which fails if a lock is there, so two
    starts cannot both take it, also where flock is missing. The run holds flock(2) on it, which the kernel
    frees the moment the process ends, however it ends, and renews its time every RENEW_S s. A start that
    finds a lock:
    - of this node, flocked: a live process, the start stops at once;
    - of this node and free (flock says so, or without flock its process is gone): takes it over at once;
    - else (another node's: its flock may not reach here, as with Lustre localflock, or may outlive its run,
      as NFS keeps a lost node's lock on the server until its lease ends; or any lock on a filesystem without
      flock, NFSv3 without lockd: ENOLCK, Lustre noflock: ENOSYS): watches it, one line said, for
      WATCH_RENEWALS periods at least (clocks of two nodes may differ: a renewal seen needs none) and until
      STALE_RENEWALS have passed since its last renewal (a minute), and while its flock is held, until it is
      freed, for up to that minute and NFS_LEASE_S more. Renewed or replaced meanwhile: a live run, the start
      stops (exit 2); not: its run is gone (kill -9, a node lost), and it is taken over; its flock still held
      at the bound: the start stops and says how to free it. A requeue on another node right after its run's
      end waits instead of exiting 2, which a scheduler does not requeue.
    The lock is registered (held) before it is put in place, so that a stop signal while it starts
    (config.SignalStop) leaves none behind. close() (or release_locks(), as the process ends) removes it."""

    RENEW_S, STALE_RENEWALS, WATCH_RENEWALS = 15, 4, 2
    NFS_LEASE_S = 90  # NFSv4's default lease: how long its server keeps the locks of a client that is gone
    held: list["OutputLock"] = []

    def __init__(self, output_dir: str):
        self.output_dir, self.path = output_dir, os.path.join(output_dir, ".lock")
        self.me, self.said_no_flock = f"pid {os.getpid()} on {socket.gethostname()}", False
        self.mine = f"{self.path}.{self.me.replace(' ', '-')}"  # our lock, before it is renamed into place
        self.stop, self.file = threading.Event(), None
        # Listed before our lock is in place, so that however this start ends, close() removes it.
        OutputLock.held.append(self)
        try:
            self.file = open(self.mine, "w+")
            self._flock(self.file)
            self.file.write(self.me + "\n")
            self.file.flush()
            taken = False
            while not taken:
                taken = self._link_in_place() or self._judge_the_lock_there()
        except BaseException:
            self.close()
            raise
        finally:
            with suppress(FileNotFoundError):
                os.unlink(self.mine)
        threading.Thread(target=self._renew, daemon=True).start()

    def _link_in_place(self) -> bool:
        try:
            os.link(self.mine, self.path)
            return True
        except FileExistsError:  # a lock is there: another's, or ours if NFS lost the reply of a link it did
            return self._ours_in_place()
        except OSError as e:  # e.g. exFAT, or SMB without its unix extensions
            raise UsageError(f"--output_dir {self.output_dir} is on a filesystem without hard links ({e.strerror}), "
                             "which its lock needs: choose another --output_dir") from None

    def _ours_in_place(self) -> bool:
        """Whether the lock in place is our file. Over NFS, a call the server did can still fail: its reply is
        lost and the client's retransmission finds it done (link: EEXIST; rename: ENOENT). The open(2) man
        page's recipe for link checks that our file gained the link; the same file in place says it for both
        calls."""
        there = self._look()
        return there is not None and os.path.samestat(there[1], os.fstat(self.file.fileno()))

    def _flock(self, f) -> str:
        """flock(2) on `f`, not waiting: "ours", "held" (by another open file: a live run's, or a lost node's
        that its NFS server still keeps) or "missing" (the filesystem has none: said once)."""
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return "ours"
        except BlockingIOError:
            return "held"
        except OSError as e:
            if not self.said_no_flock:
                print(f"warning: {self.output_dir} is on a filesystem without flock ({e.strerror}): it is locked by "
                      f"the time of {self.path}, renewed every {self.RENEW_S} s", flush=True)
            self.said_no_flock = True
            return "missing"

    def _look(self, probe_flock: bool = False) -> tuple[str, os.stat_result, str | None] | None:
        """(owner, stat, flock) of the lock in place, None if there is none; `flock` as _flock says
        (probe_flock: ours only for the look, the file is closed at once), else None. Opened, not stat(2)'ed:
        NFS revalidates a file's attributes on open, while a stat may answer from its cache for up to a
        minute. Opened for writing to probe: NFS emulates flock with a write lock."""
        try:
            f = open(self.path, "r+" if probe_flock else "r")
        except FileNotFoundError:
            return None
        with f:
            flock = self._flock(f) if probe_flock else None
            return _owner(f), os.fstat(f.fileno()), flock

    def _judge_the_lock_there(self) -> bool:
        """One look at the lock in place, not ours: stop, take it over (True), or watch it until one of those
        is due. False: look again (it was removed, or taken over by another start meanwhile)."""
        there = self._look(probe_flock=True)
        if there is None:  # its run has just ended
            return False
        owner, seen, flock = there
        pid, _, host = owner.removeprefix("pid ").partition(" on ")
        if host == socket.gethostname():  # the kernel of this node knows whether its process lives
            if flock == "held":
                raise UsageError(f"--output_dir {self.output_dir} is in use by another run ({owner}): wait for it to "
                                 "end, or choose another --output_dir")
            if flock == "ours" or not os.path.exists(f"/proc/{pid}"):
                return self._take_over(owner, seen)  # its process gone: at once, without a word
        if not self._went_stale(owner, seen, flock == "held"):
            return False
        taken = self._take_over(owner, seen)
        if taken:
            print(f"warning: {self.path} was left by {owner}, not renewed for {time.time() - seen.st_mtime:.0f} s: "
                  "taken over", flush=True)
        return taken

    def _went_stale(self, owner: str, seen: os.stat_result, flocked: bool) -> bool:
        """Watch the lock `seen` (as first opened) for WATCH_RENEWALS periods at least and until it has gone
        unrenewed for STALE_RENEWALS by its time (a time ahead of our clock: a whole stale window, no more),
        and while its flock is held (`flocked`), until that is freed: True then. False if it was removed (its
        run ended). UsageError if it was renewed or replaced (a live run), or its flock outlived the bound (a
        lost node's)."""
        stale_s, age = self.RENEW_S * self.STALE_RENEWALS, time.time() - seen.st_mtime
        # The clocks of two nodes can differ (ours 2 minutes ahead made a lock renewed just now look stale,
        # and it was taken over from its live run); a renewal seen needs no clock, so some are watched for
        # whatever the age.
        wait = min(stale_s, max(self.RENEW_S * self.WATCH_RENEWALS, stale_s - age))
        bound = stale_s + self.NFS_LEASE_S
        print(self._watching(owner, age, bound if flocked else wait, flocked), flush=True)
        started = time.monotonic()
        while flocked or time.monotonic() - started < wait:
            if flocked and time.monotonic() - started >= bound:
                raise UsageError(self._lost_node(owner, bound))
            looked = time.monotonic()
            time.sleep(self.RENEW_S / 10)
            now = self._look(probe_flock=flocked)
            if now is None:
                return False
            if not _same_file(now[1], seen):  # renewed since the previous look: no clock needed to say when
                raise UsageError(self._in_use(now[0], time.monotonic() - looked))
            flocked = now[2] == "held"
        return True

    def _watching(self, owner: str, age: float, wait: float, flocked: bool) -> str:
        held = ", and its flock is held (by its run, or by the file server for a lost node until its lease ends)"
        return (f"{self.path} names {owner}, renewed {age:.0f} s ago{held if flocked else ''}: waiting up to "
                f"{wait:.0f} s to see it renewed (every {self.RENEW_S} s while that run lives: then this start stops) "
                "or not (it is taken over" + (" once its flock is freed)" if flocked else ")"))

    def _in_use(self, owner: str, age: float) -> str:
        return (f"--output_dir {self.output_dir} is in use by another run ({owner}, which renewed its lock {age:.0f} s "
                f"ago): wait for it to end, or choose another --output_dir. If that run has ended (it is renewed every "
                f"{self.RENEW_S} s), delete {self.path}")

    def _lost_node(self, owner: str, watched: float) -> str:
        return (f"--output_dir {self.output_dir} is locked by {owner}, which has not renewed its lock in the "
                f"{watched:.0f} s this start watched it while its flock stayed held: its node may be lost, with the "
                "file server keeping its lock (NFSv4: until its lease ends; NFSv3: until that node reboots), or its "
                f"run is frozen. If no run uses the folder, delete {self.path}")

    def _take_over(self, owner: str, seen: os.stat_result) -> bool:
        """Replace the lock judged a gone run's by ours, if it is still that very file (same inode, not
        renewed since). One start alone may: it claims that file first, by an exclusive create named after it;
        a start that finds the claim made stops, as the claimant will run. rename(2) replaces the lock whole:
        never a moment without one, in which a third start could put its own in place."""
        claim = f"{self.path}.{seen.st_ino}-{seen.st_mtime_ns}"
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            raise UsageError(f"--output_dir {self.output_dir} is being taken over by another start ({self.path} was "
                             f"left by {owner}): wait for it, or choose another --output_dir. If no run uses the "
                             f"folder, delete {claim}") from None
        try:
            now = self._look()
            # Removed, renewed or replaced meanwhile: look again.
            if now is None or not _same_file(now[1], seen):
                return False
            try:
                os.rename(self.mine, self.path)
            except FileNotFoundError:  # ours already, if NFS lost the reply of a rename it did
                if not self._ours_in_place():
                    raise
            return True
        finally:
            os.unlink(claim)

    def _renew(self):
        while not self.stop.wait(self.RENEW_S):
            with suppress(OSError):
                os.utime(self.file.fileno())

    def close(self):
        """The folder is free: the file goes if it is ours (not taken over meanwhile, and put in place: a
        start stopped before that leaves the lock there as it was), then the flock."""
        if self in OutputLock.held:
            OutputLock.held.remove(self)
            self.stop.set()
            if self.file is None:  # stopped before its file was made
                return
            with suppress(OSError):
                if self._ours_in_place():
                    os.unlink(self.path)
            self.file.close()


def _owner(f) -> str:
    """Who a lock file names ("pid 4242 on host"); an empty one (written by hand, or by older code) a
    start."""
    f.seek(0)
    return f.read().strip() or "a run starting"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """The same lock, not renewed in between: its inode and its time."""
    return (a.st_ino, a.st_mtime_ns) == (b.st_ino, b.st_mtime_ns)


def release_locks():
    for lock in list(OutputLock.held):
        lock.close()


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's allocator: blocks of `mmap_bytes` or more are mapped on their own (handed back to the kernel
    when freed), and the heap is trimmed once more than `trim_bytes` at its top are free (both fixed: glibc's
    own threshold rises to 32 MB as blocks are freed). Left alone if you chose these settings yourself
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) or preload another allocator, and a no-op
    without glibc. Returns whether it applied."""
    chosen = ("MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ
              or "threshold" in os.environ.get("GLIBC_TUNABLES", "") or "malloc" in os.environ.get("LD_PRELOAD", ""))
    if chosen:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers, from malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes) and mallopt(M_TRIM_THRESHOLD, trim_bytes))


class InThread:
    """`fn(*args, **kwargs)` started on a thread now (a request that blocks while this process does other
    work); `result()` waits for it and returns its value. If it failed, `result()` raises that error once
    and then runs `fn` again, in the caller's thread: ServerGuard.run(call.result) repeats a request after
    a reconnect."""

    def __init__(self, fn, *args, **kwargs):
        self.call, self.value, self.error = functools.partial(fn, *args, **kwargs), None, None
        self.thread = threading.Thread(target=self._run, daemon=True)  # a run that stops does not wait for it
        self.thread.start()

    def _run(self):
        try:
            self.value = self.call()
        except BaseException as e:  # raised in the caller's thread by result()
            self.error = e

    def wait(self, timeout: float | None) -> bool:
        """Whether the call has ended and its result is still to be taken, after waiting up to `timeout` s
        (None: until it ends)."""
        if self.thread is None:  # its result was taken: nothing more will come
            time.sleep(timeout or 0)
            return False
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def result(self):
        if self.thread is None:  # the threaded call failed before: call again
            return self.call()
        self.thread.join()
        self.thread, error, self.error = None, self.error, None
        if error is not None:
            raise error
        return self.value


def unless_stopped(call: InThread, what: str, poll_s: float = 0.2):
    """call.result(), unless a stop signal arrives first (config.STOP): then Interrupted, and the call is
    abandoned. Its thread runs on until the process ends, and its requests to the server end with the
    process's connections."""
    while not call.wait(poll_s):
        if STOP.is_set():
            raise Interrupted(f"a stop signal arrived during {what}")
    return call.result()
