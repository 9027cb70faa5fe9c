"""A chat model's output read as OpenAI's message: its reasoning, its content and its tool calls.

Reasoning models think between ``<think>`` and ``</think>`` (Qwen3, QwQ, DeepSeek-R1 and its
distills); that text is the message's ``reasoning`` (and vLLM's older ``reasoning_content``):
- ``qwen3``: thinking when the output opens ``<think>`` or the prompt leaves one open (QwQ's and
  newer Qwen templates write it; ``enable_thinking: false`` closes it in the prompt);
- ``deepseek_r1``: the output starts in thinking, with or without its ``<think>``, unless the prompt
  closed it.

Tool-calling models write calls in the format of their chat template, which ``tool_choice: "auto"``
reads back into ``tool_calls``:
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a block per call
  (Qwen2.5, Qwen3, Hermes 2/3);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>``
  (Qwen3-Coder, Qwen3.5), values typed by the tools' schemas;
- ``llama3_json``: the output is ``{"name": ..., "parameters": {...}}``, calls separated by ``;``,
  optionally after ``<|python_tag|>`` (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` (Mistral 7B v0.3,
  Nemo) or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (Mistral Small 3.2, Devstral);
- ``pythonic``: ``[get_weather(city="Paris"), ...]`` of Python literals, optionally between
  ``<|python_start|>`` and ``<|python_end|>`` (Llama 3.2's and 4's pythonic templates).

``OutputReader`` reads an output as it streams and hands out only what can no longer change: text
that may still turn out to open a marker (``<tool_`` ...), or trailing spaces, wait for what comes
next; a call goes out whole once it is closed; what a format cannot read (a call cut by max_tokens,
JSON that does not parse) is content at the end. Streamed pieces joined give exactly the one-shot
reading of the whole output.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field

from asyncserve.sampling_params import ThinkingMarks

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_FORMATS = ("qwen3", "deepseek_r1")


@dataclass
class Reading:
    """An output's parts; a streamed delta has the same shape (the new parts)."""
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)     # (name, arguments as JSON text)


# ---- helpers -------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    """An id for something answered (a call, a response item): the prefix and 24 random hex digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def settled(text: str, marker: str | None = None) -> str:
    """The part of a still-growing text that cannot change: without trailing whitespace (it may be
    the space before a marker, or the end) and without a possible start of ``marker``."""
    if marker is not None:
        text = text[:len(text) - held_back(text, marker)]
    return text.rstrip()


def find_once(text: str, marker: str, memo: dict, key: str) -> int:
    """text.find(marker) on a text that only grows between calls with the same memo: the search goes
    on from where the last one stopped (a stream would search its whole text at every token)."""
    found = memo.get(key)
    if found is not None:
        return found
    at = text.find(marker, max(0, memo.get(key + " searched", 0) - len(marker) + 1))
    if at >= 0:
        memo[key] = at
    else:
        memo[key + " searched"] = len(text)
    return at


def arguments_json(arguments) -> str | None:
    """A call's arguments as OpenAI's JSON text: an object, or a string that holds one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def json_call(value, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    for key in argument_keys:
        if key in value:
            arguments = arguments_json(value[key])
            return None if arguments is None else (value["name"], arguments)
    return value["name"], "{}"


def json_values(text: str, separator: str = "") -> list | None:
    """The JSON values that make up ``text``, separated by whitespace (and ``separator``); None if
    anything else is there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (separator and text[pos] == separator and values)):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):      # RecursionError: nested past the stack
            return None
        values.append(value)


# ---- tool-call formats ---------------------------------------------------------------------------

class ToolFormat:
    """How one family writes tool calls. ``read`` splits the part of an output after any reasoning
    into content and calls; while ``final`` is false it returns only what cannot change."""
    name = ""
    keeps_special_tokens = False     # the format's markers are special tokens, which decoding would drop

    def read(self, text: str, final: bool, memo: dict) -> tuple[str, list[tuple[str, str]]]:
        """memo: this output's own state: the request's tool schemas ("schemas") and the format's notes
        between calls on the same growing output."""
        raise NotImplementedError

    def call_id(self) -> str:
        return new_id("call")


class MarkedCalls(ToolFormat):
    """Calls after a marker that may follow some content: the content before it streams; from the
    marker on, ``calls`` reads what it can (those it returns while not final must stay)."""
    marker = ""

    def read(self, text: str, final: bool, memo: dict) -> tuple[str, list[tuple[str, str]]]:
        start = find_once(text, self.marker, memo, "marker")
        if start < 0:
            return (text if final else settled(text, self.marker)), []
        calls, end = self.calls(text, start, final, memo)
        rest = text[end:]
        if not final:
            return text[:start].rstrip(), calls
        if calls and not rest.strip():
            return text[:start].rstrip(), calls
        return text[:start] + rest, calls          # what did not read as calls stays content

    def calls(self, text: str, start: int, final: bool, memo: dict) -> tuple[list[tuple[str, str]], int]:
        """The calls read from ``start`` and where reading stopped."""
        raise NotImplementedError


class Hermes(MarkedCalls):
    name, marker, end_marker = "hermes", "<tool_call>", "</tool_call>"
    OPEN, CLOSE = re.compile(r"\s*<tool_call>\s*"), re.compile(r"\s*</tool_call>")

    def calls(self, text, start, final, memo):
        # each block's JSON is decoded where it starts, so a string in it may hold "</tool_call>"; the
        # calls read stay read (memo), and a block is tried only once a closing marker follows it
        calls, pos = memo.setdefault("calls", []), memo.get("pos", start)
        decoder = json.JSONDecoder()
        while not memo.get("stuck") and (opened := self.OPEN.match(text, pos)) is not None:
            if text.find(self.end_marker, opened.end()) < 0:
                break
            try:
                value, end = decoder.raw_decode(text, opened.end())
            except RecursionError:           # nested past the stack: no more text will read
                memo["stuck"] = True
                break
            except ValueError:
                break
            closed, call = self.CLOSE.match(text, end), json_call(value)
            if closed is None or call is None:
                break
            calls.append(call)
            pos = memo["pos"] = closed.end()
        return list(calls), pos


class Qwen3Coder(MarkedCalls):
    """<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call> (Qwen3-Coder,
    Qwen3.5): a value is raw text, typed by the tool's JSON schema (memo["schemas"]): a string stays
    text, anything else is read as JSON (or a Python literal, as the templates write True and None)."""
    name, marker = "qwen3_coder", "<tool_call>"
    BLOCK = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def calls(self, text, start, final, memo):
        calls, pos = [], start
        while (block := self.BLOCK.match(text, pos)) is not None:
            name, body = block.group(1).strip(), block.group(2)
            schema = (memo.get("schemas") or {}).get(name) or {}
            arguments, at = {}, 0
            while (p := self.PARAMETER.match(body, at)) is not None:
                arguments[p.group(1).strip()] = self.value(p.group(2), schema.get("properties", {}).get(
                    p.group(1).strip(), {}))
                at = p.end()
            if body[at:].strip() or not name:
                break
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            pos = block.end()
        return calls, pos

    @staticmethod
    def value(text: str, schema: dict):
        kinds = schema.get("type") if isinstance(schema, dict) else None
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "string" in kinds and len(kinds) == 1:
            return text
        try:
            return json.loads(text)
        except ValueError:
            pass
        try:
            return ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text


class Mistral(MarkedCalls):
    name, marker, keeps_special_tokens = "mistral", "[TOOL_CALLS]", True
    ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
    ID_CHARS = string.ascii_letters + string.digits

    def calls(self, text, start, final, memo):
        if not final:               # a list is read once whole
            return [], start
        calls = []
        for piece in text[start + len(self.marker):].split(self.marker):
            piece = piece.strip()
            if piece.startswith("["):        # [{"name": ..., "arguments": {...}}, ...]
                values = json_values(piece)
                found = [json_call(v) for v in values[0]] if values and len(values) == 1 and \
                    isinstance(values[0], list) else [None]
            elif self.ARGS in piece:         # name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...}
                name, arguments = piece.split(self.ARGS, 1)
                name = name.split(self.CALL_ID, 1)[0]
                values = json_values(arguments)
                found = [json_call({"name": name.strip(), "arguments": values[0]})
                         if values is not None and len(values) == 1 else None]
            else:
                found = [None]
            if None in found or not found:
                return [], start
            calls += found
        return calls, len(text)

    def call_id(self) -> str:
        # Mistral's templates take back only ids of 9 letters and digits
        return "".join(secrets.choice(self.ID_CHARS) for _ in range(9))


class WholeOutputCalls(ToolFormat):
    """The whole output is the calls when it starts with ``opener`` (after an optional ``tag``): it
    is then held to the end and read; anything else is content as it comes."""
    opener, tag, end_tag = "", "", ""

    def read(self, text: str, final: bool, memo: dict) -> tuple[str, list[tuple[str, str]]]:
        body = text.lstrip()
        if self.tag and body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        elif not final and (self.tag.startswith(body) or not body):
            return "", []            # nothing yet, or what may be the tag
        if not body.startswith(self.opener):
            return (text if final else settled(text)), []
        if not final:
            return "", []
        if self.end_tag and body.rstrip().endswith(self.end_tag):
            body = body.rstrip()[:-len(self.end_tag)]
        calls = self.calls(body)
        return ("", calls) if calls else (text, [])

    def calls(self, body: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3Json(WholeOutputCalls):
    name, opener, tag = "llama3_json", "{", "<|python_tag|>"

    def calls(self, body):
        values = json_values(body, separator=";")
        if not values:
            return None
        calls = [json_call(v, ("parameters", "arguments")) for v in values]
        return None if None in calls else calls


class Pythonic(WholeOutputCalls):
    name, opener, tag, end_tag = "pythonic", "[", "<|python_start|>", "<|python_end|>"
    NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

    def calls(self, body):
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg is not None for k in node.keywords)):
                return None
            try:
                arguments = {k.arg: self.literal(k.value) for k in node.keywords}
            except (ValueError, TypeError, RecursionError):
                return None
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def literal(self, node):
        if isinstance(node, ast.Name) and node.id in self.NAMES:
            return self.NAMES[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise ValueError("** in a dict")
            return {self.literal(k): self.literal(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)       # strings, numbers, and their signs


TOOL_FORMATS = {f.name: f for f in (Hermes, Qwen3Coder, Llama3Json, Mistral, Pythonic)}


# ---- which formats a model uses --------------------------------------------------------------------

def detected_tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template writes its calls in, if it is one of ours."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template:
        return "pythonic"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return None


def detected_reasoning_format(chat_template: str | None) -> str | None:
    template = chat_template or ""
    if THINK_CLOSE not in template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"


def prompt_thinking(prompt: str) -> bool | None:
    """Whether the rendered prompt leaves the answer thinking: True when it ends inside a ``<think>``
    block (the template began it), False when it ends with one closed (thinking turned off, as
    ``enable_thinking: false`` does), None when it says neither."""
    if prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE):
        return True
    return False if prompt.rstrip().endswith(THINK_CLOSE) else None


def starts_thinking(reasoning: str | None, prompt_thinks: bool | None) -> bool:
    """Whether the answer starts inside its thinking: a deepseek_r1 one unless the prompt closed it, a
    qwen3 one when the prompt opened it."""
    return reasoning is not None and bool(prompt_thinks or (reasoning == "deepseek_r1" and prompt_thinks is None))


def thinking_marks(tokenizer, reasoning: str, prompt_thinks: bool | None) -> ThinkingMarks | None:
    """Where a constraint starts on a model that thinks first (StructuredOutputs.thinking): None when the
    prompt closed the thinking, or when the vocabulary has no single token for its end (the constraint
    then holds from the first token, and the thinking is not read)."""
    end = tokenizer.backend.token_to_id(THINK_CLOSE)
    if prompt_thinks is False or end is None:
        return None
    return ThinkingMarks(end=end, begin=tokenizer.backend.token_to_id(THINK_OPEN),
                         open=starts_thinking(reasoning, prompt_thinks))


@dataclass(frozen=True)
class ChatFormats:
    """The server's reading of chat outputs: from --tool-call-parser and --reasoning-parser, or what
    the chat template shows ("auto"); "none" turns one off."""
    tools: ToolFormat | None
    reasoning: str | None
    auto_tool_choice: bool           # --enable-auto-tool-choice

    @classmethod
    def of(cls, tool_parser: str, reasoning_parser: str, auto_tool_choice: bool, tokenizer) -> "ChatFormats":
        chat_template = tokenizer.chat_template
        tools = detected_tool_format(chat_template) if tool_parser == "auto" else \
            None if tool_parser == "none" else tool_parser
        reasoning = detected_reasoning_format(chat_template) if reasoning_parser == "auto" else \
            None if reasoning_parser == "none" else reasoning_parser
        return cls(TOOL_FORMATS[tools]() if tools else None, reasoning, auto_tool_choice)


def check_format_names(tool_parser: str, reasoning_parser: str) -> None:
    if tool_parser not in ("auto", "none", *TOOL_FORMATS):
        raise ValueError(f"tool_call_parser must be auto, none or one of {', '.join(TOOL_FORMATS)}, "
                         f"got {tool_parser!r}")
    if reasoning_parser not in ("auto", "none", *REASONING_FORMATS):
        raise ValueError(f"reasoning_parser must be auto, none or one of {', '.join(REASONING_FORMATS)}, "
                         f"got {reasoning_parser!r}")


# ---- reading one output ----------------------------------------------------------------------------

class OutputReader:
    """One choice's output, read whole (``read(text)``) or as it streams (``feed(delta, final)``, which
    returns the new parts)."""

    def __init__(self, tools: ToolFormat | None = None, reasoning: str | None = None,
                 prompt_thinks: bool | None = None, max_calls: int | None = None, schemas: dict | None = None):
        """prompt_thinks: prompt_thinking(the rendered prompt). A deepseek_r1 answer starts thinking
        unless the prompt closed it; a qwen3 one when the prompt opened it. max_calls: calls past it
        are dropped (parallel_tool_calls: false, as vLLM does). schemas: the request's tools' parameter
        schemas by name (qwen3_coder types its values by them)."""
        self.tools, self.reasoning, self.max_calls, self.schemas = tools, reasoning, max_calls, schemas or {}
        self.starts_thinking = starts_thinking(reasoning, prompt_thinks)
        self.text = ""
        self.sent = Reading()              # what feed handed out so far: at the end, the whole reading
        self.memo: dict = {"schemas": self.schemas}

    def feed(self, delta: str, final: bool) -> Reading:
        if not delta and not final:
            return Reading()
        self.text += delta
        now = self.read(self.text, final, self.memo)
        new = Reading(now.reasoning[len(self.sent.reasoning):], now.content[len(self.sent.content):],
                      now.calls[len(self.sent.calls):])
        self.sent = now
        return new

    @property
    def thinking(self) -> bool:
        """The output fed so far ends inside its thinking (or may still begin it)."""
        return self.memo.get("thinking", self.starts_thinking)

    def read(self, text: str, final: bool = True, memo: dict | None = None) -> Reading:
        """memo: feed's notes on the same growing text (None: read afresh)."""
        memo = {"schemas": self.schemas} if memo is None else memo
        reasoning, rest = "", text
        if self.reasoning is not None:
            reasoning, rest, thought = self.split_thinking(text, final, memo)
            memo["thinking"] = rest is None
            if rest is None:
                return Reading(reasoning)
            if thought:
                rest = rest.lstrip()
        if self.tools is None:
            return Reading(reasoning, rest)
        content, calls = self.tools.read(rest, final, memo)
        return Reading(reasoning, content, calls[:self.max_calls])

    def split_thinking(self, text: str, final: bool, memo: dict) -> tuple[str, str | None, bool]:
        """(reasoning, the rest or None while still thinking, whether there was thinking)."""
        body = text
        if not self.starts_thinking:
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                body = stripped[len(THINK_OPEN):]
            elif not final and THINK_OPEN.startswith(stripped):
                return "", None, False          # nothing yet, or what may be <think>
            else:
                return "", text, False
        elif body.lstrip().startswith(THINK_OPEN):       # a model that writes <think> again anyway
            body = body.lstrip()[len(THINK_OPEN):]
        elif not final and THINK_OPEN.startswith(body.lstrip()):
            return "", None, True
        end = find_once(body, THINK_CLOSE, memo, "thinking end")
        if end >= 0:
            return body[:end].strip(), body[end + len(THINK_CLOSE):], True
        return (body.strip() if final else settled(body, THINK_CLOSE).lstrip()), None, True
