"""The compiled programs: pure functions of arrays, nothing closed over but static structure.

  prefill(params, cache, tokens, start, lengths, window, sp) -> cache, first sampled tokens
  decode(params, cache, carry, sp, n_steps)                 -> cache, carry, tokens [B, C]
  score(params, cache, tokens, start)                       -> cache, logits [B, T, V]

The cache is donated by the caller. `decode` runs up to C steps inside one `while_loop`
and leaves early when every row is done, so the host only wakes to stream and check stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from .model import init_cache
from .sampling import PENALTY_WINDOW, sample


@dataclass(frozen=True)
class Runner:
    """How the model runs on its mesh: the dense model, or pipeline stages (pipeline.py)."""

    forward: Callable  # (params, tokens [B,T], positions [B,T], cache) -> (hidden [B,T,D], cache)
    head: Callable  # (params, hidden [..., D]) -> float32 logits [..., V]
    init_cache: Callable  # (batch, length) -> zeroed cache pytree
    cache_shardings: Callable  # () -> shardings pytree matching the cache
    stages: int = 1
    plan: str = ""  # which layers live where, for `jaxinfer info`
    batch_axis: int = 0  # the rows axis of each cache array ([B, K, S, H]; pipeline: 1)


@dataclass(frozen=True)
class Placement:
    """A model laid out on a mesh: the layout, its rules, the runner and the parameters."""

    layout: str
    mesh: Mesh
    rules: dict
    runner: Runner
    params: dict


def dense_runner(graphdef: nnx.GraphDef, cfg, dtype, cache_sharding) -> Runner:
    """All layers on every device of the mesh (single or tensor split)."""
    return Runner(
        forward=lambda p, tokens, positions, cache: nnx.merge(graphdef, p)(
            tokens, positions, cache
        ),
        head=lambda p, h: nnx.merge(graphdef, p).logits(h),
        init_cache=lambda batch, length: init_cache(cfg, batch, length, dtype),
        cache_shardings=lambda: [(cache_sharding, cache_sharding)] * cfg.n_layers,
    )


def make_steps(runner: Runner, chunk: int) -> dict[str, Callable]:
    """The pure step functions of one model on one mesh; `chunk` = max tokens per decode call."""

    class model:  # the runner seen as a model bound to its parameters
        def __init__(self, params):
            self.params = params

        def __call__(self, tokens, positions, cache):
            return runner.forward(self.params, tokens, positions, cache)

        def logits(self, h):
            return runner.head(self.params, h)

    def prefill(params, cache, tokens, start, lengths, window, sp):
        """tokens [B, T] at positions start[b] + t; only the first lengths[b] are real."""
        m = model(params)
        B, T = tokens.shape
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
        h, cache = m(tokens, positions, cache)  # [B, T, D]
        last = jnp.clip(lengths - 1, 0, T - 1)  # [B]
        logits = m.logits(h[jnp.arange(B), last])  # [B, V]
        return cache, sample(logits, window, sp, start + lengths)

    def decode(params, cache, carry, sp, n_steps):
        """carry: tokens [B] (next input), pos [B] (its position), budget [B] (tokens still
        allowed), done [B], window [B, W] (recent tokens by position mod W)."""
        m = model(params)
        B = carry["tokens"].shape[0]
        rows = jnp.arange(B)

        def step(state):
            i, cache, c, out = state
            window = c["window"].at[rows, c["pos"] % PENALTY_WINDOW].set(c["tokens"])
            h, cache = m(c["tokens"][:, None], c["pos"][:, None], cache)  # [B, 1, D]
            new = sample(m.logits(h[:, 0]), window, sp, c["pos"] + 1)  # [B]
            live = ~c["done"]
            stop = jnp.any(new[:, None] == sp["stops"], axis=-1)
            budget = c["budget"] - live
            out = out.at[:, i].set(jnp.where(live, new, -1))
            c = {
                "tokens": jnp.where(live, new, c["tokens"]),
                "pos": c["pos"] + live,
                "budget": budget,
                "done": c["done"] | stop | (budget <= 0),
                "window": window,
            }
            return i + 1, cache, c, out

        def more(state):
            i, _, c, _ = state
            return (i < n_steps) & ~jnp.all(c["done"])

        out = jnp.full((B, chunk), -1, jnp.int32)
        _, cache, carry, out = jax.lax.while_loop(more, step, (jnp.int32(0), cache, carry, out))
        return cache, carry, out

    def score(params, cache, tokens, start):
        m = model(params)
        T = tokens.shape[1]
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
        h, cache = m(tokens, positions, cache)
        return cache, m.logits(h)  # [B, T, V]

    def prefill_slot(params, cache, slot, tokens, start, lengths, window, sp):
        """Prefill one slot's rows of a shared cache (continuous batching): the other slots'
        rows are untouched. slot [] int32; tokens [1, T]."""
        axis = runner.batch_axis
        rows = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis), cache)
        rows, token = prefill(params, rows, tokens, start, lengths, window, sp)
        cache = jax.tree.map(
            lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis), cache, rows
        )
        return cache, token

    def grow(cache, size):
        """The cache with more positions (zeros appended); `size` [S_new] carries the shape."""
        pad = size.shape[0] - jax.tree_util.tree_leaves(cache)[0].shape[-2]
        widths = [(0, 0)] * jax.tree_util.tree_leaves(cache)[0].ndim
        widths[-2] = (0, pad)
        return jax.tree.map(lambda a: jnp.pad(a, widths), cache)

    def cache(size):
        """A zeroed cache; `size` [B, S] only carries the shape (and so the key)."""
        return runner.init_cache(*size.shape)

    return {
        "prefill": prefill,
        "decode": decode,
        "score": score,
        "cache": cache,
        "prefill_slot": prefill_slot,
        "grow": grow,
    }
