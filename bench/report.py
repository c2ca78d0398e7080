"""How long ``auditor report --format json`` takes over an hour of one million requests.

Generates a SQLite store through SQLAlchemy Core (executemany in batches): 1,000,000 HTTP server
spans over one hour on two hosts (each naming its client's User-Agent, one of 100, and its address,
one of 500), 10% of them with a client disconnect (verdict rows in a realistic mix of completed,
aborted, zombie and in-flight zombie; one in 25 at a client's 30 s timeout), whole-GPU NVML
samples every 100 ms for 4 GPUs per host, coverage counts, and stretches of orphaned work (four
engine ports a host, one every 20 s on each). Then it times, in the same run and
over the same rows, a plain ``SELECT count(*)`` (the floor), the library call (and the same with
every query on one connection, none read beside the rest), and the CLI in a fresh process, and
prints a table: wall and CPU seconds apart, since the report reads on two connections at once.

    .venv/bin/python bench/report.py [--requests N] [--db PATH] [--repeat 3] [--hours-held 6]

With ``--hours-held``, the store holds that many hours like the reported one before it, and a
table after the others gives the request count and the GPU time of the hour's last 5 to 60 minutes
read through the indexes time leads and by plain scans.

Target: the JSON report in <= 2 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import insert, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from auditor.report import ReportQuery, build_report  # noqa: E402
from auditor.report import query as report_query  # noqa: E402
from auditor.report.model import Totals  # noqa: E402
from auditor.report.query import age_bins, caller_breakdowns, orphaned_work, with_callers  # noqa: E402
from auditor.report.render_data import write_json  # noqa: E402
from auditor.report.requests import count_requests, spans  # noqa: E402
from auditor.report.timeouts import find_timeouts  # noqa: E402
from auditor.store import (  # noqa: E402
    CoverageRow,
    SpanRow,
    Store,
    UtilSampleRow,
    VerdictRow,
    tables,
)
from auditor.timefmt import rfc3339  # noqa: E402

S = 1_000_000_000
HOUR = 3600 * S
BATCH = 20_000
HOSTS = ("gpu-a", "gpu-b")
CALLERS = 500  # the client addresses the verdicts come from (services calling the engine, its proxies)
# Their User-Agents: SDKs of a few versions and browsers of many.
AGENTS = tuple([f"OpenAI/Python 1.{v}.0" for v in range(40, 60)] + [f"AsyncOpenAI/Python 1.{v}.0" for v in range(40, 60)]
               + [f"Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/{v}.0.0.0 Safari/537.36"
                  for v in range(100, 160)])
ROUTES = (("/v1/chat/completions", 0.7), ("/v1/completions", 0.3))
MODELS = (("llama-3-70b", 0.5), ("llama-3-8b", 0.3), ("qwen-2-72b", 0.2))
VERDICT_MIX = (("completed", 0.30), ("aborted", 0.48), ("zombie", 0.20), ("inflight_zombie", 0.02))
# One disconnect in 25 is a client's 30 s timeout; the others come at any age up to 20 s.
TIMED_OUT, TIMEOUT_S = 0.04, 30.0
PHASES = (("queued", 0.15), ("prefill", 0.25), ("decode", 0.55), ("unknown", 0.05))


def pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    return rng.choices([v for v, _ in weighted], [w for _, w in weighted])[0]


def batched(rows: Iterator[dict[str, Any]], size: int = BATCH) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def caller_address(n: int) -> str:
    """Request ``n``'s client address, one of CALLERS (its span's peer and its verdict's client)."""
    return f"10.1.{n % CALLERS // 250}.{n % CALLERS % 250 + 1}"


def span_rows(count: int, t0: int, rng: random.Random, remote_parents: bool = False) -> Iterator[dict[str, Any]]:
    for n in range(count):
        start = t0 + n * HOUR // count
        route, model = pick(rng, ROUTES), pick(rng, MODELS)
        yield {
            "trace_id": f"{rng.getrandbits(128):032x}", "span_id": f"{rng.getrandbits(64):016x}",
            "parent_span_id": f"{rng.getrandbits(64):016x}" if remote_parents else None, "name": f"POST {route}", "kind": "server", "role": "http_server",
            "start_ns": start, "end_ns": start + int(rng.lognormvariate(1.0, 0.8) * S),
            "service": "vllm", "host": HOSTS[n % 2], "status": "unset", "peer_addr": caller_address(n),
            "peer_port": 1024 + n % 60000, "server_port": 8000, "request_id": f"req-{n:08d}",
            "route": route, "model": model, "http_status": 200, "finish_reason": "stop",
            "prompt_tokens": 500, "completion_tokens": 200, "max_tokens": 1024,
            "time_in_queue_s": 0.05, "time_to_first_token_s": 0.2, "process_pid": 4242,
            "peer_rewritten": False, "attributes": {"user_agent.original": AGENTS[n % len(AGENTS)]},
        }


def verdict_rows(count: int, t0: int, rng: random.Random, first: int = 0) -> Iterator[dict[str, Any]]:
    for n in range(first, first + count):
        verdict = pick(rng, VERDICT_MIX)
        start = t0 + rng.randrange(HOUR - 60 * S)
        if rng.random() < TIMED_OUT:  # a client's timeout: its disconnects at one age
            disconnect = start + int(rng.gauss(TIMEOUT_S, 0.004) * S)
        else:
            disconnect = start + int(rng.uniform(0.05, 20) * S)
        if verdict == "completed":
            lag = 0.0
        elif verdict == "aborted":
            lag = rng.uniform(0.0, 0.5)
        else:
            lag = rng.expovariate(1 / 15) + 0.5
        tokens = int(lag * 40)
        yield {
            "request_key": f"{HOSTS[n % 2]}/{n:032x}/{n:016x}", "host": HOSTS[n % 2],
            "verdict": verdict, "disconnect_at_ns": disconnect, "disconnect_kind":
            "rst" if rng.random() < 0.2 else "fin", "request_start_ns": start,
            "work_end_ns": None if verdict == "inflight_zombie" else disconnect + int(lag * S),
            "lag_seconds": lag, "phase": pick(rng, PHASES), "trace_id": f"{n:032x}",
            "request_id": f"req-{n:08d}", "service": "vllm", "route": pick(rng, ROUTES),
            "model": pick(rng, MODELS), "client_addr": caller_address(n),
            "client_port": 1024 + n % 60000, "user_agent": AGENTS[n % len(AGENTS)],
            "server_port": 8000, "max_tokens": None if rng.random() < 0.2 else 1024,
            "tokens_after_disconnect": tokens, "tokens_exact": rng.random() < 0.8,
            "wasted_gpu_seconds": lag * 0.12, "wasted_cpu_seconds": 0.0, "updated_ns": disconnect,
            "details": {},
        }


def sample_rows(t0: int, rng: random.Random) -> Iterator[dict[str, Any]]:
    for tick in range(0, HOUR, S // 10):
        for host in HOSTS:
            for gpu in range(4):
                yield {"ts_ns": t0 + tick, "source": "nvml", "host": host, "gpu_index": gpu,
                       "pid": None, "util_percent": rng.uniform(60, 100), "interval_s": 0.1}


def bulk_insert(store: Store, table: Any, rows: Iterator[dict[str, Any]]) -> None:
    """SQLite's fastest path: one prepared INSERT, executemany over plain tuples, one transaction.

    The column list comes from the table model, so the bench writes exactly the store's schema;
    JSON columns are written as their text, which is what the JSON type stores in SQLite.
    """
    columns = [c.name for c in table.columns if c.name != "id" and c.computed is None]  # the database computes those
    json_columns = {c.name for c in table.columns if c.type.__class__.__name__ == "JSON"}
    sql = (f"INSERT INTO {table.name} ({', '.join(columns)}) "
           f"VALUES ({', '.join('?' for _ in columns)})")
    with store.engine.begin() as conn:
        for batch in batched(rows):
            conn.exec_driver_sql(sql, [
                tuple(json.dumps(row[c]) if c in json_columns else row.get(c) for c in columns)
                for row in batch])


def generate(store: Store, requests: int, t0: int, remote_parents: bool = False, seed: int = 7) -> dict[str, float]:
    rng = random.Random(seed)
    seconds: dict[str, float] = {}
    for name, table, rows in (
        ("spans", SpanRow.__table__, span_rows(requests, t0, rng, remote_parents)),
        # The daemon writes a verdict when it is decided, shortly after the disconnect: in time order.
        ("verdicts", VerdictRow.__table__, iter(sorted(verdict_rows(requests // 10, t0, rng, (seed - 7) * requests),
                                                       key=lambda row: row["disconnect_at_ns"]))),
        ("util_samples", UtilSampleRow.__table__, sample_rows(t0, rng)),
    ):
        started = time.perf_counter()
        bulk_insert(store, table, rows)
        seconds[name] = time.perf_counter() - started
    with store.engine.begin() as conn:
        conn.execute(insert(CoverageRow.__table__), [
            {"ts_ns": t0 + i * 10 * S, "host": HOSTS[i % 2], "kind": kind, "count": 1 + i % 5}
            for i in range(360)
            for kind in ("idle_close", "unjoined_disconnect", "unjoined_span")])
    return seconds


def orphaned_rows(t0: int, rng: random.Random) -> Iterator[dict[str, Any]]:
    """Stretches of orphaned work: on each host, four engine ports each with one every 20 s."""
    for host in HOSTS:
        for port in (8000, 8001, 8002, 8003):
            for start in range(0, HOUR, 20 * S):
                length = rng.uniform(1, 15)
                yield {"host": host, "server_port": port, "start_ns": t0 + start + rng.randrange(S),
                       "end_ns": t0 + start + int(length * S), "last_seen_ns": t0 + start + int(length * S),
                       "peak": rng.randint(1, 4), "request_seconds": length * rng.uniform(1, 3),
                       "wasted_gpu_seconds": length * rng.uniform(0.1, 1), "wasted_cpu_seconds": 0.0,
                       "end_resolution_s": 0.25, "cut_short": False, "with_spans": port == 8000,
                       "model": None, "cost_unmeasured": None}


def ensure_orphaned(store: Store, t0: int) -> None:
    """The stretches of orphaned work, in a store of its own or one made before they were kept."""
    with store.engine.connect() as conn:
        if conn.execute(text("SELECT count(*) FROM orphaned_work")).scalar_one():
            return
    bulk_insert(store, tables.orphaned_work, orphaned_rows(t0, random.Random(11)))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(repeat: int, action: Callable[[], object]) -> tuple[float, float, object]:
    """Median wall seconds and median CPU seconds (this process plus its children) of ``action``.

    CPU time is printed beside wall time because the machine may be shared: it is the figure that
    does not grow when other work competes for the cores.
    """
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        cpu_before, children_before = time.process_time(), _children_cpu()
        started = time.perf_counter()
        result = action()
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu_before + _children_cpu() - children_before)
    return statistics.median(walls), statistics.median(cpus), result


def by_window(store: Store, hour: ReportQuery, repeat: int) -> None:
    """The request count and the GPU time of the reported hour's last 5, 15, 30 and 60 minutes, read
    through the indexes time leads and by plain scans (``INDEXED_SHARE``), side by side: CPU s."""
    print(f"\nby window, read through the time indexes against plain scans (CPU s, median of {repeat}):")
    print(f"{'minutes':>8} {'share':>6} {'count idx':>10} {'count scan':>11} {'GPU idx':>8} {'GPU scan':>9}")
    indexed_share = report_query.INDEXED_SHARE
    try:
        for minutes in (5, 15, 30, 60):
            window = dataclasses.replace(hour, since_ns=hour.until_ns - minutes * 60 * S)
            with store.engine.connect() as conn:
                share = report_query._held_share(conn, window)
                figures = []
                for read in (functools.partial(report_query._count, conn, window),
                             functools.partial(report_query._fill_gpu_time, conn, window, Totals())):
                    for forced in (2.0, 0.0):  # every window through the indexes, then none
                        report_query.INDEXED_SHARE = forced
                        figures.append(timed(repeat, read)[1])
            print(f"{minutes:>8} {share:>6.3f} {figures[0]:>10.3f} {figures[1]:>11.3f} {figures[2]:>8.3f} "
                  f"{figures[3]:>9.3f}")
    finally:
        report_query.INDEXED_SHARE = indexed_share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--db", type=Path, help="store to (re)use; default: a temporary file")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is shown")
    parser.add_argument("--hours-held", type=int, default=1,
                        help="hours the store holds, each like the reported one, which is the last: the "
                             "daemon keeps six (retention.raw_hours), and `report --since 1h` reads one")
    parser.add_argument("--remote-parents", action="store_true",
                        help="every server span a child of a span not stored (an instrumented client's), "
                             "so that each lookup of its parent finds nothing")
    args = parser.parse_args()

    workdir = tempfile.TemporaryDirectory(prefix="bench-report-")
    path = args.db or Path(workdir.name) / "bench.db"
    t0 = 1_795_320_000 * S  # 2026-11-22T04:00:00Z
    fresh = not path.exists()
    store = Store(f"sqlite:///{path}")
    if fresh:
        started = time.perf_counter()
        seconds = generate(store, args.requests, t0, args.remote_parents)
        for earlier in range(1, args.hours_held):
            generate(store, args.requests, t0 - earlier * HOUR, args.remote_parents, seed=7 + earlier)
        print(f"generated {path} in {time.perf_counter() - started:.1f} s "
              + ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items()))
    ensure_orphaned(store, t0)
    query = ReportQuery(since_ns=t0, until_ns=t0 + HOUR)
    with store.engine.connect() as conn:
        counts = {table: conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                  for table in ("spans", "verdicts", "util_samples", "orphaned_work")}

    def plain_count() -> object:
        with store.engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM spans")).scalar_one()

    def window_count() -> object:
        with store.engine.connect() as conn:
            return conn.execute(text(
                "SELECT count(*) FROM spans WHERE role = 'http_server' AND start_ns >= :a "
                "AND start_ns < :b"), {"a": query.since_ns, "b": query.until_ns}).scalar_one()

    def requests_count() -> object:
        with store.engine.connect() as conn:
            return count_requests(conn, [spans.c.role == "http_server", spans.c.start_ns >= query.since_ns,
                                         spans.c.start_ns < query.until_ns], None, query.since_ns, query.until_ns)

    def timeouts() -> object:
        with store.engine.connect() as conn:
            return find_timeouts(age_bins(conn, query))

    def callers() -> object:
        with store.engine.connect() as conn:
            return caller_breakdowns(conn, query)

    def orphaned() -> object:
        with store.engine.connect() as conn:
            return orphaned_work(conn, query)

    found = timeouts()

    def who_was_cut() -> object:
        with store.engine.connect() as conn:
            return with_callers(conn, query, found)  # type: ignore[arg-type]

    one_caller = dataclasses.replace(query, user_agent=AGENTS[0])

    def one_user_agent() -> object:
        return build_report(store, one_caller, with_requests=False).totals.requests

    quarter = dataclasses.replace(query, since_ns=query.until_ns - HOUR // 4)

    def library(fmt: str, in_sqlite: bool = True, concurrent: bool = True, scans: bool = False,
                window: ReportQuery = query) -> Callable[[], object]:
        def run() -> object:
            indexed_share = report_query.INDEXED_SHARE
            report_query.INDEXED_SHARE = 0.0 if scans else indexed_share  # 0: no window read by index
            try:
                report = build_report(store, window, with_requests=fmt == "json", with_series=fmt == "html",
                                      requests_as_json=in_sqlite, concurrent=concurrent)
            finally:
                report_query.INDEXED_SHARE = indexed_share
            if fmt == "json":
                out = io.StringIO()
                write_json(report, out)
                return len(out.getvalue())
            return report.totals.requests
        return run

    auditor = str(Path(sys.executable).with_name("auditor"))
    window = ["--since", rfc3339(query.since_ns), "--until", rfc3339(query.until_ns)]

    def cli(*extra: str) -> Callable[[], object]:
        return lambda: subprocess.run([auditor, *extra], check=True, stdout=subprocess.DEVNULL)

    rows: list[tuple[str, float, float, str]] = []
    for label, action, note in (
        ("SELECT count(*) FROM spans", plain_count, "floor: every row counted once"),
        ("count of requests in window", window_count, "the report's requests query alone"),
        ("requests, each counted once", requests_count, "count_requests: parents looked up"),
        ("client timeouts", timeouts, "ages grouped in SQL, their peaks found"),
        ("callers", callers, "client addresses and User-Agents: one grouped scan"),
        ("who the timeouts cut", who_was_cut, "their disconnects' User-Agents and addresses"),
        ("orphaned work by port", orphaned, "stretches grouped by host and port"),
        ("library: build + JSON", library("json"), "build_report + write_json to memory"),
        ("library: ... on one connection", library("json", concurrent=False),
         "the same, nothing read beside the rest (concurrent=False)"),
        ("library: ... encoded in Python", library("json", in_sqlite=False),
         "the same without SQLite's json_object"),
        ("library: build (table)", library("table"), "no per-request list"),
        ("library: ... on one connection", library("table", concurrent=False), "the same, concurrent=False"),
        ("library: last 15 min (table)", library("table", window=quarter),
         "the hour's last quarter: read through the indexes time leads where the store holds 6 h"),
        ("library: ... by plain scans", library("table", scans=True, window=quarter),
         "the same, no window read through them (INDEXED_SHARE 0)"),
        ("library: build (html)", library("html"), "with series and zombie timelines"),
        ("library: ... on one connection", library("html", concurrent=False), "the same, concurrent=False"),
        ("library: one User-Agent (table)", one_user_agent, "--user-agent: spans' attributes read"),
        ("CLI: auditor --version", cli("--version"), "process start + imports only"),
        ("CLI: report --format json", cli("report", "--db", f"sqlite:///{path}", *window,
                                          "--format", "json"), "fresh process, stdout discarded"),
        ("CLI: report (table)", cli("report", "--db", f"sqlite:///{path}", *window),
         "fresh process"),
    ):
        wall, cpu, result = timed(args.repeat, action)
        if label == "library: build + JSON":
            note += f" ({int(result) / 1e6:.1f} MB)"  # type: ignore[call-overload]
        if label == "client timeouts":
            found = result if isinstance(result, list) else []
            note += ": " + (", ".join(f"{t.disconnects:,} at {t.after_seconds:g} s" for t in found) or "none")
        rows.append((label, wall, cpu, note))

    print(f"\nrows: spans {counts['spans']:,}, verdicts {counts['verdicts']:,}, "
          f"util_samples {counts['util_samples']:,}, orphaned_work {counts['orphaned_work']:,}; median of {args.repeat} runs; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    floor = rows[0][1]
    print(f"{'what':<31} {'wall s':>7} {'CPU s':>7} {'x count(*)':>10}  note")
    for label, wall, cpu, note in rows:
        print(f"{label:<31} {wall:>7.3f} {cpu:>7.3f} {wall / floor:>10.1f}  {note}")
    if args.hours_held > 1:
        by_window(store, query, args.repeat)
    json_cli = next(row for row in rows if row[0] == "CLI: report --format json")
    json_lib = next(row for row in rows if row[0] == "library: build + JSON")
    print(f"\ntarget: report --format json <= 2 s: {'met' if json_cli[1] <= 2 else 'NOT met'} "
          f"({json_cli[1]:.2f} s wall / {json_cli[2]:.2f} s CPU in the CLI, "
          f"{json_lib[1]:.2f} s in the library)")
    store.close()
    workdir.cleanup()


if __name__ == "__main__":
    main()
