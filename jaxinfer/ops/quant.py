"""Quantized weights kept compressed: GGUF block formats and per-channel int8 as `QArray`s.

A `QArray` is a weight [..., O, I] held as its parts: integer values (sub-byte values packed
as in GGUF) and per-block scales (and mins), each part [..., O, I / per] with the rows of the
weight on its leading axes, so layouts shard every part like the weight and row operations at
load (RoPE row order, head splits) apply to each part alike. `linear(x, w)` is the one matmul
seam and `embed(table, tokens)` the one lookup: the model never branches on the type.

Within a block, values keep GGUF's order (see `FORMATS`); K-quants' 6-bit sub-block scales
and mins are unpacked at load (a uint8 each per 32 values: 148 bytes per 256 values of Q4_K
instead of 144). Dequantization happens inside the compiled program. On XLA CPU a dequantized
weight is materialized before the dot (3-10x slower than the float weight, measured), so
small-row products there go to a custom kernel (kernels/cpu/) that reads the blocks once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Part:
    name: str
    dtype: str  # numpy dtype name
    per: int  # values of the weight's last axis per entry (0: one entry per row)


@dataclass(frozen=True)
class Format:
    """A block format: `block` values share `parts`; `ggml` is its GGUF type name."""

    name: str
    block: int
    parts: tuple[Part, ...]
    ggml: str | None


def _fmt(name, block, ggml, *parts) -> Format:
    return Format(name, block, tuple(Part(*p) for p in parts), ggml)


# Per block: q4/q5 `qs` byte j holds value j (low nibble) and j + 16 (high); Q4_K/Q5_K `qs`
# per 64 values: byte l holds value l (low) and 32 + l (high); Q5_0/Q5_1 `qh` bit j of the
# block's little-endian u32 is value j's fifth bit; Q5_K `qh` bit j of byte l is value
# 32 j + l's fifth bit; Q6_K `ql` per 128 values: byte b holds value b (low) and 64 + b
# (high), `qh` per 128 values: bits 2s..2s+1 of byte l are value 32 s + l's top two bits.
FORMATS = {
    f.name: f
    for f in (
        _fmt("q8_0", 32, "Q8_0", ("q", "int8", 1), ("d", "float16", 32)),
        _fmt("q4_0", 32, "Q4_0", ("qs", "uint8", 2), ("d", "float16", 32)),
        _fmt("q4_1", 32, "Q4_1", ("qs", "uint8", 2), ("d", "float16", 32), ("m", "float16", 32)),
        _fmt("q5_0", 32, "Q5_0", ("qs", "uint8", 2), ("qh", "uint8", 8), ("d", "float16", 32)),
        _fmt(
            "q5_1", 32, "Q5_1",
            ("qs", "uint8", 2), ("qh", "uint8", 8), ("d", "float16", 32), ("m", "float16", 32),
        ),
        _fmt(
            "q4_k", 256, "Q4_K",
            ("qs", "uint8", 2), ("sc", "uint8", 32), ("mn", "uint8", 32),
            ("d", "float16", 256), ("dmin", "float16", 256),
        ),
        _fmt(
            "q5_k", 256, "Q5_K",
            ("qs", "uint8", 2), ("qh", "uint8", 8), ("sc", "uint8", 32), ("mn", "uint8", 32),
            ("d", "float16", 256), ("dmin", "float16", 256),
        ),
        _fmt(
            "q6_k", 256, "Q6_K",
            ("ql", "uint8", 2), ("qh", "uint8", 4), ("sc", "int8", 16), ("d", "float16", 256),
        ),
        # weight-only per-channel int8 (`quantize="int8"` of a float checkpoint)
        _fmt("int8", 1, None, ("q", "int8", 1), ("s", "float32", 0)),
        # 16-bit float tensors of a quantized file kept 16-bit under float32 compute
        _fmt("f16", 1, "F16", ("w", "float16", 1)),
        _fmt("bf16", 1, "BF16", ("w", "bfloat16", 1)),
        # float32 weights sent to the CPU kernel for small-row products (never from a file)
        _fmt("f32", 1, None, ("w", "float32", 1)),
    )
}  # fmt: skip
GGML_FORMATS = {f.ggml: f for f in FORMATS.values() if f.ggml}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QArray:
    """A quantized weight [..., O, I] in format `fmt`: parts [..., O, I / per] whose leading
    axes are the weight's (so slicing every part slices the weight's rows); `width` is I.

    `kernel`: a kernel may multiply it (kernels/: the CPU's, Pallas's; set at placement, where
    the weight's sharding is known: kernels run on whole, unsharded weights). `acts`: "int8"
    multiplies activations quantized to 8 bits as llama.cpp does (`product_int8`; GGUF block
    formats only), "float" the float32 activations.

    `layer` (int32 []): the parts are a stack of depth-shared layers' weights [L, ...] and this
    is entry `layer` of it, which the CPU kernels read in place; `unstacked()` takes it out
    (a copy) for everything else."""

    parts: dict[str, jax.Array]
    fmt: str = field(metadata=dict(static=True))
    width: int = field(metadata=dict(static=True))
    kernel: bool = field(default=False, metadata=dict(static=True))
    acts: str = field(default="float", metadata=dict(static=True))
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        lead = 0 if self.layer is None else 1
        return (*next(iter(self.parts.values())).shape[lead:-1], self.width)

    def unstacked(self) -> QArray:
        """The weight itself: the stack's entry at `layer` (a copy), or self when unstacked."""
        if self.layer is None:
            return self
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False)  # noqa: E731
        parts = {k: pick(v) for k, v in self.parts.items()}
        return dataclasses.replace(self, parts=parts, layer=None)

    def __getitem__(self, key):  # nnx reads a parameter as `param[...]`
        if key is not Ellipsis:
            raise TypeError("a QArray is read whole (w[...]); index its parts")
        return self

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    def rows(self, fn) -> QArray:
        """The same weight with `fn` applied to every part's leading (row) axes, e.g.
        `w.rows(lambda a: a[e])` for expert e; fn must keep the last axis."""
        w = self.unstacked()
        return dataclasses.replace(w, parts={k: fn(v) for k, v in w.parts.items()})


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QSwitch:
    """A layer's weight that its stack holds in one of several formats (pipeline stages
    whose layers mix Q4_K and Q6_K: parallel/pipeline.py's Mix): options[pick] is the weight.
    Its users run `apply`, one branch per format, each on a plain QArray; a branch computes
    a product and updates no cache, so XLA copies nothing (a conditional whose branches
    update a buffer in place copies it, measured)."""

    options: tuple[QArray, ...]
    pick: jax.Array  # int32 []

    @property
    def shape(self) -> tuple[int, ...]:
        return self.options[0].shape

    def __getitem__(self, key):  # nnx reads a parameter as `param[...]`
        if key is not Ellipsis:
            raise TypeError("a QSwitch is read whole (w[...])")
        return self

    def apply(self, fn):
        """fn(the picked QArray), one traced branch per format."""
        return jax.lax.switch(self.pick, [lambda q=q: fn(q) for q in self.options])


@jax.tree_util.register_static
@dataclass(frozen=True)
class _Shared:
    """A QArray's `layer` while its tree crosses a jit boundary: entry k of the layer indices
    passed beside the tree (layers_apart)."""

    k: int


def _map_qarrays(fn, tree):
    return jax.tree.map(lambda x: fn(x) if isinstance(x, QArray) else x, tree,
                        is_leaf=lambda x: isinstance(x, QArray))  # fmt: skip


def layers_apart(tree) -> tuple[tuple[jax.Array, ...], object]:
    """(each distinct `layer` of the tree's QArrays once, the tree with each QArray's layer
    replaced by its place among them). A jitted function given both and `layers_back` sees
    one index where the weights shared one: jit makes every leaf an input of its own, and
    `linears` groups a layer's weights into one kernel call by their index's identity."""
    seen: dict[int, int] = {}
    layers: list[jax.Array] = []

    def apart(w: QArray) -> QArray:
        if w.layer is None:
            return w
        if id(w.layer) not in seen:
            seen[id(w.layer)] = len(layers)
            layers.append(w.layer)
        return dataclasses.replace(w, layer=_Shared(seen[id(w.layer)]))  # type: ignore[arg-type]

    tree = _map_qarrays(apart, tree)
    return tuple(layers), tree


def layers_back(tree, layers: tuple[jax.Array, ...]):
    """layers_apart's tree with its QArrays' layer indices back in place."""
    back = lambda w: (dataclasses.replace(w, layer=layers[w.layer.k])  # noqa: E731
                      if isinstance(w.layer, _Shared) else w)  # fmt: skip
    return _map_qarrays(back, tree)


# ---------------------------------------------------------------------------------------------
# Dequantization inside the program (jax.numpy); the reference is gguf-py's numpy dequantize.


def _nibbles(qs: jax.Array, group: int) -> jax.Array:
    """Packed nibbles [..., X] -> values [..., 2 X]: per `group` values, the low nibbles of
    group / 2 bytes, then their high nibbles."""
    g = qs.reshape(*qs.shape[:-1], -1, group // 2)  # [..., X / (group/2), group / 2]
    out = jnp.concatenate([g & 0xF, g >> 4], axis=-1)  # [..., n, group]
    return out.reshape(*qs.shape[:-1], -1)


def _bits(qh: jax.Array, width: int, count: int, byte_major: bool) -> jax.Array:
    """`count`-bit fields of bytes [..., X] -> [..., X * 8 / count]. byte_major: fields of
    each byte in a row (Q5_0); else per `width` bytes, field s of every byte, then s + 1."""
    shifts = jnp.arange(0, 8, count, dtype=jnp.uint8)
    mask = (1 << count) - 1
    if byte_major:
        out = (qh[..., None] >> shifts) & mask  # [..., X, 8 / count]
    else:
        g = qh.reshape(*qh.shape[:-1], -1, 1, width)  # [..., n, 1, width]
        out = (g >> shifts[:, None]) & mask  # [..., n, 8 / count, width]
    return out.reshape(*qh.shape[:-1], -1)


def _per(scale: jax.Array, n: int) -> jax.Array:
    """A per-block value [..., X] repeated over its n values -> [..., X * n] (float32)."""
    return jnp.repeat(scale.astype(jnp.float32), n, axis=-1)


def values(w: QArray) -> jax.Array:
    """The integer values of w as float32 [..., O, I] (before scales and mins)."""
    p = w.parts
    f = w.fmt
    if f in ("q8_0", "int8"):
        return p["q"].astype(jnp.float32)
    if f in ("f16", "bf16", "f32"):
        return p["w"].astype(jnp.float32)
    if f in ("q4_0", "q4_1"):
        return _nibbles(p["qs"], 32).astype(jnp.float32)
    if f in ("q5_0", "q5_1"):
        q = _nibbles(p["qs"], 32) | (_bits(p["qh"], 0, 1, True) << 4)
        return q.astype(jnp.float32)
    if f == "q4_k":
        return _nibbles(p["qs"], 64).astype(jnp.float32)
    if f == "q5_k":
        q = _nibbles(p["qs"], 64) | (_bits(p["qh"], 32, 1, False) << 4)
        return q.astype(jnp.float32)
    if f == "q6_k":
        q = _nibbles(p["ql"], 128) | (_bits(p["qh"], 32, 2, False) << 4)
        return q.astype(jnp.float32)
    raise ValueError(f"unknown quantized format {f!r}")


def dequantize(w: QArray, dtype=jnp.float32) -> jax.Array:
    """w as a dense [..., O, I] array of `dtype`: each value in float32 exactly as gguf-py
    computes it (scale products first), then cast."""
    w = w.unstacked()
    p, f = w.parts, w.fmt
    q = values(w)
    if f in ("f16", "bf16", "f32"):
        out = q
    elif f == "int8":
        out = q * p["s"].astype(jnp.float32)
    elif f in ("q8_0",):
        out = _per(p["d"], 32) * q
    elif f == "q4_0":
        out = _per(p["d"], 32) * (q - 8)
    elif f == "q5_0":
        out = _per(p["d"], 32) * (q - 16)
    elif f in ("q4_1", "q5_1"):
        out = _per(p["d"], 32) * q + _per(p["m"], 32)
    elif f in ("q4_k", "q5_k"):
        d = jnp.repeat(p["d"].astype(jnp.float32), 8, axis=-1)  # [..., I / 32]
        dmin = jnp.repeat(p["dmin"].astype(jnp.float32), 8, axis=-1)
        scale = jnp.repeat(d * p["sc"].astype(jnp.float32), 32, axis=-1)
        low = jnp.repeat(dmin * p["mn"].astype(jnp.float32), 32, axis=-1)
        out = scale * q - low
    elif f == "q6_k":
        d = jnp.repeat(p["d"].astype(jnp.float32), 16, axis=-1)  # [..., I / 16]
        out = jnp.repeat(d * p["sc"].astype(jnp.float32), 16, axis=-1) * (q - 32)
    else:
        raise ValueError(f"unknown quantized format {f!r}")
    return out.astype(dtype)


# ---------------------------------------------------------------------------------------------
# 8-bit activations: llama.cpp's products with its 4-8 bit formats quantize the activations to
# 8 bits (the format's vec_dot_type) and multiply integers. The same quantization here gives
# its numerics on every path: the CPU kernel's integer products (kernels/cpu/src/formats.h) and,
# where XLA multiplies, the dequantized activations times the dequantized weight.

# The activations' 8-bit type for each weight format (llama.cpp's vec_dot_type).
INT8_ACTIVATIONS = {
    "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1",
    "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k",
}  # fmt: skip


def quantize_activations(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array | None]:
    """x [..., I] quantized to 8 bits as llama.cpp quantizes activations of type `kind`, and
    dequantized -> (float32 [..., I], Q8_1's s [..., I / 32] or None).
    q8_0 / q8_1: blocks of 32, q = round-half-even(x * (127 / max|x|)), d = f16(max|x| / 127)
    (q8_1's s = f16(d * sum q), its min term); q8_k: blocks of 256, iscale = -127 / the value
    of largest magnitude (the first), q = min(127, round(iscale x)), d = 1 / iscale."""
    x = x.astype(jnp.float32)
    size = 256 if kind == "q8_k" else 32
    g = x.reshape(*x.shape[:-1], -1, size)  # [..., I / size, size]
    a = jnp.abs(g)
    s = None
    if kind == "q8_k":
        first = jnp.argmax(a, axis=-1, keepdims=True)
        top, amax = jnp.take_along_axis(g, first, -1), jnp.take_along_axis(a, first, -1)
        iscale = jnp.where(amax > 0, -127.0 / jnp.where(amax > 0, top, 1.0), 0.0)
        q = jnp.minimum(jnp.rint(iscale * g), 127.0)
        d = jnp.where(amax > 0, 1.0 / jnp.where(amax > 0, iscale, 1.0), 0.0)
    else:
        amax = jnp.max(a, axis=-1, keepdims=True)
        inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
        q = jnp.rint(g * inv)
        d = amax / 127.0
        if kind == "q8_1":
            s = (d[..., 0] * q.sum(-1)).astype(jnp.float16).astype(jnp.float32)
        d = d.astype(jnp.float16).astype(jnp.float32)
    return (q * d).reshape(x.shape), s


def with_activations(params, activations: str):
    """params with every GGUF block weight's `acts` set to `activations` ("int8" or "float");
    other leaves unchanged."""

    def mark(leaf):
        if isinstance(leaf, QArray) and leaf.fmt in INT8_ACTIVATIONS:
            return dataclasses.replace(leaf, acts=activations)
        return leaf

    return jax.tree.map(mark, params, is_leaf=lambda leaf: isinstance(leaf, QArray))


def product_int8(x: jax.Array, w: QArray, out_dtype) -> jax.Array:
    """x [..., I] times the block-format weight w [O, I] with x quantized to 8 bits (w's
    INT8_ACTIVATIONS type) -> [..., O] float32 accumulated, in `out_dtype`: the CPU kernel's
    integer products within float32 rounding. Q4_1 / Q5_1 add their mins times s, as
    llama.cpp does."""
    w = w.unstacked()
    kind = INT8_ACTIVATIONS[w.fmt]
    xq, s = quantize_activations(x, kind)
    if kind != "q8_1":
        y = jnp.einsum("...I,OI->...O", xq, dequantize(w))
        return y.astype(out_dtype)
    y = jnp.einsum("...I,OI->...O", xq, _per(w.parts["d"], 32) * values(w))  # d q, no min
    y = y + jnp.einsum("...b,Ob->...O", s, w.parts["m"].astype(jnp.float32))
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Host side: quantized weights at load (GGUF blocks: formats/gguf.py), per-channel int8


@dataclass(frozen=True)
class HostQuant:
    """A quantized weight on the host, rows in any order until `take`: parts [R, ...] of the
    file's R rows (views of a file's blocks [R, blocks, entries per block], or [R, X]), and
    `index` [...lead] the file row of each logical row. Row operations (reshape and swap of
    the leading axes, slicing them) apply to `index` alone, so the checkpoint's row
    conversions work unchanged on quantized tensors."""

    fmt: str
    parts: dict[str, np.ndarray]
    index: np.ndarray  # [...lead] int64
    width: int  # I

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.index.shape, self.width)

    @property
    def ndim(self) -> int:
        return self.index.ndim + 1

    @property
    def size(self) -> int:
        return self.index.size * self.width

    def _lead(self, shape) -> tuple[int, ...]:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape[-1] not in (self.width, -1):
            raise NotRowOp(f"reshape to {shape} changes the quantized axis ({self.width})")
        return shape[:-1]

    def reshape(self, *shape) -> HostQuant:
        return HostQuant(self.fmt, self.parts, self.index.reshape(self._lead(shape)), self.width)

    def swapaxes(self, a: int, b: int) -> HostQuant:
        n = self.ndim
        if a % n == n - 1 or b % n == n - 1:
            raise NotRowOp("a swap with the quantized axis")
        return HostQuant(self.fmt, self.parts, self.index.swapaxes(a, b), self.width)

    def __getitem__(self, key) -> HostQuant:
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key or len(key) > self.index.ndim:
            raise NotRowOp("an index into the quantized axis")
        return HostQuant(self.fmt, self.parts, self.index[key], self.width)

    @property
    def T(self):
        raise NotRowOp("a transpose")

    def astype(self, _dtype) -> HostQuant:  # quantized parts keep their types
        return self

    def take(self) -> dict[str, np.ndarray]:
        """The parts in logical row order: [...lead, X] each."""
        return {k: np.reshape(a, shape) for k, (a, shape) in self.pieces().items()}

    def pieces(self) -> dict[str, tuple[np.ndarray, tuple[int, ...]]]:
        """The parts in logical row order, each as (array [...lead, *rest], its shape
        [...lead, X]): where the rows keep the file's order, views of the file's blocks (not
        contiguous), which placement copies once, straight into their shape."""
        flat = self.index.reshape(-1)
        whole = flat.size == len(next(iter(self.parts.values())))
        keep = whole and np.array_equal(flat, np.arange(flat.size))
        out = {}
        for k, v in self.parts.items():
            rows = v if keep else v[flat]
            out[k] = (rows.reshape(*self.index.shape, *v.shape[1:]),
                      (*self.index.shape, math.prod(v.shape[1:])))  # fmt: skip
        return out


class NotRowOp(Exception):
    """A conversion that moves values within rows: the tensor is dequantized instead."""


def quantize_int8(w: np.ndarray) -> HostQuant:
    """Weight-only symmetric per-channel int8 of a float weight [..., O, I]: q = round(w / s),
    s = max |w| / 127 per row (a zero row keeps s = 1)."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    rows = int(np.prod(w.shape[:-1]))
    parts: dict[str, np.ndarray] = {"q": q.reshape(rows, -1), "s": s.reshape(rows, 1)}
    return HostQuant("int8", parts, np.arange(rows).reshape(w.shape[:-1]), w.shape[-1])
