"""The KV pools' element formats: a float dtype, or q8_0 (llama.cpp's -ctk / -ctv q8_0).

q8_0 is llama.cpp's Q8_0 along the head dimension: blocks of `block(H)` = min(32, H) values,
per block a float16 scale d = amax / 127 (computed in float32) and int8 q = round(x * (1 / d))
(rounded half away from zero, as quantize_row_q8_0_ref's roundf; d = 0 gives q = 0); a value
reads back as q * d. A q8_0 pool is one int8 array per side, [P, K, H + 2 nb, page] (nb = H /
block), so that everything that handles pools (shardings by logical axes, depth-stacked pools,
donation, page copies) handles it unchanged: rows [0, H) hold the int8 values, and rows H + 2b
and H + 2b + 1 together hold block b's `page` float16 scales as raw bytes, position s's at
bytes 2s, 2s + 1 of that two-row region (little-endian). The CPU kernel (kernels/cpu/src/
attend.cc) reads a block's 16 positions' scales there as contiguous halves.

A pool's format is told by its array's dtype: int8 is q8_0, any other its float type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import JaxinferError

Q8_0 = "q8_0"
BLOCK = 32  # values per scale (llama.cpp's QK8_0)

PoolDtype = np.dtype | str  # a float dtype, or Q8_0


def pool_dtype(name) -> PoolDtype:
    """A KV dtype name or dtype (EngineOptions.kv_dtypes()) as a pool format: Q8_0 or a dtype."""
    return Q8_0 if name == Q8_0 else jnp.dtype(name)


def block(H: int) -> int:
    """Head dims per q8_0 scale."""
    return min(BLOCK, H)


def check(H: int, dtype: PoolDtype) -> None:
    """A one-line error when q8_0 cannot hold heads of H values."""
    if dtype == Q8_0 and H % block(H):
        raise JaxinferError(
            f"a q8_0 KV cache needs head_dim a multiple of {BLOCK} (this model's is {H}); "
            "use kv_cache_dtype float16"
        )


def rows(H: int, dtype: PoolDtype) -> int:
    """A pool's rows per (page, kv head): H values, and for q8_0 two rows of scales a block."""
    return H + 2 * (H // block(H)) if dtype == Q8_0 else H


def head_dim(pool: jax.Array) -> int:
    """The head dim H of a pool [..., rows, page] (inverse of `rows`: below 32, q8_0 adds 2
    rows; from 32 on, H / 16)."""
    R = pool.shape[-2]
    if not quantized(pool):
        return R
    return R - 2 if R < BLOCK + 2 else R * 16 // 17


def array_dtype(dtype: PoolDtype) -> np.dtype:
    """The dtype of a pool array of this format."""
    return np.dtype(np.int8) if dtype == Q8_0 else np.dtype(dtype)


def page_bytes(K: int, H: int, page: int, dtype: PoolDtype) -> int:
    """Bytes of one page of one side (K or V) of a layer."""
    return K * rows(H, dtype) * page * array_dtype(dtype).itemsize


def quantized(pool: jax.Array) -> bool:
    """Whether a pool array holds q8_0."""
    return pool.dtype == jnp.int8


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (q [..., H] int8, d [..., nb] float16), llama.cpp's quantize_row_q8_0_ref
    per block of `block(H)` values."""
    H = x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], H // block(H), block(H))  # [..., nb, b]
    d = jnp.abs(xb).max(-1) / 127.0  # [..., nb]
    inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
    y = xb * inv[..., None]
    r = jnp.round(y)  # to nearest even; roundf rounds halves away from zero
    tie = jnp.abs(y - jnp.trunc(y)) == 0.5
    r = jnp.where(tie, jnp.trunc(y) + jnp.sign(y), r)
    return r.astype(jnp.int8).reshape(x.shape), d.astype(jnp.float16)


def dequantize(q: jax.Array, d: jax.Array) -> jax.Array:
    """q [..., H] int8 and d [..., nb] -> [..., H] float32 (q * d)."""
    H, nb = q.shape[-1], d.shape[-1]
    qb = q.astype(jnp.float32).reshape(*q.shape[:-1], nb, H // nb)
    return (qb * d.astype(jnp.float32)[..., None]).reshape(q.shape)


def stored(x: jax.Array, pool: jax.Array) -> jax.Array:
    """What a pool of this array's format holds for x [..., H]: x rounded to its float type, or
    quantized and read back (float32)."""
    if quantized(pool):
        return dequantize(*quantize(x))
    return x.astype(pool.dtype)


def read(page: jax.Array, H: int) -> jax.Array:
    """A q8_0 page (or pages) [..., rows, S] int8 -> its values [..., H, S] float32."""
    S = page.shape[-1]
    nb = H // block(H)
    scale_bytes = page[..., H:, :].reshape(*page.shape[:-2], nb, S, 2)
    d = lax.bitcast_convert_type(scale_bytes, jnp.float16).astype(jnp.float32)  # [..., nb, S]
    q = page[..., :H, :].astype(jnp.float32).reshape(*page.shape[:-2], nb, H // nb, S)
    return (q * d[..., None, :]).reshape(*page.shape[:-2], H, S)


def halves(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """float16 values from their bytes (int8 arrays, little-endian: lo the low byte) as float32,
    with integer arithmetic only (for kernels whose lowering has no narrowing bitcast)."""
    bits = (lo.astype(jnp.int32) & 255) | ((hi.astype(jnp.int32) & 255) << 8)
    sign = (bits >> 15) << 31
    e, m = (bits >> 10) & 31, bits & 1023
    normal = lax.bitcast_convert_type(sign | ((e + 112) << 23) | (m << 13), jnp.float32)
    tiny = m.astype(jnp.float32) * np.float32(2.0**-24) * jnp.where(sign != 0, -1.0, 1.0)
    wide = lax.bitcast_convert_type(sign | 0x7F800000 | (m << 13), jnp.float32)  # inf, nan
    return jnp.where(e == 0, tiny, jnp.where(e == 31, wide, normal))


def scatter(pool: jax.Array, pages: jax.Array, offsets: jax.Array, x: jax.Array) -> jax.Array:
    """x [B, T, K, H] stored at (pages, offsets) [B, T] of a pool [P, K, rows, S]: rounded to a
    float pool's type, or quantized into a q8_0 pool (values in the token's column, scales at
    their bytes of each block's two scale rows)."""
    if not quantized(pool):
        # Advanced indices on axes 0 and 3 put their [B, T] dims first: updates [B, T, K, H].
        return pool.at[pages, :, :, offsets].set(x.astype(pool.dtype), mode="promise_in_bounds")
    H, S = x.shape[-1], pool.shape[-1]
    q, d = quantize(x)  # [B, T, K, H], [B, T, K, nb]
    pool = pool.at[pages, :, :H, offsets].set(q, mode="promise_in_bounds")
    nb = d.shape[-1]
    scale_bytes = lax.bitcast_convert_type(d, jnp.int8)  # [B, T, K, nb, 2]
    at = 2 * offsets  # [B, T]: the scale's first byte in its block's 2 S-byte region
    row = H + 2 * jnp.arange(nb) + (at // S)[..., None]  # [B, T, nb]
    col = (at % S)[..., None] + jnp.arange(2)  # [B, T, 2]
    # Advanced indices on axes 0, 2, 3 (split by axis 1) go first: updates [B, T, nb, 2, K].
    idx = (pages[..., None, None], slice(None), row[..., None], col[..., None, :])
    return pool.at[idx].set(scale_bytes.transpose(0, 1, 3, 4, 2), mode="promise_in_bounds")
