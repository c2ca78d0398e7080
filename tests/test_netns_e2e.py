"""An engine in a network namespace of its own, as in a container on Docker's bridge or in a pod:
its sockets are in that namespace's tables, not the daemon's. The daemon on the host must judge its
cancelled requests against the engine's truth log with either source: the eBPF probe's tracepoints
fire in every namespace; the /proc fallback finds the namespace (probes.netns) and reads its
table. Needs root and iproute2 (ip netns, a veth pair); the clients reach the engine over the veth,
as a container's are routed to it."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from auditor.cli.doctor import check_engine_metrics, check_engines
from auditor.model import READ_UNKNOWN
from auditor.store import Store, VerdictRow
from collectors.listeners import ListenerPids
from probes import procfs
from probes.netns import EngineAddresses, NetNamespaces, ProcessScan
from replay.engine.launch import running_engine
from tests.e2e import (
    GRACE_S,
    cancel_after,
    complete,
    disconnect,
    expected_verdict,
    free_port,
    read_response,
    running_daemon,
    send_request,
    tally_against_truth,
    verdict_rows,
    wait_for,
)
from tests.test_daemon_unprivileged import metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 (ip) to make a network namespace"),
]

HOST_ADDR, ENGINE_ADDR = "10.231.7.1", "10.231.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def joined_namespace(name: str, link: str, host_addr: str, engine_addr: str) -> Iterator[str]:
    """A network namespace joined to this one by a veth pair (a /30): this end at ``host_addr``,
    the namespace's (its eth0) at ``engine_addr``."""
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("addr", "add", f"{host_addr}/30", "dev", link)
        _ip("link", "set", link, "up")
        _ip("-n", name, "addr", "add", f"{engine_addr}/30", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        yield name
    finally:
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace joined to this one by a veth pair: the engine's end at ENGINE_ADDR."""
    with joined_namespace(f"audns{os.getpid()}", f"aud{os.getpid() % 100000}h", HOST_ADDR, ENGINE_ADDR) as name:
        yield name


def test_other_namespaces_listening_are_found(namespace: str) -> None:
    """Found by the port listened on there, not by a port listened on here; gone when its last
    process ends."""
    server = _listen_in(namespace, 8765)
    try:
        with socket.create_server(("127.0.0.1", 0)) as here:
            own_port = here.getsockname()[1]
            spaces = NetNamespaces()
            found = spaces.refresh({8765, own_port, 8766})
            assert set(found) == {8765}, found
            (space,) = found[8765]
            assert space.pid == server.pid and spaces.processes_read > 1
            assert space.address(Path("/proc")) == ENGINE_ADDR
            # Its engine's /metrics is reached there; at the loopback where this namespace listens too.
            assert EngineAddresses(lambda ports: {}).of(8765) == (ENGINE_ADDR,)
            assert EngineAddresses(lambda ports: {8765: {1}}).of(8765) == ("127.0.0.1",)
            # The doctor asks it there too (it listens and answers nothing).
            said = check_engine_metrics([8765], timeout_s=0.3)
            assert said.detail.startswith(f"port 8765 at {ENGINE_ADDR}: /metrics not read ("), said.detail
    finally:
        server.kill()
        server.wait()
    assert NetNamespaces().refresh({8765}) == {}


def test_the_readers_of_other_namespaces_share_one_scan_of_the_processes(namespace: str) -> None:
    """The daemon's three readers of containers' networks each look every 10 s; with one shared
    ``ProcessScan`` a scan younger than its ``reuse_s`` answers all of them, and each still finds
    the namespace; one whose process ended is no longer read through it, whichever scan."""
    server = _listen_in(namespace, 8765)
    clock = [100.0]
    scan = ProcessScan(reuse_s=5.0, monotonic=lambda: clock[0])
    readers = [NetNamespaces(scan=scan) for _ in range(3)]
    try:
        assert [set(reader.refresh({8765})) for reader in readers] == [{8765}] * 3
        assert scan.scans == 1 and readers[0].processes_read == scan.processes_read > 1
        clock[0] += 5.0
        assert set(readers[1].refresh({8765})) == {8765} and scan.scans == 2
        # A port just watched looks at the processes as they are now: an engine may have just started.
        assert set(readers[0].refresh({8765}, fresh=True)) == {8765} and scan.scans == 3
    finally:
        server.kill()
        server.wait()
    # Its process gone, the namespace is not read through it, from the same scan or a new one.
    assert readers[2].refresh({8765}) == {} and scan.scans == 3
    clock[0] += 5.0
    assert readers[2].refresh({8765}) == {} and scan.scans == 4


def _listen_in(namespace: str, port: int) -> subprocess.Popen[bytes]:
    """A process listening on ``port`` in ``namespace`` (``ip`` execs it: its pid is the listener's)."""
    server = subprocess.Popen(["ip", "netns", "exec", namespace, "python3", "-c",
                               f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); "
                               "s.listen(); print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline() == b"up\n"
    return server


def test_a_namespace_that_listens_on_no_watched_port_is_read_again_once_its_sockets_change(namespace: str) -> None:
    """Its tables (each a walk of the kernel's connection hash) are read at the first look, not at
    the next while its socket count holds; a listener opened there moves the count and is found."""
    sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])
    server = None
    try:
        spaces = NetNamespaces()
        assert wait_for(lambda: spaces.refresh({8765}) == {} and spaces.tables_read >= 2, timeout_s=5)
        assert spaces.refresh({8765}) == {} and spaces.tables_read == 0
        server = _listen_in(namespace, 8765)
        found = spaces.refresh({8765})
        assert [space.pid for space in found.get(8765, [])] in ([sleeper.pid], [server.pid]), found
        assert spaces.tables_read >= 1
    finally:
        for process in (sleeper, server):
            if process is not None:
                process.kill()
                process.wait()


def test_a_server_restarted_in_a_namespace_is_told_though_its_socket_count_holds(namespace: str) -> None:
    """A server that ended and another that listens in its place (a container restarted in its pod)
    leave the namespace's count of sockets where it was; its processes changed, so its tables are
    read again at the next look and the new LISTEN socket is told. Before, the one before was told
    for up to a minute (REREAD_S), and the scraper took the restarted engine for the one it knew."""
    sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])  # the pod's own process
    servers = [_listen_in(namespace, 8765)]
    try:
        spaces = NetNamespaces()
        assert wait_for(lambda: 8765 in spaces.refresh({8765}), timeout_s=5)
        before = spaces.inodes[8765]
        servers[0].kill()
        servers[0].wait()
        servers.append(_listen_in(namespace, 8765))
        found = spaces.refresh({8765})
        assert 8765 in found and spaces.tables_read >= 1
        assert spaces.inodes[8765] and spaces.inodes[8765].isdisjoint(before), (before, spaces.inodes)
    finally:
        for process in (sleeper, *servers):
            process.kill()
            process.wait()


def test_an_ipv6_only_network_is_reached_at_its_global_address(namespace: str) -> None:
    """A namespace without an IPv4 address but the loopback (an IPv6-only pod network): its
    global IPv6 address; the IPv4 one where it has both."""
    second = f"{namespace}6"
    link = f"aud{os.getpid() % 100000}v"
    _ip("netns", "add", second)
    servers: list[subprocess.Popen[bytes]] = []
    try:
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", second)
        _ip("-n", second, "addr", "add", "fd00:231::2/64", "dev", "eth0", "nodad")
        _ip("-n", second, "link", "set", "eth0", "up")
        _ip("-n", namespace, "addr", "add", "fd00:232::2/64", "dev", "eth0", "nodad")
        servers = [_listen_in(second, 8765), _listen_in(namespace, 8766)]
        found = NetNamespaces().refresh({8765, 8766})
        assert found[8765][0].address(Path("/proc")) == "fd00:231::2", found
        assert found[8766][0].address(Path("/proc")) == ENGINE_ADDR, found
    finally:
        for server in servers:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "netns", "del", second], capture_output=True)


def test_the_engine_process_is_the_one_listening_in_the_other_namespace(namespace: str) -> None:
    """Spans without process.pid: the engine is the process listening in the container's namespace,
    also where a process here listens on the same port (a proxy's end, as docker-proxy's); with two
    other namespaces listening on it, none, and the reason says so."""
    second = f"{namespace}b"
    servers = [_listen_in(namespace, 8765)]
    try:
        with socket.create_server(("0.0.0.0", 8765)):  # the host's end: a proxy's
            pids, unknown = ListenerPids(other_namespaces=NetNamespaces()).resolve({8765})
            assert pids == {8765: servers[0].pid}, unknown
            told = check_engines([8765, 8766], otlp=("0.0.0.0:4318", ""))
            assert told.state == "ok" and (f"port 8765: listened on in 1 other network namespace(s) (pid "
                                           f"{servers[0].pid}'s) and here (a proxy's end)") in told.detail, told
            assert "port 8766: nothing listens on it yet" in told.detail, told
            # The container's spans cannot reach receivers on this host's loopback.
            told = check_engines([8765], otlp=("127.0.0.1:4318", "[::1]:4317"))
            assert told.state == "degraded" and "otlp.http" in told.fix, told
            _ip("netns", "add", second)
            servers.append(_listen_in(second, 8765))
            pids, unknown = ListenerPids(other_namespaces=NetNamespaces()).resolve({8765})
            told = check_engines([8765], otlp=(f"{HOST_ADDR}:4318",))
        assert pids == {} and "listened on in 2 other network namespaces" in unknown[8765], unknown
        assert told.state == "ok" and "8765: several engines, each scraped at its own address" in told.detail, told
    finally:
        for server in servers:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", second], capture_output=True)


def test_the_daemon_says_a_containers_spans_cannot_reach_receivers_on_its_loopback(
        tmp_path: Path, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """Once, naming the port and what to set; not where a receiver listens off the loopback."""
    server = _listen_in(namespace, 8765)
    try:
        for run, (http, warned) in enumerate((("127.0.0.1:0", True), (f"{HOST_ADDR}:0", False))):
            caplog.clear()
            (tmp_path / str(run)).mkdir()
            with running_daemon(tmp_path / str(run), **{"probe.source": "procfs", "otlp.http": http,
                                                    "otlp.grpc": ""}) as daemon:
                daemon.set_ports({8765})
                said = wait_for(lambda: "cannot reach the OTLP receivers" in caplog.text, timeout_s=3)
                time.sleep(0.5)
            assert said == warned, caplog.text
            if warned:
                assert caplog.text.count("cannot reach the OTLP receivers") == 1
                assert "port(s) 8765: served in a container's network" in caplog.text
                assert "otlp.http" in caplog.text
    finally:
        server.kill()
        server.wait()


def test_the_process_read_through_ending_is_no_disconnect(namespace: str) -> None:
    """The poller reads the namespace through one of its processes. That process ending leaves the
    connections as they were (read through another at once), and the namespace's last process
    ending takes them with it: neither is a client that left."""
    first = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])
    time.sleep(0.2)
    server = _listen_in(namespace, 8765)
    source = procfs.ProcfsConnEventSource([8765], other_namespaces=True)
    try:
        source.scan()
        assert [space.pid for space in source.other_namespaces()[8765]] == [first.pid]
        client = socket.create_connection((ENGINE_ADDR, 8765))
        time.sleep(0.05)
        assert source.scan() == []  # a new open connection: no event
        first.kill()
        first.wait()
        assert source.scan() == [] and source.scan() == []
        assert [space.pid for space in source.other_namespaces()[8765]] == [server.pid]
        server.kill()  # the namespace's last process: its sockets end with it
        server.wait()
        time.sleep(0.05)
        assert source.scan() == [] and source.scan() == [] and source.other_namespaces() == {}
        client.close()
    finally:
        source.stop()
        for process in (first, server):
            process.kill()
            process.wait()


AS_THE_UNIT = """
import socket, sys, time
from pathlib import Path
from probes.netns import NetNamespaces
from probes.procfs import ProcfsConnEventSource

found = NetNamespaces().refresh({8765})
print("found", [(space.pid, space.address(Path("/proc"))) for space in found.get(8765, [])], flush=True)
source = ProcfsConnEventSource([8765], other_namespaces=True)
source.scan()
print("ready", flush=True)
sys.stdin.readline()  # the client connected and left
time.sleep(0.05)
print("events", [(event.kind.value, event.server_addr) for event in source.scan()], flush=True)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_the_unit_user_reads_the_other_namespace_without_privileges(namespace: str) -> None:
    """What the /proc fallback reads of a container's network, as uid 65534 without a capability
    (the unit's user is not root, and the engine's processes are root's here): the namespace, its
    address, and a client's FIN there."""
    server = _listen_in(namespace, 8765)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    reader = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                               sys.executable, "-c", AS_THE_UNIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, cwd="/")
    try:
        assert reader.stdin is not None and reader.stdout is not None
        assert reader.stdout.readline().decode() == f"found [({server.pid}, '{ENGINE_ADDR}')]\n"
        assert reader.stdout.readline() == b"ready\n"
        client = socket.create_connection((ENGINE_ADDR, 8765))
        time.sleep(0.05)
        client.close()  # nothing unread: a FIN
        reader.stdin.write(b"\n")
        reader.stdin.flush()
        assert reader.stdout.readline().decode() == f"events [('peer_fin', '{ENGINE_ADDR}')]\n"
    finally:
        reader.kill()
        reader.wait()
        server.kill()
        server.wait()


def test_the_poller_reads_another_namespace_only_while_it_may_list_something(namespace: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The namespace's table (a walk of the kernel's whole connection hash) is read once while it
    lists nothing on the port and accepts nothing; a client's connection and its FIN are seen."""
    reads: list[int] = []
    parse = procfs.parse_proc_net_tcp
    monkeypatch.setattr(procfs, "parse_proc_net_tcp", lambda *args: reads.append(1) or parse(*args))
    server = _listen_in(namespace, 8765)
    source = procfs.ProcfsConnEventSource([8765], other_namespaces=True)
    try:
        source.scan()  # the baseline, as start() takes it (no poller thread: each scan here is the test's)
        assert 8765 in source.other_namespaces()
        for _ in range(5):
            source.scan()
        assert len(reads) == 1, reads  # the baseline read; none since
        client = socket.create_connection((ENGINE_ADDR, 8765))
        client_port = client.getsockname()[1]
        source.scan()
        assert len(reads) == 2, reads  # it accepted one: read
        client.shutdown(socket.SHUT_WR)
        client.close()
        time.sleep(0.05)
        events = [event for event in source.scan() if event.client_port == client_port]
        assert [(event.kind.value, event.server_addr) for event in events] == [("peer_fin", ENGINE_ADDR)], events
    finally:
        source.stop()
        server.kill()
        server.wait()


def test_the_poller_lists_a_containers_clients_with_no_time_of_their_last_data(namespace: str) -> None:
    """The engine scraper's listing of a port served in another namespace: its clients there, from
    that namespace's table (no tcp_info: READ_UNKNOWN for their last data), at the container's
    address; the namespace's accepts count in ``accepted`` (a client accepted there after a
    listing makes it incomplete), and no poll can say a listing of it complete on its own."""
    server = _listen_in(namespace, 8765)
    source = procfs.ProcfsConnEventSource([8765], other_namespaces=True)
    try:
        source.scan()
        assert 8765 in source.other_namespaces()
        assert source.clients([8765]) == {8765: ()}
        before = source.accepted()
        client = socket.create_connection((ENGINE_ADDR, 8765))
        time.sleep(0.05)
        after = source.accepted()
        assert before is not None and after == before + 1
        assert source.clients([8765]) == {8765: ((HOST_ADDR, client.getsockname()[1], READ_UNKNOWN, ENGINE_ADDR),)}
        assert source.listing_complete(8765) is None
        client.close()
    finally:
        source.stop()
        server.kill()
        server.wait()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """One direction of a forwarded connection: a FIN passed on as a half-close, an error as a reset
    of both ends (as docker-proxy does)."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                end.close()


@contextlib.contextmanager
def published(port: int) -> Iterator[None]:
    """The host's loopback ``port`` forwarded to the engine's, as Docker publishes a container's port
    (``-p PORT:PORT``) through docker-proxy: the host then listens on the engine's port number too."""
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(0.1)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                client = server.accept()[0]
            except TimeoutError:
                continue
            try:
                upstream = socket.create_connection((ENGINE_ADDR, port))
            except OSError:  # the engine stopped (the test's end): the client is refused as docker-proxy refuses it
                client.close()
                continue
            for pair in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=pair, daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        server.close()


def completed_and_cancelled(daemon: Any, engine: Any, host: str, *, completed: int) -> tuple[Counter[str], list[str]]:
    """``completed`` requests read whole and four cancelled 0.3 s in (FIN and reset, two each) at
    the engine reached at ``host``; the verdicts tallied against its truth log once settled (a
    zombie is unconfirmed until the engine's spans of its end are in) and nothing revised after."""
    clients = [complete(engine.port, stream=index % 2 == 0, max_tokens=8, request_id=f"ok{index}", host=host)
               for index in range(completed)]
    clients += [cancel_after(engine.port, 0.3, kind, stream=True, max_tokens=150, request_id=f"{kind}{index}",
                             host=host) for index in range(2) for kind in ("fin", "rst")]
    for client in clients:
        client.join()
    assert wait_for(lambda: len(engine.truth()) == completed + 4, timeout_s=20)
    wait_for(lambda: tally_against_truth(verdict_rows(daemon), engine.truth())[0]["cancels right"] == 4, timeout_s=15)
    time.sleep(0.5)
    return tally_against_truth(verdict_rows(daemon), engine.truth())


@pytest.mark.parametrize(("behavior", "aborted_spans"), [("detached", True), ("abort", True), ("abort", False)],
                         ids=["detached", "abort", "abort-vllm-like"])
@pytest.mark.parametrize("via", ["routed", "published"])
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_engine_in_its_own_network_judged_against_truth(tmp_path: Path, namespace: str, source: str, via: str,
                                                        behavior: str, aborted_spans: bool) -> None:
    """``routed``: clients reach the engine at its own address (as Docker's DNAT routes a host's
    clients from elsewhere); ``published``: through a forwarder on the host's loopback on the same
    port number, as docker-proxy (the engine sees the forwarder's connection, closed as its client's
    was). ``abort-vllm-like``: no engine span for an aborted request, as vLLM; the abort is then told
    by the engine's gauges, scraped at the container's address (its loopback is not the host's) or
    through the forwarder."""
    with contextlib.ExitStack() as stack, running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": f"{HOST_ADDR}:0"}) as daemon, running_engine(
            behavior=behavior, otlp=f"http://{HOST_ADDR}:{daemon.status.http_port}",
            truth_log=tmp_path / "truth.jsonl", step_ms=10, max_batch=4, host=ENGINE_ADDR, netns=namespace,
            extra_args=["--trace-aborted"] if aborted_spans else []) as engine:
        assert daemon.source_name == source
        forwarder = published(engine.port) if via == "published" else contextlib.nullcontext()
        stack.enter_context(forwarder)
        client_host = "127.0.0.1" if via == "published" else ENGINE_ADDR
        daemon.set_ports({engine.port})
        if source == "procfs":  # the poller found the engine's namespace as the port was watched
            assert wait_for(lambda: engine.port in daemon._parts["probe"].other_namespaces(), timeout_s=5)
        time.sleep(0.3)
        tally, problems = completed_and_cancelled(daemon, engine, client_host, completed=3)
        scraped = engine.port in daemon._parts["engine_metrics"]._answered
    assert scraped, "the engine's /metrics was not reached at its own network's address"
    assert tally["cancels"] == 4 and tally["completed"] == 3, tally
    assert tally["cancels right"] == 4 and not problems, (tally, problems)


def _zombies_beside(daemon: Any, engine: Any) -> tuple[Counter[str], list[str], list[int]]:
    """Two requests read whole and four left 0.3 s in (FIN and reset) that the engine runs on for
    3 s: the in-flight zombies the daemon showed meanwhile, and the verdicts against the truth log."""
    clients = [complete(engine.port, stream=True, max_tokens=8, request_id=f"ok{index}", host=ENGINE_ADDR)
               for index in range(2)]
    clients += [cancel_after(engine.port, 0.3, kind, stream=True, max_tokens=300, request_id=f"{kind}{index}",
                             host=ENGINE_ADDR) for index in range(2) for kind in ("fin", "rst")]
    shown: list[int] = []
    while len(engine.truth()) < 6 and len(shown) < 200:
        shown.append(daemon.correlator.stats.inflight_zombies)
        time.sleep(0.05)
    for client in clients:
        client.join()
    wait_for(lambda: tally_against_truth(verdict_rows(daemon), engine.truth())[0]["cancels right"] == 4, timeout_s=15)
    time.sleep(0.5)
    return (*tally_against_truth(verdict_rows(daemon), engine.truth()), shown)


def _queued_beside(daemon: Any, engine: Any) -> tuple[Counter[str], list[str]]:
    """One request read whole holds an engine that runs one at a time; three behind it wait in its
    queue, where their clients leave (FIN, reset, FIN): verdicts against the truth log."""
    blocker = complete(engine.port, stream=True, max_tokens=120, request_id="held", host=ENGINE_ADDR)
    time.sleep(0.2)
    queued = [cancel_after(engine.port, 0.3, ("fin", "rst")[index % 2], stream=True, max_tokens=20,
                           request_id=f"queued{index}", host=ENGINE_ADDR) for index in range(3)]
    for client in [blocker, *queued]:
        client.join()
    assert wait_for(lambda: len(engine.truth()) == 4, timeout_s=20)
    wait_for(lambda: tally_against_truth(verdict_rows(daemon), engine.truth())[0]["cancels right"] == 3, timeout_s=15)
    time.sleep(0.5)
    tally, problems = tally_against_truth(verdict_rows(daemon), engine.truth())
    phases = [truth.get("phase_at_disconnect") for truth in engine.truth() if "queued" in truth["request_id"]]
    assert phases == ["queued"] * 3, engine.truth()  # their clients left them waiting, as the engine says
    return tally, problems


# A server that listens and never answers, as an engine loading its model (vLLM binds its port first).
LOADING = "import socket, sys, time; server = socket.create_server((sys.argv[1], int(sys.argv[2]))); time.sleep(120)"


@pytest.mark.parametrize(("other_server", "case"), [("web", "aborts"), ("loading", "aborts"), ("loading", "zombies"),
                                                    ("web", "queued")])
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_a_server_on_the_engines_port_that_is_no_engine_is_left_out_of_its_gauges(
        tmp_path: Path, namespace: str, source: str, other_server: str, case: str) -> None:
    """A node's pods serve one port number, one of them an engine and another a server that is no
    engine (``web``: its /metrics a 404) or not yet (``loading``: it listens and never answers, as
    a pod whose engine is loading its model), with a client of its own connected. The other server
    is left out of the port's gauges, and its client out of the port's listings (by the server's
    address), where before the port gave no reading at all.

    ``aborts``: the engine sends no span for an aborted request (as vLLM): its aborts are told by
    its gauges, where before every one was unconfirmed. ``queued``: the same engine running one
    request at a time, the leavers' requests dropped from its queue, told by its waiting gauge.
    ``zombies``: the engine runs its leavers' requests on; the daemon counts them in flight from
    the gauges and judges them zombies once their spans come. The other server's client, whose
    request it read, is in the eBPF probe's listing: left in, it hid one of the four orphans."""
    second_host, second_server = "10.231.10.1", "10.231.10.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}w", f"aud{os.getpid() % 100000}w",
                                                     second_host, second_server))
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": f"{HOST_ADDR}:0"}))
        engine = stack.enter_context(running_engine(
            behavior="detached" if case == "zombies" else "abort",
            otlp=f"http://{HOST_ADDR}:{daemon.status.http_port}", truth_log=tmp_path / "truth.jsonl",
            step_ms=10, max_batch=1 if case == "queued" else 4, host=ENGINE_ADDR, netns=namespace,
            extra_args=["--no-process-pid"]))
        serving = (["-m", "http.server", str(engine.port), "--bind", second_server, "--directory", str(tmp_path)]
                   if other_server == "web" else ["-c", LOADING, second_server, str(engine.port)])
        web = subprocess.Popen(["ip", "netns", "exec", other, sys.executable, *serving],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(web.wait, timeout=10)
        stack.callback(web.terminate)
        assert wait_for(lambda: _answers(second_server, engine.port), timeout_s=10)
        daemon.set_ports({engine.port})
        scraper = daemon._parts["engine_metrics"]
        assert wait_for(lambda: scraper.left_out.get(engine.port) == {second_server}, timeout_s=15), scraper.left_out
        # Its own client, whose request the server has read and not answered (the headers not ended):
        # listed as a client on the port with a read, whose request no span will ever tell.
        idle = stack.enter_context(socket.create_connection((second_server, engine.port)))
        idle.sendall(b"GET / HTTP/1.1\r\nHost: web\r\n")
        time.sleep(0.3)
        shown: list[int] = []
        if case == "zombies":
            tally, problems, shown = _zombies_beside(daemon, engine)
        elif case == "queued":
            tally, problems = _queued_beside(daemon, engine)
        else:
            tally, problems = completed_and_cancelled(daemon, engine, ENGINE_ADDR, completed=2)
        rows = verdict_rows(daemon)
        assert idle.fileno() >= 0
        shown_on_metrics = metrics(daemon.status.metrics_port or 0)
    cancels, completed = {"aborts": (4, 2), "zombies": (4, 2), "queued": (3, 1)}[case]
    # What an operator sees of it: the port's gauges read, one server left out of them.
    assert f'auditor_engine_servers_left_out{{port="{engine.port}"}} 1.0' in shown_on_metrics
    reads = re.search(rf'^auditor_engine_scrapes_total{{outcome="read",port="{engine.port}"}} (\S+)$',
                      shown_on_metrics, re.M)
    assert reads is not None and float(reads.group(1)) >= 1, shown_on_metrics
    assert tally["cancels"] == cancels and tally["completed"] == completed, tally
    assert tally["cancels right"] == cancels and not problems, (tally, problems)
    if case == "zombies":  # four ran on past the grace: shown in flight, never more
        assert max(shown) == 4 and shown.count(4) >= 5, shown
        return
    aborts = [row for row in rows if row.verdict == "aborted"]
    assert len(aborts) == cancels and all(row.details.get("evidence") == "engine_metrics" for row in aborts), [
        (row.verdict, row.details.get("evidence")) for row in rows]


@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_a_pod_whose_engine_restarted_and_loads_is_left_out_of_the_ports_gauges(
        tmp_path: Path, namespace: str, source: str) -> None:
    """Two pods serve one port; the second's engine answered its scrapes and sent spans, then its
    container restarted (a crash: the pod and its address stay) and its engine is loading its
    model, listening and answering nothing. The first engine sends no span for an aborted request
    (as vLLM): its aborts are told by the gauges, the loading pod left out as a new server. Taken
    for the engine that answered there before, it cost the port every round: all unconfirmed."""
    second_host, second_server = "10.231.12.1", "10.231.12.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}r", f"aud{os.getpid() % 100000}r",
                                                     second_host, second_server))
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0"}))
        engine = stack.enter_context(running_engine(
            behavior="abort", otlp=f"http://{HOST_ADDR}:{daemon.status.http_port}", truth_log=tmp_path / "truth.jsonl",
            step_ms=10, max_batch=4, host=ENGINE_ADDR, netns=namespace, extra_args=["--no-process-pid"]))
        port = engine.port
        scraper = daemon._parts["engine_metrics"]
        with running_engine(behavior="abort", otlp=f"http://{second_host}:{daemon.status.http_port}",
                            truth_log=tmp_path / "truth-restarted.jsonl", step_ms=10, max_batch=4, port=port,
                            host=second_server, netns=other, extra_args=["--no-process-pid"]) as crashing:
            daemon.set_ports({port})
            assert wait_for(lambda: (port, second_server) in scraper._engines_at, timeout_s=15)
            complete(port, stream=False, max_tokens=4, request_id="served", host=second_server).join()
            assert wait_for(lambda: daemon.correlator.sends_spans(port, second_server), timeout_s=10)
            served = crashing.truth()
        loading = subprocess.Popen(["ip", "netns", "exec", other, sys.executable, "-c", LOADING, second_server,
                                    str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(loading.wait, timeout=10)
        stack.callback(loading.terminate)
        assert wait_for(lambda: _answers(second_server, port), timeout_s=10)
        assert wait_for(lambda: scraper.left_out.get(port) == {second_server}, timeout_s=40), scraper.left_out
        completed_and_cancelled(daemon, engine, ENGINE_ADDR, completed=2)
        rows = verdict_rows(daemon)
        tally, problems = tally_against_truth(rows, engine.truth() + served)
    assert len(served) == 1 and tally["cancels"] == 4 and tally["completed"] == 3, tally
    assert tally["cancels right"] == 4 and not problems, (tally, problems)
    aborts = [row for row in rows if row.verdict == "aborted"]
    assert len(aborts) == 4 and all(row.details.get("evidence") == "engine_metrics" for row in aborts), [
        (row.verdict, row.details.get("evidence")) for row in rows]


def engines_in_pods(stack: contextlib.ExitStack, tmp_path: Path, pods: Iterable[tuple[str, str, str, list[str]]],
                    *, behavior: str = "detached", max_batch: int = 4) -> dict[str, Any]:
    """An engine in each pod's network namespace, all serving one port (the first's, picked by the
    kernel): ``pods`` are (namespace, address, the OTLP endpoint its spans go to, arguments of its
    own); address -> engine, each with a truth log of its own. None puts process.pid on its spans
    (the OTel SDK's default leaves it out)."""
    engines: dict[str, Any] = {}
    for name, address, otlp, args in pods:
        engines[address] = stack.enter_context(running_engine(
            port=next(iter(engines.values())).port if engines else 0, behavior=behavior, otlp=otlp,
            truth_log=tmp_path / f"truth-{address}.jsonl", step_ms=10, max_batch=max_batch, host=address,
            netns=name, extra_args=["--no-process-pid", *args]))
    return engines


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("behavior", ["detached", "abort-vllm-like"])
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_two_containers_serving_one_port_judged_and_costed_each_by_its_own_engine(
        tmp_path: Path, namespace: str, source: str, behavior: str) -> None:
    """Pods of one node serve the same port, each in a network of its own, and their spans name no
    process (the SDK's default). Each sends its spans straight to the daemon (one over OTLP/HTTP,
    the other over gRPC), from its own address: its requests are judged against its own truth log.
    ``detached``: its zombies are costed to its own engine process (the one listening at that
    address), where before neither was costed, and shared among its own engine's requests only
    (both engines have one service name). ``abort-vllm-like``: no engine span for an aborted
    request, as vLLM: the aborts are told by the engines' gauges, each engine scraped at its own
    address and their counts summed for the port, where before neither was scraped and every
    abort was unconfirmed."""
    second_host, second_engine = "10.231.8.1", "10.231.8.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}c", f"aud{os.getpid() % 100000}c",
                                                     second_host, second_engine))
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0", "otlp.grpc": "0.0.0.0:0"}))
        # One sends over OTLP/HTTP, the other over gRPC: each receiver keeps where spans came from.
        engines = engines_in_pods(stack, tmp_path, [
            (namespace, ENGINE_ADDR, f"http://{HOST_ADDR}:{daemon.status.http_port}", []),
            (other, second_engine, f"grpc://{second_host}:{daemon.status.grpc_port}", [])],
            behavior=behavior.removesuffix("-vllm-like"))
        port = engines[ENGINE_ADDR].port
        daemon.set_ports({port})
        cost = daemon.correlator.cost
        assert wait_for(lambda: cost.shared.get(port) == {address: engine.pid for address, engine in engines.items()},
                        timeout_s=15), (cost.shared, cost.unresolved)
        said = check_engine_metrics([port])  # the doctor reads each pod's gauges at its address
        assert said.state == "ok" and said.detail == "; ".join(
            f"port {port} at {address}: ref gauges read (0 running, 0 waiting)"
            for address in sorted((ENGINE_ADDR, second_engine))), said.detail
        clients = []
        for address, cancels in ((ENGINE_ADDR, 3), (second_engine, 1)):
            clients += [complete(port, stream=True, max_tokens=8, request_id=f"ok-{address}", host=address)]
            clients += [cancel_after(port, 0.3, ("fin", "rst")[index % 2], stream=True, max_tokens=150,
                                     request_id=f"gone{index}-{address}", host=address) for index in range(cancels)]
        for client in clients:
            client.join()
        for address, engine in engines.items():
            expected = 4 if address == ENGINE_ADDR else 2
            assert wait_for(lambda engine=engine, expected=expected: len(engine.truth()) == expected,
                            timeout_s=20), address

        def told() -> dict[str, tuple[Counter[str], list[str]]]:
            rows = verdict_rows(daemon)
            # A client reaches each engine from this host's end of that engine's veth pair.
            return {address: tally_against_truth([row for row in rows if row.client_addr == exporter], engine.truth())
                    for (address, engine), exporter in zip(engines.items(), (HOST_ADDR, second_host), strict=True)}

        assert wait_for(lambda: all(tally["cancels right"] == tally["cancels"] and not any(
            row.verdict == "zombie" and row.details.get("provisional") for row in verdict_rows(daemon))
            for tally, _ in told().values()), timeout_s=20), told()
        time.sleep(0.5)
        tallies, rows = told(), verdict_rows(daemon)
        scraped = port in daemon._parts["engine_metrics"]._answered
    for address, (tally, problems) in tallies.items():
        assert tally["cancels"] == (3 if address == ENGINE_ADDR else 1) and tally["completed"] == 1, (address, tally)
        assert tally["cancels right"] == tally["cancels"] and not problems, (address, tally, problems)
    assert scraped, "the engines' /metrics were not reached at their own networks' addresses"
    if behavior != "detached":
        aborts = [row for row in rows if row.verdict == "aborted"]
        assert len(aborts) == 4 and all(row.details.get("evidence") == "engine_metrics" for row in aborts), [
            (row.verdict, row.details.get("evidence")) for row in rows]
        return
    zombies = [row for row in rows if row.verdict == "zombie"]
    assert len(zombies) == 4, [(row.client_addr, row.verdict) for row in rows]
    for row in zombies:
        assert "cost_unmeasured" not in row.details and row.wasted_cpu_seconds > 0, (
            row.client_addr, row.details.get("cost_unmeasured"))
        # Which pod's engine ran it: the one the client reached (each over its own veth pair).
        assert row.details["engine_address"] == (ENGINE_ADDR if row.client_addr == HOST_ADDR else second_engine)
    # Each engine's zombies together were charged about its core for their window (less what the
    # two engines and the daemon took from each other on this machine's cores): the three of the
    # first shared it, the second's had it alone.
    for exporter in (HOST_ADDR, second_host):
        mine = [row for row in zombies if row.client_addr == exporter]
        lag = sum(row.lag_seconds or 0.0 for row in mine) / len(mine)
        charged = sum(row.wasted_cpu_seconds for row in mine)
        assert 0.7 * lag < charged < 1.1 * lag, (exporter, charged, [row.lag_seconds for row in mine])


@contextlib.contextmanager
def relaying(listen: str, target: str) -> Iterator[str]:
    """An OTLP/HTTP relay at ``listen`` standing in for a collector: each export's body is posted on
    to ``target`` (host:port) from ``listen``'s address, and its answer given back. Its URL."""
    host, port = target.rsplit(":", 1)

    class Relay(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            upstream = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(listen, 0))
            headers = {name: self.headers[name] for name in ("Content-Type", "Content-Encoding") if self.headers[name]}
            upstream.request("POST", self.path, body, headers)
            answer = upstream.getresponse()
            data = answer.read()
            upstream.close()
            self.send_response(answer.status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((listen, 0), Relay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{listen}:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("named", [True, False], ids=["pod-named", "unnamed"])
def test_spans_relayed_by_a_collector_are_costed_to_the_pod_their_resource_names(
        tmp_path: Path, namespace: str, named: bool) -> None:
    """Two pods of one port send their spans through a collector (a relay on this host's address,
    not the loopback), so they come from its address, and name no process. ``pod-named``: each
    engine's resource names its pod's address (``k8s.pod.ip``, as the collector's k8sattributes
    processor adds it), and each pod's zombies are costed to its own engine; ``unnamed``: which
    pod's engine served them is not known, and each zombie says so."""
    second_host, second_engine = "10.231.8.1", "10.231.8.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}c", f"aud{os.getpid() % 100000}c",
                                                     second_host, second_engine))
        _ip("-n", other, "route", "add", "default", "via", second_host)  # to the collector at HOST_ADDR
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": "procfs", "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0"}))
        collector = stack.enter_context(relaying(HOST_ADDR, f"{HOST_ADDR}:{daemon.status.http_port}"))
        engines = {}
        for name, address in ((namespace, ENGINE_ADDR), (other, second_engine)):
            resource = {"OTEL_RESOURCE_ATTRIBUTES": f"k8s.pod.ip={address}"} if named else {}
            engines[address] = stack.enter_context(running_engine(
                port=engines[ENGINE_ADDR].port if engines else 0, behavior="detached", otlp=collector,
                truth_log=tmp_path / f"truth-{address}.jsonl", step_ms=10, max_batch=4, host=address, netns=name,
                extra_args=["--no-process-pid"], env={**os.environ, **resource}))
        port = engines[ENGINE_ADDR].port
        daemon.set_ports({port})
        cost = daemon.correlator.cost
        assert wait_for(lambda: cost.shared.get(port) == {address: engine.pid for address, engine in engines.items()},
                        timeout_s=15), (cost.shared, cost.unresolved)
        clients = [cancel_after(port, 0.3, "fin", stream=True, max_tokens=150, request_id=f"gone{index}-{address}",
                                host=address) for address, count in ((ENGINE_ADDR, 2), (second_engine, 1))
                   for index in range(count)]
        for client in clients:
            client.join()

        def zombies() -> list[Any]:
            return [row for row in verdict_rows(daemon) if row.verdict == "zombie" and not row.details.get("provisional")]

        assert wait_for(lambda: len(zombies()) == 3, timeout_s=30), [(row.request_id, row.verdict) for row in
                                                                     verdict_rows(daemon)]
        rows = zombies()
    for row in rows:
        if not named:
            assert "the spans came from none of their addresses" in row.details["cost_unmeasured"], row.details
            continue
        assert "cost_unmeasured" not in row.details and row.wasted_cpu_seconds > 0, (
            row.request_id, row.details.get("cost_unmeasured"))
        assert row.details["engine_address"] == (ENGINE_ADDR if row.client_addr == HOST_ADDR else second_engine)


@pytest.mark.privileged
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_the_unit_user_costs_each_containers_zombies_to_the_engine_the_probe_saw_closing_there(
        tmp_path: Path, namespace: str) -> None:
    """The daemon as the systemd unit runs it (uid 65534, the unit's capabilities alone), two pods'
    engines on one port run by root: their descriptors are unreadable without CAP_SYS_PTRACE, so the
    listener lookup names neither process. The eBPF probe saw each close a connection at its own
    address (the warm-up request's), and each pod's zombies are costed to that pod's engine."""
    from tests.test_daemon_unprivileged import NOBODY, unit_capabilities

    second_host, second_engine = "10.231.8.1", "10.231.8.2"
    state = Path(tempfile.mkdtemp(prefix="auditor-nobody-"))
    state.chmod(0o777)
    http_port, metrics_port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, state, ignore_errors=True)
        other = stack.enter_context(joined_namespace(f"{namespace}c", f"aud{os.getpid() % 100000}c",
                                                     second_host, second_engine))
        engines = engines_in_pods(stack, tmp_path, [
            (name, address, f"http://{exporter}:{http_port}", [])
            for name, address, exporter in ((namespace, ENGINE_ADDR, HOST_ADDR), (other, second_engine, second_host))])
        port = engines[ENGINE_ADDR].port
        caps = unit_capabilities()
        log = state / "daemon.log"
        with log.open("wb") as out:
            daemon = subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", f"--inh-caps={caps}",
                 f"--ambient-caps={caps}", "--", sys.executable, "-m", "auditor", "run",
                 "--db", f"sqlite:///{state / 'auditor.db'}", "--port", str(port), "--source", "bpf",
                 "--otlp-http", f"0.0.0.0:{http_port}", "--otlp-grpc", "", "--live", "",
                 "--metrics", f"127.0.0.1:{metrics_port}"],
                cwd=state, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                "HOME": str(state)}, stdout=out, stderr=subprocess.STDOUT)

        def stop() -> None:
            daemon.terminate()
            daemon.wait(timeout=30)

        stack.callback(stop)
        assert wait_for(lambda: 'auditor_disconnect_source_info{source="bpf"} 1.0' in metrics(metrics_port),
                        timeout_s=60), log.read_text()[-3000:]
        for client in [complete(port, stream=True, max_tokens=4, request_id=f"warm-{address}", host=address)
                       for address in engines]:
            client.join()  # read whole: the client closes, then each engine
        named = [f"port {port} at {address}: engine process {engine.pid}" for address, engine in engines.items()]
        assert wait_for(lambda: all(line in log.read_text() for line in named), timeout_s=20), log.read_text()[-3000:]
        clients = [cancel_after(port, 0.3, "fin", stream=True, max_tokens=150, request_id=f"gone{index}-{address}",
                                host=address) for address, count in ((ENGINE_ADDR, 2), (second_engine, 1))
                   for index in range(count)]
        for client in clients:
            client.join()
        store = Store(f"sqlite:///{state / 'auditor.db'}", upgrade=False, create=False)

        def zombies() -> list[VerdictRow]:
            with store.session() as session:
                return [row for row in session.scalars(select(VerdictRow)) if row.verdict == "zombie"
                        and not row.details.get("provisional")]

        assert wait_for(lambda: len(zombies()) == 3, timeout_s=30), (zombies(), log.read_text()[-3000:])
        rows = zombies()
    for row in rows:
        assert "cost_unmeasured" not in row.details and row.wasted_cpu_seconds > 0, (
            row.request_id, row.details.get("cost_unmeasured"))
        assert row.details["engine_address"] == (ENGINE_ADDR if row.client_addr == HOST_ADDR else second_engine)


@pytest.mark.parametrize("behavior", ["detached", "abort-vllm-like"])
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_two_containers_serving_one_port_judge_requests_left_waiting_in_their_queues(
        tmp_path: Path, namespace: str, source: str, behavior: str) -> None:
    """Each pod's engine runs one request at a time: a long one read whole holds it, and the
    requests behind it wait in its queue, where their clients leave (two on the first pod, one on
    the second). ``detached``: each engine runs them later all the same (zombies); ``abort-vllm-
    like``: each drops them from its queue with no span, told by its waiting gauge, which the
    scrapes sum over the two engines."""
    second_host, second_engine = "10.231.8.1", "10.231.8.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}c", f"aud{os.getpid() % 100000}c",
                                                     second_host, second_engine))
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0"}))
        engines = engines_in_pods(stack, tmp_path, [
            (name, address, f"http://{exporter}:{daemon.status.http_port}", [])
            for name, address, exporter in ((namespace, ENGINE_ADDR, HOST_ADDR), (other, second_engine, second_host))],
            behavior=behavior.removesuffix("-vllm-like"), max_batch=1)
        port = engines[ENGINE_ADDR].port
        daemon.set_ports({port})
        assert wait_for(lambda: port in daemon._parts["engine_metrics"]._answered, timeout_s=15)
        blockers = [complete(port, stream=True, max_tokens=120, request_id=f"held-{address}", host=address)
                    for address in engines]
        time.sleep(0.2)
        queued = [cancel_after(port, 0.3, ("fin", "rst")[index % 2], stream=True, max_tokens=20,
                               request_id=f"queued{index}-{address}", host=address)
                  for address, count in ((ENGINE_ADDR, 2), (second_engine, 1)) for index in range(count)]
        for client in [*blockers, *queued]:
            client.join()
        for address, expected in ((ENGINE_ADDR, 3), (second_engine, 2)):
            assert wait_for(lambda a=address, e=expected: len(engines[a].truth()) == e, timeout_s=20), address

        def told() -> dict[str, tuple[Counter[str], list[str]]]:
            rows = verdict_rows(daemon)
            return {address: tally_against_truth([row for row in rows if row.client_addr == exporter], engine.truth())
                    for (address, engine), exporter in zip(engines.items(), (HOST_ADDR, second_host), strict=True)}

        wait_for(lambda: all(tally["cancels right"] == tally["cancels"] for tally, _ in told().values()) and not any(
            row.details.get("provisional") for row in verdict_rows(daemon)), timeout_s=20)
        time.sleep(0.5)
        tallies = told()
        rows = [(row.request_id, row.verdict, row.phase, row.details.get("evidence")) for row in verdict_rows(daemon)]
        truths = [(truth["request_id"], truth.get("phase_at_disconnect")) for engine in engines.values()
                  for truth in engine.truth()]
    # Their clients left them waiting, as the engines' own logs say.
    assert sorted(phase for request_id, phase in truths if "queued" in request_id) == ["queued"] * 3, truths
    for address, (tally, problems) in tallies.items():
        assert tally["cancels"] == (2 if address == ENGINE_ADDR else 1) and tally["completed"] == 1, (address, tally)
        assert tally["cancels right"] == tally["cancels"] and not problems, (address, tally, problems, rows, truths)


def _bound_to(address: str, port: int) -> socket.socket:
    """A client socket bound to ``address:port`` that another may share (SO_REUSEADDR): a client
    of two pods may get one source port for both, as Linux picks source ports per destination."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    return sock


@pytest.mark.privileged
def test_a_gateways_two_connections_on_one_client_port_are_two_clients_not_an_orphan(
        tmp_path: Path, namespace: str) -> None:
    """Two pods of one port, each running a long request from the same gateway address and source
    port, nobody leaving: the port's summed gauges hold two requests, and the kernel lists two
    clients (told apart by the server's address), so the daemon counts no zombie in flight. With
    one client listed for the two, the request of one pod read as the other's orphan: an in-flight
    zombie alarmed about for as long as both ran."""
    second_host, second_engine = "10.231.9.1", "10.231.9.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}d", f"aud{os.getpid() % 100000}d",
                                                     second_host, second_engine))
        for name, gateway in ((namespace, HOST_ADDR), (other, second_host)):
            _ip("-n", name, "route", "add", "default", "via", gateway)
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": "bpf", "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0",
            "engine_metrics.interval_seconds": 0.1}))
        engines = engines_in_pods(stack, tmp_path, [
            (name, address, f"http://{exporter}:{daemon.status.http_port}",
             ["--engine-span", "none", "--metrics-names", "vllm"])
            for name, address, exporter in ((namespace, ENGINE_ADDR, HOST_ADDR), (other, second_engine, second_host))])
        port = engines[ENGINE_ADDR].port
        daemon.set_ports({port})
        time.sleep(0.5)
        first = _bound_to(HOST_ADDR, 0)
        second = _bound_to(HOST_ADDR, first.getsockname()[1])
        first.connect((ENGINE_ADDR, port))
        second.connect((second_engine, port))
        shown: list[int] = []
        with first, second:
            for index, sock in enumerate((first, second)):
                send_request(port, stream=True, max_tokens=400, request_id=f"long{index}", sock=sock)
            readers = [threading.Thread(target=read_response, args=(sock,)) for sock in (first, second)]
            for reader in readers:
                reader.start()
            time.sleep(0.3)  # a client that reads a short answer and leaves: the port's clients are listed
            with socket.create_connection((ENGINE_ADDR, port)) as short:
                send_request(port, stream=False, max_tokens=4, request_id="short", sock=short)
                read_response(short)
            while any(reader.is_alive() for reader in readers):  # about 4 s, 3 past the grace
                shown.append(daemon.correlator.stats.inflight_zombies)
                time.sleep(0.1)
            for reader in readers:
                reader.join()
        for address, expected in ((ENGINE_ADDR, 2), (second_engine, 1)):
            assert wait_for(lambda a=address, e=expected: len(engines[a].truth()) == e, timeout_s=20), address
        assert all(truth["finish_reason"] == "length" and truth["disconnect_at"] is None
                   for engine in engines.values() for truth in engine.truth()), [e.truth() for e in engines.values()]
        scraped = port in daemon._parts["engine_metrics"]._answered
    assert scraped and len(shown) > 20
    assert not any(shown), f"zombies in flight shown while two clients read their answers: {shown}"


@contextlib.contextmanager
def only_local_port(port: int) -> Iterator[None]:
    """The host's connects pick ``port`` meanwhile (ip_local_port_range): one already in use to
    another destination is taken all the same, as the kernel does for a busy host (a 4-tuple of
    its own); an explicit bind could not share the port with a socket that did not ask to."""
    setting = Path("/proc/sys/net/ipv4/ip_local_port_range")
    before = setting.read_text()
    setting.write_text(f"{port} {port}")
    try:
        yield
    finally:
        setting.write_text(before)


@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_a_client_on_the_scrapes_address_and_port_to_another_pod_is_watched(
        tmp_path: Path, namespace: str, source: str) -> None:
    """Two pods serve one port; the daemon holds its scrape of the first open from the host's
    address, and a gateway on that address reaches the second from the same source port (Linux
    picks source ports per destination), then leaves a long request that the engine runs on. Its
    close is a client's, not the daemon's: the zombie is judged. The /proc source left out every
    socket on the scrape's address and ports, whichever pod's, so the close was never seen."""
    second_host, second_engine = "10.231.11.1", "10.231.11.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}s", f"aud{os.getpid() % 100000}s",
                                                     second_host, second_engine))
        _ip("-n", other, "route", "add", "default", "via", second_host)  # it answers the first pod's host address
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0"}))
        engines = engines_in_pods(stack, tmp_path, [
            (name, address, f"http://{exporter}:{daemon.status.http_port}", [])
            for name, address, exporter in ((namespace, ENGINE_ADDR, HOST_ADDR), (other, second_engine, second_host))])
        port = engines[ENGINE_ADDR].port
        daemon.set_ports({port})
        scraper = daemon._parts["engine_metrics"]
        assert wait_for(lambda: port in scraper._answered, timeout_s=15)
        scrape = next(end for end in scraper._ends if end[3] == ENGINE_ADDR)
        client = socket.socket()
        client.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24), 1)
        client.bind((HOST_ADDR, 0))  # the scrape's address; its port picked as it connects
        with only_local_port(scrape[1]):  # as the kernel may pick it for another destination
            client.connect((second_engine, port))
        assert client.getsockname()[:2] == (HOST_ADDR, scrape[1])
        assert next(end for end in scraper._ends if end[3] == ENGINE_ADDR) == scrape  # held open meanwhile
        with client:
            send_request(port, stream=True, max_tokens=200, request_id="left", sock=client)
            time.sleep(0.3)
            disconnect(client, "fin")
        assert wait_for(lambda: len(engines[second_engine].truth()) == 1, timeout_s=20)
        truth = engines[second_engine].truth()
        wait_for(lambda: tally_against_truth(verdict_rows(daemon), truth)[0]["cancels right"] == 1, timeout_s=15)
        time.sleep(0.5)
        tally, problems = tally_against_truth(verdict_rows(daemon), truth)
        still_held = scrape in scraper._ends
    assert still_held, "the scrape's connection was not open while the client left"
    assert truth[0]["disconnect_at"] is not None and tally["cancels"] == 1, truth
    assert tally["cancels right"] == 1 and not problems, (tally, problems)


@pytest.mark.parametrize("signals", ["spans", "live-notices", "vllm-like", "gauges-only"])
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_one_client_port_to_two_pods_joins_each_close_to_its_own_pods_request(
        tmp_path: Path, namespace: str, source: str, signals: str) -> None:
    """A gateway reaches two pods of one port from one address, and two of its connections, one to
    each pod, have the same source port: the same client address and port and server port. A
    close on one must not be joined to the other pod's request in flight: the kernel's events say
    which pod's socket closed (its address), and each pod's spans (and live notices) come from its
    own address. ``spans``, ``live-notices``: engines that run on after their client left;
    ``vllm-like``: engines that abort, with no span for an abort (their gauges tell it)."""
    live = signals == "live-notices"
    second_host, second_engine = "10.231.8.1", "10.231.8.2"
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(joined_namespace(f"{namespace}c", f"aud{os.getpid() % 100000}c",
                                                     second_host, second_engine))
        for name, gateway in ((namespace, HOST_ADDR), (other, second_host)):  # each pod answers any host address
            _ip("-n", name, "route", "add", "default", "via", gateway)
        daemon = stack.enter_context(running_daemon(tmp_path, **{
            "probe.source": source, "probe.poll_hz": 20.0, "otlp.http": "0.0.0.0:0",
            "live.listen": "0.0.0.0:0" if live else ""}))
        gauges = ["--engine-span", "none", "--metrics-names", "vllm"] if signals == "gauges-only" else []
        engines = engines_in_pods(stack, tmp_path, [
            (name, address, f"http://{exporter}:{daemon.status.http_port}",
             [*(["--live", f"{exporter}:{daemon.status.live_port}"] if live else []), *gauges])
            for name, address, exporter in ((namespace, ENGINE_ADDR, HOST_ADDR), (other, second_engine, second_host))],
            behavior="abort" if signals == "vllm-like" else "detached")
        port = engines[ENGINE_ADDR].port
        daemon.set_ports({port})
        if source == "procfs":
            assert wait_for(lambda: len(daemon._parts["probe"].other_namespaces().get(port, ())) == 2, timeout_s=5)
        time.sleep(0.3)

        def pair(index: int, left: str) -> threading.Thread:
            """On one source port, a request to each pod. ``done-fin``, ``done-rst``: a long one to the
            second pod, read whole; 0.3 s in, a short one to the first, read whole, and its
            connection closed 0.2 s later (as a gateway's pool lets an idle one go). ``fin``,
            ``rst``: a long one to the first pod, and 0.3 s in a long one to the second (the latest
            to start on the 4-tuple), read whole; the first's client leaves 0.3 s later."""
            first = _bound_to(HOST_ADDR, 0)
            second = _bound_to(HOST_ADDR, first.getsockname()[1])
            first.connect((ENGINE_ADDR, port))
            second.connect((second_engine, port))

            def run() -> None:
                with second:
                    if left.startswith("done-"):
                        send_request(port, stream=True, max_tokens=150, request_id=f"read{index}", sock=second)
                        time.sleep(0.3)
                        send_request(port, stream=False, max_tokens=4, request_id=f"short{index}", sock=first)
                        read_response(first)
                        time.sleep(0.2)
                    else:
                        send_request(port, stream=True, max_tokens=150, request_id=f"left{index}", sock=first)
                        time.sleep(0.3)
                        send_request(port, stream=True, max_tokens=150, request_id=f"read{index}", sock=second)
                        time.sleep(0.3)
                    disconnect(first, left.removeprefix("done-"))
                    read_response(second)

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        for thread in [pair(index, left) for index, left in enumerate(("done-fin", "fin", "rst", "done-rst"))]:
            thread.join()
        for address, expected in ((ENGINE_ADDR, 4), (second_engine, 4)):
            assert wait_for(lambda a=address, e=expected: len(engines[a].truth()) == e, timeout_s=20), address

        def told() -> dict[str, tuple[Counter[str], list[str]]]:
            rows = verdict_rows(daemon)
            # The engine names a request by its X-Request-Id, prefixed as OpenAI's ids are.
            return {address: tally_against_truth([row for row in rows if f"cmpl-{row.request_id}" in {
                truth["request_id"] for truth in engine.truth()}], engine.truth()) for address, engine in engines.items()}

        wait_for(lambda: told()[ENGINE_ADDR][0]["cancels right"] == 2 and not any(
            row.details.get("provisional") for row in verdict_rows(daemon)), timeout_s=20)
        time.sleep(1.0)
        tallies = told()
        rows = [(row.request_id, row.verdict) for row in verdict_rows(daemon)]
    (first_tally, first_problems), (second_tally, second_problems) = tallies[ENGINE_ADDR], tallies[second_engine]
    assert first_tally["cancels"] == 2 and first_tally["cancels right"] == 2 and not first_problems, (
        first_tally, first_problems, rows)
    assert second_tally["completed"] == 4 and not second_tally["false findings"] and not second_problems, (
        second_tally, second_problems, rows)


@pytest.mark.parametrize("behavior", ["detached", "abort"])
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_a_containers_engine_without_spans_shows_the_work_it_ran_for_nobody(tmp_path: Path, namespace: str,
                                                                             source: str, behavior: str) -> None:
    """llama.cpp's server in a container (a network of its own), no spans at all: the work it ran
    on after its client reset is a stretch of orphaned work with either source, against its truth
    log. The /proc source lists the port's clients from the container's own table (no tcp_info
    there: no time of their last data), where it listed none before and so counted nothing; a
    client read whole beside it, and an engine that stops the work, add none."""
    from tests.test_orphaned_work_e2e import stretches

    with running_daemon(tmp_path, **{"probe.source": source, "probe.poll_hz": 20.0,
                                     "engine_metrics.interval_seconds": 0.1}) as daemon, running_engine(
            behavior=behavior, truth_log=tmp_path / "truth.jsonl", step_ms=10, host=ENGINE_ADDR, netns=namespace,
            extra_args=["--metrics-names", "llamacpp"]) as engine:
        daemon.set_ports({engine.port})
        if source == "procfs":
            assert wait_for(lambda: engine.port in daemon._parts["probe"].other_namespaces(), timeout_s=5)
        time.sleep(0.5)
        whole = complete(engine.port, stream=True, max_tokens=40, request_id="whole", host=ENGINE_ADDR)
        cancel_after(engine.port, 0.3, "rst", stream=False, max_tokens=300, request_id="left", host=ENGINE_ADDR).join()
        whole.join()
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(2, timeout=30)}
        time.sleep(1.5)
        listings = daemon.readings().engine_listings
    truth = truths["left"]
    rows = stretches(tmp_path / "auditor.db")
    assert listings.get((engine.port, True), 0) > 0, listings  # auditor_engine_listings_total
    if behavior == "abort":
        assert expected_verdict(truth) == "aborted" and rows == [], (rows, truth)
        return
    assert expected_verdict(truth) == "zombie", truth
    left_ns, finished_ns = truth["disconnect_at"], truth["finished_at"]
    [row] = rows
    assert row["server_port"] == engine.port and row["peak"] == 1, row
    assert left_ns + GRACE_S * 1e9 <= row["start_ns"] <= left_ns + (GRACE_S + 1.5) * 1e9, (row, truth)
    assert abs(row["end_ns"] - finished_ns) <= 0.5e9, (row, truth)
    assert row["request_seconds"] <= (finished_ns - left_ns) / 1e9
