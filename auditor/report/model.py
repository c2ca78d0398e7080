"""Typed records of a report: what ``auditor report`` found in a window, independent of its format.

The query layer (``query.py``) fills these from the store with SQL aggregation; the renderers
(table, JSON/CSV, HTML) only read them. Times stay integer nanoseconds here and are formatted as
RFC 3339 only at the edge, so nothing is lost between the store and the output.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from auditor.config import host_price
from auditor.model import Verdict
from auditor.timefmt import rfc3339_seconds

SCHEMA_ID = "auditor.report/v1"

# The verdicts a request with a disconnect can have (DESIGN §5), in the order reports show them.
VERDICTS = tuple(v.value for v in Verdict)
ZOMBIE_VERDICTS = tuple(v.value for v in Verdict if v.is_zombie)
BREAKDOWN_DIMENSIONS = ("service", "route", "model", "phase", "disconnect_kind", "host")
# Breakdowns by who called: dimension -> the verdicts' column. Each is grouped on its own (there
# may be as many values as callers), after the others.
CALLER_DIMENSIONS = {"client_address": "client_addr", "user_agent": "user_agent"}
# The filters a port's orphaned work can be narrowed by (ReportQuery fields).
ORPHANED_FILTERS = frozenset({"host", "model"})


def to_ns(moment: dt.datetime) -> int:
    """An aware datetime as integer nanoseconds since the epoch, exact to the microsecond."""
    delta = moment - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


@dataclass(frozen=True, slots=True)
class ReportQuery:
    """The window and filters of a report. ``None`` filters match everything."""

    since_ns: int
    until_ns: int
    host: str | None = None
    service: str | None = None
    route: str | None = None
    model: str | None = None
    top: int = 10  # how many worst zombies to list
    client: str | None = None  # the client's address (a verdict's client_addr, a span's peer address)
    user_agent: str | None = None  # the client's User-Agent, whole

    def filters(self) -> dict[str, str | None]:
        return {"host": self.host, "service": self.service, "route": self.route, "model": self.model,
                "client": self.client, "user_agent": self.user_agent}

    def describe_filters(self) -> str:
        """``host=a, route=/v1/x`` for the filters that are set, ``""`` when none is."""
        return ", ".join(f"{key}={value}" for key, value in self.filters().items() if value is not None)


# Wasted (host, GPU-seconds, CPU-seconds) by host: what a report's sums hold, for hosts priced
# apart. None: no host named (the prices of the hosts no pattern names).
WasteByHost = tuple[tuple[str | None, float, float], ...]


@dataclass(frozen=True, slots=True)
class Prices:
    """What an hour of one GPU and of one CPU core cost (0: unpriced), in ``currency``: the wasted
    GPU- and CPU-seconds priced. Set by the caller (``auditor report`` from the ``[report]`` settings);
    the store holds seconds only.

    A fleet's hosts of several kinds are priced apart: ``gpu_hour_by_host`` and ``cpu_hour_by_host``
    pair host name patterns (shell-style: ``gpu-h100-*``, or a whole name) with their prices, the
    first pattern a host matches giving its price, and ``gpu_hour`` / ``cpu_hour`` the price of the
    hosts none matches."""

    gpu_hour: float = 0.0
    cpu_hour: float = 0.0
    currency: str = "USD"
    gpu_hour_by_host: tuple[tuple[str, float], ...] = ()
    cpu_hour_by_host: tuple[tuple[str, float], ...] = ()

    @property
    def by_host(self) -> bool:
        """Whether hosts may be priced apart: a sum's cost is then its hosts' costs summed."""
        return bool(self.gpu_hour_by_host or self.cpu_hour_by_host)

    @property
    def priced(self) -> bool:
        """Whether any time has a price at all."""
        return bool(self.gpu_hour or self.cpu_hour or any(p for _, p in self.gpu_hour_by_host)
                    or any(p for _, p in self.cpu_hour_by_host))

    def rates(self, host: str | None = None) -> tuple[float, float]:
        """(GPU-hour, CPU-hour) prices of ``host``; None: of the hosts no pattern names."""
        return (host_price(host, self.gpu_hour_by_host, self.gpu_hour),
                host_price(host, self.cpu_hour_by_host, self.cpu_hour))

    def cost(self, gpu_seconds: float, cpu_seconds: float, host: str | None = None) -> float:
        """The wasted time's cost: each kind at its price (``host``'s), an unpriced kind adding nothing."""
        gpu_hour, cpu_hour = self.rates(host)
        return (gpu_seconds * gpu_hour + cpu_seconds * cpu_hour) / 3600

    def cost_by_host(self, waste: WasteByHost) -> float:
        """The cost of wasted time by host (``WasteByHost``), each host's at its prices."""
        return sum(self.cost(gpu_seconds, cpu_seconds, host) for host, gpu_seconds, cpu_seconds in waste)

    def unpriced(self, gpu_seconds: float, cpu_seconds: float, host: str | None = None) -> str | None:
        """``"GPU"`` or ``"CPU"``: the kind of wasted time the cost leaves out, having no price for it."""
        gpu_hour, cpu_hour = self.rates(host)
        if gpu_seconds > 0 and not gpu_hour:
            return "GPU"
        if cpu_seconds > 0 and not cpu_hour:
            return "CPU"
        return None

    def unpriced_hosts(self, waste: WasteByHost) -> list[tuple[str | None, str]]:
        """(host, ``"GPU"`` or ``"CPU"``) of each host whose wasted time of that kind has no price."""
        found = []
        for host, gpu_seconds, cpu_seconds in waste:
            kind = self.unpriced(gpu_seconds, cpu_seconds, host)
            if kind is not None:
                found.append((host, kind))
        return found


@dataclass(slots=True)
class Totals:
    """Sums over the window. ``gpu_seconds`` is the capacity (GPUs x window), not the busy time."""

    requests: int = 0
    disconnects: int = 0
    completed: int = 0
    aborted: int = 0
    zombies: int = 0
    inflight_zombies: int = 0
    unconfirmed: int = 0  # the client left early; nothing the engine emits told whether work stopped
    # Of those, the ones with no gauges of their engine read (details.unconfirmed_because no_gauges):
    # the engine's /metrics, scraped, could have told (vLLM sends no span for an abort).
    unconfirmed_without_gauges: int = 0
    # And the ones whose client closed as its answer ended (details.unconfirmed_because
    # raced_its_answer): a client that read it all, or a server that stopped at once on the close.
    unconfirmed_raced: int = 0
    zombie_seconds: float = 0.0
    wasted_tokens: int = 0
    wasted_tokens_estimated: int = 0  # the part of wasted_tokens that the engine did not report exactly
    zombies_without_tokens: int = 0  # zombies whose tokens nothing told (no engine span): not in wasted_tokens
    wasted_gpu_seconds: float = 0.0
    wasted_cpu_seconds: float = 0.0
    uncapped_disconnects: int = 0  # disconnected requests known (from an engine span) to have had no max_tokens
    uncosted_zombies: int = 0  # zombies whose engine's GPU/CPU time could not be read (details.cost_unmeasured)
    idle_closes: int = 0
    unjoined_disconnects: int = 0
    unjoined_spans: int = 0
    lost_kernel_events: int = 0
    proxy_rewritten_peers: int = 0
    peerless_span_joins: int = 0  # joined by server port alone: inferred, so counted
    gpus: int = 0
    gpu_seconds: float = 0.0
    gpu_busy_seconds: float = 0.0
    waste_by_host: WasteByHost = ()  # wasted_gpu_seconds and wasted_cpu_seconds, by host

    @property
    def cost_unit(self) -> str:
        """``"CPU"`` where the window has no GPU at all but CPU time was wasted (CPU-only hosts),
        else ``"GPU"``: the unit the human-readable reports lead with."""
        cpu_only = self.gpus == 0 and self.wasted_gpu_seconds == 0 and self.wasted_cpu_seconds > 0
        return "CPU" if cpu_only else "GPU"

    @property
    def wasted_gpu_share(self) -> float | None:
        """Wasted GPU-seconds as a fraction of the window's GPU time; None without GPU samples."""
        return self.wasted_gpu_seconds / self.gpu_seconds if self.gpu_seconds > 0 else None


@dataclass(frozen=True, slots=True)
class BreakdownRow:
    """Disconnected requests that share one value of a dimension (a route, a model, a phase...)."""

    key: str | None
    disconnects: int
    completed: int
    aborted: int
    zombies: int
    inflight_zombies: int
    zombie_seconds: float
    wasted_tokens: int
    wasted_gpu_seconds: float
    wasted_cpu_seconds: float = 0.0
    unconfirmed: int = 0
    waste_by_host: WasteByHost = ()  # the wasted seconds by host, for hosts priced apart

    def wasted_seconds(self, unit: str) -> float:
        return self.wasted_cpu_seconds if unit == "CPU" else self.wasted_gpu_seconds


class RequestFinding(NamedTuple):
    """One request that had a client disconnect while in flight, and its verdict.

    A NamedTuple rather than a dataclass: a report can hold a hundred thousand of these, and a
    tuple is built straight from a database row (``RequestFinding._make(row)``) at a fraction of
    the cost.
    """

    request_id: str | None
    trace_id: str | None
    verdict: str
    disconnect_at_ns: int
    disconnect_kind: str
    request_start_ns: int
    work_end_ns: int | None
    lag_seconds: float | None
    # How soon after the disconnect the work may have stopped, where clients that left after it may
    # own the orphans its engine's gauges gave it (details.lag_at_least_s); None: as exact as its evidence.
    lag_at_least_seconds: float | None
    phase: str
    route: str | None
    model: str | None
    service: str | None
    client_addr: str | None
    client_port: int | None
    user_agent: str | None
    host: str
    max_tokens: int | None
    wasted_tokens: int | None
    tokens_exact: bool
    wasted_gpu_seconds: float
    wasted_cpu_seconds: float
    # What said the verdict (details.evidence: engine_span, engine_metrics, ...), and for an
    # unconfirmed one why nothing could (details.unconfirmed_because); None where not recorded.
    evidence: str | None
    unconfirmed_because: str | None

    def wasted_seconds(self, unit: str) -> float:
        return self.wasted_cpu_seconds if unit == "CPU" else self.wasted_gpu_seconds

    @property
    def client(self) -> str | None:
        if self.client_addr is None:
            return None
        addr = f"[{self.client_addr}]" if ":" in self.client_addr else self.client_addr
        return f"{addr}:{self.client_port}" if self.client_port is not None else addr


@dataclass(frozen=True, slots=True)
class UtilPoint:
    """Mean whole-GPU utilization (all GPUs of the host) over one slice of time."""

    ts_ns: int
    util_percent: float


@dataclass(frozen=True, slots=True)
class ZombieTimeline:
    """A worst zombie with the host's GPU utilization from request start to end of work."""

    finding: RequestFinding
    end_ns: int  # work_end, or the end of the window for a zombie still running
    utilization: list[UtilPoint]


@dataclass(frozen=True, slots=True)
class Bucket:
    """One slice of the window for the over-time plots."""

    start_ns: int
    completed_requests: int  # http_server spans that ended in the slice
    disconnects: int
    zombies: int  # zombie and in-flight zombie verdicts whose disconnect fell in the slice
    wasted_gpu_seconds: float
    gpu_util_percent: float | None  # mean whole-GPU utilization; None without samples
    wasted_cpu_seconds: float = 0.0
    engine_cores: float | None = None  # engine processes' CPU in cores (/proc), read only without GPU samples
    # Work ports that sent no spans ran for clients gone (their stretches' share of the slice): the
    # mean number of such requests at once, and their wasted GPU- and CPU-seconds.
    orphaned_requests: float = 0.0
    orphaned_wasted_gpu_seconds: float = 0.0
    orphaned_wasted_cpu_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientTimeout:
    """Disconnects that came at one age of their request (disconnect less request start): a
    client's or a proxy's timeout, which gives up on every request the same time after it was
    sent (``auditor.report.timeouts`` says how they are found)."""

    after_seconds: float  # their mean age, to the millisecond
    from_seconds: float  # the youngest and oldest of them
    to_seconds: float
    disconnects: int
    completed: int
    aborted: int
    zombies: int
    inflight_zombies: int
    unconfirmed: int
    zombie_seconds: float
    wasted_gpu_seconds: float
    wasted_cpu_seconds: float
    first_ns: int  # the first and last of their disconnects
    last_ns: int
    default_of: str | None  # a well-known timeout of this length (nginx's 60 s), or None
    # How long its zombies' work ran from their requests' start, where it ended: what the answers
    # the timeout cut needed (a timeout above the longest would have let them answer). None: no
    # zombie ended, or none's end is surely its own (details.lag_at_least_s).
    zombie_work_mean_seconds: float | None = None
    zombie_work_max_seconds: float | None = None
    # Who it cut: the User-Agents and the client addresses of its disconnects, the most first
    # (up to CALLERS_SHOWN of each), with how many of them each.
    user_agents: tuple[tuple[str | None, int], ...] = ()
    client_addresses: tuple[tuple[str | None, int], ...] = ()
    waste_by_host: WasteByHost = ()  # the wasted seconds by host, for hosts priced apart

    def wasted_seconds(self, unit: str) -> float:
        return self.wasted_cpu_seconds if unit == "CPU" else self.wasted_gpu_seconds


CALLERS_SHOWN = 3  # a client timeout's User-Agents and client addresses listed


@dataclass(frozen=True, slots=True)
class AgeBar:
    """Disconnects whose request was ``start_s`` to ``start_s`` + the bar's width old (HTML)."""

    start_s: float
    disconnects: int
    zombies: int  # zombie and in-flight zombie verdicts among them


@dataclass(frozen=True, slots=True)
class DataRange:
    """Where the store holds requests, to point an empty report at the nearest data."""

    first_ns: int
    last_ns: int


@dataclass(frozen=True, slots=True)
class OrphanedPort:
    """The work the engine on one port ran after its clients left, told by the port alone (its
    gauges and the kernel: ``auditor.correlate.orphans``), over the stretches of the window. Lower
    bounds: a stretch starts at the first scrape counting an orphan, a grace after its client left."""

    host: str
    server_port: int
    model: str | None
    stretches: int
    running: int  # stretches with no end yet: still running when last written
    first_ns: int
    last_ns: int
    longest_seconds: float
    peak: int  # the most orphans one scrape counted
    request_seconds: float  # the orphans' count integrated over time
    wasted_gpu_seconds: float
    wasted_cpu_seconds: float
    with_spans: bool  # the port sent spans meanwhile: its verdicts count the same work
    cost_unmeasured: str | None


@dataclass(slots=True)
class Report:
    query: ReportQuery
    generated_ns: int
    totals: Totals
    breakdowns: dict[str, list[BreakdownRow]]
    worst_zombies: list[RequestFinding]
    requests: list[RequestFinding] = field(default_factory=list)
    requests_json: list[str] | None = None  # the same, as JSON texts made by the database
    series: list[Bucket] | None = None  # filled only when asked (the HTML report)
    bucket_ns: int = 0
    timelines: list[ZombieTimeline] | None = None
    data_range: DataRange | None = None  # filled when the window is empty
    client_timeouts: list[ClientTimeout] = field(default_factory=list)
    ages: list[AgeBar] | None = None  # disconnects by their request's age: filled with the series
    age_bar_s: float = 0.0
    ages_beyond: int = 0  # disconnects older than the last bar
    prices: Prices | None = None  # what the wasted time cost; None: seconds only
    # Work orphaned by port (ORPHANED_FILTERS alone apply to it); None: a filter it cannot honor
    # (service, route, client, User-Agent: a port's stretch has none of them).
    orphaned_work: list[OrphanedPort] | None = field(default_factory=list)

    def cost(self, wasted: Wasted) -> float | None:
        """The cost of a sum's wasted time (the totals, a breakdown row, a timeout's, a port's) at
        the report's prices, each host's at its own; None where the report has none."""
        return None if self.prices is None else self.prices.cost_by_host(waste_by_host(wasted))

    @property
    def empty(self) -> bool:
        return self.totals.requests == 0 and self.totals.disconnects == 0 and not self.orphaned_work

    def orphaned_without_spans(self) -> tuple[float, float, float]:
        """(request-, GPU-, CPU-seconds) of the work orphaned on ports that sent no spans: the
        zombie work no verdict counts."""
        ports = [p for p in self.orphaned_work or () if not p.with_spans]
        return (sum(p.request_seconds for p in ports), sum(p.wasted_gpu_seconds for p in ports),
                sum(p.wasted_cpu_seconds for p in ports))

    @property
    def has_coverage(self) -> bool:
        """Whether the window holds anything seen that is not a verdict (closes, spans, losses):
        shown even where it holds no request."""
        t = self.totals
        return any((t.idle_closes, t.unjoined_disconnects, t.unjoined_spans, t.lost_kernel_events,
                    t.proxy_rewritten_peers, t.peerless_span_joins))

    def empty_message(self) -> str:
        """What an empty window means and where the nearest data is."""
        window = f"between {rfc3339_seconds(self.query.since_ns)} and {rfc3339_seconds(self.query.until_ns)}"
        filters = self.query.describe_filters()
        what = f"no requests matching {filters}" if filters else "no requests"
        if self.data_range is None:
            return f"{what} {window}; the store holds no requests yet"
        return (f"{what} {window}; the store holds data from "
                f"{rfc3339_seconds(self.data_range.first_ns)} to {rfc3339_seconds(self.data_range.last_ns)}")


class Wasted(Protocol):
    """A sum of wasted time the report prices: its seconds, and by host where the query split them."""

    @property
    def wasted_gpu_seconds(self) -> float: ...

    @property
    def wasted_cpu_seconds(self) -> float: ...


def waste_by_host(wasted: Wasted) -> WasteByHost:
    """A sum's wasted seconds by host: as the query split them (``waste_by_host``), else all of it
    on its one host (a port's), else on no host named (the prices of hosts no pattern names)."""
    split: WasteByHost = getattr(wasted, "waste_by_host", ())
    if split:
        return split
    return ((getattr(wasted, "host", None), wasted.wasted_gpu_seconds, wasted.wasted_cpu_seconds),)
