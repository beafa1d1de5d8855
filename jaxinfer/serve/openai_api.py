"""The OpenAI API's completion requests and responses, as plain dicts.

`completion_job` / `chat_job` check a request body and turn it into a `Job`: the prompts as
token ids, `n` choices each, and their `SamplingParams` (which check every value: one-line
RequestErrors). The Job then shapes the answer:
a whole response, or the chunks of a Server-Sent-Events stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine import token_ids as engine_token_ids
from ..errors import RequestError
from ..formats.tokenizer import Tokenizer
from ..options import SamplingParams
from ..runtime.request import Result
from .chat import ChatTemplate, check_messages

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
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
MAX_CHOICES = 128


class ContextError(RequestError):
    """A prompt longer than the context (llama-server's exceed_context_size_error)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} "
            "tokens), try increasing it (-c)"
        )
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

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

    def response(self, results: Sequence[Result]) -> dict:
        if self.chat:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": r.text},
                 "logprobs": None, "finish_reason": finish_reason(r)}
                for i, r in enumerate(results)
            ]  # fmt: skip
        else:
            choices = [
                {"index": i, "text": r.text, "logprobs": None, "finish_reason": finish_reason(r)}
                for i, r in enumerate(results)
            ]
        obj = "chat.completion" if self.chat else "text_completion"
        answer = {**self._head(obj), "choices": choices, "usage": usage(self, results)}
        return {**answer, "timings": timings(results[0])}

    def chunk(self, index: int, text: str | None, finish: str | None = None) -> dict:
        """One streamed chunk of choice `index`: new text, or (text None) its end. A chat
        stream opens each choice with its role (`opening`)."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

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


def finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(job: Job, results: Sequence[Result]) -> dict:
    prompt = sum(len(ids) for ids in job.prompts)  # each prompt once, as OpenAI counts
    completion = sum(len(r.token_ids) for r in results)
    # prompt tokens the prefix cache held: each prompt once (its first choice's)
    cached = sum(r.cached_tokens for r in results[:: job.n])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


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


def completion_job(body, tokenizer: Tokenizer, n_ctx: int, model: str) -> Job:
    """POST /v1/completions: prompt is a string, a list of them, token ids or a list of those."""
    body = _object(body)
    if "prompt" not in body:
        raise RequestError("prompt is required: a string, a list of strings or token ids")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        texts = prompt
    else:
        raise RequestError("prompt must be a string, a list of strings, token ids or lists of them")
    prompts = [_prompt_ids(p, tokenizer, n_ctx, f"prompt[{k}]") for k, p in enumerate(texts)]
    return _job(body, prompts, n_ctx, model, chat=False, default_max=16)  # OpenAI's default


def chat_job(body, template: ChatTemplate | None, n_ctx: int, model: str) -> Job:
    """POST /v1/chat/completions: messages rendered with the model's chat template."""
    body = _object(body)
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
    generation = _get(body, "add_generation_prompt", bool, True)
    ids = template.encode(messages, add_generation_prompt=generation, **extra)
    _fits(len(ids), n_ctx)
    max_tokens = _get(body, "max_completion_tokens", int, None)
    body = {**body, "max_tokens": _get(body, "max_tokens", int, max_tokens)}
    return _job(body, [ids], n_ctx, model, chat=True, default_max=None)  # the whole context


def _job(body: dict, prompts, n_ctx: int, model: str, *, chat: bool, default_max) -> Job:
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise RequestError(f"{name} is not supported by this server; leave it out")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n = {n} is invalid; it must be in 1..{MAX_CHOICES}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise RequestError("best_of is not supported by this server (only best_of = n)")
    max_tokens = _get(body, "max_tokens", int, default_max)
    if max_tokens is None or max_tokens < 0:  # llama.cpp's -1: until the context is full
        max_tokens = n_ctx
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise RequestError("stop must be a string or a list of strings")
    sampling = SamplingParams(
        max_new_tokens=max_tokens,
        stop=stop or (),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        cache_salt=_get(body, "cache_salt", str, None),
        cache_prompt=_get(body, "cache_prompt", bool, True),
        **{kw: body[key] for key, kw in SAMPLING.items() if body.get(key) is not None},
    )
    stream = _get(body, "stream", bool, False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object")
    include_usage = stream and _get(stream_options, "include_usage", bool, False)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model must be a string")
    return Job(chat, tuple(map(tuple, prompts)), n, sampling, stream, include_usage, model)


def _prompt_ids(prompt, tokenizer: Tokenizer, n_ctx: int, where: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{where} is empty; pass some text or token ids")
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
        raise RequestError(f"{name} = {value!r} is invalid; it must be {want}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
