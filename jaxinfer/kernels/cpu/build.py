"""Building the CPU kernels: one shared library per instruction-set variant, from the one
source in src/ (vec.h's bodies chosen by the variant's flags, never -march=native).

`setup.py` builds every variant this machine's compiler targets when the package is installed
(into the package's `kernels/cpu/lib/`); `kernels/cpu/` rebuilds a variant at load only in an
editable checkout whose sources changed since. Imports nothing of jax, so that setup.py can load
it from the source tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).with_name("src")
# one library, all variants
UNITS = ("q_legacy.cc", "q_kquants.cc", "q_float.cc", "attend.cc", "delta.cc")
LIBRARIES = Path(__file__).with_name("lib")
COMPILER = os.environ.get("CXX", "g++")
# -ffp-contract=off: gcc must not fuse a weight's `scale * q - low` into one rounding (the
# kernel's weights are bit-exact dequantize values); the accumulations' FMAs are explicit.
# -Bsymbolic: each variant's library calls its own inline functions, not another variant's.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-Wno-psabi", "-Wno-attributes")
LINK = ("-shared", "-Wl,-Bsymbolic")


@dataclasses.dataclass(frozen=True)
class Variant:
    """An instruction-set variant: its compiler flags, the CPU flags it needs
    (/proc/cpuinfo's names), and the machines it is built for."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]
    machines: tuple[str, ...]


X86 = ("x86_64", "amd64")
ARM = ("aarch64", "arm64")
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c")
AVX512_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c")
# Best first: the loader takes the first one the CPU can run.
VARIANTS = (
    # with VNNI's vpdpbusd (Ice Lake, Cascade Lake, Zen 4 and later): the 8-bit GEMM's products
    Variant("avx512vnni", (*AVX512, "-mavx512vnni"), (*AVX512_NEEDS, "avx512_vnni"), X86),
    Variant("avx512", AVX512, AVX512_NEEDS, X86),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"), X86),
    Variant("neon", (), ("asimd",), ARM),  # NEON is in every aarch64 core (cpuinfo: asimd)
    Variant("scalar", ("-DJAXINFER_SCALAR",), (), X86 + ARM + ("",)),  # every machine
)
NAMES = tuple(v.name for v in VARIANTS)


def machine() -> str:
    return platform.machine().lower()


def digest(variant: Variant) -> str:
    """What a built library must match: the sources (every file in src/), the variant's flags
    and the common ones."""
    texts = [f.read_bytes() for f in sorted(SOURCES.iterdir()) if f.suffix in (".cc", ".h")]
    key = b"\0".join((*texts, *(f.encode() for f in (*FLAGS, *LINK, *variant.flags))))
    return hashlib.sha256(key).hexdigest()[:16]


def library(variant: Variant, folder: Path = LIBRARIES) -> Path:
    """The library file of a variant built from today's sources."""
    return folder / f"cpu-{variant.name}-{digest(variant)}.so"


class BuildError(Exception):
    pass


def build(variant: Variant, include: str, folder: Path = LIBRARIES, jobs: int = 0) -> Path:
    """Compiles the variant's units (in parallel, up to `jobs` or the CPU count), links them
    under a temporary name and renames it, so that concurrent builds never load a half-written
    file; older builds of the variant are removed. `include`: XLA's FFI headers
    (jax.ffi.include_dir())."""
    path = library(variant, folder)
    if path.exists():
        return path
    cxx = shutil.which(COMPILER)
    if cxx is None:
        raise BuildError(f"no C++ compiler ({COMPILER}) on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    width = max(1, jobs or cores or 1)
    with tempfile.TemporaryDirectory(prefix=f"{path.name}.", dir=folder) as tmp:
        compile_ = [cxx, *FLAGS, *variant.flags, f"-I{include}", f"-I{SOURCES}", "-c"]
        commands = [
            [*compile_, str(SOURCES / u), "-o", f"{tmp}/{k}.o"] for k, u in enumerate(UNITS)
        ]
        for at in range(0, len(commands), width):
            running = [
                subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for c in commands[at : at + width]
            ]
            errors = [job.communicate(timeout=1800)[1] for job in running]
            if any(job.returncode for job in running):
                lines = [ln for e in errors for ln in e.splitlines() if "error" in ln]
                raise BuildError(f"{COMPILER} failed: {(lines or ['(no message)'])[0].strip()}")
        units = [f"{tmp}/{k}.o" for k in range(len(UNITS))]
        link = subprocess.run([cxx, *LINK, *units, "-o", f"{tmp}/lib.so"], capture_output=True,
                              text=True)  # fmt: skip
        if link.returncode:
            raise BuildError(f"linking failed: {link.stderr.strip()[:200]}")
        os.replace(f"{tmp}/lib.so", path)
    for old in folder.glob(f"cpu-{variant.name}-*.so"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def buildable(variant: Variant) -> bool:
    """Whether this machine's compiler targets the variant (x86 variants on x86, NEON on Arm,
    scalar everywhere); a cross compiler is not used here."""
    return machine() in variant.machines or "" in variant.machines
