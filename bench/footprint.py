"""What the idle daemon costs the host: its memory and CPU with the eBPF source, per BPF loader
(or with the /proc source: ``--loaders procfs``, which needs no root, as on a host without bcc).

Starts `auditor run` once per loader at the same time (needs root: eBPF), each watching its own
idle port, waits until both report source=bpf, lets them settle, then reads /proc over the same
window: CPU as % of one core, RSS, PSS, private memory, peak RSS, and whether libbcc/LLVM is
mapped; then the daemon's CPU for one scrape of its own /metrics, and the figures it gives of
itself there (RSS, the sum of its threads' CPU) against /proc's. Side by side in one run, so
load from elsewhere on the host falls on both alike; compare the columns, not figures from
different runs.

- prebuilt: the default; the program bcc compiled at build time, loaded with bpf(2) alone.
- child: a short-lived child compiles and attaches, the daemon keeps descriptors.
- inprocess: bcc compiles and attaches inside the daemon (the path kept for other machines).

With ``--compare REV`` a daemon of git revision REV's code (child loader) runs beside them.

The watched port listens by default (this process holds it), so each daemon finds an "engine" and
samples its CPU, as on a host with an idle engine; that engine answers nothing, so the
daemon soon stops scraping it. ``--engine vllm`` serves an idle vLLM's /metrics page there (no
request running or waiting; 50 histograms), which the daemon
scrapes at its configured rate: a host with an idle engine, all of it. ``--engine none`` leaves
the port bound but not listening: a host whose engine has not started, or is gone.

Usage: .venv/bin/python bench/footprint.py [--seconds 30] [--settle 5] [--grpc] [--loaders prebuilt,child,inprocess]
                                           [--compare REV] [--engine idle|vllm|none]
"""

from __future__ import annotations

import argparse
import atexit
import http.server
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.detection import free_port, thread_cpu_seconds, thread_names

REPO = Path(__file__).resolve().parents[1]
# `python -m auditor`, with the loader choice made before the daemon starts (no product setting).
ENTRY = ("import sys, probes.bpf as bpf; loader = sys.argv.pop(1); "
         "bpf.default_loader = lambda: loader; from auditor.cli import main; main()")
LLVM_LIBS = ("libbcc", "libLLVM", "libclang")


def metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User and system CPU; with ``children``, that of its children reaped so far too (the loader's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM from status, Pss and private pages from smaps_rollup, in MiB."""
    values: dict[str, float] = {}
    for name in ("status", "smaps_rollup"):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Pss", "Private_Clean", "Private_Dirty"):
                values[key] = int(rest.split()[0]) / 1024
    values["Private"] = values.pop("Private_Clean", 0) + values.pop("Private_Dirty", 0)
    return values


def own_figures(text: str) -> dict[str, float]:
    """What the daemon says of itself on /metrics: RSS (MiB) and the sum of its threads' CPU (s),
    where it says them."""
    figures: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            figures["own_rss"] = float(line.split()[1]) / 2**20
        elif line.startswith("auditor_thread_cpu_seconds_total{"):
            figures["own_threads_cpu"] = figures.get("own_threads_cpu", 0.0) + float(line.rsplit(" ", 1)[1])
    return figures  # empty from a revision that did not say


SCRAPES = 200
SCRAPE_SPACING_S = 0.02


def scrape_cost(daemon: Daemon, idle_percent: float) -> dict[str, float]:
    """The daemon's CPU for one scrape of its /metrics (its idle rate taken out) and the scrape's
    median time; then its own figures against /proc's, read at the same moment."""
    pid = daemon.process.pid
    before, started, took = cpu_seconds(pid), time.monotonic(), []
    for _ in range(SCRAPES):
        asked = time.monotonic()
        metrics(daemon.metrics_port)
        took.append(time.monotonic() - asked)
        time.sleep(SCRAPE_SPACING_S)
    wall = time.monotonic() - started
    spent = cpu_seconds(pid) - before - idle_percent / 100 * wall
    own = own_figures(metrics(daemon.metrics_port))
    return {"scrape_cpu_ms": spent / SCRAPES * 1000, "scrape_ms": sorted(took)[len(took) // 2] * 1000, **own,
            "proc_rss": memory_mib(pid)["VmRSS"], "proc_cpu": cpu_seconds(pid)}


def llvm_mapped(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any(lib in maps for lib in LLVM_LIBS)


def idle_vllm() -> Any:
    """An idle vLLM's /metrics as vLLM serves it: prometheus_client's registry behind a kept-alive
    HTTP/1.1 server (uvicorn there), ``name[]`` answered with the named series only, as
    prometheus_client's own apps do. Nothing running or waiting; 50 histograms of 38 buckets."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=registry).labels("m").set(0)
    Gauge("vllm:num_requests_waiting", "Waiting.", ["model_name"], registry=registry).labels("m").set(0)
    Counter("vllm:generation_tokens", "Tokens.", ["model_name"], registry=registry).labels("m").inc(0)
    Counter("vllm:request_success", "Finished.", ["model_name", "finished_reason"],
            registry=registry).labels("m", "abort").inc(0)
    for i in range(50):
        Histogram(f"vllm:latency_{i}_seconds", "A histogram.", ["model_name"], registry=registry,
                  buckets=[0.01 * 2 ** (b / 3) for b in range(37)]).labels("m").observe(0.5)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            names = urllib.parse.parse_qs(url.query).get("name[]")
            body = generate_latest(registry.restricted_registry(names) if names else registry)
            self.send_response(200 if url.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Daemon:
    def __init__(self, loader: str, work: Path, grpc: bool, tree: Path = REPO, label: str = "",
                 engine: str = "idle") -> None:
        self.loader = label or loader
        # "procfs" is no BPF loader: the daemon's /proc source, as a host without bcc or CAP_BPF runs.
        self.source = "procfs" if loader == "procfs" else "bpf"
        self.metrics_port = free_port()
        self.server: Any = None
        # A watched port nobody uses: listening (an idle engine, this process), or only bound; or
        # an idle vLLM's /metrics served from this process (its CPU is not the daemon's).
        if engine == "vllm":
            self.server = idle_vllm()
            self.idle = self.server.socket
        else:
            self.idle = socket.create_server(("127.0.0.1", 0)) if engine == "idle" else socket.socket()
        if engine == "none":
            self.idle.bind(("127.0.0.1", 0))
        command = [sys.executable, "-c", ENTRY, loader, "run", "--db", f"sqlite:///{work / self.loader.replace(' ', '-')}.db",
                   "--port", str(self.idle.getsockname()[1]), "--otlp-http", "127.0.0.1:0",
                   "--otlp-grpc", "127.0.0.1:0" if grpc else "",
                   "--live", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",  # on, as by default
                   "--metrics", f"127.0.0.1:{self.metrics_port}", "--source", self.source]
        self.log = (work / f"{self.loader.replace(' ', '-')}.log").open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=work, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                            filter(None, [str(tree), os.environ.get("PYTHONPATH")]))})
        self.ready_s: float | None = None
        self.startup_cpu = 0.0  # CPU seconds until ready, its children's (a loader's compile) included

    def check_ready(self) -> bool:
        ready = f'auditor_disconnect_source_info{{source="{self.source}"}} 1.0'
        if self.ready_s is None and ready in metrics(self.metrics_port):
            self.ready_s = time.monotonic() - self.started
            self.startup_cpu = cpu_seconds(self.process.pid, children=True)
        return self.ready_s is not None

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        else:
            self.idle.close()
        self.log.close()


def measure(daemons: list[Daemon], seconds: float) -> dict[str, dict[str, float]]:
    before = {d.loader: cpu_seconds(d.process.pid) for d in daemons}
    threads_before = {d.loader: thread_cpu_seconds(d.process.pid) for d in daemons}
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    results = {}
    for daemon in daemons:
        pid = daemon.process.pid
        cpu = cpu_seconds(pid) - before[daemon.loader]
        results[daemon.loader] = {"cpu_percent": cpu / wall * 100, **memory_mib(pid),
                                  "llvm": float(llvm_mapped(pid)), "ready_s": daemon.ready_s or 0.0,
                                  "startup_cpu": daemon.startup_cpu}
        # Each thread's share, by its Python name (threads of one name add up).
        names, spent = thread_names(pid), thread_cpu_seconds(pid)
        for tid, (seconds_now, woke_now) in spent.items():
            name = names.get(tid, "(unnamed)")
            seconds_then, woke_then = threads_before[daemon.loader].get(tid, (0.0, 0))
            key = "thread " + name
            results[daemon.loader][key] = results[daemon.loader].get(key, 0.0) + (seconds_now - seconds_then) / wall * 100
            key = "wake-ups/s " + name
            results[daemon.loader][key] = results[daemon.loader].get(key, 0.0) + (woke_now - woke_then) / wall
    return results


ENGINES = {"idle": "an idle engine on the watched port (followed; it answers no scrape)",
           "vllm": "an idle vLLM's /metrics on the watched port (followed and scraped)",
           "none": "nothing listening on the watched port"}


def report(results: dict[str, dict[str, float]], seconds: float, grpc: bool, engine: str = "idle") -> None:
    loaders = list(results)
    print(f"\nIdle daemon ('procfs': the /proc source, else the eBPF source by that loader), {seconds:g} s window, "
          f"gRPC listener {'on' if grpc else 'off'}, "
          + ENGINES[engine])
    print(f"  {'':<22}" + "".join(f"{name:>14}" for name in loaders))
    rows = [("CPU, % of one core", "cpu_percent", "{:.2f}"), ("RSS, MiB", "VmRSS", "{:.1f}"),
            ("PSS, MiB", "Pss", "{:.1f}"), ("private, MiB", "Private", "{:.1f}"),
            ("peak RSS, MiB", "VmHWM", "{:.1f}"), ("libbcc/LLVM mapped", "llvm", "{}"),
            ("ready after, s", "ready_s", "{:.1f}"), ("start-up CPU, s", "startup_cpu", "{:.2f}"),
            (f"CPU a scrape, ms ({SCRAPES})", "scrape_cpu_ms", "{:.2f}"), ("a scrape takes, ms", "scrape_ms", "{:.2f}"),
            ("RSS, MiB: /metrics", "own_rss", "{:.1f}"), ("RSS, MiB: /proc", "proc_rss", "{:.1f}"),
            ("CPU, s: /metrics", "own_threads_cpu", "{:.2f}"), ("CPU, s: /proc", "proc_cpu", "{:.2f}")]
    for label, key, fmt in rows:
        if not any(key in results[n] for n in loaders):
            continue
        # "-": a revision whose /metrics gives no figures of its own
        cells = [fmt.format(bool(results[n][key]) if key == "llvm" else results[n][key]) if key in results[n]
                 else "-" for n in loaders]
        print(f"  {label:<22}" + "".join(f"{cell:>14}" for cell in cells))
    threads = sorted({k for n in loaders for k in results[n] if k.startswith("thread ")},
                     key=lambda k: -max(results[n].get(k, 0.0) for n in loaders))
    print("  CPU by thread, % of one core (wake-ups a second)")
    for key in threads:
        name = key.removeprefix("thread ")
        cells = [f"{results[n].get(key, 0.0):.2f} ({results[n].get('wake-ups/s ' + name, 0.0):4.1f})" for n in loaders]
        print(f"    {name[:20]:<20}" + "".join(f"{cell:>14}" for cell in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--settle", type=float, default=5)
    parser.add_argument("--grpc", action="store_true", help="also listen for OTLP/gRPC, as the unit does")
    parser.add_argument("--loaders", default="prebuilt,child,inprocess",
                        help="comma-separated: prebuilt, child, inprocess (BPF loaders), procfs (the /proc source)")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's daemon beside them (the /proc "
                        "source when the first loader is procfs, else the child loader)")
    parser.add_argument("--engine", choices=tuple(ENGINES), default="idle",
                        help="idle: the watched port listens (an idle engine, followed); vllm: it serves an "
                             "idle vLLM's /metrics; none: nothing listens")
    args = parser.parse_args()
    if os.geteuid() != 0 and set(args.loaders.split(",")) - {"procfs"}:
        print("needs root (eBPF probe); --loaders procfs runs without it")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-footprint-"))
    atexit.register(shutil.rmtree, work, True)
    engine = args.engine
    daemons = [Daemon(loader, work, args.grpc, engine=engine) for loader in args.loaders.split(",")]
    if args.compare:
        from bench.ingest import export_tree

        old = export_tree(args.compare, work / "old")
        # REV's daemon with the first loader's source: its child loader, or the /proc source.
        kind = "procfs" if args.loaders.split(",")[0] == "procfs" else "child"
        daemons.insert(0, Daemon(kind, work, args.grpc, tree=old, label=f"{kind} {args.compare}", engine=engine))
    try:
        deadline = time.monotonic() + 120
        while not all(d.check_ready() for d in daemons):
            if time.monotonic() > deadline or any(d.process.poll() is not None for d in daemons):
                print(f"a daemon did not come up with its source; logs in {work}")
                return 1
            time.sleep(0.2)
        time.sleep(args.settle)
        results = measure(daemons, args.seconds)
        for daemon in daemons:
            results[daemon.loader] |= scrape_cost(daemon, results[daemon.loader]["cpu_percent"])
    finally:
        for daemon in daemons:
            daemon.stop()
    report(results, args.seconds, args.grpc, engine)
    for daemon in daemons:  # what the daemon said of its GPU samplers, where it said anything
        said = [line for line in (work / f"{daemon.loader.replace(' ', '-')}.log").read_text(errors="replace").splitlines()
                if "NVML" in line or "GPU" in line]
        for line in said[:3]:
            print(f"  {daemon.loader}: {line.strip()[:150]}")
    if engine == "vllm":
        from collectors.enginemetrics import filtered_path

        server = idle_vllm()
        sizes = [len(urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=5).read())
                 for path in ("/metrics", filtered_path("/metrics"))]
        server.shutdown()
        print(f"  the idle vLLM's page: {sizes[0]:,} bytes whole, {sizes[1]:,} bytes with the known series only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
