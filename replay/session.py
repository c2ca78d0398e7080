"""One replay, start to end, as a library call: the typed settings, the auditor pipeline it runs
beside the load (handed in by the caller, so this package never wires the daemon itself), and the
wait for final verdicts.

``auditor replay`` is a thin command over ``run_replay``; the demo calls it the same way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from auditor.errors import AuditorError
from auditor.store import Store
from replay.capture import Capture, CaptureError, check_writable, open_capture_store, read_capture
from replay.client import RequestPlan, run_load
from replay.run import (
    EngineLoad,
    ReplayOptions,
    ReplaySummary,
    left_early,
    plan_replay,
    record_run,
    resolve_baseline,
    settled,
)


class TargetError(AuditorError):
    """The replay target is not an http:// URL of this host."""


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    capture_file: Path
    host: str
    port: int
    options: ReplayOptions
    capture_id: int | None = None  # None: the newest capture in the file
    otlp_http: str = "127.0.0.1:4318"  # where the engine exports its spans
    otlp_grpc: str = ""
    settle_s: float = 60.0  # how long an engine span may follow its request's end
    span_delay_s: float = 5.0  # the engine exporter's batch delay
    wait_s: float = 120.0  # the longest wait for verdicts after the last request
    baseline: str | None = None  # a run id, "previous" or "capture"

    @property
    def target(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def pipeline_overrides(self) -> dict[str, Any]:
        """Configuration for the auditor pipeline that judges this replay (``auditor.config`` keys):
        it writes into the capture file and watches only the target's port."""
        return {
            "db": f"sqlite:///{self.capture_file.resolve()}", "probe.ports": [self.port],
            "otlp.http": self.otlp_http, "otlp.grpc": self.otlp_grpc, "metrics.listen": "",
            "live.listen": "", "correlate.interval_seconds": 0.25,
            "correlate.late_span_seconds": self.settle_s,
        }


class Pipeline(Protocol):
    """What replay needs of the auditor pipeline (``auditor.daemon.Daemon`` is one)."""

    store: Store
    host: str  # as its correlator keys what it has read

    @property
    def source_name(self) -> str: ...
    def engine_busy(self, port: int) -> float | None: ...
    def readings(self) -> Any: ...  # auditor.metrics.SourceReadings: spans_received, engine_scrapes
    def start(self) -> None: ...
    def correlate_once(self) -> Any: ...
    def request_stop(self) -> None: ...
    def stop(self) -> None: ...


class Progress(Protocol):
    def update(self, n: int) -> None: ...


ProgressFactory = Callable[[int, str], AbstractContextManager[Progress]]


class _Silent:
    def update(self, n: int) -> None:
        return None


@contextmanager
def silent_progress(_total: int, _label: str) -> Iterator[Progress]:
    yield _Silent()


def local_target(url: str) -> tuple[str, int]:
    """(host, port) of an http:// URL on this host: the probe sees only this host's sockets."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise TargetError(f"--target {url!r}: give the engine's URL on this host, like http://127.0.0.1:8000")
    try:
        port = 80 if parts.port is None else parts.port
        if port == 0:
            raise TargetError(f"--target {url!r}: port 0 is no engine's port; give the port it serves, "
                              "like http://127.0.0.1:8000")
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (ValueError, OSError) as exc:
        raise TargetError(f"--target {url!r}: {exc}") from exc
    for family, _type, _proto, _name, address in infos:
        ip = str(address[0])
        if ipaddress.ip_address(ip).is_loopback:
            return ip, port
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((ip, 0))  # only an address of this host can be bound
                return ip, port
            except OSError:
                continue
    raise TargetError(f"--target {url!r} is not on this host: run `auditor replay` on the engine's host, "
                      "where the probe can see the engine's connections")


def wait_for_verdicts(pipeline: Pipeline, cancelled: list[RequestPlan], started_ns: int, engine: EngineLoad,
                      timeout_s: float, span_delay_s: float, port: int = 0,
                      progress: ProgressFactory = silent_progress) -> tuple[str, bool]:
    """Wait until every request left early (``cancelled``: the cancels and the client's timeouts)
    has a final verdict; returns why the wait ended, and whether every verdict is final then.

    A verdict is final once its engine span arrived. An abort without one (vLLM emits none) stays
    provisional through the late-span window, because a detached engine reports only when it
    finishes; where the engine's /metrics shows it idle for ``span_delay_s`` (its exporter's batch
    delay), no span can still come, and the wait ends early. An engine that sent no span at all by
    then (llama.cpp's server, TGI) gives no verdicts: its port's gauges judge the run
    (``record_run``), and the wait ends there too.

    Idle is read from the pipeline's own scrapes of ``port`` where it makes them: a connection of
    replay's own to the engine would be a client the kernel lists connected, and would hide the
    work of a client gone from the port's count. ``engine`` reads the gauges where it does not."""
    deadline = time.monotonic() + timeout_s
    idle_since: float | None = None
    with progress(max(1, len(cancelled)), "  waiting for verdicts") as bar:
        shown = 0
        while time.monotonic() < deadline:
            judged, pending = settled(pipeline.store, cancelled, started_ns)
            bar.update(judged - pending - shown)
            shown = judged - pending
            busy = pipeline.engine_busy(port)
            readings = None  # the pipeline's figures, read at most once a turn (not cheap: every part's)
            if busy is None:
                readings = pipeline.readings()
                if not readings.engine_scrapes:
                    busy = engine.busy()  # the pipeline scrapes no engine here
            now = time.monotonic()
            idle_since = (idle_since or now) if busy == 0 else None
            idle = idle_since is not None and now - idle_since >= span_delay_s
            if judged == len(cancelled):
                if pending == 0:
                    return "every verdict final", True
                if idle:
                    return f"engine idle for {span_delay_s:g} s", True
            elif idle and not judged and not (readings or pipeline.readings()).spans_received:
                return f"engine idle for {span_delay_s:g} s, and no span came: judged by its port", True
            time.sleep(0.25)
    return f"--wait of {timeout_s:g} s passed", False


def run_replay(settings: ReplaySettings, make_pipeline: Callable[[dict[str, Any]], Pipeline], *,
               say: Callable[[str], None] = lambda _line: None,
               progress: ProgressFactory = silent_progress) -> tuple[ReplaySummary, Capture]:
    """Replay one capture against the engine at settings.host:port beside a pipeline built by
    ``make_pipeline(settings.pipeline_overrides())``; returns (summary, capture). Raises
    AuditorError when it cannot run."""
    store = open_capture_store(settings.capture_file)
    try:
        capture = read_capture(store, settings.capture_id)
        baseline = resolve_baseline(store, capture, settings.baseline, settings.options.limit)
    finally:
        store.close()
    if not capture.requests:
        raise CaptureError(f"capture {capture.id} in {settings.capture_file} has no requests")
    check_writable(settings.capture_file)  # before any traffic, not when the results are written
    plans = plan_replay(capture, settings.options, tag=f"replay-{time.strftime('%H%M%S')}")
    pipeline = make_pipeline(settings.pipeline_overrides())
    # Earlier runs' closes in the capture file are theirs, judged and recorded: were this run's
    # pipeline to read them (those a stopped run left unsettled), it would judge them again and
    # log their zombies a second time.
    store = open_capture_store(settings.capture_file)
    try:
        store.correlate_after_stored_events(pipeline.host)
    finally:
        store.close()
    pipeline.start()
    try:
        try:
            with socket.create_connection((settings.host, settings.port), timeout=5):
                pass
        except OSError as exc:
            raise CaptureError(f"cannot connect to {settings.target}: {exc}; is the engine up?") from exc
        say(f"replaying {len(plans)} requests to {settings.target} (disconnects via {pipeline.source_name}, "
            f"spans on {settings.otlp_http or settings.otlp_grpc})")
        started_ns = time.time_ns()
        with progress(len(plans), "  sending") as bar:
            outcomes = asyncio.run(run_load(settings.host, settings.port, plans,
                                            concurrency=settings.options.concurrency,
                                            timeout_s=settings.options.request_timeout_s,
                                            on_done=lambda _outcome: bar.update(1)))
        cancelled = left_early(outcomes)
        engine = EngineLoad(settings.host, settings.port)
        try:
            ended, final = wait_for_verdicts(pipeline, cancelled, started_ns, engine, settings.wait_s,
                                             settings.span_delay_s, settings.port, progress)
        finally:
            engine.close()
        say(f"  judged: {ended}")
        pipeline.correlate_once()
        gauges_read = any(outcome == "read" and scraped_port == settings.port
                          for (scraped_port, outcome), count in pipeline.readings().engine_scrapes.items() if count)
    finally:
        pipeline.request_stop()
        pipeline.stop()
    store = open_capture_store(settings.capture_file)
    try:
        summary = record_run(store, capture, settings.target, settings.options, started_ns, plans, outcomes,
                             baseline, final=final, port=settings.port, gauges_read=gauges_read)
    finally:
        store.close()
    return summary, capture
