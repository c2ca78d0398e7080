"""Span attributes the auditor joins on, in the order they are read: the one list that both the
live-notice sender (``auditor.live``) and span normalization (``collectors.normalize``) use, so a
live notice and the span it announces always carry the same connection.

Socket-level peer attributes describe the TCP connection itself, which is what kernel events
carry, so they win over the logical client address (which a proxy header can rewrite).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PEER_ADDR_KEYS = ("network.peer.address", "net.sock.peer.addr", "client.address", "net.peer.ip")
PEER_PORT_KEYS = ("network.peer.port", "net.sock.peer.port", "client.port", "net.peer.port")
SERVER_PORT_KEYS = ("server.port", "net.host.port")
# Engine work spans by name (vLLM's); normalization also knows other conventions.
ENGINE_SPAN_NAMES = frozenset({"llm_request"})


def first_attribute(attributes: Mapping[str, Any] | None, keys: tuple[str, ...]) -> Any:
    """The value of the first of ``keys`` that ``attributes`` holds (not None), else None."""
    if not attributes:
        return None
    for key in keys:
        value = attributes.get(key)
        if value is not None:
            return value
    return None
