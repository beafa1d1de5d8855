"""Pallas kernels for the Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the decode step
and the chunkwise-parallel prompt chunk, with the semantics and shapes of `model/gdn.py`'s
`recurrent_step` and `chunked` (without `marks`), written for the GPU (Triton) lowering;
`interpret=True` runs them on the CPU (how the tests run them).

Tiling: the grid is (B, H, DV // BV); a program owns one head of one row and BV columns of its
state, S [DK, BV] float32, held in registers from the first load to the one store. Every block
is a power of two (DK, DV in {16, ..., 128}; BV = min(DV, 32) by default: B * H programs alone
would be few for a decode step, and at DK = 128 the chunk kernel's tiles spill registers
about twice as much at BV = 64); the chunk kernel recomputes its [L, L] matrices per DV tile.
The dots are 2-D, float32 in and out at Precision.HIGHEST (IEEE on Triton: its default would
be TF32); there are no gathers: the one row a loop step needs is a masked sum. The decode step
has no dot (one token: M = 1 is below Triton's minimum of 16); it multiplies and reduces. Both
write the new state to an output aliased to the input S (input_output_aliases), so a pool
updates in place.

The math, per head, with q, k L2-normed (q scaled) and g the log decay (<= 0), beta in (0, 1):
a decode step is S <- exp(g) S; delta = beta (v - k S); S <- S + k^T delta; o = q S. The chunk
kernel pads T to a multiple of L (64, or 16 / 32 for a shorter chunk; padded tokens have zero
g and beta, which change nothing) and loops (fori_loop) over the T / L sub-chunks carrying S;
inside one, with gc the cumulative log decay from the sub-chunk's start and
D_ij = exp(gc_i - gc_j) for j <= i (0 above the diagonal), the L rank-1 updates take the WY
form: A = strictly_lower((beta k) k^T * D), X = (I + A)^-1 by forward substitution (row i of
X is e_i - A_i X, L - 1 steps over an [L, L] tile), u = X (beta v), w = X (beta exp(gc) k),
v_new = u - w S, o = (exp(gc) q) S + (q k^T * D) v_new, and
S <- exp(gc_L) S + (exp(gc_L - gc) k)^T v_new. The [L, L] matrices are built per sub-chunk
(and per DV tile) inside the kernel.

What it does not do yet, and its GPU timings: benchmarks/results/pallas.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ...ops.vma import agreed

CHUNK = 64  # L for long chunks, as gdn.CHUNK
MIN_CHUNK = 16  # the smallest L: Triton's dots need every dimension >= 16
STEP_BLOCK_V = 32  # BV of the decode step
CHUNK_BLOCK_V = 32  # BV of the chunk kernel
_HI = lax.Precision.HIGHEST  # IEEE float32 dots under Triton (DEFAULT would be TF32)
_F32 = jnp.float32


def sub_chunk(T: int) -> int:
    """L, the sub-chunk length for a chunk of T tokens: a power of two in [16, 64]."""
    return max(MIN_CHUNK, min(CHUNK, 1 << (T - 1).bit_length()))


def _block_v(DV: int, block_v: int | None, default: int) -> int:
    BV = min(DV, default) if block_v is None else block_v
    if BV & (BV - 1) or DV % BV:
        raise ValueError(f"block_v {BV} must be a power of two dividing DV {DV}")
    return BV


def _check_pow2(**dims: int) -> None:
    for name, d in dims.items():
        if d < 1 or d & (d - 1):
            raise ValueError(f"{name} = {d} must be a power of two")


def _mm(a, b):  # [M, K] @ [K, N]
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32
    )


def _mm_nt(a, b):  # [M, K] @ [N, K]^T
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=_F32
    )


def _mm_tn(a, b):  # [K, M]^T @ [K, N]
    return lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=_F32
    )


# ---------------------------------------------------------------------------------------------
# the decode step


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref):
    # q_ref, k_ref [DK]; v_ref [BV]; g_ref, beta_ref [1]; s_ref [DK, BV] -> o_ref [BV], s_out_ref
    k = k_ref[...]
    S = s_ref[...] * jnp.exp(g_ref[...])[:, None]  # [DK, BV]
    kv = jnp.sum(k[:, None] * S, axis=0)  # [BV]  k S
    delta = (v_ref[...] - kv) * beta_ref[...]  # [BV]
    S = S + k[:, None] * delta[None, :]  # rank-1 update k^T delta
    o_ref[...] = jnp.sum(q_ref[...][:, None] * S, axis=0)  # [BV]  q S
    s_out_ref[...] = S


def recurrent_step(
    q, k, v, g, beta, S, *, interpret: bool = False, block_v: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """One token per row: q, k [B, H, DK], v [B, H, DV], g, beta [B, H], S [B, H, DK, DV] (all
    float32) -> o [B, H, DV], new S [B, H, DK, DV] (written over S's buffer where S is donated).
    Grid (B, H, DV // BV), BV = block_v or min(DV, 32)."""
    B, H, DK, DV = S.shape
    _check_pow2(DK=DK, DV=DV)
    BV = _block_v(DV, block_v, STEP_BLOCK_V)
    q, k, v, g, beta, S = (a.astype(_F32) for a in (q, k, v, g, beta, S))
    g, beta = g[..., None], beta[..., None]  # [B, H, 1]: a power-of-two block of one
    vec_k = pl.BlockSpec((None, None, DK), lambda b, h, j: (b, h, 0))
    vec_v = pl.BlockSpec((None, None, BV), lambda b, h, j: (b, h, j))
    one = pl.BlockSpec((None, None, 1), lambda b, h, j: (b, h, 0))
    state = pl.BlockSpec((None, None, DK, BV), lambda b, h, j: (b, h, 0, j))
    args, mat = agreed(q, k, v, g, beta, S)  # inside shard_map
    return pl.pallas_call(
        _step_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((B, H, DV), _F32, manual_axis_type=mat),
            jax.ShapeDtypeStruct((B, H, DK, DV), _F32, manual_axis_type=mat),
        ),
        grid=(B, H, DV // BV),
        in_specs=[vec_k, vec_k, vec_v, one, one, state],
        out_specs=(vec_v, state),
        input_output_aliases={5: 1},  # S -> new S, in place
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent_step",
    )(*args)


# ---------------------------------------------------------------------------------------------
# the prompt chunk


def _unit_lower_inverse(A, L: int):
    """(I + A)^-1 for strictly lower A [L, L], by forward substitution: row i of X is
    e_i - sum_{j < i} A_ij X_j (rows j < i final; A_ij = 0 for j >= i). A row is taken out of
    a tile by a masked sum, never by indexing (Triton holds tiles in registers)."""
    idx = jnp.arange(L, dtype=jnp.int32)
    rows = idx[:, None]  # [L, 1]
    eye = (rows == idx[None, :]).astype(_F32)

    def step(i, X):
        a = jnp.sum(jnp.where(rows == i, A, 0.0), axis=0)  # [L]: A_i. (by column j)
        x = (idx == i).astype(_F32) - jnp.sum(a[:, None] * X, axis=0)  # [L]: row i of X
        return jnp.where(rows == i, x[None, :], X)

    return lax.fori_loop(1, L, step, eye)


def _chunk_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, L, N):
    # q_ref, k_ref [N*L, DK]; v_ref [N*L, BV]; g_ref, beta_ref [N*L]; s_ref [DK, BV]
    # -> o_ref [N*L, BV], s_out_ref [DK, BV]
    idx = jnp.arange(L, dtype=jnp.int32)
    causal = idx[None, :] <= idx[:, None]  # [L, L] j <= i
    strict = idx[None, :] < idx[:, None]  # [L, L] j < i

    def body(n, S):  # S [DK, BV]: the state before sub-chunk n
        t = pl.ds(pl.multiple_of(n * L, L), L)
        q, k, v = q_ref[t, :], k_ref[t, :], v_ref[t, :]  # [L, DK], [L, DK], [L, BV]
        g, beta = g_ref[t], beta_ref[t]  # [L]
        gc = jnp.cumsum(g)  # [L] log decay from the sub-chunk's start
        last = jnp.sum(g)  # gc at the sub-chunk's end
        diff = gc[:, None] - gc[None, :]  # [L, L]
        # exp(gc_i - gc_j) for j <= i, 0 above (masked before exp: it would overflow there)
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
        kb = k * beta[:, None]  # [L, DK]
        A = jnp.where(strict, _mm_nt(kb, k) * decay, 0.0)  # [L, L]
        X = _unit_lower_inverse(A, L)  # [L, L]
        u = _mm(X, v * beta[:, None])  # [L, BV]
        w = _mm(X, kb * jnp.exp(gc)[:, None])  # [L, DK]
        v_new = u - _mm(w, S)  # [L, BV]
        o = _mm(q * jnp.exp(gc)[:, None], S) + _mm(_mm_nt(q, k) * decay, v_new)  # [L, BV]
        o_ref[t, :] = o
        k_tail = k * jnp.exp(last - gc)[:, None]  # [L, DK] each key's weight at the end
        return S * jnp.exp(last) + _mm_tn(k_tail, v_new)

    s_out_ref[...] = lax.fori_loop(0, N, body, s_ref[...])


def chunked(
    q, k, v, g, beta, S, *, interpret: bool = False, block_v: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """A prompt chunk: q, k [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H], S [B, H, DK, DV]
    (float32) -> o [B, T, H, DV], final S [B, H, DK, DV] (aliased to S). Grid (B, H, DV // BV),
    BV = block_v or min(DV, 32); each program runs the T / L sub-chunks in sequence."""
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    _check_pow2(DK=DK, DV=DV)
    BV = _block_v(DV, block_v, CHUNK_BLOCK_V)
    L = sub_chunk(T)
    pad = -T % L
    q, k, v, g, beta, S = (a.astype(_F32) for a in (q, k, v, g, beta, S))
    if pad:  # zero g and beta: padded tokens change nothing (and their o is cut)
        q, k, v, g, beta = (
            jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta)
        )
    TP = T + pad
    rows_k = pl.BlockSpec((None, TP, None, DK), lambda b, h, j: (b, 0, h, 0))
    rows_v = pl.BlockSpec((None, TP, None, BV), lambda b, h, j: (b, 0, h, j))
    per_token = pl.BlockSpec((None, TP, None), lambda b, h, j: (b, 0, h))
    state = pl.BlockSpec((None, None, DK, BV), lambda b, h, j: (b, h, 0, j))
    args, mat = agreed(q, k, v, g, beta, S)  # inside shard_map
    o, S = pl.pallas_call(  # the step's call over whole chunks (boilerplate)
        functools.partial(_chunk_kernel, L=L, N=TP // L),
        out_shape=(
            jax.ShapeDtypeStruct((B, TP, H, DV), _F32, manual_axis_type=mat),
            jax.ShapeDtypeStruct((B, H, DK, DV), _F32, manual_axis_type=mat),
        ),
        grid=(B, H, DV // BV),
        in_specs=[rows_k, rows_k, rows_v, per_token, per_token, state],
        out_specs=(rows_v, state),
        input_output_aliases={5: 1},  # S -> final S, in place
        compiler_params=plt.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="gdn_chunked",
    )(*args)
    return o[:, :T], S
