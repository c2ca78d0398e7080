"""The unprivileged fallback source: real sockets, real sock_diag and /proc/net/tcp{,6}, no BPF.

Most tests drive ``scan()`` by hand so each step is one snapshot; one test runs the 20 Hz poller.
The socket tests run with both readers: netlink sock_diag and /proc/net/tcp parsing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from auditor.errors import ConfigError
from auditor.model import ConnEventKind
from probes import open_source
from probes.procfs import ProcfsConnEventSource, parse_proc_net_tcp

REPO = Path(__file__).resolve().parents[1]
PEER_FIN, PEER_RST, LOCAL_FIN, CLOSED = (ConnEventKind.PEER_FIN, ConnEventKind.PEER_RST,
                                         ConnEventKind.LOCAL_FIN, ConnEventKind.CLOSED)


def listener(family: int = socket.AF_INET, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(16)
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


@pytest.fixture
def server() -> Iterator[socket.socket]:
    sock = listener()
    yield sock
    sock.close()


@pytest.fixture(params=["sock_diag", "/proc/net/tcp"])
def reader(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def kinds_for(events: list, client_port: int) -> list[ConnEventKind]:
    return [e.kind for e in events if e.client_port == client_port]


def test_client_fin_then_server_close(server: socket.socket, reader: str) -> None:
    source = ProcfsConnEventSource([port_of(server)], host="h", sock_diag=reader == "sock_diag")
    assert source.reader == reader
    assert source.scan() == []  # baseline
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client_port = port_of(client)
    assert source.scan() == []  # an open connection is not an event
    client.close()
    events = source.scan()
    assert kinds_for(events, client_port) == [PEER_FIN]
    fin = events[0]
    assert (fin.family, fin.client_addr, fin.server_addr, fin.server_port) == (
        4, "127.0.0.1", "127.0.0.1", port_of(server))
    assert fin.source == "procfs" and fin.host == "h" and fin.cookie
    accepted.close()
    assert kinds_for(source.scan(), client_port) == [CLOSED]


def test_client_reset_reads_as_peer_rst(server: socket.socket, reader: str) -> None:
    source = ProcfsConnEventSource([port_of(server)], sock_diag=reader == "sock_diag")
    source.scan()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    source.scan()
    client_port = port_of(client)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    assert kinds_for(source.scan(), client_port) == [PEER_RST]
    accepted.close()


def test_server_closing_first_is_a_local_fin(server: socket.socket, reader: str) -> None:
    source = ProcfsConnEventSource([port_of(server)], sock_diag=reader == "sock_diag")
    source.scan()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    source.scan()
    client_port = port_of(client)
    accepted.close()
    assert kinds_for(source.scan(), client_port) == [LOCAL_FIN]
    client.close()  # the server socket goes to TIME_WAIT: its full socket is gone, as the
    # probe reports it: nothing after the local_fin
    assert kinds_for(source.scan(), client_port) == []


def test_both_sides_closing_within_one_interval_is_not_a_reset(server: socket.socket, reader: str) -> None:
    source = ProcfsConnEventSource([port_of(server)], sock_diag=reader == "sock_diag")
    source.scan()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    source.scan()
    client_port = port_of(client)
    accepted.close()
    client.close()  # the server's socket is in TIME_WAIT, which a sock_diag dump leaves out
    assert kinds_for(source.scan(), client_port) == [LOCAL_FIN]


def test_ipv6_and_the_filter(reader: str) -> None:
    server6 = listener(socket.AF_INET6, "::1")
    unwatched = listener()
    source = ProcfsConnEventSource([port_of(server6)], sock_diag=reader == "sock_diag")
    source.scan()
    client6 = socket.create_connection(("::1", port_of(server6)))
    other = socket.create_connection(unwatched.getsockname())
    accepted6, _ = server6.accept()
    accepted_other, _ = unwatched.accept()
    source.scan()
    client6_port = port_of(client6)
    client6.close()
    other.close()
    events = source.scan()
    assert [(e.kind, e.family, e.client_addr, e.server_addr, e.client_port) for e in events] == [
        (PEER_FIN, 6, "::1", "::1", client6_port)]
    for sock in (accepted6, accepted_other, server6, unwatched):
        sock.close()


def test_added_port_starts_from_a_baseline_and_removed_port_goes_quiet(reader: str) -> None:
    first, second = listener(), listener()
    source = ProcfsConnEventSource([port_of(first)], sock_diag=reader == "sock_diag")
    source.scan()
    # A connection to `second` that was already half-closed before it was watched: history.
    old = socket.create_connection(second.getsockname())
    old_accepted, _ = second.accept()
    old.close()
    source.set_ports([port_of(first), port_of(second)])
    assert source.scan() == []
    fresh = socket.create_connection(second.getsockname())
    fresh_accepted, _ = second.accept()
    source.scan()
    fresh_port = port_of(fresh)
    fresh.close()
    assert kinds_for(source.scan(), fresh_port) == [PEER_FIN]
    source.set_ports([port_of(first)])
    fresh_accepted.close()
    old_accepted.close()
    assert source.scan() == []
    for sock in (first, second):
        sock.close()


def test_poller_thread_delivers_through_poll_within_the_interval(server: socket.socket) -> None:
    source = open_source([port_of(server)], prefer="procfs", poll_hz=20)
    assert source.name == "procfs"
    source.start()
    try:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        time.sleep(0.12)  # let the poller see it open
        client_port = port_of(client)
        before = time.time_ns()
        client.close()
        after = time.time_ns()
        events: list = []
        deadline = time.monotonic() + 3
        while PEER_FIN not in kinds_for(events, client_port) and time.monotonic() < deadline:
            events += source.poll(timeout_s=0.02)
        received = time.time_ns()
        fin = next(e for e in events if e.kind == PEER_FIN and e.client_port == client_port)
        # The event is the interval between the last poll that saw the socket open and the first
        # that saw it closed: it holds the close, and ends no later than the hand-over.
        assert fin.earliest_ns is not None
        assert fin.earliest_ns <= after and before <= fin.ts_ns <= received
        assert fin.ts_ns - fin.earliest_ns < 1_000_000_000
        assert received - before < 1_000_000_000
        assert source.lost_events() == 0
        accepted.close()
    finally:
        source.stop()


def test_auto_falls_back_and_says_what_is_lost(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "bcc", None)  # bcc not importable, for real
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", tmp_path / "missing.json")  # nor a prebuilt probe
    with caplog.at_level(logging.WARNING):
        source = open_source([8000], prefer="auto")
    assert source.name == "procfs"
    text = caplog.text
    assert "timing precision" in text and "FIN vs RST" in text


def test_bad_ports_and_sources_are_config_errors() -> None:
    for ports in ([0], [65536], ["8000"], [True]):
        with pytest.raises(ConfigError, match="is not a TCP port"):
            open_source(ports, prefer="procfs")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="auto, bpf, procfs"):
        open_source([8000], prefer="kprobe")
    source = ProcfsConnEventSource([8000])
    with pytest.raises(ConfigError):
        source.set_ports([-1])


def test_parser_decodes_both_families_and_skips_garbage() -> None:
    v4 = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
          "   0: 0100007F:1F40 0100007F:D431 08 00000000:00000000 00:00000000 00000000     0        0 4242 1\n"
          "   1: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1\n"
          "   2: garbage line\n"
          "   3: 0100007F:ZZZZ 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 9 1\n")
    parsed = parse_proc_net_tcp(v4, 4, frozenset({8000}))
    assert list(parsed) == [(4, "127.0.0.1", 8000, "127.0.0.1", 0xD431)]
    assert parsed[(4, "127.0.0.1", 8000, "127.0.0.1", 0xD431)].cookie == 4242
    v6 = ("  sl  local_address                         remote_address                        st\n"
          "   0: 00000000000000000000000001000000:1F40 0000000000000000FFFF00000100007F:9C40 "
          "01 00000000:00000000 00:00000000 00000000     0        0 99 1\n")
    parsed6 = parse_proc_net_tcp(v6, 6, frozenset({8000}))
    assert list(parsed6) == [(6, "::1", 8000, "::ffff:127.0.0.1", 0x9C40)]


@pytest.mark.parametrize("one_walk", [True, False])
def test_sock_diag_filters_by_port_in_the_kernel(one_walk: bool) -> None:
    from probes.sockdiag import SockDiag

    watched, other = listener(), listener()
    clients = [socket.create_connection(("127.0.0.1", port_of(s))) for s in (watched, other)]
    accepted = [watched.accept()[0], other.accept()[0]]
    diag = SockDiag()
    diag._one_walk = one_walk
    try:
        # Many ports make a long filter program; the kernel must accept it and keep only these.
        ports = frozenset({port_of(watched), *range(20000, 20200)})
        found = list(diag.sockets(ports))
        assert [(key[2], key[4], state) for key, state, *_ in found] == \
            [(port_of(watched), port_of(clients[0]), 1)]
        assert found[0][2] > 0  # the socket inode, as /proc/net/tcp shows it
        assert diag._one_walk is one_walk
    finally:
        diag.close()
        for sock in [*clients, *accepted, watched, other]:
            sock.close()


def test_sock_diag_dump_leaves_time_wait_to_a_lookup_of_the_one_socket(server: socket.socket) -> None:
    from probes.sockdiag import SockDiag

    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    key = (4, "127.0.0.1", port_of(server), "127.0.0.1", port_of(client))
    diag = SockDiag()
    try:
        assert [(k, state) for k, state, *_ in diag.sockets(frozenset({port_of(server)}))] == [(key, 1)]
        assert diag.state_of(key) == 1
        accepted.close()
        client.close()
        deadline = time.monotonic() + 5  # the last ACK crosses loopback in microseconds
        while diag.state_of(key) != 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert diag.state_of(key) == 6  # TIME_WAIT
        assert list(diag.sockets(frozenset({port_of(server)}))) == []
        assert diag.state_of((4, "127.0.0.1", port_of(server), "127.0.0.1", 1)) is None
    finally:
        diag.close()


class FixedOpens:
    """A TcpAccepts that changes only when the test says a connection was accepted."""

    def __init__(self) -> None:
        self.value = 0

    def read(self) -> int:
        return self.value

    def close(self) -> None:
        pass


def counting_source(port: int) -> tuple[ProcfsConnEventSource, FixedOpens, list, list]:
    """A sock_diag source whose TCP open counters move only when the test says, counting its dumps
    and its lookups of the sockets it knows."""
    source = ProcfsConnEventSource([port], sock_diag=True)
    opens = FixedOpens()
    source._accepts = opens  # type: ignore[assignment]
    assert source._diag is not None
    dumps: list = []
    lookups: list = []
    dump, look = source._diag.sockets, source._diag.still_listed
    source._diag.sockets = lambda ports, info=False: dumps.append(ports) or dump(ports, info)  # type: ignore[method-assign]
    source._diag.still_listed = lambda keys: lookups.append(dict(keys)) or look(keys)  # type: ignore[method-assign]
    return source, opens, dumps, lookups


def test_no_connection_opened_means_known_sockets_are_asked_about_not_dumped(server: socket.socket) -> None:
    from probes.sockdiag import TcpAccepts

    real = TcpAccepts()
    before = real.read()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    after = real.read()
    real.close()
    assert before is not None and after is not None and after >= before + 1  # the listener's accept

    source, opens, dumps, _ = counting_source(port_of(server))
    source.scan()  # the baseline: a dump
    opens.value += 2
    second = socket.create_connection(server.getsockname())
    second_accepted, _ = server.accept()
    assert source.scan() == [] and len(dumps) == 2  # a connection was opened: a dump finds it
    client_port = port_of(client)
    client.close()
    second.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    second.close()
    events = source.scan()
    assert len(dumps) == 2  # nothing opened: the two known sockets were looked up, not dumped
    assert kinds_for(events, client_port) == [PEER_FIN]
    assert [e.kind for e in events if e.client_port != client_port] == [PEER_RST]
    accepted.close()
    assert kinds_for(source.scan(), client_port) == [CLOSED] and len(dumps) == 2
    second_accepted.close()
    source.stop()


def test_outgoing_connections_cost_no_walk_and_an_accepted_one_does(server: socket.socket) -> None:
    """The real counter: a connect to a closed port is an active open only (the host calling out),
    and no socket on a watched port can come of it; a connection the watched listener accepts is a
    passive open, and a dump finds it."""
    from probes.sockdiag import TcpAccepts

    closed = socket.create_server(("127.0.0.1", 0))
    refused_port = port_of(closed)
    closed.close()
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    assert isinstance(source._accepts, TcpAccepts) and source._diag is not None
    dumps: list = []
    dump = source._diag.sockets
    source._diag.sockets = lambda ports, info=False: dumps.append(ports) or dump(ports, info)  # type: ignore[method-assign]
    source.scan()
    for _ in range(3):
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", refused_port)):
            pass
        assert source.scan() == []
    assert len(dumps) == 1  # three calls out, no walk
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    source.scan()
    assert len(dumps) == 2 and [key[4] for key in source._seen] == [port_of(client)]
    client.close()
    accepted.close()
    source.stop()


def test_an_idle_port_costs_no_dump_and_a_new_connection_is_still_seen(server: socket.socket) -> None:
    source, opens, dumps, lookups = counting_source(port_of(server))
    source.scan()  # the baseline: a dump, which lists nothing
    for _ in range(5):
        assert source.scan() == []
    assert len(dumps) == 1 and not any(lookups)  # idle: no dump, and no socket to look up
    idle_scan_ns = source._last_scan_ns
    assert idle_scan_ns is not None
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    opens.value += 2
    client_port = port_of(client)
    client.close()
    events = source.scan()  # opened and closed by the client since the last idle scan
    assert len(dumps) == 2
    assert kinds_for(events, client_port) == [PEER_FIN]
    assert events[0].earliest_ns == idle_scan_ns  # the interval starts at the last idle scan
    accepted.close()
    source.stop()


def test_the_poller_stops_within_a_check_at_a_slow_rate(server: socket.socket) -> None:
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True, poll_hz=0.2)  # a scan every 5 s
    source.start()
    time.sleep(0.1)
    started = time.monotonic()
    source.stop()
    assert source._thread is not None and not source._thread.is_alive()
    assert time.monotonic() - started < 0.25 + 0.2


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_daemons_own_connections_are_left_out_and_cost_no_lookup(family: int, reader: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon scrapes its engine over 127.0.0.1; a dual-stack engine's end names it v4-mapped.
    server = listener(family, "127.0.0.1" if family == socket.AF_INET else "::")
    source = ProcfsConnEventSource([port_of(server)], sock_diag=reader == "sock_diag")
    opens = FixedOpens()
    if reader == "sock_diag":
        source._accepts = opens  # type: ignore[assignment]
        assert source._diag is not None
        looked, lookups = source._diag.still_listed, []
        source._diag.still_listed = lambda keys: lookups.append(dict(keys)) or looked(keys)  # type: ignore[method-assign]
    source.scan()
    own = socket.create_connection(("127.0.0.1", port_of(server)))
    own_accepted, _ = server.accept()
    opens.value += 2
    source.scan()  # seen before the scraper says it is its own
    source.set_own_endpoints({(*own.getsockname()[:2], port_of(server), "127.0.0.1")})
    client = socket.create_connection(("127.0.0.1", port_of(server)))
    accepted, _ = server.accept()
    opens.value += 2
    assert source.scan() == []
    assert [key[4] for key in source._seen] == [port_of(client)]  # the scrape's socket is not listed
    client_port = port_of(client)
    client.close()
    own.close()  # the scraper closes too, and says so
    source.set_own_endpoints(set())
    events = source.scan()
    assert [(e.kind, e.client_port) for e in events] == [(PEER_FIN, client_port)]
    accepted.close()
    own_accepted.close()
    assert [e.client_port for e in source.scan()] == [client_port]  # its server end closed: only the client's
    if reader == "sock_diag":
        lookups.clear()
        for _ in range(3):
            assert source.scan() == []
        assert lookups and not any(lookups)  # nothing left to look up: the idle poll
    source.stop()
    server.close()


def test_a_closed_own_connection_is_left_out_only_for_a_while(server: socket.socket,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    source = ProcfsConnEventSource([port_of(server)])
    source.set_own_endpoints({("127.0.0.1", 40001, 8000, "127.0.0.1"), ("::1", 40002, 8000, "::1")})
    assert source._own_now() == {("127.0.0.1", 40001, 8000, "127.0.0.1"), ("::1", 40002, 8000, "::1"),
                                 ("::ffff:127.0.0.1", 40001, 8000, "::ffff:127.0.0.1")}
    monkeypatch.setattr("probes.procfs.OWN_LINGER_S", 0.05)
    source.set_own_endpoints({("::1", 40002, 8000, "::1")})
    assert ("127.0.0.1", 40001, 8000, "127.0.0.1") in source._own_now()  # closed just now: still left out
    time.sleep(0.06)
    assert source._own_now() == {("::1", 40002, 8000, "::1")}
    source.stop()


def test_a_client_of_another_port_is_watched_on_an_own_local_port(reader: str) -> None:
    # The daemon's scrape of one engine and a client of another engine may share a local port (the
    # kernel picks ephemeral ports by destination): only the scrape is the daemon's.
    scraped, other = listener(), listener()
    source = ProcfsConnEventSource([port_of(scraped), port_of(other)], sock_diag=reader == "sock_diag")
    source.scan()
    client = socket.create_connection(("127.0.0.1", port_of(other)))
    accepted, _ = other.accept()
    source.set_own_endpoints({("127.0.0.1", port_of(client), port_of(scraped), "127.0.0.1")})
    assert source.scan() == []
    assert [key[4] for key in source._seen] == [port_of(client)]
    client_port = port_of(client)
    client.close()
    assert [(e.kind, e.client_port, e.server_port) for e in source.scan()] == [(PEER_FIN, client_port, port_of(other))]
    accepted.close()
    source.stop()
    scraped.close()
    other.close()


def test_a_client_of_another_server_on_the_port_is_watched_on_an_own_local_port(reader: str) -> None:
    # Two pods of a node serve one port number, and the daemon's scrape of one and a client of the
    # other leave from one address and local port (Linux picks source ports per destination): only
    # the scrape is the daemon's, told by the server's address.
    scraped = listener()
    port = port_of(scraped)
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.2", port))
    other.listen(4)
    source = ProcfsConnEventSource([port], sock_diag=reader == "sock_diag")
    source.scan()
    ends = []
    for server in ("127.0.0.1", "127.0.0.2"):
        end = socket.socket()
        end.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        end.bind(("127.0.0.1", ends[0].getsockname()[1] if ends else 0))
        end.connect((server, port))
        ends.append(end)
    own, client = ends
    accepted = [scraped.accept()[0], other.accept()[0]]
    source.set_own_endpoints({(*own.getsockname()[:2], port, "127.0.0.1")})
    assert source.scan() == []
    assert [(key[1], key[4]) for key in source._seen] == [("127.0.0.2", port_of(client))]
    client.close()
    assert [(e.kind, e.client_port, e.server_port) for e in source.scan()] == [(PEER_FIN, port_of(own), port)]
    for sock in (own, *accepted, scraped, other):
        sock.close()
    source.stop()


def test_a_closed_own_connection_is_watched_again_once_its_server_end_is_gone(reader: str) -> None:
    # Loopback reuses an address pair in TIME_WAIT at once: a later client on the scrape's old local
    # port is someone else, and must not wait out the 120 s linger unseen.
    server = listener()
    source = ProcfsConnEventSource([port_of(server)], sock_diag=reader == "sock_diag")
    opens = FixedOpens()
    if reader == "sock_diag":
        source._accepts = opens  # type: ignore[assignment]
    source.scan()
    own = socket.create_connection(("127.0.0.1", port_of(server)))
    own_accepted, _ = server.accept()
    end = (*own.getsockname()[:2], port_of(server), "127.0.0.1")
    source.set_own_endpoints({end})
    opens.value += 1
    source.scan()
    own.close()
    source.set_own_endpoints(set())
    opens.value += 1  # a dump: the server end is still there, in CLOSE_WAIT
    assert source.scan() == []
    assert end in source._own_now()
    own_accepted.close()  # its server end: LAST_ACK, gone once the scrape's end acknowledges
    for _ in range(100):
        opens.value += 1
        assert source.scan() == []  # the own connection's close is never reported
        if end not in source._own_now():
            break
        time.sleep(0.01)
    assert end not in source._own_now()
    source.stop()
    server.close()


# -- the kernel's notices of freed sockets: what no poll lists -------------------------------------
def short_connection(server: socket.socket, how: str) -> tuple[int, int, int]:
    """A connection that sends a request and leaves, its server closing at once (as an asyncio
    server does on EOF or a reset): (client port, ns before the client left, ns after)."""
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    accepted.recv(100)
    client_port = port_of(client)
    if how == "server_first":
        accepted.close()
        client.recv(10)
    before = time.time_ns()
    if how == "rst":
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    after = time.time_ns()
    if how != "server_first":
        with contextlib.suppress(OSError):
            accepted.recv(10)
        accepted.close()
    return client_port, before, after


@pytest.mark.parametrize("how, kinds", [("rst", [PEER_RST]), ("fin", [PEER_FIN, CLOSED]),
                                        ("server_first", [LOCAL_FIN])])
def test_a_connection_no_poll_listed_is_seen_by_its_notice(server: socket.socket, how: str,
                                                           kinds: list[ConnEventKind]) -> None:
    """Open, a request, gone, all between two polls: the kernel's notice of the freed socket makes
    it events, whose interval holds the moment the client left. Its tcp_info tells a reset from
    FINs both ways; TIME_WAIT on the server's end, that the server closed first."""
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    assert source.notices is not None
    source.scan()
    time.sleep(0.02)
    client_port, before, after = short_connection(server, how)
    time.sleep(0.02)
    events = [e for e in source.scan() if e.client_port == client_port]
    assert [e.kind for e in events] == kinds
    for event in events:
        assert event.earliest_ns is not None and event.earliest_ns <= after and before <= event.ts_ns
        assert event.ts_ns <= time.time_ns() and event.ts_ns - event.earliest_ns < 200_000_000
        assert (event.server_port, event.client_addr, event.source) == (port_of(server), "127.0.0.1", "procfs")
    assert source.scan() == []  # once
    source.stop()


def test_fins_both_ways_between_two_polls_are_not_a_reset(server: socket.socket, reader: str) -> None:
    """A poll saw it open; the client's FIN and the server's close both come before the next. Gone
    from the listing, it reads as a reset from /proc/net/tcp; with sock_diag, the notice of its
    free says it ended with FINs both ways, the client's first."""
    source = ProcfsConnEventSource([port_of(server)], sock_diag=reader == "sock_diag")
    source.scan()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client_port = port_of(client)
    source.scan()
    client.close()
    assert accepted.recv(10) == b""
    accepted.close()
    time.sleep(0.02)
    want = [PEER_FIN, CLOSED] if reader == "sock_diag" else [PEER_RST]
    assert kinds_for(source.scan(), client_port) == want
    source.stop()


def test_a_socket_the_server_holds_after_the_client_left_is_reported_once(server: socket.socket,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll saw it open, then gone (the client's reset); the server frees it only later, when it
    closes its end: that notice is no connection unseen. The port is quiet by then (nothing listed,
    nothing accepted), so its notices are read only every QUIET_NOTICES_EVERY_S."""
    import probes.procfs

    monkeypatch.setattr(probes.procfs, "QUIET_NOTICES_EVERY_S", 0.05)
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    source.scan()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client_port = port_of(client)
    source.scan()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    assert kinds_for(source.scan(), client_port) == [PEER_RST]
    accepted.close()
    time.sleep(0.06)
    assert source.scan() == [] and source._held == {}  # its notice came, and was known
    source.stop()


def test_a_socket_freed_just_after_the_snapshot_that_listed_it(server: socket.socket,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed by the snapshot, freed before the notices are read: the notice waits for the next
    scan, which sees the socket gone and narrows its interval with the notice; no second event."""
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    source.scan()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client.sendall(b"x")
    accepted.recv(1)
    client_port = port_of(client)
    source.scan()
    stale = source._snapshot(frozenset({port_of(server)}))  # still lists it open
    before = time.time_ns()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    accepted.close()
    time.sleep(0.02)
    with monkeypatch.context() as patch:
        patch.setattr(source, "_snapshot", lambda ports, listing=False: stale)
        assert source.scan() == []
    assert len(source._early) == 1
    second = time.time_ns()
    events = [e for e in source.scan() if e.client_port == client_port]
    assert [e.kind for e in events] == [PEER_RST] and source._early == {}
    # It ends when the notice was read, before this scan began (the stale one read it).
    assert before <= events[0].ts_ns <= second
    assert source.scan() == []
    source.stop()


def test_notices_of_other_ports_are_not_queued() -> None:
    """The kernel keeps only the watched ports' notices (a classic BPF filter on the local port),
    or every one where there are too many ports for one program: then they are sorted here."""
    from probes.sockdiag import DestroyNotices

    watched, other = listener(), listener()
    for ports in (frozenset({port_of(watched)}), frozenset({port_of(watched), *range(20000, 20300)})):
        notices = DestroyNotices()
        notices.set_ports(ports)
        ends = [short_connection(sock, "rst")[0] for sock in (other, watched)]
        time.sleep(0.02)
        received: list[bytes] = []
        with contextlib.suppress(BlockingIOError):
            while True:
                received.append(notices._sock.recv(1 << 16))
        kept = notices._read(b"".join(received), ports)
        assert [key[4] for key, *_ in kept] == [ends[1]]
        if len(ports) == 1:
            assert len(received) == 1  # the other port's never reached the socket
        else:
            assert len(received) >= 2
        notices.close()
    watched.close()
    other.close()


def test_notices_that_cannot_be_read_are_counted_and_skipped() -> None:
    from probes.sockdiag import MSG_BYTES, DestroyNotices

    notices = DestroyNotices()
    ports = frozenset({8000})
    header = struct.Struct("=IHHII")
    message = bytearray(MSG_BYTES)
    message[0], message[1] = socket.AF_INET, 7
    struct.pack_into(">HH", message, 4, 8000, 40000)
    whole = header.pack(header.size + MSG_BYTES, 20, 0, 0, 0) + bytes(message)  # no tcp_info
    for garbage in (b"", b"\x01", header.pack(3, 20, 0, 0, 0), header.pack(header.size + 4, 20, 0, 0, 0) + b"abcd",
                    header.pack(header.size + MSG_BYTES, 99, 0, 0, 0) + bytes(message), whole,
                    whole[:40], header.pack(10_000, 20, 0, 0, 0) + bytes(message)):
        assert notices._read(garbage, ports) == []
    assert notices.unreadable == 6
    notices.close()


def test_a_connection_between_polls_is_seen_as_an_unprivileged_user(server: socket.socket) -> None:
    """The notices need no privilege: a source run as uid 65534 sees a connection that lived
    between two of its scans."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to become uid 65534) and setpriv")
    script = ("import json, sys\n"
              "from probes.procfs import ProcfsConnEventSource\n"
              f"source = ProcfsConnEventSource([{port_of(server)}], sock_diag=True)\n"
              "assert source.notices is not None\n"
              "source.scan(); print('ready', flush=True); sys.stdin.readline()\n"
              "print(json.dumps([[e.kind.value, e.client_port] for e in source.scan()]), flush=True)\n")
    child = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                              sys.executable, "-c", script], cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        client_port, _, _ = short_connection(server, "rst")
        time.sleep(0.02)
        child.stdin.write("\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == [["peer_rst", client_port]]
    finally:
        child.kill()
        child.wait()


def test_connections_shorter_than_a_poll_are_each_seen_once_with_their_close(server: socket.socket) -> None:
    """The 20 Hz poller and connections of 0-40 ms (a client that sends and leaves at once, as a
    load generator's cancellation delay 0 does): every one is reported once, and its interval
    holds the moment its client left."""
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True, poll_hz=20)
    source.start()
    closes: dict[int, tuple[int, int]] = {}
    try:
        for index in range(40):
            client = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            accepted.recv(100)
            time.sleep((index % 5) * 0.01)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            before = time.time_ns()
            client_port = port_of(client)
            client.close()
            closes[client_port] = (before, time.time_ns())
            with contextlib.suppress(OSError):
                accepted.recv(10)
            accepted.close()
        events: list = []
        deadline = time.monotonic() + 5
        while {e.client_port for e in events} < closes.keys() and time.monotonic() < deadline:
            events += source.poll(timeout_s=0.05)
        events += source.poll(timeout_s=0.2)
    finally:
        source.stop()
    mine = [e for e in events if e.client_port in closes]
    assert sorted(e.client_port for e in mine) == sorted(closes)  # each once
    for event in mine:
        before, after = closes[event.client_port]
        assert event.kind == PEER_RST
        assert event.earliest_ns is not None and event.earliest_ns <= after and before <= event.ts_ns, event


def test_notices_dropped_by_a_full_buffer_are_counted_as_lost(server: socket.socket) -> None:
    """More frees between two polls than the buffer holds: the kernel drops the rest and says so
    (ENOBUFS); the poll counts it, keeps what came, and the next poll reads on."""
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    assert source.notices is not None
    source.notices._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's least: a few
    source.scan()
    ends = [short_connection(server, "rst")[0] for _ in range(40)]
    time.sleep(0.02)
    first = [e.client_port for e in source.scan()]
    assert source.lost_events() >= 1
    assert 0 < len(first) < len(ends) and set(first) <= set(ends)
    last, _, _ = short_connection(server, "rst")
    time.sleep(0.02)
    assert [e.client_port for e in source.scan()] == [last]
    source.stop()
    assert source.lost_events() >= 1  # still told once the notices are closed


def test_a_quiet_port_reads_the_notices_once_a_second_not_every_poll(server: socket.socket) -> None:
    """Nothing listed and nothing accepted: only the daemon's own or held sockets can be freed
    there, so a poll does not ask; a connection accepted makes the next poll a dump, which does."""
    source, opens, dumps, _ = counting_source(port_of(server))
    assert source.notices is not None
    reads: list[float] = []
    take = source.notices.take
    source.notices.take = lambda: reads.append(time.monotonic()) or take()  # type: ignore[method-assign]
    source.scan()  # the baseline: a dump, and a read
    for _ in range(10):
        assert source.scan() == []
    assert len(reads) == 1 and len(dumps) == 1
    opens.value += 1
    client_port, _, _ = short_connection(server, "rst")
    time.sleep(0.02)
    assert kinds_for(source.scan(), client_port) == [PEER_RST]
    assert len(reads) == 2 and len(dumps) == 2
    source.stop()


def test_decoded_socket_ids_are_kept_to_a_bound() -> None:
    """A port taking a connection a request sees a new socket id each time: the ids kept decoded
    stay under DECODED_CACHE_MAX (a few hundred bytes each), and each is decoded right either way."""
    from probes.sockdiag import DECODED_CACHE_MAX, _decoded_key

    decoded: dict = {}
    loopback = socket.inet_pton(socket.AF_INET, "127.0.0.1") + bytes(12)
    for client_port in range(1024, 1024 + DECODED_CACHE_MAX + 10):
        message = bytes([socket.AF_INET, 1, 0, 0]) + struct.pack(">HH", 8000, client_port) + loopback * 2 + bytes(32)
        assert _decoded_key(decoded, message, 0) == (4, "127.0.0.1", 8000, "127.0.0.1", client_port)
        assert len(decoded) <= DECODED_CACHE_MAX


def test_a_listing_of_the_clients_connected_is_a_poll_with_each_ones_last_data(server: socket.socket) -> None:
    """What the engine scraper reads without the eBPF probe: the ESTABLISHED clients of the asked
    ports that are watched, each with when its last data came in (tcp_info), from a poll that
    queues its events like any other."""
    other = listener()
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    assert source.clients([port_of(server)]) is None  # no baseline yet
    source.scan()
    quiet = socket.create_connection(server.getsockname())  # connected, never sends
    quiet_end, _ = server.accept()
    talker = socket.create_connection(server.getsockname())
    talker_end, _ = server.accept()
    time.sleep(0.05)
    sent = time.time_ns()
    talker.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert talker_end.recv(100)
    time.sleep(0.2)
    listed = source.clients([port_of(server), port_of(other)])
    assert listed is not None and set(listed) == {port_of(server)}  # the unwatched port is left out
    by_port = {client_port: last_ns for _address, client_port, last_ns, _server in listed[port_of(server)]}
    assert {server for *_client, server in listed[port_of(server)]} == {"127.0.0.1"}
    assert set(by_port) == {port_of(quiet), port_of(talker)}
    # The kernel's times are jiffies, read in ms: a tick (up to 10 ms) either way.
    assert sent - 20_000_000 <= by_port[port_of(talker)] <= sent + 20_000_000
    assert by_port[port_of(quiet)] < sent - 40_000_000  # its last data (none: the handshake) came before
    talker_port = port_of(talker)
    talker.close()
    time.sleep(0.02)
    listed = source.clients([port_of(server)])
    assert listed is not None
    assert [client_port for _a, client_port, _t, _s in listed[port_of(server)]] == [port_of(quiet)]
    assert kinds_for(source.poll(timeout_s=0), talker_port) == [PEER_FIN]  # the listing was a poll
    for sock in (quiet, quiet_end, talker_end, other):
        sock.close()
    source.stop()
    assert source.clients([port_of(server)]) is None


@contextlib.contextmanager
def clients_in_each_state(server: socket.socket, answer_after_s: float, quiet_s: float) -> Iterator[dict[str, socket.socket]]:
    """Clients of ``server`` that each sent a request, by what the server did since (the client
    ends, by name): ``answered`` got its answer ``answer_after_s`` after its request and has been
    quiet ``quiet_s`` since (kept alive between requests); ``headers`` got a first few bytes at once
    and nothing since (a streamed answer waiting in the queue); ``silent`` got nothing (an answer
    sent whole at its end); ``unread`` was answered, then sent its next request, not read yet;
    ``stalled`` was answered, then sent more than it reads (a stream to a reader that stopped)."""
    names = ("answered", "headers", "silent", "unread", "stalled")
    clients = {name: socket.create_connection(server.getsockname()[:2]) for name in names}
    ends = {name: server.accept()[0] for name in names}  # accepted in the order they connected
    try:
        for name in names:
            clients[name].sendall(b"POST /v1/completions HTTP/1.1\r\n\r\n")
            assert ends[name].recv(100)
        ends["headers"].sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        time.sleep(answer_after_s)
        for name in ("answered", "unread", "stalled"):
            ends[name].sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        for name in ("answered", "headers", "unread", "stalled"):
            assert clients[name].recv(100)
        ends["stalled"].setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # until the client's receive window and the server's send buffer are full
                ends["stalled"].send(b"x" * 65536)
        time.sleep(quiet_s)
        clients["unread"].sendall(b"POST /v1/completions HTTP/1.1\r\n\r\n")
        time.sleep(0.02)
        yield ends
    finally:
        for sock in (*clients.values(), *ends.values()):
            sock.close()


def test_a_client_kept_alive_between_requests_is_not_listed(server: socket.socket,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """tcp_info tells a client the server answered and has been quiet since (it holds no request:
    an SDK's or a gateway's pool between requests) from one whose request the engine still holds:
    one whose answer waits (headers sent at once, or nothing), whose next request came unread, or
    whose stream its reader stopped taking. The scraper's listings leave out the first (sock_diag
    alone, and the /proc source's poll): it would hide an orphan of the port while it stays."""
    from probes import sockdiag

    monkeypatch.setattr(sockdiag, "IDLE_ANSWERED_MS", 100)
    monkeypatch.setattr(sockdiag, "IDLE_QUIET_MS", 200)
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    source.scan()
    lister = sockdiag.ConnectedClients()
    diag = sockdiag.SockDiag()
    try:
        with clients_in_each_state(server, answer_after_s=0.15, quiet_s=0.3) as ends:
            by_port = {end.getpeername()[1]: name for name, end in ends.items()}
            found = diag.established(frozenset({port_of(server)}))[port_of(server)]
            assert {by_port[key[4]]: idle for key, _last_ms, idle in found} == {
                "answered": True, "headers": False, "silent": False, "unread": False, "stalled": False}
            # Asked one socket at a time, as the eBPF probe's listing asks a few: the same answer.
            assert [by_port[key[4]] for key in diag.idle_of(key for key, _last_ms, _idle in found)] == ["answered"]
            for listed in (lister.clients([port_of(server)]), source.clients([port_of(server)])):
                assert listed is not None
                assert sorted(by_port[client[1]] for client in listed[port_of(server)]) == \
                    ["headers", "silent", "stalled", "unread"]
            # Its next request read, the one that came unread holds it: data came after the answer.
            assert ends["unread"].recv(100)
            time.sleep(0.25)
            found = diag.established(frozenset({port_of(server)}))[port_of(server)]
            assert [by_port[key[4]] for key, _last_ms, idle in found if idle] == ["answered"]
    finally:
        diag.close()
        lister.close()
        source.stop()


def test_a_listing_is_complete_unless_its_own_port_took_a_client_since(server: socket.socket) -> None:
    """The namespace counts every port's accepts; asked once that count moved, a poll tells whether
    the listed port itself took a client since the listing: one still connected, or one that came
    and went (the kernel's notice of its freed socket). Another port's accepts leave it complete."""
    elsewhere = listener()  # not watched: a service beside the engine
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True)
    assert source.notices is not None
    assert source.listing_complete(port_of(server)) is None  # nothing listed yet
    source.scan()
    kept = socket.create_connection(server.getsockname())
    kept_end, _ = server.accept()
    held: list[socket.socket] = []

    def listed_then(step: Callable[[], None]) -> bool | None:
        assert source.clients([port_of(server)]) is not None
        before = source.accepted()
        step()
        assert source.accepted() != before  # the namespace's count moved: alone, incomplete
        return source.listing_complete(port_of(server))

    def accept_elsewhere() -> None:
        held.append(socket.create_connection(elsewhere.getsockname()))
        held.append(elsewhere.accept()[0])

    def accept_here() -> None:
        held.append(socket.create_connection(server.getsockname()))
        held.append(server.accept()[0])

    assert listed_then(accept_elsewhere) is True
    assert listed_then(accept_here) is False
    assert listed_then(lambda: short_connection(server, "fin")) is False  # came and went in between
    assert listed_then(accept_elsewhere) is True  # what the last poll saw is no news to the next listing
    for sock in (kept, kept_end, elsewhere, *held):
        sock.close()
    source.stop()


def test_a_listing_stands_for_the_pollers_next_poll(server: socket.socket) -> None:
    """A listing is a poll: the poller's ticks follow on a whole interval after it. Listed more
    often than it polls, the poller makes no poll of its own; listed less often (the engine
    scraper's fixed cadence), each listing takes the place of one of its polls."""
    source = ProcfsConnEventSource([port_of(server)], sock_diag=True, poll_hz=20)  # every 50 ms
    polls: list[bool] = []
    scan = source._scan

    def counted(listing: bool = False) -> list:
        polls.append(listing)
        return scan(listing)

    def list_every(seconds: float, for_s: float) -> None:
        polls.clear()
        tick = time.monotonic()
        while tick < started + for_s:
            assert source.clients([port_of(server)]) is not None
            tick += seconds
            time.sleep(max(0.0, tick - time.monotonic()))

    source._scan = counted  # type: ignore[method-assign]
    source.start()
    try:
        polls.clear()
        time.sleep(2.0)
        alone = polls.count(False)
        assert alone >= 20  # about forty
        started = time.monotonic()
        list_every(0.025, 1.0)
        assert polls.count(True) >= 10
        assert polls.count(False) <= 1  # one already due as the first listing came, at most
        started = time.monotonic()
        list_every(0.25, 2.0)
        listings = polls.count(True)
        assert listings >= 6
        # Kept on their own phase, the polls would be as many as alone, the listings beside them;
        # here four polls and a listing take the time of five polls.
        assert polls.count(False) <= alone - listings // 2, (alone, listings, polls.count(False))
    finally:
        source.stop()
