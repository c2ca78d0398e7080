"""The command line: every listed command works, has help, and is documented; errors are one line."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from auditor.cli import COMMANDS, cli

DOCS = Path(__file__).parents[1] / "docs"


def test_root_help_lists_exactly_the_registered_commands() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    listed = {line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help_and_docs(name: str) -> None:
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    documented = (DOCS / "cli.md").read_text()
    assert f"auditor {name}" in documented, f"docs/cli.md does not document `auditor {name}`"


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and "auditor, version" in result.output


def test_corrupt_database_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "auditor.db"
    bad.write_bytes(b"\x00garbage" * 64)
    result = CliRunner().invoke(cli, ["db", "upgrade", "--db", f"sqlite:///{bad}"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "not a readable auditor database" in result.output
    assert bad.read_bytes() == b"\x00garbage" * 64


def test_config_typo_is_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "auditor.toml"
    config.write_text("[correlate]\ngrase_seconds = 1\n")
    result = CliRunner().invoke(cli, ["db", "upgrade", "--config", str(config), "--db", f"sqlite:///{tmp_path}/a.db"])
    assert result.exit_code == 1
    assert "Error: unknown configuration key 'correlate.grase_seconds'" in result.output
    assert not (tmp_path / "a.db").exists()


@pytest.mark.parametrize(("flag", "value", "key", "message"), [
    ("--grace", "nan", "correlate.grace_seconds", "nan: expected a finite number, e.g. 0.5"),
    ("--grace", "-1", "correlate.grace_seconds", "must be 0 or more"),
    ("--otlp-http", "foo", "otlp.http", "'foo': expected HOST:PORT, e.g. 127.0.0.1:4318"),
    ("--metrics", "127.0.0.1:99999", "metrics.listen", "'127.0.0.1:99999': expected HOST:PORT, e.g. 127.0.0.1:4318"),
])
def test_a_bad_run_flag_is_a_usage_error_naming_the_flag(tmp_path: Path, flag: str, value: str, key: str,
                                                         message: str) -> None:
    """docs/cli.md: a bad argument is a usage error (exit 2); the same value from the config file
    is a configuration error naming its key (exit 1)."""
    db = f"sqlite:///{tmp_path}/a.db"
    result = CliRunner().invoke(cli, ["run", "--db", db, flag, value])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Usage: ") and result.stderr.endswith(
        f"Error: Invalid value for '{flag}': {message}\n"), result.stderr
    section, _, name = key.partition(".")
    config = tmp_path / "auditor.toml"
    config.write_text(f"[{section}]\n{name} = {value if flag == '--grace' else repr(value)}\n")
    result = CliRunner().invoke(cli, ["run", "--db", db, "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {key}"), result.stderr
    assert not (tmp_path / "a.db").exists()


def test_db_upgrade_then_status(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    assert CliRunner().invoke(cli, ["db", "upgrade", "--db", url]).exit_code == 0
    result = CliRunner().invoke(cli, ["db", "status", "--db", url])
    assert result.exit_code == 0 and "up to date" in result.output


def test_db_status_of_a_store_newer_than_this_auditor_says_to_upgrade_the_auditor(tmp_path: Path) -> None:
    """Not "needs `auditor db upgrade`", which then refuses it: the auditor is the older one."""
    import sqlite3

    url = f"sqlite:///{tmp_path}/a.db"
    assert CliRunner().invoke(cli, ["db", "upgrade", "--db", url]).exit_code == 0
    with sqlite3.connect(tmp_path / "a.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    result = CliRunner().invoke(cli, ["db", "status", "--db", url])
    assert result.exit_code == 0 and "schema 9999" in result.output, result.output
    assert "newer than this auditor knows: upgrade the auditor" in result.output and "db upgrade" not in result.output


def test_replay_leaves_an_empty_file_untouched(tmp_path: Path) -> None:
    """An empty file is no capture: replay says so and writes nothing into it, where it used to
    migrate it (a whole schema in a file named e.jsonl)."""
    empty = tmp_path / "e.jsonl"
    empty.touch()
    result = CliRunner().invoke(cli, ["replay", str(empty), "--target", "http://127.0.0.1:1"])
    assert result.exit_code == 2 and f"{empty} is an empty file, not a capture" in result.output, result.output
    assert empty.stat().st_size == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["e.jsonl"]


def foreign_sqlite(path: Path) -> bytes:
    """Another application's SQLite file (one table, no auditor schema); its bytes."""
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE foo (x INTEGER)")
    conn.commit()
    conn.close()
    return path.read_bytes()


def test_db_status_refuses_another_applications_sqlite_file(tmp_path: Path) -> None:
    """Not "needs `auditor db upgrade`", which the upgrade then refuses: the file is not ours."""
    path = tmp_path / "other.db"
    before = foreign_sqlite(path)
    for args in (["db", "status"], ["db", "upgrade"]):
        result = CliRunner().invoke(cli, [*args, "--db", f"sqlite:///{path}"])
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Error: ") and "no auditor schema" in result.output, result.output
        assert "needs" not in result.output
    assert path.read_bytes() == before


def test_doctor_checks_a_database_not_created_yet_without_creating_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking leaves no empty ./auditor.db behind for a later report to read as an empty store."""
    from auditor.cli.doctor import OK, check_database
    from auditor.config import Config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setattr("auditor.store.db.SYSTEM_DB_DIR", tmp_path / "no-service")
    check = check_database(Config())
    assert check.state == OK and "not created yet (the daemon creates it at start)" in check.detail, check
    assert list(tmp_path.iterdir()) == []
    result = CliRunner().invoke(cli, ["report"])
    assert result.exit_code == 1 and "no database at auditor.db; run `auditor run` first" in result.output


def test_doctor_says_which_watched_ports_sent_no_spans(tmp_path: Path) -> None:
    """llama.cpp's server and TGI alone send no span naming a client: their ports give no verdicts,
    only orphaned work. The doctor says so from the store, per watched port, over the last hour."""
    import time

    from auditor.cli.doctor import DEGRADED, OK, check_spans
    from auditor.config import Config, ProbeConfig
    from auditor.model import SpanRecord, SpanRole
    from auditor.store import Store

    db = tmp_path / "a.db"
    config = Config(db=f"sqlite:///{db}", probe=ProbeConfig(ports=[8000, 8080]))
    assert check_spans(config).state == OK and not db.exists()  # nothing created
    store = Store(f"sqlite:///{db}")
    now = time.time_ns()
    store.insert_spans([SpanRecord(f"{i:032x}", "1" * 16, None, "POST /v1/completions", "server", now - 10**9,
                                   now, host=socket.gethostname(), role=SpanRole.HTTP_SERVER, peer_addr="127.0.0.1",
                                   peer_port=40000 + i, server_port=8000) for i in range(3)])
    # Another host's spans in a shared store say nothing of this one's ports.
    store.insert_spans([SpanRecord("f" * 32, "1" * 16, None, "POST /v1/completions", "server", now - 10**9, now,
                                   host="gpu-other", role=SpanRole.HTTP_SERVER, server_port=8080)])
    store.close()
    check = check_spans(config)
    assert check.state == DEGRADED, check
    assert "no server span in the last hour on port(s) 8080" in check.detail and "port 8000: 3 server spans" in check.detail
    assert "instrumented proxy" in check.fix
    assert check_spans(Config(db=f"sqlite:///{db}", probe=ProbeConfig(ports=[8000]))).state == OK
    assert check_spans(config, now_ns=now + 2 * 3600 * 10**9).detail.startswith(
        "no server span in the last hour on port(s) 8000, 8080")


def test_doctor_says_another_applications_sqlite_file_is_not_the_auditors(tmp_path: Path) -> None:
    from auditor.cli.doctor import FAILED, check_database
    from auditor.config import Config

    path = tmp_path / "other.db"
    before = foreign_sqlite(path)
    check = check_database(Config(db=f"sqlite:///{path}"))
    assert check.state == FAILED and "no auditor schema" in check.detail, check
    assert "another application's" in check.fix
    assert path.read_bytes() == before


def test_doctor_tells_a_database_it_cannot_write_by_writing_to_the_main_file(tmp_path: Path) -> None:
    """A temporary table goes to SQLite's temporary database: the doctor said "writable" of a
    file the daemon then failed every write to."""
    from auditor.cli.doctor import FAILED, OK, check_database
    from auditor.config import Config
    from auditor.store import Store

    path = tmp_path / "a.db"
    Store(f"sqlite:///{path}").close()
    check = check_database(Config(db=f"sqlite:///file:{path}?mode=ro&uri=true"))
    assert check.state == FAILED and "attempt to write a readonly database" in check.detail, check
    written = check_database(Config(db=f"sqlite:///{path}"))
    assert written.state == OK and "writable" in written.detail, written
    with sqlite3.connect(path) as conn:  # the write was rolled back
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'auditor_doctor_probe'").fetchall() == []


def test_doctor_and_run_refuse_a_sqlite_file_this_user_cannot_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 0444 file, or root's 0644 file for the auditor user: SQLite opens it read-only without a
    word, so the daemon ran, answered /healthz, and failed every round. (os.access stands in for
    the other user: root may write anything.)"""
    import os

    from auditor.cli.doctor import FAILED, check_database
    from auditor.config import Config
    from auditor.store import Store, unwritable_sqlite

    path = tmp_path / "a.db"
    Store(f"sqlite:///{path}").close()
    assert unwritable_sqlite(f"sqlite:///{path}") is None
    real_access = os.access
    monkeypatch.setattr("auditor.store.db.os.access",
                        lambda file, mode, **kw: Path(file) != path and real_access(file, mode, **kw))
    what, fix = unwritable_sqlite(f"sqlite:///{path}") or ("", "")
    assert what.startswith(f"{path} is not writable by user ") and "chmod u+w" in fix and "--db" in fix
    check = check_database(Config(db=f"sqlite:///{path}"))
    assert check.state == FAILED and f"{path} is not writable by user" in check.detail, check
    result = CliRunner().invoke(cli, ["run", "--db", f"sqlite:///{path}", "--port", "1", "--source", "procfs",
                                      "--otlp-http", "", "--otlp-grpc", "", "--metrics", "", "--live", ""])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {path} is not writable by user ") and "chown" in result.stderr
    monkeypatch.setattr("auditor.store.db.os.access",
                        lambda file, mode, **kw: Path(file) != tmp_path and real_access(file, mode, **kw))
    what, fix = unwritable_sqlite(f"sqlite:///{path}") or ("", "")
    assert what.startswith(f"{tmp_path}, the directory of {path}, is not writable") and "-wal" in what


def test_doctor_hides_a_postgresql_password(tmp_path: Path) -> None:
    from auditor.cli.doctor import _without_password

    url = "postgresql+psycopg://u:pw@127.0.0.1:1/db"
    for args in (["doctor"], ["doctor", "--json"]):
        result = CliRunner().invoke(cli, [*args, "--db", url])
        assert "u:***@127.0.0.1:1/db" in result.output and ":pw@" not in result.output, result.output
    assert _without_password(url) == "postgresql+psycopg://u:***@127.0.0.1:1/db"
    assert _without_password("sqlite:///file:/x.db?mode=ro&uri=true") == "sqlite:///file:/x.db?mode=ro&uri=true"


def test_doctor_json_schema(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--json", "--db", f"sqlite:///{tmp_path}/a.db"],
                                env={"AUDITOR_OTLP_HTTP": "127.0.0.1:0", "AUDITOR_OTLP_GRPC": "127.0.0.1:0",
                                     "AUDITOR_METRICS_LISTEN": "127.0.0.1:0", "AUDITOR_LIVE_LISTEN": "127.0.0.1:0"})
    doc = json.loads(result.output)
    assert doc["schema"] == "auditor.cli.doctor/v1"
    names = [c["name"] for c in doc["checks"]]
    assert names == ["privileges", "bpf_syscall", "tracefs", "prebuilt_probe", "kernel_headers", "bcc", "fallback",
                     "engines", "engine_metrics", "nvml", "ports", "database", "spans", "postgres_driver", "otlp_reader",
                     "prices", "source"]
    for check in doc["checks"]:
        assert check["state"] in ("ok", "degraded", "failed")
        assert check["state"] == "ok" or check["fix"] or check["name"] in ("nvml",)
    assert doc["can_run"] is True and result.exit_code == 0
    states = {c["name"]: c["state"] for c in doc["checks"]}
    if states["privileges"] == "ok":  # as root here: the probe loads without bcc
        assert states["prebuilt_probe"] == "ok" and doc["probe_loader"] == "prebuilt"
        assert doc["disconnect_source"] == "bpf"


def test_doctor_text_fits_an_80_column_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Details and fixes wrap under a hanging indent; a word longer than a line is cut, not left
    to overflow. Nothing is lost."""
    from auditor.cli.doctor import (
        DEGRADED,
        FAILED,
        Check,
        check_database,
        check_fallback,
        render_text,
    )
    from auditor.config import Config

    monkeypatch.setenv("COLUMNS", "80")
    checks = [check_fallback(poll_hz=20.0, walks=5), check_database(Config(db=f"sqlite:///{tmp_path}/{'x' * 90}.db")),
              Check("privileges", DEGRADED, "uid 1000 without CAP_BPF, CAP_PERFMON: eBPF probe unavailable",
                    "run as root, or under systemd with AmbientCapabilities=CAP_BPF CAP_PERFMON CAP_NET_ADMIN "
                    "CAP_SYS_RESOURCE CAP_DAC_READ_SEARCH"),
              Check("ports", FAILED, "in use: " + "; ".join(f"otlp.http 127.0.0.1:{port} (Address already in use, "
                                                             "held by pid 4242 (python -m http.server))"
                                                             for port in (4318, 4317)), "stop what holds them", required=True)]
    lines = render_text(checks, 1.0)
    assert all(len(line) <= 80 for line in lines), "\n".join(line for line in lines if len(line) > 80)
    assert lines[0].startswith("fallback    ok        a walk of the kernel's TCP table costs")
    assert lines[1].startswith(" " * 22) and not lines[1].startswith(" " * 23)
    words = " ".join(lines).split()
    assert "AmbientCapabilities=CAP_BPF" in words and "fix:" in words
    assert "".join(line.strip() for line in lines if "xxxx" in line).count("x") >= 90
    assert lines[-2].startswith("The daemon cannot run; disconnect source: ") and lines[-1].startswith("  ")


def test_doctor_names_the_disconnect_source_as_a_label() -> None:
    """JSON and /metrics say ``bpf`` or ``procfs``; the text line says what the fallback times by."""
    from auditor.cli.doctor import DEGRADED, OK, Check, disconnect_source, probe_loader, render_text

    fallback = [Check("privileges", DEGRADED, "uid 1000 without CAP_BPF", "run as root"),
                Check("bpf_syscall", OK, "bpf(2) answers", "")]
    probe = [Check("privileges", OK, "root", ""), Check("bpf_syscall", OK, "bpf(2) answers", ""),
             Check("prebuilt_probe", OK, "loads", "")]
    assert (disconnect_source(fallback), probe_loader(fallback)) == ("procfs", None)
    assert (disconnect_source(probe), probe_loader(probe)) == ("bpf", "prebuilt")
    assert "disconnect source: procfs (fallback: poll-interval timing)" in " ".join(render_text(fallback, 0.1, 200))
    assert "disconnect source: bpf, the prebuilt probe (" in " ".join(render_text(probe, 0.1, 200))


def test_doctor_as_a_user_tracefs_refuses_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """tracefs is root's alone (mode 0700): a user's doctor says so and how to run, not 'check
    itself failed' with no fix."""
    from auditor.cli import doctor

    locked = tmp_path / "tracing"

    def exists(path: Path) -> bool:
        if str(path).startswith(str(locked)):
            raise PermissionError(13, "Permission denied", str(path))
        return False

    monkeypatch.setattr(doctor, "TRACEFS_DIRS", (locked,))
    monkeypatch.setattr(Path, "exists", exists)
    check = doctor.check_tracefs()
    assert check.state == doctor.DEGRADED and "readable by root only" in check.detail, check
    assert check.fix.startswith("run as root, or under systemd with AmbientCapabilities=CAP_BPF"), check

    def refused() -> None:
        raise PermissionError(13, "Permission denied", "/sys/kernel/tracing/events")

    monkeypatch.setattr("probes.bpf.load_prebuilt", refused)
    check = doctor.check_prebuilt_probe()
    assert check.state == doctor.DEGRADED and "Permission denied: /sys/kernel/tracing/events" in check.detail
    assert check.fix == doctor.root_or_unit()


def test_doctor_says_what_this_hosts_time_is_priced_at() -> None:
    from auditor.cli.doctor import DEGRADED, OK, check_prices
    from auditor.config import apply_overrides, load_config

    def check(**overrides: object) -> tuple[str, str]:
        found = check_prices(apply_overrides(load_config(environ={}), {"host_id": "gpu-l4-1", **overrides}))
        return found.state, found.detail

    assert check() == (OK, "gpu-l4-1: unpriced (report.gpu_hour_price): reports show wasted seconds only")
    fleet = {"gpu-h100-*": 2.49, "gpu-l4-?": 0.8}
    assert check(**{"report.gpu_hour_prices": fleet}) == (OK, "gpu-l4-1: 0.8 USD a GPU-hour (pattern 'gpu-l4-?')")
    # A fleet priced by pattern that forgot this host, with no price for the rest: said, with the fix.
    state, detail = check(**{"report.gpu_hour_prices": {"gpu-h100-*": 2.49}})
    assert state == DEGRADED and "no pattern of report.gpu_hour_prices names this host ('gpu-h100-*')" in detail
    assert check(**{"report.gpu_hour_prices": {"gpu-h100-*": 2.49}, "report.gpu_hour_price": 1.2,
                    "report.cpu_hour_price": 0.05}) == (
        OK, "gpu-l4-1: 1.2 USD a GPU-hour (no pattern names it); 0.05 USD a CPU core-hour")


def test_doctor_says_which_otlp_reader_reads_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    from auditor.cli.doctor import DEGRADED, OK, check_otlp_reader
    from collectors import otlp_wire

    if "compiled" in otlp_wire.READERS:
        assert check_otlp_reader().state == OK
    monkeypatch.setattr(otlp_wire, "_read", otlp_wire.READERS["python"])
    check = check_otlp_reader()
    assert check.state == DEGRADED and "python3-dev" in check.fix
    assert check.detail.startswith("the Python reader")
    from collectors import normalize

    monkeypatch.setattr(normalize, "_build", normalize.BUILDERS["python"])
    assert check_otlp_reader().detail.startswith("the Python reader and record builder: ")
    monkeypatch.setattr(otlp_wire, "_read", otlp_wire.READERS.get("compiled", otlp_wire.READERS["python"]))
    if "compiled" in otlp_wire.READERS:
        assert check_otlp_reader().detail.startswith("the Python record builder: ")


def test_doctor_measures_what_the_proc_fallback_would_cost_here() -> None:
    """A real sock_diag walk on this host; the share of a core is the walk at the configured rate."""
    from auditor.cli.doctor import check_fallback

    check = check_fallback(poll_hz=10.0, walks=20)
    assert check.state == "ok", check
    found = re.search(r"costs (\d+) us of CPU here \((\d+) TCP sockets in use, (\d+) in TIME_WAIT\): "
                      r"([\d.]+)% of a core at the /proc fallback's 10 polls a second while connections arrive; "
                      r"the kernel's notices of freed sockets come", check.detail)
    assert found, check.detail
    walk_us, share = int(found[1]), float(found[4])
    assert walk_us > 0
    assert share == pytest.approx(walk_us * 10 / 1e4, abs=0.006)


def test_doctor_says_when_sock_diag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import probes.sockdiag
    from auditor.cli.doctor import check_fallback

    def refused() -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(probes.sockdiag, "SockDiag", refused)
    check = check_fallback(poll_hz=20.0)
    assert check.state == "degraded" and "sock_diag refused" in check.detail and "/proc/net/tcp" in check.detail
    assert "NETLINK_SOCK_DIAG" in check.fix


def test_doctor_says_when_the_kernels_notices_of_freed_sockets_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import probes.sockdiag
    from auditor.cli.doctor import check_fallback

    def refused() -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(probes.sockdiag, "DestroyNotices", refused)
    check = check_fallback(poll_hz=20.0, walks=5)
    assert check.state == "degraded" and "notices of freed sockets are refused" in check.detail
    assert "between two polls" in check.detail and "4.9" in check.fix


@pytest.mark.parametrize("text", ["", "TCP: inuse x tw 3\n", "TCP: inuse 1 tw\n", "UDP: inuse 4\n"])
def test_socket_counts_of_an_odd_sockstat_are_empty(tmp_path: Path, text: str) -> None:
    from probes.sockdiag import tcp_socket_counts

    (tmp_path / "sockstat").write_text(text)
    assert tcp_socket_counts(str(tmp_path / "sockstat")) == {}
    assert tcp_socket_counts(str(tmp_path / "missing")) == {}


def test_doctor_fails_when_a_port_is_taken(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(cli, ["doctor", "--json", "--db", f"sqlite:///{tmp_path}/a.db"],
                                    env={"AUDITOR_OTLP_HTTP": f"127.0.0.1:{port}", "AUDITOR_OTLP_GRPC": "",
                                         "AUDITOR_METRICS_LISTEN": "", "AUDITOR_LIVE_LISTEN": ""})
    doc = json.loads(result.output)
    ports = next(c for c in doc["checks"] if c["name"] == "ports")
    assert ports["state"] == "failed" and str(port) in ports["detail"] and ports["fix"]
    assert doc["can_run"] is False and result.exit_code == 1


@pytest.mark.privileged
def test_doctor_loads_a_real_bpf_program(tmp_path: Path) -> None:
    from auditor.cli.doctor import check_bcc

    check = check_bcc()
    assert check.state == "ok", check


def test_run_without_its_disconnect_source_refuses_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """probe.source = "bpf" where the probe cannot load: exit 1 naming why and what to do, not a
    daemon that runs judging nothing while systemd shows it active."""
    monkeypatch.setitem(sys.modules, "bcc", None)
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", tmp_path / "missing.json")
    result = CliRunner().invoke(cli, ["run", "--db", f"sqlite:///{tmp_path / 'a.db'}", "--port", "1", "--source", "bpf",
                                      "--otlp-http", "", "--otlp-grpc", "", "--metrics", "", "--live", ""])
    assert result.exit_code == 1, result.output
    assert "Error: no disconnect source (probe.source = 'bpf'): " in result.output
    assert "`auditor doctor` says what works on this host, or set probe.source = \"auto\"" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_run_and_doctor_refuse_sqlite_in_memory(tmp_path: Path) -> None:
    """The daemon's schema is made in a child process and its threads each open the database:
    in memory, each would see one of its own (no such table, then tracebacks at stop)."""
    from auditor.cli.doctor import check_database
    from auditor.config import Config

    result = CliRunner().invoke(cli, ["run", "--db", "sqlite://", "--port", "1", "--source", "procfs",
                                      "--otlp-http", "", "--otlp-grpc", "", "--metrics", "", "--live", ""])
    assert result.exit_code == 1 and "Error: --db 'sqlite://' is SQLite in memory" in result.output, result.output
    for url in ("sqlite://", "sqlite:///:memory:"):
        check = check_database(Config(db=url))
        assert (check.state, check.required) == ("failed", True) and "in memory" in check.detail, check
    relative = check_database(Config(db="sqlite:///no-such-dir-here/a.db"))
    assert relative.state == "failed" and str(Path.cwd() / "no-such-dir-here") in relative.detail, relative


def test_run_with_a_busy_address_says_so_in_one_line(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    address = f"127.0.0.1:{busy.getsockname()[1]}"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "auditor", "run", "--db", f"sqlite:///{tmp_path / 'a.db'}", "--port", "1",
             "--source", "procfs", "--otlp-http", address, "--otlp-grpc", "", "--metrics", "", "--live", ""],
            capture_output=True, text=True, timeout=60)
    finally:
        busy.close()
    assert result.returncode == 1, result.stderr
    assert f"Error: cannot listen on otlp.http {address}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_demo_on_cuda_without_a_gpu_says_so_before_starting_anything(tmp_path: Path) -> None:
    """`auditor demo --device cuda` where PyTorch or its GPU is missing: a usage error naming what
    is missing and the way out (--device cpu), and nothing started or written."""
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("PyTorch sees a CUDA GPU here: the demo would run")
    except ImportError:
        pass
    result = CliRunner().invoke(cli, ["demo", "--device", "cuda", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "--device cuda" in result.output and "use --device cpu" in result.output
    assert not (tmp_path / "out").exists()


def test_demo_refuses_a_directory_holding_a_store_without_force(tmp_path: Path) -> None:
    """`auditor demo -o /var/lib/auditor` deleted the service's database: now a usage error that
    names the files and the way out, and the files are left as they were."""
    (tmp_path / "auditor.db").write_bytes(b"the service's")
    (tmp_path / "auditor.db-wal").write_bytes(b"")
    result = CliRunner().invoke(cli, ["demo", "-o", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert (f"Error: Invalid value for -o/--output-dir: {tmp_path} holds auditor.db, auditor.db-wal, which the "
            "demo would delete") in result.stderr
    assert "--force to replace them" in result.stderr and "Traceback" not in result.output
    assert (tmp_path / "auditor.db").read_bytes() == b"the service's"


def test_demo_refuses_a_directory_it_cannot_make_or_write_in_one_line(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a PermissionError traceback from mkdir or from the store."""
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(cli, ["demo", "-o", str(tmp_path / "file" / "out")])
    assert result.exit_code == 2, result.output
    assert f"cannot use {tmp_path / 'file' / 'out'} (Not a directory); give a directory this user can write" \
        in result.stderr
    import auditor.cli.demo

    monkeypatch.setattr(auditor.cli.demo.os, "access", lambda path, mode: False)  # as a user, not root
    result = CliRunner().invoke(cli, ["demo", "-o", str(tmp_path / "ro")])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'ro'} is not writable by this user; give a directory this user can write" in result.stderr


def test_doctor_says_when_nvml_measures_no_utilization_of_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MIG-enabled GPU: NVML lists it but measures no utilization, so zombies on it cannot be
    costed in GPU time. The doctor says which GPU, and why."""
    import pynvml

    from auditor.cli.doctor import DEGRADED, check_nvml

    def unsupported(handle: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    for name, fake in {"nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 2,
                       "nvmlDeviceGetHandleByIndex": lambda index: index,
                       "nvmlDeviceGetName": lambda handle: "NVIDIA A100-SXM4-80GB",
                       "nvmlDeviceGetUtilizationRates": lambda handle: unsupported(handle) if handle == 1 else None,
                       "nvmlDeviceGetComputeRunningProcesses": lambda handle: [],
                       }.items():
        monkeypatch.setattr(pynvml, name, fake)
    check = check_nvml()
    assert check.state == DEGRADED, check
    assert "no utilization for GPU 1 (MIG mode?)" in check.detail and "GPU 0," not in check.detail


def test_doctor_says_which_gpu_keeps_no_sample_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler reads NVML's buffer of whole-GPU samples for the time it rested; a GPU whose
    NVML keeps none has the start of work begun at rest counted late. The doctor names it (an
    empty buffer is still one)."""
    import pynvml

    from auditor.cli.doctor import OK, check_nvml

    def samples(handle: int, kind: int, since: int) -> None:
        assert kind == pynvml.NVML_GPU_UTILIZATION_SAMPLES
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED if handle == 1 else pynvml.NVML_ERROR_NOT_FOUND)

    for name, fake in {"nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 2,
                       "nvmlDeviceGetHandleByIndex": lambda index: index,
                       "nvmlDeviceGetName": lambda handle: "NVIDIA H200",
                       "nvmlDeviceGetUtilizationRates": lambda handle: None,
                       "nvmlDeviceGetSamples": samples,
                       "nvmlDeviceGetComputeRunningProcesses": lambda handle: [],
                       }.items():
        monkeypatch.setattr(pynvml, name, fake)
    check = check_nvml()
    assert check.state == OK, check
    assert "no sample buffer for GPU 1:" in check.detail, check.detail


def test_doctor_names_the_gpu_processes_each_engines_cost_is_read_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host with two GPUs: the engine listening on a watched port (this test) started a
    process that NVML lists on GPU 1 (vLLM's model worker): the doctor names it. An engine with no
    process on any GPU is said to go uncosted before its zombies are."""
    import os
    import socket
    import subprocess
    from types import SimpleNamespace

    import pynvml

    from auditor.cli.doctor import DEGRADED, OK, check_nvml

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    worker = subprocess.Popen(["sleep", "30"])
    listed: dict[int, list[int]] = {1: [worker.pid]}
    for name, fake in {"nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 2,
                       "nvmlDeviceGetHandleByIndex": lambda index: index,
                       "nvmlDeviceGetName": lambda handle: "NVIDIA H200",
                       "nvmlDeviceGetUtilizationRates": lambda handle: None,
                       "nvmlDeviceGetComputeRunningProcesses":
                           lambda handle: [SimpleNamespace(pid=pid) for pid in listed.get(handle, [])],
                       }.items():
        monkeypatch.setattr(pynvml, name, fake)
    try:
        check = check_nvml([port])
        assert check.state == OK, check
        assert f"port {port}: pid {os.getpid()}, on the GPUs as {worker.pid} (GPU 1)" in check.detail
        listed.clear()
        check = check_nvml([port])
        assert check.state == DEGRADED and f"port {port}: pid {os.getpid()}, no process on a GPU" in check.detail
        assert check.fix and "not costed" in check.fix
    finally:
        worker.kill()
        worker.wait()
        listening.close()
