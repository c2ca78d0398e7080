"""Capture export and replay: a window of a real store becomes a capture file; replaying it against
the reference engine with injected cancellations finds the zombies of the buggy behaviour, none
after the fix, and compares the two runs. Garbage capture files and arguments get exit 2."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from auditor import __version__
from auditor.model import RequestVerdict, SpanRole, Verdict
from auditor.store import Store
from replay.capture import (
    CHAT_PATH,
    Capture,
    CapturedRequest,
    CaptureError,
    open_capture_store,
    read_capture,
    sample_cancels,
    write_capture,
)
from replay.capture import export_capture as export
from replay.client import KeptConnections, RequestOutcome, RequestPlan, run_load
from replay.engine.launch import running_engine
from replay.run import ReplayOptions, plan_replay, resolve_baseline
from tests.e2e import free_port
from tests.test_correlate import T0, S, engine_span, http_span

REPLAY_SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "replay.schema.json").read_text())


def auditor(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True, timeout=timeout)


def verdict(trace: str, span: str, at_s: float, kind: str = "fin") -> RequestVerdict:
    return RequestVerdict(request_key=f"h/{trace}/{span}", host="h", verdict=Verdict.ZOMBIE,
                          disconnect_at_ns=T0 + int(at_s * S), disconnect_kind=kind, request_start_ns=T0,
                          work_end_ns=None, lag_seconds=None, trace_id=trace)


def test_export_takes_entry_requests_of_the_window(store: Store, tmp_path: Path) -> None:
    store.insert_spans([
        http_span("a", 0.0, 4.0, span="1"),
        engine_span("a", 0.1, 4.0, "length"),
        http_span("b", 1.0, 2.0, span="2", client=("127.0.0.1", 40001)),
        http_span("c", 99.0, 100.0, span="3", client=("127.0.0.1", 40002)),  # outside the window
    ])
    # A gateway hop: the engine's server span is a child of the gateway's client span: not a request.
    gateway_client = replace(http_span("b", 1.0, 2.0, span="4"), kind="client", role=SpanRole.HTTP_CLIENT)
    hop = replace(http_span("b", 1.1, 1.9, span="5", client=("127.0.0.1", 40003)), parent_span_id="4" * 16)
    store.insert_spans([gateway_client, hop])
    store.upsert_verdicts([verdict("a" * 32, "1" * 16, 1.5, "rst")])
    out = tmp_path / "capture.db"
    capture_id, count = export(store, out, since_ns=T0, until_ns=T0 + 10 * S, stream_default=False)
    assert count == 2
    capture = read_capture(open_capture_store(out), capture_id)
    first, second = capture.requests
    assert first.offset_s == 0.0 and second.offset_s == 1.0
    assert first.disconnect_after_s == 1.5 and first.disconnect_kind == "rst" and first.original_verdict == "zombie"
    assert second.disconnect_after_s is None and second.disconnect_kind is None
    assert first.body["stream"] is False and first.body["max_tokens"] == 100  # from the engine span
    assert second.body["max_tokens"] == 64  # no engine span: the default
    since = dt.datetime.fromtimestamp(T0 / 1e9, dt.timezone.utc).isoformat()
    until = dt.datetime.fromtimestamp((T0 + 10 * S) / 1e9, dt.timezone.utc).isoformat()
    cli_out = tmp_path / "cli.db"
    result = auditor("capture", "export", "--db", store.url, "--since", since, "--until", until, "-o", str(cli_out),
                     "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == {
        "capture_id": 1, "requests": 2, "file": str(cli_out)}, result.stderr
    again = auditor("capture", "export", "--db", store.url, "--since", since, "--until", until, "-o", str(cli_out))
    assert again.returncode == 2 and "exists; pass --force" in again.stderr, again.stderr  # refused up front
    empty_window = auditor("capture", "export", "--db", store.url, "--since", "2020-01-01T00:00:00Z", "--until",
                           "2020-01-01T01:00:00Z", "-o", str(tmp_path / "empty.db"), "--json")
    assert empty_window.returncode == 0 and json.loads(empty_window.stdout)["requests"] == 0
    assert "warning: no requests between" in empty_window.stderr  # --json kept it quiet
    backwards = auditor("capture", "export", "--db", store.url, "--since", until, "--until", since, "-o", "x.db")
    assert backwards.returncode == 2 and "is not after --since" in backwards.stderr
    with pytest.raises(CaptureError, match="exists; pass --force"):
        export(store, out, since_ns=T0, until_ns=T0 + 10 * S)
    assert export(store, out, since_ns=T0, until_ns=T0 + 10 * S, force=True)[1] == 2


def test_export_finds_a_requests_spans_across_a_minute_boundary(store: Store, tmp_path: Path) -> None:
    """Spans are keyed by start minute first (T0 starts a minute): a request's engine span that
    started in the next minute still gives its tokens, and a gateway's client span that started
    in the minute before still marks its hop, which is no request of its own."""
    store.insert_spans([
        http_span("a", 59.9, 64.0, span="1"),
        replace(engine_span("a", 60.1, 64.0, "length", tokens=7), max_tokens=333),
        replace(http_span("b", 59.95, 70.0, span="4"), kind="client", role=SpanRole.HTTP_CLIENT),
        replace(http_span("b", 60.05, 69.0, span="5", client=("127.0.0.1", 40003)), parent_span_id="4" * 16),
    ])
    out = tmp_path / "capture.db"
    capture_id, count = export(store, out, since_ns=T0 + 59 * S, until_ns=T0 + 61 * S, stream_default=False)
    assert count == 1
    (request,) = read_capture(open_capture_store(out), capture_id).requests
    assert request.body["max_tokens"] == 333


def test_export_never_overwrites_its_own_store_or_a_device(store: Store, tmp_path: Path) -> None:
    """-o naming the --db file (however spelt), an empty path, /dev/null or a directory is refused
    with exit 2 before anything is read or written; the store keeps every byte."""
    store.insert_spans([http_span("a", 0.0, 4.0, span="1")])
    db = Path(store.url.removeprefix("sqlite:///"))
    store.close()
    before = db.read_bytes()
    for out, message in ((str(db), "is the database being exported"),
                         (str(tmp_path / "." / db.name), "is the database being exported"),
                         ("", "is empty or a directory"),
                         ("/dev/null", "is not a regular file")):
        result = auditor("capture", "export", "--db", store.url, "--since", "1h", "-o", out, "--force")
        assert result.returncode == 2, (out, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    link = tmp_path / "link.db"
    link.symlink_to(db)
    with pytest.raises(CaptureError, match="is the database being exported"):
        export(Store(store.url), link, since_ns=T0, until_ns=T0 + 10 * S, force=True)
    assert db.read_bytes() == before


def test_force_replaces_a_capture_or_an_empty_file_and_nothing_else(store: Store, tmp_path: Path) -> None:
    """--force answers "exists" for a capture; another auditor store (a backup of the daemon's,
    holding its record) or a file of something else is refused with exit 2, every byte kept."""
    store.insert_spans([http_span("a", 0.0, 4.0, span="1")])
    other_store = tmp_path / "backup.db"
    backup = Store(f"sqlite:///{other_store}")
    backup.insert_spans([http_span("b", 0.0, 4.0, span="2")])
    backup.close()
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    for target, message in ((other_store, "is an auditor store with recorded traffic (its spans)"),
                            (notes, "holds no capture")):
        before = target.read_bytes()
        result = auditor("capture", "export", "--db", store.url, "--since", "1h", "-o", str(target), "--force")
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "--force replaces only a capture file" in result.stderr and "Traceback" not in result.stderr
        assert target.read_bytes() == before
    imported = auditor("capture", "import", str(notes), "--format", "aiperf", "--model", "m", "-o", str(other_store),
                       "--force")
    assert imported.returncode == 2 and "is an auditor store with recorded traffic" in imported.stderr, imported.stderr
    empty, capture = tmp_path / "empty.db", tmp_path / "capture.db"
    empty.touch()
    assert export(store, capture, since_ns=T0, until_ns=T0 + 10 * S)[1] == 1
    for target in (empty, capture):
        assert export(store, target, since_ns=T0, until_ns=T0 + 10 * S, force=True)[1] == 1
        assert len(read_capture(open_capture_store(target)).requests) == 1


def test_a_failed_export_leaves_the_old_capture_as_it_was(store: Store, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import replay.capture

    store.insert_spans([http_span("a", 0.0, 4.0, span="1"), http_span("b", 1.0, 2.0, span="2")])
    out = tmp_path / "capture.db"
    assert export(store, out, since_ns=T0, until_ns=T0 + 10 * S)[1] == 2
    before = out.read_bytes()

    def failing(*args: object) -> Iterator[CapturedRequest]:
        yield CapturedRequest(0.0, CHAT_PATH, {"model": "m"})
        raise CaptureError("the store went away")

    monkeypatch.setattr(replay.capture, "_entry_requests", failing)
    with pytest.raises(CaptureError, match="went away"):
        export(store, out, since_ns=T0, until_ns=T0 + 10 * S, force=True)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("capture", ".capture"))) == ["capture.db"]
    assert len(read_capture(open_capture_store(out)).requests) == 2


@pytest.mark.slow
def test_capture_garbage_is_refused_with_what_to_do(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CaptureError, match="is not a capture file"):
        open_capture_store(junk)
    with pytest.raises(CaptureError, match="no such capture file"):
        open_capture_store(tmp_path / "missing.db")
    empty = tmp_path / "empty.db"
    Store(f"sqlite:///{empty}").close()
    with pytest.raises(CaptureError, match="holds no capture"):
        read_capture(open_capture_store(empty))
    good = tmp_path / "good.db"
    write_capture(good, [CapturedRequest(0.0, CHAT_PATH, {"model": "m"})])
    bad = tmp_path / "bad.db"
    write_capture(bad, [CapturedRequest(0.0, CHAT_PATH, {"model": "m"})])
    store = Store(f"sqlite:///{bad}")
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE captured_requests SET route = '/admin', disconnect_kind = 'maybe'")
    with pytest.raises(CaptureError, match="captured request 1: route '/admin'"):
        read_capture(open_capture_store(bad))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_address = f"127.0.0.1:{busy.getsockname()[1]}"
    for args, message in (([str(junk), "--target", "http://127.0.0.1:1"], "is not a capture file"),
                          ([str(bad), "--target", "http://127.0.0.1:1"], "captured request 1: route"),
                          ([str(empty), "--target", "http://127.0.0.1:1"], "holds no capture"),
                          ([str(bad), "--target", "ftp://x"], "give the engine's URL on this host"),
                          ([str(bad), "--target", "http://192.0.2.1:8000"], "is not on this host"),
                          ([str(bad), "--target", "http://127.0.0.1:8000", "--cancel-rate", "2"], "2"),
                          ([str(good), "--target", "http://127.0.0.1:1", "--baseline", "previous"],
                           "no earlier replay"),
                          ([str(good), "--target", "http://127.0.0.1:1", "--otlp-http", busy_address],
                           f"cannot listen on --otlp-http {busy_address}: Address already in use"),
                          ([str(good), "--target", "http://127.0.0.1:1", "--otlp-http", "127.0.0.1:0"],
                           "is the engine up?")):
        result = auditor("replay", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert "--db" not in result.stderr, result.stderr  # replay has no such option
        assert "otlp.http" not in result.stderr, result.stderr  # nor a configuration key to set
    busy.close()


def test_plans_replay_captured_disconnects_and_timing() -> None:
    capture = Capture(1, "c", 0, 10, "", [
        CapturedRequest(0.0, CHAT_PATH, {"model": "m"}, disconnect_after_s=0.7, disconnect_kind="rst"),
        CapturedRequest(2.0, "/v1/completions", {"model": "m"}),
        CapturedRequest(4.0, "/v1/completions", {"model": "m"}, disconnect_after_s=0.0, disconnect_kind="fin")])
    plans = plan_replay(capture, ReplayOptions(as_captured=True, speed=2.0, model="staging-model"), tag="t")
    assert [(p.cancel_after_s, p.close_with, p.start_at_s) for p in plans] == [
        (0.7, "rst", 0.0), (None, "fin", 1.0), (0.0, "fin", 2.0)]
    # A client that left after its answer was complete closed, it did not cancel: nothing to plan.
    closed = replace(capture, requests=[replace(capture.requests[0], original_verdict="completed")])
    assert plan_replay(closed, ReplayOptions(as_captured=True), tag="t")[0].cancel_after_s is None
    assert {p.body["model"] for p in plans} == {"staging-model"} and plans[0].path == CHAT_PATH
    assert len({p.trace_id for p in plans}) == 3 and plans[1].request_id == "t-000001"
    forced = plan_replay(capture, ReplayOptions(as_captured=True, close_with="fin", speed=0), tag="t")
    assert [(p.cancel_after_s, p.close_with, p.start_at_s) for p in forced] == [
        (0.7, "fin", 0.0), (None, "fin", 0.0), (0.0, "fin", 0.0)]
    assert resolve_baseline(Store("sqlite://"), replace(capture, requests=[
        replace(r, original_verdict=v) for r, v in zip(capture.requests, ["zombie", None, "inflight_zombie"],
                                                        strict=True)]), "capture").zombies == 2
    # Its verdicts are over what replay cancels: a client that left after a complete answer is none.
    with_completed = resolve_baseline(Store("sqlite://"), replace(capture, requests=[
        replace(r, original_verdict=v) for r, v in zip(capture.requests, ["completed", None, "zombie"], strict=True)]),
        "capture")
    assert with_completed.figures == {"sent": 3, "cancelled": 1, "verdicts": {"zombie": 1}, "zombies": 1}
    injected = plan_replay(capture, ReplayOptions(cancel_rate=1.0, cancel_after_s=0.25), tag="t")
    assert [p.cancel_after_s for p in injected] == [0.25, 0.25, 0.25]
    # An export's window may begin long before its first request: timing counts from that request.
    late = replace(capture, requests=[replace(r, offset_s=r.offset_s + 569.0) for r in capture.requests])
    assert [p.start_at_s for p in plan_replay(late, ReplayOptions(speed=1.0), tag="t")] == [0.0, 2.0, 4.0]


def test_load_keeps_start_times_and_the_concurrency_bound() -> None:
    heads: list[bytes] = []

    async def scenario() -> tuple[list[float], int, list[RequestOutcome]]:
        arrivals: list[float] = []
        open_now = peak = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal open_now, peak
            open_now += 1
            peak = max(peak, open_now)
            arrivals.append(loop.time() - started)
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            await asyncio.sleep(0.15)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()
            open_now -= 1

        loop = asyncio.get_running_loop()
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        plans = [RequestPlan(f"r{i}", f"{i + 1:032x}", {}, start_at_s=at)
                 for i, at in enumerate([0.3, 0.0, 0.0, 0.0, 0.0])]  # out of order on purpose
        started = loop.time()
        outcomes = await run_load("127.0.0.1", port, plans, concurrency=2)
        server.close()
        return arrivals, peak, outcomes

    arrivals, peak, outcomes = asyncio.run(scenario())
    assert peak == 2 and len(arrivals) == 5
    assert [o.plan.request_id for o in outcomes] == ["r0", "r1", "r2", "r3", "r4"]  # plan order
    assert all(o.completed and o.status == 200 for o in outcomes), outcomes
    assert arrivals[-1] >= 0.3  # r0 waited for its start time, behind the others
    # Replayed traffic names itself, so the report tells it from the clients it stands in for.
    assert all(f"\r\nUser-Agent: zombie-auditor-replay/{__version__}\r\n".encode() in head for head in heads)


def test_kept_connections_are_reused_until_a_cancel_or_the_server_closes_them() -> None:
    """As an SDK's pool: completed requests leave their connection for the next; a cancel closes
    its connection under it (never reused); a connection the server closed while idle is found
    closed at the next take; one it closes as a request arrives is retried once on a new one."""
    async def scenario() -> tuple[list[tuple[int, str]], list[RequestOutcome], KeptConnections]:
        served: list[tuple[int, str]] = []  # (connection number, request id) in arrival order
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            number = connections
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
                    await reader.readexactly(length)
                    request_id = re.search(rb"(?i)x-request-id: *(\S+)", head)[1].decode()  # type: ignore[index]
                    served.append((number, request_id))
                    assert b"connection: close" not in head.lower()
                    if request_id == "dropped" and len([r for _, r in served if r == request_id]) == 1:
                        break  # the server's idle timeout as the request arrives: its first try only
                    await asyncio.sleep(0.5 if request_id == "cancelled" else 0.01)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    if request_id == "then-idle-close":
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = KeptConnections()
        outcomes = []
        for index, (request_id, cancel) in enumerate([
                ("first", None), ("second", None), ("cancelled", 0.05), ("third", None), ("then-idle-close", None),
                ("after-idle-close", None), ("dropped", None)]):
            plan = RequestPlan(request_id, f"{index + 1:032x}", {}, cancel_after_s=cancel, close_with="rst")
            outcomes += await run_load("127.0.0.1", port, [plan], concurrency=1, connections=pool)
            await asyncio.sleep(0.05)  # the server's close of an idle one arrives before the next take
        await pool.close()
        server.close()
        return served, outcomes, pool

    served, outcomes, pool = asyncio.run(scenario())
    by_request = {request_id: number for number, request_id in served}
    assert by_request["first"] == by_request["second"] == by_request["cancelled"]  # reused until the cancel
    assert by_request["third"] == by_request["then-idle-close"] != by_request["cancelled"]  # a new one after it
    assert by_request["after-idle-close"] != by_request["third"]  # the server's idle close was noticed
    dropped = [number for number, request_id in served if request_id == "dropped"]
    assert dropped == [by_request["after-idle-close"], dropped[1]] and dropped[1] > dropped[0]  # sent again, new one
    assert [o.completed for o in outcomes] == [True, True, False, True, True, True, True], outcomes
    assert outcomes[2].cancelled_at_ns is not None
    assert pool.opened == 4 and pool.reused == 4  # second, cancelled, then-idle-close, dropped's first try


def test_cancels_are_reproducible_by_seed() -> None:
    first = sample_cancels(100, 0.3, seed=7)
    assert sum(first) == 30 and first == sample_cancels(100, 0.3, seed=7) != sample_cancels(100, 0.3, seed=8)


@pytest.mark.privileged
@pytest.mark.slow
def test_replay_finds_zombies_then_confirms_the_fix(tmp_path: Path) -> None:
    capture = tmp_path / "capture.db"
    # Every request cancelled 0.3 s in; the detached engine then generates for about 3.5 s more, long
    # after the load has ended: the replay must wait for those zombies, not judge their provisional aborts.
    requests = [CapturedRequest(offset_s=0.05 * i, path=CHAT_PATH if i % 2 else "/v1/completions",
                                body={"model": "ref-llm-1b", "prompt": "token " * 16, "max_tokens": 250,
                                      "stream": i % 3 != 0,
                                      **({"messages": [{"role": "user", "content": "hi"}]} if i % 2 else {})})
                for i in range(6)]
    write_capture(capture, requests, name="staging")
    otlp_port = free_port()
    replay_args = ["--cancel-rate", "1", "--cancel-after", "0.3", "--speed", "0", "--otlp-http",
                   f"127.0.0.1:{otlp_port}", "--span-delay", "1", "--wait", "90"]
    with running_engine(behavior="detached", otlp=f"http://127.0.0.1:{otlp_port}", step_ms=15) as engine:
        buggy = auditor("replay", str(capture), "--target", engine.url, *replay_args, "--json")
    assert buggy.returncode == 1, (buggy.stdout, buggy.stderr)
    result = json.loads(buggy.stdout)
    jsonschema.Draft202012Validator(REPLAY_SCHEMA).validate(result)
    assert result["schema"] == "auditor.replay/v1" and result["run_id"] == 1
    assert result["sent"] == 6 and result["cancelled"] == 6 and result["unjudged"] == 0, result
    assert result["zombies"] == 6 and result["verdicts"] == {"zombie": 6}, result
    assert result["evidence"] == {"zombie": {"engine_span": 6}} and result["gate"] == "zombies", result
    assert result["planned_cancels"] == 6 and result["errors"] == 0, result
    # The engine's steps set how long the zombies ran: 3.2-5.6 s of lag in runs alone, 2.4 s once in a
    # clean-clone run. Three times the grace says the replay waited for them all the same.
    assert result["wasted_tokens"] > 6 * 150 and result["lag_max_s"] > 1.5 and result["provisional"] == 0
    with running_engine(behavior="abort", otlp=f"http://127.0.0.1:{otlp_port}", step_ms=15) as engine:
        fixed = auditor("replay", str(capture), "--target", engine.url, *replay_args, "--baseline", "previous")
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr)
    assert "Zombies: 6 → 0 (baseline run 1)" in fixed.stdout, fixed.stdout
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in fixed.stdout.splitlines())}
    assert rows["errors"] == ["0", "0"] and rows["cancelled as planned"] == ["6 of 6", "6 of 6"], fixed.stdout
    assert rows["zombie (engine_span)"] == ["6", "-"] and rows["aborted (engine_metrics)"] == ["-", "6"], rows
    # The aborts carry no engine span: the engine's /metrics tell the work stopped, and showing it
    # idle ends the wait, not the
    # 60 s late-span window (the message says which ended it).
    assert "judged: engine idle for 1 s" in fixed.stderr, fixed.stderr
    store = Store(f"sqlite:///{capture}")
    with store.engine.connect() as conn:
        runs = conn.exec_driver_sql("SELECT id, capture_id FROM replay_runs ORDER BY id").all()
        results = conn.exec_driver_sql("SELECT run_id, verdict, count(*) FROM replay_results "
                                       "GROUP BY run_id, verdict ORDER BY run_id").all()
    assert [tuple(r) for r in runs] == [(1, 1), (2, 1)]
    assert [tuple(r) for r in results] == [(1, "zombie", 6), (2, "aborted", 6)]


@pytest.mark.privileged
@pytest.mark.slow
def test_an_engine_without_spans_is_gated_by_its_port(tmp_path: Path) -> None:
    """llama.cpp's server alone (its metric names, no OpenTelemetry): no request gets a verdict,
    and replay waited out --wait and said inconclusive. Its port judges the run: the detached
    engine's work for the clients that left fails the gate as zombies, against the truth log; the
    fixed one passes, and the wait ends once the engine is idle, not at --wait."""
    capture = tmp_path / "capture.db"
    write_capture(capture, [CapturedRequest(offset_s=0.3 * i, path="/v1/completions",
                                            body={"model": "ref-llm-1b", "prompt": "token " * 16, "max_tokens": 200,
                                                  "stream": i % 2 == 0})
                            for i in range(4)], name="llama")
    replay_args = ["--cancel-rate", "1", "--cancel-after", "0.3", "--otlp-http", f"127.0.0.1:{free_port()}",
                   "--span-delay", "1", "--wait", "90", "--json"]
    engine_args = ["--metrics-names", "llamacpp"]
    with running_engine(behavior="detached", step_ms=15, extra_args=engine_args,
                        truth_log=tmp_path / "truth.jsonl") as engine:
        buggy = auditor("replay", str(capture), "--target", engine.url, *replay_args)
        truths = engine.wait_for_truth(4, timeout=30)
    result = json.loads(buggy.stdout)
    jsonschema.Draft202012Validator(REPLAY_SCHEMA).validate(result)
    assert buggy.returncode == 1 and result["gate"] == "zombies", (result, buggy.stderr)
    assert result["no_spans"] and result["judged_by_port"] == 4 and result["unjudged"] == 0, result
    assert result["verdicts"] == {} and result["zombies"] == 0, result  # no request has a verdict of its own
    # The engine ran each on for about 2.2 s past its client's grace: the port counts most of it, each
    # end to within half the pipeline's 0.25 s scrapes, listed at most every other one.
    ran_on = sum((t["finished_at"] - t["disconnect_at"]) / 1e9 - 0.5 for t in truths if t.get("disconnect_at"))
    assert 0.4 * ran_on <= result["orphaned_request_seconds"] <= ran_on + 4 * 0.25, (ran_on, result)
    assert result["orphaned_wasted_cpu_seconds"] > 0, result
    with running_engine(behavior="abort", step_ms=15, extra_args=engine_args) as engine:
        fixed = auditor("replay", str(capture), "--target", engine.url, *replay_args[:-1], "--baseline", "previous")
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr)
    assert "no span came: judged by its port" in fixed.stderr, fixed.stderr
    assert re.search(r"Orphaned request-seconds: \d+\.\d → 0\.0 \(baseline run 1\)", fixed.stdout), fixed.stdout
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in fixed.stdout.splitlines())}
    assert rows["judged by its port (no spans)"] == ["4", "4"], fixed.stdout


def test_zombies_left_by_the_clients_timeout_fail_the_gate_as_zombies(tmp_path: Path) -> None:
    """A request the client gave up on (--request-timeout) is an error, and where the engine went
    on generating, a zombie too: the gate said only "unsound" (exit 4) of an engine that kept
    working after its clients left. Its verdict is waited for like a cancel's and counted apart."""
    capture = tmp_path / "capture.db"
    write_capture(capture, [CapturedRequest(offset_s=0.05 * i, path="/v1/completions",
                                            body={"model": "ref-llm-1b", "prompt": "token " * 16, "max_tokens": 250,
                                                  "stream": i % 2 == 0})
                            for i in range(6)], name="timeouts")
    otlp_port = free_port()
    replay_args = ["--cancel-rate", "0.5", "--cancel-after", "0.3", "--request-timeout", "0.6", "--speed", "0",
                   "--otlp-http", f"127.0.0.1:{otlp_port}", "--span-delay", "1", "--wait", "90", "--json"]
    with running_engine(behavior="detached", otlp=f"http://127.0.0.1:{otlp_port}", step_ms=15) as engine:
        buggy = auditor("replay", str(capture), "--target", engine.url, *replay_args)
    result = json.loads(buggy.stdout)
    jsonschema.Draft202012Validator(REPLAY_SCHEMA).validate(result)
    timed_out = 6 - result["planned_cancels"]
    assert 0 < timed_out < 6 and result["cancelled"] == result["planned_cancels"], result
    assert result["timed_out"] == timed_out and result["error_kinds"] == {"timeout": timed_out}, result
    assert result["timed_out_zombies"] == timed_out and result["zombies"] == 6, result
    assert buggy.returncode == 1 and result["gate"] == "zombies", (result, buggy.stderr)
    assert f"; {timed_out} of them after the client's --request-timeout" in result["gate_reasons"][0], result
    assert {w["left"] for w in result["worst"]} == {"cancel", "timeout"}, result["worst"]
    with running_engine(behavior="abort", otlp=f"http://127.0.0.1:{otlp_port}", step_ms=15) as engine:
        fixed = auditor("replay", str(capture), "--target", engine.url, *replay_args[:-1], "--baseline", "previous")
    # The fixed engine stops for a timeout as for a cancel: no zombie, and the timeouts leave the run
    # unsound (they are failed requests), never a pass.
    assert fixed.returncode == 4, (fixed.stdout, fixed.stderr)
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in fixed.stdout.splitlines())}
    assert rows["timed out (client gave up)"] == [str(timed_out)] * 2, fixed.stdout
    assert rows["zombies after it"] == [str(timed_out), "0"] and rows["zombies"] == ["6", "0"], fixed.stdout
    store = Store(f"sqlite:///{capture}")
    with store.engine.connect() as conn:
        kinds = conn.exec_driver_sql("SELECT run_id, disconnect_kind, count(*) FROM replay_results "
                                     "WHERE disconnect_kind = 'timeout' GROUP BY run_id ORDER BY run_id").all()
    assert [tuple(k) for k in kinds] == [(1, "timeout", timed_out), (2, "timeout", timed_out)]


def test_the_schema_names_every_verdict_a_replay_can_count() -> None:
    """A replay counts whatever verdict its cancels got, unconfirmed included (an engine whose end
    nothing tells): the schema must take each."""
    from auditor.model import Verdict

    properties = REPLAY_SCHEMA["properties"]
    for field in ("verdicts", "evidence"):
        assert set(properties[field]["propertyNames"]["enum"]) == {v.value for v in Verdict}, field


def test_a_baseline_run_of_another_capture_is_refused(tmp_path: Path) -> None:
    """'Zombies: 9 -> 0 (baseline run 2)' where run 2 replayed other traffic said nothing, and
    said it with no word of warning."""
    from auditor.store.schema import CaptureRow, ReplayRunRow
    from replay.capture import CaptureError

    store = Store(f"sqlite:///{tmp_path / 'c.db'}")
    with store.session() as session:
        session.add_all([CaptureRow(id=i, created_ns=0, name=f"c{i}", window_start_ns=0, window_end_ns=1, source="")
                         for i in (1, 2)])
        session.add_all([ReplayRunRow(id=7, started_ns=0, capture_id=1, target="t", parameters={},
                                      summary={"zombies": 9}),
                         ReplayRunRow(id=8, started_ns=1, capture_id=2, target="t", parameters={},
                                      summary={"zombies": 0})])
        session.commit()
    second = Capture(2, "c2", 0, 1, "", [CapturedRequest(0.0, "/v1/completions", {"model": "m"})])
    with pytest.raises(CaptureError, match=r"--baseline 7: that run replayed capture 1, and this replays "
                                           r"capture 2; compare with one of its runs \(\[8\]\)"):
        resolve_baseline(store, second, "7")
    assert resolve_baseline(store, second, "8").zombies == 0
    assert resolve_baseline(store, second, "previous").run_id == 8


def test_requests_the_target_refused_under_reset_cancels_are_errors(tmp_path: Path) -> None:
    """Cancels at 0 s closed with a reset read nothing back: a target that answers 404 (a model it
    does not serve) looked like one that aborted every request, and the gate passed. The server
    span says 404: those are errors, and the run is unsound."""
    capture = tmp_path / "capture.db"
    write_capture(capture, [CapturedRequest(0.05 * i, "/v1/completions", {"model": "m", "prompt": "hi",
                                                                          "max_tokens": 50}) for i in range(4)])
    otlp_port = free_port()
    with running_engine(behavior="detached", otlp=f"http://127.0.0.1:{otlp_port}", step_ms=15) as engine:
        result = auditor("replay", str(capture), "--target", engine.url, "--model", "no-such-model",
                         "--cancel-rate", "1", "--cancel-after", "0", "--close", "rst", "--speed", "0",
                         "--otlp-http", f"127.0.0.1:{otlp_port}", "--span-delay", "1", "--wait", "30", "--json")
    summary = json.loads(result.stdout)
    # Each a refusal, or no verdict at all: a reset that beat the request to the engine leaves no
    # span to judge (unjudged). Never an abort, never a pass.
    assert summary["errors"] + summary["unjudged"] == 4, summary
    if summary["errors"] == 0:
        # On a loaded host every reset can beat its request to the engine: nothing was tested, and
        # the run says so (inconclusive), not that it passed.
        assert result.returncode == 3 and summary["gate"] == "inconclusive", (summary, result.stderr)
        return
    assert result.returncode == 4 and summary["gate"] == "unsound", (summary, result.stderr)
    # A refusal the client read before its timer fired is its own error (HTTP 404, no cancel to
    # judge: seen once in CI, the answer beat the reset); one the reset cut short is judged by its
    # span: completed, refused, and counted an error (HTTP 4xx).
    assert set(summary["error_kinds"]) <= {"HTTP 404", "HTTP 4xx"}, summary
    assert set(summary["verdicts"]) <= {"completed"}, summary
    assert set(summary["evidence"].get("completed", {})) <= {"refused"}, summary
    assert summary["verdicts"].get("completed", 0) <= summary["errors"], summary
