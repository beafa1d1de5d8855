"""CompileCache: every compiled program is looked up here, keyed by shape and sharding.

A key is (program name, static config, per argument leaf (shape, dtype, weak_type, sharding)).
A hit is a graph reuse. A miss compiles ahead of time (`jit(fn).lower(*args).compile()`); every
compile after a program's first is a recompile, classified against what that program compiled
before (DESIGN.md section 2) and reported to the listeners as a `RecompileEvent`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from .errors import JaxinferError

log = logging.getLogger("jaxinfer.compile")

_DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
                "uint32": "u32", "bool": "bool", "int64": "i64", "float64": "f64"}  # fmt: skip


class RecompileError(JaxinferError):
    """Strict mode: a program was compiled after warmup()."""


@dataclass(frozen=True)
class RecompileEvent:
    program: str  # stable role name: "prefill", "decode", "score", "cache"
    nodes: int  # HLO instructions of the new executable
    stages: int  # pipeline stages the program spans
    shape_changed: bool  # argument shapes never compiled before for this program
    sharding_changed: bool  # mesh or shardings differ from this program's previous compile
    reason: str  # which key part differed, e.g. "tokens: i32[1,16] -> i32[1,64]"
    compile_seconds: float
    n_same: int  # running count of same-shape recompiles (after this one)
    n_diff: int  # running count of changed-shape recompiles (after this one)

    def log_line(self) -> str:
        return (
            f"recompile: {self.program} nodes = {self.nodes} (shape changed = "
            f"{int(self.shape_changed)}), stages = {self.stages}, n_same = {self.n_same}, "
            f"n_diff = {self.n_diff}: {self.reason}"
        )


@dataclass
class ProgramStats:
    calls: int = 0  # calls served by a cached executable (graphs reused)
    compiles: int = 0  # initial compile + recompiles
    compile_seconds: float = 0.0


@dataclass(frozen=True)
class Handle:
    """Returned by `on_recompile`; `.remove()` unregisters the callback."""

    remove: Callable[[], None]


def _leaf_key(x) -> tuple:
    sharding = x.sharding if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else None
    return (x.shape, x.dtype, getattr(x, "weak_type", False), sharding)


def _text(leaf: tuple) -> str:
    name = str(leaf[1])
    return f"{_DTYPE_SHORT.get(name, name)}[{','.join(map(str, leaf[0]))}]"


def _spec(sharding) -> str:
    return str(getattr(sharding, "spec", sharding))


class _Tracking(threading.local):
    inside = False  # a tracked compile is running on this thread


TRACKING = _Tracking()


class CompileCache:
    """Compiled programs by key, bounded (LRU), with recompile classification and hooks."""

    def __init__(self, capacity: int = 64, *, stages: int = 1, reuse: bool = True):
        if capacity < 1:
            raise JaxinferError(f"compile_cache_size = {capacity} is invalid; it must be >= 1")
        self.capacity = capacity
        self.stages = stages
        self.reuse = reuse  # False: rebuild every call (the graph-reuse-off benchmark mode)
        self.strict = False  # set by Engine.warmup() in strict mode
        self.stats: dict[str, ProgramStats] = {}
        self.n_same = 0
        self.n_diff = 0
        self.n_sharding = 0
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._history: dict[str, list[tuple]] = {}  # program -> keys compiled, in order
        self._gone: dict[tuple, str] = {}  # key -> why it left the cache
        self._callbacks: list[Callable[[RecompileEvent], None]] = []
        self._memo: tuple[Any, tuple] = (None, ())  # (parameter tree, its leaf keys)

    # ---- introspection ------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[str, list[str]]:
        """Program name -> argument shapes of each cached executable."""
        out: dict[str, list[str]] = {}
        for name, _, _, sig in self._entries:
            out.setdefault(name, []).append(" ".join(_text(leaf) for leaf in sig[1][-8:]))
        return out

    def compile_seconds(self) -> float:
        return sum(s.compile_seconds for s in self.stats.values())

    def graphs_reused(self) -> int:
        return sum(s.calls for s in self.stats.values())

    def clear(self) -> None:
        for key in self._entries:
            self._gone[key] = "cache cleared"
        self._entries.clear()

    def on_recompile(self, callback: Callable[[RecompileEvent], None]) -> Handle:
        self._callbacks.append(callback)

        def remove():
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return Handle(remove)

    # ---- lookup -------------------------------------------------------------------------

    def get(
        self, name: str, fn: Callable, args: tuple, *, static=None, layout=None, donate=(), out=None
    ):
        """The executable for `args` (arrays or ShapeDtypeStructs), compiled on a miss.

        `static` is what the program closes over (model config, dtype...); `layout` describes
        the mesh (axes, devices, rules), which also fixes `out`, the output shardings.
        """
        key = (name, static, layout, self._signature(args))
        compiled = self._entries.get(key) if self.reuse else None
        if compiled is not None:
            self._entries.move_to_end(key)
            self.stats[name].calls += 1
            return compiled
        return self._compile(key, fn, args, donate, out)

    def _signature(self, args: tuple) -> tuple:
        """(treedef, per leaf key). The parameter tree (a step's first argument) is the same
        object call after call: its leaf keys are computed once, as they dominate host time."""
        head = args[0] if args and isinstance(args[0], dict) else None
        if head is not None and self._memo[0] is head:
            head_keys = self._memo[1]
        elif head is not None:
            head_keys = tuple(map(_leaf_key, jax.tree_util.tree_leaves(head)))
            self._memo = (head, head_keys)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if head is None:
            return treedef, tuple(map(_leaf_key, leaves))
        rest = leaves[len(head_keys) :]
        return treedef, head_keys + tuple(map(_leaf_key, rest))

    def _compile(self, key, fn, args, donate, out):
        name = key[0]
        history = self._history.setdefault(name, [])
        shape_changed, sharding_changed, reason = self._classify(key, fn, history)
        if self.strict:
            raise RecompileError(f"strict mode: {name} would compile after warmup: {reason}")
        t0 = time.perf_counter()
        TRACKING.inside = True
        try:
            with jax.profiler.TraceAnnotation(f"compile {name}: {reason}"):
                jitted = jax.jit(fn, donate_argnums=donate, out_shardings=out)
                compiled = jitted.lower(*args).compile()
        finally:
            TRACKING.inside = False
        seconds = time.perf_counter() - t0
        stats = self.stats.setdefault(name, ProgramStats())
        stats.compiles += 1
        stats.compile_seconds += seconds
        if self.reuse:
            self._entries[key] = compiled
            self._gone.pop(key, None)
            while len(self._entries) > self.capacity:
                old, _ = self._entries.popitem(last=False)
                self._gone[old] = f"evicted (cache capacity {self.capacity})"
        initial = not history
        history.append(key)
        if initial:
            log.debug("compile: %s (%.2f s)", name, seconds)
            return compiled
        if sharding_changed:
            self.n_sharding += 1
        elif shape_changed:
            self.n_diff += 1
        else:
            self.n_same += 1
        event = RecompileEvent(
            program=name,
            nodes=sum(1 for ln in compiled.as_text().splitlines() if " = " in ln),
            stages=self.stages,
            shape_changed=shape_changed,
            sharding_changed=sharding_changed,
            reason=reason,
            compile_seconds=seconds,
            n_same=self.n_same,
            n_diff=self.n_diff,
        )
        log.debug(event.log_line())
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception:  # a user hook must not stop generation
                log.exception("recompile hook %r raised", callback)
        return compiled

    def _classify(self, key, fn, history) -> tuple[bool, bool, str]:
        """(shape_changed, sharding_changed, reason) of compiling `key` now.

        Only shapes count as a change of shape: dtype or weak-type drift, a churning static
        value, an eviction or a cleared cache are same-shape recompiles (inefficiencies).
        """
        name, static, layout, sig = key
        if not history:
            return True, False, "first compile"
        prev = history[-1]
        if layout != prev[2]:
            return False, True, f"layout changed: {_mesh_text(prev[2])} -> {_mesh_text(layout)}"
        shapes = [leaf[0] for leaf in sig[1]]
        shape_changed = all([leaf[0] for leaf in old[3][1]] != shapes for old in history)
        shardings = [leaf[3] for leaf in sig[1]]
        sharding_changed = prev[3][0] == sig[0] and [leaf[3] for leaf in prev[3][1]] != shardings
        if key in self._gone:
            return False, False, self._gone[key]
        if static != prev[1]:
            return False, False, f"static config changed: {prev[1]} -> {static}"
        if shape_changed or sharding_changed:
            return shape_changed, sharding_changed, _diff(fn, prev[3], sig)
        if not self.reuse:
            return False, False, "graph reuse off: program rebuilt"
        return False, False, _diff(fn, prev[3], sig) or "same key compiled again"


def _mesh_text(layout) -> str:
    if not layout:
        return "none"
    name, axes = layout[0], layout[1]
    return f"{name} ({', '.join(f'{a}={n}' for a, n in axes)})"


def _names(fn: Callable, args_sig) -> list[str]:
    """A readable name per argument leaf: the parameter name plus its path inside."""
    treedef = args_sig[0]
    params = list(inspect.signature(fn).parameters)
    dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]:
        head = path[0].idx if hasattr(path[0], "idx") else 0
        label = params[head] if head < len(params) else f"arg{head}"
        names.append(label + jax.tree_util.keystr(path[1:]))
    return names


def _diff(fn: Callable, old: tuple, new: tuple) -> str:
    """Which arguments changed between two signatures, e.g. `tokens: i32[1,16] -> i32[1,64]`.

    Leaves of one argument that changed the same way are reported once, with their count.
    """
    if old[0] != new[0]:
        return "argument structure changed"
    changes: dict[tuple[str, str], list[str]] = {}
    for label, a, b in zip(_names(fn, new), old[1], new[1], strict=True):
        if a[:2] != b[:2]:
            what = f"{_text(a)} -> {_text(b)}"
        elif a[2] != b[2]:
            what = f"weak_type {a[2]} -> {b[2]}"
        elif a[3] != b[3]:
            what = f"sharding {_spec(a[3])} -> {_spec(b[3])}"
        else:
            continue
        changes.setdefault((label.split("[")[0], what), []).append(label)
    parts = []
    for (arg, what), labels in changes.items():
        name = labels[0] if len(labels) == 1 else f"{arg} ({len(labels)} arrays)"
        parts.append(f"{name}: {what}")
    more = f" (+{len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more


def default_cache_dir() -> Path | None:
    """$JAXINFER_COMPILE_CACHE_DIR ("" or "off" disables), else the per-user cache dir."""
    env = os.environ.get("JAXINFER_COMPILE_CACHE_DIR")
    if env is not None:
        return None if env in ("", "off", "0") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxinfer" / "xla"


def use_persistent_cache(directory: str | Path | None) -> None:
    """Point JAX's persistent compilation cache at `directory` (None: off), process-wide.

    Every executable is written (no minimum compile time or size), so a second process with
    the same directory loads every program instead of compiling it.
    """
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JaxinferError(
            f"cannot create compile cache dir {str(path)!r}: {e.strerror}"
        ) from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
