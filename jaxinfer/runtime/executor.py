"""Executor: the parameters, the programs, the compile cache and the KV page pools of a model
on its mesh. `run(program, *inputs)` moves host inputs to the devices in one transfer, looks the
executable up by key (compiling on a miss), threads the donated pools through the call and
returns the other outputs. Warmup compiles the shape plan through the same keys. The host tier
of the prefix cache copies pages out of the pools and back in through it (`copy_out`,
`copy_in`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np

from ..config import ModelConfig
from ..errors import JaxinferError
from ..model.gdn import RecurrentState
from ..model.kvcache import AttentionKV, HiddenState, KVConfig
from ..parallel.placement import Placement
from ..parallel.sharding import named
from .buckets import bucket_for
from .compile import CompileCache, CompileJob, shapes_text
from .host_cache import MAX_COPY, copy_buckets
from .lockstep import Leader
from .programs import Program, programs
from .speculative import SpecConfig


class Executor:
    def __init__(
        self,
        placement: Placement,
        *,
        cfg: ModelConfig,
        dtype,
        kv_config: KVConfig,
        decode_chunk: int,
        compile_cache: CompileCache,
        spec: SpecConfig | None = None,
        draft: Placement | None = None,
        sample_rows: int = 1,
    ):
        self.cfg = cfg
        self.sample_rows = sample_rows  # R of prefill's logits and `sample` (ShapePlan)
        self.spec = spec
        self.dtype = dtype
        self.kv_config = kv_config
        self.decode_chunk = decode_chunk  # most decode steps in one call
        self.compile_cache = compile_cache
        self.device_ms = 0.0  # time inside compiled decode calls (and their wait)
        self._step_counts: dict[str, int] = {}  # step numbers of the trace annotations
        # On several processes, the leader's Leader (lockstep.py): each device call goes to
        # the followers first, and the arrays calls return are numbered alike everywhere.
        self.lockstep: Leader | None = None
        self.adopt(placement, draft)

    def adopt(self, placement: Placement, draft: Placement | None = None) -> None:
        """Serve from `placement` (a new layout; with a draft model, the draft on the same
        mesh): new programs, new pools, an empty page pool."""
        self.layout = placement.layout
        self.mesh = placement.mesh
        self.rules = dict(placement.rules)
        self.runner = placement.runner
        self.params: dict | None = placement.params  # None while a reshard moves the shards
        self.draft = draft
        draft_runner = draft.runner if draft else None
        self.programs: dict[str, Program] = programs(
            self.runner, self.kv_config, self.decode_chunk, self.cfg.vocab_size, self.spec,
            draft_runner, self.sample_rows,
        )  # fmt: skip
        self.kv: Any = None  # the page pools (a list of per-layer tuples), allocated on first use
        self._replicated = named(self.mesh)
        # This process's devices of the mesh. Over several processes, device_put of a host
        # value to the whole mesh first checks that every process holds the same (a collective
        # and an eager compile per call); here every process does by construction (the
        # leader sends it, lockstep.py), so each process places its copies itself.
        self._local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        # The host tier's copies land in pinned host memory where the backend has it (a DMA
        # straight from the device); on CPU devices the device memory is the host's.
        device = self.mesh.devices.flat[0]
        kinds = {m.kind for m in device.addressable_memories()}
        pinned = device.platform != "cpu" and "pinned_host" in kinds
        self._host = (
            self._replicated.with_memory_kind("pinned_host") if pinned else self._replicated
        )
        self.copy_buckets = copy_buckets(self.kv_config.usable_pages)  # pages a copy call moves
        self._kv_shardings = self.runner.kv_shardings() + (
            draft_runner.kv_shardings() if draft_runner else self.runner.mtp_kv_shardings()
        )
        shapes = jax.eval_shape(self.programs["cache"].fn)
        self._kv_abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self._kv_shardings,
        )
        attention = [c for c in self.runner.caches if isinstance(c, AttentionKV)]
        self.kv_dtype = attention[0].describe() if attention else None
        kv = self.kv_config
        self.page_bytes, self.bytes_per_state = cache_bytes(placement, draft, kv.page_size)
        total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shapes))
        assert total == self.page_bytes * kv.n_pages + self.bytes_per_state * kv.n_states
        self._check_memory(total)
        # What the programs close over besides their arguments: a change here is a recompile.
        # The pools' types stand for the KV dtype and the draft's (or MTP head's) layers.
        pools = tuple((a.shape, a.dtype.name) for a in jax.tree.leaves(shapes))
        static = (self.cfg, str(np.dtype(self.dtype)), self.decode_chunk, self.kv_config,
                  self.spec, draft.cfg if draft else None, pools, self.sample_rows)  # fmt: skip
        layout = (
            self.layout,
            tuple(self.mesh.shape.items()),
            tuple(d.id for d in self.mesh.devices.flat),
            tuple(sorted(self.rules.items())),
        )
        cc, stages = self.compile_cache, self.runner.stages
        self._context = cc.context(
            static, layout, ["params", "kv"], (self.model_params(), self._kv_abstract), stages
        )
        self._bare = cc.context(static, layout, [], (), stages)  # programs without params

    def model_params(self):
        """The programs' `params`: the model's, or (the model's, the draft's)."""
        return self.params if self.draft is None else (self.params, self.draft.params)

    def state_stats(self) -> dict:
        """The linear layers' per-request state: bytes per state index and allocated in all, and the
        bytes of its prefix-cache snapshots."""
        kv = self.kv_config
        slots = kv.first_snapshot
        return {
            "state_slots": slots - 1 if self.bytes_per_state else 0,
            "state_bytes_per_slot": self.bytes_per_state,
            "state_bytes_allocated": self.bytes_per_state * slots,  # snapshots apart
            "snapshot_bytes": self.bytes_per_state * kv.snapshots,
        }

    def _check_memory(self, pool_bytes: int) -> None:
        """Refuse page pools that cannot fit the devices' memory (on CPU devices, the host's)."""
        device = self.mesh.devices.flat[0]
        try:
            limit = (device.memory_stats() or {}).get("bytes_limit")
        except Exception:  # backends without memory stats
            limit = None
        need = pool_bytes / self.mesh.devices.size  # spread over the mesh, at best
        if limit is None:  # CPU devices share the host's memory
            limit, need = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), pool_bytes
        if need > limit:
            gib = 2.0**30
            raise JaxinferError(
                f"the KV page pools need {need / gib:.1f} GiB per device (linear states included) "
                f"but a device has {limit / gib:.1f} GiB; pass a smaller kv_cache_tokens (now "
                f"{self.kv_config.usable_pages * self.kv_config.page_size} tokens) or -c"
                + self._snapshot_hint()
            )

    def _snapshot_hint(self) -> str:
        kv = self.kv_config
        if not kv.snapshots:
            return ""
        gib = self.bytes_per_state * kv.snapshots / 2.0**30
        return f", or fewer --prefix-snapshots (now {kv.snapshots}: {gib:.1f} GiB)"

    # ---- calls --------------------------------------------------------------------------

    def allocate(self) -> None:
        """Allocate the page pools (zeroed, in their shardings) if they are not yet."""
        if self.kv is None:
            compiled = self._executable("cache", ())
            self.kv = self._annotated("cache", compiled)

    def run(self, name: str, *inputs):
        """Call a program on host (numpy) or device inputs; returns its outputs after the pools."""
        if self.lockstep:
            self.lockstep.send("run", name, *inputs)
        self.allocate()
        args = (self.model_params(), self.kv, *self._put(inputs))
        compiled = self._executable(name, args)
        if name not in ("decode", "verify"):
            outs = self._annotated(name, compiled, *args)
        else:
            t0 = time.perf_counter()  # device time: the executable and its wait, nothing else
            outs = jax.block_until_ready(self._annotated(name, compiled, *args))
            self.device_ms += (time.perf_counter() - t0) * 1e3
        self.kv = outs[0]
        if self.lockstep:
            self.lockstep.track(outs[1:])
        return outs[1:]

    def copy_out(self, pages: list[int], snaps: list[int]) -> tuple[list, list]:
        """Every paged leaf of the pools at `pages` and every copied state leaf at `snaps`
        (< 0: none; its rows are junk), on the host: ([n, ...] per paged leaf, [n, ...] per
        state leaf). A call per MAX_COPY pages, each padded to a copy bucket; run before the
        call that writes the pages again (JAX orders it before the pools are donated)."""
        if self.lockstep:
            self.lockstep.send("copy_out", pages, snaps)
        self.allocate()
        parts = []
        for at in range(0, len(pages), MAX_COPY):
            n = min(MAX_COPY, len(pages) - at)
            index = np.zeros((2, bucket_for(n, self.copy_buckets)), np.int32)  # pages; snaps
            index[0, :n] = pages[at : at + n]
            index[1, :n] = np.maximum(snaps[at : at + n], 0)
            args = (self.model_params(), self.kv, *self._put((index[0], index[1])))
            outs = jax.device_get(self._annotated("spill", self._executable("spill", args), *args))
            parts.append(jax.tree.map(lambda a, n=n: np.asarray(a)[:n], outs))
        return jax.tree.map(lambda *a: np.concatenate(a), *parts)

    def copy_in(self, pages: list[int], contents: list, snap: int, state: list | None) -> None:
        """Write host `contents` ([n, ...] per paged leaf) into `pages` of the pools and, with
        `state` ([1, ...] per copied state leaf), that state into state index `snap`: a call
        per MAX_COPY pages, each padded to a copy bucket (the padding writes nothing)."""
        if self.lockstep:
            self.lockstep.send("copy_in", pages, contents, snap, state)
        self.allocate()
        kv = self.kv_config
        for at in range(0, len(pages), MAX_COPY):
            n = min(MAX_COPY, len(pages) - at)
            N = bucket_for(n, self.copy_buckets)
            _, rows, _, states = self.programs["restore"].inputs(N, 0, 0)
            index = np.full(N, kv.n_pages, np.int32)  # past the end: the padding is dropped
            index[:n] = pages[at : at + n]
            padded = [np.zeros(r.shape, r.dtype) for r in rows]
            for p, c in zip(padded, contents, strict=True):
                p[:n] = c[at : at + n]
            where = np.array([kv.n_states if state is None else snap], np.int32)
            values = state if state is not None else [np.zeros(s.shape, s.dtype) for s in states]
            args = (self.model_params(), self.kv, *self._put((index, padded, where, values)))
            self.kv = self._annotated("restore", self._executable("restore", args), *args)

    def _executable(self, name: str, args: tuple):
        program = self.programs[name]
        context = self._bare if name == "cache" else self._context
        return self.compile_cache.get(
            name, context, program.fn, args, donate=program.donate, out=self._outputs(program)
        )

    def _annotated(self, name, compiled, *args):
        step = self._step_counts[name] = self._step_counts.get(name, -1) + 1
        with jax.profiler.StepTraceAnnotation(name, step_num=step):
            return compiled(*args)

    def put(self, inputs):
        """Host arrays go to the devices in one transfer, replicated, so that every key sees
        device shardings; device arrays pass as they are (inputs reused over several calls
        are put once by the caller)."""
        if self.lockstep:
            self.lockstep.send("put", inputs)
        placed = self._put(inputs)
        if self.lockstep:
            self.lockstep.track(placed)
        return placed

    def _put(self, inputs):
        leaves, treedef = jax.tree_util.tree_flatten(inputs)
        host = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray | np.generic)]
        if host:
            values = [leaves[i] for i in host]
            local = self._local
            if len(local) == self.mesh.devices.size:
                placed = jax.device_put(values, self._replicated)
            else:  # a mesh over several processes: each places its own copies (see below)
                copies = jax.device_put([v for v in values for _ in local], local * len(values))
                placed = [
                    jax.make_array_from_single_device_arrays(
                        np.shape(v), self._replicated, copies[k * len(local) : (k + 1) * len(local)]
                    )
                    for k, v in enumerate(values)
                ]
            for i, x in zip(host, placed, strict=True):
                leaves[i] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _outputs(self, program: Program):
        """Output shardings: the pools keep theirs, everything else is replicated."""
        by = {"kv": self._kv_shardings, "host": self._host}
        outs = tuple(by.get(o, self._replicated) for o in program.outputs)
        return outs[0] if len(outs) == 1 else outs

    # ---- the plan -----------------------------------------------------------------------

    def job(self, name: str, B: int, T: int) -> CompileJob:
        """The compile of program `name` at batch B and chunk T, from ShapeDtypeStructs."""
        program = self.programs[name]
        inputs = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._replicated),
            program.inputs(B, T, self.kv_config.table_width),
        )
        if name == "cache":
            args, context = inputs, self._bare
        else:
            args, context = (self.model_params(), self._kv_abstract, *inputs), self._context
        label = " ".join(f"{k}={v}" for k, v in (("B", B), ("T", T)) if v)
        return CompileJob(
            name, context, program.fn, args, program.donate, self._outputs(program), label
        )

    def describe(self, job: CompileJob) -> str:
        """A job's per-call argument shapes, e.g. `chunk.tokens i32[4,128] ...`."""
        return shapes_text(job.fn, job.args, 0 if job.name == "cache" else 2)


def cache_bytes(placement: Placement, draft: Placement | None, page_size: int) -> tuple[int, int]:
    """(bytes of one page, bytes of one state index) over every layer's pools: the model's,
    then the draft's or the MTP head's. A stage layer holds one cache per stage, a
    depth-shared unit position one per repetition."""
    runners = (placement.runner, draft.runner) if draft else (placement.runner,)
    copies = [n for r in runners for n in (r.copies or (r.stages,) * len(r.caches))]
    caches = [c for r in runners for c in r.caches]
    if draft is None:  # the MTP head's caches, unstaged
        copies += [1] * len(placement.runner.mtp_caches)
        caches += list(placement.runner.mtp_caches)
    page = state = 0
    for c, n in zip(caches, copies, strict=True):
        if isinstance(c, AttentionKV):
            page += c.page_bytes(page_size) * n
        elif isinstance(c, RecurrentState | HiddenState):
            state += c.state_bytes() * n
    return page, state
