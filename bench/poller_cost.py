"""What the /proc fallback's poller thread costs, poll by poll: its own CPU (the scheduler's
nanoseconds of that one thread), so the load and the rest of the process are not in the figure.

Scenarios, each in a fresh process, the poller at 20 Hz on a loopback listener's port:

- idle: nothing on the port (the idle poll: a read of the namespace's accept counter);
- listed: one kept-alive connection on the port, which every poll looks up;
- own: the same connection, named as the daemon's own (its scrape of the engine), so left out;
- out: nothing on the port, while this host calls out 20 times a second (connects to a closed
  loopback port: outgoing opens with no accept, as an engine's or an agent's calls elsewhere);
- load: 100 short connections a second (send, answer, close) from another thread.

Then what one walk of the kernel's established hash costs here, and how many TCP sockets this
namespace holds: under load most of a poll is that walk, which grows with the hash (with the
host's memory) and with the sockets in it (TIME_WAIT included). With ``--time-wait 5000,15000``,
the walk again with that many loopback connections closed client first, each left in TIME_WAIT
for the kernel's 60 s, as a host serving a connection a request holds them (at 100 a second,
6,000).

With ``--compare REV`` git revision REV's poller runs too, alternately, each tree in its own
processes (``--rounds``); a tree whose poller cannot be told its own connections shows "-" there.

Usage: .venv/bin/python bench/poller_cost.py [--seconds 6] [--rounds 3] [--compare REV] [--scenarios idle,out,load]
                                             [--time-wait 5000,15000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fallback_cpu import load, serve  # the same listener and load as the polled sources' bench

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("idle", "listed", "own", "out", "load")
CALLS_OUT_PER_S = 20.0
POLL_HZ = 20.0
LOAD_PER_S = 100.0


def call_out(per_s: float, stop: threading.Event) -> None:
    """Connects to a closed loopback port ``per_s`` times a second: each an outgoing open, refused."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    while not stop.wait(1 / per_s):
        with contextlib.suppress(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port)).close()


def measure(scenario: str, seconds: float) -> dict[str, float] | None:
    """The poller thread's CPU, in this process (whose ``probes`` is the tree under test)."""
    from probes.procfs import ProcfsConnEventSource

    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    port = listener.getsockname()[1]
    stop = threading.Event()
    held: list[socket.socket] = []
    if scenario in ("listed", "own"):
        held.append(socket.create_connection(("127.0.0.1", port)))
        held.append(listener.accept()[0])
    else:
        threading.Thread(target=serve, args=(listener, stop), daemon=True).start()
    source = ProcfsConnEventSource([port], poll_hz=POLL_HZ)
    if scenario == "own":
        if not hasattr(source, "set_own_endpoints"):
            return None
        end = (*held[0].getsockname()[:2], port, "127.0.0.1")
        for named in (end, end[:3], end[:2]):  # trees from before the server's address, or port, named one
            try:
                source.set_own_endpoints({named})
                break
            except ValueError:
                continue
    source.start()
    threading.Thread(target=lambda: [source.poll(0.05) for _ in iter(stop.is_set, True)], daemon=True).start()
    if scenario == "load":
        threading.Thread(target=load, args=(port, LOAD_PER_S, stop), daemon=True).start()
    if scenario == "out":
        threading.Thread(target=call_out, args=(CALLS_OUT_PER_S, stop), daemon=True).start()
    time.sleep(1.0)
    thread = source._thread
    assert thread is not None and thread.native_id is not None
    schedstat = Path(f"/proc/self/task/{thread.native_id}/schedstat")

    def cpu_s() -> float:
        return int(schedstat.read_text().split()[0]) / 1e9

    before, started = cpu_s(), time.monotonic()
    time.sleep(seconds)
    spent, wall = cpu_s() - before, time.monotonic() - started
    stop.set()
    source.stop()
    for sock in held:
        sock.close()
    listener.close()
    return {"percent": spent / wall * 100, "us_per_poll": spent / (wall * POLL_HZ) * 1e6}


def child(tree: Path, scenario: str, seconds: float) -> dict[str, float] | None:
    result = subprocess.run([sys.executable, __file__, "--child", scenario, "--seconds", str(seconds)],
                            env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                            check=True, capture_output=True, text=True)
    answer: dict[str, float] | None = json.loads(result.stdout)
    return answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured time of each run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree and scenario")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's poller, alternately")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ", ".join(SCENARIOS))
    parser.add_argument("--time-wait", type=counts_list, default=[], metavar="N,N",
                        help="also time the walk with this many more sockets in TIME_WAIT each (comma-separated, "
                             "rising; at most 20,000: the ephemeral ports of one loopback address)")
    parser.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.seconds)))
        return 0
    scenarios = [name for name in SCENARIOS if name in args.scenarios.split(",")]
    sys.path.insert(0, str(REPO))
    trees = {"working tree": REPO}
    work = None
    if args.compare:
        from bench.ingest import export_tree

        work = tempfile.TemporaryDirectory(prefix="poller-cost-")
        trees = {args.compare: export_tree(args.compare, Path(work.name)), "working tree": REPO}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_no in range(1, args.rounds + 1):
        for scenario in scenarios:
            for label, tree in trees.items():
                figure = child(tree, scenario, args.seconds)
                if figure is not None:
                    results.setdefault((label, scenario), []).append(figure)
        print(f"round {round_no} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"/proc poller thread at {POLL_HZ:g} Hz, its own CPU: % of one core (us a poll), "
          f"medians of {args.rounds} runs of {args.seconds:g} s")
    print(f"  {'':<34}" + "".join(f"{label:>22}" for label in trees))
    titles = {"idle": "idle port", "listed": "one connection, looked up", "own": "one connection, the daemon's own",
              "out": f"idle, {CALLS_OUT_PER_S:g} calls out/s",
              "load": f"{LOAD_PER_S:g} connections/s"}
    for scenario in scenarios:
        cells = []
        for label in trees:
            runs = results.get((label, scenario))
            if not runs:
                cells.append("-")
                continue
            percent = statistics.median(run["percent"] for run in runs)
            per_poll = statistics.median(run["us_per_poll"] for run in runs)
            cells.append(f"{percent:.2f} ({per_poll:.0f})")
        print(f"  {titles[scenario]:<34}" + "".join(f"{cell:>22}" for cell in cells))
    from probes.sockdiag import tcp_socket_counts, walk_cpu_us

    counts = tcp_socket_counts()
    print(f"  one walk of the established hash (a dump for an unused port): {walk_cpu_us(300):.0f} us of CPU, "
          f"this namespace holding {counts.get('inuse', 0)} TCP sockets in use and {counts.get('tw', 0)} in TIME_WAIT")
    for asked, held, walk_us in time_wait_walks(args.time_wait, walk_cpu_us, tcp_socket_counts):
        print(f"  the walk with {asked:,} more in TIME_WAIT ({held:,} counted by the kernel): {walk_us:.0f} us of CPU")
    from probes.sockdiag import DECODED_CACHE_MAX

    each = decoded_id_bytes(DECODED_CACHE_MAX)
    print(f"  a decoded socket id kept: {each:.0f} bytes (tracemalloc); a reader keeps {DECODED_CACHE_MAX:,} "
          f"at most, {each * DECODED_CACHE_MAX / 2**20:.1f} MiB, where 65,536 made {each * 65_536 / 2**20:.1f}")
    if work is not None:
        work.cleanup()
    return 0


def counts_list(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers, e.g. 5000,15000") from None
    if counts != sorted(counts) or any(n < 0 or n > 20_000 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: rising counts from 0 to 20,000")
    return counts


def time_wait_walks(counts: list[int], walk_cpu_us: Callable[[int], float],
                    socket_counts: Callable[[], dict[str, int]]) -> list[tuple[int, int, float]]:
    """For each count (rising), (count, the kernel's TIME_WAIT count, one walk's CPU in us) with that
    many more loopback connections closed client first: each client end stays in TIME_WAIT, in
    the established hash the walk reads. The connections are made at once, well inside the 60 s
    a TIME_WAIT socket lasts."""
    if not counts:
        return []
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    port = listener.getsockname()[1]

    def serve_closes() -> None:  # the server end closes on the client's FIN, after it
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener closed: done
            with conn:
                conn.recv(1)

    server = threading.Thread(target=serve_closes, daemon=True)
    server.start()
    rows, made = [], 0
    try:
        for count in counts:
            for _ in range(count - made):
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    pass  # nothing sent or unread: the close is a FIN, and this end waits in TIME_WAIT
            made = count
            time.sleep(0.2)  # the server ends closed too
            rows.append((count, socket_counts().get("tw", 0), walk_cpu_us(200)))
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        listener.close()
        server.join(timeout=5)
    return rows


def decoded_id_bytes(count: int) -> float:
    """Python memory a sock_diag reader holds for each socket id it keeps decoded (the id's bytes,
    its key of addresses and ports), as a port taking a connection a request makes them."""
    import struct
    import tracemalloc

    from probes.sockdiag import _decoded_key

    loopback = socket.inet_pton(socket.AF_INET, "127.0.0.1") + bytes(12)
    messages = [bytes([socket.AF_INET, 1, 0, 0]) + struct.pack(">HH", 8000, 1024 + i) + loopback * 2 + bytes(32)
                for i in range(count)]
    decoded: dict = {}
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for message in messages:
        _decoded_key(decoded, message, 0)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / count


if __name__ == "__main__":
    raise SystemExit(main())
