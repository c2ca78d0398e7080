"""TCP sockets on watched local ports, asked of the kernel over netlink sock_diag.

This is what ``ss`` does: a dump request with an inet_diag bytecode filter (``sport == p1 or
sport == p2 ...``) so the kernel walks its socket tables and sends back only the watched ports.
Parsing /proc/net/tcp instead means formatting and reading every socket on the host as text on
every poll (milliseconds a pass). The walk itself visits every bucket of the established hash
(262,144 on a small VM, about 0.2 ms), and IPv4 and IPv6 share that table: the older
TCPDIAG_GETSOCK request dumps both families in one walk, so it is tried first; SOCK_DIAG_BY_FAMILY,
one walk per family, is what a kernel without it gets. Unprivileged: sock_diag lists the sockets of
this network namespace to any user.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

NETLINK_SOCK_DIAG = 4
TCPDIAG_GETSOCK, SOCK_DIAG_BY_FAMILY = 18, 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP, INET_DIAG_BC_S_EQ = 1, 11
TCP_LISTEN = 10
# Every TCP state but LISTEN (1 ESTABLISHED .. 11 CLOSING, 12 NEW_SYN_RECV).
STATES = ((1 << 13) - 1) & ~(1 << TCP_LISTEN) & ~1
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBBI48x")  # struct inet_diag_req_v2, socket id left zero
_COMPAT_REQUEST = struct.Struct("=BBBB48xII")  # struct inet_diag_req: both families in one walk
_BC_OP = struct.Struct("=BBH")  # struct inet_diag_bc_op
MSG_BYTES = 72  # struct inet_diag_msg

DiagEntry = tuple[tuple[int, str, int, str, int], int, int]  # (key, state, inode)


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

    def close(self) -> None:
        self._sock.close()

    def sockets(self, ports: frozenset[int]) -> Iterator[DiagEntry]:
        """Every non-listening TCP socket (IPv4 and IPv6) whose local port is in ``ports``."""
        if not ports:
            return
        bytecode = self._filters.get(ports)
        if bytecode is None:
            bytecode = self._filters[ports] = port_filter(ports)
        attribute = struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
        if self._one_walk:
            try:
                # Collected first: a refusal arrives before any socket, and must not duplicate any.
                found = list(self._dump(TCPDIAG_GETSOCK, _COMPAT_REQUEST.pack(
                    socket.AF_INET, 0, 0, 0, STATES, 0) + attribute, ports))
            except OSError:
                self._one_walk = False
            else:
                yield from found
                return
        for family in (socket.AF_INET, socket.AF_INET6):
            body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, STATES) + attribute
            yield from self._dump(SOCK_DIAG_BY_FAMILY, body, ports)

    def _dump(self, request: int, body: bytes, ports: frozenset[int]) -> Iterator[DiagEntry]:
        self._seq += 1
        self._sock.send(_HEADER.pack(_HEADER.size + len(body), request,
                                     NLM_F_REQUEST | NLM_F_DUMP, self._seq, 0) + body)
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
                state = data[payload + 1]
                local_port, remote_port = struct.unpack_from(">HH", data, payload + 4)
                if local_port not in ports or state == TCP_LISTEN:
                    continue  # the kernel filtered already; this only guards a filter it ignored
                family = data[payload]
                local = _address(family, data[payload + 8:payload + 24])
                remote = _address(family, data[payload + 24:payload + 40])
                inode = struct.unpack_from("=I", data, payload + 68)[0]
                yield (4 if family == socket.AF_INET else 6, local, local_port, remote, remote_port), state, inode
