"""Finding the engine process behind a listening port, with real sockets and the real /proc.

Also what it takes without root: the unit's own capabilities are not enough to read another
user's descriptors; CAP_SYS_PTRACE on top of them is (docs/verdicts.md, "Cost").
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from collectors.listeners import CLOSERS_HINT, SHARED_CLOSERS_HINT, ListenerPids, listening_inodes
from probes.caps import UNIT_CAPABILITIES

REPO = Path(__file__).resolve().parents[1]


def listener(family: int = socket.AF_INET) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    sock.listen()
    return sock


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_listening_port_leads_to_this_process_ipv4_and_ipv6() -> None:
    with listener() as v4, listener(socket.AF_INET6) as v6:
        ports = {v4.getsockname()[1], v6.getsockname()[1]}
        closed = free_port()
        pids, unknown = ListenerPids().resolve([*ports, closed])
    assert pids == {port: os.getpid() for port in ports}
    assert unknown == {closed: f"nothing listens on port {closed} on this host"}


def test_a_connection_on_the_port_is_not_taken_for_the_listener() -> None:
    with listener() as server, socket.create_connection(server.getsockname()):
        accepted, _ = server.accept()
        with accepted:  # an established socket on the same local port, in the same process
            port = server.getsockname()[1]
            inodes = listening_inodes([port])
    assert len(inodes[port]) == 1  # the LISTEN row only


def test_the_kernels_sock_diag_answer_is_proc_net_tcps() -> None:
    from probes import sockdiag

    with listener() as v4, listener(socket.AF_INET6) as v6, socket.create_connection(v4.getsockname()):
        ports = {v4.getsockname()[1], v6.getsockname()[1], free_port()}
        by_netlink = sockdiag.listening_inodes(ports)
        assert by_netlink == listening_inodes(ports) and len(by_netlink) == 2

        def refused(wanted: set[int]) -> dict[int, set[int]]:
            raise PermissionError("netlink refused")

        # Given the kernel's answer, the finder takes it; where netlink is refused, /proc/net/tcp's.
        for way in (sockdiag.listening_inodes, refused):
            pids, unknown = ListenerPids(listening=way).resolve(ports)
            assert set(pids) == ports - set(unknown) and set(pids.values()) == {os.getpid()} and len(pids) == 2


def test_found_pids_are_cached_and_a_new_listener_is_found_again() -> None:
    clock = [0.0]
    finder = ListenerPids(refresh_s=0.0, verify_s=0.0, rescan_s=5.0, monotonic=lambda: clock[0])
    with listener() as first:
        port = first.getsockname()[1]
        assert finder.resolve([port])[0] == {port: os.getpid()}
        clock[0] += 1
        assert finder.resolve([port])[0] == {port: os.getpid()} and finder.scans == 1  # checked, not rescanned
    # The engine restarted on the same port (a new socket, a new inode): found by a new scan.
    with socket.create_server(("127.0.0.1", port)):
        clock[0] += 1
        assert finder.resolve([port])[0] == {}  # too soon to scan /proc again
        clock[0] += 5
        assert finder.resolve([port])[0] == {port: os.getpid()} and finder.scans == 2


def test_an_answer_holds_while_its_processes_live_and_is_checked_in_full_now_and_then() -> None:
    clock = [0.0]
    finder = ListenerPids(refresh_s=1.0, verify_s=30.0, monotonic=lambda: clock[0])
    with listener() as engine:
        port = engine.getsockname()[1]
        assert finder.resolve([port])[0] == {port: os.getpid()}
    clock[0] += 10  # closed, but its process lives: /proc/net/tcp is not read again yet
    assert finder.resolve([port]) == ({port: os.getpid()}, {})
    clock[0] += 25
    assert finder.resolve([port]) == ({}, {port: f"nothing listens on port {port} on this host"})


def test_ports_the_lookup_leaves_unknown_take_the_process_seen_closing_a_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    finder = ListenerPids()
    with listener() as engine:
        served, idle, quiet = engine.getsockname()[1], free_port(), free_port()
        closers = {served: 4242, idle: 4343, 9: 4444}  # the lookup's own answer wins; 9 was not asked
        with caplog.at_level(logging.INFO, logger="collectors.listeners"):
            for _ in range(2):
                found, unknown = finder.resolve([served, idle, quiet], closers=lambda: closers)
                assert found == {served: os.getpid(), idle: 4343}
                assert unknown == {quiet: f"nothing listens on port {quiet} on this host" + CLOSERS_HINT}
        assert [r.getMessage() for r in caplog.records] == [
            f"port {idle}: engine process 4343, seen closing a connection by the eBPF probe"]
        # The cached answer is the lookup's own: without closers the ports are unknown again.
        assert finder.resolve([served, idle, quiet]) == (
            {served: os.getpid()}, {port: f"nothing listens on port {port} on this host" for port in (idle, quiet)})


def capabilities(extra: str = "") -> str:
    names = UNIT_CAPABILITIES.split() + ([extra] if extra else [])
    return ",".join("+" + name.removeprefix("CAP_").lower() for name in names)


@pytest.mark.privileged
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
@pytest.mark.parametrize("extra", ["", "CAP_SYS_PTRACE"])
def test_as_the_units_user_another_users_engine_needs_cap_sys_ptrace(extra: str) -> None:
    unit = re.search(r"^AmbientCapabilities=(.+)$", (REPO / "systemd" / "auditor.service").read_text(), re.M)
    assert unit and unit.group(1).split() == UNIT_CAPABILITIES.split()
    caps = capabilities(extra)
    with listener() as engine:  # root's socket: another user's, for uid 65534
        port = engine.getsockname()[1]
        code = ("from collectors.listeners import ListenerPids; import json; "
                f"print(json.dumps(ListenerPids().resolve([{port}])))")
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", f"--inh-caps=-all,{caps}",
             f"--ambient-caps=-all,{caps}", "--", sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd="/", capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found, unknown = json.loads(result.stdout)
    if extra:
        assert found == {str(port): os.getpid()} and not unknown
    else:
        assert not found and "CAP_SYS_PTRACE" in unknown[str(port)], unknown
        assert "put process.pid in the engine's OpenTelemetry resource" in unknown[str(port)]


def test_one_reader_of_the_kernels_socket_tables_skips_what_it_cannot_read() -> None:
    """The listener lookup, the other namespaces' look and the doctor read /proc/net/{tcp,udp}{,6}
    with one function: LISTEN rows (or unconnected UDP ones) on the ports asked, by inode; a
    connection, another port, a socket without an inode, a short or garbled line are left out."""
    from auditor.socktable import UDP_UNCONNECTED, bound_inodes

    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = [
        "   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0",
        "   1: 0100007F:1F40 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0",
        "   2: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3333 1 0",
        "   3: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 0 1 0",
        "   4: 00000000:ZZZZ 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0",
        "   5: 00000000:1F40 00000000:0000 0A",
        "   6: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000     0        0 5555 1 0",
        "   7: 00000000:1F40 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 6666 2 0",
    ]
    text = header + "\n".join(rows) + "\n"
    assert bound_inodes(text, {8000}) == {8000: {1111, 5555}}
    assert bound_inodes(text, {8000, 8001, 9}) == {8000: {1111, 5555}, 8001: {3333}}
    assert bound_inodes(text, {8000}, UDP_UNCONNECTED) == {8000: {6666}}
    assert bound_inodes("", {8000}) == {} and bound_inodes("garbage\n\x00\n", {8000}) == {}


class TwoPods:
    """Two other network namespaces listening on ``port``, as pods of a node serving one port:
    the first's LISTEN socket is this test's listener (its process: this one), the second's an
    inode no process here holds (another user's, unreadable)."""

    def __init__(self, port: int, inode: int) -> None:
        self.port = port
        self.inodes = {port: {inode, 1}}
        self._by_address = {"10.244.1.5": {inode}, "10.244.1.6": {1}}

    def refresh(self, ports: object, *, fresh: bool = False) -> dict[int, list[object]]:
        return {self.port: [object(), object()]}

    def by_address(self, port: int) -> dict[str, set[int]]:
        return self._by_address if port == self.port else {}


def test_a_port_several_containers_serve_names_each_ones_process_by_its_address() -> None:
    """Each namespace's listener by its address (``shared``), none for the port as a whole, and
    every namespace's address (``servers``); a process the eBPF probe saw closing a connection
    there is one of their engines, not the port's, and the one at a container's address names
    that container's engine where /proc could not."""
    with listener() as engine:
        port = engine.getsockname()[1]
        inode = os.stat(f"/proc/self/fd/{engine.fileno()}").st_ino
        finder = ListenerPids(listening=lambda ports: {}, other_namespaces=TwoPods(port, inode))
        found, unknown = finder.resolve([port], closers=lambda: {port: 4242})
    assert found == {} and finder.shared == {port: {"10.244.1.5": os.getpid()}}
    # Both addresses serve the port, the second's process unread: the correlator's joins weigh both.
    assert finder.servers == {port: {"10.244.1.5", "10.244.1.6"}}
    # The eBPF probe saw processes closing at each address: the second container's is taken from
    # it (its descriptors are another user's), the first's stays the one /proc found.
    finder.resolve([port], closers=lambda: {port: 4242},
                   closers_at=lambda: {port: {"10.244.1.5": 4242, "10.244.1.6": 4343}, port + 1: {"10.0.0.1": 1}})
    assert finder.shared == {port: {"10.244.1.5": os.getpid(), "10.244.1.6": 4343}}
    assert "listened on in 2 other network namespaces" in unknown[port]
    assert "the spans came from none of their addresses" in unknown[port] and CLOSERS_HINT not in unknown[port]
    assert SHARED_CLOSERS_HINT not in unknown[port]


@pytest.mark.parametrize("probe", [True, False])
def test_a_port_whose_containers_processes_are_all_unread_says_how_to_name_them(probe: bool) -> None:
    """None of the containers' processes found (another user's, read without CAP_SYS_PTRACE): the
    reason says so, and names the eBPF probe only where it is asked (the /proc source names none);
    the process the probe saw closing on the port is none of the containers' own."""
    with listener() as engine:
        port = engine.getsockname()[1]
        finder = ListenerPids(listening=lambda ports: {}, other_namespaces=TwoPods(port, 1))
        closers = {"closers": lambda: {port: 4242}, "closers_at": lambda: {}} if probe else {}
        found, unknown = finder.resolve([port], **closers)
    assert found == {} and not any(finder.shared.values())
    assert "none of their listening processes was found" in unknown[port]
    assert "process.pid" in unknown[port] and (SHARED_CLOSERS_HINT in unknown[port]) == probe
