"""What the closes that race the server span's end cost the correlator, step by step.

A client that reads its whole answer and closes at once races the server's span end: the span
ends a fraction of a millisecond after the last byte, and the kernel may see the client's FIN
first. Each such close joins a request that DESIGN §5 calls `completed`; one that loses the race
(its span ended first) is an idle close, counted and never judged. In bench/detection.py's load
the share of racing closes moved from a fifth to two fifths between runs of the same code, and the
daemon's CPU with it; this bench fixes the share and prices it.

The load is fed to a real correlator over a real SQLite store, on a simulated clock: 100 requests a
second, a connection each, every ``--cancel-every``-th left by its client mid-answer (no engine
span, as vLLM: the engine's gauges, scraped every 0.25 s, tell its end, and its abort counter that
it was aborted), the rest answered in full with an engine span (``stop``) and closed by the
client either just after the server span's end (idle close) or just before it (the race), as
``--race`` shares. Spans arrive in the exporter's batches (``--export-s``), kernel events every
round; one round a second (``correlate.interval_seconds``), in a process of its own with the
daemon's garbage-collector settings and no other thread: the correlator's own work, not what a
busy host adds to it. Printed for each race share side by side: the rounds' CPU by step
(RoundCpu, the thread's own clock) to the last verdict, over the load's seconds (a share of a
core); how many times each racing and each cancelled request was judged (evaluated); the coverage
rows written and their pages in the store; what one racing close costs (the difference from the
first share, per race); and the CPU by minute, where growth with the run's length would show.

The verdicts are checked against what the load did: every race `completed`, every cancel
`aborted`, no other verdict. With ``--compare REV`` git revision REV's correlator runs the same
loads in its own process, its columns beside the working tree's; with ``--rounds N`` each tree runs
N times, alternating, and each step's median is printed (this VM's speed drifts by tens of percent
over minutes: the same work's CPU by minute moved 1.07-1.87% within one run).

Usage: .venv/bin/python bench/close_race.py [--seconds 300] [--race 0 0.2 0.4] [--compare REV [--rounds 3]] [--profile FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from trees import compared, use_tree

S = 1_000_000_000
MS = 1_000_000
RATE = 100  # requests a second
ANSWER_NS = 300 * MS  # a request's time on the server
RACE_BEFORE_NS = 100 * 1000  # a racing close: this long before the span's end (detection's median)
IDLE_AFTER_NS = 300 * 1000  # an idle close: this long after it
CANCEL_AFTER_NS = 120 * MS  # a cancelled request's client leaves this far into it
ABORT_NS = 2 * MS  # and its server ends the request this soon after


STEPS = ("spans", "events", "join", "judge", "write", "settle")
SCRAPE_NS = 250 * MS  # engine_metrics.interval_seconds
PORT = 8000


def scrapes(works: list[tuple[int, int]], aborts: list[int], t0: int, until: int) -> list[Any]:
    """The engine's gauges every SCRAPE_NS: requests whose work spans the moment, aborts ended by it."""
    from bisect import bisect_right

    from auditor.model import EngineLoad

    starts, ends = sorted(s for s, _ in works), sorted(e for _, e in works)
    aborts = sorted(aborts)
    return [EngineLoad(ts_ns=ts, server_port=PORT, running=bisect_right(starts, ts) - bisect_right(ends, ts),
                       waiting=0, style="ref", aborted=float(bisect_right(aborts, ts)), answered_ns=ts + MS)
            for ts in range(t0, until, SCRAPE_NS)]


def load(seconds: int, race: float, cancel_every: int, t0: int
         ) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]], list[Any], dict[str, str]]:
    """The load's spans (by export time), kernel events and scrapes (by their time), and each
    request's expected verdict."""
    from auditor.model import ConnEvent, ConnEventKind, SpanRecord, SpanRole

    spans: list[tuple[int, Any]] = []
    events: list[tuple[int, Any]] = []
    works: list[tuple[int, int]] = []
    aborts: list[int] = []
    expected: dict[str, str] = {}
    racing = 0.0
    for index in range(seconds * RATE):
        start = t0 + index * S // RATE
        port = 20000 + index % 40000
        trace = f"{index + 1:032x}"
        cancelled = index % cancel_every == cancel_every - 1
        if cancelled:
            close = start + CANCEL_AFTER_NS
            end = close + ABORT_NS
            reason = "abort"
        else:
            end = start + ANSWER_NS
            racing += race  # spread evenly: every 1/race-th completed request races
            if racing >= 1.0:
                racing -= 1.0
                close = end - RACE_BEFORE_NS
            else:
                close = end + IDLE_AFTER_NS
            reason = "stop"
        common = {"trace_id": trace, "start_ns": start, "end_ns": end, "service": "engine", "kind": "server",
                  "host": ""}
        server = SpanRecord(span_id=f"{index + 1:015x}1", parent_span_id=None, name="POST /v1/completions",
                            role=SpanRole.HTTP_SERVER, peer_addr="127.0.0.1", peer_port=port, server_port=PORT,
                            route="/v1/completions", http_status=200, request_id=f"load-{index}", **common)
        engine = SpanRecord(span_id=f"{index + 1:015x}2", parent_span_id=server.span_id, name="llm_request",
                            role=SpanRole.ENGINE, request_id=f"cmpl-load-{index}", finish_reason=reason,
                            completion_tokens=50, time_in_queue_s=0.001, time_to_first_token_s=0.01,
                            **common | {"start_ns": start + MS, "end_ns": end - MS // 5 if reason == "stop" else end})
        works.append((engine.start_ns, engine.end_ns))
        if cancelled:  # as vLLM: no engine span for an aborted request
            spans.append((end, server))
            aborts.append(end)
        else:
            spans += [(end, server), (end, engine)]
        fin = ConnEvent(ts_ns=close, kind=ConnEventKind.PEER_FIN, family=4, client_addr="127.0.0.1",
                        client_port=port, server_addr="127.0.0.1", server_port=PORT)
        events += [(close, fin), (max(close, end) + MS // 5, fin._replace(ts_ns=max(close, end) + MS // 5,
                                                                             kind=ConnEventKind.CLOSED))]
        if cancelled:
            expected[f"load-{index}"] = "aborted"
        elif close < end:
            expected[f"load-{index}"] = "completed"
    spans.sort(key=lambda item: item[0])
    events.sort(key=lambda item: item[0])
    return spans, events, scrapes(works, aborts, t0, t0 + (seconds + 80) * S), expected


TAIL_S = 75  # after the load: the late-span window and a margin, so that every verdict is final


def due(items: list[Any], upto: int, at: int, time_of: Any) -> tuple[list[Any], int]:
    """The items from index ``at`` whose time is at most ``upto``, and the index after them."""
    taken = []
    while at < len(items) and time_of(items[at]) <= upto:
        taken.append(items[at])
        at += 1
    return taken, at


def run_one(seconds: int, race: float, cancel_every: int, export_s: float, profile: str | None) -> dict[str, Any]:
    import auditor.correlate.correlator as correlator_module
    from auditor.correlate import Correlator
    from auditor.correlate.feed import SpanFeed
    from auditor.store import Store

    t0 = 1_700_000_000 * S
    spans, events, loads, expected = load(seconds, race, cancel_every, t0)
    # How often each kind of request is judged: the correlator's evaluate, counted by the load's
    # index in the trace id (a cancel every ``cancel_every``-th).
    looks: Counter[str] = Counter()
    judge = correlator_module.evaluate

    def counted(corr: Any, request: Any, now: int) -> Any:
        looks["cancel" if (int(request.key[0], 16) - 1) % cancel_every == cancel_every - 1 else "race"] += 1
        return judge(corr, request, now)

    correlator_module.evaluate = counted
    written: dict[str, str] = {}
    minutes: list[dict[str, float]] = []
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="close-race-") as tmp:
        store = Store(f"sqlite:///{tmp}/a.db")
        now = t0
        feed = SpanFeed()
        correlator = Correlator(store, host="", clock=lambda: now, feed=feed, watched_ports=lambda: {PORT})
        export_ns = int(export_s * S)
        next_export, at_span, at_event, at_load = t0 + export_ns, 0, 0, 0
        for now in range(t0 + S, t0 + (seconds + TAIL_S) * S, S):  # a round a second
            if now >= next_export:  # the exporter's batch: every span ended by now
                batch, at_span = due(spans, now, at_span, lambda item: item[0])
                if batch:
                    store.insert_spans([span for _, span in batch])
                    feed.committed([span for _, span in batch])
                next_export += export_ns
            kernel, at_event = due(events, now, at_event, lambda item: item[0])
            if kernel:
                store.insert_conn_events([event for _, event in kernel])
            scraped, at_load = due(loads, now, at_load, lambda load: load.answered_ns)
            if profiler:
                profiler.enable()
            correlator.add_engine_load(scraped)
            for verdict in correlator.tick():
                written[verdict.request_id or verdict.request_key] = verdict.verdict.value
            if profiler:
                profiler.disable()
            if (now - t0) % (60 * S) == 0:  # by minute: growth with the run's length shows
                minutes.append(correlator.cpu.seconds())
        with store.connect() as conn:
            coverage_rows = conn.scalar("SELECT count(*) FROM coverage")
            # The table's and its index's pages (SQLite's dbstat): what a month of them keeps on disk.
            coverage_bytes = conn.scalar("SELECT sum(pgsize) FROM dbstat WHERE name IN ('coverage', 'ix_coverage_ts')")
        store.close()
    correlator_module.evaluate = judge  # the next share counts its own
    if profiler:
        profiler.dump_stats(f"{profile}.{race}")
    wrong = {rid: (written.get(rid), want) for rid, want in expected.items() if written.get(rid) != want}
    extra = sorted(set(written) - set(expected))
    return {"race": race, "coverage_rows": coverage_rows, "coverage_bytes": coverage_bytes,
            "steps": correlator.cpu.seconds(),
            "verdicts": dict(Counter(written.values())), "races": sum(v == "completed" for v in expected.values()),
            "looks": {kind: looks[kind] / max(1, sum(v == want for v in expected.values()))
                      for kind, want in (("race", "completed"), ("cancel", "aborted"))},
            "minutes": minutes, "wrong": len(wrong), "wrong_example": sorted(wrong.items())[:3],
            "extra": len(extra), "extra_example": extra[:3]}


def child(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--tree", str(tree), "--seconds", str(args.seconds),
               "--cancel-every", str(args.cancel_every), "--export-s", str(args.export_s), "--json",
               "--race", *map(str, args.race)]
    if args.profile:
        command += ["--profile", f"{args.profile}.{tree.name}"]
    out = subprocess.run(command, check=True, capture_output=True, text=True)
    return list(json.loads(out.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=300, help="seconds of load (simulated)")
    parser.add_argument("--race", type=float, nargs="+", default=[0.0, 0.2, 0.4],
                        help="shares of completed requests whose client's close races the span's end")
    parser.add_argument("--cancel-every", type=int, default=10)
    parser.add_argument("--export-s", type=float, default=5.0, help="the span exporter's period")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's correlator")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree, alternating; medians printed")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the rounds into FILE.<tree>.<share>")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seconds < 10 or args.rounds < 1 or args.cancel_every < 2 or args.export_s <= 0 or any(not 0 <= r <= 1 for r in args.race):
        parser.error("--seconds at least 10, --rounds at least 1, --cancel-every at least 2, --export-s above 0, --race shares in [0, 1]")
    use_tree(args.tree)
    if args.json:
        import gc

        from auditor.cli.run import GC_FIRST_GENERATION

        gc.freeze()  # as `auditor run` does
        gc.set_threshold(GC_FIRST_GENERATION, 10, 10)
        print(json.dumps([run_one(args.seconds, race, args.cancel_every, args.export_s, args.profile)
                          for race in args.race]))
        return 0
    trees, work = compared(args.compare, "close-race-")
    print(f"{args.seconds} s of load at {RATE} req/s, a connection each, every {args.cancel_every}th cancelled; "
          f"spans exported every {args.export_s:g} s; CPU of the correlator's rounds (its thread's clock)", flush=True)
    runs: dict[str, list[list[dict[str, Any]]]] = {label: [] for label in trees}
    failed = False
    for round_ in range(args.rounds):  # the trees alternate, each round in the other order: the host's drift evens out
        for label, tree in (list(trees.items()) if round_ % 2 == 0 else list(trees.items())[::-1]):
            runs[label].append(child(tree, args))
            for r in runs[label][-1]:
                if r["wrong"] or r["extra"]:
                    failed = True
                    print(f"  {label}, race {r['race']:g}: {r['wrong']} verdicts other than the load's "
                          f"(e.g. {r['wrong_example']}), {r['extra']} verdicts of no racing or cancelled request "
                          f"(e.g. {r['extra_example']})")
    # Each step's median over the rounds, per race share; the first round's minutes.
    results = {label: [{**rounds_[0][index], "steps": {step: statistics.median(r[index]["steps"][step] for r in rounds_)
                                                       for step in STEPS},
                        "totals": [sum(r[index]["steps"][step] for step in STEPS) for r in rounds_]}
                       for index in range(len(args.race))] for label, rounds_ in runs.items()}

    def share(seconds: float) -> float:  # CPU-seconds (to the last verdict) per second of load, in %
        return seconds / args.seconds * 100

    print("% of a core: the rounds' CPU, to the last verdict, over the load's seconds "
          "(all steps: spans / join / judge / write / settle)")
    print(f"  {'race share':>10} {'races/s':>8}" + "".join(f"{label[:30]:>32}" for label in trees))
    for index, race in enumerate(args.race):
        first = results[next(iter(trees))][index]
        line = f"  {race:>10g} {first['races'] / args.seconds:>8.1f}"
        for label in trees:
            steps = results[label][index]["steps"]
            cells = "/".join(f"{share(steps[step]):.2f}" for step in ("spans", "join", "judge", "write", "settle"))
            line += f"{share(sum(steps[step] for step in STEPS)):>8.2f} ({cells})".rjust(32)
        print(line)
    print("  coverage rows written (KiB in the store), by race share: " + "; ".join(
        f"{label[:12]} " + ", ".join(f"{row['coverage_rows']:,} ({row['coverage_bytes'] / 1024:,.0f})"
                                     for row in results[label]) for label in trees))
    print("  evaluations a judged request (races, cancels), by race share: " + "; ".join(
        f"{label[:12]} " + ", ".join(f"{row['looks']['race']:.2f}/{row['looks']['cancel']:.2f}" for row in results[label])
        for label in trees))
    if args.rounds > 1:
        print("  the rounds' totals, in the order run: " + "; ".join(
            f"{label[:12]} " + " | ".join(",".join(f"{share(t):.2f}" for t in row["totals"]) for row in results[label])
            for label in trees))
    print("us of the correlator's CPU a racing close, against the first share (join / judge / write / settle; all steps):")
    for index, race in enumerate(args.race[1:], start=1):
        line = f"  {race:>10g} {'':>8}"
        for label in trees:
            base, row = results[label][0], results[label][index]
            more = row["races"] - base["races"]
            if more <= 0:
                line += f"{'-':>32}"
                continue
            per = {step: (row["steps"][step] - base["steps"][step]) / more * 1e6 for step in STEPS}
            cells = "/".join(f"{per[step]:.0f}" for step in ("join", "judge", "write", "settle"))
            line += f"{cells}; {sum(per.values()):.0f}".rjust(32)
        print(line)
    print(f"% of a core by minute (the load's {args.seconds // 60}, then the last verdicts'), race share {args.race[-1]:g}:")
    for label in trees:
        minutes = [dict.fromkeys(STEPS, 0.0), *results[label][-1]["minutes"]]
        totals = [sum(minute[step] for step in STEPS) for minute in minutes]
        print(f"  {label[:30]:>30}: " + " ".join(f"{(b - a) / 60 * 100:.2f}" for a, b in itertools.pairwise(totals)))
    if work is not None:
        work.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
