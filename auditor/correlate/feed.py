"""Spans handed from the daemon's span writer to its correlator in memory, once committed.

Reading every committed span back from the store (a query, then a row turned back into a record)
was the largest single cost of a correlation round under load. The writer already holds each
span as a record: after its commit it puts them here, and the correlator takes them each round.
Only committed spans come through, so what the correlator judges is what a restart would read.
The records are the correlator's from then on (it trims their attributes to what it reads).

Bounded: a correlator that stops taking (a round stuck on a locked database) must not let the
daemon's memory grow with the ingest rate. Past ``max_spans`` waiting, further spans are not kept
and the feed reads as overflowed; the correlator then catches up from the store, as after a
restart (duplicates are recognised there), and re-arms the feed first, so no span falls between.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from auditor.model import SpanRecord

MAX_WAITING_SPANS = 50_000  # as many as one store read of the correlator takes


class SpanFeed:
    def __init__(self, max_spans: int = MAX_WAITING_SPANS) -> None:
        self.max_spans = max_spans
        self._spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self._overflowed = False
        self.overflows = 0

    def committed(self, spans: Sequence[SpanRecord]) -> None:
        """The writer's hook: these spans are in the store now."""
        with self._lock:
            if self._overflowed:
                return
            if len(self._spans) + len(spans) > self.max_spans:
                self._overflowed = True
                self.overflows += 1
                self._spans = []
                return
            self._spans.extend(spans)

    def take(self) -> list[SpanRecord] | None:
        """The spans committed since the last take, oldest first; None after an overflow (some
        were not kept: read the store), until ``rearm``."""
        with self._lock:
            if self._overflowed:
                return None
            spans, self._spans = self._spans, []
            return spans

    def rearm(self) -> None:
        """Keep spans again, from now on (call before catching up from the store)."""
        with self._lock:
            self._overflowed = False
            self._spans = []
