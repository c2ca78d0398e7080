"""verdicts' request ids indexed by disconnect minute first, trace ids by the request key

The indexes of trace ids and request ids took every new verdict on a random page of each, as the
spans' trace-id key did (0008): a verdict's write cost 29 us on an empty table and 68 us with
500,000 held (bench/verdict_growth.py), retention keeping days of them. A trace's verdicts are
found by their request key ("host/trace/root", a range of the unique index) and replay's by the
disconnect index, so the trace-id index goes; the request-id index is led by the minute the client
left in, computed by the database from disconnect_at_ns, so its inserts go to the newest minutes'
pages.

SQLite adds the column as VIRTUAL (ALTER TABLE cannot add a STORED one; the index holds its value);
PostgreSQL as STORED (the only kind it has), which rewrites the table once.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# The expression of auditor.store.spankeys.DISCONNECT_MINUTE_SQL, written out: a migration stays as
# it was written whatever the code becomes.
_DISCONNECT_MINUTE = "disconnect_at_ns / 60000000000"


def upgrade() -> None:
    kind = "STORED" if op.get_bind().dialect.name == "postgresql" else "VIRTUAL"
    op.execute(f"ALTER TABLE verdicts ADD COLUMN disconnect_minute BIGINT NOT NULL "
               f"GENERATED ALWAYS AS ({_DISCONNECT_MINUTE}) {kind}")
    op.create_index("ix_verdicts_minute_request_id", "verdicts", ["disconnect_minute", "request_id"])
    op.drop_index("ix_verdicts_request_id", table_name="verdicts")
    op.drop_index("ix_verdicts_trace_id", table_name="verdicts")


def downgrade() -> None:
    op.create_index("ix_verdicts_trace_id", "verdicts", ["trace_id"])
    op.create_index("ix_verdicts_request_id", "verdicts", ["request_id"])
    op.drop_index("ix_verdicts_minute_request_id", table_name="verdicts")
    op.drop_column("verdicts", "disconnect_minute")
