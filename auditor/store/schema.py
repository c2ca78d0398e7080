"""SQLAlchemy 2 table models of the store.

The schema itself is created only by the Alembic migrations in ``auditor/store/migrations``; these models
describe it for queries and must stay in step with the newest migration (a test checks that).
Nanosecond timestamps are stored as 64-bit integers: exact, sortable, and free of time-zone games.
"""

from __future__ import annotations

from typing import Annotated, Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

int_pk = Annotated[int, mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)]
ns_time = Annotated[int, mapped_column(BigInteger)]  # wall-clock nanoseconds since the epoch
host_name = Annotated[str, mapped_column(String(255), default="")]


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON}


class ConnEventRow(Base):
    __tablename__ = "conn_events"
    # Read by id (the correlator) and by time (its restart, retention); never by connection.
    __table_args__ = (Index("ix_conn_events_ts", "ts_ns"),)

    id: Mapped[int_pk]
    ts_ns: Mapped[ns_time]
    kind: Mapped[str] = mapped_column(String(16))
    family: Mapped[int] = mapped_column(Integer)
    client_addr: Mapped[str] = mapped_column(String(64))
    client_port: Mapped[int] = mapped_column(Integer)
    server_addr: Mapped[str] = mapped_column(String(64))
    server_port: Mapped[int] = mapped_column(Integer)
    cookie: Mapped[int | None] = mapped_column(BigInteger)
    host: Mapped[host_name]
    source: Mapped[str] = mapped_column(String(16), default="bpf")
    earliest_ns: Mapped[int | None] = mapped_column(BigInteger)  # polled events: seen unchanged then


class SpanRow(Base):
    __tablename__ = "spans"
    __table_args__ = (
        Index("uq_spans_trace_span", "trace_id", "span_id", unique=True),
        Index("ix_spans_end", "end_ns"),  # the report's window; correlation reads by id
    )

    id: Mapped[int_pk]
    trace_id: Mapped[str] = mapped_column(String(32))
    span_id: Mapped[str] = mapped_column(String(16))
    parent_span_id: Mapped[str | None] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(16))
    role: Mapped[str] = mapped_column(String(16))
    start_ns: Mapped[ns_time]
    end_ns: Mapped[ns_time]
    service: Mapped[str] = mapped_column(String(255), default="")
    host: Mapped[host_name]
    status: Mapped[str] = mapped_column(String(8), default="unset")
    peer_addr: Mapped[str | None] = mapped_column(String(64))
    peer_port: Mapped[int | None] = mapped_column(Integer)
    server_port: Mapped[int | None] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(String(255))
    route: Mapped[str | None] = mapped_column(String(255))
    model: Mapped[str | None] = mapped_column(String(255))
    http_status: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    time_in_queue_s: Mapped[float | None] = mapped_column(Float)
    time_to_first_token_s: Mapped[float | None] = mapped_column(Float)
    process_pid: Mapped[int | None] = mapped_column(Integer)
    peer_rewritten: Mapped[bool] = mapped_column(Boolean, default=False)
    attributes: Mapped[dict[str, Any]] = mapped_column(default=dict)


class UtilSampleRow(Base):
    __tablename__ = "util_samples"
    __table_args__ = (Index("ix_util_samples_host_ts", "host", "ts_ns"),)

    id: Mapped[int_pk]
    ts_ns: Mapped[ns_time]
    source: Mapped[str] = mapped_column(String(16))
    host: Mapped[host_name]
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    util_percent: Mapped[float | None] = mapped_column(Float)
    memory_util_percent: Mapped[float | None] = mapped_column(Float)
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    power_watts: Mapped[float | None] = mapped_column(Float)
    interval_s: Mapped[float | None] = mapped_column(Float)


class VerdictRow(Base):
    __tablename__ = "verdicts"
    __table_args__ = (
        Index("uq_verdicts_request_key", "request_key", unique=True),
        Index("ix_verdicts_disconnect", "disconnect_at_ns"),
        Index("ix_verdicts_verdict", "verdict"),
    )

    id: Mapped[int_pk]
    request_key: Mapped[str] = mapped_column(String(320))
    host: Mapped[host_name]
    verdict: Mapped[str] = mapped_column(String(16))
    disconnect_at_ns: Mapped[ns_time]
    disconnect_kind: Mapped[str] = mapped_column(String(8))
    request_start_ns: Mapped[ns_time]
    work_end_ns: Mapped[int | None] = mapped_column(BigInteger)
    lag_seconds: Mapped[float | None] = mapped_column(Float)
    phase: Mapped[str] = mapped_column(String(16), default="unknown")
    trace_id: Mapped[str | None] = mapped_column(String(32))
    request_id: Mapped[str | None] = mapped_column(String(255))
    service: Mapped[str | None] = mapped_column(String(255))
    route: Mapped[str | None] = mapped_column(String(255))
    model: Mapped[str | None] = mapped_column(String(255))
    client_addr: Mapped[str | None] = mapped_column(String(64))
    client_port: Mapped[int | None] = mapped_column(Integer)
    server_port: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    tokens_after_disconnect: Mapped[int | None] = mapped_column(Integer)
    tokens_exact: Mapped[bool] = mapped_column(Boolean, default=False)
    wasted_gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    wasted_cpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    updated_ns: Mapped[ns_time]
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)


class CoverageRow(Base):
    """Counts of what could not become a verdict, per host and moment, summed over any window."""

    __tablename__ = "coverage"
    __table_args__ = (Index("ix_coverage_ts", "ts_ns"),)

    id: Mapped[int_pk]
    ts_ns: Mapped[ns_time]
    host: Mapped[host_name]
    kind: Mapped[str] = mapped_column(String(32))
    count: Mapped[int] = mapped_column(Integer, default=1)
    detail: Mapped[str | None] = mapped_column(String(255))


class CaptureRow(Base):
    """A named slice of traffic kept for replay."""

    __tablename__ = "captures"

    id: Mapped[int_pk]
    created_ns: Mapped[ns_time]
    name: Mapped[str] = mapped_column(String(255))
    window_start_ns: Mapped[ns_time]
    window_end_ns: Mapped[ns_time]
    source: Mapped[str] = mapped_column(String(255), default="")


class CapturedRequestRow(Base):
    __tablename__ = "captured_requests"
    __table_args__ = (Index("ix_captured_requests_capture", "capture_id"),)

    id: Mapped[int_pk]
    capture_id: Mapped[int] = mapped_column(ForeignKey("captures.id", ondelete="CASCADE"))
    offset_ns: Mapped[int] = mapped_column(BigInteger)  # start relative to the capture's window
    route: Mapped[str] = mapped_column(String(255))
    model: Mapped[str | None] = mapped_column(String(255))
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    disconnect_after_ns: Mapped[int | None] = mapped_column(BigInteger)
    disconnect_kind: Mapped[str | None] = mapped_column(String(8))
    original_verdict: Mapped[str | None] = mapped_column(String(16))
    body: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ReplayRunRow(Base):
    __tablename__ = "replay_runs"

    id: Mapped[int_pk]
    started_ns: Mapped[ns_time]
    finished_ns: Mapped[int | None] = mapped_column(BigInteger)
    capture_id: Mapped[int | None] = mapped_column(ForeignKey("captures.id", ondelete="SET NULL"))
    target: Mapped[str] = mapped_column(String(255))
    parameters: Mapped[dict[str, Any]] = mapped_column(default=dict)
    summary: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ReplayResultRow(Base):
    __tablename__ = "replay_results"
    __table_args__ = (Index("ix_replay_results_run", "run_id"),)

    id: Mapped[int_pk]
    run_id: Mapped[int] = mapped_column(ForeignKey("replay_runs.id", ondelete="CASCADE"))
    request_id: Mapped[str] = mapped_column(String(255))
    trace_id: Mapped[str | None] = mapped_column(String(32))
    cancel_delay_s: Mapped[float | None] = mapped_column(Float)
    disconnect_kind: Mapped[str | None] = mapped_column(String(8))
    verdict: Mapped[str | None] = mapped_column(String(16))
    lag_seconds: Mapped[float | None] = mapped_column(Float)


class CorrelatorStateRow(Base):
    """Where online correlation stands, so a restart resumes without duplicated verdicts or counts."""

    __tablename__ = "correlator_state"

    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    settled_event_id: Mapped[int] = mapped_column(BigInteger, default=0)  # every event <= this is settled
    updated_ns: Mapped[ns_time]
