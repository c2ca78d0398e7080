"""OTLP/gRPC receiver: ``TraceService/Export``, plus ``MetricsService`` and ``LogsService`` that
accept, count and drop (servers pointed at the generic ``OTEL_EXPORTER_OTLP_ENDPOINT`` export all
three signals and would log UNIMPLEMENTED otherwise).

The three methods are unary calls with one small message each way, so the receiver speaks gRPC's
HTTP/2 mapping itself, over ``collectors.http2`` (the server side of HTTP/2 that such calls need),
instead of loading grpcio's C core (about 11 MiB of a daemon that runs for weeks, and seven
threads). Per connection: one thread reads and feeds the connection's frames; a finished request
goes to a small pool of workers, which normalize, wait for the store's commit and answer on the
same connection (so a slow commit never holds up the other requests on it).

Answers follow the OTLP and gRPC specifications: OK with ``partial_success`` for rejected spans,
UNAUTHENTICATED for a bad or missing bearer token, INVALID_ARGUMENT for a body that is not the
method's message, RESOURCE_EXHAUSTED for a message over the size limit, for too many calls at once
and for a full write queue (the last two with a ``RetryInfo`` detail, which is what makes it
retryable for OTLP exporters), UNAVAILABLE when the store cannot be written, UNIMPLEMENTED for
other methods and compressions, INTERNAL for broken gRPC framing, DEADLINE_EXCEEDED for a call
none of whose bytes arrive for ``socket_timeout_s``, and HTTP 415 for requests that are not gRPC.
The queue and the size limit are checked from the message's length prefix, before its body is
buffered. A connection that does not start with HTTP/2's preface is closed (an
HTTP/1.x request first gets a 400 saying where OTLP/HTTP goes); one that breaks HTTP/2 gets a
GOAWAY; neither touches any other connection.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import math
import re
import socket
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from auditor import http1
from auditor.semconv import sender_address
from collectors import http2
from collectors import otlp_codec as codec
from collectors.http2 import ErrorCode
from collectors.normalize import NormalizeResult, normalize_body, normalize_request
from collectors.otlp_wire import Unusual
from collectors.spanwriter import QUEUE_FULL, BackPressure, SpanWriter

log = logging.getLogger(__name__)

# gRPC status codes (grpc/doc/statuscodes.md), by the names grpcio gives them.
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, \
    UNAUTHENTICATED = 0, 3, 4, 8, 12, 13, 14, 16
CODE_NAMES = {OK: "OK", INVALID_ARGUMENT: "INVALID_ARGUMENT", DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
              RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
              UNIMPLEMENTED: "UNIMPLEMENTED", INTERNAL: "INTERNAL", UNAVAILABLE: "UNAVAILABLE",
              UNAUTHENTICATED: "UNAUTHENTICATED"}

# The methods served, by their HTTP/2 path, and the signal each carries.
METHODS = {
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export": "traces",
    "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export": "metrics",
    "/opentelemetry.proto.collector.logs.v1.LogsService/Export": "logs",
}
COMPRESSIONS = ("identity", "gzip", "deflate")
ACCEPT_ENCODING = ",".join(COMPRESSIONS)

PREFACE = http2.PREFACE
_HTTP1_REQUEST = re.compile(rb"[A-Z]{3,10} ")
_PREFIX = struct.Struct(">BI")  # a gRPC message: compressed flag, length, then the message
MAX_STREAMS_PER_CONNECTION = 32  # advertised; gRPC clients queue calls beyond it
MAX_HEADER_LIST_BYTES = 16 << 10  # as grpc-core's hard limit on a request's metadata
WINDOW_BYTES = 1 << 20  # per stream and per connection: a typical export arrives without waiting
MAX_MESSAGE_TEXT = 1024  # grpc-message stays small, so an answer never waits for flow control
# An OK answer's header blocks are the same bytes every time (no dynamic table is used).
_OK_HEADERS = http2.encode_headers([(":status", "200"), ("content-type", "application/grpc"),
                                    ("grpc-accept-encoding", ACCEPT_ENCODING)])
_OK_TRAILERS = http2.encode_headers([("grpc-status", "0")])


def percent_encode(message: str) -> str:
    """grpc-message's encoding: UTF-8, every byte outside printable ASCII (and ``%``) as %XX."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}"
                   for b in message[:MAX_MESSAGE_TEXT].encode("utf-8", "replace"))


def frame(message: bytes) -> bytes:
    """One uncompressed gRPC message, length-prefixed."""
    return _PREFIX.pack(0, len(message)) + message


@functools.lru_cache(maxsize=64)  # under a flood the same few refusals go out thousands of times
def retry_details(code: int, message: str, retry_after_s: float) -> str:
    """``grpc-status-details-bin``: a google.rpc.Status carrying a RetryInfo, base64 as -bin
    metadata travels. OTLP exporters retry RESOURCE_EXHAUSTED only when it has one. Imported here:
    small, but needed only under back-pressure."""
    from google.protobuf import duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=max(1, math.ceil(retry_after_s))))
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(retry)
    return base64.b64encode(status.SerializeToString()).decode().rstrip("=")


class CallError(Exception):
    """A call answered with a gRPC status other than OK."""

    def __init__(self, code: int, message: str, *, retry_after_s: float | None = None,
                 http_status: int = 200) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.http_status = http_status


@dataclass
class _Call:
    """One request stream as it arrives: its method and metadata, then its message's bytes."""

    signal: str
    encoding: str
    deadline: float  # cut off unless more of it arrives by then (monotonic)
    buffer: bytearray = field(default_factory=bytearray)
    expected: int | None = None  # the message's length, once its prefix is in
    compressed: bool = False


class _Connection:
    """One client connection: a reading thread feeding its frames to the HTTP/2 state; workers
    answer through :meth:`answer`."""

    def __init__(self, receiver: OtlpGrpcReceiver, sock: socket.socket, peer: Any) -> None:
        self.receiver = receiver
        self.sock = sock
        self.peer = peer
        # Kept on its spans where it is not the loopback (auditor.semconv.SENDER_KEY).
        self.sender = sender_address(peer)
        self.h2 = http2.ServerConnection(max_concurrent_streams=MAX_STREAMS_PER_CONNECTION,
                                         initial_window=WINDOW_BYTES, max_header_list_size=MAX_HEADER_LIST_BYTES)
        self.lock = threading.Lock()  # the HTTP/2 state and the socket's writes
        self.answered = threading.Condition(self.lock)
        self.calls: dict[int, _Call] = {}  # streams still being read (touched by the reading thread only)
        self.pending = 0  # calls handed to workers and not yet answered

    # -- reading ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            first = self._preface()
            if first is None:
                return
            with self.lock:
                self.h2.initiate_connection()
                self.h2.increment_flow_control_window(WINDOW_BYTES - 65535)
                self._flush()
            data: bytes | None = first
            while data:
                if not self._feed(data):
                    return
                data = self._receive()
            if data is None:
                return  # closed as idle
            # The client is done sending (or stop() shut the socket): its calls still get their answers.
            with self.answered:
                self.answered.wait_for(lambda: self.pending == 0, timeout=self.receiver.socket_timeout_s)
        except OSError as exc:
            log.debug("OTLP/gRPC connection from %s ended: %s", self.peer, exc)
        except Exception:  # a fault of ours: this connection ends, the receiver goes on
            log.warning("OTLP/gRPC connection from %s failed", self.peer, exc_info=True)
        finally:
            self.receiver._discard(self)
            with contextlib.suppress(OSError):
                self.sock.close()

    def _receive(self) -> bytes | None:
        """The next bytes (b"" when the client is done), cutting off calls that stalled meanwhile;
        None after closing a connection that sat idle for ``idle_timeout_s``."""
        while True:
            with self.lock:
                self._expire()
                self._flush()
            if self.calls:
                wait = max(0.01, min(call.deadline for call in self.calls.values()) - time.monotonic())
            else:
                wait = self.receiver.idle_timeout_s
            self.sock.settimeout(wait)
            try:
                return self.sock.recv(65536)
            except TimeoutError:
                if not self.calls:
                    self._goaway(ErrorCode.NO_ERROR, b"idle")
                    return None

    def _expire(self) -> None:
        """Answer the calls that no byte of has arrived for ``socket_timeout_s`` (the lock is held)."""
        now = time.monotonic()
        for stream_id in [sid for sid, call in self.calls.items() if call.deadline <= now]:
            self._early(stream_id, CallError(DEADLINE_EXCEEDED, "the request stalled: nothing of it arrived for "
                                                                f"{self.receiver.socket_timeout_s:g} s"))

    def _preface(self) -> bytes | None:
        """The first bytes, once they are HTTP/2's preface; None after refusing anything else."""
        self.sock.settimeout(self.receiver.socket_timeout_s)
        data = b""
        while len(data) < len(PREFACE):
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                chunk = b""
            if not chunk:
                return None
            data += chunk
            if not PREFACE.startswith(data[:len(PREFACE)]):
                self._not_http2(data)
                return None
        return data

    def _not_http2(self, data: bytes) -> None:
        self.receiver._count_connection_error("not HTTP/2")
        if _HTTP1_REQUEST.match(data):
            where = f" OTLP/HTTP goes to {self.receiver.http_hint}" if self.receiver.http_hint else ""
            text = (f"this port speaks OTLP/gRPC (HTTP/2 without TLS), not HTTP/1.x.{where}\n").encode()
            with contextlib.suppress(OSError):
                self.sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n"
                                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(text), text))
        log.debug("OTLP/gRPC connection from %s does not speak HTTP/2: %r", self.peer, data[:24])

    def _feed(self, data: bytes) -> bool:
        """Hand bytes to the HTTP/2 state and act on its events; False once the connection is to
        be closed."""
        with self.lock:
            try:
                events = self.h2.receive_data(data)
            except http2.ProtocolError as exc:  # a frame that breaks HTTP/2, or an undecodable header block
                self.receiver._count_connection_error("HTTP/2 protocol error")
                log.debug("OTLP/gRPC connection from %s broke HTTP/2: %r", self.peer, exc)
                self._goaway(exc.error_code, str(exc)[:200].encode(), locked=True)
                return False
            except Exception:  # a fault of ours: said so, and only this connection ends
                self.receiver._count_connection_error("receiver fault")
                log.warning("OTLP/gRPC connection from %s: the HTTP/2 layer failed", self.peer, exc_info=True)
                self._goaway(ErrorCode.INTERNAL_ERROR, b"internal error", locked=True)
                return False
            for event in events:
                if isinstance(event, http2.DataReceived):
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    self._data(event.stream_id, event.data)
                elif isinstance(event, http2.RequestReceived):
                    self._begin(event.stream_id, event.headers)
                elif isinstance(event, http2.StreamEnded):
                    self._end(event.stream_id)
                elif isinstance(event, http2.StreamReset):
                    if self.calls.pop(event.stream_id, None) is not None:
                        self.receiver._release()
                elif isinstance(event, http2.ConnectionTerminated):
                    self._flush()
                    return False
            self._flush()
        return True

    def _begin(self, stream_id: int, headers: Any) -> None:
        meta: dict[str, str] = {}
        for name, value in headers:  # bytes: HTTP/2 checked the names and values
            meta.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        refusal = self.receiver._admit()
        if refusal is not None:
            self._early(stream_id, refusal)
            return
        call = _Call(signal=METHODS.get(meta.get(":path", ""), ""),
                     encoding=meta.get("grpc-encoding", "identity").strip().lower(),
                     deadline=time.monotonic() + self.receiver.socket_timeout_s)
        self.calls[stream_id] = call
        content_type = meta.get("content-type", "")
        if meta.get(":method") != "POST" or not (content_type == "application/grpc"
                                                 or content_type.startswith(("application/grpc+", "application/grpc;"))):
            self._early(stream_id, CallError(UNIMPLEMENTED, f"not a gRPC call (content-type {content_type[:60]!r}, "
                                                            f"method {meta.get(':method')!r})", http_status=415))
        elif not call.signal:
            self._early(stream_id, CallError(UNIMPLEMENTED, f"no method {meta.get(':path', '')[:120]!r} here; "
                                                            "OTLP exports go to "
                                                            "opentelemetry.proto.collector.*.v1.*Service/Export"))
        elif not self.receiver._authorized(meta.get("authorization")):
            self._early(stream_id, CallError(UNAUTHENTICATED, "missing or wrong bearer token"))

    def _data(self, stream_id: int, data: bytes) -> None:
        call = self.calls.get(stream_id)
        if call is None:  # answered early, refused, or reset: the rest is discarded
            return
        call.deadline = time.monotonic() + self.receiver.socket_timeout_s
        call.buffer += data
        if call.expected is None and len(call.buffer) >= _PREFIX.size:
            flag, length = _PREFIX.unpack_from(call.buffer)
            try:
                self.receiver._check_message(call, flag, length)
            except CallError as exc:
                self._early(stream_id, exc)
                return
            call.compressed, call.expected = flag == 1, length
        if call.expected is not None and len(call.buffer) > _PREFIX.size + call.expected:
            self._early(stream_id, CallError(INTERNAL, "a unary call carries one request message; this one "
                                                       "has bytes after it"))

    def _end(self, stream_id: int) -> None:
        call = self.calls.pop(stream_id, None)
        if call is None:
            return
        if call.expected is None or len(call.buffer) != _PREFIX.size + call.expected:
            self._finish(stream_id, CallError(INTERNAL, f"the request ended inside its message ({len(call.buffer)} "
                                                        "bytes, framing included)" if call.buffer else
                                                        "the request has no message"))
            self.receiver._release()
            return
        message = bytes(memoryview(call.buffer)[_PREFIX.size:])
        self.receiver._dispatch(self, stream_id, call, message)

    def _early(self, stream_id: int, error: CallError) -> None:
        """Answer before the request has ended, and tell the client to stop sending it."""
        if self.calls.pop(stream_id, None) is not None:
            self.receiver._release()
        self._finish(stream_id, error)
        with contextlib.suppress(http2.StreamClosed):
            self.h2.reset_stream(stream_id, ErrorCode.NO_ERROR)

    # -- answering --------------------------------------------------------------------------
    def answer(self, stream_id: int, result: bytes | CallError) -> None:
        """From a worker: the call's answer, sent on this connection."""
        with self.lock:
            self.pending -= 1
            self.answered.notify_all()
            self._finish(stream_id, result)
            try:
                self._flush()
            except OSError as exc:
                log.debug("OTLP/gRPC answer to %s not sent: %s", self.peer, exc)

    def _finish(self, stream_id: int, result: bytes | CallError) -> None:
        """Queue the answer's frames (the lock is held). A stream the client already reset is skipped."""
        if isinstance(result, CallError):
            self.receiver._count(result.code)
            headers = [(":status", str(result.http_status)), ("content-type", "application/grpc"),
                       ("grpc-status", str(result.code)), ("grpc-message", percent_encode(result.message))]
            if result.code == UNIMPLEMENTED:
                headers.append(("grpc-accept-encoding", ACCEPT_ENCODING))
            if result.retry_after_s is not None:
                headers.append(("grpc-status-details-bin",
                                retry_details(result.code, result.message, result.retry_after_s)))
            with contextlib.suppress(http2.StreamClosed):  # trailers-only
                self.h2.send_headers(stream_id, headers, end_stream=True)
            return
        self.receiver._count(OK)
        with contextlib.suppress(http2.StreamClosed):
            self.h2.send_headers(stream_id, _OK_HEADERS)
            self.h2.send_data(stream_id, frame(result))
            self.h2.send_headers(stream_id, _OK_TRAILERS, end_stream=True)

    def _flush(self) -> None:
        out = self.h2.data_to_send()
        if out:
            self.sock.sendall(out)

    def _goaway(self, error: int, text: bytes, *, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self.lock:
            if not self.h2.closed:
                self.h2.close_connection(error_code=error, additional_data=text)
            with contextlib.suppress(OSError):
                self._flush()

    def close(self) -> None:
        """From stop(): say goodbye and wake the reading thread."""
        self._goaway(ErrorCode.NO_ERROR, b"shutting down")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class OtlpGrpcReceiver:
    """An OTLP/gRPC trace endpoint: an accepting thread, a thread per connection, a worker pool."""

    def __init__(self, writer: SpanWriter, host: str = "127.0.0.1", port: int = 4317, *,
                 token: str | None = None, max_message_bytes: int = 8 << 20, service_host: str = "",
                 max_workers: int = 8, max_concurrent_rpcs: int = 64, max_connections: int = 64,
                 socket_timeout_s: float = 15.0, idle_timeout_s: float = 600.0, http_hint: str = "") -> None:
        self.writer = writer
        self.host = host
        self.requested_port = port
        self.token = token
        self.max_message_bytes = max_message_bytes
        # Given (a daemon's host id), every span is stored under it: the daemon's correlator reads
        # only its own host's rows. Otherwise the span's host.name, else this machine's name.
        self.service_host = service_host
        self._fallback_host = socket.gethostname()
        self.max_workers = max_workers
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.max_connections = max_connections
        self.socket_timeout_s = socket_timeout_s  # a call none of whose bytes arrive for this long
        self.idle_timeout_s = idle_timeout_s  # a connection with no call (clients reconnect on GOAWAY)
        self.http_hint = http_hint  # the OTLP/HTTP address, named to HTTP/1.x clients that come here
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._port: int | None = None
        self._connections: dict[_Connection, threading.Thread] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0  # calls admitted and not yet answered, over all connections
        self.requests_by_status: Counter[str] = Counter()
        self.connection_errors: Counter[str] = Counter()
        self.accepted_spans = 0
        self.rejected_spans = 0
        self.dropped_requests: Counter[str] = Counter()  # metrics and logs, accepted and not kept
        self.dropped_items: Counter[str] = Counter()  # their data points and log records

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> OtlpGrpcReceiver:
        """Bind and serve; raises OSError when the address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.requested_port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._listener, self._port = listener, int(listener.getsockname()[1])
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="otlp-grpc")
        self._thread = threading.Thread(target=self._accept, args=(listener,), name="otlp-grpc", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("receiver not started")
        return self._port

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting, let calls in flight finish for up to ``grace_s``, then close every connection."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            listener.close()
        if self._thread is not None:
            self._thread.join(2)
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace_s)
            connections = list(self._connections.items())
        for connection, _thread in connections:
            connection.close()
        for _connection, thread in connections:
            thread.join(1)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._thread = self._port = None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"accepted_spans": self.accepted_spans, "rejected_spans": self.rejected_spans,
                    "requests_by_status": dict(self.requests_by_status),
                    "connection_errors": dict(self.connection_errors),
                    "connections": len(self._connections), "calls_in_flight": self._in_flight,
                    "dropped_requests": dict(self.dropped_requests),
                    "dropped_items": dict(self.dropped_items),
                    "queue_spans": self.writer.queue_depth_spans}

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except OSError as exc:
                if self._listener is not listener:
                    return  # stop() shut it
                # Out of descriptors, or a connection gone before it was accepted: keep serving.
                log.warning("OTLP/gRPC listener could not accept a connection: %s", exc)
                time.sleep(0.1)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(self, sock, peer)
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    thread = threading.Thread(target=connection.run, name="otlp-grpc-conn", daemon=True)
                    self._connections[connection] = thread
            if full:
                self._count_connection_error("too many connections")
                threading.Thread(target=self._refuse_connection, args=(connection,), daemon=True).start()
            else:
                thread.start()

    @staticmethod
    def _refuse_connection(connection: _Connection) -> None:
        """Over the connection cap: a GOAWAY at once (clients back off and reconnect), no thread kept."""
        with contextlib.suppress(OSError):
            connection.sock.settimeout(2)
            with connection.lock:
                connection.h2.initiate_connection()
            connection._goaway(ErrorCode.ENHANCE_YOUR_CALM, b"too many connections")
        with contextlib.suppress(OSError):
            connection.sock.close()

    def _discard(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.pop(connection, None)
            self._in_flight -= len(connection.calls)  # calls still being read; workers release theirs
            self._idle.notify_all()

    # -- admission --------------------------------------------------------------------------
    def _admit(self) -> CallError | None:
        """Count a new call in, or say why not."""
        with self._lock:
            if self._pool is None:
                return CallError(UNAVAILABLE, "the receiver is stopping")
            if self._in_flight >= self.max_concurrent_rpcs:
                return CallError(RESOURCE_EXHAUSTED, "too many OTLP/gRPC calls at once", retry_after_s=1.0)
            self._in_flight += 1
            return None

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._idle.notify_all()

    def _authorized(self, header: str | None) -> bool:
        return http1.bearer_matches(header, self.token)

    def _check_message(self, call: _Call, flag: int, length: int) -> None:
        """From the message's prefix: its framing, its size, and room in the write queue."""
        if flag not in (0, 1):
            raise CallError(INTERNAL, f"bad gRPC message flag {flag}")
        if flag == 1 and call.encoding not in COMPRESSIONS[1:]:
            if call.encoding == "identity":
                raise CallError(INTERNAL, "the message is marked compressed but the call names no grpc-encoding")
            raise CallError(UNIMPLEMENTED, f"grpc-encoding {call.encoding[:40]!r} is not supported; "
                                           f"use {' or '.join(COMPRESSIONS[1:])} or none")
        if length > self.max_message_bytes:
            raise CallError(RESOURCE_EXHAUSTED,
                            f"received message larger than max ({length} vs. {self.max_message_bytes})")
        if call.signal == "traces":
            try:
                self.writer.check_capacity(length)
            except BackPressure as exc:
                raise self._refusal(exc) from exc

    # -- one call, on a worker --------------------------------------------------------------
    def _dispatch(self, connection: _Connection, stream_id: int, call: _Call, message: bytes) -> None:
        pool = self._pool
        try:
            if pool is None:
                raise RuntimeError("stopped")
            pool.submit(self._serve, connection, stream_id, call, message)
            connection.pending += 1  # the reading thread holds the connection's lock
        except RuntimeError:  # the pool is shut down: stop() is under way
            connection._finish(stream_id, CallError(UNAVAILABLE, "the receiver is stopping"))
            self._release()

    def _serve(self, connection: _Connection, stream_id: int, call: _Call, message: bytes) -> None:
        try:
            result: bytes | CallError = self._call(call, message, connection.sender)
        except Exception as exc:  # a fault of ours: the call fails, the receiver goes on
            log.warning("OTLP/gRPC call failed: %r", exc, exc_info=True)
            result = CallError(INTERNAL, f"the receiver failed on this request ({type(exc).__name__})")
        try:
            connection.answer(stream_id, result)
        finally:
            self._release()

    def _call(self, call: _Call, message: bytes, sender: str | None = None) -> bytes | CallError:
        if call.compressed:
            try:
                message = codec.inflate(message, call.encoding, self.max_message_bytes)
            except codec.BodyError as exc:
                code = RESOURCE_EXHAUSTED if exc.status == 413 else INTERNAL
                return CallError(code, f"the {call.encoding} message: {exc.message}")
        if call.signal != "traces":
            try:
                items = codec.decode_dropped(message, codec.PROTOBUF, call.signal)
            except codec.BodyError as exc:
                return CallError(INVALID_ARGUMENT, exc.message)
            with self._lock:
                self.dropped_requests[call.signal] += 1
                self.dropped_items[call.signal] += items
            return b""
        try:
            result = self._normalize(message, sender)
        except CallError as exc:
            return exc
        try:
            self.writer.submit(result.spans, len(message))
        except BackPressure as exc:
            return self._refusal(exc)
        with self._lock:
            self.accepted_spans += len(result.spans)
            self.rejected_spans += result.rejected
        if not result.rejected:
            return b""
        return codec.encode_response(codec.PROTOBUF, result.rejected, result.error_message[:MAX_MESSAGE_TEXT])

    def _normalize(self, message: bytes, sender: str | None = None) -> NormalizeResult:
        """The message's spans: read from its bytes where it has the usual shape, anything else
        parsed into the message (which names what is wrong with a bad one). ``sender``: the
        client's address, kept on each span (``auditor.semconv.SENDER_KEY``)."""
        try:
            return normalize_body(message, service_host=self.service_host, fallback_host=self._fallback_host,
                                  sender=sender)
        except Unusual:
            pass
        pb = codec.messages()  # protobuf, imported on the first body that needs it
        try:
            request = pb.ExportTraceServiceRequest.FromString(message)
        except (pb.DecodeError, RecursionError, ValueError) as exc:
            raise CallError(INVALID_ARGUMENT,
                            f"request is not a valid ExportTraceServiceRequest protobuf ({exc})") from exc
        return normalize_request(request, service_host=self.service_host, fallback_host=self._fallback_host,
                                 sender=sender)

    @staticmethod
    def _refusal(exc: BackPressure) -> CallError:
        code = RESOURCE_EXHAUSTED if exc.kind == QUEUE_FULL else UNAVAILABLE
        return CallError(code, f"{exc.reason}; retry later", retry_after_s=exc.retry_after_s)

    # -- counters ---------------------------------------------------------------------------
    def _count(self, code: int) -> None:
        with self._lock:
            self.requests_by_status[CODE_NAMES.get(code, str(code))] += 1

    def _count_connection_error(self, reason: str) -> None:
        with self._lock:
            self.connection_errors[reason] += 1
