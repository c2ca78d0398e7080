"""Retention: raw evidence (spans, kernel events, utilization samples) is kept for hours, findings
(verdicts, coverage) for days.

Raw rows are what a verdict is computed from; once the verdict is final they are only needed to
look into it again, and they are most of the database. Rows go in small batches, each its own
short transaction, so on SQLite (one writer at a time) ingest waits at most one batch, never for
the whole clean-up. Only this host's rows are deleted: in a shared PostgreSQL store every daemon
cleans its own, by the same rule. Deleting by the time columns the tables are indexed on needs no
schema change. SQLite reuses freed pages; the file does not shrink (``VACUUM`` offline does that).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from auditor.errors import StoreError
from auditor.store.db import Store
from auditor.store.sql import SqlUnavailable

log = logging.getLogger(__name__)

HOUR_NS = 3600 * 1_000_000_000

# Each table with the indexed time column its age is read from. A block of kernel events goes
# once its last event is old.
RAW_TABLES: tuple[tuple[str, str], ...] = (("spans", "end_ns"), ("conn_event_blocks", "last_ts_ns"),
                                           ("util_samples", "ts_ns"))
FINDING_TABLES: tuple[tuple[str, str], ...] = (("verdicts", "disconnect_at_ns"), ("coverage", "ts_ns"),
                                               ("orphaned_work", "start_ns"))
# Tables whose rows hold many events each, with the column that counts them: batches are sized
# by events there (a block of the probe's records may hold tens of thousands).
EVENT_COUNTS = {"conn_event_blocks": "count"}


@dataclass(frozen=True)
class RetentionPolicy:
    raw_hours: float = 6.0  # 0: keep raw rows forever
    verdict_days: float = 30.0  # 0: keep findings forever
    batch_rows: int = 5000


def prune_table(store: Store, table: str, time_column: str, *, host: str, older_than_ns: int,
                batch_rows: int, pause: Callable[[], bool] = lambda: False) -> int:
    """Delete ``host``'s rows of ``table`` older than ``older_than_ns``, ``batch_rows`` at a time.
    ``pause`` runs between batches (the daemon waits there, letting writers in) and returns True
    to stop early. Returns the rows deleted."""
    if table in EVENT_COUNTS:
        return _prune_blocks(store, table, time_column, host=host, older_than_ns=older_than_ns,
                             batch_events=batch_rows, pause=pause)
    deleted = 0
    # Table and column names come from the constants above, never from outside. A table's newest
    # row stays, however old: SQLite hands out the largest id plus one, so an emptied table would
    # give out ids again that readers keeping a position by id (the correlator's cost, for
    # samples) have passed, and would skip.
    statement = (f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} "
                 f"WHERE host = :host AND {time_column} < :before "
                 f"AND id < (SELECT max(id) FROM {table}) LIMIT :rows)")
    params = {"host": host, "before": older_than_ns, "rows": batch_rows}
    while True:
        try:
            with store.sql.begin() as conn:
                count = conn.run(statement, params)
        except SqlUnavailable as exc:
            raise StoreError(f"pruning {table} in {store.where()} failed: {exc}") from exc
        deleted += count
        if count < batch_rows or pause():
            return deleted


def _prune_blocks(store: Store, table: str, time_column: str, *, host: str, older_than_ns: int,
                  batch_events: int, pause: Callable[[], bool]) -> int:
    """``prune_table`` for a table whose rows hold many events each: a batch is the oldest blocks
    that hold about ``batch_events`` events together (at least one block), so that a batch holds
    the write lock about as long as a batch of rows elsewhere. Returns the blocks deleted."""
    deleted = 0
    params = {"host": host, "before": older_than_ns, "rows": batch_events}
    select = (f"SELECT id, {EVENT_COUNTS[table]} FROM {table} "
              f"WHERE host = :host AND {time_column} < :before ORDER BY id LIMIT :rows")
    delete = f"DELETE FROM {table} WHERE id <= :last AND host = :host AND {time_column} < :before"
    while True:
        try:
            with store.sql.begin() as conn:
                old = conn.all(select, params)
                events = count = 0
                for block_id, block_events in old:
                    if count and events + block_events > batch_events:
                        break
                    events, count, last = events + block_events, count + 1, block_id
                if count:
                    conn.run(delete, {**params, "last": last})
        except SqlUnavailable as exc:
            raise StoreError(f"pruning {table} in {store.where()} failed: {exc}") from exc
        deleted += count
        if count == len(old) < batch_events or not count or pause():
            return deleted


def prune(store: Store, policy: RetentionPolicy, *, host: str, now_ns: int | None = None,
          pause: Callable[[], bool] = lambda: False) -> dict[str, int]:
    """One pass over every table the policy bounds; rows deleted per table."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    deleted: dict[str, int] = {}
    stopped = False

    def pause_or_stop() -> bool:
        nonlocal stopped
        stopped = stopped or pause()
        return stopped

    for bounded, window_ns in ((RAW_TABLES, policy.raw_hours * HOUR_NS),
                               (FINDING_TABLES, policy.verdict_days * 24 * HOUR_NS)):
        if window_ns <= 0:
            continue
        for table, time_column in bounded:
            if stopped:
                return deleted
            deleted[table] = prune_table(
                store, table, time_column, host=host, older_than_ns=now_ns - int(window_ns),
                batch_rows=policy.batch_rows, pause=pause_or_stop)
    return deleted
