"""The daemon's way to its store: SQL text over the sqlite3 driver, or over a SQLAlchemy engine.

A daemon on a SQLite file (every host's default) talks to it through the standard library's
driver and never imports SQLAlchemy, which with the asyncio it loads is about 15 MiB of a process
meant to stay under 100 (docs/footprint.md). Any other database (a fleet's PostgreSQL) goes through
a SQLAlchemy engine. The daemon's statements are written once, in the SQL both SQLite and
PostgreSQL speak, with ``:name`` parameters, which the sqlite3 driver and SQLAlchemy's ``text()``
both take. Rows come back as tuples; JSON and boolean columns are read through ``json_value`` and
``bool`` where they matter (SQLite gives text and 0/1, PostgreSQL's driver objects).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

Params = Mapping[str, Any] | Sequence[Any] | None

# Connections kept open between uses: one per thread that writes or reads at once (span writer,
# event writer, sampler, correlator, retention) is plenty.
MAX_IDLE = 8


class SqlError(Exception):
    """The database refused a statement or could not be read: the driver's first line of text."""


class SqlUnavailable(SqlError):
    """An operational failure (locked, unreachable, cannot open, disk full): may pass; retry."""


class Conn(Protocol):
    """One connection, checked out for a ``with`` block."""

    def all(self, sql: str, params: Params = None) -> list[Any]: ...
    def scalar(self, sql: str, params: Params = None) -> Any: ...
    def run(self, sql: str, params: Params = None) -> int: ...
    def run_many(self, sql: str, rows: Sequence[Any]) -> None: ...
    def table_names(self) -> set[str]: ...


class Sql(Protocol):
    dialect: str

    def connect(self) -> AbstractContextManager[Conn]: ...  # reads, rolled back at the end
    def begin(self) -> AbstractContextManager[Conn]: ...  # one transaction, committed at the end
    def close(self) -> None: ...


def json_value(value: Any) -> Any:
    """A JSON column's value: SQLite keeps the text, PostgreSQL's driver decodes it already."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0] if text else type(exc).__name__


SQLITE_CACHE_KIB = 1024


def sqlite_pragmas(connection: Any) -> None:
    """Every SQLite connection's settings, whichever way it was opened."""
    cursor = connection.cursor()
    # WAL lets the report read while the daemon writes; NORMAL sync is durable across app crashes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    # Checkpoint every 10,000 pages (40 MiB of WAL) rather than 1,000: the spans' trace-id index
    # takes its inserts on random pages, and a page written many times between two checkpoints is
    # copied back once (bench figures in docs/footprint.md). The WAL file keeps its size on disk.
    cursor.execute("PRAGMA wal_autocheckpoint=10000")
    # A page cache of 1 MiB a connection, not SQLite's 2 MB: what a connection reads again is the
    # newest minutes' pages, and a page it no longer holds comes from the OS's cache (the daemon
    # keeps a few connections, each filling its cache to the limit over hours).
    cursor.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


@contextmanager
def _sqlite_errors() -> Iterator[None]:
    """The driver's errors as ``SqlUnavailable`` (operational) or ``SqlError`` (the rest)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        raise SqlUnavailable(first_line(exc)) from exc
    except sqlite3.Error as exc:
        raise SqlError(first_line(exc)) from exc


@contextmanager
def _engine_errors() -> Iterator[None]:
    """SQLAlchemy's driver errors, mapped as the sqlite3 driver's are."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    try:
        yield
    except OperationalError as exc:
        raise SqlUnavailable(first_line(exc)) from exc
    except DBAPIError as exc:
        raise SqlError(first_line(exc)) from exc


class _SqliteConn:
    __slots__ = ("_conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def all(self, sql: str, params: Params = None) -> list[Any]:
        with _sqlite_errors():
            return self._conn.execute(sql, params or ()).fetchall()

    def scalar(self, sql: str, params: Params = None) -> Any:
        with _sqlite_errors():
            row = self._conn.execute(sql, params or ()).fetchone()
        return None if row is None else row[0]

    def run(self, sql: str, params: Params = None) -> int:
        with _sqlite_errors():
            return self._conn.execute(sql, params or ()).rowcount

    def run_many(self, sql: str, rows: Sequence[Any]) -> None:
        with _sqlite_errors():
            self._conn.executemany(sql, rows)

    def table_names(self) -> set[str]:
        return {name for (name,) in self.all(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}


class SqliteSql:
    """A SQLite file through the sqlite3 driver: a small pool of connections, each used by one
    thread at a time. Reads run outside any transaction (each statement sees the newest commit,
    as SQLAlchemy's driver set-up did); ``begin()`` wraps its statements in one."""

    dialect = "sqlite"

    def __init__(self, path: str, *, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _checkout(self) -> sqlite3.Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        with _sqlite_errors():
            conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None,
                                   check_same_thread=False)
            try:
                sqlite_pragmas(conn)
            except sqlite3.Error:
                conn.close()
                raise
        return conn

    def _checkin(self, conn: sqlite3.Connection) -> None:
        keep = True
        if conn.in_transaction:
            try:
                conn.rollback()
            except sqlite3.Error:
                keep = False
        with self._lock:
            if keep and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def connect(self) -> Iterator[_SqliteConn]:
        conn = self._checkout()
        try:
            yield _SqliteConn(conn)
        finally:
            self._checkin(conn)

    @contextmanager
    def begin(self) -> Iterator[_SqliteConn]:
        conn = self._checkout()
        try:
            with _sqlite_errors():
                conn.execute("BEGIN")
                yield _SqliteConn(conn)
                conn.commit()
        finally:
            self._checkin(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _EngineConn:
    __slots__ = ("_conn", "_text")

    def __init__(self, conn: Any, text: Any) -> None:
        self._conn, self._text = conn, text

    def _execute(self, sql: str, params: Any) -> Any:
        with _engine_errors():
            return self._conn.execute(self._text(sql), params)

    def all(self, sql: str, params: Params = None) -> list[Any]:
        return list(self._execute(sql, params or {}).all())

    def scalar(self, sql: str, params: Params = None) -> Any:
        return self._execute(sql, params or {}).scalar()

    def run(self, sql: str, params: Params = None) -> int:
        return int(self._execute(sql, params or {}).rowcount)

    def run_many(self, sql: str, rows: Sequence[Any]) -> None:
        if rows:
            self._execute(sql, list(rows))

    def table_names(self) -> set[str]:
        from sqlalchemy import inspect

        return set(inspect(self._conn).get_table_names())


class EngineSql:
    """Any database SQLAlchemy reaches (PostgreSQL; SQLite in memory, which one engine must own):
    the same statements as ``text()``, each built once."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._texts: dict[str, Any] = {}

    def _text(self, sql: str) -> Any:
        statement = self._texts.get(sql)
        if statement is None:
            from sqlalchemy import text

            statement = self._texts[sql] = text(sql)
        return statement

    @contextmanager
    def connect(self) -> Iterator[_EngineConn]:
        with _engine_errors(), self.engine.connect() as conn:
            yield _EngineConn(conn, self._text)

    @contextmanager
    def begin(self) -> Iterator[_EngineConn]:
        with _engine_errors(), self.engine.begin() as conn:
            yield _EngineConn(conn, self._text)

    def close(self) -> None:
        self.engine.dispose()
