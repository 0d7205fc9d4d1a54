"""The embedded tool-calling model (embedded.build_tool_model) and the calculator's task: what the model is taught
before RL (transcripts of the embedded environments, the loss on the assistant's tokens only, no held-out sum among
them), that it then writes its calls itself but not always (when to call is left to RL), and the count of calls that
failed (tools/failed_calls)."""
import importlib.util
import os
import re
import sys

import pytest

import embedded
from conftest import ROOT, make_tiny_model
from embedded import (Calculator, Guess, assistant_labels, default_model_path, three_digit_problems, tool_model_path,
                      tool_transcripts)
from rollout import RolloutContext
from tool_calls import reader_for
from tools import tool_rollout, trajectory_metrics


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_path())


def pairs(rows):
    return {tuple(map(int, re.findall(r"\d+", r["prompt"])[:2])) for r in rows}


def test_the_calculators_held_out_sums_are_never_trained_on_and_its_answers_are_right():
    train, test = three_digit_problems(3000, seed=1), three_digit_problems(0, seed=1, split="test")
    assert len(test) == 64 and test == three_digit_problems(5, seed=1, split="test")  # seeded; n is ignored
    assert not pairs(train) & pairs(test) and len(pairs(train)) > 2500
    for row in train + test:
        a, b = map(int, re.findall(r"\d+", row["prompt"])[:2])
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["answer"] == str(a + b)


def test_the_transcripts_call_the_calculator_in_two_of_three_sums_and_play_guess_by_its_answers():
    transcripts = tool_transcripts(80, seed=0)  # as build_tool_model makes them
    sums = [m for m, schemas in transcripts if schemas[0]["function"]["name"] == "calculate"]
    games = [m for m, schemas in transcripts if schemas[0]["function"]["name"] == "guess"]
    assert (len(sums), len(games)) == (40, 40)
    assert sum("tool_calls" in m[1] for m in sums) == 26  # when to call is left to RL
    held_out = pairs(three_digit_problems(0, seed=0, split="test"))
    for messages in sums:
        a, b = map(int, re.findall(r"\d+", messages[0]["content"])[:2])
        assert (a, b) not in held_out and (a + 7 * b) % 16 != 0  # the held-out rule: no held-out pair in any draw
        assert messages[-1]["content"].endswith(f"\\boxed{{{a + b}}}.")
        if "tool_calls" in messages[1]:
            assert messages[2]["content"] == str(a + b)  # the tool's answer, as Calculator.calculate gives it
    for messages in games:
        assert messages[0]["content"] == Guess().reset(seed=0)  # the game's own prompt
        low, high = 1, Guess.high
        answers = [m["content"] for m in messages if m["role"] == "tool"]
        numbers = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in messages if "tool_calls" in m]
        for number, answer in zip(numbers, answers):
            assert low <= number <= high  # each guess among the numbers the answers so far leave
            low, high = (number + 1, high) if answer == "higher" else (low, number - 1) if answer == "lower" else \
                (number, number)
        assert answers[-1] == "found it" and messages[-1]["content"].endswith(f"is {numbers[-1]}.")


def test_the_fit_learns_only_the_assistants_tokens(tokenizer):
    """Labels cover each assistant turn from its first token to its end-of-turn token, and nothing else: not the
    system turn with the tools, the question, the tools' answers, or the `<|im_start|>assistant` openings."""
    messages, schemas = next(t for t in tool_transcripts(64, seed=0) if "tool_calls" in t[0][1])
    ids, labels = assistant_labels(tokenizer, messages, schemas)
    assert len(ids) == len(labels) and all(label in (-100, i) for i, label in zip(ids, labels))
    spans, run = [], []
    for i, label in zip(ids, labels):  # the labelled runs, in order
        if label != -100:
            run.append(i)
        elif run:
            spans, run = spans + [run], []
    spans += [run] if run else []
    a, b = map(int, re.findall(r"\d+", messages[0]["content"])[:2])
    assert [tokenizer.decode(s) for s in spans] == [
        f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{a} + {b}"}}}}\n</tool_call><|im_end|>',
        f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b}}}.<|im_end|>"]


@pytest.mark.parametrize("bf16", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_the_tool_model_is_fitted_in_the_dtype_the_trainer_computes_in(bf16, tmp_path, monkeypatch, capsys):
    """bf16 only where the CPU has it natively (config.native_bf16, train.py's --bf16 auto): on an AVX2-only CPU an
    emulated bf16 fit ran 30 minutes without finishing. Both answers of native_bf16 are given to the build (whatever
    this machine's is): built from a tiny random Llama in a fresh cache, the fit's first layer computes in bf16 where
    it is native and in fp32 where not, and the folder's name says which."""
    import torch
    make_tiny_model(tmp_path / "SmolLM2-135M-Instruct")  # the base model the build starts from, in the fresh cache
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    asked = []
    monkeypatch.setattr(embedded, "native_bf16", lambda device: asked.append(device) or bf16)  # as this CPU would say

    class Seen(Exception):
        """Raised by the first linear layer the build runs: its output's dtype is the fit's, and the rest of the
        build (two minutes on 2 cores, even for a tiny model: its logits span the whole vocabulary) is not needed."""

    def first_linear(module, args, out):
        if isinstance(module, torch.nn.Linear):
            raise Seen(out.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(first_linear)
    try:
        with pytest.raises(Seen) as seen:
            tool_model_path()
    finally:
        hook.remove()
    assert asked == [torch.device("cpu")]  # the CPU the fit runs on was asked
    assert seen.value.args[0] == (torch.bfloat16 if bf16 else torch.float32)
    folder = embedded.tool_model_folder(bf16)
    assert os.path.basename(folder).startswith(f"SmolLM2-135M-tools-{'bf16' if bf16 else 'fp32'}-")
    assert f"once into {folder} " in capsys.readouterr().err and not os.path.exists(folder)  # stopped: nothing saved


def embedded_copy(folder, name: str, edit=lambda text: text, template_edit=lambda text: text):
    """embedded.py, edited by `edit`, and its tool template, edited by `template_edit`, copied into `folder` and
    imported from there as module `name`: what the cache would see after such an edit of the recipe."""
    os.makedirs(os.path.join(folder, "templates"))
    with open(os.path.join(ROOT, "embedded.py")) as f, open(os.path.join(folder, "embedded.py"), "w") as out:
        out.write(edit(f.read()))
    with open(embedded.TOOLS_TEMPLATE) as f, open(os.path.join(folder, "templates", "chatml_tools.jinja"), "w") as out:
        out.write(template_edit(f.read()))
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "embedded.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_changed_recipe_names_another_folder_and_a_comment_does_not(tmp_path):
    """The embedded models' cache folders are named for their recipes, so a changed recipe never reuses a stale
    model: the fit's dtype, a learning rate, a tool's docstring (its schema) or the tool template name another tool
    model folder, the alignment's contrast another VLM folder; comments and blank lines name the same ones."""
    def folders(module):
        return [os.path.basename(module.tool_model_folder(False)), os.path.basename(module.tool_model_folder(True)),
                os.path.basename(module.embedded_vlm_folder())]

    def replaced(old, new):
        def edit(text):
            assert text.count(old) == 1, old
            return text.replace(old, new)
        return edit
    edits = {"same": {},
             "comments": {"edit": replaced("    model.train()\n", "    model.train()  # a comment\n\n    # another\n")},
             "lr": {"edit": replaced("lr: float = 3e-4", "lr: float = 1e-4")},
             "schema": {"edit": replaced("such as 13 + 14.", "such as 2 + 2.")},
             "template": {"template_edit": lambda text: text.replace("<tool_call>", "<call>")},
             "contrast": {"edit": replaced("contrast: float = 5.0", "contrast: float = 4.0")}}
    try:  # each copy's folders are read while it is imported (inspect finds a class's source through sys.modules)
        cases = {name: folders(embedded_copy(tmp_path / name, f"embedded_{name}", **edit))
                 for name, edit in edits.items()}
    finally:
        for name in edits:
            sys.modules.pop(f"embedded_{name}", None)
    tools_fp32, tools_bf16, vlm = folders(embedded)
    assert tools_fp32.startswith("SmolLM2-135M-tools-fp32-") and tools_bf16.startswith("SmolLM2-135M-tools-bf16-")
    assert tools_fp32.split("-")[-1] == tools_bf16.split("-")[-1]  # the same recipe but the dtype
    assert cases["same"] == cases["comments"] == [tools_fp32, tools_bf16, vlm]
    for name in ("lr", "schema", "template"):
        assert cases[name][0] != tools_fp32 and cases[name][1] != tools_bf16 and cases[name][2] == vlm, name
    assert cases["contrast"][:2] == [tools_fp32, tools_bf16] and cases["contrast"][2] != vlm


class ThreeKindsOfCall:
    """A stand-in for the server's client: the first turn writes a call that is not JSON, a call of a tool that does
    not exist and a good call; the second turn answers."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        first = ('<tool_call>{"name": "calculate", "arguments": {</tool_call>'
                 '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
                 '<tool_call>{"name": "calculate", "arguments": {"expression": "100 + 200"}}</tool_call>')
        out = []
        for p in prompts:
            text = "\\boxed{300}" if "<tool_response>" in self.tokenizer.decode(p) else first
            ids = self.tokenizer(text)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(dict(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


def test_calls_that_fail_are_counted_beside_all_calls(tokenizer):
    rows = [{"prompt": "What is 100 + 200?", "answer": "300"}]
    ctx = RolloutContext(ThreeKindsOfCall(tokenizer), tokenizer, 2, dict(max_tokens=300, temperature=1.0), seed=1)
    episodes = tool_rollout(rows, ctx, env_factory=Calculator)
    assert all((e.info["tool_calls"], e.info["failed_tool_calls"]) == (3, 2) for e in episodes)
    assert "300" in [m["content"] for m in episodes[0].messages if m["role"] == "tool"]  # the good call was made
    metrics = trajectory_metrics(episodes)
    assert (metrics["tools/calls"], metrics["tools/failed_calls"]) == (3, 2)


@pytest.mark.slow
def test_the_tool_model_writes_well_formed_calls_but_not_always():
    """Built once (about 1.5 minutes where the CPU has native bf16, 8 in fp32 without it): on held-out sums at
    temperature 1 it calls the calculator in some answers and not in others (RL learns when to call), and its calls
    are read as calls of calculate with the sum."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema
    path = tool_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(0)
    called = good = 0
    reader = reader_for("auto", tokenizer, [get_json_schema(Calculator.calculate)], path)
    rows = three_digit_problems(0, seed=0, split="test")[:24]
    conversations = [[{"role": "user", "content": row["prompt"] + Calculator().reset()}] for row in rows]
    ids = tokenizer.apply_chat_template(conversations, tools=[get_json_schema(Calculator.calculate)],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    # Every prompt's two answers in one call of generate, and the tokens every prompt begins with (the system
    # prompt with the tool's schema, 192 of 228; the prompts have one length, so no padding) computed once and
    # their cache repeated for each answer: 20 s against 40 s for one call without it (2 cores), and minutes for
    # a call per prompt.
    shared = int((ids == ids[:1]).all(0).cumprod(0).sum()) - 1  # at least one token left to compute
    with torch.no_grad():
        cache = model(ids[:1, :shared]).past_key_values
    cache.batch_repeat_interleave(2 * len(rows))
    answers = ids.repeat_interleave(2, 0)  # each prompt twice, in a row
    out = model.generate(answers, attention_mask=torch.ones_like(answers), past_key_values=cache, do_sample=True,
                         temperature=1.0, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id)
    for row, sample in zip([row for row in rows for _ in range(2)], out):
        text = tokenizer.decode(sample[ids.shape[1]:], skip_special_tokens=True)
        if "<tool_call>" in text:
            called += 1
            _, calls, errors = reader.read(text)
            a, b = re.findall(r"\d+", row["prompt"])[:2]
            good += not errors and calls == [{"name": "calculate", "arguments": {"expression": f"{a} + {b}"}}]
    assert 2 <= called <= 46, called  # of 48: neither never nor always
    assert good >= 0.7 * called, (good, called)
