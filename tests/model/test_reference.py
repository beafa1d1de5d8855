"""Validates the float64 NumPy reference (tests/reference.py) and the tiny-checkpoint writers
(tests/checkpoints.py). Independent of jaxinfer. Fast (a few seconds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from support import checkpoints as C
from support import reference as R
from support.models import GOLDEN

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "models"
STORIES_HF = MODELS / "stories260K-hf-derived"

GOLDEN_IDS = GOLDEN  # published greedy ids (conftest)
GOLDEN_TOP5_IDS = [403, 385, 410, 317, 407]
GOLDEN_TOP5_VALUES = [17.0235, 15.4062, 13.1083, 12.7692, 12.4181]

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 33, 201, 5, 88, 150, 12, 260, 9]  # 18 tokens


# ----------------------------------------------------------------------------
# stories260K golden output (real trained weights)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories():
    if not (STORIES_HF / "model.safetensors").is_file():
        pytest.skip(f"stories260K fixture not found under {STORIES_HF}")
    from safetensors.numpy import load_file

    weights = load_file(str(STORIES_HF / "model.safetensors"))
    config = json.loads((STORIES_HF / "config.json").read_text())
    return weights, config


def test_stories_golden_greedy(stories):
    weights, config = stories
    assert R.greedy(weights, config, [1], 64) == GOLDEN_IDS


def test_stories_teacher_forced_matches_golden(stories):
    weights, config = stories
    logits = R.forward(weights, config, [1] + GOLDEN_IDS[:-1])
    assert logits.shape == (64, 512) and logits.dtype == np.float64
    assert logits.argmax(-1).tolist() == GOLDEN_IDS


def test_stories_top5_after_bos(stories):
    weights, config = stories
    logits = R.forward(weights, config, [1])[0]
    top = np.argsort(-logits)[:5]
    assert top.tolist() == GOLDEN_TOP5_IDS
    np.testing.assert_allclose(logits[top], GOLDEN_TOP5_VALUES, atol=1e-3)


# ----------------------------------------------------------------------------
# reference internals
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(C.TINY))
def test_incremental_greedy_matches_full_forward(name):
    cfg = C.TINY[name]
    w = C.random_weights(cfg, seed=1)
    prompt = PROMPT[:11]
    gen = R.greedy(w, cfg, prompt, 8)
    full = R.forward(w, cfg, prompt + gen[:-1])
    assert full[len(prompt) - 1 :].argmax(-1).tolist() == gen
    # incremental logits equal full-recompute logits
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    cache = R.KVCache(cfg["num_hidden_layers"])
    inc = [R.forward_step(w64, cfg, prompt[:5], cache)]
    for t in prompt[5:]:
        inc.append(R.forward_step(w64, cfg, [t], cache))
    np.testing.assert_allclose(np.concatenate(inc), R.forward(w, cfg, prompt), atol=1e-10)


def test_causality():
    cfg = C.TINY["llama"]
    w = C.random_weights(cfg, seed=2)
    a = R.forward(w, cfg, PROMPT)
    b = R.forward(w, cfg, PROMPT[:10] + [3] * 8)
    np.testing.assert_allclose(a[:10], b[:10], atol=1e-12)
    assert np.abs(a[10:] - b[10:]).max() > 1e-3


def test_llama3_inv_freq_branches():
    cfg = C.TINY["llama3"]
    d = 16
    base = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2) / d))
    scaled = R.rope_inv_freq(cfg)
    wavelen = 2 * math.pi / base
    rs = cfg["rope_scaling"]
    old = rs["original_max_position_embeddings"]
    high = wavelen < old / rs["high_freq_factor"]
    low = wavelen > old / rs["low_freq_factor"]
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any(), "tiny llama3 config should hit every branch"
    np.testing.assert_allclose(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / rs["factor"])
    s = (old / wavelen[mid] - rs["low_freq_factor"]) / (
        rs["high_freq_factor"] - rs["low_freq_factor"]
    )
    np.testing.assert_allclose(scaled[mid], (1 - s) * base[mid] / rs["factor"] + s * base[mid])
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / rs["factor"])
    # llama.cpp's rope_freqs divisors describe the same frequencies
    np.testing.assert_allclose(base / C.llama3_rope_factors(cfg), scaled, rtol=1e-6)


def test_llama3_scaling_changes_logits():
    cfg = C.TINY["llama3"]
    w = C.random_weights(cfg, seed=3)
    plain = {**cfg, "rope_scaling": None}
    a = R.forward(w, cfg, PROMPT)
    b = R.forward(w, plain, PROMPT)
    np.testing.assert_allclose(a[0], b[0], atol=1e-12)  # position 0: no rotation at all
    assert np.abs(a - b).max() > 1e-2
    # the "type" key spelling is accepted too
    legacy = {
        **cfg,
        "rope_scaling": {
            **{k: v for k, v in cfg["rope_scaling"].items() if k != "rope_type"},
            "type": "llama3",
        },
    }
    np.testing.assert_allclose(R.forward(w, legacy, PROMPT), a, atol=1e-12)


def test_mistral_sliding_window_matters():
    cfg = C.TINY["mistral"]
    window = cfg["sliding_window"]
    assert len(PROMPT) > window
    w = C.random_weights(cfg, seed=4)
    a = R.forward(w, cfg, PROMPT)
    b = R.forward(w, {**cfg, "sliding_window": None}, PROMPT)
    c = R.forward(w, {**cfg, "use_sliding_window": False}, PROMPT)
    np.testing.assert_allclose(b, c, atol=1e-12)
    # queries at positions < window see every earlier key either way
    np.testing.assert_allclose(a[:window], b[:window], atol=1e-12)
    assert np.abs(a[window:] - b[window:]).max() > 1e-3
    # strict locality in a 1-layer model: changing token 0 (the key at position 0) only
    # affects queries i with i - 0 < window
    one = {**cfg, "num_hidden_layers": 1}
    p2 = [5] + PROMPT[1:]
    x = R.forward(w, one, PROMPT)
    y = R.forward(w, one, p2)
    np.testing.assert_allclose(x[window:], y[window:], atol=1e-12)
    assert np.abs(x[:window] - y[:window]).max() > 1e-6


def test_qwen_sliding_window_off_by_default():
    cfg = {**C.TINY["qwen2"], "sliding_window": 4}  # use_sliding_window False -> ignored
    w = C.random_weights(cfg, seed=5)
    a = R.forward(w, cfg, PROMPT)
    b = R.forward(w, {**cfg, "sliding_window": None}, PROMPT)
    np.testing.assert_allclose(a, b, atol=1e-12)


# ----------------------------------------------------------------------------
# HF writer
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(C.TINY))
def test_hf_roundtrip_and_forward(name, tmp_path):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    cfg = C.TINY[name]
    w = C.random_weights(cfg, seed=0)
    assert all(v.dtype == np.float32 for v in w.values())
    assert ("lm_head.weight" in w) != bool(cfg.get("tie_word_embeddings"))
    d = C.write_hf(tmp_path / name, cfg, w)
    cfg2 = json.loads((d / "config.json").read_text())
    assert cfg2 == {**cfg, "torch_dtype": "float32"}
    back = load_file(str(d / "model.safetensors"))
    assert set(back) == set(w)
    for k in w:
        np.testing.assert_array_equal(back[k], w[k])
    logits = R.forward(back, cfg2, PROMPT)
    assert logits.shape == (len(PROMPT), cfg["vocab_size"])
    assert np.isfinite(logits).all()
    assert 0.3 < logits.std() < 5.0  # O(1) logits

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert [tok.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    text = "Once upon a time, héllo 🙂"
    enc = tok.encode(text)
    adds_bos = cfg["model_type"] in ("llama", "mistral")
    assert (enc.ids[0] == 1) == adds_bos
    assert max(enc.ids) < cfg["vocab_size"]
    assert tok.decode(enc.ids) == text
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tcfg["add_bos_token"] == adds_bos


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_hf_sharded_roundtrip(name, tmp_path):
    from safetensors.numpy import load_file

    cfg = C.TINY[name]
    w = C.random_weights(cfg, seed=0)
    d = C.write_hf(tmp_path, cfg, w, shards=2, tokenizer=False)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"]) == set(w)
    back = {}
    for f in files:
        part = load_file(str(d / f))
        assert all(index["weight_map"][k] == f for k in part)
        back.update(part)
    assert set(back) == set(w)
    for k in w:
        np.testing.assert_array_equal(back[k], w[k])
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in w.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hf_half_dtypes(dtype, tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    np_dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    cfg = C.TINY["qwen3"]
    w = C.random_weights(cfg, seed=0)
    d = C.write_hf(tmp_path, cfg, w, dtype=dtype, tokenizer=False)
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == dtype
    header_len = int.from_bytes((d / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((d / "model.safetensors").read_bytes()[8 : 8 + header_len])
    want = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {want}
    with safe_open(str(d / "model.safetensors"), "np") as f:
        for k in w:
            np.testing.assert_array_equal(
                f.get_tensor(k).astype(np.float32), w[k].astype(np_dt).astype(np.float32)
            )


# ----------------------------------------------------------------------------
# GGUF writer
# ----------------------------------------------------------------------------


def _field(reader, key):
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


@pytest.mark.parametrize("name", sorted(C.TINY))
def test_gguf_f32_roundtrip(name, tmp_path):
    import gguf

    cfg = C.TINY[name]
    w = C.random_weights(cfg, seed=0)
    path = C.write_gguf(tmp_path / f"{name}.gguf", cfg, w, qtype="F32")
    r = gguf.GGUFReader(str(path))
    arch = C.gguf_arch(cfg)
    hidden, heads, kv, hd = C._dims(cfg)

    assert _field(r, "general.architecture") == arch
    assert _field(r, f"{arch}.context_length") == cfg["max_position_embeddings"]
    assert _field(r, f"{arch}.embedding_length") == hidden
    assert _field(r, f"{arch}.feed_forward_length") == cfg["intermediate_size"]
    assert _field(r, f"{arch}.block_count") == cfg["num_hidden_layers"]
    assert _field(r, f"{arch}.attention.head_count") == heads
    assert _field(r, f"{arch}.attention.head_count_kv") == kv
    assert _field(r, f"{arch}.rope.dimension_count") == hd
    assert _field(r, f"{arch}.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert _field(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(
        cfg["rms_norm_eps"]
    )
    if name == "qwen3":
        assert _field(r, "qwen3.attention.key_length") == hd == 16
        assert _field(r, "qwen3.attention.value_length") == hd
    if name == "mistral":
        assert _field(r, "llama.attention.sliding_window") == cfg["sliding_window"]

    # tokenizer metadata == HF tokenizer.json vocab
    tokens, merges = C.byte_level_vocab_and_merges(cfg["vocab_size"])
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "default"
    assert _field(r, "tokenizer.ggml.tokens") == tokens
    assert _field(r, "tokenizer.ggml.merges") == [f"{a} {b}" for a, b in merges]
    assert len(_field(r, "tokenizer.ggml.token_type")) == cfg["vocab_size"]
    assert _field(r, "tokenizer.ggml.bos_token_id") == 1
    assert _field(r, "tokenizer.ggml.eos_token_id") == 2
    hf_vocab = C.build_tokenizer(cfg).get_vocab()
    assert all(hf_vocab[t] == i for i, t in enumerate(tokens))

    tensors = {t.name: t for t in r.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
    stacked = _stacked_experts(cfg, w)  # GGUF name -> [E, ...] from the per-expert tensors
    w = {k: v for k, v in w.items() if ".experts." not in k}
    expected = {
        C.hf_to_gguf_name(k)
        for k in w
        if k != "lm_head.weight" or not cfg.get("tie_word_embeddings")
    } | set(stacked)
    if name == "llama3":
        expected.add("rope_freqs.weight")
    assert set(tensors) == expected
    assert ("output.weight" in tensors) != bool(cfg.get("tie_word_embeddings"))

    for hf_name, arr in w.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = tensors[C.hf_to_gguf_name(hf_name)]
        data = np.asarray(t.data)
        assert list(t.shape) == list(reversed(arr.shape))  # GGUF ne = reversed numpy shape
        assert data.shape == arr.shape
        is_q = hf_name.endswith(("q_proj.weight", "q_proj.bias"))
        is_k = hf_name.endswith(("k_proj.weight", "k_proj.bias"))
        if arch == "llama" and (is_q or is_k):
            n = heads if is_q else kv
            assert not np.array_equal(data, arr)  # the layout really changed
            np.testing.assert_array_equal(C.unpermute_gguf_to_hf(data, n), arr)
        else:
            np.testing.assert_array_equal(data, arr)
    for name, arr in stacked.items():
        assert list(tensors[name].shape) == list(reversed(arr.shape))
        np.testing.assert_array_equal(np.asarray(tensors[name].data), arr)

    if name == "llama3":
        rf = np.asarray(tensors["rope_freqs.weight"].data)
        np.testing.assert_array_equal(rf, C.llama3_rope_factors(cfg))
        assert rf.shape == (hd // 2,) and rf[0] == 1.0 and rf[-1] == 8.0
        assert np.any((rf > 1.0) & (rf < 8.0))


def _stacked_experts(cfg, w) -> dict[str, np.ndarray]:
    """What llama.cpp's converter writes for MoE layers: blk.N.ffn_{gate,up,down}_exps."""
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        if C.is_moe_layer(cfg, i):
            p = C.moe_prefix(cfg, i)
            for hf, gg in zip(C.expert_names(cfg), ("gate", "up", "down"), strict=True):
                experts = [w[f"{p}experts.{e}.{hf}.weight"] for e in range(C.n_experts(cfg))]
                out[f"blk.{i}.ffn_{gg}_exps.weight"] = np.stack(experts)
    return out


def test_permutation_matches_interleaved_rope():
    """GGUF (Meta) rows + interleaved-pair RoPE == HF rows + rotate_half RoPE, up to the
    same row permutation; i.e. the llama.cpp permute is the right layout change."""
    rng = np.random.default_rng(0)
    n_head, hd, hidden = 4, 16, 32
    W = rng.standard_normal((n_head * hd, hidden))
    x = rng.standard_normal(hidden)
    pos = 5.0
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    ang = pos * inv

    q_hf = (W @ x).reshape(n_head, hd)
    cos = np.cos(np.concatenate([ang, ang]))
    sin = np.sin(np.concatenate([ang, ang]))
    rot_half = np.concatenate([-q_hf[:, hd // 2 :], q_hf[:, : hd // 2]], axis=-1)
    out_hf = q_hf * cos + rot_half * sin

    q_m = (C.permute_hf_to_gguf(W, n_head) @ x).reshape(n_head, hd)
    a, b = q_m[:, 0::2], q_m[:, 1::2]
    out_m = np.empty_like(q_m)
    out_m[:, 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out_m[:, 1::2] = a * np.sin(ang) + b * np.cos(ang)
    out_m_back = C.unpermute_gguf_to_hf(out_m.reshape(-1, 1), n_head).reshape(n_head, hd)
    np.testing.assert_allclose(out_m_back, out_hf, atol=1e-12)
    np.testing.assert_array_equal(
        C.unpermute_gguf_to_hf(C.permute_hf_to_gguf(W, n_head), n_head), W
    )


@pytest.mark.parametrize(
    ("name", "qtype"), [("llama", "Q8_0"), ("qwen3", "Q4_0"), ("qwen2", "F16"), ("mistral", "BF16")]
)
def test_gguf_quantized_readable(name, qtype, tmp_path):
    import gguf

    cfg = C.TINY[name]
    w = C.random_weights(cfg, seed=0)
    path = C.write_gguf(tmp_path / "q.gguf", cfg, w, qtype=qtype)
    r = gguf.GGUFReader(str(path))
    want = gguf.GGMLQuantizationType[qtype]
    block = gguf.constants.GGML_QUANT_SIZES[want][0]
    arch = C.gguf_arch(cfg)
    _, heads, kv, _ = C._dims(cfg)
    tensors = {t.name: t for t in r.tensors}
    n_quant = 0
    for hf_name, arr in w.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = tensors[C.hf_to_gguf_name(hf_name)]
        if arr.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
        elif arr.shape[1] % block == 0:
            assert t.tensor_type == want
            n_quant += 1
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(arr.shape)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            deq = C.unpermute_gguf_to_hf(deq, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            deq = C.unpermute_gguf_to_hf(deq, kv)
        tol = {"Q8_0": 0.01, "Q4_0": 0.15, "F16": 1e-3, "BF16": 1e-2}[qtype]
        assert np.abs(deq - arr).max() <= tol * np.abs(arr).max() + 1e-7, hf_name
    assert n_quant > 0
    if name == "qwen3":  # hidden 48 is not a multiple of 32: those rows stay F32
        assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert tensors["blk.0.attn_output.weight"].tensor_type == want
    ft = _field(r, "general.file_type")
    assert ft == getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}")


def test_unpermute_matches_stories_fixtures(stories):
    """Our inverse permutation maps the original stories260K GGUF q/k onto the HF copy."""
    import gguf

    path = MODELS / "stories260K-gguf" / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    weights, config = stories
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    for i in range(config["num_hidden_layers"]):
        q = tensors[f"blk.{i}.attn_q.weight"]
        k = tensors[f"blk.{i}.attn_k.weight"]
        hf_q = weights[f"model.layers.{i}.self_attn.q_proj.weight"]
        hf_k = weights[f"model.layers.{i}.self_attn.k_proj.weight"]
        np.testing.assert_array_equal(
            C.unpermute_gguf_to_hf(q, config["num_attention_heads"]), hf_q
        )
        np.testing.assert_array_equal(
            C.unpermute_gguf_to_hf(k, config["num_key_value_heads"]), hf_k
        )
        np.testing.assert_array_equal(C.permute_hf_to_gguf(hf_q, config["num_attention_heads"]), q)
