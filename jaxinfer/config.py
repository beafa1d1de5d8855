"""ModelConfig: the frozen description of a decoder model.

Hugging Face and GGUF field names appear only in their converters (`formats/hf.py`,
`formats/gguf.py`); everything else in jaxinfer reads the short fields below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import CheckpointError, UnsupportedModelError

ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
    "qwen3_next", "qwen3_5", "qwen3_5_moe",
)  # fmt: skip
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # Gated DeltaNet + gated attention


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
    # the linear layers' output projection takes its V heads tiled (head r * HK + k for the
    # grouped k * R + r), as Qwen3.5 GGUFs store its columns: the model reorders o's heads, so
    # that a quantized weight keeps its blocks (moving columns would dequantize it)
    linear_out_tiled: bool = False
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
