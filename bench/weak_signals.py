"""Verdicts against the engine's truth log on the weakest signal set the rules must survive: by
default no engine span, the engine's own /metrics (vLLM's names), and a disconnect source of choice;
each signal can be changed (--engine-span, --metrics-names, --live, ...), and --plain sends no
X-Request-Id, as curl and the openai SDK do. Two requests complete (their clients close right after
the last byte) while four others are cancelled at once (FIN and reset, streaming and not) on the
same engine. Prints each request's verdict, what decided it, and what the truth log says it should
be (matched by client port); then the false findings (a completed request called a zombie or
aborted) and the cancels without a verdict or judged otherwise.

Usage: .venv/bin/python bench/weak_signals.py [--behavior detached] [--source procfs] [--done-tokens 40]
                                              [--plain] [--engine-span none] [--metrics-names vllm]
                                              [--live] [--details] [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.engine.launch import running_engine
from tests.e2e import (
    cancel_after,
    complete,
    expected_verdict,
    match_to_truth,
    running_daemon,
    tally_against_truth,
    verdict_rows,
    work_ends_line,
)


def one_run(args: argparse.Namespace) -> Counter[str]:
    """One engine and daemon, in a folder of their own (removed after unless ``--keep``)."""
    tmp = Path(tempfile.mkdtemp(prefix="weak-signals-"))
    try:
        return judged_against_truth(args, tmp)
    finally:
        if args.keep:
            print(f"the run's store and truth log: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def judged_against_truth(args: argparse.Namespace, tmp: Path) -> Counter[str]:
    """The table of verdicts, and the tally of how they compare with the truth."""
    settings = {"probe.source": args.source, "probe.poll_hz": 20, "correlate.late_span_seconds": 10.0,
                "engine_metrics.interval_seconds": 0.1}
    engine_args = ["--engine-span", args.engine_span, "--metrics-names", args.metrics_names, *args.engine_flag]
    with running_daemon(tmp, **settings) as daemon:
        if args.live:
            engine_args += ["--live", f"127.0.0.1:{daemon.status.live_port}"]
        with running_engine(behavior=args.behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                            truth_log=tmp / "truth.jsonl", step_ms=10, max_batch=16, extra_args=engine_args) as engine:
            daemon.set_ports({engine.port})
            time.sleep(0.5)  # the port's first scrapes: a request under way as the daemon starts has none before it
            name = (lambda label: None) if args.plain else (lambda label: label)
            threads = [complete(engine.port, stream=True, max_tokens=args.done_tokens, request_id=name(f"done{i}"))
                       for i in range(2)]
            for kind in ("fin", "rst"):
                for stream in (True, False):
                    threads.append(cancel_after(engine.port, args.cancel_after, kind, stream=stream, max_tokens=150,
                                                request_id=name(f"{kind}-{'stream' if stream else 'plain'}")))
                    time.sleep(0.05)
            for thread in threads:
                thread.join()
            print(f"waiting {args.settle_s:g} s for the verdicts", file=sys.stderr)
            time.sleep(args.settle_s)
            judged = verdict_rows(daemon)
            truths = engine.truth()
    matched, _ = match_to_truth(judged, truths)  # as the tally matches them
    print(f"{'request':<14} {'client port':<12} {'verdict':<16} {'decided by':<16} truth")
    for truth in truths:
        request_id = truth["request_id"].removeprefix("cmpl-")
        row = next(iter(matched.get(id(truth), [])), None)
        want = expected_verdict(truth) if truth.get("disconnect_at") else "completed"
        verdict = row.verdict if row is not None else "-"
        port = truth.get("client_port") or (f"({row.client_port})" if row is not None else None)
        print(f"{request_id[:14]:<14} {port!s:<12} {verdict:<16} {(row.details.get('evidence') if row else '-') or '-':<16} {want}")
        if args.details and row is not None:
            print(f"    {row.details}")
    tally, _ = tally_against_truth(judged, truths)
    print(f"false findings {tally['false findings']}; cancels without a verdict "
          f"{tally['cancels without a verdict']}, judged otherwise {tally['cancels judged otherwise']}, "
          f"unconfirmed {tally['cancels unconfirmed']}, unmatched {tally['cancels unmatched']}; verdicts on a port "
          f"no request of the truth names {tally['rows without truth']}")
    print(work_ends_line(tally))
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--behavior", default="detached", help="the engine's on a disconnect (replay.engine)")
    parser.add_argument("--source", default="procfs", choices=("bpf", "procfs"))
    parser.add_argument("--done-tokens", type=int, default=40, help="max_tokens of the requests that complete")
    parser.add_argument("--plain", action="store_true", help="send no X-Request-Id (curl, the openai SDK)")
    parser.add_argument("--engine-span", default="none", help="the engine's --engine-span (none, llm_request, genai)")
    parser.add_argument("--metrics-names", default="vllm", help="the engine's --metrics-names")
    parser.add_argument("--cancel-after", type=float, default=None, metavar="S",
                        help="seconds between a cancelled request's last byte and its close [default: 0, with "
                             "--plain 0.1: a client reset before the engine accepted it leaves the truth log no "
                             "client port to match by]")
    parser.add_argument("--live", action="store_true", help="the engine sends live notices to the daemon")
    parser.add_argument("--engine-flag", action="append", default=[], metavar="FLAG",
                        help="another flag for the engine, e.g. --engine-flag=--no-process-pid (repeatable)")
    parser.add_argument("--details", action="store_true", help="print each verdict's details too")
    parser.add_argument("--runs", type=int, default=1, help="runs, each with its own engine and daemon")
    parser.add_argument("--settle-s", type=float, default=14.0, help="seconds to wait for the verdicts")
    parser.add_argument("--keep", action="store_true", help="keep each run's store and truth log (printed)")
    args = parser.parse_args()
    if args.cancel_after is None:
        args.cancel_after = 0.1 if args.plain else 0.0
    total: Counter[str] = Counter()
    for run in range(args.runs):
        if args.runs > 1:
            print(f"\nrun {run + 1} of {args.runs}")
        total += one_run(args)
    if args.runs > 1:
        print(f"\n{args.runs} runs ({args.source}, {args.behavior}, engine span {args.engine_span}, "
              f"{args.metrics_names} metrics{', plain clients' if args.plain else ''}{', live' if args.live else ''}"
              f"{''.join(' ' + flag for flag in args.engine_flag)}): false findings {total['false findings']} "
              f"of {total['completed']} completed; of {total['cancels']} cancels {total['cancels right']} right, "
              f"{total['cancels unconfirmed']} unconfirmed, {total['cancels judged otherwise']} judged otherwise, "
              f"{total['cancels without a verdict']} without a verdict, {total['cancels unmatched']} unmatched "
              f"(reset before the engine read them: the truth names no client port)")
        print(work_ends_line(total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
