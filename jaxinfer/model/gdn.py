"""Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention): the causal conv, the delta rule and
the per-request state they carry between calls.

Each linear layer keeps, per state index, the last K - 1 inputs of its causal conv (for the q,
k and v channels) and the recurrent state S [HV, DK, DV], all float32 whatever the compute
dtype. A row of a prompt chunk reaches its state through `KVView.state_index` (index 0 is
the null state that padding rows write); a row whose call starts at position 0 begins from
zeros, so a reused index never leaks the previous request's state. A decode call takes its
rows' states out of the pools once, carries them through its steps and puts them back at the
end (read and written in the loop, the pools would be copied every step). Padding tokens leave the
state untouched: their beta and decay are 0 (S = S * exp(0) + k (x) 0) and the conv state
is cut at the last real input.

The delta rule per value head, with q, k L2-normed and q scaled by DK^-1/2:
    S_t = exp(g_t) S_{t-1} + k_t (x) beta_t (v_t - exp(g_t) S_{t-1}^T k_t),  o_t = S_t^T q_t
Decode runs it token by token; a prompt chunk uses the chunkwise-parallel (WY) form over
sub-chunks of CHUNK tokens, each with the state of the one before. Dimension letters: B rows,
T tokens, S state indices, C conv channels, W = K - 1 conv inputs kept, HV/HK value/key heads,
DK/DV their widths, L sub-chunk length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from .kvcache import at_layer, set_layer

CHUNK = 64  # tokens per sub-chunk of the parallel form (as the reference kernels use)
_EXACT = lax.Precision.HIGHEST  # accelerators would round f32 matmuls of the state otherwise
_L2_EPS = 1e-6


@dataclass(frozen=True)
class RecurrentState:
    """The cache of one linear layer: conv inputs per channel group (q, k, v) and the delta-rule
    state, per state index, in float32."""

    conv_channels: tuple[int, int, int]  # C of q, k, v (HK*DK, HK*DK, HV*DV)
    kernel: int  # conv taps K
    heads: int  # HV
    k_dim: int  # DK
    v_dim: int  # DV

    # logical axes of (conv q, conv k, conv v, state)
    AXES = (
        (None, None, "linear_k"),
        (None, None, "linear_k"),
        (None, None, "linear_v"),
        (None, "linear_v", None, None),
    )

    def shapes(self, slots: int) -> tuple[tuple[int, ...], ...]:
        W = self.kernel - 1
        convs = tuple((slots, W, c) for c in self.conv_channels)
        return (*convs, (slots, self.heads, self.k_dim, self.v_dim))

    def init(self, kv) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(s, jnp.float32) for s in self.shapes(kv.n_states))

    def state_bytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.shapes(1))


def take(pools, state_index: jax.Array, axis: int = 0, layer: jax.Array | None = None):
    """Each row's state [B, ...] at its state index (indices on `axis` of the pools; with `layer`,
    of entry `layer` of stacked pools [L, ...])."""
    index = (() if layer is None else (layer,)) + (slice(None),) * axis + (state_index,)
    return tuple(p.at[index].get(mode="promise_in_bounds") for p in pools)


def put(pools, states, state_index: jax.Array, axis: int = 0, skip: bool = False, layer=None):
    """Store each row's state at its index (padding rows all write the null state).
    `state_index` may have more dims ([B, M] with states [B, M, ...]); with `skip`,
    out-of-range indices (a snapshot not wanted, `skipped`) write nothing. `layer` as in `take`."""
    mode = "drop" if skip else "promise_in_bounds"

    def one(pool, state):
        index = (() if layer is None else (layer,)) + (slice(None),) * axis + (state_index,)
        return pool.at[index].set(state.astype(pool.dtype), mode=mode)

    return tuple(one(p, s) for p, s in zip(pools, states, strict=True))


def skipped(pools, axis: int = 0, layer: jax.Array | None = None) -> int:
    """The state index that `put(..., skip=True)` drops: one past the pools' last state."""
    return pools[0].shape[axis + (layer is not None)]


def read(pools, state_index: jax.Array | None, fresh: jax.Array, pick: jax.Array | None = None,
         layer: jax.Array | None = None):  # fmt: skip
    """A call's states [B, ...]: from the rows' state indices (or the prefix snapshots a chunk
    starts from), zeros where a row starts a request; or, with no indices (a decode loop, which took
    them out once), the rows' states themselves; or, keeping every token's state
    ([B, N, ...], speculative decoding), the one at `pick` [B]. With `layer`, the pools are
    stacks [L, ...] of depth-shared layers' caches, read at that layer."""
    if state_index is None:
        pools = pools if layer is None else at_layer(pools, layer)
        return pools if pick is None else tuple(select(p, pick) for p in pools)
    keep = ~fresh
    return tuple(
        jnp.where(keep.reshape(-1, *([1] * (s.ndim - 1))), s, 0.0)
        for s in take(pools, state_index, layer=layer)
    )


def sub_chunk(T: int) -> int:
    """L, the sub-chunk length `chunked` uses for a chunk of T tokens (a power of two)."""
    return min(CHUNK, 1 << (T - 1).bit_length())


def boundaries(start: jax.Array, T: int, page: int) -> jax.Array:
    """The chunk's tokens that end a page: [B, M] chunk-relative indices t (the state after
    token t is the state at a page boundary, start + t + 1 = 0 mod page), -1 where none. Laid
    out as `chunked` computes them: M = N * P, P = max(1, L // page) candidates per sub-chunk
    of L tokens (entry n * P + p lies in sub-chunk n). Entries may lie past the real tokens;
    callers mask them by length."""
    L = sub_chunk(T)
    N, P = -(-T // L), max(1, L // page)
    n = jnp.arange(N, dtype=jnp.int32)[None, :, None]  # [1, N, 1]
    first = (-start[:, None, None] - n * L - 1) % page  # [B, N, 1] first one in sub-chunk n
    local = first + page * jnp.arange(P, dtype=jnp.int32)[None, None]  # [B, N, P]
    t = jnp.where(local < L, n * L + local, -1)
    return t.reshape(start.shape[0], N * P)


def write(pools, states, state_index: jax.Array | None, keep_at: jax.Array | None = None,
          layer: jax.Array | None = None):  # fmt: skip
    """The cache after a call: the pools with each row's new state at its index; or, with no
    indices, the new states themselves; or, keeping every token's state, the call's T states
    [B, T, ...] stored at kept indices keep_at .. keep_at + T - 1. With `layer`, into entry
    `layer` of stacked pools."""
    if state_index is not None:
        return put(pools, states, state_index, layer=layer)
    if keep_at is not None:
        own = pools if layer is None else at_layer(pools, layer)
        states = tuple(
            lax.dynamic_update_slice_in_dim(p, s.astype(p.dtype), keep_at, axis=1)
            for p, s in zip(own, states, strict=True)
        )
    return states if layer is None else set_layer(pools, states, layer)


def select(kept, index: jax.Array, axis: int = 0):
    """kept [B, N, ...] (rows on `axis`) -> [B, ...]: each row's entry at index [B] (a
    speculative step's accepted state: rollback by selection, nothing copied or run again)."""
    index = index.reshape(*([1] * axis), -1, 1, *([1] * (kept.ndim - axis - 2)))
    return jnp.squeeze(jnp.take_along_axis(kept, index, axis=axis + 1), axis + 1)


def causal_conv(x, w, state, length, every: bool = False, marks=None):
    """Depthwise causal conv then SiLU. x [B, T, C] (padding zeroed), w [C, K], state [B, W, C]
    the inputs before x -> y [B, T, C] in x's dtype, new state [B, W, C] float32: the last W
    real inputs (length [B] real tokens of x); with `every`, the state after each token
    [B, T, W, C]. With `marks` [B, M] (token indices, -1: none), also the states after those
    tokens [B, M, W, C]."""
    T = x.shape[1]
    K = w.shape[1]
    full = jnp.concatenate([state, x.astype(jnp.float32)], axis=1)  # [B, W + T, C]
    w32 = w.astype(jnp.float32)
    y = sum(full[:, j : j + T] * w32[:, j] for j in range(K))  # [B, T, C]
    if every:
        new_state = jnp.stack([full[:, t + 1 : t + K] for t in range(T)], axis=1)
    elif T == 1:  # a decode step: shifted by one where the row is live
        new_state = jnp.where((length > 0)[:, None, None], full[:, 1:], full[:, :-1])
    else:
        pick = length[:, None] + jnp.arange(K - 1)[None]  # [B, W]: positions length .. +W-1
        new_state = jnp.take_along_axis(full, pick[..., None], axis=1)
    y = jax.nn.silu(y).astype(x.dtype)
    if marks is None:
        return y, new_state
    B, M = marks.shape
    at = (jnp.maximum(marks, 0) + 1)[..., None] + jnp.arange(K - 1)[None, None]  # [B, M, W]
    kept = jnp.take_along_axis(full, at.reshape(B, M * (K - 1))[..., None], axis=1)
    return y, new_state, kept.reshape(B, M, K - 1, -1)


def l2norm(x):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


def recurrent_step(q, k, v, g, beta, S):
    """One token per row: q, k [B, H, DK], v [B, H, DV], g, beta [B, H], S [B, H, DK, DV] (all
    float32) -> o [B, H, DV], S."""
    S = S * jnp.exp(g)[..., None, None]
    kv = jnp.einsum("BHKV,BHK->BHV", S, k, precision=_EXACT)
    delta = (v - kv) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("BHKV,BHK->BHV", S, q, precision=_EXACT), S


def recurrent(q, k, v, g, beta, S):
    """Token by token, keeping each token's state: q, k [B, T, H, DK], v [B, T, H, DV], g, beta
    [B, T, H], S [B, H, DK, DV] (float32) -> o [B, T, H, DV], states [B, T, H, DK, DV]."""

    def body(S, xs):
        q_t, k_t, v_t, g_t, beta_t = xs  # one token's (named: mypy rejects *xs before S)
        o, S = recurrent_step(q_t, k_t, v_t, g_t, beta_t, S)
        return S, (o, S)

    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))  # [T, B, ...]
    _, (o, states) = lax.scan(body, S, xs)
    return jnp.swapaxes(o, 0, 1), jnp.swapaxes(states, 0, 1)


def unit_lower_inverse(lower):
    """(I + lower)^-1 for strictly lower triangular lower [..., L, L], L a power of two, by
    doubling blocks: inv [[A, 0], [C, B]] = [[A', 0], [-B' C A', B']]. Only matmuls, so it
    runs the same everywhere (XLA CPU's triangular solve waits on the thread pool that a
    pipeline's collectives hold, and deadlocks there)."""
    L = lower.shape[-1]
    lead = lower.shape[:-2]
    inv = jnp.ones((*lead, L, 1, 1), lower.dtype)  # diagonal blocks of size b, here b = 1
    b = 1
    while b < L:
        n = L // (2 * b)
        blocks = lower.reshape(*lead, n, 2 * b, n, 2 * b)
        # the lower-left quarter of each 2b diagonal block: [..., n, b, b]
        c = jnp.diagonal(blocks, axis1=-4, axis2=-2)  # [..., 2b, 2b, n]
        c = jnp.moveaxis(c, -1, -3)[..., b:, :b]
        pairs = inv.reshape(*lead, n, 2, b, b)
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -jnp.einsum(
            "...ij,...jk,...kl->...il", second, c, first, precision=_EXACT
        )  # [..., n, b, b]
        zero = jnp.zeros_like(corner)
        top = jnp.concatenate([first, zero], axis=-1)
        bottom = jnp.concatenate([corner, second], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)  # [..., n, 2b, 2b]
        b *= 2
    return inv.reshape(*lead, L, L)


def chunked(q, k, v, g, beta, S, marks=None):
    """A prompt chunk: q, k [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H], S [B, H, DK, DV]
    (float32) -> o [B, T, H, DV], final S. Sub-chunks of L tokens run in sequence; inside one,
    the WY form turns its L rank-1 updates into one triangular inverse and matmuls. With
    `marks` [B, N * P] (`boundaries`: P token indices per sub-chunk, -1: none), also the
    states after those tokens [B, N * P, H, DK, DV], taken inside their sub-chunk:
    S_i = exp(gc_i) S_0 + sum_{j <= i} exp(gc_i - gc_j) k_j (x) v_new_j."""
    B, T, H, DK = k.shape
    L = sub_chunk(T)
    pad = -T % L
    if pad:  # zero beta and decay: padded tokens change nothing
        q, k, v, g, beta = (
            jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta)
        )
    N = (T + pad) // L

    def split(a):  # [B, N*L, H, ...] -> [N, B, H, L, ...]
        a = a.reshape(B, N, L, H, *a.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    q, k, v, g, beta = (split(a) for a in (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)  # [N, B, H, L] log decay from the sub-chunk's start
    i, j = jnp.arange(L)[:, None], jnp.arange(L)[None]
    # exp(gc_i - gc_j) for j <= i, 0 above the diagonal (masked before exp: it would overflow)
    decay = jnp.exp(jnp.where(j <= i, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    kb = k * beta[..., None]
    lower = jnp.einsum("NBHiK,NBHjK->NBHij", kb, k, precision=_EXACT) * decay
    lower = jnp.where(j < i, lower, 0.0)
    # (I + lower)^-1 applied to beta v and to beta k exp(gc): the WY representation
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(gc)[..., None]], axis=-1)
    solved = jnp.einsum("NBHij,NBHjX->NBHiX", unit_lower_inverse(lower), rhs, precision=_EXACT)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]  # [N, B, H, L, DV|DK]
    qk = jnp.einsum("NBHiK,NBHjK->NBHij", q, k, precision=_EXACT) * decay  # j <= i kept
    q_decayed = q * jnp.exp(gc)[..., None]
    last = gc[..., -1:]  # [N, B, H, 1]
    k_tail = k * jnp.exp(last - gc)[..., None]  # what each key weighs at the sub-chunk's end

    if marks is None:
        local = jnp.zeros((N, B, 0), jnp.int32)
    else:  # [N, B, P] each mark's index inside its sub-chunk
        local = jnp.moveaxis(marks.reshape(B, N, -1), 1, 0) % L

    def body(S, xs):
        u, w, qk, qd, kt, last, kk, gc, local = xs
        v_new = u - jnp.einsum("BHLK,BHKV->BHLV", w, S, precision=_EXACT)
        o = jnp.einsum("BHLK,BHKV->BHLV", qd, S, precision=_EXACT)
        o = o + jnp.einsum("BHij,BHjV->BHiV", qk, v_new, precision=_EXACT)
        g_at = jnp.take_along_axis(gc, local[:, None], axis=-1)  # [B, H, P]
        upto = jnp.arange(L)[None, None] <= local[:, None, :, None]  # [B, 1, P, L]
        weight = jnp.exp(jnp.where(upto, g_at[..., None] - gc[:, :, None], -jnp.inf))
        at_marks = S[:, :, None] * jnp.exp(g_at)[..., None, None] + jnp.einsum(
            "BHPL,BHLK,BHLV->BHPKV", weight, kk, v_new, precision=_EXACT
        )  # [B, H, P, DK, DV]
        S = S * jnp.exp(last)[..., None] + jnp.einsum(
            "BHLK,BHLV->BHKV", kt, v_new, precision=_EXACT
        )
        return S, (o, at_marks)

    xs = (u, w, qk, q_decayed, k_tail, last, k, gc, local)
    S, (o, at_marks) = lax.scan(body, S, xs)  # o [N, B, H, L, DV], at_marks [N, B, H, P, ...]
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, L, DV]
    o = jnp.swapaxes(o, 2, 3).reshape(B, N * L, H, -1)[:, :T]
    if marks is None:
        return o, S
    at_marks = jnp.moveaxis(jnp.moveaxis(at_marks, 0, 1), 3, 2)  # [B, N, P, H, DK, DV]
    return o, S, at_marks.reshape(B, marks.shape[1], *at_marks.shape[3:])
