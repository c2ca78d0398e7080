"""Metrics and logs on the OTLP receivers: a server pointed at the generic
``OTEL_EXPORTER_OTLP_ENDPOINT`` exports all three signals. The real SDK exporters, configured only by
that variable, must see success for metrics and logs (dropped and counted) while spans are stored."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    InMemoryLogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text

from auditor.store import Store
from collectors.otlp_grpc import OtlpGrpcReceiver
from collectors.otlp_http import OtlpHttpReceiver
from collectors.spanwriter import SpanWriter

RESOURCE = Resource.create({"service.name": "vllm"})
TOKEN = {"authorization": "Bearer s3cret"}


def finished_spans() -> list[Any]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=RESOURCE)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span("llm_request"):
        pass
    return list(memory.get_finished_spans())


def metrics_data() -> Any:
    """Two instruments, three data points (a counter with two attribute sets, a histogram)."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(resource=RESOURCE, metric_readers=[reader]).get_meter("t")
    counter = meter.create_counter("vllm.generation_tokens")
    counter.add(5, {"model": "a"})
    counter.add(7, {"model": "b"})
    meter.create_histogram("vllm.e2e_request_latency").record(0.5)
    return reader.get_metrics_data()


def log_records() -> list[Any]:
    memory = InMemoryLogRecordExporter()
    provider = LoggerProvider(resource=RESOURCE)
    provider.add_log_record_processor(SimpleLogRecordProcessor(memory))
    logger = provider.get_logger("t")
    for i in range(4):
        logger.emit(body=f"request {i} finished", attributes={"n": i})
    return list(memory.get_finished_logs())


def stored_span_names(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return [r[0] for r in conn.execute(text("SELECT name FROM spans"))]


def test_http_generic_endpoint_takes_all_three_signals(writer: SpanWriter, store: Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpHttpReceiver(writer, port=0, token="s3cret").start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer s3cret")
        exporters = HttpSpanExporter(timeout=10), HttpMetricExporter(timeout=10), HttpLogExporter(timeout=10)
        assert exporters[0].export(finished_spans()) is SpanExportResult.SUCCESS
        assert exporters[1].export(metrics_data()) is MetricExportResult.SUCCESS
        assert exporters[2].export(log_records()) is LogRecordExportResult.SUCCESS
        for exporter in exporters:
            exporter.shutdown()
        assert stored_span_names(store) == ["llm_request"]
        stats = receiver.stats()
        assert stats["dropped_requests"] == {"metrics": 1, "logs": 1}
        assert stats["dropped_items"] == {"metrics": 3, "logs": 4}
        assert stats["requests_by_status"] == {200: 3}
    finally:
        receiver.stop()


def post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/v1/metrics", "/v1/logs"])
def test_http_dropped_signals_keep_the_same_checks(path: str, writer: SpanWriter) -> None:
    receiver = OtlpHttpReceiver(writer, port=0, token="s3cret", max_body_bytes=1000).start()
    pb = {"Content-Type": "application/x-protobuf", "Authorization": "Bearer s3cret"}
    js = pb | {"Content-Type": "application/json"}
    try:
        assert post(receiver.port, path, b"", pb | {"Authorization": "Bearer nope"})[0] == 401
        assert post(receiver.port, path, b"x", pb | {"Content-Type": "text/plain"})[0] == 415
        assert post(receiver.port, path, b"x" * 1001, pb)[0] == 413
        status, body = post(receiver.port, path, b"\xff\xff\xff\x0fnot protobuf", pb)
        assert status == 400 and "is not a valid Export" in status_pb2.Status.FromString(body).message
        status, body = post(receiver.port, path, b"[1]", js)
        assert status == 400 and "must be an object" in json.loads(body)["message"]
        # OTLP JSON with hex ids (exemplars, log records) is accepted as it is.
        document = {"resourceLogs": [{"scopeLogs": [{"logRecords": [
            {"body": {"stringValue": "hi"}, "traceId": "5b8efff798038103d269b633813fc60c",
             "spanId": "eee19b7ec3c1b174"}]}]}]} if path == "/v1/logs" else {"resourceMetrics": []}
        status, body = post(receiver.port, path, json.dumps(document).encode(), js)
        assert status == 200 and json.loads(body) == {}
        status, body = post(receiver.port, path, b"", pb)
        assert status == 200 and ExportMetricsServiceResponse.FromString(body) == ExportMetricsServiceResponse()
        signal = path.rsplit("/", 1)[1]
        assert receiver.stats()["dropped_requests"] == {signal: 2}
        assert receiver.stats()["dropped_items"] == {signal: 1 if signal == "logs" else 0}
    finally:
        receiver.stop()


def test_grpc_generic_endpoint_takes_all_three_signals(writer: SpanWriter, store: Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpGrpcReceiver(writer, port=0, token="s3cret").start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        exporters = (GrpcSpanExporter(timeout=10, headers=TOKEN), GrpcMetricExporter(timeout=10, headers=TOKEN),
                     GrpcLogExporter(timeout=10, headers=TOKEN))
        assert exporters[0].export(finished_spans()) is SpanExportResult.SUCCESS
        assert exporters[1].export(metrics_data()) is MetricExportResult.SUCCESS
        assert exporters[2].export(log_records()) is LogRecordExportResult.SUCCESS
        for exporter in exporters:
            exporter.shutdown()
        assert stored_span_names(store) == ["llm_request"]
        stats = receiver.stats()
        assert stats["dropped_requests"] == {"metrics": 1, "logs": 1}
        assert stats["dropped_items"] == {"metrics": 3, "logs": 4}
        # Without the token a metrics export is refused like a trace export.
        bare = GrpcMetricExporter(timeout=5)
        assert bare.export(metrics_data()) is MetricExportResult.FAILURE
        bare.shutdown()
        assert receiver.stats()["requests_by_status"] == {"OK": 3, "UNAUTHENTICATED": 1}
    finally:
        receiver.stop()
