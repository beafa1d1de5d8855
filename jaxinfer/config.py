"""ModelConfig: the frozen description of a decoder model, and its converters.

Hugging Face and GGUF field names appear only in `from_hf` and `from_gguf`; everything else in
jaxinfer reads the short fields below.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float  # long wavelengths are stretched by this much
    low_freq_factor: float  # wavelengths above original_max / low_freq_factor get `factor`
    high_freq_factor: float  # wavelengths below original_max / high_freq_factor are kept
    original_max_position: int  # context length the model was first trained with


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "llama"  # one of ARCHS; decides only converter details, not the graph
    d_model: int = 64  # D: residual width
    n_layers: int = 2  # L
    n_heads: int = 4  # N: query heads
    n_kv_heads: int = 4  # K: key/value heads (GQA: N % K == 0; MQA: K == 1)
    head_dim: int = 16  # H: may differ from D / N (Qwen3)
    d_ff: int = 128  # F: SwiGLU hidden width
    vocab_size: int = 256  # V
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # Llama 3 scaling, from HF config
    rope_factors: tuple[float, ...] | None = None  # GGUF rope_freqs tensor: divides each frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    tie_embeddings: bool = False  # lm_head shares the token embedding
    sliding_window: int | None = None  # keys older than this many positions are masked (Mistral)
    max_position: int = 2048  # context length the model declares
    name: str = ""  # for display only

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise UnsupportedModelError(
                f"unknown architecture {self.arch!r}; supported: {', '.join(ARCHS)}"
            )
        for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, field) <= 0:
                raise CheckpointError(f"model config has {field} = {getattr(self, field)}")
        if self.vocab_size <= 0:
            raise CheckpointError(f"model config has vocab_size = {self.vocab_size}")
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(
                f"model config has n_heads ({self.n_heads}) not divisible by "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"RoPE needs an even head_dim, got {self.head_dim}")

    def n_params(self) -> int:
        D, F, V, H = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        N, K = self.n_heads, self.n_kv_heads
        attn = D * H * (2 * N + 2 * K) + (H * (N + 2 * K) if self.qkv_bias else 0)
        attn += 2 * H if self.qk_norm else 0
        layer = attn + 3 * D * F + 2 * D
        return self.n_layers * layer + V * D * (1 if self.tie_embeddings else 2) + D

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _hf_rope_scaling(rs: dict | None) -> RopeScaling | None:
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


def from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    arch = cfg.get("model_type")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"config.json model_type {arch!r} is not supported; supported: {', '.join(ARCHS)}"
        )
    try:
        d_model = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3"):  # Qwen declares a window but turns it off by default
            if cfg.get("use_sliding_window"):
                raise UnsupportedModelError(
                    "per-layer sliding windows (Qwen use_sliding_window) are not supported"
                )
            window = None
        return ModelConfig(
            arch=arch,
            d_model=d_model,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or d_model // n_heads),
            d_ff=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=_hf_rope_scaling(cfg.get("rope_scaling")),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qk_norm=arch == "qwen3",
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            name=cfg.get("_name_or_path", "") or arch,
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the field {e.args[0]!r}") from None


def from_gguf(meta: dict[str, Any], tensors: set[str]) -> ModelConfig:
    """Build a ModelConfig from decoded GGUF metadata and the set of tensor names."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2, qwen3"
        )

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return value

    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list | tuple):  # per-layer lists (some converters); uniform models only
        n_kv = n_kv[0]
    n_ff = get("feed_forward_length")
    if isinstance(n_ff, list | tuple):
        n_ff = n_ff[0]
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise CheckpointError("GGUF has neither a vocab_size nor a tokenizer vocabulary")
    window = meta.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        arch=arch,
        d_model=d_model,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or d_model // n_heads),
        d_ff=int(n_ff),
        vocab_size=int(vocab),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        sliding_window=int(window) if window else None,
        max_position=int(get("context_length", 2048)),
        name=str(meta.get("general.name") or arch),
    )


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies [H/2] of rotate-half RoPE, with Llama 3 scaling or GGUF factors."""
    import numpy as np

    H = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)  # [H/2]
    if cfg.rope_factors is not None:
        inv = inv / np.asarray(cfg.rope_factors, np.float64)
    elif cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        low_wavelen = rs.original_max_position / rs.low_freq_factor
        high_wavelen = rs.original_max_position / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return inv.astype(np.float32)
