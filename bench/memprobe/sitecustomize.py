"""Where a benched daemon's memory is, read from inside it (bench/detection.py --memory-probe).

Python runs this module at start-up when bench/memprobe is on PYTHONPATH. With
BENCH_MEMPROBE=<file> set, a thread appends one JSON line to <file> every
BENCH_MEMPROBE_S seconds (default 60), in MiB: the process's RSS and its anonymous and
file-backed parts (/proc/self/smaps_rollup); Python's object arenas (pymalloc's own statistics,
mapped apart from malloc) and the part of them in live objects (the rest is free space an arena
keeps until all of it is free); glibc's heap, in use and free but held (mallinfo2, over all its
arenas), of which SQLite's allocations are a part (sqlite3_memory_used); the objects the garbage
collector tracks, and the CPU its collections took since start-up, young ones (generations 0 and
1) and full ones apart, each timed by the clock of the thread that ran it (``gc.callbacks``).
Free heap memory counts in RSS only where its pages are still resident: malloc_trim gives them
back without changing what mallinfo2 calls free.

With BENCH_MEMTRACE=<file> (bench/detection.py --memory-trace), tracemalloc runs from start-up and
a thread appends, every BENCH_MEMPROBE_S seconds from BENCH_MEMTRACE_BASE_S (default 120) on, the
Python allocations still held and those grown since that moment, by the line that made them. It
slows every allocation and adds its own memory: read its lines, not the RSS beside them. Anything
else leaves the process alone.
"""

import os

if os.environ.get("BENCH_MEMPROBE"):
    import ctypes
    import ctypes.util
    import json
    import re
    import sys
    import threading
    import time

    MIB = 1024 * 1024

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    def _mallinfo():
        try:
            call = ctypes.CDLL(None).mallinfo2
        except (OSError, AttributeError):  # not glibc 2.33 or later
            return lambda: None
        call.restype = _MallInfo2
        return call

    def _sqlite_used():
        path = ctypes.util.find_library("sqlite3")
        if not path:
            return lambda: None
        used = ctypes.CDLL(path).sqlite3_memory_used
        used.restype = ctypes.c_int64
        return used

    def _pymalloc() -> tuple[int | None, int | None]:
        """pymalloc's arenas and, of them, the bytes in objects alive (the rest: free blocks and
        pools, which an arena gives back only once all of it is free)."""
        read, write = os.pipe()
        saved = os.dup(2)
        os.dup2(write, 2)  # sys._debugmallocstats writes to the C stderr
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(write)
            os.close(saved)
        chunks = []
        while chunk := os.read(read, 1 << 16):
            chunks.append(chunk)
        os.close(read)
        text = b"".join(chunks)
        found = [re.search(pattern, text) for pattern in (rb"\d+ arenas \* \d+ bytes/arena\s+=\s+([\d,']+)",
                                                          rb"# bytes in allocated blocks\s+=\s+([\d,']+)")]
        arenas, blocks = (int(re.sub(rb"\D", b"", f.group(1))) if f else None for f in found)
        return arenas, blocks

    import gc

    _gc_ns = {"young": 0, "full": 0}
    _gc_count = {"young": 0, "full": 0}
    _gc_began = threading.local()

    def _time_collection(phase: str, info: dict) -> None:
        if phase == "start":
            _gc_began.ns = time.thread_time_ns()
            return
        kind = "full" if info.get("generation") == 2 else "young"
        _gc_ns[kind] += time.thread_time_ns() - getattr(_gc_began, "ns", time.thread_time_ns())
        _gc_count[kind] += 1

    gc.callbacks.append(_time_collection)

    def _probe(path: str, every_s: float) -> None:
        mallinfo, sqlite_used, started = _mallinfo(), _sqlite_used(), time.monotonic()
        with open(path, "a") as out:
            while True:
                time.sleep(every_s)
                rollup = {}
                with open("/proc/self/smaps_rollup") as smaps:
                    for line in smaps:
                        parts = line.split()
                        if len(parts) == 3 and parts[0].endswith(":"):
                            rollup[parts[0][:-1]] = int(parts[1]) * 1024
                heap, (arenas, blocks), sqlite = mallinfo(), _pymalloc(), sqlite_used()
                row = {"s": round(time.monotonic() - started), "rss": rollup.get("Rss", 0) / MIB,
                       "anon": rollup.get("Anonymous", 0) / MIB,
                       "file": (rollup.get("Rss", 0) - rollup.get("Anonymous", 0)) / MIB,
                       "pymalloc": None if arenas is None else arenas / MIB,
                       "pymalloc_live": None if blocks is None else blocks / MIB,
                       "heap_used": None if heap is None else (heap.uordblks + heap.hblkhd) / MIB,
                       "heap_free": None if heap is None else heap.fordblks / MIB,
                       "sqlite": None if sqlite is None else sqlite / MIB,
                       "gc_objects": len(gc.get_objects()),
                       "gc_young_ms": _gc_ns["young"] / 1e6, "gc_young_n": _gc_count["young"],
                       "gc_full_ms": _gc_ns["full"] / 1e6, "gc_full_n": _gc_count["full"]}
                out.write(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
                out.flush()

    threading.Thread(target=_probe, args=(os.environ["BENCH_MEMPROBE"],
                                          float(os.environ.get("BENCH_MEMPROBE_S", "60"))),
                     daemon=True, name="memprobe").start()

if os.environ.get("BENCH_MEMTRACE"):
    import json
    import threading
    import time
    import tracemalloc

    def _trace(path: str, base_s: float, every_s: float, top: int) -> None:
        """Python's allocations still held, by the line that made them, grown since ``base_s``."""
        started = time.monotonic()
        time.sleep(base_s)
        keep = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
        base = tracemalloc.take_snapshot().filter_traces(keep)
        with open(path, "a") as out:
            while True:
                time.sleep(every_s)
                now = tracemalloc.take_snapshot().filter_traces(keep)
                stats = now.compare_to(base, "lineno")
                out.write(json.dumps({
                    "s": round(time.monotonic() - started), "base_s": base_s,
                    "held": sum(stat.size for stat in stats), "grown": sum(stat.size_diff for stat in stats),
                    "top": [[f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}", stat.size_diff,
                             stat.count_diff, stat.size] for stat in stats[:top]],
                    "held_top": [[f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}", stat.size, stat.count]
                                 for stat in sorted(stats, key=lambda stat: -stat.size)[:top]]}) + "\n")
                out.flush()
                del now, stats

    tracemalloc.start(1)
    threading.Thread(target=_trace, args=(os.environ["BENCH_MEMTRACE"],
                                          float(os.environ.get("BENCH_MEMTRACE_BASE_S", "120")),
                                          float(os.environ.get("BENCH_MEMPROBE_S", "60")), 40),
                     daemon=True, name="memtrace").start()
