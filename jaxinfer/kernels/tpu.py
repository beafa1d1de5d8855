"""TPU (Mosaic) kernels: the expert block's grouped product through the grouped matmul jax
ships for TPUs (`jax.experimental.pallas.ops.tpu.megablox.gmm`), on the weights as stored
([EL, out, in]: `transpose_rhs`). `interpret=True` runs it in Pallas's TPU interpreter on any
backend (how the CPU tests check it).

gmm tiles the rows by tm (rows padded up to a multiple here; 8 sublanes at least, 128 from
128 rows) and the contraction and output by 128 lanes where they divide (else whole), and it
leaves the rows past sum(counts) unwritten: they are zeroed after. Not done: paged attention
(jax's TPU ragged paged attention wants K and V interleaved in one pool, not the cache's
[P, K, H, page] pools) and the delta rule; those take the XLA path on TPUs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm


def _lanes(n: int) -> int:
    return 128 if n % 128 == 0 else n


@functools.partial(jax.jit, static_argnames=("interpret", "out_dtype"))
def grouped_matmul(xs, w, counts, *, interpret: bool = False, out_dtype=None) -> jax.Array:
    """xs [A, D] (rows sorted by group, counts [EL] int32 per group) times w [EL, O, D] ->
    [A, O] (out_dtype, default xs's), float32 accumulation; rows past sum(counts) are 0."""
    A, D = xs.shape
    O = w.shape[1]
    tm = 128 if A >= 128 else -(-A // 8) * 8
    rows = -(-A // tm) * tm
    xs_p = jnp.pad(xs, ((0, rows - A), (0, 0)))  # [rows, D]
    y = gmm(xs_p, w, counts.astype(jnp.int32), preferred_element_type=jnp.float32,
            tiling=(tm, _lanes(D), _lanes(O)), transpose_rhs=True, interpret=interpret)  # fmt: skip
    real = jnp.arange(A) < counts.sum()  # [A]
    return jnp.where(real[:, None], y[:A], 0.0).astype(out_dtype or xs.dtype)  # [A, O]
