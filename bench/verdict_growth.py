"""What writing a round's verdicts, and the correlator's lookups of them, cost as the verdicts table
fills to days of retention.

At 100 requests/s the correlator writes a verdict for every request whose connection closed while
it was watched, about 40-52 a second in bench/detection.py's load, and retention keeps verdicts for
days (``retention.verdict_days``): millions of rows. An index led by a random id (a trace id, a
request id) takes each new verdict on a leaf page of its own once it outgrows the cache, as the
spans' trace-id key did before spans were keyed by start minute (bench/span_index_growth.py). The
unique request key is random too; the request-id index is led by the disconnect minute, and a
trace's verdicts are found by a range of the request key (auditor/store/tables.py).

The table is filled through the store's own upsert (``Store.upsert_verdicts``, a round's batch at a
time, disconnect times advancing a second a batch); at each size the CPU of ``--batches`` more
batches is timed (the writing thread's own), then the correlator's two questions about verdicts it
no longer holds (``auditor.correlate.recall.Forgotten``: a trace id, an engine request id), each
about a verdict of the last minutes. Verdicts only: the spans and kernel events a real store holds
beside them share its cache and would make the figures higher. With ``--compare REV`` git revision
REV's store runs too, in its own process, and the figures stand side by side.

Usage: .venv/bin/python bench/verdict_growth.py [--held 0 50000 500000 2000000] [--per-round 52] [--compare REV]
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trees import compared, use_tree

HOST = "gpu-host-1"
S = 1_000_000_000
T0 = 1_700_000_000 * S
LOOKUPS = 200  # of each kind at each size


def verdicts(round_no: int, count: int) -> list[Any]:
    from auditor.model import RequestVerdict, Verdict

    t_ns = T0 + round_no * S
    found = []
    for _ in range(count):
        trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
        found.append(RequestVerdict(
            f"{HOST}/{trace_id}/{span_id}", HOST, Verdict.COMPLETED, t_ns, "fin", t_ns - 2 * S, t_ns, 0.0,
            trace_id=trace_id, request_id=f"cmpl-{secrets.token_hex(16)}", service="vllm", route="/v1/completions",
            model="ref-llm-1b", client_addr="10.12.4.31", client_port=40000 + round_no % 20000, server_port=8000,
            max_tokens=256, details={"provisional": False}))
    return found


def run(held: list[int], per_round: int, batches: int) -> list[dict[str, float]]:
    """At each size: us of CPU a verdict written, ms a round, and us a lookup of each kind."""
    from auditor.correlate.recall import Forgotten
    from auditor.correlate.waste import HORIZON_NS
    from auditor.store import Store

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(f"sqlite:///{scratch}/verdicts.db")
        clock = [T0]
        forgotten = Forgotten(store, HOST, lambda _trace, _root: False, lambda: clock[0] - HORIZON_NS)
        count, round_no = 0, 0
        recent: list[Any] = []
        for target in sorted(held):
            filled = time.monotonic()
            while count < target:
                batch = verdicts(round_no, min(per_round, target - count))
                forgotten.written(batch)
                store.upsert_verdicts(batch)
                count, round_no = count + len(batch), round_no + 1
            fill_s = time.monotonic() - filled
            timed = [verdicts(round_no + i, per_round) for i in range(batches)]
            for batch in timed:
                forgotten.written(batch)
            cpu = time.thread_time()
            for batch in timed:
                store.upsert_verdicts(batch)
            spent = time.thread_time() - cpu
            count, round_no = count + per_round * batches, round_no + batches
            recent = [v for batch in timed for v in batch]
            clock[0] = T0 + round_no * S
            asked = recent[-LOOKUPS:]
            cpu = time.thread_time()
            found = sum(len(forgotten.traces([v.trace_id])) for v in asked)
            by_trace = time.thread_time() - cpu
            cpu = time.thread_time()
            found += sum(len(forgotten.by_request_id([v.request_id])) for v in asked)
            by_request = time.thread_time() - cpu
            if found != 2 * len(asked):
                raise SystemExit(f"lookups found {found} of {2 * len(asked)} verdicts")
            rows.append({"held": target, "us_verdict": spent / (per_round * batches) * 1e6,
                         "ms_round": spent / batches * 1e3, "fill_s": fill_s,
                         "us_trace": by_trace / len(asked) * 1e6, "us_request_id": by_request / len(asked) * 1e6})
        store.close()
    return rows


def child(tree: Path, held: list[int], per_round: int, batches: int) -> list[dict[str, float]]:
    out = subprocess.run([sys.executable, __file__, "--tree", str(tree), "--held", *map(str, held),
                          "--per-round", str(per_round), "--batches", str(batches), "--json"],
                         check=True, capture_output=True, text=True)
    return list(json.loads(out.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", default=[0, 50_000, 500_000, 2_000_000])
    parser.add_argument("--per-round", type=int, default=52)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's store")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # the tree whose auditor to import
    args = parser.parse_args()
    if args.per_round < 1 or args.batches < 1 or any(h < 0 for h in args.held):
        parser.error("--per-round and --batches at least 1, --held sizes not negative")
    if args.batches * args.per_round < LOOKUPS:
        parser.error(f"--batches x --per-round at least {LOOKUPS} (the verdicts looked up)")
    use_tree(args.tree)
    if args.json:
        print(json.dumps(run(args.held, args.per_round, args.batches)))
        return 0
    trees, work = compared(args.compare, "verdict-growth-")
    print(f"Verdict upserts, {args.per_round} a round, {args.batches} rounds timed at each size, then "
          f"{LOOKUPS} lookups of each kind (CPU of the calling thread)", flush=True)
    results = {}
    for label, tree in trees.items():
        results[label] = child(tree, args.held, args.per_round, args.batches)
        print(f"  {label}: filled in {sum(r['fill_s'] for r in results[label]):.0f} s", flush=True)
    print(f"  {'held':>10}" + "".join(f"{label[:22]:>24}" for label in trees) + "  (us a verdict written;"
          " us a lookup by trace / by request id)")
    for index, size in enumerate(sorted(args.held)):
        cells = "".join(f"{r[index]['us_verdict']:>9.1f}; {r[index]['us_trace']:>5.0f} / {r[index]['us_request_id']:>5.0f}"
                        for r in results.values())
        print(f"  {size:>10,}{cells}")
    if len(results) == 2:
        old, new = results.values()
        print("  written, working tree / REV: " + ", ".join(f"{n['us_verdict'] / o['us_verdict']:.2f}"
                                                            for o, n in zip(old, new, strict=True)))
    if work is not None:
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
