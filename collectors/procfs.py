"""Per-process CPU sampler from ``/proc/<pid>/stat``, for engine processes on hosts without a GPU.

CPU use is the change of ``utime + stime`` (clock ticks, ``SC_CLK_TCK``) between two readings over
the monotonic time between them, as ``util_percent`` where 100 means one core fully busy. The first
reading of a pid only sets its baseline. A pid that vanished is dropped quietly; a pid reused by a
new process (different start time) starts a new baseline instead of producing a bogus delta.
``proc_root`` is injected so tests can point it at a fixture tree.
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


@dataclass(frozen=True)
class _Reading:
    cpu_ticks: int
    start_ticks: int  # process start time since boot: tells a reused pid apart
    taken_at: float  # monotonic seconds


class ProcfsSampler:
    """CPU (and resident memory) of a set of pids, set at run time with :meth:`set_pids`."""

    name = "procfs"

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc", host: str = "", *,
                 monotonic: Callable[[], float] = time.monotonic, clock_ticks: int | None = None,
                 page_size: int | None = None) -> None:
        self.proc_root = Path(proc_root)
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

    def _read(self, pid: int) -> tuple[int, int, int] | None:
        """(utime+stime, starttime, rss pages) or None when the process is gone.

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
            reading = self._read(pid)
            if reading is None:
                quiet[pid] = True
                continue  # vanished: nothing to report, and its baseline goes
            now = self._monotonic()
            cpu_ticks, start_ticks, rss_pages = reading
            current[pid] = _Reading(cpu_ticks, start_ticks, now)
            before = self._previous.get(pid)
            if before is None or before.start_ticks != start_ticks or now <= before.taken_at:
                continue
            elapsed = now - before.taken_at
            busy_s = max(0, cpu_ticks - before.cpu_ticks) / self.clock_ticks
            util = 100.0 * busy_s / elapsed
            quiet[pid] = util < QUIET_PERCENT
            samples.append(UtilSample(
                ts_ns=ts_ns, source="procfs", host=self.host, gpu_index=None, pid=pid,
                util_percent=util, memory_bytes=rss_pages * self.page_size, interval_s=elapsed,
            ))
        self._previous = current
        self._quiet = quiet
        for pid in [p for p in self._files if p not in pids]:
            self._close(pid)
        return samples

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
