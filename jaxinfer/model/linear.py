"""The one matmul seam: `linear(x, w)` for a plain or quantized weight, and `embed` for lookups.

Kernel weights (QArrays whole on one device) go to the process's kernel where one serves
(the CPU's, grouped by format; Pallas's on accelerators, kernels.product); everything else
dequantizes inside the graph, so the model never branches on the weight's type. Weights with
8-bit activations (`QArray.acts`) quantize x as llama.cpp does on every path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..ops.norm import rms_norm
from ..ops.quant import QArray, QSwitch, dequantize, product_int8


def linear(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """x [..., I] times a weight [O, I] (plain or quantized) -> [..., O] in `out_dtype`
    (default x's dtype; a wider one is accumulated in, as preferred_element_type)."""
    return linears(x, [w], out_dtype)[0]


def linears(x: jax.Array, ws, out_dtype=None, norm=None) -> list[jax.Array]:
    """`linear(x, w)` for each of the weights `ws` that share the input x (QKV, gate/up).
    Kernel weights of one format go to the CPU kernel as one call: their products share
    one pass over the threads. With `norm` (weight, eps) the products take `rms_norm(x,
    *norm)`, computed in the kernel's calls where they serve."""
    out_dtype = out_dtype or x.dtype
    rows = int(np.prod(x.shape[:-1]))
    outs: list = [None] * len(ws)
    groups: dict[tuple[str, str, int], list[int]] = {}
    for i, w in enumerate(ws):
        if isinstance(w, QSwitch):  # a weight in one of several formats: a branch each
            outs[i] = w.apply(lambda q: linears(x, [q], out_dtype, norm)[0])
        elif isinstance(w, QArray) and w.kernel:  # a stack's entries share a call by layer
            groups.setdefault((w.fmt, w.acts, id(w.layer)), []).append(i)
    if groups:
        flat = x.reshape(rows, x.shape[-1]).astype(jnp.float32)  # [M, I]
    for (fmt, acts, _), picked in groups.items():
        values = sum(int(np.prod(ws[i].shape[-2:])) for i in picked)
        layer = ws[picked[0]].layer
        if kernels.serves(rows, fmt, values, stacked=layer is not None):
            ys = kernels.matmuls(flat, fmt, [ws[i].parts for i in picked],
                                 [ws[i].shape[-2] for i in picked], norm,
                                 int8=acts == "int8", layer=layer)  # fmt: skip
            for i, y in zip(picked, ys, strict=True):  # y [M, O]
                outs[i] = y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype)
    wide = None if out_dtype == x.dtype else out_dtype
    if norm is not None and any(out is None for out in outs):
        x = rms_norm(x, *norm)
    for i, w in enumerate(ws):
        op = kernels.product(w, rows) if outs[i] is None and isinstance(w, QArray) else None
        if op is not None:
            y = op(x.reshape(rows, x.shape[-1]))  # [M, O] float32
            outs[i] = y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype)
        elif outs[i] is None and isinstance(w, QArray) and w.acts == "int8":
            outs[i] = product_int8(x, w, out_dtype)
        elif outs[i] is None:
            w = dequantize(w, x.dtype) if isinstance(w, QArray) else w  # (a stack's: a copy)
            outs[i] = jnp.einsum("...I,OI->...O", x, w, preferred_element_type=wide)
    return outs


def swiglu(x: jax.Array, w_gate, w_up, norm=None) -> jax.Array:
    """silu(linear(x, w_gate)) * linear(x, w_up) [..., F] (`norm` as in linears). Where the
    CPU kernel's 8-bit GEMM serves both weights (a prompt chunk of a GGUF model), one call
    makes the product alone: the two [M, F] products are never held (at a 512-token chunk of
    Llama-3-8B's shapes, 59 MB of the program's temporaries)."""
    rows = int(np.prod(x.shape[:-1]))
    ws = (w_gate, w_up)
    if (
        rows >= kernels.GEMM_ROWS
        and all(isinstance(w, QArray) and w.kernel and w.acts == "int8" for w in ws)
        and w_gate.fmt == w_up.fmt
        and w_gate.layer is w_up.layer
        and w_gate.shape[-2] == w_up.shape[-2]
        and kernels.serves(rows, w_gate.fmt, stacked=w_gate.layer is not None)
    ):
        flat = x.reshape(rows, x.shape[-1]).astype(jnp.float32)  # [M, D]
        F = w_gate.shape[-2]
        (y,) = kernels.matmuls(flat, w_gate.fmt, [w.parts for w in ws], [F, F], norm, int8=True,
                               layer=w_gate.layer, glu=True)  # fmt: skip
        return y.reshape(*x.shape[:-1], F).astype(x.dtype)
    gate, up = linears(x, list(ws), norm=norm)  # [..., F] each
    return jax.nn.silu(gate) * up


def embed(table, tokens: jax.Array, dtype=None) -> jax.Array:
    """Rows of an embedding table [V, D] (plain or quantized) for tokens [...] -> [..., D]:
    a quantized table dequantizes only the rows it gathers."""
    if not isinstance(table, QArray):
        return jnp.take(table, tokens, axis=0)
    rows = table.rows(lambda a: jnp.take(a, tokens, axis=0))
    return dequantize(rows, dtype or jnp.float32)
