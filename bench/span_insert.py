"""Where a span's insert goes: the store's own write of normalized spans, side by side, as it is
and without its unique (start minute, trace id, span id) index, at three commit sizes, into a table
that already holds ``--rows`` spans.

The index is the dedup of resent spans and the way to a trace's spans (auditor/store/spankeys.py).
So the run without it shows what this store format cannot save, not an option.

Usage: .venv/bin/python bench/span_insert.py [--rows 200000] [--spans 100000]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.model import SpanRecord
from auditor.store import Store
from bench.ingest import Bodies, body_normalizer

BATCH = 512  # spans a body, as the SDK's exporters send them


def spans(count: int) -> list[SpanRecord]:
    normalize, bodies = body_normalizer(), Bodies(BATCH, seed=5)
    out: list[SpanRecord] = []
    while len(out) < count:
        out += normalize(bodies.next()).spans
    return out[:count]


def insert_us(records: list[SpanRecord], rows: int, commit: int, with_index: bool, workdir: Path) -> float:
    """CPU microseconds a span of the store's write, after ``rows`` spans are already in."""
    path = workdir / f"spans-{commit}-{with_index}.db"
    store = Store(f"sqlite:///{path}")
    if not with_index:
        with sqlite3.connect(path) as conn:
            conn.execute("DROP INDEX uq_spans_start_minute_trace_span")
    for i in range(0, rows, 4096):
        store.write(records[i:min(rows, i + 4096)])
    measured = records[rows:]
    started = time.thread_time()
    for i in range(0, len(measured), commit):
        store.write(measured[i:i + commit])
    spent = time.thread_time() - started
    store.close()
    return spent / len(measured) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description="Where a span's insert goes.")
    parser.add_argument("--rows", type=int, default=200_000, help="spans already in the table")
    parser.add_argument("--spans", type=int, default=100_000, help="spans inserted and timed")
    args = parser.parse_args()
    records = spans(args.rows + args.spans)
    print(f"CPU us a span of Store.write, {args.spans:,} spans into a table of {args.rows:,}, random trace ids")
    print(f"{'spans a commit':>15} {'as the store is':>16} {'no unique index':>23}")
    with tempfile.TemporaryDirectory(prefix="span-insert-") as scratch:
        for commit in (BATCH, 4 * BATCH, 64 * BATCH):
            with_index = insert_us(records, args.rows, commit, True, Path(scratch))
            without = insert_us(records, args.rows, commit, False, Path(scratch))
            print(f"{commit:>15,} {with_index:>16.1f} {without:>23.1f}")
    print("60,000 spans/s on one core leaves 16.7 us a span for everything: decode, normalize, insert")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
