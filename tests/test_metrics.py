"""The daemon's Prometheus metrics without a daemon: completions, label bounds."""

from __future__ import annotations

import urllib.error
import urllib.request
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from auditor import __version__
from auditor.correlate.roundcpu import STEPS, RoundCpu
from auditor.metrics import MAX_LABEL_VALUES, DaemonMetrics, SourceReadings
from auditor.model import RequestVerdict, Verdict
from auditor.promtext import MetricsServer
from auditor.upkeep import completed_requests


def span(role: str, http_status: int | None = None, finish_reason: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(role=role, http_status=http_status, finish_reason=finish_reason)


def test_completions_come_from_engine_spans_once_an_engine_reports() -> None:
    # A cancelled stream ends its HTTP span "200 OK": only the engine knows it did not finish.
    rows = [span("http_server", 200), span("http_server", 200), span("engine", finish_reason="stop"),
            span("engine", finish_reason="abort"), span("engine", finish_reason="length")]
    assert completed_requests(rows, engine_spans_seen=False) == (2, True)
    # A later round with HTTP spans only still counts engine spans (none yet): no double counting.
    assert completed_requests([span("http_server", 200)], engine_spans_seen=True) == (0, True)


def test_completions_fall_back_to_http_spans_without_an_engine() -> None:
    rows = [span("http_server", 200), span("http_server", 499), span("http_server", None), span("other")]
    assert completed_requests(rows, engine_spans_seen=False) == (1, False)


def test_completed_rate_is_over_the_last_minute() -> None:
    now = [1000.0]
    metrics = DaemonMetrics(clock=lambda: now[0])
    metrics.completed(120)
    assert metrics.registry.get_sample_value("auditor_completed_requests_per_second") == 2.0
    now[0] = 1061.0  # the first 120 are older than a minute
    metrics.completed(30)
    assert metrics.registry.get_sample_value("auditor_completed_requests_per_second") == 0.5
    assert metrics.registry.get_sample_value("auditor_completed_requests_total") == 150


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_sources_are_read_when_prometheus_scrapes() -> None:
    # Nothing is pushed: what a scrape shows is what the parts hold at that moment.
    readings = SourceReadings(source="procfs", spans_received=7, store_write_errors={"spans": 0})
    metrics = DaemonMetrics(lambda: readings)
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    try:
        first = scrape(server.port)
        assert first["auditor_spans_received_total"] == {(): 7}
        assert "auditor_live_notices_total" not in first  # no live receiver
        assert first["auditor_build_info"] == {(("version", __version__),): 1}
        assert first["auditor_disconnect_source_info"] == {(("source", "procfs"),): 1}
        assert "auditor_probe_loader_info" not in first  # no eBPF probe
        assert not [name for name in first if name.endswith("_created")]
        readings.spans_received, readings.inflight_zombies, readings.store_write_errors["spans"] = 9, 2, 1
        readings.source, readings.probe_loader = "bpf", "prebuilt"
        readings.live_notices = {"accepted": 5, "rejected": 1, "dropped": 0}
        metrics.settled(RequestVerdict(request_key="h/t/s", host="h", verdict=Verdict.ZOMBIE, disconnect_at_ns=1, disconnect_kind="fin",
                                       request_start_ns=0, work_end_ns=4,
                                       lag_seconds=3.0, route="/v1/completions", model="m", wasted_gpu_seconds=1.5))
        second = scrape(server.port)
        assert second["auditor_spans_received_total"] == {(): 9}
        assert second["auditor_inflight_zombies"] == {(): 2}
        assert second["auditor_probe_loader_info"] == {(("loader", "prebuilt"),): 1}
        assert second["auditor_live_notices_total"] == {
            (("result", "accepted"),): 5, (("result", "rejected"),): 1, (("result", "dropped"),): 0}
        assert second["auditor_store_write_errors_total"] == {(("writer", "spans"),): 1}
        # Every verdict's series of the route and model, at 0 until one comes: the first zombie
        # after a completed request is one that increase() sees.
        assert second["auditor_disconnect_verdicts_total"] == {
            (("model", "m"), ("route", "/v1/completions"), ("verdict", kind.value)): int(kind is Verdict.ZOMBIE)
            for kind in Verdict}
        assert second["auditor_wasted_gpu_seconds_total"] == {(): 1.5}
        assert second["auditor_zombies_uncosted_total"] == {(): 0}
        metrics.settled(RequestVerdict(request_key="h/t/u", host="h", verdict=Verdict.ZOMBIE, disconnect_at_ns=1,
                                       disconnect_kind="fin", request_start_ns=0, work_end_ns=4, lag_seconds=3.0,
                                       route="/v1/completions", model="m",
                                       details={"cost_unmeasured": "2 GPUs here, and NVML lists neither ..."}))
        assert scrape(server.port)["auditor_zombies_uncosted_total"] == {(): 1}
        buckets = second["auditor_zombie_duration_seconds_bucket"]
        assert buckets[(("le", "2.0"), ("model", "m"), ("route", "/v1/completions"))] == 0
        assert buckets[(("le", "5.0"), ("model", "m"), ("route", "/v1/completions"))] == 1
    finally:
        server.stop()


def test_unconfirmed_verdicts_show_by_why() -> None:
    """Each reason's series from the start, at 0; a verdict that names none counts as other."""
    metrics = DaemonMetrics(lambda: SourceReadings(source="bpf"))
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    try:
        assert scrape(server.port)["auditor_unconfirmed_verdicts_total"] == {
            (("because", because),): 0 for because in ("raced_its_answer", "gauges_cannot_tell", "no_gauges")}
        for n, details in enumerate(({"unconfirmed_because": "raced_its_answer"},
                                     {"unconfirmed_because": "raced_its_answer"},
                                     {"unconfirmed_because": "no_gauges"}, {})):
            metrics.settled(RequestVerdict(request_key=f"h/t/{n}", host="h", verdict=Verdict.UNCONFIRMED,
                                           disconnect_at_ns=1, disconnect_kind="fin", request_start_ns=0,
                                           work_end_ns=None, lag_seconds=None, route="/v1/completions", model="m",
                                           details=details))
        metrics.settled(RequestVerdict(request_key="h/t/z", host="h", verdict=Verdict.ABORTED, disconnect_at_ns=1,
                                       disconnect_kind="fin", request_start_ns=0, work_end_ns=2, lag_seconds=0.0,
                                       route="/v1/completions", model="m",
                                       details={"unconfirmed_because": "no_gauges"}))  # not unconfirmed: not counted
        assert scrape(server.port)["auditor_unconfirmed_verdicts_total"] == {
            (("because", "raced_its_answer"),): 2, (("because", "gauges_cannot_tell"),): 0,
            (("because", "no_gauges"),): 1, (("because", "other"),): 1}
    finally:
        server.stop()


def test_the_probes_kernel_time_shows_with_the_ebpf_source_only() -> None:
    readings = SourceReadings(source="procfs")
    metrics = DaemonMetrics(lambda: readings)
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    try:
        assert not [name for name in scrape(server.port) if name.startswith("auditor_probe_")]
        readings.source, readings.probe_run_stats = "bpf", False
        readings.probe_runs = {"sock:inet_sock_set_state": (2_500_000_000, 40), "tcp:tcp_receive_reset": (0, 0)}
        shown = scrape(server.port)
        assert shown["auditor_probe_kernel_seconds_total"] == {
            (("tracepoint", "sock:inet_sock_set_state"),): 2.5, (("tracepoint", "tcp:tcp_receive_reset"),): 0}
        assert shown["auditor_probe_runs_total"][(("tracepoint", "sock:inet_sock_set_state"),)] == 40
        assert shown["auditor_probe_run_stats_enabled"] == {(): 0}
        readings.probe_run_stats = None  # the sysctl unreadable: no claim either way
        assert "auditor_probe_run_stats_enabled" not in scrape(server.port)
    finally:
        server.stop()


def test_the_engines_scrapes_show_by_port_and_outcome() -> None:
    readings = SourceReadings()
    metrics = DaemonMetrics(lambda: readings)
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    try:
        first = scrape(server.port)
        assert "auditor_engine_scrapes_total" not in first and "auditor_engine_servers_left_out" not in first
        readings.engine_scrapes = {(8000, "read"): 40, (8000, "failed"): 2, (9000, "no_engine"): 3}
        readings.engine_servers_left_out = {8000: 1}
        shown = scrape(server.port)
        assert shown["auditor_engine_scrapes_total"] == {
            (("outcome", "read"), ("port", "8000")): 40, (("outcome", "failed"), ("port", "8000")): 2,
            (("outcome", "no_engine"), ("port", "9000")): 3}
        assert shown["auditor_engine_servers_left_out"] == {(("port", "8000"),): 1}
    finally:
        server.stop()


def test_the_correlators_cpu_shows_by_step() -> None:
    readings = SourceReadings()
    metrics = DaemonMetrics(lambda: readings)
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    try:
        assert "auditor_correlation_cpu_seconds_total" not in scrape(server.port)  # no correlator yet
        cpu = RoundCpu()
        cpu.ns["judge"], cpu.ns["spans"] = 1_500_000_000, 250_000_000
        readings.correlation_cpu = cpu.seconds()
        shown = scrape(server.port)["auditor_correlation_cpu_seconds_total"]
        assert shown[(("step", "judge"),)] == 1.5 and shown[(("step", "spans"),)] == 0.25
        assert {dict(labels)["step"] for labels in shown} == set(STEPS)
    finally:
        server.stop()


def test_label_values_are_bounded() -> None:
    metrics = DaemonMetrics()
    labels = [metrics._label("route", f"/r{i}") for i in range(MAX_LABEL_VALUES + 5)]
    assert labels[:MAX_LABEL_VALUES] == [f"/r{i}" for i in range(MAX_LABEL_VALUES)]
    assert set(labels[MAX_LABEL_VALUES:]) == {"other"}
    assert metrics._label("route", None) == "other"  # "unknown" is new too, and there is no room
    assert metrics._label("route", "/r0") == "/r0"


def test_idle_connections_do_not_lock_out_the_scraper() -> None:
    """Eight silent connections (a port scan, kept-alive connections between scrapes) took every
    slot for 15 s: each scrape was answered 503, which reads as the daemon being down."""
    import socket
    import time

    from auditor.promtext import IDLE_TIMEOUT_S

    metrics = DaemonMetrics()
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    started = time.monotonic()  # the server's timer starts at accept, never before this
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        time.sleep(0.2)  # each holds a slot now
        assert "auditor_build_info" in scrape(server.port)
        # A silent connection is closed after the idle timeout: its slot comes back.
        idle[0].settimeout(IDLE_TIMEOUT_S + 5)
        assert idle[0].recv(1) == b""
        assert IDLE_TIMEOUT_S - 0.5 <= time.monotonic() - started <= IDLE_TIMEOUT_S + 1.5
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_gzip_only_where_the_scraper_takes_it() -> None:
    from auditor.promtext import accepts_gzip

    assert accepts_gzip("gzip") and accepts_gzip("deflate, gzip;q=0.5") and accepts_gzip("*")
    assert not accepts_gzip("gzip;q=0, identity") and not accepts_gzip("identity") and not accepts_gzip("")
    assert not accepts_gzip("gzip;q=nope")


def test_this_hosts_prices_are_exported_where_set() -> None:
    """``auditor_hour_price``: the [report] prices the daemon runs with, a priced kind each, so a
    dashboard prices each host's wasted seconds at its own; an unpriced kind is absent, not 0
    (a free hour would read as a real cost of nothing)."""
    for prices, want in (({"gpu_hour_price": 2.4, "currency": "EUR"}, {(("currency", "EUR"), ("kind", "gpu")): 2.4}),
                         ({"gpu_hour_price": 2.4, "cpu_hour_price": 0.05},
                          {(("currency", "USD"), ("kind", "gpu")): 2.4, (("currency", "USD"), ("kind", "cpu")): 0.05}),
                         ({}, {})):
        metrics = DaemonMetrics(**prices)  # type: ignore[arg-type]
        server = MetricsServer(metrics.registry, "127.0.0.1", 0)
        try:
            assert scrape(server.port).get("auditor_hour_price", {}) == want, prices
        finally:
            server.stop()


def test_a_daemon_exports_the_price_its_host_name_matches() -> None:
    """One configuration file for a fleet: each daemon exports the price of the first pattern its
    host matches (auditor_hour_price), the price of the rest where none does."""
    from auditor.config import apply_overrides, load_config
    from auditor.daemon import Daemon

    for host, want in (("gpu-h100-3", {"gpu": 2.49, "cpu": 0.05}), ("gpu-l4-1", {"gpu": 0.8, "cpu": 0.05}),
                       ("cpu-9", {"gpu": 1.0, "cpu": 0.05})):
        config = apply_overrides(load_config(environ={}), {
            "host_id": host, "report.gpu_hour_price": 1.0, "report.cpu_hour_price": 0.05,
            "report.gpu_hour_prices": {"gpu-h100-*": 2.49, "gpu-l4-*": 0.8}})
        assert Daemon(config).metrics.hour_prices == want, host
