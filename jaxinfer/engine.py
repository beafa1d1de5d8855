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
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .errors import JaxinferError, RecompileError, RequestError
from .formats.tokenizer import Tokenizer
from .model.gdn import RecurrentState
from .ops.sampling import SamplingRows
from .options import MAX_LOGPROBS, POOLING, EngineOptions, SamplingParams
from .parallel.placement import Placement
from .runtime.buckets import ShapePlan
from .runtime.compile import CompileCache, CompileCounts, Handle, RecompileEvent, watching
from .runtime.executor import Executor, cache_bytes
from .runtime.fit import FitPlan, trim_heap
from .runtime.host_cache import copy_buckets
from .runtime.kv import KVManager
from .runtime.lockstep import Follower, Leader
from .runtime.perf import PerfStats
from .runtime.profiler import profile
from .runtime.reasoning import Reasoning, Thoughts
from .runtime.request import Request, RequestState, StreamPiece, TokenLogprob
from .runtime.scheduler import Scheduler
from .runtime.speculative import SpecConfig
from .runtime.store import ExecutableStore
from .runtime.structured import Constraint, Vocabulary, grammar_key


@dataclass(frozen=True)
class PlannedProgram:
    """One program of the compile plan: its name, batch B, chunk T, per-call arguments, what
    it serves, and how its executable came (so far)."""

    program: str
    batch: int
    tokens: int
    args: str  # e.g. "chunk.tokens i32[4,128] chunk.view.table i32[4,16] ..."
    why: str = ""  # e.g. "prompt chunks of up to 128 tokens for 4 row(s) (4x128 <= 512)"
    source: str = ""  # "compiled", "loaded" (from the executable store) or "" (not yet)


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        tokenizer: Tokenizer,
        placement: Placement,
        options: EngineOptions | None = None,
        *,
        name: str = "",
        source: str = "",
        load_ms: float = 0.0,
        place: Callable[..., Placement] | None = None,
        spec: SpecConfig | None = None,
        draft: Placement | None = None,
        place_draft: Callable[..., Placement] | None = None,
        store: ExecutableStore | None = None,
    ):
        """An engine over a placed model; `load()` builds one. `options` are the serving
        options (checked when made); `place(layout, devices)` re-places the model for
        reshard(), `place_draft` the draft model; `store` holds executables of earlier
        processes."""
        o = self.options = options or EngineOptions()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dtype = jnp.dtype(o.dtype)
        self.max_seq_len = o.max_seq_len or cfg.max_position
        self.name = name
        self.source = source  # e.g. "GGUF (Q8_0, F32)"
        self.slots = o.slots
        self.decode_chunk = o.decode_chunk  # most tokens per call
        # Tokens per call while streaming, with stop strings, or serving slots: the host
        # wakes more often there (text to show, strings to find, requests to admit).
        self.stream_chunk = min(o.stream_chunk, o.decode_chunk)
        self.spec = spec  # speculative decoding: `verify` serves in place of `decode`
        # n-gram speculation also plans plain decode, for calls where no row drafts
        loops = ("decode",) if not spec else ("verify",) + ("decode",) * (spec.method == "ngram")
        # Pooled passes (embeddings, rerank): several texts a call, one on linear layers.
        pool = 1 if carries_state(placement, draft) else o.slots or max(o.batch_buckets)
        self.shapes = ShapePlan.make(
            o.prefill_buckets, o.batch_buckets, o.slots, self.max_seq_len, loops,
            pool if o.embeddings else 0,
        )  # fmt: skip
        # A smaller pool is allowed: requests that could never fit are refused at submit.
        tokens = o.kv_cache_tokens or self.max_seq_len * max(o.slots or 1, 1)
        page_bytes, state_bytes = cache_bytes(placement, draft, o.page_size)
        self._carries_state = carries_state(placement, draft)
        self.kv_config = KVManager.plan(
            tokens, self.max_seq_len, o.page_size, self.shapes.rows,
            snapshots=o.prefix_snapshots if o.prefix_cache else 0,
            carries_state=self._carries_state, page_bytes=page_bytes, state_bytes=state_bytes,
        )  # fmt: skip
        # Chain hashes start from the model's identity (and each request's cache salt).
        caches = placement.runner.caches  # their dtypes ("auto" resolved at load)
        self.model_id = repr((name, source, cfg, o.dtype, caches, o.activations))
        # The host tier's copy programs, per page-count bucket (none without a tier).
        tiered = KVManager.tiered(
            self.kv_config, o.prefix_cache, o.cache_ram_mib * 2**20,
            placement.runner.mtp is not None, self._carries_state,
        )  # fmt: skip
        self._copies = copy_buckets(self.kv_config.usable_pages) if tiered else ()
        plan = len(self._jobs())
        if o.compile_cache_size is not None and o.compile_cache_size < plan:
            raise JaxinferError(
                f"compile_cache_size = {o.compile_cache_size} is below the {plan} programs of "
                f"the compile plan; pass at least {plan} (or leave it unset)"
            )
        self.strict = o.strict
        self.compile_cache = CompileCache(
            capacity=o.compile_cache_size or max(64, plan), reuse=o.graph_reuse, store=store
        )
        self.executor = Executor(
            placement, cfg=cfg, dtype=self.dtype, kv_config=self.kv_config,
            decode_chunk=self.decode_chunk, compile_cache=self.compile_cache,
            spec=spec, draft=draft, sample_rows=self.shapes.sample_rows,
        )  # fmt: skip
        self._place = place  # (layout, devices) -> Placement, for reshard()
        self._place_draft = place_draft
        self._perf = PerfStats(load_ms=load_ms)
        self._scheduler = self._new_scheduler()
        self._warm = False  # warmup() done: strict mode now refuses compiles
        self._requests = 0
        # the tokens' bytes, for grammars and logprobs (llguidance's view, built on first use)
        self.vocabulary = Vocabulary(tokenizer, cfg.vocab_size)
        self.fit_plan: FitPlan | None = None  # load(fit=True): the memory plan it chose

    def _new_scheduler(self) -> Scheduler:
        """A scheduler over a new, empty KV pool (`self.kv`) for the executor's layout."""
        self.kv = KVManager(
            self.kv_config, self.executor.page_bytes, prefix_cache=self.options.prefix_cache,
            model_id=self.model_id, mtp=self.executor.runner.mtp is not None,
            carries_state=self._carries_state, host_bytes=self.options.cache_ram_mib * 2**20,
        )  # fmt: skip
        return Scheduler(
            self.executor, self.kv, self.shapes, self._perf, self._clock,
            decode_chunk=self.decode_chunk, stream_chunk=self.stream_chunk,
            always_interactive=self.slots is not None,
            time_slice=self.options.time_slice_ms / 1e3,
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
        if self.executor.lockstep:
            raise JaxinferError("an engine serving a process group cannot reshard")
        self.executor.params = self.executor.kv = self.executor.draft = None  # shards go first
        draft = self._place_draft(layout, devices) if self._place_draft else None
        self.executor.adopt(self._place(layout, devices), draft)
        self._scheduler = self._new_scheduler()
        if self.strict:
            self._warm = False  # new programs are expected until the next warmup()
            self.compile_cache.strict = False

    # ---- a process group (jax.distributed) ----------------------------------------------

    def lead(self, leader: Leader) -> None:
        """Lead a process group (process 0; `lockstep.connect` made `leader`): from now on
        every device call reaches the followers first, so any code may drive this engine as
        it would on one process. Call it idle, after warmup (each process warms up alone)."""
        if not self._scheduler.idle():
            raise JaxinferError("requests are still running; lead the group before any")
        self.executor.lockstep = leader
        self._scheduler = self._new_scheduler()  # no device array from before the group

    def follow(self, follower: Follower):
        """Follow a process group's leader (`lockstep.connect` made `follower`): run the device
        calls it sends, in order, until it stops the group (None) or moves to another engine
        (what it said of that one: Follower.serve)."""
        follower.executor = self.executor
        with self._watched():
            return follower.serve()

    def _clock(self) -> float:
        """Wall seconds minus the seconds spent compiling and loading executables: phase
        timings leave them out, as llama.cpp's leave setup out (they are reported apart)."""
        return time.perf_counter() - self.compile_cache.setup_seconds()

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

    def _state(
        self, prompt, params: SamplingParams, stream: bool, constraint: Constraint | None = None,
        reasoning: Reasoning | None = None,
    ) -> RequestState:  # fmt: skip
        """A checked request: any bad value raises here, before anything runs."""
        ids = self._ids(prompt, self.max_seq_len - 1)
        stop_ids = token_ids("stop_tokens", list(params.stop_tokens), self.cfg.vocab_size)
        kept = token_ids("preserved_tokens", list(params.preserved_tokens), self.cfg.vocab_size)
        if not params.ignore_eos:
            stop_ids += [t for t in self.tokenizer.eos_ids if t not in stop_ids]
        seed = self._seed(params, ids)
        thoughts = self._thoughts(reasoning, params)
        guided = thoughts is not None and thoughts.guides  # no drafts: its tokens are counted
        state = RequestState(
            prompt=ids,
            params=params,
            seed=seed,
            stop_ids=stop_ids,
            stop_strings=list(params.stop),
            budget=min(params.max_new_tokens, self.max_seq_len - len(ids)),
            decoder=self.tokenizer.stream(context=ids[-4:], keep=kept),
            sampling=SamplingRows.row(params, seed, stop_ids, guided),
            interactive=stream or bool(params.stop),
            constraint=self._constraint(params, constraint),
            thoughts=thoughts,
            logprobs=None if params.logprobs is None else [],
        )
        self._scheduler.check(state)
        if state.constraint is not None:
            state.constraint.taken = True
        return state

    def _thoughts(self, reasoning: Reasoning | None, params: SamplingParams) -> Thoughts | None:
        """What follows a request's reasoning: where a budget bounds it, or a grammar waits
        for its end. A grammar holds from the first token unless the prompt opened the
        reasoning (llama.cpp's rule): an answer that may or may not think has no grammar
        that could tell."""
        if reasoning is None or (params.constrained and not reasoning.opened):
            return None
        end = self.tokenizer.encode(reasoning.end)
        if self.tokenizer.add_bos and end[:1] == [self.tokenizer.bos_id]:
            end = end[1:]
        return Thoughts(reasoning, end, self.cfg.vocab_size)

    def _constraint(self, params: SamplingParams, given: Constraint | None) -> Constraint | None:
        """The request's matcher: `given` (checked) or a new one."""
        if given is None:
            return Constraint.of(self.vocabulary, params)
        if given.vocabulary is not self.vocabulary or given.key != grammar_key(params):
            raise RequestError(
                "the constraint was compiled for another grammar or engine; pass "
                "constraint=engine.constraint(sampling) of this request's sampling"
            )
        if given.taken:
            raise RequestError("the constraint already serves a request; pass its .copy()")
        return given

    def _seed(self, params: SamplingParams, ids: list[int]) -> int:
        """The request's seed. Without one, a fresh random seed; on several processes every
        process must draw the same, so it comes from the request itself and its number (all
        processes serve the same requests in the same order): a hash of both, folded into
        the int31 range the sampler keys take."""
        self._requests += 1
        if params.seed is not None or jax.process_count() == 1 or self.executor.lockstep:
            return params.resolved_seed()
        return hash((self._requests, tuple(ids))) % (2**31 - 1)

    def generate(
        self,
        prompt,
        *,
        sampling: SamplingParams | None = None,
        stream: bool = False,
        profile_dir: str | Path | None = None,
        **overrides,
    ):
        """Generate from one prompt (text or token ids) or a list of prompts.

        Sampling comes from `sampling` (a SamplingParams) or from keywords named like its
        fields (`max_new_tokens=32, temperature=0`), the rest keeping SamplingParams'
        defaults. Returns a Result (a list of them for a list of prompts), or with stream=True
        an iterator of StreamPiece for a single prompt. `profile_dir` wraps the call in a jax
        profiler trace written there.
        """
        params = SamplingParams.make(sampling, **overrides)
        many = isinstance(prompt, list | tuple) and bool(prompt) and not isinstance(prompt[0], int)
        if stream and many:
            raise RequestError("stream=True takes a single prompt; call it once per prompt")
        prompts = list(prompt) if many else [prompt]
        # Every request is checked before any is queued: a bad one changes nothing. A grammar
        # compiles once (seconds for a large schema), each prompt following a copy.
        grammar = self.constraint(params)
        states = [
            self._state(p, params, stream, None if grammar is None else grammar.copy())
            for p in prompts
        ]
        batch = object()  # one client: its prompts share the rows and never preempt each other
        for state in states:
            state.group = batch
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

    def submit(
        self,
        prompt,
        *,
        sampling: SamplingParams | None = None,
        stream: bool = False,
        constraint: Constraint | None = None,
        group: object = None,
        reasoning: Reasoning | None = None,
        **overrides,
    ) -> Request:
        """Queue one request (sampling as in `generate`); it is checked at once, and a bad one
        raises without disturbing the others. `Request.result()`, `.stream()` and `.cancel()`
        drive or stop it.

        A constrained request (json_schema, grammar or regex) compiles its grammar here,
        unless `constraint` brings it compiled: one that `constraint(sampling)` made for the
        same grammar, one per request (give each the `.copy()` of one compiled once).
        Requests given one `group` (a server job's choices) share the slots as one client: a
        free slot goes to the queued request whose group runs the fewest, oldest first, and
        with every slot busy a request of a group that runs fewer takes the slot of one that
        has decoded for its time slice (EngineOptions.time_slice_ms), which resumes later."""
        params = SamplingParams.make(sampling, **overrides)
        state = self._state(prompt, params, stream, constraint, reasoning)
        state.group = group
        return self._queue(state)

    def constraint(self, sampling: SamplingParams) -> Constraint | None:
        """The compiled grammar of `sampling` (None without json_schema, grammar or regex)
        for `submit(constraint=...)`; a bad one is a RequestError. It reads only the
        vocabulary (built once, under a lock), so another thread may compile it while this
        one drives the engine."""
        return Constraint.of(self.vocabulary, sampling)

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

    def logits(
        self, token_ids: Sequence[int], *, prefix_cache: bool = False, cache_salt=None
    ) -> np.ndarray:
        """Float32 logits [T, V] at every position of `token_ids` (one full forward; a whole
        context of max_seq_len tokens may be scored). With `prefix_cache`, the forward starts
        after the longest prefix the cache holds (under `cache_salt`), whose rows are NaN."""
        ids = self._ids(list(token_ids), self.max_seq_len)
        return self._drive(self._scoring(ids, cached=prefix_cache, salt=cache_salt))

    def prompt_logprobs(self, token_ids: Sequence[int], k: int = 0) -> list:
        """Log-probabilities of each prompt token after the ones before it (None for the
        first), with the k best at its position (TokenLogprob, as generated tokens carry):
        the float32 log-softmax of the scoring pass's raw logits, taken per chunk on the
        device, which returns each token's and the MAX_LOGPROBS best (the host holds O(T),
        never the [T, V] logits; any k compiles nothing)."""
        return self._drive(self.prompt_logprobs_steps(token_ids, k))

    def prompt_logprobs_steps(self, token_ids: Sequence[int], k: int = 0):
        """`prompt_logprobs` as a generator, for a server that runs steps between its chunks:
        each next() runs one prompt chunk (False), or finds the pool short of pages (True:
        step the running requests); its return value is prompt_logprobs'. One at a time."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise RequestError(f"k = {k!r} is invalid; it must be an integer in 0..{MAX_LOGPROBS}")
        ids = self._ids(list(token_ids), self.max_seq_len)
        lp = yield from self._scoring(ids, logprobs=True)  # Logprobs [T - 1] of ids[1:]
        tops = zip(lp.ids[:, :k].tolist(), lp.values[:, :k].tolist(), strict=True)
        out: list = [None]
        for i, value, (best, values) in zip(ids[1:], lp.token.tolist(), tops, strict=True):
            out.append(TokenLogprob(i, value, tuple(zip(best, values, strict=True))))
        return out

    def _scoring(self, ids: list[int], **how):
        """Scheduler.scoring of checked `ids` (`how`: its options), its compiles watched."""
        self.kv.check(len(ids), f"scoring {len(ids)} tokens", "load with a larger kv_cache_tokens")
        chunks = self._scheduler.scoring(ids, **how)
        while True:
            with self._watched():
                try:
                    waiting = next(chunks)
                except StopIteration as done:
                    return done.value
            yield waiting

    def _drive(self, steps):
        """Run a scoring generator to its value, stepping the running requests while they
        hold the pages it needs."""
        while True:
            try:
                waiting = next(steps)
            except StopIteration as done:
                return done.value
            if waiting:
                self.step()

    # ---- embeddings and rerank ----------------------------------------------------------

    def embed(self, texts, pooling: str = "last") -> np.ndarray:
        """Float32 [len(texts), d_model]: each text's final-normed hidden states (the output
        of the model's last norm, before the LM head) pooled ("last": at its last token, as
        Qwen3-Embedding wants; "mean": their average; "cls": at its first token) and
        L2-normalized. A text is a string (encoded with the EOS its tokenizer's metadata
        appends, add_eos_token) or token ids (taken as given); one string is one text. A
        prefill-only pass over prompt chunks (the `pool` programs: several texts a call,
        one at a time on linear layers), whose KV pages are given back as each text ends."""
        return self._drive(self.embed_steps(texts, pooling))

    def embed_steps(self, texts, pooling: str = "last"):
        """`embed` as a generator of calls (as `prompt_logprobs_steps`)."""
        if pooling not in POOLING:
            raise RequestError(f"pooling {pooling!r} is invalid; use one of {', '.join(POOLING)}")
        ids = self._texts(texts, add_eos=True)
        pooled, _ = yield from self._pooling(ids, (0, 0))  # [N, 3, D]: last, sum, first
        lengths = np.array([len(t) for t in ids], np.float64)[:, None]
        vectors = {"last": pooled[:, 0], "mean": pooled[:, 1] / lengths, "cls": pooled[:, 2]}
        v = vectors[pooling].astype(np.float64)
        norm = np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return (v / norm).astype(np.float32)

    def yes_probability(self, prompts, yes: int, no: int) -> np.ndarray:
        """Float32 [len(prompts)]: P(yes) after each prompt, the softmax over the logits of
        the tokens `yes` and `no` at its last position (how Qwen3-Reranker scores a query and
        document written into its template). Prompts as `embed`'s texts, strings without
        EOS; the same pooled pass."""
        return self._drive(self.yes_probability_steps(prompts, yes, no))

    def yes_probability_steps(self, prompts, yes: int, no: int):
        """`yes_probability` as a generator of calls (as `prompt_logprobs_steps`)."""
        pick = token_ids("the yes and no tokens", [yes, no], self.cfg.vocab_size)
        ids = self._texts(prompts, add_eos=False)
        _, picked = yield from self._pooling(ids, pick)  # [N, 2] float32 logits
        odds = picked[:, 1].astype(np.float64) - picked[:, 0]  # no - yes
        return (1.0 / (1.0 + np.exp(odds))).astype(np.float32)

    def _texts(self, texts, add_eos: bool) -> list[list[int]]:
        """Checked ids of a text or a list of them (strings or token ids), each within the
        context and the KV pool."""
        if isinstance(texts, str) or (
            isinstance(texts, list | tuple) and texts and isinstance(texts[0], int | np.integer)
        ):
            texts = [texts]  # one text
        if not isinstance(texts, list | tuple) or not texts:
            raise RequestError("texts must be a string, token ids or a non-empty list of them")
        out = []
        for text in texts:
            if isinstance(text, str) and text:
                text = self.tokenizer.encode(text, add_eos=add_eos)
            ids = self._ids(text, self.max_seq_len)
            self.kv.check(len(ids), f"a text of {len(ids)} tokens", "load with a larger "
                          "kv_cache_tokens")  # fmt: skip
            out.append(ids)
        return out

    def _pooling(self, texts: list[list[int]], pick):
        """Scheduler.pooling of checked texts, its compiles watched (as `_scoring`)."""
        steps = self._scheduler.pooling(texts, pick)
        while True:
            with self._watched():
                try:
                    waiting = next(steps)
                except StopIteration as done:
                    return done.value
            yield waiting

    def perf_stats(self) -> PerfStats:
        cc = self.compile_cache
        stats = self._perf.copy()
        stats.eval_device_ms = self.executor.device_ms
        stats.graphs_reused = cc.graphs_reused()
        stats.recompiles_same, stats.recompiles_diff = cc.n_same, cc.n_diff
        stats.recompiles_sharding = cc.n_sharding
        stats.programs = sum(s.compiles for s in cc.stats.values())
        stats.compile_seconds = cc.compile_seconds()
        stats.loaded = cc.loaded()
        stats.load_seconds = sum(s.load_seconds for s in cc.stats.values())
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
        state_bytes_allocated.
        The prefix cache: cached_pages (pages no request holds, kept findable; they count in
        pages_free), prefix_queries and prefix_hits (prompt tokens looked up, and found), and
        for hybrid models the linear layers' state snapshots at page ends: snapshots_total,
        snapshots_in_use (being written, or read by a request about to start from one),
        snapshots_cached and snapshot_bytes.
        The host tier (cache_ram_mib; zeros without one): host_bytes (the page contents and
        states it holds, in host memory), host_capacity, host_pages, host_hits (prompt tokens
        it served; they count in prefix_hits too) and host_evictions (entries dropped for
        room)."""
        return {"dtype": self.executor.kv_dtype, **self.kv.stats(), **self.executor.state_stats()}

    def slot_requests(self) -> list[dict]:
        """The running requests (llama-server's /slots): each one's slot (0-based), prompt
        ids, tokens generated, tokens it may still generate (remaining) and SamplingParams."""
        return [
            {"slot": a.state_index - 1,  # state indices count from 1: 0 is the padding rows'
             "prompt": list(s.prompt), "generated": len(s.token_ids),
             "remaining": s.budget - len(s.token_ids), "params": s.params}
            for a in self._scheduler.running if (s := a.state) is not None
        ]  # fmt: skip

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, the host tier's too (running requests keep their
        pages)."""
        self.kv.clear()

    def weight_bytes(self) -> int:
        """Bytes the weights occupy on this process's devices together: a replicated weight
        counts once per device holding it; quantized weights count their blocks."""
        return device_bytes(self.params)

    def memory(self) -> dict[str, int | None]:
        """Bytes on this process's devices: weights (weight_bytes), kv_pool (the KV pages),
        linear_state (the hybrid layers' per-request states), snapshots (their prefix-cache
        snapshots), temporaries (the most any program of the plan needs besides its arguments
        and outputs, from XLA's memory_analysis() of the executables this engine has, with
        what the executable store holds loaded first; None when it has none) and total; and
        programs: how many of the plan's programs the temporaries cover."""
        ex, kv = self.executor, self.kv_stats()
        jobs = [ex.job(name, B, T) for name, B, T in self._jobs()]
        have = self.compile_cache.restore_planned(jobs)
        temps = [
            c.memory_analysis().temp_size_in_bytes
            for name in {job.name for job in jobs}
            for c in self.compile_cache.executables(name)
        ]
        out = {
            "weights": self.weight_bytes(),
            "kv_pool": kv["bytes_allocated"],
            "linear_state": kv.get("state_bytes_allocated", 0),
            "snapshots": kv.get("snapshot_bytes", 0),
            "temporaries": max(temps) if temps else None,
        }
        return {**out, "total": sum(v or 0 for v in out.values()), "programs": have}

    def temporaries(self) -> int:
        """The most temporary bytes a program of the plan needs besides its arguments and
        outputs (XLA's memory_analysis()); the plan is compiled now where the compile cache
        and the store lack it (warmup then finds it done), the KV pools not yet allocated."""
        jobs = [self.executor.job(name, B, T) for name, B, T in self._jobs()]
        self.compile_cache.compile_planned(jobs)
        return max(
            c.memory_analysis().temp_size_in_bytes
            for name in {job.name for job in jobs}
            for c in self.compile_cache.executables(name)
        )

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
        ex, cc = self.executor, self.compile_cache
        plan = []
        for name, B, T in self._jobs():
            job = ex.job(name, B, T)
            why = self._why(name, B, T)
            plan.append(PlannedProgram(name, B, T, ex.describe(job), why, cc.origin(job)))
        return plan

    def _jobs(self) -> list[tuple[str, int, int]]:
        """Every (program, B, T) serving can call: the shape plan's, then the host tier's
        copies (B: pages a call moves)."""
        copies = [(name, n, 0) for name in ("spill", "restore") for n in self._copies]
        return self.shapes.jobs() + copies

    def _why(self, name: str, B: int, T: int) -> str:
        """What one program of the plan serves."""
        if name == "spill":
            return f"copies up to {B} evicted page(s) to the host tier (--cache-ram)"
        if name == "restore":
            return f"copies up to {B} page(s) of a host-tier hit back into the pool"
        return self.shapes.why(name, B, T)

    def warmup(self, *, progress: bool = True) -> dict[str, tuple[int, float]]:
        """Compile the whole plan now, in parallel (what the executable store holds loads
        instead), and build llguidance's view of the vocabulary (what a first grammar or
        logprobs request would otherwise wait for: ~1 s at 150k tokens):
        {program: (executables compiled, compile seconds)}.

        Afterwards, in strict mode, any further compile raises RecompileError.
        """
        self.compile_cache.strict = False
        ex = self.executor
        jobs = [ex.job(name, B, T) for name, B, T in self._jobs()]
        done = []

        def on_done(job, seconds):
            done.append(job)
            if progress:
                print(f"\rwarmup [{len(done)}/{len(jobs)}] {job.name} {job.label} "
                      f"{seconds:.2f} s   ", end="", file=sys.stderr, flush=True)  # fmt: skip

        t0 = time.perf_counter()
        with self._watched():
            report = self.compile_cache.compile_planned(jobs, on_done=on_done)
            trim_heap()  # compiling leaves free heap resident (~40% of the growth on CPU)
            ex.allocate()
        self.vocabulary.ll  # noqa: B018 (built now, cached)
        self._perf.warmup_programs += sum(n for n, _ in report.values())
        self._perf.warmup_seconds += time.perf_counter() - t0
        if progress:
            for name, (n, seconds) in report.items():
                print(f"\nwarmup: {name:8s} {n:3d} programs {seconds:7.2f} s",
                      end="", file=sys.stderr)  # fmt: skip
            compiled = sum(n for n, _ in report.values())
            print(f"\nwarmup: {len(done)} programs in {time.perf_counter() - t0:.2f} s "
                  f"({len(done) - compiled} loaded from the store, {compiled} compiled)",
                  file=sys.stderr)  # fmt: skip
        if self.fit_plan is not None and jax.local_devices()[0].platform == "cpu":
            self.fit_plan = self.fit_plan.measured(pools=True)  # every program compiled now
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


def carries_state(placement: Placement, draft: Placement | None) -> bool:
    """Whether a prefix leaves a state besides its KV pages: linear layers' (the model's or
    the draft's)."""
    runners = [placement.runner] + ([draft.runner] if draft else [])
    return any(isinstance(c, RecurrentState) for r in runners for c in r.caches)


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
