"""The daemon's side of loading the probe in a child: spawn ``probes.loader``, take its
descriptors, check them with the kernel, and keep them. No bcc is imported here.

The child runs the same interpreter in isolated mode (``-I``: no PYTHON* variables, no current
directory on the path) with this package's own directory put first, so it runs this code and
nothing a working directory could shadow. It inherits the process's ambient capabilities across
exec (the unit's CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH), which is all it needs.

Everything the child sends is checked before it is used: the message must be one JSON object of
the documented shape, every descriptor must be what the kernel says it is (a ring buffer of the
requested size, the port hash, the per-CPU counter, the port -> pid hash, perf events for both
tracepoints) and the record layout must be a struct of the nine fields of ``struct event``.
Anything else is a ``ProbeUnavailable`` naming what was wrong, with the descriptors closed and the
child stopped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from probes import bpfsys
from probes.clienttable import SLOT, ClientTable, slot_count
from probes.source import ProbeUnavailable

LOAD_TIMEOUT_S = 60.0  # compiling takes about a second; a loaded host with cold caches, longer
EXIT_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 64 * 1024
MAX_FDS = 16
RECORD_FIELDS = 9  # struct event in disconnect.h
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from probes.loader import main; sys.exit(main())"
FIX = "run `auditor doctor`; `auditor probe --dump-bpf` prints the program"


def loader_command() -> list[str]:
    return [sys.executable, "-I", "-c", BOOT, str(PACKAGE_ROOT)]


class LoadedProgram:
    """The attached program as descriptors: the daemon's whole hold on it. Closing the last
    perf-event descriptor detaches the tracepoints; the kernel frees program and maps with it."""

    def __init__(self, fds: dict[str, int], record: struct.Struct, ringbuf_bytes: int,
                 client_slot_bits: int = 0, fitted: tuple[str, ...] = ()) -> None:
        self.fds = fds
        self.fitted = fitted  # what the prebuilt loader changed to fit this kernel (prebuilt.Fitted.changes)
        self.record = record
        self.ringbuf_bytes = ringbuf_bytes
        self.events_fd = fds["map:events"]
        self._batch: bpfsys.BatchReader | bool | None = None  # False: the kernel has no batch reads
        try:  # the per-CPU counter has a slot per possible CPU
            self._cpus = bpfsys.possible_cpus()
        except (OSError, ValueError) as exc:
            raise ProbeUnavailable(f"the possible CPUs cannot be read ({exc})",
                                   "mount sysfs at /sys") from None
        self._table = ClientTable(fds["map:client_slots"], client_slot_bits, fds["map:client_counts"])  # mapped last

    def add_port(self, port: int) -> None:
        self._set_bit(port, True)

    def remove_port(self, port: int) -> None:
        self._set_bit(port, False)
        fd = self.fds["map:server_pids"]
        for key in bpfsys.map_items(fd, SERVER_KEY.size, _PID.size):
            if SERVER_KEY.unpack_from(key)[0] == port:
                bpfsys.map_delete(fd, key)

    def _set_bit(self, port: int, on: bool) -> None:
        """The port's bit in ``watched_ports`` (a u64 a 64 ports); only this process writes it."""
        fd, index = self.fds["map:watched_ports"], _INDEX.pack(port >> 6)
        word = _COUNTER.unpack(bpfsys.map_lookup(fd, index, 8))[0]
        bit = 1 << (port & 63)
        bpfsys.map_update(fd, index, _COUNTER.pack(word | bit if on else word & ~bit))

    def server_pids(self) -> dict[bytes, int]:
        """``struct server_key`` (a watched port and a local address) -> the process the program
        last saw closing a connection there (unchecked), for each one it has seen."""
        items = bpfsys.map_items(self.fds["map:server_pids"], SERVER_KEY.size, _PID.size)
        return {key: int(_PID.unpack(value)[0]) for key, value in items.items()}

    def clients(self) -> dict[bytes, bytes]:
        """The clients table (``struct client_key`` -> ``struct client``): every ESTABLISHED
        server socket of a watched port, from the mapped slots and the ``clients`` hash where it
        holds any, this in batches where the kernel reads them (5.6), else key by key."""
        return {**self._table.listed(), **({} if self._table.hash_empty() else self._hash_items())}

    def _hash_items(self) -> dict[bytes, bytes]:
        if self._batch is not False:
            try:
                if self._batch is None:
                    self._batch = bpfsys.BatchReader(self.fds["map:clients"], CLIENT_KEY.size, CLIENT.size)
                return self._batch.read()
            except bpfsys.BpfSyscallError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOTSUPP, errno.EOPNOTSUPP):
                    raise
                self._batch = False
        return bpfsys.map_items(self.fds["map:clients"], CLIENT_KEY.size, CLIENT.size)

    def accepted(self) -> int:
        """Clients of the watched ports accepted so far (the program's count)."""
        return self._table.accepted()

    def add_clients(self, clients: dict[bytes, bytes]) -> None:
        """Clients connected before their port was watched; one the kernel added meanwhile (in a
        slot or the hash) stays as it is, and is not put in twice."""
        for key in self._table.unheld(clients):
            if bpfsys.map_update(self.fds["map:clients"], key, clients[key], bpfsys.BPF_NOEXIST, missing_ok=True):
                self._table.hash_added += 1

    def remove_clients(self, keys: set[bytes]) -> None:
        for key in self._table.remove(keys):
            if bpfsys.map_delete(self.fds["map:clients"], key):
                self._table.hash_removed += 1

    def lost(self) -> int:
        """The per-CPU lost-event counters, summed."""
        raw = bpfsys.map_lookup(self.fds["map:lost_events"], _INDEX.pack(0), 8 * self._cpus)
        return sum(value for (value,) in _COUNTER.iter_unpack(raw))

    def program_runs(self) -> dict[str, bpfsys.ProgramRuns]:
        """Per tracepoint, the run time and count the kernel keeps of its program (zero and still
        while ``kernel.bpf_stats_enabled`` is 0)."""
        return {name.removeprefix("program:"): bpfsys.program_runs(fd)
                for name, fd in self.fds.items() if name.startswith("program:")}

    def close(self) -> None:
        self._table.close()
        close_all(self.fds)
        self.fds = {}


_INDEX, _COUNTER, _PID = struct.Struct("=i"), struct.Struct("=Q"), struct.Struct("=I")
# disconnect.bpf.c's struct server_key (sport, family, saddr)
SERVER_KEY = struct.Struct("=HH16s")
# disconnect.bpf.c's struct client_key (sport, dport, family, pad, daddr, saddr) and struct client
# (accepted_ns, last_read_ns)
CLIENT_KEY, CLIENT = struct.Struct("=HHHH16s16s"), struct.Struct("=QQ")


def load_in_child(text: str, cflags: list[str], *, ringbuf_bytes: int,
                  tracepoints: tuple[str, ...], client_slot_bits: int = 0,
                  timeout_s: float = LOAD_TIMEOUT_S, command: list[str] | None = None) -> LoadedProgram:
    """Have a child compile and attach ``text`` (with ``tracepoints`` as category:name); the
    checked result, whose descriptors the caller owns from here on."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, tempfile.TemporaryFile() as stderr:
        try:
            child = subprocess.Popen(command or loader_command(), stdin=theirs.fileno(),
                                     stdout=subprocess.DEVNULL, stderr=stderr)
        except OSError as exc:
            raise ProbeUnavailable(f"the BPF loader could not start ({exc})", FIX) from None
        finally:
            theirs.close()
        try:
            message, fds = _exchange(ours, child, stderr, text, cflags, timeout_s)
        except BaseException:  # no answer, a broken one, or Ctrl-C: the child has no more use
            _stop(child, wait_s=0)
            raise
        _stop(child, wait_s=EXIT_TIMEOUT_S)
        try:
            return _checked(message, fds, ringbuf_bytes, tracepoints, client_slot_bits, stderr)
        except BaseException:
            close_all(fds)
            raise


def close_all(fds: list[int] | dict[str, int]) -> None:
    for fd in fds.values() if isinstance(fds, dict) else fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _exchange(sock: socket.socket, child: subprocess.Popen[bytes], stderr: IO[bytes], text: str,
              cflags: list[str], timeout_s: float) -> tuple[bytes, list[int]]:
    """Send the request and take the one answer: (bytes, descriptors)."""
    sock.settimeout(timeout_s)
    try:
        sock.send(json.dumps({"text": text, "cflags": cflags}).encode())
        data, fds, flags, _ = socket.recv_fds(sock, MAX_ANSWER_BYTES, MAX_FDS,
                                              socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise ProbeUnavailable(f"the BPF loader did not answer within {timeout_s:g} s and was "
                               "stopped", FIX) from None
    except OSError as exc:  # the child died before reading: its stderr says why
        raise ProbeUnavailable(f"the BPF loader failed ({_died(child, stderr, exc)})", FIX) from None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_all(fds)
        raise ProbeUnavailable("the BPF loader's answer is not usable (longer than "
                               f"{MAX_ANSWER_BYTES} bytes or more than {MAX_FDS} descriptors)", FIX)
    if not data:
        close_all(fds)
        raise ProbeUnavailable(f"the BPF loader failed ({_died(child, stderr, None)})", FIX)
    return data, fds


def _died(child: subprocess.Popen[bytes], stderr: IO[bytes], exc: OSError | None) -> str:
    try:
        code: int | None = child.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    why = f"exit status {code}" if code is not None else (str(exc) if exc else "no answer")
    last = _stderr_line(stderr, last=True)
    return f"{why}, no answer: {last}" if last else f"{why}, no answer"


def _stderr_line(stderr: IO[bytes], *, last: bool = False, containing: str = "") -> str:
    """One line of the child's stderr, at most 200 characters ('' when there is none)."""
    stderr.seek(0)
    lines = [line.strip() for line in stderr.read(1 << 20).decode(errors="replace").splitlines()
             if line.strip() and containing in line]
    if not lines:
        return ""
    return (lines[-1] if last else lines[0])[:200]


def _stop(child: subprocess.Popen[bytes], wait_s: float) -> None:
    """Reap the child, killing it when it has not exited within ``wait_s``. SIGKILL skips bcc's
    exit handler, which is right either way: after an answer the descriptors are ours, and
    without one there is nothing the kernel keeps once the child's descriptors are gone."""
    try:
        child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _checked(data: bytes, fds: list[int], ringbuf_bytes: int, tracepoints: tuple[str, ...],
             client_slot_bits: int, stderr: IO[bytes]) -> LoadedProgram:
    try:
        message = json.loads(data)
    except ValueError:
        raise _garbage(f"not JSON: {data[:80]!r}") from None
    if not isinstance(message, dict) or not isinstance(message.get("ok"), bool):
        raise _garbage(f"not an answer object: {data[:80]!r}")
    if not message["ok"]:
        reason = message.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise _garbage("a failure without a reason")
        detail = _stderr_line(stderr, containing="error:")
        reason = reason.strip().splitlines()[0][:300] + (f"; {detail}" if detail else "")
        raise ProbeUnavailable(reason, FIX)
    named = _named_fds(message, fds)
    _check_kernel_objects(named, ringbuf_bytes, tracepoints, client_slot_bits)
    try:
        return LoadedProgram(named, _record(message.get("record_format")), ringbuf_bytes, client_slot_bits)
    except OSError as exc:  # the slots cannot be mapped (a kernel before 5.5 has no mappable maps)
        raise _garbage(f"the clients table cannot be mapped ({exc})") from None


def _garbage(what: str) -> ProbeUnavailable:
    return ProbeUnavailable(f"the BPF loader's answer is not usable ({what})", FIX)


def _named_fds(message: dict[str, Any], fds: list[int]) -> dict[str, int]:
    """name -> descriptor for the maps, the attached tracepoints and their programs; each
    descriptor used once."""
    maps, attached, programs = message.get("maps"), message.get("attached"), message.get("programs")
    if not isinstance(maps, dict) or not isinstance(attached, dict) or not isinstance(programs, dict):
        raise _garbage("maps, attached or programs missing")
    named: dict[str, int] = {}
    for group, entries in (("map", maps), ("tracepoint", attached), ("program", programs)):
        for name, index in entries.items():
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(fds):
                raise _garbage(f"{group} {name!r} names descriptor {index!r} of {len(fds)}")
            named[f"{group}:{name}"] = fds[index]
    if sorted(named.values()) != sorted(fds):
        raise _garbage(f"{len(fds)} descriptors for {len(named)} names")
    return named


def _check_kernel_objects(named: dict[str, int], ringbuf_bytes: int,
                          tracepoints: tuple[str, ...], client_slot_bits: int) -> None:
    expected = {  # name -> (map type, key size, value size, entries or None)
        "map:events": (bpfsys.BPF_MAP_TYPE_RINGBUF, 0, 0, ringbuf_bytes),
        "map:watched_ports": (bpfsys.BPF_MAP_TYPE_ARRAY, 4, 8, 1024),
        "map:lost_events": (bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, 4, 8, 1),
        "map:server_pids": (bpfsys.BPF_MAP_TYPE_HASH, SERVER_KEY.size, 4, None),
        "map:clients": (bpfsys.BPF_MAP_TYPE_HASH, CLIENT_KEY.size, CLIENT.size, None),
        "map:client_counts": (bpfsys.BPF_MAP_TYPE_ARRAY, 4, 8, 3),
        "map:client_slots": (bpfsys.BPF_MAP_TYPE_ARRAY, 4, SLOT.size, slot_count(client_slot_bits)),
    }
    attached = {f"tracepoint:{tp}" for tp in tracepoints}
    programs = {f"program:{tp}" for tp in tracepoints}
    if set(named) != set(expected) | attached | programs:
        raise _garbage(f"expected {sorted(set(expected) | attached | programs)}, got {sorted(named)}")
    for name, (map_type, key, value, entries) in expected.items():
        try:
            info = bpfsys.map_info(named[name])
        except OSError as exc:
            raise _garbage(f"{name} is not a BPF map ({exc})") from None
        if (info.type, info.key_size, info.value_size) != (map_type, key, value) or (
                entries is not None and info.max_entries != entries):
            raise _garbage(f"{name} is {info}, expected type {map_type}, key {key}, value {value}"
                           f", entries {entries}")
    for names, kind, what in ((attached, "anon_inode:[perf_event]", "a perf event"),
                              (programs, "anon_inode:bpf-prog", "a BPF program")):
        for name in names:
            target = os.readlink(f"/proc/self/fd/{named[name]}")
            if target != kind:
                raise _garbage(f"{name} is {target}, not {what}")


def _record(fmt: object) -> struct.Struct:
    if not isinstance(fmt, str):
        raise _garbage("no record_format")
    try:
        record = struct.Struct(fmt)
        fields = len(record.unpack(bytes(record.size)))
    except struct.error as exc:
        raise _garbage(f"record_format {fmt!r}: {exc}") from None
    if fields != RECORD_FIELDS or not 0 < record.size <= 4096:
        raise _garbage(f"record_format {fmt!r} has {fields} fields of {record.size} bytes, "
                       f"expected {RECORD_FIELDS}")
    return record
