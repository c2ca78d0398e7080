"""What writing a round's verdicts costs as the verdicts table fills to days of retention.

At 100 requests/s the correlator writes a verdict for every request whose connection closed while
it was watched, about 52 a second in bench/detection.py's load, and retention keeps verdicts for
days (``retention.verdict_days``): millions of rows. The table's unique key (the request key: host,
trace id, span id) and two of its other indexes (trace id, request id) are random per request, so,
as for spans before they were keyed by start minute (bench/span_index_growth.py), each new verdict
lands on a leaf page of its own in each of them once the indexes outgrow the cache. In a 900 s
load the correlator's write step went from 0.15 to 0.33% of a core as the table grew (docs/footprint.md,
thirty-first pass); this bench follows the table further.

The table is filled through the store's own upsert (``Store.upsert_verdicts``, a round's batch at a
time, disconnect times advancing a second a batch); at each size the CPU of ``--batches`` more
batches is timed (the writing thread's own). Verdicts only: the spans and kernel events a real store
holds beside them share its cache and would make the figures higher.

Usage: .venv/bin/python bench/verdict_growth.py [--held 50000 500000 2000000] [--per-round 52]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.model import RequestVerdict, Verdict
from auditor.store import Store

HOST = "gpu-host-1"
S = 1_000_000_000
T0 = 1_700_000_000 * S


def verdicts(round_no: int, count: int) -> list[RequestVerdict]:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", default=[50_000, 500_000, 2_000_000])
    parser.add_argument("--per-round", type=int, default=52)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    if args.per_round < 1 or args.batches < 1 or any(h < 0 for h in args.held):
        parser.error("--per-round and --batches at least 1, --held sizes not negative")
    print(f"Verdict upserts, {args.per_round} a round, CPU of the writing thread, {args.batches} rounds timed "
          "at each size", flush=True)
    print(f"  {'held':>10}{'us a verdict':>14}{'ms a round':>12}{'fill, s':>9}")
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(f"sqlite:///{scratch}/verdicts.db")
        held, round_no = 0, 0
        for target in sorted(args.held):
            filled = time.monotonic()
            while held < target:
                batch = verdicts(round_no, min(args.per_round, target - held))
                store.upsert_verdicts(batch)
                held, round_no = held + len(batch), round_no + 1
            fill_s = time.monotonic() - filled
            batches = [verdicts(round_no + i, args.per_round) for i in range(args.batches)]
            cpu = time.thread_time()
            for batch in batches:
                store.upsert_verdicts(batch)
            spent = time.thread_time() - cpu
            held, round_no = held + args.per_round * args.batches, round_no + args.batches
            print(f"  {target:>10,}{spent / (args.per_round * args.batches) * 1e6:>14.1f}"
                  f"{spent / args.batches * 1e3:>12.2f}{fill_s:>9.0f}", flush=True)
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
