"""Kernel monotonic time to wall-clock time: tight calibration, and wall-clock steps picked up."""

from __future__ import annotations

import logging
import time

import pytest

from probes.clock import MonotonicToWall


def test_real_calibration_is_far_inside_a_millisecond() -> None:
    clock = MonotonicToWall()
    assert clock.uncertainty_ns < 100_000
    for _ in range(20):
        monotonic = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        wall = time.time_ns()
        assert abs(clock.to_wall_ns(monotonic) - wall) < 1_000_000


def test_tightest_pair_wins() -> None:
    # Monotonic reads: (0, 5_000) is a wide pair, (10_000, 10_010) a tight one.
    monotonic_reads = iter([0, 5_000, 10_000, 10_010, 99_999])
    wall_reads = iter([1_000_000_000, 2_000_010_005])
    clock = MonotonicToWall(pairs=2, monotonic_ns=lambda: next(monotonic_reads),
                            wall_ns=lambda: next(wall_reads))
    assert clock.offset_ns == 2_000_010_005 - 10_005
    assert clock.uncertainty_ns == 5


def test_wall_clock_step_is_picked_up_at_the_next_recalibration() -> None:
    now = {"mono": 1_000, "wall": 1_000_000}
    clock = MonotonicToWall(pairs=1, recalibrate_every_s=1.0, monotonic_ns=lambda: now["mono"],
                            wall_ns=lambda: now["wall"])
    assert clock.to_wall_ns(1_000) == 1_000_000
    now["wall"] += 3_600 * 10**9  # an operator sets the clock an hour ahead
    now["mono"] += 500_000_000
    clock.maybe_recalibrate()  # too early: keeps the old offset
    assert clock.to_wall_ns(1_000) == 1_000_000
    now["mono"] += 600_000_000
    clock.maybe_recalibrate()
    assert clock.to_wall_ns(now["mono"]) == now["wall"]


def test_a_step_is_counted_and_logged_and_a_slew_is_not(caplog: pytest.LogCaptureFixture) -> None:
    now = {"mono": 1_000, "wall": 1_000_000}
    clock = MonotonicToWall(pairs=1, recalibrate_every_s=0.1, monotonic_ns=lambda: now["mono"],
                            wall_ns=lambda: now["wall"])
    for _ in range(10):  # NTP's fastest slew, 0.5 ms a second, read every tenth of a second
        now["mono"] += 100_000_000
        now["wall"] += 100_050_000
        clock.maybe_recalibrate()
    assert clock.steps == 0 and not caplog.records
    now["mono"] += 100_000_000
    now["wall"] += 100_000_000 - 90_000_000  # set back 90 ms
    with caplog.at_level(logging.WARNING, logger="probes.clock"):
        clock.maybe_recalibrate()
    assert clock.steps == 1
    assert clock.to_wall_ns(now["mono"]) == now["wall"]
    assert "stepped -90.0 ms" in caplog.text, caplog.text
