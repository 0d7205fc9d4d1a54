"""A LoRA run's push: the adapter alone against every weight with the adapter merged in. One server with LoRA on
(--enable-lora) and two train.py runs against it, one after the other, with --use_peft and the same flags but
--lora_sync adapter / merged. Prints, over the steps after the first, the push's time (time/sync) and the
server's generation time (time/generate: vLLM's LoRA kernels add work to every token the adapter run samples),
each as adapter / merged; and the bytes of one push, for this model (counted) and, on paper, for Llama-2-7B and
Llama-2-70B with the same rank on every linear layer of their decoder layers.

    .venv/bin/python bench/lora_sync.py                    # SmolLM2-135M, r=16 all-linear, 8 prompts x G=8, 128 tokens
    .venv/bin/python bench/lora_sync.py --lora_r 64 -- --fsdp
"""
import argparse
import os
import tempfile

from common import mean, serving, steady, train, workload_arguments

# decoder layers, hidden, intermediate, key/value width, vocabulary (Llama-2's published configurations)
PAPER = {"Llama-2-7B": (32, 4096, 11008, 4096, 32000), "Llama-2-70B": (80, 8192, 28672, 1024, 32000)}
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes


def paper_bytes(layers: int, hidden: int, inter: int, kv: int, vocab: int, r: int, nbytes: int = 2) -> tuple[int, int]:
    """(adapter, merged) bytes of a Llama-shaped model in bf16: the adapter has r x (in + out) per linear layer of
    every decoder layer (q, k, v, o, gate, up, down); the model every weight (embeddings and head untied)."""
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter),
              (inter, hidden)]
    adapter = layers * sum(r * (i + o) for i, o in shapes)
    model = layers * (sum(i * o for i, o in shapes) + 2 * hidden) + 2 * vocab * hidden + hidden
    return adapter * nbytes, model * nbytes


def counted_bytes(model_path: str, r: int, targets: str, nbytes: int) -> tuple[int, int]:
    """(adapter, merged) bytes of one push of this model, counted on it with peft (the adapter as pushed)."""
    from models import add_lora, load_model
    model = add_lora(load_model(model_path, "cpu"), r, 2.0 * r, 0.0, targets)
    adapter = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    merged = sum(p.numel() for name, p in model.get_base_model().named_parameters() if "lora_" not in name)
    return adapter * nbytes, merged * nbytes


def mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.1f} GB"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_target_modules", default="all-linear")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("train_flags", nargs="*", help="more train.py flags for both runs, after --")
    a = p.parse_args()
    from embedded import resolve_model
    from vllm_client import VLLMClient
    model = resolve_model(a.model)
    rank = min(r for r in (*VLLM_RANKS, a.lora_r) if r >= a.lora_r)
    lora = ["--use_peft", "--lora_r", str(a.lora_r), "--lora_alpha", str(2 * a.lora_r), "--lora_target_modules",
            a.lora_target_modules, "--learning_rate", "2e-4", *a.train_flags]
    print(f"{a.model} | LoRA r={a.lora_r} on {a.lora_target_modules} | {a.nproc} process(es) | {a.prompts} prompts x "
          f"G={a.G}, up to {a.length} tokens | {a.steps} steps | server --enable-lora --max-lora-rank {rank}")
    times = {}
    with tempfile.TemporaryDirectory() as tmp, serving(model, tmp, lora_rank=rank) as s:
        client = VLLMClient(port=s["port"])
        client.wait_for_health(60)
        nbytes = client.server_dtype_and_max_len()[0].itemsize  # the push sends what the server computes in
        for how in ("adapter", "merged"):
            metrics, _ = train(model, s["port"], os.path.join(tmp, how), a.steps, a.prompts, a.G, a.length, a.nproc,
                               (*lora, "--lora_sync", how))
            rows = steady(metrics)
            times[how] = {k: mean(rows, f"time/{k}") for k in ("sync", "generate", "step")}
            print(f"{how:8s} push {times[how]['sync']:6.2f} s   generate {times[how]['generate']:6.2f} s   "
                  f"step {times[how]['step']:6.2f} s   (steps {rows[0]['step']}-{rows[-1]['step']})")
    for k in ("sync", "generate", "step"):
        print(f"adapter / merged, {'push' if k == 'sync' else k}: {times['adapter'][k] / times['merged'][k]:.2f}")
    adapter, merged = counted_bytes(model, a.lora_r, a.lora_target_modules, nbytes)
    print(f"bytes of one push, {a.model} ({8 * nbytes}-bit): adapter {mb(adapter)}, merged {mb(merged)} "
          f"({merged / adapter:.0f}x)")
    for name, dims in PAPER.items():
        adapter, merged = paper_bytes(*dims, a.lora_r)
        print(f"bytes of one push, {name} (bf16, on paper): adapter {mb(adapter)}, merged {mb(merged)} "
              f"({merged / adapter:.0f}x)")
