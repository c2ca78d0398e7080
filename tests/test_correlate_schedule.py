"""The daemon's correlation rounds: a fixed schedule, and an extra round when an in-flight alarm
falls due before the next scheduled one (auditor.daemon._correlate_loop)."""

from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from auditor.config import apply_overrides, load_config
from auditor.daemon import ALARM_ROUND_GAP_S, Daemon


def rounds_of(interval_s: float, alarms: dict[int, float | None], run_s: float,
              failing: bool = False) -> list[float]:
    """Run the loop for ``run_s`` with rounds that set the correlator's alarm (seconds from now) as
    ``alarms`` says for the round of that index; returns the rounds' start times from the first."""
    config = load_config(environ={})
    apply_overrides(config, {"correlate.interval_seconds": interval_s})
    daemon = Daemon(config)
    daemon.correlator = SimpleNamespace(alarm_due_ns=None)
    daemon._failing = failing
    starts: list[float] = []

    def round_() -> None:
        starts.append(time.monotonic())
        due = alarms.get(len(starts) - 1)
        daemon.correlator.alarm_due_ns = None if due is None else time.time_ns() + int(due * 1e9)

    daemon.correlate_once = round_  # type: ignore[method-assign]
    thread = threading.Thread(target=daemon._correlate_loop, daemon=True)
    thread.start()
    time.sleep(run_s)
    daemon._stop.set()
    thread.join(5)
    return [t - starts[0] for t in starts]


def test_rounds_keep_their_schedule_without_alarms() -> None:
    starts = rounds_of(0.5, {}, 1.3)
    assert len(starts) == 3, starts
    assert starts[1] == pytest.approx(0.5, abs=0.1) and starts[2] == pytest.approx(1.0, abs=0.1)


def test_an_alarm_due_before_the_next_round_gets_a_round_of_its_own() -> None:
    # Round 0 finds a request whose grace ends in 0.3 s: a round then, and the schedule stays
    # (the next scheduled round at 1.0 s, not 1.3 s).
    starts = rounds_of(1.0, {0: 0.3}, 1.5)
    assert len(starts) == 3, starts
    assert starts[1] == pytest.approx(0.3, abs=0.1)
    assert starts[2] == pytest.approx(1.0, abs=0.1)


def test_an_alarm_already_due_waits_the_least_gap_not_zero() -> None:
    # A deadline in the past (a round that ran a little early against the kernel's clock): the
    # rounds come at most every ALARM_ROUND_GAP_S, never back to back.
    starts = rounds_of(5.0, {i: -1.0 for i in range(100)}, 1.0)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps and min(gaps) >= ALARM_ROUND_GAP_S * 0.9, gaps
    assert len(starts) <= 1 + 1.0 / ALARM_ROUND_GAP_S + 1, starts


def test_an_alarm_after_the_next_scheduled_round_changes_nothing() -> None:
    starts = rounds_of(0.5, {0: 3.0}, 0.8)
    assert len(starts) == 2 and starts[1] == pytest.approx(0.5, abs=0.1), starts


def test_a_failing_round_does_not_trust_its_alarm() -> None:
    starts = rounds_of(1.0, {0: 0.2}, 0.7, failing=True)
    assert len(starts) == 1, starts

