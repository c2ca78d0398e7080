"""What a span's insert costs as the spans table fills to hours of retention, with the store's
unique (trace id, span id) index, and beside it the same table with that index led by the span's
start minute.

Retention keeps spans six hours: at 100 requests/s (about 190 spans a second) that is about four
million rows. Trace ids are random, so the unique index takes each new span on a leaf page of its
own, which is read, changed, written to the WAL and copied back at a checkpoint; the more pages
the index has, the fewer of them any cache holds. bench/store_growth.py follows the first ten
minutes of this; this bench follows the hours. A start minute in front of the key keeps the pages
that take inserts to the current minute's, a few hundred, whatever the table holds. It is not
the store's index: lookups by trace id alone (a forgotten trace's recall, the report's and the
capture's joins of a span to its parent) would then need the minutes to look in.

The table is filled through the store's own write (512 spans a commit, start times advancing at
190 spans a second); at each size the timed commits go into a copy of it as it is and into a copy
with the minute-led index instead, alternately (``--rounds``). CPU is the writing thread's own.

Usage: .venv/bin/python bench/span_index_growth.py [--held 100000 1000000 4000000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.model import SpanRecord
from auditor.store import Store
from bench.span_insert import spans

SPANS_PER_S = 190  # bench/detection.py's load at 100 requests/s
COMMIT = 512  # spans a commit: an SDK exporter's batch
TIMED_COMMITS = 100
MINUTE_LED = ("CREATE UNIQUE INDEX uq_spans_minute_trace_span "
              "ON spans (start_ns / 60000000000, trace_id, span_id)")


class Spans:
    """Copies of normalized spans with fresh random ids, starting one after another."""

    def __init__(self) -> None:
        self.templates = spans(4096)
        self.next_ns = time.time_ns() - 6 * 3600 * 1_000_000_000

    def take(self, count: int) -> list[SpanRecord]:
        out = []
        for i in range(count):
            self.next_ns += 1_000_000_000 // SPANS_PER_S
            out.append(dataclasses.replace(
                self.templates[i % len(self.templates)], trace_id=secrets.token_hex(16),
                span_id=secrets.token_hex(8), start_ns=self.next_ns, end_ns=self.next_ns + 2_000_000_000))
        return out


def timed_us(db: Path, batches: list[list[SpanRecord]]) -> float:
    """CPU microseconds a span of the store's write of ``batches`` into ``db``."""
    store = Store(f"sqlite:///{db}")
    try:
        started = time.thread_time()
        for batch in batches:
            store.write(batch)
        return (time.thread_time() - started) / sum(map(len, batches)) * 1e6
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000],
                        help="table sizes to measure at (spans already held)")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each index at each size")
    args = parser.parse_args()
    source = Spans()
    print(f"CPU us a span of Store.write, {COMMIT} spans a commit, {TIMED_COMMITS} commits timed, "
          f"random trace ids, {SPANS_PER_S} spans a second of start times")
    print(f"{'spans held':>12} {'hours at 190/s':>15} {'as the store is':>16} {'minute-led index':>17} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="span-index-") as scratch:
        filled, held = Path(scratch) / "filled.db", 0
        store = Store(f"sqlite:///{filled}")
        for size in sorted(args.held):
            while held < size:
                store.write(source.take(min(4096, size - held)))
                held = min(size, held + 4096)
            store.close()
            with sqlite3.connect(filled) as conn:  # the WAL into the file, which is then copied alone
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            results: dict[str, list[float]] = {"as is": [], "minute-led": []}
            for _ in range(args.rounds):
                mark = source.next_ns
                batches = [source.take(COMMIT) for _ in range(TIMED_COMMITS)]
                for label in results:
                    copy = Path(scratch) / f"{label}.db"
                    shutil.copyfile(filled, copy)
                    if label == "minute-led":
                        with sqlite3.connect(copy) as conn:
                            conn.execute("DROP INDEX uq_spans_trace_span")
                            conn.execute(MINUTE_LED)
                    results[label].append(timed_us(copy, batches))
                    for path in (copy, Path(f"{copy}-wal"), Path(f"{copy}-shm")):
                        path.unlink(missing_ok=True)
                source.next_ns = mark  # the filled table goes on from before the timed spans
            as_is, led = (statistics.median(results[label]) for label in results)
            print(f"{size:>12,} {size / SPANS_PER_S / 3600:>15.1f} {as_is:>16.1f} {led:>17.1f} {as_is / led:>6.2f}",
                  flush=True)
            store = Store(f"sqlite:///{filled}")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
