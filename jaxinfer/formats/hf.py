"""Hugging Face checkpoints: a folder of config.json, *.safetensors and tokenizer files.

`model_config` converts config.json to a ModelConfig, `tensor_name` names each parameter's
tensor, and `open_hf` opens the folder as a `Checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ARCHS, HYBRID_ARCHS, ModelConfig, RopeScaling
from ..errors import CheckpointError, UnsupportedModelError
from .checkpoint import Checkpoint, ParamPath, param_key
from .tokenizer import Tokenizer

# model_type -> arch: the text-only Qwen3.5 checkpoints and the multimodal ones (whose
# text_config holds the language model) load the same text model.
ARCH = {a: a for a in ARCHS} | {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
MULTIMODAL = ("qwen3_5", "qwen3_5_moe")  # model_types whose language model is in text_config
LAYER_TYPES = ("full_attention", "linear_attention")


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def _object(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested object of config.json ({} when absent or null)."""
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"config.json {key} is {value!r:.40}, not an object; fix the file")
    return value


def _rope_scaling(rs: dict | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported; supported: llama3"
        )
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position=int(rs["original_max_position_embeddings"]),
    )


def moe_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """ModelConfig's expert fields from a HF config (Mixtral, Qwen2-MoE, Qwen3-MoE and the
    expert block of Qwen3-Next / Qwen3.5-MoE); {} for a dense model."""
    n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not n_experts:
        return {}
    dense: tuple[int, ...]
    if cfg.get("model_type") == "mixtral":  # softmax then top-k then renormalize
        width, norm, shared, step, dense = int(cfg["intermediate_size"]), True, 0, 1, ()
    else:
        width = int(cfg["moe_intermediate_size"])
        norm = bool(cfg.get("norm_topk_prob", False))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = tuple(int(i) for i in cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(n_layers) if i in dense or (i + 1) % step)
    return dict(
        n_experts=n_experts,
        n_experts_used=int(cfg["num_experts_per_tok"]),
        d_ff_expert=width,
        norm_topk_prob=norm,
        d_ff_shared=shared,
        shared_gate=shared > 0,  # Qwen2-MoE / Qwen3-Next: sigmoid(shared_expert_gate(x))
        dense_layers=dense,
    )


def text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The language model's config: config.json itself, or the `text_config` of a multimodal
    checkpoint (Qwen3.5 as published); True when the vision tower is left out."""
    if cfg.get("model_type") in MULTIMODAL and isinstance(cfg.get("text_config"), dict):
        text = dict(cfg["text_config"])
        text.setdefault("model_type", cfg["model_type"] + "_text")
        for key in ("tie_word_embeddings", "_name_or_path"):
            if key in cfg:
                text.setdefault(key, cfg[key])
        return text, True
    return cfg, False


def linear_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The hybrid layer pattern and Gated DeltaNet dimensions of a Qwen3-Next / Qwen3.5
    config: `layer_types`, else every `full_attention_interval`-th layer attends."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise UnsupportedModelError(
            f"config.json layer_types has {unknown}; known: {', '.join(LAYER_TYPES)}"
        )
    if len(types) != n_layers:
        raise CheckpointError(
            f"config.json layer_types lists {len(types)} layers but num_hidden_layers is {n_layers}"
        )
    rope = _object(cfg, "rope_parameters")
    factor = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    heads = max(int(cfg["num_attention_heads"]), 1)  # 0 is refused by ModelConfig
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    return dict(
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_k_heads=int(cfg["linear_num_key_heads"]),
        linear_v_heads=int(cfg["linear_num_value_heads"]),
        linear_k_dim=int(cfg["linear_key_head_dim"]),
        linear_v_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        attn_gate=bool(cfg.get("attn_output_gate", True)),
        rotary_dim=int(int(head_dim) * factor),
        mtp_layers=int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers", 0)),
    )


def model_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict (for a multimodal checkpoint,
    pass `text_config(cfg)[0]`)."""
    model_type = cfg.get("model_type")
    arch = ARCH.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        known = sorted(set(ARCH) | set(MULTIMODAL))
        raise UnsupportedModelError(
            f"config.json model_type {model_type!r} is not supported; supported: {', '.join(known)}"
        )
    try:
        d_model = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        window = cfg.get("sliding_window")
        if arch.startswith("qwen"):  # Qwen declares a window but turns it off by default
            if cfg.get("use_sliding_window"):
                raise UnsupportedModelError(
                    "per-layer sliding windows (Qwen use_sliding_window) are not supported"
                )
            window = None
        hybrid = linear_fields(cfg, n_layers) if arch in HYBRID_ARCHS else {}
        if arch == "qwen3_5_moe":  # its router always renormalizes the top-k weights
            cfg = {"norm_topk_prob": True, **cfg}
        moe = moe_fields(cfg, n_layers)
        rope = _object(cfg, "rope_parameters")
        return ModelConfig(
            arch=arch,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or d_model // max(n_heads, 1)),
            d_ff=int(cfg.get("intermediate_size") or moe.get("d_ff_expert") or 0)
            if moe
            else int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_rope_scaling(_object(cfg, "rope_scaling") or rope),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qk_norm=arch in ("qwen3", "qwen3_moe", *HYBRID_ARCHS),
            qkv_bias=bool(cfg.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))
            or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            name=cfg.get("_name_or_path", "") or arch,
            **moe,
            **hybrid,
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:  # int("x"), float(None), int(inf)
        raise CheckpointError(
            f"config.json has a value of the wrong type ({' '.join(str(e).split())}); fix the "
            "file or download it again"
        ) from None


# ---------------------------------------------------------------------------------------------
# Tensor names (keys: checkpoint.param_key)

LAYER = {  # under model.layers.{i}.
    "attn_norm": "input_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wgate": "self_attn.q_proj.weight",  # beside the query rows
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.q_norm": "self_attn.q_norm.weight",
    "attn.k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
    # Gated DeltaNet: q, k, v (and their conv) share a fused tensor; Qwen3-Next fuses more
    "linear_attn.wq": "linear_attn.in_proj_qkv.weight",
    "linear_attn.wk": "linear_attn.in_proj_qkv.weight",
    "linear_attn.wv": "linear_attn.in_proj_qkv.weight",
    "linear_attn.qkvz": "linear_attn.in_proj_qkvz.weight",  # Qwen3-Next: wq wk wv wz
    "linear_attn.wz": "linear_attn.in_proj_z.weight",
    "linear_attn.wb": "linear_attn.in_proj_b.weight",
    "linear_attn.wa": "linear_attn.in_proj_a.weight",
    "linear_attn.ba": "linear_attn.in_proj_ba.weight",  # Qwen3-Next: wb wa
    "linear_attn.conv_q": "linear_attn.conv1d.weight",
    "linear_attn.conv_k": "linear_attn.conv1d.weight",
    "linear_attn.conv_v": "linear_attn.conv1d.weight",
    "linear_attn.a": "linear_attn.A_log",
    "linear_attn.dt_bias": "linear_attn.dt_bias",
    "linear_attn.norm": "linear_attn.norm.weight",
    "linear_attn.wo": "linear_attn.out_proj.weight",
}
# The expert block, under `mlp.` (Qwen) or `block_sparse_moe.` (Mixtral)
MOE = {
    "moe.router": "gate.weight",
    "moe.shared.w_gate": "shared_expert.gate_proj.weight",
    "moe.shared.w_up": "shared_expert.up_proj.weight",
    "moe.shared.w_down": "shared_expert.down_proj.weight",
    "moe.shared_gate": "shared_expert_gate.weight",
}
# Stacked experts -> (per-expert name: Qwen, Mixtral; the fused tensor of all experts)
EXPERTS = {
    "moe.w_gate": ("gate_proj", "w1", "gate_up_proj"),
    "moe.w_up": ("up_proj", "w3", "gate_up_proj"),
    "moe.w_down": ("down_proj", "w2", "down_proj"),
}
GLOBAL = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    # the multi-token-prediction head (Qwen3.5 / Qwen3-Next); its layer is mtp.layers.0.
    "mtp.fc": "mtp.fc.weight",
    "mtp.embed_norm": "mtp.pre_fc_norm_embedding.weight",
    "mtp.hidden_norm": "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm": "mtp.norm.weight",
}


def tensor_name(path: ParamPath, cfg: ModelConfig, prefix: str = "model.") -> str:
    """The tensor of parameter `path`; `prefix` is where the language model lives (model. or,
    multimodal, model.language_model.). Stacked experts: the fused tensor, or with an expert
    index appended, that expert's."""
    expert = path[-1] if isinstance(path[-1], int) and len(path) > 2 else None
    path = path[:-1] if expert is not None else path
    key = param_key(path)
    if path[0] != "layers":
        name = GLOBAL[key]
    else:
        block = "block_sparse_moe." if cfg.arch == "mixtral" else "mlp."
        if key in MOE:
            leaf = block + MOE[key]
        elif key in EXPERTS:
            qwen, mixtral, fused = EXPERTS[key]
            each = f"{expert}.{mixtral if cfg.arch == 'mixtral' else qwen}.weight"
            leaf = f"{block}experts.{fused if expert is None else each}"
        else:
            leaf = LAYER[key]
        if path[1] == cfg.n_layers:  # the MTP layer
            return "mtp.layers.0." + leaf
        name = f"model.layers.{path[1]}.{leaf}"
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


# ---------------------------------------------------------------------------------------------
# The folder


def open_hf(folder: Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(folder)!r} has no config.json; is it a Hugging Face model?")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file} is not a JSON object; fix or re-download it")
    text, multimodal = text_config(raw)
    config = model_config(text)

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed ({e!r})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f.name for f in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{str(folder)!r} holds no *.safetensors weights")
    handles = {}
    owner = {}
    for name in files:
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"shard {name!r} named in the index is missing from {folder}")
        try:
            handles[name] = safe_open(str(f), framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file ({e})") from None
        for key in handles[name].keys():
            owner[key] = name
    dtypes = sorted({str(handles[owner[k]].get_slice(k).get_dtype()) for k in owner})
    prefix = "model.language_model." if multimodal else "model."
    # Checked now: a corrupt count would build a model of billions of layers before any
    # tensor is found missing.
    ids = {k[len(prefix) :].split(".")[1] for k in owner if k.startswith(prefix + "layers.")}
    if sum(i.isascii() and i.isdigit() and int(i) < config.n_layers for i in ids) < config.n_layers:
        raise CheckpointError(
            f"config.json declares {config.n_layers} layers but the weights hold {len(ids)} "
            f"({prefix}layers.N); fix config.json or the weights"
        )
    skipped = sorted(k for k in owner if not k.startswith((prefix, "lm_head.", "mtp.")))
    note = f"; {len(skipped)} vision tower tensors skipped" if multimodal and skipped else ""

    def read(name: str) -> np.ndarray:
        dtype = handles[owner[name]].get_slice(name).get_dtype()
        if dtype not in ("F32", "F16", "BF16", "F64"):  # FP8, int8/4-bit (quantized), complex
            raise UnsupportedModelError(
                f"tensor {name!r} is stored as {dtype}; jaxinfer reads F32, F16, BF16 and F64 "
                "safetensors weights, not quantized ones"
            )
        try:
            w = handles[owner[name]].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} ({e})") from None
        return np.asarray(w, dtype=np.float32)

    if not config.mtp_layers and "mtp.fc.weight" in owner:  # Qwen3-Next configs omit the count
        mtp = {k.split(".")[2] for k in owner if k.startswith("mtp.layers.")}
        config = dataclasses.replace(config, mtp_layers=len(mtp))
    return Checkpoint(  # boilerplate (the same keywords as gguf.open_gguf's)
        config=config,
        tokenizer=Tokenizer.from_hf_dir(folder),
        kind="hf",
        format=f"safetensors ({', '.join(dtypes)}){note}",
        read=read,
        names=set(owner),
        name=lambda path: tensor_name(path, config, prefix),
    )
