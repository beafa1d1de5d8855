"""Chat templates: a model's jinja template turned into a prompt's token ids.

The template comes from the checkpoint (`tokenizer_config.json` / `chat_template.jinja`, or the
GGUF `tokenizer.chat_template`) or from the user. It is rendered the way transformers'
`apply_chat_template` renders it: a sandboxed jinja environment with trim_blocks and
lstrip_blocks, the `tojson` filter, `raise_exception` and `strftime_now`, and the model's
bos_token / eos_token; with `continue_final_message` the text stops inside the last message, which
the answer then continues (an assistant prefill). The text is then tokenized as llama.cpp does:
specials are parsed, and when the tokenizer adds BOS itself a BOS written by the template is
dropped (one BOS either way).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ContextError, RequestError
from ..formats.tokenizer import Tokenizer
from ..options import json_object

ROLES = ("system", "user", "assistant", "tool", "developer")
MARK = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where the final message ends


class ChatTemplate:
    def __init__(self, source: str, tokenizer: Tokenizer):
        self.source = source
        self.tokenizer = tokenizer
        self._template = _compile(source)  # a syntax error raises RequestError here

    def render(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict] | None = None,
        **extra,
    ) -> str:
        """The prompt text of `messages` ([{"role", "content"}, ...], already checked) and of
        `tools` (OpenAI's [{"type": "function", "function": {...}}], passed as transformers
        does: as given, None when absent). `continue_final_message` (transformers' and vLLM's;
        not with `add_generation_prompt`) ends the text right after the last message's content,
        cutting the end of turn the template writes after it."""
        if continue_final_message:
            if add_generation_prompt:
                raise RequestError(
                    "continue_final_message and add_generation_prompt cannot both be true; set "
                    "add_generation_prompt to false to continue the final message"
                )
            content = messages[-1]["content"]  # marked where it ends, as transformers does
            messages = [*messages[:-1], {**messages[-1], "content": content + MARK}]
        tok = self.tokenizer

        def render(messages) -> str:
            return self._template.render(
                messages=list(messages),
                tools=None if tools is None else list(tools),
                add_generation_prompt=add_generation_prompt,
                bos_token=tok.token_text(tok.bos_id),
                eos_token=tok.token_text(tok.eos_ids[0] if tok.eos_ids else None),
                **extra,
            )

        try:
            try:
                text = render(messages)
            except TypeError:  # (DeepSeek's templates add a call's arguments to a string:
                as_text = _arguments_as_text(messages)  # they want OpenAI's JSON text)
                if as_text is None:
                    raise
                text = render(as_text)
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template failed: {_line(e)}") from None
        except RecursionError:
            raise RequestError("the chat template failed: the messages nest too deeply") from None
        except Exception as e:  # a template's own runtime error on these messages (name: 5)
            raise RequestError(
                f"the chat template failed on these messages: {type(e).__name__}: {_line(e)}"
            ) from None
        return _open_end(text, content) if continue_final_message else text

    def encode(self, messages: Sequence[dict], limit: int | None = None, **extra) -> list[int]:
        """Token ids of the rendered messages, with exactly one BOS where the model wants one;
        text that surely holds more than `limit` tokens is a ContextError, not encoded."""
        return self.tokenize(self.render(messages, **extra), limit)

    def tokenize(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of a rendered prompt (as `encode`)."""
        tok = self.tokenizer
        if limit is not None and (at_least := tok.too_long(text, limit)):
            raise ContextError(at_least, limit + 1, at_least=True)
        bos = tok.token_text(tok.bos_id)
        if tok.add_bos and bos and text.startswith(bos):  # llama.cpp: no double BOS
            text = text[len(bos) :]
        return tok.encode(text)


def check_messages(messages) -> list[dict]:
    """OpenAI chat messages as the plain dicts a template reads: content parts of type "text"
    are joined with newlines, an assistant's tool calls carry their arguments decoded (the
    dict templates expect, as vLLM passes them); anything else is refused with a one-line
    RequestError."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for n, message in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RequestError(f"{where}.role = {role!r} is invalid; use one of {', '.join(ROLES)}")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, f"{where}.content[{k}]")
                                for k, part in enumerate(content))  # fmt: skip
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts")
        checked = {**message, "role": role, "content": content}
        calls = checked.pop("tool_calls", None)
        if calls not in (None, []):  # templates test `'tool_calls' in message`: none is absent
            if role != "assistant":
                raise RequestError(f"{where}.tool_calls: only assistant messages make tool calls")
            checked["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            said = "is missing" if message.get("tool_call_id") is None else "must be a string"
            raise RequestError(
                f"{where}.tool_call_id {said}: the id of the tool call this message answers"
            )
        out.append(checked)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list of {{id, type, function}} objects")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(f"{at}.function is missing: {{name, arguments}}")
        if call.get("type", "function") != "function":
            raise RequestError(f'{at}.type = {call["type"]!r:.40} is invalid; use "function"')
        function = call["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{at}.function.name is missing")
        arguments = _arguments(function.get("arguments"), f"{at}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _open_end(text: str, content: str) -> str:
    """`text`, rendered with the final message's `content` + MARK, cut where the mark begins
    (less the blanks a template that trims the content trimmed before it: transformers' rule)."""
    at = text.rfind(MARK.strip())
    if at < 0 or content.strip() not in text:
        raise RequestError(
            "the chat template does not write the final message's content as given, so it "
            "cannot be continued; send it without continue_final_message"
        )
    return text[:at] if text.startswith(MARK, at) else text[:at].rstrip()


def _arguments_as_text(messages: Sequence[dict]) -> list[dict] | None:
    """`messages` with each tool call's arguments as JSON text (None: no call has any)."""
    if not any(m.get("tool_calls") for m in messages):
        return None
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _arguments(arguments, where: str) -> dict:
    """A call's arguments, OpenAI's JSON text of an object, as the object."""
    if arguments is None or arguments == "":  # a call without arguments
        return {}
    return json_object(arguments, where)


def _text_part(part, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise RequestError(f"{where} is of type {kind!r}; only text parts are supported")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tags): the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template does not parse: {_line(e)}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message):
    raise jinja2.TemplateError(message)


def _line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
