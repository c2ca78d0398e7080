"""What every connection-event source offers, and how the daemon gets one.

Two sources exist: the eBPF probe (``probes.bpf``), exact to the microsecond and able to tell FIN
from RST, and the unprivileged /proc/net/tcp poller (``probes.procfs``). ``open_source`` picks the
probe when it can load and otherwise falls back, logging what the fallback cannot see.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from auditor.errors import AuditorError, ConfigError
from auditor.model import ConnEvent

if TYPE_CHECKING:
    from probes.netns import ProcessScan

log = logging.getLogger(__name__)

SOURCE_CHOICES = ("auto", "bpf", "procfs")

# One of the daemon's own connections, as the server sees it: (the daemon's address, its local
# port, the server's port, the server's address). The server's address tells it from a client of
# another engine on the same port number (a pod of the node) that got the same local port.
OwnEnd = tuple[str, int, int, str]


class ProbeUnavailable(AuditorError):
    """The eBPF probe cannot run here; the message says why and how to fix it."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}: {fix}")
        self.reason = reason
        self.fix = fix


@runtime_checkable
class ConnEventSource(Protocol):
    """A stream of server-side connection events for a live-changeable set of local ports."""

    name: str  # "bpf" or "procfs"

    def start(self) -> None: ...

    def set_ports(self, ports: Iterable[int]) -> None: ...

    def poll(self, timeout_s: float = 0.1) -> list[ConnEvent]: ...

    def lost_events(self) -> int: ...

    def server_pids(self) -> dict[int, int]: ...  # port -> the serving process, where known

    def server_pids_at(self) -> dict[int, dict[str, int]]: ...  # the same by local address

    # This process's own connections to watched ports (the daemon's scrapes of its engines'
    # /metrics): not clients. A source may leave them out.
    def set_own_endpoints(self, endpoints: Iterable[OwnEnd]) -> None: ...

    def stop(self) -> None: ...


def validate_ports(ports: Iterable[int]) -> frozenset[int]:
    """The ports as a set, or a ConfigError naming the first one that is not a TCP port."""
    checked: set[int] = set()
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigError(f"{port!r} is not a TCP port; use 1-65535, e.g. 8000")
        checked.add(port)
    return frozenset(checked)


def fallback_warning(poll_hz: float, walk_us: float | None = None) -> str:
    """What the /proc fallback costs and loses, for the log line that says the daemon runs it.
    ``walk_us``: this host's walk of the kernel's TCP table, measured (None: not measured)."""
    interval_ms = 1000.0 / poll_hz
    cost = ("" if walk_us is None else
            f"; each poll after a new connection walks the kernel's whole TCP table, {walk_us:.0f} us of CPU "
            f"here: about {walk_us * poll_hz / 1e4:.1f}% of a core while connections arrive, where the eBPF "
            "probe costs a fraction of a percent")
    return (f"falling back to polling the kernel's socket table (sock_diag) at {poll_hz:g} Hz, which loses "
            f"timing precision (disconnect times are good to about {interval_ms:.0f} ms) and, where the kernel "
            f"refuses its notices of freed sockets, FIN vs RST and connections shorter than a poll{cost}; "
            "`auditor doctor` says what the probe needs")


def measured_walk_us(repeats: int = 10) -> float | None:
    """This host's walk of the kernel's TCP table (``probes.sockdiag.walk_cpu_us``), None where
    sock_diag is refused (the poller then parses /proc/net/tcp)."""
    from probes.sockdiag import walk_cpu_us

    try:
        return walk_cpu_us(repeats)
    except OSError:
        return None


def open_source(ports: Iterable[int], prefer: str = "auto", host: str | None = None, *,
                poll_hz: float = 20.0, ringbuf_pages: int | None = None,
                netns_scan: ProcessScan | None = None) -> ConnEventSource:
    """A connection-event source for ``ports``, not yet started (``netns_scan``: the /proc
    fallback's look at the processes' network namespaces, where the daemon shares one).

    ``prefer="bpf"`` raises ProbeUnavailable when the probe cannot load; ``"auto"`` falls back to
    the /proc poller with a warning that says what is lost; ``"procfs"`` never tries BPF.
    """
    if prefer not in SOURCE_CHOICES:
        raise ConfigError(f"source {prefer!r} is unknown; use one of {', '.join(SOURCE_CHOICES)}")
    port_set = validate_ports(ports)
    host_name = host if host is not None else socket.gethostname()
    if prefer in ("auto", "bpf"):
        from probes.bpf import DEFAULT_RINGBUF_PAGES, BpfConnEventSource

        try:
            return BpfConnEventSource(port_set, host=host_name,
                                      ringbuf_pages=ringbuf_pages or DEFAULT_RINGBUF_PAGES)
        except ProbeUnavailable as exc:
            if prefer == "bpf":
                raise
            log.warning("kernel probe unavailable (%s); %s", exc, fallback_warning(poll_hz, measured_walk_us()))
    from probes.procfs import ProcfsConnEventSource

    return ProcfsConnEventSource(port_set, host=host_name, poll_hz=poll_hz, other_namespaces=True,
                                 netns_scan=netns_scan)
