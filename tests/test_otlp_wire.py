"""The byte reader of OTLP bodies (``collectors.otlp_wire``) against the parsed message.

For every body, ``normalize_body`` must either give exactly ``normalize_request``'s result on the
message upb parses, or raise ``Unusual`` (the receivers then take the message path); it must
never take a body upb refuses. Checked on random requests of every attribute type and nesting,
on hand-built bodies with repeated fields and unknown fields, on random byte mutations of valid
bodies, and on what the OpenTelemetry SDK's own encoder sends, which must take the fast path.

Every case runs on each reader: the Python one and the compiled one (``collectors/_otlp_wire.c``),
which must also give the Python reader's answer exactly, value types and order included.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from collectors import otlp_wire
from collectors.attributes import MAX_ATTRIBUTES
from collectors.normalize import NormalizeResult, normalize_body, normalize_request
from collectors.otlp_wire import Unusual

CASES = settings(derandomize=True, deadline=None, database=None, max_examples=400,
                 suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True, params=["python", "compiled"])
def reader(request: pytest.FixtureRequest) -> Any:
    """Each test on each reader; the compiled one where it was built (see the test that says where
    it must be)."""
    if request.param not in otlp_wire.READERS:
        pytest.skip("the compiled OTLP reader is not built here")
    before = otlp_wire.reader()
    otlp_wire.use_reader(request.param)
    yield request.param
    otlp_wire.use_reader(before)


def _outcome(body: bytes) -> tuple[str, Any]:
    """("refused", None), ("unusual", message path's result) or ("read", both results agree)."""
    try:
        message = ExportTraceServiceRequest.FromString(body)
    except DecodeError:
        message = None
    try:
        got: NormalizeResult | None = normalize_body(body, service_host="", fallback_host="fallback")
    except Unusual:
        got = None
    if message is None:
        assert got is None, "the byte reader took a body upb refuses"
        return "refused", None
    expected = normalize_request(message, service_host="", fallback_host="fallback")
    if got is None:
        return "unusual", expected
    assert got.spans == expected.spans
    assert (got.rejected, got.error_message) == (expected.rejected, expected.error_message)
    return "read", expected


# -- random requests ------------------------------------------------------------------------------
_KEYS = st.sampled_from(["http.method", "http.route", "net.peer.ip", "net.peer.port", "net.host.port",
                         "server.port", "client.address", "client.port", "http.status_code",
                         "http.request.header.x_request_id", "gen_ai.request.id", "gen_ai.operation.name",
                         "gen_ai.usage.prompt_tokens", "gen_ai.response.finish_reasons", "process.pid",
                         "gen_ai.latency.time_in_queue", "url.full", "http.host", "k", "é", ""]) | st.text(max_size=8)

_SCALARS = st.one_of(
    st.text(max_size=12).map(lambda s: AnyValue(string_value=s)),
    st.just(AnyValue(string_value="é" * 5000)),  # cut to MAX_STRING_CHARS
    st.integers(-2**63, 2**63 - 1).map(lambda n: AnyValue(int_value=n)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: AnyValue(double_value=f)),
    st.binary(max_size=12).map(lambda b: AnyValue(bytes_value=b)),
    st.just(AnyValue()),
)


def _array(items: list[AnyValue]) -> AnyValue:
    out = AnyValue()
    out.array_value.values.extend(items)
    return out


def _kvlist(items: list[tuple[str, AnyValue]]) -> AnyValue:
    out = AnyValue()
    out.kvlist_value.values.extend(KeyValue(key=k, value=v) for k, v in items)
    return out


def _rarely(strategy: Any, otherwise: Any) -> Any:
    """``strategy`` in about one draw of twenty: the shapes the byte reader leaves to the message
    path (more attributes or items than kept) must not make every random request one of them."""
    return st.integers(0, 19).flatmap(lambda n: strategy if n == 0 else otherwise)


_VALUES = st.recursive(_SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=3).map(_array),
    st.lists(st.tuples(_KEYS, children), max_size=3).map(_kvlist),
    _rarely(st.just(_array([AnyValue(int_value=i) for i in range(70)])), st.just(_array([]))),
), max_leaves=5)

_ATTRIBUTES = _rarely(st.just([(f"k{i}", AnyValue(int_value=i)) for i in range(MAX_ATTRIBUTES + 3)]),
                      st.lists(st.tuples(_KEYS, _VALUES), max_size=8))


@st.composite
def _spans(draw: Any) -> Span:
    span = Span(
        trace_id=draw(st.sampled_from([bytes(range(1, 17)), b"\x00" * 16, b"\x01" * 5, b""])),
        span_id=draw(st.sampled_from([bytes(range(1, 9)), b"\x00" * 8, b"\x02" * 9])),
        parent_span_id=draw(st.sampled_from([b"", bytes(range(9, 17)), b"\x01"])),
        name=draw(st.text(max_size=10) | st.just("n" * 300)),
        kind=draw(st.integers(-3, 8)),
        start_time_unix_nano=draw(st.sampled_from([0, 1_000, 2**63 - 5, 2**64 - 1])),
        end_time_unix_nano=draw(st.sampled_from([0, 2_000, 2**63 - 1, 2**63, 2**64 - 1])),
        trace_state=draw(st.sampled_from(["", "vendor=1"])),
        flags=draw(st.sampled_from([0, 0x101, 2**32 - 1])),
        dropped_attributes_count=draw(st.integers(0, 3)),
    )
    span.attributes.extend(KeyValue(key=k, value=v) for k, v in draw(_ATTRIBUTES))
    if draw(st.booleans()):
        span.status.code = draw(st.integers(-1, 4))
        span.status.message = draw(st.text(max_size=5))
    for _ in range(draw(st.integers(0, 2))):  # events and links: read through, not kept
        event = span.events.add(name=draw(st.text(max_size=5)), time_unix_nano=draw(st.sampled_from([0, 5, 2**64 - 1])),
                                dropped_attributes_count=draw(st.integers(0, 2)))
        event.attributes.extend(KeyValue(key=k, value=v) for k, v in draw(st.lists(st.tuples(_KEYS, _VALUES), max_size=2)))
    for _ in range(draw(st.integers(0, 2))):
        link = span.links.add(trace_id=draw(st.sampled_from([bytes(range(1, 17)), b"", b"\x01" * 3])),
                              span_id=draw(st.sampled_from([bytes(range(1, 9)), b""])),
                              trace_state=draw(st.sampled_from(["", "vendor=1", "é"])),
                              dropped_attributes_count=draw(st.integers(0, 2)),
                              flags=draw(st.sampled_from([0, 0x100, 2**32 - 1])))
        link.attributes.extend(KeyValue(key=k, value=v) for k, v in draw(st.lists(st.tuples(_KEYS, _VALUES), max_size=2)))
    return span


@st.composite
def _requests(draw: Any) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 2))):
        resource_spans = request.resource_spans.add(schema_url=draw(st.sampled_from(["", "https://x"])))
        resource_spans.resource.attributes.extend(KeyValue(key=k, value=v) for k, v in draw(st.lists(
            st.tuples(st.sampled_from(["service.name", "host.name", "process.pid", "vllm.process_id"]) | _KEYS,
                      _VALUES), max_size=4)))
        for _ in range(draw(st.integers(0, 2))):
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.name = draw(st.sampled_from(["", "opentelemetry.instrumentation.asgi"]))
            scope_spans.scope.version = draw(st.sampled_from(["", "0.50b0", "é"]))
            scope_spans.scope.dropped_attributes_count = draw(st.integers(0, 2))
            scope_spans.scope.attributes.extend(KeyValue(key=k, value=v) for k, v in draw(st.lists(
                st.tuples(_KEYS, _VALUES), max_size=2)))
            scope_spans.spans.extend(draw(st.lists(_spans(), max_size=3)))
    return request


READ: dict[str, int] = {}


@CASES
@given(_requests())
def test_random_requests_agree(request: ExportTraceServiceRequest) -> None:
    how, _ = _outcome(request.SerializeToString())
    READ[how] = READ.get(how, 0) + 1


def test_most_random_requests_were_read_from_their_bytes() -> None:
    """The check above means something only if the byte reader took most of its requests."""
    if not READ:
        pytest.skip("runs after test_random_requests_agree")
    assert READ.get("read", 0) > READ.get("unusual", 0), READ


@CASES
@given(_requests().filter(lambda r: r.ByteSize() > 0), st.data())
def test_mutated_bodies_never_get_another_answer(request: ExportTraceServiceRequest, data: Any) -> None:
    body = bytearray(request.SerializeToString())
    for _ in range(data.draw(st.integers(1, 4))):
        _mutate(body, data)
        if not body:
            return
    _outcome(bytes(body))


_LONG_VARINTS = [b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x7f", b"\x80" * 10, b"\xff" * 11]


def _mutate(body: bytearray, data: Any, long_varints: bool = False) -> None:
    """One random change to ``body``, in place; with ``long_varints``, perhaps a varint of 10 or
    more bytes (past 64 bits, or unfinished) where a tag or a length was."""
    at = data.draw(st.integers(0, len(body) - 1))
    action = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", *(["varint"] * long_varints)]))
    if action == "flip":
        body[at] ^= data.draw(st.integers(1, 255))
    elif action == "insert":
        body[at:at] = data.draw(st.binary(min_size=1, max_size=3))
    elif action == "varint":
        body[at:at + 1] = data.draw(st.sampled_from(_LONG_VARINTS))
    elif action == "delete" and len(body) > 1:
        del body[at]
    elif action == "truncate":
        del body[at:]


# -- hand-built bodies: repeated and unknown fields ---------------------------------------------------
def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _body(*span_bytes: bytes, resource: bytes = b"") -> bytes:
    scope_spans = b"".join(_field(2, s) for s in span_bytes)
    return _field(1, resource + _field(2, scope_spans))


def _span_bytes(**attrs: Any) -> bytes:
    span = Span(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)), name="POST /v1/completions",
                kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=1_000, end_time_unix_nano=2_000)
    for key, value in attrs.items():
        span.attributes.add(key=key.replace("_", "."), value=AnyValue(string_value=value)
                            if isinstance(value, str) else AnyValue(int_value=value))
    return span.SerializeToString()


def test_repeated_fields_follow_protobuf_merge_rules() -> None:
    base = _span_bytes(http_method="POST", net_peer_port=40_001, net_host_port=8000)
    cases = {
        "a later name wins": base + _field(5, b"GET /later"),
        "statuses merge": base + _field(15, b"\x18\x01") + _field(15, b"\x12\x02hi") + _field(15, b"\x18\x02"),
        "attributes append, the first of a key wins": base + _field(9, _field(1, b"net.peer.port")
                                                                     + _field(2, b"\x18\x07")),
        "resources merge": _body(base, resource=_field(1, _field(1, _field(1, b"service.name")
                                                                 + _field(2, _field(1, b"a"))))
                                 + _field(1, _field(1, _field(1, b"host.name") + _field(2, _field(1, b"h"))))),
        "unknown fields are skipped": base + _varint(99 << 3) + _varint(5) + _field(98, b"xyz")
        + _varint(97 << 3 | 5) + b"abcd" + _varint(96 << 3 | 1) + b"12345678",
        "kind as a negative int32 in ten bytes": base + b"\x30" + _varint(2**64 - 2),
        "kind above 32 bits": base + b"\x30" + _varint(2**32 + 2),
    }
    for what, span_bytes in cases.items():
        body = span_bytes if what == "resources merge" else _body(span_bytes)
        how, result = _outcome(body)
        assert how == "read", what
        assert len(result.spans) == 1, what
    assert _outcome(_body(cases["a later name wins"]))[1].spans[0].name == "GET /later"
    assert _outcome(_body(cases["statuses merge"]))[1].spans[0].status == "error"
    assert _outcome(_body(cases["attributes append, the first of a key wins"]))[1].spans[0].peer_port == 40_001
    assert _outcome(_body(cases["kind above 32 bits"]))[1].spans[0].kind == "server"
    assert _outcome(_body(base + b"\x7a\x06\x18" + _varint(2**32 + 2)))[1].spans[0].status == "error"


def test_values_are_bounded_as_the_message_path_bounds_them() -> None:
    long_text = _field(9, _field(1, b"k") + _field(2, _field(1, "é".encode() * 5000)))
    (span,) = _outcome(_body(_span_bytes() + long_text))[1].spans
    assert len(span.attributes["k"]) == 4096
    odd = [KeyValue(key="nan", value=AnyValue(double_value=math.nan)),
           KeyValue(key="inf", value=AnyValue(double_value=-math.inf)),
           KeyValue(key="bytes", value=AnyValue(bytes_value=b"\x01" * 3000))]
    (span,) = _outcome(_body(_span_bytes() + b"".join(_field(9, kv.SerializeToString()) for kv in odd)))[1].spans
    assert (span.attributes["nan"], span.attributes["inf"]) == ("nan", "-inf")
    assert len(span.attributes["bytes"]) == 4096
    items = 64 * b"\x0a\x02\x18\x01"
    kept = _field(9, _field(1, b"a") + _field(2, _field(5, items)))
    assert _outcome(_body(_span_bytes() + kept))[0] == "read"
    over = _field(9, _field(1, b"a") + _field(2, _field(5, items + b"\x0a\x02\x18\x01")))
    assert _outcome(_body(_span_bytes() + over))[0] == "unusual"


def test_a_field_that_runs_past_its_message_is_refused() -> None:
    """A varint at the end of a sub-message whose last byte says "more follows": upb refuses the
    body, and the byte reader must not read on into the next field."""
    resource = b"\x10\x80"  # dropped_attributes_count, unfinished
    assert _outcome(_field(1, _field(1, resource) + _field(2, b"")))[0] == "refused"
    assert _outcome(_body(_span_bytes() + b"\x02\x00"))[0] == "refused"  # field number 0
    status = b"\x18\x80"  # the status code, unfinished
    assert _outcome(_body(_span_bytes() + _field(15, status) + b"\x28\x01"))[0] in ("refused", "unusual")


def test_sub_messages_it_does_not_keep_are_still_checked() -> None:
    """Events, links and the scope are read through with the kept fields' checks: garbage in them
    is refused as upb refuses it, and their usual shapes are read, not left to the message path."""
    def scoped(scope: bytes) -> bytes:
        return _field(1, _field(2, _field(1, scope) + _field(2, _span_bytes())))

    bad_value = _field(1, b"k") + _field(2, _field(1, b"\xc3"))  # a key-value whose text is cut UTF-8
    refused = [
        _body(_span_bytes() + _field(11, _field(2, b"\xff\xfe"))),  # an event's name
        _body(_span_bytes() + _field(11, _field(3, bad_value))),  # an event's attribute
        _body(_span_bytes() + _field(11, b"\x09" + b"\x00" * 7)),  # an event's time, cut short
        _body(_span_bytes() + _field(13, _field(3, b"\xed\xa0\x80"))),  # a link's trace_state, a surrogate
        _body(_span_bytes() + _field(13, _field(4, bad_value))),  # a link's attribute
        _body(_span_bytes() + _field(13, b"\x35\x00\x00")),  # a link's flags, cut short
        _body(_span_bytes() + _field(13, b"\x28\x80")),  # a link's dropped count, unfinished
        scoped(_field(1, b"\xff")),  # the scope's name
        scoped(_field(2, b"\xff")),  # its version
        scoped(_field(3, bad_value)),  # its attribute
    ]
    for body in refused:
        assert _outcome(body)[0] == "refused", body
    usual = [
        _body(_span_bytes() + _field(11, b"\x09" + b"\x05" * 8 + _field(2, b"e") + _field(3, _field(1, b"k")) + b"\x20\x02")),
        _body(_span_bytes() + _field(13, _field(1, b"\x01" * 16) + _field(2, b"") + _field(3, b"v=1")
                                     + _field(4, _field(1, b"k") + _field(2, b"\x18\x01")) + b"\x28\x01\x35\x01\x00\x00\x00")),
        _body(_span_bytes() + _field(13, _field(9, b"a field this schema does not define"))),
        scoped(_field(1, b"asgi") + _field(2, b"0.50b0") + _field(3, _field(1, b"k")) + b"\x20\x01"),
    ]
    for body in usual:
        assert _outcome(body)[0] == "read", body
    # A known field in another wire type: the message path's to read (upb takes it as unknown).
    assert _outcome(_body(_span_bytes() + _field(11, b"\x10\x01")))[0] == "unusual"


def test_the_field_numbers_written_out_are_the_installed_schemas() -> None:
    """otlp_wire names each message's fields without importing protobuf: they must be the installed
    schema's own (a newer schema than SCHEMA_VERSION is read from its descriptors instead)."""
    from google.protobuf import symbol_database
    pool = symbol_database.Default().pool
    installed = {name: frozenset(f.number for f in pool.FindMessageTypeByName(name).fields) for name in otlp_wire.FIELDS}
    assert otlp_wire._installed_schema() is not None
    if otlp_wire._installed_schema() <= otlp_wire.SCHEMA_VERSION:
        assert installed == otlp_wire.FIELDS
    assert otlp_wire._schema_fields() == installed


def test_shapes_it_does_not_take_go_the_message_way() -> None:
    base = _span_bytes(http_method="POST")
    two_values = _field(9, _field(1, b"k") + _field(2, b"\x18\x01") + _field(2, b"\x18\x02"))
    two_members = _field(9, _field(1, b"k") + _field(2, _field(1, b"a") + b"\x18\x05"))
    name_as_varint = b"\x28\x05"  # field 5 (name) with wire type 0
    group = _varint(50 << 3 | 3) + _varint(50 << 3 | 4)
    for extra in (two_values, two_members, name_as_varint, group):
        how, _ = _outcome(_body(base + extra))
        assert how in ("unusual", "refused")
    assert _outcome(_body(base + two_values))[0] == "unusual"  # upb merges the two values
    assert _outcome(_body(base + two_members))[0] == "unusual"  # the later member wins
    assert _outcome(_body(base + _field(9, _field(1, b"\xff") + _field(2, b"\x18\x01"))))[0] == "refused"


# -- what exporters send --------------------------------------------------------------------------
def test_the_sdk_encoders_bodies_take_the_fast_path() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "process.pid": 4242}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("opentelemetry.instrumentation.asgi", "0.50b0")
    with tracer.start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER, attributes={
            "http.method": "POST", "http.route": "/v1/chat/completions", "net.peer.ip": "10.0.0.7",
            "net.peer.port": 40_123, "net.host.port": 8000, "http.status_code": 200,
            "http.request.header.x_request_id": ("req-1",), "ratio": 0.5, "flag": True}) as server:
        server.add_event("http.response.start", {"n": 1})
        with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER, links=[Link(server.get_span_context())],
                                          attributes={"gen_ai.request.id": "chatcmpl-1", "gen_ai.usage.prompt_tokens": 812,
                                                      "gen_ai.response.finish_reasons": ("stop",),
                                                      "gen_ai.latency.time_in_queue": 0.012}) as engine:
            engine.set_status(Status(StatusCode.ERROR, "aborted"))
    body = encode_spans(exporter.get_finished_spans()).SerializeToString()
    how, result = _outcome(body)
    assert how == "read"
    by_name = {s.name: s for s in result.spans}
    assert by_name["POST /v1/chat/completions"].peer_port == 40_123
    assert by_name["llm_request"].request_id == "chatcmpl-1" and by_name["llm_request"].status == "error"
    assert by_name["llm_request"].process_pid == 4242
    assert math.isclose(by_name["llm_request"].time_in_queue_s or 0, 0.012)


@pytest.mark.parametrize("body", [b"", b"\x0a\x00", b"\x0a\x02\x12\x00"])
def test_empty_requests(body: bytes) -> None:
    how, result = _outcome(body)
    assert how == "read" and result.spans == [] and result.rejected == 0


def test_a_fault_of_the_reader_costs_speed_not_the_body(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_args: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(otlp_wire, "_read", broken)
    monkeypatch.setattr(otlp_wire, "_faults", 0)
    body = _body(_span_bytes(http_method="POST"))
    for _ in range(2):
        with pytest.raises(Unusual):
            normalize_body(body)
    assert [r.message for r in caplog.records].count(
        "the OTLP byte reader failed (ZeroDivisionError('a bug')); such bodies are parsed with upb instead") == 1
    assert len(normalize_request(ExportTraceServiceRequest.FromString(body)).spans) == 1
