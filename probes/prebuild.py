"""Compile the probe with bcc and keep what it compiled for ``probes.prebuilt``: ``make probe-object``.

Runs as root where bcc loads the probe (it compiles, loads and attaches each variant for a moment:
bcc lays the maps out as it creates them). For each variant of the clients table (with and without
BPF compare-and-swap) it compiles the program twice, with two wake-up intervals, and keeps:

- each tracepoint program's instructions, where they name a map (``BPF_PSEUDO_MAP_FD``: the
  descriptor bcc had, replaced by the map's name) and where the wake-up interval is (the only
  instructions the two compiles differ in; compiled a third time with another interval, the patch
  must give exactly what bcc gives);
- each map's type, sizes, entries and flags, as the kernel reports them;
- the tracepoint record fields the program names (``args->field``), at the offsets this host's
  tracefs gave bcc: the loader moves the program's loads where a kernel's records put them
  elsewhere, and refuses one that lacks a field or sizes it otherwise;
- the tcp:* programs compiled again with FAMILY_FROM_SOCKET, for kernels whose tcp:* records
  lack the socket's family (the loader takes those there).
- the event record's layout, and the source's digest.

Anything else in the instructions that a later kernel would have to resolve (another pseudo
source, a call to a BPF function) stops the build: the loader does not do it.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import re
import sys
from pathlib import Path
from typing import Any

from probes import bpfsys
from probes.bpf import (
    CLIENT_SLOT_BITS,
    PROGRAM_CFLAGS,
    PROGRAM_FILE,
    TRACEFS_ROOTS,
    TRACEPOINT_NAMES,
    program_text,
    tcp_records_lack_family,
)
from probes.loader import tracepoint_function
from probes.prebuilt import (
    BPF_PSEUDO_MAP_FD,
    FAMILY_TRACEPOINTS,
    FORMAT_VERSION,
    INSN,
    LD_IMM64,
    PREBUILT_FILE,
    record_fields,
    source_digest,
)

SENTINELS = (1000, 1001)  # two wake-up intervals whose compiles differ in that constant alone
CHECK_WAKEUP = 7  # a third: the patch must give what bcc compiles
BPF_CALL, BPF_JMP = 0x80, 0x05
_MAP_DECLARATION = re.compile(r"BPF_(?:ARRAY|HASH|PERCPU_ARRAY|RINGBUF_OUTPUT)\((\w+)|BPF_F_TABLE\([^,]+,[^,]+,[^,]+,\s*(\w+)")


Compiled = tuple[dict[str, bytes], dict[str, dict[str, int]], dict[int, str], str]


def compile_variant(bits: int, wakeup_every: int, family_from_socket: bool = False) -> Compiled:
    """Compile and load once: instructions by tracepoint, the maps as the kernel has them, which
    descriptor is which map, and the event record's layout."""
    from bcc import BPF

    from probes.decode import struct_format

    text = program_text(wakeup_every=wakeup_every, client_slot_bits=bits, family_from_socket=family_from_socket)
    bpf = BPF(text=text.encode(), cflags=PROGRAM_CFLAGS)
    source = PROGRAM_FILE.read_text()
    names = {first or second for first, second in _MAP_DECLARATION.findall(source)}
    by_fd: dict[int, str] = {}
    maps: dict[str, dict[str, int]] = {}
    for name in sorted(names):
        fd = int(bpf[name.encode()].map_fd)
        info = bpfsys.map_info(fd)
        by_fd[fd] = name
        maps[name] = {"type": info.type, "key_size": info.key_size, "value_size": info.value_size,
                      "max_entries": info.max_entries, "flags": info.flags}
    programs = {name: bytes(bpf.dump_func(tracepoint_function(name.encode()))) for name in TRACEPOINT_NAMES}
    events = bpf[b"events"]
    record = struct_format(events.event(ctypes.create_string_buffer(4096)).__class__).format
    bpf.cleanup()
    return programs, maps, by_fd, record


def relocations(instructions: bytes, by_fd: dict[int, str]) -> list[list[Any]]:
    """(index, map name) of each instruction that loads a map's descriptor; a ValueError for anything
    else a loader would have to resolve."""
    found = []
    index, count = 0, len(instructions) // INSN.size
    while index < count:
        code, regs, _offset, imm = INSN.unpack_from(instructions, index * INSN.size)
        source = regs >> 4
        if code == LD_IMM64:
            if source == BPF_PSEUDO_MAP_FD:
                if imm not in by_fd:
                    raise ValueError(f"instruction {index} names descriptor {imm}, no map of the program")
                found.append([index, by_fd[imm]])
            elif source:
                raise ValueError(f"instruction {index} loads a 64-bit value of pseudo source {source}")
            index += 2
            continue
        if code == BPF_JMP | BPF_CALL and source:
            raise ValueError(f"instruction {index} calls a BPF function (source {source}), not a helper")
        index += 1
    return found


def wakeup_sites(first: bytes, second: bytes) -> list[list[int]]:
    """(index, imm - interval) of the instructions the two sentinel compiles differ in: those alone,
    in their immediate alone, by exactly the sentinels' difference."""
    if len(first) != len(second):
        raise ValueError("the two compiles differ in length: the interval changed more than a constant")
    sites = []
    for index in range(len(first) // INSN.size):
        a = INSN.unpack_from(first, index * INSN.size)
        b = INSN.unpack_from(second, index * INSN.size)
        if a == b:
            continue
        if a[:3] != b[:3] or b[3] - a[3] != SENTINELS[1] - SENTINELS[0]:
            raise ValueError(f"instruction {index} differs as {a} and {b}: not the interval's constant")
        sites.append([index, a[3] - SENTINELS[0]])
    return sites


def normalized(instructions: bytes, sites: list[list[Any]]) -> bytes:
    """The instructions with the map references' descriptors zeroed: two compiles' maps differ."""
    code = bytearray(instructions)
    for index, _name in sites:
        opcode, regs, offset, _ = INSN.unpack_from(code, index * INSN.size)
        INSN.pack_into(code, index * INSN.size, opcode, regs, offset, 0)
    return bytes(code)


def named_fields(source: str) -> set[str]:
    return set(re.findall(r"\bargs\)?->(\w+)", source))


def build() -> dict[str, Any]:
    tracefs = next(root for root in TRACEFS_ROOTS if (root / "events").is_dir())
    if tcp_records_lack_family((tracefs,)):
        raise ValueError("this kernel's tcp:* records lack the family field: build where they have it")
    named = named_fields(PROGRAM_FILE.read_text())
    fields = {}
    for tracepoint in TRACEPOINT_NAMES:
        running = record_fields(tracefs, tracepoint)
        fields[tracepoint] = {name: list(at) for name, at in sorted(running.items()) if name in named}
    variants: dict[str, Any] = {}
    record = ""
    for bits in (0, CLIENT_SLOT_BITS):
        programs, maps, record = programs_of([compile_variant(bits, wakeup) for wakeup in (*SENTINELS, CHECK_WAKEUP)])
        others, other_maps, other_record = programs_of(
            [compile_variant(bits, wakeup, family_from_socket=True) for wakeup in (*SENTINELS, CHECK_WAKEUP)])
        if (other_maps, other_record) != (maps, record):
            raise ValueError("FAMILY_FROM_SOCKET changed the maps or the event record")
        for tracepoint in set(TRACEPOINT_NAMES) - set(FAMILY_TRACEPOINTS):
            if others[tracepoint] != programs[tracepoint]:
                raise ValueError(f"FAMILY_FROM_SOCKET changed {tracepoint}'s program")
        variants[str(bits)] = {"maps": maps, "programs": programs,
                               "family_from_socket": {tp: others[tp] for tp in FAMILY_TRACEPOINTS}}
    return {"format_version": FORMAT_VERSION, "source_crc32": source_digest(), "license": "GPL",
            "record_format": record, "fields": fields, "variants": variants}


def programs_of(compiles: list[Compiled]) -> tuple[dict[str, Any], dict[str, dict[str, int]], str]:
    """From the three compiles (SENTINELS, then CHECK_WAKEUP): each program's normalized
    instructions, map references and wake-up sites; the maps; the event record."""
    from probes.prebuilt import ProgramSpec, patched

    (first, maps, by_fd, record), (second, _, by_fd_2, _), (check, _, by_fd_3, _) = compiles
    programs = {}
    for tracepoint, instructions in first.items():
        references = relocations(instructions, by_fd)
        references_2, references_3 = relocations(second[tracepoint], by_fd_2), relocations(check[tracepoint], by_fd_3)
        if references != references_2 or references != references_3:
            raise ValueError(f"{tracepoint}: the compiles name their maps at other instructions")
        sites = wakeup_sites(normalized(instructions, references), normalized(second[tracepoint], references))
        spec = ProgramSpec(instructions, tuple((i, n) for i, n in references), tuple((i, d) for i, d in sites))
        zero = {name: 0 for name in maps}
        if patched(spec, zero, CHECK_WAKEUP) != normalized(check[tracepoint], references):
            raise ValueError(f"{tracepoint}: patching the interval does not give what bcc compiles")
        programs[tracepoint] = {"instructions": base64.b64encode(normalized(instructions, references)).decode(),
                                "maps": references, "wakeup": sites}
    return programs, maps, record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PREBUILT_FILE)
    args = parser.parse_args(argv)
    try:
        built = build()
    except Exception as exc:  # bcc raises bare Exception for compile and load failures
        print(f"prebuild: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(built, indent=1, sort_keys=True) + "\n")
    sizes = {bits: {tp: len(base64.b64decode(p["instructions"])) // 8 for tp, p in v["programs"].items()}
             for bits, v in built["variants"].items()}
    print(f"wrote {args.out}: instructions by variant and tracepoint {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
