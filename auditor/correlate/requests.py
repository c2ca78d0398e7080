"""The correlator's records: a request under judgement with the client disconnects joined to it,
and the counts it keeps for /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from auditor.correlate.traces import Tuple4
from auditor.model import LiveEvent, RequestVerdict, Verdict

RequestKey = tuple[str, str]  # (trace id, span id of the request's outermost server span)


@dataclass(slots=True)
class Disconnect:
    event_id: int
    ts_ns: int
    kind: str  # "fin" or "rst"
    tuple4: Tuple4
    earliest_ns: int | None = None  # a polled close: it happened in (earliest_ns, ts_ns]


@dataclass(slots=True)
class OpenRequest:
    """A request that had a client disconnect while in flight, until its verdict settles."""

    key: RequestKey
    disconnects: dict[Tuple4, Disconnect] = field(default_factory=dict)  # the first one per hop
    live_span: LiveEvent | None = None  # its server span's start, while known only live
    written: RequestVerdict | None = None
    reported: Verdict | None = None  # the verdict last handed to on_settled: a reopen that ends
    # in the same verdict is not reported (or counted) again


    def origin(self) -> Disconnect:
        return min(self.disconnects.values(), key=lambda d: d.ts_ns)

    def add(self, disconnect: Disconnect) -> None:
        known = self.disconnects.get(disconnect.tuple4)
        if known is None or disconnect.ts_ns < known.ts_ns:  # a FIN then an RST: the FIN counts
            self.disconnects[disconnect.tuple4] = disconnect


@dataclass
class CorrelatorStats:
    """What the daemon exports as metrics and the demo waits on."""

    idle_closes: int = 0
    unjoined_disconnects: int = 0
    unjoined_spans: int = 0
    proxy_rewritten: int = 0
    pending_disconnects: int = 0
    inflight_zombies: int = 0
