"""How spans are keyed in the store, and how far apart in time a span and its relatives are looked for.

A span's unique key is (start minute, trace id, span id): the minute the span started in, computed
by the database from ``start_ns`` (the ``start_minute`` column), leads it. Trace ids are random, so
an index led by them takes every new span on a page of its own, and retention's delete of every old
one on another: with six hours of spans held, those two cost the span's writer more than everything
else it does (bench/span_index_growth.py). Led by the minute, inserts go to the newest minute's
pages and deletes to the oldest's.

The price is that a span is found by its ids only where its minute is named too. Lookups of a
span's relatives name the minutes they may lie in (``auditor.model.minutes_around``):

- ``NEAR_MINUTES``: a span's parent and children within one request (a second instrumentation's
  server span, a gateway's client call and the server span it reached, an engine's span beside its
  server span) start milliseconds apart; any start within a minute either way is always found.
- ``ENCLOSING_MINUTES``: the server span around a gateway's client call may have started long
  before it (an agent's request that calls out for minutes); found when it started up to the
  correlator's horizon (15 minutes) before.
- A recalled trace (``auditor.correlate.recall``): the minutes from the horizon before its first
  request's start to the horizon after its last disconnect or work end.

A resent span (an exporter's retry) carries its start time unchanged, so it meets its stored copy
in the same minute and is dropped as a duplicate, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from auditor.model import MINUTE_NS, minutes_around, start_minute

if TYPE_CHECKING:
    from sqlalchemy.sql.elements import ColumnElement

# The column's expression, the same on SQLite and PostgreSQL (integer division of two integers).
START_MINUTE_SQL = f"start_ns / {MINUTE_NS}"
# Verdicts are keyed the same way where their ids are indexed: the request ids' index leads with the
# minute the client left in (``disconnect_minute``), found by naming the minutes a lookup may lie in.
DISCONNECT_MINUTE_SQL = f"disconnect_at_ns / {MINUTE_NS}"


def minutes_between(first_ns: int, last_ns: int) -> list[int]:
    """Every minute from the one ``first_ns`` falls in to the one ``last_ns`` falls in."""
    return list(range(start_minute(first_ns), start_minute(last_ns) + 1))


def found_near(relative_minute: Any, span_minute: Any, before: int, *where: Any) -> ColumnElement[bool]:
    """A span meeting ``where``, whose ``start_minute`` column is ``relative_minute``, started in
    one of the minutes around ``span_minute`` (an expression: the other span's column), from a
    minute after it to ``before`` minutes before: one ``EXISTS`` a minute, nearest first. (An ``IN``
    list of the minutes would have SQLite build and sort a temporary table for every row.) Used by
    the report's request count and the capture, on tables, aliases and mapped classes alike.
    (SQLAlchemy is imported here, not above: the daemon reads this module without it.)"""
    from sqlalchemy import exists, or_

    return or_(*(exists().where(relative_minute == minute, *where)
                 for minute in minutes_around(span_minute, before)))
