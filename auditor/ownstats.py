"""The daemon's own cost on /metrics: CPU by thread, and the limits its cgroup sets.

``process_*`` (auditor.promtext's process collector) says what the whole daemon takes: CPU
seconds, resident memory, open files. What an operator asks next is where that CPU goes and how
close the daemon runs to the limits of its unit (``MemoryMax=``, ``CPUQuota=``) or container:

- ``auditor_thread_cpu_seconds_total{thread}``: the scheduler's time of each of the daemon's
  threads (correlator, probe, OTLP receivers, samplers ...), summed by name with worker numbers
  dropped (``otlp-grpc_3`` counts as ``otlp-grpc``). A thread that ends leaves its time in the sum,
  so the counter never goes back; one that ended before any scrape saw it (start-up work) is only
  in ``process_cpu_seconds_total``.
- ``auditor_memory_limit_bytes``, ``auditor_cpu_limit_cores``: the tightest limit of the daemon's
  cgroup and its ancestors, cgroup v2 or v1; +Inf where none is set.
- ``auditor_cpu_throttled_seconds_total``: how long the CPU limit held the daemon back. A daemon
  that is throttled judges late; 0 where no CPU limit is set.

Everything is read when Prometheus scrapes (a few small files under /proc and /sys/fs/cgroup);
what cannot be read is left out of that scrape, never guessed.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from auditor.promtext import CounterFamily, Family, GaugeFamily

MAX_THREAD_LABELS = 40  # then "other": names come from code, but a library may start threads of its own
# v1 writes "no limit" as the largest multiple of the page size below 2**63.
V1_UNLIMITED_BYTES = 1 << 62
_WORKER_SUFFIX = re.compile(r"(?:[-_]\d+)+$")
_CALLABLE_SUFFIX = re.compile(r"\s*\(.*\)$")  # threading's "Thread-3 (target)"


def thread_label(name: str) -> str:
    """A thread's name without its pool's numbering: one label per kind of thread."""
    label = _WORKER_SUFFIX.sub("", _CALLABLE_SUFFIX.sub("", name.strip()))
    return label or "unnamed"


# -- CPU by thread --------------------------------------------------------------------------------
def _task_cpu_seconds(task: Path, ticks: int) -> float | None:
    """One thread's CPU seconds: the scheduler's nanoseconds, else utime + stime in clock ticks."""
    try:
        return int((task / "schedstat").read_bytes().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        stat = (task / "stat").read_bytes()
        fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError, IndexError):
        return None  # the thread ended meanwhile, or /proc is not what it should be


class ThreadCpu:
    """CPU seconds by thread label, kept monotonic across threads that come and go."""

    def __init__(self, proc_self: Path = Path("/proc/self")) -> None:
        self.tasks = proc_self / "task"
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._lock = threading.Lock()  # scrapes may run on several threads at once
        self._last: dict[int, tuple[str, float]] = {}  # thread id -> (label, seconds at the last read)
        self._retired: dict[str, float] = {}  # label -> seconds of its threads that ended
        self._labels: set[str] = set()  # every label given so far, at most MAX_THREAD_LABELS

    def _names(self) -> dict[int, str]:
        names = {}
        for thread in threading.enumerate():
            if thread.native_id is not None:
                names[thread.native_id] = thread.name
        return names

    def read(self) -> dict[str, float]:
        """Label -> CPU seconds of its threads, those that ended included."""
        try:
            tids = [int(entry) for entry in os.listdir(self.tasks) if entry.isdigit()]
        except OSError:
            return {}
        names = self._names()
        with self._lock:
            current: dict[int, tuple[str, float]] = {}
            for tid in tids:
                seconds = _task_cpu_seconds(self.tasks / str(tid), self._ticks)
                if seconds is None:
                    continue
                name = names.get(tid)
                if name is None:
                    try:
                        name = (self.tasks / str(tid) / "comm").read_text().strip()
                    except OSError:
                        name = "unnamed"
                current[tid] = (self._bounded(thread_label(name)), seconds)
            for tid, (label, seconds) in self._last.items():
                now = current.get(tid)
                # Gone, or its id taken by a new thread (a different name, or less time than before).
                if now is None or now[0] != label or now[1] < seconds:
                    self._retired[label] = self._retired.get(label, 0.0) + seconds
            self._last = current
            totals = dict(self._retired)
            for label, seconds in current.values():
                totals[label] = totals.get(label, 0.0) + seconds
            return totals

    def _bounded(self, label: str) -> str:
        if label not in self._labels:
            if len(self._labels) >= MAX_THREAD_LABELS:
                return "other"
            self._labels.add(label)
        return label


# -- cgroup limits ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: float  # math.inf: no limit
    cpu_cores: float  # math.inf: no limit
    throttled_seconds: float | None  # None: a CPU limit is set, but its statistics cannot be read


def own_cgroups(text: str) -> dict[str, str]:
    """/proc/self/cgroup as controller -> path; the v2 (unified) hierarchy's controller is ""."""
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ancestors(base: Path, path: str) -> Iterator[Path]:
    """The cgroup directory of ``path`` under ``base``, then each parent up to ``base``."""
    directory = base / path.strip("/")
    while True:
        yield directory
        if directory == base:
            return
        directory = directory.parent


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _v2_cpu(text: str | None) -> float | None:
    """``cpu.max`` ("max 100000" or "50000 100000") as cores, None for no limit or garbage."""
    parts = (text or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota, period = _number(parts[0]), _number(parts[1])
    return quota / period if quota is not None and period else None


def _stat_field(text: str | None, name: str) -> float | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return _number(value)
    return None


def read_cgroup_limits(root: Path = Path("/sys/fs/cgroup"),
                       proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> CgroupLimits | None:
    """The tightest memory and CPU limits over this process's cgroup and its ancestors, and how long
    the CPU limit held it back; None where the process's cgroups cannot be read (not Linux)."""
    text = _read(proc_self_cgroup)
    if text is None:
        return None
    paths = own_cgroups(text)
    memory, cpu, throttled_at = math.inf, math.inf, None
    if "memory" in paths and (root / "memory").is_dir():  # v1, or hybrid: the v1 controllers hold the limits
        for directory in _ancestors(root / "memory", paths["memory"]):
            limit = _number(_read(directory / "memory.limit_in_bytes"))
            if limit is not None and limit < V1_UNLIMITED_BYTES:
                memory = min(memory, limit)
    elif "" in paths:
        for directory in _ancestors(root, paths[""]):
            limit = _number(_read(directory / "memory.max"))  # "max": no limit, read as None
            if limit is not None:
                memory = min(memory, limit)
    if "cpu" in paths and (root / "cpu").is_dir():
        for directory in _ancestors(root / "cpu", paths["cpu"]):
            quota = _number(_read(directory / "cpu.cfs_quota_us"))
            period = _number(_read(directory / "cpu.cfs_period_us"))
            if quota is not None and quota > 0 and period and quota / period < cpu:
                cpu, throttled_at = quota / period, (directory / "cpu.stat", "throttled_time", 1e9)
    elif "" in paths:
        for directory in _ancestors(root, paths[""]):
            cores = _v2_cpu(_read(directory / "cpu.max"))
            if cores is not None and cores < cpu:
                cpu, throttled_at = cores, (directory / "cpu.stat", "throttled_usec", 1e6)
    throttled: float | None = 0.0
    if throttled_at is not None:  # the cgroup whose limit binds is the one that throttles
        stat, name, per_second = throttled_at
        value = _stat_field(_read(stat), name)
        throttled = value / per_second if value is not None else None
    return CgroupLimits(memory, cpu, throttled)


# -- the collector ------------------------------------------------------------------------------
class OwnCostCollector:
    """Per-thread CPU and cgroup limits, read at scrape time."""

    def __init__(self, threads: ThreadCpu | None = None, *, cgroup_root: Path = Path("/sys/fs/cgroup"),
                 proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> None:
        self.threads = threads or ThreadCpu()
        self.cgroup_root = cgroup_root
        self.proc_self_cgroup = proc_self_cgroup

    def collect(self) -> Iterator[Family]:
        by_thread = self.threads.read()
        if by_thread:
            family = CounterFamily("auditor_thread_cpu_seconds", "CPU time of the daemon's threads, "
                                   "by kind of thread (pool numbers dropped)", labels=["thread"])
            for label, seconds in sorted(by_thread.items()):
                family.add_metric([label], seconds)
            yield family
        limits = read_cgroup_limits(self.cgroup_root, self.proc_self_cgroup)
        if limits is None:
            return
        yield GaugeFamily("auditor_memory_limit_bytes", "Tightest memory limit of the daemon's cgroup "
                          "and its ancestors (+Inf: none)", value=limits.memory_bytes)
        yield GaugeFamily("auditor_cpu_limit_cores", "Tightest CPU limit of the daemon's cgroup and its "
                          "ancestors, in cores (+Inf: none)", value=limits.cpu_cores)
        if limits.throttled_seconds is not None:
            yield CounterFamily("auditor_cpu_throttled_seconds", "Time the CPU limit held the daemon back",
                                value=limits.throttled_seconds)
