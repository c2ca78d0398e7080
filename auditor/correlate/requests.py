"""The correlator's records: a request under judgement with the client disconnects joined to it,
and the counts it keeps for /metrics."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from auditor.correlate.evidence import Registered, ScrapeSweep
from auditor.correlate.traces import Tuple4
from auditor.correlate.waste import PartialCost
from auditor.model import LiveEvent, RequestVerdict, Verdict

RequestKey = tuple[str, str]  # (trace id, span id of the request's outermost server span)


@dataclass(slots=True)
class Disconnect:
    event_id: int
    ts_ns: int
    kind: str  # "fin" or "rst"
    tuple4: Tuple4
    earliest_ns: int | None = None  # a polled close: it happened in (earliest_ns, ts_ns]
    # The server socket's address, normalized (``norm_addr``; one text an address, shared): on a
    # port several containers serve, which of them the close was on (``Correlator.elsewhere``).
    server_addr: str = ""


class Disconnects:
    """Disconnects by event id, oldest first, by connection, and by time: a round looks up only those
    on the connections it has news of, and those whose window ends (``closed_before``)."""

    def __init__(self) -> None:
        self.by_id: dict[int, Disconnect] = {}
        # Event ids per connection: a list, as a connection has one or two (a set costs 3x the memory).
        self._on: dict[Tuple4, list[int]] = defaultdict(list)
        # (ts, event id) of each added; entries of removed ones are dropped when they reach the top.
        self._by_time: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Disconnect]:
        return iter(self.by_id.values())

    def add(self, disconnect: Disconnect) -> None:
        if disconnect.event_id in self.by_id:
            self.remove(self.by_id[disconnect.event_id])
        self.by_id[disconnect.event_id] = disconnect
        self._on[disconnect.tuple4].append(disconnect.event_id)
        heapq.heappush(self._by_time, (disconnect.ts_ns, disconnect.event_id))

    def remove(self, disconnect: Disconnect) -> None:
        del self.by_id[disconnect.event_id]
        others = self._on[disconnect.tuple4]
        if disconnect.event_id in others:
            others.remove(disconnect.event_id)
        if not others:
            del self._on[disconnect.tuple4]
        if len(self._by_time) > 2 * len(self.by_id) + 1024:  # mostly entries of removed ones: rebuilt
            self._by_time = [(d.ts_ns, d.event_id) for d in self.by_id.values()]
            heapq.heapify(self._by_time)

    def first_id(self) -> int | None:
        """The lowest event id held: the first added, as events are added in the order of their ids."""
        return next(iter(self.by_id), None)

    def oldest_ns(self) -> int | None:
        """No disconnect held closed before this (an entry of a removed one may make it earlier)."""
        return self._by_time[0][0] if self._by_time else None

    def closed_before(self, cutoff_ns: int) -> list[Disconnect]:
        """Those that closed before ``cutoff_ns``, each returned once: the caller removes them.

        By time, not event id: a polled close, or one stamped by a clock stepped back, may carry an
        earlier time than events read before it."""
        heap, found = self._by_time, []
        while heap and heap[0][0] < cutoff_ns:
            ts_ns, event_id = heapq.heappop(heap)
            disconnect = self.by_id.get(event_id)
            if disconnect is not None and disconnect.ts_ns == ts_ns:
                found.append(disconnect)
        return found

    def on(self, connections: Iterable[Tuple4]) -> list[Disconnect]:
        """Those on ``connections``, oldest first."""
        ids = sorted(event_id for tuple4 in connections for event_id in self._on.get(tuple4, ()))
        return [self.by_id[event_id] for event_id in ids]


# An untouched provisional verdict is re-evaluated after these, doubling (OpenRequest.checked).
RECHECK_FIRST_NS = 1_000_000_000
RECHECK_MAX_NS = 8_000_000_000


@dataclass(slots=True)
class OpenRequest:
    """A request that had a client disconnect while in flight, until its verdict settles."""

    key: RequestKey
    disconnects: dict[Tuple4, Disconnect] = field(default_factory=dict)  # the first one per hop
    live_span: LiveEvent | None = None  # its server span's start, while known only live
    written: RequestVerdict | None = None
    reported: Verdict | None = None  # the verdict last handed to on_settled: a reopen that ends
    # in the same verdict is not reported (or counted) again
    # When the clock settles the written verdict, where only the clock and new evidence of its own
    # trace can change it (no engine scrapes on its port); set by evaluate, None otherwise.
    settles_at_ns: int | None = None
    # A verdict the engine's scrapes decided: the latest moment of the evidence it read (the
    # scrapes that decided it, the spans, closes and disconnects around them); set by evaluate.
    reads_until_ns: int | None = None
    recheck_at_ns: int = 0  # an untouched provisional verdict is not evaluated again before this
    recheck_backoff_ns: int = 0
    first: Disconnect | None = None  # the earliest of ``disconnects`` (kept by ``add``)
    cost_partial: PartialCost | None = None  # a long zombie window's cost so far (evaluate's)
    scrape_sweep: ScrapeSweep | None = None  # where its gauges' sweep stood (evaluate's)
    registrations_seen: int = 0  # EngineLoads.registrations when it was last evaluated
    # The two scrapes EngineLoads.held_one_more compared for it (their times), where it asked (evaluate's)
    compared_ns: tuple[int, int] | None = None

    def due(self, now_ns: int, news_ns: int | None = None, registered: Registered | None = None) -> bool:
        """Whether to evaluate it this round, untouched by its own trace; ``news_ns`` is the oldest
        moment that the round's new spans, closes, scrapes and live notices concern, ``registered``
        the disconnects registered since the last round (news only to some, ``Registered``)."""
        reads = self.reads_until_ns
        if reads is not None:
            if news_ns is not None and news_ns <= reads:
                return True
            if registered and self.registered_news(registered, reads) is not None:
                return True
        return now_ns >= self.recheck_at_ns

    def registered_news(self, registered: Registered, until_ns: int) -> int | None:
        """The earliest of ``registered`` that may change what it read up to ``until_ns``."""
        return registered.concerning(self.origin().ts_ns, until_ns, self.registrations_seen, self.compared_ns)

    def checked(self, now_ns: int, *, changed: bool) -> None:
        """After an evaluation, and again once a changed verdict is written (until then it is
        looked at every round: a write the store refused is computed again). A provisional verdict
        that only the clock or new evidence of its trace can change is looked at again after 1, 2,
        4, 8 s (new evidence re-evaluates it at once), and never after the moment the clock settles
        it. A verdict the engine's scrapes decided, once every scrape it reads has come, is looked
        at again on news as old as what it read (``due``) and when it settles. Anything else, a
        scrape-decided verdict still waiting on scrapes, is looked at every round."""
        written = self.written
        if changed or written is None or not written.details.get("provisional") or self.settles_at_ns is None:
            self.recheck_at_ns = self.recheck_backoff_ns = 0
            return
        if self.reads_until_ns is not None:
            self.recheck_at_ns = self.settles_at_ns
            return
        self.recheck_backoff_ns = min(max(2 * self.recheck_backoff_ns, RECHECK_FIRST_NS), RECHECK_MAX_NS)
        self.recheck_at_ns = min(now_ns + self.recheck_backoff_ns, self.settles_at_ns)

    def origin(self) -> Disconnect:
        """The client's own disconnect: the earliest (the others are the hops it set off)."""
        if self.first is None:
            raise LookupError(f"request {self.key} has no disconnect")
        return self.first

    def add(self, disconnect: Disconnect) -> None:
        known = self.disconnects.get(disconnect.tuple4)
        if known is None or disconnect.ts_ns < known.ts_ns:  # a FIN then an RST: the FIN counts
            self.disconnects[disconnect.tuple4] = disconnect
            if self.first is None or disconnect.ts_ns < self.first.ts_ns:
                self.first = disconnect


@dataclass
class CorrelatorStats:
    """What the daemon exports as metrics and the demo waits on."""

    idle_closes: int = 0
    unjoined_disconnects: int = 0
    unjoined_spans: int = 0
    proxy_rewritten: int = 0
    pending_disconnects: int = 0
    inflight_zombies: int = 0
    # Per scraped port, the requests its engine held whose clients had left more than the grace
    # before, by its gauges and the kernel's listing alone (EngineLoads.orphans_past); absent: not told.
    orphans: dict[int, int] = field(default_factory=dict)
    # Per port (and whether it sent spans lately), the orphaned work its stretches have counted so
    # far: (request-, GPU-, CPU-seconds), a new dict each round (OrphanLedger.totals).
    orphaned: dict[tuple[int, bool], tuple[float, float, float]] = field(default_factory=dict)
