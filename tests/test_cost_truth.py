"""The engine's record of what a request cost after its client left (the truth the auditor is held to).

A backend whose every step burns a known amount of the engine thread's CPU makes the figure
predictable: steps after the disconnect times the burn, divided by the requests in each step.
"""

from __future__ import annotations

import time

import pytest

from replay.engine.core import Engine, RequestHandle
from replay.engine.truth import truth_record
from tests.test_engine_core import Recorder

BURN_S = 0.004


class BurningBackend:
    """Each step spends at least ``BURN_S`` of this thread's CPU time, however busy the machine is,
    and records what it really spent: on a busy virtual machine the thread clock also runs while
    the hypervisor holds the CPU, so a step can cost a few per cent more than asked."""

    device = "cpu"
    hidden = 8
    layers = 1

    def __init__(self) -> None:
        self.spent: list[float] = []

    def step(self, rows: int) -> float:
        started = time.thread_time()
        until = started + BURN_S
        while (now := time.thread_time()) < until:
            pass
        self.spent.append(now - started)
        return 0.0


def wait_tokens(request: RequestHandle, count: int) -> None:
    deadline = time.monotonic() + 10
    while request.tokens_generated < count and time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_cost_after_disconnect_is_the_steps_after_it_shared_by_who_was_in_them(max_batch: int) -> None:
    """``a`` (60 tokens) and ``b`` (60 tokens) arrive together; ``a``'s client leaves after 10 of its
    tokens. Batched, they share every step; one at a time, ``b`` waits and shares none of ``a``'s."""
    recorder = Recorder()
    backend = BurningBackend()
    engine = Engine(backend, max_batch=max_batch, on_finish=recorder.on_finish)
    a, b = recorder.request("a", 60), recorder.request("b", 60)
    engine.start()
    try:
        engine.submit(a)
        engine.submit(b)
        wait_tokens(a, 10)
        engine.note_disconnect(a, time.time_ns())
        recorder.wait("a", "b")
    finally:
        engine.stop()
    steps_after = a.tokens_after_disconnect or 0
    assert steps_after >= 40
    step_s = sum(backend.spent) / len(backend.spent)
    expected = steps_after * step_s / max_batch
    record = truth_record(a, "detached")
    # One step may straddle the disconnect (counted in part): at most one step's share either way,
    # and the engine's own few microseconds around each step.
    assert record["compute_seconds_after_disconnect"] == pytest.approx(
        expected, abs=max(backend.spent) * 1.05 + steps_after * 50e-6)
    assert truth_record(b, "detached")["compute_seconds_after_disconnect"] is None  # its client stayed
