"""The span insert path stores what the ORM would: every column of every span of a real OTLP body,
whatever its attributes hold (nesting, bytes, non-finite doubles, text outside ASCII, cut values)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from sqlalchemy import text

from auditor.model import SpanRecord
from auditor.store import SpanRow, Store
from auditor.store.rows import dumps_json as _dumps
from collectors.attributes import MAX_ATTRIBUTES
from collectors.normalize import normalize_request
from collectors.spanwriter import SpanWriter
from tests.test_normalize import request, span

SERVER_ATTRS = {"http.method": "POST", "http.route": "/v1/chat/completions", "net.peer.ip": "10.0.0.7",
                "net.peer.port": 40001, "net.host.port": 8000, "http.status_code": 200,
                "http.request.header.x_request_id": ["req-1"], "http.user_agent": "agent ünïcode ✓"}
ENGINE_ATTRS = {"gen_ai.request.id": "chatcmpl-1", "gen_ai.usage.prompt_tokens": 812,
                "gen_ai.usage.completion_tokens": 128, "gen_ai.request.max_tokens": 256,
                "gen_ai.latency.time_in_queue": 0.012, "gen_ai.latency.time_to_first_token": 0.21,
                "gen_ai.response.model": "llama-3-8b", "gen_ai.response.finish_reasons": ["stop"],
                "gen_ai.latency.e2e": 2.4, "flag": True}
ODD_ATTRS = {"nested": {"a": [1, "two", {"deep": [[[["x"]]]]}]}, "nan": math.nan, "inf": -math.inf,
             "big": 2**62, "negative": -5, "empty": "", "long": "y" * 5000, 'quote"\\': "line\nbreak\t\x00"}


def body() -> ExportTraceServiceRequest:
    """Server, engine, client and other spans, one with more attributes than are kept."""
    engine = span("llm_request", Span.SPAN_KIND_INTERNAL, ENGINE_ATTRS, span_id=b"\x02" * 8, parent=b"\x01" * 8)
    engine.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="aborted"))
    odd = span("odd", Span.SPAN_KIND_INTERNAL, ODD_ATTRS, span_id=b"\x03" * 8)
    odd.attributes.add(key="raw", value=AnyValue(bytes_value=b"\x00\xff"))
    crowded = span("crowded", Span.SPAN_KIND_CLIENT,
                   {"http.method": "GET", "server.address": "upstream", "server.port": 9000,
                    **{f"k{i}": i for i in range(MAX_ATTRIBUTES + 5)}}, span_id=b"\x04" * 8)
    return request(span("POST /v1/chat/completions", Span.SPAN_KIND_SERVER, SERVER_ATTRS),
                   engine, odd, crowded, resource={"service.name": "vllm", "process.pid": 4242})


def columns(store: Store) -> list[dict[str, Any]]:
    """Every stored column but the key, attributes parsed, rows in span id order."""
    with store.engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(text("SELECT * FROM spans ORDER BY span_id"))]
    for row in rows:
        del row["id"]
        row["attributes"] = json.loads(row["attributes"])
    return rows


def orm_row(record: SpanRecord) -> SpanRow:
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return SpanRow(**(fields | {"role": record.role.value}))


def test_the_writer_stores_every_column_the_orm_stores(tmp_path: Path) -> None:
    spans = normalize_request(body(), service_host="gpu-1").spans
    assert [s.name for s in spans] == ["POST /v1/chat/completions", "llm_request", "odd", "crowded"]
    fast = Store(f"sqlite:///{tmp_path / 'fast.db'}")
    writer = SpanWriter(fast).start()
    try:
        assert writer.submit(spans) == len(spans)
    finally:
        writer.stop()
    orm = Store(f"sqlite:///{tmp_path / 'orm.db'}")
    with orm.session() as session, session.begin():
        session.add_all(orm_row(s) for s in spans)
    got, expected = columns(fast), columns(orm)
    fast.close()
    orm.close()
    assert len(got) == 4 and got == expected
    # Spot checks against the body itself, so that a field both paths lost would still show.
    server, engine, odd, crowded = got
    assert (server["peer_addr"], server["peer_port"], server["server_port"], server["request_id"],
            server["http_status"], server["process_pid"], server["host"]) == (
        "10.0.0.7", 40001, 8000, "req-1", 200, 4242, "gpu-1")
    assert server["attributes"] == {"http.method": "POST", "http.user_agent": "agent ünïcode ✓"}
    assert (engine["parent_span_id"], engine["status"], engine["prompt_tokens"], engine["finish_reason"],
            engine["time_to_first_token_s"]) == ("01" * 8, "error", 812, "stop", 0.21)
    assert engine["attributes"] == {"gen_ai.latency.e2e": 2.4, "flag": True}
    assert odd["attributes"]["nan"] == "nan" and odd["attributes"]["raw"] == "00ff"
    assert odd["attributes"]['quote"\\'] == "line\nbreak\t\x00" and odd["attributes"]["big"] == 2**62
    assert crowded["server_port"] == 9000 and crowded["attributes"]["auditor.dropped_attributes"] == 8


@pytest.mark.parametrize("data", [
    {}, {"a": 1, "b": [1.5, None, True, False], "c": {"d": "é ✓ \"q\" \\ \n"}},
    {"nan": math.nan, "inf": math.inf, "huge": 10**30, "tiny": 5e-324}, [], "text", 0, None,
])
def test_the_attribute_encoder_writes_what_json_writes(data: Any) -> None:
    assert _dumps(data) == json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def test_the_attribute_encoder_refuses_what_json_refuses() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        _dumps({"x": object()})
    with pytest.raises(TypeError):
        _dumps({(1, 2): "tuple keys"})


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 33, 100])
def test_grouped_statements_store_every_row_once_in_order(tmp_path: Path, count: int) -> None:
    base = normalize_request(body(), service_host="gpu-1").spans[0]
    spans = [dataclasses.replace(base, span_id=f"{n + 1:016x}", name=f"s{n}") for n in range(count)]
    # An exporter's retry inside one batch: the duplicates (same trace and span id) are skipped
    # one by one, whether they share a grouped statement with their original or not.
    spans += spans[: count // 3]
    store = Store(f"sqlite:///{tmp_path / 'spans.db'}")
    assert store.insert_spans(spans) == len(spans)
    with store.engine.connect() as conn:
        names = [r[0] for r in conn.execute(text("SELECT name FROM spans ORDER BY id"))]
    store.close()
    assert names == [f"s{n}" for n in range(count)]


def test_grouped_statements_keep_sixteen_rows_apiece() -> None:
    from auditor.store.rows import grouped_inserts

    sql = "INSERT INTO t (a, b) VALUES (?, ?)"
    rows = [(n, -n) for n in range(35)]
    (grouped, groups), (single, rest) = grouped_inserts(sql, rows)
    assert grouped.count("(?, ?)") == 16 and single == sql
    assert groups == [tuple(v for r in rows[:16] for v in r), tuple(v for r in rows[16:32] for v in r)]
    assert rest == rows[32:]
    assert grouped_inserts(sql, rows[:5]) == [(sql, rows[:5])]


def test_generated_row_makers_give_the_converted_fields() -> None:
    """``Shape.row`` (one generated expression a record) against the plain way: every field by
    the getter, enums and dicts converted in place."""
    from auditor.model import ConnEvent, ConnEventKind
    from auditor.store.rows import rows_as_tuples, shape_of

    spans = normalize_request(body()).spans
    event = ConnEvent(5, ConnEventKind.PEER_RST, 4, "10.0.0.7", 40_000, "10.0.0.1", 8000, 42, "gpu-1")
    for records in (spans, [event, event._replace(earliest_ns=3, source="procfs")]):
        shape = shape_of(type(records[0]))
        assert shape.row is not None
        plain = rows_as_tuples(records, dataclasses.replace(shape, row=None))
        assert rows_as_tuples(records, shape) == plain
        assert all(type(row) is tuple for row in plain)
    assert rows_as_tuples([event], shape_of(ConnEvent))[0][1] == "peer_rst"
