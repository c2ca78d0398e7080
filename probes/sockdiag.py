"""TCP sockets on watched local ports, asked of the kernel over netlink sock_diag.

This is what ``ss`` does: a dump request with an inet_diag bytecode filter (``sport == p1 or
sport == p2 ...``) so the kernel walks its socket tables and sends back only the watched ports.
Parsing /proc/net/tcp instead means formatting and reading every socket on the host as text on
every poll (milliseconds a pass). The walk itself visits every bucket of the established hash
(262,144 on a small VM, about 1 ms here), and IPv4 and IPv6 share that table: the older
TCPDIAG_GETSOCK request dumps both families in one walk, so it is tried first; SOCK_DIAG_BY_FAMILY,
one walk per family, is what a kernel without it gets. Unprivileged: sock_diag lists the sockets of
this network namespace to any user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from auditor.model import ListedClient

log = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
TCPDIAG_GETSOCK, SOCK_DIAG_BY_FAMILY = 18, 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP, INET_DIAG_BC_S_EQ = 1, 11
TCP_TIME_WAIT, TCP_CLOSE, TCP_LISTEN = 6, 7, 10
# The states a dump asks for: every TCP state (1 ESTABLISHED .. 11 CLOSING, 12 NEW_SYN_RECV) but
# LISTEN, TIME_WAIT and CLOSE. The kernel skips the others before building a reply: a busy port
# keeps a minute of TIME_WAIT sockets, which were most of every reply. Whether a socket that left
# the dump went to TIME_WAIT or vanished (a reset) is asked of the one socket (``state_of``).
STATES = ((1 << 13) - 1) & ~(1 << TCP_LISTEN) & ~(1 << TCP_TIME_WAIT) & ~(1 << TCP_CLOSE) & ~1
ALL_STATES = 0xFFFFFFFF
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ENOENT = 2
# Decoded socket ids kept, then all dropped: a few hundred bytes each (bench/poller_cost.py says
# how many), so a port taking a connection a request (each id new) holds under 2 MiB of them; past
# as many connections open at once, the live ones are decoded again after each drop.
DECODED_CACHE_MAX = 4096
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBBI48x")  # struct inet_diag_req_v2, socket id left zero
_LOOKUP = struct.Struct("=BBBBI2s2s16s16sIII")  # struct inet_diag_req_v2 naming one socket
_COMPAT_REQUEST = struct.Struct("=BBBB48xII")  # struct inet_diag_req: both families in one walk
_BC_OP = struct.Struct("=BBH")  # struct inet_diag_bc_op
MSG_BYTES = 72  # struct inet_diag_msg
TCP_ESTABLISHED = 1
INET_DIAG_INFO = 2  # the reply attribute holding struct tcp_info; asked by bit (INET_DIAG_INFO - 1)
_RTATTR = struct.Struct("=HH")
TCPI_LAST_DATA_SENT, TCPI_LAST_DATA_RECV = 44, 52  # struct tcp_info: ms since we last sent data, and the peer (u32)
_QUEUES_AT = 56  # struct inet_diag_msg: bytes not read yet, and bytes sent or to send but not acknowledged
# A client kept alive between requests (``SockDiag.idle``): the server answered it, sending data at
# least IDLE_ANSWERED_MS after the client's last data came, sent nothing for IDLE_QUIET_MS since,
# and has nothing unread from it and nothing unacknowledged to it. An answer that streams is sent
# a step at a time, a few tens of ms apart; one that waits in the queue or in its prefill has sent
# at most its headers, within a moment of its request. Not told apart: a streamed answer that
# paused IDLE_QUIET_MS while its engine ran it, and an idle client whose answer took under
# IDLE_ANSWERED_MS (it stays counted as holding a request).
IDLE_ANSWERED_MS = 1000
IDLE_QUIET_MS = 2000
# struct tcp_info, u64 each: bytes of ours the peer acknowledged (a FIN counts one), data bytes
# sent (retransmissions included), of which retransmitted (Linux 4.19 on).
TCPI_BYTES_ACKED, TCPI_BYTES_SENT, TCPI_BYTES_RETRANS = 120, 200, 208

SocketKey = tuple[int, str, int, str, int]  # family (4 or 6), local addr, local port, peer addr, peer port
DiagEntry = tuple[SocketKey, int, int, int]  # (key, state, inode, the kernel's cookie of the socket)


def port_filter(ports: frozenset[int]) -> bytes:
    """inet_diag bytecode accepting a socket whose local port is one of ``ports``.

    Built like ss builds ``sport = :a or sport = :b``: each test falls through to the next on a
    match (then a JMP skips to the end: accepted) and jumps over that JMP on a miss. The last miss
    jumps past the end, which the kernel reads as rejected.
    """
    program = b""
    for port in sorted(ports):
        test = _BC_OP.pack(INET_DIAG_BC_S_EQ, 8, 12) + _BC_OP.pack(0, 0, port)
        program = test if not program else program + _BC_OP.pack(INET_DIAG_BC_JMP, 4, len(test) + 4) + test
    return program


def listening_inodes(ports: set[int]) -> dict[int, set[int]]:
    """Port -> inodes of the TCP sockets listening on it (IPv4 and IPv6), asked of the kernel: it
    walks only its listening hash, where /proc/net/tcp walks every
    connection bucket. Raises OSError when netlink is refused."""
    found: dict[int, set[int]] = {}
    diag = SockDiag()
    try:
        for (_family, _local, port, _peer, _peer_port), _state, inode, _cookie in diag.listening(frozenset(ports)):
            if inode:
                found.setdefault(port, set()).add(inode)
    finally:
        diag.close()
    return found


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    return socket.inet_ntop(socket.AF_INET6, raw)


class SockDiag:
    """One netlink socket, reused for every dump. Raises OSError when the kernel refuses."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        self._sock.bind((0, 0))
        self._seq = 0
        self._filters: dict[frozenset[int], bytes] = {}
        self._one_walk = True  # TCPDIAG_GETSOCK until the kernel refuses it
        # The socket id bytes of each reply entry -> its decoded key: a long-lived connection is
        # decoded once, not on every poll.
        self._decoded: dict[bytes, SocketKey] = {}
        # cookie -> (last_data_recv (ms), whether kept alive between requests: ``idle``), of the
        # latest walk that asked for tcp_info. By cookie, not inode: a connection not yet taken from
        # its listener's queue has inode 0.
        self._info: dict[int, tuple[int, bool]] = {}

    def close(self) -> None:
        self._sock.close()

    def sockets(self, ports: frozenset[int], info: bool = False) -> Iterator[DiagEntry]:
        """Every non-listening TCP socket (IPv4 and IPv6) whose local port is in ``ports``. With
        ``info``, each one's tcp_info is asked too: ``last_data_recv`` reads it after the walk."""
        return self._walk(ports, STATES, ~(1 << TCP_LISTEN), info)

    def last_data_recv(self, cookie: int) -> int | None:
        """How many milliseconds before the last walk asked with tcp_info (``sockets(info=True)``,
        ``established``) the socket of the kernel's ``cookie`` last received data from its peer;
        None when that walk did not list it."""
        found = self._info.get(cookie)
        return found[0] if found is not None else None

    def idle(self, cookie: int) -> bool:
        """Whether the last walk asked with tcp_info found the socket of the kernel's ``cookie`` a
        client kept alive between requests (IDLE_ANSWERED_MS): answered, quiet, nothing queued
        either way. False when it cannot tell."""
        found = self._info.get(cookie)
        return found is not None and found[1]

    def established(self, ports: frozenset[int]) -> dict[int, list[tuple[SocketKey, int, bool]]]:
        """The ESTABLISHED TCP sockets (IPv4 and IPv6) on the local ``ports``, each with how many
        milliseconds ago its peer last sent it data (``tcp_info``'s ``last_data_recv``: the
        kernel's jiffies, a few ms apart), and whether it is a client kept alive between requests
        (``idle``)."""
        found: dict[int, list[tuple[SocketKey, int, bool]]] = {port: [] for port in ports}
        state = 1 << TCP_ESTABLISHED
        for key, _state, _inode, cookie in list(self._walk(ports, state, state, info=True)):
            last_ms, idle = self._info.get(cookie, (0, False))
            found[key[2]].append((key, last_ms, idle))
        return found

    def _walk(self, ports: frozenset[int], asked: int, kept: int, info: bool) -> Iterator[DiagEntry]:
        """The sockets on the local ``ports`` in the ``asked`` states (the kernel's mask; ``kept``
        guards a kernel that ignored it), with their tcp_info where ``info``. One walk of the
        established hash for both families where the kernel takes the older request, else one a
        family."""
        if not ports:
            return
        attribute, ext = self._port_attribute(ports), (1 << (INET_DIAG_INFO - 1)) if info else 0
        if info:
            self._info.clear()
        if self._one_walk:
            try:
                # Collected first: a refusal arrives before any socket, and must not duplicate any.
                found = list(self._dump(TCPDIAG_GETSOCK, _COMPAT_REQUEST.pack(
                    socket.AF_INET, 0, 0, ext, asked, 0) + attribute, ports, states=kept, info=info))
            except OSError:
                self._one_walk = False
            else:
                yield from found
                return
        for family in (socket.AF_INET, socket.AF_INET6):
            body = _REQUEST.pack(family, socket.IPPROTO_TCP, ext, 0, asked) + attribute
            yield from self._dump(SOCK_DIAG_BY_FAMILY, body, ports, states=kept, info=info)

    def listening(self, ports: frozenset[int]) -> Iterator[DiagEntry]:
        """Every LISTEN TCP socket (IPv4 and IPv6) whose local port is in ``ports``: the kernel walks
        only its listening hash for these, not the established one."""
        if not ports:
            return
        attribute = self._port_attribute(ports)
        for family in (socket.AF_INET, socket.AF_INET6):
            body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN) + attribute
            yield from self._dump(SOCK_DIAG_BY_FAMILY, body, ports, states=1 << TCP_LISTEN)

    def _port_attribute(self, ports: frozenset[int]) -> bytes:
        bytecode = self._filters.get(ports)
        if bytecode is None:
            bytecode = self._filters[ports] = port_filter(ports)
        return struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode

    def state_of(self, key: SocketKey) -> int | None:
        """The TCP state of the one socket ``key`` names, whatever it is (TIME_WAIT included), or
        None when the kernel has no such socket: a hash lookup, not a walk."""
        found = self.lookup(key)
        return found[1] if found else None

    def still_listed(self, keys: Iterable[SocketKey]) -> list[DiagEntry]:
        """Those of ``keys`` a dump would list now, asked one by one: what a dump would return
        when no connection was accepted since the last one (see ``TcpAccepts``)."""
        found = (self.lookup(key) for key in keys)
        return [entry for entry in found if entry is not None and STATES & (1 << entry[1])]

    def idle_of(self, keys: Iterable[SocketKey]) -> set[SocketKey]:
        """Those of ``keys`` that are clients kept alive between requests (``idle``), each asked
        alone with its tcp_info: a hash lookup each (tens of microseconds), where a walk visits every
        bucket of the established hash. A socket that is gone is not idle."""
        self._info.clear()
        found = set()
        for key in keys:
            entry = self.lookup(key, info=True)
            if entry is not None and entry[1] == TCP_ESTABLISHED and self.idle(entry[3]):
                found.add(key)
        return found

    def lookup(self, key: SocketKey, info: bool = False) -> DiagEntry | None:
        """The one socket ``key`` names, in whatever state, or None when there is none; with
        ``info``, its tcp_info is asked too (``last_data_recv``, ``idle``)."""
        family = socket.AF_INET if key[0] == 4 else socket.AF_INET6
        local, peer = socket.inet_pton(family, key[1]), socket.inet_pton(family, key[3])
        ext = (1 << (INET_DIAG_INFO - 1)) if info else 0
        body = _LOOKUP.pack(family, socket.IPPROTO_TCP, ext, 0, ALL_STATES, key[2].to_bytes(2, "big"),
                            key[4].to_bytes(2, "big"), local, peer, 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
        try:
            found = list(self._dump(SOCK_DIAG_BY_FAMILY, body, frozenset({key[2]}), flags=NLM_F_REQUEST,
                                    info=info))
        except OSError as exc:
            if exc.errno == ENOENT:
                return None
            raise
        return found[0] if found else None

    def _dump(self, request: int, body: bytes, ports: frozenset[int],
              flags: int = NLM_F_REQUEST | NLM_F_DUMP, states: int = ~(1 << TCP_LISTEN),
              info: bool = False) -> Iterator[DiagEntry]:
        self._seq += 1
        self._sock.send(_HEADER.pack(_HEADER.size + len(body), request, flags, self._seq, 0) + body)
        single = not flags & NLM_F_DUMP  # one answer and no NLMSG_DONE
        while True:
            data = self._sock.recv(1 << 17)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _flags, seq, _pid = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    raise OSError(f"sock_diag sent a malformed message of {length} bytes")
                payload = offset + _HEADER.size
                offset += (length + 3) & ~3
                if seq != self._seq:
                    continue  # an answer to an earlier, abandoned request
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    errno = -struct.unpack_from("=i", data, payload)[0]
                    raise OSError(errno, f"sock_diag refused the dump: {os.strerror(errno)}")
                if kind != request or length - _HEADER.size < MSG_BYTES:
                    continue
                entry = self._entry(data, payload, ports, states)
                if entry is not None:
                    if info:
                        self._info[entry[3]] = _times(data, payload, offset)
                    yield entry
                if single:
                    return

    def _entry(self, data: bytes, payload: int, ports: frozenset[int], states: int) -> DiagEntry | None:
        """One struct inet_diag_msg: family, state, then the socket id (ports and addresses)."""
        state = data[payload + 1]
        key = _decoded_key(self._decoded, data, payload)
        if key[2] not in ports or not states & (1 << state):
            return None  # the kernel filtered already; this only guards a filter it ignored
        return key, state, struct.unpack_from("=I", data, payload + 68)[0], _cookie(data, payload)


def _decoded_key(decoded: dict[bytes, SocketKey], data: bytes, payload: int) -> SocketKey:
    """The socket id of the struct inet_diag_msg at ``payload``, decoded once per id (``decoded``)."""
    ident = data[payload:payload + 1] + data[payload + 4:payload + 40]
    key = decoded.get(ident)
    if key is None:
        key = _socket_key(data, payload)
        if len(decoded) >= DECODED_CACHE_MAX:
            decoded.clear()
        decoded[ident] = key
    return key


def _socket_key(data: bytes, payload: int) -> SocketKey:
    """The socket id of the struct inet_diag_msg at ``payload``: family, addresses and ports."""
    family = data[payload]
    local_port, remote_port = struct.unpack_from(">HH", data, payload + 4)
    return (4 if family == socket.AF_INET else 6, _address(family, data[payload + 8:payload + 24]),
            local_port, _address(family, data[payload + 24:payload + 40]), remote_port)


def _cookie(data: bytes, payload: int) -> int:
    """The kernel's cookie of the socket (``idiag_cookie``: two u32, low first): unique for as
    long as the host runs, where addresses and ports are reused."""
    low, high = struct.unpack_from("=II", data, payload + 44)
    return low | high << 32


def _tcp_info(data: bytes, start: int, end: int) -> tuple[int, int] | None:
    """Where the struct tcp_info of the INET_DIAG_INFO attribute among a reply entry's attributes
    (``data[start:end]``) begins, and its length; None when the kernel sent none."""
    while start + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, start)
        if length < _RTATTR.size or start + length > end:
            return None
        if kind == INET_DIAG_INFO:
            return start + _RTATTR.size, length - _RTATTR.size
        start += (length + 3) & ~3
    return None


def _last_data_recv(data: bytes, start: int, end: int) -> int | None:
    """``tcpi_last_data_recv`` of a reply entry's attributes (``data[start:end]``); None when the
    kernel sent no tcp_info."""
    info = _tcp_info(data, start, end)
    if info is None or info[1] < TCPI_LAST_DATA_RECV + 4:
        return None
    return int(struct.unpack_from("=I", data, info[0] + TCPI_LAST_DATA_RECV)[0])


def _times(data: bytes, payload: int, end: int) -> tuple[int, bool]:
    """(``tcpi_last_data_recv``, 0 without tcp_info; whether the socket is a client kept alive
    between requests, IDLE_ANSWERED_MS) of the reply entry at ``data[payload:end]``."""
    info = _tcp_info(data, payload + MSG_BYTES, end)
    if info is None or info[1] < TCPI_LAST_DATA_RECV + 4:
        return 0, False
    sent_ms, = struct.unpack_from("=I", data, info[0] + TCPI_LAST_DATA_SENT)
    received_ms, = struct.unpack_from("=I", data, info[0] + TCPI_LAST_DATA_RECV)
    unread, unacknowledged = struct.unpack_from("=II", data, payload + _QUEUES_AT)
    idle = (received_ms - sent_ms >= IDLE_ANSWERED_MS and sent_ms >= IDLE_QUIET_MS
            and not unread and not unacknowledged)
    return int(received_ms), idle


def _fin_acked(data: bytes, start: int, end: int) -> bool | None:
    """Whether the peer acknowledged our FIN (all data sent, and one byte more): the connection
    ended with FINs both ways, not a reset. None when the kernel's tcp_info is too old to tell."""
    info = _tcp_info(data, start, end)
    if info is None or info[1] < TCPI_BYTES_RETRANS + 8:
        return None
    acked, = struct.unpack_from("=Q", data, info[0] + TCPI_BYTES_ACKED)
    sent, retransmitted = struct.unpack_from("=QQ", data, info[0] + TCPI_BYTES_SENT)
    return bool(acked == sent - retransmitted + 1)


# The kernel's notice of a freed socket (sock_diag's destroy multicast groups, Linux 4.9 on):
# open to any user, one netlink message a socket, an inet_diag_msg as a dump's with tcp_info.
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP = 270, 1
SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY = 1, 3
SO_ATTACH_FILTER = 26
ENOBUFS = 105
# Asked of the kernel; a user gets at most net.core.rmem_max (208 KiB by default: about 200
# notices, the closes of 4,000 connections a second between two of the fallback's 20 Hz reads).
NOTICE_BUFFER_BYTES = 1 << 20
_FILTER_OP = struct.Struct("=HBBI")  # struct sock_filter (classic BPF)
_BPF_LD_H_ABS, _BPF_JEQ_K, _BPF_RET_K = 0x28, 0x15, 0x06
_SPORT_AT = _HEADER.size + 4  # idiag_sport of the message, big-endian as classic BPF loads it
MAX_FILTERED_PORTS = 255  # a jump's offset is one byte: more ports are filtered here, not in the kernel


def notice_filter(ports: Iterable[int]) -> bytes | None:
    """Classic BPF keeping the notices of sockets whose local port is one of ``ports`` (the kernel
    drops the others before they are queued: a host's other connections cost nothing); None where
    there are too many ports for one program."""
    ports = sorted(set(ports))
    if len(ports) > MAX_FILTERED_PORTS:
        return None
    program = [_FILTER_OP.pack(_BPF_LD_H_ABS, 0, 0, _SPORT_AT)]
    # Each test jumps to the last instruction (keep) on a match and falls through otherwise.
    program += [_FILTER_OP.pack(_BPF_JEQ_K, len(ports) - index, 0, port) for index, port in enumerate(ports)]
    program += [_FILTER_OP.pack(_BPF_RET_K, 0, 0, 0), _FILTER_OP.pack(_BPF_RET_K, 0, 0, 0xFFFFFFFF)]
    return b"".join(program)


@dataclass(frozen=True, slots=True)
class Freed:
    """A socket the kernel freed. It was freed after ``after_ns`` (when the read before began)
    and before ``by_ns`` (when the read that took it ended), both wall-clock; at that moment its
    peer had last sent data ``last_data_recv_ms`` before (tcp_info's, in the kernel's jiffies).
    ``fin_acked``: it ended with FINs both ways (False: a reset ended it; None: the kernel's
    tcp_info cannot tell)."""

    key: SocketKey
    cookie: int
    inode: int
    last_data_recv_ms: int
    fin_acked: bool | None
    after_ns: int
    by_ns: int


class DestroyNotices:
    """The kernel's notice of each TCP socket it frees whose local port is watched: what a poll of
    the socket tables cannot see, a connection that opened and closed between two polls.

    Read without waiting (``take``), at each poll: the notices of one read were sent after the read
    before began, which with tcp_info's time since the peer's last data bounds when that peer left.
    Raises OSError when the kernel refuses (no sock_diag, or a kernel before 4.9)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        try:
            self._sock.setblocking(False)
            self._sock.bind((0, 0))
            with contextlib.suppress(OSError):  # else the default: fewer notices between reads before one is lost
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, NOTICE_BUFFER_BYTES)
            self._ports: frozenset[int] = frozenset({0})
            self.set_ports(frozenset())  # nothing is queued before the ports are known
            for group in (SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY):
                self._sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
        except OSError:
            self._sock.close()
            raise
        self._read_began_ns = time.time_ns()
        self.overflows = 0  # reads that found notices dropped (the buffer was full): how many, unknown
        self.unreadable = 0  # notices too short to read, or without tcp_info: skipped

    def set_ports(self, ports: frozenset[int]) -> None:
        """Keep the notices of these local ports from now on (and no others)."""
        if ports == self._ports:
            return
        program = notice_filter(ports)
        if program is None:
            program = _FILTER_OP.pack(_BPF_RET_K, 0, 0, 0xFFFFFFFF)  # every notice; ``take`` keeps the ports'
        code = array("B", program)
        address, _ = code.buffer_info()
        # struct sock_fprog: the instruction count and a pointer to them, which the kernel copies.
        self._sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                              struct.pack("HP", len(program) // _FILTER_OP.size, address))
        self._ports = ports

    def take(self) -> list[Freed]:
        """The sockets on the ports freed since the last call."""
        began, found, ports = time.time_ns(), [], self._ports
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != ENOBUFS:
                    raise
                self.overflows += 1
                continue
            found += self._read(data, ports)
        after, self._read_began_ns = self._read_began_ns, began
        ended = time.time_ns()
        return [Freed(*read, after, ended) for read in found]

    def _read(self, data: bytes, ports: frozenset[int]) -> list[tuple[SocketKey, int, int, int, bool | None]]:
        found = []
        offset = 0
        while offset + _HEADER.size <= len(data):
            length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, offset)
            payload, end = offset + _HEADER.size, min(offset + length, len(data))
            if length < _HEADER.size:
                self.unreadable += 1
                break
            offset += (length + 3) & ~3
            if kind != SOCK_DIAG_BY_FAMILY or end - payload < MSG_BYTES:
                self.unreadable += 1
                continue
            key = _socket_key(data, payload)  # each socket is freed once: nothing to keep decoded
            if key[2] not in ports or not key[4]:
                continue  # another port (no filter), or a listener
            last_ms = _last_data_recv(data, payload + MSG_BYTES, end)
            if last_ms is None:
                self.unreadable += 1
                continue
            found.append((key, _cookie(data, payload), struct.unpack_from("=I", data, payload + 68)[0], last_ms,
                          _fin_acked(data, payload + MSG_BYTES, end)))
        return found

    def close(self) -> None:
        self._sock.close()


class ConnectedClients:
    """The clients connected to watched ports, for a daemon without the eBPF probe's table of
    them: one sock_diag walk of the established hash for all the ports asked (``SockDiag.
    established``, with tcp_info's last_data_recv), and this network namespace's count of accepted
    connections (``TcpAccepts``). The same two calls as ``probes.bpf.BpfConnEventSource``'s."""

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._diag: SockDiag | bool | None = None  # False: the kernel refused it
        self._accepts: TcpAccepts | bool | None = None

    def clients(self, ports: Iterable[int]) -> dict[int, tuple[ListedClient, ...]] | None:
        """Port -> (client address, client port, when data from it last came in, ns: tcp_info's
        last_data_recv, the kernel's receipt rather than the server's read, and the server
        socket's address); a client kept alive between requests (``SockDiag.idle``) is left out."""
        if self._diag is False:
            return None
        try:
            if not isinstance(self._diag, SockDiag):
                self._diag = SockDiag()
            found = self._diag.established(frozenset(ports))
        except OSError as exc:
            log.info("the clients connected to the watched ports cannot be listed (%s): the engines' gauges "
                     "are read against the requests' spans alone", exc)
            self._diag = False
            return None
        now = self._clock()
        return {port: tuple((peer, peer_port, now - last_ms * 1_000_000, local)
                            for (_family, local, _port, peer, peer_port), last_ms, idle in clients if not idle)
                for port, clients in found.items()}

    def accepted(self) -> int | None:
        """Connections this network namespace accepted so far (every port); None when unreadable."""
        if self._accepts is None:
            try:
                self._accepts = TcpAccepts()
            except OSError:
                self._accepts = False
        return self._accepts.read() if isinstance(self._accepts, TcpAccepts) else None

    def close(self) -> None:
        if isinstance(self._diag, SockDiag):
            self._diag.close()
        if isinstance(self._accepts, TcpAccepts):
            self._accepts.close()
        self._diag = self._accepts = None


class TcpAccepts:
    """How many TCP connections this network namespace's listeners have accepted (PassiveOpens of
    /proc/net/snmp): read in microseconds, where a dump walks the whole established hash. A watched
    socket is a server's end, made only by a passive open, so unchanged since a dump means none
    appeared since: the sockets a dump would list are the ones it listed, in whatever state they
    are now. Outgoing connections (ActiveOpens: an engine's calls out, an agent's pushes, a
    refused connect) do not move it, and cost no walk. None when the counter cannot be read."""

    def __init__(self, path: str = "/proc/net/snmp") -> None:
        self._fd: int | None = os.open(path, os.O_RDONLY)

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            data = os.pread(self._fd, 1 << 16, 0)
            names, values = (line.split()[1:] for line in data.splitlines() if line.startswith(b"Tcp:"))
            fields = dict(zip(names, values, strict=True))
            return int(fields[b"PassiveOpens"])
        except (OSError, ValueError, KeyError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def tcp_socket_counts(path: str = "/proc/net/sockstat") -> dict[str, int]:
    """This namespace's TCP sockets by the kernel's own count: inuse, orphan, tw (TIME_WAIT), alloc,
    mem. Empty when unreadable."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        if line.startswith("TCP:"):
            fields = line.split()[1:]
            try:
                return {name: int(value) for name, value in zip(fields[::2], fields[1::2], strict=True)}
            except ValueError:
                return {}
    return {}


def walk_cpu_us(repeats: int = 100) -> float:
    """CPU (user + system, this thread) of one dump for a port nobody uses: the kernel's walk of the
    whole established hash, every bucket and every socket of the namespace, TIME_WAIT included.
    The /proc fallback pays it on each poll that follows a newly accepted connection. Raises OSError
    when sock_diag is refused."""
    # The thread's CPU clock, not getrusage(RUSAGE_THREAD): that one reads the scheduler's total as
    # of its last tick or switch, so a few milliseconds of walks could read as none at all.
    diag, unused = SockDiag(), frozenset({1})
    try:
        list(diag.sockets(unused))
        before = time.thread_time_ns()
        for _ in range(repeats):
            list(diag.sockets(unused))
        spent_ns = time.thread_time_ns() - before
    finally:
        diag.close()
    return spent_ns / repeats / 1e3
