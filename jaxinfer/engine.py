"""Engine: the facade users hold. It checks requests, hands them to the scheduler's one loop,
and reports perf stats, KV pages and recompiles; the executor owns the model and programs.

Every request, from `generate()` (one prompt, a list, streamed) or `submit()`, goes through
the same loop: admit, one prompt chunk, one decode call, deliveries. Programs come from a small
known plan (`compile_plan()`), which `warmup()` compiles. One thread drives an Engine.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from .config import ModelConfig
from .errors import JaxinferError, RecompileError, RequestError
from .formats.tokenizer import Tokenizer
from .model.kvcache import PAGE_SIZES, KVConfig
from .ops.sampling import SamplingParams, SamplingRows
from .parallel.placement import Placement
from .runtime.buckets import ShapePlan
from .runtime.compile import CompileCache, CompileCounts, Handle, RecompileEvent, watching
from .runtime.executor import Executor
from .runtime.perf import PerfStats
from .runtime.profiler import profile
from .runtime.request import Request, RequestState, StreamPiece
from .runtime.scheduler import Scheduler
from .runtime.speculative import SpecConfig

DEFAULT_PREFILL_BUCKETS = (8, 32, 128, 512)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
DEFAULT_PAGE_SIZE = 128  # measured against 16 ... 256: benchmarks/results/paged_kv.md


@dataclass(frozen=True)
class PlannedProgram:
    """One program of the compile plan: its name, batch B, chunk T and per-call arguments."""

    program: str
    batch: int
    tokens: int
    args: str  # e.g. "chunk.tokens i32[4,128] chunk.view.table i32[4,16] ..."


def _positive(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise JaxinferError(f"{name} = {value!r} is invalid; it must be an integer >= {minimum}")
    return value


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        tokenizer: Tokenizer,
        placement: Placement,
        *,
        dtype,
        max_seq_len: int,
        name: str = "",
        source: str = "",
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        decode_chunk: int = 64,
        stream_chunk: int = 16,
        compile_cache_size: int | None = None,
        strict: bool = False,
        graph_reuse: bool = True,
        load_ms: float = 0.0,
        place: Callable[..., Placement] | None = None,
        slots: int | None = None,
        kv_cache_tokens: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        spec: SpecConfig | None = None,
        draft: Placement | None = None,
        place_draft: Callable[..., Placement] | None = None,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_seq_len = _positive("max_seq_len", max_seq_len, 2)
        self.name = name
        self.source = source  # e.g. "GGUF (Q8_0, F32)"
        if slots is not None:
            _positive("slots", slots)
        self.slots = slots
        self.decode_chunk = _positive("decode_chunk", decode_chunk)  # most tokens per call
        # Tokens per call while streaming, with stop strings, or serving slots: the host
        # wakes more often there (text to show, strings to find, requests to admit).
        self.stream_chunk = min(_positive("stream_chunk", stream_chunk), decode_chunk)
        self.spec = spec  # speculative decoding: `verify` serves in place of `decode`
        loop = "verify" if spec else "decode"
        self.shapes = ShapePlan.make(prefill_buckets, batch_buckets, slots, max_seq_len, loop)
        self.kv_config = self._kv_config(kv_cache_tokens, page_size)
        plan = len(self.shapes.jobs())
        if compile_cache_size is None:
            compile_cache_size = max(64, plan)
        elif _positive("compile_cache_size", compile_cache_size) < plan:
            raise JaxinferError(
                f"compile_cache_size = {compile_cache_size} is below the {plan} programs of the "
                f"compile plan; pass at least {plan} (or leave it unset)"
            )
        self.strict = strict
        self.compile_cache = CompileCache(capacity=compile_cache_size, reuse=graph_reuse)
        self.executor = Executor(
            placement, cfg=cfg, dtype=dtype, kv_config=self.kv_config,
            tokens_per_call=self.decode_chunk, compile_cache=self.compile_cache,
            spec=spec, draft=draft,
        )  # fmt: skip
        self._place = place  # (layout, devices) -> Placement, for reshard()
        self._place_draft = place_draft
        self._perf = PerfStats(load_ms=load_ms)
        self._scheduler = self._new_scheduler()
        self._warm = False  # warmup() done: strict mode now refuses compiles
        self._requests = 0

    def _kv_config(self, kv_cache_tokens, page_size) -> KVConfig:
        if page_size not in PAGE_SIZES:
            raise JaxinferError(
                f"page_size = {page_size!r} is invalid; use one of "
                f"{', '.join(map(str, PAGE_SIZES))}"
            )
        # A smaller pool is allowed: requests that could never fit are refused at submit.
        default = self.max_seq_len * max(self.slots or 1, 1)
        tokens = default if kv_cache_tokens is None else kv_cache_tokens
        tokens = _positive("kv_cache_tokens", tokens)
        return KVConfig.plan(tokens, self.max_seq_len, page_size, self.shapes.rows)

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            self.executor, self.shapes, self._perf, self._clock,
            decode_chunk=self.decode_chunk, stream_chunk=self.stream_chunk,
            always_interactive=self.slots is not None,
        )  # fmt: skip

    # ---- what the executor holds --------------------------------------------------------

    @property
    def layout(self) -> str:
        return self.executor.layout

    @property
    def mesh(self):
        return self.executor.mesh

    @property
    def runner(self):
        return self.executor.runner

    @property
    def params(self):
        return self.executor.params

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        return self.shapes.chunks

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return self.shapes.batches

    def reshard(self, layout: str | Path = "single", devices=None) -> None:
        """Move the weights and the KV pools to another layout.

        The programs compile again for the new mesh; those recompiles are reported with
        sharding_changed and not counted as same- or changed-shape recompiles.
        """
        if self._place is None:
            raise JaxinferError("this engine was built without a loader; it cannot reshard")
        if not self._scheduler.idle():
            raise JaxinferError("requests are still running; finish or cancel them first")
        self.executor.params = self.executor.kv = self.executor.draft = None  # shards go first
        draft = self._place_draft(layout, devices) if self._place_draft else None
        self.executor.adopt(self._place(layout, devices), draft)
        self._scheduler = self._new_scheduler()
        if self.strict:
            self._warm = False  # new programs are expected until the next warmup()
            self.compile_cache.strict = False

    def _clock(self) -> float:
        """Wall seconds minus compile seconds: phase timings leave compiles out, as
        llama.cpp's do (compiles are reported on their own)."""
        return time.perf_counter() - self.compile_cache.compile_seconds()

    # ---- text ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # ---- requests -----------------------------------------------------------------------

    def _ids(self, prompt, limit: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; pass some text or token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = token_ids("prompt token ids", prompt, self.cfg.vocab_size)
        if not ids:
            raise RequestError("the prompt is empty; pass some text or token ids")
        if len(ids) > limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_seq_len}; "
                "shorten it or load with a larger max_seq_len (-c)"
            )
        return ids

    def _state(self, prompt, max_new_tokens, params, stop, stop_tokens, ignore_eos, stream):
        """A checked request: any bad value raises here, before anything runs."""
        ids = self._ids(prompt, self.max_seq_len - 1)
        bad = not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
        if bad or max_new_tokens < 0:
            raise RequestError(f"max_new_tokens = {max_new_tokens!r} is invalid; it must be >= 0")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise RequestError("stop strings must be non-empty strings")
        stop_ids = token_ids("stop_tokens", list(stop_tokens or []), self.cfg.vocab_size)
        if not ignore_eos:
            stop_ids += [t for t in self.tokenizer.eos_ids if t not in stop_ids]
        seed = self._seed(params, ids)
        state = RequestState(
            prompt=ids,
            params=params,
            seed=seed,
            stop_ids=stop_ids,
            stop_strings=stop_strings,
            budget=min(max_new_tokens, self.max_seq_len - len(ids)),
            decoder=self.tokenizer.stream(context=ids[-4:]),
            sampling=SamplingRows.row(params, seed, stop_ids),
            interactive=stream or bool(stop_strings),
        )
        self._scheduler.check(state)
        return state

    def _seed(self, params: SamplingParams, ids: list[int]) -> int:
        """The request's seed. Without one, a fresh random seed; on several processes every
        process must draw the same, so it comes from the request itself and its number (all
        processes serve the same requests in the same order): a hash of both, folded into
        the int31 range the sampler keys take."""
        self._requests += 1
        if params.seed is not None or jax.process_count() == 1:
            return params.resolved_seed()
        return hash((self._requests, tuple(ids))) % (2**31 - 1)

    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_tokens: Sequence[int] | None = None,
        ignore_eos: bool = False,
        stream: bool = False,
        profile_dir: str | Path | None = None,
    ):
        """Generate from one prompt (text or token ids) or a list of prompts.

        Returns a Result (a list of them for a list of prompts), or with stream=True an
        iterator of StreamPiece for a single prompt. `profile_dir` wraps the call in a jax
        profiler trace written there.
        """
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
        )
        many = isinstance(prompt, list | tuple) and bool(prompt) and not isinstance(prompt[0], int)
        if stream and many:
            raise RequestError("stream=True takes a single prompt; call it once per prompt")
        prompts = list(prompt) if many else [prompt]
        # Every request is checked before any is queued: a bad one changes nothing.
        states = [
            self._state(p, max_new_tokens, params, stop, stop_tokens, ignore_eos, stream)
            for p in prompts
        ]
        requests = [self._queue(s) for s in states]
        if stream:
            return self._stream(requests[0], profile_dir)
        t0 = time.perf_counter()
        try:
            with profile(profile_dir):
                while not all(r.done for r in requests):
                    self.step()
        except BaseException:  # strict mode, an interrupt: this call's requests end here
            for r in requests:
                r.cancel()
            raise
        self._perf.total_ms += (time.perf_counter() - t0) * 1e3
        results = [r.state.result() for r in requests]
        return results if many else results[0]

    def submit(self, prompt, *, stream: bool = False, **sampling) -> Request:
        """Queue one request; it is checked at once, and a bad one raises without disturbing
        the others. `Request.result()`, `.stream()` and `.cancel()` drive or stop it."""
        stop, stop_tokens = sampling.pop("stop", None), sampling.pop("stop_tokens", None)
        max_new_tokens = sampling.pop("max_new_tokens", 128)
        ignore_eos = sampling.pop("ignore_eos", False)
        defaults = SamplingParams()
        unknown = set(sampling) - set(defaults.__dataclass_fields__)
        if unknown:
            raise RequestError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        params = SamplingParams(**{**defaults.__dict__, **sampling})
        state = self._state(prompt, max_new_tokens, params, stop, stop_tokens, ignore_eos, stream)
        return self._queue(state)

    def _queue(self, state: RequestState) -> Request:
        self._scheduler.submit(state)
        return Request(state, self.step, self._scheduler.cancel)

    def step(self, on_pieces: Callable[[], None] | None = None) -> None:
        """One scheduler step: admit, one prompt chunk, one decode call, deliveries.

        Each call's pieces are queued on their requests as soon as it returns; `on_pieces()`
        then runs (a server's engine thread sends them on at once)."""

        def deliver(out) -> None:
            for state, piece in out:
                if piece.text or piece.token_ids or piece.finish_reason:
                    state.pieces.append(piece)
            if on_pieces is not None:
                on_pieces()

        with self._watched():
            self._scheduler.step(deliver)

    def _stream(self, request: Request, profile_dir=None) -> Iterator[StreamPiece]:
        t0 = time.perf_counter()
        with profile(profile_dir):
            yield from request.stream()
        self._perf.total_ms += (time.perf_counter() - t0) * 1e3

    # ---- evaluation ---------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Float32 logits [T, V] at every position of `token_ids` (one full forward; a whole
        context of max_seq_len tokens may be scored)."""
        ids = self._ids(list(token_ids), self.max_seq_len)
        pages, total = self.executor.pages.pages_for(len(ids)), self.kv_config.usable_pages
        if pages > total:
            raise RequestError(
                f"scoring {len(ids)} tokens needs {pages} KV pages but the pool holds {total}; "
                "load with a larger kv_cache_tokens"
            )
        while True:
            with self._watched():
                out = self._scheduler.score(ids)
            if out is not None:
                return out
            self.step()  # the running requests hold the pages: let them move on

    def perf_stats(self) -> PerfStats:
        cc = self.compile_cache
        stats = self._perf.copy()
        stats.eval_device_ms = self.executor.device_ms
        stats.graphs_reused = cc.graphs_reused()
        stats.recompiles_same, stats.recompiles_diff = cc.n_same, cc.n_diff
        stats.recompiles_sharding = cc.n_sharding
        stats.programs = sum(s.compiles for s in cc.stats.values())
        stats.compile_seconds = cc.compile_seconds()
        kv = self.kv_stats()
        stats.kv_pages_in_use, stats.kv_pages_total = kv["pages_in_use"], kv["pages_total"]
        stats.kv_page_size = kv["page_size"]
        stats.kv_bytes_in_use, stats.kv_bytes_allocated = kv["bytes_in_use"], kv["bytes_allocated"]
        if self.spec:
            stats.spec_method, stats.spec_k = self.spec.method, self.spec.k
        return stats

    def kv_stats(self) -> dict:
        """The KV page pool: dtype (kv_cache_dtype), page_size, pages_total, pages_free
        (neither held nor reserved), pages_in_use, pages_reserved, bytes_allocated (every
        layer's pools) and bytes_in_use;
        for hybrid models also the linear layers' state: state_slots (requests at once),
        state_bytes_per_slot (every linear layer's conv and recurrent state, float32) and
        state_bytes_allocated."""
        stats = {"dtype": self.executor.kv_dtype, **self.executor.pages.stats()}
        return {**stats, **self.executor.state_stats()}

    def weight_bytes(self) -> int:
        """Bytes the weights occupy on this process's devices together: a replicated weight
        counts once per device holding it; quantized weights count their blocks."""
        return device_bytes(self.params)

    def activity(self) -> dict:
        """Requests now: running (holding a slot) and queued (waiting for one or for pages)."""
        sched = self._scheduler
        running = sum(a.state is not None for a in sched.running)  # a scoring pass is not one
        return {"running": running, "queued": len(sched.queue)}

    def reset_perf(self) -> None:
        """Zero the timings and graph-reuse counts (compile history is kept)."""
        self._perf = PerfStats(load_ms=self._perf.load_ms)
        self._scheduler.perf = self._perf
        self.executor.device_ms = 0.0
        for s in self.compile_cache.stats.values():
            s.calls = 0

    # ---- graph reuse --------------------------------------------------------------------

    def on_recompile(self, callback: Callable[[RecompileEvent], None]) -> Handle:
        """Call `callback(event)` on every recompile; returns a handle with `.remove()`."""
        return self.compile_cache.on_recompile(callback)

    def compile_plan(self) -> list[PlannedProgram]:
        """Every program serving can call: `warmup()` compiles exactly these."""
        ex = self.executor
        return [
            PlannedProgram(name, B, T, ex.describe(ex.job(name, B, T)))
            for name, B, T in self.shapes.jobs()
        ]

    def warmup(self, *, progress: bool = True) -> dict[str, tuple[int, float]]:
        """Compile the whole plan now, in parallel: {program: (executables, compile seconds)}.

        Afterwards, in strict mode, any further compile raises RecompileError.
        """
        self.compile_cache.strict = False
        ex = self.executor
        jobs = [ex.job(name, B, T) for name, B, T in self.shapes.jobs()]
        done = []

        def on_done(job, seconds):
            done.append(job)
            if progress:
                print(f"\rwarmup [{len(done)}/{len(jobs)}] {job.name} {job.label} "
                      f"{seconds:.2f} s   ", end="", file=sys.stderr, flush=True)  # fmt: skip

        t0 = time.perf_counter()
        with self._watched():
            report = self.compile_cache.compile_planned(jobs, on_done=on_done)
            ex.allocate()
        self._perf.warmup_programs += sum(n for n, _ in report.values())
        self._perf.warmup_seconds += time.perf_counter() - t0
        if progress:
            for name, (n, seconds) in report.items():
                print(f"\nwarmup: {name:8s} {n:3d} programs {seconds:7.2f} s",
                      end="", file=sys.stderr)  # fmt: skip
            print(f"\nwarmup: {len(done)} programs in {time.perf_counter() - t0:.2f} s",
                  file=sys.stderr)  # fmt: skip
        self.compile_cache.strict = self.strict
        self._warm = True
        return report

    @contextlib.contextmanager
    def _watched(self):
        """Attribute the compile events jax.monitoring sees on this thread during an engine
        call to it (a consumer's code between stream pieces is outside)."""
        counts = CompileCounts()
        with watching(counts):
            yield
        self._perf.untracked_compiles += counts.untracked
        self._perf.persistent_hits += counts.persistent_hits
        self._perf.persistent_misses += counts.persistent_misses
        if counts.untracked and self.strict and self._warm:
            raise RecompileError(
                f"strict mode: {counts.untracked} compile(s) outside the compile cache after "
                "warmup (an eager jax op on the host path); rerun with jax_log_compiles to "
                "see them"
            )


def device_bytes(tree) -> int:
    """Bytes a tree of arrays occupies on this process's devices (each replica counted)."""
    leaves = jax.tree.leaves(tree)
    return sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)


def token_ids(what: str, ids, vocab: int) -> list[int]:
    """Integer token ids in [0, vocab), or a RequestError naming `what`."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise RequestError(f"{what} must be integers; got {t!r}")
        out.append(int(t))
    if out and (min(out) < 0 or max(out) >= vocab):
        raise RequestError(f"{what} must lie in [0, {vocab}); got {min(out)}..{max(out)}")
    return out
