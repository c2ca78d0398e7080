"""The store's public face: the ``Store`` and the table models the report, capture and replay query.

Everything outside ``auditor`` imports from here, never from the modules inside.
"""

from auditor.store.db import Store, default_db_url, span_from_row
from auditor.store.schema import (
    Base,
    CapturedRequestRow,
    CaptureRow,
    ConnEventRow,
    CorrelatorStateRow,
    CoverageRow,
    ReplayResultRow,
    ReplayRunRow,
    SpanRow,
    UtilSampleRow,
    VerdictRow,
)

__all__ = [
    "Base", "CaptureRow", "CapturedRequestRow", "ConnEventRow", "CorrelatorStateRow", "CoverageRow",
    "ReplayResultRow", "ReplayRunRow", "SpanRow", "Store", "UtilSampleRow", "VerdictRow",
    "default_db_url", "span_from_row",
]
