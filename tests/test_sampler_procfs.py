"""procfs CPU sampler on a real busy child process and on a fixture tree (vanished and reused pids)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.procfs import ProcfsSampler

# Spins one core; answers each line on stdin with its own CPU time so the test has ground truth.
BUSY = """
import sys, threading, time
def answer():
    for _ in sys.stdin:
        print(time.process_time(), flush=True)
threading.Thread(target=answer, daemon=True).start()
end = time.monotonic() + 30
while time.monotonic() < end:
    pass
"""
IDLE = "import time\ntime.sleep(30)\n"


def _cpu_seconds(child: subprocess.Popen[str]) -> float:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("?\n")
    child.stdin.flush()
    return float(child.stdout.readline())


def test_busy_child_measures_about_one_core() -> None:
    busy = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", IDLE])
    try:
        sampler = ProcfsSampler(host="h")
        sampler.set_pids([busy.pid, idle.pid])
        time.sleep(0.3)  # let the interpreters start
        cpu_before, wall_before = _cpu_seconds(busy), time.monotonic()
        assert sampler.sample(time.time_ns()) == []  # the first reading is only a baseline
        time.sleep(1.0)
        by_pid = {s.pid: s for s in sampler.sample(time.time_ns())}
        cpu_after, wall_after = _cpu_seconds(busy), time.monotonic()
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    # One spinning thread is ~100 % of a core when it gets one; on a shared machine it may get less,
    # so compare with the child's own account of its CPU time over the same second.
    truth = 100.0 * (cpu_after - cpu_before) / (wall_after - wall_before)
    measured = by_pid[busy.pid].util_percent or 0.0
    print(f"busy child: measured {measured:.1f} % of a core, child's own account {truth:.1f} %")
    assert measured > 30.0 and abs(measured - truth) < 12.0, (measured, truth)
    assert (by_pid[idle.pid].util_percent or 0) < 5.0
    sample = by_pid[busy.pid]
    assert sample.source == "procfs" and sample.gpu_index is None and sample.host == "h"
    assert sample.interval_s == pytest.approx(1.0, abs=0.2) and (sample.memory_bytes or 0) > 1 << 20
    # Both gone now: dropped quietly, and their stat files (kept open between readings) closed.
    assert sampler.sample(time.time_ns()) == []
    assert sampler._files == {}
    assert sampler.unreadable == 0


def _write_stat(root: Path, pid: int, ticks: int, start: int, comm: str = "py thon) (x", rss: int = 25) -> None:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = ["S"] + ["0"] * 10 + [str(ticks), "0"] + ["0"] * 6 + [str(start), "0", str(rss)]
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)} 0 0\n")


def test_fixture_tree_reused_pid_and_garbage(tmp_path: Path) -> None:
    now = [10.0]
    sampler = ProcfsSampler(proc_root=tmp_path, host="h", monotonic=lambda: now[0], clock_ticks=100, page_size=4096)
    _write_stat(tmp_path, 7, ticks=100, start=1)
    _write_stat(tmp_path, 8, ticks=0, start=1)
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "stat").write_text("garbage")
    sampler.set_pids([7, 8, 9, 12345])
    assert sampler.sample(1) == []
    now[0] += 2.0
    _write_stat(tmp_path, 7, ticks=300, start=1)  # 2 s of CPU in 2 s: one core
    _write_stat(tmp_path, 8, ticks=50, start=99)  # pid reused by a new process: new baseline
    (sample,) = sampler.sample(2)
    assert (sample.pid, sample.util_percent, sample.memory_bytes, sample.interval_s) == (7, 100.0, 25 * 4096, 2.0)
    assert sampler.unreadable >= 1
    assert sampler.health() == "ok"
    assert ProcfsSampler(proc_root=tmp_path / "missing").health().startswith("degraded")


def test_cpu_clock_reads_nanoseconds_not_ticks() -> None:
    """On this host the sampler reads each process's CPU clock: over a tenth of a second the clock
    ticks of /proc/<pid>/stat (10 ms) would put every reading on a multiple of a tenth of a core."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sampler = ProcfsSampler(host="h")
        assert sampler.cpu_clock
        sampler.set_pids([busy.pid])
        time.sleep(0.3)
        cpu_before, wall_before = _cpu_seconds(busy), time.monotonic()
        sampler.sample(time.time_ns())
        samples = []
        for _ in range(10):
            time.sleep(0.1)
            samples += sampler.sample(time.time_ns())
        cpu_after, wall_after = _cpu_seconds(busy), time.monotonic()
    finally:
        busy.kill()
        busy.wait()
    assert len(samples) == 10, samples
    busy_s = [s.util_percent / 100 * s.interval_s for s in samples if s.util_percent is not None]
    off_tick = [b for b in busy_s if abs(b * 100 - round(b * 100)) > 1e-7]  # a nanosecond off a 10 ms tick
    assert len(off_tick) >= 5, busy_s  # not whole clock ticks
    measured = sum(busy_s) / sum(s.interval_s for s in samples) * 100
    truth = 100.0 * (cpu_after - cpu_before) / (wall_after - wall_before)
    print(f"busy child over 10 readings of 0.1 s: measured {measured:.1f} %, child's own account {truth:.1f} %")
    assert measured > 30.0 and abs(measured - truth) < 12.0, (measured, truth)


def test_cpu_clock_reads_stat_once_a_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CPU clock the stat file is read at a pid's first reading and then once a second:
    a new process under the pid is seen there (a new baseline), resident memory is refreshed
    there, and a clock that no longer reads means the process is gone."""
    now = [10.0]
    clocks: dict[int, int | None] = {7: 0}
    sampler = ProcfsSampler(proc_root=tmp_path, host="h", monotonic=lambda: now[0], clock_ticks=100,
                            page_size=4096, cpu_clock=True)
    monkeypatch.setattr(sampler, "_cpu_ns", lambda pid: clocks.get(pid))
    _write_stat(tmp_path, 7, ticks=0, start=1)
    sampler.set_pids([7])
    assert sampler.sample(1) == []

    def step(seconds: float, cpu_ns: int | None) -> list[tuple[float, int | None]]:
        now[0] += seconds
        clocks[7] = cpu_ns
        return [(round(s.util_percent or 0, 6), s.memory_bytes) for s in sampler.sample(int(now[0] * 1e9))]

    assert step(0.5, 250_000_000) == [(50.0, 25 * 4096)]  # half a core: the clock's nanoseconds
    _write_stat(tmp_path, 7, ticks=0, start=99, rss=40)  # another process under the pid, from now on
    assert step(0.25, 500_000_000) == [(100.0, 25 * 4096)]  # the stat file is not read within the second
    assert step(0.25, 600_000_000) == []  # a second since the last read: a new start time, a new baseline
    assert step(0.1, 650_000_000) == [(50.0, 40 * 4096)]  # the new process's, its memory read with it
    assert step(0.1, None) == []  # its clock no longer reads: gone, and its baseline with it
    assert sampler._previous == {} and sampler.idle()


def test_cpu_clock_only_where_the_tree_numbers_processes_as_this_one(tmp_path: Path) -> None:
    """A CPU clock takes a pid of this process's namespace: a tree whose "self" is another pid (a
    /proc mounted from another pid namespace) or that has none (a fixture) is read by its stat files."""
    assert ProcfsSampler().cpu_clock
    assert not ProcfsSampler(proc_root=tmp_path).cpu_clock
    other, ours = tmp_path / "other", tmp_path / "ours"
    other.mkdir()
    ours.mkdir()
    (other / "self").symlink_to("1")
    (ours / "self").symlink_to(str(os.getpid()))
    assert not ProcfsSampler(proc_root=other).cpu_clock
    assert ProcfsSampler(proc_root=ours).cpu_clock
