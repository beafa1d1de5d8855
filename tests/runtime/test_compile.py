"""Graph reuse: the compile cache, recompile classification, hooks, strict mode, stats.

Compiles are observed independently through jax.monitoring listeners registered here, not
only through jaxinfer's own counters.
"""

import json
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from support.compiles import CompileCounter
from support.models import model_path

import jaxinfer
from jaxinfer.runtime.compile import RecompileError

STORIES = "stories260K-gguf/stories260K.gguf"


def load(**kw):
    """One set of shapes for every engine here. No executable store: these tests watch what
    one engine compiles (test_store.py covers what loads)."""
    kw.setdefault("compile_cache_dir", None)
    kw.setdefault("max_seq_len", 256)
    kw.setdefault("prefill_buckets", (16, 64))
    kw.setdefault("batch_buckets", (1, 2))
    return jaxinfer.load(model_path(STORIES), **kw)


@pytest.fixture(scope="module")
def warm():
    engine = load(strict=True)
    report = engine.warmup(progress=False)
    assert set(report) == {"cache", "prefill", "sample", "decode", "score"}
    return engine


def test_warmup_compiles_the_plan_and_counts_no_recompiles(warm):
    """Planned compiles are not recompiles: after warmup the stats read 0 / 0, and the plan
    (cache, decode per batch bucket, prefill per bucket and chunk within the prompt token
    budget of 64, one sample for the most rows a prefill call takes, score per chunk past the
    smallest) is exactly what was compiled."""
    plan = warm.compile_plan()
    # batch buckets (1, 2), chunks (16, 64): cache 1 + decode 2 + prefill 3 + sample 1 + score 1
    assert [(p.program, p.batch, p.tokens) for p in plan] == [
        ("cache", 0, 0), ("decode", 1, 0), ("decode", 2, 0), ("prefill", 1, 16),
        ("prefill", 1, 64), ("prefill", 2, 16), ("sample", 2, 0), ("score", 1, 64),
    ]  # fmt: skip
    assert "chunk.tokens i32[2,16]" in plan[5].args and "chunk.view.table i32[2,2]" in plan[5].args
    stats = warm.perf_stats()
    assert (
        stats.warmup_programs
        == len(plan)
        == sum(len(v) for v in warm.compile_cache.entries().values())
    )
    text = str(stats)
    assert "recompiles = 0 / 0 (same shape) / (changed shape)" in text
    assert re.search(rf"compiles = {len(plan)} programs \(warmup, [\d.]+ s\) \+ 0 outside", text)


def test_default_plan_of_stories_is_small():
    """stories260K with default settings (context 2048): no program depends on the context,
    so the plan is cache + 4 decode + 12 prefill (B x T <= 512 for chunks 8, 32, 128, 512) +
    1 sample + 3 score programs (chunks past the smallest): 21, each saying what it serves."""
    engine = jaxinfer.load(model_path(STORIES))
    plan = engine.compile_plan()
    assert engine.max_seq_len == 2048 and len(plan) == 21
    assert [p.tokens for p in plan if p.program == "score"] == [32, 128, 512]
    assert all(p.why for p in plan)


def test_only_the_sample_programs_hold_the_sampler(warm):
    """The prompt chunk buckets return logits and carry no sampler (about 40% of a prefill
    program's HLO, which XLA keeps in memory per loaded executable): it is in the one `sample`
    program, and in the decode loop, which samples every step."""

    def texts(name):
        return [c.as_text() for c in warm.compile_cache.executables(name)]

    def has_sampler(text):
        return "jit(sample)/" in text and "threefry" in text

    assert len(texts("prefill")) == 3 and not any(map(has_sampler, texts("prefill")))
    assert len(texts("sample")) == 1 and all(map(has_sampler, texts("sample")))
    assert all(map(has_sampler, texts("decode")))


def test_steady_state_compiles_nothing(warm):
    """200+ decode steps, prompts of many lengths, changing sampling values: no compile."""
    warm.reset_perf()
    with CompileCounter() as seen:
        r = warm.generate([1], max_new_tokens=230, temperature=0, ignore_eos=True)
        assert len(r.token_ids) == 230
        for n, length in enumerate([1, 2, 7, 16, 17, 40, 64, 65, 100, 150, 200]):
            prompt = [1] + [(13 * i) % 500 + 3 for i in range(length - 1)]
            warm.generate(
                prompt, max_new_tokens=8 + n, temperature=0.1 * n, top_k=n, top_p=1 - 0.05 * n,
                min_p=0.01 * n, repeat_penalty=1 + 0.1 * n, presence_penalty=0.1 * n,
                frequency_penalty=0.05 * n, seed=n,
            )  # fmt: skip
        warm.generate(["Once upon", "a time there"], max_new_tokens=20, temperature=0.7)
        warm.logits([1, 2, 3, 4, 5])
    assert seen.n == 0
    stats = warm.perf_stats()
    assert stats.untracked_compiles == 0
    assert stats.graphs_reused > 0


def test_graphs_reused_counts_every_call(warm):
    """One request = its prefill chunks, the draw of its first token and its decode calls,
    all served from the cache."""
    warm.generate([1] * 20, max_new_tokens=40, temperature=0, ignore_eos=True)  # cache in place
    warm.reset_perf()
    warm.generate([1] * 20, max_new_tokens=40, temperature=0, ignore_eos=True)
    prefill_calls, sample_calls = 1, 1  # 20 tokens fit one 64-token chunk
    decode_calls = -(-(40 - 1) // warm.decode_chunk)  # the first token comes from prefill
    assert warm.decode_chunk == 64 and decode_calls == 1
    assert warm.perf_stats().graphs_reused == prefill_calls + sample_calls + decode_calls


def test_new_bucket_is_one_changed_shape_event():
    engine = load()
    events = []
    engine.on_recompile(events.append)
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)  # prefill chunk 16
    assert events == []  # first compiles are not recompiles
    with CompileCounter() as seen:
        engine.generate([1] * 40, max_new_tokens=4, temperature=0)  # chunk 64: new bucket
    assert seen.n == 1
    (event,) = events
    assert event.program == "prefill" and event.shape_changed and not event.sharding_changed
    assert "chunk.tokens: i32[1,16] -> i32[1,64]" in event.reason
    assert (event.n_same, event.n_diff) == (0, 1)
    assert event.nodes > 100 and event.stages == 1 and event.compile_seconds > 0


def test_cleared_cache_gives_same_shape_events():
    engine = load()
    engine.generate([1] * 10, max_new_tokens=20, temperature=0)
    events = []
    engine.on_recompile(events.append)
    engine.compile_cache.clear()
    assert engine.compile_cache.size == 0
    engine.generate([1] * 10, max_new_tokens=20, temperature=0)
    assert {e.program for e in events} == {"prefill", "sample", "decode"}
    assert all(not e.shape_changed and e.reason == "cache cleared" for e in events)
    assert events[-1].n_same == len(events) and events[-1].n_diff == 0
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff) == (len(events), 0)


def test_capacity_one_alternating_shapes_evicts():
    """The cache itself (the engine never sizes it below its plan): with room for one
    executable, two alternating shapes evict each other: same-shape recompiles."""
    from jaxinfer.runtime.compile import CompileCache

    cache = CompileCache(capacity=1)
    ctx = cache.context(static="toy", layout=("single",), names=[], fixed=())
    events = []
    handle = cache.on_recompile(events.append)

    def double(x):
        return 2 * x

    small, large = jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32)
    for _ in range(2):
        cache.get("double", ctx, double, (small,))
        cache.get("double", ctx, double, (large,))
    # (4,) first, (8,) changed shape, then each one evicted the other
    assert [e.shape_changed for e in events] == [True, False, False]
    assert "x: f32[4] -> f32[8]" in events[0].reason
    assert all("evicted (cache capacity 1)" in e.reason for e in events[1:])
    assert (events[-1].n_same, events[-1].n_diff) == (2, 1)
    handle.remove()
    cache.get("double", ctx, double, (small,))
    assert len(events) == 3 and cache.n_same == 3


def test_cache_smaller_than_the_plan_is_refused():
    with pytest.raises(jaxinfer.JaxinferError) as e:
        load(compile_cache_size=2)
    assert "compile_cache_size = 2 is below the 8 programs of the compile plan" in str(e.value)


@pytest.fixture(scope="module")
def strict():
    """A strict engine of its own, for the tests that clear or re-warm it."""
    engine = load(strict=True)
    engine.warmup(progress=False)
    return engine


@pytest.mark.slow
def test_strict_mode_raises_after_warmup_and_non_strict_goes_on(strict):
    strict.compile_cache.clear()
    with pytest.raises(RecompileError) as e:
        strict.generate([1, 2, 3], max_new_tokens=4, temperature=0)
    assert "cache cleared" in str(e.value) and isinstance(e.value, jaxinfer.JaxinferError)
    assert strict.kv_stats()["pages_in_use"] == 0  # the refused request gave its pages back
    strict.warmup(progress=False)  # strict engines recover by warming up again
    assert strict.generate([1], max_new_tokens=4, temperature=0).token_ids
    relaxed = load()
    relaxed.warmup(progress=False)
    relaxed.compile_cache.clear()
    assert relaxed.generate([1, 2, 3], max_new_tokens=4, temperature=0).token_ids


@pytest.mark.slow
def test_strict_from_environment(monkeypatch):
    monkeypatch.setenv("JAXINFER_STRICT", "1")
    engine = load()
    engine.warmup(progress=False)
    engine.compile_cache.clear()
    with pytest.raises(RecompileError):
        engine.generate([1], max_new_tokens=4, temperature=0)


def test_submit_on_an_engine_without_slots_stays_in_the_plan(strict):
    """generate(), submit() and streaming share one loop and one plan: a strict, warmed
    engine loaded without slots serves submit() with nothing compiled."""
    with CompileCounter() as seen:
        request = strict.submit([1], max_new_tokens=20, temperature=0, ignore_eos=True)
        pieces = list(strict.submit("Once upon", max_new_tokens=9, stream=True).stream())
        assert len(request.result().token_ids) == 20 and pieces[-1].finish_reason
    assert seen.n == 0


def test_untracked_compiles_are_counted_and_refused_in_strict_mode(strict):
    """An eager op during generation (here from a hook) compiles outside the cache: counted,
    and in strict mode after warmup refused."""
    engine = load()
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)
    handle = engine.on_recompile(lambda e: jax.block_until_ready(jnp.arange(11) * 3 + 1))
    engine.generate([1] * 40, max_new_tokens=4, temperature=0)  # new bucket -> hook runs
    assert engine.perf_stats().untracked_compiles >= 1
    handle.remove()
    jax.block_until_ready(jnp.arange(13) * 2)  # outside any engine call: not attributed
    before = strict.perf_stats().untracked_compiles
    strict.generate([1], max_new_tokens=4, temperature=0)
    assert strict.perf_stats().untracked_compiles == before
    # A consumer's own eager ops between stream pieces are not the engine's.
    for piece in strict.generate([1], max_new_tokens=20, temperature=0, stream=True):
        jax.block_until_ready(jnp.arange(len(piece.token_ids) + 17) * 5)
    assert strict.perf_stats().untracked_compiles == before
    # An eager op inside an engine call (a user hook run by the scheduler's step) raises.
    original = strict._scheduler.step

    def step_with_an_eager_op(deliver):
        jax.block_until_ready(jnp.arange(19) * 7)
        return original(deliver)

    strict._scheduler.step = step_with_an_eager_op
    try:
        with pytest.raises(RecompileError) as e:
            strict.generate([1], max_new_tokens=4, temperature=0)
        assert "outside the compile cache" in str(e.value)
    finally:
        strict._scheduler.step = original


def test_failing_hook_does_not_stop_generation(caplog):
    engine = load()
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)

    def bad_hook(event):
        raise RuntimeError("boom")

    engine.on_recompile(bad_hook)
    r = engine.generate([1] * 40, max_new_tokens=4, temperature=0)
    assert len(r.token_ids) == 4
    assert any("raised" in rec.getMessage() and "boom" in str(rec.exc_info[1])
               for rec in caplog.records if rec.exc_info)  # fmt: skip


def test_recompile_log_line(caplog):
    engine = load()
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)
    with caplog.at_level("DEBUG", logger="jaxinfer.compile"):
        engine.generate([1] * 40, max_new_tokens=4, temperature=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recompile:")]
    assert re.fullmatch(
        r"recompile: prefill nodes = \d+ \(shape changed = 1\), stages = 1, n_same = 0, "
        r"n_diff = 1: chunk.tokens: i32\[1,16\] -> i32\[1,64\]",
        lines[0],
    )


def test_perf_stats_lines_parse(warm):
    warm.generate("Once upon a time", max_new_tokens=10, temperature=0)
    text = str(warm.perf_stats())
    rate = r" +[\d.]+ ms / +\d+ tokens \( +[\d.]+ ms per token, +[\d.]+ tokens per second\)"
    assert re.search(r"prompt eval time =" + rate, text)
    assert re.search(r"eval time = +[\d.]+ ms / +\d+ tokens", text)
    assert re.search(r"graphs reused = \d+", text)
    m = re.search(r"recompiles = (\d+) / (\d+) \(same shape\) / \(changed shape\)", text)
    stats = warm.perf_stats()
    assert (int(m[1]), int(m[2])) == (stats.recompiles_same, stats.recompiles_diff)
    assert re.search(r"untracked = \d+; persistent cache hits = \d+, misses = \d+", text)


PROCESS = textwrap.dedent(
    """
    import json, sys
    import jaxinfer
    engine = jaxinfer.load(sys.argv[1], max_seq_len=128, prefill_buckets=(16,),
                           batch_buckets=(1,), compile_cache_dir=sys.argv[2],
                           executable_store_mib=0)
    engine.warmup(progress=False)
    ids = engine.generate([1], max_new_tokens=20, temperature=0).token_ids
    s = engine.perf_stats()
    print(json.dumps(dict(programs=s.programs, hits=s.persistent_hits,
                          misses=s.persistent_misses, ids=ids)))
    """
)


@pytest.mark.slow
def test_without_a_store_a_second_process_hits_the_persistent_cache(tmp_path):
    def run():
        out = subprocess.run(
            [sys.executable, "-c", PROCESS, str(model_path(STORIES)), str(tmp_path / "xla")],
            capture_output=True, text=True, check=True, timeout=300,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["misses"] >= first["programs"] > 0
    assert second["misses"] == 0 and second["hits"] >= second["programs"]
    assert second["ids"] == first["ids"]


@pytest.mark.slow
def test_default_buckets_serve_every_prompt_length_with_nothing_compiled():
    """Default chunks (8, 32, 128, 512) on a 512 context: prompts of every length, chunked
    and padded, stay inside the warmed plan (strict mode stays quiet)."""
    engine = jaxinfer.load(model_path(STORIES), max_seq_len=512, batch_buckets=(1,), strict=True)
    engine.warmup(progress=False)
    with CompileCounter() as seen:
        for n in (1, 8, 9, 31, 33, 129, 130, 500, 511):
            prompt = [1] + [(7 * i) % 500 + 3 for i in range(n - 1)]
            r = engine.generate(prompt, max_new_tokens=1, temperature=0)
            logits = engine.logits(prompt)
            assert int(logits[-1].argmax()) == r.token_ids[0]
        assert len(engine.logits([1] * 512)) == 512  # a whole context may be scored
    assert seen.n == 0
