"""Where a benched daemon's memory is, read from inside it (bench/detection.py --memory-probe).

Python runs this module at start-up when bench/memprobe is on PYTHONPATH. With
BENCH_MEMPROBE=<file> set, a thread appends one JSON line to <file> every
BENCH_MEMPROBE_S seconds (default 60), in MiB: the process's RSS and its anonymous and
file-backed parts (/proc/self/smaps_rollup); Python's object arenas (pymalloc's own statistics,
mapped apart from malloc); glibc's heap, in use and free but held (mallinfo2, over all its
arenas), of which SQLite's allocations are a part (sqlite3_memory_used). Free heap memory counts
in RSS only where its pages are still resident: malloc_trim gives them back without changing
what mallinfo2 calls free. Anything else leaves the process alone.
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

    def _pymalloc_arenas() -> int | None:
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
        found = re.search(rb"\d+ arenas \* \d+ bytes/arena\s+=\s+([\d,']+)", b"".join(chunks))
        return int(re.sub(rb"\D", b"", found.group(1))) if found else None

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
                heap, arenas, sqlite = mallinfo(), _pymalloc_arenas(), sqlite_used()
                row = {"s": round(time.monotonic() - started), "rss": rollup.get("Rss", 0) / MIB,
                       "anon": rollup.get("Anonymous", 0) / MIB,
                       "file": (rollup.get("Rss", 0) - rollup.get("Anonymous", 0)) / MIB,
                       "pymalloc": None if arenas is None else arenas / MIB,
                       "heap_used": None if heap is None else (heap.uordblks + heap.hblkhd) / MIB,
                       "heap_free": None if heap is None else heap.fordblks / MIB,
                       "sqlite": None if sqlite is None else sqlite / MIB}
                out.write(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
                out.flush()

    threading.Thread(target=_probe, args=(os.environ["BENCH_MEMPROBE"],
                                          float(os.environ.get("BENCH_MEMPROBE_S", "60"))),
                     daemon=True, name="memprobe").start()
