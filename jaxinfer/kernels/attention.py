"""Paged attention as a Pallas kernel (written for the GPU's Triton lowering; `interpret=True`
runs it anywhere, which is how the CPU tests run it).

One kernel serves a decode token, a speculative verify chunk and a prompt chunk alike: the
chunk's keys are already in the pages (kvcache.write), so every query reads its row's keys
through the block table, up to its own position (causal), only the live pages. The pools keep
the cache's layout [P, K, H, page] (positions on the fast axis), in any float dtype (float32,
float16, bfloat16: products in the wider of the query's and the pool's type, accumulated in
float32). Qwen3-Next/3.5's output gate (`out * sigmoid(gate)`) is applied on the way out.

Grid (B, K, Q / BQ): one program per row, kv head and block of BQ queries (query t * G + g:
the G query heads of a kv head share its keys, GQA), holding the online softmax state
(m, l [BQ], acc [BQ, H] float32) and looping over pages one at a time: s = q k [BQ, page],
then p v^T [BQ, H]. A block of queries reads pages up to its last query's position, and with
a sliding window from its first query's window start.

Not done: splitting a long row's pages over several programs (flash decoding), which decode
at batch 1 over long contexts would want on a GPU; TPU (Mosaic) versions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_MASKED = -1e30  # finite: a fully masked page gives exp(0) * 0, never NaN
DECODE_BLOCK = 16  # queries per program for short chunks (the dot's smallest tile)
CHUNK_BLOCK = 64  # queries per program in prompt chunks


def _kernel(start_ref, length_ref, table_ref, q_ref, k_ref, v_ref, *rest, G, window):
    """One row, kv head and query block: q_ref [BQ, H], k_ref, v_ref [P, H, page] (the kv
    head's pool), table_ref [NB], start_ref, length_ref [1]; rest = (gate_ref [BQ, H],)?
    and o_ref [BQ, H]."""
    *gate_ref, o_ref = rest
    BQ, H = q_ref.shape
    page = k_ref.shape[-1]
    start, length = start_ref[0], length_ref[0]
    first_q = pl.program_id(2) * BQ
    q_pos = start + (first_q + jnp.arange(BQ)) // G  # [BQ]
    n_keys = start + jnp.maximum(length, 1)  # a row's keys, its chunk's included
    last = jnp.minimum(start + (first_q + BQ - 1) // G + 1, n_keys)  # this block's last + 1
    end = jnp.minimum(pl.cdiv(last, page), table_ref.shape[0])
    begin = 0
    if window:
        begin = jnp.maximum(start + first_q // G - window + 1, 0) // page
    kind = jnp.promote_types(q_ref.dtype, k_ref.dtype)
    q = q_ref[...].astype(kind)  # [BQ, H]

    def body(j, carry):
        m, l, acc = carry
        ids = table_ref[j]  # the page holding positions j * page ...
        k = k_ref[ids].astype(kind)  # [H, page]
        v = v_ref[ids]  # [H, page]
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
    _, l, acc = lax.fori_loop(begin, end, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a query that saw nothing (padding): 0
    if gate_ref:
        out = out * jax.nn.sigmoid(gate_ref[0][...].astype(jnp.float32))
    o_ref[...] = out.astype(o_ref.dtype)


def paged_attention(
    q, pools, table, start, length, window=None, gate=None, *, interpret=False
) -> jax.Array:
    """Causal attention of a chunk's queries q [B, T, K, G, H] (scaled, rotated) over their
    rows' keys in the pools ([P, K, H, page] each, the chunk's own keys already written) ->
    [B, T, K, G, H] float32 (times sigmoid(gate [B, T, K, G, H]) when given). table [B, NB],
    start, length [B] int32 as in kvcache.KVView; a row with length 0 is idle (its output is
    padding)."""
    pool_k, pool_v = pools
    B, T, K, G, H = q.shape
    P, _, _, page = pool_k.shape
    Q = T * G
    BQ = DECODE_BLOCK if Q <= DECODE_BLOCK else CHUNK_BLOCK
    Qp = -(-Q // BQ) * BQ

    def heads(a):  # [B, T, K, G, H] -> [B, K, Qp, H], query t * G + g
        a = a.transpose(0, 2, 1, 3, 4).reshape(B, K, Q, H)
        return jnp.pad(a, ((0, 0), (0, 0), (0, Qp - Q), (0, 0)))

    row = pl.BlockSpec((1,), lambda b, h, i: (b,))
    block = pl.BlockSpec((None, None, BQ, H), lambda b, h, i: (b, h, i, 0))
    pool = pl.BlockSpec((P, None, H, page), lambda b, h, i: (0, h, 0, 0))
    args = [start, length, table, heads(q), pool_k, pool_v]
    specs = [row, row, pl.BlockSpec((None, table.shape[1]), lambda b, h, i: (b, 0)), block]
    specs += [pool, pool]
    if gate is not None:
        args.append(heads(gate))
        specs.append(block)
    out = pl.pallas_call(
        functools.partial(_kernel, G=G, window=window),
        grid=(B, K, Qp // BQ),
        in_specs=specs,
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((B, K, Qp, H), jnp.float32),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not Mosaic
        name="paged_attention",
    )(*args)
    return out[:, :, :Q].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)
