"""Work an engine ran after its clients left, told by its port alone: stretches of orphaned work.

An engine that sends no spans (llama.cpp's server; TGI, whose spans name no client; any engine
without a proxy in front) gives no verdicts: nothing tells its requests apart. Its own /metrics and
the kernel still tell orphaned work: the requests it runs beyond the clients connected to its port
(``EngineLoads.orphans_past``, the count the in-flight alarm reads). This ledger turns that count,
scrape by scrape, into *stretches* per port, one row each in ``orphaned_work``:

- a stretch starts at the first scrape that counts an orphan and ends halfway between the last
  scrape that counts one and the first that counts none (the work ended somewhere between them);
- its request-seconds are the count integrated over time, the trapezoid between two scrapes (a
  change happened somewhere between); ``peak`` is the most orphans one scrape counted;
- its cost is the orphans' share of the engine process's GPU or CPU time: the utilization over
  each stretch of scrapes, divided by the requests the engine's gauge says it was running, times
  the orphans counted (``auditor.correlate.waste``).

Every figure is a lower bound, as the count is: an orphan is counted only once its client has been
gone for the grace, and an idle kept-alive client hides one. On a port whose spans come, the same
work is in its verdicts too: the row says so (``with_spans``) and the report keeps the two apart.

A stretch still running is written every ``OPEN_WRITE_NS`` (``end_ns`` NULL), so a report during
a long one shows it; a daemon that stops ends it where the last scrape counted (``cut_short``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Samples land up to this long after the moment they describe (waste.SAMPLE_MARGIN_NS): a part of
# a stretch is costed once it is this old.
COST_AFTER_NS = 5_000_000_000
OPEN_WRITE_NS = 10_000_000_000  # a stretch still running is written this often
# A port whose count has not been read for this long (no listed scrape: the scraper stopped, the
# engine went) ends its stretch where its last scrape counted.
SILENT_NS = 10_000_000_000

# A request orphaned in a stretch began before it, and its server span ended as its client left
# (the server heard of it): a port's spans this long before a stretch tell it sends them.
SPANS_BEFORE_NS = 60_000_000_000

# (port, start, end) -> (GPU-seconds, CPU-seconds) of one request's share of the engine's time, and
# why it could not be measured (None: measured).
CostOf = Callable[[int, int, int], tuple[float, float, str | None]]


@dataclass(slots=True)
class _Stretch:
    start_ns: int
    last_ns: int  # the last scrape read into it
    last_count: int
    peak: int
    request_seconds: float = 0.0
    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    # Parts not costed yet, their samples may still come: (from, to, mean orphans), in order.
    uncosted: list[tuple[int, int, float]] = field(default_factory=list)
    end_ns: int | None = None
    end_resolution_s: float | None = None
    cut_short: bool = False
    with_spans: bool = False
    model: str | None = None
    cost_unmeasured: str | None = None
    written_ns: int = 0  # when it was last written (open stretches are rewritten)


class OrphanLedger:
    """Stretches of orphaned work per port, from the counts each correlation round reads."""

    def __init__(self, host: str, cost_of: CostOf,
                 spanned: Callable[[int, int, int], bool] = lambda port, start_ns, end_ns: False) -> None:
        self.host = host
        self._cost_of = cost_of
        # Whether server spans on the port were in flight in [start, end]: asked as a row is
        # written (from SPANS_BEFORE_NS before the stretch), when spans exported in batches
        # (vLLM's every 5 s) have come.
        self._spanned = spanned
        self._read: dict[int, tuple[int, int]] = {}  # port -> the latest scrape counted: (its time, count)
        self._open: dict[int, _Stretch] = {}
        self._ended: list[tuple[int, _Stretch]] = []  # ended, waiting to be costed whole
        self._totals: dict[int, list[float]] = {}  # port -> request-, GPU-, CPU-seconds so far
        self._sends_spans: dict[int, bool] = {}  # port -> whether it sent server spans lately (the counters' label)

    def read(self, port: int, counted: tuple[int, int] | None, now_ns: int, *, model: str | None = None) -> None:
        """This round's count of ``port``'s orphans at its latest listed scrape (``(count, the
        scrape's time)``, as ``EngineLoads.orphans_past`` gives it; None: no scrape tells). A
        scrape's count may still fall in later rounds (closes come in after it): it is taken once
        a newer scrape is read, or at once where it is none."""
        if counted is not None:
            count, ts_ns = counted
            latest = self._read.get(port)
            if latest is not None and ts_ns > latest[0]:
                self._step(port, *latest)
            if latest is None or ts_ns >= latest[0]:
                self._read[port] = (ts_ns, max(0, count))
                if count <= 0:  # later closes only lower a count: none is final at once
                    self._step(port, ts_ns, 0)
        stretch = self._open.get(port)
        if stretch is None:
            return
        stretch.model = model or stretch.model
        latest = self._read.get(port)
        if latest is not None and now_ns - latest[0] > SILENT_NS:  # nothing tells of it any more
            self._step(port, *latest)
            if port in self._open:
                self._cut_short(port)
            del self._read[port]

    def _step(self, port: int, ts_ns: int, count: int) -> None:
        stretch = self._open.get(port)
        if stretch is None:
            if count > 0:
                self._open[port] = _Stretch(start_ns=ts_ns, last_ns=ts_ns, last_count=count, peak=count)
            return
        if ts_ns <= stretch.last_ns:
            return
        self._add_part(port, stretch, ts_ns, (stretch.last_count + count) / 2)
        stretch.peak = max(stretch.peak, count)
        if count == 0:
            stretch.end_ns = (stretch.last_ns + ts_ns) // 2
            stretch.end_resolution_s = round((ts_ns - stretch.last_ns) / 1e9, 3)
            self._ended.append((port, self._open.pop(port)))
        stretch.last_ns, stretch.last_count = ts_ns, count

    def _add_part(self, port: int, stretch: _Stretch, end_ns: int, mean: float) -> None:
        """The part of ``stretch`` from its last scrape to ``end_ns``, ``mean`` orphans on average."""
        start_ns = stretch.last_ns
        seconds = mean * (end_ns - start_ns) / 1e9
        stretch.request_seconds += seconds
        self._totals.setdefault(port, [0.0, 0.0, 0.0])[0] += seconds
        parts = stretch.uncosted
        if parts and parts[-1][1] == start_ns and parts[-1][2] == mean:  # one part while the count holds
            parts[-1] = (parts[-1][0], end_ns, mean)
        else:
            parts.append((start_ns, end_ns, mean))

    def _cut_short(self, port: int) -> None:
        stretch = self._open.pop(port)
        stretch.end_ns, stretch.cut_short = stretch.last_ns, True
        self._ended.append((port, stretch))

    def take_rows(self, now_ns: int, *, final: bool = False) -> list[dict[str, Any]]:
        """The rows to write now: stretches that ended and are costed whole (their samples have
        come), and those still running that were not written for ``OPEN_WRITE_NS``. ``final``
        (the daemon stops): every stretch, ended where its last scrape counted, costed as far as
        its samples go."""
        if final:
            for port, (ts_ns, count) in list(self._read.items()):
                self._step(port, ts_ns, count)
            for port in list(self._open):
                self._cut_short(port)
            self._read.clear()
        costed_by = now_ns if final else now_ns - COST_AFTER_NS
        rows = []
        for port, stretch in self._open.items():
            self._cost(port, stretch, costed_by)
            if now_ns - stretch.written_ns >= OPEN_WRITE_NS:
                stretch.written_ns = now_ns
                rows.append(self._row(port, stretch))
        waiting = []
        for port, stretch in self._ended:
            self._cost(port, stretch, costed_by)
            if stretch.uncosted:
                waiting.append((port, stretch))
            else:
                rows.append(self._row(port, stretch))
        self._ended = waiting
        return rows

    def _cost(self, port: int, stretch: _Stretch, by_ns: int) -> None:
        while stretch.uncosted and stretch.uncosted[0][0] < by_ns:
            start_ns, end_ns, mean = stretch.uncosted.pop(0)
            if end_ns > by_ns:  # a count that holds for long: costed up to where samples have come
                stretch.uncosted.insert(0, (by_ns, end_ns, mean))
                end_ns = by_ns
            gpu_s, cpu_s, unmeasured = self._cost_of(port, start_ns, end_ns)
            if not (math.isfinite(gpu_s) and math.isfinite(cpu_s)):  # a broken sample: counted as none
                gpu_s, cpu_s, unmeasured = 0.0, 0.0, f"a utilization sample of port {port}'s engine was not a number"
            stretch.gpu_seconds += gpu_s * mean
            stretch.cpu_seconds += cpu_s * mean
            totals = self._totals.setdefault(port, [0.0, 0.0, 0.0])
            totals[1] += gpu_s * mean
            totals[2] += cpu_s * mean
            stretch.cost_unmeasured = unmeasured or stretch.cost_unmeasured

    def _row(self, port: int, stretch: _Stretch) -> dict[str, Any]:
        stretch.with_spans = stretch.with_spans or self._spanned(port, stretch.start_ns - SPANS_BEFORE_NS,
                                                                 stretch.last_ns)
        return {"host": self.host, "server_port": port, "start_ns": stretch.start_ns, "end_ns": stretch.end_ns,
                "last_seen_ns": stretch.last_ns, "peak": stretch.peak,
                "request_seconds": round(stretch.request_seconds, 6),
                "wasted_gpu_seconds": round(stretch.gpu_seconds, 6),
                "wasted_cpu_seconds": round(stretch.cpu_seconds, 6),
                "end_resolution_s": stretch.end_resolution_s, "cut_short": stretch.cut_short,
                "with_spans": stretch.with_spans, "model": stretch.model,
                "cost_unmeasured": (stretch.cost_unmeasured or "")[:255] or None}

    def totals(self) -> dict[tuple[int, bool], tuple[float, float, float]]:
        """Per port and whether it sent spans lately, the orphaned work counted so far: (request-,
        GPU-, CPU-seconds); a new dict. A port with spans has its zombies in its verdicts too."""
        return {(port, self._sends_spans.get(port, False)): (totals[0], totals[1], totals[2])
                for port, totals in self._totals.items()}

    def spans_seen(self, port: int, now_ns: int) -> None:
        """Asks, for a port with orphaned work counted, whether it sent server spans in the last
        SPANS_BEFORE_NS (the counters' ``spans`` label)."""
        if port in self._totals:
            self._sends_spans[port] = self._spanned(port, now_ns - SPANS_BEFORE_NS, now_ns)

    def open_ports(self) -> dict[int, int]:
        """The ports with a stretch running, each with when it started."""
        return {port: stretch.start_ns for port, stretch in self._open.items()}
