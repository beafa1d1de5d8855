"""Layer split: pipeline stages on the `pp` mesh axis inside one jitted program.

Layers are assigned to stages as evenly as possible. Each stage runs the same sequence of
stage layers, each of one layer kind (attention or linear attention, MLP or experts): stage
layer j of every stage is stacked on a leading [pp] axis sharded over `pp`, so each device
holds only its own layers (and their KV pages and linear states). Mixed models (3 linear : 1
attention, dense and MoE layers) get a stage-layer sequence that every stage's layer kinds
fit in order (built greedily: the kind most stages need next); a stage skips the stage layers
it has no layer for.

The stage layers are cut into runs of a repeated unit (runs.py) as depth-shared layers are
(depth.py), and each unit position's stage layers are stacked too, [pp, n, ...]: a stage runs
a loop over the unit with one traced body per unit position, so a program's size follows the
number of distinct units, not the depth. That holds where the CPU kernels read a stack's
entry in place (float32, no tensor split); elsewhere every stage layer is a run of its own
(unrolled). A weight whose stages' layers hold it in different block formats (a Q4_K_M
file's Q6_K layers) is one stack per format, and a layer's products pick its own (Mix). Inside
`jax.shard_map` over `pp`, rows are split into microbatches that flow stage
to stage with `lax.ppermute` (GPipe): with M microbatches all stages work at once after a
bubble of pp - 1 steps; with one row the stages run in sequence, as llama.cpp's layer split
does. Other mesh axes (tp) stay automatic inside the stages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import kernels
from ..config import ModelConfig
from ..formats.gguf_file import release_views
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
from ..ops.quant import FORMATS, GGML_FORMATS, HostQuant, QArray, QSwitch
from .hugepages import Arena
from .placement import (
    Placement,
    Reader,
    Runner,
    cache_shardings,
    for_kernel,
    kernel_fits,
    mtp_caches,
    put_quant,
    quant_shardings,
    to_device,
)
from .runs import Run, layer_params, layer_runs, repeat
from .runs import describe as describe_runs
from .sharding import named, spec

AXIS = "pp"

log = logging.getLogger(__name__)


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


# A layer's or stage layer's signature (runs.py): its kind, and (path, type) of each of its
# matrices: the type the file stores it in (for a stage layer, every stage's layer there;
# "Q4_K|Q6_K" where the layers of its kind hold it in several block formats: one stack per
# format, see Mix; "mixed" where the types include a float one: read in float)
Signature = tuple[Kind, tuple[tuple[tuple, str], ...]]

# GGUF types kept in blocks whatever the compute dtype (16-bit floats are not: see loader)
BLOCK_TYPES = frozenset(f.ggml for f in FORMATS.values() if f.ggml and f.block > 1)


def _block_mix(types: set[str]) -> bool:
    """Whether layers of these stored types take one stack per format (Mix)."""
    return len(types) > 1 and types <= BLOCK_TYPES


def matrix_paths(cfg: ModelConfig, kinds) -> dict[Kind, list[tuple]]:
    """Per layer kind of `kinds`: the paths of its matrices (what a file may keep in blocks),
    traced once per kind."""
    return {kind: [p for p, _ in nnx.to_flat_state(nnx.state(stage_block(cfg, kind)))
                   if quantizable(p)] for kind in set(kinds)}  # fmt: skip


def stage_signatures(cfg: ModelConfig, plan: StagePlan, stored) -> list[Signature]:
    """Per stage layer: its kind and, with `stored` (parameter path -> the type a GGUF file
    stores it in), the type of each of its matrices over the stages' layers there. A matrix
    that the layers of one kind hold in several block formats (a Q4_K_M file's ffn_down and
    attn_v: Q6_K in some layers) gets their union on every stage layer of the kind, so that
    those stage layers still form one run (Mix keeps each format in its own stack)."""
    paths = matrix_paths(cfg, plan.kinds) if stored is not None else {}
    union: dict[tuple[Kind, tuple], str] = {}
    for kind, kind_paths in paths.items():
        layers = [n for row in plan.layer_of for j, n in enumerate(row)
                  if n >= 0 and plan.kinds[j] == kind]  # fmt: skip
        for p in kind_paths:
            types = {stored(("layers", n, *p)) for n in layers}
            if _block_mix(types):
                union[kind, p] = "|".join(sorted(types))
    sigs: list[Signature] = []
    for j, kind in enumerate(plan.kinds):
        formats: tuple[tuple[tuple, str], ...] = ()
        if stored is not None:
            layers = [row[j] for row in plan.layer_of if row[j] >= 0]
            formats = tuple((p, union.get((kind, p)) or _one({stored(("layers", n, *p))
                                                               for n in layers}))
                            for p in paths[kind])  # fmt: skip
        sigs.append((kind, formats))
    return sigs


def _one(types: set[str]) -> str:
    return types.pop() if len(types) == 1 else "mixed"


@dataclass(frozen=True, eq=False)
class Mix:
    """A segment's matrices whose stages' layers hold them in different block formats (a
    Q4_K_M file keeps ffn_down and attn_v in Q6_K in the first and last eighth of the layers
    and every third between, so stage layer j of two stages often differs). Each such matrix
    is one stack per format, [pp, depth, ...], holding each stage's entries of that format in
    order (depth: the most any stage has; the others pad with zeros), so the layers stay in
    blocks. An entry reads its format and its index in that format's stack from per-stage
    tables, and its products pick the format's branch (ops/quant.py's QSwitch)."""

    paths: tuple[tuple, ...]  # the mixed matrices
    formats: tuple[tuple[str, ...], ...]  # per path, its formats (GGUF type names, sorted)
    which: np.ndarray  # [pp, n, paths] int32: an entry's format in formats[p], -1: no layer
    index: np.ndarray  # [pp, n, paths] int32: an entry's index in its format's stack

    def stack(self, p: int, f: int) -> tuple[list[list[int | None]], int]:
        """The entries (segment positions, None = padding) of path p's stack of format f, per
        stage, and its depth."""
        rows = [[n for n, w in enumerate(stage[:, p]) if w == f] for stage in self.which]
        depth = max(map(len, rows))
        return [[*row, *[None] * (depth - len(row))] for row in rows], depth


def segment_mix(plan: StagePlan, stage_layers: list[int], paths: list[tuple], stored
                ) -> Mix | None:  # fmt: skip
    """The Mix of the segment whose stage layers are `stage_layers` (in stack order), or None
    where every matrix has one block format (or a float type is among them: read in float)."""
    if stored is None:
        return None
    entries = np.array([[plan.layer_of[s][j] for j in stage_layers] for s in range(plan.stages)])
    mixed: list[tuple] = []
    formats: list[tuple[str, ...]] = []
    for path in paths:
        found = {stored(("layers", int(n), *path)) for n in entries[entries >= 0]}
        if _block_mix(found):
            mixed.append(path)
            formats.append(tuple(sorted(found)))
    if not mixed:
        return None
    which = np.full((*entries.shape, len(mixed)), -1, np.int32)
    index = np.zeros_like(which)
    for p, (path, types) in enumerate(zip(mixed, formats, strict=True)):
        for s, row in enumerate(entries):
            seen = [0] * len(types)
            for n, layer in enumerate(row):
                if layer >= 0:
                    f = which[s, n, p] = types.index(stored(("layers", int(layer), *path)))
                    index[s, n, p] = seen[f]
                    seen[f] += 1
    return Mix(tuple(mixed), tuple(formats), which, index)


def stage_runs(signatures: list[Signature], shared: bool) -> tuple[Run[Signature], ...]:
    """The stage layers cut into runs of a repeated unit where `shared`, else one run each."""
    if shared:
        return layer_runs(signatures)
    return tuple(Run(j, (sig,), 1) for j, sig in enumerate(signatures))


def place_pipeline(
    read: Reader, cfg: ModelConfig, dtype, name: str, mesh: Mesh, rules, *, kv_dtypes,
    stored=None, shared: bool = False,
) -> Placement:  # fmt: skip
    """The model split into stages over the mesh's `pp` axis; K and V pools of `kv_dtypes`.
    With `shared` (and where the kernels read stacks in place: kernel_fits), stage layers of a
    repeated unit share traced bodies; `stored` as for stage_signatures."""
    plan = stage_plan(cfg, mesh.shape[AXIS])
    shared = shared and kernel_fits(mesh)
    runs = stage_runs(stage_signatures(cfg, plan, stored), shared)
    paths = matrix_paths(cfg, plan.kinds) if stored is not None else {}
    mixes = [segment_mix(plan, run.stacked(seg), paths.get(seg.signature[0], []), stored)
             for run in runs for seg in run.segments]  # fmt: skip
    params = place_params(read, cfg, mesh, rules, dtype, plan, runs, mixes)
    runner = pipeline_runner(cfg, mesh, rules, kv_dtypes, plan, runs, mixes)
    return Placement(name, mesh, rules, runner, params, cfg)


def place_params(
    read: Reader, cfg: ModelConfig, mesh: Mesh, rules: dict, dtype, plan: StagePlan,
    runs: tuple[Run, ...], mixes: list[Mix | None],
) -> dict:  # fmt: skip
    """Parameters in pipeline form: {embed, norm, [lm_head], [mtp], runs: [per run, per
    segment of its unit, the segment's stage layers' parameters stacked [pp, n, ...]]}; a
    matrix of a segment's Mix is {format: its stack [pp, depth, ...]}.

    `read(path, shape, blocks)` gives one parameter of the plain model as a host array, or a
    HostQuant (path as in the dense model, e.g. ("layers", 3, "attn", "wq")). Each layer is
    read once; each device receives only its own stage's layers.
    """
    kernel = kernel_fits(mesh)
    params: dict = {}
    cpu = mesh.devices.flat[0].platform == "cpu"
    arena = Arena() if cpu and Arena.usable() else None  # weights in huge pages

    def put(path, shape, axes):  # one parameter replicated over the stages
        host = read(path, shape, blocks=quantizable(path))
        sharding = named(mesh, spec(axes, rules))
        if isinstance(host, HostQuant):
            parts = host.pieces()
            placed = put_quant(path, parts, host, sharding, kernel, arena=arena)
            release_views([part for part, _ in parts.values()])  # as stack_blocks
            return placed
        array = to_device(host.astype(param_dtype(path, dtype), copy=False), sharding, arena)
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
    params["runs"] = []
    widened: dict[str, int] = {}  # weights whose stages mix formats, read in float: bytes
    padding = 0  # bytes of the zero entries of per-format stacks (Mix)
    mix_of = iter(mixes)
    for run in runs:
        units = []
        for seg in run.segments:
            kind, mix = seg.signature[0], next(mix_of)
            mixed = {p for p, t in seg.signature[1] if t == "mixed"}
            entry: dict = {}
            flat = nnx.to_flat_state(nnx.state(stage_block(cfg, kind)))
            axes = block_axes(cfg, kind)
            for path, v in flat:
                sharding = named(mesh, P(AXIS, None, *spec(axes[path], rules)))
                node = entry
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                shape = v.get_value().shape
                layers = run.stacked(seg)
                if mix is not None and path in mix.paths:
                    stacks = stack_formats(read, plan, layers, mix, path, shape, sharding, kernel,
                                           arena)  # fmt: skip
                    node[path[-1]] = stacks
                    p = mix.paths.index(path)
                    for f, w in enumerate(stacks.values()):
                        rows, depth = mix.stack(p, f)
                        pads = sum(n is None for row in rows for n in row)
                        padding += _nbytes(w) * pads // (plan.stages * depth)
                    continue
                node[path[-1]] = stack_segment(
                    read, plan, layers, path, shape, sharding, dtype, kernel, arena
                )
                if path in mixed:
                    name = ".".join(map(str, path))
                    widened[name] = widened.get(name, 0) + _nbytes(node[path[-1]])
            units.append(entry)
        params["runs"].append(units)
    if padding:
        log.info("stacks per format: %.1f MiB of zero entries", padding / 2**20)
    if widened:
        log.warning(
            "%s: the stages' layers at one stage layer hold them in different formats (the "
            "mix of a Q*_K_M file), so they load in float (%.1f MiB in all); on one device "
            "they stay in blocks",
            ", ".join(sorted(widened)), sum(widened.values()) / 2**20,
        )  # fmt: skip
    return params


def _nbytes(weight) -> int:
    """Bytes of a placed weight (a QArray's parts, or an array), over all its devices."""
    return sum(a.nbytes for a in jax.tree.leaves(weight))


def stack_segment(read: Reader, plan: StagePlan, stage_layers: list[int], path, shape,
                  sharding, dtype, kernel, arena: Arena | None = None):  # fmt: skip
    """Parameter `path` of the stage layers `stage_layers` (a segment's, in stack order) on
    every stage, stacked [pp, n, ...]; each device receives its own stage's entries (built in
    place: by_stage). Quantized when every stage's layer there holds it in one format (a
    Q4_K_M file mixes Q4_K and Q6_K layers), else in float; a stage without a layer at an
    entry holds zeros (dequantizing to 0)."""
    pp, n = plan.stages, len(stage_layers)
    hosts = [[read(("layers", layer, *path), shape, blocks=quantizable(path)) if layer >= 0
              else None for layer in (plan.layer_of[s][j] for j in stage_layers)]
             for s in range(pp)]  # fmt: skip
    fmts = {(h.fmt, h.width) if isinstance(h, HostQuant) else None
            for row in hosts for h in row if h is not None}  # fmt: skip
    if len(fmts) == 1 and None not in fmts:
        return stack_blocks(hosts, path, sharding, kernel, arena)
    dt = param_dtype(path, dtype)
    if fmts != {None}:  # mixed formats: this segment is read in float
        hosts = [[read(("layers", plan.layer_of[s][j], *path), shape)
                  if plan.layer_of[s][j] >= 0 else None for j in stage_layers]
                 for s in range(pp)]  # fmt: skip

    def entry(s, j):
        h, hosts[s][j] = hosts[s][j], None  # dropped once the stage's devices have it
        return None if h is None else {"w": (h.astype(dt, copy=False), shape)}

    stacked = by_stage({"w": ((pp, n, *shape), dt)}, {"w": sharding}, entry, arena)["w"]
    return for_kernel(path, stacked, kernel, lead=2)


def stack_blocks(hosts: list[list], path, sharding, kernel, arena: Arena | None = None
                 ) -> QArray:  # fmt: skip
    """Quantized weights of one format, hosts[stage][entry] (None: zeros, dequantizing to 0),
    as one QArray [pp, n, ...] of `sharding`."""
    pp, n = len(hosts), len(hosts[0])
    first = next(h for row in hosts for h in row if h is not None)
    ref = first.pieces()  # {part: (array, its placed shape)}
    shardings = quant_shardings(("layers", *path), first, sharding, lead=2)
    shapes = {k: ((pp, n, *shape), part.dtype) for k, (part, shape) in ref.items()}
    del ref

    def entry(s, j):
        h, hosts[s][j] = hosts[s][j], None
        return None if h is None else h.pieces()

    parts = by_stage(shapes, shardings, entry, arena)
    return QArray(parts, first.fmt, first.width, kernel)


def stack_formats(read: Reader, plan: StagePlan, stage_layers: list[int], mix: Mix, path,
                  shape, sharding, kernel, arena: Arena | None = None
                  ) -> dict[str, QArray]:  # fmt: skip
    """A Mix's matrix `path` as {format: the stack of the stages' entries in it}."""
    p = mix.paths.index(path)
    out = {}
    for f, fmt in enumerate(mix.formats[p]):
        rows, _ = mix.stack(p, f)
        hosts = [[None if n is None else
                  read(("layers", plan.layer_of[s][stage_layers[n]], *path), shape, blocks=True)
                  for n in row] for s, row in enumerate(rows)]  # fmt: skip
        got = {h.fmt if isinstance(h, HostQuant) else None for row in hosts for h in row
               if h is not None}  # fmt: skip
        assert got == {GGML_FORMATS[fmt].name}, (path, fmt, got)  # as `stored` says
        out[fmt] = stack_blocks(hosts, path, sharding, kernel, arena)
    return out


def by_stage(shapes: dict, shardings: dict[str, NamedSharding], entry,
             arena: Arena | None = None) -> dict[str, jax.Array]:  # fmt: skip
    """Arrays {key: [pp, n, ...]} (shapes: {key: (shape, dtype)}) of their shardings, whose
    stage s, entry j is entry(s, j)[key] = (host array, its shape there) (entry None: zeros).
    Each device's slice is allocated once (in its huge pages with an `arena`, CPU devices:
    decode reads every weight per token) and filled in place entry by entry, and an entry's
    file pages are released once its stage's devices have it, so the host holds one entry
    beyond the slices (no stage stack on the host, no file pages of the whole matrix). Stages
    without a device of this process are never read."""
    local = {k: [(device, index) for device, index in
                 sharding.addressable_devices_indices_map(shapes[k][0]).items()
                 if index is not None]  # every device holds a slice of a stage stack
             for k, sharding in shardings.items()}  # fmt: skip
    pp, n = next(iter(shapes.values()))[0][:2]
    out: dict[str, list] = {k: [] for k in shapes}
    empty = np.empty if arena is None else arena.empty  # huge pages on CPU devices
    for s in range(pp):
        slices = {k: [(device, index, empty(_sliced(shapes[k][0], index), shapes[k][1]))
                      for device, index in on_devices if _stage(index) == s]
                  for k, on_devices in local.items()}  # fmt: skip
        if not any(slices.values()):
            continue
        for j in range(n):
            got = entry(s, j)
            for k, devices in slices.items():
                for _, index, dst in devices:
                    _fill(dst[0, j], None if got is None else got[k], index[2:])
            if got is not None:  # copied out: the mapped file's pages can go
                release_views([array for array, _ in got.values()])
        for k, devices in slices.items():
            for device, _, dst in devices:  # an arena's slice stays where it is
                out[k].append(jax.device_put(dst, device, may_alias=True))
    return {k: jax.make_array_from_single_device_arrays(shapes[k][0], shardings[k], out[k])
            for k in shapes}  # fmt: skip


def _sliced(shape: tuple[int, ...], index) -> tuple[int, ...]:
    """The shape of a device's slice `index` of an array of `shape`."""
    return tuple(len(range(*i.indices(d))) for d, i in zip(shape, index, strict=True))


def _fill(dst: np.ndarray, got: tuple[np.ndarray, tuple] | None, index) -> None:
    """dst (one entry of a device's slice) = the entry's host array, as the entry's shape,
    sliced by `index`: a whole entry in one strided copy (the array may be a view of the file's
    blocks in another shape), a part of one through a copy in its shape."""
    if got is None:
        dst[...] = 0
        return
    array, shape = got
    if dst.shape == tuple(shape):
        dst.reshape(array.shape)[...] = array  # dst is contiguous: a view
    else:
        dst[...] = np.reshape(array, shape)[tuple(index)]


def _stage(index) -> int:
    """The stage of a device's index into an array [pp, ...]."""
    return index[0].start or 0


def pipeline_runner(
    cfg: ModelConfig, mesh: Mesh, rules: dict, kv_dtypes, plan: StagePlan, runs: tuple[Run, ...],
    mixes: list[Mix | None],
) -> Runner:  # fmt: skip
    pp = plan.stages
    split = ExpertSplit.of(mesh, rules)
    entries = [(run, seg) for run in runs for seg in run.segments]  # one per cache entry
    kinds = [seg.signature[0] for _, seg in entries]
    block_defs = [nnx.graphdef(stage_block(cfg, kind, split)) for kind in kinds]
    caches = [layer_cache(cfg, kind, kv_dtypes) for kind in kinds]
    copies = [run.count * seg.repeat for run, seg in entries]
    manual = frozenset({AXIS})
    valid = plan.valid

    def init_kv(kv: KVConfig):
        """Per segment, its stage layers' caches on every stage: [pp, n, ...] leaves."""
        return [jax.tree.map(lambda a, n=n: jnp.broadcast_to(a, (pp, n, *a.shape)), cache.init(kv))
                for cache, n in zip(caches, copies, strict=True)]  # fmt: skip

    def stage(layers, x, rope_tab, view, kv):
        """One device's stage. layers/kv leaves [1, n, ...]; x [B, T, D]; view rows [B]."""
        s = lax.axis_index(AXIS)
        layers = jax.tree.map(lambda a: a[0], layers)
        kv = jax.tree.map(lambda a: a[0], kv)  # per segment, e.g. (K, V) [n, P, K, H, page]
        B = x.shape[0]
        M = microbatches(B, pp)
        mb = B // M
        xs = x.reshape(M, mb, *x.shape[1:])  # [M, mb, T, D]
        ok = jnp.asarray(valid)[s]  # [depth]

        def rows(tree, m, axis=0):  # microbatch m's rows of a [.., B, ...] tree (M = 1: all)
            if M == 1:
                return tree
            return jax.tree.map(
                lambda a: lax.dynamic_slice_in_dim(a, m * mb, mb, axis) if a.ndim else a, tree
            )

        def run_stage(y, kv, m):
            # Microbatches write disjoint pages and state indices of the shared pools: no slicing of
            # the cache, but for a decode loop's per-row linear states (view.state_index None).
            tab, v = rows(rope_tab, m), rows(view, m)
            kv, at = list(kv), 0
            for r, run in enumerate(runs):
                segs = run.segments

                def unit(i, carry, run=run, segs=segs, r=r, at=at):
                    y, own = carry
                    own = list(own)
                    for j, seg in enumerate(segs):
                        e = at + j  # the segment's cache entry and traced body

                        def layer(k, carry, seg=seg, j=j, e=e):
                            y, cache = carry
                            n = i * seg.repeat + k  # the stage layer's entry in the stacks
                            slot = run.first + i * run.width + seg.offset + k  # its stage layer
                            mix = mixes[e]
                            params = (layer_params(layers[r][j], n) if mix is None
                                      else mixed_params(layers[r][j], n, mix, s))  # fmt: skip
                            body = partial(block, block_defs[e], params, rope_tab=tab,
                                           view=v.replace(layer=n))  # fmt: skip
                            with jax.named_scope(f"run_{r}/segment_{j}"):
                                # a stage without a layer here passes y through, cache untouched
                                return lax.cond(ok[slot], lambda y, c: body(x=y, kv=c),
                                                lambda y, c: (y, c), y, cache)  # fmt: skip

                        per_row = (view.state_index is None and M > 1
                                   and isinstance(caches[e], RecurrentState))  # fmt: skip
                        cache = rows(own[j], m, axis=1) if per_row else own[j]
                        y, cache = repeat(layer, seg.repeat, (y, cache))
                        if per_row:  # the microbatch's rows back into the stage's states
                            cache = jax.tree.map(
                                lambda a, part: lax.dynamic_update_slice_in_dim(a, part, m * mb, 1),
                                own[j],
                                cache,
                            )
                        own[j] = cache
                    return y, tuple(own)

                y, own = repeat(unit, run.count, (y, tuple(kv[at : at + len(segs)])))
                kv[at : at + len(segs)] = own
                at += len(segs)
            return y, kv

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
            x, kv = staged(params["runs"], x, rope_tab, view, kv)
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
        kv_shardings=lambda: [cache_shardings(c, mesh, rules, (AXIS, None)) for c in caches],
        caches=tuple(caches),
        state_axis=2,  # [pp, n, state ids, ...]
        stages=pp,
        description=describe(plan, runs, mixes),
        mtp=draft if mtp else None,
        mtp_caches=mtp,
        mtp_kv_shardings=lambda: [cache_shardings(c, mesh, rules) for c in mtp],
        copies=tuple(pp * n for n in copies),
    )


def mixed_params(tree: dict, n, mix: Mix, s) -> dict:
    """Entry n of a segment's stacks with a Mix, on stage s: its matrices of mix.paths as
    QSwitches over their formats' stacks, each at the entry's index in it."""
    which = jnp.asarray(mix.which)[s, n]  # [paths]
    index = jnp.asarray(mix.index)[s, n]

    def walk(node, at: tuple):
        if at in mix.paths:
            p = mix.paths.index(at)
            options = tuple(layer_params(node[fmt], jnp.where(which[p] == f, index[p], 0))
                            for f, fmt in enumerate(mix.formats[p]))  # fmt: skip
            return QSwitch(options, jnp.maximum(which[p], 0))
        if isinstance(node, dict):
            return {key: walk(value, (*at, key)) for key, value in node.items()}
        return layer_params(node, n)

    return walk(tree, ())


def mtp_module(cfg: ModelConfig, split: ExpertSplit | None = None) -> MTP:
    """The abstract MTP head (shapes only)."""
    return nnx.eval_shape(lambda: MTP(cfg, nnx.Rngs(0), split))


def describe(plan: StagePlan, runs: tuple[Run, ...], mixes: list[Mix | None]) -> str:
    """Which layers each stage holds, which stage layers share a traced body, and the
    matrices held in one stack per format (Mix)."""
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
    text = "; ".join(parts) + "; " + describe_runs(runs, "stage layers")
    formats: dict[str, set[str]] = {}
    for mix in filter(None, mixes):
        for path, types in zip(mix.paths, mix.formats, strict=True):
            formats.setdefault(".".join(map(str, path)), set()).update(types)
    if formats:
        held = ", ".join(f"{name} ({'/'.join(sorted(f))})" for name, f in sorted(formats.items()))
        text += f"; one stack per format: {held}"
    return text
