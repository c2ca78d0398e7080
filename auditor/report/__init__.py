"""``auditor report``: findings over a time window, for people (table, HTML) and machines (JSON, CSV).

``build_report(store, ReportQuery(...))`` computes a ``Report`` with SQL aggregation; the
``render_*`` modules turn it into each format. The JSON schema is ``docs/report.schema.json``.
"""

from __future__ import annotations

from auditor.report.model import SCHEMA_ID, Report, ReportQuery, RequestFinding, Totals
from auditor.report.query import build_report

__all__ = ["SCHEMA_ID", "Report", "ReportQuery", "RequestFinding", "Totals", "build_report"]
