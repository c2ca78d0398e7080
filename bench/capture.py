"""How long a capture takes to export, read back and plan for replay, beside a plain count.

Generates the store of bench/report (HTTP server spans over one hour on two hosts, 10% with a
client disconnect) at a smaller default size, then times in one run: ``SELECT count(*)`` over the
spans (the floor), ``export_capture`` of the whole hour into a new file, ``read_capture`` of it,
and ``plan_replay`` with a 30% cancel rate. No target; the figures say how long a gate waits.

    .venv/bin/python bench/capture.py [--requests 360000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import generate

from auditor.store import Store
from replay.capture import export_capture, open_capture_store, read_capture
from replay.run import ReplayOptions, plan_replay

S = 1_000_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=360_000, help="requests in the hour (100 req/s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="capture-bench-") as scratch:
        workdir = Path(scratch)
        store = Store(f"sqlite:///{workdir / 'store.db'}")
        t0 = time.time_ns() - 3600 * S
        generate(store, args.requests, t0)
        rows = []
        started = time.perf_counter()
        with store.engine.connect() as conn:
            count = conn.exec_driver_sql("SELECT count(*) FROM spans").scalar_one()
        rows.append(("SELECT count(*) FROM spans", time.perf_counter() - started, f"{count:,} rows"))
        started = time.perf_counter()
        _capture_id, exported = export_capture(store, workdir / "capture.db", since_ns=t0, until_ns=t0 + 3600 * S)
        rows.append(("export_capture (one hour)", time.perf_counter() - started, f"{exported:,} requests"))
        started = time.perf_counter()
        capture = read_capture(open_capture_store(workdir / "capture.db"))
        rows.append(("read_capture", time.perf_counter() - started, f"{len(capture.requests):,} requests"))
        started = time.perf_counter()
        plans = plan_replay(capture, ReplayOptions(cancel_rate=0.3), tag="bench")
        cancels = sum(1 for p in plans if p.cancel_after_s is not None)
        rows.append(("plan_replay (30% cancelled)", time.perf_counter() - started, f"{cancels:,} cancels"))
        store.close()
    print(f"capture of one hour, {args.requests:,} requests")
    for name, seconds, note in rows:
        print(f"  {name:<30} {seconds:>8.2f} s  {note}")


if __name__ == "__main__":
    main()
