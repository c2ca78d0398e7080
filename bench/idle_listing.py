"""What telling clients kept alive between requests costs the eBPF listing (``probes.bpf``
``_idle_clients``): sock_diag asked one quiet client at a time (a hash lookup each, with its
tcp_info) against one walk of the ports (every bucket of the established hash), for so many
connected clients, each answered and quiet. CPU of this thread (user + system) a listing's ask,
medians of repeated asks; run as root or not (sock_diag lists this namespace to any user).

Usage: .venv/bin/python bench/idle_listing.py [--clients 1,8,32,128] [--repeats 200]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes.sockdiag import SockDiag, SocketKey


def cpu_us(call: object, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        before = time.thread_time_ns()
        call()  # type: ignore[operator]
        samples.append((time.thread_time_ns() - before) / 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    counts = sorted(int(n) for n in args.clients.split(","))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1024)
    port = server.getsockname()[1]
    clients, ends = [], []
    diag = SockDiag()
    print(f"clients answered and quiet, one port; CPU of one ask, us (median of {args.repeats})")
    print(f"{'clients':>8}{'lookups':>12}{'walk':>12}{'walk / lookups':>16}")
    try:
        for count in counts:
            while len(clients) < count:
                client = socket.create_connection(("127.0.0.1", port))
                clients.append(client)
                ends.append(server.accept()[0])
            keys: list[SocketKey] = [(4, "127.0.0.1", port, "127.0.0.1", c.getsockname()[1]) for c in clients]
            lookups = cpu_us(lambda keys=keys: diag.idle_of(keys), args.repeats)
            walk = cpu_us(lambda: diag.established(frozenset({port})), args.repeats)
            print(f"{count:>8}{lookups:>12.0f}{walk:>12.0f}{walk / lookups:>16.2f}")
    finally:
        diag.close()
        for sock in (*clients, *ends, server):
            sock.close()


if __name__ == "__main__":
    main()
