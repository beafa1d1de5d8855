"""Which implementation of the ops this process uses, from JAXINFER_KERNELS:
- `auto` (the default) picks by backend: on CPU the FFI kernels (cpu.py; JAXINFER_CPU_KERNELS
  picks the variant), on GPU the Pallas kernels compiled (Triton), on TPU jax's TPU kernels
  where they fit (tpu.py), elsewhere plain XLA;
- `xla` forces the plain-XLA graph path everywhere, the CPU kernels included (whatever
  JAXINFER_CPU_KERNELS says);
- `interpret` runs the Pallas kernels in Pallas's interpreter on any backend (how the CPU tests
  run the accelerator path), the CPU kernels off.
Any other value is a one-line SetupError. The model calls the ops (kernels/__init__) and never
reads this."""

from __future__ import annotations

import os

import jax

from ..errors import SetupError

ENV = "JAXINFER_KERNELS"
MODES = ("auto", "xla", "interpret")


def mode() -> str:
    """JAXINFER_KERNELS's value ("auto" when unset), checked."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise SetupError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def family() -> str:
    """The implementations in use: "cpu" (the FFI kernels), "pallas" (compiled for the GPU),
    "interpret" (those interpreted), "tpu" (tpu.py's) or "xla"."""
    m = mode()
    if m != "auto":
        return m
    return {"cpu": "cpu", "gpu": "pallas", "tpu": "tpu"}.get(jax.default_backend(), "xla")
