"""The store: migrations build the schema, bad databases are refused without being touched."""

from __future__ import annotations

import dataclasses
import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect

from auditor.errors import StoreError
from auditor.model import ConnEvent, ConnEventKind, SpanRecord, SpanRole
from auditor.store import Base, Store


def test_migrations_build_every_model_table(store: Store) -> None:
    tables = set(inspect(store.engine).get_table_names())
    assert set(Base.metadata.tables) <= tables
    assert store.current_revision() == store.head_revision()


def test_sqlite_runs_in_wal_mode(store: Store) -> None:
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 10000


def test_corrupt_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "auditor.db"
    path.write_bytes(b"this is not sqlite" * 100)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a readable auditor database"):
        Store(f"sqlite:///{path}")
    assert path.read_bytes() == before


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "auditor.db"
    Store(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(StoreError, match="newer than this auditor knows"):
        Store(f"sqlite:///{path}")


def test_foreign_database_is_not_touched(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(StoreError, match="no auditor schema"):
        Store(f"sqlite:///{path}")


def test_the_head_tables_named_for_the_daemon_are_the_schemas() -> None:
    from auditor.store.db import HEAD_TABLES

    assert set(Base.metadata.tables) | {"alembic_version"} == HEAD_TABLES


def test_a_store_missing_a_table_is_refused_and_db_status_says_which(tmp_path: Path) -> None:
    """A table dropped by hand behind a head revision is named at open (the daemon would otherwise
    fail at its first write) and by ``db status``, which exits 1; nothing is recreated."""
    import subprocess
    import sys

    path = tmp_path / "auditor.db"
    Store(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE verdicts")
    with pytest.raises(StoreError, match=r"lacks its table\(s\) verdicts"):
        Store(f"sqlite:///{path}")
    status = subprocess.run([sys.executable, "-m", "auditor", "db", "status", "--db", f"sqlite:///{path}"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 1 and "table(s) verdicts missing" in status.stdout, (status.stdout, status.stderr)
    with sqlite3.connect(path) as conn:
        assert "verdicts" not in {n for (n,) in conn.execute("SELECT name FROM sqlite_master")}


@pytest.mark.parametrize(("query", "message"), [
    ("foo=bar", r"would ignore the option\(s\) foo"),
    ("mode=ro", r"would ignore the option\(s\) mode; .*only with uri=true"),
    ("timeout=soon", "an option's value cannot be read"),
])
def test_sqlite_url_options_the_driver_would_not_take_are_refused(tmp_path: Path, query: str, message: str) -> None:
    path = tmp_path / "auditor.db"
    with pytest.raises(StoreError, match=message):
        Store(f"sqlite:///{path}?{query}")
    assert not path.exists()


def test_sqlite_url_options_the_driver_takes_open_the_store(tmp_path: Path) -> None:
    path = tmp_path / "auditor.db"
    Store(f"sqlite:///{path}").close()
    store = Store(f"sqlite:///{path}?timeout=3")
    assert store.current_revision() == store.head_revision()
    store.close()
    read_only = Store(f"sqlite:///file:{path}?mode=ro&uri=true", upgrade=False)
    assert read_only.current_revision() == read_only.head_revision()
    read_only.close()


def test_spans_are_not_duplicated(store: Store) -> None:
    span = SpanRecord(trace_id="a" * 32, span_id="b" * 16, parent_span_id=None, name="POST /v1/completions",
                      kind="server", start_ns=1, end_ns=2, role=SpanRole.HTTP_SERVER)
    store.insert_spans([span])
    store.insert_spans([span])
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM spans").scalar() == 1


def test_spans_empty_columns_are_stored_as_null_and_read_back_as_none(store: Store) -> None:
    """The rows stand NaN in for None (rows.driver_null): what SQLite stores is NULL, never a
    number, and a bool an integer; the record read back is the one written."""
    from auditor.store.db import SPAN_COLUMNS, span_from_values
    from auditor.store.rows import driver_null

    bare = SpanRecord(trace_id="c" * 32, span_id="d" * 16, parent_span_id=None, name="POST /generate",
                      kind="server", start_ns=10, end_ns=20, role=SpanRole.HTTP_SERVER)
    full = dataclasses.replace(bare, span_id="e" * 16, parent_span_id="f" * 16, peer_addr="10.0.0.7",
                               peer_port=40_000, server_port=8000, request_id="r-1", http_status=200,
                               time_in_queue_s=0.25, peer_rewritten=True, attributes={"k": None})
    empty = [name for name in SPAN_COLUMNS if getattr(bare, name) is None]
    assert len(empty) >= 10 and math.isnan(driver_null())  # on every SQLite this runs on
    store.insert_spans([bare, full])
    with store.connect() as conn:
        types = conn.all(f"SELECT {', '.join(f'typeof({n})' for n in empty)}, typeof(peer_rewritten), "
                         "peer_rewritten FROM spans ORDER BY span_id")
        rows = conn.all(f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans ORDER BY span_id")
    assert types[0] == (*["null"] * len(empty), "integer", 0)
    assert types[1][-2:] == ("integer", 1)
    assert [t == "null" for t in types[1][:-2]] == [getattr(full, n) is None for n in empty]
    assert [span_from_values(row) for row in rows] == [bare, full]


def test_conn_events_round_trip_a_block_a_host(store: Store) -> None:
    event = ConnEvent(ts_ns=123, kind=ConnEventKind.PEER_RST, family=6, client_addr="::1", client_port=5000,
                      server_addr="::1", server_port=8000, cookie=42, host="h")
    other = event._replace(ts_ns=100, host="g", source="procfs", earliest_ns=90, cookie=None)
    assert store.insert_conn_events([event, other, event._replace(ts_ns=150)]) == 3
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT host, source, format, count, first_ts_ns, last_ts_ns "
                                    "FROM conn_event_blocks ORDER BY id").all()
    assert [tuple(row) for row in rows] == [("h", "bpf", 1, 2, 123, 150), ("g", "procfs", 1, 1, 100, 100)]
    assert store.conn_events(host="h") == [event, event._replace(ts_ns=150)]
    assert store.conn_events(host="g") == [other]
    assert store.conn_events(since_ns=124) == [event._replace(ts_ns=150)]


def test_a_damaged_block_is_skipped_and_named_the_rest_read(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    first = ConnEvent(ts_ns=1, kind=ConnEventKind.PEER_FIN, family=4, client_addr="10.0.0.1", client_port=1,
                      server_addr="10.0.0.2", server_port=8000, host="h")
    store.insert_conn_events([first])
    store.insert_conn_events([first._replace(ts_ns=2)])
    store.insert_conn_events([first._replace(ts_ns=3)])
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE conn_event_blocks SET body = substr(body, 1, 20) WHERE id = 2")
    with caplog.at_level(logging.ERROR):
        assert [event.ts_ns for event in store.conn_events()] == [1, 3]
    assert "skipped 1 stored kernel events that do not decode (block 2: its checksum does not match" in caplog.text


def test_block_ids_are_not_handed_out_again_once_retention_emptied_the_table(store: Store) -> None:
    event = ConnEvent(ts_ns=1, kind=ConnEventKind.PEER_FIN, family=4, client_addr="10.0.0.1", client_port=1,
                      server_addr="10.0.0.2", server_port=8000, host="h")
    store.insert_conn_events([event])
    store.insert_conn_events([event])
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM conn_event_blocks")
    store.insert_conn_events([event])
    with store.engine.connect() as conn:  # the correlator's position is past 2: a new 1 would be skipped
        assert conn.exec_driver_sql("SELECT id FROM conn_event_blocks").scalar_one() == 3


def _downgrade(store: Store, revision: str) -> None:
    from alembic import command
    from alembic.config import Config as AlembicConfig

    from auditor.store.db import MIGRATIONS_DIR

    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with store.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def test_events_stored_as_rows_migrate_to_blocks_with_positions_and_details_kept(tmp_path: Path) -> None:
    """An older store's events become one-event blocks; the correlator's saved position and the
    coverage details that name events still name the same events (and back down again)."""
    path = tmp_path / "auditor.db"
    old = Store(f"sqlite:///{path}", check=False)
    old.upgrade("0006")
    rows = [(10 + i, "peer_fin" if i % 2 else "closed", 4, "127.0.0.1", 40000 + i, "127.0.0.1", 8000,
             None if i == 2 else 7 + i, "h" if i < 4 else "g", "bpf" if i < 3 else "procfs",
             None if i < 3 else 5 + i) for i in range(6)]
    with old.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO conn_events (ts_ns, kind, family, client_addr, client_port, server_addr, "
                             "server_port, cookie, host, source, earliest_ns) VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
        conn.exec_driver_sql("INSERT INTO correlator_state (host, settled_event_id, updated_ns) VALUES ('h', 3, 1)")
        conn.exec_driver_sql("INSERT INTO coverage (ts_ns, host, kind, count, detail) VALUES "
                             "(1, 'h', 'no_span', 1, 'ev:4'), (1, 'h', 'no_span', -1, 'ev:4:undo'), "
                             "(1, 'h', 'no_span', 1, 'other')")
    old.close()
    store = Store(f"sqlite:///{path}")
    assert store.current_revision() == store.head_revision()
    assert [tuple(event) for event in store.conn_events()] == [
        (ts, ConnEventKind(kind), *rest) for ts, kind, *rest in rows]
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT settled_event_id FROM correlator_state").scalar_one() == (3 << 16) | 0xFFFF
        assert [d for (d,) in conn.exec_driver_sql("SELECT detail FROM coverage ORDER BY id")] == [
            f"ev:{4 << 16}", f"ev:{4 << 16}:undo", "other"]
    store.insert_conn_events([store.conn_events()[0]])
    _downgrade(store, "0006")  # and back: rows again, the position and details on the same events
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM conn_events").scalar_one() == 7
        assert conn.exec_driver_sql("SELECT settled_event_id FROM correlator_state").scalar_one() == 3
        assert [d for (d,) in conn.exec_driver_sql("SELECT detail FROM coverage ORDER BY id")] == [
            "ev:4", "ev:4:undo", "other"]
    store.close()


def check_spans_take_the_minute_key(old: Store, reopen: Any) -> Store:
    """Spans stored before migration 0008 (``old``, at 0007) are keyed by their start minute after
    it: the minute is computed for each, and a resent copy is dropped."""
    minute, t0 = 60 * 10**9, 1_800_000_000 * 10**9
    stored = [(f"{i:032x}", f"{i:016x}", t0 + i * 40 * 10**9) for i in range(4)]
    with old.engine.begin() as conn:
        for trace_id, span_id, start_ns in stored:
            conn.exec_driver_sql(
                "INSERT INTO spans (trace_id, span_id, name, kind, role, start_ns, end_ns, service, host, status, "
                "peer_rewritten, attributes) VALUES (%(t)s, %(s)s, 'x', 'server', 'http_server', %(b)s, %(e)s, "
                "'', 'h', 'unset', false, '{}')" if old.dialect == "postgresql" else
                "INSERT INTO spans (trace_id, span_id, name, kind, role, start_ns, end_ns, service, host, status, "
                "peer_rewritten, attributes) VALUES (:t, :s, 'x', 'server', 'http_server', :b, :e, '', 'h', 'unset', "
                "0, '{}')", {"t": trace_id, "s": span_id, "b": start_ns, "e": start_ns + 1})
    old.close()
    store: Store = reopen()
    assert store.current_revision() == store.head_revision()
    with store.connect() as conn:
        assert conn.all("SELECT start_ns, start_minute FROM spans ORDER BY id") == [
            (start_ns, start_ns // minute) for _trace, _span, start_ns in stored]
    trace_id, span_id, start_ns = stored[1]
    store.insert_spans([SpanRecord(trace_id=trace_id, span_id=span_id, parent_span_id=None, name="x", kind="server",
                                   start_ns=start_ns, end_ns=start_ns + 1, role=SpanRole.HTTP_SERVER, host="h")])
    with store.connect() as conn:
        assert conn.scalar("SELECT count(*) FROM spans") == len(stored)
    return store


def test_spans_stored_before_the_minute_key_take_it(tmp_path: Path) -> None:
    path = tmp_path / "auditor.db"
    old = Store(f"sqlite:///{path}", check=False)
    old.upgrade("0007")
    store = check_spans_take_the_minute_key(old, lambda: Store(f"sqlite:///{path}"))
    _downgrade(store, "0007")  # and back: the (trace id, span id) key again, every span kept
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM spans").scalar_one() == 4
        assert "uq_spans_trace_span" in {i["name"] for i in inspect(conn).get_indexes("spans")}
    store.close()


def test_models_match_the_migrations(store: Store) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == [], f"tables.py and the migrations differ; write a migration: {diff}"


@pytest.mark.parametrize("in_child", [False, True])
def test_older_schema_is_migrated_at_open(tmp_path: Path, in_child: bool) -> None:
    path = tmp_path / "auditor.db"
    store = Store(f"sqlite:///{path}", check=False)
    store.upgrade("0001")
    assert store.current_revision() == "0001"
    store.close()
    reopened = Store(f"sqlite:///{path}", migrate_in_child=in_child)
    assert reopened.current_revision() == reopened.head_revision() != "0001"


def test_revisions_read_from_the_scripts_are_alembics() -> None:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from auditor.store.db import MIGRATIONS_DIR, revisions

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    scripts = ScriptDirectory.from_config(config)
    known, head = revisions()
    assert head == scripts.get_current_head()
    assert known == {script.revision for script in scripts.walk_revisions()}


def test_a_daemons_store_migrates_in_a_child_and_never_imports_alembic(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "auditor.db"
    check = ("import sys; from auditor.store import Store; "
             f"s = Store('sqlite:///{path}', migrate_in_child=True); "
             "print(s.current_revision() == s.head_revision(), 'alembic' in sys.modules, 'mako' in sys.modules)")
    for _ in range(2):  # a new database, then one already at the head
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", "False", "False"]
    assert set(inspect(Store(f"sqlite:///{path}").engine).get_table_names()) >= set(Base.metadata.tables)


def test_a_failed_child_migration_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "auditor.db"
    monkeypatch.setattr("auditor.store.db.sys.executable", str(tmp_path / "no-python"))
    with pytest.raises(StoreError, match=r"could not migrate .*auditor\.db: the migration process failed"):
        Store(f"sqlite:///{path}", migrate_in_child=True)
    monkeypatch.setattr("auditor.store.db.sys.executable", "/bin/false")  # exits 1, says nothing
    with pytest.raises(StoreError, match=r"could not migrate .*auditor\.db: exit status 1"):
        Store(f"sqlite:///{path}", migrate_in_child=True)


def test_records_are_their_tables_columns() -> None:
    """The driver's inserts and reads name the records' fields as columns: a table and its record
    that drift apart fail here, not in a daemon's write. (The database computes ``start_minute``.)"""
    from auditor.model import RequestVerdict, UtilSample
    from auditor.store import tables
    from auditor.store.rows import shape_of

    for table, record, extra in ((tables.spans, SpanRecord, ("start_minute",)), (tables.util_samples, UtilSample, ()),
                                 (tables.verdicts, RequestVerdict, ("updated_ns", "disconnect_minute"))):
        assert {c.name for c in table.columns} - {"id"} == set(shape_of(record).names) | set(extra), table.name


def _judged_span_and_verdict() -> tuple[SpanRecord, Any]:
    from auditor.model import RequestVerdict, Verdict

    span = SpanRecord(trace_id="c" * 32, span_id="d" * 16, parent_span_id=None, name="POST /v1/completions",
                      kind="server", start_ns=1, end_ns=2, role=SpanRole.HTTP_SERVER, host="h",
                      peer_addr="10.0.0.1", peer_port=0, peer_rewritten=True,
                      attributes={"auditor.final_send": True, "k": [1, "é"]})
    verdict = RequestVerdict(request_key=f"h/{'c' * 32}/{'d' * 16}", host="h", verdict=Verdict.ZOMBIE,
                             disconnect_at_ns=10, disconnect_kind="rst", request_start_ns=1, work_end_ns=40,
                             lag_seconds=3.0, trace_id="c" * 32, request_id="req-c", tokens_after_disconnect=7, tokens_exact=True,
                             details={"joined_by": "tuple", "scrapes": [1, 2]})
    return span, verdict


def check_daemon_reads(store: Store) -> None:
    """What the daemon writes, it reads back as it was: a forgotten trace's span and verdict (JSON
    and boolean columns included), the correlator's position, a retention pass."""
    from auditor.correlate.recall import Forgotten
    from auditor.store.retention import prune_table

    span, verdict = _judged_span_and_verdict()
    forgotten = Forgotten(store, "h", holds=lambda trace_id, root_id: False, horizon_start=lambda: 0)
    store.insert_spans([span])
    forgotten.written([verdict])
    store.upsert_verdicts([verdict])
    store.upsert_verdicts([verdict])  # the second replaces the first
    assert forgotten.traces(["c" * 32, "d" * 32]) == {"c" * 32}
    assert forgotten.by_request_id(["req-c", "req-d"]) == {"req-c": "c" * 32}
    spans, requests = forgotten.recall("c" * 32)
    assert spans == [span] and spans[0].peer_rewritten is True
    assert [r.written for r in requests] == [verdict] and requests[0].written.tokens_exact is True
    check_recall_by_minutes(store, forgotten)
    later = dataclasses.replace(span, span_id="e" * 16, start_ns=4, end_ns=5)  # the newest row stays anyway
    store.insert_spans([later])
    assert prune_table(store, "spans", "end_ns", host="h", older_than_ns=3, batch_rows=10) == 1
    with store.connect() as conn:
        assert conn.scalar("SELECT span_id FROM spans WHERE trace_id = :t", {"t": "c" * 32}) == "e" * 16
        assert conn.scalar("SELECT count(*) FROM verdicts WHERE trace_id = :t", {"t": "c" * 32}) == 1


def check_recall_by_minutes(store: Store, forgotten: Any) -> None:
    """A recalled trace brings back its spans of every minute from the horizon before its
    request's start to the horizon after its work's end (the key leads with the start minute),
    and none of the trace's spans outside them."""
    from auditor.model import RequestVerdict, Verdict

    minute, t0 = 60 * 10**9, 1_800_000_000 * 10**9  # t0 starts a minute
    root = SpanRecord(trace_id="f" * 32, span_id="1" * 16, parent_span_id=None, name="POST /v1/completions",
                      kind="server", start_ns=t0 + 5 * 10**9, end_ns=t0 + 6 * 10**9, role=SpanRole.HTTP_SERVER,
                      host="h")
    at = {"2": t0 - 14 * minute, "3": t0 + 59 * 10**9, "4": t0 + 2 * minute + 16 * minute - 10**9,
          "5": t0 - 16 * minute, "6": t0 + 2 * minute + 17 * minute}  # the work ends 2 min after t0
    store.insert_spans([root, *(dataclasses.replace(root, span_id=k * 16, start_ns=ns, end_ns=ns + 1)
                                for k, ns in at.items())])
    verdict = RequestVerdict(request_key=f"h/{'f' * 32}/{'1' * 16}", host="h", verdict=Verdict.ZOMBIE,
                             disconnect_at_ns=t0 + 5 * 10**9 + 1, disconnect_kind="rst",
                             request_start_ns=root.start_ns, work_end_ns=t0 + 2 * minute, lag_seconds=1.0,
                             trace_id="f" * 32)
    forgotten.written([verdict])
    store.upsert_verdicts([verdict])
    spans, requests = forgotten.recall("f" * 32)
    assert sorted(s.span_id[0] for s in spans) == ["1", "2", "3", "4"] and len(requests) == 1
    assert forgotten.recall("9" * 32) == ([], [])  # no verdict: nothing
    # A request start a bad clock put decades back: a day of minutes named, the trace's span found.
    stray = dataclasses.replace(root, trace_id="8" * 32)
    store.insert_spans([stray])
    store.upsert_verdicts([dataclasses.replace(verdict, request_key=f"h/{'8' * 32}/{'1' * 16}", trace_id="8" * 32,
                                               request_start_ns=1)])
    assert [s.span_id for s in forgotten.recall("8" * 32)[0]] == ["1" * 16]


def test_verdicts_are_found_by_index_and_new_ones_land_on_the_newest_minutes(store: Store) -> None:
    """The correlator's lookups of verdicts it no longer holds, and replay's of its run's, read an
    index, not the table; and the request-id index leads with the disconnect minute, so a verdict's
    insert lands beside the newest minute's (no index of random ids alone: bench/verdict_growth.py)."""
    from sqlalchemy import event

    from auditor.correlate import recall
    from replay.client import RequestPlan
    from replay.run import verdicts_for

    with store.connect() as conn:
        by_index = {name: conn.all(f"PRAGMA index_info({name})") for (name,) in
                    conn.all("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'verdicts'")}
        plans = {"trace": (recall._WRITTEN_OF_TRACE, {"first": "h/a/", "after": "h/a0", "since": 0}),
                 "request id": (recall._WRITTEN_BY_REQUEST_ID.format(minutes=":m0, :m1", names=":v0, :v1"),
                                {"m0": 1, "m1": 2, "v0": "x", "v1": "y", "host": "h", "since": 0})}
        for what, (sql, params) in plans.items():
            plan = " ".join(row[-1] for row in conn.all(f"EXPLAIN QUERY PLAN {sql}", params))
            assert "USING INDEX" in plan and "SCAN" not in plan, (what, plan)
    led_by = {name: columns[0][2] for name, columns in by_index.items() if not name.startswith("sqlite_")}
    random_led = {name for name, first in led_by.items() if first in ("trace_id", "request_id")}
    assert random_led == set() and led_by["ix_verdicts_minute_request_id"] == "disconnect_minute", led_by
    seen: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        seen.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        verdicts_for(store, [RequestPlan(request_id="r", trace_id="c" * 32, body={})], started_ns=10**18)
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    ((statement, parameters),) = [(s, p) for s, p in seen if "FROM verdicts" in s]
    with store.engine.connect() as conn:
        plan = " ".join(row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters))
    assert "ix_verdicts_disconnect" in plan and "SCAN" not in plan, plan


def test_a_request_id_is_looked_for_in_the_horizons_minutes_only(store: Store) -> None:
    """A verdict whose client left within the horizon (or a little past the correlator's clock) is
    found by its request id; one that left before the horizon is not (it is never recalled)."""
    from auditor.correlate.recall import Forgotten
    from auditor.model import RequestVerdict, Verdict

    minute, t0 = 60 * 10**9, 1_800_000_000 * 10**9
    now = t0 + 60 * minute
    forgotten = Forgotten(store, "h", lambda _trace, _root: False, lambda: now - 15 * minute, 15 * minute)
    at = {"old": now - 16 * minute, "edge": now - 15 * minute + 1, "now": now, "ahead": now + 4 * minute}
    written = [RequestVerdict(f"h/{name:0>32}/{'1' * 16}", "h", Verdict.ABORTED, ts, "rst", ts - 10**9, None, None,
                              trace_id=f"{name:0>32}", request_id=f"req-{name}") for name, ts in at.items()]
    forgotten.written(written)
    store.upsert_verdicts(written)
    found = forgotten.by_request_id([f"req-{name}" for name in at])
    assert found == {f"req-{name}": f"{name:0>32}" for name in ("edge", "now", "ahead")}
    # By trace, the old one is found in the store, and left to it: it disconnected before the horizon.
    assert forgotten.traces([f"{name:0>32}" for name in at]) == {f"{name:0>32}" for name in ("edge", "now", "ahead")}


def test_a_sqlite_file_is_read_and_written_without_sqlalchemy(store: Store) -> None:
    from auditor.store.sql import SqliteSql

    assert isinstance(store.sql, SqliteSql)
    check_daemon_reads(store)
    with store.connect() as conn:  # the driver's connections carry the store's settings
        assert conn.scalar("PRAGMA journal_mode") == "wal"
        assert conn.scalar("PRAGMA wal_autocheckpoint") == 10000


def test_sqlite_in_memory_goes_through_one_engine() -> None:
    from auditor.store.sql import EngineSql

    store = Store("sqlite://")
    try:
        assert isinstance(store.sql, EngineSql)
        check_daemon_reads(store)
    finally:
        store.close()


def test_a_failed_transaction_leaves_nothing_and_its_connection_serves_again(store: Store) -> None:
    from auditor.store.sql import SqlError

    with pytest.raises(SqlError, match="no such table"), store.sql.begin() as conn:
        conn.run("INSERT INTO coverage (ts_ns, host, kind, count) VALUES (1, 'h', 'x', 1)")
        conn.run("INSERT INTO no_such_table VALUES (1)")
    with pytest.raises(RuntimeError), store.sql.begin() as conn:
        conn.run("INSERT INTO coverage (ts_ns, host, kind, count) VALUES (2, 'h', 'x', 1)")
        raise RuntimeError("the caller failed")
    with store.connect() as conn:
        assert conn.scalar("SELECT count(*) FROM coverage") == 0


def test_connections_are_shared_by_threads_one_at_a_time(store: Store) -> None:
    """The span writer, event writer, sampler and correlator each take a connection when they
    need one: concurrent writers each commit, and no more connections stay open than were busy."""
    import threading

    def write(n: int) -> None:
        for i in range(50):
            store.add_coverage_rows([{"ts_ns": n * 1000 + i, "host": "h", "kind": "x", "count": 1, "detail": None}])

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with store.connect() as conn:
        assert conn.scalar("SELECT count(*) FROM coverage") == 200
    assert 1 <= len(store.sql._idle) <= 4  # type: ignore[attr-defined]


def test_a_locked_database_is_a_store_error_naming_it(store: Store) -> None:
    blocker = sqlite3.connect(store.url.removeprefix("sqlite:///"), timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")
    store.sql.timeout_s = 0.1  # type: ignore[attr-defined]
    store.sql.close()
    try:
        with pytest.raises(StoreError, match=r"write to sqlite:///.*auditor\.db failed: database is locked"):
            store.add_coverage_rows([{"ts_ns": 1, "host": "h", "kind": "x", "count": 1, "detail": None}])
    finally:
        blocker.rollback()
        blocker.close()
