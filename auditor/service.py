"""What running as a service needs, apart from what the daemon does: sd_notify without
libsystemd, listeners that fail in one line, and shutdown steps that never stop the shutdown."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from auditor.errors import ConfigError

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's <malloc.h>
MALLOC_ARENAS = 2
HEAP_TRIM_S = 60.0


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


class HeapTrim:
    """Hand the free pages inside glibc's heap back to the kernel now and then (malloc_trim(0)).

    glibc returns a heap's memory on its own only from the top; a block freed below a live one
    stays resident. The daemon's larger blocks (request bodies, span batches, big dicts' tables)
    come and go in every round, and glibc holds 2-8 MiB of such free space at 100 requests/s.
    malloc_trim gives back the whole free pages in the middle of each arena too (madvise), which
    no allocation setting does: 2-3 MiB less RSS at the correlator's horizon, for about 1 ms of
    CPU a trim at that size (bench/heap_trim.py; docs/footprint.md, thirty-third pass).
    ``maybe()`` is cheap to call every round; it trims at most once every ``every_s`` seconds.
    A no-op off glibc."""

    def __init__(self, every_s: float = HEAP_TRIM_S) -> None:
        self.every_s = every_s
        self._next = time.monotonic() + every_s
        self._trim: Any = None
        try:
            self._trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            return
        self._trim.argtypes = (ctypes.c_size_t,)

    def maybe(self) -> bool:
        """Trim if it is due; whether glibc gave any memory back."""
        now = time.monotonic()
        if self._trim is None or now < self._next:
            return False
        self._next = now + self.every_s
        return bool(self._trim(0))


@contextlib.contextmanager
def listening(key: str, address: str) -> Iterator[None]:
    """A listener that cannot bind is a configuration problem, said in one line, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"cannot listen on {key} {address}: {exc.strerror or exc}; "
                          f"{_bind_advice(exc, key, address)}") from exc


def _bind_advice(exc: OSError, key: str, address: str) -> str:
    """What to do about a listener that cannot bind, for the reason it cannot."""
    port_text = address.rsplit(":", 1)[-1]
    port = int(port_text) if port_text.isascii() and port_text.isdigit() else None
    other = f"set {key} to another address ('' turns it off)"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return f"set {key} to an address of this host, e.g. 127.0.0.1 or 0.0.0.0 ('' turns it off)"
    if exc.errno == errno.EACCES and port is not None and port < 1024:
        return (f"ports below 1024 need root or CAP_NET_BIND_SERVICE; set {key} to a port of 1024 or more "
                "('' turns it off), or grant the capability")
    if exc.errno == errno.EADDRINUSE:
        return f"find what holds it with `ss -ltnup 'sport = :{port_text}'`, or {other}"
    return other


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
