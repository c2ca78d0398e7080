"""``auditor report`` on the command line: formats, files, and every kind of bad input."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import socket
import sqlite3
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from auditor.cli import cli
from auditor.cli.util import TIME, parse_duration
from auditor.errors import StoreError
from auditor.store import Store
from tests.report_data import BROWSER, SINCE, UNTIL, fill, trace

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())


@pytest.fixture
def db(store: Store) -> str:
    fill(store)
    return store.url


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["report", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_help_exists_and_lists_the_options() -> None:
    code, out, _ = invoke("--help")
    assert code == 0
    for option in ("--since", "--until", "--host", "--service", "--route", "--model", "--format",
                   "--output", "--top", "--db", "--config"):
        assert option in out
    root = CliRunner().invoke(cli, ["--help"])
    assert "report" in root.stdout


def test_table_is_the_default(db: str) -> None:
    code, out, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL)
    assert code == 0, out
    assert "Worst zombies" in out and trace(9) in out
    assert max(len(line) for line in out.splitlines()) <= 100
    # The 3 s zombie whose later leavers' rise was untold says how short it may have been; no other does.
    assert out.count("ran on at least") == 1 and "ran on at least 1.2 s: clients that left later" in out
    assert out.count("told by") == 1 and "told by engine_metrics" in out  # the one whose details say


def test_table_fits_the_terminal_it_is_printed_on(db: str, tmp_path: Path) -> None:
    """COLUMNS=80: every line within 80, ids still whole; to a file, the 100-column layout."""
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", SINCE, "--until", UNTIL],
                                env={"COLUMNS": "80"}, catch_exceptions=False)
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert trace(9) in result.stdout and "<script>alert(1)</script>" in result.stdout
    assert "unconfirmed counts are in --format json" in result.stdout
    out = tmp_path / "r.txt"
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", SINCE, "--until", UNTIL, "-o", str(out)],
                                env={"COLUMNS": "80"}, catch_exceptions=False)
    text = out.read_text()
    assert result.exit_code == 0 and " complete aborted " in text and "unconfirmed counts" not in text
    assert max(len(line) for line in text.splitlines()) > 80  # no terminal narrows a file


def test_the_output_files_name_picks_the_format_unless_one_is_given(db: str, tmp_path: Path) -> None:
    """-o zombies.html is the page, not a table in a file named .html; a --format given wins, with
    a warning where the name says otherwise."""
    window = ["--db", db, "--since", SINCE, "--until", UNTIL]
    for name, opening in (("z.html", "<!DOCTYPE html>"), ("z.JSON", "{"), ("z.csv", "request_id,trace_id,"),
                          ("z.txt", "Zombie requests"), ("z.out", "Zombie requests")):
        code, _, err = invoke(*window, "-o", str(tmp_path / name))
        assert code == 0 and (tmp_path / name).read_text().startswith(opening), (name, err)
        assert "warning" not in err
    code, _, err = invoke(*window, "--format", "html", "-o", str(tmp_path / "r.json"))
    assert code == 0 and (tmp_path / "r.json").read_text().startswith("<!DOCTYPE html>")
    assert f"warning: writing html to {tmp_path / 'r.json'}, whose name says json" in err
    code, _, err = invoke(*window, "--json", "-o", str(tmp_path / "r2.json"))
    assert code == 0 and "warning" not in err


def test_json_on_stdout_validates(db: str) -> None:
    code, out, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json",
                          "--route", "/v1/chat/completions", "--top", "2")
    assert code == 0
    document = json.loads(out)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert document["window"]["filters"]["route"] == "/v1/chat/completions"
    assert document["totals"]["disconnects"] == 4 and len(document["worst_zombies"]) == 2
    code, short, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--json",
                            "--route", "/v1/chat/completions", "--top", "2")
    assert code == 0 and json.loads(short)["totals"] == document["totals"]


@pytest.mark.parametrize(("fmt", "marker"), [
    ("json", '"schema": "auditor.report/v1"'), ("csv", "request_id,trace_id,verdict"),
    ("html", "<!DOCTYPE html>"), ("table", "Totals")])
def test_every_format_writes_to_a_file(db: str, tmp_path: Path, fmt: str, marker: str) -> None:
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / f"report.{fmt}"
    code, out, err = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", fmt,
                            "-o", str(target))
    assert code == 0, err
    assert out == "" and f"wrote {fmt} report to {target}" in err
    assert marker in target.read_text(encoding="utf-8")
    assert list(target.parent.iterdir()) == [target]  # no temporary file left behind


def test_html_escapes_a_script_in_a_request_id(db: str) -> None:
    code, out, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "html")
    assert code == 0
    assert "<script>" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out


def test_empty_window_is_explained_and_exits_zero(db: str) -> None:
    code, out, _ = invoke("--db", db, "--since", "2026-11-23T00:00:00Z", "--until",
                          "2026-11-23T01:00:00Z")
    assert code == 0
    assert ("no requests between 2026-11-23T00:00:00Z and 2026-11-23T01:00:00Z; "
            "the store holds data from 2026-11-22T03:00:00Z to 2026-11-22T04:20:02Z") in out
    code, out, err = invoke("--db", db, "--since", "2026-11-23T00:00:00Z", "--until",
                            "2026-11-23T01:00:00Z", "--format", "json")
    assert code == 0 and "note: no requests between" in err
    document = json.loads(out)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert document["totals"]["zombies"] == 0 and document["empty"] is True


def test_empty_window_with_filters_names_them(db: str) -> None:
    code, out, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--model", "gpt-9")
    assert code == 0
    assert "no requests matching model=gpt-9 between" in out


@pytest.mark.parametrize("bad", ["yesterday", "1 hour", "-5m", "2026-11-22T10:00:00"])
def test_bad_since_is_rejected_with_an_example(db: str, bad: str) -> None:
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", bad])
    assert result.exit_code == 2
    assert "Invalid value for '--since'" in result.stderr
    assert "e.g." in result.stderr and "2026-11-22T10:00:00Z" in result.stderr


def test_until_before_since_is_rejected(db: str) -> None:
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", "1h", "--until", "2h"])
    assert result.exit_code == 2
    assert "is not after --since" in result.stderr and "e.g. --since 2h --until 1h" in result.stderr
    # A window to end now that starts now is --since's fault, not an --until nobody gave.
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", "0s"])
    assert result.exit_code == 2 and "Invalid value for --since: " in result.stderr, result.stderr
    assert "is now: the window up to now is empty; give a duration back from now, e.g. --since 1h" in result.stderr


@pytest.mark.parametrize("command", ["report", "capture export"])
def test_a_since_in_the_future_is_blamed_on_since(db: str, tmp_path: Path, command: str) -> None:
    """Without --until the window ends now: the error is --since's, not that of an --until never given."""
    out = tmp_path / "capture.db"
    extra = ["-o", str(out)] if command.startswith("capture") else []
    result = CliRunner().invoke(cli, [*command.split(), *extra, "--db", db, "--since", "2200-01-01T00:00:00Z"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for --since: 2200-01-01T00:00:00+00:00 is in the future" in result.stderr, result.stderr
    assert "--until" not in result.stderr and not out.exists()


@pytest.mark.parametrize("fmt", ["csv", "table", "html"])
def test_json_and_another_format_are_refused(db: str, fmt: str) -> None:
    result = CliRunner().invoke(cli, ["report", "--db", db, "--format", fmt, "--json"])
    assert result.exit_code == 2, result.output
    assert f"--json and --format {fmt} ask for two formats; give one" in result.stderr, result.stderr
    code, out, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json", "--json")
    assert code == 0 and json.loads(out)["schema"] == "auditor.report/v1"


@pytest.mark.parametrize(("args", "message"), [
    (["--since", "999999999w"], "'--since': '999999999w' back from now reaches before 1970"),
    (["--since", "200000w"], "'--since': '200000w' back from now reaches before 1970"),
    (["--since", "9" * 400 + "s"], "back from now reaches before 1970"),
    (["--since", "1600-01-01T00:00:00Z"], "'--since': '1600-01-01T00:00:00Z' is before 1970"),
    (["--since", "0001-01-01T00:00:00+05:00"], "is before 1970"),
    (["--until", "2300-01-01T00:00:00Z"], "'--until': '2300-01-01T00:00:00Z' is too far in the future"),
    (["--since", "9999-12-31T23:59:59-05:00"], "is too far in the future"),
])
@pytest.mark.parametrize("command", ["report", "capture export"])
def test_times_outside_what_the_store_holds_are_refused(db: str, tmp_path: Path, command: str, args: list[str],
                                                        message: str) -> None:
    """Stored times are 64-bit nanoseconds since 1970; beyond them a window used to end in an
    OverflowError traceback."""
    out = tmp_path / "capture.db"
    extra = ["-o", str(out)] if command.startswith("capture") else []
    result = CliRunner().invoke(cli, [*command.split(), *extra, "--db", db, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output, result.stderr
    assert isinstance(result.exception, SystemExit) and not out.exists()


@pytest.mark.parametrize("args", [["--since", "1h", "--until", "1h"], ["--since", "0s"],
                                  ["--since", "0s", "--until", "0s"]])
@pytest.mark.parametrize("command", ["report", "capture export"])
def test_an_empty_window_is_refused(db: str, tmp_path: Path, command: str, args: list[str]) -> None:
    """Both options and the default --until read "now" once: equal durations are an empty window."""
    out = tmp_path / "capture.db"
    extra = ["-o", str(out)] if command.startswith("capture") else []
    result = CliRunner().invoke(cli, [*command.split(), *extra, "--db", db, *args])
    assert result.exit_code == 2, result.output
    empty = "is now: the window up to now is empty" if "--until" not in args else "is not after --since"
    assert empty in result.stderr, result.stderr
    assert not out.exists()


def test_empty_output_path_is_refused(db: str) -> None:
    result = CliRunner().invoke(cli, ["report", "--db", db, "-o", "", "--format", "json"])
    assert result.exit_code == 2, result.output
    assert "'' names no file" in result.stderr and isinstance(result.exception, SystemExit)


def test_dash_output_is_standard_output(db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, out, err = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json", "-o", "-")
    assert code == 0 and json.loads(out)["schema"] == "auditor.report/v1"
    assert "wrote" not in err and list(here.iterdir()) == []


def test_capture_export_to_dash_is_refused(db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture is SQLite: standard output cannot hold it, and a file named - is nobody's intent."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = CliRunner().invoke(cli, ["capture", "export", "--db", db, "-o", "-"])
    assert result.exit_code == 2, result.output
    assert "a capture is a SQLite file, which cannot go to standard output (-o -)" in result.stderr
    assert list(here.iterdir()) == []


def test_capture_export_over_an_existing_file_is_refused_before_exporting(db: str, tmp_path: Path) -> None:
    """As report refuses its -o: a usage error, and nothing read or written, not an export then exit 1."""
    other = tmp_path / "passwd"
    other.write_text("root:x:0:0::/root:/bin/sh\n")
    result = CliRunner().invoke(cli, ["capture", "export", "--db", db, "--since", SINCE, "--until", UNTIL,
                                      "-o", str(other)])
    assert result.exit_code == 2, result.output
    assert f"{other} exists; pass --force to replace it, or another -o" in result.stderr, result.stderr
    assert "exporting" not in result.output and other.read_text() == "root:x:0:0::/root:/bin/sh\n"
    assert not list(tmp_path.glob(".passwd.*"))  # no capture was written beside it


@pytest.mark.parametrize("text", ["2026-11-22T10:00:00z", "2026-11-22t10:00:00z"])
def test_a_lowercase_z_is_utc_as_rfc_3339_allows(text: str) -> None:
    assert TIME.convert(text, None, None) == dt.datetime(2026, 11, 22, 10, tzinfo=dt.timezone.utc)


def test_missing_database_is_one_line_and_nothing_is_created(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.db"
    result = CliRunner().invoke(cli, ["report", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1
    assert result.stderr == f"Error: no database at {path}; run `auditor run` first or pass --db\n"
    assert not path.exists()


@pytest.mark.parametrize("command", [["report"], ["db", "status"]])
@pytest.mark.parametrize("where", ["env", "file"])
def test_a_missing_database_names_the_setting_it_came_from(tmp_path: Path, command: list[str], where: str) -> None:
    """Not "or pass --db" when the path came from AUDITOR_DB or the config file."""
    path = tmp_path / "nowhere.db"
    config = tmp_path / "a.toml"
    config.write_text(f'db = "sqlite:///{path}"\n')
    args, env, source = {"env": ([], {"AUDITOR_DB": f"sqlite:///{path}"}, "AUDITOR_DB"),
                         "file": (["--config", str(config)], {}, f"db in {config}")}[where]
    result = CliRunner().invoke(cli, [*command, *args], env={"AUDITOR_DB": None, **env})
    assert result.exit_code == 1, result.output
    assert result.stderr == (f"Error: no database at {path} (from {source}); run `auditor run` first or set "
                             f"{source} to the database it writes\n")
    assert not path.exists()


@pytest.mark.parametrize("command", [["report"], ["db", "status"], ["db", "upgrade"]])
def test_a_directory_as_the_database_is_named_as_one(tmp_path: Path, command: list[str]) -> None:
    """Not SQLite's "unable to open database file"."""
    result = CliRunner().invoke(cli, [*command, "--db", f"sqlite:///{tmp_path}"])
    assert result.exit_code == 1, result.output
    assert result.stderr == (f"Error: {tmp_path} is a directory, not a database file; name a file in it, e.g. "
                             f"sqlite:///{tmp_path}/auditor.db\n")


def test_store_at_the_base_revision_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    sqlite3.connect(path).close()  # a database file from before any migration ran
    code, out, _ = invoke("--db", f"sqlite:///{path}", "--since", "1h")
    assert code == 0 and "the store holds no requests yet" in out
    assert Store(f"sqlite:///{path}", upgrade=False).current_revision() is not None


@pytest.mark.parametrize("command", [["report"], ["db", "upgrade"], ["capture", "export", "-o", "{tmp}/c.db"]])
@pytest.mark.parametrize("options", ["", "?timeout=3"])
def test_a_foreign_sqlite_file_is_refused_byte_for_byte_untouched(tmp_path: Path, command: list[str],
                                                                  options: str) -> None:
    """The refusal comes before any connection sets its pragmas: journal_mode=WAL would have
    rewritten the file's header (and left -wal and -shm files beside it)."""
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE foo (x)")
        conn.execute("INSERT INTO foo VALUES (1)")
    conn.close()
    before = path.read_bytes()
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in command]
    result = CliRunner().invoke(cli, [*args, "--db", f"sqlite:///{path}{options}"])
    assert result.exit_code == 1, result.output
    assert "holds tables ['foo'] but no auditor schema; refusing to touch it" in result.output, result.output
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:?uri=true"])
@pytest.mark.parametrize("command", [["report"], ["db", "upgrade"], ["db", "status"],
                                     ["capture", "export", "-o", "{tmp}/c.db"]])
def test_sqlite_in_memory_is_refused_where_a_stored_database_is_read(tmp_path: Path, command: list[str],
                                                                    url: str) -> None:
    """A database in memory dies with the process: reading one says "no requests yet", and
    upgrading one "succeeds", about nothing."""
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in command]
    result = CliRunner().invoke(cli, [*args, "--db", url])
    assert result.exit_code == 1, result.output
    assert result.stderr == (f"Error: --db {url!r} is SQLite in memory, which holds nothing across processes; "
                             "give a file, e.g. sqlite:///auditor.db\n")
    assert list(tmp_path.iterdir()) == []


def test_a_database_other_than_sqlite_or_postgresql_is_named_as_unsupported(tmp_path: Path) -> None:
    """Not a missing MySQLdb module with a hint to install the PostgreSQL extra."""
    result = CliRunner().invoke(cli, ["report", "--db", "mysql://u:secret@x/y", "--since", "1h"])
    assert result.exit_code == 1, result.output
    assert result.stderr == ("Error: mysql://u:***@x/y: the auditor stores to SQLite or PostgreSQL only; "
                             "try sqlite:///auditor.db or postgresql+psycopg://user@host/db\n")


@pytest.mark.parametrize(("where", "named"), [
    ("flag", "--db 'garbage'"), ("env", "AUDITOR_DB 'garbage'"), ("file", "db 'garbage' in {tmp}/a.toml")])
def test_a_bad_database_url_is_named_by_where_it_came_from(tmp_path: Path, where: str, named: str) -> None:
    """Not "--db" when the user never passed --db."""
    config = tmp_path / "a.toml"
    config.write_text('db = "garbage"\n')
    args, env = {"flag": (["--db", "garbage"], {}), "env": ([], {"AUDITOR_DB": "garbage"}),
                 "file": (["--config", str(config)], {})}[where]
    result = CliRunner().invoke(cli, ["report", *args], env=env)
    assert result.exit_code == 1, result.output
    assert result.stderr == (f"Error: {named.replace('{tmp}', str(tmp_path))} is not a database URL; "
                             "try sqlite:///auditor.db or postgresql+psycopg://user@host/db\n")


@pytest.mark.parametrize("url", ["postgresql://u@127.0.0.1:abc/db", "postgresql://u@h:1:2/db",
                                 "postgresql://u@[::1/db", "postgresql://u@h:/db"])
@pytest.mark.parametrize("command", [["report"], ["db", "status"], ["db", "upgrade"], ["doctor"], ["run"]])
def test_a_database_url_with_a_bad_port_or_ipv6_address_is_not_a_database_url(url: str, command: list[str]) -> None:
    """SQLAlchemy raises ValueError, not ArgumentError, for these: no traceback either way."""
    result = CliRunner().invoke(cli, [*command, "--db", url], env={"AUDITOR_DB": None})
    assert result.exit_code == 1, result.output
    assert result.stderr == (f"Error: --db {url!r} is not a database URL; "
                             "try sqlite:///auditor.db or postgresql+psycopg://user@host/db\n")


def test_the_store_names_a_database_url_with_a_bad_port(tmp_path: Path) -> None:
    """The daemon's own path (no CLI in between) refuses it as the CLI does."""
    with pytest.raises(StoreError, match="is not a database URL"):
        Store("postgresql://u@127.0.0.1:abc/db")


def test_newer_schema_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    Store(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'ffff'")
    result = CliRunner().invoke(cli, ["report", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1 and "newer than this auditor knows" in result.stderr


def test_unreachable_postgres_names_the_url_without_the_password() -> None:
    with socket.socket() as probe:  # a port nothing listens on: bind, note, close
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg://auditor:s3cret@127.0.0.1:{port}/auditor"
    result = CliRunner().invoke(cli, ["report", "--db", url])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "s3cret" not in result.stderr
    assert lines[0].startswith(f"Error: cannot reach the database at postgresql+psycopg://auditor:***@127.0.0.1:{port}/auditor")
    assert "check that the server is running" in lines[0]


@pytest.mark.parametrize("command", [["report"], ["db", "status"]])
@pytest.mark.parametrize(("where", "named"), [("flag", "--db"), ("env", "AUDITOR_DB"), ("file", "db in {tmp}/a.toml")])
def test_unreachable_postgres_is_named_by_where_its_url_came_from(tmp_path: Path, command: list[str], where: str,
                                                                 named: str) -> None:
    """Not "the host and port in --db" when no --db was given, and the same words from both commands."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg://auditor@127.0.0.1:{port}/auditor"
    config = tmp_path / "a.toml"
    config.write_text(f'db = "{url}"\n')
    args, env = {"flag": (["--db", url], {}), "env": ([], {"AUDITOR_DB": url}),
                 "file": (["--config", str(config)], {})}[where]
    result = CliRunner().invoke(cli, [*command, *args], env={"AUDITOR_DB": None, **env})
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: cannot reach the database at {url} ("), lines
    assert lines[0].endswith(f"; check that the server is running, the host and port given by "
                             f"{named.replace('{tmp}', str(tmp_path))}, and the user and password"), lines


@pytest.mark.parametrize("driver", ["psycopg2", "asyncpg"])
def test_a_postgresql_driver_other_than_psycopg_is_told_the_url_to_use(driver: str) -> None:
    """The postgres extra installs psycopg 3: installing it again would not help a psycopg2 URL."""
    if importlib.util.find_spec(driver) is not None:
        pytest.skip(f"{driver} is installed here")
    result = CliRunner().invoke(cli, ["report", "--db", f"postgresql+{driver}://u:pw@127.0.0.1:1/db"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: cannot use postgresql+{driver}://u:***@127.0.0.1:1/db: "), result.stderr
    assert result.stderr.endswith("; the auditor talks to PostgreSQL through psycopg (3), which the extra "
                                  "zombie-auditor[postgres] installs: write the URL as "
                                  "postgresql+psycopg://u:***@127.0.0.1:1/db\n"), result.stderr
    assert "pip install" not in result.stderr


def test_unwritable_output_is_a_clear_error(db: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["report", "--db", db, "-o", str(tmp_path / "no" / "r.json"),
                                      "--format", "json"])
    assert result.exit_code != 0
    assert "r.json" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("fmt", ["json", "csv", "html", "table"])
def test_output_replaces_a_report_but_nothing_else_without_force(db: str, tmp_path: Path, fmt: str) -> None:
    """Run as root, `-o /etc/passwd` would rename a report over it: a file that holds no report
    is left alone unless --force, and a report of any format (the last run's) is replaced."""
    args = ["--db", db, "--since", SINCE, "--until", UNTIL, "--format", fmt]
    other = tmp_path / "auditor.toml"
    other.write_text("[store]\nurl = 'sqlite:///x.db'\n")
    code, _, err = invoke(*args, "-o", str(other))
    assert code == 2 and "holds no report" in err and "--force" in err
    assert other.read_text() == "[store]\nurl = 'sqlite:///x.db'\n"
    report = tmp_path / f"r.{fmt}"
    assert invoke(*args, "-o", str(report))[0] == 0
    for again in ("json", "csv", "html", "table"):  # any format over any format's report
        code, _, err = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", again, "-o", str(report))
        assert code == 0, err
    assert invoke(*args, "-o", str(other), "--force")[0] == 0
    assert other.read_text() != "[store]\nurl = 'sqlite:///x.db'\n"
    empty = tmp_path / "made-by-mktemp"
    empty.touch()
    assert invoke(*args, "-o", str(empty))[0] == 0 and empty.stat().st_size > 0
    older = tmp_path / "before-lag-at-least.csv"  # a CSV report written before lag_at_least_seconds
    older.write_text("request_id,trace_id,verdict,disconnect_at,disconnect_kind,work_end_at,lag_seconds,phase,"
                     "route,model,service,client,host,request_start_at,max_tokens,wasted_tokens,tokens_exact,"
                     "wasted_gpu_seconds,wasted_cpu_seconds\n")
    assert invoke(*args, "-o", str(older))[0] == 0
    older = tmp_path / "before-evidence.csv"  # and one written before evidence, unconfirmed_because
    older.write_text("request_id,trace_id,verdict,disconnect_at,disconnect_kind,work_end_at,lag_seconds,"
                     "lag_at_least_seconds,phase,route,model,service,client,host,request_start_at,max_tokens,"
                     "wasted_tokens,tokens_exact,wasted_gpu_seconds,wasted_cpu_seconds\n")
    assert invoke(*args, "-o", str(older))[0] == 0


def test_output_that_cannot_be_read_is_not_replaced_without_force(db: str, tmp_path: Path) -> None:
    """Whose file it is cannot be told without reading it: refused and left as it was. As root, the
    report runs without the capabilities that read any file (setpriv)."""
    import os
    import shutil
    import subprocess
    import sys

    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv, which drops the capability to read any file")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    private = tmp_path / "private.csv"
    private.write_text("someone else's\n")
    private.chmod(0o200)  # writable, not readable
    result = subprocess.run([*prefix, sys.executable, "-m", "auditor", "report", "--db", db, "--since", SINCE,
                             "--until", UNTIL, "--format", "csv", "-o", str(private)],
                            capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
    private.chmod(0o600)
    assert result.returncode == 2, result.stderr
    assert "is not readable" in result.stderr  # click's own check of -o, before the report's
    assert private.read_text() == "someone else's\n"


def test_output_to_a_device_writes_through_it(db: str) -> None:
    # Renaming a temporary file over /dev/null would replace the device for everyone.
    code, _, _ = invoke("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json",
                        "-o", "/dev/null")
    assert code == 0
    assert Path("/dev/null").is_char_device()


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("1h30m", 5400), ("1h 30m", 5400), (" 2d12h ", 216000), ("1.5h", 5400),
    ("1w2d3h4m5s", 788645), ("1m500ms", 60.5), ("30m", 1800)])
def test_durations_single_and_compound(text: str, seconds: float) -> None:
    duration = parse_duration(text)
    assert duration is not None and duration.total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1h30", "h30m", "1h-30m", "1.h", "1hour", "", "2026-11-22T10:00:00Z",
                                  "\u0661h", "1\u0660m", "\uff11h", "1.\u0665h"])
def test_not_durations(text: str) -> None:
    assert parse_duration(text) is None


def test_a_duration_in_other_digits_is_refused(db: str) -> None:
    """Only ASCII digits, as for --port: U+0661 (Arabic-Indic one) then h is not 1h."""
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", "\u0661h"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--since': '\u0661h' is neither a duration nor a time" in result.stderr, result.stderr


@pytest.mark.parametrize("bad", ["30m1h", "1h1h", "5s1m", "1m1ms1s"])
def test_compound_duration_out_of_order_is_refused_with_an_example(db: str, bad: str) -> None:
    with pytest.raises(ValueError, match="largest first"):
        parse_duration(bad)
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", bad])
    assert result.exit_code == 2
    assert "Invalid value for '--since'" in result.stderr and "e.g. 1h30m" in result.stderr


def test_compound_since_opens_the_window(db: str) -> None:
    code, out, _ = invoke("--db", db, "--since", "1h30m", "--format", "json")
    assert code == 0
    window = json.loads(out)["window"]
    assert window["seconds"] == pytest.approx(5400, abs=5)


def test_prices_come_from_the_flags_the_environment_or_the_config_file(db: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    window = ("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json")
    code, out, _ = invoke(*window)
    assert code == 0 and json.loads(out)["pricing"] is None
    config = tmp_path / "auditor.toml"
    config.write_text('[report]\ngpu_hour_price = 3.6\ncurrency = "EUR"\n')
    code, out, _ = invoke(*window, "--config", str(config))
    document = json.loads(out)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert document["pricing"] == {"gpu_hour": 3.6, "cpu_hour": None, "currency": "EUR",
                                   "gpu_hour_by_host": [], "cpu_hour_by_host": [], "unpriced": []}
    assert document["totals"]["wasted_cost"] == pytest.approx(document["totals"]["wasted_gpu_seconds"] / 1000)
    monkeypatch.setenv("AUDITOR_REPORT_GPU_HOUR_PRICE", "7.2")
    code, out, _ = invoke(*window, "--config", str(config))
    assert json.loads(out)["pricing"]["gpu_hour"] == 7.2  # the environment over the file
    code, out, _ = invoke(*window, "--config", str(config), "--gpu-hour-price", "1.8", "--currency", "$")
    assert json.loads(out)["pricing"] == {"gpu_hour": 1.8, "cpu_hour": None, "currency": "$",  # the flags over both
                                          "gpu_hour_by_host": [], "cpu_hour_by_host": [], "unpriced": []}
    code, out, _ = invoke(*window[:-2], "--gpu-hour-price", "1.8")
    assert code == 0 and "wasted cost" in out and "at 1.8 USD a GPU-hour" in out


def test_hosts_priced_apart_come_from_the_flags_the_environment_or_the_config_file(
        db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    window = ("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json")

    def priced(*extra: str, a: float, b: float) -> list[dict[str, object]]:
        """The report's host prices, having checked its cost is gpu-a's time at ``a``, gpu-b's at ``b``."""
        code, out, err = invoke(*window, *extra)
        assert code == 0, err
        document = json.loads(out)
        jsonschema.Draft202012Validator(SCHEMA).validate(document)
        hosts = {row["key"]: row["wasted_gpu_seconds"] for row in document["breakdowns"]["host"]}
        assert hosts["gpu-a"] and hosts["gpu-b"]
        assert document["totals"]["wasted_cost"] == pytest.approx((hosts["gpu-a"] * a + hosts["gpu-b"] * b) / 3600)
        patterns: list[dict[str, object]] = document["pricing"]["gpu_hour_by_host"]
        return patterns

    # The flags: a price for the hosts a pattern names, and one for the rest.
    assert priced("--gpu-hour-price", "gpu-b=9", "--gpu-hour-price", "2", a=2, b=9) == [
        {"hosts": "gpu-b", "price": 9.0}]
    config = tmp_path / "auditor.toml"
    config.write_text('[report]\ngpu_hour_price = 2\n[report.gpu_hour_prices]\n"gpu-?" = 5\n"gpu-b" = 1\n')
    assert priced("--config", str(config), a=5, b=5) == [  # the file's, the first match winning
        {"hosts": "gpu-?", "price": 5.0}, {"hosts": "gpu-b", "price": 1.0}]
    assert priced("--config", str(config), "--gpu-hour-price", "gpu-b=9", a=5, b=9)[0] == {  # the flag's first
        "hosts": "gpu-b", "price": 9.0}
    monkeypatch.setenv("AUDITOR_REPORT_GPU_HOUR_PRICES", "gpu-b=4,gpu-a=3")
    assert priced("--config", str(config), a=3, b=4) == [  # the environment over the file
        {"hosts": "gpu-b", "price": 4.0}, {"hosts": "gpu-a", "price": 3.0}]


@pytest.mark.parametrize(("args", "said"), [
    (["--gpu-hour-price", "nan"], "'--gpu-hour-price': 'nan': expected a price, or hosts and their price"),
    (["--gpu-hour-price", "gpu-*=x"], "'--gpu-hour-price': 'gpu-*=x': expected a price, or hosts and their price"),
    (["--gpu-hour-price", "=2"], "'--gpu-hour-price': '=2': expected a price, or hosts and their price"),
    (["--gpu-hour-price", "gpu-a=-2"], "--gpu-hour-price['gpu-a'] = -2.0: a price cannot be negative"),
    (["--gpu-hour-price", "1", "--gpu-hour-price", "2"], "'--gpu-hour-price': 2 prices for the hosts no pattern"),
    (["--gpu-hour-price", "-2"], "'--gpu-hour-price': -2.0: a price cannot be negative"),
    (["--cpu-hour-price", "1e9"], "'--cpu-hour-price': 1000000000.0: must be at most 100000"),
    (["--currency", "US dollars"], "'--currency': 'US dollars': expected a short unit without spaces"),
])
def test_a_bad_price_flag_is_a_usage_error_naming_the_flag(db: str, args: list[str], said: str) -> None:
    code, out, err = invoke("--db", db, *args)
    assert code == 2 and said in err and not out


def test_a_bad_price_in_the_config_file_names_its_key(db: str, tmp_path: Path) -> None:
    config = tmp_path / "auditor.toml"
    config.write_text("[report]\ngpu_hour_price = -1\n")
    code, out, err = invoke("--db", db, "--config", str(config))
    assert code == 1 and "report.gpu_hour_price = -1.0: a price cannot be negative" in err and not out


def test_one_callers_requests_by_its_user_agent_or_address(db: str) -> None:
    window = ("--db", db, "--since", SINCE, "--until", UNTIL, "--format", "json")
    code, out, _ = invoke(*window, "--user-agent", BROWSER)
    document = json.loads(out)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert document["window"]["filters"]["user_agent"] == BROWSER
    assert (document["totals"]["requests"], document["totals"]["disconnects"]) == (1, 1)
    assert [r["user_agent"] for r in document["requests"]] == [BROWSER]
    code, out, _ = invoke(*window[:-2], "--client", "10.9.9.9")
    assert code == 0 and "no requests matching client=10.9.9.9" in out
