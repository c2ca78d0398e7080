"""What finding and reading containers' network namespaces costs the daemon (probes.netns).

The /proc fallback looks for other namespaces listening on a watched port every NETNS_REFRESH_S
(a stat of every process's /proc/<pid>/net/tcp), and the engine-process lookup every 10 s at most
where it is not final; the poller then reads each such namespace's table at every poll. This prints
the CPU of one look with more processes on the host, and of one read of a namespace's table with
more connections in it, and what each costs a core at the daemon's cadence.

With ``--daemon-seconds S``, the whole daemon (the /proc source, the engine-process lookup and
the engines' scrapes: its three readers of other namespaces) watches the namespace's port for S
seconds, twice: each reader with a scan of the processes of its own, as before they shared one,
and sharing one (``probes.netns.ProcessScan``); it prints the scans a minute of each and what
they cost a core at the host's process count.

Needs root and iproute2 (ip netns). Starts sleeping processes and a server in a namespace of its
own, connects to it over loopback inside that namespace, and removes all of it on exit.

Usage: .venv/bin/python bench/netns_cost.py [--processes 0,500,1000] [--connections 0,100,1000]
       [--daemon-seconds 60]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes.netns import SCAN_REUSE_S, NetNamespaces, ProcessScan
from probes.procfs import NETNS_REFRESH_S, parse_proc_net_tcp
from probes.sockdiag import TcpAccepts

PORT = 8765
SERVER = f"""
import socket, sys, time
server = socket.create_server(("127.0.0.1", {PORT}), backlog=4096)
clients, accepted = [], []
print("up", flush=True)
for line in sys.stdin:
    for _ in range(int(line)):
        clients.append(socket.create_connection(("127.0.0.1", {PORT})))
        accepted.append(server.accept()[0])
    print(len(clients), flush=True)
"""


def cpu_per_call(call, repeats: int) -> float:
    """Seconds of this process's CPU per call, the median of five batches."""
    batches = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(repeats):
            call()
        batches.append((time.process_time() - start) / repeats)
    return sorted(batches)[2]


def counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def daemon_scans(seconds: float, shared: bool) -> tuple[int, int]:
    """(scans of the processes, processes a scan) of a daemon watching PORT for ``seconds``: its
    readers of other namespaces sharing one scan, or each with one of its own (``shared`` False)."""
    from auditor.config import apply_overrides, load_config
    from auditor.daemon import Daemon

    scans: list[ProcessScan] = []

    def counted(daemon: Daemon) -> ProcessScan:
        if shared and scans:
            return scans[0]
        scans.append(ProcessScan(reuse_s=SCAN_REUSE_S if shared else 0.0))
        return scans[-1]

    with tempfile.TemporaryDirectory(prefix="netns-bench-") as scratch:
        config = load_config(environ={})
        apply_overrides(config, {"db": f"sqlite:///{scratch}/auditor.db", "probe.ports": [PORT], "probe.source": "procfs",
                                 "otlp.http": "127.0.0.1:0", "otlp.grpc": "", "metrics.listen": "127.0.0.1:0",
                                 "live.listen": "", "sampler.nvml": False})
        original = Daemon._process_scan
        Daemon._process_scan = counted  # type: ignore[method-assign]
        try:
            daemon = Daemon(config)
            daemon.start()
            try:
                time.sleep(seconds)
            finally:
                daemon.request_stop()
                daemon.stop()
        finally:
            Daemon._process_scan = original  # type: ignore[method-assign]
    return sum(scan.scans for scan in scans), max((scan.processes_read for scan in scans), default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=counts, default=[0, 500, 1000],
                        help="sleeping processes added to the host's for the look's figures")
    parser.add_argument("--namespaces", type=counts, default=[0, 10, 40],
                        help="other namespaces listening on no watched port (idle containers), for the look's figures")
    parser.add_argument("--connections", type=counts, default=[0, 100, 1000],
                        help="connections open in the namespace for the read's figures")
    parser.add_argument("--poll-hz", type=float, default=20.0, help="the poller's rate, for the read's share")
    parser.add_argument("--daemon-seconds", type=float, default=0.0,
                        help="also run the daemon this long, its readers' scans apart and shared")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (ip netns)", file=sys.stderr)
        return 2
    name = f"benchns{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    sleepers: list[subprocess.Popen[bytes]] = []
    idle: list[str] = []
    server = None
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        server = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", SERVER],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert server.stdin is not None and server.stdout is not None
        assert server.stdout.readline() == b"up\n"
        spaces = NetNamespaces()
        print(f"one look for other namespaces listening on a port (every {NETNS_REFRESH_S:g} s at most)")
        print(f"{'processes':>10} {'ms a look':>10} {'us a process':>13} {'% of a core':>12}")
        for extra in args.processes:
            while len(sleepers) < extra:
                sleepers.append(subprocess.Popen(["sleep", "600"]))
            found = spaces.refresh({PORT})
            assert PORT in found, "the namespace's server was not found"
            look = cpu_per_call(lambda: spaces.refresh({PORT}), 20)
            print(f"{spaces.processes_read:>10} {look * 1e3:>10.2f} {look * 1e6 / spaces.processes_read:>13.1f} "
                  f"{look / NETNS_REFRESH_S * 100:>12.3f}")
        print(f"\nwith other namespaces that listen on no watched port (idle containers), {spaces.processes_read} "
              "processes: the first look reads each one's tables, later ones only where its socket count moved")
        print(f"{'namespaces':>10} {'first, ms':>10} {'tables':>7} {'later, ms':>10} {'tables':>7} {'% of a core':>12}")
        for wanted in args.namespaces:
            while len(idle) < wanted:
                idle.append(f"{name}i{len(idle)}")
                subprocess.run(["ip", "netns", "add", idle[-1]], check=True)
                sleepers.append(subprocess.Popen(["ip", "netns", "exec", idle[-1], "sleep", "600"]))
            time.sleep(0.2)
            fresh = NetNamespaces()
            start = time.process_time()
            fresh.refresh({PORT})
            first, first_tables = time.process_time() - start, fresh.tables_read
            later = cpu_per_call(functools.partial(fresh.refresh, {PORT}), 10)
            print(f"{wanted:>10} {first * 1e3:>10.2f} {first_tables:>7} {later * 1e3:>10.2f} {fresh.tables_read:>7} "
                  f"{later / NETNS_REFRESH_S * 100:>12.3f}")
        (namespace,) = found[PORT]
        tables = namespace.tables(Path("/proc"))
        ports = frozenset({PORT})
        accepts = TcpAccepts(str(namespace.snmp(Path("/proc"))))
        idle_read = cpu_per_call(accepts.read, 2000)
        accepts.close()
        print(f"\nan idle namespace (no socket on the port, no accept since): its accept counter read, "
              f"{idle_read * 1e6:.1f} us, {idle_read * args.poll_hz * 100:.3f}% of a core at {args.poll_hz:g} polls a second")
        print(f"otherwise its tables read ({', '.join(path.name for _, path in tables)}: those listening on "
              f"the port), at each poll")
        print(f"{'connections':>11} {'us a read':>10} {'% of a core':>12}")
        opened = 0
        for wanted in args.connections:
            server.stdin.write(f"{wanted - opened}\n".encode())
            server.stdin.flush()
            opened = int(server.stdout.readline())

            def read() -> None:
                for version, path in tables:
                    parse_proc_net_tcp(path.read_text(), version, ports)

            took = cpu_per_call(read, 200)
            print(f"{opened:>11} {took * 1e6:>10.1f} {took * args.poll_hz * 100:>12.3f}")
        if args.daemon_seconds > 0:
            look = cpu_per_call(lambda: spaces.refresh({PORT}), 20) / max(spaces.processes_read, 1)
            print(f"\nthe daemon's readers of other namespaces over {args.daemon_seconds:g} s (the /proc source, "
                  f"the engine-process lookup, the engines' scrapes), {look * 1e6:.1f} us a process scanned")
            print(f"{'scans':>14} {'a minute':>9} {'processes':>10} {'% of a core':>12}")
            for shared in (False, True):
                done, processes = daemon_scans(args.daemon_seconds, shared)
                per_minute = done * 60 / args.daemon_seconds
                print(f"{'shared' if shared else 'one a reader':>14} {per_minute:>9.1f} {processes:>10} "
                      f"{per_minute / 60 * processes * look * 100:>12.3f}")
    finally:
        for sleeper in sleepers:
            sleeper.kill()
        for sleeper in sleepers:
            sleeper.wait()
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", name])
        for extra in idle:
            subprocess.run(["ip", "netns", "del", extra])
    return 0


if __name__ == "__main__":
    sys.exit(main())
