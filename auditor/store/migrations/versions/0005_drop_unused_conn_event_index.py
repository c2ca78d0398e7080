"""drop the conn_events index that no query uses

The correlator reads kernel events by id (new ones after its cursor, known ones by id and time);
retention deletes them by time. Nothing reads them by connection: the index on (server_port,
client_port, client_addr, ts_ns) only cost every insert a write to a page picked by the client's
port, which is one page of its own per event once the table outgrows a commit.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_conn_events_tuple_ts", table_name="conn_events")


def downgrade() -> None:
    op.create_index("ix_conn_events_tuple_ts", "conn_events",
                    ["server_port", "client_port", "client_addr", "ts_ns"])
