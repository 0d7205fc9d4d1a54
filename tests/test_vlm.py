"""Vision-language models: image inputs through the episode, the batch, the checkpoint and the forward."""
import dataclasses
import json
import os
import re

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
    pv, pam = inputs["pixel_values"].to("cpu"), inputs["pixel_attention_mask"].to("cpu")
    assert pv.shape == (3, 2, 3, 8, 8) and pam.shape == (3, 2, 8, 8) and pam.dtype == torch.long
    assert torch.equal(pv[0, 0], one[0, 0]) and not pv[0, 1].any() and torch.equal(pv[1], two[0]) and not pv[2].any()
    assert pam[0, 0].all() and not pam[0, 1].any() and pam[1].all() and not pam[2].any()
    flat = image_episode([5], [7], pixel_values=torch.rand(4, 3))  # Qwen2-VL-like: a row per patch
    with pytest.raises(ValueError, match="'pixel_values' has shape.*leading dimension 1"):
        collate([flat], pad_id=0)
    assert set(collate([image_episode([5], [7])], pad_id=0)[0]) == {"input_ids", "attention_mask"}  # text only
    per_token = image_episode([5], [7], token_type_ids=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="'token_type_ids'.*per token"):
        collate([per_token], pad_id=0)


def test_the_episodes_of_a_group_share_one_copy_of_their_images_and_a_micro_batch_makes_only_its_rows():
    """G episodes of a prompt share its pixel tensor (vision_rollout gives them one dict): the batch holds each
    prompt's images once, taking a micro-batch copies nothing, and its rows are the images of its episodes."""
    from logprobs import take, to_device
    from rollout import collate
    G, images = 4, [torch.rand(1, 1, 3, 8, 8) + 0.1 for _ in range(3)]
    episodes = [image_episode([5], [7], pixel_values=image) for image in images for _ in range(G)]
    inputs, _ = collate(episodes, pad_id=0)
    pv = inputs["pixel_values"]
    assert pv.shape == (3 * G, 1, 3, 8, 8) and pv.values.shape[0] <= 3 + 1  # one per prompt (and the zero image)
    part = take(inputs, torch.tensor([1, 5, 11]))
    assert part["pixel_values"].values is pv.values  # nothing copied
    rows = to_device(part, "cpu")["pixel_values"]
    assert torch.equal(rows, torch.cat([images[0], images[1], images[2]]))


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
    shared = {"pixel_values": torch.randn(1, 1, 3, 8, 8)}  # the G episodes of a prompt share their images:
    for e in episodes[2:]:                                   # saved once, shared again when read
        e.model_inputs = shared
    saved = episodes_to_json(episodes)
    assert saved[3]["model_inputs"] == {"same_as": 2} and "pixel_values" in saved[2]["model_inputs"]
    _, back = presampled_from_json([json.dumps([4, saved])], rows, 1, 2)
    assert back[0].model_inputs is back[1].model_inputs and torch.equal(back[1].model_inputs["pixel_values"],
                                                                        shared["pixel_values"])


def test_idefics3_logprobs_of_a_batch_equal_each_episodes_own_and_depend_on_the_image(tiny_vlm):
    """The one log-prob path (logprobs.completion_logprobs) on a tiny Idefics3: episodes with one image, two
    images and none, batched (padded prompts, zero images), equal each one computed alone to 1e-5; the same
    completion with another image gets other log-probs (the image is seen)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from logprobs import completion_logprobs
    from rollout import collate
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


@pytest.mark.slow
def test_the_server_samples_with_the_image_and_the_trainer_scores_what_it_sampled(vlm_server, tiny_vlm):
    """The VLM rollout through the real server's chat route: its prompt ids are the processor's; the trainer's
    log-probs of the sampled tokens (fp32, the same images) equal the server's to 1e-4, and differ by more than
    1e-2 with the image swapped or removed on the trainer's side (what a dropped image would look like)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from logprobs import completion_logprobs
    from rollout import RolloutContext, collate, run_rollout
    from vision import load_processor, vision_rollout
    from vllm_client import VLLMClient
    processor = load_processor(tiny_vlm)
    assert processor is not None and load_processor(vlm_server["model"]) is not None
    red, blue = Image.new("RGB", (50, 40), (230, 20, 20)), Image.new("RGB", (64, 64), (20, 20, 230))
    rows = [{"prompt": "What colour is this?", "image": red},
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And these?"},
                                                      {"type": "image"}]}], "images": [blue, red]},
            {"prompt": "No picture here."}]
    ctx = RolloutContext(VLLMClient(port=vlm_server["port"]), processor.tokenizer, 3,
                         dict(max_tokens=12, temperature=1.0), seed=5, processor=processor)
    episodes = run_rollout(vision_rollout, rows, ctx)
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
    # a trainer that renders the images otherwise than the server (another number of tokens per image) stops
    # before it trains on log-probs of another prompt
    import copy
    other = copy.deepcopy(processor)
    other.image_seq_len += 1
    with pytest.raises(ValueError, match="the server rendered the prompt of row 0 with its images as"):
        run_rollout(vision_rollout, rows[:1], dataclasses.replace(ctx, processor=other, tokenizer=other.tokenizer))


def test_a_vlm_of_another_architecture_and_image_parts_that_miss_their_images_stop_at_start(tiny_vlm, tmp_path):
    import json
    import shutil
    from PIL import Image
    from config import UsageError
    from vision import load_processor, prompt_lengths
    processor = load_processor(tiny_vlm)
    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    rows = [{"prompt": "one picture", "image": Image.new("RGB", (32, 32))}, {"prompt": two_parts,
                                                                          "image": Image.new("RGB", (32, 32))}]
    with pytest.raises(UsageError, match="dataset row 1: the prompt has 2 image parts but the row 1 images"):
        prompt_lengths(processor.tokenizer, processor, rows)
    other = tmp_path / "other"
    shutil.copytree(tiny_vlm, other)
    config = json.load(open(other / "config.json"))
    json.dump(config | {"model_type": "llava"}, open(other / "config.json", "w"))
    with pytest.raises(UsageError, match="is a vision-language model of type 'llava'; nanogrpo trains idefics3 and"):
        load_processor(str(other))


@pytest.mark.slow
def test_a_vision_tower_push_reaches_a_repeated_image_and_the_probe_sees_a_stale_encoder_cache(vlm_server, tiny_vlm):
    """The server caches the vision encoder's output per image. After a push that changes only the vision tower,
    the log-probs of an image it has seen before move and equal the trainer's (the push resets that cache); a
    push that skipped the reset leaves them stale, and the sync probe (which has an image) stops the run."""
    from transformers import AutoModelForImageTextToText
    from config import RunStopped
    from vision import load_processor, vision_probe
    from vllm_client import VLLMClient
    from weight_sync import ServerWeights, WeightSync, check_sync
    from conftest import free_port
    client = VLLMClient(port=vlm_server["port"])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    sync = WeightSync(client, ServerWeights(model, torch.float32), 0, "127.0.0.1", free_port())
    probe = vision_probe(load_processor(tiny_vlm), {"prompt": "Describe it."}, answer=" A picture of bands.")
    assert probe.model_inputs["pixel_values"].shape[:2] == (1, 1) and probe.messages[0]["content"][0]["type"] == "image_url"

    def check():
        return check_sync(client, model, probe, torch.autocast("cpu", enabled=False), True, 1e-4, 1)

    def perturb_vision_tower():
        with torch.no_grad():
            for p in model.model.vision_model.parameters():
                p.add_(0.2 * torch.randn_like(p))

    try:
        sync.push()
        before = client.chat_prompt_logprobs(probe.messages, probe.ids)  # the image is now in the encoder cache
        assert check()["sync_probe_diff_max"] < 1e-4
        perturb_vision_tower()
        sync.push()
        after = client.chat_prompt_logprobs(probe.messages, probe.ids)
        assert max(abs(a - b) for a, b in zip(before, after)) > 1e-2  # the repeated image was encoded again
        assert check()["sync_probe_diff_max"] < 1e-4  # with the pushed tower
        perturb_vision_tower()
        client.reset_encoder_cache = lambda: None  # a push that forgets the encoder cache
        sync.push()
        with pytest.raises(RunStopped, match="weight sync check failed"):
            check()
    finally:
        model.load_state_dict(initial, strict=False)
        client.__dict__.pop("reset_encoder_cache", None)
        sync.connect()  # as after a reconnect: the next push sends everything, the frozen weights too
        sync.push()


def test_a_frozen_vision_tower_gets_no_gradient_no_adapter_and_is_pushed_once(tiny_vlm):
    from transformers import AutoModelForImageTextToText
    from models import add_lora, freeze_vision_tower
    from weight_sync import ServerWeights
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32)
    assert freeze_vision_tower(model) == ["model.vision_model", "model.connector"]
    vision = [n for n, p in model.named_parameters() if n.startswith(("model.vision_model.", "model.connector."))]
    assert vision and all(not p.requires_grad for n, p in model.named_parameters() if n in vision)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in vision)
    source = ServerWeights(model, torch.float32)
    first = [m.name for m in source.metadata()]
    reading = iter(source)  # the sender reads as many as metadata() lists, and never reaches the generator's end
    assert set(vision) <= set(first) and [next(reading)[0] for _ in first] == first  # the first push: everything
    later = [m.name for m in source.metadata()]
    assert not set(vision) & set(later) and len(later) == len(first) - len(vision) and [n for n, _ in source] == later
    lora = add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32), 4, 8, 0.0,
                    "all-linear", exclude=["model.vision_model", "model.connector"])
    adapted = {n.split(".lora_A")[0] for n, _ in lora.named_parameters() if ".lora_A" in n}
    assert adapted and not any(".vision_model." in n or ".connector." in n for n in adapted)
    assert any(".text_model." in n for n in adapted)


def image_dataset(folder, n: int = 12) -> str:
    """A jsonl dataset of colour pictures of several sizes (files), a row with two of them and one without."""
    from PIL import Image
    colours = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230), "yellow": (230, 230, 20)}
    os.makedirs(folder / "images", exist_ok=True)
    rows = []
    for i in range(n):
        name = list(colours)[i % 4]
        path = str(folder / "images" / f"{i}.png")
        Image.new("RGB", (24 + 5 * i, 40 - i), colours[name]).save(path)
        rows.append({"prompt": "What colour is the picture? One word.", "image": path, "answer": name})
    rows.append({"prompt": "Are these the same colour?", "images": [rows[0]["image"], rows[1]["image"]],
                 "answer": "no"})
    rows.append({"prompt": "Name a colour.", "answer": "any"})
    with open(folder / "data.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(folder / "data.jsonl")


VLM_RUN = ["--reward_funcs", "tests.helpers:brevity", "--num_generations", "4", "--prompts_per_step", "4",
           "--max_completion_length", "8", "--bf16", "false", "--learning_rate", "1e-2", "--micro_batch_size", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--async_generation", "--beta", "0.04"], ["--fsdp", "--freeze_vision_tower", "false"],
                                  ["--fsdp", "--use_peft", "--lora_r", "4"]], ids=["ddp_async", "fsdp_tower", "fsdp_lora"])
def test_two_processes_train_a_vlm_on_images_keep_the_server_in_sync_and_resume_exactly(vlm_server, tmp_path, mode):
    """torchrun, 2 processes, the tiny Idefics3 on a dataset of pictures: 4 steps in one go, and a new run that
    resumes from its checkpoint-2, give the same metrics and completions; the server's log-probs equal the
    trainer's after every push (the probe has an image); the weights that train change, a frozen tower does not."""
    from safetensors.torch import load_file
    from conftest import run_train
    data = image_dataset(tmp_path)
    run = [*VLM_RUN, "--dataset", data, *mode]
    run_train(vlm_server, tmp_path / "a", *run, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "0")
    proc, _ = run_train(vlm_server, tmp_path / "b", *run, "--max_steps", "4", "--resume_from_checkpoint",
                        str(tmp_path / "a" / "checkpoint-2"))
    assert "resuming from" in proc.stdout and "step 3/4" in proc.stdout and "step 2/4" not in proc.stdout
    a, b = ({m["step"]: m for m in map(json.loads, open(tmp_path / run / "metrics.jsonl"))} for run in ("a", "b"))
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("reward", "loss", "kl", "grad_norm", "completion_length", "entropy", "sync_probe_diff_max"):
            if key == "kl" and "--beta" not in mode:  # no reference, no KL
                assert key not in a[step] and key not in b[step]
                continue
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert all(m["grad_norm"] > 0 for m in a.values()) and a[3]["loss"] != a[4]["loss"]
    assert max(m["sync_probe_diff_max"] for m in a.values()) < 1e-4
    if "--async_generation" not in mode:  # async, the sampler is one update behind
        assert max(m["sampler_logprob_diff_max"] for m in a.values()) < 1e-4
    ledger = {run: [(r["step"], r["rank"], r["prompt_index"], r["completion"], r["reward"])
                    for r in map(json.loads, open(tmp_path / run / "rollouts.jsonl"))] for run in ("a", "b")}
    assert ledger["b"] == ledger["a"] and len(ledger["a"]) == 4 * 16
    columns = json.loads(open(tmp_path / "a" / "rollouts.jsonl").readline())["columns"]
    assert set(columns) & {"image", "images"} and "answer" in columns
    initial = load_file(os.path.join(vlm_server["model"], "model.safetensors"))
    if "--use_peft" in mode:
        adapter = load_file(tmp_path / "a" / "adapter" / "adapter_model.safetensors")
        assert adapter and not any("vision_model" in k or "connector" in k for k in adapter)
        assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
        return
    saved = load_file(tmp_path / "a" / "model" / "model.safetensors")
    tower = [k for k in initial if k.startswith(("model.vision_model.", "model.connector."))]
    changed = {k for k in initial if not torch.equal(saved[k], initial[k])}
    assert any(k.startswith("model.text_model.") for k in changed)
    assert bool(changed & set(tower)) == ("--freeze_vision_tower" in mode)


@pytest.mark.slow
def test_a_dry_run_of_a_vlm_measures_an_update_with_its_images(vlm_server, tmp_path):
    """--dry_run's memory check builds its largest batch from the probe, whose image tokens must stay whole."""
    from conftest import run_train
    proc = run_train(vlm_server, tmp_path / "out", *VLM_RUN, "--dataset", image_dataset(tmp_path), "--dry_run",
                     nproc=1, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run passed: 11 checks" in proc.stdout and "  ok    memory" in proc.stdout
    assert "4 completions of" in proc.stdout and os.listdir(tmp_path / "out") == ["dry_run.txt"]


@pytest.mark.slow
def test_bad_image_input_stops_at_start_in_one_line(tiny_vlm, tiny_model, tmp_path):
    """Every image is read at start: a missing or unreadable image, images for a text-only model, and prompts
    whose image tokens pass --max_prompt_length stop the run before it needs a server (exit 2, one line)."""
    from embedded import TOOLS_TEMPLATE
    from test_bad_input import offline_train_args, starts_fail
    good = image_dataset(tmp_path)
    (tmp_path / "not_an_image.png").write_text("hello")
    rows = [json.loads(line) for line in open(good)]
    rows[3]["image"] = str(tmp_path / "missing.png")
    rows[5]["image"] = str(tmp_path / "not_an_image.png")
    for name, bad in (("missing", 3), ("unreadable", 5)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for i, row in enumerate(rows) if i in (0, bad))
    cases = [(tiny_vlm, ["--dataset", str(tmp_path / "missing.jsonl")], "dataset row 1: column 'image', image 0: cannot read it"),
             (tiny_vlm, ["--dataset", str(tmp_path / "unreadable.jsonl")], "cannot identify image file"),
             (tiny_model, ["--dataset", good], "the dataset has images (row 0) but the model has no image processor"),
             (tiny_vlm, ["--dataset", good, "--max_prompt_length", "30"], "tokens > --max_prompt_length 30"),
             (tiny_vlm, ["--dataset", good, "--chat_template", TOOLS_TEMPLATE], "with a vision-language model: the "
              "server renders its prompts (with the images) by the model folder's template"),
             (tiny_model, ["--freeze_vision_tower", "false", "--vision_learning_rate", "1e-3"],
              "--vision_learning_rate: this model has no vision tower that trains")]
    errors = starts_fail([[*offline_train_args(model, tmp_path / f"out{i}", *args), "--model", model]
                          for i, (model, args, _) in enumerate(cases)])
    for (_, args, message), error in zip(cases, errors):
        assert message in error, (args, error)


@pytest.mark.slow
def test_the_vision_bench_runs_in_its_smallest_setting(vlm_server, tiny_vlm):
    from test_benches import bench, quotient
    out = bench("vision.py", "--model", tiny_vlm, "--steps", "2", "--prompts", "2", "--G", "2", "--length", "8",
                env={"NANOGRPO_BENCH_SERVER": f"{vlm_server['port']}:{vlm_server['proc'].pid}"})
    assert "generation with images vs vllm.LLM" in out and "forward+backward with images vs the bare" in out
    assert "MiB held" in out
    held, copied, ratio = re.search(r"(\S+) MiB held, (\S+) MiB with a copy per episode \((\S+)x\)", out).groups()
    assert float(copied) > float(held) > 0 and quotient(ratio, copied, held)  # one image per prompt, not per sample
    for line in out.splitlines():  # each ratio is of the two times before it
        if re.match(r" +\d +", line):
            cells = line.split()
            assert quotient(cells[3], cells[1], cells[2]) and quotient(cells[6], cells[4], cells[5]), line


def test_the_embedded_vision_task_its_reward_and_its_flags():
    from config import parse_config
    from embedded import COLOURS, named_colour, shape_problems
    train, test = shape_problems(40, 0), shape_problems(40, 0, "test")
    assert len(train) == 40 and len(test) == 64 and {r["answer"] for r in test} == set(COLOURS)
    assert sorted(r["answer"] for r in test).count("red") == 16  # balanced: chance is 1 in 4
    assert all(r["image"].size == (64, 64) for r in train)
    assert train[0]["image"].tobytes() != test[0]["image"].tobytes()
    assert named_colour(["The shape is Blue.", "blue or red", "It is bluish", "BLUE!"], ["blue"] * 4) == [1, 0, 0, 1]
    cfg = parse_config(["--dataset", "shapes"])
    assert (cfg.model, cfg.reward_funcs, cfg.freeze_vision_tower) == ("smollm2-vision", "embedded:named_colour", False)
    assert cfg.evaluates() and parse_config(["--dataset", "shapes", "--freeze_vision", "true"]).freeze_vision_tower


def test_the_embedded_vlms_connector_puts_a_shapes_image_tokens_near_its_colours_word(tmp_path):
    """embedded.align_connector, as build_embedded_vlm runs it: on held-out pictures, the image token that shows the
    most of the shape is nearer the word of its colour than of any other (chance: 1 in 4). Unaligned (the random
    connector), it is not."""
    from transformers import AutoProcessor, AutoModelForImageTextToText
    from embedded import COLOURS, build_embedded_vlm, default_model_path, shape_problems
    folder = build_embedded_vlm(str(tmp_path / "vlm"), default_model_path())
    processor, model = AutoProcessor.from_pretrained(folder), AutoModelForImageTextToText.from_pretrained(folder)
    words = model.model.text_model.embed_tokens.weight[
        [processor.tokenizer.encode(" " + c, add_special_tokens=False)[0] for c in COLOURS]]  # (4, d)
    rows = shape_problems(0, 0, "test")

    def hits() -> int:
        with torch.no_grad():
            tokens = model.model.get_image_features(
                pixel_values=processor.image_processor([r["image"] for r in rows], return_tensors="pt")["pixel_values"])
            tokens = getattr(tokens, "pooler_output", tokens)  # (64, 16, d)
            # the token that differs most from the picture's mean token: the one showing the most shape
            shape = tokens[torch.arange(len(rows)), (tokens - tokens.mean(dim=1, keepdim=True)).norm(dim=-1).argmax(1)]
            nearest = torch.cdist(shape, words).argmin(dim=1)
        return sum(list(COLOURS)[i] == r["answer"] for i, r in zip(nearest.tolist(), rows))

    aligned = hits()
    assert aligned >= 56, aligned  # of 64 (64 when written)
    torch.nn.init.normal_(model.model.connector.modality_projection.proj.weight, std=0.02)
    assert hits() <= 32  # (21)


def test_images_larger_than_the_processors_size_are_scaled_down_before_either_side_sees_them(tiny_vlm):
    from PIL import Image
    from vision import load_processor, longest_edge, row_images
    assert longest_edge(load_processor(tiny_vlm)) == 64
    big, small = Image.new("RGB", (300, 100), (1, 2, 3)), Image.new("RGB", (40, 20), (1, 2, 3))
    assert [im.size for im in row_images({"images": [big, small]}, 64)] == [(64, 21), (40, 20)]
    assert [im.size for im in row_images({"images": [big]})] == [(300, 100)]


def test_a_trained_vision_tower_has_its_own_learning_rate(tiny_vlm):
    from transformers import AutoModelForImageTextToText
    from models import freeze_vision_tower, parameter_groups
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32)
    groups = parameter_groups(model, 1e-5, 1e-3)
    vision = {id(p) for n, p in model.named_parameters() if n.startswith(("model.vision_model.", "model.connector."))}
    assert [g["lr"] for g in groups] == [1e-5, 1e-3] and {id(p) for p in groups[1]["params"]} == vision
    assert parameter_groups(model, 1e-5, 0)[1]["lr"] == 1e-5
    freeze_vision_tower(model)
    assert len(parameter_groups(model, 1e-5, 0)) == 1  # nothing of the tower trains
    from config import UsageError
    with pytest.raises(UsageError, match="--vision_learning_rate: this model has no vision tower that trains"):
        parameter_groups(model, 1e-5, 1e-3)  # a flag that would do nothing is an error
