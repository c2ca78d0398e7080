"""Online correlation: kernel disconnects + spans (+ live notices) -> one verdict per request.

Every tick reads what the sources added to the store since the last tick, joins each peer FIN/RST
to the request in flight on that connection at that moment (DESIGN §4), and (re)computes the
verdict of every request whose evidence changed or whose verdict depends on the clock. A request
is keyed by its trace and outermost server span (``auditor.correlate.traces``); a request
is *settled* once its work has ended and no more evidence is expected; settled verdicts are final
and are what the counters count.

Where evidence waits:
- a disconnect whose span has not arrived stays pending up to ``late_span_seconds``; then it is an
  idle close (its connection's last request had ended) or an unjoined disconnect. A span that
  arrives later still claims it, and the coverage count is corrected.
- a request whose server span ended but whose engine span has not arrived is provisional up to
  ``late_span_seconds``, or a short wait when a live notice said the engine work ended. Absence of
  an engine span proves nothing (vLLM emits none for an abort; many servers none at all): the
  engine's /metrics, or else an ``unconfirmed`` verdict, stand in (``auditor.correlate.evaluate``).

State is in memory, bounded by a horizon; ``correlator_state`` keeps the id below which every
kernel event is settled, so a restart resumes from there and upserts change nothing twice.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from auditor.correlate.evaluate import SPAN_END_RACE_NS, clock_dependent, evaluate
from auditor.correlate.evidence import (
    FINAL_SEND_ATTR,
    ORPHANS_LOOK_AGAIN_NS,
    ORPHANS_LOOK_FOR_NS,
    ORPHANS_SETTLE_NS,
    EngineLoads,
    Registered,
)
from auditor.correlate.feed import SpanFeed
from auditor.correlate.live import LiveState
from auditor.correlate.orphans import OrphanLedger
from auditor.correlate.prune import drop_front
from auditor.correlate.recall import Forgotten
from auditor.correlate.requests import (
    CorrelatorStats,
    Disconnect,
    Disconnects,
    OpenRequest,
    RequestKey,
)
from auditor.correlate.roundcpu import RoundCpu
from auditor.correlate.traces import TraceIndex, Tuple4, disconnect_instant, norm_addr, span_tuple
from auditor.correlate.verdict import CLOCK_ERROR_NS, NORMAL_FINISH, TOKENS_AFTER_DISCONNECT_ATTR
from auditor.correlate.waste import CostSources, wasted
from auditor.errors import StoreError
from auditor.model import (
    READ_UNKNOWN,
    STEP_STILL_NS,
    ConnEventKind,
    CoverageKind,
    EngineLoad,
    ListedClient,
    LiveEvent,
    RequestVerdict,
    SpanRecord,
    SpanRole,
    Verdict,
)
from auditor.semconv import SENDER_KEY, USER_AGENT_KEYS
from auditor.store.db import BLOCK_COLUMNS, SPAN_COLUMNS, Store, span_from_values, stored_events
from auditor.store.eventblocks import block_of, block_read
from auditor.store.sql import SqlError

log = logging.getLogger(__name__)

HORIZON_NS = 15 * 60 * 1_000_000_000
# How long at least a settled request's spans and its connections' events stay in memory. Later
# evidence for it is read back from the store (auditor.correlate.recall).
MIN_MEMORY_NS = 60 * 1_000_000_000
MEMORY_MARGIN_NS = 30 * 1_000_000_000
PRUNE_EVERY_NS = 10 * 1_000_000_000
# A server span starts once its request's head is read, and its body may be read after that: the
# last data read from a client belongs to a span that started at most this long before it (a
# later request on a kept-alive connection is read after the span before it ended).
REQUEST_READ_NS = 50_000_000
_END_OF_TIME = sys.maxsize
READ_ROWS = 50_000  # rows per store read: a long backlog is taken over several rounds
# Server spans remembered by request id until their service is known to span finishes: the newest
# this many (at 100 requests/s, 40 s of them; an engine span comes within its exporter's delay).
UNLEARNED_REQUEST_IDS = 4096
# The probe's events are stored a batch to a row (auditor.store.eventblocks); the cursor is an
# event id, and the block it lies in is read again only while it was read part way (a restart).
# A round reads blocks that hold about READ_ROWS events together (a block holds one to tens of
# thousands): their sizes first, then the blocks themselves.
_NEW_BLOCKS = ("SELECT id, count FROM conn_event_blocks WHERE id >= :block AND host = :host "
               f"ORDER BY id LIMIT {READ_ROWS}")
_NEW_EVENTS = (f"SELECT {BLOCK_COLUMNS} FROM conn_event_blocks "
               "WHERE id >= :block AND id <= :last AND host = :host ORDER BY id")
_NEW_SPANS = (f"SELECT id, {', '.join(SPAN_COLUMNS)} FROM spans "
              f"WHERE id > :cursor AND host = :host ORDER BY id LIMIT {READ_ROWS}")
# At a restart: the events already read before it, for what they tell about their connections.
_KNOWN_EVENTS = (f"SELECT {BLOCK_COLUMNS} FROM conn_event_blocks "
                 "WHERE id <= :block AND host = :host AND last_ts_ns > :since ORDER BY id")
_FIRST_SPAN_SINCE = "SELECT id FROM spans WHERE host = :host AND end_ns > :since ORDER BY id LIMIT 1"
_LAST_SPAN = "SELECT coalesce(max(id), 0) FROM spans"
_SAVED_POSITION = "SELECT settled_event_id FROM correlator_state WHERE host = :host"
_COUNTED = ("SELECT detail, ts_ns FROM coverage "
            "WHERE host = :host AND ts_ns > :since AND detail IS NOT NULL")
_CLOSED, _LOCAL_FIN, _PEER_RST = ConnEventKind.CLOSED.value, ConnEventKind.LOCAL_FIN.value, ConnEventKind.PEER_RST.value
_DEPARTURES = {ConnEventKind.PEER_FIN.value: "fin", ConnEventKind.PEER_RST.value: "rst"}
_STATS = {CoverageKind.IDLE_CLOSE: "idle_closes", CoverageKind.UNJOINED_DISCONNECT: "unjoined_disconnects",
          CoverageKind.UNJOINED_SPAN: "unjoined_spans", CoverageKind.PROXY_REWRITTEN_PEER: "proxy_rewritten"}
# The only span attributes a verdict reads: a span is held without the rest (most of its memory).
# The sender's address tells pods serving one port apart (auditor.semconv.SENDER_KEY); an HTTP
# server span also keeps the client's User-Agent, which its verdict names.
JUDGED_ATTRIBUTES = frozenset({FINAL_SEND_ATTR, TOKENS_AFTER_DISCONNECT_ATTR, SENDER_KEY})
SERVER_ATTRIBUTES = JUDGED_ATTRIBUTES | frozenset(USER_AGENT_KEYS)
_NO_ATTRIBUTES: dict[str, Any] = {}  # the attributes of every held span that keeps none: never changed
_NOWHERE: frozenset[str] = frozenset()  # no other container's spans to leave out (``Correlator.elsewhere``)
# Kept attributes that are texts many spans repeat (the sender's address, the client's User-Agent):
# the held spans that keep only such share one dict a set of values, never changed.
_REPEATED = frozenset({SENDER_KEY, *USER_AGENT_KEYS})
_SHARED_ATTRIBUTES: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}
MAX_SHARED_ATTRIBUTES = 1024
MAX_SERVER_TEXTS = 1024
# Span texts that repeat across spans: held once each (a span's memory is mostly its texts).
SHARED_TEXTS = ("name", "kind", "service", "host", "status", "peer_addr", "route", "model", "finish_reason")
# Numbers that repeat across spans, each a 32-byte object of its own as the OTLP reader makes it:
# held once each, like the texts above (by arithmetic, 0.5 MiB of a 90 s memory window at 200
# spans a second).
SHARED_NUMBERS = ("server_port", "process_pid")
MAX_SHARED_NUMBERS = 4096  # a host's ports and engine processes; past it, a span keeps its own
_numbers: dict[int, int] = {}
# How long before a peerless span's start its client's close may lie (accept queue and read).
PEERLESS_BEFORE_NS = 1_000_000_000
# A close of the server's socket this long before a reset on its 4-tuple ended an earlier
# connection. The server's FIN does not end its own connection's part: a client that has not read
# the whole answer resets after it, at once (it reads the FIN, closes, and its unread data makes
# the close a reset); a client port comes round again seconds later at the soonest.
REUSED_AFTER_NS = 1_000_000_000
# How long after a span's end the kernel events of its time are surely in the store: the daemon
# flushes the probe's events within a second (docs/daemon.md), and polls every 50 ms.
EVENTS_SETTLE_NS = 1_500_000_000


class Correlator:
    def __init__(self, store: Store, *, host: str, grace_seconds: float = 0.5,
                 late_span_seconds: float = 60.0, watched_ports: Callable[[], set[int]] | None = None,
                 on_settled: Callable[[RequestVerdict], None] | None = None,
                 clock: Callable[[], int] = time.time_ns, feed: SpanFeed | None = None) -> None:
        self.store = store
        self.host = host
        self.grace_seconds = grace_seconds
        self.late_ns = int(late_span_seconds * 1e9)
        # A settled request's spans and events: its late-span window, then a margin (a verdict that
        # waits for the window is looked at up to 8 s after it; scrapes around it still need them).
        self.memory_ns = min(HORIZON_NS, max(MIN_MEMORY_NS, self.late_ns + MEMORY_MARGIN_NS))
        self.watched_ports = watched_ports or (lambda: set())
        # Whether the disconnect source's polled resets are surely resets (``_join_peerless``).
        self.polled_resets_exact: Callable[[], bool] = lambda: False
        # How long after a scrape's answer the closes of its time are all in (``_count_orphans``):
        # ORPHANS_SETTLE_WOKEN_NS where the source wakes the daemon as clients leave.
        self.orphans_settle_ns = ORPHANS_SETTLE_NS
        self.on_settled = on_settled or (lambda verdict: None)
        self.clock = clock
        self.stats = CorrelatorStats()
        self.cpu = RoundCpu()  # the thread's CPU by step of the round (auditor.correlate.roundcpu)
        self.spans = TraceIndex()
        # A connection's event times, as tuples: most connections have one or two events, and a
        # tuple of them is one allocation where a list is two.
        self._events_by_tuple: dict[Tuple4, tuple[int, ...]] = {}  # every event's time
        self._closed_by_tuple: dict[Tuple4, tuple[int, ...]] = {}  # server socket closes
        self._local_fin_by_tuple: dict[Tuple4, tuple[int, ...]] = {}  # server FINs first
        # Services seen marking the send that ends a response: from them, no final send means the
        # response was not complete (a cancelled non-streaming response sends nothing at all).
        self.services_marking_sends: set[str] = set()
        # Services seen to send an engine span for a normal finish (vLLM with tracing on): for them,
        # no engine span by the end of the late-span window says the work was aborted.
        self.services_spanning_finishes: set[str] = set()
        # Request id -> service of recent server spans of services not known to span finishes: an
        # engine span named by one may come later (vLLM exports it through a tracer of its own).
        self._unlearned_by_request_id: dict[str, str] = {}
        self.loads = EngineLoads()
        self.loads.clients_kept_ns = self.memory_ns  # as long as the spans that tell them are held
        # (port, scrape) -> when each client unspanned_clients found untold there was last read,
        # sorted: counted once a round
        self._unspanned: dict[tuple[int, int], list[int]] = {}
        # connection -> (its latest read asked of, when the first span or notice telling it began)
        self._telling: dict[Tuple4, tuple[int, frozenset[str], int]] = {}
        # Ports whose coming scrapes a verdict of this round reads undecided: their clients are
        # wanted with them (the daemon asks the scraper, ``EngineMetricsScraper.want_clients``).
        self.clients_wanted: set[int] = set()
        self.cost = CostSources(store, host)  # samples and engine processes, for what zombies cost
        # Stretches of orphaned work per port, told by its gauges and the kernel alone (written to
        # ``orphaned_work``); rows the store refused wait for the next round.
        self.orphaned = OrphanLedger(host, self._orphan_cost, self._spans_on)
        self._orphan_rows: dict[tuple[int, int], dict[str, Any]] = {}
        self._orphan_pids: dict[int, int] = {}  # port -> its engine process as last found
        self._orphans_unwritten = False
        # Port -> the addresses of the containers serving it, where several do (the daemon's
        # listener lookup, ``set_servers``): a close there is joined only to spans from its own.
        self.servers: dict[int, frozenset[str]] = {}
        # The kernel record's text of a server address -> the one normalized text the disconnects
        # hold (the /proc source's blocks decode a new text an event): the host's own addresses, a few.
        self._server_texts: dict[str, str] = {}
        self._pending = Disconnects()
        # Resets whose span started after them and ended too recently to tell whether a later event
        # shows a new connection on the 4-tuple (TraceIndex.in_flight): looked at again each round.
        self._undecided: dict[int, Disconnect] = {}
        self._recent_unjoined = Disconnects()  # written off: a late span may still claim them back
        self._unjoined_kind: dict[int, CoverageKind] = {}  # how each of those was counted
        self._open: dict[RequestKey, OpenRequest] = {}
        # The close joined to an open request, by connection, as it came (before ``_join`` moved
        # its instant) and the key of the request holding it: a span that arrives later on the
        # connection may be the request the close really left (``_rejoin``).
        self._joined: dict[Tuple4, tuple[Disconnect, RequestKey]] = {}
        # What ``_settle`` keeps of the open requests, so that a round looks only at those that
        # changed, not at the hundreds that wait out their late-span window (ten cancels a second
        # keep about 600 open): those opened, reopened, given a disconnect or a new verdict since
        # the last settle (``_to_settle``); the in-flight zombies among them; and a heap of
        # (event id, key) of every disconnect of an open request never reported final, where the
        # restart position must stay (entries of requests since settled are dropped at its top).
        self._to_settle: set[RequestKey] = set()
        # Requests that keep checkpoints of a long window (cost_partial, scrape_sweep): each round's
        # news drops those it touches. Work that ran on for seconds after its client left, and
        # verdicts the gauges decide while their late-span window lasts (about 600 at 10 cancels a
        # second); those no longer open are let go at each prune (a reopen drops their checkpoints).
        self._checkpointed: dict[int, OpenRequest] = {}  # by id()
        self._inflight: set[RequestKey] = set()
        self._unreported: list[tuple[int, RequestKey]] = []
        self._next_expiry_ns = 0
        self._settled: dict[str, dict[str, OpenRequest]] = {}  # a late span reopens them (by trace id)
        self._settled_by_request_id: dict[str, RequestKey] = {}  # engine spans in traces of their own
        # Settled traces no longer in memory, as the store tells.
        self.forgotten = Forgotten(store, host, self._holds, lambda: self.clock() - HORIZON_NS, HORIZON_NS)
        # Of the spans being added: the forgotten traces among theirs, and by engine request id.
        self._forgotten_traces: set[str] = set()
        self._forgotten_by_request_id: dict[str, str] = {}
        self.live = LiveState()
        # Server spans whose connection's kernel events may still come: (end, arrival, span), a heap.
        self._unchecked_spans: list[tuple[int, int, SpanRecord]] = []
        self._unchecked_seq = itertools.count()  # ties on the end go by arrival
        self._touched: set[str] = set()  # traces with new evidence this round
        # The earliest moment a request judged this round, its work still running, leaves its grace
        # and becomes an in-flight zombie (evaluate sets it): the daemon runs a round then rather
        # than at its next scheduled one, so that an alarm waits for no round (docs/daemon.md).
        self.alarm_due_ns: int | None = None
        # port -> (requests its latest listed scrape held beyond its clients, when that rose): the
        # rounds of their own for orphans not counted yet (``_count_orphans``).
        self._excess_seen: dict[int, tuple[int, int]] = {}
        # Connections with a new span, kernel event or live notice of their server span this round.
        self._news: set[Tuple4] = set()
        self._news_ns: int | None = None  # the oldest moment new evidence concerns, since the last evaluation
        self._counted: dict[str, int] = {}  # what coverage counted (its source id), and when: never twice
        # The same for closes counted at their window's end (idle or unjoined), by event id: with a
        # connection a request, nearly every request's close. Written a row per kind and second
        # (``_close_rows``), not a row a close: 60 bytes a close came to 13 GiB in a month of 90 a second.
        self._counted_closes: dict[int, int] = {}
        self._closes_to_write: dict[CoverageKind, list[tuple[int, int]]] = {}  # (ts, event id), by kind
        self._coverage: list[dict[str, object]] = []  # counted, written with the round's verdicts
        self._event_cursor = 0
        self._saved_position: int | None = None  # what correlator_state holds; written only on change
        self._span_cursor = 0
        # With a feed, spans come from the daemon's writer once the store's backlog is read.
        self._feed = feed
        self._reading_store = True
        self._backlog = True  # the first read: spans from before this start, not new arrivals
        self.arrived: list[SpanRecord] = []  # the spans new in the last round (auditor.upkeep counts them)
        self._next_prune_ns = 0
        self._resume()

    # -- start-up ---------------------------------------------------------------------------
    def _resume(self) -> None:
        now = self.clock()
        with self.store.connect() as conn:
            saved = conn.scalar(_SAVED_POSITION, {"host": self.host})
            self._event_cursor = saved if saved is not None else 0
            self._saved_position = saved
            for detail, ts in conn.all(_COUNTED, {"host": self.host, "since": now - HORIZON_NS}):
                closes = _counted_close_ids(detail)
                if closes is None:
                    self._counted[detail] = ts
                self._counted_closes.update(dict.fromkeys(closes or (), ts))
        self._span_cursor = self._horizon_cursor(now)
        if self._event_cursor:
            self._read_known_events(now)
        try:  # stretches a killed run left open: this run counts on with its own
            self.store.end_open_orphaned_work(self.host)
        except StoreError as exc:
            log.warning("could not end the stretches of orphaned work a previous run left open (%s): the report "
                        "counts them running for a minute past their last write", exc)

    def _read_known_events(self, now: int) -> None:
        """The connections' events of the memory window that the last run read already (at or
        before the saved position): they are no new disconnects, but the spans read back for the
        horizon are checked against them (a span whose connection no event saw is counted)."""
        since = now - self.memory_ns
        with self.store.connect() as conn:
            blocks = conn.all(_KNOWN_EVENTS, {"block": block_of(self._event_cursor), "host": self.host,
                                              "since": since})
        for event_id, event in stored_events(blocks):
            if event_id <= self._event_cursor and event.ts_ns > since:
                self._note_event((norm_addr(event.client_addr), event.client_port, event.server_port),
                                 event.ts_ns, event.kind.value)

    def _note_event(self, tuple4: Tuple4, ts_ns: int, event_kind: str) -> None:
        _append(self._events_by_tuple, tuple4, ts_ns)
        if event_kind == _CLOSED:
            _append(self._closed_by_tuple, tuple4, ts_ns)
        elif event_kind == _LOCAL_FIN:  # the server closed first: evidence of completion
            _append(self._local_fin_by_tuple, tuple4, ts_ns)
            # and the server's socket closed: sources report no `closed` after it
            _append(self._closed_by_tuple, tuple4, ts_ns)
        elif event_kind in _DEPARTURES:
            self.loads.note_departure(tuple4, ts_ns, self.local_fins(tuple4))
            if event_kind == _PEER_RST:  # the reset closed the server's socket: no `closed` follows
                _append(self._closed_by_tuple, tuple4, ts_ns)

    def _horizon_cursor(self, now: int) -> int:
        """The span id just below this host's spans of the horizon: where reading them starts."""
        with self.store.connect() as conn:
            first_span = conn.scalar(_FIRST_SPAN_SINCE, {"host": self.host, "since": now - HORIZON_NS})
            last_span = conn.scalar(_LAST_SPAN) or 0
        return (first_span - 1) if first_span else int(last_span)

    # -- input ------------------------------------------------------------------------------
    def add_live(self, events: list[LiveEvent]) -> None:
        for event in events:  # an end changes what was running from its start on
            started = self.live.started_at(event.trace_id, event.span_id) if event.event == "end" else None
            self._news_at(event.ts_ns if started is None else min(started, event.ts_ns))
        self._touched |= self.live.add(events, self._news)

    def _news_at(self, ts_ns: int) -> None:
        if self._news_ns is None or ts_ns < self._news_ns:
            self._news_ns = ts_ns

    def _take_news(self) -> int | None:
        """The oldest moment that evidence new since the last evaluation concerns: spans (from
        their start), kernel events, live notices, scrapes, utilization samples (from the start
        of what they cover) and the load records evaluation itself changed (those of one round's
        evaluation count in the next), except the disconnects it registers (news to some only,
        ``EngineLoads.take_registered``)."""
        # A waiting scrape-decided verdict's cost reads the samples of its window, and a long window's
        # checkpoints hold what they read: new ones are news, before this round's evaluations.
        if self._checkpointed or any(request.reads_until_ns is not None for request in self._open.values()):
            self.cost.samples.refresh(self.clock())
        found = [ts for ts in (self._news_ns, self.loads.take_changed(), self.cost.samples.take_news())
                 if ts is not None]
        self._news_ns = None
        if self.cost.changed:  # another engine process behind a port: every cost may change
            self.cost.changed = False
            found.append(0)
        return min(found, default=None)

    def _read_spans(self) -> None:
        arrived_ns = self.clock()
        if self._feed is not None and not self._reading_store:
            spans = self._feed.take()
            if spans is not None:
                self._add_spans(spans, arrived_ns)
                return
            log.warning("spans arrived faster than correlation rounds took them; catching up from the store")
            self._feed.rearm()  # before the read: a span committed meanwhile comes both ways, and is known once
            self._span_cursor = self._horizon_cursor(arrived_ns)
            self._reading_store = True
        with self.store.connect() as conn:
            # Only this host's: with several daemons on one database each judges its own requests.
            rows = conn.all(_NEW_SPANS, {"cursor": self._span_cursor, "host": self.host})
        self._add_spans([span_from_values(row[1:]) for row in rows], arrived_ns, ids=[row[0] for row in rows])
        if len(rows) < READ_ROWS:
            self._reading_store = False  # caught up: from now on the feed, where there is one
            self._backlog = False

    def _add_spans(self, spans: list[SpanRecord], arrived_ns: int, ids: list[int] | None = None) -> None:
        """New spans; those of traces whose settled requests left memory bring them back first. The
        store says which traces those are, for the whole batch at once. ``ids``: the spans' row ids,
        the read cursor moved past each as it is taken (one that fails is not read again)."""
        if not spans:
            return
        self._forgotten_traces = self.forgotten.traces(
            {span.trace_id for span in spans if span.trace_id not in self._settled})
        self._forgotten_by_request_id = self.forgotten.by_request_id(
            {candidate for span in spans if span.role is SpanRole.ENGINE and span.request_id
             for candidate in _settled_request_ids(span.request_id)})
        try:
            for index, span in enumerate(spans):
                if ids is not None:
                    self._span_cursor = ids[index]
                if span.trace_id in self._forgotten_traces:
                    self._recall(span.trace_id, arrived_ns, arriving=span.span_id)
                self._add_span(span, arrived_ns)
        finally:
            self._forgotten_traces, self._forgotten_by_request_id = set(), {}

    def _holds(self, trace_id: str, root_id: str) -> bool:
        """Whether a request is in memory: open, or its trace settled and held."""
        return trace_id in self._settled or (trace_id, root_id) in self._open

    def _add_span(self, span: SpanRecord, arrived_ns: int) -> None:
        span = _lean(span)
        if not self.spans.add(span, arrived_ns):
            return
        self._news_at(span.start_ns)
        if not self._backlog:
            self.arrived.append(span)
        if span.trace_id in self._settled:
            for request in self._unsettle(self._settled.pop(span.trace_id)):
                self._reopen(request)  # evidence after settling reopens the verdict
        if span.role is SpanRole.ENGINE and span.request_id:
            self._reopen_by_request_id(span.request_id)
        if span.service and span.attributes.get(FINAL_SEND_ATTR) is True \
                and span.service not in self.services_marking_sends:
            self.services_marking_sends.add(span.service)
            self._news_at(0)  # what a service marks changes how every verdict of it reads
        if span.role is SpanRole.ENGINE or (span.role is SpanRole.HTTP_SERVER
                                            and span.service not in self.services_spanning_finishes):
            self._learn_spanning_service(span)
        if span.role is SpanRole.HTTP_SERVER and span.peer_port:
            self._news.add(span_tuple(span))
        if span.role is SpanRole.HTTP_SERVER:
            if span.peer_rewritten:
                self._count(CoverageKind.PROXY_REWRITTEN_PEER, f"span:{span.trace_id}:{span.span_id}", span.end_ns)
            elif span.peer_port and span.server_port:
                heapq.heappush(self._unchecked_spans, (span.end_ns, next(self._unchecked_seq), span))
        self._touched.add(span.trace_id)

    def _read_events(self) -> None:
        # This read runs every round, idle or not: plain SQL, a pooled connection.
        cursor = self._event_cursor
        first = block_of(cursor) + (block_read(block_of(cursor)) == cursor)  # a block read whole: the next
        with self.store.connect() as conn:
            sizes = conn.all(_NEW_BLOCKS, {"block": first, "host": self.host})
            if not sizes:
                return
            last, events = sizes[0][0], 0
            for block_id, count in sizes:
                if events and events + count > READ_ROWS:  # the rest in the next round
                    break
                last, events = block_id, events + count
            blocks = conn.all(_NEW_EVENTS, {"block": first, "last": last, "host": self.host})
        if not blocks:
            return
        previous: Tuple4 | None = None
        for event_id, event in stored_events(blocks):
            if event_id <= cursor:  # the part of a block read before a restart
                continue
            ts_ns, event_kind, earliest_ns = event.ts_ns, event.kind.value, event.earliest_ns
            tuple4 = (norm_addr(event.client_addr), event.client_port, event.server_port)
            if tuple4 == previous:  # a connection's events mostly come together: one object for them
                tuple4 = previous
            previous = tuple4
            self._news.add(tuple4)
            self._news_at(earliest_ns or ts_ns)
            self._note_event(tuple4, ts_ns, event_kind)
            if event_kind in _DEPARTURES:
                server = self._server_texts.get(event.server_addr)
                if server is None:
                    server = norm_addr(event.server_addr)  # an IPv4-mapped one as IPv4, as spans name it
                    if len(self._server_texts) < MAX_SERVER_TEXTS:
                        self._server_texts[event.server_addr] = server
                self._pending.add(Disconnect(event_id, ts_ns, _DEPARTURES[event_kind], tuple4, earliest_ns, server))
        self._event_cursor = block_read(blocks[-1][0])

    # -- the round --------------------------------------------------------------------------
    def tick(self, live: list[LiveEvent] | None = None) -> list[RequestVerdict]:
        """One round: read new evidence, join, decide, write. Returns the verdicts written."""
        cpu = self.cpu
        cpu.start()
        self._touched = set()
        self.arrived = []
        self._unspanned = {}
        self.clients_wanted = set()
        self.add_live(live or [])
        self._read_spans()
        cpu.mark("spans")
        self._read_events()
        cpu.mark("events")
        now = self.clock()
        self._rejoin()  # the closes joined in earlier rounds: those joined in this one saw its spans
        self._join_pending(now)
        self._rekey()
        self._check_unjoined_spans(now)
        for tuple4 in self._news:  # a span or notice on it may tell its client now
            self._telling.pop(tuple4, None)
        changed: list[tuple[OpenRequest, RequestVerdict]] = []
        news, registered = self._take_news(), self.loads.take_registered()
        self._forget_checkpoints(news, registered)
        self.alarm_due_ns = None
        cpu.mark("join")
        try:
            # Chosen first, in one pass (the hundreds waiting out their late-span window are tested
            # each round): evaluating one request changes no other's turn in this round. The latest
            # to leave go first: a disconnect registered in the round is news only to those that
            # left before it (Registered), which then read it in this round, not again in the next.
            touched = self._touched
            chosen = [r for r in self._open.values()
                      if r.key[0] in touched or (r.due(now, news, registered) and clock_dependent(r))]
            chosen.sort(key=_left_at, reverse=True)
            for request in chosen:
                verdict = evaluate(self, request, now)
                request.registrations_seen = self.loads.registrations
                request.checked(now, changed=verdict is not None)
                if verdict is not None:
                    changed.append((request, verdict))
            changed.reverse()  # written in the order their clients left
        except Exception:
            # The round failed part-way: its news counts again in the next, for every verdict.
            for ts_ns in (news, registered.earliest()):
                if ts_ns is not None:
                    self._news_at(ts_ns)
            raise
        cpu.mark("judge")
        # Only a committed verdict counts as written: if the store refuses (locked, disk full),
        # the next round computes and writes it again.
        written = [verdict for _, verdict in changed]
        self.forgotten.written(written)  # before the store has them: a late span asks it from then on
        self.store.upsert_verdicts(written)
        if self._closes_to_write:
            self._coverage += _close_rows(self._closes_to_write, self.host)
            self._closes_to_write = {}
        if self._coverage:  # one transaction a round; kept for the next round if the store refuses
            self.store.add_coverage_rows(self._coverage)
            self._coverage = []
        cpu.mark("write")
        for request, verdict in changed:
            request.written = verdict
            request.checked(now, changed=False)  # when to look again, now that this verdict stands
            self._to_settle.add(request.key)
            if verdict.server_port and verdict.work_end_ns and verdict.verdict is not Verdict.INFLIGHT_ZOMBIE:
                self.loads.work_ended(verdict.server_port, verdict.request_key, verdict.disconnect_at_ns,
                                      verdict.work_end_ns, int(self.grace_seconds * 1e9))
        self._news = set()  # joined with: kept when the round fails before
        first_unreported = self._settle(now)
        self._count_orphans(now)
        self._write_orphaned_work(now)
        self._save_state(first_unreported)
        self._prune(now)
        self.stats.pending_disconnects = len(self._pending)
        cpu.mark("settle")
        return written

    def checkpointed(self, request: OpenRequest) -> None:
        """``request`` keeps checkpoints (evaluate's): news drops those it touches."""
        self._checkpointed[id(request)] = request

    def _forget_checkpoints(self, news: int | None, registered: Registered) -> None:
        """A long window's cost, and its gauges' sweep, are read again from the news on; the sweep
        also from a registered disconnect that is news to it (no cost reads registrations)."""
        if not self._checkpointed or (news is None and not registered):  # nothing keeps any, or nothing new
            return
        earliest = registered.earliest()
        for request in self._checkpointed.values():
            if news is not None:
                for checkpoints in (request.cost_partial, request.scrape_sweep):
                    if checkpoints is not None:
                        checkpoints.forget_from(news)
            sweep = request.scrape_sweep
            # Most sweeps ended long before any registration: only those it could reach are asked.
            if earliest is not None and sweep is not None and sweep.reaches(earliest):
                first = request.registered_news(registered, _END_OF_TIME)
                if first is not None:
                    sweep.forget_from(first)

    def _recall(self, trace_id: str, arrived_ns: int, arriving: str | None = None) -> None:
        """Bring a settled trace back from the store: its spans (but the ``arriving`` one, already
        stored, which is new evidence), and its requests as settled."""
        spans, requests = self.forgotten.recall(trace_id)
        self._forgotten_traces.discard(trace_id)  # once: its requests are held from now on
        if trace_id in self._forgotten_by_request_id.values():
            self._forgotten_by_request_id = {request_id: trace for request_id, trace
                                             in self._forgotten_by_request_id.items() if trace != trace_id}
        for span in spans:
            if span.span_id == arriving:
                continue
            self.spans.add(_lean(span), arrived_ns)
            self._news_at(span.start_ns)
        for request in requests:
            self._keep_settled(request)

    def _learn_spanning_service(self, arrived: SpanRecord) -> None:
        """An engine span of a normal finish that joins a request marks its service, and the
        request's HTTP services (whichever arrives last: vLLM exports its engine spans apart from
        the HTTP ones), as ones that span every finish: a missing engine span then means the
        response was not complete. It joins by its trace, or by the request id the engine derived
        from X-Request-Id (server spans that came first are remembered by it). One in a trace of its own that
        nothing names (a client that sent neither traceparent nor X-Request-Id, as curl and the
        openai SDK) tells nothing of the requests: nothing is learned from it."""
        trace = list(self.spans.trace(arrived.trace_id))
        http = [s for s in trace if s.role is SpanRole.HTTP_SERVER]
        engines = [s for s in trace if s.role is SpanRole.ENGINE]
        named: list[str] = []  # services of server spans that came before this engine span named them
        if arrived.role is SpanRole.HTTP_SERVER:
            engines += self.spans.engines_named_by(arrived)
        elif not http and arrived.request_id:
            named = [service for request_id in _settled_request_ids(arrived.request_id)
                     if (service := self._unlearned_by_request_id.get(request_id)) is not None]
        if not (http or named) or not any(s.finish_reason in NORMAL_FINISH for s in engines):
            if arrived.role is SpanRole.HTTP_SERVER and arrived.request_id and arrived.service:
                self._unlearned_by_request_id[arrived.request_id] = arrived.service
                if len(self._unlearned_by_request_id) > UNLEARNED_REQUEST_IDS:
                    del self._unlearned_by_request_id[next(iter(self._unlearned_by_request_id))]
            return
        learned = {s.service for s in (*http, *engines) if s.service} | set(named)
        if not learned <= self.services_spanning_finishes:
            self.services_spanning_finishes |= learned
            self._news_at(0)

    def _reopen_by_request_id(self, engine_request_id: str) -> None:
        """An engine span whose request came without ``traceparent`` is a trace of its own (vLLM
        does this); it reaches its settled request through the id the engine derived."""
        for request_id in _settled_request_ids(engine_request_id):
            forgotten = self._forgotten_by_request_id.pop(request_id, None)
            if forgotten is not None:
                self._recall(forgotten, self.clock())
            key = self._settled_by_request_id.pop(request_id, None)
            request = self._settled.get(key[0], {}).pop(key[1], None) if key else None
            if request is not None:
                self._reopen(request)
                self._touched.add(request.key[0])

    def _reopen(self, request: OpenRequest) -> None:
        _forget_reads(request)
        self._open[request.key] = request
        self._to_settle.add(request.key)

    def _open_request(self, key: RequestKey) -> OpenRequest:
        """The open request of ``key`` (opened, or reopened from the settled ones), about to be
        given a disconnect."""
        request = self._open.get(key)
        if request is None:
            request = self._settled.get(key[0], {}).pop(key[1], None)
            if request is None:
                request = OpenRequest(key)
            else:
                _forget_reads(request)
                if request.written is not None and request.written.request_id:
                    self._settled_by_request_id.pop(request.written.request_id, None)
            self._open[key] = request
        self._to_settle.add(key)
        self._touched.add(key[0])
        return request

    def _join_pending(self, now: int) -> None:
        # A disconnect's join can change only with news on its connection (a span, a close, a live
        # notice of its server span): thousands of closes after a finished request wait out the
        # late-span window without any, and are looked at again only when it ends.
        due = {d.event_id: d for d in self._pending.on(self._news)}
        due.update((i, d) for i, d in self._undecided.items() if self._pending.by_id.get(i) is d)
        self._undecided = {}
        for disconnect in self._pending.closed_before(now - self.late_ns):  # their window ends: each is removed below
            due[disconnect.event_id] = disconnect
        for event_id, disconnect in sorted(due.items()):
            span = self._span_in_flight(disconnect)
            if span is not None and disconnect.kind == "rst" and span.start_ns > disconnect.ts_ns \
                    and now - span.end_ns < EVENTS_SETTLE_NS and now - disconnect.ts_ns <= self.late_ns:
                self._undecided[event_id] = disconnect  # a new connection's close may still come
                continue
            if span is not None:
                self._join(disconnect, span)
                self._pending.remove(disconnect)
                continue
            live = self._live_in_flight(disconnect)
            if live is not None:  # known only live: keep it pending so the span, once here, joins it
                request = self._open_request((live.trace_id, live.span_id))
                request.add(disconnect)
                request.live_span = request.live_span or live
                if now - disconnect.ts_ns <= self.late_ns:
                    continue
            if now - disconnect.ts_ns > self.late_ns:
                if live is None:
                    kind = self._classify_unjoined(disconnect)
                    self._count_close(kind, disconnect)
                    self._recent_unjoined.add(disconnect)
                    self._unjoined_kind[event_id] = kind
                self._pending.remove(disconnect)
        self._join_peerless()
        # A span that arrived after its disconnect was written off claims it back.
        for disconnect in self._recent_unjoined.on(self._news):
            span = self._span_in_flight(disconnect)
            if span is not None:
                kind = self._unjoined_kind.pop(disconnect.event_id)
                self._count(kind, f"ev:{disconnect.event_id}:undo", disconnect.ts_ns, count=-1)
                self._recent_unjoined.remove(disconnect)
                self._join(disconnect, span)

    def _join_peerless(self) -> None:
        """A server span without a peer address (its client reset before the server read the
        request, so the server never learnt who sent it) joins the unjoined reset on its server port
        nearest its start (and not after it), of a connection that carried no other span. Counted:
        it is inferred.

        Only a reset: after a FIN the socket is still there and the server learns its peer, so a
        FIN belongs to a span that names it, and may simply not have arrived yet. A polled reset
        (an interval) only where the source says its resets are resets (``polled_resets_exact``: the
        /proc source with the kernel's notices of freed sockets, which tell a reset from FINs both
        ways, and see the connections no poll listed). Without them its "reset" may be a FIN and the
        server's close within one poll, of a connection it saw open for longer (whose own span is
        still to come), and the client that resets at once is not seen at all."""
        polled = self.polled_resets_exact()
        for span in self.spans.peerless():
            candidates = [d for d in self._pending
                          if d.kind == "rst" and (polled or d.earliest_ns is None) and d.tuple4[2] == span.server_port
                          and span.start_ns - PEERLESS_BEFORE_NS <= d.ts_ns
                          and _first_instant(d) <= span.start_ns and not self._may_have_carried_a_span(d)
                          and span.attributes.get(SENDER_KEY) not in self.elsewhere(d)]
            if not candidates:
                continue
            # The nearest: an exact reset's instant, a polled one's middle.
            disconnect = min(candidates, key=lambda d: abs((_first_instant(d) + d.ts_ns) // 2 - span.start_ns))
            self.spans.claim_peerless(span)
            self._pending.remove(disconnect)
            self._count(CoverageKind.PEERLESS_SPAN_JOINED, f"peerless:{span.trace_id}:{span.span_id}", span.start_ns)
            self._join(disconnect, span, rejoinable=False)

    def _may_have_carried_a_span(self, reset: Disconnect) -> bool:
        """Whether the reset's connection may have carried a span that names it: any span on its
        4-tuple, but one that started before a close of the server's socket that came well before
        the reset (``REUSED_AFTER_NS``). That one was an earlier connection's on the same client
        port, which comes round again within the memory window at a hundred connections a second."""
        closes = self._closed_by_tuple.get(reset.tuple4, ())
        ended_by = reset.ts_ns - REUSED_AFTER_NS
        return any(span.start_ns > reset.ts_ns or not any(span.start_ns <= ts < ended_by for ts in closes)
                   for span in self.spans.on_connection(reset.tuple4, self.elsewhere(reset)))

    def _join(self, disconnect: Disconnect, span: SpanRecord, *, rejoinable: bool = True) -> None:
        """Add the close to the request of ``span``, at the instant its interval allows."""
        root = self.spans.root(span)
        key = (root.trace_id, root.span_id)
        if rejoinable:
            known = self._joined.get(disconnect.tuple4)
            if known is None or known[1] != key or disconnect.ts_ns < known[0].ts_ns:
                self._joined[disconnect.tuple4] = (disconnect, key)
        instant = disconnect_instant(span, disconnect.ts_ns, disconnect.earliest_ns)
        if instant != disconnect.ts_ns:
            disconnect = replace(disconnect, ts_ns=instant)
        if span.server_port and span.start_ns <= instant and span.end_ns - instant <= SPAN_END_RACE_NS:
            # It may have closed after its last byte: until its own evaluation says, it may have
            # added an orphan where another's rise is asked in this round (EngineLoads.racing).
            self.loads.racing(span.server_port, key, (instant, span.end_ns + CLOCK_ERROR_NS))
        self._open_request(key).add(disconnect)

    def _rejoin(self) -> None:
        """Join again, by the same rules, a close that a request still open holds, once a span on
        its connection arrives after the join: which request a close left must not depend on the
        order the spans came in. A keep-alive client that read an answer, sent its next request and
        left was joined to the answer (then the only span there) when the next request's span came
        later: a completed request judged a zombie, and the request left judged nothing (a zombie
        missed, where the answer's engine span had settled it complete at once). A request left
        with no close is let go, its verdict unwritten. A finding reported final keeps its close
        (counters and exported findings never go back); a completed one gives it up, its count
        kept."""
        joined = self._joined
        for tuple4 in [tuple4 for tuple4 in self._news if tuple4 in joined] if joined else ():
            disconnect, key = joined[tuple4]
            request = self._open.get(key) or self._settled.get(key[0], {}).get(key[1])
            if request is None or request.reported not in (None, Verdict.COMPLETED) \
                    or tuple4 not in request.disconnects:
                del joined[tuple4]
                continue
            span = self._span_in_flight(disconnect)
            if span is None:
                continue
            root = self.spans.root(span)
            if (root.trace_id, root.span_id) == key:
                continue
            self._unjoin(request, tuple4)
            self._join(disconnect, span)

    def _unjoin(self, request: OpenRequest, tuple4: Tuple4) -> None:
        """Take the close on ``tuple4`` from ``request`` (open, or settled complete); without a
        close left, let it go."""
        trace_id, span_id = key = request.key
        if self._open.get(key) is not request:  # settled: open again, as a late span would
            settled = self._settled[trace_id]
            del settled[span_id]
            if not settled:
                del self._settled[trace_id]
            self._unsettle({span_id: request})
            self._reopen(request)
        del request.disconnects[tuple4]
        self.loads.unregister(tuple4[2], key)
        self._touched.add(trace_id)
        if request.disconnects:
            request.first = min(request.disconnects.values(), key=lambda d: d.ts_ns)
            self._to_settle.add(key)
            return
        del self._open[key]
        self._to_settle.discard(key)
        self._inflight.discard(key)
        self._checkpointed.pop(id(request), None)
        if request.written is not None:
            self.store.delete_verdict(request.written.request_key)

    def _rekey(self) -> None:
        """Merge requests whose outermost span became known (a gateway's span arriving after the
        engine hop's), so one request keeps one verdict."""
        touched = self._touched  # only a new span of its trace can give a request a new root
        for key in [key for key in self._open if key[0] in touched]:
            request = self._open[key]
            span = self.spans.get(*key)
            if span is None:
                continue
            root = self.spans.root(span)
            if root.span_id == key[1]:
                continue
            del self._open[key]
            self._inflight.discard(key)
            if request.written is not None:
                self.store.delete_verdict(request.written.request_key)
            target = self._open_request((root.trace_id, root.span_id))
            for tuple4, disconnect in request.disconnects.items():
                target.add(disconnect)
                known = self._joined.get(tuple4)
                if known is not None and known[1] == key:
                    self._joined[tuple4] = (known[0], target.key)
            target.live_span = target.live_span or request.live_span

    def set_servers(self, servers: dict[int, frozenset[str]]) -> None:
        """The ports several containers serve, each with their addresses (the daemon's listener
        lookup, as it finds them)."""
        self.servers = {port: frozenset(norm_addr(address) for address in addresses)
                        for port, addresses in servers.items()}

    def elsewhere(self, disconnect: Disconnect) -> frozenset[str]:
        """On a port several containers serve, the addresses of those the close was not on: the
        spans they send are their own requests. A gateway reaching two pods from one address may
        have one source port for both (Linux picks source ports per destination), and a close on
        one pod joined to the other's request in flight made that request, read whole, a zombie.
        Spans from elsewhere (relayed by a collector, or from a pod not yet found) are not told
        apart: they may be either's."""
        return self._other_servers(disconnect.tuple4[2], disconnect.server_addr)

    def sends_spans(self, port: int, address: str, since_ns: int = 0) -> bool:
        """Whether server spans on ``port`` that began at ``since_ns`` or later came from
        ``address`` (a container's, as the receivers keep it); asked from the engine scraper's
        thread."""
        return self.spans.senders.get(port, {}).get(address, -1) >= since_ns

    def _other_servers(self, port: int, server_addr: str) -> frozenset[str]:
        """``elsewhere`` for a connection to ``server_addr`` (normalized; "" not known) on ``port``."""
        addresses = self.servers.get(port) if server_addr else None
        if not addresses or server_addr not in addresses:
            return _NOWHERE
        return addresses - {server_addr}

    def _span_in_flight(self, disconnect: Disconnect) -> SpanRecord | None:
        return self.spans.in_flight(disconnect.tuple4, disconnect.ts_ns,
                                    self._closed_by_tuple.get(disconnect.tuple4, ()), self.late_ns,
                                    disconnect.earliest_ns, peer_fin=disconnect.kind == "fin",
                                    events_at=self._events_by_tuple.get(disconnect.tuple4, ()),
                                    not_from=self.elsewhere(disconnect))

    def _live_in_flight(self, disconnect: Disconnect) -> LiveEvent | None:
        """As ``_span_in_flight``, from live notices: the same rules, so that a close waiting out its
        window is not joined to a later connection's request on a reused client port."""
        return self.live.in_flight_on(disconnect.tuple4, disconnect.ts_ns,
                                      self._closed_by_tuple.get(disconnect.tuple4, ()), self.late_ns,
                                      disconnect.earliest_ns, peer_fin=disconnect.kind == "fin",
                                      events_at=self._events_by_tuple.get(disconnect.tuple4, ()),
                                      not_from=self.elsewhere(disconnect))

    def _classify_unjoined(self, disconnect: Disconnect) -> CoverageKind:
        spans = self.spans.on_connection(disconnect.tuple4, self.elsewhere(disconnect))
        if any(span.end_ns <= disconnect.ts_ns for span in spans):
            return CoverageKind.IDLE_CLOSE
        return CoverageKind.UNJOINED_DISCONNECT

    def _check_unjoined_spans(self, now: int) -> None:
        unchecked = self._unchecked_spans
        if not unchecked or now - unchecked[0][0] <= self.late_ns:
            return
        watched = self.watched_ports()
        while unchecked and now - unchecked[0][0] > self.late_ns:  # ended a late-span window ago
            span = heapq.heappop(unchecked)[2]
            seen = self._events_by_tuple.get(span_tuple(span), ())
            if span.server_port in watched and not any(ts >= span.start_ns for ts in seen):
                self._count(CoverageKind.UNJOINED_SPAN, f"span:{span.trace_id}:{span.span_id}", span.end_ns)

    # -- evaluation (auditor.correlate.evaluate) --------------------------------------------
    def add_engine_load(self, loads: list[EngineLoad]) -> None:
        """Scrapes of the engines' own /metrics. The requests they judge are provisional until
        their work end is past; a scrape is news for those whose deciding scrapes it falls among
        (``EngineLoads.changed_ns``), and those still waiting on scrapes are looked at every round."""
        self.loads.add(loads)

    def local_fins(self, tuple4: Tuple4) -> tuple[int, ...]:
        return self._local_fin_by_tuple.get(tuple4, ())

    def connected_at(self, port: int, ts_ns: int, until_ns: int | None = None) -> int:
        """Requests in flight on ``port`` at any moment of [``ts_ns``, ``until_ns``]: their server
        spans, or their start notices while the spans have not arrived."""
        until = ts_ns if until_ns is None else max(ts_ns, until_ns)
        return self.spans.server_spans_on(port, ts_ns, until, also=self.live.running_on(port, ts_ns, until))

    def unspanned_clients(self, load: EngineLoad, clients: tuple[ListedClient, ...],
                          read_before_ns: int | None = None) -> int:
        """Of the clients the kernel listed connected to ``load``'s port as it was scraped
        (``ListedClient``), how many may hold a request that the spans and notices do not tell yet.
        The request read last is told by a server span (or its start notice) on that connection that
        started by the scrape's answer and at most REQUEST_READ_NS before that read; a span that
        started earlier is an earlier request's, and the one read last is not told yet. On a port
        several containers serve, a span another of them sent tells none of this one's clients (a
        gateway may reach two from one address and port). A client whose told request ended before
        the scrape is idle, kept alive. A client listed with no time of its last read (READ_UNKNOWN:
        another network namespace's table) is told only by a span or notice in flight on it at the
        scrape; one whose latest request ended before may be idle or holding its next: untold.
        ``read_before_ns``: only clients last read by then (their untold requests were held at that
        moment too; one of unknown read, whatever it asks). Counted once a round (spans come between
        rounds)."""
        key = (load.server_port, load.ts_ns)
        reads = self._unspanned.get(key)
        if reads is None:  # when each untold client was last read, sorted: any read_before_ns is a bisection
            port, by_ns = load.server_port, (load.answered_ns or load.ts_ns) + CLOCK_ERROR_NS
            untold: list[int] = []
            shared = port in self.servers  # else no client's server address is asked for
            for address, client_port, last_read_ns, server in clients:
                not_from = self._other_servers(port, norm_addr(server)) if shared and server else _NOWHERE
                tuple4 = (norm_addr(address), client_port, port)
                if last_read_ns == READ_UNKNOWN:
                    if not self._in_flight_at(tuple4, load.ts_ns, by_ns, not_from):
                        untold.append(READ_UNKNOWN)  # first in the sorted reads: counted whatever is asked
                elif self._first_telling(tuple4, last_read_ns, not_from) > by_ns:
                    untold.append(last_read_ns)
            reads = self._unspanned[key] = sorted(untold)
        return len(reads) if read_before_ns is None else bisect.bisect_right(reads, read_before_ns)

    def _in_flight_at(self, tuple4: Tuple4, ts_ns: int, by_ns: int, not_from: frozenset[str]) -> bool:
        """Whether a server span on the connection, started by ``by_ns`` and not sent from
        ``not_from``, was still running at ``ts_ns`` (within the clock's error), as its span or its
        notices tell."""
        if any(span.start_ns <= by_ns and span.end_ns >= ts_ns - CLOCK_ERROR_NS
               for span in self.spans.on_connection(tuple4, not_from)):
            return True
        return self.live.running_on_connection(tuple4, ts_ns - CLOCK_ERROR_NS, by_ns, not_from)

    def _first_telling(self, tuple4: Tuple4, last_read_ns: int, not_from: frozenset[str] = _NOWHERE) -> int:
        """When the first server span or start notice on the connection that can tell its request
        read last began (_END_OF_TIME: none yet): one that began at most REQUEST_READ_NS before
        that read, and not sent from ``not_from``. Kept per connection for its latest read until
        news comes on it (``_news``): a busy port's listings name the same connections scrape
        after scrape."""
        known = self._telling.get(tuple4)
        if known is not None and known[0] == last_read_ns and known[1] == not_from:
            return known[2]
        read_from_ns = last_read_ns - REQUEST_READ_NS
        first = min((span.start_ns for span in self.spans.on_connection(tuple4, not_from)
                     if span.start_ns >= read_from_ns), default=_END_OF_TIME)
        first = min(first, self.live.first_start_on(tuple4, read_from_ns, not_from))
        self._telling[tuple4] = (last_read_ns, not_from, first)
        return first

    def alarm_at(self, ts_ns: int) -> None:
        """A request judged this round becomes an in-flight zombie at ``ts_ns`` if nothing changes."""
        if self.alarm_due_ns is None or ts_ns < self.alarm_due_ns:
            self.alarm_due_ns = ts_ns

    def _count_orphans(self, now: int) -> None:
        """The engines' orphans by port, told before any span (``EngineLoads.orphans_past``): work
        whose client left, alarmed about while the spans that say whose it is have not come. The
        in-flight zombie count is the larger of the verdicts' and the ports' (each a lower bound of
        the same work). A port whose latest listed scrape ran more than its clients keeps being
        listed, and while it may add to the count a round runs as it is read, then a quarter second
        apart until it does or its excess goes, for up to two seconds."""
        grace_ns = int(self.grace_seconds * 1e9)
        orphans: dict[int, int] = {}
        for port in self.loads.listed_ports():
            counted = self.loads.orphans_past(port, grace_ns, now - self.orphans_settle_ns)
            if counted is not None:
                orphans[port] = counted[0]
            beyond = self.loads.held_beyond_listed(port)
            if beyond is not None:
                self.clients_wanted.add(port)
                answered, excess = beyond
                # Rounds of their own only for orphans not counted yet (within their grace, or in
                # a scrape not read yet), and for ORPHANS_LOOK_FOR_NS from when the excess rose: work
                # that runs on for minutes is counted already, or (beside closes that keep coming)
                # cannot be.
                if excess is not None and excess > orphans.get(port, 0):
                    seen = self._excess_seen.get(port)
                    if seen is None or excess > seen[0]:
                        seen = self._excess_seen[port] = (excess, now)
                    if now - seen[1] < ORPHANS_LOOK_FOR_NS:
                        self.alarm_at(max(answered + self.orphans_settle_ns, now + ORPHANS_LOOK_AGAIN_NS))
                    continue
            self._excess_seen.pop(port, None)
        self.stats.orphans = orphans
        self.stats.inflight_zombies = max(len(self._inflight), sum(orphans.values()))
        running = self.orphaned.open_ports()
        for port in set(self.loads.listed_ports()) | set(running):
            if port in running and (pid := self.cost.engine_pid(None, port)) is not None:
                self._orphan_pids[port] = pid  # costed later, when the engine may have gone
            # The stretches are history: each scrape's count as it was then (work a span or notice
            # has since said ended was running at it), read once gauges left standing by an engine
            # that ran no step are known for what they are (EngineLoads._unstale reads them as
            # holding nothing after STEP_STILL_NS): read as they were, an aborted vLLM batch, or
            # SGLang between its logs, ran on for that long. The alarm above is not kept waiting.
            latest = self.loads.latest(port)
            lag = STEP_STILL_NS.get(latest.style, 0) if latest is not None and latest.step_tokens is not None else 0
            counted = self.loads.orphans_past(port, grace_ns, now - self.orphans_settle_ns - lag, history=True)
            self.orphaned.read(port, counted, now - lag, model=self.loads.model_of(port))
            if port in running:  # the counters' label, asked while they grow, not of every port each round
                self.orphaned.spans_seen(port, now)

    def _spans_on(self, port: int, start_ns: int, end_ns: int) -> bool:
        """Whether server spans on ``port`` were in flight at any moment of [start, end]."""
        return self.spans.server_spans_on(port, start_ns, end_ns, set()) > 0

    def _orphan_cost(self, port: int, start_ns: int, end_ns: int) -> tuple[float, float, str | None]:
        """One request's share of what the engine on ``port`` spent in [start, end], by its own
        running gauge (``OrphanLedger``'s cost), and why it is not measured where it is not."""
        samples = self.cost.samples
        samples.refresh(self.clock())
        # The port's engine as last found: a stretch is costed seconds after it ran, when the
        # engine may have gone (a daemon that stops costs the last one after the engine stopped).
        pid = self.cost.engine_pid(None, port) or self._orphan_pids.get(port)
        if pid is None:
            return 0.0, 0.0, self.cost.unresolved.get(port, f"the process serving port {port} is not known")
        self._orphan_pids[port] = pid
        gpu = self.cost.gpu_share(pid)
        unmeasured = gpu.unmeasured or (f"no utilization samples of process {pid}"
                                        if not gpu.series and samples.series("procfs", pid) is None else None)

        def sharers(ts_ns: int) -> int:
            return max(1, self.loads.running_at(port, ts_ns) or 1)

        cost = wasted(samples, start_ns=start_ns, end_ns=end_ns, pid=pid, sharers=sharers, gpu=gpu)
        return cost.gpu_seconds, cost.cpu_seconds, unmeasured

    def _write_orphaned_work(self, now: int, *, final: bool = False) -> None:
        """The stretches of orphaned work due to be written (``OrphanLedger.take_rows``); kept for
        the next round where the store refuses them, a stretch's newest row replacing its older."""
        for row in self.orphaned.take_rows(now, final=final):
            self._orphan_rows[(row["server_port"], row["start_ns"])] = row
        self.stats.orphaned = self.orphaned.totals()
        if self._orphan_rows:
            try:
                self.store.write_orphaned_work(list(self._orphan_rows.values()))
            except StoreError as exc:
                if not self._orphans_unwritten:  # once an outage
                    log.warning("orphaned work not written (kept, retried every round): %s", exc)
                self._orphans_unwritten = True
                return
            except SqlError as exc:  # the database refused the rows themselves: no retry would take them
                log.warning("orphaned work refused by the store, %d stretches dropped: %s", len(self._orphan_rows), exc)
            self._orphan_rows, self._orphans_unwritten = {}, False

    def finish(self) -> None:
        """The daemon stops: write every stretch of orphaned work, those still running ended where
        their last scrape counted (``cut_short``)."""
        self._write_orphaned_work(self.clock(), final=True)

    # -- bookkeeping ------------------------------------------------------------------------
    def _settle(self, now: int) -> int | None:
        """Let go of requests whose verdict is final (to the settled ones, held for a late span) or
        that found no verdict within the horizon; count the in-flight zombies; return the first
        close of a request still open whose verdict was never reported final (where a restart must
        read on from).

        A verdict becomes final only when it is written, so only the requests that changed since
        the last settle are looked at (``_to_settle``), in the order of their clients' closes; all
        of them are walked for the horizon every ``PRUNE_EVERY_NS`` (a request is let go up to that
        much after its fifteen minutes)."""
        cutoff = now - HORIZON_NS
        if now >= self._next_expiry_ns:
            self._next_expiry_ns = now + PRUNE_EVERY_NS
            looked_at = list(self._open.items())
            self._to_settle, self._unreported = set(), []  # the walk pushes every unreported close again
        else:
            keys, self._to_settle = self._to_settle, set()
            looked_at = sorted(((key, self._open[key]) for key in keys if key in self._open),
                               key=lambda item: item[1].origin().ts_ns)
        for key, request in looked_at:
            self._settle_one(key, request, cutoff)
        self.stats.inflight_zombies = len(self._inflight)
        return self._first_unreported()

    def _settle_one(self, key: RequestKey, request: OpenRequest, cutoff: int) -> None:
        written = request.written
        expired = request.origin().ts_ns < cutoff
        if written is None and expired:  # no verdict within the horizon
            del self._open[key]
            return
        if written is not None and (expired or not (written.verdict is Verdict.INFLIGHT_ZOMBIE
                                                    or written.details.get("provisional"))):
            del self._open[key]
            self._inflight.discard(key)
            self._keep_settled(request)
            if request.reported is not written.verdict:
                request.reported = written.verdict
                self.on_settled(written)
            return
        if written is not None and written.verdict is Verdict.INFLIGHT_ZOMBIE:
            self._inflight.add(key)
        else:
            self._inflight.discard(key)
        if request.reported is None:
            for disconnect in request.disconnects.values():
                heapq.heappush(self._unreported, (disconnect.event_id, key))

    def _first_unreported(self) -> int | None:
        heap = self._unreported
        if len(heap) > 4 * len(self._open) + 1024:  # mostly entries of requests since settled: rebuilt
            heap[:] = [(d.event_id, key) for key, request in self._open.items() if request.reported is None
                       for d in request.disconnects.values()]
            heapq.heapify(heap)
        while heap:
            event_id, key = heap[0]
            request = self._open.get(key)
            if request is not None and request.reported is None and any(
                    d.event_id == event_id for d in request.disconnects.values()):
                return event_id
            heapq.heappop(heap)
        return None

    def _keep_settled(self, request: OpenRequest) -> None:
        """Hold a settled request for a late span of its trace. Traces are in the order their last
        request settled, so that pruning goes from the first and stops at the first it keeps."""
        trace_id, span_id = request.key
        requests = self._settled.pop(trace_id, None) or {}
        requests[span_id] = request
        self._settled[trace_id] = requests
        if request.written is not None and request.written.request_id:
            self._settled_by_request_id[request.written.request_id] = request.key

    def _unsettle(self, taken: dict[str, OpenRequest]) -> Iterable[OpenRequest]:
        """A trace's settled requests, taken out of the settled ones (to reopen or to forget them),
        no longer found by their request ids either."""
        requests = taken.values()
        for request in requests:
            request_id = request.written.request_id if request.written is not None else None
            if request_id and self._settled_by_request_id.get(request_id) == request.key:
                del self._settled_by_request_id[request_id]
        return requests

    def _count(self, kind: CoverageKind, detail: str, ts_ns: int, count: int = 1) -> None:
        if detail in self._counted:
            return
        self._coverage.append({"ts_ns": ts_ns, "host": self.host, "kind": kind.value, "count": count,
                               "detail": detail})
        self._counted[detail] = ts_ns
        self._stat(kind, count)

    def _stat(self, kind: CoverageKind, count: int) -> None:
        attr = _STATS.get(kind)
        if attr:
            setattr(self.stats, attr, getattr(self.stats, attr) + count)

    def _count_close(self, kind: CoverageKind, disconnect: Disconnect) -> None:
        """A close written off at its window's end: counted once, however often a restart reads it."""
        if disconnect.event_id in self._counted_closes:
            return
        self._counted_closes[disconnect.event_id] = disconnect.ts_ns
        self._closes_to_write.setdefault(kind, []).append((disconnect.ts_ns, disconnect.event_id))
        self._stat(kind, 1)

    def _save_state(self, first_unreported: int | None) -> None:
        # The position a restart reads on from: before every close still waiting for its span, and
        # every close of a request whose verdict was never reported final (an in-flight zombie;
        # ``first_unreported``, from ``_settle``), so that a restarted daemon joins them again and
        # finishes their verdicts.
        first = self._pending.first_id()
        settled = self._event_cursor if first is None else first - 1
        if first_unreported is not None and first_unreported <= settled:
            settled = first_unreported - 1
        if settled == self._saved_position:
            return
        self.store.save_correlator_position(self.host, settled)
        self._saved_position = settled

    def _prune(self, now: int) -> None:
        # Forgetting walks every connection seen in the horizon: every 10 s is often enough.
        if now < self._next_prune_ns:
            return
        self._next_prune_ns = now + PRUNE_EVERY_NS
        cutoff, memory_cutoff = now - HORIZON_NS, now - self.memory_ns
        # Spans of traces with no open request leave memory after the late-span window and a margin; their
        # settled requests too, which the store's verdicts bring back if need be (auditor.correlate.recall).
        self.spans.prune(memory_cutoff, keep={key[0] for key in self._open})
        # Requests no longer open keep no checkpoints that matter (a reopen drops them): let go.
        self._checkpointed = {key: r for key, r in self._checkpointed.items() if self._open.get(r.key) is r}
        # A settled request's close only while a span may still come in its late-span window.
        late_cutoff = now - self.late_ns
        self._joined = {tuple4: known for tuple4, known in self._joined.items() if known[1] in self._open
                        or (known[1][0] in self._settled and known[0].ts_ns >= late_cutoff)}
        # From the trace whose request settled first, up to the first one still in its window.
        for _trace_id, settled in drop_front(
                self._settled, lambda requests: all(r.origin().ts_ns < memory_cutoff for r in requests.values())):
            self._unsettle(settled)  # no longer found by request id either
        # A close's count ("ev:<event id>") guards against counting it again after a restart, which
        # reads the events after the saved position again: those at or before it need no guard.
        self._counted = {detail: ts for detail, ts in self._counted.items()
                         if ts >= cutoff and not _event_at_or_before(detail, self._saved_position)}
        saved = -1 if self._saved_position is None else self._saved_position
        self._counted_closes = {event_id: ts for event_id, ts in self._counted_closes.items()
                                if ts >= cutoff and event_id > saved}
        # Scrapes for an open request's whole run (a long zombie needs them all); connections' last
        # closes for the memory window (well past SAME_CONNECTION_NS).
        self.loads.prune(cutoff, closes_cutoff_ns=memory_cutoff)
        listed_cutoff = now - self.loads.clients_kept_ns  # no listing read before then is kept
        self._telling = {tuple4: known for tuple4, known in self._telling.items() if known[0] >= listed_cutoff}
        for table in (self._events_by_tuple, self._closed_by_tuple, self._local_fin_by_tuple):
            drop_front(table, lambda stamps: max(stamps) < memory_cutoff)  # in the order of their last event
        # Start notices are what joins a waiting close to a span known only live: kept while a close
        # as old as the span's end may still wait (the memory window, or the oldest waiting close).
        oldest = self._pending.oldest_ns()
        self.live.prune(cutoff, ended_before_ns=memory_cutoff if oldest is None else min(memory_cutoff, oldest))
        # Written-off disconnects a late span may claim back: idle closes (most of them, one per
        # request whose client closed after its answer) for the memory window; the rare unjoined
        # ones for the horizon, which also covers a wall clock stepped forward and back.
        for disconnect in [d for d in self._recent_unjoined if d.ts_ns < (
                memory_cutoff if self._unjoined_kind[d.event_id] is CoverageKind.IDLE_CLOSE else cutoff)]:
            self._recent_unjoined.remove(disconnect)
            del self._unjoined_kind[disconnect.event_id]


def _append(table: dict[Tuple4, tuple[int, ...]], tuple4: Tuple4, ts_ns: int) -> None:
    """Add an event time; the connection moves to the end (tables are in the order of their
    latest event, pruned by ``drop_front``)."""
    table[tuple4] = (*table.pop(tuple4, ()), ts_ns)


def _detail_event(detail: str) -> tuple[int, str] | None:
    """The kernel event a coverage detail names ("ev:<id>", "ev:<id>:undo"), and what follows its id."""
    if not detail.startswith("ev:"):
        return None
    number, _, rest = detail[3:].partition(":")
    return (int(number), rest) if number.isdigit() else None


def _event_at_or_before(detail: str, position: int | None) -> bool:
    """Whether a coverage detail names a kernel event at or before ``position``."""
    named = _detail_event(detail)
    return position is not None and named is not None and named[0] <= position


_CLOSES = "evs:"  # a coverage row's detail naming the closes it counts: "evs:<first id>,<+id>,<+id>..."
_DETAIL_CHARS = 255  # the column's width


def _close_rows(closes: dict[CoverageKind, list[tuple[int, int]]], host: str) -> list[dict[str, object]]:
    """Counted closes, (time, event id) by kind, as coverage rows: one per kind and second of their
    times (more where their ids outgrow the detail column), at the second's first close, naming
    the closes by event id so that a restart counts none twice."""
    rows: list[dict[str, object]] = []
    for kind, counted in closes.items():
        for _, in_second in itertools.groupby(sorted(counted), key=lambda close: close[0] // 1_000_000_000):
            group = list(in_second)
            for count, detail in _id_details(sorted(event_id for _, event_id in group)):
                rows.append({"ts_ns": group[0][0], "host": host, "kind": kind.value, "count": count,
                             "detail": detail})
    return rows


def _id_details(ids: list[int]) -> Iterator[tuple[int, str]]:
    """Sorted event ids as details "evs:<first>,<step>,<step>..." (each id's distance from the one
    before: a few digits), each within the column's width, with how many ids each names."""
    start = 0
    while start < len(ids):
        detail, end = _CLOSES + str(ids[start]), start + 1
        while end < len(ids):
            step = f",{ids[end] - ids[end - 1]}"
            if len(detail) + len(step) > _DETAIL_CHARS:
                break
            detail += step
            end += 1
        yield end - start, detail
        start = end


def _counted_close_ids(detail: str | None) -> list[int] | None:
    """The event ids of the closes a coverage row counted ("evs:..." or an older row's "ev:<id>"),
    or None for a detail that names something else."""
    if not detail:
        return []
    if detail.startswith(_CLOSES):
        ids = [int(part) for part in detail[len(_CLOSES):].split(",")]
        return list(itertools.accumulate(ids))
    named = _detail_event(detail)
    return [named[0]] if named is not None and not named[1] else None  # an undo is not a count


def _forget_reads(request: OpenRequest) -> None:
    """A settled request reopened: the checkpoints of its window (cost, gauges' sweep) stood only
    while news dropped those it touched, and news while it was settled did not reach them."""
    request.cost_partial = request.scrape_sweep = None


def _settled_request_ids(engine_request_id: str) -> tuple[str, ...]:
    """The request ids a settled request may hold for an engine's request id: the id itself, and
    the id less the prefix the OpenAI server adds (vLLM's \"cmpl-\" and \"chatcmpl-\"). Called
    for every engine span: plain tests, not a loop over the prefixes."""
    if engine_request_id.startswith("cmpl-"):
        return engine_request_id, engine_request_id[5:]
    if engine_request_id.startswith("chatcmpl-"):
        return engine_request_id, engine_request_id[9:]
    return (engine_request_id,)


def _left_at(request: OpenRequest) -> int:
    return request.origin().ts_ns


def _first_instant(disconnect: Disconnect) -> int:
    """The earliest moment the close may have happened: its instant, or its interval's start."""
    return disconnect.ts_ns if disconnect.earliest_ns is None else min(disconnect.earliest_ns, disconnect.ts_ns)


def _lean(span: SpanRecord) -> SpanRecord:
    """The span as the correlator holds it: without the attributes no verdict reads, and with one
    copy of each of the texts most spans repeat (service, name, route, ...). The record is the
    correlator's (read from the store, or handed over once committed), so it is changed in place:
    a copy of the record cost as much as the rest of indexing it. Most spans keep no attribute:
    they share one empty dict (which nothing changes) instead of one each, and those that keep
    only their sender's address and client's User-Agent one dict a pair of them (up to
    ``MAX_SHARED_ATTRIBUTES`` pairs; past them, a dict each)."""
    attributes = span.attributes
    kept = SERVER_ATTRIBUTES if span.role is SpanRole.HTTP_SERVER else JUDGED_ATTRIBUTES
    if attributes and not attributes.keys() <= kept:
        attributes = {k: attributes[k] for k in kept if k in attributes}
        object.__setattr__(span, "attributes", attributes or _NO_ATTRIBUTES)
    elif not attributes and attributes is not _NO_ATTRIBUTES:
        object.__setattr__(span, "attributes", _NO_ATTRIBUTES)
    if attributes and attributes.keys() <= _REPEATED and all(type(v) is str for v in attributes.values()):
        values = tuple(sorted(attributes.items()))
        one = _SHARED_ATTRIBUTES.get(values)
        if one is None and len(_SHARED_ATTRIBUTES) < MAX_SHARED_ATTRIBUTES:
            one = _SHARED_ATTRIBUTES[values] = dict(attributes)
        if one is not None and one is not attributes:
            object.__setattr__(span, "attributes", one)
    _share_texts(span)
    for name in SHARED_NUMBERS:
        value = getattr(span, name)
        if value is not None:
            held = _numbers.get(value)
            if held is None and len(_numbers) < MAX_SHARED_NUMBERS:
                held = _numbers[value] = value
            if held is not None and held is not value:
                object.__setattr__(span, name, held)
    return span


def _text_sharer(names: tuple[str, ...]) -> Callable[[SpanRecord], None]:
    """``span -> None``: each of the span's ``names`` texts replaced by the one copy held
    (``sys.intern``; the frozen record's own field, same value), written out field by field in one
    generated function: the round's spans step took about an eighth less a span than with a loop
    over the names (a zip with one attrgetter call; docs/footprint.md, the twenty-fifth pass). The
    source holds only the field names (identifiers, checked)."""
    if not all(name.isidentifier() for name in names):
        raise ValueError(f"not field names: {names}")
    lines = ["def share(span):"]
    for name in names:
        lines += [f"    value = span.{name}", "    if value is not None:", "        held = intern(value)",
                  "        if held is not value:", f"            setattr(span, {name!r}, held)"]
    namespace: dict[str, Any] = {"intern": sys.intern, "setattr": object.__setattr__}
    exec("\n".join(lines) + "\n    return None\n", namespace)
    return namespace["share"]  # type: ignore[no-any-return]


_share_texts = _text_sharer(SHARED_TEXTS)
