"""Recent spans indexed for the joins of DESIGN §4: by connection, by trace tree, by request id.

A *request* is identified by its outermost HTTP server span on this host: a trace may carry many
requests (an agent making several calls under one parent span), and one request may cross several
hops (a gateway's server span, its client span, the engine's server span, the engine span).
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import TypeVar

from auditor.correlate.waste import RunIndex
from auditor.model import SpanRecord, SpanRole
from auditor.semconv import SENDER_KEY

T = TypeVar("T")

Tuple4 = tuple[str, int, int]  # (client address, client port, server port)
# A reset moves the server's socket to CLOSE in the same softirq (tcp_reset -> tcp_done), a few
# microseconds after tcp_receive_reset: that close is the reset's own, not the server letting go of
# the socket, which still holds the request the server reads next.
RESET_OWN_CLOSE_NS = 1_000_000
# After an active close the client's 4-tuple sits in TIME_WAIT: 60 s, or, where the kernel lets a
# new connection take it over (tcp_tw_reuse, loopback by default), not before its timestamp has
# moved on by a second.
TIME_WAIT_REUSE_NS = 1_000_000_000
# A reset leaves no TIME_WAIT: the 4-tuple is free at once. The request a client sent before it
# reset is read as soon as the server's loop gets to the socket; a span that starts later than
# this after the reset is taken for a new connection's (clients from one address reuse ports
# within seconds at a hundred connections a second), not for a request left unread that long.
RESET_UNREAD_NS = 1_000_000_000
# A server ends a response's span this soon after its last byte, by which a keep-alive client may
# have sent its next request and closed (a tenth of a millisecond on an idle host; more when busy).
NEXT_REQUEST_RACE_NS = 10_000_000
MAX_DEPTH = 64  # parent chains deeper than this are cut (a cycle or garbage)


@functools.lru_cache(maxsize=4096)
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


# Addresses a port's server spans came from (``TraceIndex.senders``), at most: past it the set
# starts again (a node's pods are tens; addresses of pods gone are then forgotten).
MAX_SENDERS = 1024


def span_tuple(span: SpanRecord) -> Tuple4:
    return (norm_addr(span.peer_addr), span.peer_port or 0, span.server_port or 0)


def _counts_on_port(span: SpanRecord, trace: dict[str, SpanRecord]) -> bool:
    """Whether a server span counts among its port's requests: not when its parent is a server
    span of the same connection, as FastAPI's instrumentation makes a second one inside the ASGI
    middleware's. Counted twice, a request in flight read as two to the gauges' arithmetic: a
    client that read its whole answer was judged to have left work running (a zombie). Parallel
    requests of one trace on one HTTP/2 connection are siblings, not parent and child: each counts."""
    parent = trace.get(span.parent_span_id) if span.parent_span_id else None
    return not (parent is not None and parent.role is SpanRole.HTTP_SERVER and span.peer_port
                and not span.peer_rewritten and span_tuple(parent) == span_tuple(span))


def engine_request_ids(http_request_id: str) -> tuple[str, ...]:
    """The ids vLLM gives a request that arrived with ``X-Request-Id: <id>``."""
    return (http_request_id, f"chatcmpl-{http_request_id}", f"cmpl-{http_request_id}")


def disconnect_instant(span: SpanRecord, ts_ns: int, earliest_ns: int | None) -> int:
    """The instant a verdict takes for a close joined to ``span``.

    Exact events are their own instant. A polled close is known only to lie in (earliest, ts]:
    if the span ended inside that interval, the client cannot have left after the request was no
    longer in flight, so the span's end is the latest instant consistent with both; judging there
    never calls a request that completed right before the close aborted. Otherwise the first poll
    that saw it closed.
    """
    if earliest_ns is None:
        return ts_ns
    return max(min(ts_ns, span.end_ns), min(earliest_ns, ts_ns))


def _share(span: SpanRecord, name: str, held: str) -> None:
    """Point the frozen record's field at an equal string already held, so one copy stays."""
    if getattr(span, name) is not held:
        object.__setattr__(span, name, held)


def _without(values: list[int], drop: list[int]) -> list[int]:
    """``values`` (sorted) less one occurrence of each of ``drop`` (a time not among them is passed
    over): any equal time will do, since only how many lie below a time counts."""
    drop.sort()
    kept: list[int] = []
    at = 0
    for gone in drop:
        found = bisect.bisect_left(values, gone, at)
        if found == len(values) or values[found] != gone:
            continue  # not held (never added): nothing to take out
        kept += values[at:found]
        at = found + 1
    kept += values[at:]
    return kept


def _without_ended(ends: list[int], began: array[int], drop: list[tuple[int, int]]) -> tuple[list[int], array[int]]:
    """``PortSpans``' ends and the starts beside them less one of each (end, start) in ``drop``
    (one not among them is passed over), in one walk."""
    drop.sort()
    kept, kept_began = [], array("q")
    at = 0
    for end, start in drop:
        low = bisect.bisect_left(ends, end, at)
        found = bisect.bisect_left(began, start, low, bisect.bisect_right(ends, end, low))
        if found == len(ends) or ends[found] != end or began[found] != start:
            continue
        kept += ends[at:found]
        kept_began += began[at:found]
        at = found + 1
    kept += ends[at:]
    kept_began += began[at:]
    return kept, kept_began


class PortSpans:
    """The server spans of one port, for counting those in flight during an interval: their start
    times, sorted, and their end times, sorted, each with its span's start beside it (``_began``,
    in order of start among equal ends). Which spans they are is the trace index's (a span is here
    exactly while it is indexed there), so the times are all this holds: a dict of each span's
    extent by its ids beside them was 150-175 bytes a server span, 1.3-1.6 MiB of the memory window
    at 100 req/s (bench/correlate_memory.py; docs/footprint.md, forty-fifth pass); the start beside
    each end is 8 (an end and start as one number, 48)."""

    __slots__ = ("_began", "_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._began = array("q")

    def _slot(self, span: SpanRecord) -> int:
        """Where ``span``'s end lies in ``_ends``: among equal ends, by its start."""
        low = bisect.bisect_left(self._ends, span.end_ns)
        return bisect.bisect_left(self._began, span.start_ns, low, bisect.bisect_right(self._ends, span.end_ns, low))

    def add(self, span: SpanRecord) -> None:
        bisect.insort(self._starts, span.start_ns)
        at = self._slot(span)
        self._ends.insert(at, span.end_ns)
        self._began.insert(at, span.start_ns)

    def in_flight(self, ts_ns: int, until_ns: int) -> int:
        return bisect.bisect_right(self._starts, until_ns) - bisect.bisect_left(self._ends, ts_ns)

    def started(self, after_ns: int, until_ns: int) -> int:
        """Spans that started in (after, until]."""
        return bisect.bisect_right(self._starts, until_ns) - bisect.bisect_right(self._starts, after_ns)

    def ended(self, after_ns: int, until_ns: int) -> int:
        """Spans that ended in (after, until]."""
        return bisect.bisect_right(self._ends, until_ns) - bisect.bisect_right(self._ends, after_ns)

    def lengths_ended(self, after_ns: int, until_ns: int) -> list[int]:
        """How long each span that ended in (after, until] lasted, in nanoseconds."""
        first, last = bisect.bisect_right(self._ends, after_ns), bisect.bisect_right(self._ends, until_ns)
        return [max(0, end - start) for end, start in zip(self._ends[first:last], self._began[first:last],
                                                          strict=True)]

    def remove(self, span: SpanRecord) -> None:
        """Forget one span (added once) that stays indexed but no longer counts."""
        del self._starts[bisect.bisect_left(self._starts, span.start_ns)]
        at = self._slot(span)
        del self._ends[at], self._began[at]

    def remove_many(self, spans: Iterable[SpanRecord]) -> bool:
        """Forget these spans (each added once); False when none is left. The prune forgets the
        port's oldest spans, whose times lie at the front of its sorted lists: deleting them one by
        one moved the whole of both lists for each (a twentieth of a round's time once the memory
        window was full), where this walks the front once, up to the last time it drops."""
        starts: list[int] = []
        ended: list[tuple[int, int]] = []
        for span in spans:
            starts.append(span.start_ns)
            ended.append((span.end_ns, span.start_ns))
        if starts:
            self._starts = _without(self._starts, starts)
            self._ends, self._began = _without_ended(self._ends, self._began, ended)
        return bool(self._starts)


def in_flight_among(items: Iterable[T], start: Callable[[T], int], running_at: Callable[[T, int], bool],
                    ts_ns: int, closed_at: Iterable[int], wait_ns: int, earliest_ns: int | None = None, *,
                    peer_fin: bool, events_at: Iterable[int]) -> T | None:
    """Of one connection's server spans (or their live notices), the one in flight when the client
    left at ``ts_ns`` (``TraceIndex.in_flight`` tells the rules): one running at some moment of
    [``earliest_ns``, ``ts_ns``], the latest to start; else the first to start within ``wait_ns``
    after, if its request can have been unread then (``unread_before``). ``start(item)``: when it
    started; ``running_at(item, ns)``: whether it had not ended by then."""
    items = list(items)
    earliest = ts_ns if earliest_ns is None else min(earliest_ns, ts_ns)
    running = [item for item in items if start(item) <= ts_ns and running_at(item, earliest)]
    later = [item for item in items if ts_ns < start(item) <= ts_ns + wait_ns]
    first = min(later, key=start) if later else None
    unread = first is not None and unread_before(ts_ns, start(first), closed_at, peer_fin=peer_fin,
                                                 events_at=events_at)
    if running:
        latest = max(running, key=start)
        if unread and not running_at(latest, ts_ns + NEXT_REQUEST_RACE_NS):
            # A keep-alive client read the whole answer, sent its next request and left at once,
            # before the server had ended the answer's span: it left that next request, which the
            # server read after the close, and the answer was complete (an HTTP/1.1 client sends
            # the next request only once it has read the last; none pipelines). A polled close
            # too: the server may read that request only after the poll that saw the close.
            return first
        return latest
    return first if unread else None


def _span_start(span: SpanRecord) -> int:
    return span.start_ns


def _span_running_at(span: SpanRecord, ts_ns: int) -> bool:
    return span.end_ns >= ts_ns


def unread_before(ts_ns: int, start_ns: int, closed_at: Iterable[int], *, peer_fin: bool,
                  events_at: Iterable[int]) -> bool:
    """Whether a client that left at ``ts_ns``, before any span on its connection, left the request
    of the first span that starts there later, at ``start_ns``, unread in the server's buffer
    (``TraceIndex.in_flight`` says when); not, where the 4-tuple may have been reused in between."""
    if peer_fin and start_ns - ts_ns < TIME_WAIT_REUSE_NS:
        return True  # the client's TIME_WAIT holds the 4-tuple: no new connection can have it yet
    if not peer_fin:  # a reset: any later event but its own close is another connection's
        return start_ns - ts_ns < RESET_UNREAD_NS and not any(at > ts_ns + RESET_OWN_CLOSE_NS for at in events_at)
    # After a FIN any close of the server's socket counts, however soon: a server that is idle on
    # a keep-alive connection closes within a fraction of a millisecond of the FIN.
    return not any(ts_ns <= closed <= start_ns for closed in closed_at)


class TraceIndex:
    def __init__(self) -> None:
        self._by_trace: dict[str, dict[str, SpanRecord]] = defaultdict(dict)
        # (arrival time, trace) in arrival order. A span that overlaps a window ended after the
        # window began and so arrived after it too: scanning back from the newest arrival finds
        # every candidate, and pruning pops from the oldest, without touching the rest.
        self._arrivals: deque[tuple[int, str]] = deque()
        self._entries: dict[str, int] = defaultdict(int)  # arrivals in line per trace
        self._http_by_tuple: dict[Tuple4, list[SpanRecord]] = defaultdict(list)
        self._engine_by_request_id: dict[str, SpanRecord] = {}
        # Server spans without a peer address, by server port, until a close claims them.
        self._peerless: dict[int, list[SpanRecord]] = defaultdict(list)
        # Server spans by server port: their starts and their ends, each list sorted. Spans in flight
        # at some moment of [ts, until] are those started by ``until`` less those ended before
        # ``ts`` (which all started before it): two bisects, however many spans the port has seen.
        self._http_by_port: dict[int, PortSpans] = defaultdict(PortSpans)
        self.runs = RunIndex()  # when each request ran, for sharing its cost
        # Server port -> the addresses its server spans came from (``auditor.sender_address``, kept
        # for containers' spans) -> the latest start among them: a server on the port that is no
        # engine is left out of its summed gauges only while none of the spans counted there is
        # its (EngineMetricsScraper.scrape). Read by the scraper's thread (a lookup, no iteration).
        self.senders: dict[int, dict[str, int]] = {}

    def add(self, span: SpanRecord, arrived_ns: int) -> bool:
        """Index a span; False when it was already known (a duplicate delivery)."""
        spans = self._by_trace[span.trace_id]
        if span.span_id in spans:
            return False
        if spans:  # hold the trace's id, and a parent's span id, once (the record is the correlator's)
            _share(span, "trace_id", next(iter(spans.values())).trace_id)
            parent = spans.get(span.parent_span_id) if span.parent_span_id else None
            if parent is not None:
                _share(span, "parent_span_id", parent.span_id)
        spans[span.span_id] = span
        self.runs.add(span)
        newest = self._arrivals[-1] if self._arrivals else (arrived_ns, "")
        arrival = (max(arrived_ns, newest[0]), span.trace_id)  # monotonic even if the clock steps back
        if arrival != newest:  # a trace's spans mostly come together: one entry for them
            self._arrivals.append(arrival)
            self._entries[span.trace_id] += 1
        if span.role is SpanRole.HTTP_SERVER and span.server_port:
            sender = span.attributes.get(SENDER_KEY)
            if sender:
                known = self.senders.get(span.server_port)
                if known is None or (len(known) >= MAX_SENDERS and sender not in known):
                    known = self.senders[span.server_port] = {}
                if known.get(sender, -1) < span.start_ns:
                    known[sender] = span.start_ns
            if _counts_on_port(span, spans):
                self._http_by_port[span.server_port].add(span)
            self._uncount_children(span)  # counted or not itself: its children are duplicates now
        if span.role is SpanRole.HTTP_SERVER and not span.peer_rewritten and span.peer_port and span.server_port:
            self._http_by_tuple[span_tuple(span)].append(span)
        elif span.role is SpanRole.HTTP_SERVER and not span.peer_rewritten and not span.peer_port and span.server_port:
            self._peerless[span.server_port].append(span)
        elif span.role is SpanRole.ENGINE and span.request_id:
            self._engine_by_request_id[span.request_id] = span
        return True

    def _uncount_children(self, span: SpanRecord) -> None:
        """A server span's duplicates that came before it (a child ends, and is exported, first)
        stop counting on its port now that it is here: whether a span counts depends on its
        parent alone (``_counts_on_port``), so the prune takes out exactly what was counted."""
        if span.peer_port and not span.peer_rewritten:
            for other in self._http_by_tuple.get(span_tuple(span), ()):
                if other.parent_span_id == span.span_id and other.trace_id == span.trace_id:
                    self._http_by_port[span.server_port or 0].remove(other)

    def get(self, trace_id: str, span_id: str) -> SpanRecord | None:
        return self._by_trace.get(trace_id, {}).get(span_id)

    def engines_named_by(self, http: SpanRecord) -> list[SpanRecord]:
        """The engine spans whose request id the engine derived from this server span's
        ``X-Request-Id`` (``engine_request_ids``), in whatever trace they are."""
        if not http.request_id:
            return []
        found = (self._engine_by_request_id.get(candidate) for candidate in engine_request_ids(http.request_id))
        return [engine for engine in found if engine is not None]

    def trace(self, trace_id: str) -> Iterable[SpanRecord]:
        return self._by_trace.get(trace_id, {}).values()

    def arrived_since(self, since_ns: int) -> Iterator[dict[str, SpanRecord]]:
        """Every trace with a span that arrived at or after ``since_ns`` (newest first, once each)."""
        seen: set[str] = set()
        for arrived_ns, trace_id in reversed(self._arrivals):
            if arrived_ns < since_ns:
                return
            if trace_id not in seen and trace_id in self._by_trace:
                seen.add(trace_id)
                yield self._by_trace[trace_id]

    def server_spans_started(self, port: int, after_ns: int, until_ns: int) -> int:
        """How many server spans on ``port`` started in (after, until]."""
        spans = self._http_by_port.get(port)
        return 0 if spans is None else spans.started(after_ns, until_ns)

    def server_spans_ended(self, port: int, after_ns: int, until_ns: int) -> int:
        """How many server spans on ``port`` ended in (after, until]."""
        spans = self._http_by_port.get(port)
        return 0 if spans is None else spans.ended(after_ns, until_ns)

    def server_span_lengths_ended(self, port: int, after_ns: int, until_ns: int) -> list[int]:
        """How long each server span on ``port`` that ended in (after, until] lasted (ns)."""
        spans = self._http_by_port.get(port)
        return [] if spans is None else spans.lengths_ended(after_ns, until_ns)

    def server_spans_on(self, port: int, ts_ns: int, until_ns: int, also: set[tuple[str, str]]) -> int:
        """How many server spans on ``port`` were in flight at any moment of [ts, until], counting
        too the (trace, span) keys in ``also`` (live notices) that are not among them."""
        spans = self._http_by_port.get(port)
        if spans is None:
            return len(also)
        return spans.in_flight(ts_ns, until_ns) + sum(1 for key in also if not self._covers(port, key, ts_ns, until_ns))

    def _covers(self, port: int, key: tuple[str, str], ts_ns: int, until_ns: int) -> bool:
        """Whether the server span ``key`` (trace, span id) is among ``port``'s and was in flight at
        some moment of [ts, until]: a server span with a port is among that port's while indexed."""
        span = self.get(*key)
        return (span is not None and span.role is SpanRole.HTTP_SERVER and span.server_port == port
                and span.start_ns <= until_ns and span.end_ns >= ts_ns)

    def on_connection(self, tuple4: Tuple4, not_from: AbstractSet[str] = frozenset()) -> list[SpanRecord]:
        """The server spans on a connection's 4-tuple, but those sent from ``not_from`` (the other
        containers serving its port, ``Correlator.elsewhere``)."""
        spans = self._http_by_tuple.get(tuple4, [])
        if not_from and spans:
            return [span for span in spans if span.attributes.get(SENDER_KEY) not in not_from]
        return spans

    def in_flight(self, tuple4: Tuple4, ts_ns: int, closed_at: Iterable[int], wait_ns: int,
                  earliest_ns: int | None = None, *, peer_fin: bool = False,
                  events_at: Iterable[int], not_from: AbstractSet[str] = frozenset()) -> SpanRecord | None:
        """The server span in flight on this connection when the client left at ``ts_ns``.

        A polled close is an interval (``earliest_ns``, ``ts_ns``]: a span in flight at any moment
        of it qualifies (the latest to start, on a keep-alive connection). Before any span: the
        request was already in the server's receive buffer (a client that sends and leaves at
        once, AIPerf's delay 0), so a span that starts later on the same connection, with no close
        of the server's socket in between (which would mean the 4-tuple was reused), was in flight
        too. The close a reset itself causes (within ``RESET_OWN_CLOSE_NS``) is not such a close;
        nor, after the client's FIN, is any close within ``TIME_WAIT_REUSE_NS``: a server may close
        at the FIN while its request still waits for the application (uvicorn does), and the
        client, which closed first, holds the 4-tuple in TIME_WAIT at least that long. After a
        reset nothing holds the 4-tuple: only a span that starts within ``RESET_UNREAD_NS`` of it
        qualifies, and only while no later event on the 4-tuple (``events_at``: the times of every
        event on it) shows another connection there, since the reset socket makes none after its
        own close (the /proc source's ambiguous "gone", a FIN and the server's close within one
        poll, reads as a reset and is judged the same way). Spans sent from ``not_from`` are not
        looked at: another container's requests on a 4-tuple that its port shares with this one.
        """
        return in_flight_among(self.on_connection(tuple4, not_from), _span_start, _span_running_at, ts_ns,
                               closed_at, wait_ns, earliest_ns, peer_fin=peer_fin, events_at=events_at)

    def peerless(self) -> list[SpanRecord]:
        """Unclaimed server spans without a peer address, oldest first."""
        return sorted((s for spans in self._peerless.values() for s in spans), key=lambda s: s.start_ns)

    def claim_peerless(self, span: SpanRecord) -> None:
        spans = self._peerless.get(span.server_port or 0, [])
        if span in spans:
            spans.remove(span)

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
        """Forget traces whose spans all arrived before ``cutoff_ns``, except those in ``keep``
        (they go back in line as if they had just arrived)."""
        kept: list[str] = []
        leaving: dict[int, list[SpanRecord]] = {}
        while self._arrivals and self._arrivals[0][0] < cutoff_ns:
            _, trace_id = self._arrivals.popleft()
            remaining = self._entries[trace_id] - 1
            if remaining:
                self._entries[trace_id] = remaining
                continue
            del self._entries[trace_id]
            if trace_id in keep:
                kept.append(trace_id)
            else:
                self._forget(trace_id, leaving)
        for port, spans in leaving.items():
            on_port = self._http_by_port.get(port)
            if on_port is not None and not on_port.remove_many(spans):
                del self._http_by_port[port]
        newest = self._arrivals[-1][0] if self._arrivals else cutoff_ns
        for trace_id in kept:
            self._arrivals.append((newest, trace_id))
            self._entries[trace_id] = 1

    def _forget(self, trace_id: str, leaving: dict[int, list[SpanRecord]]) -> None:
        """Drop a trace's spans; its server spans are added to ``leaving`` (by port), for the
        caller to take out of their ports' lists in one pass each."""
        spans = self._by_trace.pop(trace_id, {})
        for span in spans.values():
            if span.role is SpanRole.HTTP_SERVER and span.server_port and _counts_on_port(span, spans):
                leaving.setdefault(span.server_port, []).append(span)
            if span.role is SpanRole.ENGINE and span.request_id:
                if self._engine_by_request_id.get(span.request_id) is span:
                    del self._engine_by_request_id[span.request_id]
            elif span.role is SpanRole.HTTP_SERVER and not span.peer_port:
                self.claim_peerless(span)
            elif span.role is SpanRole.HTTP_SERVER:
                on_tuple = self._http_by_tuple.get(span_tuple(span))
                if on_tuple is not None and span in on_tuple:
                    on_tuple.remove(span)
                    if not on_tuple:
                        del self._http_by_tuple[span_tuple(span)]
