"""Three hosts, one PostgreSQL: the fleet set-up, end to end.

Three daemons with distinct ``host_id``s (``Daemon`` objects in this process, each with its own
eBPF probe on its engine's port) write into one real PostgreSQL server. Each has its own reference
engine exporting real OTLP spans to it and real clients on loopback that complete or cancel
requests; each also takes a bounded burst of spans from the real SDK exporter. Each engine runs in
its own UTS namespace with the host name of its daemon, as on separate machines: its spans carry
``host.name``, which the receiver prefers to the daemon's own name. Checked: every span
stored once under its own host, one verdict per cancelled request per host (none lost, none
counted twice or under another host), and ``auditor report --host`` and the per-host breakdown
read across them. The figures are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text

from auditor.cli import cli
from auditor.daemon import Daemon
from auditor.store import Store
from tests.e2e import cancel_after, complete, running_daemon, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.privileged]
ROOT = Path(__file__).resolve().parents[1]

# host -> engine behaviour: two hosts leak work after a disconnect, one aborts correctly.
HOSTS = {"gpu-a": "detached", "gpu-b": "abort", "gpu-c": "detached"}
COMPLETED_PER_HOST = 8
CANCELLED_PER_HOST = 4
LOAD_BATCHES, LOAD_SPANS_PER_BATCH = 30, 50  # per host, sent over OTLP/HTTP by the SDK exporter




@contextmanager
def engine_on_host(host: str, behavior: str, otlp: str, scratch: Path) -> Iterator[int]:
    """The reference engine in a UTS namespace named ``host``; yields its port once it serves."""
    port_file = scratch / f"{host}.port"
    command = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host,
               sys.executable, "-m", "replay.engine", "--port", "0", "--port-file", str(port_file),
               "--behavior", behavior, "--step-ms", "10", "--max-batch", "16", "--otlp", otlp]
    with (scratch / f"{host}.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert wait_for(lambda: process.poll() is not None or serving(port_file), timeout_s=30)
        assert process.poll() is None, (scratch / f"{host}.log").read_text()[-2000:]
        yield int(port_file.read_text())
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serving(port_file: Path) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", int(port_file.read_text()), timeout=2)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, ValueError):
        return False


def drive(port: int, host: str) -> None:
    """Completed requests and mid-decode cancellations (FIN after 0.25 s of a 1.5 s generation)."""
    threads = [complete(port, stream=True, max_tokens=8, request_id=f"{host}-ok{i}")
               for i in range(COMPLETED_PER_HOST)]
    threads += [cancel_after(port, 0.25, "fin", stream=True, max_tokens=150,
                             request_id=f"{host}-cancel{i}") for i in range(CANCELLED_PER_HOST)]
    for thread in threads:
        thread.join(30)


def load_batches(host: str) -> list[list[Any]]:
    """Pre-built batches of internal spans (no verdicts, no requests) tagged with their host."""
    batches = []
    for batch in range(LOAD_BATCHES):
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": f"load-{host}"}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracer = provider.get_tracer("load")
        for i in range(LOAD_SPANS_PER_BATCH):
            with tracer.start_as_current_span(f"load-{batch}-{i}"):
                pass
        batches.append(list(memory.get_finished_spans()))
    return batches


def send_load(port: int, batches: list[list[Any]], failures: list[str]) -> None:
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=30)
    for batch in batches:
        if exporter.export(batch) is not SpanExportResult.SUCCESS:
            failures.append(f"port {port}: an export failed")
    exporter.shutdown()


def scalar(store: Store, sql: str, **params: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


def server_spans(store: Store) -> dict[str, int]:
    return {host: scalar(store, "SELECT count(*) FROM spans WHERE host = :h AND role = 'http_server'", h=host)
            for host in HOSTS}


def span_summary(store: Store) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(text("SELECT host, role, service, count(*) FROM spans "
                                      "WHERE service NOT LIKE 'load-%' GROUP BY host, role, service")))


def dump(store: Store) -> str:
    """What each host holds, for a failure message."""
    with store.engine.connect() as conn:
        verdicts = conn.execute(text("SELECT host, server_port, request_id, verdict, details FROM verdicts "
                                     "ORDER BY host, request_id")).all()  # details: which rule decided
    events = collections.Counter((e.host, e.server_port, e.kind.value) for e in store.conn_events())
    return f"events {sorted(events.items())}\nverdicts {verdicts}"


def settled_cancels(store: Store) -> dict[str, int]:
    """host -> its cancelled requests with a settled verdict (neither in flight nor provisional)."""
    counts = dict.fromkeys(HOSTS, 0)
    with store.engine.connect() as conn:
        for host, request_id, verdict, details in conn.execute(text(
                "SELECT host, request_id, verdict, details FROM verdicts")):
            if request_id.startswith(f"{host}-cancel") and verdict != "inflight_zombie" \
                    and not (details or {}).get("provisional"):
                counts[host] = counts.get(host, 0) + 1
    return counts


def verdicts_by_host(store: Store) -> dict[str, dict[str, str]]:
    """host -> request id -> verdict."""
    found: dict[str, dict[str, str]] = {host: {} for host in HOSTS}
    with store.engine.connect() as conn:
        for host, request_id, verdict in conn.execute(text("SELECT host, request_id, verdict FROM verdicts")):
            found.setdefault(host, {})[request_id] = verdict
    return found


def test_three_hosts_share_one_postgres(pg_url: str, tmp_path: Path) -> None:
    store = Store(pg_url)  # migrate once, as an operator would, before the fleet starts
    batches = {host: load_batches(host) for host in HOSTS}
    with ExitStack() as stack:
        daemons: dict[str, Daemon] = {}
        engines: dict[str, int] = {}
        for host, behavior in HOSTS.items():
            daemon = stack.enter_context(running_daemon(
                tmp_path / host, db=pg_url, host_id=host, **{"probe.source": "bpf",
                                                            "correlate.late_span_seconds": 5.0}))
            port = stack.enter_context(engine_on_host(
                host, behavior, f"http://127.0.0.1:{daemon.status.http_port}", tmp_path))
            daemon.set_ports({port})
            daemons[host], engines[host] = daemon, port

        # Requests on all three hosts at once.
        started = time.monotonic()
        drivers = [threading.Thread(target=drive, args=(engines[h], h)) for h in HOSTS]
        for thread in drivers:
            thread.start()
        for thread in drivers:
            thread.join(60)
        requests_s = time.monotonic() - started

        # A bounded burst of spans into all three receivers at once.
        failures: list[str] = []
        started = time.monotonic()
        senders = [threading.Thread(target=send_load, args=(daemons[h].status.http_port, batches[h], failures))
                   for h in HOSTS]
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join(120)
        load_s = time.monotonic() - started
        assert failures == []

        expected_requests = COMPLETED_PER_HOST + CANCELLED_PER_HOST
        assert wait_for(lambda: all(n >= expected_requests for n in server_spans(store).values()),
                        timeout_s=30), (server_spans(store), span_summary(store))
        # Every cancel judged for good: an in-flight alarm's row, or a provisional one, comes first.
        ok = wait_for(lambda: all(n >= CANCELLED_PER_HOST for n in settled_cancels(store).values()), timeout_s=30)
        assert ok, dump(store)
        time.sleep(2.0)  # more correlation rounds on every daemon: nothing may be added twice
        verdicts = verdicts_by_host(store)

    sent = LOAD_BATCHES * LOAD_SPANS_PER_BATCH
    for host in HOSTS:
        # Spans: every one stored once, under the host whose receiver took it.
        assert scalar(store, "SELECT count(*) FROM spans WHERE service = :s", s=f"load-{host}") == sent
        assert scalar(store, "SELECT count(*) FROM spans WHERE service = :s AND host = :h",
                      s=f"load-{host}", h=host) == sent
        assert scalar(store, "SELECT count(*) FROM spans WHERE host = :h AND role = 'http_server'",
                      h=host) == expected_requests
    total_spans = len(HOSTS) * sent
    print(f"\nfleet: {len(HOSTS)} daemons -> one PostgreSQL; {len(HOSTS) * expected_requests} requests "
          f"({len(HOSTS) * CANCELLED_PER_HOST} cancelled) in {requests_s:.1f} s; {total_spans} load spans "
          f"in {load_s:.2f} s = {total_spans / load_s:,.0f} spans/s ({LOAD_BATCHES * len(HOSTS)} exports "
          f"of {LOAD_SPANS_PER_BATCH}, 3 senders), none lost, none duplicated; verdict rows per judging "
          f"host {({h: len(v) for h, v in verdicts.items()})}")

    for host, behavior in HOSTS.items():
        # Verdicts: one per cancelled request of this host; a completed request whose client closed
        # right after the last byte may have a `completed` one; nothing of another host.
        cancelled = {f"{host}-cancel{i}" for i in range(CANCELLED_PER_HOST)}
        wanted = "zombie" if behavior == "detached" else "aborted"
        assert {r: v for r, v in verdicts[host].items() if r in cancelled} == dict.fromkeys(cancelled, wanted), \
            dump(store)
        others = {r: v for r, v in verdicts[host].items() if r not in cancelled}
        assert all(r.startswith(f"{host}-ok") and v == "completed" for r, v in others.items()), dump(store)
    assert set(verdicts) == set(HOSTS)

    # The report, per host and across hosts.
    for host, behavior in HOSTS.items():
        result = CliRunner().invoke(cli, ["report", "--db", pg_url, "--since", "10m", "--host", host,
                                          "--format", "json"])
        assert result.exit_code == 0, result.output
        totals = json.loads(result.stdout)["totals"]
        assert totals["disconnects"] == len(verdicts[host]) and totals["requests"] == expected_requests
        assert totals["zombies"] == (CANCELLED_PER_HOST if behavior == "detached" else 0)
    result = CliRunner().invoke(cli, ["report", "--db", pg_url, "--since", "10m", "--format", "json"])
    document = json.loads(result.stdout)
    by_host = {row["key"]: (row["disconnects"], row["zombies"]) for row in document["breakdowns"]["host"]}
    assert {host: zombies for host, (_, zombies) in by_host.items()} == {"gpu-a": 4, "gpu-b": 0, "gpu-c": 4}
    assert sum(disconnects for disconnects, _ in by_host.values()) == sum(len(v) for v in verdicts.values())
    assert document["totals"]["requests"] == len(HOSTS) * expected_requests
    store.close()
