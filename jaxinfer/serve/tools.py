"""Tool calls: the protocol by which a chat template's model calls the functions of OpenAI's
`tools`. The template writes the tools into the prompt; the model answers in the format it was
trained on (serve/tool_formats.py's table: Hermes/Qwen JSON, Llama 3.1 JSON, Qwen3-Coder XML,
GLM-4.5, Mistral, DeepSeek). Here a request's tools are checked, a call is forced by a grammar
when tool_choice demands one, and the calls are read back out of the text as OpenAI's
tool_calls, whole (`parse`) or while it streams (`ToolStream`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance

from ..errors import RequestError
from . import tool_formats
from .tool_formats import TABLE

FORMATS = tuple(TABLE)  # the formats' names, as --tool-call-format takes them
CHOICES = ("auto", "none", "required")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# a function without parameters takes none: its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# schema keywords whose value is a subschema, a list of them, or a map of names to them
SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else",
             "additionalItems", "propertyNames", "unevaluatedItems")  # fmt: skip
SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def tool_format(template_source: str) -> str | None:
    """The tool-call format a chat template teaches its model (a name of FORMATS), or None
    (no tools, or a format not in the table)."""
    return tool_formats.detect(template_source)


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
    row = _row(fmt)
    names = [request.name] if request.name else request.names
    schemas = {name: closed(request.parameters(name)) for name in names}
    several = request.parallel and request.name is None
    text = tool_formats.forced(row, names, schemas, several)
    _validate(text, request, names, schemas)
    return text


def closed(schema):
    """A tool's schema as its grammar enforces it: an object schema that lists properties and
    does not say additionalProperties allows no others (llama.cpp's JSON-schema converter reads
    it so), so that even a weak model ends its call instead of inventing keys; a schema that
    says additionalProperties keeps it, and allOf's parts (merged by the validator) stay open."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), list):
            parts = [closed(s) for s in out[key]]
            if key == "allOf":  # each part names only some keys: a closed part refuses the rest
                parts = [_reopened(p, s) for p, s in zip(parts, out[key], strict=True)]
            out[key] = parts
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def _reopened(part, original):
    if isinstance(part, dict) and isinstance(original, dict):
        if "additionalProperties" not in original:
            part.pop("additionalProperties", None)
    return part


def _row(fmt: str | None) -> tool_formats.ToolFormat:
    if fmt not in TABLE:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
    return TABLE[fmt]


def _validate(text: str, request: ToolRequest, names: list[str], schemas: dict) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if not is_error:
        return
    for name in names:  # which tool's schema is at fault
        schema = tool_formats.enforced({**schemas[name], "type": "object"})
        compiled = llguidance.LLMatcher.grammar_from_json_schema(schema)
        is_error, why = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
        if is_error:
            k = request.names.index(name)
            raise RequestError(
                f"tools[{k}].function.parameters cannot be enforced: {_line(why[0])}"
            )
    raise RequestError(f"the tool-call grammar is invalid: {_line(messages[0])}")


# ---- reading calls -----------------------------------------------------------------------


def parse(text: str, fmt: str, request: ToolRequest | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a generated answer, tool_calls as OpenAI's message has them;
    `request`'s schemas type the bare values of XML formats. Text with a malformed call is all
    content, with no calls (vLLM's rule); with calls, content is the text outside them (None
    if blank). A call written inside <think>...</think> is not a call."""
    row = _row(fmt)
    schemas = _schemas(request)
    found = tool_formats.read(row, text, schemas)
    if found is None:
        return text, []
    content, calls = found
    return content, [_tool_call(name, arguments, row.new_id()) for name, arguments in calls]


def _schemas(request: ToolRequest | None) -> dict[str, dict]:
    if request is None:
        return {}
    return {name: request.parameters(name) for name in request.names}


def _tool_call(name: str, arguments: dict, call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolStream:
    """Reads an answer as it streams: `feed` returns the content that is safe to send now,
    holding back what may begin a call (a partial tag at a piece's end) and blanks that may
    precede one; once a call begins nothing more is sent. `finish` returns the content still
    unsent and the calls: what was sent plus that content is `parse`'s content."""

    def __init__(self, fmt: str, request: ToolRequest | None = None):
        self.fmt, self.request = fmt, request
        self.reader = tool_formats.Reader(_row(fmt))

    @property
    def text(self) -> str:
        """Everything fed so far."""
        return self.reader.text

    def feed(self, piece: str) -> str:
        return self.reader.feed(piece)

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not yet sent, "" if none; the tool calls)."""
        content, calls = parse(self.reader.text, self.fmt, self.request)
        return (content or "")[self.reader.sent :], calls


def _line(text) -> str:
    return " ".join(str(text).split())[:300]
