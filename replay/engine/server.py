"""The reference engine's OpenAI-compatible HTTP server (Starlette, served by uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE and not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. The app is wrapped in OpenTelemetry's ASGI
middleware exactly as a production server would be (send/receive sub-spans off, ``x-request-id``
captured); the engine adds its own ``llm_request`` span when a request finishes.

Disconnects: while a response is in flight a watcher task waits on ``receive()`` for
``http.disconnect`` and records the moment; the behaviour (see :mod:`replay.engine.behaviors`)
decides what happens next.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from replay.engine.behaviors import handler_stops_on_disconnect, react_to_disconnect
from replay.engine.compute import make_backend
from replay.engine.core import Engine, RequestHandle
from replay.engine.protocol import (
    ApiError,
    GenerationRequest,
    chunk,
    full_response,
    now_created,
    parse_body,
    parse_chat,
    parse_completion,
    usage,
)
from replay.engine.signals import (
    BusyAfterLastByte,
    ContextBreak,
    OneAtATime,
    StyleMetrics,
    mark_final_send,
)
from replay.engine.tokens import prompt_seed
from replay.engine.tracing import Tracing, emit_llm_request_span, trace_headers_of, work_key_of
from replay.engine.truth import TruthLog, truth_record

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    model: str = "ref-llm-1b"
    behavior: str = "abort"
    late_seconds: float = 2.0
    max_batch: int = 8
    step_ms: float = 20.0
    prefill_chunk: int = 64
    device: str = "cpu"
    otlp: str | None = None
    truth_log: str | None = None
    service_name: str = "ref-engine"
    trace_aborted: bool = False
    gauges_on_steps: bool = False  # the style's gauges read at each step only, as vLLM's
    live: str | None = None  # HOST:PORT of the auditor's live notices
    # Signal profile (replay.engine.signals): what an observer gets, shaped like a real engine's.
    engine_span: str = "llm_request"  # "none": HTTP server spans only
    metrics_names: str = "ref"
    send_spans: bool = False
    one_at_a_time: bool = False
    process_pid: bool = True  # process.pid in the span resource
    duplicate_server_span: bool = False
    # The response's span ends this long after its last byte was sent (signals.BusyAfterLastByte).
    span_end_lag_ms: float = 0.0


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class EngineMetrics:
    """Prometheus metrics of one engine, in their own registry."""

    def __init__(self, engine: Engine, style: str = "ref", gauges_on_steps: bool = False,
                 model: str = "ref-llm-1b") -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ref_engine_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=self.registry)
        self.generation_tokens = Counter("ref_engine_generation_tokens", "Tokens generated.",
                                         registry=self.registry)
        self.prompt_tokens = Counter("ref_engine_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.disconnects = Counter("ref_engine_client_disconnects", "Clients that left before their response ended.",
                                   registry=self.registry)
        self.tokens_after_disconnect = Counter("ref_engine_tokens_after_disconnect",
                                               "Tokens generated after the client had left.", registry=self.registry)
        self.errors = Counter("ref_engine_http_errors", "Requests refused with a client error.", ["status"],
                              registry=self.registry)
        self.step_seconds = Histogram("ref_engine_step_seconds", "Duration of one engine step.",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
                                      registry=self.registry)
        running = Gauge("ref_engine_num_requests_running", "Requests in the batch.", registry=self.registry)
        waiting = Gauge("ref_engine_num_requests_waiting", "Requests in the waiting queue.", registry=self.registry)
        running.set_function(lambda: engine.counts()[0])
        waiting.set_function(lambda: engine.counts()[1])
        self.style = StyleMetrics(self.registry, style, engine.counts, on_steps=gauges_on_steps, model=model,
                                  tokens_held=engine.tokens_held)


class EngineServer:
    """Owns the engine, its tracing, truth log and metrics, and builds the ASGI app."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.tracing = Tracing(settings.service_name, settings.otlp, settings.live, process_pid=settings.process_pid)
        self.truth = TruthLog(settings.truth_log) if settings.truth_log else None
        backend = make_backend(settings.device, settings.step_ms)
        self.engine = Engine(backend, max_batch=settings.max_batch, prefill_chunk=settings.prefill_chunk,
                             on_finish=self._on_finish, on_step=self._on_step)
        self.metrics = EngineMetrics(self.engine, settings.metrics_names, settings.gauges_on_steps, settings.model)

    # -- engine thread callbacks ---------------------------------------------------------------

    def _on_step(self, seconds: float, tokens: int, prefilled: bool) -> None:
        self.metrics.step_seconds.observe(seconds)
        self.metrics.generation_tokens.inc(tokens)
        self.metrics.style.step(tokens, prefilled)

    def _on_finish(self, request: RequestHandle) -> None:
        self.tracing.work_ended(request)
        reason = request.finish_reason or "abort"
        self.metrics.requests.labels(reason).inc()
        generated_ns = (request.finished_at or 0) - (request.first_token_at or 0) if request.first_token_at else 0
        self.metrics.style.finish(reason, request.tokens_generated, max(0, generated_ns) / 1e9)
        self.metrics.prompt_tokens.inc(request.prompt_tokens)
        if request.tokens_after_disconnect:
            self.metrics.tokens_after_disconnect.inc(request.tokens_after_disconnect)
        # Like vLLM 0.33: an aborted request leaves no llm_request span unless asked for.
        if (reason != "abort" or self.settings.trace_aborted) and self.settings.engine_span != "none":
            # The reference's own names are the ideal signal set; with vLLM's, its span as vLLM's.
            emit_llm_request_span(self.tracing.tracer, request, self.settings.engine_span,
                                  names_model=self.settings.metrics_names == "ref")
        if self.truth is not None:
            self.truth.write(truth_record(request, self.settings.behavior))

    # -- ASGI ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.engine.stop)
            self.tracing.shutdown()
            if self.truth is not None:
                self.truth.close()

    def app(self) -> ASGIApp:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        starlette = Starlette(routes=routes, lifespan=self.lifespan,
                              exception_handlers={HTTPException: self._http_error, Exception: self._crash})
        inner: ASGIApp = starlette
        if self.settings.duplicate_server_span:
            inner = ContextBreak(OpenTelemetryMiddleware(
                starlette, tracer_provider=self.tracing.provider, exclude_spans=["receive", "send"],
                excluded_urls="health,metrics", http_capture_headers_server_request=["x-request-id"]))
        traced = OpenTelemetryMiddleware(
            inner, tracer_provider=self.tracing.provider,
            exclude_spans=["receive"] if self.settings.send_spans else ["receive", "send"],
            client_response_hook=mark_final_send if self.settings.send_spans else None,
            excluded_urls="health,metrics", http_capture_headers_server_request=["x-request-id"])
        if self.settings.span_end_lag_ms:
            traced = BusyAfterLastByte(traced, self.settings.span_end_lag_ms / 1000)
        return OneAtATime(traced) if self.settings.one_at_a_time else traced

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        self.metrics.errors.labels(str(exc.status_code)).inc()
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=exc.headers)

    async def _crash(self, request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        body = {"error": {"message": "internal error; see the engine log", "type": "InternalServerError",
                          "param": None, "code": 500}}
        return JSONResponse(body, status_code=500)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.settings.model, "behavior": self.settings.behavior})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "ref-engine"}]})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, kind: str) -> Response:
        arrival_at = time.time_ns()
        try:
            body = parse_body(await request.body())
            parsed = (parse_chat if kind == "chat" else parse_completion)(body, self.settings.model)
            handle = self._handle(request, parsed, kind, arrival_at)
            events = attach_event_queue(handle)
            handle.work_key = work_key_of(handle.request_id)
            self.engine.submit(handle)
            self.tracing.work_started(handle)
        except ApiError as error:
            self.metrics.errors.labels(str(error.status)).inc()
            return error_response(error)
        except ClientDisconnect:
            # Gone before its body was read (or, served one at a time, while it waited): nothing
            # reached the engine. The truth log still says so: zero tokens, ended when noticed.
            self._never_ran(request, arrival_at)
            return Response(status_code=499)
        except KeyError:
            self.metrics.errors.labels("409").inc()
            return error_response(ApiError(409, f"request id {handle.request_id} is already in flight; "
                                                "send a unique X-Request-Id"))
        return GenerationResponse(self, handle, parsed, events)

    def _never_ran(self, request: Request, arrival_at: int) -> None:
        if self.truth is None or not request.headers.get("x-request-id"):
            return
        now = time.time_ns()
        client = request.client
        handle = RequestHandle(request_id=request.headers["x-request-id"], prompt_tokens=0, max_tokens=0, seed=0,
                               stream=False, model=self.settings.model, arrival_at=arrival_at,
                               client_addr=client.host if client else None, client_port=client.port if client else None,
                               finished_at=now, finish_reason="abort", disconnect_at=now, phase_at_disconnect="queued",
                               tokens_at_disconnect=0)
        self.truth.write(truth_record(handle, self.settings.behavior))

    def _handle(self, request: Request, parsed: GenerationRequest, kind: str, arrival_at: int) -> RequestHandle:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        supplied = request.headers.get("x-request-id")
        if supplied is not None and (not supplied.strip() or len(supplied) > MAX_REQUEST_ID_CHARS
                                     or not supplied.isprintable()):
            raise ApiError(400, f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} printable characters",
                           param="X-Request-Id")
        client = request.client
        return RequestHandle(
            request_id=prefix + (supplied or uuid.uuid4().hex), prompt_tokens=parsed.prompt_tokens,
            max_tokens=parsed.max_tokens, seed=prompt_seed(parsed.prompt_text), stream=parsed.stream,
            model=parsed.model, arrival_at=arrival_at,
            client_addr=client.host if client else None, client_port=client.port if client else None,
            stop_words=parsed.stop_words, temperature=parsed.temperature, top_p=parsed.top_p, n=parsed.n,
            trace_headers=trace_headers_of(request.headers))


def attach_event_queue(handle: RequestHandle) -> asyncio.Queue[tuple[str, str]]:
    """Route the engine's events for ``handle`` into a queue on the running loop (before submit)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def deliver(kind: str, payload: str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

    handle.deliver = deliver
    return events


class GenerationResponse(Response):
    """Streams (or collects) one request's tokens, and watches for the client leaving meanwhile."""

    def __init__(self, server: EngineServer, handle: RequestHandle, parsed: GenerationRequest,
                 events: asyncio.Queue[tuple[str, str]]) -> None:
        super().__init__()
        self.server = server
        self.handle = handle
        self.parsed = parsed
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self.events
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(self._watch(receive, disconnected))
        try:
            if self.parsed.stream:
                await self._stream(send, events, disconnected)
            else:
                await self._collect(send, events, disconnected)
        finally:
            watcher.cancel()

    async def _watch(self, receive: Receive, disconnected: asyncio.Event) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        server = self.server
        server.engine.note_disconnect(self.handle, time.time_ns())
        server.metrics.disconnects.inc()
        disconnected.set()
        react_to_disconnect(server.settings.behavior, server.engine, self.handle, server.settings.late_seconds)

    async def _next(self, events: asyncio.Queue[tuple[str, str]], disconnected: asyncio.Event,
                    watch: bool) -> tuple[str, str] | None:
        """The next engine event, or None when the client left and this handler listens for that."""
        if not watch:
            return await events.get()
        if disconnected.is_set():
            return None
        getter = asyncio.ensure_future(events.get())
        waiter = asyncio.ensure_future(disconnected.wait())
        done, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if getter in done:
            return getter.result()
        getter.cancel()
        return None

    async def _stream(self, send: Send, events: asyncio.Queue[tuple[str, str]],
                      disconnected: asyncio.Event) -> None:
        handle, parsed = self.handle, self.parsed
        watch = handler_stops_on_disconnect(self.server.settings.behavior)
        created = now_created()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-request-id", handle.request_id.encode())]})

        async def emit(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        first = True
        while True:
            event = await self._next(events, disconnected, watch)
            if event is None:
                return  # the client left; the behaviour already decided the engine's fate
            kind, payload = event
            if not watch and disconnected.is_set():
                # no-check: writing to a closed connection is how this path finds out.
                self.server.engine.abort(handle.request_id)
                return
            if kind == "token":
                await emit(chunk(parsed.kind, handle.request_id, parsed.model, created, payload, None, first=first))
                first = False
                continue
            await emit(chunk(parsed.kind, handle.request_id, parsed.model, created,
                             "" if parsed.kind == "chat" else None, payload, first=first))
            if parsed.include_usage:
                await emit({"id": handle.request_id, "object": "chat.completion.chunk" if parsed.kind == "chat"
                            else "text_completion", "created": created, "model": parsed.model, "choices": [],
                            "usage": usage(handle.prompt_tokens, handle.tokens_generated)})
            await emit("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

    async def _collect(self, send: Send, events: asyncio.Queue[tuple[str, str]],
                       disconnected: asyncio.Event) -> None:
        handle, parsed = self.handle, self.parsed
        watch = handler_stops_on_disconnect(self.server.settings.behavior)
        pieces: list[str] = []
        while True:
            event = await self._next(events, disconnected, watch)
            if event is None:
                return
            kind, payload = event
            if kind == "token":
                pieces.append(payload)
                continue
            body = full_response(parsed.kind, handle.request_id, parsed.model, now_created(), "".join(pieces),
                                 payload, handle.prompt_tokens, handle.tokens_generated)
            response = JSONResponse(body, headers={"x-request-id": handle.request_id})
            await send({"type": "http.response.start", "status": 200, "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body, "more_body": False})
            return
