"""What the running daemon imports: a process that runs for weeks on every GPU host never loads
what it does not use. SQLAlchemy (about 15 MiB with the asyncio it imports) serves the report,
capture and replay; the daemon on a SQLite file reads and writes through the sqlite3 driver
(auditor.store.sql), and Alembic only migrates, in a child.

grpcio (about 11 MiB and seven threads) is not imported even with the OTLP/gRPC listener on, as
the unit runs it: the receiver speaks HTTP/2 itself (collectors.http2; tests/test_http2.py checks
that it loads no HTTP/2 library but hpack).

Nor prometheus_client or the standard library's HTTP server and client: they load ``ssl`` and
``hashlib`` (OpenSSL's libcrypto) and the email package, 7 MiB of the idle daemon's RSS (40.5 ->
33.5, bench/footprint.py) for a daemon that never speaks TLS (auditor.http1 and auditor.promtext
serve its two HTTP endpoints).

Nor the OpenTelemetry SDK, which the live-notice sender (auditor.live) runs in servers, nor
``statistics`` (``fractions`` and ``decimal``): the two together were about 2 MiB of the idle
daemon's RSS (bench/footprint.py; docs/footprint.md, thirty-fourth pass).

Nor protobuf and the OTLP messages (about 4 MiB): the byte reader (collectors.otlp_wire) reads the
usual trace body whole, the scope, events and links included, and the answers are written out;
the message path imports them on the first body that needs it (JSON, metrics or logs, an unusual
shape: docs/footprint.md, forty-sixth pass).

The daemon runs in a fresh interpreter (the test process has imported everything): the /proc
source, the reference engine exporting its spans over OTLP/HTTP or OTLP/gRPC, one request
cancelled mid-decode and one completed, until the cancelled one has its verdict; then one
retention pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, socket, sys, time

transport = sys.argv[2]

from auditor.config import apply_overrides, load_config
from auditor.daemon import Daemon
from auditor.store.retention import RetentionPolicy, prune
from replay.engine.launch import running_engine

config = load_config(environ={})
apply_overrides(config, {
    "db": "sqlite:///" + sys.argv[1], "probe.ports": [1], "probe.source": "procfs", "probe.poll_hz": 20.0,
    "otlp.http": "127.0.0.1:0", "otlp.grpc": "127.0.0.1:0" if transport == "grpc" else "", "metrics.listen": "127.0.0.1:0", "live.listen": "127.0.0.1:0",
    "correlate.grace_seconds": 0.5, "correlate.interval_seconds": 0.2, "correlate.late_span_seconds": 3.0,
    "sampler.nvml": True,  # on a host without a GPU it reports itself degraded; its module loads all the same
})
daemon = Daemon(config)
daemon.start()


def request(port, request_id, max_tokens):
    body = json.dumps({"model": "ref-llm-1b", "prompt": "a b c", "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
                 + f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


verdicts = []
try:
    otlp = (f"grpc://127.0.0.1:{daemon.status.grpc_port}" if transport == "grpc"
            else f"http://127.0.0.1:{daemon.status.http_port}")
    with running_engine(behavior="detached", otlp=otlp,
                        step_ms=10, max_batch=2) as engine:
        daemon.set_ports({engine.port})
        done, answer = request(engine.port, "done", 3), b""
        done.settimeout(10)
        while b"[DONE]" not in answer:
            chunk = done.recv(65536)
            if not chunk:
                raise SystemExit("the engine closed without finishing: " + repr(answer[-200:]))
            answer += chunk
        cancelled = request(engine.port, "left", 400)  # 4 s of work: a starved poll cannot make it look aborted
        time.sleep(0.3)
        cancelled.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ("left", "zombie") not in verdicts:
            time.sleep(0.2)
            with daemon.store.connect() as conn:
                verdicts = [tuple(row) for row in conn.all("SELECT request_id, verdict FROM verdicts")]
        cancelled.close()
        done.close()
    prune(daemon.store, RetentionPolicy(), host=daemon.config.host_id)
    lister = "client_lister" in daemon._parts  # a walker of its own beside the /proc source's polls
finally:
    daemon.request_stop()
    daemon.stop()
unused = ("sqlalchemy", "asyncio", "alembic", "mako", "bcc", "grpc", "opentelemetry.sdk", "statistics", "fractions",
          "decimal", "prometheus_client", "http.server", "http.client", "ssl", "hashlib", "hmac", "email",
          "urllib.request", "wsgiref", "google", "opentelemetry.proto.collector", "opentelemetry.proto.trace",
          "opentelemetry.proto.common", "opentelemetry.proto.resource")
loaded = sorted(name for name in sys.modules if any(name == top or name.startswith(top + ".") for top in unused))
print(json.dumps({"verdicts": verdicts, "loaded": loaded, "lister": lister}))
"""


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_the_running_daemon_never_imports_what_it_does_not_use(transport: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "auditor.db"), transport], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The paths ran: spans in, a disconnect joined, a verdict written and read back.
    assert ["left", "zombie"] in result["verdicts"], (result, done.stderr[-3000:])
    assert result["loaded"] == [], "the daemon imported " + ", ".join(result["loaded"])
    assert result["lister"] is False  # the scraper's listings are the /proc source's polls
