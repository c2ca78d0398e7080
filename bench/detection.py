"""How fast the daemon tells, and what it costs: detection latency, and CPU/memory under load.

Runs `auditor run` as its own process (so its CPU and memory are its own) against the reference
engine over loopback, as root (eBPF):

1. In-flight alarm: a detached engine with live notices; clients leave mid-decode. Time from the
   kernel's disconnect to an `inflight_zombie` in the store and to `auditor_inflight_zombies`
   rising in /metrics (target: p99 <= grace + 1 s).
2. Settled verdict: time from the engine's end of work (its truth log) to the zombie verdict in
   the store and counted in /metrics.
3. Load: an engine serving ~100 requests/s (10% cancelled); the daemon's CPU and peak RSS, and
   the load's verdicts against the engine's truth log (a verdict judged otherwise than the engine
   saw it, or a finding for a request that finished with its client, is listed).

With ``--compare REV`` the load runs alternately for the code of git revision REV and the working
tree (fresh daemons each run, same engines), and the medians are printed side by side; with
``--alarms N`` as well, each of those daemons first takes N alarms, pooled by tree.
Each load request has a connection of its own (every request ends in a close: the daemon's worst
case); with ``--keep-alive`` they share kept-alive connections as an SDK's pool does, and only a
cancel (or the server's idle timeout) closes one.
``--setting KEY=VALUE`` runs the daemons with that configuration setting (a TOML value: ``--setting
sampler.interval_ms=200``); ``--compare-setting KEY=VALUE`` runs the working tree alternately as
configured and with the setting, side by side, as ``--compare`` does two trees.
With ``--live-load`` the load's engine also sends live notices (auditor.live), as a server
instrumented with them does. ``--memory-probe`` has each daemon say where its memory is, once a
minute (bench/memprobe: RSS, Python's object arenas, glibc's heap, SQLite's part of it);
``--memory-trace`` (one tree) has the daemon run tracemalloc and prints the Python allocations grown
from the second minute on, by the line that made them (it slows the daemon: not for CPU figures).
``--weak-load`` has the load's engine send no engine span and only vLLM's gauges, the weakest signal
set, and ``--load-behavior detached`` has it run a cancelled request's work on: together, every
verdict of the load stands on the gauges' orphans, with zombies beside the completed requests.
``--alarms-by gauges`` times the alarms of an engine that sends no live notices (as vLLM): the
daemon knows its zombies by the gauges it scrapes. ``--alarms-by port`` sends vLLM's whole signal
set from that engine: no engine span either, and spans exported every 5 s, so that the /metrics
alarm comes from the port's count of orphans (its gauges less the clients the kernel lists) and
the store's only once the close's span has come. ``--watch-inflight`` reads the daemon's
in-flight zombie count every half second during the load, whose engine stops at every disconnect:
any count is a misreading (the reads cost the daemon CPU: not for CPU figures).

Usage: .venv/bin/python bench/detection.py [--alarms 15] [--load-seconds 20] [--rate 100] [--cancel-every 10]
                                           [--compare REV --rounds 3] [--profile stacks.txt]
                                           [--live-load] [--otlp grpc] [--export-delay-ms 5000] [--memory-probe]
                                           [--memory-trace] [--keep-alive] [--setting KEY=VALUE]
                                           [--compare-setting KEY=VALUE --rounds 3] [--alarms-by gauges|port]
                                           [--weak-load] [--load-behavior detached]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.config import ProbeConfig
from collectors.enginemetrics import PageConnection
from replay.client import KeptConnections, RequestPlan, run_load
from replay.engine.launch import running_engine
from replay.engine.truth import expected_verdict

GRACE_S = 0.5
MEMPROBE = Path(__file__).resolve().parent / "memprobe"  # its sitecustomize, on the daemon's path
RACE_S = 0.005  # a close this near the end of the work races it (kernel and engine clocks, one step)
# How the alarms' zombies are known while they run: by the engine's live notices, or (as vLLM's) by
# its gauges alone, which the daemon scrapes (engine_metrics.interval_seconds).
KNOWN_BY = {"live": "live notices on", "gauges": "no live notices: the engine's gauges tell",
            "port": "vLLM's signals: no live notice, no engine span, spans every 5 s: the port's gauges and "
                    "the kernel's listing tell, before the span"}
PORT_EXPORT_DELAY_MS = 5000  # --alarms-by port: vLLM's span exporter's cadence
SETTLE_S = 10.0  # how long after the last export the load's last verdicts may take (see judge_settled)
INFLIGHT_POLL_S = 0.5  # --watch-inflight


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_kept = threading.local()


def scrape(port: int) -> str:
    """The daemon's /metrics page over a kept-alive connection (one a thread and port), as a
    Prometheus server keeps its own. The alarms read it every 10 ms: a connection a read would be
    a hundred accepts a second on this host, and the /proc source takes a listing of an engine's
    clients made while any connection was accepted as one a client may be missing from (it tells
    nothing then: docs/verdicts.md)."""
    connections = _kept.__dict__.setdefault("by_port", {})
    for attempt in (0, 1):
        connection = connections.pop(port, None) or PageConnection("127.0.0.1", port, timeout_s=2)
        try:
            status, body, keep_alive = connection.get("/metrics")
        except (OSError, ValueError):
            connection.close()  # a daemon since stopped (another is on the port now): one fresh try
            if attempt:
                raise
            continue
        if status != 200:
            connection.close()
            raise OSError(f"/metrics on port {port}: HTTP {status}")
        if keep_alive:
            connections[port] = connection
        else:
            connection.close()
        return body.decode()
    raise AssertionError("unreachable")


def metric(text: str, name: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(match.group(1))
    return total


def correlation_steps(port: int | None) -> dict[str, float]:
    """The correlator's CPU seconds by step of its rounds (``auditor_correlation_cpu_seconds_total``);
    empty where the daemon has no such series (an older revision) or /metrics does not answer."""
    if port is None:
        return {}
    try:
        text = scrape(port)
    except OSError:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^auditor_correlation_cpu_seconds_total{step="([^"]+)"} ([0-9.e+-]+)$', text, re.M)}


def correlation_rounds(port: int | None) -> float:
    """Correlation rounds run so far (the count of ``auditor_correlation_tick_seconds``)."""
    if port is None:
        return 0.0
    try:
        return metric(scrape(port), "auditor_correlation_tick_seconds_count")
    except OSError:
        return 0.0


def stored_spans(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM spans").fetchone()[0])


def first_seen(db: Path, request_id: str, verdict: str, metrics_port: int, metric_name: str, above: float,
               timeout_s: float) -> tuple[int | None, int | None]:
    """Wall-clock ns at which the store first held ``verdict`` for the request and /metrics first
    showed ``metric_name`` above ``above``, polled every 10 ms; None where that never happened."""
    store_ns = metrics_ns = None
    deadline = time.time() + timeout_s
    while time.time() < deadline and (store_ns is None or metrics_ns is None):
        now = time.time_ns()
        if store_ns is None and (verdict_of(db, request_id) or ("", 0))[0] == verdict:
            store_ns = now
        if metrics_ns is None and metric(scrape(metrics_port), metric_name) > above:
            metrics_ns = now
        time.sleep(0.01)
    return store_ns, metrics_ns


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_memory_mib(pid: int) -> tuple[float, float]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def thread_cpu_seconds(pid: int) -> dict[int, tuple[float, int]]:
    """Each of the process's threads, by thread id: its CPU seconds (the scheduler's nanoseconds
    where the kernel keeps them, else clock ticks) and how many times it slept and woke
    (voluntary context switches). On a virtual machine a wake-up costs the waking thread tens to
    hundreds of microseconds, so a thread that wakes often costs CPU even with little to do."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            try:
                cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, IndexError, ValueError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue  # the thread ended
        wakeups = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M)
        out[int(task.name)] = (cpu, int(wakeups.group(1)) if wakeups else 0)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by thread id, from ``py-spy dump`` (empty without py-spy)."""
    beside = Path(sys.executable).with_name("py-spy")
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        print("no py-spy (the dev extras install it): the daemon's threads are shown by id", file=sys.stderr)
        return {}
    try:
        dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'^Thread (?:0x)?(\d+) \([^)]*\): "([^"]*)"', dump, re.M)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cancel_one(port: int, request_id: str, delay_s: float, max_tokens: int) -> None:
    plan = RequestPlan(request_id=request_id, trace_id=os.urandom(16).hex(),
                       body={"model": "ref-llm-1b", "prompt": "a b c d", "max_tokens": max_tokens, "stream": True},
                       cancel_after_s=delay_s, close_with="fin")
    asyncio.run(run_load("127.0.0.1", port, [plan], concurrency=1))


def verdict_of(db: Path, request_id: str) -> tuple[str, int] | None:
    with sqlite3.connect(db, timeout=5) as conn:
        row = conn.execute("SELECT verdict, disconnect_at_ns FROM verdicts WHERE request_id = ?", (request_id,)).fetchone()
    return (row[0], row[1]) if row else None


def measure_alarms(db: Path, engine_port: int, metrics_port: int, count: int) -> dict[str, list[float]]:
    store_lat, metrics_lat, settle_store, settle_metrics = [], [], [], []
    for index in range(count):
        request_id = f"alarm-{index}"
        gauge_before = metric(scrape(metrics_port), "auditor_inflight_zombies")
        zombies_before = metric(scrape(metrics_port), "auditor_disconnect_verdicts_total")
        # Each close at a random moment of the daemon's 1 s round: started right after the round
        # that settled the last one, every alarm would meet the rounds at the same phase.
        time.sleep(random.uniform(0.0, 1.0))
        cancel_one(engine_port, request_id, 0.3, max_tokens=400)  # zombies of ~4 s: longer than a round
        seen_store, seen_metrics = first_seen(db, request_id, "inflight_zombie", metrics_port,
                                              "auditor_inflight_zombies", gauge_before, timeout_s=10)
        found = verdict_of(db, request_id)
        if found is None or seen_store is None or seen_metrics is None:
            # With spans every 5 s (--alarms-by port) the store may learn of the zombie only once
            # its work ended: the /metrics alarm is still timed.
            print(f"  {request_id}: not flagged within 10 s ({found}; store {seen_store is not None}, "
                  f"/metrics {seen_metrics is not None})")
        if found is None:
            continue
        disconnect_ns = found[1]
        if seen_store is not None:
            store_lat.append((seen_store - disconnect_ns) / 1e9)
        if seen_metrics is not None:
            metrics_lat.append((seen_metrics - disconnect_ns) / 1e9)
        # Then the work ends; time until the settled zombie is stored and counted.
        stored, counted = first_seen(db, request_id, "zombie", metrics_port, "auditor_disconnect_verdicts_total",
                                     zombies_before, timeout_s=30)
        with sqlite3.connect(db, timeout=5) as conn:
            work_end = conn.execute("SELECT work_end_ns FROM verdicts WHERE request_id = ?", (request_id,)).fetchone()[0]
        if stored and counted and work_end:
            settle_store.append((stored - work_end) / 1e9)
            settle_metrics.append((counted - work_end) / 1e9)
    return {"alarm: store": store_lat, "alarm: /metrics": metrics_lat,
            "settled zombie: store": settle_store, "settled zombie: /metrics": settle_metrics}


async def paced_load(port: int, rate: float, seconds: float, cancel_every: int,
                     keep_alive: bool = False, tokens: int = 4) -> tuple[int, float, dict[str, int], str]:
    """Send the load; returns how many requests, the rate achieved, the requests whose client
    left before it had read the whole answer, with when it cancelled (wall-clock ns), and how the
    connections went. ``keep_alive``: the requests share kept-alive connections, as an SDK's pool
    does (a cancel closes the connection under its request); else one connection a request."""
    plans = []
    total = int(rate * seconds)
    for index in range(total):
        cancelled = index % cancel_every == 0
        plans.append(RequestPlan(request_id=f"load-{index}", trace_id=os.urandom(16).hex(),
                                 body={"model": "ref-llm-1b", "prompt": "a b", "max_tokens": tokens, "stream": index % 2 == 0},
                                 cancel_after_s=0.005 if cancelled else None, close_with="rst" if index % 4 else "fin"))
    left: dict[str, int] = {}
    pool = KeptConnections() if keep_alive else None

    async def send(plan: RequestPlan) -> None:
        for outcome in await run_load("127.0.0.1", port, [plan], concurrency=1, connections=pool):
            if outcome.cancelled_at_ns is not None and not outcome.completed:
                left[plan.request_id] = outcome.cancelled_at_ns

    # Each request's task is made at its time: a task per request made up front (180,000 for a
    # 30-minute load) kept the loop busy past the first requests' times, which then went out in a
    # burst that the engine noticed cancels of up to 0.7 s late.
    running: set[asyncio.Task[None]] = set()
    started = time.monotonic()
    for index, plan in enumerate(plans):
        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
        task = asyncio.create_task(send(plan))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    achieved = total / (time.monotonic() - started)
    if pool is None:
        return total, achieved, left, "a connection a request"
    await pool.close()
    return total, achieved, left, f"kept alive: {pool.opened} connections, {pool.reused} requests on one used before"


def load_engine_env(export_delay_ms: int | None) -> dict[str, str] | None:
    """The load engine's environment: this one, with its span export delay where one is asked."""
    if export_delay_ms is None:
        return None
    return dict(os.environ, OTEL_BSP_SCHEDULE_DELAY=str(export_delay_ms))


def setting(text: str) -> tuple[str, str, str]:
    """``section.key=value`` (value as TOML writes it) -> (section, key, value); argparse's type."""
    name, sep, value = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not (sep and dot and section and key and value.strip()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected SECTION.KEY=VALUE, e.g. sampler.interval_ms=200")
    try:
        tomllib.loads(f"v = {value.strip()}")
    except tomllib.TOMLDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {value.strip()!r} is no TOML value ({exc}); "
                                         'a text needs quotes: key="text"') from None
    return section, key.strip(), value.strip()


def config_file(settings: list[tuple[str, str, str]], path: Path) -> Path | None:
    """The daemon's configuration file holding ``settings`` (none: the daemon's defaults)."""
    if not settings:
        return None
    sections: dict[str, list[str]] = {}
    for section, key, value in settings:
        sections.setdefault(section, []).append(f"{key} = {value}")
    path.write_text("".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in sections.items()))
    return path


def settings_label(settings: list[tuple[str, str, str]]) -> str:
    return ", ".join(f"{section}.{key}={value}" for section, key, value in settings) or "defaults"


@contextlib.contextmanager
def running_daemon(tree: Path, db: Path, ports: list[int], otlp: int, metrics_port: int, live: int,
                   protocol: str = "http", source: str = "bpf",
                   memory_probe: Path | None = None,
                   memory_trace: Path | None = None, config: Path | None = None,
                   cpus: set[int] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``auditor run`` from the code in ``tree``, until it answers /metrics; its OTLP receiver on
    ``otlp`` speaks ``protocol`` (the other one is off). With ``memory_probe``, the daemon writes
    where its memory is to that file each minute (bench/memprobe); with ``memory_trace``, its
    Python allocations by line (tracemalloc); with ``config``, that configuration file (the
    command line's options still win); with ``cpus``, the daemon and all its threads run on those
    CPUs only."""
    receivers = ["--otlp-http", f"127.0.0.1:{otlp}", "--otlp-grpc", ""] if protocol == "http" else \
        ["--otlp-http", "", "--otlp-grpc", f"127.0.0.1:{otlp}"]
    command = [sys.executable, "-m", "auditor", "run", "--db", f"sqlite:///{db}", *receivers,
               "--metrics", f"127.0.0.1:{metrics_port}", "--live", f"127.0.0.1:{live}",
               "--grace", str(GRACE_S), "--source", source, *(["--config", str(config)] if config else [])]
    for port in ports:
        command += ["--port", str(port)]
    # cwd too: `python -m` puts the working directory first on the path, before PYTHONPATH.
    paths = [str(tree), os.environ.get("PYTHONPATH")]
    env = dict(os.environ)
    if memory_probe is not None or memory_trace is not None:
        paths.append(str(MEMPROBE))
    if memory_probe is not None:
        env["BENCH_MEMPROBE"] = str(memory_probe)
    if memory_trace is not None:
        env["BENCH_MEMTRACE"] = str(memory_trace)
    daemon = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree,
                              env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, paths))),
                              preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if daemon.poll() is not None:
                raise RuntimeError(f"the daemon exited with {daemon.returncode} at start: run its command to see "
                                   f"why ({' '.join(command)})")
            try:
                scrape(metrics_port)
                break
            except OSError:
                time.sleep(0.2)
        yield daemon
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)


def measure_load(daemon: subprocess.Popen[bytes], db: Path, port: int, args: argparse.Namespace,
                 metrics_port: int | None = None) -> dict[str, Any]:
    """The daemon's CPU (in all, per thread, and the correlator's by step) and memory over a paced load."""
    profiler = None
    if args.profile:
        profiler = subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(daemon.pid), "-r", str(args.profile_rate),
             "-d", str(int(args.load_seconds)), "-f", "raw", "-o", str(args.profile), "--gil", "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu_before, wall_before = proc_cpu_seconds(daemon.pid), time.monotonic()
    threads_before = thread_cpu_seconds(daemon.pid)
    steps_before = correlation_steps(metrics_port)
    rounds_before, spans_before = correlation_rounds(metrics_port), stored_spans(db)
    rss_series: list[float] = []
    done = threading.Event()

    def watch_rss() -> None:  # every 10 s: memory that grows with the run's length shows here
        while not done.wait(10):
            rss_series.append(proc_memory_mib(daemon.pid)[0])

    watcher = threading.Thread(target=watch_rss, daemon=True)
    watcher.start()
    inflight: list[float] = []

    def watch_inflight() -> None:  # the load's engine makes no zombie: every one shown is a misreading
        while not done.wait(INFLIGHT_POLL_S):
            inflight.append(metric(scrape(metrics_port), "auditor_inflight_zombies") if metrics_port else 0.0)

    if args.watch_inflight:
        threading.Thread(target=watch_inflight, daemon=True).start()
    sent, achieved, client_left, connections = asyncio.run(paced_load(
        port, args.rate, args.load_seconds, cancel_every=args.cancel_every, keep_alive=args.keep_alive,
        tokens=args.load_tokens))
    done.set()
    cpu = proc_cpu_seconds(daemon.pid) - cpu_before
    threads = {tid: (spent - threads_before.get(tid, (0.0, 0))[0], woke - threads_before.get(tid, (0.0, 0))[1])
               for tid, (spent, woke) in thread_cpu_seconds(daemon.pid).items()}
    wall = time.monotonic() - wall_before
    step_seconds = {step: spent - steps_before.get(step, 0.0) for step, spent in correlation_steps(metrics_port).items()}
    rounds, spans_taken = correlation_rounds(metrics_port) - rounds_before, stored_spans(db) - spans_before
    steps = {step: spent / wall * 100 for step, spent in step_seconds.items()}
    # A round's steps in ms, and the spans step a span (the spans stored meanwhile), where told.
    per_round = {step: spent / rounds * 1e3 for step, spent in step_seconds.items()} if rounds else {}
    span_us = step_seconds["spans"] / spans_taken * 1e6 if spans_taken and "spans" in step_seconds else None
    names = thread_names(daemon.pid)
    rss, peak = proc_memory_mib(daemon.pid)
    if profiler is not None:
        profiler.wait(timeout=30)
    time.sleep(3)
    with sqlite3.connect(db) as conn:
        spans = conn.execute("SELECT count(*) FROM spans").fetchone()[0]
        verdicts = conn.execute("SELECT count(*) FROM verdicts WHERE request_id LIKE 'load-%'").fetchone()[0]
    # The rest of the process's CPU: threads that ended during the load (a connection's reader),
    # and the process's own count in clock ticks against the threads' nanoseconds.
    by_name: dict[str, float] = {}
    wakeups: dict[str, float] = {}
    for tid, (spent, woke) in threads.items():
        name = re.sub(r"^Thread-\d+ \((.*)\)$", r"\1", names.get(tid, f"thread {tid}"))
        by_name[name] = by_name.get(name, 0.0) + spent / wall * 100
        wakeups[name] = wakeups.get(name, 0.0) + woke / wall
    by_name["(unattributed)"] = max(0.0, (cpu - sum(spent for spent, _ in threads.values())) / wall * 100)
    return {"sent": sent, "achieved": achieved, "connections": connections, "cpu": cpu, "wall": wall, "cpu_percent": cpu / wall * 100,
            "rss": rss, "peak": peak, "rss_series": rss_series, "spans": spans, "verdicts": verdicts, "threads": by_name,
            "wakeups": wakeups, "client_left": client_left, "steps": steps,
            "rounds": rounds, "per_round": per_round, "spans_taken": spans_taken, "span_us": span_us,
            "inflight": inflight}


def judge_load(db: Path, truths: list[dict[str, Any]], poll_s: float = 0.0,
               client_left: dict[str, int] | None = None) -> dict[str, Any]:
    """The load's verdicts against the load engine's truth log: disconnects it saw and how each was
    judged, and findings for requests whose client never left while they ran (the engine finished
    them normally and saw no disconnect). ``client_left``: the requests the load's client cancelled
    before reading the whole answer, with when. A cancel the engine did not see before it finished
    (its truth has no disconnect: the work ended first, under a busy CPU several ms after the close)
    is judged by the client's cancel instead, as DESIGN §5 judges it: not completed, since the work
    ended after the client left. Within 20 ms of the grace, aborted and zombie are one call;
    completed against aborted where the work ended within ``RACE_S`` of the disconnect is listed
    apart, as a race of the close with the response's end (DESIGN: such a race is completed), and
    so is no verdict there (the daemon put the close after the response: an idle close).
    ``poll_s``: a polled source's interval; disconnects of requests that arrived less than that
    before them (connections a poll can miss: docs/probe.md) are counted apart when missed."""
    with sqlite3.connect(db) as conn:
        found = conn.execute("SELECT request_id, verdict, disconnect_at_ns FROM verdicts "
                             "WHERE request_id LIKE 'load-%'").fetchall()
    rows = {request_id: verdict for request_id, verdict, _ in found}
    closed_at = {request_id: ts for request_id, _, ts in found}
    client_left = client_left or {}
    unseen = [dict(t, disconnect_at=client_left[rid]) for t in truths
              if t["disconnect_at"] is None and t["finish_reason"] in ("stop", "length")
              and (rid := t["request_id"].removeprefix("cmpl-")) in client_left and client_left[rid] < t["finished_at"]]
    left = [t for t in truths if t["disconnect_at"] is not None] + unseen
    wrong: list[str] = []
    races: list[str] = []
    missed = missed_short = 0
    missed_ids: list[str] = []
    ended_ns = max((t["disconnect_at"] for t in left), default=0)
    for truth in left:
        request_id = truth["request_id"].removeprefix("cmpl-")
        verdict, want = rows.get(request_id), expected_verdict(truth, GRACE_S)
        lag_s = (truth["finished_at"] - truth["disconnect_at"]) / 1e9
        if verdict is None and abs(lag_s) <= RACE_S:
            # By the daemon's clocks the close came after the response's end: an idle close, no verdict.
            races.append(f"{request_id} no verdict, an idle close (truth {want}, lag {lag_s:.3f} s)")
        elif verdict is None:
            missed += 1
            missed_ids.append(f"{request_id} without a verdict (left {(ended_ns - truth['disconnect_at']) / 1e9:.1f} s "
                              f"before the last disconnect; the work ended {lag_s:.3f} s after it)")
            missed_short += truth["disconnect_at"] - truth["arrival_at"] < poll_s * 1e9
        elif {verdict, want} == {"completed", "aborted"} and abs(lag_s) <= RACE_S:
            races.append(f"{request_id} {verdict} (truth {want}, lag {lag_s:.3f} s)")
        elif verdict != want and not ({verdict, want} <= {"aborted", "zombie"} and abs(lag_s - GRACE_S) <= 0.02):
            wrong.append(f"{request_id} {verdict} (truth {want}, lag {lag_s:.3f} s)")
    # A request the engine finished without seeing its client leave: a finding for it is false,
    # unless the close it was joined to came within RACE_S of the finish (a cancel that raced the
    # last step: the engine finished before it looked).
    unseen_ids = {t["request_id"] for t in unseen}
    stayed = {t["request_id"].removeprefix("cmpl-"): t for t in truths
              if t["disconnect_at"] is None and t["finish_reason"] in ("stop", "length")
              and t["request_id"] not in unseen_ids}
    false: list[str] = []
    for rid, verdict in rows.items():
        if rid not in stayed or verdict in ("completed", "unconfirmed"):
            continue
        lag_s = (stayed[rid]["finished_at"] - closed_at[rid]) / 1e9 if closed_at[rid] else math.inf
        line = f"{rid} {verdict} (truth: finished {lag_s:.3f} s after the close, which the engine did not see)"
        (races if abs(lag_s) <= RACE_S else false).append(line)
    return {"left": len(left), "unseen": len(unseen), "missed": missed, "missed_short": missed_short,
            "missed_ids": missed_ids,
            "wrong": wrong, "races": races, "false": false}


def judge_settled(db: Path, engine: Any, args: argparse.Namespace, client_left: dict[str, int]) -> dict[str, Any]:
    """The load judged once its last disconnects have had time to be: every one has a verdict, or
    ``SETTLE_S`` past the last export passed (the last spans come up to one export delay after the
    load, a reset's verdict waits for the events of its span's end, and then a round writes it)."""
    poll_s = 1 / ProbeConfig().poll_hz if args.source == "procfs" else 0.0
    deadline = time.monotonic() + (args.export_delay_ms or 200) / 1000 + SETTLE_S
    time.sleep((args.export_delay_ms or 200) / 1000 + 2)
    while True:
        judged = judge_load(db, engine.truth(), poll_s, client_left)
        if not judged["missed"] or time.monotonic() > deadline:
            return judged
        time.sleep(0.5)


def print_judged(judged: dict[str, Any]) -> None:
    short = f" ({judged['missed_short']} within one poll of their arrival)" if judged["missed_short"] else ""
    unseen = f" ({judged['unseen']} of them cancels it finished before seeing)" if judged.get("unseen") else ""
    print(f"  against truth   {judged['left']} disconnects{unseen}: {judged['missed']} without a verdict{short}, "
          f"{len(judged['wrong'])} judged otherwise, {len(judged['races'])} closes within "
          f"{RACE_S * 1000:.0f} ms of the work's end (races); {len(judged['false'])} findings for requests that finished with "
          "their client")
    for line in (judged["wrong"] + judged["false"] + judged["missed_ids"])[:5] + judged["races"][:2]:
        print(f"    {line}")


def print_load(load: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nDaemon under load ({load['sent']} requests, {load['achieved']:.0f} req/s achieved of {args.rate:.0f} "
          f"asked, {cancelled_share(args)} cancelled, spans over OTLP/{'HTTP' if args.otlp == 'http' else 'gRPC'} every "
          f"{args.export_delay_ms or 200} ms, disconnects from {args.source})")
    print(f"  daemon's config {settings_label(args.setting)}")
    print(f"  connections     {load['connections']}")
    print("  CPUs            " + ("all shared" if args.daemon_cpu is None else
                                 f"the daemon on CPU {args.daemon_cpu} alone, the engines and the load on the others"))
    print(f"  daemon CPU      {load['cpu_percent']:6.1f} % of one core ({load['cpu']:.2f} CPU-s over {load['wall']:.1f} s)")
    print(f"  daemon RSS      {load['rss']:6.1f} MiB now, {load['peak']:.1f} MiB peak; every 10 s: "
          + ", ".join(f"{mib:.0f}" for mib in load["rss_series"]))
    print(f"  stored          {load['spans']} spans, {load['verdicts']} verdicts of load requests")
    print("  by thread, % of one core (wake-ups a second): " + ", ".join(
        f"{name} {share:.2f}" + (f" ({load['wakeups'][name]:.1f})" if load["wakeups"].get(name) else "")
        for name, share in sorted(load["threads"].items(), key=lambda kv: -kv[1]) if share >= 0.005))
    if load["steps"]:
        print("  correlator by step of its rounds, % of one core: "
              + ", ".join(f"{step} {share:.2f}" for step, share in load["steps"].items()))
    if load["per_round"]:
        print(f"  correlator, ms a round ({load['rounds']:.0f} rounds): "
              + ", ".join(f"{step} {ms:.2f}" for step, ms in load["per_round"].items()))
    if load["span_us"] is not None:
        print(f"  correlator's spans step: {load['span_us']:.1f} us a span ({load['spans_taken']} spans stored meanwhile)")
    if load["inflight"]:
        shown = load["inflight"]
        print(f"  in-flight zombies shown during the load (none true: the load's engine stops at every disconnect), "
              f"every {INFLIGHT_POLL_S:g} s: mean {statistics.fmean(shown):.2f}, max {max(shown):.0f}, "
              f"above 0 in {sum(1 for n in shown if n > 0) / len(shown):.0%} of {len(shown)} readings")


def print_memory(probes: dict[str, Path], columns: int = 7) -> None:
    """The memory probe's readings (MiB) at up to ``columns`` moments of each daemon's load."""
    parts = (("rss", "RSS"), ("pymalloc", "Python's object arenas"), ("pymalloc_live", "  of them, in live objects"),
             ("heap_used", "glibc heap in use"),
             ("heap_free", "glibc heap free, held"), ("sqlite", "  of the heap, SQLite's"),
             ("anon", "anonymous"), ("file", "file-backed"))
    collector = (("gc_objects", "objects tracked, thousands", 1e-3), ("gc_young_n", "young collections", 1),
                 ("gc_young_ms", "  their CPU, ms", 1), ("gc_full_n", "full collections", 1),
                 ("gc_full_ms", "  their CPU, ms", 1))
    for label, path in probes.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if not rows:
            print(f"\nMemory of {label}: no probe readings")
            continue
        picked = sorted({rows[round(i * (len(rows) - 1) / max(1, columns - 1))]["s"] for i in range(columns)})
        at = [row for row in rows if row["s"] in picked]
        unit, per = ("minute", 60) if at[-1]["s"] >= 600 else ("second", 1)
        print(f"\nMemory of {label}, MiB (bench/memprobe), at {unit}:")
        print(f"  {'':<26}" + "".join(f"{row['s'] / per:>7.0f}" for row in at))
        for key, name in parts:
            print(f"  {name:<26}" + "".join("      -" if row.get(key) is None else f"{row[key]:>7.1f}" for row in at))
        print("  the garbage collector, since start-up:")
        for key, name, scale in collector:
            print(f"  {name:<26}" + "".join("      -" if row.get(key) is None else f"{row[key] * scale:>7.0f}"
                                            for row in at))


def print_memory_trace(path: Path, tree: Path, top: int = 20) -> None:
    """The daemon's Python allocations at its last tracemalloc reading: in all, grown since the
    base reading, and the lines that grew most and that hold most."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not rows:
        print("\nPython allocations (tracemalloc): no readings (a load shorter than the base moment?)")
        return
    print(f"\nPython allocations (tracemalloc), MiB held / grown since {rows[0]['base_s']:.0f} s, by reading: "
          + ", ".join(f"{row['s']} s {row['held'] / 2**20:.1f} / {row['grown'] / 2**20:+.1f}" for row in rows))
    print(f"  grown most by {rows[-1]['s']} s (KiB, objects; KiB held):")
    for where, grown, count, held in rows[-1]["top"][:top]:
        print(f"  {grown / 1024:>9.0f} {count:>8} {held / 1024:>9.0f}  {where.replace(str(tree) + '/', '')}")
    print(f"  held most at {rows[-1]['s']} s (KiB, objects):")
    for where, held, count in rows[-1]["held_top"][:top]:
        print(f"  {held / 1024:>9.0f} {count:>8}  {where.replace(str(tree) + '/', '')}")


def print_latencies(latencies: dict[str, list[float]], count: int, known_by: str = "live") -> None:
    print(f"\nDetection latency (grace {GRACE_S} s; {count} zombies, {KNOWN_BY[known_by]})")
    print(f"  {'measure':<28}{'n':>4}{'p50 s':>9}{'p99 s':>9}{'max s':>9}   target")
    for name, values in latencies.items():
        if not values:
            print(f"  {name:<28}{0:>4}   (none)")
            continue
        target = f"p99 <= {GRACE_S + 1:.1f} s" if name.startswith("alarm") else "-"
        print(f"  {name:<28}{len(values):>4}{statistics.median(values):>9.3f}{percentile(values, 0.99):>9.3f}"
              f"{max(values):>9.3f}   {target}")


def print_alarm_comparison(alarms: dict[str, dict[str, list[float]]], count: int, known_by: str = "live") -> None:
    labels = list(alarms)
    print(f"\nDetection latency, side by side (grace {GRACE_S} s; {count} zombies a daemon, {KNOWN_BY[known_by]}; "
          f"target: alarm p99 <= {GRACE_S + 1:.1f} s)")
    print(f"  {'measure, s':<30}" + "".join(f"{label:>16}" for label in labels))
    for name in dict.fromkeys(name for by_name in alarms.values() for name in by_name):
        for stat, value in (("p50", statistics.median), ("p99", lambda v: percentile(v, 0.99)), ("max", max)):
            cells = [f"{value(alarms[label][name]):.3f}" if alarms[label].get(name) else "-" for label in labels]
            print(f"  {name + ' ' + stat:<30}" + "".join(f"{cell:>16}" for cell in cells))
        print(f"  {name + ' n':<30}" + "".join(f"{len(alarms[label].get(name, [])):>16}" for label in labels))


def _thread_share(name: str, run: dict[str, Any]) -> float:
    return float(run["threads"].get(name, 0.0))


def _step_share(step: str, run: dict[str, Any]) -> float | None:
    return float(run["steps"][step]) if step in run["steps"] else None


def _rounds_a_second(run: dict[str, Any]) -> float | None:
    return run["rounds"] / run["wall"] if run.get("wall") else None


def _span_us(run: dict[str, Any]) -> float | None:
    return run["span_us"]


def cancelled_share(args: argparse.Namespace) -> str:
    return f"{100 / args.cancel_every:.0f}%"


def print_comparison(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    labels = list(results)
    print(f"\nDaemon at {args.rate:.0f} req/s ({cancelled_share(args)} cancelled, "
          f"{'kept-alive connections' if args.keep_alive else 'a connection a request'}), "
          f"median of {len(results[labels[0]])} alternating runs")
    print(f"  {'':<30}" + "".join(f"{label:>16}" for label in labels))
    rows: list[tuple[str, Callable[[dict[str, Any]], float], str]] = [
        ("CPU, % of one core", lambda r: r["cpu_percent"], "{:.2f}"), ("RSS, MiB", lambda r: r["rss"], "{:.1f}"),
        ("peak RSS, MiB", lambda r: r["peak"], "{:.1f}")]
    threads = sorted({name for runs in results.values() for run in runs for name in run["threads"]},
                     key=lambda name: -statistics.median(run["threads"].get(name, 0.0) for run in results[labels[-1]]))
    rows += [(f"  {name}", functools.partial(_thread_share, name), "{:.2f}") for name in threads]
    steps = list(dict.fromkeys(step for runs in results.values() for run in runs for step in run["steps"]))
    rows += [(f"  correlator: {step}", functools.partial(_step_share, step), "{:.2f}") for step in steps]
    rows += [("  correlator: us a span taken", _span_us, "{:.1f}")] if steps else []
    rows += [("  correlator: rounds a second", _rounds_a_second, "{:.2f}")] if steps else []
    for title, value, fmt in rows:
        # A revision from before the correlator told its steps has none: "-", not a zero.
        told = [[v for v in map(value, results[label]) if v is not None] for label in labels]
        cells = [fmt.format(statistics.median(values)) if values else "-" for values in told]
        print(f"  {title[:30]:<30}" + "".join(f"{cell:>16}" for cell in cells))
    print("  runs, CPU %: " + "; ".join(f"{label} " + ", ".join(f"{run['cpu_percent']:.2f}" for run in runs)
                                        for label, runs in results.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alarms", type=int, help="in-flight alarms to time (default 15; 0 with --compare): "
                        "each a client leaving at a random moment of the daemon's round")
    parser.add_argument("--load-seconds", type=float, default=20)
    parser.add_argument("--rate", type=float, default=100)
    parser.add_argument("--cancel-every", type=int, default=10, metavar="N",
                        help="the load's client cancels every Nth request (default 10: the goal's 10%%); a smaller N "
                             "shows how a round's cost follows the requests waiting out their late-span window")
    parser.add_argument("--profile", type=Path, help="record the daemon with py-spy during the load (raw stacks of "
                        "the thread holding the GIL; py-spy does not stop the daemon to sample, which at 250 Hz "
                        "doubled its CPU)")
    parser.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second with --profile")
    parser.add_argument("--compare", metavar="REV", help="also load a daemon of git revision REV's code, "
                        "alternating with the working tree's (latency only with --alarms)")
    parser.add_argument("--rounds", type=int, default=3, help="load runs of each tree with --compare")
    parser.add_argument("--load-tokens", type=int, default=4, metavar="N",
                        help="max_tokens of each load request: at the load engine's 2 ms a step, 4 makes requests of "
                             "about 10 ms; longer ones keep more requests running beside each cancel")
    parser.add_argument("--keep-alive", action="store_true",
                        help="the load's requests share kept-alive connections, as an SDK's pool does (the openai "
                             "SDK's httpx): a cancel closes its connection, a completed request leaves it open for "
                             "the next; without it, a connection a request (every request a close: the worst case)")
    parser.add_argument("--alarms-by", choices=tuple(KNOWN_BY), default="live",
                        help="how the alarms' zombies are known while they run: the engine's live notices, or "
                             "its gauges alone (as vLLM's), which the daemon scrapes")
    parser.add_argument("--live-load", action="store_true", help="the load's engine sends live notices too")
    parser.add_argument("--load-behavior", default="abort", choices=("abort", "detached"),
                        help="the load engine's on a disconnect: stop the work, or run it on (a zombie a cancel)")
    parser.add_argument("--weak-load", action="store_true",
                        help="the load's engine sends no engine span and only vLLM's gauges: the weakest signals")
    parser.add_argument("--watch-inflight", action="store_true",
                        help=f"read the daemon's auditor_inflight_zombies every {INFLIGHT_POLL_S:g} s during the load "
                             "(none is true there); the reads cost the daemon CPU: not for CPU figures")
    parser.add_argument("--otlp", choices=("http", "grpc"), default="http",
                        help="how the engines export their spans, and the daemon's receiver (vLLM's "
                             "exporter defaults to gRPC, and the unit listens for it)")
    parser.add_argument("--source", choices=("bpf", "procfs"), default="bpf",
                        help="the daemon's disconnect source (procfs: the fallback of a daemon without CAP_BPF)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the engines' compute (cuda: PyTorch on this host's GPU, sampled by NVML)")
    parser.add_argument("--load-engine-alone", action="store_true",
                        help="with --device cuda, only the load's engine on the GPU (the alarms' engine on the "
                             "CPU): one engine process a GPU, as most hosts run, where the daemon costs it by the "
                             "whole GPU's utilization instead of NVML's per-process call")
    parser.add_argument("--export-delay-ms", type=int, help="the load engine's span export delay "
                        "(OTEL_BSP_SCHEDULE_DELAY; the engine's own is 200 ms, the SDK's default, "
                        "which vLLM exports with, 5000 ms)")
    parser.add_argument("--memory-probe", action="store_true",
                        help="the daemon says where its memory is each minute (RSS, Python's arenas, glibc's heap, "
                             "SQLite), printed as a table at the end (bench/memprobe)")
    parser.add_argument("--memory-trace", action="store_true",
                        help="the daemon runs tracemalloc; its Python allocations grown from the second minute "
                             "on, by line, printed at the end (slows it: not for CPU figures; one tree only)")
    parser.add_argument("--setting", type=setting, action="append", default=[], metavar="KEY=VALUE",
                        help="a configuration setting of the daemons (repeatable), e.g. sampler.interval_ms=200")
    parser.add_argument("--compare-setting", type=setting, action="append", default=[], metavar="KEY=VALUE",
                        help="run the working tree alternately as configured and with this setting too "
                             "(repeatable: all of them together), side by side")
    parser.add_argument("--daemon-cpu", type=int, default=None, metavar="N",
                        help="run the daemon on CPU N alone and the engines and the load on the others: "
                             "a host with cores to spare, where the daemon shares no core's caches with "
                             "the work it watches (without it, all of them share every CPU)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the database and the load engine's truth log when a verdict disagrees "
                             "with the truth log (their folder is printed)")
    args = parser.parse_args()
    if args.cancel_every < 1:
        parser.error("--cancel-every must be 1 or more")
    if args.compare and args.compare_setting:
        parser.error("--compare and --compare-setting each make two daemons to compare: one of them")
    if args.memory_trace and (args.compare or args.compare_setting):
        parser.error("--memory-trace runs one daemon: leave out --compare and --compare-setting")
    if args.alarms is None:
        args.alarms = 0 if args.compare or args.compare_setting else 15
    if args.watch_inflight and args.alarms:
        parser.error("--watch-inflight counts every in-flight zombie as a misreading: add --alarms 0 (the alarms' "
                     "zombies may still run during the load)")
    daemon_cpus = None
    if args.daemon_cpu is not None:
        available = os.sched_getaffinity(0)
        if args.daemon_cpu not in available or len(available) < 2:
            parser.error(f"--daemon-cpu {args.daemon_cpu}: this process may run on CPUs {sorted(available)}; "
                         "name one of them, and leave at least one other for the engines and the load")
        daemon_cpus = {args.daemon_cpu}
        os.sched_setaffinity(0, available - daemon_cpus)  # the engines started below inherit it
    if os.geteuid() != 0 and args.source == "bpf":
        print("needs root (eBPF probe); --source procfs runs without it")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-detection-"))
    atexit.register(shutil.rmtree, work, True)  # a 15-minute run leaves 150 MiB of databases
    here = Path(__file__).resolve().parents[1]
    # Each daemon compared: its label -> the code it runs and its configuration file.
    configured = config_file(args.setting, work / "auditor.toml")
    trees = {"working tree": (here, configured)}
    if args.compare:
        from bench.ingest import export_tree

        old = export_tree(args.compare, work / "old")
        trees = {args.compare: (old, configured), "working tree": (here, configured)}
    elif args.compare_setting:
        print(f"as configured: {settings_label(args.setting)}; "
              f"with settings: {settings_label(args.setting + args.compare_setting)}")
        trees = {"as configured": (here, configured),
                 "with settings": (here, config_file(args.setting + args.compare_setting, work / "compared.toml"))}
    otlp, metrics_port, live = free_port(), free_port(), free_port(socket.SOCK_DGRAM)
    export = f"{args.otlp}://127.0.0.1:{otlp}"
    with running_engine(behavior="detached", otlp=export, step_ms=10, max_batch=16,
                        extra_args=(["--live", f"127.0.0.1:{live}"] if args.alarms_by == "live" else [])
                        + (["--engine-span", "none", "--metrics-names", "vllm"] if args.alarms_by == "port" else [])
                        + ["--device", "cpu" if args.load_engine_alone else args.device],
                        env=load_engine_env(PORT_EXPORT_DELAY_MS) if args.alarms_by == "port" else None) as zombie_engine, \
            running_engine(behavior=args.load_behavior, otlp=export, step_ms=2, max_batch=64,
                           extra_args=["--device", args.device] + (["--live", f"127.0.0.1:{live}"] if args.live_load else [])
                           + (["--engine-span", "none", "--metrics-names", "vllm"] if args.weak_load else []),
                           truth_log=None if args.compare or args.compare_setting else work / "load-truth.jsonl",
                           env=load_engine_env(args.export_delay_ms)) as busy_engine:
        ports = [zombie_engine.port, busy_engine.port]
        if len(trees) == 1:
            db = work / "auditor.db"
            probe = work / "memprobe.jsonl" if args.memory_probe else None
            trace = work / "memtrace.jsonl" if args.memory_trace else None
            with running_daemon(here, db, ports, otlp, metrics_port, live, args.otlp, args.source, probe,
                                trace, configured, daemon_cpus) as daemon:
                latencies = measure_alarms(db, zombie_engine.port, metrics_port, args.alarms)
                load = measure_load(daemon, db, busy_engine.port, args, metrics_port)
                judged = judge_settled(db, busy_engine, args, load["client_left"])
            print_latencies(latencies, args.alarms, args.alarms_by)
            print_load(load, args)
            print_judged(judged)
            if probe is not None:
                print_memory({"working tree": probe})
            if trace is not None:
                print_memory_trace(trace, here)
            if args.keep and (judged["wrong"] or judged["false"] or judged["missed"]):
                atexit.unregister(shutil.rmtree)
                print(f"  kept: {work}")
            return 0
        results: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
        alarms: dict[str, dict[str, list[float]]] = {label: {} for label in trees}
        probes: dict[str, Path] = {}
        for round_no in range(1, args.rounds + 1):
            for index, (label, (tree, config)) in enumerate(trees.items()):
                db = work / f"auditor-{round_no}-{index}.db"
                probe = work / f"memprobe-{round_no}-{index}.jsonl" if args.memory_probe else None
                if probe is not None:
                    probes.setdefault(label, probe)  # the first round's
                with running_daemon(tree, db, ports, otlp, metrics_port, live, args.otlp, args.source, probe,
                                    config=config, cpus=daemon_cpus) as daemon:
                    time.sleep(2)  # past start-up
                    for name, values in measure_alarms(db, zombie_engine.port, metrics_port, args.alarms).items():
                        alarms[label].setdefault(name, []).extend(values)
                    results[label].append(measure_load(daemon, db, busy_engine.port, args, metrics_port))
                print(f"round {round_no} {label:<14} {results[label][-1]['cpu_percent']:.2f} % of one core, "
                      f"{results[label][-1]['rss']:.1f} MiB", flush=True)
    print_comparison(results, args)
    if probes:
        print_memory(probes)
    if args.alarms:
        print_alarm_comparison(alarms, args.alarms * args.rounds, args.alarms_by)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
