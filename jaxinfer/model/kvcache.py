"""Paged KV cache: per attention layer a pool of fixed-size pages, per row a block table.

Device side: each attention layer holds two pools (K and V) of shape [P, K, H, page] (a q8_0
pool: [P, K, rows, page] int8, kvquant.py; read back as [.., H, page] floats); a row's block
table [NB] lists the pages holding its positions 0, page, 2 * page, ... Page 0 is the null
page: unallocated table entries point at it and padding tokens write into it, and every read of
it is masked by position. The host's side, `runtime/pages.py`, hands pages to requests as they
grow and shares full pages between requests by content (prefix caching).

Attention reads only the live pages of each row (online softmax, one page per row and loop
step), so its cost grows with the tokens a row holds, not with the context length. Positions
are contiguous inside a page ([K, H, page]), so the score and value products read keys along
their fast axis. Dimension letters as in transformer.py; P pages, NB table entries per row, Q
queries per kv head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from .. import kernels
from ..ops import kvquant
from ..ops.vma import varying_like

NULL_PAGE = 0
NULL_STATE = 0  # the state index padding rows read and write (gdn.py)
AXES = ("cache_seq", "kv_heads", "head_dim", None)  # logical axes of a pool [P, K, H, page]
Q8_AXES = ("cache_seq", "kv_heads", None, None)  # of a q8_0 pool [P, K, rows, page]
PAGE_SIZES = (16, 32, 64, 128, 256)
QUERY_TILE = 128  # queries per causal tile inside a prompt chunk (tiles skip keys above them)
# Chunks up to this many tokens (a speculative verify: the input token and its drafts) read
# every key from the pages with a causal mask per query, as one decode step does: fewer ops
# than a dense block over the chunk plus the pages before it.
PAGED_CHUNK = 16
_MASKED = -1e30  # finite, so that a fully masked block gives exp(0) * 0 and never NaN


@dataclass(frozen=True)
class KVConfig:
    """The pool geometry, the same for every attention layer."""

    page_size: int  # positions per page
    n_pages: int  # pages per layer, the null page included
    table_width: int  # NB: block table entries per row
    # state indices of linear layers (and the MTP head's hidden state): the null state, one per
    # request at once, one for a scoring pass, then `snapshots` prefix snapshots
    n_states: int = 1
    snapshots: int = 0

    @staticmethod
    def plan(
        kv_cache_tokens: int, max_seq_len: int, page_size: int, rows: int = 1, snapshots: int = 0
    ) -> KVConfig:
        """Pages for `kv_cache_tokens`; a state index for each of `rows` requests at once and
        one for a scoring pass, beside the null state; then `snapshots` prefix snapshots."""
        usable = -(-kv_cache_tokens // page_size)
        slots = rows + 2 + snapshots
        return KVConfig(page_size, usable + 1, -(-max_seq_len // page_size), slots, snapshots)

    @property
    def usable_pages(self) -> int:
        return self.n_pages - 1

    @property
    def first_snapshot(self) -> int:
        """The state index of the first prefix snapshot (past the requests' and scoring's)."""
        return self.n_states - self.snapshots


@dataclass(frozen=True)
class AttentionKV:
    """The cache of one attention layer: K and V pools [P, K, rows, page] in the KV cache
    formats (kvquant.py: the engine's kv_cache_dtype, or its K and V sides apart; by default the
    compute dtype): rows = H for a float pool, H values and the scales for q8_0."""

    n_kv_heads: int
    head_dim: int
    k_dtype: kvquant.PoolDtype  # a float dtype or "q8_0"
    v_dtype: kvquant.PoolDtype | None = None  # None: as k_dtype

    def __post_init__(self):
        v = self.k_dtype if self.v_dtype is None else self.v_dtype
        for name, dtype in (("k_dtype", self.k_dtype), ("v_dtype", v)):
            object.__setattr__(self, name, kvquant.pool_dtype(dtype))
            kvquant.check(self.head_dim, getattr(self, name))

    @property
    def dtypes(self) -> tuple[kvquant.PoolDtype, kvquant.PoolDtype]:
        return self.k_dtype, self.v_dtype  # type: ignore[return-value]  # set in __post_init__

    @property
    def AXES(self):  # the caches' common attribute (RecurrentState.AXES, ...)
        """Logical axes of (K pool, V pool): a q8_0 pool's rows (values and scales) stay whole."""
        return tuple(AXES if d != kvquant.Q8_0 else Q8_AXES for d in self.dtypes)

    def shape(self, kv: KVConfig, dtype: kvquant.PoolDtype) -> tuple[int, ...]:
        """A pool's shape in format `dtype`."""
        return (kv.n_pages, self.n_kv_heads, kvquant.rows(self.head_dim, dtype), kv.page_size)

    def init(self, kv: KVConfig) -> tuple[jax.Array, jax.Array]:
        return tuple(  # type: ignore[return-value]
            jnp.zeros(self.shape(kv, d), kvquant.array_dtype(d)) for d in self.dtypes
        )

    def describe(self) -> str:
        """The formats as kv_stats() reports them: "q8_0", or "K q8_0 / V float16" apart."""
        k, v = (str(d) for d in self.dtypes)
        return k if k == v else f"K {k} / V {v}"

    def page_bytes(self, page_size: int) -> int:
        return sum(
            kvquant.page_bytes(self.n_kv_heads, self.head_dim, page_size, d) for d in self.dtypes
        )


@struct.dataclass
class KVView:
    """Where a batch of rows reads and writes: one prompt chunk or one decode token per row."""

    table: jax.Array  # [B, NB] int32 page ids (NULL_PAGE where unallocated)
    start: jax.Array  # [B] int32 position of the row's first token in this call
    length: jax.Array  # [B] int32 tokens of this call that are real (0: an idle row)
    # [B] int32 the row's state index in linear layers (NULL_STATE: padding); None inside a
    # decode loop, whose linear caches are the rows' own states (gdn.read)
    state_index: jax.Array | None
    # Speculative decoding keeps every token's linear state ([B, T+, ...] per row, gdn.py):
    # pick [B] int32 is the kept state a row starts from, keep_at (int32 scalar) where the
    # call's T new states go. None: one state per row.
    pick: jax.Array | None = None
    keep_at: jax.Array | None = None
    # Prefix caching (hybrid models): [B] int32 the state index or snapshot a prompt chunk's
    # linear layers start from (a prefix hit's snapshot; else the row's slot), and [B, NB]
    # int32 per page the snapshot that takes the state at its end (out of range: none).
    # None: no snapshots.
    source: jax.Array | None = None
    snaps: jax.Array | None = None
    # Depth-shared layers (parallel/depth.py): int32 [], the layer a call of the shared body
    # runs, whose caches are entry `layer` of stacks [L, ...] (the kernels use it in place).
    # None: each layer has caches of its own.
    layer: jax.Array | None = None
    # The pools are whole on one device (placement.kernel_fits): attention may run in a
    # kernel (kernels.attention_kernel).
    kernel: bool = struct.field(pytree_node=False, default=False)
    page: int = struct.field(pytree_node=False, default=0)  # positions per page (snapshots)

    if TYPE_CHECKING:  # added by flax.struct.dataclass, which the type checker cannot see

        def replace(self, **updates: Any) -> KVView: ...

    def positions(self, T: int) -> jax.Array:
        return self.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]

    def real(self, T: int) -> jax.Array:
        """[B, T] bool: which of the call's T tokens per row are real (not padding)."""
        return jnp.arange(T)[None] < self.length[:, None]

    def snapshot_ids(self, t: jax.Array, skip: int) -> jax.Array:
        """The snapshot each of the call's tokens t [B, M] (chunk-relative, -1: none) writes
        its state after: snaps at the page it ends where it is real and ends a page, `skip`
        (an index `gdn.put(..., skip=True)` drops) elsewhere."""
        assert self.snaps is not None  # called only on views with snapshots
        pos = self.start[:, None] + t  # [B, M]
        ends = (t >= 0) & (t < self.length[:, None]) & ((pos + 1) % self.page == 0)
        page = jnp.clip(pos // self.page, 0, self.snaps.shape[1] - 1)
        return jnp.where(ends, jnp.take_along_axis(self.snaps, page, axis=1), skip)


def write(pools, k, v, view: KVView):
    """Store k, v [B, T, K, H] at positions start + t (t < length); padding goes to the null
    page. Each pool stores them in its format (kvquant.py). One token per row in a float pool
    is an in-place update slice per row on the donated pool; a prompt chunk, and a q8_0 pool
    (whose scales lie outside the token's column), is a scatter."""
    T = k.shape[1]
    page = pools[0].shape[-1]
    pos = view.positions(T)  # [B, T]
    real = view.real(T)  # [B, T]
    block = jnp.clip(pos // page, 0, view.table.shape[1] - 1)
    pages = jnp.where(real, jnp.take_along_axis(view.table, block, axis=1), NULL_PAGE)
    offsets = jnp.where(real, pos % page, 0)  # [B, T]
    return tuple(_store(pool, x, pages, offsets) for pool, x in zip(pools, (k, v), strict=True))


def _store(pool, x, pages, offsets):
    """x [B, T, K, H] into one pool at (pages, offsets) [B, T]."""
    if x.shape[1] > 1 or kvquant.quantized(pool):
        return kvquant.scatter(pool, pages, offsets, x)
    x = x.astype(pool.dtype)
    zero = jnp.zeros((), jnp.int32)
    for b in range(x.shape[0]):
        at = (pages[b, 0], zero, zero, offsets[b, 0])
        pool = lax.dynamic_update_slice(pool, x[b, 0][None, :, :, None], at)
    return pool


def at_layer(pools, layer: jax.Array):
    """Entry `layer` of stacked arrays [L, ...] (a copy)."""
    return tuple(lax.dynamic_index_in_dim(p, layer, keepdims=False) for p in pools)


def set_layer(pools, entries, layer: jax.Array):
    """Stacked arrays with entry `layer` replaced."""
    return tuple(
        lax.dynamic_update_index_in_dim(p, e.astype(p.dtype), layer, 0)
        for p, e in zip(pools, entries, strict=True)
    )


def update(q, k, v, pools, view: KVView, window: int | None = None, gate=None):
    """The chunk's k, v [B, T, K, H] written into the pools, then its queries q [B, T, K, G, H]
    attended (see `attend`), times sigmoid(gate [B, T, K, G, H]) when given -> (out
    [B, T, K, G, H] float32, or gate's dtype when gated, pools). On pools whole on one device
    (view.kernel) an attention kernel runs it where this process has one (kernels.attention_kernel):
    the CPU's writes in place and reads each row's live keys where they lie; Pallas's reads
    the pages after `write`."""
    op = kernels.attention_kernel(pools, view.kernel)
    rows = (view.table, view.start, view.length, window)
    if op is not None and op.writes:
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
        # a kernel's results vary over no manual mesh axis (a pipeline stage's shard_map)
        out, pools = varying_like(op.run(q, k, v, pools, *rows, layer=view.layer), pools[0])
    elif view.layer is not None:  # a stack's entry: taken out (a copy) and put back
        own = at_layer(pools, view.layer)
        out, own = update(q, k, v, own, view.replace(layer=None), window, gate)
        return out, set_layer(pools, own, view.layer)
    else:
        pools = write(pools, k, v, view)
        if op is not None:
            return varying_like(op.run(q, pools, *rows, gate), pools[0]), pools
        out = attend(q, k, v, pools, view, window)
    if gate is not None:
        out = out.astype(gate.dtype) * jax.nn.sigmoid(gate)
    return out, pools


def attend(q, k, v, pools, view: KVView, window: int | None = None) -> jax.Array:
    """Causal attention of a chunk's queries over its row's cached keys and its own.

    q [B, T, K, G, H] (scaled, rotated), k, v [B, T, K, H] of the chunk (already written);
    returns [B, T, K, G, H] float32. One token per row reads every key up to and including its
    own from the pages; a prompt chunk attends to itself densely (causal tiles) and to the
    positions before it through the pages.
    """
    B, T, K, G, H = q.shape
    qh = q.transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)  # [B, K, Q], query t * G + g
    q_pos = jnp.repeat(view.positions(T), G, axis=1)  # [B, Q]
    if T == 1:
        carry = _pages(qh, pools, view.table, q_pos, view.start + 1, _empty(B, K, G, H), window)
    elif T <= PAGED_CHUNK:
        n_keys = view.start + jnp.maximum(view.length, 1)
        carry = _pages(qh, pools, view.table, q_pos, n_keys, _empty(B, K, T * G, H), window, True)
    else:  # the chunk's keys and values as the pools hold them, as every later read sees them
        k, v = (kvquant.stored(x, pool) for x, pool in zip((k, v), pools, strict=True))
        carry = _chunk(qh, k, v, G, window)
        carry = _pages(qh, pools, view.table, q_pos, view.start, carry, window)
    m, l, acc = carry
    out = acc / l[..., None]  # [B, K, Q, H]
    return out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)  # [B, T, K, G, H]


def _empty(B, K, Q, H):
    """Online softmax state: running max m, sum l [B, K, Q] and output acc [B, K, Q, H]."""
    return (
        jnp.full((B, K, Q), _MASKED, jnp.float32),
        jnp.zeros((B, K, Q), jnp.float32),
        jnp.zeros((B, K, Q, H), jnp.float32),
    )


def _merge(carry, s, visible, v, always_seen: bool):
    """Fold a block of scores s [B, K, Q, S] (visible: broadcastable mask) and its values
    v [B, K, H, S] into the online softmax state. `always_seen`: every query has seen a visible
    key by now (its own, or key 0), so masked scores underflow to 0 on their own; otherwise
    a query with nothing visible yet would weigh masked keys exp(0) and needs a second mask
    (measured: that mask costs 1.5x on a prompt chunk's attention)."""
    m, l, acc = carry
    s = jnp.where(visible, s, _MASKED)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])  # [B, K, Q, S]
    if not always_seen:
        p = jnp.where(visible, p, 0.0)
    scale = jnp.exp(m - m_new)
    pv = jnp.einsum("BKQS,BKHS->BKQH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv


def _chunk(qh, k, v, G, window):
    """The chunk's own keys, causal, in query tiles that skip the keys above the diagonal."""
    B, K, Q, H = qh.shape
    T = k.shape[1]
    kt = k.transpose(0, 2, 3, 1)  # [B, K, H, T]
    vt = v.transpose(0, 2, 3, 1)
    tile = min(QUERY_TILE, T)
    parts = []
    for t0 in range(0, T, tile):
        t1 = min(T, t0 + tile)
        qt = qh[:, :, t0 * G : t1 * G]  # [B, K, (t1-t0)*G, H]
        s = jnp.einsum(
            "BKQH,BKHS->BKQS", qt, kt[..., :t1], preferred_element_type=jnp.float32
        )  # [B, K, Qt, t1]
        t_q = np.repeat(np.arange(t0, t1), G)[:, None]  # [Qt, 1] static
        t_k = np.arange(t1)[None]  # [1, t1]
        visible = t_k <= t_q
        if window:
            visible &= t_q - t_k < window
        parts.append(_merge(_empty(B, K, qt.shape[2], H), s, visible, vt[..., :t1], True))
    return tuple(jnp.concatenate(p, axis=2) for p in zip(*parts, strict=True))


def _pages(qh, pools, table, q_pos, n_keys, carry, window, causal=False):
    """Fold the keys at positions [0, n_keys[b]) of each row, read through its block table, into
    the softmax state, one page per row and loop step; `causal`: each query only up to its own
    position. (Measured on XLA CPU: gathering several pages per step, or pages smaller than
    128, is slower per key than this.)"""
    B, K, Q, H = qh.shape
    page = pools[0].shape[-1]
    first = 0
    if window:  # pages older than every live query's window are skipped
        most = jnp.max(n_keys)
        oldest = jnp.min(jnp.where(n_keys > 0, q_pos.min(-1), most))
        first = jnp.maximum(oldest - window + 1, 0) // page

    def body(j, carry):
        ids = table[:, j]  # [B], always a valid page id (the null page where unused)
        kb, vb = (_page(pool, ids, H) for pool in pools)  # [B, K, H, page]: a slice per row
        s = jnp.einsum("BKQH,BKHS->BKQS", qh, kb, preferred_element_type=jnp.float32)
        key_pos = j * page + jnp.arange(page)  # [S]
        visible = (key_pos[None] < n_keys[:, None])[:, None, None, :]  # [B, 1, 1, S]
        if causal:
            visible = visible & (key_pos <= q_pos[:, None, :, None])  # [B, 1, Q, S]
        if window:
            visible = visible & (q_pos[:, None, :, None] - key_pos < window)
        # Without a window, page 0 holds position 0, which every query sees (a decode step's
        # n_keys >= 1; a prompt chunk's carry already holds its own keys).
        return _merge(carry, s, visible, vb, always_seen=not window)

    carry = varying_like(carry, pools[0])
    return lax.fori_loop(first, -(-jnp.max(n_keys) // page), body, carry)


def _page(pool, ids, H):
    """Page ids [B] of a pool -> [B, K, H, page] in the pool's float type (q8_0: float32)."""
    pages = pool.at[ids].get(mode="promise_in_bounds")  # [B, K, rows, page]
    return kvquant.read(pages, H) if kvquant.quantized(pool) else pages


@dataclass(frozen=True)
class HiddenState:
    """Per state index, the model's final-norm hidden state [D] (float32) of the last token a
    request kept: the MTP head's input for its next row."""

    d_model: int

    AXES = ((None, None),)  # logical axes of the pool [S, D]

    def init(self, kv) -> tuple[jax.Array]:
        return (jnp.zeros((kv.n_states, self.d_model), jnp.float32),)

    def state_bytes(self) -> int:
        return 4 * self.d_model
