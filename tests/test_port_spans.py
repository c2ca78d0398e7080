"""The per-port count of server spans in flight during an interval, against counting them one by one."""

from __future__ import annotations

import random

from auditor.correlate.traces import PortSpans
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


def test_remove_forgets_one_span_and_covers_only_the_interval() -> None:
    index = PortSpans()
    for i, (start, end) in enumerate([(0, 10), (5, 20), (30, 40)]):
        index.add(span(i, start, end))
    assert index.in_flight(8, 8) == 2 and index.in_flight(21, 29) == 0 and index.in_flight(0, 100) == 3
    assert index.covers((f"{1:032x}", f"{1:016x}"), 15, 16) and not index.covers((f"{1:032x}", f"{1:016x}"), 21, 25)
    assert index.remove((f"{0:032x}", f"{0:016x}")) and index.remove((f"{1:032x}", f"{1:016x}"))
    assert index.remove((f"{1:032x}", f"{1:016x}"))  # already gone: nothing changes
    assert index.in_flight(0, 100) == 1 and not index.covers((f"{0:032x}", f"{0:016x}"), 0, 100)
    assert not index.remove((f"{2:032x}", f"{2:016x}"))


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
        index.remove((gone.trace_id, gone.span_id))
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
    keys = [(s.trace_id, s.span_id) for s in gone] + [("f" * 32, "f" * 16)]  # the last: never added
    for key in keys:
        one_by_one.remove(key)
    assert at_once.remove_many(keys)
    left = [s for s in spans if s not in gone]
    for _ in range(400):
        ts = rng.randrange(-5, 3500)
        until = ts + rng.choice([0, 2, 40, 400])
        brute = sum(1 for s in left if s.start_ns <= until and s.end_ns >= ts)
        assert at_once.in_flight(ts, until) == one_by_one.in_flight(ts, until) == brute, (ts, until)
        assert at_once.started(ts, until) == one_by_one.started(ts, until)
    assert not at_once.remove_many([(s.trace_id, s.span_id) for s in left])
