"""What the report shows beyond its figures: the breakdown by service (and host) in every format,
CPU-seconds on hosts without a GPU, and time-axis labels on round times."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import jsonschema
import pytest

from auditor.model import Phase, RequestVerdict, SpanRecord, SpanRole, Verdict
from auditor.report import ReportQuery, build_report
from auditor.report.render_data import write_json
from auditor.report.render_html import render_html
from auditor.report.render_table import render_table
from auditor.report.svg import tick_label, time_ticks
from auditor.store import Store
from auditor.timefmt import rfc3339_seconds
from tests.report_data import T0, at, fill, trace

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())
S = 1_000_000_000


def verdict(n: int, *, service: str, host: str = "cpu-1", lag: float = 4.0, gpu: float = 0.0,
            cpu: float = 0.0) -> RequestVerdict:
    return RequestVerdict(
        request_key=f"{host}/{trace(n)}/{n:016x}", host=host, verdict=Verdict.ZOMBIE,
        disconnect_at_ns=at(60 * n + 1), disconnect_kind="fin", request_start_ns=at(60 * n),
        work_end_ns=at(60 * n + 1 + lag), lag_seconds=lag, phase=Phase.DECODE, trace_id=trace(n),
        request_id=f"r-{n}", service=service, route="/v1/completions", model="tiny",
        tokens_after_disconnect=10, tokens_exact=True, wasted_gpu_seconds=gpu, wasted_cpu_seconds=cpu)


def request(n: int, *, service: str, host: str = "cpu-1") -> SpanRecord:
    return SpanRecord(
        trace_id=trace(n), span_id=f"{n:016x}", parent_span_id=None, name="POST /v1/completions",
        kind="server", start_ns=at(60 * n), end_ns=at(60 * n + 1), service=service, host=host,
        role=SpanRole.HTTP_SERVER, peer_addr="127.0.0.1", peer_port=40000 + n, server_port=8000)


def test_breakdown_by_service_and_host_in_every_format(store: Store) -> None:
    fill(store)  # service "vllm" on gpu-a and gpu-b
    store.insert_spans([request(30, service="gateway", host="gpu-a")])
    store.upsert_verdicts([verdict(30, service="gateway", host="gpu-a", lag=50.0, gpu=7.0)])
    report = build_report(store, ReportQuery(since_ns=T0, until_ns=at(3600)), with_series=True)
    services = {row.key: (row.disconnects, row.zombies, row.wasted_gpu_seconds)
                for row in report.breakdowns["service"]}
    assert services == {"vllm": (5, 2, 14.0), "gateway": (1, 1, 7.0)}
    assert report.breakdowns["service"][0].key == "gateway"  # most zombie time first
    assert {row.key: row.disconnects for row in report.breakdowns["host"]} == {"gpu-a": 5, "gpu-b": 1}
    out = io.StringIO()
    write_json(report, out)
    document = json.loads(out.getvalue())
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert [row["key"] for row in document["breakdowns"]["service"]] == ["gateway", "vllm"]
    table = render_table(report)
    assert "By service" in table and "By host" in table
    assert re.search(r"^  gateway +1 +0 +0 +1 +0 +0 +50\.0 +10 +7\.0$", table, re.M), table
    page = render_html(report)
    assert "<h2>By service</h2>" in page and "<td>gateway</td>" in page


def test_cpu_only_hosts_show_cpu_seconds(store: Store) -> None:
    store.insert_spans([request(n, service="llama.cpp") for n in (1, 2)])
    store.upsert_verdicts([verdict(1, service="llama.cpp", cpu=4.5), verdict(2, service="llama.cpp", cpu=1.25)])
    report = build_report(store, ReportQuery(since_ns=T0, until_ns=at(3600)), with_series=True)
    assert report.totals.cost_unit == "CPU" and report.totals.wasted_gpu_seconds == 0.0
    assert sum(b.wasted_cpu_seconds for b in report.series or []) == pytest.approx(5.75)
    page = render_html(report)
    assert "5.8 CPU-s" in page and "wasted (no GPU on these hosts)" in page
    assert "<h2>Zombies and wasted CPU time</h2>" in page and "wasted CPU-seconds" in page
    assert "<th>CPU-s</th>" in page and "<th>GPU-s</th>" not in page
    assert "<td>4.5</td>" in page  # the worst zombie's own CPU-seconds
    table = render_table(report)
    assert "CPU-s" in table.split("By service", 1)[1].splitlines()[1]


def test_gpu_hosts_keep_gpu_seconds(store: Store) -> None:
    fill(store)  # has GPUs and wasted GPU-seconds; CPU-seconds must not take over
    report = build_report(store, ReportQuery(since_ns=T0, until_ns=at(3600)), with_series=True)
    assert report.totals.cost_unit == "GPU"
    page = render_html(report)
    assert "<th>GPU-s</th>" in page and "<th>CPU-s</th>" not in page


@pytest.mark.parametrize(("window_s", "step_s"), [
    (90, 15), (1800, 300), (3600, 600), (5400, 900), (6 * 3600, 3600), (86400, 10800),
    (7 * 86400, 86400), (100 * 86400, 2 * 604800)])
def test_time_ticks_are_round_steps_on_round_times(window_s: int, step_s: int) -> None:
    start = T0 + 3 * 60 * S + 27 * S  # 04:03:27, not on any round time
    ticks, step_ns = time_ticks(start, start + window_s * S)
    assert step_ns == step_s * S
    assert 1 <= len(ticks) <= 8
    assert all(tick % step_ns == 0 and start <= tick <= start + window_s * S for tick in ticks)
    assert ticks[0] - start < step_ns  # the first round time in the window, not a later one


def test_tick_labels_and_the_chart_use_them(store: Store) -> None:
    assert tick_label(T0 + 600 * S, 600 * S) == "04:10"
    assert tick_label(T0 + 15 * S, 15 * S) == "04:00:15"
    assert tick_label(T0, 86400 * S) == "11-22"
    fill(store)
    since = T0 + 207 * S  # 04:03:27
    page = render_html(build_report(store, ReportQuery(since_ns=since, until_ns=since + 3600 * S),
                                    with_series=True))
    labels = re.findall(r'text-anchor="middle">(\d\d:\d\d(?::\d\d)?)</text>', page)
    assert labels[:6] == ["04:10", "04:20", "04:30", "04:40", "04:50", "05:00"]
    assert rfc3339_seconds(since)[11:16] not in labels
