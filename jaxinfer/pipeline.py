"""Layer split: pipeline stages on the `pp` mesh axis inside one jitted program.

Layers are assigned to stages as evenly as possible; slot j of every stage is stacked on a
leading [pp] axis sharded over `pp`, so each device holds only its own layers (and their KV
page pools) and unrolls its slots in Python, as the dense model does. Inside `jax.shard_map` over
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

from . import kvcache
from .config import ModelConfig, rope_inv_freq
from .errors import LayoutError
from .kvcache import AttentionKV, KVConfig, KVView
from .model import Block, block, head_logits, rms_norm, rope_table
from .moe import ExpertSplit
from .placement import Placement, Reader, Runner
from .sharding import named, spec

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


def stage_block(cfg: ModelConfig, split: ExpertSplit | None = None) -> Block:
    """The abstract layer every slot stacks: all layers must share one structure."""
    if cfg.moe and cfg.dense_layers:
        raise LayoutError(
            f"the layer split stacks identical layers, but layers {list(cfg.dense_layers)} of "
            "this MoE model are dense; use layout 'single', 'tensor' or 'expert'"
        )
    return nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0), cfg.moe, split))


def block_axes(cfg: ModelConfig) -> dict[tuple, tuple]:
    """Logical axes of one layer's parameters, by path inside the layer."""
    block = stage_block(cfg)
    return {path: v.get_metadata()["axes"] for path, v in nnx.to_flat_state(nnx.state(block))}


def place_pipeline(
    read: Reader, cfg: ModelConfig, dtype, name: str, mesh: Mesh, rules
) -> Placement:
    """The model split into stages over the mesh's `pp` axis."""
    params = place_params(read, cfg, mesh, rules, dtype)
    return Placement(name, mesh, rules, pipeline_runner(cfg, mesh, rules, dtype), params)


def place_params(read: Reader, cfg: ModelConfig, mesh: Mesh, rules: dict, dtype) -> dict:
    """Parameters in pipeline form: {embed, norm, [lm_head], slots: [per slot, leaves [pp, ...]]}.

    `read(path, shape)` gives one parameter of the plain model as a host array (path as in the
    dense model, e.g. ("layers", 3, "attn", "wq")). Each device's callback loads only the
    layers of its own stage.
    """
    plan = stage_plan(cfg.n_layers, mesh.shape[AXIS])
    np_dtype = np.dtype(dtype)
    block = stage_block(cfg)
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
    block_def = nnx.graphdef(stage_block(cfg, ExpertSplit.of(mesh, rules)))
    layer = AttentionKV(cfg.n_kv_heads, cfg.head_dim, dtype)
    manual = frozenset({AXIS})
    valid = plan.valid

    def init_kv(kv: KVConfig):
        """Per slot, the (K, V) pools of that slot's layer on every stage: [pp, P, K, H, page]."""
        return [jax.tree.map(lambda a: jnp.broadcast_to(a, (pp, *a.shape)), layer.init(kv))
                for _ in range(plan.slots)]  # fmt: skip

    def stage(slots, x, rope_tab, view, kv):
        """One device's stage. slots/kv leaves [1, ...]; x [B, T, D]; view rows [B]."""
        s = lax.axis_index(AXIS)
        slots = jax.tree.map(lambda a: a[0], slots)
        kv = jax.tree.map(lambda a: a[0], kv)  # per slot (K, V) [P, K, H, page]
        B = x.shape[0]
        M = microbatches(B, pp)
        mb = B // M
        xs = x.reshape(M, mb, *x.shape[1:])  # [M, mb, T, D]
        ok = jnp.asarray(valid)[s]  # [slots]

        def rows(tree, m):  # microbatch m's rows of a [B, ...] tree (all of it when M = 1)
            if M == 1:
                return tree
            return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, m * mb, mb, 0), tree)

        def run_stage(y, kv, m):
            # Microbatches write disjoint pages of the shared pools: no slicing of the cache.
            tab, v = rows(rope_tab, m), rows(view, m)
            new = []
            for j in range(plan.slots):
                with jax.named_scope(f"slot_{j}"):
                    out, layer_kv = block(block_def, slots[j], y, tab, kv[j], v)
                # Padding slots are identity layers; what they write lands in their own pools.
                y = jnp.where(ok[j], out, y)
                new.append(layer_kv)
            return y, new

        def step(t, carry):
            state, outs, kv = carry
            m = t - s  # the microbatch this stage holds at time t
            live = (m >= 0) & (m < M)
            mi = jnp.clip(m, 0, M - 1)
            y = jnp.where(s == 0, xs[mi], state)
            # Idle stages (the pipeline bubble) skip their layers and keep their cache.
            y, kv = lax.cond(live, partial(run_stage, m=mi), lambda y, kv: (y, kv), y, kv)
            outs = jnp.where((s == pp - 1) & live, outs.at[mi].set(y), outs)
            state = lax.ppermute(y, AXIS, [(i, (i + 1) % pp) for i in range(pp)])
            return state, outs, kv

        init = lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), (AXIS,), to="varying")
        _, outs, kv = lax.fori_loop(0, M + pp - 1, step, (*init, kv))
        out = lax.psum(jnp.where(s == pp - 1, outs, jnp.zeros_like(outs)), AXIS)  # [M, mb, T, D]
        return out.reshape(x.shape), jax.tree.map(lambda a: a[None], kv)

    staged = jax.shard_map(
        stage,
        mesh=mesh,
        in_specs=(P(AXIS), P(), P(), P(), P(AXIS)),
        out_specs=(P(), P(AXIS)),
        axis_names=manual,
    )

    def forward(params, tokens, view: KVView, kv):
        x = jnp.take(params["embed"], tokens, axis=0)  # [B, T, D]
        rope_tab = rope_table(view.positions(tokens.shape[1]), rope_inv_freq(cfg))
        with jax.named_scope("stages"):
            x, kv = staged(params["slots"], x, rope_tab, view, kv)
        return rms_norm(x, params["norm"], cfg.norm_eps), kv

    def head(params, h):
        return head_logits(h, params["embed"] if cfg.tie_embeddings else params["lm_head"])

    pool = named(mesh, P(AXIS, *spec(kvcache.AXES, rules)))
    return Runner(
        forward=forward,
        head=head,
        init_kv=init_kv,
        kv_shardings=lambda: [(pool, pool)] * plan.slots,
        stages=pp,
        description=describe(plan),
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
