"""Layer split: pipeline stages on the `pp` mesh axis inside one jitted program.

Layers are assigned to stages as evenly as possible. Each stage runs the same sequence of
stage layers, each of one layer kind (attention or linear attention, MLP or experts): stage
layer j of every stage is stacked on a leading [pp] axis sharded over `pp`, so each device
holds only its own layers (and their KV pages and linear states) and unrolls its stage layers
in Python, as the dense model does. Mixed models (3 linear : 1 attention, dense and MoE
layers) get a stage-layer sequence that every stage's layer kinds fit in order (built
greedily: the kind most stages need next); a stage skips the stage layers it has no layer
for. Inside `jax.shard_map` over
`pp`, rows are split into microbatches that flow stage to stage with `lax.ppermute` (GPipe):
with M microbatches all stages work at once after a bubble of pp - 1 steps; with one row the
stages run in sequence, as llama.cpp's layer split does. Other mesh axes (tp) stay automatic
inside the stages.
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

from .. import kernels
from ..config import ModelConfig
from ..model.gdn import RecurrentState
from ..model.kvcache import KVConfig, KVView
from ..model.linear import embed
from ..model.moe import ExpertSplit
from ..model.transformer import (
    MTP,
    Block,
    block,
    head_logits,
    layer_cache,
    mtp_forward,
    param_dtype,
    quantizable,
    rms_norm,
    rope_inv_freq,
    rope_table,
)
from ..ops.quant import HostQuant
from .placement import (
    Placement,
    Reader,
    Runner,
    cache_shardings,
    for_kernel,
    kernel_fits,
    mtp_caches,
    put_quant,
)
from .sharding import named, spec

AXIS = "pp"


Kind = tuple[bool, bool]  # ModelConfig.kind: (linear attention, experts)


@dataclass(frozen=True)
class StagePlan:
    stages: int
    kinds: tuple[Kind, ...]  # [stage layer] -> the layer kind every stage stacks there
    layer_of: tuple[tuple[int, ...], ...]  # [stage][stage layer] -> layer index, -1 = none

    @property
    def depth(self) -> int:
        return len(self.kinds)

    @property
    def valid(self) -> np.ndarray:
        return np.array(self.layer_of) >= 0  # [pp, depth]


def stage_plan(cfg: ModelConfig, stages: int) -> StagePlan:
    """Contiguous runs of layers (the first `n_layers % stages` stages one layer longer), and
    stage layers that hold every stage's layers in order: at each step the kind the most
    stages need next (the earliest stage's on a tie), so uniform models get one stage layer
    per layer."""
    base, extra = divmod(cfg.n_layers, stages)
    counts = [base + (s < extra) for s in range(stages)]
    starts = np.cumsum([0, *counts[:-1]])
    runs = [[int(starts[s]) + j for j in range(counts[s])] for s in range(stages)]
    layer_of: list[list[int]]
    kinds, layer_of = [], [[] for _ in range(stages)]
    at = [0] * stages
    while any(at[s] < counts[s] for s in range(stages)):
        nexts = [cfg.kind(runs[s][at[s]]) for s in range(stages) if at[s] < counts[s]]
        kind = max(nexts, key=lambda k: (nexts.count(k), -nexts.index(k)))
        kinds.append(kind)
        for s in range(stages):
            fits = at[s] < counts[s] and cfg.kind(runs[s][at[s]]) == kind
            layer_of[s].append(runs[s][at[s]] if fits else -1)
            at[s] += fits
    return StagePlan(stages, tuple(kinds), tuple(tuple(row) for row in layer_of))


def microbatches(batch: int, stages: int) -> int:
    """As many microbatches as stages, if the rows divide that way."""
    return max(m for m in range(1, min(batch, stages) + 1) if batch % m == 0)


def stage_block(cfg: ModelConfig, kind: Kind, split: ExpertSplit | None = None) -> Block:
    """The abstract layer a stage layer of this kind stacks."""
    return nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0), kind, split))


def block_axes(cfg: ModelConfig, kind: Kind) -> dict[tuple, tuple]:
    """Logical axes of one layer's parameters, by path inside the layer."""
    block = stage_block(cfg, kind)
    return {path: v.get_metadata()["axes"] for path, v in nnx.to_flat_state(nnx.state(block))}


def place_pipeline(
    read: Reader, cfg: ModelConfig, dtype, name: str, mesh: Mesh, rules, *, kv_dtypes
) -> Placement:
    """The model split into stages over the mesh's `pp` axis; K and V pools of `kv_dtypes`."""
    params = place_params(read, cfg, mesh, rules, dtype)
    runner = pipeline_runner(cfg, mesh, rules, kv_dtypes)
    return Placement(name, mesh, rules, runner, params, cfg)


def place_params(read: Reader, cfg: ModelConfig, mesh: Mesh, rules: dict, dtype) -> dict:
    """Parameters in pipeline form: {embed, norm, [lm_head], stage_layers: [per stage layer,
    leaves [pp, ...]]}.

    `read(path, shape, blocks)` gives one parameter of the plain model as a host array, or a
    HostQuant (path as in the dense model, e.g. ("layers", 3, "attn", "wq")). Each layer is
    read once; each device receives only its own stage's layers.
    """
    plan = stage_plan(cfg, mesh.shape[AXIS])
    kernel = kernel_fits(mesh)
    params: dict = {}

    def put(path, shape, axes):  # one parameter replicated over the stages
        host = read(path, shape, blocks=quantizable(path))
        sharding = named(mesh, spec(axes, rules))
        if isinstance(host, HostQuant):
            return put_quant(path, host.pieces(), host, sharding, kernel)
        array = jax.device_put(host.astype(param_dtype(path, dtype), copy=False), sharding)
        return for_kernel(path, array, kernel)

    table = ("vocab", "embed")
    outer = [("embed", table), ("norm", ("embed",))]
    if not cfg.tie_embeddings:
        outer.append(("lm_head", table))
    for name, logical in outer:
        shape = (cfg.d_model,) if name == "norm" else (cfg.vocab_size, cfg.d_model)
        params[name] = put((name,), shape, logical)
    if cfg.mtp_layers:  # the MTP head runs after the stages, on every device
        mtp = mtp_module(cfg)
        leaves = {}
        for path, v in nnx.to_flat_state(nnx.state(mtp)):
            shape, axes = v.get_value().shape, v.get_metadata()["axes"]
            leaves[path] = put(("mtp", *path), shape, axes)
        params["mtp"] = nnx.to_pure_dict(nnx.from_flat_state(leaves))
    stacked = []
    for j, kind in enumerate(plan.kinds):
        entry: dict = {}
        block = stage_block(cfg, kind)
        shapes = {path: v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(block))}
        axes = block_axes(cfg, kind)
        for path, shape in shapes.items():
            sharding = named(mesh, P(AXIS, *spec(axes[path], rules)))
            node = entry
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = stack_slot(read, plan, j, path, shape, sharding, dtype, kernel)
        stacked.append(entry)
    params["stage_layers"] = stacked
    return params


def stack_slot(read: Reader, plan: StagePlan, j: int, path, shape, sharding, dtype, kernel):
    """Slot j's parameter `path` of every stage, stacked [pp, ...]; each device's callback
    takes its own stage's layer. Quantized when every stage's layer holds it in the same
    format (a Q4_K_M file mixes Q4_K and Q6_K layers), else in float."""
    layers = [plan.layer_of[s][j] for s in range(plan.stages)]
    dt = param_dtype(path, dtype)
    hosts = [read(("layers", n, *path), shape, blocks=quantizable(path)) if n >= 0 else None
             for n in layers]  # fmt: skip
    real = [h for h in hosts if h is not None]
    fmts = {h.fmt if isinstance(h, HostQuant) else None for h in real}
    if len(fmts) == 1 and None not in fmts:
        # every real layer's is a HostQuant (one format, not float)
        taken = [h.take() if isinstance(h, HostQuant) else None for h in hosts]
        ref = next(t for t in taken if t is not None)
        stacked = {  # [pp, ...]: the stages' parts, zeros (dequantizing to 0) where no layer
            k: np.stack([t[k] if t is not None else np.zeros_like(v) for t in taken])
            for k, v in ref.items()
        }
        parts = {k: (v, v.shape) for k, v in stacked.items()}
        first = real[0]
        assert isinstance(first, HostQuant)  # as every real layer's
        return put_quant(("layers", *path), parts, first, sharding, kernel, lead=1)
    if fmts != {None}:  # mixed formats: this stage layer is read in float
        hosts = [read(("layers", n, *path), shape) if n >= 0 else None for n in layers]

    def stage_slice(index):
        stage = index[0].start or 0  # one stage per device along pp
        host = hosts[stage]
        assert not isinstance(host, HostQuant)  # a stage layer read in float
        host = np.zeros(shape, dt) if host is None else host.astype(dt, copy=False)
        return host[None][(slice(0, 1), *index[1:])]

    array = jax.make_array_from_callback((plan.stages, *shape), sharding, stage_slice)
    return for_kernel(path, array, kernel, lead=1)


def pipeline_runner(cfg: ModelConfig, mesh: Mesh, rules: dict, kv_dtypes) -> Runner:
    plan = stage_plan(cfg, mesh.shape[AXIS])
    pp = plan.stages
    split = ExpertSplit.of(mesh, rules)
    block_defs = [nnx.graphdef(stage_block(cfg, kind, split)) for kind in plan.kinds]
    caches = [layer_cache(cfg, kind, kv_dtypes) for kind in plan.kinds]
    manual = frozenset({AXIS})
    valid = plan.valid

    def init_kv(kv: KVConfig):
        """Per stage layer, its cache on every stage: [pp, ...] leaves."""
        return [jax.tree.map(lambda a: jnp.broadcast_to(a, (pp, *a.shape)), cache.init(kv))
                for cache in caches]  # fmt: skip

    def stage(layers, x, rope_tab, view, kv):
        """One device's stage. layers/kv leaves [1, ...]; x [B, T, D]; view rows [B]."""
        s = lax.axis_index(AXIS)
        layers = jax.tree.map(lambda a: a[0], layers)
        kv = jax.tree.map(lambda a: a[0], kv)  # per stage layer (K, V) [P, K, H, page]
        B = x.shape[0]
        M = microbatches(B, pp)
        mb = B // M
        xs = x.reshape(M, mb, *x.shape[1:])  # [M, mb, T, D]
        ok = jnp.asarray(valid)[s]  # [depth]

        def rows(tree, m):  # microbatch m's rows of a [B, ...] tree (all of it when M = 1)
            if M == 1:
                return tree
            return jax.tree.map(
                lambda a: lax.dynamic_slice_in_dim(a, m * mb, mb, 0) if a.ndim else a, tree
            )

        def run_stage(y, kv, m):
            # Microbatches write disjoint pages and state indices of the shared pools: no slicing of
            # the cache, but for a decode loop's per-row linear states (view.state_index None).
            tab, v = rows(rope_tab, m), rows(view, m)
            new = []
            for j in range(plan.depth):
                per_row = (
                    view.state_index is None and isinstance(caches[j], RecurrentState) and M > 1
                )
                cache = rows(kv[j], m) if per_row else kv[j]
                with jax.named_scope(f"slot_{j}"):
                    run = partial(block, block_defs[j], layers[j], rope_tab=tab, view=v)
                    # A stage without a layer at this position passes y through, cache untouched.
                    y, cache = lax.cond(
                        ok[j], lambda y, c, run=run: run(x=y, kv=c), lambda y, c: (y, c), y, cache
                    )
                if per_row:
                    cache = jax.tree.map(
                        lambda a, part: lax.dynamic_update_slice_in_dim(a, part, m * mb, 0),
                        kv[j],
                        cache,
                    )
                new.append(cache)
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
        check_vma=kernels.checks_vma(),
    )

    kernel = kernel_fits(mesh)

    def forward(params, tokens, view: KVView, kv):
        view = view.replace(kernel=kernel)
        x = embed(params["embed"], tokens, params["norm"].dtype)  # [B, T, D]
        rope_tab = rope_table(view.positions(tokens.shape[1]), rope_inv_freq(cfg))
        with jax.named_scope("stages"):
            x, kv = staged(params["stage_layers"], x, rope_tab, view, kv)
        return rms_norm(x, params["norm"], cfg.norm_eps), kv

    def head(params, h):
        return head_logits(h, params["embed"] if cfg.tie_embeddings else params["lm_head"])

    mtp_def = nnx.graphdef(mtp_module(cfg, split)) if cfg.mtp_layers else None
    mtp = mtp_caches(cfg, kv_dtypes)

    def draft(params, tokens, hidden, view, kv):
        assert mtp_def is not None  # drafts only with an MTP head
        head = nnx.merge(mtp_def, params["mtp"])
        return mtp_forward(head, params["embed"], cfg, tokens, hidden, view, kv)

    return Runner(
        forward=forward,
        head=head,
        init_kv=init_kv,
        kv_shardings=lambda: [cache_shardings(c, mesh, rules, (AXIS,)) for c in caches],
        caches=tuple(caches),
        state_axis=1,  # [pp, state ids, ...]
        stages=pp,
        description=describe(plan),
        mtp=draft if mtp else None,
        mtp_caches=mtp,
        mtp_kv_shardings=lambda: [cache_shardings(c, mesh, rules) for c in mtp],
    )


def mtp_module(cfg: ModelConfig, split: ExpertSplit | None = None) -> MTP:
    """The abstract MTP head (shapes only)."""
    return nnx.eval_shape(lambda: MTP(cfg, nnx.Rngs(0), split))


def describe(plan: StagePlan) -> str:
    parts = []
    for s, layers in enumerate(plan.layer_of):
        real = [n for n in layers if n >= 0]
        skip = len(layers) - len(real)
        text = (
            f"stage {s}: layers {real[0]}-{real[-1]}"
            if len(real) > 1
            else f"stage {s}: layer {real[0]}"
        )
        parts.append(text + (f" ({skip} of {len(layers)} stage layers skipped)" if skip else ""))
    return "; ".join(parts)
