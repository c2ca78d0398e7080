"""CPU of each disconnect source, side by side in one run: idle, and at 100 requests a second.

Each source watches a loopback listener's port; the load is 100 short connections a second (send,
answer, close) from a separate thread, so the figure is the source's own polling or ring-buffer
reading, measured as this process's CPU time minus the load's (the load runs without a source
first). The /proc fallback runs with both of its readers: sock_diag and /proc/net/tcp parsing.

    python bench/fallback_cpu.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This script's own tree first (not the one the virtualenv was installed from), unless
# PYTHONPATH names one.
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes.procfs import ProcfsConnEventSource


def serve(listener: socket.socket, stop: threading.Event,
          handle: Callable[[socket.socket], None] | None = None) -> None:
    """Accept until ``stop``: each connection to ``handle`` in a thread of its own, or without one
    answered in turn (its first read, then "ok") and closed."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        if handle is not None:
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
            continue
        with conn:
            conn.recv(64)
            conn.sendall(b"ok")


def load(port: int, rate: float, stop: threading.Event) -> None:
    next_at = time.monotonic()
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"hi")
            sock.recv(8)
        next_at += 1.0 / rate
        time.sleep(max(0.0, next_at - time.monotonic()))


def cpu_percent(source: Any, port: int, rate: float, seconds: float) -> float:
    """Percent of one core this process spent while ``source`` (or none) ran with the load."""
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(port, rate, stop), daemon=True)] if rate else []
    if source is not None:
        source.start()
    drain = threading.Thread(target=lambda: [source.poll(0.05) for _ in iter(stop.is_set, True)]
                             if source is not None else None, daemon=True)
    started_cpu, started = time.process_time(), time.monotonic()
    for thread in [*threads, drain]:
        thread.start()
    time.sleep(seconds)
    cpu, wall = time.process_time() - started_cpu, time.monotonic() - started
    stop.set()
    for thread in [*threads, drain]:
        thread.join()
    if source is not None:
        source.stop()
    return 100.0 * cpu / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--poll-hz", type=float, default=20.0)
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    port = listener.getsockname()[1]
    stop = threading.Event()
    threading.Thread(target=serve, args=(listener, stop), daemon=True).start()

    def make(name: str) -> Any:
        if name.startswith("fallback"):
            return ProcfsConnEventSource([port], poll_hz=args.poll_hz, sock_diag="sock_diag" in name)
        if name.startswith("eBPF"):
            from probes.bpf import BpfConnEventSource

            return BpfConnEventSource([port])
        return None

    names = ["none (load only)", f"fallback, sock_diag, {args.poll_hz:g} Hz",
             f"fallback, /proc/net/tcp, {args.poll_hz:g} Hz", "eBPF probe"]
    figures: dict[str, list[float]] = {}
    # Every idle figure first: the load leaves TIME_WAIT sockets on the port for a minute, which
    # /proc/net/tcp lists on every poll (a sock_diag dump leaves them out in the kernel), and
    # "idle" means a port with nothing on it.
    for rate in (0.0, 100.0):
        for name in list(names):
            try:
                source = make(name)
            except Exception as exc:  # no root or no bcc: the other figures still print
                print(f"({name} not measured: {exc})")
                names.remove(name)
                continue
            figures.setdefault(name, []).append(cpu_percent(source, port, rate, args.seconds))
    print(f"{'source (own CPU, load subtracted)':<36} {'idle, % core':>13} {'100 req/s, % core':>18}")
    base = figures[names[0]]
    for name in names:
        own = figures[name] if name == names[0] else [f - b for f, b in zip(figures[name], base, strict=True)]
        print(f"{name:<36} {own[0]:>13.2f} {own[1]:>18.2f}")
    stop.set()


if __name__ == "__main__":
    main()
