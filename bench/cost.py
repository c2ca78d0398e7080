"""What costing zombies costs the daemon: the previous way and the current one, side by side.

The previous way (read from git, ``--before REV``) walked every trace that arrived since the
zombie's window began, for every verdict, and ran one SQL query of the samples per verdict. The
current one reads new samples once per round and looks up who was running in a time-bucketed index.
Both run here on the same correlator state: ``--held`` requests at 100 req/s with their engine
spans, procfs samples every 100 ms, and ``--zombies`` verdicts costed, each over a 4 s window that
began ``--age`` seconds ago (a zombie still running is costed again every round, its window growing).

Usage: .venv/bin/python bench/cost.py [--held 10000 90000] [--zombies 200] [--age 30] [--before b865429]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from auditor.correlate import Correlator  # noqa: E402
from auditor.correlate.evaluate import _waste  # noqa: E402
from auditor.correlate.requests import OpenRequest  # noqa: E402
from auditor.model import SpanRecord, SpanRole, UtilSample  # noqa: E402
from auditor.store import Store  # noqa: E402

S = 1_000_000_000
PID = 4242


def previous_waste(rev: str) -> types.ModuleType:
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:auditor/correlate/waste.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("previous_waste")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:auditor/correlate/waste.py", "exec"), module.__dict__)
    return module


def spans_for(index: int, t0: int) -> list[SpanRecord]:
    start = t0 + index * S // 100
    end = start + S // 2
    common = {"trace_id": f"{index:032x}", "parent_span_id": None, "start_ns": start, "end_ns": end,
              "service": "engine", "kind": "server", "process_pid": PID}
    return [SpanRecord(span_id=f"{index:015x}1", name="POST /v1/completions", role=SpanRole.HTTP_SERVER,
                       peer_addr="127.0.0.1", peer_port=10000 + index % 50000, server_port=8000, **common),
            SpanRecord(span_id=f"{index:015x}2", name="llm_request", role=SpanRole.ENGINE, request_id=f"cmpl-{index}",
                       finish_reason="length", completion_tokens=100, time_in_queue_s=0.01, **common)]


def setup(tmp: str, held: int) -> tuple[Correlator, Store, int]:
    store = Store(f"sqlite:///{tmp}/a.db")
    now = time.time_ns()
    t0 = now - held * S // 100
    clock = [now]
    correlator = Correlator(store, host="", clock=lambda: clock[0])
    for index in range(held):
        for span in spans_for(index, t0):
            correlator.spans.add(span, span.end_ns)
    samples = [UtilSample(ts_ns=t0 + k * S // 10, source="procfs", host="", gpu_index=None, pid=PID,
                          util_percent=80.0, interval_s=0.1) for k in range(held // 10 + 10)]
    for first in range(0, len(samples), 5000):
        store.insert_samples(samples[first:first + 5000])
    return correlator, store, now


def time_both(correlator: Correlator, store: Store, now: int, zombies: int, age_s: float,
              previous: types.ModuleType) -> tuple[float, float, float, float]:
    start, end = now - int(age_s * S), now - int((age_s - 4) * S)
    engine = spans_for(0, start)[1]
    origin = types.SimpleNamespace(ts_ns=start, tuple4=("127.0.0.1", 10000, 8000))  # the client's close
    started = time.perf_counter()
    for _ in range(zombies):
        sharers = previous.requests_in_flight(correlator.spans.arrived_since(start), [], service="engine",
                                              start_ns=start, end_ns=end, now_ns=now)
        before = previous.wasted(store, host="", start_ns=start, end_ns=end, pid=PID, inflight_at=sharers)
    before_s = time.perf_counter() - started
    correlator.cost.samples.refresh(now)  # the daemon's cache is loaded once, then read incrementally
    started = time.perf_counter()
    for _ in range(zombies):
        after = _waste(correlator, OpenRequest(("0" * 32, "1" * 16)), origin, None, end, engine, None, {})
    after_s = time.perf_counter() - started
    return before_s, after_s, before.cpu_seconds, after[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", default=[10000, 90000])
    parser.add_argument("--zombies", type=int, default=200)
    parser.add_argument("--age", type=float, default=30.0)
    parser.add_argument("--before", default="b865429", help="the revision whose waste.py is the previous way")
    args = parser.parse_args()
    previous = previous_waste(args.before)
    print(f"{'requests held':>14}{'before ms/verdict':>19}{'after ms/verdict':>18}{'speed-up':>10}"
          f"{'before CPU-s':>14}{'after CPU-s':>13}")
    for held in args.held:
        with tempfile.TemporaryDirectory() as tmp:
            correlator, store, now = setup(tmp, held)
            before_s, after_s, before_cost, after_cost = time_both(correlator, store, now, args.zombies, args.age,
                                                                   previous)
            store.close()
        print(f"{held:>14,}{before_s / args.zombies * 1e3:>19.3f}{after_s / args.zombies * 1e3:>18.3f}"
              f"{before_s / after_s:>9.0f}x{before_cost:>14.3f}{after_cost:>13.3f}")
    print(f"{args.zombies} verdicts, each a 4 s window that began {args.age:.0f} s ago; 100 req/s, "
          "each running 0.5 s (so about 50 share the engine at a time); procfs samples every 100 ms at 80 %")


if __name__ == "__main__":
    main()
