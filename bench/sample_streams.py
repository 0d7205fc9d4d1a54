"""The default rollout's two ways to ask for a rank's samples, side by side on one server: all its prompts in one
request (vLLM gives the j-th sample of every prompt the request's seed + j: the j-th samples of all groups share a
random stream), and a request per prompt, each with a seed of its own, sent at once (rollout.generate: every sample
has its own stream). The two alternate, `--repeats` times each after a warm-up, on the same prompts; it prints the
median time of each and their ratio, and whether the j-th samples of two groups of the same prompt were equal.

    .venv/bin/python bench/sample_streams.py                      # SmolLM2, 8 prompts x G=8, 128 tokens, 5 repeats
    .venv/bin/python bench/sample_streams.py --prompts 16 --repeats 9
"""
import argparse
import statistics
import tempfile
import time

from transformers import AutoTokenizer

from common import serving, workload_arguments
from data import encode_prompt
from embedded import resolve_model
from rollout import RolloutContext, generate
from vllm_client import VLLMClient


def one_request(client, tokenizer, texts: list[str], G: int, length: int, seed: int) -> list[list[int]]:
    prompts = [encode_prompt(tokenizer, text, "") for text in texts]  # as the rollout encodes them
    return [s["token_ids"] for s in client.generate(prompts, n=G, max_tokens=length, temperature=1.0, seed=seed)]


def per_prompt(client, tokenizer, texts: list[str], G: int, length: int, seed: int) -> list[list[int]]:
    ctx = RolloutContext(client, tokenizer, G, dict(max_tokens=length, temperature=1.0), seed=seed)
    return [e.completion_ids for e in generate([{"prompt": text} for text in texts], ctx)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = ["What is 12 + 7?"] * 2 + [f"Write a sentence about the number {i}." for i in range(args.prompts - 2)]
    with tempfile.TemporaryDirectory() as workdir, serving(model, workdir) as server:
        client = VLLMClient(port=server["port"])
        client.wait_for_health(300)
        ways, times, alike = {"one request": one_request, "a request per prompt": per_prompt}, {}, {}
        for way, fn in ways.items():  # warm-up, and the first two groups compared
            samples = fn(client, tokenizer, texts, args.G, args.length, seed=0)  # the first two prompts are alike:
            alike[way] = samples[:args.G] == samples[args.G:2 * args.G]  # do their groups share streams?
        for repeat in range(args.repeats):
            for way, fn in ways.items():
                start = time.perf_counter()
                fn(client, tokenizer, texts, args.G, args.length, seed=repeat + 1)
                times.setdefault(way, []).append(time.perf_counter() - start)
    median = {way: statistics.median(t) for way, t in times.items()}
    print(f"{args.prompts} prompts x G={args.G}, up to {args.length} tokens, {args.repeats} repeats each, alternating:")
    for way in ways:
        print(f"  {way:22s} median {median[way]:7.2f} s   the same prompt's two groups sample alike: {alike[way]}")
    print(f"a request per prompt / one request: {median['a request per prompt'] / median['one request']:.2f}")
