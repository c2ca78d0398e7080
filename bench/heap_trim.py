"""What one of the daemon's heap trims (auditor.service.HeapTrim, malloc_trim(0) once a minute)
costs and gives back, on a heap with holes: blocks below glibc's mmap threshold, every other one
freed, at three sizes. Each size runs in a fresh process. ``heap_holes`` is that process, which
tests/test_malloc_arenas.py runs too.

Usage: .venv/bin/python bench/heap_trim.py [--holes-mib 8 32 128] [--block-kib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Blocks below glibc's mmap threshold come from the heap; every other one freed leaves holes below
# live blocks, which glibc keeps resident until malloc_trim gives their pages back. Then one
# HeapTrim(every_s).maybe() and, at once, a second.
CHILD = """
import ctypes, json, sys, time
from auditor.service import HeapTrim

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

holes_mib, block, every_s = int(sys.argv[1]), int(sys.argv[2]) * 1024, float(sys.argv[3])
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
blocks = [libc.malloc(block) for _ in range(2 * holes_mib * 1024 * 1024 // block)]
for b in blocks:
    ctypes.memset(b, 1, block)  # resident
for b in blocks[::2]:
    libc.free(b)
before = rss_mib()
trim = HeapTrim(every_s=every_s)
cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
trimmed = trim.maybe()
cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
after = rss_mib()
again = time.thread_time_ns()
trim.maybe()  # again at once: not due, or nothing left to give back
again = time.thread_time_ns() - again
print(json.dumps({"before": before, "trimmed": after if trimmed else None, "end": rss_mib(),
                  "cpu_ms": cpu / 1e6, "wall_ms": wall / 1e6, "again_cpu_ms": again / 1e6}))
"""


def heap_holes(holes_mib: int = 32, block_kib: int = 64, every_s: float = 0.0) -> dict[str, Any]:
    """A fresh process's heap with ``holes_mib`` of holes, and one ``HeapTrim(every_s).maybe()`` on
    it: RSS in MiB before, after it if it trimmed (else None) and at the end; CPU of the trim and
    of a second one at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(holes_mib), str(block_kib), str(every_s)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holes-mib", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--block-kib", type=int, default=64, help="below glibc's mmap threshold (128 KiB)")
    args = parser.parse_args()
    print(f"{'holes, MiB':>10} {'RSS before':>11} {'after':>7} {'trim CPU ms':>12} {'wall ms':>8} {'again CPU ms':>13}")
    for holes in args.holes_mib:
        got = heap_holes(holes, args.block_kib)
        after = got["trimmed"] if got["trimmed"] is not None else got["end"]
        print(f"{holes:>10} {got['before']:>11.1f} {after:>7.1f} {got['cpu_ms']:>12.3f} {got['wall_ms']:>8.3f} "
              f"{got['again_cpu_ms']:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
