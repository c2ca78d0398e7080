"""Tracing set-up for the engine and gateway, and the vLLM-style ``llm_request`` span.

Export target, in order: ``--otlp http://HOST:PORT`` (OTLP/HTTP protobuf to ``/v1/traces``),
``--otlp grpc://HOST:PORT`` (OTLP/gRPC), else the standard ``OTEL_EXPORTER_OTLP_*`` variables,
else no export (spans are still created, so code paths are the same). A ``BatchSpanProcessor``
with a short delay keeps spans timely; :meth:`Tracing.shutdown` flushes them.

The ``llm_request`` span copies what vLLM does when a request finishes: span kind SERVER, start
time = arrival, end = finish, parent taken from the request's own ``traceparent`` header (not
from the HTTP server span, which vLLM's engine never sees), and vLLM's attribute names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from auditor.errors import AuditorError
from auditor.live import LiveReporter, LiveSpanProcessor
from replay.engine.core import RequestHandle

log = logging.getLogger(__name__)

# Spans leave every 200 ms, so verdicts settle soon after the work ends; OTEL_BSP_SCHEDULE_DELAY,
# the SDK's own setting, overrides it (unset, the SDK waits 5 s: what vLLM's exporter does).
SCHEDULE_DELAY_MS = 200
LLM_REQUEST_SPAN = "llm_request"
PROPAGATOR = TraceContextTextMapPropagator()

# vLLM's names (vllm/tracing.py SpanAttributes), plus the GenAI semantic-convention finish reasons.
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
ATTR_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
ATTR_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
ATTR_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
ATTR_E2E = "gen_ai.latency.e2e"
ATTR_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_TEMPERATURE = "gen_ai.request.temperature"
ATTR_TOP_P = "gen_ai.request.top_p"
ATTR_N = "gen_ai.request.n"
ATTR_FINISH_REASONS = "gen_ai.response.finish_reasons"
# GenAI semantic conventions: the operation, and the span name "{operation} {model}".
GENAI_STYLE = "genai"
ATTR_OPERATION = "gen_ai.operation.name"
ATTR_REQUEST_MODEL = "gen_ai.request.model"
# Optional extension: lets the auditor call tokens-after-disconnect exact instead of estimated.
ATTR_TOKENS_AFTER_DISCONNECT = "auditor.tokens_after_disconnect"


class TracingConfigError(AuditorError):
    """The OTLP target cannot be used."""


def exporter_for(otlp: str | None) -> SpanExporter | None:
    """The span exporter for ``--otlp`` (or the OTEL_* environment when ``otlp`` is None)."""
    if otlp is None:
        if not any(os.environ.get(name) for name in (
                "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
            return None
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as Grpc,
            )
            return Grpc()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as Http,
            )
            return Http()
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; "
                                 "use http/protobuf or grpc")
    parts = urlsplit(otlp)
    if parts.scheme not in ("http", "https", "grpc") or not parts.hostname:
        raise TracingConfigError(f"--otlp {otlp!r} is not a collector address; "
                                 "use http://HOST:PORT (OTLP/HTTP) or grpc://HOST:PORT (OTLP/gRPC)")
    try:
        port = parts.port
    except ValueError as exc:
        raise TracingConfigError(f"--otlp {otlp!r} has a bad port: {exc}") from exc
    if parts.scheme == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        return Grpc(endpoint=f"{parts.hostname}:{port or 4317}", insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/traces"):
        path += "/v1/traces"
    return Http(endpoint=f"{parts.scheme}://{parts.hostname}:{port or 4318}{path}")


class Tracing:
    """A tracer provider with this process's resource, and the exporter chosen by ``otlp``."""

    def __init__(self, service_name: str, otlp: str | None, live: str | None = None, *,
                 process_pid: bool = True) -> None:
        attributes: dict[str, str | int] = {"service.name": service_name, "host.name": socket.gethostname()}
        if process_pid:
            attributes["process.pid"] = os.getpid()
        resource = Resource.create(attributes)
        self.provider = TracerProvider(resource=resource)
        self.exporting = False
        exporter = exporter_for(otlp)
        if exporter is not None:
            delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else SCHEDULE_DELAY_MS  # None: the SDK reads it
            self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay))
            self.exporting = True
        self.tracer = self.provider.get_tracer("replay.engine")
        self.live: LiveReporter | None = None
        if live:
            # Span starts and ends as datagrams, so the auditor sees requests while they run.
            address = live_address(live)
            processor = LiveSpanProcessor(address, service=service_name)
            self.provider.add_span_processor(processor)
            self.live = processor.reporter

    def work_started(self, request: RequestHandle) -> None:
        if self.live is not None and request.work_key is not None:
            self.live.work_started(*request.work_key)

    def work_ended(self, request: RequestHandle) -> None:
        if self.live is not None and request.work_key is not None:
            self.live.work_ended(*request.work_key, finish_reason=request.finish_reason or "abort")

    def shutdown(self) -> None:
        try:
            self.provider.force_flush(5000)
            self.provider.shutdown()
        except Exception:
            log.exception("flushing spans at shutdown failed")


def live_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of the auditor's live-notice socket."""
    host, _, port = text.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        raise TracingConfigError(f"--live {text!r} is not HOST:PORT, e.g. 127.0.0.1:4319")
    return host.strip("[]"), int(port)


def work_key_of(request_id: str) -> tuple[str, str] | None:
    """The (trace id, work id) live notices use for a request: its server span's trace, and a
    span-shaped id derived from the request id (engine work has no span of its own yet)."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    work_id = hashlib.blake2b(request_id.encode(), digest_size=8).hexdigest()
    return f"{context.trace_id:032x}", work_id


def emit_llm_request_span(tracer: trace.Tracer, request: RequestHandle, name: str = LLM_REQUEST_SPAN, *,
                          names_model: bool = True) -> None:
    """The ``llm_request`` span for a finished request, shaped like vLLM's (``name``: another engine's;
    ``genai``: the GenAI conventions' "{operation} {model}" with ``gen_ai.operation.name``).
    ``names_model`` False: an ``llm_request`` span without ``gen_ai.response.model``, as vLLM's
    (its own tests leave that check commented out); an observer takes the model from its gauges."""
    assert request.finished_at is not None
    seconds = 1e-9
    attributes: dict[str, object] = {}
    reasons = [request.finish_reason or "abort"]
    # vLLM sends its finish reasons as JSON text (json.dumps of the list); the GenAI conventions an array.
    finish_reasons: object = reasons if name == GENAI_STYLE else json.dumps(reasons)
    if name == GENAI_STYLE:
        operation = "chat" if request.request_id.startswith("chatcmpl-") else "text_completion"
        name = f"{operation} {request.model}"
        attributes.update({ATTR_OPERATION: operation, ATTR_REQUEST_MODEL: request.model})
    attributes |= {
        ATTR_REQUEST_ID: request.request_id,
        ATTR_PROMPT_TOKENS: request.prompt_tokens,
        ATTR_COMPLETION_TOKENS: request.tokens_generated,
        ATTR_E2E: (request.finished_at - request.arrival_at) * seconds,
        ATTR_MAX_TOKENS: request.max_tokens,
        ATTR_N: request.n,
        ATTR_FINISH_REASONS: finish_reasons,
    }
    if names_model or name != LLM_REQUEST_SPAN:
        attributes[ATTR_RESPONSE_MODEL] = request.model
    if request.scheduled_at is not None and request.queued_at is not None:
        attributes[ATTR_TIME_IN_QUEUE] = (request.scheduled_at - request.queued_at) * seconds
    if request.first_token_at is not None:
        attributes[ATTR_TIME_TO_FIRST_TOKEN] = (request.first_token_at - request.arrival_at) * seconds
    if request.temperature is not None:
        attributes[ATTR_TEMPERATURE] = request.temperature
    if request.top_p is not None:
        attributes[ATTR_TOP_P] = request.top_p
    if request.tokens_after_disconnect is not None:
        attributes[ATTR_TOKENS_AFTER_DISCONNECT] = request.tokens_after_disconnect
    parent = PROPAGATOR.extract(request.trace_headers) if request.trace_headers else None
    span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                             attributes=attributes,  # type: ignore[arg-type]
                             start_time=request.arrival_at)
    span.end(end_time=request.finished_at)


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers of a request, as vLLM forwards them to its engine."""
    return {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
