"""Reasoning budgets: how many tokens a thinking model may think before it is made to stop.

A thinking model writes its reasoning between a start and an end tag (`<think>` ... `</think>`)
before its answer; its chat template may open the tag in the prompt. `Reasoning` says what a
request allows; `Thoughts` follows its tokens: it counts the tokens after the start tag and,
once `budget` of them are spent, forces the end tag's tokens one by one through the token mask
the sampler already takes (sampling.SamplingRows.mask), so a budget compiles nothing. A grammar
(structured output, a forced tool call) starts after the reasoning ends.

The host sees every token of a row that thinks: while it is undecided (does the answer start
with the tag?) or writing the end, one token per call; while it thinks, at most the tokens
left in its budget per call (every call, where a grammar waits for the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RequestError
from ..ops.sampling import mask_words

# The phases of a request's reasoning.
UNDECIDED, THINKING, CLOSING, DONE = "undecided", "thinking", "closing", "done"


@dataclass(frozen=True)
class Reasoning:
    """What a request's reasoning may do: `budget` tokens after the start tag (-1: no limit, 0:
    none), between `start` and `end`; `opened`: the prompt ends inside the start tag (the
    template opened it), so the answer begins thinking."""

    budget: int = -1
    start: str = "<think>"
    end: str = "</think>"
    opened: bool = False

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < -1:
            raise RequestError(
                f"thinking_budget = {self.budget!r} is invalid; use -1 (no limit), 0 (no "
                "thinking) or a number of tokens"
            )
        if not self.start or not self.end:
            raise RequestError("a reasoning start and end tag must be non-empty text")


class Thoughts:
    """One request's reasoning as its tokens arrive: `saw(token, text)` after each token (its
    text so far), `steps()` and `mask()` before each call."""

    def __init__(self, reasoning: Reasoning, end_ids: list[int], vocab: int):
        self.reasoning = reasoning
        self.end_ids = end_ids  # the end tag's tokens, forced in order once the budget is spent
        self.vocab = vocab
        self.phase = UNDECIDED
        self.count = 0  # reasoning tokens so far
        self.forced = 0  # end-tag tokens forced so far
        self.at = 0  # where the reasoning starts in the request's text
        self.seen = 0  # the text's length at the last token: the end tag is looked for after
        if reasoning.opened:
            self._think(0)

    @property
    def done(self) -> bool:
        return self.phase == DONE

    @property
    def guides(self) -> bool:
        """Whether the host must see its tokens as they come (a budget to keep); without one
        they are only counted, whatever each call makes."""
        return self.reasoning.budget >= 0

    def _think(self, at: int) -> None:
        self.phase, self.at = THINKING, at
        if self.reasoning.budget == 0:
            self.phase = CLOSING

    def saw(self, token: int, text: str) -> None:
        """Follow one generated token; `text` is the request's whole text after it (only its
        new end is searched: a long reasoning costs no more per token than a short one)."""
        new = max(self.at, self.seen - len(self.reasoning.end) + 1)  # where the tag may end
        self.seen = len(text)
        if self.phase == UNDECIDED:
            body = text.lstrip()
            start = self.reasoning.start
            if body.startswith(start):
                self._think(len(text) - len(body) + len(start))
            elif not start.startswith(body):  # an answer without reasoning
                self.phase = DONE
        elif self.phase == THINKING:
            if text.find(self.reasoning.end, new) >= 0:
                self.phase = DONE
                return
            self.count += 1
            if self.reasoning.budget >= 0 and self.count >= self.reasoning.budget:
                self.phase = CLOSING
        elif self.phase == CLOSING:
            self.forced += 1
            if self.forced >= len(self.end_ids) or text.find(self.reasoning.end, new) >= 0:
                self.phase = DONE

    def steps(self, grammar: bool) -> int | None:
        """The most tokens the next call may make before the host must look (None: any);
        `grammar`: a grammar starts once the reasoning ends."""
        budget = self.reasoning.budget
        if self.phase == DONE or (self.phase != CLOSING and budget < 0 and not grammar):
            return None
        if self.phase == THINKING and not grammar:
            return budget - self.count
        return 1

    def mask(self) -> np.ndarray | None:
        """[mask_words(V)] int32 allowing only the end tag's next token while it is forced;
        None otherwise."""
        if self.phase != CLOSING:
            return None
        token = self.end_ids[self.forced]
        mask = np.zeros(mask_words(self.vocab), np.int32)
        mask[token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return mask
