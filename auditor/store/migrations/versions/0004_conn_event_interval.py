"""conn_events.earliest_ns: the interval of a polled event

The /proc (and sock_diag) fallback only knows that a socket changed state between two polls: the
last poll that saw the old state (``earliest_ns``) and the first that saw the new one (``ts_ns``).
Joins and verdicts use the interval; eBPF events are exact and leave it NULL.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conn_events") as batch:
        batch.add_column(sa.Column("earliest_ns", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("conn_events") as batch:
        batch.drop_column("earliest_ns")
