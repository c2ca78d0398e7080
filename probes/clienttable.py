"""The probe's clients table as it lies in the kernel: its ``client_slots`` array and its
``client_counts`` mapped read-only into this process.

``disconnect.bpf.c`` keeps its clients table in two maps: a socket claims the slot its address
hashes to (a compare-and-swap, no allocation), and goes to the ``clients`` hash only when that
slot is held. Listing reads both. The array is mapped (``BPF_F_MMAPABLE``, Linux 5.5), so a
listing is a copy of its bytes and a scan for the claimed slots, with no system call; a slot is
taken out (its port no longer watched) by a write through bpf(2). The hash is read only when it
may hold a client (``hash_empty``): a batch read of an empty one still walks its 65,536 buckets.

A slot is listed once its owner and its key's server port are both set: the program claims the
owner, writes the times, then the key; it clears the key's port before it frees the owner. A slot
read while it is being filled can be half written; the accept count, which the program increments
after the fill, is read around a listing and tells such a listing apart (``accepted``).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterable

from probes import bpfsys

# struct client_slot: owner (the socket's address), struct client_key (40 bytes), struct client
SLOT = struct.Struct("=Q40sQQ")
KEY_AT, CLIENT_AT = 8, 48  # offsets of the key (its server port first) and of struct client
_NONZERO = bytes([0] + [1] * 255)  # a translate table: 1 for any byte but 0
_FREE = bytes(KEY_AT)  # an unclaimed slot's owner
# client_counts: accepted, put in the hash by the program, taken out of it by the program
_COUNTS = struct.Struct("=QQQ")


def slot_count(bits: int) -> int:
    """The array's length for ``CLIENT_SLOT_BITS`` (one unused slot where slots are off)."""
    return 1 << bits if bits else 1


class ClientTable:
    """The slots behind ``slots_fd``, of ``CLIENT_SLOT_BITS`` ``bits`` (none listed where those are
    0: the program was built without slots), and the counters behind ``counts_fd``; the caller
    keeps both descriptors open, and counts its own changes to the hash in ``hash_added`` and
    ``hash_removed``."""

    def __init__(self, slots_fd: int, bits: int, counts_fd: int,
                 clear: Callable[[int], None] | None = None) -> None:
        self.slots = slot_count(bits)
        self.map_fd: int | None = slots_fd if bits else None
        self._clear = clear or self._clear_by_syscall  # bcc's table where bpf(2) is not known here
        self._counts = mmap.mmap(counts_fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        self._map: mmap.mmap | None = None
        try:
            if self.map_fd is not None:
                length = -(-self.slots * SLOT.size // mmap.PAGESIZE) * mmap.PAGESIZE
                self._map = mmap.mmap(slots_fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            self._counts.close()
            raise
        self._zero = bytes(SLOT.size)
        self.hash_added = self.hash_removed = 0  # by user space: clients seeded, clients forgotten

    def accepted(self) -> int:
        """Clients of the watched ports accepted so far (the program's count)."""
        return int(_COUNTS.unpack_from(self._counts)[0])

    def hash_empty(self) -> bool:
        """Whether the hash holds no client: none put in (by the program or user space) that was
        not taken out. A client the program replaced in the hash counts twice, which only reads
        the hash where it need not."""
        _accepted, added, removed = _COUNTS.unpack_from(self._counts)
        return added + self.hash_added - removed - self.hash_removed <= 0

    def items(self) -> dict[bytes, tuple[int, bytes]]:
        """The listed clients: ``struct client_key`` -> (slot index, ``struct client``). The
        claimed slots are found at C speed: each slot's server-port bytes, marked nonzero by
        ``translate``, searched with ``find`` (a scan slot by slot in Python costs about ten times
        more with a few clients)."""
        if self._map is None:
            return {}
        data = self._map[:self.slots * SLOT.size]  # one copy: the program writes on meanwhile
        used: set[int] = set()
        for byte in (KEY_AT, KEY_AT + 1):  # the port's two bytes: either is nonzero in a listed slot
            marks = data[byte::SLOT.size].translate(_NONZERO)
            index = marks.find(1)
            while index >= 0:
                used.add(index)
                index = marks.find(1, index + 1)
        found: dict[bytes, tuple[int, bytes]] = {}
        for index in used:
            at = index * SLOT.size
            if data[at:at + KEY_AT] != _FREE:  # owner set: not released under the copy
                found[data[at + KEY_AT:at + CLIENT_AT]] = (index, data[at + CLIENT_AT:at + SLOT.size])
        return found

    def listed(self) -> dict[bytes, bytes]:
        """``struct client_key`` -> ``struct client``, as the clients hash reads."""
        return {key: client for key, (_index, client) in self.items().items()}

    def unheld(self, keys: Iterable[bytes]) -> list[bytes]:
        """Those of ``keys`` no slot holds. A connection sock_diag shows ESTABLISHED that the
        program saw accepted has its slot already: the program runs before the state is stored."""
        held = self.items()
        return [key for key in keys if key not in held]

    def remove(self, keys: set[bytes]) -> set[bytes]:
        """Free the slots of ``keys``, clients of ports the program no longer watches (it no longer
        touches their slots); the keys no slot holds, for the caller to delete from the hash."""
        held = self.items()
        for key in keys & held.keys():
            self._clear(held[key][0])
        return keys - held.keys()

    def _clear_by_syscall(self, index: int) -> None:
        assert self.map_fd is not None  # only slots that were listed are cleared
        bpfsys.map_update(self.map_fd, struct.pack("=I", index), self._zero)

    def close(self) -> None:
        self._counts.close()
        if self._map is not None:
            self._map.close()
            self._map = None
