"""The engine thread of a server: one thread loads the engine, warms it up, and then drives its
scheduler loop; other threads (the HTTP handlers) hand it work and get results back.

Handlers never touch the engine. `call(fn)` runs `fn(engine)` on the engine thread between two
steps; `open(submit, sink)` submits a request there and then calls `sink` with each StreamPiece
it produces and finally its Result (or the exception that ended it); `cancel(request)` frees its
slot and pages before the next step. While requests run the thread steps without pause; idle,
it sleeps on its inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from ..engine import Engine
from ..runtime.request import Request

log = logging.getLogger(__name__)

Sink = Callable[[int, object], None]  # (index, StreamPiece...), then Result or an exception
_STOP = object()


class Worker:
    def __init__(
        self,
        load: Callable[[], Engine],
        *,
        progress: bool = False,
        on_ready: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        self._load = load
        self._progress = progress  # warmup progress on stderr
        self._on_ready, self._on_failure = on_ready, on_failure
        self.status = "loading"  # -> "warming up" -> "ready"; or "failed", "stopped"
        self.error: BaseException | None = None
        self.engine: Engine | None = None
        self.compiles_at_ready = 0  # compile-cache programs + untracked compiles at ready
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[Request, Callable[[object], None]] = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)

    # ---- other threads ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is ready or failed; True when ready."""
        self._ready.wait(timeout)
        return self.ready

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """`fn(engine)` on the engine thread; its value (or exception) in the Future."""
        future: Future = Future()
        self._inbox.put((fn, future, None))
        return future

    def open(self, submit: Callable[[Engine], list[Request]], sink: Sink) -> Future:
        """Submit requests on the engine thread (the Future holds them, or the RequestError
        that refused them) and feed `sink(index, item)` everything request `index` produces."""
        future: Future = Future()
        self._inbox.put((submit, future, sink))
        return future

    def cancel(self, request: Request) -> None:
        self.call(lambda engine: self._cancel(request))

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._load()
            self.status = "warming up"
            engine.warmup(progress=self._progress)
            stats = engine.perf_stats()
            self.compiles_at_ready = stats.programs + stats.untracked_compiles
            self.engine, self.status = engine, "ready"
        except BaseException as e:  # a bad model path, a layout that does not fit...
            self.error, self.status = e, "failed"
            self._ready.set()
            self._fail_pending(e)
            if self._on_failure:
                self._on_failure(e)
            return
        self._ready.set()
        if self._on_ready:
            self._on_ready()
        while self._drain(block=not self._live):
            if self._live:
                self._step()
            self._deliver()
        for request in list(self._live):
            self._cancel(request)
        self.status = "stopped"

    def _drain(self, block: bool) -> bool:
        """Run every waiting call; False once asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            fn, future, sink = item
            try:
                value = fn(self.engine)
            except Exception as e:  # a refused request, a failed call: theirs alone
                future.set_exception(e)
                continue
            for index, request in enumerate(value if sink is not None else ()):
                self._live[request] = partial(sink, index)
            future.set_result(value)

    def _step(self) -> None:
        try:
            self.engine.step(on_pieces=self._deliver)  # first tokens before the decode call
        except Exception as e:  # e.g. strict mode refused a compile: end what was running
            log.exception("engine step failed; the requests it was serving end with an error")
            for request, sink in list(self._live.items()):
                sink(e)
                self._cancel(request)

    def _deliver(self) -> None:
        for request, sink in list(self._live.items()):
            pieces = request.state.pieces
            while pieces:
                sink(pieces.popleft())
            if request.done:
                del self._live[request]
                sink(request.state.result())

    def _cancel(self, request: Request) -> None:
        sink = self._live.pop(request, None)
        request.cancel()
        if sink is not None:  # its (cancelled) Result, for the metrics
            sink(request.state.result())

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                return
            if item is not _STOP:
                item[1].set_exception(error)
