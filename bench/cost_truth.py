"""What the daemon charges zombies against what the engine spent on them, over several rounds.

The scenarios of tests/test_cost_e2e.py, repeated: the real daemon (eBPF probe or the /proc
source, OTLP receiver, procfs CPU sampler) watches the reference engine on the CPU, whose spans
carry no ``process.pid``; the truth is the engine's own log (``compute_seconds_after_disconnect``:
each compute step's thread CPU-seconds after the client left, shared among the requests in the
step). The daemon sees the whole process's CPU, so it may read a little high.

- ``batched``: three zombies of 80, 130 and 200 tokens share a batch of four (three, then two,
  then one running), the engine's gauges scraped every 100 ms.
- ``queued``: one request at a time, no gauges: a zombie, and one queued behind it whose client
  left while it waited (charged only for its own run).

Prints each zombie's charged / spent ratio per round, then min / median / max per zombie. With
``--compare-setting KEY=VALUE`` each round also runs a daemon with that configuration setting (a
TOML value, e.g. ``sampler.interval_ms=200``), and the two are printed side by side.

    python bench/cost_truth.py [--rounds 5] [--scenarios batched,queued] [--source bpf|procfs]
                               [--compare-setting KEY=VALUE]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.detection import setting as detection_setting  # noqa: E402
from replay.engine.launch import running_engine  # noqa: E402
from tests.e2e import cancel_after, running_daemon, verdict_rows, wait_for  # noqa: E402


def settled(daemon: Any, request_ids: set[str], timeout_s: float = 40) -> dict[str, Any]:
    def done() -> bool:
        rows = {r.request_id: r for r in verdict_rows(daemon)}
        return all(rid in rows and not rows[rid].details.get("provisional") for rid in request_ids)

    wait_for(done, timeout_s=timeout_s)
    return {r.request_id: r for r in verdict_rows(daemon) if r.request_id in request_ids}


def setting(text: str) -> tuple[str, Any]:
    """``section.key=value`` -> (dotted key, value); argparse's type, over bench/detection's."""
    section, key, value = detection_setting(text)
    return f"{section}.{key}", tomllib.loads(f"v = {value}")["v"]


def one_round(scenario: str, source: str, scratch: Path,
              compared: dict[str, Any] | None = None) -> dict[str, tuple[str, float, float]]:
    """request id -> (verdict, charged CPU-s, spent CPU-s by the truth log); ``compared``: settings
    of the daemon's configuration over the scenario's own."""
    settings: dict[str, Any] = {"probe.source": source}
    if scenario == "batched":
        settings["engine_metrics.interval_seconds"] = 0.1
        max_batch, requests = 4, [(f"batched-{n}", n, 0.0) for n in (80, 130, 200)]
    else:
        settings.update({"engine_metrics.scrape": False, "correlate.late_span_seconds": 15.0})
        max_batch, requests = 1, [("first", 80, 0.0), ("behind", 30, 0.1)]
    settings.update(compared or {})
    with running_daemon(scratch, **settings) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
            truth_log=scratch / "truth.jsonl", step_ms=20, max_batch=max_batch,
            extra_args=["--no-process-pid"]) as engine:
        daemon.set_ports({engine.port})
        if not wait_for(lambda: daemon.correlator.cost.pid_by_port.get(engine.port) == engine.pid, timeout_s=10):
            raise RuntimeError("the daemon did not find the engine behind its port")
        time.sleep(0.5)  # a first sample of the engine: the baseline
        threads = []
        for request_id, tokens, after_s in requests:
            time.sleep(after_s)
            threads.append(cancel_after(engine.port, 0.3, "fin", stream=True, max_tokens=tokens,
                                        request_id=request_id))
        for thread in threads:
            thread.join()
        truths = {rid: engine.truth_of(f"cmpl-{rid}", timeout=30) for rid, _, _ in requests}
        rows = settled(daemon, {rid for rid, _, _ in requests})
    return {rid: (rows[rid].verdict if rid in rows else "(none)",
                  rows[rid].wasted_cpu_seconds if rid in rows else 0.0,
                  truths[rid]["compute_seconds_after_disconnect"]) for rid, _, _ in requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scenarios", default="batched,queued")
    parser.add_argument("--source", choices=("bpf", "procfs"), default="bpf")
    parser.add_argument("--compare-setting", type=setting, action="append", default=[], metavar="KEY=VALUE",
                        help="each round also with this configuration setting (repeatable: all together)")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - {"batched", "queued"}
    if unknown or args.rounds < 1:
        parser.error(f"scenarios are batched and queued, rounds at least 1 (got {args.scenarios!r}, {args.rounds})")
    logging.disable(logging.INFO)  # the daemon's own finding lines: the table says it
    if args.source == "bpf" and os.geteuid() != 0:
        print("needs root (eBPF probe); --source procfs runs without it")
        return 2
    # Each daemon compared: its label -> the settings over the scenario's own.
    daemons: dict[str, dict[str, Any]] = {"as configured": {}}
    if args.compare_setting:
        daemons[", ".join(f"{key}={value}" for key, value in args.compare_setting)] = dict(args.compare_setting)
    for scenario in scenarios:
        print(f"\n{scenario}: charged / spent CPU-seconds per zombie, {args.rounds} rounds, "
              f"disconnects from {args.source}")
        ratios: dict[str, dict[str, list[float]]] = {label: {} for label in daemons}
        for round_no in range(1, args.rounds + 1):
            for label, compared in daemons.items():
                with tempfile.TemporaryDirectory() as scratch:
                    found = one_round(scenario, args.source, Path(scratch), compared)
                cells = []
                for rid, (verdict, charged, spent) in found.items():
                    ratio = charged / spent if spent > 0 else float("nan")
                    ratios[label].setdefault(rid, []).append(ratio)
                    mark = "" if verdict == "zombie" else f" [{verdict}]"
                    cells.append(f"{rid} {charged:.3f}/{spent:.3f} ({ratio - 1:+.1%}){mark}")
                named = f" {label}" if len(daemons) > 1 else ""
                print(f"  round {round_no}{named}: " + "; ".join(cells), flush=True)
        for label, found_ratios in ratios.items():
            print(f"  {'zombie':<14}{'min':>9}{'median':>9}{'max':>9}" + (f"   {label}" if len(daemons) > 1 else ""))
            for rid, values in found_ratios.items():
                print(f"  {rid:<14}{min(values) - 1:>+9.1%}{statistics.median(values) - 1:>+9.1%}"
                      f"{max(values) - 1:>+9.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
