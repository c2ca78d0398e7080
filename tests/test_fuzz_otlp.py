"""Fuzz the OTLP/HTTP receiver over a real socket with hypothesis: 10,000 cases in all (see CASES)
of random and truncated protobuf, chunked framing, mutated protobuf, wrong JSON types, huge
attributes, deep nesting, gzip bombs and garbage, and bad hex ids. Every case must get a defined answer (200/400/413/415)
within a bounded time, the server must stay up, and valid spans sent alongside must be stored.

Derandomized (same cases every run) under the ``otlp-fuzz`` settings profile; about 30-60 s here.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sqlalchemy import text

from auditor.store import Store
from collectors.otlp_http import OtlpHttpReceiver
from collectors.spanwriter import SpanWriter

CASES = {"random_protobuf": 1500, "chunked_framing": 500, "truncated_protobuf": 1500, "mutated_protobuf": 1500,
         "json_wrong_types": 2000, "huge_and_deep": 1000, "gzip": 1000, "bad_hex_ids": 1000}
assert sum(CASES.values()) == 10_000
MAX_BODY = 256 * 1024
CASE_TIME_LIMIT_S = 5.0  # a hang would hit the socket timeout (10 s) first; this bounds each case
ALLOWED = {200, 400, 413, 415}

settings.register_profile("otlp-fuzz", derandomize=True, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)


class Client:
    """A keep-alive connection that reconnects when the server closed it (after refusing a body)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None
        self.slowest_s = 0.0
        self.canaries_sent = 0
        self.cases = 0
        self.id_cases = 0
        self.alongside = 0

    def post(self, body: bytes, content_type: str = "application/x-protobuf",
             encoding: str | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": content_type} | ({"Content-Encoding": encoding} if encoding else {})
        started = time.monotonic()
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                self.conn.request("POST", "/v1/traces", body=body, headers=headers)
                response = self.conn.getresponse()
                answer = response.read()
                if response.will_close:
                    self.conn.close()
                    self.conn = None
                break
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        return response.status, answer

    def case(self, body: bytes, content_type: str = "application/x-protobuf", encoding: str | None = None) -> int:
        status, answer = self.post(body, content_type, encoding)
        assert status in ALLOWED, (status, answer[:200])
        self.cases += 1
        if self.cases % 100 == 0:  # a valid span alongside the garbage, checked at the end
            self.canaries_sent += 1
            canary = valid_request(f"canary-{self.canaries_sent}", span_id=self.canaries_sent,
                                   trace_id=b"\xca" * 16)  # a trace of its own: never a duplicate
            assert self.post(canary.SerializeToString())[0] == 200
        return status


def valid_request(name: str, *, span_id: int = 1, attrs: dict[str, str] | None = None,
                  trace_id: bytes = b"\x0f" * 16) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "fuzz"
    span = rs.scope_spans.add().spans.add(
        name=name, kind=2, trace_id=trace_id, span_id=span_id.to_bytes(8, "big"),
        start_time_unix_nano=1_700_000_000_000_000_000, end_time_unix_nano=1_700_000_000_100_000_000)
    for key, value in ({"http.method": "POST", "net.peer.port": "1"} | (attrs or {})).items():
        span.attributes.add(key=key).value.string_value = value
    return request


VALID_BYTES = valid_request("template", span_id=77, attrs={"x": "y" * 40}).SerializeToString()


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Store, OtlpHttpReceiver]]:
    path: Path = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    store = Store(f"sqlite:///{path}")
    writer = SpanWriter(store).start()
    receiver = OtlpHttpReceiver(writer, port=0, max_body_bytes=MAX_BODY, socket_timeout_s=10).start()
    client = Client(receiver.port)
    yield client, store, receiver
    receiver.stop()
    writer.stop()
    store.close()


def _check_alive(client: Client, receiver: OtlpHttpReceiver, store: Store) -> None:
    assert receiver._thread is not None and receiver._thread.is_alive()
    assert client.post(valid_request("after", span_id=999_999).SerializeToString())[0] == 200
    with store.engine.connect() as conn:
        canaries = conn.execute(text("SELECT count(*) FROM spans WHERE name LIKE 'canary-%'")).scalar()
    assert canaries == client.canaries_sent
    assert client.slowest_s < CASE_TIME_LIMIT_S, client.slowest_s


# -- protobuf -------------------------------------------------------------------------------------
@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["random_protobuf"])
@given(body=st.binary(max_size=512))
def _random_protobuf(client: Client, body: bytes) -> None:
    client.case(body)


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["truncated_protobuf"])
@given(cut=st.integers(min_value=0, max_value=len(VALID_BYTES)), tail=st.binary(max_size=8))
def _truncated_protobuf(client: Client, cut: int, tail: bytes) -> None:
    client.case(VALID_BYTES[:cut] + tail)


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["mutated_protobuf"])
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def _mutated_protobuf(client: Client, edits: list[tuple[int, int]]) -> None:
    body = bytearray(VALID_BYTES)
    for index, byte in edits:
        body[index] = byte
    client.case(bytes(body))


# -- chunked framing ----------------------------------------------------------------------------
chunk_pieces = st.lists(st.one_of(
    st.binary(min_size=1, max_size=40).map(lambda data: b"%x\r\n%s\r\n" % (len(data), data)),  # well formed
    st.tuples(st.integers(0, 1 << 24), st.binary(max_size=40)).map(lambda t: b"%x\r\n%s\r\n" % t),  # size lies
    st.sampled_from([b"0x10\r\n", b"-1\r\n", b"\r\n", b"1;" + b"e" * 2000 + b"\r\n", b"ffffffffffffffffffff\r\n",
                     b"5;name=value\r\nhello\r\n", b"3\r\nabc", b"0\r\n", b"0\r\nTrailer: x\r\n\r\n"]),
    st.binary(max_size=20),
), max_size=6)


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["chunked_framing"])
@given(pieces=chunk_pieces, terminate=st.booleans())
def _chunked_framing(client: Client, pieces: list[bytes], terminate: bool) -> None:
    """Raw chunked framing on a fresh connection, the sender's side shut after it: a truncated
    body must end in 400 at EOF, never a wait for the socket timeout."""
    framing = b"".join(pieces) + (b"0\r\n\r\n" if terminate else b"")
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", client.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: f\r\nContent-Type: application/x-protobuf\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + framing)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        # The server stops reading at a framing error and closes: the rest it never read makes
        # that close a reset, which may follow its answer here.
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(65536):
                answer += data
    assert answer.startswith(b"HTTP/1."), answer[:300]
    client.slowest_s = max(client.slowest_s, time.monotonic() - started)
    status = int(answer.split(b" ", 2)[1])
    assert status in ALLOWED, answer[:300]
    client.cases += 1


# -- JSON -----------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
SPAN_FIELDS = ["traceId", "spanId", "parentSpanId", "name", "kind", "startTimeUnixNano", "endTimeUnixNano",
               "attributes", "status", "events", "links", "droppedAttributesCount"]


def json_span(**overrides: Any) -> dict[str, Any]:
    return {"traceId": "0f" * 16, "spanId": "0e" * 8, "name": "j", "kind": 2,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000100000000",
            "attributes": [{"key": "k", "value": {"stringValue": "v"}}]} | overrides


def json_request(spans: list[Any], resource: Any = None) -> bytes:
    return json.dumps({"resourceSpans": [{"resource": resource or {"attributes": []},
                                          "scopeSpans": [{"spans": spans}]}]}).encode()


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["json_wrong_types"])
@given(field=st.sampled_from([*SPAN_FIELDS, "resource", "scopeSpans", "resourceSpans"]), value=json_values)
def _json_wrong_types(client: Client, field: str, value: Any) -> None:
    if field == "resourceSpans":
        body = json.dumps({"resourceSpans": value}).encode()
    elif field == "scopeSpans":
        body = json.dumps({"resourceSpans": [{"scopeSpans": value}]}).encode()
    elif field == "resource":
        body = json_request([json_span()], resource=value)
    else:
        body = json_request([json_span(**{field: value})])
    client.case(body, "application/json")


# -- huge and deep ----------------------------------------------------------------------------------
def _nested_json(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"stringValue": "leaf"}
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return value


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["huge_and_deep"])
@given(kind=st.sampled_from(["deep_json", "deep_raw_json", "deep_protobuf", "huge_string", "many_attributes"]),
       size=st.integers(1, 5000))
def _huge_and_deep(client: Client, kind: str, size: int) -> None:
    if kind == "deep_json":
        body = json_request([json_span(attributes=[{"key": "deep", "value": _nested_json(size % 200)}])])
        client.case(body, "application/json")
    elif kind == "deep_raw_json":
        client.case(b"[" * size * 10 + b"]" * size * 10, "application/json")
    elif kind == "deep_protobuf":
        # AnyValue nested `size` times: ArrayValue(field 5) -> values(field 1) -> AnyValue ...
        inner = b"\x0a\x04leaf"
        for _ in range(min(size, 2000)):
            array = b"\x0a" + _varint(len(inner)) + inner
            inner = b"\x2a" + _varint(len(array)) + array
        kv = b"\x0a\x01k" + b"\x12" + _varint(len(inner)) + inner
        template = valid_request("deep", span_id=5)
        span_bytes = template.resource_spans[0].scope_spans[0].spans[0].SerializeToString() + b"\x4a" + _varint(len(kv)) + kv
        scope = b"\x12" + _varint(len(span_bytes)) + span_bytes
        resource_spans = b"\x12" + _varint(len(scope)) + scope
        client.case(b"\x0a" + _varint(len(resource_spans)) + resource_spans)
    elif kind == "huge_string":
        request = valid_request("huge", span_id=6, attrs={"big": "z" * (size * 40)})
        client.case(request.SerializeToString())
    else:
        request = valid_request("many", span_id=7, attrs={f"a{i}": "v" for i in range(size)})
        client.case(request.SerializeToString())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# -- gzip ---------------------------------------------------------------------------------------------
BOMBS = [gzip.compress(b"\x00" * n, compresslevel=9) for n in (MAX_BODY + 1, 4 * MAX_BODY, 64 << 20)]
VALID_GZIP = gzip.compress(VALID_BYTES)


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["gzip"])
@given(kind=st.sampled_from(["bomb", "truncated", "garbage", "double"]), index=st.integers(0, 10_000),
       junk=st.binary(max_size=64))
def _gzip_cases(client: Client, kind: str, index: int, junk: bytes) -> None:
    if kind == "bomb":
        bomb = BOMBS[index % len(BOMBS)]
        status = client.case(bomb if len(bomb) <= MAX_BODY else bomb[:MAX_BODY], encoding="gzip")
        assert status in (400, 413)
    elif kind == "truncated":
        client.case(VALID_GZIP[: index % len(VALID_GZIP)], encoding="gzip")
    elif kind == "garbage":
        assert client.case(b"\x1f\x8b" + junk, encoding="gzip") == 400
    else:
        client.case(gzip.compress(VALID_GZIP) + junk, encoding="gzip")


# -- bad hex ids ----------------------------------------------------------------------------------------
hexish = st.text(alphabet="0123456789abcdefABCDEFxyz -", max_size=40) | st.integers() | st.none()


@settings(settings.get_profile("otlp-fuzz"), max_examples=CASES["bad_hex_ids"])
@given(trace_id=hexish, span_id=hexish, parent=hexish)
def _bad_hex_ids(client: Client, trace_id: Any, span_id: Any, parent: Any) -> None:
    client.id_cases += 1
    good_id = f"{client.id_cases:016x}"
    good = json_span(traceId="ab" * 16, spanId=good_id, name="alongside")
    odd = json_span(traceId=trace_id, spanId=span_id, parentSpanId=parent, name="odd")
    status = client.case(json_request([good, odd]), "application/json")
    assert status == 200  # ids never fail the request: the odd span is accepted or rejected alone
    client.alongside += 1


FUZZERS = {"random_protobuf": _random_protobuf, "chunked_framing": _chunked_framing, "truncated_protobuf": _truncated_protobuf,
           "mutated_protobuf": _mutated_protobuf, "json_wrong_types": _json_wrong_types,
           "huge_and_deep": _huge_and_deep, "gzip": _gzip_cases, "bad_hex_ids": _bad_hex_ids}


@pytest.mark.parametrize("name", list(CASES))
def test_fuzz_http_receiver(name: str, fuzz_target: tuple[Client, Store, OtlpHttpReceiver]) -> None:
    client, store, receiver = fuzz_target
    before = client.cases
    FUZZERS[name](client)
    assert client.cases - before >= CASES[name] * 0.9  # hypothesis may stop early on a small space
    _check_alive(client, receiver, store)
    if name == "bad_hex_ids":
        with store.engine.connect() as conn:
            alongside = conn.execute(text("SELECT count(*) FROM spans WHERE name = 'alongside'")).scalar()
        assert alongside == client.alongside


def test_base64_ids_in_json_are_rejected_per_span(fuzz_target: tuple[Client, Store, OtlpHttpReceiver]) -> None:
    client, _store, _receiver = fuzz_target
    b64 = base64.b64encode(b"\x01" * 16).decode()  # protobuf-JSON style, not OTLP JSON
    status, answer = client.post(json_request([json_span(traceId=b64)]), "application/json")
    assert status == 200 and json.loads(answer)["partialSuccess"]["rejectedSpans"] == "1"
