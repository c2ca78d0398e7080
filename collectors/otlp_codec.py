"""Decoding OTLP/HTTP bodies and encoding the answers, per the OTLP specification.

Protobuf bodies are parsed as they come. OTLP JSON differs from the protobuf JSON mapping in one
way that matters: trace and span ids are hex strings, not base64. They are rewritten before the
standard parser runs; an id that is not hex is replaced by a marker of the wrong length so that
normalization rejects that one span (counted in ``partial_success``) instead of the whole request.
Gzip bodies are inflated in bounded steps: a bomb is cut off as soon as it passes the size limit.

Metrics and logs are not used, but servers configured with the generic
``OTEL_EXPORTER_OTLP_ENDPOINT`` send them anyway; they are parsed (so garbage still gets a 400)
and counted, then dropped. Their JSON ids need no hex rewriting: a hex id of 16 or 32 characters
is also valid base64, and the bytes it decodes to are never looked at.

protobuf is imported on a body's first need of it (JSON, metrics or logs, a trace body the byte
reader leaves to upb): the usual protobuf trace body is read without it, and the protobuf answers
are two fields each, written out here (``encode_response``, ``encode_status``).
"""

from __future__ import annotations

import base64
import functools
import json
import zlib
from types import SimpleNamespace
from typing import Any

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
CONTENT_TYPES = (PROTOBUF, JSON)

# gRPC status codes used in google.rpc.Status bodies (google/rpc/code.proto).
RPC_INVALID_ARGUMENT = 3
RPC_RESOURCE_EXHAUSTED = 8
RPC_UNAUTHENTICATED = 16
RPC_UNAVAILABLE = 14

_INFLATE_STEP = 64 * 1024
_BAD_ID_MARKER = base64.b64encode(b"\x00").decode()  # one byte: never a valid trace or span id
_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


@functools.cache
def messages() -> Any:
    """The protobuf modules and messages this module parses and writes with, imported once."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from google.rpc import status_pb2
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as traces
    return SimpleNamespace(
        json_format=json_format, DecodeError=DecodeError, Status=status_pb2.Status,
        ExportTraceServiceRequest=traces.ExportTraceServiceRequest,
        ExportTraceServiceResponse=traces.ExportTraceServiceResponse,
        ExportMetricsServiceRequest=metrics.ExportMetricsServiceRequest,
        ExportMetricsServiceResponse=metrics.ExportMetricsServiceResponse,
        ExportLogsServiceRequest=logs.ExportLogsServiceRequest,
        ExportLogsServiceResponse=logs.ExportLogsServiceResponse)


class BodyError(Exception):
    """The body cannot be used; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def inflate(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """Undo ``Content-Encoding``; refuse anything that inflates past ``max_bytes`` (413)."""
    coding = (encoding or "identity").strip().lower()
    if coding in ("", "identity"):
        return body
    if coding not in ("gzip", "x-gzip", "deflate"):
        raise BodyError(415, f"Content-Encoding {coding!r} is not supported; use gzip or none")
    # wbits 47 accepts gzip and zlib headers; deflate may also come raw, tried below.
    attempts = (47, -15) if coding == "deflate" else (31,)
    last_error: Exception | None = None
    for wbits in attempts:
        try:
            return _inflate_bounded(body, wbits, max_bytes)
        except zlib.error as exc:
            last_error = exc
    raise BodyError(400, f"body is not valid {coding} data ({last_error})")


def _inflate_bounded(body: bytes, wbits: int, max_bytes: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    out = bytearray()
    pending = body
    while True:
        out += inflater.decompress(pending, _INFLATE_STEP)
        if len(out) > max_bytes:
            raise BodyError(413, f"body inflates past the limit of {max_bytes} bytes")
        pending = inflater.unconsumed_tail
        if not pending:
            break
    out += inflater.flush()
    if len(out) > max_bytes:
        raise BodyError(413, f"body inflates past the limit of {max_bytes} bytes")
    if not inflater.eof:
        raise zlib.error("truncated stream")
    return bytes(out)


def _hex_to_b64(value: Any) -> Any:
    if not isinstance(value, str):
        return _BAD_ID_MARKER
    if value == "":
        return ""
    try:
        return base64.b64encode(bytes.fromhex(value)).decode()
    except ValueError:
        return _BAD_ID_MARKER


def _rewrite_ids(obj: Any) -> None:
    """Hex ids to base64 in place, in spans and their links; anything odd is left to the parser."""
    if not isinstance(obj, dict):
        return
    for resource_spans in _list(obj.get("resourceSpans", obj.get("resource_spans"))):
        if not isinstance(resource_spans, dict):
            continue
        for scope_spans in _list(resource_spans.get("scopeSpans", resource_spans.get("scope_spans"))):
            if not isinstance(scope_spans, dict):
                continue
            for span in _list(scope_spans.get("spans")):
                if not isinstance(span, dict):
                    continue
                _rewrite_id_fields(span)
                for link in _list(span.get("links")):
                    if isinstance(link, dict):
                        _rewrite_id_fields(link)


def _rewrite_id_fields(obj: dict[str, Any]) -> None:
    for name in _ID_FIELDS:
        if name in obj:
            obj[name] = _hex_to_b64(obj[name])


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def decode_request(body: bytes, content_type: str) -> Any:
    """Parse a (plain) body into an ExportTraceServiceRequest; malformed input raises
    BodyError(400) naming the problem."""
    pb = messages()
    json_format = pb.json_format
    request = pb.ExportTraceServiceRequest()
    if content_type == PROTOBUF:
        try:
            request.ParseFromString(body)
        except (pb.DecodeError, RecursionError, ValueError) as exc:
            raise BodyError(400, f"body is not a valid ExportTraceServiceRequest protobuf ({exc})") from exc
        return request
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BodyError(400, f"body is not valid JSON ({_short(exc)})") from exc
    if not isinstance(document, dict):
        raise BodyError(400, "JSON body must be an object with resourceSpans")
    _rewrite_ids(document)
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, RecursionError, ValueError, TypeError, AttributeError) as exc:
        raise BodyError(400, f"JSON body is not an OTLP ExportTraceServiceRequest ({_short(exc)})") from exc
    return request


def encode_response(content_type: str, rejected: int = 0, error_message: str = "") -> bytes:
    """An ExportTraceServiceResponse, with its partial_success where spans were rejected."""
    if content_type == JSON:
        pb = messages()
        response = pb.ExportTraceServiceResponse()
        if rejected or error_message:
            response.partial_success.rejected_spans = rejected
            response.partial_success.error_message = error_message
        # OTLP JSON: int64 as a string is fine for any OTLP client; the mapping does that itself.
        return str(pb.json_format.MessageToJson(response, indent=None)).encode()
    if not (rejected or error_message):
        return b""
    # partial_success (1) { rejected_spans (1, int64), error_message (2, string) }
    return _length_field(1, _varint_field(1, rejected) + _length_field(2, error_message.encode()), always=True)


def encode_status(content_type: str, code: int, message: str) -> bytes:
    """A google.rpc.Status body, in the request's encoding (protobuf unless the request was JSON)."""
    if content_type == JSON:
        pb = messages()
        return str(pb.json_format.MessageToJson(pb.Status(code=code, message=message), indent=None)).encode()
    return _varint_field(1, code) + _length_field(2, message.encode())  # code (int32), message (string)


def _varint_field(number: int, value: int) -> bytes:
    """A varint field as protobuf writes it: nothing for zero, a negative number in ten bytes."""
    return _varint(number << 3) + _varint(value & 0xFFFF_FFFF_FFFF_FFFF) if value else b""


def _length_field(number: int, payload: bytes, *, always: bool = False) -> bytes:
    """A length-delimited field: nothing for an empty string, unless it is a message that is set."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload if payload or always else b""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_dropped(body: bytes, content_type: str, signal: str) -> int:
    """Parse a metrics or logs body only to check it and count its items (data points or log
    records); malformed input raises BodyError(400) like a trace body."""
    pb = messages()
    json_format = pb.json_format
    request: Any = pb.ExportMetricsServiceRequest() if signal == "metrics" else pb.ExportLogsServiceRequest()
    name = type(request).__name__
    try:
        if content_type == PROTOBUF:
            request.ParseFromString(body)
        else:
            document = json.loads(body)
            if not isinstance(document, dict):
                raise BodyError(400, f"JSON body must be an object (an OTLP {name})")
            json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except BodyError:
        raise
    except (pb.DecodeError, json_format.ParseError, RecursionError, ValueError, TypeError, AttributeError) as exc:
        raise BodyError(400, f"body is not a valid {name} ({_short(exc)})") from exc
    return count_items(request)


def count_items(request: Any) -> int:
    """Data points in an ExportMetricsServiceRequest, log records in an ExportLogsServiceRequest."""
    if isinstance(request, messages().ExportLogsServiceRequest):
        return sum(len(scope.log_records) for resource in request.resource_logs for scope in resource.scope_logs)
    points = 0
    for resource in request.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                if kind:
                    points += len(getattr(metric, kind).data_points)
    return points


def encode_empty_response(content_type: str, signal: str) -> bytes:
    """The success answer for a dropped signal: an empty Export*ServiceResponse."""
    if content_type != JSON:
        return b""  # an empty message
    pb = messages()
    response: Any = pb.ExportMetricsServiceResponse() if signal == "metrics" else pb.ExportLogsServiceResponse()
    return str(pb.json_format.MessageToJson(response, indent=None)).encode()


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."
