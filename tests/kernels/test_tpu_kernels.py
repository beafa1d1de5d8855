"""The TPU kernels (kernels/tpu.py) in Pallas's TPU interpreter against a float64 NumPy
grouped product: decode-like rows over many experts (most empty), a prompt's rows over a few
with empty experts and padding rows, widths off the 128-lane tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.kernels import grouped_reference

from jaxinfer.kernels import tpu

INTERPRET = jax.default_backend() != "tpu"


@pytest.mark.parametrize(
    ("A", "D", "O", "counts"),
    [
        (8, 256, 128, [0, 2, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1]),  # decode: 7 of 8 rows
        (300, 96, 80, [100, 0, 150, 40]),  # a prompt: an empty expert, padding rows, odd widths
    ],
)
def test_grouped_product_against_float64(A, D, O, counts):
    rng = np.random.default_rng(A)
    xs = jnp.asarray(rng.standard_normal((A, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(counts), O, D)), jnp.float32)
    counts = jnp.asarray(counts, jnp.int32)
    got = np.asarray(tpu.grouped_matmul(xs, w, counts, interpret=INTERPRET), np.float64)
    want = grouped_reference(xs, w, counts)
    scale = grouped_reference(np.abs(xs), np.abs(w), counts)  # sum |x w| per output
    # float32 accumulation of D products: within 1e-5 of sum |x w| (measured: ~1e-7)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), np.abs(got - want).max()
