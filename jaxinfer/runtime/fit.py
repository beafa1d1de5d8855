"""Fit: size the KV page pool, the prefix snapshots and, where the user did not give it, the
context to the memory there is (llama.cpp's `--fit`, vLLM's `--gpu-memory-utilization`).

The plan is measured, not guessed: the weights once placed, a page's and a state's bytes from
the caches' shapes, the programs' temporaries from XLA's `memory_analysis()` of the compiled
plan, and on CPU the runtime's own bytes (jax, XLA, the compiled programs) from the process's
growth while it compiled (loader.fitted: a first plan without the last two is compiled and
measured, and made again when it does not fit with them). What does not fit is given up in a
stated order:

1. prefix snapshots (hybrid models; the ones the user did not set), down to none;
2. the context (when not given), down to the floor `fit_ctx`, in buckets;
3. then nothing: a one-line error names the shortfall and what would fit.

Given values (`max_seq_len`, `slots`, `kv_cache_tokens`, `prefix_snapshots`) are kept, as
llama.cpp's fit keeps what the user set. A fitted count is rounded down to a bucket (m * 2^k,
m in 4..7) so that two starts whose free memory differs a little plan the same shapes and reuse
the executable store's programs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import JaxinferError
from ..options import EngineOptions

MIB = 1 << 20


def bucket_down(n: int) -> int:
    """The largest m * 2^k <= n with m in 4..7 (n itself below 8): at most 20% below n."""
    if n < 8:
        return max(n, 0)
    shift = n.bit_length() - 3  # n in [4 * 2^shift, 8 * 2^shift)
    return (n >> shift) << shift


def free_memory(device) -> tuple[int, str]:
    """Bytes free for an engine on `device` now, and where the figure comes from: an
    accelerator's memory_stats() (its limit less what is in use); on CPU the smaller of the
    host's MemAvailable and what the cgroup's limit leaves."""
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # backends without memory stats
            stats = {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            return free, f"{device.platform} memory_stats()"
    free, source = _meminfo("MemAvailable"), "MemAvailable"
    cgroup = _cgroup_room()
    if cgroup is not None and cgroup < free:
        free, source = cgroup, "the cgroup's memory limit"
    return free, source


def agreed(values: list[int], most: list[bool]) -> list[int]:
    """The same figures on every process of a group: each value's least over the processes
    (the most where `most` says), so that every process plans the same shapes (one that
    planned others would wait forever in a collective the others never call). One process:
    the values themselves."""
    import jax

    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    # as int32 pairs: without jax_enable_x64 an int64 array would arrive cut to 32 bits
    mine = np.asarray(values, np.int64).view(np.int32)
    got = np.asarray(multihost_utils.process_allgather(mine), np.int32)
    every = np.ascontiguousarray(got.reshape(-1, 2 * len(values))).view(np.int64)
    return [int(c.max() if m else c.min()) for c, m in zip(every.T, most, strict=True)]


def _meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    """What the cgroup's memory limit leaves (v2, else v1); None without a limit."""
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit, usage in (("memory.max", "memory.current"), v1):
        try:
            text = (Path("/sys/fs/cgroup") / limit).read_text().strip()
            used = int((Path("/sys/fs/cgroup") / usage).read_text())
        except (OSError, ValueError):
            continue
        if text == "max" or int(text) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return int(text) - used
    return None


def resident_bytes() -> int:
    """This process's resident set now (Linux; 0 where /proc is not there)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): compiling leaves
    hundreds of MiB free but resident, which a fit would have to plan for."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclass(frozen=True)
class Need:
    """What an engine of this model holds besides the KV pages, and a page's and a state's bytes."""

    weights: int  # on the devices, measured
    temporaries: int  # the largest program's, from memory_analysis()
    page_bytes: int  # one page of every layer's K and V pools
    state_bytes: int  # one state index of every linear layer (0: a model without state)
    rows: int  # state indices the requests use (slots or the largest batch)
    model_ctx: int  # the context the model declares
    carries_state: bool  # hybrid: prefix hits need snapshots


@dataclass(frozen=True)
class FitPlan:
    """A fitted memory plan: the values it chose and the bytes of each part."""

    memory: int  # the bytes planned in (fit_memory_mib, or free memory at load)
    source: str  # where `memory` comes from
    target: int  # bytes left free
    max_seq_len: int
    slots: int | None
    kv_cache_tokens: int
    snapshots: int
    weights: int
    kv_pool: int  # the page pool, the null page included
    states: int  # the requests' linear states
    snapshot_bytes: int
    temporaries: int
    host_cache: int  # the host tier's cap (host RAM; on CPU the same memory)
    gave_up: tuple[str, ...]  # what the plan cut, in order
    # CPU: what the process grew by while the plan compiled, besides the weights (jax, XLA,
    # the compiled programs): measured, so it varies from start to start, and planned inside
    # fit_target's margin, not beside it (shapes that vary would miss the executable store)
    runtime: int = 0
    base: int = 0  # the process's resident bytes before the weights loaded

    def measured(self, pools: bool) -> FitPlan:
        """This plan with the runtime measured now (CPU, where the devices' memory is the
        process's: what the process holds besides `base`, the weights and, with `pools`
        allocated, the caches), after the compilers' freed heap is given back."""
        trim_heap()
        held = self.weights + (self.kv_pool + self.states + self.snapshot_bytes if pools else 0)
        return dataclasses.replace(self, runtime=max(resident_bytes() - self.base - held, 0))

    @property
    def planned(self) -> int:
        """The bytes the plan holds within the memory less the target."""
        parts = (self.weights, self.kv_pool, self.states, self.snapshot_bytes, self.temporaries)
        return sum(parts) + self.host_cache

    @property
    def total(self) -> int:
        """What the engine's process holds besides what it held before the weights loaded."""
        return self.planned + self.runtime

    def options(self, o: EngineOptions) -> EngineOptions:
        """`o` with the fitted values in place of the ones fit chose."""
        return o.replace(
            max_seq_len=self.max_seq_len, kv_cache_tokens=self.kv_cache_tokens,
            prefix_snapshots=self.snapshots if o.prefix_cache else o.prefix_snapshots,
        )  # fmt: skip

    def rows(self) -> list[tuple[str, int]]:
        """(part, bytes) in the order `jaxinfer info --fit` prints them."""
        return [
            ("weights", self.weights), ("kv_pool", self.kv_pool), ("linear_state", self.states),
            ("snapshots", self.snapshot_bytes), ("temporaries", self.temporaries),
            ("host_cache", self.host_cache), ("planned", self.planned), ("runtime", self.runtime),
            ("total", self.total),
        ]  # fmt: skip

    def summary(self) -> str:
        """One line: the choice and its bytes against the memory."""
        cut = f"; gave up {', '.join(self.gave_up)}" if self.gave_up else ""
        slots = f" x {self.slots} slots" if self.slots else ""
        return (
            f"fit: context {self.max_seq_len}{slots}, KV pool {self.kv_cache_tokens} tokens, "
            f"{self.snapshots} snapshots: {self.planned / MIB:.0f} MiB of "
            f"{(self.memory - self.target) / MIB:.0f} MiB ({self.memory / MIB:.0f} MiB from "
            f"{self.source}, {self.target / MIB:.0f} MiB kept free; the runtime took "
            f"{self.runtime / MIB:.0f} MiB of it){cut}"
        )


def plan(o: EngineOptions, need: Need, memory: int, source: str) -> FitPlan:
    """The largest plan within `memory` less fit_target_mib, giving up snapshots, then the
    context down to fit_ctx; a JaxinferError names the shortfall when even that does not fit."""
    target = o.fit_target_mib * MIB
    room = memory - target
    host = o.cache_ram_mib * MIB
    states = need.state_bytes * (need.rows + 2)  # the null state and a scoring pass's too
    fixed = need.weights + need.temporaries + states + host
    if fixed > room:
        raise JaxinferError(
            f"fit: the weights ({need.weights / MIB:.0f} MiB), the programs' temporaries "
            f"({need.temporaries / MIB:.0f} MiB)"
            + (f", the linear states ({states / MIB:.0f} MiB)" if states else "")
            + (f" and --cache-ram ({host / MIB:.0f} MiB)" if host else "")
            + f" need {fixed / MIB:.0f} MiB but {memory / MIB:.0f} MiB ({source}) less "
            f"--fit-target {target / MIB:.0f} MiB leaves {room / MIB:.0f} MiB: "
            f"{(fixed - room) / MIB:.0f} MiB short; free memory, lower --fit-target"
            + (" or --cache-ram" if host else "")
        )
    page = o.page_size
    slots = max(o.slots or 1, 1)
    snaps_given = o.prefix_snapshots is not None or not o.prefix_cache or not need.carries_state

    def pages(ctx: int) -> int:  # the pool's pages, the null page included
        return -(-(o.kv_cache_tokens or ctx * slots) // page) + 1

    def default_snapshots(ctx: int) -> int:  # as KVManager.plan: the pool's bytes, one a page
        if not need.carries_state or not o.prefix_cache or o.prefix_snapshots == 0:
            return 0
        if o.prefix_snapshots is not None:
            return o.prefix_snapshots
        usable = pages(ctx) - 1
        return min(usable, usable * need.page_bytes // need.state_bytes)

    def made(ctx: int, snaps: int, gave_up: tuple[str, ...]) -> FitPlan:
        return FitPlan(
            memory, source, target, ctx, o.slots, (o.kv_cache_tokens or ctx * slots), snaps,
            need.weights, pages(ctx) * need.page_bytes, states, snaps * need.state_bytes,
            need.temporaries, host, gave_up,
        )  # fmt: skip

    def left(ctx: int) -> int:  # bytes past the pool at this context
        return room - fixed - pages(ctx) * need.page_bytes

    ctx = o.max_seq_len or need.model_ctx
    want = default_snapshots(ctx)
    if left(ctx) >= want * need.state_bytes:
        return made(ctx, want, ())
    gave_up: tuple[str, ...] = ()
    if not snaps_given and left(ctx) >= 0:  # 1. fewer snapshots
        snaps = bucket_down(left(ctx) // need.state_bytes)
        return made(ctx, snaps, (f"snapshots ({snaps} of {want})",))
    if not snaps_given and want:
        gave_up = (f"snapshots (0 of {want})",)
    elif want:  # given snapshots are kept: they come off the room first
        fixed += want * need.state_bytes
    floor = min(o.fit_ctx, need.model_ctx)
    if o.max_seq_len is None and o.kv_cache_tokens is None and left(floor) >= 0:  # 2. context
        usable = (room - fixed) // need.page_bytes - 1  # pages past the null page
        fitted = min(max(floor, bucket_down(usable // slots) * page), ctx)
        snaps = want if snaps_given else 0
        if not snaps_given and need.state_bytes:  # what the cut context leaves
            snaps = min(bucket_down(left(fitted) // need.state_bytes), default_snapshots(fitted))
            gave_up = (f"snapshots ({snaps} of {want})",)
        return made(fitted, snaps, (*gave_up, f"context ({fitted} of {ctx})"))
    # 3. nothing left to give up
    at = floor if o.max_seq_len is None and o.kv_cache_tokens is None else ctx
    short, kv = -left(at), pages(at) * need.page_bytes
    what = (
        f"--kv-cache-tokens {o.kv_cache_tokens}" if o.kv_cache_tokens
        else f"-c {ctx}" if o.max_seq_len
        else f"the context floor --fit-ctx {floor}"
    )  # fmt: skip
    per_slot = f" on each of {slots} slots" if o.slots and slots > 1 else ""
    raise JaxinferError(
        f"fit: {what}{per_slot} needs {kv / MIB:.0f} MiB of KV pages, {short / MIB:.0f} MiB "
        f"more than {memory / MIB:.0f} MiB ({source}) "
        f"leaves after the weights ({need.weights / MIB:.0f} MiB), the temporaries and "
        f"--fit-target {target / MIB:.0f} MiB; pass a smaller -c or -np, or free memory"
    )
