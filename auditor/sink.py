"""The one interface every source writes through: a batch of records in, how many stored out.

Probes, collectors and samplers hold a ``Sink``, never the store itself; ``auditor.store.Store``
is the sink the daemon hands them, and a test can hand them anything with ``write``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from auditor.model import ConnEvent, EventRun, SpanRecord, UtilSample

Record = ConnEvent | EventRun | SpanRecord | UtilSample


class Sink(Protocol):
    def write(self, records: Sequence[Record]) -> int:
        """Store one batch of records of one type in one transaction; returns how many were
        stored (a span already stored is skipped). Raises ``StoreError`` when it cannot write."""
        ...
