"""The scraper's own HTTP/1.1 client against a real socket server answering the ways engines do:
Content-Length or chunked, kept alive or closed, and answers that are no metrics page at all."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from auditor.model import EngineLoad
from collectors.enginemetrics import MAX_PAGE_BYTES, EngineMetricsScraper
from probes.procfs import ProcfsConnEventSource
from probes.sockdiag import ConnectedClients

PAGE = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"


def content_length(body: bytes = PAGE, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunked(body: bytes = PAGE) -> bytes:
    half = len(body) // 2
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))


Answer = bytes | tuple[bytes, ...] | Callable[[socket.socket], None]


class Server:
    """Answers each GET on a connection with the next of ``answers``: bytes at once, a tuple's
    parts in writes of their own (with Nagle on, as a server's own socket has it), and a callable
    may close instead."""

    def __init__(self, answers: list[Answer], host: str = "127.0.0.1", port: int = 0) -> None:
        self.answers = answers
        self.connections = 0
        self.listener = socket.create_server((host, port))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while self.answers:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        data = conn.recv(4096)
                        if not data:
                            break
                        request += data
                    if not request:
                        break
                    answer = self.answers.pop(0)
                    if callable(answer):
                        answer(conn)
                        break
                    if isinstance(answer, tuple):
                        for part in answer:
                            conn.sendall(part)
                        continue
                    conn.sendall(answer)
                    if b"Connection: close" in answer or (b"Content-Length" not in answer and b"chunked" not in answer):
                        break

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[list[Answer]], Server]]:
    servers: list[Server] = []

    def start(answers: list[Answer], host: str = "127.0.0.1", port: int = 0) -> Server:
        servers.append(Server(answers, host, port))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def scraper() -> EngineMetricsScraper:
    # One GET a scrape (the filtered page is asked for in tests of its own, below).
    return EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False)


@pytest.mark.parametrize("answer", [content_length(), chunked()], ids=["content-length", "chunked"])
def test_pages_are_read_over_one_kept_alive_connection(serve: Callable[..., Server], answer: bytes) -> None:
    server = serve([answer] * 3)
    client = scraper()
    loads = [client.scrape(server.port) for _ in range(3)]
    client.close()
    assert [(load.running, load.waiting) for load in loads if load] == [(2, 1)] * 3
    assert server.connections == 1


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="Linux's delayed acknowledgement")
def test_an_answer_written_in_two_parts_is_read_without_waiting_for_a_delayed_ack(serve: Callable[..., Server]) -> None:
    # As uvicorn answers on a socket its server bound itself: the headers, then the body, with Nagle
    # on. Nagle holds the body until the headers are acknowledged, which Linux delays by 40 ms once
    # requests follow answers at once (as an engine's first scrape sends two): without asking for a
    # quick acknowledgement, scrapes back to back after the first two took 44 ms each.
    head, body = content_length().split(b"\r\n\r\n", 1)
    server = serve([(head + b"\r\n\r\n", body)] * 9)
    client = scraper()
    loads = [client.scrape(server.port) for _ in range(9)]
    client.close()
    assert server.connections == 1
    waits_ms = sorted((load.answered_ns - load.ts_ns) / 1e6 for load in loads
                      if load is not None and load.answered_ns is not None)
    assert len(waits_ms) == 9
    assert waits_ms[4] < 20, f"asked to answered, ms: {waits_ms}"


def test_an_answer_without_length_is_read_to_the_close_and_the_next_scrape_reconnects(serve: Callable[..., Server]) -> None:
    server = serve([b"HTTP/1.1 200 OK\r\n\r\n" + PAGE, content_length(extra=b"Connection: close\r\n"), content_length()])
    client = scraper()
    assert [client.scrape(server.port) is not None for _ in range(3)] == [True] * 3
    client.close()
    assert server.connections == 3


def test_a_connection_the_engine_closed_while_idle_is_replaced_once(serve: Callable[..., Server]) -> None:
    server = serve([content_length(), lambda conn: None, content_length()])  # the second GET finds it closed
    client = scraper()
    assert client.scrape(server.port) is not None
    assert client.scrape(server.port) is not None
    client.close()
    assert server.connections == 2


def test_the_scraper_names_the_connections_it_holds_open(serve: Callable[..., Server]) -> None:
    # The /proc poller leaves these out: they are the daemon's own, on a watched port.
    server = serve([b"HTTP/1.1 200 OK\r\n\r\n" + PAGE, content_length(), content_length(), content_length()])
    told: list[frozenset[tuple[str, int, int, str]]] = []
    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False,
                                  on_connections=told.append)
    assert client.scrape(server.port) is not None  # read to the close: opened, then closed
    assert len(told) == 2 and len(told[0]) == 1 and told[1] == frozenset()
    (address, port, server_port, server_address), = told[0]
    assert address == "127.0.0.1" and port not in (0, server.port) and server_port == server.port
    assert server_address == "127.0.0.1"
    assert client.scrape(server.port) is not None and client.scrape(server.port) is not None  # one kept-alive
    assert len(told) == 3 and len(told[2]) == 1 and told[2] != told[0]
    client.close()
    assert told[-1] == frozenset()
    assert server.connections == 2


@pytest.mark.parametrize("lister_kind", ["walk", "procfs"])
def test_a_scrape_lists_the_clients_connected_to_the_port_but_its_own_when_asked(serve: Callable[..., Server],
                                                                                 lister_kind: str) -> None:
    # The kernel's word on who is connected as the scrape is sent (sock_diag), while a client has
    # just left the port or a verdict reads its scrapes: a client that sent its request 0.3 s
    # before and waits for its answer, with when it sent; not the scraper itself. Listed by a walk
    # of its own (a daemon with neither probe) or by the /proc source's poll.
    server = serve([content_length()] * 3)
    lister: ConnectedClients | ProcfsConnEventSource
    if lister_kind == "walk":
        lister = ConnectedClients()
    else:
        lister = ProcfsConnEventSource([server.port], sock_diag=True)
        lister.start()
    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False,
                                  listed_clients=lister.clients, accepted=lister.accepted)
    [unlisted] = client.scrape_all([server.port])  # the scraper's connection, kept alive from now on
    assert unlisted.connections is None
    client.want_clients([server.port])  # a client left, or a verdict reads the port's scrapes
    waiting = socket.create_connection(("127.0.0.1", server.port))  # never answered: the server serves one
    waiting_end = waiting.getsockname()[:2]
    try:
        waiting.sendall(b"POST /v1/completions HTTP/1.1\r\n\r\n")
        sent_ns = time.time_ns()
        time.sleep(0.3)
        [load] = client.scrape_all([server.port])
    finally:
        waiting.close()
        client.close()
        if isinstance(lister, ConnectedClients):
            lister.close()
        else:
            lister.stop()
    assert load is not None and load.connections is not None and load.connections_complete
    [(address, port, last_sent_ns, server_address)] = load.connections
    assert (address, port, server_address) == (*waiting_end, "127.0.0.1")
    assert abs(last_sent_ns - sent_ns) < 20_000_000, (last_sent_ns - sent_ns) / 1e6


def test_a_server_on_a_shared_port_that_is_no_engine_is_left_out_unless_its_spans_count(
        serve: Callable[..., Server]) -> None:
    """One port at two addresses: an engine, and a server whose /metrics is 404 (no engine). The
    port's load is the engine's alone, its listing without the other's clients (by the server's
    address), and the other is not asked again for a while; but where spans on the port came from
    the other's address (their requests are counted connected), the port gives no reading, as
    while any of its engines does not answer."""
    engine = serve([content_length()] * 4)
    web = serve([b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"] * 4, host="127.0.0.2", port=engine.port)
    spans_from: set[str] = set()

    def listed(ports: object) -> dict[int, tuple[tuple[str, int, int, str], ...]]:
        return {engine.port: (("10.0.0.7", 40000, 1, "127.0.0.1"), ("10.0.0.7", 40001, 2, "127.0.0.2"),
                              ("10.0.0.8", 40002, 3, "::ffff:127.0.0.2"))}

    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False,
                                  listed_clients=listed, accepted=lambda: 0,
                                  addresses_of=lambda port: ("127.0.0.1", "127.0.0.2"),
                                  sends_spans=lambda port, address, since: address in spans_from)
    try:
        client.want_clients([engine.port])
        [load] = client.scrape_all([engine.port])
        assert client.left_out == {engine.port: {"127.0.0.2"}}
        assert load.running_by_address == (("127.0.0.1", load.running),)
        assert load.connections is not None and [read for *_c, read, _s in load.connections] == [1]
        [again] = client.scrape_all([engine.port])  # the other is not asked again yet
        assert again.running_by_address == load.running_by_address and web.connections == 1
        spans_from.add("127.0.0.2")
        assert client.scrape_all([engine.port]) == [] and client.errors == 1
    finally:
        client.close()


def test_a_server_on_a_shared_port_that_has_not_answered_yet_is_left_out_until_it_does(
        serve: Callable[..., Server]) -> None:
    """A pod whose engine is still loading its model listens and never answers (vLLM binds its port
    first): the port's other engine is read alone meanwhile, without waiting out the scrape's
    timeout on it, and the pod is asked again; once it has answered as an engine, a round it fails
    gives no reading (its requests would be missing from the sum), as before."""
    engine = serve([content_length()] * 6)
    loading = socket.create_server(("127.0.0.2", engine.port))  # accepts into its backlog, answers nothing
    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=1.0, filtered=False, interval_s=0.05,
                                  addresses_of=lambda port: ("127.0.0.1", "127.0.0.2"),
                                  sends_spans=lambda port, address, since: False)
    try:
        began = time.monotonic()
        [load] = client.scrape_all([engine.port])
        assert time.monotonic() - began < 0.6  # NOT_YET_TIMEOUT_S on the loading pod, not the scrape's 1 s
        assert client.left_out == {engine.port: {"127.0.0.2"}} and load.running_by_address == (("127.0.0.1", 2),)
        loading.close()
        up = serve([content_length()], host="127.0.0.2", port=engine.port)  # one answer, then it stalls
        time.sleep(0.2)  # past the wait before it is asked again
        [load] = client.scrape_all([engine.port])
        assert client.left_out == {engine.port: frozenset()}
        assert load.running_by_address == (("127.0.0.1", 2), ("127.0.0.2", 2)) and up.connections == 1
        assert client.scrape_all([engine.port]) == [] and client.errors == 1  # an engine now: the round fails
    finally:
        client.close()


def test_each_ports_scrapes_are_counted_by_outcome(serve: Callable[..., Server]) -> None:
    # What /metrics shows of them (auditor_engine_scrapes_total): a port never read has no gauges.
    engine = serve([content_length()] * 2)
    no_engine = serve([b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nnot_ours 1\n"])
    refused = socket.create_server(("127.0.0.1", 0))
    down = refused.getsockname()[1]
    refused.close()
    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=1.0, filtered=False)
    try:
        loads = client.scrape_all([engine.port, no_engine.port, down])
        assert [load.server_port for load in loads] == [engine.port]
        assert client.outcomes() == {(engine.port, "read"): 1, (no_engine.port, "no_engine"): 1, (down, "failed"): 1}
    finally:
        client.close()


def test_a_server_gone_from_a_shared_port_is_asked_afresh_when_one_is_back_at_its_address(
        serve: Callable[..., Server]) -> None:
    """A pod answered as an engine, then left the node (the port served by one engine alone for a
    while); a pod later given its address, whose engine is still loading, is a new server: left
    out as not yet, not taken for the engine that answered there before (whose failure would cost
    the port every round, each waiting out the scrape's timeout)."""
    engine = serve([content_length()] * 6)
    second = serve([content_length()], host="127.0.0.2", port=engine.port)
    serving = ["127.0.0.1", "127.0.0.2"]
    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=1.0, filtered=False, interval_s=0.05,
                                  addresses_of=lambda port: tuple(serving), sends_spans=lambda port, address, since: False)
    try:
        [load] = client.scrape_all([engine.port])
        assert load.running_by_address == (("127.0.0.1", 2), ("127.0.0.2", 2))
        second.close()
        serving.remove("127.0.0.2")  # the pod is gone
        assert len(client.scrape_all([engine.port])) == 1
        loading = socket.create_server(("127.0.0.2", engine.port))  # another pod at its address, loading
        serving.append("127.0.0.2")
        began = time.monotonic()
        [load] = client.scrape_all([engine.port])
        assert time.monotonic() - began < 0.6 and client.errors == 0
        assert client.left_out == {engine.port: {"127.0.0.2"}} and load.running_by_address == (("127.0.0.1", 2),)
        loading.close()
    finally:
        client.close()


@pytest.mark.parametrize("restarted", [True, False], ids=["other-sockets", "same-sockets"])
def test_a_pod_whose_engine_restarted_is_asked_afresh(serve: Callable[..., Server], restarted: bool) -> None:
    """A pod's engine answered and sent spans, then crashed; the container restarted in its pod
    (same address) and its engine is loading its model: it listens on another socket and answers
    nothing. A new server: left out as not yet, so the port's other engine is read alone meanwhile;
    its spans from before the restart do not hold it in, one begun since does. The same sockets
    (no restart seen): an engine that answered before and fails now costs the round, as before."""
    engine = serve([content_length()] * 8)
    first = serve([content_length()], host="127.0.0.2", port=engine.port)
    sockets = {"127.0.0.2": frozenset({101})}
    spans_from: dict[str, int] = {}
    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=1.0, filtered=False, interval_s=0.05,
                                  addresses_of=lambda port: ("127.0.0.1", "127.0.0.2"),
                                  listening=lambda port, address: sockets.get(address),
                                  sends_spans=lambda port, address, since: spans_from.get(address, -1) >= since)
    try:
        [load] = client.scrape_all([engine.port])
        assert load.running_by_address == (("127.0.0.1", 2), ("127.0.0.2", 2))
        spans_from["127.0.0.2"] = time.time_ns()  # a request it served
        first.close()
        loading = socket.create_server(("127.0.0.2", engine.port))  # the restarted one, loading its model
        if restarted:
            sockets["127.0.0.2"] = frozenset({202})
        began = time.monotonic()
        loads = client.scrape_all([engine.port])
        if not restarted:
            assert loads == [] and client.errors == 1  # the engine it answered as before fails: no reading
            return
        assert time.monotonic() - began < 0.6 and client.errors == 0
        assert [load.running_by_address for load in loads] == [(("127.0.0.1", 2),)]
        assert client.left_out == {engine.port: {"127.0.0.2"}}
        spans_from["127.0.0.2"] = time.time_ns()  # it serves a request (spans from it, begun since)
        time.sleep(0.3)  # past the wait before it is asked again
        assert client.scrape_all([engine.port]) == [] and client.errors == 1
        loading.close()
    finally:
        client.close()


def test_a_listing_leaves_out_the_scrapers_own_connection_by_its_engines_address_too(
        serve: Callable[..., Server]) -> None:
    """Pods of one node serving one port: the scraper's connection to one of them and another's
    client (a gateway's, a host process's) may have the same address and port, told apart by the
    server's address. Only the scraper's own is left out; a lister that cannot tell the server's
    address ("") leaves out every client on the scraper's address and port, as before."""
    server = serve([content_length()] * 3)
    ends: list[tuple[str, int]] = []

    def listed(ports: object) -> dict[int, tuple[tuple[str, int, int, str], ...]]:
        (address, port), = ends
        return {server.port: ((address, port, 1, "127.0.0.1"), (address, port, 2, "10.244.1.6"),
                              (address, port, 3, "::ffff:127.0.0.1"), (address, port + 1, 4, "127.0.0.1"))}

    def unknown(ports: object) -> dict[int, tuple[tuple[str, int, int, str], ...]]:
        (address, port), = ends
        return {server.port: ((address, port, 1, ""), (address, port + 1, 2, ""))}

    def told(found: frozenset[tuple[str, int, int, str]]) -> None:
        ends[:] = [end[:2] for end in found]

    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False,
                                  listed_clients=listed, accepted=lambda: 0, on_connections=told)
    try:
        client.scrape_all([server.port])  # the scraper's connection, kept alive from now on
        client.want_clients([server.port])
        [load] = client.scrape_all([server.port])
        client.listed_clients = unknown
        [unknowing] = client.scrape_all([server.port])
    finally:
        client.close()
    assert load.connections is not None and [read for *_c, read, _s in load.connections] == [2, 4]
    assert unknowing.connections is not None and [read for *_c, read, _s in unknowing.connections] == [2]


@pytest.mark.parametrize(("moved", "port_says", "complete"), [
    (False, None, True), (True, True, True), (True, False, False), (True, None, False)],
    ids=["no accept", "accepts elsewhere", "an accept on the port", "cannot tell"])
def test_a_listing_the_namespaces_accepts_moved_around_asks_its_port(serve: Callable[..., Server], moved: bool,
                                                                      port_says: bool | None, complete: bool) -> None:
    """The /proc source counts every port's accepts: where that count moved between the listing and
    the scrape's answer, the lister is asked whether the listed port itself took a client."""
    server = serve([content_length()] * 2)
    counts = iter([0, 1 if moved else 0])
    asked: list[int] = []

    def listing_complete(port: int) -> bool | None:
        asked.append(port)
        return port_says

    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False,
                                  listed_clients=lambda ports: {port: () for port in ports},
                                  accepted=lambda: next(counts), listing_complete=listing_complete)
    client.want_clients([server.port])
    [load] = client.scrape_all([server.port])
    client.close()
    assert load.connections == () and load.connections_complete is complete
    assert asked == ([server.port] if moved else [])
    assert client.listings() == {(server.port, complete): 1}  # auditor_engine_listings_total


@pytest.mark.parametrize("cheap", [True, False], ids=["table", "walk"])
def test_a_busy_engines_scrapes_list_its_clients_where_listing_is_cheap(serve: Callable[..., Server],
                                                                         cheap: bool) -> None:
    """The daemon hears of a lone close up to the probe loop's poll late, and the scrapes in
    between, unlisted, said nothing of that client's work: with a lister that reads a table (the
    eBPF probe's), every scrape after one that showed requests held lists the clients, marked so
    (``listed_while_busy``); an idle engine's are not listed, nor, with a lister that walks the
    kernel's sockets, a busy one's until a client leaves."""
    idle = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    server = serve([content_length(idle), content_length(), content_length(), content_length(idle),
                    content_length(idle)])
    asked: list[list[int]] = []

    def lister(ports: object) -> dict[int, tuple[tuple[str, int, int, str], ...]]:
        asked.append(sorted(ports))  # type: ignore[call-overload]
        return {port: (("127.0.0.1", 40000, 1, "127.0.0.1"),) for port in ports}  # type: ignore[attr-defined]

    client = EngineMetricsScraper(lambda: [], lambda loads: None, timeout_s=2, filtered=False,
                                  listed_clients=lister, list_while_busy=cheap)
    loads = [client.scrape_all([server.port])[0] for _ in range(5)]
    client.close()
    # idle, busy (listed from the next on), busy, idle (still listed: the last scrape held), idle
    listed = [load.connections is not None for load in loads]
    assert listed == ([False, False, True, True, False] if cheap else [False] * 5), listed
    assert [load.listed_while_busy for load in loads] == listed
    assert len(asked) == sum(listed)


@pytest.mark.parametrize(("answer", "error"), [
    (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", "HTTP 404"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_PAGE_BYTES + 1), "bytes (at most"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "invalid literal"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\nshort", "closed in the middle"),
], ids=["not found", "too large", "not http", "bad chunk", "cut short"])
def test_an_answer_that_is_no_page_is_an_error_naming_why(serve: Callable[..., Server], answer: bytes, error: str) -> None:
    server = serve([answer])
    client = scraper()
    with pytest.raises(Exception, match=error.replace("(", r"\(")):
        client.scrape(server.port)
    client.close()


def test_an_engine_that_answered_before_is_tried_again_soon_after_a_failed_scrape(serve: Callable[..., Server]) -> None:
    """One failed scrape of an engine that answered before (a /metrics slow past the timeout under
    load) kept its gauges away for 30 s, every zombie of that time left to its spans: it is tried
    again at the rate, then twice as long after each failure in a row; a port that never answered
    as an engine still waits 30 s."""
    import time

    from collectors.enginemetrics import NOT_AN_ENGINE_BACKOFF_S

    def hang_up(conn: socket.socket) -> None:
        conn.close()

    server = serve([content_length(), hang_up, hang_up, hang_up, content_length()])
    client = EngineMetricsScraper(lambda: [], lambda loads: None, interval_s=0.25, timeout_s=2, filtered=False)
    assert len(client.scrape_all([server.port])) == 1
    waits = []
    for _ in range(2):  # hung up on: the kept connection and then a fresh one, then a fresh one
        began = time.monotonic()
        assert client.scrape_all([server.port]) == []
        waits.append(client._skip_until[server.port] - began)
        client._skip_until[server.port] = 0.0  # as if that wait were over
    assert 0.2 < waits[0] < 0.35 and 0.45 < waits[1] < 0.6, waits
    [load] = client.scrape_all([server.port])
    assert load.running == 2 and server.port not in client._skip_until
    client.close()
    never = socket.socket()
    never.bind(("127.0.0.1", 0))  # bound, never listening: refused
    began = time.monotonic()
    assert client.scrape_all([never.getsockname()[1]]) == []
    assert client._skip_until[never.getsockname()[1]] - began > NOT_AN_ENGINE_BACKOFF_S - 1
    never.close()


def test_a_newly_watched_port_is_scraped_at_once_while_the_old_ones_back_off(serve: Callable[..., Server]) -> None:
    import time

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: refused, so backed off
    ports = [dead.getsockname()[1]]
    loads: list[object] = []
    scraper = EngineMetricsScraper(lambda: list(ports), loads.extend, interval_s=0.25, timeout_s=2).start()
    try:
        time.sleep(0.5)  # the dead port failed and backs off: the loop sleeps
        server = serve([content_length()] * 50)
        ports.append(server.port)
        changed_at = time.monotonic()
        scraper.ports_changed()
        while not loads and time.monotonic() - changed_at < 5:
            time.sleep(0.01)
        assert loads and time.monotonic() - changed_at < 0.5
        first = len(loads)
        time.sleep(0.6)
        assert len(loads) - first >= 2  # and then at the scrape rate, not after the old back-off
    finally:
        scraper.stop()
        dead.close()


class DescribelessCollector:
    """vLLM's gauges from a collector that cannot name its series in advance, as prometheus_client's
    multiprocess collector: a registry answers ``name[]`` for it with nothing."""

    def __init__(self, running: float) -> None:
        self.running = running

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("vllm:num_requests_running", "Running.", value=self.running)
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Waiting.", value=1)
        aborts = CounterMetricFamily("vllm:request_success", "Finished.", labels=["finished_reason"])
        aborts.add_metric(["abort"], 2)
        yield aborts


@pytest.fixture
def vllm_registry() -> Iterator[tuple[object, int]]:
    """A real prometheus_client server (the library vLLM and SGLang serve /metrics with) of a
    vLLM-like registry: its gauges, its abort counter and many histograms."""
    with serving_vllm_registry(running=3, waiting=1) as served:
        yield served


@contextlib.contextmanager
def stepping(registry: object, every_s: float = 0.05) -> Iterator[None]:
    """The engine runs what its gauges hold: its generated-token counter moves at every step."""
    import threading

    from prometheus_client import CollectorRegistry, Counter

    assert isinstance(registry, CollectorRegistry)
    tokens = next(c for c, names in registry._collector_to_names.items() if "vllm:generation_tokens_total" in names)
    assert isinstance(tokens, Counter)
    stop = threading.Event()

    def step() -> None:
        while not stop.wait(every_s):
            tokens.inc(4)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@contextlib.contextmanager
def serving_vllm_registry(running: int, waiting: int) -> Iterator[tuple[object, int]]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Running.", registry=registry).set(running)
    Gauge("vllm:num_requests_waiting", "Waiting.", registry=registry).set(waiting)
    Counter("vllm:generation_tokens", "Tokens.", registry=registry).inc(1234)
    Counter("vllm:prompt_tokens", "Prompt tokens.", registry=registry).inc(4321)  # a step series too
    Counter("vllm:request_success", "Finished.", ["finished_reason"], registry=registry).labels("abort").inc(2)
    for i in range(40):
        Histogram(f"vllm:latency_{i}_seconds", "A histogram.", registry=registry,
                  buckets=[0.01 * 2 ** (b / 3) for b in range(38)]).observe(0.5)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield registry, server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_prometheus_client_engine_is_scraped_for_its_known_series_only(vllm_registry: tuple[object, int]) -> None:
    import urllib.request

    from collectors.enginemetrics import filtered_path

    _, port = vllm_registry
    client = EngineMetricsScraper(lambda: [port], lambda loads: None, timeout_s=2)
    first = client.scrape(port)
    assert client.filters == {(port, "127.0.0.1"): True}  # its short page has every series its whole page has
    loads = [first] + [client.scrape(port) for _ in range(3)]
    client.close()
    assert {(x.running, x.waiting, x.generated_tokens, x.aborted) for x in loads if x} == {(3, 1, 1234.0, 2.0)}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        whole = answer.read()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{filtered_path('/metrics')}", timeout=5) as answer:
        short = answer.read()
    assert len(short) * 20 < len(whole)  # what each scrape reads from now on


def test_an_engine_whose_short_page_lacks_series_is_read_whole(vllm_registry: tuple[object, int]) -> None:
    from prometheus_client import CollectorRegistry

    registry, port = vllm_registry
    assert isinstance(registry, CollectorRegistry)
    client = EngineMetricsScraper(lambda: [port], lambda loads: None, timeout_s=2)
    assert client.scrape(port) is not None and client.filters[(port, "127.0.0.1")] is True
    # The engine is replaced by one whose registry answers name[] with nothing (multiprocess mode).
    for collector in list(registry._collector_to_names):
        registry.unregister(collector)
    registry.register(DescribelessCollector(running=5))
    load = client.scrape(port)  # the short page fails: the whole page, in the same scrape
    assert load is not None and (load.running, load.waiting, load.aborted) == (5, 1, 2.0)
    assert (port, "127.0.0.1") not in client.filters
    load = client.scrape(port)  # asked both ways again: the short page is not used
    assert load is not None and load.running == 5 and client.filters[(port, "127.0.0.1")] is False
    client.close()


def test_quiet_engines_are_scraped_seldom_until_a_request_or_a_departure(vllm_registry: tuple[object, int]) -> None:
    import time

    from prometheus_client import CollectorRegistry, Gauge

    registry, port = vllm_registry
    assert isinstance(registry, CollectorRegistry)
    gauges = {name: c for c, names in registry._collector_to_names.items() for name in names}
    running, waiting = gauges["vllm:num_requests_running"], gauges["vllm:num_requests_waiting"]
    assert isinstance(running, Gauge) and isinstance(waiting, Gauge)
    running.set(0)
    waiting.set(0)  # the engine holds nothing
    scraped: list[float] = []
    scraper = EngineMetricsScraper(lambda: [port], lambda loads: scraped.append(time.monotonic()),
                                   interval_s=0.05, timeout_s=2, quiet_after_s=0.5, quiet_interval_s=1.0).start()
    try:
        time.sleep(2.5)  # 0.5 s at the rate, then quiet: about two more scrapes, not forty
        assert scraper.quiet and sum(1 for t in scraped if t > scraped[0] + 1.0) <= 3
        scraper.activity()  # a client left: scraped at once, and at the rate again
        left_at = time.monotonic()
        time.sleep(0.3)
        after = [t for t in scraped if t >= left_at]
        assert after and after[0] - left_at < 0.2 and len(after) >= 3 and not scraper.quiet
        time.sleep(1.0)  # quiet again; then the engine takes a request: seen at the next quiet scrape
        assert scraper.quiet
        running.set(2)
        with stepping(registry):
            time.sleep(1.3)
            assert not scraper.quiet
    finally:
        scraper.stop()


def test_gauges_no_step_refreshes_let_the_port_go_quiet(vllm_registry: tuple[object, int]) -> None:
    """vLLM's gauges after every request was aborted at once keep their last values, and its step
    counters stand still: scraped at the rate for as long as they said so, the port now goes quiet
    as an idle one does, and busy again once the engine steps."""
    import time

    registry, port = vllm_registry
    scraper = EngineMetricsScraper(lambda: [port], lambda loads: None, interval_s=0.05, timeout_s=2,
                                   quiet_after_s=0.5, quiet_interval_s=1.0).start()
    try:
        time.sleep(2.5)  # three held, no step: still after 1 s, quiet 0.5 s later
        assert scraper.quiet
        with stepping(registry):  # the engine steps again
            time.sleep(1.3)
            assert not scraper.quiet
    finally:
        scraper.stop()


def test_an_idle_engine_beside_a_busy_one_is_scraped_at_the_quiet_rate() -> None:
    import time

    scraped: dict[int, list[float]] = {}

    def keep(loads: list[EngineLoad]) -> None:
        for load in loads:
            scraped.setdefault(load.server_port, []).append(time.monotonic())

    with serving_vllm_registry(running=2, waiting=0) as (busy_registry, busy), \
            serving_vllm_registry(running=0, waiting=0) as (_, idle), stepping(busy_registry):
        scraper = EngineMetricsScraper(lambda: [busy, idle], keep, interval_s=0.05, timeout_s=2,
                                       quiet_after_s=0.5, quiet_interval_s=1.0).start()
        try:
            time.sleep(3.0)  # the idle one: 0.5 s at the rate, then about once a second
            later = {port: [t for t in times if t > times[0] + 1.0] for port, times in scraped.items()}
            assert len(later[busy]) >= 20 and 1 <= len(later[idle]) <= 3
            assert scraper.quiet_ports() == {idle} and not scraper.quiet
            scraper.activity({busy})  # a client left the busy engine: the idle one stays quiet
            assert scraper.quiet_ports() == {idle}
            left_at = time.monotonic()
            scraper.activity({idle})  # and now the idle one: scraped at once, then at the rate
            time.sleep(0.3)
            after = [t for t in scraped[idle] if t >= left_at]
            assert after and after[0] - left_at < 0.2 and len(after) >= 3 and not scraper.quiet_ports()
        finally:
            scraper.stop()


def page(style: str, running: int, waiting: int, tokens: float | None = None, model: str = "m") -> bytes:
    """A metrics page of ``style``'s names (vLLM's or SGLang's), labelled with ``model``."""
    names = {"vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total"),
             "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens_total")}[style]
    lines = [f'{names[0]}{{model_name="{model}"}} {running}', f'{names[1]}{{model_name="{model}"}} {waiting}']
    if tokens is not None:
        lines.append(f'{names[2]}{{model_name="{model}"}} {tokens}')
    return content_length(("\n".join(lines) + "\n").encode())


def test_a_port_several_containers_serve_is_read_as_the_sum_of_their_engines(serve: Callable[..., Server]) -> None:
    """Pods of a node serving one port, each in a network of its own, are scraped each at its own
    address and read as one engine: counts summed, over the window from the first request to the
    last answer. A round one of them does not answer as an engine of the same kind gives nothing
    (without its requests the others' orphans would look gone): an error, counted. So does one
    that answers as no engine, where the scraper cannot tell whether spans came from it."""
    first = serve([page("vllm", 2, 1, 100.0)] * 3)
    second = serve([page("vllm", 3, 0, 50.0), page("sglang", 1, 0),
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno"], host="127.0.0.2", port=first.port)
    client = EngineMetricsScraper(lambda: [first.port], lambda loads: None, timeout_s=2, filtered=False,
                                  addresses_of=lambda port: ("127.0.0.1", "127.0.0.2"))
    load = client.scrape(first.port)
    assert load is not None and (load.running, load.waiting, load.generated_tokens) == (5, 1, 150.0)
    assert load.server_port == first.port and load.style == "vllm" and load.model == "m"
    assert load.running_by_address == (("127.0.0.1", 2), ("127.0.0.2", 3))
    assert load.answered_ns is not None and load.ts_ns <= load.answered_ns
    with pytest.raises(OSError, match="engines of different kinds"):
        client.scrape(first.port)
    assert client.scrape_all() == [] and client.errors == 1  # the second answered no metrics page
    client.close()
    assert first.connections == 1 and second.connections == 1  # kept alive, each at its own address


def test_the_sum_of_engines_lacks_what_one_of_them_lacks() -> None:
    from collectors.enginemetrics import summed

    loads = [EngineLoad(ts_ns=10, server_port=8000, running=1, generated_tokens=5.0, model="a", style="vllm",
                        aborted=None, answered_ns=20),
             EngineLoad(ts_ns=12, server_port=8000, running=2, waiting=4, generated_tokens=None, model="b",
                        style="vllm", aborted=None, answered_ns=30)]
    load = summed(loads, ("10.0.0.1", "10.0.0.2"))
    assert (load.running, load.waiting, load.generated_tokens, load.model, load.aborted) == (3, 4, None, None, None)
    assert (load.ts_ns, load.answered_ns) == (10, 30)


def test_the_doctor_says_whose_gauges_each_watched_port_gives(serve: Callable[..., Server]) -> None:
    """`auditor doctor`'s engine_metrics check: one scrape of each watched port that is listened on;
    degraded where one gives no gauges (a 404 here: llama.cpp without --metrics), as an abort an
    engine sends no span for is then unconfirmed there. A port nothing listens on is the engines
    check's to name."""
    from auditor.cli.doctor import DEGRADED, OK, check_engine_metrics

    engine = serve([content_length()] * 2)
    plain = serve([b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"])
    nothing = socket.create_server(("127.0.0.1", 0))
    idle = nothing.getsockname()[1]
    nothing.close()
    good = check_engine_metrics([engine.port, idle])
    assert good.state == OK and good.detail == f"port {engine.port}: vllm gauges read (2 running, 1 waiting)"
    bad = check_engine_metrics([engine.port, plain.port])
    assert bad.state == DEGRADED and bad.detail.startswith(
        f"port {engine.port}: vllm gauges read (2 running, 1 waiting); port {plain.port}: /metrics not read (HTTP 404)")
    assert "llama.cpp: --metrics" in bad.fix
    assert check_engine_metrics([idle]).detail == "no watched port is listened on yet"
    assert check_engine_metrics([engine.port], scrape=False).state == DEGRADED
