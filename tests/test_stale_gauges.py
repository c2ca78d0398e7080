"""Gauges an engine publishes only with its steps (vLLM) or its logs (SGLang, every 40 decode steps):
after every request it held was aborted at once, with no request after, they keep their last values
(vLLM issues 22545, 29928; SGLang logs again only after 30 s idle). Its step series (vLLM's token
counters, SGLang's KV tokens and throughput) stand still then; read as they were, each aborted
request was an orphan running on, a zombie for ever."""

from __future__ import annotations

from dataclasses import replace

import pytest

from auditor.model import ConnEventKind, EngineLoad
from auditor.store import Store
from collectors.enginemetrics import parse_load
from tests.test_correlate import SERVER_PORT, T0, Clock, close, http_span, make, verdicts

S = 1_000_000_000
CLIENTS = [("127.0.0.1", 40001 + i) for i in range(3)]


def loads(start: float, stop: float, still_after: float | None) -> list[EngineLoad]:
    """vLLM's scrapes every 0.1 s holding the three requests; its step counter moving until
    ``still_after`` (None: throughout, the engine runs them on)."""
    found = []
    for i in range(round(start * 10), round(stop * 10) + 1):
        at = i / 10
        moving = still_after is None or at <= still_after
        found.append(EngineLoad(ts_ns=T0 + int(at * S), server_port=SERVER_PORT, running=3, style="vllm",
                                aborted=0.0, step_tokens=float(i if moving else round(still_after * 10) + 1)))
    return found


@pytest.mark.parametrize(("still_after", "want"), [(1.05, "aborted"), (None, "inflight_zombie")])
def test_gauges_left_by_an_engine_that_ran_no_step_hold_nothing(store: Store, still_after: float | None,
                                                               want: str) -> None:
    clock = Clock()
    correlator = make(store, clock)
    store.insert_spans([http_span(str(i + 1), 0, 1.05, span=str(i + 1), client=c) for i, c in enumerate(CLIENTS)])
    store.insert_conn_events([close(1.0, ConnEventKind.PEER_RST, client=c) for c in CLIENTS])
    correlator.add_engine_load(loads(0.3, 1.5, still_after))
    clock.now = T0 + int(1.5 * S)
    correlator.tick()  # the counter has stood still for less than a second: nothing can tell yet
    correlator.add_engine_load(loads(1.6, 8.0, still_after))
    clock.now = T0 + 9 * S
    correlator.tick()
    rows = verdicts(store)
    assert [row.verdict for row in rows] == [want] * 3, [(row.verdict, row.details) for row in rows]
    if want == "aborted":  # the work ended by the first scrape whose counter had stopped
        assert all(row.work_end_ns <= T0 + int(1.1 * S) for row in rows), [row.work_end_ns - T0 for row in rows]


def test_a_verdict_without_a_span_that_names_the_model_takes_the_one_the_gauges_name(store: Store) -> None:
    """vLLM's llm_request carries no model and an HTTP span none: its gauges' model_name does."""
    clock = Clock()
    correlator = make(store, clock)
    store.insert_spans([http_span(str(i + 1), 0, 1.05, span=str(i + 1), client=c) for i, c in enumerate(CLIENTS)])
    store.insert_conn_events([close(1.0, ConnEventKind.PEER_RST, client=c) for c in CLIENTS])
    correlator.add_engine_load([replace(load, model="meta-llama/Llama-3-8B") for load in loads(0.3, 8.0, None)])
    clock.now = T0 + 9 * S
    correlator.tick()
    assert [row.model for row in verdicts(store)] == ["meta-llama/Llama-3-8B"] * 3


def test_the_step_counters_are_read_where_the_engine_counts_at_every_step() -> None:
    page = ('vllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:generation_tokens_total{model_name="m"} 100.0\n'
            'vllm:prompt_tokens_total{model_name="m"} 40.0\n'
            'vllm:prompt_tokens_cached_total{model_name="m"} 7.0\n')
    load = parse_load(page, ts_ns=1, server_port=8000)
    assert load is not None and load.step_tokens == 140.0 and load.model == "m"
    two = page + 'vllm:num_requests_running{model_name="n"} 1.0\n'
    assert parse_load(two, ts_ns=1, server_port=8000).model is None  # type: ignore[union-attr]  # which one?
    load = parse_load('sglang:num_running_reqs 1\nsglang:generation_tokens_total 5\n', ts_ns=1, server_port=8000)
    assert load is not None and load.step_tokens is None  # no series its logs move: nothing to go by
    load = parse_load('sglang:num_running_reqs{model_name="m"} 1\nsglang:generation_tokens_total 5\n'
                      'sglang:num_used_tokens{model_name="m"} 300\nsglang:gen_throughput{model_name="m"} 41.5\n',
                      ts_ns=1, server_port=8000)
    assert load is not None and load.step_tokens == 341.5 and load.model == "m"


def sglang_loads(start: float, stop: float, last_log: float | None) -> list[EngineLoad]:
    """SGLang's scrapes every 0.1 s holding the three requests: it logs its gauges every 40 decode
    steps (0.4 s here) while it runs them, and not after ``last_log`` (None: it runs them on)."""
    found = []
    for i in range(round(start * 10), round(stop * 10) + 1):
        at = i / 10
        logged = at if last_log is None else min(at, last_log)
        log = int(logged / 0.4 + 1e-9)  # the logs so far: the series move with each
        found.append(EngineLoad(ts_ns=T0 + int(at * S), server_port=SERVER_PORT, running=3, style="sglang",
                                aborted=0.0, step_tokens=float(300 + 3 * 40 * log) + 0.5 * log))
    return found


@pytest.mark.parametrize(("last_log", "want"), [(2.0, "zombie"), (None, "inflight_zombie")])
def test_sglang_gauges_its_scheduler_stopped_logging_hold_nothing_after_a_log_interval(
        store: Store, last_log: float | None, want: str) -> None:
    """SGLang sets its gauges only when its scheduler logs a batch (every 40 decode steps) and,
    idle, every 30 s: the three requests it aborted a second after their clients left (its abort
    waits first) stayed in its gauges for up to 30 s, zombies that long. Once its logs stood still
    for longer than its logs come while it runs, it ran no batch: it ran on at most one log
    interval after the last."""
    clock = Clock()
    correlator = make(store, clock)
    store.insert_spans([http_span(str(i + 1), 0, 1.05, span=str(i + 1), client=c) for i, c in enumerate(CLIENTS)])
    store.insert_conn_events([close(1.0, ConnEventKind.PEER_RST, client=c) for c in CLIENTS])
    correlator.add_engine_load(sglang_loads(0.3, 9.0, last_log))
    clock.now = T0 + 9 * S
    correlator.tick()
    rows = verdicts(store)
    assert [row.verdict for row in rows] == [want] * 3, [(row.verdict, row.details) for row in rows]
    if last_log is not None:  # its work ended within one log interval after its last log
        ends = [(row.work_end_ns - T0) / S for row in rows]
        assert all(last_log <= end <= last_log + 0.5 for end in ends), ends


def test_a_request_sglang_finished_as_its_client_closed_is_not_held_by_a_log_from_before(store: Store) -> None:
    """SGLang's gauges are its last log's: a request that finished as its client closed (the close
    racing the span's end) is still in the log made just before, which the first scrape after the
    close shows; with no log after (the engine idle), it looked held after its client left, and
    a completed request was judged a zombie. Only a log after a scrape that came after the close
    says what it held then; none came, so its gauges cannot tell (unconfirmed)."""
    clock = Clock()
    correlator = make(store, clock)
    store.insert_spans([http_span("1", 0, 1.02, client=CLIENTS[0])])
    store.insert_conn_events([close(1.0198, client=CLIENTS[0])])
    logs = (0.4, 0.8, 1.01)  # running 1 at each; none after it finished at 1.02

    def scrape(at: float) -> EngineLoad:
        done = sum(1 for log in logs if log <= at)
        return EngineLoad(ts_ns=T0 + int(at * S), server_port=SERVER_PORT, running=1 if done else 0,
                          style="sglang", aborted=0.0, step_tokens=float(10 * done))
    correlator.add_engine_load([scrape(i / 10) for i in range(3, 91)])
    clock.now = T0 + 9 * S
    correlator.tick()
    [row] = verdicts(store)
    assert row.verdict == "unconfirmed", row.details
