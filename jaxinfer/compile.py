"""CompileCache: every compiled program is looked up here, keyed by shape and sharding.

A key is (program name, static config, argument (path, shape, dtype, weak_type, sharding)
tree). A hit is a graph reuse; a miss compiles ahead of time (`jit.lower(...).compile()`) and is
recorded as a compile event, classified against what this program compiled before.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax


@dataclass(frozen=True)
class CompileEvent:
    """One compile of a program (the first one of a name is its initial compile)."""

    program: str
    initial: bool  # first compile of this program name
    shape_changed: bool  # argument shapes never compiled before for this program
    sharding_changed: bool  # mesh / shardings differ from the previous compile
    reason: str  # which part of the key differed, e.g. "tokens: i32[1,16] -> i32[1,64]"
    compile_seconds: float
    nodes: int  # HLO instructions of the new executable


@dataclass
class ProgramStats:
    calls: int = 0  # calls served from the cache (graph reuse)
    compiles: int = 0
    compile_seconds: float = 0.0


def _signature(args) -> tuple:
    """The shape part of a key: (treedef, per leaf (shape, dtype, weak_type, sharding))."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple(
        (
            tuple(x.shape),
            str(x.dtype),
            bool(getattr(x, "weak_type", False)),
            getattr(x, "sharding", None) if isinstance(x, jax.Array) else None,
        )
        for x in leaves
    )


def _diff(names: list[str], old: tuple, new: tuple) -> str:
    """Human text of the leaves whose (shape, dtype, weak_type, sharding) changed."""
    if old[0] != new[0]:
        return "argument structure changed"
    parts = []
    for name, a, b in zip(names, old[1], new[1], strict=True):
        if a == b:
            continue
        if a[:2] != b[:2]:
            parts.append(f"{name}: {a[1]}{list(a[0])} -> {b[1]}{list(b[0])}")
        elif a[2] != b[2]:
            parts.append(f"{name}: weak_type {a[2]} -> {b[2]}")
        else:
            parts.append(f"sharding of {name}: {a[3]} -> {b[3]}")
    return "; ".join(parts[:4]) + (f" (+{len(parts) - 4} more)" if len(parts) > 4 else "")


def _count_nodes(hlo_text: str) -> int:
    return sum(1 for line in hlo_text.splitlines() if " = " in line and not line.startswith("Hlo"))


@dataclass
class CompileCache:
    capacity: int = 64  # executables kept (LRU); evicted ones compile again when needed
    listeners: list[Callable[[CompileEvent], None]] = field(default_factory=list)

    def __post_init__(self):
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._history: dict[str, list[tuple]] = {}  # program -> signatures compiled before
        self.stats: dict[str, ProgramStats] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def compile_seconds(self) -> float:
        """Seconds spent compiling so far (timings of a phase subtract what it compiled)."""
        return sum(s.compile_seconds for s in self.stats.values())

    def clear(self) -> None:
        self._entries.clear()

    def run(self, name: str, fn: Callable, args: tuple, *, static: Any = None, donate=()):
        """Call program `name` (pure `fn`) on `args`, compiling it first on a miss."""
        sig = _signature(args)
        key = (name, static, sig)
        stats = self.stats.setdefault(name, ProgramStats())
        compiled = self._entries.get(key)
        if compiled is None:
            compiled = self._compile(name, fn, args, static, sig, donate)
        else:
            self._entries.move_to_end(key)
            stats.calls += 1
        return compiled(*args)

    def _compile(self, name, fn, args, static, sig, donate):
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        seconds = time.perf_counter() - t0
        history = self._history.setdefault(name, [])
        previous = history[-1] if history else None
        if previous is None:
            reason, shape_changed, sharding_changed = "first compile", True, False
        else:
            prev_static, prev_sig = previous
            shapes = [s[:3] for s in sig[1]]
            sharding_changed = [s[3] for s in sig[1]] != [s[3] for s in prev_sig[1]]
            shape_changed = all([s[:3] for s in old[1]] != shapes for _, old in history)
            if static != prev_static:
                reason = f"static config changed: {prev_static} -> {static}"
            elif (static, sig) in history:
                reason = f"evicted (cache capacity {self.capacity}) or cache cleared"
            else:
                reason = _diff(names, prev_sig, sig) or "same key, new function"
        history.append((static, sig))
        event = CompileEvent(
            program=name,
            initial=previous is None,
            shape_changed=shape_changed,
            sharding_changed=sharding_changed,
            reason=reason,
            compile_seconds=seconds,
            nodes=_count_nodes(compiled.as_text()),
        )
        stats = self.stats[name]
        stats.compiles += 1
        stats.compile_seconds += seconds
        self._entries[(name, static, sig)] = compiled
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        for listener in list(self.listeners):
            listener(event)
        return compiled
