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

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from auditor.model import SpanRecord, SpanRole
from auditor.semconv import (
    PEER_ADDR_KEYS,
    PEER_PORT_KEYS,
    POD_ADDRESS_KEY,
    SENDER_KEY,
    SERVER_PORT_KEYS,
    named_address,
)
from auditor.store import dumps_json, row_layout, use_batch_rows
from collectors.attributes import (
    as_count,
    as_finish,
    as_float,
    as_int,
    as_pid,
    as_port,
    as_str,
    attributes_dict,
    cut_text,
    first_of,
    is_engine_span,
    port_from_hostport,
    take,
    take_one,
)
from collectors.otlp_wire import read_request

if TYPE_CHECKING:  # the message path's type; protobuf is imported where a body needs it
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

log = logging.getLogger(__name__)

# Column widths of the spans table (auditor.store.tables.spans): longer values are cut, never refused.
_COLUMN_CHARS = {"name": 255, "service": 255, "host": 255, "request_id": 255, "route": 255,
                 "model": 255, "finish_reason": 32, "peer_addr": 64}

_MAX_NS = 2**63 - 1  # timestamps are signed 64-bit columns

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
PID_KEYS = ("process.pid", "vllm.process_id")
ROUTE_KEY = "http.route"
# The GenAI and vLLM engine columns.
FINISH_KEYS = ("gen_ai.response.finish_reasons", "gen_ai.response.finish_reason")
MODEL_KEYS = ("gen_ai.response.model", "gen_ai.request.model")
PROMPT_KEYS = ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens")
COMPLETION_KEYS = ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")
GENAI_REQUEST_ID_KEY = "gen_ai.request.id"
MAX_TOKENS_KEY = "gen_ai.request.max_tokens"
TIME_IN_QUEUE_KEY = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN_KEY = "gen_ai.latency.time_to_first_token"
# Any of these makes a span's engine columns worth reading.
_GENAI_KEYS = frozenset({GENAI_REQUEST_ID_KEY, *FINISH_KEYS, *MODEL_KEYS, *PROMPT_KEYS, *COMPLETION_KEYS,
                         MAX_TOKENS_KEY, TIME_IN_QUEUE_KEY, TIME_TO_FIRST_TOKEN_KEY})


@dataclass
class NormalizeResult:
    """The spans that passed, how many were rejected, and why (for OTLP ``partial_success``)."""

    spans: list[SpanRecord] = field(default_factory=list)
    rejected: int = 0
    error_message: str = ""


def _role(name: str, kind: str, has_http: bool, attrs: dict[str, Any]) -> SpanRole:
    if is_engine_span(name, kind, attrs, has_http):
        return SpanRole.ENGINE
    if has_http and kind == "server":
        return SpanRole.HTTP_SERVER
    if has_http and kind == "client":
        return SpanRole.HTTP_CLIENT
    return SpanRole.OTHER


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


def _span_head(span: Any) -> str | tuple[str, str, str | None, int, int]:
    """The span's ids (as hex) and times, each read from the message once; or why it is rejected."""
    return check_head(span.trace_id, span.span_id, span.parent_span_id, span.start_time_unix_nano,
                      span.end_time_unix_nano)


def check_head(trace_id: bytes, span_id: bytes, parent: bytes, start: int,
               end: int) -> str | tuple[str, str, str | None, int, int]:
    """A span's ids (as hex) and times; or why the span is rejected."""
    if len(trace_id) != 16 or not any(trace_id):
        return "with an invalid trace id (need 16 non-zero bytes, 32 hex digits in JSON)"
    if len(span_id) != 8 or not any(span_id):
        return "with an invalid span id (need 8 non-zero bytes, 16 hex digits in JSON)"
    if parent and (len(parent) != 8 or not any(parent)):
        return "with an invalid parent span id"
    if start == 0:
        return "without a start time"
    if end > _MAX_NS:
        return "with a time past the year 2262 (not a signed 64-bit nanosecond count)"
    if end < start:
        return "ending before they start"
    return trace_id.hex(), span_id.hex(), parent.hex() or None, start, end


def _slots_fillable(record_type: Any, fields: tuple[str, ...]) -> bool:
    """Whether ``record_type``'s slots are exactly ``fields``, in order, and nothing checks them
    after ``__init__``: then a record is made by filling its slots."""
    names = tuple(f.name for f in dataclasses.fields(record_type))
    return (names == fields and getattr(record_type, "__slots__", ()) == names
            and not hasattr(record_type, "__post_init__"))


def _slot_filler(record_type: Any, fields: tuple[str, ...]) -> Callable[..., Any]:
    """Build ``record_type`` from the values of ``fields`` in order, filling its slots directly.

    SpanRecord is a frozen dataclass whose ``__init__`` sets each of its 27 fields through
    ``object.__setattr__`` (a sixth of normalization's time); the slot descriptors store the
    same values in about half of that. The builder is generated with one statement per field, as
    ``dataclasses`` generates ``__init__``: a loop over the descriptors costs as much again.
    Falls back to the constructor when the record has a ``__post_init__`` or its fields are no
    longer ``fields`` in that order (then by keyword, so a reordered or added field can never
    receive another one's value).
    """
    if not _slots_fillable(record_type, fields):
        return lambda *values: record_type(**dict(zip(fields, values, strict=True)))
    names = fields
    namespace: dict[str, Any] = {"new": object.__new__, "record_type": record_type}
    lines = [f"def build({', '.join(f'v{i}' for i in range(len(names)))}):", "    record = new(record_type)"]
    for i, name in enumerate(names):
        namespace[f"set{i}"] = getattr(record_type, name).__set__
        lines.append(f"    set{i}(record, v{i})  # {name}")
    lines.append("    return record")
    exec("\n".join(lines), namespace)  # the source holds only names made above from positions
    build: Callable[..., Any] = namespace["build"]
    return build


_SPAN_FIELDS = (
    "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns", "service", "host",
    "status", "role", "peer_addr", "peer_port", "server_port", "request_id", "route", "model",
    "http_status", "finish_reason", "prompt_tokens", "completion_tokens", "max_tokens",
    "time_in_queue_s", "time_to_first_token_s", "process_pid", "peer_rewritten", "attributes")
_new_span = _slot_filler(SpanRecord, _SPAN_FIELDS)


def normalize_request(request: ExportTraceServiceRequest, *, service_host: str = "",
                      fallback_host: str = "", sender: str | None = None) -> NormalizeResult:
    """Normalize every span of a request; bad spans are counted, never fatal.

    ``service_host`` (the receiving daemon's host id) wins over the resource's ``host.name``: the
    spans a daemon receives come from its own machine's engines, and its correlator joins them to
    its own kernel events by host. ``fallback_host`` stands in where neither is known. ``sender``:
    the address the request came from (``auditor.semconv.sender_address``), kept in each span's
    attributes (``SENDER_KEY``), but for the spans of a resource that names its pod's address
    (``POD_ADDRESS_KEY``), which keep that."""
    result = NormalizeResult()
    append = result.spans.append
    rejections = _Rejections()
    total = 0
    for resource_spans in request.resource_spans:
        resource, _ = attributes_dict(resource_spans.resource.attributes)
        service, host, pid = _resource_columns(resource, service_host, fallback_host)
        first = len(result.spans)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                total += 1
                try:
                    head = _span_head(span)
                    if isinstance(head, str):
                        rejections.add(head)
                        continue
                    attrs, dropped = attributes_dict(span.attributes)
                    status = span.status.code if span.HasField("status") else None
                    append(_build(head, span.name, span.kind, status, attrs, dropped, service, host, pid))
                except Exception as exc:  # a bug here must cost one span, never the request
                    rejections.add(f"that could not be read ({type(exc).__name__})")
        _mark_sender(result.spans, first, resource, sender)
    result.rejected = rejections.count
    result.error_message = rejections.message(total)
    return result


def _mark_sender(spans: list[SpanRecord], first: int, resource: dict[str, Any], sender: str | None) -> None:
    """Where the spans from ``first`` on, one resource's, came from: the pod address the resource
    names, else the request's sender; nothing for neither (the loopback's)."""
    named = resource.get(POD_ADDRESS_KEY)
    if isinstance(named, str) and named:
        sender = named_address(named) or sender
    if sender:
        for index in range(first, len(spans)):
            spans[index].attributes[SENDER_KEY] = sender


def normalize_body(body: bytes, *, service_host: str = "", fallback_host: str = "",
                   sender: str | None = None) -> NormalizeResult:
    """:func:`normalize_request` of a protobuf body, read without building the message
    (``collectors.otlp_wire``): the same spans and rejections. Raises ``otlp_wire.Unusual`` for a
    body that reader does not take; the caller then parses it (``otlp_codec.decode_request``)."""
    result = NormalizeResult()
    append = result.spans.append
    rejections = _Rejections()
    total = 0
    for resource, spans in read_request(body):
        service, host, pid = _resource_columns(resource, service_host, fallback_host)
        first = len(result.spans)
        for trace_id, span_id, parent, start_ns, end_ns, name, kind, status, attrs in spans:
            total += 1
            try:
                head = check_head(trace_id, span_id, parent, start_ns, end_ns)
                if isinstance(head, str):
                    rejections.add(head)
                    continue
                append(_build(head, name, kind, status, attrs, 0, service, host, pid))
            except Exception as exc:  # as normalize_request: one span, never the request
                rejections.add(f"that could not be read ({type(exc).__name__})")
        _mark_sender(result.spans, first, resource, sender)
    result.rejected = rejections.count
    result.error_message = rejections.message(total)
    return result


def _resource_columns(resource: dict[str, Any], service_host: str,
                      fallback_host: str) -> tuple[str, str, int | None]:
    service = cut_text(as_str(resource.get("service.name")) or "", _COLUMN_CHARS["service"])
    host = cut_text(service_host or as_str(resource.get("host.name")) or fallback_host, _COLUMN_CHARS["host"])
    pid = as_pid(resource.get("process.pid"))
    if pid is None:
        pid = as_pid(resource.get("vllm.process_id"))
    return service, host, pid


def build_span(head: tuple[str, str, str | None, int, int], name: str, kind_code: int, status_code: int | None,
               attrs: dict[str, Any], dropped: int, service: str, host: str,
               process_pid: int | None) -> SpanRecord:
    """One valid span to a SpanRecord: ``head`` is what ``check_head`` returned, ``status_code``
    None where the span has no status, ``attrs`` the span's own attribute dict (values that become
    columns are removed from it; what is left is stored) and ``dropped`` how many were cut."""
    if len(name) > _COLUMN_CHARS["name"]:
        name = cut_text(name, _COLUMN_CHARS["name"])
    kind = _KIND_NAMES.get(kind_code, "unspecified")
    method = first_of(attrs, METHOD_KEYS)[1]  # not a column: stays in the attributes
    role = _role(name, kind, method is not None, attrs)

    peer_addr, peer_port, server_port, peer_rewritten = _connection(attrs, role)
    has_genai = role is SpanRole.ENGINE or not _GENAI_KEYS.isdisjoint(attrs)
    request_id = _request_id(attrs, role, method is not None, has_genai)
    route = http_status = None
    if method is not None:
        route = take_one(attrs, ROUTE_KEY, as_str)
        if route is None:
            target = first_of(attrs, TARGET_KEYS)[1]
            route = target.split("?", 1)[0] if isinstance(target, str) else None
        http_status = take(attrs, STATUS_KEYS, as_count)
    pid = process_pid if process_pid is not None else take(attrs, PID_KEYS, as_pid)
    # The GenAI and vLLM engine columns; skipped for the many spans without them.
    engine = _engine_columns(attrs) if has_genai else _NO_ENGINE_COLUMNS
    if dropped:
        attrs["auditor.dropped_attributes"] = dropped
    trace_id, span_id, parent_span_id, start_ns, end_ns = head
    span_record: SpanRecord = _new_span(
        trace_id,  # trace_id
        span_id,  # span_id
        parent_span_id,  # parent_span_id
        name,  # name
        kind,  # kind
        start_ns,  # start_ns
        end_ns,  # end_ns
        service,  # service
        host,  # host
        "unset" if status_code is None else _STATUS_NAMES.get(status_code, "unset"),  # status
        role,  # role
        _opt_cut(peer_addr, "peer_addr"),  # peer_addr
        peer_port,  # peer_port
        server_port,  # server_port
        _opt_cut(request_id, "request_id"),  # request_id
        _opt_cut(route, "route"),  # route
        _opt_cut(engine.model, "model"),  # model
        http_status,  # http_status
        _opt_cut(engine.finish, "finish_reason"),  # finish_reason
        engine.prompt_tokens,  # prompt_tokens
        engine.completion_tokens,  # completion_tokens
        engine.max_tokens,  # max_tokens
        engine.time_in_queue_s,  # time_in_queue_s
        engine.time_to_first_token_s,  # time_to_first_token_s
        pid,  # process_pid
        peer_rewritten,  # peer_rewritten
        attrs,  # attributes
    )
    return span_record


def _connection(attrs: dict[str, Any], role: SpanRole) -> tuple[str | None, int | None, int | None, bool]:
    """(peer address, peer port, server port, peer rewritten by a proxy header) of an HTTP span."""
    if role is SpanRole.HTTP_SERVER:
        peer_addr = take(attrs, PEER_ADDR_KEYS, as_str)
        peer_port = take(attrs, PEER_PORT_KEYS, as_port)
        server_port = take(attrs, SERVER_PORT_KEYS, as_port)
        if server_port is None:
            # Old ASGI versions only say "host:port" (scope server, else the Host header).
            server_port = port_from_hostport(first_of(attrs, HOST_HEADER_KEYS)[1])
        if server_port is None:
            server_port = port_from_hostport(first_of(attrs, URL_KEYS)[1])
        # uvicorn's proxy-header middleware replaces the socket peer with X-Forwarded-For and
        # port 0: such a span no longer names its TCP connection and must not be joined by port.
        return peer_addr, peer_port, server_port, peer_addr is not None and not peer_port
    if role is SpanRole.HTTP_CLIENT:
        server_port = take(attrs, CLIENT_PEER_PORT_KEYS, as_port)
        if server_port is None:
            server_port = port_from_hostport(first_of(attrs, URL_KEYS)[1])
        return take(attrs, CLIENT_PEER_ADDR_KEYS, as_str), None, server_port, False
    return None, None, None, False


def _request_id(attrs: dict[str, Any], role: SpanRole, is_http: bool, has_genai: bool) -> str | None:
    request_id: str | None = None
    if is_http and role is not SpanRole.ENGINE:
        request_id = take(attrs, REQUEST_ID_HEADER_KEYS, as_str)
    if request_id is None and (has_genai or role is SpanRole.ENGINE):
        request_id = take_one(attrs, GENAI_REQUEST_ID_KEY, as_str)
    return request_id


class _EngineColumns(NamedTuple):
    finish: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    time_in_queue_s: float | None = None
    time_to_first_token_s: float | None = None


_NO_ENGINE_COLUMNS = _EngineColumns()


def _engine_columns(attrs: dict[str, Any]) -> _EngineColumns:
    return _EngineColumns(
        finish=take(attrs, FINISH_KEYS, as_finish),
        model=take(attrs, MODEL_KEYS, as_str),
        prompt_tokens=take(attrs, PROMPT_KEYS, as_count),
        completion_tokens=take(attrs, COMPLETION_KEYS, as_count),
        max_tokens=take_one(attrs, MAX_TOKENS_KEY, as_count),
        time_in_queue_s=take_one(attrs, TIME_IN_QUEUE_KEY, as_float),
        time_to_first_token_s=take_one(attrs, TIME_TO_FIRST_TOKEN_KEY, as_float),
    )


def _opt_cut(value: str | None, column: str) -> str | None:
    if value is None or len(value) <= 32:  # 32: the narrowest column, so no lookup needed
        return value
    return cut_text(value, _COLUMN_CHARS[column])


# -- the compiled builder ------------------------------------------------------------------------
# collectors/_normalize.c is build_span step for step in C, with every key, width and name taken
# from this module (configure() below); build_span stays the reference, and the builder where the
# extension was not built. tests/test_normalize_compiled.py holds the two equal on generated spans.
def _compiled() -> Any:
    try:
        from collectors import _normalize  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        _normalize.configure(
            (_new_span, is_engine_span, port_from_hostport, cut_text, as_int, as_float, as_finish),
            (_KIND_NAMES, _STATUS_NAMES),
            (SpanRole.ENGINE, SpanRole.HTTP_SERVER, SpanRole.HTTP_CLIENT, SpanRole.OTHER),
            ("unset", "unspecified", "", "auditor.dropped_attributes"),
            tuple(_COLUMN_CHARS[column] for column in ("name", "peer_addr", "request_id", "route", "model",
                                                          "finish_reason")),
            (METHOD_KEYS, PEER_ADDR_KEYS, PEER_PORT_KEYS, SERVER_PORT_KEYS, HOST_HEADER_KEYS, URL_KEYS,
             CLIENT_PEER_ADDR_KEYS, CLIENT_PEER_PORT_KEYS, REQUEST_ID_HEADER_KEYS, STATUS_KEYS, TARGET_KEYS,
             PID_KEYS, FINISH_KEYS, MODEL_KEYS, PROMPT_KEYS, COMPLETION_KEYS),
            (ROUTE_KEY, GENAI_REQUEST_ID_KEY, MAX_TOKENS_KEY, TIME_IN_QUEUE_KEY, TIME_TO_FIRST_TOKEN_KEY),
            _GENAI_KEYS, _SPAN_FIELDS,
            SpanRecord if _slots_fillable(SpanRecord, _SPAN_FIELDS) else None)
    except Exception as exc:  # a rule's data this builder cannot hold: build_span builds
        log.warning("the compiled span builder could not be set up (%s); records are built in Python", exc)
        return None
    global _compiled_rows
    _compiled_rows = _compiled_row_maker(_normalize)
    use_batch_rows(SpanRecord, _compiled_rows)
    return _normalize.build_span


_compiled_rows: Any = None


def _compiled_row_maker(compiled: Any) -> Any:
    """The compiled maker of the store's span rows, where the store makes them as it expects: the
    record's fields in order, its role as the role's value, its attributes as ``dumps_json`` text
    (``auditor.store.row_layout``); else None (the rows are made in Python)."""
    if row_layout(SpanRecord) != (_SPAN_FIELDS, {"role": "enum value", "attributes": "json"}):
        log.warning("the store's span rows are not as the compiled row maker makes them; made in Python")
        return None
    try:
        compiled.configure_rows(dumps_json, tuple(role.value for role in (
            SpanRole.ENGINE, SpanRole.HTTP_SERVER, SpanRole.HTTP_CLIENT, SpanRole.OTHER)))
    except Exception as exc:  # e.g. configure() without the record type: the rows are made in Python
        log.warning("the compiled span row maker could not be set up (%s); rows are made in Python", exc)
        return None
    return compiled.span_rows


BUILDERS: dict[str, Callable[..., SpanRecord]] = {"python": build_span}
_compiled_build = _compiled()
if _compiled_build is not None:
    BUILDERS["compiled"] = _compiled_build
_build = BUILDERS.get("compiled", build_span)


def builder() -> str:
    """Which builder makes records: "compiled" or "python"."""
    return "compiled" if _build is BUILDERS.get("compiled") else "python"


def use_builder(name: str) -> None:
    """Build records, and the store's rows of them, with the named builder of BUILDERS (tests and
    benches compare the two)."""
    global _build
    _build = BUILDERS[name]
    use_batch_rows(SpanRecord, _compiled_rows if name == "compiled" else None)
