"""`jaxinfer serve`: an OpenAI-compatible HTTP server (starlette on uvicorn) over the slots.

The HTTP side runs on one asyncio loop; the engine runs on its own thread (`worker.Worker`),
which loads and warms up while /health answers 503. Handlers check a request, hand it to the
engine thread and await its pieces. A client that disconnects cancels its requests: the slot
and pages are free before the next scheduler step. Errors are OpenAI-style JSON bodies, and
none of them stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..engine import Engine
from ..errors import JaxinferError, RequestError
from ..runtime.request import Result, StreamPiece
from .chat import ChatTemplate
from .metrics import CONTENT_TYPE, Metrics, engine_snapshot
from .openai_api import ContextError, Job, chat_job, completion_job, error_body, token_ids
from .openai_api import finish_reason as openai_finish
from .worker import Worker

log = logging.getLogger(__name__)
PUBLIC = ("/health", "/v1/health", "/metrics")  # answered without the API key, as in vLLM


class Server:
    """An HTTP server bound to host:port, its engine loaded by `load` on the engine thread.

    `run()` serves until interrupted (the CLI); `start()` / `stop()` serve from a background
    thread (tests, notebooks). Port 0 picks a free port: see `.port`.
    """

    def __init__(
        self,
        load: Callable[[], Engine],
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        api_key: str | None = None,
        alias: str | None = None,
        chat_template: str | None = None,
        progress: bool = False,
        on_ready: Callable[[Server], None] | None = None,
    ):
        self.socket = _listen(host, port)
        self.host, self.port = self.socket.getsockname()[:2]
        self.worker = Worker(
            load, progress=progress, on_failure=lambda e: self._shut(),
            on_ready=(lambda: on_ready(self)) if on_ready else None,
        )  # fmt: skip
        self.metrics = Metrics()
        self.app = _App(self, api_key=api_key, alias=alias, chat_template=chat_template).build()
        # log_config=None: uvicorn's dictConfig would replace the host program's logging.
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan="off"
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        """Serve until interrupted; a model that fails to load raises its error here."""
        self.worker.start()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.worker.stop()
            self.socket.close()
        if self.worker.error is not None:
            raise self.worker.error

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.run, name="jaxinfer-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._shut()
        if self._thread is not None:
            self._thread.join(30)

    def _shut(self) -> None:
        self._uvicorn.should_exit = True


class _App:
    """The routes, over one Server's worker and metrics."""

    def __init__(self, server: Server, *, api_key, alias, chat_template):
        self.worker, self.metrics = server.worker, server.metrics
        self.api_key = api_key
        self.alias = alias
        self._template_source = chat_template  # overrides the model's
        self._template: tuple[ChatTemplate | None, str | None] | None = None
        self.started = int(time.time())

    def build(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/metrics", self.guard(self.scrape, ready=False), methods=["GET"]),
            Route("/v1/models", self.guard(self.models), methods=["GET"]),
            Route("/models", self.guard(self.models), methods=["GET"]),
            Route("/v1/completions", self.guard(self.completions), methods=["POST"]),
            Route("/completions", self.guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self.guard(self.chat), methods=["POST"]),
            Route("/chat/completions", self.guard(self.chat), methods=["POST"]),
            Route("/tokenize", self.guard(self.tokenize), methods=["POST"]),
            Route("/detokenize", self.guard(self.detokenize), methods=["POST"]),
            Route("/reset_prefix_cache", self.guard(self.reset_prefix_cache), methods=["POST"]),
        ]
        handlers = {HTTPException: self.http_error, Exception: self.internal_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    # ---- plumbing -----------------------------------------------------------------------

    def error(self, message: str, code: int, kind: str = "invalid_request_error", **extra):
        self.metrics.refused.labels(str(code)).inc()
        return JSONResponse(error_body(message, code, kind, **extra), status_code=code)

    def guard(self, handler, *, ready: bool = True):
        """The API key, the engine being ready, and user errors as 400s."""

        async def endpoint(request: HTTPRequest):
            if self.api_key is not None and request.url.path not in PUBLIC:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    return self.error("Invalid API Key", 401, "authentication_error")
            if ready and not self.worker.ready:
                return self.unavailable()
            try:
                return await handler(request)
            except ContextError as e:
                return self.error(str(e), 400, "exceed_context_size_error",
                                  n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)  # fmt: skip
            except JaxinferError as e:  # RequestError and the like: the user's to fix
                return self.error(str(e), 400)

        return endpoint

    def unavailable(self):
        if self.worker.status == "failed":
            return self.error(f"the model failed to load: {self.worker.error}", 500, "server_error")
        return self.error("Loading model", 503, "unavailable_error")

    async def http_error(self, request, exc: HTTPException):
        return self.error(exc.detail, exc.status_code, "not_found_error"
                          if exc.status_code == 404 else "invalid_request_error")  # fmt: skip

    async def internal_error(self, request, exc: Exception):
        log.exception("internal error on %s", request.url.path, exc_info=exc)
        return self.error(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")

    async def body(self, request: HTTPRequest):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None

    @property
    def engine(self) -> Engine:
        return self.worker.engine  # read-only use here: tokenizer, config, sizes

    @property
    def model(self) -> str:
        return self.alias or self.engine.name

    def template(self) -> ChatTemplate | None:
        if self._template is None:  # once: the source either parses or not
            source = self._template_source or self.engine.tokenizer.chat_template
            self._template = (None, None)
            if source:
                try:
                    self._template = (ChatTemplate(source, self.engine.tokenizer), None)
                except RequestError as e:
                    self._template = (None, str(e))
        template, problem = self._template
        if problem:
            raise RequestError(problem)
        return template

    # ---- endpoints ----------------------------------------------------------------------

    async def health(self, request: HTTPRequest):
        if not self.worker.ready:
            return self.unavailable()
        return JSONResponse({"status": "ok"})

    async def scrape(self, request: HTTPRequest):
        if self.worker.ready:
            at_ready = self.worker.compiles_at_ready
            snap = self.worker.call(lambda engine: engine_snapshot(engine, at_ready))
            self.metrics.snapshot = await asyncio.wrap_future(snap)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: HTTPRequest):
        e = self.engine
        meta = {"n_ctx": e.max_seq_len, "n_vocab": e.cfg.vocab_size, "n_params": e.cfg.n_params(),
                "slots": e.slots or 1, "format": e.source, "jaxinfer": __version__}  # fmt: skip
        card = {"id": self.model, "object": "model", "created": self.started,
                "owned_by": "jaxinfer", "meta": meta}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, request: HTTPRequest):
        body = await self.body(request)
        content = body.get("content") if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise RequestError("content must be a string")
        tok = self.engine.tokenizer
        ids = tok.encode(content)
        if tok.add_bos and not body.get("add_special", False):  # llama-server's default
            ids = ids[1:]
        if body.get("with_pieces", False):
            piece = tok.backend.decode  # specials shown as written
            tokens = [{"id": i, "piece": piece([i], skip_special_tokens=False)} for i in ids]
            return JSONResponse({"tokens": tokens})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: HTTPRequest):
        body = await self.body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        ids = token_ids(tokens, self.engine.cfg.vocab_size, "tokens")
        return JSONResponse({"content": self.engine.tokenizer.decode(ids)})

    async def reset_prefix_cache(self, request: HTTPRequest):
        """Empty the prefix cache (vLLM's endpoint); running requests keep their pages."""
        await asyncio.wrap_future(self.worker.call(lambda engine: engine.reset_prefix_cache()))
        return JSONResponse({"status": "ok"})

    async def completions(self, request: HTTPRequest):
        e = self.engine
        job = completion_job(await self.body(request), e.tokenizer, e.max_seq_len, self.model)
        return await self.serve(request, job)

    async def chat(self, request: HTTPRequest):
        body = await self.body(request)
        job = chat_job(body, self.template(), self.engine.max_seq_len, self.model)
        return await self.serve(request, job)

    # ---- one job ------------------------------------------------------------------------

    async def serve(self, request: HTTPRequest, job: Job):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        metrics = self.metrics

        def sink(index: int, item) -> None:  # on the engine thread
            if isinstance(item, Result):
                metrics.finished(item)
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, (index, item))
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        def submit(engine: Engine):  # on the engine thread: every choice, or none
            made = []
            try:
                for ids, sampling in job.submissions():
                    made.append(engine.submit(list(ids), sampling=sampling, stream=job.stream))
            except BaseException:
                for r in made:
                    r.cancel()
                raise
            return made

        handles = await asyncio.wrap_future(self.worker.open(submit, sink))
        if job.stream:
            events = self.events(job, handles, inbox)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        collect = asyncio.ensure_future(_results(inbox, len(handles)))
        gone = asyncio.ensure_future(_disconnect(request))
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():  # the client left: its requests end now
            collect.cancel()
            for handle in handles:
                self.worker.cancel(handle)
            return Response(status_code=499)
        results = collect.result()
        if isinstance(results, Exception):
            return self.error(f"generation failed: {results}", 500, "server_error")
        return JSONResponse(job.response(results))

    async def events(self, job: Job, handles, inbox: asyncio.Queue) -> AsyncIterator[str]:
        """The SSE stream of a job; closing it early (a client gone) cancels what still runs."""
        results: list[Result | None] = [None] * len(handles)
        try:
            for index in range(len(handles)):
                if (opening := job.opening(index)) is not None:
                    yield _sse(opening)
            while any(r is None for r in results):
                index, item = await inbox.get()
                if isinstance(item, StreamPiece):
                    if item.text:
                        yield _sse(job.chunk(index, item.text))
                elif isinstance(item, Result):
                    results[index] = item
                    yield _sse(job.chunk(index, None, openai_finish(item)))
                else:  # the engine failed this step: say so in the stream, as vLLM does
                    yield _sse(error_body(f"generation failed: {item}", 500, "server_error"))
                    return
            if job.include_usage:
                yield _sse(job.usage_chunk(results))
            yield "data: [DONE]\n\n"
        finally:
            for handle, result in zip(handles, results, strict=True):
                if result is None:
                    self.worker.cancel(handle)


async def _results(inbox: asyncio.Queue, n: int):
    """Every choice's Result in order (pieces skipped), or the exception that ended them."""
    results: list[Result | None] = [None] * n
    while any(r is None for r in results):
        index, item = await inbox.get()
        if isinstance(item, Exception):
            return item
        if isinstance(item, Result):
            results[index] = item
    return results


async def _disconnect(request: HTTPRequest) -> None:
    """Returns when the client disconnects (what vLLM's with_cancellation listens for)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error (a port in use, a bad host)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise JaxinferError(f"--port {port!r} is invalid; use 0..65535 (0 = any free port)")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        raise JaxinferError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host"
        ) from None
    sock.setblocking(False)
    return sock
