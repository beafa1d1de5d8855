"""Sampling: per-request values checked on the host, tokens drawn on the device.

Every sampling value travels as an array row, never as a static argument, so changing the
temperature or the seed between requests compiles nothing. The chain follows llama.cpp's
order: penalties over the last `PENALTY_WINDOW` tokens, then temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .errors import RequestError

PENALTY_WINDOW = 64  # llama.cpp's --repeat-last-n default; the prompt tail counts too
N_STOP_IDS = 8  # stop-token slots per row (EOS ids + user stop tokens)

# Column order of the float and int rows packed for the device.
_F = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off; divides positive logits of recent tokens
    presence_penalty: float = 0.0  # subtracted once from every recent token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence in the recent window
    seed: int | None = None  # None = a fresh random seed per request

    def __post_init__(self):
        def bad(name, value, want):
            raise RequestError(f"{name} = {value!r} is invalid; it must be {want}")

        for name in _F:
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, v, "a finite number")
        if self.temperature < 0:
            bad("temperature", self.temperature, ">= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "in [0, 1]")
        if self.repeat_penalty <= 0:
            bad("repeat_penalty", self.repeat_penalty, "> 0 (1 = off)")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            bad("seed", self.seed, "an integer or None")

    def resolved_seed(self) -> int:
        if self.seed is None or self.seed < 0:
            return int(np.random.default_rng().integers(0, 2**31 - 1))
        return self.seed % (2**31 - 1)


def recent_window(ids: list[int]) -> np.ndarray:
    """The penalty window [W] of a context: its last W ids, each at (position mod W), -1 where
    empty. The decode step keeps it up to date by writing each new token at its position."""
    window = np.full(PENALTY_WINDOW, -1, np.int32)
    tail = range(max(0, len(ids) - PENALTY_WINDOW), len(ids))
    window[[p % PENALTY_WINDOW for p in tail]] = [ids[p] for p in tail]
    return window


def pack(params: list[SamplingParams], seeds: list[int], stop_ids: list[list[int]], batch: int):
    """Rows for the device: floats [B, 6], ints [B, 2] (top_k, seed), stops [B, N_STOP_IDS].

    Rows past len(params) are padding and sample greedily.
    """
    f = np.zeros((batch, len(_F)), np.float32)
    f[:, 1] = f[:, 3] = 1.0  # padding rows: top_p 1, repeat_penalty 1
    i = np.zeros((batch, 2), np.int32)
    stops = np.full((batch, N_STOP_IDS), -1, np.int32)
    for b, (p, seed, ids) in enumerate(zip(params, seeds, stop_ids, strict=True)):
        f[b] = [getattr(p, name) for name in _F]
        i[b] = [p.top_k, seed]
        if len(ids) > N_STOP_IDS:
            raise RequestError(f"at most {N_STOP_IDS} stop tokens per request, got {len(ids)}")
        stops[b, : len(ids)] = ids
    return {"f": f, "i": i, "stops": stops}


def _penalize(logits, window, f):
    """llama.cpp penalties over the recent-token window [B, W] (-1 = empty)."""
    B, V = logits.shape
    rows = jnp.arange(B)[:, None]
    counts = (
        jnp.zeros((B, V), jnp.float32)
        .at[rows, window]
        .add((window >= 0).astype(jnp.float32), mode="drop")
    )  # [B, V]
    seen = counts > 0
    rp = f[:, 3:4]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return logits - counts * f[:, 5:6] - seen * f[:, 4:5]


def _filter(logits, f, top_k):
    """Temperature, then top-k, top-p and min-p masks (-inf outside). logits [B, V] f32."""
    V = logits.shape[-1]
    logits = logits / jnp.maximum(f[:, 0:1], 1e-6)
    desc = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)  # [B]
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    desc = jnp.where(jnp.arange(V)[None] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)  # [B, V] over the top-k survivors
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    keep = (before < f[:, 1:2]) | (jnp.arange(V)[None] == 0)  # the best token always stays
    p_cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    min_cut = desc[:, :1] + jnp.log(jnp.maximum(f[:, 2:3], 1e-30))  # p >= min_p * p_max
    cut = jnp.maximum(jnp.maximum(kth, p_cut), min_cut)
    return jnp.where(logits >= cut, logits, -jnp.inf)


def sample(logits, window, sp, positions):
    """logits [B, V] f32, window [B, W], sp packed rows, positions [B] of the new tokens -> [B].

    The key of each draw is (seed, position): the same seed gives the same text however the
    decode is split into calls.
    """
    f, i = sp["f"], sp["i"]
    logits = _penalize(logits, window, f)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        masked = _filter(logits, f, i[:, 0])
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(
            i[:, 1], positions
        )
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(f[:, 0] > 0, drawn, greedy)

    # All-greedy batches skip the sort over the vocabulary.
    return jax.lax.cond(jnp.any(f[:, 0] > 0), draw, lambda _: greedy, None)
