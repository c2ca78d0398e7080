"""Client timeouts in the report: disconnects that came at one age of their request.

The finder on counts drawn from the shapes disconnect ages take (flat stretches, people's cancels
falling off with age, a stretch with none past its edge, a timeout's spike on top of either), and
the report over a store: JSON against its schema, the table within its width, the HTML's chart.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from auditor.model import Verdict
from auditor.report import ReportQuery, build_report
from auditor.report.render_data import report_dict
from auditor.report.render_html import render_html
from auditor.report.render_table import render_table
from auditor.report.timeouts import (
    BIN_NS,
    MAX_BARS,
    MIN_DISCONNECTS,
    MOMENT_NS,
    AgeBin,
    age_bars,
    find_timeouts,
    known_default,
)
from auditor.store import Store
from tests.report_data import T0, _verdict, at, fill, fill_timeouts

NS = 1_000_000_000
SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())
HOUR = ReportQuery(since_ns=T0, until_ns=at(3600))


def bins_of(ages_s: list[float], zombie_every: int = 0, apart_s: float = 1.0) -> list[AgeBin]:
    """The bins the report's query would give for disconnects at these ages, ``apart_s`` from one
    to the next in time (every ``zombie_every``-th a zombie of 1 s)."""
    counts: Counter[int] = Counter()
    zombies: Counter[int] = Counter()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    moments: dict[int, set[int]] = {}
    ages: Counter[int] = Counter()
    for n, age in enumerate(ages_s):
        index = int(age * NS) // BIN_NS
        counts[index] += 1
        ages[index] += int(age * NS)
        first.setdefault(index, T0 + int(n * apart_s * NS))
        last[index] = T0 + int(n * apart_s * NS)
        moments.setdefault(index, set()).add(last[index] // MOMENT_NS)
        if zombie_every and n % zombie_every == 0:
            zombies[index] += 1
    return [AgeBin(index=i, disconnects=n, completed=0, aborted=n - zombies[i], zombies=zombies[i],
                   inflight_zombies=0, unconfirmed=0, zombie_seconds=float(zombies[i]),
                   wasted_gpu_seconds=0.5 * zombies[i], wasted_cpu_seconds=0.0, first_ns=first[i], last_ns=last[i],
                   moments=len(moments[i]), ages_ns=ages[i])
            for i, n in counts.items()]


def spread(rng: random.Random, shape: str, n: int) -> list[float]:
    if shape == "flat":
        return [rng.uniform(0.05, 20.0) for _ in range(n)]
    if shape == "cancels":  # most leave early, fewer the longer they wait
        return [rng.expovariate(1 / 4.0) for _ in range(n)]
    if shape == "lognormal":
        return [rng.lognormvariate(1.0, 0.9) for _ in range(n)]
    # two flat stretches with cliffs between: a service whose answers take 2-5 s or 10-12 s
    return [rng.uniform(2, 5) if rng.random() < 0.7 else rng.uniform(10, 12) for _ in range(n)]


@pytest.mark.parametrize("shape", ["flat", "cancels", "lognormal", "stretches"])
def test_ages_spread_out_give_no_timeout(shape: str) -> None:
    for seed in range(12):
        rng = random.Random(seed)
        for n in (30, 2_000, 60_000):
            assert find_timeouts(bins_of(spread(rng, shape, n))) == [], (shape, seed, n)


@pytest.mark.parametrize("shape", ["flat", "cancels", "lognormal", "stretches"])
def test_a_timeout_on_any_spread_is_found_with_its_disconnects(shape: str) -> None:
    rng = random.Random(1)
    background = spread(rng, shape, 20_000)
    # A 30 s client timeout, its disconnects within a few ms of it (the server's span starts just
    # after the client's clock): 2% of the disconnects.
    timed_out = [30.0 + rng.uniform(0.001, 0.015) for _ in range(400)]
    found = find_timeouts(bins_of(background + timed_out, zombie_every=2))
    assert len(found) == 1
    timeout = found[0]
    assert 30.0 <= timeout.after_seconds <= 30.015
    assert timeout.from_seconds <= 30.0 and timeout.to_seconds >= 30.02
    held = sum(1 for age in background + timed_out if timeout.from_seconds <= age < timeout.to_seconds)
    assert timeout.disconnects == held >= 400
    assert timeout.zombies + timeout.aborted == timeout.disconnects
    assert timeout.default_of is None
    assert timeout.zombie_work_max_seconds is None  # no bin said how long its zombies worked


def test_a_timeout_among_ages_that_also_cross_it_is_found() -> None:
    # Answers take 1-60 s, the clients' timeout is 8 s: the requests that would have taken longer
    # all left at 8 s, the ones shorter than it spread out below.
    rng = random.Random(3)
    ages = [min(rng.uniform(1.0, 60.0), 8.0 + rng.uniform(0.0, 0.02)) for _ in range(500)]
    found = find_timeouts(bins_of(ages))
    assert [round(t.after_seconds) for t in found] == [8]
    assert found[0].disconnects == sum(1 for age in ages if age >= 8.0)


def test_a_few_disconnects_at_one_age_are_not_a_timeout() -> None:
    assert find_timeouts(bins_of([5.0] * (MIN_DISCONNECTS - 1))) == []
    assert [t.disconnects for t in find_timeouts(bins_of([5.0] * MIN_DISCONNECTS))] == [MIN_DISCONNECTS]


def test_disconnects_at_one_age_all_at_once_are_not_a_timeout() -> None:
    # A batch sent together and left together (a client killed): one event, told by no spike.
    rng = random.Random(4)
    ages = [rng.uniform(0.1, 20.0) for _ in range(300)]
    batch = [7.0 + rng.uniform(0, 0.01) for _ in range(40)]
    assert find_timeouts(bins_of(ages) + bins_of(batch, apart_s=0.001)) == []
    # The same spread over four seconds: a timeout (with a cancel of the background in its band).
    assert [t.disconnects for t in find_timeouts(bins_of(ages) + bins_of(batch, apart_s=0.1))] in ([40], [41])


def test_a_spike_wider_than_its_band_is_one_timeout() -> None:
    # Requests that waited 0-150 ms for the server to accept them: one timeout's disconnects
    # over three bands' width.
    rng = random.Random(5)
    ages = [1.0 + rng.uniform(0.0, 0.15) for _ in range(300)]
    found = find_timeouts(bins_of(ages))
    assert len(found) == 1 and found[0].disconnects >= 100


def test_several_timeouts_each_with_what_it_is_the_default_of() -> None:
    rng = random.Random(9)
    ages = [rng.uniform(0.1, 120.0) for _ in range(3_000)]
    ages += [60.0 + rng.uniform(0, 0.02) for _ in range(200)] + [100.0 + rng.uniform(0, 0.02) for _ in range(50)]
    found = find_timeouts(bins_of(ages))
    assert [(round(t.after_seconds), t.default_of) for t in found] == [
        (60, "nginx's proxy_read_timeout and an AWS load balancer's idle timeout"),
        (100, "Cloudflare's proxy read timeout")]
    assert known_default(599.2) == "the openai Python SDK's timeout"
    assert known_default(30.0) is None and known_default(58.0) is None


def test_age_bars_hold_every_disconnect_up_to_the_oldest_they_draw() -> None:
    rng = random.Random(2)
    ages = [rng.uniform(0, 20) for _ in range(1_000)] + [30.0] * 50 + [400.0] * 3
    bins = bins_of(ages, zombie_every=3)
    timeouts = find_timeouts(bins)
    bars, width_s, beyond = age_bars(bins, timeouts)
    assert 0 < len(bars) <= MAX_BARS and width_s == 1.0  # past 30.01 s in at most 60 bars
    assert sum(b.disconnects for b in bars) + beyond == len(ages) and beyond == 3
    assert sum(b.zombies for b in bars) == sum(1 for n, age in enumerate(ages) if n % 3 == 0 and age < 400)
    assert bars[30].disconnects == 50 and bars[30].start_s == 29.5  # the 30 s timeout's bar, centred on it
    assert bars[0].start_s == -0.5
    assert age_bars([], []) == ([], 0.0, 0)


def test_the_report_tells_a_timeout_in_every_format(store: Store) -> None:
    fill(store)
    fill_timeouts(store)
    report = build_report(store, HOUR, with_series=True)
    document = report_dict(report)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    [timeout] = document["client_timeouts"]
    assert timeout["disconnects"] == 10 and (timeout["zombies"], timeout["aborted"]) == (5, 5)
    assert timeout["after_seconds"] == 60.002  # 60 s and 0 to 6 ms, 2.4 ms on average
    assert timeout["zombie_seconds"] == pytest.approx(25.0)
    assert timeout["wasted_gpu_seconds"] == pytest.approx(5.0)
    assert timeout["first_disconnect_at"] == "2026-11-22T04:26:00.000000000Z"
    assert "nginx" in timeout["default_of"]
    # Its five zombies worked on 5 s past their clients' 60.000-60.006 s: what the answers needed.
    assert (timeout["zombie_work_mean_seconds"], timeout["zombie_work_max_seconds"]) == (65.003, 65.006)
    for width in (80, 100):
        table = render_table(report, width)
        assert all(len(line) <= width for line in table.splitlines())
        assert "Client timeouts" in table and "  60.00       10" in table and "nginx" in table
        assert "its zombies worked 65.0 s from their start on average, 65.0 s at most" in " ".join(table.split())
    # Across days, and with figures wider than their columns, a line still fits.
    wide = build_report(store, ReportQuery(since_ns=at(-86400), until_ns=at(3600)))
    wide.client_timeouts[0] = replace(wide.client_timeouts[0], first_ns=at(-80000), zombie_seconds=12_345_678.9,
                                      disconnects=1_234_567, wasted_gpu_seconds=98_765_432.1)
    for width in (80, 100):
        assert all(len(line) <= width for line in render_table(wide, width).splitlines())
    assert "11-21 05:46 to 11-22 04:29" in render_table(wide, 100)  # clipped at 80 columns
    html = render_html(report)
    assert "When clients left" in html and "Client timeouts" in html and html.count("<svg") == 4
    # Filtered away, the timeout goes with its disconnects; without any, the table says nothing.
    other = build_report(store, ReportQuery(since_ns=T0, until_ns=at(3600), model="qwen-2-7b"))
    assert other.client_timeouts == [] and "Client timeouts" not in render_table(other)


def test_a_window_without_a_timeout_has_an_empty_list(store: Store) -> None:
    fill(store)
    report = build_report(store, HOUR, with_series=True)
    assert report_dict(report)["client_timeouts"] == []
    assert "Client timeouts" not in render_html(report) and "When clients left" in render_html(report)


def test_a_zombie_whose_end_may_be_another_leavers_tells_no_work(store: Store) -> None:
    fill_timeouts(store)
    # One more at the timeout, its end given by the gauges where later leavers may own it.
    store.upsert_verdicts([_verdict(200, Verdict.ZOMBIE, start_s=2000.0, disconnect_s=2060.001, end_s=2260.0,
                                    lag=199.999, details={"evidence": "engine_metrics", "lag_at_least_s": 0.5})])
    [timeout] = build_report(store, HOUR).client_timeouts
    assert (timeout.disconnects, timeout.zombies) == (11, 6)
    assert timeout.zombie_work_max_seconds == 65.006  # not 260


def test_closes_as_answers_ended_at_one_age_are_no_timeout() -> None:
    # A benchmark whose answers are all as long: its clients close as each ends (completed, or
    # unconfirmed as a race with the end), all at one age. None of them cut an answer short.
    rng = random.Random(6)
    whole = bins_of([2.5 + rng.uniform(0, 0.02) for _ in range(200)])
    ended = [replace(b, completed=b.disconnects, aborted=0, zombies=0, cut=0) for b in whole]
    assert find_timeouts(ended + bins_of([rng.uniform(0.1, 5.0) for _ in range(100)])) == []
    # The same ages with the answers cut: a timeout, its band holding both.
    assert [t.disconnects for t in find_timeouts(whole)] == [200]


def test_the_store_counts_closes_at_the_answers_end_out_of_a_spike(store: Store) -> None:
    # Ten clients that closed as their 30 s answers ended: five completed, five unconfirmed as a
    # race with the end. Read from the store, they are no timeout.
    store.upsert_verdicts([
        _verdict(300 + k, Verdict.COMPLETED if k % 2 else Verdict.UNCONFIRMED, start_s=100.0 + 20 * k,
                 disconnect_s=130.0 + 20 * k + 0.001 * k, end_s=130.0 + 20 * k, lag=0.0,
                 details={} if k % 2 else {"unconfirmed_because": "raced_its_answer"})
        for k in range(10)])
    assert build_report(store, HOUR).client_timeouts == []
    fill_timeouts(store, from_s=400.0)
    assert [t.disconnects for t in build_report(store, HOUR).client_timeouts] == [10]


def test_a_timeout_says_who_it_cut(store: Store) -> None:
    fill(store)  # disconnects at other ages, from the same address and SDK: not the timeout's
    # A job behind a proxy: seven of its requests cut at 60 s from one address, three from another
    # address with no User-Agent named.
    store.upsert_verdicts([
        replace(_verdict(300 + k, Verdict.ZOMBIE, start_s=1500.0 + 20 * k, disconnect_s=1560.0 + 20 * k + 0.001 * k,
                         end_s=1570.0 + 20 * k, lag=10.0, user_agent=None if k >= 7 else "nightly-evals/2.1"),
                client_addr="10.0.5.5" if k >= 7 else "10.0.5.4")
        for k in range(10)])
    report = build_report(store, HOUR)
    [timeout] = report.client_timeouts
    assert timeout.disconnects == 10
    assert timeout.user_agents == (("nightly-evals/2.1", 7), (None, 3))
    assert timeout.client_addresses == (("10.0.5.4", 7), ("10.0.5.5", 3))
    document = report_dict(report)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert document["client_timeouts"][0]["user_agents"] == [{"user_agent": "nightly-evals/2.1", "disconnects": 7},
                                                             {"user_agent": None, "disconnects": 3}]
    assert "sent by nightly-evals/2.1 (7), - (3); from 10.0.5.4 (7), 10.0.5.5 (3)" in " ".join(
        render_table(report).split())
    assert "sent by nightly-evals/2.1 (7)" in render_html(report)
