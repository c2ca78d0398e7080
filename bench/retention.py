"""Disk per request, and how long one retention batch holds the SQLite write lock.

Writes N realistic requests through the Store's own batch inserts into a fresh SQLite file: per
request an HTTP server span and a vLLM ``llm_request`` span with the attributes those carry, the
peer FIN and the close of its connection (no keep-alive: the most events a request can cost), and
a verdict for the share of requests whose client left. Utilization samples do not grow with
requests but with time, so they are measured apart, per sampled series and hour. Then it prunes
everything with the daemon's retention and prints the slowest batch.

    python bench/retention.py [--requests 20000] [--disconnect-share 0.05] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

# This script's own tree first (not the one the virtualenv was installed from), unless
# PYTHONPATH names one.
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auditor.model import (
    ConnEvent,
    ConnEventKind,
    RequestVerdict,
    SpanRecord,
    SpanRole,
    UtilSample,
    Verdict,
)
from auditor.store import Store
from auditor.store.retention import FINDING_TABLES, RAW_TABLES, RetentionPolicy, prune_table

HOST = "gpu-node-17.example.internal"
S = 1_000_000_000


def request_rows(i: int, t_ns: int) -> tuple[list[SpanRecord], list[ConnEvent]]:
    trace, http_id, engine_id = f"{0x9E3779B97F4A7C15 * (i + 1) & (2**128 - 1):032x}", f"{i + 1:016x}", f"{i + 2**40:016x}"
    request_id = f"7f3c9a2e-41d8-4b6a-9c1f-{i:012x}"
    port = 30000 + i % 30000
    http = SpanRecord(trace, http_id, None, "POST /v1/chat/completions", "server", t_ns, t_ns + 4 * S,
                      service="vllm", host=HOST, status="unset", role=SpanRole.HTTP_SERVER, peer_addr="10.12.4.31",
                      peer_port=port, server_port=8000, request_id=request_id, route="/v1/chat/completions",
                      model="meta-llama/Llama-3.1-8B-Instruct", http_status=200, max_tokens=512, process_pid=4242,
                      attributes={"http.request.method": "POST", "url.path": "/v1/chat/completions",
                                  "url.scheme": "http", "server.address": "10.12.4.9", "server.port": 8000,
                                  "client.address": "10.12.4.31", "client.port": port,
                                  "network.protocol.version": "1.1", "http.route": "/v1/chat/completions",
                                  "user_agent.original": "OpenAI/Python 1.51.0",
                                  "http.request.header.x_request_id": [request_id],
                                  "http.response.status_code": 200})
    engine = SpanRecord(trace, engine_id, http_id, "llm_request", "server", t_ns + 2 * S // 100, t_ns + 4 * S - S // 100,
                        service="vllm", host=HOST, role=SpanRole.ENGINE, request_id=f"chatcmpl-{request_id}",
                        model="meta-llama/Llama-3.1-8B-Instruct", finish_reason="stop", prompt_tokens=812,
                        completion_tokens=311, max_tokens=512, time_in_queue_s=0.0123, time_to_first_token_s=0.0871,
                        process_pid=4242,
                        attributes={"gen_ai.request.id": f"chatcmpl-{request_id}",
                                    "gen_ai.response.model": "meta-llama/Llama-3.1-8B-Instruct",
                                    "gen_ai.request.max_tokens": 512, "gen_ai.request.temperature": 0.7,
                                    "gen_ai.request.top_p": 0.95, "gen_ai.request.n": 1,
                                    "gen_ai.usage.prompt_tokens": 812, "gen_ai.usage.completion_tokens": 311,
                                    "gen_ai.response.finish_reasons": ["stop"],
                                    "gen_ai.latency.time_in_queue": 0.0123,
                                    "gen_ai.latency.time_to_first_token": 0.0871,
                                    "gen_ai.latency.e2e": 3.9712, "gen_ai.latency.time_in_scheduler": 0.0044,
                                    "gen_ai.latency.time_in_model_forward": 3.6120,
                                    "gen_ai.latency.time_in_model_execute": 3.7015})
    events = [ConnEvent(t_ns + 4 * S + S // 1000 * k, kind, 4, "10.12.4.31", port, "10.12.4.9", 8000,
                        cookie=i * 2 + k, host=HOST) for k, kind in enumerate((ConnEventKind.PEER_FIN, ConnEventKind.CLOSED))]
    return [http, engine], events


def verdict_row(i: int, t_ns: int) -> RequestVerdict:
    span = request_rows(i, t_ns)[0][0]
    return RequestVerdict(f"{HOST}/{span.trace_id}/{span.span_id}", HOST, Verdict.ZOMBIE, t_ns + S, "fin", t_ns,
                          t_ns + 4 * S, 3.0, trace_id=span.trace_id, request_id=span.request_id, service="vllm",
                          route=span.route, model=span.model, client_addr="10.12.4.31", client_port=span.peer_port,
                          server_port=8000, max_tokens=512, tokens_after_disconnect=240, tokens_exact=True,
                          wasted_gpu_seconds=2.7, details={"provisional": False, "engine_span": True})


def db_bytes(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def measure(requests: int, disconnect_share: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "auditor.db"
        store = Store(f"sqlite:///{path}")
        empty = db_bytes(path)
        t0 = time.time_ns() - 3600 * S
        for start in range(0, requests, 512):
            spans, events = [], []
            for i in range(start, min(start + 512, requests)):
                s, e = request_rows(i, t0 + i * S // 100)
                spans += s
                events += e
            store.insert_spans(spans)
            store.insert_conn_events(events)
        every = max(1, round(1 / disconnect_share)) if disconnect_share else 0
        verdicts = [verdict_row(i, t0 + i * S // 100) for i in range(0, requests, every)] if every else []
        for start in range(0, len(verdicts), 500):
            store.upsert_verdicts(verdicts[start:start + 500])
        with_requests = db_bytes(path)
        samples = 36_000  # one series (a GPU or a process) at 100 ms for an hour
        for start in range(0, samples, 5000):
            store.insert_samples([UtilSample(t0 + k * S // 10, "nvml", host=HOST, gpu_index=0, util_percent=97.0,
                                             memory_util_percent=41.0, memory_bytes=70_000_000_000, power_watts=612.5,
                                             interval_s=0.1) for k in range(start, min(start + 5000, samples))])
        with_samples = db_bytes(path)
        slowest, batches = 0.0, 0
        for table, column in RAW_TABLES + FINDING_TABLES:
            while True:
                started = time.perf_counter()
                n = prune_table(store, table, column, host=HOST, older_than_ns=time.time_ns() + S, batch_rows=5000,
                                pause=lambda: True)
                slowest = max(slowest, time.perf_counter() - started)
                batches += 1
                if n < 5000:
                    break
        store.close()
    per_request = (with_requests - empty) / requests
    return {"requests": requests, "disconnect_share": disconnect_share, "bytes_per_request": round(per_request),
            "mb_per_million_requests": round(per_request * 1e6 / 2**20),
            "mb_per_series_hour_of_samples": round((with_samples - with_requests) / 2**20, 1),
            "retention_batches": batches, "slowest_batch_ms": round(slowest * 1000, 1),
            "batch_rows": RetentionPolicy().batch_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--disconnect-share", type=float, default=0.05)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.requests, args.disconnect_share)
    if args.json:
        print(json.dumps(result))
        return
    print(f"SQLite, {result['requests']} requests, {result['disconnect_share']:.0%} with a verdict:")
    print(f"  {result['bytes_per_request']} bytes per request = {result['mb_per_million_requests']} MiB per million "
          "requests (2 spans, 2 kernel events, verdicts)")
    print(f"  utilization samples: {result['mb_per_series_hour_of_samples']} MiB per series-hour at 100 ms")
    print(f"  retention: {result['retention_batches']} batches of {result['batch_rows']} rows, slowest "
          f"{result['slowest_batch_ms']} ms (the longest ingest waits on the write lock)")


if __name__ == "__main__":
    main()
