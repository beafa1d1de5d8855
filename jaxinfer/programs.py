"""The compiled programs: pure functions of arrays, and the registry that describes them.

  cache()                                            -> kv                 zeroed page pools
  prefill(params, kv, chunk, window, sampling)       -> kv, tokens [B]     one prompt chunk per row
  decode(params, kv, state, table, sampling, steps)  -> kv, state, out [B, C]
  score(params, kv, chunk)                           -> kv, logits [B, T, V]

The page pools and linear-layer states `kv` are donated. `decode` runs up to C steps inside
one `while_loop` and leaves early when every row is done, so the host only wakes to stream
and check stops. No program depends on the context length: rows reach their pages through
block tables. Each program's per-call inputs are typed structs, described once here for both
warmup and serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import gdn
from .gdn import RecurrentState
from .kvcache import KVConfig, KVView
from .placement import Runner
from .sampling import PENALTY_WINDOW, SamplingRows, sample

I32 = np.int32


def _spec(*shape, dtype=I32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@struct.dataclass
class Chunk:
    """A prompt chunk of B rows: tokens at positions view.start + t, the first view.length real."""

    tokens: jax.Array  # [B, T] int32, padding 0
    view: KVView

    @staticmethod
    def abstract(B: int, T: int, NB: int) -> Chunk:
        return Chunk(_spec(B, T), KVView(_spec(B, NB), _spec(B), _spec(B), _spec(B)))


@struct.dataclass
class DecodeState:
    """The decode loop's carry: what each row feeds next and how far it may go."""

    tokens: jax.Array  # [B] int32, the next input token
    pos: jax.Array  # [B] int32, its position
    budget: jax.Array  # [B] int32, tokens still allowed
    done: jax.Array  # [B] bool, padding rows start done
    window: jax.Array  # [B, W] int32, recent tokens by position mod W (-1 = empty)
    slot: jax.Array  # [B] int32, the row's state slot (linear layers; 0 = padding)

    @staticmethod
    def abstract(B: int) -> DecodeState:
        return DecodeState(
            _spec(B),
            _spec(B),
            _spec(B),
            _spec(B, dtype=np.bool_),
            _spec(B, PENALTY_WINDOW),
            _spec(B),
        )


@dataclass(frozen=True)
class Program:
    fn: Callable  # the pure function
    inputs: Callable[[int, int, int], tuple]  # (B, T, NB) -> abstract per-call inputs
    outputs: tuple[str, ...]  # per output: "kv" (the pools' shardings) or "rep" (replicated)
    donate: tuple[str, ...] = ("kv",)  # argument names donated to the call


def programs(runner: Runner, kv_config: KVConfig, tokens_per_call: int) -> dict[str, Program]:
    """The programs of one model on one mesh; `tokens_per_call` = C, most decode steps a call."""

    def cache():
        return runner.init_kv(kv_config)

    def prefill(params, kv, chunk: Chunk, window, sampling: SamplingRows):
        """window [B, W] of the whole prompt; samples after each row's last real token."""
        B, T = chunk.tokens.shape
        h, kv = runner.forward(params, chunk.tokens, chunk.view, kv)  # [B, T, D]
        last = jnp.clip(chunk.view.length - 1, 0, T - 1)  # [B]
        logits = runner.head(params, h[jnp.arange(B), last])  # [B, V]
        return kv, sample(logits, window, sampling, chunk.view.start + chunk.view.length)

    linear = [isinstance(c, RecurrentState) for c in runner.caches]
    axis = runner.state_axis

    def decode(params, kv, state: DecodeState, table, sampling: SamplingRows, steps):
        """Up to `steps` (<= C) tokens per row; table [B, NB] covers every position written.
        Linear layers' states leave their slots for the loop and return after it."""
        B = state.tokens.shape[0]
        rows = jnp.arange(B)
        pools = kv
        kv = [
            gdn.take(c, state.slot, axis) if lin else c for c, lin in zip(kv, linear, strict=True)
        ]

        def step(carry):
            i, kv, s, out = carry
            # The input token joins the penalty context of the token it predicts.
            window = s.window.at[rows, s.pos % PENALTY_WINDOW].set(s.tokens)
            live = ~s.done
            # Done rows write the null page and leave their linear state as it is.
            view = KVView(table, s.pos, live.astype(I32), None)
            h, kv = runner.forward(params, s.tokens[:, None], view, kv)  # [B, 1, D]
            new = sample(runner.head(params, h[:, 0]), window, sampling, s.pos + 1)  # [B]
            stop = jnp.any(new[:, None] == sampling.stops, axis=-1)
            budget = s.budget - live
            out = out.at[:, i].set(jnp.where(live, new, -1))
            s = DecodeState(
                tokens=jnp.where(live, new, s.tokens),
                pos=s.pos + live,
                budget=budget,
                done=s.done | stop | (budget <= 0),
                window=window,
                slot=s.slot,
            )
            return i + 1, kv, s, out

        def more(carry):
            i, _, s, _ = carry
            return (i < steps) & ~jnp.all(s.done)

        out = jnp.full((B, tokens_per_call), -1, I32)
        _, kv, state, out = jax.lax.while_loop(more, step, (jnp.int32(0), kv, state, out))
        kv = [
            gdn.put(p, c, state.slot, axis) if lin else c
            for p, c, lin in zip(pools, kv, linear, strict=True)
        ]
        return kv, state, out

    def score(params, kv, chunk: Chunk):
        h, kv = runner.forward(params, chunk.tokens, chunk.view, kv)
        return kv, runner.head(params, h)  # [B, T, V]

    return {
        "cache": Program(cache, lambda B, T, NB: (), ("kv",), donate=()),
        "prefill": Program(
            prefill,
            lambda B, T, NB: (
                Chunk.abstract(B, T, NB),
                _spec(B, PENALTY_WINDOW),
                SamplingRows.abstract(B),
            ),
            ("kv", "rep"),
        ),
        "decode": Program(
            decode,
            lambda B, T, NB: (
                DecodeState.abstract(B),
                _spec(B, NB),
                SamplingRows.abstract(B),
                _spec(),
            ),
            ("kv", "rep", "rep"),
        ),
        "score": Program(score, lambda B, T, NB: (Chunk.abstract(B, T, NB),), ("kv", "rep")),
    }
