"""Batched writes of connection events to the store.

The daemon's poll loop calls ``add()`` with whatever a source returned (an empty list too, so the
time-based flush happens on quiet hosts). Batches go to a ``auditor.sink.Sink`` (the daemon hands
it the store, which keeps a batch as one row): one transaction per batch. A failed write never
raises out of ``add()``: the batch is kept and retried on the next flush, up to ``max_pending``
events, beyond which the oldest are dropped and counted in ``dropped`` (with any event the sink
said it could never store). ``add`` and ``flush`` may be called from
different threads (the daemon's probe loop adds, its correlation round flushes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from auditor.errors import StoreError
from auditor.model import ConnEvent, EventRun
from auditor.sink import Sink

log = logging.getLogger(__name__)


class ConnEventWriter:
    """Buffers ConnEvents (or the probe's undecoded EventRuns) and inserts them in batches of
    about ``batch_size`` events or every ``flush_interval_s``. A run is never split: a batch of
    runs holds whole runs up to ``batch_size`` events (one larger run alone)."""

    def __init__(self, sink: Sink, *, batch_size: int = 2000, flush_interval_s: float = 0.5,
                 max_pending: int = 1_000_000,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be greater than 0, got {flush_interval_s}")
        self._sink = sink
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_pending = max(max_pending, batch_size)
        self._monotonic = monotonic
        self._pending: deque[ConnEvent | EventRun] = deque()
        self._queued = 0  # events in _pending (a run counts its records)
        self._lock = threading.Lock()
        self._last_flush = monotonic()
        self._failing = False
        self.written = 0  # events stored so far
        self.dropped = 0  # events given up on: the store kept failing, or could never hold them
        self.write_errors = 0

    @property
    def pending(self) -> int:
        """Events queued (a run counts its records)."""
        return self._queued

    def add(self, items: Iterable[ConnEvent | EventRun]) -> None:
        """Queue events or runs; writes full batches, and everything once the interval has passed."""
        with self._lock:
            items = list(items)
            self._pending.extend(items)
            self._queued += sum(map(_events_in, items))
            while self._queued > self.max_pending:
                dropped = _events_in(self._pending.popleft())
                self._queued -= dropped
                self.dropped += dropped
            interval_due = self._monotonic() - self._last_flush >= self.flush_interval_s
            if interval_due or self._queued >= self.batch_size:
                # A failure is logged and counted in _write(); the events stay queued for the next try.
                with contextlib.suppress(StoreError):
                    self._write(full_batches_only=not interval_due)

    def flush(self) -> int:
        """Write everything queued now; returns how many events were written. Raises StoreError."""
        with self._lock:
            return self._write(full_batches_only=False)

    def _next_batch(self) -> tuple[list[ConnEvent | EventRun], int]:
        """The oldest queued items of one type, up to batch_size events (at least one item)."""
        kind = type(self._pending[0])
        batch: list[ConnEvent | EventRun] = []
        events = 0
        for item in self._pending:
            weight = _events_in(item)
            if batch and (type(item) is not kind or events + weight > self.batch_size):
                break
            batch.append(item)
            events += weight
        return batch, events

    def _write(self, *, full_batches_only: bool) -> int:
        written = 0
        if not full_batches_only:
            self._last_flush = self._monotonic()
        while self._pending and (self._queued >= self.batch_size or not full_batches_only):
            batch, events = self._next_batch()
            try:
                stored = self._sink.write(batch)
            except StoreError as exc:
                self.write_errors += 1
                if not self._failing:
                    log.error("storing connection events failed (%s); %d queued, retrying", exc,
                              self._queued)
                    self._failing = True
                raise
            for _ in range(len(batch)):
                self._pending.popleft()
            self._queued -= events
            written += events
            self.written += stored
            self.dropped += events - stored  # events the store could never hold (it logged them)
        if self._failing and written:
            log.info("storing connection events works again")
            self._failing = False
        return written

    def close(self) -> None:
        """Write what is left. Raises StoreError if it cannot; the caller reports the loss."""
        self.flush()


def _events_in(item: ConnEvent | EventRun) -> int:
    return item.record_count if type(item) is EventRun else 1
