"""What one timer wake-up of a Python thread costs this host: the thread's own CPU for each sleep
and wake, side by side for the sleeps the daemon's threads take (the sampler's 100 ms, the
scraper's 250 ms, the correlator's 1 s, the /proc poller's 50 ms) and for short ones.

A thread that wakes to find little to do still pays this each time, so on a host where it is
large the daemon's fixed rates cost more than their work: `bench/detection.py` prints each
thread's wake-ups a second beside its CPU. The cost grows with the sleep: after a long one the
interpreter's code and data are no longer in the CPU's caches (and on a virtual machine the
virtual CPU may have been halted and resumed).

Usage: .venv/bin/python bench/wakeup_cost.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

SLEEPS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 1.0)


def wake_cost(sleep_s: float, seconds: float, wait: str) -> float:
    """Microseconds of the sleeping thread's CPU per wake-up, over about ``seconds``."""
    count = max(3, int(seconds / sleep_s))
    event = threading.Event()
    spent: list[float] = []

    def body() -> None:
        clock = time.thread_time
        for _ in range(2):  # the first sleeps warm up what a steady thread would have
            time.sleep(sleep_s)
        started = clock()
        for _ in range(count):
            if wait == "sleep":
                time.sleep(sleep_s)
            else:
                event.wait(sleep_s)
        spent.append(clock() - started)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return spent[0] / count * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description="What one timer wake-up of a Python thread costs this host.")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time of each sleep and way")
    args = parser.parse_args()
    print(f"CPU of one timer wake-up of a Python thread, us ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'sleep':>8}  {'time.sleep':>10}  {'Event.wait':>10}")
    for sleep_s in SLEEPS_S:
        print(f"{sleep_s * 1000:>6g} ms  {wake_cost(sleep_s, args.seconds, 'sleep'):>10.1f}  "
              f"{wake_cost(sleep_s, args.seconds, 'event'):>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
