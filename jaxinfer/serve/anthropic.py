"""Anthropic's Messages API (`POST /v1/messages`) as a translation of chat completions.

`chat_body` turns a Messages request into the chat-completions body that `openai_api.chat_job`
checks, so every limit and check of chat applies to it (a last assistant message is a prefill,
chat's continue_final_message); `message` turns the chat answer into a Message,
`MessageStream` the chat stream's chunks into Anthropic's server-sent events, and `error_body`
an error into Anthropic's shape. Plain dicts in and out, no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import RequestError
from .openai_api import SAMPLING

# Anthropic's error type of each HTTP status this server answers with
ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# chat's finish_reason -> Anthropic's stop_reason ("stop" is end_turn or stop_sequence)
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")
TOOL_CHOICES = ("auto", "any", "tool", "none")


def error_body(message: str, code: int) -> dict:
    kind = ERRORS.get(code, "api_error" if code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- requests ----------------------------------------------------------------------------


def chat_body(body, *, count: bool = False) -> dict:
    """The chat-completions body of a Messages request (`count`: of a count_tokens request,
    which has no max_tokens and generates nothing); a one-line RequestError naming the field
    at fault otherwise."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in ("mcp_servers", "container"):
        if body.get(name) not in (None, [], ""):
            raise RequestError(f"{name} is not supported by this server; leave it out")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat: dict[str, Any] = {"messages": messages}
    if messages[-1]["role"] == "assistant":  # a prefill: the answer continues it, unrepeated
        chat["continue_final_message"] = True
    if body.get("model") is not None:
        chat["model"] = body["model"]  # chat_job checks it is a string
    if not count:
        chat["max_tokens"] = _max_tokens(body.get("max_tokens"))
        # Anthropic's temperature, top_p and top_k, and llama.cpp's extras as chat takes them
        for name in (*SAMPLING, "ignore_eos"):  # (SamplingParams checks their values)
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("stream") is not None:
            chat["stream"] = body["stream"]
            # the usage chunk carries the output tokens of message_delta
            chat["stream_options"] = {"include_usage": True}
        if body.get("stop_sequences") is not None:
            chat["stop"] = _stop_sequences(body["stop_sequences"])
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice"), tools))
    chat.update(_output_format(body.get("output_config")))
    kwargs = body.get("chat_template_kwargs")  # llama-server's extra, passed on as chat's
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return _thinking(body.get("thinking"), chat)


def _max_tokens(value) -> int:
    if value is None:
        raise RequestError("max_tokens is required: the most tokens the answer may hold")
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 2**31 - 1:
        raise RequestError(
            f"max_tokens = {value!r:.40} is invalid; it must be an integer in 1..{2**31 - 1}"
        )
    return value


def _stop_sequences(stops) -> list[str]:
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop_sequences must be a list of strings")
    return stops  # their count and lengths: chat's limits


def _system(system) -> list[dict]:
    """The system prompt (a string or a list of text blocks) as chat's first message."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise RequestError("system must be a string or a list of text blocks")
    texts = [_text(block, f"system[{k}]") for k, block in enumerate(system)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _messages(messages) -> list[dict]:
    """The conversation as chat messages: an assistant's tool_use blocks become its
    tool_calls, its thinking its reasoning_content; each tool_result a `tool` message (before
    the user's text, as Anthropic puts them first)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    for n, message in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise RequestError(
                f'{where}.role = {role!r:.40} is invalid; use "user" or "assistant" (the system '
                "prompt goes in the top-level system field)"
            )
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise RequestError(f"{where}.content must be a string or a non-empty list of blocks")
        texts, calls, results, thinking = [], [], [], []
        for k, block in enumerate(content):
            at = f"{where}.content[{k}]"
            if not isinstance(block, dict):
                raise RequestError(f"{at} must be a content block object {{type, ...}}")
            kind = block.get("type")
            if kind == "text":
                texts.append(_text(block, at))
            elif kind in ("tool_use", "thinking", "redacted_thinking") and role == "user":
                raise RequestError(f"{at} is a {kind} block, which only assistant messages hold")
            elif kind == "tool_result" and role == "assistant":
                raise RequestError(f"{at} is a tool_result block, which only user messages hold")
            elif kind == "tool_use":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result":
                results.append(_tool_result(block, at))
            elif kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise RequestError(f"{at}.thinking must be a string")
                thinking.append(block["thinking"])
            elif kind == "redacted_thinking":
                pass  # encrypted by Anthropic: nothing a local model can read
            elif kind in UNSUPPORTED_BLOCKS:
                raise RequestError(f"{at} is of type {kind!r}, which is not supported: text only")
            else:
                raise RequestError(
                    f"{at}.type = {kind!r:.40} is invalid; use text, tool_use, tool_result or "
                    "thinking"
                )
        out.extend(results)
        if role == "user" and (texts or not results):
            out.append({"role": "user", "content": "\n".join(texts)})
        elif role == "assistant":
            reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                reply["tool_calls"] = calls
            if thinking:
                reply["reasoning_content"] = "\n".join(thinking)
            out.append(reply)
    return out


def _text(block, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise RequestError(f"{where} is of type {kind!r:.40}; only text blocks go here")
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}.text must be a string")
    return block["text"]


def _tool_use(block: dict, where: str) -> dict:
    """An assistant's tool_use block as chat's tool call."""
    for name in ("id", "name"):
        if not isinstance(block.get(name), str) or not block[name]:
            raise RequestError(f"{where}.{name} must be a non-empty string")
    if not isinstance(block.get("input"), dict):
        raise RequestError(f"{where}.input must be an object: the tool's arguments")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": arguments}}  # fmt: skip


def _tool_result(block: dict, where: str) -> dict:
    """A user's tool_result block as chat's `tool` message; an error's text says it is one."""
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise RequestError(f"{where}.tool_use_id must be the id of the tool_use it answers")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(part, f"{where}.content[{k}]") for k, part in enumerate(content))
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise RequestError(f"{where}.is_error must be true or false")
    if is_error:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(tools) -> list[dict]:
    """Client tools ({name, description, input_schema}) as chat's function tools; Anthropic's
    server tools (web search, code execution...) run on Anthropic's side: refused."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {name, description, input_schema} objects")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object {{name, description, input_schema}}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise RequestError(
                f"{where}.type = {kind!r:.60} is a server tool, which this server does not "
                "run; give client tools as {name, description, input_schema}"
            )
        if not isinstance(tool.get("name"), str):
            raise RequestError(f"{where}.name must be a string")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            said = "is missing" if schema is None else "must be an object"
            raise RequestError(f"{where}.input_schema {said}: the JSON schema of the tool's input")
        function = {"name": tool["name"]}  # in OpenAI's order: templates print it as it is
        if tool.get("description") is not None:
            function["description"] = tool["description"]  # check_tools: a string
        out.append({"type": "function", "function": {**function, "parameters": schema}})
    return out


def _tool_choice(choice, tools: list[dict]) -> dict:
    """tool_choice (auto, any, a named tool, none) and disable_parallel_tool_use as chat's
    tool_choice and parallel_tool_calls."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICES:
        raise RequestError(
            f'tool_choice = {choice!r:.60} is invalid; use {{"type": "auto"}}, {{"type": "any"}}, '
            '{"type": "tool", "name": ...} or {"type": "none"}'
        )
    single = choice.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be true or false")
    if not tools and kind in ("auto", "none"):
        return {}  # no tools: nothing to choose from, as Anthropic allows
    out: dict[str, Any] = {"parallel_tool_calls": False} if single else {}
    if kind == "tool":
        names = [tool["function"]["name"] for tool in tools]
        name = choice.get("name")
        if name not in names:
            raise RequestError(
                f"tool_choice.name = {name!r:.60} is not in tools ({', '.join(names) or 'none'})"
            )
        return {**out, "tool_choice": {"type": "function", "function": {"name": name}}}
    return {**out, "tool_choice": {"any": "required"}.get(kind, kind)}


def _output_format(config) -> dict:
    """output_config's format (a JSON schema the answer follows) as chat's response_format;
    its effort is Claude's own setting: not read."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise RequestError("output_config must be an object {format, effort}")
    form = config.get("format")
    if form is None:
        return {}
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise RequestError('output_config.format must be {"type": "json_schema", "schema": {...}}')
    if not isinstance(form.get("schema"), dict):
        raise RequestError("output_config.format.schema must be a JSON schema object")
    spec = {"name": "output", "schema": form["schema"]}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _thinking(thinking, chat: dict) -> dict:
    """`thinking` as chat's thinking_budget: enabled with budget_tokens N gives N, disabled
    gives 0 and the template's enable_thinking false; adaptive and between_tools leave the
    server's default."""
    if thinking is None:
        return chat
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("adaptive", "between_tools"):
        return chat
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise RequestError(
                f"thinking.budget_tokens = {budget!r:.40} is invalid; it must be a positive "
                'integer (or use {"type": "disabled"})'
            )
        return {**chat, "thinking_budget": budget}
    if kind == "disabled":
        kwargs = chat.get("chat_template_kwargs", {})
        if isinstance(kwargs, dict):  # (anything else: chat_job says what is wrong)
            kwargs = {**kwargs, "enable_thinking": False}
        return {**chat, "thinking_budget": 0, "chat_template_kwargs": kwargs}
    raise RequestError(
        f'thinking = {thinking!r:.60} is invalid; use {{"type": "enabled", "budget_tokens": N}}, '
        '{"type": "disabled"}, {"type": "adaptive"} or {"type": "between_tools"}'
    )


# ---- answers -----------------------------------------------------------------------------


def message(answer: dict) -> dict:
    """A chat completion (one choice) as Anthropic's Message: its blocks in order thinking,
    text, tool_use."""
    choice = answer["choices"][0]
    said = choice["message"]
    content = []
    reasoning = _reasoning(said)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    for call in said.get("tool_calls") or ():
        function = call["function"]
        content.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": function["name"],
                        "input": json.loads(function["arguments"] or "{}")})  # fmt: skip
    reason, sequence = _stop(choice)
    return {
        "id": _message_id(answer["id"]), "type": "message", "role": "assistant",
        "model": answer["model"], "content": content, "stop_reason": reason,
        "stop_sequence": sequence, "usage": _usage(answer["usage"]),
    }  # fmt: skip


def _reasoning(said: dict) -> str | None:
    """A message's or a delta's reasoning text (reasoning_content, or the newer reasoning)."""
    return said["reasoning_content"] if "reasoning_content" in said else said.get("reasoning")


def _stop(choice: dict) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish in STOP_REASONS:
        return STOP_REASONS[finish], None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(usage: dict) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens computed, those the prefix cache
    held are cache_read_input_tokens (their sum is the prompt, as count_tokens counts it)."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


# ---- streams -----------------------------------------------------------------------------


class MessageStream:
    """Anthropic's event sequence of one streamed message, from the chat stream's chunks:
    `start()` (message_start), then `feed(chunk)` per chunk (content_block_start / _delta /
    _stop per block; message_delta and message_stop at the usage chunk; an error event for an
    error chunk), then `close()`. Each event is an SSE frame, `event: NAME\\ndata: JSON\\n\\n`."""

    def __init__(self, chat_id: str, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = _message_id(chat_id), model, prompt_tokens
        self.index = -1  # the current block's index
        self.open: str | None = None  # the type of the open block, if one is
        self.calls: dict[int, int] = {}  # chat's tool-call index -> its tool_use block's
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.done = False  # message_stop (or an error) was sent

    def start(self) -> list[str]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}  # fmt: skip
        said: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant",
                                "model": self.model, "content": [], "stop_reason": None,
                                "stop_sequence": None, "usage": usage}  # fmt: skip
        return [_frame("message_start", {"message": said})]

    def feed(self, chunk: dict) -> list[str]:
        if self.done:
            return []
        if "error" in chunk:  # the engine failed mid-stream
            self.done = True
            return [_frame("error", error_body(chunk["error"]["message"], 500))]
        frames: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if reasoning := _reasoning(delta):
                frames += self._block("thinking", {"thinking": "", "signature": ""})
                frames.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                frames += self._block("text", {"text": ""})
                frames.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                frames += self._call(call)
            if choice.get("finish_reason"):
                frames += self._close()
                self.stop = _stop(choice)
        if chunk.get("usage"):  # the last chunk (chat_body asks for it)
            frames += self._close()
            reason, sequence = self.stop
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            usage = _usage(chunk["usage"])
            frames.append(_frame("message_delta", {"delta": delta, "usage": usage}))
            frames.append(_frame("message_stop", {}))
            self.done = True
        return frames

    def close(self) -> list[str]:
        """What ends a stream whose usage chunk never came (nothing otherwise)."""
        if self.done:
            return []
        self.done = True
        reason, sequence = self.stop
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        end = {"delta": delta, "usage": {"output_tokens": 0}}
        return [*self._close(), _frame("message_delta", end), _frame("message_stop", {})]

    def _call(self, call: dict) -> list[str]:
        """A tool call's piece: its first opens a tool_use block, arguments are its input."""
        frames = []
        function = call.get("function") or {}
        k = call.get("index", 0)
        if k not in self.calls:
            name = function.get("name") or ""
            block: dict = {"id": _tool_id(call.get("id") or f"call_{k}"), "name": name, "input": {}}
            frames += self._block("tool_use", block, new=True)
            self.calls[k] = self.index
        if function.get("arguments"):
            frames.append(self._delta(
                {"type": "input_json_delta", "partial_json": function["arguments"]},
                self.calls[k],
            ))  # fmt: skip
        return frames

    def _block(self, kind: str, fields: dict, new: bool = False) -> list[str]:
        """Open a block of `kind` unless one is open (`new`: always a fresh one)."""
        if self.open == kind and not new:
            return []
        frames = self._close()
        self.index += 1
        self.open = kind
        start = {"index": self.index, "content_block": {"type": kind, **fields}}
        return [*frames, _frame("content_block_start", start)]

    def _delta(self, delta: dict, index: int | None = None) -> str:
        index = self.index if index is None else index
        return _frame("content_block_delta", {"index": index, "delta": delta})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":  # a local model's reasoning carries no signature
            frames.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*frames, _frame("content_block_stop", {"index": self.index})]


def _frame(event: str, data: dict) -> str:
    payload = json.dumps({"type": event, **data}, ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n"
