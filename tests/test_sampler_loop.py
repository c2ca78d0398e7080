"""SamplingLoop: drift-free ticks, skipped ticks when late, failing samplers and sinks isolated."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator

from sqlalchemy import text

from auditor.model import UtilSample
from auditor.store import Store
from collectors.procfs import QUIET_PERCENT, ProcfsSampler
from collectors.sampling import Sampler, SamplingLoop


class Recorder:
    name = "recorder"

    def __init__(self, slow_on_tick: int | None = None) -> None:
        self.ticks: list[float] = []
        self.slow_on_tick = slow_on_tick

    def sample(self, ts_ns: int) -> list[UtilSample]:
        self.ticks.append(time.monotonic())
        if self.slow_on_tick is not None and len(self.ticks) == self.slow_on_tick:
            time.sleep(0.35)
        return [UtilSample(ts_ns=ts_ns, source="test", util_percent=1.0)]

    def health(self) -> str:
        return "ok"


class Broken:
    name = "broken"

    def sample(self, ts_ns: int) -> list[UtilSample]:
        raise RuntimeError("device on fire")

    def health(self) -> str:
        return "ok"


def test_ticks_do_not_drift_and_late_ticks_are_skipped() -> None:
    recorder = Recorder(slow_on_tick=5)
    assert isinstance(recorder, Sampler)
    stored: list[UtilSample] = []
    loop = SamplingLoop([recorder], sink=stored.extend, interval_s=0.1).start()
    time.sleep(1.25)
    loop.stop()
    ticks = recorder.ticks
    start = ticks[0]
    # Every tick sits on the start + k * interval grid (within scheduling noise), never sliding.
    offsets = [(t - start) / 0.1 for t in ticks]
    assert all(abs(k - round(k)) < 0.4 for k in offsets), offsets
    assert loop.skipped_ticks >= 3  # the 0.35 s stall cost ticks, which were skipped, not bunched
    assert len(ticks) <= 13 - 3 + 1
    assert len(stored) == len(ticks) == loop.stats()["samples_written"]


def test_failing_sampler_and_sink_are_isolated(store: Store) -> None:
    recorder = Recorder()
    calls = {"n": 0}

    def flaky_sink(samples: Iterable[UtilSample]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("database is locked")
        store.insert_samples(samples)

    loop = SamplingLoop([Broken(), recorder], sink=flaky_sink, interval_s=0.05)
    loop.run_once()
    health = loop.health()
    assert health["broken"] == "degraded: RuntimeError: device on fire"
    assert health["recorder"] == "ok" and health["sink"] == "degraded: database is locked"
    assert loop.samples_lost == 1
    loop.run_once()
    assert "sink" not in loop.health() and loop.samples_written == 1


@contextlib.contextmanager
def child(code: str) -> Iterator[int]:
    """A Python child running ``code`` (bounded to 30 s), killed on leaving."""
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end:\n    pass\n"
SLEEP = "import time\ntime.sleep(30)\n"


def test_procfs_samples_reach_the_store(store: Store) -> None:
    with child(SPIN) as pid:
        sampler = ProcfsSampler(host="h")
        sampler.set_pids([pid])
        loop = SamplingLoop([sampler], sink=store.insert_samples, interval_s=0.05).start()
        time.sleep(0.4)
        loop.stop()
    assert loop.health() == {"procfs": "ok"}
    with store.session() as session:
        count = session.execute(text(
            "SELECT count(*) FROM util_samples WHERE source = 'procfs' AND pid = :pid"), {"pid": pid}).scalar()
    assert count and count >= 3


def test_a_loop_with_nothing_to_sample_ticks_seldom_and_wakes_for_a_process() -> None:
    from collectors.sampling import IDLE_INTERVAL_S

    procfs = ProcfsSampler(host="h")  # follows no process: idle
    recorder = Recorder()
    stored: list[UtilSample] = []
    loop = SamplingLoop([procfs], sink=stored.extend, interval_s=0.05).start()
    try:
        time.sleep(1.5)
        assert loop.ticks <= 1 + 1.5 / IDLE_INTERVAL_S + 1  # not 30 ticks of 50 ms
        idle_ticks = loop.ticks
        with child(SPIN) as busy:
            procfs.set_pids([busy])
            loop.wake()
            time.sleep(0.5)
            assert loop.ticks - idle_ticks >= 5  # back to 50 ms at once, and it stays there while busy
            assert any(s.pid == busy and s.util_percent > QUIET_PERCENT for s in stored)
        # A process that uses (almost) no CPU runs no request: sampled once a second, each sample
        # covering the whole second, so what it spends is still all counted.
        with child(SLEEP) as sleeping:
            procfs.set_pids([sleeping])
            loop.wake()
            time.sleep(0.5)  # two readings: its baseline, then a quiet one
            quiet_ticks = loop.ticks
            time.sleep(1.5)
            assert loop.ticks - quiet_ticks <= 1 + 1.5 / IDLE_INTERVAL_S
            covering = [s for s in stored if s.pid == sleeping]
            assert procfs.idle() and covering[-1].interval_s is not None and covering[-1].interval_s > 0.5
    finally:
        loop.stop()
    # A sampler that cannot say whether it is idle keeps the loop at its rate.
    busy = SamplingLoop([procfs := ProcfsSampler(host="h"), recorder], sink=stored.extend, interval_s=0.05).start()
    time.sleep(0.5)
    busy.stop()
    assert len(recorder.ticks) >= 5 and procfs.idle()
