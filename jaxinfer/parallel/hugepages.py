"""Weights on one CPU device, held in transparent huge pages.

Decode on a CPU streams every weight once per token, and with 4 KiB pages the page walks of a
few hundred MB cost a fifth of the bandwidth: a 340 MB chain of matvecs on one core ran at
21.7 GB/s on 4 KiB pages and 29.6 GB/s on 2 MiB pages (benchmarks/results/xla_cpu_findings.md).
XLA CPU allocates its buffers with malloc, which this kernel's default THP mode ("madvise")
leaves on 4 KiB pages. So a one-CPU-device placement copies each weight into an `Arena`:
anonymous mappings advised MADV_HUGEPAGE before they are written, handed to jax without a copy
(`device_put(..., may_alias=True)`; the array keeps its host view, and so the mapping, alive).
Pipeline stages (pipeline.py) copy each CPU device's slice of a stage stack into an arena the
same way. Elsewhere (other platforms, a replicated or split weight over several devices, no
THP) weights take the plain device_put.
"""

from __future__ import annotations

import functools
import mmap
import threading

import jax
import numpy as np

HUGE = 2 << 20  # bytes of a transparent huge page (x86-64, and arm64 with 4 KiB pages)
CHUNK = 256 << 20  # bytes mapped at a time (untouched pages of a mapping cost nothing)
ALIGN = 4096  # each array starts on a page: jax aliases host memory aligned to 64 bytes


def usable(sharding: jax.sharding.Sharding) -> bool:
    """Whether weights under `sharding` can live in an arena: one CPU device, THP available."""
    devices: set[jax.Device] = sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu" and Arena.usable()


class Arena:
    """Bump allocation of host arrays in huge-page-advised anonymous mappings."""

    def __init__(self):
        self._chunk: np.ndarray | None = None  # uint8 view of the current mapping
        self._used = 0
        self._lock = threading.Lock()  # arrays are placed from several threads at once

    def put(self, host: np.ndarray, sharding: jax.sharding.Sharding, shape=None) -> jax.Array:
        """`host` copied into the arena (as `shape`: the same values, e.g. a view of a file's
        blocks [..., blocks, bytes] as [..., X]) and placed on the sharding's one CPU device."""
        view = self._take(host.nbytes).view(host.dtype).reshape(host.shape)
        view[...] = host  # one copy, strided where the host array is a view
        return jax.device_put(view.reshape(host.shape if shape is None else shape), sharding,
                              may_alias=True)  # fmt: skip

    @staticmethod
    def usable() -> bool:
        """Whether arrays placed on one CPU device can live in an arena (THP available)."""
        return hasattr(mmap, "MADV_HUGEPAGE") and _thp_enabled()

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialized array in the arena, to fill in place and place with
        `jax.device_put(..., may_alias=True)`."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self._take(nbytes).view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or start + nbytes > len(self._chunk):
                self._chunk, start = _mapping(max(CHUNK, nbytes)), 0
            self._used = start + nbytes
            return self._chunk[start : start + nbytes]


def _mapping(nbytes: int) -> np.ndarray:
    """A fresh anonymous mapping of at least `nbytes`, advised MADV_HUGEPAGE, as uint8 from
    its first 2 MiB boundary (page faults then take whole huge pages)."""
    size = -(-nbytes // HUGE) * HUGE + HUGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(m, np.uint8)
    skip = -whole.ctypes.data % HUGE
    return whole[skip : skip + size - HUGE]


@functools.cache  # read once per process, not once per weight
def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False
