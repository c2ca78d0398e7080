"""Prometheus metrics of the daemon, named by Prometheus conventions (unit suffixes, ``_total``).

Everything is read when Prometheus scrapes, by a custom collector: running totals the sources and
the correlator keep anyway (committed spans, lost kernel events, idle closes ...) are read from them
as they are, so no delta is pushed and none can be lost or counted twice. What only the daemon
sees happen (a verdict settling, a correlation round) is tallied here, under a lock, and read the
same way. No ``_created`` series: a scrape shows what the daemon knows, nothing else.

Counters count *settled* verdicts, so a provisional verdict that later changes is never counted
twice; the in-flight zombie gauge shows the live ones. No request id ever becomes a label: routes
and models are bounded by what a server exposes, and unknown values collapse to "unknown".
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from auditor import __version__
from auditor.correlate.evidence import GAUGES_CANNOT_TELL, NO_GAUGES, RACED_ITS_ANSWER
from auditor.model import RequestVerdict, Verdict
from auditor.ownstats import OwnCostCollector
from auditor.promtext import (
    CounterFamily,
    Family,
    GaugeFamily,
    HistogramFamily,
    ProcessCollector,
    Registry,
    float_text,
)

ZOMBIE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
MAX_LABEL_VALUES = 200  # per label; beyond this, values collapse to "other"
COMPLETION_WINDOW_S = 60.0


@dataclass
class SourceReadings:
    """Running totals and levels of the daemon's parts, read at scrape time (see ``Daemon.readings``)."""

    source: str = "none"
    probe_loader: str | None = None  # how the eBPF probe was loaded (probes.bpf.LOADERS); None without it
    inflight_zombies: int = 0
    # Per scraped inference port: requests its engine held after their clients had left for longer
    # than the grace, by its gauges and the kernel's listing alone (CorrelatorStats.orphans).
    engine_orphans: dict[int, int] = field(default_factory=dict)
    # Per port, the orphaned work counted by its gauges and the kernel alone so far (request-, GPU-,
    # CPU-seconds: CorrelatorStats.orphaned).
    orphaned_work: dict[tuple[int, bool], tuple[float, float, float]] = field(default_factory=dict)
    # The engines' /metrics scrapes so far by (port, outcome: read, failed, no_engine), and per port
    # several containers serve, the servers there left out of its gauges at its latest reading.
    engine_scrapes: dict[tuple[int, str], int] = field(default_factory=dict)
    # The listings of each port's clients made with its scrapes, by (port, complete).
    engine_listings: dict[tuple[int, bool], int] = field(default_factory=dict)
    engine_servers_left_out: dict[int, int] = field(default_factory=dict)
    idle_closes: int = 0
    unjoined_disconnects: int = 0
    unjoined_spans: int = 0
    lost_kernel_events: int = 0
    clock_steps: int = 0  # the eBPF probe's: steps of the wall clock seen (probes.clock)
    spans_received: int = 0
    ingest_queue_spans: int = 0
    store_write_errors: dict[str, int] = field(default_factory=dict)  # by writer
    # Live notices by what became of them (accepted, rejected: not a notice, dropped: queue full);
    # empty without a live receiver.
    live_notices: dict[str, int] = field(default_factory=dict)
    # The eBPF probe's programs, per tracepoint: (kernel ns, runs), counted by the kernel only while
    # kernel.bpf_stats_enabled is 1 (probe_run_stats; None: unreadable). Empty with other sources.
    probe_runs: dict[str, tuple[int, int]] = field(default_factory=dict)
    probe_run_stats: bool | None = None
    # The correlator thread's CPU seconds by step of its rounds (auditor.correlate.roundcpu).
    correlation_cpu: dict[str, float] = field(default_factory=dict)


class _Buckets:
    """One histogram's cumulative-ready state: counts per upper bound, sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def exposition(self) -> tuple[list[tuple[str, float]], float]:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(float_text, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        return buckets, self.total


class DaemonMetrics:
    """The registry ``/metrics`` serves, and the tallies of what happens inside the daemon."""

    def __init__(self, readings: Callable[[], SourceReadings] | None = None, *,
                 clock: Callable[[], float] = time.monotonic, gpu_hour_price: float = 0.0,
                 cpu_hour_price: float = 0.0, currency: str = "USD") -> None:
        self.registry = Registry()
        self.readings = readings or SourceReadings
        self.clock = clock
        # This host's prices (the ``[report]`` settings), for dashboards that price the wasted
        # seconds of a fleet each host at its own; 0: unpriced, not exported.
        self.hour_prices = {"gpu": gpu_hour_price, "cpu": cpu_hour_price}
        self.currency = currency
        self._lock = threading.Lock()
        self._seen_labels: dict[str, set[str]] = collections.defaultdict(set)
        self._verdicts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._zombie_durations: dict[tuple[str, str], _Buckets] = {}
        self._wasted = {"gpu": 0.0, "cpu": 0.0, "tokens": 0.0}
        self._uncosted = 0  # zombies whose engine's time could not be read (details.cost_unmeasured)
        # unconfirmed verdicts by why nothing told (details.unconfirmed_because), each series from the start
        self._unconfirmed: collections.Counter[str] = collections.Counter(
            dict.fromkeys((RACED_ITS_ANSWER, GAUGES_CANNOT_TELL, NO_GAUGES), 0))
        self._disconnects: collections.Counter[str] = collections.Counter()
        self._completed_total = 0
        self._completions: collections.deque[tuple[float, int]] = collections.deque()
        self._utilization: dict[str, float] = {}
        self._ticks = _Buckets(TICK_BUCKETS)
        self._tick_errors = 0
        self.registry.register(_Collector(self))
        # The daemon's own cost: process_* (CPU, RSS, files), CPU by thread, its cgroup's limits.
        self.registry.register(ProcessCollector())
        self.registry.register(OwnCostCollector())

    # -- what the daemon tells ----------------------------------------------------------------
    def _label(self, name: str, value: str | None) -> str:
        value = value or "unknown"
        seen = self._seen_labels[name]
        if value not in seen and len(seen) >= MAX_LABEL_VALUES:
            return "other"
        seen.add(value)
        return value

    def settled(self, verdict: RequestVerdict) -> None:
        with self._lock:
            route, model = self._label("route", verdict.route), self._label("model", verdict.model)
            if (verdict.verdict.value, route, model) not in self._verdicts:
                # Every verdict's series of a route and model from its first verdict on, at 0: a
                # counter that appears at 1 is one increase() and rate() never see.
                for kind in Verdict:
                    self._verdicts.setdefault((kind.value, route, model), 0)
            self._verdicts[(verdict.verdict.value, route, model)] += 1
            if verdict.verdict.is_zombie:
                if verdict.lag_seconds is not None:
                    self._zombie_durations.setdefault((route, model), _Buckets(ZOMBIE_BUCKETS)).observe(
                        verdict.lag_seconds)
                self._wasted["gpu"] += verdict.wasted_gpu_seconds
                self._wasted["cpu"] += verdict.wasted_cpu_seconds
                self._wasted["tokens"] += verdict.tokens_after_disconnect or 0
                if verdict.details.get("cost_unmeasured"):
                    self._uncosted += 1
            elif verdict.verdict is Verdict.UNCONFIRMED:
                because = str(verdict.details.get("unconfirmed_because"))
                self._unconfirmed[because if because in self._unconfirmed else "other"] += 1

    def disconnect(self, kind: str, count: int = 1) -> None:
        """Peer FINs or RSTs the probe saw (``fin``/``rst``)."""
        with self._lock:
            self._disconnects[kind] += count

    def completed(self, count: int) -> None:
        """Requests that finished normally, found in this correlation round."""
        with self._lock:
            self._completed_total += count
            if count:
                self._completions.append((self.clock(), count))

    def set_utilization(self, by_source: dict[str, float]) -> None:
        with self._lock:
            self._utilization.update(by_source)

    def correlation_round(self, seconds: float, *, failed: bool) -> None:
        with self._lock:
            self._ticks.observe(seconds)
            self._tick_errors += failed

    def completed_per_second(self) -> float:
        """Completions over the last minute, per second: the gauge kept for dashboards built on it."""
        with self._lock:
            cutoff = self.clock() - COMPLETION_WINDOW_S
            while self._completions and self._completions[0][0] < cutoff:
                self._completions.popleft()
            return sum(count for _, count in self._completions) / COMPLETION_WINDOW_S

    # -- what a scrape reads ------------------------------------------------------------------
    def tallies(self) -> list[Family]:
        """The tallies as metric families, copied under the lock so a scrape never sees half a verdict."""
        rate = self.completed_per_second()
        with self._lock:
            return list(self._families(rate))

    def _families(self, rate: float) -> Iterator[Family]:
        verdicts = CounterFamily("auditor_disconnect_verdicts", "Requests whose client disconnected "
                                 "while in flight, by settled verdict", labels=["verdict", "route", "model"])
        for verdict_labels, count in sorted(self._verdicts.items()):
            verdicts.add_metric(list(verdict_labels), count)
        yield verdicts
        durations = HistogramFamily("auditor_zombie_duration_seconds", "Work after the disconnect, "
                                    "for zombies", labels=["route", "model"])
        for route_model, buckets in sorted(self._zombie_durations.items()):
            durations.add_histogram(list(route_model), *buckets.exposition())
        yield durations
        yield CounterFamily("auditor_wasted_gpu_seconds", "GPU-seconds spent on zombies (utilization-"
                            "weighted, shared among requests in flight)", value=self._wasted["gpu"])
        yield CounterFamily("auditor_wasted_cpu_seconds", "CPU-seconds spent on zombies",
                            value=self._wasted["cpu"])
        yield CounterFamily("auditor_wasted_tokens", "Tokens generated after the client left, as engine "
                            "spans told them (a zombie judged without one adds none)",
                            value=self._wasted["tokens"])
        prices = GaugeFamily("auditor_hour_price", "What an hour of one GPU or one CPU core costs on this "
                             "host ([report] gpu_hour_prices' pattern it matches, else gpu_hour_price; the same for CPU; "
                             "unpriced: absent), in currency: "
                             "wasted seconds x price / 3600 is their cost", labels=["kind", "currency"])
        for kind, price in self.hour_prices.items():
            if price > 0:
                prices.add_metric([kind, self.currency], price)
        yield prices
        yield CounterFamily("auditor_zombies_uncosted", "Zombies whose engine's GPU or CPU time could not "
                            "be read (its process, or its GPU processes on a host of several GPUs, not "
                            "known): their wasted seconds count 0", value=self._uncosted)
        unconfirmed = CounterFamily("auditor_unconfirmed_verdicts", "Unconfirmed verdicts by why nothing told "
                                    "whether the work stopped: raced_its_answer (the client closed as its answer "
                                    "ended), gauges_cannot_tell, no_gauges (no gauges of its engine read)",
                                    labels=["because"])
        for because, count in sorted(self._unconfirmed.items()):
            unconfirmed.add_metric([because], count)
        yield unconfirmed
        disconnects = CounterFamily("auditor_disconnects", "Peer FIN/RST seen on watched ports",
                                    labels=["kind"])
        for kind in sorted(set(self._disconnects) | {"fin", "rst"}):
            disconnects.add_metric([kind], self._disconnects[kind])
        yield disconnects
        yield CounterFamily("auditor_completed_requests", "Requests finished normally, from engine "
                            "spans (HTTP server spans below 400 where no engine reports): its rate falls "
                            "while utilization stays: zombies", value=self._completed_total)
        yield GaugeFamily("auditor_completed_requests_per_second", "Requests finished normally per "
                          "second over the last minute; prefer rate(auditor_completed_requests_total)",
                          value=rate)
        utilization = GaugeFamily("auditor_utilization_ratio", "Mean utilization over the last minute "
                                  "(GPU when present, else engine CPU in cores)", labels=["source"])
        for source, ratio in sorted(self._utilization.items()):
            utilization.add_metric([source], ratio)
        yield utilization
        ticks = HistogramFamily("auditor_correlation_tick_seconds", "Time of one correlation round")
        ticks.add_histogram([], *self._ticks.exposition())
        yield ticks
        yield CounterFamily("auditor_correlation_errors", "Correlation rounds that failed (retried "
                            "next round)", value=self._tick_errors)


class _Collector:
    """Yields every family at scrape time: the daemon's tallies, then its parts' readings."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Family]:
        yield _info(__version__)
        yield from self.metrics.tallies()
        yield from readings_families(self.metrics.readings())


def _info(version: str) -> GaugeFamily:
    family = GaugeFamily("auditor_build_info", "The auditor's version", labels=["version"])
    family.add_metric([version], 1)
    return family


def readings_families(r: SourceReadings) -> Iterator[Family]:
    """The families read from the sources and the correlator as they are now."""
    yield GaugeFamily("auditor_inflight_zombies", "Zombies running now (disconnect seen, work still going "
                      "after grace)", value=r.inflight_zombies)
    if r.engine_orphans:
        orphans = GaugeFamily("auditor_engine_orphans", "Requests the engine on this port held whose clients "
                              "had left more than the grace before: its gauges less the clients the kernel "
                              "listed connected, told before any span (a lower bound)", labels=["port"])
        for port, count in sorted(r.engine_orphans.items()):
            orphans.add_metric([str(port)], count)
        yield orphans
    if r.orphaned_work:
        for index, (name, what) in enumerate((
                ("auditor_orphaned_request_seconds", "Seconds of requests the engine on this port ran whose "
                 "clients had left (its orphans integrated over time), by its gauges and the kernel alone: the "
                 "zombie time of engines that send no spans (a lower bound)"),
                ("auditor_orphaned_wasted_gpu_seconds", "GPU-seconds those orphans took, shared by the engine's "
                 "running gauge (counted some seconds after, as the samples come)"),
                ("auditor_orphaned_wasted_cpu_seconds", "CPU-seconds those orphans took, as above"))):
            family = CounterFamily(name, what + ". spans: whether the port sent server spans lately (then "
                                   "its verdicts count the same work)", labels=["port", "spans"])
            for (port, spans), totals in sorted(r.orphaned_work.items()):
                family.add_metric([str(port), "true" if spans else "false"], totals[index])
            yield family
    if r.engine_scrapes:
        scrapes = CounterFamily("auditor_engine_scrapes", "Scrapes of the engines' own /metrics by port and "
                                "outcome: read (gauges for the port), failed (no answer, an error status; on a "
                                "port several containers serve, an engine among them so), no_engine (no known "
                                "metric). Without reads, aborts an engine sends no span for stay unconfirmed",
                                labels=["port", "outcome"])
        for (port, outcome), count in sorted(r.engine_scrapes.items()):
            scrapes.add_metric([str(port), outcome], count)
        yield scrapes
    if r.engine_listings:
        listings = CounterFamily("auditor_engine_listings", "Listings of the clients connected to an engine's "
                                 "port made with its scrapes, by whether none can be missing (complete): only a "
                                 "complete one counts the port's orphans (the alarm before spans, orphaned work). "
                                 "Seldom complete: a port that accepts connections at every scrape where its "
                                 "accepts cannot be told apart (a container's, with the /proc source)",
                                 labels=["port", "complete"])
        for (port, complete), count in sorted(r.engine_listings.items()):
            listings.add_metric([str(port), "true" if complete else "false"], count)
        yield listings
    if r.engine_servers_left_out:
        left_out = GaugeFamily("auditor_engine_servers_left_out", "Servers on a port several containers serve "
                               "left out of its gauges at its latest reading: no engine there, or one not "
                               "answering yet (loading its model)", labels=["port"])
        for port, count in sorted(r.engine_servers_left_out.items()):
            left_out.add_metric([str(port)], count)
        yield left_out
    yield CounterFamily("auditor_idle_closes", "Closes with no request in flight (normal)", value=r.idle_closes)
    yield CounterFamily("auditor_unjoined_disconnects", "Disconnects with no span to join",
                        value=r.unjoined_disconnects)
    yield CounterFamily("auditor_unjoined_spans", "Server spans whose connection was never seen",
                        value=r.unjoined_spans)
    yield CounterFamily("auditor_kernel_events_lost", "Kernel events dropped: by the eBPF probe's ring buffer, or (the /proc source) times the kernel dropped notices of freed sockets",
                        value=r.lost_kernel_events)
    yield CounterFamily("auditor_clock_steps", "Steps of the wall clock seen by the eBPF probe's clock conversion: "
                        "kernel events stamped just before one are off against the spans' times by the step",
                        value=r.clock_steps)
    yield CounterFamily("auditor_spans_received", "Spans accepted over OTLP", value=r.spans_received)
    yield GaugeFamily("auditor_ingest_queue_spans", "Spans waiting to be committed", value=r.ingest_queue_spans)
    errors = CounterFamily("auditor_store_write_errors", "Batches the store refused (locked, disk full); "
                           "kept and retried, or answered with back-pressure", labels=["writer"])
    for writer, count in sorted(r.store_write_errors.items()):
        errors.add_metric([writer], count)
    yield errors
    if r.live_notices:
        notices = CounterFamily("auditor_live_notices", "Live notices received (accepted; rejected: not a "
                                "notice; dropped: the queue was full)", labels=["result"])
        for result, count in r.live_notices.items():
            notices.add_metric([result], count)
        yield notices
    if r.probe_runs:
        yield from _probe_runs_families(r)
    if r.correlation_cpu:
        steps = CounterFamily("auditor_correlation_cpu_seconds", "The correlator thread's CPU by step of "
                              "its rounds (spans: taking them in; judge: computing verdicts; write: "
                              "storing them; ...)", labels=["step"])
        for step, seconds in r.correlation_cpu.items():
            steps.add_metric([step], seconds)
        yield steps
    source = GaugeFamily("auditor_disconnect_source_info", "Disconnect source in use (none: no "
                         "disconnects are seen)", labels=["source"])
    source.add_metric([r.source], 1)
    yield source
    if r.probe_loader:
        loader = GaugeFamily("auditor_probe_loader_info", "How the eBPF probe was loaded: prebuilt (the "
                             "program shipped compiled), child or inprocess (compiled by bcc at start, "
                             "where this kernel refused the prebuilt one)", labels=["loader"])
        loader.add_metric([r.probe_loader], 1)
        yield loader


def _probe_runs_families(r: SourceReadings) -> Iterator[Family]:
    """The eBPF probe's own cost in the kernel: time its programs ran, on the CPUs of whichever
    processes hit the tracepoints, so it shows in no process's CPU, the daemon's included."""
    seconds = CounterFamily("auditor_probe_kernel_seconds", "Time the probe's BPF programs ran in the "
                            "kernel, counted while kernel.bpf_stats_enabled is 1", labels=["tracepoint"])
    runs = CounterFamily("auditor_probe_runs", "Runs of the probe's BPF programs, counted while "
                         "kernel.bpf_stats_enabled is 1", labels=["tracepoint"])
    for tracepoint, (run_ns, count) in sorted(r.probe_runs.items()):
        seconds.add_metric([tracepoint], run_ns / 1e9)
        runs.add_metric([tracepoint], count)
    yield seconds
    yield runs
    if r.probe_run_stats is not None:
        yield GaugeFamily("auditor_probe_run_stats_enabled", "1 while the kernel counts BPF programs' "
                          "runs (sysctl kernel.bpf_stats_enabled)", value=int(r.probe_run_stats))
