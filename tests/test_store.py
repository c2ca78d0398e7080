"""The store: migrations build the schema, bad databases are refused without being touched."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import inspect

from auditor.errors import StoreError
from auditor.model import ConnEvent, ConnEventKind, SpanRecord, SpanRole
from auditor.store import Base, Store


def test_migrations_build_every_model_table(store: Store) -> None:
    tables = set(inspect(store.engine).get_table_names())
    assert set(Base.metadata.tables) <= tables
    assert store.current_revision() == store.head_revision()


def test_sqlite_runs_in_wal_mode(store: Store) -> None:
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 10000


def test_corrupt_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "auditor.db"
    path.write_bytes(b"this is not sqlite" * 100)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a readable auditor database"):
        Store(f"sqlite:///{path}")
    assert path.read_bytes() == before


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "auditor.db"
    Store(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(StoreError, match="newer than this auditor knows"):
        Store(f"sqlite:///{path}")


def test_foreign_database_is_not_touched(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(StoreError, match="no auditor schema"):
        Store(f"sqlite:///{path}")


def test_spans_are_not_duplicated(store: Store) -> None:
    span = SpanRecord(trace_id="a" * 32, span_id="b" * 16, parent_span_id=None, name="POST /v1/completions",
                      kind="server", start_ns=1, end_ns=2, role=SpanRole.HTTP_SERVER)
    store.insert_spans([span])
    store.insert_spans([span])
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM spans").scalar() == 1


def test_conn_events_round_trip(store: Store) -> None:
    event = ConnEvent(ts_ns=123, kind=ConnEventKind.PEER_RST, family=6, client_addr="::1", client_port=5000,
                      server_addr="::1", server_port=8000, cookie=42, host="h")
    assert store.insert_conn_events([event, event]) == 2
    with store.engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT kind, family, cookie FROM conn_events").first()
    assert tuple(row) == ("peer_rst", 6, 42)


def test_models_match_the_migrations(store: Store) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == [], f"tables.py and the migrations differ; write a migration: {diff}"


@pytest.mark.parametrize("in_child", [False, True])
def test_older_schema_is_migrated_at_open(tmp_path: Path, in_child: bool) -> None:
    path = tmp_path / "auditor.db"
    store = Store(f"sqlite:///{path}", check=False)
    store.upgrade("0001")
    assert store.current_revision() == "0001"
    store.close()
    reopened = Store(f"sqlite:///{path}", migrate_in_child=in_child)
    assert reopened.current_revision() == reopened.head_revision() != "0001"


def test_revisions_read_from_the_scripts_are_alembics() -> None:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from auditor.store.db import MIGRATIONS_DIR, revisions

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    scripts = ScriptDirectory.from_config(config)
    known, head = revisions()
    assert head == scripts.get_current_head()
    assert known == {script.revision for script in scripts.walk_revisions()}


def test_a_daemons_store_migrates_in_a_child_and_never_imports_alembic(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "auditor.db"
    check = ("import sys; from auditor.store import Store; "
             f"s = Store('sqlite:///{path}', migrate_in_child=True); "
             "print(s.current_revision() == s.head_revision(), 'alembic' in sys.modules, 'mako' in sys.modules)")
    for _ in range(2):  # a new database, then one already at the head
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", "False", "False"]
    assert set(inspect(Store(f"sqlite:///{path}").engine).get_table_names()) >= set(Base.metadata.tables)


def test_a_failed_child_migration_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "auditor.db"
    monkeypatch.setattr("auditor.store.db.sys.executable", str(tmp_path / "no-python"))
    with pytest.raises(StoreError, match=r"could not migrate .*auditor\.db: the migration process failed"):
        Store(f"sqlite:///{path}", migrate_in_child=True)
    monkeypatch.setattr("auditor.store.db.sys.executable", "/bin/false")  # exits 1, says nothing
    with pytest.raises(StoreError, match=r"could not migrate .*auditor\.db: exit status 1"):
        Store(f"sqlite:///{path}", migrate_in_child=True)
