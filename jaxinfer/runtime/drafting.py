"""Which decode program an n-gram engine's call runs: `verify[B]`, which drafts, or the plain
`decode[B]`, chosen on the host before each call.

A verify step scores K + 1 tokens, and on a small model that costs several plain steps
(stories260K: 3-4 with the phase switches), so prompt lookup pays only where the text repeats
and the verify loop's per-step lookup is a cost of its own where it never does. Each row keeps a
`Drafting`: a row whose prompt ends in tokens the lookup would have predicted drafts from its
first call, any other starts with a plain call (`predicted`). A verify call that does not pay for a
row (the drafts it kept make fewer tokens than its verify steps cost in plain steps, by the
`StepCosts` the calls measure) makes it wait 1, 3, 7, then 15 plain calls before it drafts
again; one that pays ends the wait. A call verifies when any of its rows wants to draft
(inside the verify loop each row still drafts only after its lookup proved right:
speculative.trust).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PREDICTED = 2  # a prompt's last tokens the lookup must have predicted for its row to draft
TRUST_MAX = 8  # most of them counted (speculative.trust)
# The lookup's own parameters, here on the host side; speculative.py's device lookup takes
# them from this module.
NGRAM_HISTORY = 1024  # positions of a row's history the lookup searches
NGRAM_MIN, NGRAM_MAX = 2, 8  # match lengths (llama.cpp's ngram-simple and vLLM's lookup use 2..)
WAIT_LOG2 = 4  # at most 2**4 - 1 = 15 plain calls between verify calls


def predicted(tokens: Sequence[int], most: int = TRUST_MAX) -> int:
    """How many of the last tokens (up to `most`) prompt lookup would have predicted, each in
    a row back from the end: the longest match (2 to 8 tokens, the most recent among equals)
    of the tokens before it with an earlier window was followed by it."""
    ids = np.asarray(tokens[-NGRAM_HISTORY:], np.int64)
    checked = range(len(ids) - 1, max(len(ids) - 1 - most, 2), -1)  # a window before each
    for n, i in enumerate(checked):
        ends = np.arange(1, i - 1)  # earlier windows end at k < i - 1, followed by ids[k + 1]
        length = np.zeros(len(ends), np.int64)
        run = np.ones(len(ends), bool)
        for t in range(min(NGRAM_MAX, i)):  # ids[i] from the window ending at i - 1
            back = ends - t
            run &= (back >= 0) & (ids[np.maximum(back, 0)] == ids[i - 1 - t])
            length += run
        best = ends[np.argmax(length * len(ids) + ends)]  # longest, then most recent
        if length.max() < NGRAM_MIN or ids[best + 1] != ids[i]:
            return n
    return len(checked)


@dataclass
class Drafting:
    """One row's choice between drafting and plain calls."""

    wait: int = 0  # plain calls before it drafts again
    misses: int = 0  # verify calls in a row that did not pay for it
    trust: int = 0  # its lookup's proposals that came true in a row (speculative.trust)

    @staticmethod
    def start(prompt: Sequence[int]) -> Drafting:
        trust = predicted(prompt)
        return Drafting(wait=0 if trust >= PREDICTED else 1, trust=trust)

    @property
    def wants(self) -> bool:
        return self.wait == 0

    def verified(self, kept: int, steps: int, trust: int, costs: StepCosts) -> None:
        """After a verify call in which the row kept `kept` drafts in `steps` verify steps and
        ended with `trust`. (A plain call checks no proposal: the trust it leaves is the last
        verify call's.)"""
        paid = kept > 0 and kept >= steps * (costs.ratio - 1)
        self.misses = 0 if paid else self.misses + 1
        self.trust = trust
        self.wait = (1 << min(self.misses, WAIT_LOG2)) - 1

    def plain(self) -> None:
        """After a plain call."""
        self.wait = max(self.wait - 1, 0)


@dataclass
class StepCosts:
    """Seconds a loop step takes in the plain program and a verify step in the verify program,
    as the calls measure them (moving averages over an engine's calls)."""

    plain: float = 0.0
    verify: float = 0.0

    def timed(self, seconds: float, steps: int, verifies: int) -> None:
        """A call of `steps` loop steps, `verifies` of them verify steps (0: a plain call)."""
        if steps <= 0:
            return
        if not verifies:
            self.plain = _average(self.plain, seconds / steps)
        elif self.plain:  # the verify steps cost what the plain steps leave
            cost = (seconds - (steps - verifies) * self.plain) / verifies
            self.verify = _average(self.verify, max(cost, self.plain))

    @property
    def ratio(self) -> float:
        """A verify step's cost in plain steps (1 until both are measured)."""
        return self.verify / self.plain if self.plain and self.verify else 1.0

    def trust(self, k: int) -> int:
        """How many of its lookup's proposals in a row must have come true before a row drafts
        (speculative.trust): the kept drafts a verify step needs to pay for itself, 1 to k."""
        return min(max(math.ceil(self.ratio - 1), 1), k)


def _average(old: float, new: float, weight: float = 0.2) -> float:
    return new if not old else old + weight * (new - old)
