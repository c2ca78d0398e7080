"""collectors.http2 against an independent HTTP/2 client (h2, the state machine many Python
clients use) and against raw frames for what well-behaved clients never send. In memory: the
receiver's socket-level behaviour is tests/test_otlp_grpc_wire.py."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors import http2
from collectors.http2 import ErrorCode, ProtocolError, ServerConnection, StreamClosed

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/svc/Export"), (":authority", "t"),
           ("content-type", "application/grpc"), ("te", "trailers")]


def server(**kwargs: Any) -> ServerConnection:
    conn = ServerConnection(**{"max_concurrent_streams": 8, "initial_window": 1 << 20, **kwargs})
    conn.initiate_connection()
    return conn


class Pair:
    """An h2 client and our server, bytes pumped between them until neither has more to say."""

    def __init__(self, client_settings: dict[int, int] | None = None, **kwargs: Any) -> None:
        self.server = server(**kwargs)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.client.initiate_connection()
        if client_settings:
            self.client.update_settings(client_settings)
        self.events: list[Any] = []  # the server's
        self.answers: dict[int, dict[str, Any]] = {}  # the client's view, by stream
        self.ack = True  # the client gives back the window of what it reads
        self.pump()

    def pump(self) -> None:
        for _ in range(1000):
            to_server, to_client = self.client.data_to_send(), self.server.data_to_send()
            if not to_server and not to_client:
                return
            if to_server:
                for event in self.server.receive_data(to_server):
                    self.events.append(event)
                    if isinstance(event, http2.DataReceived):
                        self.server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if to_client:
                for event in self.client.receive_data(to_client):
                    self._on(event)
        raise AssertionError("the two never went quiet")

    def _on(self, event: Any) -> None:
        answer = self.answers.setdefault(getattr(event, "stream_id", 0), {"data": b"", "headers": []})
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            answer["headers"] += [(bytes(k), bytes(v)) for k, v in event.headers]
        elif isinstance(event, h2.events.DataReceived):
            answer["data"] += event.data
            if self.ack:
                self.client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            answer["ended"] = True
        elif isinstance(event, h2.events.StreamReset):
            answer["reset"] = event.error_code

    def send(self, stream: int, body: bytes, headers: list[tuple[str, str]] = REQUEST) -> None:
        """A whole request, within the client's flow control."""
        self.client.send_headers(stream, headers)
        view = memoryview(body)
        while view:
            room = min(self.client.local_flow_control_window(stream), self.client.max_outbound_frame_size)
            assert room > 0, "the server never opened its window"
            self.client.send_data(stream, bytes(view[:room]))
            view = view[room:]
            self.pump()
        self.client.end_stream(stream)
        self.pump()

    def received(self, stream: int) -> bytes:
        return b"".join(e.data for e in self.events if isinstance(e, http2.DataReceived) and e.stream_id == stream)


def answer(conn: ServerConnection, stream: int, body: bytes) -> None:
    conn.send_headers(stream, [(":status", "200"), ("content-type", "application/grpc")])
    conn.send_data(stream, body)
    conn.send_headers(stream, [("grpc-status", "0")], end_stream=True)


def test_a_call_and_its_answer_with_an_independent_client() -> None:
    pair = Pair()
    body = bytes(range(256)) * 12_000  # 3 MiB: past the stream's 1 MiB window, so updates must come
    pair.send(1, body)
    assert [type(e) for e in pair.events][:1] == [http2.RequestReceived]
    request = pair.events[0]
    assert (b":path", b"/svc/Export") in request.headers and (b"te", b"trailers") in request.headers
    assert pair.received(1) == body and isinstance(pair.events[-1], http2.StreamEnded)
    answer(pair.server, 1, b"\x00\x00\x00\x00\x00")
    pair.pump()
    got = pair.answers[1]
    assert (b":status", b"200") in got["headers"] and (b"grpc-status", b"0") in got["headers"]
    assert got["data"] == b"\x00" * 5 and got.get("ended")
    assert 1 not in pair.server.streams  # both sides done: nothing held
    pair.send(3, b"again")  # the connection goes on, HPACK's dynamic table in step
    assert pair.received(3) == b"again"


def test_an_answer_waits_for_the_clients_window_and_its_trailers_wait_behind_it() -> None:
    pair = Pair(client_settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 3})
    pair.send(1, b"x")
    pair.ack = False
    answer(pair.server, 1, b"0123456789")
    pair.pump()
    assert pair.answers[1]["data"] == b"012" and not pair.answers[1].get("ended")
    assert (b"grpc-status", b"0") not in pair.answers[1]["headers"]  # the trailers wait behind the data
    pair.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65_535})  # a larger window
    pair.pump()
    assert pair.answers[1]["data"] == b"0123456789" and pair.answers[1].get("ended")
    assert (b"grpc-status", b"0") in pair.answers[1]["headers"]


def test_a_header_block_over_several_continuation_frames() -> None:
    pair = Pair(max_header_list_size=128 << 10)
    pair.send(1, b"x", [*REQUEST, ("x-big", "v" * 40_000)])
    request = pair.events[0]
    assert isinstance(request, http2.RequestReceived) and (b"x-big", b"v" * 40_000) in request.headers
    big_answer = [(":status", "200"), ("x-big", "w" * 40_000)]  # split by us, read by h2
    pair.server.send_headers(1, big_answer, end_stream=True)
    pair.pump()
    assert (b"x-big", b"w" * 40_000) in pair.answers[1]["headers"] and pair.answers[1].get("ended")


def test_a_reset_from_the_client_ends_its_stream() -> None:
    pair = Pair()
    pair.client.send_headers(1, REQUEST)
    pair.client.reset_stream(1, 8)
    pair.pump()
    assert isinstance(pair.events[-1], http2.StreamReset) and pair.events[-1].error_code == 8
    with pytest.raises(StreamClosed):
        answer(pair.server, 1, b"late")


# -- raw frames ------------------------------------------------------------------------------
def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">HBBBI", len(payload) >> 8, len(payload) & 0xFF, kind, flags, stream) + payload


def opened(**kwargs: Any) -> tuple[ServerConnection, hpack.Encoder]:
    conn = server(**kwargs)
    conn.receive_data(http2.PREFACE + frame(http2.SETTINGS, 0, 0))
    conn.data_to_send()
    return conn, hpack.Encoder()


def frames_of(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out = []
    while data:
        high, low, kind, flags, stream = struct.unpack_from(">HBBBI", data)
        length = (high << 8) | low
        out.append((kind, flags, stream, data[9:9 + length]))
        data = data[9 + length:]
    return out


def test_padding_priority_and_ping() -> None:
    conn, encoder = opened()
    block = encoder.encode(REQUEST)
    padded = bytes([4]) + struct.pack(">IB", 0, 15) + block + b"\x00" * 4  # PADDED and PRIORITY
    events = conn.receive_data(frame(http2.HEADERS, http2.PADDED | http2.PRIORITY_FLAG | http2.END_HEADERS, 1, padded)
                               + frame(http2.DATA, http2.PADDED | http2.END_STREAM, 1, bytes([3]) + b"body" + b"\x00" * 3)
                               + frame(http2.PRIORITY, 0, 1, struct.pack(">IB", 0, 1))
                               + frame(0xEE, 0, 0, b"an unknown frame type is ignored")
                               + frame(http2.PING, 0, 0, b"12345678"))
    assert [type(e) for e in events] == [http2.RequestReceived, http2.DataReceived, http2.StreamEnded]
    assert events[1].data == b"body" and events[1].flow_controlled_length == 8
    assert (http2.PING, http2.ACK, 0, b"12345678") in frames_of(conn.data_to_send())


def test_streams_over_the_limit_and_malformed_requests_are_reset_and_the_connection_goes_on() -> None:
    conn, encoder = opened(max_concurrent_streams=1)
    events = conn.receive_data(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(REQUEST))
                               + frame(http2.HEADERS, http2.END_HEADERS, 3, encoder.encode(REQUEST)))
    assert [e.stream_id for e in events] == [1]
    assert (http2.RST_STREAM, 0, 3, struct.pack(">I", ErrorCode.REFUSED_STREAM)) in frames_of(conn.data_to_send())
    for bad in ([("Content-Type", "application/grpc")], [("connection", "keep-alive")],
                [("x-a", "one\r\ntwo")], [("te", "gzip")]):
        conn.receive_data(frame(http2.RST_STREAM, 0, 1, struct.pack(">I", 0)))
        conn.data_to_send()
        stream = conn.highest_stream_id + 2
        events = conn.receive_data(frame(http2.HEADERS, http2.END_HEADERS | http2.END_STREAM, stream,
                                         encoder.encode(REQUEST + bad)))
        assert events == [], bad
        assert (http2.RST_STREAM, 0, stream, struct.pack(">I", ErrorCode.PROTOCOL_ERROR)) in frames_of(conn.data_to_send())
    stream = conn.highest_stream_id + 2
    events = conn.receive_data(frame(http2.HEADERS, http2.END_HEADERS, stream, encoder.encode(REQUEST[1:])))
    assert events == []  # no :method
    stream += 2
    events = conn.receive_data(frame(http2.HEADERS, http2.END_HEADERS, stream, encoder.encode(REQUEST[:3])))
    assert [(type(e), e.stream_id) for e in events] == [(http2.RequestReceived, stream)]  # the least a request has


@pytest.mark.parametrize(("data", "code"), [
    (frame(http2.DATA, 0, 0, b"x"), ErrorCode.PROTOCOL_ERROR),  # DATA on the connection
    (frame(http2.DATA, 0, 5, b"x"), ErrorCode.PROTOCOL_ERROR),  # DATA on an idle stream
    (frame(http2.HEADERS, http2.END_HEADERS, 2, b""), ErrorCode.PROTOCOL_ERROR),  # an even stream
    (frame(http2.CONTINUATION, http2.END_HEADERS, 1, b""), ErrorCode.PROTOCOL_ERROR),  # no block open
    (frame(http2.HEADERS, 0, 1, b"\x82") + frame(http2.PING, 0, 0, b"12345678"), ErrorCode.PROTOCOL_ERROR),
    (frame(http2.HEADERS, http2.END_HEADERS, 1, b"\xff\xff\xff\xff\xff"), ErrorCode.COMPRESSION_ERROR),
    (frame(http2.PING, 0, 0, b"short"), ErrorCode.FRAME_SIZE_ERROR),
    (frame(http2.SETTINGS, 0, 0, b"12345"), ErrorCode.FRAME_SIZE_ERROR),
    (frame(http2.SETTINGS, 0, 0, struct.pack(">HI", http2.SETTINGS_MAX_FRAME_SIZE, 100)), ErrorCode.PROTOCOL_ERROR),
    (frame(http2.SETTINGS, 0, 0, struct.pack(">HI", http2.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 31)),
     ErrorCode.FLOW_CONTROL_ERROR),
    (frame(http2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)), ErrorCode.PROTOCOL_ERROR),
    (frame(http2.WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 31) - 1)), ErrorCode.FLOW_CONTROL_ERROR),
    (frame(http2.PUSH_PROMISE, http2.END_HEADERS, 1, b"\x00\x00\x00\x02"), ErrorCode.PROTOCOL_ERROR),
    (struct.pack(">HBBBI", 256, 0, http2.DATA, 0, 1), ErrorCode.FRAME_SIZE_ERROR),  # 65,536 bytes announced
])
def test_frames_that_break_http2_end_the_connection(data: bytes, code: ErrorCode) -> None:
    conn, _ = opened()
    with pytest.raises(ProtocolError) as broken:
        conn.receive_data(data)
    assert broken.value.error_code == code


def test_a_connection_must_start_with_the_preface_and_settings() -> None:
    with pytest.raises(ProtocolError):
        server().receive_data(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10)
    with pytest.raises(ProtocolError):
        server().receive_data(http2.PREFACE + frame(http2.PING, 0, 0, b"12345678"))
    conn = server()
    assert conn.receive_data(http2.PREFACE[:10]) == []  # a preface in pieces is fine
    assert conn.receive_data(http2.PREFACE[10:] + frame(http2.SETTINGS, 0, 0)[:4]) == []
    assert conn.receive_data(frame(http2.SETTINGS, 0, 0)[4:]) == []
    assert (http2.SETTINGS, http2.ACK, 0, b"") in frames_of(conn.data_to_send())


def test_data_past_a_reset_stream_is_ignored_but_its_window_comes_back() -> None:
    conn, encoder = opened()
    conn.receive_data(frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(REQUEST)))
    conn.reset_stream(1, ErrorCode.NO_ERROR)  # answered early
    conn.data_to_send()
    chunk = b"x" * 16_384
    for _ in range(40):  # 640 KiB, past half the connection's window: an update must come
        assert conn.receive_data(frame(http2.DATA, 0, 1, chunk)) == []
    updates = [f for f in frames_of(conn.data_to_send()) if f[0] == http2.WINDOW_UPDATE and f[2] == 0]
    assert updates and conn.recv_window > 0


def test_the_receiver_loads_no_http2_library_but_hpack() -> None:
    code = ("import sys, collectors.otlp_grpc; "
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'h2', 'hyperframe', 'hpack', 'grpc'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "['hpack']"


_STREAMS = st.sampled_from([0, 1, 3, 5, 2, 2**31 - 1])
_BLOCK = b"\x83\x86\x84"  # :method POST, :scheme http, :path / (static table: no encoder state)
_U32S = st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n))
# Frames near the valid ones (a random header's frames mostly fail at once): each type with the
# fields it expects, sometimes of the wrong size or on the wrong stream.
_FRAMES = st.one_of(
    st.tuples(st.just(http2.DATA), st.sampled_from([0, 1, 8, 9]), _STREAMS, st.binary(max_size=40)),
    st.tuples(st.just(http2.HEADERS), st.sampled_from([4, 5, 0, 1, 0x24, 0x2C]), _STREAMS,
              st.one_of(st.just(_BLOCK), st.binary(max_size=12).map(lambda pad: bytes([len(pad)]) + _BLOCK + pad))),
    st.tuples(st.just(http2.CONTINUATION), st.sampled_from([0, 4]), _STREAMS, st.just(_BLOCK)),
    st.tuples(st.just(http2.PRIORITY), st.just(0), _STREAMS, st.binary(min_size=4, max_size=6)),
    st.tuples(st.just(http2.RST_STREAM), st.just(0), _STREAMS, st.one_of(_U32S, st.binary(max_size=6))),
    st.tuples(st.just(http2.SETTINGS), st.sampled_from([0, 1]), _STREAMS,
              st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2**32 - 1)), max_size=3).map(
                  lambda pairs: b"".join(struct.pack(">HI", k, v) for k, v in pairs))),
    st.tuples(st.just(http2.PING), st.sampled_from([0, 1]), _STREAMS, st.binary(min_size=6, max_size=10)),
    st.tuples(st.just(http2.GOAWAY), st.just(0), _STREAMS, st.binary(max_size=12)),
    st.tuples(st.just(http2.WINDOW_UPDATE), st.just(0), _STREAMS, st.one_of(_U32S, st.binary(max_size=6))),
    st.tuples(st.sampled_from([http2.PUSH_PROMISE, 0x20]), st.integers(0, 255), _STREAMS, st.binary(max_size=8)),
)


@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_FRAMES, max_size=12), st.integers(0, 3))
def test_any_frames_end_in_events_or_a_protocol_error(frames: list[tuple[int, int, int, bytes]], answers: int) -> None:
    """Whatever frames come, the connection raises nothing but ProtocolError, and answering the
    requests it reported raises nothing but StreamClosed."""
    conn, encoder = opened()
    wire = frame(http2.HEADERS, http2.END_HEADERS, 1, encoder.encode(REQUEST))  # one real request first
    wire += b"".join(frame(kind, flags, stream, payload) for kind, flags, stream, payload in frames)
    try:
        events = conn.receive_data(wire)
    except ProtocolError:
        return
    for event in events:
        if isinstance(event, http2.RequestReceived) and answers:
            answers -= 1
            with contextlib.suppress(StreamClosed):
                answer(conn, event.stream_id, b"\x00" * 10)
    conn.data_to_send()
