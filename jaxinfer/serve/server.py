"""`jaxinfer serve`: an OpenAI-compatible HTTP server (starlette on uvicorn) over the slots.

The HTTP side runs on one asyncio loop; the engine runs on its own thread (`worker.Worker`),
which loads and warms up while /health answers 503. Handlers read a body (at most
max_body_mib, within `timeout` seconds), check it and build its job (JSON, tokenizing, the chat
template) on a small thread pool rather than the loop, hand the job to the engine thread and
await its pieces. A client that disconnects, or a stream's reader that stops reading for
`timeout` seconds, cancels its requests: the slot and pages are free before the next
scheduler step. Errors are OpenAI-style JSON bodies, and none of them stops the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..engine import Engine
from ..errors import JaxinferError, RequestError
from ..options import SamplingParams, ServerOptions
from ..runtime.lockstep import ProcessLost
from ..runtime.request import Result, StreamPiece
from . import anthropic
from .chat import ChatTemplate
from .metrics import CONTENT_TYPE, Metrics, engine_snapshot
from .openai_api import (
    ContextError,
    Job,
    Tokens,
    chat_job,
    completion_job,
    error_body,
    flag,
    parse_body,
    token_ids,
)
from .openai_api import finish_reason as openai_finish
from .retrieval import EmbeddingJob, RerankJob, embeddings_job, rerank_job, rerank_tokens
from .thinking import thinking_tags
from .tools import tool_format
from .worker import QueueFull, Task, Worker

log = logging.getLogger(__name__)
PUBLIC = ("/health", "/v1/health", "/metrics")  # answered without the API key, as in vLLM
MESSAGES = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's: its error shape
LINGER = 5.0  # seconds a server whose process group ended answers 503s before it stops


class Server:
    """An HTTP server bound to options.host:port, its engine loaded by `load` on the engine
    thread; `options` a ServerOptions, or its fields as keywords (Server(load, port=0)).

    `run()` serves until interrupted (the CLI); `start()` / `stop()` serve from a background
    thread (tests, notebooks). Port 0 picks a free port: see `.port`.
    """

    def __init__(
        self,
        load: Callable[[], Engine],
        options: ServerOptions | None = None,
        *,
        on_ready: Callable[[Server], None] | None = None,
        join: Callable[[Engine], None] | None = None,
        **fields,
    ):
        o = self.options = ServerOptions.make(options, **fields)
        self.socket = _listen(o.host, o.port)
        self.host, self.port = self.socket.getsockname()[:2]
        self.worker = Worker(
            _retrieving(load, o), progress=o.progress, on_failure=self._failed,
            on_ready=(lambda: on_ready(self)) if on_ready else None, join=join,
        )  # fmt: skip
        self.metrics = Metrics()
        self.app = _App(self).build()
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

    def lost(self, reason: str) -> None:
        """A process of the engine's group is gone (any thread): running requests end with
        503s or a stream's error event, /health answers 503, and the server stops LINGER
        seconds later (a supervisor's health check sees the 503 before the port closes)."""
        self.worker.lose(ProcessLost(f"the process group ended: {reason}"))

    def _failed(self, error: BaseException) -> None:
        if isinstance(error, ProcessLost):
            threading.Timer(LINGER, self._shut).start()
        else:  # the model failed to load
            self._shut()

    def _shut(self) -> None:
        self._uvicorn.should_exit = True


class _App:
    """The routes, over one Server's worker and metrics."""

    def __init__(self, server: Server):
        o = server.options
        self.worker, self.metrics = server.worker, server.metrics
        self.api_key = o.api_key
        self.alias = o.alias
        self.slots_endpoint = o.slots_endpoint  # /slots shows every running prompt: --no-slots
        self.options = o
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxinfer-http")
        # Grammars compile on a pool of their own (a large schema takes seconds), so that the
        # next request's parsing never waits behind one.
        self.grammars = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="jaxinfer-grammar"
        )
        self._template_source = o.chat_template  # overrides the model's
        self._template: tuple[ChatTemplate | None, str | None] | None = None
        self.started = int(time.time())
        self.pooling = 0  # texts of the pooled passes (embeddings, rerank) not yet done

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
            Route("/v1/messages", self.anthropic(self.messages), methods=["POST"]),
            Route(
                "/v1/messages/count_tokens", self.anthropic(self.count_tokens), methods=["POST"]
            ),  # fmt: skip
            Route("/tokenize", self.guard(self.tokenize), methods=["POST"]),
            Route("/detokenize", self.guard(self.detokenize), methods=["POST"]),
            Route("/reset_prefix_cache", self.guard(self.reset_prefix_cache), methods=["POST"]),
            Route("/props", self.guard(self.props), methods=["GET"]),
            Route("/slots", self.guard(self.slots), methods=["GET"]),
            Route("/v1/embeddings", self.guard(self.embeddings), methods=["POST"]),
            *(
                Route(path, self.guard(self.rerank), methods=["POST"])
                for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")
            ),
        ]
        handlers: dict[type[Exception], Callable[..., Any]] = {
            HTTPException: self.http_error,
            Exception: self.internal_error,
        }
        return Starlette(routes=routes, exception_handlers=handlers)

    # ---- plumbing -----------------------------------------------------------------------

    def error(self, message: str, code: int, kind: str = "invalid_request_error", **extra):
        self.metrics.refused.labels(str(code)).inc()
        return JSONResponse(error_body(message, code, kind, **extra), status_code=code)

    def guard(self, handler, *, ready: bool = True):
        """The API key, the engine being ready, and user errors as 400s."""

        async def endpoint(request: HTTPRequest):
            if self.api_key is not None and request.url.path not in PUBLIC:
                if not self.authorized(request):
                    return self.error("Invalid API Key", 401, "authentication_error")
            if ready and not self.worker.ready:
                return self.unavailable()
            try:
                return await handler(request)
            except ContextError as e:
                return self.error(str(e), 400, "exceed_context_size_error",
                                  n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)  # fmt: skip
            except _Refused as e:  # a limit: the body's size or time, the queue
                response = self.error(str(e), e.code, e.kind)
                response.headers.update(e.headers)
                return response
            except ProcessLost as e:  # the engine's process group ended: not the user's
                return self.error(str(e), 503, "unavailable_error")
            except JaxinferError as e:  # RequestError and the like: the user's to fix
                return self.error(str(e), 400)

        return endpoint

    def authorized(self, request: HTTPRequest) -> bool:
        """The API key as `Authorization: Bearer KEY`, or as Anthropic's `x-api-key: KEY`."""
        key = (self.api_key or "").encode()
        bearer = request.headers.get("authorization", "").encode()
        x_api_key = request.headers.get("x-api-key", "").encode()
        # both compared: the time taken says nothing about which one was close
        return hmac.compare_digest(bearer, b"Bearer " + key) | hmac.compare_digest(x_api_key, key)

    def anthropic(self, handler):
        """An Anthropic route: guarded as the others, its errors in Anthropic's shape.
        (anthropic-version and anthropic-beta headers are accepted and not read.)"""
        guarded = self.guard(handler)

        async def endpoint(request: HTTPRequest):
            return _anthropic_error(await guarded(request))

        return endpoint

    def unavailable(self):
        if isinstance(self.worker.error, ProcessLost):
            return self.error(str(self.worker.error), 503, "unavailable_error")
        if self.worker.status == "failed":
            return self.error(f"the model failed to load: {self.worker.error}", 500, "server_error")
        return self.error("Loading model", 503, "unavailable_error")

    async def http_error(self, request, exc: HTTPException):
        response = self.error(exc.detail, exc.status_code, "not_found_error"
                              if exc.status_code == 404 else "invalid_request_error")  # fmt: skip
        return _anthropic_error(response) if request.url.path in MESSAGES else response

    async def internal_error(self, request, exc: Exception):
        log.exception("internal error on %s", request.url.path, exc_info=exc)
        response = self.error(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
        return _anthropic_error(response) if request.url.path in MESSAGES else response

    async def read(self, request: HTTPRequest) -> bytes:
        """The raw body: at most max_body_mib (413, checked while it arrives: Content-Length
        and a running count), within `timeout` seconds (408)."""
        limit = self.options.max_body_mib << 20
        length = request.headers.get("content-length", "")
        too_large = _Refused(
            f"the request body is over this server's max_body_mib ({self.options.max_body_mib})",
            413,
        )
        if length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.options.timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise _Refused(
                f"the request body did not arrive within {self.options.timeout:g} s", 408
            ) from None
        return b"".join(chunks)

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the handlers' thread pool: parsing, tokenizing and templates stay
        off the event loop (bodies are capped: Python work holds the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def body(self, request: HTTPRequest):
        """The parsed JSON body (openai_api.parse_body)."""
        return await self.off_loop(parse_body, await self.read(request))

    @property
    def engine(self) -> Engine:
        engine = self.worker.engine  # read-only use here: tokenizer, config, sizes
        assert engine is not None  # its handlers run once the worker is ready (guard)
        return engine

    @property
    def model(self) -> str:
        return self.alias or self.engine.name

    def template(self) -> ChatTemplate | None:
        if self._template is None:  # once: the source either parses or not
            source = self._template_source or self.engine.tokenizer.chat_template
            parsed: tuple[ChatTemplate | None, str | None] = (None, None)
            if source:
                try:
                    parsed = (ChatTemplate(source, self.engine.tokenizer), None)
                except RequestError as e:
                    parsed = (None, str(e))
            # set whole, once parsed: the front door's threads call this at once, and one
            # that saw a placeholder answered "no chat template" while another parsed it
            self._template = parsed
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
        add_special, with_pieces = flag(body, "add_special"), flag(body, "with_pieces")
        tok, n_ctx = self.engine.tokenizer, self.engine.max_seq_len
        if at_least := tok.too_long(content, n_ctx):  # seconds and gigabytes to encode
            raise RequestError(
                f"content holds more than {at_least} tokens, past the context ({n_ctx}); "
                "/tokenize takes what a prompt could hold: send it in parts"
            )
        ids = await self.off_loop(tok.encode, content)
        if tok.add_bos and not add_special:  # llama-server's default
            ids = ids[1:]
        if with_pieces:
            piece = tok.backend.decode  # specials shown as written
            tokens = [{"id": i, "piece": piece([i], skip_special_tokens=False)} for i in ids]
            return JSONResponse({"tokens": tokens})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: HTTPRequest):
        body = await self.body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        ids = token_ids(tokens, self.engine.cfg.vocab_size, "tokens")
        return JSONResponse({"content": await self.off_loop(self.engine.tokenizer.decode, ids)})

    async def reset_prefix_cache(self, request: HTTPRequest):
        """Empty the prefix cache (vLLM's endpoint); running requests keep their pages."""
        await asyncio.wrap_future(self.worker.call(lambda engine: engine.reset_prefix_cache()))
        return JSONResponse({"status": "ok"})

    async def props(self, request: HTTPRequest):
        """llama-server's GET /props: the defaults a request starts from, and the server."""
        e = self.engine
        tok = e.tokenizer
        return JSONResponse({
            "default_generation_settings": _slot(0, e, None),
            "total_slots": e.shapes.rows,
            "model_alias": self.model,
            "model_path": e.name,
            "chat_template": self._template_source or tok.chat_template or "",
            "tool_call_format": self.tool_call_format(),
            "reasoning": self.reasoning(),
            "bos_token": tok.token_text(tok.bos_id),
            "eos_token": tok.token_text(tok.eos_ids[0] if tok.eos_ids else None),
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": self.slots_endpoint,
            "limits": self.options.limits(),
            "build_info": f"jaxinfer {__version__}",
            "is_sleeping": False,
            "embedding": self.options.embedding,
            "rerank": self.options.rerank,
            "pooling": self.options.pooling,
            "processes": _processes(e),
        })  # fmt: skip

    def reasoning(self) -> dict | None:
        """How thinking answers are split and bounded (None: the template does not think)."""
        source = self._template_source or self.engine.tokenizer.chat_template
        tags = thinking_tags(source) if source else None
        if tags is None:
            return None
        o = self.options
        return {"format": o.reasoning_format, "budget": o.reasoning_budget, "tags": list(tags)}

    def tool_call_format(self) -> str | None:
        """The tool-call format chat requests use: --tool-call-format, else the one the chat
        template teaches (None: none known, or no template)."""
        if self.options.tool_call_format != "auto":
            return self.options.tool_call_format
        source = self._template_source or self.engine.tokenizer.chat_template
        return tool_format(source) if source else None

    async def slots(self, request: HTTPRequest):
        """llama-server's GET /slots: each slot's request (its prompt text, sampling values and
        progress); `?fail_on_no_slot=1` answers 503 when every slot is busy."""
        if not self.slots_endpoint:
            return self.error("this server does not support the slots endpoint (started with "
                              "--no-slots)", 501, "not_supported_error")  # fmt: skip

        def read(engine: Engine) -> dict:  # on the engine thread: the scheduler's state
            return {s["slot"]: {**s, "prompt": engine.detokenize(s["prompt"])}
                    for s in engine.slot_requests()}  # fmt: skip

        running = await asyncio.wrap_future(self.worker.call(read))
        e = self.engine
        slots = [_slot(i, e, running.get(i)) for i in range(e.shapes.rows)]
        fail = request.query_params.get("fail_on_no_slot", "") not in ("", "0", "false")
        if fail and all(s["is_processing"] for s in slots):
            return self.error("no slot available", 503, "unavailable_error")
        return JSONResponse(slots)

    async def embeddings(self, request: HTTPRequest):
        """OpenAI's POST /v1/embeddings (serve --embedding), in pieces on the engine thread."""
        if not self.options.embedding:
            raise RequestError("this server does not serve embeddings; start it with --embedding")
        e, raw = self.engine, await self.read(request)

        def job() -> EmbeddingJob:
            return embeddings_job(parse_body(raw), e.tokenizer, e.max_seq_len, e.cfg.d_model,
                                  self.model, self.options)  # fmt: skip

        made, pooling = await self.off_loop(job), self.options.pooling
        texts = [list(ids) for ids in made.inputs]
        vectors = await self.pooled(
            request, len(texts), lambda engine: engine.embed_steps(texts, pooling)
        )
        return await self.answer(made.response, vectors)

    async def rerank(self, request: HTTPRequest):
        """Jina's / llama-server's POST /v1/rerank (serve --rerank): each document scored as
        Qwen3-Reranker scores it, P(yes), in pieces on the engine thread."""
        if not self.options.rerank:
            raise RequestError("this server does not rerank; start it with --rerank")
        e, raw = self.engine, await self.read(request)

        def job() -> RerankJob:
            body = parse_body(raw)
            return rerank_job(body, e.tokenizer, e.max_seq_len, self.model, self.options)

        made = await self.off_loop(job)
        yes, no = rerank_tokens(e.tokenizer, e.cfg.vocab_size)  # checked at start
        prompts = [list(ids) for ids in made.prompts]
        scores = await self.pooled(
            request, len(prompts), lambda engine: engine.yes_probability_steps(prompts, yes, no)
        )
        return await self.answer(made.response, scores)

    async def pooled(self, request: HTTPRequest, n: int, make):
        """The value of the generator `make(engine)` (a pooled pass over `n` texts), run on the
        engine thread a call at a time between the running requests' steps, as an echo's
        scoring is; None once the client has left (the pass then stops and gives its pages
        back). The texts of passes not yet done count against max_queue (429 past it)."""
        limit = self.options.max_queue
        if self.pooling + n > limit:
            raise _Refused(
                f"{self.pooling} texts wait for the engine and this request adds {n}, over "
                f"this server's max_queue ({limit}); retry later", 429, {"Retry-After": "1"},
            )  # fmt: skip
        self.pooling += n
        try:
            return await self._pooled(request, make)
        finally:
            self.pooling -= n

    async def _pooled(self, request: HTTPRequest, make):
        gone = threading.Event()
        future = self.worker.call(lambda engine: _until(gone, make(engine)))
        done = asyncio.wrap_future(future)
        left = asyncio.ensure_future(_disconnect(request))
        await asyncio.wait((done, left), return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not done.done():
            gone.set()
            future.cancel()  # not begun: skipped
            done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, not raised
            return None
        return done.result()  # a RequestError (the KV pool) is the guard's 400

    async def answer(self, shape, value):
        """`shape(value)` as JSON, built and written on the handlers' pool (a large batch of
        embeddings is megabytes of text); a client gone (value None): 499."""
        if value is None:
            return Response(status_code=499)

        def render() -> bytes:
            return json.dumps(shape(value), ensure_ascii=False, allow_nan=False,
                              separators=(",", ":")).encode()  # fmt: skip

        return Response(await self.off_loop(render), media_type="application/json")

    async def completions(self, request: HTTPRequest):
        e, raw = self.engine, await self.read(request)

        def job() -> Job:
            body = parse_body(raw)
            return completion_job(body, e.tokenizer, e.max_seq_len, self.model, self.options)

        return await self.serve(request, await self.off_loop(job))

    async def chat(self, request: HTTPRequest):
        raw = await self.read(request)

        def job() -> Job:
            body = parse_body(raw)
            return chat_job(body, self.template(), self.engine.max_seq_len, self.model,
                            self.options)  # fmt: skip

        return await self.serve(request, await self.off_loop(job))

    async def messages(self, request: HTTPRequest):
        """Anthropic's POST /v1/messages, served as the chat request it translates to."""
        raw = await self.read(request)

        def job() -> Job:
            body = anthropic.chat_body(parse_body(raw))
            return chat_job(body, self.template(), self.engine.max_seq_len, self.model,
                            self.options)  # fmt: skip

        return await self.serve(request, await self.off_loop(job), messages=True)

    async def count_tokens(self, request: HTTPRequest):
        """Anthropic's POST /v1/messages/count_tokens: the rendered prompt's tokens, tools
        included, as /v1/messages would send them to the model."""
        raw = await self.read(request)

        def count() -> int:
            body = anthropic.chat_body(parse_body(raw), count=True)
            job = chat_job(body, self.template(), self.engine.max_seq_len, self.model,
                           self.options)  # fmt: skip
            return len(job.prompts[0])

        return JSONResponse({"input_tokens": await self.off_loop(count)})

    # ---- one job ------------------------------------------------------------------------

    async def serve(self, request: HTTPRequest, job: Job, *, messages: bool = False):
        """Run `job` and answer it: in OpenAI's shape, or (`messages`) Anthropic's."""
        task = Task(
            job.submissions(), stream=job.stream, echo=job.prompts if job.echo else (),
            logprobs=job.sampling.logprobs, on_result=self.metrics.finished,
            max_queue=self.options.max_queue, reasoning=job.reasoning,
        )  # fmt: skip
        try:
            handles = await self.worker.submit(task, self.grammars)  # grammars compiled there
        except QueueFull as e:
            raise _Refused(str(e), 429, {"Retry-After": "1"}) from None
        inbox, echoed = task.inbox, task.echoed
        tokens = Tokens(self.engine.vocabulary.token_bytes)
        if job.stream:
            events = self.events(job, handles, inbox, tokens, echoed)
            if messages:
                events = _message_events(job, events)
            return _Stream(events, self.options.timeout, media_type="text/event-stream",
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
        if isinstance(results, ProcessLost):
            return self.error(str(results), 503, "unavailable_error")
        if isinstance(results, Exception):
            return self.error(f"generation failed: {results}", 500, "server_error")
        answer = job.response(results, tokens, echoed)
        return JSONResponse(anthropic.message(answer) if messages else answer)

    async def events(
        self, job: Job, handles, inbox: asyncio.Queue, tokens: Tokens, echoed
    ) -> AsyncIterator[str]:
        """The SSE stream of a job; closing it early (a client gone) cancels what still runs."""
        results: list[Result | None] = [None] * len(handles)
        offsets = [0] * len(handles)  # completions' text_offset of each choice's next token
        calls = [job.tool_stream() for _ in handles]  # with tools: each choice's call reader
        thoughts = [job.reasoning_stream() for _ in handles]  # thinking: reasoning from content

        def logprobs(index: int, lps, ids=()) -> dict | None:
            if job.sampling.logprobs is None or not lps:
                return None
            if job.chat:
                return tokens.chat(lps)
            out = tokens.completion(lps, offsets[index], ids)
            offsets[index] += sum(len(t) for t in out["tokens"])
            return out

        try:
            for index in range(len(handles)):
                if (opening := job.opening(index)) is not None:
                    yield _sse(opening)
                if echoed:  # the prompt's text first (and its logprobs)
                    text, lps = echoed[index // job.n]
                    ids = job.prompts[index // job.n]
                    yield _sse(job.chunk(index, text, None, logprobs(index, lps, ids)))
            while any(r is None for r in results):
                index, item = await inbox.get()
                if isinstance(item, StreamPiece):
                    thought, text = thoughts[index].feed(item.text) if thoughts[index] else (
                        "", item.text)  # fmt: skip
                    text = calls[index].feed(text) if calls[index] else text
                    if text or thought or item.logprobs:
                        lps = logprobs(index, item.logprobs)
                        yield _sse(job.chunk(index, text, None, lps, reasoning=thought))
                elif isinstance(item, Result):
                    results[index] = item
                    finish, stop = openai_finish(item), item.stop_string
                    thought, rest = thoughts[index].finish() if thoughts[index] else ("", "")
                    if calls[index]:  # the held-back text, or the calls
                        rest = calls[index].feed(rest)
                        more, made = calls[index].finish()
                        rest, made = rest + more, job.kept_calls(made)
                        finish = "tool_calls" if made else finish
                    else:
                        made = []
                    if rest or thought or made:
                        yield _sse(job.chunk(index, rest or None, calls=made, reasoning=thought))
                    yield _sse(job.chunk(index, None, finish, stop_reason=stop))
                elif isinstance(item, ProcessLost):  # the group ended: the stream with it
                    yield _sse(error_body(str(item), 503, "unavailable_error"))
                    return
                else:  # the engine failed this step: say so in the stream, as vLLM does
                    yield _sse(error_body(f"generation failed: {item}", 500, "server_error"))
                    return
            if job.include_usage:
                # the loop ended: every choice has its Result
                yield _sse(job.usage_chunk(cast(list[Result], results)))
            yield "data: [DONE]\n\n"
        finally:
            for handle, result in zip(handles, results, strict=True):
                if result is None:
                    self.worker.cancel(handle)


class _Refused(JaxinferError):
    """A request refused by a limit: its HTTP status, and headers (Retry-After)."""

    def __init__(self, message: str, code: int, headers: dict | None = None):
        super().__init__(message)
        self.code, self.headers = code, headers or {}
        self.kind = "rate_limit_error" if code == 429 else "invalid_request_error"


class _Stream(StreamingResponse):
    """An SSE stream whose reader must take each chunk within `timeout` seconds: one that
    stops reading ends the stream (closing its events, which cancels its requests) rather
    than hold a slot while its pieces pile up."""

    def __init__(self, content, timeout: float, **kw):
        super().__init__(content, **kw)
        self.timeout = timeout

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            await asyncio.wait_for(send(message), self.timeout)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            log.info("a stream's reader took no data for %g s; its requests end", self.timeout)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # our generator


async def _message_events(job: Job, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A chat job's SSE stream as Anthropic's events; closing it closes `events` (which
    cancels what still runs)."""
    stream = anthropic.MessageStream(job.id, job.model, len(job.prompts[0]))
    async with contextlib.aclosing(cast(AsyncGenerator[str, None], events)):
        for frame in stream.start():
            yield frame
        async for sse in events:
            data = sse.removeprefix("data: ").rstrip("\n")
            if data == "[DONE]":
                break
            for frame in stream.feed(json.loads(data)):
                yield frame
        for frame in stream.close():
            yield frame


def _anthropic_error(response: Response) -> Response:
    """An error response in Anthropic's shape, {"type": "error", "error": {type, message}}
    (the same status; Retry-After kept); any other response as it is."""
    if not isinstance(response, JSONResponse) or response.status_code < 400:
        return response
    error = json.loads(bytes(response.body))["error"]
    code = response.status_code
    shaped = JSONResponse(anthropic.error_body(error["message"], code), status_code=code)
    if "retry-after" in response.headers:
        shaped.headers["Retry-After"] = response.headers["retry-after"]
    return shaped


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


def _retrieving(load: Callable[[], Engine], options: ServerOptions) -> Callable[[], Engine]:
    """`load`, then with --rerank the check that the model can be scored so (one line, before
    warmup); served embeddings or rerank without the engine's `embeddings` option compile
    their pooled pass on first use, which a warning says."""

    def checked() -> Engine:
        engine = load()
        if options.rerank:
            rerank_tokens(engine.tokenizer, engine.cfg.vocab_size)
        if (options.embedding or options.rerank) and not engine.options.embeddings:
            log.warning("the engine was loaded without embeddings=True: the pooled pass of "
                        "embeddings and rerank compiles on first use")  # fmt: skip
        return engine

    return checked


def _until(gone: threading.Event, steps):
    """The generator `steps` until `gone` is set: then it is closed (a pooled pass gives its
    pages back) and this one returns None."""
    with contextlib.closing(steps):
        while not gone.is_set():
            try:
                waiting = next(steps)
            except StopIteration as done:
                return done.value
            yield waiting
    return None


async def _disconnect(request: HTTPRequest) -> None:
    """Returns when the client disconnects (what vLLM's with_cancellation listens for)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _slot(index: int, engine: Engine, run: dict | None) -> dict:
    """One slot as llama-server shows it: idle with the defaults, or its running request."""
    p = run["params"] if run else SamplingParams()
    n_predict = p.max_new_tokens if run else -1  # -1: chat's default, the rest of the context
    params = {
        "n_predict": n_predict, "max_tokens": n_predict,
        "seed": -1 if p.seed is None else p.seed,  # -1: a fresh random seed per request
        "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
        "repeat_penalty": p.repeat_penalty, "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty, "stop": list(p.stop),
        "ignore_eos": p.ignore_eos, "cache_prompt": p.cache_prompt,
    }  # fmt: skip
    progress = {"has_next_token": run is not None,
                "n_remain": run["remaining"] if run else -1,
                "n_decoded": run["generated"] if run else 0}  # fmt: skip
    return {"id": index, "n_ctx": engine.max_seq_len, "speculative": engine.spec is not None,
            "is_processing": run is not None, "params": params,
            "prompt": run["prompt"] if run else "", "next_token": progress}  # fmt: skip


def _processes(engine: Engine) -> list[dict]:
    """The processes the engine spans (jax.distributed; one without) and each one's devices of
    its mesh, by global device id."""
    devices = list(engine.mesh.devices.flat)
    return [
        {"process": p, "devices": [d.id for d in devices if d.process_index == p],
         "platform": devices[0].platform}
        for p in sorted({d.process_index for d in devices})
    ]  # fmt: skip


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error (a port in use, a bad host)."""
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
