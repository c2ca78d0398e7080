"""Build a ``Report`` from the store with SQL aggregation.

Every figure is computed in the database (``GROUP BY`` and conditional sums), so a window of a
million requests costs a handful of queries, not a Python loop over rows. Only the per-request list
(one row per request that had a disconnect) and the few worst zombies come back row by row.

What belongs to a window:
- requests: HTTP server spans whose start falls in it;
- findings: verdicts whose disconnect falls in it;
- coverage: coverage counts whose timestamp falls in it;
- GPU time: the window's length for every GPU that reported whole-device NVML samples in it.
``--host`` applies to all of them; ``--service``, ``--route`` and ``--model`` apply to requests and
findings (coverage and GPU samples carry no such label).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Table, and_, case, func, literal_column, select, union_all
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement

from auditor.errors import StoreError
from auditor.model import CoverageKind, SpanRole
from auditor.report.model import (
    BREAKDOWN_DIMENSIONS,
    ZOMBIE_VERDICTS,
    BreakdownRow,
    Bucket,
    DataRange,
    Report,
    ReportQuery,
    RequestFinding,
    Totals,
    UtilPoint,
    ZombieTimeline,
)
from auditor.schema import CoverageRow, SpanRow, UtilSampleRow, VerdictRow
from auditor.store import Store

spans = cast(Table, SpanRow.__table__)
verdicts = cast(Table, VerdictRow.__table__)
coverage = cast(Table, CoverageRow.__table__)
samples = cast(Table, UtilSampleRow.__table__)

NS = 1_000_000_000
# Bucket widths for the over-time plots, from which the smallest giving <= MAX_BUCKETS is chosen.
NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
                  43200, 86400, 172800, 604800)
MAX_BUCKETS = 72
TIMELINE_POINTS = 48

FINDING_COLUMNS = (
    verdicts.c.request_id, verdicts.c.trace_id, verdicts.c.verdict, verdicts.c.disconnect_at_ns,
    verdicts.c.disconnect_kind, verdicts.c.request_start_ns, verdicts.c.work_end_ns,
    verdicts.c.lag_seconds, verdicts.c.phase, verdicts.c.route, verdicts.c.model, verdicts.c.service,
    verdicts.c.client_addr, verdicts.c.client_port, verdicts.c.host, verdicts.c.max_tokens,
    verdicts.c.tokens_after_disconnect, verdicts.c.tokens_exact, verdicts.c.wasted_gpu_seconds,
    verdicts.c.wasted_cpu_seconds,
)


def build_report(store: Store, query: ReportQuery, *, with_requests: bool = True,
                 with_series: bool = False) -> Report:
    """Everything a report shows for ``query``'s window.

    ``with_requests`` loads the per-request list (JSON, CSV); ``with_series`` the time buckets and
    the worst zombies' utilization (HTML). A database error becomes a ``StoreError``.
    """
    if query.until_ns <= query.since_ns:
        raise StoreError("the window is empty: --since must be before --until")
    try:
        with store.engine.connect() as conn:
            return _build(conn, query, with_requests=with_requests, with_series=with_series)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise StoreError(f"reading the report from {store._where()} failed: {reason}") from exc


def _build(conn: Connection, query: ReportQuery, *, with_requests: bool, with_series: bool) -> Report:
    totals = Totals()
    _fill_verdict_totals(conn, query, totals)
    totals.requests = int(conn.execute(
        select(func.count()).select_from(spans).where(*_span_filter(query))).scalar_one())
    _fill_coverage(conn, query, totals)
    _fill_gpu_time(conn, query, totals)
    report = Report(
        query=query, generated_ns=time.time_ns(), totals=totals,
        breakdowns={dim: _breakdown(conn, query, dim) for dim in BREAKDOWN_DIMENSIONS},
        worst_zombies=_worst_zombies(conn, query),
    )
    if with_requests and totals.disconnects:
        rows = conn.execute(select(*FINDING_COLUMNS).where(*_verdict_filter(query))
                            .order_by(verdicts.c.disconnect_at_ns, verdicts.c.id))
        report.requests = [_finding(row) for row in rows]
    if with_series:
        report.bucket_ns = bucket_width_ns(query.until_ns - query.since_ns)
        report.series = _series(conn, query, report.bucket_ns)
        report.timelines = [_timeline(conn, query, finding) for finding in report.worst_zombies]
    if report.empty:
        report.data_range = _data_range(conn, query)
    return report


# -- filters ------------------------------------------------------------------------------------
def _label_filters(table: Any, query: ReportQuery) -> list[ColumnElement[bool]]:
    return [table.c[name] == value for name, value in query.filters().items() if value is not None]


def _verdict_filter(query: ReportQuery) -> list[ColumnElement[bool]]:
    return [verdicts.c.disconnect_at_ns >= query.since_ns, verdicts.c.disconnect_at_ns < query.until_ns,
            *_label_filters(verdicts, query)]


def _span_filter(query: ReportQuery) -> list[ColumnElement[bool]]:
    return [spans.c.role == SpanRole.HTTP_SERVER.value,
            spans.c.start_ns >= query.since_ns, spans.c.start_ns < query.until_ns,
            *_label_filters(spans, query)]


def _host_filter(table: Any, query: ReportQuery) -> list[ColumnElement[bool]]:
    return [table.c.host == query.host] if query.host is not None else []


def _whole_gpu_samples(host: str | None, since_ns: int, until_ns: int) -> list[ColumnElement[bool]]:
    """Whole-device NVML samples (no pid) in a time range, of one host or of all."""
    return [*([samples.c.host == host] if host is not None else []),
            samples.c.ts_ns >= since_ns, samples.c.ts_ns < until_ns,
            samples.c.source == "nvml", samples.c.pid.is_(None), samples.c.gpu_index.is_not(None)]


# -- totals -------------------------------------------------------------------------------------
def _count_if(condition: ColumnElement[bool]) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


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
        _sum(case((zombie, v.lag_seconds), else_=0.0)).label("zombie_seconds"),
        _sum(v.tokens_after_disconnect).label("wasted_tokens"),
        _sum(v.wasted_gpu_seconds).label("wasted_gpu_seconds"),
    ]


def _fill_verdict_totals(conn: Connection, query: ReportQuery, totals: Totals) -> None:
    v = verdicts.c
    row = conn.execute(select(
        *_verdict_aggregates(),
        _sum(case((v.tokens_exact.is_(False), v.tokens_after_disconnect), else_=0))
        .label("wasted_tokens_estimated"),
        _sum(v.wasted_cpu_seconds).label("wasted_cpu_seconds"),
        _count_if(v.max_tokens.is_(None)).label("uncapped"),
    ).where(*_verdict_filter(query))).one()
    totals.disconnects = int(row.disconnects)
    totals.completed = int(row.completed)
    totals.aborted = int(row.aborted)
    totals.zombies = int(row.zombies)
    totals.inflight_zombies = int(row.inflight_zombies)
    totals.zombie_seconds = float(row.zombie_seconds)
    totals.wasted_tokens = int(row.wasted_tokens)
    totals.wasted_tokens_estimated = int(row.wasted_tokens_estimated)
    totals.wasted_gpu_seconds = float(row.wasted_gpu_seconds)
    totals.wasted_cpu_seconds = float(row.wasted_cpu_seconds)
    totals.uncapped_disconnects = int(row.uncapped)


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


def _fill_gpu_time(conn: Connection, query: ReportQuery, totals: Totals) -> None:
    where = _whole_gpu_samples(query.host, query.since_ns, query.until_ns)
    gpus = select(samples.c.host, samples.c.gpu_index).where(*where).distinct().subquery()
    totals.gpus = int(conn.execute(select(func.count()).select_from(gpus)).scalar_one())
    busy = conn.execute(select(_sum(samples.c.util_percent / 100.0 * samples.c.interval_s))
                        .where(*where)).scalar_one()
    totals.gpu_busy_seconds = float(busy)
    totals.gpu_seconds = totals.gpus * (query.until_ns - query.since_ns) / NS


# -- breakdowns and lists -----------------------------------------------------------------------
def _breakdown(conn: Connection, query: ReportQuery, dimension: str) -> list[BreakdownRow]:
    column = verdicts.c[dimension]
    rows = conn.execute(
        select(column.label("key"), *_verdict_aggregates())
        .where(*_verdict_filter(query)).group_by(column)
        .order_by(literal_column("zombie_seconds").desc(), literal_column("disconnects").desc(),
                  column))
    return [BreakdownRow(
        key=row.key, disconnects=int(row.disconnects), completed=int(row.completed),
        aborted=int(row.aborted), zombies=int(row.zombies), inflight_zombies=int(row.inflight_zombies),
        zombie_seconds=float(row.zombie_seconds), wasted_tokens=int(row.wasted_tokens),
        wasted_gpu_seconds=float(row.wasted_gpu_seconds),
    ) for row in rows]


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
    return RequestFinding(
        request_id=row.request_id, trace_id=row.trace_id, verdict=row.verdict,
        disconnect_at_ns=row.disconnect_at_ns, disconnect_kind=row.disconnect_kind,
        request_start_ns=row.request_start_ns, work_end_ns=row.work_end_ns,
        lag_seconds=row.lag_seconds, phase=row.phase, route=row.route, model=row.model,
        service=row.service, client_addr=row.client_addr, client_port=row.client_port,
        host=row.host, max_tokens=row.max_tokens, wasted_tokens=row.tokens_after_disconnect,
        tokens_exact=bool(row.tokens_exact), wasted_gpu_seconds=row.wasted_gpu_seconds or 0.0,
        wasted_cpu_seconds=row.wasted_cpu_seconds or 0.0,
    )


# -- over time (HTML) ---------------------------------------------------------------------------
def bucket_width_ns(window_ns: int) -> int:
    """The narrowest round bucket width that cuts the window into at most MAX_BUCKETS slices."""
    for seconds in NICE_BUCKETS_S:
        if window_ns <= seconds * NS * MAX_BUCKETS:
            return seconds * NS
    return -(-window_ns // MAX_BUCKETS)


def _bucket_of(column: Any, since_ns: int, width_ns: int) -> Any:
    # Integer division on integer operands in both SQLite and PostgreSQL.
    return ((column - since_ns) / width_ns).label("bucket")


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
                                     .where(*_whole_gpu_samples(query.host, since, until))
                                     .group_by(sample_bucket)):
        if mean is not None:
            util[int(bucket)] = float(mean)
    series = []
    for index in range(count):
        row = findings.get(index)
        series.append(Bucket(
            start_ns=since + index * width_ns, completed_requests=completed.get(index, 0),
            disconnects=int(row.disconnects) if row is not None else 0,
            zombies=int(row.zombies) + int(row.inflight_zombies) if row is not None else 0,
            wasted_gpu_seconds=float(row.wasted_gpu_seconds) if row is not None else 0.0,
            gpu_util_percent=util.get(index),
        ))
    return series


def _timeline(conn: Connection, query: ReportQuery, finding: RequestFinding) -> ZombieTimeline:
    end_ns = finding.work_end_ns if finding.work_end_ns is not None else query.until_ns
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


__all__ = ["bucket_width_ns", "build_report"]
