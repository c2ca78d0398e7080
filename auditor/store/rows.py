"""Records as rows: how a dataclass (or named tuple) record becomes a column dict or a plain tuple
(the SQLite driver, the hot path of every batch insert), and the batched driver statements."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import json
import operator
import sqlite3
import typing
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Shape:
    """How one record type becomes a row: its field names, one getter for all of them, and the
    fields that need converting (enums to their values; dicts to JSON text for the tuple path)."""

    names: tuple[str, ...]
    getter: Any
    enums: tuple[str, ...]
    converters: tuple[tuple[int, Any], ...]  # (position, function) for the tuple path
    row: Any = None  # one record to its row tuple, converters applied (the tuple path)
    batch: Any = None  # (records[, null]) to their row tuples, all at once (a compiled maker: use_batch_rows)


_SHAPES: dict[type, Shape] = {}
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _json_encoder() -> Any:
    """``_encoder.encode`` without its per-call set-up: ``JSONEncoder.encode`` builds a new C
    encoder (and its float formatter) on every call, which costs more than encoding a span's few
    attributes. The C encoder is built once here, with the same settings; no cycle check (the
    values come from decoded messages, which cannot refer to themselves: a cycle would end in
    RecursionError instead of ValueError). Where there is no C encoder, the plain method."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _encoder.encode
    encode = make(None, _encoder.default, json.encoder.encode_basestring, None, _encoder.key_separator,
                  _encoder.item_separator, _encoder.sort_keys, _encoder.skipkeys, _encoder.allow_nan)
    join = "".join

    def dumps(value: Any) -> str:
        return join(encode(value, 0))

    return dumps


dumps_json = _json_encoder()


def shape_of(cls: type) -> Shape:
    shape = _SHAPES.get(cls)
    if shape is None:
        hints = typing.get_type_hints(cls)
        kind: Any = cls
        names = tuple(kind._fields if issubclass(cls, tuple) else (f.name for f in dataclasses.fields(kind)))
        enums = tuple(n for n in names if any(isinstance(t, type) and issubclass(t, enum.Enum)
                                               for t in (hints[n], *typing.get_args(hints[n]))))
        converters = tuple((i, _enum_value if n in enums else dumps_json) for i, n in enumerate(names)
                           if n in enums or typing.get_origin(hints[n]) is dict)
        # A named tuple already holds its fields in order.
        getter = _itself if issubclass(cls, tuple) else operator.attrgetter(*names)
        shape = _SHAPES[cls] = Shape(names, getter, enums, converters, _row_maker(names, converters))
    return shape


def row_layout(cls: type) -> tuple[tuple[str, ...], dict[str, str]]:
    """``cls``'s row tuple as the SQLite insert takes it: its field names in order, and how each
    converted field is converted ("enum value", or "json" for ``dumps_json`` text)."""
    shape = shape_of(cls)
    kinds = {_enum_value: "enum value", dumps_json: "json"}
    return shape.names, {shape.names[i]: kinds.get(convert, repr(convert)) for i, convert in shape.converters}


def use_batch_rows(cls: type, make_rows: Any) -> None:
    """Make ``cls``'s row tuples with ``make_rows(records[, null])`` (a compiled maker giving the
    same rows as ``rows_as_tuples``, with ``null`` for None and ints for bools where given:
    ``collectors.normalize`` offers one for SpanRecord), or, with None, in Python again."""
    _SHAPES[cls] = dataclasses.replace(shape_of(cls), batch=make_rows)


def _row_maker(names: tuple[str, ...], converters: tuple[tuple[int, Any], ...]) -> Any:
    """``record -> row tuple`` as one generated expression, ``(r.a, convert(r.b), ...)``: reading
    the fields by name and converting in place costs about half of collecting them with an
    attrgetter, copying them to a list, converting there and copying back to a tuple. The source
    holds only the record's field names (identifiers, checked) and positions."""
    if not all(name.isidentifier() for name in names):
        return None
    namespace: dict[str, Any] = {}
    parts = []
    for i, name in enumerate(names):
        convert = dict(converters).get(i)
        if convert is None:
            parts.append(f"r.{name}")
        else:
            namespace[f"convert{i}"] = convert
            parts.append(f"convert{i}(r.{name})")
    exec(f"def row(r):\n    return ({', '.join(parts)},)", namespace)
    return namespace["row"]


def _itself(record: Any) -> Any:
    return record


def _enum_value(value: Any) -> Any:
    return None if value is None else value.value


def row_dict(record: Any) -> dict[str, Any]:
    """A dataclass record as a column dict, enums as their values."""
    shape = shape_of(type(record))
    row = dict(zip(shape.names, shape.getter(record), strict=True))
    for name in shape.enums:
        row[name] = _enum_value(row[name])
    return row


@functools.cache
def driver_null() -> Any:
    """What the SQLite driver's rows may hold for NULL: a NaN, which SQLite binds as NULL (a double
    that is NaN is stored as NULL: it keeps none), where this process's SQLite does so; else None.
    The driver binds an exact float as it is, but looks up an adapter for every None (and bool)
    first, about a quarter of a microsecond each: a span's dozen empty columns were a third of its
    insert (``bench/ingest.py``). Asked of the linked library once, not assumed."""
    nan = float("nan")
    try:
        with contextlib.closing(sqlite3.connect(":memory:")) as conn:
            stored = conn.execute("SELECT ? IS NULL", (nan,)).fetchone()
    except sqlite3.Error:
        return None
    return nan if stored == (1,) else None


def rows_as_tuples(records: Iterable[Any], shape: Shape, null: Any = None) -> list[tuple[Any, ...]]:
    """Records as plain tuples in ``shape.names`` order, for the driver's executemany: the hot path
    of every batch insert on SQLite, where building a dict per row costs more than the insert.
    ``null``: ``driver_null()`` for rows that go to SQLite; a compiled maker puts it for None (the
    rows made in Python keep None)."""
    if shape.batch is not None:
        rows: list[tuple[Any, ...]] = shape.batch(records) if null is None else shape.batch(records, null)
        return rows
    getter, converters = shape.getter, shape.converters
    if not converters:
        return [getter(r) for r in records]
    if shape.row is not None:
        row = shape.row
        return [row(r) for r in records]
    rows = []
    for record in records:
        values = list(getter(record))
        for i, convert in converters:
            values[i] = convert(values[i])
        rows.append(tuple(values))
    return rows


def sqlite_insert_sql(table: str, record_type: type, skip_duplicates: bool) -> str:
    """The driver-level insert of ``record_type`` rows into ``table``, in the record's field order
    (its fields are the table's columns less ``id``: ``tests/test_store.py`` holds them equal)."""
    names = shape_of(record_type).names
    verb = "INSERT OR IGNORE" if skip_duplicates else "INSERT"
    return f"{verb} INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})"


_ROWS_PER_STATEMENT = 16  # 16 x 27 span columns: far below SQLite's 999 parameters of old builds


def grouped_inserts(sql: str, rows: list[tuple[Any, ...]]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The one-row ``INSERT ... VALUES (?, ...)`` ``sql`` as statements of 16 rows each (every
    group's values in one flat tuple), then the rest one row at a time: the driver's per-row
    step, reset and bind set-up, paid once per 16 rows, is a sixth of a span's insert. Rows are
    inserted in the same order, each on its own (``OR IGNORE`` skips each duplicate alone)."""
    size = _ROWS_PER_STATEMENT
    full = len(rows) - len(rows) % size
    if not full:
        return [(sql, rows)]
    head, values = sql.split(" VALUES ", 1)
    grouped = f"{head} VALUES {', '.join([values] * size)}"
    flat = itertools.chain.from_iterable
    statements = [(grouped, [tuple(flat(rows[i:i + size])) for i in range(0, full, size)])]
    if full < len(rows):
        statements.append((sql, rows[full:]))
    return statements
