"""The eBPF disconnect probe, for real: a uvicorn server and raw sockets on loopback.

The program is loaded once for the module per loader (see the ``probe`` fixture); each test points the live port filter at its own
listeners (ephemeral ports) and looks only at events for its own connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from auditor.config import Config
from auditor.errors import ConfigError
from auditor.model import ConnEvent, ConnEventKind
from auditor.store import Store
from probes import open_source
from probes.bpf import TRACEFS_ROOTS, TRACEPOINTS, BpfConnEventSource, tcp_records_lack_family
from probes.writer import ConnEventWriter

pytestmark = pytest.mark.privileged

PEER_FIN, PEER_RST, LOCAL_FIN, CLOSED = (ConnEventKind.PEER_FIN, ConnEventKind.PEER_RST,
                                         ConnEventKind.LOCAL_FIN, ConnEventKind.CLOSED)
MS = 1_000_000


class Probe:
    """The module's probe plus every event it has polled, so tests can wait for what they need."""

    def __init__(self, source: BpfConnEventSource) -> None:
        self.source = source
        self.events: list[ConnEvent] = []

    def wait_for(self, done: Callable[[list[ConnEvent]], bool], timeout_s: float = 5.0) -> list[ConnEvent]:
        deadline = time.monotonic() + timeout_s
        while not done(self.events) and time.monotonic() < deadline:
            self.events += self.source.poll(timeout_s=0.05)
        return self.events

    def of(self, server_port: int, client_port: int | None = None) -> list[ConnEvent]:
        return [e for e in self.events if e.server_port == server_port
                and (client_port is None or e.client_port == client_port)]

    def kinds(self, server_port: int, client_port: int) -> list[ConnEventKind]:
        return [e.kind for e in self.of(server_port, client_port)]

    def wait_closed(self, server_port: int, client_port: int) -> list[ConnEventKind]:
        """The connection's records once its last has come: `closed` after a FIN, the `peer_rst`
        of a reset (its own close is not reported; a moment more lets one show if it were)."""
        self.wait_for(lambda _: {CLOSED, PEER_RST} & set(self.kinds(server_port, client_port)))
        if PEER_RST in self.kinds(server_port, client_port):
            self.wait_for(lambda _: False, timeout_s=0.2)
        return self.kinds(server_port, client_port)


def wait_time_wait(server_port: int, client_port: int, host: str = "127.0.0.1") -> None:
    """Until the server's end of the connection is in TIME_WAIT, or gone (a host out of TIME_WAIT
    buckets closes it at once): either way its full socket went to CLOSE."""
    from probes.sockdiag import TCP_TIME_WAIT, SockDiag

    diag = SockDiag()
    try:
        deadline = time.monotonic() + 5
        while (state := diag.state_of((4, host, server_port, host, client_port))) not in (TCP_TIME_WAIT, None):
            assert time.monotonic() < deadline, f"the server's socket never reached TIME_WAIT (state {state})"
            time.sleep(0.01)
    finally:
        diag.close()


def tracefs_without_tcp_family(root: Path) -> Path:
    """This kernel's tracefs as the daemon reads it (format and id of its tracepoints), its tcp:*
    records told without the family field, as 5.10's are: the prebuilt loader then takes the
    programs that read the family from the socket. The other fields stay where they are."""
    real = next(path for path in TRACEFS_ROOTS if (path / "events").is_dir())
    for tracepoint in TRACEPOINTS:
        directory = root / "events" / tracepoint
        directory.mkdir(parents=True)
        (directory / "id").write_text((real / "events" / tracepoint / "id").read_text())
        lines = (real / "events" / tracepoint / "format").read_text().splitlines(keepends=True)
        if tracepoint.startswith("tcp/"):
            lines = [line for line in lines if " family;" not in line]
        (directory / "format").write_text("".join(lines))
    return root


@pytest.fixture(scope="module", params=["prebuilt", "prebuilt-family-from-socket",
                                        pytest.param("child", marks=pytest.mark.compiles),
                                        pytest.param("inprocess", marks=pytest.mark.compiles)])
def probe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    # Every loader: the default (bcc's compile kept at build time, loaded with bpf(2) alone), a
    # child that compiles it (the process keeps descriptors) and bcc kept in-process (machines
    # where descriptors alone are not enough). And the prebuilt programs a kernel whose tcp:*
    # records lack the family gets (they read it from the socket), here where the records have it.
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "prebuilt-family-from-socket":
            fake = tracefs_without_tcp_family(tmp_path_factory.mktemp("tracefs"))
            assert tcp_records_lack_family((fake,))
            patch.setattr("probes.bpf.TRACEFS_ROOTS", (fake,))
        if request.param.startswith("prebuilt"):
            source = open_source([], prefer="bpf", host="probe-test")
        else:
            source = BpfConnEventSource([], host="probe-test", loader=request.param)
    assert isinstance(source, BpfConnEventSource) and source.loader == request.param.removesuffix("-family-from-socket")
    source.start()
    yield Probe(source)
    source.stop()


def listener(family: int = socket.AF_INET, host: str = "127.0.0.1", backlog: int = 128) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(backlog)
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def reset_on_close(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# -- a real HTTP server: uvicorn with a slow streaming endpoint -------------------------------
async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    if scope["path"] == "/stream":  # 20 chunks, 50 ms apart: a slow token stream
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        for index in range(20):
            await send({"type": "http.response.body", "body": b"token %d\n" % index, "more_body": True})
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    import uvicorn

    sock = listener()
    server = uvicorn.Server(uvicorn.Config(streaming_app, lifespan="off", log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    yield port_of(sock)
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def read_response(sock: socket.socket) -> bytes:
    """One complete `/small` response (content-length 2)."""
    data = b""
    while not (b"\r\n\r\n" in data and data.endswith(b"ok")):
        chunk = sock.recv(4096)
        assert chunk, "server closed early"
        data += chunk
    return data


def drain_to_eof(sock: socket.socket) -> None:
    # Unread data at close() makes the kernel send RST instead of FIN.
    sock.settimeout(5)
    while sock.recv(65536):
        pass


# -- the cases of a real inference port -------------------------------------------------------
def test_client_fin_mid_response_is_a_peer_fin_timed_to_the_close(probe: Probe, http_port: int) -> None:
    probe.source.set_ports([http_port])
    client = socket.create_connection(("127.0.0.1", http_port))
    client.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
    assert b" 200 " in client.recv(65536)
    client_port = port_of(client)
    before = time.time_ns()
    client.shutdown(socket.SHUT_WR)  # the FIN, while the server is still streaming
    after = time.time_ns()
    client.close()

    kinds = probe.wait_closed(http_port, client_port)
    assert kinds[0] == PEER_FIN, kinds
    # It ends with the server's close, or with the client's reset where the close found the
    # stream's unread bytes (peer_fin, peer_rst: the reset's own close is not reported).
    assert kinds[1:] in ([CLOSED], [PEER_RST]), kinds
    assert LOCAL_FIN not in kinds  # the server closed only after the client did
    fin = probe.of(http_port, client_port)[0]
    # Loose here (a loaded host may defer loopback softirqs); the tight bound is tested below on
    # a socket whose state the test can watch.
    assert before - MS < fin.ts_ns < after + 500 * MS, (fin.ts_ns - before, after - fin.ts_ns)
    assert (fin.family, fin.client_addr, fin.server_addr) == (4, "127.0.0.1", "127.0.0.1")
    assert fin.host == "probe-test" and fin.source == "bpf"
    assert len({e.cookie for e in probe.of(http_port, client_port)}) == 1


def test_client_rst_is_one_peer_rst(probe: Probe, http_port: int) -> None:
    probe.source.set_ports([http_port])
    client = socket.create_connection(("127.0.0.1", http_port))
    client.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
    assert b" 200 " in client.recv(65536)
    client_port = port_of(client)
    reset_on_close(client)
    before = time.time_ns()
    client.close()
    after = time.time_ns()

    kinds = probe.wait_closed(http_port, client_port)
    assert kinds == [PEER_RST]  # one reset, reported once; the close it causes is not news
    rst = probe.of(http_port, client_port)[0]
    assert before - MS < rst.ts_ns < after + 500 * MS


TCP_CLOSE_WAIT, TCP_CLOSE = 8, 7


def wait_until_state(sock: socket.socket, state: int) -> int:
    """Spin until the kernel reports ``state`` for ``sock`` (TCP_INFO); returns time.time_ns()."""
    deadline = time.monotonic() + 2
    while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != state:
        assert time.monotonic() < deadline, "the state change never came"
    return time.time_ns()


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_timestamps_are_within_a_millisecond_of_the_wall_clock(probe: Probe, how: str) -> None:
    # The change happened after `before` and before the test saw the new state (`seen`): the
    # converted kernel time must fall in that window, give or take less than a millisecond.
    server = listener()
    probe.source.set_ports([port_of(server)])
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client_port = port_of(client)
    if how == "rst":
        reset_on_close(client)
    before = time.time_ns()
    client.close()
    seen = wait_until_state(accepted, TCP_CLOSE_WAIT if how == "fin" else TCP_CLOSE)
    accepted.close()
    probe.wait_closed(port_of(server), client_port)
    first = probe.of(port_of(server), client_port)[0]
    assert first.kind == (PEER_FIN if how == "fin" else PEER_RST)
    assert before - MS < first.ts_ns < seen + MS, (first.ts_ns - before, seen - first.ts_ns)
    server.close()


def test_server_closing_first_is_not_a_peer_close(probe: Probe, http_port: int) -> None:
    probe.source.set_ports([http_port])
    client = socket.create_connection(("127.0.0.1", http_port))
    client.sendall(b"GET /small HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
    drain_to_eof(client)  # uvicorn answers and closes: the client sees EOF first
    client_port = port_of(client)
    client.close()

    # The server's socket went FIN_WAIT2 -> CLOSE as it entered TIME_WAIT: a transition the
    # probe saw and does not report (the local_fin already ended the connection).
    wait_time_wait(http_port, client_port)
    probe.wait_for(lambda _: False, timeout_s=0.3)
    assert probe.kinds(http_port, client_port) == [LOCAL_FIN]


def test_keep_alive_requests_then_close(probe: Probe, http_port: int) -> None:
    probe.source.set_ports([http_port])
    client = socket.create_connection(("127.0.0.1", http_port))
    client_port = port_of(client)
    for _ in range(3):
        client.sendall(b"GET /small HTTP/1.1\r\nHost: test\r\n\r\n")
        assert read_response(client).startswith(b"HTTP/1.1 200")
    probe.wait_for(lambda _: False, timeout_s=0.2)
    assert probe.of(http_port, client_port) == []  # requests on an open connection are not events
    client.close()

    kinds = probe.wait_closed(http_port, client_port)
    assert kinds == [PEER_FIN, CLOSED]


def test_ipv6_four_tuple(probe: Probe) -> None:
    server = listener(socket.AF_INET6, "::1")
    probe.source.set_ports([port_of(server)])
    client = socket.create_connection(("::1", port_of(server)))
    accepted, _ = server.accept()
    client_port = port_of(client)
    client.close()
    probe.wait_for(lambda _: PEER_FIN in probe.kinds(port_of(server), client_port))
    accepted.close()

    assert probe.wait_closed(port_of(server), client_port) == [PEER_FIN, CLOSED]
    fin, closed = probe.of(port_of(server), client_port)
    assert (fin.family, fin.client_addr, fin.server_addr) == (6, "::1", "::1")
    assert (fin.client_port, fin.server_port) == (client_port, port_of(server))
    assert fin.cookie == closed.cookie and fin.cookie is not None and fin.cookie > 0
    server.close()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_clients_connected_are_listed_with_the_servers_last_read(probe: Probe, family: int) -> None:
    """The ``clients`` table: a client is listed from its accept to its close, with when the
    server last read data from it; another port's clients are not listed."""
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    server, other = listener(family, host), listener()
    probe.source.set_ports([port_of(server), port_of(other)])
    accepted = probe.source.accepted()
    quiet = socket.create_connection((host, port_of(server)))
    quiet_end, _ = server.accept()
    talking = socket.create_connection((host, port_of(server)))
    talking_end, _ = server.accept()
    elsewhere = socket.create_connection(("127.0.0.1", port_of(other)))
    elsewhere_end, _ = other.accept()
    time.sleep(0.05)
    talking.sendall(b"GET / HTTP/1.1\r\n\r\n")
    time.sleep(0.02)
    read_at = time.time_ns()
    assert talking_end.recv(100)
    listed = probe.source.clients([port_of(server)])
    assert listed is not None and set(listed) == {port_of(server)}
    assert accepted is not None and probe.source.accepted() == accepted + 3  # both watched ports
    by_port = {client_port: last_read for _address, client_port, last_read, _server in listed[port_of(server)]}
    assert {(address, server) for address, _port, _read, server in listed[port_of(server)]} == {(host, host)}
    assert by_port.keys() == {port_of(quiet), port_of(talking)}
    assert abs(by_port[port_of(talking)] - read_at) < 5 * MS  # the server's read, not the client's send
    assert by_port[port_of(quiet)] < read_at - 40 * MS  # its accept: nothing read since
    talking_port = port_of(talking)
    talking.close()
    talking_end.close()
    probe.wait_closed(port_of(server), talking_port)
    listed = probe.source.clients([port_of(server)])
    assert listed is not None and [p for _a, p, _r, _s in listed[port_of(server)]] == [port_of(quiet)]
    for sock in (quiet, quiet_end, elsewhere, elsewhere_end, server, other):
        sock.close()


@pytest.mark.parametrize(("lookups_at_most", "family"), [
    (64, socket.AF_INET), (64, socket.AF_INET6),  # each quiet client looked up
    (0, socket.AF_INET)])  # the port walked
def test_a_client_kept_alive_between_requests_is_not_listed(probe: Probe, monkeypatch: pytest.MonkeyPatch,
                                                            lookups_at_most: int, family: int) -> None:
    """The program's table has no send time: a client not read from for IDLE_QUIET_MS is asked of
    sock_diag, and one answered and quiet since (kept alive between requests, as a pool keeps it)
    is left out of the listing; one whose request the engine still holds stays."""
    from probes import bpf, sockdiag
    from tests.test_probe_procfs import clients_in_each_state

    monkeypatch.setattr(bpf, "IDLE_LOOKUPS_AT_MOST", lookups_at_most)
    monkeypatch.setattr(sockdiag, "IDLE_ANSWERED_MS", 100)
    monkeypatch.setattr(sockdiag, "IDLE_QUIET_MS", 200)
    monkeypatch.setattr(bpf, "IDLE_QUIET_MS", 200)
    server = listener(family, "127.0.0.1" if family == socket.AF_INET else "::1")
    probe.source.set_ports([port_of(server)])
    with clients_in_each_state(server, answer_after_s=0.15, quiet_s=0.3) as ends:
        by_port = {end.getpeername()[1]: name for name, end in ends.items()}
        listed = probe.source.clients([port_of(server)])
        assert listed is not None
        assert sorted(by_port[client[1]] for client in listed[port_of(server)]) == ["headers", "silent", "stalled", "unread"]
        monkeypatch.setattr(bpf, "IDLE_QUIET_MS", 60_000)  # none quiet that long: no walk, every client listed
        listed = probe.source.clients([port_of(server)])
        assert listed is not None and len(listed[port_of(server)]) == 5
    server.close()


def test_clients_connected_before_their_port_was_watched_are_listed(probe: Probe) -> None:
    """A port watched late (an engine found after its clients connected, a restarted daemon): its
    clients are put in the table from sock_diag, with when the server last read from them; one
    that closes afterwards leaves it as any other does."""
    server = listener()
    before = socket.create_connection(("127.0.0.1", port_of(server)))
    before_end, _ = server.accept()
    before.sendall(b"x")
    assert before_end.recv(10)
    read_at = time.time_ns()
    time.sleep(0.1)
    probe.source.set_ports([port_of(server)])
    listed = probe.source.clients([port_of(server)])
    assert listed is not None
    [(address, client_port, last_read, server_address)] = listed[port_of(server)]
    assert (address, client_port, server_address) == ("127.0.0.1", port_of(before), "127.0.0.1")
    assert abs(last_read - read_at) < 20 * MS  # tcp_info's last_data_recv: the kernel's ticks
    before_port = port_of(before)
    before.close()
    before_end.close()
    probe.wait_closed(port_of(server), before_port)
    assert probe.source.clients([port_of(server)]) == {port_of(server): ()}
    again = socket.create_connection(("127.0.0.1", port_of(server)))
    again_end, _ = server.accept()
    probe.source.set_ports([])  # unwatched: its clients leave the table (their closes go unseen)
    again.close()
    again_end.close()
    probe.source.set_ports([port_of(server)])
    assert probe.source.clients([port_of(server)]) == {port_of(server): ()}
    server.close()


@pytest.mark.parametrize("bits", [0, pytest.param(1, marks=pytest.mark.compiles)])  # 1: no prebuilt variant
def test_clients_past_the_slots_are_listed_from_the_hash(bits: int) -> None:
    """Two slots (bits 1) for six clients: those whose slot is held go to the hash, and a listing
    reads both; with no slots (a kernel without BPF atomics) every client is in the hash. Closes
    and an unwatched port take them out of either, and a sock_diag walk does not copy them."""
    source = BpfConnEventSource([], host="probe-test", client_slot_bits=bits)
    source.start()
    try:
        server = listener()
        source.set_ports([port_of(server)])
        pairs = []
        for _ in range(6):
            client = socket.create_connection(("127.0.0.1", port_of(server)))
            pairs.append((client, server.accept()[0]))
        listed = source.clients([port_of(server)])
        assert listed is not None
        assert sorted(p for _a, p, _r, _s in listed[port_of(server)]) == sorted(port_of(c) for c, _ in pairs)
        # A walk that finds clients the program has listed already (accepted as the port was being
        # watched) adds none of them twice: a copy in the hash would outlive its close.
        source._add_connected(frozenset([port_of(server)]))
        for client, end in pairs[:3]:
            client.close()
            end.close()
        deadline = time.monotonic() + 5
        while len(source.clients([port_of(server)])[port_of(server)]) != 3:  # type: ignore[index]
            assert time.monotonic() < deadline, "closed clients stayed listed"
            time.sleep(0.01)
        listed = source.clients([port_of(server)])
        assert listed is not None
        assert sorted(p for _a, p, _r, _s in listed[port_of(server)]) == sorted(port_of(c) for c, _ in pairs[3:])
        source.set_ports([])  # unwatched: their entries go, wherever they were
        assert source.clients([port_of(server)]) == {port_of(server): ()}
        source.set_ports([port_of(server)])  # watched again: seeded from sock_diag into the hash
        listed = source.clients([port_of(server)])
        assert listed is not None and len(listed[port_of(server)]) == 3
        for client, end in pairs[3:]:
            client.close()
            end.close()
        server.close()
    finally:
        source.stop()


@pytest.mark.parametrize("bits", [0, 12])  # every client in the hash; in the slots (both prebuilt)
def test_one_client_port_to_two_server_addresses_is_two_clients(bits: int) -> None:
    """A gateway holding a connection to each of two pods of one port from one address may be given
    one source port for both (Linux picks source ports per destination): two clients with the same
    address and port, told apart only by the server's address. Both are listed, each close takes
    out its own and not the other's, and the walk that seeds a newly watched port keeps both."""
    source = BpfConnEventSource([], host="probe-test", client_slot_bits=bits)
    source.start()
    try:
        server = listener(host="0.0.0.0")
        port = port_of(server)
        source.set_ports([port])

        def pair() -> list[tuple[socket.socket, socket.socket]]:
            ends = []
            for server_address in ("127.0.0.1", "127.0.0.2"):
                client = socket.socket()
                client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                client.bind(("127.0.0.1", port_of(ends[0][0]) if ends else 0))
                client.connect((server_address, port))
                ends.append((client, server.accept()[0]))
            return ends

        def listed() -> list[tuple[str, int, str]]:
            found = source.clients([port])
            assert found is not None
            return sorted((address, client_port, server) for address, client_port, _read, server in found[port])

        ends = pair()
        client_port = port_of(ends[0][0])
        assert listed() == [("127.0.0.1", client_port, "127.0.0.1"), ("127.0.0.1", client_port, "127.0.0.2")]
        # The first pod's connection closes first: the second's stays listed.
        for (client, end), left in zip(ends, ([("127.0.0.1", client_port, "127.0.0.2")], []), strict=True):
            client.close()
            end.close()
            deadline = time.monotonic() + 5
            while listed() != left:
                assert time.monotonic() < deadline, f"listed after a close: {listed()}, not {left}"
                time.sleep(0.01)
        ends = pair()
        source.set_ports([])
        source.set_ports([port])  # watched again: both seeded from sock_diag
        assert [client[:2] for client in listed()] == [("127.0.0.1", port_of(ends[0][0]))] * 2
        for client, end in ends:
            client.close()
            end.close()
        server.close()
    finally:
        source.stop()


def connect_and_close(server: socket.socket) -> int:
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    client_port = port_of(client)
    client.close()
    accepted.close()
    return client_port


def test_ports_outside_the_filter_are_ignored_and_the_filter_changes_live(probe: Probe) -> None:
    watched, other = listener(), listener()
    probe.source.set_ports([port_of(watched)])

    def round_trip() -> tuple[int, int]:
        """One connection to each port; returns once the watched one has been reported."""
        watched_client = connect_and_close(watched)
        other_client = connect_and_close(other)
        probe.wait_closed(port_of(watched), watched_client)
        # Both sockets closed at once; the other port's events (if any) are queued by now.
        probe.wait_for(lambda _: False, timeout_s=0.1)
        return watched_client, other_client

    # By client port: the probe is the module's, and an earlier test's listener may have had a port
    # number of these, its connections' events in the list too.
    _, other_client = round_trip()
    assert probe.of(port_of(other), other_client) == []

    probe.source.set_ports([port_of(watched), port_of(other)])  # no reload
    _, other_client = round_trip()
    assert probe.wait_closed(port_of(other), other_client) == [PEER_FIN, CLOSED]

    probe.source.set_ports([port_of(watched)])
    _, other_client = round_trip()
    assert probe.of(port_of(other), other_client) == []
    watched.close()
    other.close()


def test_loopback_clients_of_the_watched_port_are_not_reported(probe: Probe) -> None:
    server = listener()
    probe.source.set_ports([port_of(server)])
    client_port = connect_and_close(server)
    probe.wait_closed(port_of(server), client_port)
    # Only the server side: every event has the watched port as its server port.
    assert all(e.server_port == port_of(server) for e in probe.of(port_of(server)))
    assert not [e for e in probe.events if e.client_port == port_of(server)]
    server.close()


def test_a_clients_leaving_wakes_the_reader_at_once_and_at_most_once_a_tenth_of_a_second(probe: Probe) -> None:
    """A few records do not wake a sleeping reader (it waits for a batch or its timeout), but a
    client's FIN does, unless another departure woke it within 100 ms (DEPARTURE_WAKEUP_NS):
    that one waits for the reader's timeout, or the next departure after the 100 ms."""
    server = listener()
    probe.source.set_ports([port_of(server)])

    def poll_across_a_fin(timeout_s: float, drain: bool) -> tuple[list[ConnEvent], float, int]:
        """Connect, then half-close while a reader sleeps in poll: what it returned, how long after
        the FIN, and the client's port."""
        client = socket.create_connection(("127.0.0.1", port_of(server)))
        accepted, _ = server.accept()
        if drain:  # what earlier tests left (a connection's opening makes no record)
            probe.wait_for(lambda _: False, timeout_s=0.05)
        found: list[tuple[list[ConnEvent], float]] = []
        reader = threading.Thread(target=lambda: found.append((probe.source.poll(timeout_s=timeout_s),
                                                               time.monotonic())))
        reader.start()
        time.sleep(0.01)  # the reader sleeps in its poll
        fin_at = time.monotonic()
        client.shutdown(socket.SHUT_WR)
        reader.join()
        client_port = client.getsockname()[1]
        threading.Timer(1.0, lambda: (client.close(), accepted.close())).start()
        events, returned_at = found[0]
        probe.events += events
        return events, returned_at - fin_at, client_port

    time.sleep(0.15)  # no departure woke the reader within DEPARTURE_WAKEUP_NS
    events, after_s, client_port = poll_across_a_fin(timeout_s=3.0, drain=True)
    assert after_s < 1.0, f"the reader slept {after_s:.2f} s past the FIN"
    assert PEER_FIN in [e.kind for e in events if e.client_port == client_port]
    # At once again, within the 100 ms: this FIN waits for the timeout (unless this CPU's batch of
    # WAKEUP_EVERY records happens to fill with it).
    events, after_s, client_port = poll_across_a_fin(timeout_s=0.6, drain=False)
    assert after_s > 0.4, f"a second departure within 100 ms woke the reader {after_s * 1000:.0f} ms after it"
    assert PEER_FIN in [e.kind for e in probe.wait_for(lambda _: False, timeout_s=0.1) if e.client_port == client_port]
    server.close()


@pytest.mark.timeout(120)
def test_burst_of_20000_connections_loses_nothing(probe: Probe) -> None:
    total = 20_000
    server = listener(backlog=4096)
    port = port_of(server)
    probe.source.set_ports([port])
    lost_before = probe.source.lost_events()
    stop = threading.Event()
    # The kernel's truth is the connections the server accepted: on loopback a client's final ACK
    # and its reset can take two CPUs' queues and cross, and a reset that reaches the connection
    # while it is still a request (before the ACK made it a socket) resets no socket, so no probe
    # can report it. Seen once in many CI runs; such a connection is never accepted.
    accepted_peers: list[int] = []  # appended by the acceptor only

    def accept_and_close() -> None:
        # Close only after the client's reset has arrived: the server never closes first, and
        # the reset closed the socket already, so every connection is exactly one peer_rst.
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted, peer = server.accept()
            except OSError:
                continue
            accepted_peers.append(peer[1])
            accepted.settimeout(5)
            with contextlib.suppress(OSError):
                accepted.recv(1)
            accepted.close()

    acceptor = threading.Thread(target=accept_and_close, daemon=True)
    acceptor.start()
    client_ports: Counter[int] = Counter()
    try:
        for _ in range(total):
            client = socket.create_connection(("127.0.0.1", port))
            client_ports[port_of(client)] += 1
            reset_on_close(client)  # no TIME_WAIT: 20,000 connections cannot exhaust ports
            client.close()
            if len(client_ports) % 2000 == 0:
                probe.events += probe.source.poll(timeout_s=0)
        deadline = time.monotonic() + 30
        while len(accepted_peers) < total and time.monotonic() < deadline:
            before = len(accepted_peers)
            probe.events += probe.source.poll(timeout_s=0)
            time.sleep(0.5)
            if len(accepted_peers) == before:
                break  # the accept queue is drained: whatever is left never became a socket
        probe.wait_for(
            lambda _: sum(e.kind == PEER_RST and e.client_port in client_ports for e in probe.of(port))
            >= len(accepted_peers),
            timeout_s=30)
        probe.wait_for(lambda _: False, timeout_s=0.3)
    finally:
        stop.set()
        acceptor.join(timeout=2)
        server.close()

    mine = [e for e in probe.of(port) if e.client_port in client_ports]  # not an earlier listener's
    accepted_ports = Counter(accepted_peers)
    assert probe.source.lost_events() == lost_before == 0
    # Nearly every connection became a socket; a crossing is rare (a handful would be a fault).
    assert accepted_ports.total() >= total - total // 1000, (accepted_ports.total(), total)
    assert not accepted_ports - client_ports  # nothing accepted that no client here opened
    assert Counter(e.client_port for e in mine if e.kind == PEER_RST) == accepted_ports
    # A reset's own close is not reported, but where the kernel splits the two (a reset taken from
    # the socket's backlog in process context, then preempted or moved) it is, by design: a record
    # too many, never one missing (probes/disconnect.bpf.c). Seen twice in about fifteen runs here.
    resets = {(e.client_port, e.cookie): e.ts_ns for e in mine if e.kind == PEER_RST}
    extra = [e for e in mine if e.kind != PEER_RST]
    # Each the close of a connection whose reset came first. Should another kind appear, say all
    # that is known of its port: how often a client here used it, how often the server accepted it,
    # and every event on it, in order.
    odd = [e for e in extra if not (e.kind == CLOSED and resets.get((e.client_port, e.cookie), e.ts_ns + 1) <= e.ts_ns)]
    assert not odd, [(e, client_ports[e.client_port], accepted_ports[e.client_port],
                      [(x.kind, x.cookie, x.ts_ns - e.ts_ns) for x in mine if x.client_port == e.client_port])
                     for e in odd]
    assert len(extra) <= total // 1000, len(extra)


def test_a_full_ring_buffer_counts_every_lost_event() -> None:
    # A one-page ring buffer holds 64 records; nobody reads it while 150 connections close.
    server = listener()
    tiny = BpfConnEventSource([port_of(server)], ringbuf_pages=1)
    tiny.start()
    try:
        for _ in range(150):
            connect_and_close(server)
        received: list[ConnEvent] = []
        while batch := tiny.poll(timeout_s=0.2):
            received += batch
        lost = tiny.lost_events()
        assert lost > 0
        assert len(received) + lost == 300  # peer_fin and closed for each: all accounted for
    finally:
        tiny.stop()
        server.close()
    assert tiny.lost_events() == lost  # still readable after stop


def test_the_configured_ring_buffer_is_what_the_reader_maps() -> None:
    """The whole ring buffer is mapped into the reader and counts in its RSS: its size is the
    configured one (``probe.ring_buffer_mib``), mapped once (libbpf maps the data area twice)."""
    config = Config()
    config.probe.ring_buffer_mib = 2
    server = listener()
    source = open_source([port_of(server)], prefer="bpf", ringbuf_pages=config.probe.ring_buffer_pages)
    source.start()
    try:
        sizes = []
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                start_end, *rest = line.split(maxsplit=5)
                if "-" in start_end and rest and "bpf-map" in line:
                    start, end = (int(x, 16) for x in start_end.split("-"))
                    sizes.append(end - start)
        assert 2 * 2**20 + mmap.PAGESIZE in sizes  # the producer page, then the data area once
    finally:
        source.stop()
        server.close()


def test_events_from_the_kernel_land_in_the_store(probe: Probe, store: Store) -> None:
    server = listener()
    probe.source.set_ports([port_of(server)])
    client_ports = [connect_and_close(server) for _ in range(5)]
    probe.wait_for(lambda _: all(CLOSED in probe.kinds(port_of(server), p) for p in client_ports))
    # The probe is the module's: an earlier test's listener may have had this port number, and its
    # connections' events are in the list too. Only this test's connections go to the store.
    writer = ConnEventWriter(store, batch_size=4)
    writer.add([event for event in probe.of(port_of(server)) if event.client_port in client_ports])
    writer.close()
    rows = list(store.conn_events())
    assert sorted((r.client_port, r.kind.value) for r in rows) == sorted(
        (p, k) for p in client_ports for k in ("peer_fin", "closed"))
    assert all(r.cookie is not None and r.cookie > 0 and r.source == "bpf" for r in rows)
    server.close()


def test_undecoded_runs_store_the_same_events_as_decoding_them(store: Store) -> None:
    """The daemon's path: the ring's records stored as they were (format 2) read back as the
    events ``poll`` decodes from the same kind of traffic, wall-clock times and all."""
    server = listener()
    port = port_of(server)
    source = BpfConnEventSource([port], host="runs")  # the default loader: child, mapped
    assert source.reads_runs  # bcc's struct event is the layout the store keeps
    source.start()
    try:
        before = time.time_ns()
        client_ports = [connect_and_close(server) for _ in range(5)]
        writer = ConnEventWriter(store, batch_size=4)
        deadline = time.monotonic() + 5
        while writer.written + writer.pending < 10 and time.monotonic() < deadline:
            runs = source.poll_runs(timeout_s=0.05)
            assert all(run.stride == 64 and len(run.records) == 64 * run.record_count for run in runs)
            writer.add(runs)
        writer.close()
        after = time.time_ns()
    finally:
        source.stop()
        server.close()
    events = [event for event in store.conn_events(host="runs") if event.server_port == port]
    assert sorted((e.client_port, e.kind.value) for e in events) == sorted(
        (p, k) for p in client_ports for k in ("peer_fin", "closed"))
    assert all(before <= e.ts_ns <= after and e.cookie and e.family == 4 and e.client_addr == "127.0.0.1"
               and e.source == "bpf" and e.earliest_ns is None for e in events)


def test_bad_port_sets_are_refused_and_the_filter_is_kept(probe: Probe) -> None:
    server = listener()
    probe.source.set_ports([port_of(server)])
    with pytest.raises(ConfigError, match="at most 1024"):
        probe.source.set_ports(range(1, 1100))
    with pytest.raises(ConfigError, match="is not a TCP port"):
        probe.source.set_ports([port_of(server), 0])
    assert probe.source.ports == {port_of(server)}
    client_port = connect_and_close(server)
    assert probe.wait_closed(port_of(server), client_port) == [PEER_FIN, CLOSED]
    server.close()
