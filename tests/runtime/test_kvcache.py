"""The paged KV cache: attention through block tables against a float64 NumPy definition of
causal attention; the page pool's bookkeeping; pages per request in an engine."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import model_path

import jaxinfer
from jaxinfer.model import kvcache
from jaxinfer.model.kvcache import NULL_PAGE, AttentionKV, KVConfig, KVView
from jaxinfer.runtime.pages import PagePool

K, G, H = 2, 3, 8


def reference(q, k, v, window=None):
    """Causal softmax attention of one row, float64: q [T, K, G, H], k/v [T, K, H]."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("TKGH,SKH->KGTS", q, k)
    t = np.arange(len(q))
    visible = t[None, :] <= t[:, None]
    if window:
        visible &= t[:, None] - t[None, :] < window
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("KGTS,SKH->TKGH", p, v)


@partial(jax.jit, static_argnames="window")
def _step(q, k, v, pools, view, window):
    pools = kvcache.write(pools, k, v, view)
    return kvcache.attend(q, k, v, pools, view, window), pools


def run_paged(rows, chunk, page, window=None, seed=0, dtype=jnp.float32):
    """Feed each row's q/k/v through the pool: prompt chunks of `chunk` tokens (all rows in
    one batch, each at its own offset), the last `decode` tokens one at a time. Pages are
    handed out shuffled, so rows never hold neighbouring pages."""
    rng = np.random.default_rng(seed)
    B = len(rows)
    longest = max(len(r["q"]) for r in rows)
    kv = KVConfig.plan(B * longest + 4 * page, longest, page)
    pools = AttentionKV(K, H, dtype).init(kv)
    free = list(rng.permutation(np.arange(1, kv.n_pages)))
    table = np.zeros((B, kv.table_width), np.int32)
    for b, r in enumerate(rows):
        n = -(-len(r["q"]) // page)
        table[b, :n] = [free.pop() for _ in range(n)]
    out = [np.zeros_like(r["q"]) for r in rows]
    done = [0] * B

    def call(T, take):
        nonlocal pools
        q = np.zeros((B, T, K, G, H), np.float32)
        k = np.zeros((B, T, K, H), np.float32)
        v = np.zeros((B, T, K, H), np.float32)
        length = np.zeros(B, np.int32)
        for b, r in enumerate(rows):
            n = take(b)
            sl = slice(done[b], done[b] + n)
            q[b, :n], k[b, :n], v[b, :n], length[b] = r["q"][sl], r["k"][sl], r["v"][sl], n
        start = jnp.asarray(np.array(done, np.int32))
        view = KVView(jnp.asarray(table), start, length, jnp.zeros(B, jnp.int32))
        got, pools = _step(q, k, v, pools, view, window=window)
        for b in range(B):
            out[b][done[b] : done[b] + length[b]] = np.asarray(got)[b, : length[b]]
            done[b] += int(length[b])

    prompt = [len(r["q"]) - r["decode"] for r in rows]
    while any(d < p for d, p in zip(done, prompt, strict=True)):
        call(chunk, lambda b: min(chunk, prompt[b] - done[b]))
    while any(d < len(r["q"]) for d, r in zip(done, rows, strict=True)):
        call(1, lambda b: int(done[b] < len(rows[b]["q"])))
    return out


def random_row(rng, n, decode):
    return {
        "q": rng.normal(size=(n, K, G, H)).astype(np.float32),
        "k": rng.normal(size=(n, K, H)).astype(np.float32),
        "v": rng.normal(size=(n, K, H)).astype(np.float32),
        "decode": decode,
    }


@pytest.mark.parametrize(
    "lengths, chunk, page, window",
    [
        ([300, 41, 1], 64, 16, None),  # chunks cross pages; a row of one token
        ([700, 260], 128, 128, None),  # several pages of prior context per chunk
        ([513, 200], 512, 64, None),  # one chunk with query tiles of 128
        ([600, 90], 100, 32, 70),  # a sliding window shorter than a chunk
    ],
)
def test_paged_attention_matches_causal_attention(lengths, chunk, page, window):
    rng = np.random.default_rng(len(lengths) * chunk)
    rows = [random_row(rng, n, decode=min(n - 1, 20)) for n in lengths]
    got = run_paged(rows, chunk, page, window)
    for r, g in zip(rows, got, strict=True):
        want = reference(r["q"], r["k"], r["v"], window)
        np.testing.assert_allclose(g, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 3e-4), (jnp.bfloat16, 3e-3)])
def test_paged_attention_over_16_bit_pools(dtype, tol):
    """The graph path (pools split over devices, or no CPU kernel) under a 16-bit
    kv_cache_dtype. Chunks of up to PAGED_CHUNK tokens and decode steps read every key from
    the pools, so against the float64 reference over the rounded keys and values only the
    probabilities' rounding to the pool's type in the value product remains (measured: 7.5e-5
    and 6.9e-4 of the largest |value|)."""
    rng = np.random.default_rng(11)
    rows = [random_row(rng, n, decode=20) for n in (150, 37)]
    got = run_paged(rows, kvcache.PAGED_CHUNK, 16, dtype=dtype)
    for r, g in zip(rows, got, strict=True):
        k, v = (r[x].astype(dtype).astype(np.float32) for x in "kv")
        assert np.abs(g - reference(r["q"], k, v)).max() <= tol * np.abs(r["v"]).max()


def test_padding_and_idle_rows_write_only_the_null_page():
    page = 16
    kv = KVConfig.plan(64, 64, page)
    pools = AttentionKV(K, H, jnp.float32).init(kv)
    table = np.zeros((2, kv.table_width), np.int32)
    table[0, :2] = [3, 1]
    view = KVView(
        jnp.asarray(table), jnp.asarray([5, 0], jnp.int32), jnp.asarray([4, 0]), jnp.zeros(2)
    )
    k = jnp.ones((2, 8, K, H))
    pool_k, _ = kvcache.write(pools, k, k, view)
    pages_axis = kvcache.AXES.index("cache_seq")
    others = tuple(a for a in range(4) if a != pages_axis)
    written = np.asarray(pool_k).sum(axis=others)  # per page
    assert written[3] == 4 * K * H  # row 0's four real tokens, at positions 5..8 of page 3
    assert written[1] == written[2] == written[4] == 0
    assert written[NULL_PAGE] > 0  # row 0's padding and all of idle row 1


def test_page_pool_reserves_grows_and_releases():
    pool = PagePool(KVConfig.plan(10 * 16, 64, 16), page_bytes=100)
    assert pool.stats()["pages_total"] == 10 and pool.pages_for(33) == 3
    assert pool.reserve(4) and not pool.reserve(7) and pool.reserve(6)
    held: list[int] = []
    left = pool.grow(held, 20, 4)  # 20 positions: 2 pages
    assert len(held) == 2 and left == 2 and NULL_PAGE not in held
    left = pool.grow(held, 1000, left)  # never beyond the reservation
    assert len(held) == 4 and left == 0
    s = pool.stats()
    assert (s["pages_in_use"], s["pages_reserved"], s["pages_free"]) == (4, 6, 0)
    assert s["bytes_in_use"] == 400 and s["bytes_allocated"] == 1100  # the null page too
    pool.release(held, left)
    assert held == [] and pool.stats()["pages_free"] == 4
    pool.release([], 6)
    assert pool.stats()["pages_free"] == 10


STORIES = "stories260K-gguf/stories260K.gguf"


@pytest.fixture(scope="module")
def small_pool():
    """A pool of 3 pages (128 tokens each) under a context of 512 and 4 slots (no prefix
    cache: the same prompt's requests would share their first page)."""
    return jaxinfer.load(
        model_path(STORIES), max_seq_len=512, slots=4, kv_cache_tokens=384,
        prefill_buckets=(64,), prefix_cache=False,
    )  # fmt: skip


def test_requests_wait_for_pages_and_the_pool_empties(small_pool):
    """Requests that need 2 pages each run one at a time in the 3 pages; the others wait in
    the queue, none fails, and every page comes back when they are done."""
    engine = small_pool
    prompt = [1] + [(5 * i) % 400 + 3 for i in range(149)]  # 150 + 40 positions: 2 pages
    alone = engine.generate(prompt, max_new_tokens=40, temperature=0).token_ids
    requests = [engine.submit(prompt, max_new_tokens=40, temperature=0) for _ in range(4)]
    most_running = 0
    while not all(r.done for r in requests):
        engine.step()
        most_running = max(most_running, len(engine._scheduler.running))
        assert engine.kv_stats()["pages_in_use"] <= 3
    assert most_running == 1  # 2 + 2 pages never fit in 3
    assert [r.result().token_ids for r in requests] == [alone] * 4
    stats = engine.kv_stats()
    assert stats["pages_free"] == stats["pages_total"] == 3 and stats["pages_reserved"] == 0


def test_request_that_can_never_fit_is_refused_at_submit(small_pool):
    """A pool smaller than the context: a request that needs more pages than the pool holds
    is refused with the numbers; the engine keeps serving the ones that fit."""
    engine = small_pool
    assert engine.kv_stats()["pages_total"] == 3
    with pytest.raises(jaxinfer.RequestError) as e:
        engine.submit([1] * 400, max_new_tokens=10)  # 409 positions: 4 pages
    assert "needs 4 KV pages (409 positions, 128 per page) but the pool holds 3" in str(e.value)
    with pytest.raises(jaxinfer.RequestError):
        engine.logits([1] * 400)
    r = engine.generate([1], max_new_tokens=200, temperature=0, ignore_eos=True)
    assert len(r.token_ids) == 200 and engine.kv_stats()["pages_free"] == 3
