"""Independent references for the kernel tests: llama.cpp's activation quantization and
random GGUF block weights dequantized by gguf-py (the quantized products'), and the grouped
product in float64 (the expert block's)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from jaxinfer.formats.gguf import split_blocks
from jaxinfer.ops import quant


def q8_reference(x, kind):
    """x float32 [M, I] quantized as llama.cpp's x86 code quantizes activations (written
    separately from quant.quantize_activations; float32 steps in NumPy's float32) -> (the
    dequantized activations float64 [M, I], Q8_1's s float64 [M, I / 32] or None)."""
    x = np.asarray(x, np.float32)
    M, I = x.shape
    out, s = np.zeros((M, I)), np.zeros((M, I // 32))
    size = 256 if kind == "q8_k" else 32
    for m, b in np.ndindex(M, I // size):
        blk = x[m, size * b : size * (b + 1)]
        if kind == "q8_k":  # quantize_row_q8_K_ref
            top = blk[np.argmax(np.abs(blk))]  # the first of largest magnitude
            if top == 0:
                continue
            iscale = np.float32(-127.0) / top
            q = np.minimum(np.rint(iscale * blk), 127)
            out[m, size * b : size * (b + 1)] = q * np.float64(np.float32(1.0) / iscale)
        else:  # quantize_row_q8_0 / q8_1 (AVX2)
            amax = np.abs(blk).max()
            d = amax / np.float32(127.0)
            q = np.rint(blk * (np.float32(127.0) / amax if amax else np.float32(0)))
            out[m, size * b : size * (b + 1)] = q * np.float64(np.float16(d))
            s[m, b] = np.float16(d * np.float32(q.sum()))
    return out, (s if kind == "q8_1" else None)


def grouped_reference(xs, w, counts):
    """float64 [A, O]: each expert's rows times its weight transposed; rows past sum(counts) 0."""
    xs, w = np.asarray(xs, np.float64), np.asarray(w, np.float64)
    out = np.zeros((xs.shape[0], w.shape[1]))
    start = 0
    for e, c in enumerate(np.asarray(counts)):
        out[start : start + c] = xs[start : start + c] @ w[e].T
        start += c
    return out


# The K-quants' block bytes [start, stop) that make every value and sub-block scale the
# largest in magnitude: Q4_K / Q5_K values 15 / 31 with sc = mn = 63 (the 12 scale bytes all
# ones), Q6_K values q - 32 = -32 with sc = -128.
EXTREME = {
    "Q4_K": ((4, 144, 0xFF),),
    "Q5_K": ((4, 176, 0xFF),),
    "Q6_K": ((0, 192, 0x00), (192, 208, 0x80)),
}


def random_quantized(fmt: str, rows: int, cols: int, rng, extreme: bool = False):
    """(parts, float64 reference [rows, cols]) of a random weight: GGUF blocks of random bytes
    with sane f16 scales, dequantized by gguf-py; int8 from a float weight. `extreme` (the
    K-quants): every value and scale at its largest magnitude (EXTREME), the f16 scales
    random."""
    if fmt == "f32":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return {"w": w}, w.astype(np.float64)
    if fmt == "int8":
        hq = quant.quantize_int8(rng.standard_normal((rows, cols)))
        ref = hq.parts["q"].astype(np.float32) * hq.parts["s"]
        return hq.take(), ref.astype(np.float64)
    name = quant.FORMATS[fmt].ggml
    kind = GGMLQuantizationType[name]
    if fmt in ("f16", "bf16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if fmt == "f16":
            raw = w.astype(np.float16).view(np.uint8)
        else:  # bf16: the top half of each float32
            raw = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        bs, ts = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
        scales = (208,) if name == "Q6_K" else (0,)
        scales += (2,) if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else ()
        for at in scales:
            d = rng.uniform(-0.1, 0.1, (rows, cols // bs, 1)).astype(np.float16)
            raw[..., at : at + 2] = d.view(np.uint8)
        for start, stop, byte in EXTREME[name] if extreme else ():
            raw[..., start:stop] = byte
    raw = raw.reshape(rows, -1)
    ref = gguf_dequantize(raw, kind).reshape(rows, cols).astype(np.float64)
    return split_blocks(name, raw, (rows, cols)).take(), ref
