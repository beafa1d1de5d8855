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
from conftest import model_path

import jaxinfer
from jaxinfer.compile import RecompileError

STORIES = "stories260K-gguf/stories260K.gguf"


class CompileCounter:
    """Counts XLA backend compiles seen by jax.monitoring while active."""

    def __init__(self):
        self.n = 0

    def _listener(self, name, _secs, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def load(**kw):
    kw.setdefault("max_seq_len", 256)
    kw.setdefault("prefill_buckets", (16, 64))
    kw.setdefault("batch_buckets", (1, 2))
    return jaxinfer.load(model_path(STORIES), **kw)


@pytest.fixture(scope="module")
def warm():
    engine = load(strict=True)
    report = engine.warmup(progress=False)
    assert set(report) == {"cache", "prefill", "decode", "score"}
    return engine


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
    """One request = its prefill chunks + its decode calls, all served from the cache."""
    warm.generate([1] * 20, max_new_tokens=40, temperature=0, ignore_eos=True)  # cache in place
    warm.reset_perf()
    warm.generate([1] * 20, max_new_tokens=40, temperature=0, ignore_eos=True)
    prefill_calls = 1  # 20 tokens fit one 64-token chunk
    decode_calls = -(-(40 - 1) // warm.decode_chunk)  # the first token comes from prefill
    assert warm.decode_chunk == 64 and decode_calls == 1
    assert warm.perf_stats().graphs_reused == prefill_calls + decode_calls


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
    assert "tokens: i32[1,16] -> i32[1,64]" in event.reason
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
    assert {e.program for e in events} == {"prefill", "decode"}
    assert all(not e.shape_changed and e.reason == "cache cleared" for e in events)
    assert events[-1].n_same == len(events) and events[-1].n_diff == 0
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff) == (len(events), 0)


def test_capacity_one_alternating_buckets_evicts():
    engine = load(compile_cache_size=1)
    assert engine.compile_cache.capacity == 1
    events = []
    handle = engine.on_recompile(events.append)
    for _ in range(2):
        engine.logits([1] * 10)  # score with T = 16
        engine.logits([1] * 40)  # score with T = 64
    # T=16 first, T=64 changed shape, then each one evicted the other
    assert [e.shape_changed for e in events] == [True, False, False]
    assert all("evicted (cache capacity 1)" in e.reason for e in events[1:])
    assert (events[-1].n_same, events[-1].n_diff) == (2, 1)
    handle.remove()
    engine.logits([1] * 10)
    assert len(events) == 3


def test_strict_mode_raises_after_warmup_and_non_strict_goes_on(warm):
    warm.compile_cache.clear()
    with pytest.raises(RecompileError) as e:
        warm.generate([1, 2, 3], max_new_tokens=4, temperature=0)
    assert "cache cleared" in str(e.value) and isinstance(e.value, jaxinfer.JaxinferError)
    warm.warmup(progress=False)  # strict engines recover by warming up again
    assert warm.generate([1], max_new_tokens=4, temperature=0).token_ids
    relaxed = load()
    relaxed.warmup(progress=False)
    relaxed.compile_cache.clear()
    assert relaxed.generate([1, 2, 3], max_new_tokens=4, temperature=0).token_ids


def test_strict_from_environment(monkeypatch):
    monkeypatch.setenv("JAXINFER_STRICT", "1")
    assert load().strict


def test_untracked_compiles_are_counted_and_refused_in_strict_mode(warm):
    """An eager op during generation (here from a hook) compiles outside the cache."""
    engine = load()
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)
    handle = engine.on_recompile(lambda e: jax.block_until_ready(jnp.arange(11) * 3 + 1))
    engine.generate([1] * 40, max_new_tokens=4, temperature=0)  # new bucket -> hook runs
    assert engine.perf_stats().untracked_compiles >= 1
    handle.remove()
    jax.block_until_ready(jnp.arange(13) * 2)  # outside any engine call: not attributed
    before = warm.perf_stats().untracked_compiles
    warm.generate([1], max_new_tokens=4, temperature=0)
    assert warm.perf_stats().untracked_compiles == before


def test_failing_hook_does_not_stop_generation(caplog):
    engine = load()
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)

    def bad_hook(event):
        raise RuntimeError("boom")

    engine.on_recompile(bad_hook)
    r = engine.generate([1] * 40, max_new_tokens=4, temperature=0)
    assert len(r.token_ids) == 4
    assert any("boom" in rec.getMessage() or rec.exc_info for rec in caplog.records)


def test_recompile_log_line(caplog):
    engine = load()
    engine.generate([1] * 10, max_new_tokens=4, temperature=0)
    with caplog.at_level("DEBUG", logger="jaxinfer.compile"):
        engine.generate([1] * 40, max_new_tokens=4, temperature=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recompile:")]
    assert re.fullmatch(
        r"recompile: prefill nodes = \d+ \(shape changed = 1\), stages = 1, n_same = 0, "
        r"n_diff = 1: tokens: i32\[1,16\] -> i32\[1,64\]",
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
                           batch_buckets=(1,), compile_cache_dir=sys.argv[2])
    engine.warmup(progress=False)
    ids = engine.generate([1], max_new_tokens=20, temperature=0).token_ids
    s = engine.perf_stats()
    print(json.dumps(dict(programs=s.programs, hits=s.persistent_hits,
                          misses=s.persistent_misses, ids=ids)))
    """
)


def test_second_process_loads_every_program_from_disk(tmp_path):
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


def test_default_buckets_prompt_chunks_never_outgrow_the_cache():
    """A 130-token prompt with the default chunks (32, 128, 512) and a 256-position cache:
    the chunk is capped at the cache, so warmup covered it (strict mode stays quiet)."""
    engine = jaxinfer.load(model_path(STORIES), max_seq_len=512, batch_buckets=(1,), strict=True)
    engine.warmup(progress=False)
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(129)]
    with CompileCounter() as seen:
        r = engine.generate(prompt, max_new_tokens=20, temperature=0)
        logits = engine.logits(prompt)
    assert seen.n == 0 and len(r.token_ids) == 20
    assert int(logits[-1].argmax()) == r.token_ids[0]
