"""Tool calls of every model family (tool_calls.py): each family's chat template (tests/fixtures/chat_templates)
writes calls, and the parser --tool_call_parser auto picks (vLLM's, by the name vllm serve takes) reads them back:
one call, two calls, a malformed call as an error the model reads; a parser that cannot read the template's calls
stops the run in one line. Then the end of a turn under Llama 3.1's and Gemma 3's templates, and multi-turn
trajectories in Llama's and Mistral's formats, token-exact."""
import functools
import json
import os
import re
import shutil
import sys

import pytest

from config import UsageError
from embedded import default_model_path
from tool_calls import UNREAD, reader_for, written_call
from tests.helpers import Echo, Guess
from tools import appended_ids, check_tool_template, end_of_turn_id, tool_rollout, tool_schemas

TEMPLATES = os.path.join(os.path.dirname(__file__), "fixtures", "chat_templates")
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
# Each family: the special tokens its template writes (added to the SmolLM2 tokenizer, as its own tokenizer has
# them: the parsers look for them), the parser auto must pick, and what joins two calls in one turn where the
# template writes one call per turn (None: it writes both): Llama's JSON calls are joined by "; " (vLLM's
# llama3_json reads so), harmony writes each call as a message of its own.
FAMILIES = {
    "qwen2_5": ([], "hermes", None),
    "qwen3": (["<think>", "</think>"], "hermes", None),
    "llama3_1": (LLAMA_TOKENS, "llama3_json", "; "),
    "mistral_v3": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "mistral", None),
    "glm4moe": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                 "</think>"], "glm45", None),
    "gemma4": (["<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool>", "<tool|>",
                "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>"], "gemma4", None),
    "gptoss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"],
               "openai", "<|start|>assistant"),
}


@functools.cache
def family_tokenizer(name: str, tokens: tuple = ()):
    """The SmolLM2 tokenizer with a family's chat template and the special tokens it writes."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.add_tokens(list(tokens or FAMILIES[name][0]), special_tokens=True)
    with open(os.path.join(TEMPLATES, f"{name}.jinja")) as f:
        tokenizer.chat_template = f.read()
    return tokenizer


def forecast(city: str, days: int) -> str:
    """The weather to come.

    Args:
        city: where
        days: how many days ahead
    """
    return f"sunny in {city} for {days} days"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


SCHEMAS = tool_schemas([forecast, add])
CALLS = [{"name": "forecast", "arguments": {"city": "Paris", "days": 3}},
         {"name": "add", "arguments": {"a": 2, "b": 40}}]


def turn_of(tokenizer, calls: list[dict], content: str = "") -> str:
    """An assistant turn with `calls` (or only `content`), as the chat template writes it (what the model writes,
    decoded with its special tokens)."""
    asked = [{"role": "user", "content": "Plan my trip."}]
    message = {"role": "assistant", "content": content, **({"tool_calls": [
        {"type": "function", "id": f"call0000{k}", "function": c} for k, c in enumerate(calls)]} if calls else {})}
    prompt = tokenizer.apply_chat_template(asked, tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(asked + [message], tools=SCHEMAS, tokenize=False)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def two_calls(name: str, tokenizer, calls: list[dict]) -> str:
    """A turn with both calls: as the template writes them, or, where it writes one call per turn, each as it writes
    it, joined as the family's model writes several."""
    joiner = FAMILIES[name][2]
    if joiner is None:
        return turn_of(tokenizer, calls)
    end = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer)) if name == "llama3_1" else ""
    return turn_of(tokenizer, calls[:1]).removesuffix(end) + joiner + turn_of(tokenizer, calls[1:]).lstrip()


def malformed(text: str, name: str) -> str:
    """`text` with its first call's tool name broken as a model breaks it: unquoted in a JSON format, left out in
    the others."""
    return text.replace(f'"{name}"', name, 1) if f'"{name}"' in text else text.replace(name, "", 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_calls_are_read_back_by_the_parser_auto_picks(family):
    """The template's calls through the parser auto picked by its round trip: one call, two calls (in order), and a
    malformed first call beside a good one: an error the model reads (the good one still made, where the format
    writes calls apart), never an exception. The opening auto found is the format's."""
    tokenizer, expected = family_tokenizer(family), FAMILIES[family][1]
    reader = reader_for("auto", tokenizer, SCHEMAS, family)
    assert reader.name == expected
    assert reader.opening == {"llama3_1": '{"name":', "mistral_v3": "[TOOL_CALLS]", "gemma4": "<|tool_call>call:",
                              "gptoss": "to=functions."}.get(family, "<tool_call>")
    assert reader.read(turn_of(tokenizer, CALLS[:1]), SCHEMAS) == ("", CALLS[:1], [])
    both = two_calls(family, tokenizer, CALLS)
    assert reader.read(both, SCHEMAS).calls == CALLS
    read = reader.read(malformed(both, "forecast"), SCHEMAS)
    assert len(read.errors) == 1 and "could not be read; a call is written as" in read.errors[0], read
    # Mistral writes a turn's calls as one JSON list, which reads as a whole or not at all.
    assert read.calls == ([] if family == "mistral_v3" else CALLS[1:]), read
    read = reader.read(turn_of(tokenizer, [], "Sunny, I think."), SCHEMAS)  # an answer without a call
    assert not read.calls and not read.errors and "Sunny, I think." in read.content, read


def test_the_embedded_models_calls_are_read_by_hermes():
    """The embedded model's template (templates/chatml_tools.jinja, Hermes' format): auto picks hermes, which reads
    calls the model writes, and malformed ones (not JSON, arguments not an object, nested too deep) are errors."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    reader = reader_for("auto", tokenizer, tool_schemas([add]), "smollm2-135m")
    assert (reader.name, reader.opening) == ("hermes", "<tool_call>")
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": add}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call><|im_end|>')
    content, calls, errors = reader.read(text)
    assert content == "Let me add."
    assert calls == [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1}}]
    assert len(errors) == 2 and "could not be read" in errors[0] and "not a JSON object" in errors[1]
    content, calls, errors = reader.read("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>")
    assert calls == [] and len(errors) == 1 and "could not be read" in errors[0]


HERMES_RESPONSE = {  # transformers' response template for Hermes calls after ChatML's assistant header
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
    "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                              "content": "json", "transform": {"type": "function", "function": "{content}"}},
               "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}


def test_a_parser_that_cannot_read_the_templates_calls_stops_the_run_in_one_line():
    """A named parser must pass the same round trip: hermes on Llama's calls stops, in one line naming
    --tool_call_parser and showing what the template wrote; so does auto where no parser reads the template's
    format, and a name vLLM does not know. hf reads with transformers' parse_response where the tokenizer has a
    response template, and is not a candidate where it has none."""
    llama = family_tokenizer("llama3_1")
    for name, says in (("hermes", "--tool_call_parser hermes does not read back the call forecast({'city': 'seven', "
                                  "'days': 7}) that the chat template of llama writes as '{\"name\": \"forecast\""),
                       ("hf", "--tool_call_parser hf does not read back"),
                       ("nope", "--tool_call_parser nope: not a parser vLLM knows; give auto or one of")):
        with pytest.raises(UsageError) as e:
            reader_for(name, llama, SCHEMAS, "llama")
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)
    assert reader_for("llama3_json", llama, SCHEMAS, "llama").name == "llama3_json"
    odd = family_tokenizer("qwen2_5")
    odd = type(odd).from_pretrained(default_model_path())
    odd.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% for c in m.get('tool_calls') "
                         "or [] %}CALL {{ c['function']['name'] }} WITH {{ c['function']['arguments'] }}{% endfor %}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(UsageError) as e:
        reader_for("auto", odd, SCHEMAS, "odd")
    assert str(e.value).startswith("--tool_call_parser auto: none of hermes, llama3_json") and \
        "writes as \"CALL forecast WITH {'city': 'seven', 'days': 7}\"" in str(e.value), str(e.value)
    qwen = type(odd).from_pretrained(default_model_path())
    qwen.chat_template = family_tokenizer("qwen2_5").chat_template
    qwen.response_template = HERMES_RESPONSE
    hf = reader_for("hf", qwen, SCHEMAS, "qwen")
    prompt = qwen.apply_chat_template([{"role": "user", "content": "Plan my trip."}], tools=SCHEMAS,
                                      add_generation_prompt=True, tokenize=False)
    assert hf.read(turn_of(qwen, CALLS), SCHEMAS, prefix=prompt).calls == CALLS


def test_the_end_of_a_turn_is_llama3s_eot_id_and_gemmas_end_of_turn():
    """Llama 3.1's turns end with <|eot_id|>, Gemma 3's with <end_of_turn>, neither the tokenizer's eos: what a tool
    turn (Llama) or a user's next message (Gemma, as an agent sends one) appends starts right after it."""
    llama = family_tokenizer("llama3_1")
    gemma = family_tokenizer("gemma3", ("<bos>", "<start_of_turn>", "<end_of_turn>"))
    for tokenizer, end in ((llama, "<|eot_id|>"), (gemma, "<end_of_turn>")):
        assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids(end) != tokenizer.eos_token_id
    check_tool_template(llama, "llama")  # it renders tools, calls and results, and only appends
    asked = [{"role": "user", "content": "What is 2 + 40?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call00000",
                                                                 "function": CALLS[1]}]}
    suffix = appended_ids(llama, asked + [call], [{"role": "tool", "name": "add", "tool_call_id": "call00000",
                                                   "content": "42"}], SCHEMAS)
    assert llama.decode(suffix) == ("<|start_header_id|>ipython<|end_header_id|>\n\n\"42\"<|eot_id|>"
                                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    suffix = appended_ids(gemma, asked + [{"role": "assistant", "content": "42"}],
                          [{"role": "user", "content": "Sure?"}], None)
    assert gemma.decode(suffix) == "\n<start_of_turn>user\nSure?<end_of_turn>\n<start_of_turn>model\n"


class WritesCalls:
    """A stand-in for the server's client: the model's turn is a call of echo("word") as the chat template writes it,
    until two tools have answered (`answered` marks an answer in the context), then "done"; each turn as the
    template writes it up to the token the model stops at (its last special token, or `stops`' where the template
    writes none: GLM's model stops at <|observation|> or <|user|>). The call's id is the one the trajectory gives
    its k-th call (tools.call_id), as a model that copies ids writes it."""

    def __init__(self, tokenizer, answered: str, stops: tuple = ()):
        self.tokenizer, self.answered, self.stops = tokenizer, answered, stops
        self.schemas = tool_schemas([Echo().echo])

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        out = []
        for p in prompts:
            k = self.tokenizer.decode(p).count(self.answered)
            message = {"role": "assistant", "content": "done"} if k >= 2 else {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "id": f"call{k:05d}",
                                "function": {"name": "echo", "arguments": {"text": "word"}}}]}
            asked = [{"role": "user", "content": "x"}]
            prompt = self.tokenizer.apply_chat_template(asked, tools=self.schemas, add_generation_prompt=True,
                                                        tokenize=False)
            text = self.tokenizer.apply_chat_template(asked + [message], tools=self.schemas,
                                                      tokenize=False)[len(prompt):].rstrip()
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if ids[-1] not in self.tokenizer.all_special_ids + list(self.tokenizer.added_tokens_decoder) and self.stops:
                ids.append(self.tokenizer.convert_tokens_to_ids(self.stops[k >= 2]))
            out.append(dict(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


# Each family's mark of a tool's answer in the context, and the tokens its model stops a call turn and its last
# turn at where the template writes none.
TRAJECTORIES = {"llama3_1": ("<|start_header_id|>ipython", ()), "mistral_v3": ("[TOOL_RESULTS]", ()),
                "gemma4": ("response:echo", ()), "gptoss": ("<|start|>functions.echo", ()),
                "glm4moe": ("<|observation|>", ("<|observation|>", "<|user|>"))}


@pytest.mark.parametrize("family", TRAJECTORIES)
def test_a_trajectory_in_each_format_is_the_templates_rendering(family):
    """Two tool turns in the family's format (Mistral's calls and answers carry ids): the parser auto picks reads the
    calls, the tools answer, and each trajectory reads as the template renders its conversation: the model's turns
    as sampled, up to the token each stopped at (Gemma 4's call turn at <|tool_response>, gpt-oss's at <|call|>,
    GLM's at <|observation|>, which the template writes as the answer's opening and the trajectory holds once), and
    the template's tokens for the answers between them."""
    from rollout import RolloutContext
    tokenizer, (answered, stops) = family_tokenizer(family), TRAJECTORIES[family]
    ctx = RolloutContext(WritesCalls(tokenizer, answered, stops), tokenizer, 2, dict(max_tokens=600, temperature=1.0),
                         seed=1)
    for e in tool_rollout([{"prompt": "Echo twice."}], ctx, env_factory=Echo, max_iterations=3):
        assert [m["content"] for m in e.messages if m["role"] == "tool"] == ["word", "word"]
        assert e.info["tool_calls"] == 2 and e.info["failed_tool_calls"] == 0
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Echo twice."}] + e.messages,
                                                 tools=tool_schemas([Echo().echo]), tokenize=False)
        assert tokenizer.decode(e.prompt_ids + e.completion_ids) == rendered.rstrip() + "".join(stops[1:])


class WritesAMalformedCall:
    """A stand-in for the server's client: the model's first turn is WritesCalls' call of echo with its name broken
    (tests' malformed), its turn after reading the error "done"."""

    def __init__(self, tokenizer, stops: tuple = ()):
        self.tokenizer = tokenizer
        self.calls, self.done = WritesCalls(tokenizer, "never written", stops), WritesCalls(tokenizer, "", stops)

    def generate_each(self, prompts, max_tokens, seeds, **sampling):
        out = []
        for p, call, done in zip(prompts, self.calls.generate_each(prompts, max_tokens, seeds),
                                 self.done.generate_each(prompts, max_tokens, seeds)):
            if UNREAD in self.tokenizer.decode(p):
                out.append(done)
                continue
            ids = self.tokenizer.encode(malformed(self.tokenizer.decode(call["token_ids"]), "echo"),
                                        add_special_tokens=False)
            out.append(dict(call, token_ids=ids, logprobs=[-0.5] * len(ids)))
        return out


@pytest.mark.parametrize("family", TRAJECTORIES)
def test_a_malformed_calls_error_is_read_by_the_model_in_each_format(family):
    """A turn whose only call is malformed: the model reads its error (among the tokens given after its turn) and
    then ends; the episode's messages hold that error as a tool's answer, counted a failed call. Before, Mistral's
    and gpt-oss's templates refused the error's tool message (it answers no call in the turn: the trajectory ended,
    counted a rewritten history), and Gemma 4's dropped it (the messages held an error the tokens lacked)."""
    from rollout import RolloutContext
    tokenizer, (_, stops) = family_tokenizer(family), TRAJECTORIES[family]
    ctx = RolloutContext(WritesAMalformedCall(tokenizer, stops), tokenizer, 1, dict(max_tokens=600, temperature=1.0),
                         seed=1)
    e, = tool_rollout([{"prompt": "Echo."}], ctx, env_factory=Echo, max_iterations=3)
    given = tokenizer.decode([t for t, s in zip(e.completion_ids, e.sampled) if not s])
    answers = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert len(answers) == 1 and UNREAD in answers[0] and given.count(UNREAD) == 1, (answers, given)
    assert (e.info["failed_tool_calls"], e.info["template_rewrote_history"]) == (1, False), e.info
    assert "done" in tokenizer.decode([t for t, s in zip(e.completion_ids, e.sampled) if s])


def test_the_round_trips_call_has_arguments_of_each_type_of_its_tool():
    """written_call's arguments: one per parameter, a value of its type, an enum's first, a list of one item."""
    def book(city: str, nights: int, price: float, breakfast: bool, guests: list[str]) -> str:
        """Book a room.

        Args:
            city: where
            nights: how many
            price: at most
            breakfast: whether
            guests: who
        """
        return "booked"
    call, turn, _, opening = written_call(family_tokenizer("qwen2_5"), tool_schemas([book]))
    assert call == {"name": "book", "arguments": {"city": "seven", "nights": 7, "price": 2.5, "breakfast": True,
                                                  "guests": ["seven"]}}
    assert opening == "<tool_call>" and json.loads(turn.split("\n")[1])["arguments"] == call["arguments"]


def llama_model(model: str, out) -> str:
    """A copy of the tests' tiny model whose tokenizer speaks Llama 3.1: six of SmolLM2's special tokens that no
    test uses (ids 3 to 8) renamed to Llama's (<|eot_id|>, <|python_tag|>, ...), so the model's vocabulary holds
    them, and Llama 3.1's chat template. The weights are the tiny model's: a server that serves it serves this."""
    shutil.copytree(model, out)
    with open(os.path.join(out, "tokenizer.json")) as f:
        spec = json.load(f)
    renamed = dict(zip(range(3, 3 + len(LLAMA_TOKENS)), LLAMA_TOKENS))
    for token in spec["added_tokens"]:
        if token["id"] in renamed:
            spec["model"]["vocab"][renamed[token["id"]]] = spec["model"]["vocab"].pop(token["content"])
            token["content"] = renamed[token["id"]]
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    shutil.copy(os.path.join(TEMPLATES, "llama3_1.jinja"), os.path.join(out, "chat_template.jinja"))
    return str(out)


class GuessInLlamaCalls(Guess):
    """tests.helpers.Guess whose every turn opens with a call of guess(11) in Llama 3.1's format (given, not sampled:
    the tiny random model writes none of its own); 11 is never the secret, so its reward stays 0."""

    def turn_prefix(self) -> str:
        return '{"name": "guess", "parameters": {"number": 11}}'


@pytest.mark.slow
def test_a_parser_that_cannot_read_the_templates_calls_stops_the_start_and_the_dry_run_at_its_check(tiny_model,
                                                                                                     tmp_path):
    """--tool_call_parser hermes for a model whose template writes Llama's calls: the run stops at start with exit
    code 2 and one line, before it would need the server; the dry run does at its own check, `tool calls`, after
    `tasks` passed."""
    from conftest import run_all
    from test_bad_input import offline_train_args
    model = llama_model(tiny_model, tmp_path / "llama")
    flags = ["--model", model, "--tools", "tests.helpers:add", "--reward_funcs", "tests.helpers:brevity",
             "--tool_call_parser", "hermes"]
    runs = run_all([[sys.executable, *offline_train_args(tiny_model, tmp_path / name, *flags, *extra)]
                    for name, extra in (("start", []), ("dry", ["--dry_run"]))], 300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    says = "--tool_call_parser hermes does not read back the call add({'a': 7, 'b': 7}) that the chat template of"
    for proc, before in zip(runs, ("error: ", "error: dry run: `tool calls` failed: ")):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(before + says), proc.stderr[-3000:]
    assert re.search(r"^  ok +tasks .*\n  FAIL  tool calls ", runs[1].stdout, re.M), runs[1].stdout


def test_without_vllm_beside_the_trainer_a_run_with_tools_stops_in_one_line(monkeypatch):
    """Where the trainer's Python has no vLLM (its server runs elsewhere), reading the calls of --tools, auto or
    named, stops the run in one line (a UsageError: exit 2) saying what to install. Before, ModuleNotFoundError's
    traceback."""
    monkeypatch.setitem(sys.modules, "vllm.tool_parsers", None)  # as `import vllm.tool_parsers` fails without vLLM
    for name in ("auto", "hermes"):
        with pytest.raises(UsageError) as e:
            reader_for(name, family_tokenizer("qwen2_5"), SCHEMAS, "qwen")
        assert "pip install vllm" in str(e.value) and "\n" not in str(e.value), str(e.value)


def record(profile: dict, note: str) -> str:
    """Keep a record.

    Args:
        profile: whose
        note: about what
    """
    return "kept"


def test_json_with_a_name_key_is_no_malformed_call_and_a_spaced_malformed_call_is_one():
    """Llama's JSON calls (opening {"name":): a call whose arguments hold a "name" key is one call, an answer that
    quotes JSON with a "name" key is an answer, and a malformed call spaced as JSON may be ({ "name" :) is an error
    the model reads. Hermes: a call whose argument text holds <tool_call> is one call. Before, every opening counted:
    the first read as two errors, the second as an error, the third as an answer."""
    schemas = tool_schemas([record, add])
    call = {"name": "record", "arguments": {"profile": {"name": "Bob", "home": {"name": "Paris"}}, "note": "x"}}
    llama = family_tokenizer("llama3_1")
    reader = reader_for("auto", llama, schemas, "llama")
    assert reader.read(turn_of(llama, [call]), schemas) == ("", [call], [])
    quoted = 'Here is the record: {"name": "Paris", "population": 2}'
    assert reader.read(quoted, schemas) == (quoted, [], [])
    read = reader.read('{\n  "name" : add, "parameters": {"a": 2, "b": 3}}', schemas)
    assert read.calls == [] and len(read.errors) == 1 and "could not be read" in read.errors[0], read
    hermes = reader_for("auto", family_tokenizer("qwen2_5"), schemas, "qwen")
    call = {"name": "record", "arguments": {"profile": {}, "note": "write <tool_call> to call"}}
    assert hermes.read(turn_of(family_tokenizer("qwen2_5"), [call]), schemas) == ("", [call], [])
