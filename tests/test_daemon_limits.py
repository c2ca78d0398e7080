"""`auditor run` inside the systemd unit's own MemoryMax and CPUQuota still judges correctly.

The limits are read from systemd/auditor.service and applied with a real cgroup (v2, or the v1
memory and cpu hierarchies). Both OTLP listeners are on, as in systemd/auditor.toml, and the engine
exports its spans over gRPC, as vLLM does by default. The daemon serves a paced load of about 100 requests/s, a tenth of them
cancelled, beside long requests whose clients leave mid-decode; every cancelled request must get the
engine's truth-log verdict, and the daemon must never have been OOM-killed nor reach its limit.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from replay.client import RequestPlan, run_load
from replay.engine.launch import running_engine
from tests.cgroups import CgroupsUnavailable, Limits, limited
from tests.e2e import GRACE_S, cancel_after, expected_verdict, free_port, wait_for

pytestmark = [pytest.mark.privileged, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "auditor.service"
SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def unit_limits() -> tuple[int, float]:
    """(MemoryMax in bytes, CPUQuota in percent of one CPU) from the unit file."""
    text = UNIT.read_text()
    memory = re.search(r"^MemoryMax=(\d+)([KMG])$", text, re.M)
    cpu = re.search(r"^CPUQuota=(\d+)%$", text, re.M)
    assert memory and cpu, "the unit sets no MemoryMax=<n>[KMG] and CPUQuota=<n>%"
    return int(memory.group(1)) * SIZES[memory.group(2)], float(cpu.group(1))


def serving(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return 'source="bpf"} 1.0' in response.read().decode()
    except OSError:
        return False


async def paced_load(port: int, rate: float, seconds: float) -> None:
    plans = [RequestPlan(request_id=f"load-{i}", trace_id=os.urandom(16).hex(),
                         body={"model": "ref-llm-1b", "prompt": "a b", "max_tokens": 4, "stream": i % 2 == 0},
                         cancel_after_s=0.005 if i % 10 == 0 else None, close_with="rst" if i % 4 else "fin")
             for i in range(int(rate * seconds))]
    started = time.monotonic()

    async def paced(index: int, plan: RequestPlan) -> None:
        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
        await run_load("127.0.0.1", port, [plan], concurrency=1)

    await asyncio.gather(*(paced(i, p) for i, p in enumerate(plans)))


def own_cost(port: int) -> dict[str, float]:
    """The daemon's figures of itself from one scrape: series (with labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = ("process_", "auditor_thread_cpu", "auditor_memory_limit", "auditor_cpu_limit", "auditor_cpu_throttled")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(wanted)}


def stored_verdicts(db: Path) -> dict[str, tuple[str, bool]]:
    with sqlite3.connect(db, timeout=10) as conn:
        rows = conn.execute("SELECT request_id, verdict, details FROM verdicts").fetchall()
    return {rid.removeprefix("cmpl-"): (verdict, '"provisional": true' in details) for rid, verdict, details in rows
            if rid}


@contextmanager
def daemon_in(cgroup: Limits, tmp_path: Path, engine_port: int, otlp: int, metrics: int) -> Iterator[Path]:
    """`auditor run` moved into ``cgroup`` before it execs; yields its database. ``otlp``: the
    gRPC listener's port."""
    db, log = tmp_path / "auditor.db", tmp_path / "daemon.log"
    command = [sys.executable, "-m", "auditor", "run", "--db", f"sqlite:///{db}", "--port", str(engine_port),
               "--otlp-http", f"127.0.0.1:{free_port()}", "--otlp-grpc", f"127.0.0.1:{otlp}", "--live", "",
               "--metrics", f"127.0.0.1:{metrics}", "--grace", str(GRACE_S)]
    with log.open("wb") as out:
        daemon = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=cgroup.enter)
    try:
        assert wait_for(lambda: serving(metrics), timeout_s=60), log.read_text()[-3000:]
        yield db
        assert daemon.poll() is None, f"the daemon exited under the limits:\n{log.read_text()[-3000:]}"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)


def wrong_verdicts(cancelled: dict[str, dict[str, Any]], stored: dict[str, tuple[str, bool]]) -> list[str]:
    wrong = []
    for rid, truth in cancelled.items():
        want = expected_verdict(truth)
        lag_s = (truth["finished_at"] - truth["disconnect_at"]) / 1e9
        got = stored.get(rid, ("(none)", False))[0]
        near_grace = abs(lag_s - GRACE_S) < 0.05  # within the source's resolution either call is right
        if got != want and not (near_grace and {got, want} <= {"aborted", "zombie"}):
            wrong.append(f"{rid}: {got}, truth {want} (lag {lag_s:.3f} s)")
    return wrong


def test_daemon_within_the_unit_limits_judges_every_cancel(tmp_path: Path) -> None:
    memory_max, cpu_quota = unit_limits()
    otlp, metrics = free_port(), free_port()
    with ExitStack() as stack:
        try:
            cgroup = stack.enter_context(limited(memory_max, cpu_quota))
        except CgroupsUnavailable as exc:
            pytest.skip(f"no cgroup to apply the unit's limits in: {exc}")
        engine = stack.enter_context(running_engine(behavior="detached", otlp=f"grpc://127.0.0.1:{otlp}",
                                                    truth_log=tmp_path / "truth.jsonl", step_ms=5, max_batch=64))
        with daemon_in(cgroup, tmp_path, engine.port, otlp, metrics) as db:
            # 300 tokens of 5 ms steps outlive every cancel by about a second: well past the grace
            # whatever the machine's load, so the six are zombies by the truth log, not by luck
            long = [cancel_after(engine.port, 0.2 + 0.05 * i, "fin" if i % 2 else "rst", stream=i % 2 == 0,
                                 max_tokens=300, request_id=f"long-{i}") for i in range(6)]
            asyncio.run(paced_load(engine.port, rate=100, seconds=5))
            for thread in long:
                thread.join()
            cancelled = {t["request_id"].removeprefix("cmpl-"): t
                         for t in engine.wait_for_truth(506, timeout=60) if t.get("disconnect_at")}
            wait_for(lambda: all(rid in (s := stored_verdicts(db)) and not s[rid][1] for rid in cancelled), 30)
            stored = stored_verdicts(db)
            with sqlite3.connect(db, timeout=10) as conn:
                spans = conn.execute("SELECT count(*) FROM spans").fetchone()[0]
            peak, ooms, cpu = cgroup.memory_peak_bytes(), cgroup.oom_kills(), cgroup.cpu_throttled()
            own = own_cost(metrics)
    assert len(cancelled) >= 50 + 6
    assert spans >= 506, f"only {spans} spans came over OTLP/gRPC"
    assert sum(1 for t in cancelled.values() if expected_verdict(t) == "zombie") >= 6
    wrong = wrong_verdicts(cancelled, stored)
    assert not wrong, f"{len(wrong)} of {len(cancelled)} wrong under the limits (cpu.stat {cpu}):\n" + "\n".join(wrong)
    assert ooms == 0
    # The daemon tells its own cost and the limits it runs under, as the cgroup set them.
    assert own["auditor_memory_limit_bytes"] == memory_max
    assert own["auditor_cpu_limit_cores"] == pytest.approx(cpu_quota / 100)
    assert 0 < own["process_resident_memory_bytes"] < memory_max
    assert own['auditor_thread_cpu_seconds_total{thread="correlator"}'] > 0
    assert own['auditor_thread_cpu_seconds_total{thread="otlp-grpc"}'] > 0
    threads = sum(v for k, v in own.items() if k.startswith("auditor_thread_cpu_seconds_total"))
    assert threads <= own["process_cpu_seconds_total"] + 0.5  # ticks against nanoseconds
    assert "auditor_cpu_throttled_seconds_total" in own
    assert peak is None or peak < memory_max, f"memory peak {peak} reached MemoryMax {memory_max}"
    print(f"under MemoryMax={memory_max >> 20} MiB, CPUQuota={cpu_quota:.0f}%: memory peak "
          f"{(peak or 0) >> 20} MiB, cpu.stat {cpu}; the daemon's own figures: RSS "
          f"{own['process_resident_memory_bytes'] / 2**20:.0f} MiB, CPU {own['process_cpu_seconds_total']:.2f} s, "
          f"throttled {own['auditor_cpu_throttled_seconds_total']:.2f} s")
