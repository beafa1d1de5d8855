"""Layer split: pipeline stages on the `pp` mesh axis inside one jitted program.

Layers are assigned to stages as evenly as possible; slot j of every stage is stacked on a
leading [pp] axis sharded over `pp`, so each device holds only its own layers (and their KV
cache) and unrolls its slots in Python, as the dense model does. Inside `jax.shard_map` over
`pp`, rows are split into microbatches that flow stage to stage with `lax.ppermute` (GPipe):
with M microbatches all stages work at once after a bubble of pp - 1 steps; with one row the
stages run in sequence, as llama.cpp's layer split does. Stages with fewer layers than slots
pad with masked identity layers. Other mesh axes (tp) stay automatic inside the stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .model import Block, head_logits, rms_norm
from .sharding import cache_spec, named, spec
from .steps import Runner

AXIS = "pp"


@dataclass(frozen=True)
class StagePlan:
    stages: int
    slots: int  # layer slots per stage (the largest stage's layer count)
    layer_of: tuple[tuple[int, ...], ...]  # [stage][slot] -> layer index, -1 = padding

    @property
    def valid(self) -> np.ndarray:
        return np.array(self.layer_of) >= 0  # [pp, slots]


def stage_plan(n_layers: int, stages: int) -> StagePlan:
    """Contiguous runs of layers, the first `n_layers % stages` stages one layer longer."""
    base, extra = divmod(n_layers, stages)
    counts = [base + (s < extra) for s in range(stages)]
    starts = np.cumsum([0, *counts[:-1]])
    slots = max(counts)
    layer_of = tuple(
        tuple(int(starts[s]) + j if j < counts[s] else -1 for j in range(slots))
        for s in range(stages)
    )
    return StagePlan(stages, slots, layer_of)


def microbatches(batch: int, stages: int) -> int:
    """As many microbatches as stages, if the rows divide that way."""
    return max(m for m in range(1, min(batch, stages) + 1) if batch % m == 0)


def block_axes(cfg: ModelConfig) -> dict[tuple, tuple]:
    """Logical axes of one layer's parameters, by path inside the layer."""
    block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
    return {path: v.get_metadata()["axes"] for path, v in nnx.to_flat_state(nnx.state(block))}


def place_params(read, cfg: ModelConfig, mesh: Mesh, rules: dict, dtype) -> dict:
    """Parameters in pipeline form: {embed, norm, [lm_head], slots: [per slot, leaves [pp, ...]]}.

    `read(path, shape)` gives one parameter of the plain model as a host array (path as in the
    dense model, e.g. ("layers", 3, "attn", "wq")). Each device's callback loads only the
    layers of its own stage.
    """
    plan = stage_plan(cfg.n_layers, mesh.shape[AXIS])
    np_dtype = np.dtype(dtype)
    block = nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0)))
    shapes = {path: v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(block))}
    axes = block_axes(cfg)
    params: dict = {}
    table = ("vocab", "embed")
    outer = [("embed", table), ("norm", ("embed",))]
    if not cfg.tie_embeddings:
        outer.append(("lm_head", table))
    for name, logical in outer:  # replicated over the stages
        shape = (cfg.d_model,) if name == "norm" else (cfg.vocab_size, cfg.d_model)
        host = read((name,), shape).astype(np_dtype)
        params[name] = jax.device_put(host, named(mesh, spec(logical, rules)))
    slots = []
    for j in range(plan.slots):
        slot: dict = {}
        for path, shape in shapes.items():

            def stage_slice(index, path=path, shape=shape, j=j):
                stage = index[0].start or 0  # one stage per device along pp
                layer = plan.layer_of[stage][j]
                if layer < 0:  # padding slot: an identity layer, its weights never used
                    host = np.zeros(shape, np_dtype)
                else:
                    host = read(("layers", layer, *path), shape).astype(np_dtype)
                return host[None][(slice(0, 1), *index[1:])]

            sharding = named(mesh, P(AXIS, *spec(axes[path], rules)))
            leaf = jax.make_array_from_callback((plan.stages, *shape), sharding, stage_slice)
            node = slot
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = leaf
        slots.append(slot)
    params["slots"] = slots
    return params


def pipeline_runner(cfg: ModelConfig, mesh: Mesh, rules: dict, dtype) -> Runner:
    plan = stage_plan(cfg.n_layers, mesh.shape[AXIS])
    pp = plan.stages
    block_def = nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))))
    kv_spec = P(AXIS, *cache_spec(rules))
    manual = frozenset({AXIS})
    valid = plan.valid

    def init_cache(batch: int, length: int):
        shape = (pp, batch, cfg.n_kv_heads, length, cfg.head_dim)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(plan.slots)]

    def stage(slots, x, positions, cache):
        """One device's stage. slots/cache leaves [1, ...]; x [B, T, D]; positions [B, T]."""
        s = lax.axis_index(AXIS)
        slots = jax.tree.map(lambda a: a[0], slots)
        cache = jax.tree.map(lambda a: a[0], cache)  # per slot (k, v) [B, K, S, H]
        B = x.shape[0]
        M = microbatches(B, pp)
        mb = B // M
        xs = x.reshape(M, mb, *x.shape[1:])  # [M, mb, T, D]
        ps = positions.reshape(M, mb, -1)  # [M, mb, T]
        ok = jnp.asarray(valid)[s]  # [slots]

        def run_stage(y, pos, cache, m):
            new = []
            for j in range(plan.slots):
                k, v = cache[j]
                if M > 1:  # this microbatch's rows of the cache
                    k_m = lax.dynamic_slice_in_dim(k, m * mb, mb, 0)
                    v_m = lax.dynamic_slice_in_dim(v, m * mb, mb, 0)
                else:
                    k_m, v_m = k, v
                with jax.named_scope(f"slot_{j}"):
                    out, k_m, v_m = nnx.merge(block_def, slots[j])(y, pos, k_m, v_m)
                y = jnp.where(ok[j], out, y)  # padding slots are identity layers
                if M > 1:
                    k = lax.dynamic_update_slice_in_dim(k, k_m, m * mb, 0)
                    v = lax.dynamic_update_slice_in_dim(v, v_m, m * mb, 0)
                else:
                    k, v = k_m, v_m
                new.append((k, v))
            return y, new

        def step(t, carry):
            state, outs, cache = carry
            m = t - s  # the microbatch this stage holds at time t
            live = (m >= 0) & (m < M)
            mi = jnp.clip(m, 0, M - 1)
            y = jnp.where(s == 0, xs[mi], state)
            # Idle stages (the pipeline bubble) skip their layers and keep their cache.
            y, cache = lax.cond(
                live,
                partial(run_stage, m=mi),
                lambda y, pos, cache: (y, cache),
                y, ps[mi], cache,
            )  # fmt: skip
            outs = jnp.where((s == pp - 1) & live, outs.at[mi].set(y), outs)
            state = lax.ppermute(y, AXIS, [(i, (i + 1) % pp) for i in range(pp)])
            return state, outs, cache

        init = lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), (AXIS,), to="varying")
        _, outs, cache = lax.fori_loop(0, M + pp - 1, step, (*init, cache))
        out = lax.psum(jnp.where(s == pp - 1, outs, jnp.zeros_like(outs)), AXIS)  # [M, mb, T, D]
        return out.reshape(x.shape), jax.tree.map(lambda a: a[None], cache)

    staged = jax.shard_map(
        stage,
        mesh=mesh,
        in_specs=(P(AXIS), P(), P(), P(AXIS)),
        out_specs=(P(), P(AXIS)),
        axis_names=manual,
    )

    def forward(params, tokens, positions, cache):
        x = jnp.take(params["embed"], tokens, axis=0)  # [B, T, D]
        with jax.named_scope("stages"):
            x, cache = staged(params["slots"], x, positions, cache)
        return rms_norm(x, params["norm"], cfg.norm_eps), cache

    def head(params, h):
        return head_logits(h, params["embed"] if cfg.tie_embeddings else params["lm_head"])

    kv = named(mesh, kv_spec)
    return Runner(
        forward=forward,
        head=head,
        init_cache=init_cache,
        cache_shardings=lambda: [(kv, kv)] * plan.slots,
        stages=pp,
        plan=describe(plan),
        batch_axis=1,
    )


def describe(plan: StagePlan) -> str:
    parts = []
    for s, layers in enumerate(plan.layer_of):
        real = [n for n in layers if n >= 0]
        pad = len(layers) - len(real)
        text = (
            f"stage {s}: layers {real[0]}-{real[-1]}"
            if len(real) > 1
            else f"stage {s}: layer {real[0]}"
        )
        parts.append(text + (f" (+{pad} identity slot)" if pad else ""))
    return "; ".join(parts)
