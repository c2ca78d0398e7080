"""`auditor run` as the systemd unit runs it: not root, only the unit's ambient capabilities.

The unit (systemd/auditor.service) runs as ``User=auditor`` with AmbientCapabilities; this runs the
daemon as uid 65534 with exactly those capabilities (setpriv) and requires the eBPF source, proven
both by /metrics and by a real peer reset on a watched port being counted. The engine is this
process (root): without CAP_SYS_PTRACE the daemon cannot read its descriptors, so it learns the
engine's pid from the probe, once the engine has closed a connection.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from probes.caps import UNIT_CAPABILITIES
from tests.e2e import free_port, wait_for

pytestmark = [pytest.mark.privileged, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")]
REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


def unit_capabilities() -> str:
    """The unit's AmbientCapabilities line, in setpriv's spelling (+bpf,+perfmon,...)."""
    line = re.search(r"^AmbientCapabilities=(.+)$", (REPO / "systemd" / "auditor.service").read_text(), re.M)
    assert line, "the unit grants no ambient capabilities"
    names = line.group(1).split()
    assert " ".join(names) == UNIT_CAPABILITIES
    return ",".join("+" + name.removeprefix("CAP_").lower() for name in names)


def metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def accept_from(server: socket.socket, client: socket.socket) -> socket.socket:
    """The server's end of ``client``'s connection; the daemon's own scrapes of the port, queued
    before it, are closed."""
    server.settimeout(20)
    while True:
        accepted, peer = server.accept()
        if peer == client.getsockname():
            return accepted
        accepted.close()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # pytest's tmp_path sits under a root-only directory; uid 65534 needs a path it can reach.
    path = Path(tempfile.mkdtemp(prefix="auditor-nobody-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_unit_capabilities_without_root_load_the_probe(state_dir: Path, bpf_run_stats: None) -> None:
    caps = unit_capabilities()
    metrics_port = free_port()
    with socket.create_server(("127.0.0.1", 0)) as server:
        watched = server.getsockname()[1]
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                   f"--inh-caps={caps}", f"--ambient-caps={caps}", "--",
                   sys.executable, "-m", "auditor", "run", "--db", f"sqlite:///{state_dir / 'auditor.db'}",
                   "--port", str(watched), "--otlp-http", "127.0.0.1:0", "--otlp-grpc", "", "--live", "",
                   "--metrics", f"127.0.0.1:{metrics_port}"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(state_dir)}
        log = state_dir / "daemon.log"
        with log.open("wb") as out:
            daemon = subprocess.Popen(command, cwd=state_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert wait_for(lambda: "auditor_disconnect_source_info" in metrics(metrics_port), timeout_s=60), \
                log.read_text()[-3000:]
            text = metrics(metrics_port)
            assert 'auditor_disconnect_source_info{source="bpf"} 1.0' in text, log.read_text()[-3000:]
            # Without bcc's compile: the program built with the project, loaded with bpf(2) alone.
            assert "eBPF probe loaded by the prebuilt loader" in log.read_text()
            assert 'auditor_probe_loader_info{loader="prebuilt"} 1.0' in text
            # Loaded is not enough: a reset on the watched port must reach the daemon.
            client = socket.create_connection(("127.0.0.1", watched))
            accepted, _ = server.accept()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            assert wait_for(lambda: 'auditor_disconnects_total{kind="rst"} 1.0' in metrics(metrics_port),
                            timeout_s=20), metrics(metrics_port)[-2000:]
            accepted.close()  # already reset: a close of the engine's, but no transition it makes
            # The probe's own cost in the kernel, read from descriptors a non-root daemon holds.
            own = metrics(metrics_port)
            assert "auditor_probe_run_stats_enabled 1.0" in own
            runs = {line.split("}")[0].split('"')[1]: float(line.rsplit(" ", 1)[1])
                    for line in own.splitlines() if line.startswith("auditor_probe_runs_total{")}
            assert runs.keys() == {"sock:inet_sock_set_state", "tcp:tcp_receive_reset",
                                   "tcp:tcp_rcv_space_adjust"} and min(runs.values()) >= 1, own
            assert float(own.split("auditor_probe_kernel_seconds_total{tracepoint=\"tcp:tcp_receive_reset\"} ")[1]
                         .split()[0]) > 0
            named = f"port {watched}: engine process {os.getpid()}, seen closing a connection by the eBPF probe"
            assert named not in log.read_text()
            client = socket.create_connection(("127.0.0.1", watched))
            accepted = accept_from(server, client)
            accepted.close()  # the engine closes first: the probe sees which process did
            client.close()
            assert wait_for(lambda: named in log.read_text(), timeout_s=20), log.read_text()[-3000:]
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
    output = log.read_text()
    assert "source=bpf" in output, output[-3000:]
    assert daemon.returncode == 0, output[-3000:]
