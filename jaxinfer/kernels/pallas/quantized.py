"""A Pallas matmul of activations with a quantized weight kept compressed.

Contract: `quantized_matmul(x, w)` reads each tile of w's parts (ops/quant.py's `QArray`) and
dequantizes it inside the kernel, so the weight is never materialized in float. Outputs equal
`x @ dequantize(w).T` within float32 rounding, and with `w.acts == "int8"` what `product_int8`
gives (x quantized as llama.cpp quantizes activations, in XLA before the kernel). Served:
`FORMATS_SERVED` (`serves(w)` says). What it does not do yet, and its GPU timings:
benchmarks/results/pallas.md.

Tiling: a grid of (M / BM, O / BN) programs, BM 16-64 (M padded up to it) and BN 64, each a
`fori_loop` over I in steps of BK with a float32 accumulator [BM, BN]; BK is 256 for the
nibble formats (K-quants always: their I is a multiple of 256) and 128 for the others, 128 or
64 where I is not a multiple. Each part enters as a view [O, I / cols, cols / per] (a free
reshape) whose tiles [BN, BK / cols, cols / per] put a block's entries on the last axis, so
unpacking is shifts, masks, broadcast scales and reshapes of power-of-two shapes, written for
the Triton lowering (no gathers, no slices of values, 2-D float32 dots). A nibble-packed
block holds two halves of its `group` of columns (low nibbles the first, high the second, as
GGUF orders them): rather than interleave them in the kernel, x's columns are reordered
outside it into halves ([halves, M, I / halves]) and each half is its own dot.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...ops.quant import FORMATS, INT8_ACTIVATIONS, QArray, quantize_activations
from ...ops.vma import agreed


@dataclass(frozen=True)
class _Layout:
    """How a format's tile unpacks: per `group` columns, `halves` runs of columns (x is
    reordered to match), and each part's view: its tile rows cover `views[part]` columns of the
    weight (0: the part holds one entry per row)."""

    group: int
    halves: int
    views: dict[str, int]


_LAYOUTS = {
    "q8_0": _Layout(32, 1, {"q": 32, "d": 32}),
    "q4_0": _Layout(32, 2, {"qs": 32, "d": 32}),
    "q4_1": _Layout(32, 2, {"qs": 32, "d": 32, "m": 32}),
    "q5_0": _Layout(32, 2, {"qs": 32, "qh": 32, "d": 32}),
    "q5_1": _Layout(32, 2, {"qs": 32, "qh": 32, "d": 32, "m": 32}),
    "q4_k": _Layout(64, 2, {"qs": 64, "sc": 64, "mn": 64, "d": 256, "dmin": 256}),
    "q5_k": _Layout(64, 2, {"qs": 64, "qh": 256, "sc": 64, "mn": 64, "d": 256, "dmin": 256}),
    "q6_k": _Layout(128, 2, {"ql": 128, "qh": 128, "sc": 128, "d": 256}),
    "int8": _Layout(32, 1, {"q": 32, "s": 0}),
    "f16": _Layout(32, 1, {"w": 32}),
    "bf16": _Layout(32, 1, {"w": 32}),
}
FORMATS_SERVED: tuple[str, ...] = tuple(_LAYOUTS)
BN = 64


def serves(w) -> bool:
    """Whether `quantized_matmul` multiplies w: a 2-D QArray of a served format (any O and I:
    the kernel pads), with 8-bit activations only where the format has them."""
    return (
        isinstance(w, QArray)
        and w.ndim == 2
        and w.fmt in _LAYOUTS
        and (w.acts == "float" or w.fmt in INT8_ACTIVATIONS)
    )


@functools.partial(jax.jit, static_argnames=("interpret", "out_dtype"))
def quantized_matmul(x: jax.Array, w: QArray, *, interpret: bool = False, out_dtype=jnp.float32):
    """x [M, I] (any float dtype) times the quantized weight w [O, I] -> [M, O] in `out_dtype`,
    accumulated in float32. `interpret`: run the kernel in Pallas's interpreter (on CPU)."""
    if not serves(w):
        raise ValueError(f"quantized_matmul does not serve a {w.fmt} weight of shape {w.shape}")
    layout = _LAYOUTS[w.fmt]
    (m, i), o = x.shape, w.shape[0]
    bm = min(64, max(16, pl.next_power_of_2(m)))
    mp, op, ip = _up(m, bm), _up(o, BN), _up(i, 64)
    g, h = layout.group, layout.halves
    # dots of at most 128 columns a half; K-quants' I is a multiple of 256 (their BK)
    bk = next(b for b in (256, 128, 64) if ip % b == 0 and b // h <= 128)
    x, s = x.astype(jnp.float32), None
    if w.acts == "int8":
        x, s = quantize_activations(x, INT8_ACTIVATIONS[w.fmt])  # s [M, I / 32]: q8_1's
    x = jnp.pad(x, ((0, mp - m), (0, ip - i)))  # [Mp, Ip]
    xs = x.reshape(mp, ip // g, h, g // h).transpose(2, 0, 1, 3).reshape(h, mp, ip // h)
    if s is not None:  # q8_1's min term s @ m.T as a third half: s / 16 on 16 columns a block
        s = jnp.pad(jnp.repeat(s / 16, 16, axis=1), ((0, mp - m), (0, (ip - i) // 2)))
        xs = jnp.concatenate([xs, s[None]])  # [3, Mp, Ip / 2]
    parts, specs = {}, {}
    for part in FORMATS[w.fmt].parts:
        cols, per = layout.views[part.name], part.per
        a = w.parts[part.name]  # [O, I / per] ([O, 1]: one entry per row)
        if cols:
            a = jnp.pad(a, ((0, op - o), (0, (ip - i) // per)))
            parts[part.name] = a.reshape(op, ip // cols, cols // per)
        else:
            parts[part.name] = jnp.pad(a, ((0, op - o), (0, 0))).reshape(op, 1, 1)
        specs[part.name] = pl.BlockSpec((BN, *parts[part.name].shape[1:]), lambda i, j: (j, 0, 0))
    kernel = functools.partial(
        _kernel, fmt=w.fmt, views=layout.views, bk=bk, steps=ip // bk, mins=s is not None
    )
    (xs, parts), mat = agreed(xs, parts)  # inside shard_map
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, op), out_dtype, manual_axis_type=mat),
        grid=(mp // bm, op // BN),
        in_specs=[pl.BlockSpec((xs.shape[0], bm, xs.shape[2]), lambda i, j: (0, i, 0)), specs],
        out_specs=pl.BlockSpec((bm, BN), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),  # the Triton lowering (not Mosaic GPU's)
        name=f"qmatmul_{w.fmt}",
    )(xs, parts)
    return y[:m, :o]


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _kernel(x_ref, part_refs, o_ref, *, fmt, views, bk, steps, mins):
    """One [BM, BN] tile of the product: over I in steps of BK, the dot of each half of x's
    tile [BM, BK / halves] with the same half of w's tile, dequantized."""

    def step(k, acc):  # acc [BM, BN]
        def load(name, entries=slice(None)):  # part `name`'s tile [BN, BK / cols, entries]
            ref, cols = part_refs[name], views[name]
            return ref[:, pl.ds(k * (bk // cols), bk // cols), entries] if cols else ref[...]

        for h, piece in enumerate(_tile(fmt, load, mins)):  # piece [BN, BK / halves]
            width = piece.shape[1]
            xh = x_ref[h, :, pl.ds(k * width, width)]  # [BM, BK / halves]
            acc += lax.dot_general(
                xh, piece, (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
            )  # fmt: skip
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile(fmt: str, load, mins: bool) -> list[jax.Array]:
    """w's tile dequantized as ops/quant.py's `dequantize` computes it: float32 [BN, BK / halves]
    per half; with `mins` (q8_1 activations) the halves without the min, then m on each block's
    16 columns of the third half."""
    if fmt in ("f16", "bf16"):
        return [_flat(_f32(load("w")))]
    if fmt in ("q8_0", "int8"):
        return [_flat(_f32(load("d" if fmt == "q8_0" else "s")) * _f32(load("q")))]
    if fmt == "q6_k":
        return _q6_k(load)
    qs = load("qs").astype(jnp.int32)  # [BN, n, group / 2]: byte l holds values l and l + group/2
    halves = [qs & 0xF, qs >> 4]
    if fmt in ("q5_0", "q5_1"):  # qh [BN, n, 4]: bytes 0-1 the first half's fifth bits
        fifth = [_bits(load("qh", slice(2 * h, 2 * h + 2))) for h in (0, 1)]  # [BN, n, 16]
        halves = [q | (b << 4) for q, b in zip(halves, fifth, strict=True)]
    elif fmt == "q5_k":  # qh [BN, 1, 32]: bit 2 g + h of byte l is value 64 g + 32 h + l's
        qh = load("qh").astype(jnp.int32)
        g = lax.broadcasted_iota(jnp.int32, (1, 4, 1), 1)
        halves = [q | (((qh >> (2 * g + h)) & 1) << 4) for h, q in enumerate(halves)]
    d = _f32(load("d"))  # [BN, n, 1] (K-quants: [BN, 1, 1])
    if fmt in ("q4_k", "q5_k"):  # sc, mn [BN, 4, 2]: the sub-block scales of each half
        dmin = _f32(load("dmin"))
        return [
            _flat(d * _f32(load("sc", slice(h, h + 1))) * _f32(q)
                  - dmin * _f32(load("mn", slice(h, h + 1))))
            for h, q in enumerate(halves)
        ]  # fmt: skip
    if fmt in ("q4_0", "q5_0"):
        return [_flat(d * _f32(q - (8 if fmt == "q4_0" else 16))) for q in halves]
    m = _f32(load("m"))  # [BN, n, 1]
    if not mins:
        return [_flat(d * _f32(q) + m) for q in halves]
    return [_flat(d * _f32(q)) for q in halves] + [_flat(jnp.broadcast_to(m, halves[0].shape))]


def _q6_k(load) -> list[jax.Array]:
    """Q6_K's halves: per 128 values, ql byte b holds values b and 64 + b's low nibbles, qh byte
    l bits 2 s..2 s + 1 value 32 s + l's top two bits, sc one scale per 16 values."""
    ql = load("ql").astype(jnp.int32)  # [BN, n, 64]
    bn, n, _ = ql.shape
    qh = load("qh").astype(jnp.int32).reshape(bn, n, 1, 32)  # [BN, n, 1, 32]
    d = _f32(load("d"))  # [BN, 1, 1]
    out = []
    for h, low in enumerate((ql & 0xF, ql >> 4)):
        shifts = 2 * lax.broadcasted_iota(jnp.int32, (1, 1, 2, 1), 2) + 4 * h
        top = ((qh >> shifts) & 3).reshape(bn, n, 64)
        sc = d * _f32(load("sc", slice(4 * h, 4 * h + 4)))  # [BN, n, 4]
        scale = jnp.broadcast_to(sc.reshape(bn, n, 4, 1), (bn, n, 4, 16)).reshape(bn, n, 64)
        out.append(_flat(scale * _f32((low | (top << 4)) - 32)))
    return out


def _bits(b: jax.Array) -> jax.Array:
    """Bytes [BN, n, c] -> their bits [BN, n, 8 c] (int32), least significant first."""
    bn, n, c = b.shape
    shifts = lax.broadcasted_iota(jnp.int32, (1, 1, 1, 8), 3)
    return ((b.astype(jnp.int32).reshape(bn, n, c, 1) >> shifts) & 1).reshape(bn, n, 8 * c)


def _f32(a: jax.Array) -> jax.Array:
    return a.astype(jnp.float32)


def _flat(a: jax.Array) -> jax.Array:
    """[BN, n, e] -> [BN, n e]."""
    return a.reshape(a.shape[0], -1)
