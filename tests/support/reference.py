"""Independent float64 NumPy reference forward pass (Hugging Face semantics).

This module is deliberately self-contained: it does not import anything from
``jaxinfer``.  It is the oracle the JAX model is tested against, so it is
written to be simple and obviously correct rather than fast.

Supported ``config["model_type"]``: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, and the
mixture-of-experts ``mixtral``, ``qwen2_moe``, ``qwen3_moe``.
Semantics follow transformers' ``modeling_llama`` / ``modeling_mistral`` /
``modeling_qwen2`` / ``modeling_qwen3``:

* pre-RMSNorm decoder blocks: ``x / sqrt(mean(x**2) + eps) * w``
* rotate_half (NeoX-style) RoPE, ``inv_freq = theta ** (-arange(0, d, 2) / d)``,
  with optional llama3 frequency scaling (``_compute_llama3_parameters``)
* causal softmax attention with GQA (q head ``h`` uses kv head ``h // (H / KV)``),
  scale ``head_dim ** -0.5``, optional sliding window (key ``j`` visible to query
  ``i`` iff ``0 <= i - j < window``)
* optional q/k/v(/o) biases (detected by the presence of the bias tensors)
* Qwen3 per-head q_norm / k_norm over head_dim, applied before RoPE
* SwiGLU MLP ``down(silu(gate(x)) * up(x))``, final norm, lm_head (or tied embedding)
* mixture of experts (``modeling_mixtral`` / ``modeling_qwen2_moe`` / ``modeling_qwen3_moe``):
  per token, softmax over the router logits, the k most probable experts (equal
  probabilities: the lower expert index first, as ``torch.topk``), their probabilities
  renormalized (Mixtral always, Qwen if ``norm_topk_prob``), the weighted sum of those experts'
  SwiGLU outputs, plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when the layer has
  a shared expert. Qwen layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` are dense.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .checkpoints import is_moe_layer

__all__ = [
    "forward",
    "greedy",
    "rope_inv_freq",
    "llama3_inv_freq",
    "sliding_window_for_layer",
    "KVCache",
    "forward_step",
]


# ----------------------------------------------------------------------------
# config helpers
# ----------------------------------------------------------------------------


def _num_heads(config: dict) -> int:
    return int(config["num_attention_heads"])


def _num_kv_heads(config: dict) -> int:
    kv = config.get("num_key_value_heads")
    return int(kv) if kv is not None else _num_heads(config)


def _head_dim(config: dict) -> int:
    hd = config.get("head_dim")
    if hd is None:
        return int(config["hidden_size"]) // _num_heads(config)
    return int(hd)


def _rope_scaling(config: dict) -> dict | None:
    rs = config.get("rope_scaling")
    if not rs:
        return None
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    return {**rs, "rope_type": rope_type}


def sliding_window_for_layer(config: dict, layer: int) -> int | None:
    """Sliding window size that applies to ``layer`` (None = full causal attention).

    * mistral (and any other model_type): applies when ``sliding_window`` is not None
      and ``use_sliding_window`` is not False.
    * qwen2 / qwen3: HF only uses it when ``use_sliding_window`` is True (its default is
      False), and then only for layers ``>= max_window_layers``.
    """
    window = config.get("sliding_window")
    if window is None:
        return None
    model_type = config.get("model_type")
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None
        if layer < int(config.get("max_window_layers", 0)):
            return None
        return int(window)
    if config.get("use_sliding_window") is False:
        return None
    return int(window)


# ----------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------


def rope_inv_freq(config: dict) -> np.ndarray:
    """float64 inverse frequencies, shape [head_dim // 2], including any rope scaling."""
    dim = _head_dim(config)
    base = float(config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = _rope_scaling(config)
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "llama3":
        return llama3_inv_freq(inv_freq, rs)
    if rs["rope_type"] == "linear":
        return inv_freq / float(rs["factor"])
    raise NotImplementedError(f"rope_scaling type {rs['rope_type']!r} not supported by reference")


def llama3_inv_freq(inv_freq: np.ndarray, rope_scaling: dict) -> np.ndarray:
    """transformers ``_compute_llama3_parameters``, written from the math.

    wavelen = 2*pi / inv_freq
      wavelen < high_freq_wavelen  (= old_ctx / high_freq_factor): unchanged
      wavelen > low_freq_wavelen   (= old_ctx / low_freq_factor):  inv_freq / factor
      otherwise: smooth = (old_ctx / wavelen - low) / (high - low)
                 inv_freq * ((1 - smooth) / factor + smooth)
    """
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(rope_scaling.get("high_freq_factor", 4.0))
    old_context_len = float(rope_scaling.get("original_max_position_embeddings", 8192))

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    out = np.empty_like(inv_freq)
    for i, f in enumerate(inv_freq):
        wavelen = 2.0 * math.pi / f
        if wavelen < high_freq_wavelen:
            out[i] = f
        elif wavelen > low_freq_wavelen:
            out[i] = f / factor
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out[i] = (1.0 - smooth) * f / factor + smooth * f
    return out


def _rope_cos_sin(config: dict, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = rope_inv_freq(config)  # [D/2]
    freqs = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, D]
    # llama3 / default / linear all have attention_scaling == 1.0
    return np.cos(emb), np.sin(emb)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x: [heads, T, D]; cos/sin: [T, D]
    return x * cos[None] + _rotate_half(x) * sin[None]


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = x @ w.T
    if b is not None:
        y = y + b
    return y


def _f64(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(np.float64) for k, v in weights.items()}


class KVCache:
    """Per-layer float64 key/value cache (keys stored after RoPE), absolute positions."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers  # [KV, S, D]
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.length = 0


def _attention(
    w: dict[str, np.ndarray],
    config: dict,
    layer: int,
    x: np.ndarray,
    positions: np.ndarray,
    cache: KVCache,
) -> np.ndarray:
    p = f"model.layers.{layer}.self_attn."
    H, KV, D = _num_heads(config), _num_kv_heads(config), _head_dim(config)
    eps = float(config.get("rms_norm_eps", 1e-6))
    T = x.shape[0]

    q = _linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))
    k = _linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias"))
    v = _linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias"))
    q = q.reshape(T, H, D).transpose(1, 0, 2)  # [H, T, D]
    k = k.reshape(T, KV, D).transpose(1, 0, 2)  # [KV, T, D]
    v = v.reshape(T, KV, D).transpose(1, 0, 2)

    if p + "q_norm.weight" in w:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
        q = _rms_norm(q, w[p + "q_norm.weight"], eps)
    if p + "k_norm.weight" in w:
        k = _rms_norm(k, w[p + "k_norm.weight"], eps)

    cos, sin = _rope_cos_sin(config, positions)
    q = _apply_rope(q, cos, sin)
    k = _apply_rope(k, cos, sin)

    if cache.k[layer] is None:
        k_all, v_all = k, v
    else:
        k_all = np.concatenate([cache.k[layer], k], axis=1)
        v_all = np.concatenate([cache.v[layer], v], axis=1)
    cache.k[layer], cache.v[layer] = k_all, v_all
    S = k_all.shape[1]
    key_pos = np.arange(S)  # cache holds positions 0..S-1

    # mask[i, j]: query at positions[i] may see key at key_pos[j]
    diff = positions[:, None] - key_pos[None, :]
    allowed = diff >= 0
    window = sliding_window_for_layer(config, layer)
    if window is not None:
        allowed &= diff < window

    group = H // KV
    scale = 1.0 / math.sqrt(D)
    out = np.empty((H, T, D), dtype=np.float64)
    for h in range(H):
        kh = k_all[h // group]
        vh = v_all[h // group]
        scores = (q[h] @ kh.T) * scale  # [T, S]
        scores = np.where(allowed, scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs = probs / probs.sum(axis=-1, keepdims=True)
        out[h] = probs @ vh
    out = out.transpose(1, 0, 2).reshape(T, H * D)
    return _linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))


def _mlp(w: dict[str, np.ndarray], layer: int, x: np.ndarray) -> np.ndarray:
    p = f"model.layers.{layer}.mlp."
    gate = _linear(x, w[p + "gate_proj.weight"], w.get(p + "gate_proj.bias"))
    up = _linear(x, w[p + "up_proj.weight"], w.get(p + "up_proj.bias"))
    return _linear(_silu(gate) * up, w[p + "down_proj.weight"], w.get(p + "down_proj.bias"))


def _moe_layer(config: dict, layer: int) -> bool:
    """HF's rule: Mixtral always; Qwen MoE unless in mlp_only_layers or off the sparse step
    (the checkpoint writers' rule too: checkpoints.is_moe_layer)."""
    return is_moe_layer(config, layer)


def top_k_lowest_index(probs: np.ndarray, k: int) -> list[int]:
    """The k largest entries of a 1-D array; among equal values the lower index first."""
    return sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:k]


def moe(w: dict[str, np.ndarray], p: str, x: np.ndarray, k: int, renorm: bool, expert):
    """The expert block under prefix `p` on x [T, D]: a softmax router over every expert,
    the top k (the lower index first among equals), renormalized when `renorm`, each expert's
    SwiGLU weighted; plus the shared expert, scaled by sigmoid(gate . x) where it has a gate.
    `expert(e)` gives expert e's (gate, up, down) weights."""
    logits = x @ w[p + "gate.weight"].T  # [T, E]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = top_k_lowest_index(probs[t], k)
        weights = probs[t, chosen]
        if renorm:
            weights = weights / weights.sum()
        for e, weight in zip(chosen, weights, strict=True):
            gate, up, down = expert(e)
            out[t] += weight * ((_silu(x[t] @ gate.T) * (x[t] @ up.T)) @ down.T)
    if p + "shared_expert.gate_proj.weight" in w:
        q = p + "shared_expert."
        gate, up = x @ w[q + "gate_proj.weight"].T, x @ w[q + "up_proj.weight"].T
        shared = (_silu(gate) * up) @ w[q + "down_proj.weight"].T
        if p + "shared_expert_gate.weight" in w:
            g = x @ w[p + "shared_expert_gate.weight"].T  # [T, 1]
            shared = shared / (1.0 + np.exp(-g))
        out = out + shared
    return out


def _moe(w: dict[str, np.ndarray], config: dict, layer: int, x: np.ndarray) -> np.ndarray:
    mixtral = config["model_type"] == "mixtral"
    p = f"model.layers.{layer}." + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    renorm = True if mixtral else bool(config.get("norm_topk_prob", False))

    def expert(e):
        return tuple(w[f"{p}experts.{e}.{n}.weight"] for n in names)

    return moe(w, p, x, int(config["num_experts_per_tok"]), renorm, expert)


def _lm_head(w: dict[str, np.ndarray], config: dict) -> np.ndarray:
    if config.get("tie_word_embeddings", False) or "lm_head.weight" not in w:
        return w["model.embed_tokens.weight"]
    return w["lm_head.weight"]


def forward_step(
    w64: dict[str, np.ndarray],
    config: dict,
    token_ids: list[int],
    cache: KVCache,
    return_hidden: bool = False,
):
    """Run ``token_ids`` at positions ``cache.length ...`` using/updating ``cache``.

    ``w64`` must already be float64 (see ``forward`` / ``greedy``). Returns logits [T, V]
    (with ``return_hidden``: also the final-norm hidden states [T, hidden]).
    """
    eps = float(config.get("rms_norm_eps", 1e-6))
    ids = np.asarray(token_ids, dtype=np.int64)
    T = ids.shape[0]
    positions = np.arange(cache.length, cache.length + T)

    x = w64["model.embed_tokens.weight"][ids]  # [T, hidden]
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        h = _rms_norm(x, w64[p + "input_layernorm.weight"], eps)
        x = x + _attention(w64, config, layer, h, positions, cache)
        h = _rms_norm(x, w64[p + "post_attention_layernorm.weight"], eps)
        x = x + (_moe(w64, config, layer, h) if _moe_layer(config, layer) else _mlp(w64, layer, h))
    cache.length += T
    x = _rms_norm(x, w64["model.norm.weight"], eps)
    logits = x @ _lm_head(w64, config).T
    return (logits, x) if return_hidden else logits


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def forward(
    weights: dict[str, np.ndarray], config: dict, token_ids: list[int], return_hidden=False
):
    """Full-sequence causal forward pass. Returns float64 logits of shape [T, V] (with
    ``return_hidden``: also the final-norm hidden states [T, hidden])."""
    w64 = _f64(weights)
    cache = KVCache(int(config["num_hidden_layers"]))
    return forward_step(w64, config, list(token_ids), cache, return_hidden)


def greedy(
    weights: dict[str, np.ndarray], config: dict, prompt_ids: list[int], n: int
) -> list[int]:
    """Greedy (argmax) decoding of ``n`` new tokens after ``prompt_ids`` (incremental KV cache).

    Returns only the generated ids (length ``n``); no EOS stopping.
    """
    w64 = _f64(weights)
    cache = KVCache(int(config["num_hidden_layers"]))
    out: list[int] = []
    if n <= 0:
        return out
    logits = forward_step(w64, config, list(prompt_ids), cache)
    nxt = int(np.argmax(logits[-1]))
    out.append(nxt)
    while len(out) < n:
        logits = forward_step(w64, config, [nxt], cache)
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
    return out
