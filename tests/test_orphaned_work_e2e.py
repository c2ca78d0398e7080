"""An engine that sends no spans at all (llama.cpp's server with ``--metrics``, or TGI, alone): the
work it runs on after a client leaves is told by its port alone, as a stretch of orphaned work, and the
report shows it, against the engine's truth log. A request read whole, a client kept alive after
its answer and an engine that stops the work when its client leaves give no stretch. A client kept
alive between requests, as a pool keeps it, hides the work only until it has been quiet for
``IDLE_QUIET_MS`` after an answer (before that it may hold a request, for all the kernel tells)."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from auditor.model import STEP_STILL_NS
from auditor.report import ReportQuery, build_report
from auditor.report.render_data import report_dict
from auditor.report.render_table import render_table
from auditor.store import Store, tables
from probes.sockdiag import IDLE_ANSWERED_MS, IDLE_QUIET_MS
from replay.engine.launch import running_engine
from tests.e2e import GRACE_S, cancel_after, complete, expected_verdict, running_daemon
from tests.test_evidence_e2e import kept_alive

pytestmark = [pytest.mark.privileged, pytest.mark.slow]
SCRAPE_S = 0.1
S = 1_000_000_000


def stretches(db: Path) -> list[dict[str, Any]]:
    store = Store(f"sqlite:///{db}")
    try:
        with store.engine.connect() as conn:
            return [dict(row) for row in conn.execute(select(tables.orphaned_work)).mappings()]
    finally:
        store.close()


@pytest.mark.parametrize(("behavior", "source", "spans", "names"), [
    ("detached", "bpf", False, "llamacpp"), ("abort", "bpf", False, "llamacpp"), ("detached", "procfs", False, "llamacpp"),
    ("detached", "bpf", False, "tgi"),  # TGI alone: its spans name no client, so none are sent here
    ("detached", "bpf", True, "vllm"),  # vLLM's signals: HTTP server spans, no engine span
    # Gauges published only with a step: vLLM's, left standing by a batch aborted at once, which
    # read as they were ran on for a second; SGLang's, logged every 40 decode steps.
    ("abort", "bpf", False, "vllm-steps"), ("detached", "bpf", False, "sglang-steps"),
])
def test_an_engine_without_spans_shows_the_work_it_ran_for_nobody(tmp_path: Path, behavior: str, source: str,
                                                                  spans: bool, names: str) -> None:
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source}) as daemon, \
            running_engine(behavior=behavior, truth_log=truth_log, step_ms=10,
                           otlp=f"http://127.0.0.1:{daemon.status.http_port}" if spans else None,
                           extra_args=["--metrics-names", names.removesuffix("-steps"),
                                       *(["--gauges-on-steps"] if names.endswith("-steps") else []),
                                       *(["--engine-span", "none"] if spans else [])],
                           env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)  # the port's first scrapes
        # First a request read whole and one whose client keeps the connection after its answer
        # (that client would hide an orphan while it stays: the count is a lower bound).
        whole = complete(engine.port, stream=True, max_tokens=40, request_id="whole")
        kept = kept_alive(engine.port, hold_s=1.5, stream=False, max_tokens=60, request_id="kept")
        whole.join()
        kept.join()
        cancel = cancel_after(engine.port, 0.3, "rst", stream=False, max_tokens=300, request_id="left")
        cancel.join()
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(3, timeout=30)}
        # Scrapes past the work's end (up to a log interval late for SGLang's), and past the time
        # standing gauges take to be read as such.
        time.sleep(2.0 + STEP_STILL_NS.get(names.removesuffix("-steps"), 0) / S)
        spans_seen = daemon.readings().spans_received
        port = engine.port
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.status.metrics_port}/metrics", timeout=5) as answer:
            counted = re.search(rf'^auditor_orphaned_request_seconds_total{{port="{port}",spans="{str(spans).lower()}"}} '
                                r'(\S+)$', answer.read().decode(), re.M)
    assert (spans_seen > 0) == spans, spans_seen
    truth = truths["left"]
    rows = stretches(tmp_path / "auditor.db")
    if expected_verdict(truth) == "aborted":
        assert rows == [] and counted is None, (rows, truth)
        return
    assert expected_verdict(truth) == "zombie", truth
    left_ns, finished_ns = truth["disconnect_at"], truth["finished_at"]
    [row] = rows  # one: the request read whole and the client kept alive add none
    assert row["server_port"] == port and row["peak"] == 1 and not row["cut_short"]
    assert row["with_spans"] == spans  # with spans, its verdicts count the same work
    # Counted from the first scrape past its client's grace, to the work's end within a scrape or two.
    assert left_ns + GRACE_S * S <= row["start_ns"] <= left_ns + (GRACE_S + 1.5) * S, (row, truth)
    # SGLang's work may have run on for a log interval after its last log (40 steps of 10 ms).
    slack_s = 0.5 + (0.4 if names == "sglang-steps" else 0.0)
    assert abs(row["end_ns"] - finished_ns) <= slack_s * S, ((row["end_ns"] - finished_ns) / S, row, truth)
    assert row["request_seconds"] == pytest.approx((row["end_ns"] - row["start_ns"]) / S, abs=0.05)
    assert row["request_seconds"] <= (finished_ns - left_ns) / S  # a lower bound of its zombie time
    assert counted is not None and float(counted.group(1)) == pytest.approx(row["request_seconds"], abs=1e-3)
    # Costed by the engine process's CPU (no GPU here), shared by what it ran: itself alone.
    assert 0 < row["wasted_cpu_seconds"] <= 2 * row["request_seconds"], row
    assert row["cost_unmeasured"] is None, row

    store = Store(f"sqlite:///{tmp_path / 'auditor.db'}")
    try:
        report = build_report(store, ReportQuery(since_ns=left_ns - 60 * S, until_ns=finished_ns + 60 * S))
        narrowed = build_report(store, ReportQuery(since_ns=left_ns - 60 * S, until_ns=finished_ns + 60 * S,
                                                   route="/v1/completions"))
    finally:
        store.close()
    assert not report.empty  # no request, no verdict: the orphaned work is what the window holds
    [shown] = report_dict(report)["orphaned_work"]
    assert shown["server_port"] == port and shown["stretches"] == 1 and shown["running"] == 0
    assert shown["request_seconds"] == pytest.approx(row["request_seconds"])
    # The table shows the work of ports without spans: with them, the verdicts count it.
    assert ("Orphaned work by port" in render_table(report)) != spans
    assert narrowed.orphaned_work is None  # a port's work has no route: not shown as if it had


def test_a_request_that_only_waited_is_orphaned_work_once_the_engine_runs_it(tmp_path: Path) -> None:
    """llama.cpp's gauges, no spans, one request run at a time: a request queued behind another
    loses its client at 0.3 s. While it waits it costs nothing (DESIGN §5); the detached engine
    runs it once the one ahead ends, and from then (the truth's ``scheduled_at``) it is orphaned work."""
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S}) as daemon, \
            running_engine(behavior="detached", truth_log=tmp_path / "truth.jsonl", step_ms=10, max_batch=1,
                           extra_args=["--metrics-names", "llamacpp"]) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)
        ahead = complete(engine.port, stream=True, max_tokens=200, request_id="ahead")
        time.sleep(0.2)
        cancel_after(engine.port, 0.3, "rst", stream=False, max_tokens=200, request_id="left").join()
        ahead.join()
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(2, timeout=30)}
        time.sleep(1.0)
    truth = truths["left"]
    assert truth["disconnect_at"] + GRACE_S * S < truth["scheduled_at"], ("it did not wait past its grace", truth)
    [row] = stretches(tmp_path / "auditor.db")
    assert truth["scheduled_at"] <= row["start_ns"] <= truth["scheduled_at"] + 1.5 * S, (row, truth)
    assert abs(row["end_ns"] - truth["finished_at"]) <= 0.5 * S, (row, truth)
    assert row["request_seconds"] <= (truth["finished_at"] - truth["scheduled_at"]) / S + 0.25, (row, truth)


@pytest.mark.parametrize("source", ["bpf", "procfs"])
def test_a_pooled_client_between_requests_hides_no_orphaned_work(tmp_path: Path, source: str) -> None:
    """llama.cpp's gauges, no spans, an engine that keeps idle connections for a minute (TGI's
    server, or a gateway's upstream pool): a client reads a 2 s answer and keeps its connection,
    quiet; then another's client resets at 0.3 s and the detached engine runs its 6 s on. The quiet
    client holds no request (the kernel says it was answered and has been quiet since): the work
    is counted from at most IDLE_QUIET_MS past the answer, not hidden for as long as the pool
    keeps the connection. A client whose streamed answer still runs stays counted connected (the
    request read whole beside it adds nothing)."""
    step_ms, answer_tokens = 10, 200
    assert answer_tokens * step_ms >= IDLE_ANSWERED_MS  # an answer long enough to be told as one
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source}) as daemon, \
            running_engine(behavior="detached", truth_log=tmp_path / "truth.jsonl", step_ms=step_ms,
                           extra_args=["--metrics-names", "llamacpp", "--keep-alive-s", "60"]) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)
        pooled = kept_alive(engine.port, hold_s=12.0, stream=False, max_tokens=answer_tokens, request_id="pooled")
        time.sleep(answer_tokens * step_ms / 1000 + 0.3)  # its answer read, its connection kept
        streamed = complete(engine.port, stream=True, max_tokens=700, request_id="streamed")
        cancel_after(engine.port, 0.3, "rst", stream=False, max_tokens=600, request_id="left").join()
        streamed.join()
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(3, timeout=30)}
        time.sleep(1.0)
        answered_ns = truths["pooled"]["finished_at"]
        pooled.join()
    truth = truths["left"]
    assert expected_verdict(truth) == "zombie", truth
    left_ns, finished_ns = truth["disconnect_at"], truth["finished_at"]
    # The pooled client is connected all along (held 12 s, the engine keeps it 60 s).
    assert finished_ns < answered_ns + 11 * S, (finished_ns - answered_ns) / S
    [row] = stretches(tmp_path / "auditor.db")
    counted_from = max(left_ns + GRACE_S * S, answered_ns + IDLE_QUIET_MS * 1_000_000)
    assert counted_from <= row["start_ns"] + 0.1 * S <= counted_from + 1.6 * S, \
        ((row["start_ns"] - left_ns) / S, (row["start_ns"] - answered_ns) / S, truth)
    assert abs(row["end_ns"] - finished_ns) <= 0.5 * S, (row, truth)
    assert row["peak"] == 1, row  # the streamed request beside it, its client connected, is not counted
    assert row["request_seconds"] <= (finished_ns - left_ns) / S
