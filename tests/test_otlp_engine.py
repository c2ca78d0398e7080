"""The reference engine as a real span source: its SDK exporters (OTLP/HTTP plain and gzip, OTLP/gRPC
gzip) send its ASGI server span and its vLLM-style ``llm_request`` span into the receivers, and
the stored rows join: same trace, request ids ``X`` and ``cmpl-X``, the client's real source port."""

from __future__ import annotations

import http.client
import json
import os
import time
from typing import Any

import pytest
from sqlalchemy import text

from auditor.store import Store
from collectors.otlp_grpc import OtlpGrpcReceiver
from collectors.otlp_http import OtlpHttpReceiver
from collectors.spanwriter import SpanWriter
from replay.engine.launch import running_engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _complete(port: int, request_id: str) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.connect()
    client_port = int(conn.sock.getsockname()[1])
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hello there", "max_tokens": 4}),
                 headers={"Content-Type": "application/json", "X-Request-Id": request_id,
                          "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 200, body
    return client_port, body


def _spans(store: Store, want: int) -> dict[str, tuple[Any, ...]]:
    deadline = time.monotonic() + 15
    while True:
        with store.engine.connect() as conn:
            found = {r[0]: tuple(r[1:]) for r in conn.execute(text(
                "SELECT role, trace_id, request_id, peer_port, server_port, prompt_tokens, completion_tokens,"
                " max_tokens, finish_reason, process_pid FROM spans WHERE role IN ('http_server', 'engine')"))}
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.parametrize(("protocol", "compression"), [("http", "none"), ("http", "gzip"), ("grpc", "gzip")])
def test_engine_spans_land_and_join(protocol: str, compression: str, writer: SpanWriter, store: Store) -> None:
    if protocol == "http":
        receiver: Any = OtlpHttpReceiver(writer, port=0).start()
    else:
        receiver = OtlpGrpcReceiver(writer, port=0).start()
    env = os.environ | {"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": compression}
    try:
        with running_engine(otlp=f"{protocol}://127.0.0.1:{receiver.port}", step_ms=1, env=env) as engine:
            client_port, body = _complete(engine.port, "req-1")
            spans = _spans(store, 2)
            engine_pid = engine.pid
    finally:
        receiver.stop()
    server = spans["http_server"]
    llm = spans["engine"]
    assert server[:4] == (TRACE_ID, "req-1", client_port, engine.port)
    assert llm[0] == TRACE_ID and llm[1] == "cmpl-req-1" == body["id"]
    assert llm[4:7] == (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"], 4)
    assert llm[7] == body["choices"][0]["finish_reason"]
    assert server[8] == llm[8] == engine_pid
    assert receiver.stats()["accepted_spans"] >= 2
