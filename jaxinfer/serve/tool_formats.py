"""Tool-call formats: how each family of chat templates teaches its model to call functions.

One row per format (`ToolFormat`, the `TABLE`): how the format is recognised in a template's
source, which of its tags decoding must keep where a vocabulary makes them special tokens, how
the calls of a finished answer are read (XML formats carry bare text, typed here by the tool's
JSON schema), what a streaming reader must hold back, and the llguidance grammar that makes a
model write calls. Text inside `<think>...</think>` is never a call. serve/tools.py checks a
request's tools and turns what is read here into OpenAI's tool_calls.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..runtime.structured import JSON_OPTIONS

Schemas = Mapping[str, dict]  # function name -> the JSON schema of its arguments
Call = tuple[str, dict]  # (name, arguments)
Found = tuple[list[str], list[Call]]  # the text between and after the calls; the calls
THINK, UNTHINK = "<think>", "</think>"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a function's name, as tools.check_tools allows
MAX_BOUNDED_TEXT = 4096  # a string parameter's maxLength above this is not written in a grammar

# ---- the formats' tags -------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # hermes, qwen3_coder, glm45
FUNCTION, END_FUNCTION = "<function=", "</function>"  # qwen3_coder
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
ARG_KEY, END_ARG_KEY = "<arg_key>", "</arg_key>"  # glm45
ARG_VALUE, END_ARG_VALUE = "<arg_value>", "</arg_value>"
PYTHON_TAG = "<|python_tag|>"  # llama3_json: Llama's tool-call token (the reader takes both)
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # mistral
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # deepseek
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _openai_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _mistral_id() -> str:
    # Mistral's templates refuse a tool_call_id that is not 9 letters or digits
    return uuid.uuid4().hex[:9]


@dataclass(frozen=True)
class ToolFormat:
    """One way a template's model writes its calls."""

    name: str
    detect: Callable[[str], bool]  # whether a template's source writes calls this way
    read: Callable[[str, Schemas], Found | None]  # the calls a text begins with (None: malformed)
    call: Callable[[int, str, dict], list[str]]  # Lark rules `call_<i>` writing one call
    opens: tuple[str, ...] = ()  # text that begins a call anywhere outside <think>
    leading: tuple[str, ...] = ()  # text that begins a call only at the answer's start
    frame: tuple[str, str, str] = ("", "\n", "")  # several forced calls: before, between, after
    # the tags `read` needs: where a vocabulary makes them special tokens, decoding keeps them
    # as text (llama.cpp's preserved tokens: Mistral's [TOOL_CALLS] and [ARGS] are special)
    preserved: tuple[str, ...] = ()
    several: bool = True  # whether one answer can carry several calls
    new_id: Callable[[], str] = _openai_id  # a call's id, as the template will want it back


# ---- reading answers ---------------------------------------------------------------------


def read(fmt: ToolFormat, text: str, schemas: Schemas) -> tuple[str | None, list[Call]] | None:
    """(content, calls) of a whole answer, or None when it makes no well-formed call (then it
    is all content). Content is the text outside the calls, each piece stripped, joined by
    newlines (the text before the first call keeps its start), None if blank; a tag that the
    answer stopped in (max_tokens) after its calls, one that opens a call or the one that
    closes the calls (DeepSeek's), is not content."""
    start = first_call(fmt, text)
    if start < 0:
        return None
    found = fmt.read(text[start:], schemas)
    if found is None or not found[1]:
        return None
    pieces, calls = found
    if pieces:
        last = pieces[-1]
        pieces[-1] = last[: len(last) - _stopped_in(last, (*fmt.opens, fmt.frame[2]))]
    outside = [text[:start].rstrip(), *(piece.strip() for piece in pieces)]
    return "\n".join(piece for piece in outside if piece) or None, calls


def first_call(fmt: ToolFormat, text: str) -> int:
    """Where the answer's first call begins (-1: none). Reasoning that the prompt opened (no
    <think> in the answer) is split off before (serve/thinking.py), with the prompt in view."""
    if fmt.leading:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(fmt.leading) else -1
    pos, think = 0, False
    while True:
        if think:
            close = text.find(UNTHINK, pos)
            if close < 0:
                return -1
            pos, think = close + len(UNTHINK), False
            continue
        at, tag = _earliest(text, pos, (*fmt.opens, THINK))
        if tag != THINK:
            return at
        pos, think = at + len(THINK), True


class Reader:
    """An answer as it streams: `feed` returns the content that is safe to send now, holding
    back what may begin a call (a partial tag at the end) and blanks that may precede one;
    once a call begins nothing more is sent (what follows comes from `read` at the end). What
    was sent is always the start of `read`'s content (or of the text, when no call parses)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""  # everything fed so far
        self.sent = 0  # text[:sent] went out as content
        self.pos = 0  # tags that begin before pos are settled; `think` holds at pos
        self.think = False  # inside <think>...</think>: no tag but </think> counts
        self.calling = False  # a call has begun
        self.plain = False  # leading formats: the answer does not begin with a call

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.calling:
            return ""
        text, leading = self.text, self.fmt.leading
        if leading:
            if not self.plain:
                body = text.lstrip()
                if body.startswith(leading):
                    self.calling = True
                    return ""
                if any(tag.startswith(body) for tag in leading):  # blank, or a partial tag
                    return ""
                self.plain = True
            end = len(text)  # nothing after the start is a call
        else:
            end = self._scan()
        out = text[self.sent : end] if leading else text[self.sent : end].rstrip()
        self.sent += len(out)
        return out

    def _scan(self) -> int:
        """How far content may go out; moves pos (and think) over the settled tags."""
        text, tags = self.text, (*self.fmt.opens, THINK)
        while True:
            if self.think:
                close = text.find(UNTHINK, self.pos)
                if close < 0:  # reasoning is content: all of it may go
                    self.pos = max(self.pos, len(text) - _partial(text, UNTHINK))
                    return len(text)
                self.pos, self.think = close + len(UNTHINK), False
                continue
            at, tag = _earliest(text, self.pos, tags)
            if tag == THINK:
                self.pos, self.think = at + len(THINK), True
            elif at >= 0:
                self.calling = True
                return at
            else:
                held = max(_partial(text, t) for t in tags)
                self.pos = max(self.pos, len(text) - held)
                return self.pos


def _earliest(text: str, pos: int, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """(where, which) of the first of `tags` in text[pos:]; (-1, None) if none."""
    best, which = -1, None
    for tag in tags:
        at = text.find(tag, pos)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, tag
    return best, which


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _stopped_in(text: str, tags: tuple[str, ...]) -> int:
    """The length of the end of `text` where the answer stopped (max_tokens) inside one of
    `tags`: a start of the tag, and the U+FFFD that decoding writes for the bytes of a
    character the answer stopped inside (a byte-level vocabulary spells DeepSeek's "｜" and
    "▁" a byte at a time); 0 if none."""
    body = text.rstrip("\ufffd")
    held = max((_partial(body, tag) for tag in tags if tag), default=0)
    return len(text) - len(body) + held if held else 0


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _json_call(call, *keys: str) -> Call | None:
    """(name, arguments) of one call's JSON (text or decoded), None if malformed; arguments
    may come as the JSON text of an object."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except ValueError:
            return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments: object = next((call[key] for key in keys if key in call), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


Inner = Callable[[str, int], tuple[list[Call], int] | None]  # calls read at text[pos:], end


def _blocks(
    text: str, open_: str, close: str, inner: Inner, inside: tuple[str, ...] = ()
) -> Found | None:
    """Calls in `open_ ... close` blocks (the text begins with one), each block's inside read
    from its start (so a value may hold the close tag). A last block that lacks its close, or
    stopped inside it (the answer stopped; not where the tags `inside` that could go on with
    the block's inside start the same), is taken as it is; one that does not read, after calls
    that do, is where the answer stopped (max_tokens): it is dropped and the calls before it
    stand."""
    pos, calls, pieces = 0, list[Call](), list[str]()
    while True:
        found = inner(text, pos + len(open_))
        end = _skip_space(text, found[1]) if found else 0
        rest = text[end:]
        if found and found[0] and rest and _stopped_in(rest, (close,)) == len(rest):
            if not any(tag.startswith(rest) for tag in inside):
                return pieces, calls + found[0]
        if not found or not found[0] or (end < len(text) and not text.startswith(close, end)):
            stopped = calls and text.find(close, pos) < 0
            return (pieces, calls) if stopped else None
        calls += found[0]
        if end == len(text):
            return pieces, calls
        after = end + len(close)
        pos = text.find(open_, after)
        pieces.append(text[after : len(text) if pos < 0 else pos])
        if pos < 0:
            return pieces, calls


def _read_hermes(text: str, schemas: Schemas) -> Found | None:
    decoder = json.JSONDecoder()

    def inner(text: str, pos: int) -> tuple[list[Call], int] | None:
        try:
            obj, end = decoder.raw_decode(text, _skip_space(text, pos))
        except ValueError:
            return None
        call = _json_call(obj, "arguments", "parameters")
        return None if call is None else ([call], end)

    return _blocks(text, OPEN, CLOSE, inner)


def _read_llama3_json(text: str, schemas: Schemas) -> Found | None:
    body = text.lstrip()
    pos = len(PYTHON_TAG) if body.startswith(PYTHON_TAG) else 0
    calls, decoder = [], json.JSONDecoder()
    while True:  # one call, or several separated by ";"
        pos = _skip_space(body, pos)
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = _json_call(obj, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        pos = _skip_space(body, pos)
        if pos < len(body) and body[pos] == ";":
            pos = _skip_space(body, pos + 1)
        elif pos < len(body):
            return None
        if pos == len(body):
            return [], calls


def _read_qwen3_coder(text: str, schemas: Schemas) -> Found | None:
    def inner(text: str, pos: int) -> tuple[list[Call], int] | None:
        calls = []  # one or more <function=...> blocks
        while text.startswith(FUNCTION, pos := _skip_space(text, pos)):
            found = _xml_function(text, pos, schemas)
            if found is None:
                return None
            calls.append(found[0])
            pos = found[1]
        return calls, pos

    if text.startswith(FUNCTION):  # a <function=...> the model wrote without <tool_call>
        return _blocks(OPEN + text, OPEN, CLOSE, inner, (FUNCTION,))
    return _blocks(text, OPEN, CLOSE, inner, (FUNCTION,))


def _xml_function(text: str, pos: int, schemas: Schemas) -> tuple[Call, int] | None:
    """qwen3_coder's `<function=NAME>` and its `<parameter=KEY>\nVALUE\n</parameter>` list,
    read from pos; (the call, where its </function> ends)."""
    head = text.find(">", pos)
    name = text[pos + len(FUNCTION) : max(head, pos)].strip()
    if head < 0 or not NAME.fullmatch(name):
        return None
    schema, arguments = schemas.get(name, {}), {}
    pos = _skip_space(text, head + 1)
    while not text.startswith(END_FUNCTION, pos):
        key_end = text.find(">", pos)
        if not text.startswith(PARAMETER, pos) or key_end < 0:
            return None
        key = text[pos + len(PARAMETER) : key_end].strip()
        end = text.find(END_PARAMETER, key_end)
        if end >= 0:
            pos = end + len(END_PARAMETER)
        else:  # no </parameter> at all: the value ends at the next tag (as vLLM reads it)
            stops = [
                at
                for at in (text.find(PARAMETER, key_end), text.find(END_FUNCTION, key_end))
                if at >= 0
            ]
            if not stops:
                return None
            end = pos = min(stops)
        value = text[key_end + 1 : end]
        value = value[1:] if value.startswith("\n") else value  # the template's own newlines
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = _typed(value, _property(schema, key), schema)
        pos = _skip_space(text, pos)
    return (name, arguments), pos + len(END_FUNCTION)


def _read_glm45(text: str, schemas: Schemas) -> Found | None:
    def inner(text: str, pos: int) -> tuple[list[Call], int] | None:
        stops = [at for at in (text.find(t, pos) for t in ("\n", ARG_KEY, CLOSE)) if at >= 0]
        cut = min(stops, default=-1)  # none: the answer stopped inside the name
        name = text[pos:cut].strip()
        if cut < 0 or not NAME.fullmatch(name):
            return None
        schema, arguments = schemas.get(name, {}), {}
        while text.startswith(ARG_KEY, pos := _skip_space(text, cut)):
            key_end = text.find(END_ARG_KEY, pos)
            value_at = _skip_space(text, key_end + len(END_ARG_KEY))
            value_end = text.find(END_ARG_VALUE, value_at)
            if key_end < 0 or not text.startswith(ARG_VALUE, value_at) or value_end < 0:
                return None
            key = text[pos + len(ARG_KEY) : key_end].strip()
            value = text[value_at + len(ARG_VALUE) : value_end]
            arguments[key] = _typed(value, _property(schema, key), schema)
            cut = value_end + len(END_ARG_VALUE)
        return [(name, arguments)], pos

    return _blocks(text, OPEN, CLOSE, inner, (ARG_KEY,))


V11_HEAD = re.compile(  # [TOOL_CALLS] NAME([CALL_ID]id)[ARGS]
    rf"\s*({NAME.pattern})(?:{re.escape(CALL_ID)}[A-Za-z0-9_-]*)?{re.escape(ARGS)}"
)


def _read_mistral(text: str, schemas: Schemas) -> Found | None:
    """[TOOL_CALLS] then a JSON list of calls, or (v11) NAME[ARGS]{...}, each call after its
    own [TOOL_CALLS] (Mistral Small 3.2 puts [CALL_ID]id before [ARGS]). A last [TOOL_CALLS]
    that does not read, after calls that do, is where the answer stopped: it is dropped."""
    calls: list[Call] = []
    pos, decoder = 0, json.JSONDecoder()
    while text.startswith(TOOL_CALLS, pos):
        pos = _skip_space(text, pos + len(TOOL_CALLS))
        found = _mistral_calls(text, pos, decoder)
        if found is None:
            last = text.find(TOOL_CALLS, pos) < 0
            return ([], calls) if last and calls else None
        pos, more = found
        calls += more
        after = _skip_space(text, pos)
        if text.startswith(TOOL_CALLS, after):
            pos = after
    return [text[pos:]], calls


def _mistral_calls(text: str, pos: int, decoder: json.JSONDecoder) -> tuple[int, list[Call]] | None:
    """(where they end, the calls) of what one [TOOL_CALLS] carries, or None. A JSON list that
    the answer stopped in (max_tokens) gives the calls it completed."""
    head = V11_HEAD.match(text, pos)
    if head or not text.startswith("[", pos):
        try:
            value, end = decoder.raw_decode(text, _skip_space(text, head.end()) if head else pos)
        except ValueError:
            return None
        named = {"name": head.group(1), "arguments": value} if head else value
        call = _json_call(named, "arguments", "parameters")
        return None if call is None else (end, [call])
    calls: list[Call] = []
    end = pos + 1
    while True:  # the list's items, one by one
        try:
            item, end = decoder.raw_decode(text, _skip_space(text, end))
        except ValueError:
            return (len(text), calls) if calls and "]" not in text[end:] else None
        call = _json_call(item, "arguments", "parameters")
        if call is None:
            return None
        calls.append(call)
        end = _skip_space(text, end)
        if end == len(text):  # it stopped before the "]"
            return end, calls
        if text.startswith("]", end):
            return end + 1, calls
        if not text.startswith(",", end):
            return None
        end += 1


DEEPSEEK_V3_BODY = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\s*\n```(?:json)?\s*\n(.*)\n```\s*", re.S)


def _read_deepseek(text: str, schemas: Schemas) -> Found | None:
    """<｜tool▁calls▁begin｜> then calls, each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
    and its arguments in a ```json fence (V3, R1) or `NAME<｜tool▁sep｜>{...}` (V3.1), then
    <｜tool▁calls▁end｜>. A last call left unclosed (the answer stopped) is read, or dropped
    if it does not read and calls precede it."""
    pos = len(CALLS_BEGIN) if text.startswith(CALLS_BEGIN) else 0
    calls: list[Call] = []
    while text.startswith(CALL_BEGIN, pos := _skip_space(text, pos)):
        end = text.find(CALL_END, pos)
        call = _deepseek_call(text[pos + len(CALL_BEGIN) : len(text) if end < 0 else end])
        if call is None:
            return ([], calls) if end < 0 and calls else None
        calls.append(call)
        pos = len(text) if end < 0 else end + len(CALL_END)
    if not calls:
        return None
    after = _skip_space(text, pos)
    pos = after + len(CALLS_END) if text.startswith(CALLS_END, after) else pos
    return [text[pos:]], calls


def _deepseek_call(body: str) -> Call | None:
    sep = body.find(SEP)
    if sep < 0:
        return None
    head, rest = body[:sep].strip(), body[sep + len(SEP) :]
    fenced = DEEPSEEK_V3_BODY.fullmatch(rest) if head == "function" else None
    name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (head, rest)
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return None
    return (name, decoded) if NAME.fullmatch(name) and isinstance(decoded, dict) else None


# ---- typing bare values by schema --------------------------------------------------------


def _property(schema: dict, key: str) -> dict | None:
    """The schema of parameter `key` (None: unknown, read as text)."""
    properties = schema.get("properties")
    if isinstance(properties, dict) and isinstance(properties.get(key), dict):
        return properties[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _typed(raw: str, schema: dict | None, root: dict) -> object:
    """A bare XML value as its schema types it: a string parameter (or an unknown one) is the
    text itself; any other is read as JSON, or a Python literal (templates that write values
    with Jinja's `string` filter give True, None, {'a': 1}), else kept as text, as vLLM's
    qwen3_coder parser does."""
    if _is_text(schema, root):
        return raw
    text = raw.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    words = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in words:
        return words[text.lower()]
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw
    return value if _is_json(value) else raw


def _is_json(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool)


def _is_text(schema: dict | None, root: dict) -> bool:
    """Whether a parameter is written as bare text: its schema allows strings only, or says
    nothing of its type."""
    types = _types(schema, root)
    return types is None or types == {"string"}


def _types(schema, root: dict, depth: int = 0) -> set[str] | None:
    """The JSON types a schema allows (None: it does not say)."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    if isinstance(schema.get("$ref"), str):
        return _types(_resolve(root, schema["$ref"]), root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {_json_type(v) for v in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            union: set[str] = set()
            for sub in schema[key]:
                types = _types(sub, root, depth + 1)
                if types is None:
                    return None
                union |= types
            return union
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return None


def _json_type(value) -> str:
    for kind, types in (
        ("null", type(None)),
        ("boolean", bool),
        ("integer", int),
        ("number", float),
        ("string", str),
        ("array", list),
    ):
        if isinstance(value, types):
            return kind
    return "object"


def _resolve(root: dict, ref: str):
    node: object = root
    if not ref.startswith("#"):
        return None
    for part in ref.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


# ---- forcing calls -----------------------------------------------------------------------


def forced(fmt: ToolFormat, names: list[str], schemas: Schemas, several: bool) -> str:
    """The Lark grammar (llguidance's) of an answer that is one call, or with `several` one or
    more, of the functions `names`, each with its arguments' schema as given (already closed:
    tools.grammar makes an absent additionalProperties false)."""
    rules = [rule for i, name in enumerate(names) for rule in fmt.call(i, name, schemas[name])]
    before, between, after = fmt.frame
    if several and fmt.several:
        calls = f"call ({_lit(between)} call)*" if between else "call+"
    else:
        calls = "call"
    start = " ".join(
        part
        for part in (_lit(before) if before else "", calls, _lit(after) if after else "")
        if part
    )
    alternatives = " | ".join(f"call_{i}" for i in range(len(names)))
    return "\n".join(["%llguidance {}", f"start: {start}", f"call: {alternatives}", *rules]) + "\n"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def enforced(schema: dict, root: dict | None = None) -> dict:
    """A schema as one %json of a grammar: its own root, so `x-guidance` (read at the root
    only) bounds the blanks, and a parameter's schema keeps the $defs its $refs name."""
    out = {**schema, "x-guidance": JSON_OPTIONS}
    for key in ("$defs", "definitions"):
        if root is not None and key in root and key not in out:
            out[key] = root[key]
    return out


def _json_call_rules(head: str, tail: str) -> Callable[[int, str, dict], list[str]]:
    """Rules of a call whose arguments are a JSON object between `head` and `tail` (both with
    {name} in them)."""

    def call(i: int, name: str, schema: dict) -> list[str]:
        body = enforced({**schema, "type": "object"})
        return [
            f"call_{i}: {_lit(head.format(name=name))} args_{i} {_lit(tail.format(name=name))}",
            f"args_{i}: %json {json.dumps(body)}",
        ]

    return call


def _xml_call_rules(head: str, tail: str, key: str, close: str):
    """Rules of a call whose arguments are written one per parameter: `key` (with {key}) then
    the value then `close`. A string parameter is free text without `close`'s tag (bounded by
    maxLength, or one of its enum); any other is JSON of its schema. The properties come in
    their schema's order, the required ones always; others only where additionalProperties
    allows them."""
    tag = close.strip()  # the tag free text may not contain

    def call(i: int, name: str, schema: dict) -> list[str]:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
        keys = list(properties) + [r for r in required if r not in properties]
        rules, parts = [], []
        for j, k in enumerate(keys):
            rule = f"p_{i}_{j}"
            rules += _value_rules(rule, _lit(key.format(key=k)), properties.get(k), schema, close)
            parts.append(rule if k in required else f"{rule}?")
        extra = schema.get("additionalProperties", "properties" not in schema)
        if extra is not False and extra is not None:
            names = "|".join(_regex_escape(k) for k in keys)
            rules.append(
                f"x_{i}: {_lit(key.split('{key}')[0])} XN_{i} {_lit(key.split('{key}')[1])} xv_{i}"
            )
            rules.append(f"XN_{i}: /[^<>=\\n]+/" + (f" & ~/({names})/" if names else ""))
            rules += _value_rules(
                f"xv_{i}", "", extra if isinstance(extra, dict) else None, schema, close
            )
            parts.append(f"x_{i}*")
        body = " ".join([_lit(head.format(name=name)), *parts, _lit(tail.format(name=name))])
        return [f"call_{i}: {body}", *rules]

    def _value_rules(rule: str, prefix: str, prop, root: dict, close: str) -> list[str]:
        """Rules `rule` writing `prefix`, a value of schema `prop`, and `close`."""
        lead = f"{prefix} " if prefix else ""
        if not _is_text(prop, root):
            return [
                f"{rule}: {lead}{rule}_json {_lit(close)}",
                f"{rule}_json: %json {json.dumps(enforced(prop, root))}",
            ]
        enum = _string_choices(prop, root)
        if enum is not None:
            choices = " | ".join(_lit(v) for v in enum)
            return [f"{rule}: {lead}({choices}) {_lit(close)}"]
        top = prop.get("maxLength") if isinstance(prop, dict) else None
        low = prop.get("minLength") if isinstance(prop, dict) else None
        low = low if isinstance(low, int) and low > 0 else 0
        if isinstance(top, int) and low <= top <= MAX_BOUNDED_TEXT:
            size = f"{{{low},{top}}}"
        else:
            size = f"{{{low},}}" if low else "*"
        text = f"/(?s:.{size})/ & ~/(?s:.*){_regex_escape(tag)}(?s:.*)/"
        terminal = rule.upper()
        return [
            f"{rule}: {lead}{terminal}",
            f"{terminal}: {terminal}_TEXT {_lit(close)}",
            f"{terminal}_TEXT: {text}",
        ]

    return call


def _string_choices(schema, root: dict) -> list[str] | None:
    """The strings a string parameter may take, where its schema lists them."""
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        schema = _resolve(root, schema["$ref"])
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("const"), str):
        return [schema["const"]]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return enum
    return None


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust regex syntax)."""
    out = []
    for char in text:
        if char in "\\.+*?()|[]{}^$#&-~/":
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        else:
            out.append(char)
    return "".join(out)


def _detect_xml(source: str) -> bool:
    return OPEN in source and FUNCTION in source and ARG_KEY not in source


def _detect_hermes(source: str) -> bool:
    return OPEN in source and FUNCTION not in source and ARG_KEY not in source


def _detect_llama3_json(source: str) -> bool:
    if any(tag in source for tag in (OPEN, ARG_KEY, TOOL_CALLS, CALLS_BEGIN)):
        return False
    return PYTHON_TAG in source or '"parameters"' in source


TABLE: dict[str, ToolFormat] = {
    f.name: f
    for f in [
        # Hermes 2/3, Qwen 2.5, Qwen3, QwQ
        ToolFormat(
            name="hermes",
            detect=_detect_hermes,
            read=_read_hermes,
            call=_json_call_rules(OPEN + '\n{{"name": "{name}", "arguments": ', "}}\n" + CLOSE),
            opens=(OPEN,),
            preserved=(OPEN, CLOSE),
        ),
        # Llama 3.1, 3.2, 3.3
        ToolFormat(
            name="llama3_json",
            detect=_detect_llama3_json,
            read=_read_llama3_json,
            call=_json_call_rules('{{"name": "{name}", "parameters": ', "}}"),
            leading=("{", PYTHON_TAG),
            several=False,
            preserved=(PYTHON_TAG,),
        ),
        # Qwen3-Coder, Qwen3.5, Qwen3.6
        ToolFormat(
            name="qwen3_coder",
            detect=_detect_xml,
            read=_read_qwen3_coder,
            call=_xml_call_rules(
                OPEN + "\n" + FUNCTION + "{name}>\n",
                END_FUNCTION + "\n" + CLOSE,
                PARAMETER + "{key}>\n",
                "\n" + END_PARAMETER + "\n",
            ),
            opens=(OPEN, FUNCTION),
            preserved=(OPEN, CLOSE),
        ),
        # GLM-4.5, GLM-4.6
        ToolFormat(
            name="glm45",
            detect=lambda source: ARG_KEY in source,
            read=_read_glm45,
            call=_xml_call_rules(
                OPEN + "{name}\n",
                CLOSE,
                ARG_KEY + "{key}" + END_ARG_KEY + "\n" + ARG_VALUE,
                END_ARG_VALUE + "\n",
            ),
            opens=(OPEN,),
            preserved=(OPEN, CLOSE, ARG_KEY, END_ARG_KEY, ARG_VALUE, END_ARG_VALUE),
        ),
        # Mistral Nemo, Mistral Small 3/3.1 (a JSON list after [TOOL_CALLS])
        ToolFormat(
            name="mistral",
            detect=lambda source: TOOL_CALLS in source and ARGS not in source,
            read=_read_mistral,
            call=_json_call_rules('{{"name": "{name}", "arguments": ', "}}"),
            opens=(TOOL_CALLS,),
            frame=(TOOL_CALLS + "[", ", ", "]"),
            new_id=_mistral_id,
            preserved=(TOOL_CALLS,),
        ),
        # Mistral Small 3.2, Devstral, Magistral (each call [TOOL_CALLS]name[ARGS]{...})
        ToolFormat(
            name="mistral_v11",
            detect=lambda source: TOOL_CALLS in source and ARGS in source,
            read=_read_mistral,
            call=_json_call_rules(TOOL_CALLS + "{name}" + ARGS, ""),
            opens=(TOOL_CALLS,),
            frame=("", "", ""),
            new_id=_mistral_id,
            preserved=(TOOL_CALLS, ARGS, CALL_ID),
        ),
        # DeepSeek V3, R1 and its distills (```json fenced arguments)
        ToolFormat(
            name="deepseek_v3",
            detect=lambda source: CALLS_BEGIN in source and "```json" in source,
            read=_read_deepseek,
            call=_json_call_rules(
                CALL_BEGIN + "function" + SEP + "{name}\n```json\n", "\n```" + CALL_END
            ),
            opens=(CALLS_BEGIN, CALL_BEGIN),
            frame=(CALLS_BEGIN, "\n", CALLS_END),
            preserved=(CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP),
        ),
        # DeepSeek V3.1 (name<｜tool▁sep｜>{...})
        ToolFormat(
            name="deepseek_v31",
            detect=lambda source: CALLS_BEGIN in source and "```json" not in source,
            read=_read_deepseek,
            call=_json_call_rules(CALL_BEGIN + "{name}" + SEP, CALL_END),
            opens=(CALLS_BEGIN, CALL_BEGIN),
            frame=(CALLS_BEGIN, "", CALLS_END),
            preserved=(CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP),
        ),
    ]
}


def detect(source: str) -> str | None:
    """The name of the format a template's source teaches (None: no tools, or none known)."""
    return next((f.name for f in TABLE.values() if f.detect(source)), None)
