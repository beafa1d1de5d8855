"""Engine: owns the parameters, the compiled programs and the KV cache; serves generate().

A batch of prompts is prefilled chunk by chunk (chunk sizes from `prefill_buckets`), then
decoded `decode_chunk` tokens per compiled call. The host wakes once per call to detokenize,
stream and check stop strings. Batch sizes, chunk sizes and cache lengths all come from small
bucket lists, so the set of compiled programs is small and known.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import numpy as np

from .compile import CompileCache, Handle, RecompileError, RecompileEvent
from .config import ModelConfig
from .errors import JaxinferError, RequestError
from .perf import WATCHER, PerfStats
from .profiler import profile
from .request import Row, StreamPiece
from .sampling import PENALTY_WINDOW, SamplingParams, pack, recent_window
from .scheduler import Request, Slots, bucket_for
from .sharding import named
from .steps import Placement, make_steps
from .tokenizer import Tokenizer

DEFAULT_PREFILL_BUCKETS = (32, 128, 512)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
MIN_CACHE = 128  # smallest cache length; lengths double from here up to max_seq_len


def _decode_carry(rows: list[Row], batch: int) -> dict[str, np.ndarray]:
    """The decode loop state for rows entering decode (padding rows start done)."""
    n = len(rows)
    window = np.full((batch, PENALTY_WINDOW), -1, np.int32)
    for b, r in enumerate(rows):
        window[b] = recent_window(r.prompt)
    return {
        "tokens": np.zeros(batch, np.int32),
        "pos": np.array([len(r.prompt) for r in rows] + [0] * (batch - n), np.int32),
        "budget": np.array([r.budget - 1 for r in rows] + [0] * (batch - n), np.int32),
        "done": np.ones(batch, bool),
        "window": window,
    }


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
        compile_cache_size: int = 64,
        strict: bool = False,
        graph_reuse: bool = True,
        load_ms: float = 0.0,
        place: Callable[..., Placement] | None = None,
        slots: int | None = None,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.name = name
        self.source = source  # e.g. "GGUF (Q8_0, F32)"
        self.prefill_buckets = tuple(sorted({min(b, max_seq_len) for b in prefill_buckets}))
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.cache_buckets = self._cache_lengths(max_seq_len)
        self.decode_chunk = decode_chunk  # most tokens one decode call makes (compiled)
        # Tokens per call while streaming, with stop strings, or serving slots: the host
        # wakes more often there (text to show, strings to find, requests to admit).
        self.stream_chunk = min(stream_chunk, decode_chunk)
        self.strict = strict
        self.compile_cache = CompileCache(capacity=compile_cache_size, reuse=graph_reuse)
        # What the programs close over besides their arguments: a change here is a recompile.
        self._static = (cfg, str(np.dtype(dtype)), decode_chunk)
        self._place = place  # (layout, devices) -> Placement, for reshard()
        self._adopt(placement)
        self._perf = PerfStats(load_ms=load_ms)
        self._warm = False  # warmup() done: strict mode now refuses compiles
        self._requests = 0
        bad = not isinstance(slots, int) or isinstance(slots, bool) or slots < 1
        if slots is not None and bad:
            raise JaxinferError(f"slots = {slots!r} is invalid; it must be an integer >= 1")
        self.slots = slots
        self._slots = Slots(self, slots) if slots else None
        self._step_counts: dict[str, int] = {}  # step numbers of the trace annotations

    def _adopt(self, placement: Placement) -> None:
        self.layout = placement.layout
        self.mesh = placement.mesh
        self.rules = dict(placement.rules)
        self.runner = placement.runner
        self.params = placement.params
        self._steps = make_steps(self.runner, self.decode_chunk)
        self._replicated = named(self.mesh)
        self._cache_sharding = self.runner.cache_shardings()
        self._layout = (  # the mesh part of every program key
            self.layout,
            tuple(self.mesh.shape.items()),
            tuple(d.id for d in self.mesh.devices.flat),
            tuple(sorted(self.rules.items())),
        )
        self._cache = None  # the KV cache of the last batch, reused when the shape fits
        self._cache_shape = (0, 0)

    def reshard(self, layout: str | Path = "single", devices=None) -> None:
        """Move the weights (and, from now on, the cache) to another layout.

        The programs compile again for the new mesh; those recompiles are reported with
        sharding_changed and not counted as same- or changed-shape recompiles.
        """
        if self._place is None:
            raise JaxinferError("this engine was built without a loader; it cannot reshard")
        if self._slots is not None and not self._slots.idle():
            raise JaxinferError("requests are still running on the slots; finish or cancel them")
        self.params = None  # let the old shards go before the new ones arrive
        self._cache = None
        self._adopt(self._place(layout, devices))
        if self._slots is not None:  # its cache lived on the old mesh
            self._slots = Slots(self, self._slots.n)
        if self.strict:
            self._warm = False  # new programs are expected until the next warmup()
            self.compile_cache.strict = False

    @staticmethod
    def _cache_lengths(max_seq_len: int) -> tuple[int, ...]:
        lengths, n = [], MIN_CACHE
        while n < max_seq_len:
            lengths.append(n)
            n *= 2
        return (*lengths, max_seq_len)

    # ---- text ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # ---- programs -----------------------------------------------------------------------

    def _put(self, args: tuple) -> tuple:
        """Host arrays go to the device in one transfer before the call, so that every key
        sees device shardings. Arguments without host arrays (parameters, cache) are passed
        on as the same objects."""
        flat = [jax.tree_util.tree_flatten(a) for a in args]
        host = [
            (i, j)
            for i, (leaves, _) in enumerate(flat)
            for j, x in enumerate(leaves)
            if isinstance(x, np.ndarray | np.generic)
        ]
        if not host:
            return args
        placed = jax.device_put([flat[i][0][j] for i, j in host], self._replicated)
        for (i, j), x in zip(host, placed, strict=True):
            flat[i][0][j] = x
        touched = {i for i, _ in host}
        return tuple(
            jax.tree_util.tree_unflatten(flat[i][1], flat[i][0]) if i in touched else a
            for i, a in enumerate(args)
        )

    def _outputs(self, name: str):
        """Output shardings: the cache keeps its layout, everything else is replicated."""
        cache, rep = self._cache_sharding, self._replicated
        outputs = {"cache": cache, "grow": cache, "decode": (cache, rep, rep)}
        return outputs.get(name, (cache, rep))

    def _run(self, name: str, *args, donate=(1,)):
        args = self._put(args)
        program = self.compile_cache.get(
            name, self._steps[name], args, static=self._static, layout=self._layout,
            donate=donate, out=self._outputs(name),
        )  # fmt: skip
        step = self._step_counts[name] = self._step_counts.get(name, -1) + 1
        with jax.profiler.StepTraceAnnotation(name, step_num=step):
            if name != "decode":
                return program(*args)
            t0 = time.perf_counter()  # device time: the executable and its wait, nothing else
            out = jax.block_until_ready(program(*args))
        self._perf.eval_device_ms += (time.perf_counter() - t0) * 1e3
        return out

    def _take_cache(self, batch: int, length: int):
        """A cache of [batch, length]; stale entries need no zeroing since attention masks
        every position past the query."""
        if self._cache is None or self._cache_shape != (batch, length):
            self._cache = None  # free the old one first
            self._cache = self._run("cache", np.zeros((batch, length), np.bool_), donate=())
            self._cache_shape = (batch, length)
        cache, self._cache = self._cache, None
        return cache

    def _clock(self) -> float:
        """Wall seconds minus compile seconds: phase timings leave compiles out, as
        llama.cpp's do (compiles are reported on their own)."""
        return time.perf_counter() - self.compile_cache.compile_seconds()

    def chunk_for(self, remaining: int, cache_length: int) -> int:
        """The prompt chunk for `remaining` tokens: the smallest bucket that holds them, else
        the largest, never longer than the cache (warmup compiles exactly these pairs)."""
        fitting = [b for b in self.prefill_buckets if b <= cache_length]
        return bucket_for(remaining, fitting or self.prefill_buckets[:1])

    def _prefill(self, rows: list[Row], batch: int, cache, cache_length: int):
        """Run every row's prompt through the model; returns the cache and first tokens."""
        longest = max(len(r.prompt) for r in rows)
        window = np.full((batch, PENALTY_WINDOW), -1, np.int32)
        for b, r in enumerate(rows):
            window[b] = recent_window(r.prompt)
        sp = pack(
            [r.params for r in rows], [r.seed for r in rows], [r.stop_ids for r in rows], batch
        )
        (sp,) = self._put((sp,))  # on the device once for every call of this batch
        first = np.zeros(batch, np.int32)
        picks = []  # (rows ending in this chunk, their sampled tokens)
        offset = 0
        while offset < longest:
            T = self.chunk_for(longest - offset, cache_length)
            tokens = np.zeros((batch, T), np.int32)
            lengths = np.zeros(batch, np.int32)
            ending = []
            for b, r in enumerate(rows):
                seg = r.prompt[offset : offset + T]
                tokens[b, : len(seg)] = seg
                lengths[b] = len(seg)
                if seg and offset + T >= len(r.prompt):
                    ending.append(b)
            start = np.full(batch, offset, np.int32)
            cache, sampled = self._run(
                "prefill", self.params, cache, tokens, start, lengths, window, sp
            )
            picks.append((ending, sampled))
            offset += T
        for ending, sampled in picks:
            first[ending] = np.asarray(sampled)[ending]
        return cache, first, sp

    def _generate_batch(
        self, rows: list[Row], streaming: bool
    ) -> Iterator[tuple[int, StreamPiece]]:
        """Prefill and decode one batch, yielding (row index, piece) as text is produced."""
        interactive = streaming or any(r.stop_strings for r in rows)
        batch = bucket_for(len(rows), self.batch_buckets)
        # The last generated token is never fed back, so it needs no cache position.
        need = max(len(r.prompt) + r.budget - 1 for r in rows)
        length = bucket_for(need, self.cache_buckets)
        cache = self._take_cache(batch, length)
        clock = self._clock
        t0 = clock()
        cache, first, sp = self._prefill(rows, batch, cache, length)
        t1 = clock()
        self._perf.prompt_tokens += sum(len(r.prompt) for r in rows)
        self._perf.prompt_ms += (t1 - t0) * 1e3

        done = np.ones(batch, bool)
        for b, r in enumerate(rows):
            yield b, r.accept([int(first[b])])
            done[b] = r.finish is not None
        carry = _decode_carry(rows, batch)
        carry["tokens"][:] = first
        carry["done"][:] = done
        generated = 0
        while not all(r.finish for r in rows):
            n = np.int32(self.stream_chunk if interactive else self.decode_chunk)
            cache, carry, out = self._run("decode", self.params, cache, carry, sp, n)
            out = np.asarray(out)
            host_done = np.asarray(carry["done"]).copy()
            changed = False
            for b, r in enumerate(rows):
                if r.finish:
                    continue
                ids = [int(t) for t in out[b] if t >= 0]
                generated += len(ids)
                yield b, r.accept(ids)
                if r.finish and not host_done[b]:  # a stop string the device cannot see
                    host_done[b] = True
                    changed = True
            if changed:
                carry = {k: np.asarray(v) for k, v in carry.items()}
                carry["done"] = host_done
        self._cache = cache
        t2 = clock()
        self._perf.eval_tokens += generated
        self._perf.eval_ms += (t2 - t1) * 1e3
        for r in rows:
            r.prompt_ms, r.decode_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3

    # ---- requests -----------------------------------------------------------------------

    def _row(self, prompt, max_new_tokens, params, stop, stop_tokens, ignore_eos) -> Row:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; pass some text or token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if any(t < 0 or t >= self.cfg.vocab_size for t in ids):
                raise RequestError(
                    f"prompt token ids must lie in [0, {self.cfg.vocab_size}); got "
                    f"{min(ids)}..{max(ids)}"
                )
        if not ids:
            raise RequestError("the prompt is empty; pass some text or token ids")
        if len(ids) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_seq_len}; "
                "shorten it or load with a larger max_seq_len (-c)"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise RequestError(f"max_new_tokens = {max_new_tokens!r} is invalid; it must be >= 0")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise RequestError("stop strings must be non-empty strings")
        stop_ids = list(stop_tokens or [])
        if not ignore_eos:
            stop_ids += [t for t in self.tokenizer.eos_ids if t not in stop_ids]
        return Row(
            prompt=ids,
            params=params,
            seed=self._seed(params, ids),
            stop_ids=stop_ids,
            stop_strings=stop_strings,
            budget=min(max_new_tokens, self.max_seq_len - len(ids)),
            decoder=self.tokenizer.stream(context=ids[-4:]),
        )

    def _seed(self, params: SamplingParams, ids: list[int]) -> int:
        """The request's seed. Without one, a fresh random seed; on several processes every
        process must draw the same, so it comes from the request itself and its number (all
        processes serve the same requests in the same order)."""
        self._requests += 1
        if params.seed is not None or jax.process_count() == 1:
            return params.resolved_seed()
        return (self._requests * 1_000_003 + sum(ids) * 7919 + len(ids)) % (2**31 - 1)

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
        prompts = list(prompt) if many else [prompt]
        # Every request is checked before any device work: a bad one changes nothing.
        rows = [
            self._row(p, max_new_tokens, params, stop, stop_tokens, ignore_eos) for p in prompts
        ]
        if stream and many:
            raise RequestError("stream=True takes a single prompt; call it once per prompt")
        if self.slots:  # loaded with slots: every request goes through them
            requests = [self._slots.submit(r) for r in rows]
            if stream:
                return self._stream_request(requests[0], profile_dir)
            t0 = time.perf_counter()
            with profile(profile_dir), self._watched():
                while not all(q.done for q in requests):
                    self._slots.step()
            self._perf.total_ms += (time.perf_counter() - t0) * 1e3
            results = [r.result() for r in rows]
            return results if many else results[0]
        if stream:
            return self._stream(rows[0], profile_dir)
        with profile(profile_dir):
            self._drive(rows)
        results = [r.result() for r in rows]
        return results if many else results[0]

    def submit(self, prompt, **sampling) -> Request:
        """Queue one request on the slots (continuous batching); it is checked at once, and a
        bad one raises without disturbing the others. `Request.result()`, `.stream()` and
        `.cancel()` drive or stop it. Engines loaded without `slots` get one slot here
        (generate() keeps its batch path there)."""
        if self._slots is None:
            self._slots = Slots(self, 1)
        stop, stop_tokens = sampling.pop("stop", None), sampling.pop("stop_tokens", None)
        max_new_tokens = sampling.pop("max_new_tokens", 128)
        ignore_eos = sampling.pop("ignore_eos", False)
        defaults = SamplingParams()
        unknown = set(sampling) - set(defaults.__dataclass_fields__)
        if unknown:
            raise RequestError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        params = SamplingParams(**{**defaults.__dict__, **sampling})
        row = self._row(prompt, max_new_tokens, params, stop, stop_tokens, ignore_eos)
        return self._slots.submit(row)

    def step(self) -> None:
        """One scheduling step of the slots (admit, one prefill chunk, one decode call)."""
        if self._slots is not None:
            with self._watched():
                self._slots.step()

    def _stream_request(self, request: Request, profile_dir=None) -> Iterator[StreamPiece]:
        with profile(profile_dir), self._watched():
            yield from request.stream()

    def _stream(self, row: Row, profile_dir=None) -> Iterator[StreamPiece]:
        t0 = time.perf_counter()
        with profile(profile_dir), self._watched():
            for _, piece in self._batches([row], streaming=True):
                if piece.text or piece.token_ids:
                    yield piece
        self._perf.total_ms += (time.perf_counter() - t0) * 1e3

    def _drive(self, rows: list[Row]) -> None:
        t0 = time.perf_counter()
        with self._watched():
            for _ in self._batches(rows):
                pass
        self._perf.total_ms += (time.perf_counter() - t0) * 1e3

    def _batches(
        self, rows: list[Row], streaming: bool = False
    ) -> Iterator[tuple[int, StreamPiece]]:
        """Serve rows in batches of at most the largest batch bucket."""
        live = [r for r in rows if r.budget > 0]
        for r in rows:
            if r.budget <= 0:
                r.finish = "length"
        step = self.batch_buckets[-1]
        for i in range(0, len(live), step):
            yield from self._generate_batch(live[i : i + step], streaming)

    # ---- evaluation ---------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Float32 logits [T, V] at every position of `token_ids` (one full forward)."""
        row = self._row(list(token_ids), 0, SamplingParams(), None, None, True)
        with self._watched():
            return self._score(row.prompt)

    def _score(self, ids: list[int]) -> np.ndarray:
        length = bucket_for(len(ids), self.cache_buckets)
        cache = self._take_cache(1, length)
        out = []
        offset = 0
        while offset < len(ids):
            T = self.chunk_for(len(ids) - offset, length)
            tokens = np.zeros((1, T), np.int32)
            seg = ids[offset : offset + T]
            tokens[0, : len(seg)] = seg
            start = np.array([offset], np.int32)
            cache, logits = self._run("score", self.params, cache, tokens, start)
            out.append(np.asarray(logits)[0, : len(seg)])
            offset += T
        self._cache = cache
        return np.concatenate(out, axis=0)

    def perf_stats(self) -> PerfStats:
        cc = self.compile_cache
        stats = self._perf.copy()
        stats.graphs_reused = cc.graphs_reused()
        stats.recompiles_same, stats.recompiles_diff = cc.n_same, cc.n_diff
        stats.recompiles_sharding = cc.n_sharding
        stats.programs = sum(s.compiles for s in cc.stats.values())
        stats.compile_seconds = cc.compile_seconds()
        return stats

    def reset_perf(self) -> None:
        """Zero the timings and graph-reuse counts (compile history is kept)."""
        self._perf = PerfStats(load_ms=self._perf.load_ms)
        for s in self.compile_cache.stats.values():
            s.calls = 0

    # ---- graph reuse --------------------------------------------------------------------

    def on_recompile(self, callback: Callable[[RecompileEvent], None]) -> Handle:
        """Call `callback(event)` on every recompile; returns a handle with `.remove()`."""
        return self.compile_cache.on_recompile(callback)

    def warmup(self, *, progress: bool = True) -> dict[str, tuple[int, float]]:
        """Compile every declared bucket now: {program: (executables, compile seconds)}.

        Afterwards, in strict mode, any further compile raises RecompileError.
        """
        self.compile_cache.strict = False
        jobs = []
        for S in self.cache_buckets:
            if not self.slots:  # the batch path (with slots, generate() uses the slots)
                for B in self.batch_buckets:
                    jobs.append(("cache", B, 0, S))
                    jobs.append(("decode", B, 0, S))
                    jobs += [("prefill", B, T, S) for T in self._chunks(S)]
            jobs += [("score", 1, T, S) for T in self._chunks(S)]
            if self.slots:
                N = self.slots
                jobs += [("cache", N, 0, S), ("decode", N, 0, S)]
                jobs += [("prefill_slot", N, T, S) for T in self._chunks(S)]
                if S != self.cache_buckets[-1]:
                    jobs.append(("grow", N, 0, S))
        jobs = list(dict.fromkeys(jobs))  # the slot programs may repeat a batch bucket's
        before = {k: (v.compiles, v.compile_seconds) for k, v in self.compile_cache.stats.items()}
        with self._watched():
            for i, (name, B, T, S) in enumerate(jobs):
                if progress:
                    print(f"\rwarmup [{i + 1}/{len(jobs)}] {name} B={B} T={T} S={S}   ",
                          end="", file=sys.stderr, flush=True)  # fmt: skip
                args = self._abstract_args(name, B, T, S)
                donate = {"cache": (), "grow": ()}.get(name, (1,))
                self.compile_cache.get(
                    name, self._steps[name], args, static=self._static,
                    layout=self._layout, donate=donate, out=self._outputs(name),
                )  # fmt: skip
        report = {}
        for name, st in self.compile_cache.stats.items():
            n0, s0 = before.get(name, (0, 0.0))
            report[name] = (st.compiles - n0, st.compile_seconds - s0)
            if progress:
                print(f"\nwarmup: {name:8s} {st.compiles - n0:3d} programs "
                      f"{st.compile_seconds - s0:7.2f} s", end="", file=sys.stderr)  # fmt: skip
        if progress:
            print(file=sys.stderr)
        self.compile_cache.strict = self.strict
        self._warm = True
        return report

    def _chunks(self, S: int) -> list[int]:
        """Every chunk length `chunk_for` can pick with a cache of S positions."""
        return sorted({self.chunk_for(T, S) for T in self.prefill_buckets})

    def _abstract_args(self, name: str, B: int, T: int, S: int) -> tuple:
        """ShapeDtypeStructs of a program's arguments, as `_run` would pass them."""

        def spec(shape, dtype, sharding=self._replicated):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        def like(tree):
            return jax.tree.map(lambda x: spec(x.shape, x.dtype), tree)

        if name == "cache":
            return (spec((B, S), np.bool_),)
        shapes = jax.eval_shape(lambda: self.runner.init_cache(B, S))
        cache = jax.tree.map(lambda x, sh: spec(x.shape, x.dtype, sh), shapes, self._cache_sharding)
        if name == "grow":  # to the next cache length
            nxt = self.cache_buckets[self.cache_buckets.index(S) + 1]
            return (cache, spec((nxt,), np.bool_))
        if name == "prefill_slot":
            one = (spec((1, T), np.int32), spec((1,), np.int32), spec((1,), np.int32))
            window = spec((1, PENALTY_WINDOW), np.int32)
            return (self.params, cache, spec((), np.int32), *one, window, like(pack([], [], [], 1)))
        sp = like(pack([], [], [], B))
        if name == "decode":
            carry = like(_decode_carry([], B))
            return (self.params, cache, carry, sp, spec((), np.int32))
        tokens, start = spec((B, T), np.int32), spec((B,), np.int32)
        if name == "score":
            return (self.params, cache, tokens, start)
        window = spec((B, PENALTY_WINDOW), np.int32)
        return (self.params, cache, tokens, start, spec((B,), np.int32), window, sp)

    @contextlib.contextmanager
    def _watched(self):
        """Attribute the compile events jax.monitoring sees during an engine call to it."""
        base = WATCHER.snapshot()
        try:
            yield
        finally:
            now = WATCHER.snapshot()
            untracked = now[0] - base[0]
            self._perf.untracked_compiles += untracked
            self._perf.persistent_hits += now[1] - base[1]
            self._perf.persistent_misses += now[2] - base[2]
        if untracked and self.strict and self._warm:
            raise RecompileError(
                f"strict mode: {untracked} compile(s) outside the compile cache after warmup "
                "(an eager jax op on the host path); rerun with jax_log_compiles to see them"
            )
