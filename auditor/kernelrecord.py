"""The probe's kernel event record (``struct event`` of ``probes/disconnect.h``) to ConnEvents.

The record's layout is the kernel's and the probe's contract; it is written down here, in
``RECORD``, because two readers decode it: the probe reader (``probes.bpf``), and the store,
which keeps the probe's records as the ring buffer held them (``auditor.store.eventblocks``,
format 2) so that the daemon's reader does not decode them at all. The probe checks at load that
bcc's view of ``struct event`` is ``RECORD`` (``probes.decode.is_stored_layout``); where it is
not, the probe decodes and stores events as before.

Decoding is a hot loop: at a close per request every microsecond here is a share of the
server's capacity. Records arrive as tuples from ``struct.iter_unpack`` (no per-field access),
address text is cached by its packed bytes, and each event is made in one step as the named tuple
it is (see ``EventBuilder``).
"""

from __future__ import annotations

import socket
import struct
from array import array
from itertools import compress
from typing import Any

from auditor.model import ConnEvent, ConnEventKind

# struct event: ts_ns, skaddr, saddr[16], daddr[16], sport, dport, family, kind, oldstate. Native
# byte order in the kernel; the store keeps records only where that is little-endian.
RECORD = struct.Struct("<QQ16s16sHHHBB")
RING_HEADER_BYTES = 8  # the ring buffer's per-record header (u32 len, u32 page offset)
KIND_OFFSET = 8 + 8 + 16 + 16 + 2 + 2 + 2  # of the kind byte in a record
SPORT_OFFSET = 8 + 8 + 16 + 16  # of the server port (u16) in a record
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
_DEPARTING = bytes(int(code in (1, 2)) for code in range(256))  # kind code -> 1 for a departure


def ring_record(stride: int) -> struct.Struct:
    """One record as it sits in the ring buffer, ``stride`` bytes with its header: the payload's
    fields only (header and padding skipped)."""
    pad = stride - RING_HEADER_BYTES - RECORD.size
    if pad < 0:
        raise ValueError(f"a stride of {stride} bytes is shorter than a record with its header")
    return struct.Struct(f"<{RING_HEADER_BYTES}x{RECORD.format.lstrip('<')}{pad}x")


def departures(records: bytes, stride: int) -> tuple[int, int, set[int]]:
    """(peer FINs, peer resets, the server ports they left) of ring records ``stride`` bytes
    apart, read at C speed without decoding the records."""
    kinds = records[RING_HEADER_BYTES + KIND_OFFSET::stride]
    fins, resets = kinds.count(1), kinds.count(2)
    if not fins and not resets:
        return 0, 0, set()
    words = array("H")  # the records as u16s (the store keeps records only on little-endian machines)
    words.frombytes(records)
    server_ports = words[(RING_HEADER_BYTES + SPORT_OFFSET) // 2::stride // 2]
    return fins, resets, set(compress(server_ports, kinds.translate(_DEPARTING)))


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
