"""Shared fixtures: a tiny random model with the SmolLM2 tokenizer, and the real vLLM server on it."""
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# Every process the tests start inherits this mark, wherever it ends up (torchrun's ranks and vLLM's workers run in
# sessions of their own): after the session, one still running is found by it, killed and listed.
os.environ["NANOGRPO_TEST_SUITE"] = str(os.getpid())


def die_with_parent():
    """preexec_fn of a process a test starts: SIGTERM when the test process dies, even by SIGKILL (Linux)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run(cmd: list[str], timeout: float, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for a command that may start a process tree (torchrun
    and its ranks, a script and its server): in a session of its own, and stopped whole on every way out, a
    time-out or an interrupted test too (subprocess.run would kill the first process only)."""
    also = kwargs.pop("preexec_fn", None) or (lambda: None)  # e.g. a resource limit
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env, preexec_fn=lambda: (die_with_parent(), also()), **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_all(cmds: list[list[str]], timeout: float, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """run() of each command, all at once (for short ones that mostly import: they overlap on the cores)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
        return list(pool.map(lambda cmd: run(cmd, timeout, env), cmds))


def left_running() -> list[tuple[int, str]]:
    """(pid, command line) of the processes this test session started that still run (zombies aside)."""
    mark, found = f"NANOGRPO_TEST_SUITE={os.getpid()}".encode(), []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if "multiprocessing.resource_tracker" not in command:  # ends with this process
            found.append((pid, command))
    return found


RUNNING = {"slow": True}  # whether the test being set up is marked slow


def pytest_runtest_setup(item):  # before its fixtures, a session's server among them
    RUNNING["slow"] = item.get_closest_marker("slow") is not None


def pytest_configure(config):
    def interrupted(signum, frame):  # a test run stopped with SIGTERM tears its fixtures (servers) down, as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)


def pytest_sessionfinish(session, exitstatus):
    deadline = time.monotonic() + 15  # a process killed by a fixture's teardown may still be on its way out
    while (left := left_running()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:  # a test or fixture that does not stop what it started: the run fails
        print("\nprocesses started by the tests were still running after them (killed now; the run fails):\n"
              + "\n".join(f"  {pid} {command[:200]}" for pid, command in left), file=sys.stderr)
        session.exitstatus = 1


def free_port() -> int:
    import utils
    return utils.free_ports()[0]


def stop(proc: subprocess.Popen):
    """Stop exactly the process group we started (the server's workers included)."""
    import utils
    utils.stop_process_group(proc)


def collated(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0):
    """Model inputs and completion mask of (prompt, completion) token lists, as rollout.collate makes them."""
    from rollout import collate, sampled_episode
    inputs, tokens = collate([sampled_episode({}, p, c) for p, c in zip(prompts, completions)], pad_id)
    return inputs, tokens["mask"]


def make_tiny_model(path, num_heads: int = 1, max_positions: int = 1024) -> str:
    """A random 2-layer Llama (head_dim 64: vLLM's CPU attention rejects 16) with tied embeddings and the
    SmolLM2 tokenizer; 3 M parameters with one head."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from embedded import default_model_path
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads, head_dim=64,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # one constant hidden dimension, and EOS favoured along it: P(EOS) ~ 0.1 per token, so
        E = model.model.embed_tokens.weight  # completions end at different lengths and brevity is learnable
        E[:, 0] = 1.0
        E[config.eos_token_id, 0] = 2.1
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


VLM_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
                "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                "<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_vlm(path, image_size: int = 64) -> str:
    """A random Idefics3 (SmolVLM's architecture): the tiny Llama above as its language model, a 2-layer
    vision tower on image_size^2 images in patches of 8, pixel shuffle by 2 (image_size^2 / 256 image tokens
    per image), and the SmolLM2 tokenizer with Idefics3's image tokens; an image processor that resizes to
    image_size without splitting."""
    import torch
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor)
    from embedded import default_model_path
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    tokenizer.chat_template = VLM_TEMPLATE
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    config = Idefics3Config(text_config=text, vision_config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, image_size=image_size,
        patch_size=8), scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True, pad_token_id=2)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # as make_tiny_model: EOS favoured along one dimension
        E = model.model.text_model.embed_tokens.weight
        E[:, 0] = 1.0
        E[2, 0] = 2.1
    model.save_pretrained(path)
    image_processor = Idefics3ImageProcessor(size={"longest_edge": image_size},
                                             max_image_size={"longest_edge": image_size}, do_image_splitting=False)
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=(image_size // 16) ** 2,
                      chat_template=VLM_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> str:
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_positions=2048)  # as the benches' engines need


@contextlib.contextmanager
def running_server(model: str, log_path, *extra: str, port: int | None = None):
    """The real vllm_server.py on a free loopback port (or `port`), fp32 so log-probs can be compared
    tightly; stopped (its whole process group) on exit, also when the test fails. Only for a test marked slow:
    README's `-m "not slow"` runs no server."""
    if not RUNNING["slow"]:
        raise RuntimeError("this test starts the vLLM server: mark it @pytest.mark.slow")
    port = port or free_port()
    log = open(log_path, "w+")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "vllm_server.py"), "--model", model, "--port", str(port),
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            preexec_fn=die_with_parent)
    from config import UsageError
    from vllm_client import VLLMClient
    client = VLLMClient(port=port, api_key=extra[extra.index("--api-key") + 1] if "--api-key" in extra else None)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.wait_for_health(timeout=2)
                break
            except UsageError:  # not answering yet
                pass
        if proc.poll() is not None or client.model_name is None:
            log.seek(0)
            raise RuntimeError("vllm_server.py did not start:\n" + log.read()[-5000:])
        yield {"port": port, "model": model, "proc": proc}
    finally:
        stop(proc)
        log.close()


def make_tiny_adapter(model: str, path, r: int = 4) -> str:
    """A peft LoRA adapter of `model` in `path`, its B random (it changes the outputs), as a user brings one."""
    import torch
    from transformers import AutoModelForCausalLM
    from models import add_lora
    torch.manual_seed(r)
    lora = add_lora(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), r, 16.0, 0.0, "q_proj,v_proj")
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()
    lora.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """The server on the tiny model, shared by the tests of a session; with LoRA on, as run.sh starts it for
    --use_peft (a LoRA run pushes its adapter alone, unless --lora_sync merged), serving a user's adapter `user`
    (--lora-modules: the pushes must leave it and its folder as they are) and taking adapters up to 16 MB."""
    user = make_tiny_adapter(tiny_model, tmp_path_factory.mktemp("user-adapter"))
    with running_server(tiny_model, tmp_path_factory.mktemp("server") / "server.log", "--enable-lora",
                        "--max-lora-rank", "16", "--lora-modules", f"user={user}", "--max-adapter-mb", "16") as s:
        yield {**s, "user_adapter": user}


def train_args(server, out, *args) -> list[str]:
    return [os.path.join(ROOT, "train.py"), "--model", server["model"], "--vllm_server_port", str(server["port"]),
            "--vllm_group_port", str(free_port()), "--output_dir", str(out), "--eval_steps", "0", *args]  # evaluate where asked


def launcher(nproc: int) -> list[str]:
    """torchrun with `nproc` processes on a free rendezvous port, or plain python for one."""
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
            if nproc > 1 else [sys.executable])


def run_train(server, out, *args, nproc=2, check=True, env=None, **kwargs):
    """train.py on the tiny model against `server`: under torchrun with `nproc` processes (gloo), or plain
    python for 1. Returns the process and the metrics of each step (or only the process, if not `check`)."""
    proc = run([*launcher(nproc), *train_args(server, out, *args)], timeout=900,
               env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), **kwargs)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, [json.loads(line) for line in open(out / "metrics.jsonl")]
