"""Tiny random hybrid linear-attention checkpoints: Qwen3-Next, Qwen3.5 dense, Qwen3.5 MoE.

Independent of ``jaxinfer``: only numpy, safetensors, tokenizers, gguf and ``tests/checkpoints.py``.

* ``HYBRID_TINY``: tiny HF ``config.json`` dicts ("qwen3_next", "qwen3_5", "qwen3_5_moe"), modelled
  on the fixtures in ``/work/shared/models/tiny-random`` (3 Gated-DeltaNet layers : 1 gated
  full-attention layer, 2 k-heads / 4 v-heads, partial RoPE 0.25, mRoPE sections for Qwen3.5)
* ``hybrid_random_weights(config, seed, mtp=False)``: float32 weights with HF names
* ``write_hybrid_hf(dirpath, config, weights, multimodal=False)``: config.json + safetensors +
  tokenizer; ``multimodal=True`` writes the published Qwen3.5 form (``text_config``,
  ``model.language_model.*``, a small ``model.visual.*`` tower, fused MoE experts)
* ``write_hybrid_gguf(path, config, weights)``: arch ``qwen3next`` / ``qwen35`` / ``qwen35moe``,
  written the way llama.cpp's ``convert_hf_to_gguf.py`` (llama_cpp_python 0.3.36) writes it:
  same metadata keys in the same order, same tensor names, order, shapes, types and values
* ``hybrid_bench_gguf(path, arch, ...)``: a random GGUF of benchmark size

Conventions of llama.cpp's converter reproduced here (``conversion/qwen.py``):

* every ``*norm.weight`` except ``linear_attn.norm.weight`` is stored as ``1 + w``;
  ``A_log`` as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``; ``conv1d [C, 1, K]`` is
  squeezed to ``[C, K]``; ``shared_expert_gate [1, D]`` stays 2-D (ggml ``{D, 1}``).
* qwen3next: ``in_proj_qkvz`` rows, grouped per k-head ``[q dk | k dk | v r*dv | z r*dv]``
  (``r = nv / nk``), become ``attn_qkv = [q all; k all; v all]`` and ``attn_gate = z all``; the
  v and z heads keep their grouped (k-head-major) order. ``in_proj_ba`` is copied unchanged as
  ``ssm_ba`` (rows per k-head ``[b r | a r]``).
* qwen35 / qwen35moe (when ``nk != nv``): every V-head axis goes from grouped order
  ``[k0v0, k0v1, k1v0, k1v1]`` (v head ``h = k*r + j``) to tiled order ``[k0v0, k1v0, k0v1, k1v1]``
  (position ``j*nk + k``): V rows of ``in_proj_qkv``, rows of ``in_proj_z``, ``in_proj_b/a``,
  ``A_log``, ``dt_bias``, the V channels of ``conv1d``, the input columns of ``out_proj``.
* experts ``mlp.experts.E.{gate,up,down}_proj`` are stacked into ``ffn_{gate,up,down}_exps``
  (fused ``experts.gate_up_proj [E, 2F, D]`` is split: gate rows first).
* MTP (``mtp.*``) becomes block ``L = num_hidden_layers``: ``mtp.fc`` -> ``blk.L.nextn.eh_proj``,
  ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``mtp.norm`` -> ``nextn.enorm`` /
  ``nextn.hnorm`` / ``nextn.shared_head_norm`` (``1 + w``), ``mtp.layers.0.*`` -> ``blk.L.*``;
  ``block_count`` includes it and ``nextn_predict_layers`` is written.
* tensors are emitted in the order of the sorted HF names (experts at the last expert tensor).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np

from .checkpoints import (
    SPECIAL_TOKENS,
    build_tokenizer,
    byte_level_vocab_and_merges,
    random_experts,
    write_hf,
)
from .checkpoints import _tokenizer_config as _hf_tokenizer_config

__all__ = [
    "HYBRID_TINY",
    "GGUF_ARCH",
    "hybrid_config",
    "hybrid_random_weights",
    "to_multimodal_weights",
    "multimodal_config",
    "write_hybrid_hf",
    "hybrid_gguf_tensors",
    "write_hybrid_gguf",
    "hybrid_bench_config",
    "hybrid_bench_gguf",
    "reorder_v_heads",
]

GGUF_ARCH = {
    "qwen3_next": "qwen3next",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
}

_ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}

# ----------------------------------------------------------------------------
# tiny configs
# ----------------------------------------------------------------------------


def _layer_types(n_layers: int, interval: int) -> list[str]:
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]


def hybrid_config(kind: str, **overrides) -> dict:
    """A tiny HF text config of ``kind`` ("qwen3_next", "qwen3_5", "qwen3_5_moe").

    Keys as in the fixtures' config.json (transformers 5.23 spelling plus the keys real
    checkpoints carry: ``rope_theta`` / ``partial_rotary_factor`` beside ``rope_parameters``).
    ``layer_types`` is recomputed from ``num_hidden_layers`` / ``full_attention_interval`` unless
    given. Token ids follow ``checkpoints.build_tokenizer`` (<unk>=0, <s>=1, </s>=2, no BOS added).
    """
    if kind not in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"unknown hybrid kind {kind!r}")
    model_type = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text"}.get(
        kind, "qwen3_5_moe_text"
    )
    cfg: dict = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": 768,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if kind == "qwen3_next":
        cfg.update(
            intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            partial_rotary_factor=0.25,
            rope_theta=10000000.0,
            rope_scaling=None,
            rope_parameters={
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000.0,
                "rope_type": "default",
            },
        )
    else:
        cfg.update(
            attn_output_gate=True,
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
            rope_parameters={
                "mrope_interleaved": True,
                "mrope_section": [2, 1, 1],
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000.0,
                "rope_type": "default",
            },
        )
        if kind == "qwen3_5":
            cfg["intermediate_size"] = 96
    if kind in ("qwen3_next", "qwen3_5_moe"):
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    cfg.update(overrides)
    if "layer_types" not in overrides:
        cfg["layer_types"] = _layer_types(
            int(cfg["num_hidden_layers"]), int(cfg["full_attention_interval"])
        )
    return dict(sorted(cfg.items()))


HYBRID_TINY: dict[str, dict] = {
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba, every layer MoE (8 experts top-2) + a
    # sigmoid-gated shared expert, partial RoPE (8 of 32 dims), (1+w) norms.
    "qwen3_next": hybrid_config("qwen3_next"),
    # Qwen3.5 dense: separate in_proj_qkv / z / b / a, interleaved mRoPE sections [2, 1, 1].
    "qwen3_5": hybrid_config("qwen3_5"),
    # Qwen3.5 MoE: as Qwen3.5 with Qwen3-Next's MoE block.
    "qwen3_5_moe": hybrid_config("qwen3_5_moe"),
}


def _text(config: dict) -> dict:
    """The text config (``text_config`` of a multimodal Qwen3.5 config, else ``config``)."""
    return config.get("text_config") or config


def _is_moe(cfg: dict) -> bool:
    return bool(cfg.get("num_experts"))


def _is_fused_gdn(cfg: dict) -> bool:
    return cfg["model_type"] == "qwen3_next"


def _layer_kinds(cfg: dict) -> list[str]:
    lt = cfg.get("layer_types")
    if lt is None:
        lt = _layer_types(int(cfg["num_hidden_layers"]), int(cfg.get("full_attention_interval", 4)))
    return list(lt)


def _n_mtp(cfg: dict, weights: dict | None = None) -> int:
    """MTP layer count: ``mtp_num_hidden_layers``, or (Qwen3-Next) counted from ``mtp.layers.*``."""
    if weights is not None:
        idx = {
            int(n.split(".")[2])
            for n in weights
            if n.startswith("mtp.layers.") and n.split(".")[2].isdecimal()
        }
        return max(idx) + 1 if idx else 0
    return int(cfg.get("mtp_num_hidden_layers") or 0)


def _dims(cfg: dict) -> dict:
    d = {
        "D": int(cfg["hidden_size"]),
        "H": int(cfg["num_attention_heads"]),
        "KV": int(cfg["num_key_value_heads"]),
        "hd": int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        "nk": int(cfg["linear_num_key_heads"]),
        "nv": int(cfg["linear_num_value_heads"]),
        "dk": int(cfg["linear_key_head_dim"]),
        "dv": int(cfg["linear_value_head_dim"]),
        "K": int(cfg["linear_conv_kernel_dim"]),
        "V": int(cfg["vocab_size"]),
    }
    d["key_dim"] = d["nk"] * d["dk"]
    d["value_dim"] = d["nv"] * d["dv"]
    d["conv_dim"] = 2 * d["key_dim"] + d["value_dim"]
    return d


# ----------------------------------------------------------------------------
# random weights
# ----------------------------------------------------------------------------


def hybrid_random_weights(
    config: dict, seed: int = 0, *, mtp: bool = False, std: float | None = None
) -> dict[str, np.ndarray]:
    """Random float32 weights with HF (text-model) names for a hybrid ``config``.

    Matrices ~ N(0, gain^2 / fan_in) (or N(0, ``std``^2) when ``std`` is given); embedding
    std 0.2 (``std`` if given), lm_head std 0.15; zero-centred (1+w) norms ~ U(-0.3, 0.3);
    ``linear_attn.norm`` ~ U(0.7, 1.3); ``A_log = log U(0.05, 1)``; ``dt_bias`` ~ N(0, 0.5^2);
    conv weights ~ N(0, 0.3^2); routers gain 3; shared-expert gates gain 2. ``mtp=True`` adds the
    ``mtp.*`` tensors (one full-attention MTP layer per ``mtp_num_hidden_layers``, at least 1).
    """
    cfg = _text(config)
    rng = np.random.default_rng(seed)
    d = _dims(cfg)
    D = d["D"]

    def mat(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        s = std if std is not None else gain / math.sqrt(inp)
        return (rng.standard_normal((out, inp)) * s).astype(np.float32)

    def znorm(n: int) -> np.ndarray:
        return rng.uniform(-0.3, 0.3, n).astype(np.float32)

    def pnorm(n: int) -> np.ndarray:
        return rng.uniform(0.7, 1.3, n).astype(np.float32)

    def attn(p: str) -> dict[str, np.ndarray]:
        H, KV, hd = d["H"], d["KV"], d["hd"]
        return {
            p + "self_attn.q_proj.weight": mat(2 * H * hd, D, 1.0),
            p + "self_attn.k_proj.weight": mat(KV * hd, D, 1.0),
            p + "self_attn.v_proj.weight": mat(KV * hd, D, 0.7),
            p + "self_attn.o_proj.weight": mat(D, H * hd, 0.5),
            p + "self_attn.q_norm.weight": znorm(hd),
            p + "self_attn.k_norm.weight": znorm(hd),
        }

    def gdn(p: str) -> dict[str, np.ndarray]:
        nv, kd, vd = d["nv"], d["key_dim"], d["value_dim"]
        q = p + "linear_attn."
        w = {
            q + "A_log": np.log(rng.uniform(0.05, 1.0, nv)).astype(np.float32),
            q + "dt_bias": (0.5 * rng.standard_normal(nv)).astype(np.float32),
            q + "conv1d.weight": (0.3 * rng.standard_normal((d["conv_dim"], 1, d["K"]))).astype(
                np.float32
            ),
            q + "norm.weight": pnorm(d["dv"]),
            q + "out_proj.weight": mat(D, vd, 0.5),
        }
        if _is_fused_gdn(cfg):
            w[q + "in_proj_qkvz.weight"] = mat(2 * kd + 2 * vd, D, 1.0)
            w[q + "in_proj_ba.weight"] = mat(2 * nv, D, 1.0)
        else:
            w[q + "in_proj_qkv.weight"] = mat(2 * kd + vd, D, 1.0)
            w[q + "in_proj_z.weight"] = mat(vd, D, 1.0)
            w[q + "in_proj_b.weight"] = mat(nv, D, 1.0)
            w[q + "in_proj_a.weight"] = mat(nv, D, 1.0)
        return w

    def mlp(p: str) -> dict[str, np.ndarray]:
        if not _is_moe(cfg):
            F = int(cfg["intermediate_size"])
            return {
                p + "mlp.gate_proj.weight": mat(F, D, 1.0),
                p + "mlp.up_proj.weight": mat(F, D, 0.7),
                p + "mlp.down_proj.weight": mat(D, F, 0.5),
            }
        return random_experts(cfg, p + "mlp.", mat)

    emb_std = 0.2 if std is None else std
    head_std = 0.15 if std is None else std
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": (emb_std * rng.standard_normal((d["V"], D))).astype(np.float32)
    }
    for i, kind in enumerate(_layer_kinds(cfg)):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = znorm(D)
        w.update(gdn(p) if kind == "linear_attention" else attn(p))
        w[p + "post_attention_layernorm.weight"] = znorm(D)
        w.update(mlp(p))
    w["model.norm.weight"] = znorm(D)
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = (head_std * rng.standard_normal((d["V"], D))).astype(np.float32)
    if mtp:
        w["mtp.fc.weight"] = mat(D, 2 * D, 1.0)
        w["mtp.pre_fc_norm_embedding.weight"] = znorm(D)
        w["mtp.pre_fc_norm_hidden.weight"] = znorm(D)
        for j in range(max(1, _n_mtp(cfg))):
            p = f"mtp.layers.{j}."
            w[p + "input_layernorm.weight"] = znorm(D)
            w.update(attn(p))
            w[p + "post_attention_layernorm.weight"] = znorm(D)
            w.update(mlp(p))
        w["mtp.norm.weight"] = znorm(D)
    return w


# ----------------------------------------------------------------------------
# HF writer (text-only and published multimodal form)
# ----------------------------------------------------------------------------


def multimodal_config(config: dict) -> dict:
    """The published multimodal Qwen3.5 config around a ``qwen3_5_text`` / ``qwen3_5_moe_text``
    config: ``model_type`` qwen3_5 / qwen3_5_moe, ``text_config``, a tiny ``vision_config``."""
    text = copy.deepcopy(_text(config))
    mt = text["model_type"]
    if mt not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise ValueError(f"no multimodal form for model_type {mt!r}")
    outer = mt.removesuffix("_text")
    text.pop("architectures", None)
    V = int(text["vocab_size"])
    return {
        "architectures": [
            "Qwen3_5ForConditionalGeneration"
            if outer == "qwen3_5"
            else "Qwen3_5MoeForConditionalGeneration"
        ],
        "model_type": outer,
        # placeholders inside the tiny vocab (the real ones are 248053..248057)
        "image_token_id": V - 4,
        "video_token_id": V - 3,
        "vision_start_token_id": V - 2,
        "vision_end_token_id": V - 1,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "text_config": text,
        "vision_config": {
            "model_type": outer,
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 4,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": int(text["hidden_size"]),
            "num_position_embeddings": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.02,
            "deepstack_visual_indexes": [],
        },
        "torch_dtype": "float32",
    }


def _vision_weights(mm_config: dict, seed: int) -> dict[str, np.ndarray]:
    """A one-block Qwen3-VL-style vision tower under ``model.visual.*`` (a text loader skips it)."""
    vc = mm_config["vision_config"]
    rng = np.random.default_rng(seed + 1000)
    h, f, m = int(vc["hidden_size"]), int(vc["intermediate_size"]), int(vc["spatial_merge_size"])
    p, t, c = int(vc["patch_size"]), int(vc["temporal_patch_size"]), int(vc["in_channels"])
    o = int(vc["out_hidden_size"])

    def r(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    v = "model.visual."
    w = {
        v + "patch_embed.proj.weight": r(h, c, t, p, p),
        v + "patch_embed.proj.bias": r(h),
        v + "pos_embed.weight": r(int(vc["num_position_embeddings"]), h),
        v + "merger.norm.weight": 1 + r(h),
        v + "merger.norm.bias": r(h),
        v + "merger.linear_fc1.weight": r(h * m * m, h * m * m),
        v + "merger.linear_fc1.bias": r(h * m * m),
        v + "merger.linear_fc2.weight": r(o, h * m * m),
        v + "merger.linear_fc2.bias": r(o),
    }
    for b in range(int(vc["depth"])):
        q = f"{v}blocks.{b}."
        w.update(
            {
                q + "norm1.weight": 1 + r(h),
                q + "norm1.bias": r(h),
                q + "norm2.weight": 1 + r(h),
                q + "norm2.bias": r(h),
                q + "attn.qkv.weight": r(3 * h, h),
                q + "attn.qkv.bias": r(3 * h),
                q + "attn.proj.weight": r(h, h),
                q + "attn.proj.bias": r(h),
                q + "mlp.linear_fc1.weight": r(f, h),
                q + "mlp.linear_fc1.bias": r(f),
                q + "mlp.linear_fc2.weight": r(h, f),
                q + "mlp.linear_fc2.bias": r(h),
            }
        )
    return w


def to_multimodal_weights(
    config: dict, weights: dict[str, np.ndarray], *, seed: int = 0
) -> dict[str, np.ndarray]:
    """Text weights -> the published multimodal naming: ``model.language_model.*`` (embed, layers,
    norm), ``lm_head.weight`` and ``mtp.*`` at the top, ``model.visual.*`` added, and MoE experts
    of the main layers fused into ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate rows first) and
    ``mlp.experts.down_proj [E, D, F]``. MTP experts stay per-expert."""
    cfg = _text(config)
    out: dict[str, np.ndarray] = {}
    for name, arr in weights.items():
        if name.startswith("model."):
            out["model.language_model." + name[len("model.") :]] = arr
        else:
            out[name] = arr
    if _is_moe(cfg):
        E = int(cfg["num_experts"])
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.language_model.layers.{i}.mlp.experts."
            if f"{p}0.gate_proj.weight" not in out:
                continue
            g, u, dn = (
                np.stack([out.pop(f"{p}{e}.{n}.weight") for e in range(E)])
                for n in ("gate_proj", "up_proj", "down_proj")
            )
            out[p + "gate_up_proj"] = np.concatenate([g, u], axis=1)
            out[p + "down_proj"] = dn
    out.update(_vision_weights(multimodal_config(cfg), seed))
    return out


def write_hybrid_hf(
    dirpath,
    config: dict,
    weights: dict[str, np.ndarray],
    multimodal: bool = False,
    *,
    dtype: str = "float32",
    shards: int = 1,
    seed: int = 0,
) -> Path:
    """Write an HF checkpoint folder (``checkpoints.write_hf`` + its byte-level BPE tokenizer).

    ``multimodal=False``: the text-only form ``Qwen3_5ForCausalLM`` & co. save (``model.*``,
    per-expert tensors), ``weights`` as given. ``multimodal=True`` (Qwen3.5 only): the published
    form, see ``multimodal_config`` / ``to_multimodal_weights`` (``weights`` in text naming)."""
    text = _text(config)
    if not multimodal:
        return write_hf(dirpath, text, weights, dtype=dtype, shards=shards)
    mm = multimodal_config(text)
    d = write_hf(
        dirpath,
        mm,
        to_multimodal_weights(text, weights, seed=seed),
        dtype=dtype,
        shards=shards,
        tokenizer=False,
    )
    gen = {"bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id")}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    build_tokenizer(text).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(_hf_tokenizer_config(text), indent=2) + "\n"
    )
    stm = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (d / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    return d


# ----------------------------------------------------------------------------
# GGUF writer
# ----------------------------------------------------------------------------


def reorder_v_heads(x: np.ndarray, axis: int, nk: int, nv_per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp ``_LinearAttentionVReorderBase._reorder_v_heads``: along ``axis`` (length
    ``nk * nv_per_k * head_dim``) move V heads from grouped order (head ``k * r + j``) to tiled
    order (position ``j * nk + k``)."""
    axis = axis % x.ndim
    shape = list(x.shape)
    y = x.reshape(*shape[:axis], nk, nv_per_k, head_dim, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # MTP block (after the mtp.* remap below)
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

_MTP_GLOBALS = {
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head.norm",
}


def _normalize_name(name: str, n_layer: int) -> str | None:
    """The converter's ``filter_tensors``: drop vision, strip ``language_model.``, remap mtp.*."""
    if "visual." in name or "vision" in name or "patch_embed" in name:
        return None
    name = name.replace("language_model.", "")
    if name.startswith("model.mtp."):
        name = name[len("model.") :]
    if name.startswith("mtp."):
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
            return f"model.layers.{n_layer + int(parts[2])}.{parts[3]}"
        if len(parts) == 3 and parts[1] in _MTP_GLOBALS:
            return f"model.layers.{n_layer}.{_MTP_GLOBALS[parts[1]]}.{parts[2]}"
        raise KeyError(f"unknown MTP tensor {name!r}")
    return name


def _gguf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{int(parts[2])}.{_LAYER_NAMES[parts[3]]}"
    raise KeyError(f"no GGUF name for {name!r}")


def hybrid_gguf_tensors(
    config: dict, weights: dict[str, np.ndarray]
) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in numpy order) pairs, in the converter's order, for
    ``weights`` in text naming, published multimodal naming, or with fused experts."""
    cfg = _text(config)
    arch = GGUF_ARCH[cfg["model_type"]]
    d = _dims(cfg)
    nk, nv, dk, dv = d["nk"], d["nv"], d["dk"], d["dv"]
    r = nv // nk
    n_layer = int(cfg["num_hidden_layers"])
    E = int(cfg.get("num_experts") or 0)
    reorder = arch in ("qwen35", "qwen35moe") and nk != nv
    out: list[tuple[str, np.ndarray]] = []
    pending: dict[int, dict[str, np.ndarray]] = {}

    for orig in sorted(weights):
        name = _normalize_name(orig, n_layer)
        if name is None:
            continue
        t = np.asarray(weights[orig], dtype=np.float32)
        parts = name.split(".")
        bid = int(parts[2]) if name.startswith("model.layers.") else None

        # MoE experts: fused form is split; per-expert tensors are stacked at the last one
        if ".mlp.experts." in name:
            if name.endswith(("experts.down_proj", "experts.down_proj.weight")):
                out.append((f"blk.{bid}.ffn_down_exps.weight", t))
            elif name.endswith(("experts.gate_up_proj", "experts.gate_up_proj.weight")):
                F = t.shape[-2] // 2
                out.append((f"blk.{bid}.ffn_gate_exps.weight", np.ascontiguousarray(t[..., :F, :])))
                out.append((f"blk.{bid}.ffn_up_exps.weight", np.ascontiguousarray(t[..., F:, :])))
            else:
                bucket = pending.setdefault(bid, {})
                bucket[name] = t
                if len(bucket) >= 3 * E:
                    for w_name, gg in (
                        ("down_proj", "down"),
                        ("gate_proj", "gate"),
                        ("up_proj", "up"),
                    ):
                        stacked = np.stack(
                            [
                                bucket.pop(f"model.layers.{bid}.mlp.experts.{e}.{w_name}.weight")
                                for e in range(E)
                            ]
                        )
                        out.append((f"blk.{bid}.ffn_{gg}_exps.weight", stacked))
            continue

        # Qwen3.5: V heads grouped -> tiled
        if reorder and "linear_attn." in name:
            if ".in_proj_qkv." in name:
                kd2 = 2 * nk * dk
                t = np.concatenate([t[:kd2], reorder_v_heads(t[kd2:], 0, nk, r, dv)], axis=0)
            elif ".in_proj_z." in name:
                t = reorder_v_heads(t, 0, nk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = reorder_v_heads(t, 0, nk, r, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                t = reorder_v_heads(t, -1, nk, r, 1)
            elif ".conv1d" in name:
                t = np.squeeze(t)
                kd2 = 2 * nk * dk
                t = np.concatenate([t[:kd2], reorder_v_heads(t[kd2:], 0, nk, r, dv)], axis=0)
            elif ".out_proj." in name:
                t = reorder_v_heads(t, 1, nk, r, dv)

        # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            # torch's float32 exp; numpy's float32 exp can differ by 1 ulp, float64 rounds to the
            # same float32 for these values (checked bit-exactly against the fixtures)
            t = (-np.exp(t.astype(np.float64))).astype(np.float32)
        elif "conv1d" in name:
            t = np.squeeze(t)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + np.float32(1)

        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            per = [dk, dk, r * dv, r * dv]
            g = t.reshape(nk, sum(per), t.shape[-1])
            q, k, v, z = np.split(g, np.cumsum(per)[:-1], axis=1)
            qkv = np.concatenate([x.reshape(-1, t.shape[-1]) for x in (q, k, v)], axis=0)
            out.append((f"blk.{bid}.attn_qkv.weight", np.ascontiguousarray(qkv)))
            out.append(
                (f"blk.{bid}.attn_gate.weight", np.ascontiguousarray(z.reshape(-1, t.shape[-1])))
            )
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            continue
        out.append((_gguf_name(name), np.ascontiguousarray(t)))

    left = [n for b in pending.values() for n in b]
    if left:
        raise ValueError(f"unprocessed experts: {left[:4]}...")
    return out


def _gguf_tokenizer(config: dict, tokenizer_dir) -> dict:
    """tokens, types, merges, pre, special ids (in the converter's order), add_bos."""
    import gguf

    if tokenizer_dir is None:
        tokens, merges = byte_level_vocab_and_merges(int(config["vocab_size"]))
        types = [
            gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens
        ]
        special = {}
        if config.get("eos_token_id") is not None:
            special["eos"] = int(config["eos_token_id"])
        if config.get("bos_token_id") is not None:
            special["bos"] = int(config["bos_token_id"])
        return {
            "pre": "default",
            "tokens": tokens,
            "types": types,
            "merges": [f"{a} {b}" for a, b in merges],
            "special": special,
            "add_bos": False,
        }
    # an HF tokenizer.json (+ tokenizer_config.json) as the converter's _set_vocab_gpt2 reads it
    td = Path(tokenizer_dir)
    tj = json.loads((td / "tokenizer.json").read_text())
    tc_path = td / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    vocab = dict(tj["model"]["vocab"])
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    rev = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(int(config["vocab_size"])):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif rev[i] in added:
            tokens.append(rev[i])
            special = added[rev[i]].get("special", False)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(rev[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]

    def tok_id(v):
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if v is not None else None

    special: dict[str, int] = {}
    for key in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        i = tok_id(tc.get(f"{key}_token"))
        if i is not None:
            special[key] = int(i)
    for key in ("bos", "eos"):
        if key not in special and config.get(f"{key}_token_id") is not None:
            special[key] = int(config[f"{key}_token_id"])
    pre = "qwen2"
    return {
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "special": special,
        "add_bos": tc.get("add_bos_token"),
    }


_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic, gguf-py's spelling
    "pad": "tokenizer.ggml.padding_token_id",
    "cls": "tokenizer.ggml.cls_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}

_FORCE_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def write_hybrid_gguf(
    path,
    config: dict,
    weights: dict[str, np.ndarray],
    *,
    qtype: str = "F32",
    name: str | None = None,
    tokenizer_dir=None,
    qtypes: dict[str, str] | None = None,
) -> Path:
    """Write a qwen3next / qwen35 / qwen35moe GGUF as llama.cpp's converter would; returns path.

    * ``config``: a hybrid text config (or a multimodal Qwen3.5 config with ``text_config``).
    * ``weights``: HF names (text or multimodal form); ``mtp.*`` tensors, when present, become
      block ``num_hidden_layers`` and ``nextn_predict_layers`` is written.
    * ``qtype``: "F32" (default), "F16", "BF16" or "Q8_0" for weight matrices, with the converter's
      rules: 1-D tensors, ``*_norm.weight``, ``ssm_conv1d``, ``ffn_gate_inp``(``_shexp``) and
      non-``.weight`` tensors stay F32; a matrix whose rows don't fit the block falls back to F16.
    * ``qtypes``: GGUF tensor name -> a type gguf-py quantizes, where a matrix is not ``qtype``
      (layers that mix formats, as llama.cpp's K-quant mixes do).
    * ``name``: ``general.name`` (default ``tiny-<arch>``); ``general.size_label`` is computed.
    * ``tokenizer_dir``: take the tokenizer from an HF folder's tokenizer.json (pre ``qwen2``),
      else the ``checkpoints`` byte-level BPE (pre ``default``).
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = _text(config)
    arch = GGUF_ARCH[cfg["model_type"]]
    d = _dims(cfg)
    n_layer = int(cfg["num_hidden_layers"])
    n_mtp = _n_mtp(cfg, weights)
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta"))
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    qt = gguf.GGMLQuantizationType[qtype.upper()]
    ftype = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "BF16": gguf.LlamaFileType.MOSTLY_BF16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[qt.name]

    w = gguf.GGUFWriter(str(path), arch)
    for tname, arr in hybrid_gguf_tensors(cfg, weights):
        t_qt = gguf.GGMLQuantizationType[qtypes[tname]] if tname in (qtypes or {}) else qt
        if arr.ndim <= 1 or tname.endswith("_norm.weight") or tname.endswith(_FORCE_F32):
            t_qt = gguf.GGMLQuantizationType.F32
        elif not tname.endswith(".weight"):
            t_qt = gguf.GGMLQuantizationType.F32
        try:
            data = gguf.quants.quantize(arr, t_qt)
        except gguf.QuantError:
            t_qt = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(arr, t_qt)
        w.add_tensor(tname, data, raw_dtype=t_qt)

    total, shared, expert, n_exp = w.get_total_parameter_count()
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"tiny-{arch}")
    if total > 0:
        w.add_size_label(gguf.size_label(total, shared, expert, n_exp))
    # TextModel.set_gguf_parameters
    w.add_block_count(n_layer + n_mtp)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(d["D"])
    if cfg.get("intermediate_size") is not None:
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(d["H"])
    w.add_head_count_kv(d["KV"])
    if "mrope_section" in rope:
        sections = list(rope["mrope_section"])[:4]
        w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if _is_moe(cfg):
        w.add_expert_count(int(cfg["num_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("head_dim") is not None:
        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
    w.add_file_type(ftype)
    # Qwen2MoeModel
    if cfg.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    # _QwenMtpMixin
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    # Qwen3NextModel
    w.add_ssm_conv_kernel(d["K"])
    w.add_ssm_state_size(d["dk"])
    w.add_ssm_group_count(d["nk"])
    w.add_ssm_time_step_rank(d["nv"])
    w.add_ssm_inner_size(d["value_dim"])
    if cfg.get("layer_types") is not None:
        rec = [t == "linear_attention" for t in cfg["layer_types"]] + [False] * n_mtp
        w.add_array(f"{arch}.attention.recurrent_layers", rec)
    w.add_full_attention_interval(int(cfg.get("full_attention_interval", 4)))
    w.add_rope_dimension_count(int(d["hd"] * prf))
    if arch != "qwen3next" and "mrope_section" not in rope:
        w.add_rope_dimension_sections([11, 11, 10, 0])  # _Qwen35MRopeMixin default
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tok = _gguf_tokenizer(cfg, tokenizer_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    for key, i in tok["special"].items():
        w.add_uint32(_SPECIAL_ID_KEYS[key], i)
    if tok["add_bos"] is not None:
        w.add_add_bos_token(bool(tok["add_bos"]))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------
# benchmark-size GGUF
# ----------------------------------------------------------------------------

_ARCH_KIND = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}


def hybrid_bench_config(
    arch: str = "qwen35",
    d_model: int = 512,
    n_layers: int = 8,
    *,
    vocab_size: int = 4096,
    full_attention_interval: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 128,
    linear_key_heads: int = 4,
    linear_value_heads: int = 8,
    linear_head_dim: int = 64,
    intermediate_size: int | None = None,
    n_experts: int = 64,
    top_k: int = 8,
    expert_width: int = 256,
    shared_width: int = 512,
    max_position_embeddings: int = 4096,
) -> dict:
    """A hybrid HF text config of benchmark size (default: 8 layers = 6 GDN + 2 attention at
    d_model 512; MoE archs 64 experts top-8 width 256 plus a 512-wide shared expert)."""
    kind = _ARCH_KIND[arch]
    over: dict = {
        "vocab_size": vocab_size,
        "hidden_size": d_model,
        "num_hidden_layers": n_layers,
        "full_attention_interval": full_attention_interval,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": linear_key_heads,
        "linear_num_value_heads": linear_value_heads,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "max_position_embeddings": max_position_embeddings,
    }
    if kind != "qwen3_5_moe":
        over["intermediate_size"] = intermediate_size or 3 * d_model
    if kind != "qwen3_5":
        over.update(
            num_experts=n_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=expert_width,
            shared_expert_intermediate_size=shared_width,
        )
    if kind != "qwen3_next":
        over["rope_parameters"] = {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
            "rope_type": "default",
        }
    return hybrid_config(kind, **over)


def hybrid_bench_gguf(
    path,
    arch: str = "qwen35",
    d_model: int = 512,
    n_layers: int = 8,
    *,
    qtype: str = "F32",
    seed: int = 0,
    std: float = 0.02,
    mtp: bool = False,
    **config_kw,
) -> Path:
    """Write a random hybrid GGUF of benchmark size (see ``hybrid_bench_config``) that llama.cpp
    loads; weights ~ N(0, ``std``^2) so activations stay small. Returns the path; the HF config
    is ``hybrid_bench_config(arch, d_model, n_layers, **config_kw)``. F32 qwen35moe at the
    defaults is ~850 MB; pass ``qtype="Q8_0"`` or fewer/narrower experts for a smaller file."""
    cfg = hybrid_bench_config(arch, d_model, n_layers, **config_kw)
    weights = hybrid_random_weights(cfg, seed, mtp=mtp, std=std)
    return write_hybrid_gguf(path, cfg, weights, qtype=qtype, name=f"bench-{arch}")
