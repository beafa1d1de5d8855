"""Kernels: implementations of the ops for one backend, chosen where the model calls them; this
module is the only seam (the model and the placement ask it, never a backend). The family in
use (backend.py: JAXINFER_KERNELS and the backend) decides:
- `cpu`: the CPU's XLA FFI custom calls (`cpu/`: the FFI module, C++ sources in `cpu/src/`,
  one library per instruction set built by `cpu/build.py`): quantized and small-row float
  products, paged attention, the Gated DeltaNet step and chunk;
- `pallas` (GPU) and `interpret` (anywhere, the tests): the Pallas kernels (`pallas/`): paged
  attention, quantized products that dequantize in their tiles, the Gated DeltaNet step and
  chunk, the expert block's grouped products;
- `tpu`: the expert block's grouped product through jax's megablox (`tpu.py`);
- `xla`: none; the model's own jnp code runs every op.
Each entry below gives an op's kernel or None (the model's XLA code runs it). The model asks
for the op and never reads the backend. Kernels run on whole weights and pools (`whole`: the
placement splits no axis the kernel would see)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax

from ..ops import kvquant
from . import cpu, tpu
from .backend import family, mode
from .cpu import (
    ATTEND_POOLS,
    GEMM_ROWS,
    MAX_ROWS,
    attend,
    available,
    grouped_matmuls,
    matmul,
    matmuls,
    serves,
    status,
)
from .pallas import delta, grouped, quantized
from .pallas.attention import paged_attention
from .pallas.grouped import tile_map

__all__ = [
    "ATTEND_POOLS",
    "GEMM_ROWS",
    "MAX_ROWS",
    "AttentionKernel",
    "attend",
    "attention_kernel",
    "available",
    "checks_vma",
    "delta_rule",
    "expert_products",
    "family",
    "uses_grouped_experts",
    "grouped_product",
    "matmul",
    "matmuls",
    "mode",
    "product",
    "reads_stacked_layers",
    "takes_f32_weights",
    "serves",
    "status",
    "tile_map",
]


def _pallas() -> dict | None:
    """The Pallas kernels' keyword arguments in this family, or None outside Pallas."""
    fam = family()
    return {"interpret": fam == "interpret"} if fam in ("pallas", "interpret") else None


@dataclass(frozen=True)
class AttentionKernel:
    """A paged attention kernel. `writes`: run(q, k, v, pools, table, start, length, window)
    -> (out, pools) stores the chunk's keys itself (the CPU's); else run(q, pools, table,
    start, length, window, gate) -> out reads pools that already hold them (Pallas)."""

    run: Callable
    writes: bool


def attention_kernel(pools, whole: bool) -> AttentionKernel | None:
    """The attention kernel for these pools ([P, K, rows, page] each, kvcache.py; whole on one
    device or not), or None: the CPU's for the (K, V) dtype pairs it has handlers for
    (cpu.ATTEND_PAIRS); Pallas's where the head dim H and the page are tiles (`_tile`)."""
    if family() == "cpu" and whole and cpu.attends(pools) and available():
        return AttentionKernel(attend, True)  # stacked pools too (depth-shared layers: `layer=`)
    pallas = _pallas()
    tiles = all(_tile(n) for p in pools for n in (kvquant.head_dim(p), p.shape[-1]))
    if pallas is not None and whole and tiles:
        return AttentionKernel(functools.partial(paged_attention, **pallas), False)
    return None


def _tile(n: int) -> bool:
    """A power of two of at least 16: Triton's smallest dot operand."""
    return n >= 16 and n & (n - 1) == 0


# Rows up to which a quantized product runs in the Pallas kernel (decode, verify, short
# chunks: bound by reading the weight); a longer prompt chunk is bound by compute, where
# dequantizing once for XLA's tensor-core dot beats the kernel's float32 tiles (llama.cpp's
# CUDA backend splits the same way: its vector kernels for small batches, a dequantized GEMM
# above).
PRODUCT_ROWS = 64


def product(w, rows: int) -> Callable | None:
    """The Pallas product x [rows, I] -> [rows, O] float32 for the quantized weight w (a
    QArray whole on one device: `w.kernel`), or None."""
    pallas = _pallas()
    if pallas is None or not w.kernel or rows > PRODUCT_ROWS or not quantized.serves(w):
        return None
    return functools.partial(quantized.quantized_matmul, w=w.unstacked(), **pallas)


def delta_rule(state: tuple[int, ...], whole: bool, stacked: bool = False
               ) -> tuple[Callable, Callable] | None:  # fmt: skip
    """The Gated DeltaNet's (recurrent_step, chunked) kernels for states of `state`'s shape
    [..., DK, DV] (whole on one device or not), or None: the CPU's (any DK, DV), Pallas's
    (DK and DV tiles). `stacked`: kernels that update a stack of depth-shared layers' states
    [L, B, ...] in place at `layer=` (the CPU's only)."""
    if family() == "cpu" and whole and available():
        return cpu.delta_step, cpu.delta_chunk
    if stacked:
        return None
    pallas = _pallas()
    if pallas is None or not whole or not all(_tile(n) for n in state[-2:]):
        return None
    return (
        functools.partial(delta.recurrent_step, **pallas),
        functools.partial(delta.chunked, **pallas),
    )


def grouped_product(whole: bool) -> Callable | None:
    """The expert block's grouped product for weights whole on one device or not: xs [A, D]
    sorted by expert, w [EL, O, D], counts [EL] -> [A, O], reading only the experts with rows
    (Pallas's, grouped.py; on TPUs megablox's, tpu.py), or None."""
    pallas = _pallas()
    if not whole or (pallas is None and family() != "tpu"):
        return None
    if pallas is None:
        return tpu.grouped_matmul
    return functools.partial(grouped.grouped_matmul, **pallas)


def expert_products(ws, whole: bool) -> Callable | None:
    """The expert block's grouped products for stacked quantized weights like `ws` ([EL, O, I]
    QArrays, whole on one device or not): a function (xs [A, I] sorted by expert, weights,
    counts [EL]) -> one [A, O] float32 per weight that reads only the experts with rows, in
    place (the CPU's qmatmul_grouped; weights of one format share a call), or None."""
    if family() != "cpu" or not whole or not available() or not all(w.kernel for w in ws):
        return None
    return _grouped_products


def _grouped_products(xs, ws, counts) -> list:
    outs: list[jax.Array | None] = [None] * len(ws)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, w in enumerate(ws):
        groups.setdefault((w.fmt, w.acts), []).append(i)
    for (fmt, acts), picked in groups.items():
        ys = grouped_matmuls(xs.astype("float32"), counts, fmt, [ws[i].parts for i in picked],
                             [ws[i].shape[-2] for i in picked], int8=acts == "int8",
                             layer=ws[picked[0]].layer)  # fmt: skip
        for i, y in zip(picked, ys, strict=True):
            outs[i] = y
    return outs


def takes_f32_weights() -> bool:
    """Whether float32 matrices are placed for a kernel (as "f32" QArrays): the CPU kernels
    multiply them at the small row counts where XLA CPU's dot leaves its one-row path
    (cpu.CROSSOVERS, benchmarks/results/crossovers.md)."""
    return family() == "cpu"


def reads_stacked_layers() -> bool:
    """Whether the kernels read one layer of stacked weights and caches in place (the
    depth-shared loop, parallel/depth.py): the CPU kernels, when they are built."""
    return family() == "cpu" and available()


def checks_vma() -> bool:
    """Whether the program's shard_maps (pipeline stages, expert shards) check varying manual
    axes: not under `interpret`, whose Pallas interpreter slices varying operands with
    unvarying grid indices, which the check refuses (jax 0.10); compiled kernels declare their
    outputs' axes (ops.vma.agreed)."""
    return family() != "interpret"


def uses_grouped_experts() -> bool:
    """Whether the expert block runs as grouped products (every expert's rows in one call:
    `grouped_product`'s kernel, else XLA's ragged dot) rather than the CPU's loop of
    per-expert tiles: on accelerators, and where the Pallas kernels are interpreted (the
    accelerator path on CPU)."""
    return jax.default_backend() != "cpu" or mode() == "interpret"
