"""Every supported architecture against the independent float64 NumPy reference forward.

Tiny random checkpoints are written by the test (HF folders and GGUF files, see
checkpoints.py) and loaded through the public API; logits are compared position by position.
"""

import numpy as np
import pytest
from support import reference
from support.checkpoints import TINY, random_weights, write_gguf, write_hf
from support.models import F32_LOGITS_ATOL

import jaxinfer

ARCHS = sorted(TINY)
PROMPT = [1, 17, 250, 33, 4, 99, 180, 5, 7, 260, 61, 42, 3, 150, 200, 11, 12, 13, 14, 280]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    config = TINY[request.param]
    weights = random_weights(config, seed=7)
    want = reference.forward(weights, config, PROMPT)  # [T, V] float64
    return request.param, config, weights, want, tmp_path_factory.mktemp(request.param)


def test_hf_logits_match_reference(arch_case):
    name, config, weights, want, tmp = arch_case
    engine = jaxinfer.load(write_hf(tmp / "hf", config, weights, shards=2))
    got = engine.logits(PROMPT)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=F32_LOGITS_ATOL, rtol=0)


def test_gguf_logits_match_reference(arch_case):
    name, config, weights, want, tmp = arch_case
    engine = jaxinfer.load(write_gguf(tmp / "m.gguf", config, weights))
    np.testing.assert_allclose(engine.logits(PROMPT), want, atol=F32_LOGITS_ATOL, rtol=0)


def test_decode_matches_full_forward(arch_case):
    """Prefill + decode steps give the tokens a teacher-forced full forward picks."""
    name, config, weights, _, tmp = arch_case
    engine = jaxinfer.load(write_hf(tmp / "hf1", config, weights), prefill_buckets=(4, 16))
    prompt = PROMPT[:7]
    out = engine.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
    full = reference.forward(weights, config, prompt + out[:-1])  # [T, V]
    picks = full[len(prompt) - 1 :]
    top2 = np.sort(picks, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3  # only positions with a clear winner are judged
    assert clear.sum() >= len(out) // 2
    assert np.array_equal(np.asarray(out)[clear], picks.argmax(-1)[clear])
    # and the engine's own full forward agrees with its decode, at every position
    mine = engine.logits(prompt + out[:-1])[len(prompt) - 1 :]
    assert np.array_equal(mine.argmax(-1)[clear], np.asarray(out)[clear])


def test_bfloat16_compute_close_to_reference(arch_case):
    name, config, weights, want, tmp = arch_case
    engine = jaxinfer.load(write_hf(tmp / "hf2", config, weights), dtype="bfloat16")
    got = engine.logits(PROMPT)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
