"""What live notices say is running now: the correlator's view of requests in flight."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from auditor.correlate.ids import HexKey, SpanKey, hex_key, span_key
from auditor.correlate.prune import drop_front
from auditor.correlate.traces import Tuple4, in_flight_among, norm_addr
from auditor.correlate.verdict import NORMAL_FINISH
from auditor.model import LiveEvent


class LiveState:
    """Requests in flight as far as start/end notices tell, keyed for the correlator's joins."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], LiveEvent] = {}
        # Kept for the horizon, one entry a request: by number, not by text (auditor.correlate.ids).
        # trace -> when its engine work last ended and what the notice told of the finish, packed
        # in one int (``_packed``): one entry a request for the horizon, 90,000 at 100 a second.
        self._engine_end: dict[HexKey, int] = {}
        self._span_end: dict[SpanKey, int] = {}  # server span -> when it ended
        self._by_tuple: dict[Tuple4, list[LiveEvent]] = defaultdict(list)

    def add(self, events: list[LiveEvent], connections: set[Tuple4] | None = None) -> set[str]:
        """Apply notices; returns the traces they concern, and adds to ``connections`` those whose
        server span they start or end (what ``in_flight_on`` answers for)."""
        for event in events:
            key = (event.trace_id, event.span_id)
            if event.event == "start":
                self._running[key] = event
                if not event.engine and event.peer_addr and event.peer_port and event.server_port:
                    tuple4 = (norm_addr(event.peer_addr), event.peer_port, event.server_port)
                    self._by_tuple[tuple4].append(event)
                    if connections is not None:
                        connections.add(tuple4)
                continue
            started = self._running.pop(key, None)
            if event.engine or (started is not None and started.engine):
                trace = hex_key(event.trace_id)
                self._engine_end.pop(trace, None)  # to the end: both are pruned from the front
                self._engine_end[trace] = _packed(event.ts_ns, event.finish)
            else:
                span = span_key(*key)
                self._span_end.pop(span, None)
                self._span_end[span] = event.ts_ns
                if connections is not None and started is not None and started.peer_addr and started.peer_port \
                        and started.server_port:
                    connections.add((norm_addr(started.peer_addr), started.peer_port, started.server_port))
        return {event.trace_id for event in events}

    def started_at(self, trace_id: str, span_id: str) -> int | None:
        """When a span still running, as notices tell, started."""
        started = self._running.get((trace_id, span_id))
        return None if started is None else started.ts_ns

    def in_flight_on(self, tuple4: Tuple4, ts_ns: int, closed_at: Iterable[int], wait_ns: int,
                     earliest_ns: int | None = None, *, peer_fin: bool = False,
                     events_at: Iterable[int] = (), not_from: AbstractSet[str] = frozenset()) -> LiveEvent | None:
        """The server span in flight on this connection when the client left at ``ts_ns``, as far
        as notices tell, by the rules of ``TraceIndex.in_flight`` (the same arguments): one running
        then, the latest to start; else the first to start later, if the request was unread then
        and the 4-tuple not reused in between (a client port comes round again within seconds).
        Notices sent from ``not_from`` (the other containers serving the port) are not looked at."""
        notices = self._by_tuple.get(tuple4)
        if notices and not_from:
            notices = [live for live in notices if live.sender not in not_from]
        if not notices:  # most closes: no notice on their connection (or none sent at all)
            return None

        return in_flight_among(notices, _started, self._running_at, ts_ns, closed_at, wait_ns,
                               earliest_ns, peer_fin=peer_fin, events_at=events_at)

    def _running_at(self, live: LiveEvent, at_ns: int) -> bool:
        """Whether the server span a start notice began still ran at ``at_ns``, as notices tell."""
        key = (live.trace_id, live.span_id)
        return key in self._running or self._span_end.get(span_key(*key), 0) >= at_ns

    def first_start_on(self, tuple4: Tuple4, from_ns: int, not_from: AbstractSet[str] = frozenset()) -> int:
        """When the first server span on this connection that started at ``from_ns`` or later began,
        as start notices not sent from ``not_from`` tell (sys.maxsize: none)."""
        return min((live.ts_ns for live in self._by_tuple.get(tuple4, ())
                    if live.ts_ns >= from_ns and live.sender not in not_from), default=sys.maxsize)

    def running_on_connection(self, tuple4: Tuple4, ts_ns: int, by_ns: int,
                              not_from: AbstractSet[str] = frozenset()) -> bool:
        """Whether a server span on this connection that started by ``by_ns`` (and not sent from
        ``not_from``) was still running at ``ts_ns``, as notices tell."""
        return any(live.ts_ns <= by_ns and live.sender not in not_from and self._running_at(live, ts_ns)
                   for live in self._by_tuple.get(tuple4, ()))

    def running(self, trace_id: str, span_ids: set[str]) -> bool:
        """Whether any of these spans, or any engine work of the trace, is still running."""
        return any(trace == trace_id and (span_id in span_ids or live.engine)
                   for (trace, span_id), live in self._running.items())

    def span_end(self, trace_id: str, span_id: str) -> int | None:
        return self._span_end.get(span_key(trace_id, span_id))

    def engine_end(self, trace_id: str) -> int | None:
        packed = self._engine_end.get(hex_key(trace_id))
        return None if packed is None else _ended_ns(packed)

    def engine_finished_normally(self, trace_id: str) -> bool | None:
        """Whether the trace's last engine end was a normal finish (stop, length); None: untold."""
        packed = self._engine_end.get(hex_key(trace_id))
        return None if packed is None else _FINISH_TOLD[packed & _FINISH_MASK]

    def running_on(self, port: int, ts_ns: int, until_ns: int | None = None) -> set[tuple[str, str]]:
        """Server spans running on ``port`` and started by ``until_ns`` (default ``ts_ns``), as far
        as notices tell."""
        until = ts_ns if until_ns is None else until_ns
        return {key for key, e in self._running.items() if not e.engine and e.server_port == port and e.ts_ns <= until}

    def running_work(self, service: str, sender: str | None = None) -> dict[str, int]:
        """Per trace, since when notices say ``service`` runs its work: engine work where the
        service reports it, else its server spans. With ``sender`` (the container address its spans
        came from, on a port several containers serve), that container's notices only, and those
        from no container's address (a relay's, or the loopback's). Notices start at submission:
        where the engine's gauges are scraped, they, not these, tell who was running."""
        mine = [e for e in self._running.values()
                if e.service == service and (sender is None or e.sender is None or e.sender == sender)]
        work = {e.trace_id: e.ts_ns for e in mine if e.engine}
        return work or {e.trace_id: e.ts_ns for e in mine}

    def prune(self, cutoff_ns: int, ended_before_ns: int | None = None) -> None:
        """Forget what notices told before ``cutoff_ns`` (the horizon). A server span's start notice,
        held to join a client's close to the span running on its connection, goes sooner: once the
        span ended before ``ended_before_ns``, when no close still waiting to be joined is that old
        (the caller's guarantee). End times stay for the horizon: a request known only from its
        notices is judged by them, again if its trace is recalled."""
        for tuple4, lives in list(self._by_tuple.items()):
            if max(e.ts_ns for e in lives) < cutoff_ns:
                del self._by_tuple[tuple4]
            elif ended_before_ns is not None:
                kept = [e for e in lives if (e.trace_id, e.span_id) in self._running
                        or self._span_end.get(span_key(e.trace_id, e.span_id), -1) >= ended_before_ns]
                if not kept:
                    del self._by_tuple[tuple4]
                elif len(kept) < len(lives):
                    self._by_tuple[tuple4] = kept
        # Both in the order the notices ended, give or take a clock: from the front.
        drop_front(self._span_end, lambda ended: ended < cutoff_ns)
        drop_front(self._engine_end, lambda packed: _ended_ns(packed) < cutoff_ns)


# An engine end as one int: the time to the microsecond (the clock error is 2 ms), shifted left two
# bits, and in them whether its notice told a normal finish (1), another finish (2), or none (0).
_FINISH_MASK = 0b11
_FINISH_TOLD = (None, True, False, None)


def _packed(ts_ns: int, finish: str | None) -> int:
    told = 0 if finish is None else 1 if finish in NORMAL_FINISH else 2
    return (ts_ns // 1000) << 2 | told


def _ended_ns(packed: int) -> int:
    return (packed >> 2) * 1000


def _started(live: LiveEvent) -> int:
    return live.ts_ns
