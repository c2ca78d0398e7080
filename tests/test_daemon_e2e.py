"""The daemon against the reference engine in every behaviour, with real clients cancelling.

Each behaviour runs the same scenarios: a request cancelled while queued, one cancelled during
prefill, two cancelled mid-decode (streaming with FIN, non-streaming with RST), a completed
request on a keep-alive connection that then goes idle and closes, and a connection kept as an
SDK's pool keeps it: two requests complete on it, then a third is left mid-decode. The verdicts
must match the engine's truth log: every cancelled request found, no false zombie, lag within
20 ms (with the /proc fallback: within its poll interval more). Both disconnect sources run: the
eBPF probe (root) and the polling fallback, which needs no privilege, so CI without eBPF still
runs it end to end.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from auditor.correlate.correlator import EVENTS_SETTLE_NS
from auditor.correlate.evidence import ORPHANS_SETTLE_NS, ORPHANS_SETTLE_WOKEN_NS
from auditor.model import CoverageKind
from auditor.store import CoverageRow, SpanRow
from replay.engine.launch import running_engine
from tests.e2e import (
    GRACE_S,
    cancel_after,
    complete,
    disconnect,
    expected_verdict,
    read_response,
    running_daemon,
    send_request,
    verdict_rows,
    wait_for,
)

pytestmark = [pytest.mark.slow]
LAG_TOLERANCE_S = 0.020
POLL_HZ = 20.0
SOURCES = [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"]


def lag_tolerance(source: str) -> float:
    """A polled close is known to a poll interval; the probe's to the microsecond."""
    return LAG_TOLERANCE_S + (1.0 / POLL_HZ if source == "procfs" else 0.0)


def daemon_overrides(source: str, **extra: object) -> dict[str, object]:
    return {"probe.source": source, "probe.poll_hz": POLL_HZ, **extra}


DRIVEN_REQUESTS = 11  # how many requests drive() sends


def drive(port: int, tag: str) -> None:
    # Two blockers fill the batch; the third waits in the queue and is cancelled there.
    blockers = [complete(port, stream=True, max_tokens=40, request_id=f"{tag}-blocker{i}") for i in range(2)]
    time.sleep(0.1)
    queued = cancel_after(port, 0.1, "fin", stream=False, max_tokens=30, request_id=f"{tag}-queued")
    for thread in [*blockers, queued]:
        thread.join()
    time.sleep(0.6)
    # Mid-decode: streaming closed with FIN, non-streaming reset.
    decode = [cancel_after(port, 0.35, "fin", stream=True, max_tokens=120, request_id=f"{tag}-decode-fin"),
              cancel_after(port, 0.35, "rst", stream=False, max_tokens=120, request_id=f"{tag}-decode-rst")]
    for thread in decode:
        thread.join()
    # During prefill: a long prompt, cancelled right after it was sent.
    cancel_after(port, 0.03, "rst", stream=True, max_tokens=20, prompt_words=1000,
                 request_id=f"{tag}-prefill").join()
    # Keep-alive: two complete requests on one connection, then an idle close (never a finding).
    with send_request(port, stream=False, max_tokens=3, request_id=f"{tag}-ka1") as sock:
        read_response(sock)
        send_request(port, stream=True, max_tokens=3, request_id=f"{tag}-ka2", sock=sock)
        read_response(sock)
        time.sleep(0.2)
    # Pooled, as an SDK keeps its connections: two complete requests, then a third left mid-decode
    # on the same connection (a reset, as a client closing with the stream unread). The close is
    # the third's alone: the first two ended before it, on the same 4-tuple.
    with send_request(port, stream=True, max_tokens=3, request_id=f"{tag}-pool1") as sock:
        read_response(sock)
        send_request(port, stream=False, max_tokens=3, request_id=f"{tag}-pool2", sock=sock)
        read_response(sock)
        send_request(port, stream=True, max_tokens=120, request_id=f"{tag}-pool-left", sock=sock)
        time.sleep(0.35)
        disconnect(sock, "rst")


def drive_and_judge(daemon: Any, engine: Any, behavior: str) -> tuple[set[str], list[dict[str, Any]], list[Any]]:
    """Drive the five cancels of ``drive`` at a watched engine; (cancelled ids, truths of the
    requests whose client left, verdict rows) once the daemon has judged them."""
    daemon.set_ports({engine.port})
    drive(engine.port, behavior)
    cancelled = {f"cmpl-{behavior}-{name}" for name in ("queued", "decode-fin", "decode-rst", "prefill", "pool-left")}
    # Behaviours that ignore the client finish their work later: wait for the engine's word.
    assert wait_for(lambda: cancelled <= {t["request_id"] for t in engine.truth()}, timeout_s=20)
    truths = [t for t in engine.truth() if t.get("disconnect_at")]
    # Every disconnect the engine saw becomes a settled-enough verdict (engine spans may lag).
    assert wait_for(lambda: len(verdict_rows(daemon)) >= len(truths), timeout_s=15)
    time.sleep(1.0)
    return cancelled, truths, verdict_rows(daemon)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("behavior", ["abort", "detached", "no-check", "late", "queued-leak"])
def test_verdicts_match_truth(tmp_path: Path, behavior: str, source: str) -> None:
    truth_log = tmp_path / "truth.jsonl"
    with running_daemon(tmp_path, **daemon_overrides(source, **{"correlate.late_span_seconds": 30.0})) as daemon, \
            running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=2,
            extra_args=["--late-seconds", "1.0", "--prefill-chunk", "64", "--trace-aborted"]) as engine:
        assert daemon.source_name == source
        # The port's orphans are read once a scrape's closes are in: sooner where the probe wakes the daemon.
        assert daemon.correlator.orphans_settle_ns == (ORPHANS_SETTLE_WOKEN_NS if source == "bpf" else ORPHANS_SETTLE_NS)
        cancelled, truths, judged = drive_and_judge(daemon, engine, behavior)
        rows = {row.request_id: row for row in judged}
        all_truth = engine.truth()
    assert {t["request_id"] for t in truths} >= cancelled, [t for t in all_truth if t["request_id"] in cancelled]
    # The prefill case resets 30 ms after sending: no poll of the fallback may list its connection,
    # which the kernel's notice of the freed socket still makes an event (docs/probe.md).
    problems = mismatches(list(rows.values()), truths, source, set())
    shorter_than_a_poll = {f"{behavior}-prefill"} if source == "procfs" else set()
    for truth in truths:  # and, where an engine span tells the phase, the phase
        row = rows.get(truth["request_id"].removeprefix("cmpl-"))
        # A close within one poll of the request's arrival is known to an interval that may hold
        # both queued and prefill (on a busy host the engine may not have taken the request up 30
        # ms after it came): which one it fell in is not known to the polling fallback.
        if truth["request_id"].removeprefix("cmpl-") in shorter_than_a_poll:
            continue
        if row is not None and row.details.get("engine_span") and row.phase != truth["phase_at_disconnect"]:
            problems.append(f"{row.request_id}: phase {row.phase}, truth {truth['phase_at_disconnect']}")
    assert not problems, "\n".join(problems)
    # The keep-alive requests completed, their connection closed idle or under a later request on
    # it: never a finding.
    kept = {f"{behavior}-{name}" for name in ("ka1", "ka2", "pool1", "pool2")}
    assert all(rows[rid].verdict == "completed" for rid in kept & set(rows))
    assert {t["request_id"] for t in all_truth} >= {f"cmpl-{rid}" for rid in kept}


@pytest.mark.privileged
def test_live_notices_flag_a_zombie_while_it_runs(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}", step_ms=10,
            extra_args=["--live", f"127.0.0.1:{daemon.status.live_port}"]) as engine:
        daemon.set_ports({engine.port})
        cancel_after(engine.port, 0.3, "fin", stream=True, max_tokens=400, request_id="live").join()
        assert wait_for(lambda: [r.verdict for r in verdict_rows(daemon)] == ["inflight_zombie"],
                        timeout_s=30, interval_s=0.02)
        [flagged] = verdict_rows(daemon)
        notices = daemon.readings().live_notices  # as /metrics shows them
        assert notices["accepted"] >= 2 and notices["rejected"] == notices["dropped"] == 0, notices
        # When the work finally ends, the same request becomes a zombie with its full lag: it was
        # flagged while its work still ran (how soon is bench/detection.py's figure).
        assert wait_for(lambda: [r.verdict for r in verdict_rows(daemon)] == ["zombie"], timeout_s=60)
        [row] = verdict_rows(daemon)
        assert row.request_id == flagged.request_id == "live"
        assert row.lag_seconds > flagged.lag_seconds >= GRACE_S, (row.lag_seconds, flagged.lag_seconds)


@pytest.mark.parametrize("source", SOURCES)
def test_plain_clients_with_live_notices_match_truth(tmp_path: Path, source: str) -> None:
    """curl and the openai SDK send no traceparent and no X-Request-Id: the engine's span is then
    of a trace of its own that nothing joins, and its live notices are its only word on the
    request. A client that reads the whole answer and closes at once races the server span's end
    (most of these do); none of them may be judged aborted or a zombie (the end notice says how
    the engine finished), and those that left mid-decode are aborted, against the truth log."""
    with running_daemon(tmp_path, **daemon_overrides(source)) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", step_ms=10,
            truth_log=tmp_path / "truth.jsonl", extra_args=["--live", f"127.0.0.1:{daemon.status.live_port}"]) as engine:
        daemon.set_ports({engine.port})
        for index in range(12):
            complete(engine.port, stream=index % 2 == 0, max_tokens=4, request_id=None).join()
        for kind in ("fin", "rst"):
            cancel_after(engine.port, 0.3, kind, stream=True, max_tokens=200, request_id=None).join()
        assert wait_for(lambda: len(engine.truth()) == 14, timeout_s=20)
        truths = {t["client_port"]: t for t in engine.truth()}
        left = {port for port, t in truths.items() if t.get("disconnect_at")}
        assert len(left) == 2, truths
        assert wait_for(lambda: left <= {r.client_port for r in verdict_rows(daemon)}, timeout_s=15)
        time.sleep(3.5)  # past the late-span window: every verdict settled
        rows = {r.client_port: r for r in verdict_rows(daemon)}
    wrong = {port: (rows[port].verdict, truths[port].get("finish_reason"), rows[port].details)
             for port in rows if (rows[port].verdict == "aborted") is not (port in left)
             or rows[port].verdict in ("zombie", "inflight_zombie")}
    assert not wrong, wrong
    raced = [rows[port].verdict for port in rows if port not in left]
    assert set(raced) <= {"completed"}, raced  # the end notice told a normal finish: never unconfirmed


@pytest.mark.privileged
def test_vllm_style_abort_without_engine_span_is_aborted(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", step_ms=10) as engine:
        daemon.set_ports({engine.port})
        # Like vLLM with tracing on, the engine spans every normal finish: once the daemon has seen
        # that, a cancelled request without an engine span was aborted, even where its span ended
        # as the client closed.
        complete(engine.port, stream=False, max_tokens=4, request_id="v-warm-up").join()
        threads = [cancel_after(engine.port, 0.3, kind, stream=stream, max_tokens=200, request_id=f"v-{kind}-{stream}")
                   for kind in ("fin", "rst") for stream in (True, False)]
        for thread in threads:
            thread.join()
        def cancelled() -> list:
            rows = verdict_rows(daemon)
            # The warm-up's client closed after the last byte: completed, or unconfirmed where its
            # close raced the span's end; never aborted or zombie.
            assert all(r.verdict in ("completed", "unconfirmed") for r in rows if r.request_id == "v-warm-up"), rows
            return [r for r in rows if r.request_id != "v-warm-up"]

        # A verdict without an engine span is provisional until a scrape of the engine's /metrics
        # after the disconnect shows whether the work stopped.
        assert wait_for(lambda: len(cancelled()) == 4 and not any(r.details["provisional"] and r.verdict != "aborted"
                                                                  for r in cancelled()), timeout_s=15)
        rows = cancelled()
        assert {r.verdict for r in rows} == {"aborted"}, [(r.verdict, r.details) for r in rows]
        assert all(not r.details["engine_span"] and r.phase == "unknown" for r in rows)


@pytest.mark.privileged
@pytest.mark.parametrize("propagate", [True, False])
def test_gateway_chain_one_verdict_with_hop_delay(tmp_path: Path, propagate: bool) -> None:
    from replay.engine.launch import running_gateway

    with running_daemon(tmp_path) as daemon:
        otlp = f"http://127.0.0.1:{daemon.status.http_port}"
        with running_engine(behavior="abort", otlp=otlp, step_ms=10) as engine, \
                running_gateway(engine.url, propagate=propagate, otlp=otlp) as gateway:
            daemon.set_ports({engine.port, gateway.port})
            complete(gateway.port, stream=False, max_tokens=4, request_id="warm-up").join()
            cancel_after(gateway.port, 0.3, "fin", stream=True, max_tokens=150, request_id="via-gateway").join()
            want = "aborted" if propagate else "zombie"
            # The engine hop's spans may arrive first; the gateway's span then merges the two.
            detail = "hops" if propagate else "upstream_not_closed_ports"

            def judged() -> list:
                # The warm-up completed: at most a close race (completed or unconfirmed), never more.
                return [r for r in verdict_rows(daemon)
                        if r.request_id == "via-gateway" or r.verdict not in ("completed", "unconfirmed")]

            assert wait_for(lambda: [(r.verdict, r.server_port, detail in r.details) for r in judged()]
                            == [(want, gateway.port, True)], timeout_s=30), \
                [(r.verdict, r.server_port, r.details) for r in judged()]
            [row] = judged()
    # One request, one verdict, at the hop where the client left.
    assert row.server_port == gateway.port and row.request_id == "via-gateway"
    if propagate:
        assert "hops" in row.details, row.details
        [hop] = row.details["hops"]
        assert hop["server_port"] == engine.port and 0 <= hop["disconnect_delay_s"] < 0.5
    else:
        assert row.details["upstream_not_closed_ports"] == [engine.port] and row.lag_seconds > GRACE_S


def mismatches(verdicts: list, truths: list[dict], source: str, missable: set[str]) -> list[str]:
    """Each request the engine saw a disconnect of against its verdict; completed ones never judged.
    A span without a peer names its request by the engine's id (``cmpl-<X-Request-Id>``)."""
    rows = {(row.request_id or "").removeprefix("cmpl-"): row for row in verdicts}
    problems = []
    for truth in truths:
        request_id = truth["request_id"].removeprefix("cmpl-")
        row = rows.get(request_id)
        if row is None:
            if request_id not in missable:
                problems.append(f"{request_id}: no verdict")
            continue
        want, truth_lag = expected_verdict(truth), (truth["finished_at"] - truth["disconnect_at"]) / 1e9
        # Within the source's time resolution of the grace period, aborted and zombie are one call.
        at_grace = {row.verdict, want} <= {"aborted", "zombie"} and abs(truth_lag - GRACE_S) <= lag_tolerance(source)
        if row.verdict != want and not at_grace:
            problems.append(f"{request_id}: verdict {row.verdict}, truth {want} (truth lag {truth_lag:.3f} s)")
        elif want != "completed" and abs(row.lag_seconds - truth_lag) > lag_tolerance(source):
            # Both ends, so a failure says which one differs: the disconnect the kernel saw against
            # when the engine noticed it, or the end of work against the engine's own end.
            problems.append(f"{request_id}: lag {row.lag_seconds:.4f} s, truth {truth_lag:.4f} s "
                            f"({row.disconnect_kind} at {(row.disconnect_at_ns - truth['disconnect_at']) / 1e9:+.4f} s, "
                            f"work end at {((row.work_end_ns or 0) - truth['finished_at']) / 1e9:+.4f} s "
                            "from the engine's)")
    seen = {t["request_id"].removeprefix("cmpl-") for t in truths}
    return problems + [f"{rid}: verdict {row.verdict} for a request the engine saw no disconnect of"
                       for rid, row in rows.items() if rid not in seen and row.verdict != "completed"]


@pytest.mark.parametrize("source", [
    pytest.param("bpf", marks=pytest.mark.privileged),
    "procfs"])
@pytest.mark.parametrize("behavior", ["abort", "detached"])
def test_cancel_matrix_matches_truth(tmp_path: Path, behavior: str, source: str) -> None:
    """FIN and RST, streaming and not, cancelled 0, 0.3 and 0.8 s after sending, beside requests
    that complete: every cancel gets the engine's verdict, no completed request is judged."""
    cases = [(kind, stream, delay) for kind in ("fin", "rst") for stream in (True, False) for delay in (0.0, 0.3, 0.8)]
    with running_daemon(tmp_path, **daemon_overrides(source, **{"correlate.late_span_seconds": 10.0})) as daemon, \
            running_engine(behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                           truth_log=tmp_path / "truth.jsonl", step_ms=10, max_batch=16,
                           extra_args=["--trace-aborted"]) as engine:
        assert daemon.source_name == source
        daemon.set_ports({engine.port})
        threads = [complete(engine.port, stream=i % 2 == 0, max_tokens=20, request_id=f"done{i}") for i in range(3)]
        for kind, stream, delay in cases:
            threads.append(cancel_after(engine.port, delay, kind, stream=stream, max_tokens=150,
                                        request_id=f"{kind}-{'stream' if stream else 'plain'}-{delay}"))
            time.sleep(0.05)
        for thread in threads:
            thread.join()
        cancelled = {f"cmpl-{k}-{'stream' if s else 'plain'}-{d}" for k, s, d in cases}
        assert wait_for(lambda: cancelled <= {t["request_id"] for t in engine.truth()}, timeout_s=30)
        truths = [t for t in engine.truth() if t.get("disconnect_at")]
        assert {t["request_id"] for t in truths} >= cancelled
        # A client that leaves at once (delay 0) is gone before the fallback's next poll: the
        # kernel's notice of the freed socket tells it (docs/probe.md).
        wait_for(lambda: not mismatches(verdict_rows(daemon), truths, source, set()),
                 timeout_s=20)  # the assertion below names what is still wrong
        problems = mismatches(verdict_rows(daemon), truths, source, set())
        with daemon.store.session() as session:
            peerless = session.scalar(select(func.coalesce(func.sum(CoverageRow.count), 0)).where(
                CoverageRow.kind == CoverageKind.PEERLESS_SPAN_JOINED.value)) or 0
    assert not problems, "\n".join(problems)
    # A client that resets right after sending may leave a span without a peer address (the
    # socket was gone when the server asked); joined by port, each such join is counted.
    assert peerless <= len([c for c in cases if c[0] == "rst" and c[2] == 0])


def connect_from(port: int, client_port: int = 0, timeout_s: float = 10.0) -> socket.socket:
    """A connection to ``port`` from ``client_port`` (any when 0). A port the last connection left
    in TIME_WAIT is taken over once the kernel allows it (loopback: a second after its last segment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", client_port))
            sock.connect(("127.0.0.1", port))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def close_with_fin(sock: socket.socket) -> None:
    """Close with nothing unread, so the kernel sends FIN, and wait for the server's own close."""
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(5)
    while sock.recv(65536):
        pass
    sock.close()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("first_close, reuse_after_s", [("fin", 1.2), ("rst", 0.3)])
def test_a_request_on_a_reused_4_tuple_is_not_the_one_the_client_left(tmp_path: Path, source: str, first_close: str,
                                                                      reuse_after_s: float) -> None:
    """A client closes an idle keep-alive connection, with a FIN (the server closes it within a
    millisecond; the client's TIME_WAIT can be taken over a second later) or a reset (nothing
    holds the port); then a new connection from the same port carries a long request that
    completes. Joined to the old disconnect, that request would read as one whose client had left
    before it was read, running on for most of a second: a false zombie. The engine's truth log:
    no disconnect."""
    with running_daemon(tmp_path, **daemon_overrides(source)) as daemon, running_engine(
            behavior="abort", otlp=f"http://127.0.0.1:{daemon.status.http_port}", step_ms=10,
            truth_log=tmp_path / "truth.jsonl") as engine:
        daemon.set_ports({engine.port})
        first = connect_from(engine.port)
        client_port = first.getsockname()[1]
        send_request(engine.port, stream=False, max_tokens=3, request_id="reuse-first", sock=first)
        read_response(first)
        time.sleep(0.2)  # idle on keep-alive, then the client leaves
        if first_close == "fin":
            close_with_fin(first)
        else:
            disconnect(first, "rst")
        time.sleep(reuse_after_s)
        second = connect_from(engine.port, client_port)
        reused_port = second.getsockname()[1]
        send_request(engine.port, stream=True, max_tokens=80, request_id="reuse-second", sock=second)
        read_response(second)
        close_with_fin(second)
        assert wait_for(lambda: {"cmpl-reuse-first", "cmpl-reuse-second"} <= {t["request_id"] for t in engine.truth()},
                        timeout_s=10)
        truths = {t["request_id"]: t for t in engine.truth()}

        def judged() -> bool:  # both requests' server spans read, and rounds run since
            with daemon.store.session() as session:
                ids = set(session.scalars(select(SpanRow.request_id).where(SpanRow.role == "http_server")))
            return {"reuse-first", "reuse-second"} <= ids

        assert wait_for(judged, timeout_s=15)
        # Past the wait of a join after a reset (the events of the span's end surely stored), and a
        # few correlation rounds (0.2 s each) after it.
        time.sleep(EVENTS_SETTLE_NS / 1e9 + 1.0)
        rows = verdict_rows(daemon)
        kinds = [event.kind.value for event in daemon.store.conn_events() if event.client_port == client_port]
    assert truths["cmpl-reuse-second"]["disconnect_at"] is None and truths["cmpl-reuse-second"]["finish_reason"] == "length"
    assert reused_port == client_port
    # Each connection's departure: a FIN, which the /proc source reads as a reset when the server's
    # close follows within one poll (docs/probe.md).
    assert sum(kind in ("peer_fin", "peer_rst") for kind in kinds) == 2, kinds
    wrong = [(r.request_id, r.verdict, r.lag_seconds) for r in rows if r.verdict != "completed"]
    assert not wrong, wrong
