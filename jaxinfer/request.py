"""A request on the host: its prompt, sampling values and stops, and the text it has made.

`Row.accept(ids)` takes the ids a compiled decode call produced for this request: it applies
stop tokens, stop strings and the token budget, detokenizes incrementally, and returns the
piece of text that can be shown (held back while it could still start a stop string).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams
from .tokenizer import StreamDecoder


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only (a final EOS / stop token included)
    prompt_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length" or "cancelled"
    prompt_ms: float = 0.0  # prefill time of the batch this request was in
    decode_ms: float = 0.0  # decode time of the batch this request was in


@dataclass(frozen=True)
class StreamPiece:
    text: str  # newly completed text (held back while it could start a stop string)
    token_ids: list[int]  # ids produced since the previous piece
    finish_reason: str | None = None  # set on the last piece


@dataclass
class Row:
    """One request being served (a row of a batch, or a slot)."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    stop_strings: list[str]
    budget: int  # new tokens allowed (max_new_tokens clipped to the context)
    decoder: StreamDecoder
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    finish: str | None = None
    prompt_ms: float = 0.0
    decode_ms: float = 0.0

    def accept(self, ids: list[int]) -> StreamPiece:
        """Append newly generated ids; the piece they complete (maybe empty)."""
        if self.finish or not ids:
            return StreamPiece("", [], self.finish)
        if self.stop_strings:
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
            self.text += self.decoder.push([tok])
            if self._cut_stop_string():
                break
            if len(self.token_ids) >= self.budget:
                self.finish = "length"
                self.text += self.decoder.flush()
                break
        return new_ids

    def _cut_stop_string(self) -> bool:
        for s in self.stop_strings:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.finish = "stop"
                return True
        return False

    def result(self) -> Result:
        return Result(
            text=self.text,
            token_ids=list(self.token_ids),
            prompt_ids=list(self.prompt),
            finish_reason=self.finish or "length",
            prompt_ms=self.prompt_ms,
            decode_ms=self.decode_ms,
        )
