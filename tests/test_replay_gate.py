"""Replay as a release gate: failed requests and missed cancels never pass, captures keep what
was captured (vLLM's engine spans in traces of their own included), and what a benchmark produced
(AIPerf's profile export, a mooncake trace) replays with its own cancellation plan."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import jsonschema
import pytest
from click.testing import CliRunner

from auditor.cli import cli
from auditor.store import Store
from replay.capture import (
    CHAT_PATH,
    CapturedRequest,
    CaptureError,
    open_capture_store,
    read_capture,
    write_capture,
)
from replay.capture import export_capture as export
from replay.client import RequestPlan, run_load
from replay.imports import import_benchmark
from replay.run import ReplayOptions, busy_from_metrics, plan_replay
from tests.test_correlate import T0, S, engine_span, http_span
from tests.test_replay import REPLAY_SCHEMA, auditor, free_port


@pytest.fixture
def answers_404() -> Iterator[int]:
    """A real HTTP/1.1 server that answers 404 to everything, like an engine serving another route."""
    yield from serving_404(delay_s=0.0)


@pytest.fixture
def answers_404_late() -> Iterator[int]:
    """The same, 50 ms after the request: a cancel timer of 0 s always fires first."""
    yield from serving_404(delay_s=0.05)


def serving_404(delay_s: float) -> Iterator[int]:
    import time

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(delay_s)
            body = b'{"detail":"Not Found"}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST

        def log_message(self, *_args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_replay_against_an_engine_that_404s_fails_the_gate(tmp_path: Path, answers_404: int) -> None:
    capture = tmp_path / "capture.db"
    write_capture(capture, [CapturedRequest(0.01 * i, "/v1/completions", {"model": "m", "prompt": "hi"})
                            for i in range(12)])
    result = auditor("replay", str(capture), "--target", f"http://127.0.0.1:{answers_404}", "--speed", "0",
                     "--otlp-http", f"127.0.0.1:{free_port()}", "--wait", "2",
                     "--request-cancellation-rate", "50", "--request-cancellation-delay", "0.5", "--json")
    assert result.returncode == 4, (result.stdout, result.stderr)
    summary = json.loads(result.stdout)
    jsonschema.Draft202012Validator(REPLAY_SCHEMA).validate(summary)
    assert summary["sent"] == 12 and summary["errors"] == 12 and summary["completed"] == 0, summary
    assert summary["error_kinds"] == {"HTTP 404": 12} and summary["gate"] == "unsound"
    assert summary["planned_cancels"] == 6 and summary["cancelled"] == 0  # 50 %, AIPerf's percent
    assert "unsound: 12 of 12 requests failed (HTTP 404 x12)" in result.stderr, result.stderr
    assert "only 0 of 6 planned cancels happened" in result.stderr
    assert "sending: 12/12" in result.stderr  # counts, where standard error is no terminal (a CI log)
    table = auditor("replay", str(capture), "--target", f"http://127.0.0.1:{answers_404}", "--speed", "0",
                    "--otlp-http", f"127.0.0.1:{free_port()}", "--wait", "2", "--cancel-rate", "0",
                    "--baseline", "previous")
    assert table.returncode == 4, (table.stdout, table.stderr)
    assert "errors: HTTP 404 x12" in table.stdout and "Traceback" not in table.stderr
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table.stdout.splitlines())}
    assert rows["errors"] == ["12", "12"] and rows["sent"] == ["12", "12"], table.stdout


def test_refused_connections_are_errors_not_completions() -> None:
    plans = [RequestPlan(f"r{i}", f"{i + 1:032x}", {"model": "m"}) for i in range(3)]
    outcomes = asyncio.run(run_load("127.0.0.1", free_port(), plans, concurrency=2))
    assert all(o.error and o.error.startswith("connect:") and not o.completed for o in outcomes), outcomes


def test_both_spellings_of_one_setting_are_refused() -> None:
    result = CliRunner().invoke(cli, ["replay", "x.db", "--target", "http://127.0.0.1:1", "--cancel-rate", "0.1",
                                      "--request-cancellation-rate", "10"])
    assert result.exit_code == 2 and "give one spelling, not both" in result.output, result.output


@pytest.mark.parametrize("option", ["--cancel-rate", "--request-cancellation-rate", "--cancel-after",
                                    "--request-cancellation-delay", "--speed", "--request-timeout", "--settle",
                                    "--span-delay", "--wait"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_timings_are_refused_by_option(option: str, value: str) -> None:
    """nan passes every range check (each comparison with it is false); inf never ends a wait."""
    result = CliRunner().invoke(cli, ["replay", "x.db", "--target", "http://127.0.0.1:1", option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output


def test_target_port_zero_is_refused() -> None:
    result = CliRunner().invoke(cli, ["replay", "x.db", "--target", "http://127.0.0.1:0"])
    assert result.exit_code == 2 and "port 0 is no engine's port" in result.output, result.output


def test_a_read_only_capture_is_refused_before_any_traffic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 1 means zombies: a replay that could not record its results must not end with it, nor
    load the engine for nothing."""
    capture = tmp_path / "capture.db"
    write_capture(capture, [CapturedRequest(0.0, CHAT_PATH, {"model": "m"})])
    capture.chmod(0o444)
    if os.geteuid() == 0:  # permission bits do not bind root: answer as for anyone else
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: access(path, mode, **kw) and not (
            mode & os.W_OK and Path(path) == capture))
    engine = socket.socket()
    engine.bind(("127.0.0.1", 0))
    engine.listen()
    engine.setblocking(False)
    try:
        result = CliRunner().invoke(cli, ["replay", str(capture), "--target",
                                          f"http://127.0.0.1:{engine.getsockname()[1]}", "--otlp-http", ""])
        assert result.exit_code == 2 and "is read-only; the replay records its run" in result.output, result.output
        with pytest.raises(BlockingIOError):
            engine.accept()  # nothing was sent
    finally:
        engine.close()


def test_capture_finds_engine_spans_in_traces_of_their_own(store: Store, tmp_path: Path) -> None:
    # vLLM without a client traceparent: its llm_request span is a trace of its own, named after
    # the X-Request-Id (cmpl-<id>, chatcmpl-<id>).
    store.insert_spans([
        http_span("a", 0.0, 4.0, span="1", request_id="req-1"),
        engine_span("b", 0.1, 4.0, "length", request_id="cmpl-req-1", tokens=200),
        http_span("c", 1.0, 2.0, span="2", client=("127.0.0.1", 40001), request_id="req-2"),
        engine_span("d", 1.1, 2.0, "stop", request_id="chatcmpl-req-2", tokens=32),
        http_span("e", 2.0, 3.0, span="3", client=("127.0.0.1", 40002), request_id="nobody-saw-me"),
    ])
    out = tmp_path / "capture.db"
    export(store, out, since_ns=T0, until_ns=T0 + 10 * S)
    capture = read_capture(open_capture_store(out))
    assert [(r.body.get("model"), r.body["max_tokens"]) for r in capture.requests] == [
        ("m", 200), ("m", 32), (None, 64)]
    with pytest.raises(CaptureError, match=r"captured request 3 has no model.*pass --model NAME"):
        plan_replay(capture, ReplayOptions(), tag="t")
    assert {p.body["model"] for p in plan_replay(capture, ReplayOptions(model="staging"), tag="t")} == {"staging"}


def aiperf_record(start_ns: int, *, cancelled_after_s: float | None = None, osl: int | None = 40,
                  phase: str = "profiling") -> str:
    metadata = {"x_request_id": "x", "request_start_ns": start_ns, "request_ack_ns": None,
                "request_end_ns": start_ns + 10**9, "benchmark_phase": phase,
                "was_cancelled": cancelled_after_s is not None,
                "cancellation_time_ns": None if cancelled_after_s is None else start_ns + int(cancelled_after_s * S)}
    metrics: dict[str, object] = {"input_sequence_length": {"value": 20, "unit": "tokens"}}
    error = None
    if cancelled_after_s is not None:
        metrics = {"error_isl": {"value": 20, "unit": "tokens"}}
        error = {"code": 499, "type": "RequestCancellationError", "message": "Request was cancelled"}
    elif osl is not None:
        metrics["output_sequence_length"] = {"value": osl, "unit": "tokens"}
    return json.dumps({"metadata": metadata, "metrics": metrics, "error": error})


def test_aiperf_profile_export_replays_with_its_cancellation_plan(tmp_path: Path) -> None:
    export_file = tmp_path / "profile_export.jsonl"
    export_file.write_text("\n".join([
        aiperf_record(T0 - S, phase="warmup"),  # left out, as AIPerf leaves it out
        aiperf_record(T0 + 2 * S, cancelled_after_s=0.0),
        aiperf_record(T0, osl=30),
        aiperf_record(T0 + S, cancelled_after_s=0.2),
        aiperf_record(T0 + 3 * S, osl=50),
    ]) + "\n\n")
    out = tmp_path / "capture.db"
    with pytest.raises(CaptureError, match="pass --model NAME"):
        import_benchmark(export_file, "aiperf", out, model=None)
    assert import_benchmark(export_file, "aiperf", out, model="m") == (1, 4)
    capture = read_capture(open_capture_store(out))
    plans = plan_replay(capture, ReplayOptions(as_captured=True, speed=0), tag="t")
    assert [(r.offset_s, r.disconnect_after_s, r.disconnect_kind) for r in capture.requests] == [
        (0.0, None, None), (1.0, 0.2, "fin"), (2.0, 0.0, "fin"), (3.0, None, None)]
    assert [p.body["max_tokens"] for p in plans] == [30, 40, 40, 50]  # cancelled: the run's median
    assert plans[0].path == CHAT_PATH and plans[0].body["messages"] and plans[0].body["model"] == "m"

    async def slow_engine() -> list[bool]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(1.0)  # far beyond every captured cancel delay
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        outcomes = await run_load("127.0.0.1", server.sockets[0].getsockname()[1], plans, concurrency=4)
        server.close()
        return [o.cancelled_at_ns is not None for o in outcomes]

    assert asyncio.run(slow_engine()) == [False, True, True, False]  # exactly AIPerf's cancelled requests


def test_mooncake_trace_keeps_arrivals_lengths_and_shared_prefixes(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 52, "hash_ids": [46, 47]}\n'
                     '{"timestamp": 10535, "input_length": 6, "output_length": 26, "hash_ids": [46, 48]}\n'
                     '{"timestamp": 27482, "input_length": 5, "output_length": 3}\n')
    out = tmp_path / "capture.db"
    result = CliRunner().invoke(cli, ["capture", "import", str(trace), "--format", "mooncake", "--model", "m",
                                      "--endpoint", "completions", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"capture_id": 1, "requests": 3, "file": str(out)}
    first, second, third = read_capture(open_capture_store(out)).requests
    assert [r.offset_s for r in (first, second, third)] == [0.0, 10.535, 27.482]
    assert [r.body["max_tokens"] for r in (first, second, third)] == [52, 26, 3]
    assert len(first.body["prompt"].split()) == 8 and len(second.body["prompt"].split()) == 6
    assert first.body["prompt"].split()[:3] == second.body["prompt"].split()[:3]  # block 46, shared
    assert first.body["prompt"].split()[4] != second.body["prompt"].split()[4]  # blocks 47 and 48


@pytest.mark.parametrize(("fmt", "lines", "message"), [
    ("aiperf", ['{"metadata": {"request_start_ns": 1}}', "{oops"], "line 2: not JSON"),
    ("aiperf", ['{"metrics": {}}'], "line 1: no \"metadata\" object"),
    ("aiperf", ['{"metadata": {"request_start_ns": "soon"}}'], "line 1: metadata.request_start_ns 'soon'"),
    ("aiperf", ['{"metadata": {"request_start_ns": 5, "was_cancelled": true}}'], "line 1: was_cancelled without"),
    ("aiperf", ['{"metadata": {"request_start_ns": 5, "benchmark_phase": "warmup"}}'], "holds no profiling records"),
    ("mooncake", ['{"timestamp": 0, "input_length": 5, "output_length": 0}'], "line 1: output_length 0"),
    ("mooncake", ['[1, 2]'], "line 1: an array, not an object; is this a mooncake trace file?"),
    ("aiperf", ['"x"'], "line 1: a string, not an object; is this an AIPerf profile_export.jsonl file?"),
    ("aiperf", ["{oops"], "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
                          "is this an AIPerf profile_export.jsonl file (JSON Lines"),
    ("mooncake", ['{"timestamp": -4, "input_length": 5, "output_length": 2}'], "line 1: timestamp -4"),
    ("mooncake", ['{"a": 1}'], "line 1: no timestamp field (its arrival in milliseconds); is this a mooncake trace"),
    ("mooncake", ['{"timestamp": 0, "input_length": 5, "output_length": 2}',
                  '{"timestamp": 1e400, "input_length": 5, "output_length": 2}'], "line 2: timestamp inf"),
    ("mooncake", ['{"timestamp": NaN, "input_length": 5, "output_length": 2}'], "line 1: timestamp nan"),
    ("mooncake", ['{"timestamp": 1e13, "input_length": 5, "output_length": 2}'], "line 1: timestamp 10000000000000.0 is not milliseconds"),
    ("mooncake", ['{"timestamp": 0, "input_length": 10000000000, "output_length": 2}'],
     "line 1: input_length 10000000000 is not a number from 0 to 1048576"),
    ("mooncake", ['{"timestamp": 0, "input_length": NaN, "output_length": 2}'], "line 1: input_length nan"),
    ("mooncake", ['{"timestamp": 0, "input_length": 5, "output_length": 1e400}'], "line 1: output_length inf"),
    ("aiperf", ['{"metadata": {"request_start_ns": 5}, "metrics": {"input_sequence_length": {"value": 1e12}}}'],
     "line 1: metrics.input_sequence_length 1000000000000.0 is not a token count"),
    ("aiperf", ['{"metadata": {"request_start_ns": 5}, "metrics": {"output_sequence_length": NaN}}'],
     "line 1: metrics.output_sequence_length nan"),
    ("aiperf", ['{"metadata": {"request_start_ns": 100000000000000000000}}'], "line 1: metadata.request_start_ns"),
])
def test_imported_garbage_names_the_line(tmp_path: Path, fmt: str, lines: list[str], message: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["capture", "import", str(source), "--format", fmt, "--model", "m",
                                      "-o", str(tmp_path / "out.db")])
    assert result.exit_code == 1 and result.output.startswith("Error: "), result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out.db").exists()


def test_import_of_a_binary_or_missing_file_says_so_in_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "rand.db"
    binary.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 2}\n\xa5\x00\xff\n')
    result = CliRunner().invoke(cli, ["capture", "import", str(binary), "--format", "mooncake", "--model", "m",
                                      "-o", str(tmp_path / "out.db")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip() == (f"Error: {binary} line 2: not UTF-8 text; is this a mooncake trace file "
                                     "(JSON Lines, one object per line)?"), result.output
    # A file that is not there is named before anything else is asked for.
    result = CliRunner().invoke(cli, ["capture", "import", str(tmp_path / "nope.jsonl"), "--format", "aiperf",
                                      "-o", str(tmp_path / "out.db")])
    assert result.exit_code == 2 and "does not exist" in result.output and "--model" not in result.output, result.output
    assert not (tmp_path / "out.db").exists()


def test_import_without_a_model_names_the_format_with_its_article(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"metadata": {"request_start_ns": 5}}\n')
    result = CliRunner().invoke(cli, ["capture", "import", str(source), "--format", "aiperf",
                                      "-o", str(tmp_path / "out.db")])
    assert result.exit_code == 2, result.output
    assert "Error: an AIPerf profile_export.jsonl does not name the model; pass --model" in result.output


def test_import_to_an_empty_path_a_device_or_standard_output_is_refused(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "in.jsonl"
    source.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n')
    for out, message in (("", "is empty or a directory"), ("/dev/null", "/dev/null is not a regular file"),
                         ("-", "a capture is a SQLite file, which cannot go to standard output (-o -)")):
        result = CliRunner().invoke(cli, ["capture", "import", str(source), "--format", "mooncake", "--model", "m",
                                          "-o", out, "--force"])
        assert result.exit_code == 2 and message in result.output, result.output
        assert isinstance(result.exception, SystemExit)
    assert not (tmp_path / "-").exists()


def test_replay_summary_fits_80_columns() -> None:
    """The worst zombies' table shows the trace id's first 16 hex digits (--json has all 32)."""
    from auditor.cli.replay import _print_summary
    from replay.capture import Capture
    from replay.run import ReplaySummary

    summary = ReplaySummary(run_id=3, capture_id=1, target="http://127.0.0.1:8000", sent=200, cancelled=60,
                            planned_cancels=60, verdicts={"inflight_zombie": 40, "aborted": 20},
                            evidence={"inflight_zombie": {"engine_span": 40}, "aborted": {"engine_metrics": 20}},
                            zombies=40, zombie_seconds=812.5, lag_p50_s=12.5, lag_max_s=120.25,
                            baseline_run_id=2, baseline_zombies=41,
                            baseline={"sent": 200, "zombies": 41, "verdicts": {"zombie": 41}})
    summary.worst = [{"request_id": f"replay-101112-{i:06d}", "trace_id": "0af7651916cd43dd8448eb211c80319c",
                      "verdict": "inflight_zombie", "lag_seconds": 1234.56, "tokens_after_disconnect": 123456,
                      "phase": "prefill", "disconnect_kind": "fin"} for i in range(3)]
    capture = Capture(id=1, name="staging", window_start_ns=0, window_end_ns=1, source="", requests=[])

    @click.command()
    def show() -> None:
        _print_summary(summary, capture)

    result = CliRunner().invoke(show, [], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    table = result.output.splitlines()
    assert all(len(line) <= 80 for line in table), "\n".join(line for line in table if len(line) > 80)
    assert "  replay-101112-000000 0af7651916cd43dd… 1234.56 123456 prefill  fin" in table


def test_fin_cancels_drain_and_rst_cancels_reset() -> None:
    """A FIN cancel reads what is still coming before it closes (an unread close would reset the
    connection), an RST cancel resets it: the server sees end-of-file for one, a reset for the other."""

    async def scenario() -> dict[str, str]:
        seen: dict[str, str] = {}

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            request_id = next(line.split(b": ")[1].decode() for line in head.split(b"\r\n")
                              if line.lower().startswith(b"x-request-id"))
            await reader.readexactly(2)  # the body, {}
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            end = asyncio.ensure_future(reader.read(1))
            try:
                for _ in range(300):  # streams until the client goes, as an engine would
                    writer.write(b"data: token\n\n" * 50)
                    await writer.drain()
                    done, _ = await asyncio.wait({end}, timeout=0.01)
                    if done:
                        seen[request_id] = "eof" if end.result() == b"" else "data"
                        break
                for _ in range(5):  # the last tokens, on their way when the client left
                    writer.write(b"data: token\n\n" * 50)
                    await writer.drain()
                    await asyncio.sleep(0.01)
            except ConnectionResetError:
                seen[request_id] = seen.get(request_id, "") + "reset"
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        plans = [RequestPlan("fin", "1" * 32, {}, cancel_after_s=0.1, close_with="fin"),
                 RequestPlan("rst", "2" * 32, {}, cancel_after_s=0.1, close_with="rst")]
        outcomes = await run_load("127.0.0.1", server.sockets[0].getsockname()[1], plans, concurrency=2)
        await asyncio.sleep(0.2)
        server.close()
        assert all(o.cancelled_at_ns and not o.error for o in outcomes), outcomes
        return seen

    # Without the drain, the FIN client's close with unread bytes would show as "eofreset".
    assert asyncio.run(scenario()) == {"fin": "eof", "rst": "reset"}


def test_engine_load_reads_the_prometheus_exposition() -> None:
    text = ("# HELP vllm:num_requests_running Requests running.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{model_name="m"} 1.0\n'
            'vllm:num_requests_waiting_by_reason{reason="x"} 9.0\n'
            "ref_engine_num_requests_running 0\n")
    assert busy_from_metrics(text) == 3.0
    assert busy_from_metrics("llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n") == 3.0
    assert busy_from_metrics("process_cpu_seconds_total 3\n") is None
    assert busy_from_metrics("this is { not prometheus\n") is None


def test_each_gate_reason_carries_its_own_kind() -> None:
    """Zombies beside too few cancels: the run fails for zombies, and the cancels line says
    unsound, not zombies (as docs/replay.md's reasons read)."""
    from replay.run import ReplaySummary, gate, gate_reasons

    summary = ReplaySummary(sent=4, cancelled=2, planned_cancels=4, zombies=1, zombie_seconds=3.0)
    assert gate(summary) == ("zombies", ["1 zombies (3.0 zombie-seconds)", "only 2 of 4 planned cancels happened "
                                         "(the others were answered, or failed, before their timer fired)"])
    assert [kind for kind, _ in gate_reasons(summary)] == ["zombies", "unsound"]
    assert gate(ReplaySummary(sent=4, cancelled=2, planned_cancels=2, unjudged=1)) == (
        "inconclusive", ["1 cancelled requests got no verdict"])
    assert gate(ReplaySummary(sent=4, cancelled=2, planned_cancels=2)) == ("pass", [])


def test_an_engine_without_spans_is_judged_by_its_port() -> None:
    """No span from the engine (llama.cpp's server, TGI): no request has a verdict. Its port's
    orphaned work decides: any stretch fails the gate as zombies, none passes; without gauges to
    read, the cancels stay unjudged and the reason says what would judge them."""
    from replay.run import ReplaySummary, gate

    judged = ReplaySummary(sent=6, cancelled=6, planned_cancels=6, no_spans=True, judged_by_port=6)
    assert gate(judged) == ("pass", [])
    ran_on = ReplaySummary(sent=6, cancelled=6, planned_cancels=6, no_spans=True, judged_by_port=6,
                           orphaned_stretches=2, orphaned_request_seconds=14.25)
    assert gate(ran_on) == ("zombies", ["the engine ran 14.2 request-seconds for clients that had left (2 stretches "
                                        "of orphaned work, told by its /metrics and the kernel alone: it sent no "
                                        "spans)"])
    one = ReplaySummary(sent=1, cancelled=1, planned_cancels=1, no_spans=True, judged_by_port=1,
                        orphaned_stretches=1, orphaned_request_seconds=2.0)
    assert "(1 stretch of orphaned work" in gate(one)[1][0]
    decision, [reason] = gate(ReplaySummary(sent=6, cancelled=6, planned_cancels=6, no_spans=True, unjudged=6))
    assert decision == "inconclusive" and "sent no spans" in reason and "--metrics" in reason, reason


def test_a_run_that_cancels_nothing_tested_nothing() -> None:
    """An export of a quiet hour replayed --as-captured (or --cancel-rate 0) cancels nothing: it
    passed the gate against an engine that leaves a zombie at every disconnect."""
    from replay.run import ReplaySummary, gate

    decision, reasons = gate(ReplaySummary(sent=8, completed=8, planned_cancels=0))
    assert decision == "unsound" and "no request was cancelled" in reasons[0] and "--cancel-rate" in reasons[0]
    assert gate(ReplaySummary(sent=0))[0] == "pass"  # nothing sent is refused earlier, not judged here


def test_a_refusal_that_comes_as_the_cancel_goes_out_is_an_error(answers_404_late: int) -> None:
    """--cancel-after 0: the timer fires before the 404 arrives. The FIN's drain reads it: the
    target refused the request, which is no abort (6 of 6 were counted clean aborts, gate pass)."""
    plans = [RequestPlan(f"r{i}", f"{i + 1:032x}", {"model": "nope", "prompt": "hi"}, cancel_after_s=0.0,
                         close_with="fin") for i in range(6)]
    outcomes = asyncio.run(run_load("127.0.0.1", answers_404_late, plans, concurrency=2))
    assert all(o.cancelled_at_ns is not None for o in outcomes)
    assert all(o.error is not None and o.error.startswith("HTTP 404") for o in outcomes), [o.error for o in outcomes]


def test_a_captured_body_that_is_not_json_is_named(tmp_path: Path) -> None:
    """It raised JSONDecodeError through the CLI: a traceback and exit 1, which means zombies."""
    import sqlite3

    capture = tmp_path / "capture.db"
    write_capture(capture, [CapturedRequest(0.01 * i, "/v1/completions", {"model": "m", "prompt": "hi"})
                            for i in range(3)])
    with sqlite3.connect(capture) as conn:
        (row_id,) = conn.execute("SELECT min(id) FROM captured_requests").fetchone()
        conn.execute("UPDATE captured_requests SET body = 'not json' WHERE id = ?", (row_id,))
    conn.close()
    with pytest.raises(CaptureError, match=f"captured request {row_id}: body is not JSON"):
        read_capture(open_capture_store(capture))
    result = auditor("replay", str(capture), "--target", "http://127.0.0.1:1", "--otlp-http",
                     f"127.0.0.1:{free_port()}")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "body is not JSON" in result.stderr and "Traceback" not in result.stderr
