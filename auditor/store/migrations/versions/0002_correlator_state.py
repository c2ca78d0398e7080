"""correlator resume state

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "correlator_state",
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("settled_event_id", sa.BigInteger(), nullable=False),
        sa.Column("updated_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("host", name=op.f("pk_correlator_state")),
    )


def downgrade() -> None:
    op.drop_table("correlator_state")
