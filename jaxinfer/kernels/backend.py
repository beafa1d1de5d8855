"""Which implementation of the ops this process uses, from JAXINFER_KERNELS: `auto` (the
default) picks by backend, the CPU's FFI kernels on CPU (cpu.py; JAXINFER_CPU_KERNELS picks
the variant); `xla` forces the plain-XLA graph path everywhere, the CPU kernels included
(whatever JAXINFER_CPU_KERNELS says). Any other value is a one-line SetupError. The model
calls the ops and never reads this."""

from __future__ import annotations

import os

import jax

from ..errors import SetupError

ENV = "JAXINFER_KERNELS"
MODES = ("auto", "xla")


def mode() -> str:
    """JAXINFER_KERNELS's value ("auto" when unset), checked."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise SetupError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def grouped_experts() -> bool:
    """Whether the expert block runs as grouped products (`lax.ragged_dot`, every expert's
    rows in one call) rather than the CPU's loop of per-expert tiles: on accelerators."""
    return jax.default_backend() != "cpu"
