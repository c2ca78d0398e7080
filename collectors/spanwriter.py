"""Durable, batched span writes with back-pressure: the only way the receivers reach the store.

``SpanWriter.submit`` returns only once the spans are committed, so an OTLP request is acknowledged
only after its data is safe. Requests wait in a bounded queue, and everything waiting is committed
in a single transaction (group commit): many concurrent requests share one commit, which is what
makes SQLite fast enough. The commit is made by a submitting thread, not by a writer thread of its
own: a submitter that finds no commit under way takes the queue and commits it (the leader); those
that come meanwhile wait, and one of them leads the next commit. A lone exporter's request is
committed by the thread that read it, with no hand-off to wake another thread for. The queue is
bounded in spans and bytes; when it is full, or the database cannot be written (locked past its
busy timeout, disk full), ``submit`` raises :class:`BackPressure` with a retry delay that the
receivers turn into 429/503 + ``Retry-After``. After a failed commit, new work is refused for
``retry_after_s`` so a locked database is not hammered; later submissions land normally once it is
writable again. The advertised retry delay grows with the outage (up to ``max_retry_after_s``):
exporters honour ``Retry-After`` and give up after a handful of retries, so a fixed 1 s would make
them drop spans after a few seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from auditor.errors import StoreError
from auditor.model import SpanRecord
from auditor.sink import Sink

log = logging.getLogger(__name__)

QUEUE_FULL = "queue_full"
STORE_UNAVAILABLE = "store_unavailable"


class BackPressure(Exception):
    """The spans were not taken; try again after ``retry_after_s`` seconds."""

    def __init__(self, retry_after_s: float, reason: str, kind: str = QUEUE_FULL) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.kind = kind  # QUEUE_FULL (answer 429) or STORE_UNAVAILABLE (answer 503)


@dataclass(eq=False)
class _Pending:
    spans: Sequence[SpanRecord]
    nbytes: int
    done: bool = False  # under the writer's lock
    error: BackPressure | None = None


class SpanWriter:
    """Bounded queue of spans, committed in batches to a ``auditor.sink.Sink`` by its submitters."""

    def __init__(self, sink: Sink, *, max_queue_spans: int = 32_768, max_queue_bytes: int = 128 << 20,
                 max_batch_spans: int = 16_384, retry_after_s: float = 1.0, max_retry_after_s: float = 30.0,
                 submit_timeout_s: float = 30.0, queue_wait_s: float = 1.0,
                 on_commit: Callable[[Sequence[SpanRecord]], None] | None = None) -> None:
        self.sink = sink
        self.on_commit = on_commit  # told of every batch once it is committed (the daemon's correlator)
        self.max_queue_spans = max_queue_spans
        self.max_queue_bytes = max_queue_bytes
        self.max_batch_spans = max_batch_spans
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self.submit_timeout_s = submit_timeout_s
        self.queue_wait_s = queue_wait_s
        self._queue: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._queued_spans = 0
        self._queued_bytes = 0
        self._refuse_until = 0.0  # monotonic time before which new work is refused after a failure
        self._failing_since: float | None = None  # monotonic start of the current store outage
        self._last_error = ""
        self._running = False
        self._committing = False  # a leader is committing a batch
        # Counters for /metrics.
        self.committed_spans = 0
        self.commits = 0
        self.failed_commits = 0
        self.refused_queue_full = 0
        self.refused_store_unavailable = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> SpanWriter:
        with self._cond:
            self._running = True
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new work, commit what is queued, then stop; anything left after ``timeout_s``
        (a commit that does not finish) is refused."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._running = False
        while True:
            with self._cond:
                while self._committing and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                if self._committing or not self._queue:
                    leftovers = list(self._queue)
                    self._queue.clear()
                    for item in leftovers:
                        self._queued_spans -= len(item.spans)
                        self._queued_bytes -= item.nbytes
                        item.error = BackPressure(self.retry_after_s, "span writer stopped", STORE_UNAVAILABLE)
                        item.done = True
                    self._cond.notify_all()
                    return
                batch = self._lead()
            self._commit_and_release(batch)

    # -- producer side ----------------------------------------------------------------------
    def check_capacity(self, nbytes: int = 0) -> None:
        """Raise BackPressure now if new work would be refused: lets a receiver say 429/503 before
        it spends anything on reading and decoding a body."""
        with self._cond:
            self._raise_if_store_refusing()
            if self._queued_spans >= self.max_queue_spans or (
                    self._queued_bytes and self._queued_bytes + nbytes > self.max_queue_bytes):
                self.refused_queue_full += 1
                raise self._queue_full()

    def _raise_if_store_refusing(self) -> None:
        if time.monotonic() < self._refuse_until:
            self.refused_store_unavailable += 1
            raise BackPressure(self._store_retry_after(), f"store unavailable: {self._last_error}",
                               STORE_UNAVAILABLE)

    def _store_retry_after(self) -> float:
        """As long as the outage has lasted so far, so exporters back off about as fast as it grows."""
        if self._failing_since is None:
            return self.retry_after_s
        outage = time.monotonic() - self._failing_since
        return min(self.max_retry_after_s, max(self.retry_after_s, round(outage, 1)))

    def _over_capacity(self, nspans: int, nbytes: int) -> bool:
        # An empty queue takes anything, so one request larger than the bounds still gets in.
        over_spans = self._queued_spans and self._queued_spans + nspans > self.max_queue_spans
        over_bytes = self._queued_bytes and self._queued_bytes + nbytes > self.max_queue_bytes
        return bool(over_spans or over_bytes)

    def _queue_full(self) -> BackPressure:
        return BackPressure(self.retry_after_s,
                            f"write queue full ({self._queued_spans} spans, {self._queued_bytes} bytes)")

    def submit(self, spans: Sequence[SpanRecord], nbytes: int = 0) -> int:
        """Queue spans and wait until they are committed; returns how many were written.

        When the queue is full, waits up to ``queue_wait_s`` for room (the caller has already paid
        for decoding; a short wait beats throwing that work away), then raises BackPressure. Also
        raises it when the store cannot be written, or when the commit takes longer than
        ``submit_timeout_s`` (the spans may still land then; writes are idempotent).
        """
        if not spans:
            return 0
        item = _Pending(spans, nbytes)
        with self._cond:
            deadline = time.monotonic() + self.queue_wait_s
            while True:
                if not self._running:
                    raise BackPressure(self.retry_after_s, "span writer is not running", STORE_UNAVAILABLE)
                self._raise_if_store_refusing()
                if not self._over_capacity(len(spans), nbytes):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.refused_queue_full += 1
                    raise self._queue_full()
                self._cond.wait(remaining)
            self._queue.append(item)
            self._queued_spans += len(spans)
            self._queued_bytes += nbytes
        give_up = time.monotonic() + self.submit_timeout_s
        while True:
            with self._cond:
                # Wait while another thread commits; lead the next commit if this item still waits.
                while not item.done and self._committing:
                    remaining = give_up - time.monotonic()
                    if remaining <= 0:
                        raise BackPressure(self.retry_after_s, "commit did not finish in time", STORE_UNAVAILABLE)
                    self._cond.wait(remaining)
                if item.done:
                    break
                batch = self._lead()
            self._commit_and_release(batch)
        if item.error is not None:
            raise item.error
        return len(spans)

    # -- the leader's commit ----------------------------------------------------------------
    def _lead(self) -> list[_Pending]:
        """Take the queue's first batch to commit it (under the lock; the queue is not empty)."""
        self._committing = True
        batch: list[_Pending] = []
        count = 0
        while self._queue and (not batch or count + len(self._queue[0].spans) <= self.max_batch_spans):
            item = self._queue.popleft()
            batch.append(item)
            count += len(item.spans)
        return batch

    def _commit_and_release(self, batch: list[_Pending]) -> None:
        try:
            self._commit(batch)
        finally:
            with self._cond:
                self._committing = False
                for item in batch:
                    self._queued_spans -= len(item.spans)
                    self._queued_bytes -= item.nbytes
                    item.done = True
                self._cond.notify_all()  # the batch's submitters, the next leader, those waiting for room

    def _insert(self, spans: Sequence[SpanRecord]) -> None:
        self.sink.write(spans)  # one transaction; raises StoreError when it cannot write

    def _commit(self, batch: list[_Pending]) -> None:
        spans = [span for item in batch for span in item.spans]
        try:
            self._insert(spans)
        except StoreError as exc:
            self._fail(batch, str(exc))
            return
        except Exception as exc:  # unexpected: find the request that causes it, keep the others
            log.exception("span batch of %d spans failed; retrying request by request", len(spans))
            self._commit_one_by_one(batch, exc)
            return
        self.commits += 1
        self.committed_spans += len(spans)
        self._failing_since = None
        self._committed(spans)

    def _committed(self, spans: Sequence[SpanRecord]) -> None:
        if self.on_commit is not None:
            try:
                self.on_commit(spans)
            except Exception:  # the spans are stored: a failing listener must not undo that
                log.exception("span commit listener failed")

    def _commit_one_by_one(self, batch: list[_Pending], first_error: Exception) -> None:
        for item in batch:
            try:
                self._insert(item.spans)
            except Exception as exc:
                self.failed_commits += 1
                item.error = BackPressure(self.retry_after_s, f"write failed: {exc or first_error}",
                                          STORE_UNAVAILABLE)
                continue
            self.commits += 1
            self.committed_spans += len(item.spans)
            self._committed(item.spans)

    def _fail(self, batch: list[_Pending], message: str) -> None:
        self.failed_commits += 1
        if self._last_error != message:
            log.warning("span commit failed, answering back-pressure for %.1f s: %s",
                        self.retry_after_s, message)
        with self._cond:
            self._last_error = message
            self._refuse_until = time.monotonic() + self.retry_after_s
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            retry_after = self._store_retry_after()
        for item in batch:
            item.error = BackPressure(retry_after, f"store unavailable: {message}", STORE_UNAVAILABLE)

    # -- introspection ----------------------------------------------------------------------
    @property
    def queue_depth_spans(self) -> int:
        return self._queued_spans

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "queue_spans": self._queued_spans,
                "queue_bytes": self._queued_bytes,
                "committed_spans": self.committed_spans,
                "commits": self.commits,
                "failed_commits": self.failed_commits,
                "refused_queue_full": self.refused_queue_full,
                "refused_store_unavailable": self.refused_store_unavailable,
            }
