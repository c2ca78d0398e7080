"""bench/memprobe: the readings a benched daemon's memory is told by, taken in a real process
that holds known amounts in Python objects and in glibc's heap."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")

# 40 MiB of small Python objects (pymalloc's arenas) and 24 MiB of blocks from malloc (glibc's heap).
CHILD = """
import ctypes, time
objects = [str(i) * 4 for i in range(400_000)]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
blocks = [libc.malloc(64 * 1024) for _ in range(384)]
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
time.sleep(1.5)
"""


def test_the_probe_tells_python_objects_from_heap_blocks(tmp_path: Path) -> None:
    out = tmp_path / "probe.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env |= {"BENCH_MEMPROBE": str(out), "BENCH_MEMPROBE_S": "0.5", "PYTHONPATH": str(REPO / "bench" / "memprobe")}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows, "no readings in 1.5 s at one each 0.5 s"
    last = rows[-1]
    assert last["rss"] == pytest.approx(last["anon"] + last["file"], abs=0.2)
    assert last["pymalloc"] >= 20, last  # 400,000 short strings and their list
    assert 18 <= last["pymalloc_live"] <= last["pymalloc"], last  # they are alive: most of the arenas
    assert last["heap_used"] >= 24, last  # the malloc'd blocks
    assert last["heap_used"] + last["pymalloc"] <= last["anon"] + 4, last  # both are anonymous memory
    assert 0 <= last["sqlite"] < 1, last  # loaded, nothing opened


def test_without_its_variable_the_probe_does_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env["PYTHONPATH"] = str(REPO / "bench" / "memprobe")
    threads = subprocess.run([sys.executable, "-c", "import threading; print(threading.active_count())"],
                             env=env, check=True, timeout=60, capture_output=True, text=True).stdout
    assert threads.strip() == "1"


# After the base reading (0.2 s), about 10 MiB from one line; then readings every 0.5 s.
TRACED_CHILD = """
import time
time.sleep(0.4)
grown = [bytes(1000) for _ in range(10_000)]
time.sleep(1.3)
"""


def test_the_trace_names_the_line_that_grew(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env |= {"BENCH_MEMTRACE": str(out), "BENCH_MEMTRACE_BASE_S": "0.2", "BENCH_MEMPROBE_S": "0.5",
            "PYTHONPATH": str(REPO / "bench" / "memprobe")}
    subprocess.run([sys.executable, "-c", TRACED_CHILD], env=env, check=True, timeout=60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows, "no readings"
    line = TRACED_CHILD.splitlines().index("grown = [bytes(1000) for _ in range(10_000)]") + 1
    where, grown, count, held = rows[-1]["top"][0]
    assert where == f"<string>:{line}", rows[-1]["top"][:3]
    assert 9.5 * 2**20 <= grown <= 11 * 2**20 and count >= 10_000, rows[-1]["top"][0]
    assert rows[-1]["held_top"][0][0] == where and rows[-1]["held"] >= held >= grown
    assert rows[-1]["grown"] >= grown - 2**20
