"""NVML sampler against an injected NVML double raising pynvml's own error classes (no GPU here),
plus one ``gpu``-marked test against the real library."""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from collectors.nvml import NvmlSampler


def nvml_error(code: int) -> Exception:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass, e.g. NVMLError_GpuIsLost


@dataclass
class FakeNvml:
    """Two GPUs; ``broken`` maps a GPU index to the NVML error code its calls raise."""

    count: int = 2
    init_error: int | None = None
    broken: dict[int, int] = field(default_factory=dict)
    power_supported: bool = True
    process_samples: list[Any] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise nvml_error(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.calls.append(f"handle {index}")
        self._check(index)
        return index

    def _check(self, handle: int) -> None:
        if handle in self.broken:
            raise nvml_error(self.broken[handle])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        self._check(handle)
        return SimpleNamespace(gpu=90 + handle, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        self._check(handle)
        return SimpleNamespace(total=80 << 30, used=(10 + handle) << 30, free=1)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._check(handle)
        if not self.power_supported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 250_500  # milliwatts

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        self._check(handle)
        return [SimpleNamespace(pid=1000 + handle, usedGpuMemory=2 << 30),
                SimpleNamespace(pid=2000 + handle, usedGpuMemory=None)]

    def nvmlDeviceGetProcessUtilization(self, handle: int, last_seen: int) -> list[Any]:
        self._check(handle)
        self.calls.append(f"procutil {handle} since {last_seen}")
        rows = [r for r in self.process_samples if r.timeStamp > last_seen]
        if not rows:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return rows


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_gpu_and_process_samples() -> None:
    fake = FakeNvml(process_samples=[
        SimpleNamespace(pid=1000, timeStamp=5, smUtil=30, memUtil=10),
        SimpleNamespace(pid=1000, timeStamp=9, smUtil=70, memUtil=20),
    ])
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    samples = sampler.sample(1_000)
    gpu0 = [s for s in samples if s.gpu_index == 0]
    whole = gpu0[0]
    assert (whole.pid, whole.util_percent, whole.memory_util_percent) == (None, 90.0, 40.0)
    assert (whole.memory_bytes, whole.power_watts, whole.source, whole.host) == (10 << 30, 250.5, "nvml", "h")
    assert whole.interval_s is None  # first reading: no window yet
    proc_a_first, proc_a, proc_b = [s for s in gpu0 if s.pid is not None]
    # Every NVML reading is a sample at NVML's own time, covering the time since the previous one.
    assert (proc_a_first.ts_ns, proc_a_first.util_percent) == (5_000, 30.0)
    assert (proc_a.ts_ns, proc_a.util_percent, proc_a.memory_util_percent, proc_a.memory_bytes) == (9_000, 70.0, 20.0, 2 << 30)
    assert proc_a.interval_s == pytest.approx(4e-6)
    assert (proc_b.pid, proc_b.util_percent, proc_b.memory_bytes) == (2000, None, None)  # no reading: unknown
    assert sampler.health() == "ok"
    # The next read asks only for samples newer than the last one seen, and says how long the window was.
    clock.now += 0.1
    samples = sampler.sample(20_000)  # 20 us: past NVML's next update (every 4 us here)
    assert "procutil 0 since 9" in fake.calls
    assert samples[0].interval_s == pytest.approx(0.1)
    # NVML had nothing new for the process: its utilization is unknown this tick, never a made-up 0 %.
    assert [s.util_percent for s in samples if s.pid == 1000] == [None]


def test_unsupported_power_is_left_empty() -> None:
    sampler = NvmlSampler(nvml=FakeNvml(count=1, power_supported=False), monotonic=Clock())
    (whole, *_procs) = sampler.sample(1)
    assert whole.power_watts is None and whole.util_percent == 90.0
    assert sampler.health() == "ok"


def test_lost_gpu_degrades_alone_backs_off_and_recovers() -> None:
    fake = FakeNvml(broken={1: pynvml.NVML_ERROR_GPU_IS_LOST})
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, monotonic=clock, backoff_initial_s=1.0, backoff_max_s=4.0)
    samples = sampler.sample(1)
    assert {s.gpu_index for s in samples} == {0}  # GPU 0 still sampled
    assert sampler.health().startswith("degraded: gpu 1: NVMLError_GpuIsLost: GPU is lost")
    attempts = fake.calls.count("handle 1")
    clock.now += 0.5
    sampler.sample(2)
    assert fake.calls.count("handle 1") == attempts  # inside the backoff: not retried
    clock.now += 0.6
    sampler.sample(3)
    assert fake.calls.count("handle 1") == attempts + 1  # retried after 1 s, failed again: 2 s next
    clock.now += 1.5
    sampler.sample(4)
    assert fake.calls.count("handle 1") == attempts + 1
    del fake.broken[1]  # back on the bus
    clock.now += 0.6
    samples = sampler.sample(5)
    assert {s.gpu_index for s in samples} == {0, 1}
    assert sampler.health() == "ok"


def test_unknown_error_on_every_gpu_never_raises() -> None:
    fake = FakeNvml(broken={0: pynvml.NVML_ERROR_UNKNOWN, 1: pynvml.NVML_ERROR_UNKNOWN})
    sampler = NvmlSampler(nvml=fake, monotonic=Clock())
    assert sampler.sample(1) == []
    assert "gpu 0: NVMLError_Unknown" in sampler.health() and "gpu 1:" in sampler.health()
    assert sampler.errors == 2


def test_no_library_or_no_gpu_is_degraded_and_retried() -> None:
    fake = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, monotonic=clock, backoff_initial_s=2.0)
    assert sampler.sample(1) == []
    assert sampler.health().startswith("degraded: NVML unavailable (NVMLError_LibraryNotFound")
    sampler.sample(2)
    assert fake.calls.count("init") == 1  # backing off
    fake.init_error = None
    clock.now += 2.1
    assert len(sampler.sample(3)) == 6  # 2 GPUs + 2 processes each
    assert sampler.health() == "ok"
    sampler.close()
    assert fake.calls[-1] == "shutdown"
    assert NvmlSampler(nvml=FakeNvml(count=0), monotonic=clock).health() == "ok"  # not tried yet
    empty = NvmlSampler(nvml=FakeNvml(count=0), monotonic=clock)
    assert empty.sample(1) == [] and empty.health() == "degraded: NVML sees no GPU"


def test_driver_gone_reinitializes() -> None:
    fake = FakeNvml(count=1, broken={0: pynvml.NVML_ERROR_UNINITIALIZED})
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, monotonic=clock)
    assert sampler.sample(1) == []
    fake.broken.clear()
    clock.now += 5
    assert sampler.sample(2)
    assert fake.calls.count("init") == 2


@pytest.mark.gpu
def test_real_nvml() -> None:
    sampler = NvmlSampler(nvml=pynvml, host="real")
    try:
        samples = sampler.sample(1)
        assert sampler.health() == "ok", sampler.health()
        whole = [s for s in samples if s.pid is None]
        assert whole and all(0 <= (s.util_percent or 0) <= 100 and (s.memory_bytes or 0) > 0 for s in whole)
    finally:
        sampler.close()


@dataclass
class UpdatingNvml(FakeNvml):
    """An NVML that, like current drivers, updates per-process utilization every ``period_s`` and
    stamps each reading with the CPU's wall time in microseconds; ``util_at`` is the engine's real
    SM use at each moment, which the reading averages over its period."""

    now_s: float = 1_700_000_000.0
    period_s: float = 0.2
    pid: int = 4242
    util_at: Any = None

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=1 << 30)]

    def nvmlDeviceGetProcessUtilization(self, handle: int, last_seen: int) -> list[Any]:
        self.calls.append("procutil")
        latest = int(self.now_s / self.period_s) * self.period_s
        stamp = round(latest * 1e6)
        if stamp <= last_seen:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        steps = 20
        mean = sum(self.util_at(latest - self.period_s * (i + 0.5) / steps) for i in range(steps)) / steps
        return [SimpleNamespace(pid=self.pid, timeStamp=stamp, smUtil=round(mean), memUtil=5)]


def test_nvml_updating_every_200ms_sampled_every_100ms_costs_what_ran(store: Any) -> None:
    """The daemon ticks every 100 ms, NVML updates every 200 ms: half the ticks find nothing new.
    The GPU-seconds integrated from the samples must match the engine's real use, not half of it;
    and NVML is asked for per-process readings once per update, not on every tick (that call is
    NVML's dearest by far)."""
    from auditor.correlate.waste import SampleCache, wasted

    start_s = 1_700_000_000.0

    def util_at(t: float) -> float:  # busy 90 % for 3 s, then 40 %, then idle
        offset = t - start_s
        return 90.0 if 1.0 <= offset < 4.0 else 40.0 if 4.0 <= offset < 7.0 else 0.0

    fake = UpdatingNvml(count=1, now_s=start_s, util_at=util_at)
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    for _ in range(100):  # ten seconds of 100 ms ticks
        fake.now_s += 0.1
        clock.now += 0.1
        store.insert_samples(sampler.sample(int(fake.now_s * 1e9)))
    cache = SampleCache(store, "h")
    cache.refresh(int(fake.now_s * 1e9))
    window = (int((start_s + 2.0) * 1e9), int((start_s + 6.0) * 1e9))
    cost = wasted(cache, start_ns=window[0], end_ns=window[1], pid=fake.pid, sharers=lambda ts: 1)
    truth = 2.0 * 0.9 + 2.0 * 0.4  # GPU-seconds the engine really used in the window
    assert cost.gpu_seconds == pytest.approx(truth, rel=0.10), (cost.gpu_seconds, truth)
    assert sampler.update_period_s(0) == pytest.approx(0.2, abs=1e-6)
    assert 50 <= fake.calls.count("procutil") <= 53  # 100 ticks, 50 updates


@dataclass
class JitteryNvml(UpdatingNvml):
    """NVML as seen on an H200: an update about every 197.5 ms, each a few ms late or early, the
    newest reading only in each answer, a process left out of the readings while it is idle, and
    the whole GPU at 0 % then."""

    period_s: float = 0.1975
    jitter_s: float = 0.004
    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=round(self.util_at(self.now_s - 0.05)), memory=10)

    def update_at(self, k: int) -> float:
        return k * self.period_s + self.jitter_s * math.sin(k * 2.39996)  # spread, repeatable

    def nvmlDeviceGetProcessUtilization(self, handle: int, last_seen: int) -> list[Any]:
        self.calls.append("procutil")
        k = int(self.now_s / self.period_s) + 1
        while self.update_at(k) > self.now_s:
            k -= 1
        stamp = round(self.update_at(k) * 1e6)
        used = self.util_at(self.update_at(k) - self.period_s / 2)
        if stamp <= last_seen or not used:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return [SimpleNamespace(pid=self.pid, timeStamp=stamp, smUtil=round(used), memUtil=5)]


def test_per_process_readings_asked_once_an_update_lose_none_across_jitter_and_idle_spells(store: Any) -> None:
    """Asking once per NVML update saves half of NVML's dearest call, but NVML answers only its
    newest reading: an ask that comes too early or waits too long loses one. On an H200 a first
    version lost 6-11 % of a busy spell's GPU-seconds: it skipped a whole period after an early ask,
    and after an idle spell it took the idle gap (1.2 s) for the period. Every busy update here
    must be read, through updates a few ms off their period and a second of idleness."""
    from auditor.correlate.waste import SampleCache, wasted

    start_s = 1_700_000_000.0

    def util_at(t: float) -> float:  # a blip (the engine's first allocation), idle, busy 80 % for 3 s,
        offset = t - start_s        # idle for 1.2 s, busy 60 % for 3 s
        return (30.0 if 0.0 <= offset < 0.2 else 80.0 if 1.0 <= offset < 4.0 else 60.0 if 5.2 <= offset < 8.2
                else 0.0)

    fake = JitteryNvml(count=1, now_s=start_s, util_at=util_at)
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    read: set[int] = set()
    for _ in range(100):  # ten seconds of 100 ms ticks
        fake.now_s += 0.1
        clock.now += 0.1
        samples = sampler.sample(int(fake.now_s * 1e9))
        read |= {s.ts_ns // 1000 for s in samples if s.pid == fake.pid and s.util_percent}
        store.insert_samples(samples)
    busy_updates = {round(fake.update_at(k) * 1e6) for k in range(int(start_s / fake.period_s), int(fake.now_s / fake.period_s))
                    if fake.update_at(k) <= fake.now_s and util_at(fake.update_at(k) - fake.period_s / 2)}
    assert busy_updates - read == set(), f"{len(busy_updates - read)} of {len(busy_updates)} readings lost"
    assert sampler.update_period_s(0) == pytest.approx(fake.period_s, abs=0.01)
    assert fake.calls.count("procutil") <= 50  # not one a tick (100): about one an update while in use
    cache = SampleCache(store, "h")
    cache.refresh(int(fake.now_s * 1e9))
    cost = wasted(cache, start_ns=int(start_s * 1e9), end_ns=int(fake.now_s * 1e9), pid=fake.pid, sharers=lambda ts: 1)
    # What every busy reading says, each over its period: all of it is counted.
    readings_say = sum(util_at(stamp / 1e6 - fake.period_s / 2) / 100 * fake.period_s for stamp in busy_updates)
    assert cost.gpu_seconds == pytest.approx(readings_say, rel=0.03)


@dataclass
class SharedLaterNvml(JitteryNvml):
    """An H200-like NVML that lists graphics processes too, and whose whole-GPU utilization is the
    mean of the last sixth of a second (NVML's shortest sample period). A second engine (pid
    ``second_pid``, idle) gets a context from ``second_from_s``; ``graphics`` lists a graphics
    process sharing the GPU."""

    second_pid: int = 5151
    second_from_s: float = math.inf
    graphics: list[Any] = field(default_factory=list)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        steps = 20
        mean = sum(self.util_at(self.now_s - (i + 0.5) / 6 / steps) for i in range(steps)) / steps
        return SimpleNamespace(gpu=round(mean), memory=10)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        second = [SimpleNamespace(pid=self.second_pid, usedGpuMemory=1 << 20)] if self.now_s >= self.second_from_s else []
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=1 << 30), *second]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:
        return self.graphics


def busy_then_idle(start_s: float) -> Any:
    def util_at(t: float) -> float:  # busy 80 % for 3 s, idle 0.8 s, busy 60 % for 3 s, idle; 50 % at 9.5 s
        offset = t - start_s
        return (80.0 if 0.3 <= offset < 3.3 else 60.0 if 4.1 <= offset < 7.1 else 50.0 if offset >= 9.5
                else 0.0)
    return util_at


TRUTH_TO_8S = 3.0 * 0.8 + 3.0 * 0.6  # GPU-seconds the engine ran in its first 8 s


def run_ticks(fake: SharedLaterNvml, sampler: NvmlSampler, clock: Clock, store: Any, seconds: float) -> None:
    """The sampling loop's pace: 100 ms ticks while in use, a second apart once the sampler is idle
    (its first tick, before NVML is up, at once)."""
    if not fake.calls:
        store.insert_samples(sampler.sample(int(fake.now_s * 1e9)))
    end = fake.now_s + seconds
    while fake.now_s < end - 0.05:  # the float sum of 0.1 steps wanders past 1.7e9 s
        step = 1.0 if sampler.idle() else 0.1
        fake.now_s += step
        clock.now += step
        store.insert_samples(sampler.sample(int(fake.now_s * 1e9)))


def engine_cost(store: Any, fake: SharedLaterNvml, start_s: float) -> float:
    """The engine's GPU-seconds in its first 8 s. The sampler rests from about 8.2 s (a second at
    0 %), and what begins while it rests is seen from its next tick, a second later at most: the
    spell from 9.5 s is not in the window."""
    from auditor.correlate.waste import SampleCache, wasted

    cache = SampleCache(store, "h")
    cache.refresh(int(fake.now_s * 1e9))
    return wasted(cache, start_ns=int(start_s * 1e9), end_ns=int((start_s + 8.0) * 1e9), pid=fake.pid,
                  sharers=lambda ts: 1).gpu_seconds


def engine_samples(store: Any, pid: int) -> list[tuple[float, float]]:
    with store.connect() as conn:
        return [(util, interval) for util, interval in conn.all(
            "SELECT util_percent, interval_s FROM util_samples WHERE pid = :pid AND util_percent > 0 "
            "AND interval_s IS NOT NULL", {"pid": pid})]


def test_a_process_alone_on_its_gpu_is_costed_by_the_whole_gpu_without_the_per_process_call(store: Any) -> None:
    """One engine on the GPU, no graphics process: the whole GPU's utilization (a 3 us call) is the
    engine's, so NVML's per-process call (1.4 ms of CPU on an H200) is never made, and the engine's
    GPU-seconds still come out as what it ran, idle spell and the sampler's one-second rest
    included (a reading after a second at rest covers one period, not the whole second)."""
    start_s = 1_700_000_000.0
    fake = SharedLaterNvml(count=1, now_s=start_s, util_at=busy_then_idle(start_s))
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    run_ticks(fake, sampler, clock, store, 10.5)
    assert "procutil" not in fake.calls
    assert engine_cost(store, fake, start_s) == pytest.approx(TRUTH_TO_8S, rel=0.03)
    # The spell that began while the sampler rested: its first sample covers one period, not the
    # second since the tick before (at 50 % that would be 0.5 GPU-s, of which 0.35 never ran).
    assert max(interval for _, interval in engine_samples(store, fake.pid)) <= 0.2 + 1e-9

    # Asked to, it reads per process as before, and comes to the same.
    store_b = type(store)(str(store.engine.url).replace("auditor.db", "b.db"))
    fake = SharedLaterNvml(count=1, now_s=start_s, util_at=busy_then_idle(start_s))
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=Clock(), per_process_always=True)
    run_ticks(fake, sampler, sampler._monotonic, store_b, 10.5)  # type: ignore[arg-type]
    assert 20 <= fake.calls.count("procutil") <= 50
    readings_cost = engine_cost(store_b, fake, start_s)
    store_b.close()
    assert readings_cost == pytest.approx(TRUTH_TO_8S, rel=0.05)


@dataclass
class BufferingNvml(SharedLaterNvml):
    """SharedLaterNvml with NVML's buffer of whole-GPU utilization samples (``nvmlDeviceGetSamples``):
    one every ``buffer_period_s`` (200 ms on an H200), each the mean of its period, the last 15 s;
    the whole GPU's reading is the newest of them, so it lags by up to a period. (On an H200 the
    reading lags as much but is not exactly that sample: bench/nvml_cost.py compares them.)"""

    buffer_period_s: float = 0.2

    def _period_mean(self, k: int) -> float:
        steps = 20
        return sum(self.util_at(k * self.buffer_period_s - self.buffer_period_s * (i + 0.5) / steps)
                   for i in range(steps)) / steps

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        """The newest buffered sample: the last whole period, up to a period old."""
        return SimpleNamespace(gpu=round(self._period_mean(int(self.now_s / self.buffer_period_s))), memory=10)

    def nvmlDeviceGetSamples(self, handle: int, sampling_type: int, last_seen: int) -> tuple[int, list[Any]]:
        self.calls.append(f"buffer since {last_seen}")
        assert sampling_type == pynvml.NVML_GPU_UTILIZATION_SAMPLES
        newest = int(self.now_s / self.buffer_period_s)
        rows = []
        for k in range(newest - int(15 / self.buffer_period_s), newest + 1):
            stamp = round(k * self.buffer_period_s * 1e6)
            if stamp <= last_seen:
                continue
            rows.append(SimpleNamespace(timeStamp=stamp, sampleValue=SimpleNamespace(uiVal=round(self._period_mean(k)))))
        if not rows:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, rows


def spell_while_resting(start_s: float, begins_s: float) -> Any:
    def util_at(t: float) -> float:  # a blip at 0.3 s (the sampler's first use), then 70 % for 2 s
        offset = t - start_s
        return 50.0 if 0.3 <= offset < 0.5 else 70.0 if begins_s <= offset < begins_s + 2.0 else 0.0
    return util_at


def whole_gpu_cost(store: Any, now_s: float, start_s: float, end_s: float) -> float:
    from auditor.correlate.waste import SampleCache, wasted

    cache = SampleCache(store, "h")
    cache.refresh(int(now_s * 1e9))
    return wasted(cache, start_ns=int(start_s * 1e9), end_ns=int(end_s * 1e9), pid=None,
                  sharers=lambda ts: 1).gpu_seconds


@pytest.mark.parametrize("begins_s", [4.1, 4.4, 4.85])  # the rest ticks fall at 3, 4 and 5 s
def test_work_begun_while_the_sampler_rests_is_read_from_nvmls_buffer(store: Any, begins_s: float) -> None:
    """The sampler rests (a tick a second) once the GPU reads 0 % for a second, and a request that
    comes to an idle engine begins its work somewhere inside that second. The first busy reading
    averages only NVML's last period: alone, it would lose the work before that period (up to
    0.8 s here), and as the whole GPU's it would spread that period's figure over the whole
    second. At such a gap the sampler reads NVML's own buffer of the whole GPU's utilization
    (200 ms samples), so the spell costs what it ran, for the engine alone on its GPU and for
    the whole GPU alike; the buffer is read at the rest's end and every few seconds of it, not at
    every tick."""
    start_s = 1_700_000_000.0
    truth = 2.0 * 0.7
    window = (start_s + 3.5, start_s + 7.0)
    fake = BufferingNvml(count=1, now_s=start_s, util_at=spell_while_resting(start_s, begins_s))
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    run_ticks(fake, sampler, clock, store, 8.0)
    cache_cost = engine_cost_between(store, fake, *window)
    assert cache_cost == pytest.approx(truth, rel=0.05)
    assert whole_gpu_cost(store, fake.now_s, *window) == pytest.approx(truth, rel=0.05)
    reads = [call for call in fake.calls if call.startswith("buffer")]
    assert 1 <= len(reads) <= 3, reads  # after a rest, not at every tick

    # Without the buffer (a driver that keeps none): the alone reading covers one period, and part
    # of the spell is lost - what the buffer is read for.
    store_b = type(store)(str(store.engine.url).replace("auditor.db", "b.db"))
    fake_b = SharedLaterNvml(count=1, now_s=start_s, util_at=spell_while_resting(start_s, begins_s))
    clock = Clock()
    run_ticks(fake_b, NvmlSampler(nvml=fake_b, host="h", monotonic=clock), clock, store_b, 8.0)
    unbuffered = engine_cost_between(store_b, fake_b, *window)
    store_b.close()
    lost = truth - unbuffered
    assert lost > 0.05, (unbuffered, truth)  # the test stands for the change: it fails without it


def short_spells(start_s: float) -> Any:
    def util_at(t: float) -> float:  # a blip at 0.3 s, then 0.3 s at 90 % at 4.2 s and 0.5 s at 60 % at 12.3 s
        offset = t - start_s
        return (50.0 if 0.3 <= offset < 0.5 else 90.0 if 4.2 <= offset < 4.5 else 60.0 if 12.3 <= offset < 12.8
                else 0.0)
    return util_at


def test_spells_begun_and_ended_while_the_sampler_rests_are_read_from_the_buffer_every_few_seconds(store: Any) -> None:
    """A short request on an idle engine can start and finish between two of the resting
    sampler's ticks, a second apart: both ticks read 0 %. At rest the sampler reads NVML's buffer
    every few seconds (BUFFER_EVERY_S), and its non-zero samples count the spell; the zeros are
    not stored (each would repeat a 0 % reading the rest ticks made). The rest stays a rest: no
    tick at the full rate, and one buffer read a few seconds."""
    from collectors.nvml import BUFFER_EVERY_S

    start_s = 1_700_000_000.0
    fake = BufferingNvml(count=1, now_s=start_s, util_at=short_spells(start_s))
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    run_ticks(fake, sampler, clock, store, 30.0)
    # The second spell is still running at the rest tick at 12.8 s: that tick reads the buffer and
    # leaves the rest, and the next one reads NVML's last sixth of a second, 0.02 GPU-s of the spell
    # again (any tick at the full rate after a spell ends does).
    for begin, end, truth, within in ((3.8, 5.0, 0.3 * 0.9, 0.05), (11.8, 13.3, 0.5 * 0.6, 0.10)):
        window = (start_s + begin, start_s + end)
        assert engine_cost_between(store, fake, *window) == pytest.approx(truth, rel=within), begin
        assert whole_gpu_cost(store, fake.now_s, *window) == pytest.approx(truth, rel=within), begin
    reads = sum(call.startswith("buffer") for call in fake.calls)
    assert reads <= 1 + 30.0 / BUFFER_EVERY_S, reads
    with store.connect() as conn:
        resting = conn.all("SELECT interval_s FROM util_samples WHERE pid IS NULL AND ts_ns BETWEEN :a AND :b",
                           {"a": int((start_s + 5.5) * 1e9), "b": int((start_s + 11.5) * 1e9)})
    assert resting and all(interval > 0.9 for interval, in resting)  # the rest ticks alone: no buffered zeros

    # Without the buffer both spells are lost: each falls between two ticks that read 0 %.
    store_b = type(store)(str(store.engine.url).replace("auditor.db", "b.db"))
    fake_b = SharedLaterNvml(count=1, now_s=start_s, util_at=short_spells(start_s))
    clock = Clock()
    run_ticks(fake_b, NvmlSampler(nvml=fake_b, host="h", monotonic=clock), clock, store_b, 30.0)
    assert engine_cost_between(store_b, fake_b, start_s + 3.8, start_s + 5.0) == 0.0
    store_b.close()


def test_a_spell_at_rest_is_still_read_when_a_wake_right_after_a_resting_tick_brings_the_full_rate(store: Any) -> None:
    """The daemon wakes the sampling loop when a client leaves. A wake 0.25 s after a resting tick
    is no long gap (its reading covers those 0.25 s), but the rest before it still holds a spell
    that both resting ticks read as 0 %: the ticks at the full rate that follow must not be taken
    to cover it, and it is read from the buffer within BUFFER_EVERY_S."""
    start_s = 1_700_000_000.0

    def util_at(t: float) -> float:  # the blip, 0.3 s at 90 % inside a resting second, then 60 % from 5.15 s
        offset = t - start_s
        return 50.0 if 0.3 <= offset < 0.5 else 90.0 if 4.2 <= offset < 4.5 else 60.0 if 5.15 <= offset < 6.2 else 0.0

    fake = BufferingNvml(count=1, now_s=start_s, util_at=util_at)
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)

    def tick(step: float) -> None:
        fake.now_s += step
        clock.now += step
        store.insert_samples(sampler.sample(int(fake.now_s * 1e9)))

    tick(0.0)
    while fake.now_s < start_s + 4.95:  # the loop's pace: resting ticks at 3, 4 and 5 s
        tick(1.0 if sampler.idle() else 0.1)
    assert abs(fake.now_s - (start_s + 5.0)) < 1e-3 and sampler.idle()
    tick(0.25)  # the wake: 0.25 s after the resting tick (no long gap), the GPU in use since 5.15 s
    assert not sampler.idle()
    for _ in range(80):
        tick(0.1)
    assert engine_cost_between(store, fake, start_s + 4.1, start_s + 4.8) == pytest.approx(0.3 * 0.9, rel=0.05)
    assert engine_cost_between(store, fake, start_s + 5.1, start_s + 6.8) == pytest.approx(1.05 * 0.6, rel=0.10)


@dataclass
class NoBufferNvml(BufferingNvml):
    """A driver or board that keeps no sample buffer, or lets this user read none."""

    refusal: int = pynvml.NVML_ERROR_NOT_SUPPORTED

    def nvmlDeviceGetSamples(self, handle: int, sampling_type: int, last_seen: int) -> tuple[int, list[Any]]:
        self.calls.append("buffer")
        raise nvml_error(self.refusal)


@pytest.mark.parametrize("refusal", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION])
def test_a_gpu_without_a_sample_buffer_is_asked_once_and_sampled_as_before(store: Any, refusal: int) -> None:
    """Where NVML refuses the buffer for good, the sampler asks once, never again, and samples as
    it did without the buffer: nothing raised, the GPU healthy, the spell read from its ticks."""
    start_s = 1_700_000_000.0
    fake = NoBufferNvml(count=1, now_s=start_s, util_at=spell_while_resting(start_s, 4.4), refusal=refusal)
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    run_ticks(fake, sampler, clock, store, 20.0)
    assert fake.calls.count("buffer") == 1
    assert sampler.health() == "ok"
    assert 0.9 < engine_cost_between(store, fake, start_s + 3.5, start_s + 7.0) < 1.4  # its ticks, part lost


def engine_cost_between(store: Any, fake: SharedLaterNvml, start_s: float, end_s: float) -> float:
    from auditor.correlate.waste import SampleCache, wasted

    cache = SampleCache(store, "h")
    cache.refresh(int(fake.now_s * 1e9))
    return wasted(cache, start_ns=int(start_s * 1e9), end_ns=int(end_s * 1e9), pid=fake.pid,
                  sharers=lambda ts: 1).gpu_seconds


@pytest.mark.parametrize("shared_by", ["a second engine", "a graphics process"])
def test_a_process_that_stops_being_alone_is_read_per_process_and_no_time_counts_twice(store: Any, shared_by: str) -> None:
    """From 2.5 s into the first busy spell, something else has the GPU too: from then on the
    whole GPU's time is not the engine's alone, so its own readings are asked for. The first of
    them covers a period of which the whole-GPU samples already counted part: that part is not
    counted again (it would be up to 0.2 GPU-s at each change)."""
    start_s = 1_700_000_000.0
    fake = SharedLaterNvml(count=1, now_s=start_s, util_at=busy_then_idle(start_s))
    if shared_by == "a second engine":
        fake.second_from_s = start_s + 2.53
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    run_ticks(fake, sampler, clock, store, 2.5)
    assert "procutil" not in fake.calls
    if shared_by == "a graphics process":
        fake.graphics = [SimpleNamespace(pid=77, usedGpuMemory=1 << 20)]
    run_ticks(fake, sampler, clock, store, 8.0)
    assert fake.calls.count("procutil") >= 20
    assert engine_cost(store, fake, start_s) == pytest.approx(TRUTH_TO_8S, rel=0.03)


@pytest.mark.gpu
def test_real_nvml_per_process_cost_of_a_known_busy_spell(store: Any) -> None:
    """On a real GPU: this process keeps the GPU busy for 2 s (synchronized matrix products) while
    two samplers tick every 100 ms: one asking NVML per process, one as the daemon does by default
    (a process alone on its GPU costed by the whole GPU's utilization; per process where it is not
    alone). The GPU-seconds each integrates come within 10 % of the GPU's busy time by CUDA events
    around each product (drivers update the readings about every 200 ms). On an H200: 97.6 % of the
    wall busy, per-process readings 0.94 of it, the whole GPU 0.94."""
    torch = pytest.importorskip("torch", reason="the busy spell needs PyTorch with CUDA")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    from auditor.correlate.waste import SampleCache, wasted

    samplers = {"per-process": NvmlSampler(nvml=pynvml, host="per-process", per_process_always=True),
                "default": NvmlSampler(nvml=pynvml, host="default")}
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            for sampler in samplers.values():
                store.insert_samples(sampler.sample(time.time_ns()))
            time.sleep(0.1)

    a = torch.randn((8192, 8192), device="cuda", dtype=torch.float16)
    # The first product loads cuBLAS and its kernels on the host between the two events: measured
    # inside the spell, that time would count as GPU busy time that NVML never sees.
    (a @ a).sum().item()
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(1.0)
        events = []
        begin = time.time_ns()
        while time.time_ns() - begin < 2_000_000_000:
            started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
            a = (a @ a).clamp_(-1, 1)
            ended.record()
            torch.cuda.synchronize()
            events.append((started, ended))
        end = time.time_ns()
        time.sleep(1.0)  # NVML's last reading of the spell lands up to a period later
    finally:
        stop.set()
        ticker.join()
        periods = [samplers["per-process"].update_period_s(i) for i in range(4)]
        for sampler in samplers.values():
            sampler.close()
    busy_s = sum(started.elapsed_time(ended) for started, ended in events) / 1000
    costs = {}
    for host in samplers:
        cache = SampleCache(store, host)
        cache.refresh(time.time_ns())
        assert cache.series("nvml", os.getpid()) is not None, f"{host}: no sample of this process"
        costs[host] = wasted(cache, start_ns=begin - 500_000_000, end_ns=end + 500_000_000, pid=os.getpid(),
                             sharers=lambda ts: 1).gpu_seconds
    # Shown with `pytest -rA`: what docs/gpu-validation.md records of each GPU this ran on.
    print(f"busy {busy_s:.3f} s by CUDA events in {(end - begin) / 1e9:.3f} s, GPU-seconds: NVML's "
          f"per-process {costs['per-process']:.3f}, the daemon's default {costs['default']:.3f}; "
          f"update period seen per GPU (s): {periods}")
    for host, cost in costs.items():
        assert cost == pytest.approx(busy_s, rel=0.10), (host, cost, busy_s, periods)


@dataclass
class RestingNvml(FakeNvml):
    """One GPU whose whole-device utilization is ``util``, and no process on it."""

    count: int = 1
    util: int = 0

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=self.util, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return []


def test_a_gpu_at_rest_is_looked_at_once_a_second_and_at_full_rate_once_used() -> None:
    """A GPU host with nothing running: nothing to cost, so after a second of 0 % the sampler is
    idle (the loop ticks about once a second) and asks for no per-process readings (NVML's dearest
    call: 2.4 ms of CPU on an H200). The first tick that sees use brings the full rate back, and
    per-process readings are asked for until two updates after the last use seen."""
    from collectors.sampling import IDLE_INTERVAL_S, SamplingLoop

    clock = Clock()
    fake = RestingNvml()
    sampler = NvmlSampler(nvml=fake, monotonic=clock, quiet_after_s=1.0)
    wall_ns = 1_700_000_000 * 10**9  # NVML stamps readings with the wall clock, in microseconds

    def tick(seconds: float) -> None:
        clock.now += seconds
        sampler.sample(wall_ns + round((clock.now - 100.0) * 1e9))

    tick(0.0)
    assert not sampler.idle()  # at rest, but not for a second yet
    tick(1.0)
    assert sampler.idle()
    assert not any(call.startswith("procutil") for call in fake.calls)  # 0 %: nothing to ask a process
    stamp = wall_ns // 1000 + 1_100_000
    fake.util, fake.process_samples = 12, [SimpleNamespace(pid=7, timeStamp=stamp, smUtil=12, memUtil=1)]
    tick(0.2)
    assert not sampler.idle() and "procutil 0 since 0" in fake.calls
    fake.util = 0
    tick(0.1)  # 0 % whole, but in use a tick ago: the spell's last reading may be still to come
    assert not sampler.idle() and f"procutil 0 since {stamp}" in fake.calls
    asked = len(fake.calls)
    tick(1.0)  # two updates without use: nothing asked, at rest again
    tick(1.0)
    assert sampler.idle() and len(fake.calls) == asked
    fake.broken = {0: pynvml.NVML_ERROR_GPU_IS_LOST}
    tick(0.1)
    tick(10.0)  # backing off: a failing GPU keeps the full rate, not an idle one
    assert not sampler.idle()

    # The loop: about one tick a second at rest, back to its rate within a second of use.
    fake = RestingNvml()
    stored: list[Any] = []
    loop = SamplingLoop([NvmlSampler(nvml=fake, quiet_after_s=0.3)], sink=stored.extend, interval_s=0.05).start()
    try:
        time.sleep(0.5)
        at_rest = loop.ticks
        time.sleep(2.0)
        assert loop.ticks - at_rest <= 1 + 2.0 / IDLE_INTERVAL_S  # not 40 ticks of 50 ms
        fake.util = 35
        time.sleep(IDLE_INTERVAL_S + 0.1)  # the idle wait in progress ends
        used = loop.ticks
        time.sleep(0.5)
        assert loop.ticks - used >= 6
    finally:
        loop.stop()
    whole = [s for s in stored if s.pid is None]
    assert whole[-1].util_percent == 35.0
    quiet = [s for s in whole if s.util_percent == 0.0 and s.interval_s is not None]
    assert max(s.interval_s for s in quiet) > 0.8  # each quiet sample covers its whole second


@dataclass
class TwoProcessNvml(UpdatingNvml):
    """Two engines on one GPU, each update's readings stamped 3 ms apart."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in (11, 12)]

    def nvmlDeviceGetProcessUtilization(self, handle: int, last_seen: int) -> list[Any]:
        latest = int(self.now_s / self.period_s) * self.period_s
        rows = [SimpleNamespace(pid=11, timeStamp=round(latest * 1e6), smUtil=50, memUtil=5),
                SimpleNamespace(pid=12, timeStamp=round(latest * 1e6) + 3_000, smUtil=25, memUtil=5)]
        rows = [row for row in rows if row.timeStamp > last_seen and row.timeStamp <= self.now_s * 1e6]
        if not rows:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return rows


def test_readings_of_one_update_stamped_apart_are_no_period(store: Any) -> None:
    """Each answer is one update: the few ms between two processes' stamps in it are not NVML's
    period (taken as the period, every reading would cover 3 ms and the cost all but vanish)."""
    from auditor.correlate.waste import SampleCache, wasted

    start_s = 1_700_000_000.0
    fake = TwoProcessNvml(count=1, now_s=start_s)
    clock = Clock()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    for _ in range(50):
        fake.now_s += 0.1
        clock.now += 0.1
        store.insert_samples(sampler.sample(int(fake.now_s * 1e9)))
    assert sampler.update_period_s(0) == pytest.approx(0.2, abs=0.005)
    cache = SampleCache(store, "h")
    cache.refresh(int(fake.now_s * 1e9))
    window = (int((start_s + 1.0) * 1e9), int((start_s + 4.0) * 1e9))
    for pid, share in ((11, 0.5), (12, 0.25)):
        cost = wasted(cache, start_ns=window[0], end_ns=window[1], pid=pid, sharers=lambda ts: 1)
        assert cost.gpu_seconds == pytest.approx(3.0 * share, rel=0.05), (pid, cost.gpu_seconds)


@dataclass
class MigNvml(FakeNvml):
    """A MIG-enabled GPU: NVML measures no utilization of it, whole or per process."""

    count: int = 1

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetProcessUtilization(self, handle: int, last_seen: int) -> list[Any]:
        self.calls.append("procutil")
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_a_gpu_without_utilization_keeps_its_memory_and_says_its_time_is_not_costed() -> None:
    """NVML supports no utilization query on a MIG-enabled GPU. That is no lost device to retry
    forever: its memory and its processes' memory are still sampled, and health says plainly that
    its GPU time is not costed."""
    clock = Clock()
    fake = MigNvml()
    sampler = NvmlSampler(nvml=fake, host="h", monotonic=clock)
    samples = sampler.sample(1_700_000_000 * 10**9)
    whole = [s for s in samples if s.pid is None]
    assert len(whole) == 1 and whole[0].util_percent is None and whole[0].memory_bytes == 10 << 30
    assert {s.pid: s.memory_bytes for s in samples if s.pid} == {1000: 2 << 30, 2000: None}
    assert sampler.health() == "degraded: gpu 0: NVML gives no utilization for it (MIG mode?): GPU time not costed"
    clock.now += 1.0
    sampler.sample(1_700_000_001 * 10**9)
    assert fake.calls.count("handle 0") == 1 and "procutil" not in fake.calls  # not retried as lost
    assert sampler.idle()  # nothing it can measure runs: once a second


_SampleArray = ctypes.POINTER(pynvml.c_nvmlProcessUtilizationSample_t)
_RAW_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _SampleArray, ctypes.POINTER(ctypes.c_uint),
                                  ctypes.c_ulonglong)


@dataclass
class RawNvml(FakeNvml):
    """FakeNvml that also hands out a C function with nvmlDeviceGetProcessUtilization's contract,
    as pynvml's ``_nvmlGetFunctionPointer`` does: a null array or a count too small for the readings
    newer than ``lastSeen`` answers INSUFFICIENT_SIZE with the count needed; none newer answers
    NOT_FOUND. ``raw_error`` makes every raw call answer that code."""

    c_nvmlProcessUtilizationSample_t: Any = pynvml.c_nvmlProcessUtilizationSample_t
    NVMLError: Any = pynvml.NVMLError
    raw_calls: list[tuple[int, int]] = field(default_factory=list)  # (room given, readings newer)
    raw_error: int | None = None
    _keep: Any = None

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        assert name == "nvmlDeviceGetProcessUtilization"

        def call(handle: int | None, array: Any, count: Any, last_seen: int) -> int:
            rows = [r for r in self.process_samples if r.timeStamp > last_seen]
            room = count[0] if array else 0
            self.raw_calls.append((room, len(rows)))
            if self.raw_error is not None:
                return self.raw_error
            if not rows:
                return pynvml.NVML_ERROR_NOT_FOUND
            count[0] = len(rows)
            if room < len(rows):
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            for i, row in enumerate(rows):
                array[i].pid, array[i].timeStamp, array[i].smUtil, array[i].memUtil = (
                    row.pid, row.timeStamp, row.smUtil, row.memUtil)
            return pynvml.NVML_SUCCESS

        self._keep = _RAW_PROTOTYPE(call)
        return self._keep


def readings(count: int, start: int) -> list[Any]:
    return [SimpleNamespace(pid=3000 + i, timeStamp=start + i, smUtil=10 + i, memUtil=i) for i in range(count)]


def test_per_process_readings_come_in_one_driver_call_and_match_the_wrapper() -> None:
    """pynvml's wrapper asks NVML twice per read (the count, then the readings), and each is the
    dear call; the sampler's raw call asks once, with room for what the last answer needed."""
    from collectors.nvml import FIRST_CAPACITY

    raw, wrapped = RawNvml(count=1), FakeNvml(count=1)
    raw_sampler = NvmlSampler(nvml=raw, monotonic=Clock())
    wrapped_sampler = NvmlSampler(nvml=wrapped, monotonic=Clock())
    seen = []
    for tick, many in enumerate((FIRST_CAPACITY + 4, 3, FIRST_CAPACITY + 6)):
        raw.process_samples = wrapped.process_samples = readings(many, start=1_000 * (tick + 1))
        ts = 1_000_000 * (tick + 1)
        raw_samples, wrapped_samples = raw_sampler.sample(ts), wrapped_sampler.sample(ts)
        assert raw_samples == wrapped_samples
        seen.append(sorted(s.pid for s in raw_samples if s.pid is not None and s.util_percent is not None))
    assert seen == [list(range(3000, 3000 + n)) for n in (FIRST_CAPACITY + 4, 3, FIRST_CAPACITY + 6)]
    # The first read found its room too small once; after that, one call a read, the room grown
    # to what NVML asked for (and a little more), and a larger answer fits it.
    assert raw.raw_calls == [(FIRST_CAPACITY, FIRST_CAPACITY + 4), (2 * FIRST_CAPACITY + 4, FIRST_CAPACITY + 4),
                             (2 * FIRST_CAPACITY + 4, 3), (2 * FIRST_CAPACITY + 4, FIRST_CAPACITY + 6)]


def test_raw_call_errors_mean_what_the_wrapper_s_did() -> None:
    """NOT_FOUND (nothing newer) leaves the process's utilization unknown; a lost GPU degrades that
    GPU, as when pynvml's wrapper raised them."""
    raw = RawNvml(count=1, process_samples=readings(2, start=1_000))
    clock = Clock()
    sampler = NvmlSampler(nvml=raw, monotonic=clock)
    sampler.sample(1_000_000)
    raw.process_samples = []
    clock.now += 1.0
    samples = sampler.sample(2_000_000)
    assert [s.util_percent for s in samples if s.pid is not None] == [None, None]  # FakeNvml's two processes
    assert sampler.health() == "ok"
    raw.raw_error = pynvml.NVML_ERROR_GPU_IS_LOST
    clock.now += 1.0
    assert sampler.sample(3_000_000) == []
    assert sampler.health().startswith("degraded: gpu 0: NVMLError_GpuIsLost")


def test_a_driver_that_refuses_the_one_call_gets_the_wrapper_and_loses_no_reading() -> None:
    """Should a driver answer the one call with an error where pynvml's two calls work, the read is
    made again with the wrapper, and every later read too."""
    raw = RawNvml(count=1, process_samples=readings(2, start=1_000), raw_error=pynvml.NVML_ERROR_INVALID_ARGUMENT)
    clock = Clock()
    sampler = NvmlSampler(nvml=raw, monotonic=clock)
    samples = sampler.sample(1_000_000)
    assert sorted(s.pid for s in samples if s.pid is not None and s.util_percent is not None) == [3000, 3001]
    assert len(raw.raw_calls) == 1 and raw.calls.count("procutil 0 since 0") == 1
    raw.process_samples = readings(2, start=2_000)
    clock.now += 1.0
    samples = sampler.sample(2_000_000)
    assert sorted(s.pid for s in samples if s.pid is not None and s.util_percent is not None) == [3000, 3001]
    assert len(raw.raw_calls) == 1  # the wrapper from then on
    assert sampler.health() == "ok"


def test_nvml_period_is_the_median_of_the_one_period_gaps() -> None:
    """Gaps of one period give it, their median (two middle ones averaged when even); an idle spell
    of several periods is left out; fewer than three gaps give none."""
    from collectors.nvml import _Gpu

    gpu = _Gpu(index=0)
    stamp = 1_000_000
    gpu.note_update(stamp)
    for gap in (200_000, 1_000_000):
        stamp += gap
        gpu.note_update(stamp)
    assert gpu.period_us is None  # two gaps
    for gap, period in ((210_000, 205_000.0), (190_000, 200_000.0), (205_000, 202_500.0)):
        stamp += gap
        gpu.note_update(stamp)
        assert gpu.period_us == period
