"""The CPU kernels: XLA FFI custom calls (C++ in src/) built with g++ on first use and cached.
`qmatmul` reads a `QArray`'s blocks once and dequantizes in registers; `model.linear` sends it
products of up to MAX_ROWS activation rows; the rest, and any backend without the kernel,
dequantize inside the graph. Float32 weights placed for it ("f32" QArrays) go to it at
FLOAT_ROWS: small batches, where XLA CPU's dot leaves its fast one-row path. `attend` is paged
attention with the K/V write.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from ..ops.quant import FORMATS

log = logging.getLogger("jaxinfer")

KERNELS = Path(__file__).with_name("src")
SOURCE = KERNELS / "qmatmul.cc"  # compiled in parts (its handlers spread over the units)
SOURCES = (SOURCE, KERNELS / "attend.cc")  # the library: these, sharing KERNELS' headers
COMPILER = "g++"
# -ffp-contract=off: gcc must not fuse a weight's `scale * q - low` into one rounding (the
# kernel's weights are bit-exact dequantize values); the accumulation's FMAs are explicit.
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off")

# Largest activation row count the kernel serves: the crossover with XLA's dot on an in-graph
# dequantized weight, which wins only from about 512 rows (benchmarks/results/qkernel.md).
MAX_ROWS = 256
MAX_WEIGHTS = 8  # weights in one call (kMaxWeights in qmatmul.cc)

_lock = threading.Lock()
_ready: bool | None = None
_lib: ctypes.CDLL | None = None  # kept referenced: the registered handlers live in it


def available() -> bool:
    """Whether the kernel is built, loaded and registered (once per process; CPU backend
    only; JAXINFER_QKERNEL=0 turns it off). Never raises: a failed build logs a warning."""
    global _ready
    if _ready is None:
        with _lock:
            if _ready is None:
                _ready = _load()
    return _ready


# Float32 weights ("f32" QArrays) go to the kernel for 2 to FLOAT_ROWS rows, where it beats
# XLA's own dot. One row goes to it only for weights of at least ONE_ROW_VALUES: XLA's one-row
# dot is a fused matvec, as fast on large weights and faster on small ones, where a custom
# call's fixed cost shows (figures: benchmarks/results/qkernel.md, "Moved from the code").
FLOAT_ROWS = 32
ONE_ROW_VALUES = 1 << 18


def serves(rows: int, fmt: str = "q8_0", values: int = 0) -> bool:
    """Whether a product of `rows` activation rows with a `fmt` weight of `values` values
    goes to the kernel."""
    if fmt == "f32":
        ok = 2 <= rows <= FLOAT_ROWS or (rows == 1 and values >= ONE_ROW_VALUES)
    else:
        ok = rows <= MAX_ROWS
    return ok and available()


def matmul(x: jax.Array, fmt: str, parts: dict[str, jax.Array], out_features: int) -> jax.Array:
    """x f32 [M, I] times the quantized weight [O, I] given by its parts -> f32 [M, O]."""
    return matmuls(x, fmt, [parts], [out_features])[0]


def matmuls(x: jax.Array, fmt: str, weights, out_features, norm=None) -> list[jax.Array]:
    """x f32 [M, I] times each of up to MAX_WEIGHTS `fmt` weights [O_w, I] (their parts) in one
    call -> [f32 [M, O_w]]: the weights share one split over the threads. With `norm` (weight
    f32 [I], eps > 0), x's rows are first RMS-normalized and scaled (`norm.rms_norm`) in the
    kernel, once per call."""
    if not available():
        raise RuntimeError("the quantized CPU kernel is not available here; ask serves() first")
    extra = () if norm is None else (norm[0].astype(jnp.float32),)
    eps = np.float32(0.0 if norm is None else norm[1])
    outs = []
    for at in range(0, len(weights), MAX_WEIGHTS):
        group, sizes = weights[at : at + MAX_WEIGHTS], out_features[at : at + MAX_WEIGHTS]
        call = jax.ffi.ffi_call(
            _target(fmt),
            [jax.ShapeDtypeStruct((x.shape[0], o), jnp.float32) for o in sizes],
            vmap_method="sequential",  # the kernel takes one [M, I] x
        )
        parts = (parts[p.name] for parts in group for p in FORMATS[fmt].parts)
        outs += call(x, *parts, *extra, eps=eps)
    return outs


# The attention kernel's handler (attend_<suffix> in the library, registered as
# jaxinfer_attend_<suffix>) by the pools' dtype, the engine's kv_cache_dtype: 16-bit pools
# are widened to float32 as they are read.
ATTEND_POOLS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _attend_target(dtype: str) -> str:
    return f"jaxinfer_attend_{ATTEND_POOLS[dtype]}"


ATTEND = _attend_target("float32")


def attend(q, k, v, pools, table, start, length, window: int | None):
    """T tokens per row (kernels/src/attend.cc): writes the real ones (t < length [B]) of k, v
    [B, T, K, H] at positions start [B] + t into the pools [P, K, H, S] (ATTEND_POOLS'
    dtypes; in place: they are aliased to the outputs), then attends q [B, T, K, G, H]
    float32 (scaled, rotated): token t over the row's positions [max(0, n - window), n),
    n = min(start + t + 1, start + max(length, 1)), read through table [B, NB] -> (out
    [B, T, K, G, H] float32, pools)."""
    if not available():
        raise RuntimeError("the CPU kernels are not available here; ask available() first")
    pool_k, pool_v = pools
    like = jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call(
        _attend_target(str(pool_k.dtype)),
        (like(q.shape, jnp.float32), *(like(p.shape, p.dtype) for p in pools)),
        input_output_aliases={3: 1, 4: 2},
        vmap_method="sequential",
    )
    out, pool_k, pool_v = call(q, k, v, pool_k, pool_v, table, start, length,
                               window=np.int64(window or 0))  # fmt: skip
    return out, (pool_k, pool_v)


def _target(fmt: str) -> str:
    return f"jaxinfer_qmatmul_{fmt}"


def _load() -> bool:
    global _lib
    if os.environ.get("JAXINFER_QKERNEL", "1") == "0":
        return False
    try:
        if jax.default_backend() != "cpu":
            return False
        lib = ctypes.CDLL(str(_build()))
        for fmt in FORMATS:
            capsule = jax.ffi.pycapsule(getattr(lib, f"qmatmul_{fmt}"))  # every format has one
            jax.ffi.register_ffi_target(_target(fmt), capsule, platform="cpu")
        for dtype, suffix in ATTEND_POOLS.items():
            capsule = jax.ffi.pycapsule(getattr(lib, f"attend_{suffix}"))
            jax.ffi.register_ffi_target(_attend_target(dtype), capsule, platform="cpu")
    except Exception as e:  # any failure means the in-graph path, which is always correct
        log.warning("quantized CPU kernel unavailable, dequantizing in the graph: %s", e)
        return False
    _lib = lib
    return True


class BuildError(Exception):
    pass


def _build() -> Path:
    """The compiled kernel for this source, compiler flags, jaxlib and CPU, built once into
    the cache directory: its handlers in up to 4 units compiled in parallel, then linked under
    a temporary name and renamed, so that concurrent processes never load a half-written
    file."""
    texts = [f.read_text() for f in sorted(KERNELS.iterdir()) if f.suffix in (".cc", ".h")]
    key = "\0".join((*texts, COMPILER, *FLAGS, jaxlib.__version__, _cpu()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("JAXINFER_KERNEL_DIR") or Path.home() / ".cache/jaxinfer/kernels")
    path = cache / f"qmatmul-{digest}.so"
    if path.exists():
        return path
    cxx = shutil.which(COMPILER)
    if cxx is None:
        raise BuildError(f"no C++ compiler ({COMPILER}) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = max(1, min(4, cores or 1))
    with tempfile.TemporaryDirectory(prefix=f"{path.name}.", dir=cache) as tmp:
        compile_ = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{KERNELS}", "-c"]
        commands = [
            [*compile_, f"-DQMATMUL_PARTS={n}", f"-DQMATMUL_PART={k}", str(SOURCE)]
            for k in range(n)
        ] + [[*compile_, str(source)] for source in SOURCES if source != SOURCE]
        units = [f"{tmp}/{k}.o" for k in range(len(commands))]
        jobs = [
            subprocess.Popen(
                [*command, "-o", unit],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for command, unit in zip(commands, units, strict=True)
        ]
        errors = [job.communicate(timeout=900)[1] for job in jobs]
        if any(job.returncode for job in jobs):
            lines = [ln for e in errors for ln in e.splitlines() if "error" in ln]
            raise BuildError(f"{COMPILER} failed: {(lines or ['(no message)'])[0].strip()}")
        link = subprocess.run(
            [cxx, "-shared", *units, "-o", f"{tmp}/lib.so"], capture_output=True, text=True
        )
        if link.returncode:
            raise BuildError(f"linking failed: {link.stderr.strip()[:200]}")
        os.replace(f"{tmp}/lib.so", path)
    return path


def _cpu() -> str:
    """The CPU's model name and feature flags (-march=native code is built for them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    pick = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(pick))
