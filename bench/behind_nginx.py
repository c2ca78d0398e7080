"""Verdicts against the engine's truth log with a real nginx in front of the engine, the deployment
most users run: the three configs users copy for an OpenAI-compatible server (keepalive: SSE
unbuffered, upstream connections pooled; nokeep: one upstream connection per request; buffered:
pooled, nginx's default buffering), each disconnect source, an engine that runs on after its client
left (detached) or aborts. Each run sends tests/nginx.py's plan (15 requests that complete, 8 whose
clients leave, FIN and reset) with plain clients (no X-Request-Id) on vLLM's weak signal set (no
engine span, vLLM's /metrics names). Prints one line per cell: false findings (completed requests
judged zombie or aborted) and how the cancels were judged, side by side.

Usage: .venv/bin/python bench/behind_nginx.py [--runs 1] [--variant nokeep ...] [--source bpf ...]
                                              [--behavior detached ...] [--span-delay-ms 5000] [--details]
                                              [--engine-span none] [--metrics-names vllm] [--engine-flag F]
Needs nginx (`make setup` takes the binary from Debian's package) and, for the eBPF source, root.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import tally_against_truth, work_ends_line
from tests.nginx import VARIANTS, find_nginx, run_behind_nginx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="nginx config (repeatable)")
    parser.add_argument("--source", action="append", choices=("bpf", "procfs"), help="disconnect source (repeatable)")
    parser.add_argument("--behavior", action="append", choices=("detached", "abort"), help="engine (repeatable)")
    parser.add_argument("--runs", type=int, default=1, help="runs a cell, each with its own engine, daemon and nginx")
    parser.add_argument("--engine-span", default="none", help="the engine's --engine-span (none, llm_request, genai)")
    parser.add_argument("--metrics-names", default="vllm", help="the engine's --metrics-names (vllm, sglang, tgi, ...)")
    parser.add_argument("--engine-flag", action="append", default=[], metavar="FLAG",
                        help="another flag for the engine, e.g. --engine-flag=--gauges-on-steps (repeatable)")
    parser.add_argument("--span-delay-ms", type=int, default=None, metavar="MS",
                        help="the engine's span export delay (vLLM keeps the OpenTelemetry SDK's 5000) [default: 200]")
    parser.add_argument("--details", action="store_true", help="print what the truth contradicts, per run")
    args = parser.parse_args()
    if find_nginx() is None:
        print("nginx not found: run `make setup` as root", file=sys.stderr)
        return 2
    cells = list(itertools.product(args.variant or ["keepalive", "nokeep", "buffered"],
                                   args.source or ["bpf", "procfs"], args.behavior or ["detached", "abort"]))
    totals: dict[tuple[str, str, str], Counter[str]] = {}
    for number, (variant, source, behavior) in enumerate(cells, 1):
        total: Counter[str] = Counter()
        for run in range(args.runs):
            print(f"[{number}/{len(cells)}] {variant} {source} {behavior}: run {run + 1} of {args.runs}",
                  file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="behind-nginx-") as tmp:
                rows, truths, actions = run_behind_nginx(Path(tmp), variant, source, behavior,
                                                         engine_span=args.engine_span, metrics_names=args.metrics_names,
                                                         engine_flags=args.engine_flag, span_delay_ms=args.span_delay_ms)
            tally, problems = tally_against_truth(rows, truths)
            tally["client errors"] += sum(1 for action in actions if action.error)
            total += tally
            if args.details:
                for line in problems:
                    print(f"    {variant} {source} {behavior} run {run + 1}: {line}")
        totals[(variant, source, behavior)] = total
    delay = "" if args.span_delay_ms is None else f", spans exported every {args.span_delay_ms} ms"
    flags = "".join(" " + flag for flag in args.engine_flag)
    print(f"\n{args.runs} run(s) a cell; plain clients, engine span {args.engine_span}, "
          f"{args.metrics_names} /metrics names{flags}{delay}")
    print(f"{'nginx':<10} {'source':<7} {'engine':<9} {'false findings':>16} {'cancels':>8} {'right':>6} "
          f"{'unconf.':>8} {'otherwise':>10} {'no verdict':>11}")
    grand: Counter[str] = Counter()
    for (variant, source, behavior), total in totals.items():
        grand += total
        print(f"{variant:<10} {source:<7} {behavior:<9} "
              f"{total['false findings']:>5} of {total['completed']:<7} {total['cancels']:>8} "
              f"{total['cancels right']:>6} {total['cancels unconfirmed']:>8} {total['cancels judged otherwise']:>10} "
              f"{total['cancels without a verdict']:>11}")
    print(f"{'all':<28} {grand['false findings']:>5} of {grand['completed']:<7} {grand['cancels']:>8} "
          f"{grand['cancels right']:>6} {grand['cancels unconfirmed']:>8} {grand['cancels judged otherwise']:>10} "
          f"{grand['cancels without a verdict']:>11}")
    print(work_ends_line(grand))
    if grand["rows without truth"] or grand["client errors"]:
        print(f"rows without truth {grand['rows without truth']}, client errors {grand['client errors']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
