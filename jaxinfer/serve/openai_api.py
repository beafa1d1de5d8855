"""The OpenAI API's completion requests and responses, as plain dicts.

This is the one module that checks a request body: `parse_body` reads the JSON (valid
Unicode, bounded nesting), and `completion_job` / `chat_job` check its fields and turn it into
a `Job`: the prompts as
token ids, `n` choices each, and their `SamplingParams` (which check every value: one-line
RequestErrors). The Job then shapes the answer:
a whole response, or the chunks of a Server-Sent-Events stream, with OpenAI's logprobs
(`Tokens` names each token by its text and bytes).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import token_ids as engine_token_ids
from ..errors import ContextError, RequestError
from ..formats.tokenizer import Tokenizer
from ..options import (
    MAX_LOGPROBS,
    MAX_STOP_LENGTH,
    REASONING_FORMATS,
    SamplingParams,
    ServerOptions,
)
from ..runtime.reasoning import Reasoning
from ..runtime.request import Result, TokenLogprob
from .chat import ChatTemplate, check_messages
from .thinking import ReasoningSplit, opened, split, thinking_tags
from .tool_formats import TABLE
from .tools import ToolRequest, ToolStream, check_tools, grammar, parse, tool_format

# llama.cpp's extras next to OpenAI's own fields: body key -> SamplingParams field
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}
# Fields this server cannot honour: refused unless they carry their "off" value.
UNSUPPORTED = {
    "suffix": (None, ""),
    "logit_bias": (None, {}),
}
DEFAULT_LIMITS = ServerOptions()


@dataclass(frozen=True)
class Job:
    """A checked completion request: `n` choices for each prompt."""

    chat: bool
    prompts: tuple[tuple[int, ...], ...]  # token ids
    n: int
    sampling: SamplingParams  # shared by every choice (seed apart)
    stream: bool
    include_usage: bool
    model: str
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    tool_format: str | None = None  # chat with tools: how the model's calls are read back
    # thinking models (chat): the reasoning's tags and budget, and how answers are split
    # (serve.thinking; "none": not at all)
    reasoning: Reasoning | None = None
    reasoning_format: str = "none"
    parallel_tool_calls: bool = True  # False: an answer's first call only
    tool_request: ToolRequest | None = None  # its tools' schemas type XML formats' values
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def replace(self, **changes) -> Job:
        return dataclasses.replace(self, **changes)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def submissions(self) -> list[tuple[tuple[int, ...], SamplingParams]]:
        """(prompt ids, sampling) per choice, in choice order; with a seed, choice i of a
        prompt uses seed + i, so that its n samples differ."""
        out = []
        seed = self.sampling.seed
        for ids in self.prompts:
            for i in range(self.n):
                if seed is not None and seed >= 0:  # a negative seed means random anyway
                    out.append((ids, self.sampling.replace(seed=seed + i)))
                else:
                    out.append((ids, self.sampling))
        return out

    # ---- answers ------------------------------------------------------------------------

    def _head(self, obj: str) -> dict:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, results: Sequence[Result], tokens: Tokens, echoed=None) -> dict:
        """The whole answer; `echoed` (with echo): per prompt, its text and its tokens'
        TokenLogprobs (None for the first token; the list None without logprobs)."""
        choices = []
        for i, r in enumerate(results):
            choice: dict[str, Any]  # its message or text and logprobs are set below
            choice = {
                "index": i,
                "logprobs": None,
                "finish_reason": finish_reason(r),
                "stop_reason": r.stop_string,
            }  # vLLM's: the stop string that ended it
            if self.chat:
                reasoning, said = self.split(r.text)  # a call inside the reasoning is none
                message: dict[str, Any] = {"role": "assistant", "content": said}
                if self.tool_format:
                    content, calls = parse(said, self.tool_format, self.tool_request)
                    calls = self.kept_calls(calls)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        choice["finish_reason"] = "tool_calls"
                if reasoning is not None:  # vLLM's and llama-server's name, and the newer one
                    message |= {"reasoning_content": reasoning, "reasoning": reasoning}
                choice["message"] = message
                if r.logprobs is not None:
                    choice["logprobs"] = tokens.chat(r.logprobs)
            else:
                text, lps = echoed[i // self.n] if echoed else ("", None)
                choice["text"] = text + r.text
                if r.logprobs is not None:
                    ids = self.prompts[i // self.n]
                    choice["logprobs"] = tokens.completion((lps or []) + r.logprobs, 0, ids)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        answer = {**self._head(obj), "choices": choices, "usage": usage(self, results)}
        return {**answer, "timings": timings(results[0])}

    def chunk(
        self, index: int, text: str | None, finish: str | None = None, logprobs=None, calls=(),
        stop_reason: str | None = None, reasoning: str | None = None,
    ) -> dict:  # fmt: skip
        """One streamed chunk of choice `index`: new text (and new `reasoning`), or (text
        None) its end, with the logprobs of its tokens (`logprobs`: Tokens.chat /
        Tokens.completion's object, or None) or the tool calls it makes; its end carries the
        stop string that ended it (`stop_reason`). A chat stream opens each choice with its
        role (`opening`)."""
        end = {} if finish is None else {"stop_reason": stop_reason}
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if reasoning:
                delta |= {"reasoning_content": reasoning, "reasoning": reasoning}
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [{**choice, **end}]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish, **end}  # fmt: skip
        return {**self._head("text_completion"), "choices": [choice]}

    def kept_calls(self, calls: list[dict]) -> list[dict]:
        """The calls an answer returns: the first alone without parallel_tool_calls."""
        return calls if self.parallel_tool_calls else calls[:1]

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer (reasoning None: it did not think, or the
        reasoning format is "none")."""
        r = self.reasoning
        if r is None or self.reasoning_format == "none":
            return None, text
        return split(text, (r.start, r.end), r.opened, self.reasoning_format)

    def reasoning_stream(self) -> ReasoningSplit | None:
        """A choice's splitter of reasoning from content while it streams (None: no split)."""
        r = self.reasoning
        if r is None or self.reasoning_format == "none":
            return None
        return ReasoningSplit((r.start, r.end), r.opened, self.reasoning_format)

    def tool_stream(self) -> ToolStream | None:
        """A choice's reader of tool calls while it streams (None: no tools)."""
        if not self.tool_format:
            return None
        return ToolStream(self.tool_format, self.tool_request)

    def opening(self, index: int) -> dict | None:
        if not self.chat:
            return None
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}  # fmt: skip
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, results: Sequence[Result]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {**self._head(obj), "choices": [], "usage": usage(self, results)}
        return {**chunk, "timings": timings(results[0])}


class Tokens:
    """Tokens as OpenAI's logprobs name them: each by its text and its UTF-8 bytes (a token
    may hold part of a character: its text then has U+FFFD, its bytes are exact)."""

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes  # id -> bytes

    def entry(self, token: int, logprob: float) -> dict:
        raw = self.token_bytes(token)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def chat(self, lps: Sequence[TokenLogprob]) -> dict:
        """Chat's logprobs object."""
        content = [
            {**self.entry(t.id, t.logprob), "top_logprobs": [self.entry(i, v) for i, v in t.top]}
            for t in lps
        ]
        return {"content": content, "refusal": None}

    def completion(self, lps: Sequence[TokenLogprob | None], offset: int, ids=()) -> dict:
        """Completions' logprobs object: per token its text, logprob and top ones (None for
        a prompt's first token, whose id comes from `ids`), and its text's offset."""
        tokens, values, tops, offsets = [], [], [], []
        for k, t in enumerate(lps):
            text = self.entry(t.id if t else ids[k], 0.0)["token"]
            tokens.append(text)
            values.append(t.logprob if t else None)
            tops.append({self.entry(i, v)["token"]: v for i, v in t.top} if t else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip


def finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(job: Job, results: Sequence[Result]) -> dict:
    prompt = sum(len(ids) for ids in job.prompts)  # each prompt once, as OpenAI counts
    completion = sum(len(r.token_ids) for r in results)
    # prompt tokens the prefix cache held: each prompt once (its first choice's)
    cached = sum(r.cached_tokens for r in results[:: job.n])
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    if job.reasoning is not None:
        thought = sum(r.reasoning_tokens for r in results)
        out["completion_tokens_details"] = {"reasoning_tokens": thought}
    return out


def timings(result: Result) -> dict:
    """llama-server's timings of one choice: prompt tokens found in the cache (cache_n) and
    computed (prompt_n), tokens generated (predicted_n), and the times they took."""
    prompt_n = len(result.prompt_ids) - result.cached_tokens
    predicted_n = len(result.token_ids)
    return {
        "cache_n": result.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": result.prompt_ms,
        "prompt_per_second": prompt_n / result.prompt_ms * 1e3 if result.prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": result.decode_ms,
        "predicted_per_second": (
            (predicted_n - 1) / result.decode_ms * 1e3 if result.decode_ms else 0.0
        ),
    }


def error_body(message: str, code: int, kind: str = "invalid_request_error", **extra) -> dict:
    return {"error": {"code": code, "message": message, "type": kind, "param": None, **extra}}


# ---- requests ----------------------------------------------------------------------------


SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of half a UTF-16 pair
LONE = re.compile("[\ud800-\udfff]")  # such a half, once parsed


def parse_body(raw: bytes) -> Any:
    """A request's JSON body; its strings are valid Unicode (what the tokenizer takes)."""
    try:
        text = raw.decode()  # UTF-8, as RFC 8259 asks
        body = json.loads(text)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except ValueError as e:  # bad JSON or UTF-8, an integer of over 4,300 digits
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    if SURROGATE.search(text) and (where := _lone_surrogate(body)) is not None:
        raise RequestError(
            f"{where:.80} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without "
            "its pair); send valid Unicode text"
        )
    return body


def _lone_surrogate(body) -> str | None:
    """Where a parsed JSON value holds a string (or key) with half a UTF-16 pair, which JSON
    can escape but UTF-8 cannot encode (e.g. "messages[0].content"); None when nowhere."""
    stack = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if LONE.search(value):
                return where or "the request body"
        elif isinstance(value, dict):
            for key, item in value.items():
                if LONE.search(key):
                    return f"a key of {where or 'the request body'}"
                if key.isidentifier():
                    path = f"{where}.{key}" if where else key
                else:  # its repr: one printable line
                    path = f"{where}[{key!r}]"
                stack.append((path, item))
        elif isinstance(value, list):
            stack.extend((f"{where or 'body'}[{i}]", item) for i, item in enumerate(value))
    return None


def completion_job(
    body, tokenizer: Tokenizer, n_ctx: int, model: str, limits: ServerOptions = DEFAULT_LIMITS
) -> Job:
    """POST /v1/completions: prompt is a string, a list of them, token ids or a list of those;
    within the server's `limits`."""
    body = _object(body)
    if "prompt" not in body:
        raise RequestError("prompt is required: a string, a list of strings or token ids")
    prompt = body["prompt"]
    texts: list[str | list]  # strings, or token ids
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        texts = prompt
    else:
        raise RequestError("prompt must be a string, a list of strings, token ids or lists of them")
    _choices(body, len(texts), limits)  # before the prompts are tokenized
    prompts = [_prompt_ids(p, tokenizer, n_ctx, f"prompt[{k}]") for k, p in enumerate(texts)]
    return _job(body, prompts, n_ctx, model, limits, chat=False, default_max=16)  # OpenAI's


def chat_job(
    body, template: ChatTemplate | None, n_ctx: int, model: str,
    limits: ServerOptions = DEFAULT_LIMITS,
) -> Job:  # fmt: skip
    """POST /v1/chat/completions: messages rendered with the model's chat template (with
    vLLM's continue_final_message, the answer continues the last message); within the
    server's `limits`. The answers keep as text the special tokens that its tool-call format
    and reasoning tags are made of (SamplingParams.preserved_tokens)."""
    body = _object(body)
    _choices(body, 1, limits)
    _fits_kib(body.get("tools"), "tools", limits)
    messages = check_messages(body.get("messages"))
    if template is None:
        raise RequestError(
            "this model has no chat template (tokenizer_config.json chat_template or GGUF "
            "tokenizer.chat_template); start the server with --chat-template-file, or use "
            "/v1/completions"
        )
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise RequestError("chat_template_kwargs must be an object")
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(extra)
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    extra = {**limits.chat_template_kwargs, **extra}  # the server's defaults under the request's
    tags = thinking_tags(template.source)
    budget = _thinking_budget(body, limits)
    if budget == 0 and tags and "enable_thinking" not in extra:
        extra["enable_thinking"] = False  # Qwen3's templates then write an empty reasoning
    tools = check_tools(body)
    fmt = None
    if tools is not None and tools.choice != "none":
        fmt = limits.tool_call_format
        fmt = tool_format(template.source) if fmt == "auto" else fmt  # or --tool-call-format
        if fmt is None:
            raise RequestError(
                "this model's chat template has no tool-call format jaxinfer reads (docs/"
                "serving.md lists them); name the model's with --tool-call-format, pass a "
                "template that has one with --chat-template-file, or leave tools out"
            )
    continues = flag(body, "continue_final_message")
    text = template.render(
        messages, add_generation_prompt=_get(body, "add_generation_prompt", bool, not continues),
        continue_final_message=continues, tools=tools.tools if tools else None, **extra,
    )  # fmt: skip
    ids = template.tokenize(text, limit=n_ctx - 1)
    _fits(len(ids), n_ctx)
    max_tokens = _max_tokens(body, "max_completion_tokens", None)
    body = {**body, "max_tokens": _max_tokens(body, "max_tokens", max_tokens)}
    forced = grammar(tools, fmt)  # tool_choice required / a named function: a call is forced
    job = _job(body, [ids], n_ctx, model, limits, chat=True, default_max=None, forced=forced)
    kept = [*(TABLE[fmt].preserved if fmt else ()), *(tags or ())]  # those a parser reads
    if preserved := template.tokenizer.specials(kept):
        job = job.replace(sampling=job.sampling.replace(preserved_tokens=preserved))
    if fmt:
        assert tools is not None  # a tool format is only looked for with tools
        job = job.replace(tool_format=fmt, parallel_tool_calls=tools.parallel, tool_request=tools)
    if tags is not None:
        how = _get(body, "reasoning_format", str, limits.reasoning_format)
        if how not in REASONING_FORMATS:
            raise RequestError(
                f"reasoning_format {how!r:.40} is not supported; use one of "
                f"{', '.join(REASONING_FORMATS)}"
            )
        thinks = Reasoning(budget, *tags, opened=opened(text, tags))
        job = job.replace(reasoning=thinks, reasoning_format="deepseek" if how == "auto" else how)
    return job  # default_max None: the whole context


def _thinking_budget(body: dict, limits: ServerOptions) -> int:
    """The tokens a request may think: thinking_budget (or reasoning_budget, its alias), else
    the server's --reasoning-budget; -1 no limit, 0 no thinking."""
    if body.get("thinking_budget") is not None and body.get("reasoning_budget") is not None:
        raise RequestError("give thinking_budget or reasoning_budget (its alias), not both")
    name = "reasoning_budget" if body.get("reasoning_budget") is not None else "thinking_budget"
    budget = _get(body, name, int, limits.reasoning_budget)
    if budget < -1:
        raise RequestError(
            f"{name} = {budget} is invalid; use -1 (no limit), 0 (no thinking) or a number of "
            "tokens"
        )
    return budget


def _job(
    body: dict, prompts, n_ctx: int, model: str, limits: ServerOptions, *, chat: bool,
    default_max, forced=None,
) -> Job:  # fmt: skip
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise RequestError(f"{name} is not supported by this server; leave it out")
    n = _get(body, "n", int, 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise RequestError("best_of is not supported by this server (only best_of = n)")
    max_tokens = _max_tokens(body, "max_tokens", default_max)
    if max_tokens is None or max_tokens == -1:  # llama.cpp's -1: until the context is full
        max_tokens = n_ctx
    if limits.n_predict >= 0:  # the server's -n caps every choice, as llama-server's does
        max_tokens = min(max_tokens, limits.n_predict)
    sampling = SamplingParams(
        max_new_tokens=max_tokens,
        stop=_stop(body.get("stop"), limits),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        cache_salt=_get(body, "cache_salt", str, None),
        cache_prompt=_get(body, "cache_prompt", bool, True),
        logprobs=_logprobs(body, chat),
        **_constraint(body, forced, limits),
        **{kw: body[key] for key, kw in SAMPLING.items() if body.get(key) is not None},
    )
    echo = _get(body, "echo", bool, False)
    if echo and chat:
        raise RequestError("echo is for /v1/completions; leave it out of chat requests")
    stream = _get(body, "stream", bool, False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object")
    include_usage = stream and _get(stream_options, "include_usage", bool, False)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model must be a string")
    return Job(chat, tuple(map(tuple, prompts)), n, sampling, stream, include_usage, model, echo)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top logprobs per token (None: no logprobs): chat's `logprobs: true` with
    `top_logprobs: k`, completions' `logprobs: k`."""
    if not chat:  # (false: off, as some clients send it)
        k = None if body.get("logprobs") is False else _get(body, "logprobs", int, None)
        if body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs is for chat; completions take logprobs: k")
    elif _get(body, "logprobs", bool, False):
        k = _get(body, "top_logprobs", int, 0)
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs needs logprobs: true")
    else:
        k = None
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise RequestError(f"{name} = {k} is invalid; it must be in 0..{MAX_LOGPROBS}")
    return k


def _choices(body: dict, prompts: int, limits: ServerOptions) -> None:
    """Refuse more than max_choices choices (prompts x n) in one request."""
    n = _get(body, "n", int, 1)
    if n < 1:
        raise RequestError(f"n = {n} is invalid; it must be at least 1")
    if prompts * n > limits.max_choices:
        raise RequestError(
            f"{prompts} prompt(s) x n = {n} is {prompts * n} choices, over this server's "
            f"max_choices ({limits.max_choices}); send fewer prompts or a smaller n"
        )


def _stop(stop, limits: ServerOptions) -> tuple[str, ...]:
    """Stop strings: at most max_stop_strings, each of at most MAX_STOP_LENGTH characters."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings")
    if len(stops) > limits.max_stop_strings:
        raise RequestError(
            f"stop has {len(stops)} strings, over this server's max_stop_strings "
            f"({limits.max_stop_strings})"
        )
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        longest = max(len(s) for s in stops)
        raise RequestError(
            f"a stop string of {longest} characters is over the limit ({MAX_STOP_LENGTH})"
        )
    return tuple(stops)


def _fits_kib(value, what: str, limits: ServerOptions) -> None:
    """Refuse a schema, grammar or tool list over max_grammar_kib (as compact JSON)."""
    if value is None:
        return
    try:
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    except RecursionError:
        raise RequestError(f"{what} is nested too deeply") from None
    except (TypeError, ValueError):
        return  # not JSON-like: the field's own check says what is wrong
    size = len(text.encode(errors="replace"))
    if size > limits.max_grammar_kib << 10:
        raise RequestError(
            f"{what} is {size / 1024:.0f} KiB, over this server's max_grammar_kib "
            f"({limits.max_grammar_kib})"
        )


def _constraint(body: dict, forced: str | None, limits: ServerOptions) -> dict:
    """The structured-output keywords of SamplingParams: OpenAI's response_format, or
    llama.cpp's json_schema and grammar (GBNF, or llguidance's Lark after %llguidance); or
    `forced`, the grammar of a tool call tool_choice demands."""
    given = [n for n in ("response_format", "json_schema", "grammar") if body.get(n) is not None]
    for name in given:
        _fits_kib(body[name], name, limits)
    if forced is not None:
        if given:
            raise RequestError(f"tool_choice forces a tool call; leave {given[0]} out")
        return {"grammar": forced}
    if len(given) > 1:
        raise RequestError(f"pass one of {' / '.join(given)}, not several")
    if body.get("grammar") is not None:
        return {"grammar": _get(body, "grammar", str, None)}
    if body.get("json_schema") is not None:
        return {"json_schema": _schema(body["json_schema"], "json_schema")}
    form = body.get("response_format")
    if form is None:
        return {}
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":  # llama.cpp lets a schema ride along
        return {"json_schema": _schema(form.get("schema", {}), "response_format.schema")}
    if kind == "json_schema":
        spec = form.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
            raise RequestError("response_format.json_schema must be an object with a schema")
        where = "response_format.json_schema.schema"
        return {"json_schema": _schema(spec.get("schema", {}), where)}
    raise RequestError(
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
    )


def _schema(schema, where: str) -> dict:
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON schema object")
    return schema


def _prompt_ids(prompt, tokenizer: Tokenizer, n_ctx: int, where: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{where} is empty; pass some text or token ids")
        if at_least := tokenizer.too_long(prompt, n_ctx - 1):
            raise ContextError(at_least, n_ctx, at_least=True)
        ids = tokenizer.encode(prompt)
    else:
        ids = token_ids(prompt, tokenizer.vocab_size, where)
        if not ids:
            raise RequestError(f"{where} is empty; pass some text or token ids")
    _fits(len(ids), n_ctx)
    return ids


def _fits(n_prompt: int, n_ctx: int) -> None:
    if n_prompt > n_ctx - 1:  # room for at least one new token
        raise ContextError(n_prompt, n_ctx)


def token_ids(ids, vocab: int, where: str) -> list[int]:
    """A JSON list of integer token ids in [0, vocab), or a one-line RequestError."""
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise RequestError(f"{where} must be a list of integer token ids")
    return engine_token_ids(f"{where} token ids", ids, vocab)  # the range check


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _get(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        want = {int: "an integer", bool: "true or false", str: "a string"}[kind]
        raise RequestError(f"{name} = {value!r:.40} is invalid; it must be {want}")
    return value


def flag(body: dict, name: str) -> bool:
    """A boolean field, false when absent or null: JSON true or false, nothing else."""
    return _get(body, name, bool, False)


def _max_tokens(body: dict, name: str, default):
    """A token count: an integer in 0..2**31-1, or llama.cpp's -1 (until the context ends)."""
    value = _get(body, name, int, default)
    if value is not None and not -1 <= value <= 2**31 - 1:
        raise RequestError(
            f"{name} = {value} is invalid; it must be -1 (until the context ends) or in "
            f"0..{2**31 - 1}"
        )
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
