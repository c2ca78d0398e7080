"""The daemon's end of live notices: a UDP socket read by a thread into a bounded queue.

The wire format is written by ``auditor.live`` (the sender servers import); garbage datagrams are
counted and dropped, never raised.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
from typing import Any

from auditor.live import MAX_DATAGRAM
from auditor.model import LiveEvent


def parse_datagram(data: bytes) -> LiveEvent | None:
    """A datagram as a LiveEvent, or None when it is not one (garbage is dropped, never raised)."""
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
        )
    except (ValueError, KeyError, TypeError):
        return None


class LiveReceiver:
    """The daemon's end: a UDP socket read by a thread into a bounded queue. The thread sleeps in
    its read until a datagram comes (a read with a timeout woke it five times a second for
    nothing, and a wake-up costs CPU); ``stop`` shuts the socket, which ends the read at once."""

    def __init__(self, host: str, port: int, *, max_queue: int = 100_000) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        self.events: queue.Queue[LiveEvent] = queue.Queue(maxsize=max_queue)
        self.received = 0
        self.rejected = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM + 1)
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if self._stop.is_set():  # the shut socket's empty read
                return
            event = parse_datagram(data)
            if event is None:
                self.rejected += 1
                continue
            self.received += 1
            try:
                self.events.put_nowait(event)
            except queue.Full:
                self.dropped += 1

    def drain(self) -> list[LiveEvent]:
        events = []
        while True:
            try:
                events.append(self.events.get_nowait())
            except queue.Empty:
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
