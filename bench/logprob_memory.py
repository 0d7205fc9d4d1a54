"""Peak memory of the no-grad log-prob pass: the (B, C, vocab) logits at once (chunk_size None) against
the lm_head applied 32 positions at a time, which is what utils.completion_logprobs does without grad
(pi_old, reference, probe). Each path runs in its own process; the number is the growth of the
process's peak RSS during the pass.

    .venv/bin/python bench/logprob_memory.py [--model smollm2-135m] [--batch 16] [--completion 256]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(path: str, model: str, batch: int, prompt: int, completion: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import config
    import utils
    m = utils.load_model(config.resolve_model(model), "cpu")
    ids = torch.randint(3, m.config.vocab_size, (batch, prompt + completion))
    attn = torch.ones_like(ids)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        utils.completion_logprobs(m, {"input_ids": ids, "attention_mask": attn}, completion, 1.0,
                                  32 if path == "chunked" else None)
    seconds = time.perf_counter() - t
    return {"path": path, "peak_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
            "seconds": seconds}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--one", default="")
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.model, a.batch, a.prompt, a.completion)))
        sys.exit()
    results = {}
    for path in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--one", path, "--model", a.model, "--batch", str(a.batch),
                              "--prompt", str(a.prompt), "--completion", str(a.completion)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[path] = json.loads(out)
        print(f"{path:8s} peak RSS growth {results[path]['peak_growth_mb']:8.0f} MB   {results[path]['seconds']:.2f} s")
    print(f"chunked / plain: memory {results['chunked']['peak_growth_mb'] / results['plain']['peak_growth_mb']:.2f}x, "
          f"time {results['chunked']['seconds'] / results['plain']['seconds']:.2f}x "
          f"(batch {a.batch}, {a.prompt} prompt + {a.completion} completion tokens, bf16 autocast)")
