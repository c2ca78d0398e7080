"""One request's verdict from the evidence gathered so far, and the record of which evidence decided it.

Kept apart from the joins (``correlator``): the joins decide *which* request a disconnect belongs
to, this decides *what became of it*. Evidence, best first (DESIGN §5): the engine span, live
notices, the engine's own /metrics, and for completion what the server had sent. Each verdict's
``details`` says which decided it (``evidence``) and how exact its work end is (``work_end_exact``:
``span``, ``live``, ``scrape`` with ``work_end_resolution_s``, or ``none``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from auditor.correlate import evidence as ev
from auditor.correlate.requests import OpenRequest
from auditor.correlate.traces import span_tuple
from auditor.correlate.verdict import (
    CLOCK_ERROR_NS,
    Evidence,
    decide,
    inflight_from,
    never_ran,
    phase_at,
    tokens_after_disconnect,
)
from auditor.correlate.waste import PARTIAL_MIN_NS, PartialCost, running_part, sharers_at, wasted
from auditor.model import RequestVerdict, SpanRecord, SpanRole, Verdict
from auditor.semconv import MAX_USER_AGENT, SENDER_KEY, USER_AGENT_KEYS, engine_of

if TYPE_CHECKING:
    from auditor.correlate.correlator import Correlator

ENGINE_SETTLE_AFTER_LIVE_END_NS = 2_000_000_000
# A server span that ended this soon after the client's close may have ended with a response the
# client had read whole: a busy server ends its span milliseconds after the last byte left (2-7 ms
# at full CPU: bench/detection.py --weak-load --load-behavior detached --load-tokens 300), as a
# server that hears of a disconnect does. Such a request owns orphans only if its leaving added one.
SPAN_END_RACE_NS = 10_000_000
# A verdict whose only change is its lag (an in-flight zombie's grows every round) is no change.
_COMPARED = tuple(name for name in RequestVerdict.__dataclass_fields__ if name != "lag_seconds")


def evaluate(corr: Correlator, request: OpenRequest, now: int) -> RequestVerdict | None:
    """The request's verdict now, or None when it is too early or nothing changed."""
    origin = request.origin()
    trace_id, root_id = request.key
    root = corr.spans.get(trace_id, root_id)
    subtree = corr.spans.subtree(root) if root else []
    http_spans = [s for s in subtree if s.role is SpanRole.HTTP_SERVER]
    origin_span = next((s for s in http_spans if span_tuple(s) == origin.tuple4), None) or next(
        (s for s in http_spans if not s.peer_port and s.server_port == origin.tuple4[2]), None)  # peerless
    engine = corr.spans.engine_for(root, subtree) if root else None
    details: dict[str, Any] = {"engine_span": engine is not None}
    racing = _may_have_answered(corr, origin.ts_ns, origin_span, subtree)
    work_end, provisional, known = _work_end(corr, request, root, subtree, engine, now, details, racing)
    started = origin_span.start_ns if origin_span and origin_span.start_ns > origin.ts_ns else None
    # An engine span without a finish reason (a configured name) cannot say the response was complete.
    completed = None if engine and engine.finish_reason else ev.completed_by(
        origin.ts_ns, origin_span, subtree, corr.local_fins(origin.tuple4), CLOCK_ERROR_NS, origin.earliest_ns)
    # Without the engine's span (one of its own trace, no request id to join it by), the engine's
    # end notice: done by the time the client left (within the clock's error), a normal finish is
    # a complete response, as the span's would be. With its finish untold, that end is no abort the
    # close caused, nor known to be a complete answer: unconfirmed (below). The engine tells its end
    # after it handed the last token over, and a client that read it and closed at once can be first
    # by milliseconds on a busy host: where nothing marks the server's sends, an end told up to
    # SPAN_END_RACE_NS after the close reads as one told before it.
    untold_done = False
    if engine is None and details.get("evidence") == ev.LIVE_NOTICE:
        live_end = corr.live.engine_end(trace_id)
        as_it_left = live_end is not None and (
            live_end <= origin.ts_ns + CLOCK_ERROR_NS
            or (live_end - origin.ts_ns <= SPAN_END_RACE_NS and _sends_unmarked(corr, origin.ts_ns, origin_span, subtree)))
        if as_it_left:
            told_normal = corr.live.engine_finished_normally(trace_id)
            if told_normal and completed is None:
                completed = ev.LIVE_NOTICE
            untold_done = told_normal is None
    if completed is not None:
        corr.loads.completed_departure(origin.tuple4[2], origin.ts_ns)
        hop = _scraped_hop(corr, subtree)
        if hop is not None:  # registered by _metrics_work_end, as it may own orphans: a done request owns none
            corr.loads.unregister(hop.server_port or 0, request.key)
    if details.pop("awaiting", False) and completed is None:
        # No scrape since it left has come yet, or the gauges' orphans may be requests still
        # running whose spans have not come: the next round reads what has come by then. (A round
        # of its own as its grace ends cost the correlator a sixth more at 100 requests/s, for
        # alarms 0.01-0.06 s sooner at the median: docs/footprint.md, fifty-first pass.)
        return None
    if known and completed is None and racing and origin_span is not None \
            and (origin_span.end_ns - origin.ts_ns <= CLOCK_ERROR_NS or details.get("leaving_untold")
                 or origin.kind == "fin") \
            and details.get("orphaned_scrapes") == 0 and not details.get("aborts_counted") \
            and not details.get("no_finish_counted"):
        # The span ended as the client closed, and the gauges never saw the request held after:
        # a client closing after the last byte and a server reacting at once look the same. Nor
        # can one whose leaving the scrapes could not tell (a host too busy for a whole listing).
        # A FIN is how a client that read the whole response closes: a server that ends the span a
        # few milliseconds after it (a loaded host's event loop) may have been done before it.
        # Unless the engine counted its aborts, or counted no normal finish while it ran.
        known, details["close_races_span_end"] = False, True
    if known and completed is None and untold_done:
        known, details["engine_done_as_client_left"] = False, True
    if known and completed is None and (details.get("no_abort_counted") or details.get("finish_counted")):
        # Gone by the next scrapes, and the engine aborted none (it counts every request it aborts)
        # or counted it finished normally: it finished the work. Whether the answer was whole when
        # the client left, nothing says: a loaded server ends its span well after the last byte
        # (its event loop held by other work), and the client's close after reading it all then
        # looks like a cancel the server reacted to.
        known = False
    decision = decide(Evidence(origin.ts_ns, origin_span, engine, work_end, now, started_ns=started,
                               completed_by=completed, work_stopped_known=known), corr.grace_seconds)
    if decision is None:
        if work_end is None:  # still running, inside its grace: the alarm is due when the grace ends
            corr.alarm_at(inflight_from(origin.ts_ns, corr.grace_seconds))
        return None
    if completed is not None:
        details["evidence"], provisional = completed, False
    if decision.verdict is Verdict.UNCONFIRMED:
        details["evidence"], details["work_end_exact"] = ev.HTTP_ONLY, "none"
        details["unconfirmed_because"] = _unconfirmed_because(corr, subtree, details)
        for told in ("work_end_resolution_s", "lag_at_least_s"):  # of an end nothing tells
            details.pop(told, None)
    details["provisional"] = provisional
    if started is not None:
        details["waited_unread_s"] = round((started - origin.ts_ns) / 1e9, 6)
        if "lag_at_least_s" in details:  # the lag counts from when the server read it
            details["lag_at_least_s"] = round(max(0.0, details["lag_at_least_s"] - (started - origin.ts_ns) / 1e9), 3)
    base = root or (request.live_span.as_span() if request.live_span else None)
    tokens, exact = tokens_after_disconnect(origin.ts_ns, engine)
    gpu_s = cpu_s = 0.0
    if decision.verdict not in (Verdict.COMPLETED, Verdict.UNCONFIRMED) and not never_ran(engine):
        gpu_s, cpu_s = _waste(corr, request, origin, started, work_end or now, engine, base, details)
    _add_hops(request, origin, http_spans, origin_span, details)
    verdict = RequestVerdict(
        request_key=f"{corr.host}/{trace_id}/{root_id}", host=corr.host, verdict=decision.verdict,
        disconnect_at_ns=origin.ts_ns, disconnect_kind=origin.kind,
        request_start_ns=base.start_ns if base else origin.ts_ns, work_end_ns=work_end,
        lag_seconds=decision.lag_seconds, phase=phase_at(origin.ts_ns, engine), trace_id=trace_id,
        request_id=(origin_span.request_id if origin_span else None) or (engine.request_id if engine else None),
        service=base.service if base else None, route=base.route if base else None,
        model=(engine.model if engine else None) or (base.model if base else None)
        or corr.loads.model_of(origin.tuple4[2]),  # vLLM's llm_request names none: its gauges do
        client_addr=origin.tuple4[0], client_port=origin.tuple4[1], user_agent=_user_agent(base, origin_span),
        server_port=origin.tuple4[2],
        max_tokens=engine.max_tokens if engine else (origin_span.max_tokens if origin_span else None),
        tokens_after_disconnect=tokens, tokens_exact=exact, wasted_gpu_seconds=gpu_s,
        wasted_cpu_seconds=cpu_s, details=details,
    )
    written = request.written
    unchanged = written is not None and all(getattr(written, name) == getattr(verdict, name) for name in _COMPARED)
    if unchanged and decision.verdict is not Verdict.INFLIGHT_ZOMBIE:
        return None
    return verdict


def _user_agent(*spans: SpanRecord | None) -> str | None:
    """The client's User-Agent as the first of ``spans`` that names one tells it (the request's
    outermost server span, then the one its connection joined), cut to what the store keeps."""
    for span in spans:
        if span is not None:
            for key in USER_AGENT_KEYS:
                value = span.attributes.get(key)
                if isinstance(value, str) and value:
                    return value[:MAX_USER_AGENT]
    return None


def _may_have_answered(corr: Correlator, disconnect_ns: int, origin_span: SpanRecord | None,
                       subtree: list[SpanRecord]) -> bool:
    """The server read the request before the client closed and its span ended as the client
    closed (within SPAN_END_RACE_NS): a client closing after the last byte and a server reacting
    at once look the same, unless the server records its sends (then no final send means not
    complete) or its engine spans every normal finish (then a missing engine span means not
    complete). The gauges, or the engine's abort counter rising by as many as the clients that
    left, may still tell. After a FIN (how a client that read it all closes), or within the clock
    error, gauges that never held it after leave it unconfirmed; after a reset, later, they say it
    was aborted (the server heard of the close), unless no scrape could tell whether its leaving
    added an orphan (unconfirmed too)."""
    return origin_span is not None and origin_span.end_ns - disconnect_ns <= SPAN_END_RACE_NS \
        and _sends_unmarked(corr, disconnect_ns, origin_span, subtree)


def _sends_unmarked(corr: Correlator, disconnect_ns: int, origin_span: SpanRecord | None,
                    subtree: list[SpanRecord]) -> bool:
    """The server read the request before the client closed, and neither its sends nor its engine's
    normal finishes are recorded: nothing tells whether the client had the whole response."""
    if origin_span is None or origin_span.start_ns > disconnect_ns:
        return False
    sends = origin_span.service in corr.services_marking_sends or any(
        s.parent_span_id == origin_span.span_id and ev.FINAL_SEND_ATTR in s.attributes for s in subtree)
    return not sends and origin_span.service not in corr.services_spanning_finishes


def _add_hops(request: OpenRequest, origin: Any, http_spans: list[SpanRecord], origin_span: SpanRecord | None,
              details: dict[str, Any]) -> None:
    hops = [{"server_port": d.tuple4[2], "client_port": d.tuple4[1],
             "disconnect_delay_s": round((d.ts_ns - origin.ts_ns) / 1e9, 6)}
            for d in sorted(request.disconnects.values(), key=lambda d: d.ts_ns) if d is not origin]
    if hops:
        details["hops"] = hops
    unclosed = [s.server_port for s in http_spans if s is not origin_span and span_tuple(s) not in request.disconnects]
    if unclosed:
        details["upstream_not_closed_ports"] = unclosed


def _work_end(corr: Correlator, request: OpenRequest, root: SpanRecord | None, subtree: list[SpanRecord],
              engine: SpanRecord | None, now: int, details: dict[str, Any],
              racing: bool = False) -> tuple[int | None, bool, bool]:
    """When the request's work ended on this host, whether that may still change, and whether
    anything tells that it stopped at all. ``racing``: its client may have closed after the last
    byte (``_may_have_answered``)."""
    trace_id = request.key[0]
    # Set only where the clock and news as old as what the verdict read are all that can change it.
    request.settles_at_ns = request.reads_until_ns = None
    mine = {s.span_id for s in subtree} | {request.key[1]}
    if corr.live.running(trace_id, mine):
        details["evidence"], details["work_end_exact"] = ev.LIVE_NOTICE, "live"
        return None, True, True  # a live notice says part of it is still running
    if root is None:
        # Known only live: its end notice stands in until the span itself arrives.
        details["evidence"], details["work_end_exact"] = ev.LIVE_NOTICE, "live"
        ended = corr.live.span_end(*request.key)
        if ended is None:
            return None, True, True
        return max(ended, corr.live.engine_end(trace_id) or 0), True, True
    ends = [s.end_ns for s in subtree if s.role in (SpanRole.HTTP_SERVER, SpanRole.ENGINE)]
    work_end = max(ends + ([engine.end_ns] if engine else []))
    if engine is not None:
        details["evidence"], details["work_end_exact"] = ev.ENGINE_SPAN, "span"
        return work_end, False, True
    live_end = corr.live.engine_end(trace_id)
    if live_end is not None:
        details["evidence"], details["work_end_exact"] = ev.LIVE_NOTICE, "live"
        request.settles_at_ns = live_end + ENGINE_SETTLE_AFTER_LIVE_END_NS
        return max(work_end, live_end), now < request.settles_at_ns, True
    scraped = _metrics_work_end(corr, request, subtree, now, racing)
    if scraped is not None:
        by_metrics, port, disconnect, answered = scraped
        details["evidence"], details["work_end_exact"] = ev.ENGINE_METRICS, "scrape"
        details["work_end_resolution_s"] = round(by_metrics.resolution_s, 3)
        details["orphaned_scrapes"] = by_metrics.orphaned_scrapes
        if by_metrics.held_one_more is not None:
            details["held_one_more"] = by_metrics.held_one_more
        if by_metrics.leaving_untold:
            details["leaving_untold"] = True
        if by_metrics.no_finish_counted:
            details["no_finish_counted"] = True
        if by_metrics.orphaned_scrapes == 0 and corr.loads.aborts_cover(
                port, disconnect, answered, _connected_on(corr, port)):
            details["aborts_counted"] = True
        elif by_metrics.orphaned_scrapes == 0 and request.origin().kind == "fin" and not racing:
            # Gone by the next scrapes, its client leaving with a FIN (a reset is no client that
            # read it all) well before its span ended (a racing close has rules of its own): did
            # the engine finish it, not abort it? (evaluate: then unconfirmed)
            if corr.loads.no_abort_while(port, disconnect, answered):
                details["no_abort_counted"] = True
            elif corr.loads.finishes_cover(port, disconnect, answered, lambda start, end:
                                           corr.spans.server_span_lengths_ended(port, start - CLOCK_ERROR_NS,
                                                                                end + CLOCK_ERROR_NS)):
                details["finish_counted"] = True
        if by_metrics.awaiting:
            details["awaiting"] = True
        if by_metrics.earliest_ns is not None and max(work_end, by_metrics.earliest_ns) < (by_metrics.work_end_ns or now):
            # Later leavers whose leaving the gauges could not tell may own the orphans it was given
            # since: its work may have stopped that soon after its client left (from its close here;
            # evaluate counts from when the server read it, where that was later).
            details["lag_at_least_s"] = round(max(0, max(work_end, by_metrics.earliest_ns) - request.origin().ts_ns) / 1e9, 3)
        if by_metrics.work_end_ns is None:
            corr.clients_wanted.add(port)  # its next scrapes decide it: with the clients connected
            return None, True, True
        end = max(work_end, by_metrics.work_end_ns)
        # An engine span may still arrive and say exactly; until then the scrape's word stands.
        # Other requests' spans and disconnects, and scrapes, change it without touching this
        # request, but only those that concern the moments its deciding scrapes span: once the
        # scrapes it reads have all come, it is looked at again on news that old (OpenRequest.due).
        reads = by_metrics.read_until_ns
        if by_metrics.orphaned_scrapes == 0:  # aborts_cover reads two scrapes after the answer
            covered = corr.loads.read_until(port, answered)
            reads = None if covered is None or reads is None else max(reads, covered)
        # Scrapes skipped as undecided (their orphans may be clients' requests whose spans have
        # not come) are decided by those spans: the verdict waits the late-span window for them too.
        waits_from = max(end, by_metrics.unsure_until_ns or 0)
        if reads is not None:
            request.reads_until_ns, request.settles_at_ns = reads + CLOCK_ERROR_NS, waits_from + corr.late_ns
        return end, now - waits_from < corr.late_ns, not _straddles_the_grace(corr, by_metrics, disconnect, details)
    # Nothing says whether the work stopped: an engine span may yet arrive (vLLM emits none for
    # an abort, so its absence proves nothing); until then, and after, the verdict is unconfirmed.
    if not corr.loads.watched(request.origin().tuple4[2]):  # no scrapes to come that could change it
        request.settles_at_ns = work_end + corr.late_ns
    return work_end, now - work_end < corr.late_ns, False


def _metrics_work_end(corr: Correlator, request: OpenRequest, subtree: list[SpanRecord], now: int,
                      racing: bool = False) -> tuple[ev.MetricsEnd, int, int, int] | None:
    """The work end the engine's gauges tell, on the innermost scraped hop of the request, with
    that hop's port, disconnect and span end.

    A request that ended within the clock error of a scrape counts as connected at it: one orphan
    right at a completion (the next request taken up as the last one ends) is no evidence.

    A ``racing`` request (its client may have closed after the last byte) owns orphans only if
    the engine held one more once it left (``EngineLoads.held_one_more``); until that is known, and
    where it did not, it is no registered leaver, so claims none of those of earlier leavers."""
    origin = request.origin()
    hop = _scraped_hop(corr, subtree)
    if hop is None:
        return None
    disconnect = request.disconnects.get(span_tuple(hop), origin).ts_ns
    port, until = hop.server_port or 0, hop.end_ns + CLOCK_ERROR_NS
    connected = _connected_on(corr, port)

    def arrived(start: int, end: int) -> int:
        return corr.spans.server_spans_started(port, start, end + CLOCK_ERROR_NS)

    def ending(start: int, end: int) -> int:
        return corr.spans.server_spans_ended(port, start - CLOCK_ERROR_NS, end + ev.ENDING_NS)

    def spans_ended(start: int, end: int) -> int:
        return corr.spans.server_spans_ended(port, start - CLOCK_ERROR_NS, end + CLOCK_ERROR_NS)

    request.compared_ns = None
    if racing:
        held = corr.loads.held_one_more(port, request.key, disconnect, hop.start_ns, until, connected, arrived,
                                        corr.unspanned_clients, no_within_ns=int(corr.grace_seconds * 1e9),
                                        spans_ended=spans_ended)
        if held is None and now - until > ev.HELD_ONE_MORE_WINDOW_NS:
            held = (None, None)  # no scrape came in the window (its engine's scrapes stopped): untold
        request.compared_ns = None if held is None else held[1]
        if held is None or not held[0]:
            corr.loads.unregister(port, request.key)
            # Until known to have added none, it may have added an orphan where another's rise is
            # asked: two clients that closed as their responses ended, one left its work running
            # (a proxy's upstream connections, one a request), cannot both be told from the rise.
            corr.loads.racing(port, request.key, (disconnect, until) if held is None or held[0] is None else None)
            if held is None:  # no scrape after it that says yet: nothing is said of it
                return ev.MetricsEnd(None, 0.0, 0, awaiting=True), port, disconnect, max(disconnect, hop.end_ns)
            (first, second), answered = held[1] or (disconnect, disconnect), max(disconnect, hop.end_ns)
            unfinished, read_until = False, second
            if held[0] is False and (hop.http_status or 0) < 500:
                # It held no more once it left: a complete answer or an abort at once. The engine's
                # count of normal finishes tells which, where it stood still over the request's life
                # (a server error is neither, and is never counted).
                counted = corr.loads.no_finish_while(port, hop.route, hop.start_ns, hop.end_ns)
                if counted is None and now - until <= ev.HELD_ONE_MORE_WINDOW_NS:
                    return ev.MetricsEnd(None, 0.0, 0, awaiting=True), port, disconnect, answered
                if counted is not None and counted[0]:
                    unfinished, read_until = True, max(second, counted[1])
            return ev.MetricsEnd(max(disconnect, hop.start_ns), (second - first) / 1e9, 0, read_until,
                                 held_one_more=held[0], leaving_untold=held[0] is None,
                                 no_finish_counted=unfinished), port, disconnect, answered
    corr.loads.register(port, request.key, disconnect, connected_until_ns=until)
    if request.scrape_sweep is None and now - disconnect > ev.SWEEP_AFTER_NS:  # a long sweep: checkpoints
        request.scrape_sweep = ev.ScrapeSweep()
        corr.checkpointed(request)
    ended = corr.loads.work_end(port, disconnect, max(disconnect, hop.start_ns), connected,
                                connected_until_ns=until, arrived=arrived, sweep=request.scrape_sweep,
                                unspanned=corr.unspanned_clients, ending=ending)
    if ended is None and now - disconnect < ev.HELD_ONE_MORE_WINDOW_NS \
            and not corr.loads.scraped_after(port, max(disconnect, hop.start_ns, until)):
        # No scrape since it left yet (the port is scraped every quarter second): the next says.
        # Read now, nothing would tell whether its work stopped, and it would be unconfirmed.
        ended = ev.MetricsEnd(None, 0.0, 0, awaiting=True)
    if ended is not None and racing:
        ended = replace(ended, held_one_more=True)
    return None if ended is None else (ended, port, disconnect, max(disconnect, hop.end_ns))


def _straddles_the_grace(corr: Correlator, by_metrics: ev.MetricsEnd, disconnect_ns: int,
                         details: dict[str, Any]) -> bool:
    """Whether the scrapes the gauges' end lies between are further apart than the grace, one
    within it and one past it: the work may have stopped at once or run on past the grace, and
    the midpoint the end is put at would decide it either way. Scrapes come every quarter second,
    so only a stall of the scrape loop (a slow /metrics, a loaded host, a round waiting on a pod
    that does not answer) parts them so far: a reading that caught an aborted request's last
    moment, followed by none for a second, put its end half a second past the close (a zombie)."""
    if by_metrics.gone_by_ns is None or by_metrics.work_end_ns is None:
        return False
    grace_ns = int(corr.grace_seconds * 1e9)
    # Where no scrape counted it after its client left, its end is taken at the leaving, or at
    # the server's read of it where that came later (the lag counts from there).
    since = disconnect_ns if by_metrics.held_at_ns is not None else by_metrics.work_end_ns
    held = by_metrics.held_at_ns if by_metrics.held_at_ns is not None else since
    if by_metrics.gone_by_ns - held > grace_ns and held - since <= grace_ns < by_metrics.gone_by_ns - since:
        details["scrapes_apart_s"] = round((by_metrics.gone_by_ns - held) / 1e9, 3)
        return True
    return False


def _unconfirmed_because(corr: Correlator, subtree: list[SpanRecord], details: dict[str, Any]) -> str:
    """Why nothing tells whether an unconfirmed request's work stopped (``ev.RACED_ITS_ANSWER``, ...):
    its client closed as its answer ended (a client that read it all and a server that stopped at
    once on the close look the same, and the gauges never saw it held after); its engine's gauges
    were read but cannot tell (scrapes that stopped, a leaving no listing could tell, other
    leavers' requests on the port); or no gauges of its engine were read at all: then only the
    engine's span, or its live notices, could have told (vLLM sends none for an abort)."""
    finished = details.get("no_abort_counted") or details.get("finish_counted")  # by the engine, as it left
    if details.get("engine_done_as_client_left") or finished or (
            details.get("close_races_span_end") and not details.get("leaving_untold")):
        return ev.RACED_ITS_ANSWER
    return ev.GAUGES_CANNOT_TELL if _scraped_hop(corr, subtree) is not None else ev.NO_GAUGES


def _connected_on(corr: Correlator, port: int) -> Callable[[int, int], int]:
    """Requests in flight on ``port`` at any moment of a scrape's [sent, answered], give or take
    the clock error: the connected count its orphans are read against."""
    def connected(start: int, end: int) -> int:
        return corr.connected_at(port, start - CLOCK_ERROR_NS, end + CLOCK_ERROR_NS)
    return connected


def _scraped_hop(corr: Correlator, subtree: list[SpanRecord]) -> SpanRecord | None:
    """The innermost server span of the request on a port whose engine's gauges are scraped."""
    hops = [s for s in subtree if s.role is SpanRole.HTTP_SERVER and s.server_port is not None
            and corr.loads.watched(s.server_port)]
    return max(hops, key=lambda s: s.start_ns) if hops else None


def _waste(corr: Correlator, request: OpenRequest, origin: Any, started: int | None, end_ns: int,
           engine: SpanRecord | None, base: SpanRecord | None, details: dict[str, Any]) -> tuple[float, float]:
    """This request's share of what its engine spent while its client was gone and it was running."""
    start_ns, port = max(origin.ts_ns, started or 0), origin.tuple4[2]
    if engine is not None:
        start_ns = max(start_ns, running_part(engine)[0])  # waiting in the queue costs nothing
    if end_ns <= start_ns or (engine is None and details.get("orphaned_scrapes") == 0):
        return 0.0, 0.0  # nothing ran for it: no window, or the gauges never held it after its client left
    span = engine or base
    service, trace_id = (span.service, span.trace_id) if span else ("", "")
    # Where its spans came from: on a port several containers serve, which one's engine ran it.
    sender = next((found for s in (engine, base) if s is not None and (found := s.attributes.get(SENDER_KEY))), None)
    samples = corr.cost.samples
    samples.refresh(corr.clock())
    pid = corr.cost.engine_pid((engine.process_pid if engine else None) or (base.process_pid if base else None),
                               port, sender)
    gpu = corr.cost.gpu_share(pid)
    if pid is None:
        details["cost_unmeasured"] = corr.cost.unresolved.get(
            port, f"the process serving port {port} is not known: no process.pid in its spans and no listener found")
    elif gpu.unmeasured:
        details["cost_unmeasured"] = gpu.unmeasured
    elif not gpu.series and samples.series("procfs", pid) is None:
        details["cost_unmeasured"] = f"no utilization samples of process {pid}"
    if gpu.source:
        details["gpu_time_of"] = gpu.source  # where the GPU time was read: "pid 5001", "GPUs 2, 3"
    if sender and port in corr.cost.shared:
        details["engine_address"] = sender  # which of the containers serving the port ran it
    # The engine's own running gauge when scraped: a request waiting its turn shares nothing. On a
    # port several containers serve, the count of the one its spans came from (the time read is its).
    shared = port in corr.cost.shared
    gauge = ((lambda ts: corr.loads.running_at(port, ts, sender if shared else None))
             if corr.loads.watched(port) and (sender or not shared) else None)
    engine_name = engine_of(service, span.attributes if span else None)
    sharers = sharers_at(corr.spans.runs, engine_name, trace_id, corr.live.running_work(service, sender), gauge)
    if request.cost_partial is None and end_ns - start_ns > PARTIAL_MIN_NS:
        request.cost_partial = PartialCost()
        corr.checkpointed(request)
    cost = wasted(samples, start_ns=start_ns, end_ns=end_ns, pid=pid, sharers=sharers, gpu=gpu,
                  partial=request.cost_partial, basis=(gauge is not None, engine_name, trace_id))
    return round(cost.gpu_seconds, 6), round(cost.cpu_seconds, 6)


def clock_dependent(request: OpenRequest) -> bool:
    written = request.written
    return written is None or written.verdict is Verdict.INFLIGHT_ZOMBIE or bool(written.details.get("provisional"))
