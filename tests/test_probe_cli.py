"""`auditor probe`: bad input, --dump-bpf, and the live --json stream in a real subprocess."""

from __future__ import annotations

import json
import mmap
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from auditor.cli import cli
from auditor.config import Config
from probes import bpfsys
from probes.caps import UNIT_CAPABILITIES

# The --json line schema, as documented in docs/probe.md.
EVENT_LINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ts", "kind", "client_addr", "client_port", "server_addr", "server_port",
                 "family", "cookie"],
    "properties": {
        "ts": {"type": "string",
               "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$"},
        "kind": {"enum": ["peer_fin", "peer_rst", "local_fin", "closed"]},
        "client_addr": {"type": "string"},
        "client_port": {"type": "integer", "minimum": 0, "maximum": 65535},
        "server_addr": {"type": "string"},
        "server_port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "family": {"enum": [4, 6]},
        "cookie": {"type": ["integer", "null"], "minimum": 0},
    },
}
# Runs the real entry point; `block_bcc` makes `import bcc` fail the way it does without bcc.
ENTRY = "import sys\nfrom auditor.cli import main\nmain()\n"
ENTRY_WITHOUT_BCC = "import sys\nsys.modules['bcc'] = None\nfrom auditor.cli import main\nmain()\n"
# ... and without the prebuilt probe either: nothing loads the eBPF probe.
ENTRY_WITHOUT_EBPF = ("import sys, pathlib, probes.prebuilt as p\nsys.modules['bcc'] = None\n"
                      "p.PREBUILT_FILE = pathlib.Path('/nonexistent/disconnect.prebuilt.json')\n"
                      "from auditor.cli import main\nmain()\n")


@pytest.mark.parametrize(("value", "message"), [
    ("0", "0 is out of range"),
    ("65536", "65536 is out of range"),
    ("abc", "'abc' is not a port number"),
    ("", "'' is not a port number"),
    ("-5", "'-5' is not a port number"),
    ("\u00b2", "'\u00b2' is not a port number"),  # a digit to str.isdigit(), not to int()
])
def test_bad_ports_are_one_line_errors(value: str, message: str) -> None:
    result = CliRunner().invoke(cli, ["probe", "--port", value])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_dump_bpf_where_tracefs_is_refused_says_what_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user tracefs refuses (root's 0700 events directory): a one-line error naming the
    capabilities and the way out, not a PermissionError traceback."""
    import probes.bpf

    def refused(*_args: object, **_kwargs: object) -> bool:
        raise PermissionError(13, "Permission denied", "/sys/kernel/tracing/events")

    monkeypatch.setattr(probes.bpf, "tcp_records_lack_family", refused)
    monkeypatch.setattr("probes.caps.missing_bpf_capabilities", lambda: ["CAP_BPF", "CAP_PERFMON"])
    result = CliRunner().invoke(cli, ["probe", "--port", "28000", "--dump-bpf"])
    assert result.exit_code == 1, result.output
    assert result.stderr == ("Error: --dump-bpf reads this kernel's tracepoint formats from "
                             "/sys/kernel/tracing/events, which this user cannot read; eBPF needs CAP_BPF, "
                             "CAP_PERFMON (missing from the effective set): run as root, or grant "
                             f"AmbientCapabilities={UNIT_CAPABILITIES} (systemd/auditor.service does)\n")


def test_dump_bpf_prints_the_program_that_is_loaded(tmp_path: Path) -> None:
    config = tmp_path / "auditor.toml"
    config.write_text("[probe]\nring_buffer_mib = 8\n")
    result = CliRunner().invoke(cli, ["probe", "--dump-bpf", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"#define RINGBUF_PAGES {8 * 2**20 // mmap.PAGESIZE}\n")  # the configured size
    result = CliRunner().invoke(cli, ["probe", "--dump-bpf"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert text.startswith(f"#define RINGBUF_PAGES {Config().probe.ring_buffer_pages}\n#define WAKEUP_EVERY ")
    assert '#include "disconnect.h"' in text  # the shared header, included as bcc compiles it
    assert "struct event {" in (Path(__file__).parents[1] / "probes" / "disconnect.h").read_text()
    assert "TRACEPOINT_PROBE(sock, inet_sock_set_state)" in text
    assert "TRACEPOINT_PROBE(tcp, tcp_receive_reset)" in text
    assert "kprobe" not in text.lower().replace("no kprobes", "")


def test_help_lists_the_options() -> None:
    result = CliRunner().invoke(cli, ["probe", "--help"])
    assert result.exit_code == 0
    for option in ("--port", "--json", "--dump-bpf", "--source", "--db", "--config"):
        assert option in result.output


class Probe:
    """`auditor probe` as a child process, read line by line without blocking forever."""

    def __init__(self, *args: str, entry: str = ENTRY) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", entry, "probe", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.stdout_lines: list[str] = []

    def wait_stderr(self, text: str, timeout_s: float = 30) -> str:
        assert self.process.stderr is not None
        seen = ""
        deadline = time.monotonic() + timeout_s
        while text not in seen and time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            seen += line
        assert text in seen, seen
        return seen

    def read_json_until(self, done: Any, timeout_s: float = 10) -> list[dict[str, Any]]:
        # Raw reads from the pipe: a buffered readline() would hide lines from select().
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        selector = selectors.DefaultSelector()
        selector.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        records: list[dict[str, Any]] = []
        pending = b""
        while not done(records) and time.monotonic() < deadline:
            if not selector.select(timeout=0.1):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.stdout_lines.append(line.decode() + "\n")
                records.append(json.loads(line))
        return records

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Signal the child; returns its exit code and stderr. Unread stdout lands in stdout_lines."""
        self.process.send_signal(sig)
        stdout, stderr = self.process.communicate(timeout=10)
        self.stdout_lines += stdout.splitlines(keepends=True)
        return self.process.returncode, stderr


@pytest.fixture
def server() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def one_connection(server: socket.socket, hold_s: float = 0.01) -> int:
    """Client closes first; the server follows ``hold_s`` later."""
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client_port = int(client.getsockname()[1])
    time.sleep(hold_s)
    client.close()
    time.sleep(hold_s)
    accepted.close()
    return client_port


def run_stream(server: socket.socket, source: str, sig: int) -> None:
    port = server.getsockname()[1]
    child = Probe("--port", str(port), "--json", "--source", source)
    try:
        child.wait_stderr(f"with {source}")
        client_port = one_connection(server, hold_s=0.01)  # shorter than a poll: procfs sees it by its notice
        records = child.read_json_until(
            lambda rs: any(r["kind"] == "closed" and r["client_port"] == client_port for r in rs))
    finally:
        code, stderr = child.stop(sig)
    mine = [r for r in records if r["client_port"] == client_port]
    assert [r["kind"] for r in mine] == ["peer_fin", "closed"], child.stdout_lines
    for record in records:
        jsonschema.validate(record, EVENT_LINE_SCHEMA)
    assert mine[0]["server_port"] == port and mine[0]["family"] == 4
    assert code == 0, stderr
    assert "0 lost" in stderr  # the ring buffer's, or the notices of freed sockets the kernel dropped
    if source == "bpf" and bpfsys.stats_enabled() is False:
        assert "in the kernel" not in stderr  # not counted, so not told
    assert "Traceback" not in stderr


@pytest.mark.privileged
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_json_stream_from_the_kernel_stops_cleanly(server: socket.socket, sig: int) -> None:
    run_stream(server, "bpf", sig)


@pytest.mark.privileged
def test_the_kernel_time_of_the_probe_is_told_at_stop_where_counted(server: socket.socket,
                                                                    bpf_run_stats: None) -> None:
    port = server.getsockname()[1]
    child = Probe("--port", str(port), "--json", "--source", "bpf")
    try:
        child.wait_stderr("with bpf")
        client_port = one_connection(server)
        child.read_json_until(lambda rs: any(r["kind"] == "closed" and r["client_port"] == client_port for r in rs))
    finally:
        code, stderr = child.stop()
    assert code == 0, stderr
    told = re.search(r"; in the kernel: ([\d,]+) program runs, ([\d.,]+) ms, ([\d,]+) ns a run$", stderr.strip())
    assert told, stderr
    assert int(told.group(1).replace(",", "")) >= 5  # the one connection's server end alone changed state 5 times


def test_json_stream_from_the_fallback(server: socket.socket) -> None:
    run_stream(server, "procfs", signal.SIGTERM)


def test_without_bcc_the_probe_runs_prebuilt(server: socket.socket) -> None:
    port = str(server.getsockname()[1])
    child = Probe("--port", port, "--source", "bpf", entry=ENTRY_WITHOUT_BCC)
    try:
        if os.geteuid() == 0:
            child.wait_stderr("with bpf")
    finally:
        code, stderr = child.stop()
    assert code == (0 if os.geteuid() == 0 else 1), stderr


def test_missing_bcc_is_an_error_for_bpf_and_a_fallback_for_auto(server: socket.socket) -> None:
    port = str(server.getsockname()[1])
    forced = subprocess.run([sys.executable, "-c", ENTRY_WITHOUT_EBPF, "probe", "--port", port,
                             "--source", "bpf"], capture_output=True, text=True, timeout=60)
    assert forced.returncode == 1
    expected = ("bcc is not importable: run `make setup` as root" if os.geteuid() == 0
                else "eBPF needs root")
    assert forced.stderr.strip().splitlines()[-1].startswith(f"Error: {expected}"), forced.stderr
    assert "Traceback" not in forced.stderr

    child = Probe("--port", port, "--source", "auto", entry=ENTRY_WITHOUT_EBPF)
    try:
        seen = child.wait_stderr("with procfs")
    finally:
        code, _ = child.stop()
    assert "timing precision" in seen and "FIN vs RST" in seen
    assert code == 0


def test_table_output_fits_a_terminal(server: socket.socket) -> None:
    port = server.getsockname()[1]
    child = Probe("--port", str(port), "--source", "procfs")
    try:
        child.wait_stderr("with procfs")
        client_port = one_connection(server, hold_s=0.15)
        time.sleep(0.3)
    finally:
        code, stderr = child.stop()
    assert code == 0, stderr
    lines = [line.rstrip("\n") for line in child.stdout_lines]
    assert lines[0].split() == ["TIME", "(UTC)", "KIND", "CLIENT", "SERVER"]
    rows = [line.split() for line in lines[1:]]
    assert [row[1] for row in rows if row[2] == f"127.0.0.1:{client_port}"] == ["peer_fin", "closed"]
    assert all(row[3] == f"127.0.0.1:{port}" for row in rows)
    assert all(len(line) <= 80 for line in lines)
    assert all(len(row[0]) == len("20:35:46.123456") for row in rows)


def test_docs_describe_exactly_the_emitted_fields() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "probe.md").read_text()
    section = docs.split("## `--json` output", 1)[1].split("\n## ", 1)[0]
    documented = {line.split("|")[1].strip().strip("`") for line in section.splitlines()
                  if line.startswith("| `")}
    assert documented == set(EVENT_LINE_SCHEMA["properties"])
