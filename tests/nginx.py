"""A throwaway nginx in front of the reference engine, the deployment most users run, and clients
that talk to it: for the tests and bench/behind_nginx.py.

Behind nginx the engine never sees a client. nginx notices a client leaving within milliseconds and
closes its own upstream connection with a FIN, even when the client reset; a cancelled request's
upstream connection never returns to the pool. The engine's truth log therefore names nginx's
upstream ports, and a pooled upstream port carries many requests: a verdict is matched to the truth
record on its port that arrived nearest its start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from auditor.store import VerdictRow
from replay.engine.launch import running_engine
from tests.e2e import (
    disconnect,
    free_port,
    leavers_settled,
    read_response,
    running_daemon,
    send_request,
    verdict_rows,
    wait_for,
)

# The configs users copy for an OpenAI-compatible server, as the upstream block and location lines.
VARIANTS = {
    # SSE passed through as it is read, upstream connections pooled
    "keepalive": ("keepalive 16;", "proxy_buffering off;"),
    # the same without upstream keepalive: one upstream connection per request, closed at its end
    "nokeep": ("", "proxy_buffering off;"),
    # upstream keepalive, nginx's default proxy_buffering on
    "buffered": ("keepalive 16;", ""),
    # as "keepalive", with a read timeout (60 s by default) short enough to cut answers: nginx
    # answers 504 and closes the upstream connection 1 s after the engine last sent a byte
    "read_timeout": ("keepalive 16;", "proxy_buffering off; proxy_read_timeout 1s;"),
}

_CONFIG = """\
daemon off;
master_process on;
worker_processes 1;
pid {base}/nginx.pid;
error_log {base}/error.log info;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {base}/body;
    proxy_temp_path {base}/proxy;
    fastcgi_temp_path {base}/fastcgi;
    uwsgi_temp_path {base}/uwsgi;
    scgi_temp_path {base}/scgi;
    access_log off;
    upstream engine {{
        server 127.0.0.1:{upstream_port};
        {keepalive}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            {buffering}
        }}
    }}
}}
"""


def find_nginx() -> Path | None:
    """nginx on PATH, in sbin, or the binary `make setup` takes from Debian's package into the venv."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found:
        return Path(found)
    beside = Path(os.environ.get("VIRTUAL_ENV", Path(__file__).resolve().parents[1] / ".venv")) / "bin" / "nginx"
    return beside if beside.exists() else None


@contextmanager
def nginx_proxy(base: Path, variant: str, upstream_port: int) -> Iterator[int]:
    """nginx proxying 127.0.0.1:<port it yields> to the engine, its files under ``base``."""
    binary = find_nginx()
    if binary is None:
        raise RuntimeError("nginx not found; run `make setup` as root (it takes the binary from Debian's package)")
    keepalive, buffering = VARIANTS[variant]
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = base / "nginx.conf"
    config.write_text(_CONFIG.format(base=base, upstream_port=upstream_port, port=port, keepalive=keepalive,
                                     buffering=buffering))
    # -e: the error log before the config is read (the default path may not be writable)
    with (base / "nginx.out").open("wb") as out:
        process = subprocess.Popen([str(binary), "-p", str(base), "-c", str(config), "-e", str(base / "error.log")],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = (base / "error.log").read_text(errors="replace")[-2000:] if (base / "error.log").exists() else ""
                    raise RuntimeError(f"nginx did not start listening on {port}: {log}") from None
                time.sleep(0.05)
        yield port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGQUIT)  # graceful: open requests finish, then it exits
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


# -- clients -------------------------------------------------------------------------------------
@dataclass
class Action:
    """One client request through nginx, started ``start_s`` into the plan. ``leave`` None: read the
    whole answer and close; ``"fin"``/``"rst"``: leave ``after_s`` after the request was written, with
    a FIN (what has arrived drained first) or a reset."""

    start_s: float
    max_tokens: int
    stream: bool = True
    leave: str | None = None
    after_s: float = 0.0
    user_agent: str | None = None
    error: str = field(default="", init=False)

    def run(self, port: int) -> None:
        try:
            sock = send_request(port, stream=self.stream, max_tokens=self.max_tokens, request_id=None,
                                user_agent=self.user_agent)
            if self.leave is None:
                read_response(sock)
                sock.close()
                return
            sock.settimeout(0.02)
            end = time.monotonic() + self.after_s
            while time.monotonic() < end:
                try:
                    if not sock.recv(65536):
                        break
                except TimeoutError:
                    continue
            if self.leave == "rst":
                disconnect(sock, "rst")
                return
            sock.setblocking(False)  # drain: a close with unread data would send a reset
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass
            sock.close()
        except OSError as exc:
            self.error = repr(exc)


def plan() -> list[Action]:
    """About 3 s of traffic on one engine: 15 requests that complete (streamed and not, some side by
    side with a leaver) and 8 whose clients leave, FIN and reset, early and late in the answer."""
    A = Action
    return [A(0.0, 20), A(0.0, 21), A(0.0, 22, stream=False), A(0.0, 150, leave="fin", after_s=0.4),
            A(0.02, 151, leave="rst", after_s=0.5), A(0.03, 23),
            A(0.6, 152, leave="fin", after_s=0.01), A(0.6, 153, leave="rst", after_s=0.01), A(0.6, 24), A(0.62, 25),
            A(0.9, 154, leave="fin", after_s=0.015), A(0.9, 155, leave="rst", after_s=0.005),
            A(1.2, 26), A(1.2, 27), A(1.2, 156, leave="fin", after_s=0.3), A(1.22, 157, leave="rst", after_s=0.3),
            A(1.25, 28, stream=False),
            A(2.0, 29), A(2.0, 30), A(2.02, 31, stream=False), A(2.05, 32),
            A(2.6, 40), A(2.6, 41)]


def run_plan(port: int, actions: Sequence[Action]) -> None:
    """Each action in its own thread at its time; returns when all have ended."""
    start = time.monotonic()

    def go(action: Action) -> None:
        time.sleep(max(0.0, start + action.start_s - time.monotonic()))
        action.run(port)

    threads = [threading.Thread(target=go, args=(action,), daemon=True) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


# -- one run -------------------------------------------------------------------------------------
SETTINGS = {"probe.poll_hz": 20, "correlate.late_span_seconds": 10.0, "engine_metrics.interval_seconds": 0.1}


def run_behind_nginx(tmp: Path, variant: str, source: str, behavior: str, *, engine_span: str = "none",
                     metrics_names: str = "vllm", engine_flags: Sequence[str] = (), span_delay_ms: int | None = None,
                     timeout_s: float = 60.0, actions: list[Action] | None = None
                     ) -> tuple[list[VerdictRow], list[dict[str, Any]], list[Action]]:
    """The daemon watching the engine's port, nginx in front, ``actions`` (default ``plan()``) sent to
    nginx: once every verdict has settled, the verdicts, the engine's truth records and the actions
    (their errors). The daemon's store stays in ``tmp`` (``auditor.db``).
    ``span_delay_ms``: how long the engine's spans wait to be exported (the OpenTelemetry SDK's
    default, which vLLM keeps, is 5000; the reference engine's 200)."""
    env = None if span_delay_ms is None else {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": str(span_delay_ms)}
    with running_daemon(tmp, **{"probe.source": source, **SETTINGS}) as daemon, \
            running_engine(behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                           truth_log=tmp / "truth.jsonl", step_ms=10, max_batch=16,
                           extra_args=["--engine-span", engine_span, "--metrics-names", metrics_names, *engine_flags],
                           env=env) as engine:
        daemon.set_ports({engine.port})
        with nginx_proxy(tmp / "nginx", variant, engine.port) as port:
            actions = plan() if actions is None else actions
            run_plan(port, actions)
        # nginx has stopped: every upstream connection is closed and every request ended or running.

        # Settled: the truth log has stopped growing for 2 s (a detached engine runs on its
        # leavers, 1.5 s at most here), every leaver has a verdict and none is provisional.
        seen = {"count": -1, "since": time.monotonic()}

        def settled() -> bool:
            truths = engine.truth()
            if len(truths) != seen["count"]:
                seen["count"], seen["since"] = len(truths), time.monotonic()
            return time.monotonic() - seen["since"] >= 2.0 and leavers_settled(verdict_rows(daemon), truths)

        wait_for(settled, timeout_s=timeout_s, interval_s=0.25)
        time.sleep(1.0)  # anything that would still change them
        return verdict_rows(daemon), engine.truth(), actions
