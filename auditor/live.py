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
import socket
import time
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import SpanKind

from auditor.semconv import (
    GENAI_OPERATION,
    MAX_DATAGRAM,
    PEER_ADDR_KEYS,
    PEER_PORT_KEYS,
    SERVER_PORT_KEYS,
    EngineSpans,
    first_attribute,
)

log = logging.getLogger(__name__)
_ENGINE_SPANS = EngineSpans()

DEFAULT_ADDRESS = ("127.0.0.1", 4319)


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

    def _work(self, event: str, trace_id: str, span_id: str, name: str, finish: str | None = None) -> None:
        payload = {"v": 1, "ev": event, "trace": trace_id, "span": span_id, "name": name,
                   "kind": "internal", "ts": time.time_ns(), "peer": None, "peer_port": None,
                   "port": None, "pid": self.pid, "service": self.service, "engine": True}
        if finish:
            payload["finish"] = finish
        self.send(payload)

    def work_started(self, trace_id: str, span_id: str, name: str = "llm_request") -> None:
        """Engine work on a request began (call where the scheduler accepts it)."""
        self._work("start", trace_id, span_id, name)

    def work_ended(self, trace_id: str, span_id: str, name: str = "llm_request",
                   finish_reason: str | None = None) -> None:
        """Engine work on a request stopped: finished, aborted or failed. ``finish_reason`` as the
        engine's span would say it (``stop``, ``length``, ``abort``): a normal finish before the
        client left tells a complete response even where the engine's span cannot be joined to the
        request's (no ``traceparent``, no ``X-Request-Id``)."""
        self._work("end", trace_id, span_id, name, finish_reason)

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
        peer_port = first_attribute(attrs, PEER_PORT_KEYS)
        server_port = first_attribute(attrs, SERVER_PORT_KEYS)
        self.reporter.send({
            "v": 1, "ev": event, "trace": f"{context.trace_id:032x}", "span": f"{context.span_id:016x}",
            "name": span.name, "kind": "server", "ts": ts_ns or time.time_ns(),
            "peer": first_attribute(attrs, PEER_ADDR_KEYS),
            "peer_port": int(peer_port) if isinstance(peer_port, int) else None,
            "port": int(server_port) if isinstance(server_port, int) else None,
            "pid": self.reporter.pid, "service": service,
            "engine": _ENGINE_SPANS.matches(span.name, "server", attrs.get(GENAI_OPERATION), http=any(
                key in attrs for key in ("http.request.method", "http.method"))),
        })

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._send("start", span, span.start_time)

    def on_end(self, span: ReadableSpan) -> None:
        self._send("end", span, span.end_time)

    def shutdown(self) -> None:
        self.reporter.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
