"""load(): a checkpoint path (or nothing, for the built-in model) -> a ready Engine.

Weights travel one tensor at a time from the file to the device, cast to the compute dtype on
the way, so the host never holds more than one weight beyond the memory-mapped file.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from .checkpoint import open_checkpoint
from .compile import default_cache_dir, use_persistent_cache
from .config import ModelConfig
from .engine import Engine
from .errors import JaxinferError
from .model import Transformer, abstract_model
from .pipeline import pipeline_runner, place_params
from .sharding import (
    cache_spec,
    effective_rules,
    load_layout,
    make_mesh,
    named,
    select_devices,
    spec,
)
from .steps import Placement, dense_runner
from .tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ENGINE_OPTIONS = (
    "prefill_buckets",
    "batch_buckets",
    "decode_chunk",
    "stream_chunk",
    "compile_cache_size",
    "strict",
    "graph_reuse",
    "slots",
)
_DEFAULT = object()

# The built-in default: random weights from a fixed seed over a byte-level vocabulary, so the
# main job runs with no download. It produces noise, never language.
BUILTIN_NAME = "builtin-random (random weights, byte-level tokenizer; not a trained model)"
BUILTIN_SEED = 0


def builtin_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        arch="llama", d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
        d_ff=768, vocab_size=vocab_size, max_position=2048, name=BUILTIN_NAME,
    )  # fmt: skip


def _dtype(name: str):
    if name not in DTYPES:
        raise JaxinferError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _param_shardings(cfg: ModelConfig, mesh, rules) -> dict[tuple, NamedSharding]:
    """Each parameter's sharding, from the logical axes it declared where it was created."""
    state = nnx.state(abstract_model(cfg))
    return {
        path: named(mesh, spec(var.get_metadata()["axes"], rules))
        for path, var in nnx.to_flat_state(state)
    }


def _random_reader(cfg: ModelConfig, seed: int):
    """Random weights from a fixed seed, read like a checkpoint: (path, shape) -> array."""
    state = nnx.state(Transformer(cfg, nnx.Rngs(seed)))
    host = {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(state)}
    return lambda path, shape: host[path].reshape(shape)


def _place(read, cfg: ModelConfig, dtype, layout, devices) -> Placement:
    """The model on a layout's mesh, weights placed straight into their shardings."""
    plan = load_layout(layout)
    mesh = make_mesh(plan, select_devices(devices, plan))
    rules = effective_rules(plan, mesh, cfg)
    if "layers" in rules:
        params = place_params(read, cfg, mesh, rules, dtype)
        return Placement(plan.name, mesh, rules, pipeline_runner(cfg, mesh, rules, dtype), params)
    graphdef, state = nnx.split(abstract_model(cfg))
    shardings = _param_shardings(cfg, mesh, rules)

    def place(path, leaf):
        key = tuple(k.key for k in path)
        host = read(key, leaf.shape).astype(np.dtype(dtype))
        # Each device receives only its slice (on several hosts, only local devices ask).
        return jax.make_array_from_callback(leaf.shape, shardings[key], lambda i: host[i])

    params = jax.tree_util.tree_map_with_path(place, nnx.to_pure_dict(state))
    runner = dense_runner(graphdef, cfg, dtype, named(mesh, cache_spec(rules)))
    return Placement(plan.name, mesh, rules, runner, params)


def load(
    model: str | Path | ModelConfig | None = None,
    *,
    dtype: str = "float32",
    max_seq_len: int | None = None,
    layout: str | Path = "single",
    devices=None,
    compile_cache_dir: str | Path | None = _DEFAULT,  # type: ignore[assignment]
    **options,
) -> Engine:
    """Load a Hugging Face folder or a .gguf file.

    None gives the built-in random model; a ModelConfig gives random weights of that shape
    (for benchmarks) with the byte-level tokenizer when its vocabulary is large enough.
    `compile_cache_dir` sets the persistent compilation cache (default: a per-user cache
    directory or $JAXINFER_COMPILE_CACHE_DIR; None disables). `strict=True` (or
    JAXINFER_STRICT=1) makes any compile after `warmup()` raise RecompileError.
    """
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise JaxinferError(
            f"unknown load option(s) {', '.join(unknown)}; known: {', '.join(ENGINE_OPTIONS)}"
        )
    compute = _dtype(dtype)
    use_persistent_cache(
        default_cache_dir() if compile_cache_dir is _DEFAULT else compile_cache_dir
    )
    options.setdefault("strict", os.environ.get("JAXINFER_STRICT", "") not in ("", "0"))
    t0 = time.perf_counter()
    if model is None or isinstance(model, ModelConfig):
        tokenizer = Tokenizer.byte_level()
        cfg = model or builtin_config(tokenizer.vocab_size)
        if cfg.vocab_size < tokenizer.vocab_size:
            raise JaxinferError(
                f"a random model needs vocab_size >= {tokenizer.vocab_size} (byte tokenizer)"
            )
        read = _random_reader(cfg, BUILTIN_SEED)
        source, name = "random init", cfg.name or BUILTIN_NAME
    else:
        ckpt = open_checkpoint(model)
        cfg, tokenizer, read = ckpt.config, ckpt.tokenizer, ckpt.tensor
        source, name = ckpt.format, str(model)
    place = partial(_place, read, cfg, compute)
    placement = place(layout, devices)
    if max_seq_len is None:
        max_seq_len = cfg.max_position
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise JaxinferError(f"max_seq_len = {max_seq_len!r} is invalid; it must be >= 2")
    jax.block_until_ready(placement.params)
    return Engine(
        cfg,
        tokenizer,
        placement,
        place=place,
        dtype=compute,
        max_seq_len=max_seq_len,
        name=name,
        source=source,
        load_ms=(time.perf_counter() - t0) * 1e3,
        **options,
    )


def generate(model_or_engine=None, prompt="", **kwargs):
    """One call: load the model (a path, or None for the built-in) or reuse an Engine."""
    if isinstance(model_or_engine, Engine):
        return model_or_engine.generate(prompt, **kwargs)
    load_kw = {k: kwargs.pop(k) for k in ("dtype", "max_seq_len", *ENGINE_OPTIONS) if k in kwargs}
    return load(model_or_engine, **load_kw).generate(prompt, **kwargs)
