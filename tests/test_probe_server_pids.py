"""The probe names the process serving a watched port: the one that closes its connections.

The server is a real child process running as another user (uid 65534), the client is this
process (root). On loopback the client's packets are processed in softirq in the client's own
context, so a probe that took the pid on a received FIN, a reset or the final ACK would name this
process: every test checks the child is named, and the reset test that nothing is named at all.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from auditor.model import ConnEventKind
from probes import bpfsys
from probes.bpf import BpfConnEventSource
from probes.handoff import SERVER_KEY
from tests.test_probe_bpf import wait_time_wait

pytestmark = pytest.mark.privileged
NOBODY = 65534

# One listener per "listen", the newest accepted connection is the one "eof" and "close" act on.
SERVER = r"""
import socket, sys
listeners, conns = [], []
for line in sys.stdin:
    word = line.strip()
    reply = "ok"
    if word in ("listen", "listen-any", "listen-dual"):
        if word == "listen-dual":  # IPv6 and IPv4 (as IPv4-mapped addresses) on one socket
            listeners.append(socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True))
        else:
            listeners.append(socket.create_server(("127.0.0.1" if word == "listen" else "0.0.0.0", 0)))
        reply = str(listeners[-1].getsockname()[1])
    elif word == "accept":
        conns.append(listeners[-1].accept()[0])
    elif word == "eof":
        while conns[-1].recv(4096):
            pass
    elif word == "close":
        conns.pop().close()
    print(reply, flush=True)
"""


def python_for_nobody() -> str:
    """An interpreter uid 65534 can run: this one, unless it lives under a directory closed to
    other users (a root-only pyenv); the server needs only the standard library."""
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            if subprocess.run([python, "-c", ""], user=NOBODY, group=NOBODY, extra_groups=[],
                              cwd="/", timeout=30).returncode == 0:
                return python
        except OSError:
            continue
    pytest.skip("no Python interpreter that uid 65534 may run")


class Server:
    """A TCP server in a child process of another user, driven a command at a time."""

    def __init__(self, python: str) -> None:
        self.process = subprocess.Popen([python, "-I", "-c", SERVER], user=NOBODY, group=NOBODY,
                                        extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd="/")
        self.pid = self.process.pid

    def ask(self, command: str) -> str:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline().strip()
        assert reply, f"the server child died on {command!r}"
        return reply

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module", params=["prebuilt", pytest.param("child", marks=pytest.mark.compiles), pytest.param("inprocess", marks=pytest.mark.compiles)])
def source(request: pytest.FixtureRequest) -> Iterator[BpfConnEventSource]:
    probe = BpfConnEventSource([], host="pid-test", loader=request.param)
    probe.start()
    yield probe
    probe.stop()


@pytest.fixture(scope="module")
def python() -> str:
    return python_for_nobody()


@pytest.fixture
def server(python: str) -> Iterator[Server]:
    child = Server(python)
    yield child
    child.stop()


def watched_listener(source: BpfConnEventSource, server: Server, how: str = "listen") -> int:
    """A new listener in the server child, on a port the probe watches (and nothing else does)."""
    port = int(server.ask(how))
    source.set_ports([port])
    return port


def connect(server: Server, port: int, address: str = "127.0.0.1") -> tuple[socket.socket, int]:
    """A client connection the server child has accepted, and the client's port."""
    client = socket.create_connection((address, port))
    server.ask("accept")
    return client, int(client.getsockname()[1])


def wait_event(source: BpfConnEventSource, port: int, client_port: int, kind: ConnEventKind) -> None:
    """Until the probe reports ``kind`` for that connection: the kernel has handled it by then."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(e.server_port == port and e.client_port == client_port and e.kind is kind
               for e in source.poll(timeout_s=0.05)):
            return
    pytest.fail(f"no {kind.value} from the probe for port {port}, client port {client_port}")


def test_the_server_closing_first_names_the_server_not_the_client(source: BpfConnEventSource,
                                                                   server: Server) -> None:
    port = watched_listener(source, server)
    client, client_port = connect(server, port)
    assert source.server_pids() == {}
    server.ask("close")  # ESTABLISHED -> FIN_WAIT1, in the server's close()
    assert source.server_pids() == {port: server.pid}
    client.close()  # the client's FIN reaches the server socket in softirq, in this process
    # FIN_WAIT2 -> CLOSE (into TIME_WAIT) runs here too; the probe reports no event for it
    wait_time_wait(port, client_port)
    source.poll(timeout_s=0.2)
    assert source.server_pids() == {port: server.pid} and server.pid != os.getpid()


def test_a_client_fin_then_the_servers_close_names_the_server(source: BpfConnEventSource,
                                                               server: Server) -> None:
    port = watched_listener(source, server)
    client, client_port = connect(server, port)
    client.shutdown(socket.SHUT_WR)
    server.ask("eof")  # the server socket went ESTABLISHED -> CLOSE_WAIT in this process's softirq
    wait_event(source, port, client_port, ConnEventKind.PEER_FIN)
    assert source.server_pids() == {}
    server.ask("close")  # CLOSE_WAIT -> LAST_ACK, in the server's close()
    assert source.server_pids() == {port: server.pid}
    client.close()
    wait_event(source, port, client_port, ConnEventKind.CLOSED)  # the final ACK: softirq, not recorded
    assert source.server_pids() == {port: server.pid}


def reset(source: BpfConnEventSource, server: Server, port: int) -> None:
    """A connection the client resets; returns once the probe has seen the reset (its move to
    CLOSE follows in the same softirq, unreported)."""
    client, client_port = connect(server, port)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # the reset and the move to CLOSE run in softirq, in this process
    wait_event(source, port, client_port, ConnEventKind.PEER_RST)


def test_a_client_reset_names_nobody_and_keeps_the_server_once_named(source: BpfConnEventSource,
                                                                      server: Server) -> None:
    port = watched_listener(source, server)
    reset(source, server, port)
    server.ask("close")  # closing a socket already reset is no transition of its own
    assert source.server_pids() == {}
    client, _ = connect(server, port)
    server.ask("close")
    client.close()
    assert source.server_pids() == {port: server.pid}
    reset(source, server, port)
    server.ask("close")
    assert source.server_pids() == {port: server.pid}


@pytest.mark.parametrize("how", ["listen-any", "listen-dual"])
def test_the_server_is_named_at_each_local_address_it_was_seen_closing_at(source: BpfConnEventSource,
                                                                          server: Server, how: str) -> None:
    """One listener reached at two local addresses (as a port several containers serve is reached
    at each one's): the process is named at each where it closed a connection, and for the port at
    the lowest. A dual-stack socket's IPv4 clients are IPv4-mapped IPv6 addresses to the kernel,
    named as the IPv4 ones."""
    port = watched_listener(source, server, how)
    for address in ("127.0.0.3", "127.0.0.2"):
        client, _ = connect(server, port, address)
        server.ask("close")
        client.close()
    assert source.server_pids_at() == {port: {"127.0.0.2": server.pid, "127.0.0.3": server.pid}}
    assert source.server_pids() == {port: server.pid}
    # Unwatched, the port's entries at every address go.
    source.set_ports([])
    source.set_ports([port])
    assert source.server_pids_at() == {}


def server_pids_fd(source: BpfConnEventSource) -> int:
    program = source._program
    fds = getattr(program, "fds", None)
    return fds["map:server_pids"] if fds is not None else int(program._server_pids.map_fd)  # type: ignore[union-attr]


def test_values_that_name_no_live_process_are_left_out(source: BpfConnEventSource) -> None:
    exited = subprocess.Popen(["true"])
    exited.wait()
    values = {20001: exited.pid, 20002: 0, 20003: 0xFFFFFFFF, 20004: 1 << 22 | 1, 20005: 1}
    source.set_ports(values)
    fd = server_pids_fd(source)
    for port, pid in {**values, 20006: 1}.items():  # 20006 is not watched
        bpfsys.map_update(fd, SERVER_KEY.pack(port, socket.AF_INET, socket.inet_aton("10.0.0.1")), struct.pack("=I", pid))
    bpfsys.map_update(fd, SERVER_KEY.pack(20005, 99, b""), struct.pack("=I", 1))  # no address family: nobody
    assert source.server_pids() == {20005: 1}
    assert source.server_pids_at() == {20005: {"10.0.0.1": 1}}
    # A port no longer watched loses its entry: watched again, it names nobody until a close.
    source.set_ports([20001])
    source.set_ports([20005])
    assert source.server_pids() == {}
    bpfsys.map_delete(fd, struct.pack("=H", 20006))
