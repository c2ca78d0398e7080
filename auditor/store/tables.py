"""The store's tables as SQLAlchemy Core ``Table`` objects: what the daemon reads and writes through.

The schema itself is created only by the Alembic migrations in ``auditor/store/migrations``; these
tables describe it for queries and must stay in step with the newest migration (a test checks that).
Nanosecond timestamps are stored as 64-bit integers: exact, sortable, and free of time-zone games.

The ORM classes of ``auditor.store.schema`` map these same tables for the report, capture and
replay. The daemon never imports them: SQLAlchemy's ORM is about 6 MiB of a process that runs for
weeks, and Core does everything the daemon asks of its store.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Computed,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
)

from auditor.semconv import MAX_USER_AGENT
from auditor.store.spankeys import DISCONNECT_MINUTE_SQL, START_MINUTE_SQL

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING)


def _id() -> Column[Any]:
    return Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True)


def _ns(name: str) -> Column[Any]:
    """Wall-clock nanoseconds since the epoch, required."""
    return Column(name, BigInteger, nullable=False)


def _host() -> Column[Any]:
    return Column("host", String(255), nullable=False, default="")


def _text(name: str, length: int, **kwargs: Any) -> Column[Any]:
    """A required text column."""
    return Column(name, String(length), nullable=False, **kwargs)


def _json(name: str) -> Column[Any]:
    return Column(name, JSON, nullable=False, default=dict)


# The probe's events, a batch to a row (the body's layout: auditor.store.eventblocks). Read by id
# (the correlator) and by time (its restart, retention); never by connection. AUTOINCREMENT: an id
# is never handed out twice, even once retention has emptied the table, since the correlator's
# saved position is one.
conn_event_blocks = Table(
    "conn_event_blocks", metadata,
    _id(), _host(),
    _text("source", 16, default="bpf"),
    Column("format", Integer, nullable=False),
    Column("count", Integer, nullable=False),
    _ns("first_ts_ns"), _ns("last_ts_ns"),
    Column("body", LargeBinary, nullable=False),
    Index("ix_conn_event_blocks_last_ts_ns", "last_ts_ns"),
    sqlite_autoincrement=True,
)

spans = Table(
    "spans", metadata,
    _id(),
    _text("trace_id", 32),
    _text("span_id", 16),
    Column("parent_span_id", String(16)),
    _text("name", 255),
    _text("kind", 16),
    _text("role", 16),
    _ns("start_ns"), _ns("end_ns"),
    _text("service", 255, default=""),
    _host(),
    _text("status", 8, default="unset"),
    Column("peer_addr", String(64)),
    Column("peer_port", Integer),
    Column("server_port", Integer),
    Column("request_id", String(255)),
    Column("route", String(255)),
    Column("model", String(255)),
    Column("http_status", Integer),
    Column("finish_reason", String(32)),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("max_tokens", Integer),
    Column("time_in_queue_s", Float),
    Column("time_to_first_token_s", Float),
    Column("process_pid", Integer),
    Column("peer_rewritten", Boolean, nullable=False, default=False),
    _json("attributes"),
    # The minute the span started in, computed by the database (spankeys.py): it leads the unique
    # key, so the index pages that take inserts, and retention's deletes, are the newest and the
    # oldest minutes', not a random page of hours of random trace ids each.
    Column("start_minute", BigInteger, Computed(START_MINUTE_SQL, persisted=True), nullable=False),
    Index("uq_spans_start_minute_trace_span", "start_minute", "trace_id", "span_id", unique=True),
    Index("ix_spans_end", "end_ns"),  # the report's window; correlation reads by id
)

util_samples = Table(
    "util_samples", metadata,
    _id(), _ns("ts_ns"),
    _text("source", 16),
    _host(),
    Column("gpu_index", Integer),
    Column("pid", Integer),
    Column("util_percent", Float),
    Column("memory_util_percent", Float),
    Column("memory_bytes", BigInteger),
    Column("power_watts", Float),
    Column("interval_s", Float),
    Index("ix_util_samples_host_ts", "host", "ts_ns"),
)

verdicts = Table(
    "verdicts", metadata,
    _id(),
    _text("request_key", 320),
    _host(),
    _text("verdict", 16),
    _ns("disconnect_at_ns"),
    _text("disconnect_kind", 8),
    _ns("request_start_ns"),
    Column("work_end_ns", BigInteger),
    Column("lag_seconds", Float),
    _text("phase", 16, default="unknown"),
    Column("trace_id", String(32)),
    Column("request_id", String(255)),
    Column("service", String(255)),
    Column("route", String(255)),
    Column("model", String(255)),
    Column("client_addr", String(64)),
    Column("client_port", Integer),
    Column("user_agent", String(MAX_USER_AGENT)),
    Column("server_port", Integer),
    Column("max_tokens", Integer),
    Column("tokens_after_disconnect", Integer),
    Column("tokens_exact", Boolean, nullable=False, default=False),
    Column("wasted_gpu_seconds", Float, nullable=False, default=0.0),
    Column("wasted_cpu_seconds", Float, nullable=False, default=0.0),
    _ns("updated_ns"),
    _json("details"),
    # The minute the client left in, computed by the database (spankeys.py). It leads the index of
    # request ids, so a verdict's insert lands on the newest minutes' pages, not on a random page
    # of days of random ids. A request's trace is found by its key ("host/trace/root": a range of
    # the unique index), and replay's by the disconnect index's range: no index of trace ids.
    Column("disconnect_minute", BigInteger, Computed(DISCONNECT_MINUTE_SQL, persisted=True), nullable=False),
    Index("uq_verdicts_request_key", "request_key", unique=True),
    Index("ix_verdicts_disconnect", "disconnect_at_ns"),
    Index("ix_verdicts_verdict", "verdict"),
    # The correlator's question about engine request ids it no longer holds (auditor.correlate.recall).
    Index("ix_verdicts_minute_request_id", "disconnect_minute", "request_id"),
)

# Counts of what could not become a verdict, per host and moment, summed over any window.
coverage = Table(
    "coverage", metadata,
    _id(), _ns("ts_ns"),
    _host(),
    _text("kind", 32),
    Column("count", Integer, nullable=False, default=1),
    Column("detail", String(255)),
    Index("ix_coverage_ts", "ts_ns"),
)

# Stretches of work an engine ran after its clients left, told by its port alone (its gauges and
# the kernel: auditor.correlate.orphans). One row a stretch, rewritten while it runs (end_ns NULL).
orphaned_work = Table(
    "orphaned_work", metadata,
    _id(),
    _host(),
    Column("server_port", Integer, nullable=False),
    _ns("start_ns"),
    Column("end_ns", BigInteger),
    _ns("last_seen_ns"),
    Column("peak", Integer, nullable=False),
    Column("request_seconds", Float, nullable=False),
    Column("wasted_gpu_seconds", Float, nullable=False, default=0.0),
    Column("wasted_cpu_seconds", Float, nullable=False, default=0.0),
    Column("end_resolution_s", Float),
    Column("cut_short", Boolean, nullable=False, default=False),
    Column("with_spans", Boolean, nullable=False, default=False),
    Column("model", String(255)),
    Column("cost_unmeasured", String(255)),
    Index("uq_orphaned_work_stretch", "host", "server_port", "start_ns", unique=True),
    Index("ix_orphaned_work_start", "start_ns"),
)

# A named slice of traffic kept for replay.
captures = Table(
    "captures", metadata,
    _id(), _ns("created_ns"),
    _text("name", 255),
    _ns("window_start_ns"), _ns("window_end_ns"),
    _text("source", 255, default=""),
)

captured_requests = Table(
    "captured_requests", metadata,
    _id(),
    Column("capture_id", ForeignKey("captures.id", ondelete="CASCADE"), nullable=False),
    Column("offset_ns", BigInteger, nullable=False),  # start relative to the capture's window
    _text("route", 255),
    Column("model", String(255)),
    Column("stream", Boolean, nullable=False, default=False),
    Column("prompt_tokens", Integer),
    Column("max_tokens", Integer),
    Column("disconnect_after_ns", BigInteger),
    Column("disconnect_kind", String(8)),
    Column("original_verdict", String(16)),
    _json("body"),
    Index("ix_captured_requests_capture", "capture_id"),
)

replay_runs = Table(
    "replay_runs", metadata,
    _id(), _ns("started_ns"),
    Column("finished_ns", BigInteger),
    Column("capture_id", ForeignKey("captures.id", ondelete="SET NULL")),
    _text("target", 255),
    _json("parameters"),
    _json("summary"),
)

replay_results = Table(
    "replay_results", metadata,
    _id(),
    Column("run_id", ForeignKey("replay_runs.id", ondelete="CASCADE"), nullable=False),
    _text("request_id", 255),
    Column("trace_id", String(32)),
    Column("cancel_delay_s", Float),
    Column("disconnect_kind", String(8)),
    Column("verdict", String(16)),
    Column("lag_seconds", Float),
    Index("ix_replay_results_run", "run_id"),
)

# Where online correlation stands, so a restart resumes without duplicated verdicts or counts.
correlator_state = Table(
    "correlator_state", metadata,
    Column("host", String(255), primary_key=True),
    Column("settled_event_id", BigInteger, nullable=False, default=0),  # every event <= this is settled
    _ns("updated_ns"),
)
