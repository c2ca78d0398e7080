"""A BPF ring buffer read straight from its memory mapping, a batch at a time.

bcc's reader (libbpf's ``ring_buffer__consume``) calls back into Python once per record: the
callback, the ctypes copy and the trampoline were a third of the probe reader's time. The ring
buffer map is designed to be mapped by its consumer (this is how libbpf reads it): one writable
page holding the consumer position, then a read-only page holding the producer position followed
by the data area, which the kernel offers twice in a row so that a run of records that wraps is
contiguous. Here the committed records between the two positions are copied out (one slice, or
two where the run wraps), decoded with ``struct.iter_unpack`` and the consumer position is
advanced once per batch. Only the first copy of the data area is mapped: the reader copies
anyway, and every mapped page of the ring counts in the process's RSS (16 MiB per copy by default).

Every record the probe writes has the same size (``struct event``), so records sit at a fixed
stride. A record header (``u32 len; u32 pg_off``) carries two flags in ``len``: BUSY (reserved,
not yet submitted) and DISCARD. Reading stops at the first busy record, as libbpf does. The
headers are checked in a first copy and the committed run is copied again before it is decoded:
a single copy could see a header that was committed while the record's body was read before it,
since one bulk copy does not order its own loads. That ordering argument holds on x86 (loads are
not reordered with other loads); ``supported()`` keeps other machines on bcc's reader.
"""

from __future__ import annotations

import contextlib
import mmap
import platform
import select
import struct
from collections.abc import Callable
from typing import Any

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HEADER_BYTES = 8
_POSITION = struct.Struct("=Q")
_HEADER_LEN = struct.Struct("=I")
MAX_BATCH_RECORDS = 32_768  # per read: bounds the memory one read holds on a full ring buffer (2 MiB)


def supported() -> bool:
    """Whether the lock-free read below is sound on this machine (total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


class MappedRingBuffer:
    """Fixed-size records of one BPF ring buffer map, read in batches without callbacks.

    ``record`` is the struct.Struct of one record's payload; ``read()`` returns their tuples.
    """

    def __init__(self, map_fd: int, data_bytes: int, record: struct.Struct) -> None:
        if data_bytes <= 0 or data_bytes & (data_bytes - 1) or data_bytes % mmap.PAGESIZE:
            raise ValueError(f"ring buffer size must be a power-of-two number of pages, got {data_bytes}")
        page = mmap.PAGESIZE
        self._consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._producer = mmap.mmap(map_fd, page + data_bytes, mmap.MAP_SHARED, mmap.PROT_READ,
                                   offset=page)
        self._data_offset = page
        self._data_bytes = data_bytes
        self._mask = data_bytes - 1
        self._position: int = _POSITION.unpack_from(self._consumer, 0)[0]
        self._payload = record.size
        self._stride = (HEADER_BYTES + record.size + 7) & ~7
        # One record with its header skipped: tuples of the payload's fields only.
        self._record = struct.Struct(f"={HEADER_BYTES}x{record.format.lstrip('=@<>!')}"
                                     f"{self._stride - HEADER_BYTES - record.size}x")
        committed = _HEADER_LEN.pack(record.size)
        self._committed_bytes = tuple(committed[i:i + 1] for i in range(4))
        self._fd = map_fd
        self._epoll: select.epoll | None = None  # registered on the first wait
        self.malformed = 0  # records of another size: never written by the probe, skipped

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        for mapping in (self._consumer, self._producer):
            with contextlib.suppress(BufferError):
                mapping.close()

    def wait(self, timeout_s: float) -> None:
        """Sleep until the kernel wakes readers (a batch is full) or ``timeout_s`` has passed;
        returns at once while unread records are signalled (level-triggered, as libbpf polls)."""
        if self._epoll is None:
            self._epoll = select.epoll()
            self._epoll.register(self._fd, select.EPOLLIN)
        self._epoll.poll(max(0.0, timeout_s))

    def pending_bytes(self) -> int:
        return int(_POSITION.unpack_from(self._producer, 0)[0]) - self._position

    def read(self) -> list[tuple[Any, ...]]:
        """The committed records from the consumer position on (at most MAX_BATCH_RECORDS), as
        tuples of the record struct; the consumer position moves past them."""
        out: list[tuple[Any, ...]] = []
        self._consume(lambda run: out.extend(self._record.iter_unpack(run)))
        return out

    def read_runs(self) -> list[bytes]:
        """The same records undecoded: runs of whole records, ``stride`` bytes each with its
        header, as the ring held them (a discarded record splits a run)."""
        runs: list[bytes] = []
        self._consume(runs.append)
        return runs

    @property
    def stride(self) -> int:
        return self._stride

    def _consume(self, take: Callable[[bytes], object]) -> None:
        available = min(self.pending_bytes(), MAX_BATCH_RECORDS * self._stride, self._data_bytes)
        done = 0
        while done < available:
            done += self._read_run(done, available - done, take)
            if done >= available or self._busy(done):
                break
            done += self._skip(done)
        if done:
            self._position += done
            _POSITION.pack_into(self._consumer, 0, self._position)  # frees the space for the kernel

    def _slice(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the data area from ``offset`` past the consumer position, joined
        across the end of the area (never longer than the area: reads are bounded by it)."""
        start = (self._position + offset) & self._mask
        base, head = self._data_offset, min(length, self._data_bytes - start)
        if head == length:
            return self._producer[base + start:base + start + length]
        return self._producer[base + start:base + start + head] + self._producer[base:base + length - head]

    def _read_run(self, offset: int, length: int, take: Callable[[bytes], object]) -> int:
        """Hand ``take`` the run of committed, full-size records at ``offset``; returns its bytes."""
        stride = self._stride
        count = length // stride
        if not count:
            return 0
        first = self._slice(offset, count * stride)
        # The first record whose header is not exactly "committed, payload size": a busy,
        # discarded or odd-sized one ends the run. Checked byte-wise at C speed.
        good = count
        for index, expected in enumerate(self._committed_bytes):
            column = first[index::stride]
            good = min(good, len(column) - len(column.lstrip(expected)))
        if not good:
            return 0
        take(self._slice(offset, good * stride))  # again: every record in it was committed before
        return good * stride

    def _header(self, offset: int) -> int:
        return int(_HEADER_LEN.unpack(self._slice(offset, _HEADER_LEN.size))[0])

    def _busy(self, offset: int) -> bool:
        """Whether the record at ``offset`` is still being written (reading stops there)."""
        return bool(self._header(offset) & BUSY_BIT)

    def _skip(self, offset: int) -> int:
        """Step over a discarded or odd-sized record; returns the bytes it takes."""
        header = self._header(offset)
        if not header & DISCARD_BIT:
            self.malformed += 1
        return (HEADER_BYTES + (header & ~(BUSY_BIT | DISCARD_BIT)) + 7) & ~7
