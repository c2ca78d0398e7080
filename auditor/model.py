"""Domain records shared by every part of the auditor.

Sources (probes, collectors) produce these; the store persists them; correlation turns them into
verdicts. They are plain frozen dataclasses (kernel events: named tuples) so that every layer can
build and compare them without a database. All times are wall-clock nanoseconds since the Unix epoch (``time.time_ns()``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from auditor.semconv import SENDER_KEY


class ConnEventKind(str, enum.Enum):
    """What happened to a server-side TCP socket on an inference port."""

    PEER_FIN = "peer_fin"  # the client sent FIN: server socket ESTABLISHED -> CLOSE_WAIT
    PEER_RST = "peer_rst"  # the client reset the connection
    LOCAL_FIN = "local_fin"  # the server closed first: ESTABLISHED -> FIN_WAIT1 (not a disconnect)
    CLOSED = "closed"  # the socket reached CLOSE


class SpanRole(str, enum.Enum):
    """How correlation uses a span."""

    HTTP_SERVER = "http_server"  # an ASGI/HTTP server span: one request on one connection
    HTTP_CLIENT = "http_client"  # a gateway's outgoing call to the next hop
    ENGINE = "engine"  # the engine's own span (vLLM ``llm_request``)
    OTHER = "other"


class Verdict(str, enum.Enum):
    """What became of a request whose client disconnected while it was in flight (DESIGN §5)."""

    COMPLETED = "completed"
    ABORTED = "aborted"
    ZOMBIE = "zombie"
    INFLIGHT_ZOMBIE = "inflight_zombie"
    # The client left before the response ended, but nothing the engine emits can tell whether its
    # work stopped (HTTP spans only, no engine metrics): counted, never passed off as an abort.
    UNCONFIRMED = "unconfirmed"

    @property
    def is_zombie(self) -> bool:
        return self in ZOMBIE_VERDICTS


# The verdicts that count as zombies: the one place this is decided (report, metrics, replay use it).
ZOMBIE_VERDICTS = frozenset({Verdict.ZOMBIE, Verdict.INFLIGHT_ZOMBIE})


class Phase(str, enum.Enum):
    """Where the request was when its client left."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    UNKNOWN = "unknown"


class CoverageKind(str, enum.Enum):
    """Things the auditor saw but could not turn into a verdict; reported, never hidden."""

    IDLE_CLOSE = "idle_close"  # a close with no request in flight (normal keep-alive end)
    UNJOINED_DISCONNECT = "unjoined_disconnect"  # a peer close with no span to join it to
    UNJOINED_SPAN = "unjoined_span"  # a server span whose connection was never seen
    LOST_KERNEL_EVENTS = "lost_kernel_events"  # events the ring buffer dropped (the /proc source: notices dropped)
    PROXY_REWRITTEN_PEER = "proxy_rewritten_peer"  # span peer rewritten from X-Forwarded-For
    # a span with no peer address (its client left before the server read the request) joined by
    # its server port to the unjoined close just before it: a verdict, counted because it is inferred
    PEERLESS_SPAN_JOINED = "peerless_span_joined"


class ConnEvent(NamedTuple):
    """One kernel-observed state change of a server-side socket on a watched port.

    A named tuple rather than a frozen dataclass like the other records: the probe reader builds
    one per kernel event (hundreds of thousands a second at its limit), and a tuple is built in
    one step where a dataclass sets each field on its own. Change it with ``_replace``."""

    ts_ns: int
    kind: ConnEventKind
    family: int  # 4 or 6
    client_addr: str
    client_port: int
    server_addr: str
    server_port: int
    cookie: int | None = None
    host: str = ""
    source: str = "bpf"  # "bpf" or "procfs" (the unprivileged fallback)
    # A polled event is an interval, not an instant: the socket was last seen unchanged at
    # ``earliest_ns`` and first seen changed at ``ts_ns``. None for the probe, whose ts_ns is exact.
    earliest_ns: int | None = None


class EventRun(NamedTuple):
    """The probe's kernel event records as its ring buffer held them, not yet decoded.

    The daemon stores these as they are (``auditor.store.eventblocks``, format 2): decoding
    waits for the one reader that needs the events, the correlator. ``records`` is ``record_count``
    records ``stride`` bytes apart, each the ring's 8-byte header and a ``struct event``
    (``auditor.kernelrecord.RECORD``); the kernel's monotonic timestamps plus ``offset_ns`` are
    wall-clock time, ``first_ts_ns`` and ``last_ts_ns`` the earliest and latest of them."""

    records: bytes
    record_count: int
    stride: int
    offset_ns: int
    first_ts_ns: int
    last_ts_ns: int
    host: str = ""
    source: str = "bpf"


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """A span reduced to the columns correlation joins on (DESIGN §4); the rest stays in ``attributes``."""

    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str | None
    name: str
    kind: str  # OTLP span kind without prefix: "server", "client", "internal", ...
    start_ns: int
    end_ns: int
    service: str = ""
    host: str = ""
    status: str = "unset"  # "unset", "ok" or "error"
    role: SpanRole = SpanRole.OTHER
    peer_addr: str | None = None
    peer_port: int | None = None
    server_port: int | None = None
    request_id: str | None = None  # X-Request-Id on HTTP spans, gen_ai.request.id on engine spans
    route: str | None = None
    model: str | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    time_in_queue_s: float | None = None
    time_to_first_token_s: float | None = None
    process_pid: int | None = None
    peer_rewritten: bool = False  # the peer came from X-Forwarded-For (port 0): never joined
    attributes: dict[str, Any] = field(default_factory=dict)


# How far apart in start time a span and its relatives are looked for, in whole minutes (the store
# keys spans by start minute first: auditor/store/spankeys.py). A span's parent and children within
# one request (a second instrumentation's server span, a gateway's client call and the server span
# it reached, an engine's span beside its server span) start milliseconds apart: a minute either
# side always holds them. The server span around a gateway's client call may have started long
# before it (an agent's request calling out for minutes): up to the correlator's horizon.
MINUTE_NS = 60_000_000_000
NEAR_MINUTES = 1
ENCLOSING_MINUTES = 15


def start_minute(start_ns: int) -> int:
    """The minute a span that started at ``start_ns`` is keyed by (SQL's integer division)."""
    return start_ns // MINUTE_NS if start_ns >= 0 else -(-start_ns // MINUTE_NS)


def minutes_around(minute: Any, before: int, after: int = NEAR_MINUTES) -> list[Any]:
    """The minutes a relative of a span that started in ``minute`` is looked for in, nearest first:
    from ``after`` minutes after it to ``before`` minutes before. ``minute`` is a number or a
    column expression (a correlated subquery's outer span)."""
    return [minute + offset if offset else minute
            for offset in sorted(range(-before, after + 1), key=lambda offset: (abs(offset), -offset))]


def started_near(relative: SpanRecord, span: SpanRecord, before: int = NEAR_MINUTES) -> bool:
    """``relative`` started in a minute a lookup from ``span`` names (``minutes_around``)."""
    return -before <= start_minute(relative.start_ns) - start_minute(span.start_ns) <= NEAR_MINUTES


def is_inner_server_span(span: SpanRecord, lookup: Callable[[str, str], SpanRecord | None]) -> bool:
    """A server span inside another server span of its trace, directly or behind one client span
    (a second instrumentation, a traced gateway hop): no request of its own. ``lookup(trace_id,
    span_id)`` finds its relatives; they count where the report's lookups would find them (the
    parent near the span, the server span around a client call up to ``ENCLOSING_MINUTES``
    before it). The report asks the same in SQL (``auditor.report.requests.inner_server_span``);
    tests hold the two equal."""
    parent = lookup(span.trace_id, span.parent_span_id) if span.parent_span_id else None
    if parent is None or not started_near(parent, span):
        return False
    if parent.role == SpanRole.HTTP_SERVER:
        return True
    grand = (lookup(span.trace_id, parent.parent_span_id)
             if parent.role == SpanRole.HTTP_CLIENT and parent.parent_span_id else None)
    return grand is not None and grand.role == SpanRole.HTTP_SERVER and started_near(grand, parent, ENCLOSING_MINUTES)


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """A span (or engine work item) starting or ending, as the daemon receives it."""

    event: str  # "start" or "end"
    trace_id: str
    span_id: str
    name: str
    kind: str
    ts_ns: int
    peer_addr: str | None
    peer_port: int | None
    server_port: int | None
    pid: int | None
    service: str
    engine: bool  # engine work (not an HTTP span)
    # An engine end's finish reason where the engine tells it (stop, length, abort, ...); None: untold.
    finish: str | None = None
    # The address the notice came from where it is a container's (``auditor.semconv.sender_address``),
    # as the receivers keep it on spans: which of the engines serving one port sent it.
    sender: str | None = None

    def as_span(self) -> SpanRecord:
        """A stand-in server span for a request known only from its start notice."""
        return SpanRecord(trace_id=self.trace_id, span_id=self.span_id, parent_span_id=None, name=self.name,
                          kind=self.kind, start_ns=self.ts_ns, end_ns=self.ts_ns, service=self.service,
                          role=SpanRole.HTTP_SERVER, peer_addr=self.peer_addr, peer_port=self.peer_port,
                          server_port=self.server_port, process_pid=self.pid,
                          attributes={SENDER_KEY: self.sender} if self.sender else {})


@dataclass(frozen=True, slots=True)
class UtilSample:
    """One utilization reading: a whole GPU, a process on a GPU, or a process on the CPU."""

    ts_ns: int
    source: str  # "nvml" or "procfs"
    host: str = ""
    gpu_index: int | None = None  # None for CPU samples
    pid: int | None = None  # None for whole-device samples
    util_percent: float | None = None  # SM utilization, or CPU percent where 100 = one core busy
    memory_util_percent: float | None = None
    memory_bytes: int | None = None
    power_watts: float | None = None
    interval_s: float | None = None  # the window the reading covers


# How long an engine's step series (``EngineLoad.step_tokens``) may stand still while its work runs,
# by whose names it uses: vLLM publishes with each step (a second is longer than any step, a chunk
# of a long prompt's prefill included); SGLang logs its gauges with each prefill batch and every 40
# decode steps (``decode_log_interval``), and idle only every 30 s.
STEP_STILL_NS: dict[str, int] = {"vllm": 1_000_000_000, "sglang": 5_000_000_000}
# The engines whose gauges move only when they log a batch: their work may have run on for up to
# one log interval after the last log that moved them.
LOGGED_STYLES = frozenset({"sglang"})


# A client the kernel listed connected to a port: its address, its port, when data from it last
# came to the server (ns), and the server socket's own address ("" where not known). Pods of one
# node serving one port are told apart by the last: a gateway reaching two of them from one address
# may be given one source port for both.
ListedClient = tuple[str, int, int, str]
# A ListedClient's last read where the kernel's table gives none: a client of another network
# namespace (a container's engine), listed from that namespace's /proc/net/tcp by the /proc source.
READ_UNKNOWN = 0
# The engines (``EngineLoad.style``) whose finish count is of the tokens the requests they finished
# normally generated, not of the requests (llama.cpp's ``tokens_predicted``): a rise says that at
# least one finished, not how many.
FINISHES_COUNTED_IN_TOKENS = frozenset({"llamacpp"})


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine's own /metrics: how many requests it was running and holding."""

    ts_ns: int
    server_port: int  # the inference port the engine serves (and was scraped on)
    running: int
    waiting: int = 0
    generated_tokens: float | None = None  # the engine's cumulative generated-token counter
    # The sum of the series its every published step moves (STEP_STILL_NS): vLLM's generated and
    # prompt token counters; SGLang's KV tokens in use and generation throughput, which it logs
    # with its gauges. Standing still while the gauges hold requests: no step ran, they are stale.
    step_tokens: float | None = None
    # The one model its gauges name (vLLM's and SGLang's ``model_name`` label); None: none, or several.
    model: str | None = None
    style: str = ""  # whose metric names matched: vllm, sglang, tgi, llamacpp, ref
    aborted: float | None = None  # the engine's cumulative count of aborted requests; None: it has none
    # The engine's cumulative count of requests it finished normally (vLLM's ``request_success``
    # but its "abort" series, TGI's), or of their generated tokens where it counts no requests
    # (llama.cpp's, ``FINISHES_COUNTED_IN_TOKENS``); None: it has none
    finished: float | None = None
    # Where ``finished`` counts tokens (llama.cpp): the engine's cumulative seconds of those
    # requests' generation, first token to last (``tokens_predicted_seconds``), each request's
    # at most its span's length. None: not read.
    finished_seconds: float | None = None
    # When the answer came: the gauges describe one moment in [ts_ns, answered_ns], so a request
    # that started or ended in between may or may not be in them. None: an instant.
    answered_ns: int | None = None
    # The clients connected to the port just before the scrape, the kernel's word (the eBPF probe's
    # table, or sock_diag without it), listed while the correlator wants them (``ListedClient``),
    # the scraper's own connections left out. None: not listed with this scrape.
    connections: tuple[ListedClient, ...] | None = None
    # False: a client was accepted (of a watched port, by the probe's count; of any port without
    # it) between the listing and the answer, so a client of this port may be missing from it.
    connections_complete: bool = True
    # Listed only because the engine held requests (``EngineMetricsScraper(list_while_busy=True)``),
    # not because a client had left or a verdict asked: kept a short while unless a client left
    # near it (``EngineLoads.add``).
    listed_while_busy: bool = False
    # A port several containers serve: its counts are their engines' sum, and this each one's
    # running count by its address (who shared an engine's time is its own count). None: one engine.
    running_by_address: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestVerdict:
    """The auditor's finding for one request that had a client disconnect while in flight."""

    request_key: str  # stable identity: "<host>/<trace_id>/<server span_id>"
    host: str
    verdict: Verdict
    disconnect_at_ns: int
    disconnect_kind: str  # "fin" or "rst"
    request_start_ns: int
    work_end_ns: int | None
    lag_seconds: float | None
    phase: Phase = Phase.UNKNOWN
    trace_id: str | None = None
    request_id: str | None = None
    service: str | None = None
    route: str | None = None
    model: str | None = None
    client_addr: str | None = None
    client_port: int | None = None
    # The client's User-Agent as its HTTP server span tells it (``user_agent.original``, or the
    # older ``http.user_agent``): which SDK, browser or proxy gave up. At most
    # ``auditor.semconv.MAX_USER_AGENT`` characters.
    user_agent: str | None = None
    server_port: int | None = None
    max_tokens: int | None = None
    tokens_after_disconnect: int | None = None
    tokens_exact: bool = False
    wasted_gpu_seconds: float = 0.0
    wasted_cpu_seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
