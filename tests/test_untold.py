"""UntoldClients: a listing is tested once, then only where news came, and agrees with a fresh test."""

from __future__ import annotations

from auditor.correlate.untold import UntoldClients
from auditor.model import EngineLoad

PORT = 8000
MS = 1_000_000


def test_a_listing_is_tested_once_and_again_only_where_news_came() -> None:
    spans: dict[tuple[str, int, int], list[int]] = {}  # connection -> its spans' starts
    asked: list[tuple[str, int, int]] = []

    def told(tuple4: tuple[str, int, int], last_read_ns: int, by_ns: int) -> bool:
        asked.append(tuple4)
        return any(last_read_ns - 50 * MS <= start <= by_ns for start in spans.get(tuple4, ()))

    untold = UntoldClients(told, str.lower)
    clients = tuple(("127.0.0.1", 40000 + i, i * 10 * MS) for i in range(5))
    spans[("127.0.0.1", 40001, PORT)] = [5 * MS]  # read at 10 ms: its span tells it
    scrape = EngineLoad(ts_ns=100 * MS, server_port=PORT, running=5)
    by_ns = 102 * MS
    assert untold.count(scrape, clients, by_ns) == 4
    assert untold.count(scrape, clients, by_ns, read_before_ns=20 * MS) == 2  # read at 0 and 20 ms
    assert len(asked) == 5  # the second ask tested nothing
    # Spans came for two connections: one whose request started by the scrape, one after it.
    spans[("127.0.0.1", 40002, PORT)] = [21 * MS]
    spans[("127.0.0.1", 40003, PORT)] = [150 * MS]
    asked.clear()
    untold.news([("127.0.0.1", 40002, PORT), ("127.0.0.1", 40003, PORT), ("127.0.0.1", 40001, PORT),
                 ("127.0.0.1", 49999, PORT)])
    assert sorted(asked) == [("127.0.0.1", 40002, PORT), ("127.0.0.1", 40003, PORT)]  # the untold ones only
    assert untold.count(scrape, clients, by_ns) == 3
    assert untold.count(scrape, clients, by_ns, read_before_ns=20 * MS) == 1
    fresh = UntoldClients(told, str.lower)
    assert fresh.count(scrape, clients, by_ns) == 3 and fresh.count(scrape, clients, by_ns, 20 * MS) == 1
    untold.forget_before(101 * MS)
    assert len(untold) == 0
    untold.news([("127.0.0.1", 40000, PORT)])  # no listing holds it now: nothing to do
