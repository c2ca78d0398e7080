"""Engines' own abort counters: read from /metrics under each engine's names, and used as evidence
that a cancelled request's work stopped only when they rose by as many as the requests that left."""

from __future__ import annotations

import pytest

from auditor.correlate import Correlator
from auditor.model import ConnEventKind, EngineLoad
from auditor.store import Store
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
    assert row.verdict == verdict, row.details
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
