"""The engine core: a waiting queue, continuous batching and one step loop in its own thread.

Requests enter :meth:`Engine.submit` from the HTTP layer and wait in a dict keyed by request id
(so an abort removes a queued request by id, as vLLM's scheduler does). Each step the loop

1. applies pending aborts: queued requests are dropped, running ones leave the batch - so a running
   request is aborted *between* steps, never in the middle of one;
2. admits waiting requests, oldest first, while the batch has room (``max_batch``);
3. runs one step of real compute on the backend: one row per decoding request plus up to
   ``prefill_chunk`` prompt tokens of requests still in prefill (chunked prefill, so a long prompt
   spans several steps and costs more);
4. hands each decoding request its next pseudo-word and finishes those that hit ``max_tokens`` or a
   stop word.

Tokens reach the HTTP handler through ``RequestHandle.deliver`` (thread-safe, set by the caller).
Finished requests go to ``on_finish`` in the engine thread; that is where tracing and the
ground-truth log hook in. The loop never raises: a failing callback is logged once and counted.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from replay.engine.compute import ComputeBackend
from replay.engine.tokens import token_text

log = logging.getLogger(__name__)


class Phase(str, enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestHandle:
    """One request's state; timestamps are wall-clock nanoseconds (``time.time_ns``)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    seed: int
    stream: bool
    model: str
    arrival_at: int
    client_addr: str | None = None
    client_port: int | None = None
    stop_words: frozenset[str] = frozenset()
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    trace_headers: dict[str, str] = dataclasses.field(default_factory=dict)
    work_key: tuple[str, str] | None = None  # (trace id, work id) for the auditor's live notices
    # Called from the engine thread with ("token", text) or ("finish", reason); must not block.
    deliver: Callable[[str, str], None] | None = None

    queued_at: int | None = None
    scheduled_at: int | None = None
    first_token_at: int | None = None
    finished_at: int | None = None
    finish_reason: str | None = None
    phase: Phase = Phase.QUEUED
    prefilled_tokens: int = 0
    tokens_generated: int = 0
    disconnect_at: int | None = None
    phase_at_disconnect: str | None = None
    tokens_at_disconnect: int | None = None
    # Compute spent on this request after ``disconnect_at``: each step's cost (thread CPU-seconds on
    # the CPU, synchronized wall-seconds on a GPU) shared equally among the requests in that step.
    compute_after_disconnect_s: float = 0.0

    @property
    def tokens_after_disconnect(self) -> int | None:
        if self.tokens_at_disconnect is None:
            return None
        return self.tokens_generated - self.tokens_at_disconnect


class Engine:
    """Continuous-batching scheduler and step loop; thread-safe entry points."""

    def __init__(self, backend: ComputeBackend, *, max_batch: int = 8, prefill_chunk: int = 64,
                 on_finish: Callable[[RequestHandle], None] | None = None,
                 on_step: Callable[[float, int, bool], None] | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.backend = backend
        self.max_batch = max_batch
        self.prefill_chunk = max(1, prefill_chunk)
        self._on_finish = on_finish
        self._on_step = on_step
        self._lock = threading.Condition()
        self._waiting: OrderedDict[str, RequestHandle] = OrderedDict()
        self._running: OrderedDict[str, RequestHandle] = OrderedDict()
        self._pending_aborts: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.callback_errors = 0

    # -- entry points (any thread) -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still in flight finish with reason ``abort``."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: RequestHandle) -> None:
        """Queue ``request``; raises ``KeyError`` if its id is already in flight."""
        with self._lock:
            if request.request_id in self._waiting or request.request_id in self._running:
                raise KeyError(request.request_id)
            request.queued_at = time.time_ns()
            self._waiting[request.request_id] = request
            self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        """Ask for ``request_id`` to stop; applied before the next step. Unknown ids are ignored."""
        with self._lock:
            if request_id in self._waiting or request_id in self._running:
                self._pending_aborts.add(request_id)
                self._lock.notify_all()

    def note_disconnect(self, request: RequestHandle, at_ns: int) -> None:
        """Record when the client left (ground truth), whatever the behaviour does about it."""
        with self._lock:
            # A finished request's record is frozen (callbacks read it without the lock): a client
            # leaving after the end is not a disconnect in flight.
            if request.disconnect_at is None and request.phase is not Phase.FINISHED:
                request.disconnect_at = at_ns
                request.phase_at_disconnect = request.phase.value
                request.tokens_at_disconnect = request.tokens_generated

    def phase_of(self, request: RequestHandle) -> Phase:
        with self._lock:
            return request.phase

    def counts(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        with self._lock:
            return len(self._running), len(self._waiting)

    def tokens_held(self) -> int:
        """The tokens the running requests hold in the KV cache (prompt so far and generated)."""
        with self._lock:
            return sum(r.prefilled_tokens + r.tokens_generated for r in self._running.values())

    # -- the loop (engine thread only) ---------------------------------------------------------

    def _loop(self) -> None:
        leftovers: list[RequestHandle] | None = None
        while leftovers is None:
            try:
                leftovers = self._iteration()
            except Exception:  # a bug here must not silently stop every request forever
                self.callback_errors += 1
                log.exception("engine loop iteration failed; continuing")
                time.sleep(0.01)
        with self._lock:
            now = time.time_ns()
            for request in leftovers:
                self._mark_finished(request, "abort", now)
        for request in leftovers:
            self._finish_callbacks(request)

    def _iteration(self) -> list[RequestHandle] | None:
        """One scheduling round; when stopping, returns the requests still in flight."""
        with self._lock:
            while not self._stopping and not self._waiting and not self._running and not self._pending_aborts:
                self._lock.wait()
            if self._stopping:
                leftovers = list(self._waiting.values()) + list(self._running.values())
                self._waiting.clear()
                self._running.clear()
                return leftovers
            finished = self._apply_aborts()
            self._admit()
            prefilling, decoding = self._plan()
        for request in finished:
            self._finish_callbacks(request)
        if prefilling or decoding:
            self._step(prefilling, decoding)
        return None

    def _apply_aborts(self) -> list[RequestHandle]:
        now = time.time_ns()
        finished = []
        for request_id in self._pending_aborts:
            request = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
            if request is not None:
                self._mark_finished(request, "abort", now)
                finished.append(request)
        self._pending_aborts.clear()
        return finished

    def _admit(self) -> None:
        now = time.time_ns()
        while self._waiting and len(self._running) < self.max_batch:
            _, request = self._waiting.popitem(last=False)
            request.scheduled_at = now
            request.phase = Phase.PREFILL
            self._running[request.request_id] = request

    def _plan(self) -> tuple[list[tuple[RequestHandle, int]], list[RequestHandle]]:
        """Which requests prefill how many prompt tokens this step, and which decode."""
        prefilling: list[tuple[RequestHandle, int]] = []
        decoding: list[RequestHandle] = []
        budget = self.prefill_chunk
        for request in self._running.values():
            if request.phase is Phase.DECODE:
                decoding.append(request)
            elif budget > 0:
                chunk = min(budget, request.prompt_tokens - request.prefilled_tokens)
                budget -= chunk
                prefilling.append((request, chunk))
        return prefilling, decoding

    def _step(self, prefilling: list[tuple[RequestHandle, int]], decoding: list[RequestHandle]) -> None:
        rows = len(decoding) + sum(chunk for _, chunk in prefilling)
        started_ns, spent_from = time.time_ns(), self._cost_clock()
        started = time.perf_counter()
        try:
            self.backend.step(rows)
        except Exception:  # a broken device must not kill the loop silently mid-request
            log.exception("compute step failed (rows=%d); continuing", rows)
        elapsed = time.perf_counter() - started
        spent = self._cost_clock() - spent_from
        self.steps += 1
        now = time.time_ns()
        deliveries: list[tuple[RequestHandle, str, str]] = []
        finished: list[RequestHandle] = []
        with self._lock:
            self._charge([r for r, _ in prefilling] + decoding, spent, started_ns, now)
            for request, chunk in prefilling:
                if request.request_id not in self._running:
                    continue
                request.prefilled_tokens += chunk
                if request.prefilled_tokens >= request.prompt_tokens:
                    # The step that completes the prompt also samples the first token, as in vLLM.
                    request.phase = Phase.DECODE
                    decoding.append(request)
            for request in decoding:
                if request.request_id not in self._running:
                    continue
                word = token_text(request.seed, request.tokens_generated).strip()
                if word in request.stop_words:
                    self._running.pop(request.request_id)
                    self._mark_finished(request, "stop", now)
                    finished.append(request)
                    continue
                text = token_text(request.seed, request.tokens_generated)
                request.tokens_generated += 1
                if request.first_token_at is None:
                    request.first_token_at = now
                deliveries.append((request, "token", text))
                if request.tokens_generated >= request.max_tokens:
                    self._running.pop(request.request_id)
                    self._mark_finished(request, "length", now)
                    finished.append(request)
        for request, kind, payload in deliveries:
            self._deliver(request, kind, payload)
        for request in finished:
            self._finish_callbacks(request)
        if self._on_step is not None:
            try:
                self._on_step(elapsed, len(deliveries), bool(prefilling))
            except Exception:
                self._callback_failed("on_step")

    def _cost_clock(self) -> float:
        """What a step costs: this thread's CPU time on the CPU (other threads' work is not the
        step's), wall time on a GPU (each step ends synchronized)."""
        return time.thread_time() if self.backend.device == "cpu" else time.perf_counter()

    @staticmethod
    def _charge(members: list[RequestHandle], spent: float, started_ns: int, ended_ns: int) -> None:
        """Ground truth of waste: each member's equal share of the step, the part after its client left."""
        for request in members:
            if request.disconnect_at is None or request.disconnect_at >= ended_ns:
                continue
            after = (ended_ns - max(started_ns, request.disconnect_at)) / max(1, ended_ns - started_ns)
            request.compute_after_disconnect_s += spent * after / len(members)

    @staticmethod
    def _mark_finished(request: RequestHandle, reason: str, now: int) -> None:
        request.finish_reason = reason
        request.finished_at = now
        request.phase = Phase.FINISHED

    def _deliver(self, request: RequestHandle, kind: str, payload: str) -> None:
        if request.deliver is None:
            return
        try:
            request.deliver(kind, payload)
        except Exception:
            self._callback_failed("deliver")

    def _finish_callbacks(self, request: RequestHandle) -> None:
        self._deliver(request, "finish", request.finish_reason or "abort")
        if self._on_finish is not None:
            try:
                self._on_finish(request)
            except Exception:
                self._callback_failed("on_finish")

    def _callback_failed(self, which: str) -> None:
        self.callback_errors += 1
        if self.callback_errors == 1 or self.callback_errors % 1000 == 0:
            log.exception("engine callback %s failed (%d so far); continuing", which, self.callback_errors)

