"""The report's orphaned work by port: stretches told by an engine's port alone, in every format."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from auditor.report import ReportQuery, build_report
from auditor.report.model import Prices
from auditor.report.render_data import report_dict
from auditor.report.render_html import render_html
from auditor.report.render_table import render_table
from auditor.store import Store
from tests.report_data import LLAMA, T0, at, fill

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())
HOUR = ReportQuery(since_ns=T0, until_ns=at(3600))
S = 1_000_000_000


def stretch(port: int, start_s: float, end_s: float | None, request_s: float, *, host: str = "gpu-a",
            peak: int = 1, gpu_s: float = 0.0, with_spans: bool = False, model: str | None = None,
            last_seen_ns: int | None = None, unmeasured: str | None = None) -> dict[str, Any]:
    return {"host": host, "server_port": port, "start_ns": at(start_s), "end_ns": None if end_s is None else at(end_s),
            "last_seen_ns": last_seen_ns or at(end_s if end_s is not None else start_s), "peak": peak,
            "request_seconds": request_s, "wasted_gpu_seconds": gpu_s, "wasted_cpu_seconds": 0.0,
            "end_resolution_s": 0.25, "cut_short": False, "with_spans": with_spans, "model": model,
            "cost_unmeasured": unmeasured}


@pytest.fixture
def orphaned(store: Store) -> Store:
    store.write_orphaned_work([
        stretch(8080, 100, 112, 12.0, gpu_s=6.0, peak=1),  # llama.cpp alone
        stretch(8080, 200, 260, 90.0, gpu_s=45.0, peak=2),
        stretch(8080, -30, 5, 35.0, gpu_s=1.0),  # began before the window, ended in it
        stretch(8080, -100, -50, 50.0),  # ended before the window: not shown
        stretch(8000, 300, 303, 3.0, gpu_s=1.5, with_spans=True, model=LLAMA),  # vLLM: in its verdicts too
        stretch(8001, 500, 520, 20.0, gpu_s=2.0, model=LLAMA),  # an uninstrumented vLLM: its gauges name the model
        stretch(9000, 400, 410, 10.0, host="gpu-b", unmeasured="the process serving port 9000 is not known"),
    ])
    return store


def test_stretches_are_summed_by_port_the_most_orphaned_first(orphaned: Store) -> None:
    report = build_report(orphaned, HOUR)
    assert not report.empty  # no request in the window: the orphaned work is what it holds
    document = report_dict(report)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    ports = document["orphaned_work"]
    assert [(p["host"], p["server_port"]) for p in ports] == [("gpu-a", 8080), ("gpu-a", 8001), ("gpu-b", 9000),
                                                              ("gpu-a", 8000)]  # those that sent spans last
    llama = ports[0]
    assert (llama["stretches"], llama["running"], llama["peak"]) == (3, 0, 2)
    assert llama["request_seconds"] == pytest.approx(12 + 90 + 35)
    assert llama["wasted_gpu_seconds"] == pytest.approx(52.0) and llama["longest_seconds"] == 60.0
    assert not llama["with_spans"] and llama["model"] is None and llama["wasted_cost"] is None
    assert ports[3]["with_spans"] and ports[3]["model"] == LLAMA
    assert ports[2]["cost_unmeasured"] == "the process serving port 9000 is not known"
    assert report.orphaned_without_spans() == pytest.approx((167.0, 54.0, 0.0))


def test_the_table_html_and_prices_show_each_port(orphaned: Store) -> None:
    fill(orphaned)  # beside verdicts and requests
    report = dataclasses.replace(build_report(orphaned, HOUR), prices=Prices(gpu_hour=3.6, currency="USD"))
    for width in (80, 100):
        table = render_table(report, width=width)
        section = table.split("Orphaned work by port")[1].split("\n\n")[0]
        assert all(len(line) <= width for line in section.splitlines()), section
        assert "Orphaned work by port (the engine's gauges and the kernel alone; at least)" in table
    table = render_table(report)
    [llama] = [line for line in table.splitlines() if line.startswith("  gpu-a:8080 ")]
    assert llama.split() == ["gpu-a:8080", "3", "1m", "00s", "2", "137.0", "52.0", "0.052"], llama
    # The port that sent spans has its zombies in the verdicts: the table and the HTML leave it to JSON.
    assert "gpu-a:8000" not in table and "Ports with spans count it in their verdicts" in " ".join(table.split())
    assert "not costed: the process serving port 9000 is not known" in table and "model llama-3-8b" in table
    assert report_dict(report)["orphaned_work"][0]["wasted_cost"] == pytest.approx(52 * 3.6 / 3600)
    page = render_html(report)
    assert "<h2>Orphaned work by port</h2>" in page and "<td>gpu-a:8080</td>" in page
    assert "<td>gpu-a:8000</td>" not in page
    assert page.count("<th>cost, USD</th>") >= 1


def test_filters_a_port_cannot_honor_leave_it_out(orphaned: Store) -> None:
    assert [p.server_port for p in build_report(orphaned, dataclasses.replace(HOUR, host="gpu-b")).orphaned_work
            or []] == [9000]
    assert [p.server_port for p in build_report(orphaned, dataclasses.replace(HOUR, model=LLAMA)).orphaned_work
            or []] == [8001, 8000]
    for narrowed in ({"route": "/v1/chat/completions"}, {"client": "10.0.0.7"}, {"service": "vllm"},
                     {"user_agent": "curl/8.5.0"}):
        report = build_report(orphaned, dataclasses.replace(HOUR, **narrowed))
        assert report.orphaned_work is None and report_dict(report)["orphaned_work"] is None
        assert "Orphaned work" not in render_table(report)


def test_a_stretch_still_running_is_counted_as_such_until_its_row_goes_stale(store: Store) -> None:
    now = time.time_ns()
    store.write_orphaned_work([
        {**stretch(8080, 0, None, 20.0, last_seen_ns=now - 5 * S), "start_ns": now - 30 * S},
        {**stretch(8081, 0, None, 20.0, last_seen_ns=now - 600 * S), "start_ns": now - 900 * S},  # daemon died
    ])
    report = build_report(store, ReportQuery(since_ns=now - 3600 * S, until_ns=now + 60 * S))
    running = {p.server_port: p.running for p in report.orphaned_work or []}
    assert running == {8080: 1, 8081: 0}
    assert "1 still running when last seen" in render_table(report)


def test_a_non_finite_figure_is_left_out_of_the_sums(store: Store) -> None:
    """An upstream bug's infinity must not turn a port's whole sum, or the document, into garbage."""
    store.write_orphaned_work([stretch(8080, 100, 110, float("inf"), gpu_s=float("-inf")),
                               stretch(8080, 200, 210, 10.0, gpu_s=5.0)])
    report = build_report(store, HOUR)
    document = report_dict(report)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    [port] = document["orphaned_work"]
    assert (port["stretches"], port["request_seconds"], port["wasted_gpu_seconds"]) == (2, 10.0, 5.0)
    json.dumps(document, allow_nan=False)


def test_the_html_plots_the_work_of_ports_without_spans_over_time(orphaned: Store) -> None:
    report = build_report(orphaned, HOUR, with_series=True)
    assert report.series is not None
    slice_s = report.bucket_ns / S
    # Each stretch's request-seconds spread over its time, within the window: 12 + 90 + the last 5 s
    # of the one that began before it (35 over 35 s) + 10 on gpu-b; the port with spans is not plotted.
    assert sum(b.orphaned_requests for b in report.series) * slice_s == pytest.approx(12 + 90 + 5 + 10 + 20)
    assert sum(b.orphaned_wasted_gpu_seconds for b in report.series) == pytest.approx(6 + 45 + 1 * 5 / 35 + 2)
    page = render_html(report)
    assert "<h2>Orphaned work on ports without spans</h2>" in page
    assert 'aria-label="orphaned requests at once and their GPU-seconds over time"' in page
    narrowed = build_report(orphaned, dataclasses.replace(HOUR, route="/v1/completions"), with_series=True)
    assert narrowed.series is not None and not any(b.orphaned_requests for b in narrowed.series)
    assert "Orphaned work on ports without spans" not in render_html(narrowed)


def test_hosts_priced_apart_price_each_port_at_its_hosts(orphaned: Store) -> None:
    orphaned.write_orphaned_work([stretch(9001, 600, 636, 36.0, host="gpu-b", gpu_s=36.0)])
    prices = Prices(gpu_hour=1.0, gpu_hour_by_host=(("gpu-b", 10.0),))
    report = dataclasses.replace(build_report(orphaned, HOUR), prices=prices)
    ports = {(p["host"], p["server_port"]): p for p in report_dict(report)["orphaned_work"]}
    assert ports[("gpu-a", 8080)]["wasted_cost"] == pytest.approx(52.0 * 1.0 / 3600)
    assert ports[("gpu-b", 9001)]["wasted_cost"] == pytest.approx(36.0 * 10.0 / 3600)
