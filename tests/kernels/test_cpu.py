"""The CPU kernels (kernels/cpu/) against a float64 NumPy product of gguf-py's dequantized
weights and a float64 attention: every format and pool type under every variant this CPU runs
(the scalar one on every machine), odd row counts, activation rows across tile boundaries, and
inside jit, fori_loop, cond, vmap and shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.special import expit
from support.kernels import q8_reference, random_quantized

from jaxinfer.kernels import cpu as qkernel
from jaxinfer.model import linear
from jaxinfer.ops import quant

MS = (1, 2, 3, 5, 8, 13, 64)  # decode; fused tiles (2-8); dequantized-row tiles (13, 64)
FORMATS = tuple(quant.FORMATS)


VARIANTS = qkernel.runnable()  # best first; the scalar variant wherever a compiler built it


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not qkernel.available():
        pytest.skip(f"no CPU kernels here: {qkernel.status().describe()}")


@pytest.fixture(
    params=[pytest.param(v, marks=[pytest.mark.slow] * (i > 0)) for i, v in enumerate(VARIANTS)]
)
def variant(request):
    """The calls traced in the test use each variant in turn: the best one in the default run,
    the others (the scalar one at least) in the slow tier."""
    with qkernel.using(request.param):
        yield request.param


def width(fmt: str) -> int:
    """A row width of several blocks (and a ragged tail for the any-width formats)."""
    return {1: 100, 32: 96, 256: 512}[quant.FORMATS[fmt].block]


def check(y, x, ref, scale=1.0):
    """y within float32 rounding of x @ ref.T: 1e-5 of the sum of |terms| per output (measured:
    at most 3.6e-7 over every format and 1-64 rows; I * eps32 would allow 6e-5 at I = 1024)."""
    x = np.asarray(x, np.float64)
    bound = 1e-5 * scale * (np.abs(x) @ np.abs(ref).T) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - scale * (x @ ref.T))
    assert np.all(err <= bound), f"max error / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("rows", [37, 101])  # 101: three chunks of rows, one odd
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference(fmt, rows, variant):
    rng = np.random.default_rng(FORMATS.index(fmt) * 1000 + rows)
    cols = width(fmt)
    parts, ref = random_quantized(fmt, rows, cols, rng)
    x = rng.standard_normal((max(MS), cols)).astype(np.float32)

    @jax.jit  # one program for every M
    def products(x, parts):
        return [qkernel.matmul(x[:m], fmt, parts, rows) for m in MS]

    for m, y in zip(MS, products(x, parts), strict=True):
        assert y.shape == (m, rows) and y.dtype == jnp.float32
        check(y, x[:m], ref)


def test_float_weights_past_the_cache(variant):
    """An f32 weight over the kernel's cached-weight size (2^18 values) at every M: tiles of
    four weight rows from the quarters of each thread's range, then the 0-3 rows left over
    (O = 1031 rows in chunks of 128-129; I = 300, a ragged tail). check's bound: measured at
    most 5.2e-8 of the sum of |terms| over 5 seeds."""
    rng = np.random.default_rng(11)
    parts, ref = random_quantized("f32", 1031, 300, rng)
    x = rng.standard_normal((max(MS), 300)).astype(np.float32)

    @jax.jit
    def products(x, parts):
        return [qkernel.matmul(x[:m], "f32", parts, 1031) for m in MS]

    for m, y in zip(MS, products(x, parts), strict=True):
        check(y, x[:m], ref)


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_k"])
def test_several_weights_in_one_call(fmt, variant):
    """Weights sharing an input in one call (QKV, gate/up): each result matches its own
    reference, with output row counts that split the threads' chunks across weights."""
    rng = np.random.default_rng(7)
    cols = width(fmt)
    weights = [random_quantized(fmt, rows, cols, rng) for rows in (96, 17, 33)]
    x = rng.standard_normal((max(MS), cols)).astype(np.float32)

    @jax.jit
    def products(x, parts):
        return [qkernel.matmuls(x[:m], fmt, parts, [96, 17, 33]) for m in MS]

    for m, ys in zip(MS, products(x, [p for p, _ in weights]), strict=True):
        for y, (_, ref) in zip(ys, weights, strict=True):
            assert y.shape == (m, ref.shape[0])
            check(y, x[:m], ref)


def test_linears_groups_by_format():
    """`linear.linears` over weights of mixed formats and a plain array: one kernel call per
    format, every result equal to its own `linear`."""
    rng = np.random.default_rng(8)
    cols = 512
    fmts = ("q8_0", "q4_k", "q8_0")
    made = [random_quantized(f, 40, cols, rng) for f in fmts]
    ws = [quant.QArray(p, f, cols, kernel=True) for (p, _), f in zip(made, fmts, strict=True)]
    plain = rng.standard_normal((24, cols)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, cols)).astype(np.float32))
    ys = jax.jit(linear.linears)(x, [*ws, jnp.asarray(plain)])
    refs = [r for _, r in made] + [plain.astype(np.float64)]
    flat = np.asarray(x).reshape(6, cols)
    for y, ref in zip(ys, refs, strict=True):
        assert y.shape == (2, 3, ref.shape[0])
        check(np.asarray(y).reshape(6, -1), flat, ref)
    hlo = jax.jit(linear.linears).lower(x, [*ws, jnp.asarray(plain)]).as_text()
    assert hlo.count("jaxinfer_qmatmul_q8_0") == 1 and hlo.count("jaxinfer_qmatmul_q4_k") == 1


def test_linears_fold_the_norm(variant):
    """`linear.linears(x, ws, norm=(w, eps))`: the kernel's calls normalize x's rows themselves
    (one call per format), the other weights take XLA's norm; each result matches a float64
    RMSNorm and product, at 1 and 6 rows and at 64 (past every variant's float_rows: the f32
    weight takes XLA's norm and dot there, the q8_0 one the kernel's where the variant's
    max_rows reaches 64). check's bound holds with room:
    measured at most 8.4e-8 of the sum of |terms| over 5 seeds."""
    rng = np.random.default_rng(9)
    cols = 512
    fmts = ("f32", "q8_0")
    made = [random_quantized(f, 40, cols, rng) for f in fmts]
    ws = [quant.QArray(p, f, cols, kernel=True) for (p, _), f in zip(made, fmts, strict=True)]
    plain = rng.standard_normal((24, cols)).astype(np.float32)
    refs = [r for _, r in made] + [plain.astype(np.float64)]
    gain = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    eps = 1e-5
    for rows in (1, 6, 64):
        x = rng.standard_normal((rows, cols)).astype(np.float32) * 3.0
        run = jax.jit(lambda x, ws, g: linear.linears(x, ws, norm=(g, eps)))
        ys = run(x, [*ws, jnp.asarray(plain)], gain)
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * gain
        for y, ref in zip(ys, refs, strict=True):
            check(y, normed, ref)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    hlo = jax.jit(lambda x, ws, g: linear.linears(x, ws, norm=(g, eps))).lower(x, ws, gain)
    text = hlo.as_text()
    assert text.count("jaxinfer_qmatmul_f32") == 1 and text.count("jaxinfer_qmatmul_q8_0") == 1
    assert "rsqrt" not in text  # the kernel weights alone: no norm left in the graph


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_are_exact(fmt, variant):
    """One-hot activations read single weights back: bit-equal to gguf-py's float32 values."""
    rng = np.random.default_rng(1)
    cols = width(fmt)
    parts, ref = random_quantized(fmt, 13, cols, rng)
    picks = rng.choice(cols, 8, replace=False)
    x = np.zeros((8, cols), np.float32)
    x[np.arange(8), picks] = 1
    y = qkernel.matmul(jnp.asarray(x), fmt, parts, 13)
    np.testing.assert_array_equal(np.asarray(y), ref[:, picks].T.astype(np.float32))


def test_in_loops_and_cond():
    rng = np.random.default_rng(2)
    parts, ref = random_quantized("q4_k", 37, 512, rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)

    @jax.jit
    def looped(x, parts):
        def body(i, acc):  # sum over i of (i + 1) x W^T = 6 x W^T
            return acc + qkernel.matmul(x * (i + 1).astype(x.dtype), "q4_k", parts, 37)

        total = jax.lax.fori_loop(0, 3, body, jnp.zeros((3, 37), jnp.float32))
        picked = jax.lax.cond(
            total[0, 0] > -1e30,
            lambda: qkernel.matmul(x, "q4_k", parts, 37),
            lambda: jnp.zeros((3, 37), jnp.float32),
        )
        return total, picked

    total, picked = looped(x, parts)
    check(total, x, ref, scale=6.0)
    check(picked, x, ref)


def test_vmap():
    rng = np.random.default_rng(3)
    parts, ref = random_quantized("q8_0", 37, 96, rng)
    x = rng.standard_normal((4, 2, 96)).astype(np.float32)  # [batch, M, I]
    y = jax.jit(jax.vmap(lambda x: qkernel.matmul(x, "q8_0", parts, 37)))(x)
    for b in range(4):
        check(y[b], x[b], ref)


def test_shard_map_per_device_rows():
    """Each device multiplies its own rows of the weight, as the pipeline and expert splits
    call the kernel inside shard_map with every mesh axis manual."""
    n = jax.device_count()
    rng = np.random.default_rng(4)
    parts, ref = random_quantized("q6_k", 12 * n, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    mesh = jax.make_mesh((n,), ("d",))
    rows = NamedSharding(mesh, P("d"))
    parts = {k: jax.device_put(v, rows) for k, v in parts.items()}

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("d")), out_specs=P(None, "d"))
    def sharded(x, parts):
        return qkernel.matmul(x, "q6_k", parts, 12)

    check(sharded(x, parts), x, ref)


def test_linear_seam():
    """linear.linear sends a block format's products to the kernel at every row count, and a
    per-row int8 weight's up to MAX_ROWS, larger ones to the graph; all give the product."""
    rng = np.random.default_rng(5)
    for fmt, graph_from in (("q5_k", None), ("int8", qkernel.MAX_ROWS + 1)):
        parts, ref = random_quantized(fmt, 37, 512, rng)
        w = quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, 512, True)
        for rows in (1, qkernel.MAX_ROWS + 1):
            x = rng.standard_normal((rows, 512)).astype(np.float32)
            text = jax.jit(linear.linear).lower(x, w).as_text()
            assert (f"jaxinfer_qmatmul_{fmt}" in text) == (rows != graph_from), (fmt, rows)
            check(jax.jit(linear.linear)(x, w), x, ref)


BLOCK_FORMATS = tuple(quant.INT8_ACTIVATIONS)


def int8_reference(x, fmt, parts, ref):
    """llama.cpp's product of x [M, I] with the weight (gguf-py's float64 values `ref`) under
    8-bit activations: the quantized activations times the weight, where Q4_1 / Q5_1 take
    their mins times s (vec_dot_q4_1_q8_1) -> (float64 [M, O], the dequantized activations)."""
    xq, s = q8_reference(x, quant.INT8_ACTIVATIONS[fmt])
    if s is None:
        return xq @ ref.T, xq
    m = np.asarray(parts["m"], np.float64)  # [O, I / 32]
    return xq @ (ref - np.repeat(m, 32, axis=1)).T + s @ m.T, xq


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_int8_activations_match_reference(fmt, variant):
    """8-bit activations: the kernel's integer products (1-13 rows) and the graph path's
    (quantize_activations times the dequantized weight, past the kernel's rows) equal
    llama.cpp's quantize-then-multiply within float32 rounding (check's bound, on the
    quantized activations' terms). Activations with exact ties and zero blocks included."""
    rng = np.random.default_rng(BLOCK_FORMATS.index(fmt) + 50)
    cols, rows = width(fmt), 37
    parts, ref = random_quantized(fmt, rows, cols, rng)
    x = rng.standard_normal((13, cols)).astype(np.float32)
    x[1, :64] = 0.0  # zero blocks
    x[2, :32] = np.arange(32) - 15.5  # values at .5 after scaling: rounding ties
    x[3, 7] = -x[3].__abs__().max() * 2  # a negative value of largest magnitude (Q8_K's sign)
    w = quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, cols, True, "int8")
    for m in (1, 2, 3, 5, 8, 13):
        y = qkernel.matmuls(jnp.asarray(x[:m]), fmt, [parts], [rows], int8=True)[0]
        want, xq = int8_reference(x[:m], fmt, parts, ref)
        check_int8(y, want, xq, ref)
    graph = jax.jit(lambda x, w: quant.product_int8(x, w, jnp.float32))(x, w)
    want, xq = int8_reference(x, fmt, parts, ref)
    check_int8(graph, want, xq, ref)


# Prompt chunks and their edges: the one-row dot, idot's tiles (2-8), the GEMM from 9 rows
# (panels of 16: full, ragged, one past), chunk buckets and one past them.
LARGE_MS = (1, 2, 7, 16, 31, 64, 127, 128, 129, 255, 512, 513, 1024)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_large_m_products_match_llama_cpp_arithmetic(fmt, variant):
    """8-bit activations at every row count a prompt brings (LARGE_MS) through the seam
    (linear.linear): the kernel serves each product (its custom call is in the program: no
    float copy of the weight) and equals llama.cpp's quantize-then-multiply within float32
    rounding. 37 output rows (ragged against the 8-row register tiles and the threads'
    chunks) and 3 blocks per row (768 values of the 256-blocks: a ragged last 256 against
    nothing, and a row of several chunks of unpacked values)."""
    rng = np.random.default_rng(BLOCK_FORMATS.index(fmt) + 90)
    rows, cols = 37, 3 * quant.FORMATS[fmt].block
    parts, ref = random_quantized(fmt, rows, cols, rng)
    w = quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, cols, True, "int8")
    product = jax.jit(linear.linear)
    x = rng.standard_normal((max(LARGE_MS), cols)).astype(np.float32)
    x[3, :64] = 0.0  # a zero block
    x[5, 7] = -np.abs(x[5]).max() * 2  # a negative value of largest magnitude (Q8_K's sign)
    for m in LARGE_MS:
        assert f"jaxinfer_qmatmul_{fmt}" in product.lower(x[:m], w).as_text(), m
        want, xq = int8_reference(x[:m], fmt, parts, ref)
        check_int8(product(x[:m], w), want, xq, ref)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_large_m_products_hold_the_largest_sums(fmt, variant):
    """The K-quant GEMM's integer sums where they are largest: every weight value and
    sub-block scale at its largest magnitude (support.kernels.EXTREME) against activations
    quantized to -127 (rows of ones) or 127 (rows of minus ones) everywhere, so that every
    product in a sum has one sign: AVX2's int16 sums over spans of groups and the int32
    block sums hold them without wrapping."""
    rng = np.random.default_rng(len(fmt) + 130)
    rows, cols = 9, 2 * quant.FORMATS[fmt].block
    parts, ref = random_quantized(fmt, rows, cols, rng, extreme=True)
    w = quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, cols, True, "int8")
    x = np.ones((40, cols), np.float32)
    x[1::2] = -1.0
    product = jax.jit(linear.linear)
    assert f"jaxinfer_qmatmul_{fmt}" in product.lower(x, w).as_text()
    want, xq = int8_reference(x, fmt, parts, ref)
    check_int8(product(x, w), want, xq, ref)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k", "q6_k"])
def test_grouped_products_read_each_expert(fmt, variant):
    """The expert block's grouped products (kernels.grouped_matmuls): rows sorted by expert
    times each expert's weight of a stacked [E, O, I] one, with 8-bit activations (one row, a
    few, a GEMM's worth) and float ones, against a float64 product per expert; experts
    without rows, and rows past the experts' (zero), as the expert block sends them."""
    rng = np.random.default_rng(len(fmt) + 7)
    E, O, I = 6, 24, 2 * quant.FORMATS[fmt].block
    made = [random_quantized(fmt, O, I, rng) for _ in range(E)]
    stacked = {k: jnp.asarray(np.stack([p[k] for p, _ in made])) for k in made[0][0]}
    for int8 in (True, False):
        for counts in ([0, 1, 0, 3, 0, 0], [20, 0, 9, 1, 16, 2]):
            A = sum(counts) + 5
            x = rng.standard_normal((A, I)).astype(np.float32)
            y = qkernel.grouped_matmuls(jnp.asarray(x), jnp.asarray(counts, np.int32), fmt,
                                        [stacked], [O], int8=int8)[0]  # fmt: skip
            at = 0
            for (parts, ref), n in zip(made, counts, strict=True):
                xs = x[at : at + n]
                if int8:
                    want, xq = int8_reference(xs, fmt, parts, ref)
                    check_int8(y[at : at + n], want, xq, ref)
                else:
                    check(y[at : at + n], xs, ref)
                at += n
            assert np.all(np.asarray(y)[at:] == 0)


def delta_reference(q, k, v, g, beta, S):
    """The delta rule token by token in float64 (gdn.py's formula): q, k [B, T, H, DK], v
    [B, T, H, DV], g, beta [B, T, H], S [B, H, DK, DV] -> o [B, T, H, DV], final S."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, S))
    o, S = np.zeros(v.shape), S.copy()
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t][..., None]
        S = S + k[:, t][..., :, None] * delta[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


@pytest.mark.parametrize("shape", [(2, 1, 3, 16, 24), (2, 37, 4, 32, 80), (1, 9, 2, 128, 128)])
def test_delta_rule_matches_the_float64_recurrence(shape, variant):
    """The Gated DeltaNet's step and chunk kernels (src/delta.cc) against the recurrence in
    float64: one token, a chunk of odd length with DV not a multiple of the 64-value column
    blocks, Qwen3.5's 128 x 128 heads; a padding token (beta = g = 0) changes nothing."""
    B, T, H, DK, DV = shape
    rng = np.random.default_rng(T + DK)
    q = rng.standard_normal((B, T, H, DK)).astype(np.float32) / np.sqrt(DK)
    k = rng.standard_normal((B, T, H, DK)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # l2-normed, as the layer feeds it
    v = rng.standard_normal((B, T, H, DV)).astype(np.float32)
    g = -rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    g[:, -1], beta[:, -1] = 0.0, 0.0  # the last token pads
    S = rng.standard_normal((B, H, DK, DV)).astype(np.float32)
    want_o, want_s = delta_reference(q, k, v, g, beta, S)
    o, s = jax.jit(qkernel.delta_chunk)(q, k, v, g, beta, S)
    np.testing.assert_allclose(o, want_o, rtol=0, atol=2e-6 * np.abs(want_o).max())
    np.testing.assert_allclose(s, want_s, rtol=0, atol=2e-6 * np.abs(want_s).max())
    o1, s1 = jax.jit(qkernel.delta_step)(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
    want_o, want_s = delta_reference(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], S)
    np.testing.assert_allclose(o1, want_o[:, 0], rtol=0, atol=2e-6 * np.abs(want_o).max())
    np.testing.assert_allclose(s1, want_s, rtol=0, atol=2e-6 * np.abs(want_s).max())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_k"])  # Q8_0, Q8_1, Q8_K activations
def test_large_m_products_fold_the_norm(fmt, variant):
    """The 8-bit GEMM (9 rows on) with the RMS norm folded in, each row normed as it is
    quantized into its panel: llama.cpp's norm, quantize and multiply, within check_int8's
    bound plus two quantization steps of the row (its float32 norm may differ from NumPy's
    in the last bit, which can move a value across a rounding edge)."""
    rng = np.random.default_rng(BLOCK_FORMATS.index(fmt) + 130)
    rows, cols = 37, 3 * quant.FORMATS[fmt].block
    parts, ref = random_quantized(fmt, rows, cols, rng)
    w = quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, cols, True, "int8")
    gain, eps = rng.uniform(0.5, 1.5, cols).astype(np.float32), 1e-5
    run = jax.jit(lambda x, w, g: linear.linears(x, [w], norm=(g, eps))[0])
    mins = np.abs(np.asarray(parts["m"], np.float64)).max(1) if "m" in parts else 0.0
    for m in (9, 16, 129, 513):
        x = rng.standard_normal((m, cols)).astype(np.float32) * 3.0
        text = run.lower(x, w, gain).as_text()
        assert f"jaxinfer_qmatmul_{fmt}" in text and "rsqrt" not in text, m
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * gain
        want, xq = int8_reference(normed.astype(np.float32), fmt, parts, ref)
        step = np.abs(normed).max(axis=1, keepdims=True) / 127  # [m, 1]: a block's at most
        slack = 2 * step * (np.abs(ref).max(axis=1) + 2 * mins)  # [m, O]
        bound = 1e-5 * (np.abs(xq) @ np.abs(ref).T) + slack
        err = np.abs(np.asarray(run(x, w, gain), np.float64) - want)
        assert np.all(err <= bound), (m, float(np.max(err / bound)))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_swiglu_makes_the_product_alone(fmt, variant):
    """linear.swiglu on two int8 weights, 9 rows or more: one kernel call makes silu(gate) *
    up (no [M, F] gate or up in the program, no XLA sigmoid), equal to llama.cpp's quantized
    products then silu and multiply in float64 within each product's check_int8 bound carried
    through (|silu'| <= 1.1). 150 output rows: steps of 64 rows (gemm.chunk_rows) and a
    ragged last one."""
    rng = np.random.default_rng(BLOCK_FORMATS.index(fmt) + 170)
    rows, cols = 150, 3 * quant.FORMATS[fmt].block
    made = [random_quantized(fmt, rows, cols, rng) for _ in range(2)]
    gate, up = (quant.QArray({k: jnp.asarray(v) for k, v in parts.items()}, fmt, cols, True,
                             "int8") for parts, _ in made)  # fmt: skip
    run = jax.jit(linear.swiglu)
    for m in (9, 129, 513):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        text = run.lower(x, gate, up).as_text()
        assert text.count(f"jaxinfer_qmatmul_{fmt}") == 1 and "logistic" not in text, m
        (g, xq), (u, _) = (int8_reference(x, fmt, parts, ref) for parts, ref in made)
        silu = g * expit(g)
        bg, bu = (1e-5 * (np.abs(xq) @ np.abs(ref).T) for _, ref in made)
        bound = 1.1 * bg * np.abs(u) + np.abs(silu) * bu + 1e-6 * np.abs(silu * u) + 1e-30
        err = np.abs(np.asarray(run(x, gate, up), np.float64) - silu * u)
        assert np.all(err <= bound), (m, float(np.max(err / bound)))


def check_int8(y, want, xq, ref):
    """check's bound on the quantized activations' terms (|s m| terms are within it too)."""
    bound = 1e-5 * (np.abs(xq) @ np.abs(ref).T) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - want)
    assert np.all(err <= bound), f"max error / bound {np.max(err / bound):.3g}"


def attention_reference(q, pool_k, pool_v, table, start, length, window):
    """float64 softmax attention of token t of row b (at p = start + t) over the positions
    [n - window, n) (without a window, [0, n)) with n = min(p + 1, start + max(length, 1)),
    keys and values read through the row's block table."""
    B, T, K, G, H = q.shape
    S = pool_k.shape[-1]
    out = np.zeros(q.shape)
    for b, t in np.ndindex(B, T):
        n = min(start[b] + t + 1, start[b] + max(length[b], 1))
        pos = np.arange(n)
        if window:
            pos = pos[pos >= n - window]
        pages, offsets = table[b, pos // S], pos % S
        keys = pool_k[pages, :, :, offsets].astype(np.float64)  # [n, K, H]
        values = pool_v[pages, :, :, offsets].astype(np.float64)
        s = np.einsum("kgh,nkh->kgn", q[b, t].astype(np.float64), keys)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b, t] = np.einsum("kgn,nkh->kgh", p / p.sum(-1, keepdims=True), values)
    return out


# (B, K, G, H, page, pages, table width): stories260K's heads, the 86M's, odd query groups
# (G = 3, 5: padded register groups), G = 8, head sizes 8-128, every page size but 256
ATTENTION_SHAPES = [
    (1, 4, 2, 8, 128, 9, 4),
    (4, 12, 1, 64, 128, 17, 4),
    (3, 2, 5, 16, 16, 40, 12),
    (2, 1, 8, 32, 32, 20, 6),
    (4, 3, 3, 128, 64, 30, 7),
]


@pytest.mark.parametrize("T", [1, 21])  # a decode step; a prompt chunk across pages
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_matches_reference(shape, window, T, variant):
    check_attention(shape, window, T, np.float32)


@pytest.mark.parametrize("T", [1, 21])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES[::2])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_attention_over_16_bit_pools(dtype, shape, window, T, variant):
    """kv_cache_dtype float16 / bfloat16: the tokens' keys and values are stored rounded to
    the pool's type (as NumPy rounds: to nearest even), and read back widened."""
    check_attention(shape, window, T, dtype)


def check_attention(shape, window, T, dtype):
    """Rows of different lengths (one starting at 0-2 keys, others across several pages),
    pages in a random order, sliding windows shorter and longer than a page, a row with
    padding tokens, an idle row: each real token's key and value land at its position (the
    pools otherwise unchanged, bit for bit), then every token attends over its keys."""
    B, K, G, H, S, P, NB = shape
    rng = np.random.default_rng(ATTENTION_SHAPES.index(shape) * 100 + window + T)
    q = rng.standard_normal((B, T, K, G, H)).astype(np.float32)
    k, v = rng.standard_normal((2, B, T, K, H)).astype(np.float32)
    pool_k, pool_v = rng.standard_normal((2, P, K, H, S)).astype(dtype)
    # every row its own pages, in a random order (as the page pool hands them out)
    table = rng.permutation(np.arange(1, P))[: B * NB].reshape(B, NB).astype(np.int32)
    start = rng.integers(0, NB * S - T, B).astype(np.int32)
    start[0] = rng.integers(0, 3)
    length = np.full(B, T, np.int32)
    length[0] = max(1, T - 4)  # padding tokens after the real ones
    length[-1] = 0 if B > 1 else length[-1]  # an idle row: attends, writes nothing
    run = jax.jit(lambda *a: qkernel.attend(*a, window))
    out, (new_k, new_v) = run(q, k, v, (pool_k, pool_v), table, start, length)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    for b in range(B):
        for t in range(length[b]):
            page, at = table[b, (start[b] + t) // S], (start[b] + t) % S
            want_k[page, :, :, at], want_v[page, :, :, at] = k[b, t], v[b, t]
    assert new_k.dtype == new_v.dtype == dtype
    np.testing.assert_array_equal(np.asarray(new_k).view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(new_v).view(np.uint8), want_v.view(np.uint8))
    ref = attention_reference(q, want_k, want_v, table, start, length, window)
    # outputs are convex combinations of values: errors relative to the largest |value|
    # (measured: at most 4.5e-6 over the float32 cases, T = 1 and 21; 3.7e-6 over the 16-bit
    # ones, whose widened values are exact in float32)
    assert np.abs(np.asarray(out, np.float64) - ref).max() <= 2e-5 * np.abs(want_v).max()


def test_float_engine_runs_the_kernels(stories_gguf):
    """A float32 model on one CPU device: every decode step's attention is the kernel's, and a
    short prompt's products (2-32 rows) are too, so the golden tests above exercise them."""
    stories_gguf.generate("Once upon a time", max_new_tokens=4, temperature=0)
    decode = [c.as_text() for c in stories_gguf.compile_cache.executables("decode")]
    prefill = [c.as_text() for c in stories_gguf.compile_cache.executables("prefill")]
    variant = qkernel.status().variant
    assert decode and all(qkernel._attend_target("float32", variant) in text for text in decode)
    assert any(qkernel._target("f32", variant) in text for text in prefill)
