"""CompileCache: every compiled program is looked up here, keyed by shape and sharding.

A key is (program name, context, per-call argument leaves (shape, dtype, weak_type, sharding)).
The context stands for what is the same call after call: the static config the program closes
over, the mesh, and the leaves of the leading arguments (parameters, KV pools), described once
per placement. A hit is a graph reuse. A miss compiles ahead of time
(`jit(fn).lower(*args).compile()`). Compiles of the warmup plan are planned; any other compile
after a program's first is a recompile, classified against what that program compiled before
(docs/compiling.md) and reported to the listeners as a `RecompileEvent`.

With an executable store (store.py), a key this cache has never held is looked up there before
it compiles, and what compiles is saved there: a later process loads the executable instead of
tracing, lowering and compiling it. A load is neither a compile nor a recompile; a key that
was held and then evicted or cleared compiles again (a same-shape recompile), never loads.

The compile watcher counts, through `jax.monitoring`, XLA compiles the cache did not start
(untracked: a stray eager op, a jit outside the cache) and persistent-cache hits and misses, on
the threads that are inside an engine call.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from ..errors import JaxinferError, RecompileError
from .store import jax_options, make_private, why_unsafe

log = logging.getLogger("jaxinfer.compile")

_DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
                "uint32": "u32", "bool": "bool", "int64": "i64", "float64": "f64"}  # fmt: skip


@dataclass(frozen=True)
class RecompileEvent:
    program: str  # stable role name: "cache", "prefill", "sample", "decode", "score"
    nodes: int  # HLO instructions of the new executable (lines of its HLO text with " = ")
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
    compiles: int = 0  # every compile: planned, initial and recompiles
    compile_seconds: float = 0.0
    planned: int = 0  # compiles of the warmup plan
    planned_seconds: float = 0.0
    loaded: int = 0  # executables loaded from the store (not compiles)
    load_seconds: float = 0.0


@dataclass(frozen=True)
class Handle:
    """Returned by `on_recompile`; `.remove()` unregisters the callback."""

    remove: Callable[[], None]


@dataclass(frozen=True)
class Context:
    """What stays the same between calls of a program on one placement."""

    static: Any  # what the programs close over (model config, dtype, KV geometry...)
    layout: tuple  # (name, mesh axes, device ids, rules)
    fixed: tuple[tuple[str, tuple], ...]  # (label, leaf key) of the leading arguments
    tree: str  # their tree structure (with static fields, e.g. a weight's block format)
    n_fixed: int  # how many leading arguments `fixed` describes
    stages: int  # pipeline stages of the programs


@dataclass(frozen=True)
class CompileJob:
    """One compile of the warmup plan."""

    name: str
    context: int
    fn: Callable
    args: tuple  # ShapeDtypeStructs (or arrays)
    donate: tuple[str, ...]
    out: Any  # output shardings
    label: str = ""  # e.g. "B=4 T=128", for the progress bar


def leaf_key(x) -> tuple:
    sharding = x.sharding if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else None
    return (x.shape, x.dtype, getattr(x, "weak_type", False), sharding)


def labelled_leaves(names: list[str], args: tuple) -> tuple[tuple[str, tuple], ...]:
    """(argument name + path inside it, leaf key) of every leaf of `args`."""
    out = []
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            out.append((names[i] + jax.tree_util.keystr(path), leaf_key(leaf)))
    return tuple(out)


def shapes_text(fn: Callable, args: tuple, skip: int) -> str:
    """`name shape` of every leaf of fn's arguments after the first `skip`."""
    names = list(inspect.signature(fn).parameters)[skip:]
    return " ".join(f"{label} {_text(key)}" for label, key in labelled_leaves(names, args[skip:]))


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

    def __init__(self, capacity: int = 64, *, reuse: bool = True, store=None):
        """`store`: an ExecutableStore (store.py), or None."""
        if capacity < 1:
            raise JaxinferError(f"compile_cache_size = {capacity} is invalid; it must be >= 1")
        self.capacity = capacity
        self.reuse = reuse  # False: rebuild every call (the graph-reuse-off benchmark mode)
        self.strict = False  # set by Engine.warmup() in strict mode
        self.store = store if reuse else None  # graph reuse off rebuilds: nothing loads
        self.stats: dict[str, ProgramStats] = {}
        self.n_same = 0
        self.n_diff = 0
        self.n_sharding = 0
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._contexts: list[Context] = []
        self._context_ids: dict[Context, int] = {}
        self._seen: dict[str, set[tuple]] = {}  # program -> argument shapes compiled
        self._last: dict[str, tuple] = {}  # program -> (key, labelled leaves) of its last compile
        self._gone: dict[tuple, str] = {}  # key -> why it left the cache
        self._origin: dict[tuple, str] = {}  # key -> "compiled" or "loaded" (from the store)
        self._callbacks: list[Callable[[RecompileEvent], None]] = []
        self._lock = threading.Lock()

    # ---- introspection ------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[str, list[str]]:
        """Program name -> per-call argument shapes of each cached executable."""
        out: dict[str, list[str]] = {}
        for name, _, _, leaves in self._entries:
            out.setdefault(name, []).append(" ".join(_text(leaf) for leaf in leaves))
        return out

    def executables(self, name: str) -> list:
        """The cached executables (jax `Compiled`) of one program."""
        return [c for key, c in self._entries.items() if key[0] == name]

    def origin(self, job: CompileJob) -> str:
        """How a planned program's executable came: "compiled", "loaded" (from the store), or
        "" (not yet)."""
        key = self.key(job.name, job.context, job.args, self._contexts[job.context].n_fixed)
        return self._origin.get(key, "") if key in self._entries else ""

    def compile_seconds(self) -> float:
        return sum(s.compile_seconds for s in self.stats.values())

    def setup_seconds(self) -> float:
        """Seconds spent compiling and loading executables."""
        return sum(s.compile_seconds + s.load_seconds for s in self.stats.values())

    def loaded(self) -> int:
        return sum(s.loaded for s in self.stats.values())

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

    def context(self, static, layout: tuple, names: list[str], fixed: tuple, stages=1) -> int:
        """The id of the context in which the leading arguments `fixed` (named `names`) are
        the same call after call; their leaves are described once, here."""
        tree = str(jax.tree_util.tree_structure(fixed))
        ctx = Context(static, layout, labelled_leaves(names, fixed), tree, len(fixed), stages)
        with self._lock:
            if ctx not in self._context_ids:
                self._context_ids[ctx] = len(self._contexts)
                self._contexts.append(ctx)
            return self._context_ids[ctx]

    # ---- lookup -------------------------------------------------------------------------

    @staticmethod
    def key(name: str, context: int, args: tuple, fixed: int) -> tuple:
        """The key of calling `name` on `args`, whose first `fixed` are the context's."""
        leaves, treedef = jax.tree_util.tree_flatten(args[fixed:])
        return (name, context, treedef, tuple(map(leaf_key, leaves)))

    def get(self, name: str, context: int, fn: Callable, args: tuple, *, donate=(), out=None):
        """The executable for `args` (arrays or ShapeDtypeStructs), compiled on a miss."""
        key = self.key(name, context, args, self._contexts[context].n_fixed)
        compiled = self.lookup(key)
        if compiled is None:
            compiled = self.restore(key, fn, args, donate, out)
        if compiled is None:
            compiled = self.compile(key, fn, args, donate=donate, out=out)
        return compiled

    def restore(self, key: tuple, fn: Callable, args: tuple, donate=(), out=None):
        """The executable of a key this cache never held, loaded from the store (None: not
        there, or no store)."""
        if self.store is None or key in self._gone or key in self._entries:
            return None
        labelled = self._labelled(key, fn, args)
        t0 = time.perf_counter()
        with jax.profiler.TraceAnnotation(f"load {key[0]} from the executable store"):
            store_key = self._store_key(key, labelled, donate, out)
            compiled = self.store.load(store_key, self._devices(key))
        if compiled is None:
            return None
        with self._lock:
            self._record(key, compiled, time.perf_counter() - t0, labelled, False, loaded=True)
        log.debug("loaded: %s", key[0])
        return compiled

    def _save(self, key: tuple, compiled, labelled, donate, out) -> None:
        if self.store is not None:
            store_key = self._store_key(key, labelled, donate, out)
            self.store.save(store_key, compiled, self._devices(key))

    def _devices(self, key: tuple) -> list:
        """The devices a program runs on, in its mesh's order."""
        by_id = {d.id: d for d in jax.devices()}
        return [by_id[i] for i in self._contexts[key[1]].layout[2]]

    def _store_key(self, key: tuple, labelled: tuple, donate, out) -> str:
        """The store's key: the environment, then everything the compile depends on (jax's
        options again as they are on the compiling thread: a `with` block around a call)."""
        assert self.store is not None  # only called with a store
        ctx = self._contexts[key[1]]
        return "\n".join([
            self.store.fingerprint, f"jax options {jax_options()}", f"program {key[0]}",
            f"static {ctx.static!r}", f"layout {ctx.layout!r}", f"fixed {ctx.tree}",
            f"args {key[2]}", f"donate {tuple(donate)!r}", f"out {out!r}",
            *(f"{label} {leaf!r}" for label, leaf in labelled),
        ])  # fmt: skip

    def lookup(self, key: tuple):
        """A cached executable, counted as a graph reuse; None on a miss."""
        compiled = self._entries.get(key) if self.reuse else None
        if compiled is not None:
            self._entries.move_to_end(key)
            self.stats[key[0]].calls += 1
        return compiled

    def compile(self, key: tuple, fn: Callable, args: tuple, *, donate=(), out=None):
        """Compile `key` now, outside any plan: an initial compile or a recompile."""
        name = key[0]
        shape_changed, sharding_changed, reason, labelled = self._classify(key, fn, args)
        if self.strict:
            raise RecompileError(f"strict mode: {name} would compile after warmup: {reason}")
        first = name not in self._last
        compiled, seconds, storable = self._build(key, fn, args, donate, out, reason)
        with self._lock:
            self._record(key, compiled, seconds, labelled, planned=False)
        if storable:
            self._save(key, compiled, labelled, donate, out)
        if first:
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
            stages=self._contexts[key[1]].stages,
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

    def compile_planned(
        self,
        jobs: list[CompileJob],
        *,
        workers: int = 0,
        on_done: Callable[[CompileJob, float], None] | None = None,
    ) -> dict[str, tuple[int, float]]:
        """Compile the warmup plan (what is not cached yet; what the store holds loads instead)
        in a thread pool: XLA compiles release the GIL. Planned compiles are not recompiles:
        no events, no counts. Returns {program: (executables compiled, compile seconds)}."""
        todo = []
        for job in jobs:
            key = self.key(job.name, job.context, job.args, self._contexts[job.context].n_fixed)
            if key not in self._entries or not self.reuse:
                todo.append((key, job))
        report: dict[str, tuple[int, float]] = {}
        counts = _THREAD.counts  # the workers' compile events belong to the caller's engine call

        def build(item):
            key, job = item
            t0 = time.perf_counter()
            with watching(counts) if counts is not None else contextlib.nullcontext():
                if self.restore(key, job.fn, job.args, job.donate, job.out):
                    if on_done is not None:
                        on_done(job, time.perf_counter() - t0)
                    return
                compiled, seconds, storable = self._build(
                    key, job.fn, job.args, job.donate, job.out, "plan"
                )
            labelled = self._labelled(key, job.fn, job.args)
            with self._lock:
                self._record(key, compiled, seconds, labelled, planned=True)
                n, s = report.get(job.name, (0, 0.0))
                report[job.name] = (n + 1, s + seconds)
            if storable:
                self._save(key, compiled, labelled, job.donate, job.out)
            if on_done is not None:
                on_done(job, seconds)

        workers = workers or min(len(todo), os.cpu_count() or 1) or 1
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for future in [pool.submit(build, item) for item in todo]:
                future.result()
        return report

    def restore_planned(self, jobs: list[CompileJob]) -> int:
        """Load what the store holds of the plan, compiling nothing -> the plan's executables
        this cache now has."""
        have = 0
        for job in jobs:
            key = self.key(job.name, job.context, job.args, self._contexts[job.context].n_fixed)
            if key in self._entries or self.restore(key, job.fn, job.args, job.donate, job.out):
                have += 1
        return have

    def _build(self, key, fn, args, donate, out, reason):
        """(compiled, seconds, storable): an executable that jax's persistent cache returned
        is not storable (XLA:CPU serializes a deserialized executable without some of its
        functions: "Function wrapped_broadcast not found" when the copy runs)."""
        t0 = time.perf_counter()
        TRACKING.inside = True
        try:
            with watching(CompileCounts()) as counts:
                with jax.profiler.TraceAnnotation(f"compile {key[0]}: {reason}"):
                    jitted = jax.jit(fn, donate_argnames=donate, out_shardings=out)
                    compiled = jitted.lower(*args).compile()
        finally:
            TRACKING.inside = False
        return compiled, time.perf_counter() - t0, counts.persistent_hits == 0

    def _record(self, key, compiled, seconds, labelled, planned: bool, loaded=False) -> None:
        name = key[0]
        stats = self.stats.setdefault(name, ProgramStats())
        if loaded:
            stats.loaded += 1
            stats.load_seconds += seconds
        else:
            stats.compiles += 1
            stats.compile_seconds += seconds
        if planned:
            stats.planned += 1
            stats.planned_seconds += seconds
        self._origin[key] = "loaded" if loaded else "compiled"
        self._seen.setdefault(name, set()).add(tuple(leaf[1][0] for leaf in labelled))
        self._last[name] = (key, labelled)
        if not self.reuse:
            return
        self._entries[key] = compiled
        self._gone.pop(key, None)
        while len(self._entries) > self.capacity:
            old, _ = self._entries.popitem(last=False)
            self._gone[old] = f"evicted (cache capacity {self.capacity})"

    def _labelled(self, key, fn, args) -> tuple:
        """Every argument leaf, named: the context's, then the per-call ones."""
        ctx = self._contexts[key[1]]
        names = list(inspect.signature(fn).parameters)[ctx.n_fixed :]
        return ctx.fixed + labelled_leaves(names, args[ctx.n_fixed :])

    def _classify(self, key, fn, args) -> tuple[bool, bool, str, tuple]:
        """(shape_changed, sharding_changed, reason, labelled leaves) of compiling `key` now.

        Only shapes count as a change of shape: dtype or weak-type drift, a churning static
        value, an eviction or a cleared cache are same-shape recompiles (inefficiencies).
        """
        name = key[0]
        labelled = self._labelled(key, fn, args)
        if name not in self._last:
            return True, False, "first compile", labelled
        prev_key, prev = self._last[name]
        ctx, prev_ctx = self._contexts[key[1]], self._contexts[prev_key[1]]
        if ctx.layout != prev_ctx.layout:
            reason = f"layout changed: {_mesh_text(prev_ctx.layout)} -> {_mesh_text(ctx.layout)}"
            return False, True, reason, labelled
        shapes = tuple(leaf[1][0] for leaf in labelled)
        shape_changed = shapes not in self._seen.get(name, set())
        same_tree = prev_key[2] == key[2] and len(prev) == len(labelled)
        sharding_changed = same_tree and [x[1][3] for x in prev] != [x[1][3] for x in labelled]
        if key in self._gone:
            return False, False, self._gone[key], labelled
        if ctx.static != prev_ctx.static:
            reason = f"static config changed: {prev_ctx.static} -> {ctx.static}"
            return False, False, reason, labelled
        if shape_changed or sharding_changed:
            return shape_changed, sharding_changed, _diff(prev, labelled), labelled
        if not self.reuse:
            return False, False, "graph reuse off: program rebuilt", labelled
        return False, False, _diff(prev, labelled) or "same key compiled again", labelled


def _mesh_text(layout) -> str:
    if not layout:
        return "none"
    name, axes = layout[0], layout[1]
    return f"{name} ({', '.join(f'{a}={n}' for a, n in axes)})"


def _diff(old: tuple, new: tuple) -> str:
    """Which arguments changed between two labelled signatures, e.g.
    `tokens: i32[1,16] -> i32[1,64]`. Leaves of one argument that changed the same way are
    reported once, with their count."""
    if [label for label, _ in old] != [label for label, _ in new]:
        return "argument structure changed"
    changes: dict[tuple[str, str], list[str]] = {}
    for (label, a), (_, b) in zip(old, new, strict=True):
        if a[:2] != b[:2]:
            what = f"{_text(a)} -> {_text(b)}"
        elif a[2] != b[2]:
            what = f"weak_type {a[2]} -> {b[2]}"
        elif a[3] != b[3]:
            what = f"sharding {_spec(a[3])} -> {_spec(b[3])}"
        else:
            continue
        changes.setdefault((label.split("[")[0].split(".")[0], what), []).append(label)
    parts = []
    for (arg, what), labels in changes.items():
        name = labels[0] if len(labels) == 1 else f"{arg} ({len(labels)} arrays)"
        parts.append(f"{name}: {what}")
    more = f" (+{len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more


# ---- the compile watcher ------------------------------------------------------------------

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_MISS = "/jax/compilation_cache/cache_misses"


@dataclass
class CompileCounts:
    untracked: int = 0  # XLA compiles the CompileCache did not start
    persistent_hits: int = 0  # executables loaded from the persistent compilation cache
    persistent_misses: int = 0


class _Watcher(threading.local):
    counts: CompileCounts | None = None  # where this thread's compile events go


_THREAD = _Watcher()
_LOCK = threading.Lock()
_INSTALLED = False


def _on_duration(event: str, duration_secs: float, **_kw: str | int) -> None:
    counts = _THREAD.counts
    if counts is not None and event == _BACKEND_COMPILE and not TRACKING.inside:
        with _LOCK:
            counts.untracked += 1


def _on_event(event: str, **_kw: str | int) -> None:
    counts = _THREAD.counts
    if counts is None or event not in (_CACHE_HIT, _CACHE_MISS):
        return
    with _LOCK:
        if event == _CACHE_HIT:
            counts.persistent_hits += 1
        else:
            counts.persistent_misses += 1


@contextlib.contextmanager
def watching(counts: CompileCounts) -> Iterator[CompileCounts]:
    """Send the compile events of this thread to `counts` while inside, and on to the
    enclosing block's on leaving (listeners are registered with jax.monitoring the first
    time)."""
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _INSTALLED = True
    previous, _THREAD.counts = _THREAD.counts, counts
    try:
        yield counts
    finally:
        _THREAD.counts = previous
        if previous is not None:
            with _LOCK:
                for f in dataclasses.fields(counts):
                    setattr(previous, f.name, getattr(previous, f.name) + getattr(counts, f.name))


# ---- the persistent compilation cache -----------------------------------------------------


def use_persistent_cache(directory: str | Path | None) -> None:
    """Point JAX's persistent compilation cache at `directory` (None: off), process-wide.

    Every executable is written (no minimum compile time or size), so a second process with
    the same directory loads every program instead of compiling it. An engine with an
    executable store does not use it: the store needs executables compiled afresh (_build).
    Loading an executable runs its code: a directory another user could change (see
    store.open_folder) leaves the cache off, with a warning.
    """
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    path = Path(directory).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise JaxinferError(
            f"cannot create compile cache dir {str(path)!r}: {e.strerror}"
        ) from None
    make_private(path)
    why = why_unsafe(path)
    if why is not None:
        log.warning(
            "jax's persistent compilation cache is off: %s: %s (it loads code: use a folder "
            "of your own, mode 0700, in one only you can write)", path, why
        )  # fmt: skip
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
