"""Which database a command opens when none is named: on a systemd host, the unit's.

The unit's state directory is moved by patching ``auditor.store.db.SYSTEM_DB_DIR``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import auditor.store.db
from auditor.cli import cli
from auditor.store import Store, default_db_url

NOBODY = 65534


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A shell on the host: no --db, no AUDITOR_DB, not under systemd, in an unrelated directory.

    Yields the unit's state directory (not created yet). It sits in a fresh directory under /tmp
    that others may traverse, so the permission tests can look at it as another user.
    """
    root = Path(tempfile.mkdtemp(prefix="auditor-state-"))
    root.chmod(0o711)
    for name in ("STATE_DIRECTORY", "AUDITOR_DB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(auditor.store.db, "SYSTEM_DB_DIR", root / "auditor")
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    try:
        yield root / "auditor"
    finally:
        for path in sorted(root.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        root.rmdir()


def make_store(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Store(f"sqlite:///{path}").close()


def report(*args: str) -> Result:
    return CliRunner().invoke(cli, ["report", "--since", "1h", "--format", "json", *args])


def test_report_finds_the_units_database_and_says_so(host: Path) -> None:
    make_store(host / "auditor.db")
    result = report()
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"database: sqlite:///{host / 'auditor.db'}"
    assert json.loads(result.stdout)["schema"].startswith("auditor.report/")
    assert not Path("auditor.db").exists()  # nothing created in the working directory


def test_without_the_units_database_the_working_directory_is_used(host: Path) -> None:
    make_store(Path("auditor.db"))
    result = report()
    assert result.exit_code == 0, result.output
    assert "database: sqlite:///auditor.db" in result.stderr


def test_a_named_database_wins_and_is_not_announced(host: Path, tmp_path: Path) -> None:
    make_store(host / "auditor.db")
    named = tmp_path / "named.db"
    make_store(named)
    by_flag = report("--db", f"sqlite:///{named}")
    assert by_flag.exit_code == 0, by_flag.output
    assert "database:" not in by_flag.stderr
    config = tmp_path / "auditor.toml"
    config.write_text(f'db = "sqlite:///{tmp_path / "missing.db"}"\n')
    by_config = report("--config", str(config))
    assert by_config.exit_code == 1
    assert "missing.db" in by_config.output  # the config's database, not the unit's


def test_state_directory_wins_over_the_units_path(host: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    make_store(host / "auditor.db")
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    assert default_db_url(find_service_db=True) == f"sqlite:///{tmp_path / 'auditor.db'}"


def test_the_daemons_default_never_takes_the_units_database(host: Path) -> None:
    # `auditor run` by hand must not write into the running service's store.
    make_store(host / "auditor.db")
    assert default_db_url() == "sqlite:///auditor.db"
    assert default_db_url(find_service_db=True) == f"sqlite:///{host / 'auditor.db'}"


def test_db_status_finds_the_units_database(host: Path) -> None:
    make_store(host / "auditor.db")
    result = CliRunner().invoke(cli, ["db", "status"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"sqlite:///{host / 'auditor.db'}: schema ")


def as_unprivileged_user(args: list[str]) -> tuple[int, str]:
    """``auditor ARGS`` with the permissions of a user outside the auditor group: (exit code, output).

    As root, a forked child drops to nobody, so the kernel really refuses the reads."""
    if os.geteuid() != 0:
        result = CliRunner().invoke(cli, args)
        return result.exit_code, result.output
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 99
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = CliRunner().invoke(cli, args)
            os.write(writer, result.output.encode())
            code = result.exit_code
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        output = pipe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output


@pytest.mark.parametrize("layout", ["directory 0750", "file 0600"])
def test_an_unreadable_units_database_is_a_one_line_error(host: Path, layout: str) -> None:
    make_store(host / "auditor.db")
    if layout == "directory 0750":  # what StateDirectoryMode=0750 gives everyone outside the group
        host.chmod(0o750)
    else:
        host.chmod(0o755)
        (host / "auditor.db").chmod(0o600)
    code, output = as_unprivileged_user(["report", "--since", "1h"])
    assert code == 1, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith(f"Error: {host / 'auditor.db'} is the auditor service's database")
    assert "sudo" in lines[0] and "auditor group" in lines[0]


def test_a_group_readable_units_database_is_read_while_the_daemon_runs(host: Path) -> None:
    # With UMask=0027 the unit's files are 0640; SQLite then needs the daemon's -wal and -shm to be
    # there (it cannot create them in a directory it may not write).
    make_store(host / "auditor.db")
    daemon = Store(f"sqlite:///{host / 'auditor.db'}")
    try:
        with daemon.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            for path in host.iterdir():
                path.chmod(0o644)
            host.chmod(0o755)
            code, output = as_unprivileged_user(["report", "--since", "1h", "--format", "json"])
    finally:
        daemon.close()
    assert code == 0, output
    assert f"database: sqlite:///{host / 'auditor.db'}" in output


def test_db_upgrade_upgrades_the_units_database(host: Path) -> None:
    """After a package upgrade, `auditor db upgrade` on the host means the service's database; it
    used to migrate (and create) an auditor.db in whatever directory the shell was in."""
    make_store(host / "auditor.db")
    result = CliRunner().invoke(cli, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert f"sqlite:///{host / 'auditor.db'}: schema at" in result.stdout
    assert not Path("auditor.db").exists()


@pytest.mark.parametrize(("command", "finds_the_units"), [
    (["report"], True), (["capture", "export"], True), (["db", "status"], True), (["db", "upgrade"], True),
    (["run"], False), (["doctor"], False)])
def test_db_help_says_which_database_each_command_opens(command: list[str], finds_the_units: bool) -> None:
    text = " ".join(CliRunner().invoke(cli, [*command, "--help"]).output.split())
    assert ("/var/lib/auditor/auditor.db when it exists" in text) == finds_the_units, text
