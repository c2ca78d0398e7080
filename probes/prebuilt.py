"""The probe as bcc compiled it, loaded with bpf(2) alone: no bcc, no kernel headers, no LLVM.

bcc compiles ``disconnect.bpf.c`` against kernel headers, which GPU hosts seldom have for their
running kernel, and with LLVM, which costs a second of CPU and about 150 MiB at every start. Yet
the program reads nothing of the kernel's own structures: only its tracepoints' records, the
maps, and helpers whose numbers are the kernel's stable interface. So ``probes.prebuild`` (run
where bcc works, ``make probe-object``) keeps what bcc compiled in ``disconnect.prebuilt.json``,
and this module loads that on any kernel that passes three checks:

- the object was built from the program as it is now (its source digest);
- every field of a tracepoint record the program reads is in the running kernel's record, at
  the same size (its tracefs format files say). bcc laid ``args`` out from the build host's
  format files, so where the running kernel puts a field elsewhere, each load of it is moved
  there (``relocated``: a small CO-RE for tracepoint records); the tcp:* records that lack the
  socket's family (5.10's) get the programs built to read it from the socket instead;
- the kernel's verifier accepts each program.

What bcc would otherwise decide at load time is filled in here: each map's descriptor in the
instructions that name it, the ring buffer's size, and the wake-up interval (``WAKEUP_EVERY``, a
constant in the instructions; the build found where by compiling with two values and checked
the patch against a third). The clients table comes in the two forms the program has (with and
without BPF compare-and-swap), one a variant. The result is the ``LoadedProgram`` the child
loader hands over: the rest of the daemon cannot tell them apart.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import logging
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from probes import bpfsys
from probes.handoff import RECORD_FIELDS, LoadedProgram, close_all
from probes.loader import MAP_NAMES
from probes.source import ProbeUnavailable

log = logging.getLogger(__name__)

PROGRAM_DIR = Path(__file__).resolve().parent
PREBUILT_FILE = PROGRAM_DIR / "disconnect.prebuilt.json"
SOURCE_FILES = ("disconnect.bpf.c", "disconnect.h")
FORMAT_VERSION = 2
# The tcp:* records (tcp_event_sk) gained the socket's family after 5.10; where they lack it the
# programs built with FAMILY_FROM_SOCKET (disconnect.bpf.c) read it from the socket.
FAMILY_TRACEPOINTS = ("tcp:tcp_receive_reset", "tcp:tcp_rcv_space_adjust")
FIX = "run `make probe-object` as root where bcc works, or let the daemon compile it (bcc and kernel headers)"
INSN = struct.Struct("=BBhi")  # struct bpf_insn: code, dst_reg:4 src_reg:4, off, imm
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
BPF_PSEUDO_MAP_FD = 1
# Until 5.11 the kernel counts BPF maps and programs against RLIMIT_MEMLOCK (then the cgroup).
MEMLOCK_CHARGED_BEFORE = (5, 11)
_FIELD = re.compile(r"field:(?P<decl>[^;]*);\s*offset:(?P<offset>\d+);\s*size:(?P<size>\d+);")


def source_digest(directory: Path = PROGRAM_DIR) -> str:
    """CRC-32 of the program's source files, in order: what the object was compiled from. A check
    against a stale object, not against tampering (the object is the package's own file); hashlib
    would map OpenSSL into the daemon, 3.5 MiB of RSS."""
    crc = 0
    for name in SOURCE_FILES:
        crc = binascii.crc32((directory / name).read_bytes(), crc)
    return f"{crc:08x}"


def record_fields(tracefs: Path, tracepoint: str) -> dict[str, tuple[int, int]]:
    """The running kernel's record of ``tracepoint`` (category:name) as its format file lays it
    out; OSError where it cannot be read."""
    return format_fields((tracefs / "events" / tracepoint.replace(":", "/") / "format").read_text())


def format_fields(text: str) -> dict[str, tuple[int, int]]:
    """A tracefs format file's fields: name -> (offset, size)."""
    fields = {}
    for found in _FIELD.finditer(text):
        name = re.search(r"(\w+)\s*(\[[^\]]*\])?\s*$", found["decl"])
        if name:
            fields[name[1]] = (int(found["offset"]), int(found["size"]))
    return fields


@dataclass(frozen=True)
class MapSpec:
    type: int
    key_size: int
    value_size: int
    max_entries: int  # the ring buffer's ("events") is the configuration's, set at load
    flags: int


@dataclass(frozen=True)
class ProgramSpec:
    instructions: bytes
    maps: tuple[tuple[int, str], ...]  # (instruction index, map name) of each map reference
    wakeup: tuple[tuple[int, int], ...]  # (instruction index, imm - WAKEUP_EVERY) of each use


@dataclass(frozen=True)
class Variant:
    maps: dict[str, MapSpec]
    programs: dict[str, ProgramSpec]  # by tracepoint
    family_from_socket: dict[str, ProgramSpec]  # FAMILY_TRACEPOINTS' programs for records without it


@dataclass(frozen=True)
class Prebuilt:
    source_crc32: str
    license: str
    record_format: str
    fields: dict[str, dict[str, tuple[int, int]]]  # tracepoint -> the fields the program names
    variants: dict[int, Variant]  # by client slot bits


def read(path: Path | None = None) -> Prebuilt:
    """The object at ``path`` (PREBUILT_FILE), checked whole; ProbeUnavailable naming what is wrong."""
    path = path or PREBUILT_FILE
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ProbeUnavailable(f"the prebuilt probe cannot be read ({exc.strerror or exc})", FIX) from None
    except ValueError as exc:
        raise _broken(path, f"not JSON ({exc})") from None
    try:
        return _parsed(data)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise _broken(path, f"{type(exc).__name__}: {exc}") from None


def _broken(path: Path, what: str) -> ProbeUnavailable:
    return ProbeUnavailable(f"the prebuilt probe {path.name} is not usable ({what})", FIX)


def _parsed(data: Any) -> Prebuilt:
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format_version is not {FORMAT_VERSION}")
    variants = {int(bits): _variant(_dict(variant)) for bits, variant in _dict(data["variants"]).items()}
    fields = {tracepoint: {name: (_int(at[0]), _int(at[1])) for name, at in _dict(named).items()}
              for tracepoint, named in _dict(data["fields"]).items()}
    return Prebuilt(_str(data["source_crc32"]), _str(data["license"]), _str(data["record_format"]),
                    fields, variants)


def _variant(data: dict[str, Any]) -> Variant:
    maps = {name: MapSpec(*(_int(spec[key]) for key in ("type", "key_size", "value_size", "max_entries", "flags")))
            for name, spec in _dict(data["maps"]).items()}
    missing = [name for name in MAP_NAMES if name not in maps]
    if missing:
        raise ValueError(f"no {', '.join(missing)} map")
    programs = {tracepoint: _program(tracepoint, spec, maps) for tracepoint, spec in _dict(data["programs"]).items()}
    family_from_socket = {tracepoint: _program(tracepoint, spec, maps)
                          for tracepoint, spec in _dict(data["family_from_socket"]).items()}
    return Variant(maps, programs, family_from_socket)


def _program(tracepoint: str, spec: dict[str, Any], maps: dict[str, MapSpec]) -> ProgramSpec:
    instructions = base64.b64decode(_str(spec["instructions"]), validate=True)
    if not instructions or len(instructions) % INSN.size:
        raise ValueError(f"{tracepoint}: {len(instructions)} bytes of instructions")
    references = tuple((_int(index), _str(name)) for index, name in spec["maps"])
    wakeup = tuple((_int(index), _int(delta)) for index, delta in spec["wakeup"])
    count = len(instructions) // INSN.size
    for index, name in references:
        if name not in maps or not 0 <= index < count - 1 or instructions[index * INSN.size] != LD_IMM64:
            raise ValueError(f"{tracepoint}: map reference {name!r} at instruction {index}")
    if any(not 0 <= index < count for index, _ in wakeup):
        raise ValueError(f"{tracepoint}: wake-up constant at {wakeup}")
    return ProgramSpec(instructions, references, wakeup)


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _dict(value: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise TypeError(f"{str(value)[:60]} is not a non-empty object")
    return value


def unusable_reason(prebuilt: Prebuilt, client_slot_bits: int, tracepoints: Iterable[str],
                    tracefs: Path, source_crc32: str | None = None) -> str | None:
    """Why ``prebuilt`` cannot run here (one line), or None: its source, its variant, the running
    kernel's tracepoint records (from ``tracefs``)."""
    try:
        fitted(prebuilt, client_slot_bits, tracepoints, tracefs, source_crc32)
    except ProbeUnavailable as exc:
        return exc.reason
    return None


@dataclass(frozen=True)
class Fitted:
    """The programs to load on this kernel, by tracepoint, and what was changed to fit it."""

    programs: dict[str, ProgramSpec]
    changes: tuple[str, ...]  # one line each, for the log: fields moved, the family read from the socket


def fitted(prebuilt: Prebuilt, client_slot_bits: int, tracepoints: Iterable[str], tracefs: Path,
           source_crc32: str | None = None) -> Fitted:
    """The variant's programs with their record loads where this kernel's records put the fields
    (``relocated``); ProbeUnavailable naming what does not fit."""
    if prebuilt.source_crc32 != (source_crc32 or source_digest()):
        raise ProbeUnavailable("the prebuilt probe was compiled from another version of disconnect.bpf.c", FIX)
    if client_slot_bits not in prebuilt.variants:
        raise ProbeUnavailable(f"the prebuilt probe has no variant with {client_slot_bits} client slot bits "
                               f"(it has {', '.join(map(str, sorted(prebuilt.variants)))})", FIX)
    variant = prebuilt.variants[client_slot_bits]
    programs: dict[str, ProgramSpec] = {}
    changes: list[str] = []
    for tracepoint in tracepoints:
        if tracepoint not in variant.programs:
            raise ProbeUnavailable(f"the prebuilt probe has no program for {tracepoint}", FIX)
        try:
            running = record_fields(tracefs, tracepoint)
        except OSError as exc:
            raise ProbeUnavailable(f"{exc.filename} cannot be read ({exc.strerror or exc})", FIX) from None
        built = prebuilt.fields.get(tracepoint, {})
        program = variant.programs[tracepoint]
        if "family" in built and "family" not in running and tracepoint in variant.family_from_socket:
            program = variant.family_from_socket[tracepoint]
            built = {name: at for name, at in built.items() if name != "family"}
            changes.append(f"{tracepoint}: the record has no family field; the socket's is read instead")
        for name, (offset, size) in built.items():
            now = running.get(name)
            if now is None or now[1] != size:
                where = f"{now[1]} bytes" if now else "missing"
                raise ProbeUnavailable(f"this kernel's {tracepoint} record has {name} {where}; the prebuilt "
                                       f"probe reads it as {size} bytes at offset {offset}", FIX)
        moved = {name: (at[0], running[name][0]) for name, at in built.items() if running[name][0] != at[0]}
        if moved:
            try:
                program = replace(program, instructions=relocated(program.instructions, built, running))
            except ValueError as exc:
                raise ProbeUnavailable(f"the prebuilt probe's {tracepoint} program cannot be moved to this "
                                       f"kernel's record ({exc})", FIX) from None
            changes.append(f"{tracepoint}: fields moved in the record, the program's loads with them: "
                           + ", ".join(f"{name} {old}->{new}" for name, (old, new) in sorted(moved.items())))
        programs[tracepoint] = program
    return Fitted(programs, tuple(changes))


# -- moving record loads (a small CO-RE for tracepoint records) ---------------------------------
_CLASS_LD, _CLASS_LDX, _CLASS_ST, _CLASS_STX, _CLASS_ALU, _CLASS_JMP, _CLASS_JMP32, _CLASS_ALU64 = range(8)
_SIZES = {0x00: 4, 0x08: 2, 0x10: 1, 0x18: 8}  # BPF_W, BPF_H, BPF_B, BPF_DW
_MODE_ATOMIC = 0xC0
_CALL, _EXIT, _JA = 0x80, 0x90, 0x00
_ADD, _SUB, _MOV = 0x00, 0x10, 0xB0
_BPF_X = 0x08  # the source operand is a register
_CMPXCHG, _FETCH = 0xF1, 0x01
_UNSURE = -1 << 40  # a register that may or may not hold the context, or holds it changed: no base


def relocated(instructions: bytes, built: dict[str, tuple[int, int]], running: dict[str, tuple[int, int]]) -> bytes:
    """``instructions`` with each load from the tracepoint record (the context, r1 at entry) moved
    from where ``built`` puts its field to where ``running`` does. Which registers hold the
    context, and at what constant offset, is followed along every path (moves, constant adds,
    calls clobbering r1-r5); a ValueError where that cannot be told exactly: a load through a
    register that holds the context on one path and not another, the context stored anywhere
    (it would come back unfollowed), a write into the record, a load that is not within one of
    ``built``'s fields, or an offset the instruction cannot hold."""
    count = len(instructions) // INSN.size
    decoded = [INSN.unpack_from(instructions, index * INSN.size) for index in range(count)]
    states: dict[int, dict[int, int]] = {0: {1: 0}}  # instruction -> register -> context offset
    base_at: dict[int, int] = {}  # load instruction -> the context offset of its base register
    work = [0]
    while work:
        index = work.pop()
        regs = dict(states[index])
        code, packed, offset, imm = decoded[index]
        dst, src = packed & 0x0F, packed >> 4
        klass, step = code & 0x07, 1
        successors: list[int] = []
        if klass == _CLASS_LDX:
            if src in regs:
                if regs[src] == _UNSURE or base_at.get(index, regs[src]) != regs[src]:
                    raise ValueError(f"instruction {index} reads through a register that is not surely the record")
                base_at[index] = regs[src]
            regs.pop(dst, None)
        elif klass == _CLASS_LD:
            if code != LD_IMM64:
                raise ValueError(f"instruction {index}: a packet load ({code:#x})")
            regs.pop(dst, None)
            step = 2
        elif klass in (_CLASS_ST, _CLASS_STX):
            if dst in regs:
                raise ValueError(f"instruction {index} writes into the record")
            if klass == _CLASS_STX and src in regs:
                raise ValueError(f"instruction {index} stores the record's address")
            if klass == _CLASS_STX and code & 0xE0 == _MODE_ATOMIC:
                if imm == _CMPXCHG:
                    regs.pop(0, None)
                elif imm & _FETCH:
                    regs.pop(src, None)
        elif klass in (_CLASS_ALU, _CLASS_ALU64):
            op = code & 0xF0
            if klass == _CLASS_ALU64 and op == _MOV:
                if code & _BPF_X and src in regs:
                    regs[dst] = regs[src]
                else:
                    regs.pop(dst, None)
            elif klass == _CLASS_ALU64 and op in (_ADD, _SUB) and not code & _BPF_X and dst in regs:
                regs[dst] = _UNSURE if regs[dst] == _UNSURE else regs[dst] + (imm if op == _ADD else -imm)
            elif dst in regs or (code & _BPF_X and src in regs):
                regs[dst] = _UNSURE
        elif klass in (_CLASS_JMP, _CLASS_JMP32):
            op = code & 0xF0
            if op == _EXIT and klass == _CLASS_JMP:
                continue
            if op == _CALL and klass == _CLASS_JMP:
                for reg in range(6):
                    regs.pop(reg, None)
            elif op == _JA:
                successors = [index + 1 + offset]
                step = 0
            else:
                successors = [index + 1 + offset]
        else:
            raise ValueError(f"instruction {index}: class {klass}")
        if step:
            successors.append(index + step)
        for target in successors:
            if not 0 <= target < count:
                raise ValueError(f"instruction {index} jumps outside the program")
            merged = _merge(states.get(target), regs)
            if merged != states.get(target):
                states[target] = merged
                work.append(target)
    fields = sorted(built.items(), key=lambda item: item[1][0])
    code_out = bytearray(instructions)
    for index, base in sorted(base_at.items()):
        code, packed, offset, imm = decoded[index]
        size = _SIZES[code & 0x18]
        at = base + offset
        field = next((name for name, (start, length) in fields if start <= at and at + size <= start + length), None)
        if field is None:
            raise ValueError(f"instruction {index} reads record bytes {at}-{at + size - 1}, within no field it names")
        new = running[field][0] + (at - built[field][0]) - base
        if not -(1 << 15) <= new < 1 << 15:
            raise ValueError(f"instruction {index}: offset {new} does not fit")
        INSN.pack_into(code_out, index * INSN.size, code, packed, new, imm)
    return bytes(code_out)


def _merge(known: dict[int, int] | None, incoming: dict[int, int]) -> dict[int, int]:
    """Two paths' context registers: where they differ (or one lacks it), the register is unsure."""
    if known is None:
        return incoming
    return {reg: known[reg] if known.get(reg) == incoming.get(reg) else _UNSURE for reg in known.keys() | incoming.keys()}


def patched(program: ProgramSpec, map_fds: dict[str, int], wakeup_every: int) -> bytes:
    """The instructions with this process's map descriptors and the wake-up interval in place."""
    code = bytearray(program.instructions)
    for index, name in program.maps:
        at = index * INSN.size
        opcode, regs, offset, _ = INSN.unpack_from(code, at)
        INSN.pack_into(code, at, opcode, regs, offset, map_fds[name])
    for index, delta in program.wakeup:
        at = index * INSN.size
        opcode, regs, offset, _ = INSN.unpack_from(code, at)
        INSN.pack_into(code, at, opcode, regs, offset, wakeup_every + delta)
    return bytes(code)


def load(*, ringbuf_bytes: int, wakeup_every: int, client_slot_bits: int, tracepoints: tuple[str, ...],
         tracefs: Path, path: Path | None = None) -> LoadedProgram:
    """Create the maps, load and attach the programs of ``path``; the caller owns the result.
    ProbeUnavailable, with nothing left attached, where any step fails."""
    prebuilt = read(path)
    fit = fitted(prebuilt, client_slot_bits, tracepoints, tracefs)
    for change in fit.changes:
        log.info("prebuilt probe: %s", change)
    variant = prebuilt.variants[client_slot_bits]
    memlock_counts = _raise_memlock(os.uname().release)
    fds: dict[str, int] = {}
    internal: list[int] = []  # maps only the programs use: they hold them once loaded
    try:
        for name, spec in variant.maps.items():
            entries = ringbuf_bytes if name == "events" else spec.max_entries
            fd = bpfsys.map_create(spec.type, spec.key_size, spec.value_size, entries, spec.flags, name)
            if name in MAP_NAMES:
                fds[f"map:{name}"] = fd
            else:
                internal.append(fd)
        map_fds = {name.removeprefix("map:"): fd for name, fd in fds.items()}
        map_fds.update(zip([n for n in variant.maps if n not in MAP_NAMES], internal, strict=True))
        for tracepoint in tracepoints:
            category, event = tracepoint.split(":")
            fds[f"program:{tracepoint}"] = bpfsys.prog_load(
                bpfsys.BPF_PROG_TYPE_TRACEPOINT, patched(fit.programs[tracepoint], map_fds, wakeup_every),
                prebuilt.license, event)
            tracepoint_id = int((tracefs / "events" / category / event / "id").read_text())
            fds[f"tracepoint:{tracepoint}"] = bpfsys.perf_event_open_tracepoint(tracepoint_id)
            bpfsys.attach_to_perf_event(fds[f"tracepoint:{tracepoint}"], fds[f"program:{tracepoint}"])
        record = struct.Struct(prebuilt.record_format)
        if len(record.unpack(bytes(record.size))) != RECORD_FIELDS:
            raise ValueError(f"record_format {prebuilt.record_format!r} is not the {RECORD_FIELDS} fields of struct event")
        return LoadedProgram(fds, record, ringbuf_bytes, client_slot_bits, fit.changes)
    except BaseException as exc:  # nothing stays attached: closing the descriptors detaches
        close_all(fds)
        if isinstance(exc, OSError) and exc.errno == errno.EPERM and memlock_counts:
            raise ProbeUnavailable(f"the prebuilt probe did not load ({_first_line(exc)}): this kernel counts "
                                   "BPF memory against the locked-memory limit",
                                   "raise it (`ulimit -l unlimited`; the unit sets LimitMEMLOCK=infinity)") from None
        if isinstance(exc, (OSError, ValueError, struct.error)):
            raise ProbeUnavailable(f"the prebuilt probe did not load ({_first_line(exc)})", FIX) from None
        raise
    finally:
        for fd in internal:
            os.close(fd)


def _raise_memlock(release: str) -> bool:
    """Whether this kernel counts BPF memory against RLIMIT_MEMLOCK; if so the limit is raised as
    far as this process may (bcc does the same; the unit's LimitMEMLOCK=infinity does it before)."""
    numbers = re.match(r"(\d+)\.(\d+)", release)
    if numbers is None or (int(numbers[1]), int(numbers[2])) >= MEMLOCK_CHARGED_BEFORE:
        return False
    import resource

    for limit in (resource.RLIM_INFINITY, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]):
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
            break
        except (ValueError, OSError):  # no CAP_SYS_RESOURCE, or a filter refusing setrlimit
            continue
    return True


def _first_line(exc: BaseException) -> str:
    text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
