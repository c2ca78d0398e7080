"""The stored layout of kernel events (auditor.store.eventblocks): round trips and garbage."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import pytest

from auditor.kernelrecord import RECORD, departures
from auditor.model import ConnEvent, ConnEventKind, EventRun
from auditor.store import eventblocks
from auditor.store.eventblocks import BlockError, block_of, block_read, event_id, pack, unpack


def events() -> list[ConnEvent]:
    return [
        ConnEvent(1_795_000_000_000_000_000, ConnEventKind.PEER_FIN, 4, "127.0.0.1", 40000, "127.0.0.2", 8000,
                  0x7FFF_8881_05BA_5340, "h", "bpf", None),
        ConnEvent(1_795_000_000_000_000_001, ConnEventKind.PEER_RST, 6, "2001:db8::1", 65535, "::1", 1,
                  None, "h", "bpf", 1_794_999_999_000_000_000),
        ConnEvent(1_795_000_000_000_000_002, ConnEventKind.LOCAL_FIN, 4, "10.0.0.1", 0, "10.0.0.2", 8000, 0, "h",
                  "bpf", 0),
        ConnEvent(5, ConnEventKind.CLOSED, 6, "fe80::1%eth0", 1, "::", 2, -1, "h", "bpf", -5),
    ]


def test_every_field_comes_back() -> None:
    assert unpack(pack(events()), 4, host="h", source="bpf") == events()
    assert unpack(pack([]), 0, host="h", source="bpf") == []


def test_host_and_source_are_the_rows() -> None:
    back = unpack(pack(events()), 4, host="other", source="procfs")
    assert {(event.host, event.source) for event in back} == {("other", "procfs")}


def test_rows_group_by_host_and_source_in_first_seen_order_and_split_at_the_limit() -> None:
    mixed = [events()[0], events()[1]._replace(host="g"), events()[2], events()[3]._replace(source="procfs")]
    rows = eventblocks.block_rows(mixed)
    assert [(row["host"], row["source"], row["count"]) for row in rows] == [("h", "bpf", 2), ("g", "bpf", 1),
                                                                            ("h", "procfs", 1)]
    assert (rows[0]["first_ts_ns"], rows[0]["last_ts_ns"]) == (mixed[0].ts_ns, mixed[2].ts_ns)
    many = eventblocks.block_rows([events()[0]] * (eventblocks.MAX_BLOCK_EVENTS + 2))
    assert [row["count"] for row in many] == [eventblocks.MAX_BLOCK_EVENTS, 2]


@pytest.mark.parametrize(("change", "message"), [
    ({"kind": "gone"}, "no stored code for the event kind"),
    ({"client_addr": "1.2.3.4\n5"}, "address holds a line break"),
    ({"client_port": 70000}, "does not fit the stored columns"),
    ({"ts_ns": 2.5}, "does not fit the stored columns"),
    ({"cookie": 1 << 63}, "does not fit the stored columns"),
    ({"family": 300}, "does not fit the stored columns"),
    ({"cookie": -(1 << 63)}, "the stored mark of no value"),
])
def test_an_event_the_format_cannot_hold_is_refused_by_name(change: dict[str, object], message: str) -> None:
    bad = events()[0]._replace(**change)
    with pytest.raises(ValueError, match=message):
        pack([events()[1], bad])
    assert not eventblocks.storable(bad) and eventblocks.storable(events()[1])


def test_a_damaged_body_fails_its_checksum() -> None:
    body = pack(events())
    for damaged in (body[:-1], body[:40], body + b"x", body[:5] + bytes([body[5] ^ 1]) + body[6:], b"abc"):
        with pytest.raises(BlockError, match="checksum does not match"):
            unpack(damaged, 4, host="h", source="bpf")


def _resealed(change: Callable[[bytes], bytes]) -> bytes:
    """The body with its checksum taken off, changed, and sealed again: a checksum is no
    excuse for the layout's own checks."""
    return eventblocks.seal(change(pack(events())[:-4]))


@pytest.mark.parametrize(("change", "count", "message"), [
    (lambda b: b[:40], 4, "too few for 4 events"),
    (lambda b: b + b"\n::1", 4, "9 addresses for 4 events"),
    (lambda b: b, 5, "."),  # a wrong count shifts every column: whichever check sees it first
    (lambda b: b, 3, "."),
    (lambda b: b, -1, "cannot hold -1 events"),
    (lambda b: b[:4 * 28] + b"\x09" + b[4 * 28 + 1:], 4, "no event kind has the code 9"),
    (lambda b: b[:4 * 29] + b"\x05" + b[4 * 29 + 1:], 4, "neither 4 nor 6"),
    (lambda b: b[:4 * 30] + b"\xff" + b[4 * 30 + 1:], 4, "not UTF-8"),
])
def test_a_body_that_does_not_hold_its_events_says_why(change: Callable[[bytes], bytes], count: int,
                                                       message: str) -> None:
    with pytest.raises(BlockError, match=message):
        unpack(_resealed(change), count, host="h", source="bpf")
    with pytest.raises(BlockError, match="an empty block has a 5-byte body"):
        unpack(b"abcde", 0, host="h", source="bpf")


def test_another_format_is_refused_by_number() -> None:
    with pytest.raises(BlockError, match="block 7 has format 3; this auditor reads formats 1 and 2"):
        list(eventblocks.events_of(7, 3, 4, pack(events()), host="h", source="bpf"))


def test_event_ids_order_events_as_stored_and_positions_name_whole_blocks() -> None:
    stored = list(eventblocks.events_of(3, 1, 4, pack(events()), host="h", source="bpf"))
    ids = [number for number, _ in stored]
    assert ids == sorted(ids) and ids[0] == event_id(3, 0) and ids[-1] < block_read(3) < event_id(4, 0)
    assert {block_of(number) for number in ids} == {3} and block_of(block_read(3)) == 3
    assert event_id(4, 0) - 1 == block_read(3)  # "before the first event of 4" is "3 read whole"


# -- format 2: the probe's ring buffer records, kept as they were ---------------------------

STRIDE = 64
OFFSET = 1_700_000_000_000_000_000  # wall minus monotonic
SKADDR = 0xFFFF_8881_05BA_5340


def record(ts: int, kind: int, client_port: int, *, family: int = 2, server_port: int = 8000) -> bytes:
    """One record as the kernel leaves it in the ring: header, ``struct event``, padding."""
    if family == 2:
        client, server = bytes([10, 0, 0, 1]).ljust(16, b"\0"), bytes([10, 0, 0, 2]).ljust(16, b"\0")
    else:
        client, server = socket.inet_pton(socket.AF_INET6, "2001:db8::1"), socket.inet_pton(socket.AF_INET6, "::1")
    body = RECORD.pack(ts, SKADDR + client_port, server, client, server_port, client_port, family, kind, 1)
    return struct.pack("<II", RECORD.size, 0) + body.ljust(STRIDE - 8, b"\0")


def run(*records: bytes, host: str = "h") -> EventRun:
    times = [struct.unpack_from("<Q", r, 8)[0] + OFFSET for r in records]
    return EventRun(b"".join(records), len(records), STRIDE, OFFSET, min(times), max(times), host, "bpf")


def stored(block_id: int, row: dict[str, object]) -> list[tuple[int, ConnEvent]]:
    return list(eventblocks.events_of(block_id, row["format"], row["count"], row["body"],  # type: ignore[arg-type]
                                      host=row["host"], source=row["source"]))  # type: ignore[arg-type]


def test_ring_records_are_kept_as_they_were_and_decoded_when_read() -> None:
    raw = run(record(5, 1, 40000), record(7, 4, 40000), record(6, 2, 40001, family=10, server_port=9000))
    [row] = eventblocks.run_rows([raw, raw._replace(records=b"", record_count=0)])
    assert (row["format"], row["count"], row["first_ts_ns"], row["last_ts_ns"]) == (2, 3, OFFSET + 5, OFFSET + 7)
    back = stored(9, row)
    assert [number for number, _ in back] == [event_id(9, i) for i in range(3)]
    cookie = (SKADDR + 40000) & ((1 << 63) - 1)
    assert back[0][1] == ConnEvent(OFFSET + 5, ConnEventKind.PEER_FIN, 4, "10.0.0.1", 40000, "10.0.0.2", 8000,
                                   cookie, "h", "bpf", None)
    assert back[2][1][1:7] == (ConnEventKind.PEER_RST, 6, "2001:db8::1", 40001, "::1", 9000)


def test_a_ring_record_that_does_not_decode_is_left_out_and_the_others_keep_their_ids(
        caplog: pytest.LogCaptureFixture) -> None:
    [row] = eventblocks.run_rows([run(record(5, 1, 40000), record(6, 9, 40001), record(7, 4, 40002))])
    with caplog.at_level("WARNING"):
        back = stored(2, row)
    assert [(number, event.client_port) for number, event in back] == [(event_id(2, 0), 40000),
                                                                       (event_id(2, 2), 40002)]
    assert "left out 1 kernel records of a stored block that do not decode" in caplog.text


@pytest.mark.parametrize(("change", "count", "message"), [
    (lambda b: b[:-1], 2, "checksum does not match"),
    (lambda b: eventblocks.seal(b[:-4][:5]), 2, "too few for a header"),
    (lambda b: eventblocks.seal(struct.pack("<qH", OFFSET, 40) + b[10:-4]), 2, "40 bytes apart cannot hold"),
    (lambda b: eventblocks.seal(struct.pack("<qH", OFFSET, 72) + b[10:-4]), 2, "are not 2 records of 72"),
    (lambda b: b, 3, "are not 3 records of 64"),
    (lambda b: b, 70000, "cannot hold 70000 events"),
])
def test_a_ring_body_that_does_not_hold_its_records_says_why(change: Callable[[bytes], bytes], count: int,
                                                             message: str) -> None:
    [row] = eventblocks.run_rows([run(record(5, 1, 40000), record(7, 4, 40000))])
    with pytest.raises(BlockError, match=f"block 4: .*{message}"):
        list(eventblocks.events_of(4, 2, count, change(row["body"]), host="h", source="bpf"))


def test_departures_are_read_from_the_records_without_decoding_them() -> None:
    records = b"".join([record(1, 1, 40000), record(2, 4, 40000), record(3, 2, 40001, server_port=9000),
                        record(4, 3, 40002, server_port=7000), record(5, 1, 40003)])
    assert departures(records, STRIDE) == (2, 1, {8000, 9000})
    assert departures(record(1, 4, 1), STRIDE) == (0, 0, set())
