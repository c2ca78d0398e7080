"""The engine's spans at a real OTLP endpoint (HTTP and gRPC), the gateway, the HTTP API and CLI.

The OTLP endpoints are minimal real receivers started here: an HTTP server decoding
``ExportTraceServiceRequest`` protobuf at ``/v1/traces``, and a gRPC TraceService.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from click.testing import CliRunner
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from auditor.cli import cli
from replay.engine.launch import EngineProcess, running_engine, running_gateway

SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class SpanSink:
    """Spans received, flattened to dicts; thread-safe."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "kind": span.kind, "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "resource": resource})
            self._lock.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        with self._lock:
            found: list[dict[str, Any]] = []

            def ready() -> bool:
                found[:] = [s for s in self.spans if predicate(s)]
                return bool(found)

            assert self._lock.wait_for(ready, timeout), f"no such span among {[s['name'] for s in self.spans]}"
            return found[0]

    def matching(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if predicate(s)]


@pytest.fixture
def otlp_http() -> Iterator[tuple[str, SpanSink]]:
    sink = SpanSink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest()
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request.ParseFromString(body)
            sink.add(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", sink
    server.shutdown()
    server.server_close()


@pytest.fixture
def otlp_grpc() -> Iterator[tuple[str, SpanSink]]:
    sink = SpanSink()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            sink.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"grpc://127.0.0.1:{port}", sink
    server.stop(None)


def wait_record(engine: EngineProcess, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
    return engine.truth_of(request_id, timeout)


def send_raw(url: str, path: str, request_id: str, max_tokens: int, stream: bool) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    body = json.dumps({"messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                       "stream": stream}).encode()
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: "
                  f"{request_id}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    return sock


def stream_then_leave(url: str, path: str, request_id: str, events: int = 3, max_tokens: int = 200) -> int:
    """Stream a request, read ``events`` chunks, close; returns the client port."""
    sock = send_raw(url, path, request_id, max_tokens, stream=True)
    received = b""
    while received.count(b"data: ") < events:
        piece = sock.recv(65536)
        assert piece, received
        received += piece
    client_port: int = sock.getsockname()[1]
    sock.close()
    return client_port


def by_request_id(request_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s["name"] == "llm_request" and s["attributes"].get("gen_ai.request.id") == request_id


def test_spans_carry_vllm_names_and_join_keys_over_otlp_http(otlp_http: tuple[str, SpanSink], tmp_path: Path) -> None:
    endpoint, sink = otlp_http
    with running_engine(otlp=endpoint, truth_log=tmp_path / "truth.jsonl", step_ms=3,
                        extra_args=["--metrics-names", "vllm"]) as engine:
        response = httpx.post(engine.url + "/v1/completions", timeout=10, headers={
            "X-Request-Id": "span-a", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
            "X-Forwarded-For": "10.9.8.7"},  # must not replace the real peer
            json={"prompt": "trace me please", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9})
        assert response.status_code == 200 and response.json()["id"] == "cmpl-span-a"
        record = wait_record(engine, "cmpl-span-a")
        assert record["client_addr"] == "127.0.0.1"
        llm = sink.wait_for(by_request_id("cmpl-span-a"))
        http_span = sink.wait_for(lambda s: s["name"] == "POST /v1/completions" and s["trace_id"] == TRACE_ID)

        # A cancelled stream: like vLLM 0.33, no llm_request span for it.
        stream_then_leave(engine.url, "/v1/chat/completions", "span-b")
        assert wait_record(engine, "chatcmpl-span-b")["finish_reason"] == "abort"
        sink.wait_for(lambda s: s["name"] == "POST /v1/chat/completions")
        time.sleep(0.6)  # three export rounds
        assert sink.matching(by_request_id("chatcmpl-span-b")) == []
        engine_pid, engine_port = engine.pid, engine.port

    assert (llm["kind"], llm["trace_id"], llm["parent"]) == (SPAN_KIND_SERVER, TRACE_ID, PARENT_ID)
    assert (llm["start"], llm["end"]) == (record["arrival_at"], record["finished_at"])
    attributes = llm["attributes"]
    assert attributes["gen_ai.usage.prompt_tokens"] == 2 + 1 + 2 and attributes["gen_ai.usage.completion_tokens"] == 5
    assert attributes["gen_ai.request.max_tokens"] == 5 and "gen_ai.response.model" not in attributes  # as vLLM's
    assert (attributes["gen_ai.request.temperature"], attributes["gen_ai.request.top_p"]) == (0.5, 0.9)
    assert attributes["gen_ai.request.n"] == 1 and attributes["gen_ai.response.finish_reasons"] == '["length"]'  # vLLM's JSON text
    assert attributes["gen_ai.latency.e2e"] == pytest.approx((record["finished_at"] - record["arrival_at"]) / 1e9)
    assert attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(
        (record["first_token_at"] - record["arrival_at"]) / 1e9)
    assert attributes["gen_ai.latency.time_in_queue"] >= 0
    assert "auditor.tokens_after_disconnect" not in attributes  # nobody left
    assert llm["resource"]["service.name"] == "ref-engine" and llm["resource"]["process.pid"] == engine_pid
    assert llm["resource"]["host.name"] == socket.gethostname()

    # The ASGI server span: real peer (no proxy rewriting), server port, captured X-Request-Id.
    assert http_span["kind"] == SPAN_KIND_SERVER and http_span["parent"] == PARENT_ID
    http_attributes = http_span["attributes"]
    peer_port = http_attributes.get("net.peer.port", http_attributes.get("client.port"))
    assert peer_port == record["client_port"]
    assert http_attributes.get("net.host.port", http_attributes.get("server.port")) == engine_port
    assert http_attributes.get("net.peer.ip", http_attributes.get("client.address")) == "127.0.0.1"
    assert http_attributes["http.request.header.x_request_id"] == ["span-a"]
    assert not sink.matching(lambda s: s["name"].endswith((" send", " receive")))


def test_trace_aborted_over_grpc_reports_tokens_after_disconnect(otlp_grpc: tuple[str, SpanSink],
                                                                 tmp_path: Path) -> None:
    endpoint, sink = otlp_grpc
    with running_engine(otlp=endpoint, truth_log=tmp_path / "truth.jsonl", step_ms=3,
                        extra_args=["--trace-aborted", "--service-name", "staging-llm"]) as engine:
        stream_then_leave(engine.url, "/v1/chat/completions", "cut")
        record = wait_record(engine, "chatcmpl-cut")
        span = sink.wait_for(by_request_id("chatcmpl-cut"))
        last = httpx.post(engine.url + "/v1/completions", json={"prompt": "bye", "max_tokens": 1},
                          headers={"X-Request-Id": "last"}, timeout=10)
        assert last.status_code == 200
    # Stopping the engine flushed the span of the request that ended just before.
    assert sink.matching(by_request_id("cmpl-last"))
    assert record["finish_reason"] == "abort"
    assert span["attributes"]["gen_ai.response.finish_reasons"] == '["abort"]'
    assert span["attributes"]["auditor.tokens_after_disconnect"] == record["tokens_after_disconnect"] <= 10
    assert span["attributes"]["gen_ai.usage.completion_tokens"] == record["tokens_generated"]
    assert span["resource"]["service.name"] == "staging-llm"


def test_standard_otel_variables_choose_the_exporter_without_otlp_flag(otlp_http: tuple[str, SpanSink]) -> None:
    endpoint, sink = otlp_http
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint + "/v1/traces",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    with running_engine(step_ms=2, env=env) as engine:
        httpx.post(engine.url + "/v1/completions", json={"prompt": "env", "max_tokens": 1},
                   headers={"X-Request-Id": "from-env"}, timeout=10).raise_for_status()
        sink.wait_for(by_request_id("cmpl-from-env"))


@pytest.mark.parametrize("delay_ms", [None, 60_000])
def test_otel_bsp_schedule_delay_sets_how_long_spans_wait(delay_ms: int | None, otlp_http: tuple[str, SpanSink],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine exports every 200 ms unless OTEL_BSP_SCHEDULE_DELAY, the SDK's own setting, says
    otherwise (the load benches export as vLLM does with it)."""
    from replay.engine.tracing import Tracing

    endpoint, sink = otlp_http
    if delay_ms is None:
        monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    else:
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", str(delay_ms))
    tracing = Tracing("delay-test", endpoint)
    try:
        tracing.tracer.start_span("waits").end()
        time.sleep(1.5)  # several of the engine's own export periods
        assert len(sink.matching(lambda s: s["name"] == "waits")) == (1 if delay_ms is None else 0)
        tracing.provider.force_flush()
        sink.wait_for(lambda s: s["name"] == "waits", timeout=5)
    finally:
        tracing.provider.shutdown()


@pytest.mark.parametrize("propagate", [True, False])
def test_gateway_propagates_the_cancel_or_not(propagate: bool, otlp_http: tuple[str, SpanSink],
                                              tmp_path: Path) -> None:
    endpoint, sink = otlp_http
    request_id = f"via-gateway-{propagate}"
    with running_engine(otlp=endpoint, truth_log=tmp_path / "truth.jsonl", step_ms=3) as engine, \
            running_gateway(engine.url, propagate=propagate, otlp=endpoint) as gateway:
        plain = httpx.post(gateway.url + "/v1/completions", json={"prompt": "through", "max_tokens": 3},
                           headers={"X-Request-Id": f"plain-{propagate}"}, timeout=10)
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
        assert httpx.post(gateway.url + "/v1/completions", json={"prompt": "x", "model": "nope"},
                          timeout=10).status_code == 404
        stream_then_leave(gateway.url, "/v1/chat/completions", request_id, max_tokens=120)
        record = wait_record(engine, "chatcmpl-" + request_id)
        waiting = send_raw(gateway.url, "/v1/chat/completions", f"plain-{request_id}", 120, stream=False)
        time.sleep(0.15)
        waiting.close()
        plain_record = wait_record(engine, f"chatcmpl-plain-{request_id}")
        engine_http = sink.wait_for(lambda s: s["name"] == "POST /v1/chat/completions"
                                    and s["resource"]["service.name"] == "ref-engine")
    for cut in (record, plain_record):
        if propagate:
            assert cut["finish_reason"] == "abort" and cut["disconnect_at"] is not None
            assert cut["tokens_generated"] < 120
        else:
            assert cut["finish_reason"] == "length" and cut["tokens_generated"] == 120
            assert cut["disconnect_at"] is None  # the engine's own client, the gateway, never left
    client = sink.wait_for(lambda s: s["kind"] == SPAN_KIND_CLIENT and s["trace_id"] == engine_http["trace_id"])
    gateway_server = sink.wait_for(lambda s: s["span_id"] == client["parent"])
    assert gateway_server["resource"]["service.name"] == "ref-gateway"
    assert gateway_server["kind"] == SPAN_KIND_SERVER and engine_http["parent"] == client["span_id"]
    assert client["attributes"]["http.url"].endswith("/v1/chat/completions")
    if propagate:
        assert client["attributes"]["gateway.upstream_cancelled"] is True


def test_gateway_answers_502_when_the_upstream_is_down() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]  # bound, never listening: connections are refused
        with running_gateway(f"http://127.0.0.1:{dead_port}") as gateway:
            response = httpx.post(gateway.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert response.status_code == 502 and "upstream" in response.json()["error"]["message"]


def test_api_errors_are_openai_json_and_the_server_keeps_serving(tmp_path: Path) -> None:
    with running_engine(step_ms=2) as engine, httpx.Client(base_url=engine.url, timeout=10) as client:
        chat = "/v1/chat/completions"
        message = [{"role": "user", "content": "hi"}]
        cases = [
            (client.post(chat, content=b"{nope"), 400),
            (client.post(chat, content=b"[]"), 400),
            (client.post(chat, json={"model": "ref-llm-1b"}), 422),
            (client.post(chat, json={"messages": message, "max_tokens": 0}), 422),
            (client.post(chat, json={"messages": message, "max_tokens": 10**6}), 422),
            (client.post(chat, json={"messages": message, "model": "llama-405b"}), 404),
            (client.post("/v1/completions", json={"prompt": None}), 422),
            (client.post(chat, json={"messages": message}, headers={"X-Request-Id": "x" * 300}), 400),
            (client.get(chat), 405),
            (client.get("/v2/anything"), 404),
        ]
        for response, status in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == status and error["message"] and error["type"]
        ok = client.post(chat, json={"messages": message, "max_tokens": 2}, headers={"X-Request-Id": "abc"})
        assert ok.status_code == 200 and ok.json()["id"] == "chatcmpl-abc"
        assert ok.json()["usage"] == {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers={"X-Request-Id": "abc"}).json()["id"] == "cmpl-abc"
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["id"].startswith("cmpl-")
        assert client.get("/v1/models").json()["data"][0]["id"] == "ref-llm-1b"
        metrics = client.get("/metrics").text
        assert 'ref_engine_http_errors_total{status="422"} 4.0' in metrics
        assert 'ref_engine_requests_total{finish_reason="length"} 3.0' in metrics


def test_cli_refuses_bad_settings_with_what_to_do() -> None:
    runner = CliRunner()
    assert "engine" in runner.invoke(cli, ["--help"]).output
    result = runner.invoke(cli, ["engine", "--otlp", "ftp://collector:1", "--step-ms", "1"])
    assert result.exit_code == 1 and "Error: --otlp 'ftp://collector:1' is not a collector address" in result.output
    result = runner.invoke(cli, ["engine", "--gateway", "not a url"])
    assert result.exit_code == 1 and "Error: --gateway 'not a url' is not an engine address" in result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = runner.invoke(cli, ["engine", "--port", str(taken.getsockname()[1]), "--step-ms", "1"])
    assert result.exit_code == 1 and "Error: cannot listen on 127.0.0.1:" in result.output
    try:
        import torch  # noqa: F401
    except ImportError:
        result = runner.invoke(cli, ["engine", "--device", "cuda"])
        assert result.exit_code == 1 and "Error: --device cuda needs PyTorch" in result.output
    result = runner.invoke(cli, ["engine", "--step-ms", "1", "--truth-log", "/nonexistent/dir/truth.jsonl"])
    assert result.exit_code == 1 and "Error: cannot open the truth log /nonexistent/dir/truth.jsonl" in result.output
    result = runner.invoke(cli, ["engine", "--behavior", "sometimes"])
    assert result.exit_code == 2 and "Invalid value for '--behavior'" in result.output
