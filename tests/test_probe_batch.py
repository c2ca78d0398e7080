"""The probe reader's batch path without the kernel: the ring-buffer reader against a ring laid out
in a memfd laid out as the kernel maps it (a consumer page, a producer page, then the data area;
the kernel's second copy of the data area is left blank, since the reader maps only the first), and the bulk decoding of records into ConnEvents."""

from __future__ import annotations

import mmap
import os
import socket
import struct
from collections.abc import Iterator

import pytest

from auditor.model import ConnEvent, ConnEventKind
from probes.decode import _FIELDS, AF_INET, AF_INET6, EventBuilder
from probes.ringbuf import BUSY_BIT, DISCARD_BIT, MappedRingBuffer

PAGE = mmap.PAGESIZE
DATA = 2 * PAGE
PAYLOAD = struct.Struct("=QQ")  # 16 bytes: a record takes 24 with its header


class Ring:
    def __init__(self) -> None:
        self.fd = os.memfd_create("ring")
        os.ftruncate(self.fd, 2 * PAGE + 2 * DATA)
        self.map = mmap.mmap(self.fd, 2 * PAGE + 2 * DATA)
        self.producer = 0

    def put(self, *values: int, flags: int = 0, size: int = PAYLOAD.size) -> None:
        record = struct.pack("=II", size | flags, 0) + PAYLOAD.pack(*values)[:size].ljust(size, b"\0")
        record = record.ljust((len(record) + 7) & ~7, b"\0")
        for i, byte in enumerate(record):  # the first copy only: the reader maps only that one
            self.map[2 * PAGE + (self.producer + i) % DATA] = byte
        self.producer += len(record)
        struct.pack_into("=Q", self.map, PAGE, self.producer)

    def consumer(self) -> int:
        return int(struct.unpack_from("=Q", self.map, 0)[0])


@pytest.fixture
def ring() -> Iterator[Ring]:
    ring = Ring()
    yield ring
    ring.map.close()
    os.close(ring.fd)


def test_reads_committed_records_in_order_and_frees_them(ring: Ring) -> None:
    reader = MappedRingBuffer(ring.fd, DATA, PAYLOAD)
    for i in range(10):
        ring.put(i, i * 2)
    assert reader.read() == [(i, i * 2) for i in range(10)]
    assert ring.consumer() == 10 * 24
    assert reader.read() == []


def test_stops_at_a_busy_record_and_resumes_there(ring: Ring) -> None:
    reader = MappedRingBuffer(ring.fd, DATA, PAYLOAD)
    ring.put(1, 1)
    ring.put(2, 2, flags=BUSY_BIT)
    assert reader.read() == [(1, 1)]
    assert ring.consumer() == 24
    struct.pack_into("=I", ring.map, 2 * PAGE + 24, PAYLOAD.size)  # the kernel submits it
    ring.put(3, 3)
    assert reader.read() == [(2, 2), (3, 3)]


def test_skips_discarded_and_counts_odd_sized_records(ring: Ring) -> None:
    reader = MappedRingBuffer(ring.fd, DATA, PAYLOAD)
    ring.put(1, 1)
    ring.put(9, 9, flags=DISCARD_BIT)
    ring.put(7, 7, size=8)  # another size: never written by the probe
    ring.put(2, 2)
    assert reader.read() == [(1, 1), (2, 2)]
    assert reader.malformed == 1
    assert ring.consumer() == ring.producer


def test_records_that_wrap_around_the_end_read_whole(ring: Ring) -> None:
    reader = MappedRingBuffer(ring.fd, DATA, PAYLOAD)
    per_lap = DATA // 24
    for lap in range(3):
        values = [(lap, i) for i in range(per_lap - 5)]
        for value in values:
            ring.put(*value)
        assert reader.read() == values
    assert ring.consumer() == ring.producer > DATA


def test_event_builder_by_position_builds_what_the_constructor_would() -> None:
    v4 = socket.inet_pton(socket.AF_INET, "10.0.0.7").ljust(16, b"\0")
    v6 = socket.inet_pton(socket.AF_INET6, "::ffff:10.0.0.8")
    records = [
        (100, 1 << 63 | 42, v4, v4, 8000, 40000, AF_INET, 1, 1),
        (200, 43, v6, v6, 8000, 40001, AF_INET6, 2, 0),
        (300, 44, v4, v4, 8000, 40002, AF_INET, 99, 0),  # no such kind
        (400, 45, v4, v4, 8000, 40003, 7, 4, 0),  # no such family
    ]
    fast, fast_bad = EventBuilder(by_position=True)(records, 5, "gpu-1")
    slow, slow_bad = EventBuilder(by_position=False)(records, 5, "gpu-1")
    assert fast == slow == [
        ConnEvent(105, ConnEventKind.PEER_FIN, 4, "10.0.0.7", 40000, "10.0.0.7", 8000, 42, "gpu-1"),
        ConnEvent(205, ConnEventKind.PEER_RST, 6, "::ffff:10.0.0.8", 40001, "::ffff:10.0.0.8", 8000,
                  43, "gpu-1"),
    ]
    assert [hash(e) for e in fast] == [hash(e) for e in slow]
    assert [r for r, _ in fast_bad] == [r for r, _ in slow_bad] == records[2:]
    assert ConnEvent._fields == _FIELDS  # the model still has the order the fast path fills
