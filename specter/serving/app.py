"""The OpenAI-compatible HTTP app: routes, key check, body limit, admission queue, streaming, cancellation.

``build_app`` makes the FastAPI app that ``specter serve`` puts behind Ray Serve (``actors/serve.py``);
the engine behind it is a ``Backend`` (there: the replica's verifier actor). Requests past what the
engine runs at once wait here in a bounded queue (``max_queue``): past it a request is
answered 429 with ``Retry-After`` before anything is read or started. A request whose client goes away
(a closed stream, a dropped connection) is cancelled at the engine's next round and leaves the queue.

Routes: ``GET /health`` (open), ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(with a key set, every ``/v1`` path answers 401 without ``Authorization: Bearer KEY``).
The engine decodes ``Settings.concurrency`` requests at once (continuously batched; 1 without the
lean step, or without a draft process for a drafting policy) and the queue holds the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specter.serving.api import ApiError, Model, parse, response, sse, usage_chunk
from specter.serving.api import chunk as stream_chunk
from specter.serving.text import TextStream

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20  # bytes of a request body; a larger one is refused (413) before it is read whole
DEFAULT_MAX_QUEUE = 64


class Backend(Protocol):
    """The engine behind the app."""

    def stream(self, request_id: str, prompt_ids: list[int], max_new_tokens: int,
               **options: Any) -> AsyncIterator[dict[str, Any]]:
        """``{"tokens": [...]}`` per commit, then ``{"tokens": [], "stats": {...}}``."""
        ...

    def cancel(self, request_id: str) -> None:
        """End the request at its next round (returns at once)."""
        ...

    async def alive(self) -> None:
        """Raise when the engine cannot answer."""
        ...


class Metrics(Protocol):
    def inc(self, name: str, value: float = 1.0) -> None: ...

    def set(self, name: str, value: float) -> None: ...

    def observe(self, name: str, value: float) -> None: ...


class NoMetrics:
    def inc(self, name: str, value: float = 1.0) -> None:
        pass

    def set(self, name: str, value: float) -> None:
        pass

    def observe(self, name: str, value: float) -> None:
        pass


@dataclass
class Counts:
    """What the server has done since it started (``GET /health`` shows them)."""

    running: int = 0
    waiting: int = 0
    completed: int = 0  # answered in full (finish reason stop or length)
    cancelled: int = 0  # their client went away first
    rejected: int = 0  # 429: the queue was full
    errors: int = 0  # the engine failed them
    seconds: list[float] = field(default_factory=list)  # the last requests' engine times (Retry-After)


class Admission:
    """At most ``slots`` requests on the engine, at most ``max_queue`` waiting for it."""

    def __init__(self, slots: int, max_queue: int, counts: Counts, metrics: Metrics):
        self.slots = slots
        self.free = asyncio.Semaphore(slots)
        self.max_queue, self.counts, self.metrics = max_queue, counts, metrics

    def reserve(self) -> None:
        """Take a place in the queue, or raise 429 (nothing was started)."""
        if self.counts.waiting >= self.max_queue:
            self.counts.rejected += 1
            self.metrics.inc("specter_server_rejected")
            recent = self.counts.seconds[-16:] or [1.0]
            ahead = (self.counts.waiting + 1) / self.slots  # requests ahead, per engine place
            wait = math.ceil(min(60.0, max(1.0, ahead * sum(recent) / len(recent))))
            raise ApiError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry in {wait} s",
                           None, "queue_full", {"Retry-After": str(wait)})
        self._waiting(+1)

    @contextlib.asynccontextmanager
    async def engine(self) -> AsyncIterator[None]:
        """Wait in the queue (reserved) for the engine, then hold it."""
        try:
            await self.free.acquire()
        finally:
            self._waiting(-1)
        self.counts.running += 1
        try:
            yield
        finally:
            self.counts.running -= 1
            self.free.release()

    def _waiting(self, change: int) -> None:
        self.counts.waiting += change
        self.metrics.set("specter_queue_depth", self.counts.waiting)


@dataclass
class Settings:
    """How the app answers: the served model, the key (None: no check), the limits."""

    model: Model
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body: int = MAX_BODY
    eos_token_id: int | None = None
    concurrency: int = 1  # requests the engine decodes at once (batched); the rest wait in the queue


def build_app(backend: Backend, settings: Settings, metrics: Metrics | None = None) -> FastAPI:
    """The FastAPI app of ``specter serve`` over ``backend``."""
    server = _Server(backend, settings, metrics or NoMetrics())
    app = FastAPI(title="Specter", description="OpenAI-compatible completions on an offloaded MoE model",
                  docs_url=None, redoc_url=None)
    app.state.counts = server.counts  # what it has done: ``GET /health``, and ``specter serve``'s last line

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404/405 in OpenAI's shape
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        return await server.health()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await server.guarded(request, server.models)

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> Response:
        return await server.guarded(request, lambda r: server.model(name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.guarded(request, lambda r: server.complete(r, "completion"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.guarded(request, lambda r: server.complete(r, "chat"))

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(request: Request, rest: str) -> Response:
        return await server.guarded(request, lambda r: server.unknown(r))

    app.state.server = server
    return app


class _Server:
    def __init__(self, backend: Backend, settings: Settings, metrics: Metrics):
        self.backend, self.settings, self.metrics = backend, settings, metrics
        self.counts = Counts()
        self.admission = Admission(settings.concurrency, settings.max_queue, self.counts, metrics)

    async def guarded(self, request: Request, handle: Any) -> Response:
        """The key check, then the handler; an ``ApiError`` becomes its response."""
        try:
            self._check_key(request)
            result = handle(request)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        except ApiError as exc:
            return _error(exc)

    def _check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", None, "invalid_api_key")

    async def health(self) -> JSONResponse:
        c = self.counts
        body = {"status": "ok", "model": self.settings.model.name, "running": c.running, "waiting": c.waiting,
                "completed": c.completed, "cancelled": c.cancelled, "rejected": c.rejected, "errors": c.errors}
        try:
            await asyncio.wait_for(self.backend.alive(), timeout=10.0)
        except Exception as exc:
            body.update(status="unavailable", reason=f"the engine does not answer: {exc}")
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    def _card(self) -> dict[str, Any]:
        return {"id": self.settings.model.name, "object": "model", "created": 0, "owned_by": "specter",
                "context_length": self.settings.model.context}

    def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._card()]})

    def model(self, name: str) -> JSONResponse:
        if name != self.settings.model.name:
            raise ApiError(404, f"model {name!r} not found: this server serves {self.settings.model.name!r}",
                           "model", "model_not_found")
        return JSONResponse(self._card())

    def unknown(self, request: Request) -> JSONResponse:
        raise ApiError(404, f"{request.method} {request.url.path}: no such endpoint (this server has /v1/models, "
                            "/v1/completions and /v1/chat/completions)", None, "unknown_url")

    async def complete(self, request: Request, kind: str) -> Response:
        body = await _read_body(request, self.settings.max_body)
        req = parse(body, kind, self.settings.model)
        self.admission.reserve()  # 429 here, before anything starts
        events = self._run(req)
        # The first event is awaited here (the queue, the prefill): a client gone meanwhile cancels this
        # handler inside the generator, which then cancels the request and gives its place back; an
        # engine that fails before the first token answers with a status, not a broken stream.
        first = await anext(events)
        if req.stream:
            return StreamingResponse(self._sse(req, _chain(first, events)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces, end = [], None
        async for kind_, value in _chain(first, events):
            if kind_ == "text":
                pieces.append(value)
            else:
                end = value
        assert end is not None
        finish, tokens, stats = end
        return JSONResponse(response(req, "".join(pieces), finish, tokens, stats))

    async def _sse(self, req: Any, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[bytes]:
        first = True
        try:
            async for kind, value in events:
                if kind == "text":
                    if value or first:
                        yield sse(stream_chunk(req, value, first=first))
                        first = False
                    continue
                finish, tokens, stats = value
                yield sse(stream_chunk(req, None if req.kind == "chat" else "", finish, first=first))
                if req.include_usage:
                    yield sse(usage_chunk(req, tokens, stats))
        except ApiError as exc:  # the engine failed mid-stream: the client's SDK raises this
            yield sse(exc.body())
        yield sse("[DONE]")

    async def _run(self, req: Any) -> AsyncIterator[tuple[str, Any]]:
        """("text", piece)… then ("end", (finish_reason, completion tokens, stats)). Holds a queue place
        (``Admission.reserve``) on entry; cancels the engine's request when left early."""
        text = TextStream(self.settings.model.tokenizer, req.stop)
        stats: dict[str, Any] = {}
        tokens, finished, failed, started = 0, False, False, 0.0
        options = {"temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                   "eos_token_id": self.settings.eos_token_id}
        try:
            async with self.admission.engine():
                started = time.monotonic()
                try:
                    async for out in self.backend.stream(req.id, req.prompt_ids, req.max_tokens, **options):
                        if out["tokens"] and not text.stopped:
                            if tokens == 0:
                                self.metrics.observe("specter_ttft_seconds", time.monotonic() - started)
                            tokens += len(out["tokens"])
                            piece = text.add(out["tokens"])
                            if text.stopped:
                                self.backend.cancel(req.id)  # the rest of this round is not wanted
                            yield "text", piece
                        stats = out.get("stats", stats)
                except ApiError:
                    raise
                except Exception as exc:
                    failed = True
                    self.counts.errors += 1
                    log.exception("request %s failed", req.id)
                    raise ApiError(503, f"the engine failed this request: {type(exc).__name__}: {exc}", None,
                                   "engine_error") from None
                finished = True
            self.counts.seconds = (self.counts.seconds + [time.monotonic() - started])[-16:]
            if not text.stopped:
                yield "text", text.finish()
            last = text.tokens[-1:] if text.tokens else []
            eos = self.settings.eos_token_id
            finish = "stop" if text.stopped or (eos is not None and last == [eos]) or tokens < req.max_tokens \
                else "length"
            self.counts.completed += 1
            yield "end", (finish, tokens, stats)
        finally:
            if not finished:
                self.backend.cancel(req.id)
                if not failed:
                    self.counts.cancelled += 1
                    self.metrics.inc("specter_server_cancelled")


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes: by its Content-Length
    before reading, else while reading it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body: {int(declared)} bytes, over the limit of {limit}", None, "body_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body: over the limit of {limit} bytes", None, "body_too_large")
        parts.append(part)
    return b"".join(parts)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
