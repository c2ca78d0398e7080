"""What zombies cost, end to end, against what the engine itself spent (its truth log).

The real daemon (eBPF probe, OTLP receiver, procfs CPU sampler) watches the reference engine on the
CPU, whose spans carry no ``process.pid`` (the OpenTelemetry SDK's default resource): the daemon
must find the engine by its listening port. The engine's ``compute_seconds_after_disconnect`` is
the truth: each compute step's thread CPU-seconds after the client left, shared among the requests
in that step. The daemon sees the whole process's CPU, steps and everything else (HTTP, tracing,
the /metrics it scrapes), so it may only read a little high; within 10 % per zombie is asked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from auditor.daemon import Daemon
from auditor.store.schema import SpanRow
from replay.engine.launch import EngineProcess, running_engine
from tests.e2e import cancel_after, running_daemon, verdict_rows, wait_for

pytestmark = [pytest.mark.privileged, pytest.mark.slow]
TOLERANCE = 0.10


def found_engine(daemon: Daemon, engine: EngineProcess) -> None:
    """Wait until the daemon has found the engine behind its port and sampled it once (a baseline)."""
    assert wait_for(lambda: daemon.correlator.cost.pid_by_port.get(engine.port) == engine.pid, timeout_s=10), (
        daemon.correlator.cost.pid_by_port, daemon.correlator.cost.unresolved)
    time.sleep(0.5)


def settled_zombies(daemon: Daemon, request_ids: set[str]) -> dict[str, Any]:
    def done() -> bool:
        rows = {r.request_id: r for r in verdict_rows(daemon)}
        return all(rid in rows and not rows[rid].details.get("provisional") for rid in request_ids)

    assert wait_for(done, timeout_s=40), [(r.request_id, r.verdict, r.details) for r in verdict_rows(daemon)]
    return {r.request_id: r for r in verdict_rows(daemon) if r.request_id in request_ids}


def no_span_names_a_process(daemon: Daemon) -> None:
    with daemon.store.session() as session:
        pids = set(session.scalars(select(SpanRow.process_pid)))
    assert pids == {None}, pids


def compare(rows: dict[str, Any], truths: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for request_id, row in sorted(rows.items()):
        truth = truths[request_id]["compute_seconds_after_disconnect"]
        if row.verdict != "zombie":
            problems.append(f"{request_id}: {row.verdict} ({row.details})")
        elif abs(row.wasted_cpu_seconds - truth) > TOLERANCE * truth:
            problems.append(f"{request_id}: charged {row.wasted_cpu_seconds:.3f} CPU-s, spent {truth:.3f} "
                            f"({row.wasted_cpu_seconds / truth - 1:+.0%}; {row.details})")
    return problems


def test_batched_zombies_cost_what_they_ran_with_the_engine_found_by_its_port(tmp_path: Path) -> None:
    """Three zombies of different lengths share the batch (three, then two, then one running)."""
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": 0.1}) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
            truth_log=tmp_path / "truth.jsonl", step_ms=20, max_batch=4, extra_args=["--no-process-pid"]) as engine:
        daemon.set_ports({engine.port})
        found_engine(daemon, engine)
        names = {f"batched-{n}": n for n in (80, 130, 200)}
        for thread in [cancel_after(engine.port, 0.3, "fin", stream=True, max_tokens=n, request_id=rid)
                       for rid, n in names.items()]:
            thread.join()
        truths = {rid: engine.truth_of(f"cmpl-{rid}", timeout=30) for rid in names}
        rows = settled_zombies(daemon, set(names))
        no_span_names_a_process(daemon)
    assert not compare(rows, truths), "\n".join(compare(rows, truths))
    # Sharing mattered: the longest ran alone at its end, the shortest never did.
    spent = {rid: truths[rid]["compute_seconds_after_disconnect"] for rid in names}
    assert spent["batched-200"] > 2 * spent["batched-80"]


def test_one_at_a_time_zombie_is_charged_in_full_and_the_request_waiting_behind_it_nothing(tmp_path: Path) -> None:
    """One request at a time, no gauges scraped: the spans alone tell who ran. The request queued
    behind the first zombie is charged only for its own run, none of the wait."""
    # The engine span of the request behind comes only when it ends, after the first ran: give it time.
    settings = {"engine_metrics.scrape": False, "correlate.late_span_seconds": 15.0}
    with running_daemon(tmp_path, **settings) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
            truth_log=tmp_path / "truth.jsonl", step_ms=20, max_batch=1, extra_args=["--no-process-pid"]) as engine:
        daemon.set_ports({engine.port})
        found_engine(daemon, engine)
        first = cancel_after(engine.port, 0.3, "fin", stream=True, max_tokens=80, request_id="first")
        time.sleep(0.1)
        behind = cancel_after(engine.port, 0.3, "fin", stream=True, max_tokens=30, request_id="behind")
        first.join()
        behind.join()
        truths = {rid: engine.truth_of(f"cmpl-{rid}", timeout=30) for rid in ("first", "behind")}
        rows = settled_zombies(daemon, {"first", "behind"})
    assert truths["behind"]["phase_at_disconnect"] == "queued", truths["behind"]
    assert truths["behind"]["scheduled_at"] >= truths["first"]["finished_at"]
    assert not compare(rows, truths), "\n".join(compare(rows, truths))
