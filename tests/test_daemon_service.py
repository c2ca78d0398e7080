"""`auditor run` as systemd runs it: READY and WATCHDOG notifications, /metrics, SIGTERM, restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select

from auditor.store import CoverageRow, Store, VerdictRow
from replay.engine.launch import running_engine
from tests.e2e import cancel_after, free_port, wait_for

pytestmark = [pytest.mark.privileged, pytest.mark.slow]


def start_daemon(db: str, engine_port: int, otlp_port: int, metrics_port: int, notify: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "2000000"}
    return subprocess.Popen(
        [sys.executable, "-m", "auditor", "run", "--db", db, "--port", str(engine_port),
         "--otlp-http", f"127.0.0.1:{otlp_port}", "--otlp-grpc", "", "--live", "",
         "--metrics", f"127.0.0.1:{metrics_port}", "--grace", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def notifications(sock: socket.socket, timeout_s: float) -> list[str]:
    messages, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if any("WATCHDOG=1" in m for m in messages):
            break
    return messages


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def counts(store: Store) -> tuple[int, int]:
    with store.session() as session:
        verdicts = session.scalar(select(func.count()).select_from(VerdictRow)) or 0
        coverage = session.scalar(select(func.coalesce(func.sum(CoverageRow.count), 0))) or 0
    return int(verdicts), int(coverage)


def test_notify_metrics_sigterm_and_restart(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'auditor.db'}"
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    otlp_port, metrics_port = free_port(), free_port()
    with running_engine(behavior="detached", otlp=f"http://127.0.0.1:{otlp_port}", step_ms=10) as engine:
        daemon = start_daemon(db, engine.port, otlp_port, metrics_port, notify_path)
        try:
            messages = notifications(notify, timeout_s=30)
            assert any(m.startswith("READY=1") for m in messages), messages
            assert any("WATCHDOG=1" in m for m in messages), messages
            # A zombie: the detached engine generates 150 tokens after the client left.
            cancel_after(engine.port, 0.2, "fin", stream=True, max_tokens=150, request_id="svc-zombie").join()
            assert wait_for(lambda: 'auditor_disconnect_verdicts_total{model="ref-llm-1b",route="/v1/completions",'
                            'verdict="zombie"} 1.0' in scrape(metrics_port), timeout_s=30), scrape(metrics_port)
            text = scrape(metrics_port)
            assert "svc-zombie" not in text  # no request ids in labels
            for name in ("auditor_zombie_duration_seconds_bucket", "auditor_wasted_cpu_seconds_total",
                         "auditor_wasted_tokens_total", "auditor_inflight_zombies", "auditor_disconnects_total",
                         "auditor_idle_closes_total", "auditor_kernel_events_lost_total",
                         "auditor_clock_steps_total 0.0", "auditor_ingest_queue_spans",
                         "auditor_completed_requests_per_second",
                         'auditor_disconnect_source_info{source="bpf"} 1.0'):
                assert name in text, name
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=10) == 0
        finally:
            if daemon.poll() is None:
                daemon.kill()
            output = daemon.stdout.read().decode() if daemon.stdout else ""
        assert "Traceback" not in output, output
        store = Store(db)
        before = counts(store)
        assert before[0] == 1
        # A restart resumes from the saved position: nothing counted or judged twice.
        notify.setblocking(False)
        while True:  # forget the first run's notifications
            try:
                notify.recv(4096)
            except BlockingIOError:
                break
        daemon = start_daemon(db, engine.port, otlp_port, metrics_port, notify_path)
        try:
            messages = notifications(notify, timeout_s=30)
            assert any(m.startswith("READY=1") for m in messages), messages
            # A new zombie proves the restarted daemon judges; the first one is not judged again.
            cancel_after(engine.port, 0.2, "fin", stream=True, max_tokens=150, request_id="svc-zombie-2").join()
            assert wait_for(lambda: counts(store)[0] == before[0] + 1, timeout_s=30), counts(store)
            assert counts(store)[1] == before[1]
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=10)
    notify.close()
