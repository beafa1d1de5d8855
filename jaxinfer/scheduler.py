"""Slots: continuous batching over a fixed number of slots.

Requests queue and take free slots; each slot's prompt is prefilled chunk by chunk (one chunk
per step, interleaved with one decode call for the running slots); a finished or cancelled
request frees its slot at once. All slots share one KV cache [N, K, S, H] (N = slots, rows of
idle slots are masked), grown through the cache-length buckets as requests need, so the
programs are the same N-row decode and one-row prefill whatever requests come and go.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .sampling import PENALTY_WINDOW, pack, recent_window

if TYPE_CHECKING:
    from .engine import Engine
    from .request import Result, Row, StreamPiece


class Request:
    """A submitted request: `result()` and `stream()` drive the engine until it is done."""

    def __init__(self, slots: Slots, row: Row):
        self._slots = slots
        self.row = row
        self.pieces: deque[StreamPiece] = deque()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.row.finish is not None

    def result(self) -> Result:
        while not self.done:
            self._slots.engine.step()
        return self.row.result()

    def stream(self) -> Iterator[StreamPiece]:
        while True:
            while self.pieces:
                yield self.pieces.popleft()
            if self.done:
                return
            self._slots.engine.step()

    def cancel(self) -> None:
        self._slots.cancel(self)

    @property
    def latency(self) -> float | None:
        """Seconds from submit to the last token."""
        return None if self.finished_at is None else self.finished_at - self.submitted

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted


@dataclass
class _Active:
    request: Request
    offset: int = 0  # prompt tokens already prefilled
    decoding: bool = False
    sp: dict = field(default_factory=dict)  # this request's packed sampling row


class Slots:
    def __init__(self, engine: Engine, n: int):
        self.engine = engine
        self.n = n
        self.queue: deque[Request] = deque()
        self.active: list[_Active | None] = [None] * n
        self.cache = None
        self.length = 0  # cache positions S
        self.carry = {
            "tokens": np.zeros(n, np.int32),
            "pos": np.zeros(n, np.int32),
            "budget": np.zeros(n, np.int32),
            "done": np.ones(n, bool),
            "window": np.full((n, PENALTY_WINDOW), -1, np.int32),
        }
        self.sp = pack([], [], [], n)

    # ---- requests -----------------------------------------------------------------------

    def submit(self, row: Row) -> Request:
        request = Request(self, row)
        if row.budget <= 0:
            row.finish = "length"
            request.finished_at = time.perf_counter()
        else:
            self.queue.append(request)
        return request

    def cancel(self, request: Request) -> None:
        if request.done:
            return
        request.row.finish = "cancelled"
        request.finished_at = time.perf_counter()
        if request in self.queue:
            self.queue.remove(request)
            return
        for b, slot in enumerate(self.active):
            if slot is not None and slot.request is request:
                self._free(b)

    def idle(self) -> bool:
        return not self.queue and all(s is None for s in self.active)

    # ---- one scheduling step ------------------------------------------------------------

    def step(self) -> None:
        """Admit queued requests, prefill one chunk, run one decode call."""
        self._admit()
        self._prefill_one_chunk()
        if any(s is not None and s.decoding for s in self.active):
            self._decode()

    def _admit(self) -> None:
        for b in range(self.n):
            if self.active[b] is None and self.queue:
                request = self.queue.popleft()
                row = request.row
                sp = pack([row.params], [row.seed], [row.stop_ids], 1)
                self.active[b] = _Active(request, sp=sp)
                for key in ("f", "i", "stops"):
                    self.sp[key][b] = sp[key][0]
                # One position beyond what the request writes: the parking spot (see _park).
                self._ensure_length(len(row.prompt) + row.budget)
                self._park()

    def _ensure_length(self, need: int) -> None:
        """A cache long enough for `need` positions, grown one bucket at a time."""
        engine = self.engine
        target = engine.cache_buckets.index(bucket_for(need, engine.cache_buckets))
        if self.cache is None:
            size = np.zeros((self.n, engine.cache_buckets[target]), np.bool_)
            self.cache = engine._run("cache", size, donate=())
            self.length = engine.cache_buckets[target]
            return
        while self.length < engine.cache_buckets[target]:
            nxt = engine.cache_buckets[engine.cache_buckets.index(self.length) + 1]
            self.cache = engine._run("grow", self.cache, np.zeros(nxt, np.bool_), donate=())
            self.length = nxt

    def _prefill_one_chunk(self) -> None:
        waiting = [(b, s) for b, s in enumerate(self.active) if s is not None and not s.decoding]
        if not waiting:
            return
        engine = self.engine
        b, slot = min(waiting, key=lambda bs: bs[1].request.submitted)
        prompt = slot.request.row.prompt
        T = engine.chunk_for(len(prompt) - slot.offset, self.length)
        seg = prompt[slot.offset : slot.offset + T]
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(seg)] = seg
        window = recent_window(prompt)[None]  # [1, W]
        t0 = engine._clock()
        self.cache, token = engine._run(
            "prefill_slot", engine.params, self.cache, np.int32(b), tokens,
            np.array([slot.offset], np.int32), np.array([len(seg)], np.int32), window, slot.sp,
        )  # fmt: skip
        slot.offset += len(seg)
        if slot.offset < len(prompt):
            engine._perf.prompt_ms += (engine._clock() - t0) * 1e3
            engine._perf.prompt_tokens += len(seg)
            return
        first = int(np.asarray(token)[0])  # the prompt is in: its first new token
        engine._perf.prompt_ms += (engine._clock() - t0) * 1e3
        engine._perf.prompt_tokens += len(seg)
        self._deliver(b, [first])
        if self.active[b] is None:
            return  # finished on its first token
        slot.decoding = True
        row = slot.request.row
        self.carry["tokens"][b] = first
        self.carry["pos"][b] = len(prompt)
        self.carry["budget"][b] = row.budget - 1
        self.carry["done"][b] = False
        self.carry["window"][b] = recent_window(prompt)

    def _decode(self) -> None:
        engine = self.engine
        t0 = engine._clock()
        n = np.int32(engine.stream_chunk)
        self.cache, carry, out = engine._run(
            "decode", engine.params, self.cache, self.carry, self.sp, n
        )
        out = np.asarray(out)
        self.carry = {k: np.array(v) for k, v in carry.items()}  # host copies we may edit
        generated = 0
        for b, slot in enumerate(self.active):
            if slot is None or not slot.decoding:
                continue
            ids = [int(t) for t in out[b] if t >= 0]
            generated += len(ids)
            self._deliver(b, ids)
        engine._perf.eval_tokens += generated
        engine._perf.eval_ms += (engine._clock() - t0) * 1e3

    def _deliver(self, b: int, ids: list[int]) -> None:
        request = self.active[b].request
        piece = request.row.accept(ids)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        if piece.text or piece.token_ids:
            request.pieces.append(piece)
        if request.done:
            request.finished_at = time.perf_counter()
            self._free(b)

    def _free(self, b: int) -> None:
        self.active[b] = None
        self._park()

    def _park(self) -> None:
        """Rows not decoding still run in the decode program (masked) and write their token's
        K/V at their position: keep that at the cache's last position, which no live request
        reaches, so a slot being prefilled is never overwritten."""
        for b, slot in enumerate(self.active):
            if slot is None or not slot.decoding:
                self.carry["done"][b] = True
                self.carry["pos"][b] = self.length - 1


def bucket_for(n: int, buckets) -> int:
    """Smallest bucket >= n, else the largest."""
    return next((x for x in buckets if x >= n), buckets[-1])
