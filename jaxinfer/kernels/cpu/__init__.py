"""The CPU kernels: XLA FFI custom calls (C++ in src/), one library per instruction-set variant
(build.py), built when the package is installed and chosen when first used: the best variant
the CPU runs, or the one JAXINFER_CPU_KERNELS names (off: none; JAXINFER_KERNELS=xla turns
them off too, backend.py).

Contract: `matmul` / `matmuls` multiply activations by a weight read in its GGUF blocks (every
served block format, at every row count `serves` accepts: a streaming product at few rows, an
8-bit GEMM for prompt chunks; no float copy of a weight anywhere), as a float64 product of
llama.cpp's quantized arithmetic gives them within 1e-5 relative; float32 weights placed for
them ("f32" QArrays) at the row counts of CROSSOVERS; `grouped_matmuls` multiplies each
routed expert's rows once; `attend` is paged attention with the K/V write; `delta_step` /
`delta_chunk` are the Gated DeltaNet recurrence. Each takes a stack of layers and a layer
index where the depth-shared loop needs one (`layer=`) and reads that layer in place.
Measurements: benchmarks/results/qkernel.md, crossovers.md, variants.md, realshape.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ...errors import SetupError
from ...ops.quant import FORMATS, INT8_ACTIVATIONS
from ...ops.vma import agreed
from .. import backend
from . import build

log = logging.getLogger("jaxinfer")

ENV = "JAXINFER_CPU_KERNELS"
CHOICES = (*build.NAMES, "off")

MAX_WEIGHTS = 8  # weights in one call (kMaxWeights in qmatmul.h)
GEMM_ROWS = 9  # 8-bit products of this many rows or more run as a GEMM (kGemmRows, qmatmul.h)


@dataclasses.dataclass(frozen=True)
class Status:
    """The kernels of this process: the variant in use (None: the graph path) and, for each
    better one and for the graph path, why it is not used."""

    variant: str | None
    skipped: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        """One line for `jaxinfer info` and the bench header."""
        why = "; ".join(f"{name}: {reason}" for name, reason in self.skipped)
        used = f"{self.variant} kernels" if self.variant else "none (the graph path)"
        return used + (f" ({why})" if why else "")


_lock = threading.Lock()
_status: Status | None = None
_libs: dict[str, ctypes.CDLL] = {}  # kept referenced: the registered handlers live in them
_failed: dict[str, str] = {}  # variant -> why it did not load (tried once per process)
_active = threading.local()  # using(): a variant for the calls traced in a block


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo's `flags`, or
    `Features` on Arm): only what the OS enables."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def missing(variant: build.Variant, flags: frozenset[str] | None = None) -> str | None:
    """Why this CPU cannot run a variant (None: it can)."""
    if build.machine() not in variant.machines and "" not in variant.machines:
        return f"not for {build.machine() or 'this machine'}"
    lack = [f for f in variant.needs if f not in (cpu_flags() if flags is None else flags)]
    return f"the CPU lacks {', '.join(lack)}" if lack else None


def runnable() -> list[str]:
    """The variants this CPU runs and this installation has (or, in a source checkout,
    builds), best first."""
    return [v.name for v in build.VARIANTS if missing(v) is None and _load(v) is None]


def status() -> Status:
    """The variant chosen for this process (once): JAXINFER_CPU_KERNELS's, else the best one
    the CPU runs. A value not in CHOICES, or a forced variant the CPU cannot run or that is not
    built, raises SetupError; an unforced variant that fails to load is skipped with its
    reason."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _choose()
    return _status


def available() -> bool:
    """Whether a kernel variant is loaded and registered (CPU backend only)."""
    return jax.default_backend() == "cpu" and status().variant is not None


@contextlib.contextmanager
def using(variant: str):
    """The calls traced inside the block use `variant` (one of runnable()): how the tests run
    every variant in one process."""
    if variant not in runnable():
        raise SetupError(f"the {variant} kernels do not run here ({_why(variant)})")
    before = getattr(_active, "variant", None)
    _active.variant = variant
    jax.clear_caches()  # jit's trace caches do not see the variant: trace again inside
    try:
        yield
    finally:
        _active.variant = before
        jax.clear_caches()  # and again after, for the variant in use


def _choose() -> Status:
    if backend.mode() != "auto":  # xla or Pallas everywhere, whatever ENV says
        return Status(None, (("kernels", f"{backend.ENV}={backend.mode()}"),))
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in CHOICES:
        raise SetupError(f"{ENV}={forced!r} is not one of {', '.join(CHOICES)}")
    if forced == "off":
        return Status(None, (("kernels", f"{ENV}=off"),))
    if forced:
        variant = _variant(forced)
        why = missing(variant) or _load(variant)
        if why:
            raise SetupError(f"{ENV}={forced}: {why}; unset it to use the best variant that runs")
        return Status(forced)
    skipped: list[tuple[str, str]] = []
    for variant in build.VARIANTS:
        why = missing(variant) or _load(variant)
        if why is None:
            return Status(variant.name, tuple(skipped))
        if build.machine() in variant.machines:  # other machines' variants go unsaid
            skipped.append((variant.name, why))
    return Status(None, tuple(skipped))


def _variant(name: str) -> build.Variant:
    return next(v for v in build.VARIANTS if v.name == name)


def _why(name: str) -> str:
    variant = _variant(name)
    return missing(variant) or _load(variant) or "it runs"


def _load(variant: build.Variant) -> str | None:
    """Loads a variant's library and registers its handlers (once); returns why it failed,
    None when it is loaded. Built at install; rebuilt here only in a source checkout whose
    sources changed (an editable install)."""
    if variant.name in _libs or variant.name in _failed:
        return _failed.get(variant.name)
    path = build.library(variant)
    try:
        if not path.exists():
            if not (Path(__file__).parents[3] / "pyproject.toml").exists():
                _failed[variant.name] = "not built (no C++ compiler at install?)"
                return _failed[variant.name]
            log.info("building the %s CPU kernels (their sources changed)", variant.name)
            path = build.build(variant, jax.ffi.include_dir())
        lib = ctypes.CDLL(str(path))
        for fmt in FORMATS:  # every format has both
            for kind in ("qmatmul", "qmatmul_grouped"):
                capsule = jax.ffi.pycapsule(getattr(lib, f"{kind}_{fmt}"))
                jax.ffi.register_ffi_target(_target(fmt, variant.name, kind), capsule,
                                            platform="cpu")  # fmt: skip
        for pair in ATTEND_PAIRS:
            capsule = jax.ffi.pycapsule(getattr(lib, _attend_handler(*pair)))
            jax.ffi.register_ffi_target(_attend_target(pair[0], variant.name, pair[1]), capsule,
                                        platform="cpu")  # fmt: skip
        for kind in ("delta_step", "delta_chunk"):
            capsule = jax.ffi.pycapsule(getattr(lib, kind))
            jax.ffi.register_ffi_target(f"jaxinfer_{kind}_{variant.name}", capsule,
                                        platform="cpu")  # fmt: skip
    except (OSError, AttributeError, build.BuildError, RuntimeError) as e:
        _failed[variant.name] = f"failed to load: {str(e).splitlines()[0][:200]}"
        return _failed[variant.name]
    _libs[variant.name] = lib
    return None


def current() -> str | None:
    """The variant the products traced now use (using()'s, else status()'s; None: none)."""
    return getattr(_active, "variant", None) or status().variant


def _in_use() -> str:
    variant = current()
    if variant is None:
        raise RuntimeError("the CPU kernels are not available here; ask available() first")
    return variant


@dataclasses.dataclass(frozen=True)
class Crossovers:
    """Where a variant's products beat XLA's, so go to the kernel: float32 weights ("f32"
    QArrays) at 2 to `float_rows` activation rows, and at one row from `one_row_values`
    weight values (None: never; XLA's one-row dot is a fused matvec whose fixed cost is
    lower); per-row int8 and 16-bit float weights up to `max_rows` rows (past them XLA's dot
    on the in-graph dequantized weight wins). GGUF block weights always go to the kernel
    (BLOCK_FORMATS). Measured per variant by benchmarks/crossovers.py."""

    float_rows: int
    one_row_values: int | None
    max_rows: int


# benchmarks/results/crossovers.md. avx512: an Intel Xeon (Sapphire Rapids class) host, two
# pinned cores (one_row_values from an earlier Xeon VM, where it gave 86M decode 1.04x; the
# host's one-row figures are within noise of XLA's); avx2 and scalar: an AMD EPYC (Zen 1), 2
# cores. neon is not measured on Arm hardware: avx2's, whose register file holds as many
# 16-lane values (vec.h).
CROSSOVERS = {
    "avx512vnni": Crossovers(float_rows=24, one_row_values=1 << 18, max_rows=128),
    "avx512": Crossovers(float_rows=24, one_row_values=1 << 18, max_rows=128),
    "avx2": Crossovers(float_rows=16, one_row_values=None, max_rows=32),
    "neon": Crossovers(float_rows=16, one_row_values=None, max_rows=32),
    # at 32 rows scalar's kernel ties in-graph (q8_0 0.94x, q4_k 1.01x of its time)
    "scalar": Crossovers(float_rows=8, one_row_values=None, max_rows=16),
}
# The most activation rows any variant's kernel serves for the CROSSOVERS formats.
MAX_ROWS = max(c.max_rows for c in CROSSOVERS.values())
# GGUF block formats: the kernel serves every row count (past 8 rows with 8-bit activations as
# a GEMM, src/gemm.h), so that no program holds a float copy of such a weight.
BLOCK_FORMATS = frozenset(INT8_ACTIVATIONS)


def serves(rows: int, fmt: str = "q8_0", values: int = 0, stacked: bool = False) -> bool:
    """Whether a product of `rows` activation rows with a `fmt` weight of `values` values
    goes to the kernel: always for BLOCK_FORMATS, else the variant in use's CROSSOVERS; a
    `stacked` float weight (depth-shared layers: XLA would copy its entry out of the stack
    before its dot) from one row on."""
    if not available():
        return False
    if fmt in BLOCK_FORMATS:
        return True
    c = CROSSOVERS[_in_use()]
    if fmt == "f32":
        large = c.one_row_values is not None and values >= c.one_row_values
        return 2 <= rows <= c.float_rows or (rows == 1 and (stacked or large))
    return rows <= c.max_rows


def matmul(x: jax.Array, fmt: str, parts: dict[str, jax.Array], out_features: int) -> jax.Array:
    """x f32 [M, I] times the quantized weight [O, I] given by its parts -> f32 [M, O]."""
    return matmuls(x, fmt, [parts], [out_features])[0]


def _layer(layer) -> jax.Array:
    """The layer operand of a kernel: a stack's entry (int32 []), 0 for unstacked operands."""
    return jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)


def matmuls(x: jax.Array, fmt: str, weights, out_features, norm=None, int8: bool = False,
            layer=None, glu: bool = False) -> list[jax.Array]:  # fmt: skip
    """x f32 [M, I] times each of up to MAX_WEIGHTS `fmt` weights [O_w, I] (their parts) in one
    call -> [f32 [M, O_w]]: the weights share one split over the threads. With `norm` (weight
    f32 [I], eps > 0), x's rows are first RMS-normalized and scaled (`norm.rms_norm`) in the
    kernel, once per call. `int8`: x's rows quantized to 8 bits as llama.cpp does for `fmt`
    (quant.INT8_ACTIVATIONS) and multiplied as integers (GGUF block formats only). With
    `layer` (int32 []), the parts are stacks [L, O_w, ...] read in place at that layer.
    `glu` (two weights, gate and up, of one width F; int8, GEMM_ROWS rows or more): one
    result, [silu(x gate^T) * (x up^T)] f32 [M, F], without the two products held whole."""
    if glu and not (len(weights) == 2 and int8 and x.shape[0] >= GEMM_ROWS):
        raise ValueError("matmuls: glu takes two weights, int8 and GEMM_ROWS rows or more")
    variant = _in_use()
    extra = () if norm is None else (norm[0].astype(jnp.float32),)
    eps = np.float32(0.0 if norm is None else norm[1])
    outs: list[jax.Array] = []
    for at in range(0, len(weights), MAX_WEIGHTS):
        group, sizes = weights[at : at + MAX_WEIGHTS], out_features[at : at + MAX_WEIGHTS]
        results = sizes[:1] if glu else sizes  # glu: one result of the two weights
        call = jax.ffi.ffi_call(
            _target(fmt, variant),
            [jax.ShapeDtypeStruct((x.shape[0], o), jnp.float32) for o in results],
            vmap_method="sequential",  # the kernel takes one [M, I] x
        )
        parts = (parts[p.name] for parts in group for p in FORMATS[fmt].parts)
        outs += call(x, _layer(layer), *parts, *extra, eps=eps, int8=np.int32(int8),
                     glu=np.int32(glu))  # fmt: skip
    return outs


def grouped_matmuls(x: jax.Array, counts: jax.Array, fmt: str, weights, out_features,
                    int8: bool = False, layer=None) -> list[jax.Array]:  # fmt: skip
    """The expert block's products: x f32 [A, I] (rows sorted by expert, counts int32 [E] rows
    per expert) times each of up to MAX_WEIGHTS stacked `fmt` weights [E, O_w, I] (their parts)
    -> [f32 [A, O_w]]: expert e's rows times its weight, read in place; experts without rows
    are not read; rows from sum(counts) on are 0. `int8` and `layer` as in matmuls."""
    variant = _in_use()
    outs: list[jax.Array] = []
    for at in range(0, len(weights), MAX_WEIGHTS):
        group, sizes = weights[at : at + MAX_WEIGHTS], out_features[at : at + MAX_WEIGHTS]
        call = jax.ffi.ffi_call(
            _target(fmt, variant, "qmatmul_grouped"),
            [jax.ShapeDtypeStruct((x.shape[0], o), jnp.float32) for o in sizes],
            vmap_method="sequential",
        )
        parts = (parts[p.name] for parts in group for p in FORMATS[fmt].parts)
        outs += call(x, counts.astype(jnp.int32), _layer(layer), *parts, int8=np.int32(int8))
    return outs


# The attention kernel's pool kinds by the pools' array dtype (the engine's kv_cache_dtype, or
# its K and V sides apart; int8 pools hold q8_0, ops/kvquant.py): 16-bit pools are widened
# to float32 as they are read, q8_0's scaled by their blocks' scales.
ATTEND_POOLS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int8": "q8_0"}
# The (K, V) pool dtype pairs with a handler: same kinds, and q8_0 on one side with any float
# kind on the other (a float K with another float V runs the graph path).
ATTEND_PAIRS = tuple(
    (k, v) for k in ATTEND_POOLS for v in ATTEND_POOLS if k == v or "int8" in (k, v)
)


def _attend_handler(k_dtype: str, v_dtype: str) -> str:
    """The handler's symbol in the library: attend_<K kind>, then _<V kind> where it differs."""
    k, v = ATTEND_POOLS[k_dtype], ATTEND_POOLS[v_dtype]
    return f"attend_{k}" if k == v else f"attend_{k}_{v}"


def _attend_target(k_dtype: str, variant: str, v_dtype: str | None = None) -> str:
    """The registered target of a variant's handler for (K, V) pool dtypes (V None: as K)."""
    return f"jaxinfer_{_attend_handler(k_dtype, v_dtype or k_dtype)}_{variant}"


def attends(pools) -> bool:
    """Whether the kernel has a handler for these (K, V) pools' dtypes."""
    return tuple(str(p.dtype) for p in pools) in ATTEND_PAIRS


def attend(q, k, v, pools, table, start, length, window: int | None, layer=None):
    """T tokens per row (kernels/cpu/src/attend.cc): writes the real ones (t < length [B]) of k, v
    [B, T, K, H] at positions start [B] + t into the pools [P, K, rows, S] (an ATTEND_PAIRS
    pair of dtypes; in place: they are aliased to the outputs), then attends q [B, T, K, G, H]
    float32 (scaled, rotated): token t over the row's positions [max(0, n - window), n),
    n = min(start + t + 1, start + max(length, 1)), read through table [B, NB] -> (out
    [B, T, K, G, H] float32, pools). With `layer`, the pools are stacks [L, P, K, H, S]
    used in place at that layer."""
    variant = _in_use()
    pool_k, pool_v = pools
    like = jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call(
        _attend_target(str(pool_k.dtype), variant, str(pool_v.dtype)),
        (like(q.shape, jnp.float32), *(like(p.shape, p.dtype) for p in pools)),
        input_output_aliases={3: 1, 4: 2},
        vmap_method="sequential",
    )
    out, pool_k, pool_v = call(q, k, v, pool_k, pool_v, table, start, length, _layer(layer),
                               window=np.int64(window or 0))  # fmt: skip
    return out, (pool_k, pool_v)


def delta_step(q, k, v, g, beta, S, layer=None):
    """The delta rule for one token per row (src/delta.cc): q, k [B, H, DK], v [B, H, DV],
    g, beta [B, H], S [B, H, DK, DV] (float32; with `layer`, a stack [L, B, H, DK, DV]
    updated at that layer) -> o [B, H, DV], S (updated in place)."""
    return _delta("delta_step", q, k, v, g, beta, S, layer)


def delta_chunk(q, k, v, g, beta, S, layer=None):
    """The delta rule over a prompt chunk, token by token (src/delta.cc): q, k
    [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H], S [B, H, DK, DV] (or stacked, as in
    delta_step) -> o [B, T, H, DV], the final S (in place)."""
    return _delta("delta_chunk", q, k, v, g, beta, S, layer)


def _delta(kind: str, q, k, v, g, beta, S, layer):
    like = jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call(
        f"jaxinfer_{kind}_{_in_use()}",
        (like(v.shape, jnp.float32), like(S.shape, jnp.float32)),
        input_output_aliases={5: 1},
        vmap_method="sequential",
    )
    args = [a.astype(jnp.float32) for a in (q, k, v, g, beta, S)] + [_layer(layer)]
    # inside shard_map (a pipeline stage) the state varies over the stage axis, and so do the
    # outputs (ffi_call types them as unvarying): cast to what the operands vary over
    cast, _ = agreed(*call(*args), *args[:6])
    return cast[0], cast[1]


def _target(fmt: str, variant: str, kind: str = "qmatmul") -> str:
    return f"jaxinfer_{kind}_{fmt}_{variant}"
