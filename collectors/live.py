"""The daemon's end of live notices: a UDP socket read by a thread into a bounded queue.

The wire format is written by ``auditor.live`` (the sender servers import); garbage datagrams are
counted and dropped, never raised.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Any

from auditor.model import LiveEvent
from auditor.semconv import MAX_DATAGRAM, sender_address


def parse_datagram(data: bytes, sender: str | None = None) -> LiveEvent | None:
    """A datagram as a LiveEvent, or None when it is not one (garbage is dropped, never raised).
    ``sender``: the container address it came from (``sender_address``), None for the loopback."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("v") != 1 or doc.get("ev") not in ("start", "end"):
            return None
        trace_id, span_id = str(doc["trace"]), str(doc["span"])
        int(trace_id, 16), int(span_id, 16)
        if len(trace_id) != 32 or len(span_id) != 16:
            return None

        def opt_int(value: Any) -> int | None:
            return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

        peer = doc.get("peer")
        return LiveEvent(
            event=doc["ev"], trace_id=trace_id.lower(), span_id=span_id.lower(),
            name=str(doc.get("name", ""))[:255], kind=str(doc.get("kind", ""))[:16],
            ts_ns=int(doc["ts"]), peer_addr=str(peer)[:64] if peer else None,
            peer_port=opt_int(doc.get("peer_port")), server_port=opt_int(doc.get("port")),
            pid=opt_int(doc.get("pid")), service=str(doc.get("service", ""))[:255],
            engine=bool(doc.get("engine")),
            finish=str(finish)[:32] if isinstance(finish := doc.get("finish"), str) and finish else None,
            sender=sender,
        )
    except (ValueError, KeyError, TypeError):
        return None


class LiveReceiver:
    """The daemon's end: a UDP socket read by a thread into a bounded queue.

    The thread sleeps in a blocking read until a datagram comes (a read with a timeout woke it five
    times a second for nothing), then takes every datagram waiting without blocking, and waits
    ``gather_s`` before reading again unless that batch was large: at a few hundred notices a
    second one wake-up takes a batch of them instead of each its own (inside the daemon a wake-up
    costs more than the notice it reads). Notices wait at most ``gather_s`` longer; the socket's
    buffer holds hundreds (``SO_RCVBUF`` is capped by net.core.rmem_max). ``stop`` shuts the
    socket, which ends the read at once. Each notice keeps the address it came from where that is
    a container's (``LiveEvent.sender``), as the OTLP receivers keep it on spans: on a port
    several containers serve, which engine's request it tells."""

    GATHER_S = 0.05
    BATCH_FULL = 256  # a batch this large reads again at once: the buffer must not fill

    def __init__(self, host: str, port: int, *, max_queue: int = 100_000, gather_s: float = GATHER_S) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        self.max_queue = max_queue
        self.gather_s = gather_s
        self._events: list[LiveEvent] = []  # taken, not yet drained: swapped whole by drain()
        self._lock = threading.Lock()
        self.received = 0
        self.rejected = 0
        self.dropped = 0
        self.wakeups = 0  # batches read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        sock, size = self._sock, MAX_DATAGRAM + 1
        while not self._stop.is_set():
            try:
                batch = [sock.recvfrom(size)]
            except OSError:
                if self._stop.is_set():
                    return
                continue
            try:
                while len(batch) < self.BATCH_FULL:
                    batch.append(sock.recvfrom(size, socket.MSG_DONTWAIT))
            except OSError:  # nothing more waiting (EAGAIN), or the socket was shut
                pass
            if self._stop.is_set():  # the shut socket's empty read
                return
            self._take(batch)
            if len(batch) < self.BATCH_FULL:
                self._stop.wait(self.gather_s)

    def _take(self, batch: list[tuple[bytes, Any]]) -> None:
        self.wakeups += 1
        events = []
        for data, peer in batch:
            event = parse_datagram(data, sender_address(peer))
            if event is None:
                self.rejected += 1
            else:
                events.append(event)
        self.received += len(events)
        with self._lock:
            room = self.max_queue - len(self._events)
            if len(events) > room:
                self.dropped += len(events) - max(room, 0)
                events = events[:max(room, 0)]
            self._events.extend(events)

    def drain(self) -> list[LiveEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def stop(self) -> None:
        self._stop.set()
        # Linux shuts even an unconnected UDP socket for reading, waking its reader, though it
        # answers ENOTCONN.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._sock.close()
