"""The Llama-family decoder (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3) as a flax NNX module.

Weights are stored [out, in] (GGUF order, no transpose at load), one array per layer and weight,
and the layer loop is written out in Python so XLA sees every layer separately: scanning stacked
layers makes XLA CPU copy each layer's weights every token (DESIGN.md section 1).
Dimension letters: B batch, T tokens, S cache positions, D model, N heads, K kv heads,
G = N / K, H head dim, F mlp, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig, rope_inv_freq

# Per layer: (k, v), each [B, K, S, H]. One donated buffer per layer and tensor keeps the
# attention dot free of transposes (a stacked [L, B, S, K, H] forces a copy per layer).
KVCache = list[tuple[jax.Array, jax.Array]]


def _param(rngs: nnx.Rngs, shape, axes, scale=0.02, init_one=False) -> nnx.Param:
    """A parameter with its logical axes declared once (layouts map them to mesh axes)."""
    if init_one:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, axes=axes)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 whatever the activation dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x [B, T, *, H], positions [B, T]."""
    angle = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angle)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, *, H/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def write_cache(cache_k, cache_v, k, v, positions):
    """Store k, v [B, T, K, H] at `positions` [B, T] of caches [B, K, S, H].

    One token per row (decode) is a dynamic_update_slice per row, which XLA performs in place
    on the donated cache. Prompt chunks scatter instead: their padding positions may run past
    S, and a scatter drops those where an update slice would clamp onto valid entries.
    """
    B, T = positions.shape
    k = k.astype(cache_k.dtype).transpose(0, 2, 1, 3)  # [B, K, T, H]
    v = v.astype(cache_v.dtype).transpose(0, 2, 1, 3)
    if T == 1:
        zero = jnp.zeros((), positions.dtype)
        for b in range(B):
            at = (b, zero, positions[b, 0], zero)
            cache_k = jax.lax.dynamic_update_slice(cache_k, k[b : b + 1], at)
            cache_v = jax.lax.dynamic_update_slice(cache_v, v[b : b + 1], at)
        return cache_k, cache_v
    rows = jnp.arange(B)[:, None]  # [B, 1]
    cache_k = cache_k.at[rows, :, positions, :].set(k.transpose(0, 2, 1, 3), mode="drop")
    cache_v = cache_v.at[rows, :, positions, :].set(v.transpose(0, 2, 1, 3), mode="drop")
    return cache_k, cache_v


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        N, K, H, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        self.cfg = cfg
        # 2-D [out, in] weights: a 3-D [N, H, D] weight makes XLA CPU copy it every token.
        # The flattened N*H axis is named "heads" (head-major, so splitting it splits heads).
        self.wq = _param(rngs, (N * H, D), ("heads", "embed"))
        self.wk = _param(rngs, (K * H, D), ("kv_heads", "embed"))
        self.wv = _param(rngs, (K * H, D), ("kv_heads", "embed"))
        self.wo = _param(rngs, (D, N * H), ("embed", "heads"))
        if cfg.qkv_bias:
            self.bq = _param(rngs, (N * H,), ("heads",))
            self.bk = _param(rngs, (K * H,), ("kv_heads",))
            self.bv = _param(rngs, (K * H,), ("kv_heads",))
        if cfg.qk_norm:
            self.q_norm = _param(rngs, (H,), ("head_dim",), init_one=True)
            self.k_norm = _param(rngs, (H,), ("head_dim",), init_one=True)

    def __call__(self, x, positions, cache_k, cache_v):
        """x [B, T, D], positions [B, T]; cache_k/v [B, K, S, H] -> out [B, T, D], new caches."""
        cfg = self.cfg
        B, T, _ = x.shape
        K, G, H = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        S = cache_k.shape[2]
        q = jnp.einsum("BTD,ED->BTE", x, self.wq[...])  # [B, T, N*H]
        k = jnp.einsum("BTD,ED->BTE", x, self.wk[...])  # [B, T, K*H]
        v = jnp.einsum("BTD,ED->BTE", x, self.wv[...])  # [B, T, K*H]
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = q.reshape(B, T, K * G, H)  # [B, T, N, H]
        k = k.reshape(B, T, K, H)  # [B, T, K, H]
        v = v.reshape(B, T, K, H)  # [B, T, K, H]
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.norm_eps)
        inv_freq = rope_inv_freq(cfg)
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)

        cache_k, cache_v = write_cache(cache_k, cache_v, k, v, positions)

        q = q.reshape(B, T, K, G, H)  # [B, T, K, G, H]
        scores = jnp.einsum(
            "BTKGH,BKSH->BKGTS", q, cache_k, preferred_element_type=jnp.float32
        )  # [B, K, G, T, S]
        scores = scores * (1.0 / np.sqrt(H))
        # Entries past a query's position are stale (earlier requests, padding): masked.
        key_pos = jnp.arange(S)  # [S]
        visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
        if cfg.sliding_window:
            visible &= positions[:, :, None] - key_pos[None, None, :] < cfg.sliding_window
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(cache_v.dtype)  # [B, K, G, T, S]
        out = jnp.einsum("BKGTS,BKSH->BTKGH", probs, cache_v)  # [B, T, K, G, H]
        out = out.reshape(B, T, K * G * H).astype(x.dtype)  # [B, T, N*H]
        return jnp.einsum("BTE,DE->BTD", out, self.wo[...]), cache_k, cache_v


class MLP(nnx.Module):
    """SwiGLU feed-forward; an MoE block would replace this module in `Block`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.w_gate = _param(rngs, (F, D), ("mlp", "embed"))
        self.w_up = _param(rngs, (F, D), ("mlp", "embed"))
        self.w_down = _param(rngs, (D, F), ("embed", "mlp"))

    def __call__(self, x):
        gate = jnp.einsum("BTD,FD->BTF", x, self.w_gate[...])  # [B, T, F]
        up = jnp.einsum("BTD,FD->BTF", x, self.w_up[...])  # [B, T, F]
        return jnp.einsum("BTF,DF->BTD", jax.nn.silu(gate) * up, self.w_down[...])  # [B, T, D]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.attn_norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, cache_k, cache_v):
        with jax.named_scope("attn"):
            h, cache_k, cache_v = self.attn(
                rms_norm(x, self.attn_norm[...], self.eps), positions, cache_k, cache_v
            )
        x = x + h
        with jax.named_scope("mlp"):
            x = x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps))
        return x, cache_k, cache_v


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), scale=1.0)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

    def __call__(self, tokens, positions, cache: KVCache):
        """tokens, positions [B, T] -> final hidden states [B, T, D] (normed), new cache."""
        x = self.embed_tokens(tokens)  # [B, T, D]
        new_cache = []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x, k, v = layer(x, positions, *cache[i])
            new_cache.append((k, v))
        return self.final_norm(x), new_cache

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]

    def final_norm(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.norm[...], self.cfg.norm_eps)

    def logits(self, h: jax.Array) -> jax.Array:
        head = self.embed if self.cfg.tie_embeddings else self.lm_head
        return head_logits(h, head[...])


def head_logits(h: jax.Array, head: jax.Array) -> jax.Array:
    """Final hidden states h [..., D] and head [V, D] -> float32 logits [..., V]."""
    return jnp.einsum("...D,VD->...V", h, head, preferred_element_type=jnp.float32)


def init_cache(cfg: ModelConfig, batch: int, seq: int, dtype) -> KVCache:
    """A zeroed cache of `seq` positions for `batch` rows: per layer (k, v) [B, K, S, H]."""
    shape = (batch, cfg.n_kv_heads, seq, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers)]


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with shapes only (no memory): the source of parameter names, shapes, axes."""
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
