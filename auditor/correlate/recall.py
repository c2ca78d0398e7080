"""Settled requests whose spans the correlator no longer holds, brought back when a late span comes.

Holding every span of the horizon (15 minutes) in memory made the daemon grow with its request
rate, about 5 KB a request: at 100 requests/s, past any sane memory limit within ten minutes. The
correlator holds a settled request only for its late-span window and a margin. A span that arrives
later for its trace (vLLM's span for a request its client left long ago, sent when the work at last
ended) brings the trace's stored spans and verdicts back from the store, and the request is judged
again as if it had never left memory.

Which traces those are is the store's to say, not memory's: every settled request has its verdict
row. A trace is forgotten when this run wrote a verdict of it that the correlator no longer holds,
its requests disconnected within the horizon. Asking costs one indexed query for all of a round's
new spans; remembering them cost about 110 bytes a request for the whole horizon, the one part of
the correlator's memory that grew with it (9 MiB at 100 req/s by the fifteenth minute).

Most new spans are of traces this run never judged, so the store is asked only about those that
``WrittenFilter`` may hold: the trace ids and request ids of the verdicts this run wrote, in a
fixed 1 MiB whatever the rate (a Bloom filter, so a yes may be wrong and the store then says no;
a no never is). The two queries a round were about a fifth of the correlator's samples in taking in
spans (py-spy: 34 of 181).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from auditor.correlate.requests import Disconnect, OpenRequest
from auditor.correlate.traces import norm_addr
from auditor.correlate.waste import HORIZON_NS
from auditor.model import ENCLOSING_MINUTES, MINUTE_NS, Phase, RequestVerdict, SpanRecord, Verdict
from auditor.store.db import SPAN_COLUMNS, Store, span_from_values
from auditor.store.spankeys import minutes_between
from auditor.store.sql import json_value

_VERDICT_COLUMNS = tuple(RequestVerdict.__dataclass_fields__)
# A trace's spans, in the minutes named (the key leads with them: auditor/store/spankeys.py).
_TRACE_SPANS = (f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans "
                "WHERE start_minute IN ({minutes}) AND trace_id = :trace_id AND host = :host")
# A trace's requests: their keys are "host/trace/root", so the trace's keys lie between two texts.
_TRACE_VERDICTS = (f"SELECT {', '.join(_VERDICT_COLUMNS)} FROM verdicts "
                   "WHERE request_key >= :first AND request_key < :after")
# This run's verdicts of a trace, by the trace's range of request keys (no index of trace ids:
# auditor/store/tables.py), and of some engine request ids, in the minutes named (the index of
# request ids leads with the disconnect minute): the candidates.
_WRITTEN_OF_TRACE = ("SELECT request_key, disconnect_at_ns FROM verdicts "
                     "WHERE request_key >= :first AND request_key < :after AND updated_ns >= :since")
_WRITTEN_BY_REQUEST_ID = ("SELECT request_id, request_key, disconnect_at_ns FROM verdicts "
                          "WHERE disconnect_minute IN ({minutes}) AND request_id IN ({names}) "
                          "AND host = :host AND updated_ns >= :since")
# Disconnects this far past the correlator's horizon (a wall clock stepped back) are still found.
_AHEAD_NS = 5 * MINUTE_NS
_RECALL_REACH_NS = 24 * 60 * MINUTE_NS  # the most minutes a recall names: a day
_CHUNK = 400  # ids a query: far below any driver's parameter limit
_FILTER_BITS = 20  # the written filter's positions: 2**20, a byte each (a bit for each generation)
_MASK = (1 << _FILTER_BITS) - 1
_TO_PREVIOUS = bytes((mark & 1) << 1 for mark in range(256))  # the current generation's mark becomes the previous's

# Whether the correlator holds a request (by trace id and root span id): open, or settled in memory.
Holds = Callable[[str, str], bool]


class WrittenFilter:
    """The values (trace ids, request ids) of this run's verdicts, kept for as long as a verdict
    can be recalled: ``may_hold`` never says no for a value ``add``ed with a disconnect that is
    still within the horizon, and says yes for one never added about twice in 1,000 at 100
    requests/s (a generation of 45,000 values: 25 verdicts a second, a trace id and a request id
    each, for 15 minutes).

    A Bloom filter of two generations: three positions a value, from its ``hash`` (a string's is
    computed once and kept), in one byte array whose bit 0 marks the current generation and bit 1
    the previous. Values go to the current one until the horizon passes the earliest disconnect it
    holds (it then spans a horizon's verdicts) and has passed every one the previous holds; then
    the current becomes the previous (one ``translate`` of the array) and the old previous is let
    go. Memory stays 1 MiB however many verdicts there are."""

    def __init__(self, horizon_start: Callable[[], int]) -> None:
        self.horizon_start = horizon_start
        self._marks = bytearray(1 << _FILTER_BITS)
        self._current_from: int | None = None  # the earliest disconnect the current holds
        self._current_until = self._previous_until = -1  # the latest disconnect each holds
        self.rotations = 0

    def add(self, value: str, disconnect_ns: int, horizon_start_ns: int | None = None) -> None:
        """``horizon_start_ns``: the horizon's start now, where the caller adds many at once."""
        if self._current_from is not None:
            start = self.horizon_start() if horizon_start_ns is None else horizon_start_ns
            if self._current_from < start and self._previous_until < start:
                self._marks = bytearray(self._marks.translate(_TO_PREVIOUS))
                self._previous_until, self._current_until, self._current_from = self._current_until, -1, None
                self.rotations += 1
        marks, h = self._marks, hash(value)
        marks[h & _MASK] |= 1
        marks[(h >> _FILTER_BITS) & _MASK] |= 1
        marks[(h >> 2 * _FILTER_BITS) & _MASK] |= 1
        self._current_until = max(self._current_until, disconnect_ns)
        self._current_from = disconnect_ns if self._current_from is None else min(self._current_from, disconnect_ns)

    def may_hold(self, value: str) -> bool:
        marks, h = self._marks, hash(value)
        return bool(marks[h & _MASK] & marks[(h >> _FILTER_BITS) & _MASK] & marks[(h >> 2 * _FILTER_BITS) & _MASK])


class Forgotten:
    """The settled traces the correlator no longer holds, as the store tells, and their recall.
    The correlator tells it each verdict it writes (``written``): the store is asked only about
    the values of those."""

    def __init__(self, store: Store, host: str, holds: Holds, horizon_start: Callable[[], int],
                 horizon_ns: int = HORIZON_NS) -> None:
        self.store = store
        self.host = host
        self.holds = holds
        self.horizon_start = horizon_start  # requests that disconnected before it are not recalled
        self.horizon_ns = horizon_ns  # how long the horizon is: its minutes are those looked in
        # This run's: verdicts written from now on. A restarted daemon reads the horizon's spans
        # back without the requests it settled before (they stay as written, as they did).
        self.since_ns = time.time_ns()
        self.filter = WrittenFilter(horizon_start)
        self.recalled = 0

    def written(self, verdicts: Iterable[RequestVerdict]) -> None:
        """These verdicts of this run are (about to be) in the store."""
        add, start = self.filter.add, self.horizon_start()  # the clock once: a round's verdicts at a time
        for verdict in verdicts:
            if verdict.host != self.host:
                continue
            for value in (verdict.trace_id, verdict.request_id):  # the columns ``_find`` matches
                if value:
                    add(value, verdict.disconnect_at_ns, start)

    def traces(self, trace_ids: Iterable[str]) -> set[str]:
        """Those of ``trace_ids`` that are forgotten."""
        may_hold = self.filter.may_hold
        candidates = sorted({trace_id for trace_id in trace_ids if trace_id and may_hold(trace_id)})
        if not candidates:
            return set()
        rows: list[Any] = []
        with self.store.connect() as conn:
            for trace_id in candidates:
                prefix = f"{self.host}/{trace_id}/"
                params = {"first": prefix, "after": prefix[:-1] + "0", "since": self.since_ns}
                rows += [(trace_id, *row) for row in conn.all(_WRITTEN_OF_TRACE, params)]
        return set(self._forgotten(rows).values())

    def by_request_id(self, request_ids: Iterable[str]) -> dict[str, str]:
        """Request ids (the engine's, as settled verdicts hold them) -> their forgotten trace. Only
        verdicts whose client left in the horizon's minutes are looked at: older ones are not
        recalled anyway."""
        may_hold = self.filter.may_hold
        ordered = sorted({value for value in request_ids if value and may_hold(value)})
        if not ordered:
            return {}
        start = self.horizon_start()
        minutes = minutes_between(start, start + self.horizon_ns + _AHEAD_NS)
        rows: list[Any] = []
        with self.store.connect() as conn:
            for i in range(0, len(ordered), _CHUNK):
                chunk = ordered[i:i + _CHUNK]
                params: dict[str, Any] = {f"v{j}": value for j, value in enumerate(chunk)}
                params |= {f"m{j}": minute for j, minute in enumerate(minutes)}
                params |= {"host": self.host, "since": self.since_ns}
                sql = _WRITTEN_BY_REQUEST_ID.format(minutes=", ".join(f":m{j}" for j in range(len(minutes))),
                                                    names=", ".join(f":v{j}" for j in range(len(chunk))))
                rows += conn.all(sql, params)
        return self._forgotten(rows)

    def _forgotten(self, rows: list[Any]) -> dict[str, str]:
        """Matched value -> trace id, for the forgotten traces among this run's verdict rows
        (value, request key, disconnect time)."""
        # A trace is forgotten while every request of it that memory does not hold disconnected
        # within the horizon (one older than it leaves the trace to the store for good).
        cutoff = self.horizon_start()
        by_trace: dict[str, bool] = {}
        found: dict[str, str] = {}
        for value, request_key, disconnect_ns in rows:
            _host, trace_id, root_id = request_key.rsplit("/", 2)
            if self.holds(trace_id, root_id):
                continue
            by_trace[trace_id] = by_trace.get(trace_id, True) and disconnect_ns >= cutoff
            found[value] = trace_id
        return {value: trace_id for value, trace_id in found.items() if by_trace[trace_id]}

    def recall(self, trace_id: str) -> tuple[list[SpanRecord], list[OpenRequest]]:
        """The trace's stored spans and its settled requests as they were written. The spans are
        those that started from the horizon before its first request's start to the horizon after
        its last request's disconnect or work end (``auditor.model.ENCLOSING_MINUTES``): a
        request's own spans all do. At most a day of minutes is named (a request start that a bad
        clock put years back must not make a query of millions)."""
        self.recalled += 1
        prefix = f"{self.host}/{trace_id}/"
        with self.store.connect() as conn:
            requests = [_request_from_row(row) for row in
                        conn.all(_TRACE_VERDICTS, {"first": prefix, "after": prefix[:-1] + "0"})]
            if not requests:
                return [], []
            verdicts = [request.written for request in requests if request.written is not None]
            reach_ns = ENCLOSING_MINUTES * MINUTE_NS
            last_ns = max(max(v.disconnect_at_ns, v.work_end_ns or 0, v.request_start_ns) for v in verdicts) + reach_ns
            first_ns = max(min(v.request_start_ns for v in verdicts) - reach_ns, last_ns - _RECALL_REACH_NS)
            minutes = minutes_between(first_ns, last_ns)
            params: dict[str, Any] = {f"m{i}": minute for i, minute in enumerate(minutes)}
            sql = _TRACE_SPANS.format(minutes=", ".join(f":m{i}" for i in range(len(minutes))))
            spans = [span_from_values(row) for row in conn.all(sql, params | {"trace_id": trace_id, "host": self.host})]
        return spans, requests


def _request_from_row(row: tuple[object, ...]) -> OpenRequest:
    """A settled request as its verdict row tells: its key, the client's disconnect, the verdict."""
    columns: dict[str, Any] = dict(zip(_VERDICT_COLUMNS, row, strict=True))
    verdict = RequestVerdict(**(columns | {"verdict": Verdict(columns["verdict"]),
                                           "phase": Phase(columns["phase"] or Phase.UNKNOWN.value),
                                           "tokens_exact": bool(columns["tokens_exact"]),
                                           "details": json_value(columns["details"]) or {}}))
    _host, trace_id, root_id = verdict.request_key.rsplit("/", 2)
    tuple4 = (norm_addr(verdict.client_addr or ""), verdict.client_port or 0, verdict.server_port or 0)
    request = OpenRequest((trace_id, root_id), written=verdict, reported=verdict.verdict)
    # The event id is gone with the event's memory; a settled request is never pending again.
    request.add(Disconnect(0, verdict.disconnect_at_ns, verdict.disconnect_kind, tuple4))
    return request
