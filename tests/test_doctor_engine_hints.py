"""`auditor doctor`'s engine_metrics check where an engine gives no gauges: what in its command line
keeps them off its /metrics, read from the process that listens on the port."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from auditor.cli.doctor import DEGRADED, check_engine_metrics, engine_flag_hint

# What vLLM's /metrics holds with its stats loggers off: the Python client's own series only.
SERVER = '''\
import http.server, sys
PAGE = (b"# TYPE python_gc_objects_collected_total counter\\n"
        b"python_gc_objects_collected_total{generation=\\"0\\"} 3.0\\n")
class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Page)
print(server.server_address[1], flush=True)
server.serve_forever()
'''


@pytest.mark.parametrize(("argv", "says"), [
    (["/usr/bin/vllm", "serve", "m", "--disable-log-stats"], "--disable-log-stats"),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--disable-log-stats"],
     "--disable-log-stats"),
    (["vllm", "serve", "m"], None),  # its gauges are on: the page's problem is elsewhere
    (["vllm", "serve", "m", "--api-server-count", "4"], "--api-server-count"),
    (["vllm", "serve", "m", "--api-server-count=2", "--data-parallel-size", "2"], "--api-server-count"),
    (["vllm", "serve", "m", "-asc", "2"], "--api-server-count"),
    (["vllm", "serve", "m", "--api-server-count", "1"], None),
    (["vllm", "serve", "m", "--api-server-count"], None),  # nothing readable: not said
    (["python3", "-m", "sglang.launch_server", "--model-path", "m"], "--enable-metrics"),
    (["python3", "-m", "sglang.launch_server", "--model-path", "m", "--enable-metrics"], None),
    (["/opt/llama.cpp/build/bin/llama-server", "-m", "m.gguf"], "--metrics"),
    (["llama-server", "-m", "m.gguf", "--metrics"], None),
    (["python3", "-m", "pytest", "-k", "sglang and vllm", "--disable-log-stats"], None),  # no engine
])
def test_the_hint_names_the_flag_that_keeps_the_gauges_off(argv: list[str], says: str | None) -> None:
    hint = engine_flag_hint(argv)
    assert (hint is None) if says is None else (hint is not None and says in hint), hint


@pytest.fixture
def vllm_without_stats(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A process started as ``vllm serve m --disable-log-stats`` (a script named vllm) serving the
    page vLLM serves so: (its pid, its port)."""
    program = tmp_path / "vllm"
    program.write_text(f"#!{sys.executable}\n{SERVER}")
    program.chmod(0o755)
    process = subprocess.Popen([str(program), "serve", "m", "--disable-log-stats"], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        yield process.pid, port
    finally:
        process.kill()
        process.wait(timeout=10)


def test_the_doctor_names_vllms_flag_that_keeps_its_gauges_off(vllm_without_stats: tuple[int, int]) -> None:
    """vLLM with --disable-log-stats serves /metrics without one vllm: series: the doctor says the
    page has no engine metric, and which process and flag are why."""
    pid, port = vllm_without_stats  # listening since it printed its port
    check = check_engine_metrics([port])
    assert check.state == DEGRADED, check
    assert check.detail.startswith(f"port {port}: /metrics has no engine metric this daemon knows"), check.detail
    assert f"pid {pid}: its command line has vLLM's --disable-log-stats" in check.detail, check.detail
    assert "--disable-log-stats" in check.fix
