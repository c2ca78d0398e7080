"""Machine formats of a report: JSON (schema ``auditor.report/v1``, docs/report.md) and CSV.

The JSON document is written top-level key by key so that the per-request list, which can hold a
hundred thousand objects, goes out one compact object per line: readable with ``less``, greppable,
and several times faster to produce than indenting every nested value.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from json.encoder import encode_basestring
from math import isfinite
from typing import Any, TextIO

from auditor.report.model import (
    SCHEMA_ID,
    BreakdownRow,
    ClientTimeout,
    OrphanedPort,
    Report,
    RequestFinding,
    Wasted,
    waste_by_host,
)
from auditor.timefmt import rfc3339, rfc3339_or_none

# The fields of one request, in order: the JSON object keys and the CSV header.
REQUEST_FIELDS = (
    "request_id", "trace_id", "verdict", "disconnect_at", "disconnect_kind", "work_end_at",
    "lag_seconds", "lag_at_least_seconds", "phase", "route", "model", "service", "client", "user_agent", "host",
    "request_start_at", "max_tokens", "wasted_tokens", "tokens_exact", "wasted_gpu_seconds", "wasted_cpu_seconds",
    "evidence", "unconfirmed_because",
)


def _number(value: float | None, digits: int = 9) -> float | None:
    # NaN and infinities are not JSON; a broken sample must not make the whole document invalid.
    if value is None or not isfinite(value):
        return None
    return round(value, digits)


def _finite(value: float | None) -> float | None:
    # Rounded as the SQLite path rounds (sqlite_json.FLOAT_DIGITS), so both give the same numbers.
    return round(value, 9) if value is not None and isfinite(value) else None


def request_dict(finding: RequestFinding) -> dict[str, Any]:
    return {
        "request_id": finding.request_id,
        "trace_id": finding.trace_id,
        "verdict": finding.verdict,
        "disconnect_at": rfc3339(finding.disconnect_at_ns),
        "disconnect_kind": finding.disconnect_kind,
        "work_end_at": rfc3339_or_none(finding.work_end_ns),
        "lag_seconds": _finite(finding.lag_seconds),
        "lag_at_least_seconds": _finite(finding.lag_at_least_seconds),
        "phase": finding.phase,
        "route": finding.route,
        "model": finding.model,
        "service": finding.service,
        "client": finding.client,
        "user_agent": finding.user_agent,
        "host": finding.host,
        "request_start_at": rfc3339(finding.request_start_ns),
        "max_tokens": finding.max_tokens,
        "wasted_tokens": finding.wasted_tokens,
        "tokens_exact": finding.tokens_exact,
        "wasted_gpu_seconds": _finite(finding.wasted_gpu_seconds),
        "wasted_cpu_seconds": _finite(finding.wasted_cpu_seconds),
        "evidence": finding.evidence,
        "unconfirmed_because": finding.unconfirmed_because,
    }


def _text(value: str | None) -> str:
    return "null" if value is None else encode_basestring(value)


def _json_time(ns: int | None) -> str:
    return "null" if ns is None else f'"{rfc3339(ns)}"'


def _json_int(value: int | None) -> str:
    return "null" if value is None else str(value)


def _json_float(value: float | None) -> str:
    return repr(round(value, 9)) if value is not None and isfinite(value) else "null"


def request_json(finding: RequestFinding) -> str:
    """``request_dict(finding)`` encoded as one compact JSON object, without building the dict.

    The per-request list is most of a report's bytes; a template with the C string escaper is
    about twice as fast as ``json.dumps`` of a dict. A test holds the two encodings equal.
    """
    f = finding
    return (
        f'{{"request_id": {_text(f.request_id)}, "trace_id": {_text(f.trace_id)}, '
        f'"verdict": {encode_basestring(f.verdict)}, '
        f'"disconnect_at": "{rfc3339(f.disconnect_at_ns)}", '
        f'"disconnect_kind": {encode_basestring(f.disconnect_kind)}, '
        f'"work_end_at": {_json_time(f.work_end_ns)}, '
        f'"lag_seconds": {_json_float(f.lag_seconds)}, '
        f'"lag_at_least_seconds": {_json_float(f.lag_at_least_seconds)}, "phase": {encode_basestring(f.phase)}, '
        f'"route": {_text(f.route)}, "model": {_text(f.model)}, "service": {_text(f.service)}, '
        f'"client": {_text(f.client)}, "user_agent": {_text(f.user_agent)}, "host": {encode_basestring(f.host)}, '
        f'"request_start_at": "{rfc3339(f.request_start_ns)}", '
        f'"max_tokens": {_json_int(f.max_tokens)}, "wasted_tokens": {_json_int(f.wasted_tokens)}, '
        f'"tokens_exact": {"true" if f.tokens_exact else "false"}, '
        f'"wasted_gpu_seconds": {_json_float(f.wasted_gpu_seconds)}, '
        f'"wasted_cpu_seconds": {_json_float(f.wasted_cpu_seconds)}, '
        f'"evidence": {_text(f.evidence)}, "unconfirmed_because": {_text(f.unconfirmed_because)}}}'
    )


def _cost(report: Report, wasted: Wasted) -> float | None:
    cost = report.cost(wasted)
    return None if cost is None else _number(cost)


def _breakdown_dict(report: Report, row: BreakdownRow) -> dict[str, Any]:
    return {
        "key": row.key, "disconnects": row.disconnects, "completed": row.completed,
        "aborted": row.aborted, "zombies": row.zombies, "inflight_zombies": row.inflight_zombies,
        "unconfirmed": row.unconfirmed,
        "zombie_seconds": _number(row.zombie_seconds, 6), "wasted_tokens": row.wasted_tokens,
        "wasted_gpu_seconds": _number(row.wasted_gpu_seconds, 6),
        "wasted_cpu_seconds": _number(row.wasted_cpu_seconds, 6),
        "wasted_cost": _cost(report, row),
    }


def _timeout_dict(report: Report, timeout: ClientTimeout) -> dict[str, Any]:
    return {
        "after_seconds": timeout.after_seconds, "from_seconds": timeout.from_seconds,
        "to_seconds": timeout.to_seconds, "disconnects": timeout.disconnects,
        "completed": timeout.completed, "aborted": timeout.aborted, "zombies": timeout.zombies,
        "inflight_zombies": timeout.inflight_zombies, "unconfirmed": timeout.unconfirmed,
        "zombie_seconds": _number(timeout.zombie_seconds, 6),
        "wasted_gpu_seconds": _number(timeout.wasted_gpu_seconds, 6),
        "wasted_cpu_seconds": _number(timeout.wasted_cpu_seconds, 6),
        "wasted_cost": _cost(report, timeout),
        "first_disconnect_at": rfc3339(timeout.first_ns), "last_disconnect_at": rfc3339(timeout.last_ns),
        "default_of": timeout.default_of,
        "zombie_work_mean_seconds": timeout.zombie_work_mean_seconds,
        "zombie_work_max_seconds": timeout.zombie_work_max_seconds,
        "user_agents": [{"user_agent": agent, "disconnects": n} for agent, n in timeout.user_agents],
        "client_addresses": [{"client_address": address, "disconnects": n} for address, n in timeout.client_addresses],
    }


def _orphaned_dict(report: Report, port: OrphanedPort) -> dict[str, Any]:
    return {
        "host": port.host, "server_port": port.server_port, "model": port.model, "stretches": port.stretches,
        "running": port.running, "first_at": rfc3339(port.first_ns), "last_at": rfc3339(port.last_ns),
        "longest_seconds": _number(port.longest_seconds, 6), "peak": port.peak,
        "request_seconds": _number(port.request_seconds, 6),
        "wasted_gpu_seconds": _number(port.wasted_gpu_seconds, 6),
        "wasted_cpu_seconds": _number(port.wasted_cpu_seconds, 6),
        "wasted_cost": _cost(report, port),
        "with_spans": port.with_spans, "cost_unmeasured": port.cost_unmeasured,
    }


def report_header_dict(report: Report) -> dict[str, Any]:
    """The whole JSON document except the per-request list."""
    query, totals, prices = report.query, report.totals, report.prices
    share = totals.wasted_gpu_share
    return {
        "schema": SCHEMA_ID,
        "generated_at": rfc3339(report.generated_ns),
        "window": {
            "since": rfc3339(query.since_ns),
            "until": rfc3339(query.until_ns),
            "seconds": (query.until_ns - query.since_ns) / 1e9,
            "filters": query.filters(),
        },
        "empty": report.empty,
        "note": report.empty_message() if report.empty else None,
        "data_range": None if report.data_range is None else {
            "first": rfc3339(report.data_range.first_ns), "last": rfc3339(report.data_range.last_ns)},
        "totals": {
            "requests": totals.requests,
            "disconnects": totals.disconnects,
            "completed": totals.completed,
            "aborted": totals.aborted,
            "zombies": totals.zombies,
            "inflight_zombies": totals.inflight_zombies,
            "unconfirmed": totals.unconfirmed,
            "zombie_seconds": _number(totals.zombie_seconds, 6),
            "wasted_tokens": totals.wasted_tokens,
            "wasted_tokens_estimated": totals.wasted_tokens_estimated,
            "zombies_without_tokens": totals.zombies_without_tokens,
            "wasted_gpu_seconds": _number(totals.wasted_gpu_seconds, 6),
            "wasted_cpu_seconds": _number(totals.wasted_cpu_seconds, 6),
            "gpus": totals.gpus,
            "gpu_seconds": _number(totals.gpu_seconds, 6),
            "gpu_busy_seconds": _number(totals.gpu_busy_seconds, 6),
            "wasted_gpu_share": _number(share) if share is not None else None,
            "wasted_cost": _cost(report, totals),
            "uncapped_disconnects": totals.uncapped_disconnects,
            "uncosted_zombies": totals.uncosted_zombies,
            "unconfirmed_without_gauges": totals.unconfirmed_without_gauges,
            "unconfirmed_raced": totals.unconfirmed_raced,
            "idle_closes": totals.idle_closes,
            "unjoined_disconnects": totals.unjoined_disconnects,
            "unjoined_spans": totals.unjoined_spans,
            "lost_kernel_events": totals.lost_kernel_events,
            "proxy_rewritten_peers": totals.proxy_rewritten_peers,
            "peerless_span_joins": totals.peerless_span_joins,
        },
        "pricing": None if prices is None else {
            "gpu_hour": prices.gpu_hour or None, "cpu_hour": prices.cpu_hour or None, "currency": prices.currency,
            "gpu_hour_by_host": [{"hosts": pattern, "price": price} for pattern, price in prices.gpu_hour_by_host],
            "cpu_hour_by_host": [{"hosts": pattern, "price": price} for pattern, price in prices.cpu_hour_by_host],
            "unpriced": [{"host": host, "kind": kind.lower()}
                         for host, kind in prices.unpriced_hosts(waste_by_host(totals))]},
        "breakdowns": {dimension: [_breakdown_dict(report, row) for row in rows]
                       for dimension, rows in report.breakdowns.items()},
        "worst_zombies": [request_dict(finding) for finding in report.worst_zombies],
        "client_timeouts": [_timeout_dict(report, timeout) for timeout in report.client_timeouts],
        "orphaned_work": None if report.orphaned_work is None else [
            _orphaned_dict(report, port) for port in report.orphaned_work],
    }


def report_dict(report: Report) -> dict[str, Any]:
    """The JSON document as Python values (for callers that post-process it)."""
    if report.requests_json is not None:
        return report_header_dict(report) | {"requests": [json.loads(t) for t in report.requests_json]}
    return report_header_dict(report) | {"requests": [request_dict(f) for f in report.requests]}


def write_json(report: Report, out: TextIO) -> None:
    header = report_header_dict(report)
    out.write("{\n")
    for key, value in header.items():
        text = json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False)
        out.write(f"  {json.dumps(key)}: {text.replace(chr(10), chr(10) + '  ')},\n")
    out.write('  "requests": [')
    texts = report.requests_json if report.requests_json is not None else map(
        request_json, report.requests)
    first = True
    for text in texts:
        out.write("\n    " if first else ",\n    ")
        out.write(text)
        first = False
    if not first:
        out.write("\n  ")
    out.write("]\n}\n")


def write_csv(findings: Iterable[RequestFinding], out: TextIO) -> None:
    """One row per request with a disconnect; the header row holds the JSON field names."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(REQUEST_FIELDS)
    for finding in findings:
        values = request_dict(finding)
        writer.writerow([_cell(values[name]) for name in REQUEST_FIELDS])


def _cell(value: Any) -> Any:
    # Spelled as in the JSON, so that both formats read the same way.
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value
