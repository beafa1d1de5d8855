"""Prefix caching: the same greedy tokens and logits with the cache on and off (dense, MoE and
the three hybrid fixtures, whose hits start from state snapshots), hits through generated
text, 4 slots with a cancel and forced eviction, tenants kept apart by cache_salt, the page
pool's eviction order, and a 200-request soak that compiles nothing and gives every page and
snapshot back.

The reference for every cached run is the same engine's model with the cache off: the cache
must change which tokens are computed, never what comes out."""

import json

import numpy as np
import pytest
from support.compiles import CompileCounter
from support.models import model_path

import jaxinfer
from jaxinfer.model.kvcache import KVConfig
from jaxinfer.runtime.pages import PagePool, Snapshots, chain_hash, root_hash

PAGE = 16
OPTS = dict(
    page_size=PAGE, max_seq_len=512, prefill_buckets=(32, 128), batch_buckets=(1, 4),
    kv_cache_tokens=2048,
)  # fmt: skip
FIXTURES = {
    "dense": "stories260K-gguf/stories260K.gguf",
    "moe": "tiny-random/qwen3_moe_e8k2_bpe",
    "qwen3_next": "tiny-random/qwen3_next_l3f1_e8k2_mtp",
    "qwen3_5": "tiny-random/qwen3_5_l3f1_dense_mtp",
    "qwen3_5_moe": "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp",
}
# Logits of a hit against a cold forward (the prompt computed in other chunks, the state
# restored from its snapshot): measured up to 3.4e-5 on the graph path (qwen3_next, logits up
# to 7) and 2.4e-4 with the CPU kernels (qwen3_5_moe, page-aligned repeat: its 16 computed rows
# take the kernels' float32 products, the cold 128-row chunk XLA's dot); 4x margin. The greedy
# ids are asserted equal besides.
LOGITS_ATOL = 1e-3


def _base(kind: str) -> list[int]:
    """300 token ids the model knows: a fixture's longest prompt, or stories' text."""
    if kind == "dense":
        engine_text = "Once upon a time, there was a little girl who loved to play. " * 30
        return jaxinfer.load(model_path(FIXTURES[kind]), max_seq_len=16).tokenize(engine_text)
    root = model_path(FIXTURES[kind])
    ids = json.loads((root / "reference.json").read_text())["prompts"][3]["ids"]
    return (ids * 2)[:300]


def _greedy(engine, ids, n=12, **kw):
    return engine.generate(ids, max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def _cases(base: list[int], answer: list[int]) -> dict[str, tuple[list[int], int]]:
    """Prompts after base[:200] + its answer was served -> (prompt, tokens it must hit)."""
    turn = base[:200] + answer  # the first request and what it generated (40 tokens)
    return {
        "one page": (base[:20] + base[250:260], 16),
        "two pages, then mid-page": (base[:40] + base[210:230], 32),
        "many pages": (base[:130] + base[260:263], 128),
        "repeated exactly": (base[:150], 144),
        "repeated, page-aligned": (base[:144], 128),  # its last token is computed again
        "through the answer": (turn + base[100:110], 224),  # pages filled while decoding
    }


@pytest.mark.parametrize(
    "kind",
    [k if k == "dense" else pytest.param(k, marks=pytest.mark.slow) for k in FIXTURES],
)  # fmt: skip (the hybrid fixtures in the slow tier: the default tier's time budget)
def test_hits_give_the_tokens_and_logits_of_a_cold_run(kind):
    """Each prompt twice on one engine: with the cache, and cold (cache_prompt=False, and
    logits() without it: every token computed)."""
    root = model_path(FIXTURES[kind])
    on = jaxinfer.load(root, **OPTS)  # its own: the cache's contents are part of the test
    base = _base(kind)
    first = _greedy(on, base[:200], 40)
    cold = _greedy(on, base[:200], 40, cache_prompt=False)
    assert first.cached_tokens == 0 and first.token_ids == cold.token_ids
    for name, (prompt, hit) in _cases(base, first.token_ids).items():
        got = _greedy(on, prompt)
        assert got.cached_tokens == hit, name
        assert got.token_ids == _greedy(on, prompt, cache_prompt=False).token_ids, name
        cached = on.logits(prompt, prefix_cache=True)  # starts after the cached prefix too
        cold = on.logits(prompt)
        skipped = int(np.isnan(cached[:, 0]).sum())
        assert skipped >= hit and np.isnan(cached[:skipped]).all(), name
        np.testing.assert_allclose(cached[skipped:], cold[skipped:], atol=LOGITS_ATOL, err_msg=name)
    stats = on.kv_stats()
    assert stats["prefix_hits"] > 0 and stats["prefix_queries"] > stats["prefix_hits"]
    assert stats["pages_in_use"] == 0 and stats["cached_pages"] > 0
    hybrid = kind.startswith("qwen3_")
    assert (stats["snapshots_total"] > 0) == hybrid
    assert stats["snapshots_in_use"] == 0


@pytest.fixture(scope="module")
def hybrid():
    root = model_path(FIXTURES["qwen3_5"])
    return root, _base("qwen3_5")


def _mixed(base: list[int]) -> list[tuple[list[int], int]]:
    """Requests that share a prefix and diverge, repeat, and share nothing."""
    a = base[:90] + base[200:210]
    b = base[:90] + base[220:245]
    c = base[150:200]
    return [(a, 10), (b, 14), (c, 6), (a, 10), (b[:60], 8), (base[:33], 12), (a, 10)]


@pytest.mark.parametrize(
    "snapshots", [pytest.param(n, marks=pytest.mark.slow) for n in (0, None, 64)]
)
def test_hybrid_gives_the_cache_off_tokens_at_every_snapshot_count(hybrid, snapshots):
    """A request that could hit a prefix after another prompt has used its state index: with
    no snapshot to start its linear layers from (prefix_snapshots=0), it takes no hit and
    computes the prefix; with snapshots, it hits and resumes from one. Tokens as cache-off."""
    root, base = hybrid
    engine = jaxinfer.load(root, prefix_snapshots=snapshots, **OPTS)
    _greedy(engine, base[:200])
    _greedy(engine, base[100:180])  # another prompt's state now in the state index
    prompt = base[:40] + base[210:230]
    got = _greedy(engine, prompt)
    assert got.token_ids == _greedy(engine, prompt, cache_prompt=False).token_ids
    assert (got.cached_tokens > 0) == (snapshots != 0)
    stats = engine.kv_stats()
    # the default keeps at most the KV pool's bytes of snapshots (Qwen3-Next's real shapes
    # would otherwise keep ~25x the pool's bytes)
    assert snapshots is not None or 0 < stats["snapshot_bytes"] <= stats["bytes_allocated"]


def test_the_pool_error_names_the_snapshots():
    """Snapshots that cannot fit: the one-line error names --prefix-snapshots and their bytes."""
    root = model_path(FIXTURES["qwen3_5"])
    with pytest.raises(
        jaxinfer.JaxinferError, match=r"--prefix-snapshots \(now 10000000: .* GiB\)"
    ):
        jaxinfer.load(root, prefix_snapshots=10_000_000, **OPTS)


@pytest.mark.slow  # the soak's single-device run (default tier) covers slots, cancels, evictions
def test_hits_in_four_slots_with_a_cancel_and_eviction(hybrid, engines):
    """Two requests share a prefix then diverge, a third repeats the first, one is
    cancelled, and a pool of 24 pages with 6 snapshots forces evictions: every request's
    tokens equal its run alone on an engine without the cache."""
    root, base = hybrid
    small = dict(OPTS, slots=4, kv_cache_tokens=24 * PAGE, prefix_snapshots=6)
    engine = jaxinfer.load(root, **small)
    alone = engines(root, prefix_cache=False, **OPTS)
    requests = _mixed(base)
    want = [_greedy(alone, p, n).token_ids for p, n in requests]
    for round_ in range(3):  # the later rounds hit what the earlier ones left, or evicted
        handles = [
            engine.submit(p, max_new_tokens=n, temperature=0, ignore_eos=True) for p, n in requests
        ]
        doomed = engine.submit(base[:100], max_new_tokens=30, temperature=0)
        engine.step()
        doomed.cancel()
        got = [h.result().token_ids for h in handles]
        assert got == want, round_
    stats = engine.kv_stats()
    assert stats["prefix_hits"] > 0 and stats["cached_pages"] <= stats["pages_total"]
    assert (stats["pages_in_use"], stats["pages_reserved"], stats["snapshots_in_use"]) == (0, 0, 0)


@pytest.mark.slow
def test_cache_salt_keeps_tenants_apart(hybrid):
    root, base = hybrid
    engine = jaxinfer.load(root, **OPTS)
    prompt = base[:100]
    assert _greedy(engine, prompt, 2, cache_salt="tenant-a").cached_tokens == 0
    assert _greedy(engine, prompt, 2, cache_salt="tenant-b").cached_tokens == 0
    assert _greedy(engine, prompt, 2).cached_tokens == 0  # no salt is a tenant of its own
    assert _greedy(engine, prompt, 2, cache_salt="tenant-a").cached_tokens == 96
    assert _greedy(engine, prompt, 2, cache_prompt=False).cached_tokens == 0
    engine.reset_prefix_cache()
    assert engine.kv_stats()["cached_pages"] == 0
    assert _greedy(engine, prompt, 2, cache_salt="tenant-a").cached_tokens == 0


def _filled(pool: PagePool, hashes: list[bytes]) -> list[int]:
    """A request that fills and names len(hashes) pages, then ends: its pages."""
    assert pool.admit([], len(hashes))
    held: list[int] = []
    pool.grow(held, len(hashes) * PAGE, len(hashes))
    for page, h in zip(held, hashes, strict=True):
        assert pool.register(page, h)
    pages = list(held)
    pool.release(held, 0)
    return pages


def test_page_pool_evicts_the_oldest_chain_last_page_first():
    pool = PagePool(KVConfig.plan(6 * PAGE, 64, PAGE), page_bytes=1)
    old = [chain_hash(root_hash("m", None), range(PAGE))]
    old.append(chain_hash(old[0], range(PAGE, 2 * PAGE)))
    new = [chain_hash(root_hash("m", "salt"), range(PAGE))]
    old_pages, new_pages = _filled(pool, old), _filled(pool, new)
    stats = pool.stats()
    assert (stats["cached_pages"], stats["pages_free"], stats["pages_in_use"]) == (3, 6, 0)
    # A request needing every page is admitted: cached pages never hold one back. It takes
    # the 3 empty pages, then the oldest chain's last page, then its first, then the newer.
    assert pool.admit([], 6)
    held: list[int] = []
    pool.grow(held, 4 * PAGE, 6)
    assert pool.lookup(old) == old_pages[:1] and pool.lookup(new) == new_pages
    pool.grow(held, 5 * PAGE, 2)
    assert pool.lookup(old) == [] and pool.lookup(new) == new_pages
    pool.release(held, 1)
    # a hit holds its pages: they leave the free count until released
    hit = pool.lookup(new)
    assert pool.admit(hit, 0) and pool.stats()["pages_in_use"] == 1
    assert pool.stats()["pages_free"] == 5
    pool.release(hit, 0)
    assert pool.stats()["pages_free"] == 6 and pool.stats()["cached_pages"] == 1


def test_snapshots_are_pinned_while_read_and_evicted_least_recent_first():
    snaps = Snapshots(first=10, count=2)
    a, b = snaps.take(), snaps.take()
    snaps.keep(b"A", a)
    snaps.keep(b"B", b)
    assert snaps.take() is not None  # evicts A, the older
    assert snaps.find(b"A") is None and snaps.find(b"B") == b
    snaps.pin(b"B")
    assert snaps.take() is None  # B is pinned, the other slot is being written
    snaps.unpin(b)
    assert snaps.stats()["snapshots_in_use"] == 1


def _soak(engine, base, rng, n: int):
    kw = dict(temperature=0, ignore_eos=True)
    handles = []
    for i in range(n):
        cut = int(rng.integers(8, 120))
        prompt = base[:cut] if i % 3 else base[int(rng.integers(0, 150)) :][:cut]
        handles.append(engine.submit(prompt, max_new_tokens=int(rng.integers(1, 10)), **kw))
        if i % 7 == 3:
            handles[-1].cancel()
        if i % 5 == 4:
            engine.step()
    for h in handles:
        h.result()


@pytest.mark.slow  # the default tier's time budget; the units above cover the pool
@pytest.mark.parametrize("layout, devices", [("single", 1), ("layer", 2), ("tensor", 2)])
def test_a_200_request_soak_compiles_nothing_and_gives_everything_back(
    hybrid, engines, layout, devices
):
    """Hits, misses, cancels and evictions (20 pages, 8 snapshots) in 4 slots: no compile
    after warmup, every page and snapshot back when idle, and afterwards prompts that hit
    what the soak left give the tokens of an engine without the cache (one-device engines
    of the session, shared with the other tests)."""
    root, base = hybrid
    opts = dict(OPTS, slots=4, kv_cache_tokens=20 * PAGE, prefix_snapshots=8)
    engine = jaxinfer.load(root, layout=layout, devices=devices, strict=True, **opts)
    engine.warmup(progress=False)
    rng = np.random.default_rng(0)
    with CompileCounter() as seen:
        _soak(engine, base, rng, 200)
        probes = [base[:cut] + base[200:204] for cut in (17, 40, 64, 100)]
        got = [_greedy(engine, p, 6) for p in probes]
    assert seen.n == 0
    stats = engine.kv_stats()
    assert stats["prefix_hits"] > 0 and sum(r.cached_tokens for r in got) > 0
    assert (stats["pages_in_use"], stats["pages_reserved"], stats["snapshots_in_use"]) == (0, 0, 0)
    assert stats["pages_free"] == stats["pages_total"]
    perf = engine.perf_stats()
    assert (perf.recompiles_same, perf.recompiles_diff) == (0, 0)
    # test_hybrid's engine (DENSE there), every token computed
    cold = engines(root, max_seq_len=512, prefill_buckets=(128,), batch_buckets=(1, 4),
                   kv_cache_tokens=2048)  # fmt: skip
    want = [_greedy(cold, p, 6, cache_prompt=False).token_ids for p in probes]
    assert [r.token_ids for r in got] == want
