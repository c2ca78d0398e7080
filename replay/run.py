"""A replay run: captured requests become load plans with injected cancellations, and the
auditor's verdicts for the cancelled ones become the run's result, kept in the capture file.

Cancellation follows AIPerf (see ``replay.client``): ``rate`` of the requests, chosen by seed, leave
``cancel_after_s`` after the request was fully written. ``as_captured`` replays the disconnects the
capture saw instead, each after the delay and with the close (FIN or RST) it had then.
"""

from __future__ import annotations

import http.client
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from auditor.model import ZOMBIE_VERDICTS, Verdict
from auditor.store import ReplayResultRow, ReplayRunRow, Store, VerdictRow, tables
from replay.capture import Capture, CapturedRequest, CaptureError, sample_cancels
from replay.client import RequestOutcome, RequestPlan

ZOMBIES = frozenset(v.value for v in ZOMBIE_VERDICTS)
# A run's verdicts are those whose client left after it started: the daemon's disconnect times come
# from this host's clocks too (replay runs on the engine's host), a minute covers their differences.
_CLOCK_MARGIN_NS = 60 * 10**9
# The engine's spans and the pipeline's stretches of orphaned work are stamped by this host's clock
# as the run's start is: an earlier run's, a minute before, are not this one's.
_SAME_HOST_MARGIN_NS = 10**9
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
    request_timeout_s: float | None = 600.0  # a request not cancelled and not answered by then is an error


def answered_first(request: CapturedRequest) -> bool:
    """The capture saw this client leave only after its answer was complete: a close, not a cancel,
    so ``--as-captured`` does not plan one (it could never fire, and a gate counts missed cancels)."""
    return request.original_verdict == Verdict.COMPLETED.value


def plan_replay(capture: Capture, options: ReplayOptions, *, tag: str) -> list[RequestPlan]:
    requests = capture.requests[: options.limit] if options.limit is not None else capture.requests
    injected = sample_cancels(len(requests), options.cancel_rate, options.seed)
    # Timing counts from the first request sent: an export's window may begin long before it.
    first_s = min((request.offset_s for request in requests), default=0.0)
    plans = []
    for index, (request, inject) in enumerate(zip(requests, injected, strict=True)):
        delay: float | None = None
        close = options.close_with or "fin"
        if options.as_captured and request.disconnect_after_s is not None and not answered_first(request):
            delay = request.disconnect_after_s
            close = options.close_with or request.disconnect_kind or "fin"
        elif inject:
            delay = options.cancel_after_s
        body = dict(request.body)
        if options.model:
            body["model"] = options.model
        elif not body.get("model"):
            raise CaptureError(f"captured request {index + 1} has no model (nothing recorded one); "
                               "pass --model NAME, the name the target engine serves")
        plans.append(RequestPlan(
            request_id=f"{tag}-{index:06d}", trace_id=secrets.token_hex(16), body=body, path=request.path,
            cancel_after_s=delay, close_with=close,
            start_at_s=(request.offset_s - first_s) / options.speed if options.speed > 0 else 0.0))
    return plans


@dataclass(slots=True)
class ReplaySummary:
    run_id: int = 0
    capture_id: int = 0
    target: str = ""
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    planned_cancels: int = 0  # cancels the plan asked for; fewer happen when answers come first
    errors: int = 0  # 4xx/5xx answers, refused connections, timeouts, broken responses
    error_kinds: dict[str, int] = field(default_factory=dict)  # "HTTP 404", "connect", "timeout", ...
    verdicts: dict[str, int] = field(default_factory=dict)  # for the cancelled requests
    evidence: dict[str, dict[str, int]] = field(default_factory=dict)  # verdict -> what decided it -> count
    timed_out: int = 0  # not cancelled, but the client gave up after --request-timeout (among the errors)
    timed_out_zombies: int = 0  # of those, the ones the engine went on with: counted in zombies too
    unjudged: int = 0  # cancelled, yet no verdict: the disconnect or the span never reached the auditor
    # The engine sent no span in the run (llama.cpp's server, TGI): no request can have a verdict.
    no_spans: bool = False
    # Of the requests left early, those judged by the engine's port alone where it sent no spans:
    # its /metrics gauges against the clients the kernel listed connected (the orphaned work below).
    judged_by_port: int = 0
    orphaned_stretches: int = 0  # stretches of work the port ran for clients that had left
    orphaned_request_seconds: float = 0.0
    orphaned_wasted_gpu_seconds: float = 0.0
    orphaned_wasted_cpu_seconds: float = 0.0
    provisional: int = 0  # a verdict that could still turn into a zombie when the wait ran out
    zombies: int = 0
    zombie_seconds: float = 0.0
    lag_p50_s: float | None = None
    lag_max_s: float | None = None
    wasted_tokens: int = 0
    zombies_without_tokens: int = 0  # their tokens nothing told (no engine span): not in wasted_tokens
    wasted_gpu_seconds: float = 0.0
    wasted_cpu_seconds: float = 0.0
    baseline_run_id: int | None = None
    baseline_zombies: int | None = None
    baseline: dict[str, Any] | None = None  # the baseline's figures (COMPARED keys; None where it has none)
    worst: list[dict[str, Any]] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        decision, reasons = gate(self)
        return {"schema": SCHEMA, **asdict(self), "gate": decision, "gate_reasons": reasons}

    def figures(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in COMPARED}


# What the report sets side by side for the baseline and the new run.
COMPARED = ("sent", "errors", "planned_cancels", "cancelled", "verdicts", "evidence", "timed_out", "timed_out_zombies",
            "zombies", "zombie_seconds",
            "wasted_tokens", "zombies_without_tokens", "wasted_gpu_seconds", "wasted_cpu_seconds",
            "judged_by_port", "orphaned_request_seconds", "orphaned_wasted_gpu_seconds", "orphaned_wasted_cpu_seconds")


@dataclass(frozen=True, slots=True)
class Baseline:
    run_id: int | None  # None: the capture's own verdicts
    zombies: int
    figures: dict[str, Any]


def gate(summary: ReplaySummary) -> tuple[str, list[str]]:
    """The release gate's decision and its reasons: "zombies" (work went on after clients left),
    "unsound" (requests failed, or fewer cancels happened than planned: the run did not test what it
    meant to), "inconclusive" (cancels without a final verdict) or "pass"."""
    labelled = gate_reasons(summary)
    return (labelled[0][0] if labelled else "pass"), [reason for _, reason in labelled]


def gate_reasons(summary: ReplaySummary) -> list[tuple[str, str]]:
    """Each reason against passing with its own kind, the deciding one first: a run with zombies
    and failed requests fails for both, and says which is which."""
    reasons = []
    if summary.zombies:
        timed_out = (f"; {summary.timed_out_zombies} of them after the client's --request-timeout"
                     if summary.timed_out_zombies else "")
        reasons.append(("zombies", f"{summary.zombies} zombies ({summary.zombie_seconds:.1f} zombie-seconds{timed_out})"))
    if summary.judged_by_port and summary.orphaned_stretches:
        stretches = f"{summary.orphaned_stretches} stretch{'es' if summary.orphaned_stretches != 1 else ''}"
        reasons.append(("zombies", f"the engine ran {summary.orphaned_request_seconds:.1f} request-seconds for clients "
                                   f"that had left ({stretches} of orphaned work, told by its /metrics and the "
                                   "kernel alone: it sent no spans)"))
    if summary.errors:
        kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(summary.error_kinds.items()))
        reasons.append(("unsound", f"{summary.errors} of {summary.sent} requests failed ({kinds})"))
    if summary.sent and not summary.planned_cancels:
        reasons.append(("unsound", "no request was cancelled, so no disconnect was tested (the capture holds "
                                   "none to replay as captured: plan some with --cancel-rate)"))
    if summary.cancelled < summary.planned_cancels:
        reasons.append(("unsound", f"only {summary.cancelled} of {summary.planned_cancels} planned cancels "
                                   "happened (the others were answered, or failed, before their timer fired)"))
    if reasons:
        return reasons
    if summary.unjudged:
        why = (": the engine sent no spans, and its /metrics gave no gauges to judge them by (llama.cpp's "
               "server: --metrics; or point its exporter at --otlp-http)" if summary.no_spans else "")
        reasons.append(("inconclusive", f"{summary.unjudged} cancelled requests got no verdict{why}"))
    if summary.provisional:
        reasons.append(("inconclusive", f"{summary.provisional} verdicts could still become zombies when the wait "
                                        "ran out"))
    return reasons


def error_kind(error: str) -> str:
    """The class of an outcome's error, for counting: "HTTP 404", "connect", "timeout", ..."""
    head = error.split(":", 1)[0]
    return " ".join(head.split()[:2]) if head.startswith("HTTP") else head


# The evidence word of a verdict whose server span answered a 4xx refusal (the correlator's, named
# here as replay reads verdicts from the store, not from the correlator).
REFUSED = "refused"


def evidence_of(details: dict[str, Any] | None) -> str:
    """What decided a verdict, from its details: the correlator's own word where it gives one,
    else whether the engine's span was there; "-" where the details say nothing."""
    details = details or {}
    if isinstance(details.get("evidence"), str):
        return str(details["evidence"])
    if "engine_span" in details:
        return "engine span" if details["engine_span"] else "no engine span"
    return "-"


# Gauges of requests an engine is running or holding, by server: the sum is 0 when it is idle.
BUSY_GAUGES = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting", "sglang:num_running_reqs",
                         "sglang:num_queue_reqs", "tgi_queue_size", "tgi_batch_current_size",
                         "llamacpp:requests_processing", "llamacpp:requests_deferred",
                         "ref_engine_num_requests_running", "ref_engine_num_requests_waiting"})


def busy_from_metrics(text: str) -> float | None:
    """The sum of the known gauges in a Prometheus text exposition; None when it has none or
    cannot be parsed."""
    values = []
    try:
        for family in text_string_to_metric_families(text):
            values += [sample.value for sample in family.samples if sample.name in BUSY_GAUGES]
    except ValueError:
        return None
    return sum(values) if values else None


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
        return busy_from_metrics(text) if response.status == 200 else None

    def close(self) -> None:
        self._connection.close()


def verdicts_for(store: Store, plans: list[RequestPlan], started_ns: int) -> dict[str, VerdictRow]:
    """The auditor's verdict for each plan, by the trace id the client sent: among the verdicts
    whose client left after the run started (``started_ns``, less a margin for the clocks), a
    range of the disconnect index (the store has no index of trace ids)."""
    traces = {plan.trace_id for plan in plans}
    found: dict[str, VerdictRow] = {}
    since_ns = started_ns - _CLOCK_MARGIN_NS
    with store.session() as session:
        ordered = sorted(traces)
        for i in range(0, len(ordered), 500):
            for row in session.scalars(select(VerdictRow).where(VerdictRow.disconnect_at_ns >= since_ns,
                                                                VerdictRow.trace_id.in_(ordered[i:i + 500]))):
                found[row.trace_id or ""] = row
    return found


def left_early(outcomes: list[RequestOutcome]) -> list[RequestPlan]:
    """The requests whose client left before the answer's end: the cancelled ones, and those it gave
    up on after --request-timeout (a client's timeout leaves a zombie as surely as a cancel)."""
    return [o.plan for o in outcomes if o.cancelled_at_ns is not None or o.timed_out_at_ns is not None]


def settled(store: Store, cancelled: list[RequestPlan], started_ns: int) -> tuple[int, int]:
    """(requests left early with a verdict, of them not final yet): an in-flight zombie, or a
    verdict still waiting for a late engine span (an abort without one is provisional until the
    correlator's late-span window has passed, because a detached engine reports only at its end)."""
    rows = verdicts_for(store, cancelled, started_ns)
    pending = sum(1 for r in rows.values()
                  if r.verdict == Verdict.INFLIGHT_ZOMBIE.value or (r.details or {}).get("provisional"))
    return len(rows), pending


def record_run(store: Store, capture: Capture, target: str, options: ReplayOptions, started_ns: int,
               plans: list[RequestPlan], outcomes: list[RequestOutcome],
               baseline: Baseline | None, *, final: bool = True, port: int = 0,
               gauges_read: bool = False) -> ReplaySummary:
    """Judge the run from the store's verdicts, write it (runs and results tables) and carry the
    baseline from :func:`resolve_baseline`. ``final``: the wait ended because nothing could change
    any more; otherwise verdicts still provisional are counted as such.

    Where the engine on ``port`` sent no span in the run, no request has a verdict; where the
    pipeline read its gauges (``gauges_read``), the port judges the requests left early as a whole:
    the stretches of work it ran for clients that had left (``auditor.correlate.orphans``, written
    as the pipeline stopped) are the run's zombies, none of them a pass. A lower bound, as the count
    is: a zombie that ends within about a second of its client's grace may go uncounted."""
    summary = ReplaySummary(capture_id=capture.id, target=target, sent=len(outcomes),
                            planned_cancels=sum(1 for plan in plans if plan.cancel_after_s is not None))
    verdicts = verdicts_for(store, plans, started_ns)
    lags: list[float] = []
    results = []
    for outcome in outcomes:
        plan = outcome.plan
        summary.completed += outcome.completed
        if outcome.error:
            _count_error(summary, plan.request_id, outcome.error)
        if outcome.timed_out_at_ns is not None:
            summary.timed_out += 1
            row = verdicts.get(plan.trace_id)
            if row is not None and row.verdict in ZOMBIES:
                summary.timed_out_zombies += 1
                _count_zombie(summary, plan, row, lags, left="timeout")
            results.append(_result_row(plan, row, options.request_timeout_s, "timeout"))
            continue
        if outcome.cancelled_at_ns is None:
            continue
        summary.cancelled += 1
        row = verdicts.get(plan.trace_id)
        if row is not None and not outcome.error and (row.details or {}).get("evidence") == REFUSED:
            # A reset sent before the answer reads nothing: the server span says the target
            # refused the request (a 4xx), which tests no cancel.
            _count_error(summary, plan.request_id, "HTTP 4xx: the target refused the request (its span says)")
        _count_verdict(summary, plan, row, final, lags)
        results.append(_result_row(plan, row, plan.cancel_after_s, plan.close_with))
    if port:
        _judge_by_port(store, summary, port, started_ns, gauges_read)
    summary.worst.sort(key=lambda w: -(w["lag_seconds"] or 0.0))
    summary.worst = summary.worst[:10]
    if lags:
        summary.lag_p50_s = statistics.median(lags)
        summary.lag_max_s = max(lags)
    if baseline is not None:
        summary.baseline_run_id, summary.baseline_zombies = baseline.run_id, baseline.zombies
        summary.baseline = {key: baseline.figures.get(key) for key in COMPARED}
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


def _judge_by_port(store: Store, summary: ReplaySummary, port: int, started_ns: int, gauges_read: bool) -> None:
    """The run judged by the engine's port where it sent no span (``record_run``)."""
    with store.engine.connect() as conn:
        summary.no_spans = not conn.scalar(select(func.count()).select_from(tables.spans).where(
            tables.spans.c.server_port == port, tables.spans.c.start_ns >= started_ns - _SAME_HOST_MARGIN_NS))
        if not (summary.no_spans and gauges_read and summary.unjudged):
            return
        orphaned = tables.orphaned_work.c
        stretches = conn.execute(select(orphaned.request_seconds, orphaned.wasted_gpu_seconds,
                                        orphaned.wasted_cpu_seconds)
                                 .where(orphaned.server_port == port, orphaned.start_ns >= started_ns)).all()
    summary.judged_by_port, summary.unjudged = summary.unjudged, 0
    summary.orphaned_stretches = len(stretches)
    summary.orphaned_request_seconds = round(sum(s.request_seconds for s in stretches), 6) or 0.0
    summary.orphaned_wasted_gpu_seconds = round(sum(s.wasted_gpu_seconds for s in stretches), 6) or 0.0
    summary.orphaned_wasted_cpu_seconds = round(sum(s.wasted_cpu_seconds for s in stretches), 6) or 0.0


def _result_row(plan: RequestPlan, row: VerdictRow | None, left_after_s: float | None, left_how: str) -> dict[str, Any]:
    """One replay_results row: how and when the client left, and the verdict the auditor gave."""
    return {"request_id": plan.request_id, "trace_id": plan.trace_id, "cancel_delay_s": left_after_s,
            "disconnect_kind": left_how, "verdict": row.verdict if row is not None else None,
            "lag_seconds": row.lag_seconds if row is not None else None}


def _count_error(summary: ReplaySummary, request_id: str, error: str) -> None:
    summary.errors += 1
    kind = error_kind(error)
    summary.error_kinds[kind] = summary.error_kinds.get(kind, 0) + 1
    if len(summary.first_errors) < 5:
        summary.first_errors.append(f"{request_id}: {error}")


def _count_verdict(summary: ReplaySummary, plan: RequestPlan, row: VerdictRow | None, final: bool,
                   lags: list[float]) -> None:
    if row is None:
        summary.unjudged += 1
        return
    verdict = row.verdict
    summary.verdicts[verdict] = summary.verdicts.get(verdict, 0) + 1
    by_evidence = summary.evidence.setdefault(verdict, {})
    evidence = evidence_of(row.details)
    by_evidence[evidence] = by_evidence.get(evidence, 0) + 1
    if not final and verdict not in ZOMBIES and (row.details or {}).get("provisional"):
        summary.provisional += 1
    if verdict in ZOMBIES:
        _count_zombie(summary, plan, row, lags, left="cancel")


def _count_zombie(summary: ReplaySummary, plan: RequestPlan, row: VerdictRow, lags: list[float], *,
                  left: str) -> None:
    """A zombie's figures into the run's; ``left``: how its client left ("cancel", "timeout")."""
    summary.zombies += 1
    summary.zombie_seconds += row.lag_seconds or 0.0
    summary.wasted_tokens += row.tokens_after_disconnect or 0
    summary.zombies_without_tokens += row.tokens_after_disconnect is None
    summary.wasted_gpu_seconds += row.wasted_gpu_seconds or 0.0
    summary.wasted_cpu_seconds += row.wasted_cpu_seconds or 0.0
    if row.lag_seconds is not None:
        lags.append(row.lag_seconds)
    summary.worst.append({"request_id": plan.request_id, "trace_id": plan.trace_id, "verdict": row.verdict,
                          "lag_seconds": row.lag_seconds, "tokens_after_disconnect": row.tokens_after_disconnect,
                          "phase": row.phase, "disconnect_kind": row.disconnect_kind, "left": left})


def resolve_baseline(store: Store, capture: Capture, baseline: str | None,
                     limit: int | None = None) -> Baseline | None:
    """What to compare with: a run id, "previous" (the last run of this capture), "capture" (the
    verdicts the capture itself recorded, over the requests replayed) or None. Checked before any
    traffic is sent. Figures an older run did not keep stay absent (shown as "-")."""
    if baseline is None:
        return None
    if baseline == "capture":
        requests = capture.requests[:limit] if limit is not None else capture.requests
        # Over the disconnects a replay cancels, as its own verdicts are: a client that left after
        # a complete answer is no cancel, and its `completed` is not a verdict the replay can lose.
        cancelled = [r for r in requests if r.disconnect_after_s is not None and not answered_first(r)]
        verdicts: dict[str, int] = {}
        for request in cancelled:
            if request.original_verdict:
                verdicts[request.original_verdict] = verdicts.get(request.original_verdict, 0) + 1
        zombies = sum(count for verdict, count in verdicts.items() if verdict in ZOMBIES)
        return Baseline(None, zombies, {"sent": len(requests), "cancelled": len(cancelled), "verdicts": verdicts,
                                        "zombies": zombies})
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
            if run.capture_id is not None and run.capture_id != capture.id:  # other traffic: its zombie count says nothing of this run's
                same = list(session.scalars(select(ReplayRunRow.id).where(ReplayRunRow.capture_id == capture.id)
                                            .order_by(ReplayRunRow.id)))
                raise CaptureError(f"--baseline {run_id}: that run replayed capture {run.capture_id}, and this "
                                   f"replays capture {capture.id}; compare with one of its runs ({same}) or "
                                   "--baseline previous")
        figures = dict(run.summary or {})
    counted = figures.get("zombies")
    if not isinstance(counted, int):
        raise CaptureError(f"replay run {run.id} has no zombie count to compare with")
    return Baseline(run.id, counted, figures)
