"""Prompt lookup by brute force: the independent reference of the n-gram proposer
(jaxinfer.runtime.speculative) and of the host's drafting choice (runtime.drafting)."""

from __future__ import annotations

NGRAM_MIN, NGRAM_MAX = 2, 8  # match lengths, as llama.cpp's and vLLM's prompt lookup take them


def ngram_reference(context: list[int], k: int, held: int | None = None) -> list[int]:
    """The longest (NGRAM_MIN..NGRAM_MAX) suffix of `context` that occurs earlier, the latest
    such occurrence; the up to k tokens after it. `held`: the history's width, when only the
    occurrences whose window lies in the last `held` - NGRAM_MAX positions count."""
    pos = len(context) - 1
    first = 0 if held is None else pos - held + NGRAM_MAX
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if n > pos:
            continue
        suffix = context[pos - n + 1 :]
        for end in range(pos - 1, max(n - 2, first - 1), -1):
            if context[end - n + 1 : end + 1] == suffix:
                return context[end + 1 : end + 1 + k]
    return []
