"""The daemon's per-round bookkeeping beside the verdicts: completed requests for /metrics, the
engine pids the CPU sampler follows, and the minute's mean utilization.

Each round looks at the spans the correlator took in that round. A completion counts once its
span has settled (``SPAN_SETTLE_NS``), so that a server span inside
another (FastAPI's own telemetry beside the ASGI middleware, a traced gateway hop) is known as
such and not counted twice. The minute's utilization moves slowly and is re-read every
``UTILIZATION_REFRESH_S``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from auditor.metrics import DaemonMetrics
from auditor.model import SpanRecord, SpanRole, is_inner_server_span
from auditor.store.db import Store

UTILIZATION_REFRESH_S = 10.0
SPAN_SETTLE_NS = 5_000_000_000  # completions are counted once the spans around them have arrived
PID_FOLLOW_NS = 60 * 1_000_000_000  # how long the CPU sampler follows a pid no span names any more
# Each source's mean over the minute: whole GPUs (no pid) and the engine processes' CPU (procfs).
_MEAN_UTILIZATION = ("SELECT source, avg(util_percent) FROM util_samples "
                     "WHERE ts_ns > :since AND host = :host AND (pid IS NULL OR source = 'procfs') "
                     "GROUP BY source")


def completed_requests(rows: Sequence[Any], engine_spans_seen: bool) -> tuple[int, bool]:
    """How many of these new span rows (``role``, ``http_status``, ``finish_reason``) are requests
    that finished normally, and whether engine spans have been seen. Engine spans say so exactly (a
    cancelled stream still ends its HTTP span "200 OK"); once one has been seen, only they count.
    Where no engine reports spans, HTTP server spans below 400 do."""
    engine = [r for r in rows if r.role == SpanRole.ENGINE.value]
    if engine or engine_spans_seen:
        return sum(1 for r in engine if r.finish_reason not in (None, "abort")), True
    return sum(1 for r in rows if r.http_status is not None and r.http_status < 400), False


class Upkeep:
    """Called once per correlation round from the correlator's thread, with the spans that round
    took in (``arrived``) and a way to find a span of a trace the correlator holds (``lookup``)."""

    def __init__(self, store: Store, host: str, metrics: DaemonMetrics,
                 follow_pids: Callable[[set[int]], None] | None,
                 find_engines: Callable[[], set[int]] = set) -> None:
        self.store, self.host, self.metrics = store, host, metrics
        self._follow, self._find_engines = follow_pids, find_engines
        self._engine_spans_seen = False  # then completions are counted from engine spans only
        # New spans whose surrounding spans may not have arrived: a heap by end (then arrival).
        self._unsettled: list[tuple[int, int, SpanRecord]] = []
        self._arrival = itertools.count()
        self._pids: dict[int, int] = {}  # engine pid -> when a span last named it (wall ns)
        self._following: set[int] | None = None
        self._next_utilization = 0.0

    def round(self, arrived: Sequence[SpanRecord] = (),
              lookup: Callable[[str, str], SpanRecord | None] = lambda trace, span: None) -> None:
        now_ns = time.time_ns()
        unsettled = self._unsettled
        for span in arrived:
            if span.role is SpanRole.HTTP_SERVER or span.role is SpanRole.ENGINE:
                heapq.heappush(unsettled, (span.end_ns, next(self._arrival), span))
        settled = []
        while unsettled and unsettled[0][0] < now_ns - SPAN_SETTLE_NS:
            settled.append(heapq.heappop(unsettled)[2])
        if settled:
            # A server span inside another (a second instrumentation, a traced gateway hop) is no
            # request of its own; asked once the spans around it have arrived.
            requests = [s for s in settled if s.role is not SpanRole.HTTP_SERVER or not is_inner_server_span(s, lookup)]
            count, self._engine_spans_seen = completed_requests(requests, self._engine_spans_seen)
            self.metrics.completed(count)
        # A pid of 1 is an engine that is its container's first process, named in its own
        # namespace: on this host it is init. Its host process is the port's listener, followed below.
        self._follow_pids({s.process_pid for s in arrived if s.process_pid and s.process_pid > 1}, now_ns)
        if time.monotonic() >= self._next_utilization:
            self._next_utilization = time.monotonic() + UTILIZATION_REFRESH_S
            self._refresh_utilization(now_ns)

    def _follow_pids(self, seen: set[int], now_ns: int) -> None:
        """A pid a new span names, or that listens on a watched port, is followed at once; one
        unseen for a minute is let go."""
        for pid in seen | self._find_engines():
            self._pids[pid] = now_ns
        for pid in [p for p, last in self._pids.items() if now_ns - last > PID_FOLLOW_NS]:
            del self._pids[pid]
        if self._follow is not None and set(self._pids) != self._following:
            self._following = set(self._pids)
            self._follow(set(self._following))

    def _refresh_utilization(self, now_ns: int) -> None:
        with self.store.connect() as conn:
            util = conn.all(_MEAN_UTILIZATION, {"since": now_ns - PID_FOLLOW_NS, "host": self.host})
        self.metrics.set_utilization({source: (mean or 0.0) / 100.0 for source, mean in util})
