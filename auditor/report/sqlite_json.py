"""The per-request JSON objects built inside SQLite, for the large ``--format json`` reports.

A window can hold a hundred thousand requests with a disconnect. Fetching twenty columns a row
into Python objects and encoding them again costs most of the report's time; SQLite's
``json_object`` does the same work in C and hands back one string a row. The objects are the
same as ``render_data.request_dict`` gives (a test compares the two on every kind of row):
nanosecond RFC 3339 times, ``"addr:port"`` clients, ``true``/``false``, floats rounded to 9
decimals, and non-finite numbers as ``null``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, case, func, literal
from sqlalchemy.sql.elements import ColumnElement

from auditor.report.model import ZOMBIE_VERDICTS

NS = 1_000_000_000
FLOAT_DIGITS = 9  # as render_data rounds per-request floats


def _time(column: Any) -> ColumnElement[Any]:
    """Integer nanoseconds as ``2026-11-22T04:00:00.000000001Z``; NULL stays NULL."""
    # printf, not ``+``: with untyped operands SQLAlchemy could render an addition.
    text = func.printf("%s.%09dZ", func.strftime("%Y-%m-%dT%H:%M:%S", column // NS, "unixepoch"),
                       column % NS)
    return case((column.is_(None), None), else_=text)


def _float(column: Any) -> ColumnElement[Any]:
    # SQLite stores NaN as NULL; infinities would print as 9e999, so they become null too.
    return case((func.abs(column) <= 1e300, func.round(column, FLOAT_DIGITS)), else_=None)


def _client(table: Table) -> ColumnElement[Any]:
    addr, port = table.c.client_addr, table.c.client_port
    shown = case((func.instr(addr, ":") > 0, func.printf("[%s]", addr)), else_=addr)
    return case((addr.is_(None), None), (port.is_(None), shown),
                else_=func.printf("%s:%d", shown, port))


def lag_at_least(table: Table) -> ColumnElement[Any]:
    """A zombie's ``details.lag_at_least_s`` (plain SQL, every backend): read for zombies alone, so
    the other verdicts' details are not parsed."""
    return case((table.c.verdict.in_(ZOMBIE_VERDICTS), table.c.details["lag_at_least_s"].as_float()), else_=None)


def verdict_evidence(table: Table) -> ColumnElement[Any]:
    """What said a verdict (``details.evidence``), plain SQL on every backend."""
    evidence: ColumnElement[Any] = table.c.details["evidence"].as_string()
    return evidence


def unconfirmed_reason(table: Table) -> ColumnElement[Any]:
    """Why an unconfirmed verdict is one (``details.unconfirmed_because``), for those alone."""
    return case((table.c.verdict == "unconfirmed", table.c.details["unconfirmed_because"].as_string()), else_=None)


def request_json_column(table: Table) -> ColumnElement[str]:
    """A ``json_object(...)`` over a verdicts table with the keys of one JSON request object."""
    c = table.c
    fields: list[tuple[str, Any]] = [
        ("request_id", c.request_id),
        ("trace_id", c.trace_id),
        ("verdict", c.verdict),
        ("disconnect_at", _time(c.disconnect_at_ns)),
        ("disconnect_kind", c.disconnect_kind),
        ("work_end_at", _time(c.work_end_ns)),
        ("lag_seconds", _float(c.lag_seconds)),
        ("lag_at_least_seconds", _float(lag_at_least(table))),
        ("phase", c.phase),
        ("route", c.route),
        ("model", c.model),
        ("service", c.service),
        ("client", _client(table)),
        ("user_agent", c.user_agent),
        ("host", c.host),
        ("request_start_at", _time(c.request_start_ns)),
        ("max_tokens", c.max_tokens),
        ("wasted_tokens", c.tokens_after_disconnect),
        ("tokens_exact", func.json(case((c.tokens_exact, literal("true")), else_=literal("false")))),
        ("wasted_gpu_seconds", _float(c.wasted_gpu_seconds)),
        ("wasted_cpu_seconds", _float(c.wasted_cpu_seconds)),
        ("evidence", verdict_evidence(table)),
        ("unconfirmed_because", unconfirmed_reason(table)),
    ]
    arguments: list[Any] = []
    for key, value in fields:
        arguments += [literal(key), value]
    return func.json_object(*arguments)
