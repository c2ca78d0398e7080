"""The store: one SQLAlchemy engine over SQLite (default) or PostgreSQL, migrated by Alembic.

Sources write through the batch ``insert_*`` methods (one transaction a batch; on SQLite plain
tuples through the driver, elsewhere SQLAlchemy Core); correlation reads through ``connect()``
(Core, on the tables of ``auditor.store.tables``), the report, capture and replay through
``session()`` (the ORM, imported on first use: the daemon never loads it). Opening a store checks its schema first:
a file that is not a database, or a database written by a newer auditor, is refused with an error
that says what to do, and nothing is overwritten.

Alembic is imported only to migrate: the schema check reads the revision files and the version
table itself, and the daemon migrates a new database in a short-lived child
(``auditor.store.migrate``), so a long-running process never holds Alembic and Mako (about 11 MiB).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, delete, event, insert, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, OperationalError, SQLAlchemyError

from auditor.errors import StoreError
from auditor.model import ConnEvent, CoverageKind, RequestVerdict, SpanRecord, SpanRole, UtilSample
from auditor.store import tables
from auditor.store.rows import (
    grouped_inserts,
    row_dict,
    rows_as_tuples,
    shape_of,
    sqlite_insert_sql,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_REVISION_LINE = re.compile(r"^(down_revision|revision)\s*(?::[^=]*)?=\s*(None|\"([^\"]*)\"|'([^']*)')", re.M)
MIGRATE_TIMEOUT_S = 600.0


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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the report read while the daemon writes; NORMAL sync is durable across app crashes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    # Checkpoint every 10,000 pages (40 MiB of WAL) rather than 1,000: the spans' trace-id index
    # takes its inserts on random pages, and a page written many times between two checkpoints is
    # copied back once (bench figures in docs/footprint.md). The WAL file keeps its size on disk.
    cursor.execute("PRAGMA wal_autocheckpoint=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


class Store:
    """A migrated database and the batch writes the sources use."""

    def __init__(self, url: str | None = None, *, upgrade: bool = True, create: bool = True,
                 check: bool = True, migrate_in_child: bool = False) -> None:
        self.url = url or default_db_url()
        self.engine = _make_engine(self.url, create=create)
        self._sessions: Any = None  # an ORM sessionmaker, made on first use
        self._verdict_statement: Any = None  # built on first use (False: this database has none)
        if check:
            self.check_schema(upgrade=upgrade, in_child=migrate_in_child)

    # -- schema -----------------------------------------------------------------------------
    def head_revision(self) -> str:
        return revisions()[1]

    def current_revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                if not inspect(conn).has_table("alembic_version"):
                    return None
                found = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            if len(found) > 1:
                raise StoreError(f"{self.where()} records several schema revisions {sorted(found)}; "
                                 "it was migrated by something else: pass another --db")
            return found[0] if found else None
        except OperationalError as exc:
            if self.engine.dialect.name != "sqlite":
                raise StoreError(f"cannot reach {self.where()} ({_short(exc)}); check that the server "
                                 "is up and the URL, user and password are right") from exc
            raise StoreError(f"cannot open {self.where()} ({_short(exc)}); check the path and its "
                             "permissions") from exc
        except DatabaseError as exc:
            raise StoreError(
                f"{self.where()} is not a readable auditor database ({_short(exc)}); "
                "move it aside or pass another --db"
            ) from exc

    def check_schema(self, *, upgrade: bool = True, in_child: bool = False) -> None:
        current = self.current_revision()
        known, head = revisions()
        if current is not None and current not in known:
            raise StoreError(
                f"{self.where()} has schema {current}, newer than this auditor knows (head {head}); "
                "upgrade the auditor or point --db elsewhere"
            )
        if current == head:
            return
        if current is None:
            with self.engine.connect() as conn:
                tables = set(inspect(conn).get_table_names())
            if tables:
                raise StoreError(
                    f"{self.where()} holds tables {sorted(tables)[:3]} but no auditor schema; "
                    "refusing to touch it: pass another --db"
                )
        if not upgrade:
            raise StoreError(f"{self.where()} needs migrating to {head}: run `auditor db upgrade`")
        if in_child and self._reachable_from_a_child():
            self._upgrade_in_child()
        else:
            self.upgrade()

    def _reachable_from_a_child(self) -> bool:
        url = make_url(self.url)
        return not (url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"))

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
        self.engine.dispose()  # connections opened before the migration may hold the old schema

    def upgrade(self, revision: str = "head") -> None:
        from alembic import command
        from alembic.config import Config as AlembicConfig

        logging.getLogger("alembic").setLevel(logging.WARNING)  # per-step INFO lines are noise here
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        try:
            with self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
        except SQLAlchemyError as exc:
            raise StoreError(f"could not migrate {self.where()}: {_short(exc)}") from exc

    def where(self) -> str:
        """The store's URL with any password hidden: what error messages name."""
        return make_url(self.url).render_as_string(hide_password=True)

    # -- writes -----------------------------------------------------------------------------
    def _insert(self, table: Any, rows: list[Any], statement: Any = None) -> int:
        """One transaction: ``rows`` as dicts for a Core statement (default: a plain insert), or
        as tuples when ``statement`` is driver SQL text."""
        if not rows:
            return 0
        try:
            with self.engine.begin() as conn:
                if isinstance(statement, str):
                    for sql, params in grouped_inserts(statement, rows):
                        conn.exec_driver_sql(sql, params)
                else:
                    conn.execute(insert(table) if statement is None else statement, rows)
        except OperationalError as exc:
            raise StoreError(f"write to {self.where()} failed: {_short(exc)}") from exc
        return len(rows)

    def _insert_records(self, table: Any, records: Iterable[Any], *, skip_duplicates: bool = False) -> int:
        """Insert dataclass records whose fields are the table's columns (less the ``id`` key).
        SQLite gets plain tuples through the driver; other databases go through SQLAlchemy Core."""
        records = list(records)
        if not records:
            return 0
        if self.engine.dialect.name != "sqlite":
            statement: Any = None
            if skip_duplicates and self.engine.dialect.name == "postgresql":
                from sqlalchemy.dialects.postgresql import insert as pg_insert

                statement = pg_insert(table).on_conflict_do_nothing()
            return self._insert(table, [row_dict(r) for r in records], statement)
        record_type = type(records[0])
        sql = sqlite_insert_sql(table, record_type, skip_duplicates)
        return self._insert(table, rows_as_tuples(records, shape_of(record_type)), sql)

    def insert_conn_events(self, events: Iterable[ConnEvent]) -> int:
        return self._insert_records(tables.conn_events, events)

    def insert_spans(self, spans: Iterable[SpanRecord]) -> int:
        """Insert spans; a span already stored (same trace and span id) is skipped, not duplicated."""
        return self._insert_records(tables.spans, spans, skip_duplicates=True)

    def insert_samples(self, samples: Iterable[UtilSample]) -> int:
        return self._insert_records(tables.util_samples, samples)

    def write(self, records: Sequence[ConnEvent | SpanRecord | UtilSample]) -> int:
        """The sources' sink (``auditor.sink.Sink``): one batch of one record type, one transaction."""
        if not records:
            return 0
        writer = self._writers.get(type(records[0]))
        if writer is None:
            raise TypeError(f"the store keeps no {type(records[0]).__name__} records")
        return int(writer(self, records))

    _writers: dict[type, Any] = {ConnEvent: insert_conn_events, SpanRecord: insert_spans,
                                 UtilSample: insert_samples}

    def add_coverage(self, kind: CoverageKind, count: int = 1, *, host: str = "",
                     ts_ns: int | None = None, detail: str | None = None) -> None:
        self.add_coverage_rows([{"ts_ns": ts_ns if ts_ns is not None else time.time_ns(), "host": host,
                                 "kind": kind.value, "count": count, "detail": detail}])

    def add_coverage_rows(self, rows: list[dict[str, Any]]) -> int:
        """Coverage rows (``ts_ns``, ``host``, ``kind``, ``count``, ``detail``), one transaction."""
        return self._insert(tables.coverage, rows)

    def upsert_verdicts(self, verdicts: Sequence[RequestVerdict]) -> int:
        """Write verdicts keyed by request; a later verdict for the same request replaces the earlier."""
        if not verdicts:
            return 0
        now = time.time_ns()
        try:
            self._upsert_verdicts(verdicts, now)
        except OperationalError as exc:
            raise StoreError(f"write to {self.where()} failed: {_short(exc)}") from exc
        return len(verdicts)

    def _upsert_verdicts(self, verdicts: Sequence[RequestVerdict], now: int) -> None:
        # The last verdict of a request in the batch wins (a row can be upserted once per statement).
        rows = list({v.request_key: row_dict(v) | {"updated_ns": now} for v in verdicts}.values())
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

            dialect_insert: Any = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(self.engine.dialect.name)
            if dialect_insert is None:
                self._verdict_statement = False
                return None
            table = tables.verdicts
            statement = dialect_insert(table)
            updated = {c.name: statement.excluded[c.name] for c in table.columns if c.name not in ("id", "request_key")}
            self._verdict_statement = statement.on_conflict_do_update(index_elements=["request_key"], set_=updated)
        return None if self._verdict_statement is False else self._verdict_statement

    def delete_verdict(self, request_key: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(tables.verdicts).where(tables.verdicts.c.request_key == request_key))

    # -- reads ------------------------------------------------------------------------------
    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A Core connection for reads (its transaction is rolled back at the end)."""
        with self.engine.connect() as conn:
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
        self.engine.dispose()


def _make_engine(url: str, *, create: bool) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"--db {url!r} is not a database URL; try sqlite:///auditor.db "
                         "or postgresql+psycopg://user@host/db") from exc
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            path = Path(database)
            if not path.exists() and not create:
                raise StoreError(f"no database at {path}; run `auditor run` first or pass --db")
            if not path.parent.exists():
                raise StoreError(f"directory {path.parent} does not exist; create it or pass another --db")
        engine = create_engine(parsed, connect_args={"timeout": 5})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    try:
        return create_engine(parsed, pool_pre_ping=True)
    except (ImportError, ArgumentError) as exc:
        raise StoreError(f"cannot use {parsed.render_as_string(hide_password=True)}: {exc}; "
                         "for PostgreSQL install the extra: pip install 'zombie-auditor[postgres]'") from exc


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0] if text else type(exc).__name__


def span_from_row(row: Any) -> SpanRecord:
    """A stored span back as the domain record, from a row of its table or an ORM object."""
    return SpanRecord(
        trace_id=row.trace_id, span_id=row.span_id, parent_span_id=row.parent_span_id, name=row.name,
        kind=row.kind, start_ns=row.start_ns, end_ns=row.end_ns, service=row.service, host=row.host,
        status=row.status, role=SpanRole(row.role), peer_addr=row.peer_addr, peer_port=row.peer_port,
        server_port=row.server_port, request_id=row.request_id, route=row.route, model=row.model,
        http_status=row.http_status, finish_reason=row.finish_reason, prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens, max_tokens=row.max_tokens,
        time_in_queue_s=row.time_in_queue_s, time_to_first_token_s=row.time_to_first_token_s,
        process_pid=row.process_pid, peer_rewritten=row.peer_rewritten, attributes=row.attributes or {},
    )
