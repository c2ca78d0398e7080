"""The compiled span record builder (``collectors/_normalize.c``) against ``normalize.build_span``.

Both builders get the same generated span: a name and kind that may or may not make it an engine
span, attributes drawn from every key a column reads (and others), with values of every type a
reader yields and the odd ones a column must refuse ("²", "", ports past 65535, lists, None). The
record, the attributes it leaves and any exception must be the same (``repr``, so a bool is not
taken for an int). Skipped, with the reason, where the extension was not built, unless this host
could have built it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auditor.model import SpanRecord, SpanRole
from auditor.semconv import GENAI_OPERATION
from collectors import normalize
from collectors.attributes import configure_engine_spans
from tests.test_otlp_wire_compiled import missing_build_tools

CASES = settings(derandomize=True, deadline=None, database=None, max_examples=1500,
                 suppress_health_check=list(HealthCheck))

# The keys of each column, as normalize reads them (aliases in order), and a few no column reads.
GROUPS = (
    normalize.METHOD_KEYS, normalize.HOST_HEADER_KEYS, normalize.URL_KEYS, normalize.STATUS_KEYS,
    normalize.TARGET_KEYS, normalize.REQUEST_ID_HEADER_KEYS, normalize.CLIENT_PEER_ADDR_KEYS,
    normalize.CLIENT_PEER_PORT_KEYS, normalize.PID_KEYS, normalize.FINISH_KEYS, normalize.MODEL_KEYS,
    normalize.PROMPT_KEYS, normalize.COMPLETION_KEYS, normalize.PEER_ADDR_KEYS, normalize.PEER_PORT_KEYS,
    normalize.SERVER_PORT_KEYS, tuple(sorted(normalize._GENAI_KEYS)),
    (normalize.ROUTE_KEY, GENAI_OPERATION, "http.scheme", "user.note", "auditor.dropped_attributes"),
)
# Values at the edges of what a column takes, of every type a reader yields.
EDGES = st.sampled_from([
    0, 1, -1, 200, 8000, 65535, 65536, 2**31 - 1, 2**31, 2**63 - 1, 10**30, True, False, None,
    "", "POST", "8000", " 8000 ", "\u00b2", "\u0661\u0662", "-1", "12.0", "nan", "1e3", "stop", "chat",
    "text_completion", "req-7", "host:9000", "[::1]:8443", "http://engine:8001/v1/chat?x=1",
    "/v1/completions?stream=true", "/v1/completions", "?", "r" * 300, "x" * 40,
    8000.0, 0.5, -0.0, 1e300, float("nan"), float("inf"), [], ["a"], ["b", "c"], [7], [""], {"a": 1},
])
VALUES = EDGES | st.text(max_size=6) | st.integers() | st.floats() | st.lists(EDGES, max_size=2)


PORTS = [0, 8000, 65535, 65536, -1, "8000", " 80 ", "\u00b2", 8000.0, 8000.5, True, "", None]
TEXTS = ["127.0.0.1", "engine", "", ["10.0.0.1"], [], 7, "x" * 80, "r" * 300, "stop", ["length"]]
COUNTS = [812, 0, -1, 2**31 - 1, 2**31, "12", " 12", 12.0, 12.5, True, "\u00b2"]
HOSTPORTS = ["host:9000", "[::1]:8443", "h:99999", "h:", "http://e:8001/p?q=1", "e:abc", ":80", "a:1, b:2",
             "https://[::1]/x", ""]
# What each group's keys typically hold, edges included (index: the group's in GROUPS).
TYPICAL = [
    ["POST", "GET", "", None, 1, ["GET"]], HOSTPORTS, HOSTPORTS,
    [200, 502, "200", "\u00b2", -1, 2**31, True, 200.0], ["/v1/completions?stream=true", "/p", "?", "", ["/x?y"], 3],
    ["req-7", ["req-1"], [], "", 5, "q" * 300], TEXTS, PORTS, [4242, 0, -5, 2**31, "4242", True, 4242.0],
    TEXTS, TEXTS, COUNTS, COUNTS, TEXTS, PORTS, PORTS,
    [0.012, "0.5", float("nan"), float("inf"), 1, 10**400, "chatcmpl-1", 256, "stop", True],
    ["chat", "text_completion", "embeddings", None, 1, "/v1/chat", "http", 3],
]


@st.composite
def span_attributes(draw: st.DrawFn) -> dict[str, Any]:
    """Each column's keys present or not, often several aliases at once, often with one value
    (``http/dup``), sometimes with values that disagree or do not convert."""
    attrs: dict[str, Any] = {}
    for keys, typical in zip(GROUPS, TYPICAL, strict=True):
        values = st.sampled_from(typical) | st.sampled_from(typical) | VALUES
        shared = draw(values)
        for key in keys:
            if draw(st.integers(0, 2)) == 0:
                attrs[key] = shared if draw(st.booleans()) else draw(values)
    return attrs


NAMES = st.sampled_from([
    "llm_request", "POST /v1/chat/completions", "chat llama-3", "chat", "text_completion m", "chat a b",
    "my-engine", "tgi.generate", "tgi", "n" * 300, "",
]) | st.text(max_size=8)


@pytest.fixture(autouse=True)
def _engine_names() -> Iterator[None]:
    """Configured engine span names besides vLLM's, as the daemon sets them: the compiled builder
    asks the same test the Python one does."""
    configure_engine_spans(["my-engine", "tgi*"])
    yield
    configure_engine_spans([])


def test_the_compiled_builder_is_built_where_it_can_be() -> None:
    """Where a C compiler and Python's headers are, the install builds the compiled builder and
    records are built by it: a build that fails there must fail this test, not pass unseen."""
    missing = missing_build_tools()
    if missing:
        pytest.skip(f"no {missing} here: records are built in Python")
    assert "compiled" in normalize.BUILDERS, "the install did not build collectors/_normalize.c"
    assert normalize.builder() == "compiled"


needs_compiled = pytest.mark.skipif("compiled" not in normalize.BUILDERS,
                                    reason="the compiled span record builder is not built here")


def _answer(build: Any, args: tuple[Any, ...], attrs: dict[str, Any]) -> str:
    mine = copy.deepcopy(attrs)
    try:
        record = build(*args[:4], mine, *args[4:])
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}; left {mine!r}"
    assert type(record) is SpanRecord
    assert record.attributes is mine  # the dict given, less what became columns
    return repr(record)


def _both(args: tuple[Any, ...], attrs: dict[str, Any]) -> str:
    python = _answer(normalize.BUILDERS["python"], args, attrs)
    compiled = _answer(normalize.BUILDERS["compiled"], args, attrs)
    assert compiled == python, (args, attrs)
    return python


@needs_compiled
@CASES
@given(name=NAMES, kind=st.sampled_from([2, 2, 3]) | st.integers(-1, 7), status=st.none() | st.integers(-1, 3) | st.just(2**70),
       attrs=span_attributes(), dropped=st.sampled_from([0, 3]),
       pid=st.none() | st.sampled_from([4242, 0]), parent=st.none() | st.just("00f067aa0ba902b7"))
def test_the_compiled_builder_builds_as_the_python_one(name: str, kind: int, status: int | None,
                                                       attrs: dict[str, Any], dropped: int, pid: int | None,
                                                       parent: str | None) -> None:
    head = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b8", parent, 1_000, 2_000)
    _both((head, name, kind, status, dropped, "svc", "gpu-1", pid), attrs)


@needs_compiled
def test_the_compiled_builder_on_the_spans_engines_send() -> None:
    """The shapes of real instrumentations, with what each must give (so that agreeing on a wrong
    answer fails too)."""
    head = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b8", None, 1_000, 2_000)
    asgi = {"http.method": "POST", "http.route": "/v1/chat/completions", "net.peer.ip": "10.0.0.7",
            "net.peer.port": 40001, "net.host.port": 8000, "http.status_code": 200,
            "http.request.header.x_request_id": ["req-1"], "http.flavor": "1.1"}
    vllm = {"gen_ai.request.id": "chatcmpl-9", "gen_ai.usage.prompt_tokens": 812,
            "gen_ai.usage.completion_tokens": 128, "gen_ai.request.max_tokens": 256,
            "gen_ai.latency.time_in_queue": 0.012, "gen_ai.response.model": "llama-3-8b",
            "gen_ai.response.finish_reasons": '["stop"]', "gen_ai.request.temperature": 0.7}  # vLLM's JSON text
    client = {"http.method": "POST", "url.full": "http://engine:8001/v1/completions",
              "server.address": "engine", "http.request.header.x-request-id": "gw-1"}
    proxied = {"http.request.method": "GET", "client.address": "203.0.113.9", "client.port": 0,
               "http.host": "api:8443", "url.path": "/health?full=1"}
    expected = [
        (2, asgi, dict(role="http_server", peer_addr="10.0.0.7", peer_port=40001, server_port=8000,
                       route="/v1/chat/completions", http_status=200, request_id="req-1"),
         {"http.method": "POST", "http.flavor": "1.1"}),
        (1, vllm, dict(role="engine", request_id="chatcmpl-9", prompt_tokens=812, completion_tokens=128,
                       max_tokens=256, time_in_queue_s=0.012, model="llama-3-8b", finish_reason="stop",
                       process_pid=4242), {"gen_ai.request.temperature": 0.7}),
        (3, client, dict(role="http_client", peer_addr="engine", server_port=8001, request_id="gw-1"),
         {"http.method": "POST", "url.full": "http://engine:8001/v1/completions"}),
        (2, proxied, dict(role="http_server", peer_addr="203.0.113.9", peer_port=0, server_port=8443,
                          peer_rewritten=True, route="/health"), {"http.request.method": "GET",
                                                                   "http.host": "api:8443",
                                                                   "url.path": "/health?full=1"}),
    ]
    for kind, attrs, columns, left in expected:
        name = "llm_request" if kind == 1 else "POST"
        pid = 4242 if kind == 1 else None
        _both((head, name, kind, None, 0, "svc", "gpu-1", pid), attrs)
        record = normalize.BUILDERS["compiled"](head, name, kind, None, dict(attrs), 0, "svc", "gpu-1", pid)
        got = {key: getattr(record, key) for key in columns}
        got["role"] = record.role.value
        assert got == columns
        assert record.attributes == left


@needs_compiled
def test_the_compiled_builder_refuses_what_it_cannot_hold(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A record type whose fields moved, or that checks itself after __init__, is not filled slot
    by slot: set-up fails, with the reason logged, and the Python builder builds."""
    from collectors import _normalize  # type: ignore[attr-defined]

    reordered = (normalize._SPAN_FIELDS[1], normalize._SPAN_FIELDS[0], *normalize._SPAN_FIELDS[2:])
    monkeypatch.setattr(normalize, "_SPAN_FIELDS", reordered)
    assert normalize._compiled() is None
    assert "the compiled span builder could not be set up (fields: 'span_id' where this builder has trace_id)" \
        in caplog.text
    monkeypatch.undo()

    @dataclasses.dataclass(frozen=True)
    class Plain:  # fields, but no slots
        x: int = 0

    with pytest.raises(AttributeError, match="has no attribute 'trace_id'"):
        _normalize.configure(*_configuration()[:-1], Plain)
    computed = type("Computed", (), {"__slots__": normalize._SPAN_FIELDS[1:], "trace_id": property(lambda _: "")})
    with pytest.raises(TypeError, match="record: trace_id is not an object slot of its own"):
        _normalize.configure(*_configuration()[:-1], computed)
    _normalize.configure(*_configuration())  # as it was
    assert normalize._slots_fillable(SpanRecord, normalize._SPAN_FIELDS)


def _configuration() -> tuple[Any, ...]:
    """The arguments normalize._compiled gives configure()."""
    from collectors import _normalize

    captured: list[tuple[Any, ...]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_normalize, "configure", lambda *args: captured.append(args))
        normalize._compiled()
    return captured[0]


# -- the store's rows of spans -------------------------------------------------------------------
JSON_TEXTS = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from('"\\\b\f\n\r\t\x00\x1f\x7f/'),
                     max_size=8)
JSON_VALUES = st.one_of(JSON_TEXTS, st.integers(), st.sampled_from([2**70, -2**70, True, False, None]),
                        st.floats(), st.lists(st.integers(), max_size=2),
                        st.dictionaries(JSON_TEXTS, st.integers(), max_size=2))


def _rows_both(records: list[SpanRecord]) -> list[tuple[Any, ...]]:
    from auditor.store.rows import rows_as_tuples, shape_of, use_batch_rows

    try:
        use_batch_rows(SpanRecord, None)
        python = rows_as_tuples(records, shape_of(SpanRecord))
    finally:
        use_batch_rows(SpanRecord, normalize._compiled_rows)
    compiled = rows_as_tuples(records, shape_of(SpanRecord))
    assert repr(compiled) == repr(python)
    # As the store asks for them: NaN for None and ints for bools, the rest the same objects' values.
    nan = float("nan")
    stood_in = rows_as_tuples(records, shape_of(SpanRecord), nan)
    assert repr(stood_in) == repr([tuple(nan if v is None else int(v) if isinstance(v, bool) else v for v in row)
                                   for row in python])
    assert all(v is nan for row, plain in zip(stood_in, python, strict=True)
               for v, p in zip(row, plain, strict=True) if p is None)
    return python


needs_compiled_rows = pytest.mark.skipif(normalize._compiled_rows is None,
                                         reason="the compiled span row maker is not set up here")


@needs_compiled_rows
@CASES
@given(attrs=st.dictionaries(JSON_TEXTS | st.sampled_from(["http.flavor", "a\u00e9\u4e2d\U0001f600"]), JSON_VALUES,
                             max_size=6), role=st.sampled_from(list(SpanRole)))
def test_the_compiled_rows_are_the_store_s_rows(attrs: dict[str, Any], role: SpanRole) -> None:
    """Every value type JSON has (texts with every character it escapes, and wide ones; ints past
    64 bits; NaN, which the text writer leaves to json), in the row the store inserts."""
    from collectors import _normalize

    head = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b8", None, 1_000, 2_000)
    record = normalize.BUILDERS["python"](head, "POST", 2, None, {}, 0, "svc", "gpu-1", None)
    record = dataclasses.replace(record, role=role, attributes=attrs)
    (row,) = _rows_both([record])
    assert _normalize.attributes_json(attrs) == row[normalize._SPAN_FIELDS.index("attributes")]


@needs_compiled_rows
def test_the_compiled_rows_of_normalized_spans() -> None:
    """The rows of the spans engines send, as normalized; and no record of another type."""
    import sys
    from pathlib import Path

    from auditor.store.rows import rows_as_tuples, shape_of

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        import ingest
    finally:
        sys.path.pop(0)
    bodies = ingest.Bodies(64, seed=3)
    records = [span for _ in range(4) for span in normalize.normalize_body(bodies.next(), service_host="h").spans]
    rows = _rows_both(records)
    assert len(rows) == 256 and rows[0][normalize._SPAN_FIELDS.index("role")] in ("engine", "http_server")
    with pytest.raises(TypeError, match="not a SpanRecord"):
        rows_as_tuples([*records[:1], ("a", "tuple")], shape_of(SpanRecord))
