"""The program registry: each compiled program of one model on one mesh, with its typed
per-call inputs (for warmup and serving alike), output shardings and donated arguments.

The functions are pure functions of arrays: the plain ones in steps.py (`cache`, `prefill`,
`sample`, `decode`, `score`, `pool`), speculative decoding's `verify` in speculative.py. A
speculative engine serves `verify[B]` where a plain one serves `decode[B]`. The host tier of
the prefix cache (host_cache.py) copies pages with `spill` (out of the pools, to the host)
and `restore` (back in), here: generic over the pools' array leaves, each along its page or
state axis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ..model.gdn import RecurrentState
from ..model.kvcache import HiddenState, KVConfig
from ..ops.sampling import PENALTY_WINDOW, SamplingRows
from ..parallel.placement import Runner
from . import steps
from .inputs import Chunk, DecodeState, abstract
from .speculative import SpecConfig, verify


@dataclass(frozen=True)
class Program:
    fn: Callable  # the pure function
    inputs: Callable[[int, int, int], tuple]  # (B, T, NB) -> abstract per-call inputs
    # per output: "kv" (the pools' shardings), "rep" (replicated) or "host" (replicated, in
    # the host's pinned memory where the backend has it)
    outputs: tuple[str, ...]
    donate: tuple[str, ...] = ("kv",)  # argument names donated to the call


def programs(
    runner: Runner,
    kv_config: KVConfig,
    decode_chunk: int,
    vocab: int,
    spec: SpecConfig | None = None,
    draft: Runner | None = None,
    sample_rows: int = 1,
) -> dict[str, Program]:
    """The programs of one model on one mesh; `decode_chunk`, most decode steps a call,
    `vocab` = V, the logits' width (the sampling rows carry token masks over it).
    With a draft model, `params` is (the model's, the draft's) and `kv` lists the model's
    layers then the draft's (one page pool, one set of state indices). `sample_rows`: the
    rows of prefill's logits and of the one `sample` program (the most a prefill call takes)."""
    setup = steps.Setup(runner, kv_config, decode_chunk, vocab, spec, draft, sample_rows)
    leaves = pool_leaves(setup)
    paged = [leaf for leaf in leaves if leaf is not None and not leaf.state]
    stated = [leaf for leaf in leaves if leaf is not None and leaf.state]

    snaps = setup.snapshots  # prefix snapshots: prefill and the loops take snapshot tables

    def loop_inputs(B: int, T: int, NB: int) -> tuple:
        history = spec.history if spec else 0
        state = DecodeState.abstract(B, history)
        fixed = (state, abstract(B, NB), SamplingRows.abstract(B, vocab), abstract())
        return (*fixed, abstract(B, NB)) if snaps else fixed

    def sample_inputs(B: int, T: int, NB: int) -> tuple:
        R = sample_rows
        logits, sampling = abstract(R, vocab, dtype=jnp.float32), SamplingRows.abstract(R, vocab)
        return logits, abstract(R, PENALTY_WINDOW), sampling, abstract(R)

    return {
        "cache": Program(partial(steps.cache, setup), lambda B, T, NB: (), ("kv",), donate=()),
        "prefill": Program(
            partial(steps.prefill, setup),
            lambda B, T, NB: (Chunk.abstract(B, T, NB, snaps, snaps),),
            ("kv", "rep"),
        ),
        "sample": Program(partial(steps.sample_first, setup), sample_inputs, ("kv", "rep", "rep")),
        "decode": Program(partial(steps.decode, setup), loop_inputs, ("kv", "rep", "rep", "rep")),
        "verify": Program(partial(verify, setup), loop_inputs, ("kv",) + ("rep",) * 4),
        "score": Program(
            partial(steps.score, setup),
            lambda B, T, NB: (Chunk.abstract(B, T, NB, snaps), abstract(B, T)),
            ("kv", "rep", "rep"),
        ),
        "pool": Program(
            partial(steps.pool, setup),
            lambda B, T, NB: (Chunk.abstract(B, T, NB, snaps), abstract(steps.PICK)),
            ("kv", "rep", "rep"),
        ),
        "spill": Program(
            partial(spill, leaves),
            lambda B, T, NB: (abstract(B), abstract(B)),
            ("host", "host"),
            donate=(),
        ),
        "restore": Program(
            partial(restore, leaves),
            lambda B, T, NB: (
                abstract(B),
                [abstract(B, *leaf.entry, dtype=leaf.dtype) for leaf in paged],
                abstract(1),
                [abstract(1, *leaf.entry, dtype=leaf.dtype) for leaf in stated],
            ),
            ("kv",),
        ),
    }


@dataclass(frozen=True)
class PoolLeaf:
    """One array leaf of the pools `kv` that the host tier copies: indexed by page (attention
    pools) or by state index (`state`: linear layers' states and the MTP head's hidden state,
    copied at prefix snapshots), along `axis` (after a stack's axis: depth-shared or staged
    layers), with its shape and dtype."""

    state: bool
    axis: int
    shape: tuple[int, ...]
    dtype: Any

    @property
    def entry(self) -> tuple[int, ...]:
        """The shape of one page's (or one state's) slice."""
        return self.shape[: self.axis] + self.shape[self.axis + 1 :]


def pool_leaves(setup: steps.Setup) -> list[PoolLeaf | None]:
    """Per array leaf of `kv`, in its tree order: how the host tier copies it; None for state
    leaves where no prefix snapshots are kept (no hit ever starts from a copied state)."""
    shapes = jax.eval_shape(partial(steps.cache, setup))
    n, stacked = setup.n_model, setup.runner.state_axis
    proposer = setup.draft.state_axis if setup.draft else 0  # the MTP head's are unstaged
    out: list[PoolLeaf | None] = []
    for i, (cache, entry) in enumerate(zip(setup.caches, shapes, strict=True)):
        state = isinstance(cache, RecurrentState | HiddenState)
        axis = stacked if i < n else proposer
        for leaf in jax.tree.leaves(entry):
            keep = not state or setup.snapshots
            out.append(PoolLeaf(state, axis, leaf.shape, leaf.dtype) if keep else None)
    return out


def spill(leaves: list[PoolLeaf | None], params, kv, pages, snaps):
    """Pages [N] of every paged leaf and the states at snaps [N] of every copied state leaf
    -> ([N, ...] per paged leaf, [N, ...] per state leaf), for the host tier. `params` is
    unused: the programs share their leading arguments."""
    paged: list[jax.Array] = []
    states: list[jax.Array] = []
    for a, leaf in zip(jax.tree.leaves(kv), leaves, strict=True):
        if leaf is not None:
            index = snaps if leaf.state else pages
            taken = jnp.moveaxis(jnp.take(a, index, axis=leaf.axis, mode="clip"), leaf.axis, 0)
            (states if leaf.state else paged).append(taken)
    return paged, states


def restore(leaves: list[PoolLeaf | None], params, kv, pages, contents, snap, state):
    """The pools with pages [N] of every paged leaf set to contents ([N, ...] per paged leaf)
    and, at snap [1], every copied state leaf to state ([1, ...] per state leaf); indices past
    an axis's end (the padding) write nothing."""
    flat, tree = jax.tree.flatten(kv)
    rows, states = iter(contents), iter(state)
    out = []
    for a, leaf in zip(flat, leaves, strict=True):
        if leaf is not None:
            index, data = (snap, next(states)) if leaf.state else (pages, next(rows))
            at = (slice(None),) * leaf.axis + (index,)
            a = a.at[at].set(jnp.moveaxis(data, 0, leaf.axis).astype(a.dtype), mode="drop")
        out.append(a)
    return jax.tree.unflatten(tree, out)
