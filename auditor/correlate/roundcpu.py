"""The correlator thread's CPU by step of its rounds, for /metrics and the benches.

The thread's own total is on /metrics already (``auditor_thread_cpu_seconds_total``); what the
next question needs is which step of a round takes it: taking in spans, judging, writing verdicts.
Each step is timed with the thread's own clock (``time.thread_time_ns``: CPU, not waiting), a few
calls a round. The steps are fixed, so the dict a scrape copies never changes size.
"""

from __future__ import annotations

import time

# In the order a round runs them (auditor.daemon.Daemon.correlate_once, Correlator.tick).
STEPS = (
    "flush",     # the daemon's kernel events and samples written before the round reads them
    "spans",     # new spans read (or handed over by the writer) and indexed
    "events",    # new kernel events read
    "join",      # disconnects joined to spans, requests rekeyed, unjoined spans counted
    "judge",     # verdicts (re)computed
    "write",     # verdicts and coverage written
    "settle",    # settled requests let go, the restart position saved, memory pruned
    "upkeep",    # the daemon's completions, followed pids, the minute's utilization
)


class RoundCpu:
    """CPU nanoseconds by step: ``start()`` where a stretch begins, ``mark(step)`` where a step ends."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(STEPS, 0)
        self._at = time.thread_time_ns()

    def start(self) -> None:
        self._at = time.thread_time_ns()

    def mark(self, step: str) -> None:
        now = time.thread_time_ns()
        self.ns[step] += now - self._at
        self._at = now

    def seconds(self) -> dict[str, float]:
        """A copy, by step (safe from another thread: the keys never change)."""
        return {step: ns / 1e9 for step, ns in self.ns.items()}
