"""Validates the float64 NumPy hybrid reference (tests/reference_hybrid.py: Qwen3-Next, Qwen3.5
dense and MoE) against transformers' float64 outputs stored with the tiny-random fixtures, and
its incremental state handling (prompt in pieces, decode) against one pass. Independent of
jaxinfer; about a second."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from support import reference_hybrid as RH
from support.models import model_path

FIXTURES = [
    "tiny-random/qwen3_next_l3f1_e8k2_mtp",
    "tiny-random/qwen3_5_l3f1_dense_mtp",
    "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp",
]
# last_logits_f64 is rounded to 9 decimals; measured max |delta| over the 4 prompts of each
# fixture: 5.0e-10 for all three (i.e. the rounding). transformers' own float64 mode (float32
# casts left in) differs from the strict run by up to 2.7e-5, so 1e-8 pins the strict math.
F64_LOGITS_ATOL = 1e-8
STATE_ATOL = 1e-9  # pieces / decode vs one pass: measured <= 1e-12


@functools.cache
def _load(rel: str):
    from safetensors.numpy import load_file

    root = model_path(rel)
    config = json.loads((root / "config.json").read_text())
    ref = json.loads((root / "reference.json").read_text())
    return config, RH.to_f64(load_file(root / "model.safetensors")), ref


def fixture(rel: str):
    """(config, float64 weights, reference.json); skips when the fixture is missing."""
    return _load(rel)


# ----------------------------------------------------------------------------
# against transformers (float64)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rel", FIXTURES)
def test_last_logits_match_transformers_f64(rel):
    config, w, ref = fixture(rel)
    for prompt in ref["prompts"]:
        got = RH.forward(w, config, prompt["ids"])
        assert got.shape == (len(prompt["ids"]), config["vocab_size"])
        want = np.asarray(prompt["last_logits_f64"])
        np.testing.assert_allclose(got[-1], want, atol=F64_LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("rel", FIXTURES)
def test_greedy_matches_transformers(rel):
    config, w, ref = fixture(rel)
    for prompt in ref["prompts"]:  # 6..235-token prompts, 32 new tokens each
        assert RH.greedy(w, config, prompt["ids"], 32) == prompt["greedy_ids"]


# ----------------------------------------------------------------------------
# incremental state: pieces and decode == one pass
# ----------------------------------------------------------------------------


def _run_in_pieces(w, config, ids, sizes):
    cache = RH.HybridCache(config)
    out, s = [], 0
    for n in sizes:
        out.append(RH.forward_step(w, config, ids[s : s + n], cache))
        s += n
    assert s == len(ids) and cache.length == len(ids)
    return np.concatenate(out), cache


@pytest.mark.parametrize("rel", FIXTURES)
def test_prompt_in_pieces_then_decode_equals_one_pass(rel):
    config, w, ref = fixture(rel)
    prompt = ref["prompts"][-1]["ids"]  # the longest prompt
    generated = ref["prompts"][-1]["greedy_ids"][:6]
    ids = prompt + generated
    full = RH.forward(w, config, ids)

    chunks32 = [32] * (len(prompt) // 32) + [len(prompt) % 32]
    odd = [1, 2, 64, 5, len(prompt) - 72]  # pieces shorter than the conv kernel, too
    for sizes in (chunks32, odd):
        sizes = [n for n in sizes if n] + [1] * len(generated)  # then one token at a time
        got, cache = _run_in_pieces(w, config, ids, sizes)
        np.testing.assert_allclose(got, full, atol=STATE_ATOL, rtol=0)

    # a copied cache continues identically and leaves the original untouched
    _, cache = _run_in_pieces(w, config, prompt, chunks32)
    fork = cache.copy()
    a = RH.forward_step(w, config, generated[:2], fork)
    b = RH.forward_step(w, config, generated[:2], cache)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, full[len(prompt) : len(prompt) + 2], atol=STATE_ATOL, rtol=0)


@pytest.mark.parametrize("rel", FIXTURES[:2])  # fused in_proj_qkvz and separate in_proj_qkv
def test_gdn_layer_state_carries_across_pieces(rel):
    config, w, _ = fixture(rel)
    x = np.random.default_rng(0).normal(size=(70, config["hidden_size"]))
    whole, (conv, rec) = RH.gdn_layer(w, config, 0, x)
    a, state = RH.gdn_layer(w, config, 0, x[:2])  # 2 < K - 1 = 3
    b, state = RH.gdn_layer(w, config, 0, x[2:41], state)
    c, state = RH.gdn_layer(w, config, 0, x[41:], state)
    np.testing.assert_allclose(np.concatenate([a, b, c]), whole, atol=1e-12, rtol=0)
    np.testing.assert_allclose(state[0], conv, atol=0, rtol=0)
    np.testing.assert_allclose(state[1], rec, atol=1e-12, rtol=0)
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    assert conv.shape == (config["linear_conv_kernel_dim"] - 1, 2 * nk * dk + nv * dv)
    assert rec.shape == (nv, dk, dv)


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------


def _random_gdn_inputs(rng, T=150, H=3, dk=8, dv=5):
    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    q = unit(rng.normal(size=(T, H, dk))) * dk**-0.5
    k = unit(rng.normal(size=(T, H, dk)))
    v = rng.normal(size=(T, H, dv))
    g = -rng.uniform(0.0, 2.0, size=(T, H))
    beta = rng.uniform(0.0, 1.0, size=(T, H))
    state = rng.normal(size=(H, dk, dv))
    return q, k, v, g, beta, state


def test_gdn_chunked_equals_recurrent():
    q, k, v, g, beta, state = _random_gdn_inputs(np.random.default_rng(1))
    want, want_state = RH.gdn_recurrent(q, k, v, g, beta, state)
    for chunk in (64, 7, 1):
        got, got_state = RH.gdn_chunked(q, k, v, g, beta, state, chunk=chunk)
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
        np.testing.assert_allclose(got_state, want_state, atol=1e-10, rtol=0)


def test_gdn_recurrent_definition_and_neutral_pad():
    q, k, v, g, beta, state = _random_gdn_inputs(np.random.default_rng(2), T=4, H=2)
    out, final = RH.gdn_recurrent(q, k, v, g, beta, state)
    S = state.copy()
    for t in range(4):  # explicit loops over heads: S [dk, dv]
        for h in range(2):
            S[h] = S[h] * np.exp(g[t, h])
            delta = (v[t, h] - S[h].T @ k[t, h]) * beta[t, h]
            S[h] = S[h] + np.outer(k[t, h], delta)
            np.testing.assert_allclose(out[t, h], S[h].T @ q[t, h], atol=1e-13, rtol=0)
    np.testing.assert_allclose(final, S, atol=1e-13, rtol=0)
    # a pad step with g = 0 and beta = 0 leaves the state unchanged
    _, padded = RH.gdn_recurrent(q[:1], k[:1], v[:1], np.zeros((1, 2)), np.zeros((1, 2)), final)
    np.testing.assert_array_equal(padded, final)


def test_causal_conv_definition_and_state():
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(9, 5)), rng.normal(size=(5, 4))
    y, state = RH.causal_conv(x, w)
    xp = np.concatenate([np.zeros((3, 5)), x])
    pre = np.stack([sum(w[:, j] * xp[t + j] for j in range(4)) for t in range(9)])
    np.testing.assert_allclose(y, pre / (1.0 + np.exp(-pre)), atol=1e-14, rtol=0)
    np.testing.assert_array_equal(state, x[-3:])
    # in pieces (one shorter than K - 1)
    y1, s = RH.causal_conv(x[:2], w)
    np.testing.assert_array_equal(s, xp[2:5])
    y2, s = RH.causal_conv(x[2:], w, s)
    np.testing.assert_allclose(np.concatenate([y1, y2]), y, atol=1e-14, rtol=0)
    np.testing.assert_array_equal(s, state)


# ----------------------------------------------------------------------------
# config / checkpoint variants
# ----------------------------------------------------------------------------


PROMPT = [5, 300, 17, 42, 99, 3, 250, 7, 7, 128, 64, 33, 201, 5, 88, 150, 12, 260, 9, 700]


def test_layer_types_derived_from_full_attention_interval():
    config, w, _ = fixture(FIXTURES[0])
    derived = {k: v for k, v in config.items() if k != "layer_types"}
    assert (
        RH.layer_types(derived)
        == RH.layer_types(config)
        == ["linear_attention"] * 3 + ["full_attention"]
    )
    np.testing.assert_array_equal(RH.forward(w, derived, PROMPT), RH.forward(w, config, PROMPT))


def test_fused_experts_equal_per_expert():
    config, w, _ = fixture(FIXTURES[2])
    fused = dict(w)
    E = config["num_experts"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate = [fused.pop(f"{p}{e}.gate_proj.weight") for e in range(E)]
        up = [fused.pop(f"{p}{e}.up_proj.weight") for e in range(E)]
        down = [fused.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
        fused[p + "gate_up_proj"] = np.stack(
            [np.concatenate(gu) for gu in zip(gate, up, strict=True)]
        )
        fused[p + "down_proj"] = np.stack(down)
    np.testing.assert_array_equal(RH.forward(fused, config, PROMPT), RH.forward(w, config, PROMPT))


def test_qwen3_next_grouped_projections_equal_qwen3_5_separate_ones():
    """Regrouping in_proj_qkvz / in_proj_ba into Qwen3.5's [q all | k all | v all], z, b, a (V
    heads keep their per-key-head order) gives the same model; Qwen3.5-MoE always renormalizes
    the top-k, as this Qwen3-Next config does (norm_topk_prob)."""
    config, w, _ = fixture(FIXTURES[0])
    nk, nv, dk, dv = 2, 4, 16, 16
    r, D = nv // nk, config["hidden_size"]
    split = dict(w)
    for i, kind in enumerate(RH.layer_types(config)):
        if kind != "linear_attention":
            continue
        p = f"model.layers.{i}.linear_attn."
        qkvz = split.pop(p + "in_proj_qkvz.weight").reshape(nk, 2 * dk + 2 * r * dv, D)
        ba = split.pop(p + "in_proj_ba.weight").reshape(nk, 2 * r, D)
        q, k = qkvz[:, :dk], qkvz[:, dk : 2 * dk]
        v, z = qkvz[:, 2 * dk : 2 * dk + r * dv], qkvz[:, 2 * dk + r * dv :]
        split[p + "in_proj_qkv.weight"] = np.concatenate(
            [q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)]
        )
        split[p + "in_proj_z.weight"] = z.reshape(-1, D)
        split[p + "in_proj_b.weight"] = ba[:, :r].reshape(-1, D)
        split[p + "in_proj_a.weight"] = ba[:, r:].reshape(-1, D)
    as_qwen3_5 = {**config, "model_type": "qwen3_5_moe_text"}
    np.testing.assert_allclose(
        RH.forward(split, as_qwen3_5, PROMPT), RH.forward(w, config, PROMPT), atol=1e-12, rtol=0
    )


def test_nested_text_config_and_language_model_prefix():
    config, w, _ = fixture(FIXTURES[1])
    nested = {"model_type": "qwen3_5", "text_config": config}
    renamed = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in w.items()
    }
    np.testing.assert_array_equal(
        RH.forward(renamed, nested, PROMPT), RH.forward(w, config, PROMPT)
    )
