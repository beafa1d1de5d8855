"""Parallel slots (continuous batching): every request's result equals running it alone;
nothing compiles as requests come and go; cancellation and bad requests touch no one else."""

import random

import pytest
from support.compiles import CompileCounter
from support.models import model_path

import jaxinfer

STORIES = "stories260K-gguf/stories260K.gguf"
rng = random.Random(0)
PROMPTS = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in
           [0, 299, 17, 64, 5, 150, 33, 250, 1, 90, 120, 63]]  # fmt: skip
MAX_NEW = [40, 5, 33, 12, 60, 8, 21, 3, 50, 17, 1, 28]


def load(**kw):
    """One row or four slots over the same pool, so that the one-row programs are shared."""
    return jaxinfer.load(
        model_path(STORIES), max_seq_len=512, prefill_buckets=(16, 64), batch_buckets=(1,),
        kv_cache_tokens=2048, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def alone():
    engine = load()
    return [
        engine.generate(p, max_new_tokens=n, temperature=0).token_ids
        for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]


@pytest.fixture(scope="module")
def slots4():
    engine = load(slots=4, strict=True)
    engine.warmup(progress=False)
    return engine


def test_twelve_requests_through_four_slots_equal_alone_and_compile_nothing(slots4, alone):
    with CompileCounter() as seen:
        requests = [
            slots4.submit(p, max_new_tokens=n, temperature=0)
            for p, n in zip(PROMPTS, MAX_NEW, strict=True)
        ]
        results = [r.result() for r in requests]
    assert seen.n == 0
    assert [r.token_ids for r in results] == alone
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert all(r.time_to_first_token <= r.latency for r in requests)


def test_generate_list_uses_the_slots_in_order(slots4, alone):
    results = slots4.generate(PROMPTS[:6], max_new_tokens=12, temperature=0)
    for r, a, n in zip(results, alone, MAX_NEW[:6], strict=False):
        k = min(12, n)  # greedy: the first k tokens do not depend on max_new_tokens
        assert r.token_ids[:k] == a[:k]


def test_cancel_mid_way_leaves_the_others_unchanged(slots4, alone):
    requests = [
        slots4.submit(p, max_new_tokens=n, temperature=0)
        for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    victim = requests[4]  # 60 new tokens: still running after its first decode call
    while not victim.state.token_ids:
        slots4.step()
    assert not victim.done
    pages = slots4.kv_stats()
    victim.cancel()
    assert slots4.kv_stats()["pages_free"] > pages["pages_free"]  # its pages are back at once
    assert victim.result().finish_reason == "cancelled"
    others = [r.result().token_ids for i, r in enumerate(requests) if i != 4]
    assert others == [a for i, a in enumerate(alone) if i != 4]
    assert alone[4][: len(victim.result().token_ids)] == victim.result().token_ids


def test_bad_request_is_refused_alone(slots4, alone):
    good = slots4.submit(PROMPTS[2], max_new_tokens=MAX_NEW[2], temperature=0)
    with pytest.raises(jaxinfer.RequestError):
        slots4.submit(PROMPTS[3], max_new_tokens=5, temperature=-1)
    with pytest.raises(jaxinfer.RequestError):
        slots4.submit([1] * 600, max_new_tokens=5)
    with pytest.raises(jaxinfer.RequestError) as e:  # with the EOS id: 10 stop ids
        slots4.submit(PROMPTS[3], max_new_tokens=5, stop_tokens=list(range(3, 12)))
    assert "at most 8 stop tokens" in str(e.value)
    for bad in ([3.5], ["x"], [-1], [9999]):
        with pytest.raises(jaxinfer.RequestError):
            slots4.submit(PROMPTS[3], max_new_tokens=5, stop_tokens=bad)
    also_good = slots4.submit(PROMPTS[0], max_new_tokens=MAX_NEW[0], temperature=0)
    assert good.result().token_ids == alone[2] and also_good.result().token_ids == alone[0]


def test_stream_of_a_request(slots4):
    kw = dict(max_new_tokens=30, temperature=0.9, seed=3)
    request = slots4.submit("Once upon a time", **kw)
    other = slots4.submit("The dog", max_new_tokens=20, temperature=0)
    pieces = list(request.stream())
    assert "".join(p.text for p in pieces) == request.result().text
    assert [t for p in pieces for t in p.token_ids] == request.result().token_ids
    assert other.result().token_ids


@pytest.mark.slow
def test_same_under_layer_split_on_two_devices(alone):
    engine = load(slots=4, layout="layer", devices=2)
    requests = [
        engine.submit(p, max_new_tokens=n, temperature=0)
        for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    assert [r.result().token_ids for r in requests] == alone


@pytest.mark.slow
def test_cli_parallel_file(tmp_path, capsys):
    from jaxinfer.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe dog\nLily was\n")
    argv = ["generate", "-m", str(model_path(STORIES)), "-f", str(prompts), "--parallel", "2",
            "-n", "8", "--temp", "0", "-c", "256"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert [line.split("]")[0] for line in out] == ["--- [0", "--- [1", "--- [2"]
    assert "latency p50" in captured.err and "p95" in captured.err


def test_submit_on_an_engine_without_slots():
    from support.models import GOLDEN

    engine = load()
    request = engine.submit([1], max_new_tokens=8, temperature=0)
    assert request.result().token_ids == GOLDEN[:8]
    batch = engine.generate([[1], [1, 403]], max_new_tokens=4, temperature=0)
    assert batch[0].token_ids == GOLDEN[:4] and engine.slots is None


@pytest.mark.slow
def test_reshard_with_slots_keeps_results(alone):
    engine = load(slots=2)
    first = engine.submit(PROMPTS[2], max_new_tokens=MAX_NEW[2], temperature=0)
    assert first.result().token_ids == alone[2]
    engine.reshard("layer", devices=2)
    again = engine.submit(PROMPTS[2], max_new_tokens=MAX_NEW[2], temperature=0)
    assert again.result().token_ids == alone[2]
