"""Prometheus metrics of the daemon, named by Prometheus conventions (unit suffixes, ``_total``).

Counters count *settled* verdicts, so a provisional verdict that later changes is never counted
twice; the in-flight zombie gauge shows the live ones. No request id ever becomes a label: routes
and models are bounded by what a server exposes, and unknown values collapse to "unknown".
"""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from auditor.model import RequestVerdict

ZOMBIE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
MAX_LABEL_VALUES = 200  # per label; beyond this, values collapse to "other"


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.verdicts = Counter("auditor_disconnect_verdicts", "Requests whose client disconnected while in flight, "
                                "by settled verdict", ["verdict", "route", "model"], registry=r)
        self.zombie_duration = Histogram("auditor_zombie_duration_seconds", "Work after the disconnect, "
                                         "for zombies", ["route", "model"], buckets=ZOMBIE_BUCKETS, registry=r)
        self.wasted_gpu = Counter("auditor_wasted_gpu_seconds", "GPU-seconds spent on zombies (utilization-"
                                  "weighted, shared among requests in flight)", registry=r)
        self.wasted_cpu = Counter("auditor_wasted_cpu_seconds", "CPU-seconds spent on zombies", registry=r)
        self.wasted_tokens = Counter("auditor_wasted_tokens", "Tokens generated after the client left", registry=r)
        self.inflight_zombies = Gauge("auditor_inflight_zombies", "Zombies running now (disconnect seen, "
                                      "work still going after grace)", registry=r)
        self.disconnects = Counter("auditor_disconnects", "Peer FIN/RST seen on watched ports", ["kind"], registry=r)
        self.idle_closes = Counter("auditor_idle_closes", "Closes with no request in flight (normal)", registry=r)
        self.unjoined_disconnects = Counter("auditor_unjoined_disconnects", "Disconnects with no span to join",
                                            registry=r)
        self.unjoined_spans = Counter("auditor_unjoined_spans", "Server spans whose connection was never seen",
                                      registry=r)
        self.lost_kernel_events = Counter("auditor_kernel_events_lost", "Kernel events dropped by the ring "
                                          "buffer", registry=r)
        self.spans_received = Counter("auditor_spans_received", "Spans accepted over OTLP", registry=r)
        self.store_write_errors = Counter("auditor_store_write_errors", "Batches the store refused (locked, "
                                          "disk full); kept and retried, or answered with back-pressure",
                                          ["writer"], registry=r)
        self.ingest_queue = Gauge("auditor_ingest_queue_spans", "Spans waiting to be committed", registry=r)
        self.completed_rate = Gauge("auditor_completed_requests_per_second", "Requests finished normally per "
                                    "second over the last minute, from engine spans (HTTP server spans below 400 "
                                    "where no engine reports): falls while utilization stays: zombies",
                                    registry=r)
        self.utilization = Gauge("auditor_utilization_ratio", "Mean utilization over the last minute "
                                 "(GPU when present, else engine CPU in cores)", ["source"], registry=r)
        self.correlation_seconds = Histogram("auditor_correlation_tick_seconds", "Time of one correlation round",
                                             registry=r)
        self.correlation_errors = Counter("auditor_correlation_errors", "Correlation rounds that failed "
                                          "(retried next round)", registry=r)
        self.source_info = Gauge("auditor_disconnect_source_info", "Disconnect source in use", ["source"], registry=r)
        self._seen_labels: dict[str, set[str]] = collections.defaultdict(set)
        self._completions: collections.deque[float] = collections.deque()

    def _label(self, name: str, value: str | None) -> str:
        value = value or "unknown"
        seen = self._seen_labels[name]
        if value not in seen and len(seen) >= MAX_LABEL_VALUES:
            return "other"
        seen.add(value)
        return value

    def settled(self, verdict: RequestVerdict) -> None:
        route, model = self._label("route", verdict.route), self._label("model", verdict.model)
        self.verdicts.labels(verdict.verdict.value, route, model).inc()
        if verdict.verdict.is_zombie:
            if verdict.lag_seconds is not None:
                self.zombie_duration.labels(route, model).observe(verdict.lag_seconds)
            self.wasted_gpu.inc(verdict.wasted_gpu_seconds)
            self.wasted_cpu.inc(verdict.wasted_cpu_seconds)
            self.wasted_tokens.inc(verdict.tokens_after_disconnect or 0)

    def completed(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._completions.extend([now] * count)
        while self._completions and self._completions[0] < now - 60:
            self._completions.popleft()
        self.completed_rate.set(len(self._completions) / 60.0)
