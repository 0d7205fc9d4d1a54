"""Rollout functions for tests, passed as --rollout tests.rollouts:NAME."""
from rollout import Episode

PREFIX = " The answer is"


def forced_prefix(rows, ctx):
    """Every completion starts with PREFIX, which the policy did not sample: the server continues the
    prompt followed by it, and the episode marks its tokens unsampled (log-prob 0.0: a placeholder
    that must never be compared or weighted)."""
    prefix = ctx.tokenizer(PREFIX, add_special_tokens=False)["input_ids"]
    prompts = [ctx.encode(row["prompt"]) for row in rows]
    samples = ctx.client.generate([p + prefix for p in prompts], n=ctx.num_generations, seed=ctx.seed, **ctx.sampling)
    G = ctx.num_generations
    return [Episode(rows[i // G], prompts[i // G], prefix + s["token_ids"], [False] * len(prefix) + [True] * len(s["token_ids"]),
                    [0.0] * len(prefix) + s["logprobs"], s["finish_reason"]) for i, s in enumerate(samples)]


def too_few(rows, ctx):
    return forced_prefix(rows, ctx)[1:]
