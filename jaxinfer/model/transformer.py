"""The Llama-family decoder (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3) as a flax NNX module.

Weights are stored [out, in] (GGUF order, no transpose at load), one array per layer and weight,
and the layer loop is written out in Python so XLA sees every layer separately: scanning stacked
layers makes XLA CPU copy each layer's weights every token (docs/design.md, "Layers"); the
depth-shared loop of parallel/depth.py reads stacked weights in place instead.
Hybrid models (Qwen3-Next, Qwen3.5) replace attention in some layers with Gated DeltaNet
(`GatedDeltaNet`, its math in gdn.py); their attention layers gate their output and rotate
only part of each head. Dimension letters: B batch, T tokens, S cache positions, D model,
N heads, K kv heads, G = N / K, H head dim, F mlp, V vocab; HK/HV linear key/value heads of
width DK/DV.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from .. import kernels
from ..config import ModelConfig
from ..ops.norm import rms_norm
from ..ops.quant import layers_apart, layers_back
from . import gdn, kvcache, moe
from .gdn import RecurrentState
from .kvcache import AttentionKV, KVView
from .linear import embed as embed_rows
from .linear import linear, linears, swiglu
from .moe import ExpertSplit


def _param(rngs: nnx.Rngs, shape, axes, scale=0.02, init_one=False) -> nnx.Param:
    """A parameter with its logical axes declared once (layouts map them to mesh axes)."""
    if init_one:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, axes=axes)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [R/2] (R = rope_dims) of rotate-half RoPE, with Llama 3 scaling or
    GGUF factors."""
    H = cfg.rope_dims  # partial RoPE rotates only the first rope_dims of each head
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


def rope_table(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, R/2] of rotate-half RoPE over R dims at positions [B, T] (once per
    forward).

    On CPU the table is made inside a conditional whose two branches are this same table: XLA
    CPU otherwise fuses cos and sin into every layer's q and k rotation and recomputes them
    there, and it does not fuse across a conditional (benchmarks/results/xla_cpu_findings.md,
    "RoPE's sin/cos once per program"). A one-branch switch or a constant predicate would be
    simplified away. Elsewhere the plain table: an accelerator reads a conditional's predicate
    on the host."""

    def table(p):
        angle = p[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
        return jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]

    if jax.default_backend() != "cpu":
        return table(positions)
    return lax.cond(positions[0, 0] >= 0, table, table, positions)


def rope(x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE of x [B, T, *, H] with a `rope_table`; partial RoPE (R < H) rotates the
    first R dims and passes the rest."""
    cos, sin = table
    R = 2 * cos.shape[-1]
    if R < x.shape[-1]:
        return jnp.concatenate([rope(x[..., :R], table), x[..., R:]], axis=-1)
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
        if cfg.attn_gate:  # per query head, rows of q_proj beside the query's in checkpoints
            self.wgate = _param(rngs, (N * H, D), ("heads", "embed"))

    def __call__(self, x, rope_tab, kv, view: KVView, norm=None):
        """x [B, T, D] at the view's positions (RMS-normalized first with `norm`, (weight,
        eps)); kv this layer's (K, V) pools -> [B, T, D], kv."""
        cfg = self.cfg
        B, T, _ = x.shape
        K, G, H = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        # q [B, T, N*H], k and v [B, T, K*H]; the output gate [B, T, N*H] shares their input
        ws = [self.wq[...], self.wk[...], self.wv[...]]
        q, k, v, *gate = linears(x, ws + ([self.wgate[...]] if cfg.attn_gate else []), norm=norm)
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

        gated = gate[0].reshape(B, T, K, G, H) if cfg.attn_gate else None
        out, kv = kvcache.update(q, k, v, kv, view, cfg.sliding_window, gated)  # [B, T, K, G, H]
        out = out.reshape(B, T, K * G * H).astype(x.dtype)  # [B, T, N*H]
        return linear(out, self.wo[...]), kv  # [B, T, D]


# Parameters that stay float32 whatever the compute dtype: the decay rate and its bias, whose
# bf16 rounding the recurrence would compound (a known accuracy bug elsewhere).
FLOAT32_PARAMS = frozenset({"a", "dt_bias"})


# Weights read only through `linear` / `embed`: these may stay quantized on the device.
QUANTIZABLE = frozenset(
    {"wq", "wk", "wv", "wo", "wgate", "wz", "wb", "wa", "w_gate", "w_up", "w_down", "fc",
     "embed", "lm_head"}
)  # fmt: skip


def quantizable(path: tuple) -> bool:
    return path[-1] in QUANTIZABLE


def param_dtype(path: tuple, dtype) -> np.dtype:
    """The dtype a parameter is stored in: the compute dtype, or float32 for FLOAT32_PARAMS."""
    linear = "linear_attn" in path and path[-1] in FLOAT32_PARAMS
    return np.dtype(np.float32 if linear else dtype)


class GatedDeltaNet(nnx.Module):
    """The linear-attention layer of Qwen3-Next / Qwen3.5: q, k, v through a causal conv, the
    gated delta rule per value head (gdn.py), a gated RMSNorm, the output projection.

    Weights are kept apart per role ([out, in]), V heads in checkpoint (HF) order: value head
    h reads key head h // (HV / HK), so splitting both head axes evenly keeps them together.
    `a` is -exp(A_log), the per-head decay rate.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, HK, HV = cfg.d_model, cfg.linear_k_heads, cfg.linear_v_heads
        KD, VD, K = HK * cfg.linear_k_dim, HV * cfg.linear_v_dim, cfg.conv_kernel
        self.cfg = cfg
        self.wq = _param(rngs, (KD, D), ("linear_k", "embed"))
        self.wk = _param(rngs, (KD, D), ("linear_k", "embed"))
        self.wv = _param(rngs, (VD, D), ("linear_v", "embed"))
        self.wz = _param(rngs, (VD, D), ("linear_v", "embed"))  # the output gate
        self.wb = _param(rngs, (HV, D), ("linear_v", "embed"))  # beta = sigmoid(b)
        self.wa = _param(rngs, (HV, D), ("linear_v", "embed"))  # decay input
        self.conv_q = _param(rngs, (KD, K), ("linear_k", None), scale=0.5)
        self.conv_k = _param(rngs, (KD, K), ("linear_k", None), scale=0.5)
        self.conv_v = _param(rngs, (VD, K), ("linear_v", None), scale=0.5)
        rate = -jnp.exp(0.5 * jax.random.normal(rngs.params(), (HV,), jnp.float32))
        self.a = nnx.Param(rate, axes=("linear_v",))
        self.dt_bias = _param(rngs, (HV,), ("linear_v",), scale=0.5)
        self.norm = _param(rngs, (cfg.linear_v_dim,), (None,), init_one=True)
        self.wo = _param(rngs, (D, VD), ("embed", "linear_v"))

    def __call__(self, x, state, view: KVView):
        """x [B, T, D] at the view's positions; state this layer's pools (conv q, k, v and
        delta-rule state by state index; in a decode loop, the rows' own states: gdn.read) ->
        [B, T, D], state."""
        cfg = self.cfg
        B, T, _ = x.shape
        HK, HV, DK, DV = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        real = view.real(T)  # [B, T]: padding never reaches the state
        # q, k, v [B, T, E] each, the output gate z [B, T, VD], b and a [B, T, HV]
        *proj, z, b, a = linears(
            x, [w[...] for w in (self.wq, self.wk, self.wv, self.wz, self.wb, self.wa)]
        )
        keep = view.pick is not None  # speculative: every token's state is kept
        source = view.state_index if view.source is None else view.source
        layer = view.layer  # depth-shared layers: the state pools are stacks [L, ...]
        # A decode step of a shared layer updates its delta-rule states in the stack, in place
        # (a kernel's); taken out and put back, they would cross memory three times.
        ops = kernels.delta_rule(state[3].shape, view.kernel, stacked=layer is not None)
        in_place = layer is not None and view.state_index is None and not keep and T == 1 and ops
        if in_place:
            assert layer is not None  # in_place implies a layer
            conv_q, conv_k, conv_v = gdn.at_layer(state[:3], layer)
            S = state[3]
        else:
            conv_q, conv_k, conv_v, S = gdn.read(state, source, view.start == 0, view.pick, layer)
        # A prompt chunk with prefix snapshots also keeps the states at the page ends it holds.
        marks = None
        if view.snaps is not None and view.state_index is not None:
            marks = gdn.boundaries(view.start, T, view.page)  # [B, M]
        weights = (self.conv_q, self.conv_k, self.conv_v)
        convs = [
            gdn.causal_conv(jnp.where(real[..., None], y, 0), w[...], c, view.length, keep, marks)
            for y, w, c in zip(proj, weights, (conv_q, conv_k, conv_v), strict=True)
        ]
        (q, conv_q), (k, conv_k), (v, conv_v) = (c[:2] for c in convs)
        q = gdn.l2norm(q.reshape(B, T, HK, DK)) * (1.0 / np.sqrt(DK))
        k = gdn.l2norm(k.reshape(B, T, HK, DK))
        q, k = jnp.repeat(q, HV // HK, axis=2), jnp.repeat(k, HV // HK, axis=2)  # [B, T, HV, DK]
        v = v.reshape(B, T, HV, DV).astype(jnp.float32)
        b, a = b.astype(jnp.float32), a.astype(jnp.float32)
        beta = jax.nn.sigmoid(b) * real[..., None]  # [B, T, HV]
        g = self.a[...] * jax.nn.softplus(a + self.dt_bias[...]) * real[..., None]  # log decay
        # the delta rule's step and chunk: a kernel's where the process has one
        step, chunk = kernels.delta_rule(S.shape, view.kernel) or (gdn.recurrent_step, gdn.chunked)
        if keep:
            o, S = gdn.recurrent(q, k, v, g, beta, S)  # S [B, T, HV, DK, DV]
        elif in_place:
            assert ops is not None  # in_place implies kernels
            o, S = ops[0](q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S, layer=layer)
            o = o[:, None]  # [B, 1, HV, DV]; S the whole stack
        elif T == 1:
            o, S = step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
            o, at_marks = o[:, None], S[:, None]  # [B, 1, HV, DV], the state after token 0
        elif marks is not None:  # the states at page ends too: the XLA form
            o, S, at_marks = gdn.chunked(q, k, v, g, beta, S, marks)
        else:
            o, S = chunk(q, k, v, g, beta, S)
        z = z.reshape(B, T, HV, DV)
        o = rms_norm(o, self.norm[...], cfg.norm_eps) * jax.nn.silu(z.astype(jnp.float32))
        if cfg.linear_out_tiled:  # wo's columns: head r * HK + k for our k * R + r
            o = o.reshape(B, T, HK, HV // HK, DV).swapaxes(2, 3)
        out = linear(o.reshape(B, T, HV * DV).astype(x.dtype), self.wo[...])  # [B, T, D]
        if in_place:
            assert layer is not None  # in_place implies a layer
            state = (*gdn.set_layer(state[:3], (conv_q, conv_k, conv_v), layer), S)
        else:
            state = gdn.write(
                state, (conv_q, conv_k, conv_v, S), view.state_index, view.keep_at, layer
            )
        if marks is not None:
            snaps = (*(c[2] for c in convs), at_marks)  # [B, M, ...] each
            ids = view.snapshot_ids(marks, gdn.skipped(state, layer=layer))
            state = gdn.put(state, snaps, ids, skip=True, layer=layer)
        return out, state


class MLP(nnx.Module):
    """SwiGLU feed-forward of width F (the model's d_ff, or a shared expert's width)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
        D, F = cfg.d_model, width or cfg.d_ff
        self.w_gate = _param(rngs, (F, D), ("mlp", "embed"))
        self.w_up = _param(rngs, (F, D), ("mlp", "embed"))
        self.w_down = _param(rngs, (D, F), ("embed", "mlp"))

    def __call__(self, x, norm=None):
        """x [B, T, D] (RMS-normalized first with `norm`, (weight, eps)) -> [B, T, D]."""
        h = swiglu(x, self.w_gate[...], self.w_up[...], norm=norm)  # [B, T, F]
        return linear(h, self.w_down[...])  # [B, T, D]


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

    def __call__(self, x, valid, whole=False):
        """x [B, T, D], valid [B, T] (padding routes nowhere) -> [B, T, D]. `whole`: the
        weights are whole on one device (a kernel may run the expert block)."""
        cfg = self.cfg
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        weights, ids = moe.route(flat, self.router[...], cfg.n_experts_used, cfg.norm_topk_prob)
        w = (self.w_gate[...], self.w_up[...], self.w_down[...])
        out = moe.experts(flat, ids, weights, valid.reshape(B * T), *w, self.split, whole)
        out = out.reshape(B, T, D).astype(x.dtype)
        if cfg.d_ff_shared:
            shared = self.shared(x)
            if cfg.shared_gate:
                gate = jnp.einsum("BTD,D->BT", x, self.shared_gate[...])[..., None]
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype) * shared
            out = out + shared
        return out


class Block(nnx.Module):
    """One decoder layer: attention or Gated DeltaNet, then the MLP or the expert block."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, kind=(False, False), split=None):
        linear, experts = kind  # ModelConfig.kind(layer)
        self.eps = cfg.norm_eps
        self.attn_norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        self.linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(cfg, rngs)
        else:
            self.attn = Attention(cfg, rngs)
        self.mlp_norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        self.experts = experts
        if experts:
            self.moe = MoE(cfg, rngs, split)
        else:
            self.mlp = MLP(cfg, rngs)

    def __call__(self, x, rope_tab, kv, view: KVView):
        # Attention and the MLP take x and their norm: where their products run in the CPU
        # kernel, the norm runs there too (a norm is 4-5 small XLA kernels).
        if self.linear:
            with jax.named_scope("linear_attn"):
                h, kv = self.linear_attn(rms_norm(x, self.attn_norm[...], self.eps), kv, view)
        else:
            with jax.named_scope("attn"):
                h, kv = self.attn(x, rope_tab, kv, view, norm=(self.attn_norm[...], self.eps))
        x = x + h
        if self.experts:
            with jax.named_scope("moe"):
                h = rms_norm(x, self.mlp_norm[...], self.eps)
                x = x + self.moe(h, view.real(x.shape[1]), view.kernel)
        else:
            with jax.named_scope("mlp"):
                x = x + self.mlp(x, norm=(self.mlp_norm[...], self.eps))
        return x, kv


def block(graphdef: nnx.GraphDef, params, x, rope_tab, kv, view: KVView):
    """One decoder layer as a pure function of its parameters -> (x, kv). Jitted so that the
    identical layers of a program are traced once, not once per layer: XLA inlines the calls,
    so the compiled program is the same, and tracing a program (what a warm start pays for
    every program of the plan) takes 40% less time. A stack's weights come in with their one
    layer index (quant.layers_apart), so that QKV and gate/up each stay one kernel call."""
    layers, params = layers_apart(params)
    return _block(graphdef, params, layers, x, rope_tab, kv, view)


@partial(jax.jit, static_argnums=0)
def _block(graphdef: nnx.GraphDef, params, layers, x, rope_tab, kv, view: KVView):
    return nnx.merge(graphdef, layers_back(params, layers))(x, rope_tab, kv, view)


class MTP(nnx.Module):
    """A multi-token-prediction head (Qwen3.5, Qwen3-Next): row p joins the model's final-norm
    hidden state h_p and the next token's embedding, fc(concat(norm(embed), norm(h))) (the
    embedding first), runs one full-attention decoder layer over the rows (its own KV cache,
    row p at cache position p, RoPE at p + 1), then a norm; the model's lm_head reads it as
    the logits of token p + 2. Its output feeds the next draft step as h."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, split: ExpertSplit | None = None):
        D = cfg.d_model
        self.eps = cfg.norm_eps
        self.embed_norm = _param(rngs, (D,), ("embed",), init_one=True)
        self.hidden_norm = _param(rngs, (D,), ("embed",), init_one=True)
        self.fc = _param(rngs, (D, 2 * D), ("embed", None))
        # the same expert block as the model's last layer (MoE models' MTP layer is MoE)
        self.layer = Block(cfg, rngs, (False, cfg.kind(cfg.n_layers - 1)[1]), split)
        self.norm = _param(rngs, (D,), ("embed",), init_one=True)

    def __call__(self, embedded, hidden, rope_tab, kv, view: KVView):
        """embedded, hidden [B, T, D] -> [B, T, D] (normed), kv (this layer's pools)."""
        x = jnp.concatenate(
            [rms_norm(embedded, self.embed_norm[...], self.eps),
             rms_norm(hidden, self.hidden_norm[...], self.eps)], axis=-1,
        )  # fmt: skip
        x = linear(x, self.fc[...])  # [B, T, D]
        x, kv = self.layer(x, rope_tab, kv, view)
        return rms_norm(x, self.norm[...], self.eps), kv


def mtp_forward(mtp: MTP, embed, cfg, tokens, hidden, view: KVView, kv):
    """The MTP head over rows at cache positions view.start + t: tokens [B, T] the next
    tokens, hidden [B, T, D] -> [B, T, D], kv."""
    x = embed_rows(embed, tokens, hidden.dtype).astype(hidden.dtype)  # [B, T, D]
    rope_tab = rope_table(view.positions(tokens.shape[1]) + 1, rope_inv_freq(cfg))
    return mtp(x, hidden, rope_tab, kv, view)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, split: ExpertSplit | None = None):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), scale=1.0)
        self.layers = nnx.List([Block(cfg, rngs, cfg.kind(i), split) for i in range(cfg.n_layers)])
        self.norm = _param(rngs, (cfg.d_model,), ("embed",), init_one=True)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        if cfg.mtp_layers:
            self.mtp = MTP(cfg, rngs, split)

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

    def draft(self, tokens, hidden, view: KVView, kv):
        return mtp_forward(self.mtp, self.embed[...], self.cfg, tokens, hidden, view, kv)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        # a quantized table dequantizes to the compute dtype, which the norms are stored in
        return embed_rows(self.embed[...], tokens, self.norm[...].dtype)  # [B, T, D]

    def final_norm(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.norm[...], self.cfg.norm_eps)

    def logits(self, h: jax.Array) -> jax.Array:
        head = self.embed if self.cfg.tie_embeddings else self.lm_head
        return head_logits(h, head[...])


def head_logits(h: jax.Array, head) -> jax.Array:
    """Final hidden states h [..., D] and head [V, D] (plain or quantized) -> float32 logits
    [..., V]."""
    return linear(h, head, jnp.float32)


def layer_cache(
    cfg: ModelConfig, kind: tuple[bool, bool], kv_dtypes
) -> AttentionKV | RecurrentState:
    """The typed cache of a layer of this kind: KV pages of `kv_dtypes` (the K and V pools'
    formats, kvquant.py), or a linear layer's state (float32)."""
    if not kind[0]:
        return AttentionKV(cfg.n_kv_heads, cfg.head_dim, *kv_dtypes)
    KD, VD = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_v_heads * cfg.linear_v_dim
    return RecurrentState(
        (KD, KD, VD), cfg.conv_kernel, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    )


def cache_layers(cfg: ModelConfig, kv_dtypes) -> list[AttentionKV | RecurrentState]:
    """The typed cache of every layer, in layer order (KV pools of the (K, V) `kv_dtypes`)."""
    return [layer_cache(cfg, cfg.kind(i), kv_dtypes) for i in range(cfg.n_layers)]


@lru_cache(maxsize=8)
def abstract_model(cfg: ModelConfig, split: ExpertSplit | None = None) -> Transformer:
    """The model with shapes only (no memory): the source of parameter names, shapes, axes.
    Cached: tracing it costs a tenth of a second and more with the layers (never mutated)."""
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), split))
