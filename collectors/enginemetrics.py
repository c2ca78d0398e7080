"""Scrape each inference engine's own Prometheus /metrics for how many requests it is working on.

An engine that emits no engine span still counts its running and waiting requests, under its own
names. Running requests above the requests whose clients are still connected are orphans: work
that goes on after a disconnect. The correlator makes that comparison; this module only reads the
gauges, at a fixed period, from every watched inference port (the engine serves /metrics on the
port it serves requests on: vLLM, SGLang, TGI's router, llama.cpp with ``--metrics``).

A port that answers with no known metric is skipped quietly and retried less often: not every
watched port is an engine (a gateway, an app). Each port is scraped over one kept-alive
connection: a connection per scrape would add a client close on the inference port every scrape,
and the correlator counts client closes there (abort counters are matched to departures).

An engine without live notices exports a request's spans when it ends, so the requests it runs
are not known connected until then. While a client has just left a port, or a verdict reads its
coming scrapes (``want_clients``), each scrape of it also lists the clients connected to it
(``EngineLoad.connections``): the correlator reads the gauges against them.

An engine's page is mostly histograms the daemon never reads (a vLLM's is over 100 KiB). Servers
built on prometheus_client (vLLM, SGLang) answer ``?name[]=...`` with only the named series; others
ignore the query. The first scrape of an engine reads its page both ways, and the short one is used
from then on only if it holds every series the whole page gave (a registry that cannot tell its
collectors' names, as in multiprocess mode, answers it with nothing); any failure reads the whole
page again.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from urllib.parse import quote

from auditor.model import STEP_STILL_NS, EngineLoad, ListedClient

log = logging.getLogger(__name__)

# (style, running gauge, waiting gauge, generated-token counter), in the engines' own names. The
# parser strips a counter's ``_total``; the names here are without it. TGI's is the sum of a
# histogram of each finished request's tokens.
KNOWN_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens"),
    ("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens"),
    ("tgi", "tgi_batch_current_size", "tgi_queue_size", "tgi_request_generated_tokens_sum"),
    ("llamacpp", "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:tokens_predicted"),
    ("ref", "ref_engine_num_requests_running", "ref_engine_num_requests_waiting", "ref_engine_generation_tokens"),
)
# Each engine's own count of the requests it aborted: (counter without ``_total``, label, value);
# a label of None counts every series. The counter rising between the scrapes around a disconnect
# says the work of the cancelled request stopped. vLLM's "abort" series does not count a request
# aborted because its client left (its abort path records no finished-request stats; vLLM issues
# 31503, 55634): it stays flat, and is read in case a version counts them. TGI counts a request
# whose client is gone as ``tgi_request_failure{err="dropped"}`` when it stops its work. llama.cpp
# counts no aborts.
ABORT_COUNTERS: dict[str, tuple[str, str | None, str | None]] = {
    "vllm": ("vllm:request_success", "finished_reason", "abort"),
    "sglang": ("sglang:num_aborted_requests", None, None),
    "tgi": ("tgi_request_failure", "err", "dropped"),
    "ref": ("ref_engine_requests", "finish_reason", "abort"),
}
# Engines that list a counter only from its first count (TGI's metrics exporter): no series on the
# page is a count of 0, not an engine that does not count.
LISTED_ONCE_COUNTED = frozenset({"tgi"})
# Each engine's own count of the requests it finished normally: (counter without ``_total``, label,
# the label's value to leave out; None: every series). vLLM counts a request by its finish reason
# (stop, length, ...) as it hands the request's last token to the server; its "abort" series is
# left out. TGI counts ``tgi_request_success`` as its router takes the last token, before it sends
# it; a stream whose client left is dropped uncounted. llama.cpp counts no requests, but adds a
# request's generated tokens to ``tokens_predicted`` only as it finishes it normally, just after it
# hands the last over (a task cancelled because its client left is released uncounted): a rise
# says some request finished, not how many (``auditor.model.FINISHES_COUNTED_IN_TOKENS``). No rise
# over a request's whole life, on an engine seen to count, says it did not finish normally
# (``EngineLoads.no_finish_while``): where its client closed as its span ended, it was no complete
# answer.
FINISH_COUNTERS: dict[str, tuple[str, str | None, str | None]] = {
    "vllm": ("vllm:request_success", "finished_reason", "abort"),
    "tgi": ("tgi_request_success", None, None),
    "llamacpp": ("llamacpp:tokens_predicted", None, None),
    "ref": ("ref_engine_requests", "finish_reason", "abort"),
}
# Where an engine's finish count is of tokens, its count of those requests' generation time, added
# with them (llama.cpp's ``t_tokens_generation_total``, in whole milliseconds a request): each adds
# at most its own span's length, so a rise can say more than one request finished.
FINISH_SECONDS: dict[str, str] = {"llamacpp": "llamacpp:tokens_predicted_seconds"}
MODEL_LABEL = "model_name"  # the served model, on vLLM's and SGLang's gauges
MAX_MODEL_CHARS = 255
# The series an engine moves at every step it publishes its gauges with: their sum is
# ``EngineLoad.step_tokens``. vLLM records each step's token counts and publishes its gauges with
# each step, so after every request was aborted at once the gauges keep their last values (vLLM
# issues 22545, 29928) while these stand still. SGLang sets its gauges only when it logs a batch
# (each prefill, every 40 decode steps, idle every 30 s): the KV tokens in use and the generation
# throughput move with each log while work runs.
STEP_SERIES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm:generation_tokens", "vllm:prompt_tokens"),
    "sglang": ("sglang:num_used_tokens", "sglang:gen_throughput"),
}
_STEP_GAUGES = frozenset({"sglang:num_used_tokens", "sglang:gen_throughput"})  # the rest are counters
NOT_AN_ENGINE_BACKOFF_S = 30.0
# A server of a port several containers serve that has not answered a scrape since it appeared (an
# engine loading its model listens for minutes before it answers: vLLM binds its port first) is
# asked again this often at most, each failure doubling the wait from the scrape interval.
NOT_YET_BACKOFF_S = 10.0
NOT_YET_TIMEOUT_S = 0.2
# A port whose engine answered before and then failed a scrape (a /metrics slow past the timeout
# under load, a restart) is tried again at the rate, then twice as long after each failure in a
# row, up to NOT_AN_ENGINE_BACKOFF_S: thirty seconds without its gauges for one slow answer would
# leave every zombie of that time to its spans alone.
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux's
# An engine that has held no request (nothing running or waiting) and seen no client leave for
# QUIET_AFTER_S is scraped every QUIET_INTERVAL_S until a scrape shows a request or a client leaves
# it (``activity``): an idle engine's scrapes cost CPU for nothing. Each port on its own, so the idle
# engines of a host with several are not scraped at the rate of its busy one. The first second of a
# request that comes to a quiet engine is read at that coarser step; a disconnect is scraped at once.
QUIET_AFTER_S = 10.0
QUIET_INTERVAL_S = 1.0
IDLE_RECHECK_S = 2.0  # with no engine to scrape, how soon a newly watched port is tried
# How long after a client left a port (``activity``), or a verdict asked (``want_clients``), its
# scrapes list the clients connected: a read of the eBPF probe's table of them, or without it a
# walk of the kernel's established hash (about a millisecond a round on a host of 262,144 buckets,
# whatever the ports hold).
LIST_CLIENTS_FOR_S = 2.0
MAX_PAGE_BYTES = 4 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024


_WANTED = tuple(dict.fromkeys(tuple(name for entry in KNOWN_METRICS for name in entry[1:]) + tuple(
    counter for counter, _, _ in ABORT_COUNTERS.values()) + tuple(
    counter for counter, _, _ in FINISH_COUNTERS.values()) + tuple(FINISH_SECONDS.values()) + tuple(
    name for names in STEP_SERIES.values() for name in names)))
_ABORT_NAMES = {counter: (label, value) for counter, label, value in ABORT_COUNTERS.values()}
_FINISH_NAMES = {counter: (label, value) for counter, label, value in FINISH_COUNTERS.values()}
_FINISHED = "finished:"  # the key of a finish counter's sum in ``_values`` (its name may be an abort counter's)
# The sample names to ask a prometheus_client server for (``name[]``): counters as ``_total``.
_SAMPLE_NAMES = tuple(dict.fromkeys(
    name for style, running, waiting, tokens in KNOWN_METRICS
    for name in (running, waiting, f"{tokens}_total")
    + ((f"{ABORT_COUNTERS[style][0]}_total",) if style in ABORT_COUNTERS else ())
    + ((f"{FINISH_COUNTERS[style][0]}_total",) if style in FINISH_COUNTERS else ())
    + ((f"{FINISH_SECONDS[style]}_total",) if style in FINISH_SECONDS else ())
    + tuple(name if name in _STEP_GAUGES else f"{name}_total" for name in STEP_SERIES.get(style, ()))))


def filtered_path(path: str) -> str:
    """``path`` asking a prometheus_client server for the known series only."""
    query = "&".join(f"name%5B%5D={quote(name, safe=':')}" for name in _SAMPLE_NAMES)
    return f"{path}{'&' if '?' in path else '?'}{query}"


_SERIES = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ESCAPE = re.compile(r"\\(.)")


def known_series(text: str, names: tuple[str, ...] = _WANTED) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of the known gauges and counters, in the
    Prometheus text format. An engine's page is mostly histograms the daemon never reads: only
    lines of known names are parsed, here rather than by prometheus_client's parser, which at a few
    scrapes a second cost more than everything else the scrape does. A known line that does not
    parse raises ValueError (the scraper counts it). ``names``: only lines that begin with these."""
    for line in _known_lines(text, names):
        match = _SERIES.fullmatch(line)
        if match is None:
            raise ValueError(f"unreadable series line: {line[:120]!r}")
        name, label_text, value = match.groups()
        labels: dict[str, str] = {}
        if label_text:
            position = 0
            for label in _LABEL.finditer(label_text):
                if label.start() != position:
                    break
                labels[label.group(1)] = _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), label.group(2))
                position = label.end()
            if label_text[position:].strip():
                raise ValueError(f"unreadable labels: {line[:120]!r}")
        yield name, labels, float(value)


def _known_lines(text: str, names: tuple[str, ...]) -> list[str]:
    """The lines that begin with one of ``names``, in page order. Each name is searched for (a
    scan in C) rather than every line split off and tested: a vLLM's page is 2,000 lines of
    histograms, and splitting them cost more than everything else the scrape does."""
    found: dict[int, str] = {}
    for name in names:
        at = text.find(name)
        while at != -1:
            if (at == 0 or text[at - 1] == "\n") and at not in found:
                end = text.find("\n", at)
                found[at] = (text[at:] if end == -1 else text[at:end]).removesuffix("\r")
            at = text.find(name, at + len(name))
    return [found[at] for at in sorted(found)]


_STYLES = {entry[0]: entry for entry in KNOWN_METRICS}  # style -> its KNOWN_METRICS entry


def parse_load(text: str, *, ts_ns: int, server_port: int) -> EngineLoad | None:
    """The engine load in a /metrics page, or None when no known running gauge is there.

    Several series of one gauge (one per model, or per label) add up. The first engine in
    ``KNOWN_METRICS`` whose running gauge the page has is the one read, and only its series."""
    found = _engine_values(text)
    if found is None:
        return None
    style, values = found
    _, running, waiting, tokens = _STYLES[style]
    abort_counter = ABORT_COUNTERS.get(style)
    unlisted = 0.0 if style in LISTED_ONCE_COUNTED else None
    aborted = values.get(abort_counter[0], unlisted) if abort_counter else None
    steps = [values[name] for name in STEP_SERIES.get(style, ()) if name in values]
    finish_counter = FINISH_COUNTERS.get(style)
    return EngineLoad(ts_ns=ts_ns, server_port=server_port, running=int(values[running]),
                      waiting=int(values.get(waiting, 0.0)), generated_tokens=values.get(tokens),
                      style=style, aborted=aborted, step_tokens=sum(steps) if steps else None,
                      model=_served_model(text, running),
                      finished=values.get(_FINISHED + finish_counter[0], unlisted) if finish_counter else None,
                      finished_seconds=values.get(FINISH_SECONDS[style]) if style in FINISH_SECONDS else None)


def _served_model(text: str, running: str) -> str | None:
    """The model the running gauge's series name (``model_name``, vLLM's and SGLang's label), when
    they name exactly one: vLLM's ``llm_request`` span carries no model, and an HTTP span none."""
    models = {labels.get(MODEL_LABEL) for name, labels, _ in known_series(text, (running,)) if name == running}
    if len(models) != 1:
        return None
    model = models.pop()
    return model[:MAX_MODEL_CHARS] if model else None


def page_series(text: str) -> tuple[str, frozenset[str]] | None:
    """Whose page it is and which of that engine's known series it has, or None."""
    found = _engine_values(text)
    return None if found is None else (found[0], frozenset(found[1]))


def _engine_values(text: str) -> tuple[str, dict[str, float]] | None:
    for style, running, waiting, tokens in KNOWN_METRICS:
        if running not in text:  # no series of this engine's (a scan that stops at the first)
            continue
        counters = dict.fromkeys(counter[0] for counter in (ABORT_COUNTERS.get(style), FINISH_COUNTERS.get(style))
                                 if counter)
        seconds = (FINISH_SECONDS[style],) if style in FINISH_SECONDS else ()
        values = _values(text, (running, waiting, tokens, *counters, *seconds, *STEP_SERIES.get(style, ())))
        if running in values:  # else the name was only in a comment, a label, or another series' name
            return style, values
    return None


def _values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sum of each named gauge's or counter's series (an abort counter's matching ones; a
    finish counter's others, under ``_FINISHED`` and its name)."""
    values: dict[str, float] = {}
    for sample_name, labels, value in known_series(text, names):
        if sample_name.endswith(("_created", "_bucket", "_count", "_sum")) and sample_name not in names:
            continue
        name = sample_name.removesuffix("_total")
        if name in _FINISH_NAMES:
            label, left_out = _FINISH_NAMES[name]
            if label is None or labels.get(label) != left_out:
                values[_FINISHED + name] = values.get(_FINISHED + name, 0.0) + value
            else:
                values.setdefault(_FINISHED + name, 0.0)  # the engine counts finishes, none yet
        if name in _ABORT_NAMES:
            label, wanted = _ABORT_NAMES[name]
            values.setdefault(name, 0.0)  # the engine counts aborts, none of them yet
            if label is not None and labels.get(label) != wanted:
                continue
        values[name] = values.get(name, 0.0) + value
    return values


class NoPage(OSError):
    """The server answered the metrics path with a status that says it has no such page (4xx)."""


def summed(loads: list[EngineLoad], addresses: tuple[str, ...]) -> EngineLoad:
    """The gauges of the engines that serve one port (containers, each in a network of its own, at
    ``addresses``), as of one engine: each count summed, a series one of them lacks lacking, one
    model where all name it; the window from the first request sent to the last answer (each
    engine's moment is within it); and each one's running count by its address. Engines of
    different kinds (their metric names) are not summed: OSError."""
    first = loads[0]
    if any(load.style != first.style for load in loads):
        raise OSError(f"engines of different kinds on port {first.server_port}: "
                      f"{', '.join(sorted({load.style for load in loads}))}")

    def total(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return sum(present) if len(present) == len(values) else None

    models = {load.model for load in loads}
    return EngineLoad(ts_ns=min(load.ts_ns for load in loads), server_port=first.server_port,
                      running=sum(load.running for load in loads), waiting=sum(load.waiting for load in loads),
                      generated_tokens=total([load.generated_tokens for load in loads]),
                      step_tokens=total([load.step_tokens for load in loads]),
                      model=models.pop() if len(models) == 1 else None, style=first.style,
                      aborted=total([load.aborted for load in loads]),
                      finished=total([load.finished for load in loads]),
                      finished_seconds=total([load.finished_seconds for load in loads]),
                      answered_ns=max(load.answered_ns or load.ts_ns for load in loads),
                      running_by_address=tuple((address, load.running) for address, load in zip(addresses, loads,
                                                                                                 strict=True)))


class PageConnection:
    """One kept-alive HTTP/1.1 connection that GETs one path: status, body, and whether the
    connection may be used again. http.client parses each answer's headers with the email
    package, which cost most of a scrape; a metrics answer needs its status line, its length
    (Content-Length, chunked, or up to the close) and Connection.

    Every read first asks the kernel to acknowledge at once (``TCP_QUICKACK``, which does not
    stick). A Starlette app under uvicorn writes an answer's headers and its body apart, and on a
    socket its server bound itself (as vLLM's does, and the reference engine's) asyncio leaves
    Nagle on: it sets ``TCP_NODELAY`` only on sockets made with the TCP protocol number. Nagle then
    holds the body until the headers are acknowledged, and Linux delays that acknowledgement by
    40 ms when the connection looks interactive (a request sent soon after an answer): a GET right
    after another, as an engine's first scrape makes (its whole page, then the short one), waited
    44 ms for its body. Scrapes 50 ms or more apart were not delayed (docs/footprint.md). A server
    with Nagle off answers as fast either way; the option costs one system call a read."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        address, local_port = self._sock.getsockname()[:2]
        # This end's address and port, the server's port and address (as the probes' OwnEnd).
        self.end: tuple[str, int, int, str] = (address, local_port, port, self._sock.getpeername()[0])
        self._host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 literal in brackets
        self._requests: dict[str, bytes] = {}
        self._buffer = bytearray()

    def _request(self, path: str) -> bytes:
        request = self._requests.get(path)
        if request is None:
            request = self._requests[path] = (
                f"GET {path} HTTP/1.1\r\nHost: {self._host_header}\r\nAccept: text/plain\r\n"
                "User-Agent: zombie-auditor\r\n\r\n").encode()
        return request

    def close(self) -> None:
        self._sock.close()

    def set_timeout(self, timeout_s: float) -> None:
        self._sock.settimeout(timeout_s)

    def get(self, path: str) -> tuple[int, bytes, bool]:
        self._buffer.clear()
        self._sock.sendall(self._request(path))
        head = self._until(b"\r\n\r\n", MAX_HEAD_BYTES).decode("latin-1").split("\r\n")
        version, _, rest = head[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise OSError(f"not an HTTP answer: {head[0][:60]!r}")
        headers = {}
        for line in head[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip().lower()
        keep_alive = version == "HTTP/1.1" and headers.get("connection") != "close"
        if "chunked" in headers.get("transfer-encoding", ""):
            body = self._chunked()
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if not 0 <= length <= MAX_PAGE_BYTES:
                raise OSError(f"page of {length} bytes (at most {MAX_PAGE_BYTES})")
            body = self._exactly(length)
        else:
            body, keep_alive = self._to_close(), False
        return int(rest[:3]), body, keep_alive

    def _fill(self) -> None:
        if _QUICKACK is not None:
            self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        data = self._sock.recv(65536)
        if not data:
            raise OSError("connection closed in the middle of an answer")
        self._buffer += data

    def _until(self, marker: bytes, limit: int) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            if len(self._buffer) > limit:
                raise OSError(f"no {marker!r} within {limit} bytes")
            self._fill()
        out = bytes(self._buffer[:end])
        del self._buffer[:end + len(marker)]
        return out

    def _exactly(self, length: int) -> bytes:
        while len(self._buffer) < length:
            self._fill()
        out = bytes(self._buffer[:length])
        del self._buffer[:length]
        return out

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size = int(self._until(b"\r\n", 1024).split(b";")[0].strip() or b"x", 16)
            if size == 0:
                while self._until(b"\r\n", MAX_HEAD_BYTES):  # trailer fields, up to an empty line
                    pass
                return b"".join(parts)
            total += size
            if total > MAX_PAGE_BYTES:
                raise OSError(f"page over {MAX_PAGE_BYTES} bytes")
            parts.append(self._exactly(size))
            if self._exactly(2) != b"\r\n":
                raise OSError("malformed chunk")

    def _to_close(self) -> bytes:
        while True:
            data = self._sock.recv(65536)
            if not data:
                return bytes(self._buffer)
            self._buffer += data
            if len(self._buffer) > MAX_PAGE_BYTES:
                raise OSError(f"page over {MAX_PAGE_BYTES} bytes")


class EngineMetricsScraper:
    """Scrapes ``http://HOST:PORT/metrics`` for every watched port every ``interval_s``, in a thread.

    ``sink`` receives each round's loads; it must not block. Failures are counted and logged once
    per port, never raised. ``on_connections`` is told (local address, local port, server port,
    server address) of every connection the scraper holds open, whenever that changes: they are
    the auditor's own, on the watched ports, and a disconnect source that polls leaves them out."""

    def __init__(self, ports: Callable[[], Iterable[int]], sink: Callable[[list[EngineLoad]], None], *,
                 interval_s: float = 0.25, host: str = "127.0.0.1", path: str = "/metrics",
                 timeout_s: float = 1.0, clock: Callable[[], int] = time.time_ns, filtered: bool = True,
                 quiet_after_s: float = QUIET_AFTER_S, quiet_interval_s: float = QUIET_INTERVAL_S,
                 on_connections: Callable[[frozenset[tuple[str, int, int, str]]], None] | None = None,
                 listed_clients: Callable[[Iterable[int]], dict[int, tuple[ListedClient, ...]] | None]
                 | None = None, accepted: Callable[[], int | None] | None = None,
                 listing_complete: Callable[[int], bool | None] | None = None,
                 list_while_busy: bool = False,
                 addresses_of: Callable[[int], tuple[str, ...]] | None = None,
                 sends_spans: Callable[[int, str, int], bool] | None = None,
                 listening: Callable[[int, str], frozenset[int] | None] | None = None) -> None:
        self.ports = ports
        # The address of each port's engine, asked at each scrape (``host`` without it): a
        # container's engine on a network of its own is not on this namespace's loopback; a port
        # several containers serve has one engine at each of theirs.
        self.addresses_of = addresses_of
        # Whether spans on a port that began at a time or later came from an address (the
        # correlator's word): a server there that is no engine can be left out of the port's gauges
        # only if none did (``scrape``).
        self.sends_spans = sends_spans
        # The LISTEN sockets of a port's server at an address (``addresses_of``'s latest look; None
        # where not known), and per (port, address) those seen last: (sockets, wall-clock ns from
        # which spans from there are the server's). Other sockets there: a new server
        # (``_note_servers``).
        self.listening = listening
        self._servers: dict[tuple[int, str], tuple[frozenset[int], int]] = {}
        # Of a port several containers serve, the servers that answered as no engine does, and
        # until when (monotonic) they are left out: (port, address) -> until.
        self._not_engines: dict[tuple[int, str], float] = {}
        self._engines_at: set[tuple[int, str]] = set()  # (port, address) of those that answered as engines
        self._not_yet: dict[tuple[int, str], tuple[float, int]] = {}  # -> (asked again from, failures)
        self._opening_timeout_s: float | None = None  # a connection opened now waits this, not timeout_s
        self.left_out: dict[int, frozenset[str]] = {}  # port -> those left out at its latest scrape
        self.listed_clients = listed_clients
        self.accepted = accepted
        self.listing_complete = listing_complete
        # List the clients with every scrape of a port whose engine held requests at its last, not
        # only once the daemon has heard a client left: it hears of a lone close up to the probe
        # loop's poll later (0.25 s), and the scrapes in between, unlisted, say nothing of that
        # client's work. For a lister that reads a table (the eBPF probe's, about 50 us), not one
        # that walks the kernel's sockets.
        self.list_while_busy = list_while_busy
        self._holding: set[int] = set()  # ports whose last scrape showed requests held
        self.on_connections = on_connections
        self.sink = sink
        self.interval_s = interval_s
        self.host = host
        self.path = path
        self.timeout_s = timeout_s
        self.clock = clock
        self.errors = 0
        # Each port's scrapes by outcome (``outcomes``): ``read`` (gauges for the port),
        # ``failed`` (no answer, not HTTP, an error status, or one of a shared port's engines so),
        # ``no_engine`` (a page without an engine's known metric). Changed and read under ``_lock``.
        self._outcomes: dict[tuple[int, str], int] = {}
        # Each port's listings of its clients made with a scrape, by whether none can be missing
        # (``listings``). Changed and read under ``_lock``.
        self._listings: dict[tuple[int, bool], int] = {}
        self._skip_until: dict[int, float] = {}
        self._answered: set[int] = set()  # ports whose engine answered a scrape once
        self._failed: dict[int, int] = {}  # port -> its scrapes failed in a row
        self._connections: dict[tuple[int, str], PageConnection] = {}  # (port, address) -> its connection
        self._ends: set[tuple[str, int, int, str]] = set()  # the connections open now (see on_connections)
        self._end_hosts: dict[tuple[str, int], set[str]] = {}  # their (address, port) -> the engines' addresses
        # Per port: until when (monotonic) its scrapes list the clients connected (``want_clients``).
        self._list_until: dict[int, float] = {}
        self._filtered_path = filtered_path(path)
        # Per port: whether its engine answers the filtered path with every series it has (None:
        # not known yet, read both ways at its next scrape). ``filtered=False``: never asked.
        self._ask_filtered = filtered
        self.filters: dict[tuple[int, str], bool] = {}  # by (port, address): each engine of a shared port
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop(), ports_changed() and activity() while quiet
        self.quiet_after_s = quiet_after_s
        self.quiet_interval_s = max(quiet_interval_s, interval_s)
        # Per port: the last scrape that showed a request held (or failed), or a client leaving;
        # and when it is scraped next (a port not in it: at once).
        self._active_at: dict[int, float] = {}
        self._stepped: dict[int, tuple[float, float]] = {}  # port -> (its step count, when it last moved)
        self._next_at: dict[int, float] = {}
        self._lock = threading.Lock()  # the two above: the loop schedules, departures wake
        self._thread: threading.Thread | None = None

    def scrape(self, port: int) -> EngineLoad | None:
        """The port's engine's gauges; of a port several containers serve (``addresses_of``
        names each), their sum, as of one engine serving the port: the correlator reads it
        against every client connected to the port. Only a round in which every engine answered
        gives one: without one's requests the sum would show the others' orphans gone.

        A server there that answers as no engine does (a page without a known metric, or 4xx: a
        web app, another kind of model server on the same port number) is left out, asked again
        after NOT_AN_ENGINE_BACKOFF_S, and its clients left out of the port's listings by their
        server's address (``scrape_all``), so the sum and the clients are of the same servers;
        so is one that fails (no answer in time, refused, 5xx) and has never answered as an
        engine (a pod whose engine is still loading: it runs nothing the rounds before it counted),
        asked again after up to NOT_YET_BACKOFF_S. Not while spans on the port come from its
        address (``sends_spans``): their requests are among those the correlator counts
        connected, and the port then gives no reading. One that answered as an engine before and
        fails now costs the round, as before, unless it listens on other sockets now: another
        process, a container restarted in its pod (``_note_servers``)."""
        addresses = self.addresses_of(port) if self.addresses_of is not None else (self.host,)
        self._forget_gone(port, addresses)
        if len(addresses) == 1:
            self.left_out.pop(port, None)
            return self._scrape_at(port, addresses[0])
        now = time.monotonic()
        self._note_servers(port, addresses)
        loads, engines, others = [], [], []
        for address in addresses:
            target = (port, address)
            if self._not_engines.get(target, 0.0) <= now and self._not_yet.get(target, (0.0, 0))[0] <= now:
                load, why = self._scrape_shared(target, now)
                if load is not None:
                    loads.append(load)
                    engines.append(address)
                    continue
                if why is not None:  # answered as no engine does
                    if target not in self._not_engines:
                        log.info("port %d: the server at %s answered its %s with %s: no engine; left out of the "
                                 "port's gauges and listings while no span on the port comes from it (asked "
                                 "again every %.0f s)", port, address, self.path, why, NOT_AN_ENGINE_BACKOFF_S)
                    self._not_engines[target] = now + NOT_AN_ENGINE_BACKOFF_S
                    self._not_yet.pop(target, None)
            since_ns = self._servers.get(target, (frozenset(), 0))[1]
            if self.sends_spans is None or self.sends_spans(port, address, since_ns):
                state = "has not answered yet" if target in self._not_yet else "answered as no engine does"
                raise OSError(f"the server at {address} {state}, and spans on port {port} came from its address")
            others.append(address)
        if not loads:
            self.left_out.pop(port, None)
            return None
        self.left_out[port] = frozenset(others)
        return summed(loads, tuple(engines))

    def _note_servers(self, port: int, addresses: tuple[str, ...]) -> None:
        """A server at an address whose LISTEN sockets changed is another server process (a
        container restarted in its pod, which keeps the pod's address; its engine then loads its
        model for minutes): what was learnt of the one before is forgotten, and only spans that
        began once its sockets were seen count as its. Else an engine that crashed and reloads,
        having answered and sent spans before, left the port without readings for the whole load.
        Its sockets are seen within ``addresses_of``'s refresh of its start (10 s): the namespace's
        tables are read again when its count of sockets or its processes change. A server that
        serves requests with spans from its start, answering as no engine does, is held in again
        by its first span begun since."""
        if self.listening is None:
            return
        for address in addresses:
            target = (port, address)
            sockets = self.listening(port, address)
            if sockets is None:
                continue
            known = self._servers.get(target)
            if known is None:
                self._servers[target] = (sockets, 0)  # any span from there, ever, is its
            elif known[0] != sockets:
                log.info("port %d: the server at %s listens on other sockets: another process, asked afresh",
                         port, address)
                self._engines_at.discard(target)
                self._not_engines.pop(target, None)
                self._not_yet.pop(target, None)
                self._servers[target] = (sockets, time.time_ns())

    def _forget_gone(self, port: int, addresses: tuple[str, ...]) -> None:
        """Forget what was learnt of servers no longer on ``port`` (a pod gone, or moved): one back
        at that address later is asked afresh."""
        if not (self._not_engines or self._not_yet or self._engines_at):  # one engine a port: nothing kept
            return
        for table in (self._not_engines, self._not_yet):
            for gone in [key for key in table if key[0] == port and key[1] not in addresses]:
                del table[gone]
        self._engines_at -= {key for key in self._engines_at if key[0] == port and key[1] not in addresses}

    def _scrape_shared(self, target: tuple[int, str], now: float) -> tuple[EngineLoad | None, str | None]:
        """One engine's scrape on a port several containers serve: (its load, None), or (None, why)
        where it answered as no engine does, or (None, None) where it has never answered as an
        engine and fails now (asked again after up to NOT_YET_BACKOFF_S, over a connection that
        waits NOT_YET_TIMEOUT_S: an engine still loading its model accepts and never answers, and
        the port's other engines' round should not wait on it). One that answered as an engine
        before and fails now raises: the round has no reading."""
        port, address = target
        if target not in self._engines_at:  # a connection opened now waits less (``_open``)
            self._opening_timeout_s = min(NOT_YET_TIMEOUT_S, self.timeout_s)
        try:
            load = self._scrape_at(port, address)
        except NoPage as exc:
            return None, str(exc)
        except OSError as exc:
            if target in self._engines_at:
                raise
            failures = self._not_yet.get(target, (0.0, 0))[1] + 1
            self._not_yet[target] = (now + min(NOT_YET_BACKOFF_S, self.interval_s * 2 ** (failures - 1)), failures)
            if failures == 1:
                log.info("port %d: the server at %s has not answered its %s yet (%s): left out of the port's gauges "
                         "and listings until it does, while no span on the port comes from it", port, address,
                         self.path, exc)
            return None, None
        finally:
            self._opening_timeout_s = None
        if load is None:
            return None, "no known metric"
        self._not_engines.pop(target, None)
        self._not_yet.pop(target, None)
        if target not in self._engines_at:
            self._engines_at.add(target)
            connection = self._connections.get(target)
            if connection is not None:
                connection.set_timeout(self.timeout_s)  # opened waiting NOT_YET_TIMEOUT_S
        return load, None

    def _scrape_at(self, port: int, address: str) -> EngineLoad | None:
        # The gauges describe the engine at one moment between the request and its answer; both
        # ends are kept so a request that started or ended in between is never taken for an orphan.
        ts_ns = self.clock()
        target = (port, address)
        filters = self.filters.get(target)
        if filters:
            try:
                load = parse_load(self._fetch(target, self._filtered_path), ts_ns=ts_ns, server_port=port)
            except (OSError, ValueError):
                load = None
            if load is not None:
                return replace(load, answered_ns=max(ts_ns, self.clock()))
            del self.filters[target]  # the short page failed: the whole page, and ask again next time
            ts_ns = self.clock()
        text = self._fetch(target, self.path)
        load = parse_load(text, ts_ns=ts_ns, server_port=port)
        if load is None:
            return None
        load = replace(load, answered_ns=max(ts_ns, self.clock()))
        if filters is None and self._ask_filtered:
            self.filters[target] = self._filters_alike(target, text)
        return load

    def _connected(self, ports: Iterable[int]) -> dict[int, tuple[ListedClient, ...]]:
        """The clients connected to each of ``ports`` now, but this scraper, each with when the
        server last read data from it (``EngineLoad.connections``), from ``listed_clients`` (the
        eBPF probe's table, about 50 us; or the /proc source's poll, made at once: a sock_diag
        walk of the kernel's established hash, about a millisecond on a host of 262,144 buckets,
        that stands for the poller's next); nothing where it cannot tell. This scraper's own
        connections are told by their engine's address too: one of them and a client of another
        engine on the port (a pod of the node) may have the same address and port."""
        found = self.listed_clients(ports) if self.listed_clients is not None else None
        if found is None:
            return {}
        own = self._end_hosts

        def is_own(client: ListedClient) -> bool:
            hosts = own.get((client[0], client[1]))
            return hosts is not None and (not client[3] or client[3].removeprefix("::ffff:") in hosts)

        return {port: tuple(c for c in clients if not is_own(c)) for port, clients in found.items()}

    def _accepts_now(self) -> int | None:
        """The clients accepted so far (``accepted``: the eBPF probe's count for the watched ports,
        or this network namespace's for every port); None when it cannot be read (every listing
        is then taken as complete)."""
        return self.accepted() if self.accepted is not None else None

    def _filters_alike(self, target: tuple[int, str], whole: str) -> bool:
        """Whether the engine's filtered page has the same engine's same series as its whole page."""
        try:
            short = page_series(self._fetch(target, self._filtered_path))
        except (OSError, ValueError):
            return False
        return short is not None and short == page_series(whole)

    def _fetch(self, target: tuple[int, str], path: str) -> str:
        """The page of the engine at ``target`` (port, address), over its kept-alive connection; a
        stale one is replaced once."""
        for attempt in (0, 1):
            reused = target in self._connections
            connection = self._connections.pop(target, None) or self._open(target)
            try:
                status, body, keep_alive = connection.get(path)
                if status != 200:
                    raise (NoPage if 400 <= status < 500 else OSError)(f"HTTP {status}")
            except Exception:
                self._close(connection)
                if reused and attempt == 0:
                    continue  # the engine closed the idle connection: one fresh try
                raise
            if keep_alive:
                self._connections[target] = connection
            else:
                self._close(connection)
            return body.decode("utf-8", errors="replace")
        raise AssertionError("unreachable")

    def _open(self, target: tuple[int, str]) -> PageConnection:
        port, host = target
        connection = PageConnection(host, port, self._opening_timeout_s or self.timeout_s)
        self._ends.add(connection.end)
        self._end_hosts.setdefault(connection.end[:2], set()).add(connection.end[3])
        self._tell_connections()
        return connection

    def _close(self, connection: PageConnection) -> None:
        connection.close()
        self._ends.discard(connection.end)
        hosts = self._end_hosts.get(connection.end[:2], set())
        hosts.discard(connection.end[3])
        if not hosts:
            self._end_hosts.pop(connection.end[:2], None)
        self._tell_connections()

    def _tell_connections(self) -> None:
        if self.on_connections is not None:
            self.on_connections(frozenset(self._ends))

    def close(self) -> None:
        for connection in list(self._connections.values()):
            self._close(connection)
        self._connections.clear()

    def scrape_all(self, ports: Iterable[int] | None = None) -> list[EngineLoad]:
        """A scrape of each of ``ports`` (every watched port by default) not in its back-off."""
        loads = []
        now = time.monotonic()
        wanted = sorted(set(self.ports() if ports is None else ports))
        with self._lock:
            listing = [port for port in wanted
                       if self._list_until.get(port, -math.inf) > now and self._skip_until.get(port, 0.0) <= now]
        busy_only = {port for port in wanted if port in self._holding and port not in listing
                     and self._skip_until.get(port, 0.0) <= now} if self.list_while_busy else set()
        listing += sorted(busy_only)
        # A client accepted between the listing and a scrape's answer may be among the requests the
        # gauges hold and not among the clients listed: a count of accepts (``_accepts_now``)
        # before and after says whether any was; if so the scrape's listing is incomplete, unless
        # ``listing_complete`` (the /proc source, whose count is every port's) finds none on its port.
        accepts = self._accepts_now() if listing else None
        walked = self._connected(listing) if listing else {}
        for port in wanted:
            if self._skip_until.get(port, 0.0) > now:
                continue
            try:
                load = self.scrape(port)
            except Exception as exc:  # a port that is down or not HTTP: try again later
                self.errors += 1
                self._count(port, "failed")
                self._forget_filters(port)  # whatever answers next is asked both ways again
                failed = self._failed[port] = self._failed.get(port, 0) + 1
                backoff = (min(NOT_AN_ENGINE_BACKOFF_S, self.interval_s * 2 ** (failed - 1))
                           if port in self._answered else NOT_AN_ENGINE_BACKOFF_S)
                if port not in self._skip_until:
                    if port in self._answered:
                        log.info("engine metrics on port %d failed (%s); retrying in %.2g s, then less often "
                                 "while it fails (up to every %.0f s)", port, exc, backoff, NOT_AN_ENGINE_BACKOFF_S)
                    else:
                        log.info("no engine metrics on port %d (%s); retrying every %.0f s", port, exc,
                                 NOT_AN_ENGINE_BACKOFF_S)
                self._skip_until[port] = now + backoff
                continue
            if load is None:
                self._count(port, "no_engine")
                self._forget_filters(port)
                self._skip_until[port] = now + NOT_AN_ENGINE_BACKOFF_S
                continue
            self._count(port, "read")
            self._skip_until.pop(port, None)
            self._failed.pop(port, None)
            self._answered.add(port)
            if load.running or load.waiting:
                self._holding.add(port)
            else:
                self._holding.discard(port)
            if port in walked:
                after = self._accepts_now() if accepts is not None else None
                complete = after in (None, accepts)
                if not complete and self.listing_complete is not None:
                    complete = self.listing_complete(port) is True  # accepted elsewhere, not on this port
                with self._lock:
                    self._listings[(port, complete)] = self._listings.get((port, complete), 0) + 1
                clients, left_out = walked[port], self.left_out.get(port)
                if left_out:  # the clients of servers left out of the gauges (``scrape``)
                    clients = tuple(c for c in clients if c[3].removeprefix("::ffff:") not in left_out)
                load = replace(load, connections=clients, connections_complete=complete,
                               listed_while_busy=port in busy_only)
            loads.append(load)
        return loads

    def _count(self, port: int, outcome: str) -> None:
        with self._lock:
            key = (port, outcome)
            self._outcomes[key] = self._outcomes.get(key, 0) + 1

    def outcomes(self) -> dict[tuple[int, str], int]:
        """Scrapes so far by (port, outcome): ``read``, ``failed``, ``no_engine``. A port whose
        scrapes are never ``read`` gives no gauges: an abort its engine sends no span for (vLLM)
        stays unconfirmed there."""
        with self._lock:
            return dict(self._outcomes)

    def listings(self) -> dict[tuple[int, bool], int]:
        """Listings of the clients connected so far by (port, complete): only a complete one counts
        the port's orphans (``EngineLoad.connections_complete``). A port listed incompletely scrape
        after scrape (one that accepts connections all the time, where its accepts cannot be told
        from other ports': a container's with the /proc source) has its orphans counted seldom."""
        with self._lock:
            return dict(self._listings)

    def _forget_filters(self, port: int) -> None:
        for target in [target for target in self.filters if target[0] == port]:
            del self.filters[target]

    def start(self) -> EngineMetricsScraper:
        self._thread = threading.Thread(target=self._loop, name="engine-metrics", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            ports = set(self.ports())
            with self._lock:
                for gone in set(self._next_at) - ports:
                    self._next_at.pop(gone)
                    self._active_at.pop(gone, None)
                    self._stepped.pop(gone, None)
                    self._list_until.pop(gone, None)
                    self._holding.discard(gone)
                    self._answered.discard(gone)
                    self._failed.pop(gone, None)
            due = sorted(port for port in ports if self._next_at.get(port, now) <= now)
            try:
                loads = self.scrape_all(due)
                if loads:
                    self.sink(loads)
            except Exception:
                loads = []
                log.exception("engine metrics round failed; continuing")
            self._schedule(due, {load.server_port: load for load in loads}, now)
            # A port in its back-off (not an engine) waits until its retry; the loop looks again
            # within IDLE_RECHECK_S whatever it waits for. Missed ticks are skipped, not burst.
            waits = [max(self._next_at[port], self._skip_until.get(port, 0.0)) for port in ports]
            delay = min([*waits, now + IDLE_RECHECK_S]) - time.monotonic()
            if self._wake.wait(max(0.0, delay)):  # woken early: new ports, a departure, or stop
                self._wake.clear()
        self.close()

    def _schedule(self, scraped: list[int], loads: dict[int, EngineLoad], began: float) -> None:
        """Each scraped port's next scrape: at the rate, or the quiet rate once its engine has held
        nothing for ``quiet_after_s`` (a port whose scrape failed counts as busy: its back-off
        decides when it is tried again)."""
        now = time.monotonic()
        with self._lock:
            for port in scraped:
                load = loads.get(port)
                still = load is not None and self._stood_still(port, load, now)
                if load is None or ((load.running or load.waiting) and not still):
                    self._active_at[port] = now
                active_at = self._active_at.setdefault(port, now)
                step = self.quiet_interval_s if now - active_at >= self.quiet_after_s else self.interval_s
                self._next_at[port] = max(self._next_at.get(port, began) + step, now)

    def _stood_still(self, port: int, load: EngineLoad, now: float) -> bool:
        """Whether the engine's step series (``EngineLoad.step_tokens``) have not moved for its
        STEP_STILL_NS: its gauges then hold requests no step runs (vLLM's after a batch aborted at
        once), and the port goes quiet as an idle one does, until a request makes it step again."""
        if load.step_tokens is None:
            return False
        seen = self._stepped.get(port)
        if seen is None or seen[0] != load.step_tokens or not (load.running or load.waiting):
            self._stepped[port] = (load.step_tokens, now)  # (holding nothing: nothing to go stale yet)
            return False
        return now - seen[1] >= STEP_STILL_NS.get(load.style, STEP_STILL_NS["vllm"]) / 1e9

    def quiet_ports(self) -> set[int]:
        """The watched ports scraped at the quiet rate now."""
        now = time.monotonic()
        return {port for port, active_at in list(self._active_at.items()) if now - active_at >= self.quiet_after_s}

    @property
    def quiet(self) -> bool:
        """Every watched port's engine quiet (none scraped at the rate)."""
        ports = set(self._active_at)
        return bool(ports) and self.quiet_ports() == ports

    def want_clients(self, ports: Iterable[int], seconds: float = LIST_CLIENTS_FOR_S) -> None:
        """List the clients connected to these ports with each of their scrapes for the next
        ``seconds``: the correlator reads the engines' gauges against them while it judges a
        disconnect there (``EngineLoads.work_end``)."""
        until = time.monotonic() + seconds
        with self._lock:
            for port in ports:
                self._list_until[port] = max(self._list_until.get(port, -math.inf), until)

    def activity(self, ports: Iterable[int] | None = None) -> None:
        """A client left these watched ports (every one by default): each is back to the scrape
        rate, and a quiet one is scraped at once (the scrapes after a disconnect tell whether its
        work stopped); their clients are listed with their scrapes for a while (``want_clients``)."""
        self.want_clients(set(self._next_at) if ports is None else ports)
        with self._lock:
            quiet = self.quiet_ports()
            now = time.monotonic()
            for port in set(self._next_at) if ports is None else set(ports) & set(self._next_at):
                self._active_at[port] = now
                if port in quiet:
                    self._next_at[port] = now
                    self._wake.set()

    def ports_changed(self) -> None:
        """Scrape at once: a newly watched port needs a scrape before its first disconnect, and the
        loop may be sleeping out every old port's back-off."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
