"""What receiving live notices costs: CPU per 1,000 notices at a steady rate, the receiver alone.

A child process runs the daemon's receiver (``collectors.live.LiveReceiver``) and drains it twice
a second, as correlation rounds do; this process sends notices shaped like ``auditor.live``'s over
loopback, paced every 10 ms, and reads the child's CPU from /proc over the sending. The default
rate, 500 notices a second, is 100 requests a second that each send a server span's start and end,
FastAPI's second server span's, and the engine work's. Inside the daemon under
``bench/detection.py --live-load`` the receiver's thread costs about three times what it costs
here alone (docs/footprint.md): this isolates what parsing and queueing a notice cost.

With ``--compare REV`` the receivers of git revision REV and of the working tree run alternately,
each in a fresh child, and the medians are printed side by side.

Usage: .venv/bin/python bench/live_notices.py [--rate 500] [--seconds 20] [--compare REV --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))


def child() -> None:
    """The receiver, drained every 0.5 s, until stdin closes; then its counts as JSON."""
    import threading

    from collectors.live import LiveReceiver

    receiver = LiveReceiver("127.0.0.1", 0)
    receiver.start()
    print(receiver.port, flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    drained = 0
    while not done.wait(0.5):
        drained += len(receiver.drain())
    drained += len(receiver.drain())
    receiver.stop()
    print(json.dumps({"received": receiver.received, "drained": drained, "dropped": receiver.dropped}), flush=True)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def datagram(index: int, event: str) -> bytes:
    return json.dumps({"v": 1, "ev": event, "trace": f"{index:032x}", "span": f"{index:016x}",
                       "name": "POST /v1/completions", "kind": "server", "ts": time.time_ns(),
                       "peer": "127.0.0.1", "peer_port": 10_000 + index % 50_000, "port": 8000, "pid": 4242,
                       "service": "engine", "engine": False}, separators=(",", ":")).encode()


def run(tree: Path, rate: float, seconds: float) -> dict[str, float]:
    """One child of ``tree``'s code under ``rate`` notices a second for ``seconds``."""
    proc = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    port = int(proc.stdout.readline())
    time.sleep(0.5)  # past start-up
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payloads = [datagram(i // 2, ("start", "end")[i % 2]) for i in range(2000)]
    cpu_before, started = cpu_seconds(proc.pid), time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - started) < seconds:
        while sent < rate * elapsed:
            sender.sendto(payloads[sent % len(payloads)], ("127.0.0.1", port))
            sent += 1
        time.sleep(0.01)
    wall = time.monotonic() - started
    time.sleep(0.6)  # the last notices read and drained
    cpu = cpu_seconds(proc.pid) - cpu_before
    proc.stdin.close()
    counts = json.loads(proc.stdout.readline())
    proc.wait(timeout=10)
    return {"sent": sent, "received": counts["received"], "cpu_percent": cpu / wall * 100,
            "ms_per_1000": cpu * 1000 / max(sent, 1) * 1000}


def export(rev: str, into: Path) -> Path:
    sys.path.insert(0, str(HERE / "bench"))
    from ingest import export_tree

    return export_tree(rev, into)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=500, help="notices a second")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's receiver, alternately")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child()
        return 0
    with tempfile.TemporaryDirectory(prefix="live-notices-") as scratch:
        trees = {"working tree": HERE}
        if args.compare:
            trees = {args.compare: export(args.compare, Path(scratch)), "working tree": HERE}
        results: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
        for round_no in range(1, (args.rounds if args.compare else 1) + 1):
            for label, tree in trees.items():
                result = run(tree, args.rate, args.seconds)
                results[label].append(result)
                print(f"round {round_no} {label:<14} {result['cpu_percent']:5.2f} % of one core, "
                      f"{result['ms_per_1000']:6.1f} ms per 1,000 notices, {result['received']:.0f} of "
                      f"{result['sent']:.0f} received", flush=True)
    print(f"\nLive notices at {args.rate:.0f} a second, {args.seconds:.0f} s, median of {len(next(iter(results.values())))}"
          " run(s) each")
    print(f"  {'':<28}" + "".join(f"{label:>16}" for label in results))
    for key, title in (("cpu_percent", "receiver CPU, % of one core"), ("ms_per_1000", "CPU ms per 1,000 notices")):
        print(f"  {title:<28}" + "".join(f"{statistics.median(r[key] for r in runs):16.2f}" for runs in results.values()))
    print(f"  {'received of sent':<28}" + "".join(
        f"{sum(r['received'] for r in runs) / sum(r['sent'] for r in runs):16.4f}" for runs in results.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
