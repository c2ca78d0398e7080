"""The daemon: probe, OTLP receivers, samplers, live notices, online correlation and /metrics.

Threads, each isolated so one failing part degrades the daemon instead of stopping it:
- probe: polls kernel disconnect events and writes them in batches;
- OTLP HTTP and gRPC receivers: their own servers, committing spans before acknowledging;
- sampling loop: NVML and procfs;
- correlator: every ``correlate.interval_seconds``, joins what arrived and writes verdicts;
  it also pings the systemd watchdog, so a wedged correlator gets the service restarted;
- metrics: auditor.promtext's HTTP server.

Data moves one way: sources -> store -> correlator -> verdicts and metrics. Spans reach the
correlator from the span writer once committed (``auditor.correlate.feed``), not read back. ``stop()`` (SIGTERM)
stops intake first, flushes every queue to the store, runs a last correlation round and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from auditor.config import Config, loopback_only, parse_address
from auditor.correlate import Correlator
from auditor.correlate.evidence import ORPHANS_SETTLE_WOKEN_NS
from auditor.correlate.feed import SpanFeed
from auditor.errors import AuditorError, StoreError
from auditor.kernelrecord import departures
from auditor.metrics import DaemonMetrics, SourceReadings
from auditor.model import ConnEvent, CoverageKind, EngineLoad, EventRun, RequestVerdict, UtilSample
from auditor.promtext import MetricsServer
from auditor.service import HeapTrim, listening, notify_systemd, quietly
from auditor.store import Store, default_db_url, unwritable_sqlite
from auditor.upkeep import Upkeep

log = logging.getLogger(__name__)

PROBE_POLL_S = 0.25
# After a client left, the eBPF probe's reader polls this often for a while: the kernel wakes it
# for a departure at most once in DEPARTURE_WAKEUP_NS (disconnect.bpf.c), and a second one left
# in between is heard by this poll, not the next quarter second's.
PROBE_POLL_AFTER_DEPARTURE_S = 0.1
PROBE_QUICK_POLLS_FOR_S = 1.0
# Kernel events are committed by each correlation round just before it reads them; the probe loop
# commits them itself only when no round has for this long (a round stuck on a locked store).
EVENT_FLUSH_BACKSTOP_S = 1.0
# Samples are committed by the correlation round, just before it reads them, rather than one
# transaction per sampler tick (10 Hz): a commit costs far more than the sample. The sampler
# commits on its own only when rounds stop coming (a wedged or failing correlator).
SAMPLE_BACKSTOP_S = 5.0
# The least time between a correlation round and an extra one run for an in-flight alarm: bounds
# the extra rounds to a few a second however many clients leave running work.
ALARM_ROUND_GAP_S = 0.2


@dataclass
class DaemonStatus:
    started_at: float = field(default_factory=time.time)
    source: str = "none"
    probe_loader: str | None = None  # with the eBPF source: prebuilt, child or inprocess
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    live_port: int | None = None
    ticks: int = 0
    errors: int = 0


def stalled_after(interval_s: float) -> float:
    """Seconds without a correlation round after which the daemon is stuck: the unit's watchdog
    period, or five rounds where rounds are set further apart."""
    return max(30.0, 5 * interval_s)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.host = config.host_id or socket.gethostname()
        gpu_hour, cpu_hour = config.report.hour_prices(self.host)  # this host's, where priced apart
        self.metrics = DaemonMetrics(self.readings, gpu_hour_price=gpu_hour, cpu_hour_price=cpu_hour,
                                     currency=config.report.currency)
        self.status = DaemonStatus()
        self._stop = threading.Event()
        self._ready = threading.Event()  # READY=1 sent: only then may WATCHDOG=1 follow
        self._threads: list[threading.Thread] = []
        self._parts: dict[str, Any] = {}
        self._ports = set(config.probe.ports)
        self._told_contained: set[int] = set()  # ports whose engine in a container was warned of
        # Which network namespace each process is in, one scan for the three readers of containers'
        # networks (the /proc source, the engine-process lookup, the engines' addresses).
        self._netns_scan: Any = None
        self._lost_reported = 0
        self._failing = False
        self._round_ended = time.monotonic()  # the correlator's last round, for /healthz
        self._samples: list[UtilSample] = []  # taken, not yet committed
        self._samples_lock = threading.Lock()
        self._samples_commit_lock = threading.Lock()  # one commit at a time keeps row ids in time order
        self._samples_committed_at = time.monotonic()
        self._events_flushed_at = time.monotonic()

    # -- start ------------------------------------------------------------------------------
    def start(self) -> None:
        url = self.config.db or default_db_url()
        unwritable = unwritable_sqlite(url)
        if unwritable:  # else it starts, answers /healthz, and fails every round on a read-only database
            raise StoreError("; ".join(unwritable))
        self.store = Store(url, migrate_in_child=True)
        self._span_feed = SpanFeed()  # committed spans, to the correlator without a read back
        self._start_probe()
        self._start_receivers()
        self._start_samplers()
        self._start_findings()
        if self.config.live.listen:
            from collectors.live import LiveReceiver

            host, port = parse_address(self.config.live.listen, "live.listen")
            with listening("live.listen", self.config.live.listen):
                live = LiveReceiver(host, port)
            live.start()
            self._parts["live"] = live
            self.status.live_port = live.port
        self.correlator = Correlator(self.store, host=self.host, grace_seconds=self.config.correlate.grace_seconds,
                                     late_span_seconds=self.config.correlate.late_span_seconds,
                                     watched_ports=lambda: set(self._ports), on_settled=self._settled,
                                     feed=self._span_feed)
        probe: Any = self._parts.get("probe")
        if getattr(probe, "notices", None) is not None:  # the /proc source's resets are resets while they come
            self.correlator.polled_resets_exact = lambda: probe.notices is not None
        if getattr(probe, "wakes_on_departure", False):  # a scrape's closes are in sooner
            self.correlator.orphans_settle_ns = ORPHANS_SETTLE_WOKEN_NS
        procfs = self._parts.get("procfs")
        extra_pids = set(self.config.sampler.procfs_pids)
        self._upkeep = Upkeep(self.store, self.host, self.metrics, None if procfs is None else
                              lambda pids: self._sample_pids(extra_pids | pids), find_engines=self._find_engines)
        self._heap_trim = HeapTrim()
        self._start_engine_metrics()
        self._round_ended = time.monotonic()
        self._spawn("correlator", self._correlate_loop)
        self._start_retention()
        if self.config.metrics.listen:
            host, port = parse_address(self.config.metrics.listen, "metrics.listen")
            with listening("metrics.listen", self.config.metrics.listen):
                server = MetricsServer(self.metrics.registry, host, port, health=self.health)
            self._parts["metrics"] = server
            self.status.metrics_port = server.port
        notify_systemd(f"READY=1\nSTATUS=watching ports {sorted(self._ports)} via {self.status.source}")
        self._ready.set()
        log.info("auditor running: source=%s otlp-http=%s otlp-grpc=%s metrics=%s live=%s", self.status.source,
                 *("off" if port is None else port for port in (self.status.http_port, self.status.grpc_port,
                                                                self.status.metrics_port, self.status.live_port)))

    @property
    def source_name(self) -> str:
        """Which disconnect source runs: bpf, procfs, or none."""
        return self.status.source

    def _process_scan(self) -> Any:
        """The one ``probes.netns.ProcessScan`` the daemon's readers of other namespaces share."""
        if self._netns_scan is None:
            from probes.netns import SCAN_REUSE_S, ProcessScan

            self._netns_scan = ProcessScan(reuse_s=SCAN_REUSE_S)
        return self._netns_scan

    def _spawn(self, name: str, target: Any) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _start_probe(self) -> None:
        from probes import open_source
        from probes.writer import ConnEventWriter

        try:
            source = open_source(ports=sorted(self._ports), prefer=self.config.probe.source, host=self.host,
                                 poll_hz=self.config.probe.poll_hz,
                                 ringbuf_pages=self.config.probe.ring_buffer_pages, netns_scan=self._process_scan())
            source.start()
        except AuditorError as exc:
            # Without one the daemon would judge nothing, yet look healthy to systemd.
            other = (", or set probe.source = \"auto\" (--source auto) to run the /proc fallback"
                     if self.config.probe.source == "bpf" else "")
            raise AuditorError(f"no disconnect source (probe.source = {self.config.probe.source!r}): {exc}; "
                               f"`auditor doctor` says what works on this host{other}") from exc
        self._parts["probe"] = source
        self._parts["event_writer"] = ConnEventWriter(self.store)
        self.status.source = source.name
        self.status.probe_loader = getattr(source, "loader", None)
        self._spawn("probe", self._probe_loop)

    def _start_receivers(self) -> None:
        from collectors.attributes import configure_engine_spans
        from collectors.otlp_http import OtlpHttpReceiver
        from collectors.spanwriter import SpanWriter

        configure_engine_spans(self.config.spans.engine_names)
        otlp = self.config.otlp
        writer = SpanWriter(self.store, on_commit=self._span_feed.committed).start()
        self._parts["span_writer"] = writer
        token = otlp.token or None
        if otlp.http:
            host, port = parse_address(otlp.http, "otlp.http")
            http = OtlpHttpReceiver(writer, host=host, port=port, token=token, max_body_bytes=otlp.max_body_bytes,
                                    service_host=self.host)
            with listening("otlp.http", otlp.http):
                http.start()
            self._parts["otlp_http"] = http
            self.status.http_port = http.port
        if otlp.grpc:
            from collectors.otlp_grpc import OtlpGrpcReceiver

            host, port = parse_address(otlp.grpc, "otlp.grpc")
            grpc = OtlpGrpcReceiver(writer, host=host, port=port, token=token, service_host=self.host,
                                    max_message_bytes=otlp.max_body_bytes, http_hint=otlp.http)
            with listening("otlp.grpc", otlp.grpc):
                grpc.start()
            self._parts["otlp_grpc"] = grpc
            self.status.grpc_port = grpc.port

    def _start_samplers(self) -> None:
        from collectors.listeners import ListenerPids
        from collectors.procfs import ProcfsSampler
        from collectors.sampling import SamplingLoop

        samplers: list[Any] = []
        if self.config.sampler.nvml:
            from collectors.nvml import NvmlSampler

            samplers.append(NvmlSampler(host=self.host,
                                        per_process_always=self.config.sampler.nvml_per_process_always))
        from probes.netns import NetNamespaces
        from probes.sockdiag import listening_inodes

        # Engines whose spans name no process; their sockets asked of the kernel, not /proc/net/tcp,
        # and of containers' network namespaces.
        self._parts["listeners"] = ListenerPids(listening=listening_inodes,
                                                other_namespaces=NetNamespaces(scan=self._process_scan()))
        procfs = ProcfsSampler(host=self.host)
        procfs.set_pids(self.config.sampler.procfs_pids)
        samplers.append(procfs)
        self._parts["procfs"] = procfs
        loop = SamplingLoop(samplers, sink=self._write_samples, interval_s=self.config.sampler.interval_ms / 1000)
        loop.start()
        self._parts["sampling"] = loop

    def _sample_pids(self, pids: set[int]) -> None:
        """Follow these processes' CPU; the sampling loop, idle while it followed none, wakes."""
        self._parts["procfs"].set_pids(pids)
        self._parts["sampling"].wake()

    def _departed(self, ports: set[int]) -> None:
        """Clients left these watched ports. A sampler that found its engine quiet samples once a
        second: a sample now ends the quiet one near the disconnect, where a zombie's cost begins
        (the eBPF probe's within milliseconds, the /proc source's within its poll; the costing
        puts the busy part of that reading at its end).
        The scraper scrapes a quiet one of these engines at once, and at its rate from then on."""
        if "sampling" in self._parts:
            self._parts["sampling"].wake()
        if "engine_metrics" in self._parts:
            self._parts["engine_metrics"].activity(ports)

    def _start_engine_metrics(self) -> None:
        if not self.config.engine_metrics.scrape:
            return
        from collectors.enginemetrics import EngineMetricsScraper

        settings = self.config.engine_metrics
        self._engine_loads: list[EngineLoad] = []
        self._loads_lock = threading.Lock()

        def keep(loads: list[EngineLoad]) -> None:
            with self._loads_lock:
                self._engine_loads.extend(loads)

        def own_connections(endpoints: frozenset[tuple[str, int, int, str]]) -> None:
            probe = self._parts.get("probe")  # started before the scraper
            if probe is not None:
                probe.set_own_endpoints(endpoints)

        # The clients connected to the engines' ports: the eBPF probe keeps a table of them; the
        # /proc source makes a poll for each (the poller skips its next); without either, a
        # sock_diag walk a listing.
        lister: Any = self._parts.get("probe")
        if not hasattr(lister, "clients"):
            from probes.sockdiag import ConnectedClients

            lister = self._parts["client_lister"] = ConnectedClients()
        from probes.netns import EngineAddresses, NetNamespaces
        from probes.sockdiag import listening_inodes

        addresses = EngineAddresses(listening_inodes, NetNamespaces(scan=self._process_scan()))
        scraper = EngineMetricsScraper(lambda: set(self._ports), keep, interval_s=settings.interval_seconds,
                                       path=settings.path, on_connections=own_connections,
                                       listed_clients=lister.clients, accepted=lister.accepted,
                                       listing_complete=getattr(lister, "listing_complete", None),
                                       list_while_busy=getattr(lister, "listing_is_cheap", False),
                                       addresses_of=addresses.of, listening=addresses.listening,
                                       sends_spans=self.correlator.sends_spans)
        self._parts["engine_metrics"] = scraper.start()

    def _drain_engine_loads(self) -> list[EngineLoad]:
        if "engine_metrics" not in self._parts:
            return []
        with self._loads_lock:
            loads, self._engine_loads = self._engine_loads, []
        return loads

    def _write_samples(self, samples: Iterable[UtilSample]) -> None:
        """The sampling loop's sink: keep the tick's samples for the next commit."""
        with self._samples_lock:
            self._samples.extend(samples)
            overdue = time.monotonic() - self._samples_committed_at >= SAMPLE_BACKSTOP_S
        if overdue:
            self._commit_samples()

    def _flush_events(self) -> None:
        writer = self._parts.get("event_writer")
        if writer is None:
            return
        self._events_flushed_at = time.monotonic()
        with contextlib.suppress(StoreError):  # kept queued; the writer logs once
            writer.flush()

    def _commit_samples(self) -> None:
        """Commit the samples taken so far in one transaction; the correlator's cost reads them by
        row id, so commits never overlap (a later batch must not get its ids first)."""
        with self._samples_commit_lock:
            with self._samples_lock:
                samples, self._samples = self._samples, []
                self._samples_committed_at = time.monotonic()
            try:
                self.store.write(samples)
            except AuditorError as exc:
                log.warning("%d samples dropped: %s", len(samples), exc)

    def _start_findings(self) -> None:
        from auditor.findings import FindingsExporter

        self.findings = FindingsExporter(self.config.export.otlp_logs_endpoint)

    def _settled(self, verdict: RequestVerdict) -> None:
        """A verdict became final: count it, and tell the journal and the tracing backend."""
        self.metrics.settled(verdict)
        self.findings.settled(verdict)

    def _start_retention(self) -> None:
        retention = self.config.retention
        if retention.raw_hours or retention.verdict_days:
            self._spawn("retention", self._retention_loop)

    # -- loops ------------------------------------------------------------------------------
    def _probe_loop(self) -> None:
        source, writer = self._parts["probe"], self._parts["event_writer"]
        # The eBPF probe's records go to the store undecoded where their layout allows: the
        # correlator decodes them once, when it reads them (auditor.store.eventblocks).
        runs = bool(getattr(source, "reads_runs", False))
        woken_by_departures = bool(getattr(source, "wakes_on_departure", False))
        quick_until = 0.0
        while not self._stop.is_set():
            try:
                # A lone event waits for the timeout unless it is a client's leaving (the kernel
                # wakes the reader for a full batch, or a departure); its timestamp is the kernel's,
                # so waiting moves no verdict, only its discovery. Each idle wake-up costs CPU.
                timeout_s = PROBE_POLL_AFTER_DEPARTURE_S if time.monotonic() < quick_until else PROBE_POLL_S
                if runs:
                    taken = source.poll_runs(timeout_s=timeout_s)
                    left = self._took(taken, [departures(run.records, run.stride) for run in taken], writer)
                else:
                    taken = source.poll(timeout_s=timeout_s)
                    left = self._took(taken, [_departure(event) for event in taken], writer)
                if left and woken_by_departures:
                    quick_until = time.monotonic() + PROBE_QUICK_POLLS_FOR_S
                if time.monotonic() - self._events_flushed_at >= EVENT_FLUSH_BACKSTOP_S:
                    self._flush_events()
            except Exception:
                log.exception("probe loop error; continuing")
                time.sleep(0.1)

    def _took(self, taken: list[ConnEvent] | list[EventRun], found: list[tuple[int, int, set[int]]],
              writer: Any) -> bool:
        """Queue what the probe gave for the store, count its disconnects, and wake the scrapes of
        the ports clients left. ``found``: (peer FINs, peer resets, their server ports) of each
        item. Whether any client left."""
        if not taken:
            return False
        writer.add(taken)
        departed: set[int] = set()
        for fins, resets, ports in found:
            for kind, count in (("fin", fins), ("rst", resets)):
                if count:
                    self.metrics.disconnect(kind, count)
            departed |= ports
        if departed:
            self._departed(departed)
        return bool(departed)

    def _correlate_loop(self) -> None:
        """Rounds on a fixed schedule (correlate.interval_seconds), and one in between when a request
        whose work still runs leaves its grace before the next: its in-flight alarm then waits for
        no scheduled round. Rounds are at least ALARM_ROUND_GAP_S apart."""
        interval = self.config.correlate.interval_seconds
        watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.correlate_once()
            if watchdog_usec and self._ready.is_set():
                notify_systemd("WATCHDOG=1")
            now = time.monotonic()
            if now >= next_tick:  # the scheduled round (an extra one that ran past it counts as it)
                next_tick += interval
                if next_tick < now:  # skip missed ticks rather than bursting to catch up
                    next_tick = now
            delay = next_tick - now
            due = self.correlator.alarm_due_ns
            if due is not None and not self._failing:  # a failed round's is not trusted
                delay = min(delay, max((due - time.time_ns()) / 1e9, ALARM_ROUND_GAP_S))
            self._stop.wait(delay)

    def _retention_loop(self) -> None:
        """Prune old rows now and then, a batch at a time with a pause between batches, so the
        writers (one at a time on SQLite) never wait for more than one batch."""
        from auditor.store.retention import RetentionPolicy, prune

        retention = self.config.retention
        policy = RetentionPolicy(retention.raw_hours, retention.verdict_days, retention.batch_rows)
        while not self._stop.is_set():
            try:
                deleted = prune(self.store, policy, host=self.host, pause=lambda: self._stop.wait(0.05))
                if any(deleted.values()):
                    log.info("retention: deleted %s", ", ".join(f"{n} {t}" for t, n in deleted.items() if n))
            except StoreError as exc:
                log.warning("retention pass failed, retrying in %.0f s: %s", retention.interval_seconds, exc)
            except Exception:
                log.exception("retention pass failed; retrying")
            self._stop.wait(retention.interval_seconds)

    def correlate_once(self) -> None:
        started, failed = time.monotonic(), False
        cpu = self.correlator.cpu
        try:
            cpu.start()
            self._flush_events()  # before the round reads them: a disconnect waits for no batch
            self._commit_samples()  # before the round: a zombie's cost needs its last samples
            cpu.mark("flush")
            live = self._parts["live"].drain() if "live" in self._parts else []
            self.correlator.add_engine_load(self._drain_engine_loads())
            self.correlator.tick(live)
            if self.correlator.clients_wanted and "engine_metrics" in self._parts:
                self._parts["engine_metrics"].want_clients(self.correlator.clients_wanted)
            cpu.start()
            self._report_lost_events()
            self._upkeep.round(self.correlator.arrived, self.correlator.spans.get)
            self._heap_trim.maybe()  # once a minute: the heap's free pages back to the kernel
            cpu.mark("upkeep")
            self.status.ticks += 1
            if self._failing:
                log.info("correlation works again")
                self._failing = False
        except Exception as exc:
            self.status.errors += 1
            failed = True
            if not self._failing:  # once per outage, not once per round
                log.warning("correlation round failed (retrying every round): %s",
                            str(getattr(exc, "orig", None) or exc).splitlines()[0])
                self._failing = True
        finally:
            self._round_ended = time.monotonic()
            self.metrics.correlation_round(self._round_ended - started, failed=failed)

    def health(self) -> tuple[bool, str]:
        """What ``/healthz`` answers: unhealthy only when the correlator's rounds stopped, the same
        thing the unit's watchdog (WatchdogSec=30s) restarts the daemon for. A round that fails (the
        database away) is not: a restart would not bring the database back."""
        since = time.monotonic() - self._round_ended
        if since > stalled_after(self.config.correlate.interval_seconds):
            return False, f"stalled: no correlation round for {since:.0f} s"
        if self._failing:
            return True, f"ok, but correlation rounds fail (last {since:.1f} s ago): see the daemon's log"
        return True, f"ok: last correlation round {since:.1f} s ago, source {self.status.source}"

    def _report_lost_events(self) -> None:
        source = self._parts.get("probe")
        if source is None:
            return
        lost = source.lost_events()
        if lost > self._lost_reported:
            self.store.add_coverage(CoverageKind.LOST_KERNEL_EVENTS, lost - self._lost_reported, host=self.host)
            self._lost_reported = lost

    def engine_busy(self, port: int, fresh_s: float = 5.0) -> float | None:
        """Requests the engine on ``port`` ran and held at the daemon's newest scrape of it, taken
        in the last ``fresh_s``; None without one (not scraped, no known gauges, or gone quiet)."""
        load = self.correlator.loads.latest(port)
        if load is None or time.time_ns() - load.ts_ns > fresh_s * 1e9:
            return None
        return float(load.running + load.waiting)

    def readings(self) -> SourceReadings:
        """What /metrics shows of the parts, read from them at scrape time: their own running totals,
        so nothing is pushed, and a part that is not there (yet) reads as zero."""
        readings = SourceReadings(source=self.status.source, probe_loader=self.status.probe_loader)
        correlator = getattr(self, "correlator", None)
        if correlator is not None:
            stats = correlator.stats
            readings.inflight_zombies, readings.idle_closes = stats.inflight_zombies, stats.idle_closes
            readings.engine_orphans = dict(stats.orphans)
            readings.orphaned_work = stats.orphaned  # replaced whole each round, never changed
            readings.unjoined_disconnects, readings.unjoined_spans = stats.unjoined_disconnects, stats.unjoined_spans
            readings.correlation_cpu = correlator.cpu.seconds()
        source = self._parts.get("probe")
        if source is not None:
            try:
                readings.lost_kernel_events = max(source.lost_events(), self._lost_reported)
            except Exception:  # a scrape shows the last figure the correlator stored rather than failing
                readings.lost_kernel_events = self._lost_reported
            if hasattr(source, "clock_steps"):  # the eBPF probe: its stamps are converted to the wall clock
                readings.clock_steps = source.clock_steps()
            if hasattr(source, "program_runs"):  # the eBPF probe: its own cost in the kernel
                from probes.bpfsys import stats_enabled

                readings.probe_runs = {tracepoint: (runs.run_ns, runs.runs)
                                       for tracepoint, runs in source.program_runs().items()}
                readings.probe_run_stats = stats_enabled()
        scraper = self._parts.get("engine_metrics")
        if scraper is not None:
            readings.engine_scrapes = scraper.outcomes()
            readings.engine_listings = scraper.listings()
            readings.engine_servers_left_out = {port: len(out) for port, out in dict(scraper.left_out).items()}
        writer = self._parts.get("span_writer")
        if writer is not None:
            writer_stats = writer.stats()
            readings.ingest_queue_spans = writer_stats.get("queue_spans", 0)
            readings.spans_received = writer_stats.get("committed_spans", 0)
            readings.store_write_errors["spans"] = writer_stats.get("failed_commits", 0)
        event_writer = self._parts.get("event_writer")
        if event_writer is not None:
            readings.store_write_errors["conn_events"] = event_writer.write_errors
        live = self._parts.get("live")
        if live is not None:
            readings.live_notices = {"accepted": live.received - live.dropped, "rejected": live.rejected,
                                     "dropped": live.dropped}  # received counts the dropped too
        return readings

    def _find_engines(self) -> set[int]:
        """The processes listening on the watched ports, for engines whose spans name no process:
        the correlator charges their cost, the CPU sampler follows them. Where /proc does not tell
        (another user's engine, no CAP_SYS_PTRACE), the eBPF probe's closing process does. A port
        several containers serve has one in each, named by its address; the correlator is told
        their addresses whether their processes are found or not (its joins weigh them)."""
        listeners, probe = self._parts.get("listeners"), self._parts.get("probe")
        if listeners is None:
            return set()
        if probe is not None and probe.name == "bpf":
            found, unknown = listeners.resolve(self._ports, probe.server_pids, probe.server_pids_at)
        else:
            found, unknown = listeners.resolve(self._ports)
        self.correlator.cost.set_listeners(found, unknown, listeners.shared)
        self.correlator.set_servers(listeners.servers)
        self._warn_unreachable_receivers(listeners.in_other_namespaces)
        return set(found.values()).union(*(by_address.values() for by_address in listeners.shared.values()))

    def _warn_unreachable_receivers(self, contained: set[int]) -> None:
        """Once a port: its engine listens in a container's network, whose loopback is its own, and
        the OTLP receivers listen on this one only. Its spans cannot come; every disconnect there
        would be unjoined."""
        otlp = self.config.otlp
        new = contained - self._told_contained
        if new and loopback_only((otlp.http, otlp.grpc)):
            log.warning("port(s) %s: served in a container's network of its own, which cannot reach the OTLP "
                        "receivers on this host's loopback (%s): its spans will not come. Set otlp.http (or "
                        "otlp.grpc) to this host's address on that network (172.17.0.1 on Docker's default "
                        "bridge) or 0.0.0.0 with otlp.token, and the engine's OTLP endpoint to it",
                        ", ".join(map(str, sorted(new))), ", ".join(a for a in (otlp.http, otlp.grpc) if a))
        self._told_contained |= new

    def set_ports(self, ports: set[int]) -> None:
        self._ports = set(ports)
        source = self._parts.get("probe")
        if source is not None:
            source.set_ports(sorted(ports))
        scraper = self._parts.get("engine_metrics")
        if scraper is not None:
            scraper.ports_changed()

    # -- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop intake, flush every queue, run a last correlation round. Bounded to a few seconds."""
        notify_systemd("STOPPING=1")
        for name in ("otlp_http", "otlp_grpc"):
            part = self._parts.get(name)
            if part is not None:
                quietly(part.stop)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for name in ("sampling", "engine_metrics"):
            if name in self._parts:
                quietly(self._parts[name].stop)
        if "client_lister" in self._parts:
            quietly(self._parts["client_lister"].close)
        if "probe" in self._parts:
            quietly(self._parts["probe"].stop)
        if "event_writer" in self._parts:
            quietly(self._parts["event_writer"].close)
        if "span_writer" in self._parts:
            quietly(self._parts["span_writer"].stop)
        if "live" in self._parts:
            quietly(self._parts["live"].stop)
        self.correlate_once()
        if getattr(self, "correlator", None) is not None:  # stretches of orphaned work still running
            quietly(self.correlator.finish)
        quietly(self.findings.shutdown)
        if "metrics" in self._parts:
            quietly(self._parts["metrics"].stop)
        self.store.close()

    def request_stop(self) -> None:
        """Ask the daemon to stop (safe from a signal handler); ``wait`` then returns."""
        self._stop.set()

    def wait(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(5.0)  # a signal handler's request_stop ends the wait at once


def _departure(event: ConnEvent) -> tuple[int, int, set[int]]:
    """``auditor.kernelrecord.departures`` of one decoded event."""
    kind = event.kind.value
    if kind == "peer_fin":
        return 1, 0, {event.server_port}
    if kind == "peer_rst":
        return 0, 1, {event.server_port}
    return 0, 0, set()
