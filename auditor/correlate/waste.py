"""What a zombie cost: utilization integrated over its zombie window, shared by who was really running.

GPU-seconds come from NVML samples of the processes doing the engine's GPU work: the serving
process itself, or the processes it started (vLLM serves HTTP from one process and runs the model
in its children, one a GPU with tensor parallelism). Each such process is costed by its own
readings (per process, or the whole GPU's when it is alone there); one NVML lists without
readings, by the whole GPUs it is on. On a host with one GPU, an engine whose GPU processes are not
known is costed by that GPU; with several, it is not costed (whose GPUs they are is not known).
CPU-seconds come from procfs samples of the serving process, on hosts without a GPU.

Each sample covers ``(ts - interval, ts]`` at an even rate, except the long reading of a quiet
process that the next reading finds busy: its busy time is taken to be its last part, at the next
reading's rate, since the work began inside it and went on. The part inside the window counts,
divided by the number of requests the engine was *running* at that moment: its own running gauge when it is
scraped, else the running part of its engine spans (after their time in queue) and the engine work
live notices say is running, one per request. A request waiting in a queue shares nothing.

Everything is kept in memory and indexed, so costing a verdict does not scan the store or every
trace: :class:`SampleCache` reads new samples once per round (by row id), :class:`RunIndex` files
each span's running interval in time buckets as the span arrives.
"""

from __future__ import annotations

import bisect
from array import array
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from auditor.correlate.checkpoints import Checkpoints
from auditor.model import SpanRecord, SpanRole
from auditor.semconv import engine_of
from auditor.store.db import Store

DEFAULT_INTERVAL_S = 0.1
BUCKET_NS = 1_000_000_000
HORIZON_NS = 15 * 60 * 1_000_000_000  # as the correlator's: nothing older is costed
REFRESH_NS = 100_000_000  # new samples are read at most this often
# A sample lands up to one interval after the moment it describes; NVML's are at most seconds apart.
SAMPLE_MARGIN_NS = 5_000_000_000
# A reading covering more than this many times the next one's time, and less busy, was a quiet
# process's (read once a second instead of ten times): its busy time goes to its end (_backload).
BACKLOAD_RATIO = 2
_BUCKET_SPAN_MAX = 3600  # a span longer than an hour is garbage: file only its last hour


@dataclass(frozen=True, slots=True)
class Waste:
    gpu_seconds: float
    cpu_seconds: float


@dataclass(slots=True)
class _Series:
    """One source's samples of one process (pid None: the whole GPU), in time order; packed
    arrays, a horizon of 100 ms samples being tens of thousands per series."""

    ts: array[int] = field(default_factory=lambda: array("q"))
    start: array[int] = field(default_factory=lambda: array("q"))  # the covered interval's start
    util: array[float] = field(default_factory=lambda: array("d"))

    def add(self, ts: int, start: int, util: float) -> int | None:
        """File a sample; returns the start of an earlier one it reshaped (``_backload``), if any."""
        if self.ts and ts < self.ts[-1]:
            at = bisect.bisect_right(self.ts, ts)
            self.ts.insert(at, ts)
            self.start.insert(at, start)
            self.util.insert(at, util)
            return None
        reshaped = self._backload(ts, start, util) if self.ts else None
        self.ts.append(ts)
        self.start.append(start)
        self.util.append(util)
        return reshaped

    def _backload(self, ts: int, start: int, util: float) -> int | None:
        """A long reading followed by a short, busier one came out of a quiet stretch (a sampler
        reads a quiet process seldom): the work it saw began somewhere inside it and went on. Spread
        evenly, a second half idle and half busy reads as 50 % throughout, and a zombie whose client
        left in its busy half is charged half of what it ran. So its busy time is put at its end, at
        the rate the next reading found, and the rest is idle; its total is unchanged."""
        last_ts, last_start, last_util = self.ts[-1], self.start[-1], self.util[-1]
        long_ns, next_ns = last_ts - last_start, ts - start
        if not (0.0 < last_util < util and long_ns > BACKLOAD_RATIO * next_ns and abs(start - last_ts) <= next_ns):
            return None
        busy_ns = int(long_ns * last_util / util)
        split = last_ts - busy_ns
        self.ts[-1], self.util[-1] = split, 0.0  # the idle part
        self.ts.append(last_ts)
        self.start.append(split)
        self.util.append(util)
        return last_start

    def within(self, start_ns: int, end_ns: int) -> range:
        """Indexes of the samples that may cover part of ``[start_ns, end_ns]``."""
        return range(bisect.bisect_right(self.ts, start_ns),
                     bisect.bisect_left(self.ts, end_ns + SAMPLE_MARGIN_NS))

    def prune(self, cutoff_ns: int) -> None:
        keep = bisect.bisect_left(self.ts, cutoff_ns)
        if keep:
            del self.ts[:keep], self.start[:keep], self.util[:keep]


_SAMPLE_COLUMNS = "id, ts_ns, source, gpu_index, pid, util_percent, interval_s"
_NEWEST_SAMPLE = "SELECT coalesce(max(id), 0) FROM util_samples"
_HORIZON_SAMPLES = (f"SELECT {_SAMPLE_COLUMNS} FROM util_samples "
                    "WHERE id <= :cursor AND host = :host AND ts_ns > :since")
# The new samples, every round: by row id. Written ``host = :host``, the host would pick the table's
# index on (host, ts_ns), and the read would walk every sample the host has kept (hours of them) to
# filter them by id: 66 ms a round at 860,000 samples. ``host || ''`` is no indexed column, so the
# read starts at the first new row (SQLite and PostgreSQL alike).
_NEW_SAMPLES = f"SELECT {_SAMPLE_COLUMNS} FROM util_samples WHERE id > :cursor AND host || '' = :host"


class SampleCache:
    """The host's utilization samples of the horizon, read from the store by row id, once per round."""

    def __init__(self, store: Store, host: str) -> None:
        self.store = store
        self.host = host
        # (source, pid), and ("nvml", None, GPU) for a whole GPU
        self._series: dict[tuple[str, int | None] | tuple[str, None, int], _Series] = defaultdict(_Series)
        self.gpus_of: dict[int, set[int]] = defaultdict(set)  # pid -> the GPUs NVML listed it on
        self._listed_at: dict[int, int] = {}  # pid -> when NVML last listed it
        self._cursor: int | None = None
        self._read_at = -REFRESH_NS
        self.queries = 0
        self.news_ns: int | None = None  # the earliest moment new samples cover, since last taken

    def refresh(self, now_ns: int) -> None:
        if now_ns - self._read_at < REFRESH_NS:
            return
        self._read_at = now_ns
        self.queries += 1
        with self.store.connect() as conn:  # under load this runs every round
            if self._cursor is None:  # the horizon, up to the newest row now (later ones come next round)
                self._cursor = int(conn.scalar(_NEWEST_SAMPLE) or 0)
                rows = conn.all(_HORIZON_SAMPLES, {"cursor": self._cursor, "host": self.host,
                                                   "since": now_ns - HORIZON_NS})
            else:
                rows = conn.all(_NEW_SAMPLES, {"cursor": self._cursor, "host": self.host})
        for row_id, ts_ns, source, gpu_index, pid, util_percent, interval_s in rows:
            self._cursor = max(self._cursor, row_id)
            if source == "nvml" and pid is not None and gpu_index is not None:
                self.gpus_of[pid].add(gpu_index)
                self._listed_at[pid] = max(ts_ns, self._listed_at.get(pid, ts_ns))
            if util_percent is None or interval_s == 0:
                # The source could not tell (no sample, not an idle one), or the reading covers no
                # time (NVML's buffer counted it already): nothing to file.
                continue
            covered_from = ts_ns - int((interval_s or DEFAULT_INTERVAL_S) * 1e9)
            key = (source, pid) if pid is not None or gpu_index is None else (source, None, gpu_index)
            reshaped = self._series[key].add(ts_ns, covered_from, util_percent)
            changed = covered_from if reshaped is None else min(covered_from, reshaped)
            if self.news_ns is None or changed < self.news_ns:
                self.news_ns = changed
        for series in self._series.values():
            series.prune(now_ns - HORIZON_NS)
        for pid in [pid for pid, at in self._listed_at.items() if at < now_ns - HORIZON_NS]:
            del self._listed_at[pid], self.gpus_of[pid]

    def take_news(self) -> int | None:
        news, self.news_ns = self.news_ns, None
        return news

    def series(self, source: str, pid: int | None) -> _Series | None:
        """A process's samples from ``source``; pid None: samples that named no process and no GPU."""
        found = self._series.get((source, pid))
        return found if found is not None and found.ts else None

    def gpu_series(self, gpu_index: int) -> _Series | None:
        """A whole GPU's NVML samples."""
        found = self._series.get(("nvml", None, gpu_index))
        return found if found is not None and found.ts else None

    def gpus(self) -> set[int]:
        """The GPUs with whole-GPU samples in the horizon."""
        return {key[2] for key, series in self._series.items() if len(key) == 3 and series.ts}

    def pids(self, source: str) -> set[int]:
        return {key[1] for key, series in self._series.items()
                if len(key) == 2 and key[0] == source and key[1] and series.ts}


def parent_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """A process's parent, from its stat file (the field after the parenthesised name, which may
    hold spaces and parentheses itself); None when it is gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as stat:
            raw = stat.read(4096)
        return int(raw[raw.rindex(b")") + 2:].split(maxsplit=2)[1])
    except (OSError, ValueError, IndexError):
        return None


def innermost_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """A process's pid in its own (innermost) pid namespace, from the ``NSpid`` line of its status:
    inside a container, the pid its spans name as ``process.pid``. None when unreadable."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


MAX_DEPTH = 32  # ancestors looked at: an engine's GPU processes are its children or grandchildren


def ancestors_of(pid: int, parent_of: Callable[[int], int | None] = parent_pid) -> tuple[int, ...]:
    """A process's ancestors, nearest first, up to init (or as far as they can be read)."""
    chain: list[int] = []
    at = pid
    while len(chain) < MAX_DEPTH and (parent := parent_of(at)) not in (None, 0, at) and parent not in chain:
        chain.append(parent)
        at = parent
    return tuple(chain)


@dataclass(slots=True)
class GpuShare:
    """Where an engine's GPU time is read: its GPU processes' own series, else whole GPUs; and why
    none when neither is known."""

    series: list[_Series]
    unmeasured: str = ""
    source: str = ""  # what the series are, for the verdict's details: "pids 5001", "GPUs 2, 3"


class CostSources:
    """What costing needs besides spans: the samples, which process serves which port, and which
    GPU processes belong to which serving process."""

    def __init__(self, store: Store, host: str, *, parent_of: Callable[[int], int | None] = parent_pid,
                 inner_pid_of: Callable[[int], int | None] = innermost_pid) -> None:
        self.samples = SampleCache(store, host)
        self.parent_of = parent_of
        self.inner_pid_of = inner_pid_of
        self._ancestors: dict[int, tuple[int, ...]] = {}  # a GPU process -> its ancestors, once looked up
        self._inner: dict[int, int | None] = {}  # a process -> its pid in its own namespace, once read
        self.pid_by_port: dict[int, int] = {}
        self.unresolved: dict[int, str] = {}  # port -> why its process is not known
        # A port several containers serve (each in a network of its own) -> each one's address -> its process.
        self.shared: dict[int, dict[str, int]] = {}
        self.changed = False  # the listeners changed since the correlator last looked

    def set_listeners(self, pid_by_port: dict[int, int], unresolved: dict[int, str],
                      shared: dict[int, dict[str, int]] | None = None) -> None:
        """The engine processes found behind the watched ports (by whoever can look: the daemon);
        ``shared``: those of a port several containers serve, by each container's address."""
        shared = shared or {}
        if pid_by_port != self.pid_by_port or unresolved != self.unresolved or shared != self.shared:
            self.pid_by_port, self.unresolved, self.changed = dict(pid_by_port), dict(unresolved), True
            self.shared = {port: dict(by_address) for port, by_address in shared.items()}

    def ancestors(self, pid: int) -> tuple[int, ...]:
        """A process's ancestors, nearest first, looked up once: a process's parent does not change
        while it runs (unless the parent exits first, and then the engine is gone too)."""
        found = self._ancestors.get(pid)
        if found is None:
            found = self._ancestors[pid] = ancestors_of(pid, self.parent_of)
        return found

    def engine_pid(self, named: int | None, port: int, sender: str | None = None) -> int | None:
        """The host process to cost, from the pid the spans name and the one listening on the port
        (on a port several containers serve, the one listening at the address the spans came
        from, ``sender``). A span's ``process.pid`` is the engine's pid in its own pid namespace:
        inside a container (often 1, or 7) it names an unrelated process of this host, or init
        itself, whose descendants would be every engine here. So where the listener, or a GPU
        process it started, has that pid in its own namespace, that host process is the one.
        Otherwise the named process is taken (the engine behind a proxy that holds the port), but
        never init."""
        listener = self.pid_by_port.get(port)
        if listener is None and sender and port in self.shared:
            listener = self.shared[port].get(sender)
        if named is None or named == listener:
            return listener
        if listener is not None and listener not in self.ancestors(named):
            started = [gpu_pid for gpu_pid in sorted(self.samples.gpus_of) if listener in self.ancestors(gpu_pid)]
            for candidate in (listener, *started):
                if candidate != named and self._inner_pid(candidate) == named:
                    return candidate
        return named if named > 1 else listener

    def _inner_pid(self, pid: int) -> int | None:
        if pid not in self._inner:
            if len(self._inner) > 256:  # processes come and go over days: keep the recent ones
                self._inner.clear()
            self._inner[pid] = self.inner_pid_of(pid)
        return self._inner[pid]

    def gpu_share(self, pid: int | None) -> GpuShare:
        """The series that hold the GPU time of the engine served by ``pid``: its own and its
        descendants' per-process series; else the whole GPUs NVML listed them on; else, on a host
        with one GPU, that GPU."""
        samples = self.samples
        gpus = samples.gpus()
        if pid is not None and pid > 1:
            if len(self._ancestors) > 2 * len(samples.gpus_of) + 64:  # processes gone, their pids free
                self._ancestors = {p: up for p, up in self._ancestors.items() if p in samples.gpus_of}
            processes = {pid} | {gpu_pid for gpu_pid in samples.gpus_of
                                 if gpu_pid != pid and pid in self.ancestors(gpu_pid)}
            own = [(p, found) for p in sorted(processes) if (found := samples.series("nvml", p)) is not None]
            if own:
                return GpuShare([series for _, series in own], source=_numbered("pid", [p for p, _ in own]))
            listed_on = sorted(set().union(*(samples.gpus_of.get(p, set()) for p in processes)))
            whole = [(gpu, found) for gpu in listed_on if (found := samples.gpu_series(gpu)) is not None]
            if whole:
                return GpuShare([series for _, series in whole], source=_numbered("GPU", [g for g, _ in whole]))
        if len(gpus) == 1:
            (only,) = gpus
            return GpuShare([samples.gpu_series(only)], source=f"GPU {only}, the host's one")  # type: ignore[list-item]
        if not gpus:  # no GPU here; or samples that named no GPU, taken as the host's one
            unnamed = samples.series("nvml", None)
            return GpuShare([] if unnamed is None else [unnamed])
        who = f"process {pid}" if pid is not None else "the engine's process"
        return GpuShare([], f"{len(gpus)} GPUs here, and NVML lists neither {who} nor a process it "
                            "started on any: whose GPU time is not known")


def _numbered(kind: str, numbers: list[int]) -> str:
    """``pid 5001``, ``GPUs 2, 3``."""
    return f"{kind}{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"


def running_part(span: SpanRecord) -> tuple[int, int]:
    """When a span's request was running: an engine span after its time in queue."""
    start = span.start_ns
    if span.role is SpanRole.ENGINE and span.time_in_queue_s:
        start = min(span.end_ns, start + int(span.time_in_queue_s * 1e9))
    return start, span.end_ns


def trace_key(trace_id: str) -> int:
    """A trace as RunIndex files it: its id's hash, 8 bytes. Two of the few requests in flight at
    one moment would have to share a 64-bit hash to be counted once."""
    return hash(trace_id)


class _Runs:
    """The runs filed in one bucket, as three arrays of 8-byte integers: starts, ends and trace
    keys. They are kept for the whole horizon (15 minutes, 90,000 requests at 100 req/s): a run as
    a tuple of two ints and its trace id's string, which the run alone kept alive once the spans
    had left memory, cost about 230 bytes a request; this is 24 bytes a bucket it is filed in."""

    __slots__ = ("ends", "starts", "traces")

    def __init__(self) -> None:
        self.starts = array("q")
        self.ends = array("q")
        self.traces = array("q")

    def add(self, start: int, end: int, trace_id: str) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.traces.append(trace_key(trace_id))


class RunIndex:
    """Per engine (``engine_of``: its service, and the address its spans came from where that is a
    container's), when each request was running, in one-second buckets: fed as spans arrive.

    Engine spans give the running part; server spans stand in for services that send no engine
    span. A query looks at one bucket, so its cost is the concurrency there, not the horizon's size.
    """

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, bool, int], _Runs] = defaultdict(_Runs)
        self._engines: set[str] = set()  # services seen sending engine spans
        self._oldest_bucket: int | None = None
        self.spans = 0

    def add(self, span: SpanRecord) -> None:
        if span.role not in (SpanRole.ENGINE, SpanRole.HTTP_SERVER) or span.end_ns < span.start_ns:
            return
        engine = span.role is SpanRole.ENGINE
        # Most held spans keep no attribute (one shared empty dict): their engine is their service.
        name = engine_of(span.service, span.attributes) if span.attributes else span.service
        if engine:
            self._engines.add(name)
        elif name in self._engines:
            return  # its engine spans tell who ran
        start, end = running_part(span)
        last = end // BUCKET_NS
        first = max(start // BUCKET_NS, last - _BUCKET_SPAN_MAX)
        for bucket in range(first, last + 1):
            self._buckets[(name, engine, bucket)].add(start, end, span.trace_id)
        self.spans += 1
        self._prune(last)

    def running_at(self, engine_name: str, ts_ns: int) -> set[int]:
        """The traces (``trace_key``) whose request engine ``engine_name`` (``engine_of``) was
        running at ``ts_ns``."""
        engine = engine_name in self._engines
        runs = self._buckets.get((engine_name, engine, ts_ns // BUCKET_NS))
        if runs is None:
            return set()
        return {trace for start, end, trace in zip(runs.starts, runs.ends, runs.traces, strict=True)
                if start <= ts_ns <= end}

    def _prune(self, newest_bucket: int) -> None:
        cutoff = newest_bucket - HORIZON_NS // BUCKET_NS
        if self._oldest_bucket is None:
            self._oldest_bucket = newest_bucket
        if self._oldest_bucket >= cutoff - 60:  # sweep once a minute's worth is stale
            return
        for key in [k for k in self._buckets if k[2] < cutoff]:
            del self._buckets[key]
        self._oldest_bucket = cutoff


def sharers_at(runs: RunIndex, engine_name: str, trace_id: str, live: dict[str, int],
               gauge: Callable[[int], int | None] | None) -> Callable[[int], int]:
    """How many requests shared the engine at a moment: the gauge when scraped, else the running
    spans of engine ``engine_name`` (``engine_of``) and the live engine work not yet spanned, each
    request once, this one included."""

    def count(ts_ns: int) -> int:
        if gauge is not None:
            counted = gauge(ts_ns)
            if counted is not None:
                return max(1, counted)
        traces = runs.running_at(engine_name, ts_ns)
        traces.update(trace_key(trace) for trace, since in live.items() if since <= ts_ns)
        traces.add(trace_key(trace_id))
        return len(traces)

    return count


PARTIAL_MIN_NS = 4_000_000_000  # windows longer than this keep checkpoints (PartialCost)
CHECKPOINT_NS = 1_000_000_000


class PartialCost(Checkpoints[tuple[float, float]]):
    """A long window's cost so far, at checkpoints on whole seconds: (GPU-, CPU-seconds) from the
    window's start to each (``checkpoints``). The key: the window's start, the process, the series
    read and what its sharers are counted by."""

    __slots__ = ()


def wasted(samples: SampleCache, *, start_ns: int, end_ns: int, pid: int | None,
           sharers: Callable[[int], int], gpu: GpuShare | None = None, partial: PartialCost | None = None,
           basis: tuple[object, ...] = ()) -> Waste:
    """Utilization-seconds spent in ``[start_ns, end_ns]``, this request's share of them. ``gpu``:
    where the engine's GPU time is (``CostSources.gpu_share``); without it, the pid's own NVML
    series, else the one GPU's of a host with one. ``partial``: the window's checkpoints, for a
    window longer than PARTIAL_MIN_NS (the caller keeps it from round to round); ``basis``: what
    ``sharers`` counts by, part of the checkpoints' key."""
    if end_ns <= start_ns:
        return Waste(0.0, 0.0)
    if gpu is None:
        own = samples.series("nvml", pid) if pid is not None else None
        gpus = samples.gpus()
        whole = samples.gpu_series(next(iter(gpus))) if len(gpus) == 1 else samples.series("nvml", None)
        gpu = GpuShare([found] if (found := own or whole) is not None else [])
    cpu = samples.series("procfs", pid) if pid is not None else None
    if partial is None or end_ns - start_ns <= PARTIAL_MIN_NS:
        return Waste(gpu_seconds=sum(_integrate(series, start_ns, end_ns, sharers) for series in gpu.series),
                     cpu_seconds=_integrate(cpu, start_ns, end_ns, sharers))
    resumed = partial.resume((start_ns, pid, *map(id, gpu.series), id(cpu), *basis), end_ns)
    at, (gpu_s, cpu_s) = resumed if resumed is not None else (start_ns, (0.0, 0.0))
    while at < end_ns:  # a second at a time, each whole second a checkpoint
        upto = min(end_ns, (at // CHECKPOINT_NS + 1) * CHECKPOINT_NS)
        gpu_s += sum(_integrate(series, at, upto, sharers) for series in gpu.series)
        cpu_s += _integrate(cpu, at, upto, sharers)
        if upto % CHECKPOINT_NS == 0:
            partial.mark(upto, (gpu_s, cpu_s))
        at = upto
    return Waste(gpu_seconds=gpu_s, cpu_seconds=cpu_s)


def _integrate(series: _Series | None, start_ns: int, end_ns: int, sharers: Callable[[int], int]) -> float:
    if series is None:
        return 0.0
    total = 0.0
    for i in series.within(start_ns, end_ns):
        ts, covered_from = series.ts[i], series.start[i]
        if covered_from >= end_ns:
            break  # a series' samples cover one stretch each, in order: none later reaches back
        low, high = max(covered_from, start_ns), min(ts, end_ns)
        if high <= low:
            continue
        total += series.util[i] / 100.0 * (high - low) / 1e9 / sharers((low + high) // 2)
    return total
