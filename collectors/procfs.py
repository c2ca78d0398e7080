"""Per-process CPU sampler, for engine processes on hosts without a GPU.

CPU use is the change of the process's CPU time between two readings over the monotonic time
between them, as ``util_percent`` where 100 means one core fully busy. The first reading of a pid
only sets its baseline. A pid that vanished is dropped quietly; a pid reused by a new process
(different start time) starts a new baseline instead of producing a bogus delta.

The CPU time is the process's CPU clock (``clock_gettime`` on the clock id Linux gives every
process, the one ``clock_getcpuclockid`` returns): nanoseconds, where ``/proc/<pid>/stat``'s
``utime + stime`` count clock ticks (``SC_CLK_TCK``, 10 ms: a tenth of a core at the sampler's 10
readings a second), and one system call with no text to parse. ``/proc/<pid>/stat`` is read at a
pid's first reading and then once a second (``STAT_EVERY_S``) for what only it tells: the start time
that tells a reused pid apart, and the resident memory. Where the clock cannot be read (a kernel
without it), or ``proc_root`` numbers processes otherwise (a fixture tree in tests, a /proc of
another pid namespace), the stat file's ticks are read every time, as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from auditor.model import UtilSample

log = logging.getLogger(__name__)

# A followed process using less than this much of one core is running no request: while every one
# is this quiet, the sampler says it is idle and the loop samples once a second. A sample covers
# the whole time since the one before, so nothing a process spends goes uncounted; a request that
# starts in a quiet second is only measured in a coarser step until the next sample shows it, and
# the costing puts that step's busy time at its end (auditor.correlate.waste, _Series._backload).
QUIET_PERCENT = 2.0
# How often a followed process's stat file is read where its CPU clock gives the CPU time: its start
# time (a reused pid) and resident memory. A pid can only be taken again once its process is gone,
# which the clock reports at the next reading (EINVAL); a new process under the same pid within one
# reading is caught here, a second later at most.
STAT_EVERY_S = 1.0
_CPUCLOCK_SCHED = 2  # the kernel's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED): ((~pid) << 3) | 2


def process_cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (glibc's ``clock_getcpuclockid``)."""
    return ((~pid) << 3) | _CPUCLOCK_SCHED


def _numbers_as_we_do(proc_root: Path) -> bool:
    try:
        return os.readlink(proc_root / "self") == str(os.getpid())
    except OSError:
        return False


def _cpu_clock_works() -> bool:
    try:
        time.clock_gettime_ns(process_cpu_clock(os.getpid()))
    except (OSError, AttributeError):  # not Linux, or a sandbox that refuses the call
        return False
    return True


@dataclass(frozen=True)
class _Reading:
    cpu_ns: int
    start_ticks: int  # process start time since boot: tells a reused pid apart
    taken_at: float  # monotonic seconds
    rss_pages: int
    stat_at: float  # when the stat file was last read (start time, resident memory)


class ProcfsSampler:
    """CPU (and resident memory) of a set of pids, set at run time with :meth:`set_pids`."""

    name = "procfs"

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc", host: str = "", *,
                 monotonic: Callable[[], float] = time.monotonic, clock_ticks: int | None = None,
                 page_size: int | None = None, cpu_clock: bool | None = None) -> None:
        self.proc_root = Path(proc_root)
        # A CPU clock names a process by its pid in this process's namespace: only where the stat
        # files number processes the same way (their tree's "self" is this process; not a fixture
        # tree, nor a /proc mounted from another pid namespace), and where this process's own reads.
        self.cpu_clock = (_numbers_as_we_do(self.proc_root) and _cpu_clock_works()) if cpu_clock is None else cpu_clock
        self.host = host
        self._monotonic = monotonic
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self.page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._lock = threading.Lock()
        self._pids: frozenset[int] = frozenset()
        self._previous: dict[int, _Reading] = {}
        self._files: dict[int, int] = {}  # pid -> its open stat file (read only by the sampling thread)
        self._quiet: dict[int, bool] = {}  # pid -> under QUIET_PERCENT at its latest reading, or gone
        self.unreadable = 0  # stat files that existed but could not be parsed

    def set_pids(self, pids: Iterable[int]) -> None:
        """Replace the watched pids (thread-safe; takes effect at the next sample)."""
        wanted = frozenset(int(pid) for pid in pids if int(pid) > 0)
        with self._lock:
            self._pids = wanted

    def idle(self) -> bool:
        """No process to sample, or every one followed quiet (``QUIET_PERCENT``) or gone."""
        with self._lock:
            pids = self._pids
        return all(self._quiet.get(pid, False) for pid in pids)

    def _cpu_ns(self, pid: int) -> int | None:
        """The process's CPU time by its CPU clock, or None when it is gone."""
        try:
            return time.clock_gettime_ns(process_cpu_clock(pid))
        except OSError:  # EINVAL: no such process
            return None

    def _read(self, pid: int) -> tuple[int, int, int] | None:
        """(utime+stime in clock ticks, starttime, rss pages) or None when the process is gone.

        The stat file stays open between readings and is read again from its start: one system
        call a reading instead of five (open, fstat, two reads, close), which on a virtual machine
        was most of the sampler's cost at 10 Hz. An open stat file belongs to its process: once
        that exits, reading fails (ESRCH) even if the pid is taken again, and the file is reopened."""
        try:
            fd = self._files.get(pid)
            if fd is None:
                fd = self._files[pid] = os.open(self.proc_root / str(pid) / "stat", os.O_RDONLY | os.O_CLOEXEC)
            raw = os.pread(fd, 4096, 0)
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            self._close(pid)
            return None
        except OSError:
            self._close(pid)
            self.unreadable += 1
            return None
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        try:
            fields = raw[raw.rindex(b")") + 2:].split()
            return int(fields[11]) + int(fields[12]), int(fields[19]), int(fields[21])
        except (ValueError, IndexError):
            self.unreadable += 1
            return None

    def sample(self, ts_ns: int) -> list[UtilSample]:
        with self._lock:
            pids = self._pids
        samples: list[UtilSample] = []
        current: dict[int, _Reading] = {}
        quiet: dict[int, bool] = {}
        for pid in sorted(pids):
            reading = self._reading(pid, self._previous.get(pid))
            if reading is None:
                quiet[pid] = True
                continue  # vanished: nothing to report, and its baseline goes
            current[pid] = reading
            before = self._previous.get(pid)
            if before is None or before.start_ticks != reading.start_ticks or reading.taken_at <= before.taken_at:
                continue
            elapsed = reading.taken_at - before.taken_at
            util = 100.0 * max(0, reading.cpu_ns - before.cpu_ns) / 1e9 / elapsed
            quiet[pid] = util < QUIET_PERCENT
            samples.append(UtilSample(
                ts_ns=ts_ns, source="procfs", host=self.host, gpu_index=None, pid=pid,
                util_percent=util, memory_bytes=reading.rss_pages * self.page_size, interval_s=elapsed,
            ))
        self._previous = current
        self._quiet = quiet
        for pid in [p for p in self._files if p not in pids]:
            self._close(pid)
        return samples

    def _reading(self, pid: int, before: _Reading | None) -> _Reading | None:
        """This moment's reading of ``pid`` (None: gone): its CPU clock, and the stat file when
        ``before`` is none or a second old; the stat file's ticks where the clock is off."""
        if not self.cpu_clock:
            stat = self._read(pid)
            if stat is None:
                return None
            cpu_ticks, start_ticks, rss_pages = stat
            now = self._monotonic()
            return _Reading(cpu_ticks * 1_000_000_000 // self.clock_ticks, start_ticks, now, rss_pages, now)
        cpu_ns = self._cpu_ns(pid)
        if cpu_ns is None:
            self._close(pid)
            return None
        now = self._monotonic()
        if before is not None and now - before.stat_at < STAT_EVERY_S:
            return _Reading(cpu_ns, before.start_ticks, now, before.rss_pages, before.stat_at)
        stat = self._read(pid)  # None: ended since the clock's read
        return None if stat is None else _Reading(cpu_ns, stat[1], now, stat[2], now)

    def _close(self, pid: int) -> None:
        fd = self._files.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for pid in list(self._files):
            self._close(pid)

    def health(self) -> str:
        if not self.proc_root.is_dir():
            return f"degraded: {self.proc_root} is not readable"
        return "ok"
