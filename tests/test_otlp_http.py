"""OTLP/HTTP receiver on a real socket: real SDK exporters (protobuf, gzip), OTLP JSON bodies, every
error status of the specification, back-pressure from a full queue and from a locked database."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import event, text

from auditor.store import Store
from collectors.otlp_http import OtlpHttpReceiver
from collectors.spanwriter import SpanWriter

PB, JS = "application/x-protobuf", "application/json"


def rows(store: Store, sql: str = "SELECT name, role, request_id, service FROM spans ORDER BY name") -> list[Any]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def sdk_spans(count: int = 3, name: str = "llm_request") -> list[Any]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "engine", "process.pid": 99}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(count):
        with tracer.start_as_current_span(f"{name}-{i}" if i else name,
                                          attributes={"gen_ai.request.id": f"cmpl-{i}"}):
            pass
    return list(memory.get_finished_spans())


def post(port: int, body: bytes, headers: dict[str, str] | None = None, *, path: str = "/v1/traces",
         method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": PB} | (headers or {}))
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def json_body(spans: list[dict[str, Any]]) -> bytes:
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "js"}}]},
        "scopeSpans": [{"scope": {"name": "t"}, "spans": spans}],
    }]}).encode()


def json_span(name: str, span_id: str, trace_id: str = "5b8efff798038103d269b633813fc60c",
              **extra: Any) -> dict[str, Any]:
    return {"traceId": trace_id, "spanId": span_id, "name": name, "kind": 2,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000500000000",
            "attributes": [{"key": "http.method", "value": {"stringValue": "GET"}},
                           {"key": "net.peer.port", "value": {"intValue": "40000"}}],
            "status": {"code": "STATUS_CODE_OK"}} | extra


@pytest.fixture
def receiver(writer: SpanWriter) -> Iterator[OtlpHttpReceiver]:
    r = OtlpHttpReceiver(writer, port=0, max_body_bytes=1 << 20, service_host="node-a").start()
    yield r
    r.stop()


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_sdk_exporter_spans_are_committed(compression: Compression, receiver: OtlpHttpReceiver,
                                          store: Store) -> None:
    exporter = OTLPSpanExporter(endpoint=receiver.url, compression=compression, timeout=10)
    assert exporter.export(sdk_spans()) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert rows(store) == [("llm_request", "engine", "cmpl-0", "engine"),
                           ("llm_request-1", "other", "cmpl-1", "engine"),
                           ("llm_request-2", "other", "cmpl-2", "engine")]
    assert rows(store, "SELECT DISTINCT host, process_pid FROM spans") == [("node-a", 99)]
    assert receiver.stats()["accepted_spans"] == 3 and receiver.stats()["requests_by_status"] == {200: 1}


def test_json_body_with_hex_ids_and_partial_success(receiver: OtlpHttpReceiver, store: Store) -> None:
    body = json_body([
        json_span("good", "eee19b7ec3c1b174", parentSpanId="eee19b7ec3c1b173"),
        json_span("bad-hex", "zzzz9b7ec3c1b174"),
        json_span("short", "eee1"),
        json_span("backwards", "eee19b7ec3c1b175", endTimeUnixNano="1"),
    ])
    for encoding in ("identity", "gzip"):
        payload = gzip.compress(body) if encoding == "gzip" else body
        status, headers, answer = post(receiver.port, payload,
                                       {"Content-Type": "application/json; charset=utf-8",
                                        "Content-Encoding": encoding})
        assert status == 200, answer
        assert headers["content-type"] == JS
        partial = json.loads(answer)["partialSuccess"]
        assert int(partial["rejectedSpans"]) == 3
        assert "invalid span id" in partial["errorMessage"]
    (stored,) = rows(store, "SELECT name, trace_id, span_id, parent_span_id, kind, status, peer_port, start_ns FROM spans")
    assert stored == ("good", "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "eee19b7ec3c1b173",
                      "server", "ok", 40000, 1700000000000000000)
    assert receiver.rejected_spans == 6


def test_protobuf_partial_success(receiver: OtlpHttpReceiver, store: Store) -> None:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    spans.add(name="ok", trace_id=b"\x01" * 16, span_id=b"\x02" * 8, start_time_unix_nano=1, end_time_unix_nano=2)
    spans.add(name="bad", trace_id=b"\x01" * 3, span_id=b"\x03" * 8, start_time_unix_nano=1, end_time_unix_nano=2)
    status, headers, answer = post(receiver.port, request.SerializeToString())
    assert status == 200 and headers["content-type"] == PB
    response = ExportTraceServiceResponse.FromString(answer)
    assert response.partial_success.rejected_spans == 1
    assert "invalid trace id" in response.partial_success.error_message
    assert [r[0] for r in rows(store)] == ["ok"]


def status_message(body: bytes, content_type: str = PB) -> str:
    if content_type == JS:
        return str(json.loads(body)["message"])
    return status_pb2.Status.FromString(body).message


def test_malformed_bodies_get_400_with_a_status(receiver: OtlpHttpReceiver) -> None:
    status, _, body = post(receiver.port, b"\xff\xff\xff\x0fnot protobuf")
    assert status == 400 and "not a valid ExportTraceServiceRequest" in status_message(body)
    status, _, body = post(receiver.port, b"{not json", {"Content-Type": JS})
    assert status == 400 and "not valid JSON" in status_message(body, JS)
    status, _, body = post(receiver.port, json.dumps({"resourceSpans": "nope"}).encode(), {"Content-Type": JS})
    assert status == 400 and "not an OTLP ExportTraceServiceRequest" in status_message(body, JS)
    status, _, body = post(receiver.port, b"[1]", {"Content-Type": JS})
    assert status == 400 and "must be an object" in status_message(body, JS)
    status, _, body = post(receiver.port, b"\x1f\x8b garbage", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip" in status_message(body)


def test_routing_auth_type_and_size_errors(writer: SpanWriter) -> None:
    receiver = OtlpHttpReceiver(writer, port=0, token="s3cret", max_body_bytes=1000).start()
    try:
        ok = {"Authorization": "Bearer s3cret"}
        assert post(receiver.port, b"", ok, path="/v1/profiles")[0] == 404
        assert post(receiver.port, b"", ok, method="GET")[0] == 405
        status, headers, _ = post(receiver.port, b"")
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert post(receiver.port, b"", {"Authorization": "Bearer wrong"})[0] == 401
        assert post(receiver.port, b"", ok)[0] == 200  # an empty request is a valid, empty export
        assert post(receiver.port, b"x", ok | {"Content-Type": "text/plain"})[0] == 415
        assert post(receiver.port, b"x", ok | {"Content-Encoding": "br"})[0] == 415
        assert post(receiver.port, b"x" * 1001, ok)[0] == 413
        bomb = gzip.compress(b"\x00" * (50 << 20))  # 50 MiB of zeros in ~50 KiB... over 1000 bytes too
        assert post(receiver.port, bomb, ok | {"Content-Encoding": "gzip"})[0] == 413
        small_bomb = gzip.compress(b"\x00" * 100_000)
        assert len(small_bomb) < 1000
        status, _, body = post(receiver.port, small_bomb, ok | {"Content-Encoding": "gzip"})
        assert status == 413 and "inflates past the limit" in status_message(body)
        by_status = receiver.stats()["requests_by_status"]
        assert by_status == {404: 1, 405: 1, 401: 2, 200: 1, 415: 2, 413: 3}
    finally:
        receiver.stop()


def test_garbage_on_the_socket_leaves_the_server_up(receiver: OtlpHttpReceiver) -> None:
    for junk in (b"\x00\x01\x02garbage\r\n\r\n", b"POST /v1/traces HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: zz\r\n\r\n",
                 b"POST /v1/traces HTTP/1.1\r\nContent-Type: application/x-protobuf\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
            sock.sendall(junk)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            # A request line that is not HTTP/1.x gets http.server's HTTP/0.9-style error page.
            assert b"400" in answer or b"411" in answer, answer
    assert post(receiver.port, b"")[0] == 200


def raw_exchange(port: int, request: bytes) -> bytes:
    """Send raw bytes, read until the server closes or goes quiet; returns everything it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        sock.settimeout(1.0)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            pass
        return answer


def chunked_post(body: bytes, chunk_size: int, *, close: bool = False) -> bytes:
    parts = [body[i:i + chunk_size] for i in range(0, len(body), chunk_size)]
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"
    return (b"POST /v1/traces HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n" + (b"Connection: close\r\n" if close else b"") + b"\r\n" + framed)


def test_headers_are_read_in_any_case_and_bad_ones_refused(receiver: OtlpHttpReceiver, store: Store) -> None:
    body = json_body([json_span("headers-a", "00000000000000b1")])
    # Names in any case, a repeated header's first value, spaces around values, two requests on
    # one keep-alive connection, and Expect: 100-continue answered before the body.
    request = (b"POST /v1/traces HTTP/1.1\r\nhOsT: t\r\ncontent-TYPE:   application/json  \r\n"
               b"Content-Type: application/x-protobuf\r\nCONTENT-LENGTH: %d\r\n\r\n%s" % (len(body), body))
    expect = request.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n", 1)
    answer = raw_exchange(receiver.port, request + expect)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b" 200 OK") == 2, answer
    assert b"HTTP/1.1 100 Continue" in answer and answer.index(b"100 Continue") < answer.rindex(b" 200 OK")
    assert [r[0] for r in rows(store)] == ["headers-a"]
    # A line without a colon is refused (the email package took it for the end of the headers),
    # as are a space before the colon and a folded line (RFC 9112 5.1, 5.2).
    head = b"POST /v1/traces HTTP/1.1\r\nHost: t\r\n"
    for headers, status in ((b"No colon here\r\n", b" 400 "), (b"Name : value\r\n", b" 400 "),
                            (b"X-A: 1\r\n folded\r\n", b" 400 "), (b": nameless\r\n", b" 400 "),
                            (b"X-Long: " + b"a" * 70_000 + b"\r\n", b" 431 "),
                            (b"".join(b"X-%d: 1\r\n" % i for i in range(101)), b" 431 ")):
        answer = raw_exchange(receiver.port, head + headers + b"Content-Length: 0\r\n\r\n")
        assert status in answer.split(b"\r\n", 1)[0], (headers[:30], answer[:200])
    answer = raw_exchange(receiver.port, b"POST /v1/traces HTTP/2.0\r\nHost: t\r\n\r\n")
    assert b" 505 " in answer.split(b"\r\n", 1)[0], answer
    assert post(receiver.port, b"")[0] == 200  # still up


def test_chunked_bodies_are_read_and_bad_framing_is_refused(receiver: OtlpHttpReceiver, store: Store) -> None:
    body = json_body([json_span("chunked-a", "00000000000000a1"), json_span("chunked-b", "00000000000000a2")])
    # Two chunked requests on one keep-alive connection: both answered 200, both stored.
    answer = raw_exchange(receiver.port, chunked_post(body, 37) + chunked_post(body, 1000, close=True))
    assert answer.count(b"HTTP/1.0 200") + answer.count(b"HTTP/1.1 200") == 2, answer
    assert sorted(r[0] for r in rows(store)) == ["chunked-a", "chunked-b"]  # the repeat is a duplicate
    head = b"POST /v1/traces HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    for framing, status, message in (
            (b"zz\r\nabc\r\n0\r\n\r\n", b" 400 ", b"bad chunk size"),
            (b"-5\r\nabc\r\n0\r\n\r\n", b" 400 ", b"bad chunk size"),
            (b"0_3\r\nabc\r\n0\r\n\r\n", b" 400 ", b"bad chunk size"),
            (b"3\r\nabcXY0\r\n\r\n", b" 400 ", b"lacks its CRLF"),
            (b"a" * 3000, b" 400 ", b"chunk-size line"),
            (b"%x\r\n" % ((1 << 20) + 1), b" 413 ", b"over the limit")):
        answer = raw_exchange(receiver.port, head + framing)
        assert status in answer.split(b"\r\n", 1)[0] and message in answer, (framing[:20], answer)
    answer = raw_exchange(receiver.port, head.replace(b"chunked", b"gzip, chunked") + b"0\r\n\r\n")
    assert b" 501 " in answer.split(b"\r\n", 1)[0] and b"not supported" in answer, answer
    assert post(receiver.port, b"")[0] == 200  # still up


def _fast_busy_store(path: Path) -> Store:
    """A store whose connections give up on a lock after 0.3 s instead of 5 s (keeps the test short)."""
    store = Store(f"sqlite:///{path}")
    event.listen(store.engine, "connect", lambda dbapi, _rec: dbapi.execute("PRAGMA busy_timeout=300"))
    store.engine.dispose()
    return store


def test_locked_database_gives_503_then_recovers(tmp_path: Path) -> None:
    store = _fast_busy_store(tmp_path / "a.db")
    writer = SpanWriter(store, retry_after_s=0.5).start()
    receiver = OtlpHttpReceiver(writer, port=0).start()
    body = _encode(sdk_spans(2))
    locker = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        status, headers, answer = post(receiver.port, body)
        assert status == 503, answer
        assert headers["retry-after"] == "1"
        assert "database is locked" in status_message(answer)
        assert post(receiver.port, body)[0] == 503  # refused at once during the cool-down
        locker.execute("ROLLBACK")
        time.sleep(0.6)
        assert post(receiver.port, body)[0] == 200
        assert len(rows(store)) == 2
        assert writer.stats()["failed_commits"] == 1
    finally:
        locker.close()
        receiver.stop()
        writer.stop()
        store.close()


def _encode(spans: list[Any]) -> bytes:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return bytes(encode_spans(spans).SerializeToString())


def test_full_queue_gives_429_and_concurrent_requests_share_commits(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    writer = SpanWriter(store, max_queue_spans=20, queue_wait_s=0).start()
    receiver = OtlpHttpReceiver(writer, port=0).start()
    locker = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    results: list[int] = []
    try:
        # Hold the write lock briefly (well under the busy timeout) so requests pile up in the queue.
        locker.execute("BEGIN EXCLUSIVE")
        threads = [threading.Thread(target=lambda i=i: results.append(
            post(receiver.port, _encode(sdk_spans(4, name=f"r{i}")))[0])) for i in range(5)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 5
        while writer.queue_depth_spans < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, answer = post(receiver.port, _encode(sdk_spans(4, name="late")))
        assert status == 429 and headers["retry-after"] == "1", answer
        locker.execute("ROLLBACK")
        for thread in threads:
            thread.join(10)
        assert sorted(results) == [200] * 5
        assert len(rows(store)) == 20
        assert writer.stats()["commits"] < 5  # five requests, fewer transactions: group commit
    finally:
        locker.close()
        receiver.stop()
        writer.stop()
        store.close()


def test_connection_storm_beyond_the_cap_gets_503(writer: SpanWriter) -> None:
    receiver = OtlpHttpReceiver(writer, port=0, max_connections=2, socket_timeout_s=2).start()
    idle = [socket.create_connection(("127.0.0.1", receiver.port)) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as extra:
            assert extra.recv(100).startswith(b"HTTP/1.1 503")
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if post(receiver.port, b"")[0] == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("receiver did not accept connections again")
    receiver.stop()


@pytest.mark.parametrize("line", [
    b"POST /v1/traces HTTP/1.1\r\n", b"POST /v1/traces HTTP/1.0\r\n", b"POST //v1//traces HTTP/1.1\r\n",
    b"POST /v1/traces HTTP/01.1\r\n", b"POST /v1/traces HTTP/1.01\r\n", b"POST /v1/traces HTTP/1.1\n",
    b"post /v1/traces HTTP/1.1\r\n", b"POST /v1/traces\xa0x HTTP/1.1\r\n", b"POST /v1/traces HTTP/1.12345678901\r\n",
    b"POST /v1/traces HTTP/1.1x\r\n", b"POST /v1/traces http/1.1\r\n", b"POST /v1/traces HTTP/1\r\n",
    b"POST /v1/traces HTTP/0.9\r\n", b"POST /v1/traces HTTP/2.0\r\n", b"POST /v1/traces HTTP/1.\xb2\r\n",
    b"POST /v1/traces HTTP/1.\xd9\xa1\r\n", b"POST\r\n", b"POST /v1/traces\r\n", b"GET /v1/traces\r\n",
    b"POST /v1/traces x HTTP/1.1\r\n", b"\r\n", b" \t \r\n", b"\x00\x01\x02garbage\r\n",
])
def test_request_lines_are_read_as_http_server_reads_them(line: bytes) -> None:
    """The receivers read request lines themselves (auditor.http1: importing ``http.server`` costs
    the daemon ssl and the email package): a line the standard library takes is taken with the same
    fields, one it refuses is refused with the same status, and HTTP/0.9's two-word GET, which it
    serves, is refused with 400."""
    import io
    from http.server import BaseHTTPRequestHandler

    from auditor.http1 import RequestLine, parse_request_line

    refused: list[int] = []
    standard = BaseHTTPRequestHandler.__new__(BaseHTTPRequestHandler)
    standard.protocol_version = "HTTP/1.1"
    standard.raw_requestline = line  # type: ignore[attr-defined]  # set by handle_one_request
    standard.rfile, standard.wfile = io.BytesIO(b"\r\n"), io.BytesIO()
    standard.client_address, standard.request_version = ("127.0.0.1", 1), "HTTP/0.9"
    standard.send_error = lambda code, *args: refused.append(code)  # type: ignore[method-assign]
    took = standard.parse_request()
    ours = parse_request_line(line)
    if took and len(line.split()) == 2:  # HTTP/0.9's form
        assert isinstance(ours, tuple) and ours[0] == 400 and "HTTP/0.9" in ours[1], ours
    elif took:
        assert ours == RequestLine(standard.command, standard.path, standard.request_version,
                                   not standard.close_connection), ours
    elif refused:
        assert not isinstance(ours, RequestLine) and ours is not None and ours[0] == refused[0], (ours, refused)
    else:  # an empty line: nothing answered, the connection closed
        assert ours is None


@pytest.mark.parametrize(("rejected", "message"), [(0, ""), (1, ""), (0, "why"), (3, "2 spans without a trace id"),
                                                   (300, "é" * 200), (2**40, "x")])
def test_the_written_out_answers_are_what_protobuf_writes(rejected: int, message: str) -> None:
    """The protobuf answers are written without protobuf (the daemon does not import it for the
    usual body): byte for byte what the messages serialize to, and what an exporter parses back."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceResponse,
    )

    from collectors import otlp_codec as codec

    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    assert codec.encode_response(codec.PROTOBUF, rejected, message) == response.SerializeToString()
    parsed = ExportTraceServiceResponse.FromString(codec.encode_response(codec.PROTOBUF, rejected, message))
    assert (parsed.partial_success.rejected_spans, parsed.partial_success.error_message) == (rejected, message)
    for code in (0, 3, 14, -1, 2**31 - 1):
        status = status_pb2.Status(code=code, message=message)
        assert codec.encode_status(codec.PROTOBUF, code, message) == status.SerializeToString()
    assert codec.encode_empty_response(codec.PROTOBUF, "metrics") == ExportMetricsServiceResponse().SerializeToString()
    assert codec.encode_empty_response(codec.PROTOBUF, "logs") == ExportLogsServiceResponse().SerializeToString()
