"""Final verdicts as OTLP log records over real OTLP/HTTP, and one journal line per zombie."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from auditor.config import load_config
from auditor.errors import ConfigError
from auditor.findings import FindingsExporter
from auditor.model import RequestVerdict, Verdict

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class LogsReceiver(ThreadingHTTPServer):
    """A tiny OTLP/HTTP logs endpoint on loopback that keeps every record it is sent."""

    def __init__(self) -> None:
        self.records: list[LogRecord] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: LogsReceiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportLogsServiceRequest.FromString(body)
        with self.server.lock:
            self.server.paths.append(self.path)
            for resource_logs in request.resource_logs:
                for scope_logs in resource_logs.scope_logs:
                    self.server.records.extend(scope_logs.log_records)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[LogsReceiver]:
    server = LogsReceiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def verdict(kind: Verdict, request_id: str, lag: float | None) -> RequestVerdict:
    return RequestVerdict(f"gpu-a/{TRACE}/{SPAN}", "gpu-a", kind, 1_000, "rst", 500, 4_000, lag, trace_id=TRACE,
                          request_id=request_id, route="/v1/completions", model="ref-llm-1b",
                          tokens_after_disconnect=42, tokens_exact=True, wasted_gpu_seconds=1.25,
                          user_agent="OpenAI/Python 1.54.0" if kind is Verdict.ZOMBIE else None)


def attributes(record: LogRecord) -> dict[str, object]:
    values = {}
    for kv in record.attributes:
        kind = kv.value.WhichOneof("value")
        values[kv.key] = getattr(kv.value, kind) if kind else None
    return values


def test_every_final_verdict_reaches_the_collector_on_its_trace(receiver: LogsReceiver,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    exporter = FindingsExporter(f"http://127.0.0.1:{receiver.server_port}/v1/logs")
    with caplog.at_level(logging.WARNING, logger="auditor.findings"):
        exporter.settled(verdict(Verdict.ZOMBIE, "req-zombie", 3.5))
        exporter.settled(verdict(Verdict.ABORTED, "req-aborted", 0.1))
    exporter.shutdown()  # flushes the batch
    assert receiver.paths == ["/v1/logs"]
    by_request = {attributes(r)["http.request.header.x-request-id"]: r for r in receiver.records}
    assert set(by_request) == {"req-zombie", "req-aborted"}
    zombie = by_request["req-zombie"]
    assert zombie.trace_id.hex() == TRACE and zombie.span_id.hex() == SPAN
    assert zombie.severity_text == "WARN" and zombie.time_unix_nano == 4_000
    found = attributes(zombie)
    assert found["auditor.verdict"] == "zombie" and found["auditor.lag_seconds"] == 3.5
    assert found["auditor.wasted_gpu_seconds"] == 1.25 and found["auditor.tokens_after_disconnect"] == 42
    assert found["user_agent.original"] == "OpenAI/Python 1.54.0"
    assert attributes(by_request["req-aborted"])["auditor.verdict"] == "aborted"
    assert "user_agent.original" not in attributes(by_request["req-aborted"])  # none is named, none is sent
    # The journal: one line per zombie, none for the abort.
    lines = [r.getMessage() for r in caplog.records if r.name == "auditor.findings"]
    assert len(lines) == 1
    assert "req-zombie" in lines[0] and TRACE in lines[0] and "3.50 s" in lines[0] and "1.25 GPU-s" in lines[0]


def test_without_an_endpoint_only_the_journal_hears(caplog: pytest.LogCaptureFixture) -> None:
    exporter = FindingsExporter("")
    with caplog.at_level(logging.WARNING, logger="auditor.findings"):
        exporter.settled(verdict(Verdict.ZOMBIE, "req-1", None))
    exporter.shutdown()
    assert [r.levelno for r in caplog.records if r.name == "auditor.findings"] == [logging.WARNING]
    assert "work went on unknown" in caplog.records[-1].getMessage()


def test_a_bad_endpoint_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match=r"export\.otlp_logs_endpoint = 'collector:4318'"):
        load_config(environ={"AUDITOR_EXPORT_OTLP_LOGS_ENDPOINT": "collector:4318"})
