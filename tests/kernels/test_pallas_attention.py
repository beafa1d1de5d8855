"""The Pallas paged attention kernel (kernels/pallas/attention.py) against a float64 NumPy attention
over each row's keys read back from the pages, beside the plain-XLA path (kvcache.attend) on
the same pools: page sizes, ragged rows (decode, verify and prompt chunks, idle rows), GQA
ratios, a sliding window, the output gate, float32 / float16 / bfloat16 pools, and the null
page full of garbage. Interpreted on CPU; compiled where the backend is a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.kernels.pallas.attention import paged_attention
from jaxinfer.model import kvcache

INTERPRET = jax.default_backend() == "cpu"
# float32 products in a different order than NumPy's float64: measured max |err| 2-5e-7 on
# outputs of size ~1 (the XLA path's is the same); half-precision pools and probabilities
# (p is cast to the pool's type before p v, as in the XLA path) are held to the XLA path's own
# measured error against float64, times two, plus float32's.
F32_ATOL = 1e-5


def reference(q, pools, table, start, length, window=None, gate=None):
    """float64 attention of q [B, T, K, G, H] over each row's positions [0, start + t] read
    from the pages (positions of padding tokens too, as the kernel computes them)."""
    pool_k, pool_v = (np.asarray(p.astype(jnp.float32), np.float64) for p in pools)
    B, T, K, G, H = q.shape
    page = pool_k.shape[-1]
    out = np.zeros((B, T, K, G, H))
    q = np.asarray(q.astype(jnp.float32), np.float64)
    for b in range(B):
        for t in range(T):
            pos = int(start[b]) + t
            if t >= max(int(length[b]), 1):
                continue  # padding: compared nowhere
            keys = np.arange(pos + 1)
            if window:
                keys = keys[pos - keys < window]
            pages = np.asarray(table[b])[keys // page]
            k = pool_k[pages, :, :, keys % page]  # [S, K, H]
            v = pool_v[pages, :, :, keys % page]
            s = np.einsum("KGH,SKH->KGS", q[b, t], k)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, t] = np.einsum("KGS,SKH->KGH", p / p.sum(-1, keepdims=True), v)
    if gate is not None:
        out = out / (1 + np.exp(-np.asarray(gate, np.float64)))
    return out


def case(rng, *, B, T, K, G, H, page, starts, lengths, dtype=jnp.float32, q_dtype=jnp.float32):
    """Random pools of `dtype` (the null page full of large finite garbage), each row's pages
    scattered over the pool (unused table entries: the null page), the chunk's k, v written
    with kvcache.write -> (q, k, v, pools, view)."""
    width = -(-max(s + T for s in starts) // page) + 1
    n_pages = B * width + 3
    shape = (n_pages, K, H, page)
    pool_k = rng.standard_normal(shape).astype(np.float32)
    pool_v = rng.standard_normal(shape).astype(np.float32)
    pool_k[0], pool_v[0] = 1e4, -1e4  # null page: must never be read unmasked
    ids = rng.permutation(np.arange(1, n_pages))[: B * width].reshape(B, width)
    table = np.zeros((B, width), np.int32)
    for b in range(B):
        used = -(-(starts[b] + max(lengths[b], 1)) // page)
        table[b, :used] = ids[b, :used]
    view = kvcache.KVView(
        table=jnp.asarray(table),
        start=jnp.asarray(starts, jnp.int32),
        length=jnp.asarray(lengths, jnp.int32),
        state_index=None,
    )
    q = jnp.asarray(rng.standard_normal((B, T, K, G, H)) / np.sqrt(H), q_dtype)
    k = jnp.asarray(rng.standard_normal((B, T, K, H)), q_dtype)
    v = jnp.asarray(rng.standard_normal((B, T, K, H)), q_dtype)
    pools = kvcache.write((jnp.asarray(pool_k, dtype), jnp.asarray(pool_v, dtype)), k, v, view)
    return q, k, v, pools, view


def worst(a, b, lengths) -> float:
    """The largest |a - b| over the outputs of real tokens (t < length)."""
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return max(np.abs(a[r, :n] - b[r, :n]).max() for r, n in enumerate(lengths) if n > 0)


def check(rng, window=None, gated=False, atol=F32_ATOL, **shape):
    q, k, v, pools, view = case(rng, **shape)
    gate = jnp.asarray(rng.standard_normal(q.shape), q.dtype) if gated else None
    args = (view.table, view.start, view.length, window)
    got = paged_attention(q, pools, *args, gate, interpret=INTERPRET)
    want = reference(q, pools, *args, None if gate is None else gate.astype(jnp.float32))
    xla, _ = kvcache.update(q, k, v, pools, view, window, gate)  # the plain-XLA path
    xla_err, err = (worst(out, want, shape["lengths"]) for out in (xla, got))
    assert np.isfinite(np.asarray(got)).all()  # padding and idle rows included
    assert err <= max(atol, 2 * xla_err), (err, xla_err)
    return err, xla_err


DEFAULT = ((16, 1), (32, 4), (128, 8))  # each page size and GQA ratio once; the rest slow


@pytest.mark.parametrize(
    ("page", "G"),
    [(p, g) if (p, g) in DEFAULT else pytest.param(p, g, marks=pytest.mark.slow)
     for p in (16, 32, 128) for g in (1, 4, 8)],
)  # fmt: skip
def test_decode_rows_of_ragged_lengths(page, G):
    """One token per row at ragged positions: a first token, a page's last and first
    position, a long row, an idle row (length 0)."""
    starts = [0, page - 1, page, 3 * page + 5, 7]
    check(np.random.default_rng(page + G), B=5, T=1, K=2, G=G, H=64, page=page,
          starts=starts, lengths=[1, 1, 1, 1, 0])  # fmt: skip


def test_long_rows_split_their_pages_over_programs():
    """Decode over long rows: each row's pages split over several programs (here 65 table
    entries in 42 splits of 2 pages; most splits past the short rows' ends), merged after."""
    check(np.random.default_rng(11), B=3, T=1, K=2, G=4, H=32, page=16,
          starts=[994, 3, 517], lengths=[1, 1, 1])  # fmt: skip


@pytest.mark.parametrize("T", [4, 16, 100])
def test_chunks_read_their_own_keys_through_the_pages(T):
    """Verify chunks (T <= 16) and prompt chunks (several query blocks) at ragged starts,
    with ragged real lengths (padding tokens after them) and an idle row."""
    starts = [0, 37, 64]
    lengths = [T, T - 1, 0] if T > 1 else [1, 1, 0]
    check(np.random.default_rng(T), B=3, T=T, K=2, G=4, H=32, page=16,
          starts=starts, lengths=lengths)  # fmt: skip


@pytest.mark.slow
def test_a_sliding_window_skips_old_keys():
    check(np.random.default_rng(5), window=24, B=3, T=40, K=1, G=2, H=32, page=16,
          starts=[0, 50, 3], lengths=[40, 33, 1])  # fmt: skip
    check(np.random.default_rng(6), window=24, B=2, T=1, K=2, G=2, H=32, page=16,
          starts=[70, 5], lengths=[1, 1])  # fmt: skip


def test_the_output_gate_of_qwen3_next_is_applied_on_the_way_out():
    """Qwen3-Next/3.5's gated attention: out * sigmoid(gate), head_dim 256, 8 query heads per
    kv head."""
    check(np.random.default_rng(7), gated=True, B=2, T=5, K=2, G=8, H=256, page=16,
          starts=[3, 30], lengths=[5, 2])  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
def test_half_precision_pools(dtype, q_dtype):
    """Pools of 16-bit floats, queries in float32 or bfloat16 (a bf16 model): within twice the
    XLA path's own error against float64 on the same pools."""
    eps = float(np.finfo(ml_dtypes.bfloat16 if "bfloat16" in (dtype, q_dtype) else dtype).eps)
    err, xla_err = check(np.random.default_rng(8), atol=4 * eps, dtype=jnp.dtype(dtype),
                         q_dtype=jnp.dtype(q_dtype), B=3, T=20, K=2, G=4, H=64, page=16,
                         starts=[0, 21, 40], lengths=[20, 20, 1])  # fmt: skip
    assert err <= 8 * eps, (err, eps)
