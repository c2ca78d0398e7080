"""The few bpf(2) commands the daemon needs, through ctypes: no bcc, no LLVM.

Updating the port filter, reading the lost-event counter and checking what a descriptor is are
single system calls on the maps the loader handed over. Loading the prebuilt probe
(``probes.prebuilt``) takes three more: creating its maps, loading its programs, and attaching
each to its tracepoint through a perf event (``perf_event_open``, as bcc attaches them). The syscall number differs per architecture;
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
PERF_EVENT_OPEN_NUMBERS = {"x86_64": 298, "amd64": 298, "aarch64": 241, "arm64": 241}

# enum bpf_cmd (include/uapi/linux/bpf.h)
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 3, 4
BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD = 14, 15
BPF_MAP_CREATE, BPF_PROG_LOAD = 0, 5
BPF_PROG_TYPE_TRACEPOINT = 5
BPF_OBJ_NAME_LEN = 16
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
# ... for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries, map_flags, inner_map_fd,
# numa_node, map_name[16]; the rest zero.
_MAP_CREATE_ATTR = struct.Struct("=IIIIIII16s")
# ... for BPF_PROG_LOAD: prog_type, insn_cnt, u64 insns, u64 license, log_level, log_size, u64
# log_buf, kern_version, prog_flags, prog_name[16]; the rest zero.
_PROG_LOAD_ATTR = struct.Struct("=IIQQIIQII16s")
_ATTR_BYTES = 128  # what the kernel reads of the attributes; the tail past what it knows is zero
VERIFIER_LOG_BYTES = 1 << 20
# struct perf_event_attr (PERF_ATTR_SIZE_VER5: 112 bytes): type, size, config, sample_period,
# sample_type, read_format, the flag bits, wakeup_events; the rest zero.
_PERF_ATTR = struct.Struct("=IIQQQQQI")
PERF_ATTR_BYTES = 112
PERF_TYPE_TRACEPOINT, PERF_SAMPLE_RAW, PERF_FLAG_FD_CLOEXEC = 2, 1 << 10, 1 << 3
PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_SET_BPF = 0x2400, 0x40042408


class BpfSyscallError(OSError):
    """A bpf(2) command failed; the message names the command and the kernel's reason."""


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int = 0


def syscall_number(machine: str | None = None, numbers: dict[str, int] = SYSCALL_NUMBERS,
                   call: str = "bpf(2)") -> int:
    arch = (machine or platform.machine()).lower()
    try:
        return numbers[arch]
    except KeyError:
        raise BpfSyscallError(errno.ENOSYS, f"the {call} syscall number of {arch} is not known "
                              f"here (known: {', '.join(sorted(numbers))})") from None


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
    map_type, map_id, key_size, value_size, max_entries, flags = _MAP_INFO.unpack_from(info.raw)
    return MapInfo(map_type, map_id, key_size, value_size, max_entries, flags)


def _object_name(name: str) -> bytes:
    """A map's or program's name as the kernel takes it: at most 15 characters of letters, digits,
    ``_`` and ``.`` (bpftool shows it)."""
    kept = "".join(c if c.isalnum() or c in "_." else "_" for c in name)
    return kept.encode()[:BPF_OBJ_NAME_LEN - 1]


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0,
               name: str = "") -> int:
    """A new map; its descriptor (close-on-exec, as the kernel gives every BPF descriptor)."""
    attr = ctypes.create_string_buffer(_MAP_CREATE_ATTR.pack(
        map_type, key_size, value_size, max_entries, flags, 0, 0, _object_name(name)).ljust(_ATTR_BYTES, b"\0"))
    return _bpf(BPF_MAP_CREATE, attr, f"map create {name}")


def prog_load(prog_type: int, instructions: bytes, license: str, name: str = "") -> int:
    """Load a program; refused, the error ends with the last line of the verifier's log (it is
    asked for only then: a load with a log costs the verifier's text)."""
    insns = ctypes.create_string_buffer(instructions, len(instructions))
    license_buf = ctypes.create_string_buffer(license.encode())

    def load(log: ctypes.Array[ctypes.c_char] | None) -> int:
        attr = ctypes.create_string_buffer(_PROG_LOAD_ATTR.pack(
            prog_type, len(instructions) // 8, ctypes.addressof(insns), ctypes.addressof(license_buf),
            1 if log is not None else 0, len(log) if log is not None else 0,
            ctypes.addressof(log) if log is not None else 0, 0, 0, _object_name(name)).ljust(_ATTR_BYTES, b"\0"))
        return _bpf(BPF_PROG_LOAD, attr, f"program load {name}")

    try:
        return load(None)
    except BpfSyscallError as exc:
        if exc.errno not in (errno.EACCES, errno.EINVAL):  # the verifier's two answers
            raise
        log = ctypes.create_string_buffer(VERIFIER_LOG_BYTES)
        try:
            return load(log)  # the same program again: refused again, now with the log
        except BpfSyscallError as again:
            # The log ends in its statistics ("processed N insns ..."): the reason is the line before.
            lines = [line for line in log.value.decode(errors="replace").splitlines()
                     if line.strip() and not line.startswith(("processed ", "verification time"))]
            last = lines[-1][:200] if lines else "no verifier log"
            raise BpfSyscallError(again.errno, f"{again.strerror}; the verifier: {last}") from None


def perf_event_open_tracepoint(tracepoint_id: int) -> int:
    """A perf event on one tracepoint (all processes, counted on CPU 0: a program attached to it runs
    on every CPU), as bcc opens one to attach a program to it."""
    attr = ctypes.create_string_buffer(_PERF_ATTR.pack(
        PERF_TYPE_TRACEPOINT, PERF_ATTR_BYTES, tracepoint_id, 1, PERF_SAMPLE_RAW, 0, 0, 1).ljust(PERF_ATTR_BYTES, b"\0"))
    number = syscall_number(numbers=PERF_EVENT_OPEN_NUMBERS, call="perf_event_open(2)")
    result = int(_libc.syscall(ctypes.c_long(number), attr, ctypes.c_int(-1), ctypes.c_int(0),
                               ctypes.c_int(-1), ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC)))
    if result < 0:
        code = ctypes.get_errno()
        raise BpfSyscallError(code, f"perf_event_open(tracepoint {tracepoint_id}): {os.strerror(code)}")
    return result


def attach_to_perf_event(perf_fd: int, prog_fd: int) -> None:
    """Run the program on the perf event's tracepoint, from now on."""
    for request, argument, what in ((PERF_EVENT_IOC_SET_BPF, prog_fd, "set program"),
                                    (PERF_EVENT_IOC_ENABLE, 0, "enable")):
        if _libc.ioctl(ctypes.c_int(perf_fd), ctypes.c_ulong(request), ctypes.c_int(argument)) < 0:
            code = ctypes.get_errno()
            raise BpfSyscallError(code, f"perf event ioctl ({what}): {os.strerror(code)}")


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
