"""Findings where people look: one journal line per zombie, and every final verdict as an OTLP log
record carrying its request's trace and span id, so a tracing backend shows the finding on the
trace of the request it is about.

Only settled verdicts are exported (the same ones the counters count): a provisional verdict may
still change, and a log record cannot be taken back. Exporting never blocks correlation: records
go through the SDK's batch processor, and an unreachable endpoint costs dropped records, logged by
the SDK, nothing else.
"""

from __future__ import annotations

import logging
from typing import Any

from auditor import __version__
from auditor.model import RequestVerdict, Verdict

log = logging.getLogger("auditor.findings")

SEVERITY = {Verdict.ZOMBIE: "WARN", Verdict.INFLIGHT_ZOMBIE: "WARN", Verdict.ABORTED: "INFO",
            Verdict.COMPLETED: "INFO"}


def root_span_id(verdict: RequestVerdict) -> str | None:
    """The request's outermost server span: the last part of its key ``<host>/<trace>/<span>``."""
    span_id = verdict.request_key.rsplit("/", 1)[-1]
    return span_id if len(span_id) == 16 else None


def finding_attributes(verdict: RequestVerdict) -> dict[str, Any]:
    """The record's attributes: what the finding says, none of them empty."""
    values: dict[str, Any] = {
        "auditor.verdict": verdict.verdict.value, "auditor.lag_seconds": verdict.lag_seconds,
        "auditor.disconnect_kind": verdict.disconnect_kind, "auditor.phase": verdict.phase.value,
        "auditor.wasted_gpu_seconds": verdict.wasted_gpu_seconds,
        "auditor.wasted_cpu_seconds": verdict.wasted_cpu_seconds,
        "auditor.tokens_after_disconnect": verdict.tokens_after_disconnect,
        "auditor.tokens_exact": verdict.tokens_exact, "auditor.request_key": verdict.request_key,
        "http.request.header.x-request-id": verdict.request_id, "http.route": verdict.route,
        "gen_ai.request.model": verdict.model, "client.address": verdict.client_addr,
        "client.port": verdict.client_port, "user_agent.original": verdict.user_agent,
        "server.port": verdict.server_port, "host.name": verdict.host,
    }
    return {key: value for key, value in values.items() if value is not None}


def journal_line(verdict: RequestVerdict) -> str:
    lag = f"{verdict.lag_seconds:.2f} s" if verdict.lag_seconds is not None else "unknown"
    return (f"zombie request {verdict.request_id or '-'} trace {verdict.trace_id or '-'}: work went on {lag} "
            f"after the client's {verdict.disconnect_kind.upper()}, {verdict.wasted_gpu_seconds:.2f} GPU-s, "
            f"{verdict.wasted_cpu_seconds:.2f} CPU-s, {verdict.tokens_after_disconnect or 0} tokens "
            f"({verdict.route or '-'}, {verdict.model or '-'})")


class FindingsExporter:
    """``settled(verdict)`` for the correlator: a journal line per zombie, an OTLP log record per verdict."""

    def __init__(self, otlp_logs_endpoint: str = "", *, service_name: str = "auditor", timeout_s: float = 10.0) -> None:
        self._provider: Any = None
        self._logger: Any = None
        if otlp_logs_endpoint:
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
            from opentelemetry.sdk._logs import LoggerProvider
            from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
            from opentelemetry.sdk.resources import Resource

            resource = Resource.create({"service.name": service_name, "service.version": __version__})
            self._provider = LoggerProvider(resource=resource)
            self._provider.add_log_record_processor(BatchLogRecordProcessor(
                OTLPLogExporter(endpoint=otlp_logs_endpoint, timeout=timeout_s)))
            self._logger = self._provider.get_logger("auditor.findings", __version__)

    def settled(self, verdict: RequestVerdict) -> None:
        if verdict.verdict.is_zombie:
            log.warning(journal_line(verdict))
        if self._logger is not None:
            try:
                self._emit(verdict)
            except Exception:  # never on the correlation path: a finding lost, not a round
                log.exception("could not export finding %s", verdict.request_key)

    def _emit(self, verdict: RequestVerdict) -> None:
        from opentelemetry import trace
        from opentelemetry._logs import SeverityNumber

        context = None
        span_id = root_span_id(verdict)
        if verdict.trace_id and span_id:
            span_context = trace.SpanContext(int(verdict.trace_id, 16), int(span_id, 16), is_remote=True,
                                             trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
            context = trace.set_span_in_context(trace.NonRecordingSpan(span_context))
        severity = SEVERITY[verdict.verdict]
        self._logger.emit(timestamp=verdict.work_end_ns or verdict.disconnect_at_ns, context=context,
                          severity_text=severity,
                          severity_number=SeverityNumber.WARN if severity == "WARN" else SeverityNumber.INFO,
                          body=f"{verdict.verdict.value}: request {verdict.request_id or verdict.request_key}",
                          attributes=finding_attributes(verdict), event_name="auditor.verdict")

    def shutdown(self) -> None:
        """Send what is batched (bounded by the exporter's timeout), then stop."""
        if self._provider is not None:
            self._provider.shutdown()
