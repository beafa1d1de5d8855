"""The q8_0 KV cache (ops/kvquant.py; llama.cpp's -ctk / -ctv q8_0): the quantizer and the
pool layout against a NumPy definition of llama.cpp's quantize_row_q8_0_ref; attention over
q8_0 pools (alone and beside float pools, and depth-stacked) in the XLA path, every CPU kernel
variant this machine runs and the Pallas kernel (interpreted) against a float64 attention over
the dequantized cache; engines under q8_0 whose greedy tokens are float KV's."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.models import model_path

import jaxinfer
from jaxinfer.errors import JaxinferError
from jaxinfer.kernels import cpu as qkernel
from jaxinfer.kernels.pallas.attention import paged_attention
from jaxinfer.model import kvcache
from jaxinfer.model.kvcache import AttentionKV, KVConfig, KVView
from jaxinfer.ops import kvquant

VARIANTS = qkernel.runnable() if qkernel.available() else []  # best first
FLOATS = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# ---- the NumPy definition ----


def ref_quantize(x):
    """llama.cpp's quantize_row_q8_0_ref per block of min(32, H) values along the last axis of
    x (float32): d = amax / 127 in float32, stored as float16; q = roundf(x * (1 / d)) (halves
    away from zero; d = 0: q = 0) -> (q int8 [..., H], d float16 [..., nb])."""
    x = np.asarray(x, np.float32)
    H = x.shape[-1]
    bs = min(32, H)
    xb = x.reshape(*x.shape[:-1], H // bs, bs)
    d = np.abs(xb).max(-1) / np.float32(127)  # float32
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    y = (xb * inv[..., None]).astype(np.float64)  # the float32 product, exact in float64
    q = np.sign(y) * np.floor(np.abs(y) + 0.5)
    return q.astype(np.int8).reshape(x.shape), d.astype(np.float16)


def ref_pack(x):
    """x [..., H, S] (values at S positions) -> the q8_0 pool bytes [..., H + 2 nb, S] int8:
    the values' rows, then per block its S float16 scales as 2 S contiguous bytes."""
    H, S = x.shape[-2:]
    q, d = ref_quantize(np.swapaxes(x, -1, -2))  # [..., S, H], [..., S, nb]
    scales = np.swapaxes(d, -1, -2).copy()  # [..., nb, S] float16, positions contiguous
    scale_rows = scales.view(np.int8).reshape(*x.shape[:-2], -1, S)  # [..., 2 nb, S]
    return np.concatenate([np.swapaxes(q, -1, -2), scale_rows], axis=-2)


def ref_unpack(pool, H):
    """A q8_0 pool [..., H + 2 nb, S] int8 -> its values [..., H, S] float64 (q * d)."""
    S = pool.shape[-1]
    nb = H // min(32, H)
    region = np.ascontiguousarray(pool[..., H:, :]).reshape(*pool.shape[:-2], nb, 2 * S)
    d = region.view("<f2").astype(np.float64)  # [..., nb, S]
    q = pool[..., :H, :].astype(np.float64).reshape(*pool.shape[:-2], nb, H // nb, S)
    return (q * d[..., None, :]).reshape(*pool.shape[:-2], H, S)


def attention(q, keys, values, table, start, length, window):
    """float64 attention of q [B, T, K, G, H] over pools of values [P, K, H, S]: token t of row
    b over positions [max(0, n - window), n), n = start + t + 1 (real tokens only)."""
    B, T = q.shape[:2]
    S = keys.shape[-1]
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(length[b]):
            pos = np.arange(start[b] + t + 1)
            if window:
                pos = pos[pos >= start[b] + t + 1 - window]
            pages, at = table[b, pos // S], pos % S
            k, v = keys[pages, :, :, at], values[pages, :, :, at]  # [n, K, H]
            s = np.einsum("KGH,nKH->KGn", q[b, t].astype(np.float64), k)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, t] = np.einsum("KGn,nKH->KGH", p / p.sum(-1, keepdims=True), v)
    return out


# ---- the quantizer and the layout ----


@pytest.mark.parametrize("H", [8, 16, 32, 64, 128])
def test_quantize_is_llama_cpp_q8_0(H):
    """Exact, ties and zero blocks included: values at k + 1/2 steps of a block whose amax is
    127 (d = 1), and a block of zeros."""
    rng = np.random.default_rng(H)
    x = (rng.standard_normal((50, H)) * rng.uniform(0.01, 30, (50, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, :] = (np.arange(H) % 9 - 4) + 0.5
    x[1, 0] = 127.0  # every block of row 1: d = 1 ...
    x[1, :: min(32, H)] = 127.0
    x[2] = -x[1]
    q, d = kvquant.quantize(jnp.asarray(x))
    want_q, want_d = ref_quantize(x)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_array_equal(np.asarray(d).view(np.uint16), want_d.view(np.uint16))
    assert q.dtype == jnp.int8 and want_q[1, 1] == -3 and want_q[2, 1] == 3  # -3.5, 3.5: away


def test_pool_shapes_bytes_and_the_head_dim_check():
    kv = KVConfig.plan(64, 64, 16)
    for H, rows in ((8, 10), (16, 18), (32, 34), (64, 68), (128, 136)):
        cache = AttentionKV(2, H, "q8_0", "float16")
        k, v = cache.init(kv)
        assert k.shape == (kv.n_pages, 2, rows, 16) and k.dtype == jnp.int8
        assert v.shape == (kv.n_pages, 2, H, 16) and v.dtype == jnp.float16
        assert kvquant.head_dim(k) == kvquant.head_dim(v) == H
        assert cache.page_bytes(16) == 2 * rows * 16 + 2 * H * 16 * 2
    assert AttentionKV(2, 64, "float32").describe() == "float32"
    assert AttentionKV(2, 64, "q8_0", "bfloat16").describe() == "K q8_0 / V bfloat16"
    with pytest.raises(JaxinferError, match="head_dim a multiple of 32 .* is 48.*float16"):
        AttentionKV(2, 48, "float16", "q8_0")


def test_write_puts_values_and_scales_where_the_layout_says():
    """kvcache.write (the XLA path) into a q8_0 pool: a prompt chunk across pages and a decode
    token, against the NumPy packing of the same positions."""
    K, H, S = 2, 64, 16
    kv = KVConfig.plan(96, 64, S)
    pools = AttentionKV(K, H, "q8_0").init(kv)
    rng = np.random.default_rng(0)
    table = np.zeros((1, kv.table_width), np.int32)
    table[0, :3] = [4, 2, 5]
    values = np.zeros((kv.n_pages, K, H, S), np.float32)
    for start, T in ((3, 20), (23, 1)):
        x = rng.standard_normal((1, T, K, H)).astype(np.float32)
        view = KVView(jnp.asarray(table), jnp.asarray([start], jnp.int32),
                      jnp.asarray([T], jnp.int32), None)  # fmt: skip
        pools = kvcache.write(pools, jnp.asarray(x), jnp.asarray(x), view)
        for t in range(T):
            p = start + t
            values[table[0, p // S], :, :, p % S] = x[0, t]
    want = ref_pack(values)
    for pool in pools:
        np.testing.assert_array_equal(np.asarray(pool)[1:], want[1:])  # past the null page


# ---- attention over q8_0 pools ----

# (B, K, G, H, page, pages, table width)
SHAPES = [
    (1, 4, 2, 8, 128, 9, 4),  # stories260K's heads: one block of 8
    (3, 2, 4, 32, 16, 40, 12),
    (2, 2, 3, 128, 64, 30, 7),  # four blocks; odd query groups
    (2, 1, 8, 16, 32, 20, 6),
]
KINDS = [
    ("q8_0", "q8_0"),
    ("q8_0", "float16"),
    ("float32", "q8_0"),
    ("bfloat16", "q8_0"),
    ("q8_0", "bfloat16"),
    ("float16", "q8_0"),
]
# Outputs are convex combinations of values: errors relative to the largest |value| read.
# Measured over every case below (T = 1, 5, 21; windows; mixed kinds; all variants, the XLA
# path, Pallas): at most 1.9e-6 (float32 sums against float64 over the same dequantized values);
# the bound leaves 5x. The XLA path and Pallas round the probabilities to a 16-bit V pool's
# type before p v (as over 16-bit pools alone: test_kvcache's bounds, measured there).
TOL = 1e-5
P_ROUNDING = {"float16": 3e-4, "bfloat16": 3e-3}


def pool_of(kind, x):
    """Source values x [P, K, H, S] float32 as a pool of `kind`."""
    return ref_pack(x) if kind == "q8_0" else x.astype(FLOATS[kind])


def values_of(kind, pool, H):
    """What a pool of `kind` holds, float64 [P, K, H, S]."""
    if kind == "q8_0":
        return ref_unpack(np.asarray(pool), H)
    return np.asarray(pool).astype(np.float64)


class Case:
    """Rows of different lengths over pages in a random order (the null page full of large
    values), one with padding tokens after its real ones and (B > 1) an idle row; the source
    values of the pools before and after the chunk's tokens are written."""

    def __init__(self, shape, T, kinds, seed):
        B, K, G, H, S, P, NB = shape
        rng = np.random.default_rng(seed)
        self.kinds, self.H, self.S = kinds, H, S
        self.q = rng.standard_normal((B, T, K, G, H)).astype(np.float32) / np.sqrt(H)
        self.k, self.v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in "kv")
        before = [rng.standard_normal((P, K, H, S)).astype(np.float32) for _ in "kv"]
        for x in before:
            x[0] = 50.0  # the null page: never read unmasked
        self.table = rng.permutation(np.arange(1, P))[: B * NB].reshape(B, NB).astype(np.int32)
        self.start = rng.integers(0, NB * S - T, B).astype(np.int32)
        self.start[0] = rng.integers(0, 3)
        self.length = np.full(B, T, np.int32)
        self.length[0] = max(1, T - 4)
        if B > 1:
            self.length[-1] = 0
        self.pools = tuple(jnp.asarray(pool_of(k, x)) for k, x in zip(kinds, before, strict=True))
        after = [x.copy() for x in before]
        for b in range(B):
            for t in range(self.length[b]):
                page, at = self.table[b, (self.start[b] + t) // S], (self.start[b] + t) % S
                after[0][page, :, :, at], after[1][page, :, :, at] = self.k[b, t], self.v[b, t]
        self.want_pools = [pool_of(kind, x) for kind, x in zip(kinds, after, strict=True)]
        keys, values = (values_of(k, p, H) for k, p in zip(kinds, self.want_pools, strict=True))
        self.want = attention(self.q, keys, values, self.table, self.start, self.length, None)
        self.scale = np.abs(values[1:]).max()  # past the null page

    def view(self, **kw):
        return KVView(jnp.asarray(self.table), jnp.asarray(self.start),
                      jnp.asarray(self.length), None, **kw)  # fmt: skip

    def check(self, out, pools=None, layer=None, tol=TOL):
        """Real tokens' outputs within tol; pools (when given) bit for bit past the null page."""
        out = np.asarray(out, np.float64)
        for b, n in enumerate(self.length):
            err = np.abs(out[b, :n] - self.want[b, :n]).max() if n else 0.0
            assert err <= tol * self.scale, (b, err / self.scale)
        if pools is not None:
            for got, want in zip(pools, self.want_pools, strict=True):
                got = np.asarray(got if layer is None else got[layer])
                np.testing.assert_array_equal(got[1:].view(np.uint8), want[1:].view(np.uint8))


def cases():
    """Every shape, at a decode step, a verify chunk and a prompt chunk, under every pair (the
    first pair in the default tier, the rest slow)."""
    for shape in SHAPES:
        for T in (1, 5, 21):
            for i, (k, v) in enumerate(KINDS):
                marks = [pytest.mark.slow] * (i > 0)
                name = f"H{shape[3]}-S{shape[4]}-T{T}-{k}-{v}"
                yield pytest.param(shape, T, (k, v), id=name, marks=marks)


@pytest.mark.parametrize("shape, T, kinds", list(cases()))
def test_xla_path(shape, T, kinds):
    """kvcache.update without a kernel (pools split over devices; no CPU kernel): writes
    quantized, reads each page dequantized; a prompt chunk (T = 21) attends to its own keys as
    the cache holds them."""
    c = Case(shape, T, kinds, seed=SHAPES.index(shape) * 10 + T)
    out, pools = jax.jit(kvcache.update)(c.q, c.k, c.v, c.pools, c.view())
    c.check(out, pools, tol=P_ROUNDING.get(kinds[1], TOL))


def run_kernel(c: Case, variant: str, window: int):
    """The CPU kernel under `variant` on a case, checked (window: against its own reference)."""
    if window:
        keys, values = (values_of(k, p, c.H) for k, p in zip(c.kinds, c.want_pools, strict=True))
        c.want = attention(c.q, keys, values, c.table, c.start, c.length, window)
    with qkernel.using(variant):
        run = jax.jit(lambda *a: qkernel.attend(*a, window))
        out, pools = run(c.q, c.k, c.v, c.pools, c.table, c.start, c.length)
    c.check(out, pools)


@pytest.mark.skipif(not VARIANTS, reason="no CPU kernels here")
@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, marks=[pytest.mark.slow] * (i > 0)) for i, v in enumerate(VARIANTS)],
)
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("shape, T, kinds", list(cases()))
def test_cpu_kernel(shape, T, kinds, window, variant):
    """The CPU kernel writes the tokens quantized as llama.cpp does (bit for bit) and attends
    over the dequantized keys and values: the best variant here, the others in the slow tier."""
    run_kernel(Case(shape, T, kinds, seed=SHAPES.index(shape) * 10 + T), variant, window)


@pytest.mark.skipif(not VARIANTS, reason="no CPU kernels here")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_kernel_under_every_variant(variant):
    """Every variant this CPU runs on a decode step and a prompt chunk, q8_0 alone and beside
    a float16 pool, head dims of one and of four blocks."""
    for i, shape in enumerate(SHAPES[1:3]):
        for T, kinds in ((1, KINDS[0]), (21, KINDS[1]), (5, KINDS[5])):
            run_kernel(Case(shape, T, kinds, seed=i * 10 + T), variant, 40 if T == 21 else 0)


@pytest.mark.skipif(not VARIANTS, reason="no CPU kernels here")
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q8_0", "float32")])
def test_depth_stacked_pools(kinds):
    """Stacks of layers' pools [L, ...] (depth-shared layers): the CPU kernel and the XLA path
    write and read entry `layer` only."""
    shape, T = SHAPES[1], 5
    c = Case(shape, T, kinds, seed=99)
    rng = np.random.default_rng(1)
    others = [pool_of(k, rng.standard_normal((shape[5], shape[1], shape[3], shape[4]))
              .astype(np.float32)) for k in kinds]  # fmt: skip
    stacks = tuple(np.stack([o, p, o]) for o, p in zip(others, c.pools, strict=True))
    layer = jnp.asarray(1, jnp.int32)
    with qkernel.using(VARIANTS[0]):
        run = jax.jit(lambda *a: qkernel.attend(*a, None, layer=layer))
        out, pools = run(c.q, c.k, c.v, stacks, c.table, c.start, c.length)
    c.check(out, pools, layer=1)
    out, xla_pools = jax.jit(kvcache.update)(c.q, c.k, c.v, stacks, c.view(layer=layer))
    c.check(out, xla_pools, layer=1)
    for got in (pools, xla_pools):
        for g, o in zip(got, others, strict=True):
            for at in (0, 2):
                np.testing.assert_array_equal(np.asarray(g[at]).view(np.uint8), o.view(np.uint8))


@pytest.mark.parametrize("T", [pytest.param(1, marks=pytest.mark.slow), 5,
                               pytest.param(21, marks=pytest.mark.slow)])  # fmt: skip
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q8_0", "float16"), ("float32", "q8_0")])
def test_pallas_interpreted(T, kinds):
    """The Pallas kernel (interpreted) over pools kvcache.write filled: pages dequantized in
    the kernel."""
    shape = SHAPES[1]  # H and the page are tiles
    c = Case(shape, T, kinds, seed=7 + T)
    view = c.view()
    pools = kvcache.write(c.pools, jnp.asarray(c.k), jnp.asarray(c.v), view)
    out = paged_attention(c.q, pools, view.table, view.start, view.length, interpret=True)
    c.check(out, pools, tol=P_ROUNDING.get(kinds[1], TOL))


# ---- engines ----

PROMPT = [1, 403, 385, 410, 317, 407, 12, 33, 301, 286]
# The largest |logit difference| between q8_0 and float32 KV, teacher-forced over float's greedy
# tokens, measured once per model over its reference prompts (stories260K: PROMPT, 48 tokens;
# MoE routing amplifies it: a key's rounding can flip an expert) -> the bound, 1.5x that: a
# position whose float top-2 margin is within it may pick the other token.
MEASURED = {
    "stories260K": 1.29,
    "qwen3_moe_e8k2_bpe": 1.29,
    "qwen3_next_l3f1_e8k2_mtp": 0.029,
    "qwen3_5_moe_l3f1_e8k2_mtp": 0.0143,
}


def greedy(engine, prompt, n=32):
    return engine.generate(prompt, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids


def check_greedy(model, name, prompt, n=32, **kv):
    """q8_0 KV's (or `kv`'s) logits within the bound of float32 KV's; its greedy tokens
    float's up to a position whose float top-2 margin is within the bound (there the two may
    part); teacher-forced over float's tokens, q8_0's argmax float's token but at such
    positions, at most 1 in 10 excused."""
    tol = 1.5 * MEASURED[name]
    float_kv = jaxinfer.load(model, kv_cache_dtype="float32")
    q8_kv = jaxinfer.load(model, **(kv or {"kv_cache_dtype": "q8_0"}))
    want, got = greedy(float_kv, prompt, n), greedy(q8_kv, prompt, n)
    seq = list(prompt) + want
    lf = float_kv.logits(seq)[len(prompt) - 1 : -1]  # [n, V]: each generated token's logits
    lq = q8_kv.logits(seq)[len(prompt) - 1 : -1]
    assert np.abs(lq - lf).max() <= tol
    top2 = np.sort(lf, axis=-1)[:, -2:]
    close = top2[:, 1] - top2[:, 0] <= tol
    excused = np.nonzero(lq.argmax(-1) != np.asarray(want))[0]
    assert close[excused].all() and len(excused) <= n // 10, excused
    first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    assert first is None or close[first], (first, want, got)
    return q8_kv


@pytest.mark.slow
def test_stories_greedy_under_q8_0():
    q8_kv = check_greedy(None, "stories260K", PROMPT, 48)
    assert q8_kv.kv_stats()["dtype"] == "q8_0"
    f32 = jaxinfer.load(None, kv_cache_dtype="float32").kv_stats()
    per_page = [s["bytes_allocated"] / (s["pages_total"] + 1) for s in (q8_kv.kv_stats(), f32)]
    assert per_page[0] == pytest.approx(per_page[1] * 10 / 32)  # H = 8: 8 + 2 bytes, not 32


@pytest.mark.parametrize(
    "folder",
    [
        # an MoE: 8 experts, top-2, head_dim 16 (one block)
        pytest.param("qwen3_moe_e8k2_bpe", marks=pytest.mark.slow),
        # a hybrid: DeltaNet and gated attention, head_dim 32
        pytest.param("qwen3_next_l3f1_e8k2_mtp", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe_l3f1_e8k2_mtp", marks=pytest.mark.slow),
    ],
)
def test_tiny_random_greedy_under_q8_0(folder):
    path = model_path(f"tiny-random/{folder}")
    prompt = json.loads((path / "reference.json").read_text())["prompts"][1]["ids"]
    check_greedy(path, folder, prompt, 32)


@pytest.mark.slow  # 17 s here: the default tier's time budget
def test_mixed_kinds_and_kv_stats():
    """-ctk q8_0 -ctv f16: the pair reaches the pools, kv_stats and the prefix-cache root, and
    the tokens are float's as under q8_0 on both sides."""
    e = check_greedy(None, "stories260K", PROMPT, 32, kv_cache_dtype_k="q8_0",
                     kv_cache_dtype_v="f16")  # fmt: skip
    assert e.kv_stats()["dtype"] == "K q8_0 / V float16"
    assert "k_dtype='q8_0', v_dtype=dtype('float16')" in e.model_id


def test_prefix_cache_hit_gives_the_same_tokens():
    e = jaxinfer.load(None, kv_cache_dtype="q8_0", page_size=16)
    prompt = PROMPT * 5  # 50 tokens: three full pages to share
    first = greedy(e, prompt, 16)
    hits = e.kv_stats()["prefix_hits"]
    assert greedy(e, prompt, 16) == first
    assert e.kv_stats()["prefix_hits"] > hits


@pytest.mark.slow
def test_speculative_ngram_under_q8_0():
    prompt = PROMPT * 4
    plain = greedy(jaxinfer.load(None, kv_cache_dtype="q8_0"), prompt, 32)
    spec = jaxinfer.load(None, kv_cache_dtype="q8_0", speculative="ngram")
    assert greedy(spec, prompt, 32) == plain


@pytest.mark.slow
def test_depth_shared_layers_under_q8_0():
    """shared_layers (the default) on one CPU device: the layers' pools are stacks the kernel
    reads at their layer; the same tokens as separate layers."""
    if not qkernel.available():
        pytest.skip("depth-shared layers need the CPU kernels")
    shared = jaxinfer.load(None, kv_cache_dtype="q8_0")
    assert shared.runner.copies  # depth-shared: stacked caches
    apart = jaxinfer.load(None, kv_cache_dtype="q8_0", shared_layers=False)
    assert greedy(shared, PROMPT, 32) == greedy(apart, PROMPT, 32)
