"""`auditor doctor` as an operator meets it: the unit's own user, root with a narrowed capability
set, probe.source set by hand. What it predicts must be what `auditor run` then does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.cli.doctor import DEGRADED, OK, Check, check_source, disconnect_source, probe_loader
from tests.e2e import running_daemon
from tests.test_daemon_unprivileged import NOBODY, REPO, unit_capabilities

SETPRIV = pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
LOADS = [Check("privileges", OK, ""), Check("bpf_syscall", OK, ""), Check("prebuilt_probe", OK, "")]
REFUSED = [Check("privileges", DEGRADED, ""), Check("bpf_syscall", DEGRADED, ""),
           Check("prebuilt_probe", DEGRADED, "")]


def test_probe_source_bpf_where_the_probe_cannot_load_is_a_daemon_that_cannot_run() -> None:
    """`auditor run` with probe.source = bpf exits 1 where eBPF cannot load; the doctor said
    'can run' and exited 0."""
    check = check_source("bpf", REFUSED)
    assert check.state == "failed" and check.required and "probe.source = auto" in check.fix
    assert check_source("bpf", LOADS).state == OK
    assert check_source("auto", REFUSED).state == OK


def test_probe_source_procfs_is_the_source_the_doctor_names() -> None:
    checks = [*LOADS, check_source("procfs", LOADS)]
    assert (disconnect_source(checks), probe_loader(checks)) == ("procfs", None)
    assert "the eBPF probe would load here" in checks[-1].detail
    auto = [*LOADS, check_source("auto", LOADS)]
    assert (disconnect_source(auto), probe_loader(auto)) == ("bpf", "prebuilt")


def doctor(*prefix: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, object]:
    result = subprocess.run([*prefix, sys.executable, "-m", "auditor", "doctor", "--json"],
                            capture_output=True, text=True, timeout=120, cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    document: dict[str, object] = json.loads(result.stdout)
    document["exit_code"] = result.returncode
    return document


def states(document: dict[str, object]) -> dict[str, tuple[str, str]]:
    return {c["name"]: (c["state"], c["detail"]) for c in document["checks"]}  # type: ignore[attr-defined]


@pytest.mark.privileged
@SETPRIV
def test_root_with_only_bpf_and_perfmon_loads_the_probe(tmp_path: Path) -> None:
    """tracefs is root's own: root needs no DAC capability to read it. Root whose shell dropped all
    but CAP_BPF and CAP_PERFMON was sent to the fallback and told to run as root."""
    env = {"AUDITOR_DB": f"sqlite:///{tmp_path / 'a.db'}", "AUDITOR_OTLP_HTTP": "127.0.0.1:0",
           "AUDITOR_OTLP_GRPC": "127.0.0.1:0", "AUDITOR_METRICS_LISTEN": "127.0.0.1:0",
           "AUDITOR_LIVE_LISTEN": "127.0.0.1:0"}
    document = doctor("setpriv", "--inh-caps=-all", "--bounding-set=-all,+bpf,+perfmon", "--", env=env)
    found = states(document)
    assert found["privileges"][0] == OK, found["privileges"]
    assert "CAP_BPF, CAP_PERFMON effective" in found["privileges"][1]
    assert found["prebuilt_probe"][0] == OK, found["prebuilt_probe"]  # it really loaded and attached
    assert document["disconnect_source"] == "bpf" and document["exit_code"] == 0


@pytest.mark.privileged
@SETPRIV
def test_the_services_ports_asked_from_its_own_user_are_no_conflict(tmp_path: Path) -> None:
    """The running daemon is another user's (here root's): its /proc/<pid>/fd cannot be read
    without CAP_SYS_PTRACE, so its listeners were 'in use' by an unknown holder, the doctor said
    'cannot run' and told the operator to stop what holds them: the service itself."""
    with running_daemon(tmp_path, **{"probe.source": "procfs", "otlp.grpc": ""}) as daemon:
        env = {"AUDITOR_DB": "sqlite:////tmp/auditor-doctor-none.db",
               "AUDITOR_OTLP_HTTP": f"127.0.0.1:{daemon.status.http_port}", "AUDITOR_OTLP_GRPC": "",
               "AUDITOR_METRICS_LISTEN": f"127.0.0.1:{daemon.status.metrics_port}",
               "AUDITOR_LIVE_LISTEN": f"127.0.0.1:{daemon.status.live_port}", "HOME": "/tmp"}
        caps = unit_capabilities()
        document = doctor("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          f"--inh-caps={caps}", f"--ambient-caps={caps}", "--", env=env, cwd=Path("/tmp"))
    state, detail = states(document)["ports"]
    assert state == OK, detail
    assert "held by the running auditor (it answers on metrics.listen" in detail
    assert document["exit_code"] == 0

    # A program that is not an auditor on a configured address is still a conflict.
    import socket

    with socket.create_server(("127.0.0.1", 0)) as other:
        env["AUDITOR_OTLP_HTTP"] = f"127.0.0.1:{other.getsockname()[1]}"
        env["AUDITOR_METRICS_LISTEN"] = "127.0.0.1:0"
        env["AUDITOR_LIVE_LISTEN"] = "127.0.0.1:0"
        document = doctor("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          f"--inh-caps={caps}", f"--ambient-caps={caps}", "--", env=env, cwd=Path("/tmp"))
    assert states(document)["ports"][0] == "failed" and document["exit_code"] == 1
