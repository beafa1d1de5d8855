"""Every Pallas kernel lowers for a GPU without one (Pallas's Triton lowering, which their
compiler_params pick), inside shard_map too: the pipeline stages and expert shards of the
`layer` and `expert` layouts run them there, where their outputs must declare the manual axes
they vary over (ops.vma.agreed). Numerics are the kernels' own test files' business."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxinfer.kernels.pallas import delta, grouped, quantized
from jaxinfer.kernels.pallas.attention import paged_attention
from jaxinfer.ops.quant import QArray

TRITON = "__gpu$xla.gpu.triton"
S = jax.ShapeDtypeStruct


def attention(q, pk, pv, table, start, length):
    return paged_attention(q, (pk, pv), table, start, length, 64, q)  # windowed, gated


def quantized_product(x, q, d):
    return quantized.quantized_matmul(x, QArray({"q": q, "d": d}, "q8_0", 256, kernel=True))


KERNELS = {  # name: (fn, abstract operands); each operand gets a leading stage axis of 2
    "attention": (attention, [S((2, 1, 2, 4, 64), jnp.bfloat16), S((9, 2, 64, 16), jnp.bfloat16),
                              S((9, 2, 64, 16), jnp.bfloat16), S((2, 4), jnp.int32),
                              S((2,), jnp.int32), S((2,), jnp.int32)]),
    "attention chunk": (attention, [S((2, 100, 2, 4, 64), jnp.bfloat16),
                                    S((33, 2, 64, 16), jnp.bfloat16),
                                    S((33, 2, 64, 16), jnp.bfloat16), S((2, 16), jnp.int32),
                                    S((2,), jnp.int32), S((2,), jnp.int32)]),
    "quantized_matmul": (quantized_product, [S((3, 256), jnp.float32), S((128, 256), jnp.int8),
                            S((128, 8), jnp.float16)]),
    "delta step": (delta.recurrent_step, [S((2, 4, 32), jnp.float32)] * 2
                   + [S((2, 4, 64), jnp.float32)] + [S((2, 4), jnp.float32)] * 2
                   + [S((2, 4, 32, 64), jnp.float32)]),
    "delta chunk": (delta.chunked, [S((1, 40, 2, 32), jnp.float32)] * 2
                    + [S((1, 40, 2, 32), jnp.float32)] + [S((1, 40, 2), jnp.float32)] * 2
                    + [S((1, 2, 32, 32), jnp.float32)]),
    "grouped": (grouped.grouped_matmul, [S((24, 64), jnp.bfloat16), S((8, 96, 64), jnp.bfloat16),
                                         S((8,), jnp.int32)]),
}  # fmt: skip


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("name", list(KERNELS))
def test_lowers_for_the_gpu(name, staged):
    kernel, operands = KERNELS[name]
    fn = kernel
    if staged:  # one stage's operands per device of a 2-device "pp" axis, as a pipeline runs
        mesh = Mesh(np.array(jax.devices()[:2]), ("pp",))
        operands = [S((2, *o.shape), o.dtype) for o in operands]

        def run(*args):
            out = kernel(*(a[0] for a in args))
            return jax.tree.map(lambda y: y[None], out)

        fn = jax.shard_map(run, mesh=mesh, in_specs=P("pp"), out_specs=P("pp"))
    text = jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON in text
