"""Recent spans indexed for the joins of DESIGN §4: by connection, by trace tree, by request id.

A *request* is identified by its outermost HTTP server span on this host: a trace may carry many
requests (an agent making several calls under one parent span), and one request may cross several
hops (a gateway's server span, its client span, the engine's server span, the engine span).
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable

from auditor.model import SpanRecord, SpanRole

Tuple4 = tuple[str, int, int]  # (client address, client port, server port)
MAX_DEPTH = 64  # parent chains deeper than this are cut (a cycle or garbage)


def norm_addr(addr: str | None) -> str:
    """One spelling per address: IPv4-mapped IPv6 as IPv4, IPv6 compressed."""
    if not addr:
        return ""
    try:
        ip = ipaddress.ip_address(addr.strip("[]"))
    except ValueError:
        return addr.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def span_tuple(span: SpanRecord) -> Tuple4:
    return (norm_addr(span.peer_addr), span.peer_port or 0, span.server_port or 0)


def engine_request_ids(http_request_id: str) -> tuple[str, ...]:
    """The ids vLLM gives a request that arrived with ``X-Request-Id: <id>``."""
    return (http_request_id, f"chatcmpl-{http_request_id}", f"cmpl-{http_request_id}")


class TraceIndex:
    def __init__(self) -> None:
        self._by_trace: dict[str, dict[str, SpanRecord]] = defaultdict(dict)
        self._http_by_tuple: dict[Tuple4, list[SpanRecord]] = defaultdict(list)
        self._engine_by_request_id: dict[str, SpanRecord] = {}

    def add(self, span: SpanRecord) -> bool:
        """Index a span; False when it was already known (a duplicate delivery)."""
        spans = self._by_trace[span.trace_id]
        if span.span_id in spans:
            return False
        spans[span.span_id] = span
        if span.role is SpanRole.HTTP_SERVER and not span.peer_rewritten and span.peer_port and span.server_port:
            self._http_by_tuple[span_tuple(span)].append(span)
        elif span.role is SpanRole.ENGINE and span.request_id:
            self._engine_by_request_id[span.request_id] = span
        return True

    def get(self, trace_id: str, span_id: str) -> SpanRecord | None:
        return self._by_trace.get(trace_id, {}).get(span_id)

    def trace(self, trace_id: str) -> Iterable[SpanRecord]:
        return self._by_trace.get(trace_id, {}).values()

    def traces(self) -> Iterable[tuple[str, dict[str, SpanRecord]]]:
        return self._by_trace.items()

    def on_connection(self, tuple4: Tuple4) -> list[SpanRecord]:
        return self._http_by_tuple.get(tuple4, [])

    def in_flight(self, tuple4: Tuple4, ts_ns: int, closed_at: Iterable[int], wait_ns: int) -> SpanRecord | None:
        """The server span in flight on this connection when the client left at ``ts_ns``.

        Inside a span's interval it is that span. Before any span: the request was already in the
        server's receive buffer (a client that sends and leaves at once, AIPerf's delay 0), so a span
        that starts later on the same connection, with no close of the server's socket in between
        (which would mean the 4-tuple was reused), was in flight too.
        """
        spans = self._http_by_tuple.get(tuple4, [])
        for span in spans:
            if span.start_ns <= ts_ns <= span.end_ns:
                return span
        later = [s for s in spans if ts_ns < s.start_ns <= ts_ns + wait_ns]
        if not later:
            return None
        first = min(later, key=lambda s: s.start_ns)
        if any(ts_ns <= closed <= first.start_ns for closed in closed_at):
            return None
        return first

    def root(self, span: SpanRecord) -> SpanRecord:
        """The outermost HTTP server span above ``span`` (itself when none is known)."""
        spans = self._by_trace.get(span.trace_id, {})
        root, current = span, span
        for _ in range(MAX_DEPTH):
            parent = spans.get(current.parent_span_id or "")
            if parent is None:
                break
            current = parent
            if current.role is SpanRole.HTTP_SERVER:
                root = current
        return root

    def subtree(self, root: SpanRecord) -> list[SpanRecord]:
        """``root`` and every known span below it."""
        spans = self._by_trace.get(root.trace_id, {})
        result = []
        for span in spans.values():
            current: SpanRecord | None = span
            for _ in range(MAX_DEPTH):
                if current is None:
                    break
                if current.span_id == root.span_id:
                    result.append(span)
                    break
                current = spans.get(current.parent_span_id or "")
        return result

    def engine_for(self, root: SpanRecord, subtree: list[SpanRecord]) -> SpanRecord | None:
        """The engine span of a request: below it, beside it (vLLM parents ``llm_request`` on the
        caller's span, like the server span), or by the request id the engine derived. Only an
        engine span that overlaps the request in time qualifies: ids and traces do get reused."""

        def overlaps(engine: SpanRecord) -> bool:
            return engine.start_ns <= root.end_ns and engine.end_ns >= root.start_ns

        trace = [s for s in self.trace(root.trace_id) if s.role is SpanRole.ENGINE and overlaps(s)]
        engines = [s for s in subtree if s.role is SpanRole.ENGINE and overlaps(s)]
        if not engines and root.parent_span_id:
            engines = [s for s in trace if s.parent_span_id == root.parent_span_id]
        if not engines:
            # A trace that carries one request only: its engine spans are that request's,
            # however (or whether) the engine parented them.
            roots = {self.root(s).span_id for s in self.trace(root.trace_id) if s.role is SpanRole.HTTP_SERVER}
            if roots == {root.span_id}:
                engines = trace
        if engines:
            return max(engines, key=lambda s: s.end_ns)
        for span in subtree:
            if span.role is SpanRole.HTTP_SERVER and span.request_id:
                for candidate in engine_request_ids(span.request_id):
                    engine = self._engine_by_request_id.get(candidate)
                    if engine is not None and overlaps(engine):
                        return engine
        return None

    def prune(self, cutoff_ns: int, keep: set[str]) -> None:
        """Forget traces that ended before ``cutoff_ns``, except those in ``keep``."""
        for trace_id in [t for t, spans in self._by_trace.items()
                         if t not in keep and max(s.end_ns for s in spans.values()) < cutoff_ns]:
            for span in self._by_trace.pop(trace_id).values():
                if span.role is SpanRole.ENGINE and span.request_id:
                    self._engine_by_request_id.pop(span.request_id, None)
        for tuple4 in [k for k, spans in self._http_by_tuple.items() if max(s.end_ns for s in spans) < cutoff_ns]:
            del self._http_by_tuple[tuple4]
