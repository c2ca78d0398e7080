"""The prebuilt probe (``probes.prebuilt``): what it refuses to load, and that it is bcc's compile
of the program as it is now."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from probes import prebuilt
from probes.bpf import CLIENT_SLOT_BITS, TRACEFS_ROOTS, TRACEPOINT_NAMES, default_client_slot_bits
from probes.source import ProbeUnavailable

STATE_FORMAT = """name: inet_sock_set_state
ID: 2287
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:const void * skaddr;\toffset:8;\tsize:8;\tsigned:0;
\tfield:int oldstate;\toffset:16;\tsize:4;\tsigned:1;
\tfield:__u8 daddr_v6[16];\toffset:56;\tsize:16;\tsigned:0;
"""


def committed() -> dict[str, Any]:
    return json.loads(prebuilt.PREBUILT_FILE.read_text())


def fake_tracefs(root: Path, data: dict[str, Any], moved: tuple[str, str, int] | None = None) -> Path:
    """A tracefs whose format files hold the fields the object reads, where it reads them; with
    ``moved`` (tracepoint, field, offset), that one elsewhere."""
    for tracepoint, fields in data["fields"].items():
        directory = root / "events" / tracepoint.replace(":", "/")
        directory.mkdir(parents=True)
        lines = []
        for name, (offset, size) in fields.items():
            if moved and moved[:2] == (tracepoint, name):
                offset = moved[2]
            lines.append(f"\tfield:__u8 {name}[{size}];\toffset:{offset};\tsize:{size};\tsigned:0;")
        (directory / "format").write_text("format:\n" + "\n".join(lines) + "\n")
    return root


def test_format_files_are_read_by_field_name() -> None:
    assert prebuilt.format_fields(STATE_FORMAT) == {
        "common_type": (0, 2), "common_pid": (4, 4), "skaddr": (8, 8), "oldstate": (16, 4), "daddr_v6": (56, 16)}


def test_the_committed_object_is_of_the_program_as_it_is_now() -> None:
    # A change to disconnect.bpf.c or disconnect.h needs `make probe-object` (as root, with bcc).
    data = committed()
    assert data["source_crc32"] == prebuilt.source_digest()
    loaded = prebuilt.read()
    assert set(loaded.variants) == {0, CLIENT_SLOT_BITS}
    for variant in loaded.variants.values():
        assert set(variant.programs) == set(TRACEPOINT_NAMES)
        assert set(variant.family_from_socket) == set(prebuilt.FAMILY_TRACEPOINTS)
    # The fields it reads are the ones the program names, and every one of them is checked.
    assert {"skaddr", "oldstate", "newstate", "sport", "dport"} <= set(data["fields"]["sock:inet_sock_set_state"])


def test_a_kernel_whose_record_lacks_a_field_or_sizes_it_otherwise_is_refused_by_name(tmp_path: Path) -> None:
    data = committed()
    loaded = prebuilt.read()
    assert prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES, fake_tracefs(tmp_path / "a", data)) is None
    tracefs = fake_tracefs(tmp_path / "b", data)
    (tracefs / "events/tcp/tcp_rcv_space_adjust/format").write_text("format:\n")
    reason = prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES, tracefs)
    assert reason is not None and reason.startswith("this kernel's tcp:tcp_rcv_space_adjust record has daddr missing")
    # The socket's family may be missing from the tcp:* records (the socket is read instead),
    # never from sock:inet_sock_set_state's.
    state = tracefs / "events/sock/inet_sock_set_state/format"
    state.write_text(state.read_text().replace("family[2];\toffset:28;\tsize:2;", "family[4];\toffset:28;\tsize:4;"))
    assert prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES[:1], tracefs) == (
        "this kernel's sock:inet_sock_set_state record has family 4 bytes; the prebuilt probe reads it as 2 bytes "
        "at offset 28")


# The tcp:* records as Linux 5.10 lays them out (Debian 11's kernel, read from its tracefs): no
# family field, so every address field two bytes earlier than the build host's.
RECORD_5_10 = {"skaddr": (8, 8), "sport": (16, 2), "dport": (18, 2), "saddr": (20, 4), "daddr": (24, 4),
               "saddr_v6": (28, 16), "daddr_v6": (44, 16), "sock_cookie": (64, 8)}


def test_a_kernel_that_moved_the_fields_gets_the_programs_loads_moved_with_them(tmp_path: Path) -> None:
    data = committed()
    loaded = prebuilt.read()
    tracefs = fake_tracefs(tmp_path, data)
    for tracepoint in prebuilt.FAMILY_TRACEPOINTS:
        lines = [f"\tfield:__u8 {name}[{size}];\toffset:{offset};\tsize:{size};\tsigned:0;"
                 for name, (offset, size) in RECORD_5_10.items()]
        (tracefs / "events" / tracepoint.replace(":", "/") / "format").write_text("format:\n" + "\n".join(lines) + "\n")
    fit = prebuilt.fitted(loaded, 0, TRACEPOINT_NAMES, tracefs)
    assert fit.programs["sock:inet_sock_set_state"] == loaded.variants[0].programs["sock:inet_sock_set_state"]
    assert len(fit.changes) == 4 and "tcp:tcp_receive_reset: the record has no family field" in fit.changes[0]
    assert "saddr 22->20" in fit.changes[1]
    for tracepoint in prebuilt.FAMILY_TRACEPOINTS:
        before = loaded.variants[0].family_from_socket[tracepoint].instructions
        after = fit.programs[tracepoint].instructions
        changed = [(prebuilt.INSN.unpack_from(before, i), prebuilt.INSN.unpack_from(after, i))
                   for i in range(0, len(before), 8) if before[i:i + 8] != after[i:i + 8]]
        # Only loads (BPF_LDX) changed, only in their offset, each by the two bytes its field moved.
        assert changed and all(old[0] & 7 == 1 and old[:2] == new[:2] and old[3] == new[3] and new[2] - old[2] == -2
                               for old, new in changed)
        # The record-family program reads the family, which 5.10 lacks: it is not the one taken.
        assert loaded.variants[0].programs[tracepoint].instructions != before


@pytest.mark.parametrize("bits", [0, CLIENT_SLOT_BITS])
def test_every_record_load_of_every_program_is_followed(bits: int) -> None:
    # Every field eight bytes further on: each program's loads from the record all move by eight
    # (none goes through a register the analysis cannot place), and nothing else changes.
    data = committed()
    variant = prebuilt.read().variants[bits]
    for tracepoint, program in [*variant.programs.items(), *variant.family_from_socket.items()]:
        built = {name: (offset, size) for name, (offset, size) in data["fields"][tracepoint].items()}
        moved = {name: (offset + 8, size) for name, (offset, size) in built.items()}
        before, after = program.instructions, prebuilt.relocated(program.instructions, built, moved)
        changed = [(prebuilt.INSN.unpack_from(before, i), prebuilt.INSN.unpack_from(after, i))
                   for i in range(0, len(before), 8) if before[i:i + 8] != after[i:i + 8]]
        assert len(changed) >= 5, tracepoint
        assert all(old[0] & 7 == 1 and new[2] - old[2] == 8 for old, new in changed), tracepoint


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return prebuilt.INSN.pack(code, dst | src << 4, off, imm)


MOV64_REG, ADD64_IMM, LDX_H, LDX_W, STX_DW, JEQ_IMM, CALL, EXIT = 0xBF, 0x07, 0x69, 0x61, 0x7B, 0x15, 0x85, 0x95
BUILT = {"a": (20, 2), "b": (24, 8)}
MOVED = {"a": (40, 2), "b": (16, 8)}


def offsets(code: bytes) -> list[int]:
    return [prebuilt.INSN.unpack_from(code, i)[2] for i in range(0, len(code), 8)]


def test_record_loads_are_followed_through_moves_and_constant_adds() -> None:
    program = b"".join([
        insn(MOV64_REG, 6, 1),            # r6 = ctx
        insn(LDX_H, 2, 6, 20),            # a
        insn(MOV64_REG, 3, 6), insn(ADD64_IMM, 3, imm=24),
        insn(LDX_W, 4, 3, 4),             # b, its second word, through ctx + 24
        insn(CALL, imm=5),                # r1-r5 clobbered; r6 kept
        insn(LDX_W, 2, 1, 20),            # r1 is the call's, not the record: left alone
        insn(LDX_H, 2, 6, 20),            # a again, through r6
        insn(EXIT),
    ])
    assert offsets(prebuilt.relocated(program, BUILT, MOVED)) == [0, 40, 0, 0, -4, 0, 20, 40, 0]
    assert prebuilt.relocated(program, BUILT, BUILT) == program


@pytest.mark.parametrize(("program", "message"), [
    ([insn(JEQ_IMM, 0, off=1), insn(MOV64_REG, 6, 1), insn(LDX_H, 2, 6, 20), insn(EXIT)],
     "instruction 2 reads through a register that is not surely the record"),
    ([insn(STX_DW, 10, 1, -8), insn(EXIT)], "instruction 0 stores the record's address"),
    ([insn(LDX_W, 2, 1, 21), insn(EXIT)], "instruction 0 reads record bytes 21-24, within no field it names"),
    ([insn(0x62, 1, 0, 20, 7), insn(EXIT)], "instruction 0 writes into the record"),
    ([insn(0x05, off=5), insn(EXIT)], "instruction 0 jumps outside the program"),
])
def test_record_loads_that_cannot_be_followed_exactly_are_refused(program: list[bytes], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prebuilt.relocated(b"".join(program), BUILT, MOVED)


def test_an_object_of_another_source_or_without_the_variant_is_refused(tmp_path: Path) -> None:
    data = committed()
    loaded = prebuilt.read()
    tracefs = fake_tracefs(tmp_path, data)
    assert prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES, tracefs, source_crc32="0" * 8) == \
        "the prebuilt probe was compiled from another version of disconnect.bpf.c"
    assert prebuilt.unusable_reason(loaded, 9, TRACEPOINT_NAMES, tracefs) == \
        f"the prebuilt probe has no variant with 9 client slot bits (it has 0, {CLIENT_SLOT_BITS})"


def broken(data: dict[str, Any], change: str) -> dict[str, Any]:
    program = data["variants"]["0"]["programs"]["tcp:tcp_receive_reset"]
    if change == "odd instructions":
        program["instructions"] = base64.b64encode(b"\0" * 12).decode()
    elif change == "a reference to no map":
        program["maps"][0][1] = "nowhere"
    elif change == "a reference that is no 64-bit load":
        program["maps"][0][0] += 1
    elif change == "a map missing":
        del data["variants"]["0"]["maps"]["watched_ports"]
    elif change == "a size that is text":
        data["variants"]["0"]["maps"]["events"]["key_size"] = "0"
    elif change == "another format":
        data["format_version"] = 1
    return data


@pytest.mark.parametrize(("change", "message"), [
    ("odd instructions", "12 bytes of instructions"),
    ("a reference to no map", "map reference 'nowhere'"),
    ("a reference that is no 64-bit load", "map reference 'watched_ports' at instruction 6"),
    ("a map missing", "no watched_ports map"),
    ("a size that is text", "'0' is not an integer"),
    ("another format", "format_version is not 2"),
])
def test_a_damaged_object_is_a_clear_error(tmp_path: Path, change: str, message: str) -> None:
    path = tmp_path / "disconnect.prebuilt.json"
    path.write_text(json.dumps(broken(committed(), change)))
    with pytest.raises(ProbeUnavailable, match=r"the prebuilt probe disconnect\.prebuilt\.json is not usable") as caught:
        prebuilt.read(path)
    assert message in caught.value.reason
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ProbeUnavailable, match="not JSON"):
        prebuilt.read(path)
    with pytest.raises(ProbeUnavailable, match="the prebuilt probe cannot be read"):
        prebuilt.read(tmp_path / "missing.json")


def test_patching_puts_the_descriptors_and_the_interval_in_place() -> None:
    program = prebuilt.read().variants[CLIENT_SLOT_BITS].programs["sock:inet_sock_set_state"]
    fds = {name: 40 + i for i, name in enumerate(sorted({name for _, name in program.maps}))}
    code = prebuilt.patched(program, fds, 321)
    for index, name in program.maps:
        assert prebuilt.INSN.unpack_from(code, index * 8)[3] == fds[name]
    for index, delta in program.wakeup:
        assert prebuilt.INSN.unpack_from(code, index * 8)[3] == 321 + delta
    changed = {i for i in range(len(code) // 8) if code[i * 8:i * 8 + 8] != program.instructions[i * 8:i * 8 + 8]}
    assert changed == {index for index, _ in (*program.maps, *program.wakeup)}


@pytest.mark.privileged
def test_a_kernel_that_refuses_the_program_is_named_and_nothing_stays_attached(tmp_path: Path) -> None:
    data = committed()
    bits = default_client_slot_bits()  # the variant this kernel's verifier takes
    for programs in ("programs", "family_from_socket"):  # whichever this kernel's record asks for
        program = data["variants"][str(bits)][programs]["tcp:tcp_receive_reset"]
        program["instructions"] = base64.b64encode(b"\x95" + b"\0" * 7).decode()  # exit without setting r0
        program["maps"], program["wakeup"] = [], []
    path = tmp_path / "disconnect.prebuilt.json"
    path.write_text(json.dumps(data))
    tracefs = next(root for root in TRACEFS_ROOTS if (root / "events").is_dir())
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProbeUnavailable, match=r"the prebuilt probe did not load \(bpf\(program load "
                                               r"tcp_receive_reset\): .*; the verifier: R0 !read_ok"):
        prebuilt.load(ringbuf_bytes=1 << 20, wakeup_every=64, client_slot_bits=bits,
                      tracepoints=TRACEPOINT_NAMES, tracefs=tracefs, path=path)
    assert len(os.listdir("/proc/self/fd")) == before  # maps, programs and perf events closed


@pytest.mark.privileged
@pytest.mark.compiles
def test_bcc_compiles_today_what_was_committed() -> None:
    # `make probe-object` is reproducible here: the committed object is this source's compile.
    from probes.prebuild import build

    built = build()
    data = committed()
    assert built["variants"] == data["variants"]
    assert (built["fields"], built["record_format"]) == (data["fields"], data["record_format"])
