"""A client's timeout, told by the report from the daemon's own verdicts, against what the client
knows it did and the engine's truth log.

The real openai SDK calls the reference engine (vLLM's signals only: no engine span, its
/metrics) with a timeout shorter than the answers, and its default retries: each call gives up
three times, each attempt a zombie on an engine that runs on. Beside them, streams the
application closes after a few chunks, at ages spread out, and answers read to the end. The
report must tell one timeout, at the SDK's timeout, holding every attempt the SDK gave up on and
nothing else; the verdicts must match the engine's truth as everywhere else.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from auditor.report import ReportQuery, build_report
from auditor.report.render_table import render_table
from auditor.store import Store
from replay.engine.launch import running_engine
from tests.e2e import (
    HostWitness,
    leavers_settled,
    running_daemon,
    tally_against_truth,
    verdict_rows,
    wait_for,
)
from tests.nginx import Action, find_nginx, run_behind_nginx

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow]

MODEL = "ref-llm-1b"
TIMEOUT_S = 0.7
# The SDK's default: two retries after the first attempt. Four calls: twelve disconnects at one
# age stand out from the six cancels around them beyond doubt (nine, with all six within 0.5 s
# below them, are a one in 200,000 chance: not told).
CALLS, ATTEMPTS = 4, 3
BATCH_JOB = "nightly-evals/2.1 (batch)"  # the User-Agent of the requests nginx cuts


def timed_out_calls(url: str, errors: list[BaseException]) -> None:
    """One call past its timeout, retried by the SDK as it does by default."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=ATTEMPTS - 1)
    try:
        client.completions.create(model=MODEL, prompt="word word word word", max_tokens=200)  # 2 s of decode
    except openai.APITimeoutError:
        return
    except BaseException as exc:
        errors.append(exc)
    else:
        errors.append(AssertionError("the call did not time out"))
    finally:
        client.close()


def cancels_and_answers(url: str) -> tuple[int, int]:
    """Streams closed after a few chunks, at ages spread out below the timeout, and answers read
    whole. Returns (completed, given up)."""
    rng = random.Random(11)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completed = given_up = 0
    for n in range(6):
        chunks = rng.randrange(1, 25)
        with client.completions.create(model=MODEL, prompt="word word", max_tokens=200, stream=True) as stream:
            for number, _ in enumerate(stream):
                if number == chunks:
                    break
        given_up += 1
        if n % 2 == 0:
            client.completions.create(model=MODEL, prompt="word word", max_tokens=10)
            completed += 1
        time.sleep(0.2)
    client.close()
    return completed, given_up


@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_the_report_tells_the_sdks_timeout_from_the_daemons_verdicts(tmp_path: Path, source: str) -> None:
    settings = {"probe.source": source, "correlate.late_span_seconds": 10.0,
                "engine_metrics.interval_seconds": 0.1}
    with HostWitness() as witness, running_daemon(tmp_path, **settings) as daemon, \
            running_engine(behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                           truth_log=tmp_path / "truth.jsonl", step_ms=10, max_batch=32,
                           extra_args=["--engine-span", "none", "--metrics-names", "vllm"]) as engine:
        daemon.set_ports({engine.port})
        since_ns = time.time_ns()
        completed, given_up = cancels_and_answers(engine.url)
        errors: list[BaseException] = []
        callers = [threading.Thread(target=timed_out_calls, args=(engine.url, errors)) for _ in range(CALLS)]
        for caller in callers:  # apart, as calls come: a timeout met again and again
            caller.start()
            time.sleep(0.5)
        for caller in callers:
            caller.join(timeout=30)
        assert not errors, errors
        timed_out = CALLS * ATTEMPTS
        truths = engine.wait_for_truth(completed + given_up + timed_out, timeout=30)
        assert len(truths) == completed + given_up + timed_out, truths
        assert wait_for(lambda: leavers_settled(verdict_rows(daemon), truths), timeout_s=40, interval_s=0.25), \
            [(r.client_port, r.verdict, r.details) for r in verdict_rows(daemon)]
        time.sleep(1.0)
        rows = verdict_rows(daemon)
        tally, problems = tally_against_truth(rows, truths, daemon.store.conn_events(), witness)
        report = build_report(daemon.store, ReportQuery(since_ns=since_ns, until_ns=time.time_ns()))
    assert not problems, (tally, problems)
    assert tally["cancels"] == given_up + timed_out, tally
    # The engine's own view: the attempts whose client left at the timeout's age.
    at_timeout = [t for t in truths if t["disconnect_at"] is not None
                  and (t["disconnect_at"] - t["arrival_at"]) / 1e9 >= TIMEOUT_S - 0.05]
    assert len(at_timeout) == timed_out, [(t["disconnect_at"] - t["arrival_at"]) / 1e9 for t in truths
                                          if t["disconnect_at"] is not None]
    ages = sorted(round((r.disconnect_at_ns - r.request_start_ns) / 1e9, 3) for r in rows)
    assert [(t.disconnects, t.zombies + t.inflight_zombies + t.unconfirmed) for t in report.client_timeouts] \
        == [(timed_out, timed_out)], (report.client_timeouts, " ".join(map(str, ages)))
    [timeout] = report.client_timeouts
    assert TIMEOUT_S - 0.02 <= timeout.after_seconds <= TIMEOUT_S + 0.05, (timeout, ages)
    assert timeout.default_of is None
    # What the answers needed, from the zombies' work, against the engine's own times (its work
    # end told by vLLM's gauges, to a 0.1 s scrape).
    # Only zombies whose end is their own for sure tell it (not where later leavers may own the
    # orphans the gauges gave them: lag_at_least_s).
    needed = [(t["finished_at"] - t["arrival_at"]) / 1e9 for t in at_timeout]
    sure = [r for r in rows if r.verdict == "zombie" and r.details.get("lag_at_least_s") is None
            and timeout.from_seconds <= (r.disconnect_at_ns - r.request_start_ns) / 1e9 < timeout.to_seconds]
    assert (timeout.zombie_work_max_seconds is not None) == bool(sure), (timeout, sure)
    if timeout.zombie_work_max_seconds is not None:
        assert abs(timeout.zombie_work_max_seconds - max(needed)) <= 0.3, (timeout, needed)
    assert "Client timeouts" in render_table(report)
    # Who left: the SDK, as its User-Agent on each request's server span says.
    agent = f"OpenAI/Python {openai.__version__}"
    assert {r.user_agent for r in rows} == {agent}, {r.user_agent for r in rows}
    assert [(r.key, r.disconnects) for r in report.breakdowns["user_agent"]] == [(agent, len(rows))]
    assert (timeout.user_agents, timeout.client_addresses) == (((agent, timed_out),), (("127.0.0.1", timed_out),))


@pytest.mark.skipif(find_nginx() is None, reason="nginx not found: run `make setup` as root")
@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_the_report_tells_nginxs_read_timeout_where_the_engine_sees_only_nginx(tmp_path: Path, source: str) -> None:
    # nginx gives up on an upstream answer after 1 s without a byte (proxy_read_timeout 1s): every
    # non-streamed answer longer than that is cut there, the client answered 504, the engine left
    # running. Streams read to the end or left early by their clients pass under it.
    rng = random.Random(12)
    cut = [Action(0.6 * k, 200, stream=False, user_agent=BATCH_JOB) for k in range(8)]  # 2 s of decode each
    others = [Action(0.3 + 0.6 * k, 20) for k in range(6)]
    others += [Action(0.1 + 0.6 * k, 150, leave="fin", after_s=rng.uniform(0.05, 0.7)) for k in range(6)]
    rows, truths, actions = run_behind_nginx(tmp_path, "read_timeout", source, "detached", actions=cut + others)
    assert not [action for action in actions if action.error], [action.error for action in actions]
    store = Store(f"sqlite:///{tmp_path / 'auditor.db'}")
    try:
        first = min(row.request_start_ns for row in rows)
        report = build_report(store, ReportQuery(since_ns=first - 10**9, until_ns=time.time_ns()))
    finally:
        store.close()
    tally, problems = tally_against_truth(rows, truths)
    assert not problems, (tally, problems)
    # The engine's own view: the requests nginx left 1 s into them, each one of `cut`.
    at_timeout = [t for t in truths if t["disconnect_at"] is not None
                  and 0.95 <= (t["disconnect_at"] - t["arrival_at"]) / 1e9 <= 1.5]
    assert len(at_timeout) == len(cut), [(t["disconnect_at"] - t["arrival_at"]) / 1e9 for t in truths
                                         if t["disconnect_at"] is not None]
    ages = sorted(round((r.disconnect_at_ns - r.request_start_ns) / 1e9, 3) for r in rows)
    assert [t.disconnects for t in report.client_timeouts] == [len(cut)], \
        (report.client_timeouts, " ".join(map(str, ages)))
    [timeout] = report.client_timeouts
    assert 0.98 <= timeout.after_seconds <= 1.05 and timeout.completed == 0, timeout
    # nginx passes the client's User-Agent on where the engine sees only nginx's address: the
    # report still says who was cut.
    cut_rows = [r for r in rows if timeout.from_seconds <= (r.disconnect_at_ns - r.request_start_ns) / 1e9
                < timeout.to_seconds]
    assert {(r.client_addr, r.user_agent) for r in cut_rows} == {("127.0.0.1", BATCH_JOB)}, cut_rows
    assert (BATCH_JOB, len(cut)) in [(r.key, r.zombies + r.inflight_zombies + r.unconfirmed + r.aborted)
                                     for r in report.breakdowns["user_agent"]]
    assert (timeout.user_agents, timeout.client_addresses) == (((BATCH_JOB, len(cut)),), (("127.0.0.1", len(cut)),))
