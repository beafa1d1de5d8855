"""The Pallas grouped matmul (kernels/pallas/grouped.py) against a float64 NumPy product per
expert and against `lax.ragged_dot` (the XLA path of moe.grouped_ffn): decode (8 assignments over 64
experts, most of them empty), a prefill of 300 rows over 16 experts with ragged counts (zero
counts, counts that are whole tiles, padding rows past sum(counts)), D and O off the tiles,
float32 and bfloat16. On CPU the kernel runs in Pallas's interpreter; on a GPU compiled through
Triton (tests/conftest.py sets JAX_PLATFORMS=cpu unless it is set: JAX_PLATFORMS=cuda)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from support.kernels import grouped_reference

from jaxinfer.kernels.pallas.grouped import BM, grouped_matmul, run_tiles, tile_count, tile_map

INTERPRET = jax.default_backend() == "cpu"
U_BF16 = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits (eps 2^-7), round to nearest
ACC = 1e-5  # float32 accumulation: see check_f32


def magnitudes(xs, w, counts):
    """float64 [A, O]: the sum of |terms| of each output, the scale of its rounding error."""
    return grouped_reference(
        np.abs(np.asarray(xs, np.float64)), np.abs(np.asarray(w, np.float64)), counts
    )


def check(y, want, bound):
    err = np.abs(np.asarray(y, np.float64) - want)
    assert np.all(err <= bound + 1e-30), f"max error / bound {np.max(err / (bound + 1e-30)):.3g}"


def check_f32(y, xs, w, counts):
    """Within float32 accumulation of the float64 product: 1e-5 of the sum of |terms| per output
    (a float32 sum of n products errs by at most about n u sum|terms|, u = 2^-24: 5e-6 at
    D = 80; typically sqrt(n) u)."""
    check(y, grouped_reference(xs, w, counts), ACC * magnitudes(xs, w, counts))


def case(rng, counts, A, D, O, dtype=np.float32):
    """Random xs [A, D], w [EL, O, D] (rounded to dtype), counts [EL]; rows past sum(counts)
    hold values too (they must still come out 0)."""
    counts = np.asarray(counts, np.int32)
    assert counts.sum() <= A
    xs = jnp.asarray(rng.standard_normal((A, D)), dtype)
    w = jnp.asarray(rng.standard_normal((counts.size, O, D)), dtype)
    return xs, w, jnp.asarray(counts)


def ragged(xs, w, counts):
    """The XLA path: lax.ragged_dot over w transposed to [EL, D, O], float32 out."""
    return lax.ragged_dot(xs, jnp.swapaxes(w, 1, 2), counts, preferred_element_type=jnp.float32)


# decode: 8 assignments (one token, k = 8, or 8 tokens' top-1) over 64 experts, one expert
# picked twice; D, O whole tiles
DECODE = dict(A=8, D=128, O=128, counts={3: 1, 10: 2, 17: 1, 40: 1, 41: 1, 63: 2})
# decode with padding: 6 of 8 rows assigned here (the other 2: another device's experts)
DECODE_PAD = dict(A=8, D=64, O=192, counts={0: 1, 5: 3, 62: 2})
# prefill: 300 rows over 16 experts, 280 assigned: zero counts (1, 5, 10), counts that are whole
# tiles (16, 32, 48), one-row experts, 20 padding rows; D = 80, O = 100 off the tiles
PREFILL = dict(A=300, D=80, O=100, counts=[30, 0, 17, 16, 48, 0, 1, 32, 33, 2, 0, 20, 25, 9, 1, 46])


def counts_of(spec, experts):
    c = spec["counts"]
    if isinstance(c, dict):
        out = np.zeros(experts, np.int32)
        out[list(c)] = list(c.values())
        return out
    return np.asarray(c, np.int32)


CASES = {"decode": (DECODE, 64), "decode_pad": (DECODE_PAD, 64), "prefill": (PREFILL, 16)}


@pytest.mark.parametrize("name", CASES)
def test_float32_matches_numpy_and_ragged_dot(name):
    spec, experts = CASES[name]
    counts = counts_of(spec, experts)
    xs, w, c = case(np.random.default_rng(len(name)), counts, spec["A"], spec["D"], spec["O"])
    y = grouped_matmul(xs, w, c, interpret=INTERPRET)
    assert y.shape == (spec["A"], spec["O"]) and y.dtype == jnp.float32
    check_f32(y, xs, w, counts)
    assert np.all(np.asarray(y)[counts.sum() :] == 0)  # padding rows: exactly 0
    # the XLA path agrees within both products' accumulation error
    check(y, np.asarray(ragged(xs, w, c), np.float64), 2 * ACC * magnitudes(xs, w, counts))


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_bfloat16(name):
    """bfloat16 xs and w. Against the float64 product of the unrounded float32 values: rounding
    each input to bfloat16 moves each term x w by at most (2 u + u^2) |x w| (u = 2^-8, the unit
    roundoff), so an output by at most about 2^-7 sum|x w| (+ float32 accumulation); the
    default output (bfloat16) is then rounded once more, by at most u |y|. Against the float64
    product of the rounded values only the accumulation (and the output's rounding) remain: the
    tight check, which a wrong row or expert would fail."""
    spec, experts = CASES[name]
    counts = counts_of(spec, experts)
    xs32, w32, c = case(np.random.default_rng(7), counts, spec["A"], spec["D"], spec["O"])
    xs, w = xs32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    size = magnitudes(xs32, w32, counts)
    exact = grouped_reference(xs32, w32, counts)  # the unrounded inputs
    rounded = grouped_reference(xs, w, counts)  # the bfloat16 inputs, exactly

    y = grouped_matmul(xs, w, c, interpret=INTERPRET, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32
    check(y, exact, (2 * U_BF16 + U_BF16**2 + 2 * ACC) * size)
    check(y, rounded, ACC * magnitudes(xs, w, counts))

    yb = grouped_matmul(xs, w, c, interpret=INTERPRET)  # out_dtype: xs's, bfloat16
    assert yb.dtype == jnp.bfloat16
    check(yb, rounded, ACC * magnitudes(xs, w, counts) + U_BF16 * np.abs(rounded))
    assert np.all(np.asarray(yb, np.float32)[counts.sum() :] == 0)
    check(
        yb, np.asarray(ragged(xs, w, c), np.float64), 2 * ACC * size + 2 * U_BF16 * np.abs(rounded)
    )


def test_mixed_dtypes_and_other_tiles():
    """bfloat16 weights with float32 rows (multiplied in float32), BM = 32, BN = 128 and
    BK = 128 (one masked step over D = 80), float16 output."""
    counts = counts_of(PREFILL, 16)
    xs, w, c = case(np.random.default_rng(11), counts, PREFILL["A"], 80, 100)
    w = w.astype(jnp.bfloat16)
    y = grouped_matmul(xs, w, c, interpret=INTERPRET, block_m=32, block_n=128, block_k=128)
    assert y.dtype == jnp.float32
    check_f32(y, xs, w, counts)
    y16 = grouped_matmul(xs, w, c, interpret=INTERPRET, out_dtype=jnp.float16)
    assert y16.dtype == jnp.float16
    want = grouped_reference(xs, w, counts)
    check(y16, want, ACC * magnitudes(xs, w, counts) + 2.0**-11 * np.abs(want))


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_tiles_in_any_order(name):
    """The same product with the tiles run reversed and shuffled: a GPU runs them at once, the
    interpreter in order, so only this shows that a tile writes no rows but its own (the
    masked store: its rows past n_t belong to the next expert's tile, which runs first here)."""
    spec, experts = CASES[name]
    counts = counts_of(spec, experts)
    xs, w, c = case(np.random.default_rng(5), counts, spec["A"], spec["D"], spec["O"])
    tiles = tile_map(c, spec["A"])
    T = tiles[0].shape[0]
    for order in (np.arange(T)[::-1], np.random.default_rng(6).permutation(T)):
        y = run_tiles(xs, w, tuple(a[order] for a in tiles), interpret=INTERPRET)
        check_f32(y, xs, w, counts)
        assert np.all(np.asarray(y)[counts.sum() :] == 0)


def test_no_rows_assigned():
    """Every row padding (a device whose experts no token chose): all zeros, no tile runs."""
    xs, w, c = case(np.random.default_rng(2), np.zeros(8, np.int32), 5, 64, 64)
    assert np.all(np.asarray(grouped_matmul(xs, w, c, interpret=INTERPRET)) == 0)


@pytest.mark.parametrize(
    "counts, A",
    [
        ([1] * 64, 64),  # one row an expert: the bound's worst case (a partial tile each)
        ([17] * 8, 136),  # a whole and a partial tile each
        ([16, 0, 32, 0], 48),  # whole tiles only
        ([0, 5, 0, 0, 3], 12),  # padding rows past sum(counts)
        ([0, 0, 0], 4),
    ],
)
def test_tile_map(counts, A):
    """Each assigned row in exactly one used tile, of its own expert; tiles in row order; at
    most tile_count(A, EL) of them; unused tiles have 0 rows."""
    counts = np.asarray(counts, np.int32)
    e, r, n = (np.asarray(a) for a in tile_map(jnp.asarray(counts), A))
    assert e.shape == r.shape == n.shape == (tile_count(A, counts.size),)
    owner = np.repeat(np.arange(counts.size), counts)  # [sum] each sorted row's expert
    seen = np.zeros(A, np.int32)
    for t in np.flatnonzero(n):
        assert 0 < n[t] <= BM and r[t] + n[t] <= counts.sum()
        assert np.all(owner[r[t] : r[t] + n[t]] == e[t])
        seen[r[t] : r[t] + n[t]] += 1
    assert np.all(seen[: counts.sum()] == 1) and np.all(seen[counts.sum() :] == 0)
    used = np.flatnonzero(n)
    assert np.all(np.diff(r[used]) > 0) and np.all(np.diff(used) == 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_the_gpu_through_triton(dtype):
    """Without a GPU, the kernel still lowers for one through Pallas's Triton lowering (the path
    its compiler_params pick, not Mosaic GPU): masked loads (D, O off the tiles) and whole
    tiles."""
    for A, D, O in ((300, 80, 100), (8, 128, 128)):
        run = jax.jit(lambda xs, w, c: grouped_matmul(xs, w, c))
        lowered = run.trace(
            jax.ShapeDtypeStruct((A, D), dtype),
            jax.ShapeDtypeStruct((16, O, D), dtype),
            jax.ShapeDtypeStruct((16,), jnp.int32),
        ).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_bad_inputs_are_refused():
    xs, w, c = jnp.zeros((4, 64)), jnp.zeros((2, 32, 64)), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="needs xs"):
        grouped_matmul(xs, w[:, :, :32], c)
    with pytest.raises(ValueError, match="needs xs"):
        grouped_matmul(xs, w, jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="w must be"):
        grouped_matmul(xs, w.astype(jnp.int8), c)
    with pytest.raises(ValueError, match="power of two"):
        grouped_matmul(xs, w, c, block_n=48)
    with pytest.raises(ValueError, match="int32"):  # 2^31 weight elements: traced, not built
        grouped_matmul.trace(
            jax.ShapeDtypeStruct((4, 2**16), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 2**14, 2**16), jnp.bfloat16),
            jax.ShapeDtypeStruct((2,), jnp.int32),
        )
