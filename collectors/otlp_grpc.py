"""OTLP/gRPC receiver: the ``TraceService/Export`` method on grpcio, plus ``MetricsService`` and
``LogsService`` that accept, count and drop (servers pointed at the generic
``OTEL_EXPORTER_OTLP_ENDPOINT`` export all three signals and would log UNIMPLEMENTED otherwise).

Same normalization and the same :class:`SpanWriter` as the HTTP receiver. Status codes follow the
OTLP specification: OK with ``partial_success`` for rejected spans, UNAUTHENTICATED for a bad or
missing bearer token, RESOURCE_EXHAUSTED (with a ``RetryInfo`` detail, which is what makes it
retryable for OTLP exporters) when the write queue is full, UNAVAILABLE when the store cannot be
written. gzip compression and the message size limit are handled by grpcio itself.
"""

from __future__ import annotations

import hmac
import logging
import math
import socket
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from collectors.normalize import NormalizeResult, normalize_body, normalize_request
from collectors.otlp_codec import count_items
from collectors.otlp_wire import Unusual
from collectors.spanwriter import QUEUE_FULL, BackPressure, SpanWriter

log = logging.getLogger(__name__)


def _trace_service(receiver: OtlpGrpcReceiver) -> Any:
    """``TraceService/Export`` taking the request's bytes as they came: ``collectors.otlp_wire``
    reads the usual body without building the message, as the HTTP receiver does."""
    export = grpc.unary_unary_rpc_method_handler(
        receiver._export, request_deserializer=None,
        response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)
    return grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService",
                                                {"Export": export})


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpGrpcReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        self.receiver._drop("metrics", request, context)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _LogsService(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, receiver: OtlpGrpcReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        self.receiver._drop("logs", request, context)
        return logs_service_pb2.ExportLogsServiceResponse()


class OtlpGrpcReceiver:
    """An OTLP/gRPC trace endpoint served by grpcio's own threads."""

    def __init__(self, writer: SpanWriter, host: str = "127.0.0.1", port: int = 4317, *,
                 token: str | None = None, max_message_bytes: int = 8 << 20, service_host: str = "",
                 max_workers: int = 8, max_concurrent_rpcs: int = 64) -> None:
        self.writer = writer
        self.host = host
        self.requested_port = port
        self.token = token
        self.max_message_bytes = max_message_bytes
        # Given (a daemon's host id), every span is stored under it: the daemon's correlator reads
        # only its own host's rows. Otherwise the span's host.name, else this machine's name.
        self.service_host = service_host
        self._fallback_host = socket.gethostname()
        self.max_workers = max_workers
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self._server: Any = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self.requests_by_status: Counter[str] = Counter()
        self.accepted_spans = 0
        self.rejected_spans = 0
        self.dropped_requests: Counter[str] = Counter()  # metrics and logs, accepted and not kept
        self.dropped_items: Counter[str] = Counter()  # their data points and log records

    def start(self) -> OtlpGrpcReceiver:
        """Bind and serve; raises OSError when the address cannot be bound."""
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="otlp-grpc"),
            # Beyond this many RPCs in flight grpcio answers RESOURCE_EXHAUSTED by itself.
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", self.max_message_bytes),
                     ("grpc.so_reuseport", 0)],
        )
        server.add_generic_rpc_handlers((_trace_service(self),))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _MetricsService(self), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _LogsService(self), server)
        try:
            port = server.add_insecure_port(f"{self.host}:{self.requested_port}")
        except RuntimeError as exc:  # grpcio reports a failed bind this way
            raise OSError(f"cannot listen on {self.host}:{self.requested_port} ({exc})") from exc
        if port == 0:
            raise OSError(f"cannot listen on {self.host}:{self.requested_port}")
        server.start()
        self._server, self._port = server, port
        return self

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("receiver not started")
        return self._port

    def stop(self, grace_s: float = 2.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1)
        self._server = self._port = None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"accepted_spans": self.accepted_spans, "rejected_spans": self.rejected_spans,
                    "requests_by_status": dict(self.requests_by_status),
                    "dropped_requests": dict(self.dropped_requests),
                    "dropped_items": dict(self.dropped_items),
                    "queue_spans": self.writer.queue_depth_spans}

    def _count(self, code: grpc.StatusCode) -> None:
        with self._lock:
            self.requests_by_status[code.name] += 1

    def _authorized(self, context: Any) -> bool:
        if self.token is None:
            return True
        header = dict(context.invocation_metadata()).get("authorization", "")
        return hmac.compare_digest(str(header).strip().encode("utf-8", "replace"),
                                   f"Bearer {self.token}".encode())

    def _export(self, body: bytes, context: Any) -> Any:
        if not self._authorized(context):
            self._count(grpc.StatusCode.UNAUTHENTICATED)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        result = self._normalize(body, context)
        try:
            self.writer.submit(result.spans, len(body))
        except BackPressure as exc:
            self._refuse(context, exc)
        with self._lock:
            self.accepted_spans += len(result.spans)
            self.rejected_spans += result.rejected
        self._count(grpc.StatusCode.OK)
        response = trace_service_pb2.ExportTraceServiceResponse()
        if result.rejected:
            response.partial_success.rejected_spans = result.rejected
            response.partial_success.error_message = result.error_message
        return response

    def _normalize(self, body: bytes, context: Any) -> NormalizeResult:
        try:
            return normalize_body(body, service_host=self.service_host, fallback_host=self._fallback_host)
        except Unusual:
            pass
        try:
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        except (DecodeError, RecursionError, ValueError) as exc:
            self._count(grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request is not a valid ExportTraceServiceRequest protobuf ({exc})")
        return normalize_request(request, service_host=self.service_host, fallback_host=self._fallback_host)

    def _drop(self, signal: str, request: Any, context: Any) -> None:
        """Count a metrics or logs export and keep nothing; the token is still required."""
        if not self._authorized(context):
            self._count(grpc.StatusCode.UNAUTHENTICATED)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        with self._lock:
            self.dropped_requests[signal] += 1
            self.dropped_items[signal] += count_items(request)
        self._count(grpc.StatusCode.OK)

    def _refuse(self, context: Any, exc: BackPressure) -> None:
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.kind == QUEUE_FULL else grpc.StatusCode.UNAVAILABLE
        self._count(code)
        seconds = max(1, math.ceil(exc.retry_after_s))
        retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds))
        status = status_pb2.Status(code=code.value[0], message=f"{exc.reason}; retry later")
        status.details.add().Pack(retry)
        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
        context.abort(code, status.message)
