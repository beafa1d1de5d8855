"""The Llama-family decoder (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3) as a flax NNX module.

Weights are stored [out, in] (GGUF order, no transpose at load), one array per layer and weight,
and the layer loop is written out in Python so XLA sees every layer separately: scanning stacked
layers makes XLA CPU copy each layer's weights every token (DESIGN.md section 1).
Dimension letters: B batch, T tokens, S cache positions, D model, N heads, K kv heads,
G = N / K, H head dim, F mlp, V vocab.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import kvcache, moe
from .config import ModelConfig, rope_inv_freq
from .kvcache import AttentionKV, KVView
from .moe import ExpertSplit


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


def rope_table(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, H/2] of rotate-half RoPE at positions [B, T] (once per forward)."""
    angle = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    return jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]


def rope(x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE of x [B, T, *, H] with a `rope_table`."""
    cos, sin = table
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, *, H/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


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

    def __call__(self, x, rope_tab, kv, view: KVView):
        """x [B, T, D] at the view's positions; kv this layer's (K, V) pools -> [B, T, D], kv."""
        cfg = self.cfg
        B, T, _ = x.shape
        K, G, H = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
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
        q, k = rope(q, rope_tab), rope(k, rope_tab)
        q = (q * (1.0 / np.sqrt(H))).reshape(B, T, K, G, H)  # [B, T, K, G, H]

        kv = kvcache.write(kv, k, v, view)
        out = kvcache.attend(q, k, v, kv, view, cfg.sliding_window)  # [B, T, K, G, H]
        out = out.reshape(B, T, K * G * H).astype(x.dtype)  # [B, T, N*H]
        return jnp.einsum("BTE,DE->BTD", out, self.wo[...]), kv


class MLP(nnx.Module):
    """SwiGLU feed-forward of width F (the model's d_ff, or a shared expert's width)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
        D, F = cfg.d_model, width or cfg.d_ff
        self.w_gate = _param(rngs, (F, D), ("mlp", "embed"))
        self.w_up = _param(rngs, (F, D), ("mlp", "embed"))
        self.w_down = _param(rngs, (D, F), ("embed", "mlp"))

    def __call__(self, x):
        gate = jnp.einsum("BTD,FD->BTF", x, self.w_gate[...])  # [B, T, F]
        up = jnp.einsum("BTD,FD->BTF", x, self.w_up[...])  # [B, T, F]
        return jnp.einsum("BTF,DF->BTD", jax.nn.silu(gate) * up, self.w_down[...])  # [B, T, D]


class MoE(nnx.Module):
    """The expert block in place of the MLP: a float32 router picks k of E SwiGLU experts
    per token (moe.py computes them), plus an optional shared expert scaled by a sigmoid gate.
    Expert weights are stacked [E, F, D] / [E, D, F] on the `experts` logical axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, split: ExpertSplit | None = None):
        E, F, D = cfg.n_experts, cfg.d_ff_expert, cfg.d_model
        self.cfg = cfg
        self.split = split
        self.router = _param(rngs, (E, D), (None, "embed"))  # every device routes every token
        self.w_gate = _param(rngs, (E, F, D), ("experts", "mlp", "embed"))
        self.w_up = _param(rngs, (E, F, D), ("experts", "mlp", "embed"))
        self.w_down = _param(rngs, (E, D, F), ("experts", "embed", "mlp"))
        if cfg.d_ff_shared:
            self.shared = MLP(cfg, rngs, cfg.d_ff_shared)
            if cfg.shared_gate:
                self.shared_gate = _param(rngs, (D,), ("embed",))

    def __call__(self, x, valid):
        """x [B, T, D], valid [B, T] (padding routes nowhere) -> [B, T, D]."""
        cfg = self.cfg
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        weights, ids = moe.route(flat, self.router[...], cfg.n_experts_used, cfg.norm_topk_prob)
        w = (self.w_gate[...], self.w_up[...], self.w_down[...])
        out = moe.experts(flat, ids, weights, valid.reshape(B * T), *w, self.split)
        out = out.reshape(B, T, D).astype(x.dtype)
        if cfg.d_ff_shared:
            shared = self.shared(x)
            if cfg.shared_gate:
                gate = jnp.einsum("BTD,D->BT", x, self.shared_gate[...])[..., None]
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype) * shared
            out = out + shared
        return out


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, experts: bool = False, split=None):
        self.eps = cfg.norm_eps
        self.attn_norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        self.experts = experts
        if experts:
            self.moe = MoE(cfg, rngs, split)
        else:
            self.mlp = MLP(cfg, rngs)

    def __call__(self, x, rope_tab, kv, view: KVView):
        with jax.named_scope("attn"):
            h, kv = self.attn(rms_norm(x, self.attn_norm[...], self.eps), rope_tab, kv, view)
        x = x + h
        h = rms_norm(x, self.mlp_norm[...], self.eps)
        if self.experts:
            with jax.named_scope("moe"):
                x = x + self.moe(h, view.real(x.shape[1]))
        else:
            with jax.named_scope("mlp"):
                x = x + self.mlp(h)
        return x, kv


@partial(jax.jit, static_argnums=0)
def block(graphdef: nnx.GraphDef, params, x, rope_tab, kv, view: KVView):
    """One decoder layer as a pure function of its parameters -> (x, kv). Jitted so that the
    identical layers of a program are traced once, not once per layer: XLA inlines the calls,
    so the compiled program is the same, and tracing a program (what a warm start pays for
    every program of the plan) takes 40% less time."""
    return nnx.merge(graphdef, params)(x, rope_tab, kv, view)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, split: ExpertSplit | None = None):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), scale=1.0)
        self.layers = nnx.List(
            [Block(cfg, rngs, cfg.is_moe(i), split) for i in range(cfg.n_layers)]
        )
        self.norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

    def __call__(self, tokens, view: KVView, kv: list):
        """tokens [B, T] at the view's positions; kv per layer (K, V) pools ->
        final hidden states [B, T, D] (normed), new kv."""
        x = self.embed_tokens(tokens)  # [B, T, D]
        rope_tab = rope_table(view.positions(tokens.shape[1]), rope_inv_freq(self.cfg))
        new_kv = []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x, layer_kv = block(*nnx.split(layer), x, rope_tab, kv[i], view)
            new_kv.append(layer_kv)
        return self.final_norm(x), new_kv

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


def cache_layers(cfg: ModelConfig, dtype) -> list[AttentionKV]:
    """The typed cache of every layer, in layer order."""
    return [AttentionKV(cfg.n_kv_heads, cfg.head_dim, dtype) for _ in range(cfg.n_layers)]


def abstract_model(cfg: ModelConfig, split: ExpertSplit | None = None) -> Transformer:
    """The model with shapes only (no memory): the source of parameter names, shapes, axes."""
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), split))
