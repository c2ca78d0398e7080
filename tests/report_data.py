"""(No tests here.) A small, realistic store for the report tests, filled only through the Store APIs.

Two hosts, two routes, two models; HTTP server spans (the requests), engine spans (never counted
as requests), one verdict of every kind, coverage counts, and whole-GPU and per-process samples.
Every figure the tests assert is derived by hand from the rows below.
"""

from __future__ import annotations

import datetime as dt

from auditor.model import (
    CoverageKind,
    Phase,
    RequestVerdict,
    SpanRecord,
    SpanRole,
    UtilSample,
    Verdict,
)
from auditor.store import Store

S = 1_000_000_000
T0 = 1_795_320_000 * S  # 2026-11-22T04:00:00Z
SINCE = "2026-11-22T04:00:00Z"
UNTIL = "2026-11-22T05:00:00Z"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LLAMA, QWEN = "llama-3-8b", "qwen-2-7b"
EVIL_ID = "<script>alert(1)</script>"
SDK_AGENT = "OpenAI/Python 1.54.0"
BROWSER = "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Safari/537.36"
UNCOSTED = "2 GPUs here, and NVML lists neither process 4242 nor a process it started on any"


def at(seconds: float) -> int:
    return T0 + int(seconds * S)


def trace(n: int) -> str:
    return f"{n:032x}"


def _http(n: int, start_s: float, end_s: float, *, host: str = "gpu-a", route: str = CHAT,
          model: str = LLAMA, request_id: str | None = None,
          user_agent: tuple[str, str] | None = ("user_agent.original", SDK_AGENT)) -> SpanRecord:
    return SpanRecord(
        trace_id=trace(n), span_id=f"{n:016x}", parent_span_id=None, name=f"POST {route}",
        kind="server", start_ns=at(start_s), end_ns=at(end_s), service="vllm", host=host,
        role=SpanRole.HTTP_SERVER, peer_addr="10.0.0.7", peer_port=40000 + n, server_port=8000,
        request_id=request_id or f"req-{n}", route=route, model=model, http_status=200,
        attributes=dict([user_agent]) if user_agent else {})


def _engine(n: int, start_s: float, end_s: float, host: str = "gpu-a") -> SpanRecord:
    return SpanRecord(
        trace_id=trace(n), span_id=f"{n + 1000:016x}", parent_span_id=f"{n:016x}", name="llm_request",
        kind="internal", start_ns=at(start_s), end_ns=at(end_s), service="vllm", host=host,
        role=SpanRole.ENGINE, request_id=f"chatcmpl-req-{n}", model=LLAMA, process_pid=4242)


def _verdict(n: int, verdict: Verdict, *, start_s: float, disconnect_s: float, end_s: float | None,
             lag: float | None, kind: str = "fin", phase: Phase = Phase.DECODE, host: str = "gpu-a",
             route: str = CHAT, model: str = LLAMA, max_tokens: int | None = 512,
             tokens: int | None = 0, exact: bool = True, gpu: float = 0.0,
             request_id: str | None = None, details: dict[str, str] | None = None,
             user_agent: str | None = SDK_AGENT) -> RequestVerdict:
    return RequestVerdict(
        request_key=f"{host}/{trace(n)}/{n:016x}", host=host, verdict=verdict,
        disconnect_at_ns=at(disconnect_s), disconnect_kind=kind, request_start_ns=at(start_s),
        work_end_ns=at(end_s) if end_s is not None else None, lag_seconds=lag, phase=phase,
        trace_id=trace(n), request_id=request_id or f"req-{n}", service="vllm", route=route,
        model=model, client_addr="10.0.0.7", client_port=40000 + n, user_agent=user_agent, server_port=8000,
        max_tokens=max_tokens, tokens_after_disconnect=tokens, tokens_exact=exact,
        wasted_gpu_seconds=gpu, details=details or {})


def fill(store: Store) -> None:
    """Requests 1-10 on gpu-a and 11-12 on gpu-b in the window; 13 an hour before it."""
    spans = [_http(n, 60.0 * n, 60.0 * n + 2) for n in range(1, 5)]  # 4 plain chat requests
    spans += [_http(n, 60.0 * n, 60.0 * n + 3, route=COMPLETIONS, model=QWEN) for n in range(5, 7)]
    spans += [
        _http(7, 700, 702.0),  # completed at disconnect
        _http(8, 800, 801.0, route=COMPLETIONS, model=QWEN, user_agent=("http.user_agent", BROWSER)),  # aborted
        _http(9, 900, 902.0, request_id=EVIL_ID),  # zombie, 12.5 s
        _http(10, 1000, 1001.0),  # zombie, 3 s, no max_tokens
        _http(11, 1100, 1101.0, host="gpu-b", user_agent=None),  # in-flight zombie on the other host
        _http(12, 1200, 1202.0, host="gpu-b"),
        _http(13, -3600, -3598.0),  # before the window
    ]
    spans += [_engine(n, 60.0 * n + 0.1, 60.0 * n + 1.9) for n in range(1, 5)]
    store.insert_spans(spans)
    store.upsert_verdicts([
        _verdict(7, Verdict.COMPLETED, start_s=700, disconnect_s=702.0, end_s=702.0, lag=0.0,
                 details={"cost_unmeasured": UNCOSTED}),  # not a zombie: not counted as one not costed
        _verdict(8, Verdict.ABORTED, start_s=800, disconnect_s=800.5, end_s=800.7, lag=0.2,
                 kind="rst", phase=Phase.PREFILL, route=COMPLETIONS, model=QWEN, tokens=0, user_agent=BROWSER),
        _verdict(9, Verdict.ZOMBIE, start_s=900, disconnect_s=901.0, end_s=913.5, lag=12.5,
                 tokens=900, exact=True, gpu=10.0, request_id=EVIL_ID),
        _verdict(10, Verdict.ZOMBIE, start_s=1000, disconnect_s=1000.5, end_s=1003.5, lag=3.0,
                 max_tokens=None, tokens=200, exact=False, gpu=2.5,
                 details={"cost_unmeasured": UNCOSTED, "lag_at_least_s": 1.25,  # later leavers' rise untold
                          "evidence": "engine_metrics"}),
        _verdict(11, Verdict.INFLIGHT_ZOMBIE, start_s=1100, disconnect_s=1100.2, end_s=None, lag=30.0,
                 kind="rst", phase=Phase.QUEUED, host="gpu-b", tokens=None, gpu=1.5, user_agent=None),
        _verdict(13, Verdict.ZOMBIE, start_s=-3600, disconnect_s=-3599.5, end_s=-3500.0, lag=99.5,
                 details={"cost_unmeasured": UNCOSTED}),
    ])
    store.add_coverage(CoverageKind.IDLE_CLOSE, 3, host="gpu-a", ts_ns=at(100))
    store.add_coverage(CoverageKind.IDLE_CLOSE, 2, host="gpu-b", ts_ns=at(200))
    store.add_coverage(CoverageKind.UNJOINED_DISCONNECT, 1, host="gpu-a", ts_ns=at(300))
    store.add_coverage(CoverageKind.UNJOINED_SPAN, 4, host="gpu-a", ts_ns=at(400))
    store.add_coverage(CoverageKind.LOST_KERNEL_EVENTS, 7, host="gpu-a", ts_ns=at(500))
    store.add_coverage(CoverageKind.PROXY_REWRITTEN_PEER, 1, host="gpu-b", ts_ns=at(600))
    store.add_coverage(CoverageKind.PEERLESS_SPAN_JOINED, 1, host="gpu-a", ts_ns=at(700))
    store.add_coverage(CoverageKind.LOST_KERNEL_EVENTS, 100, host="gpu-a", ts_ns=at(-10))  # outside
    # gpu-a has two GPUs sampled every 10 s through the hour at 80%; gpu-b has none (a CPU host).
    store.insert_samples(
        UtilSample(ts_ns=at(t), source="nvml", host="gpu-a", gpu_index=gpu, util_percent=80.0,
                   interval_s=10.0)
        for t in range(0, 3600, 10) for gpu in (0, 1))
    store.insert_samples([  # per-process samples must not count as whole GPUs
        UtilSample(ts_ns=at(5), source="nvml", host="gpu-a", gpu_index=0, pid=4242, util_percent=75.0,
                   interval_s=10.0),
        UtilSample(ts_ns=at(5), source="procfs", host="gpu-b", pid=99, util_percent=150.0, interval_s=1.0),
    ])


def fill_timeouts(store: Store, count: int = 10, after_s: float = 60.0, *, first: int = 100,
                  from_s: float = 1500.0, host: str = "gpu-a") -> None:
    """``count`` requests from ``from_s`` on, 20 s apart, whose clients left ``after_s`` (and a few
    ms) after their start, every other one a zombie."""
    spans, verdicts = [], []
    for k in range(count):
        n, start = first + k, from_s + 20.0 * k
        left = start + after_s + 0.001 * (k % 7)
        spans.append(_http(n, start, left + 5.0, host=host))
        zombie = k % 2 == 0
        verdicts.append(_verdict(n, Verdict.ZOMBIE if zombie else Verdict.ABORTED, start_s=start,
                                 disconnect_s=left, end_s=left + (5.0 if zombie else 0.2),
                                 lag=5.0 if zombie else 0.2, gpu=1.0 if zombie else 0.0, host=host))
    store.insert_spans(spans)
    store.upsert_verdicts(verdicts)


def since_dt() -> dt.datetime:
    return dt.datetime.fromisoformat(SINCE.replace("Z", "+00:00"))
