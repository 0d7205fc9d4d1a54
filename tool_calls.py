"""Reading the tool calls in a model's turn with the parsers the ecosystem ships (docs/decisions.md, "Tool-call
parsing"; README: Environments and tools): vLLM's tool parsers, by the names `vllm serve --tool-call-parser NAME`
takes (hermes, llama3_json, mistral, openai for gpt-oss, glm45, gemma4, qwen3_xml, pythonic, ...), and
transformers' `tokenizer.parse_response` ("hf") where the tokenizer has a response template. None is ours: each
model family writes its calls in a format of its own, and the parsers that read them live where the formats are
maintained.

--tool_call_parser auto (the default) picks the parser by a round trip: an assistant turn with a call to the first
tool, rendered by the model's own chat template, must be read back as the same call (name and arguments). A named
parser must pass the same round trip. Either way a run never trains with a parser that cannot read its own
template's calls.

The parser only reads text, to decide which tools to call; the tokens trained on are the ones sampled (tools.py's
take_turns). What this file holds: the round trip (`reader_for`) and `CallReader`, the thin adapter that reads one
turn's text into (content, calls, errors), where a call it cannot read is an error the model reads, not a crash.

vLLM is imported here lazily, only when a run has tools: without tools the trainer runs where vLLM is not
installed (a GPU box whose server runs elsewhere).
"""
import json
import logging
import os
import re
import threading
from typing import NamedTuple

from config import UsageError

# The candidates of --tool_call_parser auto, in the order they are tried: Hermes first (Qwen2.5/Qwen3's format and the
# embedded tool model's), then the families' own. The first that reads the template's call back exactly is chosen.
AUTO_ORDER = ("hermes", "llama3_json", "mistral", "openai", "glm45", "gemma4", "qwen3_xml", "deepseek_v31",
              "deepseek_v3", "kimi_k2", "minimax_m2", "granite", "lfm2", "pythonic", "hf")
CALL_ID = "call00001"  # the id of the round trip's call: Mistral's templates take 9 letters or digits, no more
# What the round trip's arguments hold, by JSON type: values that every format writes and reads back unchanged.
# What every error of a call that could not be read says (tools.answered_ids checks that the model reads it).
UNREAD = "could not be read"
EXAMPLE_VALUES = {"integer": 7, "number": 2.5, "string": "seven", "boolean": True, "object": {}, "null": None}


class Read(NamedTuple):
    """What a model's turn says: its text without the calls (special tokens left out, as the turn's content), the calls
    the parser read ({"name", "arguments"}, in the order written), and one error per call it could not read, for the
    model to read as that call's answer."""
    content: str
    calls: list[dict]
    errors: list[str]


class CallReader:
    """Reads the tool calls in a model turn's text with one parser, `name` (module docstring), bound to the model's
    tokenizer: read(text, tools) -> Read. `opening`: the text that opens a call in the template's format (the round
    trip finds it), by which a call the parser cannot read is still seen and answered with an error; `example`: a
    call as the template writes it, shown in that error. Safe to call from several threads."""

    def __init__(self, name: str, tokenizer, opening: str = "", example: str = ""):
        self.name, self.tokenizer, self.opening = name, tokenizer, opening
        self.needs_prefix = name == "hf"  # parse_response reads where the prompt left the turn (e.g. inside <think>)
        self._parsers, self._lock = {}, threading.Lock()  # vLLM's parser per tool set (it reads argument types there)
        # The turn's content is shown without special tokens, as the text the model wrote (the longest first: one may
        # hold another).
        self._special = sorted({t for t in tokenizer.all_special_tokens} | {
            t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        # (Without them too: a tool's answer is rendered, and tokenized, inside the template's tool message.)
        self.example = self._without_special(example)

    def read(self, text: str, tools: list[dict] | None = None, prefix: str = "") -> Read:
        """The calls in `text`, a model turn decoded with its special tokens (formats mark calls with them: Mistral's
        [TOOL_CALLS], Llama's <|python_tag|>, harmony's channels), given the tools' JSON schemas (some formats write
        arguments as text, typed by the schema) and, for "hf", the `prefix` the turn continues."""
        with self._lock:
            calls, content = self._parse(text, tools or [], prefix)
            openings, broken = self._openings(text)
            if len(calls) >= len(openings) or not broken:
                return self._checked(calls, content, [])
            # A call the parser could not read (vLLM's parsers then give up on the whole turn): each call's text is read
            # alone, and each that gives no call is an error the model reads, with a call as the template writes one.
            pieces, errors = [], []
            for start, end in zip(openings, openings[1:] + [len(text)]):
                piece, _ = self._parse(text[start:end], tools or [], prefix)
                pieces += piece
                if not piece:
                    errors.append(f"error: the tool call {self._without_special(text[start:end])[:200]!r} {UNREAD}; a "
                                  f"call is written as {self.example[:200]!r}")
            if len(pieces) < len(calls):  # an opening inside a call the parser read (its arguments): cut, it reads less
                return self._checked(calls, content, [])
            return self._checked(pieces, text[:openings[0]], errors)

    def _openings(self, text: str) -> tuple[list[int], bool]:
        """Where calls begin in `text` (the opening's places), and whether one may be a call the parser could not
        read. In a JSON format ({"name":, spaced as JSON may be) an opening inside an object that reads opens no call
        (a "name" key of a call's arguments), and only one whose object does not read is such a call: an object that
        reads is a call the parser read, or JSON that the turn quotes, its text."""
        if not self.opening.startswith("{"):
            return [m.start() for m in re.finditer(re.escape(self.opening), text)] if self.opening else [], True
        pattern, found, end, broken = r"\s*".join(re.escape(c) for c in self.opening if not c.isspace()), [], 0, False
        for m in re.finditer(pattern, text):
            if m.start() < end:
                continue
            found.append(m.start())
            try:
                end = m.start() + json.JSONDecoder().raw_decode(text[m.start():])[1]
            except (ValueError, RecursionError):
                broken = True
        return found, broken

    def _parse(self, text: str, tools: list[dict], prefix: str) -> tuple[list[tuple], str]:
        """The parser's calls in `text` as (name, arguments: JSON text or a dict), and the text's content; a parser
        that fails on the text reads no call in it, and all of it as content."""
        request, parser = (None, None) if self.name == "hf" else self._vllm_parser(tools)
        try:
            if self.name == "hf":
                message = self.tokenizer.parse_response(text, prefix=prefix, tools=tools)
                return ([(c.get("function", c).get("name"), c.get("function", c).get("arguments"))
                         for c in message.get("tool_calls") or []], message.get("content") or "")
            ids = _harmony_ids(text) if self.name == "openai" else []
            _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
            return [(c.name, c.arguments) for c in calls or []], content or ""
        except (Exception, RecursionError):  # a malformed call (RecursionError: JSON nested too deep)
            return [], text

    def _vllm_parser(self, tools: list[dict]):
        """The request vLLM's parser reads the tools from, and the parser, as `vllm serve --tool-call-parser` composes
        it. Made once per tool set (a parser reads the vocabulary when made: ~0.1 s), but harmony's each time (it
        keeps the state of the turn it read)."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._parsers or self.name == "openai":
            self._parsers[key] = vllm_parser(self.name, self.tokenizer, tools)
        return self._parsers[key]

    def _checked(self, calls: list[tuple], content: str, errors: list[str]) -> Read:
        """`calls` as {"name", "arguments": a dict}; one whose name is not text or whose arguments are not a JSON
        object is an error the model reads."""
        out = []
        for name, arguments in calls:
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except (ValueError, RecursionError):
                pass  # said below
            if not isinstance(name, str) or not name or not isinstance(arguments, dict | None):
                errors.append(f"error: the tool call {name}({str(arguments)[:200]}) {UNREAD}: its arguments "
                              "are not a JSON object")
            else:
                out.append({"name": name, "arguments": arguments or {}})
        return Read(self._without_special(content), out, errors)

    def _without_special(self, text: str) -> str:
        for token in self._special:
            text = text.replace(token, "")
        return text.strip()


def vllm_parser(name: str, tokenizer, tools: list[dict]) -> tuple:
    """(a chat request holding `tools`, vLLM's parser `name` for the tokenizer), composed as vLLM's server composes
    it for `--enable-auto-tool-choice --tool-call-parser NAME` (harmony's for "openai", gpt-oss's format). Raises
    KeyError for a name vLLM does not know, TypeError for a tokenizer that lacks the tokens the parser looks for."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager
    # A malformed call is the model's (it reads an error for it, counted in tools/failed_calls): vLLM's parsers
    # would log each with a traceback.
    for logger in ("vllm.tool_parsers", "vllm.parser"):
        logging.getLogger(logger).setLevel(logging.CRITICAL)
    if name not in parser_names():
        raise KeyError(name)
    request = ChatCompletionRequest(model="", messages=[{"role": "user", "content": ""}], tools=tools or None,
                                    tool_choice="auto" if tools else None)
    parser = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, is_harmony=name == "openai",
                                      tokenizer=tokenizer)
    return request, parser(tokenizer, request.tools)


def _harmony_ids(text: str) -> list[int]:
    """The harmony encoding's token ids of `text`: vLLM's harmony parser reads a gpt-oss turn as token ids (gpt-oss's
    own tokenizer is that encoding, so the ids are the ones it sampled)."""
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
    return get_encoding().encode(text, allowed_special="all")


def parser_names() -> list[str]:
    """The names --tool_call_parser takes besides auto: vLLM's (those of `vllm serve --tool-call-parser`, hf among
    them). A one-line UsageError where vLLM is not installed beside the trainer: its parsers read the calls."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError as e:
        raise UsageError(f"reading the model's tool calls (--tools, --env, an agent's tools=[...]) takes vLLM's "
                         f"parsers, and this trainer's Python has no vLLM ({e}): pip install vllm (the server's "
                         "version) beside the trainer") from None
    return ToolParserManager.list_registered()


# -----------------------------------------------------------------------------
# the round trip: the template writes a call, the parser must read it back

def example_arguments(parameters: dict) -> dict:
    """Arguments for a call to a tool whose JSON schema's parameters are `parameters`: each one, with a value of its
    type (an enum's first; a list of one item)."""
    return {name: _example(spec) for name, spec in (parameters.get("properties") or {}).items()}


def _example(spec: dict):
    if spec.get("enum"):
        return spec["enum"][0]
    kind = spec.get("type", "string")
    kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
    return [_example(spec.get("items") or {})] if kind == "array" else EXAMPLE_VALUES.get(kind, "seven")


def written_call(tokenizer, schemas: list[dict]) -> tuple[dict, str, str, str]:
    """A call to the first tool with arguments of its schema's types, and how the chat template writes it: (the call
    {"name", "arguments"}, the assistant turn's text, the prompt's text before it, the text that opens a call (the
    turn's text up to the tool's name, past what a turn without a call also writes, to its first space: e.g.
    <tool_call>, [TOOL_CALLS], {"name":))."""
    function = schemas[0].get("function", schemas[0])
    call = {"name": function["name"], "arguments": example_arguments(function.get("parameters") or {})}
    asked = [{"role": "user", "content": "Call a tool."}]
    message = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": CALL_ID,
                                                                   "function": call}]}
    prompt = tokenizer.apply_chat_template(asked, tools=schemas, add_generation_prompt=True, tokenize=False)
    turn = _turn_of(prompt, tokenizer.apply_chat_template(asked + [message], tools=schemas, tokenize=False))
    try:  # what a turn without a call writes where the call would begin (a template may refuse an empty turn)
        quiet = _turn_of(prompt, tokenizer.apply_chat_template(asked + [{"role": "assistant", "content": ""}],
                                                               tools=schemas, tokenize=False))
    except Exception:
        quiet = ""
    before_name = turn[:turn.find(call["name"])] if call["name"] in turn else ""
    shared = len(os.path.commonprefix([before_name, quiet]))
    while shared and not before_name[shared - 1].isspace() and not before_name[shared:shared + 1].isspace():
        shared -= 1  # what both write ends where a word does
    words = before_name[shared:].split()
    return call, turn, prompt, words[0] if words else ""


def _turn_of(prompt: str, conversation: str) -> str:
    """The last turn's text: the conversation past what it shares with the prompt (a template may write the start of
    a turn differently once it holds one)."""
    return conversation[len(os.path.commonprefix([prompt, conversation])):]


def reader_for(name: str, tokenizer, schemas: list[dict], model: str) -> CallReader:
    """The reader of the model's calls: parser `name` (--tool_call_parser), or with "auto" the first of AUTO_ORDER,
    that reads a call the chat template writes (written_call) back as the same call. UsageError in one line naming
    --tool_call_parser and showing what the template wrote where it does not (no run trains with a parser that
    cannot read its own template's calls)."""
    schemas = schemas or [PROBE_SCHEMA]  # an agent's tools come with its calls, an environment may have none
    call, turn, prompt, opening = written_call(tokenizer, schemas)
    known = parser_names()
    if name != "auto" and name not in known:
        raise UsageError(f"--tool_call_parser {name}: not a parser vLLM knows; give auto or one of {', '.join(known)}")
    tried = {}  # name -> what it read, or why it cannot read this tokenizer's calls
    for candidate in AUTO_ORDER if name == "auto" else (name,):
        if candidate == "hf" and getattr(tokenizer, "response_template", None) is None:
            tried[candidate] = "the tokenizer has no response template"
            continue
        reader = CallReader(candidate, tokenizer, opening, turn.strip())
        try:
            got = reader.read(turn, schemas, prefix=prompt)
        except Exception as e:  # made for this tokenizer, a parser may fail (one without the tokens it looks for)
            tried[candidate] = f"it cannot read this tokenizer's text: {type(e).__name__}: {e}"
            continue
        if got.calls == [call] and not got.errors:
            return reader
        tried[candidate] = f"it read {got.calls or 'no call'}"
    written = f"the call {call['name']}({call['arguments']}) that the chat template of {model} writes as " \
              f"{turn.strip()[:160]!r}"
    if name == "auto":
        raise UsageError(f"--tool_call_parser auto: none of {', '.join(AUTO_ORDER)} reads back {written}: name the "
                         "parser of this format (--tool_call_parser, the names vllm serve takes), or give a template "
                         "whose calls one reads (--chat_template FILE)")
    raise UsageError(f"--tool_call_parser {name} does not read back {written} ({tried[name]}): name the parser of this "
                     "format, or auto to find it")


# The round trip's tool where the run has none to call (an environment without public methods).
PROBE_SCHEMA = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "the first number"},
                                     "b": {"type": "integer", "description": "the second number"}},
    "required": ["a", "b"]}}}
