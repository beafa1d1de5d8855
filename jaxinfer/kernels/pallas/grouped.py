"""A Pallas grouped matmul for the MoE expert block on GPUs: `grouped_matmul(xs, w, counts)`
multiplies rows sorted by expert with their expert's weight, reading only the experts that some
row uses, each once per row tile. It computes what `lax.ragged_dot(xs, swapaxes(w, 1, 2),
counts)` computes (model/moe.py's `grouped_ffn`), with w as stored ([EL, O, D], row-major
[out, in]; no transpose), float32 accumulation, and the rows past sum(counts) (padding, or the
assignments of experts held on other devices) zero.

The tile map (plain jnp, outside the kernel, as megablox's): the rows of each expert are cut
into row tiles of BM = 16 (Triton's smallest dot) that never cross an expert, so an expert with
c rows takes ceil(c / BM) tiles and one without rows none. Tile t has its expert e_t, its first
sorted row r_t and its valid rows n_t <= BM: three small int32 arrays [T] with the static bound
T = ceil(A / BM) + min(EL, A) (each expert that has rows adds at most one partial tile);
the tiles past the real ones have n_t = 0. moe.expert_ffn's loop runs the same map with its
own tile height. `run_tiles` runs the kernel over a given map (the tests
feed it in other orders).

The grid is (T, O / BN), BN = 64. A program skips itself when n_t = 0 (`pl.when`); otherwise
it loads xs[r_t : r_t + BM] in BK = 64 column chunks (dynamic `pl.ds` on whole-array refs;
rows past n_t masked to 0), w[e_t, BN rows, BK columns] (a dynamic expert index: only this
expert's slab is read), accumulates the [BM, BN] product in float32 over D, and stores only
its first n_t rows (a masked store: the tile's other rows belong to the next expert's tiles).
The output starts as zeros (aliased with `input_output_aliases`), so rows no tile owns stay 0.
D and O need not be multiples of the tiles: the loads past them are masked (zeros), as is
the store past O, so nothing is padded or copied, the weights least of all; a masked load or
store never touches the addresses it masks, so reads and writes past A rows stay in bounds.
The Triton lowering computes element offsets in int32: xs, w and the output must each hold
fewer than 2^31 elements (w [EL, O, D] of a large MoE may not: split its experts).

Why not `lax.ragged_dot` on a GPU: XLA GPU may expand it into a dense product over every expert
(masking each expert's rows), which reads all EL experts' weights on every call; at decode,
where a token touches k of EL experts (8 of 128), that is 16x the weight traffic. Here the
weight traffic is (tiles used) x O x D: at decode one slab per touched expert.

Written for Pallas's Triton lowering (`compiler_params` = triton.CompilerParams; without them
jax picks Mosaic GPU on a GPU); `interpret=True` runs it on the CPU (the tests). float32
dots run at Precision.HIGHEST (IEEE on Triton, whose default is TF32); 16-bit operands go to
the tensor cores as they are, accumulated in float32. Mixed operand dtypes multiply in their
promoted type.

What it does not do yet, and its GPU timings: benchmarks/results/pallas.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ...ops.vma import agreed

BM = 16  # rows per tile: Triton's smallest dot
BN = 64  # output columns per program
BK = 64  # columns of D per step of the reduction
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def tile_count(A: int, EL: int, block_m: int = BM) -> int:
    """T, the static bound on the row tiles: ceil(A / BM) whole tiles plus at most one partial
    tile for each expert that has rows (at most min(EL, A) of them)."""
    return -(-A // block_m) + min(EL, A)


def tile_map(counts: jax.Array, A: int, block_m: int = BM):
    """counts [EL] rows per expert (sorted rows, sum <= A) -> (expert [T], first row [T], valid
    rows [T]) int32 for T = tile_count(A, EL) row tiles of block_m rows, each inside one expert,
    in order of rows; unused tiles have 0 valid rows (and expert 0 and row 0). Counts below 0
    count as 0, and rows at or past A are never valid (memory safety if sum(counts) > A)."""
    EL = counts.shape[0]
    T = tile_count(A, EL, block_m)
    counts = jnp.maximum(counts.astype(jnp.int32), 0)  # [EL]
    ends = jnp.cumsum(counts)  # [EL] one past each expert's last sorted row
    starts = ends - counts
    tiles = -(-counts // block_m)  # [EL]
    tile_end = jnp.cumsum(tiles)  # [EL] one past each expert's last tile
    t = jnp.arange(T, dtype=jnp.int32)  # [T]
    # [T] tile t's expert: searchsorted(tile_end, t, "right") as a count (jnp.searchsorted
    # refuses operands varying over a shard_map's manual axes, jax 0.10)
    e = jnp.sum(t[:, None] >= tile_end[None, :], axis=1, dtype=jnp.int32)
    used = e < EL
    e = jnp.minimum(e, EL - 1)
    row = starts[e] + (t - (tile_end[e] - tiles[e])) * block_m  # [T]
    n = jnp.clip(jnp.minimum(ends[e], A) - row, 0, block_m)  # [T]
    n = jnp.where(used, n, 0)
    return (jnp.where(n > 0, e, 0), jnp.where(n > 0, row, 0), n.astype(jnp.int32))


def _kernel(e_ref, r_ref, n_ref, x_ref, w_ref, _zeros_ref, o_ref, *, bm, bn, bk, D, O, kind):
    """Tile t = program_id(0), columns j = program_id(1): e_ref, r_ref, n_ref [1] (the tile's
    expert, first row, valid rows); x_ref [A, D], w_ref [EL, O, D], o_ref [A, O] whole arrays
    (o_ref aliased to _zeros_ref)."""
    n = n_ref[0]
    j = pl.program_id(1)  # out here: the interpreter does not see program_id inside a cond

    @pl.when(n > 0)
    def _():
        e, r = e_ref[0], r_ref[0]
        rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0) < n  # [BM, 1]
        outs = j * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)  # [BN, 1] w's rows
        precision = lax.Precision.HIGHEST if kind == jnp.float32 else None

        def step(k, acc):  # acc [BM, BN] float32
            k0 = pl.multiple_of(k * bk, bk)
            cols = k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # [1, BK]
            x_mask = rows & (cols < D) if D % bk else jnp.broadcast_to(rows, (bm, bk))
            x = plt.load(x_ref.at[pl.ds(r, bm), pl.ds(k0, bk)], mask=x_mask, other=0)  # [BM, BK]
            w_slab = w_ref.at[e, pl.ds(j * bn, bn), pl.ds(k0, bk)]  # [BN, BK] of expert e
            if O % bn or D % bk:
                w_mask = (outs < O) & (cols < D)  # [BN, BK]
                w = plt.load(w_slab, mask=w_mask, other=0)
            else:
                w = w_slab[...]
            return acc + lax.dot_general(
                x.astype(kind), w.astype(kind), (((1,), (1,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )  # fmt: skip

        acc = lax.fori_loop(0, pl.cdiv(D, bk), step, jnp.zeros((bm, bn), jnp.float32))
        out_cols = j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)  # [1, BN]
        mask = rows & (out_cols < O) if O % bn else jnp.broadcast_to(rows, (bm, bn))
        plt.store(o_ref.at[pl.ds(r, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype), mask=mask)


_STATIC = ("interpret", "out_dtype", "block_m", "block_n", "block_k", "num_warps")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul(
    xs: jax.Array,
    w: jax.Array,
    counts: jax.Array,
    *,
    interpret: bool = False,
    out_dtype=None,
    block_m: int = BM,
    block_n: int = BN,
    block_k: int = BK,
    num_warps: int = 4,
) -> jax.Array:
    """xs [A, D] rows sorted by expert, w [EL, O, D] (float32 / bfloat16 / float16, as stored:
    [out, in]), counts [EL] int32 rows per expert (sum <= A) -> [A, O] in out_dtype (default
    xs's), accumulated in float32: sorted row a is xs[a] @ w[e].T for the expert e with
    cumsum(counts)[e - 1] <= a < cumsum(counts)[e]; rows at or past sum(counts) are 0.
    `interpret`: run the kernel in Pallas's interpreter (on CPU). block_m, block_n, block_k:
    BM, BN, BK (powers of two, at least 16: 16 is Triton's smallest dot; a long prefill may
    want BM 64 or 128, fewer tiles re-reading each expert's weight); num_warps: Triton's."""
    if counts.shape != w.shape[:1]:
        raise ValueError(
            f"grouped_matmul needs xs [A, D], w [EL, O, D], counts [EL]; got {xs.shape}, "
            f"{w.shape}, {counts.shape}"
        )
    tiles = tile_map(counts, xs.shape[0], block_m) if xs.ndim == 2 else None
    return run_tiles(
        xs, w, tiles, interpret=interpret, out_dtype=out_dtype, block_m=block_m,
        block_n=block_n, block_k=block_k, num_warps=num_warps,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC)
def run_tiles(  # grouped_matmul's arguments (boilerplate)
    xs: jax.Array,
    w: jax.Array,
    tiles: tuple[jax.Array, jax.Array, jax.Array],
    *,
    interpret: bool = False,
    out_dtype=None,
    block_m: int = BM,
    block_n: int = BN,
    block_k: int = BK,
    num_warps: int = 4,
) -> jax.Array:
    """`grouped_matmul` over a given tile map (expert, first row, valid rows) [T] int32 each,
    as `tile_map(counts, A, block_m)` makes it, in any order (the tiles are independent: a GPU
    runs them at once, the interpreter one after another). Tiles must not overlap; rows no tile
    owns are 0."""
    if xs.ndim != 2 or w.ndim != 3 or xs.shape[1] != w.shape[2]:
        raise ValueError(
            f"grouped_matmul needs xs [A, D], w [EL, O, D], counts [EL]; got {xs.shape}, {w.shape}"
        )
    for name, a in (("xs", xs), ("w", w)):
        if a.dtype not in _FLOATS:
            raise ValueError(f"grouped_matmul: {name} must be float32, bfloat16 or float16, "
                             f"not {a.dtype}")  # fmt: skip
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"grouped_matmul: {name} = {b} must be a power of two >= 16")
    (A, D), (EL, O, _) = xs.shape, w.shape
    if max(xs.size, w.size, A * O) >= 2**31:  # Triton's element offsets are int32
        raise ValueError(
            f"grouped_matmul: an operand of 2^31 elements or more (xs {xs.shape}, w {w.shape}): "
            "the kernel's element offsets are int32; split the experts"
        )
    out_dtype = jnp.dtype(xs.dtype if out_dtype is None else out_dtype)
    e, r, n = tiles  # [T] each
    T = e.shape[0]
    if A == 0 or O == 0 or EL == 0 or T == 0:
        return jnp.zeros((A, O), out_dtype)
    one = pl.BlockSpec((1,), lambda t, j: (t,))
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)  # noqa: E731
    zeros = jnp.zeros((A, O), out_dtype)  # rows no tile owns stay 0
    kernel = functools.partial(
        _kernel, bm=block_m, bn=block_n, bk=block_k, D=D, O=O,
        kind=jnp.promote_types(xs.dtype, w.dtype),
    )  # fmt: skip
    args, mat = agreed(*(a.astype(jnp.int32) for a in (e, r, n)), xs, w, zeros)  # shard_map
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((A, O), out_dtype, manual_axis_type=mat),
        grid=(T, pl.cdiv(O, block_n)),
        in_specs=[one, one, one, whole(xs), whole(w), whole(zeros)],
        out_specs=whole(zeros),
        input_output_aliases={5: 0},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=3),  # Triton
        name="grouped_matmul",
    )(*args)
