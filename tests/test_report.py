"""The report over a realistic store: figures, breakdowns, filters, and every output format."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from pathlib import Path

import jsonschema
import pytest

from auditor.model import RequestVerdict, Verdict
from auditor.report import ReportQuery, build_report
from auditor.report.model import Prices, Report, RequestFinding
from auditor.report.query import FINDING_COLUMNS
from auditor.report.render_data import (
    REQUEST_FIELDS,
    report_dict,
    request_dict,
    request_json,
    write_csv,
    write_json,
)
from auditor.report.render_html import render_html
from auditor.report.render_table import money, render_table
from auditor.store import Store
from auditor.timefmt import rfc3339
from tests.report_data import (
    BROWSER,
    CHAT,
    COMPLETIONS,
    EVIL_ID,
    LLAMA,
    QWEN,
    SDK_AGENT,
    T0,
    S,
    _verdict,
    at,
    fill,
    fill_timeouts,
    trace,
)

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())
HOUR = ReportQuery(since_ns=T0, until_ns=at(3600))


@pytest.fixture
def filled(store: Store) -> Store:
    fill(store)
    return store


def validate(document: dict[str, object]) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(document)


def test_totals_are_summed_over_the_window_only(filled: Store) -> None:
    t = build_report(filled, HOUR).totals
    assert (t.requests, t.disconnects) == (12, 5)  # engine spans and the earlier hour excluded
    assert (t.completed, t.aborted, t.zombies, t.inflight_zombies) == (1, 1, 2, 1)
    assert t.zombie_seconds == pytest.approx(12.5 + 3.0 + 30.0)
    assert (t.wasted_tokens, t.wasted_tokens_estimated) == (1100, 200)
    assert t.wasted_gpu_seconds == pytest.approx(14.0)
    assert t.uncapped_disconnects == 1
    assert t.uncosted_zombies == 1  # a zombie that says cost_unmeasured; not the completed one
    assert (t.idle_closes, t.unjoined_disconnects, t.unjoined_spans, t.lost_kernel_events,
            t.proxy_rewritten_peers, t.peerless_span_joins) == (5, 1, 4, 7, 1, 1)
    # Two GPUs x one hour; per-process and CPU samples are not GPUs.
    assert (t.gpus, t.gpu_seconds) == (2, 7200.0)
    assert t.gpu_busy_seconds == pytest.approx(360 * 2 * 0.8 * 10)
    assert t.wasted_gpu_share == pytest.approx(14.0 / 7200.0)


def test_unconfirmed_verdicts_without_gauges_or_racing_their_answer_are_counted_apart(store: Store) -> None:
    # Those no gauges of their engine told (its /metrics not read): the ones scraping would confirm.
    store.upsert_verdicts([
        _verdict(n, Verdict.UNCONFIRMED, start_s=60.0 * n, disconnect_s=60.0 * n + 1, end_s=60.0 * n + 1.5, lag=None,
                 tokens=None, details={"evidence": "http_only", "unconfirmed_because": because})
        for n, because in ((1, "no_gauges"), (2, "no_gauges"), (3, "raced_its_answer"), (4, "gauges_cannot_tell"))])
    report = build_report(store, HOUR)
    assert (report.totals.unconfirmed, report.totals.unconfirmed_without_gauges) == (4, 2)
    # Those whose client closed as the answer ended: whole answers, or stops, that nothing told apart.
    assert report.totals.unconfirmed_raced == 1
    document = report_dict(report)
    validate(document)
    assert (document["totals"]["unconfirmed_without_gauges"], document["totals"]["unconfirmed_raced"]) == (2, 1)
    table = render_table(report)
    assert "no gauges read" in table and "auditor doctor" in table
    assert re.search(r"raced their answer +1 ", table), table
    html = render_html(report)
    assert "2 with no gauges of their engine read" in html and "1 whose client closed as its answer ended" in html


def test_breakdowns_group_by_each_dimension(filled: Store) -> None:
    report = build_report(filled, HOUR)
    routes = {row.key: row for row in report.breakdowns["route"]}
    assert routes[CHAT].disconnects == 4 and routes[CHAT].zombies == 2
    assert routes[CHAT].zombie_seconds == pytest.approx(45.5)
    assert routes[COMPLETIONS].aborted == 1 and routes[COMPLETIONS].zombie_seconds == 0
    assert report.breakdowns["route"][0].key == CHAT  # worst first
    assert {row.key: row.disconnects for row in report.breakdowns["phase"]} == {
        "decode": 3, "prefill": 1, "queued": 1}
    assert {row.key: row.disconnects for row in report.breakdowns["disconnect_kind"]} == {
        "fin": 3, "rst": 2}
    assert {row.key for row in report.breakdowns["model"]} == {LLAMA, QWEN}


def test_the_client_addresses_say_who_left(filled: Store) -> None:
    def caller(n: int, address: str | None, verdict: Verdict, lag: float, gpu: float) -> RequestVerdict:
        start = 1000.0 + n
        row = _verdict(n, verdict, start_s=start, disconnect_s=start + 1, end_s=start + 1 + lag, lag=lag, gpu=gpu)
        return dataclasses.replace(row, client_addr=address)

    filled.upsert_verdicts([caller(200, "10.0.9.9", Verdict.ZOMBIE, 40.0, 8.0),
                            caller(201, "10.0.9.9", Verdict.ZOMBIE, 20.0, 4.0),
                            caller(202, "fd00::7", Verdict.ABORTED, 0.1, 0.0),
                            caller(203, None, Verdict.COMPLETED, 0.0, 0.0)])
    report = build_report(filled, HOUR)
    rows = report.breakdowns["client_address"]
    # The heaviest caller first; the port is no part of it; a verdict without an address is None.
    assert [(r.key, r.disconnects, r.zombies, r.zombie_seconds, r.wasted_gpu_seconds) for r in rows] == [
        ("10.0.9.9", 2, 2, 60.0, 12.0), ("10.0.0.7", 5, 2, 45.5, 14.0), (None, 1, 0, 0.0, 0.0),
        ("fd00::7", 1, 0, 0.0, 0.0)]
    by_route = report.breakdowns["route"]
    for dimension in ("client_address", "route"):  # every breakdown adds up to the totals
        picked = report.breakdowns[dimension]
        assert sum(r.disconnects for r in picked) == report.totals.disconnects == 9
        assert sum(r.wasted_gpu_seconds for r in picked) == pytest.approx(sum(r.wasted_gpu_seconds for r in by_route))
    assert "By client address" in render_table(report) and "10.0.9.9" in render_table(report, width=80)
    assert "<h2>By client address</h2>" in render_html(report)
    validate(report_dict(report))


def test_worst_zombies_are_ordered_by_lag_and_limited(filled: Store) -> None:
    worst = build_report(filled, HOUR).worst_zombies
    assert [f.lag_seconds for f in worst] == [30.0, 12.5, 3.0]
    assert [f.trace_id for f in worst] == [trace(11), trace(9), trace(10)]
    top1 = build_report(filled, ReportQuery(since_ns=T0, until_ns=at(3600), top=1)).worst_zombies
    assert [f.request_id for f in top1] == ["req-11"]


@pytest.mark.parametrize(("filters", "requests", "disconnects"), [
    ({"host": "gpu-b"}, 2, 1),
    ({"route": COMPLETIONS}, 3, 1),
    ({"model": QWEN, "host": "gpu-a"}, 3, 1),
    ({"service": "vllm"}, 12, 5),
    ({"service": "other"}, 0, 0),
    ({"client": "10.0.0.7"}, 12, 5),
    ({"client": "10.9.9.9"}, 0, 0),
    # The spans' User-Agent under either convention's name; request 11 names none.
    ({"user_agent": SDK_AGENT}, 10, 3),
    ({"user_agent": BROWSER, "route": COMPLETIONS}, 1, 1),
])
def test_filters_apply_to_requests_and_findings(filled: Store, filters: dict[str, str],
                                                requests: int, disconnects: int) -> None:
    t = build_report(filled, ReportQuery(since_ns=T0, until_ns=at(3600), **filters)).totals
    assert (t.requests, t.disconnects) == (requests, disconnects)


def test_host_filter_narrows_coverage_and_gpu_time(filled: Store) -> None:
    t = build_report(filled, ReportQuery(since_ns=T0, until_ns=at(3600), host="gpu-b")).totals
    assert (t.idle_closes, t.lost_kernel_events, t.proxy_rewritten_peers, t.peerless_span_joins) == (2, 0, 1, 0)
    assert (t.gpus, t.gpu_seconds, t.wasted_gpu_share) == (0, 0.0, None)


def test_json_matches_the_schema_and_lists_every_disconnect(filled: Store) -> None:
    out = io.StringIO()
    write_json(build_report(filled, HOUR), out)
    document = json.loads(out.getvalue())
    validate(document)
    assert document == report_dict(build_report(filled, HOUR)) | {"generated_at": document["generated_at"]}
    assert document["window"]["since"] == "2026-11-22T04:00:00.000000000Z"
    requests = document["requests"]
    assert [r["trace_id"] for r in requests] == [trace(n) for n in (7, 8, 9, 10, 11)]
    zombie = requests[2]
    assert zombie == {
        "request_id": EVIL_ID, "trace_id": trace(9), "verdict": "zombie",
        "disconnect_at": rfc3339(at(901)), "disconnect_kind": "fin", "work_end_at": rfc3339(at(913.5)),
        "lag_seconds": 12.5, "lag_at_least_seconds": None, "phase": "decode", "route": CHAT, "model": LLAMA, "service": "vllm",
        "client": "10.0.0.7:40009", "user_agent": "OpenAI/Python 1.54.0", "host": "gpu-a",
        "request_start_at": rfc3339(at(900)),
        "max_tokens": 512, "wasted_tokens": 900, "tokens_exact": True, "wasted_gpu_seconds": 10.0,
        "wasted_cpu_seconds": 0.0, "evidence": None, "unconfirmed_because": None}
    assert requests[4]["work_end_at"] is None and requests[4]["verdict"] == "inflight_zombie"
    assert requests[3]["lag_seconds"] == 3.0 and requests[3]["lag_at_least_seconds"] == 1.25


def test_csv_has_one_row_per_disconnect_with_the_json_field_names(filled: Store) -> None:
    report = build_report(filled, HOUR)
    out = io.StringIO()
    write_csv(report.requests, out)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert tuple(rows[0]) == REQUEST_FIELDS
    assert [row["verdict"] for row in rows] == ["completed", "aborted", "zombie", "zombie",
                                                "inflight_zombie"]
    assert rows[2]["request_id"] == EVIL_ID and rows[3]["max_tokens"] == ""
    assert rows[3]["tokens_exact"] == "false"


def test_table_fits_100_columns_and_shows_full_ids(filled: Store) -> None:
    text = render_table(build_report(filled, HOUR))
    assert max(len(line) for line in text.splitlines()) <= 100
    for needle in ("requests", "12", "41.7%", "0.2% of 7,200 GPU-s", "By route", "By model",
                   "By phase at disconnect", "By disconnect kind", "no max_tokens cap",
                   "lost kernel events", "peerless span joins", trace(9), EVIL_ID, "req-11"):
        assert needle in text, needle


def test_table_escapes_terminal_control_characters_and_wraps_long_ids(store: Store) -> None:
    fill(store)
    from auditor.model import Verdict
    from tests.report_data import _verdict
    hostile = "\x1b[31mred\x1b[0m" + "x" * 150
    store.upsert_verdicts([_verdict(40, Verdict.ZOMBIE, start_s=50, disconnect_s=51, end_s=600,
                                    lag=549.0, request_id=hostile, route="/v1/" + "r" * 60)])
    text = render_table(build_report(store, HOUR))
    assert "\x1b" not in text and "\\x1b[31mred" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "x" * 150 in text.replace("\n", "").replace(" ", "")  # whole, over two lines


def test_html_is_self_contained_and_escapes_store_text(filled: Store) -> None:
    page = render_html(build_report(filled, HOUR, with_series=True))
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page.lower() and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    for network in ("src=", "href=", "@import", "url(", "https://cdn", "<link"):
        assert network not in page
    assert page.count("<svg") == 4  # zombies over time, completion vs utilization, ages at disconnect, timelines
    assert "Completed requests against GPU utilization" in page and trace(11) in page


def test_series_buckets_the_window(filled: Store) -> None:
    report = build_report(filled, HOUR, with_series=True)
    assert report.series is not None and report.timelines is not None
    assert report.bucket_ns == 60 * 1_000_000_000 and len(report.series) == 60
    assert sum(b.completed_requests for b in report.series) == 12
    assert sum(b.zombies for b in report.series) == 3
    assert sum(b.wasted_gpu_seconds for b in report.series) == pytest.approx(14.0)
    assert {b.gpu_util_percent for b in report.series} == {80.0}
    two_hours = build_report(filled, ReportQuery(since_ns=T0, until_ns=at(7200)), with_series=True)
    assert two_hours.series is not None and two_hours.bucket_ns == 120 * 1_000_000_000
    assert [b.completed_requests for b in two_hours.series[:3]] == [1, 2, 2]  # summed per bucket
    by_trace = {t.finding.trace_id: t for t in report.timelines}
    assert by_trace[trace(9)].end_ns == at(913.5)
    assert by_trace[trace(11)].end_ns == at(1100.2) + 30 * 1_000_000_000  # still running: lag so far
    assert by_trace[trace(9)].utilization and by_trace[trace(11)].utilization == []  # gpu-b: no GPU


def test_a_host_without_gpu_samples_plots_its_engines_cpu(filled: Store) -> None:
    """gpu-b has no NVML samples, only /proc's of its engine (1.5 cores for 1 s): the second plot
    is completed requests against that CPU, not an empty GPU axis captioned as if it were busy."""
    query = ReportQuery(since_ns=T0, until_ns=at(3600), host="gpu-b")
    report = build_report(filled, query, with_series=True)
    assert report.series is not None and all(b.gpu_util_percent is None for b in report.series)
    assert report.series[0].engine_cores == pytest.approx(1.5 / 60)  # 1.5 core-seconds over a minute
    assert all(b.engine_cores is None for b in report.series[1:])
    page = render_html(report)
    assert "Completed requests against the engines' CPU" in page
    assert "against GPU utilization" not in page and "engine CPU, cores" in page
    assert "Completed requests against GPU utilization" in render_html(build_report(filled, HOUR, with_series=True))


def test_empty_window_says_where_the_data_is(filled: Store) -> None:
    report = build_report(filled, ReportQuery(since_ns=at(86400), until_ns=at(90000)))
    assert report.empty
    assert report.empty_message() == (
        "no requests between 2026-11-23T04:00:00Z and 2026-11-23T05:00:00Z; "
        "the store holds data from 2026-11-22T03:00:00Z to 2026-11-22T04:20:02Z")
    out = io.StringIO()
    write_json(report, out)
    document = json.loads(out.getvalue())
    validate(document)
    assert document["empty"] is True and document["totals"]["requests"] == 0
    assert document["requests"] == [] and document["data_range"]["first"].startswith("2026-11-22T03")


def test_empty_store(store: Store) -> None:
    report = build_report(store, HOUR, with_series=True)
    assert report.empty_message().endswith("the store holds no requests yet")
    assert "the store holds no requests yet" in render_html(report)


@pytest.mark.parametrize("text", ['quote " and \\\\ backslash', "tab\tnewline\n\x00nul", "ünïcødé ✓ 🧟",
                                  "\u2028line separator", ""])
def test_fast_request_encoding_equals_json_dumps(filled: Store, text: str) -> None:
    finding = build_report(filled, HOUR).requests[4]  # the in-flight zombie: nulls included
    odd = finding._replace(request_id=text, route=text, lag_seconds=1 / 3,
                              wasted_gpu_seconds=float("nan"))
    for value in (finding, odd):
        assert json.loads(request_json(value)) == request_dict(value)


def test_finding_columns_follow_the_dataclass_fields() -> None:
    names = [column.name for column in FINDING_COLUMNS]
    fields = list(RequestFinding._fields)
    assert names == [{"wasted_tokens": "tokens_after_disconnect"}.get(f, f) for f in fields]


def test_sqlite_built_json_equals_the_python_encoding(filled: Store) -> None:
    from auditor.model import Verdict
    from tests.report_data import _verdict

    odd = [
        _verdict(50, Verdict.ZOMBIE, start_s=50, disconnect_s=51.000000001, end_s=60.123456789,
                 lag=1 / 3, request_id='q"uote\\back\tslash\n\x00\x1b ünï 🧟 \u2028',
                 details={"evidence": "engine_metrics", "unconfirmed_because": "no_gauges"}),  # not unconfirmed
        _verdict(51, Verdict.INFLIGHT_ZOMBIE, start_s=52, disconnect_s=53, end_s=None,
                 lag=float("inf"), route="", model=None, max_tokens=None, tokens=None, gpu=1e-7),
        _verdict(52, Verdict.UNCONFIRMED, start_s=54, disconnect_s=55, end_s=55.5, lag=0.5,
                 details={"evidence": "http_only", "unconfirmed_because": "raced_its_answer"}),
    ]
    filled.upsert_verdicts(odd)
    with filled.engine.begin() as conn:  # an IPv6 client, and one with no port
        conn.exec_driver_sql("UPDATE verdicts SET client_addr = '::1' WHERE request_key LIKE '%/"
                             + trace(50) + "/%'")
        conn.exec_driver_sql("UPDATE verdicts SET client_port = NULL WHERE request_key LIKE '%/"
                             + trace(51) + "/%'")
    fast = build_report(filled, HOUR, requests_as_json=True)
    slow = build_report(filled, HOUR)
    assert fast.requests_json is not None and len(fast.requests_json) == 8 and fast.requests == []
    parsed = [json.loads(text) for text in fast.requests_json]
    assert parsed == [request_dict(f) for f in slow.requests]
    assert parsed == [json.loads(request_json(f)) for f in slow.requests]
    by_trace = {p["trace_id"]: p for p in parsed}
    assert by_trace[trace(50)]["client"] == "[::1]:40050"
    assert by_trace[trace(50)]["disconnect_at"] == "2026-11-22T04:00:51.000000001Z"
    assert by_trace[trace(51)]["client"] == "10.0.0.7" and by_trace[trace(51)]["lag_seconds"] is None
    # Why each was judged so; why nothing told only for an unconfirmed one.
    assert [by_trace[trace(n)]["evidence"] for n in (50, 51, 52)] == ["engine_metrics", None, "http_only"]
    assert [by_trace[trace(n)]["unconfirmed_because"] for n in (50, 51, 52)] == [None, None, "raced_its_answer"]
    for make in (fast, slow):
        out = io.StringIO()
        write_json(make, out)
        validate(json.loads(out.getvalue()))


def test_every_verdict_is_counted_and_shown(store: Store) -> None:
    from auditor.model import Verdict
    from tests.report_data import _verdict

    store.upsert_verdicts([_verdict(20 + i, verdict, start_s=10.0 * i, disconnect_s=10.0 * i + 1, end_s=10.0 * i + 2,
                          lag=1.0, route=CHAT) for i, verdict in enumerate(Verdict)])
    report = build_report(store, HOUR, with_requests=True)
    t = report.totals
    counts = {"completed": t.completed, "aborted": t.aborted, "zombie": t.zombies,
              "inflight_zombie": t.inflight_zombies, "unconfirmed": t.unconfirmed}
    assert set(counts) == {v.value for v in Verdict} and set(counts.values()) == {1}
    [route] = report.breakdowns["route"]
    assert (route.completed, route.aborted, route.zombies, route.inflight_zombies, route.unconfirmed) == (1,) * 5
    validate(report_dict(report))
    table = render_table(report)
    assert "  unconfirmed" in table and max(len(line) for line in table.splitlines()) <= 100


def test_a_window_without_requests_still_shows_what_was_lost(store: Store) -> None:
    """Events lost by the ring buffer and closes with nothing to join, in a window with no request:
    the table and the page used to say only "no requests", as if nothing had happened."""
    from auditor.model import CoverageKind

    store.add_coverage(CoverageKind.LOST_KERNEL_EVENTS, 5000, host="gpu-a", ts_ns=at(60))
    store.add_coverage(CoverageKind.UNJOINED_DISCONNECT, 40, host="gpu-a", ts_ns=at(61))
    report = build_report(store, HOUR, with_series=True)
    assert report.empty and report.has_coverage
    table = render_table(report)
    assert "no requests between" in table
    assert "lost kernel events" in table and "5,000" in table and "findings may be missing" in table
    assert "unjoined disconnects" in table and "40" in table
    page = render_html(report)
    assert "coverage: lost kernel events" in page and "5,000: findings may be missing" in page
    assert "Coverage" not in render_table(build_report(store, ReportQuery(since_ns=at(7200), until_ns=at(9000))))


def test_tokens_nothing_told_are_unknown_not_zero(store: Store) -> None:
    """Zombies judged without an engine span have no token count: the total is unknown, not 0 tokens
    generated for nobody, and a partly known total is a lower bound."""
    from auditor.model import Phase, Verdict
    from tests.report_data import _verdict

    store.upsert_verdicts([_verdict(30 + i, Verdict.ZOMBIE, start_s=100.0 * i, disconnect_s=100.0 * i + 1,
                                    end_s=100.0 * i + 5, lag=4.0, tokens=None, max_tokens=None,
                                    phase=Phase.UNKNOWN) for i in range(3)])
    report = build_report(store, HOUR)
    assert (report.totals.wasted_tokens, report.totals.zombies_without_tokens) == (0, 3)
    table = render_table(report)
    assert any(line.split()[:3] == ["wasted", "tokens", "unknown"] for line in table.splitlines()), table
    assert "no engine span told the tokens of any zombie" in table
    document = report_dict(report)
    validate(document)
    assert document["totals"]["zombies_without_tokens"] == 3
    assert "<b>unknown</b><span>tokens generated for nobody</span>" in render_html(report)
    # The cap is as unknown as the tokens: not counted as requests sent without one.
    assert report.totals.uncapped_disconnects == 0

    store.upsert_verdicts([_verdict(40, Verdict.ZOMBIE, start_s=500, disconnect_s=501, end_s=510, lag=9.0,
                                    tokens=120)])
    partly = build_report(store, HOUR)
    assert (partly.totals.wasted_tokens, partly.totals.zombies_without_tokens) == (120, 3)
    assert "at least: unknown for 3 zombies" in render_table(partly)


def test_gpu_time_is_the_window_up_to_now(filled: Store) -> None:
    """A window that ends in the future has no GPU time there yet: counting it made the waste's
    share of GPU time shrink with every day --until was set ahead."""
    import time

    until = time.time_ns() + 180 * 86400 * 1_000_000_000
    before = time.time_ns()
    t = build_report(filled, ReportQuery(since_ns=T0, until_ns=until)).totals
    after = time.time_ns()
    assert t.gpus == 2
    assert 2 * (before - T0) / 1e9 <= t.gpu_seconds <= 2 * (after - T0) / 1e9


def test_disconnects_beyond_the_window_requests_are_no_share() -> None:
    from auditor.report.model import Totals
    from auditor.report.render_table import disconnects_note

    assert disconnects_note(Totals(requests=4, disconnects=1)).startswith("25.0% of requests")
    note = disconnects_note(Totals(requests=2, disconnects=4))
    assert "%" not in note and "some began before it" in note


def test_html_says_what_its_tables_leave_out_and_dates_the_worst(store: Store) -> None:
    from auditor.model import Verdict
    from tests.report_data import _verdict

    store.upsert_verdicts([_verdict(100 + i, Verdict.ZOMBIE, start_s=10.0 * i, disconnect_s=10.0 * i + 1,
                                    end_s=10.0 * i + 3, lag=2.0, route=f"/v1/route-{i}",
                                    request_id="\x1b[31mred" if i == 0 else None) for i in range(63)])
    page = render_html(build_report(store, HOUR, with_series=True))
    assert "... and 13 more (all of them in --format json or csv)" in page
    assert rfc3339(at(1))[:10] in page.split("Worst zombies</h2>")[1]  # the date, not the time alone
    assert "\x1b" not in page and "\\x1b[31mred" in page


def test_html_shows_how_short_a_zombie_may_have_been_where_later_leavers_may_own_its_work(filled: Store) -> None:
    worst = render_html(build_report(filled, HOUR)).split("Worst zombies</h2>")[1].split("</table>")[0]
    assert worst.count("&ge;") == 1 and "3.0 (&ge; 1.2)</span>" in worst
    assert worst.count("<td>engine_metrics</td>") == 1 and ">told by</th>" in worst  # what decided it


def test_a_lone_point_between_gaps_is_drawn() -> None:
    from auditor.report.svg import Series, time_chart

    chart = time_chart("x", [0, 60_000_000_000, 120_000_000_000], 60_000_000_000,
                       Series("a", [1.0, 2.0, 3.0], "#111111"),
                       Series("b", [None, 0.5, None], "#222222"))
    assert '<circle' in chart and 'fill="#222222"' in chart


def test_wide_characters_keep_the_columns(store: Store) -> None:
    """A route or host in CJK takes two terminal cells a character: counted by len() it pushed
    its row's columns two cells right per character, past the terminal's edge."""
    from auditor.model import Verdict
    from auditor.report.render_table import cells
    from tests.report_data import _verdict

    wide, narrow = "/v1/東京" * 6, "/v1/tokyo-" * 6
    store.upsert_verdicts([_verdict(60 + i, Verdict.ZOMBIE, start_s=10.0 * i, disconnect_s=10.0 * i + 1,
                                    end_s=10.0 * i + 3, lag=2.0, route=route, host="gpu-ü-東京")
                           for i, route in enumerate((wide, narrow))])
    table = render_table(build_report(store, HOUR))
    lines = table.splitlines()
    assert max(cells(line) for line in lines) <= 100, max(lines, key=cells)
    by_route = lines[lines.index("By route") + 2:lines.index("By route") + 4]
    assert len(by_route) == 2 and cells(by_route[0]) == cells(by_route[1]), by_route
    assert "東京" in by_route[0] or "東京" in by_route[1]


def priced(report: Report, gpu_hour: float = 0.0, cpu_hour: float = 0.0, currency: str = "USD") -> Report:
    report.prices = Prices(gpu_hour, cpu_hour, currency)
    return report


def test_prices_turn_the_wasted_time_into_money_in_every_format(store: Store) -> None:
    fill(store)
    fill_timeouts(store, 10, 60.0)
    cpu = _verdict(300, Verdict.ZOMBIE, start_s=100, disconnect_s=101, end_s=111, lag=10.0)
    store.upsert_verdicts([dataclasses.replace(cpu, wasted_cpu_seconds=36.0)])
    report = priced(build_report(store, HOUR), gpu_hour=2.5, cpu_hour=0.1, currency="EUR")
    document = report_dict(report)
    validate(document)
    assert document["pricing"] == {"gpu_hour": 2.5, "cpu_hour": 0.1, "currency": "EUR",
                                   "gpu_hour_by_host": [], "cpu_hour_by_host": [], "unpriced": []}
    totals = document["totals"]
    # 19 GPU-seconds at 2.5 an hour and 36 CPU-seconds at 0.1 an hour.
    assert (totals["wasted_gpu_seconds"], totals["wasted_cpu_seconds"]) == (19.0, 36.0)
    assert totals["wasted_cost"] == pytest.approx(19 * 2.5 / 3600 + 36 * 0.1 / 3600)
    for rows in document["breakdowns"].values():
        assert sum(row["wasted_cost"] for row in rows) == pytest.approx(totals["wasted_cost"])
        for row in rows:
            assert row["wasted_cost"] == pytest.approx(
                (row["wasted_gpu_seconds"] * 2.5 + row["wasted_cpu_seconds"] * 0.1) / 3600)
    [timeout] = document["client_timeouts"]
    assert timeout["wasted_cost"] == pytest.approx(5.0 * 2.5 / 3600)  # five zombies of 1 GPU-s
    table = render_table(report)
    assert re.search(r"wasted cost +0\.014 EUR +at 2\.5 EUR a GPU-hour and 0\.1 EUR a CPU core-hour\n", table)
    assert "the work past its disconnects cost 0.0035 EUR" in table
    assert render_table(report, width=80).count("wasted cost") == 1
    page = render_html(report)
    assert '<b>0.014 EUR</b><span>wasted, at 2.5 EUR a GPU-hour and 0.1 EUR a CPU core-hour</span>' in page
    # A cost column in each breakdown's table and the timeouts' table.
    assert page.count("<th>cost, EUR</th>") == sum(1 for rows in report.breakdowns.values() if rows) + 1


def test_an_unpriced_report_shows_seconds_only(filled: Store) -> None:
    report = build_report(filled, HOUR)
    document = report_dict(report)
    validate(document)
    assert document["pricing"] is None and document["totals"]["wasted_cost"] is None
    assert all(row["wasted_cost"] is None for rows in document["breakdowns"].values() for row in rows)
    assert "wasted cost" not in render_table(report)
    page = render_html(report)
    assert "cost," not in page and "wasted cost" not in page


def test_a_kind_of_wasted_time_without_a_price_is_said_to_be_left_out(filled: Store) -> None:
    cpu = _verdict(300, Verdict.ZOMBIE, start_s=100, disconnect_s=101, end_s=111, lag=10.0)
    filled.upsert_verdicts([dataclasses.replace(cpu, wasted_cpu_seconds=36.0)])
    report = priced(build_report(filled, HOUR), gpu_hour=3.6)
    document = report_dict(report)
    validate(document)
    assert document["pricing"] == {"gpu_hour": 3.6, "cpu_hour": None, "currency": "USD",
                                   "gpu_hour_by_host": [], "cpu_hour_by_host": [],
                                   "unpriced": [{"host": "gpu-a", "kind": "cpu"}]}
    assert document["totals"]["wasted_cost"] == pytest.approx(14.0 * 3.6 / 3600)  # the CPU time adds nothing
    table = render_table(report)
    assert re.search(r"wasted cost +0\.014 USD +at 3\.6 USD a GPU-hour; CPU time not priced\n", table)
    assert "(report.cpu_hour_price)" in table


@pytest.mark.parametrize(("value", "shown"), [(0.0, "0.00"), (0.004249, "0.0042"), (0.99, "0.99"),
                                               (0.996, "1.00"), (1234.5, "1,234.50")])
def test_money_is_to_the_cent_and_two_digits_below_one(value: float, shown: str) -> None:
    assert money(value, "USD") == f"{shown} USD" and money(value) == shown


def test_the_requests_read_beside_the_rest_give_the_same_report(filled: Store) -> None:
    """The count of requests and the per-request list come from a second connection, in a thread;
    read on the one connection they give the same report, in every shape."""
    for shape in ({}, {"with_series": True}, {"requests_as_json": True}, {"with_requests": False}):
        beside, alone = (build_report(filled, HOUR, concurrent=c, **shape) for c in (True, False))  # type: ignore[arg-type]
        alone.generated_ns = beside.generated_ns
        assert report_dict(beside) == report_dict(alone), shape
        assert beside.requests_json == alone.requests_json and beside.series == alone.series
    assert build_report(filled, HOUR, requests_as_json=True).requests_json is not None


def test_a_store_in_memory_is_read_on_its_one_connection() -> None:
    """SQLite in memory is a database per connection: a second one would read an empty store."""
    memory = Store("sqlite://")
    try:
        fill(memory)
        assert not memory.shared_by_connections
        report = build_report(memory, HOUR)
        assert report.totals.requests == 12 and len(report.requests) == report.totals.disconnects == 5
    finally:
        memory.close()


def test_a_failure_on_the_second_connection_is_the_reports_error(filled: Store) -> None:
    from auditor.errors import StoreError

    with filled.engine.begin() as conn:  # the request count's table alone, read on the second connection
        conn.exec_driver_sql("ALTER TABLE spans RENAME TO spans_elsewhere")
    for concurrent in (True, False):
        with pytest.raises(StoreError, match=r"reading the report from .* failed: no such table: spans"):
            build_report(filled, HOUR, concurrent=concurrent)


@pytest.mark.parametrize("window_s", [(600, 840), (0, 3600), (1090, 1210), (-7200, 60)])
def test_a_narrow_window_read_through_the_time_indexes_gives_the_same_report(
        filled: Store, window_s: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A window over a small share of the store (``INDEXED_SHARE``) counts its requests by minute
    and names the hosts that sent samples, so that both are read through indexes: the figures are
    those of the plain scans."""
    from auditor.report import query as report_query

    query = ReportQuery(since_ns=at(window_s[0]), until_ns=at(window_s[1]))
    shown = []
    for share in (2.0, 0.0):  # every window read through the indexes, then none
        monkeypatch.setattr(report_query, "INDEXED_SHARE", share)
        report = build_report(filled, query, with_series=True)
        report.generated_ns = 0
        shown.append(report_dict(report))
    assert shown[0] == shown[1]
    assert shown[0]["totals"]["requests"] == {(600, 840): 2, (0, 3600): 12, (1090, 1210): 2, (-7200, 60): 1}[window_s]


def test_the_share_of_the_store_a_window_covers_is_by_minute(filled: Store) -> None:
    from auditor.report.query import _held_share

    minute = 60 * S
    with filled.engine.connect() as conn:  # the spans held start from an hour before T0 to minute 20
        first, last = (int(v) for v in conn.exec_driver_sql(
            "SELECT min(start_minute), max(start_minute) FROM spans").one())
        assert (first, last) == (T0 // minute - 60, T0 // minute + 20)
        assert _held_share(conn, ReportQuery(since_ns=at(-7200), until_ns=at(3600))) == 1.0
        assert _held_share(conn, ReportQuery(since_ns=at(-7200), until_ns=at(-3660))) == 0.0
        assert _held_share(conn, ReportQuery(since_ns=at(0), until_ns=at(3600))) == 21 / 81
        assert _held_share(conn, ReportQuery(since_ns=at(600), until_ns=at(720))) == 2 / 81
    empty = Store("sqlite://")
    with empty.engine.connect() as conn:
        assert _held_share(conn, HOUR) == 1.0
    empty.close()


def test_hosts_priced_apart_cost_each_hosts_time_at_its_price(store: Store) -> None:
    """A fleet of GPU kinds in one report: each sum's cost is its hosts' wasted seconds, each at the
    price of the first pattern its name matches; the rest at the price for hosts none names."""
    fill(store)
    fill_timeouts(store, 10, 60.0)  # five zombies of 1 GPU-s each on gpu-a
    fill_timeouts(store, 4, 60.0, first=200, from_s=1510.0, host="gpu-b")  # two on gpu-b
    prices = Prices(gpu_hour=1.0, currency="EUR", gpu_hour_by_host=(("gpu-b", 9.0), ("gpu-*", 3.0)))
    report = build_report(store, HOUR)
    report.prices = prices
    document = report_dict(report)
    validate(document)
    assert document["pricing"]["gpu_hour_by_host"] == [{"hosts": "gpu-b", "price": 9.0},
                                                       {"hosts": "gpu-*", "price": 3.0}]
    hosts = {row["key"]: row["wasted_gpu_seconds"] for row in document["breakdowns"]["host"]}
    assert set(hosts) == {"gpu-a", "gpu-b"} and all(hosts.values())
    want = (hosts["gpu-a"] * 3.0 + hosts["gpu-b"] * 9.0) / 3600
    assert document["totals"]["wasted_cost"] == pytest.approx(want)
    for dimension, rows in document["breakdowns"].items():  # every breakdown splits the same cost
        assert sum(row["wasted_cost"] for row in rows) == pytest.approx(want), dimension
    for row in document["breakdowns"]["host"]:
        assert row["wasted_cost"] == pytest.approx(row["wasted_gpu_seconds"] * {"gpu-a": 3.0, "gpu-b": 9.0}[row["key"]]
                                                   / 3600)
    [timeout] = document["client_timeouts"]
    assert timeout["wasted_cost"] == pytest.approx((5 * 3.0 + 2 * 9.0) / 3600)
    assert sum(gpu for _, gpu, _ in report.client_timeouts[0].waste_by_host) == pytest.approx(7.0)
    table = render_table(report)
    assert "at 9 EUR a GPU-hour on gpu-b, 3 on gpu-*, 1 elsewhere\n" in table
    # A host no pattern names, with no price for the rest: its time is said to be left out.
    report.prices = Prices(gpu_hour_by_host=(("gpu-a", 3.0),))
    assert report_dict(report)["totals"]["wasted_cost"] == pytest.approx(hosts["gpu-a"] * 3.0 / 3600)
    assert "at 3 USD a GPU-hour on gpu-a; GPU time of gpu-b not priced (report.gpu_hour_prices)" in " ".join(
        render_table(report).split())
    assert report_dict(report)["pricing"]["unpriced"] == [{"host": "gpu-b", "kind": "gpu"}]
    page = render_html(report)
    assert "GPU time of gpu-b not priced" in page
