"""The host's choice of an n-gram engine's decode program (runtime/drafting.py): the prompt
test against the brute-force lookup, the waits between verify calls, and an engine whose
plain prompts decode without drafting while a copy drafts, both with the plain engine's ids."""

from __future__ import annotations

import numpy as np
import pytest
from support.lookup import NGRAM_MAX, NGRAM_MIN, ngram_reference
from support.models import model_path

import jaxinfer
from jaxinfer.runtime import drafting
from jaxinfer.runtime.drafting import Drafting, StepCosts, predicted

STORIES = "stories260K-gguf/stories260K.gguf"
SMALL = dict(max_seq_len=512, prefill_buckets=(32, 128), batch_buckets=(1,))


@pytest.mark.parametrize("seed", range(4))
def test_predicted_is_the_lookup_predicting_the_last_tokens(seed):
    assert (drafting.NGRAM_MIN, drafting.NGRAM_MAX) == (NGRAM_MIN, NGRAM_MAX)
    rng = np.random.default_rng(seed)
    seen = set()
    for _ in range(200):
        n = int(rng.integers(1, 60))
        context = [int(t) for t in rng.integers(0, int(rng.integers(2, 8)), n)]
        if rng.random() < 0.3:  # a planted copy at the end
            at = int(rng.integers(0, n))
            context += context[at : at + int(rng.integers(1, 12))]
        want = 0  # the last tokens the brute-force lookup predicts, back from the end
        while want < 4 and ngram_reference(context[: len(context) - 1 - want], 1) == [
            context[len(context) - 1 - want]
        ]:
            want += 1
        assert predicted(context, most=4) == want, context
        seen.add(want)
    assert seen == {0, 1, 2, 3, 4}


def test_a_row_that_keeps_no_draft_waits_longer_each_time():
    row = Drafting.start([1, 5, 9, 2, 7])  # nothing repeats: a plain call first
    assert not row.wants
    row.plain()
    assert row.wants
    waits = []
    for _ in range(6):
        row.verified(0, 3, 0, StepCosts())
        waits.append(row.wait)
        for _ in range(row.wait):
            assert not row.wants
            row.plain()
        assert row.wants
    assert waits == [1, 3, 7, 15, 15, 15]
    row.verified(2, 3, 3, StepCosts())  # a kept draft: it drafts on
    assert row.wants and row.misses == 0
    assert Drafting.start([4, 1, 2, 3, 9, 4, 1, 2, 3]).wants  # ends in a repeat


def test_a_verify_call_pays_when_its_kept_drafts_cover_what_its_verify_steps_cost():
    costs = StepCosts()
    costs.timed(1.0, 10, 0)  # plain calls: 0.1 s a step
    assert costs.ratio == 1.0  # no verify call measured yet
    costs.timed(1.8, 10, 4)  # 6 plain steps (0.6 s) and 4 verify steps of 0.3 s
    assert costs.ratio == pytest.approx(3.0)
    row = Drafting()
    row.verified(7, 4, 0, costs)  # 4 + 7 tokens in the time of 12 plain steps: a miss
    assert row.misses == 1 and not row.wants
    row = Drafting()
    row.verified(8, 4, 0, costs)  # 4 + 8 tokens for 12: it pays
    assert row.misses == 0 and row.wants
    row.verified(1, 1, 0, StepCosts())  # costs unknown: a kept draft pays
    assert row.wants


@pytest.mark.slow
def test_plain_prompts_decode_plainly_and_copies_draft(engines):
    ngram = jaxinfer.load(model_path(STORIES), speculative="ngram", **SMALL)
    plain = engines(model_path(STORIES), **SMALL)
    ngram.warmup(progress=False)
    prompt = plain.tokenize("Once upon a time, there was a little girl who")
    assert predicted(prompt) == 0
    want = plain.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True).token_ids
    got = ngram.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True)
    assert got.token_ids == want
    assert ngram.perf_stats().draft_tokens == 0  # one call, the plain program
    passage = plain.generate([1], max_new_tokens=64, temperature=0, ignore_eos=True).token_ids
    copy = [1, *passage, 1, *passage[:12]]  # its first sentence again: the rest repeats
    assert predicted(copy) >= drafting.PREDICTED
    want = plain.generate(copy, max_new_tokens=48, temperature=0, ignore_eos=True).token_ids
    ngram.reset_perf()
    assert ngram.generate(copy, max_new_tokens=48, temperature=0, ignore_eos=True).token_ids == want
    stats = ngram.perf_stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # kept, and refused where it diverges
    assert stats.recompiles_same == stats.recompiles_diff == 0  # both programs were planned
