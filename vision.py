"""Vision-language models (README: Vision-language models): prompts with images.

A row's images (its `images` column, a list, or `image`, one: PIL images, file paths or bytes, as TRL
takes them) go into its prompt as `{"type": "image"}` parts before the first user text, as TRL places
them. The model's processor renders the prompt once: the expanded token ids (each image as the model's
image tokens) are the episode's prompt_ids, and the pixel inputs (Idefics3: pixel_values and
pixel_attention_mask) its model_inputs, which every forward gets through the inputs dict. The server
samples through its chat route, the one that takes images (/v1/completions silently drops them), with
the images as data URLs; it answers with the prompt ids it expanded, which must equal the processor's.
Also here: load_tokenizer, the processor (a VLM's) and tokenizer every run loads, with --chat_template.
"""
import base64
import concurrent.futures
import io

from config import UsageError
from data import encode_prompts, prompt_messages
from rollout import Episode, RolloutContext, slot_seed
from tools import read_chat_template
from weight_sync import Probe

IMAGE_COLUMNS = ("images", "image")
ARCHITECTURES = ("idefics3", "smolvlm")  # pixel_values (prompts, images, 3, H, W), served by vLLM's CPU build


def load_processor(model_path: str, chat_template: str = "", vision_learning_rate: float = 0.0):
    """The model's processor if it is a vision-language model's (it has an image processor), else None.
    UsageError for a VLM of an architecture nanogrpo does not train (yet), or with a --chat_template of its
    own (the server renders a VLM's prompts with the folder's template, which the trainer's must equal)."""
    from transformers import AutoConfig, AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except (OSError, ValueError, KeyError, ImportError):  # a tokenizer-only folder
        processor = None
    if getattr(processor, "image_processor", None) is None:
        if vision_learning_rate:
            raise UsageError("--vision_learning_rate: this model has no vision tower that trains (a text-only model); "
                             "drop the flag")
        return None
    model_type = AutoConfig.from_pretrained(model_path).model_type
    if model_type not in ARCHITECTURES:
        raise UsageError(f"{model_path} is a vision-language model of type {model_type!r}; nanogrpo trains "
                         f"{' and '.join(ARCHITECTURES)} models (SmolVLM) for now, whose image inputs hold one row "
                         "per prompt")
    if chat_template:
        raise UsageError(f"--chat_template {chat_template} with a vision-language model: the server renders its "
                         "prompts (with the images) by the model folder's template, and the trainer's must be the "
                         f"same; put the template in {model_path} (chat_template.jinja) and drop --chat_template")
    return processor


def load_tokenizer(cfg, model_path: str):
    """The model's processor (a vision-language model's; else None) and its tokenizer, with --chat_template if
    given (e.g. a template that renders tools, for a model whose own cannot)."""
    from transformers import AutoTokenizer
    processor = load_processor(model_path, cfg.chat_template, cfg.vision_learning_rate)
    tokenizer = processor.tokenizer if processor else AutoTokenizer.from_pretrained(model_path)
    if cfg.chat_template:
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    return processor, tokenizer


def longest_edge(processor) -> int | None:
    """The longest image side the processor works at (Idefics3: size["longest_edge"]); larger images are
    scaled down to it before either side sees them."""
    # A dict, or transformers' SizeDict.
    size = getattr(getattr(processor, "image_processor", None), "size", None)
    return size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)


def row_images(row: dict, longest_edge: int | None = None) -> list:
    """A row's images as RGB PIL images: its `images` column (a list) or `image` (one, or a list); each a
    PIL image, a file path, bytes, or {"bytes": ..., "path": ...} (a datasets Image not decoded). ValueError
    saying which one cannot be read. With `longest_edge`, a larger image is scaled down to it (aspect kept),
    so the trainer and the server get the same bounded picture (a huge one would stall the server's
    decoding)."""
    from PIL import Image
    column = next((c for c in IMAGE_COLUMNS if row.get(c) is not None), None)
    if column is None:
        return []
    value = row[column]
    out = []
    for k, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
        try:
            if isinstance(item, dict):
                item = item.get("bytes") or item.get("path")
            if isinstance(item, (bytes, bytearray)):
                item = Image.open(io.BytesIO(item))
            elif isinstance(item, str):
                item = Image.open(item)
            if not isinstance(item, Image.Image):
                raise ValueError(f"it is a {type(item).__name__}, not an image, a path or bytes")
            item = item.convert("RGB")
            if longest_edge and max(item.size) > longest_edge:
                scale = longest_edge / max(item.size)
                item = item.resize((max(1, round(item.width * scale)), max(1, round(item.height * scale))),
                                   Image.Resampling.LANCZOS)
            out.append(item)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise ValueError(f"column {column!r}, image {k}: cannot read it ({e})") from None
    return out


def with_image_parts(messages: list[dict], num_images: int) -> list[dict]:
    """The messages with num_images {"type": "image"} parts before the first user message's text (TRL's
    place for them), unless they hold image parts already (then as many as there are images)."""
    messages = [{**m, "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str)
                 else list(m["content"])} for m in messages]
    given = sum(part.get("type") == "image" for m in messages for part in m["content"])
    if given:
        if given != num_images:
            raise ValueError(f"the prompt has {given} image parts but the row {num_images} images")
        return messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[first]["content"] = [{"type": "image"}] * num_images + messages[first]["content"]
    return messages


def encode_vision_prompt(processor, messages: list[dict], images: list) -> tuple[list[int], dict]:
    """The processor's rendering of a prompt with its images: (the expanded token ids, the model's pixel
    inputs as tensors with a leading dimension of 1)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    enc = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    return enc["input_ids"][0].tolist(), {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}


def image_token_counts(processor):
    """A function: an image's size (width, height) -> the tokens the processor expands it to, each size
    counted once (from the processor's own formula where it has one, as vLLM does, else by rendering a blank
    image)."""
    from PIL import Image
    counts, image_token = {}, getattr(processor, "image_token", "<image>")
    plain = len(processor.tokenizer(image_token, add_special_tokens=False)["input_ids"])

    def count(size):
        if size not in counts:
            try:  # the processor takes (height, width)
                counts[size] = processor._get_num_multimodal_tokens(image_sizes=[size[::-1]])["num_image_tokens"][0]
            except (AttributeError, KeyError, TypeError, NotImplementedError):
                ids = processor(text=[image_token], images=[[Image.new("RGB", size)]])["input_ids"][0]
                counts[size] = len(ids) - plain + 1
        return counts[size]
    return count


def prompt_lengths(tokenizer, processor, rows: list[dict], system_prompt: str = "", tools=None) -> list[int]:
    """Each row's prompt length in tokens as the model sees it, image tokens included. Every image is read
    now: a row whose image cannot be read, or a dataset with images for a model without an image processor, is
    a UsageError naming it (so a run does not fail on it hours in)."""
    sizes, prompts = [], []  # each row's image sizes, (width, height): the images themselves are not kept
    for i, row in enumerate(rows):
        try:
            sizes.append([image.size for image in row_images(row, longest_edge(processor))])
            if processor is not None:  # the prompt with an image part per image
                prompts.append(with_image_parts(prompt_messages(row["prompt"], system_prompt), len(sizes[-1])))
        except ValueError as e:
            raise UsageError(f"dataset row {i}: {e}; fix or drop that row") from None
        if sizes[-1] and processor is None:
            raise UsageError(f"the dataset has images (row {i}) but the model has no image processor: it is a "
                             "text-only model. Use a vision-language model (e.g. SmolVLM), or drop the "
                             f"{'/'.join(IMAGE_COLUMNS)} column")
    if processor is None:
        return list(map(len, encode_prompts(tokenizer, [r["prompt"] for r in rows], system_prompt, tools)))
    count = image_token_counts(processor)
    texts = [processor.apply_chat_template(m, add_generation_prompt=True) for m in prompts]
    return [len(processor.tokenizer(text, add_special_tokens=False)["input_ids"]) + sum(count(size) - 1 for size in s)
            for text, s in zip(texts, sizes)]


def probe_image():
    """A fixed picture for the sync probe of a VLM whose first row has none: colour bands, no two pixels
    alike."""
    from PIL import Image
    return Image.frombytes("RGB", (64, 64), bytes((x * 4 + c * 85 + y) % 256 for y in range(64) for x in range(64)
                                                  for c in range(3)))


def vision_probe(processor, row: dict, system_prompt: str = "", answer: str = "") -> Probe:
    """The sync probe of a VLM: a row's prompt with its images (or a fixed picture) and a fixed answer, which
    the server scores through the chat route, so that a stale vision-encoder cache or a dropped image
    shows."""
    images = row_images(row, longest_edge(processor)) or [probe_image()]
    messages = with_image_parts(prompt_messages(row["prompt"], system_prompt), len(images))
    messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = processor.apply_chat_template(messages, continue_final_message=True)
    enc = processor(text=[text], images=[images], return_tensors="pt")
    pixels = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    return Probe(enc["input_ids"][0].tolist(), pixels, server_messages(messages, images))


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes the pixels the trainer has
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def server_messages(messages: list[dict], images: list) -> list[dict]:
    """The messages as the chat route takes them: each image part an image_url with the next image."""
    images = iter(images)
    return [{**m, "content": [{"type": "image_url", "image_url": {"url": data_url(next(images))}}
                              if part.get("type") == "image" else part for part in m["content"]]} for m in messages]


def vision_rollout(rows: list[dict], ctx: RolloutContext) -> list[Episode]:
    """The rollout of a vision-language model (rollout.py's contract): G samples of each row's prompt with its
    images, one chat request per row, all rows at once (their requests meet in the server's batches)."""
    prompts, processor = [], ctx.processor
    for i, row in enumerate(rows):
        images = row_images(row, longest_edge(processor))
        messages = with_image_parts(prompt_messages(row["prompt"], ctx.system_prompt), len(images))
        prompts.append((*encode_vision_prompt(processor, messages, images), server_messages(messages, images)))

    def sample(i):  # a seed per row: prompts that differ only in their images must not draw the same samples
        return ctx.client.chat(prompts[i][2], n=ctx.num_generations, seed=slot_seed(ctx.seed, i), **ctx.sampling)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(rows))) as pool:
        answers = list(pool.map(sample, range(len(rows))))
    episodes = []
    for i, ((ids, inputs, _), (server_ids, samples)) in enumerate(zip(prompts, answers)):
        if server_ids != ids:
            first = next((k for k, (a, b) in enumerate(zip(server_ids, ids)) if a != b), min(len(ids), len(server_ids)))
            raise ValueError(f"the server rendered the prompt of row {i} with its images as {len(server_ids)} tokens, "
                             f"the processor as {len(ids)} (first difference at token {first}): the server must "
                             "process images as the model folder's processor does; start it without "
                             "--mm-processor-kwargs or --chat-template of its own")
        episodes += [Episode(rows[i], ids, s["token_ids"], [True] * len(s["token_ids"]), s["logprobs"],
                             s["finish_reason"], model_inputs=inputs) for s in samples]
    return episodes
