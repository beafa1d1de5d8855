"""Tool calls: the protocol by which a chat template's model calls the functions of OpenAI's
`tools`. The template writes the tools into the prompt; the model answers in the format it was
trained on, "hermes" (Hermes, Qwen 2.5/3: `<tool_call>\\n{"name", "arguments"}\\n</tool_call>`
blocks) or "llama3_json" (Llama 3.1/3.2: the whole answer is `{"name", "parameters"}`). Here a
request's tools are checked, a call is forced by a grammar when tool_choice demands one, and
the calls are read back out of the text, whole (`parse`) or while it streams (`ToolStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

import llguidance

from ..errors import RequestError
from ..runtime.structured import JSON_OPTIONS

FORMATS = ("hermes", "llama3_json")
CHOICES = ("auto", "none", "required")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # hermes
PYTHON_TAG = "<|python_tag|>"  # llama3_json: Llama's tool-call token; decoded text may lack it
# a function without parameters takes none: its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_format(template_source: str) -> str | None:
    """The tool-call format a chat template teaches its model: "hermes", "llama3_json", or
    None (no tools, or a format not implemented here)."""
    if OPEN in template_source:
        # Qwen3-Coder / Qwen3.5 (`<function=name>`) and GLM (`<arg_key>`) put XML, not JSON,
        # inside <tool_call>
        xml = "<function=" in template_source or "<arg_key>" in template_source
        return None if xml else "hermes"
    if "[TOOL_CALLS]" in template_source:  # Mistral's own format
        return None
    if PYTHON_TAG in template_source or '"parameters"' in template_source:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked `tools`, `tool_choice` and `parallel_tool_calls`."""

    tools: list  # as the request gave them, [{"type": "function", "function": {...}}]: the
    # template's `tools`, as transformers' apply_chat_template passes them
    choice: str = "auto"  # "auto", "none" or "required" (which naming a function implies)
    name: str | None = None  # the function tool_choice names: the one call the answer makes
    parallel: bool = True  # parallel_tool_calls: may "required" make several calls

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def parameters(self, name: str) -> dict:
        """The JSON schema of function `name`'s arguments."""
        function = self.tools[self.names.index(name)]["function"]
        return function.get("parameters", NO_PARAMETERS)


def check_tools(body: dict) -> ToolRequest | None:
    """The request's tools (None when it has none), or a one-line RequestError naming the
    field at fault."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise RequestError(f"{legacy} is not supported; use tools and tool_choice")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls = {parallel!r:.60} is invalid; use true or false")
    if tools is None or tools == []:
        if choice is not None and choice != "none":
            raise RequestError("tool_choice needs tools: the list of functions the model may call")
        return None
    if not isinstance(tools, list):
        raise RequestError('tools must be a list of {"type": "function", "function": {...}}')
    names = [_check_tool(tool, f"tools[{k}]") for k, tool in enumerate(tools)]
    seen: set[str] = set()
    for k, name in enumerate(names):
        if name in seen:
            raise RequestError(f"tools[{k}].function.name = {name!r} is given twice")
        seen.add(name)
    choice, forced = _check_choice(choice, names)
    return ToolRequest(tools, choice, forced, True if parallel is None else parallel)


def _check_tool(tool, where: str) -> str:
    if not isinstance(tool, dict):
        raise RequestError(f'{where} must be an object {{"type": "function", "function": {{...}}}}')
    if tool.get("type") != "function":
        kind = tool.get("type")
        said = "is missing" if kind is None else f"= {kind!r:.40} is invalid"
        raise RequestError(f'{where}.type {said}; only "function" tools are supported')
    function = tool.get("function")
    if not isinstance(function, dict):
        said = "is missing" if function is None else "must be an object"
        raise RequestError(f"{where}.function {said}: {{name, description, parameters}}")
    name = function.get("name")
    if name is None:
        raise RequestError(f"{where}.function.name is missing")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(
            f"{where}.function.name = {name!r:.80} is invalid; use 1 to 64 letters, digits, "
            "underscores, dots or dashes"
        )
    if not isinstance(function.get("description", ""), str):
        raise RequestError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict):
        raise RequestError(f"{where}.function.parameters must be a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise RequestError(
            f"{where}.function.parameters.type = {parameters['type']!r:.40} is invalid; the "
            'arguments of a function are an object ("type": "object")'
        )
    if not isinstance(function.get("strict", False), bool | None):
        raise RequestError(f"{where}.function.strict must be true or false")
    return name


def _check_choice(choice, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in CHOICES:
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise RequestError("tool_choice.function.name is missing")
        if name not in names:
            raise RequestError(
                f"tool_choice.function.name = {name!r:.80} is not in tools ({', '.join(names)})"
            )
        return "required", name
    raise RequestError(
        f'tool_choice = {choice!r:.80} is invalid; use "auto", "none", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


# ---- forcing a call ----------------------------------------------------------------------


def grammar(request: ToolRequest | None, fmt: str | None) -> str | None:
    """The llguidance Lark grammar that forces the call(s) tool_choice demands ("required", or
    a named function), in the model's format `fmt`; None when the answer is free ("auto",
    "none", no tools). A parameters schema llguidance cannot enforce is a RequestError."""
    if request is None or request.choice != "required":
        return None
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
    names = [request.name] if request.name else request.names
    # The call's frame is written out (the template's own spacing), and the arguments are the
    # tool's schema at the root of their own %json: its "#/..." $refs resolve as the client meant
    # them, and x-guidance (read at the root only) bounds the whitespace.
    rules = []
    for i, name in enumerate(names):
        if fmt == "hermes":
            head, tail = f'{OPEN}\n{{"name": "{name}", "arguments": ', "}\n" + CLOSE
        else:
            head, tail = f'{{"name": "{name}", "parameters": ', "}"
        schema = _enforced(request.parameters(name))
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps(tail)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    several = fmt == "hermes" and request.parallel and request.name is None
    start = 'start: call ("\\n" call)*' if several else "start: call"
    alternatives = " | ".join(f"call_{i}" for i in range(len(names)))
    text = "\n".join(["%llguidance {}", start, f"call: {alternatives}", *rules]) + "\n"
    _validate(text, request, names)
    return text


def _enforced(parameters: dict) -> dict:
    return {**parameters, "type": "object", "x-guidance": JSON_OPTIONS}  # bounded blanks


def _validate(text: str, request: ToolRequest, names: list[str]) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if not is_error:
        return
    for name in names:  # which tool's schema is at fault
        schema = llguidance.LLMatcher.grammar_from_json_schema(_enforced(request.parameters(name)))
        is_error, why = llguidance.LLMatcher.validate_grammar_with_warnings(schema)
        if is_error:
            k = request.names.index(name)
            raise RequestError(
                f"tools[{k}].function.parameters cannot be enforced: {_line(why[0])}"
            )
    raise RequestError(f"the tool-call grammar is invalid: {_line(messages[0])}")


# ---- reading calls -----------------------------------------------------------------------


def parse(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a generated answer, tool_calls as OpenAI's message has them.
    Text with a malformed call is all content, with no calls (vLLM's rule); with calls, content
    is the text outside them (None if blank)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
    found = _hermes(text) if fmt == "hermes" else _llama3_json(text)
    if found is None:
        return text, []
    content, calls = found
    return content, [_tool_call(name, arguments) for name, arguments in calls]


def _hermes(text: str):
    start = text.find(OPEN)
    if start < 0:
        return None
    outside, calls = [text[:start].rstrip()], []
    while start >= 0:
        body = start + len(OPEN)
        end = text.find(CLOSE, body)  # a missing last </tool_call> (stopped early) is tolerated
        call = _call(text[body:] if end < 0 else text[body:end], "arguments")
        if call is None:
            return None
        calls.append(call)
        if end < 0:
            break
        after = end + len(CLOSE)
        start = text.find(OPEN, after)
        outside.append(text[after : len(text) if start < 0 else start].strip())
    return "\n".join(piece for piece in outside if piece) or None, calls


def _llama3_json(text: str):
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    elif not body.startswith("{"):
        return None
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while True:  # one call, or several separated by ";"
        pos = _skip_space(body, pos)
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = _call(obj, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        pos = _skip_space(body, pos)
        if pos < len(body) and body[pos] == ";":
            pos = _skip_space(body, pos + 1)
        elif pos < len(body):
            return None
        if pos == len(body):
            return None, calls


def _call(call, *keys: str) -> tuple[str, dict] | None:
    """(name, arguments) of one call's JSON (text or decoded), None if malformed."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except ValueError:
            return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments: object = next((call[key] for key in keys if key in call), {})
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def _tool_call(name: str, arguments: dict) -> dict:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolStream:
    """Reads an answer as it streams: `feed` returns the content that is safe to send now,
    holding back what may begin a call (a partial `<tool_call>`, a leading `{` or
    `<|python_tag|>`) and blanks that may precede one; once a call begins nothing more is
    sent. `finish` returns the content still unsent and the calls: what was sent plus that
    content is `parse`'s content."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
        self.fmt = fmt
        self.text = ""  # everything fed so far
        self.sent = 0  # text[:sent] went out as content; it ends in a non-blank (or is empty)
        self.calling = False  # a call has begun: the rest is held for finish()
        self.plain = False  # llama3_json: the answer does not start with a call

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.calling:
            return ""
        text = self.text
        if self.fmt == "hermes":
            start = text.find(OPEN, self.sent)
            self.calling = start >= 0
            end = start if self.calling else len(text) - _partial(text, OPEN)
            tail = text[self.sent : end].rstrip()  # blanks wait: a call may follow them
        elif self.plain:
            tail = text[self.sent :]
        else:
            body = text.lstrip()
            if body.startswith("{") or body.startswith(PYTHON_TAG):
                self.calling = True
                return ""
            if PYTHON_TAG.startswith(body):  # blank so far, or a partial <|python_tag|>
                return ""
            self.plain = True
            tail = text
        self.sent += len(tail)
        return tail

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not yet sent, "" if none; the tool calls)."""
        content, calls = parse(self.text, self.fmt)
        return (content or "")[self.sent :], calls


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _line(text) -> str:
    return " ".join(str(text).split())[:300]
