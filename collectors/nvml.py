"""NVML sampler: per-GPU utilization, memory and power, per-process SM utilization and memory.

The NVML module is injected (``nvml=pynvml`` in production, a double in tests), so nothing needs
patching. NVML failing is an expected state, not a crash: no library or no driver leaves the
sampler degraded and retried with exponential backoff; a GPU that errors (fallen off the bus:
``NVMLError_GpuIsLost``, or ``Unknown``) is degraded on its own and retried, while the other GPUs
keep being sampled. Optional readings a board does not support (power on some boards, per-process
figures without permission) are simply left empty.

Per-process utilization is NVML's dearest call by far (1.4-2.4 ms of CPU on an H200, against 2-9
us for each of the others), and NVML answers only its newest reading of each process. pynvml's
wrapper calls it twice per read (the count, then the readings); ``ProcessUtilization`` once. It is asked
for about once per NVML update, from when the next one is due until it comes, and only while the
GPU is in use or was within the last two updates; and not at all for a process alone on its GPU
(the one compute process NVML lists there, no graphics one), whose utilization is then the whole
GPU's: all the GPU's time is that process's. On an H200 (bench/nvml_cost.py, three runs) the whole
GPU read 0.918-0.936 of a busy spell measured by CUDA events, per-process readings 0.889-0.939. Once every GPU has read 0 % for
``quiet_after_s``, the sampler says it is idle and the sampling loop ticks about once a second
instead of ten times; the first tick that sees use puts it back at the full rate. A GPU at rest
has no per-process readings to miss, and each whole-GPU sample covers the time since the one
before, so a quiet second is still counted. What a resting tick cannot tell (the GPU's use inside
the second before it: a reading averages only NVML's last period) is read from NVML's own buffer
of whole-GPU samples (``_buffered``): on an H200, spells of 0.3-3 s begun while the sampler
rested read 0.90-1.03 of their CUDA events' time with it (means by length; single spells 0.70-1.06),
0.42-0.90 alone and 1.06-1.99 as the whole GPU without (docs/gpu-validation.md, runs 11-13).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from auditor.model import UtilSample

log = logging.getLogger(__name__)

# Errors that mean the device (or NVML itself) is gone, as opposed to "this reading is unsupported".
_DEVICE_GONE = frozenset({
    "NVMLError_GpuIsLost", "NVMLError_Unknown", "NVMLError_ResetRequired", "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded", "NVMLError_LibRmVersionMismatch", "NVMLError_GpuNotFound",
    "NVMLError_Timeout", "NVMLError_IrqIssue",
})
PERIOD_WINDOW = 16  # NVML update gaps kept to estimate its period
PERIOD_MIN_GAPS = 3  # gaps seen before the period is estimated from them (until then: the default)
SHORTEST_PERIOD_US = 20_000  # NVML documents periods of 1/6 s to 1 s; a shorter gap is no period
CLOCK_AGREES_NS = 60 * 1_000_000_000
_NEEDS_REINIT = frozenset({"NVMLError_Uninitialized", "NVMLError_DriverNotLoaded"})
# nvmlDeviceGetSamples's answers that mean "never for this GPU": not asked again (auditor doctor names such GPUs).
NO_BUFFER = frozenset({"NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound"})
GPU_UTILIZATION_SAMPLES = 1  # NVML_GPU_UTILIZATION_SAMPLES: nvmlDeviceGetSamples's whole-GPU utilization
BACKFILL_GAP = 1.5  # a gap since the last tick longer than this many NVML periods is read from its buffer
BUFFER_EVERY_S = 5.0  # at rest, NVML's buffer (about 14 s deep on an H200) is read this often
Point = tuple[int, float, float]  # a buffered whole-GPU sample: wall ns, seconds covered, percent


def sample_value(sample: Any, value_type: int) -> float:
    """A buffered NVML sample's value (``nvmlDeviceGetSamples``), by the type NVML says it has."""
    names = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    return float(getattr(sample.sampleValue, names.get(value_type, "uiVal")))


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml formats its message through the library, which may be gone
        text = ""
    name = type(exc).__name__
    return f"{name}: {text}" if text and text != name else name


def _device_gone(exc: BaseException) -> bool:
    return type(exc).__name__ in _DEVICE_GONE or not type(exc).__name__.startswith("NVMLError")


NVML_SUCCESS, NVML_ERROR_NOT_FOUND, NVML_ERROR_INSUFFICIENT_SIZE = 0, 6, 7
FIRST_CAPACITY = 8  # process readings room for at first; grown to what NVML says it needs


class ProcessUtilization:
    """``nvmlDeviceGetProcessUtilization`` in one driver call. pynvml's wrapper makes two: one that
    asks how many readings there are, then one that fetches them (one call that found nothing cost
    1.4 ms of CPU on an H200; bench/nvml_cost.py times a read both ways). Here the array has room for as many readings as the last
    answer needed (NVML's documented in-out count), and grows when NVML says it is too small.
    Falls back to pynvml's wrapper when the module has no raw function pointers (a test double),
    and for good when the one call fails where the wrapper does not: readings are never lost to it."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._capacity = FIRST_CAPACITY
        self._fn: Any = None
        self._sample_type: Any = getattr(nvml, "c_nvmlProcessUtilizationSample_t", None)
        pointer = getattr(nvml, "_nvmlGetFunctionPointer", None)
        if self._sample_type is not None and pointer is not None:
            try:
                self._fn = pointer("nvmlDeviceGetProcessUtilization")
            except Exception:  # an NVML without it: the wrapper raises the same as before
                self._fn = None

    @property
    def one_call(self) -> bool:
        return self._fn is not None

    def __call__(self, handle: Any, last_seen_us: int) -> list[Any]:
        """The readings newer than ``last_seen_us``; raises NVMLError as pynvml's wrapper does
        (NotFound: none newer)."""
        if self._fn is None:
            return list(self._nvml.nvmlDeviceGetProcessUtilization(handle, last_seen_us))
        while True:
            samples = (self._sample_type * self._capacity)()  # fresh: the rows returned point into it
            count = ctypes.c_uint(self._capacity)
            ret = self._fn(handle, samples, ctypes.byref(count), ctypes.c_ulonglong(last_seen_us))
            if ret == NVML_SUCCESS:
                rows: list[Any] = samples[:count.value]
                return rows
            if ret != NVML_ERROR_INSUFFICIENT_SIZE or count.value <= self._capacity:
                error = self._nvml.NVMLError(ret)
                if ret == NVML_ERROR_NOT_FOUND or _device_gone(error):
                    raise error
                return self._wrapper_instead(handle, last_seen_us, ret)
            self._capacity = count.value + FIRST_CAPACITY  # room for a few more processes next time

    def _wrapper_instead(self, handle: Any, last_seen_us: int, ret: int) -> list[Any]:
        """The one call failed (``ret``): ask pynvml's wrapper. If it answers, this driver wants the
        two calls, and gets them from now on; if it fails too, its error is the GPU's."""
        rows = list(self._nvml.nvmlDeviceGetProcessUtilization(handle, last_seen_us))
        log.warning("NVML per-process utilization in one call failed (code %s) where two calls work; "
                    "using two from now on", ret)
        self._fn = None
        return rows


def _median(values: list[int]) -> float:
    """The median of a few integers (``statistics.median``'s answer, without the daemon importing
    ``statistics`` and, with it, ``fractions`` and ``decimal``: docs/footprint.md, thirty-fourth pass)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    failures: int = 0
    retry_at: float = 0.0
    error: str = ""
    last_seen_us: int = 0  # newest process-utilization sample already read (NVML's timestamp)
    last_sample_at: float | None = None
    seen_by_pid: dict[int, int] = field(default_factory=dict)  # newest NVML timestamp per process
    updates: list[int] = field(default_factory=list)  # recent gaps between NVML's updates, in us
    period_us: float | None = None  # NVML's update period as observed (see note_update)
    clock_offset_ns: int | None = None  # NVML's clock to the wall clock, when they differ
    used_at_us: int | None = None  # when this GPU last showed use (above 0 % whole, or a process's reading)
    no_utilization: bool = False  # NVML gives no utilization for it (a MIG-enabled GPU): memory only
    alone_until_us: dict[int, int] = field(default_factory=dict)  # a process costed by the whole GPU, until
    # Time that ticks after long gaps did not cover and NVML's buffer has not been read for yet
    # (``_buffered``): from, until.
    unread_from_us: int | None = None
    unread_until_us: int = 0
    repeats_until_ns: int | None = None  # readings repeat the newest buffered sample until NVML's next update
    no_buffer: bool = False  # NVML keeps no sample buffer for it (``_buffered``)

    def note_update(self, stamp_us: int) -> None:
        """A newer NVML update: its gap to the last one tells NVML's period. Idle spells and missed
        updates make a gap of several periods, and each update comes a few ms early or late, so the
        period is the median of the recent gaps that are one period long (under 1.5 times the
        shortest). None is trusted before PERIOD_MIN_GAPS gaps: the first is often an idle spell
        (an engine's first allocation, then nothing for a second), and as the period it would let
        one reading cover the whole spell."""
        if self.last_seen_us and stamp_us - self.last_seen_us >= SHORTEST_PERIOD_US:
            self.updates = [*self.updates[-(PERIOD_WINDOW - 1):], stamp_us - self.last_seen_us]
            if len(self.updates) >= PERIOD_MIN_GAPS:
                shortest = min(self.updates)
                self.period_us = _median([g for g in self.updates if g < 1.5 * shortest])
        self.last_seen_us = stamp_us

    def reading_due(self, now_us: int, longest_period_us: float) -> bool:
        """Whether NVML can have a per-process reading newer than the last one read. It updates
        about every ``period_us`` and answers only its newest reading of each process, so a reading
        not asked for before the next update is lost: from the expected update on, ask at every
        tick until a newer one comes. The period as estimated is capped: were it too long, waiting
        that long between asks would lose the readings in between."""
        if not (self.last_seen_us and self.period_us):
            return True
        return now_us >= self.last_seen_us + min(self.period_us, longest_period_us)

    def nvml_us(self, now_ns: int) -> int:
        """The wall clock on NVML's clock (see ``wall_ns``)."""
        return (now_ns - (self.clock_offset_ns or 0)) // 1000

    def wall_ns(self, stamp_us: int, now_ns: int) -> int:
        """NVML's timestamp on the wall clock: the CPU's wall time in microseconds on the drivers
        seen so far; were it another clock, it is mapped by its offset at the first reading."""
        if self.clock_offset_ns is None:
            self.clock_offset_ns = 0 if abs(stamp_us * 1000 - now_ns) < CLOCK_AGREES_NS else now_ns - stamp_us * 1000
        return stamp_us * 1000 + self.clock_offset_ns


class NvmlSampler:
    """Samples every GPU NVML can see; degraded, never raising, when NVML or a GPU fails."""

    name = "nvml"

    def __init__(self, nvml: Any = None, host: str = "", *, monotonic: Callable[[], float] = time.monotonic,
                 backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0,
                 per_process: bool = True, default_period_s: float = 0.2, quiet_after_s: float = 1.0,
                 per_process_always: bool = False, read_buffer: bool = True) -> None:
        self._nvml = nvml
        self.default_period_s = default_period_s  # NVML's update period until seen
        self.host = host
        self._monotonic = monotonic
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.per_process = per_process
        self.per_process_always = per_process_always  # ask per process for a GPU's only process too
        self.read_buffer = read_buffer  # read a long gap from NVML's buffer (off: to measure without)
        self._initialized = False
        self._init_failures = 0
        self._init_retry_at = 0.0
        self._init_error = ""
        self._gpus: list[_Gpu] = []
        self._process_utilization: ProcessUtilization | None = None
        self.errors = 0  # NVML calls that failed, for /metrics
        self.quiet_after_s = quiet_after_s
        self._quiet_since: float | None = None  # since when every reading said nothing runs
        self._used = False  # this tick saw some use (a GPU above 0 %, or a process's reading)

    def _backoff(self, failures: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, failures - 1)))

    # -- NVML lifecycle ---------------------------------------------------------------------
    def _init(self, now: float) -> bool:
        if self._initialized:
            return True
        if now < self._init_retry_at:
            return False
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
            self.errors += 1
            self._init_failures += 1
            self._init_retry_at = now + self._backoff(self._init_failures)
            message = _describe(exc)
            if message != self._init_error:
                log.warning("NVML unavailable (%s); retrying with backoff", message)
            self._init_error = message
            return False
        self._initialized = True
        self._init_failures = 0
        self._init_error = ""
        self._gpus = [_Gpu(index) for index in range(count)]
        self._process_utilization = ProcessUtilization(self._nvml)
        return True

    def close(self) -> None:
        if self._initialized and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                log.debug("nvmlShutdown failed", exc_info=True)
        self._initialized = False

    # -- sampling ---------------------------------------------------------------------------
    def idle(self) -> bool:
        """NVML is not up (no driver, no GPU): retried on its own back-off, at idle ticks; or every
        GPU has been at rest for ``quiet_after_s``: looked at once a second until one is not."""
        if not self._initialized:
            return True
        return self._quiet_since is not None and self._monotonic() - self._quiet_since >= self.quiet_after_s

    def sample(self, ts_ns: int) -> list[UtilSample]:
        now = self._monotonic()
        if not self._init(now):
            return []
        samples: list[UtilSample] = []
        self._used = False
        for gpu in self._gpus:
            if gpu.handle is None and now < gpu.retry_at:
                continue
            try:
                if gpu.handle is None:
                    gpu.handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                samples.extend(self._sample_gpu(gpu, ts_ns, now))
            except Exception as exc:
                self._gpu_failed(gpu, exc, now)
                if type(exc).__name__ in _NEEDS_REINIT:
                    self._initialized = False  # the driver went away: start again with nvmlInit
                    break
                continue
            if gpu.failures:
                log.info("GPU %d is back after %d failed attempts", gpu.index, gpu.failures)
            gpu.failures, gpu.error = 0, ""
        # A failing GPU counts as in use: its retries keep their own back-off, at the full rate.
        if self._used or any(g.handle is None for g in self._gpus):
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = now
        return samples

    def _gpu_failed(self, gpu: _Gpu, exc: BaseException, now: float) -> None:
        self.errors += 1
        gpu.failures += 1
        gpu.handle = None  # a lost GPU's handle is stale: look it up again on retry
        gpu.retry_at = now + self._backoff(gpu.failures)
        message = _describe(exc)
        if message != gpu.error:
            log.warning("GPU %d: %s; retrying with backoff", gpu.index, message)
        gpu.error = message

    def _optional(self, call: Callable[..., Any], *args: Any) -> Any:
        """A reading some boards lack: None when unsupported, but a lost device still raises."""
        try:
            return call(*args)
        except Exception as exc:
            if _device_gone(exc):
                raise
            return None

    def _sample_gpu(self, gpu: _Gpu, ts_ns: int, now: float) -> list[UtilSample]:
        nvml, handle = self._nvml, gpu.handle
        interval_s = None if gpu.last_sample_at is None else now - gpu.last_sample_at
        gpu.last_sample_at = now
        # None on a GPU NVML measures no utilization of (MIG enabled): its memory is still read.
        rates = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        if rates is None and not gpu.no_utilization:
            log.warning("GPU %d: NVML gives no utilization for it (MIG mode?); its processes' GPU time "
                        "is not costed, their memory still is", gpu.index)
        gpu.no_utilization = rates is None
        if rates is not None and rates.gpu:
            self._used = True
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        milliwatts = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
        # After a gap longer than NVML's period (the sampler at rest, a late tick), the newest
        # reading tells only the last period: the gap is read from NVML's own buffer instead. Not
        # for a GPU NVML gives no utilization of: its time is not costed.
        backfill, replaced = ([], False) if rates is None else self._buffered(gpu, ts_ns, interval_s,
                                                                              in_use=bool(rates.gpu))
        own_s = self._own_cover(gpu, ts_ns, interval_s, backfill if replaced else [])
        samples = [UtilSample(
            ts_ns=wall_ns, source="nvml", host=self.host, gpu_index=gpu.index, pid=None, util_percent=util,
            interval_s=covered_s,
        ) for wall_ns, covered_s, util in backfill]
        samples.append(UtilSample(
            ts_ns=ts_ns, source="nvml", host=self.host, gpu_index=gpu.index, pid=None,
            util_percent=None if rates is None else float(rates.gpu),
            memory_util_percent=None if rates is None else float(rates.memory),
            memory_bytes=int(memory.used),
            power_watts=None if milliwatts is None else float(milliwatts) / 1000.0,
            interval_s=own_s,
        ))
        if self.per_process:
            if rates is not None and rates.gpu:
                gpu.used_at_us = gpu.nvml_us(ts_ns)
            samples.extend(self._sample_processes(gpu, ts_ns, interval_s, rates, backfill, own_s))
        return samples

    def _buffered(self, gpu: _Gpu, ts_ns: int, interval_s: float | None, in_use: bool) -> tuple[list[Point], bool]:
        """The whole GPU's utilization from NVML's own buffer of it (200 ms samples, about 14 s
        deep on an H200): ``(wall ns, seconds covered, percent)`` per buffered sample, oldest
        first, and whether they replace this tick's reading. A tick at the full rate covers the
        time since the one before (its reading averages NVML's last period, longer than a tick);
        a tick after a longer gap (the loop's one-second rest, a late tick) does not, and that
        gap is read from the buffer:

        - at once when the GPU is in use at the gap's end: the tick's reading tells only the last
          period, so work begun earlier in the gap would be lost (a process alone on its GPU) or
          that period's figure spread over the whole gap (the whole GPU). The buffered samples
          replace the reading;
        - else every ``BUFFER_EVERY_S``: a spell begun and ended inside a gap reads 0 % at the
          tick. Only the buffer's non-zero samples are kept: they fall on readings of 0 %, so
          adding them counts nothing twice.

        A read costs about as much as a per-process one (1.4 ms of CPU on an H200): one at each
        rest's end and one every few seconds at rest."""
        if interval_s is None or not self.read_buffer:
            return [], False
        get_samples = getattr(self._nvml, "nvmlDeviceGetSamples", None)
        now_us = gpu.nvml_us(ts_ns)
        last_tick_us = gpu.nvml_us(ts_ns - int(interval_s * 1e9))
        period_s = max(self.default_period_s, (gpu.period_us or 0) / 1e6)
        gap = interval_s > BACKFILL_GAP * period_s
        if gap:
            gpu.unread_from_us = last_tick_us if gpu.unread_from_us is None else gpu.unread_from_us
            gpu.unread_until_us = now_us
        since_us, until_us = gpu.unread_from_us, gpu.unread_until_us
        if since_us is None or get_samples is None or gpu.no_buffer:
            return [], False
        if not ((gap and in_use) or now_us - since_us >= BUFFER_EVERY_S * 1e6):
            return [], False
        gpu.unread_from_us = None
        try:
            found = get_samples(gpu.handle, GPU_UTILIZATION_SAMPLES, since_us)
        except Exception as exc:  # NotFound: nothing newer
            if _device_gone(exc):
                raise
            if type(exc).__name__ in NO_BUFFER:
                gpu.no_buffer = True
                log.info("GPU %d: NVML keeps no sample buffer (%s): work begun while the sampler rests is "
                         "counted from its first busy reading", gpu.index, _describe(exc))
            return [], False
        value_type, rows = found
        replaces = gap and in_use
        points: list[Point] = []
        previous = since_us
        for stamp_us, util in sorted((int(row.timeStamp), sample_value(row, value_type)) for row in rows):
            if stamp_us <= previous or stamp_us > until_us:
                continue
            covered_us = min(stamp_us - previous, period_s * 1e6)  # its own period at most
            previous = stamp_us
            if util or (replaces and stamp_us > last_tick_us):  # a 0 % on a 0 % reading adds nothing
                points.append((gpu.wall_ns(stamp_us, ts_ns), covered_us / 1e6, util))
        return points, replaces and any(wall_ns > gpu.wall_ns(last_tick_us, ts_ns) for wall_ns, _, _ in points)

    def _own_cover(self, gpu: _Gpu, ts_ns: int, interval_s: float | None, backfill: list[Point]) -> float | None:
        """What this tick's whole-GPU reading covers: the time since the tick before, except after
        buffered samples replaced a reading (``backfill``). The reading averages about the last
        period, which the buffer's newest sample counted already (on an H200 it is not that
        sample's value: 3 of 30 reads equalled it, 6 the one before; it was 95 ms old at the
        median), so until NVML's next update, a period after that sample, readings cover
        nothing, and the first one after covers from then. Counted from the tick instead, a 1 s
        spell begun at rest read 1.12 of its CUDA events' time there, a 0.3 s one 1.37."""
        period_ns = int(max(self.default_period_s, (gpu.period_us or 0) / 1e6) * 1e9)
        if backfill:
            gpu.repeats_until_ns = backfill[-1][0] + period_ns
        if interval_s is None or gpu.repeats_until_ns is None:
            return interval_s
        covered_s = max(0.0, min(interval_s, (ts_ns - gpu.repeats_until_ns) / 1e9))
        if ts_ns >= gpu.repeats_until_ns:
            gpu.repeats_until_ns = None
        return covered_s

    def _sample_processes(self, gpu: _Gpu, ts_ns: int, interval_s: float | None, rates: Any,
                          backfill: list[Point], own_s: float | None) -> list[UtilSample]:
        nvml, handle = self._nvml, gpu.handle
        memory_by_pid: dict[int, int | None] = {}
        for process in self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []:
            used = getattr(process, "usedGpuMemory", None)
            memory_by_pid[int(process.pid)] = None if used is None else int(used)
        if self._alone(gpu, memory_by_pid, rates):
            return self._alone_samples(gpu, ts_ns, rates, memory_by_pid, backfill, own_s)
        # Asked for only when a reading can be new (about once per NVML update, not every tick),
        # and only while the GPU is in use or was in the last two updates: the reading of a spell's
        # last moments comes after the whole GPU already reads 0 %.
        util_rows: list[Any] = []
        now_us = gpu.nvml_us(ts_ns)
        longest_us = self.default_period_s * 1e6
        in_use = gpu.used_at_us is not None and now_us < gpu.used_at_us + 2 * min(gpu.period_us or longest_us,
                                                                                longest_us)
        if in_use and gpu.reading_due(now_us, longest_us):
            # Only samples newer than the last one read; NotFound just means "none since then".
            try:
                assert self._process_utilization is not None
                util_rows = self._process_utilization(handle, gpu.last_seen_us)
            except Exception as exc:
                if _device_gone(exc):
                    raise
            if any(row.smUtil for row in util_rows):
                gpu.used_at_us = now_us
        if in_use:
            self._used = True
        samples = self._utilization_samples(gpu, util_rows, ts_ns, memory_by_pid)
        sampled = {s.pid for s in samples}
        for pid in sorted(memory_by_pid.keys() - sampled):
            # NVML has no new reading for it yet (it updates every ~200 ms, not every tick): its
            # memory now, its utilization unknown - never a 0 % that did not happen.
            samples.append(UtilSample(
                ts_ns=ts_ns, source="nvml", host=self.host, gpu_index=gpu.index, pid=pid, util_percent=None,
                memory_bytes=memory_by_pid[pid], interval_s=interval_s,
            ))
        return samples

    def _alone(self, gpu: _Gpu, memory_by_pid: dict[int, int | None], rates: Any) -> bool:
        """Whether the GPU's one compute process is all that can use it: then the whole GPU's
        utilization is that process's, with no per-process call. A graphics process (or a board
        that cannot list them) shares it, and so does a second compute process."""
        graphics = getattr(self._nvml, "nvmlDeviceGetGraphicsRunningProcesses", None)
        if self.per_process_always or rates is None or len(memory_by_pid) != 1 or graphics is None:
            return False
        return self._optional(graphics, gpu.handle) == []

    def _alone_samples(self, gpu: _Gpu, ts_ns: int, rates: Any, memory_by_pid: dict[int, int | None],
                       backfill: list[Point], own_s: float | None) -> list[UtilSample]:
        """The only process's samples, from the whole GPU's readings: the buffered ones of a long
        gap (``_buffered``), then this tick's, covering what the whole GPU's does (``own_s``). That
        reading averages NVML's last sample period (1/6 s to 1 s by product), so after a longer gap
        with no buffer read it covers one period, not the whole gap; and none of them covers time
        that the process's last per-process reading covered already."""
        (pid, memory), = memory_by_pid.items()
        now_us = gpu.nvml_us(ts_ns)
        read_until = gpu.seen_by_pid.get(pid)
        read_until_ns = None if read_until is None else gpu.wall_ns(read_until, ts_ns)

        def covering(at_ns: int, covered_s: float) -> float:
            if read_until_ns is None:
                return covered_s
            return max(0.0, min(covered_s, (at_ns - read_until_ns) / 1e9))

        samples = [UtilSample(
            ts_ns=wall_ns, source="nvml", host=self.host, gpu_index=gpu.index, pid=pid, util_percent=util,
            interval_s=covering(wall_ns, covered_s),
        ) for wall_ns, covered_s, util in backfill]
        period_s = max(self.default_period_s, (gpu.period_us or 0) / 1e6)
        covered_s = None if own_s is None else covering(ts_ns, min(own_s, period_s))
        gpu.alone_until_us = {pid: now_us}  # no other process is on this GPU now: theirs are done
        samples.append(UtilSample(
            ts_ns=ts_ns, source="nvml", host=self.host, gpu_index=gpu.index, pid=pid,
            util_percent=float(rates.gpu), memory_util_percent=float(rates.memory),
            memory_bytes=memory, interval_s=covered_s,
        ))
        return samples

    def _utilization_samples(self, gpu: _Gpu, rows: list[Any], ts_ns: int,
                             memory_by_pid: dict[int, int | None]) -> list[UtilSample]:
        """One sample per NVML reading, at NVML's own timestamp, covering the time since the
        process's previous reading when that was the update before, else one update period (a
        process NVML skipped was idle: NVML lists only processes with some use in its last period)."""
        samples = []
        # One answer is one NVML update as far as the period goes: its processes' readings may be
        # stamped a little apart, and those gaps are not periods.
        newest = max((int(row.timeStamp) for row in rows), default=0)
        if newest > gpu.last_seen_us:
            gpu.note_update(newest)
        for row in sorted(rows, key=lambda r: int(r.timeStamp)):
            stamp_us, pid = int(row.timeStamp), int(row.pid)
            if stamp_us <= gpu.seen_by_pid.get(pid, 0):
                continue  # read already
            previous = gpu.seen_by_pid.get(pid)
            gpu.seen_by_pid[pid] = stamp_us
            # Readings one update apart tile the time exactly; after a longer gap (the process idle,
            # so NVML left it out) a reading covers one period.
            period_us = gpu.period_us or (self.default_period_s * 1e6)
            gap_us = None if previous is None else stamp_us - previous
            covered_us = gap_us if gap_us is not None and gap_us < 1.5 * period_us else period_us
            alone_until = gpu.alone_until_us.pop(pid, None)
            if alone_until is not None:  # costed by the whole GPU until then (it was alone)
                covered_us = min(covered_us, stamp_us - alone_until)
                if covered_us <= 0:
                    continue
            if row.smUtil:
                self._used = True
            samples.append(UtilSample(
                ts_ns=gpu.wall_ns(stamp_us, ts_ns), source="nvml", host=self.host, gpu_index=gpu.index,
                pid=pid, util_percent=float(row.smUtil), memory_util_percent=float(row.memUtil),
                memory_bytes=memory_by_pid.get(pid), interval_s=covered_us / 1e6,
            ))
        return samples

    def update_period_s(self, gpu_index: int) -> float | None:
        """NVML's per-process update period on that GPU as observed so far (None: not seen yet)."""
        period = next((g.period_us for g in self._gpus if g.index == gpu_index), None)
        return None if period is None else period / 1e6

    # -- health -----------------------------------------------------------------------------
    def health(self) -> str:
        now = self._monotonic()
        if not self._initialized:
            if not self._init_error:
                return "ok"  # not tried yet
            wait = max(0.0, self._init_retry_at - now)
            return f"degraded: NVML unavailable ({self._init_error}); retry in {wait:.0f} s"
        if not self._gpus:
            return "degraded: NVML sees no GPU"
        broken = [f"gpu {g.index}: {g.error} (retry in {max(0.0, g.retry_at - now):.0f} s)"
                  for g in self._gpus if g.error]
        broken += [f"gpu {g.index}: NVML gives no utilization for it (MIG mode?): GPU time not costed"
                   for g in self._gpus if g.no_utilization and not g.error]
        return "degraded: " + "; ".join(broken) if broken else "ok"
