"""Speculative decoding: what proposes the drafts, and how the decode loop carries them.

A speculative engine decodes with `verify` (programs.py) instead of `decode`: each step of its
loop proposes up to K drafts per row, scores the row's input token and its drafts in one
forward of K + 1 tokens, and keeps the accepted prefix (sampling.accept). How many drafts a
row accepts is data, never shape: the program set is the plain one with `verify[B]` in place
of `decode[B]`.

Proposers, all on the device inside the loop:
- `ngram`: prompt lookup. The longest recent match (NGRAM_MIN .. NGRAM_MAX tokens) of the
  row's last tokens in its own history (prompt and output, the last NGRAM_HISTORY positions)
  proposes the tokens that followed it.
- `mtp`: the checkpoint's multi-token-prediction head (model.MTP), one layer with its own KV
  layer in the page pool: after each step it reads the model's hidden states of the kept
  tokens (writing their rows of its cache), then chains K - 1 steps on its own output. The
  model's hidden state of a row's last kept token waits in a per-slot `HiddenState`.
- `draft`: a second, smaller model with the same vocabulary, on the same mesh, with its own
  KV layers and linear states in the same page pool and slots; it runs K + 1 greedy decode
  steps per loop step (the last one only feeds its cache the last draft).

Rejected drafts need no undo. Attention KV past the accepted position is overwritten later;
linear-attention layers keep every token's state during the call ([B, K + 1, ...] per row,
`KVView.pick` / `keep_at`) and the next step starts from the accepted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

METHODS = ("ngram", "draft", "mtp")
NGRAM_HISTORY = 1024  # positions of a row's history the lookup searches
NGRAM_MIN, NGRAM_MAX = 2, 8  # match lengths (llama.cpp's ngram-simple and vLLM's lookup use 2..)


@dataclass(frozen=True)
class SpecConfig:
    method: str  # one of METHODS
    k: int  # draft tokens per step (K)
    vocab: int = 0  # a draft model proposes ids below this (the model's vocab_size); 0: any

    @property
    def history(self) -> int:
        """Width of the token history the decode state carries (0: none needed)."""
        return NGRAM_HISTORY if self.method == "ngram" else 0


def ngram(history: jax.Array, pos: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup. history [B, H] token ids by position mod H (-1 = empty), holding
    positions up to pos [B] (the row's input token) -> drafts [B, k], count [B] real drafts.

    The row's last n tokens (n up to NGRAM_MAX) are compared with every earlier window of its
    history; the longest match, the most recent among equals, proposes what followed it.
    """
    B, H = history.shape
    rows = jnp.arange(B)[:, None]
    age = (pos[:, None] - jnp.arange(H)[None]) % H  # [B, H] how far back each entry lies
    length = jnp.zeros((B, H), jnp.int32)
    run = jnp.ones((B, H), jnp.bool_)
    for i in range(NGRAM_MAX):
        token = history[rows, (pos[:, None] - i) % H]  # [B, 1] the suffix's i-th last token
        earlier = jnp.roll(history, i, axis=1)  # [b, x] = history at x - i
        # entry x ends a candidate at position pos - age; its i-th token must exist
        run = run & (earlier == token) & (age + i <= pos[:, None])
        length = length + run
    usable = (age >= 1) & (age <= H - NGRAM_MAX)  # earlier than pos, its window still held
    length = jnp.where(usable, length, 0)
    best = jnp.argmax(length * H - age, axis=1)  # [B]: longest, then most recent
    best_len = jnp.take_along_axis(length, best[:, None], axis=1)[:, 0]
    best_age = jnp.take_along_axis(age, best[:, None], axis=1)[:, 0]
    count = jnp.where(best_len >= NGRAM_MIN, jnp.minimum(k, best_age), 0)  # known followers
    follow = (best[:, None] + 1 + jnp.arange(k)[None]) % H  # [B, k]
    drafts = jnp.take_along_axis(history, follow, axis=1)
    drafts = jnp.where(jnp.arange(k)[None] < count[:, None], drafts, 0)
    return drafts.astype(jnp.int32), count.astype(jnp.int32)
