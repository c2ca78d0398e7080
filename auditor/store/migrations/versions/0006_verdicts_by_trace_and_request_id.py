"""index verdicts by trace id and by request id

The correlator no longer keeps the settled traces that left its memory: when a span arrives for a
trace it does not hold, it asks the store whether this run settled a request of that trace (by
trace id), or, for an engine span in a trace of its own, of its request id. One indexed read per
round of new spans instead of about 110 bytes a request held for the whole 15-minute horizon.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_verdicts_trace_id", "verdicts", ["trace_id"])
    op.create_index("ix_verdicts_request_id", "verdicts", ["request_id"])


def downgrade() -> None:
    op.drop_index("ix_verdicts_request_id", table_name="verdicts")
    op.drop_index("ix_verdicts_trace_id", table_name="verdicts")
