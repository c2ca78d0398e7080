"""Retention on a real SQLite store: old raw rows go, recent ones stay, verdicts outlive spans."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from auditor.config import load_config
from auditor.errors import ConfigError
from auditor.model import (
    ConnEvent,
    ConnEventKind,
    CoverageKind,
    RequestVerdict,
    SpanRecord,
    SpanRole,
    UtilSample,
    Verdict,
)
from auditor.store import SpanRow, Store, tables
from auditor.store.retention import HOUR_NS, RetentionPolicy, prune
from tests.e2e import running_daemon, wait_for

NOW = 1_760_000_000 * 1_000_000_000


def fill(store: Store, host: str, ages_h: list[float], *, tag: str = "", now_ns: int = NOW) -> None:
    """One request per age: its spans, kernel events, samples, verdict, a coverage row and a stretch
    of orphaned work."""
    for i, age in enumerate(ages_h):
        end = now_ns - int(age * HOUR_NS)
        trace = f"{tag}{i:x}".rjust(32, "0")
        store.insert_spans([SpanRecord(trace, "1" * 16, None, "POST /v1/completions", "server", end - 10**9, end,
                                       host=host, role=SpanRole.HTTP_SERVER),
                            SpanRecord(trace, "2" * 16, "1" * 16, "llm_request", "internal", end - 10**9, end,
                                       host=host, role=SpanRole.ENGINE)])
        store.insert_conn_events([ConnEvent(end - 5 * 10**8, kind, 4, "127.0.0.1", 40000 + i, "127.0.0.1", 8000,
                                            host=host) for kind in (ConnEventKind.PEER_FIN, ConnEventKind.CLOSED)])
        store.insert_samples([UtilSample(end, "procfs", host=host, pid=1, util_percent=90.0)])
        store.upsert_verdicts([RequestVerdict(f"{host}/{trace}/{'1' * 16}", host, Verdict.ZOMBIE, end - 5 * 10**8,
                                              "fin", end - 10**9, end, 0.5)])
        store.add_coverage(CoverageKind.IDLE_CLOSE, host=host, ts_ns=end)
        store.write_orphaned_work([{"host": host, "server_port": 8000, "start_ns": end - 10**9, "end_ns": end,
                                    "last_seen_ns": end, "peak": 1, "request_seconds": 1.0, "wasted_gpu_seconds": 0.0,
                                    "wasted_cpu_seconds": 0.5, "end_resolution_s": 0.25, "cut_short": False,
                                    "with_spans": False, "model": None, "cost_unmeasured": None}])


def counts(store: Store, host: str) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {table.name: conn.scalar(select(func.count()).select_from(table).where(table.c.host == host)) or 0
                for table in (tables.spans, tables.conn_event_blocks, tables.util_samples, tables.verdicts, tables.coverage,
                              tables.orphaned_work)}


def test_old_raw_rows_go_recent_stay_and_verdicts_outlive_spans(store: Store) -> None:
    # Ages in hours: two within the raw window, two past it but within the verdict window, one past both.
    fill(store, "h1", [0.5, 5.0, 7.0, 30.0, 24 * 31])
    fill(store, "other", [30.0], tag="f")  # another daemon's rows in a shared store: its own to prune
    pauses = []
    policy = RetentionPolicy(raw_hours=6, verdict_days=30, batch_rows=2)
    deleted = prune(store, policy, host="h1", now_ns=NOW, pause=lambda: pauses.append(1) is not None)
    # A request's two kernel events were stored together: one block.
    assert deleted == {"spans": 6, "conn_event_blocks": 3, "util_samples": 3, "verdicts": 1, "coverage": 1,
                       "orphaned_work": 1}
    assert counts(store, "h1") == {"spans": 4, "conn_event_blocks": 2, "util_samples": 2, "verdicts": 4,
                                   "coverage": 4, "orphaned_work": 4}
    assert counts(store, "other") == {"spans": 2, "conn_event_blocks": 1, "util_samples": 1, "verdicts": 1,
                                      "coverage": 1, "orphaned_work": 1}
    with store.session() as session:
        kept = session.scalars(select(SpanRow.end_ns).where(SpanRow.host == "h1")).all()
    assert min(kept) >= NOW - 6 * HOUR_NS
    # Bounded batches, a pause after each full one: 6 spans at 2 a batch, 3 blocks of 2 events
    # (one a batch), 3 samples.
    assert len(pauses) == 3 + 2 + 1
    assert prune(store, policy, host="h1", now_ns=NOW) == dict.fromkeys(deleted, 0)


def test_blocks_of_kernel_events_go_in_batches_of_about_as_many_events(store: Store) -> None:
    """A block may hold thousands of events: a batch is sized by the events its blocks hold, so
    one batch never holds the write lock for a thousand blocks' worth."""
    old = NOW - 7 * HOUR_NS

    def block(events: int, port: int) -> None:
        store.insert_conn_events([ConnEvent(old + i, ConnEventKind.CLOSED, 4, "127.0.0.1", port, "127.0.0.1", 8000,
                                            host="h1") for i in range(events)])

    for events, port in ((3, 1), (3, 2), (1, 3), (9, 4), (1, 5)):
        block(events, port)
    block(1, 6)
    store.insert_conn_events([ConnEvent(NOW, ConnEventKind.CLOSED, 4, "127.0.0.1", 7, "127.0.0.1", 8000, host="h1")])
    batches: list[int] = []

    def pause() -> bool:
        batches.append(counts(store, "h1")["conn_event_blocks"])
        return False

    deleted = prune(store, RetentionPolicy(raw_hours=6, verdict_days=30, batch_rows=4), host="h1", now_ns=NOW,
                    pause=pause)
    assert deleted["conn_event_blocks"] == 6
    # Blocks left after each full batch: {3}, then {3, 1}, then {9} alone (more than a batch),
    # then {1, 1} and the pass ends (fewer than a batch's events were left).
    assert batches[batches.index(6):batches.index(6) + 3] == [6, 4, 3]
    assert [event.client_port for event in store.conn_events(host="h1")] == [7]


def test_a_tables_newest_row_stays_so_its_id_is_never_handed_out_again(store: Store) -> None:
    """The correlator reads new samples by row id; a table emptied by retention would hand out
    ids from 1 again, below its position, and those samples would never be read."""
    store.insert_samples([UtilSample(NOW - 10 * HOUR_NS + i, "procfs", host="h1", pid=1, util_percent=50.0)
                          for i in range(3)])
    deleted = prune(store, RetentionPolicy(raw_hours=6, verdict_days=30), host="h1", now_ns=NOW)
    assert deleted["util_samples"] == 2 and counts(store, "h1")["util_samples"] == 1
    store.insert_samples([UtilSample(NOW, "procfs", host="h1", pid=1, util_percent=50.0)])
    with store.engine.connect() as conn:
        assert [i for (i,) in conn.exec_driver_sql("SELECT id FROM util_samples ORDER BY id")] == [3, 4]


def test_a_stop_ends_the_pass_between_batches(store: Store) -> None:
    fill(store, "h1", [10.0, 11.0, 12.0])
    deleted = prune(store, RetentionPolicy(raw_hours=6, verdict_days=30, batch_rows=1), host="h1", now_ns=NOW,
                    pause=lambda: True)
    assert deleted == {"spans": 1}
    assert counts(store, "h1")["spans"] == 5


def test_zero_keeps_forever(store: Store) -> None:
    fill(store, "h1", [24 * 400])
    assert prune(store, RetentionPolicy(raw_hours=0, verdict_days=0), host="h1", now_ns=NOW) == {}
    assert counts(store, "h1")["spans"] == 2


def test_the_daemon_prunes_in_the_background(tmp_path: Path) -> None:
    seeded = Store(f"sqlite:///{tmp_path / 'auditor.db'}")
    fill(seeded, "h1", [8.0, 0.1], now_ns=time.time_ns())  # the old rows first: a table's newest row stays
    seeded.close()
    with running_daemon(tmp_path, **{"probe.source": "procfs", "host_id": "h1", "retention.interval_seconds": 0.2,
                                     "retention.raw_hours": 6, "sampler.interval_ms": 10_000}) as daemon:
        assert wait_for(lambda: counts(daemon.store, "h1")["conn_event_blocks"] == 1, timeout_s=20), counts(daemon.store, "h1")
        assert counts(daemon.store, "h1")["spans"] == 2 and counts(daemon.store, "h1")["verdicts"] == 2


@pytest.mark.parametrize(("values", "message"), [
    ({"raw_hours": 0.5}, "keep raw rows at least 1 hour"),
    ({"raw_hours": 48, "verdict_days": 1}, "findings must outlive the evidence"),
    ({"verdict_days": -1}, r"must be 0 \(keep forever\) or more"),
    ({"batch_rows": 0}, "retention.batch_rows must be greater than 0"),
])
def test_bad_retention_is_a_one_line_error(tmp_path: Path, values: dict[str, float], message: str) -> None:
    config = tmp_path / "auditor.toml"
    config.write_text("[retention]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
    with pytest.raises(ConfigError, match=message) as error:
        load_config(config, environ={})
    assert "\n" not in str(error.value)
