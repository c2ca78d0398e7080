"""Engines' own abort counters: read from /metrics under each engine's names, and used as evidence
that a cancelled request's work stopped only when they rose by as many as the requests that left."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pytest

from auditor.correlate import Correlator
from auditor.model import ConnEventKind, EngineLoad
from auditor.store import Store, VerdictRow
from collectors.enginemetrics import parse_load
from tests.test_correlate import CLIENT, SERVER_PORT, T0, Clock, close, http_span, make, verdicts

S = 1_000_000_000

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 3.0
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 0.0
# TYPE sglang:num_aborted_requests_total counter
sglang:num_aborted_requests_total{model_name="m"} 4.0
"""
LLAMACPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""
# TGI (the metrics crate): a counter's series appears with its first count; a client gone is "dropped".
TGI = """# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 2
# TYPE tgi_request_failure counter
tgi_request_failure{err="validation"} 5
tgi_request_failure{err="dropped"} 2
"""


@pytest.mark.parametrize(("page", "aborted"), [
    (VLLM, 3.0), (VLLM.replace('finished_reason="abort"', 'finished_reason="stop"'), 0.0),
    (SGLANG, 4.0), (LLAMACPP, None), (TGI, 2.0),
    (TGI.replace('tgi_request_failure{err="dropped"} 2\n', ""), 0.0),  # none dropped yet: no series
    ("\n".join(line for line in TGI.splitlines() if "failure" not in line), 0.0)])
def test_the_abort_count_is_read_under_each_engines_names(page: str, aborted: float | None) -> None:
    load = parse_load(page, ts_ns=1, server_port=8000)
    assert load is not None and load.aborted == aborted


def load(at: float, aborted: float | None, running: int = 0) -> EngineLoad:
    return EngineLoad(ts_ns=T0 + int(at * S), server_port=SERVER_PORT, running=running, style="vllm",
                      aborted=aborted)


def raced(correlator: Correlator, store: Store, clients: list[tuple[str, int]], aborts: list[float | None]) -> None:
    """Requests whose server span ended within a millisecond of the client's close, with no orphan
    seen after: the close raced the span's end, and only the abort counter can tell."""
    store.insert_spans([http_span(str(i + 1), 0, 1.0005, span=str(i + 1), client=c) for i, c in enumerate(clients)])
    store.insert_conn_events([close(1.0, ConnEventKind.PEER_FIN, client=c) for c in clients])
    correlator.add_engine_load([load(0.9, aborts[0]), load(1.1, aborts[1]), load(1.3, aborts[2])])


@pytest.mark.parametrize(("aborts", "verdict"), [
    ([3.0, 4.0, 4.0], "aborted"),  # the counter rose by one around the one departure
    ([3.0, 3.0, 3.0], "unconfirmed"),  # no abort: a response that just ended looks the same
    ([None, None, None], "unconfirmed"),  # an engine that counts no aborts (llama.cpp)
    ([3.0, 2.0, 2.0], "unconfirmed")])  # a reset (engine restart) says nothing
def test_a_close_racing_the_span_end_is_aborted_only_when_the_engine_counted_the_abort(
        store: Store, aborts: list[float | None], verdict: str) -> None:
    clock = Clock()
    correlator = make(store, clock)
    raced(correlator, store, [CLIENT], aborts)
    clock.now = T0 + 9 * S
    correlator.tick()
    [row] = verdicts(store)
    assert row.verdict == verdict, str(row.details)
    assert row.details.get("aborts_counted", False) is (verdict == "aborted")
    if verdict == "aborted":
        assert row.details["evidence"] == "engine_metrics"


def test_fewer_aborts_than_departures_abort_none_of_them(store: Store) -> None:
    clock = Clock()
    correlator = make(store, clock)
    raced(correlator, store, [CLIENT, ("127.0.0.1", 40002)], [3.0, 4.0, 4.0])
    clock.now = T0 + 9 * S
    correlator.tick()
    assert sorted(r.verdict for r in verdicts(store)) == ["unconfirmed", "unconfirmed"]


def test_as_many_aborts_as_departures_abort_each(store: Store) -> None:
    clock = Clock()
    correlator = make(store, clock)
    raced(correlator, store, [CLIENT, ("127.0.0.1", 40002)], [3.0, 5.0, 5.0])
    clock.now = T0 + 9 * S
    correlator.tick()
    assert sorted(r.verdict for r in verdicts(store)) == ["aborted", "aborted"]


def test_a_late_abort_of_an_earlier_departure_is_not_taken_for_a_completed_requests(store: Store) -> None:
    clock = Clock()
    correlator = make(store, clock)
    early, done = ("127.0.0.1", 40002), CLIENT
    # The engine aborts the request whose client left at 0.0 only about a second later, just as
    # another response ends and its client closes (a close racing the span's end).
    store.insert_spans([http_span("1", -1, 0.0005, span="1", client=early), http_span("2", 0.5, 1.0005, span="2",
                                                                                       client=done)])
    store.insert_conn_events([close(0.0, ConnEventKind.PEER_RST, client=early), close(1.0, client=done)])
    # The gauges held the early request on after its client left (with the other one from 0.5 s).
    correlator.add_engine_load([load(-0.5, 3.0, 1), load(0.1, 3.0, 1), load(0.5, 3.0, 2), load(0.9, 3.0, 2),
                                load(1.1, 4.0), load(1.3, 4.0)])
    clock.now = T0 + 9 * S
    correlator.tick()
    rows = {r.client_port: r for r in verdicts(store)}
    assert rows[done[1]].verdict != "aborted", rows[done[1]].details


@pytest.mark.parametrize(("aborts", "verdict"), [
    ([2.0, 3.0, 3.0, 3.0, 3.0], "unconfirmed"),  # nothing aborted: the engine finished it
    ([2.0, 3.0, 3.0, 4.0, 4.0], "aborted"),  # the abort counted a scrape after the answer
    ([2.0, 3.0, 3.0, None, 3.0], "aborted"),  # a scrape without the count says nothing
    ([3.0, 3.0, 3.0, 3.0, 3.0], "aborted"),  # never seen to rise: may count no client's abort (vLLM)
    ([None, None, None, None, None], "aborted")])  # no abort counter (llama.cpp): the gauges alone
def test_a_span_that_ended_well_after_the_close_is_no_abort_where_the_engine_aborted_nothing(
        store: Store, aborts: list[float | None], verdict: str) -> None:
    """A loaded server ends its span 30 ms after the last byte (its event loop held by other work):
    its client, which read it all and closed, looks like a cancel the server reacted to. The
    gauges never held it after; an engine that counts its aborts counted none."""
    clock = Clock()
    correlator = make(store, clock)
    store.insert_spans([http_span("1", 0, 1.03)])
    store.insert_conn_events([close(1.0, ConnEventKind.PEER_FIN)])
    for at, aborted in zip((0.5, 0.9, 1.1, 1.3, 1.5), aborts, strict=True):  # one by one, as scraped
        correlator.add_engine_load([load(at, aborted)])
    clock.now = T0 + 9 * S
    correlator.tick()
    [row] = verdicts(store)
    assert row.verdict == verdict, str(row.details)
    assert row.details.get("no_abort_counted", False) is (verdict == "unconfirmed"), row.details
    if verdict == "unconfirmed":
        assert row.details["unconfirmed_because"] == "raced_its_answer", row.details


# -- Counts of normal finishes: no abort counted, but a completed request counted ---------------
LLAMACPP_TOKENS = LLAMACPP + """# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 340
"""


@pytest.mark.parametrize(("page", "finished"), [
    (VLLM, 9.0),  # stop and length, not abort
    (VLLM.replace("} 7.0", "} 0.0").replace("} 2.0", "} 0.0"), 0.0),
    (SGLANG, None), (LLAMACPP, None),
    (LLAMACPP_TOKENS, 340.0),  # the tokens of the requests it finished normally
    (TGI, 0.0),  # its counter listed from the first success: none yet
    (TGI + "# TYPE tgi_request_success counter\ntgi_request_success 12\n", 12.0)])
def test_the_count_of_normal_finishes_is_read_under_each_engines_names(page: str, finished: float | None) -> None:
    parsed = parse_load(page, ts_ns=1, server_port=8000)
    assert parsed is not None and parsed.finished == finished


def test_llamacpps_finish_count_is_its_generated_token_count_too() -> None:
    parsed = parse_load(LLAMACPP_TOKENS, ts_ns=1, server_port=8000)
    assert parsed is not None and parsed.generated_tokens == parsed.finished == 340.0


def counted(at: float, finished: float | None, style: str = "vllm") -> EngineLoad:
    """A scrape of ``style``'s page (vLLM's): running the one request of ``raced_alone`` while it is
    in flight."""
    return EngineLoad(ts_ns=T0 + int(at * S), server_port=SERVER_PORT, running=int(0.2 < at < 1.0), style=style,
                      aborted=None if style == "llamacpp" else 0.0, finished=finished)


def raced_alone(store: Store, route: str = "/v1/completions", kind: ConnEventKind = ConnEventKind.PEER_FIN,
                status: int = 200) -> None:
    """One request from 0.2 s to 1.0005 s, its client closing at 1.0 (a FIN or a reset): the close
    raced its span's end, and the gauges never held it after (vLLM's abort counter stays flat)."""
    store.insert_spans([replace(http_span("1", 0.2, 1.0005, span="1"), route=route, http_status=status)])
    store.insert_conn_events([close(1.0, kind)])


SCRAPES_AT = (-0.2, 0.1, 0.3, 0.9, 1.05, 1.3, 1.5)


def judged_alone(store: Store, counts: Iterable[tuple[float, float | None]], style: str = "vllm",
                 **request: Any) -> VerdictRow:
    """``raced_alone``'s request judged 9 s on, from scrapes of ``style``'s page (when, the finish count)."""
    clock = Clock()
    correlator = make(store, clock)
    raced_alone(store, **request)
    correlator.add_engine_load([counted(at, count, style) for at, count in counts])
    clock.now = T0 + 9 * S
    correlator.tick()
    [row] = verdicts(store)
    return row


@pytest.mark.parametrize("kind", [ConnEventKind.PEER_FIN, ConnEventKind.PEER_RST])
@pytest.mark.parametrize(("counts", "route", "verdict"), [
    # An earlier request finished (7 -> 8), then nothing while this one ran: no complete answer.
    ([7, 8, 8, 8, 8, 8, 8], "/v1/completions", "aborted"),
    ([7, 8, 8, 8, 9, 9, 9], "/v1/completions", "unconfirmed"),  # a finish while it ran: maybe its own
    ([8, 8, 8, 8, 8, 8, 9], "/v1/completions", "aborted"),  # one after the scrape that says: another's
    ([8, 8, 8, 8, 8, 8, 8], "/v1/completions", "unconfirmed"),  # never seen to count: may not count
    ([7, 8, 8, 8, 8, 8, 8], "/health", "unconfirmed"),  # a request the count never counts
    ([7, 8, None, 8, 8, 8, 8], "/v1/completions", "unconfirmed")])  # a scrape without the count
def test_a_close_racing_the_span_end_is_aborted_where_no_finish_was_counted_while_it_ran(
        store: Store, kind: ConnEventKind, counts: list[float | None], route: str, verdict: str) -> None:
    row = judged_alone(store, zip(SCRAPES_AT, counts, strict=True), route=route, kind=kind)
    assert row.verdict == verdict, str(row.details)
    assert row.details.get("no_finish_counted", False) is (verdict == "aborted")
    if verdict == "unconfirmed":
        assert row.details["unconfirmed_because"] == "raced_its_answer"


def test_a_racing_close_waits_for_the_scrape_after_its_answer_to_read_the_finish_count(store: Store) -> None:
    """The count is read up to the first scrape a quarter second after the span ended (vLLM counts
    a finish as it hands the last token over, a few milliseconds after the server may have sent
    it): until that scrape, no verdict; with it, the count that stood still says aborted."""
    clock = Clock()
    correlator = make(store, clock)
    raced_alone(store)
    correlator.add_engine_load([counted(at, count) for at, count in ((-0.2, 7), (0.1, 8), (0.9, 8), (1.05, 8), (1.2, 8))])
    clock.now = T0 + int(1.6 * S)
    correlator.tick()
    assert verdicts(store) == []
    correlator.add_engine_load([counted(1.3, 8)])
    clock.now = T0 + 9 * S
    correlator.tick()
    [row] = verdicts(store)
    assert (row.verdict, row.details.get("no_finish_counted")) == ("aborted", True), row.details


def test_a_racing_close_whose_engine_stopped_answering_is_unconfirmed(store: Store) -> None:
    """No scrape a quarter second after the span ended ever comes (the engine went away): once the
    window for its answer is past, nothing says, and the verdict is what it was without the count."""
    row = judged_alone(store, ((-0.2, 7), (0.1, 8), (0.9, 8), (1.05, 8), (1.2, 8)))
    assert (row.verdict, row.details.get("unconfirmed_because")) == ("unconfirmed", "raced_its_answer"), str(row.details)


def test_a_racing_close_of_a_server_error_is_not_read_by_the_finish_count(store: Store) -> None:
    """A 500 is never counted as a finish, nor is it an abort: the count standing still says nothing."""
    row = judged_alone(store, zip(SCRAPES_AT, (7, 8, 8, 8, 8, 8, 8), strict=True), status=500)
    assert (row.verdict, row.details.get("no_finish_counted")) == ("unconfirmed", None), str(row.details)


@pytest.mark.parametrize(("style", "route", "verdict"), [
    ("tgi", "/generate_stream", "aborted"), ("tgi", "/v1/chat/completions", "aborted"),
    ("llamacpp", "/completion", "aborted"),
    ("vllm", "/generate_stream", "unconfirmed"),  # not a route vLLM serves, nor counts
    ("tgi", "/v1/responses", "unconfirmed"), ("llamacpp", "/health", "unconfirmed")])
def test_each_engines_finish_count_is_read_for_the_routes_it_counts(store: Store, style: str, route: str,
                                                                   verdict: str) -> None:
    """TGI's success count and llama.cpp's count of finished requests' tokens stood still while a
    request to one of their generating routes ran: it was no complete answer; a route the engine
    does not count says nothing."""
    counts = (7, 8, 8, 8, 8, 8, 8) if style != "llamacpp" else (300, 340, 340, 340, 340, 340, 340)
    row = judged_alone(store, zip(SCRAPES_AT, counts, strict=True), style=style, route=route)
    assert (row.verdict, row.details.get("no_finish_counted", False)) == (verdict, verdict == "aborted"), \
        str(row.details)


def vllm_late(store: Store, counts: list[float], kind: ConnEventKind = ConnEventKind.PEER_FIN,
              other_end: float | None = None, style: str = "vllm",
              scrapes: tuple[float, ...] = (0.3, 0.5, 0.9, 1.1, 1.3),
              seconds: tuple[float, ...] | None = None) -> VerdictRow:
    """One request from 0.2 s whose client closed at 1.0 and whose span ended 30 ms later (a loaded
    server's): the gauges held it up to 0.9 and never after. Scrapes of ``style``'s page (vLLM's) at
    ``scrapes`` (the first's finish count 6, before the port's first rise; then ``counts``);
    ``other_end``: another client's request on the port whose span ended then (half a second
    long); ``seconds``: the engine's count of generation time at each scrape (llama.cpp's)."""
    clock = Clock()
    correlator = make(store, clock)
    spans = [http_span("1", 0.2, 1.03, span="1")]
    if other_end is not None:
        spans.append(http_span("2", other_end - 0.5, other_end, span="2", client=("127.0.0.1", 40002)))
    store.insert_spans(spans)
    store.insert_conn_events([close(1.0, kind)] + ([] if other_end is None else [
        close(other_end + 0.001, ConnEventKind.PEER_FIN, client=("127.0.0.1", 40002))]))
    for index, (at, finished) in enumerate(zip(scrapes, [6.0, *counts], strict=True)):
        running = int(at <= 0.9) + int(other_end is not None and other_end - 0.5 < at < other_end)
        correlator.add_engine_load([EngineLoad(ts_ns=T0 + int(at * S), server_port=SERVER_PORT, running=running,
                                               style=style, aborted=None if style == "llamacpp" else 0.0,
                                               finished=finished,
                                               finished_seconds=None if seconds is None else seconds[index])])
    clock.now = T0 + 9 * S
    correlator.tick()
    return next(row for row in verdicts(store) if row.client_port == CLIENT[1])


@pytest.mark.parametrize(("counts", "kind", "other_end", "verdict"), [
    ([7, 7, 8, 8], ConnEventKind.PEER_FIN, None, "unconfirmed"),  # its own finish, counted as it left
    ([7, 7, 7, 7], ConnEventKind.PEER_FIN, None, "aborted"),  # no finish: it was cut short
    ([7, 7, 8, 8], ConnEventKind.PEER_RST, None, "aborted"),  # a reset is no client that read it all
    ([7, 7, 8, 8], ConnEventKind.PEER_FIN, 1.05, "aborted"),  # one finish, two answers ended: whose?
    ([7, 7, 9, 9], ConnEventKind.PEER_FIN, 1.05, "unconfirmed")])  # both finished
def test_a_span_that_ended_well_after_the_close_is_no_abort_where_vllm_counted_its_finish(
        store: Store, counts: list[float], kind: ConnEventKind, other_end: float | None, verdict: str) -> None:
    row = vllm_late(store, counts, kind, other_end)
    assert row.verdict == verdict, str(row.details)
    assert row.details.get("finish_counted", False) is (verdict == "unconfirmed"), row.details


def test_a_finish_counted_by_a_scrape_between_the_last_byte_and_the_close_is_counted(store: Store) -> None:
    """The engine counts a finish as it hands the last token over, before the client reads it and
    closes: a scrape answered between the two (here at 0.995 s, the close at 1.0) already holds it,
    and the rise is read from the one before."""
    row = vllm_late(store, [7, 7, 8, 8, 8], scrapes=(0.3, 0.5, 0.9, 0.995, 1.1, 1.3))
    assert (row.verdict, row.details.get("finish_counted")) == ("unconfirmed", True), str(row.details)
    # Nor is a count that another request's finish moved before the close taken for this one's.
    row = vllm_late(store, [7, 7, 8, 8, 8], other_end=0.99, scrapes=(0.3, 0.5, 0.9, 0.995, 1.1, 1.3))
    assert (row.verdict, row.details.get("finish_counted", False)) == ("aborted", False), str(row.details)


@pytest.mark.parametrize(("counts", "style", "other_end", "verdict"), [
    ([7, 7, 8, 8], "tgi", None, "unconfirmed"),  # TGI counts requests, as vLLM
    ([7, 7, 8, 8], "tgi", 1.05, "aborted"),
    ([70, 70, 88, 88], "llamacpp", None, "unconfirmed"),  # tokens of a finish: its own, the only end
    ([70, 70, 70, 70], "llamacpp", None, "aborted"),
    # Two answers ended, and 36 tokens were counted: one request's, or both? A count of tokens cannot say.
    ([70, 70, 106, 106], "llamacpp", 1.05, "aborted")])
def test_a_span_that_ended_well_after_the_close_is_no_abort_where_tgi_or_llamacpp_counted_its_finish(
        store: Store, counts: list[float], style: str, other_end: float | None, verdict: str) -> None:
    row = vllm_late(store, [float(count) for count in counts], other_end=other_end, style=style)
    assert row.verdict == verdict, str(row.details)
    assert row.details.get("finish_counted", False) is (verdict == "unconfirmed"), row.details


@pytest.mark.parametrize(("seconds", "counts", "verdict"), [
    # Two answers ended (0.83 s and 0.5 s long) and 1.2 s of generation was counted: more than
    # the longer alone could have added, so both finished.
    ((9.0, 10.0, 10.0, 11.2, 11.2), [70, 70, 106, 106], "unconfirmed"),
    ((9.0, 10.0, 10.0, 10.8, 10.8), [70, 70, 106, 106], "aborted"),  # the longer one's alone, maybe
    ((9.0, 10.0, 10.0, 11.2, 11.2), [70, 70, 71, 71], "aborted")])  # one token: one request's
def test_llamacpps_count_of_generation_time_says_when_two_answers_that_ended_together_both_finished(
        store: Store, seconds: tuple[float, ...], counts: list[float], verdict: str) -> None:
    row = vllm_late(store, [float(count) for count in counts], other_end=1.05, style="llamacpp", seconds=seconds)
    assert (row.verdict, row.details.get("finish_counted", False)) == (verdict, verdict == "unconfirmed"), \
        str(row.details)

