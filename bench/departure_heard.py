"""How soon the daemon hears that a client left: from the client's close to the probe loop's
report of it (``Daemon._took``, which wakes the port's scrapes and the GPU sampler), for lone
closes on a quiet host and for bursts of closes a few milliseconds apart, with the eBPF probe.
Also the probe thread's CPU and wake-ups while idle and during the closes.

Runs the daemon in this process (as root) against a plain TCP server on loopback that reads what
each client sends; every client sends a line, reads nothing, and half-closes (a FIN).
Run it from another tree (a git worktree) to compare: the probe program is that tree's.

Usage: .venv/bin/python bench/departure_heard.py [--lone 20] [--bursts 10] [--burst-size 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.detection import thread_cpu_seconds
from bench.fallback_cpu import serve
from tests.e2e import running_daemon


def drain(conn: socket.socket) -> None:
    """The server side of a client: read to its end, then close."""
    with conn:
        while conn.recv(4096):
            pass


def probe_thread(native_id: int) -> tuple[float, int]:
    """The probe thread's CPU seconds and voluntary wake-ups so far."""
    return thread_cpu_seconds(os.getpid())[native_id]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lone", type=int, default=20, help="lone closes, 0.6 s apart")
    parser.add_argument("--bursts", type=int, default=10, help="bursts of closes, 0.6 s apart")
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--burst-gap-ms", type=float, default=30.0, help="between the closes of a burst")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()
    threading.Thread(target=serve, args=(listener, stop, drain), daemon=True).start()
    heard: list[tuple[int, int]] = []  # (monotonic ns, departures reported), in order
    tmp = Path(tempfile.mkdtemp(prefix="departure-heard-"))
    with running_daemon(tmp, **{"probe.source": "bpf", "engine_metrics.scrape": False}) as daemon:
        took = daemon._took

        def recording(taken, found, writer):  # type: ignore[no-untyped-def]
            left = sum(fins + resets for fins, resets, _ in found)
            if left:
                heard.append((time.monotonic_ns(), left))
            return took(taken, found, writer)

        daemon._took = recording  # type: ignore[method-assign]
        daemon.set_ports({port})
        time.sleep(1.0)
        probe = next(t.native_id for t in threading.enumerate() if t.name == "probe")
        assert probe is not None
        (cpu0, woken0), t0 = probe_thread(probe), time.monotonic()
        time.sleep(args.idle_seconds)
        (cpu1, woken1), idle_s = probe_thread(probe), time.monotonic() - t0
        idle_cpu, idle_woken = (cpu1 - cpu0) / idle_s, (woken1 - woken0) / idle_s

        closes: list[tuple[str, int]] = []

        def leave(kind: str) -> None:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"hello\n")
            time.sleep(0.02)
            closes.append((kind, time.monotonic_ns()))
            sock.shutdown(socket.SHUT_WR)
            threading.Timer(2.0, sock.close).start()

        (cpu0, woken0), t0 = probe_thread(probe), time.monotonic()
        for _ in range(args.lone):
            leave("lone")
            time.sleep(0.6)
        for _ in range(args.bursts):
            for _ in range(args.burst_size):
                leave("burst")
                time.sleep(args.burst_gap_ms / 1000)
            time.sleep(0.6)
        time.sleep(0.5)
        (cpu1, woken1), busy_s = probe_thread(probe), time.monotonic() - t0
        busy_cpu, busy_woken = (cpu1 - cpu0) / busy_s, (woken1 - woken0) / busy_s
    stop.set()

    # The k-th close is heard when the reported departures first reach k (only this bench's
    # clients leave the watched port).
    reported, at = 0, []
    for ts, count in heard:
        reported += count
        at.append((reported, ts))
    lags: dict[str, list[float]] = {"lone": [], "burst": []}
    missing = 0
    for k, (kind, closed) in enumerate(closes, start=1):
        found = next((ts for total, ts in at if total >= k), None)
        if found is None:
            missing += 1
            continue
        lags[kind].append(max(0.0, (found - closed) / 1e6))
    print(f"probe thread: idle {idle_cpu * 100:.2f}% of a core, {idle_woken:.1f} wake-ups/s; "
          f"during the closes {busy_cpu * 100:.2f}%, {busy_woken:.1f} wake-ups/s")
    print(f"{'closes':<8}{'count':>6}{'p50 ms':>9}{'p90 ms':>9}{'max ms':>9}")
    for kind, values in lags.items():
        if values:
            values.sort()
            p90 = values[min(len(values) - 1, int(len(values) * 0.9))]
            print(f"{kind:<8}{len(values):>6}{statistics.median(values):>9.1f}{p90:>9.1f}{values[-1]:>9.1f}")
    if missing:
        print(f"{missing} closes never reported")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
