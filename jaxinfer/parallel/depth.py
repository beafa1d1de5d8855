"""Depth-shared layers: a model on one CPU device whose layers of one run (runs.py: a unit of
layer kinds and weight formats, repeated) share one traced body, a loop over the unit's
repetitions. A program's size, and so its compile time, follows the number of distinct units,
not the depth.

Each unit position's weights are stacked [count, ...] (one array per weight and position), and
so are its caches (KV pools [count, P, K, H, page], linear states [count, S, ...]). The loop
body runs layer `i` of the stack: the CPU kernels take the stacks and the index and read (and
write) the layer's entry in place (`QArray.layer`, `KVView.layer`): a slice taken out of a
stack by XLA would be a copy of the layer's weights every step (a scan over stacked layers
decoded 2.1-2.5x slower for that reason: docs/design.md, "Layers"). Float32 weights are held as
"f32" QArrays for the same reason; norms, biases and other small parameters are sliced (copies
of a few KiB).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from ..formats.gguf_file import release_views
from ..model.kvcache import KVConfig, KVView
from ..model.linear import embed
from ..model.transformer import (
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
from ..ops.quant import HostQuant, QArray
from .hugepages import Arena
from .pipeline import Signature, block_axes, matrix_paths, mtp_module, stage_block
from .placement import (
    Placement,
    Reader,
    Runner,
    cache_shardings,
    for_kernel,
    mtp_caches,
    put_quant,
    to_device,
)
from .runs import Run, Segment, describe, layer_params, layer_runs, repeat
from .sharding import named, spec

Stored = Callable[[tuple], str]  # a parameter path -> the type its checkpoint stores it in


def layer_signatures(cfg: ModelConfig, stored: Stored | None) -> list[Signature]:
    """Per layer: its kind and, with `stored` (a checkpoint whose weights may differ in type
    from layer to layer: GGUF; parameter path -> the type the file stores it in), the type of
    each of its matrices."""
    kinds = [cfg.kind(i) for i in range(cfg.n_layers)]
    paths = matrix_paths(cfg, kinds) if stored is not None else {}
    sigs: list[Signature] = []
    for i, kind in enumerate(kinds):
        formats: tuple[tuple[tuple, str], ...] = ()
        if stored is not None:
            formats = tuple((p, stored(("layers", i, *p))) for p in paths[kind])
        sigs.append((kind, formats))
    return sigs


def _format(host) -> str:
    return host.fmt if isinstance(host, HostQuant) else str(host.dtype)


def _flat(module) -> nnx.FlatState:
    return nnx.to_flat_state(nnx.state(module))


def place_depth(
    read: Reader, cfg: ModelConfig, dtype, name: str, mesh: Mesh, rules, *, kv_dtypes,
    stored: Stored | None = None,
) -> Placement:  # fmt: skip
    """The model on one CPU device with depth-shared layers: {embed, norm, [lm_head], [mtp],
    runs: [per run, per unit position, the layer parameters stacked [count, ...]]}."""
    runs = layer_runs(layer_signatures(cfg, stored))
    arena = Arena()
    reading = threading.Lock()  # a checkpoint reads one tensor at a time

    def single(path, shape, axes):  # a parameter outside the layers
        sharding = named(mesh, spec(axes, rules))
        with reading:
            host = read(path, shape, blocks=quantizable(path))
        if isinstance(host, HostQuant):
            return put_quant(path, host.pieces(), host, sharding, True, arena=arena)
        host = host.astype(param_dtype(path, dtype), copy=False)
        return for_kernel(path, to_device(host, sharding, arena), True)

    # a segment's layers, stacked
    def stacked(run: Run[Signature], seg: Segment[Signature], path, shape, axes):
        layers = run.stacked(seg)
        sharding = named(mesh, P(None, *spec(axes, rules)))
        dt, stacks, first = param_dtype(path, dtype), {}, None
        for i, n in enumerate(layers):
            with reading:
                host = read(("layers", n, *path), shape, blocks=quantizable(path))
            first = host if first is None else first
            if (_format(host), getattr(host, "width", None)) != (
                _format(first), getattr(first, "width", None)):  # fmt: skip
                raise RuntimeError(f"layer {n}'s {'.'.join(map(str, path))} is not held "
                                   f"as layer {layers[0]}'s ({_format(first)})")  # fmt: skip
            if isinstance(host, HostQuant):
                parts = host.pieces()
            else:  # a float tensor: the reader's own copy
                parts = {"w": (host.astype(dt, copy=False), host.shape)}
            for k, (a, s) in parts.items():
                if k not in stacks:
                    stacks[k] = _Stack(arena, len(layers), a.dtype, s)
                stacks[k].fill(i, a)
            release_views([a for a, _ in parts.values()])  # copied: the file's pages can go
        if isinstance(first, HostQuant):
            placed = {k: st.place(sharding) for k, st in stacks.items()}
            return QArray(placed, first.fmt, first.width, True)
        return _float_stack(path, stacks["w"].place(sharding))

    outer = [("embed", (cfg.vocab_size, cfg.d_model), ("vocab", "embed")),
             ("norm", (cfg.d_model,), ("embed",))]  # fmt: skip
    if not cfg.tie_embeddings:
        outer.append(("lm_head", (cfg.vocab_size, cfg.d_model), ("vocab", "embed")))
    jobs: dict[tuple, tuple[Callable, tuple]] = {
        ("outer", n): (single, ((n,), shape, axes)) for n, shape, axes in outer
    }
    if cfg.mtp_layers:  # the MTP head runs after the layers, unstacked
        for path, v in _flat(mtp_module(cfg)):
            jobs["mtp", path] = (single, (("mtp", *path), v.get_value().shape,
                                          v.get_metadata()["axes"]))  # fmt: skip
    for r, run in enumerate(runs):
        for j, seg in enumerate(run.segments):
            kind = seg.signature[0]
            axes = block_axes(cfg, kind)
            for path, v in _flat(stage_block(cfg, kind)):
                jobs["runs", r, j, path] = (stacked, (run, seg, path, v.get_value().shape,
                                                      axes[path]))  # fmt: skip
    # the arrays copy into place on the CPU's threads at once (numpy copies without the GIL)
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        done: dict[tuple, Any] = dict(
            zip(jobs, pool.map(lambda job: job[0](*job[1]), jobs.values()), strict=True)
        )
    params: dict = {n: done["outer", n] for n, _, _ in outer}
    if cfg.mtp_layers:
        flat = {path: done[key] for key in done if key[0] == "mtp" for path in [key[1]]}
        params["mtp"] = nnx.to_pure_dict(nnx.from_flat_state(flat))
    params["runs"] = []
    for r, run in enumerate(runs):
        units = []
        for j in range(len(run.segments)):
            tree: dict = {}
            for key, value in done.items():
                if key[0] == "runs" and key[1:3] == (r, j):
                    node = tree
                    for k in key[3][:-1]:
                        node = node.setdefault(k, {})
                    node[key[3][-1]] = value
            units.append(tree)
        params["runs"].append(units)
    runner = depth_runner(cfg, runs, kv_dtypes, mesh, rules)
    return Placement(name, mesh, rules, runner, params, cfg)


class _Stack:
    """A stacked array [count, *shape] filled layer by layer, each entry copied once: in the
    arena's huge pages where it serves the device (hugepages.py), else in host memory."""

    def __init__(self, arena: Arena, count: int, dtype, shape):
        self.shape, self.arena = (count, *shape), arena
        empty = arena.empty if arena.usable() else np.empty
        self.array = empty(self.shape, dtype)

    def fill(self, i: int, host: np.ndarray) -> None:
        self.array[i].reshape(host.shape)[...] = host  # a view of the file: one strided copy

    def place(self, sharding) -> jax.Array:
        return jax.device_put(self.array, sharding, may_alias=True)


def _float_stack(path: tuple, array: jax.Array):
    """A stacked float32 weight the CPU kernel reads in place ("f32" QArray): the layer
    matrices and the experts; smaller parameters stay arrays (sliced where used)."""
    if array.dtype == np.float32 and quantizable(path) and array.ndim >= 3:
        return QArray({"w": array}, "f32", array.shape[-1], True)
    return array


def depth_runner(
    cfg: ModelConfig, runs: tuple[Run[Signature], ...], kv_dtypes, mesh: Mesh, rules
) -> Runner:
    """The runner of depth-shared layers: per run, a loop over its unit's repetitions, and in
    it per segment of the unit its body (a loop of its own where it repeats)."""
    entries = [(run, seg) for run in runs for seg in run.segments]  # one per cache entry
    caches = [layer_cache(cfg, seg.signature[0], kv_dtypes) for _, seg in entries]
    graphdefs = [nnx.graphdef(stage_block(cfg, seg.signature[0])) for _, seg in entries]
    mtp = mtp_caches(cfg, kv_dtypes)

    def init_kv(kv: KVConfig):
        """Per segment, its layers' caches stacked: [count * repeat, ...] leaves."""
        return [
            tuple(jnp.zeros((run.count * seg.repeat, *a.shape), a.dtype) for a in cache.init(kv))
            for (run, seg), cache in zip(entries, caches, strict=True)
        ]

    def forward(params, tokens, view: KVView, kv):
        view = view.replace(kernel=True)
        x = embed(params["embed"], tokens, params["norm"].dtype)  # [B, T, D]
        rope_tab = rope_table(view.positions(tokens.shape[1]), rope_inv_freq(cfg))
        out, at = [], 0
        for r, run in enumerate(runs):
            segs = run.segments
            stacks, own = params["runs"][r], tuple(kv[at : at + len(segs)])
            defs = graphdefs[at : at + len(segs)]

            def unit(i, carry, segs=segs, stacks=stacks, defs=defs, r=r):
                x, own = carry
                own = list(own)
                for j, (seg, graphdef, stack) in enumerate(zip(segs, defs, stacks, strict=True)):

                    def layer(k, carry, seg=seg, graphdef=graphdef, stack=stack, j=j):
                        x, cache = carry
                        n = i * seg.repeat + k  # the layer's entry in the segment's stacks
                        with jax.named_scope(f"run_{r}/segment_{j}"):
                            return block(graphdef, layer_params(stack, n), x, rope_tab, cache,
                                         view.replace(layer=n))  # fmt: skip

                    x, own[j] = repeat(layer, seg.repeat, (x, own[j]))
                return x, tuple(own)

            x, own = repeat(unit, run.count, (x, own))
            out += own
            at += len(segs)
        return rms_norm(x, params["norm"], cfg.norm_eps), out

    def head(params, h):
        return head_logits(h, params["embed"] if cfg.tie_embeddings else params["lm_head"])

    mtp_def = nnx.graphdef(mtp_module(cfg)) if cfg.mtp_layers else None

    def draft(params, tokens, hidden, view, kv):
        assert mtp_def is not None  # drafts only with an MTP head
        head_ = nnx.merge(mtp_def, params["mtp"])
        return mtp_forward(head_, params["embed"], cfg, tokens, hidden, view.replace(kernel=True),
                           kv)  # fmt: skip

    return Runner(
        forward=forward,
        head=head,
        init_kv=init_kv,
        kv_shardings=lambda: [cache_shardings(c, mesh, rules, (None,)) for c in caches],
        caches=tuple(caches),
        state_axis=1,  # [count, state ids, ...]
        description=describe(runs),
        mtp=draft if mtp else None,
        mtp_caches=mtp,
        mtp_kv_shardings=lambda: [cache_shardings(c, mesh, rules) for c in mtp],
        copies=tuple(run.count * seg.repeat for run, seg in entries),
    )
