"""The daemon's figures of itself: CPU by thread, and its cgroup's limits, from real /proc files
and from cgroup trees written the way the kernel lays them out (v2, v1, and garbage)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest

from auditor.metrics import DaemonMetrics
from auditor.ownstats import (
    MAX_THREAD_LABELS,
    OwnCostCollector,
    ThreadCpu,
    own_cgroups,
    read_cgroup_limits,
    thread_label,
)
from auditor.promtext import Registry


def test_thread_labels_drop_pool_numbers_only() -> None:
    assert thread_label("otlp-grpc_3") == "otlp-grpc"
    assert thread_label("ThreadPoolExecutor-0_12") == "ThreadPoolExecutor"
    assert thread_label("Thread-7 (process_request_thread)") == "Thread"
    assert thread_label("correlator") == "correlator"
    assert thread_label("procfs-conn-poller") == "procfs-conn-poller"
    assert thread_label("  ") == "unnamed"


def burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_busy_thread_is_counted_under_its_label_and_stays_counted_after_it_ends() -> None:
    cpu = ThreadCpu()
    started, done = threading.Event(), threading.Event()

    def work() -> None:
        burn(0.2)
        started.set()
        done.wait(5)

    worker = threading.Thread(target=work, name="burner_4")
    worker.start()
    assert started.wait(5)
    seen = cpu.read()
    assert seen["burner"] >= 0.19
    done.set()
    worker.join()
    after = cpu.read()  # the thread is gone: its time stays in the counter
    assert after["burner"] >= seen["burner"]
    assert "MainThread" in after


def fake_task(tasks: Path, tid: int, *, schedstat: str | None = None, stat: str | None = None,
              comm: str = "worker") -> None:
    task = tasks / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    for name, text in (("schedstat", schedstat), ("stat", stat), ("comm", comm + "\n")):
        if text is not None:
            (task / name).write_text(text)
        elif (task / name).exists():
            (task / name).unlink()


def test_thread_cpu_reads_stat_when_schedstat_is_missing_and_skips_garbage(tmp_path: Path) -> None:
    tasks = tmp_path / "task"
    fake_task(tasks, 900001, schedstat="2500000000 0 0\n", comm="native poller")
    # No schedstat: utime 150 + stime 50 ticks; the name holds spaces and a parenthesis.
    fake_task(tasks, 900002, stat="900002 (odd ) name) S " + " ".join(["0"] * 10) + " 150 50 0 0\n", comm="odd")
    fake_task(tasks, 900003, schedstat="garbage", stat="garbage", comm="broken")
    cpu = ThreadCpu(tmp_path)
    cpu._ticks = 100
    seen = cpu.read()
    assert seen == {"native poller": 2.5, "odd": 2.0}


def test_thread_cpu_never_goes_back_when_a_thread_id_is_reused(tmp_path: Path) -> None:
    tasks = tmp_path / "task"
    fake_task(tasks, 900001, schedstat="3000000000 0 0", comm="pool_1")
    cpu = ThreadCpu(tmp_path)
    assert cpu.read() == {"pool": 3.0}
    fake_task(tasks, 900001, schedstat="1000000000 0 0", comm="pool_2")  # a new thread, same id, less time
    assert cpu.read() == {"pool": 4.0}
    (tasks / "900001" / "schedstat").unlink()
    (tasks / "900001" / "comm").unlink()
    (tasks / "900001").rmdir()  # it ended
    assert cpu.read() == {"pool": 4.0}


def test_thread_labels_are_bounded(tmp_path: Path) -> None:
    tasks = tmp_path / "task"
    for i in range(MAX_THREAD_LABELS + 5):
        fake_task(tasks, 900000 + i, schedstat="1000000 0 0", comm=f"kind{chr(65 + i % 26)}{i // 26}x")
    seen = ThreadCpu(tmp_path).read()
    assert len(seen) == MAX_THREAD_LABELS + 1
    assert seen["other"] == pytest.approx(5 * 0.001)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_own_cgroups_reads_v1_v2_and_hybrid_lines() -> None:
    text = "12:cpu,cpuacct:/system.slice/a.service\n4:memory:/system.slice/a.service\n0::/system.slice/a.service\nbad\n"
    assert own_cgroups(text) == {"cpu": "/system.slice/a.service", "cpuacct": "/system.slice/a.service",
                                 "memory": "/system.slice/a.service", "": "/system.slice/a.service"}


def test_v2_limits_are_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "self-cgroup"
    write(proc, "0::/system.slice/auditor.service\n")
    write(root / "cgroup.controllers", "cpu memory pids\n")
    write(root / "system.slice" / "memory.max", "max\n")
    write(root / "system.slice" / "cpu.max", "200000 100000\n")
    write(root / "system.slice" / "cpu.stat", "usage_usec 9\nthrottled_usec 7000000\n")
    unit = root / "system.slice" / "auditor.service"
    write(unit / "memory.max", "402653184\n")
    write(unit / "cpu.max", "50000 100000\n")
    write(unit / "cpu.stat", "usage_usec 5\nnr_throttled 3\nthrottled_usec 1500000\n")
    limits = read_cgroup_limits(root, proc)
    assert limits is not None
    assert (limits.memory_bytes, limits.cpu_cores, limits.throttled_seconds) == (402653184, 0.5, 1.5)
    write(unit / "cpu.max", "max 100000\n")  # the slice's two cores bind now, and it is the slice that throttles
    limits = read_cgroup_limits(root, proc)
    assert limits is not None and (limits.cpu_cores, limits.throttled_seconds) == (2.0, 7.0)


def test_v1_and_hybrid_limits_and_no_limit_at_all(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "self-cgroup"
    write(proc, "4:memory:/job\n2:cpu,cpuacct:/job\n0::/\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory" / "job" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu" / "job" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu" / "job" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu" / "job" / "cpu.stat", "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n")
    limits = read_cgroup_limits(root, proc)
    assert limits is not None
    assert (limits.memory_bytes, limits.cpu_cores, limits.throttled_seconds) == (math.inf, math.inf, 0.0)
    write(root / "memory" / "job" / "memory.limit_in_bytes", "268435456\n")
    write(root / "cpu" / "job" / "cpu.cfs_quota_us", "25000\n")
    write(root / "cpu" / "job" / "cpu.stat", "nr_periods 10\nnr_throttled 2\nthrottled_time 250000000\n")
    limits = read_cgroup_limits(root, proc)
    assert limits is not None
    assert (limits.memory_bytes, limits.cpu_cores, limits.throttled_seconds) == (268435456, 0.25, 0.25)


def test_garbage_in_cgroup_files_reads_as_no_limit_and_unreadable_stats_as_unknown(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "self-cgroup"
    write(proc, "0::/svc\n")
    write(root / "svc" / "memory.max", "lots\n")
    write(root / "svc" / "cpu.max", "50000 0\n")  # a zero period: not a limit
    limits = read_cgroup_limits(root, proc)
    assert limits is not None and (limits.memory_bytes, limits.cpu_cores) == (math.inf, math.inf)
    write(root / "svc" / "cpu.max", "50000 100000\n")  # a limit, but no cpu.stat to say what it did
    limits = read_cgroup_limits(root, proc)
    assert limits is not None and limits.cpu_cores == 0.5 and limits.throttled_seconds is None
    assert read_cgroup_limits(root, tmp_path / "missing") is None


def test_the_daemon_registry_serves_its_own_cost(tmp_path: Path) -> None:
    text = DaemonMetrics().registry.exposition().decode()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 'auditor_thread_cpu_seconds_total{thread="MainThread"}', "auditor_memory_limit_bytes",
                 "auditor_cpu_limit_cores"):
        assert name in text, name
    # Where the cgroup cannot be read, the limits are left out, nothing else.
    registry = Registry()
    registry.register(OwnCostCollector(proc_self_cgroup=tmp_path / "missing"))
    text = registry.exposition().decode()
    assert "auditor_thread_cpu_seconds_total" in text and "auditor_memory_limit_bytes" not in text
