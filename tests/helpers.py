"""Reward functions for tests, passed as --reward_funcs tests.helpers:NAME (TRL's signature)."""
import itertools
import math
import os
import signal
import time


def raises(completions, **kwargs):
    raise RuntimeError("a broken reward function")


def raises_on_x(completions, **kwargs):
    if any("BAD" in c for c in completions):
        raise ValueError("BAD")
    return [1.0] * len(completions)


def hangs_on_x(completions, **kwargs):
    if any("HANG" in c for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def old_style(completions, answers):
    """The signature nanogrpo used before it took TRL's: refused at start."""
    return [0.0] * len(completions)


def returns_one(completions, **kwargs):
    return [1.0]


def returns_text(completions, **kwargs):
    return ["high"] * len(completions)


def raises_on_x_else_text(completions, **kwargs):
    """Raises on a batch holding BAD; one completion at a time, it returns text: a bug, not a failure."""
    if any("BAD" in c for c in completions):
        raise ValueError("BAD")
    return ["high"] * len(completions)


def brevity(completions, **kwargs):
    """1 for an empty completion, falling to 0 at 80 characters: learnable by the tiny test model,
    which ends a completion with probability ~0.1 per token."""
    return [max(0.0, 1 - len(c) / 80) for c in completions]


_calls = 0


def inf_on_calls(completions, **kwargs):
    """brevity, but +inf on the calls listed in NANOGRPO_TEST_INF_CALLS (1-based; the scorer process keeps
    the count, so with one trainer process call k is step k): a reward bug that makes the loss NaN."""
    global _calls
    _calls += 1
    if str(_calls) in os.environ.get("NANOGRPO_TEST_INF_CALLS", "").split(","):
        return [math.inf] * len(completions)
    return brevity(completions)


def logs_extra(completions, log_extra, log_metric, **kwargs):
    """Logs one value per completion (TRL's log_extra) and a metric; raises on a completion holding BAD."""
    if any("BAD" in c for c in completions):
        raise ValueError("BAD")
    log_extra("length", [len(c) for c in completions])
    log_metric("mean_length", sum(map(len, completions)) / len(completions))
    return [1.0] * len(completions)


def logs_extra_short(completions, log_extra, **kwargs):
    log_extra("length", [len(completions[0])])  # one value for the whole batch: refused
    return [1.0] * len(completions)


def judge_down_after_first_call(completions, **kwargs):
    """brevity on the first call; from the second on, raises on every completion (an LLM judge whose endpoint
    went down mid-run). The scorer process keeps the count."""
    global _calls
    _calls += 1
    if _calls > 1:
        raise ConnectionError("the judge's endpoint is down")
    return brevity(completions)


def starts_a_child_and_hangs(completions, **kwargs):
    """A code-execution reward whose sandbox never ends: starts `sleep`, writes "scorer_pid child_pid secret" (the
    secret: VLLM_API_KEY as the function sees it) to NANOGRPO_TEST_PID_FILE, and waits for the child forever."""
    import subprocess
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["NANOGRPO_TEST_PID_FILE"], "w") as f:
        f.write(f"{os.getpid()} {child.pid} {os.environ.get('VLLM_API_KEY', 'none')}")
    child.wait()
    return [0.0] * len(completions)


def sees_secrets(completions, **kwargs):
    """brevity, writing "<VLLM_API_KEY> <WANDB_API_KEY>" as the function sees them ("none" if unset) to
    NANOGRPO_TEST_PID_FILE."""
    with open(os.environ["NANOGRPO_TEST_PID_FILE"], "w") as f:
        f.write(" ".join(os.environ.get(k, "none") for k in ("VLLM_API_KEY", "WANDB_API_KEY")))
    return brevity(completions)


def ctrl_c_is_pythons(completions, **kwargs):
    """1.0 for each completion if Ctrl-C reaches this process's Python handler (not blocked, not ignored; asyncio,
    which runs the functions, has its own), else 0.0."""
    free = signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return [float(free and signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL))] * len(completions)


def brevity_on_some_prompts(prompts, completions, **kwargs):
    """brevity for prompts of an odd length (in characters), 0 for the others: their groups have no signal."""
    return [max(0.0, 1 - len(c) / 80) if len(str(p)) % 2 else 0.0 for p, c in zip(prompts, completions)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def guess(number: int) -> str:
    """A tool named as the Guess environment's method.

    Args:
        number: a number
    """
    return str(number)


class Guess:
    """A game as TRL 1.16's documentation writes environments: reset(**row) starts it (a secret from 1 to 10, the
    same for the same prompt), the tool `guess` answers higher or lower, get_reward() is 1 once it was found."""

    def __init__(self):
        self.secret, self.found = 0, False

    def reset(self, **kwargs) -> str:
        import zlib
        self.secret, self.found = zlib.crc32(str(kwargs.get("prompt")).encode()) % 10 + 1, False
        return " Guess my number from 1 to 10 with the guess tool."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: a whole number from 1 to 10
        """
        self.found = self.found or number == self.secret
        return "found it" if number == self.secret else "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return float(self.found)


async def one_call_agent(client, row):
    """An OpenAI-client agent, as agent code is written: it calls client.chat.completions.create and returns its
    reward (a short answer is better)."""
    answer = await client.chat.completions.create(model=client.model, max_tokens=8,
                                                  messages=[{"role": "user", "content": str(row["prompt"])}])
    return 1.0 - len(answer.choices[0].message.content or "") / 80


async def two_call_agent(client, row):
    """A first answer, then a follow-up question with the conversation so far. The first answer is the end-of-turn
    token alone (<|im_end|>, id 2 in SmolLM2's vocabulary): an empty answer, passed back as a dict."""
    messages = [{"role": "user", "content": str(row["prompt"])}]
    first = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=1,
                                                 extra_body={"allowed_token_ids": [2]})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Are you sure?"}]
    second = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=6)
    return 1.0 - len(second.choices[0].message.content or "") / 80


async def unchained_agent(client, row):
    """Two calls whose second does not continue the first: it starts with another system message (a new sample)."""
    await client.chat.completions.create(model=client.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    await client.chat.completions.create(model=client.model, max_tokens=2, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    return 0.0


class NoReset:
    """An environment without reset(**row): refused at start."""

    def look(self) -> str:
        """Look around."""
        return "nothing"


def undocumented(x: int) -> int:
    return x


def near_target(completions, target_len, **kwargs):
    """1 for a completion of `target_len` characters (a column only one task of the mixture tests has), falling
    by 1/40 per character away from it."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # chat prompts: messages
    return [max(0.0, 1 - abs(len(text) - t) / 40) for text, t in zip(texts, target_len)]


def stretch_near_target(matrix, names, tasks):
    """A --reward_postprocess hook: near_target's column of the rows of task `hello` becomes 2 x - 1; each call
    appends what it received (the names, the tasks, where the matrix is NaN) to NANOGRPO_TEST_HOOK_LOG."""
    import json
    with open(os.environ["NANOGRPO_TEST_HOOK_LOG"], "a") as f:
        f.write(json.dumps({"names": names, "tasks": tasks, "nan": matrix.isnan().tolist()}) + "\n")
    j = [n.endswith("near_target") for n in names].index(True)
    for i, task in enumerate(tasks):
        if task == "hello":
            matrix[i, j] = 2 * matrix[i, j] - 1
    return matrix


def fails_on_rank_1_at_call_2(matrix, names, tasks):
    """A --reward_postprocess hook that raises on rank 1's second call only (step 2 with no evaluation): a bug that
    only some batches meet, on one rank."""
    global _calls
    _calls += 1
    if os.environ.get("RANK") == "1" and _calls == 2:
        raise ValueError("a hook that fails on one rank")
    return matrix


# ----------------------------------------------------------------------------- multi-turn (tests/test_multi_turn.py)

def always_one(completions, **kwargs):
    return [1.0] * len(completions)


class Strict:
    """An environment whose reset names the dataset's columns it takes, and nothing else (TRL's contract: no column
    that nanogrpo adds); get_reward() does not apply (None) to rows whose answer is "none"."""

    def reset(self, prompt, answer) -> str:
        self.answer = answer
        return " Reply."

    def get_reward(self) -> float | None:
        return None if self.answer == "none" else 0.5


class Fragile:
    """No get_reward: the reward functions score it. Its reset raises on a prompt holding "break", its turn_prefix
    on one holding "crash": those trajectories get no reward, whatever the functions say."""

    def reset(self, prompt, **row) -> str:
        if "break" in prompt:
            raise RuntimeError("the environment broke")
        self.prompt = prompt
        return ""

    def turn_prefix(self) -> str:
        if "crash" in self.prompt:
            raise RuntimeError("the environment crashed")
        return ""


def with_secret(rows, ctx):
    """The default rollout, with an extra field per episode (TRL's rollout_func fields): secret = 0.25 x its place."""
    from rollout import generate
    episodes = generate(rows, ctx)
    for k, e in enumerate(episodes):
        e.extra = {"secret": 0.25 * (k % ctx.num_generations)}
    return episodes


def gated_at_call_2(rows, ctx):
    """The default rollout; its second call (step 2 with one process; NANOGRPO_TEST_GATE_CALL: another, on
    NANOGRPO_TEST_GATE_RANK alone if set) first writes NANOGRPO_TEST_GATE + ".waiting" and waits until
    NANOGRPO_TEST_GATE + ".open" exists: a test can change the server while no request runs, or stop the run there."""
    global _calls
    _calls += 1
    gate, rank = os.environ["NANOGRPO_TEST_GATE"], os.environ.get("NANOGRPO_TEST_GATE_RANK")
    if _calls == int(os.environ.get("NANOGRPO_TEST_GATE_CALL", 2)) and rank in (None, os.environ.get("RANK", "0")):
        open(gate + ".waiting", "w").close()
        while not os.path.exists(gate + ".open"):
            time.sleep(0.1)
    from rollout import generate
    return generate(rows, ctx)


class WaitsWhenAsked:
    """An environment whose tool `wait` answers at once, but when the file NANOGRPO_TEST_GATE exists, or at this
    process's call number NANOGRPO_TEST_GATE_CALL (on NANOGRPO_TEST_GATE_RANK alone if set): then it writes
    NANOGRPO_TEST_GATE + ".waiting" and waits until NANOGRPO_TEST_GATE + ".open" exists (an hour at most: a slow
    tool). Run with a structured-outputs regex that makes the model write the call."""

    CALL = '<tool_call>\n{"name": "wait", "arguments": {}}\n</tool_call>'

    def reset(self, **row) -> str:
        return ""

    def wait(self) -> str:
        """Wait until the world is ready."""
        gate, call = os.environ["NANOGRPO_TEST_GATE"], next(_tool_calls)
        ours = os.environ.get("NANOGRPO_TEST_GATE_RANK") in (None, os.environ.get("RANK", "0"))
        if os.path.exists(gate) or ours and call == int(os.environ.get("NANOGRPO_TEST_GATE_CALL", 0)):
            open(gate + ".waiting", "w").close()
            deadline = time.monotonic() + 3600
            while not os.path.exists(gate + ".open") and time.monotonic() < deadline:
                time.sleep(0.1)
        return "ready"


_tool_calls = itertools.count(1)  # (next() on it is atomic: the tools of a turn run on threads of their own)


def hangs_at_call_2(completions, **kwargs):
    """A reward function whose second call (step 2, one process, no evaluation) writes NANOGRPO_TEST_GATE + ".waiting"
    and hangs (a judge that stopped answering)."""
    global _calls
    _calls += 1
    if _calls == 2:
        open(os.environ["NANOGRPO_TEST_GATE"] + ".waiting", "w").close()
        time.sleep(3600)
    return [1.0] * len(completions)


def reads_secret(completions, secret, **kwargs):
    return list(secret)


async def free_two_call_agent(client, row):
    """A first answer of the model's own words (any tokens), passed back as the SDK message it came as, then a
    follow-up question: token-exact only if the words are not re-tokenized."""
    messages = [{"role": "user", "content": str(row["prompt"])}]
    first = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=6)
    messages += [first.choices[0].message, {"role": "user", "content": "Are you sure?"}]
    second = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=6)
    return 1.0 - len(second.choices[0].message.content or "") / 80


class Echo:
    """Its tool echo(text) answers with text: trajectories whose calls differ grow apart."""

    def reset(self, **row):
        return ""

    def echo(self, text: str) -> str:
        """Echo the text.

        Args:
            text: anything
        """
        return text
