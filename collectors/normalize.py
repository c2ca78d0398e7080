"""Turn an OTLP ``ExportTraceServiceRequest`` into :class:`auditor.model.SpanRecord` rows.

The join columns of DESIGN §4 are pulled out of the attributes, whichever HTTP semantic
conventions the instrumentation speaks: the old ones (``net.peer.ip``, ``http.method``, ...), the
stable ones (``client.address``, ``http.request.method``, ...) or both at once (``http/dup``).
vLLM's ``llm_request`` span and the GenAI conventions fill the engine columns. Whatever is not a
column stays in ``attributes``, bounded in count, size and nesting.

Input is never trusted: a span with a bad id or an end before its start is rejected on its own and
counted (it becomes ``partial_success`` in the OTLP answer); the rest of the request is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from auditor.model import SpanRecord, SpanRole
from auditor.semconv import ENGINE_SPAN_NAMES, PEER_ADDR_KEYS, PEER_PORT_KEYS, SERVER_PORT_KEYS

# Bounds on what one span may store: enough for any real instrumentation, small enough that a
# hostile exporter cannot blow up the database or the daemon's memory.
MAX_ATTRIBUTES = 128
MAX_STRING_CHARS = 4096
MAX_ARRAY_ITEMS = 64
MAX_DEPTH = 4  # AnyValue array/kvlist nesting kept; deeper values become a marker string
MAX_KEY_CHARS = 256
TRUNCATED_MARK = "...[truncated]"
TOO_DEEP_MARK = "[nested too deep]"

# Column widths of the spans table (auditor.store.schema.SpanRow): longer values are cut, never refused.
_COLUMN_CHARS = {"name": 255, "service": 255, "host": 255, "request_id": 255, "route": 255,
                 "model": 255, "finish_reason": 32, "peer_addr": 64}

_MAX_NS = 2**63 - 1  # timestamps are signed 64-bit columns
_MAX_PID = 2**31 - 1

_KIND_NAMES = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS_NAMES = {0: "unset", 1: "ok", 2: "error"}

# Attribute keys, most specific first; the join keys' order is auditor.semconv's.
# Where the ASGI instrumentation puts "host[:port]" (scope server, or the Host header).
HOST_HEADER_KEYS = ("http.host", "server.address", "http.server_name")
URL_KEYS = ("url.full", "http.url")
METHOD_KEYS = ("http.request.method", "http.method")
STATUS_KEYS = ("http.response.status_code", "http.status_code")
TARGET_KEYS = ("url.path", "http.target")
REQUEST_ID_HEADER_KEYS = ("http.request.header.x_request_id", "http.request.header.x-request-id")
CLIENT_PEER_ADDR_KEYS = ("server.address", "net.peer.name", "net.peer.ip")
CLIENT_PEER_PORT_KEYS = ("server.port", "net.peer.port")
_GENAI_KEYS = frozenset({
    "gen_ai.request.id", "gen_ai.response.finish_reasons", "gen_ai.response.finish_reason",
    "gen_ai.response.model", "gen_ai.request.model", "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.input_tokens", "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens",
    "gen_ai.request.max_tokens", "gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
})


@dataclass
class NormalizeResult:
    """The spans that passed, how many were rejected, and why (for OTLP ``partial_success``)."""

    spans: list[SpanRecord] = field(default_factory=list)
    rejected: int = 0
    error_message: str = ""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - len(TRUNCATED_MARK))] + TRUNCATED_MARK


def any_value(value: AnyValue, depth: int = 0) -> Any:
    """Convert an OTLP AnyValue to plain JSON-able Python, bounded in size and depth."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return _cut(value.string_value, MAX_STRING_CHARS)
    if kind == "int_value":
        return value.int_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "double_value":
        number = value.double_value
        # NaN and infinities are not JSON; keep them readable instead of poisoning the row.
        return number if math.isfinite(number) else str(number)
    if kind == "bytes_value":
        return _cut(value.bytes_value.hex(), MAX_STRING_CHARS)
    if kind == "array_value":
        if depth >= MAX_DEPTH:
            return TOO_DEEP_MARK
        return [any_value(item, depth + 1) for item in value.array_value.values[:MAX_ARRAY_ITEMS]]
    if kind == "kvlist_value":
        if depth >= MAX_DEPTH:
            return TOO_DEEP_MARK
        return {_cut(kv.key, MAX_KEY_CHARS): any_value(kv.value, depth + 1)
                for kv in kv_slice(value.kvlist_value.values, MAX_ARRAY_ITEMS)}
    return None


def kv_slice(values: Any, limit: int) -> Any:
    return values if len(values) <= limit else values[:limit]


def attributes_dict(values: Any) -> tuple[dict[str, Any], int]:
    """Attributes as a dict (first value of a repeated key wins) and how many were dropped."""
    out: dict[str, Any] = {}
    kept: list[KeyValue] = kv_slice(values, MAX_ATTRIBUTES)
    for kv in kept:
        key = kv.key
        if len(key) > MAX_KEY_CHARS:
            key = _cut(key, MAX_KEY_CHARS)
        if key in out:
            continue
        # Hot path: most attributes are plain strings and ints; everything else goes the long way.
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "string_value":
            text = value.string_value
            out[key] = text if len(text) <= MAX_STRING_CHARS else _cut(text, MAX_STRING_CHARS)
        elif kind == "int_value":
            out[key] = value.int_value
        else:
            out[key] = any_value(value)
    return out, len(values) - len(kept)


# -- typed reads of attribute values; anything of the wrong type reads as missing -------------
def _first(attrs: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        value = attrs.get(key)
        if value is not None and value != "":
            return key, value
    return None, None


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit() and len(text) < 19:
            return int(text)
    return None


def as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def as_str(value: Any) -> str | None:
    """A string, or the first string of a list (captured headers and finish reasons are lists)."""
    if type(value) is str:
        return value
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, str):
        return value
    return None


def _port(value: Any) -> int | None:
    port = as_int(value)
    return port if port is not None and 0 <= port <= 65535 else None


def _pid(value: Any) -> int | None:
    number = as_int(value)
    return number if number is not None and 0 < number <= _MAX_PID else None


def _count(value: Any) -> int | None:
    number = as_int(value)
    return number if number is not None and 0 <= number < 2**31 else None


def port_from_hostport(text: Any) -> int | None:
    """The port of "host:port", "[v6]:port" or a URL; None when there is none."""
    if not isinstance(text, str) or not text:
        return None
    try:
        parsed = urlsplit(text if "://" in text else f"//{text.split(',')[0].strip()}")
        return parsed.port
    except ValueError:
        return None


def _take(attrs: dict[str, Any], keys: tuple[str, ...], convert: Any) -> Any:
    """The first of ``keys`` whose value converts, removed from ``attrs`` (it becomes a column).
    Aliases holding the same value (``http/dup``) go too; an alias that disagrees stays."""
    chosen = None
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        converted = convert(value)
        if converted is None:
            continue
        if chosen is None:
            chosen = converted
        if converted == chosen:
            del attrs[key]
    return chosen


def _take1(attrs: dict[str, Any], key: str, convert: Any) -> Any:
    value = attrs.get(key)
    if value is None:
        return None
    converted = convert(value)
    if converted is not None:
        del attrs[key]
    return converted


def _role(name: str, kind: str, has_http: bool) -> SpanRole:
    if name in ENGINE_SPAN_NAMES:
        return SpanRole.ENGINE
    if has_http and kind == "server":
        return SpanRole.HTTP_SERVER
    if has_http and kind == "client":
        return SpanRole.HTTP_CLIENT
    return SpanRole.OTHER


def _bad_id(raw: bytes, size: int, *, optional: bool = False) -> bool:
    if optional and not raw:
        return False
    return len(raw) != size or not any(raw)


class _Rejections:
    def __init__(self) -> None:
        self.count = 0
        self.reasons: dict[str, int] = {}

    def add(self, reason: str) -> None:
        self.count += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def message(self, total: int) -> str:
        if not self.count:
            return ""
        parts = ", ".join(f"{n} {why}" for why, n in sorted(self.reasons.items()))
        return f"rejected {self.count} of {total} spans: {parts}"


def _check_span(span: Any) -> str | None:
    if _bad_id(span.trace_id, 16):
        return "with an invalid trace id (need 16 non-zero bytes, 32 hex digits in JSON)"
    if _bad_id(span.span_id, 8):
        return "with an invalid span id (need 8 non-zero bytes, 16 hex digits in JSON)"
    if _bad_id(span.parent_span_id, 8, optional=True):
        return "with an invalid parent span id"
    if span.start_time_unix_nano == 0:
        return "without a start time"
    if span.end_time_unix_nano > _MAX_NS:
        return "with a time past the year 2262 (not a signed 64-bit nanosecond count)"
    if span.end_time_unix_nano < span.start_time_unix_nano:
        return "ending before they start"
    return None


def normalize_request(request: ExportTraceServiceRequest, *, service_host: str = "",
                      fallback_host: str = "") -> NormalizeResult:
    """Normalize every span of a request; bad spans are counted, never fatal.

    ``service_host`` (the receiving daemon's host id) wins over the resource's ``host.name``: the
    spans a daemon receives come from its own machine's engines, and its correlator joins them to
    its own kernel events by host. ``fallback_host`` stands in where neither is known."""
    result = NormalizeResult()
    rejections = _Rejections()
    total = 0
    for resource_spans in request.resource_spans:
        resource, _ = attributes_dict(resource_spans.resource.attributes)
        service = _cut(as_str(resource.get("service.name")) or "", _COLUMN_CHARS["service"])
        host = _cut(service_host or as_str(resource.get("host.name")) or fallback_host, _COLUMN_CHARS["host"])
        pid = _pid(resource.get("process.pid"))
        if pid is None:
            pid = _pid(resource.get("vllm.process_id"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                total += 1
                reason = _check_span(span)
                if reason is not None:
                    rejections.add(reason)
                    continue
                try:
                    result.spans.append(normalize_span(span, service=service, host=host, process_pid=pid))
                except Exception as exc:  # a bug here must cost one span, never the request
                    rejections.add(f"that could not be read ({type(exc).__name__})")
    result.rejected = rejections.count
    result.error_message = rejections.message(total)
    return result


def normalize_span(span: Any, *, service: str, host: str, process_pid: int | None) -> SpanRecord:
    """One valid OTLP span (ids already checked) to a SpanRecord."""
    # ``attrs`` is this span's own dict: values that become columns are removed from it, and
    # what is left is stored as the span's attributes.
    attrs, dropped = attributes_dict(span.attributes)
    name = span.name
    if len(name) > _COLUMN_CHARS["name"]:
        name = _cut(name, _COLUMN_CHARS["name"])
    kind = _KIND_NAMES.get(span.kind, "unspecified")
    method = _first(attrs, METHOD_KEYS)[1]  # not a column: stays in the attributes
    role = _role(name, kind, method is not None)

    peer_addr: str | None = None
    peer_port: int | None = None
    server_port: int | None = None
    peer_rewritten = False
    if role is SpanRole.HTTP_SERVER:
        peer_addr = _take(attrs, PEER_ADDR_KEYS, as_str)
        peer_port = _take(attrs, PEER_PORT_KEYS, _port)
        server_port = _take(attrs, SERVER_PORT_KEYS, _port)
        if server_port is None:
            # Old ASGI versions only say "host:port" (scope server, else the Host header).
            server_port = port_from_hostport(_first(attrs, HOST_HEADER_KEYS)[1])
        if server_port is None:
            server_port = port_from_hostport(_first(attrs, URL_KEYS)[1])
        # uvicorn's proxy-header middleware replaces the socket peer with X-Forwarded-For and
        # port 0: such a span no longer names its TCP connection and must not be joined by port.
        peer_rewritten = peer_addr is not None and not peer_port
    elif role is SpanRole.HTTP_CLIENT:
        peer_addr = _take(attrs, CLIENT_PEER_ADDR_KEYS, as_str)
        server_port = _take(attrs, CLIENT_PEER_PORT_KEYS, _port)
        if server_port is None:
            server_port = port_from_hostport(_first(attrs, URL_KEYS)[1])

    has_genai = role is SpanRole.ENGINE or not _GENAI_KEYS.isdisjoint(attrs)
    if role is SpanRole.ENGINE:
        request_id = _take1(attrs, "gen_ai.request.id", as_str)
    elif method is not None:
        request_id = _take(attrs, REQUEST_ID_HEADER_KEYS, as_str)
        if request_id is None and has_genai:
            request_id = _take1(attrs, "gen_ai.request.id", as_str)
    else:
        request_id = _take1(attrs, "gen_ai.request.id", as_str) if has_genai else None

    route = http_status = None
    if method is not None:
        route = _take1(attrs, "http.route", as_str)
        if route is None:
            target = _first(attrs, TARGET_KEYS)[1]
            route = target.split("?", 1)[0] if isinstance(target, str) else None
        http_status = _take(attrs, STATUS_KEYS, _count)
    pid = process_pid if process_pid is not None else _take(attrs, ("process.pid", "vllm.process_id"), _pid)

    finish = model = prompt_tokens = completion_tokens = max_tokens = None
    time_in_queue_s = time_to_first_token_s = None
    if has_genai:  # the GenAI and vLLM engine columns; skipped for the many spans without them
        finish = _take(attrs, ("gen_ai.response.finish_reasons", "gen_ai.response.finish_reason"), as_str)
        model = _take(attrs, ("gen_ai.response.model", "gen_ai.request.model"), as_str)
        prompt_tokens = _take(attrs, ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"), _count)
        completion_tokens = _take(attrs,
            ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"), _count)
        max_tokens = _take1(attrs, "gen_ai.request.max_tokens", _count)
        time_in_queue_s = _take1(attrs, "gen_ai.latency.time_in_queue", as_float)
        time_to_first_token_s = _take1(attrs, "gen_ai.latency.time_to_first_token", as_float)

    if dropped:
        attrs["auditor.dropped_attributes"] = dropped
    return SpanRecord(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex() or None,
        name=name,
        kind=kind,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        service=service,
        host=host,
        status=_STATUS_NAMES.get(span.status.code, "unset") if span.HasField("status") else "unset",
        role=role,
        peer_addr=_opt_cut(peer_addr, "peer_addr"),
        peer_port=peer_port,
        server_port=server_port,
        request_id=_opt_cut(request_id, "request_id"),
        route=_opt_cut(route, "route"),
        model=_opt_cut(model, "model"),
        http_status=http_status,
        finish_reason=_opt_cut(finish, "finish_reason"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        max_tokens=max_tokens,
        time_in_queue_s=time_in_queue_s,
        time_to_first_token_s=time_to_first_token_s,
        process_pid=pid,
        peer_rewritten=peer_rewritten,
        attributes=attrs,
    )


def _opt_cut(value: str | None, column: str) -> str | None:
    if value is None or len(value) <= 32:  # 32: the narrowest column, so no lookup needed
        return value
    return _cut(value, _COLUMN_CHARS[column])
