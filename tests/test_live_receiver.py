"""The daemon's live-notice receiver on a real UDP socket: notices are queued, garbage is counted,
an idle receiver sleeps in its read (no wake-ups), a busy one reads in batches, and stop ends
either wait at once."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from collectors.live import LiveReceiver
from tests.e2e import wait_for


def notice(ev: str = "start") -> bytes:
    return json.dumps({"v": 1, "ev": ev, "trace": "ab" * 16, "span": "cd" * 8, "name": "POST /v1/completions",
                       "kind": "server", "ts": time.time_ns(), "peer": "127.0.0.1", "peer_port": 40000,
                       "port": 8000, "pid": 4242, "service": "engine", "engine": False}).encode()


def wakeups(thread_id: int) -> int:
    status = Path(f"/proc/self/task/{thread_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_notices_are_queued_garbage_is_counted_and_an_idle_receiver_sleeps_until_stopped() -> None:
    receiver = LiveReceiver("127.0.0.1", 0)
    receiver.start()
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for data in (notice("start"), b"\xff not json", b"", notice("end")):
            sender.sendto(data, ("127.0.0.1", receiver.port))
        assert wait_for(lambda: receiver.received == 2 and receiver.rejected == 2, 5, 0.01)
        drained = receiver.drain()
        assert [event.event for event in drained] == ["start", "end"]
        assert [event.sender for event in drained] == [None, None]  # the loopback is no container's

        thread_id = receiver._thread.native_id
        assert thread_id is not None
        before = wakeups(thread_id)
        time.sleep(1.0)
        # A read with a timeout woke the thread five times a second with nothing to read.
        assert wakeups(thread_id) - before <= 1

        started = time.monotonic()
        receiver.stop()
        assert not receiver._thread.is_alive()
        assert time.monotonic() - started < 1.0
    finally:
        sender.close()
        receiver.stop()


def test_a_burst_is_read_in_batches_and_nothing_is_lost() -> None:
    """Notices sent faster than the gathering wait are taken many to a wake-up, all of them, in
    the order sent; a full queue counts what it drops instead of growing."""
    receiver = LiveReceiver("127.0.0.1", 0, max_queue=1_500)
    receiver.start()
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for index in range(1_000):
            sender.sendto(notice("start" if index % 2 == 0 else "end"), ("127.0.0.1", receiver.port))
            if index % 100 == 99:
                time.sleep(0.01)  # paced a little, as a server sends: the buffer never fills
        assert wait_for(lambda: receiver.received == 1_000, 5, 0.01), receiver.received
        events = receiver.drain()
        assert [event.event for event in events] == ["start", "end"] * 500
        assert receiver.wakeups < 100, receiver.wakeups  # about one a gathering wait, not one a notice

        for _ in range(2_000):  # undrained: the queue holds 1,500 and counts the rest dropped
            sender.sendto(notice(), ("127.0.0.1", receiver.port))
        assert wait_for(lambda: receiver.received == 3_000, 5, 0.01), receiver.received
        assert len(receiver.drain()) == 1_500 and receiver.dropped == 500
    finally:
        sender.close()
        receiver.stop()


def test_stop_ends_the_gathering_wait_at_once() -> None:
    receiver = LiveReceiver("127.0.0.1", 0, gather_s=30.0)
    receiver.start()
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sender.sendto(notice(), ("127.0.0.1", receiver.port))
        assert wait_for(lambda: receiver.received == 1, 5, 0.01)
        started = time.monotonic()
        receiver.stop()
        assert not receiver._thread.is_alive() and time.monotonic() - started < 1.0
    finally:
        sender.close()
        receiver.stop()


def test_an_engine_end_carries_its_finish_as_told_and_nothing_else() -> None:
    """LiveReporter.work_ended's finish reason round-trips; a finish of the wrong type, or none,
    is untold (None), never a made-up one; a long one is cut, not refused."""
    from auditor.live import LiveReporter
    from collectors.live import parse_datagram

    receiver = LiveReceiver("127.0.0.1", 0)
    receiver.start()
    reporter = LiveReporter(("127.0.0.1", receiver.port), service="engine")
    try:
        reporter.work_ended("ab" * 16, "cd" * 8, finish_reason="length")
        reporter.work_ended("ab" * 16, "cd" * 8)
        assert wait_for(lambda: receiver.received == 2, 5, 0.01)
        told, untold = receiver.drain()
        assert (told.engine, told.event, told.finish) == (True, "end", "length")
        assert (untold.engine, untold.finish) == (True, None)
    finally:
        reporter.close()
        receiver.stop()
    base = json.loads(notice("end"))
    for finish, read in ((123, None), (True, None), ("", None), (None, None), ("x" * 100, "x" * 32), ("stop", "stop")):
        event = parse_datagram(json.dumps({**base, "engine": True, "finish": finish}).encode())
        assert event is not None and event.finish == read, (finish, event)


def test_a_notice_keeps_the_container_address_it_came_from() -> None:
    """As the OTLP receivers keep it on spans (``auditor.semconv.sender_address``): where several
    containers serve one port, which engine's request a notice tells. An IPv4-mapped peer (a
    dual-stack socket's) reads as IPv4; garbage from a container is still garbage."""
    receiver = LiveReceiver("127.0.0.1", 0)
    try:
        receiver._take([(notice(), ("10.244.1.5", 39000)), (notice("end"), ("::ffff:10.244.1.6", 39000, 0, 0)),
                        (b"garbage", ("10.244.1.7", 1))])
        assert [event.sender for event in receiver.drain()] == ["10.244.1.5", "10.244.1.6"]
        assert receiver.rejected == 1
    finally:
        receiver.stop()
