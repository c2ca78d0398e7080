"""Listener addresses end to end: ``auditor run`` on a busy address says so in one line, and
``auditor doctor`` tells a foreign holder (cannot run) from the running auditor daemon (fine)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from auditor.cli import cli
from auditor.cli.doctor import is_auditor_daemon
from auditor.errors import ConfigError
from auditor.service import listening

OFF = {"otlp.http": "", "otlp.grpc": "", "metrics.listen": "", "live.listen": ""}
RUN_FLAGS = {"otlp.http": "--otlp-http", "otlp.grpc": "--otlp-grpc", "metrics.listen": "--metrics",
             "live.listen": "--live"}
ENV = {"otlp.http": "AUDITOR_OTLP_HTTP", "otlp.grpc": "AUDITOR_OTLP_GRPC", "metrics.listen": "AUDITOR_METRICS_LISTEN",
       "live.listen": "AUDITOR_LIVE_LISTEN"}


def run_args(db: Path, addresses: dict[str, str]) -> list[str]:
    args = [sys.executable, "-m", "auditor", "run", "--db", f"sqlite:///{db}", "--port", "1", "--source", "procfs"]
    for key, address in {**OFF, **addresses}.items():
        args += [RUN_FLAGS[key], address]
    return args


def held(kind: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.bind(("127.0.0.1", 0))
    if kind == socket.SOCK_STREAM:
        sock.listen()
    return sock


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("key", ["otlp.http", "metrics.listen", "live.listen"])
def test_run_on_a_busy_address_exits_with_one_error_line(tmp_path: Path, key: str) -> None:
    kind = socket.SOCK_DGRAM if key == "live.listen" else socket.SOCK_STREAM
    with held(kind) as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        result = subprocess.run(run_args(tmp_path / "a.db", {key: address}), capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: cannot listen on {key} {address}: Address already in use; find what holds it "
                      f"with `ss -ltnup 'sport = :{address.rsplit(':', 1)[1]}'`, or set {key} to another "
                      "address ('' turns it off)"], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(("error", "address", "reason", "advice"), [
    (OSError(errno.EACCES, "Permission denied"), "127.0.0.1:80", "Permission denied",
     "ports below 1024 need root or CAP_NET_BIND_SERVICE; set otlp.http to a port of 1024 or more ('' turns it off), "
     "or grant the capability"),
    (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), "192.0.2.7:4318",
     "Cannot assign requested address",
     "set otlp.http to an address of this host, e.g. 127.0.0.1 or 0.0.0.0 ('' turns it off)"),
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "999.1.1.1:4318", "Name or service not known",
     "set otlp.http to an address of this host, e.g. 127.0.0.1 or 0.0.0.0 ('' turns it off)"),
    (OSError(errno.EACCES, "Permission denied"), "127.0.0.1:4318", "Permission denied",
     "set otlp.http to another address ('' turns it off)"),
])
def test_a_listener_that_cannot_bind_gets_advice_for_its_reason(error: OSError, address: str, reason: str,
                                                                  advice: str) -> None:
    with pytest.raises(ConfigError) as raised, listening("otlp.http", address):
        raise error
    assert str(raised.value) == f"cannot listen on otlp.http {address}: {reason}; {advice}"


def test_grpc_on_an_address_not_on_this_host_says_so_once(tmp_path: Path) -> None:
    result = subprocess.run(run_args(tmp_path / "a.db", {"otlp.grpc": "192.0.2.7:4317"}), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: cannot listen on otlp.grpc 192.0.2.7:4317: Cannot assign requested address; set "
                      "otlp.grpc to an address of this host, e.g. 127.0.0.1 or 0.0.0.0 ('' turns it off)"], errors


def doctor_ports(tmp_path: Path, addresses: dict[str, str]) -> tuple[dict, int]:
    env = {ENV[key]: address for key, address in {**OFF, **addresses}.items()}
    result = CliRunner().invoke(cli, ["doctor", "--json", "--db", f"sqlite:///{tmp_path}/doctor.db"], env=env)
    doc = json.loads(result.output)
    return next(c for c in doc["checks"] if c["name"] == "ports"), result.exit_code


def test_doctor_names_a_foreign_holder_of_live_listen(tmp_path: Path) -> None:
    with held(socket.SOCK_DGRAM) as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        ports, exit_code = doctor_ports(tmp_path, {"live.listen": address})
    assert ports["state"] == "failed" and exit_code == 1, ports
    assert f"live.listen {address} (Address already in use" in ports["detail"], ports
    assert f"held by pid {os.getpid()}" in ports["detail"] and ports["fix"], ports


def test_doctor_accepts_the_ports_the_running_auditor_holds(tmp_path: Path) -> None:
    addresses = {"otlp.http": f"127.0.0.1:{free_port(socket.SOCK_STREAM)}",
                 "metrics.listen": f"127.0.0.1:{free_port(socket.SOCK_STREAM)}",
                 "live.listen": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"}
    daemon = subprocess.Popen(run_args(tmp_path / "daemon.db", addresses), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while "auditor running" not in (line := daemon.stderr.readline() if daemon.stderr else ""):
            assert line and time.monotonic() < deadline, "the daemon did not start"
        assert " otlp-grpc=off " in line, line  # a receiver turned off says so, not None
        ports, exit_code = doctor_ports(tmp_path, addresses)
        with held(socket.SOCK_STREAM) as foreign:  # the daemon's ports beside a foreign one
            other = f"127.0.0.1:{foreign.getsockname()[1]}"
            mixed, mixed_exit = doctor_ports(tmp_path, {**addresses, "otlp.grpc": other})
    finally:
        daemon.terminate()
        daemon.communicate(timeout=30)
    assert ports["state"] == "ok" and exit_code == 0, ports
    assert ports["detail"] == f"{', '.join(addresses.values())} held by the running auditor (pid {daemon.pid})"
    assert mixed["state"] == "failed" and mixed_exit == 1, mixed
    assert mixed["detail"].startswith(f"in use: otlp.grpc {other}") and "metrics.listen" not in mixed["detail"]


@pytest.mark.parametrize(("argv", "daemon"), [
    (["/usr/bin/python3", "-m", "auditor", "run", "--port", "8000"], True),
    (["/opt/auditor/.venv/bin/auditor", "run"], True),
    (["auditor", "doctor"], False),
    (["nginx: master process"], False),
    (["python3", "auditor.py", "run"], False),
])
def test_auditor_daemon_is_told_by_its_command_line(argv: list[str], daemon: bool) -> None:
    assert is_auditor_daemon(argv) is daemon
