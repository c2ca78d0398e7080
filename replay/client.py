"""A load client that cancels requests the way users and proxies do.

Cancellation follows AIPerf's semantics: a chosen fraction of requests is cancelled; the timer
starts when the request has been fully written (T2), so a delay of 0 means "send everything, then
leave at once", and the same delay hits the same point of a request's life whatever the load. A
cancelled request closes with FIN (a browser tab, AIPerf) or RST (a proxy timeout). Every request
carries ``X-Request-Id`` and a W3C ``traceparent`` so the auditor's verdicts join to it exactly.
Each request has a connection of its own (``Connection: close``) unless the load keeps them alive
(``KeptConnections``), as an SDK's pool does: then a request reuses a connection that earlier
ones completed on, and a cancel closes that connection under it.

h11 frames the HTTP/1.1 exchange over raw asyncio streams: the socket stays ours, because the point
is control over when and how it ends (FIN after draining, or RST, at an exact time after T2).
An answer of 4xx or 5xx, a refused connection or a response not complete within the timeout is
an error, never a completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import h11

from auditor import __version__

# Replayed traffic names itself: the engine's logs and the auditor's report (by user agent) tell it
# from the clients it stands in for.
USER_AGENT = f"zombie-auditor-replay/{__version__}"


@dataclass(frozen=True, slots=True)
class RequestPlan:
    request_id: str
    trace_id: str
    body: dict[str, object]
    path: str = "/v1/completions"
    cancel_after_s: float | None = None  # from T2 (request fully written); None: read to the end
    close_with: str = "fin"  # "fin" or "rst"
    start_at_s: float = 0.0  # not sent before this long after the load starts (replay pacing)


@dataclass(slots=True)
class RequestOutcome:
    plan: RequestPlan
    sent_at_ns: int = 0  # T2
    cancelled_at_ns: int | None = None
    timed_out_at_ns: int | None = None  # the client gave up on the answer (its timeout) and closed
    completed: bool = False  # the whole response was read before any cancel
    status: int | None = None
    bytes_read: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class LoadSpec:
    requests: int = 40
    concurrency: int = 8
    cancel_fraction: float = 0.3
    cancel_delays_s: tuple[float, ...] = (0.0, 0.2, 0.5)
    close_with: tuple[str, ...] = ("fin", "rst")
    max_tokens: tuple[int, ...] = (32, 64, 128)
    stream_fraction: float = 0.5
    model: str = "ref-llm-1b"
    seed: int = 7
    tag: str = "load"


def plan_load(spec: LoadSpec) -> list[RequestPlan]:
    """A reproducible request mix: the same spec and seed give the same requests and cancels.

    Trace ids are new on every call, so two runs of one plan never share a trace."""
    rng = random.Random(spec.seed)
    plans = []
    for index in range(spec.requests):
        cancelled = rng.random() < spec.cancel_fraction
        stream = rng.random() < spec.stream_fraction
        words = rng.choice((8, 32, 128))
        body: dict[str, object] = {"model": spec.model, "prompt": " ".join(["token"] * words),
                                   "max_tokens": rng.choice(spec.max_tokens), "stream": stream}
        plans.append(RequestPlan(
            request_id=f"{spec.tag}-{index:05d}", trace_id=secrets.token_hex(16), body=body,
            cancel_after_s=rng.choice(spec.cancel_delays_s) if cancelled else None,
            close_with=rng.choice(spec.close_with)))
    return plans


# A FIN-closing client reads what is still on the way before it closes: closing a socket with
# unread bytes makes the kernel send RST, and the engine would see a proxy's close, not a browser's.
FIN_DRAIN_S = 2.0


class KeptConnections:
    """HTTP/1.1 keep-alive, the way an SDK's connection pool does it (httpx under the openai SDK):
    a request takes an idle connection (here the one that went idle last; httpx takes the first
    in its list) or opens one, and gives it back once it has read its whole answer. A cancelled
    request's connection is closed (FIN or RST, as planned) and never reused; so is one the
    server closed while it was idle (its keep-alive timeout), found at the next take. ``close()``
    ends the idle ones with the client's FIN."""

    def __init__(self) -> None:
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection]] = []
        self.opened = 0  # connections opened
        self.reused = 0  # requests sent on a connection an earlier request completed on

    async def take(self, host: str, port: int, *, fresh: bool = False
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection, bool]:
        """A connection for the next request (``fresh``: a new one), and whether an earlier
        request completed on it."""
        while self._idle and not fresh:
            reader, writer, connection = self._idle.pop()
            if reader.at_eof() or writer.is_closing():  # the server closed it while it was idle
                writer.close()
                continue
            self.reused += 1
            return reader, writer, connection, True
        reader, writer = await asyncio.open_connection(host, port)
        self.opened += 1
        return reader, writer, h11.Connection(h11.CLIENT), False

    def give_back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: h11.Connection) -> None:
        if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
            connection.start_next_cycle()
            self._idle.append((reader, writer, connection))
        else:  # the server asked to close, or the exchange did not end cleanly
            writer.close()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer, _ in idle:
            writer.close()
        for _, writer, _ in idle:
            with contextlib.suppress(OSError):  # the server's reset of it, say
                await writer.wait_closed()


def _request_bytes(connection: h11.Connection, plan: RequestPlan, host: str, *, keep_alive: bool = False) -> bytes:
    data = json.dumps(plan.body).encode()
    headers = [("Host", host), ("Content-Type", "application/json"), ("Accept", "text/event-stream"),
               ("User-Agent", USER_AGENT), ("X-Request-Id", plan.request_id),
               ("traceparent", f"00-{plan.trace_id}-{secrets.token_hex(8)}-01"),
               ("Content-Length", str(len(data)))] + ([] if keep_alive else [("Connection", "close")])
    return b"".join(connection.send(event) or b"" for event in (
        h11.Request(method="POST", target=plan.path, headers=headers), h11.Data(data=data), h11.EndOfMessage()))


async def _abort(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, close_with: str,
                 connection: h11.Connection | None = None, outcome: RequestOutcome | None = None) -> None:
    """Close at the planned moment: a reset, or a FIN and a drain of what the server still sends,
    whose status line, where one comes, goes to ``outcome`` (a target that refused the request
    answers it as the cancel goes out, and that is no abort)."""
    sock = writer.get_extra_info("socket")
    if close_with == "rst" and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return
    if sock is not None:
        sock.shutdown(socket.SHUT_WR)  # FIN now, at the planned moment
    try:
        async with asyncio.timeout(FIN_DRAIN_S):
            while data := await reader.read(65536):
                if connection is not None and outcome is not None and outcome.status is None:
                    _note_status(connection, data, outcome)
    except (TimeoutError, OSError):
        pass  # an engine still streaming to a closed client: close anyway
    writer.close()


def _note_status(connection: h11.Connection, data: bytes, outcome: RequestOutcome) -> None:
    """The response's status, if ``data`` completes its head."""
    try:
        connection.receive_data(data)
        while (event := connection.next_event()) is not h11.NEED_DATA:
            if isinstance(event, h11.Response):
                outcome.status = event.status_code
                return
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    except h11.ProtocolError:
        return


async def _run_one(host: str, port: int, plan: RequestPlan, timeout_s: float | None,
                   connections: KeptConnections | None = None) -> RequestOutcome:
    outcome, stale = await _exchange(host, port, plan, timeout_s, connections, reuse=True)
    if stale:  # a kept connection the server closed as the request went out: once more, on a new one
        outcome, _ = await _exchange(host, port, plan, timeout_s, connections, reuse=False)
    return outcome


async def _exchange(host: str, port: int, plan: RequestPlan, timeout_s: float | None,
                    connections: KeptConnections | None, *, reuse: bool) -> tuple[RequestOutcome, bool]:
    """One try; and whether it went out on a kept connection that the server had closed (nothing
    came back, no timer fired), as an SDK retries once."""
    outcome = RequestOutcome(plan)
    reused = timed_out = False
    try:
        if connections is not None:
            reader, writer, connection, reused = await connections.take(host, port, fresh=not reuse)
        else:
            reader, writer = await asyncio.open_connection(host, port)
            connection = h11.Connection(h11.CLIENT)
    except OSError as exc:
        outcome.error = f"connect: {exc.strerror or exc}"
        return outcome, False
    try:
        writer.write(_request_bytes(connection, plan, f"{host}:{port}", keep_alive=connections is not None))
        await writer.drain()
        outcome.sent_at_ns = time.time_ns()  # T2: every timer starts here
        read = asyncio.ensure_future(_read_response(reader, connection, outcome))
        limit = plan.cancel_after_s if plan.cancel_after_s is not None else timeout_s
        done, _ = await asyncio.wait({read}, timeout=limit)
        if not done:
            read.cancel()
            await asyncio.wait({read})  # let it end: the drain below reads the same stream
            if plan.cancel_after_s is None:  # no answer within --request-timeout
                outcome.error = f"timeout: no complete response after {timeout_s:g} s"
                outcome.timed_out_at_ns = time.time_ns()
                timed_out = True
            else:  # still waiting for the response when the timer fired: cancel
                outcome.cancelled_at_ns = time.time_ns()
                answered = outcome.status is not None
                await _abort(reader, writer, plan.close_with, connection, outcome)
                if outcome.status is not None and outcome.status >= 400:
                    outcome.error = (f"HTTP {outcome.status} " + ("before the cancel" if answered else
                                     "as the cancel went out: the target refused the request"))
                return outcome, False
        else:
            read.result()
        outcome.completed = outcome.error is None
    except (OSError, h11.ProtocolError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    stale = reused and outcome.status is None and not timed_out
    if connections is not None and outcome.completed and not stale:
        connections.give_back(reader, writer, connection)
    else:
        writer.close()
    return outcome, stale


async def _read_response(reader: asyncio.StreamReader, connection: h11.Connection,
                         outcome: RequestOutcome) -> None:
    """Read one response to its end through h11 (Content-Length, chunked or close-delimited); a
    4xx or 5xx answer becomes the outcome's error, with the start of its body."""
    head = b""
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            outcome.status = event.status_code
        elif isinstance(event, h11.Data):
            outcome.bytes_read += len(event.data)
            if len(head) < 200:
                head += bytes(event.data[:200])
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    if outcome.status is not None and outcome.status >= 400:
        text = " ".join(head.decode("utf-8", "replace").split())[:120]
        outcome.error = f"HTTP {outcome.status}" + (f": {text}" if text else "")


async def run_load(host: str, port: int, plans: list[RequestPlan], *, concurrency: int,
                   timeout_s: float | None = None, on_done: Callable[[RequestOutcome], None] | None = None,
                   connections: KeptConnections | None = None) -> list[RequestOutcome]:
    """Send every plan with at most ``concurrency`` in flight, none before its ``start_at_s``;
    results in plan order. Plans start in ``start_at_s`` order, and only the requests in flight
    exist as tasks, so an hour of captured traffic costs the memory of ``concurrency`` requests.
    ``timeout_s`` bounds a request that is not cancelled (None: no bound). ``connections``: keep
    connections alive in that pool (the caller closes it) instead of one a request."""
    gate = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: list[RequestOutcome] = [RequestOutcome(plan) for plan in plans]
    running: set[asyncio.Task[None]] = set()

    async def one(index: int, plan: RequestPlan) -> None:
        try:
            results[index] = await _run_one(host, port, plan, timeout_s, connections)
        except Exception as exc:  # a bug here costs one request, never the run
            results[index].error = f"{type(exc).__name__}: {exc}"
        finally:
            gate.release()
        if on_done is not None:
            on_done(results[index])

    for index in sorted(range(len(plans)), key=lambda i: plans[i].start_at_s):
        delay = started + plans[index].start_at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await gate.acquire()
        task = loop.create_task(one(index, plans[index]))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.gather(*running)
    return results


@dataclass
class LoadSummary:
    sent: int = 0
    cancelled: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)


def summarize(outcomes: list[RequestOutcome]) -> LoadSummary:
    summary = LoadSummary(sent=len(outcomes))
    for outcome in outcomes:
        summary.cancelled += outcome.cancelled_at_ns is not None
        summary.completed += outcome.completed
        if outcome.error:
            summary.errors.append(f"{outcome.plan.request_id}: {outcome.error}")
    return summary
