"""The same migrations and writes on a real PostgreSQL server (the fleet set-up)."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, select

from auditor.model import ConnEvent, ConnEventKind, RequestVerdict, SpanRecord, SpanRole, Verdict
from auditor.store import Base, Store, VerdictRow

pytestmark = pytest.mark.postgres




def test_migrations_and_writes_on_postgres(pg_url: str) -> None:
    store = Store(pg_url)
    try:
        assert set(Base.metadata.tables) <= set(inspect(store.engine).get_table_names())
        assert store.current_revision() == store.head_revision()
        event = ConnEvent(ts_ns=1, kind=ConnEventKind.PEER_FIN, family=4, client_addr="127.0.0.1",
                          client_port=1234, server_addr="127.0.0.1", server_port=8000, host="pg")
        store.insert_conn_events([event])
        assert store.conn_events(host="pg") == [event]  # bytea comes back as a memoryview
        span = SpanRecord(trace_id="c" * 32, span_id="d" * 16, parent_span_id=None, name="llm_request",
                          kind="server", start_ns=1, end_ns=2, role=SpanRole.ENGINE, attributes={"k": [1, 2]})
        store.insert_spans([span, span])
        verdict = RequestVerdict(request_key="h/t/s", host="h", verdict=Verdict.INFLIGHT_ZOMBIE,
                                 disconnect_at_ns=10, disconnect_kind="fin", request_start_ns=5,
                                 work_end_ns=None, lag_seconds=None)
        store.upsert_verdicts([verdict])
        store.upsert_verdicts([RequestVerdict(**_as_zombie(verdict))])
        with store.session() as session:
            rows = session.scalars(select(VerdictRow)).all()
        assert [(r.verdict, r.lag_seconds) for r in rows] == [("zombie", 3.0)]
        # Reopening an up-to-date store changes nothing.
        Store(pg_url).close()
    finally:
        store.close()


def _as_zombie(verdict: RequestVerdict) -> dict[str, object]:
    from dataclasses import asdict

    values = asdict(verdict)
    values.update(verdict=Verdict.ZOMBIE, work_end_ns=3_000_000_010, lag_seconds=3.0)
    return values


def test_the_daemons_statements_on_postgres(pg_url: str) -> None:
    """The daemon's SQL text (recall, retention, its reads) on PostgreSQL, through the engine."""
    from tests.test_store import check_daemon_reads

    store = Store(pg_url)
    try:
        with store.sql.begin() as conn:
            for table in ("spans", "verdicts"):
                conn.run(f"DELETE FROM {table}")
        check_daemon_reads(store)
    finally:
        store.close()


def test_stored_events_migrate_to_blocks_on_postgres(pg_url: str) -> None:
    """Migration 0007 on PostgreSQL: rows become blocks with their ids, and the id sequence
    moves past them (explicit ids leave it behind), so the next block gets a new id."""
    from sqlalchemy import text

    url = _fresh_database(pg_url, "migrate7")
    old = Store(url, check=False)
    old.upgrade("0006")
    with old.engine.begin() as conn:
        for port in (1, 2, 3):
            conn.execute(text("INSERT INTO conn_events (ts_ns, kind, family, client_addr, client_port, "
                              "server_addr, server_port, host, source) VALUES "
                              "(:ts, 'peer_fin', 4, '10.0.0.1', :port, '10.0.0.2', 8000, 'h', 'bpf')"),
                         {"ts": 100 + port, "port": port})
        conn.execute(text("INSERT INTO correlator_state (host, settled_event_id, updated_ns) VALUES ('h', 2, 1)"))
    old.close()
    store = Store(url)
    try:
        assert [event.client_port for event in store.conn_events(host="h")] == [1, 2, 3]
        store.insert_conn_events([store.conn_events()[0]])
        with store.engine.connect() as conn:
            assert [i for (i,) in conn.execute(text("SELECT id FROM conn_event_blocks ORDER BY id"))] == [1, 2, 3, 4]
            assert conn.execute(text("SELECT settled_event_id FROM correlator_state")).scalar_one() == (2 << 16) | 0xFFFF
    finally:
        store.close()


def test_spans_take_the_minute_key_on_postgres(pg_url: str) -> None:
    """Migration 0008 on PostgreSQL: the stored start minute column is filled for the spans there."""
    from tests.test_store import check_spans_take_the_minute_key

    url = _fresh_database(pg_url, "migrate8")
    old = Store(url, check=False)
    old.upgrade("0007")
    check_spans_take_the_minute_key(old, lambda: Store(url)).close()


def _fresh_database(pg_url: str, name: str) -> str:
    """The URL of an empty database ``name`` on the server of ``pg_url``."""
    from sqlalchemy import create_engine, text

    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return pg_url.rsplit("/", 1)[0] + "/" + name
