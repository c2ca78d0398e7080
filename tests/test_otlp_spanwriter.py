"""SpanWriter on a real SQLite store: group commit, bounded queue, isolation of a bad request."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from sqlalchemy import text

from auditor.model import SpanRecord, SpanRole
from auditor.sink import Record
from auditor.store import Store
from collectors.spanwriter import QUEUE_FULL, STORE_UNAVAILABLE, BackPressure, SpanWriter


def record(n: int, **changes: object) -> SpanRecord:
    fields: dict[str, object] = {"trace_id": f"{n:032x}", "span_id": f"{n + 1:016x}", "parent_span_id": None,
                                 "name": f"s{n}", "kind": "server", "start_ns": 1, "end_ns": 2,
                                 "role": SpanRole.HTTP_SERVER, "peer_port": 4000 + n, "attributes": {"k": n}}
    return SpanRecord(**(fields | changes))  # type: ignore[arg-type]


def stored(store: Store) -> list[tuple[object, ...]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT name, role, peer_port, peer_rewritten, attributes FROM spans ORDER BY name"))]


def test_rows_match_the_store_and_duplicates_are_ignored(store: Store) -> None:
    writer = SpanWriter(store).start()
    try:
        assert writer.submit([record(1), record(2, peer_rewritten=True)]) == 2
        writer.submit([record(1)])  # an exporter retry: same ids, stored once
    finally:
        writer.stop()
    assert stored(store) == [("s1", "http_server", 4001, 0, '{"k":1}'), ("s2", "http_server", 4002, 1, '{"k":2}')]
    with store.session() as session:  # readable through the ORM's JSON type as well
        from auditor.store import SpanRow

        assert [row.attributes for row in session.query(SpanRow).order_by(SpanRow.name)] == [{"k": 1}, {"k": 2}]


def test_a_request_that_cannot_be_written_fails_alone(store: Store) -> None:
    writer = SpanWriter(store).start()
    locker = sqlite3.connect(Path(store.engine.url.database or ""), isolation_level=None)
    results: dict[str, object] = {}

    def send(name: str, spans: list[SpanRecord]) -> None:
        try:
            results[name] = writer.submit(spans)
        except BackPressure as exc:
            results[name] = exc

    try:
        locker.execute("BEGIN EXCLUSIVE")  # hold commits so both requests land in one batch
        threads = [threading.Thread(target=send, args=("good", [record(1)])),
                   threading.Thread(target=send, args=("bad", [record(2, attributes={"x": object()})]))]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        locker.execute("ROLLBACK")
        for thread in threads:
            thread.join(10)
    finally:
        locker.close()
        writer.stop()
    assert results["good"] == 1
    bad = results["bad"]
    assert isinstance(bad, BackPressure) and bad.kind == STORE_UNAVAILABLE and "not JSON serializable" in bad.reason
    assert [row[0] for row in stored(store)] == ["s1"]


def test_waits_briefly_for_room_then_refuses(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    writer = SpanWriter(store, max_queue_spans=1, queue_wait_s=0.2).start()
    locker = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        first = threading.Thread(target=writer.submit, args=([record(1)],))
        first.start()
        while writer.queue_depth_spans == 0:
            time.sleep(0.01)
        with pytest.raises(BackPressure) as full:
            writer.check_capacity()
        assert full.value.kind == QUEUE_FULL
        started = time.monotonic()
        with pytest.raises(BackPressure):
            writer.submit([record(2)])
        assert time.monotonic() - started >= 0.2
        # Room appears while a submitter waits: it gets in instead of being refused.
        writer.queue_wait_s = 5.0
        second = threading.Thread(target=writer.submit, args=([record(3)],))
        second.start()
        time.sleep(0.1)
        locker.execute("ROLLBACK")
        first.join(10)
        second.join(10)
        assert [row[0] for row in stored(store)] == ["s1", "s3"]
        assert writer.stats()["refused_queue_full"] == 2
    finally:
        locker.close()
        writer.stop()
        store.close()
    with pytest.raises(BackPressure, match="not running"):
        writer.submit([record(4)])


def test_submitters_commit_in_turn_each_request_once_with_no_thread_of_its_own(store: Store) -> None:
    """Concurrent submitters: one commits (the leader) while the others wait, and one of those
    commits what came meanwhile. Every span lands once, requests share commits, the commits are
    made by the submitting threads, and nothing is left queued or waiting."""
    committed_by: list[str] = []

    class Slow:  # the real store, each commit taking a little longer, so that submitters overlap
        def write(self, records: Sequence[Record]) -> int:
            committed_by.append(threading.current_thread().name)
            time.sleep(0.005)
            return store.write(records)

    threads_before = threading.active_count()
    writer = SpanWriter(Slow()).start()
    assert threading.active_count() == threads_before
    failures: list[BaseException] = []

    def send(sender: int) -> None:
        try:
            for n in range(20):
                assert writer.submit([record(sender * 1000 + n)]) == 1
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    senders = [threading.Thread(target=send, args=(i,), name=f"sender-{i}") for i in range(16)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(30)
    writer.stop()
    assert failures == [] and not any(thread.is_alive() for thread in senders)
    assert len(stored(store)) == 320 and writer.stats()["committed_spans"] == 320
    assert writer.stats()["queue_spans"] == 0 and writer.stats()["commits"] == len(committed_by) < 320
    assert set(committed_by) <= {f"sender-{i}" for i in range(16)}
