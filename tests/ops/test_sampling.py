"""Sampling: seeds, greedy, and the filters and penalties against a NumPy definition written
from llama.cpp's default sampler chain (common/common.h): penalties, top-k, top-p, min-p on the
untempered logits, temperature last."""

import jax
import numpy as np
import pytest
from support.models import GOLDEN

from jaxinfer import SamplingParams
from jaxinfer.ops.sampling import (
    PENALTY_WINDOW,
    SamplingRows,
    accept,
    argmax,
    sample,
    token_logprobs,
)
from jaxinfer.options import MAX_LOGPROBS

FREE = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def test_same_seed_same_sample_different_seeds_differ(stories_hf):
    kw = dict(max_new_tokens=24, **FREE)
    a = stories_hf.generate("Once upon a time", seed=1, **kw).token_ids
    b = stories_hf.generate("Once upon a time", seed=1, **kw).token_ids
    c = stories_hf.generate("Once upon a time", seed=2, **kw).token_ids
    assert a == b and a != c


def test_temperature_zero_is_greedy(stories_hf):
    r = stories_hf.generate([1], max_new_tokens=32, temperature=0, top_k=5, top_p=0.5, seed=3)
    assert r.token_ids == GOLDEN[:32]
    r = stories_hf.generate([1], max_new_tokens=32, temperature=1.5, top_k=1, seed=3)
    assert r.token_ids == GOLDEN[:32]


def _np_chain(logits, temperature, top_k, top_p, min_p):
    """(tokens kept, their sampling distribution), as llama.cpp's samplers do it in turn:
    top-k, top-p (softmax over the survivors, the shortest prefix reaching p), min-p (logit
    >= max + log(min_p)), all on untempered logits; then softmax(logits / temperature) over
    what is left."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros_like(logits, bool)
    keep[order[: top_k if top_k > 0 else len(logits)]] = True
    if top_p < 1:
        p = np.where(keep, np.exp(logits - logits.max()), 0.0)
        p /= p.sum()
        cum, nucleus = 0.0, np.zeros_like(keep)
        for i in order:
            if not keep[i]:
                break
            nucleus[i] = True
            cum += p[i]
            if cum >= top_p:
                break
        keep &= nucleus
    if min_p > 0:
        keep &= logits >= logits[keep].max() + np.log(min_p)
    z = np.where(keep, logits / temperature, -np.inf)
    want = np.exp(z - z.max())
    return keep, want / want.sum()


def _draw_many(logits, params, B=4096):
    rows = SamplingRows.stack([SamplingRows.row(params, seed, []) for seed in range(B)], B)
    window = np.full((B, PENALTY_WINDOW), -1, np.int32)
    return np.asarray(jax.jit(sample)(np.tile(logits, (B, 1)), window, rows, np.zeros(B, np.int32)))


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (0.7, 0, 0.8, 0.0),
        (2.5, 0, 0.6, 0.0),  # nucleus of the untempered distribution, then a flat draw
        (1.3, 0, 1.0, 0.2),
        (0.4, 0, 1.0, 0.05),  # min-p on untempered logits keeps more than after temperature
        (1.0, 8, 0.9, 0.05),
    ],
)
def test_filters_match_llamacpp_chain(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    V, B = 32, 4096
    logits = rng.normal(size=V).astype(np.float32) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    drawn = _draw_many(logits, params, B)
    allowed, want = _np_chain(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    assert set(drawn.tolist()) <= set(np.flatnonzero(allowed).tolist())
    freq = np.bincount(drawn, minlength=V) / B
    # 4096 draws: a binomial frequency's standard deviation is at most 0.008
    assert np.abs(freq - want).max() < 0.04


@pytest.mark.parametrize(
    "scale, temperature, top_k, top_p, min_p",
    [
        (3.0, 1.0, 40, 0.95, 0.05),  # llama.cpp's defaults
        (3.0, 0.8, 0, 0.9, 0.0),  # a nucleus among the highest 128
        (0.5, 1.0, 0, 0.999, 0.0),  # a nucleus of most of the vocabulary
        (1.0, 1.5, 0, 1.0, 0.0),  # no filter
        (1.0, 1.2, 300, 1.0, 0.0),  # top-k past the highest 128
        (0.5, 0.7, 0, 1.0, 0.01),  # min-p keeping most of the vocabulary
    ],
)
def test_filters_match_llamacpp_chain_over_a_large_vocabulary(
    scale, temperature, top_k, top_p, min_p
):
    """V = 2000: the filters keep a few tokens or most of them. The empirical CDF of 4096
    draws (tokens in descending logit order) against the chain's: by the DKW inequality a
    deviation over 0.04 has probability below 1e-5."""
    rng = np.random.default_rng(1)
    V = 2000
    logits = (rng.normal(size=V) * scale).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    drawn = _draw_many(logits, params)
    allowed, want = _np_chain(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    assert set(drawn.tolist()) <= set(np.flatnonzero(allowed).tolist())
    order = np.argsort(-logits, kind="stable")
    rank = np.empty(V, np.int64)
    rank[order] = np.arange(V)
    cdf = np.cumsum(np.bincount(rank[drawn], minlength=V)) / len(drawn)
    assert np.abs(cdf - np.cumsum(want[order])).max() < 0.04


@pytest.mark.parametrize("temperature, top_k", [(1.5, 0), (0.8, 5)])
def test_speculative_acceptance_keeps_the_sampled_distribution(temperature, top_k):
    """sampling.accept over 4096 rows with the same logits [T, V] and the same one-hot drafts
    (each position's most likely token): the first token follows the chain's distribution at
    position 0, the draft is kept as often as that distribution picks it, and where it was
    kept the second token follows the chain's distribution at position 1. Each frequency
    within 5 binomial standard deviations of the NumPy chain's probability."""
    rng = np.random.default_rng(2)
    V, B, T = 16, 4096, 3
    logits = (rng.normal(size=(T, V)) * 1.5).astype(np.float32)
    drafts = logits[:-1].argmax(-1).astype(np.int32)  # [T - 1]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0)
    rows = SamplingRows.stack([SamplingRows.row(params, seed, []) for seed in range(B)], B)
    windows = np.full((B, T, PENALTY_WINDOW), -1, np.int32)
    positions = np.tile(np.arange(1, T + 1, dtype=np.int32), (B, 1))
    tokens, n = jax.jit(accept)(
        np.tile(logits, (B, 1, 1)), windows, rows, positions, np.tile(drafts, (B, 1)),
        np.full(B, T - 1, np.int32),
    )  # fmt: skip
    tokens, n = np.asarray(tokens), np.asarray(n)
    want = [_np_chain(logits[t].astype(np.float64), temperature, top_k, 1.0, 0.0)[1]
            for t in range(T)]  # fmt: skip

    def close(drawn, p):
        tol = 5 * np.sqrt(p * (1 - p) / len(drawn)) + 1e-3
        assert np.all(np.abs(np.bincount(drawn, minlength=V) / len(drawn) - p) <= tol)

    close(tokens[:, 0], want[0])
    kept = n >= 1
    assert np.array_equal(kept, tokens[:, 0] == drafts[0])
    close(tokens[kept, 1], want[1])


def test_a_row_draws_the_same_token_in_any_batch():
    """A row's draw depends on its own logits, values, seed and position only, whichever way
    the other rows of its batch are drawn (from their highest logits, after a sort of the
    vocabulary, over all of it, greedily)."""
    rng = np.random.default_rng(2)
    V = 2000
    cases = [
        (3.0, SamplingParams(temperature=1.0, seed=5)),
        (0.5, SamplingParams(temperature=1.0, top_k=0, top_p=0.999, min_p=0.0, seed=6)),
        (1.0, SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)),
        (1.0, SamplingParams(temperature=0.0, seed=8)),
        (3.0, SamplingParams(temperature=0.7, top_k=8, seed=9, repeat_penalty=1.3)),
    ]
    logits = np.stack([rng.normal(size=V) * scale for scale, _ in cases]).astype(np.float32)
    window = np.full((len(cases), PENALTY_WINDOW), -1, np.int32)
    window[:, :3] = np.argsort(-logits, axis=-1)[:, :3]  # the best three were seen
    rows = [SamplingRows.row(p, p.seed, []) for _, p in cases]
    positions = np.arange(len(cases), dtype=np.int32) + 40
    draw = jax.jit(sample)
    together = np.asarray(draw(logits, window, SamplingRows.stack(rows, len(rows)), positions))
    for b in range(len(cases)):
        alone = draw(logits[b : b + 1], window[b : b + 1], SamplingRows.stack([rows[b]], 1),
                     positions[b : b + 1])  # fmt: skip
        assert int(np.asarray(alone)[0]) == int(together[b]), b


def test_argmax_is_numpys():
    """The first maximum of each row, the first NaN where there is one (np.argmax's rule)."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(64, 300)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, [17, 200]] = np.nan
    x[7, -1] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), np.argmax(x, axis=-1))


@pytest.mark.parametrize(
    "repeat, presence, frequency", [(1.3, 0.0, 0.0), (1.0, 0.8, 0.0), (1.1, 0.2, 0.5)]
)
def test_greedy_with_penalties_matches_definition(stories_hf, repeat, presence, frequency):
    prompt = stories_hf.tokenize("Once upon a time, there was a little girl")
    out = stories_hf.generate(
        prompt, max_new_tokens=12, temperature=0, repeat_penalty=repeat,
        presence_penalty=presence, frequency_penalty=frequency,
    ).token_ids  # fmt: skip
    full = stories_hf.logits(prompt + out[:-1]).astype(np.float64)
    for i, tok in enumerate(out):
        context = (prompt + out)[: len(prompt) + i][-PENALTY_WINDOW:]
        z = full[len(prompt) - 1 + i].copy()
        ids, counts = np.unique(context, return_counts=True)
        z[ids] = np.where(z[ids] > 0, z[ids] / repeat, z[ids] * repeat)
        z[ids] -= presence + frequency * counts
        assert tok == int(np.argmax(z)), f"step {i}"


@pytest.mark.parametrize("lead", [(5,), (2, 70), (1, 512)])
def test_token_logprobs_match_a_float64_log_softmax(lead):
    """Each position's token log-probability and MAX_LOGPROBS best against NumPy's float64
    log-softmax, few positions at once and many (taken LOGPROB_ROWS at a time, the last block
    ragged), a negative token giving none."""
    V = 3001
    rng = np.random.default_rng(len(lead))
    logits = rng.standard_normal((*lead, V)).astype(np.float32) * 4
    tokens = rng.integers(-1, V, lead).astype(np.int32)
    got = jax.jit(lambda lg, tk: token_logprobs(lg, tk, True))(logits, tokens)
    x = logits.astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    want = np.take_along_axis(lp, np.maximum(tokens, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got.token), want, rtol=0, atol=2e-5)
    best = np.argsort(-lp, axis=-1)[..., :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(got.ids), best)
    np.testing.assert_allclose(np.asarray(got.values), np.take_along_axis(lp, best, -1), atol=2e-5)
