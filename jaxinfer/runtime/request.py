"""A request on the host: its prompt, sampling values and stops, and the text it has made.

`RequestState.accept(ids, lp)` takes the ids a compiled call produced for this request (and
their log-probabilities, where it asked for them): it applies stop tokens, stop strings, the
token budget and the end of its grammar, detokenizes incrementally, and returns the piece of
text that can be shown (held back while it could still start a stop string).
`Request` is the handle `Engine.submit` returns.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..formats.tokenizer import StreamDecoder
from ..options import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw logits, and the `k` best
    tokens' (id, logprob) pairs at its position, best first (k = the request's `logprobs`)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only (a final EOS / stop token included)
    prompt_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length" or "cancelled"
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    queue_ms: float = 0.0  # from submit to admission (waiting for a slot or KV pages)
    prompt_ms: float = 0.0  # from admission to the first new token (prefill)
    decode_ms: float = 0.0  # from the first new token to the last
    logprobs: list[TokenLogprob] | None = None  # one per generated token, where asked for
    stop_string: str | None = None  # the stop string that ended the text, if one did
    reasoning_tokens: int = 0  # of token_ids, those written inside the reasoning tags


@dataclass(frozen=True)
class StreamPiece:
    text: str  # newly completed text (held back while it could start a stop string)
    token_ids: list[int]  # ids produced since the previous piece
    finish_reason: str | None = None  # set on the last piece
    logprobs: tuple[TokenLogprob, ...] = ()  # of token_ids, where asked for


@dataclass(eq=False)
class RequestState:
    """One request being served, from submit to its last token."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    stop_strings: list[str]
    budget: int  # new tokens allowed (max_new_tokens clipped to the context)
    decoder: StreamDecoder
    sampling: tuple  # its packed sampling row (SamplingRows.row), checked at submit
    interactive: bool = False  # streamed or with stop strings: the host wakes more often
    constraint: Any = None  # structured.Constraint: the grammar its tokens follow
    thoughts: Any = None  # reasoning.Thoughts: its reasoning budget (a grammar starts after)
    group: object = None  # requests that share slots fairly as one (a server job's choices)
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache
    served: int = 0  # tokens computed for it (prompt chunks, resumptions and generated)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # a list where params.logprobs asks for them
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    finish: str | None = None
    stop_string: str | None = None  # the stop string that ended it (cut from `text`)
    pieces: deque = field(default_factory=deque)  # delivered, not yet streamed
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def cache_prompt(self) -> bool:
        return self.params.cache_prompt

    @property
    def need(self) -> int:
        """KV positions it can ever write: the prompt and every generated token but the last
        (which is never fed back)."""
        return len(self.prompt) + max(self.budget, 1) - 1

    def steps(self) -> int | None:
        """The most tokens the next call may make for it before the host looks (None: any):
        one under a grammar, the rest of its reasoning budget while it thinks."""
        grammar = self.constraint is not None
        if self.thoughts is not None and not self.thoughts.done:
            return self.thoughts.steps(grammar)
        return 1 if grammar else None

    def mask(self) -> np.ndarray | None:
        """[mask_words(V)] int32, the tokens it may take next (None: any): the end of its
        reasoning while it is forced, then its grammar's."""
        if self.thoughts is not None and not self.thoughts.done:
            return self.thoughts.mask()
        return None if self.constraint is None else self.constraint.mask()

    def end(self, reason: str) -> None:
        self.finish = reason
        self.finished_at = time.perf_counter()

    def accept(self, ids: list[int], lp=None) -> StreamPiece:
        """Append newly generated ids (lp: their sampling.Logprobs rows on the host, where the
        request wants them); the piece they complete (maybe empty)."""
        if self.finish or not ids:
            return StreamPiece("", [], self.finish)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        piece = self._accept(ids)
        if self.logprobs is not None and lp is not None:
            k = self.params.logprobs
            made = [
                TokenLogprob(t, float(lp.token[i]), tuple(zip(best[:k], values[:k], strict=True)))
                for i, (t, best, values) in enumerate(
                    zip(piece.token_ids, lp.ids.tolist(), lp.values.tolist(), strict=False)
                )
            ]
            self.logprobs.extend(made)
            piece = StreamPiece(piece.text, piece.token_ids, piece.finish_reason, tuple(made))
        if self.finish:
            self.finished_at = time.perf_counter()
        return piece

    def _accept(self, ids: list[int]) -> StreamPiece:
        over = False
        thinking = self.thoughts is not None and not self.thoughts.done
        if self.constraint is not None and not thinking:  # one token per call; its grammar
            ids = ids[:1]  # may end with it
            over = not self.constraint.consume(ids[0])
        if self.stop_strings or thinking:
            new_ids = self._accept_each(ids)
        else:  # the device already stopped at stop tokens: take the chunk whole
            new_ids = ids[: self.budget - len(self.token_ids)]
            hit = next((k for k, t in enumerate(new_ids) if t in self.stop_ids), None)
            if hit is not None:
                new_ids = new_ids[: hit + 1]
                self.finish = "stop"
            elif len(self.token_ids) + len(new_ids) >= self.budget:
                self.finish = "length"
            self.token_ids += new_ids
            self.text += self.decoder.push(new_ids[:hit] if hit is not None else new_ids)
            if self.finish:
                self.text += self.decoder.flush()
        if over and not self.finish:
            self.finish = "stop"
            self.text += self.decoder.flush()
        hold = 0 if self.finish else max((len(s) for s in self.stop_strings), default=1) - 1
        upto = max(self.emitted, len(self.text) - hold)
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return StreamPiece(piece, new_ids, self.finish)

    def _accept_each(self, ids: list[int]) -> list[int]:
        """Token by token, so that a stop string ends the ids right where it completes."""
        new_ids = []
        for tok in ids:
            new_ids.append(tok)
            self.token_ids.append(tok)
            if tok in self.stop_ids:
                self.finish = "stop"
                self.text += self.decoder.flush()
                break
            before = len(self.text)
            self.text += self.decoder.push([tok])
            if self.thoughts is not None and not self.thoughts.done:
                self.thoughts.saw(tok, self.text)
            if self._cut_stop_string(before):
                break
            if len(self.token_ids) >= self.budget:
                self.finish = "length"
                self.text += self.decoder.flush()
                break
        return new_ids

    def _cut_stop_string(self, before: int) -> bool:
        """End the text at the first stop string that the text after position `before` (new
        this token) completes: each token scans its own text and len(s) - 1 before it."""
        for s in self.stop_strings:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.finish, self.stop_string = "stop", s
                return True
        return False

    def result(self) -> Result:
        def ms(a, b):
            return (b - a) * 1e3 if a is not None and b is not None else 0.0

        return Result(
            text=self.text,
            token_ids=list(self.token_ids),
            prompt_ids=list(self.prompt),
            finish_reason=self.finish or "length",
            cached_tokens=self.cached_tokens,
            queue_ms=ms(self.submitted_at, self.admitted_at),
            prompt_ms=ms(self.admitted_at, self.first_token_at),
            decode_ms=ms(self.first_token_at, self.finished_at),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            stop_string=self.stop_string,
            reasoning_tokens=0 if self.thoughts is None else self.thoughts.count,
        )


class Request:
    """A submitted request: `result()` and `stream()` drive the engine until it is done."""

    def __init__(self, state: RequestState, drive: Callable[[], None], cancel: Callable):
        self.state = state
        self._drive = drive  # one engine step
        self._cancel = cancel

    @property
    def done(self) -> bool:
        return self.state.finish is not None

    def result(self) -> Result:
        while not self.done:
            self._drive()
        return self.state.result()

    def stream(self) -> Iterator[StreamPiece]:
        """Pieces of text as they are produced. Closing the stream early (a client gone, a
        `break`) cancels the request, so its slot and pages free at once."""
        pieces = self.state.pieces
        try:
            while True:
                while pieces:
                    yield pieces.popleft()
                if self.done:
                    return
                self._drive()
        finally:
            if not self.done:
                self.cancel()

    def cancel(self) -> None:
        self._cancel(self.state)

    @property
    def latency(self) -> float | None:
        """Seconds from submit to the last token."""
        s = self.state
        return None if s.finished_at is None else s.finished_at - s.submitted_at

    @property
    def time_to_first_token(self) -> float | None:
        s = self.state
        return None if s.first_token_at is None else s.first_token_at - s.submitted_at
