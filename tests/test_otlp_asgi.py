"""A real instrumented ASGI app (starlette + opentelemetry-instrumentation-asgi under uvicorn, in its
own process) exports its server spans over OTLP/HTTP into the receiver; the stored rows must carry
the client's real source port, the server port and the captured X-Request-Id, under the old, the
new and the duplicated HTTP semantic conventions, and flag a peer rewritten by proxy headers."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from auditor.store import Store
from collectors.otlp_http import OtlpHttpReceiver
from collectors.spanwriter import SpanWriter

APP = r"""
import os, socket, sys
import uvicorn
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

provider = TracerProvider(resource=Resource.create({"service.name": "asgi-app", "process.pid": os.getpid()}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=os.environ["OTLP_URL"])))
trace.set_tracer_provider(provider)

async def completions(request):
    return JSONResponse({"ok": True})

app = OpenTelemetryMiddleware(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]))
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(128)  # connections wait in the backlog until uvicorn serves them
print(sock.getsockname()[1], flush=True)
config = uvicorn.Config(app, log_level="warning", proxy_headers=os.environ.get("PROXY") == "1",
                        forwarded_allow_ips="*")
uvicorn.Server(config).run(sockets=[sock])
"""


@pytest.fixture
def receiver(store: Store) -> Iterator[OtlpHttpReceiver]:
    writer = SpanWriter(store).start()
    r = OtlpHttpReceiver(writer, port=0, service_host="node-a").start()
    yield r
    r.stop()
    writer.stop()


def _start_app(receiver: OtlpHttpReceiver, semconv: str, proxy: bool) -> tuple[subprocess.Popen[str], int]:
    env = os.environ | {"OTLP_URL": receiver.url, "PROXY": "1" if proxy else "0",
                        "OTEL_SEMCONV_STABILITY_OPT_IN": semconv,
                        "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST": "x-request-id"}
    app = subprocess.Popen([sys.executable, "-c", APP], env=env, stdout=subprocess.PIPE, text=True)
    assert app.stdout is not None
    line = app.stdout.readline()
    assert line.strip().isdigit(), "the app did not start"
    return app, int(line)


def _call(port: int, headers: dict[str, str]) -> int:
    """One request on a fresh connection; returns the client's own (ephemeral) source port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.connect()
    client_port = int(conn.sock.getsockname()[1])
    conn.request("POST", "/v1/completions", body=b"{}", headers={"Content-Type": "application/json"} | headers)
    assert conn.getresponse().read() == b'{"ok":true}'
    conn.close()
    return client_port


def _server_spans(store: Store, want: int) -> list[tuple[object, ...]]:
    deadline = time.monotonic() + 10
    while True:
        with store.engine.connect() as conn:
            found = [tuple(r) for r in conn.execute(text(
                "SELECT peer_addr, peer_port, server_port, request_id, route, http_status, service, host,"
                " peer_rewritten, process_pid FROM spans WHERE role = 'http_server' ORDER BY start_ns"))]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.parametrize("semconv", ["", "http", "http/dup"], ids=["old", "new", "dup"])
def test_asgi_server_spans_carry_the_connection(semconv: str, receiver: OtlpHttpReceiver, store: Store) -> None:
    app, port = _start_app(receiver, semconv, proxy=False)
    try:
        client_port = _call(port, {"X-Request-Id": "req-42"})
        (span,) = _server_spans(store, 1)
    finally:
        app.terminate()
        app.wait(10)
    assert span[:8] == ("127.0.0.1", client_port, port, "req-42", "/v1/completions", 200, "asgi-app", "node-a")
    assert span[8] == 0 and span[9] == app.pid


def test_proxy_headers_rewrite_is_flagged(receiver: OtlpHttpReceiver, store: Store) -> None:
    app, port = _start_app(receiver, "", proxy=True)
    try:
        _call(port, {"X-Forwarded-For": "203.0.113.7", "X-Request-Id": "via-proxy"})
        (span,) = _server_spans(store, 1)
    finally:
        app.terminate()
        app.wait(10)
    peer_addr, peer_port, server_port, request_id = span[:4]
    assert (peer_addr, server_port, request_id) == ("203.0.113.7", port, "via-proxy")
    assert not peer_port  # uvicorn sets port 0 (older) or none (newer releases)
    assert span[8] == 1  # peer_rewritten: this span must not be joined to a connection by port
