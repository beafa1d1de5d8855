"""Hybrid linear attention (Qwen3-Next, Qwen3.5) against independent references: the float64
NumPy Gated DeltaNet of tests/reference_hybrid.py (step by step, the simplest definition) and
transformers' / llama.cpp's outputs on the tiny-random fixtures. Then chunking and padding,
slots, layouts, compiles, memory and bad input."""

from __future__ import annotations

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import hybrid_checkpoints as H
from support import reference_hybrid as R
from support.compiles import CompileCounter
from support.models import F32_LOGITS_ATOL, model_path

import jaxinfer
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, LayoutError, UnsupportedModelError
from jaxinfer.formats import open_checkpoint
from jaxinfer.model import gdn
from jaxinfer.model.transformer import abstract_model
from jaxinfer.parallel.pipeline import stage_plan

FIXTURES = {
    "qwen3_next": "tiny-random/qwen3_next_l3f1_e8k2_mtp",
    "qwen3_5": "tiny-random/qwen3_5_l3f1_dense_mtp",
    "qwen3_5_moe": "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp",
}
FIXTURE_ATOL = 5e-4  # HF float32 vs float64 differ by up to 4e-4 (tiny-random/README.md)
BUCKETS = dict(max_seq_len=512, prefill_buckets=(32, 128))  # the 235-token prompt: 2 chunks
# The Qwen3.5 engines of the default run: one row or four slots over the same pools (the
# slots' state slots and pages), so that one-row programs are shared through the session's
# executable store.
DENSE = dict(max_seq_len=512, prefill_buckets=(128,), batch_buckets=(1, 4), kv_cache_tokens=2048)
ONE_CHUNK = dict(max_seq_len=512, prefill_buckets=(128,))  # the other kinds, in the default run


def _fixture(kind: str):
    root = model_path(FIXTURES[kind])
    return root, json.loads((root / "reference.json").read_text())


def _greedy(engine, ids, n=32):
    return engine.generate(ids, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids


# ---- the delta rule and the conv against the float64 recurrence -------------------------


def _gdn_inputs(rng, B, T, H=3, DK=8, DV=5):
    """Random f32 inputs in the ranges the layer produces: unit-norm q, k, log decay <= 0."""
    unit = lambda *s: (x := rng.normal(size=s)) / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(B, T, H, DK) * DK**-0.5
    return dict(
        q=q.astype(np.float32),
        k=unit(B, T, H, DK).astype(np.float32),
        v=rng.normal(size=(B, T, H, DV)).astype(np.float32),
        g=-rng.exponential(0.3, size=(B, T, H)).astype(np.float32),
        beta=rng.uniform(size=(B, T, H)).astype(np.float32),
        S=rng.normal(size=(B, H, DK, DV)).astype(np.float32),
    )


CHUNKED, STEP = jax.jit(gdn.chunked), jax.jit(gdn.recurrent_step)


@pytest.mark.parametrize("T", [1, 7, 64, 100, 300])
def test_chunked_and_recurrent_forms_match_the_float64_recurrence(T):
    x = _gdn_inputs(np.random.default_rng(T), 2, T)
    o, S = CHUNKED(*(jnp.asarray(x[k]) for k in ("q", "k", "v", "g", "beta", "S")))
    S_step, steps = jnp.asarray(x["S"]), []
    for t in range(T):
        cut = [jnp.asarray(x[k][:, t]) for k in ("q", "k", "v", "g", "beta")]
        o_t, S_step = STEP(*cut, S_step)
        steps.append(o_t)
    for b in range(2):
        want_o, want_S = R.gdn_recurrent(
            *(x[k][b].astype(np.float64) for k in ("q", "k", "v", "g", "beta")), x["S"][b]
        )
        # f32 noise: |o| <= 1 here; measured max 4.6e-7 (chunked), 9e-8 (recurrent)
        np.testing.assert_allclose(np.asarray(o)[b], want_o, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(S)[b], want_S, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.stack(steps, 1)[b], want_o, atol=2e-5, rtol=2e-5)


def test_padding_leaves_the_state_and_conv_untouched():
    """Tokens past a row's length (beta = g = 0, conv inputs cut) change nothing."""
    rng = np.random.default_rng(1)
    x = _gdn_inputs(rng, 1, 40)
    n = 23
    pad = {k: v.copy() for k, v in x.items()}
    pad["g"][:, n:] = 0
    pad["beta"][:, n:] = 0
    _, S_pad = CHUNKED(*(jnp.asarray(pad[k]) for k in ("q", "k", "v", "g", "beta", "S")))
    _, S_cut = CHUNKED(
        *(jnp.asarray(x[k][:, :n]) for k in ("q", "k", "v", "g", "beta")), jnp.asarray(x["S"])
    )
    np.testing.assert_allclose(np.asarray(S_pad), np.asarray(S_cut), atol=1e-6, rtol=1e-6)

    C, K = 6, 4
    inputs = rng.normal(size=(1, 10, C)).astype(np.float32)
    w = rng.normal(size=(C, K)).astype(np.float32)
    state = rng.normal(size=(1, K - 1, C)).astype(np.float32)
    y, new = gdn.causal_conv(
        jnp.asarray(inputs), jnp.asarray(w), jnp.asarray(state), jnp.array([7])
    )
    want_y, want_state = R.causal_conv(inputs[0, :7].astype(np.float64), w, state[0])
    np.testing.assert_allclose(np.asarray(y)[0, :7], want_y, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new)[0], want_state, atol=0, rtol=0)


# ---- the fixtures: transformers and llama.cpp ---------------------------------------------


@pytest.mark.parametrize("gguf", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize(
    "kind",
    ["qwen3_5", *(pytest.param(k, marks=pytest.mark.slow) for k in ("qwen3_next", "qwen3_5_moe"))],
)  # the others' conversions: test_hf_and_gguf_give_the_same_parameters, in the default run
def test_fixtures_match_transformers_and_llama_cpp(engines, kind, gguf):
    root, ref = _fixture(kind)
    opts = DENSE if kind == "qwen3_5" else ONE_CHUNK
    engine = engines(root / "model-f32.gguf" if gguf else root, **opts)
    assert engine.cfg.linear_layers == (0, 1, 2)
    assert engine.cfg.n_params() == ref["n_params"]  # the trunk, MTP weights left out
    for prompt in ref["prompts"]:
        last = np.asarray(engine.logits(prompt["ids"]))[-1]
        np.testing.assert_allclose(last, prompt["last_logits_f64"], atol=FIXTURE_ATOL, rtol=0)
        assert _greedy(engine, prompt["ids"]) == prompt["greedy_ids"]


@pytest.mark.parametrize("kind", sorted(FIXTURES))
def test_hf_and_gguf_give_the_same_parameters(kind):
    """llama.cpp's converter regroups, reorders V heads, adds 1 to norms and stores -exp(A_log):
    undoing all of it gives back the HF parameters (to float32 rounding). Qwen3.5's output
    projection keeps the GGUF's tiled V-head columns (`linear_out_tiled`: the model tiles o)."""
    root, _ = _fixture(kind)
    hf, gg = open_checkpoint(root), open_checkpoint(root / "model-f32.gguf")
    cfg = hf.config
    assert gg.config.linear_out_tiled == kind.startswith("qwen3_5")
    state = abstract_model(cfg)
    from flax import nnx

    for path, var in nnx.to_flat_state(nnx.state(state)):
        shape = var.get_value().shape
        want = hf.tensor(path, shape)
        if gg.config.linear_out_tiled and path[-1] == "wo" and "linear_attn" in path:
            HK, R = cfg.linear_k_heads, cfg.linear_v_heads // cfg.linear_k_heads
            # grouped column (k R + r) DV + d -> tiled (r HK + k) DV + d
            want = want.reshape(shape[0], HK, R, -1).swapaxes(1, 2).reshape(shape)
        np.testing.assert_allclose(gg.tensor(path, shape), want, rtol=1e-6, atol=1e-7,
                                   err_msg=path)  # fmt: skip


@pytest.mark.slow  # 43 s: the default tier must stay under 10 minutes on 2 cores
def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A published-form Qwen3.5-MoE (text_config, model.language_model.*, fused experts, a
    vision tower) loads the text model and says the tower was skipped."""
    cfg = H.hybrid_config("qwen3_5_moe")
    w = H.hybrid_random_weights(cfg, seed=5)
    path = H.write_hybrid_hf(tmp_path / "mm", cfg, w, multimodal=True)
    engine = jaxinfer.load(path, **ONE_CHUNK)
    assert "vision tower tensors skipped" in engine.source
    ids = [3, 50, 7, 300, 12, 99, 5, 640, 21, 8]
    got = np.asarray(engine.logits(ids))
    np.testing.assert_allclose(got, R.forward(w, cfg, ids), atol=F32_LOGITS_ATOL, rtol=0)
    assert _greedy(engine, ids, 12) == R.greedy(w, cfg, ids, 12)


def test_bfloat16_keeps_the_state_and_decay_in_float32():
    root, ref = _fixture("qwen3_5")
    engine = jaxinfer.load(root, dtype="bfloat16", **ONE_CHUNK)
    layer = engine.params["layers"][0]["linear_attn"]
    assert layer["a"].dtype == layer["dt_bias"].dtype == jnp.float32
    assert layer["wq"].dtype == jnp.bfloat16
    prompt = ref["prompts"][3]  # the longest: 235 tokens through the recurrence
    last = np.asarray(engine.logits(prompt["ids"]))[-1]
    assert all(a.dtype == jnp.float32 for a in engine.executor.kv[0])  # conv + delta state
    # bf16 weights and activations against float64: measured max |d| 0.14-0.37 over the 4
    # prompts (0.30 on this one), so 1.0 leaves room for another CPU's summation order
    np.testing.assert_allclose(last, prompt["last_logits_f64"], atol=1.0, rtol=0)


# ---- chunks, padding, slots ----------------------------------------------------------------


@pytest.fixture(scope="module")
def dense():
    """The Qwen3.5 dense fixture, its float64 weights and a 300-token prompt."""
    root, ref = _fixture("qwen3_5")
    from safetensors.numpy import load_file

    weights = load_file(str(root / "model.safetensors"))
    config = json.loads((root / "config.json").read_text())
    rng = random.Random(3)
    return root, ref, weights, config, [rng.randrange(3, 760) for _ in range(300)]


@pytest.mark.slow  # prompts in two chunks: the fixtures' test, in the default run
def test_prompt_in_chunks_of_128_equals_one_padded_chunk_of_512(dense, engines):
    root, _, weights, config, prompt = dense
    want = R.forward(weights, config, prompt)[-8:]
    small = engines(root, **DENSE)
    big = jaxinfer.load(root, max_seq_len=512, prefill_buckets=(512,))
    for engine in (small, big):  # 3 chunks of 128 (the last padded), or 1 of 512 (212 padding)
        got = np.asarray(engine.logits(prompt))[-8:]
        np.testing.assert_allclose(got, want, atol=F32_LOGITS_ATOL, rtol=0)
    assert _greedy(small, prompt, 16) == _greedy(big, prompt, 16)


@pytest.fixture(scope="module")
def slots4(dense):
    root = dense[0]
    engine = jaxinfer.load(root, slots=4, strict=True, **DENSE)  # its own: strict
    engine.warmup(progress=False)
    return engine


def _requests(dense):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 760) for _ in range(n)] for n in
               [5, 240, 17, 64, 3, 150, 33, 90, 1, 120]]  # fmt: skip
    return prompts, [24, 5, 30, 12, 40, 8, 21, 3, 33, 17]


@pytest.fixture(scope="module")
def alone(dense, engines):
    """Each request of _requests run alone on a one-row engine."""
    engine = engines(dense[0], **DENSE)
    return [_greedy(engine, p, n) for p, n in zip(*_requests(dense), strict=True)]


def test_ten_requests_in_four_slots_equal_each_alone(dense, slots4, alone):
    prompts, new = _requests(dense)
    want = alone
    with CompileCounter() as seen:
        requests = [
            slots4.submit(p, max_new_tokens=n, temperature=0, ignore_eos=True)
            for p, n in zip(prompts, new, strict=True)
        ]
        victim = slots4.submit(prompts[1], max_new_tokens=60, temperature=0, ignore_eos=True)
        while not victim.state.token_ids:
            slots4.step()
        victim.cancel()  # mid-way: its slot goes back, its neighbours go on
        got = [r.result().token_ids for r in requests]
    assert seen.n == 0
    assert got == want
    # A slot reused after long requests (and a cancel) starts from zeros: as a fresh engine.
    assert _greedy(slots4, prompts[0], 24) == want[0]


def test_state_memory_per_slot_is_reported(dense, slots4):
    cfg = slots4.cfg
    KD, VD = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_v_heads * cfg.linear_v_dim
    per_layer = 4 * ((cfg.conv_kernel - 1) * (2 * KD + VD) + VD * cfg.linear_k_dim)
    stats = slots4.kv_stats()
    assert stats["state_bytes_per_slot"] == len(cfg.linear_layers) * per_layer
    assert stats["state_slots"] == 5  # 4 requests and a scoring pass
    assert stats["state_bytes_allocated"] == 6 * stats["state_bytes_per_slot"]  # + null slot


# ---- layouts and compiles ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, devices",
    [("single", 1), ("tensor", 2), ("layer", 2), ("layer", 3), ("layer", 4),
     ("layer-tensor", 4)],
)  # fmt: skip
def test_same_tokens_under_every_layout(layout, devices):
    root, ref = _fixture("qwen3_5_moe")
    engine = jaxinfer.load(root, layout=layout, devices=devices, **BUCKETS)
    for prompt in (ref["prompts"][0], ref["prompts"][3]):
        assert _greedy(engine, prompt["ids"]) == prompt["greedy_ids"], layout


@pytest.mark.slow
@pytest.mark.parametrize("layout, devices", [("single", 1), ("tensor", 2), ("layer", 2)])
def test_slots_coming_and_going_compile_nothing(dense, alone, layout, devices):
    root = dense[0]
    engine = jaxinfer.load(root, layout=layout, devices=devices, slots=2, strict=True, **BUCKETS)
    engine.warmup(progress=False)
    prompts, new = _requests(dense)
    kw = dict(temperature=0, ignore_eos=True)
    with CompileCounter() as seen:
        requests = [engine.submit(p, max_new_tokens=n, **kw) for p, n in
                    zip(prompts[:6], new[:6], strict=True)]  # fmt: skip
        requests[1].cancel()
        got = [r.result().token_ids for r in requests]
        engine.logits(prompts[1])
    assert seen.n == 0
    # two rows decode at once (two microbatches under `layer`): each as if alone
    assert [g for i, g in enumerate(got) if i != 1] == [
        a for i, a in enumerate(alone[:6]) if i != 1
    ]
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff) == (0, 0)


def _kinds(n_layers, interval, moe_dense=()):
    cfg = ModelConfig(
        arch="qwen3_5", n_layers=n_layers, linear_layers=tuple(
            i for i in range(n_layers) if (i + 1) % interval), linear_k_heads=1,
        linear_v_heads=1, linear_k_dim=4, linear_v_dim=4, conv_kernel=4,
        n_experts=4 if moe_dense else 0, n_experts_used=1, d_ff_expert=8,
        dense_layers=tuple(moe_dense),
    )  # fmt: skip
    return cfg


def test_stage_plans_follow_the_layer_kinds():
    L, A = (True, False), (False, False)
    plan = stage_plan(_kinds(8, 4), 2)  # LLLA LLLA: the same slots on both stages
    assert plan.kinds == (L, L, L, A) and plan.valid.all()
    plan = stage_plan(_kinds(8, 4), 4)  # LL | LA | LL | LA
    assert plan.kinds == (L, L, A)
    assert plan.layer_of == ((0, 1, -1), (2, -1, 3), (4, 5, -1), (6, -1, 7))
    plan = stage_plan(_kinds(12, 4), 3)
    assert plan.kinds == (L, L, L, A) and plan.valid.all()
    for stages in (2, 3, 4):  # every layer exactly once, in order within its stage
        plan = stage_plan(_kinds(10, 4, moe_dense=(0, 5)), stages)
        seen = [n for row in plan.layer_of for n in row if n >= 0]
        assert seen == list(range(10))
        cfg = _kinds(10, 4, moe_dense=(0, 5))
        for row in plan.layer_of:
            for j, n in enumerate(row):
                assert n < 0 or cfg.kind(n) == plan.kinds[j]


# ---- bad input -----------------------------------------------------------------------------


def test_bad_hybrid_checkpoints_are_one_line(tmp_path):
    cfg = H.hybrid_config("qwen3_5")
    w = H.hybrid_random_weights(cfg, seed=2)
    bad_types = dict(
        cfg, layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]
    )
    with pytest.raises(UnsupportedModelError, match=r"layer_types has \['mamba'\]"):
        jaxinfer.load(H.write_hybrid_hf(tmp_path / "types", bad_types, w), max_seq_len=32)
    with pytest.raises(CheckpointError, match=r"\[128, 4\] .* 3-tap conv imply \[128, 3\]"):
        jaxinfer.load(
            H.write_hybrid_hf(tmp_path / "conv", dict(cfg, linear_conv_kernel_dim=3), w),
            max_seq_len=32,
        )
    heads = dict(cfg, linear_num_value_heads=8)
    with pytest.raises(CheckpointError, match=r"A_log' has shape \[4\], the config implies \[8\]"):
        jaxinfer.load(H.write_hybrid_hf(tmp_path / "heads", heads, w), max_seq_len=32)
    wide = H.hybrid_config("qwen3_5", num_attention_heads=8)  # attention splits 8 ways, not GDN
    path = H.write_hybrid_hf(tmp_path / "wide", wide, H.hybrid_random_weights(wide, seed=2))
    with pytest.raises(LayoutError, match=r"linear-attention value heads \(4\) .* tp \(8\)"):
        jaxinfer.load(path, layout="tensor", devices=8, max_seq_len=32)
