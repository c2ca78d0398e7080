"""Batched storage of connection events in a real, migrated SQLite store."""

from __future__ import annotations

import logging

import pytest

from auditor.errors import StoreError
from auditor.model import ConnEvent, ConnEventKind
from auditor.store import Store
from probes.writer import ConnEventWriter


def make_events(count: int, start: int = 0) -> list[ConnEvent]:
    return [ConnEvent(ts_ns=1_795_000_000_000_000_000 + i, kind=ConnEventKind.PEER_FIN, family=4,
                      client_addr="127.0.0.1", client_port=40_000 + i % 20_000,
                      server_addr="127.0.0.1", server_port=8000,
                      cookie=0x7FFF_8881_05BA_5340 + i, host="h")  # a masked kernel address
            for i in range(start, start + count)]


def stored(store: Store) -> int:
    return len(store.conn_events())


def test_full_batches_are_written_as_they_fill(store: Store) -> None:
    writer = ConnEventWriter(store, batch_size=3, flush_interval_s=60)
    writer.add(make_events(7))
    assert (stored(store), writer.pending, writer.written) == (6, 1, 6)
    assert writer.flush() == 1
    assert stored(store) == 7
    assert store.conn_events() == make_events(7)
    first = store.conn_events()[0]
    assert (first.kind, first.cookie, first.client_port, first.source) == (
        ConnEventKind.PEER_FIN, 0x7FFF_8881_05BA_5340, 40_000, "bpf")


def test_interval_flush_on_a_quiet_host(store: Store) -> None:
    now = [0.0]
    writer = ConnEventWriter(store, batch_size=1000, flush_interval_s=0.5, monotonic=lambda: now[0])
    writer.add(make_events(2))
    assert stored(store) == 0
    now[0] = 0.6
    writer.add([])  # the poll loop calls add() even when nothing came
    assert stored(store) == 2


def test_a_failing_store_keeps_events_and_never_raises_from_add(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    writer = ConnEventWriter(store, batch_size=2, flush_interval_s=60)
    with store.engine.begin() as conn:  # make every insert fail, for real
        conn.exec_driver_sql("ALTER TABLE conn_event_blocks RENAME TO away")
    with caplog.at_level(logging.ERROR):
        writer.add(make_events(5))
        writer.add(make_events(1, start=5))
    assert writer.pending == 6 and writer.write_errors >= 1 and writer.written == 0
    assert caplog.text.count("storing connection events failed") == 1  # logged once
    with pytest.raises(StoreError):
        writer.flush()
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE away RENAME TO conn_event_blocks")
    writer.close()
    assert stored(store) == 6 and writer.pending == 0 and writer.dropped == 0


def test_pending_is_bounded_and_drops_are_counted(store: Store) -> None:
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE conn_event_blocks RENAME TO away")
    writer = ConnEventWriter(store, batch_size=10, flush_interval_s=60, max_pending=25)
    writer.add(make_events(40))
    assert writer.pending == 25 and writer.dropped == 15


def test_bad_settings_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        ConnEventWriter(store, batch_size=0)
    with pytest.raises(ValueError, match="flush_interval_s"):
        ConnEventWriter(store, flush_interval_s=0)


def test_events_added_on_one_thread_and_flushed_on_another_are_stored_once_in_order(store: Store) -> None:
    import threading

    writer = ConnEventWriter(store, batch_size=50, flush_interval_s=60)
    done = threading.Event()

    def flusher() -> None:
        while not done.is_set():
            writer.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for start in range(0, 5000, 7):
            writer.add(make_events(min(7, 5000 - start), start))
    finally:
        done.set()
        thread.join()
    writer.flush()
    cookies = [event.cookie for event in store.conn_events()]
    assert cookies == [0x7FFF_8881_05BA_5340 + i for i in range(5000)]
    assert writer.written == 5000 and writer.pending == 0


def test_an_event_the_store_cannot_hold_is_dropped_and_counted_the_rest_stored(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    writer = ConnEventWriter(store, batch_size=3, flush_interval_s=60)
    odd = make_events(1, start=3)[0]._replace(client_addr="127.0.0.1\n")  # no source makes this
    with caplog.at_level(logging.ERROR):
        writer.add([*make_events(2), odd])
        writer.add(make_events(3, start=4))
    assert "dropped 1 kernel events the store cannot hold: an event's address holds a line break" in caplog.text
    assert (writer.dropped, writer.written, writer.pending) == (1, 5, 0)
    writer.flush()
    assert store.conn_events() == [*make_events(2), *make_events(3, start=4)]
