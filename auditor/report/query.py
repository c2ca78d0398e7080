"""Build a ``Report`` from the store with SQL aggregation.

Every figure is computed in the database (``GROUP BY`` and conditional sums), so a window of a
million requests costs a handful of queries, not a Python loop over rows. Only the per-request list
(one row per request that had a disconnect) and the few worst zombies come back row by row.

What belongs to a window:
- requests: HTTP server spans whose start falls in it, each client request once (``requests``);
- findings: verdicts whose disconnect falls in it;
- coverage: coverage counts whose timestamp falls in it;
- GPU time: the window's length for every GPU that reported whole-device NVML samples in it.
``--host`` applies to all of them; ``--service``, ``--route`` and ``--model`` apply to requests and
findings (coverage and GPU samples carry no such label).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from math import isfinite
from typing import Any, TypeVar, cast

from sqlalchemy import and_, case, func, select, text, union_all
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement

from auditor.errors import StoreError
from auditor.model import CoverageKind, SpanRole, start_minute
from auditor.report.model import (
    BREAKDOWN_DIMENSIONS,
    CALLER_DIMENSIONS,
    CALLERS_SHOWN,
    ORPHANED_FILTERS,
    ZOMBIE_VERDICTS,
    BreakdownRow,
    Bucket,
    ClientTimeout,
    DataRange,
    OrphanedPort,
    Report,
    ReportQuery,
    RequestFinding,
    Totals,
    UtilPoint,
    WasteByHost,
    ZombieTimeline,
)
from auditor.report.requests import count_requests
from auditor.report.sqlite_json import (
    lag_at_least,
    request_json_column,
    unconfirmed_reason,
    verdict_evidence,
)
from auditor.report.timeouts import BIN_NS, MOMENT_NS, AgeBin, age_bars, find_timeouts
from auditor.semconv import USER_AGENT_KEYS
from auditor.store import Store, tables

spans, verdicts, coverage, samples = tables.spans, tables.verdicts, tables.coverage, tables.util_samples
orphaned = tables.orphaned_work

_T = TypeVar("_T")
NS = 1_000_000_000
# A window that covers less than this share of the time the store holds is read through the
# indexes time leads, the rest by plain scans: a span read through the index costs about six times
# one scanned (bench/report.py --hours-held 6: the request count of the last hour took as long
# either way, of its last 15 minutes 0.16 s against 0.60).
INDEXED_SHARE = 0.15
# Bucket widths for the over-time plots, from which the smallest giving <= MAX_BUCKETS is chosen.
NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
                  43200, 86400, 172800, 604800)
MAX_BUCKETS = 72
TIMELINE_POINTS = 48

# In the order of RequestFinding's fields (checked by a test).
FINDING_COLUMNS = (
    verdicts.c.request_id, verdicts.c.trace_id, verdicts.c.verdict, verdicts.c.disconnect_at_ns,
    verdicts.c.disconnect_kind, verdicts.c.request_start_ns, verdicts.c.work_end_ns, verdicts.c.lag_seconds,
    lag_at_least(verdicts).label("lag_at_least_seconds"),
    verdicts.c.phase, verdicts.c.route, verdicts.c.model, verdicts.c.service, verdicts.c.client_addr,
    verdicts.c.client_port, verdicts.c.user_agent, verdicts.c.host, verdicts.c.max_tokens,
    verdicts.c.tokens_after_disconnect, verdicts.c.tokens_exact, verdicts.c.wasted_gpu_seconds,
    verdicts.c.wasted_cpu_seconds, verdict_evidence(verdicts).label("evidence"),
    unconfirmed_reason(verdicts).label("unconfirmed_because"),
)


def build_report(store: Store, query: ReportQuery, *, with_requests: bool = True,
                 with_series: bool = False, requests_as_json: bool = False, concurrent: bool = True) -> Report:
    """Everything a report shows for ``query``'s window.

    ``with_requests`` loads the per-request list (JSON, CSV); with ``requests_as_json`` on SQLite
    it comes as ready JSON texts in ``Report.requests_json`` instead, built by the database (the
    fast path of ``--format json``). ``with_series`` adds the time buckets and the worst zombies'
    utilization (HTML). A database error becomes a ``StoreError``.

    The count of requests, the per-request list and the time buckets are read on a second
    connection, in a thread of their own, while this one reads the rest (``concurrent``, where
    every connection reads the same store: not SQLite in memory). The driver lets go of the
    interpreter while the database works, so the two overlap on two cores (bench/report.py). Each
    query reads its own snapshot either way, as each statement does on one connection.
    """
    if query.until_ns <= query.since_ns:
        raise StoreError("the window is empty: --since must be before --until")
    as_json = requests_as_json and store.engine.dialect.name == "sqlite"
    try:
        bucket_ns = bucket_width_ns(query.until_ns - query.since_ns) if with_series else 0
        if not (concurrent and store.shared_by_connections):
            with store.engine.connect() as conn:
                return _build(conn, query, count=lambda: _count(conn, query),
                              requests=lambda: _requests(conn, query, as_json) if with_requests else None,
                              series=lambda: _series(conn, query, bucket_ns) if with_series else None)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="report-apart") as pool:
            counted = pool.submit(_apart, store, _count, query)
            listed = pool.submit(_apart, store, _requests, query, as_json) if with_requests else None
            drawn = pool.submit(_apart, store, _series, query, bucket_ns) if with_series else None
            with store.engine.connect() as conn:
                return _build(conn, query, count=counted.result,
                              requests=listed.result if listed is not None else lambda: None,
                              series=drawn.result if drawn is not None else lambda: None)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise StoreError(f"reading the report from {store.where()} failed: {reason}") from exc


def _build(conn: Connection, query: ReportQuery, *, count: Callable[[], int],
           requests: Callable[[], list[str] | list[RequestFinding] | None],
           series: Callable[[], list[Bucket] | None]) -> Report:
    """The report on ``conn``; ``count`` gives the window's requests (``_count``), ``requests`` the
    per-request list (JSON texts or findings; None: not asked), called once the totals say there
    were disconnects, and ``series`` the time buckets (``_series``; None: not asked)."""
    totals = Totals()
    breakdowns = _fold_verdict_groups(conn, query, totals)
    breakdowns |= caller_breakdowns(conn, query) if totals.disconnects else {d: [] for d in CALLER_DIMENSIONS}
    _fill_coverage(conn, query, totals)
    _fill_gpu_time(conn, query, totals)
    report = Report(
        query=query, generated_ns=time.time_ns(), totals=totals,
        breakdowns=breakdowns,
        worst_zombies=_worst_zombies(conn, query),
    )
    report.orphaned_work = orphaned_work(conn, query)
    ages = age_bins(conn, query) if totals.disconnects else []
    report.client_timeouts = with_callers(conn, query, find_timeouts(ages))
    report.series = series()
    if report.series is not None:
        report.bucket_ns = bucket_width_ns(query.until_ns - query.since_ns)
        report.timelines = [_timeline(conn, query, finding) for finding in report.worst_zombies]
        report.ages, report.age_bar_s, report.ages_beyond = age_bars(ages, report.client_timeouts)
    totals.requests = count()
    if report.empty:
        report.data_range = _data_range(conn, query)
    listed = requests() if totals.disconnects else None
    if listed and isinstance(listed[0], str):
        report.requests_json = listed
    elif listed is not None:
        report.requests = cast(list[RequestFinding], listed)
    return report


def _count(conn: Connection, query: ReportQuery) -> int:
    """The window's requests, each counted once (``count_requests``)."""
    return count_requests(conn, _span_filter(query), query.host, query.since_ns, query.until_ns,
                          by_minute=_held_share(conn, query) < INDEXED_SHARE)


def _held_share(conn: Connection, query: ReportQuery) -> float:
    """How much of the time the store holds spans of the window covers, by minute: the first and
    the last minute held are two lookups of the index the minute leads. 1 in an empty store."""
    first, last = conn.execute(select(select(func.min(spans.c.start_minute)).scalar_subquery(),
                                      select(func.max(spans.c.start_minute)).scalar_subquery())).one()
    if first is None or last is None:
        return 1.0
    covered = min(int(last), start_minute(query.until_ns - 1)) - max(int(first), start_minute(query.since_ns)) + 1
    return max(0, covered) / (int(last) - int(first) + 1)


def _requests(conn: Connection, query: ReportQuery, as_json: bool) -> list[str] | list[RequestFinding]:
    """The window's requests with a disconnect, in the order they left: JSON texts built by
    SQLite (``as_json``) or findings."""
    order = (verdicts.c.disconnect_at_ns, verdicts.c.id)
    if as_json:
        return list(conn.execute(select(request_json_column(verdicts)).where(*_verdict_filter(query))
                                 .order_by(*order)).scalars())
    rows = conn.execute(select(*FINDING_COLUMNS).where(*_verdict_filter(query)).order_by(*order))
    return list(map(_finding, rows))


def _apart(store: Store, read: Callable[..., _T], *args: Any) -> _T:
    """``read(conn, *args)`` on a connection of its own (``build_report``'s thread)."""
    with store.engine.connect() as conn:
        return read(conn, *args)


# -- filters ------------------------------------------------------------------------------------
def _label_filters(table: Any, query: ReportQuery) -> list[ColumnElement[bool]]:
    """The query's label filters over the verdicts or the spans table (or an alias of either)."""
    return [_label(table, name) == value for name, value in query.filters().items() if value is not None]


def _label(table: Any, name: str) -> Any:
    """A filter's label in ``table``: a column of its own, but for a span the client's address is
    its peer's and its User-Agent one of its attributes (the first of the conventions' names)."""
    if "client_addr" in table.c:  # the verdicts
        return table.c["client_addr" if name == "client" else name]
    if name == "client":
        return table.c.peer_addr
    if name == "user_agent":
        return func.coalesce(*(table.c.attributes[key].as_string() for key in USER_AGENT_KEYS))
    return table.c[name]


def _verdict_filter(query: ReportQuery) -> list[ColumnElement[bool]]:
    return [verdicts.c.disconnect_at_ns >= query.since_ns, verdicts.c.disconnect_at_ns < query.until_ns,
            *_label_filters(verdicts, query)]


def _span_filter(query: ReportQuery) -> list[ColumnElement[bool]]:
    return [spans.c.role == SpanRole.HTTP_SERVER.value,
            spans.c.start_ns >= query.since_ns, spans.c.start_ns < query.until_ns,
            *_label_filters(spans, query)]


def _host_filter(table: Any, query: ReportQuery) -> list[ColumnElement[bool]]:
    return [table.c.host == query.host] if query.host is not None else []


def _sample_hosts(conn: Connection, query: ReportQuery) -> list[ColumnElement[bool]]:
    """Where a window without ``--host`` covers a small share of what the store holds, the hosts
    that sent samples, named: the samples' index leads with the host, then the time, so a window
    of each host is read through it instead of every sample held. Found by a walk that skips from
    one host to the next in that index (one lookup a host, not a scan)."""
    if query.host is not None or _held_share(conn, query) >= INDEXED_SHARE:
        return []
    hosts = conn.execute(text(
        "WITH RECURSIVE hosts(host) AS (SELECT min(host) FROM util_samples UNION ALL "
        "SELECT (SELECT min(host) FROM util_samples WHERE host > hosts.host) FROM hosts "
        "WHERE hosts.host IS NOT NULL) SELECT host FROM hosts WHERE host IS NOT NULL")).scalars().all()
    return [samples.c.host.in_(hosts)]


def _whole_gpu_samples(host: str | None, since_ns: int, until_ns: int) -> list[ColumnElement[bool]]:
    """Whole-device NVML samples (no pid) in a time range, of one host or of all."""
    return [*([samples.c.host == host] if host is not None else []),
            samples.c.ts_ns >= since_ns, samples.c.ts_ns < until_ns,
            samples.c.source == "nvml", samples.c.pid.is_(None), samples.c.gpu_index.is_not(None)]


# -- totals -------------------------------------------------------------------------------------
def _count_if(condition: ColumnElement[bool]) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _finite(column: Any) -> Any:
    # An infinite value (a bug upstream) would turn every sum it joins into infinity; leave it out.
    return case((func.abs(column) <= 1e300, column), else_=None)


def _sum(expression: Any) -> Any:
    return func.coalesce(func.sum(expression), 0)


def _verdict_aggregates() -> list[Any]:
    """Per-verdict counts and the costs, as aggregate columns usable with or without GROUP BY."""
    v = verdicts.c
    zombie = v.verdict.in_(ZOMBIE_VERDICTS)
    return [
        func.count().label("disconnects"),
        _count_if(v.verdict == "completed").label("completed"),
        _count_if(v.verdict == "aborted").label("aborted"),
        _count_if(v.verdict == "zombie").label("zombies"),
        _count_if(v.verdict == "inflight_zombie").label("inflight_zombies"),
        _count_if(v.verdict == "unconfirmed").label("unconfirmed"),
        _sum(case((zombie, _finite(v.lag_seconds)), else_=0.0)).label("zombie_seconds"),
        _sum(v.tokens_after_disconnect).label("wasted_tokens"),
        _sum(_finite(v.wasted_gpu_seconds)).label("wasted_gpu_seconds"),
        _sum(_finite(v.wasted_cpu_seconds)).label("wasted_cpu_seconds"),
    ]


def _fold_verdict_groups(conn: Connection, query: ReportQuery,
                         totals: Totals) -> dict[str, list[BreakdownRow]]:
    """Fill the verdict totals and every breakdown from ONE grouped scan of the window's verdicts.

    The database groups by every dimension and the verdict at once; the few hundred groups
    that come back are folded here into the totals and the per-dimension breakdowns, instead of
    scanning the verdicts once per breakdown.
    """
    v = verdicts.c
    keys = [v[dimension] for dimension in BREAKDOWN_DIMENSIONS]

    def unconfirmed_because(reason: str) -> Any:
        return _count_if(unconfirmed_reason(verdicts) == reason)

    rows = conn.execute(
        select(*keys, v.verdict, func.count().label("n"),
               _sum(_finite(v.lag_seconds)).label("lag"),
               _sum(v.tokens_after_disconnect).label("tokens"),
               _sum(case((v.tokens_exact.is_(False), v.tokens_after_disconnect), else_=0))
               .label("estimated"),
               _sum(_finite(v.wasted_gpu_seconds)).label("gpu"),
               _sum(_finite(v.wasted_cpu_seconds)).label("cpu"),
               # max_tokens comes from the engine span; without one (phase unknown) it is unknown,
               # which is not the same as uncapped.
               _count_if(v.max_tokens.is_(None) & (v.phase != "unknown")).label("uncapped"),
               _count_if(v.verdict.in_(ZOMBIE_VERDICTS) & v.tokens_after_disconnect.is_(None))
               .label("tokens_unknown"),
               _count_if(v.verdict.in_(ZOMBIE_VERDICTS)
                         & v.details["cost_unmeasured"].as_string().is_not(None)).label("uncosted"),
               unconfirmed_because("no_gauges").label("ungauged"),  # evidence.NO_GAUGES
               unconfirmed_because("raced_its_answer").label("raced"))  # evidence.RACED_ITS_ANSWER
        .where(*_verdict_filter(query)).group_by(*keys, v.verdict)).all()
    folded: dict[str, dict[str | None, list[Any]]] = {d: {} for d in BREAKDOWN_DIMENSIONS}
    by_host: dict[str, list[float]] = {}
    for row in rows:
        count, lag = int(row.n), float(row.lag)
        zombie_lag = lag if row.verdict in ZOMBIE_VERDICTS else 0.0
        totals.disconnects += count
        if row.verdict in _VERDICT_INDEX:
            name = _TOTALS_FIELD[row.verdict]
            setattr(totals, name, getattr(totals, name) + count)
        totals.zombie_seconds += zombie_lag
        totals.wasted_tokens += int(row.tokens)
        totals.wasted_tokens_estimated += int(row.estimated)
        totals.wasted_gpu_seconds += float(row.gpu)
        totals.wasted_cpu_seconds += float(row.cpu)
        totals.uncapped_disconnects += int(row.uncapped)
        totals.zombies_without_tokens += int(row.tokens_unknown)
        totals.uncosted_zombies += int(row.uncosted)
        totals.unconfirmed_without_gauges += int(row.ungauged)
        totals.unconfirmed_raced += int(row.raced)
        _add_waste(by_host, row)
        _add_group(folded, row, count, zombie_lag)
    totals.waste_by_host = _waste(by_host)
    return _breakdown_rows(folded)


def caller_breakdowns(conn: Connection, query: ReportQuery) -> dict[str, list[BreakdownRow]]:
    """The breakdowns by who called (client address, User-Agent), from one grouped scan of their
    own: as many values as callers, they would multiply the groups of the one scan of the other
    dimensions by as many. Grouped together, their groups are about one a caller (a caller
    sends one User-Agent), not one a pair of the two."""
    v = verdicts.c
    keys = [v[column].label(dimension) for dimension, column in CALLER_DIMENSIONS.items()]
    rows = conn.execute(
        select(*keys, v.host, v.verdict, func.count().label("n"), _sum(_finite(v.lag_seconds)).label("lag"),
               _sum(v.tokens_after_disconnect).label("tokens"), _sum(_finite(v.wasted_gpu_seconds)).label("gpu"),
               _sum(_finite(v.wasted_cpu_seconds)).label("cpu"))
        .where(*_verdict_filter(query)).group_by(*keys, v.host, v.verdict)).all()
    folded: dict[str, dict[str | None, list[Any]]] = {d: {} for d in CALLER_DIMENSIONS}
    for row in rows:
        _add_group(folded, row, int(row.n), float(row.lag) if row.verdict in ZOMBIE_VERDICTS else 0.0)
    return _breakdown_rows(folded)


def _add_group(folded: dict[str, dict[str | None, list[Any]]], row: Any, count: int, zombie_lag: float) -> None:
    """Add one group of verdicts (one verdict, one host, one value of each dimension in ``folded``)
    to each dimension's accumulator of its value: [disconnects, completed, aborted, zombies,
    in-flight, zombie seconds, tokens, GPU-s, CPU-s, unconfirmed, {host: [GPU-s, CPU-s]}]."""
    for dimension, groups in folded.items():
        acc = groups.get(row._mapping[dimension])
        if acc is None:
            acc = groups[row._mapping[dimension]] = [0.0] * 10 + [{}]
        acc[0] += count
        if row.verdict in _VERDICT_INDEX:
            acc[_VERDICT_INDEX[row.verdict]] += count
        acc[5] += zombie_lag
        acc[6] += int(row.tokens)
        acc[7] += float(row.gpu)
        acc[8] += float(row.cpu)
        _add_waste(acc[10], row)


def _add_waste(by_host: dict[str, list[float]], row: Any) -> None:
    """Add a group's wasted GPU- and CPU-seconds (``row.gpu``, ``row.cpu``) to its host's."""
    waste = by_host.get(row.host)
    if waste is None:
        waste = by_host[row.host] = [0.0, 0.0]
    waste[0] += float(row.gpu)
    waste[1] += float(row.cpu)


def _waste(by_host: dict[str, list[float]]) -> WasteByHost:
    return tuple((host, gpu, cpu) for host, (gpu, cpu) in sorted(by_host.items()))


def _breakdown_rows(folded: dict[str, dict[str | None, list[Any]]]) -> dict[str, list[BreakdownRow]]:
    """Each dimension's accumulators as breakdown rows, worst first: most zombie time, then most
    disconnects."""
    return {dimension: sorted(
        (BreakdownRow(key=key, disconnects=int(a[0]), completed=int(a[1]), aborted=int(a[2]),
                      zombies=int(a[3]), inflight_zombies=int(a[4]), zombie_seconds=a[5],
                      wasted_tokens=int(a[6]), wasted_gpu_seconds=a[7], wasted_cpu_seconds=a[8],
                      unconfirmed=int(a[9]), waste_by_host=_waste(a[10]))
         for key, a in groups.items()),
        key=lambda r: (-r.zombie_seconds, -r.disconnects, r.key or ""))
        for dimension, groups in folded.items()}


# Where each verdict is counted: its slot in a breakdown accumulator, and its Totals field.
_VERDICT_INDEX = {"completed": 1, "aborted": 2, "zombie": 3, "inflight_zombie": 4, "unconfirmed": 9}
_TOTALS_FIELD = {"completed": "completed", "aborted": "aborted", "zombie": "zombies",
                 "inflight_zombie": "inflight_zombies", "unconfirmed": "unconfirmed"}


def _fill_coverage(conn: Connection, query: ReportQuery, totals: Totals) -> None:
    rows = conn.execute(
        select(coverage.c.kind, _sum(coverage.c.count))
        .where(coverage.c.ts_ns >= query.since_ns, coverage.c.ts_ns < query.until_ns,
               *_host_filter(coverage, query))
        .group_by(coverage.c.kind))
    by_kind = {kind: int(count) for kind, count in rows}
    totals.idle_closes = by_kind.get(CoverageKind.IDLE_CLOSE.value, 0)
    totals.unjoined_disconnects = by_kind.get(CoverageKind.UNJOINED_DISCONNECT.value, 0)
    totals.unjoined_spans = by_kind.get(CoverageKind.UNJOINED_SPAN.value, 0)
    totals.lost_kernel_events = by_kind.get(CoverageKind.LOST_KERNEL_EVENTS.value, 0)
    totals.proxy_rewritten_peers = by_kind.get(CoverageKind.PROXY_REWRITTEN_PEER.value, 0)
    totals.peerless_span_joins = by_kind.get(CoverageKind.PEERLESS_SPAN_JOINED.value, 0)


# A stretch with no end whose row was not rewritten for this long (every 10 s while it runs) was
# cut short by a daemon that did not stop cleanly: not counted as running.
ORPHANED_STALE_NS = 60 * NS


def _orphaned_in_window(query: ReportQuery) -> list[ColumnElement[bool]] | None:
    """The conditions of the stretches of orphaned work that overlap the window and match its
    filters; None where a filter they cannot honor is set (a port's work has no route or caller)."""
    if any(value is not None and name not in ORPHANED_FILTERS for name, value in query.filters().items()):
        return None
    return [orphaned.c.start_ns < query.until_ns, _orphaned_until() >= query.since_ns, *_host_filter(orphaned, query),
            *([orphaned.c.model == query.model] if query.model is not None else [])]


def _orphaned_until() -> Any:
    """A stretch's end, or while it runs, when it was last written."""
    return func.coalesce(orphaned.c.end_ns, orphaned.c.last_seen_ns)


def orphaned_work(conn: Connection, query: ReportQuery) -> list[OrphanedPort] | None:
    """The stretches of orphaned work that overlap the window, by host and port: the ports that
    sent no spans first, then the most request-seconds; None where a filter they cannot honor is set."""
    in_window = _orphaned_in_window(query)
    if in_window is None:
        return None
    until = _orphaned_until()
    rows = conn.execute(
        select(orphaned.c.host, orphaned.c.server_port, func.max(orphaned.c.model).label("model"),
               func.count().label("stretches"),
               _count_if(and_(orphaned.c.end_ns.is_(None),
                              orphaned.c.last_seen_ns >= time.time_ns() - ORPHANED_STALE_NS)).label("running"),
               func.min(orphaned.c.start_ns).label("first"), func.max(until).label("last"),
               func.max(until - orphaned.c.start_ns).label("longest"), func.max(orphaned.c.peak).label("peak"),
               _sum(_finite(orphaned.c.request_seconds)).label("request_s"),
               _sum(_finite(orphaned.c.wasted_gpu_seconds)).label("gpu_s"),
               _sum(_finite(orphaned.c.wasted_cpu_seconds)).label("cpu_s"),
               _count_if(orphaned.c.with_spans).label("with_spans"),
               func.max(orphaned.c.cost_unmeasured).label("unmeasured"))
        .where(*in_window)
        .group_by(orphaned.c.host, orphaned.c.server_port))
    found = [OrphanedPort(
        host=row.host, server_port=int(row.server_port), model=row.model, stretches=int(row.stretches),
        running=int(row.running), first_ns=int(row.first), last_ns=int(row.last),
        longest_seconds=int(row.longest) / NS, peak=int(row.peak), request_seconds=float(row.request_s),
        wasted_gpu_seconds=float(row.gpu_s), wasted_cpu_seconds=float(row.cpu_s), with_spans=int(row.with_spans) > 0,
        cost_unmeasured=row.unmeasured) for row in rows]
    # The ports whose zombies nothing else tells first: a port that sent spans has them in its verdicts.
    return sorted(found, key=lambda p: (p.with_spans, -p.request_seconds, p.host, p.server_port))


def _fill_gpu_time(conn: Connection, query: ReportQuery, totals: Totals) -> None:
    # One scan grouped by GPU gives both how many GPUs reported and how busy they were. Grouping
    # by gpu_index first keeps SQLite from walking the (host, ts) index row by row to save a sort
    # of a handful of groups, which costs more than the plain scan.
    per_gpu = conn.execute(
        select(samples.c.host, samples.c.gpu_index,
               _sum(samples.c.util_percent / 100.0 * samples.c.interval_s).label("busy"))
        .where(*_whole_gpu_samples(query.host, query.since_ns, query.until_ns), *_sample_hosts(conn, query))
        .group_by(samples.c.gpu_index, samples.c.host)).all()
    totals.gpus = len(per_gpu)
    totals.gpu_busy_seconds = sum(float(row.busy) for row in per_gpu)
    # Capacity is the time that has passed: a window that ends in the future has none there yet.
    elapsed_ns = max(0, min(query.until_ns, time.time_ns()) - query.since_ns)
    totals.gpu_seconds = totals.gpus * elapsed_ns / NS


def age_bins(conn: Connection, query: ReportQuery) -> list[AgeBin]:
    """The window's disconnects counted by their request's age in 10 ms bins, with their verdicts
    and costs (``timeouts.py`` finds the timeouts among them)."""
    v = verdicts.c
    age_bin = ((v.disconnect_at_ns - v.request_start_ns) // BIN_NS).label("age_bin")
    # How long a zombie's work ran from its request's start: what its answer needed. Not where
    # later leavers may own the orphans its engine's gauges gave it (details.lag_at_least_s):
    # its end may be theirs.
    ended = (v.verdict == "zombie") & v.work_end_ns.is_not(None) & lag_at_least(verdicts).is_(None)
    worked = v.work_end_ns - v.request_start_ns
    rows = conn.execute(select(age_bin, *_verdict_aggregates(), func.min(v.disconnect_at_ns).label("first"),
                               func.max(v.disconnect_at_ns).label("last"),
                               func.count(func.distinct(v.disconnect_at_ns // MOMENT_NS)).label("moments"),
                               func.sum(v.disconnect_at_ns - v.request_start_ns).label("ages"),
                               _count_if((v.verdict != "completed") & (func.coalesce(unconfirmed_reason(verdicts), "")
                                                                        != "raced_its_answer")).label("cut"),
                               _count_if(ended).label("ended"), _sum(case((ended, worked), else_=0)).label("worked"),
                               func.max(case((ended, worked), else_=None)).label("longest"))
                        .where(*_verdict_filter(query)).group_by(age_bin))
    return [AgeBin(index=int(r.age_bin), disconnects=int(r.disconnects), completed=int(r.completed),
                   aborted=int(r.aborted), zombies=int(r.zombies), inflight_zombies=int(r.inflight_zombies),
                   unconfirmed=int(r.unconfirmed), zombie_seconds=float(r.zombie_seconds),
                   wasted_gpu_seconds=float(r.wasted_gpu_seconds), wasted_cpu_seconds=float(r.wasted_cpu_seconds),
                   first_ns=int(r.first), last_ns=int(r.last), moments=int(r.moments), ages_ns=int(r.ages),
                   cut=int(r.cut), zombies_ended=int(r.ended), zombie_work_ns=int(r.worked),
                   zombie_work_max_ns=int(r.longest) if r.longest is not None else None)
            for r in rows if r.age_bin is not None]


def with_callers(conn: Connection, query: ReportQuery, timeouts: list[ClientTimeout]) -> list[ClientTimeout]:
    """Each timeout with who it cut: its disconnects' User-Agents and client addresses, the most
    first, from one grouped scan of the window's verdicts whose age falls in a timeout's band."""
    if not timeouts:
        return timeouts
    v = verdicts.c
    age_bin = (v.disconnect_at_ns - v.request_start_ns) // BIN_NS
    bands = [(round(t.from_seconds * NS) // BIN_NS, round(t.to_seconds * NS) // BIN_NS) for t in timeouts]
    which = case(*((and_(age_bin >= lo, age_bin < hi), index) for index, (lo, hi) in enumerate(bands)),
                 else_=None).label("which")
    rows = conn.execute(select(which, v.user_agent, v.client_addr, v.host, func.count().label("n"),
                               _sum(_finite(v.wasted_gpu_seconds)).label("gpu"),
                               _sum(_finite(v.wasted_cpu_seconds)).label("cpu"))
                        .where(*_verdict_filter(query), which.is_not(None))
                        .group_by(which, v.user_agent, v.client_addr, v.host)).all()
    agents: list[dict[str | None, int]] = [{} for _ in timeouts]
    addresses: list[dict[str | None, int]] = [{} for _ in timeouts]
    by_host: list[dict[str, list[float]]] = [{} for _ in timeouts]
    for row in rows:
        agents[row.which][row.user_agent] = agents[row.which].get(row.user_agent, 0) + int(row.n)
        addresses[row.which][row.client_addr] = addresses[row.which].get(row.client_addr, 0) + int(row.n)
        _add_waste(by_host[row.which], row)

    def most(counts: dict[str | None, int]) -> tuple[tuple[str | None, int], ...]:
        return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0] or ""))[:CALLERS_SHOWN])

    return [dataclasses.replace(t, user_agents=most(agents[i]), client_addresses=most(addresses[i]),
                                waste_by_host=_waste(by_host[i]))
            for i, t in enumerate(timeouts)]


# -- breakdowns and lists -----------------------------------------------------------------------
def _worst_zombies(conn: Connection, query: ReportQuery) -> list[RequestFinding]:
    if query.top <= 0:
        return []
    rows = conn.execute(
        select(*FINDING_COLUMNS)
        .where(*_verdict_filter(query), verdicts.c.verdict.in_(ZOMBIE_VERDICTS))
        .order_by(func.coalesce(verdicts.c.lag_seconds, 0.0).desc(), verdicts.c.disconnect_at_ns)
        .limit(query.top))
    return [_finding(row) for row in rows]


def _finding(row: Any) -> RequestFinding:
    # FINDING_COLUMNS lists the columns in RequestFinding's field order, so a row becomes a
    # finding as one tuple copy: that matters for a hundred thousand rows.
    return RequestFinding._make(row)


# -- over time (HTML) ---------------------------------------------------------------------------
def bucket_width_ns(window_ns: int) -> int:
    """The narrowest round bucket width that cuts the window into at most MAX_BUCKETS slices."""
    for seconds in NICE_BUCKETS_S:
        if window_ns <= seconds * NS * MAX_BUCKETS:
            return seconds * NS
    return -(-window_ns // MAX_BUCKETS)


def _bucket_of(column: Any, since_ns: int, width_ns: int) -> Any:
    # ``//`` renders integer division (SQLAlchemy's ``/`` would divide as floats, one group a row).
    return ((column - since_ns) // width_ns).label("bucket")


def _series(conn: Connection, query: ReportQuery, width_ns: int) -> list[Bucket]:
    since, until = query.since_ns, query.until_ns
    count = -(-(until - since) // width_ns)
    completed: dict[int, int] = {}
    span_bucket = _bucket_of(spans.c.end_ns, since, width_ns)
    for bucket, number in conn.execute(
            select(span_bucket, func.count())
            .where(spans.c.role == SpanRole.HTTP_SERVER.value, spans.c.end_ns >= since,
                   spans.c.end_ns < until, *_label_filters(spans, query))
            .group_by(span_bucket)):
        completed[int(bucket)] = int(number)
    verdict_bucket = _bucket_of(verdicts.c.disconnect_at_ns, since, width_ns)
    findings: dict[int, Any] = {}
    for found in conn.execute(select(verdict_bucket, *_verdict_aggregates())
                              .where(*_verdict_filter(query)).group_by(verdict_bucket)):
        findings[int(found.bucket)] = found
    util: dict[int, float] = {}
    sample_bucket = _bucket_of(samples.c.ts_ns, since, width_ns)
    for bucket, mean in conn.execute(select(sample_bucket, func.avg(samples.c.util_percent))
                                     .where(*_whole_gpu_samples(query.host, since, until),
                                            *_sample_hosts(conn, query))
                                     .group_by(sample_bucket)):
        if mean is not None:
            util[int(bucket)] = float(mean)
    # Without GPU samples, the engine processes' CPU where /proc samples them: core-seconds (a
    # sample's share of a core times the time it covers) over the slice's length, so a slice with
    # gaps in its samples reads low, never high. (With GPU samples nothing plots it: not read.)
    cores: dict[int, float] = {}
    cpu_bucket = _bucket_of(samples.c.ts_ns, since, width_ns)
    for bucket, core_seconds in [] if util else conn.execute(
            select(cpu_bucket, func.sum(samples.c.util_percent * samples.c.interval_s / 100.0))
            .where(*([samples.c.host == query.host] if query.host is not None else []),
                   samples.c.ts_ns >= since, samples.c.ts_ns < until, samples.c.source == "procfs",
                   samples.c.util_percent.is_not(None), samples.c.interval_s.is_not(None))
            .group_by(cpu_bucket)):
        if core_seconds is not None:
            cores[int(bucket)] = float(core_seconds) / (width_ns / NS)
    orphaned = _orphaned_series(conn, query, width_ns, count)
    series = []
    for index in range(count):
        row = findings.get(index)
        series.append(Bucket(
            start_ns=since + index * width_ns, completed_requests=completed.get(index, 0),
            disconnects=int(row.disconnects) if row is not None else 0,
            zombies=int(row.zombies) + int(row.inflight_zombies) if row is not None else 0,
            wasted_gpu_seconds=float(row.wasted_gpu_seconds) if row is not None else 0.0,
            gpu_util_percent=util.get(index),
            wasted_cpu_seconds=float(row.wasted_cpu_seconds) if row is not None else 0.0,
            engine_cores=cores.get(index),
            orphaned_requests=orphaned[index][0], orphaned_wasted_gpu_seconds=orphaned[index][1],
            orphaned_wasted_cpu_seconds=orphaned[index][2],
        ))
    return series


def _orphaned_series(conn: Connection, query: ReportQuery, width_ns: int, count: int) -> list[list[float]]:
    """Per slice of the window: the work of ports that sent no spans for clients gone, as (mean
    requests at once, GPU-seconds, CPU-seconds), each stretch's figures spread evenly over its time
    (a stretch holds its mean count). Zeros where a filter they cannot honor is set."""
    per_slice = [[0.0, 0.0, 0.0] for _ in range(count)]
    in_window = _orphaned_in_window(query)
    if in_window is None:
        return per_slice
    since, slice_s = query.since_ns, width_ns / NS
    for start_ns, end_ns, request_s, gpu_s, cpu_s in conn.execute(
            select(orphaned.c.start_ns, _orphaned_until(), _finite(orphaned.c.request_seconds),
                   _finite(orphaned.c.wasted_gpu_seconds), _finite(orphaned.c.wasted_cpu_seconds))
            .where(*in_window, orphaned.c.with_spans.is_(False))):
        length = end_ns - start_ns
        if length <= 0:
            continue
        for index in range(max(0, (start_ns - since) // width_ns), min(count, (end_ns - since) // width_ns + 1)):
            low, high = since + index * width_ns, since + (index + 1) * width_ns
            share = (min(high, end_ns) - max(low, start_ns)) / length
            if share > 0:
                figures = per_slice[index]
                figures[0] += (request_s or 0.0) * share / slice_s
                figures[1] += (gpu_s or 0.0) * share
                figures[2] += (cpu_s or 0.0) * share
    return per_slice


def _timeline(conn: Connection, query: ReportQuery, finding: RequestFinding) -> ZombieTimeline:
    if finding.work_end_ns is not None:
        end_ns = finding.work_end_ns
    elif finding.lag_seconds is not None and isfinite(finding.lag_seconds):
        # Still running: the daemon's lag is the zombie time so far, up to its last update.
        end_ns = finding.disconnect_at_ns + int(finding.lag_seconds * NS)
    else:
        end_ns = min(query.until_ns, time.time_ns())
    end_ns = max(end_ns, finding.disconnect_at_ns, finding.request_start_ns + 1)
    step = max(1, -(-(end_ns - finding.request_start_ns) // TIMELINE_POINTS))
    slice_of = _bucket_of(samples.c.ts_ns, finding.request_start_ns, step)
    rows = conn.execute(
        select(slice_of, func.avg(samples.c.util_percent))
        .where(*_whole_gpu_samples(finding.host, finding.request_start_ns, end_ns))
        .group_by(slice_of).order_by(slice_of))
    points = [UtilPoint(ts_ns=finding.request_start_ns + int(index) * step, util_percent=float(mean))
              for index, mean in rows if mean is not None]
    return ZombieTimeline(finding=finding, end_ns=end_ns, utilization=points)


# -- empty windows ------------------------------------------------------------------------------
def _data_range(conn: Connection, query: ReportQuery) -> DataRange | None:
    """First and last request time in the store (matching the filters if any match at all)."""
    def bounds(filtered: bool) -> Sequence[Any]:
        span_where = [spans.c.role == SpanRole.HTTP_SERVER.value]
        verdict_where: list[ColumnElement[bool]] = []
        if filtered:
            span_where += _label_filters(spans, query)
            verdict_where += _label_filters(verdicts, query)
        times = union_all(
            select(func.min(spans.c.start_ns).label("first"), func.max(spans.c.end_ns).label("last"))
            .where(and_(True, *span_where)),
            select(func.min(verdicts.c.request_start_ns).label("first"),
                   func.max(verdicts.c.disconnect_at_ns).label("last"))
            .where(and_(True, *verdict_where)),
        ).subquery()
        return conn.execute(select(func.min(times.c.first), func.max(times.c.last))).one()

    first, last = bounds(filtered=True)
    if first is None and any(v is not None for v in query.filters().values()):
        first, last = bounds(filtered=False)
    if first is None or last is None:
        return None
    return DataRange(first_ns=int(first), last_ns=int(last))


__all__ = ["age_bins", "bucket_width_ns", "build_report", "caller_breakdowns", "with_callers"]
