"""GGUF models (llama.cpp): metadata -> ModelConfig, tensor names, the block split of quantized
tensors into QArray parts, and `open_gguf` (the container itself: gguf_file.py).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..config import HYBRID_ARCHS, ModelConfig
from ..errors import CheckpointError, UnsupportedModelError
from ..ops import quant
from ..ops.quant import HostQuant
from . import gguf_file
from .checkpoint import Checkpoint, ParamPath, param_key
from .tokenizer import Tokenizer

log = logging.getLogger("jaxinfer")
ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
}  # general.architecture -> arch


# ---------------------------------------------------------------------------------------------
# Metadata -> ModelConfig


def _number(meta: dict[str, Any], key: str, default: Any = None, kind: type = int):
    """Metadata `key` as an int (or float): the first entry of a per-layer list (uniform models
    only); a one-line CheckpointError when it is missing without a default, or not a number."""
    value = meta.get(key, default)
    if value is None:
        raise CheckpointError(f"GGUF metadata lacks {key}")
    if isinstance(value, list) and value:
        value = value[0]
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        expected = "an integer" if kind is int else "a finite number"
        raise CheckpointError(
            f"GGUF metadata {key} is {value!r:.40}, not {expected}; the file is corrupt, "
            "re-convert it"
        )
    return kind(value)


def _check_layers(gguf_arch: str, n_blocks: int, n_layers: int, tensors: set[str]) -> None:
    """The declared layer count matches the blk.N tensors: a corrupt count would build a model
    of billions of layers, or silently drop some."""
    ids = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    layers = {int(i) for i in ids if i.isascii() and i.isdigit()}
    if sum(i < n_layers for i in layers) < n_layers or max(layers, default=-1) >= n_blocks:
        span = f"blk.0 to blk.{max(layers)}" if layers else "none"
        raise CheckpointError(
            f"GGUF metadata declares {gguf_arch}.block_count = {n_blocks} but the file holds "
            f"tensors of {len(layers)} layers ({span}); the file is corrupt, re-convert it"
        )


def _moe_fields(meta: dict[str, Any], gguf_arch: str, n_layers: int, tensors: set[str]):
    """Expert fields from GGUF metadata; a layer without a router keeps the dense MLP."""
    n_experts = _number(meta, f"{gguf_arch}.expert_count", 0)
    if not n_experts:
        return {}
    dense = []
    for i in range(n_layers):
        router = f"blk.{i}.ffn_gate_inp.weight"
        stacked = [f"blk.{i}.ffn_{w}_exps.weight" for w in ("gate", "up", "down")]
        if f"blk.{i}.ffn_gate.0.weight" in tensors:
            raise UnsupportedModelError(
                f"this GGUF stores experts one tensor each (blk.{i}.ffn_gate.0.weight, an "
                "early-2024 layout); convert the model again with a current llama.cpp"
            )
        if router in tensors:
            missing = [n for n in stacked if n not in tensors]
            if missing:
                raise CheckpointError(f"GGUF has router {router!r} but lacks {missing[0]!r}")
        elif any(n in tensors for n in stacked):
            raise CheckpointError(f"GGUF has expert tensors in layer {i} but no router {router!r}")
        else:
            dense.append(i)
    if len(dense) == n_layers:
        raise CheckpointError(
            f"GGUF metadata declares {gguf_arch}.expert_count = {n_experts} but no layer has "
            "a router (blk.N.ffn_gate_inp.weight)"
        )
    width = f"{gguf_arch}.expert_feed_forward_length"
    if width not in meta:  # Mixtral-style llama GGUFs: the experts have the model's ffn width
        width = f"{gguf_arch}.feed_forward_length"
    shared = _number(meta, f"{gguf_arch}.expert_shared_feed_forward_length", 0)
    if not shared and "blk.0.ffn_up_shexp.weight" in tensors:
        raise CheckpointError(
            f"GGUF has shared experts but no {gguf_arch}.expert_shared_feed_forward_length"
        )
    # llama.cpp renormalizes the k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE.
    norm = meta.get(f"{gguf_arch}.expert_weights_norm", gguf_arch != "qwen2moe")
    return dict(
        n_experts=n_experts,
        n_experts_used=_number(meta, f"{gguf_arch}.expert_used_count", 0),
        d_ff_expert=_number(meta, width),
        norm_topk_prob=bool(norm),
        d_ff_shared=shared,
        shared_gate=any(f"blk.{i}.ffn_gate_inp_shexp.weight" in tensors for i in range(n_layers)),
        dense_layers=tuple(dense),
    )


def model_config(meta: dict[str, Any], tensors: set[str]) -> ModelConfig:
    """Build a ModelConfig from decoded GGUF metadata and the set of tensor names."""
    gguf_arch = meta.get("general.architecture")
    if not isinstance(gguf_arch, str) or gguf_arch not in ARCH:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(ARCH)}"
        )

    def get(key, default=None, kind=int):  # per-layer lists (some converters): the first entry
        return _number(meta, f"{gguf_arch}.{key}", default, kind)

    d_model = get("embedding_length")
    n_heads = get("attention.head_count")
    # Multi-token prediction blocks (Qwen3.5, Qwen3-Next) follow the trunk's layers.
    n_blocks = get("block_count")
    n_layers = n_blocks - get("nextn_predict_layers", 0)
    _check_layers(gguf_arch, n_blocks, n_layers, tensors)
    n_kv = get("attention.head_count_kv", n_heads)
    moe = _moe_fields(meta, gguf_arch, n_layers, tensors)
    n_ff = get("feed_forward_length", moe.get("d_ff_expert"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", 0) or (len(tokens) if isinstance(tokens, list) else 0)
    if not vocab:
        raise CheckpointError("GGUF has neither a vocab_size nor a tokenizer vocabulary")
    window = get("attention.sliding_window", 0)
    arch = ARCH[gguf_arch]
    hybrid = _linear_fields(meta, gguf_arch, n_layers) if arch in HYBRID_ARCHS else {}
    if arch == "llama" and moe:
        arch = "mixtral"  # llama.cpp writes Mixtral as llama with experts
    return ModelConfig(
        arch=arch,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=get("attention.key_length", 0) or d_model // max(n_heads, 1),
        d_ff=n_ff,
        vocab_size=vocab,
        rope_theta=get("rope.freq_base", 10000.0, float),
        norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5, float),
        qk_norm=arch in HYBRID_ARCHS or "blk.0.attn_q_norm.weight" in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        sliding_window=window or None,
        max_position=get("context_length", 2048),
        name=str(meta.get("general.name") or gguf_arch),
        **moe,
        **hybrid,
    )


def _linear_fields(meta: dict[str, Any], gguf_arch: str, n_layers: int) -> dict[str, Any]:
    """The layer pattern and Gated DeltaNet dimensions from llama.cpp's `ssm.*` keys:
    `attention.recurrent_layers`, else every `full_attention_interval`-th layer attends."""

    def get(key, default=None):
        return _number(meta, f"{gguf_arch}.{key}", default)

    recurrent = meta.get(f"{gguf_arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = get("full_attention_interval")
        if interval <= 0:
            raise CheckpointError(f"GGUF {gguf_arch}.full_attention_interval is {interval}")
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    if not isinstance(recurrent, list) or len(recurrent) < n_layers:
        raise CheckpointError(
            f"GGUF {gguf_arch}.attention.recurrent_layers is not a list of {n_layers} flags"
        )
    v_heads = get("ssm.time_step_rank")
    inner = get("ssm.inner_size")
    if v_heads <= 0 or inner % v_heads:
        raise CheckpointError(
            f"GGUF {gguf_arch}.ssm.inner_size ({inner}) is not a multiple of its "
            f"{v_heads} value heads (ssm.time_step_rank)"
        )
    head_dim = get("attention.key_length", 0)
    return dict(
        linear_layers=tuple(i for i in range(n_layers) if recurrent[i]),
        linear_k_heads=get("ssm.group_count"),
        linear_v_heads=v_heads,
        linear_k_dim=get("ssm.state_size"),
        linear_v_dim=inner // v_heads,
        conv_kernel=get("ssm.conv_kernel"),
        attn_gate=True,
        rotary_dim=get("rope.dimension_count", 0) or head_dim,
        mtp_layers=get("nextn_predict_layers", 0),
        linear_out_tiled=gguf_arch in ("qwen35", "qwen35moe"),  # ssm_out's V heads tiled
    )


# ---------------------------------------------------------------------------------------------
# Tensor names (keys: checkpoint.param_key)

LAYER = {  # under blk.{i}.
    "attn_norm": "attn_norm.weight",
    "attn.wq": "attn_q.weight",
    "attn.wgate": "attn_q.weight",  # beside the query rows
    "attn.wk": "attn_k.weight",
    "attn.wv": "attn_v.weight",
    "attn.wo": "attn_output.weight",
    "attn.bq": "attn_q.bias",
    "attn.bk": "attn_k.bias",
    "attn.bv": "attn_v.bias",
    "attn.q_norm": "attn_q_norm.weight",
    "attn.k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "mlp.w_gate": "ffn_gate.weight",
    "mlp.w_up": "ffn_up.weight",
    "mlp.w_down": "ffn_down.weight",
    "moe.router": "ffn_gate_inp.weight",
    "moe.shared.w_gate": "ffn_gate_shexp.weight",
    "moe.shared.w_up": "ffn_up_shexp.weight",
    "moe.shared.w_down": "ffn_down_shexp.weight",
    "moe.shared_gate": "ffn_gate_inp_shexp.weight",
    "moe.w_gate": "ffn_gate_exps.weight",  # experts stacked [E, ...]
    "moe.w_up": "ffn_up_exps.weight",
    "moe.w_down": "ffn_down_exps.weight",
    # Gated DeltaNet: q, k, v (and their conv) share a fused tensor; Qwen3-Next fuses b and a
    "linear_attn.wq": "attn_qkv.weight",
    "linear_attn.wk": "attn_qkv.weight",
    "linear_attn.wv": "attn_qkv.weight",
    "linear_attn.wz": "attn_gate.weight",
    "linear_attn.wb": "ssm_beta.weight",
    "linear_attn.wa": "ssm_alpha.weight",
    "linear_attn.ba": "ssm_ba.weight",  # Qwen3-Next: wb wa
    "linear_attn.conv_q": "ssm_conv1d.weight",
    "linear_attn.conv_k": "ssm_conv1d.weight",
    "linear_attn.conv_v": "ssm_conv1d.weight",
    "linear_attn.a": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm": "ssm_norm.weight",
    "linear_attn.wo": "ssm_out.weight",
}
GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
# The multi-token-prediction head (Qwen3.5 / Qwen3-Next), under blk.{n_layers}. beside its layer
MTP = {
    "mtp.fc": "nextn.eh_proj.weight",
    "mtp.embed_norm": "nextn.enorm.weight",
    "mtp.hidden_norm": "nextn.hnorm.weight",
    "mtp.norm": "nextn.shared_head_norm.weight",
}


def tensor_name(path: ParamPath, cfg: ModelConfig) -> str:
    """The tensor of parameter `path` (stacked experts: one tensor [E, ...])."""
    key = param_key(path)
    if key in MTP:
        return f"blk.{cfg.n_layers}.{MTP[key]}"
    if path[0] != "layers":
        return GLOBAL[key]
    if key == "mlp_norm" and cfg.arch in HYBRID_ARCHS:
        return f"blk.{path[1]}.post_attention_norm.weight"
    return f"blk.{path[1]}.{LAYER[key]}"


# ---------------------------------------------------------------------------------------------
# Quantized blocks -> QArray parts


def split_blocks(ggml_type: str, data: np.ndarray, shape: tuple[int, ...]) -> HostQuant:
    """GGUF block data (uint8 [rows, bytes per row] as gguf-py reads it) of a tensor of
    logical shape [..., O, I] -> its parts [rows, blocks, entries per block]: views of `data`
    where a part's bytes are stored in it, new arrays where they are unpacked (f16 scales,
    K-quants' 6-bit scales)."""
    fmt = quant.GGML_FORMATS[ggml_type]
    *lead, width = shape
    rows = int(np.prod(lead))
    nb = width // fmt.block
    raw = data.view(np.uint8).reshape(rows, nb, -1)  # [R, nb, bytes], a view of the file
    return HostQuant(fmt.name, _parts(fmt, raw), np.arange(rows).reshape(lead), width)


def _parts(fmt: quant.Format, raw: np.ndarray) -> dict[str, np.ndarray]:
    """GGUF blocks [R, nb, bytes] -> parts [R, nb, per-block entries] (gguf-py quants.py's
    field order)."""
    f16 = lambda b: b.copy().view(np.float16)  # noqa: E731  [R, nb, 2] -> [R, nb, 1]
    name = fmt.name
    if name in ("f16", "bf16"):
        return {"w": raw.view(np.dtype(fmt.parts[0].dtype))}
    if name == "q8_0":
        return {"d": f16(raw[..., :2]), "q": raw[..., 2:].view(np.int8)}
    if name == "q4_0":
        return {"d": f16(raw[..., :2]), "qs": raw[..., 2:]}
    if name == "q4_1":
        return {"d": f16(raw[..., :2]), "m": f16(raw[..., 2:4]), "qs": raw[..., 4:]}
    if name == "q5_0":
        return {"d": f16(raw[..., :2]), "qh": raw[..., 2:6], "qs": raw[..., 6:]}
    if name == "q5_1":
        return {"d": f16(raw[..., :2]), "m": f16(raw[..., 2:4]), "qh": raw[..., 4:8],
                "qs": raw[..., 8:]}  # fmt: skip
    if name in ("q4_k", "q5_k"):
        head = np.ascontiguousarray(raw[..., :16])  # one pass over the blocks' first bytes
        sc, mn = _k_scales(head[..., 4:16])
        out = {"d": f16(head[..., :2]), "dmin": f16(head[..., 2:4]), "sc": sc, "mn": mn}
        if name == "q4_k":
            return {**out, "qs": raw[..., 16:]}
        return {**out, "qh": raw[..., 16:48], "qs": raw[..., 48:]}
    if name == "q6_k":
        return {"ql": raw[..., :128], "qh": raw[..., 128:192],
                "sc": raw[..., 192:208].view(np.int8), "d": f16(raw[..., 208:210])}  # fmt: skip
    raise ValueError(f"no block split for {name!r}")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K 12-byte packed 6-bit scales and mins [..., 12] -> sc, mn [..., 8] uint8.
    Bytes j < 4: d_j & 63 and m_j & 63; bytes 4 + j: (md_j & 15) | (d_j >> 6) << 4 and
    (md_j >> 4) | (m_j >> 6) << 4 (d, m, md: the three groups of 4 bytes), computed on the
    groups as little-endian 32-bit words with per-byte masks: a load reads every block."""
    d, m, md = np.moveaxis(np.ascontiguousarray(packed).view("<u4"), -1, 0)  # [...] each
    low6, low4, top2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x30303030
    sc = np.stack([d & low6, (md & low4) | ((d >> 2) & top2)], axis=-1)
    mn = np.stack([m & low6, ((md >> 4) & low4) | ((m >> 2) & top2)], axis=-1)
    return sc.view(np.uint8), mn.view(np.uint8)


# ---------------------------------------------------------------------------------------------
# The file


# GGUF types held as floats (widened to the compute dtype at load, or kept as a 16-bit QArray)
FLOATS = frozenset({"F32", "F64"})


def open_gguf(file: Path) -> Checkpoint:
    from gguf.quants import dequantize

    gg = gguf_file.read(file)
    types = sorted({t.tensor_type.name for t in gg.tensors})
    for t in gg.tensors:
        if t.tensor_type.name not in quant.GGML_FORMATS and t.tensor_type.name not in FLOATS:
            raise UnsupportedModelError(
                f"tensor {t.name!r} has GGUF type {t.tensor_type.name}, which jaxinfer does not "
                f"keep compressed (it keeps {', '.join(sorted(quant.GGML_FORMATS))}); "
                "re-quantize the model to Q4_K_M, Q5_K_M, Q6_K or Q8_0"
            )
    meta = {}
    for key, value in gg.fields.items():
        try:
            meta[key] = gguf_file.text(value)
        except UnicodeDecodeError:  # a field that is not UTF-8 is not one we need
            continue
    tensors = {t.name: t for t in gg.tensors}
    config = model_config(meta, set(tensors))
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, np.float32).ravel()
        config = config.replace(rope_factors=tuple(float(x) for x in factors))

    placed: list = []  # the tensor read last, whose pages go when the next one is read

    def release(t) -> None:
        """Blocks are read in place (views of the mapped file): the pages of the tensor read
        before this one leave the process's resident memory (placed by now when reads and
        copies alternate; placement on several threads drops each block tensor's pages
        after its own copy, gguf_file.release_views, and load() the rest at the end)."""
        for done in placed:
            gg.release(done)
        placed[:] = [t]

    def release_all() -> None:
        """Every tensor's pages out of resident memory: the weights have been placed (read on
        several threads, a tensor's pages can be touched after the next one was read)."""
        for t in gg.tensors:
            gg.release(t)

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        release(t)
        try:
            w = np.array(dequantize(t.data, t.tensor_type), np.float32)  # a copy
        except (NotImplementedError, ValueError) as e:
            raise UnsupportedModelError(
                f"cannot dequantize {name!r} ({t.tensor_type.name}): {e}"
            ) from None
        return w

    def blocks(name: str) -> HostQuant | None:
        t = tensors[name]
        release(t)
        fmt = quant.GGML_FORMATS.get(t.tensor_type.name)
        if fmt is None or len(t.shape) < 2 or int(t.shape[0]) % fmt.block:
            return None
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF ne [in, out, ...]
        assert fmt.ggml is not None  # GGML_FORMATS holds only formats with a GGUF type
        try:
            kept = split_blocks(fmt.ggml, t.data, shape)  # views of the mapped file
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} has malformed {fmt.ggml} data ({e})") from None
        return kept

    return Checkpoint(  # boilerplate (the same keywords as hf.open_hf's)
        config=config,
        tokenizer=Tokenizer.from_gguf(gg.fields, file),
        kind="gguf",
        format=f"GGUF ({', '.join(types)})",
        read=read,
        names=set(tensors),
        name=lambda path: tensor_name(path, config),
        blocks=blocks,
        release=release_all,
        # (a missing tensor: placement's read names it)
        types=lambda name: tensors[name].tensor_type.name if name in tensors else "missing",
    )
