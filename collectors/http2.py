"""The server side of HTTP/2 (RFC 9113) that gRPC's unary calls need, and no more.

A client opens streams with HEADERS (and CONTINUATION), sends its message in DATA frames and ends
the stream; the server answers with HEADERS, DATA and trailers. Everything else a client may send is
handled as the RFC requires: SETTINGS (acknowledged; the peer's window and frame size honoured),
PING (answered), WINDOW_UPDATE, RST_STREAM, PRIORITY (ignored), GOAWAY, padding, unknown frame
types (ignored). A frame that breaks the protocol raises :class:`ProtocolError` with the code the
connection's GOAWAY carries; a malformed request resets its stream only.

Header blocks are decoded with ``hpack`` (whose dynamic table the client's encoder drives). Our
own header blocks use no dynamic table at all (literals without indexing), so the client's
SETTINGS_HEADER_TABLE_SIZE never matters and an answer's block is the same bytes every time.

The API mirrors the parts of ``h2.connection.H2Connection`` a server uses: feed bytes to
:meth:`ServerConnection.receive_data`, act on the events it returns, and send what
:meth:`ServerConnection.data_to_send` gives. It is not thread-safe: the caller holds a lock.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
MAX_FRAME = 16_384  # our SETTINGS_MAX_FRAME_SIZE (the default): larger frames are refused
MAX_HEADER_BLOCK = 64 << 10  # compressed, over CONTINUATION frames: past it the client is abusive

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, \
    SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = range(1, 7)

_HEAD = struct.Struct(">HBBBI")  # length (24 bits: 16 + 8), type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_GOAWAY = struct.Struct(">II")

# Request headers a server must treat as malformed (RFC 9113 8.2.2), and the pseudo-headers a
# request may carry (8.3.1).
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                  b"upgrade"})
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class ProtocolError(Exception):
    """The client broke HTTP/2: the connection ends with a GOAWAY carrying ``error_code``."""

    def __init__(self, error_code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.error_code = error_code


class StreamClosed(Exception):
    """An answer for a stream that is gone (the client reset it, or it was answered already)."""


@dataclass(frozen=True, slots=True)
class RequestReceived:
    stream_id: int
    headers: Sequence[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class DataReceived:
    stream_id: int
    data: bytes
    flow_controlled_length: int  # padding included: what to acknowledge


@dataclass(frozen=True, slots=True)
class StreamEnded:
    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The client reset a stream it had opened, or we reset it for a malformed request."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class ConnectionTerminated:
    error_code: int
    last_stream_id: int


Event = RequestReceived | DataReceived | StreamEnded | StreamReset | ConnectionTerminated


@dataclass(slots=True)
class _Stream:
    recv_window: int
    send_window: int
    remote_closed: bool = False  # the client ended its side (END_STREAM)
    local_closed: bool = False  # our answer's last frame is queued
    unacked: int = 0  # DATA bytes taken and not yet given back in a WINDOW_UPDATE
    pending: list[tuple[int, bytes, int]] = field(default_factory=list)  # frames held for the send window


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return _HEAD.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def _length(value: int) -> bytes:
    """A string's length in HPACK's integer encoding, 7-bit prefix, no Huffman (RFC 7541 5.1, 5.2)."""
    if value < 0x7F:
        return bytes([value])
    out = bytearray([0x7F])
    value -= 0x7F
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    """A header block of literals without indexing, new names, no Huffman (RFC 7541 6.2.2)."""
    out = bytearray()
    for name, value in headers:
        raw_name, raw_value = name.encode("latin-1"), value.encode("latin-1")
        out += b"\x00" + _length(len(raw_name)) + raw_name + _length(len(raw_value)) + raw_value
    return bytes(out)


def malformed(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """Why a request's header list is malformed (RFC 9113 8.2 and 8.3.1), or None."""
    seen: set[bytes] = set()
    regular = False
    for name, value in headers:
        if name[:1] == b":":
            if regular:
                return "a pseudo-header after a regular header"
            if name not in _REQUEST_PSEUDO or name in seen:
                return f"pseudo-header {name[:40]!r} unknown or repeated"
            seen.add(name)
        else:
            regular = True
            if name.lower() != name or not name:
                return f"header name {name[:40]!r} is not lowercase"
            if name in _CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                return f"connection-specific header {name[:40]!r}"
        if b"\r" in value or b"\n" in value or b"\x00" in value:
            return f"header {name[:40]!r} has a CR, LF or NUL in its value"
    if not {b":method", b":scheme", b":path"} <= seen:
        return "a request without :method, :scheme or :path"
    return None


class ServerConnection:
    """One HTTP/2 connection, server side. The three settings are what :meth:`initiate_connection`
    advertises, and they hold for what we accept from the start: before a client has seen them it
    may only send less (the defaults)."""

    def __init__(self, *, max_concurrent_streams: int = 100, initial_window: int = DEFAULT_WINDOW,
                 max_header_list_size: int = 16 << 10) -> None:
        self.max_concurrent_streams = max_concurrent_streams
        self.initial_window = initial_window
        self.max_header_list_size = max_header_list_size
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = max_header_list_size
        self.streams: dict[int, _Stream] = {}
        self.highest_stream_id = 0  # the last stream the client opened
        self.recv_window = DEFAULT_WINDOW  # the connection's, as the client sees it
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = MAX_FRAME
        self.closed = False  # our GOAWAY is queued
        self._unacked = 0  # the connection's DATA bytes taken and not yet given back
        self._window_opened = DEFAULT_WINDOW  # the connection's receive window when all is given back
        self._out = bytearray()
        self._buffer = bytearray()
        self._preface = False
        self._settings = False  # the client's first SETTINGS arrived
        self._continuing: tuple[int, int, bytearray] | None = None  # stream id, flags, block so far
        self._events: list[Event] = []

    # -- what we send -----------------------------------------------------------------------
    def initiate_connection(self) -> None:
        settings = [(SETTINGS_MAX_CONCURRENT_STREAMS, self.max_concurrent_streams),
                    (SETTINGS_INITIAL_WINDOW_SIZE, self.initial_window),
                    (SETTINGS_MAX_HEADER_LIST_SIZE, self.max_header_list_size)]
        self._out += _frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings))

    def increment_flow_control_window(self, increment: int) -> None:
        """Open the connection's receive window by ``increment`` bytes."""
        self.recv_window += increment
        self._window_opened += increment
        self._out += _frame(WINDOW_UPDATE, 0, 0, _U32.pack(increment))

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def send_headers(self, stream_id: int, headers: list[tuple[str, str]] | bytes, end_stream: bool = False) -> None:
        """An answer's headers or trailers (``headers`` may be an encoded block)."""
        stream = self._answerable(stream_id)
        block = headers if isinstance(headers, bytes) else encode_headers(headers)
        flags = END_STREAM if end_stream else 0
        if end_stream:
            stream.local_closed = True
        if len(block) > self.peer_max_frame:  # HEADERS, then CONTINUATION frames
            chunks = [block[i:i + self.peer_max_frame] for i in range(0, len(block), self.peer_max_frame)]
            frames = _frame(HEADERS, flags, stream_id, chunks[0]) + b"".join(
                _frame(CONTINUATION, END_HEADERS if i == len(chunks) - 1 else 0, stream_id, chunk)
                for i, chunk in enumerate(chunks[1:], 1))
        else:
            frames = _frame(HEADERS, flags | END_HEADERS, stream_id, block)
        stream.pending.append((HEADERS, frames, 0))
        self._send_pending(stream_id, stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        stream = self._answerable(stream_id)
        if end_stream:
            stream.local_closed = True
        for start in range(0, max(len(data), 1), self.peer_max_frame):
            chunk = data[start:start + self.peer_max_frame]
            last = start + self.peer_max_frame >= len(data)
            stream.pending.append((DATA, chunk, END_STREAM if end_stream and last else 0))
        self._send_pending(stream_id, stream)

    def reset_stream(self, stream_id: int, error_code: int = ErrorCode.NO_ERROR) -> None:
        """Reset a stream we know (raises StreamClosed otherwise)."""
        if self.streams.pop(stream_id, None) is None:
            raise StreamClosed(f"stream {stream_id} is closed")
        self._out += _frame(RST_STREAM, 0, stream_id, _U32.pack(error_code))

    def close_connection(self, error_code: int = ErrorCode.NO_ERROR, additional_data: bytes = b"") -> None:
        self.closed = True
        self._out += _frame(GOAWAY, 0, 0, _GOAWAY.pack(self.highest_stream_id, error_code) + additional_data)

    def _answerable(self, stream_id: int) -> _Stream:
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            raise StreamClosed(f"stream {stream_id} is closed or answered")
        return stream

    def _send_pending(self, stream_id: int, stream: _Stream) -> None:
        """Send a stream's held frames in order, DATA as far as both send windows allow."""
        while stream.pending:
            kind, payload, flags = stream.pending[0]
            if kind == HEADERS:
                self._out += payload
            elif payload:
                room = min(self.send_window, stream.send_window)
                if room <= 0:
                    return  # the rest waits for a WINDOW_UPDATE
                if len(payload) > room:  # what fits goes now; the rest keeps its place and END_STREAM
                    stream.pending[0] = (DATA, payload[room:], flags)
                    self._data_frame(stream_id, stream, payload[:room], 0)
                    continue
                self._data_frame(stream_id, stream, payload, flags)
            else:
                self._out += _frame(DATA, flags, stream_id)  # empty: no window needed
            stream.pending.pop(0)
        if stream.local_closed and stream.remote_closed:
            self.streams.pop(stream_id, None)

    def _data_frame(self, stream_id: int, stream: _Stream, payload: bytes, flags: int) -> None:
        self._out += _frame(DATA, flags, stream_id, payload)
        self.send_window -= len(payload)
        stream.send_window -= len(payload)

    # -- what we receive --------------------------------------------------------------------
    def acknowledge_received_data(self, length: int, stream_id: int) -> None:
        """Give back the window of DATA the caller has taken: a WINDOW_UPDATE once half of it is used."""
        self._credit_connection(length)
        stream = self.streams.get(stream_id)
        if stream is not None and not stream.remote_closed:
            stream.unacked += length
            if stream.unacked >= self.initial_window // 2:
                stream.recv_window += stream.unacked
                self._out += _frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.unacked))
                stream.unacked = 0

    def _credit_connection(self, length: int) -> None:
        self._unacked += length
        if self._unacked >= self._window_opened // 2:
            self.recv_window += self._unacked
            self._out += _frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._unacked))
            self._unacked = 0

    def receive_data(self, data: bytes) -> list[Event]:
        """The events in these bytes; raises ProtocolError when the client broke HTTP/2."""
        if self.closed:
            return []
        buffer = self._buffer
        buffer += data
        events: list[Event] = []
        self._events = events
        if not self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "no HTTP/2 connection preface")
                return events
            if not buffer.startswith(PREFACE):
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "no HTTP/2 connection preface")
            del buffer[:len(PREFACE)]
            self._preface = True
        offset = 0
        try:
            while len(buffer) - offset >= 9:
                high, low, kind, flags, stream_id = _HEAD.unpack_from(buffer, offset)
                length = (high << 8) | low
                if length > MAX_FRAME:
                    raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {MAX_FRAME})")
                end = offset + 9 + length
                if len(buffer) < end:
                    break
                payload = bytes(buffer[offset + 9:end])
                offset = end
                self._frame(kind, flags, stream_id & MAX_WINDOW, payload)
        finally:
            del buffer[:offset]
        return events

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if not self._settings and (kind != SETTINGS or flags & ACK):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "the connection must start with SETTINGS")
        if self._continuing is not None and (kind != CONTINUATION or stream_id != self._continuing[0]):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a header block interrupted before its end")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if stream_id:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "PING of other than 8 bytes")
            if not flags & ACK:
                self._out += _frame(PING, ACK, 0, payload)
        elif kind == RST_STREAM:
            if not stream_id or stream_id > self.highest_stream_id:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on the connection or an idle stream")
            if len(payload) != 4:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes")
            if self.streams.pop(stream_id, None) is not None:
                self._events.append(StreamReset(stream_id, _U32.unpack(payload)[0]))
        elif kind == PRIORITY:
            if not stream_id:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on the connection")
            if len(payload) != 5:
                self._reset(stream_id, ErrorCode.FRAME_SIZE_ERROR)
        elif kind == GOAWAY:
            if stream_id:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            last, code = _GOAWAY.unpack_from(payload)
            self._events.append(ConnectionTerminated(code, last & MAX_WINDOW))
        elif kind == PUSH_PROMISE:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a client may not push")
        # Frames of other types are ignored (RFC 9113 5.5).

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "padding as long as the frame")
        return payload[1:len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or stream_id > self.highest_stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on the connection or an idle stream")
        length = len(payload)
        self.recv_window -= length
        if self.recv_window < 0:
            raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        data = self._unpad(flags, payload)
        stream = self.streams.get(stream_id)
        if stream is None:  # reset or answered and done: ignored, its window given back
            self._credit_connection(length)
            return
        if stream.remote_closed:
            self._credit_connection(length)
            self._reset(stream_id, ErrorCode.STREAM_CLOSED)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self._credit_connection(length)
            self._reset(stream_id, ErrorCode.FLOW_CONTROL_ERROR)
            return
        self._events.append(DataReceived(stream_id, data, length))
        if flags & END_STREAM:
            self._end_remote(stream_id, stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id % 2:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, not one a client opens")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, payload)
        else:
            self._continuing = (stream_id, flags, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuing is None:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")
        _, first_flags, block = self._continuing
        block += payload
        if len(block) > MAX_HEADER_BLOCK:
            raise ProtocolError(ErrorCode.ENHANCE_YOUR_CALM, "a header block over 64 KiB")
        if flags & END_HEADERS:
            self._continuing = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        # Decoded whatever becomes of the stream: the block may change the dynamic table.
        try:
            headers = self.decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError as exc:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"header list over the advertised limit: {exc}") from exc
        except (hpack.HPACKError, ValueError, IndexError) as exc:
            raise ProtocolError(ErrorCode.COMPRESSION_ERROR, f"header block cannot be decoded: {exc}") from exc
        stream = self.streams.get(stream_id)
        if stream_id <= self.highest_stream_id:  # trailers of an open request, or a stream gone
            if stream is None or stream.remote_closed:
                self._reset(stream_id, ErrorCode.STREAM_CLOSED)
            elif not flags & END_STREAM:
                self._reset(stream_id, ErrorCode.PROTOCOL_ERROR)
            else:
                self._end_remote(stream_id, stream)
            return
        self.highest_stream_id = stream_id
        if len(self.streams) >= self.max_concurrent_streams:
            self._out += _frame(RST_STREAM, 0, stream_id, _U32.pack(ErrorCode.REFUSED_STREAM))
            return
        pairs = list(headers)
        if malformed(pairs):
            self._out += _frame(RST_STREAM, 0, stream_id, _U32.pack(ErrorCode.PROTOCOL_ERROR))
            return
        stream = self.streams[stream_id] = _Stream(self.initial_window, self.peer_initial_window)
        self._events.append(RequestReceived(stream_id, pairs))
        if flags & END_STREAM:
            self._end_remote(stream_id, stream)

    def _end_remote(self, stream_id: int, stream: _Stream) -> None:
        stream.remote_closed = True
        self._events.append(StreamEnded(stream_id))
        if stream.local_closed and not stream.pending:
            self.streams.pop(stream_id, None)

    def _reset(self, stream_id: int, error_code: ErrorCode) -> None:
        """A stream error: the stream is reset, and the caller told if it knew the stream."""
        self._out += _frame(RST_STREAM, 0, stream_id, _U32.pack(error_code))
        if self.streams.pop(stream_id, None) is not None:
            self._events.append(StreamReset(stream_id, error_code))

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        self._settings = True
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "a stream's window past 2^31-1")
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not MAX_FRAME <= value <= (1 << 24) - 1:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
        self._out += _frame(SETTINGS, ACK, 0)
        for sid, stream in list(self.streams.items()):  # a larger window may free held answers
            if stream.pending:
                self._send_pending(sid, stream)

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if not stream_id:
            if not increment:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a connection WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "the connection's window past 2^31-1")
            for sid, held in list(self.streams.items()):
                if held.pending:
                    self._send_pending(sid, held)
            return
        if stream_id > self.highest_stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a stream already closed: its updates may still be on the way
        if not increment:
            self._reset(stream_id, ErrorCode.PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._reset(stream_id, ErrorCode.FLOW_CONTROL_ERROR)
            return
        if stream.pending:
            self._send_pending(stream_id, stream)
