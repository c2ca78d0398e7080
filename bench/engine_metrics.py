"""What reading an engine's /metrics costs the daemon: one page parsed whole against only its
known series, side by side, for a page the size of a busy vLLM's (many histogram buckets).

The scraper reads every watched port a few times a second, so this is CPU the daemon spends
continuously. With ``--compare REV`` the page is also read by git revision REV's code, in a
process of its own, in the same run.

With ``--served``, it also scrapes the reference engine's /metrics (Starlette under uvicorn, on a
socket the server bound itself, as vLLM's) over one kept-alive connection, back to back and at
spaced intervals, with and without the quick ACK the scraper asks for before each read: how long
from asked to answered, and the scraper's CPU a scrape.

Usage: .venv/bin/python bench/engine_metrics.py [--buckets 2000] [--rounds 20] [--compare REV] [--served]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.parser import text_string_to_metric_families

from collectors.enginemetrics import parse_load


def page(bucket_lines: int) -> str:
    lines = ["# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge",
             'vllm:num_requests_running{model_name="m"} 3.0',
             "# HELP vllm:num_requests_waiting Waiting.", "# TYPE vllm:num_requests_waiting gauge",
             'vllm:num_requests_waiting{model_name="m"} 1.0']
    families = max(1, bucket_lines // 40)
    for family in range(families):
        name = f"vllm:latency_{family}_seconds"
        lines += [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
        for le in range(38):
            lines.append(f'{name}_bucket{{le="{0.01 * 2 ** (le / 3):.4f}",model_name="m"}} {le * 7}.0')
        lines += [f'{name}_count{{model_name="m"}} 300.0', f'{name}_sum{{model_name="m"}} 41.5']
    return "\n".join(lines) + "\n"


def per_call_ms(action, text: str, rounds: int) -> float:  # type: ignore[no-untyped-def]
    started = time.process_time()
    for _ in range(rounds):
        action(text)
    return (time.process_time() - started) * 1000 / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--buckets", type=int, default=2000, help="histogram lines on the page")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hz", type=float, default=4.0, help="scrapes per second per port")
    parser.add_argument("--compare", metavar="REV", help="also read the page with git revision REV's parse_load")
    parser.add_argument("--served", action="store_true",
                        help="also scrape the reference engine's /metrics, with and without the quick ACK")
    args = parser.parse_args()
    text = page(args.buckets)
    whole = per_call_ms(lambda t: list(text_string_to_metric_families(t)), text, args.rounds)
    filtered = per_call_ms(lambda t: parse_load(t, ts_ns=0, server_port=1), text, args.rounds)
    rows = [("parse the whole page", whole), ("the engine's known series (used)", filtered)]
    if args.compare:
        rows.insert(1, (f"known series, {args.compare}", revision_ms(args.compare, text, args.rounds)))
    print(f"page: {len(text.splitlines())} lines, {len(text) / 1024:.0f} KiB; {args.hz:g} scrapes/s per port")
    print(f"{'':32} {'ms / page':>10} {'% of a core':>12}")
    for label, ms in rows:
        print(f"{label:32} {ms:10.2f} {ms * args.hz / 10:12.2f}")
    print(f"ratio whole / known only: {whole / filtered:.0f}x")
    if args.compare:
        print(f"ratio {args.compare} / now: {rows[1][1] / filtered:.1f}x")
    if args.served:
        served()


SCRAPES = 12


def served() -> None:
    """The reference engine's page, scraped as the daemon does, at several spacings."""
    from collectors import enginemetrics
    from replay.engine.launch import running_engine

    quickack = enginemetrics._QUICKACK
    print(f"\nthe reference engine's /metrics over one kept-alive connection, {SCRAPES} scrapes each, medians")
    print(f"{'spacing':>10} {'quick ACK':>10} {'asked to answered, ms':>22} {'CPU us / scrape':>16}")
    with running_engine(behavior="abort", step_ms=2) as engine:
        for spacing_s in (0.0, 0.05, 0.25):
            for option in (quickack, None):
                enginemetrics._QUICKACK = option  # the module's switch, as the scraper reads it
                scraper = enginemetrics.EngineMetricsScraper(lambda: {engine.port}, lambda loads: None)
                scraper.scrape(engine.port)  # the first scrape reads the page both ways
                waits, cpus = [], []
                for _ in range(SCRAPES):
                    time.sleep(spacing_s)
                    started = time.thread_time()
                    load = scraper.scrape(engine.port)
                    cpus.append((time.thread_time() - started) * 1e6)
                    if load is not None and load.answered_ns is not None:
                        waits.append((load.answered_ns - load.ts_ns) / 1e6)
                scraper.close()
                print(f"{spacing_s * 1000:>7.0f} ms {'yes' if option else 'no':>10} "
                      f"{statistics.median(waits) if waits else float('nan'):>22.2f} {statistics.median(cpus):>16.0f}")
    enginemetrics._QUICKACK = quickack


def revision_ms(rev: str, text: str, rounds: int) -> float:
    """ms per page of REV's parse_load, in a process that imports only REV's collectors."""
    from bench.ingest import export_tree

    with tempfile.TemporaryDirectory() as tmp:
        old = export_tree(rev, Path(tmp))
        code = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
                "from collectors.enginemetrics import parse_load; text = sys.stdin.read(); "
                "started = time.process_time(); rounds = int(sys.argv[2])\n"
                "for _ in range(rounds): parse_load(text, ts_ns=0, server_port=1)\n"
                "print((time.process_time() - started) * 1000 / rounds)")
        out = subprocess.run([sys.executable, "-c", code, str(old), str(rounds)], input=text, cwd=tmp,
                             check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])

if __name__ == "__main__":
    main()
