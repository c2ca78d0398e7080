"""How many client requests a window holds: each counted once, at the edge of this host.

One client request can leave several HTTP server spans: FastAPI's own instrumentation over a
hand-added ASGI middleware (or any second instrumentation across a context break) nests a second
SERVER span in the first, on the same connection; a gateway in front of an engine on the same host
gives the gateway's span and the engine's. Counted are only the outermost server spans of a
request: not one whose parent is a server span (nested), nor one whose parent is a client span
inside a server span (an upstream hop whose trace context was propagated). Where a gateway does not
propagate trace context, the engine's span starts a trace of its own; such a hop is told by the
gateway's client span to a local server's port, with a server span there starting during it and no
server span below it, and each one takes one request off the count.

Spans are keyed by their start minute first (``auditor.store.spankeys``): each lookup of a relative
names the minutes it may have started in. A parent or child within the request is looked for a
minute either side of the span; the server span around a gateway's client call up to the horizon
(15 minutes) before it. A gateway request whose outer span started earlier still than its call
counts its inner server span as a request of its own.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, exists, func, not_, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.util import ClauseAdapter

from auditor.model import ENCLOSING_MINUTES, NEAR_MINUTES, SpanRole, start_minute
from auditor.store import tables
from auditor.store.spankeys import found_near

spans = tables.spans
SERVER, CLIENT = SpanRole.HTTP_SERVER.value, SpanRole.HTTP_CLIENT.value
LOOPBACK = ("127.0.0.1", "::1", "localhost")
HOP_SLACK_NS = 1_000_000_000  # a hop may start before the window its inner span starts in


def _found(relative: Any, span: Any, before: int, *where: ColumnElement[bool]) -> ColumnElement[bool]:
    """A ``relative`` (a table or alias of spans) that meets ``where`` started from a minute after
    ``span`` to ``before`` minutes before it."""
    return found_near(relative.c.start_minute, span.c.start_minute, before, *where)


def inner_server_span(span: Any) -> ColumnElement[bool]:
    """``span`` (a server span, a table or alias of spans) is inside another server span of its
    trace: its parent, started near it, is one, or is a client span inside one that started up to
    the horizon before it. The parent is looked up once."""
    parent, grand = spans.alias("parent"), spans.alias("grand")
    behind_hop = _found(grand, parent, ENCLOSING_MINUTES, grand.c.trace_id == parent.c.trace_id,
                        grand.c.span_id == parent.c.parent_span_id, grand.c.role == SERVER)
    in_server = _found(parent, span, NEAR_MINUTES, parent.c.trace_id == span.c.trace_id,
                       parent.c.span_id == span.c.parent_span_id,
                       or_(parent.c.role == SERVER, and_(parent.c.role == CLIENT, behind_hop)))
    return and_(span.c.parent_span_id.is_not(None), in_server)


def count_requests(conn: Connection, where: list[ColumnElement[bool]], host: str | None,
                   since_ns: int, until_ns: int, by_minute: bool = False) -> int:
    """Client requests among the server spans that ``where`` selects (their window and labels):
    the outermost ones, less the untraced local hops whose inner span ``where`` would select.
    ``by_minute``: the spans are named by their start minute too, so that they are read through
    the index the minute leads rather than by a scan of every span held (a window over a small
    share of the store)."""
    if by_minute:
        where = [*where, *_minutes(spans, since_ns, until_ns)]
    outer = conn.execute(select(func.count()).select_from(spans).where(
        *where, not_(inner_server_span(spans)))).scalar_one()
    return int(outer) - _untraced_hops(conn, where, host, since_ns, until_ns, by_minute)


def _minutes(table: Any, since_ns: int, until_ns: int) -> list[ColumnElement[bool]]:
    return [table.c.start_minute >= start_minute(since_ns), table.c.start_minute <= start_minute(until_ns - 1)]


def _untraced_hops(conn: Connection, where: list[ColumnElement[bool]], host: str | None,
                   since_ns: int, until_ns: int, by_minute: bool) -> int:
    hop, caller, below = spans.alias("hop"), spans.alias("caller"), spans.alias("below")
    # The inner side: a counted (outermost) server span at the hop's port, started during the hop.
    inner = spans.alias("inner")
    inner_where = [_rebind(clause, inner) for clause in where]
    reached = exists().where(
        *inner_where, not_(inner_server_span(inner)), inner.c.host == hop.c.host,
        inner.c.server_port == hop.c.server_port, inner.c.start_ns >= hop.c.start_ns,
        inner.c.start_ns <= hop.c.end_ns, or_(hop.c.peer_addr.in_(LOOPBACK), inner.c.peer_addr == hop.c.peer_addr))
    in_server = _found(caller, hop, ENCLOSING_MINUTES, caller.c.trace_id == hop.c.trace_id,
                       caller.c.span_id == hop.c.parent_span_id, caller.c.role == SERVER)
    traced = _found(below, hop, NEAR_MINUTES, below.c.trace_id == hop.c.trace_id,
                    below.c.parent_span_id == hop.c.span_id, below.c.role == SERVER)
    hops = select(func.count()).select_from(hop).where(
        hop.c.role == CLIENT, hop.c.start_ns >= since_ns - HOP_SLACK_NS, hop.c.start_ns < until_ns,
        *(_minutes(hop, since_ns - HOP_SLACK_NS, until_ns) if by_minute else ()),
        *([hop.c.host == host] if host is not None else []), in_server, not_(traced), reached)
    return int(conn.execute(hops).scalar_one())


def _rebind(clause: ColumnElement[bool], table: Any) -> ColumnElement[bool]:
    """``clause`` over ``spans`` rewritten over ``table`` (an alias of it)."""
    rebound: ColumnElement[bool] = ClauseAdapter(table).traverse(and_(clause))
    return rebound
