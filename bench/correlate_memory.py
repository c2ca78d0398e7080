"""What the correlator holds per request, by allocation site (tracemalloc), after N requests.

Requests arrive as the daemon sees them at 100 a second: each second, 100 requests' server and
engine spans and their clients' closes (FIN then the socket's close) go into a SQLite store, and
one correlation round reads them. As under bench/detection.py's load, most clients close after
the answer (an idle close), every tenth leaves mid-request and every second one closes as its
answer ends, before the server span does (a verdict: completed): both kinds are settled requests,
which the correlator remembers for the horizon. With the default 60 s late-span window a
request's spans and events stay about 90 s (9,000 requests); what is kept for the 15-minute
horizon grows past that, so compare N = 9,000 with N = 30,000.

With ``--live`` each request also sends the live notices a server sends with auditor.live (its
server span's start and end, and its engine work's), decoded from their datagrams as the daemon's
receiver does, each arriving in the round of its second.

With ``--user-agents K`` each server span carries the attributes the ASGI instrumentation sets,
its User-Agent one of K (0: no attributes; a number as large as the requests: each its own, as
no real traffic has them): what holding the client's User-Agent for the verdict costs.

Usage: .venv/bin/python bench/correlate_memory.py [--requests 9000 30000] [--top 12] [--live]
       [--user-agents 0 1 30000]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from correlate import S, spans_for  # the same requests bench/correlate.py holds

from auditor.correlate import Correlator
from auditor.model import ConnEvent, ConnEventKind, LiveEvent
from auditor.store import Store
from collectors.live import parse_datagram


def notices(index: int, t0: int) -> list[LiveEvent]:
    """The live notices of request ``index``'s spans (bench/correlate.spans_for), as datagrams read."""
    start = t0 + index * S // 100
    end = start + S // 2
    server = {"v": 1, "trace": f"{index:032x}", "span": f"{index:015x}1", "name": "POST /v1/completions",
              "kind": "server", "peer": "127.0.0.1", "peer_port": 10_000 + index % 50_000, "port": 8000,
              "pid": 4242, "service": "engine", "engine": False}
    work = server | {"span": f"{index:015x}3", "name": "llm_request", "kind": "internal", "peer": None,
                     "peer_port": None, "port": None, "engine": True}
    datagrams = [server | {"ev": "start", "ts": start}, work | {"ev": "start", "ts": start + S // 100},
                 work | {"ev": "end", "ts": end - S // 100}, server | {"ev": "end", "ts": end}]
    events = [parse_datagram(json.dumps(d).encode()) for d in datagrams]
    return [event for event in events if event is not None]


def closes(index: int, t0: int) -> list[ConnEvent]:
    at = t0 + index * S // 100 + S // 2 + 1_000  # just after the answer (spans_for: half a second)
    if index % 10 == 0:
        at -= S // 4  # mid-request
    elif index % 2:
        at -= 2_000  # as the answer ends, before the server span does
    connection = {"family": 4, "client_addr": "127.0.0.1", "client_port": 10_000 + index % 50_000,
                  "server_addr": "127.0.0.1", "server_port": 8000, "cookie": index}
    return [ConnEvent(ts_ns=at, kind=ConnEventKind.PEER_FIN, **connection),
            ConnEvent(ts_ns=at + 1_000, kind=ConnEventKind.CLOSED, **connection)]


def user_agent(index: int, kinds: int) -> str | None:
    """Request ``index``'s User-Agent, one of ``kinds`` (a browser's, about 110 characters)."""
    return None if not kinds else (f"Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
                                   f"Chrome/{index % kinds}.0.0.0 Safari/537.36")


def arrive(store: Store, t0: int, first: int, requests: int, agents: int = 0) -> int:
    """Requests ``first`` to ``first + 99`` (fewer past ``requests``): their spans and closes are
    stored; returns the end of their second, when a correlation round reads them."""
    batch = range(first, min(requests, first + 100))
    store.insert_spans([span for i in batch for span in spans_for(i, t0, False, user_agent(i, agents))])
    store.insert_conn_events([event for i in batch for event in closes(i, t0)])
    return t0 + (first + 100) * S // 100 + S // 2


def held(requests: int, top: int, live: bool = False, agents: int = 0) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/memory.db")
        t0 = time.time_ns() - (requests // 100 + 10) * S
        clock = [t0]
        correlator = Correlator(store, host="", late_span_seconds=60, clock=lambda: clock[0])
        gc.collect()
        tracemalloc.start(1)
        before = tracemalloc.take_snapshot()
        for first in range(0, requests, 100):
            clock[0] = arrive(store, t0, first, requests, agents)
            correlator.tick([e for i in range(first, min(requests, first + 100)) for e in notices(i, t0)]
                            if live else None)
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        stats = after.compare_to(before, "lineno")
        total = sum(stat.size_diff for stat in stats)
        kinds = f", {agents:,} User-Agents" if agents else ", no span attributes"
        print(f"{requests:,} requests{' with live notices' if live else ''}{kinds}: {total / 2**20:.1f} MiB held, "
              f"{total / requests:,.0f} bytes a request")
        for stat in stats[:top]:
            frame = stat.traceback[0]
            where = frame.filename.split("/site-packages/")[-1].replace(str(Path.cwd()) + "/", "")
            print(f"  {stat.size_diff / requests:7.0f} B {stat.count_diff / requests:6.2f} objects a request  "
                  f"{where}:{frame.lineno}")
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[9000, 30000])
    parser.add_argument("--top", type=int, default=12, help="allocation sites shown")
    parser.add_argument("--live", action="store_true", help="each request also sends live notices")
    parser.add_argument("--user-agents", type=int, nargs="+", default=[0],
                        help="server spans with attributes and one of this many User-Agents (0: no attributes)")
    args = parser.parse_args()
    for requests in args.requests:
        for agents in args.user_agents:
            held(requests, args.top, args.live, agents)


if __name__ == "__main__":
    main()
