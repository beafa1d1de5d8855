"""Placement: a model laid out on a mesh, with the runner that executes it there.

The dense path (one device or tensor split) lives here; the layer split lives in pipeline.py.
Weights travel one tensor at a time from the reader into their shardings.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import kernels
from ..config import ModelConfig
from ..errors import LayoutError
from ..formats.gguf_file import release_views
from ..model.kvcache import AttentionKV, HiddenState, KVConfig, KVView
from ..model.moe import ExpertSplit
from ..model.transformer import Transformer, abstract_model, cache_layers, param_dtype, quantizable
from ..ops.quant import FORMATS, HostQuant, QArray
from . import hugepages
from .hugepages import Arena
from .sharding import named, spec

# (parameter path, shape, blocks) -> host array, or with `blocks` a HostQuant when the
# checkpoint holds the parameter quantized
Reader = Callable[..., np.ndarray | HostQuant]


@dataclass(frozen=True)
class Runner:
    """How the model runs on its mesh: the dense model, or pipeline stages (pipeline.py)."""

    forward: Callable  # (params, tokens [B,T], view, kv) -> (hidden [B,T,D], kv)
    head: Callable  # (params, hidden [..., D]) -> float32 logits [..., V]
    init_kv: Callable[[KVConfig], list]  # zeroed pools per layer: (K, V) or a linear state
    kv_shardings: Callable[[], list]  # shardings matching init_kv's tree
    caches: tuple = ()  # the cache type of each entry of init_kv's list
    state_axis: int = 0  # the state axis of a linear layer's cache arrays
    stages: int = 1
    description: str = ""  # which layers live where, for `jaxinfer info`
    # The MTP head, when built: (params, tokens [B,T], hidden [B,T,D], view, kv) -> (g, kv),
    # with its caches (its attention layer's pools, the per-request hidden state), unstaged.
    mtp: Callable | None = None
    mtp_caches: tuple = ()
    mtp_kv_shardings: Callable[[], list] = lambda: []
    # layers each entry of init_kv's list stacks (depth-shared layers); () : `stages` each
    copies: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """A model (`cfg`) laid out on a mesh: the layout, its rules, the runner and the
    parameters."""

    layout: str
    mesh: Mesh
    rules: dict
    runner: Runner
    params: dict
    cfg: ModelConfig


def place_dense(
    read: Reader, cfg: ModelConfig, dtype, name: str, mesh: Mesh, rules, *, kv_dtypes
) -> Placement:
    """Every layer on every device of the mesh, weights placed straight into their shardings;
    K and V pools of `kv_dtypes` (their formats, ops/kvquant.py)."""
    graphdef, state = nnx.split(abstract_model(cfg, expert_split(cfg, mesh, rules)))
    shardings = param_shardings(cfg, mesh, rules)
    kernel = kernel_fits(mesh)
    arena = Arena()
    reading = threading.Lock()  # a checkpoint reads one tensor at a time

    def put(path, leaf):
        key = tuple(k.key for k in path)
        with reading:
            host = read(key, leaf.shape, blocks=quantizable(key))
        if isinstance(host, HostQuant):
            return put_quant(key, host.pieces(), host, shardings[key], kernel, arena=arena)
        host = host.astype(param_dtype(key, dtype), copy=False)  # the reader copied it
        return for_kernel(key, to_device(host, shardings[key], arena), kernel)

    # Weights copy into place on the CPU's threads at once (numpy copies without the GIL): the
    # Llama-3-8B-shape Q4_K_M file of benchmarks/realshape.py (0.66 GB) loaded in 1.3-2.1 s
    # rather than 2.3-2.9 (2 cores)
    leaves, tree = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        placed = list(pool.map(lambda pl: put(*pl), leaves))
    params = jax.tree_util.tree_unflatten(tree, placed)
    runner = dense_runner(graphdef, cfg, kv_dtypes, mesh, rules)
    return Placement(name, mesh, rules, runner, params, cfg)


def param_shardings(cfg: ModelConfig, mesh, rules) -> dict[tuple, NamedSharding]:
    """Each parameter's sharding, from the logical axes it declared where it was created."""
    state = nnx.state(abstract_model(cfg, expert_split(cfg, mesh, rules)))
    return {
        path: named(mesh, spec(var.get_metadata()["axes"], rules))
        for path, var in nnx.to_flat_state(state)
    }


def expert_split(cfg: ModelConfig, mesh, rules) -> ExpertSplit | None:
    """The layout's expert split, for a model with experts (None for a dense one: the split
    changes no parameter, and the abstract model traced once serves both uses)."""
    return ExpertSplit.of(mesh, rules) if cfg.moe else None


def random_reader(cfg: ModelConfig, seed: int) -> Reader:
    """Random weights from a fixed seed, read like a checkpoint: (path, shape) -> array."""
    state = nnx.state(Transformer(cfg, nnx.Rngs(seed)))
    host = {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(state)}
    return lambda path, shape, blocks=False: host[path].reshape(shape)


def to_device(host: np.ndarray, sharding: NamedSharding, arena: Arena | None = None,
              shape: tuple[int, ...] | None = None):  # fmt: skip
    """A host array placed with `sharding` as `shape` (default its own; a view of a file's
    blocks [..., blocks, bytes] becomes [..., X]): on one CPU device copied once into the
    arena's huge pages (hugepages.py), else each device receives only its slice (on several
    hosts, only local devices ask)."""
    shape = host.shape if shape is None else tuple(shape)
    if arena is not None and hugepages.usable(sharding):
        return arena.put(host, sharding, shape)
    host = host.reshape(shape)
    return jax.make_array_from_callback(shape, sharding, lambda i: host[i])


def kernel_fits(mesh: Mesh) -> bool:
    """Whether products and attention may use kernels (kernels/: the CPU's FFI calls, Pallas):
    when the only split axes are the ones the program runs by hand (pipeline stages, expert
    shards), so that the kernels always see whole weights and pools."""
    return all(n == 1 for name, n in mesh.shape.items() if name not in ("pp", "ep"))


def for_kernel(path: tuple, array: jax.Array, kernel: bool, lead: int = 0):
    """A float32 matrix [*lead, O, I] as an "f32" QArray that the CPU kernel multiplies at the
    row counts where it beats XLA's dot (kernels.cpu.CROSSOVERS: XLA CPU's dot at 2-8 rows costs
    2-4x its one-row time); other weights (stacked experts, other dtypes) unchanged."""
    if (
        kernel
        and kernels.takes_f32_weights()
        and quantizable(path)
        and array.dtype == np.float32
        and array.ndim == 2 + lead
    ):
        return QArray({"w": array}, "f32", array.shape[-1], True)
    return array


def put_quant(path: tuple, parts: dict, host: HostQuant, sharding: NamedSharding, kernel: bool,
              lead: int = 0, arena: Arena | None = None) -> QArray:  # fmt: skip
    """A quantized weight's parts (HostQuant.pieces(): host arrays and their shapes
    [*lead, ..., O, X]) placed with the weight's sharding (quant_shardings)."""
    shardings = quant_shardings(path, host, sharding, lead)
    out = {k: to_device(part, shardings[k], arena, shape) for k, (part, shape) in parts.items()}
    if arena is not None and hugepages.usable(sharding):  # copied: the file's pages can go
        release_views([part for part, _ in parts.values()])
    return QArray(out, host.fmt, host.width, kernel)


def quant_shardings(path: tuple, host: HostQuant, sharding: NamedSharding, lead: int = 0
                    ) -> dict[str, NamedSharding]:  # fmt: skip
    """Per part of a quantized weight [*lead, ..., O, I] of `sharding`: each part split like
    the weight's rows and, for the columns, by whole blocks (a split that would cut a block is
    refused); per-row parts keep their one column."""
    fmt = FORMATS[host.fmt]
    mesh, pspec = sharding.mesh, tuple(sharding.spec)
    pspec = pspec + (None,) * (len(host.shape) + lead - len(pspec))
    axis = pspec[-1]
    blocks = host.width // fmt.block
    if axis is not None and blocks % mesh.shape[axis]:
        name = "/".join(str(k) for k in path)
        raise LayoutError(
            f"{name}: its {host.width} columns are {blocks} {fmt.ggml or fmt.name} blocks of "
            f"{fmt.block}, which {axis} = {mesh.shape[axis]} would cut; use a device count "
            f"that divides {blocks}, or the 'layer' layout"
        )
    out = {}
    for k, part in host.parts.items():  # [R, ...]: a part's columns are its entries per row
        whole = math.prod(part.shape[1:]) == 1 and host.width > 1  # a per-row scale
        out[k] = NamedSharding(mesh, P(*pspec[:-1], None if whole else axis))
    return out


def dense_runner(graphdef: nnx.GraphDef, cfg: ModelConfig, kv_dtypes, mesh, rules) -> Runner:
    """All layers on every device of the mesh (single or tensor split)."""
    layers = cache_layers(cfg, kv_dtypes)
    mtp = mtp_caches(cfg, kv_dtypes)
    kernel = kernel_fits(mesh)

    def forward(p, tokens, view: KVView, kv):
        return nnx.merge(graphdef, p)(tokens, view.replace(kernel=kernel), kv)

    def draft(p, tokens, hidden, view: KVView, kv):
        return nnx.merge(graphdef, p).draft(tokens, hidden, view.replace(kernel=kernel), kv)

    return Runner(
        forward=forward,
        head=lambda p, h: nnx.merge(graphdef, p).logits(h),
        init_kv=lambda kv: [layer.init(kv) for layer in layers],
        kv_shardings=lambda: [cache_shardings(layer, mesh, rules) for layer in layers],
        caches=tuple(layers),
        mtp=draft if mtp else None,
        mtp_caches=mtp,
        mtp_kv_shardings=lambda: [cache_shardings(c, mesh, rules) for c in mtp],
    )


def mtp_caches(cfg: ModelConfig, kv_dtypes) -> tuple:
    """The MTP head's caches: its attention layer's KV pools and the per-request hidden state."""
    if not cfg.mtp_layers:
        return ()
    return (AttentionKV(cfg.n_kv_heads, cfg.head_dim, *kv_dtypes), HiddenState(cfg.d_model))


def cache_shardings(layer, mesh, rules, lead: tuple = ()) -> tuple[NamedSharding, ...]:
    """The shardings of one layer's cache arrays (under `lead` leading mesh axes)."""
    return tuple(named(mesh, P(*lead, *spec(axes, rules))) for axes in layer.AXES)
