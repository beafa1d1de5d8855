"""The host-RAM tier of the prefix cache (--cache-ram): a prefix evicted from a small device pool
and hit again from the host gives the greedy tokens and log-probabilities of a cold run on an
engine without the prefix cache (dense, and a hybrid whose hit restores a linear-state
snapshot), warmup compiles its copy programs so that serving with it compiles nothing, the
store never holds more than its capacity, and the store's LRU and byte accounting alone.

The reference for every hit is another engine with the prefix cache off: every token computed,
nothing copied."""

import numpy as np
import pytest
from support.compiles import CompileCounter
from support.models import model_path

import jaxinfer
from jaxinfer.runtime.host_cache import MAX_COPY, HostCache, HostPage, copy_buckets

PAGE = 16
# 6 pages: one 60-token prompt with its answer fills 4, so a second prompt evicts the first.
SMALL = dict(page_size=PAGE, max_seq_len=128, kv_cache_tokens=6 * PAGE, prefill_buckets=(32, 64),
             batch_buckets=(1,))  # fmt: skip
# Log-probabilities of a hit against a cold run (the prompt computed in other chunks): float32
# rounding, measured ~1e-6 on stories260K; the greedy ids are asserted equal besides.
ATOL = 1e-3


def _greedy(engine, ids, **kw):
    return engine.generate(ids, max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=2, **kw)


def _values(result) -> np.ndarray:
    """[n, 3] the chosen token's log-probability and the two best of each step."""
    return np.array([[t.logprob, *(v for _, v in t.top)] for t in result.logprobs])


def _prompts(engine, n: int) -> list[list[int]]:
    """`n` distinct 60-token prompts the model knows."""
    text = "Once upon a time, there was a little girl who loved to play. She had a big red ball. "
    ids = engine.tokenize(text * 4)
    return [ids[i : i + 60] if i % 2 else ids[i : i + 60][::-1] for i in range(n)]


@pytest.fixture(scope="module")
def dense():
    """stories260K with a 1 MiB host tier over a 6-page pool, warmed up in strict mode."""
    engine = jaxinfer.load(cache_ram_mib=1, strict=True, **SMALL)
    engine.warmup(progress=False)
    return engine


def test_a_host_hit_gives_the_tokens_and_logprobs_of_a_cold_run(dense, engines):
    cold = engines(prefix_cache=False, **SMALL)
    a, b = _prompts(dense, 2)
    plan = {p.program for p in dense.compile_plan()}
    assert {"spill", "restore"} <= plan
    with CompileCounter() as seen:
        first = _greedy(dense, a)
        _greedy(dense, b)  # evicts a's pages from the pool: to the host
        before = dense.kv_stats()
        again = _greedy(dense, a)
    assert seen.n == 0  # strict mode raises besides; the copies were compiled by warmup
    after = dense.kv_stats()
    assert before["host_pages"] >= 3 and first.cached_tokens == 0
    host = after["host_hits"] - before["host_hits"]
    assert host > 0 and again.cached_tokens == 48  # 3 of its pages: its last token computed
    assert after["prefix_hits"] - before["prefix_hits"] == 48
    want = _greedy(cold, a)
    assert again.token_ids == want.token_ids == first.token_ids
    np.testing.assert_allclose(_values(again), _values(want), atol=ATOL)
    # logits() starting after the hit (the host's pages copied in) agree with a cold pass too
    _greedy(dense, b)
    cached = dense.logits(a, prefix_cache=True)
    skipped = int(np.isnan(cached[:, 0]).sum())
    assert skipped > 0
    np.testing.assert_allclose(cached[skipped:], cold.logits(a)[skipped:], atol=ATOL)


def test_the_tier_never_holds_more_than_its_capacity(dense):
    """Distinct prompts spill ~4 pages of 20 KiB each: 1 MiB fills after about 13 of them."""
    with CompileCounter() as seen:
        for ids in _prompts(dense, 24):
            dense.generate(ids, max_new_tokens=2, temperature=0)
            stats = dense.kv_stats()
            assert stats["host_bytes"] <= stats["host_capacity"] == 2**20
    assert seen.n == 0
    assert stats["host_evictions"] > 0 and stats["host_bytes"] > 2**20 - 2 * 20480
    dense.reset_prefix_cache()
    stats = dense.kv_stats()
    assert (stats["host_bytes"], stats["host_pages"], stats["cached_pages"]) == (0, 0, 0)


@pytest.mark.slow  # a hybrid engine pair's load and compiles
def test_a_hybrid_host_hit_restores_the_state_at_its_end(engines):
    """Qwen3.5's linear layers start the prefill from the state the host tier kept at the hit's
    last page (copied into a snapshot), not from the pool's: tokens and log-probabilities of
    the cold run."""
    root = model_path("tiny-random/qwen3_5_l3f1_dense_mtp")
    opts = dict(SMALL, kv_cache_tokens=8 * PAGE, prefix_snapshots=16)  # snapshots outlive pages
    engine = jaxinfer.load(root, cache_ram_mib=4, **opts)
    cold = engines(root, prefix_cache=False, **opts)
    base = list(range(3, 203))
    a, b = base[:60], base[100:160]
    first = _greedy(engine, a)
    _greedy(engine, b)
    _greedy(engine, base[40:100])  # (evicting a page forgets its snapshot in the pool)
    before = engine.kv_stats()
    again = _greedy(engine, a)
    after = engine.kv_stats()
    assert before["snapshots_total"] > 0 and after["host_hits"] > before["host_hits"]
    assert again.cached_tokens == 48
    want = _greedy(cold, a)
    assert again.token_ids == want.token_ids == first.token_ids
    np.testing.assert_allclose(_values(again), _values(want), atol=ATOL)
    assert (after["pages_in_use"], after["snapshots_in_use"]) == (0, 0)


def _page(nbytes: int, state: int = 0) -> HostPage:
    pages = (np.zeros(nbytes // 2, np.uint8), np.zeros(nbytes - nbytes // 2, np.uint8))
    return HostPage(pages, (np.zeros(state, np.uint8),) if state else None)


def test_the_store_evicts_least_recently_used_within_its_bytes():
    store = HostCache(capacity=100)
    assert store.put(b"a", _page(40)) and store.put(b"b", _page(30, state=10))
    assert store.bytes == 80 and len(store) == 2
    store.get(b"a")  # a is now the most recent: b goes first
    assert store.put(b"c", _page(50))
    assert store.find(b"b") is None and store.find(b"a") is not None
    assert (store.bytes, store.evictions) == (90, 1)
    assert not store.put(b"huge", _page(101))  # larger than the whole store: not held
    assert store.bytes == 90 and store.find(b"huge") is None and store.evictions == 1
    # a page held without its state wants the copy that brings one; with it, nothing
    assert store.wants(b"new", state=False) and not store.wants(b"a", state=False)
    assert store.wants(b"a", state=True)
    assert store.put(b"a", _page(40, state=20))  # replaces its old copy; c goes for room
    assert store.find(b"c") is None and (store.bytes, store.evictions) == (60, 2)
    assert not store.wants(b"a", state=True)
    store.clear()
    assert (store.bytes, len(store), store.stats()["host_evictions"]) == (0, 0, 2)


def test_copy_buckets_are_powers_of_two_up_to_the_pool():
    assert copy_buckets(1) == (1,)
    assert copy_buckets(6) == (1, 2, 4, 8)
    assert copy_buckets(8) == (1, 2, 4, 8)
    assert copy_buckets(10_000)[-1] == MAX_COPY
