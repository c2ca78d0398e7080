"""stretches of orphaned work, told by an engine's port alone

An engine that sends no spans gives no verdicts, but its gauges and the kernel tell the work it
ran after its clients left. One row per stretch of such work per port
(``auditor.correlate.orphans``), kept as long as the verdicts.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "orphaned_work",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("server_port", sa.Integer(), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=True),
        sa.Column("last_seen_ns", sa.BigInteger(), nullable=False),
        sa.Column("peak", sa.Integer(), nullable=False),
        sa.Column("request_seconds", sa.Float(), nullable=False),
        sa.Column("wasted_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("wasted_cpu_seconds", sa.Float(), nullable=False),
        sa.Column("end_resolution_s", sa.Float(), nullable=True),
        sa.Column("cut_short", sa.Boolean(), nullable=False),
        sa.Column("with_spans", sa.Boolean(), nullable=False),
        sa.Column("model", sa.String(255), nullable=True),
        sa.Column("cost_unmeasured", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_orphaned_work")),
    )
    op.create_index("uq_orphaned_work_stretch", "orphaned_work", ["host", "server_port", "start_ns"], unique=True)
    op.create_index("ix_orphaned_work_start", "orphaned_work", ["start_ns"])


def downgrade() -> None:
    op.drop_index("ix_orphaned_work_start", table_name="orphaned_work")
    op.drop_index("uq_orphaned_work_stretch", table_name="orphaned_work")
    op.drop_table("orphaned_work")
