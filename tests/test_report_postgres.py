"""The report on a real PostgreSQL server gives the same figures as on SQLite.

The server runs from a temporary directory as the ``postgres`` user (it refuses root), listening
only on a Unix socket there, so no port is shared with anything else.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

import jsonschema
import pytest
from click.testing import CliRunner

from auditor.cli import cli
from auditor.report import ReportQuery, build_report
from auditor.report import query as report_query
from auditor.report.render_data import report_dict
from auditor.report.render_html import render_html
from auditor.store import Store
from tests.report_data import BROWSER, SDK_AGENT, SINCE, T0, UNTIL, at, fill, fill_timeouts

pytestmark = pytest.mark.postgres
SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(versions[-1]) if versions else None


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    initdb, postgres = _binary("initdb"), _binary("postgres")
    if not initdb or not postgres:
        pytest.skip("PostgreSQL server binaries not installed")
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no postgres user to run the server as")
    as_user: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = Path(tempfile.mkdtemp(prefix="report-pg-"))
    if os.geteuid() == 0:
        os.chown(base, user.pw_uid, user.pw_gid)
    data = base / "data"
    subprocess.run([*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "postgres",
                    "--no-sync"], check=True, capture_output=True, timeout=120)
    server = subprocess.Popen([*as_user, postgres, "-D", str(data), "-k", str(base),
                               "-c", "listen_addresses=", "-c", "fsync=off"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (base / ".s.PGSQL.5432").exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {server.stderr.read() if server.stderr else ''}")
            time.sleep(0.1)
        time.sleep(0.3)  # the socket file appears just before connections are accepted
        yield f"postgresql+psycopg://postgres@/postgres?host={base}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)


def test_postgres_report_equals_sqlite(pg_url: str, store: Store) -> None:
    pg = Store(pg_url)
    try:
        fill(pg)
        fill(store)
        query = ReportQuery(since_ns=T0, until_ns=at(3600))
        on_pg, on_sqlite = report_dict(build_report(pg, query)), report_dict(build_report(store, query))
        on_pg.pop("generated_at")
        on_sqlite.pop("generated_at")
        assert on_pg == on_sqlite
        assert on_pg["totals"]["requests"] == 12 and on_pg["totals"]["zombies"] == 2
        # A caller's filters: the spans' User-Agent read from their JSON attributes on both.
        for caller, requests in (({"user_agent": SDK_AGENT}, 10), ({"user_agent": BROWSER}, 1),
                                 ({"client": "10.0.0.7"}, 12)):
            narrowed = ReportQuery(since_ns=T0, until_ns=at(3600), **caller)
            on_pg, on_sqlite = report_dict(build_report(pg, narrowed)), report_dict(build_report(store, narrowed))
            assert on_pg | {"generated_at": None} == on_sqlite | {"generated_at": None}, caller
            assert on_pg["totals"]["requests"] == requests, caller
        # A narrow window read through the indexes time leads (the minute's, the host's walk): the same.
        for share, window in ((2.0, (600, 840)), (2.0, (0, 3600)), (0.0, (600, 840))):
            narrow = ReportQuery(since_ns=at(window[0]), until_ns=at(window[1]))
            with patch.object(report_query, "INDEXED_SHARE", share):
                on_pg, on_sqlite = (report_dict(build_report(each, narrow, with_series=True)) for each in (pg, store))
            assert on_pg | {"generated_at": None} == on_sqlite | {"generated_at": None}, window
            assert on_pg["totals"]["requests"] == (2 if window == (600, 840) else 12)
            assert on_pg["totals"]["gpu_seconds"] > 0
        with_series = build_report(pg, query, with_series=True)
        assert with_series.series is not None
        assert sum(b.completed_requests for b in with_series.series) == 12
        assert "<svg" in render_html(with_series)
        empty = build_report(pg, ReportQuery(since_ns=at(86400), until_ns=at(90000)))
        assert empty.empty and empty.data_range is not None
        result = CliRunner().invoke(cli, ["report", "--db", pg_url, "--since", SINCE, "--until", UNTIL,
                                          "--format", "json"])
        assert result.exit_code == 0, result.output
        jsonschema.Draft202012Validator(SCHEMA).validate(json.loads(result.stdout))
    finally:
        pg.close()


def test_postgres_finds_the_same_client_timeouts(pg_url: str, store: Store) -> None:
    pg = Store(pg_url)
    try:
        # An hour after fill()'s (the server is the module's: the other tests read that hour).
        for each in (pg, store):
            fill_timeouts(each, from_s=7200.0)  # ages grouped by integer division: the same bins on both
        query = ReportQuery(since_ns=at(7200), until_ns=at(10800))
        on_pg, on_sqlite = (build_report(each, query) for each in (pg, store))
        assert on_pg.client_timeouts == on_sqlite.client_timeouts
        assert [t.disconnects for t in on_pg.client_timeouts] == [10]
    finally:
        pg.close()


def test_postgres_keeps_the_same_orphaned_work(pg_url: str, store: Store) -> None:
    from tests.test_report_orphaned import stretch

    pg = Store(pg_url)
    try:
        for each in (pg, store):  # hours of their own: the server is the module's
            each.write_orphaned_work([stretch(8080, 20000, None, 5.0), stretch(8000, 20100, 20110, 4.0, with_spans=True)])
            each.write_orphaned_work([stretch(8080, 20000, 20030, 25.0, gpu_s=12.5, peak=2)])  # its end replaces it
        query = ReportQuery(since_ns=at(19800), until_ns=at(23400))
        on_pg, on_sqlite = (report_dict(build_report(each, query))["orphaned_work"] for each in (pg, store))
        assert on_pg == on_sqlite
        assert [(p["server_port"], p["stretches"], p["request_seconds"], p["with_spans"]) for p in on_pg] == [
            (8080, 1, 25.0, False), (8000, 1, 4.0, True)]
        # A stretch a killed run left open, ended where last written as the next run starts.
        for each in (pg, store):
            each.write_orphaned_work([stretch(8090, 20200, None, 3.0, last_seen_ns=at(20203))])
            each.end_open_orphaned_work("gpu-a")
        on_pg, on_sqlite = (report_dict(build_report(each, query))["orphaned_work"] for each in (pg, store))
        assert on_pg == on_sqlite
        [ended] = [p for p in on_pg if p["server_port"] == 8090]
        assert ended["running"] == 0 and ended["longest_seconds"] == pytest.approx(3.0), ended
    finally:
        pg.close()


def test_capture_export_from_postgres_equals_sqlite(pg_url: str, store: Store, tmp_path: Path) -> None:
    from replay.capture import export_capture, open_capture_store, read_capture

    pg = Store(pg_url)
    try:
        fill(pg)  # spans and verdicts are idempotent writes: a second fill changes nothing here
        fill(store)
        captures = []
        for name, source in (("pg", pg), ("sqlite", store)):
            export_capture(source, tmp_path / f"{name}.db", since_ns=T0, until_ns=at(3600))
            captures.append(read_capture(open_capture_store(tmp_path / f"{name}.db")).requests)
        on_pg, on_sqlite = captures
        assert on_pg == on_sqlite and len(on_pg) == 12
        assert [r.original_verdict for r in on_pg if r.original_verdict] == [
            "completed", "aborted", "zombie", "zombie", "inflight_zombie"]
    finally:
        pg.close()
