"""spans keyed by their start minute first

The unique (trace id, span id) index took every new span on a page of its own, random trace ids
being random, and retention's delete of every old span on another: with hours of spans held these
two cost the span writer more than all else (bench/span_index_growth.py). The key is now (start
minute, trace id, span id), the minute computed by the database from start_ns, so inserts go to the
newest minute's pages and deletes to the oldest's (auditor/store/spankeys.py).

SQLite adds the column as VIRTUAL (ALTER TABLE cannot add a STORED one; the index holds its value);
PostgreSQL as STORED (the only kind it has), which rewrites the table once.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The expression of auditor.store.spankeys.START_MINUTE_SQL, written out: a migration stays as it
# was written whatever the code becomes.
_START_MINUTE = "start_ns / 60000000000"


def upgrade() -> None:
    kind = "STORED" if op.get_bind().dialect.name == "postgresql" else "VIRTUAL"
    op.execute(f"ALTER TABLE spans ADD COLUMN start_minute BIGINT NOT NULL "
               f"GENERATED ALWAYS AS ({_START_MINUTE}) {kind}")
    op.create_index("uq_spans_start_minute_trace_span", "spans", ["start_minute", "trace_id", "span_id"],
                    unique=True)
    op.drop_index("uq_spans_trace_span", table_name="spans")


def downgrade() -> None:
    op.create_index("uq_spans_trace_span", "spans", ["trace_id", "span_id"], unique=True)
    op.drop_index("uq_spans_start_minute_trace_span", table_name="spans")
    op.drop_column("spans", "start_minute")
