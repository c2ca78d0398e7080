"""The probe loaded by a short-lived child: what the daemon keeps (descriptors, no bcc, no LLVM),
that the attachments outlive the child, and a defined answer to every way the child can fail.

The failure cases run real children (the loader itself, or a stand-in that misbehaves on purpose)
over the real socket protocol; only the compile and load cases need eBPF privileges.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from auditor.model import ConnEventKind
from probes import ProbeUnavailable, bpfsys, open_source, prebuilt
from probes.bpf import (
    PROGRAM_CFLAGS,
    TRACEPOINT_NAMES,
    BpfConnEventSource,
    compiling_loader,
    default_loader,
    program_text,
)
from probes.handoff import load_in_child
from tests.e2e import wait_for

PEER_FIN, PEER_RST, CLOSED = ConnEventKind.PEER_FIN, ConnEventKind.PEER_RST, ConnEventKind.CLOSED
PAGE = 4096
REPO = Path(__file__).resolve().parents[1]
LIBBCC_OR_LLVM = ("libbcc", "libLLVM", "libclang")


def children_running(marker: str) -> list[int]:
    """Live (not zombie) child processes of this process whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and marker in cmdline:
            found.append(int(entry.name))
    return found


def closes(server: socket.socket, reset: bool) -> int:
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    if reset:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client_port = int(client.getsockname()[1])
    client.close()
    time.sleep(0.01)
    accepted.close()
    return client_port


def fake_child(code: str) -> list[str]:
    """A stand-in loader: Python code with the socket as ``sock`` (its standard input)."""
    boot = "import socket, sys, os, json, time; sock = socket.socket(fileno=0); sock.recv(1 << 20)\n"
    return [sys.executable, "-c", boot + code]


def load(command: list[str] | None = None, text: str | None = None, timeout_s: float = 30.0) -> object:
    return load_in_child(text or program_text(), PROGRAM_CFLAGS, ringbuf_bytes=4096 * PAGE,
                         tracepoints=TRACEPOINT_NAMES, timeout_s=timeout_s, command=command)


# -- the real loader ----------------------------------------------------------------------------
@pytest.mark.privileged
@pytest.mark.parametrize("loader", [pytest.param("child", marks=pytest.mark.compiles), "prebuilt"])
def test_a_probe_loaded_without_bcc_here_sees_fin_and_rst(loader: str) -> None:
    # The child compiled it and exited; the prebuilt probe was never compiled here.
    server = socket.create_server(("127.0.0.1", 0))
    source = BpfConnEventSource([server.getsockname()[1]], host="loader-test", loader=loader)
    try:
        assert children_running("probes.loader") == []  # it exited: only descriptors remain here
        source.start()
        port = server.getsockname()[1]
        fin_port, rst_port = closes(server, reset=False), closes(server, reset=True)
        events: list = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (
                any(e.kind == CLOSED and e.client_port == fin_port for e in events)
                and any(e.kind == PEER_RST and e.client_port == rst_port for e in events)):
            events += source.poll(timeout_s=0.05)
        events += source.poll(timeout_s=0.2)
        kinds = {p: [e.kind for e in events if e.client_port == p and e.server_port == port]
                 for p in (fin_port, rst_port)}
        assert kinds == {fin_port: [PEER_FIN, CLOSED], rst_port: [PEER_RST]}
        assert source.lost_events() == 0
    finally:
        source.stop()
        server.close()


@pytest.mark.privileged
@pytest.mark.parametrize("loader", ["prebuilt", pytest.param("child", marks=pytest.mark.compiles), pytest.param("inprocess", marks=pytest.mark.compiles)])
def test_the_kernel_counts_the_probes_runs_while_asked(loader: str, bpf_run_stats: None) -> None:
    # Every state change of every TCP socket on the host runs the program, watched port or not.
    server = socket.create_server(("127.0.0.1", 0))
    source = BpfConnEventSource([server.getsockname()[1]], host="loader-test", loader=loader)
    assert source.program_runs() == {}  # not started
    try:
        source.start()
        before = source.program_runs()
        assert set(before) == set(TRACEPOINT_NAMES)
        for _ in range(20):
            closes(server, reset=False)
        closes(server, reset=True)
        after = source.program_runs()
        states = TRACEPOINT_NAMES[0]
        # A FIN close on loopback walks both ends through at least six states between them.
        assert after[states].runs - before[states].runs >= 20 * 6
        assert after[states].run_ns > before[states].run_ns
        bpfsys.STATS_SYSCTL.write_text("0")  # not asked: the kernel counts nothing
        stopped_at = source.program_runs()
        closes(server, reset=False)
        assert source.program_runs() == stopped_at
    finally:
        source.stop()
        server.close()
    assert source.program_runs() == {}


def test_run_counts_come_from_a_programs_fdinfo_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "7").write_text("pos:\t0\nprog_type:\t5\nrun_time_ns:\t1234\nrun_cnt:\t9\n")
    (tmp_path / "8").write_text("pos:\t0\nflags:\t02\n")  # a map, a file: no run counts
    (tmp_path / "9").write_text("run_time_ns:\tmany\nrun_cnt:\t1\n")
    assert bpfsys.program_runs(7, tmp_path) == bpfsys.ProgramRuns(1234, 9)
    for fd in (8, 9):
        with pytest.raises(ValueError, match=f"descriptor {fd} shows no BPF program run counts"):
            bpfsys.program_runs(fd, tmp_path)
    (tmp_path / "on").write_text("1\n")
    (tmp_path / "off").write_text("0\n")
    assert bpfsys.stats_enabled(tmp_path / "on") is True
    assert bpfsys.stats_enabled(tmp_path / "off") is False
    assert bpfsys.stats_enabled(tmp_path / "absent") is None


@pytest.mark.privileged
@pytest.mark.compiles
def test_stop_frees_the_program_and_its_maps() -> None:
    # The kernel frees a map once nothing refers to it: not the child (gone), not a perf event
    # (detached), not the daemon (closed). Freeing is deferred, hence the wait.
    source = BpfConnEventSource([8000], loader="child")
    source.start()
    ids = [bpfsys.map_info(fd).id for name, fd in source._program.fds.items()  # type: ignore[union-attr]
           if name.startswith("map:")]
    for map_id in ids:
        os.close(bpfsys.map_by_id(map_id))  # alive while the source runs
    source.stop()

    def freed() -> bool:
        for map_id in ids:
            try:
                os.close(bpfsys.map_by_id(map_id))
                return False
            except OSError:
                pass
        return True

    assert wait_for(freed, timeout_s=10)


@pytest.mark.privileged
@pytest.mark.compiles
def test_an_unloadable_program_is_probe_unavailable_with_the_childs_one_line_reason() -> None:
    broken = program_text().replace("return 0;", "return undeclared_name;", 1)
    with pytest.raises(ProbeUnavailable) as caught:
        load(text=broken)
    reason = caught.value.reason
    assert reason.startswith("the BPF program failed to load (Failed to compile BPF module")
    assert "undeclared_name" in reason  # the compiler's first error, not its whole output
    assert "\n" not in reason and len(reason) < 600
    assert children_running("probes.loader") == []


@pytest.mark.privileged
@pytest.mark.compiles
def test_a_program_without_the_probes_maps_is_refused_and_detached() -> None:
    bare = "TRACEPOINT_PROBE(tcp, tcp_receive_reset) { return 0; }\n"
    with pytest.raises(ProbeUnavailable, match=r"the program lacks what the probe reads \(no events map\)"):
        load(text=bare)


@pytest.mark.privileged
@pytest.mark.compiles
def test_a_program_without_the_server_pid_map_is_refused() -> None:
    renamed = program_text().replace("server_pids", "other_pids")
    assert renamed != program_text()
    with pytest.raises(ProbeUnavailable, match=r"the program lacks what the probe reads \(no server_pids map\)"):
        load(text=renamed)
    assert children_running("probes.loader") == []


@pytest.mark.privileged
@pytest.mark.compiles
def test_auto_falls_back_when_neither_the_prebuilt_probe_nor_the_child_loads(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    broken = tmp_path / "disconnect.prebuilt.json"
    broken.write_text(json.dumps({"format_version": prebuilt.FORMAT_VERSION}))
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", broken)
    monkeypatch.setattr("probes.bpf.program_text", lambda *_a, **_k: "this is not C\n")
    with caplog.at_level(logging.WARNING):
        source = open_source([8000], prefer="auto", host="h")
    assert source.name == "procfs"
    assert "the prebuilt probe disconnect.prebuilt.json is not usable (KeyError: 'variants')" in caplog.text
    assert "the BPF program failed to load" in caplog.text
    with pytest.raises(ProbeUnavailable, match="the BPF program failed to load"):
        open_source([8000], prefer="bpf", host="h")


# -- children that misbehave --------------------------------------------------------------------
def test_a_child_that_hangs_is_killed_after_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(ProbeUnavailable, match=r"did not answer within 1 s and was stopped"):
        load(fake_child("time.sleep(60)"), timeout_s=1)
    assert time.monotonic() - started < 10
    assert children_running("time.sleep(60)") == []


def test_a_child_that_dies_is_named_with_its_exit_status_and_last_words() -> None:
    with pytest.raises(ProbeUnavailable, match=r"exit status 3, no answer: boom"):
        load(fake_child("sys.stderr.write('compiling\\nboom\\n'); sys.exit(3)"))


@pytest.mark.parametrize(("answer", "message"), [
    (b"garbage", "not JSON"),
    (b"[1, 2]", "not an answer object"),
    (b'{"ok": false}', "a failure without a reason"),
    (b'{"ok": true, "maps": {"events": 0}, "attached": {}, "programs": {}}', "descriptor 0 of 0"),
    (b'{"ok": true, "maps": {}, "attached": {}}', "maps, attached or programs missing"),
    (b'{"ok": true}', "maps, attached or programs missing"),
])
def test_garbage_from_the_child_is_a_clear_error(answer: bytes, message: str) -> None:
    with pytest.raises(ProbeUnavailable, match="the BPF loader's answer is not usable") as caught:
        load(fake_child(f"sock.send({answer!r})"))
    assert message in caught.value.reason


def test_a_failure_the_child_reports_is_passed_on_as_its_reason() -> None:
    answer = b'{"ok": false, "reason": "bcc is not importable (No module named bcc)\\nsecond line"}'
    with pytest.raises(ProbeUnavailable) as caught:
        load(fake_child(f"sock.send({answer!r})"))
    assert caught.value.reason == "bcc is not importable (No module named bcc)"


def test_descriptors_that_are_not_the_probes_maps_are_refused_and_closed() -> None:
    # Thirteen descriptors under the right names, but files: the kernel says they are not BPF maps.
    code = ("fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(13)]\n"
            "names = {'maps': {'events': 0, 'watched_ports': 1, 'lost_events': 2, 'server_pids': 5,\n"
            "                  'clients': 8, 'client_counts': 11, 'client_slots': 12},\n"
            f"         'attached': {{{TRACEPOINT_NAMES[0]!r}: 3, {TRACEPOINT_NAMES[1]!r}: 4,\n"
            f"                      {TRACEPOINT_NAMES[2]!r}: 9}},\n"
            f"         'programs': {{{TRACEPOINT_NAMES[0]!r}: 6, {TRACEPOINT_NAMES[1]!r}: 7,\n"
            f"                      {TRACEPOINT_NAMES[2]!r}: 10}},\n"
            "         'ok': True, 'record_format': '=QQ16s16sHHHBB'}\n"
            "socket.send_fds(sock, [json.dumps(names).encode()], fds)\n")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProbeUnavailable, match="map:events is not a BPF map"):
        load(fake_child(code))
    assert len(os.listdir("/proc/self/fd")) == before  # the received descriptors were closed


def test_more_descriptors_than_the_probe_takes_are_refused_and_closed() -> None:
    code = ("fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(40)]\n"
            "socket.send_fds(sock, [b'{}'], fds)\n")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProbeUnavailable, match="more than 16 descriptors"):
        load(fake_child(code))
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_loader_that_cannot_start_is_probe_unavailable() -> None:
    with pytest.raises(ProbeUnavailable, match="the BPF loader could not start"):
        load(["/nonexistent/python"])


# -- where the child loader is used ------------------------------------------------------------
def test_architectures_without_a_known_syscall_number_keep_bcc_in_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OSError, match="the bpf\\(2\\) syscall number of riscv64 is not known"):
        bpfsys.syscall_number("riscv64")
    assert bpfsys.syscall_number("x86_64") == 321 and bpfsys.syscall_number("aarch64") == 280
    monkeypatch.setattr("platform.machine", lambda: "riscv64")
    assert default_loader() == "inprocess"
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert default_loader() == "prebuilt" and compiling_loader() == "child"
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", Path("/nonexistent/disconnect.prebuilt.json"))
    assert default_loader() == "child"


def test_an_unknown_loader_or_a_reader_it_cannot_offer_is_a_config_error() -> None:
    from auditor.errors import ConfigError

    with pytest.raises(ConfigError, match="BPF loader 'llvm' is unknown"):
        BpfConnEventSource([8000], loader="llvm")
    with pytest.raises(ConfigError, match="mapped_reader=False needs loader='inprocess'"):
        BpfConnEventSource([8000], loader="child", mapped_reader=False)


@pytest.mark.privileged
@pytest.mark.compiles
def test_bccs_callback_reader_brings_bcc_in_process_and_reads() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    source = BpfConnEventSource([server.getsockname()[1]], mapped_reader=False)
    try:
        assert source.loader == "inprocess"
        source.start()
        client_port = closes(server, reset=True)
        events: list = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(e.kind == PEER_RST for e in events):
            events += source.poll(timeout_s=0.05)
        events += source.poll(timeout_s=0.2)
        assert [e.kind for e in events if e.client_port == client_port] == [PEER_RST]
    finally:
        source.stop()
        server.close()


def test_possible_cpus_reads_the_kernels_mask(tmp_path: Path) -> None:
    mask = tmp_path / "possible"
    for text, count in [("0\n", 1), ("0-7\n", 8), ("0-3,6,8-9\n", 7)]:
        mask.write_text(text)
        assert bpfsys.possible_cpus(mask) == count


# -- the daemon as the unit runs it -------------------------------------------------------------
@pytest.mark.privileged
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_the_units_daemon_maps_no_bcc_or_llvm_and_watches_with_bpf() -> None:
    # As systemd/auditor.service runs it: uid 65534, NoNewPrivileges, only the unit's ambient
    # capabilities, which the loader child inherits across exec.
    from tests.test_daemon_unprivileged import NOBODY, free_port, metrics, unit_capabilities

    state = Path(tempfile.mkdtemp(prefix="auditor-loader-"))
    state.chmod(0o777)  # uid 65534 writes its database here
    server = socket.create_server(("127.0.0.1", 0))
    metrics_port, caps = free_port(), unit_capabilities()
    command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs",
               f"--inh-caps={caps}", f"--ambient-caps={caps}", "--",
               sys.executable, "-m", "auditor", "run", "--db", f"sqlite:///{state / 'a.db'}",
               "--port", str(server.getsockname()[1]), "--otlp-http", "127.0.0.1:0",
               "--otlp-grpc", "", "--live", "", "--metrics", f"127.0.0.1:{metrics_port}"]
    log = state / "daemon.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen(command, cwd=state, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(state)})
    try:
        assert wait_for(lambda: 'source="bpf"} 1.0' in metrics(metrics_port), timeout_s=60), \
            log.read_text()[-3000:]
        mapped = Path(f"/proc/{daemon.pid}/maps").read_text()
        uid_line = next(line for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines()
                        if line.startswith("Uid:"))
        assert uid_line.split()[1:] == [str(NOBODY)] * 4  # not root: the capabilities did it
        assert [line for line in mapped.splitlines() if any(lib in line for lib in LIBBCC_OR_LLVM)] == []
        closes(server, reset=True)
        assert wait_for(lambda: 'auditor_disconnects_total{kind="rst"} 1.0' in metrics(metrics_port),
                        timeout_s=20), metrics(metrics_port)[-2000:]
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        server.close()
        output = log.read_text()
        shutil.rmtree(state, ignore_errors=True)
    assert daemon.returncode == 0, output[-3000:]
