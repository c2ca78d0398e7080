"""Disconnects that came at one age of their request: a client's or a proxy's timeout.

A timeout gives up on every request the same time after it was sent: a client that waits 30 s for
a non-streamed answer, nginx after 60 s without a byte from upstream, a benchmark's cancel delay.
Its disconnects stack up at one *age* (the disconnect less the request's start) where people's
cancels spread out; and each one it cut short ran on the GPU as long as the timeout for nothing,
and as a zombie longer, where the engine did not stop on the close.

The window's disconnects are counted by age in 10 ms bins (one grouped query, ``query.py``). A
band of ages (100 ms, or 1% of the age where that is wider) is a timeout where it holds at least
``MIN_DISCONNECTS``, twice what either flank (five bands on each side) holds per band, and more
than ages coming as those around them come would put in it once in a million (a Poisson tail).
Each flank is read on its own: the edge of a stretch of ages with none past it has one empty
flank, and the band holds what the other holds per band. Ages spread out however they are (a flat
stretch, the slope of people's cancels, such an edge) do not pass; a timeout hit fewer than five
times, or whose disconnects came in fewer than five different tenths of a second (one event), is
not told. A band wider than its spike still holds all of it; a spike wider than its band
(requests that waited for the server's accept for varying times) is told once, for the band that
holds the most of it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from auditor.report.model import AgeBar, ClientTimeout

NS = 1_000_000_000
BIN_NS = 10_000_000
MOMENT_NS = 100_000_000  # disconnects in one tenth of a second came at once
# The /proc source times a close to its poll interval (50 ms at its default rate): a band holds that.
MIN_BAND_NS = 100_000_000
BAND_SHARE = 100  # the band is 1/100 of the age where that is wider than MIN_BAND_NS
FLANK_BANDS = 5
MIN_DISCONNECTS = 5
MEAN_FLOOR = 0.1  # flanks with none in them are taken to hold a tenth of one per band
LOG_CHANCE = math.log(1e-6)
MAX_TIMEOUTS = 5

# Timeouts that are a default somewhere, and what they are the default of: a disconnect at one of
# them points at the hop that gave up (the client is often not the one that left).
KNOWN_TIMEOUTS_S = (
    (60.0, "nginx's proxy_read_timeout and an AWS load balancer's idle timeout"),
    (100.0, "Cloudflare's proxy read timeout"),
    (600.0, "the openai Python SDK's timeout"),
)
# Widths of the HTML chart's bars, the narrowest giving at most MAX_BARS.
BAR_WIDTHS_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
MAX_BARS = 60


@dataclass(frozen=True, slots=True)
class AgeBin:
    """The disconnects whose request was ``index`` x 10 ms old (to the next 10 ms), and their verdicts."""

    index: int
    disconnects: int
    completed: int
    aborted: int
    zombies: int
    inflight_zombies: int
    unconfirmed: int
    zombie_seconds: float
    wasted_gpu_seconds: float
    wasted_cpu_seconds: float
    first_ns: int
    last_ns: int
    moments: int  # how many different tenths of a second (of the clock) the disconnects came in
    ages_ns: int  # their ages summed
    # Those whose answer had not ended (not completed, nor unconfirmed as a race with its end):
    # what a timeout cuts. None: all of them.
    cut: int | None = None
    # The zombies whose work ended, how long it ran from their requests' start summed, the longest.
    zombies_ended: int = 0
    zombie_work_ns: int = 0
    zombie_work_max_ns: int | None = None


def band_ns(age_ns: int) -> int:
    """How wide a band of ages one timeout's disconnects may fall in, at this age."""
    return max(MIN_BAND_NS, age_ns // BAND_SHARE)


def find_timeouts(bins: Sequence[AgeBin]) -> list[ClientTimeout]:
    """The timeouts among the disconnects counted in ``bins``, the most disconnects first."""
    every = sorted((b for b in bins if b.index >= 0 and b.disconnects > 0), key=lambda b: b.index)
    every_starts = [b.index * BIN_NS for b in every]
    # Closes as answers ended come at one age too where answers are all as long (a benchmark's
    # fixed lengths): only the disconnects that cut an answer short are counted for a spike.
    ordered = [b for b in every if _cut(b) > 0]
    starts = [b.index * BIN_NS for b in ordered]
    before = [0]  # before[i]: the disconnects cutting answers in ordered[:i]
    for b in ordered:
        before.append(before[-1] + _cut(b))

    def count(lo_ns: int, hi_ns: int) -> int:
        return before[bisect_left(starts, hi_ns)] - before[bisect_left(starts, lo_ns)]

    candidates = []
    for lo in starts:
        width = band_ns(lo)
        held = count(lo, lo + width)
        if held < MIN_DISCONNECTS:
            continue
        # Each flank on its own: the edge of a stretch (ages up to a limit, none past it) has
        # one empty flank, and the band holds what the other holds per band.
        flank = FLANK_BANDS * width
        per_band = count(lo + width, lo + width + flank) / FLANK_BANDS
        left = min(flank, lo)  # no ages below 0
        if left:
            per_band = max(per_band, count(lo - left, lo) * width / left)
        if _spike(held, per_band):
            candidates.append((-held, lo, width))
    found: list[ClientTimeout] = []
    taken: list[tuple[int, int]] = []
    for _, lo, width in sorted(candidates):
        # One band either side is the same timeout's: its spike may be wider than its band.
        if any(lo < hi + width and lo + width > taken_lo - width for taken_lo, hi in taken):
            continue
        taken.append((lo, lo + width))
        # Its figures hold every disconnect in its band, those at an answer's end too.
        members = every[bisect_left(every_starts, lo):bisect_left(every_starts, lo + width)]
        # Disconnects at one age that came in a few moments only are one event (a client that
        # left with all of a batch it sent at once), not a timeout met again and again.
        if sum(b.moments for b in members) >= MIN_DISCONNECTS:
            found.append(_timeout(members))
        if len(found) == MAX_TIMEOUTS:
            break
    return found


def _cut(b: AgeBin) -> int:
    return b.disconnects if b.cut is None else b.cut


def _spike(held: int, per_band: float) -> bool:
    """Whether ``held`` disconnects in a band are a spike where the ages around put ``per_band``
    in a band: at least ``MIN_DISCONNECTS``, twice as many, and fewer than one chance in a
    million of that many if they came as those around them do (Poisson)."""
    if held < MIN_DISCONNECTS or held < 2 * per_band:
        return False
    mean = max(per_band, MEAN_FLOOR)
    # log P(X >= held): its first term over 1 - mean / (held + 1), a geometric bound on the rest.
    first = held * math.log(mean) - mean - math.lgamma(held + 1)
    return first - math.log1p(-mean / (held + 1)) < LOG_CHANCE


# What a timeout adds up from its bins, each under the same name in both.
_SUMMED = ("disconnects", "completed", "aborted", "zombies", "inflight_zombies", "unconfirmed", "zombie_seconds",
           "wasted_gpu_seconds", "wasted_cpu_seconds")


def _timeout(members: Sequence[AgeBin]) -> ClientTimeout:
    sums = {name: sum(getattr(b, name) for b in members) for name in _SUMMED}
    after = sum(b.ages_ns for b in members) / sums["disconnects"] / NS
    ended = sum(b.zombies_ended for b in members)
    longest = [b.zombie_work_max_ns for b in members if b.zombie_work_max_ns is not None]
    return ClientTimeout(
        **sums, after_seconds=round(after, 3), from_seconds=round(members[0].index * BIN_NS / NS, 3),
        to_seconds=round((members[-1].index + 1) * BIN_NS / NS, 3),
        first_ns=min(b.first_ns for b in members), last_ns=max(b.last_ns for b in members),
        default_of=known_default(after),
        zombie_work_mean_seconds=round(sum(b.zombie_work_ns for b in members) / ended / NS, 3) if ended else None,
        zombie_work_max_seconds=round(max(longest) / NS, 3) if longest else None)


def known_default(after_s: float) -> str | None:
    """What a timeout of ``after_s`` seconds is the default of, where it is one."""
    for seconds, what in KNOWN_TIMEOUTS_S:
        if abs(after_s - seconds) * NS <= band_ns(int(seconds * NS)):
            return what
    return None


def age_bars(bins: Sequence[AgeBin], timeouts: Sequence[ClientTimeout]) -> tuple[list[AgeBar], float, int]:
    """The disconnects by age for a chart: up to the age under which 99% of them came (and past
    every timeout found), in at most MAX_BARS bars of a round width centred on its multiples (the
    first starts below 0). Returns the bars, their width in seconds and how many disconnects came
    older than the last bar."""
    ordered = sorted((b for b in bins if b.index >= 0 and b.disconnects > 0), key=lambda b: b.index)
    total = sum(b.disconnects for b in ordered)
    if not total:
        return [], 0.0, 0
    seen, top_ns = 0, 0
    for b in ordered:
        seen += b.disconnects
        top_ns = (b.index + 1) * BIN_NS
        if 100 * seen >= 99 * total:
            break
    top_ns = max([top_ns, *(int(t.to_seconds * NS) for t in timeouts)])
    width_s = next((w for w in BAR_WIDTHS_S if top_ns <= w * NS * MAX_BARS), -(-top_ns // (NS * MAX_BARS)))
    width_bins = max(1, round(width_s * NS / BIN_NS))
    # Bars centred on round ages, where timeouts are set: a 30 s one's disconnects, at 29.99 and
    # 30.00 s, in one bar rather than split between two.
    half = width_bins // 2
    count = (-(-top_ns // BIN_NS) - 1 + half) // width_bins + 1
    disconnects, zombies, older = [0] * count, [0] * count, 0
    for b in ordered:
        slot = (b.index + half) // width_bins
        if slot >= count:
            older += b.disconnects
            continue
        disconnects[slot] += b.disconnects
        zombies[slot] += b.zombies + b.inflight_zombies
    bars = [AgeBar(start_s=round((slot * width_bins - half) * BIN_NS / NS, 3), disconnects=disconnects[slot],
                   zombies=zombies[slot]) for slot in range(count)]
    return bars, width_bins * BIN_NS / NS, older
