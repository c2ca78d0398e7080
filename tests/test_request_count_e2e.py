"""``requests`` counts each client request once (real eBPF, real OTLP export, real engine, truth log).

Two server spans for one request: a second ASGI instrumentation nested in the first (the engine's
``--duplicate-server-span`` profile, as FastAPI's own telemetry over a hand-added middleware), or a
gateway in front of the engine on the same host, with trace context forwarded or not. The report's
``requests`` must equal the requests the engine's truth log saw, and the verdicts the truth's."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select

from auditor.daemon import Daemon
from auditor.model import SpanRole
from auditor.report.model import ReportQuery
from auditor.report.query import build_report
from auditor.store.schema import SpanRow
from replay.engine.launch import running_engine, running_gateway
from tests.e2e import (
    cancel_after,
    complete,
    expected_verdict,
    running_daemon,
    verdict_rows,
    wait_for,
)
from tests.test_daemon_e2e import DRIVEN_REQUESTS, daemon_overrides, drive, mismatches

pytestmark = [pytest.mark.privileged, pytest.mark.slow]


def report_requests(daemon: Daemon, since_ns: int) -> int:
    report = build_report(daemon.store, ReportQuery(since_ns=since_ns, until_ns=time.time_ns() + 10**9),
                          with_requests=False)
    return report.totals.requests


def server_spans(daemon: Daemon) -> int:
    with daemon.store.session() as session:
        return int(session.scalar(select(func.count()).select_from(SpanRow).where(
            SpanRow.role == SpanRole.HTTP_SERVER.value)) or 0)


def test_a_duplicate_server_span_counts_once_and_changes_no_verdict(tmp_path: Path) -> None:
    since = time.time_ns()
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **daemon_overrides("bpf", **{"correlate.late_span_seconds": 30.0})) as daemon, \
            running_engine(behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                           truth_log=truth_log, step_ms=10, max_batch=2,
                           extra_args=["--trace-aborted", "--duplicate-server-span"]) as engine:
        daemon.set_ports({engine.port})
        drive(engine.port, "dup")
        assert wait_for(lambda: len(engine.truth()) >= DRIVEN_REQUESTS, timeout_s=20)
        truths = [t for t in engine.truth() if t.get("disconnect_at")]
        assert wait_for(lambda: len(verdict_rows(daemon)) >= len(truths), timeout_s=15)
        everything = engine.truth()
        assert wait_for(lambda: server_spans(daemon) >= 2 * len(everything), timeout_s=10)
        time.sleep(1.0)
        rows = verdict_rows(daemon)
        assert server_spans(daemon) == 2 * len(everything)  # the profile does double every request
        assert report_requests(daemon, since) == len(everything)
    problems = mismatches(rows, truths, "bpf", set())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("trace_context", ["yes", "no"])
def test_gateway_and_engine_count_each_request_once(tmp_path: Path, trace_context: str) -> None:
    since = time.time_ns()
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"correlate.late_span_seconds": 30.0}) as daemon:
        otlp = f"http://127.0.0.1:{daemon.status.http_port}"
        with running_engine(behavior="abort", otlp=otlp, truth_log=truth_log, step_ms=10) as engine, \
                running_gateway(engine.url, propagate=True, otlp=otlp,
                                extra_args=["--trace-context", trace_context]) as gateway:
            daemon.set_ports({engine.port, gateway.port})
            for i in range(3):
                complete(gateway.port, stream=i % 2 == 0, max_tokens=6, request_id=f"gw-done{i}").join()
            for kind in ("fin", "rst"):
                cancel_after(gateway.port, 0.3, kind, stream=True, max_tokens=150, request_id=f"gw-{kind}").join()
                time.sleep(0.2)
            assert wait_for(lambda: len(engine.truth()) >= 5, timeout_s=20)
            everything = engine.truth()
            assert wait_for(lambda: server_spans(daemon) >= 2 * len(everything), timeout_s=10)
            assert wait_for(lambda: {"gw-fin", "gw-rst"} <= {r.request_id for r in verdict_rows(daemon)},
                            timeout_s=20)
            if trace_context == "yes":  # the engine's span joins the gateway's trace: judged by it then
                wait_for(lambda: all(r.details.get("engine_span") for r in verdict_rows(daemon)
                                     if r.request_id in ("gw-fin", "gw-rst")), timeout_s=10)
            time.sleep(1.0)
            rows = verdict_rows(daemon)
            assert report_requests(daemon, since) == len(everything) == 5
    truths = {t["request_id"].removeprefix("cmpl-"): t for t in everything}
    for request_id in ("gw-fin", "gw-rst"):
        want = expected_verdict(truths[request_id])
        judged = {r.server_port: r.verdict for r in rows if r.request_id == request_id}
        if trace_context == "yes":  # one request, one verdict, at the edge
            assert judged == {gateway.port: want}, [(r.verdict, r.server_port, r.details) for r in rows]
        else:
            # Two traces: the engine's hop is judged on its own, by the engine's evidence; the
            # gateway's hop, with HTTP spans only and no gauges, cannot tell and says so.
            assert judged == {engine.port: want, gateway.port: "unconfirmed"}, \
                [(r.verdict, r.server_port, r.details) for r in rows]
    assert not [r for r in rows if r.request_id.startswith("gw-done") and r.verdict not in ("completed", "unconfirmed")]


def test_the_daemons_completed_count_takes_a_duplicate_server_span_once(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", step_ms=10,
            extra_args=["--engine-span", "none", "--duplicate-server-span"]) as engine:
        daemon.set_ports({engine.port})
        for i in range(3):
            complete(engine.port, stream=i == 0, max_tokens=4, request_id=f"count-{i}").join()
        assert wait_for(lambda: server_spans(daemon) >= 6, timeout_s=10)

        def completed() -> float:
            with urllib.request.urlopen(f"http://127.0.0.1:{daemon.status.metrics_port}/metrics") as response:
                page = response.read().decode()
            return sum(float(line.split()[-1]) for line in page.splitlines()
                       if line.startswith("auditor_completed_requests_total"))

        assert wait_for(lambda: completed() >= 3, timeout_s=15)
        time.sleep(1.5)
        assert completed() == 3
