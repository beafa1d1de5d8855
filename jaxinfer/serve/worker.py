"""The engine thread of a server: one thread loads the engine, warms it up, and then drives its
scheduler loop; other threads (the HTTP handlers) hand it work and get results back, through
one queue (llama-server's task queue is the shape).

Handlers never touch the engine but to compile grammars (which reads its tokenizer only).
`call(fn)` runs `fn(engine)` on the engine thread between two steps; `open(task)` runs a `Task`
there: it submits the task's requests (all or none) and then feeds the task each StreamPiece
they produce and finally each Result (or the exception that ended them), which the handler
awaits on its own event loop (`await submit(task)` compiles the task's grammars on a thread
pool first, and opens it); a task's echoed prompts are scored one chunk at a time, between the
other requests' steps and in at most half the thread's time while they run, so that a long
echo delays them by a bounded share, not by the whole prompt.
`cancel(request)` frees its slot and pages before the next step. While requests run the
thread steps without pause; idle, it sleeps on its inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, InvalidStateError
from functools import partial

from ..engine import Engine
from ..errors import RequestError
from ..options import SamplingParams
from ..runtime.lockstep import ProcessLost
from ..runtime.reasoning import Reasoning
from ..runtime.request import Request, Result
from ..runtime.structured import Constraint, grammar_key

log = logging.getLogger(__name__)

Sink = Callable[[int, object], None]  # (index, StreamPiece...), then Result or an exception
_STOP = object()


class QueueFull(RequestError):
    """A task refused because too many choices already wait for a slot (HTTP 429)."""


class Task:
    """One HTTP job's work on the engine thread: each prompt of `echo` scored first (its text,
    and its tokens' logprobs when `logprobs` is set), then every submission (prompt ids and
    sampling) submitted as a request, streaming pieces when `stream`. What request `index`
    makes arrives as (index, item) in `inbox`, on the event loop that made the task;
    `on_result` sees each Result on the engine thread (the metrics)."""

    def __init__(
        self,
        submissions: Sequence[tuple[Sequence[int], SamplingParams]],
        *,
        stream: bool,
        echo: Sequence[Sequence[int]] = (),
        logprobs: int | None = None,
        on_result: Callable[[Result], None] | None = None,
        max_queue: int | None = None,
        reasoning: Reasoning | None = None,
    ):
        self.submissions, self.stream = submissions, stream
        self.reasoning = reasoning  # chat with a thinking template: its tags and budget
        self.max_queue = max_queue  # most choices waiting for a slot, with this task's
        self.echo, self.logprobs, self.on_result = echo, logprobs, on_result
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.echoed: list[tuple[str, list | None]] = []  # per echoed prompt: text, logprobs
        self.constraints: dict[tuple | None, Constraint | None] | None = None  # grammar_key

    def prepare(self, engine: Engine) -> None:
        """Compile the job's grammars, each once (its n choices, seeds apart, share one),
        so that `submit` only copies them: a large schema takes seconds, which the engine
        thread, serving every client, must not spend. Call it on another thread (a handler's
        thread pool) before `Worker.open`; a bad schema or grammar is a RequestError here."""
        if self.constraints is not None:
            return
        constraints: dict[tuple | None, Constraint | None] = {}
        for _, sampling in self.submissions:
            key = grammar_key(sampling)
            if key is not None and key not in constraints:
                constraints[key] = engine.constraint(sampling)
        self.constraints = constraints

    def submit(self, engine: Engine) -> list[Request]:
        """On the engine thread: every request, or none (a refusal cancels those made)."""
        steps = self.steps(engine)
        while True:
            try:
                waiting = next(steps)
            except StopIteration as done:
                return done.value
            if waiting:  # a scoring pass waits for the pages running requests hold
                engine.step()

    def steps(self, engine: Engine):
        """`submit` as a generator whose next() does a bounded piece (an echoed prompt's
        scoring chunk), so that the worker steps the other requests between them; returns
        the requests."""
        made: list[Request] = []
        if self.max_queue is not None:
            waiting = engine.activity()["queued"]
            if waiting + len(self.submissions) > self.max_queue:
                raise QueueFull(
                    f"{waiting} choices wait for a slot and this request adds "
                    f"{len(self.submissions)}, over this server's max_queue ({self.max_queue}); "
                    "retry later"
                )
        try:
            self.prepare(engine)  # unless done already: then here, still once per grammar
            constraints = self.constraints or {}
            for ids in self.echo:
                k = self.logprobs
                lps = None if k is None else (yield from engine.prompt_logprobs_steps(ids, k))
                self.echoed.append((engine.detokenize(ids), lps))
            for ids, sampling in self.submissions:
                compiled = constraints.get(grammar_key(sampling))
                constraint = None if compiled is None else compiled.copy()
                made.append(engine.submit(list(ids), sampling=sampling, stream=self.stream,
                                          constraint=constraint, group=self,
                                          reasoning=self.reasoning))  # fmt: skip
        except BaseException:
            for r in made:
                r.cancel()
            raise
        return made

    def sink(self, index: int, item) -> None:
        """On the engine thread: request `index`'s piece, Result or exception to the inbox."""
        if isinstance(item, Result) and self.on_result is not None:
            self.on_result(item)
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, (index, item))
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Worker:
    def __init__(
        self,
        load: Callable[[], Engine],
        *,
        progress: bool = False,
        on_ready: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        join: Callable[[Engine], None] | None = None,
    ):
        self._load = load
        self._join = join  # after warmup: e.g. lead a process group (Engine.lead)
        self._progress = progress  # warmup progress on stderr
        self._on_ready, self._on_failure = on_ready, on_failure
        self.status = "loading"  # -> "warming up" -> "ready"; or "failed", "stopped"
        self.error: BaseException | None = None
        self.engine: Engine | None = None
        self.compiles_at_ready = 0  # compile-cache programs + untracked compiles at ready
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[Request, Callable[[object], None]] = {}
        self._tasks: deque = deque()  # (generator, future, sink) of tasks run in pieces
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

    def open(self, task: Task) -> Future:
        """Submit the task's requests on the engine thread (the Future holds them, or the
        RequestError that refused them) and feed the task everything each produces. A
        Future cancelled before the engine thread comes to it submits nothing."""
        future: Future = Future()
        run = task.steps if task.echo else task.submit  # an echo is scored in pieces
        self._inbox.put((run, future, task.sink))
        return future

    async def submit(self, task: Task, pool: Executor | None = None) -> list[Request]:
        """A handler's way in (on its event loop): compile the task's grammars on `pool` (the
        loop's default without one; `Task.prepare`), then `open` it; its requests, or the
        RequestError that refused them. Cancelled (a client gone), it leaves nothing running:
        a task the engine thread had not begun is skipped; the requests of one it had begun
        are cancelled."""
        if self.engine is not None:
            await asyncio.get_running_loop().run_in_executor(pool, task.prepare, self.engine)
        future = self.open(task)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._cancel_made)  # runs at once if it was skipped
            raise

    def _cancel_made(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            for request in future.result():
                self.cancel(request)

    def cancel(self, request: Request) -> None:
        self.call(lambda engine: self._cancel(request))

    def lose(self, error: BaseException) -> None:
        """The engine cannot run any more (a process of its group is gone; any thread may
        say so, the engine thread may be blocked in a collective with it): every running
        request, task and waiting call ends with `error` at once, and the worker takes no
        more work (status "failed")."""
        if self.status == "failed":
            return
        self.error, self.status = error, "failed"
        for sink in list(self._live.values()):
            sink(error)
        for _, future, _ in list(self._tasks):
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)
        self._fail_pending(error)
        self._inbox.put(_STOP)
        if self._on_failure:
            self._on_failure(error)

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._load()
            self.status = "warming up"
            engine.warmup(progress=self._progress)
            if self._join is not None:
                self._join(engine)
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
        spent = {"tasks": 0.0, "steps": 0.0}  # engine-thread seconds while tasks wait
        while self._drain(block=not self._live and not self._tasks):
            # Pieces of tasks take at most half the thread while requests run: a scoring
            # chunk costs many single-token steps (grammars), so it cannot go every loop.
            if self._tasks and (not self._live or spent["tasks"] <= spent["steps"]):
                spent["tasks"] += _timed(self._advance)
                if not self._drain(block=False):  # what came in meanwhile joins this step
                    break
            if self._live:
                spent["steps"] += _timed(self._step)
            if not self._tasks:
                spent["tasks"] = spent["steps"] = 0.0
            self._deliver()
        for request in list(self._live):
            self._cancel(request)
        for steps, _, _ in self._tasks:
            steps.close()  # a scoring pass gives its pages back
        if self.status != "failed":  # (lost: the error stays what /health reports)
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
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting (asyncio cancels the Future): skip it
            try:
                value = fn(self.engine)
            except Exception as e:  # a refused request, a failed call: theirs alone
                future.set_exception(e)
                continue
            if inspect.isgenerator(value):  # a task: its pieces run between steps (_advance)
                self._tasks.append((value, future, sink))
                continue
            self._settle(value, future, sink)

    def _advance(self) -> None:
        """Run the tasks in order until one has done a piece (a scoring chunk: one task at
        a time, as a scoring pass has one state index); those done go live."""
        while self._tasks:
            steps, future, sink = self._tasks[0]
            try:
                next(steps)  # True while its pages are held by running requests: they step
                return
            except StopIteration as done:
                self._tasks.popleft()
                self._settle(done.value, future, sink)
            except Exception as e:
                self._tasks.popleft()
                future.set_exception(e)

    def _settle(self, value, future: Future, sink) -> None:
        for index, request in enumerate(value if sink is not None else ()):
            self._live[request] = partial(sink, index)
        future.set_result(value)

    def _step(self) -> None:
        assert self.engine is not None  # steps run only once the engine is ready (_run)
        try:
            self.engine.step(on_pieces=self._deliver)  # first tokens before the decode call
        except Exception as e:  # e.g. strict mode refused a compile: end what was running
            if self.engine.executor.lockstep:  # a group out of step cannot go on
                why = f"the process group ended: a step failed: {e}"
                self.lose(e if isinstance(e, ProcessLost) else ProcessLost(why))
                return
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
            if item is not _STOP and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)
