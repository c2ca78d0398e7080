"""The orphaned work by port of an engine that sends no spans (llama.cpp's server with --metrics,
alone, by default; --names for another engine's gauges), against the engine's truth log: how much
of its zombie time the port alone tells, and that an engine that stops the work shows none.

One daemon and reference engine per behavior (llama.cpp's metric names, no OTLP at all):
``detached`` runs a request on after its client leaves, ``abort`` stops it. The load: requests
cancelled at random points (FIN and reset, streaming and not, 1 to 4 s of work each) among
requests read whole, a few running at once; with ``--pool N``, N clients that keep their
connection after their answer, as an SDK's pool does, each of which hides an orphan while it stays.

Prints, per behavior side by side: the truth's orphaned time (each cancelled request's running time
past its client's grace), the request-seconds the stretches counted and their ratio, the most
orphans at once (truth and counted), the stretches and their CPU-seconds.

Usage: .venv/bin/python bench/orphaned_work.py [--cancels 12] [--done 6] [--gap 0.3] [--pool 0] [--source bpf]
                                               [--names llamacpp|tgi|vllm|sglang] [--gauges-on-steps]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.model import STEP_STILL_NS
from replay.engine.launch import running_engine
from tests.e2e import GRACE_S, cancel_after, complete, read_response, running_daemon, send_request
from tests.test_orphaned_work_e2e import stretches

S = 1_000_000_000


def pooled(port: int, hold_s: float) -> threading.Thread:
    """A client that reads its short answer whole, then keeps the connection open for ``hold_s``."""
    def run() -> None:
        with send_request(port, stream=False, max_tokens=8, request_id=None) as sock:
            read_response(sock)
            time.sleep(hold_s)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def truth_orphaned(truths: list[dict[str, Any]]) -> tuple[float, int]:
    """(request-seconds the engine ran requests whose clients had left more than the grace before,
    the most such at once), from the truth log."""
    spans = []
    for truth in truths:
        left = truth.get("disconnect_at")
        if not left or truth.get("behavior") != "detached":
            continue
        start = max(left + int(GRACE_S * S), truth.get("scheduled_at") or left)
        if truth["finished_at"] > start:
            spans.append((start, truth["finished_at"]))
    total = sum(end - start for start, end in spans) / S
    moments = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = running = 0
    for _, step in moments:
        running += step
        peak = max(peak, running)
    return total, peak


def one_run(args: argparse.Namespace, behavior: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="orphaned-work-"))
    rng = random.Random(args.seed)
    try:
        settings = {"probe.source": args.source, "engine_metrics.interval_seconds": 0.1}
        with running_daemon(tmp, **settings) as daemon, running_engine(
                behavior=behavior, truth_log=tmp / "truth.jsonl", step_ms=10, max_batch=16,
                extra_args=["--metrics-names", args.names, *(["--gauges-on-steps"] if args.gauges_on_steps else [])]
        ) as engine:
            daemon.set_ports({engine.port})
            time.sleep(0.5)
            load_s = args.gap * (args.cancels + args.done)
            threads = [pooled(engine.port, load_s + 4.0) for _ in range(args.pool)]
            kinds = [(kind, stream) for kind in ("fin", "rst") for stream in (True, False)]
            order = ["cancel"] * args.cancels + ["done"] * args.done
            rng.shuffle(order)
            for i, what in enumerate(order):
                tokens = rng.randint(100, 400)
                if what == "done":
                    threads.append(complete(engine.port, stream=True, max_tokens=rng.randint(20, 80), request_id=None))
                else:
                    kind, stream = kinds[i % len(kinds)]
                    threads.append(cancel_after(engine.port, rng.uniform(0.2, 1.0), kind, stream=stream,
                                                max_tokens=tokens, request_id=None))
                time.sleep(args.gap)
            for thread in threads:
                thread.join()
            truths = engine.wait_for_truth(len(order) + args.pool, timeout=60)
            # Scrapes past the last work's end, and past the time standing gauges take to be read as such.
            time.sleep(1.5 + STEP_STILL_NS.get(args.names, 0) / S)
        rows = stretches(tmp / "auditor.db")
        truth_s, truth_peak = truth_orphaned(truths)
        return {"truth_s": truth_s, "truth_peak": truth_peak, "counted_s": sum(r["request_seconds"] for r in rows),
                "peak": max((r["peak"] for r in rows), default=0), "stretches": len(rows),
                "cpu_s": sum(r["wasted_cpu_seconds"] for r in rows),
                "cancels": sum(1 for t in truths if t.get("disconnect_at"))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cancels", type=int, default=12)
    parser.add_argument("--done", type=int, default=6)
    parser.add_argument("--pool", type=int, default=0, help="clients kept connected after their answer")
    parser.add_argument("--source", choices=["bpf", "procfs"], default="bpf")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between one request's start and the next's")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--names", default="llamacpp", choices=["llamacpp", "tgi", "vllm", "sglang"],
                        help="whose metric names the engine serves (no spans with any)")
    parser.add_argument("--gauges-on-steps", action="store_true",
                        help="gauges published with a step (vLLM) or a logged batch (SGLang) only")
    args = parser.parse_args()
    results = {behavior: one_run(args, behavior) for behavior in ("detached", "abort")}
    steps = ", gauges on steps" if args.gauges_on_steps else ""
    print(f"{args.names} names{steps}, no spans: {args.cancels} cancels among {args.done} read whole, {args.gap:g} s "
          f"apart, pool {args.pool}, source {args.source}")
    print(f"{'':<34}{'detached':>12}{'abort':>12}")
    rows = [("cancelled (truth)", "cancels", "{:.0f}"),
            ("orphaned request-s (truth)", "truth_s", "{:.2f}"),
            ("orphaned request-s (counted)", "counted_s", "{:.2f}"),
            ("most at once (truth)", "truth_peak", "{:.0f}"),
            ("most at once (counted)", "peak", "{:.0f}"),
            ("stretches", "stretches", "{:.0f}"),
            ("their CPU-s", "cpu_s", "{:.2f}")]
    for label, key, form in rows:
        print(f"{label:<34}" + "".join(f"{form.format(results[b][key]):>12}" for b in results))
    detached = results["detached"]
    ratio = detached["counted_s"] / detached["truth_s"] if detached["truth_s"] else float("nan")
    print(f"{'counted / truth (detached)':<34}{ratio:>12.3f}")


if __name__ == "__main__":
    main()
