"""The child that compiles and attaches the probe, hands its file descriptors over, and exits.

bcc compiles with LLVM inside the process that imports it: about 150 MiB mapped and as much heap
that the daemon would carry for its whole life to use once. So the daemon starts this module
(``probes.handoff``), which imports bcc, compiles and attaches ``disconnect.bpf.c`` exactly as
given, and sends back over its Unix socket (standard input, SOCK_SEQPACKET) one message: a JSON
answer plus, with SCM_RIGHTS, the descriptors that keep the program alive and usable:

- the perf-event descriptor of each attached tracepoint (a tracepoint program stays attached
  while any descriptor refers to its perf event),
- the program descriptor behind each tracepoint: its fdinfo carries the run time and count the
  kernel keeps while ``kernel.bpf_stats_enabled`` is 1 (the probe's own cost, which is charged to
  whichever process hit the tracepoint, not to the daemon),
- the ``events`` ring buffer, ``watched_ports``, ``lost_events``, ``server_pids``, ``clients``,
  ``client_counts`` and ``client_slots`` maps.

Then it leaves with ``os._exit``: bcc's exit handler would otherwise detach the tracepoints
(``PERF_EVENT_IOC_DISABLE`` acts on the shared perf event, not only on this process's copy).
When loading fails it answers ``{"ok": false, "reason": ...}`` with bcc's one-line reason, exits
normally so that whatever was attached is detached, and the compiler's output stays on stderr.

Request: ``{"text": program text, "cflags": [...]}``. Answer: see ``probes.handoff``.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from typing import Any

MAX_REQUEST_BYTES = 1 << 20
MAP_NAMES = ("events", "watched_ports", "lost_events", "server_pids", "clients", "client_counts", "client_slots")


def tracepoint_function(tracepoint: bytes) -> bytes:
    """bcc's name for the function of ``TRACEPOINT_PROBE(category, event)``, by ``category:event``."""
    return b"tracepoint__" + tracepoint.replace(b":", b"__")


class LoadFailed(Exception):
    """Loading failed; the message is the one line the daemon shows."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def parse_request(data: bytes) -> tuple[str, list[str]]:
    try:
        request = json.loads(data)
    except ValueError as exc:
        raise LoadFailed(f"the request is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise LoadFailed("the request is not a JSON object")
    text, cflags = request.get("text"), request.get("cflags", [])
    if not isinstance(text, str) or not text:
        raise LoadFailed("the request has no program text")
    if not isinstance(cflags, list) or not all(isinstance(flag, str) for flag in cflags):
        raise LoadFailed("the request's cflags are not a list of strings")
    return text, cflags


def load(text: str, cflags: list[str]) -> tuple[dict[str, Any], list[int], Any]:
    """Compile and attach: the answer, the descriptors it numbers, and the bcc object that holds
    them open (until this process exits)."""
    try:
        from bcc import BPF
    except ImportError as exc:
        raise LoadFailed(f"bcc is not importable ({first_line(exc)})") from None
    from probes.decode import struct_format

    try:  # TRACEPOINT_PROBE functions are attached by the constructor
        bpf = BPF(text=text.encode(), cflags=cflags)
    except Exception as exc:  # bcc raises bare Exception for compile, load and attach failures
        raise LoadFailed(f"the BPF program failed to load ({first_line(exc)})") from None
    fds: list[int] = []
    maps: dict[str, int] = {}
    try:
        for name in MAP_NAMES:
            try:
                table = bpf[name.encode()]
            except KeyError:  # bcc's answer to a name the program does not define
                raise LoadFailed(f"the program lacks what the probe reads (no {name} map)") from None
            maps[name] = len(fds)
            fds.append(int(table.map_fd))
        events = bpf[b"events"]
        record = struct_format(events.event(ctypes.create_string_buffer(4096)).__class__)
    except LoadFailed:
        raise
    except Exception as exc:  # a map of another kind, or a layout bcc cannot give
        raise LoadFailed(f"the program lacks what the probe reads ({first_line(exc)})") from None
    attached: dict[str, int] = {}
    programs: dict[str, int] = {}
    for tracepoint, fd in bpf.tracepoint_fds.items():
        attached[tracepoint.decode()] = len(fds)
        fds.append(int(fd))
        function = bpf.funcs.get(tracepoint_function(tracepoint))
        if function is None:
            raise LoadFailed(f"no TRACEPOINT_PROBE function runs on {tracepoint.decode()}")
        programs[tracepoint.decode()] = len(fds)
        fds.append(int(function.fd))
    return ({"ok": True, "maps": maps, "attached": attached, "programs": programs,
             "record_format": record.format}, fds, bpf)


def answer(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    payload = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [payload], fds)
    else:
        sock.send(payload)


def main() -> int:
    sock = socket.socket(fileno=sys.stdin.fileno())
    try:
        message, fds, _bpf = load(*parse_request(sock.recv(MAX_REQUEST_BYTES)))
    except LoadFailed as exc:
        answer(sock, {"ok": False, "reason": str(exc)}, [])
        return 1  # a normal exit: bcc detaches whatever it had attached
    answer(sock, message, fds)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not through bcc's atexit cleanup: the daemon now owns the attachments


if __name__ == "__main__":
    sys.exit(main())
