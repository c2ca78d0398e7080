"""Whether a correlation round costs more the longer the daemon runs: round CPU per simulated minute
over the 15-minute horizon, the requests of bench/correlate_memory.py at 100 a second.

A round's work should follow the request rate, not how long the daemon has been up: what is
kept for the horizon (settled requests' trace ids, registered disconnects, the run index) grows
for 15 minutes, and a pass that walks all of it makes every round dearer until then. What the
store keeps grows for longer: retention keeps raw rows 6 hours, and a read that walks them makes
every round dearer for that long. The sampler's readings are stored each second too, and
``--kept-hours`` puts that many hours of them in the store before the first round. Simulated
time, so the 15 minutes take about a minute; CPU is the round's own thread time.

With ``--compare REV`` the same requests go through git revision REV's correlator too, each tree
in its own process, alternately (``--rounds``), and the medians are printed side by side.

Usage: .venv/bin/python bench/correlate_growth.py [--minutes 15] [--kept-hours 6] [--compare REV --rounds 2] [--json]
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
# The sampler's readings: four engine processes' CPU at 10 Hz (a GPU host adds each GPU and each
# process on it).
SAMPLED_PIDS = 4
SAMPLES_PER_S = 40


def run(minutes: int, kept_hours: float = 0.0) -> list[float]:
    """Round CPU, in ms per simulated second, for each simulated minute. Each simulated second
    also stores the sampler's readings (SAMPLES_PER_S); ``kept_hours`` of them are in the store
    before the first round, as retention keeps them (6 hours by default)."""
    from correlate_memory import arrive  # after the tree's ``auditor`` is imported

    from auditor.correlate import Correlator
    from auditor.model import UtilSample
    from auditor.store import Store

    def readings(first_ns: int, count: int) -> list[UtilSample]:
        return [UtilSample(ts_ns=first_ns + i * S // SAMPLES_PER_S, source="procfs", pid=1000 + i % SAMPLED_PIDS,
                           util_percent=50.0, interval_s=SAMPLED_PIDS / SAMPLES_PER_S) for i in range(count)]

    requests = minutes * 6000
    per_minute: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/growth.db")
        t0 = time.time_ns() - (requests // 100 + 10) * S
        clock = [t0]
        kept = int(kept_hours * 3600 * SAMPLES_PER_S)
        for first in range(0, kept, 100_000):
            store.insert_samples(readings(t0 - (kept - first) * S // SAMPLES_PER_S, min(100_000, kept - first)))
        correlator = Correlator(store, host="", late_span_seconds=60, clock=lambda: clock[0])
        gc.freeze()  # as `auditor run` does, start-up objects out of the collector's way
        gc.set_threshold(20_000, 10, 10)
        spent = 0.0
        for first in range(0, requests, 100):
            clock[0] = arrive(store, t0, first, requests)
            store.insert_samples(readings(clock[0] - S, SAMPLES_PER_S))
            started = time.thread_time()
            correlator.tick()
            spent += time.thread_time() - started
            if (first + 100) % 6000 == 0:
                per_minute.append(spent / 60 * 1000)
                spent = 0.0
        store.close()
    return per_minute


def child(tree: Path, minutes: int, kept_hours: float) -> list[float]:
    result = subprocess.run([sys.executable, __file__, "--tree", str(tree), "--minutes", str(minutes),
                             "--kept-hours", str(kept_hours), "--json"], check=True, capture_output=True, text=True)
    return list(json.loads(result.stdout))


def summary(per_minute: list[float]) -> dict[str, float]:
    """Early (minutes 2-3, the late-span window full) against late (the last two minutes)."""
    early, late = statistics.median(per_minute[1:3]), statistics.median(per_minute[-2:])
    return {"early": early, "late": late, "growth": late / early if early else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=15, help="simulated minutes (the horizon is 15)")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's correlator, alternately")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree with --compare")
    parser.add_argument("--kept-hours", type=float, default=0.0,
                        help="hours of utilization samples in the store before the first round (retention keeps 6)")
    parser.add_argument("--json", action="store_true", help="print the per-minute figures as JSON")
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # the tree whose auditor to import
    args = parser.parse_args()
    if args.minutes < 4:
        parser.error("--minutes must be at least 4")
    use_tree(args.tree)
    if args.json:
        print(json.dumps(run(args.minutes, args.kept_hours)))
        return 0
    trees, work = compared(args.compare, "correlate-growth-")
    results: dict[str, list[list[float]]] = {label: [] for label in trees}
    for round_no in range(1, (args.rounds if args.compare else 1) + 1):
        for label, tree in trees.items():
            results[label].append(child(tree, args.minutes, args.kept_hours))
            print(f"round {round_no} {label:<14} " + " ".join(f"{x:.1f}" for x in results[label][-1]), flush=True)
    print(f"\nround CPU, ms per simulated second, 100 requests/s and {SAMPLES_PER_S} samples/s, "
          f"{args.kept_hours:g} h of samples kept before (medians of {len(results[label])} runs)")
    print(f"  {'':<32}" + "".join(f"{label:>16}" for label in trees))
    for key, title in (("early", "minutes 2-3 (window full)"), ("late", f"minutes {args.minutes - 1}-{args.minutes}"),
                       ("growth", "late / early")):
        print(f"  {title:<32}" + "".join(f"{statistics.median(summary(run)[key] for run in runs):>16.2f}"
                                          for runs in results.values()))
    if work is not None:
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
