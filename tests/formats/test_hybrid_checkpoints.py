"""The hybrid checkpoint writers of tests/hybrid_checkpoints.py against llama.cpp's own output.

* write_hybrid_gguf on each fixture's model.safetensors + config.json reproduces the fixture's
  model-f32.gguf and model-q8_0.gguf (written by llama.cpp's convert_hf_to_gguf.py) byte for byte:
  metadata, tensor names, order, shapes, types and data (MTP ``blk.L.nextn.*`` included).
* llama.cpp (llama-cpp-python) loads random tiny GGUFs of each arch and generates, and its
  greedy ids on the GGUF written here equal the fixtures' recorded llama.cpp ``precise`` ids.
* write_hybrid_hf writes the fixtures' tensor names and shapes; the multimodal form converts to
  the same GGUF tensors as the text form.

No jaxinfer import: these check the test tooling itself.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import hybrid_checkpoints as H
from support.models import model_path

FIXTURES = {
    "qwen3_next": "tiny-random/qwen3_next_l3f1_e8k2_mtp",
    "qwen3_5": "tiny-random/qwen3_5_l3f1_dense_mtp",
    "qwen3_5_moe": "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp",
}
KINDS = tuple(FIXTURES)
ARCH_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.recurrent_layers",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.dimension_sections",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "nextn_predict_layers",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "full_attention_interval",
)


def _fixture(kind: str):
    from safetensors.numpy import load_file

    root = model_path(FIXTURES[kind])
    config = json.loads((root / "config.json").read_text())
    ref = json.loads((root / "reference.json").read_text())
    return root, config, load_file(str(root / "model.safetensors")), ref


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _llama(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    # the fixtures' "precise" configuration: F32 KV cache, no flash attention, one thread
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=512,
        n_batch=512,
        n_threads=1,
        flash_attn=False,
        type_k=0,
        type_v=0,
        logits_all=True,
        verbose=False,
    )


def _greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        logits = llm.scores[llm.n_tokens - 1]
        assert np.isfinite(logits).all()
        out.append(int(np.argmax(logits)))
        llm.eval(out[-1:])
    return out


# ----------------------------------------------------------------------------
# 1. the GGUF writer reproduces llama.cpp's converter
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype,fname", [("F32", "model-f32.gguf"), ("Q8_0", "model-q8_0.gguf")])
@pytest.mark.parametrize("kind", KINDS)
def test_gguf_reproduces_the_converter_byte_for_byte(tmp_path, kind, qtype, fname):
    from gguf import GGUFReader

    root, config, weights, ref = _fixture(kind)
    name = ref["llama_cpp"]["gguf_f32"]["metadata"]["general.name"]
    out = H.write_hybrid_gguf(
        tmp_path / fname, config, weights, qtype=qtype, name=name, tokenizer_dir=root
    )
    got, want = GGUFReader(out), GGUFReader(root / fname)
    arch = _fields(want)["general.architecture"]
    assert arch == H.GGUF_ARCH[config["model_type"]]

    # tensors: names in the same order (MTP nextn tensors included), shapes, types, data
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    assert any(".nextn." in t.name for t in got.tensors)
    for a, b in zip(got.tensors, want.tensors, strict=True):
        assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)), a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name
    if qtype == "F32":
        listed = [(n, s, t) for n, s, t in ref["llama_cpp"]["gguf_f32"]["tensors"]]
        assert [(t.name, list(map(int, t.shape)), t.tensor_type.name) for t in got.tensors] == [
            (n, list(s), t) for n, s, t in listed
        ]

    # metadata: the same keys in the same order with the same values
    fg, fw = _fields(got), _fields(want)
    assert list(fg) == list(fw)
    assert fg == fw
    for key in ARCH_KEYS:  # the ones a loader reads (spelled out so a rename shows up here)
        assert fg.get(f"{arch}.{key}") == fw.get(f"{arch}.{key}"), key

    # and therefore the whole file
    assert out.read_bytes() == (root / fname).read_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_without_mtp_drops_only_the_nextn_block(tmp_path, kind):
    from gguf import GGUFReader

    root, config, weights, _ = _fixture(kind)
    trunk = {n: w for n, w in weights.items() if not n.startswith("mtp.")}
    got = GGUFReader(H.write_hybrid_gguf(tmp_path / "m.gguf", config, trunk))
    want = GGUFReader(root / "model-f32.gguf")
    L = config["num_hidden_layers"]
    keep = [t for t in want.tensors if not t.name.startswith(f"blk.{L}.")]
    assert [t.name for t in got.tensors] == [t.name for t in keep]
    for a, b in zip(got.tensors, keep, strict=True):
        assert a.data.tobytes() == b.data.tobytes(), a.name
    fields = _fields(got)
    arch = fields["general.architecture"]
    assert fields[f"{arch}.block_count"] == L
    assert f"{arch}.nextn_predict_layers" not in fields
    assert fields[f"{arch}.attention.recurrent_layers"] == [
        t == "linear_attention" for t in config["layer_types"]
    ]


def test_v_head_reorder_is_grouped_to_tiled():
    # 2 k-heads x 2 v-heads per k-head, head_dim 1: grouped [k0v0, k0v1, k1v0, k1v1]
    x = np.array([0, 1, 2, 3])
    assert H.reorder_v_heads(x, 0, 2, 2, 1).tolist() == [0, 2, 1, 3]
    rows = np.arange(8).reshape(8, 1)  # head_dim 2: heads move as blocks of rows
    assert H.reorder_v_heads(rows, 0, 2, 2, 2)[:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


# ----------------------------------------------------------------------------
# 2. llama.cpp accepts what is written
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_loads_and_generates_random_tiny_gguf(tmp_path, kind, mtp):
    config = H.HYBRID_TINY[kind]
    weights = H.hybrid_random_weights(config, seed=1, mtp=mtp)
    llm = _llama(H.write_hybrid_gguf(tmp_path / "tiny.gguf", config, weights))
    assert llm.n_vocab() == config["vocab_size"]
    ids = _greedy(llm, [5, 17, 99, 300, 41, 7, 250], 16)
    assert len(set(ids)) > 4  # not a degenerate (NaN -> argmax 0) stream


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_greedy_on_the_written_gguf_equals_the_fixture(tmp_path, kind):
    root, config, weights, ref = _fixture(kind)
    llm = _llama(H.write_hybrid_gguf(tmp_path / "f32.gguf", config, weights, tokenizer_dir=root))
    for i in (0, 2):  # 6 and 54 prompt tokens
        want = ref["llama_cpp"]["prompts"][i]["precise"]["greedy_ids"]
        assert _greedy(llm, ref["prompts"][i]["ids"], len(want)) == want


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35", "qwen35moe"])
def test_bench_gguf_loads_in_llama_cpp(tmp_path, arch):
    # the benchmark builder at a reduced size (the default 8 x 512 is exercised by hand)
    path = H.hybrid_bench_gguf(
        tmp_path / "bench.gguf",
        arch,
        d_model=128,
        n_layers=4,
        vocab_size=1024,
        head_dim=32,
        linear_head_dim=32,
        n_experts=16,
        top_k=4,
        expert_width=64,
        shared_width=128,
        max_position_embeddings=512,
    )
    llm = _llama(path)
    assert len(_greedy(llm, list(range(10, 40)), 4)) == 4


# ----------------------------------------------------------------------------
# 3. the HF writer
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_hf_round_trip_has_the_fixture_names_and_shapes(tmp_path, kind):
    from safetensors import safe_open

    _, config, _, ref = _fixture(kind)
    d = H.write_hybrid_hf(tmp_path / "hf", config, H.hybrid_random_weights(config, mtp=True))
    with safe_open(str(d / "model.safetensors"), "np") as f:
        got = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}
    assert got == ref["safetensors_tensors"]
    assert json.loads((d / "config.json").read_text())["model_type"] == config["model_type"]
    assert (d / "tokenizer.json").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_configs_have_the_fixture_layout(kind):
    _, config, _, ref = _fixture(kind)
    tiny = H.HYBRID_TINY[kind]
    assert tiny["model_type"] == config["model_type"]
    mine = H.hybrid_random_weights(tiny, mtp=True)
    # same shapes as the fixture's tensors, which were written for the same dimensions
    assert {n: list(w.shape) for n, w in mine.items()} == ref["safetensors_tensors"]
    for key in ("layer_types", "full_attention_interval", "rope_parameters", "head_dim"):
        assert tiny[key] == config[key], key


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_hf_form(tmp_path, kind):
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    config = H.HYBRID_TINY[kind]
    weights = H.hybrid_random_weights(config, seed=2, mtp=True)
    d = H.write_hybrid_hf(tmp_path / "mm", config, weights, multimodal=True)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == config["model_type"].removesuffix("_text")
    assert cfg["text_config"]["model_type"] == config["model_type"]
    assert "vision_config" in cfg and "vocab_size" not in cfg
    st = load_file(str(d / "model.safetensors"))
    assert "lm_head.weight" in st and "model.language_model.embed_tokens.weight" in st
    assert "model.language_model.norm.weight" in st
    assert any(n.startswith("model.visual.blocks.0.") for n in st)
    assert not any(n.startswith("model.layers.") for n in st)
    assert any(n.startswith("mtp.layers.0.") for n in st)
    if kind == "qwen3_5_moe":
        E, F, D = config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]
        p = "model.language_model.layers.0.mlp.experts."
        assert st[p + "gate_up_proj"].shape == (E, 2 * F, D)
        assert st[p + "down_proj"].shape == (E, D, F)
        np.testing.assert_array_equal(
            st[p + "gate_up_proj"][3, :F], weights["model.layers.0.mlp.experts.3.gate_proj.weight"]
        )
        np.testing.assert_array_equal(
            st[p + "gate_up_proj"][3, F:], weights["model.layers.0.mlp.experts.3.up_proj.weight"]
        )
        assert not any(n.startswith(p + "0.") for n in st)
    # the multimodal checkpoint converts to exactly the text checkpoint's GGUF tensors
    a = GGUFReader(H.write_hybrid_gguf(tmp_path / "mm.gguf", cfg, st))
    b = GGUFReader(H.write_hybrid_gguf(tmp_path / "text.gguf", config, weights))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.data.tobytes() == y.data.tobytes(), x.name
    assert _fields(a) == _fields(b)


def test_random_weights_randomize_what_a_loader_could_misread():
    for kind, config in H.HYBRID_TINY.items():
        w = H.hybrid_random_weights(config, seed=0)
        for name, arr in w.items():
            assert arr.dtype == np.float32, name
            assert np.unique(arr).size > 1, name  # no constant tensor (all-zero norms, ones, ...)
        z = w["model.layers.0.input_layernorm.weight"]
        assert abs(float(z.mean())) < 0.1  # zero-centred (1 + w) norm
        g = w["model.layers.0.linear_attn.norm.weight"]
        assert abs(float(g.mean()) - 1) < 0.2  # plain gated norm
        assert (w["model.layers.0.linear_attn.A_log"] < 0).all(), kind  # -exp(A_log) in (-1, 0)
