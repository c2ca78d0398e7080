"""Kernel event records (``struct event`` of ``disconnect.h``) to ``ConnEvent`` objects, in bulk.

This is the probe reader's hot loop: at a close per request every microsecond here is a share of
the server's capacity. Three things keep it under a microsecond an event: records arrive as
tuples from ``struct.iter_unpack`` (no per-field ctypes access), address text is cached by its
packed bytes, and each event is made in one step as the named tuple it is (see ``EventBuilder``).
"""

from __future__ import annotations

import ctypes
import socket
import struct
from typing import Any

from auditor.model import ConnEvent, ConnEventKind

# Must match the EVENT_* defines of disconnect.h.
KIND_BY_CODE = {
    1: ConnEventKind.PEER_FIN,
    2: ConnEventKind.PEER_RST,
    3: ConnEventKind.LOCAL_FIN,
    4: ConnEventKind.CLOSED,
}
# Kernel socket addresses have the top bit set; clearing it keeps the identity unique and lets
# it fit the signed 64-bit cookie column.
COOKIE_MASK = (1 << 63) - 1
AF_INET = 2
AF_INET6 = 10
_FIELDS = ("ts_ns", "kind", "family", "client_addr", "client_port", "server_addr", "server_port",
           "cookie", "host", "source", "earliest_ns")
_ADDRESS_CACHE_MAX = 65_536  # clients churn; keep the cache bounded


def struct_format(event_class: Any) -> struct.Struct:
    """A struct.Struct equal to bcc's view of ``struct event``, for fast batch decoding."""
    codes = {ctypes.c_ulonglong: "Q", ctypes.c_ulong: "Q", ctypes.c_uint: "I", ctypes.c_ushort: "H",
             ctypes.c_ubyte: "B", ctypes.c_longlong: "q", ctypes.c_int: "i", ctypes.c_short: "h"}
    fmt = "="  # native byte order, no implicit padding: gaps are spelled out below
    position = 0
    for name, ctype in event_class._fields_:
        field = getattr(event_class, name)
        if field.offset > position:
            fmt += f"{field.offset - position}x"
        if getattr(ctype, "_length_", None):  # u8[16] arrives as bytes
            fmt += f"{field.size}s"
        else:
            fmt += codes[ctype]
        position = field.offset + field.size
    if ctypes.sizeof(event_class) > position:
        fmt += f"{ctypes.sizeof(event_class) - position}x"
    return struct.Struct(fmt)


class EventBuilder:
    """Record tuples (the fields of ``struct event`` in order) to ConnEvents.

    ConnEvent is a named tuple: each event is made in one step from its values in field order
    (``tuple.__new__``), about half of what filling a dataclass's slots one by one cost, inlined
    in the loop without a call frame per event. ``ConnEvent._fields`` is checked against that order
    once; where it differs, events are built by keyword.
    """

    def __init__(self, by_position: bool | None = None) -> None:
        self._cache: dict[bytes, str] = {}
        self._by_position = ConnEvent._fields == _FIELDS if by_position is None else by_position

    def __call__(self, records: list[tuple[Any, ...]], offset_ns: int,
                 host: str) -> tuple[list[ConnEvent], list[tuple[tuple[Any, ...], Exception]]]:
        """The events, and the records that did not decode with why (a bad kind or family)."""
        if not self._by_position:
            return self._by_keyword(records, offset_ns, host)
        new, event_type = tuple.__new__, ConnEvent
        kinds, cache, address = KIND_BY_CODE, self._cache, self._address
        events: list[ConnEvent] = []
        append = events.append
        bad: list[tuple[tuple[Any, ...], Exception]] = []
        for record in records:
            ts, skaddr, saddr, daddr, sport, dport, family, kind, _old = record
            try:
                if family == AF_INET:
                    append(new(event_type, (ts + offset_ns, kinds[kind], 4, cache.get(daddr) or address(family, daddr),
                                            dport, cache.get(saddr) or address(family, saddr), sport,
                                            skaddr & COOKIE_MASK, host, "bpf", None)))
                else:
                    append(new(event_type, (ts + offset_ns, kinds[kind], 6, address(family, daddr), dport,
                                            address(family, saddr), sport, skaddr & COOKIE_MASK, host, "bpf",
                                            None)))
            except (ValueError, KeyError, OSError) as exc:
                bad.append((record, exc))
        return events, bad

    def _by_keyword(self, records: list[tuple[Any, ...]], offset_ns: int,
                    host: str) -> tuple[list[ConnEvent], list[tuple[tuple[Any, ...], Exception]]]:
        events: list[ConnEvent] = []
        bad: list[tuple[tuple[Any, ...], Exception]] = []
        for record in records:
            ts, skaddr, saddr, daddr, sport, dport, family, kind, _old = record
            try:
                events.append(ConnEvent(
                    ts_ns=ts + offset_ns, kind=KIND_BY_CODE[kind], family=4 if family == AF_INET else 6,
                    client_addr=self._address(family, daddr), client_port=dport,
                    server_addr=self._address(family, saddr), server_port=sport,
                    cookie=skaddr & COOKIE_MASK, host=host, source="bpf"))
            except (ValueError, KeyError, OSError) as exc:
                bad.append((record, exc))
        return events, bad

    def _address(self, family: int, packed: bytes) -> str:
        """Address text, cached: IPv4 keys are the 16 packed bytes, IPv6 keys 17 (never confused)."""
        cache = self._cache
        key = packed if family == AF_INET else packed + b"6"
        text = cache.get(key)
        if text is None:
            if family == AF_INET:
                text = socket.inet_ntop(socket.AF_INET, packed[:4])
            elif family == AF_INET6:
                text = socket.inet_ntop(socket.AF_INET6, packed)
            else:
                raise ValueError(f"address family {family} is neither AF_INET nor AF_INET6")
            if len(cache) >= _ADDRESS_CACHE_MAX:
                cache.clear()
            cache[key] = text
        return text
