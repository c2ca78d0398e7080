"""Signal profiles: which of its signals the reference engine gives an observer, shaped like a real engine's.

Real servers differ in what they tell. vLLM emits an ``llm_request`` span and ``vllm:`` metrics;
SGLang, TGI and llama.cpp have other metric names and other (or no) engine spans; many servers
have HTTP server spans only. The profile flags reproduce each case on the one engine so the auditor's
verdicts can be checked against the truth log for every combination:

| flag | effect |
|---|---|
| ``--engine-span NAME`` | the engine span's name (``llm_request`` as vLLM; ``none``: HTTP server spans only); with another engine's ``--metrics-names``, ``llm_request`` names no model, as vLLM's |
| ``--metrics-names STYLE`` | running/waiting gauges, token counter and (where the engine has one) finished/aborted counter also under ``vllm``, ``sglang``, ``tgi`` or ``llamacpp`` names, each counted when that engine counts it |
| ``--send-spans`` | the HTTP server span gets ``http send`` sub-spans; the one that ends the response says so |
| ``--one-at-a-time`` | one request is served at a time; the rest wait before the HTTP handler (llama.cpp ``-np 1``) |
| ``--gauges-on-steps`` | the style's gauges change only when the engine steps (vLLM's: every request aborted at once leaves them at their last values), or, for SGLang's, when it logs a batch: each prefill, every 40 decode steps, and idle every 30 s |
| ``--span-end-lag-ms MS`` | the event loop is held this long after each answer's (``/v1/``) last byte is written, before the HTTP instrumentation ends its span: a loaded server, whose client reads the whole answer and closes before the span ends |
| ``--duplicate-server-span`` | a second ASGI instrumentation adds a second SERVER span, child of the first, per request (FastAPI's own telemetry over a hand-added middleware) |
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import context
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Receive, Scope, Send

PROPAGATOR = TraceContextTextMapPropagator()
METRIC_STYLES = ("ref", "vllm", "sglang", "tgi", "llamacpp")
# (running gauge, waiting gauge, generated-token counter) in each engine's own names.
METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens"),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size", "tgi_request_generated_tokens"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:tokens_predicted"),
}
# How each engine counts finished requests: vLLM by ``finished_reason`` (stop, length, abort), but
# a request aborted because its client left never reaches that count (the output processor's abort
# path records no finished-request stats: the "abort" series stays 0); SGLang all requests and
# aborted ones apart; TGI counts a request finished normally as ``tgi_request_success`` and one
# whose client is gone as a failure, ``err="dropped"``, when it stops its work (each series appears
# with its first count); llama.cpp counts no requests, and adds a request's generated tokens to its
# token counter only when it finishes it normally (a cancelled task is released uncounted).
FINISH_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm": ("vllm:request_success", "Finished requests by finish reason (engine's own name)."),
}
SUCCESS_COUNTERS: dict[str, tuple[str, str]] = {
    "tgi": ("tgi_request_success", "Requests that succeeded (engine's own name)."),
}
TOKENS_AT_FINISH = frozenset({"llamacpp"})
# llama.cpp adds too each such request's generation time, first token to last, in whole milliseconds.
GENERATION_SECONDS: dict[str, tuple[str, str]] = {
    "llamacpp": ("llamacpp:tokens_predicted_seconds", "Predict process time (engine's own name)."),
}
ABORT_COUNTERS: dict[str, tuple[str, str]] = {
    "sglang": ("sglang:num_aborted_requests", "Aborted requests (engine's own name)."),
}
DROPPED_COUNTERS: dict[str, tuple[str, str, str]] = {
    "tgi": ("tgi_request_failure", "err", "dropped"),
}
# TGI's generated tokens are a histogram of each finished request's count, not a counter.
TOKEN_HISTOGRAMS = frozenset({"tgi"})
# The labels of the gauges' series (None: the model served), as each engine sets them.
MODEL_LABELS: dict[str, dict[str, str | None]] = {
    "vllm": {"engine": "0", "model_name": None},
    "sglang": {"model_name": None},
}
# Engines that publish their scheduler's gauges only when they log a batch: SGLang at each prefill
# batch and every ``decode_log_interval`` (40) decode steps, and, idle, every 30 s (its scheduler's
# memory check). With them go the series its log always moves while work runs: the KV tokens in use
# and the generation throughput over the logged steps (0 when idle).
LOGGED_EVERY_STEPS: dict[str, int] = {"sglang": 40}
IDLE_LOG_S: dict[str, float] = {"sglang": 30.0}
LOG_GAUGES: dict[str, tuple[str, str]] = {"sglang": ("sglang:num_used_tokens", "sglang:gen_throughput")}
# Marks the send that ends the response (ASGI ``more_body`` false), so an observer can tell a
# complete response from one the handler abandoned.
ATTR_FINAL_SEND = "asgi.event.final"


class StyleMetrics:
    """Running/waiting gauges, a token counter and the finish counters named as ``style``'s engine names them."""

    def __init__(self, registry: CollectorRegistry, style: str, counts: Callable[[], tuple[int, int]], *,
                 on_steps: bool = False, model: str = "ref-llm-1b",
                 tokens_held: Callable[[], int] = lambda: 0) -> None:
        self.tokens: Counter | None = None
        self.tokens_per_request: Histogram | None = None
        self.finished: Counter | None = None
        self.aborted: Counter | None = None
        self.dropped: Counter | None = None
        self.succeeded: Counter | None = None
        self.generation_seconds: Counter | None = None
        self._registry = registry
        self._style = style
        # on_steps: what the last published step left, as vLLM publishes its scheduler's counts
        # with each step (vLLM issues 22545, 29928: every request aborted at once leaves them at
        # their last values), and SGLang with each logged batch (LOGGED_EVERY_STEPS).
        self._counts = counts
        self._tokens_held = tokens_held
        self._on_steps = on_steps
        self._log_every = LOGGED_EVERY_STEPS.get(style, 1)
        self._idle_log_s = IDLE_LOG_S.get(style)
        self._stepped = (0, 0)
        self._steps = 0
        self._logged: tuple[int, float] = (0, 0.0)  # (KV tokens in use, generation tokens/s) at the last log
        self._logged_at = time.monotonic()
        self._generated_since_log = 0
        if style not in METRIC_NAMES:
            return
        running, waiting, tokens = METRIC_NAMES[style]
        shown: Callable[[], tuple[int, int]] = self._published if on_steps else counts
        labels = MODEL_LABELS.get(style, {})  # vLLM and SGLang name the model served on their gauges
        values = {label: model if value is None else value for label, value in labels.items()}
        for index, (name, text) in enumerate(((running, "Requests running (engine's own name)."),
                                              (waiting, "Requests waiting (engine's own name)."))):
            gauge = Gauge(name, text, list(labels), registry=registry)
            series = gauge.labels(**values) if labels else gauge
            series.set_function(functools.partial(_count_of, shown, index))
        for index, name in enumerate(LOG_GAUGES.get(style, ())):
            gauge = Gauge(name, "What the scheduler's last log held (engine's own name).", list(labels),
                          registry=registry)
            series = gauge.labels(**values) if labels else gauge
            series.set_function(functools.partial(self._log_value, index))
        if style in TOKEN_HISTOGRAMS:
            self.tokens_per_request = Histogram(tokens, "Generated tokens per request (engine's own name).",
                                                buckets=(1, 4, 16, 64, 256, 1024, 4096), registry=registry)
        else:
            self.tokens = Counter(tokens, "Generated tokens (engine's own name).", registry=registry)
        if style in FINISH_COUNTERS:
            name, text = FINISH_COUNTERS[style]
            self.finished = Counter(name, text, ["finished_reason"], registry=registry)
            for reason in ("stop", "length", "abort"):  # every series from the start, as vLLM does
                self.finished.labels(reason)
        if style in GENERATION_SECONDS:
            self.generation_seconds = Counter(*GENERATION_SECONDS[style], registry=registry)
        if style in ABORT_COUNTERS:
            self.aborted = Counter(*ABORT_COUNTERS[style], registry=registry)
        if style in DROPPED_COUNTERS:
            name, label, self._dropped_value = DROPPED_COUNTERS[style]
            self.dropped = Counter(name, "Failed requests by error (engine's own name).", [label], registry=registry)

    def step(self, tokens: int, prefilled: bool = False) -> None:
        """An engine step that generated ``tokens`` (``prefilled``: it ran a prefill)."""
        self._steps += 1
        self._generated_since_log += tokens
        if not self._on_steps or prefilled or self._steps % self._log_every == 0:
            self._log(idle=False)
        if self.tokens is not None and self._style not in TOKENS_AT_FINISH:
            self.tokens.inc(tokens)

    def _log(self, *, idle: bool) -> None:
        now = time.monotonic()
        rate = 0.0 if idle else self._generated_since_log / max(now - self._logged_at, 1e-6)
        self._stepped = self._counts()
        self._logged, self._logged_at, self._generated_since_log = (self._tokens_held(), rate), now, 0

    def _published(self) -> tuple[int, int]:
        """The counts the last log left; an idle engine logs again every IDLE_LOG_S."""
        if self._idle_log_s is not None and time.monotonic() - self._logged_at >= self._idle_log_s:
            self._log(idle=True)
        return self._stepped

    def _log_value(self, index: int) -> float:
        if self._on_steps:
            self._published()
        else:  # read live: what a log now would hold
            self._logged = (self._tokens_held(), self._logged[1])
        return float(self._logged[index])

    def finish(self, reason: str, tokens: int = 0, generation_s: float = 0.0) -> None:
        """A request finished (``reason`` "abort": its client left and its work stopped), having
        generated ``tokens`` over ``generation_s`` from its first token to its last."""
        if self.finished is not None and reason != "abort":
            self.finished.labels(reason).inc()
        if self._style in SUCCESS_COUNTERS and reason != "abort":
            if self.succeeded is None:  # listed from its first count, as TGI's exporter does
                self.succeeded = Counter(*SUCCESS_COUNTERS[self._style], registry=self._registry)
            self.succeeded.inc()
        if self._style in TOKENS_AT_FINISH and self.tokens is not None and reason != "abort":
            self.tokens.inc(tokens)
        if self.generation_seconds is not None and reason != "abort":
            self.generation_seconds.inc(math.floor(generation_s * 1e3) / 1e3)
        if self.aborted is not None and reason == "abort":
            self.aborted.inc()
        if self.dropped is not None and reason == "abort":
            self.dropped.labels(self._dropped_value).inc()
        if self.tokens_per_request is not None and reason != "abort":  # TGI records a success's only
            self.tokens_per_request.observe(tokens)


def _count_of(counts: Callable[[], tuple[int, int]], index: int) -> int:
    return counts()[index]


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


class BusyAfterLastByte:
    """Outside the HTTP instrumentation: after the write of an answer's last byte, hold the event
    loop ``lag_s`` before the instrumentation ends the span, as a loaded server's loop is held by
    other work. The client reads the last byte and may close meanwhile; the server hears of it only
    once the loop is free. (An ``asyncio.sleep`` would not do: the instrumentation ends the span as
    the last byte's write returns, and a client's close is noticed at once.)"""

    def __init__(self, app: ASGIApp, lag_s: float) -> None:
        self.app = app
        self.lag_s = lag_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):  # answers only: /metrics as it was
            await self.app(scope, receive, send)
            return

        async def lagging(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                time.sleep(self.lag_s)  # the loop held, as by other work

        await self.app(scope, receive, lagging)


class ContextBreak:
    """Runs the app in an empty OpenTelemetry context, the current span's ``traceparent`` put in
    the request headers: what an app behind a context break sees (a sub-application, a second
    instrumentation that starts from the headers, as FastAPI's own instrumentation does over a
    hand-added middleware). The ASGI instrumentation inside then starts a second SERVER span, a
    child of the first, on the same connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier)
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"traceparent", b"tracestate")]
        headers += [(k.encode(), v.encode()) for k, v in carrier.items()]
        token = context.attach(Context())
        try:
            await self.app({**scope, "headers": headers}, receive, send)
        finally:
            context.detach(token)
