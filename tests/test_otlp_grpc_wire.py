"""The OTLP/gRPC receiver's HTTP/2 layer, frame by frame: an h2 client (or raw bytes) in the test,
the receiver on a real socket. Every case ends by checking that the receiver still serves and holds
no call or connection it should have let go; garbage is fuzzed with hypothesis (derandomized)."""

from __future__ import annotations

import gzip
import logging
import shutil
import socket
import sqlite3
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from sqlalchemy import text

from auditor.store import Store
from collectors.otlp_grpc import OtlpGrpcReceiver
from collectors.spanwriter import SpanWriter
from tests.test_otlp_grpc import sdk_spans

TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def grpc_frame(message: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BI", flag, len(message)) + message


def request_bytes(count: int = 2) -> bytes:
    return encode_spans(sdk_spans(count)).SerializeToString()


class Client:
    """An HTTP/2 client over a plain socket, for the requests grpcio would never send."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.flush()
        self.answers: dict[int, dict[str, Any]] = {}
        self.terminated: h2.events.ConnectionTerminated | None = None

    def flush(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def start(self, path: str = TRACES, content_type: str = "application/grpc",
              extra: tuple[tuple[str, str], ...] = ()) -> int:
        stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":authority", "t"),
                                      (":path", path), ("content-type", content_type), ("te", "trailers"),
                                      *extra])
        self.flush()
        return stream

    def send(self, stream: int, body: bytes, end: bool = True) -> bool:
        """Send within flow control; False once the server has reset the stream."""
        view = memoryview(body)
        while view:
            if "reset" in self.answers.get(stream, {}):
                return False
            window = min(self.h2.local_flow_control_window(stream), self.h2.max_outbound_frame_size)
            if window <= 0:
                self.read(lambda: "reset" in self.answers.get(stream, {})
                          or self.h2.local_flow_control_window(stream) > 0)
                continue
            try:
                self.h2.send_data(stream, bytes(view[:window]))
            except h2.exceptions.StreamClosedError:
                return False
            self.flush()
            view = view[window:]
        if end:
            try:
                self.h2.end_stream(stream)
            except h2.exceptions.StreamClosedError:
                return False
            self.flush()
        return True

    def call(self, body: bytes, **kwargs: Any) -> dict[str, Any]:
        stream = self.start(**kwargs)
        self.send(stream, body)
        return self.answer(stream)

    def read(self, done: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "no answer in time"
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            for event in self.h2.receive_data(data):
                self._on(event)
            self.flush()

    def _on(self, event: Any) -> None:
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            self.answers.setdefault(event.stream_id, {"data": b""}).update(dict(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            self.answers.setdefault(event.stream_id, {"data": b""})["data"] += event.data
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.answers.setdefault(event.stream_id, {"data": b""})["ended"] = True
        elif isinstance(event, h2.events.StreamReset):
            self.answers.setdefault(event.stream_id, {"data": b""})["reset"] = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.terminated = event

    def answer(self, stream: int) -> dict[str, Any]:
        self.read(lambda: "grpc-status" in self.answers.get(stream, {}))
        return self.answers[stream]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def receiver(writer: SpanWriter, request: pytest.FixtureRequest) -> Iterator[OtlpGrpcReceiver]:
    options = getattr(request, "param", {})
    r = OtlpGrpcReceiver(writer, port=0, **options).start()
    yield r
    r.stop()


def span_count(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM spans")).scalar_one())


def settled(receiver: OtlpGrpcReceiver, connections: int = 0) -> dict[str, Any]:
    """The receiver's stats once it holds no call in flight and at most ``connections``."""
    deadline = time.monotonic() + 5
    while True:
        stats = receiver.stats()
        if (stats["calls_in_flight"] == 0 and stats["connections"] <= connections) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def still_serves(receiver: OtlpGrpcReceiver) -> None:
    """A fresh grpcio client gets OK from the trace method."""
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        response = trace_service_pb2_grpc.TraceServiceStub(channel).Export(encode_spans(sdk_spans(1)), timeout=5)
    assert response == trace_service_pb2.ExportTraceServiceResponse()


def test_an_http1_request_is_told_where_otlp_http_goes(writer: SpanWriter) -> None:
    receiver = OtlpGrpcReceiver(writer, port=0, http_hint="127.0.0.1:4318").start()
    try:
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"speaks OTLP/gRPC" in answer and b"127.0.0.1:4318" in answer
        with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
            sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 20)  # a TLS ClientHello
            assert sock.recv(4096) == b""  # closed, nothing said
        assert settled(receiver)["connection_errors"] == {"not HTTP/2": 2}
        still_serves(receiver)
    finally:
        receiver.stop()


def test_a_broken_frame_gets_a_goaway_and_only_that_connection_ends(receiver: OtlpGrpcReceiver) -> None:
    other = Client(receiver.port)
    broken = Client(receiver.port)
    # WINDOW_UPDATE on the connection with an increment of 0: a connection error (RFC 9113 6.9).
    broken.sock.sendall(b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00")
    with pytest.raises(ConnectionError):
        broken.read(lambda: False)
    assert broken.terminated is not None
    assert broken.terminated.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    answer = other.call(grpc_frame(request_bytes()))
    assert answer["grpc-status"] == "0"
    other.close()
    assert settled(receiver)["connection_errors"] == {"HTTP/2 protocol error": 1}


def test_a_header_list_over_the_advertised_limit_ends_the_connection(receiver: OtlpGrpcReceiver) -> None:
    client = Client(receiver.port)
    with pytest.raises(ConnectionError):
        client.start(extra=(("x-padding", "p" * (20 << 10)),))
        client.read(lambda: False)
    assert client.terminated is not None
    client.close()
    assert settled(receiver)["connection_errors"] == {"HTTP/2 protocol error": 1}
    still_serves(receiver)


def test_other_methods_and_media_types(receiver: OtlpGrpcReceiver) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary("/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export")(
                b"", timeout=5)
        assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert "ProfilesService" in (unknown.value.details() or "")
    client = Client(receiver.port)
    answer = client.call(grpc_frame(request_bytes()), content_type="application/json")
    assert answer[":status"] == "415" and answer["grpc-status"] == "12"
    client.close()
    still_serves(receiver)


@pytest.mark.parametrize("receiver", [{"max_message_bytes": 4096}], indirect=True)
def test_a_message_over_the_limit_is_refused_from_its_prefix(receiver: OtlpGrpcReceiver, store: Store) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        export = channel.unary_unary(TRACES)
        with pytest.raises(grpc.RpcError) as big:
            export(b"\x0a" * 5000, timeout=5)
        assert big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max (5000 vs. 4096)" in (big.value.details() or "")
        assert export(request_bytes(), timeout=5) == b""  # the same channel goes on
    # Far past the windows: the rest of the stream is reset and its bytes in flight discarded;
    # the connection is not stalled by them.
    client = Client(receiver.port)
    stream = client.start()
    client.send(stream, grpc_frame(b"\x0a" * (3 << 20)))
    assert client.answer(stream)["grpc-status"] == "8"
    assert client.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    client.close()
    assert span_count(store) == 4
    assert settled(receiver)["requests_by_status"] == {"RESOURCE_EXHAUSTED": 2, "OK": 2}


@pytest.mark.parametrize(("body", "extra", "code", "words"), [
    (b"", (), "13", "has no message"),
    (grpc_frame(b"x" * 100)[:50], (), "13", "ended inside its message"),
    (grpc_frame(b"") + grpc_frame(b""), (), "13", "bytes after it"),
    (grpc_frame(b"", flag=2), (), "13", "bad gRPC message flag 2"),
    (grpc_frame(b"abc", flag=1), (), "13", "names no grpc-encoding"),
    (grpc_frame(b"abc", flag=1), (("grpc-encoding", "br"),), "12", "'br' is not supported"),
    (grpc_frame(b"not gzip", flag=1), (("grpc-encoding", "gzip"),), "13", "not valid gzip"),
    (grpc_frame(gzip.compress(b"\x00" * (1 << 20)), flag=1), (("grpc-encoding", "gzip"),), "8",
     "inflates past the limit"),
    (grpc_frame(b"\x0a\x05\x12"), (), "3", "not a valid ExportTraceServiceRequest"),
], ids=["empty", "truncated", "two-messages", "flag", "no-encoding", "unknown-encoding", "bad-gzip",
        "gzip-bomb", "bad-protobuf"])
@pytest.mark.parametrize("receiver", [{"max_message_bytes": 65536}], indirect=True)
def test_broken_calls_are_answered_and_the_connection_goes_on(
        body: bytes, extra: tuple[tuple[str, str], ...], code: str, words: str, receiver: OtlpGrpcReceiver) -> None:
    client = Client(receiver.port)
    answer = client.call(body, extra=extra)
    assert answer["grpc-status"] == code, answer
    assert words in answer["grpc-message"], answer
    if code == "12":
        assert answer["grpc-accept-encoding"] == "identity,gzip,deflate"
    zipped = client.call(grpc_frame(gzip.compress(request_bytes()), flag=1), extra=(("grpc-encoding", "gzip"),))
    assert zipped["grpc-status"] == "0"
    client.close()
    assert settled(receiver)["calls_in_flight"] == 0


@pytest.mark.parametrize("receiver", [{"socket_timeout_s": 0.5}], indirect=True)
def test_a_reset_or_stalled_call_lets_go_of_its_slot(receiver: OtlpGrpcReceiver) -> None:
    client = Client(receiver.port)
    stream = client.start()
    client.send(stream, grpc_frame(request_bytes())[:20], end=False)
    client.h2.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
    client.flush()
    assert client.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    assert settled(receiver, connections=1)["calls_in_flight"] == 0
    # A stalled call is cut off even while other calls keep its connection busy.
    stalled = client.start()
    client.send(stalled, grpc_frame(request_bytes())[:20], end=False)
    started = time.monotonic()
    while "grpc-status" not in client.answers.get(stalled, {}):
        assert client.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
        assert time.monotonic() - started < 3, "the stalled call was never cut off"
    answer = client.answers[stalled]
    assert answer["grpc-status"] == "4" and "stalled" in answer["grpc-message"]
    assert time.monotonic() - started >= 0.5
    # And alone on a silent connection; the connection stays.
    stalled = client.start()
    client.send(stalled, grpc_frame(request_bytes())[:20], end=False)
    assert client.answer(stalled)["grpc-status"] == "4"
    assert client.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    client.close()
    assert settled(receiver)["calls_in_flight"] == 0


@pytest.mark.parametrize("receiver", [{"idle_timeout_s": 0.5}], indirect=True)
def test_an_idle_connection_is_closed_and_grpc_clients_reconnect(receiver: OtlpGrpcReceiver, store: Store) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        stub.Export(encode_spans(sdk_spans(1)), timeout=5)
        time.sleep(1.0)
        assert settled(receiver)["connections"] == 0
        stub.Export(encode_spans(sdk_spans(1)), timeout=5)
    assert receiver.stats()["requests_by_status"] == {"OK": 2}


@pytest.mark.parametrize("receiver", [{"max_connections": 2}], indirect=True)
def test_connections_over_the_cap_get_a_goaway(receiver: OtlpGrpcReceiver) -> None:
    first, second = Client(receiver.port), Client(receiver.port)
    assert first.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    assert second.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    third = Client(receiver.port)
    with pytest.raises(ConnectionError):
        third.read(lambda: False)
    assert third.terminated is not None
    assert third.terminated.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    first.close()
    settled(receiver, connections=1)
    fourth = Client(receiver.port)
    assert fourth.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    for client in (second, third, fourth):
        client.close()
    assert settled(receiver)["connection_errors"] == {"too many connections": 1}


def test_calls_on_one_connection_run_side_by_side(receiver: OtlpGrpcReceiver, store: Store) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        pending = [stub.Export.future(encode_spans(sdk_spans(2)), timeout=10) for _ in range(40)]
        for future in pending:
            future.result()
    assert span_count(store) == 80
    assert settled(receiver)["requests_by_status"] == {"OK": 40}


def test_calls_over_the_concurrency_limit_are_refused_with_retry_info(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    writer = SpanWriter(store, retry_after_s=0.5).start()
    receiver = OtlpGrpcReceiver(writer, port=0, max_concurrent_rpcs=1).start()
    locker = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            locker.execute("BEGIN EXCLUSIVE")
            pending = stub.Export.future(encode_spans(sdk_spans(1)), timeout=20)
            deadline = time.monotonic() + 5
            while receiver.stats()["calls_in_flight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Export(encode_spans(sdk_spans(1)), timeout=5)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "too many OTLP/gRPC calls" in (refused.value.details() or "")
            details = dict(refused.value.trailing_metadata() or ())["grpc-status-details-bin"]
            retry = error_details_pb2.RetryInfo()
            assert status_pb2.Status.FromString(details).details[0].Unpack(retry)
            assert retry.retry_delay.seconds == 1
            locker.execute("ROLLBACK")
            try:  # committed once the lock went, or refused if it outlasted the busy timeout
                pending.result()
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE
        assert settled(receiver)["calls_in_flight"] == 0
        still_serves(receiver)
    finally:
        locker.close()
        receiver.stop()
        writer.stop()
        store.close()


def test_stop_closes_open_connections(writer: SpanWriter) -> None:
    receiver = OtlpGrpcReceiver(writer, port=0).start()
    clients = [Client(receiver.port) for _ in range(3)]
    for client in clients:
        assert client.call(grpc_frame(request_bytes()))["grpc-status"] == "0"
    started = time.monotonic()
    receiver.stop()
    assert time.monotonic() - started < 3
    for client in clients:
        with pytest.raises(ConnectionError):
            client.read(lambda: False)
        assert client.terminated is not None and client.terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
        client.close()
    deadline = time.monotonic() + 2  # idle workers leave as soon as they see the pool shut
    while [t for t in threading.enumerate() if t.name.startswith("otlp-grpc")] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("otlp-grpc")]


# -- fuzzing ---------------------------------------------------------------------------------
def valid_exchange() -> bytes:
    """What a client sends for one trace call: preface, SETTINGS, HEADERS, DATA (a gRPC frame)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "t"), (":path", TRACES),
                          ("content-type", "application/grpc"), ("grpc-encoding", "gzip")])
    conn.send_data(1, grpc_frame(gzip.compress(request_bytes(3)), flag=1), end_stream=True)
    return conn.data_to_send()


VALID = valid_exchange()
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.integers(len(PREFACE), len(data) - 1))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip":
            data[where] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[where:where + draw(st.integers(1, 64))]
        else:
            data[where:where] = draw(st.binary(min_size=1, max_size=32))
        if len(data) <= len(PREFACE) + 1:
            break
    return bytes(data)


GARBAGE = st.one_of(mutated(), st.binary(max_size=512).map(lambda tail: PREFACE + tail), st.binary(max_size=64))


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtlpGrpcReceiver]:
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('grpcfuzz') / 'f.db'}")
    writer = SpanWriter(store).start()
    receiver = OtlpGrpcReceiver(writer, port=0, socket_timeout_s=2, max_message_bytes=1 << 20).start()
    yield receiver
    receiver.stop()
    writer.stop()
    store.close()


def exchange(port: int, data: bytes) -> None:
    """Send the bytes, half-close, and read until the receiver closes (it must, and soon)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass


@settings(derandomize=True, deadline=None, database=None, max_examples=400,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=GARBAGE)
def test_fuzzed_connections_never_hurt_the_receiver(data: bytes, fuzz_target: OtlpGrpcReceiver,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="collectors.otlp_grpc"):
        exchange(fuzz_target.port, data)
    faults = [r.getMessage() for r in caplog.records if r.name == "collectors.otlp_grpc"]
    assert not faults, faults  # garbage is the sender's fault: never a fault of ours


def test_after_the_fuzz_the_receiver_holds_nothing_and_serves(fuzz_target: OtlpGrpcReceiver) -> None:
    exchange(fuzz_target.port, VALID)  # the unmutated exchange is a real call
    stats = settled(fuzz_target)
    assert stats["calls_in_flight"] == 0 and stats["connections"] == 0, stats
    assert stats["requests_by_status"].get("OK", 0) >= 1
    still_serves(fuzz_target)


def test_curl_an_independent_http2_client_gets_its_answers(receiver: OtlpGrpcReceiver, store: Store,
                                                           tmp_path: Path) -> None:
    """curl speaks HTTP/2 through nghttp2, the library behind most HTTP/2 stacks outside Python:
    a call, and a 3 MiB one that only gets through if our windows are given back as it arrives."""
    curl = shutil.which("curl")
    assert curl, "curl is missing: make setup installs it (the tests' independent HTTP/2 client)"

    def post(message: bytes) -> tuple[str, bytes]:
        body, answer = tmp_path / "body", tmp_path / "answer"
        body.write_bytes(grpc_frame(message))
        done = subprocess.run([curl, "-sS", "--http2-prior-knowledge", "--data-binary", f"@{body}",
                               "-H", "content-type: application/grpc", "-H", "te: trailers",
                               "-D", "-", "-o", str(answer), f"http://127.0.0.1:{receiver.port}{TRACES}"],
                              capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.replace("\r", ""), answer.read_bytes()

    head, answer = post(request_bytes(3))
    assert head.startswith("HTTP/2 200") and "grpc-status: 0" in head, head
    assert answer == grpc_frame(b"") and span_count(store) == 3
    head, answer = post(b"\xff" * (3 << 20))  # not a request: refused, after all of it was read
    assert "grpc-status: 3" in head and answer == b"", head
    assert settled(receiver)["requests_by_status"] == {"OK": 1, "INVALID_ARGUMENT": 1}
    still_serves(receiver)
