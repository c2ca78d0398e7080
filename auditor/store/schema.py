"""SQLAlchemy ORM classes of the store's tables, for the report, capture, replay and tests.

Each maps one Core table of ``auditor.store.tables``, where the columns are defined; the
annotations here only type the attributes. The daemon reads and writes through the tables
themselves and never imports this module (nor SQLAlchemy's ORM).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import DeclarativeBase, Mapped

from auditor.store import tables


class Base(DeclarativeBase):
    metadata = tables.metadata


class ConnEventBlockRow(Base):
    """A batch of the probe's events; ``auditor.store.eventblocks`` reads its body
    (``Store.conn_events()`` gives the events themselves)."""

    __table__ = tables.conn_event_blocks

    id: Mapped[int]
    host: Mapped[str]
    source: Mapped[str]
    format: Mapped[int]
    count: Mapped[int]
    first_ts_ns: Mapped[int]
    last_ts_ns: Mapped[int]
    body: Mapped[bytes]


class SpanRow(Base):
    __table__ = tables.spans

    id: Mapped[int]
    trace_id: Mapped[str]
    span_id: Mapped[str]
    parent_span_id: Mapped[str | None]
    name: Mapped[str]
    kind: Mapped[str]
    role: Mapped[str]
    start_ns: Mapped[int]
    end_ns: Mapped[int]
    service: Mapped[str]
    host: Mapped[str]
    status: Mapped[str]
    peer_addr: Mapped[str | None]
    peer_port: Mapped[int | None]
    server_port: Mapped[int | None]
    request_id: Mapped[str | None]
    route: Mapped[str | None]
    model: Mapped[str | None]
    http_status: Mapped[int | None]
    finish_reason: Mapped[str | None]
    prompt_tokens: Mapped[int | None]
    completion_tokens: Mapped[int | None]
    max_tokens: Mapped[int | None]
    time_in_queue_s: Mapped[float | None]
    time_to_first_token_s: Mapped[float | None]
    process_pid: Mapped[int | None]
    peer_rewritten: Mapped[bool]
    attributes: Mapped[dict[str, Any]]
    start_minute: Mapped[int]  # computed by the database (auditor/store/spankeys.py)


class UtilSampleRow(Base):
    __table__ = tables.util_samples

    id: Mapped[int]
    ts_ns: Mapped[int]
    source: Mapped[str]
    host: Mapped[str]
    gpu_index: Mapped[int | None]
    pid: Mapped[int | None]
    util_percent: Mapped[float | None]
    memory_util_percent: Mapped[float | None]
    memory_bytes: Mapped[int | None]
    power_watts: Mapped[float | None]
    interval_s: Mapped[float | None]


class VerdictRow(Base):
    __table__ = tables.verdicts

    id: Mapped[int]
    request_key: Mapped[str]
    host: Mapped[str]
    verdict: Mapped[str]
    disconnect_at_ns: Mapped[int]
    disconnect_kind: Mapped[str]
    request_start_ns: Mapped[int]
    work_end_ns: Mapped[int | None]
    lag_seconds: Mapped[float | None]
    phase: Mapped[str]
    trace_id: Mapped[str | None]
    request_id: Mapped[str | None]
    service: Mapped[str | None]
    route: Mapped[str | None]
    model: Mapped[str | None]
    client_addr: Mapped[str | None]
    client_port: Mapped[int | None]
    user_agent: Mapped[str | None]
    server_port: Mapped[int | None]
    max_tokens: Mapped[int | None]
    tokens_after_disconnect: Mapped[int | None]
    tokens_exact: Mapped[bool]
    wasted_gpu_seconds: Mapped[float]
    wasted_cpu_seconds: Mapped[float]
    updated_ns: Mapped[int]
    details: Mapped[dict[str, Any]]


class CoverageRow(Base):
    """Counts of what could not become a verdict, per host and moment, summed over any window."""

    __table__ = tables.coverage

    id: Mapped[int]
    ts_ns: Mapped[int]
    host: Mapped[str]
    kind: Mapped[str]
    count: Mapped[int]
    detail: Mapped[str | None]


class OrphanedWorkRow(Base):
    """A stretch of work an engine ran after its clients left, told by its port alone."""

    __table__ = tables.orphaned_work

    id: Mapped[int]
    host: Mapped[str]
    server_port: Mapped[int]
    start_ns: Mapped[int]
    end_ns: Mapped[int | None]
    last_seen_ns: Mapped[int]
    peak: Mapped[int]
    request_seconds: Mapped[float]
    wasted_gpu_seconds: Mapped[float]
    wasted_cpu_seconds: Mapped[float]
    end_resolution_s: Mapped[float | None]
    cut_short: Mapped[bool]
    with_spans: Mapped[bool]
    model: Mapped[str | None]
    cost_unmeasured: Mapped[str | None]


class CaptureRow(Base):
    """A named slice of traffic kept for replay."""

    __table__ = tables.captures

    id: Mapped[int]
    created_ns: Mapped[int]
    name: Mapped[str]
    window_start_ns: Mapped[int]
    window_end_ns: Mapped[int]
    source: Mapped[str]


class CapturedRequestRow(Base):
    __table__ = tables.captured_requests

    id: Mapped[int]
    capture_id: Mapped[int]
    offset_ns: Mapped[int]
    route: Mapped[str]
    model: Mapped[str | None]
    stream: Mapped[bool]
    prompt_tokens: Mapped[int | None]
    max_tokens: Mapped[int | None]
    disconnect_after_ns: Mapped[int | None]
    disconnect_kind: Mapped[str | None]
    original_verdict: Mapped[str | None]
    body: Mapped[dict[str, Any]]


class ReplayRunRow(Base):
    __table__ = tables.replay_runs

    id: Mapped[int]
    started_ns: Mapped[int]
    finished_ns: Mapped[int | None]
    capture_id: Mapped[int | None]
    target: Mapped[str]
    parameters: Mapped[dict[str, Any]]
    summary: Mapped[dict[str, Any]]


class ReplayResultRow(Base):
    __table__ = tables.replay_results

    id: Mapped[int]
    run_id: Mapped[int]
    request_id: Mapped[str]
    trace_id: Mapped[str | None]
    cancel_delay_s: Mapped[float | None]
    disconnect_kind: Mapped[str | None]
    verdict: Mapped[str | None]
    lag_seconds: Mapped[float | None]


class CorrelatorStateRow(Base):
    """Where online correlation stands, so a restart resumes without duplicated verdicts or counts."""

    __table__ = tables.correlator_state

    host: Mapped[str]
    settled_event_id: Mapped[int]
    updated_ns: Mapped[int]
