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
        store.insert_conn_events([ConnEvent(ts_ns=1, kind=ConnEventKind.PEER_FIN, family=4,
                                            client_addr="127.0.0.1", client_port=1234,
                                            server_addr="127.0.0.1", server_port=8000)])
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
