"""Signal profiles: which of its signals the reference engine gives an observer, shaped like a real engine's.

Real servers differ in what they tell. vLLM emits an ``llm_request`` span and ``vllm:`` metrics;
SGLang, TGI and llama.cpp have other metric names and other (or no) engine spans; many servers
have HTTP server spans only. The profile flags reproduce each case on the one engine so the auditor's
verdicts can be checked against the truth log for every combination:

| flag | effect |
|---|---|
| ``--engine-span NAME`` | the engine span's name (``llm_request`` as vLLM; ``none``: HTTP server spans only) |
| ``--metrics-names STYLE`` | running/waiting gauges and token counter also under ``vllm``, ``sglang``, ``tgi`` or ``llamacpp`` names |
| ``--send-spans`` | the HTTP server span gets ``http send`` sub-spans; the one that ends the response says so |
| ``--one-at-a-time`` | one request is served at a time; the rest wait before the HTTP handler (llama.cpp ``-np 1``) |
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.types import ASGIApp, Receive, Scope, Send

METRIC_STYLES = ("ref", "vllm", "sglang", "tgi", "llamacpp")
# (running gauge, waiting gauge, generated-token counter) in each engine's own names.
METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens"),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size", "tgi_request_generated_tokens"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:tokens_predicted"),
}
# Marks the send that ends the response (ASGI ``more_body`` false), so an observer can tell a
# complete response from one the handler abandoned.
ATTR_FINAL_SEND = "asgi.event.final"


def add_style_metrics(registry: CollectorRegistry, style: str, counts: Callable[[], tuple[int, int]]) -> Counter | None:
    """Running/waiting gauges and a token counter named as ``style``'s engine names them."""
    if style not in METRIC_NAMES:
        return None
    running, waiting, tokens = METRIC_NAMES[style]
    Gauge(running, "Requests running (engine's own name).", registry=registry).set_function(lambda: counts()[0])
    Gauge(waiting, "Requests waiting (engine's own name).", registry=registry).set_function(lambda: counts()[1])
    return Counter(tokens.removesuffix("_total"), "Generated tokens (engine's own name).", registry=registry)


def mark_final_send(span: Any, scope: dict[str, Any], message: dict[str, Any]) -> None:
    """``client_response_hook`` of the ASGI middleware: flag the send that completes the response."""
    if span is not None and span.is_recording() and message.get("type") == "http.response.body":
        span.set_attribute(ATTR_FINAL_SEND, not message.get("more_body", False))


class OneAtATime:
    """Serve generation requests one at a time, outside the HTTP instrumentation: a waiting request
    has no server span yet, as on a single-slot server that reads the next request only when free."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...] = ("/v1/",)) -> None:
        self.app = app
        self.paths = paths
        self._lock: asyncio.Lock | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.paths) or scope["path"] == "/v1/models":
            await self.app(scope, receive, send)
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self.app(scope, receive, send)
