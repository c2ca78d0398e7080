"""The report's ``requests``: each client request once, whatever server spans it left."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

from auditor.model import SpanRecord, SpanRole
from auditor.report import query as report_query
from auditor.report.model import ReportQuery
from auditor.report.query import build_report
from auditor.store import Store

S = 1_000_000_000
T0 = 1_800_000_000 * S


def server(trace: str, span: str, parent: str | None = None, port: int = 8000, start: float = 0.0,
           peer: str = "127.0.0.1", service: str = "engine") -> SpanRecord:
    return SpanRecord(trace_id=trace * 32, span_id=span * 16, parent_span_id=parent * 16 if parent else None,
                      name="POST /v1/completions", kind="server", start_ns=T0 + int(start * S),
                      end_ns=T0 + int((start + 1) * S), service=service, host="h", role=SpanRole.HTTP_SERVER,
                      peer_addr=peer, peer_port=40000, server_port=port, http_status=200)


def client(trace: str, span: str, parent: str | None, port: int = 8000, start: float = 0.0,
           address: str = "127.0.0.1") -> SpanRecord:
    return replace(server(trace, span, parent, port, start), name="POST", kind="client", role=SpanRole.HTTP_CLIENT,
                   peer_addr=address, peer_port=None, service="gateway")


def counted(store: Store, query: ReportQuery) -> int:
    """The window's requests, counted by plain scans and through the index the start minute leads
    (a window over a small share of the store): the same either way."""
    found = []
    for share in (0.0, 2.0):
        with patch.object(report_query, "INDEXED_SHARE", share):
            found.append(build_report(store, query, with_requests=False).totals.requests)
    assert found[0] == found[1]
    return found[0]


def requests(store: Store, *spans: SpanRecord, service: str | None = None) -> int:
    store.insert_spans(list(spans))
    return counted(store, ReportQuery(since_ns=T0 - S, until_ns=T0 + 60 * S, service=service))


def test_a_plain_server_span_is_a_request(store: Store) -> None:
    assert requests(store, server("a", "1"), server("b", "2", start=2)) == 2


def test_a_server_span_nested_in_another_counts_once(store: Store) -> None:
    assert requests(store, server("a", "1"), server("a", "2", parent="1")) == 1


def test_a_gateway_hop_with_trace_context_counts_once(store: Store) -> None:
    assert requests(store, server("a", "1", port=9000, service="gateway"), client("a", "2", "1"),
                    server("a", "3", parent="2")) == 1


def test_a_gateway_hop_without_trace_context_counts_once(store: Store) -> None:
    # The engine's span starts a trace of its own; the gateway's client span to a local port tells the hop.
    assert requests(store, server("a", "1", port=9000, service="gateway"), client("a", "2", "1", start=0.1),
                    server("b", "3", start=0.2)) == 1


def test_a_callers_client_span_or_a_remote_hop_takes_nothing_off(store: Store) -> None:
    # An instrumented load client (its client span in no server span), and a gateway calling another
    # host: the local engine's requests are requests of their own.
    assert requests(store, client("a", "1", None, start=0.1), server("a", "2", parent="1", start=0.2),
                    server("c", "5", port=9000, service="gateway", start=5), client("c", "6", "5", start=5.1,
                                                                                      address="10.0.0.9"),
                    server("d", "7", start=5.2, peer="10.0.0.7")) == 3


def test_a_service_filter_counts_that_services_edge_requests(store: Store) -> None:
    spans = [server("a", "1", port=9000, service="gateway"), client("a", "2", "1"), server("a", "3", parent="2")]
    assert requests(store, *spans, service="gateway") == 1


def test_the_in_memory_twin_of_inner_server_span_agrees_with_the_sql(store: Store) -> None:
    from sqlalchemy import select

    from auditor.model import is_inner_server_span
    from auditor.report.requests import inner_server_span, spans

    shapes = [server("a", "1"), server("a", "2", parent="1"),  # nested
              server("b", "1", port=9000), client("b", "2", "1"), server("b", "3", parent="2"),  # traced hop
              client("c", "1", None), server("c", "2", parent="1"),  # behind a caller's client span only
              server("d", "2", parent="9"),  # its parent never arrived
              replace(server("e", "1"), role=SpanRole.OTHER), server("e", "2", parent="1")]  # parent no server
    store.insert_spans(shapes)
    with store.engine.connect() as conn:
        by_sql = {(row.trace_id, row.span_id) for row in conn.execute(
            select(spans.c.trace_id, spans.c.span_id).where(spans.c.role == SpanRole.HTTP_SERVER.value,
                                                            inner_server_span(spans)))}
    known = {(s.trace_id, s.span_id): s for s in shapes}
    in_memory = {(s.trace_id, s.span_id) for s in shapes if s.role is SpanRole.HTTP_SERVER
                 and is_inner_server_span(s, lambda trace, span: known.get((trace, span)))}
    assert in_memory == by_sql == {("a" * 32, "2" * 16), ("b" * 32, "3" * 16)}



def requests_of(store: Store, *spans: SpanRecord, hour: int) -> int:
    """The requests of ``spans``, shifted ``hour`` hours on, counted over that hour's first minute."""
    base = hour * 3600 * S
    store.insert_spans([replace(s, start_ns=s.start_ns + base, end_ns=s.end_ns + base) for s in spans])
    return counted(store, ReportQuery(since_ns=T0 + base, until_ns=T0 + base + 60 * S))


def test_relatives_are_found_in_the_minutes_the_key_names_and_not_beyond(store: Store) -> None:
    """The store keys spans by start minute first, so the report looks for a span's parent in the
    minutes around it (T0 starts a minute; each case in an hour of its own, its window that hour's
    first minute): a nested span whose parent started in the minute before is inside it, one whose
    parent started two minutes before counts on its own; the server span around a gateway's call
    is found when it started up to 15 minutes before the call, not 16. The in-memory twin agrees."""
    from auditor.model import is_inner_server_span

    cases = [([server("a", "1", start=-50), server("a", "2", parent="1", start=5)], 0),
             ([server("b", "1", start=-70), server("b", "2", parent="1", start=5)], 1),
             ([server("c", "1", port=9000, service="gateway", start=-14 * 60), client("c", "2", "1", start=0.1),
               server("c", "3", parent="2", start=0.2)], 0),
             ([server("d", "1", port=9000, service="gateway", start=-16 * 60 - 1), client("d", "2", "1", start=0.1),
               server("d", "3", parent="2", start=0.2)], 1)]
    for hour, (spans, counted) in enumerate(cases):
        assert requests_of(store, *spans, hour=hour + 1) == counted, spans[0].trace_id
        known = {(s.trace_id, s.span_id): s for s in spans}
        assert is_inner_server_span(spans[-1], lambda trace, span, known=known: known.get((trace, span))) \
            is (counted == 0)
