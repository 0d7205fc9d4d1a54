"""The real vllm_server.py on a tiny random model: generation, weight pushes, restoring weights, what an
idle server costs, its processes' reuse of freed memory, multi-turn trajectories sampled from it token-exact, and
the LoRA adapters it is pushed (POST /load_adapter): only its own replaced or removed, the ones it refuses said why."""
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, collated, free_port
from logprobs import completion_logprobs
from utils import cpu_seconds_of_group
from vllm_client import VLLMClient
from weight_sync import ServerWeights, WeightSync

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(server):
    client = VLLMClient(port=server["port"])
    client.wait_for_health(30)
    tokenizer = AutoTokenizer.from_pretrained(server["model"])
    model = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    # small buckets: many of them, and the big embedding travels alone
    sync = WeightSync(client, ServerWeights(model, torch.float32), 0, "127.0.0.1", free_port(), bucket_mb=0.5)
    sync.push()  # the server is shared: training tests may have left their weights in it
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Name a colour.")["input_ids"]]
    yield client, model, prompts, sync, initial
    model.load_state_dict(initial, strict=False)
    sync.push()  # leave the server as we found it


def trainer_logprobs(model, prompts, samples, n):
    prompt_of = [prompts[i // n] for i in range(len(samples))]
    inputs, cmask = collated(prompt_of, [s["token_ids"] for s in samples], pad_id=2)
    with torch.no_grad():
        return completion_logprobs(model, inputs, cmask.shape[1], 1.0)[0], cmask


def test_generate_returns_n_completions_with_ids_logprobs_and_finish_reasons(setup):
    client, model, prompts, *_ = setup
    samples = client.generate(prompts, n=3, max_tokens=12, temperature=1.0)
    assert len(samples) == 6
    for s in samples:
        assert 1 <= len(s["token_ids"]) <= 12 and len(s["logprobs"]) == len(s["token_ids"])
        assert s["finish_reason"] in ("stop", "length")
        assert all(lp <= 0 for lp in s["logprobs"])
    assert len({tuple(s["token_ids"]) for s in samples[:3]}) > 1  # sampled, not copies


def test_sampler_logprobs_equal_the_trainers_in_fp32(setup):
    client, model, prompts, *_ = setup
    samples = client.generate(prompts, n=2, max_tokens=16, temperature=1.0)
    ours, mask = trainer_logprobs(model, prompts, samples, 2)
    for i, s in enumerate(samples):
        diff = (ours[i, :len(s["logprobs"])] - torch.tensor(s["logprobs"])).abs().max().item()
        assert diff < 1e-4, diff


def test_push_changes_outputs_and_restoring_reproduces_them_exactly(setup):
    client, model, prompts, sync, initial = setup
    probe = prompts[0] + [100, 200, 300, 400, 500]
    before = client.prompt_logprobs(probe)
    greedy_before = client.generate(prompts, n=1, max_tokens=8, temperature=1e-5)
    # change every weight, the (tied) embedding included: a stale lm_head copy on the server would show
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert "model.embed_tokens.weight" in [m.name for m in sync.source.metadata()]
    sync.push()
    after = client.prompt_logprobs(probe)
    assert max(abs(a - b) for a, b in zip(before, after)) > 0.1
    # the server now computes exactly what the model with the pushed weights computes
    ids = torch.tensor([probe])
    with torch.no_grad():
        want = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert (torch.tensor(after) - want).abs().max().item() < 1e-4
    model.load_state_dict(initial, strict=False)
    sync.push()
    assert client.prompt_logprobs(probe) == before
    assert client.generate(prompts, n=1, max_tokens=8, temperature=1e-5) == greedy_before


def test_seeded_requests_are_reproducible_whatever_else_the_server_runs(setup):
    """The trainer seeds every request (exact resume). Long prompts, sent alone and then next to other
    requests, give the same samples; on CPU this needs whole-prompt prefills (vllm_server.py's default)."""
    import threading
    client, *_ = setup
    prompts = [[100 + (i * 7 + j) % 3000 for j in range(300 + 40 * i)] for i in range(6)]
    alone = client.generate(prompts, n=4, max_tokens=12, seed=1234)
    busy = threading.Thread(target=client.generate, args=(prompts[::-1],), kwargs=dict(n=4, max_tokens=12, seed=99))
    busy.start()
    together = client.generate(prompts, n=4, max_tokens=12, seed=1234)
    busy.join()
    assert [s["token_ids"] for s in together] == [s["token_ids"] for s in alone]
    assert client.generate(prompts[:1], n=4, max_tokens=12, seed=4321) != alone[:4]  # another seed, other samples


def test_a_server_without_work_waits_instead_of_spinning(setup, server):
    # vLLM's engine and worker processes poll their message queues in a busy loop for 1 s after each
    # message (about a core each); on CPUs vllm_server.py makes them wait, in every process it starts
    client, _, prompts, *_ = setup
    client.generate(prompts, n=1, max_tokens=4)
    before = cpu_seconds_of_group(server["proc"].pid)
    time.sleep(1.0)
    used = cpu_seconds_of_group(server["proc"].pid) - before
    assert used < 0.3, f"the server used {used:.2f} s of CPU in the 1 s after a request, with nothing to do"


def read_pairs(handle, pairs: int, answers):
    """A reader of vLLM's shared-memory message queue in a process of its own, tuned as a CPU server's workers
    are. After each pair of messages it answers how long they waited, as a worker answers a step."""
    import vllm_server
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    vllm_server.tune_cpu_server_process()
    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    for _ in range(pairs):
        first_sent = queue.dequeue()
        first_waited = time.perf_counter() - first_sent
        second_sent = queue.dequeue()
        answers.send(max(first_waited, time.perf_counter() - second_sent))


def test_a_waiting_queue_reader_finds_a_message_whose_notification_was_lost():
    # vLLM's queue announces each message on a socket that drops an announcement sent within ~1 ms of the one
    # before; a reader waiting on that socket found such a message only at vLLM's 5 s re-check, while its
    # writer waited for an answer: a server's requests stalled in multiples of 5 s
    import multiprocessing
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    spawn, pairs = multiprocessing.get_context("spawn"), 60
    queue, (answers, answer) = MessageQueue(n_reader=1, n_local_reader=1), spawn.Pipe(duplex=False)
    reader = spawn.Process(target=read_pairs, args=(queue.export_handle(), pairs, answer))
    reader.start()
    waits = []
    try:
        queue.wait_until_ready()
        for k in range(pairs):
            time.sleep(0.005)  # the reader is past its short spin: it waits on the socket
            queue.enqueue(time.perf_counter())
            gap = time.perf_counter() + (k % 10) * 100e-6  # 0-1 ms later: the reader may have looked already,
            while time.perf_counter() < gap:  # and the second announcement is dropped
                pass
            queue.enqueue(time.perf_counter())
            assert answers.poll(30), "the reader did not answer"
            waits.append(answers.recv())
    finally:
        reader.kill()
        reader.join()
    assert max(waits) < 1.0, f"a message waited {max(waits):.2f} s for a reader with nothing else to do ({waits})"


def test_small_requests_and_pushes_never_wait_for_a_lost_notification(setup):
    # a waiting reader of vLLM's message queues can miss the notification of a message; vLLM finds it
    # again only after 5 s, so an idle-waiting server would stall requests in multiples of 5 s
    client, _, prompts, sync, _ = setup
    requests, pushes = [], []
    for i in range(30):
        t = time.perf_counter()
        client.generate(prompts[:1], n=4, max_tokens=16, seed=i)
        requests.append(time.perf_counter() - t)
    for _ in range(10):
        t = time.perf_counter()
        sync.push()
        pushes.append(time.perf_counter() - t)
    assert max(requests) < 2.5 and max(pushes) < 2.5, (
        f"slowest request {max(requests):.2f} s, slowest push {max(pushes):.2f} s: a stall (each is ~0.1 s)")


FAULTS_PER_CYCLE = """
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
import vllm_server  # in a process of a CPU server (NANOGRPO_CPU_SERVER=1) this tunes it as the server's own are

def cycle():  # a push's pattern: a 64 MB bucket filled by a cast, some layer-sized blocks
    source = torch.ones(32 * 2**20, dtype=torch.float32)
    bucket = torch.empty(64 * 2**20, dtype=torch.uint8)
    bucket.view(torch.bfloat16).copy_(source)
    layers = [torch.empty(k * 2**20, dtype=torch.uint8).fill_(1) for k in (3, 17, 40)]

for _ in range(8):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 4)
"""


def page_faults_per_cycle(**env) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_CYCLE, ROOT], capture_output=True, text=True, check=True,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    return int(out.stdout.split()[-1])


def test_a_cpu_servers_processes_reuse_freed_memory():
    # glibc gives blocks over 32 MB back to the kernel when they are freed, so each push would fault in
    # every bucket and layer afresh (one fault per 4 KiB page: ~60k per cycle here)
    # (NANOGRPO_VLLM_POLLING=1: the polling patch stays out, which would import vLLM; only the memory tuning runs)
    plain = page_faults_per_cycle(NANOGRPO_CPU_SERVER=None)
    tuned = page_faults_per_cycle(NANOGRPO_CPU_SERVER="1", NANOGRPO_VLLM_POLLING="1")
    users = page_faults_per_cycle(NANOGRPO_CPU_SERVER="1", NANOGRPO_VLLM_POLLING="1",
                                  MALLOC_MMAP_THRESHOLD_=str(32 * 2**20))  # theirs wins
    assert plain > 10_000 and users > 10_000, (plain, users)
    assert tuned < 1_000, f"{tuned} page faults per cycle in a tuned process, {plain} in a plain one"


class FirstTurnCalls:
    """The real client, except that every trajectory's first turn is `ids` (a call to add: the tiny random model
    never writes one), with no sampler log-probs; later turns are the server's samples."""

    def __init__(self, client, ids: list[int]):
        self.client, self.ids, self.requests = client, ids, 0

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        self.requests += 1
        if self.requests == 1:
            return [dict(token_ids=self.ids, logprobs=[math.nan] * len(self.ids), finish_reason="stop")] * len(prompts)
        return self.client.generate_each(prompts, max_tokens, seeds, **sampling)


def test_multi_turn_trajectories_are_token_exact(setup):
    """A call, the tool's answer, and a second turn the server samples from the trajectory's token ids. The trainer's
    log-probs of the model's second turn equal the sampler's (it was sampled from exactly the tokens the trainer
    sees), and the server re-scoring whole trajectories agrees with the trainer on every model token, in fp32."""
    from rollout import RolloutContext, collate
    from helpers import add
    from tools import tool_rollout
    client, model, _, sync, initial = setup
    model.load_state_dict(initial, strict=False)
    sync.push()  # the server has the weights of `model` (earlier tests here pushed others)
    tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    call = tokenizer('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')["input_ids"]
    ctx = RolloutContext(FirstTurnCalls(client, call + [tokenizer.eos_token_id]), tokenizer, 3,
                         dict(max_tokens=64, temperature=1.0), seed=5)
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": [{"role": "user", "content": "Add 2 and 3."}]}]
    episodes = tool_rollout(rows, ctx, tools=[add], max_iterations=2)
    assert len(episodes) == 6 and ctx.client.requests >= 2
    for e in episodes:
        assert e.messages[0]["tool_calls"] == [{"type": "function", "id": "call00000", "function": {
            "name": "add", "arguments": {"a": 2, "b": 3}}}]
        assert e.messages[1] == {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "5"}
        first = len(call) + 1
        answer = e.sampled.index(True, first)  # the tool's answer and the next turn's start: not the model's
        assert not any(e.sampled[first:answer]) and all(e.sampled[:first])
        assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(e.completion_ids[first:answer])
        assert e.info["tool_calls"] >= 1 and not e.info["template_rewrote_history"]
    inputs, tokens = collate(episodes, 0)
    with torch.no_grad():
        ours = completion_logprobs(model, inputs, tokens["mask"].shape[1], 1.0)[0]
    sampled = tokens["sampled"].bool() & ~tokens["sampler_logp"].isnan()  # the server's samples: the later turns
    assert sampled.sum() > 0 and (ours - tokens["sampler_logp"]).abs()[sampled].max() < 1e-4
    for i, e in enumerate(episodes[:2]):  # re-scored on the server: every token the model wrote, the call too
        theirs = torch.tensor(client.prompt_logprobs(e.prompt_ids + e.completion_ids)[len(e.prompt_ids) - 1:])
        model_tokens = torch.tensor(e.sampled)
        assert (ours[i, :len(theirs)] - theirs).abs()[model_tokens].max() < 1e-4


# ----------------------------------------------------------------------------- LoRA adapters (POST /load_adapter)

@pytest.fixture(scope="module")
def adapters(server) -> dict[int, bytes]:
    """Adapters of the tiny model as the trainer pushes them (weight_sync.AdapterWeights), by rank: 4, and 32 (above
    the session server's --max-lora-rank 16)."""
    from models import add_lora
    from weight_sync import AdapterWeights
    made = {}
    for r in (4, 32):
        lora = add_lora(AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32), r, 16.0, 0.0,
                        "all-linear")
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        made[r] = AdapterWeights(lora).payload(is_main=True)
    return made


def served(port: int) -> dict[str, str]:
    """{name: folder} of the adapters the server serves (/v1/models lists each one's folder as its root)."""
    import requests
    cards = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
    return {card["id"]: card["root"] for card in cards if card.get("parent")}


def test_pushes_replace_unload_and_delete_only_the_servers_own_adapters(server, adapters):
    """A user's adapter (--lora-modules user=FOLDER) survives any number of pushes, computing as before from its
    folder as it was, and a push under its name is refused (409: the run stops saying so). Of its own adapters, a push
    keeps the newest K of its series (policy-N: one run's) and leaves other series alone; the folder of an adapter it
    unloads or replaces is removed. Before, a push unloaded every adapter but the newest K, the user's too, and
    deleted its folder; a replaced adapter's folder stayed behind."""
    from config import RunStopped
    client = VLLMClient(port=server["port"])
    client.wait_for_health(30)
    base, probe, user = client.model_name, list(range(100, 140)), server["user_adapter"]

    def logprobs_of(name: str) -> list[float]:
        client.model_name = name
        return client.prompt_logprobs(probe)
    user_files = {name: open(os.path.join(user, name), "rb").read() for name in os.listdir(user)}
    before = logprobs_of("user")
    assert max(abs(a - b) for a, b in zip(before, logprobs_of(base))) > 1e-3  # the user's adapter is in them
    client.load_adapter("other-0", adapters[4], keep=1)  # another run's series
    folders = []
    for k in range(6):
        client.load_adapter(f"test-{k}", adapters[4], keep=2)
        folders.append(served(server["port"])[f"test-{k}"])
    now = served(server["port"])
    assert {"user", "other-0", "test-4", "test-5"} <= set(now) and not {f"test-{k}" for k in range(4)} & set(now), now
    assert now["user"] == user and [os.path.isdir(f) for f in folders] == [False] * 4 + [True] * 2
    client.load_adapter("test-5", adapters[4], keep=2)  # the same name again: in place, from a new folder
    replaced = served(server["port"])["test-5"]
    assert replaced != folders[5] and os.path.isdir(replaced) and not os.path.exists(folders[5])
    with pytest.raises(RunStopped, match=r"^the vLLM server refused the LoRA adapter user \(409\): the server serves "
                                         "an adapter named user that it did not write"):
        client.load_adapter("user", adapters[4])
    assert logprobs_of("user") == before and served(server["port"])["user"] == user
    assert {name: open(os.path.join(user, name), "rb").read() for name in os.listdir(user)} == user_files


def test_an_adapter_the_server_refuses_stops_the_run_in_one_line_with_the_reason(server, adapters):
    """A rank above --max-lora-rank, a body that is no adapter, a cut one, one above --max-adapter-mb (sent whole or
    streamed): 4xx with the reason, which stops the run in one line (RunStopped: exit 3); a ?keep= or ?name= that is
    not one: 400. The server keeps none of them, and still samples. Before, vLLM's refusal answered 500 (read as a
    lost server: the trainer pushed again for --vllm_server_timeout), and so did ?keep=² ("²".isdigit())."""
    import requests
    from config import RunStopped
    client = VLLMClient(port=server["port"])
    client.wait_for_health(30)
    url = f"{client.base}/load_adapter"
    cases = [("big-0", adapters[32], 422, "LoRA rank 32 is greater than max_lora_rank 16."),
             ("bad-0", b"not an adapter", 400, "the body is not a peft adapter as the trainer sends it"),
             ("cut-0", adapters[4][:len(adapters[4]) // 2], 422, ""),
             ("huge-0", bytes(17 * 2**20), 413, "the adapter is 17.0 MB, above the server's --max-adapter-mb 16")]
    for name, body, status, reason in cases:
        with pytest.raises(RunStopped) as refused:
            client.load_adapter(name, body)
        assert str(refused.value).startswith(f"the vLLM server refused the LoRA adapter {name} ({status}): {reason}")
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 600, str(refused.value)
    streamed = requests.post(url, params={"name": "huge-1"}, data=(bytes(2**20) for _ in range(17)), timeout=60)
    assert streamed.status_code == 413 and "above the server's --max-adapter-mb 16" in streamed.text
    for params in ({"name": "x-0", "keep": "²"}, {"name": "x-0", "keep": "0"}, {"name": "x-0", "keep": "65"},
                   {"name": "x-0", "keep": "9" * 5000}, {"name": "../x"}, {"name": ""}):
        answer = requests.post(url, params=params, data=adapters[4], timeout=60)
        assert answer.status_code == 400 and "?keep= (a count from 1 to 64)" in answer.text, (params, answer.text)
    assert not {"big-0", "bad-0", "cut-0", "huge-0", "huge-1", "x-0"} & set(served(server["port"]))
    assert client.healthy() and len(client.generate([[100, 200]], n=2, max_tokens=4)) == 2
