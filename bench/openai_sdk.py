"""Verdicts against the engine's truth log when the real openai SDK calls the engine: one pooled
client (completions and chat) reads streams to the end, gives up with `stream.close()` and by
leaving a `with` block after a few chunks, and lets a non-streamed request pass its timeout
(tests/test_openai_sdk_e2e.py's session), on vLLM's weak signal set (no engine span, vLLM's
/metrics names). Prints, per disconnect source, false findings and how the given-up requests were
judged.

Usage: .venv/bin/python bench/openai_sdk.py [--runs 2] [--source bpf ...] [--behavior detached]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.engine.launch import running_engine
from tests.e2e import leavers_settled, running_daemon, tally_against_truth, verdict_rows, wait_for
from tests.test_openai_sdk_e2e import sdk_session

SETTINGS = {"probe.poll_hz": 20, "correlate.late_span_seconds": 10.0, "engine_metrics.interval_seconds": 0.1}


def one_run(source: str, behavior: str) -> Counter[str]:
    with tempfile.TemporaryDirectory(prefix="openai-sdk-") as scratch:
        tmp = Path(scratch)
        with running_daemon(tmp, **{"probe.source": source, **SETTINGS}) as daemon, \
                running_engine(behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                               truth_log=tmp / "truth.jsonl", step_ms=10, max_batch=16,
                               extra_args=["--engine-span", "none", "--metrics-names", "vllm"]) as engine:
            daemon.set_ports({engine.port})
            completed, given_up = sdk_session(engine.url)
            truths = engine.wait_for_truth(completed + given_up, timeout=30)
            wait_for(lambda: leavers_settled(verdict_rows(daemon), truths), timeout_s=40, interval_s=0.25)
            time.sleep(1.0)
            tally, _ = tally_against_truth(verdict_rows(daemon), truths)
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", choices=("bpf", "procfs"), help="disconnect source (repeatable)")
    parser.add_argument("--behavior", default="detached", choices=("detached", "abort"), help="the engine's")
    parser.add_argument("--runs", type=int, default=2, help="runs a source, each with its own engine and daemon")
    args = parser.parse_args()
    print(f"{'source':<7} {'false findings':>16} {'given up':>9} {'right':>6} {'unconf.':>8} {'otherwise':>10} "
          f"{'no verdict':>11}")
    for source in args.source or ["bpf", "procfs"]:
        total: Counter[str] = Counter()
        for run in range(args.runs):
            print(f"{source}: run {run + 1} of {args.runs}", file=sys.stderr, flush=True)
            total += one_run(source, args.behavior)
        print(f"{source:<7} {total['false findings']:>5} of {total['completed']:<7} {total['cancels']:>9} "
              f"{total['cancels right']:>6} {total['cancels unconfirmed']:>8} {total['cancels judged otherwise']:>10} "
              f"{total['cancels without a verdict']:>11}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
