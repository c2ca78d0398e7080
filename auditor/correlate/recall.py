"""Settled requests whose spans the correlator no longer holds, brought back when a late span comes.

Holding every span of the horizon (15 minutes) in memory made the daemon grow with its request
rate, about 5 KB a request: at 100 requests/s, past any sane memory limit within ten minutes. The
correlator holds the spans of a settled request only for its late-span window and a margin; after
that it keeps just the trace id (and the engine's request id), here. A span that arrives later for such a
trace (vLLM's span for a request its client left long ago, sent when the work at last ended) brings
the trace's stored spans and verdicts back from the store, and the request is judged again as if
it had never left memory. The store keeps everything of the horizon anyway: this is a cache policy.

What stays is the one thing that grows with the horizon at a steady request rate (a forgotten trace
for each request a client closed), so it is kept small: a trace id as the number its hex digits
spell (``auditor.correlate.ids``), the engine's request id as its hash (a collision only
recalls a trace that is then judged again as it was), and the time a trace is kept by, rounded up
to the second, one object for all the traces of that second.
"""

from __future__ import annotations

from typing import Any

from auditor.correlate.ids import HexKey, hex_key, hex_text
from auditor.correlate.prune import drop_front
from auditor.correlate.requests import Disconnect, OpenRequest
from auditor.correlate.traces import norm_addr
from auditor.model import Phase, RequestVerdict, SpanRecord, Verdict
from auditor.store.db import SPAN_COLUMNS, Store, span_from_values
from auditor.store.sql import json_value

_VERDICT_COLUMNS = tuple(RequestVerdict.__dataclass_fields__)
_TRACE_SPANS = f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE trace_id = :trace_id AND host = :host"
# A trace's requests: their keys are "host/trace/root", so the trace's keys lie between two texts.
_TRACE_VERDICTS = (f"SELECT {', '.join(_VERDICT_COLUMNS)} FROM verdicts "
                   "WHERE request_key >= :first AND request_key < :after")
_S = 1_000_000_000


class Forgotten:
    def __init__(self, store: Store, host: str) -> None:
        self.store = store
        self.host = host
        # Both in the order traces were forgotten, oldest first give or take a pruning pass, so that
        # pruning stops at the first trace it keeps: rebuilding them every pass, tens of thousands
        # of entries at 100 req/s, made the correlator's rounds cost more the longer it ran.
        self._traces: dict[HexKey, int] = {}  # trace key -> its requests' first disconnect, to the second
        self._request_ids: dict[int, HexKey] = {}  # hash of the engine's request id -> trace key
        self._second = 0  # the latest of those seconds: traces forgotten in the same second share it
        self.recalled = 0

    def __len__(self) -> int:
        return len(self._traces)

    def __contains__(self, trace_id: str) -> bool:
        return hex_key(trace_id) in self._traces

    def add(self, trace_id: str, requests: list[OpenRequest]) -> None:
        key = hex_key(trace_id)
        first = min(r.origin().ts_ns for r in requests)
        second = -(-first // _S) * _S  # up: a trace is kept a little longer, never less
        if second == self._second:
            second = self._second
        self._second = second
        self._traces.pop(key, None)  # forgotten again (recalled, then settled): to the end of the line
        self._traces[key] = second
        for request in requests:
            if request.written is not None and request.written.request_id:
                request_key = hash(request.written.request_id)
                self._request_ids.pop(request_key, None)
                self._request_ids[request_key] = key

    def trace_of(self, request_id: str) -> str | None:
        key = self._request_ids.get(hash(request_id))
        return None if key is None or key not in self._traces else hex_text(key)

    def prune(self, cutoff_ns: int) -> None:
        """Forget traces whose requests left before ``cutoff_ns``, from the oldest on, up to the first
        one kept (a trace forgotten later that left earlier goes a pass or so after its time)."""
        drop_front(self._traces, lambda first_disconnect: first_disconnect < cutoff_ns)
        drop_front(self._request_ids, lambda trace_id: trace_id not in self._traces)

    def recall(self, trace_id: str) -> tuple[list[SpanRecord], list[OpenRequest]]:
        """The trace's stored spans and its settled requests as they were written; forgotten no more."""
        self._traces.pop(hex_key(trace_id), None)
        self.recalled += 1
        prefix = f"{self.host}/{trace_id}/"
        with self.store.connect() as conn:
            spans = [span_from_values(row) for row in conn.all(
                _TRACE_SPANS, {"trace_id": trace_id, "host": self.host})]
            rows = conn.all(_TRACE_VERDICTS, {"first": prefix, "after": prefix[:-1] + "0"})
        return spans, [_request_from_row(row) for row in rows]


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
