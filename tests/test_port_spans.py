"""The per-port count of server spans in flight during an interval, against counting them one by one;
and live notices counted beside them."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from auditor.correlate.traces import PortSpans, TraceIndex, in_flight_among
from auditor.model import SpanRecord, SpanRole


def span(index: int, start: int, end: int) -> SpanRecord:
    return SpanRecord(trace_id=f"{index:032x}", span_id=f"{index:016x}", parent_span_id=None, name="POST",
                      kind=2, start_ns=start, end_ns=end, service="s", host="h", status=0,
                      role=SpanRole.HTTP_SERVER, server_port=8000)


def test_in_flight_counts_equal_a_pass_over_every_span() -> None:
    rng = random.Random(7)
    spans = []
    for index in range(400):
        start = rng.randrange(0, 10_000)
        spans.append(span(index, start, start + rng.choice([0, 1, 5, 50, 500, 5000])))
    index = PortSpans()
    for item in spans:
        index.add(item)
    for _ in range(500):
        ts = rng.randrange(-100, 16_000)
        until = ts + rng.choice([0, 1, 10, 300])
        brute = sum(1 for s in spans if s.start_ns <= until and s.end_ns >= ts)
        assert index.in_flight(ts, until) == brute, (ts, until)


def test_the_lengths_of_spans_that_ended_in_a_window_are_theirs() -> None:
    """Each end is held with its own start: of two spans that ended at once, removing one leaves
    the other's length."""
    index = PortSpans()
    spans = [span(i, start, end) for i, (start, end) in enumerate([(0, 100), (50, 100), (20, 200), (150, 250)])]
    for item in spans:
        index.add(item)
    assert sorted(index.lengths_ended(90, 200)) == [50, 100, 180] and index.ended(90, 200) == 3
    assert index.lengths_ended(100, 199) == [] and index.ended(100, 199) == 0
    index.remove(spans[1])
    assert sorted(index.lengths_ended(90, 200)) == [100, 180]
    assert index.remove_many([spans[0], spans[2]]) and index.lengths_ended(-1, 1000) == [100]


def test_remove_forgets_one_span() -> None:
    index = PortSpans()
    spans = [span(i, start, end) for i, (start, end) in enumerate([(0, 10), (5, 20), (30, 40)])]
    for item in spans:
        index.add(item)
    assert index.in_flight(8, 8) == 2 and index.in_flight(21, 29) == 0 and index.in_flight(0, 100) == 3
    assert index.remove_many([spans[0]]) and index.remove_many([spans[1]])
    assert index.in_flight(0, 100) == 1 and index.in_flight(8, 8) == 0
    assert index.remove_many([span(9, 7, 7)])  # never added: nothing changes
    assert index.in_flight(0, 100) == 1
    assert not index.remove_many([spans[2]])


def test_live_notices_count_once_beside_the_spans_of_their_port() -> None:
    """A live notice's (trace, span) counts in flight unless that server span is indexed on the
    port and in flight in the interval already (then it is counted once, as a span)."""
    index = TraceIndex()
    spans = [span(i, start, end) for i, (start, end) in enumerate([(0, 10), (5, 20), (30, 40)])]
    for item in spans:
        index.add(item, arrived_ns=item.end_ns)
    other_port = replace(span(7, 0, 100), server_port=9000)
    index.add(other_port, arrived_ns=100)
    key = (spans[1].trace_id, spans[1].span_id)
    assert index.server_spans_on(8000, 15, 16, also={key}) == 1  # the span itself: once
    assert index.server_spans_on(8000, 21, 25, also={key}) == 1  # indexed, not in flight then: the notice
    assert index.server_spans_on(8000, 21, 25, also=set()) == 0
    assert index.server_spans_on(8000, 0, 1, also={(other_port.trace_id, other_port.span_id)}) == 2
    assert index.server_spans_on(8000, 0, 1, also={("a" * 32, "b" * 16)}) == 2  # not indexed
    assert index.server_spans_on(8001, 0, 1, also={key}) == 1  # no span on that port


def test_counts_after_removals_equal_a_pass_over_the_spans_left() -> None:
    """Spans with equal starts or ends: removing one removes one of the equal times, never more."""
    rng = random.Random(11)
    spans = [span(index, start, start + rng.choice([0, 3, 30])) for index in range(300)
             for start in [rng.randrange(0, 200)]]
    index = PortSpans()
    for item in spans:
        index.add(item)
    left = list(spans)
    rng.shuffle(left)
    while left:
        gone = left.pop()
        index.remove_many([gone])
        for _ in range(5):
            ts = rng.randrange(-5, 240)
            until = ts + rng.choice([0, 2, 40])
            assert index.in_flight(ts, until) == sum(1 for s in left if s.start_ns <= until and s.end_ns >= ts)


def test_removing_many_at_once_equals_removing_them_one_by_one() -> None:
    """The prune's way: a port's oldest spans (and some others, and one already gone) taken out
    in one pass leave the counts that taking them out one at a time leaves."""
    rng = random.Random(23)
    spans = [span(index, start, start + rng.choice([0, 3, 30, 3000])) for index in range(500)
             for start in [rng.randrange(0, 400)]]
    one_by_one, at_once = PortSpans(), PortSpans()
    for item in spans:
        one_by_one.add(item)
        at_once.add(item)
    by_start = sorted(spans, key=lambda s: s.start_ns)
    gone = by_start[:150] + rng.sample(by_start[150:], 40)
    for item in gone:
        one_by_one.remove_many([item])
    assert at_once.remove_many([*gone, span(999, 10_000, 10_001)])  # the last: never added
    left = [s for s in spans if s not in gone]
    for _ in range(400):
        ts = rng.randrange(-5, 3500)
        until = ts + rng.choice([0, 2, 40, 400])
        brute = sum(1 for s in left if s.start_ns <= until and s.end_ns >= ts)
        assert at_once.in_flight(ts, until) == one_by_one.in_flight(ts, until) == brute, (ts, until)
        assert at_once.started(ts, until) == one_by_one.started(ts, until)
        ended = sorted(s.end_ns - s.start_ns for s in left if ts < s.end_ns <= until)
        assert sorted(at_once.lengths_ended(ts, until)) == sorted(one_by_one.lengths_ended(ts, until)) == ended
        assert at_once.ended(ts, until) == len(ended)
    assert not at_once.remove_many(left)


def connection_span(trace: int, span_id: int, parent: int | None, start: int, end: int,
                    peer_port: int = 40000) -> SpanRecord:
    return replace(span(trace, start, end), span_id=f"{span_id:016x}",
                   parent_span_id=None if parent is None else f"{parent:016x}", peer_addr="10.0.0.7",
                   peer_port=peer_port)


def test_a_duplicate_server_span_counts_once_in_either_order() -> None:
    """FastAPI's instrumentation adds a second SERVER span inside the ASGI middleware's, on the
    same connection: one request, however the two arrive. Counted twice, one request in flight
    read as two to the gauges' arithmetic, and a client that read its whole answer was judged to
    have left work running."""
    for order in ("child first", "parent first"):
        index = TraceIndex()
        outer, inner = connection_span(1, 1, None, 0, 100), connection_span(1, 2, 1, 5, 95)
        for item in ([inner, outer] if order == "child first" else [outer, inner]):
            index.add(item, arrived_ns=100)
        assert index.server_spans_on(8000, 50, 50, also=set()) == 1, order
        assert index.server_spans_started(8000, -1, 100) == 1 and index.server_spans_ended(8000, 0, 100) == 1, order
        # A third level of the same (a middleware's own span) still makes one request.
        index.add(connection_span(1, 3, 2, 10, 90), arrived_ns=100)
        assert index.server_spans_on(8000, 50, 50, also=set()) == 1, order
        index.prune(cutoff_ns=200, keep=set())  # what was counted is what leaves
        assert index.server_spans_on(8000, 50, 50, also=set()) == 0
    # The middle one last: the innermost counted until its parent came, though that parent
    # counts not itself (its own parent is here).
    index = TraceIndex()
    for item in (connection_span(1, 1, None, 0, 100), connection_span(1, 3, 2, 10, 90), connection_span(1, 2, 1, 5, 95)):
        index.add(item, arrived_ns=100)
    assert index.server_spans_on(8000, 50, 50, also=set()) == 1
    index.prune(cutoff_ns=200, keep=set())
    assert index.server_spans_on(8000, 50, 50, also=set()) == 0 and index.server_spans_started(8000, -1, 100) == 0


def test_parallel_requests_of_one_trace_on_one_connection_count_each() -> None:
    """HTTP/2: an agent's two calls in one trace share a connection; siblings, not duplicates."""
    index = TraceIndex()
    client = replace(connection_span(1, 1, None, 0, 100), role=SpanRole.OTHER, kind=3, server_port=None)
    index.add(client, arrived_ns=100)
    for span_id, (start, end) in ((2, (5, 95)), (3, (10, 50))):
        index.add(connection_span(1, span_id, 1, start, end), arrived_ns=100)
    assert index.server_spans_on(8000, 20, 20, also=set()) == 2
    # The same spans on two connections (another client port) are two requests too.
    other = TraceIndex()
    other.add(connection_span(2, 1, None, 0, 100), arrived_ns=100)
    other.add(connection_span(2, 2, 1, 5, 95, peer_port=40001), arrived_ns=100)
    assert other.server_spans_on(8000, 50, 50, also=set()) == 2


MS = 1_000_000


def keep_alive_spans(answer_ends_after_ms: float, next_after_ms: float = 0.5) -> list[tuple[int, int]]:
    """(start, end) of two requests on one connection, in ns from the client's close at 0: the
    answer it had (ending ``answer_ends_after_ms`` after the close), and the next one, which the
    server read ``next_after_ms`` after the close."""
    return [(-300 * MS, int(answer_ends_after_ms * MS)), (int(next_after_ms * MS), 100 * MS)]


@pytest.mark.parametrize(("answer_ends_after_ms", "reset", "polled", "want"), [
    (0.065, False, False, 1),  # answered, next request sent, FIN at once: the next request's
    (0.065, True, False, 1),  # the same with a reset
    (0.065, False, True, 1),  # a polled close: the next request was sent before it, read after the poll
    (50, False, False, 0),  # the answer still going 50 ms after the close: the client left it
])
def test_a_close_right_after_sending_the_next_request_is_the_next_requests(
        answer_ends_after_ms: float, reset: bool, polled: bool, want: int) -> None:
    """A keep-alive client read an answer, sent its next request and closed at once, before the
    server had ended the answer's span (its span ends a fraction of a millisecond after its last
    byte). The close was taken for the answer's: a completed request judged a zombie beside the
    engine running the next one on, and the next one, the request really left, judged nothing."""
    spans = keep_alive_spans(answer_ends_after_ms)
    chosen = in_flight_among(spans, lambda s: s[0], lambda s, ns: s[1] >= ns, 0, [], 5_000 * MS,
                             -40 * MS if polled else None, peer_fin=not reset, events_at=[0])
    assert chosen == spans[want]


def test_a_later_request_of_another_connection_on_the_4_tuple_does_not_take_the_close() -> None:
    """After a reset nothing holds the 4-tuple: a span that starts after another connection's
    events there is that connection's, and the close stays the answer's."""
    spans = keep_alive_spans(0.065, next_after_ms=5)
    chosen = in_flight_among(spans, lambda s: s[0], lambda s, ns: s[1] >= ns, 0, [], 5_000 * MS, None,
                             peer_fin=False, events_at=[0, 3 * MS])
    assert chosen == spans[0]
