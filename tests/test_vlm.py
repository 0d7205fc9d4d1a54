"""Vision-language models: image inputs through the episode, the batch, the checkpoint and the forward."""
import json
from functools import partial

import pytest
import torch


def image_episode(prompt_ids, completion_ids, **model_inputs):
    from rollout import sampled_episode
    e = sampled_episode({}, prompt_ids, completion_ids, [-0.5] * len(completion_ids))
    e.model_inputs = model_inputs
    return e


def test_image_inputs_of_unequal_counts_are_padded_with_zero_images_and_a_bad_layout_is_refused():
    """A batch of prompts with one image, two, and none (Idefics3's pixel_values (1, images, 3, H, W)): each
    episode's images at its row's start, zeros elsewhere (Idefics3 skips all-zero images)."""
    from rollout import collate
    one, two = torch.rand(1, 1, 3, 8, 8) + 0.1, torch.rand(1, 2, 3, 8, 8) + 0.1
    episodes = [image_episode([5, 6], [7], pixel_values=one, pixel_attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.long)),
                image_episode([5], [7, 8], pixel_values=two, pixel_attention_mask=torch.ones(1, 2, 8, 8, dtype=torch.long)),
                image_episode([5, 6, 9], [7])]
    inputs, _ = collate(episodes, pad_id=0)
    pv, pam = inputs["pixel_values"], inputs["pixel_attention_mask"]
    assert pv.shape == (3, 2, 3, 8, 8) and pam.shape == (3, 2, 8, 8) and pam.dtype == torch.long
    assert torch.equal(pv[0, 0], one[0, 0]) and not pv[0, 1].any() and torch.equal(pv[1], two[0]) and not pv[2].any()
    assert pam[0, 0].all() and not pam[0, 1].any() and pam[1].all() and not pam[2].any()
    flat = image_episode([5], [7], pixel_values=torch.rand(4, 3))  # Qwen2-VL-like: a row per patch
    with pytest.raises(ValueError, match="'pixel_values' has shape.*leading dimension 1"):
        collate([flat], pad_id=0)
    assert set(collate([image_episode([5], [7])], pad_id=0)[0]) == {"input_ids", "attention_mask"}  # text only


def test_a_batch_sampled_ahead_keeps_its_images_exactly_through_a_checkpoint():
    from rollout import episodes_to_json, presampled_from_json
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    episodes = [image_episode([5, 6], [7], pixel_values=torch.randn(1, 1, 3, 8, 8)),
                image_episode([5, 6], [8], pixel_values=torch.randn(1, 1, 3, 8, 8).to(torch.bfloat16)),
                image_episode([5], [9]), image_episode([5], [9, 10])]
    for e, row in zip(episodes, [rows[0]] * 2 + [rows[1]] * 2):
        e.row = row
    line = json.dumps([4, episodes_to_json(episodes)])
    version, back = presampled_from_json([line], rows, 0, 2)
    assert version == 4 and len(back) == 4
    for a, b in zip(episodes, back):
        assert a.model_inputs.keys() == b.model_inputs.keys()
        for k in a.model_inputs:
            assert a.model_inputs[k].dtype == b.model_inputs[k].dtype and torch.equal(a.model_inputs[k], b.model_inputs[k])
        assert (a.prompt_ids, a.completion_ids, a.row) == (b.prompt_ids, b.completion_ids, b.row)


def test_idefics3_logprobs_of_a_batch_equal_each_episodes_own_and_depend_on_the_image(tiny_vlm):
    """The one log-prob path (utils.completion_logprobs) on a tiny Idefics3: episodes with one image, two
    images and none, batched (padded prompts, zero images), equal each one computed alone to 1e-5; the same
    completion with another image gets other log-probs (the image is seen)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from rollout import collate
    from utils import completion_logprobs
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()

    def episode(images: list, question: str, completion: list[int]):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        enc = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        return image_episode(enc["input_ids"][0].tolist(), completion, **inputs)

    red, blue = Image.new("RGB", (40, 30), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))
    episodes = [episode([red], "What colour is it?", [100, 200, 300]),
                episode([blue, red], "Which is red?", [400, 500]),
                episode([], "Say hi.", [600, 700, 800, 900])]
    image_tokens = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert [e.prompt_ids.count(image_tokens) for e in episodes] == [16, 32, 0]  # (64 / 8 / 2)^2 per image

    def logprobs(batch):
        inputs, tokens = collate(batch, pad_id=2)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, inputs, tokens["mask"].shape[1], 1.0)
        return [logp[i, :len(e.completion_ids)] for i, e in enumerate(batch)]

    together = logprobs(episodes)
    for e, lp in zip(episodes, together):
        assert torch.allclose(lp, logprobs([e])[0], atol=1e-5, rtol=0)
    swapped = episode([blue], "What colour is it?", [100, 200, 300])
    assert (logprobs([swapped])[0] - together[0]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm, tmp_path_factory):
    from conftest import running_server
    with running_server(tiny_vlm, tmp_path_factory.mktemp("vlm-server") / "server.log") as s:
        yield s


def test_the_server_samples_with_the_image_and_the_trainer_scores_what_it_sampled(vlm_server, tiny_vlm):
    """The VLM rollout through the real server's chat route: its prompt ids are the processor's; the trainer's
    log-probs of the sampled tokens (fp32, the same images) equal the server's to 1e-4, and differ by more than
    1e-2 with the image swapped or removed on the trainer's side (what a dropped image would look like)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from rollout import RolloutContext, collate, run_rollout
    from utils import completion_logprobs
    from vision import load_processor, vision_rollout
    from vllm_server import VLLMClient
    processor = load_processor(tiny_vlm)
    assert processor is not None and load_processor(vlm_server["model"]) is not None
    red, blue = Image.new("RGB", (50, 40), (230, 20, 20)), Image.new("RGB", (64, 64), (20, 20, 230))
    rows = [{"prompt": "What colour is this?", "image": red},
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And these?"},
                                                      {"type": "image"}]}], "images": [blue, red]},
            {"prompt": "No picture here."}]
    ctx = RolloutContext(VLLMClient(port=vlm_server["port"]), processor.tokenizer, 3,
                         dict(max_tokens=12, temperature=1.0), seed=5)
    episodes = run_rollout(partial(vision_rollout, processor=processor), rows, ctx)
    assert [e.model_inputs["pixel_values"].shape[1] if e.model_inputs else 0 for e in episodes] == [1] * 3 + [2] * 3 + [0] * 3
    assert all(len(e.completion_ids) == len(e.logprobs) > 0 for e in episodes)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()

    def worst_difference(batch):
        inputs, tokens = collate(batch, pad_id=2)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, inputs, tokens["mask"].shape[1], 1.0)
        return max((logp[i, :len(e.logprobs)] - torch.tensor(e.logprobs)).abs().max().item() for i, e in enumerate(batch))

    assert worst_difference(episodes) < 1e-4
    first = episodes[0]
    from vision import encode_vision_prompt, with_image_parts
    for images in ([blue], []):  # the same tokens, the other image (or none) on the trainer's side only
        messages = with_image_parts([{"role": "user", "content": "What colour is this?"}], len(images))
        ids, inputs = encode_vision_prompt(processor, messages, images)
        other = type(first)(first.row, ids, first.completion_ids, first.sampled, first.logprobs, first.finish_reason,
                            model_inputs=inputs)
        assert worst_difference([other]) > 1e-2, images
