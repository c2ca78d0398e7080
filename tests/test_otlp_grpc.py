"""OTLP/gRPC receiver: the real SDK gRPC exporter (plain and gzip), bearer token, partial success,
and back-pressure answered with the retryable status codes of the OTLP specification."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sqlalchemy import event, text

from auditor.store import Store
from collectors.otlp_grpc import OtlpGrpcReceiver
from collectors.spanwriter import SpanWriter


def sdk_spans(count: int = 2) -> list[Any]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gw", "host.name": "h1"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(count):
        with tracer.start_as_current_span(f"s{i}", kind=SpanKind.CLIENT if i else SpanKind.SERVER,
                                          attributes={"http.request.method": "POST", "server.port": 8000}):
            pass
    return list(memory.get_finished_spans())


def names(store: Store) -> list[tuple[str, str]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT name, role FROM spans ORDER BY name"))]


def stub(port: int) -> Any:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, trace_service_pb2_grpc.TraceServiceStub(channel)


@pytest.mark.parametrize("compression", [None, grpc.Compression.Gzip], ids=["plain", "gzip"])
def test_sdk_grpc_exporter_with_token(compression: Any, writer: SpanWriter, store: Store) -> None:
    receiver = OtlpGrpcReceiver(writer, port=0, token="s3cret").start()
    try:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{receiver.port}", insecure=True, timeout=10,
                                    compression=compression, headers={"authorization": "Bearer s3cret"})
        assert exporter.export(sdk_spans()) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert names(store) == [("s0", "http_server"), ("s1", "http_client")]
        channel, client = stub(receiver.port)
        with channel, pytest.raises(grpc.RpcError) as refused:
            client.Export(encode_spans(sdk_spans()), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert receiver.stats()["requests_by_status"] == {"OK": 1, "UNAUTHENTICATED": 1}
    finally:
        receiver.stop()


def test_partial_success(writer: SpanWriter, store: Store) -> None:
    receiver = OtlpGrpcReceiver(writer, port=0).start()
    request = encode_spans(sdk_spans())
    request.resource_spans[0].scope_spans[0].spans[1].span_id = b"\x00" * 8
    channel, client = stub(receiver.port)
    try:
        with channel:
            response = client.Export(request, timeout=5)
        assert response.partial_success.rejected_spans == 1
        assert "invalid span id" in response.partial_success.error_message
        assert names(store) == [("s0", "http_server")]
    finally:
        receiver.stop()


def test_bodies_that_are_not_a_request_are_invalid_arguments(writer: SpanWriter, store: Store) -> None:
    """The trace method takes the request's bytes as they came: a body neither reader takes gets
    INVALID_ARGUMENT naming the problem, and the receiver goes on serving."""
    receiver = OtlpGrpcReceiver(writer, port=0).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{receiver.port}")
    export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
    try:
        with channel:
            for garbage in (b"\x0a\x05\x12", b"\xff" * 7, b"\x0a\x03\x12\x01\xff"):
                with pytest.raises(grpc.RpcError) as refused:
                    export(garbage, timeout=5)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid ExportTraceServiceRequest" in (refused.value.details() or "")
            answer = export(encode_spans(sdk_spans()).SerializeToString(), timeout=5)
        assert answer == b""  # an empty ExportTraceServiceResponse: no partial success
        assert names(store) == [("s0", "http_server"), ("s1", "http_client")]
        assert receiver.stats()["requests_by_status"]["INVALID_ARGUMENT"] == 3
    finally:
        receiver.stop()


def _retry_delay(error: grpc.RpcError) -> int:
    details = dict(error.trailing_metadata() or ())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(details)
    retry = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry)
    return retry.retry_delay.seconds


def test_back_pressure_statuses(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    event.listen(store.engine, "connect", lambda dbapi, _rec: dbapi.execute("PRAGMA busy_timeout=300"))
    store.engine.dispose()
    writer = SpanWriter(store, max_queue_spans=1, retry_after_s=0.5, queue_wait_s=0).start()
    receiver = OtlpGrpcReceiver(writer, port=0).start()
    locker = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    channel, client = stub(receiver.port)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        pending = client.Export.future(encode_spans(sdk_spans(1)), timeout=10)
        deadline = time.monotonic() + 5
        while writer.queue_depth_spans == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as full:
            client.Export(encode_spans(sdk_spans(1)), timeout=5)
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _retry_delay(full.value) == 1
        with pytest.raises(grpc.RpcError) as locked:
            pending.result()
        assert locked.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "database is locked" in (locked.value.details() or "")
        locker.execute("ROLLBACK")
        time.sleep(0.6)
        client.Export(encode_spans(sdk_spans(1)), timeout=5)
        assert names(store) == [("s0", "http_server")]
    finally:
        channel.close()
        locker.close()
        receiver.stop()
        writer.stop()
        store.close()
