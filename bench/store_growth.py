"""What storing the daemon's records costs as the store's tables grow: CPU per second of load for
each two simulated minutes, side by side with a git revision's store.

The daemon's load at 100 requests/s: about 190 spans a second (random trace ids, as exporters make
them) in five commits, and 300 kernel events a second in four. An index keyed on something random
takes each insert on a page of its own once its table outgrows a commit, and every such page is
written to the WAL and copied back at a checkpoint: that cost grows with the table, which a
short run never shows. Simulated time, so ten minutes take a minute or two; CPU is the storing
thread's own.

Usage: .venv/bin/python bench/store_growth.py [--minutes 10] [--compare REV]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPANS_PER_EXPORT, EXPORTS_PER_S, EVENTS_PER_COMMIT, EVENT_COMMITS_PER_S = 38, 5, 75, 4


def run(minutes: int) -> list[float]:
    """CPU of storing one second of load, in ms, averaged over each two simulated minutes."""
    from ingest import Bodies, body_normalizer  # after the tree's ``auditor`` is imported

    from auditor.model import ConnEvent, ConnEventKind
    from auditor.store import Store

    normalize, bodies, rng = body_normalizer(), Bodies(SPANS_PER_EXPORT, seed=5, ordered_ids=False), random.Random(1)
    per_slice: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/growth.db")
        ts, spent = time.time_ns(), 0.0
        for second in range(minutes * 60):
            exports = [normalize(bodies.next()).spans for _ in range(EXPORTS_PER_S)]
            commits = []
            for _ in range(EVENT_COMMITS_PER_S):
                events = []
                for n in range(EVENTS_PER_COMMIT):
                    ts += 1_000_000_000 // (EVENTS_PER_COMMIT * EVENT_COMMITS_PER_S)
                    events.append(ConnEvent(ts, ConnEventKind.PEER_FIN if n % 2 else ConnEventKind.CLOSED, 4,
                                            "127.0.0.1", rng.randrange(32768, 61000), "127.0.0.1", 8000,
                                            rng.getrandbits(48), "h"))
                commits.append(events)
            started = time.thread_time()
            for spans in exports:
                store.write(spans)
            for events in commits:
                store.write(events)
            spent += time.thread_time() - started
            if (second + 1) % 120 == 0:
                per_slice.append(spent / 120 * 1000)
                spent = 0.0
        store.close()
    return per_slice


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=10, help="simulated minutes (an even number)")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's store, alternately")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # the tree whose auditor to import
    args = parser.parse_args()
    if args.minutes < 2 or args.minutes % 2:
        parser.error("--minutes must be an even number, at least 2")
    if args.tree:
        sys.path.insert(0, str(args.tree))
        import auditor  # noqa: F401  # this tree's, before the bench helpers put the working tree first
    sys.path.insert(1, str(HERE.parent))
    sys.path.insert(1, str(HERE))
    if args.json:
        print(json.dumps(run(args.minutes)))
        return 0
    trees = {"working tree": HERE.parent}
    work = None
    if args.compare:
        from ingest import export_tree

        work = tempfile.TemporaryDirectory(prefix="store-growth-")
        trees = {args.compare: export_tree(args.compare, Path(work.name)), "working tree": HERE.parent}
    results = {}
    for label, tree in trees.items():
        out = subprocess.run([sys.executable, __file__, "--tree", str(tree), "--minutes", str(args.minutes), "--json"],
                             check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""))
        results[label] = json.loads(out.stdout)
    print("CPU of storing one second of load (190 spans, 300 kernel events), ms, per two simulated minutes")
    print(f"  {'minutes':<10}" + "".join(f"{label:>16}" for label in trees))
    for index in range(args.minutes // 2):
        print(f"  {f'{2 * index}-{2 * index + 2}':<10}" + "".join(f"{runs[index]:>16.2f}" for runs in results.values()))
    if work is not None:
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
