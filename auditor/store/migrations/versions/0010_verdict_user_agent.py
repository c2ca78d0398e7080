"""verdicts keep the client's User-Agent

Which SDK, browser or proxy left is on the request's HTTP server span, and spans are deleted after
hours while verdicts are kept for days: the verdict keeps it, for the report's breakdown by it.
Rows written before stay NULL (unknown).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("verdicts", sa.Column("user_agent", sa.String(255), nullable=True))


def downgrade() -> None:
    op.drop_column("verdicts", "user_agent")
