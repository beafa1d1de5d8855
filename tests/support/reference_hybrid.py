"""Independent float64 NumPy reference forward pass of the hybrid linear-attention models.

Like ``reference.py`` it imports nothing from ``jaxinfer``; it shares that module's expert
block (the same HF definition), and is written to be simple and obviously correct rather than
fast.

Supported ``config["model_type"]``: ``qwen3_next`` (Qwen3-Next), ``qwen3_5_text`` (Qwen3.5
dense) and ``qwen3_5_moe_text`` (Qwen3.5 MoE). A nested ``text_config`` and weights under
``model.language_model.*`` (released Qwen3.5 checkpoints) are accepted too. Semantics follow
transformers' ``modeling_qwen3_next`` / ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe``; the
``mtp.*`` weights are ignored (transformers ignores them as well).

Layer pattern: ``config["layer_types"]`` when present, else layer ``i`` is
``linear_attention`` iff ``(i + 1) % full_attention_interval != 0`` (default interval 4).

Decoder block: ``x += mixer(norm1(x)); x += mlp(norm2(x))``, then ``final_norm`` and ``lm_head``.

* **Zero-centered RMSNorm** (``Qwen3NextRMSNorm``) for input/post-attention/q_norm/k_norm/final:
  ``x / sqrt(mean(x**2) + eps) * (1 + w)`` with ``eps = rms_norm_eps``.
* **Gated DeltaNet** (``linear_attn``; nk key heads of dim dk, nv value heads of dim dv,
  r = nv / nk, key_dim = nk*dk, value_dim = nv*dv):

  - projections. Qwen3-Next: ``in_proj_qkvz`` output viewed per *key head* as
    ``[nk, 2*dk + 2*r*dv]`` and split ``[q dk | k dk | v r*dv | z r*dv]``
    (``fix_query_key_value_ordering``); ``in_proj_ba`` viewed ``[nk, 2*r]`` and split
    ``[b r | a r]``; v/z/b/a then flattened so value head ``g*r + j`` belongs to key head
    ``g``. Qwen3.5: ``in_proj_qkv`` is contiguous ``[q all | k all | v all]``, plus
    ``in_proj_z`` [value_dim], ``in_proj_b`` [nv], ``in_proj_a`` [nv].
  - ``mixed = [q | k | v]`` (conv_dim = 2*key_dim + value_dim) goes through a depthwise causal
    conv (``conv1d.weight [conv_dim, 1, K]``, no bias; the last tap multiplies the current
    token) and SiLU. Its state is the last ``K - 1`` *inputs* (pre-conv).
  - ``beta = sigmoid(b)``; ``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay <= 0; torch's
    softplus returns ``x`` for ``x > 20``, reproduced here).
  - q, k repeated to the nv value heads with ``repeat_interleave(r)`` (value head h uses key
    head ``h // r``), L2-normalized ``x / sqrt(sum(x**2) + 1e-6)`` (FLA's ``l2norm``: eps is
    added to the sum of squares, not to the norm), and q scaled by ``dk ** -0.5``.
  - gated delta rule per value head, state ``S [dk, dv]`` (``gdn_recurrent``):
    ``S *= exp(g_t); delta = (v_t - S^T k_t) * beta_t; S += k_t delta^T; o_t = S^T q_t``.
    ``gdn_chunked`` is the equivalent chunked (WY) form of ``torch_chunk_gated_delta_rule``.
  - output: per value head the *plain*-weight gated RMSNorm ``Qwen3NextRMSNormGated``
    ``o / sqrt(mean(o**2) + rms_norm_eps) * w * silu(z)`` (norm before gate), then
    ``out_proj``.
* **Gated full attention** (``self_attn``): ``q_proj`` emits per head ``[q head_dim | gate
  head_dim]`` (``view(T, H, 2*head_dim)`` then ``chunk(2)``); zero-centered q_norm / k_norm over
  head_dim; partial rotate-half RoPE on the first ``rotary_dim = int(head_dim *
  partial_rotary_factor)`` dims of each head, ``inv_freq = theta ** (-arange(0, rotary_dim, 2) /
  rotary_dim)`` (theta and the factor from ``rope_parameters``, else top level); causal softmax
  attention with GQA (q head ``h`` uses kv head ``h // (H / KV)``), scale ``head_dim ** -0.5``;
  ``out * sigmoid(gate)`` before ``o_proj``. Qwen3.5's interleaved mRoPE gives every section
  the same (text) position, so it reduces to this 1-D partial RoPE. A ``q_proj`` of only
  ``H * head_dim`` rows is read as an ungated attention.
* **MLP**: SwiGLU ``down(silu(gate(x)) * up(x))``. MoE (Qwen3-Next: layers not in
  ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``; Qwen3.5-MoE: every layer):
  softmax over ``mlp.gate`` logits, top-k (equal probabilities: the lower expert index first),
  renormalized if ``norm_topk_prob`` (Qwen3-Next, default True; Qwen3.5-MoE always
  renormalizes, its config has no such key), weighted sum of the experts' SwiGLU outputs, plus
  ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``. Experts either per-expert
  (``experts.{e}.gate_proj/up_proj/down_proj.weight``) or fused (``experts.gate_up_proj [E, 2F,
  D]``, gate rows first, and ``experts.down_proj [E, D, F]``).

Incremental use: ``HybridCache`` carries per layer the conv state ``[K-1, conv_dim]`` and the
recurrent state ``[nv, dk, dv]`` (linear layers) or the post-RoPE keys / values ``[KV, S, D]``
(attention layers); ``forward_step`` appends any number of tokens, so a prompt can be run in
pieces and then decoded one token at a time, with the same result as one pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .reference import moe

__all__ = [
    "HybridCache",
    "causal_conv",
    "forward",
    "forward_step",
    "gdn_chunked",
    "gdn_layer",
    "gdn_recurrent",
    "greedy",
    "layer_types",
    "text_config",
    "to_f64",
]


# ----------------------------------------------------------------------------
# config helpers
# ----------------------------------------------------------------------------


def text_config(config: dict) -> dict:
    """The text-model config (a released Qwen3.5 config nests it under ``text_config``)."""
    return config["text_config"] if "text_config" in config else config


def layer_types(config: dict) -> list[str]:
    """``"linear_attention"`` / ``"full_attention"`` per layer."""
    config = text_config(config)
    n = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        types = list(config["layer_types"])[:n]
    else:
        interval = int(config.get("full_attention_interval") or 4)
        types = [
            "linear_attention" if (i + 1) % interval != 0 else "full_attention" for i in range(n)
        ]
    for t in types:
        if t not in ("linear_attention", "full_attention"):
            raise ValueError(f"unknown layer type {t!r}")
    return types


def _rope_param(config: dict, key: str, default: float) -> float:
    rp = config.get("rope_parameters") or {}
    if key in rp and rp[key] is not None:
        return float(rp[key])
    if config.get(key) is not None:
        return float(config[key])
    return default


def _head_dim(config: dict) -> int:
    hd = config.get("head_dim")
    if hd is None:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(hd)


def _rotary_dim(config: dict) -> int:
    return int(_head_dim(config) * _rope_param(config, "partial_rotary_factor", 1.0))


def _rope_type(config: dict) -> str:
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rp.get("rope_type", rp.get("type")) or "default"


def _is_moe_layer(config: dict, layer: int) -> bool:
    model_type = config.get("model_type")
    experts = int(config.get("num_experts") or 0)
    if model_type == "qwen3_5_text" or experts <= 0:
        return False
    if model_type == "qwen3_5_moe_text":
        return True
    if layer in (config.get("mlp_only_layers") or []):
        return False
    return (layer + 1) % int(config.get("decoder_sparse_step") or 1) == 0


def _renormalize_topk(config: dict) -> bool:
    if config.get("model_type") == "qwen3_5_moe_text":
        return True  # Qwen3VLMoeTextTopKRouter always renormalizes
    return bool(config.get("norm_topk_prob", True))


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------


def to_f64(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    """float64 copies of the weights (no copy for arrays that already are float64)."""
    return {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    # torch.nn.functional.softplus(beta=1, threshold=20)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _rms_norm_1p(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centered RMSNorm: ``x / sqrt(mean(x**2) + eps) * (1 + w)``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``Qwen3NextRMSNormGated``: plain weight, norm before the SiLU gate."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w * _silu(z)


def _l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = x @ w.T
    return y if b is None else y + b


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


# ----------------------------------------------------------------------------
# Gated DeltaNet pieces
# ----------------------------------------------------------------------------


def causal_conv(
    x: np.ndarray, w: np.ndarray, state: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU.

    x [T, C]; w [C, K] (``conv1d.weight[:, 0, :]``); state [K-1, C] = the previous K-1 inputs
    (zeros if None). ``y[t, c] = silu(sum_j w[c, j] * xp[t + j, c])`` with ``xp = concat(state,
    x)``, i.e. tap ``K-1`` multiplies the current input. Returns ``(y [T, C], new_state)``, the
    new state being the last K-1 rows of ``xp``.
    """
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    T, C = x.shape
    K = w.shape[1]
    if state is None:
        state = np.zeros((K - 1, C), dtype=np.float64)
    xp = np.concatenate([np.asarray(state, dtype=np.float64), x], axis=0)  # [K-1+T, C]
    y = np.zeros((T, C), dtype=np.float64)
    for j in range(K):
        y += xp[j : j + T] * w[None, :, j]
    new_state = xp[xp.shape[0] - (K - 1) :].copy()
    return _silu(y), new_state


def _begin(q, k, v, g, beta, state):
    """The inputs in float64, the state (a float64 copy, or zeros [H, dk, dv]) and the output
    [T, H, dv] to fill, for either form of the delta rule."""
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    T, H, dk = k.shape
    dv = v.shape[-1]
    S = np.zeros((H, dk, dv)) if state is None else np.array(state, dtype=np.float64)
    return q, k, v, g, beta, S, np.empty((T, H, dv), dtype=np.float64)


def gdn_recurrent(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, token by token (``torch_recurrent_gated_delta_rule``).

    q, k [T, H, dk] (already L2-normalized, q already scaled by dk**-0.5, already repeated to the
    H value heads); v [T, H, dv]; g [T, H] log decay (<= 0); beta [T, H]; state [H, dk, dv]
    (zeros if None). Per t and head: ``S *= exp(g_t); kv = S^T k_t; delta = (v_t - kv) *
    beta_t; S += k_t delta^T; o_t = S^T q_t``. Returns ``(o [T, H, dv], final state)``.
    """
    q, k, v, g, beta, S, out = _begin(q, k, v, g, beta, state)
    T, H = k.shape[:2]
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def gdn_chunked(  # gdn_recurrent's arguments (boilerplate): two forms of one rule
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray | None = None,
    chunk: int = 64,
) -> tuple[np.ndarray, np.ndarray]:
    """The same rule in chunked (WY) form, as ``torch_chunk_gated_delta_rule``; same arguments.

    Within a chunk, with ``G = cumsum(g)`` and ``D[i, j] = exp(G_i - G_j)`` (j <= i):
    ``A = inv(I + strict_lower((beta*k) k^T * D))``, ``u = A (beta*v)``, ``w = A (beta*k*exp(G))``;
    then ``v' = u - w S``, ``o = (q*exp(G)) S + lower(q k^T * D) v'``,
    ``S = exp(G_last) S + (k * exp(G_last - G))^T v'``. A short last chunk is not padded.
    """
    q, k, v, g, beta, S, out = _begin(q, k, v, g, beta, state)
    T, H = k.shape[:2]
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        lower = np.tril(np.ones((n, n), dtype=bool))
        strict = np.tril(np.ones((n, n), dtype=bool), -1)
        for h in range(H):
            qc, kc, vc = q[s:e, h], k[s:e, h], v[s:e, h]
            bc = beta[s:e, h][:, None]
            G = np.cumsum(g[s:e, h])
            D = np.where(lower, np.exp(np.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
            A = np.eye(n) + np.where(strict, ((bc * kc) @ kc.T) * D, 0.0)
            u = np.linalg.solve(A, bc * vc)
            wk = np.linalg.solve(A, bc * kc * np.exp(G)[:, None])
            v_new = u - wk @ S[h]
            attn = np.where(lower, (qc @ kc.T) * D, 0.0)
            out[s:e, h] = (qc * np.exp(G)[:, None]) @ S[h] + attn @ v_new
            S[h] = S[h] * np.exp(G[-1]) + (kc * np.exp(G[-1] - G)[:, None]).T @ v_new
    return out, S


def _gdn_dims(config: dict) -> tuple[int, int, int, int, int]:
    nk = int(config["linear_num_key_heads"])
    nv = int(config["linear_num_value_heads"])
    dk = int(config["linear_key_head_dim"])
    dv = int(config["linear_value_head_dim"])
    K = int(config.get("linear_conv_kernel_dim") or 4)
    if nv % nk:
        raise ValueError(f"linear_num_value_heads {nv} not a multiple of linear_num_key_heads {nk}")
    return nk, nv, dk, dv, K


def gdn_layer(
    w: dict[str, np.ndarray],
    config: dict,
    layer: int,
    x: np.ndarray,
    state: tuple[np.ndarray, np.ndarray] | None = None,
    prefix: str = "model.",
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One Gated DeltaNet mixer (``model.layers.{layer}.linear_attn.*``).

    x [T, hidden] is the input *after* ``input_layernorm``; state ``(conv [K-1, conv_dim],
    recurrent [nv, dk, dv])`` or None (zeros). Returns ``(out [T, hidden], new state)``; the
    residual add is the caller's.
    """
    config = text_config(config)
    nk, nv, dk, dv, K = _gdn_dims(config)
    r = nv // nk
    eps = float(config.get("rms_norm_eps", 1e-6))
    p = f"{prefix}layers.{layer}.linear_attn."
    x = np.asarray(x, dtype=np.float64)
    T = x.shape[0]
    get = lambda name: np.asarray(w[p + name], dtype=np.float64)  # noqa: E731

    if p + "in_proj_qkvz.weight" in w:  # Qwen3-Next: grouped per key head
        qkvz = _linear(x, get("in_proj_qkvz.weight")).reshape(T, nk, 2 * dk + 2 * r * dv)
        ba = _linear(x, get("in_proj_ba.weight")).reshape(T, nk, 2 * r)
        q = qkvz[..., :dk].reshape(T, nk * dk)
        k = qkvz[..., dk : 2 * dk].reshape(T, nk * dk)
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(T, nv * dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(T, nv, dv)
        b = ba[..., :r].reshape(T, nv)
        a = ba[..., r:].reshape(T, nv)
        mixed = np.concatenate([q, k, v], axis=-1)
    else:  # Qwen3.5: separate projections, [q all | k all | v all]
        mixed = _linear(x, get("in_proj_qkv.weight"))
        z = _linear(x, get("in_proj_z.weight")).reshape(T, nv, dv)
        b = _linear(x, get("in_proj_b.weight"))
        a = _linear(x, get("in_proj_a.weight"))

    conv_w = get("conv1d.weight")
    conv_w = conv_w.reshape(conv_w.shape[0], conv_w.shape[-1])  # [conv_dim, K]
    if conv_w.shape != (2 * nk * dk + nv * dv, K):
        raise ValueError(f"{p}conv1d.weight has shape {conv_w.shape}")
    conv_state, rec_state = (None, None) if state is None else state
    mixed, conv_state = causal_conv(mixed, conv_w, conv_state)

    key_dim = nk * dk
    q = mixed[:, :key_dim].reshape(T, nk, dk)
    k = mixed[:, key_dim : 2 * key_dim].reshape(T, nk, dk)
    v = mixed[:, 2 * key_dim :].reshape(T, nv, dv)

    beta = _sigmoid(b)
    g = -np.exp(get("A_log")) * _softplus(a + get("dt_bias"))
    q = np.repeat(q, r, axis=1)  # repeat_interleave: value head h uses key head h // r
    k = np.repeat(k, r, axis=1)
    q = _l2norm(q) * (dk**-0.5)
    k = _l2norm(k)

    o, rec_state = gdn_recurrent(q, k, v, g, beta, rec_state)
    o = _gated_rms_norm(o, z, get("norm.weight"), eps)
    out = _linear(o.reshape(T, nv * dv), get("out_proj.weight"))
    return out, (conv_state, rec_state)


# ----------------------------------------------------------------------------
# gated full attention
# ----------------------------------------------------------------------------


def _rope(config: dict, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if _rope_type(config) != "default":
        raise NotImplementedError(f"rope_type {_rope_type(config)!r} not supported by reference")
    dim = _rotary_dim(config)
    theta = _rope_param(config, "rope_theta", 10000.0)
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freqs = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, rotary_dim]
    return np.cos(emb), np.sin(emb)


def _apply_partial_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x [heads, T, D]; cos/sin [T, rotary_dim]
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    return np.concatenate([rot * cos[None] + _rotate_half(rot) * sin[None], rest], axis=-1)


def _attention(  # reference.py's arguments (boilerplate), plus this model's cache and prefix
    w: dict[str, np.ndarray],
    config: dict,
    layer: int,
    x: np.ndarray,
    positions: np.ndarray,
    kv: tuple[np.ndarray, np.ndarray] | None,
    prefix: str,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    p = f"{prefix}layers.{layer}.self_attn."
    H = int(config["num_attention_heads"])
    KV = int(config.get("num_key_value_heads") or H)
    D = _head_dim(config)
    eps = float(config.get("rms_norm_eps", 1e-6))
    T = x.shape[0]

    qg = _linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias"))
    if qg.shape[-1] == 2 * H * D:  # per head [q | gate]
        qg = qg.reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    else:
        q, gate = qg.reshape(T, H, D), None
    k = _linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).reshape(T, KV, D)
    v = _linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).reshape(T, KV, D)
    q = _rms_norm_1p(q, w[p + "q_norm.weight"], eps).transpose(1, 0, 2)  # [H, T, D]
    k = _rms_norm_1p(k, w[p + "k_norm.weight"], eps).transpose(1, 0, 2)  # [KV, T, D]
    v = v.transpose(1, 0, 2)

    cos, sin = _rope(config, positions)
    q = _apply_partial_rope(q, cos, sin)
    k = _apply_partial_rope(k, cos, sin)
    if kv is not None:
        k = np.concatenate([kv[0], k], axis=1)
        v = np.concatenate([kv[1], v], axis=1)
    S = k.shape[1]
    allowed = positions[:, None] >= np.arange(S)[None, :]  # cache holds positions 0..S-1

    group = H // KV
    scale = D**-0.5
    out = np.empty((H, T, D), dtype=np.float64)
    for h in range(H):
        scores = (q[h] @ k[h // group].T) * scale
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[h] = (probs / probs.sum(axis=-1, keepdims=True)) @ v[h // group]
    out = out.transpose(1, 0, 2).reshape(T, H * D)
    if gate is not None:
        out = out * _sigmoid(gate)
    return _linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias")), (k, v)


# ----------------------------------------------------------------------------
# MLP / MoE
# ----------------------------------------------------------------------------


def _swiglu(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray) -> np.ndarray:
    return (_silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def _expert_weights(
    w: dict[str, np.ndarray], p: str, e: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if p + "experts.gate_up_proj" in w:  # fused: [E, 2F, D] (gate rows first), [E, D, F]
        gate_up = w[p + "experts.gate_up_proj"][e]
        F = gate_up.shape[0] // 2
        return gate_up[:F], gate_up[F:], w[p + "experts.down_proj"][e]
    q = f"{p}experts.{e}."
    return w[q + "gate_proj.weight"], w[q + "up_proj.weight"], w[q + "down_proj.weight"]


def _moe(w: dict[str, np.ndarray], config: dict, p: str, x: np.ndarray) -> np.ndarray:
    k, renorm = int(config["num_experts_per_tok"]), _renormalize_topk(config)
    return moe(w, p, x, k, renorm, lambda e: _expert_weights(w, p, e))


def _mlp(w: dict[str, np.ndarray], config: dict, layer: int, x: np.ndarray, prefix: str):
    p = f"{prefix}layers.{layer}.mlp."
    if _is_moe_layer(config, layer):
        return _moe(w, config, p, x)
    return _swiglu(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------


class HybridCache:
    """Per-layer float64 state, absolute positions ``0 .. length-1``.

    Linear layers: ``conv[i]`` [K-1, conv_dim] (the last K-1 conv inputs) and ``recurrent[i]``
    [nv, dk, dv]. Attention layers: ``k[i]`` / ``v[i]`` [KV, length, head_dim] (keys after
    q/k-norm and RoPE). Unused entries stay None.
    """

    def __init__(self, config: dict):
        self.layer_types = layer_types(config)
        n = len(self.layer_types)
        self.conv: list[np.ndarray | None] = [None] * n
        self.recurrent: list[np.ndarray | None] = [None] * n
        self.k: list[np.ndarray | None] = [None] * n
        self.v: list[np.ndarray | None] = [None] * n
        self.length = 0

    def copy(self) -> HybridCache:
        other = object.__new__(HybridCache)
        other.layer_types = list(self.layer_types)
        for name in ("conv", "recurrent", "k", "v"):
            setattr(other, name, [None if a is None else a.copy() for a in getattr(self, name)])
        other.length = self.length
        return other


def _prefix(w: dict[str, Any]) -> str:
    return "model.language_model." if "model.language_model.embed_tokens.weight" in w else "model."


def forward_step(
    weights: dict[str, Any],
    config: dict,
    token_ids: list[int],
    cache: HybridCache,
    return_hidden: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Run ``token_ids`` at positions ``cache.length ...``, reading and updating ``cache``.

    Returns float64 logits [T, V] (with ``return_hidden``: also the final-norm hidden states
    [T, hidden]). Weights are used as float64 (pass ``to_f64(weights)`` to avoid re-converting
    float32 weights on every call).
    """
    w = to_f64(weights)
    config = text_config(config)
    prefix = _prefix(w)
    eps = float(config.get("rms_norm_eps", 1e-6))
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    T = ids.shape[0]
    positions = np.arange(cache.length, cache.length + T)

    x = w[prefix + "embed_tokens.weight"][ids]
    for i, kind in enumerate(cache.layer_types):
        p = f"{prefix}layers.{i}."
        h = _rms_norm_1p(x, w[p + "input_layernorm.weight"], eps)
        if kind == "linear_attention":
            state = None if cache.conv[i] is None else (cache.conv[i], cache.recurrent[i])
            out, (cache.conv[i], cache.recurrent[i]) = gdn_layer(w, config, i, h, state, prefix)
        else:
            kv = None if cache.k[i] is None else (cache.k[i], cache.v[i])
            out, (cache.k[i], cache.v[i]) = _attention(w, config, i, h, positions, kv, prefix)
        x = x + out
        h = _rms_norm_1p(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + _mlp(w, config, i, h, prefix)
    cache.length += T
    hidden = _rms_norm_1p(x, w[prefix + "norm.weight"], eps)
    if config.get("tie_word_embeddings", False) or "lm_head.weight" not in w:
        head = w[prefix + "embed_tokens.weight"]
    else:
        head = w["lm_head.weight"]
    logits = hidden @ head.T
    return (logits, hidden) if return_hidden else logits


def forward(weights: dict[str, Any], config: dict, token_ids: list[int]) -> np.ndarray:
    """Full-sequence causal forward pass from an empty state. Returns float64 logits [T, V]."""
    return forward_step(weights, config, list(token_ids), HybridCache(config))


def greedy(weights: dict[str, Any], config: dict, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy (argmax, ties to the lower id) decoding of ``n`` tokens after ``prompt_ids``.

    The prompt runs in one pass, then one token per step through the ``HybridCache``. Returns
    only the generated ids; no EOS stopping.
    """
    w = to_f64(weights)
    cache = HybridCache(config)
    out: list[int] = []
    if n <= 0:
        return out
    logits = forward_step(w, config, list(prompt_ids), cache)
    out.append(int(np.argmax(logits[-1])))
    while len(out) < n:
        logits = forward_step(w, config, [out[-1]], cache)
        out.append(int(np.argmax(logits[-1])))
    return out
