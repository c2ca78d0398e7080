"""NVML sampler against an injected NVML double raising pynvml's own error classes (no GPU here),
plus one ``gpu``-marked test against the real library."""

from __future__ import annotations

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
    whole, proc_a, proc_b = gpu0
    assert (whole.pid, whole.util_percent, whole.memory_util_percent) == (None, 90.0, 40.0)
    assert (whole.memory_bytes, whole.power_watts, whole.source, whole.host) == (10 << 30, 250.5, "nvml", "h")
    assert whole.interval_s is None  # first reading: no window yet
    assert (proc_a.pid, proc_a.util_percent, proc_a.memory_util_percent, proc_a.memory_bytes) == (1000, 70.0, 20.0, 2 << 30)
    assert (proc_b.pid, proc_b.util_percent, proc_b.memory_bytes) == (2000, 0.0, None)
    assert sampler.health() == "ok"
    # The next read asks only for samples newer than the last one seen, and says how long the window was.
    clock.now += 0.1
    samples = sampler.sample(2_000)
    assert "procutil 0 since 9" in fake.calls
    assert samples[0].interval_s == pytest.approx(0.1)
    assert [s.util_percent for s in samples if s.pid == 1000] == [0.0]  # no new sample: idle


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
