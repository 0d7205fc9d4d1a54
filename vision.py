"""Vision-language models (README: Vision-language models): prompts with images.

A row's images (its `images` column, a list, or `image`, one: PIL images, file paths or bytes, as TRL
takes them) go into its prompt as `{"type": "image"}` parts before the first user text, as TRL places
them. The model's processor renders the prompt once: the expanded token ids (each image as the model's
image tokens) are the episode's prompt_ids, and the pixel inputs (Idefics3: pixel_values and
pixel_attention_mask) its model_inputs, which every forward gets through the inputs dict. The server
samples through its chat route, the one that takes images (/v1/completions silently drops them), with
the images as data URLs; it answers with the prompt ids it expanded, which must equal the processor's.
"""
import base64
import concurrent.futures
import io

from rollout import Episode, RolloutContext
from utils import prompt_messages

IMAGE_COLUMNS = ("images", "image")


def load_processor(model_path: str):
    """The model's processor if it is a vision-language model's (it has an image processor), else None."""
    from transformers import AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except (OSError, ValueError, KeyError, ImportError):  # a tokenizer-only folder
        return None
    return processor if getattr(processor, "image_processor", None) is not None else None


def row_images(row: dict) -> list:
    """A row's images as RGB PIL images: its `images` column (a list) or `image` (one, or a list); each a
    PIL image, a file path, bytes, or {"bytes": ..., "path": ...} (a datasets Image not decoded). ValueError
    saying which one cannot be read."""
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
            out.append(item.convert("RGB"))
        except (OSError, ValueError) as e:
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


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes the pixels the trainer has
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def server_messages(messages: list[dict], images: list) -> list[dict]:
    """The messages as the chat route takes them: each image part an image_url with the next image."""
    images = iter(images)
    return [{**m, "content": [{"type": "image_url", "image_url": {"url": data_url(next(images))}}
                              if part.get("type") == "image" else part for part in m["content"]]} for m in messages]


def vision_rollout(rows: list[dict], ctx: RolloutContext, processor=None) -> list[Episode]:
    """The rollout of a vision-language model (rollout.py's contract): G samples of each row's prompt with its
    images, one chat request per row, all rows at once (their requests meet in the server's batches)."""
    prompts = []
    for i, row in enumerate(rows):
        images = row_images(row)
        messages = with_image_parts(prompt_messages(row["prompt"], ctx.system_prompt), len(images))
        prompts.append((*encode_vision_prompt(processor, messages, images), server_messages(messages, images)))

    def sample(i):
        return ctx.client.chat(prompts[i][2], n=ctx.num_generations, seed=ctx.seed, **ctx.sampling)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(rows))) as pool:
        answers = list(pool.map(sample, range(len(rows))))
    episodes = []
    for i, ((ids, inputs, _), (server_ids, samples)) in enumerate(zip(prompts, answers)):
        if server_ids != ids:
            raise ValueError(f"the server rendered the prompt of row {i} with its images as {len(server_ids)} tokens, "
                             f"the processor as {len(ids)} (first difference at token "
                             f"{next((k for k, (a, b) in enumerate(zip(server_ids, ids)) if a != b), min(len(ids), len(server_ids)))}"
                             "): the server must process images as the model folder's processor does; start it "
                             "without --mm-processor-kwargs or --chat-template of its own")
        episodes += [Episode(rows[i], ids, s["token_ids"], [True] * len(s["token_ids"]), s["logprobs"],
                             s["finish_reason"], model_inputs=inputs) for s in samples]
    return episodes
