"""The correlator's read of utilization samples: each new sample of its host once, at a cost that
does not grow with the samples the store keeps (hours of them, at tens a second)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from auditor.correlate.waste import _NEW_SAMPLES, SampleCache
from auditor.model import UtilSample
from auditor.store import Store

S = 1_000_000_000
T0 = 1_700_000_000 * S


def samples(host: str, count: int, first_ns: int) -> list[UtilSample]:
    return [UtilSample(ts_ns=first_ns + i * S // 40, source="procfs", host=host, pid=100 + i % 4,
                       util_percent=float(i % 100), interval_s=0.1) for i in range(count)]


def vm_steps(db: Path, cursor: int, host: str) -> int:
    """SQLite's virtual-machine instructions (in hundreds) for one read of the new samples."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    with sqlite3.connect(db) as conn:
        conn.set_progress_handler(count, 100)
        conn.execute(_NEW_SAMPLES, {"cursor": cursor, "host": host}).fetchall()
    return steps


def newest_id(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT max(id) FROM util_samples").fetchone()[0])


def test_new_samples_read_once_and_only_this_hosts(store: Store) -> None:
    read_once_and_only_this_hosts(store)


def test_new_samples_on_postgres(pg_url: str) -> None:
    """The same on a fleet's PostgreSQL, where the read's text must mean the same."""
    store = Store(pg_url)
    try:
        with store.sql.begin() as conn:
            conn.run("DELETE FROM util_samples")
        read_once_and_only_this_hosts(store)
    finally:
        store.close()


def read_once_and_only_this_hosts(store: Store) -> None:
    cache = SampleCache(store, "h")
    store.insert_samples(samples("h", 10, T0) + samples("other", 10, T0))
    cache.refresh(T0 + 10 * S)
    assert cache.pids("procfs") == {100, 101, 102, 103}
    series = cache.series("procfs", 100)
    assert series is not None and len(series.ts) == 3  # samples 0, 4 and 8 of host h
    store.insert_samples(samples("other", 5, T0 + S) + samples("h", 4, T0 + S))
    cache.refresh(T0 + 20 * S)
    assert len(series.ts) == 4  # one new sample of pid 100; none read twice, none of the other host
    assert cache.news_ns is not None


def test_new_samples_cost_does_not_grow_with_the_kept_ones(tmp_path: Path) -> None:
    """Read at a position past every kept sample, with a few new ones behind it, the store with
    30,000 samples kept (host ``h`` and another) costs what one with 100 costs. The read once took
    the index on (host, time) for the host and walked all of the host's samples to filter them by
    id: a round's cost grew with the hours of samples kept."""
    cost = {}
    for kept in (100, 30_000):
        db = tmp_path / f"kept-{kept}.db"
        store = Store(f"sqlite:///{db}")
        store.insert_samples(samples("h", kept, T0) + samples("other", kept // 10, T0))
        cursor = newest_id(db)
        store.insert_samples(samples("h", 5, T0 + 3600 * S) + samples("other", 5, T0 + 3600 * S))
        store.close()
        cost[kept] = vm_steps(db, cursor, "h")
        with sqlite3.connect(db) as conn:
            rows = conn.execute(_NEW_SAMPLES, {"cursor": cursor, "host": "h"}).fetchall()
        assert len(rows) == 5 and all(row[0] > cursor for row in rows)
    assert cost[30_000] <= 2 * cost[100] + 5, cost
