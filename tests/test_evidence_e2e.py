"""Verdicts from whatever the engine emits, against the engine's truth log (DESIGN §5, "Evidence").

The reference engine runs with signal profiles of real servers: no engine span at all (HTTP server
spans only, as llama.cpp or TGI behind instrumentation), its gauges under vLLM, TGI or llama.cpp
names, with or without ``http send`` sub-spans, and served one request at a time. The daemon scrapes
the gauges itself. Cancelled requests must get the truth's verdict, with the work end within a
scrape interval; completed requests, whichever way their client closed, are never aborted nor zombies.
Where the engine counts its aborts (vLLM, SGLang names), every cancelled request of an aborting
engine is ``aborted``, even when the client's close raced the server span's end.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest

from auditor.store import VerdictRow
from probes.sockdiag import IDLE_QUIET_MS
from replay.engine.launch import running_engine
from tests.e2e import (
    GRACE_S,
    HostWitness,
    against_truth,
    cancel_after,
    complete,
    expected_verdict,
    host_excuses,
    may_be_earlier_ns,
    read_response,
    running_daemon,
    send_request,
    settled_by_client_port,
    settled_by_request_id,
    timeline,
    verdict_rows,
    wait_for,
)

pytestmark = [pytest.mark.privileged, pytest.mark.slow]
SCRAPE_S = 0.1
# The engines whose /metrics count requests aborted because their client left (vLLM's "abort"
# series does not: the reference engine's vLLM names keep it at 0, as vLLM does).
COUNTS_ABORTS = ("sglang", "tgi")
NAME_THE_MODEL = ("vllm", "sglang")  # the engines whose gauges name the model served (model_name)


def close_after_last_byte(port: int, request_id: str) -> threading.Thread:
    """Read the whole response, then close at once (curl, the openai SDK after [DONE])."""
    return complete(port, stream=True, max_tokens=8, request_id=request_id)


def server_closes_first(port: int, request_id: str) -> threading.Thread:
    """``Connection: close``: the server ends the response and closes before the client does."""

    def run() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        body = b'{"model":"ref-llm-1b","prompt":"word word","max_tokens":8}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nX-Request-Id: " + request_id.encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.settimeout(30)
        while sock.recv(65536):
            pass
        sock.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def drive(engine: Any, tag: str) -> None:
    port = engine.port
    for i in range(3):  # completed, each way a client closes
        close_after_last_byte(port, f"{tag}-done-fin{i}").join()
        server_closes_first(port, f"{tag}-done-close{i}").join()
    # The first two cancels overlap: the second leaves while the first's work may still run on.
    # The third leaves once both have ended: had it left within a scrape of one of their ends, the
    # running count could not tell its orphan from theirs (an engine's speed varies with the host's
    # load, so no fixed schedule keeps them apart).
    for n, (kind, stream) in enumerate((("fin", True), ("rst", False), ("fin", False))):
        if n == 2:
            for earlier in ("fin-True", "rst-False"):
                engine.truth_of(f"cmpl-{tag}-cancel-{earlier}", timeout=30)
            time.sleep(0.3)
        cancel_after(port, 0.3, kind, stream=stream, max_tokens=150, request_id=f"{tag}-cancel-{kind}-{stream}").join()
        time.sleep(0.2)


@pytest.mark.parametrize(("behavior", "names", "send_spans"), [
    ("detached", "vllm", False),
    ("detached", "sglang", False),
    # A cancelled non-streaming response sent nothing: the service's other responses show it marks its sends.
    ("abort", "tgi", True),
    ("abort", "llamacpp", False),
    # vLLM counts no client's abort: a close that raced the span's end cannot be told from a complete answer.
    ("abort", "vllm", False),
    # The engine counts its aborts: every cancelled request is aborted, whichever way the close raced.
    ("abort", "sglang", False),
    ("abort", "tgi", False)])
def test_http_spans_only(tmp_path: Path, behavior: str, names: str, send_spans: bool) -> None:
    http_spans_only(tmp_path, behavior, names, send_spans, source="bpf")


@pytest.mark.parametrize(("behavior", "names", "send_spans"), [
    ("detached", "vllm", False),
    ("abort", "tgi", True),
    ("abort", "llamacpp", False),
    ("abort", "vllm", False)])
def test_http_spans_only_polled_closes(tmp_path: Path, behavior: str, names: str, send_spans: bool) -> None:
    """The /proc source knows a close only to a poll interval, which the server span's end, prompt
    on a disconnect, falls inside: that order is no evidence that the response was complete."""
    http_spans_only(tmp_path, behavior, names, send_spans, source="procfs")


def http_spans_only(tmp_path: Path, behavior: str, names: str, send_spans: bool, source: str) -> None:
    truth_log = tmp_path / "truth.jsonl"
    args = ["--engine-span", "none", "--metrics-names", names] + (["--send-spans"] if send_spans else [])
    with HostWitness() as witness, running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S,
                                                               "probe.source": source}) as daemon, running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, extra_args=args) as engine:
        daemon.set_ports({engine.port})
        drive(engine, behavior)
        cancelled = {t["request_id"] for t in engine.wait_for_truth(12, timeout=30) if t.get("disconnect_at")}
        assert len(cancelled) == 3, engine.truth()
        rows = settled_by_request_id(daemon, (rid.removeprefix("cmpl-") for rid in cancelled))
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.truth()}
        events = daemon.store.conn_events()
    problems: list[str] = []

    def problem(row: VerdictRow, text: str) -> None:
        if not host_excuses(witness, row, text):
            problems.append(text)

    for request_id, row in rows.items():
        truth = truths[request_id]
        if not truth.get("disconnect_at"):  # completed: any verdict but an abort or a zombie
            if row.verdict in ("aborted", "zombie", "inflight_zombie"):
                problem(row, f"{request_id}: {row.verdict} for a completed request ({row.details}; "
                             f"{timeline(row, truth, events)})")
            continue
        want = expected_verdict(truth)
        if want == "aborted" and not send_spans and names not in COUNTS_ABORTS \
                and row.details.get("close_races_span_end"):
            # Without a final send or an abort counter, a server that reacts within the clock error
            # of the close looks like a response that just ended: the auditor must say it cannot
            # tell, never guess.
            want = "unconfirmed"
        if row.verdict != want:
            problem(row, f"{request_id}: {row.verdict}, truth {want} ({row.details}; {timeline(row, truth, events)})")
        if want != "unconfirmed" and row.details.get("evidence") != "engine_metrics":
            problem(row, f"{request_id}: decided by {row.details.get('evidence')}, not the engine's gauges")
        # Where later leavers' rise is untold, the verdict says how much earlier the end may be.
        earlier_ns = may_be_earlier_ns(row)
        if want == "zombie" and not -SCRAPE_S * 1.5e9 - earlier_ns <= truth["finished_at"] - row.work_end_ns \
                <= SCRAPE_S * 1.5e9:
            problem(row, f"{request_id}: work end off by {(row.work_end_ns - truth['finished_at']) / 1e9:.3f} s "
                         f"({row.details})")
        if names in NAME_THE_MODEL and row.model != "ref-llm-1b":  # no span names it: the gauges do
            problem(row, f"{request_id}: model {row.model!r}, not the one the gauges name")
    assert {rid.removeprefix("cmpl-") for rid in cancelled} <= set(rows)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("names", "flag"), [
    ("tgi", "no_abort_counted"), ("sglang", "no_abort_counted"), ("vllm", "finish_counted"),
    ("llamacpp", "finish_counted")])
def test_a_loaded_servers_late_span_end_is_no_abort_where_the_engine_counts(tmp_path: Path, names: str,
                                                                            flag: str) -> None:
    """The server's event loop held 30 ms after each answer's last byte (``--span-end-lag-ms``, as
    other work holds a loaded server's): its clients, which read it all and closed at once, closed
    30 ms before the span ended, as a cancel the server reacted to does. With the gauges alone each
    was `aborted` (every one, by each engine's names); the engine, which counts every abort,
    counted none then, or (vLLM; llama.cpp, which counts no aborts, by the tokens of the requests
    it finished) counted its normal finish as the client left: `unconfirmed`, since nothing says
    whether the answer was whole. Its cancels (first, so that the port's abort counter is seen to
    count) stay `aborted`."""
    settings = {"engine_metrics.interval_seconds": SCRAPE_S}
    with HostWitness() as witness, running_daemon(tmp_path, **settings) as daemon, \
            running_engine(behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                           truth_log=tmp_path / "truth.jsonl", step_ms=10,
                           extra_args=["--engine-span", "none", "--metrics-names", names, "--span-end-lag-ms", "30"]
                           ) as engine:
        daemon.set_ports({engine.port})
        assert wait_for(lambda: daemon.readings().engine_scrapes.get((engine.port, "read"), 0) >= 3, timeout_s=10)
        for kind in ("fin", "rst"):
            cancel_after(engine.port, 0.3, kind, stream=True, max_tokens=150, request_id=f"cancel-{kind}").join()
            time.sleep(0.6)
        for i in range(4):
            complete(engine.port, stream=bool(i % 2), max_tokens=8, request_id=f"done{i}").join()
            time.sleep(0.15)
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(6, timeout=30)}
        rows = settled_by_request_id(daemon, truths)
        events = daemon.store.conn_events()
        scrapes = daemon.correlator.loads.scrapes_of(engine.port)
    problems, uncovered = [], []
    for request_id, truth in truths.items():
        row = rows[request_id]
        # The last answer's own scrapes may find the engine idle, its SGLang gauges unrefreshed: no
        # gauges' word then (no ``orphaned_scrapes``), and unconfirmed all the same.
        told = "orphaned_scrapes" in row.details
        want = ("aborted", False) if truth.get("disconnect_at") else ("unconfirmed", told)
        if (row.verdict, row.details.get(flag, False)) != want:
            text = f"{request_id}: {row.verdict}, want {want} ({row.details}; {timeline(row, truth, events, scrapes)})"
            if host_excuses(witness, row, text):
                continue
            # One answer of the four `aborted`, its finish not covered, came in 2 of 41 runs of
            # llama.cpp's names (none of 10 of vLLM's) while the rise was read from the last scrape
            # answered before the close only: one answered between the engine's count and the
            # client's close (a millisecond or two) holds the count already. Read from the one
            # before it too (``finishes_cover``), none in 30 runs since. One is still told (with
            # the scrapes read), two fail.
            if flag == "finish_counted" and not truth.get("disconnect_at") and row.verdict == "aborted":
                uncovered.append(text)
            else:
                problems.append(text)
    assert not problems, "\n".join(problems)
    assert len(uncovered) <= 1, "\n".join(uncovered)
    for text in uncovered:
        warnings.warn(f"a completed answer's finish not covered: {text}", stacklevel=1)
    assert sum(bool(row.details.get(flag)) for row in rows.values()) >= 3, rows


@pytest.mark.parametrize(("behavior", "names", "source"), [
    ("abort", "vllm", "bpf"), ("abort", "vllm", "procfs"), ("detached", "vllm", "bpf"), ("abort", "sglang", "bpf")])
def test_plain_clients_against_an_engine_that_spans_in_its_own_traces(tmp_path: Path, behavior: str,
                                                                      names: str, source: str) -> None:
    """vLLM behind the openai SDK: no traceparent and no X-Request-Id reach the engine, so its
    llm_request spans are traces of their own with ids it made up, joined to no request; the
    gauges, SGLang's abort counter and vLLM's count of normal finishes are what tell. Clients that
    read the whole answer (racing the span's end) or that the server closed on are never aborted
    nor zombies; cancels get the truth's verdict. vLLM counts no client's abort, and a close that
    raced the span's end was `unconfirmed` (each of its 3 cancels, every run): its finish count
    standing still while the request ran now says it was no complete answer. Matched to the truth
    log by client port, the only thing both sides know."""
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source}) as daemon, \
            running_engine(behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
                           step_ms=10, extra_args=["--metrics-names", names]) as engine:
        daemon.set_ports({engine.port})
        for _ in range(4):
            complete(engine.port, stream=True, max_tokens=8, request_id=None).join()
            complete(engine.port, stream=False, max_tokens=8, request_id=None).join()
        time.sleep(0.3)  # the last finish counted in a scrape before the first cancel began
        for kind, stream in (("fin", True), ("rst", False), ("fin", False)):
            cancel_after(engine.port, 0.3, kind, stream=stream, max_tokens=150, request_id=None).join()
            time.sleep(0.2)
        truths, left, rows = settled_by_client_port(daemon, engine, requests=11, leavers=3)
    problems = against_truth(rows, truths, left, unconfirmed_ok=False)
    assert not problems, "\n".join(problems)
    if behavior == "abort" and names == "vllm":  # the FINs that raced their span's end, told by the count
        raced = [rows[port].details for port in left
                 if rows[port].disconnect_kind == "fin" and rows[port].details.get("held_one_more") is False]
        assert all(details.get("no_finish_counted") for details in raced), raced


@pytest.mark.parametrize("scrape", [True, False], ids=["gauges", "no-gauges"])
def test_vllms_aborts_unconfirmed_without_its_gauges_say_so_and_are_counted(tmp_path: Path, scrape: bool) -> None:
    """vLLM's signal set (HTTP spans, its engine's span for each finished request and none for an
    abort, its /metrics; clients that send X-Request-Id): four clients leave and the engine aborts
    their requests. Its gauges tell the aborts; with the scrape turned off, nothing does: each is
    unconfirmed, never guessed, says it had no gauges, and the report counts it apart (the verdicts
    scraping would confirm)."""
    from auditor.report import ReportQuery, build_report
    from auditor.store import Store

    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S,
                                     "engine_metrics.scrape": scrape}) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, extra_args=["--metrics-names", "vllm"]) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.3)
        complete(engine.port, stream=True, max_tokens=8, request_id="read-whole").join()
        for index, kind in enumerate(("fin", "rst", "fin", "rst")):
            cancel_after(engine.port, 0.3, kind, stream=True, max_tokens=150, request_id=f"left{index}").join()
            time.sleep(0.2)
        truths, left, rows = settled_by_client_port(daemon, engine, requests=5, leavers=4)
        report = build_report(Store(f"sqlite:///{tmp_path / 'auditor.db'}", check=False),
                              ReportQuery(since_ns=time.time_ns() - 60 * 10**9, until_ns=time.time_ns()))
    assert all(expected_verdict(truths[port]) == "aborted" for port in left), truths
    assert not against_truth(rows, truths, left, unconfirmed_ok=True)
    verdicts = [(rows[port].verdict, rows[port].details.get("unconfirmed_because")) for port in left]
    if scrape:
        assert verdicts == [("aborted", None)] * 4, verdicts
        assert report.totals.unconfirmed_without_gauges == 0
    else:
        assert verdicts == [("unconfirmed", "no_gauges")] * 4, verdicts
        assert (report.totals.unconfirmed, report.totals.unconfirmed_without_gauges) == (4, 4)


@pytest.mark.parametrize("source", ["procfs", pytest.param("bpf", marks=pytest.mark.privileged)])
def test_fastapis_second_server_span_leaves_completed_clients_completed(tmp_path: Path, source: str) -> None:
    """FastAPI's own telemetry over an ASGI middleware: two SERVER spans a request, the second a
    child of the first on the same connection. vLLM's gauges, no engine span, plain clients: two
    read their whole answer while four cancel at once on an engine that runs on after them. The
    port's requests in flight were counted twice, and both completed clients were judged zombies
    (both sources, every run)."""
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"probe.source": source, "engine_metrics.interval_seconds": SCRAPE_S,
                                     "correlate.late_span_seconds": 10.0}) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=16,
            extra_args=["--engine-span", "none", "--metrics-names", "vllm", "--duplicate-server-span"]) as engine:
        daemon.set_ports({engine.port})
        threads = [complete(engine.port, stream=True, max_tokens=40, request_id=None) for _ in range(2)]
        for kind in ("fin", "rst"):
            for stream in (True, False):
                threads.append(cancel_after(engine.port, 0.1, kind, stream=stream, max_tokens=150, request_id=None))
                time.sleep(0.05)
        for thread in threads:
            thread.join()
        truths, left, rows = settled_by_client_port(daemon, engine, requests=6, leavers=4, timeout_s=40)
    problems = against_truth(rows, truths, left, unconfirmed_ok=True)
    assert not problems, "\n".join(problems)
    assert sum(rows[port].verdict == "zombie" for port in left) >= 1  # the gauges still tell zombies


def test_one_at_a_time_request_cancelled_while_waiting_is_no_zombie_and_costs_nothing(tmp_path: Path) -> None:
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{
            "engine_metrics.interval_seconds": SCRAPE_S,
            # The waiting requests are read only after the one ahead ends (about 1.7 s, more on a
            # busy machine): the join waits for a span that late (3 s in tests, 60 s by default).
            "correlate.late_span_seconds": 8.0}) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=1, extra_args=["--one-at-a-time"]) as engine:
        daemon.set_ports({engine.port})
        # Short enough that the waiting requests are read well within the clients' TIME_WAIT (1 s):
        # the server closes their sockets at the FIN, and only TIME_WAIT tells no other connection
        # can have taken the 4-tuple since.
        ahead = complete(engine.port, stream=True, max_tokens=90, request_id="ahead")
        time.sleep(0.3)
        waiting = [cancel_after(engine.port, 0.3, kind, stream=False, max_tokens=50, request_id=f"waiting-{kind}")
                   for kind in ("fin", "rst")]
        for thread in [ahead, *waiting]:
            thread.join()
        # Both waiting requests judged for good (the one ahead gets a verdict of its own).
        assert wait_for(lambda: {"waiting-fin", "waiting-rst"} <= {
            r.request_id for r in verdict_rows(daemon) if not r.details.get("provisional")}, timeout_s=30), \
            [(r.request_id, r.verdict, r.details) for r in verdict_rows(daemon)]
        rows = {r.request_id: r for r in verdict_rows(daemon)}
        # The engine logs a request's truth once it has dropped it, which may come after the span
        # that let the verdict settle.
        truths = {request_id: engine.truth_of(request_id) for request_id in ("waiting-fin", "waiting-rst")}
    for kind in ("fin", "rst"):
        row, truth = rows[f"waiting-{kind}"], truths[f"waiting-{kind}"]
        assert truth["tokens_generated"] == 0 and expected_verdict(truth) == "aborted"
        assert row.verdict == "aborted", (row.verdict, row.details)
        assert row.wasted_cpu_seconds == 0 and row.wasted_gpu_seconds == 0
        # The request ahead ran meanwhile: the server read this one only after it, as late after
        # the client left as the engine says it arrived (how late depends on this host's pace).
        waited_s = (truth["arrival_at"] - row.disconnect_at_ns) / 1e9
        assert waited_s > 0.05, (waited_s, truth)
        assert row.details["waited_unread_s"] == pytest.approx(waited_s, abs=0.05)



@pytest.mark.parametrize("names", ["vllm", "sglang", "tgi", "llamacpp"])
def test_a_request_that_only_waited_in_the_engines_queue_is_aborted_by_each_engines_names(
        tmp_path: Path, names: str) -> None:
    """One request runs at a time (``--max-batch 1``), HTTP spans only: a request the server read
    waits in the engine's queue behind a long one, and its client leaves (a FIN, then a reset); the
    engine drops it unrun. Nothing it counts moves for such a request (no finish, and on vLLM's
    names no abort either), and answers that finish meanwhile (the one ahead) must not be taken for
    its: `aborted`, costing nothing, whatever names the gauges go by; the one ahead, read whole,
    never `aborted`."""
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S}) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=1, extra_args=["--engine-span", "none", "--metrics-names", names]) as engine:
        daemon.set_ports({engine.port})
        assert wait_for(lambda: daemon.readings().engine_scrapes.get((engine.port, "read"), 0) >= 3, timeout_s=10)
        ahead = complete(engine.port, stream=True, max_tokens=150, request_id="ahead")
        time.sleep(0.2)
        waiting = [cancel_after(engine.port, 0.3 + 0.2 * n, kind, stream=bool(n), max_tokens=50,
                                request_id=f"waiting-{kind}") for n, kind in enumerate(("fin", "rst"))]
        for thread in [ahead, *waiting]:
            thread.join()
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(3, timeout=30)}
        rows = settled_by_request_id(daemon, ["waiting-fin", "waiting-rst"])
    for kind in ("fin", "rst"):
        truth, row = truths[f"waiting-{kind}"], rows[f"waiting-{kind}"]
        assert truth["scheduled_at"] is None and truth["tokens_generated"] == 0, truth  # it never ran
        assert (row.verdict, row.wasted_gpu_seconds, row.wasted_cpu_seconds) == ("aborted", 0, 0), \
            (kind, row.verdict, row.details)
    if "ahead" in rows:  # its client closed after the last byte: most often no verdict at all
        assert rows["ahead"].verdict in ("completed", "unconfirmed"), rows["ahead"].details


def kept_alive(port: int, hold_s: float = 1.5, **request: Any) -> threading.Thread:
    """Read the whole response, then keep the connection open a while, as a client's pool does."""

    def run() -> None:
        with send_request(port, **request) as sock:
            read_response(sock)
            time.sleep(hold_s)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("behavior", ["abort", "detached"])
def test_a_cancel_beside_requests_whose_spans_have_not_come(tmp_path: Path, behavior: str) -> None:
    """vLLM's signal set: no engine span, no live notice, its gauges, spans exported in batches (here
    every 2 s) and so only after a request ends. Two requests of about 3 s run (one streamed, one
    not) while a third's client leaves at 0.3 s. The gauges hold three while the only spans come
    later; the kernel lists the two clients still connected. An engine that aborts the third is
    never shown running it (no ``inflight_zombie``, which was shown until the others' spans came);
    one that runs it on is shown so within a second of the grace, and both settle as the truth says."""
    truth_log = tmp_path / "truth.jsonl"
    args = ["--engine-span", "none", "--metrics-names", "vllm"]
    # Settled verdicts are right when the spans come within the late window: 3 s against batches
    # every 2 s left a loaded machine too little (a verdict settled before the others' spans came).
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S,
                                     "correlate.late_span_seconds": 6.0}) as daemon, running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, extra_args=args, env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "2000"}) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)  # the port's first scrapes
        longs = [kept_alive(engine.port, stream=stream, max_tokens=300, request_id=f"long-{stream}")
                 for stream in (True, False)]
        time.sleep(0.2)
        left_at = time.monotonic()
        cancel = cancel_after(engine.port, 0.3, "rst", stream=True, max_tokens=300, request_id="left")
        seen: list[tuple[float, str]] = []
        while any(t.is_alive() for t in longs) or time.monotonic() - left_at < 3:
            row = next((r for r in verdict_rows(daemon) if r.request_id == "left"), None)
            if row is not None:
                seen.append((time.monotonic() - left_at, row.verdict))
            time.sleep(0.05)
        cancel.join()
        for thread in longs:
            thread.join()
        [truth] = [t for t in engine.wait_for_truth(3, timeout=30) if t.get("disconnect_at")]
        rows = settled_by_request_id(daemon, ["left"])
    want = truth_says = expected_verdict(truth)
    if want == "aborted" and rows["left"].details.get("close_races_span_end"):
        want = "unconfirmed"  # the span ended within the clock error of the reset; vLLM counts no client's abort
    assert rows["left"].verdict == want, (rows["left"].details, truth)
    for finished in ("long-True", "long-False"):  # their clients closed a while after the last byte
        assert finished not in rows or rows[finished].verdict not in ("aborted", "zombie", "inflight_zombie"), \
            (finished, rows[finished].verdict, rows[finished].details)
    if truth_says == "aborted":
        assert "inflight_zombie" not in {verdict for _, verdict in seen}, seen
    else:
        first = next((at for at, verdict in seen if verdict == "inflight_zombie"), None)
        assert first is not None and first < 0.3 + GRACE_S + 1.0, seen
        assert abs(rows["left"].work_end_ns - truth["finished_at"]) <= SCRAPE_S * 1.5e9, (rows["left"].details, truth)


def daemon_gauges(daemon: Any, engine_port: int) -> tuple[float, float]:
    """(auditor_inflight_zombies, auditor_engine_orphans of the engine's port), from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.status.metrics_port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    inflight = re.search(r"^auditor_inflight_zombies (\S+)$", text, re.M)
    orphans = re.search(rf'^auditor_engine_orphans{{port="{engine_port}"}} (\S+)$', text, re.M)
    assert inflight is not None, text
    return float(inflight.group(1)), float(orphans.group(1)) if orphans else 0.0


@pytest.mark.parametrize(("behavior", "source"), [("abort", "bpf"), ("detached", "bpf"), ("detached", "procfs")])
def test_work_that_runs_on_is_alarmed_about_before_its_span_comes(tmp_path: Path, behavior: str, source: str) -> None:
    """vLLM's signal set with spans that come long after (its exporter's five seconds, here thirty):
    two requests run with their clients connected while a third's client leaves at 0.3 s. An
    engine that runs the third on is shown so on /metrics (``auditor_inflight_zombies``,
    ``auditor_engine_orphans``) within two seconds of the grace, while no span has come and the
    truth log says its work still ran, and no longer once the truth says it stopped; one that
    aborts it is never shown."""
    truth_log = tmp_path / "truth.jsonl"
    args = ["--engine-span", "none", "--metrics-names", "vllm"]
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source,
                                     "correlate.late_span_seconds": 40.0}) as daemon, running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, extra_args=args, env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "30000"}) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)  # the port's first scrapes
        # Running past the third's work: a client kept connected after its answer counts against
        # the port's orphans (it may hold a request for all the kernel tells), as does a close
        # within the grace, so the count is a lower bound.
        longs = [kept_alive(engine.port, hold_s=0.5, stream=stream, max_tokens=600, request_id=f"long-{stream}")
                 for stream in (True, False)]
        time.sleep(0.2)
        sent_at = time.time()
        cancel = cancel_after(engine.port, 0.3, "rst", stream=True, max_tokens=400, request_id="left")
        seen: list[tuple[float, float, float]] = []  # (wall time, in-flight zombies, the port's orphans)
        while time.time() - sent_at < 7.5:
            seen.append((time.time(), *daemon_gauges(daemon, engine.port)))
            time.sleep(0.05)
        cancel.join()
        for thread in longs:
            thread.join()
        spans_seen = daemon.readings().spans_received
        [truth] = [t for t in engine.wait_for_truth(3, timeout=30) if t.get("disconnect_at")]
    assert spans_seen == 0, "a span came: the alarm was not told by the port alone"
    want = expected_verdict(truth)
    left_s, finished_s = truth["disconnect_at"] / 1e9, truth["finished_at"] / 1e9
    if want == "aborted":
        assert all(inflight == 0 and orphans == 0 for _, inflight, orphans in seen), seen
        return
    assert want == "zombie", truth
    first = next((at for at, inflight, orphans in seen if orphans >= 1 and inflight >= 1), None)
    assert first is not None, seen
    assert left_s + GRACE_S < first < left_s + GRACE_S + 2.0, (first - left_s, seen)
    assert first < finished_s, "the work was not running any more when it was shown running"
    assert all(orphans <= 1 for _, _, orphans in seen), seen  # the two connected clients' work never
    # Shown while it ran, and no longer within two seconds of its end.
    timeline = [(round(at - left_s, 2), inflight, orphans) for at, inflight, orphans in seen]
    assert all(orphans == 1 for at, _, orphans in seen if first <= at < finished_s - 0.1), \
        (finished_s - left_s, timeline)
    after = [orphans for at, _, orphans in seen if at > finished_s + 2.0]
    assert after and not any(after), (finished_s - left_s, timeline)


@pytest.mark.parametrize("source", ["bpf", "procfs"])
def test_work_that_runs_on_beside_a_pooled_client_between_requests_is_alarmed_about(tmp_path: Path,
                                                                                 source: str) -> None:
    """vLLM's signal set, spans thirty seconds away, and a client of a pool (an SDK's, a gateway's)
    that read a 2 s answer and keeps its connection, quiet, on an engine that keeps idle connections
    a minute: a request whose client leaves at 0.3 s runs on. The pooled client holds no request (the
    kernel says it was answered and has been quiet since), so the orphan is shown in flight from at
    most IDLE_QUIET_MS past that answer, and while the truth says the work ran; before the kernel's
    send times were read it was hidden for as long as the pool kept the connection."""
    args = ["--engine-span", "none", "--metrics-names", "vllm", "--keep-alive-s", "60"]
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source,
                                     "correlate.late_span_seconds": 40.0}) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=tmp_path / "truth.jsonl",
            step_ms=10, extra_args=args, env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "30000"}) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)
        pooled = kept_alive(engine.port, hold_s=12.0, stream=False, max_tokens=200, request_id="pooled")
        time.sleep(2.3)  # its answer read (2 s), its connection kept
        cancel = cancel_after(engine.port, 0.3, "rst", stream=True, max_tokens=500, request_id="left")
        seen: list[tuple[float, float]] = []  # (wall time, the port's orphans)
        sent_at = time.time()
        while time.time() - sent_at < 6.0:
            seen.append((time.time(), daemon_gauges(daemon, engine.port)[1]))
            time.sleep(0.05)
        cancel.join()
        spans_seen = daemon.readings().spans_received
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(2, timeout=30)}
        pooled.join()
    assert spans_seen == 0, "a span came: the alarm was not told by the port alone"
    truth, answered_s = truths["left"], truths["pooled"]["finished_at"] / 1e9
    assert expected_verdict(truth) == "zombie", truth
    left_s, finished_s = truth["disconnect_at"] / 1e9, truth["finished_at"] / 1e9
    first = next((at for at, orphans in seen if orphans >= 1), None)
    assert first is not None, seen
    told_from = max(left_s + GRACE_S, answered_s + IDLE_QUIET_MS / 1000)
    assert told_from - 0.1 < first < told_from + 1.5, (first - left_s, first - answered_s, seen)
    assert first < finished_s and all(orphans <= 1 for _, orphans in seen), seen


@pytest.mark.parametrize("source", ["bpf", "procfs"])
def test_a_queued_orphan_is_shown_in_flight_only_once_the_engine_runs_it(tmp_path: Path, source: str) -> None:
    """One request at a time, vLLM's signals, spans thirty seconds away: a request queued behind
    another loses its client at 0.3 s. While it waits it costs nothing (DESIGN §5) and is not shown
    in flight; the engine, detached, runs it once the one ahead ends, and from then (the truth log's
    ``scheduled_at``) it is shown, by the port alone."""
    truth_log = tmp_path / "truth.jsonl"
    args = ["--engine-span", "none", "--metrics-names", "vllm"]
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source,
                                     "correlate.late_span_seconds": 40.0}) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=1, extra_args=args,
            env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "30000"}) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)  # the port's first scrapes
        ahead = complete(engine.port, stream=True, max_tokens=250, request_id="ahead")
        time.sleep(0.2)
        cancel = cancel_after(engine.port, 0.3, "rst", stream=True, max_tokens=500, request_id="left")
        seen: list[tuple[float, float, float]] = []  # (wall time, in-flight zombies, the port's orphans)
        started = time.time()
        while time.time() - started < 9.0:
            seen.append((time.time(), *daemon_gauges(daemon, engine.port)))
            time.sleep(0.05)
        cancel.join()
        ahead.join()
        spans_seen = daemon.readings().spans_received
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(2, timeout=30)}
    assert spans_seen == 0, "a span came: the alarm was not told by the port alone"
    truth = truths["left"]
    left_s, run_s, finished_s = (truth[key] / 1e9 for key in ("disconnect_at", "scheduled_at", "finished_at"))
    assert left_s + GRACE_S + 0.5 < run_s, ("it did not wait long past its client's leaving", truth)
    timeline = [(round(at - left_s, 2), inflight, orphans) for at, inflight, orphans in seen]
    # Waiting: never shown, though its client left seconds before.
    assert all(inflight == 0 and orphans == 0 for at, inflight, orphans in seen if at < run_s), \
        (run_s - left_s, timeline)
    # Running: shown (the close of the one ahead counts against the count for its grace).
    first = next((at for at, inflight, orphans in seen if at >= run_s and inflight >= 1 and orphans >= 1), None)
    assert first is not None and first < min(finished_s, run_s + GRACE_S + 2.0), (run_s - left_s, timeline)


@pytest.mark.parametrize("names", ["vllm", "sglang"])
@pytest.mark.parametrize("behavior", ["abort", "detached"])
def test_gauges_vllm_leaves_after_every_request_was_aborted(tmp_path: Path, behavior: str, names: str) -> None:
    """vLLM publishes its gauges with each engine step: when every request it holds is aborted at
    once and none comes after, they keep their last values (vLLM issues 22545, 29928). Its step
    counters stand still then. Read as they were, the three aborted requests were orphans running
    on: all three `inflight_zombie` for as long as the engine stayed idle. An engine that runs them
    on keeps stepping, and they are zombies."""
    truth_log = tmp_path / "truth.jsonl"
    args = ["--engine-span", "none", "--metrics-names", names, "--gauges-on-steps"]
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S,
                                     "correlate.late_span_seconds": 5.0}) as daemon, running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, extra_args=args) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)  # the port's first scrapes
        threads = [cancel_after(engine.port, 0.3, kind, stream=True, max_tokens=300, request_id=f"all-{i}")
                   for i, kind in enumerate(("fin", "rst", "fin"))]
        for thread in threads:
            thread.join()
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(3, timeout=30)}
        rows = settled_by_request_id(daemon, truths)
    problems = []
    for request_id, truth in truths.items():
        want, got = expected_verdict(truth), rows[request_id]
        # A close racing the span's end on vLLM's signals is unconfirmed (it counts no client's abort).
        if got.verdict != want and not (want == "aborted" and got.verdict == "unconfirmed"):
            problems.append(f"{request_id}: {got.verdict}, truth {want} ({got.details})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", ["bpf", "procfs"])
@pytest.mark.parametrize("close", ["fin", "rst"])
def test_a_close_right_after_the_next_request_on_a_kept_alive_connection_is_that_requests(
        tmp_path: Path, close: str, source: str) -> None:
    """A kept-alive client reads an answer, sends its next request and leaves at once (a user who
    stops a generation as it starts), before the server has ended the answer's span. The exact
    close was joined to the answer: beside the engine running the next request on, the completed
    answer was judged a zombie (6 of 8 with a reset on the eBPF source, 2 of 8 with a FIN) and the
    request really left had no verdict. On the /proc source the close's interval holds the next
    request's start (where that span comes a round after the answer's, the close joins again:
    tests/test_correlate.py pins that order, which these runs rarely meet). vLLM's signal set,
    against the truth log."""
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **{"engine_metrics.interval_seconds": SCRAPE_S, "probe.source": source,
                                     "correlate.late_span_seconds": 5.0}) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, extra_args=["--engine-span", "none", "--metrics-names", "vllm"]) as engine:
        daemon.set_ports({engine.port})
        time.sleep(0.5)  # the port's first scrapes
        for i in range(3):
            sock = socket.create_connection(("127.0.0.1", engine.port))
            send_request(engine.port, stream=True, max_tokens=20, request_id=f"ka{i}-done", sock=sock)
            read_response(sock)
            send_request(engine.port, stream=True, max_tokens=150, request_id=f"ka{i}-next", sock=sock)
            if close == "rst":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            sock.close()
            time.sleep(0.7)
        truths = {t["request_id"].removeprefix("cmpl-"): t for t in engine.wait_for_truth(6, timeout=30)}
        left = {rid for rid, t in truths.items() if t.get("disconnect_at")}
        assert left == {f"ka{i}-next" for i in range(3)}, truths
        rows = settled_by_request_id(daemon, left)
    problems = [f"{rid}: {row.verdict} for a completed request ({row.details})" for rid, row in rows.items()
                if rid not in left and row.verdict in ("aborted", "zombie", "inflight_zombie")]
    problems += [f"{rid}: {rows[rid].verdict}, truth {expected_verdict(truths[rid])} ({rows[rid].details})"
                 for rid in left if rows[rid].verdict not in (expected_verdict(truths[rid]), "unconfirmed")]
    assert not problems, "\n".join(problems)
