"""Reasoning budgets: a request that may think N tokens thinks exactly N, then writes the end
tag (forced through the token mask, nothing compiled), on every slot at once; budget 0 thinks
none; a grammar starts after the reasoning; with no budget the tokens are only counted and
the text is the free run's."""

import json

import jsonschema
import pytest
from support.compiles import CompileCounter
from support.models import model_path
from support.schemas import PERSON

import jaxinfer
from jaxinfer.runtime.reasoning import Reasoning

STORIES = "stories260K-gguf/stories260K.gguf"
END = "</think>"


@pytest.fixture(scope="module")
def engine():
    engine = jaxinfer.load(model_path(STORIES), max_seq_len=256, slots=4, strict=True,
                           prefill_buckets=(16, 64), kv_cache_tokens=1024)  # fmt: skip
    engine.warmup(progress=False)
    return engine


def _end_ids(engine) -> list[int]:
    ids = engine.tokenize(END)
    return ids[1:] if ids and ids[0] == engine.tokenizer.bos_id else ids


def test_each_slot_thinks_its_budget_then_ends_with_nothing_compiled(engine):
    prompt = engine.tokenize("Once upon a time, there was a little dog.")
    end = _end_ids(engine)
    budgets = [0, 1, 7, 30]
    with CompileCounter() as seen:
        requests = [
            engine.submit(
                prompt,
                max_new_tokens=60,
                temperature=0.8,
                seed=3 + n,
                ignore_eos=True,
                reasoning=Reasoning(budget=n, opened=True),
            )  # fmt: skip
            for n in budgets
        ]
        results = [r.result() for r in requests]
    assert seen.n == 0
    for n, r in zip(budgets, results, strict=True):
        assert r.reasoning_tokens == n
        assert r.token_ids[n : n + len(end)] == end, n  # then the end tag, token by token
        assert END not in engine.detokenize(r.token_ids[:n])
        assert len(r.token_ids) == 60  # the answer goes on after it


def test_no_budget_counts_and_changes_nothing(engine):
    """budget -1: the tokens are the free run's, and those before any end tag are counted."""
    prompt = engine.tokenize("The little girl said")
    free = engine.generate(prompt, max_new_tokens=40, temperature=0, ignore_eos=True)
    r = engine.submit(prompt, max_new_tokens=40, temperature=0, ignore_eos=True,
                      reasoning=Reasoning(budget=-1, opened=True)).result()  # fmt: skip
    assert r.token_ids == free.token_ids
    assert r.reasoning_tokens == 40  # stories never writes the end tag: all of it is reasoning


def test_an_answer_that_does_not_open_the_tag_does_not_think(engine):
    """Not opened by the prompt: only an answer that starts with the start tag thinks."""
    prompt = engine.tokenize("Once upon a time")
    r = engine.submit(prompt, max_new_tokens=20, temperature=0, ignore_eos=True,
                      reasoning=Reasoning(budget=3)).result()  # fmt: skip
    assert r.reasoning_tokens == 0
    free = engine.generate(prompt, max_new_tokens=20, temperature=0, ignore_eos=True)
    assert r.token_ids == free.token_ids


def test_a_grammar_starts_after_the_reasoning(engine):
    prompt = engine.tokenize("Tom is a boy.")
    end = _end_ids(engine)
    r = engine.submit(prompt, max_new_tokens=200, temperature=0.7, seed=1, json_schema=PERSON,
                      reasoning=Reasoning(budget=5, opened=True)).result()  # fmt: skip
    assert r.reasoning_tokens == 5 and r.token_ids[5 : 5 + len(end)] == end
    answer = engine.detokenize(r.token_ids[5 + len(end) :])
    if r.finish_reason == "stop":
        jsonschema.validate(json.loads(answer), PERSON)
    else:  # the budget ran out mid-object: still a prefix the grammar allowed
        assert answer.lstrip().startswith("{")


def test_a_bad_budget_is_refused():
    with pytest.raises(jaxinfer.RequestError, match="thinking_budget"):
        Reasoning(budget=-2)
