"""What the disconnect probe costs, measured side by side in one run (needs root and bcc).

1. Loopback HTTP load against a real uvicorn server, a new connection per request (the probe's
   worst case: every request is a close), alternating rounds without and with the probe loaded,
   polled and written to a SQLite store. Prints requests/s of both and their ratio.
2. Sustained kernel-to-store rate: several processes open and reset short loopback connections as
   fast as they can while this process polls the probe and writes every event to SQLite. Prints
   events stored per second, lost events, and this process's CPU per 1,000 events, for each ring
   buffer size asked (--ring-mib 4,1: side by side).

    .venv/bin/python bench/probe_overhead.py [--seconds 4] [--rounds 3] [--generators 3]
    .venv/bin/python bench/probe_overhead.py --compare REV [--rounds 3]   # the reader, REV beside now
"""

from __future__ import annotations

import argparse
import atexit
import multiprocessing
import os
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# This script's own tree first (not the one the virtualenv was installed from), unless
# PYTHONPATH names one: the children --compare starts for another revision.
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
LAST_REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"


# -- processes: the HTTP server, the HTTP clients, the connection generators, the acceptor --------
async def tiny_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve(fd: int) -> None:
    import uvicorn

    # socket(fileno=) keeps the real family (uvicorn's fd= assumes AF_UNIX, which leaves Nagle on
    # and stalls keep-alive responses behind delayed ACKs).
    listener = socket.socket(fileno=fd)
    server = uvicorn.Server(uvicorn.Config(tiny_app, lifespan="off", log_level="error",
                                           access_log=False))
    server.run(sockets=[listener])


def wait_for_go(ready: Any, go: Any) -> None:
    ready.put(os.getpid())
    go.wait()


def http_client(address: tuple[str, int], ready: Any, go: Any, seconds: float,
                per_connection: int, results: Any) -> None:
    wait_for_go(ready, go)
    cpu_before = sum(cpu_seconds())
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.create_connection(address) as sock:
            for _ in range(per_connection - 1):  # keep-alive requests: the answer is 2 bytes
                sock.sendall(REQUEST)
                answer = b""
                while not answer.endswith(b"\r\n\r\nok"):
                    answer += sock.recv(4096)
            sock.sendall(LAST_REQUEST)
            while sock.recv(4096):  # read to EOF: the server closes, the client never resets
                pass
        done += per_connection
    results.put((done, sum(cpu_seconds()) - cpu_before))


def reset_generator(address: tuple[str, int], ready: Any, go: Any, seconds: float,
                    results: Any) -> None:
    linger_zero = struct.pack("ii", 1, 0)
    wait_for_go(ready, go)
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(200):  # check the clock once per 200 connections
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero)
            sock.connect(address)
            sock.close()
        done += 200
    results.put(done)


def acceptor(listener: socket.socket, stop: Any) -> None:
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            accepted, _ = listener.accept()
        except OSError:
            continue
        accepted.close()


# -- the probe side ---------------------------------------------------------------------------------
class Consumer:
    """The daemon's hot path: poll the probe, hand events to the batched store writer."""

    def __init__(self, source: Any, writer: Any | None, poll_s: float) -> None:
        self.source = source
        self.writer = writer
        self.poll_s = poll_s  # the daemon's wait (auditor.daemon.PROBE_POLL_S) unless --poll-seconds
        self.stopping = threading.Event()
        self.received = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.received += take(self.source, self.writer, self.poll_s)
        while taken := take(self.source, self.writer, 0.1):  # drain what is left
            self.received += taken
        if self.writer is not None:
            self.writer.flush()


def take(source: Any, writer: Any | None, timeout_s: float) -> int:
    """One poll as the daemon's probe loop makes it; returns the events taken. With a store, the
    probe's records go to it undecoded where the probe offers that (``poll_runs``), and the
    disconnects are counted from the records, as the daemon counts them for /metrics."""
    if writer is not None and getattr(source, "reads_runs", False):
        from auditor.kernelrecord import departures

        runs = source.poll_runs(timeout_s=timeout_s)
        for run in runs:
            departures(run.records, run.stride)
        writer.add(runs)
        return sum(run.record_count for run in runs)
    events = source.poll(timeout_s=timeout_s)
    if writer is not None:
        writer.add(events)
    return len(events)


def read_back(store: Any, after_id: int) -> tuple[float, int, int]:
    """What the correlator spends reading the stored events back: (CPU seconds of this thread,
    events, the last block id read), for the blocks after ``after_id``."""
    from auditor.store.db import BLOCK_COLUMNS, stored_events

    started = time.thread_time()
    with store.connect() as conn:
        blocks = conn.all(f"SELECT {BLOCK_COLUMNS} FROM conn_event_blocks WHERE id > :after ORDER BY id",
                          {"after": after_id})
    count = sum(1 for _ in stored_events(blocks))
    return time.thread_time() - started, count, (blocks[-1][0] if blocks else after_id)


def cpu_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def start_together(workers: list[Any], ready: Any, go: Any) -> None:
    """Start the processes and release them at once, after every one has imported and is waiting."""
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=60)
    go.set()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_round(address: tuple[str, int], clients: int, seconds: float, server_pid: int,
               per_connection: int = 1) -> tuple[float, float, float, int]:
    """Requests per second; CPU seconds per request of server, clients and this process; of this
    process alone (the reader); and the requests done.

    The CPU figure counts only the processes of the benchmark, so it holds on a machine shared
    with other work, where requests per second swing by several percent from round to round.
    """
    ctx = multiprocessing.get_context("spawn")
    results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=http_client,
                           args=(address, ready, go, seconds, per_connection, results))
               for _ in range(clients)]
    server_before, own_before = process_cpu_seconds(server_pid), sum(cpu_seconds())
    start_together(workers, ready, go)
    reports = [results.get(timeout=seconds + 60) for _ in workers]
    server_cpu = process_cpu_seconds(server_pid) - server_before
    own_cpu = sum(cpu_seconds()) - own_before
    for worker in workers:
        worker.join()
    requests = sum(done for done, _ in reports)
    cpu = server_cpu + own_cpu + sum(client_cpu for _, client_cpu in reports)
    return requests / seconds, cpu / max(requests, 1), own_cpu / max(requests, 1), requests


def loopback_listener() -> tuple[socket.socket, tuple[str, int]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    return listener, listener.getsockname()


def http_overhead(args: argparse.Namespace, workdir: Path, per_connection: int) -> dict[str, Any]:
    from auditor.store import Store
    from probes import bpfsys
    from probes.bpf import BpfConnEventSource
    from probes.writer import ConnEventWriter

    listener, address = loopback_listener()
    server = subprocess.Popen([sys.executable, __file__, "--serve-fd", str(listener.fileno())],
                              pass_fds=[listener.fileno()])
    store = Store(f"sqlite:///{workdir / 'http.db'}")
    configs = ("without", "probe", "probe+store")
    rates: dict[str, list[float]] = {name: [] for name in configs}
    cpu_per_request: dict[str, list[float]] = {name: [] for name in configs}
    reader_cpu: dict[str, list[float]] = {name: [] for name in configs}  # this process, per request
    kernel_ns: dict[str, list[float]] = {name: [] for name in configs[1:]}  # the program's, per request
    kernel_runs: dict[str, list[float]] = {name: [] for name in configs[1:]}
    read_back_cpu: list[float] = []  # the correlator's decoding of a round's stored events, per request
    last_block = 0
    events = lost = maps_bytes = 0
    requests_probed = 0
    try:  # the kernel counts the programs' runs (a clock read or two each)
        stats_before: str | None = bpfsys.STATS_SYSCTL.read_text()
        bpfsys.STATS_SYSCTL.write_text("1")
    except OSError as exc:  # a read-only /proc/sys (some containers): no kernel time, said so
        print(f"probe_overhead: the probe's kernel time is not counted ({bpfsys.STATS_SYSCTL}: {exc})")
        stats_before = None
    try:
        time.sleep(1.5)  # uvicorn start-up
        http_round(address, args.clients, 1.0, server.pid)  # warm-up
        for round_index in range(args.rounds):
            # Rotate the order each round so drift in the machine's load falls on all three.
            for name in configs[round_index % 3:] + configs[:round_index % 3]:
                if name == "without":
                    rate, cpu, own, _ = http_round(address, args.clients, args.seconds, server.pid,
                                                   per_connection)
                    rates[name].append(rate)
                    cpu_per_request[name].append(cpu)
                    reader_cpu[name].append(own)
                    continue
                source = BpfConnEventSource([address[1]])  # loaded fresh, detached after
                source.start()
                maps_bytes = maps_bytes or maps_memory()
                consumer = Consumer(source, ConnEventWriter(store) if name == "probe+store" else None,
                                    args.poll_seconds)
                consumer.thread.start()
                runs_before = source.program_runs()
                rate, cpu, own, requests = http_round(address, args.clients, args.seconds, server.pid,
                                                      per_connection)
                runs_after = source.program_runs()
                kernel_ns[name].append(sum(runs_after[tp].run_ns - runs_before[tp].run_ns
                                           for tp in runs_after) / max(requests, 1))
                kernel_runs[name].append(sum(runs_after[tp].runs - runs_before[tp].runs
                                             for tp in runs_after) / max(requests, 1))
                drain_before = sum(cpu_seconds())
                consumer.stopping.set()
                consumer.thread.join()
                # The reader's final drain after the round belongs to the round's requests.
                final_drain = (sum(cpu_seconds()) - drain_before) / max(requests, 1)
                rates[name].append(rate)
                cpu_per_request[name].append(cpu + final_drain)
                reader_cpu[name].append(own + final_drain)
                if name == "probe+store":
                    seconds, _, last_block = read_back(store, last_block)
                    read_back_cpu.append(seconds / max(requests, 1))
                requests_probed += requests
                events += consumer.received
                lost += source.lost_events()
                source.stop()
    finally:
        if stats_before is not None:
            bpfsys.STATS_SYSCTL.write_text(stats_before)
        server.terminate()
        server.wait(timeout=10)
        store.close()
    return {**{name: statistics.median(values) for name, values in rates.items()},
            **{f"{name} kernel ns": statistics.median(values) if stats_before is not None else None
               for name, values in kernel_ns.items()},
            **{f"{name} kernel runs": statistics.median(values) if stats_before is not None else None
               for name, values in kernel_runs.items()},
            **{f"{name} cpu": statistics.median(values) for name, values in cpu_per_request.items()},
            **{f"{name} reader cpu": statistics.median(values) for name, values in reader_cpu.items()},
            "events per request": events / max(requests_probed, 1),
            "read back cpu": statistics.median(read_back_cpu),
            **{f"{name} rounds": " ".join(f"{value:,.0f}" for value in values)
               for name, values in rates.items()},
            "events": events, "lost": lost, "maps bytes": maps_bytes}


def maps_memory() -> int:
    """The kernel memory of the BPF maps this process holds open (each map's ``memlock`` in its
    descriptor's fdinfo): the probe's, while it is loaded. Charged to the daemon's cgroup."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue
        if "map_type:" in info:
            total += next((int(line.split()[1]) for line in info.splitlines() if line.startswith("memlock:")), 0)
    return total


def event_rate(args: argparse.Namespace, workdir: Path, ring_mib: int, run: int) -> dict[str, float]:
    """Connections reset as fast as the generators go, read live into a store of their own (one a
    ``run``) through a ring buffer of ``ring_mib`` MiB."""
    from auditor.config import ProbeConfig
    from auditor.store import Store
    from probes.bpf import BpfConnEventSource
    from probes.writer import ConnEventWriter

    ctx = multiprocessing.get_context("spawn")
    listener, address = loopback_listener()
    store = Store(f"sqlite:///{workdir / f'rate-{run}.db'}")  # counted whole below: never shared
    pages = ProbeConfig(ring_buffer_mib=ring_mib).ring_buffer_pages  # as the daemon sizes it
    source = BpfConnEventSource([address[1]], ringbuf_pages=pages)
    source.start()
    writer = ConnEventWriter(store, batch_size=5000)
    consumer = Consumer(source, writer, args.poll_seconds)
    results, ready, go, stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    acceptor_process = ctx.Process(target=acceptor, args=(listener, stop))
    acceptor_process.start()
    generators = [ctx.Process(target=reset_generator, args=(address, ready, go, args.seconds, results))
                  for _ in range(args.generators)]
    consumer.thread.start()
    start_together(generators, ready, go)
    cpu_before = cpu_seconds()
    wall_before = time.monotonic()
    connections = sum(results.get(timeout=args.seconds + 60) for _ in generators)
    consumer.stopping.set()
    consumer.thread.join()
    wall = time.monotonic() - wall_before
    stop.set()
    user, system = (after - before for after, before in zip(cpu_seconds(), cpu_before, strict=True))
    for process in [acceptor_process, *generators]:
        process.join()
    lost = source.lost_events()
    source.stop()
    with store.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT coalesce(sum(count), 0) FROM conn_event_blocks").scalar_one()
    store.close()
    return {"connections": connections, "stored": stored, "written": writer.written,
            "lost": lost, "seconds": wall, "user_ms_per_1k": 1e6 * user / max(stored, 1),
            "sys_ms_per_1k": 1e6 * system / max(stored, 1)}


DRAIN_VARIANTS = (("callback", False, False), ("mapped", True, False),
                  ("callback+store", False, True), ("mapped+store", True, True))


def fill_backlog(args: argparse.Namespace, listener: socket.socket, address: tuple[str, int]) -> int:
    """Open and reset connections for ``args.backlog_seconds`` with nobody reading the probes'
    ring buffers; returns how many were made once their last resets have landed."""
    ctx = multiprocessing.get_context("spawn")
    results, ready, go, stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    acceptor_process = ctx.Process(target=acceptor, args=(listener, stop))
    acceptor_process.start()
    generators = [ctx.Process(target=reset_generator, args=(address, ready, go, args.backlog_seconds, results))
                  for _ in range(args.generators)]
    start_together(generators, ready, go)
    connections = sum(int(results.get(timeout=args.backlog_seconds + 60)) for _ in generators)
    stop.set()
    acceptor_process.join()
    for worker in generators:
        worker.join()
    time.sleep(0.3)  # the last resets land
    return connections


def drain(source: Any, writer: Any) -> dict[str, float]:
    """Empty ``source``'s ring buffer (into ``writer`` when there is one) and say what it cost."""
    cpu_before, wall_before, drained = cpu_seconds(), time.monotonic(), 0
    while taken := take(source, writer, 0):
        drained += taken
    if writer is not None:
        writer.flush()
    wall = time.monotonic() - wall_before
    user, system = (after - before for after, before in zip(cpu_seconds(), cpu_before, strict=True))
    return {"stored": drained, "lost": source.lost_events(), "seconds": wall,
            "user_ms_per_1k": 1e6 * user / max(drained, 1), "sys_ms_per_1k": 1e6 * system / max(drained, 1)}


def drain_rate(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, float]]:
    """Fill ring buffers with nobody reading, then time each reader alone emptying its own: the
    pipeline's capacity, free of the CPU the connection generators take. Four probes are attached
    at once, so every one holds the same backlog: bcc's per-record callback and the batch read of
    the mapped ring, each without and with the SQLite store behind it."""
    from auditor.store import Store
    from probes.bpf import BpfConnEventSource
    from probes.writer import ConnEventWriter

    listener, address = loopback_listener()
    sources = {name: BpfConnEventSource([address[1]], ringbuf_pages=16384, mapped_reader=mapped)
               for name, mapped, _ in DRAIN_VARIANTS}  # 64 MiB each: room for the backlog
    for source in sources.values():
        source.start()
    connections = fill_backlog(args, listener, address)
    figures: dict[str, dict[str, float]] = {}
    for name, _, with_store in DRAIN_VARIANTS:
        source = sources[name]
        store = Store(f"sqlite:///{workdir / f'drain-{name}.db'}") if with_store else None
        writer = ConnEventWriter(store, batch_size=5000) if store is not None else None
        figures[name] = {"connections": connections, **drain(source, writer)}
        source.stop()
        if store is not None:
            store.close()
    return figures


def drain_child(port: int, with_store: bool) -> None:
    """One tree's mapped reader in its own process (``--compare``): attach, say ready, wait for
    "drain" on stdin, empty the ring buffer and print what it cost as JSON."""
    import json

    from probes.bpf import BpfConnEventSource
    from probes.writer import ConnEventWriter

    source = BpfConnEventSource([port], ringbuf_pages=16384, mapped_reader=True)
    source.start()
    print("ready", flush=True)
    sys.stdin.readline()
    writer = None
    if with_store:
        from auditor.store import Store

        scratch = tempfile.mkdtemp(prefix="drain-")
        atexit.register(shutil.rmtree, scratch, True)
        store = Store(f"sqlite:///{scratch}/drain.db")
        writer = ConnEventWriter(store, batch_size=5000)
    print(json.dumps(drain(source, writer)), flush=True)
    source.stop()


def drain_compare(args: argparse.Namespace) -> None:
    """The mapped reader of revision ``args.compare`` and of the working tree on the same backlog:
    each in its own process, both attached before the connections are made (every probe sees
    every event), then each drains its own ring buffer in turn, the first to drain alternating
    from round to round. Prints the medians side by side."""
    import io
    import json
    import tarfile

    here = Path(__file__).resolve().parent.parent
    figures: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="probe-old-") as scratch:
        archive = subprocess.run(["git", "-C", str(here), "archive", "--format=tar", args.compare, "auditor",
                                  "collectors", "probes"], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(scratch, filter="data")
        trees = {args.compare: scratch, "working tree": str(here)}
        for round_no in range(args.rounds):
            for with_store in (False, True):
                listener, address = loopback_listener()
                children = {label: subprocess.Popen(
                    [sys.executable, __file__, "--drain-child", str(address[1]), *(["--store"] if with_store else [])],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONPATH": tree}) for label, tree in trees.items()}
                for child in children.values():
                    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
                fill_backlog(args, listener, address)
                order = list(children) if round_no % 2 == 0 else list(children)[::-1]
                for label in order:
                    child = children[label]
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write("drain\n")
                    child.stdin.flush()
                    result = json.loads(child.stdout.readline())
                    child.wait(timeout=60)
                    variant = "mapped+store" if with_store else "mapped"
                    figures.setdefault((variant, label), []).append(result["user_ms_per_1k"])
                    figures.setdefault((f"{variant} events/s", label), []).append(
                        result["stored"] / result["seconds"])
                    print(f"round {round_no + 1} {label:<14} {variant:<13} {result['stored']:>9,} events, "
                          f"lost {result['lost']}, user {result['user_ms_per_1k']:.2f} ms / 1,000 events",
                          flush=True)
                listener.close()
    print(f"\nreader user CPU per 1,000 events (target <= 2 ms) and drain rate, median of {args.rounds} rounds")
    for variant in ("mapped", "mapped events/s", "mapped+store", "mapped+store events/s"):
        old, new = (statistics.median(figures[(variant, label)]) for label in trees)
        print(f"  {variant:<22} {args.compare}: {old:>10,.2f}   working tree: {new:>10,.2f}   x{new / old:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each measured phase")
    parser.add_argument("--rounds", type=int, default=5, help="HTTP rounds without/with the probe")
    parser.add_argument("--clients", type=int, default=2, help="HTTP client processes")
    parser.add_argument("--per-connection", type=per_connection_list, default=[1, 20],
                        help="HTTP requests per connection, a comma list measured in turn (1: every "
                             "request is a close, the worst case; 20: keep-alive clients)")
    parser.add_argument("--generators", type=int, default=3, help="connection generator processes")
    parser.add_argument("--backlog-seconds", type=float, default=2.0,
                        help="how long to fill the ring buffer before timing the drain")
    parser.add_argument("--http-only", action="store_true", help="skip the event-rate phases")
    parser.add_argument("--ring-mib", type=ring_sizes, default=None,
                        help="ring buffer sizes in MiB for the live event-rate phase, a comma list measured "
                             "in turn and shown side by side (default: the daemon's, probe.ring_buffer_mib)")
    parser.add_argument("--poll-seconds", type=float, default=None,
                        help="the reader's wait for events (default: the daemon's, PROBE_POLL_S)")
    parser.add_argument("--compare", metavar="REV",
                        help="only the drain phase: revision REV's mapped reader and the working tree's on "
                             "the same backlog, --rounds times")
    parser.add_argument("--serve-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--drain-child", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--store", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fd is not None:
        serve(args.serve_fd)
        return 0
    if args.drain_child is not None:
        drain_child(args.drain_child, args.store)
        return 0

    if args.ring_mib is None:
        from auditor.config import ProbeConfig

        args.ring_mib = [ProbeConfig().ring_buffer_mib]
    if args.poll_seconds is None:
        from auditor.daemon import PROBE_POLL_S

        args.poll_seconds = PROBE_POLL_S
    elif not 0 < args.poll_seconds <= 10:
        parser.error(f"--poll-seconds must be above 0 and at most 10, got {args.poll_seconds:g}")
    from probes.bpf import bpf_unavailable_reason

    problem = bpf_unavailable_reason()
    if problem is not None:
        print(f"probe_overhead: not measured: {problem}")
        return 0
    if args.compare:
        drain_compare(args)
        return 0
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure
    with tempfile.TemporaryDirectory(prefix="probe-bench-") as tmp:
        http = {n: http_overhead(args, Path(tmp), n) for n in args.per_connection}
        if not args.http_only:
            rates = [(mib, event_rate(args, Path(tmp), mib, run)) for run, mib in enumerate(args.ring_mib)]
            drain = drain_rate(args, Path(tmp))
    print(f"probe overhead on {os.cpu_count()} CPUs, load average before: {load_before:.2f}; the reader "
          f"waits {args.poll_seconds:g} s for events")
    rows: list[tuple[str, str, str]] = []
    for per_connection, figures in http.items():
        kind = "every request is a close: the worst case" if per_connection == 1 else "keep-alive"
        rows.append((f"HTTP: uvicorn, {args.clients} client processes, {per_connection} request(s) per "
                     f"connection ({kind}), median of {args.rounds} rounds of {args.seconds:g} s", "", ""))
        rows += http_rows(figures)
    if not args.http_only:
        rows += event_rows(args, rates, drain)
    for name, value, note in rows:
        print(f"  {name:<31} {value:>12}  {note}" if value else name)
    return 0


def ring_sizes(text: str) -> list[int]:
    """``--ring-mib``: MiB, powers of two, as the daemon's setting takes them."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of whole MiB: {text!r}") from None
    if not sizes or any(size < 1 or size & (size - 1) for size in sizes):
        raise argparse.ArgumentTypeError(f"ring buffer sizes must be powers of two, at least 1: {text!r}")
    return sizes


def per_connection_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts like 1,20, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"each count must be at least 1, got {text!r}")
    return values


def http_rows(http: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        ("HTTP requests/s without probe", f"{http['without']:,.0f}", f"rounds {http['without rounds']}"),
        ("HTTP requests/s, probe polled", f"{http['probe']:,.0f}", f"rounds {http['probe rounds']}"),
        ("HTTP requests/s, probe + store", f"{http['probe+store']:,.0f}",
         f"rounds {http['probe+store rounds']}"),
        ("ratio, probe polled", f"{http['probe'] / http['without']:.3f}", "target >= 0.98"),
        ("ratio, probe + store", f"{http['probe+store'] / http['without']:.3f}",
         f"{http['events']:,.0f} events, {http['lost']:,.0f} lost"),
        ("CPU per request without probe", f"{http['without cpu'] * 1e6:.0f} µs",
         "server + clients + reader, summed over processes"),
        ("CPU per request, probe polled", f"{http['probe cpu'] * 1e6:.0f} µs",
         f"capacity ratio {http['without cpu'] / http['probe cpu']:.3f}"),
        ("CPU per request, probe + store", f"{http['probe+store cpu'] * 1e6:.0f} µs",
         f"capacity ratio {http['without cpu'] / http['probe+store cpu']:.3f}"),
        # The reader's own CPU is measured in this process alone, without the noise of the server's
        # and clients' (which swing by several percent a round): what the probe adds in user space.
        # Less what this process spends without the probe (starting the clients).
        ("reader CPU per request, polled", f"{reader(http, 'probe') * 1e6:.1f} µs",
         f"{http['events per request']:.2f} events a request; "
         f"{reader(http, 'probe') / http['without cpu']:.2%} of a request without the probe"),
        ("reader CPU per request, + store", f"{reader(http, 'probe+store') * 1e6:.1f} µs",
         f"{reader(http, 'probe+store') / http['without cpu']:.2%} of a request without the probe"),
        *kernel_rows(http),
        ("probe maps' kernel memory", f"{http['maps bytes'] / 2**20:.2f} MiB",
         "every map's memlock (fdinfo): charged to the daemon's cgroup"),
    ]


def kernel_rows(http: dict[str, Any]) -> list[tuple[str, str, str]]:
    if http["probe kernel ns"] is None:
        return [("probe in the kernel per request", "not counted", "kernel.bpf_stats_enabled could not be set")]
    return [
        # The program's time as the kernel counts it (kernel.bpf_stats_enabled): charged to the
        # server's and clients' CPU, where the rounds above can only see it through their noise.
        ("probe in the kernel per request", f"{http['probe kernel ns'] / 1e3:.2f} µs",
         f"{http['probe kernel runs']:.1f} program runs of "
         f"{http['probe kernel ns'] / max(http['probe kernel runs'], 1e-9):.0f} ns; "
         f"{http['probe kernel ns'] / 1e9 / http['without cpu']:.2%} of a request without the probe"),
        ("capacity ratio, accounted", f"{accounted(http, 'probe'):.4f}",
         "polled: CPU a request without the probe, over that plus the probe's kernel time and the reader's CPU"),
        ("capacity ratio, accounted", f"{accounted(http, 'probe+store'):.4f}", "+ store"),
        ("  + read back", f"{accounted(http, 'probe+store', read_back=True):.4f}",
         f"and the correlator's read of the stored events, {http['read back cpu'] * 1e6:.2f} µs a request"),
    ]


def accounted(http: dict[str, Any], config: str, *, read_back: bool = False) -> float:
    """The capacity ratio from what the probe itself costs a request (its programs' kernel time,
    its reader's CPU, and with ``read_back`` the correlator's read of what was stored), not from
    the difference of two noisy totals."""
    without = float(http["without cpu"])
    extra = http["read back cpu"] if read_back else 0.0
    return without / (without + http[f"{config} kernel ns"] / 1e9 + max(reader(http, config), 0.0) + extra)


def reader(http: dict[str, Any], config: str) -> float:
    """This process's CPU per request with the probe, less its CPU per request without it."""
    return float(http[f"{config} reader cpu"] - http["without reader cpu"])


def event_rows(args: argparse.Namespace, rates: list[tuple[int, dict[str, float]]],
               drain: dict[str, dict[str, float]]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for mib, rate in rates:
        per_connection = rate["stored"] / max(rate["connections"], 1)  # a reset: one record, two before
        rows += [
            (f"live, a ring buffer of {mib} MiB:", "", ""),
            ("  connections opened and reset", f"{rate['connections']:,.0f}",
             f"{rate['connections'] / rate['seconds']:,.0f}/s by {args.generators} processes"),
            ("  events kernel -> store", f"{rate['stored']:,.0f}",
             f"lost {rate['lost']:,.0f}; {per_connection:.2f} a connection"),
            ("  sustained events/s to store", f"{rate['stored'] / rate['seconds']:,.0f}",
             "sharing the CPUs with the generators; target >= 50,000, zero loss"),
            ("  reader user CPU / 1,000 events", f"{rate['user_ms_per_1k']:.1f} ms",
             f"system {rate['sys_ms_per_1k']:.1f} ms; user {rate['user_ms_per_1k'] * per_connection:.1f} ms "
             "/ 1,000 connections"),
        ]
    rows.append((f"backlog of {drain['mapped']['connections']:,.0f} connections drained by the "
                 "reader alone (its capacity):", "", ""))
    for name, _, _ in DRAIN_VARIANTS:
        figures = drain[name]
        rows.append((f"  {name} events/s", f"{figures['stored'] / figures['seconds']:,.0f}",
                     f"user {figures['user_ms_per_1k']:.2f} ms / 1,000 events, system "
                     f"{figures['sys_ms_per_1k']:.2f} ms; {figures['stored']:,.0f} events, "
                     f"lost {figures['lost']:,.0f}"))
    return rows

if __name__ == "__main__":
    sys.exit(main())
