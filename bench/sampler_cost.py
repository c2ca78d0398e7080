"""What the sampling thread costs on a host without a GPU, tick by tick: its own CPU (the scheduler's
nanoseconds of that one thread), the /proc sampler following engine processes at the daemon's 10
readings a second, and how far each reading is from the processes' own account of their CPU.

Each run is a fresh process: the sampling loop (``collectors.sampling.SamplingLoop``) with one
``ProcfsSampler`` following ``--processes`` busy children (each four threads that compute and
sleep, as an engine's do), for ``--seconds``. Each child reports its own CPU time
(``time.process_time``) at the start and the end, so the bench also prints how far the sum of the
sampler's readings is from the truth.

With ``--compare REV`` git revision REV's sampler runs too, alternately, each tree in its own
processes (``--rounds``). On a virtual machine a tick costs much more than its work in a warm loop:
the thread wakes cold after each sleep (docs/footprint.md, the fifth pass). ``--calls`` shows it
call by call: each of a tick's parts timed by the thread's clock back to back and right after a
100 ms sleep (medians), in the working tree.

Usage: .venv/bin/python bench/sampler_cost.py [--seconds 10] [--rounds 3] [--processes 2] [--compare REV] [--calls]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INTERVAL_S = 0.1  # sampler.interval_ms's default

ENGINE = """
import sys, threading, time
def work():
    while True:
        sum(range(20000))
        time.sleep(0.003)
for _ in range(4):
    threading.Thread(target=work, daemon=True).start()
for _ in sys.stdin:
    print(time.process_time(), flush=True)
"""


def _cpu_of(child: subprocess.Popen[str]) -> float:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("?\n")
    child.stdin.flush()
    return float(child.stdout.readline())


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` engine-like processes, started and given half a second; killed on the way out."""
    children = [subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) for _ in range(count)]
    try:
        time.sleep(0.5)
        yield children
    finally:
        for child in children:
            child.kill()
            child.wait()


def measure(processes: int, seconds: float) -> dict[str, float]:
    """The sampling thread's CPU, in this process (whose ``collectors`` is the tree under test)."""
    from collectors.procfs import ProcfsSampler
    from collectors.sampling import SamplingLoop

    with busy_processes(processes) as children:
        samples: list = []
        sampler = ProcfsSampler()
        sampler.set_pids([child.pid for child in children])
        loop = SamplingLoop([sampler], sink=samples.extend, interval_s=INTERVAL_S).start()
        time.sleep(1.0)
        thread = loop._thread
        assert thread is not None and thread.native_id is not None
        schedstat = Path(f"/proc/self/task/{thread.native_id}/schedstat")
        truth_before = [_cpu_of(child) for child in children]
        before, ticks, started = int(schedstat.read_text().split()[0]), loop.ticks, time.monotonic()
        taken = len(samples)
        time.sleep(seconds)
        spent, ticked, wall = int(schedstat.read_text().split()[0]) - before, loop.ticks - ticks, time.monotonic() - started
        measured = sum(s.util_percent / 100 * s.interval_s for s in samples[taken:])
        truth = sum(_cpu_of(child) for child in children) - sum(truth_before)
        loop.stop()
    return {"percent": spent / 1e9 / wall * 100, "us_per_tick": spent / 1e3 / max(1, ticked),
            "measured_cpu_s": measured, "truth_cpu_s": truth}


def calls(processes: int, samples: int = 60) -> None:
    """Each part of a tick, back to back and after a 100 ms sleep: medians of ``samples`` calls."""
    from collectors.procfs import ProcfsSampler, process_cpu_clock
    from collectors.sampling import SamplingLoop

    with busy_processes(processes) as children:
        pid = children[0].pid
        sampler = ProcfsSampler()
        sampler.set_pids([child.pid for child in children])
        loop = SamplingLoop([sampler], sink=lambda samples: None, interval_s=INTERVAL_S)
        loop.run_once()
        held = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        parts = (("time.monotonic()", time.monotonic),
                 ("a read of /proc/<pid>/stat, held open", lambda: os.pread(held, 4096, 0)),
                 ("the same, parsed for utime + stime", lambda: sampler._read(pid)),
                 ("the process's CPU clock", lambda: time.clock_gettime_ns(process_cpu_clock(pid))),
                 ("the sampling loop's idle check", loop.idle),
                 (f"one tick, {processes} processes followed", loop.run_once))
        print(f"a tick's parts, us of the thread's CPU, medians of {samples} calls:")
        print(f"  {'':<44}{'back to back':>14}{'after 100 ms':>14}")
        for name, call in parts:
            cells = []
            for pause in (0.0, 0.1):
                spent = []
                for _ in range(samples):
                    if pause:
                        time.sleep(pause)
                    began = time.thread_time_ns()
                    call()
                    spent.append(time.thread_time_ns() - began)
                cells.append(statistics.median(spent) / 1e3)
            print(f"  {name:<44}" + "".join(f"{cell:>14.1f}" for cell in cells))
        os.close(held)


def child(tree: Path, processes: int, seconds: float) -> dict[str, float]:
    result = subprocess.run([sys.executable, __file__, "--child", "--processes", str(processes),
                             "--seconds", str(seconds)],
                            env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                            check=True, capture_output=True, text=True)
    answer: dict[str, float] = json.loads(result.stdout)
    return answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time of each run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree")
    parser.add_argument("--processes", type=int, default=2, help="engine processes followed (the detection bench runs two)")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV's sampler, alternately")
    parser.add_argument("--calls", action="store_true",
                        help="time each part of a tick, back to back and after a 100 ms sleep (working tree)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seconds <= 0 or args.rounds < 1 or args.processes < 1:
        parser.error("--seconds must be positive, --rounds and --processes at least 1")
    if args.calls:
        sys.path.insert(0, str(REPO))
        calls(args.processes)
        return 0
    if args.child:
        print(json.dumps(measure(args.processes, args.seconds)))
        return 0
    trees = {"working tree": REPO}
    work = None
    if args.compare:
        sys.path.insert(0, str(REPO))
        from bench.ingest import export_tree

        work = tempfile.TemporaryDirectory(prefix="sampler-cost-")
        trees = {args.compare: export_tree(args.compare, Path(work.name)), "working tree": REPO}
    results: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for round_no in range(1, args.rounds + 1):
        for label, tree in trees.items():
            results[label].append(child(tree, args.processes, args.seconds))
        print(f"round {round_no} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"sampling thread at {1 / INTERVAL_S:g} readings a second, following {args.processes} busy processes; "
          f"medians of {args.rounds} runs of {args.seconds:g} s")
    print(f"  {'':<44}" + "".join(f"{label:>16}" for label in trees))
    rows = (("% of one core (its own CPU)", lambda r: f"{r['percent']:.3f}"),
            ("us a tick", lambda r: f"{r['us_per_tick']:.0f}"),
            ("readings' CPU-s against the processes' own, %",
             lambda r: f"{(r['measured_cpu_s'] / r['truth_cpu_s'] - 1) * 100:+.1f}" if r["truth_cpu_s"] else "-"))
    for title, cell in rows:
        cells = []
        for label in trees:
            runs = results[label]
            values = [cell(run) for run in runs]
            numeric = [float(v) for v in values if v != "-"]
            cells.append(f"{statistics.median(numeric):.3f}".rstrip("0").rstrip(".") if numeric else "-")
        print(f"  {title:<44}" + "".join(f"{c:>16}" for c in cells))
    for label in trees:
        print(f"  {label} runs, us a tick: " + ", ".join(f"{run['us_per_tick']:.0f}" for run in results[label]))
    if work is not None:
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
