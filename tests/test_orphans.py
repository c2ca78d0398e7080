"""Stretches of orphaned work from an engine's port alone (auditor.correlate.orphans), and their rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from auditor.correlate.orphans import COST_AFTER_NS, OPEN_WRITE_NS, SILENT_NS, OrphanLedger
from auditor.store.db import Store

S = 1_000_000_000
T0 = 1_700_000_000 * S
PORT = 8080


def ledger(costs: list[tuple[int, int, int]] | None = None, gpu_per_s: float = 0.5) -> OrphanLedger:
    """A ledger whose engine spends ``gpu_per_s`` of a GPU per running request; the parts it was
    asked to cost are appended to ``costs``."""
    def cost_of(port: int, start_ns: int, end_ns: int) -> tuple[float, float, str | None]:
        if costs is not None:
            costs.append((port, start_ns, end_ns))
        return gpu_per_s * (end_ns - start_ns) / S, 0.0, None
    return OrphanLedger("h1", cost_of)


def feed(book: OrphanLedger, counts: list[int], *, start_s: float = 0.0, every_s: float = 0.25) -> int:
    """One scrape every ``every_s`` with these orphan counts, each read in two rounds (a count
    is taken once a newer scrape is read). Returns the time of the last round."""
    now = T0
    for i, count in enumerate(counts):
        ts = T0 + int((start_s + i * every_s) * S)
        for now in (ts + S // 10, ts + S // 5):
            book.read(PORT, (count, ts), now)
    return now


def test_a_stretch_runs_from_the_first_scrape_counting_an_orphan_to_halfway_past_the_last() -> None:
    book = ledger()
    now = feed(book, [0, 0, 1, 1, 1, 1, 0, 0])  # one orphan from 0.5 s, none at 1.5 s
    assert book.take_rows(now) == []  # its last part is not costed yet: samples may still come
    [row] = book.take_rows(now + COST_AFTER_NS + S)
    assert row["start_ns"] == T0 + S // 2
    assert row["end_ns"] == T0 + int(1.375 * S)  # between the last scrape counting it and the first not
    assert row["end_resolution_s"] == 0.25
    assert row["peak"] == 1 and not row["cut_short"]
    assert row["request_seconds"] == pytest.approx(0.875)  # 0.75 s whole, and half the last quarter
    assert row["wasted_gpu_seconds"] == pytest.approx(0.875 * 0.5)  # the engine's share of each, per orphan
    assert book.take_rows(now + 2 * COST_AFTER_NS) == []  # written once
    assert book.totals() == {(PORT, False): pytest.approx((0.875, 0.875 * 0.5, 0.0))}  # /metrics' counters


def test_the_count_is_integrated_between_scrapes_and_the_peak_kept() -> None:
    book = ledger()
    now = feed(book, [1, 3, 3, 2, 0], every_s=1.0)
    [row] = book.take_rows(now + COST_AFTER_NS + S)
    # Trapezoids: (1+3)/2 + 3 + (3+2)/2 + (2+0)/2 request-seconds.
    assert row["request_seconds"] == pytest.approx(2 + 3 + 2.5 + 1)
    assert row["wasted_gpu_seconds"] == pytest.approx((2 + 3 + 2.5 + 1) * 0.5)
    assert row["peak"] == 3


def test_no_orphans_no_stretch() -> None:
    book = ledger()
    now = feed(book, [0] * 20)
    assert book.take_rows(now + COST_AFTER_NS + S, final=True) == []


def test_a_scrape_whose_count_changes_in_a_later_round_counts_as_last_read() -> None:
    """Closes reaching the daemon after a scrape lower its count: the count read last stands."""
    book = ledger()
    book.read(PORT, (1, T0), T0 + S // 10)
    book.read(PORT, (0, T0), T0 + S // 5)  # a close of its time came in
    book.read(PORT, (0, T0 + S), T0 + S + S // 10)
    book.read(PORT, (0, T0 + 2 * S), T0 + 2 * S)
    assert book.take_rows(T0 + 10 * S, final=True) == []


def test_a_long_stretch_is_written_while_it_runs_and_costed_as_its_samples_come() -> None:
    costs: list[tuple[int, int, int]] = []
    book = ledger(costs)
    now = feed(book, [1] * 81)  # 20 s of one orphan, still running
    [row] = book.take_rows(now)
    # Up to the scrape before the last: the latest scrape's count may still fall (closes come in).
    assert row["end_ns"] is None and row["request_seconds"] == pytest.approx(19.75)
    assert costs and max(end for _, _, end in costs) <= now - COST_AFTER_NS
    assert book.take_rows(now + S) == []  # rewritten only every OPEN_WRITE_NS
    [again] = book.take_rows(now + OPEN_WRITE_NS)
    assert again["start_ns"] == row["start_ns"]


def test_a_port_nothing_tells_of_any_more_ends_its_stretch_cut_short() -> None:
    book = ledger()
    now = feed(book, [1, 1, 1])
    book.read(PORT, None, now + SILENT_NS + S)
    [row] = book.take_rows(now + SILENT_NS + COST_AFTER_NS + 2 * S)
    assert row["cut_short"] and row["end_ns"] == T0 + S // 2
    assert row["request_seconds"] == pytest.approx(0.5)


def test_the_daemon_stopping_writes_every_stretch() -> None:
    book = ledger()
    now = feed(book, [0, 2, 2])
    [row] = book.take_rows(now, final=True)
    assert row["cut_short"] and row["peak"] == 2 and row["end_ns"] == T0 + S // 2
    assert row["request_seconds"] == pytest.approx(0.5) and row["wasted_gpu_seconds"] == pytest.approx(0.25)


def test_an_unmeasured_cost_says_why() -> None:
    book = OrphanLedger("h1", lambda port, start, end: (0.0, 0.0, f"the process serving port {port} is not known"))
    now = feed(book, [1, 1, 0])
    [row] = book.take_rows(now, final=True)
    assert row["wasted_gpu_seconds"] == 0 and row["cost_unmeasured"] == "the process serving port 8080 is not known"


def test_a_cost_that_is_not_a_number_counts_as_none_and_says_why(tmp_path: Path) -> None:
    """SQLite stores NaN as NULL, which the table refuses: one broken sample would have kept the
    row unwritable, and the round failing, for good."""
    book = OrphanLedger("h1", lambda port, start, end: (float("nan"), 0.0, None))
    now = feed(book, [1, 1, 0])
    [row] = book.take_rows(now, final=True)
    assert row["wasted_gpu_seconds"] == 0.0 and "not a number" in row["cost_unmeasured"]
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    assert store.write_orphaned_work([row]) == 1
    store.close()


def test_rows_are_stored_and_a_running_stretch_is_replaced_by_its_end(tmp_path: Path) -> None:
    from sqlalchemy import select

    from auditor.store import tables

    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    book = ledger()
    now = feed(book, [1] * 60)
    store.write_orphaned_work(book.take_rows(now))
    now = feed(book, [1, 0], start_s=15.0)
    store.write_orphaned_work(book.take_rows(now + COST_AFTER_NS + S))
    with store.engine.connect() as conn:
        rows = conn.execute(select(tables.orphaned_work)).mappings().all()
    assert len(rows) == 1, rows
    assert rows[0]["end_ns"] == T0 + int(15.125 * S) and rows[0]["request_seconds"] == pytest.approx(15.125)
    store.close()


def correlator_with_a_stretch(tmp_path: Path) -> Any:
    """A correlator on a store of its own whose ledger holds one stretch of one orphan, running."""
    from auditor.correlate.correlator import Correlator

    correlator = Correlator(Store(f"sqlite:///{tmp_path / 'a.db'}"), host="h1")
    correlator.orphaned = ledger()
    feed(correlator.orphaned, [1, 1, 1])
    return correlator


def test_rows_the_store_refuses_are_kept_for_the_next_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy import func, select

    from auditor.errors import StoreError
    from auditor.store import tables

    correlator = correlator_with_a_stretch(tmp_path)
    store = correlator.store
    real = store.write_orphaned_work

    def refuse(rows: list[dict[str, object]]) -> int:
        raise StoreError("write to a.db failed: database is locked")

    monkeypatch.setattr(store, "write_orphaned_work", refuse)
    correlator.finish()
    correlator.finish()
    assert caplog.text.count("orphaned work not written") == 1  # once an outage, not every round
    monkeypatch.setattr(store, "write_orphaned_work", real)
    correlator.finish()
    with store.engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(tables.orphaned_work)) == 1
    assert correlator.stats.orphaned == {(PORT, False): pytest.approx((0.5, 0.25, 0.0))}
    store.close()


def test_rows_the_database_refuses_are_dropped_not_retried_for_ever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from auditor.store.sql import SqlError

    correlator = correlator_with_a_stretch(tmp_path)
    calls = []

    def refuse(rows: list[dict[str, object]]) -> int:
        calls.append(len(rows))
        raise SqlError("NOT NULL constraint failed: orphaned_work.peak")

    monkeypatch.setattr(correlator.store, "write_orphaned_work", refuse)
    correlator.finish()
    correlator.finish()
    assert calls == [1] and "1 stretches dropped" in caplog.text
    correlator.store.close()


def test_stretches_a_killed_run_left_open_are_ended_where_last_written_as_the_daemon_starts(tmp_path: Path) -> None:
    """A daemon killed mid-stretch (an OOM kill under its memory limit) leaves its row open; the next
    run on that host ends it at its last write, cut short, before it counts on with stretches of its
    own. Another host's open stretch is that host's daemon's: left running."""
    from sqlalchemy import select

    from auditor.correlate.correlator import Correlator
    from auditor.store import tables

    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    for host in ("h1", "h2"):
        book = OrphanLedger(host, lambda port, start_ns, end_ns: (0.0, 0.0, None))
        now = feed(book, [1] * 60)
        store.write_orphaned_work(book.take_rows(now))
    Correlator(store, host="h1")
    with store.engine.connect() as conn:
        rows = {row["host"]: row for row in conn.execute(select(tables.orphaned_work)).mappings()}
    assert rows["h1"]["end_ns"] == rows["h1"]["last_seen_ns"] and rows["h1"]["cut_short"], rows["h1"]
    assert rows["h2"]["end_ns"] is None and not rows["h2"]["cut_short"], rows["h2"]
    store.close()
