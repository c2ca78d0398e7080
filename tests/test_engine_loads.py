"""The engine's gauges as evidence: when a disconnected request's work ended (EngineLoads.work_end)."""

from __future__ import annotations

import pytest

from auditor.correlate.evidence import EngineLoads, ScrapeSweep
from auditor.model import EngineLoad

S = 1_000_000_000
MS = 1_000_000
CLOCK_ERROR = 20 * MS
PORT = 8000
GRACE = 500 * MS  # the correlator's default


def at(seconds: float) -> int:
    return round(seconds * S)


def scraped(runs: dict[str, tuple[float, float]]) -> EngineLoads:
    """Scrapes every 100 ms for 3 s of an engine running each request over its (start, end) seconds."""
    loads = EngineLoads()
    loads.add([EngineLoad(at(tenth / 10), PORT, running=sum(1 for start, end in runs.values()
                                                            if at(start) <= at(tenth / 10) < at(end)))
               for tenth in range(31)])
    return loads


def connected_counter(spans: dict[str, tuple[float, float]]):  # type: ignore[no-untyped-def]
    """The connected count as the correlator gives it: server spans in flight at any moment of the
    scrape's interval, widened by the clock error."""
    def connected(start_ns: int, end_ns: int) -> int:
        return sum(1 for first, last in spans.values()
                   if at(first) <= end_ns + CLOCK_ERROR and at(last) >= start_ns - CLOCK_ERROR)
    return connected


@pytest.mark.parametrize("b_span_end", [1.31, 1.75], ids=["noticed at once", "noticed late"])
def test_a_request_that_left_but_whose_span_is_still_counted_connected_claims_no_orphan(b_span_end: float) -> None:
    # A's client left at 0.25 s and its work ran on to 1.95 s. B started at 0.9 s; its client left at
    # 1.2995 s, its server noticed at once (its span's end) or only at 1.75 s; its work ran on to 2.5 s.
    runs = {"A": (0.0, 1.95), "B": (0.9, 2.5)}
    spans = {"A": (0.0, 0.26), "B": (0.9, b_span_end)}
    loads = scraped(runs)
    loads.register(PORT, "A", at(0.25), connected_until_ns=at(0.26) + CLOCK_ERROR)
    loads.register(PORT, "B", at(1.2995), connected_until_ns=at(b_span_end) + CLOCK_ERROR)
    ended = loads.work_end(PORT, at(0.25), at(0.25), connected_counter(spans),
                           connected_until_ns=at(0.26) + CLOCK_ERROR)
    # The scrape at 1.3 s counts B as connected (its span ends after it): two running, one
    # connected, one orphan, A's. Counting B as a newer orphan too ended A's work at 1.25 s.
    assert ended is not None and ended.work_end_ns == at(1.95) and ended.orphaned_scrapes == 17
    # B's own work end: the newest orphan, past A's end.
    ended_b = loads.work_end(PORT, at(1.2995), at(1.2995), connected_counter(spans),
                             connected_until_ns=at(b_span_end) + CLOCK_ERROR)
    assert ended_b is not None and ended_b.work_end_ns == at(2.45)


def test_a_registration_changes_the_work_end_of_those_that_left_before_it_only() -> None:
    """The first test's A and B: B's registration ends A's work earlier, and A's changes nothing of
    B's (an earlier leaver counts among those before and by each scrape alike)."""
    runs = {"A": (0.0, 1.95), "B": (0.9, 2.5)}
    spans = {"A": (0.0, 0.26), "B": (0.9, 1.31)}

    def ends(registered: list[str], unregistered: tuple[str, ...] = ()) -> dict[str, int | None]:
        loads = scraped(runs)
        for name in registered:
            loads.register(PORT, name, at({"A": 0.25, "B": 1.2995}[name]),
                           connected_until_ns=at(spans[name][1]) + CLOCK_ERROR)
        for name in unregistered:  # proved complete when its client left: it owns no orphan
            loads.unregister(PORT, name)
        found = {name: loads.work_end(PORT, at(left), at(left), connected_counter(spans),
                                      connected_until_ns=at(spans[name][1]) + CLOCK_ERROR)
                 for name, left in (("A", 0.25), ("B", 1.2995))}
        return {name: end.work_end_ns if end else None for name, end in found.items()}

    assert ends(["A", "B"]) == {"A": at(1.95), "B": at(2.45)}
    assert ends(["A"])["A"] == at(2.45)  # without B, B's orphans read as A's
    assert ends(["B"])["B"] == at(2.45)
    assert ends(["A", "B"], unregistered=("B",))["A"] == at(2.45)  # as if B had never left


def test_a_registration_is_news_to_those_that_left_before_it_judged_before_it_reading_that_far() -> None:
    loads = EngineLoads()
    loads.register(PORT, "A", at(0.25))
    judged_after_a = loads.registrations
    loads.register(PORT, "B", at(1.2995))
    loads.register(PORT, "B", at(1.2995))  # the same again: no registration
    registered = loads.take_registered()
    assert registered.earliest() == at(0.25) and loads.registrations == 2
    assert registered.concerning(at(0.25), at(2.0), seen=judged_after_a) == at(1.2995)
    assert registered.concerning(at(0.25), at(2.0), seen=loads.registrations) is None  # judged after B
    assert registered.concerning(at(0.25), at(1.0), seen=judged_after_a) is None  # read scrapes to 1 s
    assert registered.concerning(at(1.2995), at(3.0), seen=0) is None  # B itself, and later leavers
    assert registered.concerning(at(0.1), at(3.0), seen=0) == at(0.25)
    assert not loads.take_registered()
    # Registered again with another end of its span: its old time goes, its new one comes.
    loads.register(PORT, "B", at(1.4), connected_until_ns=at(1.5))
    registered = loads.take_registered()
    assert registered.concerning(at(1.3), at(3.0), seen=0) == at(1.4)
    assert registered.concerning(at(1.0), at(3.0), seen=0) == at(1.2995)


def test_a_request_registered_again_replaces_its_disconnect() -> None:
    runs = {"A": (0.0, 1.95), "B": (0.9, 2.5)}
    spans = {"A": (0.0, 0.26), "B": (0.9, 1.31)}
    loads = scraped(runs)
    loads.register(PORT, "B", at(0.1), connected_until_ns=at(0.2))  # first seen with another close
    loads.register(PORT, "A", at(0.25), connected_until_ns=at(0.26) + CLOCK_ERROR)
    loads.register(PORT, "B", at(1.2995), connected_until_ns=at(1.31) + CLOCK_ERROR)
    loads.register(PORT, "B", at(1.2995), connected_until_ns=at(1.31) + CLOCK_ERROR)  # no change
    ended = loads.work_end(PORT, at(0.25), at(0.25), connected_counter(spans),
                           connected_until_ns=at(0.26) + CLOCK_ERROR)
    assert ended is not None and ended.work_end_ns == at(1.95)
    loads.prune(at(1.0))  # A's registration leaves with the horizon; B's stays
    # B, registered again, went to the end of the line: pruning from the first registration on
    # reached A (which it would not, past a B still at the front).
    assert list(loads._disconnects[PORT]) == [hash("B")]
    assert list(loads._disconnect_times[PORT]) == [at(1.2995)]
    assert list(loads._connected_until[PORT]) == [at(1.31) + CLOCK_ERROR]
    assert list(loads._untils_sorted[PORT]) == [at(1.31) + CLOCK_ERROR]  # B's first "until" went with it


@pytest.mark.parametrize("guarded", [True, False], ids=["arrivals-skipped", "arrivals-counted"])
def test_a_request_that_arrives_while_a_scrape_is_answered_ends_no_orphans_work(guarded: bool) -> None:
    """A's client left at 0.3 s; its work ran on to 2.0 s. B's request arrived 2 ms after the scrape
    of 0.5 s was sent, and the engine took it up 1 ms later, after it had read its gauges for that
    scrape (running 1: A). The connected count, widened by the clock error, holds B at that scrape:
    A's orphan is not in it, which is no evidence that A's work ended (a CI run's case: the zombie
    was judged aborted, its work end 1.06 s early)."""
    runs = {"A": (0.0, 2.0), "B": (0.503, 2.6)}
    spans = {"A": (0.0, 0.301), "B": (0.502, 0.8)}
    loads = scraped(runs)
    loads.register(PORT, "A", at(0.3), connected_until_ns=at(0.301) + CLOCK_ERROR)
    loads.register(PORT, "B", at(0.8), connected_until_ns=at(0.8) + CLOCK_ERROR)

    def arrived(start_ns: int, end_ns: int) -> int:
        return sum(1 for first, _ in spans.values() if start_ns < at(first) <= end_ns + CLOCK_ERROR)

    ended = loads.work_end(PORT, at(0.3), at(0.3), connected_counter(spans),
                           connected_until_ns=at(0.301) + CLOCK_ERROR, arrived=arrived if guarded else None)
    assert ended is not None and ended.work_end_ns is not None
    if guarded:
        assert ended.work_end_ns == at(1.95) and ended.orphaned_scrapes == 15  # 0.4 s and 0.6-1.9 s
    else:  # what the daemon judged before: the scrape of 0.5 s ended A's work
        assert ended.work_end_ns == at(0.45) and ended.orphaned_scrapes == 1


@pytest.mark.parametrize("guarded", [True, False], ids=["endings-confirmed", "endings-trusted"])
def test_a_request_finished_before_its_span_ends_hides_no_orphan(guarded: bool) -> None:
    """A's client left at 0.3 s; its work ran on to 2.0 s. B and C ran beside it and the engine
    finished them at 1.09 s, but their server spans ended only at 1.13 s (the last bytes sent on a
    loaded host): the scrape of 1.1 s counts both connected and running none of them, so shows no
    orphan. The next scrapes show A's again: that scrape is passed over (a CI run's case: the
    zombie's work end 271 ms early)."""
    runs = {"A": (0.0, 2.0), "B": (0.1, 1.09), "C": (0.15, 1.09)}
    spans = {"A": (0.0, 0.301), "B": (0.1, 1.13), "C": (0.15, 1.13)}
    loads = scraped(runs)
    loads.register(PORT, "A", at(0.3), connected_until_ns=at(0.301) + CLOCK_ERROR)

    def ending(start_ns: int, end_ns: int) -> int:
        return sum(1 for _, last in spans.values() if start_ns - CLOCK_ERROR < at(last) <= end_ns + 100 * MS)

    ended = loads.work_end(PORT, at(0.3), at(0.3), connected_counter(spans),
                           connected_until_ns=at(0.301) + CLOCK_ERROR, ending=ending if guarded else None)
    assert ended is not None and ended.work_end_ns is not None
    if guarded:
        assert ended.work_end_ns == at(1.95) and ended.orphaned_scrapes == 15  # 0.4-1.0 s and 1.2-1.9 s
    else:  # what the daemon judged before: the scrape of 1.1 s ended A's work
        assert ended.work_end_ns == at(1.05)
    # Where A's work ended between that scrape and the next, the next decides: between 1.0 and 1.2 s.
    runs["A"] = (0.0, 1.15)
    loads = scraped(runs)
    loads.register(PORT, "A", at(0.3), connected_until_ns=at(0.301) + CLOCK_ERROR)
    ended = loads.work_end(PORT, at(0.3), at(0.3), connected_counter(spans),
                           connected_until_ns=at(0.301) + CLOCK_ERROR, ending=ending)
    assert ended is not None and ended.work_end_ns == at(1.1) and ended.resolution_s == pytest.approx(0.2)
    # Where the endings cannot hide an orphan (A done by then too), that scrape decides at once.
    runs["A"] = (0.0, 1.09)
    loads = scraped(runs)
    loads.register(PORT, "A", at(0.3), connected_until_ns=at(0.301) + CLOCK_ERROR)
    ended = loads.work_end(PORT, at(0.3), at(0.3), connected_counter(spans),
                           connected_until_ns=at(0.301) + CLOCK_ERROR, ending=ending)
    assert ended is not None and ended.work_end_ns == at(1.05) and ended.read_until_ns == at(1.1)


def test_a_sweep_read_on_from_its_checkpoints_ends_where_a_whole_sweep_does() -> None:
    """The first test's A and B (B noticed late), the scrapes arriving one by one and A's work end
    read after each, on from the sweep's checkpoints (news dropping those it touches, as the
    correlator does each round): the same end and count as one sweep over them all, and the
    checkpoints taken hold B as a later departure still connected."""
    runs = {"A": (0.0, 1.95), "B": (0.9, 2.5)}
    spans = {"A": (0.0, 0.26), "B": (0.9, 1.75)}
    whole = scraped(runs)
    loads, sweep = EngineLoads(), ScrapeSweep()
    loads.register(PORT, "A", at(0.25), connected_until_ns=at(0.26) + CLOCK_ERROR)
    ended = None
    for tenth in range(31):
        if tenth == 13:
            loads.register(PORT, "B", at(1.2995), connected_until_ns=at(1.75) + CLOCK_ERROR)
        loads.add([EngineLoad(at(tenth / 10), PORT, running=sum(1 for start, end in runs.values()
                                                                if at(start) <= at(tenth / 10) < at(end)))])
        # As the correlator: scrapes are news from their moment, B's registration to A (left before it).
        for news in (loads.take_changed(), loads.take_registered().concerning(at(0.25), at(9), seen=0)):
            if news is not None:
                sweep.forget_from(news)
        ended = loads.work_end(PORT, at(0.25), at(0.25), connected_counter(spans),
                               connected_until_ns=at(0.26) + CLOCK_ERROR, sweep=sweep)
    whole.register(PORT, "A", at(0.25), connected_until_ns=at(0.26) + CLOCK_ERROR)
    whole.register(PORT, "B", at(1.2995), connected_until_ns=at(1.75) + CLOCK_ERROR)
    expected = whole.work_end(PORT, at(0.25), at(0.25), connected_counter(spans),
                              connected_until_ns=at(0.26) + CLOCK_ERROR)
    assert ended == expected and expected is not None and expected.work_end_ns == at(1.95)
    assert any(held for held, *_ in sweep.states)  # B's "until", from a checkpoint after 1.3 s


def test_a_sweep_is_reached_by_news_exactly_where_news_would_drop_checkpoints() -> None:
    sweep = ScrapeSweep()  # news drops checkpoints up to a second (its margin) before it
    assert sweep.resume(("port", "disconnect")) is None and not sweep.reaches(at(0))
    sweep.mark(at(1), ((), None, 0, None))
    sweep.mark(at(2), ((), at(2), 1, at(2)))
    for news, reaches, kept in ((3.5, False, 2), (3.0, True, 1)):
        assert sweep.reaches(at(news)) is reaches
        sweep.forget_from(at(news))
        assert len(sweep.at) == kept


def held_one_more(loads: EngineLoads, name: str, left: float, span_end: float,
                  spans: dict[str, tuple[float, float]]) -> tuple[bool, tuple[int, int] | None] | None:
    def spans_ended(start_ns: int, end_ns: int) -> int:
        return sum(1 for _, last in spans.values() if start_ns - CLOCK_ERROR <= at(last) <= end_ns + CLOCK_ERROR)
    return loads.held_one_more(PORT, name, at(left), at(spans[name][0]), at(span_end) + CLOCK_ERROR,
                               connected_counter(spans), lambda start, end: 0, lambda load, clients, read_before: 0,
                               no_within_ns=GRACE, spans_ended=spans_ended)


def test_a_leaving_that_adds_no_orphan_is_told_from_one_that_does() -> None:
    """D's client closed at 1.3 s after its last byte (its work ended at 1.29 s, its span at 1.3005
    s); C's cancelled at 1.3 s and ran on to 2.0 s. L's request runs from 0 to 3 s, its client
    connected. Latest leaver first, D would take an earlier leaver's orphan; its leaving added none."""
    spans = {"L": (0.0, 3.0), "D": (0.8, 1.3005), "C": (0.8, 1.3005), "Z": (0.0, 0.5005)}
    finished = scraped({"L": (0.0, 3.0), "D": (0.8, 1.29)})
    answer = held_one_more(finished, "D", 1.3, 1.3005, {n: spans[n] for n in ("L", "D")})
    assert answer == (False, (at(1.2), at(1.4)))  # compared from the scrape before the last that counted it
    cancelled = scraped({"L": (0.0, 3.0), "C": (0.8, 2.0)})
    assert held_one_more(cancelled, "C", 1.3, 1.3005, {n: spans[n] for n in ("L", "C")}) == (True, (at(1.2), at(1.4)))
    # Z's client left at 0.5 s and its work runs on to 2.5 s: its orphan may have ended as D's ran
    # on, which looks the same. No scrape within the grace after D left says no: D waits, and
    # after HELD_ONE_MORE_WINDOW_NS the answer is None (nothing tells).
    beside_zombie = scraped({"Z": (0.0, 2.5), "D": (0.8, 1.29)})
    assert held_one_more(beside_zombie, "D", 1.3, 1.3005, {n: spans[n] for n in ("Z", "D")}) is None
    with_zombie = scraped({"Z": (0.0, 2.5), "C": (0.8, 2.0)})
    assert held_one_more(with_zombie, "C", 1.3, 1.3005, {n: spans[n] for n in ("Z", "C")}) == (True, (at(1.2), at(1.4)))
    # Another disconnected request whose span ended between the scrapes may own the new orphan:
    # then either may have added it, and neither is told.
    both = scraped({"L": (0.0, 3.0), "C": (0.8, 2.0), "D": (0.8, 1.29)})
    both.register(PORT, "C", at(1.3), connected_until_ns=at(1.3005) + CLOCK_ERROR)
    assert held_one_more(both, "D", 1.3, 1.3005, spans) is None
    assert held_one_more(both, "C", 1.3, 1.3005, spans) == (True, (at(1.2), at(1.4)))  # its own is no other


def test_a_later_leaver_whose_rise_is_untold_may_own_the_orphans_an_earlier_one_is_given() -> None:
    """A's client left at 0.25 s and its work ran on to 1.43 s; B's left at 0.5 s, its work ran on
    to 2.5 s. C's client closed as its span ended, at 1.41 s, and its work ran on to 2.8 s; whether
    its leaving added an orphan is untold (A's ended in the same scrapes), so it is no registered
    leaver. Read as owning none, its orphan is taken for A's until B's work ends, then for B's:
    each end is given late, to a scrape's resolution. Each says how much earlier it may be, and
    the truth lies within."""
    runs = {"A": (0.0, 1.43), "B": (0.3, 2.5), "C": (0.6, 2.8)}
    spans = {"A": (0.0, 0.26), "B": (0.3, 0.51), "C": (0.6, 1.41)}
    loads = scraped(runs)
    loads.register(PORT, "A", at(0.25), connected_until_ns=at(0.26) + CLOCK_ERROR)
    loads.register(PORT, "B", at(0.5), connected_until_ns=at(0.51) + CLOCK_ERROR)
    loads.racing(PORT, "C", (at(1.41), at(1.41) + CLOCK_ERROR))
    for name, left, truth, estimate, earliest in (("A", 0.25, 1.43, 2.45, 1.4), ("B", 0.5, 2.5, 2.75, 2.4)):
        ended = loads.work_end(PORT, at(left), at(left), connected_counter(spans),
                               connected_until_ns=at(spans[name][1]) + CLOCK_ERROR)
        assert ended is not None and ended.work_end_ns == at(estimate) and ended.resolution_s == pytest.approx(0.1)
        assert ended.earliest_ns == at(earliest), name
        assert ended.earliest_ns <= at(truth) <= ended.work_end_ns + at(ended.resolution_s / 2)
    # Told to have added none (``held_one_more`` no), or registered, C leaves no doubt.
    loads.racing(PORT, "C", None)
    ended = loads.work_end(PORT, at(0.25), at(0.25), connected_counter(spans), connected_until_ns=at(0.26) + CLOCK_ERROR)
    assert ended is not None and ended.earliest_ns is None
    loads.register(PORT, "C", at(1.41), connected_until_ns=at(1.41) + CLOCK_ERROR)
    ended = loads.work_end(PORT, at(0.25), at(0.25), connected_counter(spans), connected_until_ns=at(0.26) + CLOCK_ERROR)
    assert ended is not None and ended.work_end_ns == at(1.45) and ended.earliest_ns is None
    # A racer that left before A (or as A did) is no later leaver: it changes nothing of A's end.
    early = scraped(runs)
    early.register(PORT, "A", at(0.25), connected_until_ns=at(0.26) + CLOCK_ERROR)
    early.register(PORT, "B", at(0.5), connected_until_ns=at(0.51) + CLOCK_ERROR)
    early.racing(PORT, "D", (at(0.2), at(0.2) + CLOCK_ERROR))
    early.racing(PORT, "E", (at(0.25), at(0.2505) + CLOCK_ERROR))
    ended = early.work_end(PORT, at(0.25), at(0.25), connected_counter(spans), connected_until_ns=at(0.26) + CLOCK_ERROR)
    assert ended is not None and ended.earliest_ns is None


def logged_scrapes(logs: list[float], runs: dict[str, tuple[float, float]]) -> EngineLoads:
    """Scrapes every 100 ms for 3 s of an engine that sets its gauges only when it logs (SGLang),
    at ``logs`` (seconds): each shows what the last log held of ``runs``."""
    loads = EngineLoads()
    for tenth in range(31):
        log = max(i for i, when in enumerate(logs) if when <= tenth / 10)
        held = sum(1 for start, end in runs.values() if start <= logs[log] < end)
        loads.add([EngineLoad(at(tenth / 10), PORT, running=held, style="sglang", step_tokens=float(log))])
    return loads


def test_a_logged_engine_compares_a_leaving_with_gauges_logged_before_the_request_began() -> None:
    """A batch full (SGLang, two slots): W1 and W2 arrive at 0.4 and 0.45 s and their clients leave
    at once; they wait for a slot and are logged only at the next decode log, 0.98 s, and run on.
    D's request, prefilled and logged at 0.26 s, completes at 0.95 s and its client closes. The
    scrape compared with (0.8 s) shows the log of 0.26 s, which came before W1 and W2 arrived:
    read against it, the two were a rise D's leaving made, and D a zombie (2 of 4 completed
    requests in bench/weak_signals.py with --max-batch=2). D's own log came after 0.2 s: that
    scrape is compared with, and W1 and W2 are leavers that may have added an orphan since."""
    logs = [0.0, 0.26, 0.98, 1.38, 1.78, 2.18, 2.58]
    spans = {"D": (0.25, 0.951), "W1": (0.4, 0.401), "W2": (0.45, 0.451)}

    def loads(d_runs_to: float) -> EngineLoads:
        scrapes = logged_scrapes(logs, {"D": (0.25, d_runs_to), "W1": (0.4, 3.0), "W2": (0.45, 3.0)})
        for name in ("W1", "W2"):
            scrapes.register(PORT, name, at(spans[name][0]), connected_until_ns=at(spans[name][1]) + CLOCK_ERROR)
        return scrapes
    completed = held_one_more(loads(0.95), "D", 0.95, 0.951, spans)
    assert completed is not None and completed[0] is None, completed  # no rise beyond the two: untold
    assert held_one_more(loads(3.0), "D", 0.95, 0.951, spans) == (True, (at(0.0), at(1.4)))


def test_a_leaver_logged_after_it_began_claims_no_orphan_of_an_earlier_one() -> None:
    """E's client left at 0.23 s and its work ran on to 2.0 s. N arrived at 0.27 s, after the log of
    0.25 s, and left at once; it waited and ran from the next log on. The scrapes that show the log
    of 0.25 s hold A and E: N, the newer leaver, is not in them, but latest leaver first it took
    E's orphan, and E's work was judged stopped at its close. N may be missing from them: they say
    nothing of E, and the next log's do."""
    logs = [0.0, 0.25, 0.65, 1.05, 1.45, 1.85, 2.25, 2.65]
    spans = {"A": (0.2, 0.9), "E": (0.21, 0.231), "N": (0.27, 0.271)}
    loads = logged_scrapes(logs, {"A": (0.2, 0.9), "E": (0.21, 2.0), "N": (0.27, 2.5)})
    for name, left in (("E", 0.23), ("N", 0.27)):
        loads.register(PORT, name, at(left), connected_until_ns=at(spans[name][1]) + CLOCK_ERROR)
    ended = loads.work_end(PORT, at(0.23), at(0.23), connected_counter(spans),
                           connected_until_ns=at(0.231) + CLOCK_ERROR)
    assert ended is not None and ended.work_end_ns == at(2.25) and ended.orphaned_scrapes == 16, ended


def test_a_logged_engine_reads_every_scrape_of_one_log_alike() -> None:
    """Z's client left at 0.3 s and its work ran on to 2.0 s. Behind nginx without upstream
    keepalive, A1 and A2 arrived at 0.65 s on new upstream connections, after the log of 0.55 s
    that the scrapes of 0.6 s and 0.7 s both show. Read as each was read, 0.6 s held Z's orphan and
    0.7 s none (A1 and A2 counted connected, not in that log): Z's work was judged stopped at
    0.65 s (zombies read as aborted in bench/behind_nginx.py on SGLang's cadence with a full batch).
    Read against the requests connected while that log may have been set, both say the same; the
    log that dropped Z (2.15 s) ends its work. The logs that may predate its close say nothing."""
    logs = [0.0, 0.25, 0.55, 0.95, 1.35, 1.75, 2.15, 2.55]
    spans = {"Z": (0.1, 0.301), "A1": (0.65, 1.5), "A2": (0.65, 1.5)}
    loads = logged_scrapes(logs, {"Z": (0.1, 2.0), "A1": (0.65, 1.5), "A2": (0.65, 1.5)})
    loads.register(PORT, "Z", at(0.3), connected_until_ns=at(0.301) + CLOCK_ERROR)
    ended = loads.work_end(PORT, at(0.3), at(0.3), connected_counter(spans), connected_until_ns=at(0.301) + CLOCK_ERROR)
    assert ended is not None and ended.work_end_ns == at(2.15) and ended.orphaned_scrapes == 16, ended


def test_a_logged_engine_says_no_only_with_the_requests_that_ended_in_its_log_interval_as_orphans() -> None:
    """Z's client left at 0.46 s after a chunk and its work ran on to 2.0 s. The next log (0.585 s,
    between the scrapes of 0.5 s and 0.6 s) came after C completed (0.584 s, its client closing at
    0.588 s) and after W, cancelled while it waited, took C's slot: it holds Z, W and Q. Read
    against the requests connected at any moment of its interval (C, W, Q), it showed no orphan,
    and Z's leaving was said to add none: a zombie judged `unconfirmed`, and a later leaver took
    its orphan (a completed request judged a zombie behind nginx on SGLang's cadence with a full
    batch). C and W ended in that interval, so may be missing from its gauges: no says nothing
    there, and the next log (1.05 s) shows Z's orphan."""
    logs = [0.0, 0.05, 0.35, 0.585, 1.05, 1.45, 1.85, 2.25, 2.65]
    spans = {"Z": (0.06, 0.461), "C": (0.06, 0.588), "W": (0.08, 0.584), "Q": (0.09, 3.0)}
    loads = logged_scrapes(logs, {"Z": (0.06, 2.0), "C": (0.06, 0.584), "W": (0.08, 2.3), "Q": (0.09, 3.0)})
    loads.register(PORT, "W", at(0.582), connected_until_ns=at(0.584) + CLOCK_ERROR)
    assert held_one_more(loads, "Z", 0.46, 0.461, spans) == (True, (at(0.0), at(1.1)))


def test_a_logged_engine_counts_no_orphan_of_a_request_that_closed_after_its_log() -> None:
    """SGLang's gauges are its last log's. Behind nginx without upstream keepalive each upstream
    connection closes as its answer ends: Y's request completed at 1.449 s and closed at 1.45 s,
    after the log of 1.42 s that held it; the scrape of 1.5 s shows that log. D's client closed at
    1.3 s after its last byte (its work ended at 1.29 s); L runs on, connected. Y is connected at
    every moment since that log may show, so no orphan, and D's leaving is no rise (not a zombie).
    Nor is it a no: Y's span ended in that log's interval, and a log after its end holding L and an
    orphan of D's would read the same; the next log is past the grace, so nothing tells. C,
    cancelled at the same moment and run on to 2.0 s, did add one."""
    logs = [0.0, 0.42, 0.82, 1.22, 1.42, 1.82, 2.22, 2.62]

    def logged(runs: dict[str, tuple[float, float]]) -> EngineLoads:
        return logged_scrapes(logs, runs)
    spans = {"L": (0.0, 3.0), "Y": (0.5, 1.45), "D": (0.8, 1.3005)}
    finished = logged({"L": (0.0, 3.0), "Y": (0.5, 1.449), "D": (0.8, 1.29)})
    assert held_one_more(finished, "D", 1.3, 1.3005, spans) is None
    cancelled = logged({"L": (0.0, 3.0), "Y": (0.5, 1.449), "C": (0.8, 2.0)})
    assert held_one_more(cancelled, "C", 1.3, 1.3005, {"L": spans["L"], "Y": spans["Y"], "C": spans["D"]}) \
        == (True, (at(0.0), at(1.5)))


def test_a_leaving_is_compared_with_a_scrape_that_says_and_none_before_it_says_yes() -> None:
    spans = {"Z": (0.0, 0.5005), "C": (0.8, 1.3005)}
    loads = scraped({"Z": (0.0, 2.5), "C": (0.8, 2.4)})
    # The port's clients were listed at 1.2 s, and not at 1.4 s, before the daemon heard of the
    # close: that scrape says nothing, nor does any up to 0.75 s after the disconnect.
    loads.add([EngineLoad(at(1.2), PORT, running=2, connections=())])
    assert held_one_more(loads, "C", 1.3, 1.3005, spans) == (True, (at(1.2), at(2.1)))
    # U's request, read at 0.05 s, runs on and its span has not come: the engine holds it at every
    # scrape and nothing counts it connected. Listed untold at 2.1 s, it is no orphan there, nor at
    # the scrapes compared with, which held it too.
    untold = scraped({"Z": (0.0, 2.5), "C": (0.8, 2.4), "U": (0.0, 3.0)})
    untold.add([EngineLoad(at(2.1), PORT, running=3, connections=(("127.0.0.1", 40100, at(0.05), ""),))])

    def unspanned(load: EngineLoad, clients: tuple[tuple[str, int, int, str], ...], read_before: int | None) -> int:
        return sum(1 for _, _, last_read, _ in clients if read_before is None or last_read <= read_before)
    answer = untold.held_one_more(PORT, "C", at(1.3), at(0.8), at(1.3005) + CLOCK_ERROR, connected_counter(spans),
                                  lambda start, end: 0, unspanned, no_within_ns=GRACE)
    assert answer == (True, (at(1.2), at(2.1)))
    assert held_one_more(scraped({}), "C", 4.0, 4.0005, spans) is None  # no scrape after it yet
    late = EngineLoads()  # scraping began after it left (a daemon started since): nothing to compare
    late.add([EngineLoad(at(2.0 + tenth / 10), PORT, running=1) for tenth in range(5)])
    assert held_one_more(late, "C", 1.3, 1.3005, spans) == (True, None)


def test_a_request_arriving_as_a_scrape_is_read_leaves_that_scrape_undecided() -> None:
    """N's request arrived 1 ms after the scrape of 1.4 s was sent: that scrape counts it
    connected, and the engine took it up only at 1.45 s. With N not held there, C's leaving would
    seem to add no orphan; with it held, one. That scrape says neither, and the next says yes.
    Where no scrape says within the window, the answer is None: nothing tells."""
    spans = {"Z": (0.0, 0.5005), "C": (0.8, 1.3005), "N": (1.401, 3.0)}
    loads = scraped({"Z": (0.0, 2.5), "C": (0.8, 2.0), "N": (1.45, 3.0)})

    def arrived(start_ns: int, end_ns: int) -> int:
        return sum(1 for first, _ in spans.values() if start_ns < at(first) <= end_ns + CLOCK_ERROR)

    def ask(loads: EngineLoads) -> tuple[bool | None, tuple[int, int] | None] | None:
        return loads.held_one_more(PORT, "C", at(1.3), at(0.8), at(1.3005) + CLOCK_ERROR, connected_counter(spans),
                                   arrived, lambda load, clients, read_before: 0, no_within_ns=GRACE)
    assert ask(loads) == (True, (at(1.2), at(1.5)))
    # Each scrape after it listed incompletely (accepts while the kernel was walked): none says.
    busy = EngineLoads()
    busy.add([EngineLoad(at(tenth / 10), PORT, running=(tenth < 25) + (8 <= tenth < 20),
                         connections=None if tenth < 14 else (), connections_complete=tenth < 14)
              for tenth in range(41)])
    assert ask(busy) == (None, (at(1.2), at(3.4)))


def test_a_registration_whose_span_ended_between_the_scrapes_compared_is_news_from_the_first() -> None:
    loads = EngineLoads()
    loads.register(PORT, "X", at(0.5), connected_until_ns=at(1.25))  # left before D, span ended after 1.2 s
    registered = loads.take_registered()
    assert registered.concerning(at(1.3), at(2.0), seen=0) is None  # left before D: no news to its sweep
    assert registered.concerning(at(1.3), at(2.0), seen=0, compared=(at(1.2), at(1.4))) == at(1.2)
    assert registered.concerning(at(1.3), at(2.0), seen=1, compared=(at(1.2), at(1.4))) is None
    assert registered.concerning(at(1.3), at(2.0), seen=0, compared=(at(1.3), at(1.4))) is None


def test_a_scrape_read_as_its_span_began_is_not_compared_with() -> None:
    """C's request arrived 5 ms after the scrape of 1.2 s was sent, and the engine took it up before
    reading its gauges: that scrape counts it connected and held, where an arrival it counts
    connected may not be held yet. Which, nothing tells: the scrape is passed over for the one before."""
    spans = {"Z": (0.0, 0.5005), "C": (1.205, 1.3005)}
    loads = EngineLoads()
    loads.add([EngineLoad(at(tenth / 10), PORT, running=1 + (12 <= tenth < 25), answered_ns=at(tenth / 10) + 10 * MS)
               for tenth in range(31)])

    def arrived(start_ns: int, end_ns: int) -> int:
        return sum(1 for first, _ in spans.values() if start_ns < at(first) <= end_ns + CLOCK_ERROR)
    answer = loads.held_one_more(PORT, "C", at(1.3), at(1.205), at(1.3005) + CLOCK_ERROR, connected_counter(spans),
                                 arrived, lambda load, clients, read_before: 0, no_within_ns=GRACE)
    assert answer == (True, (at(1.1), at(1.4)))


def listed_load(seconds: float, held: int, clients: int, complete: bool = True, answer_ms: int = 5) -> EngineLoad:
    connections = tuple(("127.0.0.1", 40000 + i, at(seconds), "") for i in range(clients))
    return EngineLoad(at(seconds), PORT, running=held, answered_ns=at(seconds) + answer_ms * MS,
                      connections=connections, connections_complete=complete)


def test_orphans_past_the_grace_are_told_by_the_port_alone() -> None:
    """vLLM's five-second span export: no span says whose the work is yet. Two clients connected,
    three requests held; the third's client left at 1.0 s."""
    loads = EngineLoads()
    loads.note_departure(("127.0.0.1", 39999, PORT), at(1.0))
    loads.add([listed_load(1.25, held=3, clients=2), listed_load(1.75, held=3, clients=2)])
    # Within the grace at 1.25 s: it may yet be aborted; 0.75 s after it left, by 1.75 s, it was not.
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(1.3)) == (0, at(1.25))
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.5)) == (1, at(1.75))
    # A scrape not yet read far enough past its answer for its time's closes to have come is not read.
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(1.75)) == (0, at(1.25))
    # The work stopped: the next listed scrape holds only the two connected.
    loads.add([listed_load(2.0, held=2, clients=2)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(3.0)) == (0, at(2.0))


def test_sglang_gauges_count_no_orphan_of_a_request_that_finished_before_its_log_was_shown() -> None:
    """SGLang's gauges are its last log's (every 40 decode steps): the log at 1.01 s held the
    request that finished and whose client left at 1.02 s, and the engine, idle, logs no more.
    Its scrapes show that log from 1.1 s on; 0.7 s after the client left it is no orphan: the
    clients that left since the scrape before the log was shown count against it."""
    loads = EngineLoads()

    def logged(seconds: float, held: int, log: int) -> EngineLoad:
        load = listed_load(seconds, held=held, clients=0)
        return EngineLoad(load.ts_ns, PORT, running=held, answered_ns=load.answered_ns, connections=(),
                          connections_complete=True, style="sglang", step_tokens=float(log))
    loads.add([logged(1.0, 1, 1)])
    loads.note_departure(("127.0.0.1", 39999, PORT), at(1.02))
    loads.add([logged(seconds / 10, 1, 2) for seconds in range(11, 19)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.5)) == (0, at(1.8))
    # Logged after the client left (a log at 1.85 s still holding it): an orphan.
    loads.add([logged(1.9, 1, 3)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(3.0)) == (1, at(1.9))


def test_an_orphan_whose_work_is_known_to_have_ended_leaves_the_count_at_once() -> None:
    """A zombie settled by its span (its work ended at 2.1 s) while the port's latest listed scrape
    (1.75 s) still holds it: the count drops with the span, not seconds later with a new listing.
    Work that ended before that scrape, or that left within its grace, was never counted there."""
    loads = EngineLoads()
    loads.note_departure(("127.0.0.1", 39999, PORT), at(1.0))
    loads.add([listed_load(1.75, held=3, clients=2)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.5)) == (1, at(1.75))
    loads.work_ended(PORT, "aborted", left_ns=at(1.6), ended_ns=at(1.62), grace_ns=GRACE)  # never an orphan
    loads.work_ended(PORT, "earlier", left_ns=at(0.2), ended_ns=at(1.7), grace_ns=GRACE)  # ended before the scrape
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.5)) == (1, at(1.75))
    loads.work_ended(PORT, "zombie", left_ns=at(1.0), ended_ns=at(2.1), grace_ns=GRACE)
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.5)) == (0, at(1.75))
    # Another port's ends are not this one's.
    loads.work_ended(PORT + 1, "elsewhere", left_ns=at(1.0), ended_ns=at(2.4), grace_ns=GRACE)
    loads.add([listed_load(2.25, held=3, clients=2)])  # an orphan of a client that left unseen
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(3.0)) == (1, at(2.25))


def test_the_ends_kept_for_the_count_stay_few() -> None:
    """A zombie a second on a port never listed again: only the ends of the last seconds are kept."""
    loads = EngineLoads()
    for second in range(1000):
        loads.work_ended(PORT, f"z{second}", left_ns=at(second), ended_ns=at(second + 2), grace_ns=GRACE)
    assert len(loads._ended[PORT]) <= 2 * 64


def test_an_orphan_counts_against_a_close_of_its_scrapes_time_not_its_own() -> None:
    """A client that left just before the scrape (or a polled close seen just after it) may own the
    orphan: however long ago the other left, the count is a lower bound, never an extra one."""
    loads = EngineLoads()
    loads.note_departure(("127.0.0.1", 39998, PORT), at(0.2))
    loads.add([listed_load(1.5, held=1, clients=0)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(3.0)) == (1, at(1.5))
    loads.note_departure(("127.0.0.1", 39997, PORT), at(1.4))  # within the grace before it
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(3.0)) == (0, at(1.5))
    loads.note_departure(("127.0.0.1", 39996, PORT), at(1.9))  # after its answer, within a poll's slack
    loads.add([listed_load(1.75, held=2, clients=0)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(3.0)) == (0, at(1.75))


def test_an_incomplete_or_stale_listing_tells_no_orphans() -> None:
    loads = EngineLoads()
    loads.note_departure(("127.0.0.1", 39999, PORT), at(0.1))
    loads.add([listed_load(1.0, held=1, clients=0)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.0)) == (1, at(1.0))
    # A client accepted between the listing and the answer may be missing from it: the scrape
    # before is the latest that tells.
    loads.add([listed_load(1.25, held=2, clients=0, complete=False)])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.0)) == (1, at(1.0))
    assert loads.held_beyond_listed(PORT) == (at(1.25) + 5 * MS, None)
    # A listing of seconds ago says nothing of now; nor does a port never listed.
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(4.5)) is None
    loads.add([EngineLoad(at(1.5), PORT + 1, running=3)])
    assert loads.orphans_past(PORT + 1, GRACE, read_by_ns=at(2.0)) is None


def test_idle_clients_count_against_the_port_and_a_queued_orphan_only_once_it_runs() -> None:
    """A request that only waits in the queue costs nothing (DESIGN §5): its client gone, it is no
    orphan until the engine runs it. An idle kept-alive client counts against the count."""
    loads = EngineLoads()
    loads.note_departure(("127.0.0.1", 39999, PORT), at(0.1))
    # One running, its client listed, and the leaver's request waiting: no orphan yet.
    loads.add([EngineLoad(at(1.0), PORT, running=1, waiting=1, answered_ns=at(1.005),
                          connections=(("127.0.0.1", 40000, at(0.9), ""),))])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.0)) == (0, at(1.0))
    assert loads.held_beyond_listed(PORT) is None
    # The engine takes it up: two running, one client.
    loads.add([EngineLoad(at(1.25), PORT, running=2, waiting=0, answered_ns=at(1.255),
                          connections=(("127.0.0.1", 40000, at(0.9), ""),))])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.0)) == (1, at(1.25))
    assert loads.held_beyond_listed(PORT) == (at(1.255), 1)
    # A third client listed, idle on a kept-alive connection: the orphan can no longer be told.
    loads.add([EngineLoad(at(1.5), PORT, running=2, waiting=0, answered_ns=at(1.505),
                          connections=tuple(("127.0.0.1", 40000 + i, at(0.9), "") for i in range(2)))])
    assert loads.orphans_past(PORT, GRACE, read_by_ns=at(2.5)) == (0, at(1.5))
    assert loads.held_beyond_listed(PORT) is None


def test_a_busy_engines_listings_are_kept_only_near_a_clients_close() -> None:
    """Listings made only because the engine was busy are read for the scrapes soon after a close
    (in place of a scrape the daemon could not have had listed yet):
    once the daemon had time to hear of every close (BUSY_LISTING_SETTLE_NS), those that no close
    came up to BUSY_LISTING_NEAR_NS before are forgotten; the rest, and every listing made because
    a client left or a verdict asked, stay for the memory window."""
    from auditor.correlate.evidence import BUSY_LISTING_NEAR_NS, BUSY_LISTING_SETTLE_NS

    loads = EngineLoads()
    client = (("127.0.0.1", 40100, at(0.0), ""),)
    loads.note_departure(("127.0.0.1", 40200, PORT), at(5.0))
    for tenth in range(0, 300, 5):  # every half second for 30 s, busy throughout
        loads.add([EngineLoad(at(tenth / 10), PORT, running=1, connections=client,
                              listed_while_busy=tenth != 100)])  # the one at 10 s: a verdict asked
    kept = sorted(loads._busy_clients[PORT])
    settled = at(29.5) - BUSY_LISTING_SETTLE_NS
    near = [ts for ts in range(at(5.0), at(5.0) + BUSY_LISTING_NEAR_NS + 1, at(0.5))]
    assert [ts for ts in kept if ts < settled] == near, [ts / S for ts in kept]
    assert [ts for ts in kept if ts >= settled] == list(range(settled, at(29.5) + 1, at(0.5)))
    assert list(loads._clients[PORT]) == [at(10.0)]  # asked for: kept with the others
    # A busy-only listing stands in for a scrape only within UNLISTED_AFTER_LEAVING_NS of a close.
    from auditor.correlate.evidence import _UNLISTED

    assert loads._listing(loads._clients[PORT], PORT, at(5.5), at(5.0)) == client
    assert loads._listing(loads._clients[PORT], PORT, at(6.5), at(5.0)) is _UNLISTED
