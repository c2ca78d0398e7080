"""Spans reach the daemon's correlator from its span writer, in memory, once committed: the same
verdicts as reading them back, a backlog read from the store first, and a catch-up from the store
when the correlator fell behind (real SQLite store, controlled clock)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from auditor.correlate import Correlator
from auditor.correlate.feed import SpanFeed
from auditor.model import RequestVerdict, SpanRecord
from auditor.store import Store
from collectors.spanwriter import BackPressure, SpanWriter
from tests.test_correlate import (
    SERVER_PORT,
    T0,
    Clock,
    S,
    close,
    coverage,
    engine_span,
    http_span,
    verdicts,
)


def correlator(store: Store, clock: Clock, feed: SpanFeed | None, settled: list[RequestVerdict]) -> Correlator:
    return Correlator(store, host="h", grace_seconds=0.5, late_span_seconds=5, clock=clock,
                      watched_ports=lambda: {SERVER_PORT}, on_settled=settled.append, feed=feed)


def client(n: int) -> tuple[str, int]:
    return ("127.0.0.1", 41000 + n)


def request(n: int, *, zombie: bool) -> list[SpanRecord]:
    """Request ``n``: its client leaves at 1 s; the engine runs on to 4 s (zombie) or stops."""
    trace = f"{n:x}"
    return [http_span(trace, 0, 1.0, client=client(n)),
            engine_span(trace, 0, 4.0 if zombie else 1.0, "length" if zombie else "abort", request_id=f"cmpl-{n}")]


def judged(store: Store) -> list[tuple[str, str]]:
    return sorted((row.trace_id or "", row.verdict) for row in verdicts(store))


class _Counted:
    """A store connection that tells ``seen`` each statement it reads with."""

    def __init__(self, conn: Any, seen: Callable[[str], None]) -> None:
        self._conn, self._seen = conn, seen

    def all(self, sql: str, params: Any = None) -> list[Any]:
        self._seen(sql)
        return list(self._conn.all(sql, params))

    def scalar(self, sql: str, params: Any = None) -> Any:
        self._seen(sql)
        return self._conn.scalar(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def count_reads(store: Store, seen: Callable[[str], None]) -> None:
    connect = store.sql.connect

    @contextmanager
    def counted() -> Iterator[_Counted]:
        with connect() as conn:
            yield _Counted(conn, seen)

    store.sql.connect = counted  # type: ignore[method-assign]


def test_fed_spans_give_the_verdicts_of_spans_read_back(tmp_path: pytest.TempPathFactory) -> None:
    stores = {name: Store(f"sqlite:///{tmp_path}/{name}.db") for name in ("read", "fed")}
    feed = SpanFeed()
    clock = Clock()
    settled: dict[str, list[RequestVerdict]] = {"read": [], "fed": []}
    correlators = {"read": correlator(stores["read"], clock, None, settled["read"]),
                   "fed": correlator(stores["fed"], clock, feed, settled["fed"])}
    writer = SpanWriter(stores["fed"], on_commit=feed.committed).start()
    span_reads: dict[str, int] = {"read": 0, "fed": 0}
    for name, store in stores.items():
        count_reads(store, lambda statement, name=name:
                    span_reads.__setitem__(name, span_reads[name] + ("FROM spans" in statement)))
    try:
        for round_ in range(3):
            spans = [s for n in range(round_ * 4, round_ * 4 + 4) for s in request(n, zombie=n % 2 == 0)]
            events = [close(1.0, client=client(n)) for n in range(round_ * 4, round_ * 4 + 4)]
            stores["read"].insert_spans(spans)
            writer.submit(spans)
            for store in stores.values():
                store.insert_conn_events(events)
            clock.now = T0 + (5 + round_) * S
            for name in correlators:
                correlators[name].tick()
        clock.now = T0 + 20 * S
        for name in correlators:
            correlators[name].tick()
    finally:
        writer.stop()
    assert judged(stores["fed"]) == judged(stores["read"])
    assert span_reads == {"read": 4, "fed": 1}  # the fed correlator read the store once: its backlog
    assert sorted(v for _, v in judged(stores["fed"])) == ["aborted"] * 6 + ["zombie"] * 6
    assert len(settled["fed"]) == len(settled["read"]) == 12
    for store in stores.values():
        store.close()


def test_the_backlog_is_read_from_the_store_then_the_feed_and_a_span_seen_both_ways_counts_once(store: Store) -> None:
    feed = SpanFeed()
    clock = Clock()
    store.insert_spans(request(1, zombie=True))  # stored before the daemon started
    writer = SpanWriter(store, on_commit=feed.committed).start()
    try:
        writer.submit(request(2, zombie=True))  # committed before the first round: in the store and the feed
        settled: list[RequestVerdict] = []
        judge = correlator(store, clock, feed, settled)
        # A server span whose connection never closes is counted unjoined, once, however it came.
        lonely = http_span("9", 0, 1.0, client=client(9))
        writer.submit([lonely])
        store.insert_conn_events([close(1.0, client=client(1)), close(1.0, client=client(2))])
        clock.now = T0 + 5 * S
        judge.tick()
        assert judge.arrived == []  # what was stored before the first round is no news (nor counted)
        writer.submit(request(3, zombie=False))  # after the backlog: through the feed only
        store.insert_conn_events([close(1.0, client=client(3))])
        clock.now = T0 + 5 * S + 1
        judge.tick()
        assert sorted(span.trace_id[0] for span in judge.arrived) == ["3", "3"]
        for at in (6, 12, 20):
            clock.now = T0 + at * S
            judge.tick()
    finally:
        writer.stop()
    assert [v for _, v in judged(store)] == ["zombie", "zombie", "aborted"]
    assert len(settled) == 3
    assert coverage(store, "unjoined_span") == 1


def test_a_correlator_that_falls_behind_catches_up_from_the_store(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    feed = SpanFeed(max_spans=4)
    clock = Clock()
    writer = SpanWriter(store, on_commit=feed.committed).start()
    settled: list[RequestVerdict] = []
    judge = correlator(store, clock, feed, settled)
    try:
        judge.tick()  # the (empty) backlog is read: spans come by the feed from now on
        for n in range(1, 5):  # 8 spans waiting: more than the feed keeps
            writer.submit(request(n, zombie=True))
        store.insert_conn_events([close(1.0, client=client(n)) for n in range(1, 5)])
        assert feed.take() is None and feed.overflows == 1
        clock.now = T0 + 5 * S
        with caplog.at_level(logging.WARNING, logger="auditor.correlate.correlator"):
            judge.tick()
        assert "catching up from the store" in caplog.text
        writer.submit(request(5, zombie=False))  # the feed works again after the catch-up
        store.insert_conn_events([close(1.0, client=client(5))])
        for at in (6, 20):
            clock.now = T0 + at * S
            judge.tick()
    finally:
        writer.stop()
    assert [v for _, v in judged(store)] == ["zombie"] * 4 + ["aborted"]
    assert len(settled) == 5


def test_the_writer_tells_only_of_committed_spans_and_a_failing_listener_loses_nothing(store: Store) -> None:
    told: list[Sequence[SpanRecord]] = []
    writer = SpanWriter(store, on_commit=told.append).start()
    try:
        good = http_span("a", 0, 1.0)
        writer.submit([good])
        bad = http_span("b", 0, 1.0)
        with pytest.raises(BackPressure):
            writer.submit([type(bad)(**{**{f: getattr(bad, f) for f in bad.__slots__}, "attributes": {"x": object()}})])
        assert [list(batch) for batch in told] == [[good]]

        def broken(spans: Sequence[SpanRecord]) -> None:
            raise RuntimeError("listener down")

        writer.on_commit = broken
        assert writer.submit([http_span("c", 0, 1.0)]) == 1  # stored and acknowledged all the same
    finally:
        writer.stop()
    with store.session() as session:
        from auditor.store import SpanRow

        assert sorted(row.trace_id[0] for row in session.query(SpanRow)) == ["a", "c"]

