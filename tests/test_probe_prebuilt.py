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
from probes.bpf import CLIENT_SLOT_BITS, TRACEFS_ROOTS, TRACEPOINT_NAMES
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
    # The fields it reads are the ones the program names, and every one of them is checked.
    assert {"skaddr", "oldstate", "newstate", "sport", "dport"} <= set(data["fields"]["sock:inet_sock_set_state"])


def test_a_kernel_whose_record_moved_a_field_is_refused_by_name(tmp_path: Path) -> None:
    data = committed()
    loaded = prebuilt.read()
    assert prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES, fake_tracefs(tmp_path / "a", data)) is None
    tracefs = fake_tracefs(tmp_path / "b", data, moved=("tcp:tcp_receive_reset", "sport", 40))
    assert prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES, tracefs) == (
        "this kernel's tcp:tcp_receive_reset record has sport at offset 40, 2 bytes; the prebuilt probe "
        "reads it at offset 16, 2 bytes")
    (tracefs / "events/tcp/tcp_rcv_space_adjust/format").write_text("format:\n")
    reason = prebuilt.unusable_reason(loaded, CLIENT_SLOT_BITS, TRACEPOINT_NAMES[2:], tracefs)
    assert reason is not None and "tcp:tcp_rcv_space_adjust record has daddr missing" in reason


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
        data["format_version"] = 2
    return data


@pytest.mark.parametrize(("change", "message"), [
    ("odd instructions", "12 bytes of instructions"),
    ("a reference to no map", "map reference 'nowhere'"),
    ("a reference that is no 64-bit load", "map reference 'watched_ports' at instruction 6"),
    ("a map missing", "no watched_ports map"),
    ("a size that is text", "'0' is not an integer"),
    ("another format", "format_version is not 1"),
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
    program = data["variants"][str(CLIENT_SLOT_BITS)]["programs"]["tcp:tcp_receive_reset"]
    program["instructions"] = base64.b64encode(b"\x95" + b"\0" * 7).decode()  # exit without setting r0
    program["maps"], program["wakeup"] = [], []
    path = tmp_path / "disconnect.prebuilt.json"
    path.write_text(json.dumps(data))
    tracefs = next(root for root in TRACEFS_ROOTS if (root / "events").is_dir())
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProbeUnavailable, match=r"the prebuilt probe did not load \(bpf\(program load "
                                               r"tcp_receive_reset\): .*; the verifier: R0 !read_ok"):
        prebuilt.load(ringbuf_bytes=1 << 20, wakeup_every=64, client_slot_bits=CLIENT_SLOT_BITS,
                      tracepoints=TRACEPOINT_NAMES, tracefs=tracefs, path=path)
    assert len(os.listdir("/proc/self/fd")) == before  # maps, programs and perf events closed


@pytest.mark.privileged
def test_bcc_compiles_today_what_was_committed() -> None:
    # `make probe-object` is reproducible here: the committed object is this source's compile.
    from probes.prebuild import build

    built = build()
    data = committed()
    assert built["variants"] == data["variants"]
    assert (built["fields"], built["record_format"]) == (data["fields"], data["record_format"])
