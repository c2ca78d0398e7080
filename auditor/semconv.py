"""Span attributes the auditor joins on, in the order they are read: the one list that both the
live-notice sender (``auditor.live``) and span normalization (``collectors.normalize``) use, so a
live notice and the span it announces always carry the same connection.

Socket-level peer attributes describe the TCP connection itself, which is what kernel events
carry, so they win over the logical client address (which a proxy header can rewrite).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

PEER_ADDR_KEYS = ("network.peer.address", "net.sock.peer.addr", "client.address", "net.peer.ip")
PEER_PORT_KEYS = ("network.peer.port", "net.sock.peer.port", "client.port", "net.peer.port")
SERVER_PORT_KEYS = ("server.port", "net.host.port")
# The client's User-Agent on an HTTP server span: the stable convention's name, then the older one
# (opentelemetry-instrumentation-asgi sets either, or both, by OTEL_SEMCONV_STABILITY_OPT_IN).
USER_AGENT_KEYS = ("user_agent.original", "http.user_agent")
MAX_USER_AGENT = 255  # characters of it a verdict keeps (the store's column)
# A live notice's largest datagram (``auditor.live`` writes them, ``collectors.live`` reads them);
# here so the daemon's receiver does not import the sender's OpenTelemetry SDK (docs/footprint.md,
# thirty-fourth pass).
MAX_DATAGRAM = 1024
# Engine work spans by name: vLLM's ``llm_request``. More names come from configuration
# (``[spans] engine_names``); the GenAI semantic conventions are recognised by their operation.
ENGINE_SPAN_NAMES = frozenset({"llm_request"})
# GenAI semantic conventions (gen-ai-spans): an inference span is named "{gen_ai.operation.name}
# {gen_ai.request.model}" and carries the operation as an attribute. Its kind is CLIENT at the
# caller (the openai SDK's instrumentation: no engine work of this host) and SERVER or INTERNAL
# where the model runs, which is the engine's own span.
GENAI_OPERATION = "gen_ai.operation.name"
GENAI_INFERENCE_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})


class EngineSpans:
    """Which spans are an engine's own work span: by name (vLLM's, configured ones, a trailing
    ``*`` for a prefix), or by the GenAI conventions' inference operation. A CLIENT span never is:
    it is a caller's view of work done elsewhere."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        extra = [name.strip() for name in names if name.strip()]
        self.names = ENGINE_SPAN_NAMES | {name for name in extra if not name.endswith("*")}
        self.prefixes = tuple(name[:-1] for name in extra if name.endswith("*") and len(name) > 1)

    def matches(self, name: str, kind: str, operation: Any = None, *, http: bool = False) -> bool:
        """``kind``: the span kind in lower case; ``operation``: its ``gen_ai.operation.name``;
        ``http``: whether it has HTTP attributes (an HTTP span is never taken for GenAI work)."""
        if kind == "client":
            return False
        if name in self.names or (self.prefixes and name.startswith(self.prefixes)):
            return True
        if http:
            return False
        if operation is not None:
            return operation in GENAI_INFERENCE_OPERATIONS
        op, _, model = name.partition(" ")
        return op in GENAI_INFERENCE_OPERATIONS and bool(model) and " " not in model


def first_attribute(attributes: Mapping[str, Any] | None, keys: tuple[str, ...]) -> Any:
    """The value of the first of ``keys`` that ``attributes`` holds (not None), else None."""
    if not attributes:
        return None
    for key in keys:
        value = attributes.get(key)
        if value is not None:
            return value
    return None


# Where a span came from: the address of the OTLP client that sent it (the receivers add it). A
# host's engines in containers on networks of their own send from their own addresses; pods of one
# node that serve the same port are told apart by it (their processes, and who shared whose GPU
# time). Not added for a loopback sender (an engine in the daemon's own network): nothing to tell.
# Where the span's resource names its pod's address (POD_ADDRESS_KEY), that address instead: spans
# relayed by a collector come from the collector's.
SENDER_KEY = "auditor.sender_address"
# The pod's address as a resource attribute: a collector's k8sattributes processor adds it (with
# ``k8s.pod.ip`` among its ``extract.metadata``), or the pod's own OTEL_RESOURCE_ATTRIBUTES from the
# downward API's status.podIP.
POD_ADDRESS_KEY = "k8s.pod.ip"


def sender_address(peer: Any) -> str | None:
    """The address an OTLP client sent from (its socket's peer: ``(address, port, ...)``), as
    recorded on its spans: None for a loopback one (or none); an IPv4 address a dual-stack socket
    shows mapped into IPv6 as the IPv4 one."""
    address = (peer[0] if peer else None) if isinstance(peer, tuple) else peer
    if not isinstance(address, str) or not address:
        return None
    if address.startswith("::ffff:") and "." in address:
        address = address[7:]
    if address.startswith("127.") or address == "::1":
        return None
    return address


@functools.lru_cache(maxsize=1024)
def named_address(value: str) -> str | None:
    """A resource's ``k8s.pod.ip`` as a sender's address (``sender_address``'s rules, the text
    written as an address is): None for what is not an IP address."""
    try:
        address = ipaddress.ip_address(value.strip())
    except ValueError:
        return None
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return sender_address(str(mapped or address))


def engine_of(service: str, attributes: Mapping[str, Any] | None) -> str:
    """Which engine a span's request ran on, for counting who shared it: its service, and where
    its spans came from a container's own address, that address too (two pods serving one model
    under one service name are two engines)."""
    sender = attributes.get(SENDER_KEY) if attributes else None
    return f"{service}@{sender}" if isinstance(sender, str) and sender else service
