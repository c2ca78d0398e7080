"""What running as a service needs, apart from what the daemon does: sd_notify without
libsystemd, listeners that fail in one line, and shutdown steps that never stop the shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from auditor.errors import ConfigError

log = logging.getLogger(__name__)


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
