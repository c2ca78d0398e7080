"""The verdict rules of DESIGN §5 as pure functions over one request's evidence.

Kept free of I/O and state so each rule can be read, and tested, on its own. ``correlate`` gathers
the evidence (spans, kernel events, live notices) and calls ``decide``.
"""

from __future__ import annotations

from dataclasses import dataclass

from auditor.model import Phase, SpanRecord, Verdict

# A client that closes right after the last byte races the server's span end by about a
# millisecond; anything that finished within this of the disconnect was complete.
CLOCK_ERROR_NS = 2_000_000
NORMAL_FINISH = frozenset({"stop", "length"})
TOKENS_AFTER_DISCONNECT_ATTR = "auditor.tokens_after_disconnect"


@dataclass(frozen=True, slots=True)
class Evidence:
    disconnect_at_ns: int
    http_span: SpanRecord | None  # the server span the disconnect joined (None: known only live)
    engine_span: SpanRecord | None
    work_end_ns: int | None  # None: work still in flight (or not known to have ended)
    now_ns: int
    # When the server took the request up: later than the disconnect when the client left while
    # its request still waited unread (a one-at-a-time server); work before it is no zombie's.
    started_ns: int | None = None
    completed_by: str | None = None  # evidence that the response was complete (auditor.correlate.evidence)
    work_stopped_known: bool = True  # False: nothing tells whether the work stopped (HTTP spans only)


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    lag_seconds: float | None


def inflight_from(disconnect_ns: int, grace_seconds: float) -> int:
    """The first moment at which work still running after a disconnect is an in-flight zombie."""
    return disconnect_ns + int(grace_seconds * 1e9) + 1


def decide(evidence: Evidence, grace_seconds: float) -> Decision | None:
    """The verdict for a disconnect while in flight, or None while it is too early to say."""
    grace_ns = int(grace_seconds * 1e9)
    disconnect = evidence.disconnect_at_ns
    if evidence.work_end_ns is None:
        if evidence.now_ns >= inflight_from(disconnect, grace_seconds):
            return Decision(Verdict.INFLIGHT_ZOMBIE, (evidence.now_ns - disconnect) / 1e9)
        return None
    lag_ns = evidence.work_end_ns - max(disconnect, evidence.started_ns or disconnect)
    engine = evidence.engine_span
    # The engine says the response was complete; without its span, what the server had sent does
    # (evidence.completed_by). A server span that merely ended promptly proves neither.
    if engine is not None and engine.finish_reason in NORMAL_FINISH and engine.end_ns <= disconnect + CLOCK_ERROR_NS:
        return Decision(Verdict.COMPLETED, max(lag_ns, 0) / 1e9)
    if (engine is None or engine.finish_reason is None) and evidence.completed_by is not None:
        return Decision(Verdict.COMPLETED, max(lag_ns, 0) / 1e9)
    if not evidence.work_stopped_known:
        return Decision(Verdict.UNCONFIRMED, None)
    if never_ran(engine) or lag_ns <= grace_ns:
        return Decision(Verdict.ABORTED, max(lag_ns, 0) / 1e9)
    return Decision(Verdict.ZOMBIE, lag_ns / 1e9)


def never_ran(engine: SpanRecord | None) -> bool:
    """The engine span of a request that left the queue without computing anything."""
    return (engine is not None and engine.time_in_queue_s is None and not engine.completion_tokens
            and engine.finish_reason not in NORMAL_FINISH)


def phase_at(disconnect_ns: int, engine: SpanRecord | None) -> Phase:
    """Queued, prefill or decode, from the engine span's arrival, queue and first-token times.

    A latency the span lacks is a stage the request never reached: no time in queue means it
    never left the queue, no time to first token means it never finished prefill.
    """
    if engine is None:
        return Phase.UNKNOWN
    arrival = engine.start_ns
    if engine.time_in_queue_s is None or disconnect_ns < arrival + engine.time_in_queue_s * 1e9:
        return Phase.QUEUED
    if engine.time_to_first_token_s is None or disconnect_ns < arrival + engine.time_to_first_token_s * 1e9:
        return Phase.PREFILL
    return Phase.DECODE


def tokens_after_disconnect(disconnect_ns: int, engine: SpanRecord | None) -> tuple[int | None, bool]:
    """Tokens generated after the disconnect, and whether the engine reported them exactly.

    Estimated otherwise by spreading the completion tokens evenly over the decode time.
    """
    if engine is None:
        return None, False
    exact = engine.attributes.get(TOKENS_AFTER_DISCONNECT_ATTR)
    if isinstance(exact, int) and not isinstance(exact, bool) and exact >= 0:
        return exact, True
    if engine.completion_tokens is None:
        return None, False
    if engine.end_ns <= disconnect_ns:
        return 0, False
    first_token = engine.start_ns + int((engine.time_to_first_token_s or 0.0) * 1e9)
    if disconnect_ns <= first_token or engine.end_ns <= first_token:
        return engine.completion_tokens, False
    share = (engine.end_ns - disconnect_ns) / (engine.end_ns - first_token)
    return round(engine.completion_tokens * share), False
