"""OTLP/HTTP receiver: ``POST /v1/traces`` with protobuf or JSON bodies, plain or gzip; metrics
and logs (``/v1/metrics``, ``/v1/logs``) are checked, counted and dropped.

Served by a thread a connection (``auditor.http1``) rather than an ASGI stack: every request ends
in a blocking wait for a SQLite commit, which a thread does naturally while an event loop would
need a thread pool anyway. The pieces that keep it up under garbage are small and explicit: bad
request lines and headers answered 400/431/505 by ``auditor.http1``, a socket timeout per
connection (slow senders), a cap on concurrent connections (extra ones get 503 at once), a body
size limit checked before reading and again while inflating gzip, and a check of the write queue
before a body is read so a flood is refused cheaply.

Answers follow the OTLP specification: 200 + ExportTraceServiceResponse (``partial_success`` when
normalization rejected spans; an empty Export{Metrics,Logs}ServiceResponse for dropped signals), 400 malformed (google.rpc.Status body), 401 bad or missing bearer
token, 404 other paths, 405 other methods, 411 neither Content-Length nor chunked, 413 too large,
415 unsupported media type or encoding, 429 queue full and 503 store unavailable, both with
``Retry-After``, 501 a transfer coding other than chunked. Chunked bodies (as streaming HTTP
clients send them) are read chunk by chunk against the same size limit.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from auditor import http1
from auditor.semconv import sender_address
from collectors import otlp_codec as codec
from collectors.normalize import NormalizeResult, normalize_body, normalize_request
from collectors.otlp_wire import Unusual
from collectors.spanwriter import QUEUE_FULL, BackPressure, SpanWriter

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
# Servers pointed at the generic OTEL_EXPORTER_OTLP_ENDPOINT send all three signals; metrics and
# logs are accepted and dropped so that their exporters do not log a 404 on every export.
SIGNAL_PATHS = {TRACES_PATH: "traces", "/v1/metrics": "metrics", "/v1/logs": "logs"}
DROPPED_SIGNALS = ("metrics", "logs")


class _Server(http1.Server):
    def __init__(self, address: tuple[str, int], receiver: OtlpHttpReceiver) -> None:
        self.receiver = receiver
        super().__init__(address, _Handler, max_connections=receiver.max_connections,
                         socket_timeout_s=receiver.socket_timeout_s, name="OTLP/HTTP")

    def refused_busy(self) -> None:
        self.receiver._count_status(503)


MAX_CHUNK_LINE = 1024  # a chunk-size line with extensions, or a trailer line
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


def read_chunked(rfile: Any, limit: int) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (RFC 9112 §7.1), at most ``limit`` bytes; trailers
    are read and ignored. Raises BodyError: 400 for bad framing, 413 past the limit."""
    parts: list[bytes] = []
    total = 0
    while True:
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if not line.endswith(b"\n"):
            raise codec.BodyError(400, "chunked body ended early or has a chunk-size line over "
                                       f"{MAX_CHUNK_LINE} bytes")
        size_text = line.split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):  # hex digits only: int() would take "0x", "_", "+"
            raise codec.BodyError(400, f"bad chunk size {size_text[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > limit:
            raise codec.BodyError(413, f"chunked body is over the limit of {limit} bytes")
        chunk = rfile.read(size)
        if len(chunk) != size or rfile.read(2) != b"\r\n":
            raise codec.BodyError(400, "chunked body ended inside a chunk or a chunk lacks its CRLF")
        parts.append(chunk)
    for _ in range(64):  # trailer fields, then the empty line
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
        if not line.endswith(b"\n"):
            break
    raise codec.BodyError(400, "chunked body has no end of trailers")


class _Handler(http1.Handler):
    server: _Server
    server_name = "auditor-otlp"

    def _signal(self) -> str | None:
        """The signal this path is for, or None after answering 404."""
        signal = SIGNAL_PATHS.get(urlsplit(self.path).path)
        if signal is None:
            self._answer(404, codec.encode_status("", 5, f"no such endpoint {self.path[:100]!r}; "
                                                      f"OTLP traces go to {TRACES_PATH}"), drain=True)
        return signal

    def _wrong_method(self) -> None:
        if self._signal() is not None:
            path = urlsplit(self.path).path
            self._answer(405, codec.encode_status("", 12, f"use POST on {path}"),
                         extra={"Allow": "POST"}, drain=True)

    do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _wrong_method

    def do_POST(self) -> None:
        signal = self._signal()
        if signal is not None:
            self.server.receiver._handle(_Exchange(self, signal))

    # -- answering --------------------------------------------------------------------------
    def answer(self, status: int, body: bytes, *, content_type: str,
               extra: dict[str, str] | None = None) -> None:
        self.server.receiver._count_status(status)
        super().answer(status, body, content_type=content_type, extra=extra)

    def _answer(self, status: int, body: bytes, *, content_type: str = codec.PROTOBUF,
                extra: dict[str, str] | None = None, drain: bool = False) -> None:
        """Send a complete answer. ``drain``: the body was not read, so the connection must close."""
        unread = self.headers.get("Transfer-Encoding") or (self.headers.get("Content-Length") or "").strip() != "0"
        if drain and unread:
            self.close_connection = True
        self.answer(status, body, content_type=content_type, extra=extra)


class OtlpHttpReceiver:
    """An OTLP/HTTP trace endpoint on its own thread, writing through a :class:`SpanWriter`."""

    def __init__(self, writer: SpanWriter, host: str = "127.0.0.1", port: int = 4318, *,
                 token: str | None = None, max_body_bytes: int = 8 << 20, service_host: str = "",
                 max_connections: int = 64, socket_timeout_s: float = 15.0) -> None:
        self.writer = writer
        self.host = host
        self.requested_port = port
        self.token = token
        self.max_body_bytes = max_body_bytes
        # Given (a daemon's host id), every span is stored under it: the daemon's correlator reads
        # only its own host's rows. Otherwise the span's host.name, else this machine's name.
        self.service_host = service_host
        self._fallback_host = socket.gethostname()
        self.max_connections = max_connections
        self.socket_timeout_s = socket_timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.requests_by_status: Counter[int] = Counter()
        self.accepted_spans = 0
        self.rejected_spans = 0
        self.dropped_requests: Counter[str] = Counter()  # metrics and logs, accepted and not kept
        self.dropped_items: Counter[str] = Counter()  # their data points and log records

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> OtlpHttpReceiver:
        """Bind and serve; raises OSError (e.g. address in use) so the daemon can say so."""
        self._server = _Server((self.host, self.requested_port), self)
        # The serving loop wakes this often only to see a stop; each wake-up costs CPU on an idle host.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 1.0},
                                        name="otlp-http", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("receiver not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = self._thread = None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"accepted_spans": self.accepted_spans, "rejected_spans": self.rejected_spans,
                    "requests_by_status": dict(self.requests_by_status),
                    "dropped_requests": dict(self.dropped_requests),
                    "dropped_items": dict(self.dropped_items),
                    "queue_spans": self.writer.queue_depth_spans}

    def _count_status(self, status: int) -> None:
        with self._lock:
            self.requests_by_status[status] += 1

    # -- one request ------------------------------------------------------------------------
    def _authorized(self, header: str | None) -> bool:
        return http1.bearer_matches(header, self.token)

    def _handle(self, exchange: _Exchange) -> None:
        """One POST: admit it, read and decode its body, then store spans or drop the rest."""
        handler = exchange.handler
        if not self._admitted(exchange):
            return
        # Dropped signals never reach the write queue, so a backed-up queue does not refuse them.
        reserve = self.writer.check_capacity if exchange.signal == "traces" else _no_reservation
        body = self._read_body(exchange, reserve)
        if body is None:
            return
        try:
            plain = codec.inflate(body, handler.headers.get("Content-Encoding"), self.max_body_bytes)
            if exchange.signal in DROPPED_SIGNALS:
                self._drop(exchange, codec.decode_dropped(plain, exchange.content_type, exchange.signal))
                return
            result = self._normalize(plain, exchange.content_type, sender_address(handler.client_address))
        except codec.BodyError as exc:
            exchange.fail(exc.status, codec.RPC_INVALID_ARGUMENT, exc.message)
            return
        except Exception as exc:  # the parser met something nobody expected: still the sender's fault
            log.warning("OTLP/HTTP body could not be decoded: %r", exc)
            exchange.fail(400, codec.RPC_INVALID_ARGUMENT, f"body could not be decoded ({type(exc).__name__})")
            return
        self._store(exchange, result, len(plain))

    def _admitted(self, exchange: _Exchange) -> bool:
        """Bearer token and media type, checked before any of the body is read."""
        if not self._authorized(exchange.handler.headers.get("Authorization")):
            exchange.fail(401, codec.RPC_UNAUTHENTICATED, "missing or wrong bearer token",
                          extra={"WWW-Authenticate": 'Bearer realm="otlp"'}, drain=True)
            return False
        if exchange.content_type not in codec.CONTENT_TYPES:
            exchange.fail(415, codec.RPC_INVALID_ARGUMENT,
                          f"Content-Type {exchange.content_type or 'missing'!r} is not supported; "
                          f"send {codec.PROTOBUF} or {codec.JSON}", drain=True)
            return False
        return True

    def _read_body(self, exchange: _Exchange, reserve: Callable[[int], None]) -> bytes | None:
        """The raw body under the size limit, or None after answering why not. ``reserve`` asks
        the write queue for room before the body is read (raises BackPressure)."""
        headers = exchange.handler.headers
        transfer_encoding = (headers.get("Transfer-Encoding") or "").strip().lower()
        length_header = headers.get("Content-Length")
        if transfer_encoding == "chunked":
            return self._read_chunked_body(exchange, reserve)
        if transfer_encoding:
            exchange.fail(501, codec.RPC_INVALID_ARGUMENT,  # RFC 9112 §6.1: a coding it does not implement
                          f"Transfer-Encoding {transfer_encoding[:40]!r} is not supported; send a "
                          "Content-Length or chunked", drain=True)
            return None
        if length_header is None:
            exchange.fail(411, codec.RPC_INVALID_ARGUMENT, "send the body with a Content-Length or chunked",
                          drain=True)
            return None
        return self._read_sized_body(exchange, length_header, reserve)

    def _read_chunked_body(self, exchange: _Exchange, reserve: Callable[[int], None]) -> bytes | None:
        try:
            reserve(0)
        except BackPressure as exc:
            self._back_pressure(exchange, exc, drain=True)
            return None
        try:
            return read_chunked(exchange.handler.rfile, self.max_body_bytes)
        except codec.BodyError as exc:
            exchange.handler.close_connection = True  # where the next request starts is unknown
            exchange.fail(exc.status, codec.RPC_INVALID_ARGUMENT, exc.message)
            return None

    def _read_sized_body(self, exchange: _Exchange, length_header: str,
                         reserve: Callable[[int], None]) -> bytes | None:
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError(length_header)
        except ValueError:
            exchange.fail(400, codec.RPC_INVALID_ARGUMENT, f"bad Content-Length {length_header[:40]!r}",
                          drain=True)
            return None
        if length > self.max_body_bytes:
            exchange.fail(413, codec.RPC_INVALID_ARGUMENT,
                          f"body of {length} bytes is over the limit of {self.max_body_bytes}", drain=True)
            return None
        try:
            reserve(length)
        except BackPressure as exc:
            self._back_pressure(exchange, exc, drain=True)
            return None
        body = exchange.handler.rfile.read(length)
        if len(body) != length:
            exchange.handler.close_connection = True
            exchange.fail(400, codec.RPC_INVALID_ARGUMENT, f"body ended after {len(body)} of {length} bytes")
            return None
        return bytes(body)

    def _normalize(self, plain: bytes, content_type: str, sender: str | None = None) -> NormalizeResult:
        """The body's spans: a protobuf body read from its bytes where it has the usual shape,
        anything else parsed into the message (which names what is wrong with a bad body).
        ``sender``: the client's address, kept on each span (``auditor.semconv.SENDER_KEY``)."""
        if content_type == codec.PROTOBUF:
            try:
                return normalize_body(plain, service_host=self.service_host, fallback_host=self._fallback_host,
                                      sender=sender)
            except Unusual:
                pass
        request = codec.decode_request(plain, content_type)
        return normalize_request(request, service_host=self.service_host, fallback_host=self._fallback_host,
                                 sender=sender)

    def _store(self, exchange: _Exchange, result: NormalizeResult, plain_bytes: int) -> None:
        """Commit the spans; answer 200 only once they are committed."""
        try:
            self.writer.submit(result.spans, plain_bytes)
        except BackPressure as exc:
            self._back_pressure(exchange, exc)
            return
        with self._lock:
            self.accepted_spans += len(result.spans)
            self.rejected_spans += result.rejected
        exchange.handler._answer(200, codec.encode_response(exchange.reply_type, result.rejected,
                                                            result.error_message),
                                 content_type=exchange.reply_type)

    def _drop(self, exchange: _Exchange, items: int) -> None:
        with self._lock:
            self.dropped_requests[exchange.signal] += 1
            self.dropped_items[exchange.signal] += items
        exchange.handler._answer(200, codec.encode_empty_response(exchange.reply_type, exchange.signal),
                                 content_type=exchange.reply_type)

    @staticmethod
    def _back_pressure(exchange: _Exchange, exc: BackPressure, *, drain: bool = False) -> None:
        status, code = (429, codec.RPC_RESOURCE_EXHAUSTED) if exc.kind == QUEUE_FULL else (503, codec.RPC_UNAVAILABLE)
        exchange.fail(status, code, f"{exc.reason}; retry later", drain=drain,
                      extra={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})


class _Exchange:
    """One request being answered: its handler, its signal and the encoding of the answer."""

    def __init__(self, handler: _Handler, signal: str) -> None:
        self.handler = handler
        self.signal = signal
        self.content_type = codec.media_type(handler.headers.get("Content-Type"))
        # Errors go back in the request's encoding when it is one we speak, protobuf otherwise.
        self.reply_type = self.content_type if self.content_type in codec.CONTENT_TYPES else codec.PROTOBUF

    def fail(self, status: int, rpc_code: int, message: str, *, drain: bool = False,
             extra: dict[str, str] | None = None) -> None:
        self.handler._answer(status, codec.encode_status(self.reply_type, rpc_code, message),
                             content_type=self.reply_type, extra=extra, drain=drain)


def _no_reservation(_size: int) -> None:
    """The capacity check for bodies that are never queued."""
