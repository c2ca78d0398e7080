"""What a zombie cost: utilization integrated over its zombie window, shared among requests in flight.

GPU-seconds come from NVML samples (the engine process's SM utilization when NVML reports it per
process, else the whole GPU's); CPU-seconds from procfs samples of the engine process, on hosts
without a GPU. Each sample covers ``(ts - interval, ts]``; the part inside the window counts,
divided by the number of requests the engine had in flight at that moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import select

from auditor.model import SpanRecord
from auditor.store import Store
from auditor.store.schema import UtilSampleRow

DEFAULT_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class Waste:
    gpu_seconds: float
    cpu_seconds: float


def wasted(store: Store, *, host: str, start_ns: int, end_ns: int, pid: int | None,
           inflight_at: Callable[[int], int]) -> Waste:
    """Utilization-seconds spent in ``[start_ns, end_ns]``, this request's equal share of them."""
    if end_ns <= start_ns:
        return Waste(0.0, 0.0)
    margin = int(5e9)  # samples land up to one interval after the moment they describe
    with store.session() as session:
        rows = session.execute(
            select(UtilSampleRow.ts_ns, UtilSampleRow.source, UtilSampleRow.gpu_index, UtilSampleRow.pid,
                   UtilSampleRow.util_percent, UtilSampleRow.interval_s)
            .where(UtilSampleRow.host == host, UtilSampleRow.ts_ns > start_ns,
                   UtilSampleRow.ts_ns < end_ns + margin)
        ).all()
    gpu_process = [r for r in rows if r.source == "nvml" and pid is not None and r.pid == pid]
    gpu_device = [r for r in rows if r.source == "nvml" and r.pid is None]
    cpu_process = [r for r in rows if r.source == "procfs" and pid is not None and r.pid == pid]
    gpu_rows = gpu_process or gpu_device

    def integrate(samples: list[object]) -> float:
        total = 0.0
        for row in samples:
            ts, util, interval = row.ts_ns, row.util_percent, row.interval_s  # type: ignore[attr-defined]
            if util is None:
                continue
            covered_from = ts - int((interval or DEFAULT_INTERVAL_S) * 1e9)
            overlap_ns = min(ts, end_ns) - max(covered_from, start_ns)
            if overlap_ns <= 0:
                continue
            sharers = max(1, inflight_at((max(covered_from, start_ns) + min(ts, end_ns)) // 2))
            total += util / 100.0 * overlap_ns / 1e9 / sharers
        return total

    return Waste(gpu_seconds=integrate(list(gpu_rows)), cpu_seconds=integrate(list(cpu_process)))


def requests_in_flight(traces: Iterable[dict[str, SpanRecord]], running_since: list[int], *, service: str,
                       start_ns: int, end_ns: int, now_ns: int) -> Callable[[int], int]:
    """How many requests the engine ``service`` had in flight at a moment within the window: each
    trace's extent from its stored spans, plus what live notices say is still running."""
    intervals = []
    for trace in traces:
        mine = [s for s in trace.values() if s.service == service and s.end_ns >= start_ns and s.start_ns <= end_ns]
        if mine:
            intervals.append((min(s.start_ns for s in mine), max(s.end_ns for s in mine)))
    intervals += [(since, now_ns) for since in running_since]

    def count(ts: int) -> int:
        return sum(1 for first, last in intervals if first <= ts <= last)

    return count
