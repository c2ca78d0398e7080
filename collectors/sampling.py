"""The sampler interface and the loop that drives samplers at a fixed rate.

A sampler is anything with a ``name``, ``sample(ts_ns) -> list[UtilSample]`` and ``health()``.
The loop ticks on ``time.monotonic`` at ``start + k * interval`` (no drift from the time each tick
takes), skips ticks it missed instead of bursting to catch up, and isolates failures: a sampler
that raises is marked degraded and the others still run; a sink that fails (say a locked
database) loses that tick's samples, counted, and the loop goes on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from auditor.model import UtilSample

log = logging.getLogger(__name__)

# While every sampler says it has nothing to sample (``idle()``: no NVML, no process followed or
# every one quiet), the loop ticks this seldom, or at once when woken (``wake``: a process to
# follow): each wake-up costs CPU (most on a virtual machine) on a host with nothing to
# measure. A sample covers the time since the one before, so a quiet second is still counted.
IDLE_INTERVAL_S = 1.0
# Between busy ticks the loop sleeps (``time.sleep``) rather than waiting on its stop event: on a
# virtual machine a wake-up from an Event's timed wait cost 150 us of the thread's CPU at 100 ms
# against 112 for a sleep (bench/wakeup_cost.py), ten times a second. A stop is seen within this.
STOP_SEEN_WITHIN_S = 0.25

OK = "ok"


@runtime_checkable
class Sampler(Protocol):
    """A source of utilization samples, called once per tick from one thread."""

    name: str

    def sample(self, ts_ns: int) -> list[UtilSample]:
        """Samples for this instant (wall-clock ``ts_ns``); may return nothing (e.g. a first reading)."""
        ...

    def health(self) -> str:
        """``"ok"`` or ``"degraded: <reason>"``."""
        ...


class SamplingLoop:
    """Drives samplers every ``interval_s`` on their own thread and hands samples to ``sink``."""

    def __init__(self, samplers: Sequence[Sampler], sink: Callable[[Iterable[UtilSample]], object], *,
                 interval_s: float = 0.1, monotonic: Callable[[], float] = time.monotonic,
                 wall_clock_ns: Callable[[], int] = time.time_ns) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.samplers = list(samplers)
        self.sink = sink
        self.interval_s = interval_s
        self._monotonic = monotonic
        self._wall_clock_ns = wall_clock_ns
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by wake() and stop(): ends an idle wait
        self._thread: threading.Thread | None = None
        self._failures: dict[str, str] = {}
        self.ticks = 0
        self.skipped_ticks = 0
        self.samples_written = 0
        self.samples_lost = 0
        self._sink_error = ""

    def start(self) -> SamplingLoop:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="sampling-loop", daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        """A sampler has something to sample again (a process to follow): tick now, not after an idle wait."""
        self._wake.set()

    def idle(self) -> bool:
        """Whether every sampler says it has nothing to sample (those that cannot say are busy)."""
        return all(callable(getattr(sampler, "idle", None)) and sampler.idle()  # type: ignore[attr-defined]
                   for sampler in self.samplers)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None
        for sampler in self.samplers:
            close = getattr(sampler, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.debug("closing sampler %s failed", sampler.name, exc_info=True)

    def health(self) -> dict[str, str]:
        """Sampler name -> ``"ok"`` or ``"degraded: reason"``; the sink shows up as ``"sink"``."""
        states: dict[str, str] = {}
        for sampler in self.samplers:
            failure = self._failures.get(sampler.name)
            if failure:
                states[sampler.name] = f"degraded: {failure}"
                continue
            try:
                states[sampler.name] = sampler.health()
            except Exception as exc:
                states[sampler.name] = f"degraded: health check failed ({exc})"
        if self._sink_error:
            states["sink"] = f"degraded: {self._sink_error}"
        return states

    def run_once(self) -> list[UtilSample]:
        """One tick: every sampler, isolated from the others, then the sink."""
        ts_ns = self._wall_clock_ns()
        samples: list[UtilSample] = []
        for sampler in self.samplers:
            try:
                samples.extend(sampler.sample(ts_ns))
            except Exception as exc:
                if self._failures.get(sampler.name) != str(exc):
                    log.warning("sampler %s failed: %s", sampler.name, exc)
                self._failures[sampler.name] = f"{type(exc).__name__}: {exc}"
                continue
            self._failures.pop(sampler.name, None)
        self.ticks += 1
        if samples:
            try:
                self.sink(samples)
            except Exception as exc:
                self.samples_lost += len(samples)
                if self._sink_error != str(exc):
                    log.warning("could not store %d samples: %s", len(samples), exc)
                self._sink_error = str(exc)
            else:
                self.samples_written += len(samples)
                self._sink_error = ""
        return samples

    def _run(self) -> None:
        start = self._monotonic()
        tick = 0
        while not self._stop.is_set():
            self.run_once()
            tick += 1
            if self.idle():
                self._wake.wait(IDLE_INTERVAL_S)
                self._wake.clear()
                start, tick = self._monotonic(), 0  # a new schedule from the end of the idle wait
                continue
            now = self._monotonic()
            due = start + tick * self.interval_s
            if now > due:
                # Late (a slow sampler, a paused VM): skip the ticks already missed.
                behind = math.floor((now - due) / self.interval_s) + 1
                self.skipped_ticks += behind
                tick += behind
                due = start + tick * self.interval_s
            while not self._stop.is_set() and (left := due - self._monotonic()) > 0:
                time.sleep(min(left, STOP_SEEN_WITHIN_S))

    def stats(self) -> dict[str, int]:
        return {"ticks": self.ticks, "skipped_ticks": self.skipped_ticks,
                "samples_written": self.samples_written, "samples_lost": self.samples_lost}
