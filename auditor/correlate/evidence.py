"""Which evidence decides a verdict when the engine emits no engine span (DESIGN §5, "Evidence").

Two questions, each answered from what real servers do emit:

1. Was the response complete when the client left? Told by what the server had sent: its own FIN
   before the client's (kernel order), the ``http send`` that ended the response, or a server span
   that had already ended. Never by the absence of an engine span.
2. Did the work stop? Told by the engine's own /metrics: requests it holds (running + waiting)
   above the requests still in flight on its port are orphans; while a disconnected request's
   share of them lasts, its work goes on. The end is known to a scrape interval. Where the engine
   counts its aborts (vLLM ``finished_reason="abort"``, SGLang), the counter rising between the
   scrapes around a disconnect by as many as the requests that left then says their work stopped.

Where neither tells, the answer is ``None`` and the verdict is ``unconfirmed``: never an abort.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from auditor.correlate.checkpoints import Checkpoints
from auditor.correlate.prune import drop_front
from auditor.correlate.verdict import CLOCK_ERROR_NS
from auditor.model import (
    FINISHES_COUNTED_IN_TOKENS,
    LOGGED_STYLES,
    STEP_STILL_NS,
    EngineLoad,
    ListedClient,
    SpanRecord,
)

FINAL_SEND_ATTR = "asgi.event.final"
SERVER_CLOSED_FIRST_NS = 1_000_000_000  # a client's close this soon after the server's FIN answers it
SAME_CONNECTION_NS = 30_000_000_000  # closes of one connection this close together are one departure
ABORT_LOOKBACK_NS = 1_000_000_000  # departures counted before the first scrape, when there is none earlier

# The evidence names a verdict records in details["evidence"].
ENGINE_SPAN = "engine_span"
LIVE_NOTICE = "live_notice"
ENGINE_METRICS = "engine_metrics"
KERNEL_ORDER = "kernel_order"
LAST_SEND = "last_send"
SPAN_END = "span_end"
REFUSED = "refused"
HTTP_ONLY = "http_only"
# Why an unconfirmed verdict is one, in details["unconfirmed_because"] (evaluate._unconfirmed_because).
RACED_ITS_ANSWER = "raced_its_answer"
GAUGES_CANNOT_TELL = "gauges_cannot_tell"
NO_GAUGES = "no_gauges"
# 4xx answers a server gives before any work (bad request, not found, too long, rate limited),
# less those that tell of the client's leaving or waiting: 408 (it was too slow), 499 (it left).
NOT_REFUSALS = frozenset({408, 499})


def refused(http_status: int | None) -> bool:
    """Whether a server span's status is a refusal: the request was answered, and nothing ran."""
    return http_status is not None and 400 <= http_status < 500 and http_status not in NOT_REFUSALS


def completed_by(disconnect_ns: int, http_span: SpanRecord | None, subtree: Iterable[SpanRecord],
                 local_fins: Iterable[int], clock_error_ns: int, earliest_ns: int | None = None) -> str | None:
    """The evidence that the response was complete when the client left, or None.

    ``earliest_ns`` is set for a polled close, known only to lie after it: a span that ended
    after that moment may have ended because the client left (a server ends its span as soon as it
    hears of the disconnect), so its end orders nothing."""
    if http_span is None:
        return None
    if refused(http_span.http_status):
        return REFUSED  # a complete answer, whenever the client left: no work to go on
    if any(http_span.start_ns <= fin <= disconnect_ns for fin in local_fins):
        return KERNEL_ORDER  # the server closed first: it had nothing more to send
    for span in subtree:
        if span.parent_span_id == http_span.span_id and span.attributes.get(FINAL_SEND_ATTR) is True \
                and span.start_ns <= disconnect_ns + clock_error_ns:
            return LAST_SEND
    if http_span.end_ns <= disconnect_ns and (earliest_ns is None or http_span.end_ns <= earliest_ns):
        return SPAN_END  # the server was done before it heard of the disconnect
    return None


@dataclass(frozen=True, slots=True)
class MetricsEnd:
    """What the engine's gauges say about one disconnected request's work."""

    work_end_ns: int | None  # None: still orphaned at the latest scrape
    resolution_s: float  # the scrape interval around the end
    orphaned_scrapes: int  # scrapes that counted it as running after its client left
    read_until_ns: int | None = None  # the latest moment the scrapes that decided it span
    # Nothing decided yet: no scrape since it left, or only scrapes whose orphans the kernel's
    # connected clients may hold (their spans not come). Whether this request's work goes on cannot
    # be told before the next scrapes, or those spans, come.
    awaiting: bool = False
    # The last such scrape skipped on the way to the answer: spans still to come may change it.
    unsure_until_ns: int | None = None
    # Where asked (a client that may have closed after the last byte): whether the engine held one
    # more request once it left (EngineLoads.held_one_more)
    held_one_more: bool | None = None
    leaving_untold: bool = False  # asked, and no scrape within HELD_ONE_MORE_WINDOW_NS could say
    # The earliest the work may have ended (or, still orphaned, may have), where that is before the
    # last scrape that counted it: leavers after it whose own rise is untold (``EngineLoads.racing``)
    # may own the orphans it was given since. None: the end is as exact as ``resolution_s`` says.
    earliest_ns: int | None = None
    # The scrapes the end lies between: the last that counted it running after its client left
    # (None: none did, the end is taken at the leaving), and the first that showed it gone.
    held_at_ns: int | None = None
    gone_by_ns: int | None = None
    # Asked where it held no more (a client that may have closed after the last byte): the engine's
    # finish counter stood still over its whole life (``EngineLoads.no_finish_while``), so it was
    # no complete answer, and its work stopped as its client left.
    no_finish_counted: bool = False


# The routes whose requests each engine's finish counter counts (``EngineLoad.style``: its
# generating endpoints): a request to another (a health check, the model list) never moves it, so
# its standing still says nothing of such a request's answer (``EngineLoads.no_finish_while``).
_OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
COUNTED_ROUTES: dict[str, frozenset[str]] = {
    "vllm": _OPENAI_ROUTES | {"/v1/responses"},
    "tgi": _OPENAI_ROUTES | {"/generate", "/generate_stream"},
    "llamacpp": _OPENAI_ROUTES | {"/completion", "/completions", "/chat/completions", "/infill"},
    "ref": _OPENAI_ROUTES,
}
# vLLM counts a finish as it hands the request's last output to the server, which may be a few
# milliseconds after the server sent it where outputs are handed over in slices (over 128 at once):
# the count is read up to the first scrape this long after the span's end.
FINISH_COUNT_LAG_NS = 250_000_000


# Evidence this long after a scrape may still change what the sweep read there: the connected count
# spans the scrape's answer and the clock error, both well under it.
SWEEP_NEWS_MARGIN_NS = 1_000_000_000
SWEEP_CHECKPOINT_NS = 1_000_000_000
SWEEP_AFTER_NS = 4_000_000_000  # a request whose client left longer ago than this keeps checkpoints
# The daemon hears of a disconnect within milliseconds (the eBPF probe wakes it; within 0.1 s of
# another close), or the /proc source's poll, later on a loaded host, and lists the port's clients
# from its next scrape on: a scrape this soon after a disconnect that it did not list (one of the
# port's scrapes listed before) says nothing of an orphan.
UNLISTED_AFTER_LEAVING_NS = 750_000_000
# A listing made only because the engine held requests is kept (for the memory window) where a
# client's close came at most BUSY_LISTING_NEAR_NS before it (the scraper's own listing window
# after a close: the listings it would have made had it heard of the close at once); the others are
# forgotten once BUSY_LISTING_SETTLE_NS has passed, time for the daemon to hear of every close.
BUSY_LISTING_NEAR_NS = 2_000_000_000
BUSY_LISTING_SETTLE_NS = 10_000_000_000
# A request whose leaving may have added no orphan is asked of the scrapes this long after its span's
# end (EngineLoads.held_one_more): enough for one listed scrape after the disconnect. A request on a
# scraped port that no scrape since its client left says anything of waits as long for one (no
# verdict until then) before it is read as one whose work nothing tells.
HELD_ONE_MORE_WINDOW_NS = 2_000_000_000
# An engine drops a finished request from its running gauge before the server has sent the last
# bytes and ended the request's span: a scrape read in between counts it connected and not held,
# which hides an orphan. Spans that ended this soon after a scrape's answer may be such (a loaded
# host's event loop stretches the gap to tens of milliseconds).
ENDING_NS = 100_000_000
# The engine's orphans counted by port alone (``EngineLoads.orphans_past``), before any span says
# whose they are: a scrape is read this long after its answer, when the closes of its time have come
# (the /proc source's polls come every quarter second, later on a loaded host, and the daemon stores
# what they found before each round); with a source that wakes the daemon as clients leave (the eBPF
# probe: a lone close within a millisecond, one of a burst within the 0.1 s the daemon then polls
# at) after ORPHANS_SETTLE_WOKEN_NS. A close is counted with the scrape up to ORPHANS_CLOSE_SLACK_NS
# after its answer (a polled close is seen after it happened, by up to a poll); a count older than
# ORPHANS_STALE_NS says nothing of now. While a scrape holds more than its clients and the count, a round looks
# again ORPHANS_LOOK_AGAIN_NS later (the engines' scrapes come a quarter second apart), for up to
# ORPHANS_LOOK_FOR_NS after that excess rose (the grace and a scrape's settling, with room).
ORPHANS_SETTLE_NS = 500_000_000
ORPHANS_SETTLE_WOKEN_NS = 200_000_000
ORPHANS_CLOSE_SLACK_NS = ORPHANS_SETTLE_NS
ORPHANS_LOOK_AGAIN_NS = 250_000_000
ORPHANS_LOOK_FOR_NS = 2_000_000_000
ORPHANS_STALE_NS = 3_000_000_000
_UNLISTED: Any = object()  # no listing with a scrape (a listing of no client is an empty tuple)


# A sweep's state after a scrape: the heap of "until"s still connected, the last orphaned scrape,
# how many were orphaned, the last orphaned whatever the untold racers owned.
SweepState = tuple[tuple[int, ...], int | None, int, int | None]


class ScrapeSweep(Checkpoints[SweepState]):
    """Where ``EngineLoads.work_end``'s sweep of the scrapes stood, about a second apart, while every
    scrape it read still held the request's work (``checkpoints``). Evidence up to
    SWEEP_NEWS_MARGIN_NS after a scrape may change what the sweep read there, so news drops the
    checkpoints that far before it too. The key: the port, the disconnect and the first scrape's
    bound."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(margin_ns=SWEEP_NEWS_MARGIN_NS, spacing_ns=SWEEP_CHECKPOINT_NS)


def _times() -> array[int]:
    """Nanosecond times kept for the horizon: 8-byte integers (an int object in a list takes 40)."""
    return array("q")


_NO_TIMES = _times()  # read only
_TS = operator.attrgetter("ts_ns")  # a scrape's time, bisect's key (in C: no Python call a step)
_HALF = 1 << 64


def _answered_before(series: list[EngineLoad], moment_ns: int) -> int:
    """The index of the last scrape in ``series`` answered before ``moment_ns`` (a scrape sent
    before it may read its count after), or -1."""
    before = bisect.bisect_left(series, moment_ns, key=_TS) - 1
    while before >= 0 and (series[before].answered_ns or series[before].ts_ns) >= moment_ns:
        before -= 1
    return before


def _each_generated(first: EngineLoad, last: EngineLoad, lengths: Sequence[int]) -> bool:
    """Whether the engine's count of its finished requests' generation time rose, from ``first``
    to ``last``, by more than all of ``lengths`` (the spans that ended then) but the shortest, and
    its count of their tokens by one a span at least: none of those requests but finished."""
    if len(lengths) < 2 or first.finished is None or last.finished is None \
            or first.finished_seconds is None or last.finished_seconds is None:
        return False
    rise_ns = (last.finished_seconds - first.finished_seconds) * 1e9
    return last.finished - first.finished >= len(lengths) and rise_ns > sum(lengths) - min(lengths)


def _pair(first: int, second: int) -> int:
    """Two nanosecond times (within 64 bits each) as one number: 44 bytes where a tuple of them takes 120."""
    return first * _HALF + (second % _HALF)


def _unpair(pair: int) -> tuple[int, int]:
    first, second = divmod(pair, _HALF)
    return first, second - _HALF if second >= _HALF // 2 else second


def _take_one(values: array[int], value: int) -> None:
    """One occurrence of ``value`` out of the sorted ``values``, where there is one."""
    index = bisect.bisect_left(values, value)
    if index < len(values) and values[index] == value:
        del values[index]


class Registered:
    """The registrations (``EngineLoads.register``) made since the correlator last took them, each
    as its disconnect's time, its number in the order they were made, and until when the connected
    count holds its span.

    A registration changes the work end only of requests that left before it and read scrapes up
    to it (a later leaver claims orphans first; one that left earlier cancels out of the count),
    and only for those judged before it was made: news to them alone, not to every verdict that
    read that far (``concerning``). It changes too whether the engine held one more request when a
    client left (``EngineLoads.held_one_more``) where its span ended between the scrapes compared."""

    __slots__ = ("_numbers", "_times", "_untils")

    def __init__(self, made: list[tuple[int, int, int]]) -> None:
        made.sort()
        self._times = [ts_ns for ts_ns, _, _ in made]
        self._numbers = [number for _, number, _ in made]
        self._untils = [until_ns for _, _, until_ns in made]

    def __bool__(self) -> bool:
        return bool(self._times)

    def earliest(self) -> int | None:
        return self._times[0] if self._times else None

    def concerning(self, left_ns: int, until_ns: int, seen: int,
                   compared: tuple[int, int] | None = None) -> int | None:
        """The earliest registration after ``left_ns`` and at most ``until_ns`` made after the
        ``seen``-th: news to a request whose client left at ``left_ns``, judged when ``seen`` had
        been made, whose verdict read scrapes up to ``until_ns``. ``compared``: the scrapes
        ``held_one_more`` compared for it (their times); a registration whose span ended between
        them is news from the first."""
        times, numbers = self._times, self._numbers
        for index in range(bisect.bisect_right(times, left_ns), bisect.bisect_right(times, until_ns)):
            if numbers[index] > seen:
                return times[index]
        if compared is not None:
            first, second = compared
            if any(first <= until < second and number > seen for until, number in zip(self._untils, numbers, strict=True)):
                return first
        return None


class EngineLoads:
    """Recent scrapes per inference port, and the disconnected requests that may own their orphans."""

    def __init__(self) -> None:
        self._loads: dict[int, list[EngineLoad]] = defaultdict(list)
        # Registrations are kept for the horizon, one a disconnected request: as numbers, not objects.
        # port -> hash of the request -> its disconnect and until when the connected count holds its
        # span, as one number (``_pair``); two of the horizon's requests would have to share a
        # 64-bit hash for one to take the other's place.
        self._disconnects: dict[int, dict[int, int]] = defaultdict(dict)
        # port -> {hash(request): its close and until when it was connected (``_pair``)} of the
        # leavers that may have closed after their last byte (``held_one_more``) whose own rise is
        # not known to be none: no registered leaver, yet each may have added an orphan where
        # another's rise is asked, or that ``work_end`` gives an earlier leaver.
        self._racers: dict[int, dict[int, int]] = defaultdict(dict)
        self._racer_untils: dict[int, array[int]] = defaultdict(_times)  # port -> those "until"s, sorted
        self._racer_closes: dict[int, array[int]] = defaultdict(_times)  # port -> their closes, sorted
        self._disconnect_times: dict[int, array[int]] = defaultdict(_times)  # port -> those disconnects, sorted
        self._connected_until: dict[int, array[int]] = defaultdict(_times)  # port -> their "until", alike
        self._untils_sorted: dict[int, array[int]] = defaultdict(_times)  # port -> those "until"s, sorted
        # port -> every client close (kernel), sorted; kept for the horizon, one a request: 8-byte
        # integers in an array, not int objects in a list (40 bytes each)
        self._departures: dict[int, array[int]] = defaultdict(_times)
        self._departed: dict[tuple[str, int, int], int] = {}  # connection -> its last close
        # The earliest moment any change concerns (a scrape, a close) since the correlator last took
        # it: verdicts that read nothing that old stay as they are.
        self.changed_ns: int | None = None
        # Registrations are news apart (``Registered``): made so far, and those since last taken.
        self.registrations = 0
        self._registered: list[tuple[int, int, int]] = []
        # port -> scrape time -> the clients connected then (``EngineLoad.connections``), for the
        # scrapes that listed them; kept for ``clients_kept_ns`` after the port's latest listing
        # (the correlator's memory window, as the spans that tell them): older scrapes are read
        # without them.
        self._clients: dict[int, dict[int, tuple[ListedClient, ...] | None]] = {}  # None: incomplete
        self._busy_clients: dict[int, dict[int, tuple[ListedClient, ...] | None]] = {}  # alike, busy-only
        self._busy_listings: dict[int, deque[int]] = {}  # port -> its busy-only listings not yet settled
        self.clients_kept_ns = 60_000_000_000
        # port -> request -> (its client's close, its work's end), for requests whose work went on
        # after their clients left and is known to have ended (``work_ended``): orphans a listed
        # scrape counted that are gone since. Kept for ORPHANS_STALE_NS and the settling after it.
        self._ended: dict[int, dict[str, tuple[int, int]]] = {}
        self._ended_room: dict[int, int] = {}
        self._still_since: dict[int, int] = {}  # port -> the first scrape of its latest step count
        self._log_gaps: dict[int, list[int]] = {}  # port -> its last four intervals between logs of work
        self._models: dict[int, str] = {}  # port -> the model its latest scrape that named one named
        # Ports whose engine's finish counter (``EngineLoad.finished``) was seen to rise between two
        # scrapes: it counts (a counter that never moves, an engine's statistics turned off, says
        # nothing by standing still).
        self._counts_finishes: set[int] = set()
        # Ports whose engine's abort counter has been seen to rise (``no_abort_while``): vLLM's abort
        # series never does, since it counts no client's abort.
        self._counts_aborts: set[int] = set()

    def _changed(self, ts_ns: int) -> None:
        if self.changed_ns is None or ts_ns < self.changed_ns:
            self.changed_ns = ts_ns

    def take_changed(self) -> int | None:
        changed, self.changed_ns = self.changed_ns, None
        return changed

    def take_registered(self) -> Registered:
        made, self._registered = self._registered, []
        return Registered(made)

    def _registered_at(self, ts_ns: int, until_ns: int) -> None:
        self.registrations += 1
        self._registered.append((ts_ns, self.registrations, until_ns))

    def add(self, loads: Iterable[EngineLoad]) -> set[int]:
        """Record scrapes; returns the ports they concern."""
        ports = set()
        for load in loads:
            if load.connections is not None:
                # A busy-only listing is kept apart: it stands in only for a scrape the daemon could
                # not have had listed, before it heard of a close (``_listing``).
                kept = self._busy_clients if load.listed_while_busy else self._clients
                listed = kept.setdefault(load.server_port, {})
                listed[load.ts_ns] = load.connections if load.connections_complete else None
                cutoff = load.ts_ns - self.clients_kept_ns
                while (first := next(iter(listed))) < cutoff:  # listed in time order: from the front
                    del listed[first]
                if load.listed_while_busy:
                    self._drop_busy_listings(load.server_port, load.ts_ns)
                load = replace(load, connections=None)  # kept apart, and for less long than the scrape
            if load.model is not None:
                self._models[load.server_port] = load.model
            series = self._loads[load.server_port]
            if series and load.ts_ns < series[-1].ts_ns:
                bisect.insort(series, load, key=_TS)
            else:
                if load.finished is not None and series and series[-1].finished is not None \
                        and load.finished > series[-1].finished:
                    self._counts_finishes.add(load.server_port)
                if load.aborted is not None and series and series[-1].aborted is not None \
                        and load.aborted > series[-1].aborted:
                    self._counts_aborts.add(load.server_port)
                series.append(load)
                if load.step_tokens is not None:
                    self._unstale(load.server_port, series)
            ports.add(load.server_port)
            self._changed(load.ts_ns)
        return ports

    def _drop_busy_listings(self, port: int, ts_ns: int) -> None:
        """Note a listing made only because the engine was busy (``EngineLoad.listed_while_busy``),
        and forget those of the port that no client's close came up to BUSY_LISTING_NEAR_NS before,
        once BUSY_LISTING_SETTLE_NS has passed for the daemon to hear of any: a port whose clients
        keep their connections (a pool) would otherwise keep one a scrape for the memory window,
        where a listing is read only for the scrapes soon after a close."""
        pending = self._busy_listings.setdefault(port, deque())
        pending.append(ts_ns)
        listed, closes = self._busy_clients.get(port, {}), self._departures.get(port, _NO_TIMES)
        while pending and pending[0] < ts_ns - BUSY_LISTING_SETTLE_NS:
            at = pending.popleft()
            index = bisect.bisect_right(closes, at)
            if index == 0 or closes[index - 1] < at - BUSY_LISTING_NEAR_NS:
                listed.pop(at, None)

    def _listing(self, listed: dict[int, Any], port: int, ts_ns: int, disconnect_ns: int) -> Any:
        """The clients listed with the port's scrape at ``ts_ns`` (None: incompletely; _UNLISTED:
        not listed), read for a request whose client left at ``disconnect_ns``. A scrape listed only
        because the engine was busy counts only where an unlisted one would say nothing: within
        UNLISTED_AFTER_LEAVING_NS of the disconnect, before the daemon could have asked for it."""
        clients = listed.get(ts_ns, _UNLISTED)
        if clients is _UNLISTED and ts_ns - disconnect_ns <= UNLISTED_AFTER_LEAVING_NS:
            clients = self._busy_clients.get(port, {}).get(ts_ns, _UNLISTED)
        return clients

    def model_of(self, port: int) -> str | None:
        """The model the engine on ``port`` serves, as its gauges name it (``EngineLoad.model``)."""
        return self._models.get(port)

    def _unstale(self, port: int, series: list[EngineLoad]) -> None:
        """An engine whose step series (``EngineLoad.step_tokens``) stood still for its
        STEP_STILL_NS ran no step then: what its gauges held from the first scrape of that value on
        was not running. vLLM publishes its gauges with each step, so a batch aborted at once, with
        no request after, left them at their last values (vLLM issues 22545, 29928): read as they
        were, every aborted request was an orphan running on for ever. Those scrapes are read as
        holding nothing, and that is news from the first of them. An engine that publishes only
        when it logs a batch (LOGGED_STYLES: SGLang, every 40 decode steps) may have run on for a
        log interval after its last log: read as running for the longest of its last intervals."""
        last = series[-1]
        since = self._still_since.get(port)
        if since is None or len(series) < 2 or series[-2].step_tokens != last.step_tokens:
            self._still_since[port] = last.ts_ns
            previous = series[-2] if len(series) > 1 else None
            if since is not None and last.style in LOGGED_STYLES and previous is not None \
                    and (previous.running or previous.waiting):  # an interval between logs of work
                gaps = self._log_gaps.setdefault(port, [])
                gaps[:] = [*gaps[-3:], last.ts_ns - since]
            return
        still_ns = STEP_STILL_NS.get(last.style, STEP_STILL_NS["vllm"])
        if last.ts_ns - since < still_ns:
            return
        ran_on = min(max(self._log_gaps.get(port) or [0]), still_ns) if last.style in LOGGED_STYLES else 0
        first = bisect.bisect_left(series, since + ran_on, key=_TS)
        for i in range(len(series) - 1, first - 1, -1):
            if not (series[i].running or series[i].waiting):
                if i < len(series) - 1:
                    break  # read as holding nothing already, and those before it too
                continue
            series[i] = replace(series[i], running=0, waiting=0)
            self._changed(series[i].ts_ns)

    def note_departure(self, connection: tuple[str, int, int], ts_ns: int, server_fins: Iterable[int] = ()) -> None:
        """A client closed (FIN or RST) ``connection`` (client address, client port, server port):
        the kernel's word, whether or not a request was joined to it yet. Counted once per
        connection (a half-close and the reset of the final close are one departure); a close
        that answers the server's own FIN (``server_fins`` on that connection just before: a
        finished response, the daemon's own scrape) is no departure while work went on."""
        if any(ts_ns - SERVER_CLOSED_FIRST_NS <= fin <= ts_ns for fin in server_fins):
            return
        seen = self._departed.pop(connection, None)
        self._departed[connection] = ts_ns  # at the end: in the order of their last close, for prune
        if seen is not None and ts_ns - seen < SAME_CONNECTION_NS:
            return
        self._changed(ts_ns)
        series = self._departures[connection[2]]
        if series and ts_ns < series[-1]:
            bisect.insort(series, ts_ns)
        else:
            series.append(ts_ns)

    def completed_departure(self, port: int, ts_ns: int) -> None:
        """The client that closed at ``ts_ns`` had its whole response (kernel order, final send,
        span end): its close is no departure an abort could be for."""
        closes = self._departures.get(port)
        if closes:
            index = bisect.bisect_left(closes, ts_ns)
            if index < len(closes) and closes[index] == ts_ns:
                del closes[index]
                self._changed(ts_ns)

    def scrapes_of(self, port: int) -> tuple[EngineLoad, ...]:
        """The scrapes of ``port`` held now, oldest first (those pruned are gone)."""
        return tuple(self._loads.get(port, ()))

    def latest(self, port: int) -> EngineLoad | None:
        """The port's newest scrape; None without one. Asked from other threads (replay's wait)."""
        series = self._loads.get(port)
        try:
            return series[-1] if series else None
        except IndexError:  # emptied by a prune in the correlator's thread meanwhile
            return None

    def watched(self, port: int) -> bool:
        return bool(self._loads.get(port))

    def scraped_after(self, port: int, ts_ns: int) -> bool:
        """Whether a scrape of the port taken after ``ts_ns`` has come."""
        series = self._loads.get(port)
        return series[-1].ts_ns > ts_ns if series else False

    def register(self, port: int, request: Hashable, disconnect_ns: int, connected_until_ns: int | None = None) -> None:
        """A disconnected request that may own orphans; ``connected_until_ns``: the connected count
        (``connected_at`` in ``work_end``) holds its server span at every scrape up to then (its
        span's end and the clock error), so no scrape before then counts it as an orphan too."""
        until = disconnect_ns - 1 if connected_until_ns is None else connected_until_ns
        key, registered = hash(request), _pair(disconnect_ns, until)
        self.racing(port, request, None)
        packed = self._disconnects[port].get(key)
        if packed == registered:
            return
        times, untils = self._disconnect_times[port], self._connected_until[port]
        if packed is not None:
            self._forget_registered(port, packed)
        self._registered_at(disconnect_ns, until)
        self._disconnects[port].pop(key, None)  # to the end: in registration order, for prune
        self._disconnects[port][key] = registered
        index = bisect.bisect_right(times, disconnect_ns)
        times.insert(index, disconnect_ns)
        untils.insert(index, until)
        ended = self._untils_sorted[port]
        ended.insert(bisect.bisect_right(ended, until), until)

    def racing(self, port: int, request: Hashable, left_until: tuple[int, int] | None) -> None:
        """``request``, a leaver that may have closed after its last byte, may have added an orphan
        (its ``held_one_more`` not answered, or untold): its client's close, and until when the
        connected count holds its span; None: it added none."""
        self._racer(port, hash(request), left_until)

    def _racer(self, port: int, key: int, left_until: tuple[int, int] | None) -> None:
        racers = self._racers.get(port)
        known = None if racers is None else racers.pop(key, None)
        if known is not None:
            left, until = _unpair(known)
            _take_one(self._racer_closes[port], left)
            _take_one(self._racer_untils[port], until)
        if left_until is not None:
            self._racers[port][key] = _pair(*left_until)
            for times, ts_ns in ((self._racer_closes[port], left_until[0]), (self._racer_untils[port], left_until[1])):
                times.insert(bisect.bisect_right(times, ts_ns), ts_ns)

    def unregister(self, port: int, request: Hashable) -> None:
        """A registered request proved complete when its client left (kernel order, final send,
        span end): its work was done, so it owns no orphan and claims none before earlier leavers."""
        self.racing(port, request, None)
        requests = self._disconnects.get(port)
        packed = None if requests is None else requests.pop(hash(request), None)
        if packed is not None:
            self._forget_registered(port, packed)

    def _forget_registered(self, port: int, packed: int) -> None:
        """Take one registration (``_pair``) out of the port's sorted times: news from its disconnect."""
        known = _unpair(packed)
        times, untils = self._disconnect_times[port], self._connected_until[port]
        index = bisect.bisect_left(times, known[0])
        while index < len(times) and times[index] == known[0] and untils[index] != known[1]:
            index += 1
        if index < len(times) and times[index] == known[0]:
            del times[index], untils[index]
            _take_one(self._untils_sorted[port], known[1])
        self._registered_at(*known)

    def running_at(self, port: int, ts_ns: int, address: str | None = None) -> int | None:
        """Requests the engine was running at ``ts_ns`` (the scrape before it), None without scrapes.
        ``address``: on a port several containers serve, the count of the engine there (None where
        that scrape has none of it)."""
        series = self._loads.get(port)
        if not series:
            return None
        index = bisect.bisect_right(series, ts_ns, key=_TS) - 1
        if index < 0:
            return None
        load = series[index]
        if address is not None and load.running_by_address is not None:
            return next((running for at, running in load.running_by_address if at == address), None)
        return load.running

    def work_end(self, port: int, disconnect_ns: int, started_ns: int,
                 connected_at: Callable[[int, int], int], connected_until_ns: int | None = None,
                 arrived: Callable[[int, int], int] | None = None, sweep: ScrapeSweep | None = None,
                 unspanned: Callable[[EngineLoad, tuple[ListedClient, ...]], int] | None = None,
                 ending: Callable[[int, int], int] | None = None) -> MetricsEnd | None:
        """When this request's work ended, as the gauges tell; None when no scrape came after it left.

        At each scrape after ``started_ns``, orphans = held - connected, where connected counts every
        request in flight at any moment the scrape's gauges may have been set (``connected_at(start,
        end)`` over ``_set_between``: as it was read, or for an engine that logs them, over its log's
        interval, so every scrape of one log reads alike). Requests that left later claim orphans
        first: an engine finishes what it started first, so a newer orphan outlives an older one. The
        work ends between the last scrape that still counted it and the next.

        Scrapes up to ``connected_until_ns`` count this request itself as connected (its server span
        had not ended, give or take the clock error), so they cannot show it orphaned: they say
        nothing of its work and are skipped.

        ``arrived(start, end)``: server spans that started after the scrape's gauges may have been set
        from (up to its answer, or its log's first showing, and the clock error). The connected count
        holds them, but the engine may not have taken them up when it read its gauges: a scrape that
        shows no orphan only because of them says neither, and is skipped too. The work then ends
        between the last scrape that counted it and the first that shows it gone whatever those requests
        were, and the resolution says how far apart those are.

        ``unspanned(load, clients)``: of the clients the kernel listed connected to the port as
        the scrape was sent (kept for ``clients_kept_ns``), how many may hold a request that no
        span or notice has told yet (an engine without live notices exports a request's spans
        when it ends). Where they could be all of a scrape's orphans, the scrape says neither and
        is skipped: a later span decides it. The scraper lists a port's clients while a client has
        just left it or a verdict reads its scrapes (``EngineMetricsScraper.want_clients``); a
        scrape it did not list within UNLISTED_AFTER_LEAVING_NS of the disconnect (before the
        daemon heard of it) says neither either. With nothing decided but such scrapes, the
        answer is ``awaiting``.

        ``ending(start, end)``: server spans that ended from when the scrape's gauges may have been set
        to ENDING_NS after that. The connected count holds them, but the engine may have finished them
        already when it read its gauges: a scrape that shows no orphan only because of them may hide
        one. Such a scrape is passed over, once (with every other scrape of its log): the next one
        decides (an orphan there again, or the end between the last scrape that counted it and that
        one).

        Leavers that may have closed after their last byte and whose own rise is not known
        (``racing``: ``held_one_more`` untold or not answered yet) are no registered leavers: read
        as owning no orphan, the likelier (a client that read its whole answer). But each that left
        after this request may own one of the orphans it is given: then its work may have ended as
        early as the last scrape that held more orphans than they could (``earliest_ns``).

        ``sweep``: the request's checkpoints (``ScrapeSweep``), kept by the caller from round to round."""
        series = self._loads.get(port, [])
        first_after = max(started_ns, connected_until_ns or started_ns)
        start = bisect.bisect_right(series, first_after, key=_TS)
        # Requests that left after this one (its own disconnect is not after itself): counted by
        # bisection, the registered requests being every disconnected one of the horizon.
        times, untils = self._disconnect_times.get(port, _NO_TIMES), self._connected_until.get(port, _NO_TIMES)
        left_before = bisect.bisect_right(times, disconnect_ns)
        # Of those that left after this one and by the scrape, the ones whose span the connected
        # count still holds there are no orphans of it: counted as both, one claimed this request's
        # orphan and ended its work early. Swept along the scrapes (their times only grow): when
        # each such one stops being connected, as a heap of those "until"s.
        still_connected: list[int] = []
        taken = left_before
        last_orphaned: int | None = None
        count, unsure = 0, 0
        masked = False  # a scrape with no orphan that ``ending`` may explain was passed over
        masked_from = 0  # when that scrape's gauges may have been set from
        # The racers that left after this request (their "until"s, sorted), and the last scrape
        # orphaned even had each of them that was no longer connected there left an orphan.
        # A racer closes within SPAN_END_RACE_NS of its span's end, so one that left by this request's
        # disconnect is no longer connected at any scrape the sweep reads: each count of those
        # gone by a scrape less those that left by the disconnect is of the later ones.
        racers = self._racer_untils.get(port, _NO_TIMES)
        racers_before = bisect.bisect_right(self._racer_closes.get(port, _NO_TIMES), disconnect_ns)
        last_sure: int | None = None
        # The clients the kernel listed at the port's scrapes; a port never listed (sock_diag
        # refused) is read against the spans alone.
        listed = self._clients.get(port) if unspanned is not None else None
        found = sweep.resume((port, disconnect_ns, first_after)) if sweep is not None else None
        if found is not None:  # on from the checkpoint: what the sweep held after that scrape
            swept_ns, (held, last_orphaned, count, last_sure) = found
            still_connected = list(held)
            start = bisect.bisect_right(series, swept_ns, key=_TS)
            taken = max(left_before, bisect.bisect_right(times, swept_ns))

        def earliest() -> int | None:
            return None if last_sure == last_orphaned else last_sure or max(started_ns, disconnect_ns)

        for load in series[start:]:
            # When its gauges were set: as it was read, or at its log (LOGGED_STYLES), which may
            # predate the scrape by a whole interval. A log that may have come before the request
            # left (or while its span still counted it) says nothing of its work after.
            read_from, read_end = self._set_between(port, load)
            if read_from < first_after:
                continue
            left_by_then = bisect.bisect_right(times, load.ts_ns)
            for index in range(taken, left_by_then):
                heapq.heappush(still_connected, untils[index])
            taken = max(taken, left_by_then)
            while still_connected and still_connected[0] < read_from:
                heapq.heappop(still_connected)
            newer = max(0, left_by_then - left_before - len(still_connected))
            orphans = load.running + load.waiting - connected_at(read_from, read_end)
            if orphans > newer:
                owned = orphans  # of which the later leavers own one each, and this request one
                if listed is not None and unspanned is not None:
                    clients = self._listing(listed, port, load.ts_ns, disconnect_ns)
                    if clients is _UNLISTED:  # undecided only before the daemon heard of the disconnect
                        undecided = load.ts_ns - disconnect_ns <= UNLISTED_AFTER_LEAVING_NS
                    elif clients is None:  # a listing a client may be missing from says nothing either
                        undecided = True
                    else:
                        owned = orphans - unspanned(load, clients)
                        undecided = owned <= newer
                    if undecided:
                        unsure = load.ts_ns  # requests whose spans have not come may be what it holds
                        continue
                masked = False  # it held the work after all: the scrape passed over hid the orphan
                last_orphaned, count = load.ts_ns, count + 1
                if owned > newer + max(0, bisect.bisect_left(racers, read_from) - racers_before):
                    last_sure = load.ts_ns
                if sweep is not None and not unsure:  # a checkpoint past an undecided scrape would skip it
                    sweep.mark(load.ts_ns, (tuple(still_connected), last_orphaned, count, last_sure))
                continue
            if arrived is not None and orphans + arrived(read_from, read_end) > newer:
                if sweep is not None and not unsure and not masked:
                    sweep.mark(load.ts_ns, (tuple(still_connected), last_orphaned, count, last_sure))
                continue
            if ending is not None and orphans + ending(read_from, read_end) > newer \
                    and (not masked or (load.style in LOGGED_STYLES and read_from == masked_from)):
                masked, masked_from = True, read_from  # passed over (each scrape of its log): the next says
                continue
            answered = load.answered_ns or load.ts_ns
            read_until = max(load.ts_ns, answered)
            if last_orphaned is None:
                return MetricsEnd(max(started_ns, disconnect_ns), (load.ts_ns - started_ns) / 1e9, 0, read_until,
                                  unsure_until_ns=unsure or None, gone_by_ns=load.ts_ns)
            return MetricsEnd((last_orphaned + load.ts_ns) // 2, (load.ts_ns - last_orphaned) / 1e9, count,
                              read_until, unsure_until_ns=unsure or None, earliest_ns=earliest(),
                              held_at_ns=last_orphaned, gone_by_ns=load.ts_ns)
        if last_orphaned is None:
            return MetricsEnd(None, 0.0, 0, awaiting=True) if unsure else None
        return MetricsEnd(None, 0.0, count, earliest_ns=earliest())

    def orphans_past(self, port: int, grace_ns: int, read_by_ns: int, *, history: bool = False) -> tuple[int, int] | None:
        """How many requests the engine on ``port`` ran whose clients had left more than
        ``grace_ns`` before, at its latest scrape answered by ``read_by_ns`` with the clients
        connected listed completely (and the scrape's time); None without such a scrape in the last
        ORPHANS_STALE_NS. Told by the port alone, before any span or notice says whose they are: an
        engine that exports its spans every few seconds (vLLM), or a request whose span ends only
        with its work, is alarmed about from its gauges and the kernel.

        running - the clients listed connected - the clients that left from ``grace_ns`` before
        the scrape (before its log, where the engine logs its gauges: ``_shown_since``) to its
        answer (and a polled close's slack) - the orphans known to have ended
        since the scrape (``work_ended``: without them the count would hold a zombie settled by its
        span until the port is listed again, up to ORPHANS_STALE_NS). Each client connected holds
        at most one request (HTTP/1.1, as the engines serve it), and a listing no client was
        accepted during (``connections_complete``) misses none that the gauges count. Running
        only: a request that waits in the queue costs nothing yet (DESIGN §5), and is counted once
        it runs. A lower bound: a kept-alive client until the kernel says it was answered and
        quiet since (the listers leave it out then: ``probes.sockdiag.IDLE_QUIET_MS``), a waiting
        request's client, a scraper's connection, a close that answered nothing, each counts
        against it. It assumes that every request the engine holds came over this port.

        ``history``: the count as it was at that scrape, for the record of orphaned work
        (``auditor.correlate.orphans``): work known to have ended after the scrape was still
        running then, so it is not taken off."""
        listed = self._clients.get(port)
        if not listed:
            return None
        for ts_ns in reversed(listed):
            if ts_ns < read_by_ns - ORPHANS_STALE_NS:
                return None
            clients, load = listed[ts_ns], self._scrape_at(port, ts_ns)
            if clients is None or load is None:
                continue
            answered = load.answered_ns or load.ts_ns
            if answered > read_by_ns:
                continue
            closes = self._departures.get(port, _NO_TIMES)
            recent = bisect.bisect_right(closes, answered + ORPHANS_CLOSE_SLACK_NS) \
                - bisect.bisect_right(closes, self._shown_since(port, load) - grace_ns - CLOCK_ERROR_NS)
            ended = 0 if history else self._ended_since(port, load.ts_ns, grace_ns)
            return max(0, load.running - len(clients) - recent - ended), load.ts_ns
        return None

    def work_ended(self, port: int, request: str, left_ns: int, ended_ns: int, grace_ns: int) -> None:
        """``request``'s work on ``port``, whose client left at ``left_ns``, ended at ``ended_ns``
        (told by its span or notice): an orphan that a scrape before ``ended_ns`` counted and that
        the port's count no longer holds, though no scrape listed since says so. Only work that
        outlived its client by the grace can have been counted."""
        if ended_ns - left_ns <= grace_ns - CLOCK_ERROR_NS:
            return
        ended = self._ended.setdefault(port, {})
        ended[request] = (left_ns, ended_ns)
        if len(ended) > self._ended_room.get(port, 64):  # pruned as it doubles: each end costs O(1)
            forget = ended_ns - ORPHANS_STALE_NS - ORPHANS_SETTLE_NS - CLOCK_ERROR_NS
            for old in [r for r, (_, end) in ended.items() if end < forget]:
                del ended[old]
            self._ended_room[port] = max(64, 2 * len(ended))

    def _ended_since(self, port: int, ts_ns: int, grace_ns: int) -> int:
        """Of the orphans the port's scrape at ``ts_ns`` may have counted (clients gone past the
        grace, within the clock's error), how many are known to have ended since. Ends older than
        any scrape still read stay until ``work_ended`` prunes them: ``end > ts_ns`` passes them by."""
        ended = self._ended.get(port)
        if not ended:
            return 0
        return sum(1 for left, end in ended.values() if end > ts_ns and left <= ts_ns - grace_ns + CLOCK_ERROR_NS)

    def held_beyond_listed(self, port: int) -> tuple[int, int | None] | None:
        """The port's latest listed scrape: when it was answered, and how many requests it ran
        beyond the clients listed connected (None: listed incompletely), where that is more than
        none: orphans, maybe within their grace, that the coming scrapes must list again. None
        otherwise."""
        listed = self._clients.get(port)
        if not listed:
            return None
        ts_ns = next(reversed(listed))
        clients, load = listed[ts_ns], self._scrape_at(port, ts_ns)
        if load is None:
            return None
        answered = load.answered_ns or load.ts_ns
        if clients is None:
            return answered, None
        excess = load.running - len(clients)
        return (answered, excess) if excess > 0 else None

    def listed_ports(self) -> list[int]:
        return list(self._clients)

    def _shown_since(self, port: int, load: EngineLoad) -> int:
        """The earliest moment ``load``'s gauges may show: its own, but for an engine that sets
        them when it logs a batch (LOGGED_STYLES), the scrape before the first that showed its log."""
        if load.style not in LOGGED_STYLES:
            return load.ts_ns
        series, index = self._first_showing(port, load)
        return series[index - 1].ts_ns if index > 0 else load.ts_ns

    def _first_showing(self, port: int, load: EngineLoad) -> tuple[list[EngineLoad], int]:
        """The port's scrapes and the index of the first that showed ``load``'s log."""
        series = self._loads.get(port, [])
        index = bisect.bisect_left(series, load.ts_ns, key=_TS)
        while index > 0 and series[index - 1].step_tokens == load.step_tokens:
            index -= 1
        return series, index

    def _set_between(self, port: int, load: EngineLoad) -> tuple[int, int]:
        """When the gauges ``load`` shows were set: as it was read (sent to answered), but for an
        engine that sets them when it logs a batch (LOGGED_STYLES), at its log, between the scrape
        before the first that showed it and that first one. Read as it was read, such gauges hold
        requests that completed and closed since the log: behind a proxy that closes each upstream
        connection as its answer ends, each was one orphan more, and completed requests were judged
        zombies (bench/behind_nginx.py on SGLang's cadence: 7 of 90); read so by ``work_end``, requests
        that arrived after the log were counted connected and not held, and a running orphan
        vanished between two scrapes of one log (zombies judged aborted). ``held_one_more`` reads its
        later scrapes so, and the one it compares with from that one's interval on."""
        if load.style not in LOGGED_STYLES:
            return load.ts_ns, load.answered_ns or load.ts_ns
        series, index = self._first_showing(port, load)
        first = series[index] if index < len(series) else load
        return (series[index - 1].ts_ns if index > 0 else first.ts_ns), first.answered_ns or first.ts_ns

    def _scrape_at(self, port: int, ts_ns: int) -> EngineLoad | None:
        """The port's scrape taken at ``ts_ns`` (a listing's key), None where it is no longer kept."""
        series = self._loads.get(port, [])
        index = bisect.bisect_left(series, ts_ns, key=_TS)
        return series[index] if index < len(series) and series[index].ts_ns == ts_ns else None

    def held_one_more(self, port: int, request: Hashable, disconnect_ns: int, span_start_ns: int,
                      connected_until_ns: int, connected_at: Callable[[int, int], int], arrived: Callable[[int, int], int],
                      unspanned: Callable[[EngineLoad, tuple[ListedClient, ...], int | None], int],
                      no_within_ns: int, spans_ended: Callable[[int, int], int] | None = None,
                      ) -> tuple[bool | None, tuple[int, int] | None] | None:
        """Whether the engine held one more request once this one's client had left than before:
        the orphans (held - connected) at the first scrape that no longer counts it connected, less
        those at the one before the last that did (or that came before its span began), above the
        registered requests whose spans ended in between (each may have become an orphan there).
        With the answer, the first and last scrapes compared; None while no scrape after it that
        says has come; an answer of None where none said within HELD_ONE_MORE_WINDOW_NS (its
        verdict cannot tell). With no scrape from before it left (the daemon started since), there
        is nothing to compare: (True, None), and it is read like any leaver. ``span_start_ns``:
        when its server span began.

        ``work_end`` gives orphans to the latest leaver first, which is right when every leaver
        left its work running. A client that closed as its response ended, its span ending with
        the close, would take there the orphans of requests that left earlier and run on, and
        their work would seem to stop when it left. Where a request may be such a client, this
        says whether its leaving added an orphan at all.

        Yes where the rise is more than the others can make; no where, even had every orphan of
        the first scrape ended by the second, the count did not rise: an orphan that ended in
        between and one this request added leave the count as it was, and the two cannot be told
        apart (so an engine running earlier leavers' work on never answers no). A no says its work
        was not running at the second scrape: only within ``no_within_ns`` of the disconnect (the
        grace) does that make it stopped at once.

        Clients the kernel listed at the second scrape whose requests no span tells yet
        (``unspanned``, with when each was last read) do not count as its orphans, nor, where read
        before the first scrape compared, as those of the earlier ones (held there too). Requests
        that arrived as either scrape was read (``arrived``: counted connected, maybe not held yet)
        may each be an orphan there or not: a yes holds with all of them orphans at the first and
        none at the second, a no with none at the first and all at the second; between the two
        the second scrape says nothing. Untold clients read in between count at neither (errs
        toward no). A second scrape that says nothing (that, not listed soon after the disconnect,
        or listed incompletely) is passed over for the next, up to HELD_ONE_MORE_WINDOW_NS after
        the span's end.

        ``spans_ended(start, end)``: server spans that ended then. A logged scrape is read against the
        requests connected at any moment of its log's interval, and each that ended in it may have
        ended before the log, so be missing from its gauges and hide an orphan: a no holds only
        with every one of them an orphan too."""
        series = self._loads.get(port, [])
        after = bisect.bisect_right(series, connected_until_ns, key=_TS)
        if after == 0:
            return True, None
        # Compared with the scrape before the last that counted it connected (or that came before its
        # span began): a response finishes before its last byte is sent, so the last may have
        # counted its span but no longer its work (one orphan too few), where the one before still
        # held it. A scrape read as its span began says nothing of it (counted connected, held or
        # not yet): the one before it is taken.
        def read_as_it_began(load: EngineLoad) -> bool:
            return load.ts_ns < span_start_ns <= (load.answered_ns or load.ts_ns) + CLOCK_ERROR_NS

        index = after - 2 if after >= 2 else after - 1
        if read_as_it_began(series[index]):
            index -= 1
        # An engine that logs its gauges (LOGGED_STYLES) shows there what it held at its log, any
        # time from the scrape before the first that showed it on: where this request may have
        # arrived after that log, the scrape counts it connected but its gauges may not hold it
        # (a request waiting for a batch slot is logged only at the next decode log). The scrape
        # before that log's first showing is taken, until one read before the request began or
        # whose log came after it (or the first kept: nothing earlier says more).
        while index >= 0 and series[index].style in LOGGED_STYLES:
            load = series[index]
            if span_start_ns > (load.answered_ns or load.ts_ns) + CLOCK_ERROR_NS:
                break
            if read_as_it_began(load):
                index -= 1
                continue
            _, first = self._first_showing(port, load)
            if first == 0 or span_start_ns <= series[first - 1].ts_ns - CLOCK_ERROR_NS:
                break
            index = first - 1
        if index < 0:
            return True, None
        before = series[index]
        before_end = before.answered_ns or before.ts_ns
        base = before.running + before.waiting - connected_at(before.ts_ns, before_end)
        # From when its gauges may have been set: requests that arrived since may be in them or
        # not (counted connected as it was read), and requests whose spans ended since may have
        # left their work in the later scrapes' gauges without being in its own.
        since = self._set_between(port, before)[0]
        base_arrived = arrived(since, before_end)
        listed = self._clients.get(port)
        ended = self._untils_sorted.get(port, _NO_TIMES)
        own = hash(request)
        packed = self._disconnects.get(port, {}).get(own)
        own_until = None if packed is None else _unpair(packed)[1]
        racers = self._racers.get(port)
        racer_untils = self._racer_untils.get(port, _NO_TIMES)  # counted by bisection, as ``work_end`` does
        racing = None if racers is None else racers.get(own)
        own_racing = None if racing is None else _unpair(racing)[1]
        # An engine that sets its gauges when it logs a batch (SGLang, every 40 decode steps) shows,
        # until its next log, what it held at its last: a request it finished before the client
        # left is still in them. The log the first scrape after the close shows may have come
        # before the close too (any time since the scrape before): only a later log, after a
        # scrape that came after the close, says what it held after.
        logged_before: tuple[float | None, ...] = ()
        if series[after - 1].style in LOGGED_STYLES and after < len(series):
            logged_before = (series[after - 1].step_tokens, series[after].step_tokens)
        for load in series[after:]:
            if load.ts_ns - connected_until_ns > HELD_ONE_MORE_WINDOW_NS:
                return None, (since, load.ts_ns)
            if load.step_tokens in logged_before:
                continue
            load_from, load_end = self._set_between(port, load)
            orphans = load.running + load.waiting - connected_at(load_from, load_end)
            held_before = base
            if listed is not None:
                clients = self._listing(listed, port, load.ts_ns, disconnect_ns)
                if clients is _UNLISTED:
                    if load.ts_ns - disconnect_ns <= UNLISTED_AFTER_LEAVING_NS:
                        continue
                elif clients is None:
                    continue
                else:  # untold there, and where read before the scrape compared with, untold there too
                    orphans -= unspanned(load, clients, None)
                    held_before -= unspanned(load, clients, before.ts_ns)
            others = bisect.bisect_left(ended, load.ts_ns) - bisect.bisect_left(ended, since)
            if own_until is not None and since <= own_until < load.ts_ns:
                others -= 1
            if racers:  # others that may have closed after their last byte, their own rise unknown
                others += bisect.bisect_left(racer_untils, load.ts_ns) - bisect.bisect_left(racer_untils, since)
                if own_racing is not None and since <= own_racing < load.ts_ns:
                    others -= 1
            # Each registered other may have added one; each orphan of the first scrape may have ended.
            least_rise = orphans - (held_before + base_arrived)
            most_rise = orphans + arrived(load_from, load_end) - held_before
            may_have_ended = max(0, held_before + base_arrived)  # the first scrape's orphans, at most
            if spans_ended is not None and load.style in LOGGED_STYLES:
                most_rise += spans_ended(load_from, load_end)
            if least_rise > others:
                return True, (since, load.ts_ns)
            if load.ts_ns - disconnect_ns <= no_within_ns and most_rise + may_have_ended <= 0:
                return False, (since, load.ts_ns)
        return None

    def read_until(self, port: int, answered_ns: int) -> int | None:
        """The latest scrape ``aborts_cover`` reads for a request answered at ``answered_ns`` (the
        second after it), None while it has not come: until then a new scrape may change the answer."""
        series = self._loads.get(port, [])
        after = bisect.bisect_left(series, answered_ns, key=_TS)
        if after + 1 >= len(series):
            return None
        last = series[after + 1]
        return max(last.ts_ns, last.answered_ns or last.ts_ns)

    def no_finish_while(self, port: int, route: str | None, start_ns: int, end_ns: int) -> tuple[bool, int] | None:
        """Whether the engine's finish counter stood still over a request's whole life: from a
        scrape answered before its server span began (``start_ns``) to the first read
        FINISH_COUNT_LAG_NS after it ended (``end_ns``), every scrape between reading the same
        count, on a port whose engine has been seen to count, for a ``route`` it counts the requests
        of (``COUNTED_ROUTES``). An engine counts a request it
        finished normally as it hands its last token over, so a request that completed would have
        moved it; one whose client closed as its span ended was then no complete answer. With the
        answer, when the last scrape it read was answered (the verdict waits for it); None while
        that scrape has not come. A count that moved (another request finished, or this one), or
        nothing to compare: (False, 0)."""
        series = self._loads.get(port, [])
        if port not in self._counts_finishes or not series or route not in COUNTED_ROUTES.get(series[-1].style, ()):
            return False, 0
        before = _answered_before(series, start_ns - CLOCK_ERROR_NS)  # not one read as the request began
        after = bisect.bisect_right(series, end_ns + FINISH_COUNT_LAG_NS, key=_TS)
        if before < 0:
            return False, 0
        if after >= len(series):
            return None
        counts = {load.finished for load in series[before:after + 1]}
        if len(counts) != 1 or None in counts:
            return False, 0
        last = series[after]
        return True, last.answered_ns or last.ts_ns

    def aborts_cover(self, port: int, disconnect_ns: int, answered_ns: int,
                     connected_at: Callable[[int, int], int]) -> bool:
        """Whether the engine's abort counter rose, between the scrape before ``disconnect_ns`` and
        one of the two after ``answered_ns`` (the server's answer to the disconnect; the engine may
        abort a step later), by at least the number of clients that closed a connection to
        ``port`` from one scrape earlier to then (``note_departure``): each of them was aborted.
        Fewer aborts than departures cannot say which were, and say nothing; nor can a rise while
        the engine still held orphans at the scrape before (an abort that came late for an earlier
        departure)."""
        series = self._loads.get(port, [])
        before = bisect.bisect_right(series, disconnect_ns, key=_TS) - 1
        after = bisect.bisect_left(series, answered_ns, key=_TS)
        if before < 0:
            return False
        first, aborted_before = series[before], series[before].aborted
        if aborted_before is None or first.running + first.waiting > connected_at(
                first.ts_ns, first.answered_ns or first.ts_ns):
            return False
        since = series[before - 1].ts_ns if before > 0 else first.ts_ns - ABORT_LOOKBACK_NS
        closes = self._departures.get(port, _NO_TIMES)
        for last in series[after:after + 2]:
            left = bisect.bisect_right(closes, last.ts_ns) - bisect.bisect_right(closes, since)
            if last.aborted is not None and left > 0 and last.aborted - aborted_before >= left:
                return True
        return False

    def no_abort_while(self, port: int, disconnect_ns: int, answered_ns: int) -> bool:
        """Whether the engine's abort counter stood still from the last scrape answered before
        ``disconnect_ns`` to the second after ``answered_ns`` (the server's answer to the close;
        ``aborts_cover`` reads the same two), every scrape between reading the same count: the
        engine aborted nothing then, so the request's work, gone by those scrapes, ended as the
        engine finished it, not because its client left. (An engine that counts aborts, SGLang and
        TGI, counts one for every request whose client left while it ran.) False where the two
        scrapes after have not come, or any of them read no count, or the port's count has never
        been seen to rise (vLLM's stays 0 whatever its clients do)."""
        if port not in self._counts_aborts:
            return False
        series = self._loads.get(port, [])
        before = _answered_before(series, disconnect_ns)  # not one read after the close: it may hold the abort
        after = bisect.bisect_left(series, answered_ns, key=_TS)
        if before < 0 or after + 1 >= len(series):
            return False
        counts = {load.aborted for load in series[before:after + 2]}
        return len(counts) == 1 and None not in counts

    def finishes_cover(self, port: int, disconnect_ns: int, end_ns: int,
                       ended: Callable[[int, int], Sequence[int]]) -> bool:
        """Whether the engine's finish counter rose, from the last scrape answered before
        ``disconnect_ns`` to the first sent after it, by at least the number of server spans on
        ``port`` (``ended(after, until)``: how long each lasted) that ended from the first of them
        to the later of the second and the request's span end ``end_ns``, and as long again as that
        span ended after the close (the server's delay, which another request that finished in the
        window may have had too): each of them, this request among them, was then finished
        normally. An engine counts a finish when it hands the last token over, before the server
        writes the last byte and so before a client that read it closes: a scrape answered between
        the two already holds it, so the rise is read from the scrape before that one too (a window
        one scrape longer, with the ends in it). Fewer finishes than ends say nothing: one of them
        may be this one's, or another's. A count of tokens (llama.cpp's) says some request
        finished: this one where it was the only one that ended; where several did, each finished
        only if the engine's count of their generation time rose by more than the lengths of all
        of them but the shortest (each adds at most its own span's length, so fewer could not have
        added so much) and its tokens by at least one each. On a port whose count has been seen to
        rise."""
        if port not in self._counts_finishes:
            return False
        series = self._loads.get(port, [])
        after = bisect.bisect_left(series, disconnect_ns, key=_TS)  # the first sent after the close
        before = _answered_before(series, disconnect_ns)
        if before < 0 or after >= len(series):
            return False
        last, delay = series[after], max(0, end_ns - disconnect_ns)
        for first in (series[index] for index in (before, before - 1) if index >= 0):
            if first.finished is None or last.finished is None or last.finished <= first.finished:
                continue
            lengths = ended(first.answered_ns or first.ts_ns, max(last.answered_ns or last.ts_ns, end_ns) + delay)
            if first.style not in FINISHES_COUNTED_IN_TOKENS:
                if 0 < len(lengths) <= last.finished - first.finished:
                    return True
            elif len(lengths) == 1 or _each_generated(first, last, lengths):
                return True
        return False

    def prune(self, cutoff_ns: int, closes_cutoff_ns: int | None = None) -> None:
        closes_cutoff_ns = cutoff_ns if closes_cutoff_ns is None else max(cutoff_ns, closes_cutoff_ns)
        for port, racers in list(self._racers.items()):  # asked of only near their own close
            for key in [key for key, packed in racers.items() if _unpair(packed)[1] < closes_cutoff_ns]:
                self._racer(port, key, None)
            if not racers:
                del self._racers[port], self._racer_untils[port], self._racer_closes[port]
        for port, series in list(self._loads.items()):
            keep = bisect.bisect_left(series, cutoff_ns, key=_TS)
            del series[:keep]
            if not series:
                del self._loads[port]
                self._clients.pop(port, None)
                self._busy_listings.pop(port, None)
                self._busy_clients.pop(port, None)
                self._still_since.pop(port, None)
                self._log_gaps.pop(port, None)
                self._models.pop(port, None)
        # Registrations and last closes go from the first made up to the first kept: they are made in
        # about time order, and a pass then touches only what it forgets.
        for port, requests in list(self._disconnects.items()):
            drop_front(requests, lambda registered: _unpair(registered)[0] < cutoff_ns)
            times, untils = self._disconnect_times[port], self._connected_until[port]
            gone = bisect.bisect_left(times, cutoff_ns)
            ended = self._untils_sorted[port]
            for until in untils[:gone]:
                _take_one(ended, until)
            del times[:gone], untils[:gone]
            if not requests:
                del self._disconnects[port], self._disconnect_times[port], self._connected_until[port]
                del self._untils_sorted[port]
        # A connection's last close matters for SAME_CONNECTION_NS only: kept from ``closes_cutoff_ns``.
        drop_front(self._departed, lambda last_close: last_close < closes_cutoff_ns)
        for port, closes in list(self._departures.items()):
            del closes[:bisect.bisect_left(closes, cutoff_ns)]
            if not closes:
                del self._departures[port]
