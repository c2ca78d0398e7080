"""The daemon's /metrics without prometheus_client (auditor.promtext), checked against it: the same
text byte for byte, the same process_* families, and a server that answers as its server does
(gzip, ``name[]``, HEAD) and refuses what it does not serve."""

from __future__ import annotations

import gzip
import http.client
import math
import os
import socket
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import ProcessCollector as LibraryProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from auditor.metrics import DaemonMetrics, SourceReadings
from auditor.model import RequestVerdict, Verdict
from auditor.promtext import (
    CounterFamily,
    GaugeFamily,
    MetricsServer,
    ProcessCollector,
    Registry,
    float_text,
)


def busy_metrics() -> DaemonMetrics:
    """Every kind of family the daemon serves, with values, labels and text that need escaping."""
    readings = SourceReadings(source="bpf", spans_received=12_345_678, store_write_errors={"spans": 2},
                              live_notices={"accepted": 3}, probe_runs={"sock:inet_sock_set_state": (10**9, 7)},
                              probe_run_stats=True, correlation_cpu={"judge": 0.125, "spans": 1e-7})
    metrics = DaemonMetrics(lambda: readings)
    for index, (route, lag) in enumerate((("/v1/completions", 3.0), ('/odd"route\\\n', 0.2), ("/v1/chat", 4000.0))):
        metrics.settled(RequestVerdict(request_key=f"h/t/{index}", host="h", verdict=Verdict.ZOMBIE,
                                       disconnect_at_ns=1, disconnect_kind="fin", request_start_ns=0, work_end_ns=4,
                                       lag_seconds=lag, route=route, model="m", wasted_gpu_seconds=1.5 * index))
    metrics.settled(RequestVerdict(request_key="h/t/x", host="h", verdict=Verdict.ABORTED, disconnect_at_ns=1,
                                   disconnect_kind="rst", request_start_ns=0, work_end_ns=4, lag_seconds=None))
    metrics.disconnect("fin", 3)
    metrics.completed(42)
    metrics.set_utilization({"gpu0": 0.75})
    metrics.correlation_round(0.0321, failed=False)
    metrics.correlation_round(12.5, failed=True)
    return metrics


class _AsLibrary:
    """Our families handed to prometheus_client as its own Metric objects, for its generate_latest."""

    def __init__(self, families: list) -> None:  # type: ignore[type-arg]
        self.families = families

    def collect(self):  # type: ignore[no-untyped-def]
        for family in self.families:
            metric = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                metric.add_sample(sample.name, sample.labels, sample.value)
            yield metric


def test_the_text_equals_prometheus_clients_byte_for_byte() -> None:
    metrics = busy_metrics()
    families = [family for family in metrics.registry.collect() if not family.name.startswith("process_")]
    ours = Registry()
    ours.register(_AsList(families))
    library = CollectorRegistry()
    library.register(_AsLibrary(families))
    text = ours.exposition()
    assert text == generate_latest(library)
    # And it parses back to the values that went in.
    parsed = {sample.name: sample for family in text_string_to_metric_families(text.decode())
              for sample in family.samples if not sample.labels}
    assert parsed["auditor_spans_received_total"].value == 12_345_678
    assert parsed["auditor_correlation_tick_seconds_count"].value == 2
    assert b'route="/odd\\"route\\\\\\n"' in text


class _AsList:
    def __init__(self, families: list) -> None:  # type: ignore[type-arg]
        self.families = families

    def collect(self):  # type: ignore[no-untyped-def]
        return iter(self.families)


@pytest.mark.parametrize("value", [0, 1, -1, 0.5, 1e-7, 123456.0, 1234567.0, 1e6, 5e15, 1e16, 1e22, 12_345_678,
                                   -1e22, math.inf, -math.inf, math.nan, 0.1 + 0.2, 2**53])
def test_numbers_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert float_text(value) == floatToGoString(value)


def test_process_families_are_the_libraries() -> None:
    ours = {family.name: family for family in ProcessCollector().collect()}
    theirs = {metric.name: metric for metric in LibraryProcessCollector(registry=None).collect()}
    assert set(ours) == {"process_virtual_memory_bytes", "process_resident_memory_bytes",
                         "process_start_time_seconds", "process_cpu_seconds", "process_open_fds", "process_max_fds"}
    assert set(ours) == set(theirs)
    for name, family in ours.items():
        assert (family.type, family.documentation) == (theirs[name].type, theirs[name].documentation), name
        ((_, _, value),) = family.samples
        other = theirs[name].samples[0].value
        if name in ("process_start_time_seconds", "process_max_fds"):
            assert value == other, name
        elif name == "process_cpu_seconds":
            assert -1e-9 <= other - value <= 0.5  # read a moment earlier, in clock ticks (summed apart there)
        else:  # memory and files move between the two reads, a little
            assert abs(value - other) <= max(8 << 20, other * 0.1), (name, value, other)
    assert ours["process_open_fds"].samples[0].value == pytest.approx(len(os.listdir("/proc/self/fd")), abs=4)


def test_a_family_given_a_value_takes_no_labels() -> None:
    assert CounterFamily("x_total", "x", value=2).samples[0].name == "x_total"
    with pytest.raises(ValueError, match="labels"):
        GaugeFamily("g", "g", value=1, labels=["a"])


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    served = MetricsServer(busy_metrics().registry, "127.0.0.1", 0)
    yield served
    served.stop()


def get(server: MetricsServer, path: str, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_the_server_answers_as_prometheus_clients_does(server: MetricsServer) -> None:
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"auditor_build_info" in body and b"process_resident_memory_bytes" in body
    assert int(headers["content-length"]) == len(body)
    # gzip where the scraper accepts it, as Prometheus does.
    status, headers, packed = get(server, "/metrics", headers={"Accept-Encoding": "gzip"})
    assert headers["content-encoding"] == "gzip" and b"auditor_build_info" in gzip.decompress(packed)
    # Only the named series (the form vLLM's and SGLang's servers answer too).
    status, _, body = get(server, "/metrics?name[]=auditor_spans_received_total&name[]=auditor_disconnects_total")
    names = {sample.name for family in text_string_to_metric_families(body.decode()) for sample in family.samples}
    assert status == 200 and names == {"auditor_spans_received_total", "auditor_disconnects_total"}
    status, headers, body = get(server, "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 1000
    assert get(server, "/")[0] == 200
    status, _, body = get(server, "/favicon.ico")
    assert status == 404 and b"/metrics" in body
    assert get(server, "/metrics", method="POST")[0] == 501


def exchange(host: str, port: int, data: bytes) -> bytes:
    """Send raw bytes; everything answered until the server closes."""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_two_scrapes_on_one_connection_and_garbage_after(server: MetricsServer) -> None:
    answer = exchange("127.0.0.1", server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                      b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01 garbage\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 OK") == 2 and b"HTTP/1.1 400 Bad Request" in answer, answer[-300:]
    assert get(server, "/metrics")[0] == 200  # still up


def test_an_ipv6_address_is_served() -> None:
    served = MetricsServer(busy_metrics().registry, "::1", 0)
    try:
        answer = exchange("::1", served.port, b"GET /metrics HTTP/1.0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 OK") and b"auditor_build_info" in answer
    finally:
        served.stop()
