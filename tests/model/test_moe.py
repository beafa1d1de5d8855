"""Mixture of experts against independent references: the float64 NumPy MoE of
tests/reference.py on checkpoints written here (HF and GGUF, per-expert and fused tensors), and
transformers' / llama.cpp's outputs on the tiny-random fixtures. Then layouts, slots, routing
that varies without compiles, router ties, and bad checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import checkpoints as C
from support import reference as R
from support.compiles import CompileCounter
from support.models import F32_LOGITS_ATOL, model_path

import jaxinfer
from jaxinfer.errors import CheckpointError, LayoutError

FIXTURES = {"qwen3_moe": "tiny-random/qwen3_moe_e8k2_bpe", "mixtral": "tiny-random/mixtral_e8k2"}
FIXTURE_ATOL = 5e-4  # HF float32 vs float64 differ by up to 4e-4 (tiny-random/README.md)
PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 33, 201, 5, 88, 150, 12, 260, 9, 77, 31]
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
# One set of shapes for the fixtures' engines (the 235-token prompt: two chunks of 128), so
# that they share compiled programs through the session's executable store.
FIXTURE_OPTS = dict(max_seq_len=512, prefill_buckets=(128,), kv_cache_tokens=1024)
SLOW = pytest.mark.slow  # the other families' logits are in test_model's default tier


def slow_unless(value, fast):
    return value if value in fast else pytest.param(value, marks=SLOW)


def _fixture(name: str):
    root = model_path(FIXTURES[name])
    return root, json.loads((root / "reference.json").read_text())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Per architecture: config, weights, and HF (per-expert and fused) and GGUF checkpoints."""
    out = {}
    for arch in MOE_ARCHS:
        cfg = C.TINY[arch]
        w = C.random_weights(cfg, seed=3)
        root = tmp_path_factory.mktemp(arch)
        out[arch] = dict(
            config=cfg,
            weights=w,
            hf=C.write_hf(root / "hf", cfg, w),
            fused=C.write_hf(root / "fused", cfg, C.fuse_experts(cfg, w)),
            gguf=C.write_gguf(root / "model.gguf", cfg, w),
        )
    return out


@pytest.mark.parametrize("form", ["hf", "fused", "gguf"])
@pytest.mark.parametrize("arch", [slow_unless(a, ("qwen3_moe",)) for a in MOE_ARCHS])
def test_logits_and_greedy_match_the_float64_reference(written, engines, arch, form):
    case = written[arch]
    engine = engines(case[form])  # the shapes of test_model's engines: programs cached
    assert engine.cfg.moe and engine.cfg.arch == arch
    want = R.forward(case["weights"], case["config"], PROMPT)
    got = np.asarray(engine.logits(PROMPT))
    np.testing.assert_allclose(got, want, atol=F32_LOGITS_ATOL, rtol=0)
    greedy = R.greedy(case["weights"], case["config"], PROMPT, 12)
    assert engine.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids == greedy


def test_parameter_counts_and_bytes_read_per_token(written):
    """n_params equals the placed arrays; a decode token reads the dense part and k of the E
    experts of every MoE layer (counted here from the HF config)."""
    from jaxinfer.cli.bench import weight_bytes, weight_bytes_read

    hf = written["qwen3_moe"]["config"]
    engine = jaxinfer.load(written["qwen3_moe"]["hf"], max_seq_len=32)
    total = sum(v.size for v in written["qwen3_moe"]["weights"].values())
    assert weight_bytes(engine) == 4 * total == 4 * engine.cfg.n_params()
    per_expert = 3 * hf["hidden_size"] * hf["moe_intermediate_size"]
    unused = hf["num_hidden_layers"] * (hf["num_experts"] - hf["num_experts_per_tok"])
    assert weight_bytes_read(engine, 1) == pytest.approx(4 * (total - unused * per_expert))
    assert engine.cfg.n_active_params() == total - unused * per_expert
    assert weight_bytes_read(engine, 1000) == pytest.approx(4 * total)
    for arch in ("mixtral", "qwen2_moe"):  # shared experts, gates, biases, dense layers
        other = jaxinfer.load(written[arch]["hf"], max_seq_len=32)
        n = sum(v.size for v in written[arch]["weights"].values())
        assert weight_bytes(other) == 4 * n == 4 * other.cfg.n_params(), arch


def test_config_fields_follow_the_hf_rules(written):
    """Qwen2-MoE's dense layers come from decoder_sparse_step and mlp_only_layers; its shared
    expert is gated; its weights are not renormalized."""
    cfg = jaxinfer.load(written["qwen2_moe"]["hf"], max_seq_len=32).cfg
    assert cfg.dense_layers == (0, 2, 3) and [cfg.is_moe(i) for i in range(4)] == [
        False, True, False, False,
    ]  # fmt: skip
    assert (cfg.n_experts, cfg.n_experts_used, cfg.d_ff_expert) == (6, 2, 32)
    assert cfg.d_ff_shared == 40 and cfg.shared_gate and not cfg.norm_topk_prob
    gguf = jaxinfer.load(written["qwen2_moe"]["gguf"], max_seq_len=32).cfg
    assert gguf.dense_layers == cfg.dense_layers and gguf.d_ff_shared == 40
    assert gguf.norm_topk_prob is False and gguf.shared_gate


@pytest.mark.parametrize("name", [slow_unless(n, ("qwen3_moe",)) for n in sorted(FIXTURES)])
@pytest.mark.parametrize("gguf", [False, pytest.param(True, marks=SLOW)])
def test_fixtures_match_transformers_and_llama_cpp(engines, name, gguf):
    root, ref = _fixture(name)
    engine = engines(root / "model-f32.gguf" if gguf else root, **FIXTURE_OPTS)
    for p in ref["prompts"]:
        assert engine.tokenizer.encode(p["text"]) == p["ids"]
        last = np.asarray(engine.logits(p["ids"]))[-1]
        np.testing.assert_allclose(last, p["last_logits_f64"], atol=FIXTURE_ATOL, rtol=0)
        got = engine.generate(p["ids"], max_new_tokens=32, temperature=0).token_ids
        assert got == p["greedy_ids"]
    assert all(r["first_diff_vs_hf_greedy"] is None for r in _llama_cpp_runs(ref))


def _llama_cpp_runs(ref) -> list[dict]:
    runs = ref["llama_cpp"]
    return [v for v in runs.values() if isinstance(v, dict) and "first_diff_vs_hf_greedy" in v]


def test_qwen3_next_expert_block_matches_the_reference():
    """The Qwen3-Next expert block (routed + sigmoid-gated shared expert) from the fixture's
    layer-0 weights, loaded through the same names, against the float64 NumPy block."""
    from safetensors.numpy import load_file

    from jaxinfer.config import ModelConfig
    from jaxinfer.formats.hf import MOE, moe_fields, tensor_name
    from jaxinfer.model.transformer import MoE

    root = model_path("tiny-random/qwen3_next_l3f1_e8k2_mtp")
    hf = json.loads((root / "config.json").read_text())
    w = load_file(str(root / "model.safetensors"))
    cfg = ModelConfig(
        arch="qwen2_moe", d_model=hf["hidden_size"], n_layers=1, n_heads=4, n_kv_heads=2,
        head_dim=hf["head_dim"], d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        **{**moe_fields(hf, 1), "dense_layers": ()},
    )  # fmt: skip
    assert (cfg.n_experts, cfg.d_ff_shared, cfg.shared_gate) == (8, 32, True)
    import jax.numpy as jnp
    from flax import nnx

    block = MoE(cfg, nnx.Rngs(0))
    paths = [tuple(key.split(".")) for key in MOE]
    names = {path: tensor_name(("layers", 0, *path), cfg) for path in paths}
    for path, name in names.items():
        target = block
        for key in path[1:-1]:
            target = getattr(target, key)
        var = getattr(target, path[-1])
        var[...] = jnp.asarray(w[name].reshape(var.shape))
    p = "model.layers.0.mlp.experts."
    for leaf, hf_leaf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        stacked = np.stack([w[f"{p}{e}.{hf_leaf}.weight"] for e in range(8)])
        getattr(block, leaf)[...] = jnp.asarray(stacked)
    x = np.random.default_rng(0).standard_normal((1, 9, cfg.d_model)).astype(np.float32)
    got = np.asarray(block(jnp.asarray(x), jnp.ones((1, 9), bool)))[0]
    want = R._moe({k: v.astype(np.float64) for k, v in w.items()}, hf, 0, x[0].astype(np.float64))
    # Outputs reach |12|; measured 3.4e-6 here, the project's f32 logit tolerance elsewhere.
    np.testing.assert_allclose(got, want, atol=F32_LOGITS_ATOL, rtol=0)


# ---- layouts, slots, compiles -----------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe_reference():
    root, ref = _fixture("qwen3_moe")
    return root, ref["prompts"][3]


@pytest.mark.parametrize(
    "layout, devices",
    [("single", 1), ("expert", 2), *(pytest.param(*x, marks=SLOW) for x in (
        ("expert", 4), ("tensor", 2), ("layer", 2), ("layer-expert", 4),
        ("expert-tensor.toml", 4)))],
)  # fmt: skip
def test_same_tokens_under_every_layout(qwen3_moe_reference, engines, tmp_path, layout, devices):
    root, prompt = qwen3_moe_reference
    if layout.endswith(".toml"):
        path = tmp_path / layout
        path.write_text(
            '[mesh]\nep = 2\ntp = -1\n[rules]\nexperts = "ep"\nheads = "tp"\n'
            'kv_heads = "tp"\nmlp = "tp"\nvocab = "tp"\n'
        )
        layout = str(path)
    engine = engines(root, layout=layout, devices=devices, **FIXTURE_OPTS)
    got = engine.generate(prompt["ids"], max_new_tokens=32, temperature=0).token_ids
    assert got == prompt["greedy_ids"], layout
    last = np.asarray(engine.logits(prompt["ids"]))[-1]
    np.testing.assert_allclose(last, prompt["last_logits_f64"], atol=FIXTURE_ATOL, rtol=0)


def test_experts_live_where_the_layout_puts_them(qwen3_moe_reference):
    root, _ = qwen3_moe_reference
    engine = jaxinfer.load(root, max_seq_len=64, layout="expert", devices=4)
    leaf = engine.params["layers"][0]["moe"]["w_gate"]
    held = {
        d.id: idx[0].indices(8)[:2]
        for d, idx in leaf.sharding.devices_indices_map(leaf.shape).items()
    }
    assert sorted(held.values()) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(s.data.shape[0] == 2 for s in leaf.addressable_shards)


@pytest.mark.parametrize(
    "layout, devices",
    [("single", 1), *(pytest.param(*x, marks=SLOW) for x in (
        ("expert", 2), ("tensor", 2), ("layer-expert", 4)))],
)  # fmt: skip
def test_routing_varies_and_nothing_compiles(qwen3_moe_reference, layout, devices):
    """After warmup, prompts that route to different experts (and slots that mix them)
    compile nothing, and each slot's tokens equal the request run alone."""
    root, prompt = qwen3_moe_reference
    engine = jaxinfer.load(
        root,
        layout=layout,
        devices=devices,
        slots=2,
        strict=True,
        batch_buckets=(1, 2),
        **FIXTURE_OPTS,
    )  # its own: strict after warmup
    engine.warmup(progress=False)
    prompts = [prompt["ids"], [5, 9, 700, 3], list(range(100, 160))]
    with CompileCounter() as seen:
        alone = [engine.generate(p, max_new_tokens=16, temperature=0).token_ids for p in prompts]
        together = [r.token_ids for r in engine.generate(prompts, max_new_tokens=16, temperature=0)]
    assert seen.n == 0
    assert together == alone and alone[0] == prompt["greedy_ids"][:16]
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff, stats.untracked_compiles) == (0, 0, 0)


# ---- router ties ------------------------------------------------------------------------


def _tied_router(gap: float):
    """Qwen3-MoE with top-1 routing whose router rows are zero except 2 and 5 = (1 + gap) x
    row 2: a token with a positive logit for expert 2 ties it with expert 5 (gap 0) or leans
    to 5 by gap x that logit; the others tie at 0, where expert 0 must win."""
    cfg = dict(C.TINY["qwen3_moe"], num_experts_per_tok=1)
    w = C.random_weights(cfg, seed=5)
    for i in range(cfg["num_hidden_layers"]):
        r = w[f"model.layers.{i}.mlp.gate.weight"]
        r[[0, 1, 3, 4, 6, 7]] = 0.0
        r[5] = r[2] * np.float32(1 + gap)
    return cfg, w


@pytest.mark.parametrize("gap", [0.0, 1e-3])
def test_router_ties_go_to_the_lower_index(tmp_path, gap):
    """Equal router probabilities pick the lower expert index (torch.topk's rule); a near-tie
    well above float32 noise picks the larger."""
    cfg, w = _tied_router(gap)
    engine = jaxinfer.load(C.write_hf(tmp_path / "hf", cfg, w), max_seq_len=64)
    want = R.forward(w, cfg, PROMPT)
    np.testing.assert_allclose(np.asarray(engine.logits(PROMPT)), want, atol=F32_LOGITS_ATOL)
    w2 = {k: v.copy() for k, v in w.items()}
    for i in range(cfg["num_hidden_layers"]):  # make the loser's choice visible in the output
        for n in ("gate_proj", "up_proj", "down_proj"):
            w2[f"model.layers.{i}.mlp.experts.{5 if gap == 0 else 2}.{n}.weight"] *= 0
    other = R.forward(w2, cfg, PROMPT)
    assert np.abs(other - want).max() < 1e-12  # the reference never used the losing expert
    from jaxinfer.model import moe

    x = np.ones((3, 4), np.float32)
    router = np.zeros((6, 4), np.float32)
    router[[1, 3, 4]] = 1.0  # experts 1, 3, 4 tie
    weights, ids = moe.route(x, router, 2, normalize=True)
    assert np.asarray(ids).tolist() == [[1, 3]] * 3
    np.testing.assert_allclose(np.asarray(weights), 0.5)


# ---- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, words",
    [
        ("fewer_experts", ["blk.0.ffn_", "_exps", "holds 6 experts", "declares 8"]),
        ("wide_experts", ["blk.0.ffn_down_exps", "[8, 64, 24]", "[8, 64, 20]"]),
        ("no_router", ["blk.1.ffn_gate_inp.weight", "no router"]),
        ("top_k", ["9", "8", "experts per token"]),
    ],
)
def test_bad_moe_gguf_is_one_line(tmp_path, case, words):
    cfg = C.TINY["qwen3_moe"]
    w = C.random_weights(cfg, seed=1)
    meta_cfg = dict(cfg)
    if case == "fewer_experts":  # layer 0's stacked tensors hold 6 experts, metadata says 8
        for e in (6, 7):
            for n in ("gate_proj", "up_proj", "down_proj"):
                del w[f"model.layers.0.mlp.experts.{e}.{n}.weight"]
    elif case == "wide_experts":
        meta_cfg["moe_intermediate_size"] = 20
    elif case == "no_router":
        del w["model.layers.1.mlp.gate.weight"]
    elif case == "top_k":
        meta_cfg["num_experts_per_tok"] = 9
    path = C.write_gguf(tmp_path / "bad.gguf", meta_cfg, w)
    with pytest.raises(CheckpointError) as err:
        jaxinfer.load(path, max_seq_len=32)
    msg = str(err.value)
    assert "\n" not in msg and all(word in msg for word in words), msg
    jaxinfer.load(
        C.write_gguf(tmp_path / "good.gguf", cfg, C.random_weights(cfg, 1)), max_seq_len=32
    )


def test_per_expert_gguf_tensors_are_refused_by_name(tmp_path):
    """Early-2024 GGUFs stored blk.N.ffn_gate.E.weight per expert: refused with what to do."""
    from jaxinfer.errors import UnsupportedModelError

    cfg = C.TINY["mixtral"]
    w = C.random_weights(cfg, seed=1)
    path = C.write_gguf(tmp_path / "new.gguf", cfg, w)
    import gguf

    reader = gguf.GGUFReader(str(path))
    old = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") and key.count(".") <= 2 and not field.types[1:]:
            old.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        data = np.asarray(t.data)
        if "_exps" in t.name:
            for e in range(data.shape[0]):
                old.add_tensor(t.name.replace("_exps", f".{e}"), data[e])
        else:
            old.add_tensor(t.name, data)
    old.write_header_to_file()
    old.write_kv_data_to_file()
    old.write_tensors_to_file()
    old.close()
    with pytest.raises(UnsupportedModelError, match=r"one tensor each \(blk\.0\.ffn_gate\.0"):
        jaxinfer.load(tmp_path / "old.gguf", max_seq_len=32)


def test_bad_moe_hf_checkpoints_are_one_line(tmp_path):
    cfg = C.TINY["qwen3_moe"]
    w = C.random_weights(cfg, seed=1)
    missing = {k: v for k, v in w.items() if "experts.3.up_proj" not in k or ".0.mlp" in k}
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.3\.up_proj"):
        jaxinfer.load(C.write_hf(tmp_path / "missing", cfg, missing), max_seq_len=32)
    extra = dict(w, **{"model.layers.0.mlp.experts.8.gate_proj.weight": w[
        "model.layers.0.mlp.experts.0.gate_proj.weight"]})  # fmt: skip
    with pytest.raises(CheckpointError, match="more experts than the 8"):
        jaxinfer.load(C.write_hf(tmp_path / "extra", cfg, extra), max_seq_len=32)


def test_layouts_that_do_not_fit_the_experts_are_refused(written):
    with pytest.raises(LayoutError, match=r"8 experts over ep = 3 .* --devices 2"):
        jaxinfer.load(written["qwen3_moe"]["hf"], layout="expert", devices=3)
    with pytest.raises(LayoutError, match=r"8 experts over ep = 3 .* --devices 4 "):
        jaxinfer.load(written["qwen3_moe"]["hf"], layout="layer-expert", devices=6)
    with pytest.raises(LayoutError, match="has none"):
        jaxinfer.load(model_path("stories260K-gguf/stories260K.gguf"), layout="expert", devices=2)


@pytest.mark.slow
def test_layer_split_of_dense_and_moe_layers(written):
    """Qwen2-MoE layers 0, 2, 3 dense and 1 experts: the stages' slots follow the kinds."""
    case = written["qwen2_moe"]
    engine = jaxinfer.load(case["hf"], max_seq_len=128, layout="layer", devices=2)
    assert "skipped" in engine.runner.description
    greedy = R.greedy(case["weights"], case["config"], PROMPT, 12)
    assert engine.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids == greedy


@pytest.mark.parametrize("N, k, E", [(1, 2, 8), (7, 2, 8), (64, 8, 16), (300, 2, 4)])
def test_grouped_products_and_the_tile_loop_match_a_float64_expert_block(N, k, E):
    """The accelerators' expert block (lax.ragged_dot over the sorted assignments) and the
    CPU's tile loop against NumPy float64, with padding rows and, as under an expert split,
    the experts in two halves whose parts sum to the whole."""
    import jax.numpy as jnp

    from jaxinfer.model.moe import expert_ffn, grouped_ffn

    rng = np.random.default_rng(N + k + E)
    D, F = 16, 24
    x = rng.normal(size=(N, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, k)).astype(np.float32)
    valid = rng.random(N) > 0.2
    gate, up = (rng.normal(size=(E, F, D)).astype(np.float32) / 4 for _ in range(2))
    down = rng.normal(size=(E, D, F)).astype(np.float32) / 4
    want = np.zeros((N, D))
    for n in np.flatnonzero(valid):
        for e, w in zip(ids[n], weights[n], strict=True):
            g, u = gate[e] @ x[n].astype(np.float64), up[e] @ x[n].astype(np.float64)
            want[n] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    args = [jnp.asarray(a) for a in (x, ids, weights, valid)]
    for ffn in (expert_ffn, grouped_ffn):
        whole = np.asarray(ffn(*args, gate, up, down))
        h = E // 2
        halves = sum(np.asarray(ffn(*args, gate[s], up[s], down[s], first=s.start))
                     for s in (slice(0, h), slice(h, E)))  # fmt: skip
        for got in (whole, halves):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=ffn.__name__)
