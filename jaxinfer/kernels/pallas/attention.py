"""Paged attention as a Pallas kernel (written for the GPU's Triton lowering; `interpret=True`
runs it anywhere, which is how the CPU tests run it).

One kernel serves a decode token, a speculative verify chunk and a prompt chunk alike: the
chunk's keys are already in the pages (kvcache.write), so every query reads its row's keys
through the block table, up to its own position (causal), only the live pages. The pools keep
the cache's layout [P, K, H, page] (positions on the fast axis), in any float dtype (float32,
float16, bfloat16: products in the wider of the query's and the pool's type, accumulated in
float32), or q8_0's [P, K, rows, page] int8 (ops/kvquant.py), each page dequantized to
float32 in the kernel after it is loaded (its scales' bytes put together with integer
arithmetic). Qwen3-Next/3.5's output gate (`out * sigmoid(gate)`) is applied on the way out.

Grid (B, K, Q / BQ, S): one program per row, kv head, block of BQ queries (query t * G + g:
the G query heads of a kv head share its keys, GQA) and split of the row's pages, holding the
online softmax state (m, l [BQ], acc [BQ, H] float32) and looping over its pages one at a
time: s = q k [BQ, page], then p v^T [BQ, H]. A block of queries reads pages up to its last
query's position, and with a sliding window from its first query's window start. Short chunks
(decode, verify) split each row's pages over S programs (flash decoding: B x K programs alone
would leave most of a GPU idle over a long context); the splits' states are merged in XLA
after the call, with the gate.

Not done: TPU (Mosaic) versions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...ops import kvquant
from ...ops.vma import agreed

_MASKED = -1e30  # finite: a fully masked page gives exp(0) * 0, never NaN
DECODE_BLOCK = 16  # queries per program for short chunks (the dot's smallest tile)
CHUNK_BLOCK = 64  # queries per program in prompt chunks
PROGRAMS = 256  # a short chunk's rows x kv heads x page splits to aim at (~2 per GPU core)


def _kernel(start_ref, length_ref, table_ref, q_ref, k_ref, v_ref, m_ref, l_ref, o_ref, *,
            G, window, per_split):  # fmt: skip
    """One row, kv head, query block and split of the pages: q_ref [BQ, H], k_ref, v_ref
    [P, rows, page] (the kv head's pool), table_ref [NB], start_ref, length_ref [1] -> the
    split's softmax state: m_ref, l_ref [BQ], o_ref [BQ, H] (unnormalized)."""
    BQ, H = q_ref.shape
    page = k_ref.shape[-1]
    start, length = start_ref[0], length_ref[0]
    first_q = pl.program_id(2) * BQ
    q_pos = start + (first_q + jnp.arange(BQ)) // G  # [BQ]
    n_keys = start + jnp.maximum(length, 1)  # a row's keys, its chunk's included
    last = jnp.minimum(start + (first_q + BQ - 1) // G + 1, n_keys)  # this block's last + 1
    end = jnp.minimum(pl.cdiv(last, page), table_ref.shape[0])
    begin: int | jax.Array = 0
    if window:
        begin = jnp.maximum(start + first_q // G - window + 1, 0) // page
    split = pl.program_id(3) * per_split  # this program's pages: [split, split + per_split)
    begin, end = jnp.maximum(begin, split), jnp.minimum(end, split + per_split)
    kind = jnp.promote_types(q_ref.dtype, _values(k_ref.dtype))
    q = q_ref[...].astype(kind)  # [BQ, H]

    def body(j, carry):
        m, l, acc = carry
        ids = table_ref[j]  # the page holding positions j * page ...
        k = _page(k_ref, ids, H).astype(kind)  # [H, page]
        v = _page(v_ref, ids, H)  # [H, page]
        s = jnp.dot(q, k, preferred_element_type=jnp.float32)  # [BQ, page]
        key = j * page + jnp.arange(page)  # [page]
        visible = (key[None, :] <= q_pos[:, None]) & (key[None, :] < n_keys)  # [BQ, page]
        if window:
            visible &= q_pos[:, None] - key[None, :] < window
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))  # [BQ]
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)  # [BQ, page]
        scale = jnp.exp(m - m_new)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [BQ, H]
        return m_new, l * scale + p.sum(-1), acc * scale[:, None] + pv

    init = (
        jnp.full((BQ,), _MASKED, jnp.float32),
        jnp.zeros((BQ,), jnp.float32),
        jnp.zeros((BQ, H), jnp.float32),
    )
    m_ref[...], l_ref[...], o_ref[...] = lax.fori_loop(begin, end, body, init)


def _values(dtype) -> jnp.dtype:
    """The type a pool's pages are read in: its own, float32 for q8_0."""
    return jnp.dtype(jnp.float32) if dtype == jnp.int8 else jnp.dtype(dtype)


def _page(ref, ids, H: int) -> jax.Array:
    """Page `ids` of a kv head's pool ref [P, rows, page] -> [H, page] in `_values`' type: a
    q8_0 page's int8 values times their blocks' float16 scales (kvquant.py's layout)."""
    if ref.dtype != jnp.int8:
        return ref[ids]
    page = ref.shape[-1]
    nb = H // kvquant.block(H)
    q = ref[ids, pl.ds(0, H), :].astype(jnp.float32).reshape(nb, H // nb, page)
    scale_bytes = ref[ids, pl.ds(H, 2 * nb), :].reshape(nb, page, 2)
    d = kvquant.halves(scale_bytes[..., 0], scale_bytes[..., 1])  # [nb, page]
    return (q * d[:, None, :]).reshape(H, page)


def splits(B: int, K: int, Q: int, NB: int) -> int:
    """Page splits per row (flash decoding): a short chunk of B rows x K kv heads alone would
    leave most of a GPU idle over a long context, so its pages are split until about
    PROGRAMS programs run; a prompt chunk has query blocks enough (1)."""
    if Q > DECODE_BLOCK:
        return 1
    return max(1, min(NB, PROGRAMS // (B * K)))


def paged_attention(
    q, pools, table, start, length, window=None, gate=None, *, interpret=False
) -> jax.Array:
    """Causal attention of a chunk's queries q [B, T, K, G, H] (scaled, rotated) over their
    rows' keys in the pools ([P, K, rows, page] each, kvcache.py; the chunk's own keys already
    written) ->
    [B, T, K, G, H] float32 (times sigmoid(gate [B, T, K, G, H]) when given). table [B, NB],
    start, length [B] int32 as in kvcache.KVView; a row with length 0 is idle (its output is
    padding). The splits' softmax states are merged here (XLA fuses it with the gate)."""
    pool_k, pool_v = pools
    B, T, K, G, H = q.shape
    P, _, _, page = pool_k.shape
    NB = table.shape[1]
    Q = T * G
    BQ = DECODE_BLOCK if Q <= DECODE_BLOCK else CHUNK_BLOCK
    Qp = -(-Q // BQ) * BQ
    S = splits(B, K, Q, NB)
    qh = q.transpose(0, 2, 1, 3, 4).reshape(B, K, Q, H)  # query t * G + g
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, Qp - Q), (0, 0)))  # [B, K, Qp, H]

    row = pl.BlockSpec((1,), lambda b, h, i, s: (b,))
    k_spec, v_spec = (
        pl.BlockSpec((P, None, p.shape[2], page), lambda b, h, i, s: (0, h, 0, 0)) for p in pools
    )
    state = pl.BlockSpec((None, None, None, BQ), lambda b, h, i, s: (s, b, h, i))
    args, mat = agreed(start, length, table, qh, pool_k, pool_v)  # inside shard_map
    m, l, acc = pl.pallas_call(
        functools.partial(_kernel, G=G, window=window, per_split=-(-NB // S)),
        grid=(B, K, Qp // BQ, S),
        in_specs=[
            row,
            row,
            pl.BlockSpec((None, NB), lambda b, h, i, s: (b, 0)),
            pl.BlockSpec((None, None, BQ, H), lambda b, h, i, s: (b, h, i, 0)),
            k_spec,
            v_spec,
        ],
        out_specs=[
            state,
            state,
            pl.BlockSpec((None, None, None, BQ, H), lambda b, h, i, s: (s, b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, B, K, Qp), jnp.float32, manual_axis_type=mat),
            jax.ShapeDtypeStruct((S, B, K, Qp), jnp.float32, manual_axis_type=mat),
            jax.ShapeDtypeStruct((S, B, K, Qp, H), jnp.float32, manual_axis_type=mat),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic
        name="paged_attention",
    )(*args)
    weight = jnp.exp(m - m.max(0))  # [S, B, K, Qp]: each split's share
    l = (weight * l).sum(0)  # [B, K, Qp]
    out = (weight[..., None] * acc).sum(0) / jnp.where(l > 0, l, 1.0)[..., None]  # nothing: 0
    out = out[:, :, :Q].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
    return out
