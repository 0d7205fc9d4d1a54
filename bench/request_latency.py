"""How long a small request and a weight push take on the CPU server, and what an idle server costs, with
vllm_server.py's polling (as shipped) against vLLM's own (NANOGRPO_VLLM_POLLING=1: 1 s of busy polling after
each message). One invocation runs, one server after the other (never two at once: they share the CPU):

  for each model (the tests' tiny random Llama, SmolLM2-135M) and each polling:
    - `--requests` sequential small requests (one prompt, n=4, 16 tokens), each timed;
    - `--pushes` sequential weight pushes of the model's own weights (gloo, the server's dtype), each timed;
    - the CPU the server's processes use in the `--idle` seconds after a request, with nothing to do.

It prints median, p90 and max of each, in seconds, and the idle CPU in cores. With $NANOGRPO_BENCH_SERVER set
(the tests), "tiny" with the shipped polling alone is measured on that server, the tests' own.

    .venv/bin/python bench/request_latency.py [--models tiny,smollm2-135m --pollings "shipped,vLLM's" --requests 50
                                              --pushes 20 --idle 5]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from common import ROOT, SHARED_SERVER, free_port, serving

sys.path.insert(0, os.path.join(ROOT, "tests"))
POLLINGS = {"shipped": "0", "vLLM's": "1"}  # NANOGRPO_VLLM_POLLING in the server's environment


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(ordered):6.3f}  p90 {p90:6.3f}  max {ordered[-1]:6.3f}"


def measure(model: str, flags: tuple, workdir: str, requests: int, pushes: int, idle: float) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from utils import cpu_seconds_of_group
    from vllm_client import VLLMClient
    from weight_sync import ServerWeights, WeightSync
    with serving(model, workdir, *flags) as server:
        client = VLLMClient(port=server["port"])
        dtype, _ = client.server_dtype_and_max_len()
        prompt = AutoTokenizer.from_pretrained(model)("What is 12 + 7?")["input_ids"]
        client.generate([prompt], n=4, max_tokens=16)  # warm-up
        request_times = []
        for i in range(requests):
            t = time.perf_counter()
            client.generate([prompt], n=4, max_tokens=16, seed=i)
            request_times.append(time.perf_counter() - t)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        sync = WeightSync(client, ServerWeights(policy, dtype), 0, "127.0.0.1", free_port())
        sync.push()  # warm-up: the first push builds the transfer group
        push_times = []
        for _ in range(pushes):
            t = time.perf_counter()
            sync.push()
            push_times.append(time.perf_counter() - t)
        client.generate([prompt], n=1, max_tokens=4)
        pgid = server["pid"]
        before = cpu_seconds_of_group(pgid)
        time.sleep(idle)
        idle_cores = (cpu_seconds_of_group(pgid) - before) / idle
        del sync
    return {"requests": request_times, "pushes": push_times, "idle": idle_cores}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2-135m", help="comma-separated; 'tiny' = the tests' model")
    parser.add_argument("--pollings", default=",".join(POLLINGS), help="comma-separated, of " + ",".join(POLLINGS))
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured")
    args = parser.parse_args()
    if set(args.pollings.split(",")) - set(POLLINGS):
        parser.error(f"--pollings {args.pollings}: of {','.join(POLLINGS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from embedded import resolve_model
    with tempfile.TemporaryDirectory() as workdir:
        results = []
        for name in args.models.split(","):
            if name == "tiny" and os.environ.get(SHARED_SERVER) and args.pollings == "shipped":
                from vllm_client import VLLMClient  # the tests' own server on their tiny model, served as shipped
                client = VLLMClient(port=int(os.environ[SHARED_SERVER].split(":")[0]))
                client.wait_for_health(timeout=30)
                model, flags = client.model_name, ()
            elif name == "tiny":
                from conftest import make_tiny_model
                model = make_tiny_model(os.path.join(workdir, "tiny"))
                flags = ("--dtype", "float32", "--max-model-len", "1024")  # as the tests serve it
            else:
                model, flags = resolve_model(name), ()
            for polling, value in ((k, POLLINGS[k]) for k in args.pollings.split(",")):
                os.environ["NANOGRPO_VLLM_POLLING"] = value  # the server started next inherits it
                print(f"{name}, {polling} polling ...", flush=True)
                results.append((name, polling, measure(model, flags, workdir, args.requests, args.pushes, args.idle)))
    print(f"\n{'model':<14} {'polling':<9} {'what':<22} seconds")
    for name, polling, r in results:
        for what in ("requests", "pushes"):
            label = f"{len(r[what])} {what}"
            print(f"{name:<14} {polling:<9} {label:<22} {summary(r[what])}")
        print(f"{name:<14} {polling:<9} {'idle server, CPU':<22} {r['idle']:.3f} cores")


if __name__ == "__main__":
    main()
