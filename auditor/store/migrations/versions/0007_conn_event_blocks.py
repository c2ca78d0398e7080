"""kernel events stored a batch to a row: conn_event_blocks replaces conn_events

A row of twelve columns per event cost the daemon about 2.4 us an event at a close per request,
most of it SQLite's per-row insert. Events are now packed a batch to a row
(``auditor.store.eventblocks``). Each existing event becomes a block of its own with the event's
old id as the block's id, so positions carry over exactly: the correlator's saved position
``s`` (every event up to row ``s`` read) becomes "block ``s`` read", and coverage details that
name an event ("ev:<id>") name the same event by its new id.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import sqlalchemy as sa
from alembic import op

from auditor.model import ConnEvent, ConnEventKind
from auditor.store import eventblocks

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

CHUNK = 5000
_EVENT_COLUMNS = ("ts_ns", "kind", "family", "client_addr", "client_port", "server_addr", "server_port",
                  "cookie", "host", "source", "earliest_ns")


def upgrade() -> None:
    blocks = op.create_table(
        "conn_event_blocks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("format", sa.Integer(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("last_ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conn_event_blocks")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_conn_event_blocks_last_ts_ns", "conn_event_blocks", ["last_ts_ns"])
    bind = op.get_bind()
    select = sa.text(f"SELECT id, {', '.join(_EVENT_COLUMNS)} FROM conn_events WHERE id > :after "
                     f"ORDER BY id LIMIT {CHUNK}")
    after, copied = 0, 0
    while True:
        rows = bind.execute(select, {"after": after}).all()
        if not rows:
            break
        out = []
        for row in rows:
            event = ConnEvent(row[1], ConnEventKind(row[2]), *row[3:])
            out.append({"id": row[0], "host": event.host, "source": event.source, "format": eventblocks.FORMAT,
                        "count": 1, "first_ts_ns": event.ts_ns, "last_ts_ns": event.ts_ns,
                        "body": eventblocks.pack([event])})
        bind.execute(blocks.insert(), out)
        after, copied = rows[-1][0], copied + len(rows)
    if copied and bind.dialect.name == "postgresql":  # explicit ids leave the sequence behind
        bind.execute(sa.text("SELECT setval(pg_get_serial_sequence('conn_event_blocks', 'id'), "
                             "(SELECT max(id) FROM conn_event_blocks))"))
    bind.execute(sa.text(f"UPDATE correlator_state SET settled_event_id = settled_event_id * "
                         f"{1 << eventblocks.INDEX_BITS} + {eventblocks.MAX_BLOCK_EVENTS}"))
    _renumber_details(bind, lambda number: eventblocks.event_id(number, 0))
    op.drop_index("ix_conn_events_ts", table_name="conn_events")
    op.drop_table("conn_events")


def downgrade() -> None:
    op.create_table(
        "conn_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("family", sa.Integer(), nullable=False),
        sa.Column("client_addr", sa.String(64), nullable=False),
        sa.Column("client_port", sa.Integer(), nullable=False),
        sa.Column("server_addr", sa.String(64), nullable=False),
        sa.Column("server_port", sa.Integer(), nullable=False),
        sa.Column("cookie", sa.BigInteger(), nullable=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("earliest_ns", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conn_events")),
    )
    op.create_index("ix_conn_events_ts", "conn_events", ["ts_ns"])
    bind = op.get_bind()
    events = sa.table("conn_events", *(sa.column(name) for name in ("id", *_EVENT_COLUMNS)))
    select = sa.text("SELECT id, format, count, body, host, source FROM conn_event_blocks WHERE id > :after "
                     "ORDER BY id LIMIT 100")
    new_ids: dict[int, int] = {}  # event id -> row id, for the positions and details below
    after, next_row = 0, 1
    while True:
        blocks = bind.execute(select, {"after": after}).all()
        if not blocks:
            break
        out = []
        for block_id, fmt, count, body, host, source in blocks:
            try:
                stored = list(eventblocks.events_of(block_id, fmt, count, body, host=host, source=source))
            except eventblocks.BlockError:
                continue  # a damaged block has no rows to become
            for number, event in stored:
                new_ids[number] = next_row
                out.append({"id": next_row, **event._asdict(), "kind": event.kind.value})
                next_row += 1
        if out:
            bind.execute(events.insert(), out)
        after = blocks[-1][0]
    if new_ids and bind.dialect.name == "postgresql":
        bind.execute(sa.text("SELECT setval(pg_get_serial_sequence('conn_events', 'id'), "
                             "(SELECT max(id) FROM conn_events))"))
    numbers = sorted(new_ids)

    def row_at_or_before(position: int) -> int:
        found = bisect.bisect_right(numbers, position)
        return new_ids[numbers[found - 1]] if found else 0

    for host, settled in bind.execute(sa.text("SELECT host, settled_event_id FROM correlator_state")).all():
        bind.execute(sa.text("UPDATE correlator_state SET settled_event_id = :row WHERE host = :host"),
                     {"row": row_at_or_before(settled), "host": host})
    _renumber_details(bind, row_at_or_before)
    op.drop_index("ix_conn_event_blocks_last_ts_ns", table_name="conn_event_blocks")
    op.drop_table("conn_event_blocks")


def _renumber_details(bind: sa.Connection, renumber: Callable[[int], int]) -> None:
    """Coverage details naming an event ("ev:<id>" or "ev:<id>:undo") with the event's other id."""
    rows = bind.execute(sa.text("SELECT id, detail FROM coverage WHERE detail LIKE 'ev:%'")).all()
    changed = []
    for row_id, detail in rows:
        number, _, rest = detail[3:].partition(":")
        if number.isdigit():
            changed.append({"id": row_id, "detail": f"ev:{renumber(int(number))}" + (f":{rest}" if rest else "")})
    if changed:
        bind.execute(sa.text("UPDATE coverage SET detail = :detail WHERE id = :id"), changed)
