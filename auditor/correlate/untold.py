"""Which of the clients the kernel listed at a scrape hold a request that nothing tells yet.

An engine without live notices exports a request's spans when it ends, so a client connected at a
scrape may hold a request the gauges count and no span explains (``Correlator.unspanned_clients``
says which). The verdicts that read a scrape ask this of it every round, with a different "read
before" each; under load a port lists hundreds of clients at each of hundreds of scrapes. Testing
every listed client against its connection's spans at every ask was most of a round's time there.

Whether a client is told only changes when a span or notice comes on its connection, and then
only from untold to told. So each listing is tested once, into the clients untold there (with when
the server last read from each, sorted: any "read before" is a bisection), and a round re-tests
only the untold clients of the connections that had news, in the listings that hold them.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from auditor.correlate.traces import Tuple4
from auditor.model import EngineLoad

Key = tuple[int, int]  # (server port, scrape time)


@dataclass(slots=True)
class _Listing:
    by_ns: int  # a span or notice that started by then may tell a client (the scrape's answer)
    untold: dict[Tuple4, int] = field(default_factory=dict)  # client -> when the server last read from it
    reads: list[int] = field(default_factory=list)  # the same times, sorted


class UntoldClients:
    """``told(tuple4, last_read_ns, by_ns)``: whether a span or notice on that connection tells the
    request the server read last at ``last_read_ns``; ``address(addr)``: the address as spans
    carry it."""

    def __init__(self, told: Callable[[Tuple4, int, int], bool], address: Callable[[str], str]) -> None:
        self._told = told
        self._address = address
        self._listings: dict[Key, _Listing] = {}
        # client -> (the one tuple every listing holds it by, the listings where it is untold)
        self._holding: dict[Tuple4, tuple[Tuple4, set[Key]]] = {}
        self._by_age: list[Key] = []  # (port, scrape time) in a heap by time: pruned from the oldest

    def __len__(self) -> int:
        return len(self._listings)

    def count(self, load: EngineLoad, clients: Iterable[tuple[str, int, int]], by_ns: int,
              read_before_ns: int | None = None) -> int:
        """Untold clients of ``load``'s listing ``clients``; ``read_before_ns``: only those the
        server last read by then."""
        key = (load.server_port, load.ts_ns)
        listing = self._listings.get(key)
        if listing is None:
            listing = self._listings[key] = _Listing(by_ns)
            port = load.server_port
            for address, client_port, last_read_ns in clients:
                tuple4 = (self._address(address), client_port, port)
                if not self._told(tuple4, last_read_ns, by_ns):
                    held = self._holding.get(tuple4)
                    if held is None:
                        held = self._holding[tuple4] = (tuple4, set())
                    listing.untold[held[0]] = last_read_ns
                    held[1].add(key)
            listing.reads = sorted(listing.untold.values())
            heapq.heappush(self._by_age, (load.ts_ns, load.server_port))
        reads = listing.reads
        return len(reads) if read_before_ns is None else bisect.bisect_right(reads, read_before_ns)

    def news(self, connections: Iterable[Tuple4]) -> None:
        """Spans or notices came on these connections: re-test them where they were untold."""
        for tuple4 in connections:
            held = self._holding.get(tuple4)
            if held is None:
                continue
            keys = held[1]
            for key in list(keys):
                listing = self._listings[key]
                last_read_ns = listing.untold[tuple4]
                if self._told(tuple4, last_read_ns, listing.by_ns):
                    del listing.untold[tuple4]
                    del listing.reads[bisect.bisect_left(listing.reads, last_read_ns)]
                    keys.discard(key)
            if not keys:
                del self._holding[tuple4]

    def forget_before(self, ts_ns: int) -> None:
        """Let go of the listings of scrapes before ``ts_ns``."""
        while self._by_age and self._by_age[0][0] < ts_ns:
            scraped_ns, port = heapq.heappop(self._by_age)
            listing = self._listings.pop((port, scraped_ns), None)
            if listing is None:
                continue
            for tuple4 in listing.untold:
                held = self._holding.get(tuple4)
                if held is not None:
                    held[1].discard((port, scraped_ns))
                    if not held[1]:
                        del self._holding[tuple4]
