"""Engine.embed and Engine.yes_probability (the pooled pass: `pool[B, T]` programs over prompt
chunks, no KV kept) against the float64 NumPy references' final-normed hidden states and
logits (support/reference.py, reference_hybrid.py): every pooling, texts batched and alone,
one longer than the largest chunk; nothing compiles after warmup; the EOS a tokenizer's
metadata appends (HF post-processor or add_eos_token, GGUF tokenizer.ggml.add_eos_token)."""

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file
from support import reference as R
from support import reference_hybrid as RH
from support.models import STORIES, STORIES_HF, model_path

import jaxinfer
from jaxinfer.errors import RequestError
from jaxinfer.formats import gguf_file
from jaxinfer.formats.tokenizer import Tokenizer

COSINE = 0.9999  # float32 on the device against float64
# chunks of 8 and 32 tokens, batches of 1 and 2 rows: a 70-token text takes three calls
PLAN = dict(max_seq_len=256, prefill_buckets=(8, 32), batch_buckets=(1, 2), embeddings=True)
HYBRID = "tiny-random/qwen3_5_l3f1_dense_mtp"
MOE = "tiny-random/qwen3_moe_e8k2_bpe"
LONG = "Lily saw a big red ball under a tree and ran to get it. " * 6


def pooled(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """The reference's pooled, L2-normalized vector of hidden states [T, D] (float64)."""
    v = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
    return v / np.linalg.norm(v)


class Reference:
    """A model's float64 forward (dense or hybrid) from its HF folder."""

    def __init__(self, rel: str):
        root = model_path(rel)
        self.config = json.loads((root / "config.json").read_text())
        self.hybrid = rel == HYBRID
        weights = load_file(root / "model.safetensors")
        self.weights = RH.to_f64(weights) if self.hybrid else weights

    def run(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(logits [T, V], final-normed hidden states [T, D]), float64."""
        if self.hybrid:
            cache = RH.HybridCache(self.config)
            return RH.forward_step(self.weights, self.config, list(ids), cache, True)
        return R.forward(self.weights, self.config, list(ids), return_hidden=True)


def check_embeddings(engine, ref: Reference, texts) -> None:
    """Each pooling of `texts`, batched and each alone, against the reference."""
    ids = [engine.tokenize(t) if isinstance(t, str) else t for t in texts]
    hidden = [ref.run(i)[1] for i in ids]
    for pooling in ("last", "mean", "cls"):
        batched = engine.embed(texts, pooling)
        assert batched.shape == (len(texts), engine.cfg.d_model) and batched.dtype == np.float32
        for k, text in enumerate(texts):
            want = pooled(hidden[k], pooling)
            assert float(batched[k] @ want) >= COSINE, (pooling, k, float(batched[k] @ want))
            alone = engine.embed(text if isinstance(text, str) else [text], pooling)[0]
            assert float(alone @ want) >= COSINE, (pooling, k, "alone")
    assert engine.kv_stats()["pages_in_use"] == 0  # every text's pages were given back


@pytest.fixture(scope="module")
def stories():
    """stories260K with the pooled pass in its plan, warmed up, strict."""
    engine = jaxinfer.load(model_path(STORIES_HF), strict=True, **PLAN)
    engine.warmup(progress=False)
    return engine


def test_dense_embeddings_equal_the_reference_with_no_compile(stories, compiles):
    """Three texts (one of 70 tokens, over the largest chunk of 32), batched two rows a
    call and alone, each pooling; strict mode and jax.monitoring see no compile."""
    texts = ["Once upon a time", LONG, "x", [1, 400, 22, 7]]
    assert len(stories.tokenize(LONG)) > 2 * 32
    plan = [(p.program, p.batch, p.tokens) for p in stories.compile_plan()]
    assert {p for p in plan if p[0] == "pool"} == {("pool", 1, 8), ("pool", 1, 32), ("pool", 2, 8)}
    with compiles() as seen:
        check_embeddings(stories, Reference(STORIES_HF), texts)
    assert seen.n == 0


def test_yes_probability_is_the_softmax_of_two_logits(stories):
    """P(yes) = softmax over the logits of `yes` and `no` at each prompt's last position."""
    ref = Reference(STORIES_HF)
    prompts = ["Once upon a time", LONG]
    yes, no = 403, 407
    got = stories.yes_probability(prompts, yes, no)
    for k, text in enumerate(prompts):
        logits = ref.run(stories.tokenize(text))[0][-1]
        want = np.exp(logits[yes]) / (np.exp(logits[yes]) + np.exp(logits[no]))
        assert abs(float(got[k]) - want) < 1e-4, (k, float(got[k]), want)


def test_embed_waits_for_pages_and_refuses_bad_texts(stories):
    """A running request holds both pages of the pool (256 tokens): the pass steps it until
    it ends, then leases a page per text and gives it back; bad texts are one-line
    RequestErrors."""
    running = stories.submit("Once upon a time", max_new_tokens=250, temperature=0,
                             ignore_eos=True)  # fmt: skip
    stories.step()  # admitted: its pages are reserved
    ref = Reference(STORIES_HF)
    got = stories.embed([LONG])[0]
    assert running.done and len(running.result().token_ids) > 200  # it ran first
    assert float(got @ pooled(ref.run(stories.tokenize(LONG))[1], "last")) >= COSINE
    for bad, words in [
        ([""], "empty"), ([[]], "empty"), ([[0, 512]], "must lie in [0, 512)"),
        ([[1] * 257], "257 tokens but the context holds 256"), ([], "non-empty list"),
    ]:  # fmt: skip
        with pytest.raises(RequestError, match=re.escape(words)):
            stories.embed(bad)
    with pytest.raises(RequestError, match="pooling 'max' is invalid"):
        stories.embed(["x"], "max")
    assert stories.kv_stats()["pages_in_use"] == 0


def test_hybrid_embeddings_equal_the_reference():
    """Gated DeltaNet layers carry their state from chunk to chunk in the scoring pass's
    state index (one text a call); a 70-token text crosses three chunks."""
    engine = jaxinfer.load(model_path(HYBRID), **PLAN)
    rng = np.random.default_rng(0)
    texts = [rng.integers(3, 765, n).tolist() for n in (5, 70, 1)]
    check_embeddings(engine, Reference(HYBRID), texts)
    plan = {(p.program, p.batch) for p in engine.compile_plan() if p.program == "pool"}
    assert plan == {("pool", 1)}  # one row a call: linear layers keep one state per row


@pytest.mark.slow
def test_moe_embeddings_equal_the_reference():
    engine = jaxinfer.load(model_path(MOE), **PLAN)
    rng = np.random.default_rng(1)
    check_embeddings(engine, Reference(MOE), [rng.integers(3, 765, n).tolist() for n in (9, 70)])


@pytest.mark.slow
@pytest.mark.parametrize("layout, devices", [("tensor", 2), ("layer", 2)])
def test_embeddings_under_other_layouts(layout, devices):
    """Tensor-split and pipelined (stages) placements run the same pooled pass."""
    engine = jaxinfer.load(model_path(STORIES_HF), layout=layout, devices=devices, **PLAN)
    check_embeddings(engine, Reference(STORIES_HF), ["Once upon a time", LONG])


@pytest.mark.slow
def test_hybrid_pooled_pass_compiles_nothing_after_warmup(compiles):
    engine = jaxinfer.load(model_path(HYBRID), strict=True, **PLAN)
    engine.warmup(progress=False)
    with compiles() as seen:
        engine.embed([[5] * 70, [7] * 3], "mean")
        engine.yes_probability([[5] * 40], 690, 662)
    assert seen.n == 0


# ---- the EOS a tokenizer appends ---------------------------------------------------------


def test_eos_is_appended_where_the_tokenizer_metadata_says(tmp_path, stories):
    """HF: a post-processor that appends an id (Qwen3-Embedding's), or tokenizer_config's
    add_eos_token; GGUF: tokenizer.ggml.add_eos_token. encode() appends it only when asked;
    embed() asks for strings, not for token ids."""
    spec = json.loads((model_path(STORIES_HF) / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "</s>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                           "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}},
    }  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_append == 2
    assert tok.encode("Hi", add_eos=True) == [*tok.encode("Hi"), 2] and tok.encode("Hi")[-1] != 2
    config = {"add_eos_token": False, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_dir(tmp_path).eos_append is None  # an explicit false wins
    shutil.copy(model_path(STORIES_HF) / "tokenizer.json", tmp_path / "tokenizer.json")
    assert Tokenizer.from_hf_dir(tmp_path).eos_append is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": True}))
    assert Tokenizer.from_hf_dir(tmp_path).eos_append == 2

    path = model_path(STORIES)
    fields = dict(gguf_file.read(path).fields)
    assert Tokenizer.from_gguf(fields, path).eos_append is None
    fields["tokenizer.ggml.add_eos_token"] = True
    assert Tokenizer.from_gguf(fields, path).eos_append == 2

    stories.tokenizer.eos_append = 2  # as such metadata would set it
    try:
        ref = Reference(STORIES_HF)
        text = "Once upon a time"
        ids = stories.tokenize(text)
        got = stories.embed([text, ids])
        assert float(got[0] @ pooled(ref.run([*ids, 2])[1], "last")) >= COSINE
        assert float(got[1] @ pooled(ref.run(ids)[1], "last")) >= COSINE  # ids as given
    finally:
        stories.tokenizer.eos_append = None
