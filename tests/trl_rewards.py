"""Reward functions written as TRL's GRPOTrainer documentation writes them, for a chat dataset whose rows
are {"prompt": [system, user], "target_len": int, "kind": "count" | "chat"} and have no answer column.
Passed as --reward_funcs tests.trl_rewards:NAME. Each checks what it is given and raises if it is not
what TRL would pass (a raise is counted in scorer_failures, which the test wants at 0)."""
import asyncio


def reward_len(completions, **kwargs):
    """TRL's example: a completion of about 20 characters is best (conversational: completion[0]["content"])."""
    return [-abs(20 - len(completion[0]["content"])) / 20 for completion in completions]


def close_to_target(prompts, completions, target_len, **kwargs):
    """Reads the extra column target_len, which must be the one of the prompt it scores (the prompt says it)."""
    for prompt, target in zip(prompts, target_len):
        if prompt[0]["role"] != "system" or f"about {target} characters" not in prompt[-1]["content"]:
            raise ValueError(f"target_len {target} is not the column of prompt {prompt}")
    return [max(0.0, 1 - abs(len(c[0]["content"]) - t) / 40) for c, t in zip(completions, target_len)]


async def async_brevity(completions, completion_ids, trainer_state, **kwargs):
    """An async function, which also reads the token ids and TRL's trainer_state."""
    await asyncio.sleep(0.01)
    if not all(isinstance(i, int) for ids in completion_ids for i in ids) or trainer_state.global_step < 0:
        raise TypeError("completion_ids must be lists of token ids, trainer_state.global_step a step")
    return [max(0.0, 1 - len(ids) / 16) for ids in completion_ids]


def count_only(completions, kind, **kwargs):
    """Scores only the rows of kind "count" and returns None (not scored) for the others."""
    return [float(len(c[0]["content"].split()) <= 3) if k == "count" else None for c, k in zip(completions, kind)]
