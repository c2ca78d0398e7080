"""A gateway in front of an engine: proxies OpenAI requests, and propagates a cancel or not.

``--propagate yes``: when its own client leaves, the gateway closes the upstream connection, so the
engine sees the disconnect too. ``--propagate no``: it keeps reading the upstream response to the
end and throws it away - the classic gateway that turns every client timeout into a zombie.

Traced like a production proxy: an ASGI server span (OpenTelemetry middleware) and, inside it, an
HTTP client span per upstream call whose context goes upstream in ``traceparent`` (unless
``--trace-context no``: a proxy that forwards no trace context).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from replay.engine.protocol import ApiError
from replay.engine.tracing import PROPAGATOR, Tracing, TracingConfigError

log = logging.getLogger(__name__)

# Request headers passed upstream; hop-by-hop ones (connection, content-length...) are not.
FORWARDED_HEADERS = ("content-type", "accept", "authorization", "x-request-id", "tracestate")
CONNECT_TIMEOUT_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class GatewaySettings:
    upstream: str
    propagate: bool = True
    otlp: str | None = None
    service_name: str = "ref-gateway"
    live: str | None = None
    trace_context: bool = True  # send traceparent upstream; False: the engine's spans start traces of their own


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        parts = urlsplit(settings.upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TracingConfigError(f"--gateway {settings.upstream!r} is not an engine address; "
                                     "use e.g. --gateway http://127.0.0.1:8000")
        self.settings = settings
        self.upstream = settings.upstream.rstrip("/")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tracing = Tracing(settings.service_name, settings.otlp, settings.live)
        self.client: httpx.AsyncClient | None = None
        self.cancelled_upstream = 0

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_SECONDS)
        self.client = httpx.AsyncClient(timeout=timeout)
        try:
            yield
        finally:
            await self.client.aclose()
            self.tracing.shutdown()

    def app(self) -> ASGIApp:
        routes = [
            Route("/v1/chat/completions", self.proxy, methods=["POST"]),
            Route("/v1/completions", self.proxy, methods=["POST"]),
            Route("/v1/models", self.proxy, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        starlette = Starlette(routes=routes, lifespan=self.lifespan)
        return OpenTelemetryMiddleware(
            starlette, tracer_provider=self.tracing.provider, exclude_spans=["receive", "send"],
            excluded_urls="health,metrics", http_capture_headers_server_request=["x-request-id"])

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "upstream": self.upstream, "propagate": self.settings.propagate})

    async def proxy(self, request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        return ProxyResponse(self, request.method, request.url.path, headers, body)


class ProxyResponse(Response):
    """Relays one upstream response, watching the client; on its departure cancels or drains upstream."""

    def __init__(self, gateway: Gateway, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        super().__init__()
        self.gateway = gateway
        self.method = method
        self.path = path
        self.forward_headers = headers
        self.request_body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = self.gateway
        assert gateway.client is not None
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, disconnected))
        url = gateway.upstream + self.path
        span_attributes: dict[str, AttributeValue] = {"http.method": self.method, "http.url": url,
                           "net.peer.name": gateway.upstream_host, "net.peer.port": gateway.upstream_port}
        try:
            with gateway.tracing.tracer.start_as_current_span(
                    self.method, kind=SpanKind.CLIENT, attributes=span_attributes) as span:
                headers = dict(self.forward_headers)
                if gateway.settings.trace_context:
                    PROPAGATOR.inject(headers)  # the client span is current: upstream becomes its child
                upstream_request = gateway.client.build_request(self.method, url, headers=headers,
                                                                content=self.request_body)
                sending = asyncio.create_task(gateway.client.send(upstream_request, stream=True))
                gone = asyncio.create_task(disconnected.wait())
                await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
                if not sending.done() and gateway.settings.propagate:
                    # The client left before the upstream answered (a non-streaming request, or a
                    # long queue): cancelling the send closes the upstream connection.
                    sending.cancel()
                    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                        await sending
                    gateway.cancelled_upstream += 1
                    span.set_attribute("gateway.upstream_cancelled", True)
                    return
                try:
                    upstream = await sending
                except httpx.HTTPError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    error = ApiError(502, f"upstream {gateway.upstream} failed: {exc!r}")
                    await JSONResponse(error.body(), status_code=502)(scope, receive, send)
                    return
                span.set_attribute("http.status_code", upstream.status_code)
                await self._relay(upstream, send, disconnected, span)
        finally:
            watcher.cancel()

    async def _relay(self, upstream: httpx.Response, send: Send, disconnected: asyncio.Event, span: Span) -> None:
        passed = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in upstream.headers.items()
                  if name in ("content-type", "cache-control", "x-request-id")]
        pump = asyncio.create_task(self._pump(upstream, send, disconnected, passed))
        gone = asyncio.create_task(disconnected.wait())
        try:
            done, _ = await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                pump.result()
                return
            if self.gateway.settings.propagate:
                # Closing an unfinished response closes its connection: the engine sees a FIN.
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
                self.gateway.cancelled_upstream += 1
                span.set_attribute("gateway.upstream_cancelled", True)
            else:
                await pump  # drain upstream to the end, as a non-propagating gateway does
        finally:
            gone.cancel()
            await upstream.aclose()

    @staticmethod
    async def _pump(upstream: httpx.Response, send: Send, disconnected: asyncio.Event,
                    headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
        try:
            async for piece in upstream.aiter_raw():
                if not disconnected.is_set():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
        except httpx.HTTPError as exc:
            # The upstream broke mid-response: end ours (the client sees a truncated body), go on.
            log.warning("upstream response broke off: %r", exc)
        if not disconnected.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watch_disconnect(receive: Receive, disconnected: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    disconnected.set()


def build_gateway(settings: GatewaySettings) -> ASGIApp:
    return Gateway(settings).app()
