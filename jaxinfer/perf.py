"""Perf stats (llama.cpp style) and the process-wide compile watcher.

The watcher listens to `jax.monitoring`: every XLA compile that the CompileCache did not
start is an untracked compile (a stray eager op, a jit outside the cache), and persistent
compilation cache hits and misses are counted for the stats.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

import jax

from .compile import TRACKING

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"


class _Watcher:
    """Counts compile events for the whole process (jax listeners are global)."""

    def __init__(self):
        self.untracked = 0
        self.persistent_hits = 0
        self.persistent_misses = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, name, _secs, **_kw):
        if name == _BACKEND_COMPILE and not TRACKING.inside:
            with self._lock:
                self.untracked += 1

    def _on_event(self, name, **_kw):
        with self._lock:
            if name == _CACHE_HIT:
                self.persistent_hits += 1
            elif name == _CACHE_MISS:
                self.persistent_misses += 1

    def snapshot(self) -> tuple[int, int, int]:
        return self.untracked, self.persistent_hits, self.persistent_misses


WATCHER = _Watcher()


@dataclass
class PerfStats:
    load_ms: float = 0.0
    prompt_tokens: int = 0
    prompt_ms: float = 0.0  # compile time excluded, as llama.cpp's timings exclude setup
    eval_tokens: int = 0
    eval_ms: float = 0.0
    eval_device_ms: float = 0.0  # part of eval_ms inside compiled decode calls
    total_ms: float = 0.0
    graphs_reused: int = 0  # calls served by a cached executable
    recompiles_same: int = 0  # same-shape recompiles: something should have been reused
    recompiles_diff: int = 0  # changed-shape recompiles: new buckets
    recompiles_sharding: int = 0  # after a layout change; expected, not counted above
    programs: int = 0  # executables compiled (initial compiles + recompiles)
    compile_seconds: float = 0.0
    untracked_compiles: int = 0  # compiles outside the CompileCache (jax.monitoring)
    persistent_hits: int = 0  # executables loaded from the persistent compilation cache
    persistent_misses: int = 0

    def host_share(self) -> float:
        """Share of decode wall time spent on the host outside compiled code."""
        return 1.0 - self.eval_device_ms / self.eval_ms if self.eval_ms else 0.0

    def copy(self) -> PerfStats:
        return PerfStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __str__(self) -> str:
        def rate(n, ms):
            per = ms / n if n else 0.0
            tps = 1000.0 * n / ms if ms else 0.0
            return (
                f"{ms:10.2f} ms / {n:5d} tokens "
                f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
            )

        return "\n".join(
            [
                f"perf:        load time = {self.load_ms:10.2f} ms",
                f"perf: prompt eval time = {rate(self.prompt_tokens, self.prompt_ms)}",
                f"perf:        eval time = {rate(self.eval_tokens, self.eval_ms)}",
                f"perf:   eval host time = {self.host_share():.1%} of eval (outside compiled code)",
                f"perf:       total time = {self.total_ms:10.2f} ms",
                f"perf:    graphs reused = {self.graphs_reused}",
                f"perf:       recompiles = {self.recompiles_same} / {self.recompiles_diff} "
                f"(same shape) / (changed shape), {self.recompiles_sharding} after resharding",
                f"perf:         compiles = {self.programs} programs, {self.compile_seconds:.2f} s; "
                f"untracked = {self.untracked_compiles}; persistent cache hits = "
                f"{self.persistent_hits}, misses = {self.persistent_misses}",
            ]
        )
