"""Fit: the memory plan (runtime/fit.py) against arithmetic written here, and load(fit=True)
end to end: a small memory gives a plan that serves a full context on every slot, too little
is a one-line error, and two fits whose memory differs by 2% compile nothing the second time."""

from __future__ import annotations

import pytest

import jaxinfer
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.options import EngineOptions
from jaxinfer.runtime import fit

MIB = 1 << 20


def need(**kw) -> fit.Need:
    base = dict(weights=100 * MIB, temporaries=10 * MIB, page_bytes=MIB, state_bytes=0,
                rows=2, model_ctx=32768, carries_state=False)  # fmt: skip
    return fit.Need(**{**base, **kw})


def test_bucket_down_is_m_times_a_power_of_two_within_20_percent():
    for n in range(1, 5000):
        b = fit.bucket_down(n)
        assert b <= n and b >= 0.8 * n - 1e-9
        if n >= 8:
            top = b >> (b.bit_length() - 3)
            assert 4 <= top <= 7 and b == top << (b.bit_length() - 3)
    # neighbours within a bucket plan the same count
    assert fit.bucket_down(1000) == fit.bucket_down(1020) == 896


def test_a_plan_that_fits_keeps_the_model_context():
    o = EngineOptions(fit=True, slots=2, page_size=128, fit_target_mib=0)
    # 32768 tokens x 2 slots = 512 pages + the null page, 1 MiB each
    p = fit.plan(o, need(), memory=(100 + 10 + 513) * MIB, source="test")
    assert (p.max_seq_len, p.kv_cache_tokens, p.snapshots, p.gave_up) == (32768, 65536, 0, ())
    assert p.total == (100 + 10 + 513) * MIB
    assert p.options(o).max_seq_len == 32768


def test_the_context_is_cut_to_a_bucket_and_never_below_the_floor():
    o = EngineOptions(fit=True, slots=2, page_size=128, fit_target_mib=24, fit_ctx=4096)
    # room for 300 pages past the weights, temporaries and the null page: 150 a slot,
    # bucketed down to 128 pages = 16384 tokens a slot
    memory = (24 + 100 + 10 + 1 + 300) * MIB
    p = fit.plan(o, need(), memory, "test")
    assert p.max_seq_len == 128 * 128 and p.kv_cache_tokens == 2 * 128 * 128
    assert p.gave_up == ("context (16384 of 32768)",)
    assert p.total <= memory - 24 * MIB
    # 2% more memory: the same plan (the same shapes, the same programs)
    assert fit.plan(o, need(), int(memory * 1.02), "test").max_seq_len == p.max_seq_len
    # below the floor: a one-line error naming it
    with pytest.raises(JaxinferError, match=r"--fit-ctx 4096 on each of 2 slots") as e:
        fit.plan(o, need(), (24 + 100 + 10 + 1 + 60) * MIB, "test")
    assert "\n" not in str(e.value)


def test_a_given_context_is_kept_or_refused():
    o = EngineOptions(fit=True, slots=1, max_seq_len=8192, page_size=128, fit_target_mib=0)
    p = fit.plan(o, need(), (110 + 65) * MIB, "test")  # 64 pages + the null page
    assert p.max_seq_len == 8192 and p.gave_up == ()
    with pytest.raises(JaxinferError, match=r"-c 8192 .* 1 MiB more"):
        fit.plan(o, need(), (110 + 64) * MIB, "test")


def test_below_the_weights_names_the_shortfall():
    o = EngineOptions(fit=True, fit_target_mib=0)
    with pytest.raises(JaxinferError, match=r"need 110 MiB but 80 MiB .* 30 MiB short") as e:
        fit.plan(o, need(), 80 * MIB, "--fit-memory")
    assert "\n" not in str(e.value)


def test_snapshots_go_first_then_the_context():
    # a hybrid: 1 MiB pages, 4 MiB snapshots; by default as many snapshots as the pool's
    # bytes hold (one a page at most): 64 pages -> 16 snapshots
    n = need(state_bytes=4 * MIB, carries_state=True, rows=1)
    o = EngineOptions(fit=True, slots=1, max_seq_len=8192, page_size=128, fit_target_mib=0)
    states = 4 * 3  # the row's, the null state's and a scoring pass's
    full = (110 + states + 65 + 16 * 4) * MIB
    assert fit.plan(o, n, full, "t").snapshots == 16
    p = fit.plan(o, n, full - 10 * MIB, "t")  # 54 MiB: 13 snapshots, bucketed to 12
    assert p.snapshots == 12 and p.gave_up == ("snapshots (12 of 16)",)
    # given snapshots are kept: the context goes instead
    o = EngineOptions(fit=True, slots=1, page_size=128, fit_target_mib=0, prefix_snapshots=16,
                      fit_ctx=1024)  # fmt: skip
    p = fit.plan(o, n, full - 10 * MIB, "t")
    assert p.snapshots == 16 and p.max_seq_len < 8192 + 1 and p.gave_up[-1].startswith("context")


# ---- load(fit=True) ------------------------------------------------------------------------

# 4 KiB of K and V a token (2 layers x 2 x 4 kv heads x 64 x 4 bytes): the model's 32k context
# on 2 slots is 256 MiB of pages, more than the plans below hold
WIDE_CTX = ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=256,
                       vocab_size=512, max_position=32768)  # fmt: skip


@pytest.mark.slow
def test_a_small_memory_serves_a_full_context_on_every_slot(tmp_path):
    e = jaxinfer.load(WIDE_CTX, fit=True, fit_memory_mib=12, fit_target_mib=0, fit_ctx=256,
                      slots=2, compile_cache_dir=tmp_path)  # fmt: skip
    plan = e.fit_plan
    assert plan is not None and plan.gave_up[-1].startswith("context")
    assert 256 <= e.max_seq_len < 32768 and plan.planned <= 12 * MIB
    # the plan's bytes are the engine's own
    mem = e.memory()
    assert (mem["weights"], mem["kv_pool"]) == (plan.weights, plan.kv_pool)
    # every slot at once, each to the full context
    n = e.max_seq_len
    prompts = [[1 + i] * 40 for i in range(2)]
    out = e.generate(prompts, max_new_tokens=n - 40, temperature=0.0, ignore_eos=True)
    assert [len(r.token_ids) for r in out] == [n - 40] * 2


@pytest.mark.slow
def test_two_fits_two_percent_apart_compile_nothing_the_second_time(tmp_path):
    kw = dict(fit=True, fit_target_mib=0, fit_ctx=256, slots=2, compile_cache_dir=tmp_path)
    first = jaxinfer.load(WIDE_CTX, fit_memory_mib=48, **kw)
    first.warmup(progress=False)
    second = jaxinfer.load(WIDE_CTX, fit_memory_mib=49, **kw)
    report = second.warmup(progress=False)
    assert second.max_seq_len == first.max_seq_len
    assert sum(n for n, _ in report.values()) == 0  # every program from the store


def test_fit_below_the_weights_is_a_one_line_error():
    with pytest.raises(JaxinferError, match=r"fit: the weights .* MiB short") as e:
        jaxinfer.load(WIDE_CTX, fit=True, fit_memory_mib=1, fit_target_mib=0)
    assert "\n" not in str(e.value)
