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

ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
    "qwen3_next", "qwen3_5", "qwen3_5_moe",
)  # fmt: skip
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # Gated DeltaNet + gated attention
GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
}  # GGUF general.architecture -> arch
# HF model_type -> arch: the text-only Qwen3.5 checkpoints and the multimodal ones (whose
# text_config holds the language model) load the same text model.
HF_ARCHS = {a: a for a in ARCHS} | {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
MULTIMODAL = ("qwen3_5", "qwen3_5_moe")  # model_types whose language model is in text_config
LAYER_TYPES = ("full_attention", "linear_attention")


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
    # Mixture of experts (n_experts = 0: a dense model). MoE layers replace the MLP with a
    # router over E experts, k of them used per token, plus an optional shared expert.
    n_experts: int = 0  # E
    n_experts_used: int = 0  # k: experts per token (top-k of the router's softmax)
    d_ff_expert: int = 0  # FE: each expert's SwiGLU width
    norm_topk_prob: bool = True  # renormalize the k routing weights to sum to 1
    d_ff_shared: int = 0  # FS: the shared expert's width (0 = none)
    shared_gate: bool = False  # the shared expert is scaled by sigmoid(gate . x) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep the dense MLP
    # Hybrid linear attention (Qwen3-Next, Qwen3.5): these layers are Gated DeltaNet, with
    # HK key heads of width DK and HV value heads of width DV (HV % HK == 0) and a causal conv
    # of `conv_kernel` taps; the other layers attend, with a sigmoid output gate if attn_gate.
    linear_layers: tuple[int, ...] = ()
    linear_k_heads: int = 0  # HK
    linear_v_heads: int = 0  # HV
    linear_k_dim: int = 0  # DK
    linear_v_dim: int = 0  # DV
    conv_kernel: int = 0
    attn_gate: bool = False  # attention output * sigmoid(gate), the gate from q_proj
    rotary_dim: int = 0  # RoPE on the first rotary_dim dims of each head (0: all of them)
    # Multi-token-prediction layers the checkpoint ships (Qwen3.5 / Qwen3-Next); the model
    # builds them only when speculating with them (loader.py sets 0 otherwise)
    mtp_layers: int = 0
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
        if self.n_experts:
            if not 0 < self.n_experts_used <= self.n_experts:
                raise CheckpointError(
                    f"model config routes each token to {self.n_experts_used} experts of "
                    f"{self.n_experts}; it needs 1 <= experts per token <= experts"
                )
            if self.d_ff_expert <= 0:
                raise CheckpointError(f"model config has expert width {self.d_ff_expert}")
            bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
            if bad:
                raise CheckpointError(
                    f"model config names dense layers {bad} outside 0..{self.n_layers - 1}"
                )

        if self.linear_layers:
            bad = [i for i in self.linear_layers if not 0 <= i < self.n_layers]
            if bad:
                raise CheckpointError(
                    f"model config names linear-attention layers {bad} outside "
                    f"0..{self.n_layers - 1}"
                )
            dims = ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim")
            for field in (*dims, "conv_kernel"):
                if getattr(self, field) <= 0:
                    raise CheckpointError(f"model config has {field} = {getattr(self, field)}")
            if self.linear_v_heads % self.linear_k_heads:
                raise CheckpointError(
                    f"model config has {self.linear_v_heads} linear value heads, not a multiple "
                    f"of its {self.linear_k_heads} key heads"
                )
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise CheckpointError(
                f"RoPE dims {self.rotary_dim} must be even and at most head_dim {self.head_dim}"
            )

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear attention) layer."""
        return layer in self.linear_layers

    def kind(self, layer: int) -> tuple[bool, bool]:
        """(linear attention, experts): what a layer's parameters and cache look like."""
        return self.is_linear(layer), self.is_moe(layer)

    @property
    def rope_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_moe(self, layer: int) -> bool:
        """Whether `layer` uses the expert block (else the dense MLP of width d_ff)."""
        return self.n_experts > 0 and layer not in self.dense_layers

    @property
    def moe(self) -> bool:
        return any(self.is_moe(i) for i in range(self.n_layers))

    def n_params(self) -> int:
        D, F, V, H = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        N, K = self.n_heads, self.n_kv_heads
        attn = D * H * (2 * N + 2 * K) + (H * (N + 2 * K) if self.qkv_bias else 0)
        attn += 2 * H if self.qk_norm else 0
        HK, HV = self.linear_k_heads, self.linear_v_heads
        conv = 2 * HK * self.linear_k_dim + HV * self.linear_v_dim
        DV = self.linear_v_dim
        linear = D * (conv + 2 * HV + 2 * HV * DV) + conv * self.conv_kernel + 2 * HV + DV
        attn += D * N * H if self.attn_gate else 0
        total = 0
        for i in range(self.n_layers):
            ffn = 3 * D * F
            if self.is_moe(i):
                ffn = D * self.n_experts + 3 * D * self.n_experts * self.d_ff_expert
                ffn += 3 * D * self.d_ff_shared + (D if self.shared_gate else 0)
            total += (linear if self.is_linear(i) else attn) + ffn + 2 * D
        return total + V * D * (1 if self.tie_embeddings else 2) + D

    def n_active_params(self) -> int:
        """Parameters read per token: only k of the E experts of an MoE layer."""
        unused = self.n_experts - self.n_experts_used
        moe_layers = sum(self.is_moe(i) for i in range(self.n_layers))
        return self.n_params() - moe_layers * unused * 3 * self.d_model * self.d_ff_expert

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _hf_object(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested object of config.json ({} when absent or null)."""
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"config.json {key} is {value!r:.40}, not an object; fix the file")
    return value


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


def hf_moe_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """ModelConfig's expert fields from a HF config (Mixtral, Qwen2-MoE, Qwen3-MoE and the
    expert block of Qwen3-Next / Qwen3.5-MoE); {} for a dense model."""
    n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not n_experts:
        return {}
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


def hf_text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
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


def hf_linear_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
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
    rope = _hf_object(cfg, "rope_parameters")
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


def from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict (for a multimodal checkpoint,
    pass `hf_text_config(cfg)[0]`)."""
    model_type = cfg.get("model_type")
    arch = HF_ARCHS.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        known = sorted(set(HF_ARCHS) | set(MULTIMODAL))
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
        hybrid = hf_linear_fields(cfg, n_layers) if arch in HYBRID_ARCHS else {}
        if arch == "qwen3_5_moe":  # its router always renormalizes the top-k weights
            cfg = {"norm_topk_prob": True, **cfg}
        moe = hf_moe_fields(cfg, n_layers)
        rope = _hf_object(cfg, "rope_parameters")
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
            rope_scaling=_hf_rope_scaling(_hf_object(cfg, "rope_scaling") or rope),
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


def _gguf_number(meta: dict[str, Any], key: str, default: Any = None, kind: type = int):
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


def _check_gguf_layers(gguf_arch: str, n_blocks: int, n_layers: int, tensors: set[str]) -> None:
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


def _gguf_moe_fields(meta: dict[str, Any], gguf_arch: str, n_layers: int, tensors: set[str]):
    """Expert fields from GGUF metadata; a layer without a router keeps the dense MLP."""
    n_experts = _gguf_number(meta, f"{gguf_arch}.expert_count", 0)
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
    shared = _gguf_number(meta, f"{gguf_arch}.expert_shared_feed_forward_length", 0)
    if not shared and "blk.0.ffn_up_shexp.weight" in tensors:
        raise CheckpointError(
            f"GGUF has shared experts but no {gguf_arch}.expert_shared_feed_forward_length"
        )
    # llama.cpp renormalizes the k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE.
    norm = meta.get(f"{gguf_arch}.expert_weights_norm", gguf_arch != "qwen2moe")
    return dict(
        n_experts=n_experts,
        n_experts_used=_gguf_number(meta, f"{gguf_arch}.expert_used_count", 0),
        d_ff_expert=_gguf_number(meta, width),
        norm_topk_prob=bool(norm),
        d_ff_shared=shared,
        shared_gate=any(f"blk.{i}.ffn_gate_inp_shexp.weight" in tensors for i in range(n_layers)),
        dense_layers=tuple(dense),
    )


def from_gguf(meta: dict[str, Any], tensors: set[str]) -> ModelConfig:
    """Build a ModelConfig from decoded GGUF metadata and the set of tensor names."""
    gguf_arch = meta.get("general.architecture")
    if not isinstance(gguf_arch, str) or gguf_arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}"
        )

    def get(key, default=None, kind=int):  # per-layer lists (some converters): the first entry
        return _gguf_number(meta, f"{gguf_arch}.{key}", default, kind)

    d_model = get("embedding_length")
    n_heads = get("attention.head_count")
    # Multi-token prediction blocks (Qwen3.5, Qwen3-Next) follow the trunk's layers.
    n_blocks = get("block_count")
    n_layers = n_blocks - get("nextn_predict_layers", 0)
    _check_gguf_layers(gguf_arch, n_blocks, n_layers, tensors)
    n_kv = get("attention.head_count_kv", n_heads)
    moe = _gguf_moe_fields(meta, gguf_arch, n_layers, tensors)
    n_ff = get("feed_forward_length", moe.get("d_ff_expert"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", 0) or (len(tokens) if isinstance(tokens, list) else 0)
    if not vocab:
        raise CheckpointError("GGUF has neither a vocab_size nor a tokenizer vocabulary")
    window = get("attention.sliding_window", 0)
    arch = GGUF_ARCHS[gguf_arch]
    hybrid = _gguf_linear_fields(meta, gguf_arch, n_layers) if arch in HYBRID_ARCHS else {}
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


def _gguf_linear_fields(meta: dict[str, Any], gguf_arch: str, n_layers: int) -> dict[str, Any]:
    """The layer pattern and Gated DeltaNet dimensions from llama.cpp's `ssm.*` keys:
    `attention.recurrent_layers`, else every `full_attention_interval`-th layer attends."""

    def get(key, default=None):
        return _gguf_number(meta, f"{gguf_arch}.{key}", default)

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
    )

