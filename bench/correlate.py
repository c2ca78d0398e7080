"""Correlation cost against how much the daemon holds: one round's time, and one zombie's
evaluation, with N recent requests in memory (the 15-minute horizon at 100 req/s is ~90,000).

Usage: .venv/bin/python bench/correlate.py [--held 1000 10000 90000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.correlate import Correlator
from auditor.model import ConnEvent, ConnEventKind, SpanRecord, SpanRole
from auditor.store import Store

S = 1_000_000_000


def spans_for(index: int, t0: int, zombie: bool, user_agent: str | None = None) -> list[SpanRecord]:
    """Request ``index``'s server and engine spans; ``user_agent``: its server span's attributes as
    the ASGI instrumentation sets them, with that User-Agent (None: no attributes)."""
    start = t0 + index * S // 100  # 100 requests per second
    end = start + (4 * S if zombie else S // 2)
    trace = f"{index:032x}"
    common = {"trace_id": trace, "parent_span_id": None, "start_ns": start, "end_ns": end, "service": "engine",
              "kind": "server"}
    return [SpanRecord(span_id=f"{index:015x}1", name="POST /v1/completions", role=SpanRole.HTTP_SERVER,
                       peer_addr="127.0.0.1", peer_port=10000 + index % 50000, server_port=8000, route="/v1/completions",
                       http_status=200, attributes={} if user_agent is None else {
                           "http.method": "POST", "http.scheme": "http", "http.flavor": "1.1", "http.host": "127.0.0.1:8000",
                           "http.target": "/v1/completions", "user_agent.original": user_agent}, **common),
            SpanRecord(span_id=f"{index:015x}2", name="llm_request", role=SpanRole.ENGINE, request_id=f"cmpl-{index}",
                       finish_reason="length", completion_tokens=100, time_in_queue_s=0.01, time_to_first_token_s=0.1,
                       **common)]


def run(held: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/a.db")
        t0 = time.time_ns() - (held // 100 + 10) * S
        clock = [t0]
        correlator = Correlator(store, host="", late_span_seconds=60, clock=lambda: clock[0])
        started = time.perf_counter()
        # The held traffic arrives as it would live: a second's worth (100 requests) per round.
        for first in range(0, held, 100):
            store.insert_spans([s for i in range(first, min(held, first + 100)) for s in spans_for(i, t0, False)])
            clock[0] = t0 + (first + 100) * S // 100 + S // 2
            correlator.tick()
        load_s = time.perf_counter() - started
        now = clock[0] = t0 + (held // 100 + 10) * S
        # Ten zombies arrive: their spans and disconnects, then one round judges them.
        zombies = [held + i for i in range(10)]
        store.insert_spans([s for i in zombies for s in spans_for(i, now - 5 * S - held * S // 100, True)])
        store.insert_conn_events([ConnEvent(ts_ns=now - 5 * S + (i - held) * S // 100 + S // 2, kind=ConnEventKind.PEER_FIN,
                                            family=4, client_addr="127.0.0.1", client_port=10000 + i % 50000,
                                            server_addr="127.0.0.1", server_port=8000) for i in zombies])
        started = time.perf_counter()
        written = correlator.tick()
        round_s = time.perf_counter() - started
        assert [v.verdict.value for v in written] == ["zombie"] * 10, written
        started = time.perf_counter()
        correlator.tick()  # a quiet round
        quiet_s = time.perf_counter() - started
        store.close()
    return load_s, round_s, quiet_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", default=[1000, 10000, 90000])
    args = parser.parse_args()
    print(f"{'requests held':>14}{'feeding them s':>16}{'round with 10 zombies s':>25}{'quiet round s':>15}")
    for held in args.held:
        load_s, round_s, quiet_s = run(held)
        print(f"{held:>14,}{load_s:>16.3f}{round_s:>25.4f}{quiet_s:>15.4f}")
    print("feeding: 100 requests per round, one round per simulated second (the daemon's pace at 100 req/s)")


if __name__ == "__main__":
    main()
