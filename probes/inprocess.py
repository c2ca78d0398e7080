"""The probe compiled and attached by bcc inside this process: the path for machines where the
daemon cannot hold the program by its descriptors alone (no known bpf(2) syscall number, or no
sound lock-free ring buffer read, see ``probes.ringbuf.supported``), and the baseline that
``bench/footprint.py`` compares the child loader against. It maps libbcc and LLVM (about
150 MiB) for the life of the process; ``probes.handoff`` is the default where it can run.

Same surface as ``probes.handoff.LoadedProgram``, plus bcc's per-record callback reader.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable
from typing import Any

from probes.bpfsys import ProgramRuns, program_runs
from probes.clienttable import ClientTable
from probes.decode import struct_format
from probes.loader import tracepoint_function
from probes.source import ProbeUnavailable

log = logging.getLogger(__name__)


class BccProgram:
    def __init__(self, text: str, cflags: list[str], client_slot_bits: int = 0) -> None:
        from bcc import BPF

        try:
            self._bpf = BPF(text=text.encode(), cflags=cflags)
        except Exception as exc:  # bcc raises bare Exception for compile and load failures
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ProbeUnavailable(
                f"the BPF program failed to load ({first_line})",
                "run `auditor doctor`; `auditor probe --dump-bpf` prints the program") from exc
        self._events = self._bpf[b"events"]
        self._watched = self._bpf[b"watched_ports"]
        self._lost = self._bpf[b"lost_events"]
        self._server_pids = self._bpf[b"server_pids"]
        self._clients = self._bpf[b"clients"]
        slots = self._bpf[b"client_slots"]
        try:
            self._table = ClientTable(int(slots.map_fd), client_slot_bits, int(self._bpf[b"client_counts"].map_fd),
                                      clear=lambda index: slots.__setitem__(ctypes.c_int(index), slots.Leaf()))
        except OSError as exc:  # a kernel before 5.5 has no mappable maps
            self._bpf.cleanup()
            raise ProbeUnavailable(f"the probe's clients table cannot be mapped ({exc})",
                                   "run `auditor doctor`") from None
        # The payload layout as bcc sees struct event (a cast of a blank buffer: no record needed).
        self.record = struct_format(self._events.event(ctypes.create_string_buffer(4096)).__class__)
        self.events_fd = int(self._events.map_fd)
        self.ringbuf_bytes = int(self._events.max_entries)

    def add_port(self, port: int) -> None:
        self._set_bit(port, True)

    def remove_port(self, port: int) -> None:
        self._set_bit(port, False)
        for key in [key for key in self._server_pids if key.sport == port]:
            with contextlib.suppress(KeyError):
                del self._server_pids[key]

    def _set_bit(self, port: int, on: bool) -> None:
        """The port's bit in ``watched_ports`` (a u64 a 64 ports)."""
        index = ctypes.c_int(port >> 6)
        word, bit = int(self._watched[index].value), 1 << (port & 63)
        self._watched[index] = ctypes.c_ulonglong(word | bit if on else word & ~bit)

    def server_pids(self) -> dict[bytes, int]:
        """As ``probes.handoff.LoadedProgram.server_pids`` gives them."""
        return {bytes(key): int(value.value) for key, value in self._server_pids.items()}

    def clients(self) -> dict[bytes, bytes]:
        """The clients table, as ``probes.handoff.LoadedProgram.clients`` gives it."""
        hashed = {} if self._table.hash_empty() else {bytes(key): bytes(value) for key, value in self._clients.items()}
        return {**self._table.listed(), **hashed}

    def accepted(self) -> int:
        return self._table.accepted()

    def add_clients(self, clients: dict[bytes, bytes]) -> None:
        table = self._clients
        for key in self._table.unheld(clients):
            found = table.Key.from_buffer_copy(key)
            if found not in table:  # one the kernel added meanwhile stays
                table[found] = table.Leaf.from_buffer_copy(clients[key])
                self._table.hash_added += 1

    def remove_clients(self, keys: set[bytes]) -> None:
        for key in self._table.remove(keys):
            with contextlib.suppress(KeyError):
                del self._clients[self._clients.Key.from_buffer_copy(key)]
                self._table.hash_removed += 1

    def lost(self) -> int:
        return int(sum(self._lost[ctypes.c_int(0)]))

    def program_runs(self) -> dict[str, ProgramRuns]:
        """As ``LoadedProgram.program_runs``: the kernel's counts for each tracepoint's program."""
        runs = {}
        for tracepoint in self._bpf.tracepoint_fds:
            function = self._bpf.funcs.get(tracepoint_function(tracepoint))
            if function is not None:  # attached otherwise than by TRACEPOINT_PROBE: not counted here
                runs[tracepoint.decode()] = program_runs(function.fd)
        return runs

    def close(self) -> None:
        self._table.close()
        self._bpf.cleanup()

    # -- bcc's reader: one callback per record ----------------------------------------------
    def open_callbacks(self, on_record: Callable[[Any, Any, int], int]) -> None:
        self._events.open_ring_buffer(on_record)

    def poll(self, timeout_ms: int) -> None:
        self._bpf.ring_buffer_poll(timeout_ms)
        self._bpf.ring_buffer_consume()  # records submitted without a wake-up
