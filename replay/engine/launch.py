"""Start a reference engine (or gateway) in a subprocess, wait until it serves, stop it cleanly.

Used by the demo, the daemon's tests and replay::

    with running_engine(behavior="detached", truth_log=path) as engine:
        httpx.post(engine.url + "/v1/completions", json={...})
        records = engine.truth()

The process gets ``--port-file`` so port 0 works; on exit it receives SIGTERM, which lets uvicorn
finish, the engine stop and the span processor flush before the process ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from auditor.errors import AuditorError
from replay.engine.truth import read_truth

_PROJECT_ROOT = Path(__file__).resolve().parents[2]


class EngineLaunchError(AuditorError):
    """The engine subprocess did not come up."""


@dataclasses.dataclass
class EngineProcess:
    url: str
    port: int
    pid: int
    truth_log: Path | None
    process: subprocess.Popen[bytes]
    log_path: Path

    def truth(self) -> list[dict[str, Any]]:
        """The ground-truth records written so far (empty without a truth log)."""
        if self.truth_log is None or not self.truth_log.exists():
            return []
        return read_truth(self.truth_log)

    def wait_for_truth(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Wait until at least ``count`` records exist (requests end asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.truth()
            if len(records) >= count or time.monotonic() > deadline:
                return records
            time.sleep(0.02)

    def truth_of(self, request_id: str, timeout: float = 15.0) -> dict[str, Any]:
        """The truth record of one request, waiting for it to end; AssertionError with the log if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.truth():
                if record["request_id"] == request_id:
                    return record
            time.sleep(0.02)
        raise AssertionError(f"no truth record for {request_id}; log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


def _wait_until_serving(process: subprocess.Popen[bytes], port_file: Path, log_path: Path, host: str,
                        timeout: float) -> int:
    deadline = time.monotonic() + timeout
    port: int | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EngineLaunchError(f"the engine exited with code {process.returncode} before serving:\n{tail}")
        if port is None and port_file.exists():
            with contextlib.suppress(ValueError):
                port = int(port_file.read_text().strip())
        if port is not None and _healthy(host, port):
            return port
        time.sleep(0.05)
    raise EngineLaunchError(f"the engine did not serve /health within {timeout:.0f} s; "
                            f"log:\n{log_path.read_text(errors='replace')[-2000:]}")


def _healthy(host: str, port: int) -> bool:
    """``GET /health`` answered 200. On a socket rather than an HTTP client: the daemon's import
    test runs an engine beside a daemon and must see only what the daemon imports."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(f"GET /health HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
            return sock.makefile("rb").readline().split(b" ")[1:2] == [b"200"]
    except OSError:
        return False


@contextlib.contextmanager
def running_engine(port: int = 0, behavior: str = "abort", otlp: str | None = None,
                   truth_log: str | os.PathLike[str] | None = None, step_ms: float = 10.0, max_batch: int = 8,
                   extra_args: Sequence[str] = (), host: str = "127.0.0.1", startup_timeout: float = 30.0,
                   env: dict[str, str] | None = None, netns: str | None = None) -> Iterator[EngineProcess]:
    """Run ``python -m replay.engine`` with these settings for the duration of the ``with`` block;
    in the named network namespace (``ip netns``) where ``netns`` is given, as a container's
    engine runs (``ip`` execs it: the pid is the engine's)."""
    with tempfile.TemporaryDirectory(prefix="ref-engine-") as scratch:
        port_file = Path(scratch) / "port"
        log_path = Path(scratch) / "engine.log"
        command = [sys.executable, "-m", "replay.engine", "--host", host, "--port", str(port),
                   "--port-file", str(port_file), "--behavior", behavior, "--step-ms", str(step_ms),
                   "--max-batch", str(max_batch), "--exit-with-parent", str(os.getpid())]
        if otlp is not None:
            command += ["--otlp", otlp]
        if truth_log is not None:
            command += ["--truth-log", str(truth_log)]
        command += list(extra_args)
        if netns is not None:
            command = ["ip", "netns", "exec", netns, *command]
        child_env = dict(os.environ if env is None else env)
        # Importable even where the project is not installed (a checkout run in place).
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), child_env.get("PYTHONPATH")]))
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=child_env)
        try:
            bound = _wait_until_serving(process, port_file, log_path, host, startup_timeout)
            yield EngineProcess(url=f"http://{host}:{bound}", port=bound, pid=process.pid,
                                truth_log=Path(truth_log) if truth_log is not None else None,
                                process=process, log_path=log_path)
        finally:
            _stop(process)


def _stop(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running_gateway(upstream: str, propagate: bool = True, otlp: str | None = None,
                    **kwargs: Any) -> Iterator[EngineProcess]:
    """A gateway in front of ``upstream`` (same handle as :func:`running_engine`)."""
    extra = ["--gateway", upstream, "--propagate", "yes" if propagate else "no", *kwargs.pop("extra_args", ())]
    with running_engine(otlp=otlp, extra_args=extra, **kwargs) as gateway:
        yield gateway
