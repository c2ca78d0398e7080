"""Span normalization: join columns under old, new and duplicated HTTP conventions, vLLM and GenAI
attributes, gateway client spans, proxy-rewritten peers, and bounded handling of hostile values.

Every case runs both ways: from the parsed message and from the body's bytes
(``collectors.otlp_wire``), which must agree wherever the byte reader takes the body; and with
each record builder (``normalize.build_span`` and its compiled twin, where it was built)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from auditor.model import SpanRole
from collectors import normalize as normalization
from collectors.attributes import MAX_ATTRIBUTES, MAX_STRING_CHARS, TOO_DEEP_MARK, cut_text
from collectors.normalize import NormalizeResult, normalize_body
from collectors.normalize import normalize_request as from_message
from collectors.otlp_wire import Unusual

TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
SERVER, CLIENT, INTERNAL = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_INTERNAL


@pytest.fixture(autouse=True, params=["python", "compiled"])
def builder(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test with each record builder (tests/test_normalize_compiled.py says where the compiled
    one must be built)."""
    if request.param not in normalization.BUILDERS:
        pytest.skip("the compiled span record builder is not built here")
    before = normalization.builder()
    normalization.use_builder(request.param)
    yield request.param
    normalization.use_builder(before)


def normalize_request(req: ExportTraceServiceRequest, **hosts: str) -> NormalizeResult:
    """The message path's result, checked against the byte reader's on the serialized body."""
    expected = from_message(req, **hosts)
    try:
        got = normalize_body(req.SerializeToString(), **hosts)
    except Unusual:
        return expected
    assert (got.spans, got.rejected, got.error_message) == (expected.spans, expected.rejected,
                                                           expected.error_message)
    return expected


def value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, list):
        out = AnyValue()
        out.array_value.values.extend(value(x) for x in v)
        return out
    if isinstance(v, dict):
        out = AnyValue()
        out.kvlist_value.values.extend(KeyValue(key=k, value=value(x)) for k, x in v.items())
        return out
    return AnyValue(string_value=v)


def request(*spans: Span, resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, v in (resource or {"service.name": "engine", "host.name": "gpu-1"}).items():
        rs.resource.attributes.add(key=key, value=value(v))
    rs.scope_spans.add().spans.extend(spans)
    return req


def span(name: str, kind: int, attrs: dict[str, Any], *, span_id: bytes = b"\x01" * 8,
         trace_id: bytes = TRACE, start: int = 1_000, end: int = 2_000, parent: bytes = b"") -> Span:
    s = Span(name=name, kind=kind, trace_id=trace_id, span_id=span_id, parent_span_id=parent,
             start_time_unix_nano=start, end_time_unix_nano=end)
    s.attributes.extend(KeyValue(key=k, value=value(v)) for k, v in attrs.items())
    return s


OLD = {"http.method": "POST", "http.target": "/v1/completions?x=1", "http.route": "/v1/completions",
       "net.peer.ip": "127.0.0.1", "net.peer.port": 50123, "net.host.port": 8000,
       "http.status_code": 200, "http.request.header.x_request_id": ["req-7"]}
NEW = {"http.request.method": "POST", "url.path": "/v1/completions", "http.route": "/v1/completions",
       "client.address": "127.0.0.1", "client.port": 50123, "server.port": 8000,
       "http.response.status_code": 200, "http.request.header.x-request-id": ["req-7"]}


@pytest.mark.parametrize("attrs", [OLD, NEW, OLD | NEW], ids=["old", "new", "http-dup"])
def test_asgi_server_span_join_columns_under_every_convention(attrs: dict[str, Any]) -> None:
    result = normalize_request(request(span("POST /v1/completions", SERVER, attrs)))
    assert result.rejected == 0
    (record,) = result.spans
    assert record.role is SpanRole.HTTP_SERVER
    assert (record.peer_addr, record.peer_port, record.server_port) == ("127.0.0.1", 50123, 8000)
    assert record.request_id == "req-7"
    assert record.route == "/v1/completions"
    assert record.http_status == 200
    assert (record.service, record.host, record.kind) == ("engine", "gpu-1", "server")
    assert record.trace_id == TRACE.hex() and record.span_id == "01" * 8
    assert not record.peer_rewritten
    # Columns are not repeated in attributes; the method (no column) is kept there.
    assert "net.peer.port" not in record.attributes and "client.port" not in record.attributes
    assert record.attributes.get("http.method", record.attributes.get("http.request.method")) == "POST"


def test_socket_level_peer_wins_and_server_port_falls_back_to_host() -> None:
    attrs = {"http.method": "GET", "net.sock.peer.addr": "10.0.0.9", "net.sock.peer.port": 41000,
             "net.peer.ip": "192.0.2.1", "http.host": "10.0.0.1:8443", "http.target": "/health"}
    (record,) = normalize_request(request(span("GET", SERVER, attrs))).spans
    assert (record.peer_addr, record.peer_port, record.server_port) == ("10.0.0.9", 41000, 8443)
    assert record.route == "/health"
    attrs = {"http.request.method": "GET", "network.peer.address": "::1", "network.peer.port": 5,
             "url.full": "http://[::1]:9000/x"}
    (record,) = normalize_request(request(span("GET", SERVER, attrs))).spans
    assert (record.peer_addr, record.peer_port, record.server_port) == ("::1", 5, 9000)


def test_proxy_rewritten_peer_is_flagged() -> None:
    attrs = OLD | {"net.peer.ip": "203.0.113.5", "net.peer.port": 0}
    (record,) = normalize_request(request(span("POST", SERVER, attrs))).spans
    assert record.peer_rewritten and record.peer_port == 0
    no_port = {k: v for k, v in NEW.items() if k != "client.port"}
    (record,) = normalize_request(request(span("POST", SERVER, no_port))).spans
    assert record.peer_rewritten and record.peer_port is None


def test_vllm_llm_request_span() -> None:
    attrs = {"gen_ai.request.id": "cmpl-req-7", "gen_ai.usage.prompt_tokens": 12,
             "gen_ai.usage.completion_tokens": 40, "gen_ai.request.max_tokens": 64,
             "gen_ai.latency.time_in_queue": 0.25, "gen_ai.latency.time_to_first_token": 0.5,
             "gen_ai.response.finish_reasons": ["length"], "gen_ai.response.model": "m-1",
             "gen_ai.request.temperature": 0.7}
    req = request(span("llm_request", INTERNAL, attrs),
                  resource={"service.name": "vllm", "vllm.process_id": 4242})
    (record,) = normalize_request(req, service_host="node-a").spans
    assert record.role is SpanRole.ENGINE
    assert record.request_id == "cmpl-req-7"
    assert (record.prompt_tokens, record.completion_tokens, record.max_tokens) == (12, 40, 64)
    assert (record.time_in_queue_s, record.time_to_first_token_s) == (0.25, 0.5)
    assert (record.finish_reason, record.model, record.process_pid) == ("length", "m-1", 4242)
    assert record.host == "node-a"  # no host.name: the receiver's host
    assert record.attributes == {"gen_ai.request.temperature": 0.7}


@pytest.mark.parametrize(("sent", "read"), [
    ('["stop"]', "stop"), ('["abort"]', "abort"), ('["length", "stop"]', "length"),  # vLLM: json.dumps(list)
    (["stop"], "stop"), ("stop", "stop"),  # an array, as the GenAI conventions say; a plain string
    ("[stop", "[stop"), ("[1]", "[1]"), ("[]", "[]"), ("[" * 5000, "[" * 5000),  # not a list of text: as sent
])
def test_finish_reasons_sent_as_json_text(sent: Any, read: str) -> None:
    """vLLM sets gen_ai.response.finish_reasons to json.dumps([reason]): a string. Read as it
    came, a normal finish never read as one."""
    attrs = {"gen_ai.request.id": "cmpl-1", "gen_ai.response.finish_reasons": sent}
    (record,) = normalize_request(request(span("llm_request", SERVER, attrs))).spans
    assert record.finish_reason == cut_text(read, normalization._COLUMN_CHARS["finish_reason"])


def test_genai_input_output_token_names_and_process_pid() -> None:
    attrs = {"gen_ai.request.id": "x", "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 9,
             "gen_ai.request.model": "m-req", "gen_ai.response.finish_reasons": ["stop", "length"]}
    req = request(span("llm_request", SERVER, attrs), resource={"process.pid": 77})
    (record,) = normalize_request(req).spans
    assert (record.prompt_tokens, record.completion_tokens) == (3, 9)
    assert (record.model, record.finish_reason, record.process_pid) == ("m-req", "stop", 77)


def test_gateway_client_span() -> None:
    attrs = {"http.request.method": "POST", "server.address": "engine.internal", "server.port": 8000,
             "url.full": "http://engine.internal:8000/v1/chat/completions",
             "http.request.header.x-request-id": "gw-1", "http.response.status_code": 502}
    (record,) = normalize_request(request(span("POST", CLIENT, attrs))).spans
    assert record.role is SpanRole.HTTP_CLIENT
    assert (record.peer_addr, record.server_port, record.request_id) == ("engine.internal", 8000, "gw-1")
    assert record.http_status == 502


def test_other_spans_and_wrong_types_read_as_missing() -> None:
    attrs = {"http.method": "GET", "net.peer.port": "not a port", "net.host.port": 70000,
             "http.status_code": True, "gen_ai.usage.prompt_tokens": -5}
    (record,) = normalize_request(request(span("GET", SERVER, attrs))).spans
    assert (record.peer_port, record.server_port, record.http_status) == (None, None, None)
    assert record.attributes["net.peer.port"] == "not a port"
    (other,) = normalize_request(request(span("work", INTERNAL, {"a": 1}))).spans
    assert other.role is SpanRole.OTHER and other.kind == "internal"
    # Digits other than ASCII's read as missing too: "²" passes str.isdigit() but not int().
    odd = {"http.method": "GET", "http.status_code": "\u00b2", "net.peer.port": "\u0661\u0662", "net.host.port": " 8000 "}
    (record,) = normalize_request(request(span("GET", SERVER, odd))).spans
    assert (record.http_status, record.peer_port, record.server_port) == (None, None, 8000)
    assert record.attributes["http.status_code"] == "\u00b2"


def test_bad_spans_are_rejected_one_by_one() -> None:
    good = span("ok", SERVER, {}, span_id=b"\x02" * 8)
    bad = [
        span("short trace", SERVER, {}, trace_id=b"\x01" * 5, span_id=b"\x03" * 8),
        span("zero trace", SERVER, {}, trace_id=b"\x00" * 16, span_id=b"\x04" * 8),
        span("bad span id", SERVER, {}, span_id=b"\x05" * 9),
        span("bad parent", SERVER, {}, span_id=b"\x06" * 8, parent=b"\x01"),
        span("backwards", SERVER, {}, span_id=b"\x07" * 8, start=5_000, end=4_000),
        span("year 2300", SERVER, {}, span_id=b"\x08" * 8, end=2**63),  # found by the fuzzer
    ]
    result = normalize_request(request(good, *bad))
    assert [s.name for s in result.spans] == ["ok"]
    assert result.rejected == 6
    assert "rejected 6 of 7 spans" in result.error_message
    assert "invalid trace id" in result.error_message and "ending before they start" in result.error_message


def test_hostile_attributes_are_bounded() -> None:
    nested: Any = "leaf"
    for _ in range(20):  # deeper than kept, shallower than protobuf's own parse limit
        nested = [nested]
    attrs = {f"k{i}": i for i in range(MAX_ATTRIBUTES + 50)}
    attrs["k0"] = "x" * (MAX_STRING_CHARS * 10)
    attrs["k1"] = nested
    attrs["k2"] = {"a": {"b": {"c": {"d": {"e": 1}}}}}
    attrs["k3"] = float("nan")
    attrs["k4"] = list(range(10_000))
    (record,) = normalize_request(request(span("big", INTERNAL, attrs))).spans
    assert len(record.attributes) <= MAX_ATTRIBUTES + 1
    assert record.attributes["auditor.dropped_attributes"] == 50
    assert len(record.attributes["k0"]) == MAX_STRING_CHARS
    assert TOO_DEEP_MARK in repr(record.attributes["k1"]) and TOO_DEEP_MARK in repr(record.attributes["k2"])
    assert record.attributes["k3"] == "nan"
    assert len(record.attributes["k4"]) == 64
    long_name = span("n" * 10_000, SERVER, {"http.method": "GET", "http.route": "/" + "r" * 1000})
    (record,) = normalize_request(request(long_name)).spans
    assert len(record.name) == 255 and len(record.route or "") == 255


def test_record_builder_fills_every_field_or_uses_the_constructor() -> None:
    import dataclasses

    from collectors.normalize import _slot_filler

    @dataclasses.dataclass(frozen=True, slots=True)
    class Pair:
        first: str
        second: int

    build = _slot_filler(Pair, ("first", "second"))
    assert build("a", 1) == Pair("a", 1)
    with pytest.raises(TypeError):
        build("a")  # a missing value is an error, never an unset slot
    # Fields in another order than the builder is called with: by keyword, never by position.
    assert _slot_filler(Pair, ("second", "first"))(2, "b") == Pair("b", 2)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        first: str
        second: int

        def __post_init__(self) -> None:
            if self.second < 0:
                raise ValueError("negative")

    with pytest.raises(ValueError, match="negative"):
        _slot_filler(Checked, ("first", "second"))("a", -1)


def test_the_senders_address_is_kept_on_each_span() -> None:
    """Each span of a request sent from a container's address keeps it (SENDER_KEY), in the
    attributes the store writes (read back in tests/test_cost_sharing.py); spans sent from the
    loopback keep nothing more. A span that sends the key itself from a container has it
    overwritten: where a span came from is the receiver's to say."""
    from auditor.semconv import SENDER_KEY

    req = request(span("POST", SERVER, OLD),
                  span("llm_request", INTERNAL, {SENDER_KEY: "10.0.0.9"}, span_id=b"\x02" * 8))
    got = normalize_request(req, sender="10.244.1.5")
    assert [s.attributes.get(SENDER_KEY) for s in got.spans] == ["10.244.1.5", "10.244.1.5"]
    assert got.spans[0].attributes is not got.spans[1].attributes
    plain = normalize_request(request(span("POST", SERVER, OLD)))
    assert SENDER_KEY not in plain.spans[0].attributes


@pytest.mark.parametrize(("named", "kept"), [("10.244.1.7", "10.244.1.7"), (" fd00::7 ", "fd00::7"),
                                             ("::ffff:10.244.1.7", "10.244.1.7"), ("127.0.0.1", "10.0.0.9"),
                                             ("not an address", "10.0.0.9"), ("", "10.0.0.9"), (7, "10.0.0.9")])
def test_a_resource_that_names_its_pods_address_keeps_it_where_a_collector_relayed_it(named: Any, kept: str) -> None:
    """Spans relayed by a collector come from its address (10.0.0.9); a resource with ``k8s.pod.ip``
    (the collector's k8sattributes processor, or the pod's own resource) keeps the pod's instead,
    each resource its own. What is no address, or a loopback one, leaves the sender's."""
    from auditor.semconv import SENDER_KEY

    req = request(span("POST", SERVER, OLD), resource={"service.name": "engine", "k8s.pod.ip": named})
    other = req.resource_spans.add()
    other.resource.attributes.add(key="service.name", value=value("engine"))
    other.scope_spans.add().spans.append(span("POST", SERVER, OLD, span_id=b"\x02" * 8))
    got = normalize_request(req, sender="10.0.0.9")
    assert [s.attributes.get(SENDER_KEY) for s in got.spans] == [kept, "10.0.0.9"]
    # From the loopback (a collector on this host), only the named pod is kept.
    local = normalize_request(req)
    assert [s.attributes.get(SENDER_KEY) for s in local.spans] == [None if kept == "10.0.0.9" else kept, None]
