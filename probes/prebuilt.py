"""The probe as bcc compiled it, loaded with bpf(2) alone: no bcc, no kernel headers, no LLVM.

bcc compiles ``disconnect.bpf.c`` against kernel headers, which GPU hosts seldom have for their
running kernel, and with LLVM, which costs a second of CPU and about 150 MiB at every start. Yet
the program reads nothing of the kernel's own structures: only its tracepoints' records, the
maps, and helpers whose numbers are the kernel's stable interface. So ``probes.prebuild`` (run
where bcc works, ``make probe-object``) keeps what bcc compiled in ``disconnect.prebuilt.json``,
and this module loads that on any kernel that passes three checks:

- the object was built from the program as it is now (its source digest);
- every field of a tracepoint record the program names lies where it lay when it was built
  (bcc lays out ``args`` from the build host's tracefs format files; a kernel that moved a field
  would have the program read another one): the running kernel's format files say;
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
import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes import bpfsys
from probes.handoff import RECORD_FIELDS, LoadedProgram, close_all
from probes.loader import MAP_NAMES
from probes.source import ProbeUnavailable

PROGRAM_DIR = Path(__file__).resolve().parent
PREBUILT_FILE = PROGRAM_DIR / "disconnect.prebuilt.json"
SOURCE_FILES = ("disconnect.bpf.c", "disconnect.h")
FORMAT_VERSION = 1
FIX = "run `make probe-object` as root where bcc works, or let the daemon compile it (bcc and kernel headers)"
INSN = struct.Struct("=BBhi")  # struct bpf_insn: code, dst_reg:4 src_reg:4, off, imm
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
BPF_PSEUDO_MAP_FD = 1
_FIELD = re.compile(r"field:(?P<decl>[^;]*);\s*offset:(?P<offset>\d+);\s*size:(?P<size>\d+);")


def source_digest(directory: Path = PROGRAM_DIR) -> str:
    """CRC-32 of the program's source files, in order: what the object was compiled from. A check
    against a stale object, not against tampering (the object is the package's own file); hashlib
    would map OpenSSL into the daemon, 3.5 MiB of RSS."""
    crc = 0
    for name in SOURCE_FILES:
        crc = binascii.crc32((directory / name).read_bytes(), crc)
    return f"{crc:08x}"


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
    programs = {}
    for tracepoint, spec in _dict(data["programs"]).items():
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
        programs[tracepoint] = ProgramSpec(instructions, references, wakeup)
    return Variant(maps, programs)


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
    """Why ``prebuilt`` cannot run here as it is (one line), or None: its source, its variant, the
    running kernel's tracepoint records (from ``tracefs``)."""
    if prebuilt.source_crc32 != (source_crc32 or source_digest()):
        return "the prebuilt probe was compiled from another version of disconnect.bpf.c"
    if client_slot_bits not in prebuilt.variants:
        return (f"the prebuilt probe has no variant with {client_slot_bits} client slot bits "
                f"(it has {', '.join(map(str, sorted(prebuilt.variants)))})")
    for tracepoint in tracepoints:
        if tracepoint not in prebuilt.variants[client_slot_bits].programs:
            return f"the prebuilt probe has no program for {tracepoint}"
        path = tracefs / "events" / tracepoint.replace(":", "/") / "format"
        try:
            running = format_fields(path.read_text())
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror or exc})"
        for name, (offset, size) in prebuilt.fields.get(tracepoint, {}).items():
            if running.get(name) != (offset, size):
                now = running.get(name)
                where = f"at offset {now[0]}, {now[1]} bytes" if now else "missing"
                return (f"this kernel's {tracepoint} record has {name} {where}; the prebuilt probe "
                        f"reads it at offset {offset}, {size} bytes")
    return None


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
    problem = unusable_reason(prebuilt, client_slot_bits, tracepoints, tracefs)
    if problem:
        raise ProbeUnavailable(problem, FIX)
    variant = prebuilt.variants[client_slot_bits]
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
                bpfsys.BPF_PROG_TYPE_TRACEPOINT, patched(variant.programs[tracepoint], map_fds, wakeup_every),
                prebuilt.license, event)
            tracepoint_id = int((tracefs / "events" / category / event / "id").read_text())
            fds[f"tracepoint:{tracepoint}"] = bpfsys.perf_event_open_tracepoint(tracepoint_id)
            bpfsys.attach_to_perf_event(fds[f"tracepoint:{tracepoint}"], fds[f"program:{tracepoint}"])
        record = struct.Struct(prebuilt.record_format)
        if len(record.unpack(bytes(record.size))) != RECORD_FIELDS:
            raise ValueError(f"record_format {prebuilt.record_format!r} is not the {RECORD_FIELDS} fields of struct event")
        return LoadedProgram(fds, record, ringbuf_bytes, client_slot_bits)
    except BaseException as exc:  # nothing stays attached: closing the descriptors detaches
        close_all(fds)
        if isinstance(exc, (OSError, ValueError, struct.error)):
            raise ProbeUnavailable(f"the prebuilt probe did not load ({_first_line(exc)})", FIX) from None
        raise
    finally:
        for fd in internal:
            os.close(fd)


def _first_line(exc: BaseException) -> str:
    text = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
