"""What NVML costs the sampler on this host, and how its per-process readings compare with the GPU's
own account of a busy spell. Needs a GPU (and PyTorch on CUDA for the second part).

1. Each NVML call the sampler makes on a tick, at rest: wall and CPU microseconds (median of many),
   then a whole ``NvmlSampler.sample`` tick and the store write of its samples. At rest no process
   has a reading, so the per-process call is a single driver call that finds nothing.
2. A busy spell of this process (synchronized half-precision matrix products, ``--spell`` seconds)
   with CUDA events around every product: the GPU's busy time by the events, against the
   GPU-seconds integrated from two samplers' samples of this process (ticking every 100 ms, as
   the daemon does): one asking NVML per process, one as the daemon does by default (this process,
   alone on its GPU, costed by the whole GPU's utilization, without the dear per-process call),
   and the CPU each spends a tick.
   Then NVML is asked for everything it holds of this process (lastSeen 0): how many readings it
   answers says whether a reading not asked for in time can be read later. While that reading is
   held, a read is timed both ways: pynvml's wrapper (two driver calls: the count, then the
   readings) and the sampler's ``ProcessUtilization`` (one).
3. The whole GPU's own buffer of utilization samples (``nvmlDeviceGetSamples``, GPU utilization),
   read once after the spell: how many it holds and how far back, their period, what they add up
   to against the events, and what a read costs. If it holds every period of the last seconds, a
   sampler could read it once a second instead of ticking ten times, and lose nothing.
4. Spells begun while the sampler rests (``--rest-spells``): the daemon's sampling loop ticks once a
   second once the GPU has read 0 % for a second, and a request that comes to an idle engine
   starts somewhere inside such a second. Spells of 0.3, 1 and 3 s begin at spread moments of the
   rest second; two samplers in one loop, the default (the gap read from NVML's buffer, and the
   buffer read every few seconds at rest) and one without the buffer, cost this process (alone on
   its GPU) and the whole GPU, against the events. Before them, whether the whole GPU's reading is
   the buffer's newest sample (the sampler counts a reading that repeats it for nothing).

    python bench/nvml_cost.py [--calls 200] [--spell 2] [--rest-spells 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pynvml

from auditor.store import Store
from collectors.nvml import NvmlSampler, ProcessUtilization, sample_value
from collectors.sampling import SamplingLoop


def cost_us(call: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(median wall us, median CPU us) of ``call``; NVML errors (NotFound, NotSupported) count as calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.thread_time()
        with contextlib.suppress(pynvml.NVMLError):
            call()
        cpus.append((time.thread_time() - cpu) * 1e6)
        walls.append((time.perf_counter() - wall) * 1e6)
    return statistics.median(walls), statistics.median(cpus)


def tick_calls(handle: Any) -> dict[str, Callable[[], Any]]:
    return {
        "GetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
        "GetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
        "GetPowerUsage": lambda: pynvml.nvmlDeviceGetPowerUsage(handle),
        "GetComputeRunningProcesses": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
        "GetGraphicsRunningProcesses": lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
        "GetProcessUtilization": lambda: pynvml.nvmlDeviceGetProcessUtilization(handle, int(time.time() * 1e6)),
    }


def calls_at_rest(repeats: int) -> None:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(f"NVML calls at rest on GPU 0 ({pynvml.nvmlDeviceGetName(handle)}), median of {repeats}")
    print(f"  {'call':<32}{'wall us':>10}{'CPU us':>10}")
    for name, call in tick_calls(handle).items():
        wall, cpu = cost_us(call, repeats)
        print(f"  {name:<32}{wall:>10.0f}{cpu:>10.0f}")
    sampler = NvmlSampler(nvml=pynvml, host="bench")
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(f"sqlite:///{scratch}/a.db")
        sampler.sample(time.time_ns())
        wall, cpu = cost_us(lambda: sampler.sample(time.time_ns()), repeats)
        print(f"  {'whole tick (sample())':<32}{wall:>10.0f}{cpu:>10.0f}")
        rows = sampler.sample(time.time_ns())
        wall, cpu = cost_us(lambda: store.insert_samples(rows), repeats)
        print(f"  {'store write of its samples':<32}{wall:>10.0f}{cpu:>10.0f}   ({len(rows)} samples)")
        store.close()
    sampler.close()


def timed_spell(torch: Any, a: Any, seconds: float) -> tuple[Any, int, int, float, int]:
    """Synchronized matrix products for ``seconds`` of wall time, CUDA events around each: the
    last product, the spell's wall-clock begin and end (ns), the GPU's busy seconds by the events,
    and how many products."""
    events = []
    begin = time.time_ns()
    while time.time_ns() - begin < seconds * 1e9:
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        a = (a @ a).clamp_(-1, 1)
        ended.record()
        torch.cuda.synchronize()
        events.append((started, ended))
    return a, begin, time.time_ns(), sum(s.elapsed_time(e) for s, e in events) / 1000, len(events)


def busy_spell(seconds: float, rest_spells: int = 0) -> None:
    try:
        import torch
    except ImportError:
        print("\nbusy spell: skipped, no PyTorch here")
        return
    if not torch.cuda.is_available():
        print("\nbusy spell: skipped, PyTorch sees no CUDA GPU")
        return
    from auditor.correlate.waste import SampleCache, wasted

    with tempfile.TemporaryDirectory() as scratch:
        store = Store(f"sqlite:///{scratch}/a.db")
        samplers = {"per-process": NvmlSampler(nvml=pynvml, host="per-process", per_process_always=True),
                    "default": NvmlSampler(nvml=pynvml, host="default")}
        stop = threading.Event()
        tick_cpu: dict[str, list[float]] = {host: [] for host in samplers}

        def tick() -> None:
            while not stop.is_set():
                for host, sampler in samplers.items():
                    cpu = time.thread_time()
                    store.insert_samples(sampler.sample(time.time_ns()))
                    tick_cpu[host].append((time.thread_time() - cpu) * 1e6)
                time.sleep(0.1)

        a = torch.randn((8192, 8192), device="cuda", dtype=torch.float16)
        (a @ a).sum().item()  # warm: the first product loads its kernels
        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(1.0)
        a, begin, end, gpu_busy_s, products = timed_spell(torch, a, seconds)
        time.sleep(1.0)
        stop.set()
        ticker.join()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            buffered = [r for r in pynvml.nvmlDeviceGetProcessUtilization(handle, 0) if r.pid == os.getpid()]
        except pynvml.NVMLError:
            buffered = []
        # With a reading to return, pynvml's wrapper makes both of its driver calls.
        one_call = ProcessUtilization(pynvml)
        read_costs = {"pynvml's wrapper (2 calls)": cost_us(lambda: pynvml.nvmlDeviceGetProcessUtilization(handle, 0), 20)}
        if one_call.one_call:
            read_costs["the sampler's (1 call)"] = cost_us(lambda: one_call(handle, 0), 20)
        period = samplers["per-process"].update_period_s(0)
        costs = {}
        for host, sampler in samplers.items():
            sampler.close()
            cache = SampleCache(store, host)
            cache.refresh(time.time_ns())
            costs[host] = wasted(cache, start_ns=begin - 500_000_000, end_ns=end + 500_000_000,
                                 pid=os.getpid(), sharers=lambda ts: 1).gpu_seconds
        store.close()
    wall_s = (end - begin) / 1e9
    stamps = sorted(int(r.timeStamp) for r in buffered)
    print(f"\nBusy spell of this process: {products} products over {wall_s:.2f} s wall")
    print(f"  GPU busy by CUDA events            {gpu_busy_s:8.3f} s  ({gpu_busy_s / wall_s:.1%} of the wall)")
    for host, label in (("per-process", "per-process readings"), ("default", "the daemon's default")):
        print(f"  NVML, {label:<28}{costs[host]:8.3f} GPU-s  (ratio to events {costs[host] / gpu_busy_s:.3f}); "
              f"a tick while busy {statistics.median(tick_cpu[host]):.0f} us CPU (median of {len(tick_cpu[host])})")
    print(f"  NVML update period seen            {period} s")
    print(f"  asked for all it holds (lastSeen 0) {len(stamps)} reading(s) of this process"
          + (f", the oldest {time.time() - stamps[0] / 1e6:.2f} s old" if stamps else ""))
    for way, (wall, cpu) in read_costs.items():
        print(f"  a read with readings, {way:<27} {wall:.0f} us wall, {cpu:.0f} us CPU (median of 20)")
    try:
        buffered_whole_gpu(begin, end, gpu_busy_s)
    except Exception as exc:  # a driver without the buffer must not cost the rest of the run
        print(f"  the whole GPU's sample buffer: not read ({type(exc).__name__}: {exc})")
    calls_while_busy(torch)
    rates_against_buffer(torch)
    if rest_spells:
        spells_after_rest(torch, rest_spells)


def rates_against_buffer(torch: Any, reads: int = 30) -> None:
    """Whether the whole GPU's reading (``GetUtilizationRates``) is the newest sample of NVML's
    buffer: under a load that changes every 100 ms, each reading against the buffer's newest and
    the one before it. The sampler counts a reading that repeats the buffer's newest for nothing."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    a = torch.randn((4096, 4096), device="cuda", dtype=torch.float16)
    rng = random.Random(7)
    same_newest = same_before = 0
    ages = []
    for i in range(reads * 3):
        begin = time.perf_counter()
        while time.perf_counter() - begin < rng.uniform(0.0, 0.09):
            a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        time.sleep(max(0.0, 0.1 - (time.perf_counter() - begin)))
        if i % 3:
            continue
        rate = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        now_us = time.time_ns() // 1000
        value_type, rows = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, now_us - 2_000_000)
        points = sorted((int(r.timeStamp), sample_value(r, value_type)) for r in rows)
        if len(points) < 2:
            continue
        same_newest += rate == points[-1][1]
        same_before += rate == points[-2][1]
        ages.append((now_us - points[-1][0]) / 1e3)
    print(f"\nThe whole GPU's reading against the buffer, {reads} reads under a load changing every 100 ms:")
    print(f"  equal to the buffer's newest sample {same_newest}, to the one before it {same_before}; "
          f"the newest {statistics.median(ages):.0f} ms old (median; max {max(ages):.0f})")


def spells_after_rest(torch: Any, repeats: int) -> None:
    """Spells begun while the sampling loop rests, costed with and without NVML's buffer."""
    from auditor.correlate.waste import SampleCache, wasted

    a = torch.randn((8192, 8192), device="cuda", dtype=torch.float16)
    (a @ a).sum().item()
    hosts = {"buffer": True, "no buffer": False}  # host name: whether its sampler reads NVML's buffer
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(f"sqlite:///{scratch}/rest.db")
        samplers = [NvmlSampler(nvml=pynvml, host=host, read_buffer=read) for host, read in hosts.items()]
        loop = SamplingLoop(samplers, sink=store.insert_samples, interval_s=0.1).start()
        spells: list[tuple[float, int, int, float]] = []
        try:
            for length in (0.3, 1.0, 3.0):
                for r in range(repeats):
                    deadline = time.monotonic() + 10
                    while not loop.idle() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    time.sleep(0.2 + (r + 0.5) / repeats * 1.0)  # spread over the rest second
                    a, begin, end, busy_s, _ = timed_spell(torch, a, length)
                    spells.append((length, begin, end, busy_s))
                    time.sleep(1.5)
        finally:
            loop.stop()
            for sampler in samplers:
                sampler.close()
        now = time.time_ns()
        ratios: dict[tuple[float, str, str], list[float]] = {}
        for host in hosts:
            cache = SampleCache(store, host)
            cache.refresh(now)
            for length, begin, end, busy_s in spells:
                for whom, pid in (("this process", os.getpid()), ("whole GPU", None)):
                    cost = wasted(cache, start_ns=begin - 700_000_000, end_ns=end + 700_000_000, pid=pid,
                                  sharers=lambda ts: 1).gpu_seconds
                    ratios.setdefault((length, host, whom), []).append(cost / busy_s)
        store.close()
    print(f"\nSpells begun while the sampler rests ({repeats} of each length, spread over the rest second):"
          " NVML's GPU-seconds / the events' busy time, mean (min-max)")
    columns = [(host, whom) for host in hosts for whom in ("this process", "whole GPU")]
    print(f"  {'spell':<8}" + "".join(f"{host + ', ' + whom:>28}" for host, whom in columns))
    for length in (0.3, 1.0, 3.0):
        cells = []
        for host, whom in columns:
            found = ratios[(length, host, whom)]
            cells.append(f"{statistics.mean(found):.3f} ({min(found):.2f}-{max(found):.2f})")
        print(f"  {length:<8}" + "".join(f"{cell:>28}" for cell in cells))
    for length in (0.3, 1.0, 3.0):
        print(f"  each {length} s spell, " + "; ".join(
            f"{host}, {whom}: " + " ".join(f"{r:.2f}" for r in ratios[(length, host, whom)]) for host, whom in columns))


def buffered_whole_gpu(begin_ns: int, end_ns: int, gpu_busy_s: float) -> None:
    """NVML's buffer of whole-GPU utilization samples, read once after the spell."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    now_us = time.time_ns() // 1000
    value_type, samples = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    points = sorted((int(s.timeStamp), sample_value(s, value_type)) for s in samples)
    print(f"\nThe whole GPU's sample buffer (nvmlDeviceGetSamples, GPU utilization), read {len(points)} samples")
    if len(points) < 2:
        return
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(points)]
    low, high = (begin_ns - 500_000_000) // 1000, (end_ns + 500_000_000) // 1000
    busy_s = 0.0
    for (previous, _), (stamp, value) in itertools.pairwise(points):
        overlap = min(stamp, high) - max(previous, low)
        if overlap > 0:
            busy_s += value / 100 * overlap / 1e6
    print(f"  oldest {(now_us - points[0][0]) / 1e6:.2f} s old, newest {(now_us - points[-1][0]) / 1e6:.2f} s old; "
          f"gaps median {statistics.median(gaps) / 1e3:.1f} ms, max {max(gaps) / 1e3:.1f} ms")
    covers = points[0][0] <= low
    print(f"  over the spell: {busy_s:.3f} GPU-s (ratio to events {busy_s / gpu_busy_s:.3f})"
          + ("" if covers else "; the buffer does not reach back to the spell's start"))
    for label, since in (("everything held", 0), ("nothing new", points[-1][0])):
        wall, cpu = cost_us(lambda since=since: pynvml.nvmlDeviceGetSamples(
            handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since), 50)
        print(f"  a read of {label:<16} {wall:.0f} us wall, {cpu:.0f} us CPU (median of 50)")


def calls_while_busy(torch: Any, repeats: int = 50) -> None:
    """The same calls while this process keeps the GPU busy: products queued without waiting for
    them, so the GPU works through them while the calls are timed."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.float16)
    print(f"\nNVML calls while this process keeps GPU 0 busy, median of {repeats}")
    print(f"  {'call':<32}{'wall us':>10}{'CPU us':>10}")
    for name, call in tick_calls(handle).items():
        for _ in range(300):  # about half a second of work on an H200, queued
            a = (a @ a).clamp_(-1, 1)
        wall, cpu = cost_us(call, repeats)
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        print(f"  {name:<32}{wall:>10.0f}{cpu:>10.0f}" + ("" if busy else "   (the GPU ran out of work first)"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--spell", type=float, default=2.0)
    parser.add_argument("--rest-spells", type=int, default=3, help="spells of each length after a rest (0: none)")
    args = parser.parse_args()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"NVML unavailable here: {exc}")
        return 2
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            print("NVML sees no GPU")
            return 2
        calls_at_rest(args.calls)
        busy_spell(args.spell, args.rest_spells)
    finally:
        pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
