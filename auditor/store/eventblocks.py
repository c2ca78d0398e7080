"""Kernel events stored a batch to a row: the body format of ``conn_event_blocks``.

A close per request is the probe's worst case, and there a row of twelve columns per event cost
more of the daemon's CPU than the probe's whole budget, most of it SQLite's per-row insert and
index work (docs/footprint.md, the nineteenth and twentieth passes). So the probe's events are
stored as blocks, one row per batch the writer hands over, the events packed column by column in
one ``body``:

====================  ===========================================================
``ts_ns``             n x int64: wall-clock nanoseconds
``earliest_ns``       n x int64: a polled event's last unchanged sighting; NONE if exact
``cookie``            n x int64: the socket's identity; NONE if the source has none
``client_port``       n x uint16
``server_port``       n x uint16
``kind``              n x uint8: the codes of ``probes/disconnect.h`` (1 peer FIN .. 4 closed)
``family``            n x uint8: 4 or 6
addresses             UTF-8: the n client addresses, then the n server addresses, one ``\\n``
                      between each two
``crc32``             uint32: zlib's CRC-32 of every byte before it
====================  ===========================================================

All integers little-endian; n is the row's ``count``. The row also holds the events' ``host``
and ``source`` (one of each a block), their first and last ``ts_ns`` (what restarts and
retention select blocks by) and ``format`` (1: this layout).

Format 2 is the probe's records as its ring buffer held them (``auditor.model.EventRun``), kept
without decoding them in the daemon's reader: an int64 offset from the kernel's monotonic clock
to wall-clock time, a uint16 stride, then n records of that stride (the ring's 8-byte header and
a ``struct event``, ``auditor.kernelrecord.RECORD``), then the same CRC-32. They are decoded
once, when read. A record that does not decode (a kind or family the probe never writes) is
left out and logged; the rest of its block reads.

An event is named by ``event_id(block id, index)``, a single integer that orders events as
they were stored, and which the correlator's saved position and coverage details keep. A body
that does not decode (a damaged file, another layout) raises :class:`BlockError`; readers skip
that block and say so, the rest of the store stays readable.
"""

from __future__ import annotations

import logging
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from auditor.kernelrecord import RECORD, RING_HEADER_BYTES, EventBuilder, ring_record
from auditor.model import ConnEvent, ConnEventKind, EventRun

log = logging.getLogger(__name__)

FORMAT = 1  # events packed column by column
FORMAT_RING = 2  # the probe's ring buffer records as they were
INDEX_BITS = 16
MAX_BLOCK_EVENTS = (1 << INDEX_BITS) - 1  # index 0xFFFF never names an event: see block_read()
NONE = -(1 << 63)  # int64 minimum: no value (None) in the earliest_ns and cookie columns
KIND_CODES = {ConnEventKind.PEER_FIN: 1, ConnEventKind.PEER_RST: 2, ConnEventKind.LOCAL_FIN: 3,
              ConnEventKind.CLOSED: 4}
KINDS = {code: kind for kind, code in KIND_CODES.items()}
_LITTLE = sys.byteorder == "little"
# Bytes an event takes in the fixed-width columns: three int64, two uint16, two uint8.
_FIXED_BYTES = 3 * 8 + 2 * 2 + 2
_CRC = struct.Struct("<I")
_RING_HEADER = struct.Struct("<qH")  # offset_ns, stride
_ring_builder = EventBuilder()  # its address cache lives as long as the process


class BlockError(ValueError):
    """A stored block whose body does not hold the events its row says it does."""


def event_id(block_id: int, index: int) -> int:
    """The id of a block's ``index``-th event: ids order events as they were stored."""
    return (block_id << INDEX_BITS) | index


def block_of(position: int) -> int:
    """The block an event id (or a position between events) lies in."""
    return position >> INDEX_BITS


def block_read(block_id: int) -> int:
    """The position just after a block's last event: every event of it is at or before it."""
    return (block_id << INDEX_BITS) | MAX_BLOCK_EVENTS


def _column(typecode: str, values: Iterable[int]) -> bytes:
    column = array(typecode, values)
    if not _LITTLE:
        column.byteswap()
    return column.tobytes()


def _read_column(typecode: str, body: bytes, start: int, count: int) -> tuple[array[int], int]:
    column = array(typecode)
    end = start + count * column.itemsize
    column.frombytes(body[start:end])
    if not _LITTLE:
        column.byteswap()
    return column, end


def pack(events: Sequence[ConnEvent]) -> bytes:
    """The body of a block holding ``events`` (at most MAX_BLOCK_EVENTS, any host or source:
    the caller groups them). Raises ValueError for an event that cannot be stored (a kind the
    format has no code for, an address with a line break, a number out of its column's range)."""
    return _pack(list(zip(*events, strict=True))) if events else b""


def _pack(columns: list[tuple[Any, ...]]) -> bytes:
    """``pack`` of the events' columns (ConnEvent's fields, each a tuple of every event's value)."""
    ts, kind, family, client_addr, client_port, server_addr, server_port, cookie, _host, _source, earliest = columns
    count = len(ts)
    if count > MAX_BLOCK_EVENTS:
        raise ValueError(f"a block holds at most {MAX_BLOCK_EVENTS} events, not {count}")
    try:
        codes = bytes(map(KIND_CODES.__getitem__, kind))
    except KeyError as exc:
        raise ValueError(f"no stored code for the event kind {exc.args[0]!r}") from None
    addresses = "\n".join(client_addr + server_addr)
    if addresses.count("\n") != 2 * count - 1:
        raise ValueError("an event's address holds a line break")
    try:
        families = bytes(family)
        body = b"".join((
            _column("q", ts), _optional(earliest), _optional(cookie),
            _column("H", client_port), _column("H", server_port),
            codes, families, addresses.encode()))
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"an event does not fit the stored columns: {exc}") from None
    if families.strip(b"\x04\x06"):
        raise ValueError("an event's address family is neither 4 nor 6")
    return seal(body)


def _optional(values: tuple[int | None, ...]) -> bytes:
    """An int64 column that may hold None: the probe's are all None (earliest) or none (cookie)."""
    missing = values.count(None)
    if NONE in values:
        raise ValueError(f"{NONE} is the stored mark of no value, not a value")
    if missing == len(values):
        return _column("q", [NONE]) * missing
    if not missing:
        return _column("q", values)  # type: ignore[arg-type]  # no None in it: counted above
    return _column("q", [NONE if value is None else value for value in values])


def seal(body: bytes) -> bytes:
    """``body`` with its checksum after it."""
    return body + _CRC.pack(zlib.crc32(body))


def _checked(body: bytes) -> bytes:
    """A sealed body without its checksum. Raises BlockError where the checksum does not match."""
    if len(body) < _CRC.size or _CRC.unpack_from(body, len(body) - _CRC.size)[0] != zlib.crc32(
            memoryview(body)[:-_CRC.size]):
        raise BlockError("its checksum does not match: the body was damaged")
    return body[:-_CRC.size]


def storable(event: ConnEvent) -> bool:
    """Whether ``pack`` takes this event."""
    try:
        pack([event])
    except ValueError:
        return False
    return True


def _check_count(count: int) -> None:
    if count < 0 or count > MAX_BLOCK_EVENTS:
        raise BlockError(f"a block cannot hold {count} events")


def unpack(body: bytes, count: int, *, host: str, source: str) -> list[ConnEvent]:
    """The events of one block, in the order they were stored. Raises BlockError."""
    _check_count(count)
    if not count:
        if body:
            raise BlockError(f"an empty block has a {len(body)}-byte body")
        return []
    body = _checked(body)
    if len(body) < count * _FIXED_BYTES + 2 * count - 1:
        raise BlockError(f"{len(body)} bytes are too few for {count} events")
    ts, at = _read_column("q", body, 0, count)
    earliest, at = _read_column("q", body, at, count)
    cookie, at = _read_column("q", body, at, count)
    client_port, at = _read_column("H", body, at, count)
    server_port, at = _read_column("H", body, at, count)
    codes, families = body[at:at + count], body[at + count:at + 2 * count]
    try:
        addresses = body[at + 2 * count:].decode().split("\n")
        kinds = [KINDS[code] for code in codes]
    except UnicodeDecodeError as exc:
        raise BlockError(f"addresses are not UTF-8: {exc.reason}") from None
    except KeyError as exc:
        raise BlockError(f"no event kind has the code {exc.args[0]}") from None
    if len(addresses) != 2 * count:
        raise BlockError(f"{len(addresses)} addresses for {count} events")
    if families.strip(b"\x04\x06"):
        raise BlockError("an address family is neither 4 nor 6")
    new, event = tuple.__new__, ConnEvent
    return [new(event, (t, k, f, ca, cp, sa, sp, None if c == NONE else c, host, source,
                        None if e == NONE else e))
            for t, k, f, ca, cp, sa, sp, c, e in zip(ts, kinds, families, addresses[:count], client_port,
                                                     addresses[count:], server_port, cookie, earliest,
                                                     strict=True)]


def block_rows(events: Iterable[ConnEvent]) -> list[dict[str, Any]]:
    """The ``conn_event_blocks`` rows (less ``id``) that store ``events``: one a host and source
    in the order they first appear, split at MAX_BLOCK_EVENTS. Raises ValueError (see pack)."""
    events = list(events)
    if not events:
        return []
    columns = list(zip(*events, strict=True))
    hosts, sources = set(columns[8]), set(columns[9])
    if len(hosts) == 1 and len(sources) == 1 and len(events) <= MAX_BLOCK_EVENTS:  # the daemon's case
        return [_row(hosts.pop(), sources.pop(), columns)]
    groups: dict[tuple[str, str], list[ConnEvent]] = {}
    for event in events:
        groups.setdefault((event.host, event.source), []).append(event)
    return [_row(host, source, list(zip(*group[start:start + MAX_BLOCK_EVENTS], strict=True)))
            for (host, source), group in groups.items() for start in range(0, len(group), MAX_BLOCK_EVENTS)]


def _row(host: str, source: str, columns: list[tuple[Any, ...]]) -> dict[str, Any]:
    times = columns[0]
    return {"host": host, "source": source, "format": FORMAT, "count": len(times),
            "first_ts_ns": min(times), "last_ts_ns": max(times), "body": _pack(columns)}


def run_rows(runs: Iterable[EventRun]) -> list[dict[str, Any]]:
    """The ``conn_event_blocks`` rows (less ``id``) that keep ``runs`` as they are: one a run."""
    return [{"host": run.host, "source": run.source, "format": FORMAT_RING, "count": run.record_count,
             "first_ts_ns": run.first_ts_ns, "last_ts_ns": run.last_ts_ns,
             "body": seal(_RING_HEADER.pack(run.offset_ns, run.stride) + run.records)}
            for run in runs if run.record_count]


def unpack_ring(body: bytes, count: int, *, host: str) -> tuple[list[ConnEvent], list[int] | None]:
    """The events of a format-2 body's records that decode, with their records' indexes where
    some did not (None: every record did, in order). Raises BlockError."""
    _check_count(count)
    body = _checked(body)
    if len(body) < _RING_HEADER.size:
        raise BlockError(f"{len(body)} bytes are too few for a header")
    offset_ns, stride = _RING_HEADER.unpack_from(body)
    if stride < RING_HEADER_BYTES + RECORD.size or stride % 8:
        raise BlockError(f"records {stride} bytes apart cannot hold a {RECORD.size}-byte record and its header")
    records = body[_RING_HEADER.size:]
    if len(records) != count * stride:
        raise BlockError(f"{len(records)} bytes of records are not {count} records of {stride}")
    tuples = list(ring_record(stride).iter_unpack(records))
    events, bad = _ring_builder(tuples, offset_ns, host)
    if not bad:
        return events, None
    log.warning("left out %d kernel records of a stored block that do not decode (%s)", len(bad), bad[0][1])
    indexes = [index for index, record in enumerate(tuples) if _ring_builder([record], offset_ns, host)[0]]
    return events, indexes


def events_of(block_id: int, fmt: int, count: int, body: bytes, *, host: str,
              source: str) -> Iterable[tuple[int, ConnEvent]]:
    """(event id, event) for each event of one stored block. Raises BlockError before yielding
    anything when the block does not decode."""
    first = event_id(block_id, 0)
    try:
        if fmt == FORMAT:
            events = unpack(bytes(body), count, host=host, source=source)
            return zip(range(first, first + len(events)), events, strict=True)
        if fmt == FORMAT_RING:
            events, indexes = unpack_ring(bytes(body), count, host=host)
            if indexes is None:
                return zip(range(first, first + len(events)), events, strict=True)
            return zip((first + index for index in indexes), events, strict=True)
    except BlockError as exc:
        raise BlockError(f"block {block_id}: {exc}") from None
    raise BlockError(f"block {block_id} has format {fmt}; this auditor reads formats {FORMAT} and {FORMAT_RING}")
