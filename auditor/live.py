"""Live alarms: span starts and ends sent to the daemon as datagrams, the moment they happen.

OTLP delivers a span only when it ends, so a zombie is otherwise found when its work finally
stops. A server that adds ``LiveSpanProcessor`` to its tracer provider (and an engine that calls
``LiveReporter.work_started``/``work_ended`` from its scheduler, for engine spans that are
created only at the end, as vLLM's ``llm_request`` is) lets the daemon see requests in flight, so
a zombie is flagged ``inflight_zombie`` within a second after the grace period.

The sender never blocks and never raises: one non-blocking UDP ``sendto`` per event; a full
socket buffer or an absent daemon costs the server nothing but a counted drop.

Wire format: one JSON object per datagram, at most ``MAX_DATAGRAM`` bytes:
``{"v": 1, "ev": "start"|"end", "trace": hex32, "span": hex16, "name": str, "kind": str,
"ts": ns, "peer": addr|null, "peer_port": int|null, "port": int|null, "pid": int,
"service": str, "engine": bool}``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import SpanKind

from auditor.model import SpanRecord, SpanRole
from auditor.traces import Tuple4, norm_addr

log = logging.getLogger(__name__)

MAX_DATAGRAM = 1024
DEFAULT_ADDRESS = ("127.0.0.1", 4319)


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """A span (or engine work item) starting or ending, as the daemon receives it."""

    event: str  # "start" or "end"
    trace_id: str
    span_id: str
    name: str
    kind: str
    ts_ns: int
    peer_addr: str | None
    peer_port: int | None
    server_port: int | None
    pid: int | None
    service: str
    engine: bool  # engine work (not an HTTP span)

    def as_span(self) -> SpanRecord:
        """A stand-in server span for a request known only from its start notice."""
        return SpanRecord(trace_id=self.trace_id, span_id=self.span_id, parent_span_id=None, name=self.name,
                          kind=self.kind, start_ns=self.ts_ns, end_ns=self.ts_ns, service=self.service,
                          role=SpanRole.HTTP_SERVER, peer_addr=self.peer_addr, peer_port=self.peer_port,
                          server_port=self.server_port, process_pid=self.pid)


def _first(attributes: Any, *names: str) -> Any:
    for name in names:
        value = attributes.get(name) if attributes else None
        if value is not None:
            return value
    return None


class LiveReporter:
    """Sends live events to the daemon; safe to call from any thread, never blocks."""

    def __init__(self, address: tuple[str, int] = DEFAULT_ADDRESS, *, service: str = "") -> None:
        self.address = address
        self.service = service
        self.sent = 0
        self.dropped = 0
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.pid = os.getpid()

    def send(self, payload: dict[str, Any]) -> None:
        try:
            data = json.dumps(payload, separators=(",", ":")).encode()[:MAX_DATAGRAM]
            self._sock.sendto(data, self.address)
            self.sent += 1
        except Exception:  # full buffer, no daemon, anything: the server must not notice
            self.dropped += 1

    def _work(self, event: str, trace_id: str, span_id: str, name: str) -> None:
        self.send({"v": 1, "ev": event, "trace": trace_id, "span": span_id, "name": name,
                   "kind": "internal", "ts": time.time_ns(), "peer": None, "peer_port": None,
                   "port": None, "pid": self.pid, "service": self.service, "engine": True})

    def work_started(self, trace_id: str, span_id: str, name: str = "llm_request") -> None:
        """Engine work on a request began (call where the scheduler accepts it)."""
        self._work("start", trace_id, span_id, name)

    def work_ended(self, trace_id: str, span_id: str, name: str = "llm_request") -> None:
        """Engine work on a request stopped: finished, aborted or failed."""
        self._work("end", trace_id, span_id, name)

    def close(self) -> None:
        self._sock.close()


class LiveSpanProcessor(SpanProcessor):
    """Reports server-span starts and ends to the daemon; add it beside the OTLP exporter."""

    def __init__(self, address: tuple[str, int] = DEFAULT_ADDRESS, *, service: str = "") -> None:
        self.reporter = LiveReporter(address, service=service)

    def _send(self, event: str, span: ReadableSpan, ts_ns: int | None) -> None:
        context = span.get_span_context()
        if context is None or span.kind is not SpanKind.SERVER:
            return
        attrs = span.attributes or {}
        service = self.reporter.service or str(span.resource.attributes.get("service.name", ""))
        peer_port = _first(attrs, "client.port", "net.peer.port")
        server_port = _first(attrs, "server.port", "net.host.port")
        self.reporter.send({
            "v": 1, "ev": event, "trace": f"{context.trace_id:032x}", "span": f"{context.span_id:016x}",
            "name": span.name, "kind": "server", "ts": ts_ns or time.time_ns(),
            "peer": _first(attrs, "client.address", "net.peer.ip", "network.peer.address"),
            "peer_port": int(peer_port) if isinstance(peer_port, int) else None,
            "port": int(server_port) if isinstance(server_port, int) else None,
            "pid": self.reporter.pid, "service": service,
            "engine": span.name == "llm_request",
        })

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._send("start", span, span.start_time)

    def on_end(self, span: ReadableSpan) -> None:
        self._send("end", span, span.end_time)

    def shutdown(self) -> None:
        self.reporter.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def parse_datagram(data: bytes) -> LiveEvent | None:
    """A datagram as a LiveEvent, or None when it is not one (garbage is dropped, never raised)."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("v") != 1 or doc.get("ev") not in ("start", "end"):
            return None
        trace_id, span_id = str(doc["trace"]), str(doc["span"])
        int(trace_id, 16), int(span_id, 16)
        if len(trace_id) != 32 or len(span_id) != 16:
            return None

        def opt_int(value: Any) -> int | None:
            return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

        peer = doc.get("peer")
        return LiveEvent(
            event=doc["ev"], trace_id=trace_id.lower(), span_id=span_id.lower(),
            name=str(doc.get("name", ""))[:255], kind=str(doc.get("kind", ""))[:16],
            ts_ns=int(doc["ts"]), peer_addr=str(peer)[:64] if peer else None,
            peer_port=opt_int(doc.get("peer_port")), server_port=opt_int(doc.get("port")),
            pid=opt_int(doc.get("pid")), service=str(doc.get("service", ""))[:255],
            engine=bool(doc.get("engine")),
        )
    except (ValueError, KeyError, TypeError):
        return None


class LiveReceiver:
    """The daemon's end: a UDP socket read by a thread into a bounded queue."""

    def __init__(self, host: str, port: int, *, max_queue: int = 100_000) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.bind((host, port))
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self.events: queue.Queue[LiveEvent] = queue.Queue(maxsize=max_queue)
        self.received = 0
        self.rejected = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM + 1)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            event = parse_datagram(data)
            if event is None:
                self.rejected += 1
                continue
            self.received += 1
            try:
                self.events.put_nowait(event)
            except queue.Full:
                self.dropped += 1

    def drain(self) -> list[LiveEvent]:
        events = []
        while True:
            try:
                events.append(self.events.get_nowait())
            except queue.Empty:
                return events

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


class LiveState:
    """What live notices say is running now: the correlator's view of requests in flight."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], LiveEvent] = {}
        self._engine_end: dict[str, int] = {}  # trace -> when its engine work last ended
        self._span_end: dict[tuple[str, str], int] = {}
        self._by_tuple: dict[Tuple4, list[LiveEvent]] = defaultdict(list)

    def add(self, events: list[LiveEvent]) -> set[str]:
        """Apply notices; returns the traces they concern."""
        for event in events:
            key = (event.trace_id, event.span_id)
            if event.event == "start":
                self._running[key] = event
                if not event.engine and event.peer_addr and event.peer_port and event.server_port:
                    self._by_tuple[(norm_addr(event.peer_addr), event.peer_port, event.server_port)].append(event)
                continue
            started = self._running.pop(key, None)
            if event.engine or (started is not None and started.engine):
                self._engine_end[event.trace_id] = event.ts_ns
            else:
                self._span_end[key] = event.ts_ns
        return {event.trace_id for event in events}

    def in_flight_on(self, tuple4: Tuple4, ts_ns: int) -> LiveEvent | None:
        """The server span running on this connection at ``ts_ns``, as far as notices tell."""
        for live in self._by_tuple.get(tuple4, ()):
            key = (live.trace_id, live.span_id)
            if key in self._running or self._span_end.get(key, 0) >= ts_ns:
                return live
        return None

    def running(self, trace_id: str, span_ids: set[str]) -> bool:
        """Whether any of these spans, or any engine work of the trace, is still running."""
        return any(trace == trace_id and (span_id in span_ids or live.engine)
                   for (trace, span_id), live in self._running.items())

    def span_end(self, trace_id: str, span_id: str) -> int | None:
        return self._span_end.get((trace_id, span_id))

    def engine_end(self, trace_id: str) -> int | None:
        return self._engine_end.get(trace_id)

    def running_since(self, service: str) -> list[int]:
        return [e.ts_ns for e in self._running.values() if e.service == service]

    def prune(self, cutoff_ns: int) -> None:
        for tuple4 in [k for k, lives in self._by_tuple.items() if max(e.ts_ns for e in lives) < cutoff_ns]:
            del self._by_tuple[tuple4]
        for key in [k for k, ts in self._span_end.items() if ts < cutoff_ns]:
            del self._span_end[key]
        for trace_id in [t for t, ts in self._engine_end.items() if ts < cutoff_ns]:
            del self._engine_end[trace_id]
