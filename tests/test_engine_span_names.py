"""Which spans are engine spans: vLLM's name, the GenAI conventions' inference spans where the model
runs, configured names; never a caller's CLIENT span, never an HTTP span."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from auditor.config import load_config
from auditor.errors import ConfigError
from auditor.model import ConnEventKind, SpanRole
from auditor.store import Store
from collectors.attributes import configure_engine_spans
from collectors.normalize import normalize_request
from tests.test_correlate import T0, Clock, close, engine_span, http_span, make, verdicts
from tests.test_normalize import CLIENT, INTERNAL, SERVER, request, span

GENAI = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama-3", "gen_ai.usage.output_tokens": 12,
         "gen_ai.response.finish_reasons": ["stop"]}


@pytest.fixture(autouse=True)
def default_names() -> Iterator[None]:
    configure_engine_spans([])
    yield
    configure_engine_spans([])


def role(name: str, kind: int, attrs: dict[str, Any]) -> SpanRole:
    [record] = normalize_request(request(span(name, kind, attrs))).spans
    return record.role


@pytest.mark.parametrize(("name", "kind", "attrs"), [
    ("llm_request", SERVER, {}),  # vLLM
    ("chat llama-3", SERVER, GENAI),  # GenAI conventions at the inference server
    ("chat llama-3", INTERNAL, GENAI),  # the model runs in the same process
    ("text_completion ref-llm-1b", SERVER, {}),  # the convention's name alone
    ("inference", SERVER, {**GENAI, "gen_ai.operation.name": "text_completion"}),  # the attribute alone
])
def test_engine_spans_by_convention(name: str, kind: int, attrs: dict[str, Any]) -> None:
    assert role(name, kind, attrs) is SpanRole.ENGINE


@pytest.mark.parametrize(("name", "kind", "attrs"), [
    ("chat llama-3", CLIENT, GENAI),  # the openai SDK's instrumentation: a caller's view
    ("llm_request", CLIENT, {}),
    ("embeddings llama-3", SERVER, {**GENAI, "gen_ai.operation.name": "embeddings"}),  # no generation
    ("execute_tool search", INTERNAL, {}),
    ("POST /v1/chat/completions", SERVER, {"http.request.method": "POST", "server.port": 8000}),
    ("chat llama-3", SERVER, {"http.request.method": "POST", "server.port": 8000}),  # an HTTP span stays one
    ("generate_request", SERVER, {}),  # unknown until configured
])
def test_not_engine_spans(name: str, kind: int, attrs: dict[str, Any]) -> None:
    assert role(name, kind, attrs) is not SpanRole.ENGINE


def test_configured_names_and_prefixes() -> None:
    configure_engine_spans(["generate_request", "Req *"])
    assert role("generate_request", SERVER, {}) is SpanRole.ENGINE
    assert role("Req 7f3a9c", INTERNAL, {}) is SpanRole.ENGINE
    assert role("Req 7f3a9c", CLIENT, {}) is SpanRole.OTHER
    assert role("llm_request", SERVER, {}) is SpanRole.ENGINE  # vLLM's stays


def test_engine_names_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "auditor.toml"
    path.write_text('[spans]\nengine_names = ["generate_request", "Req *"]\n')
    assert load_config(path, environ={}).spans.engine_names == ["generate_request", "Req *"]
    env = {"AUDITOR_SPANS_ENGINE_NAMES": "a, b*"}
    assert load_config(environ=env).spans.engine_names == ["a", "b*"]
    path.write_text("[spans]\nengine_names = [1]\n")
    with pytest.raises(ConfigError, match=r"spans\.engine_names"):
        load_config(path, environ={})


def test_an_engine_span_without_finish_reason_leaves_completion_to_what_the_server_sent(store: Store) -> None:
    clock = Clock()
    correlator = make(store, clock)
    # The server closed first (kernel order); the engine's span, of a configured name, says no finish reason.
    store.insert_spans([http_span("a", 0, 1.0005), replace(engine_span("a", 0.01, 0.9995, "stop"), finish_reason=None)])
    store.insert_conn_events([close(1.0, ConnEventKind.LOCAL_FIN), close(1.0001)])
    clock.now = T0 + 9 * 1_000_000_000
    correlator.tick()
    [row] = verdicts(store)
    assert row.verdict == "completed" and row.details["evidence"] == "kernel_order"
