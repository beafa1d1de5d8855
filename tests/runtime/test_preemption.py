"""Time-sliced slots: with every slot busy, another client's request takes the slot of one that
has decoded for its time slice, which resumes later exactly where it was (the same tokens,
sampled or greedy, under a grammar, on a model that carries state), with nothing compiled;
one client's own requests never preempt each other.

The reference is the engine with preemption off (time_slice_ms=0): preemption must change
when tokens are computed, never which."""

import json

import jsonschema
import pytest
from support.compiles import CompileCounter
from support.models import model_path
from support.schemas import PERSON

import jaxinfer

STORIES = "stories260K-gguf/stories260K.gguf"
HYBRID = "tiny-random/qwen3_5_l3f1_dense_mtp"
OPTS = dict(
    max_seq_len=512, prefill_buckets=(16, 64), kv_cache_tokens=2048, page_size=16, slots=2,
)  # fmt: skip
# long enough that the late request overtakes them even when a loaded machine makes the
# slice (4x its prefill's calls) long: 300 tokens failed twice in full default-tier runs
LONG = dict(max_new_tokens=460, ignore_eos=True)


def _prompts(engine) -> list[list[int]]:
    text = "Once upon a time, there was a little girl who loved to play. " * 4
    ids = engine.tokenize(text)
    return [ids[: 20 + 7 * i] for i in range(4)]


def _run(engine, prompts, params, late=None):
    """Two long requests of their own clients fill both slots; once both decode, a third
    client's short request arrives (`late`: its prompt). The results, and whether the late one
    finished while both long ones still ran."""
    requests = [engine.submit(p, sampling=s) for p, s in zip(prompts, params, strict=True)]
    while not all(r.state.token_ids for r in requests):
        engine.step()
    if late is None:
        return [r.result() for r in requests], None
    short = engine.submit(late, max_new_tokens=4, temperature=0)
    short.result()
    overtook = not any(r.done for r in requests)
    return [r.result() for r in [*requests, short]], overtook


@pytest.fixture(scope="module")
def stories():
    engines = {}
    for name, ms in (("off", 0), ("on", 1)):
        engine = jaxinfer.load(model_path(STORIES), time_slice_ms=ms, strict=True, **OPTS)
        engine.warmup(progress=False)
        engines[name] = engine
    return engines


@pytest.mark.parametrize("cache", [True, False])
def test_preempted_requests_resume_exactly_and_the_late_client_overtakes(stories, cache):
    """Greedy and seeded sampling: the late request (a third client) runs at once, the one it
    preempted resumes, and every token equals the run without preemption."""
    prompts = _prompts(stories["on"])
    params = [
        jaxinfer.SamplingParams(temperature=0, cache_prompt=cache, **LONG),
        jaxinfer.SamplingParams(temperature=0.9, seed=7, cache_prompt=cache, **LONG),
    ]
    want, _ = _run(stories["off"], prompts[:2], params)
    before = stories["on"].perf_stats().preempted
    with CompileCounter() as seen:
        got, overtook = _run(stories["on"], prompts[:2], params, late=prompts[3])
    assert overtook, "the late request waited for a long one to finish"
    assert stories["on"].perf_stats().preempted > before
    assert [r.token_ids for r in got[:2]] == [r.token_ids for r in want]
    assert [r.text for r in got[:2]] == [r.text for r in want]
    assert got[2].token_ids == stories["off"].generate(
        prompts[3], max_new_tokens=4, temperature=0).token_ids  # fmt: skip
    assert seen.n == 0
    stats = stories["on"].kv_stats()
    assert stats["pages_in_use"] == 0


def test_logprobs_and_stop_strings_survive_preemption(stories):
    """A preempted request keeps its log-probabilities (one per token, the same values) and
    its stop-string state."""
    prompts = _prompts(stories["on"])
    params = [
        jaxinfer.SamplingParams(temperature=0, logprobs=3, **LONG),
        jaxinfer.SamplingParams(temperature=0, stop=("zzz-never",), **LONG),
    ]
    want, _ = _run(stories["off"], prompts[:2], params)
    got, overtook = _run(stories["on"], prompts[:2], params, late=prompts[2])
    assert overtook
    for g, w in zip(got[:2], want, strict=True):
        assert g.token_ids == w.token_ids and g.text == w.text
    assert len(got[0].logprobs) == len(got[0].token_ids)
    for g, w in zip(got[0].logprobs, want[0].logprobs, strict=True):
        assert g.id == w.id and [t for t, _ in g.top] == [t for t, _ in w.top]
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


def test_a_grammar_request_resumes_in_its_grammar(stories):
    """A request under a JSON schema is preempted mid-object and still ends valid."""
    prompts = _prompts(stories["on"])
    schema = jaxinfer.SamplingParams(temperature=0, json_schema=PERSON, max_new_tokens=120)
    params = [schema, jaxinfer.SamplingParams(temperature=0, **LONG)]
    want, _ = _run(stories["off"], prompts[:2], params)
    got, overtook = _run(stories["on"], prompts[:2], params, late=prompts[3])
    assert overtook
    assert got[0].token_ids == want[0].token_ids
    if got[0].finish_reason == "stop":
        jsonschema.validate(json.loads(got[0].text), PERSON)


def test_a_longer_job_that_preempts_nobody_does_not_hold_up_a_shorter_one(stories):
    """Two long requests fill both slots; a third client's longer job (no running request
    gives way to it: the shorter job first) queues, then a fourth client's short request: the
    short one still takes a slot at once, not after the longer job; all end with the tokens
    of the engine without preemption."""
    prompts = _prompts(stories["on"])
    params = [jaxinfer.SamplingParams(temperature=0, **LONG)] * 2
    longer = jaxinfer.SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True)
    want = stories["off"].generate(prompts[2], sampling=longer).token_ids
    engine = stories["on"]
    requests = [engine.submit(p, sampling=s) for p, s in zip(prompts[:2], params, strict=True)]
    while not all(r.state.token_ids for r in requests):
        engine.step()
    waiting = engine.submit(prompts[2], sampling=longer)
    short = engine.submit(prompts[3], max_new_tokens=4, temperature=0)
    short.result()
    assert not any(r.done for r in requests), "the short request queued behind the longer job"
    assert not waiting.state.token_ids  # it still waits: nobody gave way to it
    assert waiting.result().token_ids == want
    assert short.result().token_ids == stories["off"].generate(
        prompts[3], max_new_tokens=4, temperature=0).token_ids  # fmt: skip
    for r in requests:  # the request that gave way may still run after `waiting` ends
        r.result()
    assert engine.kv_stats()["pages_in_use"] == 0


def test_a_clients_own_requests_never_preempt_each_other(stories):
    """A generate() list (one client) through 2 slots: no preemption, however long each runs."""
    engine = stories["on"]
    before = engine.perf_stats().preempted
    out = engine.generate(_prompts(engine), max_new_tokens=40, ignore_eos=True, temperature=0)
    assert engine.perf_stats().preempted == before
    assert all(len(r.token_ids) == 40 for r in out)


def test_equal_clients_are_served_in_order_not_in_turns(stories):
    """Separate clients with the same max_new_tokens: a waiting one never has fewer tokens to
    make than a running one, so none is preempted (taking turns would only delay them all)."""
    engine = stories["on"]
    before = engine.perf_stats().preempted
    requests = [engine.submit(p, temperature=0, **LONG) for p in _prompts(engine)]
    assert all(len(r.result().token_ids) == LONG["max_new_tokens"] for r in requests)
    assert engine.perf_stats().preempted == before


@pytest.mark.slow  # four engines of the hybrid fixture: the default tier's time budget
@pytest.mark.parametrize("snapshots", [None, 0])
def test_a_model_with_state_resumes_exactly(snapshots):
    """The hybrid fixture (Gated DeltaNet state, MTP head): the preempted request's state is
    recomputed (from a snapshot where one is kept), and its tokens equal the run without
    preemption."""
    root = model_path(HYBRID)
    ids = json.loads((root / "reference.json").read_text())["prompts"][3]["ids"]
    prompts = [(ids * 4)[: 30 + 9 * i] for i in range(4)]
    params = [jaxinfer.SamplingParams(temperature=0, **LONG)] * 2
    runs = {}
    for ms in (0, 1):
        engine = jaxinfer.load(root, time_slice_ms=ms, prefix_snapshots=snapshots, **OPTS)
        runs[ms] = _run(engine, prompts[:2], params, late=prompts[3])
        if ms:
            assert engine.perf_stats().preempted > 0
            assert engine.kv_stats()["snapshots_in_use"] == 0
    (want, _), (got, overtook) = runs[0], runs[1]
    assert overtook
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_time_slice_is_checked():
    with pytest.raises(jaxinfer.JaxinferError, match="time_slice_ms"):
        jaxinfer.EngineOptions(time_slice_ms=-1)
