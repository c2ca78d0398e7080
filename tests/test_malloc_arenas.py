"""The daemon caps glibc's malloc arenas (auditor.service.limit_malloc_arenas), counted in a real
process by glibc's own malloc_stats(), and hands the heap's free pages back now and then
(auditor.service.HeapTrim), seen in a real process's RSS."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.service import MALLOC_ARENAS

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="arenas and malloc_stats are glibc's")

# Threads that each allocate a block too large for Python's own allocator, all alive at once,
# then glibc prints one "Arena N:" section per arena to stderr.
CHILD = """
import ctypes, sys, threading
from auditor.service import limit_malloc_arenas
print(limit_malloc_arenas() if sys.argv[1] == "cap" else None, flush=True)
threads = 24
all_in, done = threading.Barrier(threads + 1), threading.Event()
held = []

def work():
    held.append(ctypes.create_string_buffer(64 * 1024))
    all_in.wait()
    done.wait()

pool = [threading.Thread(target=work) for _ in range(threads)]
for thread in pool:
    thread.start()
all_in.wait()
ctypes.CDLL(None).malloc_stats()
done.set()
for thread in pool:
    thread.join()
"""


def arenas(mode: str, **env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    environ["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=environ, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip(), len(re.findall(r"^Arena \d+:", out.stderr, re.M))


def test_threads_share_two_arenas_once_capped_and_one_each_otherwise() -> None:
    said, capped = arenas("cap")
    assert said == "True"
    assert 1 <= capped <= MALLOC_ARENAS
    _, default = arenas("default")
    assert default > MALLOC_ARENAS * 2, f"glibc's default gave only {default} arenas to 24 threads"


def test_an_arena_count_the_user_set_is_left_alone() -> None:
    said, count = arenas("cap", MALLOC_ARENA_MAX="4")
    assert said == "False"
    assert MALLOC_ARENAS < count <= 4


def heap_holes(every_s: float) -> tuple[float, float | None, float]:
    """RSS in MiB of a process with 32 MiB of holes in its heap (bench/heap_trim.py's, which says
    how); after a trim if ``HeapTrim(every_s).maybe()`` trimmed; at the end."""
    sys.path.insert(0, str(REPO / "bench"))
    from heap_trim import heap_holes as run

    got = run(holes_mib=32, block_kib=64, every_s=every_s)
    return got["before"], got["trimmed"], got["end"]


def test_a_due_trim_gives_the_heaps_free_pages_back() -> None:
    before, trimmed, _ = heap_holes(every_s=0)
    assert trimmed is not None, "malloc_trim gave nothing back from 32 MiB of holes"
    assert before - trimmed > 24, f"RSS {before:.0f} -> {trimmed:.0f} MiB: the holes' pages stayed resident"


def test_a_trim_not_yet_due_leaves_the_heap_alone() -> None:
    before, trimmed, end = heap_holes(every_s=3600)
    assert trimmed is None, "trimmed before it was due"
    assert before - end < 4, f"RSS {before:.0f} -> {end:.0f} MiB without a trim"
