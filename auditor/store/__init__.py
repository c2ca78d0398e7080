"""The store's public face: the ``Store``, its Core tables, and the ORM classes the report, capture and
replay query.

Everything outside ``auditor`` imports from here, never from the modules inside. The Core tables
and the ORM classes (``SpanRow`` and the rest) are loaded on first use, so that a process which
never asks for them (the daemon on a SQLite file) never imports SQLAlchemy.
"""

from typing import TYPE_CHECKING, Any

from auditor.store.db import (
    Store,
    default_db_url,
    span_from_row,
    sqlite_database,
    unwritable_sqlite,
)
from auditor.store.rows import dumps_json, row_layout, use_batch_rows
from auditor.store.spankeys import found_near

if TYPE_CHECKING:
    from auditor.store import tables
    from auditor.store.schema import (
        Base,
        CapturedRequestRow,
        CaptureRow,
        ConnEventBlockRow,
        CorrelatorStateRow,
        CoverageRow,
        ReplayResultRow,
        ReplayRunRow,
        SpanRow,
        UtilSampleRow,
        VerdictRow,
    )

_ORM_NAMES = frozenset({
    "Base", "CaptureRow", "CapturedRequestRow", "ConnEventBlockRow", "CorrelatorStateRow", "CoverageRow",
    "ReplayResultRow", "ReplayRunRow", "SpanRow", "UtilSampleRow", "VerdictRow",
})

__all__ = [
    "Base",
    "CaptureRow",
    "CapturedRequestRow",
    "ConnEventBlockRow",
    "CorrelatorStateRow",
    "CoverageRow",
    "ReplayResultRow",
    "ReplayRunRow",
    "SpanRow",
    "Store",
    "UtilSampleRow",
    "VerdictRow",
    "default_db_url",
    "dumps_json",
    "found_near",
    "row_layout",
    "span_from_row",
    "sqlite_database",
    "tables",
    "unwritable_sqlite",
    "use_batch_rows",
]


def __getattr__(name: str) -> Any:
    if name == "tables":
        import importlib

        return importlib.import_module("auditor.store.tables")
    if name in _ORM_NAMES:
        from auditor.store import schema

        return getattr(schema, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
