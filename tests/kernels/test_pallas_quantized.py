"""The Pallas quantized matmul (kernels/pallas/quantized.py) against a float64 NumPy product of
gguf-py's dequantized weights: every served format, decode (M = 1), ragged M, O and I that are not
multiples of the tiles, and 8-bit activations against llama.cpp's activation quantization
written in NumPy. On CPU the kernel runs in Pallas's interpreter; on a GPU compiled through
Triton (tests/conftest.py sets JAX_PLATFORMS=cpu unless it is set: JAX_PLATFORMS=cuda)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.kernels import q8_reference, random_quantized

from jaxinfer.kernels.pallas.quantized import FORMATS_SERVED, quantized_matmul, serves
from jaxinfer.ops import quant

INTERPRET = jax.default_backend() == "cpu"
BLOCK_FORMATS = tuple(f for f in FORMATS_SERVED if f in quant.INT8_ACTIVATIONS)


def random_weight(fmt: str, rows: int, cols: int, rng) -> tuple[quant.QArray, np.ndarray]:
    """(w, float64 reference [rows, cols]): support.reference.random_quantized's parts (GGUF
    blocks split as the loader splits them, dequantized by gguf-py) as a QArray."""
    parts, ref = random_quantized(fmt, rows, cols, rng)
    return quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, cols), ref


def check(y, want, x, ref):
    """y within float32 accumulation noise of the float64 product `want`: 1e-5 of the sum of
    |terms| per output. A float32 sum of n products errs by at most about n u sum|terms| (u =
    2^-24; 3e-5 at I = 512) and typically sqrt(n) u (1.4e-6); measured in the interpreter: at
    most 2.5e-7 (float activations) and 3.1e-7 (8-bit) over every format and shape here."""
    bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(ref).T) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - want)
    assert np.all(err <= bound), f"max error / bound {np.max(err / bound):.3g}"


# (O, I, row counts): O = 200 and I off the tiles (padded: I = 288 and 100 to a multiple of
# 64; K-quants' I is always a multiple of their 256), decode and ragged M; then whole tiles
RAGGED = (200, {1: 100, 32: 288, 256: 512}, (1, 7, 33))
TILES = (128, {1: 256, 32: 512, 256: 512}, (16, 64))


# whole tiles (more rows) in the slow tier: the ragged shapes cover every path by default
@pytest.mark.parametrize(
    "shape", [RAGGED, pytest.param(TILES, marks=pytest.mark.slow)], ids=["ragged", "tiles"]
)
@pytest.mark.parametrize("fmt", FORMATS_SERVED)
def test_matches_gguf_py(fmt, shape):
    rows, widths, ms = shape
    cols = widths[quant.FORMATS[fmt].block]
    rng = np.random.default_rng(FORMATS_SERVED.index(fmt) * 100 + rows)
    w, ref = random_weight(fmt, rows, cols, rng)
    assert serves(w)
    x = rng.standard_normal((max(ms), cols)).astype(np.float32)
    for m in ms:
        y = quantized_matmul(jnp.asarray(x[:m]), w, interpret=INTERPRET)
        assert y.shape == (m, rows) and y.dtype == jnp.float32
        check(y, x[:m].astype(np.float64) @ ref.T, x[:m], ref)


def test_dtypes():
    """bfloat16 x and output: the product of x's values, accumulated in float32, then rounded
    once to bfloat16 (half a unit of its 8-bit significand)."""
    rng = np.random.default_rng(3)
    w, ref = random_weight("q4_k", 64, 256, rng)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    y = quantized_matmul(x, w, interpret=INTERPRET, out_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    x64 = np.asarray(x, np.float64)
    want = x64 @ ref.T
    y = np.asarray(y, np.float64)
    assert np.all(np.abs(y - want) <= 2.0**-8 * np.abs(want) + 1e-5 * (np.abs(x64) @ np.abs(ref).T))


def test_serves():
    w, _ = random_weight("q8_0", 64, 64, np.random.default_rng(4))
    assert not serves(w.rows(lambda a: jnp.stack([a, a])))  # stacked (experts)
    assert not serves(quant.QArray({"w": jnp.zeros((64, 64))}, "f32", 64))
    assert not serves(jnp.zeros((64, 64)))
    with pytest.raises(ValueError, match="does not serve"):
        quantized_matmul(jnp.zeros((1, 64)), w.rows(lambda a: jnp.stack([a, a])))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_int8_activations(fmt):
    """8-bit activations (w.acts == "int8"): llama.cpp's quantize-then-multiply in float64 (Q4_1
    / Q5_1 take their mins times s, vec_dot_q4_1_q8_1), and product_int8 (the XLA path), within
    check's bound on the quantized activations' terms. Zero blocks, rounding ties and a negative
    value of largest magnitude (Q8_K's sign) included."""
    rng = np.random.default_rng(BLOCK_FORMATS.index(fmt) + 50)
    w, ref = random_weight(fmt, 200, 512, rng)
    w = quant.with_activations(w, "int8")
    assert serves(w)
    x = rng.standard_normal((13, 512)).astype(np.float32)
    x[1, :256] = 0.0  # zero blocks
    x[2, :32] = np.arange(32) - 15.5  # values at .5 after scaling: rounding ties
    x[3, 7] = -np.abs(x[3]).max() * 2
    xq, s = q8_reference(x, quant.INT8_ACTIVATIONS[fmt])
    if s is None:
        want = xq @ ref.T
    else:
        m = np.asarray(w.parts["m"], np.float64)  # [O, I / 32]
        want = xq @ (ref - np.repeat(m, 32, axis=1)).T + s @ m.T
    for rows in (1, 13):
        y = quantized_matmul(jnp.asarray(x[:rows]), w, interpret=INTERPRET)
        check(y, want[:rows], xq[:rows], ref)
    xla = jax.jit(lambda x, w: quant.product_int8(x, w, jnp.float32))(x, w)
    check(
        quantized_matmul(jnp.asarray(x), w, interpret=INTERPRET),
        np.asarray(xla, np.float64),
        xq,
        ref,
    )
