"""The orphaned work by port of an engine that sends no spans (llama.cpp's server with --metrics,
alone, by default; --names for another engine's gauges), against the engine's truth log: how much
of its zombie time the port alone tells, and that an engine that stops the work shows none.

One daemon and reference engine per behavior (llama.cpp's metric names, no OTLP at all):
``detached`` runs a request on after its client leaves, ``abort`` stops it. The load: requests
cancelled at random points (FIN and reset, streaming and not, 1 to 4 s of work each) among
requests read whole, a few running at once; with ``--pool N``, N pooled connections (an SDK's, a
gateway's upstream pool) that send requests one after another and stay quiet between them: a
connection between requests hides an orphan until the kernel says it was answered and quiet for
IDLE_QUIET_MS (``--compare-idle`` adds a detached run where it always hides one, as before). With
``--netns`` the engine runs in a network of its own, as a container's (``--compare-listing`` adds a
detached run where the /proc source lists none of its clients, as before).

Prints, per behavior side by side: the truth's orphaned time (each cancelled request's running time
past its client's grace), the request-seconds the stretches counted and their ratio, the most
orphans at once (truth and counted), the stretches and their CPU-seconds.

Usage: .venv/bin/python bench/orphaned_work.py [--cancels 12] [--done 6] [--gap 0.3] [--source bpf]
                                               [--pool 0] [--pool-idle 6] [--keep-alive 5] [--compare-idle]
                                               [--netns [--compare-listing]]
                                               [--names llamacpp|tgi|vllm|sglang] [--gauges-on-steps]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.model import STEP_STILL_NS
from probes import bpf, procfs, sockdiag
from replay.engine.launch import running_engine
from tests.e2e import GRACE_S, cancel_after, complete, read_response, running_daemon, send_request
from tests.test_orphaned_work_e2e import stretches

S = 1_000_000_000


def pooled(port: int, until: float, idle_s: float, rng: random.Random, sent: list[int], host: str) -> threading.Thread:
    """A connection of a client's pool (an SDK's, a gateway's upstream): requests one after another
    on it, each answered whole in 1 to 2 s, the connection kept and quiet 1 to ``idle_s`` seconds
    between them, until ``until``; ``sent`` counts them."""
    def run() -> None:
        with send_request(port, stream=False, max_tokens=rng.randint(100, 200), request_id=None, host=host) as sock:
            while True:
                read_response(sock)
                sent.append(1)
                time.sleep(rng.uniform(1.0, idle_s))
                if time.time() >= until:
                    return
                send_request(port, stream=False, max_tokens=rng.randint(100, 200), request_id=None, sock=sock,
                             host=host)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@contextlib.contextmanager
def container_listed(listed: bool) -> Iterator[None]:
    """With ``listed`` False, the /proc source lists no client of a port served in another network
    namespace (it cannot count that namespace's accepts): as before it listed them."""
    if listed:
        yield
        return
    saved = procfs.ProcfsConnEventSource._foreign_accepted
    procfs.ProcfsConnEventSource._foreign_accepted = lambda self, namespace: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        procfs.ProcfsConnEventSource._foreign_accepted = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def network(netns: bool) -> Iterator[tuple[str | None, str]]:
    """(the namespace the engine runs in, the address its clients reach it at): a network of its
    own joined to this one by a veth pair, as a container's on a bridge, with ``netns``."""
    if not netns:
        yield None, "127.0.0.1"
        return
    from tests.test_netns_e2e import ENGINE_ADDR, HOST_ADDR, joined_namespace

    with joined_namespace(f"owbench{os.getpid()}", f"owb{os.getpid() % 100000}", HOST_ADDR, ENGINE_ADDR) as name:
        yield name, ENGINE_ADDR


@contextlib.contextmanager
def idle_told(told: bool) -> Iterator[None]:
    """With ``told`` False, no client is ever taken as kept alive between requests (each client
    connected may hold one): the listing as it was before the kernel's send times were read."""
    saved = sockdiag.IDLE_QUIET_MS, bpf.IDLE_QUIET_MS
    if not told:
        sockdiag.IDLE_QUIET_MS = bpf.IDLE_QUIET_MS = 1 << 31
    try:
        yield
    finally:
        sockdiag.IDLE_QUIET_MS, bpf.IDLE_QUIET_MS = saved


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


def one_run(args: argparse.Namespace, behavior: str, told: bool = True, listed: bool = True) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="orphaned-work-"))
    rng = random.Random(args.seed)
    try:
        settings = {"probe.source": args.source, "engine_metrics.interval_seconds": 0.1}
        with network(args.netns) as (netns, host), idle_told(told), container_listed(listed), \
                running_daemon(tmp, **settings) as daemon, running_engine(
                behavior=behavior, truth_log=tmp / "truth.jsonl", step_ms=10, max_batch=16, host=host, netns=netns,
                extra_args=["--metrics-names", args.names, "--keep-alive-s", str(args.keep_alive),
                            *(["--gauges-on-steps"] if args.gauges_on_steps else [])]
        ) as engine:
            daemon.set_ports({engine.port})
            time.sleep(1.0 if netns else 0.5)  # the /proc source finds the namespace within its next look
            load_s = args.gap * (args.cancels + args.done)
            pool_sent: list[int] = []
            threads = [pooled(engine.port, time.time() + load_s + 2.0, args.pool_idle, random.Random(args.seed + i),
                              pool_sent, host) for i in range(args.pool)]
            kinds = [(kind, stream) for kind in ("fin", "rst") for stream in (True, False)]
            order = ["cancel"] * args.cancels + ["done"] * args.done
            rng.shuffle(order)
            for i, what in enumerate(order):
                tokens = rng.randint(100, 400)
                if what == "done":
                    threads.append(complete(engine.port, stream=True, max_tokens=rng.randint(20, 80), request_id=None,
                                            host=host))
                else:
                    kind, stream = kinds[i % len(kinds)]
                    threads.append(cancel_after(engine.port, rng.uniform(0.2, 1.0), kind, stream=stream,
                                                max_tokens=tokens, request_id=None, host=host))
                time.sleep(args.gap)
            for thread in threads:
                thread.join()
            truths = engine.wait_for_truth(len(order) + len(pool_sent), timeout=60)
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
    parser.add_argument("--pool", type=int, default=0,
                        help="pooled connections: requests one after another, kept alive between them")
    parser.add_argument("--pool-idle", type=float, default=6.0, help="most seconds a pooled connection stays quiet")
    parser.add_argument("--keep-alive", type=float, default=5.0,
                        help="seconds the engine keeps an idle connection (5: uvicorn, llama.cpp; TGI: until its client "
                             "closes it, or 30 in recent versions)")
    parser.add_argument("--compare-idle", action="store_true",
                        help="also run detached with no client taken as kept alive between requests")
    parser.add_argument("--netns", action="store_true",
                        help="the engine in a network of its own, as a container's (root and iproute2)")
    parser.add_argument("--compare-listing", action="store_true",
                        help="with --netns --source procfs: also run detached with the container's clients not listed")
    parser.add_argument("--source", choices=["bpf", "procfs"], default="bpf")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between one request's start and the next's")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--names", default="llamacpp", choices=["llamacpp", "tgi", "vllm", "sglang"],
                        help="whose metric names the engine serves (no spans with any)")
    parser.add_argument("--gauges-on-steps", action="store_true",
                        help="gauges published with a step (vLLM) or a logged batch (SGLang) only")
    args = parser.parse_args()
    results = {behavior: one_run(args, behavior) for behavior in ("detached", "abort")}
    if args.compare_idle:
        results = {"detached": results["detached"], "idle untold": one_run(args, "detached", told=False),
                   "abort": results["abort"]}
    if args.compare_listing:
        results = {"detached": results["detached"], "unlisted": one_run(args, "detached", listed=False),
                   **{name: result for name, result in results.items() if name != "detached"}}
    steps = ", gauges on steps" if args.gauges_on_steps else ""
    pool = f"pool {args.pool} (quiet 1-{args.pool_idle:g} s, engine keeps idle {args.keep_alive:g} s)" if args.pool \
        else "no pool"
    print(f"{args.names} names{steps}, no spans: {args.cancels} cancels among {args.done} read whole, {args.gap:g} s "
          f"apart, {pool}, source {args.source}{', engine in a network of its own' if args.netns else ''}")
    print(f"{'':<34}" + "".join(f"{name:>14}" for name in results))
    rows = [("cancelled (truth)", "cancels", "{:.0f}"),
            ("orphaned request-s (truth)", "truth_s", "{:.2f}"),
            ("orphaned request-s (counted)", "counted_s", "{:.2f}"),
            ("most at once (truth)", "truth_peak", "{:.0f}"),
            ("most at once (counted)", "peak", "{:.0f}"),
            ("stretches", "stretches", "{:.0f}"),
            ("their CPU-s", "cpu_s", "{:.2f}")]
    for label, key, form in rows:
        print(f"{label:<34}" + "".join(f"{form.format(results[b][key]):>14}" for b in results))
    ratios = [results[b]["counted_s"] / results[b]["truth_s"] if results[b]["truth_s"] else float("nan")
              for b in results]
    print(f"{'counted / truth':<34}" + "".join(f"{ratio:>14.3f}" for ratio in ratios))


if __name__ == "__main__":
    main()
