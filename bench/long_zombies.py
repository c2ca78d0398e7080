"""Whether a correlation round costs more the longer its zombies run: round CPU per simulated minute
while N requests run on after their clients left, beside 100 requests a second.

A zombie still running is judged every round (its lag and cost grow), and its cost is the engine's
utilization integrated over its window, shared by what else ran. Integrated whole every round, the
window grows a second a round and so does the round's cost; a zombie storm (the case the auditor is
for) then costs the daemon most when it matters. Each zombie here is known by its live start notice
(no span until it ends), or with ``--known-by gauges`` as vLLM's are: its server span ended as its
client left, no engine span, and the engine's running gauge (scraped at 4 Hz) holding it. The
requests around it are bench/correlate_memory.py's (spans and closes, the same engine and port);
the engine process is sampled at 10 Hz at 100 %. Simulated time; CPU is the round's own thread time.

With ``--compare REV`` the same run goes through git revision REV's correlator too, each tree in
its own process, alternately (``--rounds``), and the figures are printed side by side.

Usage: .venv/bin/python bench/long_zombies.py [--zombies 5] [--minutes 10] [--compare REV --rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trees import compared, use_tree

HERE = Path(__file__).resolve().parent
S = 1_000_000_000
PID, PORT = 4242, 8000  # bench/correlate_memory.py's engine


def run(zombies: int, minutes: int, known_by: str = "live") -> dict[str, list[float]]:
    """Round CPU and the judge step's, ms a round, for each simulated minute; and the zombies' cost."""
    from correlate_memory import arrive  # after the tree's ``auditor`` is imported

    from auditor.correlate import Correlator
    from auditor.model import (
        ConnEvent,
        ConnEventKind,
        EngineLoad,
        LiveEvent,
        SpanRecord,
        SpanRole,
        UtilSample,
    )
    from auditor.store import Store

    seconds = minutes * 60
    per_minute: list[float] = []
    judge_per_minute: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/zombies.db")
        t0 = time.time_ns() - (seconds + 10) * S
        clock = [t0]
        correlator = Correlator(store, host="", late_span_seconds=60, clock=lambda: clock[0])
        correlator.cost.set_listeners({PORT: PID}, {})
        gc.freeze()  # as `auditor run` does
        gc.set_threshold(20_000, 10, 10)
        starts = [LiveEvent("start", f"{0xF << 124 | i:032x}", f"{0xF << 60 | i:016x}", "POST /v1/completions",
                            "server", t0, "127.0.0.1", 9000 + i, PORT, PID, "engine", False) for i in range(zombies)]
        leave = [ConnEvent(ts_ns=t0 + S // 2, kind=ConnEventKind.PEER_FIN, family=4, client_addr="127.0.0.1",
                           client_port=9000 + i, server_addr="127.0.0.1", server_port=PORT, host="")
                 for i in range(zombies)]
        store.insert_conn_events(leave)
        gauges = known_by == "gauges"
        if gauges:  # each zombie's server span, ended as its client left
            store.insert_spans([SpanRecord(
                trace_id=event.trace_id, span_id=event.span_id, parent_span_id=None, name=event.name, kind="server",
                start_ns=t0, end_ns=t0 + S // 2, service="engine", role=SpanRole.HTTP_SERVER, peer_addr="127.0.0.1",
                peer_port=event.peer_port, server_port=PORT, route="/v1/completions", http_status=200)
                for event in starts])
        spent = judged = 0.0
        has_steps = hasattr(correlator, "cpu")
        for second in range(seconds):
            clock[0] = arrive(store, t0, second * 100, seconds * 100)
            store.insert_samples([UtilSample(ts_ns=t0 + second * S + k * S // 10, source="procfs", host="", pid=PID,
                                             util_percent=100.0, interval_s=0.1) for k in range(1, 11)])
            judge_before = correlator.cpu.ns["judge"] if has_steps else 0
            started = time.thread_time()
            if gauges:  # what the engine runs at each scrape: the zombies, and the requests of that moment
                correlator.add_engine_load([EngineLoad(ts_ns=at, server_port=PORT, running=zombies + running_at(at, t0))
                                            for at in (t0 + second * S + k * S // 4 + S // 200 for k in range(4))])
            correlator.tick(starts if second == 0 and not gauges else None)
            spent += time.thread_time() - started
            judged += (correlator.cpu.ns["judge"] - judge_before) / 1e9 if has_steps else 0.0
            if (second + 1) % 60 == 0:
                per_minute.append(spent / 60 * 1000)
                judge_per_minute.append(judged / 60 * 1000)
                spent = judged = 0.0
        with store.connect() as conn:
            costs = [float(c) for (c,) in conn.all(
                "SELECT wasted_cpu_seconds FROM verdicts WHERE verdict = 'inflight_zombie' ORDER BY request_key")]
        store.close()
    return {"round": per_minute, "judge": judge_per_minute, "costs": costs}


def running_at(ts_ns: int, t0: int) -> int:
    """bench/correlate.spans_for's requests running at ``ts_ns``: one starts every 10 ms, for 0.5 s."""
    return sum(1 for index in range((ts_ns - t0 - S // 2) * 100 // S, (ts_ns - t0) * 100 // S + 2)
               if index >= 0 and t0 + index * S // 100 <= ts_ns <= t0 + index * S // 100 + S // 2)


def child(tree: Path, zombies: int, minutes: int, known_by: str) -> dict[str, list[float]]:
    result = subprocess.run([sys.executable, __file__, "--tree", str(tree), "--zombies", str(zombies),
                             "--minutes", str(minutes), "--known-by", known_by, "--json"],
                            check=True, capture_output=True, text=True)
    return dict(json.loads(result.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zombies", type=int, default=5, help="requests running on after their clients left")
    parser.add_argument("--minutes", type=int, default=10, help="simulated minutes (the horizon is 15)")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's correlator, alternately")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree with --compare")
    parser.add_argument("--known-by", choices=("live", "gauges"), default="live",
                        help="how the zombies are known to run on: live start notices, or the engine's gauges")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # the tree whose auditor to import
    args = parser.parse_args()
    if args.minutes < 2 or args.zombies < 1:
        parser.error("--minutes must be at least 2 and --zombies at least 1")
    use_tree(args.tree)
    if args.json:
        print(json.dumps(run(args.zombies, args.minutes, args.known_by)))
        return 0
    trees, work = compared(args.compare, "long-zombies-")
    results: dict[str, list[dict[str, list[float]]]] = {label: [] for label in trees}
    for round_no in range(1, (args.rounds if args.compare else 1) + 1):
        for label, tree in trees.items():
            results[label].append(child(tree, args.zombies, args.minutes, args.known_by))
            print(f"round {round_no} {label:<14} ms a round by minute: "
                  + " ".join(f"{x:.1f}" for x in results[label][-1]["round"]), flush=True)
    print(f"\n{args.zombies} zombies known by {args.known_by} running on for {args.minutes} simulated minutes beside 100 requests/s, "
          f"ms of correlator CPU a round (medians of {len(results[label])} runs)")
    print(f"  {'':<28}" + "".join(f"{label:>16}" for label in trees))
    minutes = sorted({0, args.minutes // 2 - 1, args.minutes - 1})
    rows = [(f"{key}, minute {m + 1}", key, m) for key in ("round", "judge") for m in minutes]
    for title, key, minute in rows:
        print(f"  {title:<28}" + "".join(f"{statistics.median(r[key][minute] for r in runs):>16.2f}"
                                          for runs in results.values()))
    print(f"  {'a zombie charged, CPU-s':<28}" + "".join(
        f"{statistics.median(statistics.mean(r['costs']) if r['costs'] else 0.0 for r in runs):>16.2f}"
        for runs in results.values()))
    if work is not None:
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
