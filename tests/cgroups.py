"""A memory + CPU cgroup for a test's child process: cgroup v2 where its controllers are available,
else the v1 ``memory`` and ``cpu`` hierarchies, below the cgroups this process is already in.

``limited(memory_bytes, cpu_percent)`` yields a ``Limits`` whose ``enter`` is a ``preexec_fn``:
the child moves itself in before it execs, so all it ever allocates is charged there.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from auditor.ownstats import own_cgroups

ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000


class CgroupsUnavailable(Exception):
    """No writable memory and CPU cgroups here (not root, or a read-only /sys/fs/cgroup)."""


def _own_path(controller: str) -> str:
    path = own_cgroups(Path("/proc/self/cgroup").read_text()).get(controller)
    if path is None:
        raise CgroupsUnavailable(f"this process is in no {controller} cgroup")
    return path


@dataclass
class Limits:
    version: int
    dirs: list[Path] = field(default_factory=list)

    def enter(self) -> None:
        for directory in self.dirs:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def _memory_dir(self) -> Path:
        return self.dirs[0]

    def memory_peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        path = self._memory_dir() / name
        return int(path.read_text()) if path.exists() else None

    def oom_kills(self) -> int:
        if self.version == 2:
            events = dict(line.split() for line in (self._memory_dir() / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0))
        control = dict(line.split() for line in (self._memory_dir() / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0))

    def cpu_throttled(self) -> dict[str, int]:
        stat = self.dirs[-1] / "cpu.stat"
        return {k: int(v) for k, v in (line.split() for line in stat.read_text().splitlines())}


def _make(directory: Path, settings: dict[str, str]) -> Path:
    try:
        directory.mkdir()
        for name, value in settings.items():
            (directory / name).write_text(value)
    except OSError as exc:
        raise CgroupsUnavailable(f"cannot set up {directory}: {exc.strerror}") from exc
    return directory


@contextmanager
def limited(memory_bytes: int, cpu_percent: float) -> Iterator[Limits]:
    name = f"auditor-test-{uuid.uuid4().hex[:8]}"
    quota = str(int(CPU_PERIOD_US * cpu_percent / 100))
    v2 = ROOT / "cgroup.controllers"
    if v2.exists() and {"memory", "cpu"} <= set(v2.read_text().split()):
        limits = Limits(2)
        limits.dirs.append(_make(ROOT / _own_path("").lstrip("/") / name,
                                 {"memory.max": str(memory_bytes), "cpu.max": f"{quota} {CPU_PERIOD_US}"}))
    elif (ROOT / "memory").is_dir() and (ROOT / "cpu").is_dir():
        limits = Limits(1)
        limits.dirs.append(_make(ROOT / "memory" / _own_path("memory").lstrip("/") / name,
                                 {"memory.limit_in_bytes": str(memory_bytes)}))
        limits.dirs.append(_make(ROOT / "cpu" / _own_path("cpu").lstrip("/") / name,
                                 {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": quota}))
    else:
        raise CgroupsUnavailable("neither cgroup v2 with memory and cpu nor the v1 memory and cpu hierarchies")
    try:
        yield limits
    finally:
        for directory in limits.dirs:
            # A process still inside means the test's own teardown failed; its error says more.
            with contextlib.suppress(OSError):
                directory.rmdir()
