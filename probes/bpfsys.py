"""The few bpf(2) commands the daemon needs on maps it was handed, through ctypes: no bcc, no LLVM.

The program is compiled and attached by a short-lived child (``probes.loader``); the daemon keeps
only file descriptors. Updating the port filter, reading the lost-event counter and checking what
a descriptor is are single system calls, done here. The syscall number differs per architecture;
an architecture missing from ``SYSCALL_NUMBERS`` gets ``BpfSyscallError`` rather than a guess.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass
from pathlib import Path

# __NR_bpf: arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
SYSCALL_NUMBERS = {"x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280}

# enum bpf_cmd (include/uapi/linux/bpf.h)
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 3, 4
BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD = 14, 15
BPF_ANY, BPF_NOEXIST = 0, 1
# enum bpf_map_type: the four the probe hands over
BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_RINGBUF = 1, 2, 6, 27

# union bpf_attr for the element commands: u32 map_fd, (pad), u64 key, u64 value, u64 flags.
_ELEM_ATTR = struct.Struct("=I4xQQQ")
# ... for the batch commands: u64 in_batch, u64 out_batch, u64 keys, u64 values, u32 count,
# u32 map_fd, u64 elem_flags, u64 flags.
_BATCH_ATTR = struct.Struct("=QQQQIIQQ")
# ... for BPF_MAP_GET_FD_BY_ID: u32 map_id, u32 next_id, u32 open_flags.
_ID_ATTR = struct.Struct("=III")
# ... and for BPF_OBJ_GET_INFO_BY_FD: u32 bpf_fd, u32 info_len, u64 info.
_INFO_ATTR = struct.Struct("=IIQ")
# struct bpf_map_info, its first fields: type, id, key_size, value_size, max_entries, map_flags.
_MAP_INFO = struct.Struct("=IIIIII")
_MAP_INFO_BYTES = 88  # the whole struct on current kernels; an older kernel fills less


class BpfSyscallError(OSError):
    """A bpf(2) command failed; the message names the command and the kernel's reason."""


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int


def syscall_number(machine: str | None = None) -> int:
    arch = (machine or platform.machine()).lower()
    try:
        return SYSCALL_NUMBERS[arch]
    except KeyError:
        raise BpfSyscallError(errno.ENOSYS, f"the bpf(2) syscall number of {arch} is not known "
                              f"here (known: {', '.join(sorted(SYSCALL_NUMBERS))})") from None


def supported() -> bool:
    try:
        syscall_number()
    except BpfSyscallError:
        return False
    return True


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(command: int, attr: ctypes.Array[ctypes.c_char], what: str) -> int:
    result = int(_libc.syscall(ctypes.c_long(syscall_number()), ctypes.c_int(command), attr,
                               ctypes.c_uint(len(attr))))
    if result < 0:
        code = ctypes.get_errno()
        raise BpfSyscallError(code, f"bpf({what}): {os.strerror(code)}")
    return result


def map_update(map_fd: int, key: bytes, value: bytes, flags: int = BPF_ANY, missing_ok: bool = False) -> bool:
    """Set ``key``; with BPF_NOEXIST only where it is not there (``missing_ok``: quietly not, and
    False)."""
    key_buf, value_buf = ctypes.create_string_buffer(key), ctypes.create_string_buffer(value)
    attr = ctypes.create_string_buffer(_ELEM_ATTR.pack(map_fd, ctypes.addressof(key_buf),
                                                       ctypes.addressof(value_buf), flags))
    try:
        _bpf(BPF_MAP_UPDATE_ELEM, attr, "map update")
    except BpfSyscallError as exc:
        if not (missing_ok and exc.errno == errno.EEXIST):
            raise
        return False
    return True


def map_delete(map_fd: int, key: bytes) -> bool:
    """Remove ``key``; False when it was not there."""
    key_buf = ctypes.create_string_buffer(key)
    attr = ctypes.create_string_buffer(_ELEM_ATTR.pack(map_fd, ctypes.addressof(key_buf), 0, 0))
    try:
        _bpf(BPF_MAP_DELETE_ELEM, attr, "map delete")
    except BpfSyscallError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return True


def map_lookup(map_fd: int, key: bytes, value_bytes: int) -> bytes:
    key_buf, value_buf = ctypes.create_string_buffer(key), ctypes.create_string_buffer(value_bytes)
    attr = ctypes.create_string_buffer(_ELEM_ATTR.pack(map_fd, ctypes.addressof(key_buf),
                                                       ctypes.addressof(value_buf), 0))
    _bpf(BPF_MAP_LOOKUP_ELEM, attr, "map lookup")
    return value_buf.raw[:value_bytes]


class BatchReader:
    """Every key and value of one hash map, read ``chunk`` entries a system call
    (BPF_MAP_LOOKUP_BATCH, Linux 5.6): a few calls where ``map_items`` makes two an entry. The
    buffers are kept from read to read. ``read`` raises BpfSyscallError EINVAL where the kernel
    has no batch reads."""

    def __init__(self, map_fd: int, key_bytes: int, value_bytes: int, chunk: int = 256) -> None:
        self.map_fd, self.key_bytes, self.value_bytes, self.chunk = map_fd, key_bytes, value_bytes, chunk
        self._keys = ctypes.create_string_buffer(key_bytes * chunk)
        self._values = ctypes.create_string_buffer(value_bytes * chunk)
        self._in, self._out = ctypes.create_string_buffer(8), ctypes.create_string_buffer(8)  # the kernel's u32 token

    def read(self) -> dict[bytes, bytes]:
        items: dict[bytes, bytes] = {}
        first = True
        while True:
            attr = ctypes.create_string_buffer(_BATCH_ATTR.pack(
                0 if first else ctypes.addressof(self._in), ctypes.addressof(self._out),
                ctypes.addressof(self._keys), ctypes.addressof(self._values), self.chunk, self.map_fd, 0, 0))
            done = False
            try:
                _bpf(BPF_MAP_LOOKUP_BATCH, attr, "map batch lookup")
            except BpfSyscallError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: the last of them (count says how many came)
                    raise
                done = True
            count = struct.unpack_from("=I", attr.raw, 32)[0]
            keys, values = self._keys.raw, self._values.raw
            for index in range(count):
                items[keys[index * self.key_bytes:(index + 1) * self.key_bytes]] = \
                    values[index * self.value_bytes:(index + 1) * self.value_bytes]
            if done:
                return items
            ctypes.memmove(self._in, self._out, 8)
            first = False


def map_items(map_fd: int, key_bytes: int, value_bytes: int) -> dict[bytes, bytes]:
    """Every key of a hash map with its value, walked key by key (two system calls an entry). An
    entry added during the walk may or may not be seen; one deleted is skipped. The kernel starts
    over from the first key when the walk's last key was deleted meanwhile: keys seen before are
    taken once, and the walk ends at the first key it has seen twice in a row."""
    items: dict[bytes, bytes] = {}
    key, next_key = ctypes.create_string_buffer(key_bytes), ctypes.create_string_buffer(key_bytes)
    value = ctypes.create_string_buffer(value_bytes)
    walk = ctypes.create_string_buffer(_ELEM_ATTR.pack(map_fd, 0, ctypes.addressof(next_key), 0))
    after = ctypes.create_string_buffer(_ELEM_ATTR.pack(map_fd, ctypes.addressof(key), ctypes.addressof(next_key), 0))
    lookup = ctypes.create_string_buffer(_ELEM_ATTR.pack(map_fd, ctypes.addressof(next_key),
                                                         ctypes.addressof(value), 0))
    repeated = 0
    while repeated < 2:
        try:
            _bpf(BPF_MAP_GET_NEXT_KEY, walk, "map walk")
        except BpfSyscallError as exc:
            if exc.errno == errno.ENOENT:
                break  # past the last key
            raise
        found = next_key.raw
        repeated = repeated + 1 if found in items else 0
        if not repeated:
            try:
                _bpf(BPF_MAP_LOOKUP_ELEM, lookup, "map lookup")
            except BpfSyscallError as exc:
                if exc.errno != errno.ENOENT:
                    raise
            else:
                items[found] = value.raw
        ctypes.memmove(key, next_key, key_bytes)
        walk = after
    return items


def map_info(fd: int) -> MapInfo:
    """What the kernel says the map behind ``fd`` is; BpfSyscallError when it is not a BPF map."""
    info = ctypes.create_string_buffer(_MAP_INFO_BYTES)
    attr = ctypes.create_string_buffer(_INFO_ATTR.pack(fd, _MAP_INFO_BYTES, ctypes.addressof(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, "object info")
    map_type, map_id, key_size, value_size, max_entries, _flags = _MAP_INFO.unpack_from(info.raw)
    return MapInfo(map_type, map_id, key_size, value_size, max_entries)


def map_by_id(map_id: int) -> int:
    """A new descriptor for the map with this id (BpfSyscallError ENOENT once it is freed)."""
    attr = ctypes.create_string_buffer(_ID_ATTR.pack(map_id, 0, 0))
    return _bpf(BPF_MAP_GET_FD_BY_ID, attr, "map by id")


def possible_cpus(path: Path = Path("/sys/devices/system/cpu/possible")) -> int:
    """How many CPUs a per-CPU map has a slot for (the kernel's possible mask, e.g. ``0-7``)."""
    count = 0
    for part in path.read_text().strip().split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


@dataclass(frozen=True)
class ProgramRuns:
    """What the kernel counted of one program's runs: only while ``kernel.bpf_stats_enabled`` is 1."""

    run_ns: int
    runs: int


def program_runs(fd: int, fdinfo: Path = Path("/proc/self/fdinfo")) -> ProgramRuns:
    """The run time and count the kernel keeps for the program behind ``fd`` (its fdinfo); a
    ValueError when ``fd`` is not a BPF program or the kernel predates these fields (5.1)."""
    fields: dict[str, str] = {}
    for line in (fdinfo / str(fd)).read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    try:
        return ProgramRuns(int(fields["run_time_ns"]), int(fields["run_cnt"]))
    except (KeyError, ValueError):
        raise ValueError(f"descriptor {fd} shows no BPF program run counts") from None


def stats_enabled(path: Path = STATS_SYSCTL) -> bool | None:
    """Whether the kernel counts BPF programs' runs now; None when it cannot be read."""
    try:
        return path.read_text().strip() not in ("", "0")
    except OSError:
        return None
