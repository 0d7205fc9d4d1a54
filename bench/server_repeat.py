"""Does the server answer the same request the same way? Starts one vllm_server.py (the embedded model by
default) and sends it a step of the default run as train.py would (--prompts problems of the embedded task with
its system prompt, G samples of each, one request seed) --repeats times, first alone and then each time next to
another request, with the weights unchanged. Prints, for each answer, how many of its completions are the
first answer's token for token, how many of those also have its log-probs to the last bit, and the largest
log-prob difference among them. A run repeats exactly only if every answer does (README: The default run).

    .venv/bin/python bench/server_repeat.py                      # bf16 where the CPU has it (the default)
    .venv/bin/python bench/server_repeat.py --server_args="--dtype float32"
"""
import argparse
import os
import shlex
import sys
import tempfile
import threading

from common import ROOT, serving


def compare(answer: list[dict], first: list[dict]) -> str:
    same = [(a, b) for a, b in zip(answer, first) if a["token_ids"] == b["token_ids"]]
    diffs = [max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0) for a, b in same]
    return (f"same tokens {len(same):3d}/{len(first)}  same log-probs {sum(d == 0 for d in diffs):3d}/{len(same)}  "
            f"largest log-prob difference {max(diffs, default=0.0):.2e}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--length", type=int, default=40)
    p.add_argument("--server_args", default="", help="vllm serve flags for the server, e.g. --dtype float32")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from transformers import AutoTokenizer

    from config import DEFAULT_DATASET, EMBEDDED_TASKS
    from embedded import arithmetic_problems, resolve_model
    from vllm_client import VLLMClient
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    system = EMBEDDED_TASKS[DEFAULT_DATASET]["system_prompt"]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": row["prompt"]}],
                                             add_generation_prompt=True, return_dict=False)
               for row in arithmetic_problems(args.prompts, seed=42)]
    with tempfile.TemporaryDirectory() as tmp, serving(model, tmp, *shlex.split(args.server_args)) as server:
        client = VLLMClient(port=server["port"], api_key=os.environ.get("VLLM_API_KEY"))
        client.wait_for_health()
        ask = lambda: client.generate(prompts, n=args.G, max_tokens=args.length, seed=1234)
        print(f"{args.prompts} prompts x G={args.G}, {args.length} tokens, one request seed; "
              f"server flags: {args.server_args or 'none'}")
        first = ask()
        for i in range(args.repeats):
            print(f"alone, again ({i + 1}):        ", compare(ask(), first), flush=True)
        for i in range(args.repeats):
            other = threading.Thread(target=client.generate, args=(prompts[::-1],),
                                     kwargs=dict(n=args.G, max_tokens=args.length, seed=99))
            other.start()
            answer = ask()
            other.join()
            print(f"next to another request ({i + 1}):", compare(answer, first), flush=True)
