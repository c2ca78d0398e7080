"""What the /proc fallback sees of connections shorter than its poll interval, with and without the
kernel's notices of freed sockets, side by side on the same traffic.

Two fallback sources watch one loopback listener at the same rate (default 20 Hz): one reads the
kernel's notices (probes.sockdiag.DestroyNotices), the other polls alone. Clients connect, send a
request, and leave after a drawn lifetime, half with a FIN, half with a reset; the server reads
the request and closes its end as soon as it sees the client gone (as an asyncio server does).
For each lifetime, per source: the share of clients whose leaving is reported (a peer_fin or
peer_rst on its connection), the share whose event interval holds the moment it left (measured
around the client's close), the share reported with the right kind (FIN or RST), and the median
interval width; then each poller thread's CPU (its own scheduler clock) over the run.

Usage: .venv/bin/python bench/short_connections.py [--seconds 20] [--rate 50] [--poll-hz 20]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fallback_cpu import serve  # the polled sources' bench's listener

from auditor.model import ConnEvent, ConnEventKind
from probes.procfs import ProcfsConnEventSource

LIFETIMES_MS = (0, 5, 10, 20, 40, 80, 200)
DEPARTURES = {ConnEventKind.PEER_FIN: "fin", ConnEventKind.PEER_RST: "rst"}


def handle(conn: socket.socket) -> None:
    """Read the request, then wait for the client to leave and close at once."""
    with conn, contextlib.suppress(OSError):
        conn.recv(1024)
        while conn.recv(1024):
            pass


def client(port: int, lifetime_ms: int, kind: str) -> tuple[int, int, int, int]:
    """One connection; (its port, ns before it connected, ns just before it left, ns just after)."""
    connecting = time.time_ns()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    time.sleep(lifetime_ms / 1000)
    if kind == "rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    before = time.time_ns()
    client_port = sock.getsockname()[1]
    sock.close()
    return client_port, connecting, before, time.time_ns()


def thread_cpu_s(source: ProcfsConnEventSource) -> float:
    """The poller thread's CPU so far: its scheduler clock (/proc/self/task/<tid>/schedstat)."""
    thread = source._thread  # the poller's: its own clock, not the process's
    assert thread is not None and thread.native_id is not None
    return int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[0]) / 1e9


def collect(source: ProcfsConnEventSource, into: list[ConnEvent], stop: threading.Event) -> None:
    while not stop.is_set():
        into.extend(source.poll(timeout_s=0.05))


def _share(count: int, of: int) -> str:
    return f"{100 * count / of:5.1f}%" if of else "    -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of clients")
    parser.add_argument("--rate", type=float, default=50.0, help="clients started a second")
    parser.add_argument("--poll-hz", type=float, default=20.0)
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    port = listener.getsockname()[1]
    stop = threading.Event()
    threading.Thread(target=serve, args=(listener, stop, handle), daemon=True).start()

    sources = {"notices": ProcfsConnEventSource([port], poll_hz=args.poll_hz, sock_diag=True),
               "polls alone": ProcfsConnEventSource([port], poll_hz=args.poll_hz, sock_diag=True)}
    if sources["notices"].notices is None:
        sys.exit("the kernel gives no notices of freed sockets here (sock_diag destroy groups, Linux 4.9 on)")
    sources["polls alone"]._close_notices()  # the same poller, as it runs where the kernel gives none
    events: dict[str, list[ConnEvent]] = {name: [] for name in sources}
    collectors = [threading.Thread(target=collect, args=(source, events[name], stop), daemon=True)
                  for name, source in sources.items()]
    for source in sources.values():
        source.start()
    for thread in collectors:
        thread.start()
    cpu_before = {name: thread_cpu_s(source) for name, source in sources.items()}

    rng = random.Random(7)
    # (client port, connecting, lifetime, kind, before, after): a reset frees its client port at
    # once, and a later client may get it, so events are told apart by time too (``whose``).
    left: list[tuple[int, int, int, str, int, int]] = []
    lock = threading.Lock()

    def one(lifetime_ms: int, kind: str) -> None:
        client_port, connecting, before, after = client(port, lifetime_ms, kind)
        with lock:
            left.append((client_port, connecting, lifetime_ms, kind, before, after))

    started = time.monotonic()
    clients: list[threading.Thread] = []
    count = int(args.seconds * args.rate)
    for index in range(count):
        thread = threading.Thread(target=one, args=(LIFETIMES_MS[index % len(LIFETIMES_MS)], rng.choice(("fin", "rst"))))
        thread.start()
        clients.append(thread)
        time.sleep(max(0.0, started + (index + 1) / args.rate - time.monotonic()))
        if index % max(1, int(args.rate)) == 0:
            print(f"\r{index + 1}/{count} clients", end="", file=sys.stderr, flush=True)
    for thread in clients:
        thread.join()
    print(file=sys.stderr)
    time.sleep(0.5)  # the last polls
    wall = time.monotonic() - started
    cpu = {name: thread_cpu_s(source) - cpu_before[name] for name, source in sources.items()}
    stop.set()
    for thread in collectors:
        thread.join()
    for source in sources.values():
        source.stop()

    print(f"{len(left)} clients over {wall:.1f} s, the fallback at {args.poll_hz:g} Hz "
          f"({1000 / args.poll_hz:.0f} ms between polls); a server that closes when its client leaves")
    print("by the client's lifetime after its request: reported / interval holds the leaving / kind right; "
          "median interval ms")
    names = list(sources)
    print(f"{'lifetime ms':>11}  " + "  ".join(f"{name:>30}" for name in names))
    by_port: dict[int, list[tuple[int, int, int, str, int, int]]] = {}
    for entry in sorted(left, key=lambda entry: entry[1]):
        by_port.setdefault(entry[0], []).append(entry)

    def whose(event: ConnEvent) -> tuple[int, int, int, str, int, int] | None:
        """The client of the event's port that connected last before the event's end."""
        found = None
        for entry in by_port.get(event.client_port, ()):
            if entry[1] > event.ts_ns:
                break
            found = entry
        return found

    reported = {name: {} for name in names}  # client -> its first departure event
    for name in names:
        for event in events[name]:
            entry = whose(event) if event.kind in DEPARTURES else None
            if entry is not None:
                reported[name].setdefault(entry, event)
    for lifetime in LIFETIMES_MS:
        clients_of = [entry for entry in left if entry[2] == lifetime]
        cells = []
        for name in names:
            holds = right = 0
            widths = []
            mine = [(entry, reported[name][entry]) for entry in clients_of if entry in reported[name]]
            for (_port, _connecting, _life, kind, before, after), event in mine:
                earliest = event.earliest_ns if event.earliest_ns is not None else event.ts_ns
                holds += earliest <= after and before <= event.ts_ns
                right += DEPARTURES[event.kind] == kind
                widths.append((event.ts_ns - earliest) / 1e6)
            width = f"{statistics.median(widths):5.1f}" if widths else "    -"
            cells.append(" ".join(_share(n, len(clients_of)) for n in (len(mine), holds, right)) + f" {width}")
        print(f"{lifetime:>11}  " + "  ".join(f"{cell:>30}" for cell in cells))
    print("poller thread CPU, % of one core: " + ", ".join(f"{name} {100 * cpu[name] / wall:.2f}" for name in names))
    listener.close()


if __name__ == "__main__":
    main()
