"""Prometheus's text exposition (format 0.0.4) of the daemon's metric families, and ``/metrics``.

Not prometheus_client: importing any part of it imports its exposition module, which imports
``http.server``, ``urllib.request`` and ``wsgiref`` (and through them ``ssl``, ``hashlib`` and the
email package): 8.9 MiB in a fresh interpreter (bench/import_cost.py). Without it and
``http.server`` the idle daemon holds 33.5 MiB instead of 40.5 (docs/footprint.md, forty-fourth
pass). The daemon's families are all built when Prometheus scrapes, by collectors that read
running totals; it keeps no client-side metric objects. So what it needs is small and here: the
three family types it uses, the text format, the ``process_*`` families and an HTTP endpoint.
The text equals prometheus_client's ``generate_latest`` byte for byte (tests/test_promtext.py
checks it against the library), so dashboards and recording rules see the same series.

The endpoint answers ``GET``/``HEAD`` on ``/metrics`` (and ``/``), gzip when the scraper accepts
it, and ``?name[]=...`` with only the named series, as prometheus_client's server does. It serves
the text format only: Prometheus asks for OpenMetrics first but takes this.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol
from urllib.parse import parse_qs, urlsplit

from auditor import http1

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_PATHS = ("/metrics", "/")
HEALTH_PATH = "/healthz"
MAX_CONNECTIONS = 32
IDLE_TIMEOUT_S = 5.0  # a connection silent this long is closed (between requests, or within one)


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


class Family:
    """One metric family: its name, help text, type and samples."""

    type = "untyped"
    suffix = ""  # of its samples' name

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.samples: list[Sample] = []
        self._labelnames = tuple(labels or ())
        if value is not None:
            if self._labelnames:
                raise ValueError(f"{name}: a value is given for a family with labels")
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(Sample(self.name + self.suffix, dict(zip(self._labelnames, labels, strict=True)), value))


class GaugeFamily(Family):
    type = "gauge"


class CounterFamily(Family):
    """A counter: its samples are named ``<name>_total`` (a name given with ``_total`` is taken without)."""

    type = "counter"
    suffix = "_total"

    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        super().__init__(name.removesuffix("_total"), documentation, value, labels)


class HistogramFamily(Family):
    type = "histogram"

    def add_histogram(self, labels: Sequence[str], buckets: Sequence[tuple[str, float]], sum_value: float) -> None:
        """Cumulative ``buckets`` as (upper bound text, count), the last ``+Inf``; then count and sum."""
        base = dict(zip(self._labelnames, labels, strict=True))
        for bound, count in buckets:
            self.samples.append(Sample(self.name + "_bucket", {**base, "le": bound}, count))
        self.samples.append(Sample(self.name + "_count", base, buckets[-1][1]))
        self.samples.append(Sample(self.name + "_sum", base, sum_value))


class Collector(Protocol):
    def collect(self) -> Iterable[Family]: ...


class Registry:
    """The collectors a scrape reads, in the order they were registered."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []
        self._lock = threading.Lock()

    def register(self, collector: Collector) -> None:
        with self._lock:
            self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        with self._lock:
            collectors = list(self._collectors)
        for collector in collectors:
            yield from collector.collect()

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value now, or None (tests read the daemon's tallies with it)."""
        for family in self.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return None

    def exposition(self, names: Iterable[str] | None = None) -> bytes:
        """The text format of every family; with ``names``, only samples of those names."""
        if names is None:
            return render(self.collect())
        wanted = set(names)
        return render(_restricted(self.collect(), wanted))


def _restricted(families: Iterable[Family], names: set[str]) -> Iterator[Family]:
    for family in families:
        samples = [sample for sample in family.samples if sample.name in names]
        if samples:
            kept = Family(family.name, family.documentation)
            kept.type, kept.suffix, kept.samples = family.type, family.suffix, samples
            yield kept


def float_text(value: float) -> str:
    """A value as Prometheus's Go code writes it: +Inf, -Inf, NaN; exponent form from 1e+06 up
    (Python's repr switches at 1e+16)."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _sample_line(sample: Sample) -> str:
    if not sample.labels:
        return f"{sample.name} {float_text(sample.value)}\n"
    labels = ",".join(f'{name}="{_escape_value(value)}"' for name, value in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}} {float_text(sample.value)}\n"


def render(families: Iterable[Family]) -> bytes:
    """Families in the text format: HELP and TYPE lines (a counter's named ``_total``), then samples."""
    out: list[str] = []
    for family in families:
        name = family.name + family.suffix
        out.append(f"# HELP {name} {_escape_help(family.documentation)}\n")
        out.append(f"# TYPE {name} {family.type}\n")
        out.extend(map(_sample_line, family.samples))
    return "".join(out).encode("utf-8")


# -- process_* ------------------------------------------------------------------------------------
class ProcessCollector:
    """``process_*`` of this process from /proc, as prometheus_client's process collector names and
    computes them: virtual and resident memory, start time, CPU seconds, open and maximum files.
    What cannot be read is left out of that scrape."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._pagesize = os.sysconf("SC_PAGE_SIZE")
        self._boot_time = _boot_time(proc)

    def collect(self) -> Iterator[Family]:
        if self._boot_time is None:
            return
        me = os.path.join(self._proc, "self")
        try:
            with open(os.path.join(me, "stat"), "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[-1].split()
            # After the name: state is fields[0], so stat(5)'s field n is fields[n - 3].
            yield GaugeFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", float(fields[20]))
            yield GaugeFamily("process_resident_memory_bytes", "Resident memory size in bytes.",
                              float(fields[21]) * self._pagesize)
            yield GaugeFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                              float(fields[19]) / self._ticks + self._boot_time)
            yield CounterFamily("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                                (float(fields[11]) + float(fields[12])) / self._ticks)
        except (OSError, ValueError, IndexError):
            pass
        try:
            max_fds = None
            with open(os.path.join(me, "limits"), "rb") as limits:
                for line in limits:
                    if line.startswith(b"Max open file"):
                        max_fds = float(line.split()[3])
                        break
            open_fds = len(os.listdir(os.path.join(me, "fd")))
        except (OSError, ValueError, IndexError):
            return
        yield GaugeFamily("process_open_fds", "Number of open file descriptors.", open_fds)
        if max_fds is not None:
            yield GaugeFamily("process_max_fds", "Maximum number of open file descriptors.", max_fds)


def _boot_time(proc: str) -> float | None:
    try:
        with open(os.path.join(proc, "stat"), "rb") as stat:
            for line in stat:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- /metrics -------------------------------------------------------------------------------------
class _Handler(http1.Handler):
    server: _Server
    server_name = "auditor-metrics"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == HEALTH_PATH and self.server.health is not None:
            healthy, reason = self.server.health()
            self.answer(200 if healthy else 503, reason.encode() + b"\n", content_type="text/plain; charset=utf-8")
            return
        if url.path not in METRICS_PATHS:
            self.refuse(404, f"no such page {url.path[:100]!r}; the metrics are at /metrics")
            return
        names = parse_qs(url.query).get("name[]")
        try:
            body = self.server.registry.exposition(names)
        except Exception:  # a collector's bug: an error answer, not a dead thread
            log.exception("a /metrics scrape failed")
            self.refuse(500, "the metrics could not be read; see the daemon's log")
            return
        extra = {"Vary": "Accept-Encoding"}
        if accepts_gzip(self.headers.get("Accept-Encoding") or ""):
            body, extra["Content-Encoding"] = gzip.compress(body, 6), "gzip"
        self.answer(200, body, content_type=CONTENT_TYPE, extra=extra)

    do_HEAD = do_GET


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip: named (or ``*``) with a weight above 0."""
    for item in accept_encoding.lower().split(","):
        name, _, params = item.partition(";")
        if name.strip() not in ("gzip", "*"):
            continue
        weight = params.strip().removeprefix("q=") if params.strip().startswith("q=") else "1"
        try:
            return float(weight) > 0
        except ValueError:
            return False
    return False


class _Server(http1.Server):
    def __init__(self, address: tuple[str, int], registry: Registry,
                 health: Callable[[], tuple[bool, str]] | None) -> None:
        self.registry = registry
        self.health = health
        # A connection holds its thread until it is silent for the timeout: eight idle ones (a port
        # scan, replicas' kept-alive connections between scrapes) used to answer every scrape 503
        # for 15 s. Scrapers reconnect at no cost; a slot is a thread, a few hundred KiB at most.
        super().__init__(address, _Handler, max_connections=MAX_CONNECTIONS, socket_timeout_s=IDLE_TIMEOUT_S,
                         name="metrics")


class MetricsServer:
    """``/metrics`` on its own thread; binding raises OSError (e.g. address in use). With ``health``,
    ``/healthz`` answers 200 or 503 with its reason: a liveness check for what serving /metrics,
    on a thread of its own, cannot tell."""

    def __init__(self, registry: Registry, host: str, port: int,
                 health: Callable[[], tuple[bool, str]] | None = None) -> None:
        self._server = _Server((host, port), registry, health)
        # The serving loop wakes this often only to see a stop; each wake-up costs CPU on an idle host.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 1.0},
                                        name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

