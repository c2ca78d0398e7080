"""The store: SQLite (default) or PostgreSQL, migrated by Alembic.

A SQLite file is reached through the standard library's driver (``auditor.store.sql``): the daemon
never imports SQLAlchemy. Other databases, and SQLite in memory, go through a SQLAlchemy engine.
Sources write through the batch ``insert_*`` methods (one transaction a batch); correlation reads
through ``connect()`` (SQL text, ``auditor.store.sql``); the report, capture and replay through
``engine`` and ``session()`` (SQLAlchemy Core and ORM, imported on first use). Opening a store
checks its schema first: a file that is not a database, or a database written by a newer auditor,
is refused with an error that says what to do, and nothing is overwritten.

Alembic is imported only to migrate: the schema check reads the revision files and the version
table itself, and the daemon migrates a new database in a short-lived child
(``auditor.store.migrate``), so a long-running process never holds Alembic and Mako (about 11 MiB).
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from auditor.errors import StoreError
from auditor.model import (
    ConnEvent,
    CoverageKind,
    EventRun,
    RequestVerdict,
    SpanRecord,
    SpanRole,
    UtilSample,
)
from auditor.store import eventblocks
from auditor.store.rows import (
    driver_null,
    grouped_inserts,
    row_dict,
    rows_as_tuples,
    shape_of,
    sqlite_insert_sql,
)
from auditor.store.sql import (
    Conn,
    EngineSql,
    Sql,
    SqlError,
    SqliteSql,
    SqlUnavailable,
    first_line,
    json_value,
    sqlite_pragmas,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_REVISION_LINE = re.compile(r"^(down_revision|revision)\s*(?::[^=]*)?=\s*(None|\"([^\"]*)\"|'([^']*)')", re.M)
MIGRATE_TIMEOUT_S = 600.0


# The tables of the head schema (auditor.store.tables; a test holds the two alike), named here so
# the daemon checks them without importing SQLAlchemy's metadata.
HEAD_TABLES = frozenset({"alembic_version", "conn_event_blocks", "spans", "util_samples", "verdicts", "coverage",
                         "orphaned_work", "captures", "captured_requests", "replay_runs", "replay_results", "correlator_state"})


@cache
def revisions() -> tuple[frozenset[str], str]:
    """(every revision the migration scripts know, the head): read from the scripts' own
    ``revision``/``down_revision`` lines, without importing Alembic."""
    parents: dict[str, str | None] = {}
    for script in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        found = {m.group(1): m.group(3) or m.group(4) for m in _REVISION_LINE.finditer(script.read_text())}
        if "revision" in found:
            parents[found["revision"]] = found.get("down_revision")
    heads = set(parents) - {parent for parent in parents.values() if parent}
    if len(heads) != 1:
        raise StoreError(f"the migration scripts in {MIGRATIONS_DIR} have heads {sorted(heads)}, not one")
    return frozenset(parents), heads.pop()


# The systemd unit's state directory (StateDirectory=auditor). Tests move it by patching this;
# it is no setting: a host has one unit and one place.
SYSTEM_DB_DIR = Path("/var/lib/auditor")


def default_db_url(*, find_service_db: bool = False) -> str:
    """SQLite in the state directory: systemd's StateDirectory when set, else the working directory.

    ``find_service_db`` is for commands that read what the daemon wrote, run from a shell: the
    unit's database comes before the working directory when it exists. Raises StoreError when it
    exists but this user may not read it, rather than quietly reading some other file.
    """
    state_dir = os.environ.get("STATE_DIRECTORY")
    if state_dir:
        return f"sqlite:///{Path(state_dir.split(':')[0]) / 'auditor.db'}"
    if find_service_db:
        path = SYSTEM_DB_DIR / "auditor.db"
        # The unit makes its state directory 0750 auditor:auditor: others cannot even look inside.
        try:
            found = path.exists() if os.access(path.parent, os.X_OK) else path.parent.is_dir()
        except OSError:
            found = False
        if found and not os.access(path, os.R_OK):
            raise StoreError(f"{path} is the auditor service's database and this user cannot read it; "
                             "run with sudo (or join the auditor group, with UMask=0027 in the unit), or pass --db")
        if found:
            return f"sqlite:///{path}"
    return "sqlite:///auditor.db"


def sqlite_file(url: str) -> str | None:
    """The file of a plain ``sqlite:///PATH`` URL, which the sqlite3 driver opens without
    SQLAlchemy; None for any other URL (in memory, ``file:`` URIs, options, another database)."""
    for scheme in ("sqlite:///", "sqlite+pysqlite:///"):
        if url.startswith(scheme):
            path = url[len(scheme):]
            if path and path != ":memory:" and not path.startswith("file:") and not any(c in path for c in "?%#"):
                return path
    return None


def sqlite_database(url: str) -> str | None:
    """The database of any SQLite URL as SQLAlchemy reads it (options allowed; a ``file:`` URI as
    written); None for another database, SQLite in memory, or a URL that is none."""
    if not url.startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return None
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:"):
        return None
    return database


class Store:
    """A migrated database and the batch writes the sources use."""

    def __init__(self, url: str | None = None, *, upgrade: bool = True, create: bool = True,
                 check: bool = True, migrate_in_child: bool = False) -> None:
        self.url = url or default_db_url()
        path = sqlite_file(self.url)
        self._engine: Engine | None = None
        self._native = path is not None  # a SQLite file, through the driver
        self.sql: Sql
        if path is not None:
            _check_sqlite_path(path, create=create)
            _refuse_foreign_sqlite(path, self.url)  # even unchecked: opening it would rewrite its header
            self.sql = SqliteSql(path)
        else:
            self._engine = _make_engine(self.url, create=create)
            if self._engine.dialect.name == "sqlite" and self._engine.url.database:
                _refuse_foreign_sqlite(self._engine.url.database, self.where())
            self.sql = EngineSql(self._engine)
        self._sessions: Any = None  # an ORM sessionmaker, made on first use
        self._verdict_statement: Any = None  # built on first use (False: this database has none)
        if check:
            self.check_schema(upgrade=upgrade, in_child=migrate_in_child)

    @property
    def engine(self) -> Engine:
        """A SQLAlchemy engine on the store (the report, capture, replay, migrations): on a SQLite
        file, made on first use, beside the driver's own connections."""
        if self._engine is None:
            self._engine = _make_engine(self.url, create=True)
        return self._engine

    @property
    def dialect(self) -> str:
        return self.sql.dialect

    # -- schema -----------------------------------------------------------------------------
    def head_revision(self) -> str:
        return revisions()[1]

    def current_revision(self) -> str | None:
        try:
            with self.sql.connect() as conn:
                if "alembic_version" not in conn.table_names():
                    return None
                found = [version for (version,) in conn.all("SELECT version_num FROM alembic_version")]
            if len(found) > 1:
                raise StoreError(f"{self.where()} records several schema revisions {sorted(found)}; "
                                 "it was migrated by something else: pass another --db")
            return found[0] if found else None
        except SqlUnavailable as exc:
            if self.dialect != "sqlite":
                raise StoreError(f"cannot reach {self.where()} ({exc}); check that the server "
                                 "is up and the URL, user and password are right") from exc
            raise StoreError(f"cannot open {self.where()} ({exc}); check the path and its "
                             "permissions") from exc
        except SqlError as exc:
            raise StoreError(
                f"{self.where()} is not a readable auditor database ({exc}); "
                "move it aside or pass another --db"
            ) from exc

    def missing_tables(self) -> list[str]:
        """The head schema's tables this database lacks (dropped by hand, a restore of part of it)."""
        with self.sql.connect() as conn:
            return sorted(HEAD_TABLES - conn.table_names())

    def check_schema(self, *, upgrade: bool = True, in_child: bool = False) -> None:
        current = self.current_revision()
        known, head = revisions()
        if current is not None and current not in known:
            raise StoreError(
                f"{self.where()} has schema {current}, newer than this auditor knows (head {head}); "
                "upgrade the auditor or point --db elsewhere"
            )
        if current == head:
            if missing := self.missing_tables():
                raise StoreError(f"{self.where()} records schema {head} but lacks its table(s) {', '.join(missing)}: "
                                 "something else changed it; move it aside (the daemon starts a new one) "
                                 "or pass another --db")
            return
        if current is None:
            with self.sql.connect() as conn:
                tables = conn.table_names()
            if tables:
                raise StoreError(
                    f"{self.where()} holds tables {sorted(tables)[:3]} but no auditor schema; "
                    "refusing to touch it: pass another --db"
                )
        if not upgrade:
            raise StoreError(f"{self.where()} needs migrating to {head}: run `auditor db upgrade`")
        if in_child and (self._native or self.shared_by_connections):
            self._upgrade_in_child()
        else:
            self.upgrade()

    @property
    def shared_by_connections(self) -> bool:
        """Whether every connection opened to the store reads the same data: a SQLite file or a
        PostgreSQL server, not SQLite in memory (a database of its own per connection)."""
        from sqlalchemy.engine import make_url

        url = make_url(self.url)
        if url.get_backend_name() != "sqlite":
            return True
        database = url.database or ""
        # In memory: the plain name, or a file: URI naming it (uri=true) or its mode=memory.
        return bool(database) and ":memory:" not in database and url.query.get("mode") != "memory"

    def _upgrade_in_child(self) -> None:
        """Migrate in a short-lived interpreter: what Alembic maps stays out of this process. The
        URL travels in the environment, never on a command line others can read."""
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "AUDITOR_MIGRATE_DB": self.url,
               "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        try:
            done = subprocess.run([sys.executable, "-m", "auditor.store.migrate"], env=env, capture_output=True,
                                  text=True, timeout=MIGRATE_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StoreError(f"could not migrate {self.where()}: the migration process failed ({exc})") from exc
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise StoreError(said if said.startswith("could not migrate") else f"could not migrate {self.where()}: {said}")
        # Connections opened before the migration may hold the old schema.
        self.sql.close()
        if self._engine is not None:
            self._engine.dispose()

    def upgrade(self, revision: str = "head") -> None:
        from alembic import command
        from alembic.config import Config as AlembicConfig
        from sqlalchemy.exc import SQLAlchemyError

        logging.getLogger("alembic").setLevel(logging.WARNING)  # per-step INFO lines are noise here
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        try:
            with self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
        except SQLAlchemyError as exc:
            raise StoreError(f"could not migrate {self.where()}: {first_line(exc)}") from exc
        if self._native:
            self.sql.close()  # the driver's idle connections may have read the old schema

    def where(self) -> str:
        """The store's URL with any password hidden: what error messages name."""
        if sqlite_file(self.url) is not None:
            return self.url  # a file's URL holds no password
        from sqlalchemy.engine import make_url

        return make_url(self.url).render_as_string(hide_password=True)

    # -- writes -----------------------------------------------------------------------------
    def _write(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """One transaction: each statement once per row of its own (dicts for ``:name`` parameters,
        or tuples)."""
        try:
            with self.sql.begin() as conn:
                for sql, rows in statements:
                    conn.run_many(sql, rows)
        except SqlUnavailable as exc:
            raise StoreError(f"write to {self.where()} failed: {exc}") from exc

    def _insert_records(self, table: str, records: Iterable[Any], *, skip_duplicates: bool = False) -> int:
        """Insert dataclass records whose fields are the table's columns (less the ``id`` key).
        SQLite gets plain tuples through the driver, sixteen rows a statement; other databases go
        through SQLAlchemy Core (its column types encode the JSON columns)."""
        records = list(records)
        if not records:
            return 0
        if not self._native:
            return self._insert_core(table, [row_dict(r) for r in records], skip_duplicates)
        record_type = type(records[0])
        sql = sqlite_insert_sql(table, record_type, skip_duplicates)
        rows = rows_as_tuples(records, shape_of(record_type), driver_null())
        self._write(grouped_inserts(sql, rows))
        return len(rows)

    def _insert_core(self, table_name: str, rows: list[dict[str, Any]], skip_duplicates: bool) -> int:
        from sqlalchemy import insert
        from sqlalchemy.exc import OperationalError

        from auditor.store import tables

        table = tables.metadata.tables[table_name]
        statement: Any = insert(table)
        if skip_duplicates and self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            statement = pg_insert(table).on_conflict_do_nothing()
        elif skip_duplicates and self.dialect == "sqlite":
            statement = insert(table).prefix_with("OR IGNORE")
        try:
            with self.engine.begin() as conn:
                conn.execute(statement, rows)
        except OperationalError as exc:
            raise StoreError(f"write to {self.where()} failed: {first_line(exc)}") from exc
        return len(rows)

    def insert_conn_events(self, events: Iterable[ConnEvent]) -> int:
        """Store events as blocks (``auditor.store.eventblocks``): a row per host and source,
        one transaction. Returns how many were stored: an event the format cannot hold is
        logged and left out."""
        events = list(events)
        try:
            rows = eventblocks.block_rows(events)
        except ValueError as exc:  # no source makes such an event; the others are still stored
            kept = [event for event in events if eventblocks.storable(event)]
            log.error("dropped %d kernel events the store cannot hold: %s", len(events) - len(kept), exc)
            rows = eventblocks.block_rows(kept)
        return self._insert_blocks(rows)

    def correlate_after_stored_events(self, host: str) -> None:
        """Have ``host``'s correlator start after every kernel event stored so far, as if it had
        settled them: for a pipeline that judges only what comes next on a store of earlier runs
        (a replay into its capture file, whose earlier runs' results are recorded already)."""
        with self.sql.connect() as conn:
            last_block = conn.scalar("SELECT max(id) FROM conn_event_blocks")
        if last_block is not None:
            self.save_correlator_position(host, eventblocks.block_read(int(last_block)))

    def save_correlator_position(self, host: str, settled_event_id: int) -> None:
        """``host``'s correlator has settled every kernel event up to this id: a restart reads on
        from there. One row per host: updated, or inserted the first time."""
        values = {"host": host, "settled_event_id": settled_event_id, "updated_ns": time.time_ns()}
        with self.sql.begin() as conn:
            if not conn.run("UPDATE correlator_state SET settled_event_id = :settled_event_id, "
                            "updated_ns = :updated_ns WHERE host = :host", values):
                conn.run("INSERT INTO correlator_state (host, settled_event_id, updated_ns) "
                         "VALUES (:host, :settled_event_id, :updated_ns)", values)

    def insert_event_runs(self, runs: Iterable[EventRun]) -> int:
        """Store the probe's undecoded runs as they are, a block each, one transaction; returns
        the events stored."""
        return self._insert_blocks(eventblocks.run_rows(runs))

    def _insert_blocks(self, rows: list[dict[str, Any]]) -> int:
        if not rows:
            return 0
        if not self._native:
            self._insert_core("conn_event_blocks", rows, False)
        else:
            self._write([(_BLOCK_INSERT, rows)])
        return sum(row["count"] for row in rows)

    def conn_events(self, *, host: str | None = None, since_ns: int | None = None) -> list[ConnEvent]:
        """The stored events (of ``host``, at or after ``since_ns``), in the order they were stored.
        A block that does not decode is left out and logged."""
        where = " AND ".join(clause for clause, wanted in (("host = :host", host is not None),
                                                           ("last_ts_ns >= :since", since_ns is not None))
                             if wanted)
        sql = f"SELECT {BLOCK_COLUMNS} FROM conn_event_blocks {'WHERE ' + where if where else ''} ORDER BY id"
        with self.connect() as conn:
            blocks = conn.all(sql, {"host": host, "since": since_ns})
        return [event for _, event in stored_events(blocks)
                if since_ns is None or event.ts_ns >= since_ns]

    def insert_spans(self, spans: Iterable[SpanRecord]) -> int:
        """Insert spans; a span already stored (same trace and span id) is skipped, not duplicated."""
        return self._insert_records("spans", spans, skip_duplicates=True)

    def insert_samples(self, samples: Iterable[UtilSample]) -> int:
        return self._insert_records("util_samples", samples)

    def write(self, records: Sequence[ConnEvent | EventRun | SpanRecord | UtilSample]) -> int:
        """The sources' sink (``auditor.sink.Sink``): one batch of one record type, one transaction."""
        if not records:
            return 0
        writer = self._writers.get(type(records[0]))
        if writer is None:
            raise TypeError(f"the store keeps no {type(records[0]).__name__} records")
        return int(writer(self, records))

    _writers: dict[type, Any] = {ConnEvent: insert_conn_events, EventRun: insert_event_runs,
                                 SpanRecord: insert_spans, UtilSample: insert_samples}

    def add_coverage(self, kind: CoverageKind, count: int = 1, *, host: str = "",
                     ts_ns: int | None = None, detail: str | None = None) -> None:
        self.add_coverage_rows([{"ts_ns": ts_ns if ts_ns is not None else time.time_ns(), "host": host,
                                 "kind": kind.value, "count": count, "detail": detail}])

    def add_coverage_rows(self, rows: list[dict[str, Any]]) -> int:
        """Coverage rows (``ts_ns``, ``host``, ``kind``, ``count``, ``detail``), one transaction."""
        if rows:
            self._write([(_COVERAGE_INSERT, rows)])
        return len(rows)

    def write_orphaned_work(self, rows: list[dict[str, Any]]) -> int:
        """Stretches of orphaned work (``auditor.correlate.orphans``), each replacing the row of the
        same host, port and start (a stretch is rewritten while it runs), one transaction."""
        if rows:
            keys = [{"host": r["host"], "server_port": r["server_port"], "start_ns": r["start_ns"]} for r in rows]
            self._write([(_ORPHANED_WORK_DELETE, keys), (_ORPHANED_WORK_INSERT, rows)])
        return len(rows)

    def end_open_orphaned_work(self, host: str) -> None:
        """End ``host``'s stretches of orphaned work still open (``end_ns`` NULL) where they were
        last written, cut short: a daemon killed mid-stretch (its memory limit's OOM kill, SIGKILL)
        left them so, and the daemon restarted counts on with stretches of its own."""
        self._write([(_ORPHANED_WORK_END_OPEN, [{"host": host, "cut_short": True}])])

    def upsert_verdicts(self, verdicts: Sequence[RequestVerdict]) -> int:
        """Write verdicts keyed by request; a later verdict for the same request replaces the earlier."""
        if not verdicts:
            return 0
        now = time.time_ns()
        # The last verdict of a request in the batch wins (a row can be upserted once per statement).
        latest = {v.request_key: v for v in verdicts}
        if self._native:  # a SQLite file: the driver, a tuple a row (enums as values, details as JSON)
            rows = [(*row, now) for row in rows_as_tuples(latest.values(), shape_of(RequestVerdict))]
            self._write([(_sqlite_verdict_upsert(), rows)])
            return len(rows)
        from sqlalchemy.exc import OperationalError

        values = [row_dict(v) | {"updated_ns": now} for v in latest.values()]
        try:
            self._upsert_verdicts_core(values)
        except OperationalError as exc:
            raise StoreError(f"write to {self.where()} failed: {first_line(exc)}") from exc
        return len(values)

    def _upsert_verdicts_core(self, rows: list[dict[str, Any]]) -> None:
        statement = self._verdict_upsert()
        if statement is not None:  # one INSERT .. ON CONFLICT DO UPDATE per row, no ORM round trip
            with self.engine.begin() as conn:
                conn.execute(statement, rows)
            return
        from auditor.store.schema import VerdictRow

        with self.session() as session, session.begin():
            existing = {row.request_key: row for row in
                        session.query(VerdictRow).filter(VerdictRow.request_key.in_([r["request_key"] for r in rows]))}
            for values in rows:
                row = existing.get(values["request_key"])
                if row is None:
                    session.add(VerdictRow(**values))
                else:
                    for name, value in values.items():
                        setattr(row, name, value)

    def _verdict_upsert(self) -> Any:
        """``INSERT .. ON CONFLICT (request_key) DO UPDATE`` on SQLite and PostgreSQL, built once;
        None on other databases (the ORM's select-then-update)."""
        if self._verdict_statement is None:
            from sqlalchemy.dialects import postgresql, sqlite

            from auditor.store import tables

            dialect_insert: Any = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(self.dialect)
            if dialect_insert is None:
                self._verdict_statement = False
                return None
            table = tables.verdicts
            statement = dialect_insert(table)
            updated = {c.name: statement.excluded[c.name] for c in table.columns
                       if c.name not in ("id", "request_key") and c.computed is None}
            self._verdict_statement = statement.on_conflict_do_update(index_elements=["request_key"], set_=updated)
        return None if self._verdict_statement is False else self._verdict_statement

    def delete_verdict(self, request_key: str) -> None:
        with self.sql.begin() as conn:
            conn.run("DELETE FROM verdicts WHERE request_key = :key", {"key": request_key})

    # -- reads ------------------------------------------------------------------------------
    @contextmanager
    def connect(self) -> Iterator[Conn]:
        """A connection for the daemon's reads (``auditor.store.sql.Conn``: SQL text, tuples)."""
        with self.sql.connect() as conn:
            yield conn

    @contextmanager
    def session(self) -> Iterator[Session]:
        """An ORM session (the report, capture, replay): SQLAlchemy's ORM is imported here, on first use."""
        if self._sessions is None:
            from sqlalchemy.orm import sessionmaker

            self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        with self._sessions() as session:
            yield session

    def close(self) -> None:
        self.sql.close()
        if self._engine is not None:
            self._engine.dispose()


BLOCK_COLUMNS = "id, format, count, body, host, source"
_BLOCK_INSERT = ("INSERT INTO conn_event_blocks (host, source, format, count, first_ts_ns, last_ts_ns, body) "
                 "VALUES (:host, :source, :format, :count, :first_ts_ns, :last_ts_ns, :body)")


def stored_events(blocks: Iterable[Sequence[Any]]) -> Iterator[tuple[int, ConnEvent]]:
    """(event id, event) for every event of ``blocks`` (rows of BLOCK_COLUMNS, in id order); a
    block that does not decode is logged and skipped."""
    for block_id, fmt, count, body, host, source in blocks:
        try:
            yield from eventblocks.events_of(block_id, fmt, count, body, host=host, source=source)
        except eventblocks.BlockError as exc:
            log.error("skipped %d stored kernel events that do not decode (%s)", count, exc)


_COVERAGE_INSERT = ("INSERT INTO coverage (ts_ns, host, kind, count, detail) "
                    "VALUES (:ts_ns, :host, :kind, :count, :detail)")
_ORPHANED_WORK_COLUMNS = ("host", "server_port", "start_ns", "end_ns", "last_seen_ns", "peak", "request_seconds",
                          "wasted_gpu_seconds", "wasted_cpu_seconds", "end_resolution_s", "cut_short", "with_spans",
                          "model", "cost_unmeasured")
_ORPHANED_WORK_INSERT = (f"INSERT INTO orphaned_work ({', '.join(_ORPHANED_WORK_COLUMNS)}) "
                         f"VALUES ({', '.join(':' + c for c in _ORPHANED_WORK_COLUMNS)})")
_ORPHANED_WORK_DELETE = ("DELETE FROM orphaned_work "
                         "WHERE host = :host AND server_port = :server_port AND start_ns = :start_ns")
_ORPHANED_WORK_END_OPEN = ("UPDATE orphaned_work SET end_ns = last_seen_ns, cut_short = :cut_short "
                           "WHERE host = :host AND end_ns IS NULL")


@cache
def _sqlite_verdict_upsert() -> str:
    """``INSERT .. ON CONFLICT (request_key) DO UPDATE`` (SQLite 3.24 on), a verdict's fields and
    ``updated_ns`` as positional parameters (the row tuples of ``rows_as_tuples``)."""
    columns = (*shape_of(RequestVerdict).names, "updated_ns")
    updated = ", ".join(f"{c} = excluded.{c}" for c in columns if c != "request_key")
    return (f"INSERT INTO verdicts ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)}) "
            f"ON CONFLICT (request_key) DO UPDATE SET {updated}")


def _check_sqlite_path(database: str, *, create: bool) -> None:
    if database and database != ":memory:" and not database.startswith("file:"):
        path = Path(database)
        if path.is_dir():
            raise StoreError(f"{path} is a directory, not a database file; name a file in it, e.g. "
                             f"sqlite:///{path / 'auditor.db'}")
        if not path.exists() and not create:
            raise StoreError(f"no database at {path}; run `auditor run` first or pass --db")
        if not path.parent.exists():
            raise StoreError(f"directory {path.parent} does not exist; create it or pass another --db")


def unwritable_sqlite(url: str) -> tuple[str, str] | None:
    """Why this user cannot write the SQLite file of ``url``, and the fix; None where it can (or for
    another database, or SQLite in memory). SQLite opens a file it cannot write read-only without a
    word, so a daemon on it would start, answer /healthz and fail every write; and it writes its
    -wal, -shm and -journal files beside the database, so their directory must be writable too."""
    database = sqlite_file(url) or sqlite_database(url)
    if database is None or database.startswith("file:"):
        return None
    path = Path(database)
    directory = path.parent.resolve()
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = f"uid {os.geteuid()}"
    effective = os.access in os.supports_effective_ids
    for file in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")):
        if file.exists() and not os.access(file, os.W_OK, effective_ids=effective):
            return (f"{file} is not writable by user {user}, and the daemon writes to it",
                    f"give that user the file (chown {user} {file}) or write permission (chmod u+w {file}), "
                    "or pass another --db")
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK, effective_ids=effective):
        return (f"{directory}, the directory of {path}, is not writable by user {user}, and SQLite writes "
                "its -wal and -shm files beside the database",
                f"give that user the directory (chown {user} {directory}), or pass another --db")
    return None


def _refuse_foreign_sqlite(database: str, where: str) -> None:
    """Refuse another application's SQLite file before any connection of ours opens it: each sets
    ``journal_mode=WAL``, which rewrites the file's header, so the schema check that follows would
    refuse a file it had already changed. Read-only here; anything it cannot read is left to the
    store's own checks, which name the problem."""
    path = Path(database.removeprefix("file:"))
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        uri = f"{path.resolve().as_uri()}?mode=ro"
    except (OSError, ValueError):
        return
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5)
    except sqlite3.Error:
        return
    try:
        tables = {name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
        versioned = "alembic_version" in tables and conn.execute(
            "SELECT 1 FROM alembic_version LIMIT 1").fetchone() is not None
    except sqlite3.Error:
        return  # not a database, encrypted, locked: the store's own checks say which
    finally:
        conn.close()
    if tables and not versioned:
        raise StoreError(f"{where} holds tables {sorted(tables)[:3]} but no auditor schema; "
                         "refusing to touch it: pass another --db")


def _make_engine(url: str, *, create: bool) -> Engine:
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number, a broken [IPv6]
        raise StoreError(f"{url!r} is not a database URL; try sqlite:///auditor.db "
                         "or postgresql+psycopg://user@host/db") from exc
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise StoreError(f"{parsed.render_as_string(hide_password=True)}: the auditor stores to SQLite or "
                         "PostgreSQL only; try sqlite:///auditor.db or postgresql+psycopg://user@host/db")
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite_path(parsed.database or "", create=create)
        engine = _sqlite_engine(parsed)
        event.listen(engine, "connect", lambda dbapi_connection, _record: sqlite_pragmas(dbapi_connection))
        return engine
    try:
        return create_engine(parsed, pool_pre_ping=True)
    except (ImportError, ArgumentError) as exc:
        where = parsed.render_as_string(hide_password=True)
        if parsed.get_driver_name() != "psycopg":  # postgresql:// alone means psycopg2 to SQLAlchemy
            suggested = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=True)
            raise StoreError(f"cannot use {where}: {exc}; the auditor talks to PostgreSQL through psycopg "
                             f"(3), which the extra zombie-auditor[postgres] installs: write the URL as "
                             f"{suggested}") from exc
        raise StoreError(f"cannot use {where}: {exc}; "
                         "for PostgreSQL install the extra: pip install 'zombie-auditor[postgres]'") from exc


def _sqlite_engine(parsed: Any) -> Engine:
    """A SQLite engine, refusing URL options the driver would ignore (SQLAlchemy only warns, and
    the store would run without what the user asked for) or cannot read."""
    import warnings

    from sqlalchemy import create_engine
    from sqlalchemy.exc import SAWarning

    where = parsed.render_as_string(hide_password=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SAWarning)
        try:
            engine = create_engine(parsed, connect_args={"timeout": 5})
            engine.dialect.create_connect_args(engine.url)  # where the options are read; no connection
        except (TypeError, ValueError) as exc:
            raise StoreError(f"{where}: an option's value cannot be read ({exc}); fix it or drop it "
                             "from the URL") from exc
    if any(issubclass(w.category, SAWarning) for w in caught):
        options = ", ".join(sorted(k for k in parsed.query if k not in _PYSQLITE_OPTIONS))
        raise StoreError(f"{where}: SQLite's driver would ignore the option(s) {options}; it reads "
                         f"{', '.join(_PYSQLITE_OPTIONS)} from the URL, and SQLite's own URI options (mode=ro, "
                         "cache=shared) only with uri=true and the database written as file:PATH")
    return engine


_PYSQLITE_OPTIONS = ("uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements")


# A span's columns in the order ``span_from_values`` reads them: the record's fields.
SPAN_COLUMNS: tuple[str, ...] = tuple(SpanRecord.__dataclass_fields__)
_SPAN_ROLE, _SPAN_REWRITTEN, _SPAN_ATTRIBUTES = (SPAN_COLUMNS.index(n) for n in ("role", "peer_rewritten", "attributes"))


def span_from_values(values: Sequence[Any]) -> SpanRecord:
    """A stored span back as the domain record, from its columns in ``SPAN_COLUMNS`` order."""
    fields = dict(zip(SPAN_COLUMNS, values, strict=True))
    fields["role"] = SpanRole(values[_SPAN_ROLE])
    fields["peer_rewritten"] = bool(values[_SPAN_REWRITTEN])
    fields["attributes"] = json_value(values[_SPAN_ATTRIBUTES]) or {}
    return SpanRecord(**fields)


def span_from_row(row: Any) -> SpanRecord:
    """A stored span back as the domain record, from a row of its table or an ORM object."""
    return span_from_values([getattr(row, name) for name in SPAN_COLUMNS])
