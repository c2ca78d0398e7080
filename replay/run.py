"""A replay run: captured requests become load plans with injected cancellations, and the
auditor's verdicts for the cancelled ones become the run's result, kept in the capture file.

Cancellation follows AIPerf (see ``replay.client``): ``rate`` of the requests, chosen by seed, leave
``cancel_after_s`` after the request was fully written. ``as_captured`` replays the disconnects the
capture saw instead, each after the delay and with the close (FIN or RST) it had then.
"""

from __future__ import annotations

import http.client
import re
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select

from auditor.model import ZOMBIE_VERDICTS, Verdict
from auditor.store import ReplayResultRow, ReplayRunRow, Store, VerdictRow
from replay.capture import Capture, CaptureError, sample_cancels
from replay.client import RequestOutcome, RequestPlan

ZOMBIES = frozenset(v.value for v in ZOMBIE_VERDICTS)
SCHEMA = "auditor.replay/v1"


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    cancel_rate: float = 0.0
    cancel_after_s: float = 0.5
    as_captured: bool = False
    close_with: str | None = None  # "fin", "rst", or None: as captured (FIN when not captured)
    speed: float = 1.0  # 0: as fast as concurrency allows
    concurrency: int = 16
    limit: int | None = None
    seed: int = 7
    model: str | None = None  # replaces the captured model (the staging engine serves another name)


def plan_replay(capture: Capture, options: ReplayOptions, *, tag: str) -> list[RequestPlan]:
    requests = capture.requests[: options.limit] if options.limit is not None else capture.requests
    injected = sample_cancels(len(requests), options.cancel_rate, options.seed)
    plans = []
    for index, (request, inject) in enumerate(zip(requests, injected, strict=True)):
        delay: float | None = None
        close = options.close_with or "fin"
        if options.as_captured and request.disconnect_after_s is not None:
            delay = request.disconnect_after_s
            close = options.close_with or request.disconnect_kind or "fin"
        elif inject:
            delay = options.cancel_after_s
        body = dict(request.body)
        if options.model:
            body["model"] = options.model
        plans.append(RequestPlan(
            request_id=f"{tag}-{index:06d}", trace_id=secrets.token_hex(16), body=body, path=request.path,
            cancel_after_s=delay, close_with=close,
            start_at_s=request.offset_s / options.speed if options.speed > 0 else 0.0))
    return plans


@dataclass(slots=True)
class ReplaySummary:
    run_id: int = 0
    capture_id: int = 0
    target: str = ""
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)  # for the cancelled requests
    unjudged: int = 0  # cancelled, yet no verdict: the disconnect or the span never reached the auditor
    provisional: int = 0  # a verdict that could still turn into a zombie when the wait ran out
    zombies: int = 0
    zombie_seconds: float = 0.0
    lag_p50_s: float | None = None
    lag_max_s: float | None = None
    wasted_tokens: int = 0
    baseline_run_id: int | None = None
    baseline_zombies: int | None = None
    worst: list[dict[str, Any]] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}


# Gauges of requests an engine is running or holding, by server: the sum is 0 when it is idle.
BUSY_GAUGES = re.compile(r"^(vllm:num_requests_(?:running|waiting)|sglang:num_(?:running|queue)_reqs|"
                         r"tgi_(?:queue_size|batch_current_size)|ref_engine_num_requests_(?:running|waiting))"
                         r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


class EngineLoad:
    """Requests the engine is running or queueing, read from its Prometheus /metrics (vLLM,
    SGLang, TGI, the reference engine) over one kept-alive connection: the probe watches this
    port, and a connection per poll would be a stream of closes to account for."""

    def __init__(self, host: str, port: int, timeout_s: float = 2.0) -> None:
        self._connection = http.client.HTTPConnection(host, port, timeout=timeout_s)

    def busy(self) -> float | None:
        """The sum of the known gauges; None when the engine exposes none or cannot be read."""
        for _attempt in range(2):  # the server may have closed the kept-alive connection
            try:
                self._connection.request("GET", "/metrics")
                response = self._connection.getresponse()
                text = response.read(4 << 20).decode("utf-8", "replace")
                break
            except (OSError, http.client.HTTPException):
                self._connection.close()
        else:
            return None
        if response.status != 200:
            return None
        values = [float(m.group(2)) for m in BUSY_GAUGES.finditer(text)]
        return sum(values) if values else None

    def close(self) -> None:
        self._connection.close()


def verdicts_for(store: Store, plans: list[RequestPlan]) -> dict[str, VerdictRow]:
    """The auditor's verdict for each plan, by the trace id the client sent."""
    traces = {plan.trace_id for plan in plans}
    found: dict[str, VerdictRow] = {}
    with store.session() as session:
        ordered = list(traces)
        for i in range(0, len(ordered), 500):
            for row in session.scalars(select(VerdictRow).where(VerdictRow.trace_id.in_(ordered[i:i + 500]))):
                found[row.trace_id or ""] = row
    return found


def settled(store: Store, cancelled: list[RequestPlan]) -> tuple[int, int]:
    """(cancelled requests with a verdict, of them not final yet): an in-flight zombie, or a
    verdict still waiting for a late engine span (an abort without one is provisional until the
    correlator's late-span window has passed, because a detached engine reports only at its end)."""
    rows = verdicts_for(store, cancelled)
    pending = sum(1 for r in rows.values()
                  if r.verdict == Verdict.INFLIGHT_ZOMBIE.value or (r.details or {}).get("provisional"))
    return len(rows), pending


def record_run(store: Store, capture: Capture, target: str, options: ReplayOptions, started_ns: int,
               plans: list[RequestPlan], outcomes: list[RequestOutcome],
               baseline: tuple[int | None, int] | None, *, final: bool = True) -> ReplaySummary:
    """Judge the run from the store's verdicts, write it (runs and results tables) and carry the
    baseline run's (id, zombies) from :func:`resolve_baseline`. ``final``: the wait ended because
    nothing could change any more; otherwise verdicts still provisional are counted as such."""
    summary = ReplaySummary(capture_id=capture.id, target=target, sent=len(outcomes))
    verdicts = verdicts_for(store, plans)
    lags: list[float] = []
    results = []
    for outcome in outcomes:
        plan = outcome.plan
        summary.completed += outcome.completed
        if outcome.error:
            summary.errors += 1
            if len(summary.first_errors) < 5:
                summary.first_errors.append(f"{plan.request_id}: {outcome.error}")
        if outcome.cancelled_at_ns is None:
            continue
        summary.cancelled += 1
        row = verdicts.get(plan.trace_id)
        verdict = row.verdict if row is not None else None
        if verdict is None:
            summary.unjudged += 1
        else:
            summary.verdicts[verdict] = summary.verdicts.get(verdict, 0) + 1
            if not final and verdict not in ZOMBIES and (row.details or {}).get("provisional"):
                summary.provisional += 1
        if row is not None and verdict in ZOMBIES:
            summary.zombies += 1
            summary.zombie_seconds += row.lag_seconds or 0.0
            summary.wasted_tokens += row.tokens_after_disconnect or 0
            if row.lag_seconds is not None:
                lags.append(row.lag_seconds)
            summary.worst.append({"request_id": plan.request_id, "trace_id": plan.trace_id,
                                  "verdict": verdict, "lag_seconds": row.lag_seconds,
                                  "tokens_after_disconnect": row.tokens_after_disconnect,
                                  "phase": row.phase, "disconnect_kind": row.disconnect_kind})
        results.append({"request_id": plan.request_id, "trace_id": plan.trace_id,
                        "cancel_delay_s": plan.cancel_after_s, "disconnect_kind": plan.close_with,
                        "verdict": verdict, "lag_seconds": row.lag_seconds if row is not None else None})
    summary.worst.sort(key=lambda w: -(w["lag_seconds"] or 0.0))
    summary.worst = summary.worst[:10]
    if lags:
        summary.lag_p50_s = statistics.median(lags)
        summary.lag_max_s = max(lags)
    if baseline is not None:
        summary.baseline_run_id, summary.baseline_zombies = baseline
    with store.session() as session, session.begin():
        run = ReplayRunRow(started_ns=started_ns, finished_ns=time.time_ns(), capture_id=capture.id,
                           target=target, parameters=asdict(options), summary={})
        session.add(run)
        session.flush()
        summary.run_id = run.id
        run.summary = summary.as_json()
        if results:
            session.execute(ReplayResultRow.__table__.insert(), [{"run_id": run.id, **r} for r in results])
    return summary


def resolve_baseline(store: Store, capture: Capture, baseline: str | None,
                     limit: int | None = None) -> tuple[int | None, int] | None:
    """What to compare with, as (run id or None, its zombies): a run id, "previous" (the last run
    of this capture), "capture" (the verdicts the capture itself recorded, over the requests
    replayed) or None. Checked before any traffic is sent."""
    if baseline is None:
        return None
    if baseline == "capture":
        requests = capture.requests[:limit] if limit is not None else capture.requests
        return None, sum(1 for r in requests if r.original_verdict in ZOMBIES)
    with store.session() as session:
        if baseline == "previous":
            run = session.scalars(select(ReplayRunRow).where(ReplayRunRow.capture_id == capture.id)
                                  .order_by(ReplayRunRow.id.desc()).limit(1)).first()
            if run is None:
                raise CaptureError(f"no earlier replay of capture {capture.id} to compare with; run once "
                                   "without --baseline first, or compare with --baseline capture")
        else:
            try:
                run_id = int(baseline)
            except ValueError:
                raise CaptureError(f"--baseline {baseline!r}: give a run id (like 3), 'previous' or "
                                   "'capture'") from None
            run = session.scalars(select(ReplayRunRow).where(ReplayRunRow.id == run_id)).first()
            if run is None:
                known = list(session.scalars(select(ReplayRunRow.id).order_by(ReplayRunRow.id)))
                raise CaptureError(f"--baseline {run_id}: no such replay run in this file (runs: {known})")
        zombies = (run.summary or {}).get("zombies")
    if not isinstance(zombies, int):
        raise CaptureError(f"replay run {run.id} has no zombie count to compare with")
    return run.id, zombies
