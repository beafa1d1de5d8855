"""Log-probabilities: each generated token's and its k best, from the sampling programs on the
device, against a float64 log-softmax of independent logits (the tiny-random fixtures'
transformers float64 run, and a NumPy float64 forward of stories260K); the same through
speculation, through prompt scoring (echo), and with a new k compiling nothing."""

import json

import numpy as np
import pytest
from support import reference
from support.models import STORIES_HF, model_path

from jaxinfer.errors import RequestError

# float32 log-probabilities against float64 ones: the fixtures' float32-vs-float64 logit
# spread is up to 4e-4 (tiny-random/README.md), and a log-softmax adds its lse's error once
LOGPROB_ATOL = 1e-3
FIXTURES = {
    "qwen3_moe": "tiny-random/qwen3_moe_e8k2_bpe",
    "qwen3_5": "tiny-random/qwen3_5_l3f1_dense_mtp",
    "mixtral": "tiny-random/mixtral_e8k2",
}
OPTS = dict(max_seq_len=512, prefill_buckets=(128,), batch_buckets=(1, 4))


def log_softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def check(lp, want: np.ndarray, k: int) -> None:
    """A TokenLogprob against the float64 log-probabilities of its position."""
    assert lp.logprob == pytest.approx(want[lp.id], abs=LOGPROB_ATOL)
    order = np.argsort(-want, kind="stable")
    margin = np.sort(want)[::-1]
    ids = [i for i, _ in lp.top]
    assert len(ids) == k
    for rank, (i, v) in enumerate(lp.top):
        assert v == pytest.approx(want[i], abs=LOGPROB_ATOL)
        # the order is the reference's wherever the reference's own gap exceeds the noise
        if rank + 1 < len(margin) and margin[rank] - margin[rank + 1] > 2 * LOGPROB_ATOL:
            assert i == order[rank], (rank, ids, order[:k].tolist())


@pytest.mark.parametrize(
    "kind", [k if k == "qwen3_moe" else pytest.param(k, marks=pytest.mark.slow) for k in FIXTURES]
)
def test_first_token_logprobs_match_the_fixtures_float64_logits(engines, kind):
    root = model_path(FIXTURES[kind])
    ref = json.loads((root / "reference.json").read_text())
    engine = engines(root, **OPTS)
    for prompt in ref["prompts"]:
        want = log_softmax64(prompt["last_logits_f64"])
        r = engine.generate(prompt["ids"], max_new_tokens=2, temperature=0, logprobs=5)
        assert r.token_ids[0] == prompt["greedy_ids"][0]
        assert len(r.logprobs) == len(r.token_ids)
        check(r.logprobs[0], want, 5)


@pytest.fixture(scope="module")
def stories_reference():
    from safetensors.numpy import load_file

    root = model_path(STORIES_HF)
    weights = load_file(str(root / "model.safetensors"))
    config = json.loads((root / "config.json").read_text())
    return weights, config


def test_every_generated_token_matches_a_float64_forward(engines, stories_reference):
    """stories260K greedy and sampled: each token's logprob and top 20 against the NumPy
    float64 forward over the prompt and the tokens before it (raw logits: no penalty,
    temperature or filter changes them)."""
    engine = engines(model_path(STORIES_HF), **OPTS)
    weights, config = stories_reference
    prompt = engine.tokenize("Once upon a time, there was a")
    for params in (dict(temperature=0), dict(temperature=1.3, top_k=5, repeat_penalty=1.3, seed=1)):
        r = engine.generate(prompt, max_new_tokens=12, logprobs=20, **params)
        assert len(r.logprobs) == len(r.token_ids) == 12
        logits = reference.forward(weights, config, prompt + r.token_ids[:-1])  # [T, V]
        want = log_softmax64(logits[len(prompt) - 1 :])
        for t, lp in enumerate(r.logprobs):
            assert lp.id == r.token_ids[t]
            check(lp, want[t], 20)


def test_prompt_logprobs_match_the_generated_ones_and_a_new_k_compiles_nothing(engines, compiles):
    """Echo's prompt logprobs (the scoring program, float64 on the host) equal the
    generated tokens' (the decode program) over the same text; k changes compile nothing."""
    engine = engines(model_path(STORIES_HF), **OPTS)
    engine.generate("Once", max_new_tokens=4, temperature=0, logprobs=1)  # warm the programs
    with compiles() as seen:
        r = engine.generate("Once upon a time", max_new_tokens=10, temperature=0, logprobs=7)
        engine.generate("Once upon a time", max_new_tokens=10, temperature=0, logprobs=0)
    assert seen.n == 0
    scored = engine.prompt_logprobs(r.prompt_ids + r.token_ids, 7)
    assert scored[0] is None and len(scored) == len(r.prompt_ids) + len(r.token_ids)
    for a, b in zip(r.logprobs, scored[len(r.prompt_ids) :], strict=True):
        assert a.id == b.id and a.logprob == pytest.approx(b.logprob, abs=2e-4)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert all(lp.top == () for lp in engine.generate("Once", logprobs=0).logprobs)
    assert engine.generate("Once", max_new_tokens=2).logprobs is None


@pytest.mark.slow
def test_speculative_tokens_carry_their_logprobs(engines):
    """n-gram drafts accepted in bulk carry the same logprobs as the plain decode."""
    plain = engines(model_path(STORIES_HF), **OPTS)
    spec = engines(model_path(STORIES_HF), speculative="ngram", draft_tokens=4, **OPTS)
    prompt = "Once upon a time, there was a little girl. Once upon a time, there was a little"
    a = plain.generate(prompt, max_new_tokens=24, temperature=0, logprobs=3)
    b = spec.generate(prompt, max_new_tokens=24, temperature=0, logprobs=3)
    assert b.token_ids == a.token_ids
    assert spec.perf_stats().accepted_tokens > 0
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.id == y.id and x.logprob == pytest.approx(y.logprob, abs=2e-4)
        assert [i for i, _ in x.top] == [i for i, _ in y.top]


def test_bad_logprobs_values_are_refused(engines):
    engine = engines(model_path(STORIES_HF), **OPTS)
    for bad in (-1, 21, 2.5, True, "5"):
        with pytest.raises(RequestError, match="logprobs"):
            engine.generate("Once", logprobs=bad)
    with pytest.raises(RequestError, match="k = 21"):
        engine.prompt_logprobs([1, 2, 3], 21)
