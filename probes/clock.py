"""Kernel monotonic timestamps turned into wall-clock nanoseconds.

``bpf_ktime_get_ns()`` reads CLOCK_MONOTONIC, which has no relation to the epoch. The offset
between the two clocks is measured from paired reads (monotonic, wall, monotonic): the pair with
the shortest gap bounds the error to half that gap, typically well under a microsecond. The offset
is measured again every ``recalibrate_every_s`` (a tenth of a second: 5 us of clock reads) so that
a wall-clock step (NTP, an operator, a virtual machine's clock set after a pause) shows up in
converted timestamps within that interval. The spans' times are the wall clock's as the engine read
it: until the step is seen, the kernel's close times are off against them by the whole step (a
close read before the request's span began, a completed request judged left). A step is logged and
counted (``steps``), so that a verdict of that moment can be doubted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
# A move of the offset beyond this between two calibrations is a step: NTP slews the wall clock by
# at most 0.5 ms a second, and the calibration's own error is well under a microsecond.
STEP_NS = 1_000_000

MonotonicReader = Callable[[], int]
WallReader = Callable[[], int]


def _monotonic_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class MonotonicToWall:
    """Converts CLOCK_MONOTONIC nanoseconds (as the kernel stamps them) to epoch nanoseconds."""

    def __init__(self, *, pairs: int = 9, recalibrate_every_s: float = 0.1,
                 monotonic_ns: MonotonicReader = _monotonic_ns,
                 wall_ns: WallReader = time.time_ns) -> None:
        self._pairs = max(1, pairs)
        self._recalibrate_every_ns = int(recalibrate_every_s * 1e9)
        self._monotonic_ns = monotonic_ns
        self._wall_ns = wall_ns
        self.offset_ns = 0
        self.uncertainty_ns = 0  # half the tightest pair's gap: the bound on the offset's error
        self.steps = 0  # wall-clock steps seen since start
        self._calibrated_at_ns: int | None = None
        self.calibrate()

    def calibrate(self) -> int:
        """Measure the wall-minus-monotonic offset again; returns it."""
        best_gap: int | None = None
        best_offset = 0
        for _ in range(self._pairs):
            before = self._monotonic_ns()
            wall = self._wall_ns()
            after = self._monotonic_ns()
            gap = after - before
            if best_gap is None or gap < best_gap:
                best_gap = gap
                best_offset = wall - (before + after) // 2
        moved = best_offset - self.offset_ns
        if self._calibrated_at_ns is not None and abs(moved) > STEP_NS:
            self.steps += 1
            log.warning("the wall clock stepped %+.1f ms against the monotonic clock in the %.2f s since it was "
                        "last read: kernel events stamped in that while are off by as much against the spans' "
                        "times, and verdicts of requests then may be wrong", moved / 1e6,
                        (before - self._calibrated_at_ns) / 1e9)
        self.offset_ns = best_offset
        self.uncertainty_ns = (best_gap or 0) // 2
        self._calibrated_at_ns = self._monotonic_ns()
        return best_offset

    def maybe_recalibrate(self) -> None:
        """Calibrate if the last calibration is older than the interval (cheap to call often)."""
        calibrated = self._calibrated_at_ns
        if calibrated is None or self._monotonic_ns() - calibrated >= self._recalibrate_every_ns:
            self.calibrate()

    def to_wall_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns
