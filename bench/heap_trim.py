"""What one of the daemon's heap trims (auditor.service.HeapTrim, malloc_trim(0) once a minute)
costs and gives back, on a heap with holes: blocks below glibc's mmap threshold, every other one
freed, at three sizes. Each size runs in a fresh process.

Usage: .venv/bin/python bench/heap_trim.py [--holes-mib 8 32 128] [--block-kib 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import ctypes, sys, time
from auditor.service import HeapTrim

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

holes_mib, block = int(sys.argv[1]), int(sys.argv[2]) * 1024
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
blocks = [libc.malloc(block) for _ in range(2 * holes_mib * 1024 * 1024 // block)]
for b in blocks:
    ctypes.memset(b, 1, block)
for b in blocks[::2]:
    libc.free(b)
before = rss_mib()
trim = HeapTrim(every_s=0)
cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
trim.maybe()
cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
after = rss_mib()
cpu2 = time.thread_time_ns()
trim.maybe()  # again at once: nothing left to give back
cpu2 = time.thread_time_ns() - cpu2
print(before, after, cpu / 1e6, wall / 1e6, cpu2 / 1e6)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holes-mib", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--block-kib", type=int, default=64, help="below glibc's mmap threshold (128 KiB)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"PYTHONPATH": str(REPO)}
    print(f"{'holes, MiB':>10} {'RSS before':>11} {'after':>7} {'trim CPU ms':>12} {'wall ms':>8} {'again CPU ms':>13}")
    for holes in args.holes_mib:
        out = subprocess.run([sys.executable, "-c", CHILD, str(holes), str(args.block_kib)], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()
        before, after, cpu, wall, again = map(float, out)
        print(f"{holes:>10} {before:>11.1f} {after:>7.1f} {cpu:>12.3f} {wall:>8.3f} {again:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
