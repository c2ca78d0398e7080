"""What running as a service needs, apart from what the daemon does: sd_notify without
libsystemd, listeners that fail in one line, and shutdown steps that never stop the shutdown."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from auditor.errors import ConfigError

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's <malloc.h>
MALLOC_ARENAS = 2


def limit_malloc_arenas(count: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for the rest of the process (mallopt M_ARENA_MAX), unless
    MALLOC_ARENA_MAX already set it. Call before the daemon starts its threads.

    glibc gives each new thread an arena of its own, up to eight per core, and each arena keeps the
    memory its thread freed. Python's own allocator serves small objects under the GIL, so only
    the larger blocks (span batches, the receivers' buffers, SQLite's pages) land there, and two
    arenas are enough for them. On a 16-core GPU host the daemon under load held up to 14 MiB less
    with two (one run each, docs/footprint.md). Returns whether the cap was set: not on a libc without mallopt."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_ARENA_MAX, count))


@contextlib.contextmanager
def listening(key: str, address: str) -> Iterator[None]:
    """A listener that cannot bind is a configuration problem, said in one line, not a traceback."""
    try:
        yield
    except OSError as exc:
        port = address.rsplit(":", 1)[-1]
        raise ConfigError(f"cannot listen on {key} {address}: {exc.strerror or exc}; find what holds it with "
                          f"`ss -ltnup 'sport = :{port}'`, or set {key} to another address ('' turns it off)") from exc


def notify_systemd(message: str) -> bool:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET, if systemd gave one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as exc:
        log.warning("could not notify systemd (%s): %s", message.split("=")[0], exc)
        return False


def quietly(action: Any) -> None:
    try:
        action()
    except Exception:
        log.exception("error while stopping %s", getattr(action, "__qualname__", action))
