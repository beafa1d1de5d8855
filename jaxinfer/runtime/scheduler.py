"""Scheduler: the one loop behind generate(), submit() and streaming.

Each step admits queued requests while a row and their KV pages are free, runs one prompt
chunk for every row still prefilling (as one batch), runs one decode call for the rows that are
decoding, and returns what each request produced. Rows are compacted into the smallest batch
bucket that holds them: the KV lives in pages reached through block tables and a linear
layer's state at the request's state index, so moving a request to another row moves
nothing but its table row and state index. A request reserves every page it can
need when admitted and takes them as it grows, so it never fails mid-generation; finishing or
cancelling gives them back at once.

The KV pool, its pages, the prefix cache and its snapshots belong to the KV manager (kv.py):
a request holds a `Lease` on it, which admission takes (mapping in a cached prefix, which the
prefill then starts after), each call grows, filled pages are registered under, and retiring
gives back. The scheduler never sees a hash or a snapshot. With the host tier, it has the
executor copy the cached pages the manager evicted out to the host before each compiled call
(`_run`), and a lease's host-tier hits back in right after its admission (`_restore`).

Structured output: a row whose request follows a grammar gets its token mask filled before
each call that samples for it, and such a call makes one token per row. Log-probabilities
come back from the device only when a row in the call asked for them.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from ..model.kvcache import NULL_STATE
from ..ops.sampling import PENALTY_WINDOW, SamplingRows, free_mask, recent_window
from .buckets import ShapePlan
from .drafting import Drafting, StepCosts
from .executor import Executor
from .inputs import Chunk, DecodeState
from .kv import KVManager, Lease
from .perf import PerfStats
from .request import RequestState, StreamPiece

Delivery = tuple[RequestState, StreamPiece]
QUEUE_SCAN = 512  # queued requests `_ranked` compares (a server queues at most max_queue)
SHARED_SCORE_CHUNK = 128  # most tokens of a scoring chunk while requests run beside it


@dataclass(eq=False)
class _Active:
    """An admitted request: its KV lease, its prompt progress and a host copy of its decode
    row."""

    state: RequestState
    state_index: int  # its state index in the linear layers (one per running request)
    kv: Lease
    context: list[int]  # the ids its prefill computes: the prompt and, resumed, what it made
    offset: int = 0  # context tokens prefilled
    decoding: bool = False
    token: int = 0  # the next input token
    pos: int = 0  # its position
    left: int = 0  # tokens still allowed
    prefilled: float = 0.0  # seconds of the prefill calls that computed its context
    since: float = 0.0  # clock at its first decoded token: its time slice starts
    drafting: Drafting = field(default_factory=Drafting)  # n-gram: verify or plain calls


class Scheduler:
    def __init__(
        self,
        executor: Executor,
        kv: KVManager,
        shapes: ShapePlan,
        perf: PerfStats,
        clock: Callable[[], float],
        *,
        decode_chunk: int,
        stream_chunk: int,
        always_interactive: bool,
        time_slice: float = 0.0,
    ):
        self.executor = executor
        self.kv = kv
        self.shapes = shapes
        self.perf = perf
        self.clock = clock  # seconds, compile time excluded
        self.decode_chunk = decode_chunk
        self.stream_chunk = stream_chunk
        # Slots serve requests that arrive between steps: always wake every `stream_chunk`.
        self.always_interactive = always_interactive
        # Seconds a request decodes before another client's waiting request may take its row
        # (0: never; `_preempt`).
        self.time_slice = time_slice
        self.queue: deque[RequestState] = deque()
        self.running: list[_Active] = []  # in admission order
        # free state indices, lowest last
        self._free_states = list(range(shapes.rows, NULL_STATE, -1))
        # The last decode call's rows, device state and sampling rows, and (host, device) table.
        self._last: tuple = ((), None, None, (None, None))
        self._last_loop = ""  # the last decode call's program
        self._chooses = len(shapes.loops) > 1  # n-gram: verify or plain calls (drafting.py)
        self.costs = StepCosts()  # what the two programs' steps take (n-gram)
        self._guided = False  # the last decode call's masks guided a row
        self._step_arrays: dict[int, object] = {}

    # ---- requests -----------------------------------------------------------------------

    def check(self, state: RequestState) -> None:
        """Refuse a request that could never get its pages, with the numbers."""
        fix = "lower max_new_tokens or load with a larger kv_cache_tokens"
        self.kv.check(state.need, "the request", fix)

    def submit(self, state: RequestState) -> None:
        self.check(state)
        if state.budget <= 0:
            state.end("length")
        else:
            self.queue.append(state)

    def cancel(self, state: RequestState) -> None:
        if state.finish is not None:
            return
        state.end("cancelled")
        if state in self.queue:
            self.queue.remove(state)
        for active in self.running:
            if active.state is state:
                self._retire(active)
                break

    def idle(self) -> bool:
        return not self.queue and not self.running

    # ---- one step -----------------------------------------------------------------------

    def step(self, deliver: Callable[[list[Delivery]], None]) -> None:
        """Admit, one prompt chunk, one decode call. `deliver` gets the pieces each call
        produced as soon as it returns: a first token is out before the decode call runs."""
        self._admit()
        for phase in (self._prefill, self._decode):
            out: list[Delivery] = []
            phase(out)
            if out:
                deliver(out)

    def _admit(self) -> None:
        while self.queue:
            if len(self.running) >= self.shapes.rows:
                state = self._preempt()
            else:
                head, key = self._ranked()
                state = min(head, key=key)
            if state is None:
                return
            # A preempted request resumes by computing what it made too (its full pages are
            # prefix hits where the cache is on); its next token is then sampled at the
            # position it would have been, with the same key (seed, position).
            context = state.prompt + state.token_ids
            salt = state.cache_salt
            lease = self.kv.admit(context, state.need, cache=state.cache_prompt, salt=salt)
            if lease is None:
                return  # it waits for pages (or for a page a running prompt fills to hit it)
            self.queue.remove(state)
            self._restore(lease)
            if state.admitted_at is None:
                state.admitted_at = time.perf_counter()
                state.cached_tokens = lease.cached_tokens
            active = _Active(state, self._free_states.pop(), lease, context, lease.cached_tokens)
            if self._chooses:
                active.drafting = Drafting.start(context)
            self.running.append(active)

    def _ranked(self) -> tuple[list[RequestState], Callable[[RequestState], tuple]]:
        """The queued requests looked at, and the key that orders them as free rows go to
        them (the least first): first those of the client
        (group) that runs the fewest requests (a request without a group is a client of its
        own), so that a job of 128 choices delays another client's request by one choice,
        not by all of them; among those, of the client served least so far (the tokens
        computed for its requests still here: least attained service, so a new client's
        request goes before one preempted after its slice); the oldest among equals. The
        first QUEUE_SCAN queued requests are looked at (the rest wait in order): a
        generate() list of thousands stays cheap."""
        running: Counter[object] = Counter()
        served: Counter[object] = Counter()
        for a in self.running:
            running[_group(a.state)] += 1
            served[_group(a.state)] += a.state.served
        head = list(itertools.islice(self.queue, QUEUE_SCAN))
        for state in head:
            served[_group(state)] += state.served
        return head, lambda s: (running[_group(s)], served[_group(s)])

    def _preempt(self) -> RequestState | None:
        """When every row is taken: the first queued request (in `_ranked` order) for which a
        running one gives its row back, or None. The running request of the group that runs
        the most, among those that have decoded for their time slice and whose group runs at
        least two more than the waiting request's, or one more and may still make more tokens
        than it may (max_new_tokens left: the shorter job first, so that equal requests of
        single clients are served in order rather than in turns), goes back to the queue's
        end (vLLM's recompute preemption: its pages are given back, and its resumption
        computes its prompt and tokens again, the cached full pages excepted). A request
        that no running one may give way to (a longer job than all of them) does not hold
        up those behind it that one may. A slice is `time_slice` or four times the prefill
        calls that computed the request's context (their time, not the wall time since its
        admission, which waiting behind other prompts' chunks would stretch), whichever is
        longer, so that recomputing costs it at most a fifth of its time. A request's wait
        for a row is thus bounded by about one slice however long the others generate; a
        job's own choices never preempt each other."""
        if not self.time_slice:
            return None
        now = self.clock()

        def slice_over(a: _Active) -> bool:
            return a.decoding and now - a.since >= max(self.time_slice, 4 * a.prefilled)

        ripe = [a for a in self.running if slice_over(a)]
        if not ripe:
            return None
        running = Counter(_group(a.state) for a in self.running)
        loads = [(a, running[_group(a.state)]) for a in ripe]
        head, key = self._ranked()
        for waiting in sorted(head, key=key):
            mine = running[_group(waiting)]
            wants = waiting.budget - len(waiting.token_ids)  # the most tokens it may make
            # its client still runs as many as waiting's once it gives its row back
            victims = [(n, now - a.since, a) for a, n in loads
                       if n > mine + 1 or (n > mine and a.left > wants)]  # fmt: skip
            if victims:
                victim = max(victims, key=lambda v: v[:2])[2]
                self._retire(victim)
                self.queue.append(victim.state)
                self.perf.preempted += 1
                return waiting
        return None

    def _run(self, name: str, *inputs):
        """A compiled call (Executor.run), after the pages it may overwrite are spilled."""
        self._spill()
        return self.executor.run(name, *inputs)

    def _spill(self) -> None:
        """Copy the cached pages evicted since the last call out to the host tier, before a
        call writes them again (one transfer; nothing without a host tier)."""
        spill = self.kv.spill()
        if spill is not None:
            contents, states = self.executor.copy_out(spill.pages, spill.snaps)
            self.kv.keep(spill, contents, states)

    def _restore(self, lease: Lease) -> None:
        """Copy a new lease's host-tier hits into its pages (and the state at their end into
        the snapshot its prefill starts from), after spilling what those pages held."""
        restore = lease.restore
        if restore is None:
            return
        self._spill()
        self.executor.copy_in(restore.pages, restore.contents(), restore.snap, restore.state())
        lease.restore = None

    def _register(self, active: _Active, filled: int) -> None:
        """Name the request's pages wholly below position `filled`."""
        state = active.state
        self.kv.register(active.kv, filled, lambda: state.prompt + state.token_ids)

    def _prefill(self, out: list[Delivery]) -> None:
        """One chunk for the waiting prompts, oldest first: the chunk length that takes the
        most prompt tokens in one call (rows x tokens within the prompt token budget), the
        longest among equals. Several short prompts (prefix hits leave short suffixes) go
        in one call of shorter chunks rather than one call each."""
        rows = [a for a in self.running if not a.decoding]
        if not rows:
            return
        left = [len(a.context) - a.offset for a in rows]

        def taken(T: int) -> tuple[int, int]:
            return sum(min(n, T) for n in left[: self.shapes.rows_for(T)]), T

        T = self.shapes.chunk_for(left[0])
        T = max((c for c in self.shapes.chunks if c <= T), key=taken)
        rows = rows[: self.shapes.rows_for(T)]
        B = self.shapes.batch_for(len(rows))
        tokens = np.zeros((B, T), np.int32)
        start, length, state_index = (np.zeros(B, np.int32) for _ in range(3))
        R = self.shapes.sample_rows  # the sample call's rows: B of them real
        window = np.full((R, PENALTY_WINDOW), -1, np.int32)
        for b, active in enumerate(rows):
            prompt = active.context
            seg = prompt[active.offset : active.offset + T]
            tokens[b, : len(seg)] = seg
            start[b], length[b], state_index[b] = active.offset, len(seg), active.state_index
            self.kv.grow(active.kv, active.offset + len(seg))
            if active.offset + len(seg) == len(prompt):  # the chunk that samples a token
                window[b] = recent_window(prompt)
        upto = [min(a.offset + T, len(a.context)) for a in rows]
        view = self.kv.view([a.kv for a in rows], B, start, length, state_index, upto)
        ends = [a.offset + T >= len(a.context) for a in rows]
        t0 = self.clock()
        chunk = Chunk(tokens, view)  # type: ignore[arg-type]  # host rows, put later
        (logits,) = self._run("prefill", chunk)
        if any(ends):  # some prompt is in: its first token, from the chunk's last logits
            at = np.zeros(R, np.int32)  # the new tokens' positions
            at[:B] = start + length
            sampling = self._sampling(rows, R, ends)
            first, lp = self._run("sample", logits, window, sampling, at)
            first, lp = np.asarray(first), self._logprobs(rows, lp)
        else:
            jax.block_until_ready(logits)  # the chunk's time is its own
        seconds = self.clock() - t0
        self.perf.prompt_ms += seconds * 1e3
        self.perf.prompt_tokens += int(length.sum())
        for b, active in enumerate(rows):
            active.offset += int(length[b])
            active.prefilled += seconds
            active.state.served += int(length[b])
            self.kv.started(active.kv)
            self._register(active, active.offset)
            state = active.state
            if active.offset < len(active.context):
                continue
            token = int(first[b])  # the prompt is in: its first new token
            out.append((state, state.accept([token], _row(lp, b, None))))
            if state.finish:
                self._retire(active)
                continue
            active.decoding, active.since = True, self.clock()
            active.token, active.pos = token, len(active.context)
            active.left = state.budget - len(state.token_ids)

    def _decode(self, out: list[Delivery]) -> None:
        rows = tuple(a for a in self.running if a.decoding)
        if not rows:
            return
        B = self.shapes.batch_for(len(rows))
        n = self._decode_chunk(rows)
        spec = self.executor.spec
        ahead = spec.k if spec else 0  # a speculative step writes its drafts' positions too
        upto = [min(a.pos + n + ahead, a.state.need) for a in rows]
        for active, tokens in zip(rows, upto, strict=True):  # pages for every position it writes
            self.kv.grow(active.kv, tokens)
        loop = self._loop(rows)
        state, sampling, tables = self._inputs(rows, B, upto, loop)
        t0 = self.clock()
        table, *snaps = tables
        state, ids, lp, *counts = self._run(loop, state, table, sampling, self._steps(n), *snaps)
        ids, lp = np.asarray(ids), self._logprobs(rows, lp)
        seconds = self.clock() - t0
        if counts:  # per row: drafted, accepted, row steps, verify steps
            per_row = np.asarray(counts[0])
            drafted, accepted, steps, _ = (int(c) for c in per_row.sum(axis=0))
            self.perf.draft_tokens += drafted
            self.perf.accepted_tokens += accepted
            self.perf.spec_steps += steps
            if self._chooses:
                loop_steps, verifies = (int(c) for c in per_row[:, 2:].max(axis=0))
                self.costs.timed(seconds, loop_steps, verifies)
                trust = np.asarray(state.backoff)[:, 0]  # sliced on the host: no eager op
                for b, active in enumerate(rows):
                    kept, steps = int(per_row[b, 1]), int(per_row[b, 3])
                    active.drafting.verified(kept, steps, int(trust[b]), self.costs)
        elif self._chooses:
            self.costs.timed(seconds, int((ids >= 0).sum(axis=1).max()), 0)
            for active in rows:
                active.drafting.plain()
        generated = 0
        for b, active in enumerate(rows):
            new = [t for t in ids[b].tolist() if t >= 0]
            if not new:
                continue
            generated += len(new)
            active.state.served += len(new)
            active.pos += len(new)
            active.token, active.left = new[-1], active.left - len(new)
            out.append((active.state, active.state.accept(new, _row(lp, b, ids[b] >= 0))))
            # (a stop string may end token_ids before the positions the call wrote)
            known = len(active.state.prompt) + len(active.state.token_ids)
            self._register(active, min(active.pos, known))
            if active.state.finish:  # at a stop token, the budget or a stop string
                self._retire(active)
        self._last = (rows, state, sampling, self._last[3])
        self.perf.eval_tokens += generated
        self.perf.eval_ms += (self.clock() - t0) * 1e3

    def _loop(self, rows: tuple[_Active, ...]) -> str:
        """The decode program of a call: with n-gram speculation, `verify` where a row wants
        to draft, else `decode` (drafting.py)."""
        loops = self.shapes.loops
        return loops[1] if self._chooses and not any(a.drafting.wants for a in rows) else loops[0]

    def _inputs(self, rows: tuple[_Active, ...], batch: int, upto: list[int], loop: str):
        """The decode call's state, sampling rows and tables (the block table, and with
        snapshots the snapshot table for positions below upto[row]), on the device. While
        the same rows decode call after call with the same program, the state is the one the
        last call returned and the rows and tables are the ones already sent (a table changes
        once a page): a steady call sends nothing to the devices (each transfer costs ~0.1 ms
        on the host here). (`decode` leaves the n-gram history behind: a switch rebuilds.)"""
        last_rows, state, sampling, (host_tables, tables) = self._last
        new_tables = self.kv.tables([a.kv for a in rows], batch, upto)
        if rows != last_rows or loop != self._last_loop:  # the device state is rebuilt, one put
            state = self._host_state(rows, batch)
            sampling = self._sampling(rows, batch)
            host_tables = new_tables
            state, sampling, tables = self.executor.put((state, sampling, new_tables))
        elif any(not np.array_equal(a, b) for a, b in zip(new_tables, host_tables, strict=True)):
            host_tables, tables = new_tables, self.executor.put(new_tables)
        # masks change each call while a row is guided, and once more when none is any longer
        guided = any(a.state.steps() is not None for a in rows)
        if rows == last_rows and (guided or self._guided):
            sampling = sampling.replace(mask=self.executor.put(self._masks(rows, batch)))
        self._guided = guided
        self._last = (rows, state, sampling, (host_tables, tables))
        self._last_loop = loop
        return state, sampling, tables

    def _sampling(self, rows, batch: int, sampled=None) -> SamplingRows:
        """The sampling rows of a call, with its token masks (`_masks`)."""
        rows_ = SamplingRows.stack([a.state.sampling for a in rows], batch)
        return rows_.replace(mask=self._masks(rows, batch, sampled))

    def _masks(self, rows, batch: int, sampled=None) -> np.ndarray:
        """[batch, W] the token masks of the rows a call samples for (`sampled` [row]: whether
        it does; every row by default) that a grammar or a reasoning budget guides, every
        token allowed elsewhere."""
        masks = free_mask(batch, self.executor.cfg.vocab_size)
        for b, active in enumerate(rows):
            if sampled is None or sampled[b]:
                mask = active.state.mask()
                if mask is not None:
                    masks[b] = mask
        return masks

    def _logprobs(self, rows, lp):
        """The call's Logprobs on the host where a row wants them, else None."""
        if any(a.state.logprobs is not None for a in rows):
            return jax.device_get(lp)
        return None

    def _steps(self, n: int):
        """The steps argument of decode, kept on the device per value."""
        if n not in self._step_arrays:
            self._step_arrays[n] = self.executor.put(np.int32(n))
        return self._step_arrays[n]

    def _decode_chunk(self, rows) -> int:
        """Fewer tokens per call while anyone streams, has stop strings or waits to start. A
        row a grammar or a reasoning budget guides makes one token a call (each needs the
        host's matcher or count): the decode program rests it after its token while the
        others go on; the verify program cannot, so there the whole call makes one."""
        waiting = bool(self.queue) or any(not a.decoding for a in self.running)
        interactive = self.always_interactive or waiting or any(a.state.interactive for a in rows)
        n = self.stream_chunk if interactive else self.decode_chunk
        if self.executor.spec is None:
            return n
        return min([n, *(s for a in rows if (s := a.state.steps()) is not None)])

    def _host_state(self, rows, batch: int) -> DecodeState:
        """The decode state of `rows` from their host copies; padding rows start done."""
        spec = self.executor.spec
        width = spec.history if spec else 0
        history = np.full((batch, width), -1, np.int32)
        window = np.full((batch, PENALTY_WINDOW), -1, np.int32)
        tokens, pos, left, state_index = (np.zeros(batch, np.int32) for _ in range(4))
        done = np.ones(batch, np.bool_)
        for b, active in enumerate(rows):
            state = active.state
            # The context before the input token: the prompt and all but the last new token.
            context = state.prompt + state.token_ids[:-1]
            window[b] = recent_window(context)
            if width:  # n-gram lookup: the longer history, by position mod its width
                history[b] = recent_window(context, width)
            tokens[b], pos[b], left[b], done[b] = active.token, active.pos, active.left, False
            state_index[b] = active.state_index
        backoff = np.zeros((batch, 2), np.int32)
        if self._chooses and spec:  # n-gram: what each row's lookup proved, what it needs
            backoff[: len(rows), 0] = [a.drafting.trust for a in rows]
            backoff[:, 1] = self.costs.trust(spec.k)
        host = (tokens, pos, left, done, window, state_index, history, backoff)
        return DecodeState(*host)  # type: ignore[arg-type]  # host rows, put later

    def _retire(self, active: _Active) -> None:
        self.kv.release(active.kv)
        self.running.remove(active)
        self._free_states.append(active.state_index)  # the next request in it starts from zeros

    # ---- scoring ------------------------------------------------------------------------

    def scoring(
        self, ids: list[int], cached: bool = False, salt: str | None = None, logprobs: bool = False
    ):
        """A scoring pass, one prompt chunk per next(): it yields True while the pool lacks
        the pages (the caller steps the running requests until they free some), False after
        each chunk, and returns float32 logits [T, V] at every position of `ids` or, with
        `logprobs`, the host Logprobs [T - 1] of ids[1:], each given the ids before it (its
        log-probability and the MAX_LOGPROBS best at its position, from the device: the host
        holds O(T), never [T, V]). `cached`: start after the longest prefix the cache holds
        (under `salt`), whose rows are NaN (ids -1). One pass at a time (it has one state
        index); steps may run between its chunks."""
        while (lease := self.kv.admit(ids, len(ids), cache=cached, salt=salt)) is None:
            yield True
        # The scoring pass has a state index of its own, past the requests' ones.
        state_index = np.array([self.kv.config.first_snapshot - 1], np.int32)
        offset, out = lease.cached_tokens, []
        try:
            self._restore(lease)
            while offset < len(ids):
                T = self.shapes.score_chunk_for(len(ids) - offset)
                if self.running:  # each chunk delays every running request: short ones
                    T = min(T, self.shapes.score_chunk_for(SHARED_SCORE_CHUNK))
                seg = ids[offset : offset + T]
                tokens = np.zeros((1, T), np.int32)
                tokens[0, : len(seg)] = seg
                following = np.full((1, T), -1, np.int32)  # none: the program skips logprobs
                if logprobs:
                    after = ids[offset + 1 : offset + T + 1]
                    following[0, : len(after)] = after
                self.kv.grow(lease, offset + len(seg))
                at, length = np.array([offset], np.int32), np.array([len(seg)], np.int32)
                view = self.kv.view([lease], 1, at, length, state_index)
                chunk = Chunk(tokens, view)  # type: ignore[arg-type]  # host rows, put later
                logits, lp = self._run("score", chunk, following)
                real = np.s_[0, : len(seg)]
                if logprobs:  # [T] and [T, K] come back; the logits stay on the device
                    out.append(jax.tree.map(lambda a, real=real: a[real], jax.device_get(lp)))
                else:
                    out.append(np.asarray(logits)[real])
                offset += len(seg)
                self.kv.started(lease)
                yield False
        finally:
            self.kv.release(lease)

        def joined(*chunks):  # the rows the prefix cache held were not computed
            first = chunks[0]
            fill = np.nan if first.dtype.kind == "f" else -1
            skipped = np.full((lease.cached_tokens, *first.shape[1:]), fill, first.dtype)
            return np.concatenate([skipped, *chunks], axis=0)

        if not logprobs:
            return joined(*out)
        return jax.tree.map(lambda *a: joined(*a)[:-1], *out)  # the last predicts no id

    # ---- pooled passes ------------------------------------------------------------------

    def pooling(self, texts: list[list[int]], pick):
        """A pooled pass over `texts` (embeddings, rerank), one call per next(): it yields
        True while the pool lacks the next text's pages and no text is in the pass (the
        caller steps the running requests until they free some), False after each call, and
        returns pooled [N, 3, D] float64 (each text's final-normed hidden state at its last
        token, their sum over its tokens, and at its first) and picked [N, P] float32 (the
        logits of `pick` [P] after its last token). Texts go in calls of prefill's shapes,
        several rows a call as prompts do, each with a KV lease given back as it ends
        (nothing is kept); with linear layers one row a call, in the scoring pass's state
        index. One pass (pooled or scoring) at a time."""
        pick = np.asarray(pick, np.int32)
        scoring = self.kv.config.first_snapshot - 1  # (a model without linear layers reads none)
        cap = 1 if self.kv.carries_state else self.shapes.rows
        pooled: list = [None] * len(texts)
        picked: list = [None] * len(texts)
        waiting, rows = deque(range(len(texts))), list[_Text]()
        try:
            while waiting or rows:
                while waiting and len(rows) < cap:
                    ids = texts[waiting[0]]
                    lease = self.kv.admit(ids, len(ids))
                    if lease is None:
                        break
                    rows.append(_Text(waiting.popleft(), ids, lease))
                if not rows:
                    yield True
                    continue
                left = [len(r.ids) - r.offset for r in rows]

                def taken(T: int, left=left) -> tuple[int, int]:
                    return sum(min(n, T) for n in left[: min(self.shapes.rows_for(T), cap)]), T

                T = self.shapes.chunk_for(left[0])
                T = max((c for c in self.shapes.chunks if c <= T), key=taken)
                batch = rows[: min(self.shapes.rows_for(T), cap)]
                B = self.shapes.batch_for(len(batch))
                tokens = np.zeros((B, T), np.int32)
                start, length, state_index = (np.zeros(B, np.int32) for _ in range(3))
                for b, r in enumerate(batch):
                    seg = r.ids[r.offset : r.offset + T]
                    tokens[b, : len(seg)] = seg
                    start[b], length[b], state_index[b] = r.offset, len(seg), scoring
                    self.kv.grow(r.kv, r.offset + len(seg))
                view = self.kv.view([r.kv for r in batch], B, start, length, state_index)
                chunk = Chunk(tokens, view)  # type: ignore[arg-type]  # host rows, put later
                out, logits = (np.asarray(a) for a in self._run("pool", chunk, pick))
                for b, r in enumerate(batch):  # out [B, 3, D]: last, sum, first of the chunk
                    if r.offset == 0:
                        r.first = out[b, 2]
                    r.total = r.total + out[b, 1]  # float64 over a long text's chunks
                    r.offset += int(length[b])
                    if r.offset == len(r.ids):
                        pooled[r.index] = np.stack([out[b, 0], r.total, r.first])
                        picked[r.index] = logits[b]
                        self.kv.release(r.kv)
                        rows.remove(r)
                yield False
        finally:
            for r in rows:
                self.kv.release(r.kv)
        return np.stack(pooled), np.stack(picked)


@dataclass(eq=False)
class _Text:
    """A text of a pooled pass: its ids, KV lease and progress, and what its chunks pooled."""

    index: int  # its place among the pass's texts
    ids: list[int]
    kv: Lease
    offset: int = 0  # tokens computed
    first: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [D] at its first token
    total: np.ndarray = field(default_factory=lambda: np.zeros((), np.float64))  # [D] their sum


def _group(state: RequestState) -> object:
    """The client a request shares rows with: its group, or itself."""
    return state if state.group is None else state.group


def _row(lp, b: int, take):
    """Row b of a call's host Logprobs (None: nobody asked) at the positions `take` selects
    (None: a prefill's one token)."""
    return None if lp is None else jax.tree.map(lambda a: a[b][take], lp)
