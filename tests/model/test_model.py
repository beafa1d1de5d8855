"""Every supported architecture against the independent float64 NumPy reference forward.

Tiny random checkpoints are written by the test (HF folders and GGUF files, see
support/checkpoints.py) and loaded through the public API; logits are compared position by
position. Every family runs the full forward in both formats; decoding and bfloat16 run on
the families whose paths differ there (a sliding window, experts) and on all of them in the
slow tier.
"""

import numpy as np
import pytest
from support import reference
from support.checkpoints import TINY
from support.models import F32_LOGITS_ATOL

ARCHS = sorted(TINY)
PROMPT = [1, 17, 250, 33, 4, 99, 180, 5, 7, 260, 61, 42, 3, 150, 200, 11, 12, 13, 14, 280]
DECODE = ("mistral", "qwen2_moe")  # the sliding window and experts in the decode loop
BF16 = ("qwen3",)  # q/k norms in bfloat16


def tiered(archs, fast):
    return [a if a in fast else pytest.param(a, marks=pytest.mark.slow) for a in archs]


@pytest.fixture(scope="module")
def want():
    """The reference logits [T, V] (float64) per family, computed once."""
    cache = {}

    def get(tiny_model):
        key = id(tiny_model.weights)
        if key not in cache:
            cache[key] = reference.forward(tiny_model.weights, tiny_model.config, PROMPT)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_match_reference(arch, fmt, tiny, engines, want):
    """HF folders (in two shards) and GGUF files (q/k rows permuted for llama) alike."""
    model = tiny(arch, fmt, seed=7, **({"shards": 2} if fmt == "hf" else {}))
    got = engines(model.path).logits(PROMPT)
    assert got.shape == want(model).shape
    np.testing.assert_allclose(got, want(model), atol=F32_LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", tiered(ARCHS, DECODE))
def test_decode_matches_full_forward(arch, tiny, engines):
    """Prefill + decode steps give the tokens a teacher-forced full forward picks."""
    model = tiny(arch, "hf", seed=7, shards=2)
    engine = engines(model.path)
    prompt = PROMPT[:7]
    out = engine.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
    full = reference.forward(model.weights, model.config, prompt + out[:-1])  # [T, V]
    picks = full[len(prompt) - 1 :]
    top2 = np.sort(picks, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3  # only positions with a clear winner are judged
    assert clear.sum() >= len(out) // 2
    assert np.array_equal(np.asarray(out)[clear], picks.argmax(-1)[clear])
    # and the engine's own full forward agrees with its decode, at every position
    mine = engine.logits(prompt + out[:-1])[len(prompt) - 1 :]
    assert np.array_equal(mine.argmax(-1)[clear], np.asarray(out)[clear])


@pytest.mark.parametrize("arch", tiered(ARCHS, BF16))
def test_bfloat16_compute_close_to_reference(arch, tiny, engines, want):
    model = tiny(arch, "hf", seed=7, shards=2)
    got = engines(model.path, dtype="bfloat16").logits(PROMPT)
    assert np.abs(got - want(model)).max() < 0.1 * np.abs(want(model)).max()
