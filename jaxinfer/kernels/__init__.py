"""Kernels: implementations of the ops (`ops/`) for one backend, chosen where the model calls
them. Today the CPU's XLA FFI custom calls (`cpu.py`; C++ sources in `src/`, one library per
instruction set, built by `build.py`): the quantized and small-row float products and paged
attention. JAXINFER_KERNELS=xla forces the plain-XLA graph path (`backend.mode`). The model
never calls a backend directly."""

from .backend import grouped_experts, mode
from .cpu import ATTEND_POOLS, MAX_ROWS, attend, available, matmul, matmuls, serves, status

__all__ = [
    "ATTEND_POOLS",
    "MAX_ROWS",
    "attend",
    "available",
    "grouped_experts",
    "matmul",
    "matmuls",
    "mode",
    "serves",
    "status",
]
