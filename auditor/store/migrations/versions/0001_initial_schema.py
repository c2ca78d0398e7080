"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22 04:00:16.564062
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "captures",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("window_start_ns", sa.BigInteger(), nullable=False),
        sa.Column("window_end_ns", sa.BigInteger(), nullable=False),
        sa.Column("source", sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_captures")),
    )
    op.create_table(
        "conn_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("family", sa.Integer(), nullable=False),
        sa.Column("client_addr", sa.String(length=64), nullable=False),
        sa.Column("client_port", sa.Integer(), nullable=False),
        sa.Column("server_addr", sa.String(length=64), nullable=False),
        sa.Column("server_port", sa.Integer(), nullable=False),
        sa.Column("cookie", sa.BigInteger(), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conn_events")),
    )
    with op.batch_alter_table("conn_events", schema=None) as batch_op:
        batch_op.create_index("ix_conn_events_ts", ["ts_ns"], unique=False)
        batch_op.create_index(
            "ix_conn_events_tuple_ts",
            ["server_port", "client_port", "client_addr", "ts_ns"],
            unique=False,
        )

    op.create_table(
        "coverage",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("detail", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_coverage")),
    )
    with op.batch_alter_table("coverage", schema=None) as batch_op:
        batch_op.create_index("ix_coverage_ts", ["ts_ns"], unique=False)

    op.create_table(
        "spans",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("trace_id", sa.String(length=32), nullable=False),
        sa.Column("span_id", sa.String(length=16), nullable=False),
        sa.Column("parent_span_id", sa.String(length=16), nullable=True),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=8), nullable=False),
        sa.Column("peer_addr", sa.String(length=64), nullable=True),
        sa.Column("peer_port", sa.Integer(), nullable=True),
        sa.Column("server_port", sa.Integer(), nullable=True),
        sa.Column("request_id", sa.String(length=255), nullable=True),
        sa.Column("route", sa.String(length=255), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("time_in_queue_s", sa.Float(), nullable=True),
        sa.Column("time_to_first_token_s", sa.Float(), nullable=True),
        sa.Column("process_pid", sa.Integer(), nullable=True),
        sa.Column("peer_rewritten", sa.Boolean(), nullable=False),
        sa.Column("attributes", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_spans")),
    )
    with op.batch_alter_table("spans", schema=None) as batch_op:
        batch_op.create_index("ix_spans_end", ["end_ns"], unique=False)
        batch_op.create_index("ix_spans_peer", ["peer_port", "peer_addr"], unique=False)
        batch_op.create_index("ix_spans_request_id", ["request_id"], unique=False)
        batch_op.create_index("uq_spans_trace_span", ["trace_id", "span_id"], unique=True)

    op.create_table(
        "util_samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("util_percent", sa.Float(), nullable=True),
        sa.Column("memory_util_percent", sa.Float(), nullable=True),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("power_watts", sa.Float(), nullable=True),
        sa.Column("interval_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_util_samples")),
    )
    with op.batch_alter_table("util_samples", schema=None) as batch_op:
        batch_op.create_index("ix_util_samples_host_ts", ["host", "ts_ns"], unique=False)

    op.create_table(
        "verdicts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("request_key", sa.String(length=320), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("verdict", sa.String(length=16), nullable=False),
        sa.Column("disconnect_at_ns", sa.BigInteger(), nullable=False),
        sa.Column("disconnect_kind", sa.String(length=8), nullable=False),
        sa.Column("request_start_ns", sa.BigInteger(), nullable=False),
        sa.Column("work_end_ns", sa.BigInteger(), nullable=True),
        sa.Column("lag_seconds", sa.Float(), nullable=True),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("trace_id", sa.String(length=32), nullable=True),
        sa.Column("request_id", sa.String(length=255), nullable=True),
        sa.Column("service", sa.String(length=255), nullable=True),
        sa.Column("route", sa.String(length=255), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("client_addr", sa.String(length=64), nullable=True),
        sa.Column("client_port", sa.Integer(), nullable=True),
        sa.Column("server_port", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("tokens_after_disconnect", sa.Integer(), nullable=True),
        sa.Column("tokens_exact", sa.Boolean(), nullable=False),
        sa.Column("wasted_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("wasted_cpu_seconds", sa.Float(), nullable=False),
        sa.Column("updated_ns", sa.BigInteger(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_verdicts")),
    )
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.create_index("ix_verdicts_disconnect", ["disconnect_at_ns"], unique=False)
        batch_op.create_index("ix_verdicts_verdict", ["verdict"], unique=False)
        batch_op.create_index("uq_verdicts_request_key", ["request_key"], unique=True)

    op.create_table(
        "captured_requests",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "capture_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("offset_ns", sa.BigInteger(), nullable=False),
        sa.Column("route", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("disconnect_after_ns", sa.BigInteger(), nullable=True),
        sa.Column("disconnect_kind", sa.String(length=8), nullable=True),
        sa.Column("original_verdict", sa.String(length=16), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["capture_id"],
            ["captures.id"],
            name=op.f("fk_captured_requests_capture_id_captures"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_captured_requests")),
    )
    with op.batch_alter_table("captured_requests", schema=None) as batch_op:
        batch_op.create_index("ix_captured_requests_capture", ["capture_id"], unique=False)

    op.create_table(
        "replay_runs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("started_ns", sa.BigInteger(), nullable=False),
        sa.Column("finished_ns", sa.BigInteger(), nullable=True),
        sa.Column(
            "capture_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["capture_id"],
            ["captures.id"],
            name=op.f("fk_replay_runs_capture_id_captures"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_runs")),
    )
    op.create_table(
        "replay_results",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("request_id", sa.String(length=255), nullable=False),
        sa.Column("trace_id", sa.String(length=32), nullable=True),
        sa.Column("cancel_delay_s", sa.Float(), nullable=True),
        sa.Column("disconnect_kind", sa.String(length=8), nullable=True),
        sa.Column("verdict", sa.String(length=16), nullable=True),
        sa.Column("lag_seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["replay_runs.id"],
            name=op.f("fk_replay_results_run_id_replay_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_results")),
    )
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.create_index("ix_replay_results_run", ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.drop_index("ix_replay_results_run")

    op.drop_table("replay_results")
    op.drop_table("replay_runs")
    with op.batch_alter_table("captured_requests", schema=None) as batch_op:
        batch_op.drop_index("ix_captured_requests_capture")

    op.drop_table("captured_requests")
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.drop_index("uq_verdicts_request_key")
        batch_op.drop_index("ix_verdicts_verdict")
        batch_op.drop_index("ix_verdicts_disconnect")

    op.drop_table("verdicts")
    with op.batch_alter_table("util_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_util_samples_host_ts")

    op.drop_table("util_samples")
    with op.batch_alter_table("spans", schema=None) as batch_op:
        batch_op.drop_index("uq_spans_trace_span")
        batch_op.drop_index("ix_spans_request_id")
        batch_op.drop_index("ix_spans_peer")
        batch_op.drop_index("ix_spans_end")

    op.drop_table("spans")
    with op.batch_alter_table("coverage", schema=None) as batch_op:
        batch_op.drop_index("ix_coverage_ts")

    op.drop_table("coverage")
    with op.batch_alter_table("conn_events", schema=None) as batch_op:
        batch_op.drop_index("ix_conn_events_tuple_ts")
        batch_op.drop_index("ix_conn_events_ts")

    op.drop_table("conn_events")
    op.drop_table("captures")
