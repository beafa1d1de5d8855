"""The typed per-call inputs of the compiled programs, described once for warmup (abstract
shapes) and serving (host arrays): a prompt chunk, and the decode loop's carry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..model.kvcache import KVView
from ..ops.sampling import PENALTY_WINDOW

I32 = np.int32


def abstract(*shape, dtype=I32) -> jax.Array:
    """A shape and dtype standing in for an array (the lowering reads nothing else)."""
    return cast(jax.Array, jax.ShapeDtypeStruct(shape, dtype))


@struct.dataclass
class Chunk:
    """A prompt chunk of B rows: tokens at positions view.start + t, the first view.length real.
    With prefix snapshots, view.source and view.snaps say where linear states start from and
    which page ends keep theirs."""

    tokens: jax.Array  # [B, T] int32, padding 0
    view: KVView

    @staticmethod
    def abstract(B: int, T: int, NB: int, source: bool = False, snaps: bool = False) -> Chunk:
        view = KVView(abstract(B, NB), abstract(B), abstract(B), abstract(B))
        if source:
            view = view.replace(source=abstract(B))
        if snaps:
            view = view.replace(snaps=abstract(B, NB))
        return Chunk(abstract(B, T), view)


@struct.dataclass
class DecodeState:
    """The decode loop's carry: what each row feeds next and how far it may go."""

    tokens: jax.Array  # [B] int32, the next input token
    pos: jax.Array  # [B] int32, its position
    budget: jax.Array  # [B] int32, tokens still allowed
    done: jax.Array  # [B] bool, padding rows start done
    window: jax.Array  # [B, W] int32, recent tokens by position mod W (-1 = empty)
    state_index: jax.Array  # [B] int32, the row's state index (linear layers; 0 = padding)
    history: jax.Array  # [B, H] int32, tokens by position mod H for n-gram lookup (H may be 0)
    # [B, 2] int32 speculation back-off. A draft model or MTP: verify steps in a row that kept
    # no draft, and steps left without drafting (each miss doubles the wait;
    # speculative.backoff). n-gram: its proposals that came true in a row, and how many it
    # needs before it drafts (speculative.trust)
    backoff: jax.Array

    if TYPE_CHECKING:  # added by flax.struct.dataclass, which the type checker cannot see

        def replace(self, **updates: Any) -> DecodeState: ...

    @staticmethod
    def abstract(B: int, history: int = 0) -> DecodeState:
        return DecodeState(
            abstract(B),
            abstract(B),
            abstract(B),
            abstract(B, dtype=np.bool_),
            abstract(B, PENALTY_WINDOW),
            abstract(B),
            abstract(B, history),
            abstract(B, 2),
        )


def ring_put(ring: jax.Array, start: jax.Array, new: jax.Array, count: jax.Array) -> jax.Array:
    """ring [B, W, ...] with new[b, j] at position (start[b] + j) mod W for j < count[b]
    (new [B, t, ...]). Selects, not a scatter: XLA CPU turns a scatter into a loop of its own,
    which costs a small model's decode step more than its forward."""
    W, t = ring.shape[1], new.shape[1]
    j = (jnp.arange(W)[None] - start[:, None]) % W  # [B, W] which of new lands at each entry
    inside = j < count[:, None]
    j = jnp.minimum(j, t - 1).reshape(j.shape + (1,) * (ring.ndim - 2))
    src = jnp.take_along_axis(new, j, axis=1)
    return jnp.where(inside.reshape(j.shape), src, ring)
