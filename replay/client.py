"""A load client that cancels requests the way users and proxies do.

Cancellation follows AIPerf's semantics: a chosen fraction of requests is cancelled; the timer
starts when the request has been fully written (T2), so a delay of 0 means "send everything, then
leave at once", and the same delay hits the same point of a request's life whatever the load. A
cancelled request closes with FIN (a browser tab, AIPerf) or RST (a proxy timeout). Every request
carries ``X-Request-Id`` and a W3C ``traceparent`` so the auditor's verdicts join to it exactly.

Raw asyncio streams, not an HTTP library: the point is control over when and how the socket ends.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field


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


def _request_bytes(plan: RequestPlan, host: str) -> bytes:
    data = json.dumps(plan.body).encode()
    parent_span = secrets.token_hex(8)
    head = (f"POST {plan.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nX-Request-Id: {plan.request_id}\r\n"
            f"traceparent: 00-{plan.trace_id}-{parent_span}-01\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


def _abort(writer: asyncio.StreamWriter, close_with: str) -> None:
    sock = writer.get_extra_info("socket")
    if close_with == "rst" and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        if sock is not None:
            sock.shutdown(socket.SHUT_WR)  # FIN now, even with unread response bytes
        writer.close()


async def _run_one(host: str, port: int, plan: RequestPlan) -> RequestOutcome:
    outcome = RequestOutcome(plan)
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        outcome.error = f"connect: {exc}"
        return outcome
    try:
        writer.write(_request_bytes(plan, f"{host}:{port}"))
        await writer.drain()
        outcome.sent_at_ns = time.time_ns()
        read = asyncio.ensure_future(_read_all(reader, outcome))
        if plan.cancel_after_s is None:
            await read
        else:
            done, _ = await asyncio.wait({read}, timeout=plan.cancel_after_s)
            if not done:  # still waiting for the response when the timer fired: cancel
                outcome.cancelled_at_ns = time.time_ns()
                read.cancel()
                _abort(writer, plan.close_with)
                return outcome
        outcome.completed = outcome.error is None
    except (OSError, asyncio.IncompleteReadError) as exc:
        outcome.error = str(exc)
    writer.close()
    return outcome


async def _read_all(reader: asyncio.StreamReader, outcome: RequestOutcome) -> None:
    status_line = await reader.readline()
    parts = status_line.split()
    outcome.status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    while chunk := await reader.read(65536):
        outcome.bytes_read += len(chunk)


async def run_load(host: str, port: int, plans: list[RequestPlan], *, concurrency: int,
                   on_done: Callable[[RequestOutcome], None] | None = None) -> list[RequestOutcome]:
    """Send every plan with at most ``concurrency`` in flight, none before its ``start_at_s``;
    results in plan order. Plans start in ``start_at_s`` order, and only the requests in flight
    exist as tasks, so an hour of captured traffic costs the memory of ``concurrency`` requests."""
    gate = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: list[RequestOutcome] = [RequestOutcome(plan) for plan in plans]
    running: set[asyncio.Task[None]] = set()

    async def one(index: int, plan: RequestPlan) -> None:
        try:
            results[index] = await _run_one(host, port, plan)
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
