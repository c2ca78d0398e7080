"""Who a zombie's cost is shared with, on a real store with a controlled clock.

Every figure here is worked out by hand from the samples written: a process at 100 % CPU for
a span of time, shared by the requests the engine ran in it, and by no request that only waited.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from auditor.correlate import Correlator
from auditor.correlate.checkpoints import MAX_CHECKPOINTS
from auditor.correlate.waste import PartialCost, SampleCache
from auditor.model import EngineLoad, LiveEvent, SpanRecord, SpanRole, UtilSample
from auditor.semconv import SENDER_KEY, engine_of, sender_address
from auditor.store import Store
from tests.test_correlate import (
    CLIENT,
    SERVER_PORT,
    T0,
    Clock,
    close,
    engine_span,
    http_span,
    make,
    verdicts,
)

S = 1_000_000_000
PID = 4242
OTHER = ("127.0.0.1", 40002)


def busy(store: Store, until_s: float, util: float = 100.0, pid: int = PID) -> None:
    store.write([UtilSample(ts_ns=T0 + int(0.1 * i * S), source="procfs", host="h", pid=pid, util_percent=util,
                            interval_s=0.1) for i in range(1, int(until_s * 10) + 1)])


def engine(trace: str, start: float, end: float, queued_s: float, pid: int | None = PID) -> SpanRecord:
    span = engine_span(trace, start, end, "length", request_id=f"cmpl-{trace}")
    return replace(span, time_in_queue_s=queued_s, process_pid=pid)


def judge(store: Store, clock: Clock, at_s: float, correlator: Correlator | None = None) -> dict[str, float]:
    correlator = correlator or make(store, clock)
    clock.now = T0 + int(at_s * S)
    correlator.tick()
    return {row.trace_id[0]: row.wasted_cpu_seconds for row in verdicts(store)}


def test_a_zombie_with_a_request_waiting_behind_it_pays_in_full(store: Store) -> None:
    """One at a time: ``a`` runs 0-6 s, its client leaves at 2 s; ``b`` arrives at 1 s and waits
    until 6 s (its engine span says 5 s in queue), then runs to 8 s, its client still there."""
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0),
                        http_span("b", 1.0, 8.0, client=OTHER), engine("b", 1.0, 8.0, 5.0)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    assert judge(store, Clock(), 10.0)["a"] == pytest.approx(4.0, rel=0.03)  # 2-6 s at 100 %, alone


def test_running_together_shares_and_a_request_waiting_shares_nothing(store: Store) -> None:
    """``a`` and ``b`` run together 0-4 s, then ``a`` alone to 6 s; ``c`` waits 0-6 s then runs.
    ``a``'s client left at 2 s: 2-4 s half of 100 %, 4-6 s all of it = 3 CPU-s."""
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0),
                        http_span("b", 0, 4.0, client=OTHER), engine("b", 0, 4.0, 0.0),
                        http_span("c", 0, 8.0, client=("127.0.0.1", 40003)), engine("c", 0, 8.0, 6.0)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    assert judge(store, Clock(), 10.0)["a"] == pytest.approx(3.0, rel=0.03)


def test_the_engines_running_gauge_decides_when_scraped(store: Store) -> None:
    """No engine span for ``b`` at all (an engine that spans nothing for it), but the gauge said
    two were running 2-3 s: that second is shared, the rest is ``a``'s alone = 3.5 CPU-s."""
    clock = Clock()
    correlator = make(store, clock)
    correlator.add_engine_load([EngineLoad(ts_ns=T0 + i * S // 10, server_port=SERVER_PORT,
                                           running=2 if 20 <= i < 30 else 1) for i in range(80)])
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    assert judge(store, clock, 10.0, correlator)["a"] == pytest.approx(3.5, rel=0.03)


def test_live_notices_count_a_running_request_once(store: Store) -> None:
    """``b`` is still running, known from its live notices only (a server start and an engine
    start, same trace): it shares ``a``'s 2-6 s as one request, not two = 2 CPU-s."""
    clock = Clock()
    correlator = make(store, clock)
    trace = "b" * 32
    correlator.add_live([
        LiveEvent("start", trace, "8" * 16, "POST", "server", T0, OTHER[0], OTHER[1], SERVER_PORT, PID, "engine",
                  False),
        LiveEvent("start", trace, "9" * 16, "llm_request", "internal", T0, None, None, None, PID, "engine", True)])
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    assert judge(store, clock, 10.0, correlator)["a"] == pytest.approx(2.0, rel=0.03)


def quiet_then_busy(store: Store, busy_from_s: float, until_s: float, *, next_util: float = 100.0) -> None:
    """A process the sampler found quiet, so read once a second: quiet to 1 s, busy from
    ``busy_from_s`` (inside the reading at 2 s), then read every 100 ms at ``next_util`` %."""
    readings = [(1.0, 1.0, 0.5), (2.0, 1.0, 100.0 * (2.0 - busy_from_s))]
    readings += [(2.0 + 0.1 * i, 0.1, next_util) for i in range(1, round((until_s - 2.0) * 10) + 1)]
    store.write([UtilSample(ts_ns=T0 + int(ts * S), source="procfs", host="h", pid=PID, util_percent=util,
                            interval_s=interval) for ts, interval, util in readings])


def test_a_quiet_processs_long_reading_puts_the_work_it_saw_at_its_end(store: Store) -> None:
    """The engine was idle until 1.5 s; its reading at 2 s covers 1-2 s at 50 %. ``a``'s client
    left at 1.6 s and it ran alone to 3 s at 100 %: 1.4 CPU-s. Spread evenly, the reading would
    charge 1.6-2 s at 50 % (1.2 CPU-s, the short zombie under-charged by a seventh)."""
    store.insert_spans([http_span("a", 1.5, 1.6), engine("a", 1.5, 3.0, 0.0)])
    store.insert_conn_events([close(1.6)])
    quiet_then_busy(store, busy_from_s=1.5, until_s=4.0)
    assert judge(store, Clock(), 6.0)["a"] == pytest.approx(1.4, rel=0.02)


def test_a_long_reading_followed_by_a_quiet_one_stays_even(store: Store) -> None:
    """Work that began and ended inside the long reading (the next one finds the process no
    busier): where in it the work ran is not known, and it is spread evenly."""
    store.insert_spans([http_span("a", 1.0, 1.5), engine("a", 1.0, 2.0, 0.0)])
    store.insert_conn_events([close(1.5)])
    quiet_then_busy(store, busy_from_s=1.5, until_s=3.0, next_util=1.0)
    assert judge(store, Clock(), 6.0)["a"] == pytest.approx(0.25, rel=0.02)  # 1.5-2 s at 50 %


def test_a_reading_reshaped_by_the_next_is_news_to_the_rounds_after(store: Store) -> None:
    """The long reading is filed even until the next arrives; then its start is news, so verdicts
    costed from it in the meantime are costed again."""
    cache = SampleCache(store, "h")
    reading = UtilSample(ts_ns=T0 + 2 * S, source="procfs", host="h", pid=PID, util_percent=50.0, interval_s=1.0)
    store.write([reading])
    cache.refresh(T0 + 2 * S)
    assert cache.take_news() == T0 + S
    store.write([replace(reading, ts_ns=T0 + 2 * S + S // 10, util_percent=100.0, interval_s=0.1)])
    cache.refresh(T0 + 3 * S)
    assert cache.take_news() == T0 + S  # not only the new reading's 2-2.1 s
    series = cache.series("procfs", PID)
    assert series is not None and list(series.util) == [0.0, 100.0, 100.0]
    assert list(series.start) == [T0 + S, T0 + 3 * S // 2, T0 + 2 * S]


def inflight_cost(store: Store) -> float:
    [row] = [r for r in verdicts(store) if r.trace_id == "a" * 32]
    assert row.verdict == "inflight_zombie", row.verdict
    return row.wasted_cpu_seconds


def test_a_long_zombies_cost_goes_on_from_its_checkpoints_and_news_of_its_past_counts(store: Store) -> None:
    """``a`` runs on after its client left at 1 s, known from its live notice alone; each second
    brings that second's samples (100 %). At 12 s the spans of ``b`` arrive: it ran 3-8 s, so
    those seconds of ``a``'s window were shared. Rounds go on from the checkpoints a whole second
    apart; the news of 3 s drops those after it. At 20 s: 2 + 5/2 + 12 = 16.5 CPU-s, as a
    correlator that never saw the window before integrates it whole."""
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.set_listeners({SERVER_PORT: PID}, {})
    start = LiveEvent("start", "a" * 32, "8" * 16, "POST", "server", T0, CLIENT[0], CLIENT[1], SERVER_PORT, PID,
                      "engine", False)
    correlator.tick([start])
    store.insert_conn_events([close(1.0)])
    for second in range(1, 21):
        store.write([UtilSample(ts_ns=T0 + (second - 1) * S + k * S // 10, source="procfs", host="h", pid=PID,
                                util_percent=100.0, interval_s=0.1) for k in range(1, 11)])
        if second == 12:
            store.insert_spans([http_span("b", 3.0, 8.0, client=OTHER), engine("b", 3.0, 8.0, 0.0)])
        clock.now = T0 + second * S
        correlator.tick()
        if second == 11:
            assert inflight_cost(store) == pytest.approx(10.0, rel=0.01)  # alone, 1-11 s
            [request] = correlator._open.values()
            assert request.cost_partial is not None and len(request.cost_partial.at) >= 5
    kept = inflight_cost(store)
    assert kept == pytest.approx(16.5, rel=0.01)
    fresh = make(store, clock)
    fresh.cost.set_listeners({SERVER_PORT: PID}, {})
    [whole] = [v for v in fresh.tick([start]) if v.trace_id == "a" * 32]
    assert whole.wasted_cpu_seconds == pytest.approx(kept, abs=1e-6)


def test_a_long_windows_checkpoints_stay_few_and_recent_ones_a_second_apart() -> None:
    """Fifteen minutes of a zombie's window keep at most MAX_CHECKPOINTS sums, the newest a second
    apart (news seldom reaches far back); each is the integral up to its moment."""
    partial = PartialCost()
    assert partial.resume(("k",), T0) is None
    for second in range(1, 901):
        partial.mark(T0 + second * S, (0.0, float(second)))
    assert len(partial.at) <= MAX_CHECKPOINTS
    assert list(partial.at[-16:]) == [T0 + second * S for second in range(885, 901)]
    assert all(cpu == (at - T0) / S for at, (_, cpu) in zip(partial.at, partial.states, strict=True))
    partial.forget_from(T0 + 880 * S)
    found = partial.resume(("k",), T0 + 900 * S)
    assert found is not None
    at, (_, cpu) = found
    assert at == T0 + 879 * S and cpu == 879.0
    partial.forget_from(T0 + 600 * S)  # older than any kept: read from the start again
    assert partial.resume(("k",), T0 + 900 * S) is None
    partial.mark(T0 + S, (0.0, 1.0))
    assert partial.resume(("another",)) is None and not partial.at  # another key starts over


def test_without_a_known_process_the_verdict_says_why_instead_of_a_silent_zero(store: Store) -> None:
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0, pid=None)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.set_listeners({}, {SERVER_PORT: "nothing listens on port 8000 on this host"})
    assert judge(store, clock, 10.0, correlator)["a"] == 0
    assert verdicts(store)[0].details["cost_unmeasured"] == "nothing listens on port 8000 on this host"


def test_the_process_found_behind_the_port_is_costed(store: Store) -> None:
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0, pid=None)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0, util=50.0)
    busy(store, 8.0, util=100.0, pid=999)  # another process on the host: not the engine
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.set_listeners({SERVER_PORT: PID}, {})
    assert judge(store, clock, 10.0, correlator)["a"] == pytest.approx(2.0, rel=0.03)
    assert "cost_unmeasured" not in verdicts(store)[0].details


def test_an_empty_window_reads_no_samples(store: Store) -> None:
    """A zombie whose work ended before it ran (all queue) costs nothing, and nothing is read for it."""
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 5.999)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    clock = Clock()
    correlator = make(store, clock)
    costs = judge(store, clock, 10.0, correlator)
    assert costs["a"] == pytest.approx(0.001, abs=0.001)
    before = correlator.cost.samples.queries
    store.insert_spans([http_span("z", 20.0, 21.0, client=OTHER), engine("z", 20.0, 26.0, 6.0)])
    store.insert_conn_events([close(21.0, client=OTHER)])
    judge(store, clock, 30.0, correlator)
    assert correlator.cost.samples.queries == before



def test_the_run_index_counts_each_request_running_at_a_moment_once() -> None:
    """What cost sharing reads: the requests a service was running at a moment, each once (a run
    filed in every one-second bucket it spans, the live work not yet spanned, the zombie itself),
    held as 8-byte integers rather than strings for the whole horizon."""
    from auditor.correlate.waste import RunIndex, sharers_at, trace_key

    runs = RunIndex()
    for trace, start, end in (("a", 0.0, 3.5), ("b", 1.2, 1.8), ("c", 2.5, 4.0), ("d", 5.0, 6.0)):
        runs.add(engine(trace, start, end, queued_s=0.0))
    assert runs.running_at("engine", T0 + int(1.5 * S)) == {trace_key("a" * 32), trace_key("b" * 32)}
    assert runs.running_at("engine", T0 + int(3.0 * S)) == {trace_key("a" * 32), trace_key("c" * 32)}
    assert runs.running_at("other", T0 + int(3.0 * S)) == set()
    count = sharers_at(runs, "engine", "a" * 32, {"e" * 32: T0 + 3 * S, "a" * 32: T0}, gauge=None)
    assert count(T0 + int(1.5 * S)) == 2  # a (its run, its live work, itself: once) and b
    assert count(T0 + int(3.2 * S)) == 3  # a, c, e
    assert count(T0 + int(4.5 * S)) == 2  # a itself (its run is over) and e
    assert all(type(bucket.traces).__name__ == "array" for bucket in runs._buckets.values())


def gpu_busy(store: Store, until_s: float, gpu: int, util: float, pid: int | None = None,
             memory_only: bool = False) -> None:
    """NVML's samples of one GPU (pid None) or of one process on it, every 100 ms."""
    store.write([UtilSample(ts_ns=T0 + int(0.1 * i * S), source="nvml", host="h", gpu_index=gpu, pid=pid,
                            util_percent=None if memory_only else util, memory_bytes=1 << 30, interval_s=0.1)
                 for i in range(1, int(until_s * 10) + 1)])


def judge_gpu(store: Store, clock: Clock, at_s: float, correlator: Correlator) -> tuple[float, dict[str, object]]:
    clock.now = T0 + int(at_s * S)
    correlator.tick()
    (row,) = verdicts(store)
    return row.wasted_gpu_seconds, row.details


# A host with four GPUs busy at 20, 40, 60 and 80 %. vLLM-like: the spans and the port name the
# process serving HTTP (PID); its children do the GPU work (CHILD on GPU 2, or two with tensor
# parallelism). ``a`` runs 0-6 s alone, its client leaves at 2 s: 4 s of zombie work.
CHILD, SIBLING, STRANGER = 5001, 5002, 6001
PARENTS = {CHILD: PID, SIBLING: PID, STRANGER: 1, PID: 1}


def four_gpu_host(store: Store) -> tuple[Correlator, Clock]:
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0)])
    store.insert_conn_events([close(2.0)])
    for gpu, util in enumerate((20.0, 40.0, 60.0, 80.0)):
        gpu_busy(store, 8.0, gpu, util)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.parent_of = PARENTS.get
    return correlator, clock


@pytest.mark.parametrize(("shape", "expected", "source"), [
    ("the child's own readings on GPU 2", 4.0 * 0.55, f"pid {CHILD}"),
    ("the child listed on GPU 2 without readings: GPU 2 whole", 4.0 * 0.60, "GPU 2"),
    ("two children, GPUs 1 and 3, listed without readings", 4.0 * (0.40 + 0.80), "GPUs 1, 3"),
    ("a grandchild's own readings", 4.0 * 0.55, "pid 7001"),
])
def test_an_engine_is_costed_by_the_gpus_its_own_processes_use_not_the_whole_host(store: Store, shape: str,
                                                                                 expected: float, source: str) -> None:
    """Summing every GPU of the host would cost this zombie 4 s x 2.0 = 8 GPU-s; the engine used
    one GPU (or two): the GPU processes that descend from the process serving its port say which."""
    correlator, clock = four_gpu_host(store)
    gpu_busy(store, 8.0, 0, 20.0, pid=STRANGER)  # another engine's process, on GPU 0: not this one's
    if shape == "the child's own readings on GPU 2":
        gpu_busy(store, 8.0, 2, 55.0, pid=CHILD)
    elif shape == "the child listed on GPU 2 without readings: GPU 2 whole":
        gpu_busy(store, 8.0, 2, 0.0, pid=CHILD, memory_only=True)
    elif shape == "two children, GPUs 1 and 3, listed without readings":
        gpu_busy(store, 8.0, 1, 0.0, pid=CHILD, memory_only=True)
        gpu_busy(store, 8.0, 3, 0.0, pid=SIBLING, memory_only=True)
    else:
        correlator.cost.parent_of = {7001: CHILD, **PARENTS}.get
        gpu_busy(store, 8.0, 2, 55.0, pid=7001)
    wasted_gpu, details = judge_gpu(store, clock, 10.0, correlator)
    assert wasted_gpu == pytest.approx(expected, rel=0.03)
    assert "cost_unmeasured" not in details
    assert details["gpu_time_of"] == source  # where the verdict's GPU time was read


def test_with_several_gpus_and_none_known_to_be_the_engines_it_is_not_costed_and_says_why(store: Store) -> None:
    correlator, clock = four_gpu_host(store)
    gpu_busy(store, 8.0, 0, 20.0, pid=STRANGER)
    wasted_gpu, details = judge_gpu(store, clock, 10.0, correlator)
    assert wasted_gpu == 0
    assert details["cost_unmeasured"] == (f"4 GPUs here, and NVML lists neither process {PID} nor a process it "
                                          "started on any: whose GPU time is not known")


def test_with_one_gpu_an_engine_without_gpu_processes_of_its_own_is_costed_by_that_gpu(store: Store) -> None:
    """The engine's GPU work in a process NVML shows under another pid (a container's namespace):
    on a host with one GPU, that GPU is the engine's."""
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0)])
    store.insert_conn_events([close(2.0)])
    gpu_busy(store, 8.0, 0, 70.0)
    gpu_busy(store, 8.0, 0, 70.0, pid=STRANGER)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.parent_of = PARENTS.get
    wasted_gpu, details = judge_gpu(store, clock, 10.0, correlator)
    assert wasted_gpu == pytest.approx(4.0 * 0.70, rel=0.03)
    assert "cost_unmeasured" not in details
    assert details["gpu_time_of"] == "GPU 0, the host's one"


def test_a_parent_is_read_from_stat_whatever_the_process_name(tmp_path: Path) -> None:
    from auditor.correlate.waste import parent_pid

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (vllm (Engine) 0) S 17 42 1 0 -1 4194560 1 0 0 0\n")
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("garbage")
    assert parent_pid(42, str(tmp_path)) == 17
    assert parent_pid(43, str(tmp_path)) is None  # unreadable: no parent, not a crash
    assert parent_pid(44, str(tmp_path)) is None  # gone
    assert parent_pid(os.getpid()) == os.getppid()


@pytest.mark.parametrize(("named", "inner", "expected"), [
    (1, {PID: 1, CHILD: 2}, 4.0 * 0.55),  # the engine is its container's first process: its child's readings
    (2, {PID: 1, CHILD: 2}, 4.0 * 0.55),  # the spans come from the child, which is 2 in the container
    (CHILD, {}, 4.0 * 0.55),  # a host process the listener started
    (None, {}, 4.0 * 0.55),  # no process.pid: the listener
])
def test_a_pid_the_spans_name_inside_a_container_is_not_taken_for_this_hosts(store: Store, named: int | None,
                                                                            inner: dict[int, int],
                                                                            expected: float) -> None:
    """A span's process.pid is the engine's pid in its container. Taken as this host's, pid 1 is
    init, whose descendants are every GPU process here (all four GPUs' engines would be charged).
    The listener on the port, or a GPU process it started, that has that pid in its own namespace
    is the engine."""
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0, pid=named)])
    store.insert_conn_events([close(2.0)])
    for gpu, util in enumerate((20.0, 40.0, 60.0, 80.0)):
        gpu_busy(store, 8.0, gpu, util)
    gpu_busy(store, 8.0, 2, 55.0, pid=CHILD)
    gpu_busy(store, 8.0, 0, 20.0, pid=STRANGER)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.parent_of = PARENTS.get
    correlator.cost.inner_pid_of = lambda pid: inner.get(pid, pid)
    correlator.cost.set_listeners({SERVER_PORT: PID}, {})
    wasted_gpu, details = judge_gpu(store, clock, 10.0, correlator)
    assert wasted_gpu == pytest.approx(expected, rel=0.03)
    assert "cost_unmeasured" not in details


def test_an_engine_behind_a_proxy_that_holds_the_port_is_the_one_its_spans_name(store: Store) -> None:
    """The port's listener is a proxy (its own process, no GPU); the spans name the engine, a host
    process that is neither the proxy nor started by it, nor the proxy's pid in any namespace."""
    proxy = 300
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0, pid=CHILD)])
    store.insert_conn_events([close(2.0)])
    for gpu, util in enumerate((20.0, 40.0)):
        gpu_busy(store, 8.0, gpu, util)
    gpu_busy(store, 8.0, 1, 35.0, pid=CHILD)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.parent_of = {CHILD: 77, proxy: 1, 77: 1}.get
    correlator.cost.inner_pid_of = lambda pid: pid
    correlator.cost.set_listeners({SERVER_PORT: proxy}, {})
    wasted_gpu, _details = judge_gpu(store, clock, 10.0, correlator)
    assert wasted_gpu == pytest.approx(4.0 * 0.35, rel=0.03)


def test_init_named_with_no_listener_known_is_no_engine(store: Store) -> None:
    store.insert_spans([http_span("a", 0, 2.0), engine("a", 0, 6.0, 0.0, pid=1)])
    store.insert_conn_events([close(2.0)])
    for gpu in range(2):
        gpu_busy(store, 8.0, gpu, 50.0)
        gpu_busy(store, 8.0, gpu, 50.0, pid=STRANGER + gpu)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.parent_of = lambda pid: 1
    wasted_gpu, details = judge_gpu(store, clock, 10.0, correlator)
    assert wasted_gpu == 0
    assert "not known" in str(details["cost_unmeasured"])


def test_a_pid_in_its_own_namespace_is_read_from_status(tmp_path: Path) -> None:
    from auditor.correlate.waste import innermost_pid

    for pid, text in ((42, "Name:\tpython\nNSpid:\t42\t1\n"), (43, "Name:\tx\nNSpid:\t43\n"), (44, "garbage")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(text)
    assert innermost_pid(42, str(tmp_path)) == 1
    assert innermost_pid(43, str(tmp_path)) == 43
    assert innermost_pid(44, str(tmp_path)) is None
    assert innermost_pid(45, str(tmp_path)) is None
    assert innermost_pid(os.getpid()) is not None


def test_the_processes_an_engine_started_are_found_through_proc(store: Store) -> None:
    """The same with this host's real process tree, read from /proc: a serving process (a shell)
    and the process it started (its model worker, as NVML would list it on GPU 1)."""
    import subprocess
    import time

    from auditor.correlate.waste import CostSources

    server = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    children: list[int] = []
    try:
        for _ in range(100):
            children = [int(pid) for pid in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
            if children:
                break
            time.sleep(0.01)
        (worker,) = children
        for gpu, util in enumerate((20.0, 40.0, 60.0)):
            gpu_busy(store, 8.0, gpu, util)
        gpu_busy(store, 8.0, 1, 30.0, pid=worker)
        gpu_busy(store, 8.0, 2, 60.0, pid=os.getpid())  # this test's own process: not the engine's
        cost = CostSources(store, "h")
        cost.samples.refresh(T0 + 10 * S)
        share = cost.gpu_share(server.pid)
        assert share.series == [cost.samples.series("nvml", worker)] and not share.unmeasured
        assert cost.engine_pid(server.pid, SERVER_PORT) == server.pid
        cost.set_listeners({SERVER_PORT: server.pid}, {})
        assert cost.engine_pid(worker, SERVER_PORT) == worker  # spans from the worker name it
        assert cost.engine_pid(1, SERVER_PORT) == server.pid  # init never
    finally:
        for pid in children:
            os.kill(pid, 9)
        server.kill()
        server.wait()


def test_a_settled_zombie_reopened_by_a_late_span_of_its_own_reads_its_window_afresh(store: Store) -> None:
    """``a`` ran 0-12 s, its client gone at 1 s; its spans arrive at 13 s, when it ran alone as far
    as anything tells: 11 CPU-s, read through the checkpoints of a long window, and the verdict
    settles. ``b``'s spans (it ran 3-8 s on the same engine) arrive at 14 s: a settled verdict stays
    as written. At 15 s a late span of ``a``'s own trace reopens it, and its window is read again
    with ``b`` in it: 2 + 5/2 + 4 = 8.5 CPU-s. Checkpoints taken while ``b`` was unknown, and kept
    through the settling, do not stand."""
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.set_listeners({SERVER_PORT: PID}, {})
    busy(store, 16.0)
    store.insert_conn_events([close(1.0)])
    store.insert_spans([http_span("a", 0, 12.0), engine("a", 0, 12.0, 0.0)])
    assert judge(store, clock, 13.0, correlator)["a"] == pytest.approx(11.0, rel=0.01)
    assert not correlator._open  # settled: held for a late span of its trace
    store.insert_spans([http_span("b", 3.0, 8.0, client=OTHER), engine("b", 3.0, 8.0, 0.0)])
    assert judge(store, clock, 14.0, correlator)["a"] == pytest.approx(11.0, rel=0.01)
    late = replace(http_span("a", 11.0, 11.5, span="6"), parent_span_id="5" * 16, name="postprocess",
                   kind="internal", role=SpanRole.OTHER, peer_addr=None, peer_port=None, server_port=None)
    store.insert_spans([late])
    assert judge(store, clock, 15.0, correlator)["a"] == pytest.approx(8.5, rel=0.01)


def from_container(span: SpanRecord, address: str) -> SpanRecord:
    """The span as the receivers keep it when its engine sent it from ``address`` (a container's)."""
    return replace(span, attributes={**span.attributes, SENDER_KEY: address})


def test_two_containers_serving_one_port_are_costed_each_by_its_own_engine(store: Store) -> None:
    """Pods of a node serve port 8000 from networks of their own, under one service name, and their
    spans name no process: each engine is the one listening at the address its spans came from.
    ``a`` (first pod, its client gone at 2 s) runs 0-6 s beside ``b`` (second pod, 0-6 s, client
    there); the first pod's engine is busy at 100 %, the second's at 50 %. ``a`` ran alone on its
    engine: 4 CPU-s, not shared with ``b`` nor read from the second engine. ``c``, sent through a
    collector (no container's address), has no engine to cost, and says why."""
    first, second = "10.244.1.5", "10.244.1.6"
    store.insert_spans([from_container(http_span("a", 0, 2.0), first),
                        from_container(engine("a", 0, 6.0, 0.0, pid=None), first),
                        from_container(http_span("b", 0, 6.0, client=OTHER), second),
                        from_container(engine("b", 0, 6.0, 0.0, pid=None), second),
                        http_span("c", 0, 2.0, client=("127.0.0.1", 40003)), engine("c", 0, 6.0, 0.0, pid=None)])
    store.insert_conn_events([close(2.0), close(2.0, client=("127.0.0.1", 40003))])
    busy(store, 8.0, pid=PID)
    busy(store, 8.0, util=50.0, pid=PID + 1)
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.set_listeners({}, {SERVER_PORT: "port 8000 is listened on in 2 other network namespaces"},
                                  {SERVER_PORT: {first: PID, second: PID + 1}})
    assert correlator.cost.engine_pid(None, SERVER_PORT, second) == PID + 1
    assert correlator.cost.engine_pid(None, SERVER_PORT, "10.9.9.9") is None
    assert correlator.cost.engine_pid(None, SERVER_PORT) is None
    wasted = judge(store, clock, 10.0, correlator)
    assert wasted["a"] == pytest.approx(4.0, rel=0.03)
    rows = {row.trace_id[0]: row for row in verdicts(store)}
    assert "cost_unmeasured" not in rows["a"].details
    assert wasted["c"] == 0.0 and "2 other network namespaces" in rows["c"].details["cost_unmeasured"]


def test_the_run_index_tells_engines_apart_by_where_their_spans_came_from() -> None:
    """One service name, two containers: a request of one is no sharer of the other's; spans with
    no container's address are counted by their service alone, as before."""
    from auditor.correlate.waste import RunIndex, trace_key

    runs = RunIndex()
    runs.add(from_container(engine("a", 0.0, 4.0, queued_s=0.0), "10.244.1.5"))
    runs.add(from_container(engine("b", 0.0, 4.0, queued_s=0.0), "10.244.1.6"))
    runs.add(engine("c", 0.0, 4.0, queued_s=0.0))
    at = T0 + 2 * S
    assert runs.running_at(engine_of("engine", {SENDER_KEY: "10.244.1.5"}), at) == {trace_key("a" * 32)}
    assert runs.running_at(engine_of("engine", {SENDER_KEY: "10.244.1.6"}), at) == {trace_key("b" * 32)}
    assert runs.running_at(engine_of("engine", {}), at) == {trace_key("c" * 32)}


@pytest.mark.parametrize(("peer", "kept"), [
    (("10.244.1.5", 41000), "10.244.1.5"), (("::ffff:10.244.1.5", 41000, 0, 0), "10.244.1.5"),
    (("fd00::5", 41000, 0, 0), "fd00::5"), (("127.0.0.1", 41000), None), (("127.8.0.1", 1), None),
    (("::1", 41000, 0, 0), None), ((), None), ("", None), (None, None)])
def test_the_sender_kept_on_spans_is_a_containers_address_not_the_loopback(peer: object, kept: str | None) -> None:
    assert sender_address(peer) == kept


def test_on_a_port_several_containers_serve_the_sharers_are_read_from_the_engines_own_count(store: Store) -> None:
    """The port's scrapes sum its engines' gauges (3 running: 2 on the first pod, ``a`` and one whose
    span has not come, 1 on the second); ``a``'s share of its engine's time is read from its own
    engine's count: 2-6 s at 100 % by two = 2 CPU-s (the sum would make it 1.33, its spans alone 4)."""
    first, second = "10.244.1.5", "10.244.1.6"
    clock = Clock()
    correlator = make(store, clock)
    correlator.cost.set_listeners({}, {}, {SERVER_PORT: {first: PID, second: PID + 1}})
    correlator.add_engine_load([EngineLoad(ts_ns=T0 + i * S // 10, server_port=SERVER_PORT, running=3,
                                           running_by_address=((first, 2), (second, 1))) for i in range(80)])
    store.insert_spans([from_container(http_span("a", 0, 2.0), first),
                        from_container(engine("a", 0, 6.0, 0.0, pid=None), first)])
    store.insert_conn_events([close(2.0)])
    busy(store, 8.0)
    assert judge(store, clock, 10.0, correlator)["a"] == pytest.approx(2.0, rel=0.03)
