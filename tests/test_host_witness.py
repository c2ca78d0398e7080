"""The end-to-end tests' witness of the host (tests.e2e.HostWitness): a stall it suffers is told
where it happened, and nowhere else."""

from __future__ import annotations

import os
import signal
import time

from tests.e2e import HostWitness


def test_a_stall_is_told_near_it_and_not_elsewhere() -> None:
    with HostWitness(stall_s=0.3) as witness:
        time.sleep(0.3)
        assert witness.near(0, time.time_ns()) == []  # a calm host: nothing
        stopped_at = time.time_ns()
        pid = witness.pid
        os.kill(pid, signal.SIGSTOP)  # what a paused machine does to every process on it
        time.sleep(0.8)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
    told = witness.near(stopped_at, stopped_at)
    assert len(told) == 1 and told[0].startswith("the host stalled"), told
    assert 0.75 <= float(told[0].split()[3]) < 3, told
    assert witness.near(stopped_at + 3_000_000_000, stopped_at + 4_000_000_000) == []
