"""What a span's insert, and retention's delete of an old span, cost as the spans table fills to
hours of retention, with the store's unique (start minute, trace id, span id) index, and beside it
the same table with the key it had before, (trace id, span id).

Retention keeps spans six hours: at 100 requests/s (about 190 spans a second) that is about four
million rows. Trace ids are random, so an index led by them takes each new span on a leaf page of
its own, which is read, changed, written to the WAL and copied back at a checkpoint, and each
deleted span on another; the more pages the index has, the fewer of them any cache holds.
bench/store_growth.py follows the first ten minutes of this; this bench follows the hours. The
start minute in front of the key keeps the pages that take inserts to the current minute's, and
those that lose rows to the oldest minutes', whatever the table holds (auditor/store/spankeys.py).

The table is filled through the store's own write (512 spans a commit, start times advancing at
190 spans a second); at each size the timed commits go into a copy of it as it is and into a copy
with the trace-led index instead, alternately (``--rounds``); then, in the same copy, retention's
own delete (``prune_table``, its batches) takes as many of the oldest spans as were written: what
a host that has run for the whole retention does every second besides its inserts. CPU is the
writing thread's own.

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
from auditor.store.retention import RetentionPolicy, prune_table
from bench.span_insert import spans

SPANS_PER_S = 190  # bench/detection.py's load at 100 requests/s
COMMIT = 512  # spans a commit: an SDK exporter's batch
TIMED_COMMITS = 100

TRACE_LED = "CREATE UNIQUE INDEX uq_spans_trace_span ON spans (trace_id, span_id)"  # the key before


class Spans:
    """Copies of normalized spans with fresh random ids, starting one after another."""

    def __init__(self) -> None:
        self.templates = spans(4096)
        self.first_ns = self.next_ns = time.time_ns() - 6 * 3600 * 1_000_000_000

    def take(self, count: int) -> list[SpanRecord]:
        out = []
        for i in range(count):
            self.next_ns += 1_000_000_000 // SPANS_PER_S
            out.append(dataclasses.replace(
                self.templates[i % len(self.templates)], trace_id=secrets.token_hex(16),
                span_id=secrets.token_hex(8), start_ns=self.next_ns, end_ns=self.next_ns + 2_000_000_000))
        return out


def timed_us(db: Path, batches: list[list[SpanRecord]], older_than_ns: int) -> tuple[float, float]:
    """CPU microseconds a span of the store's write of ``batches`` into ``db``, then of retention's
    delete of the spans that ended before ``older_than_ns``."""
    store = Store(f"sqlite:///{db}")
    try:
        started = time.thread_time()
        for batch in batches:
            store.write(batch)
        written = time.thread_time() - started
        host = batches[0][0].host
        started = time.thread_time()
        deleted = prune_table(store, "spans", "end_ns", host=host, older_than_ns=older_than_ns,
                              batch_rows=RetentionPolicy().batch_rows)
        pruned = time.thread_time() - started
        if not deleted:
            raise SystemExit("retention deleted nothing: the bench's times are off")
        return written / sum(map(len, batches)) * 1e6, pruned / deleted * 1e6
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
    print("insert | delete: each with the (trace id, span id) key it had before, as the store is "
          "(led by the start minute), and their ratio")
    print(f"{'spans held':>12} {'hours at 190/s':>15} {'insert before':>14} {'as is':>7} {'ratio':>6} "
          f"{'delete before':>14} {'as is':>7} {'ratio':>6}")
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
            results: dict[str, list[tuple[float, float]]] = {"trace-led": [], "as is": []}
            # As many of the oldest spans as the timed commits write (each ends 2 s after its start).
            older_than_ns = source.first_ns + 2_000_000_000 + COMMIT * TIMED_COMMITS * 1_000_000_000 // SPANS_PER_S
            for _ in range(args.rounds):
                mark = source.next_ns
                batches = [source.take(COMMIT) for _ in range(TIMED_COMMITS)]
                for label in results:
                    copy = Path(scratch) / f"{label}.db"
                    shutil.copyfile(filled, copy)
                    if label == "trace-led":
                        with sqlite3.connect(copy) as conn:
                            conn.execute("DROP INDEX uq_spans_start_minute_trace_span")
                            conn.execute(TRACE_LED)
                    results[label].append(timed_us(copy, batches, older_than_ns))
                    for path in (copy, Path(f"{copy}-wal"), Path(f"{copy}-shm")):
                        path.unlink(missing_ok=True)
                source.next_ns = mark  # the filled table goes on from before the timed spans
            (before, now), (del_before, del_now) = (
                [statistics.median(run[part] for run in results[label]) for label in results] for part in (0, 1))
            print(f"{size:>12,} {size / SPANS_PER_S / 3600:>15.1f} {before:>14.1f} {now:>7.1f} {before / now:>6.2f} "
                  f"{del_before:>14.1f} {del_now:>7.1f} {del_before / del_now:>6.2f}", flush=True)
            store = Store(f"sqlite:///{filled}")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
