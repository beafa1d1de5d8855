"""load(): a checkpoint path (or nothing, for the built-in stories260K) -> a ready Engine.

Weights travel one tensor at a time from the file to the device, cast to the compute dtype on
the way, so the host never holds more than one weight beyond the memory-mapped file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import kernels
from .config import ModelConfig
from .engine import Engine, carries_state, device_bytes
from .errors import JaxinferError, UnsupportedModelError
from .formats import open_checkpoint
from .formats.tokenizer import Tokenizer
from .ops.kvquant import PoolDtype, pool_dtype
from .ops.quant import HostQuant, quantize_int8, with_activations
from .options import EngineOptions
from .parallel.depth import place_depth
from .parallel.pipeline import place_pipeline
from .parallel.placement import Placement, Reader, place_dense, random_reader
from .parallel.sharding import effective_rules, load_layout, make_mesh, select_devices
from .runtime import fit
from .runtime.compile import use_persistent_cache
from .runtime.executor import cache_bytes
from .runtime.speculative import SpecConfig
from .runtime.store import ExecutableStore, fingerprint

# The built-in default model ships in the package: Karpathy's stories260K (MIT; models/LICENSE),
# a 1.2 MB GGUF trained on TinyStories, so the main job writes a little story with no download.
log = logging.getLogger(__name__)

BUILTIN_MODEL = Path(__file__).parent / "data" / "stories260K.gguf"
# The built-in random model, by name (benchmarks): random weights from a fixed seed over a
# byte-level vocabulary. It produces noise, never language.
BUILTIN_RANDOM = "builtin-random"
BUILTIN_NAME = "builtin-random (random weights, byte-level tokenizer; not a trained model)"
BUILTIN_SEED = 0


def builtin_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        arch="llama", d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
        d_ff=768, vocab_size=vocab_size, max_position=2048, name=BUILTIN_NAME,
    )  # fmt: skip


def kv_dtype(options: EngineOptions, narrow_weights: bool) -> tuple[PoolDtype, PoolDtype]:
    """The K and V pools' formats (kvquant.py: a float dtype or "q8_0"; llama.cpp's -ctk and
    -ctv; "auto": EngineOptions.kv_dtypes): a 16-bit cache under float32 compute halves the KV
    memory and the bytes attention reads (llama.cpp's default is float16), q8_0 about quarters
    it."""
    k, v = options.kv_dtypes(narrow_weights)
    return pool_dtype(k), pool_dtype(v)


def narrow(ckpt) -> bool:
    """Whether a checkpoint stores its layers' matrices in fewer than 32 bits: GGUF blocks or
    16-bit floats (GGUF types; None for other formats, whose float weights take the compute
    dtype)."""
    if ckpt.types is None:
        return False
    wide = {"F32", "F64", "missing"}
    return any(ckpt.types(n) not in wide for n in ckpt.names if n.startswith("blk."))


def quantizing(read: Reader, how: str, compute) -> Reader:
    """The reader under a `quantize` choice (QUANTIZE) and the compute dtype: 16-bit float
    tensors stay 16-bit (as QArrays) only under float32 compute; else they are plain weights
    of the compute dtype."""
    if how == "none":
        return lambda path, shape, blocks=False: read(path, shape)
    wide = np.dtype(compute).itemsize > 2

    def reader(path, shape, blocks=False):
        w = read(path, shape, blocks=blocks)
        if isinstance(w, HostQuant) and w.fmt in ("f16", "bf16") and not wide:
            return read(path, shape)
        if how == "int8" and blocks and not isinstance(w, HostQuant):
            return quantize_int8(w)
        return w

    return reader


def place(read: Reader, cfg: ModelConfig, dtype, kv_dtypes, activations: str, shared: bool,
          stored, layout, devices) -> Placement:  # fmt: skip
    """The model on a layout's mesh: pipeline stages when the layout splits the layers; with
    `shared`, with the CPU kernels at float32, depth-shared layers (on one device, or the
    stage layers of pipeline stages without a tensor split; `stored`:
    a parameter's type in the file, for a checkpoint whose layers may differ in types, GGUF's
    Q4_K_M; else None); the GGUF block weights
    multiply `activations` ("int8": quantized to 8 bits, or "float")."""
    plan = load_layout(layout)
    mesh = make_mesh(plan, select_devices(devices, plan))
    rules = effective_rules(plan, mesh, cfg)
    # depth-shared layers where the CPU kernels read a stack's entry in place, at float32
    stacks = shared and kernels.reads_stacked_layers() and np.dtype(dtype) == np.float32
    how: Callable[..., Placement]
    if "layers" in rules:
        how = partial(place_pipeline, stored=stored, shared=stacks)
    elif stacks and mesh.devices.size == 1:
        how = partial(place_depth, stored=stored)
    else:
        how = place_dense
    placement = how(read, cfg, dtype, plan.name, mesh, rules, kv_dtypes=kv_dtypes)
    return dataclasses.replace(placement, params=with_activations(placement.params, activations))


def load(
    model: str | Path | ModelConfig | None = None,
    *,
    options: EngineOptions | None = None,
    **short,
) -> Engine:
    """Load a Hugging Face folder or a .gguf file into a ready Engine.

    None gives the built-in model (stories260K, shipped in the package); "builtin-random" the
    built-in random model; a ModelConfig random weights of that shape (for benchmarks) with the
    byte-level tokenizer when its vocabulary is large enough. Options come as
    `options=EngineOptions(...)` or as its fields by keyword (`slots=4`, `layout="layer"`),
    not both; see EngineOptions for each one.
    """
    o = EngineOptions.make(options, **short)
    if o.fit:  # an accelerator allocates what the plan asks, not a fixed share up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    kernels.mode()  # a bad JAXINFER_KERNELS fails here, before the model loads
    if jax.default_backend() == "cpu":
        kernels.status()  # and a bad JAXINFER_CPU_KERNELS
    compute = jnp.dtype(o.dtype)
    store = executable_store(o)
    # jax's persistent cache serves what the store does not hold only without a store: the
    # store saves executables compiled afresh (compile.py, CompileCache._build)
    use_persistent_cache(None if store else o.compile_cache_dir)
    t0 = time.perf_counter()
    # fit plans in the memory there is before the weights arrive
    memory = fit.free_memory(jax.local_devices()[0]) if o.fit else (0, "")
    if o.fit_memory_mib is not None:
        memory = (o.fit_memory_mib * fit.MIB, "--fit-memory")
    base = fit.resident_bytes()
    if model is None:
        model = BUILTIN_MODEL
    if store is not None:  # the executables read while the weights are placed
        store.prefetch(session(model, o, store.fingerprint))
    if model == BUILTIN_RANDOM or isinstance(model, ModelConfig):
        tokenizer = Tokenizer.byte_level()
        cfg = model if isinstance(model, ModelConfig) else builtin_config(tokenizer.vocab_size)
        if cfg.vocab_size < tokenizer.vocab_size:
            raise JaxinferError(
                f"a random model needs vocab_size >= {tokenizer.vocab_size} (byte tokenizer)"
            )
        read, release, stored = random_reader(cfg, BUILTIN_SEED), None, None
        source, name, narrow_weights = "random init", cfg.name or BUILTIN_NAME, False
    else:
        ckpt = open_checkpoint(model)
        cfg, tokenizer, read, release = ckpt.config, ckpt.tokenizer, ckpt.tensor, ckpt.release
        stored = ckpt.stored_type if ckpt.types else None
        source = ckpt.format
        name = "stories260K (built in)" if model == BUILTIN_MODEL else str(model)
        narrow_weights = o.quantize != "none" and narrow(ckpt)
    read = quantizing(read, o.quantize, compute)
    dtypes = (compute, kv_dtype(o, narrow_weights), o.activations, o.shared_layers)
    spec, place_draft = _speculative(o.speculative, o.draft_tokens, cfg, tokenizer, dtypes, name)
    if cfg.mtp_layers and (spec is None or spec.method != "mtp"):
        cfg = dataclasses.replace(cfg, mtp_layers=0)  # the MTP head is built only to draft

    def placer(layout, devices) -> Placement:
        placement = place(read, cfg, *dtypes, stored, layout, devices)
        if release:  # the weights are in place: the file's pages go (RSS near the file)
            jax.block_until_ready(placement.params)
            release()
        return placement

    placement = placer(o.layout, o.devices)
    draft = place_draft(o.layout, o.devices) if place_draft else None
    jax.block_until_ready((placement.params, draft.params if draft else None))

    def engine(options: EngineOptions) -> Engine:
        return Engine(
            cfg, tokenizer, placement, options, place=placer, name=name, source=source,
            load_ms=(time.perf_counter() - t0) * 1e3, spec=spec, draft=draft,
            place_draft=place_draft, store=store,
        )  # fmt: skip

    return fitted(engine, o, cfg, placement, draft, memory, base) if o.fit else engine(o)


def fitted(
    engine: Callable[[EngineOptions], Engine], o: EngineOptions, cfg: ModelConfig,
    placement: Placement, draft: Placement | None, memory: tuple[int, str], base: int,
) -> Engine:  # fmt: skip
    """The engine of the largest plan that fits `memory` (bytes, and where the figure comes
    from; fit.plan). The first plan leaves the programs' temporaries out; its whole compile plan
    is compiled (warmup finds it done) and their temporaries read (XLA's memory_analysis()):
    when the first plan does not fit with them, the plan is made again with them (its programs
    compile at warmup). Both depend on shapes only, so the next start with the same memory
    plans the same and finds its programs in the executable store. On CPU the plan also
    reports the runtime's bytes: what the process grew by since `base` (its resident bytes
    before the weights), besides the weights."""
    page_bytes, state_bytes = cache_bytes(placement, draft, o.page_size)
    weights = device_bytes(placement.params) + (device_bytes(draft.params) if draft else 0)
    # a group plans once: the least memory, the most any process holds (fit.agreed)
    free, weights, page_bytes, state_bytes = fit.agreed(
        [memory[0], weights, page_bytes, state_bytes], [False, True, True, True]
    )
    if jax.process_count() > 1:
        memory = (free, f"{memory[1]}, the least of {jax.process_count()} processes")
    rows = o.slots or max(o.batch_buckets)
    need = fit.Need(
        weights, 0, page_bytes, state_bytes, rows, cfg.max_position,
        carries_state(placement, draft),
    )  # fmt: skip
    plan = fit.plan(o, need, *memory)
    made = engine(plan.options(o))
    (temporaries,) = fit.agreed([made.temporaries()], [True])
    measured = dataclasses.replace(plan, temporaries=temporaries)
    if measured.planned > plan.memory - plan.target:  # plan again with the temporaries
        plan = fit.plan(o, dataclasses.replace(need, temporaries=temporaries), *memory)
        made = engine(plan.options(o))
    else:
        plan = measured
    plan = dataclasses.replace(plan, base=base)
    if jax.local_devices()[0].platform == "cpu":  # the devices' memory is the process's
        plan = plan.measured(pools=False)  # measured again after warmup (Engine.warmup)
    made.fit_plan = plan
    log.info(plan.summary())
    return made


def executable_store(o: EngineOptions) -> ExecutableStore | None:
    """The executable store of these options: in the compile cache dir, unless there is none or
    its size is 0. Processes of one engine (`jax.distributed`) may share the folder: each keeps
    its own programs, under keys and a manifest that name the process (fingerprint())."""
    if o.compile_cache_dir is None or not o.executable_store_mib:
        return None
    variant = kernels.cpu.current() if jax.default_backend() == "cpu" else None
    flags = kernels.cpu.cpu_flags()
    return ExecutableStore.inside(
        o.compile_cache_dir, o.executable_store_mib << 20, fingerprint(variant, flags)
    )


def session(model, o: EngineOptions, fingerprint: str) -> str:
    """A digest of one model (its files' names, sizes and times) under one set of options."""
    ident = repr(model)
    path = Path(model) if isinstance(model, str | Path) else None
    if path is not None and path.exists():
        files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
        ident += "".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files)
    # the store's own options, and fit's memory (a fit's shapes are in its programs' keys)
    options = o.replace(compile_cache_dir=None, executable_store_mib=0, fit_memory_mib=None)
    return hashlib.sha256(f"{ident}\n{options!r}\n{fingerprint}".encode()).hexdigest()[:32]


def _speculative(
    how, k, cfg: ModelConfig, tokenizer: Tokenizer, dtypes: tuple[Any, Any, str, bool], model: str
):
    """The speculative config and, for a draft model, its placer (layout, devices) ->
    Placement (`dtypes`: the compute and KV dtypes, the activations' type, shared layers); a
    bad choice raises here, before anything is placed."""
    if how is None:
        return None, None
    if how == "ngram":
        return SpecConfig("ngram", k), None
    if how == "mtp":
        if not cfg.mtp_layers:
            raise UnsupportedModelError(
                f"speculative='mtp' needs multi-token-prediction weights (HF mtp.*, GGUF "
                f"blk.N.nextn.*), which {model} does not have; use speculative='ngram' or a "
                "draft model"
            )
        return SpecConfig("mtp", k), None
    spec = SpecConfig("draft", k)
    draft_stored = None  # a GGUF's layers may hold weights of different types
    if isinstance(how, ModelConfig):
        draft_cfg, draft_read = how, random_reader(how, BUILTIN_SEED + 1)
        draft_tok = tokenizer
    elif isinstance(how, str | Path):
        ckpt = open_checkpoint(how)
        draft_cfg, draft_tok, draft_read = ckpt.config, ckpt.tokenizer, ckpt.tensor
        draft_stored = ckpt.stored_type if ckpt.types else None
    else:
        raise JaxinferError(
            f"speculative = {how!r} is invalid; use 'ngram', 'mtp' or a draft model's path"
        )
    # The tokenizers must agree; embedding tables may be padded differently (Qwen2.5 0.5B and
    # 7B share a tokenizer but not a table size): drafts stay below the model's vocab_size.
    probe = "Once upon a time, 12 friends met at the café."
    same = draft_tok.vocab_size == tokenizer.vocab_size
    if not same or draft_tok.encode(probe) != tokenizer.encode(probe):
        raise JaxinferError(
            f"the draft model's vocabulary ({draft_tok.vocab_size} tokens) is not the model's "
            f"({tokenizer.vocab_size}); a draft must share the model's tokenizer"
        )
    return dataclasses.replace(spec, vocab=cfg.vocab_size), partial(
        place, draft_read, draft_cfg, *dtypes, draft_stored
    )


def generate(model_or_engine=None, prompt="", **kwargs):
    """One call: load the model (a path, or None for the built-in one) or reuse an Engine,
    then generate. Keywords named like EngineOptions' fields (or `options=`) go to `load`,
    the rest to `Engine.generate`."""
    if isinstance(model_or_engine, Engine):
        return model_or_engine.generate(prompt, **kwargs)
    names = {f.name for f in dataclasses.fields(EngineOptions)} | {"options"}
    load_kw = {k: kwargs.pop(k) for k in names & set(kwargs)}
    return load(model_or_engine, **load_kw).generate(prompt, **kwargs)
