"""Engine behaviour: padding and batching do not change results; requests are independent."""

import numpy as np
import pytest
from support.models import F32_LOGITS_ATOL, GOLDEN, model_path

import jaxinfer

STORY = "Once upon a time, there was a little girl named Lily. She loved to play"


@pytest.fixture(scope="module")
def unpadded():
    """Chunks of one token: no prompt padding anywhere."""
    return jaxinfer.load(
        model_path("stories260K-hf-derived"), prefill_buckets=(1,), batch_buckets=(1,)
    )


def test_padded_prompt_equals_unpadded(stories_hf, unpadded):
    ids = stories_hf.tokenize(STORY)
    assert len(ids) not in stories_hf.prefill_buckets  # the default engine pads the chunk
    np.testing.assert_allclose(stories_hf.logits(ids), unpadded.logits(ids), atol=F32_LOGITS_ATOL)
    a = stories_hf.generate(STORY, max_new_tokens=20, temperature=0)
    b = unpadded.generate(STORY, max_new_tokens=20, temperature=0)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_long_prompt_is_chunked(stories_hf):
    """A prompt longer than the largest chunk gives the logits of the one-chunk forward."""
    ids = [1] + GOLDEN * 3  # 193 tokens
    small = jaxinfer.load(model_path("stories260K-hf-derived"), prefill_buckets=(16, 64))
    np.testing.assert_allclose(small.logits(ids), stories_hf.logits(ids), atol=F32_LOGITS_ATOL)


def test_batch_equals_alone(stories_hf):
    prompts = ["Once upon a time", "The dog", [1, 403, 407], "Lily and Tom went to the park"]
    kw = dict(max_new_tokens=24, temperature=0)
    together = stories_hf.generate(prompts[:3], **kw)  # batch bucket 4 with one padding row
    alone = [stories_hf.generate(p, **kw) for p in prompts[:3]]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]


def test_sampled_batch_rows_keep_their_own_seed(stories_hf):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    alone = stories_hf.generate("The cat", seed=5, **kw)
    together = stories_hf.generate(["The dog", "The cat"], seed=5, **kw)
    assert together[1].token_ids == alone.token_ids


def test_result_fields(stories_hf):
    r = stories_hf.generate("Once upon a time", max_new_tokens=5, temperature=0)
    assert r.prompt_ids == stories_hf.tokenize("Once upon a time")
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    full = stories_hf.detokenize(r.prompt_ids + r.token_ids)
    assert "Once upon a time" + r.text == full


def test_eos_finishes_with_stop(tmp_path):
    """The checkpoint's EOS id (here declared as '.', id 426) ends generation; ignore_eos
    keeps going."""
    import json
    import shutil

    folder = tmp_path / "stories"
    shutil.copytree(model_path("stories260K-hf-derived"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 426}))
    engine = jaxinfer.load(folder)  # the shapes of stories_hf: its programs are cached
    r = engine.generate([1], max_new_tokens=64, temperature=0)
    assert r.finish_reason == "stop" and r.token_ids == GOLDEN[: GOLDEN.index(426) + 1]
    assert r.text == "Once upon a time, there was a little girl named Lily"
    r = engine.generate([1], max_new_tokens=64, temperature=0, ignore_eos=True)
    assert r.token_ids == GOLDEN and r.finish_reason == "length"


def test_stop_string_cuts_text(stories_hf):
    r = stories_hf.generate([1], max_new_tokens=64, temperature=0, stop=["dog", "Lily."])
    assert r.finish_reason == "stop" and r.stop_string == "Lily."  # which one ended it
    assert r.text == "Once upon a time, there was a little girl named "


def test_stop_token(stories_hf):
    r = stories_hf.generate([1], max_new_tokens=64, temperature=0, stop_tokens=[426])
    assert r.token_ids == GOLDEN[: GOLDEN.index(426) + 1] and r.finish_reason == "stop"
    assert r.stop_string is None


def test_stream_concatenates_to_result(stories_hf):
    kw = dict(max_new_tokens=40, temperature=0.9, seed=11, stop=["park"])
    pieces = list(stories_hf.generate("Once upon a time", stream=True, **kw))
    whole = stories_hf.generate("Once upon a time", **kw)
    assert "".join(p.text for p in pieces) == whole.text
    assert [t for p in pieces for t in p.token_ids] == whole.token_ids
    assert pieces[-1].finish_reason == whole.finish_reason


def test_continuation_keeps_its_leading_space(stories_hf):
    r = stories_hf.generate("Once upon", max_new_tokens=3, temperature=0)
    assert r.text == " a time,"


def test_max_new_tokens_zero(stories_hf):
    r = stories_hf.generate("Hi", max_new_tokens=0)
    assert r.token_ids == [] and r.text == "" and r.finish_reason == "length"


def test_context_limit_finishes_with_length():
    engine = jaxinfer.load(model_path("stories260K-hf-derived"), max_seq_len=40)
    r = engine.generate([1] + GOLDEN[:30], max_new_tokens=100, temperature=0, ignore_eos=True)
    assert len(r.token_ids) == 40 - 31 and r.finish_reason == "length"
    assert r.token_ids == GOLDEN[30:39]


def test_generate_function_loads_or_reuses(stories_hf):
    r = jaxinfer.generate(stories_hf, [1], max_new_tokens=8, temperature=0)
    assert r.token_ids == GOLDEN[:8]
    path = model_path("stories260K-gguf/stories260K.gguf")
    r = jaxinfer.generate(path, [1], max_new_tokens=8, temperature=0, max_seq_len=512)
    assert r.token_ids == GOLDEN[:8]


def test_builtin_default_model_is_stories260k(stories_gguf):
    """No model: the stories260K GGUF shipped in the package (it writes a story); the random
    model stays available by name."""
    engine = jaxinfer.load()
    assert "stories260K" in engine.name and engine.source.startswith("GGUF")
    r = engine.generate("Once upon a time", max_new_tokens=24, temperature=0)
    assert (
        r.text == stories_gguf.generate("Once upon a time", max_new_tokens=24, temperature=0).text
    )
    assert r.text.startswith(", there was a little")
    r = jaxinfer.generate(None, [1], max_new_tokens=8, temperature=0)
    assert r.token_ids == GOLDEN[:8]
    random = jaxinfer.load("builtin-random")
    assert "random" in random.name
    assert random.detokenize(random.tokenize("héllo 世界")) == "héllo 世界"


def test_a_plan_without_a_one_row_bucket_prefills_with_its_smallest():
    """batch_buckets=(8,) (`jaxinfer bench --parallel 8`): chunks whose 8 rows pass the prompt
    budget still get a prefill program, of the smallest bucket."""
    from jaxinfer.runtime.buckets import ShapePlan

    plan = ShapePlan.make((8, 512), (8,), None, 2048)
    assert [(n, B, T) for n, B, T in plan.jobs() if n == "prefill"] == [
        ("prefill", 8, 8), ("prefill", 8, 512)
    ]  # fmt: skip
    assert plan.rows_for(512) == 8
