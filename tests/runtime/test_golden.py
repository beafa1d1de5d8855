"""The real stories260K model reproduces its published greedy output from every format."""

import pytest
from support.models import GOLDEN, model_path

import jaxinfer


def greedy_from_bos(engine, n=64):
    return engine.generate([1], max_new_tokens=n, temperature=0, ignore_eos=True).token_ids


def test_gguf_f32(stories_gguf):
    assert greedy_from_bos(stories_gguf) == GOLDEN


def test_hf_safetensors(stories_hf):
    assert greedy_from_bos(stories_hf) == GOLDEN


def test_hf_text_matches_golden_text(stories_hf):
    result = stories_hf.generate([1], max_new_tokens=64, temperature=0, ignore_eos=True)
    assert result.text.startswith("Once upon a time, there was a little girl named Lily.")
    assert result.text.endswith("but it was too high.\nLily")


@pytest.mark.parametrize(
    "rel, n_match",
    [
        ("stories260K-gguf-quant-derived/stories260K-Q8_0.gguf", 64),
        ("stories260K-gguf-quant-derived/stories260K-mixed-quants.gguf", 53),
    ],
)
def test_quantized_gguf(engines, rel, n_match):
    """float32 activations (the dequantized weights' products: test_quant's engines too)."""
    engine = engines(model_path(rel), activations="float", max_seq_len=512)
    assert greedy_from_bos(engine)[:n_match] == GOLDEN[:n_match]


@pytest.mark.slow  # 11 s a case here: the default tier's time budget
@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_16_bit_kv_cache(kv, stories_gguf):
    """kv_cache_dtype: keys and values stored in 16 bits (the attention kernel widens them as
    it reads) halve the pools and keep the published greedy output."""
    engine = jaxinfer.load(model_path("stories260K-gguf/stories260K.gguf"), kv_cache_dtype=kv,
                           max_seq_len=512)  # fmt: skip
    assert greedy_from_bos(engine) == GOLDEN
    kv_stats, f32_stats = engine.kv_stats(), stories_gguf.kv_stats()
    assert (kv_stats["dtype"], f32_stats["dtype"]) == (kv, "float32")
    per_page = [s["bytes_allocated"] / (s["pages_total"] + 1) for s in (kv_stats, f32_stats)]
    assert per_page[0] * 2 == per_page[1]


def test_top5_logits_after_bos(stories_gguf):
    logits = stories_gguf.logits([1])[0]
    top = logits.argsort()[::-1][:5].tolist()
    assert top == [403, 385, 410, 317, 407]
    assert logits[top] == pytest.approx([17.0235, 15.4062, 13.1083, 12.7692, 12.4181], abs=1e-3)


def test_prompt_text_tokenized_with_bos(stories_hf, stories_gguf):
    text = "Once upon a time, there was a little girl named Lily."
    want = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426]
    assert stories_hf.tokenize(text) == want
    assert stories_gguf.tokenize(text) == want
    assert stories_gguf.generate(text, max_new_tokens=8, temperature=0).prompt_ids == want
