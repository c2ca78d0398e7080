"""The network namespaces other than the daemon's that listen on a watched port: containers' engines.

Each network namespace has its own TCP tables. An engine in a container with a network of its own
(Docker's default bridge, a pod's network) serves from sockets that neither sock_diag nor
/proc/net/tcp, read from the daemon's namespace, ever list. The eBPF probe's tracepoints fire in
every namespace; the /proc fallback reads each such namespace's table itself.

Entering a namespace (``setns``) needs CAP_SYS_ADMIN, and naming one (the ``/proc/<pid>/ns/net``
link) a ptrace read of a process in it. Neither is needed to read ``/proc/<pid>/net/tcp``, which
lists the network namespace of process ``<pid>`` to any user. Its inode number tells the
namespaces apart: each namespace registers its own proc entries, and every process in it shows
the same one. So ``NetNamespaces.refresh`` stats that file for every process (a few microseconds
each), keeps one process per namespace, and reads the LISTEN rows of each namespace but the
daemon's own for the watched ports: again only where the namespace's own count of TCP sockets
(its sockstat, read without a walk) or its processes changed since, or a minute passed, for a
read walks the kernel's whole connection hash and a host may run many containers that serve no
watched port. A namespace whose process ends is read through another of its processes; one with
none left is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from auditor.socktable import bound_inodes

log = logging.getLogger(__name__)

# A namespace whose count of TCP sockets has not moved is not read again for this long: a listener
# that closed and another that opened between two looks leave the count where it was.
REREAD_S = 60.0
# The daemon's readers of other namespaces each look every 10 s; a scan of the processes this young
# answers any of them (``ProcessScan``).
SCAN_REUSE_S = 5.0


@dataclass(frozen=True, slots=True)
class Namespace:
    """A network namespace other than the daemon's, read through one of its processes."""

    ident: int  # the inode of its tcp table, the same through every process in it
    pid: int  # a process in it when last looked
    versions: frozenset[int] = frozenset({4, 6})  # the tables listening on a watched port (a v6 one may take v4)

    def tables(self, proc_root: Path) -> list[tuple[int, Path]]:
        """(IP version, path) of its TCP tables that listen on a watched port. Reading one walks
        the kernel's whole connection hash, shared by every namespace (1-5 ms on a large host)."""
        net = proc_root / str(self.pid) / "net"
        return [(version, net / ("tcp" if version == 4 else "tcp6")) for version in sorted(self.versions)]

    def address(self, proc_root: Path) -> str | None:
        """Its first IPv4 address other than loopback (the container's on its bridge, which the host
        routes to), from the routing table's local entries; else its first global IPv6 address (an
        IPv6-only pod network); None where it has neither or it ended."""
        net = proc_root / str(self.pid) / "net"
        try:
            lines = (net / "fib_trie").read_text().splitlines()
        except OSError:
            lines = []
        last = ""
        for line in lines:
            text = line.strip()
            if text.startswith(("|-- ", "+-- ")):
                last = text[4:].split(" ", 1)[0]
            elif text == "/32 host LOCAL" and last and not last.startswith("127."):
                return last
        try:
            rows = (net / "if_inet6").read_text().splitlines()
        except OSError:
            return None
        for row in rows:  # address (32 hex digits), interface index, prefix length, scope, flags, name
            fields = row.split()
            if len(fields) >= 4 and fields[3] == "00" and len(fields[0]) == 32:
                with contextlib.suppress(ValueError):
                    return socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
        return None

    def snmp(self, proc_root: Path) -> Path:
        """Its counters (PassiveOpens: the connections its listeners accepted), read in microseconds."""
        return proc_root / str(self.pid) / "net" / "snmp"


def _ident(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:  # the process ended, or this kernel hides it
        return None


def _socket_count(net: Path) -> tuple[int, int] | None:
    """The namespace's TCP and TCP6 sockets in use (its own counts in sockstat, read without a walk
    of the connection hash); None where unreadable."""
    try:
        counts = [next(line.split()[2] for line in (net / name).read_text().splitlines()
                       if line.startswith(prefix)) for name, prefix in (("sockstat", "TCP: "), ("sockstat6", "TCP6: "))]
        return int(counts[0]), int(counts[1])
    except (OSError, StopIteration, IndexError, ValueError):
        return None


class ProcessScan:
    """Which network namespace each process is in: a stat of every process's ``net/tcp`` (a few
    microseconds each; milliseconds on a host of thousands of processes). The daemon's readers of
    other namespaces (the /proc source, the engine-process lookup, the engines' addresses) each look
    every 10 s on their own; sharing one scan, one younger than ``reuse_s`` answers them all, where
    each made its own (and the addresses' lookup one a port). Thread-safe: they run in different
    threads. ``reuse_s`` 0: a scan each time asked."""

    def __init__(self, proc_root: Path = Path("/proc"), *, reuse_s: float = 0.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.proc_root = proc_root
        self.reuse_s = reuse_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._taken: tuple[float, dict[int, list[int]]] | None = None  # (monotonic time, the scan)
        self.processes_read = 0  # processes stat'ed by the latest scan (its cost grows with them)
        self.scans = 0

    def by_namespace(self, fresh: bool = False) -> dict[int, list[int]]:
        """Namespace (its tcp table's inode) -> its processes, every namespace's; taken anew where
        ``fresh`` (a port just watched: an engine started a moment ago must be found). OSError
        where /proc cannot be listed. Not to be changed: it may answer others too."""
        with self._lock:
            now = self._monotonic()
            if not fresh and self._taken is not None and now - self._taken[0] < self.reuse_s:
                return self._taken[1]
            found: dict[int, list[int]] = {}
            read = 0
            for name in os.listdir(self.proc_root):
                if not name.isdigit():
                    continue
                read += 1
                ident = _ident(self.proc_root / name / "net" / "tcp")
                if ident is not None:
                    found.setdefault(ident, []).append(int(name))
            self.processes_read, self.scans, self._taken = read, self.scans + 1, (now, found)
            return found


class NetNamespaces:
    """Which of the watched ports are listened on in which other network namespaces; ``scan``: the
    processes' namespaces, where shared (``ProcessScan``; by default one of its own, taken anew at
    each refresh)."""

    def __init__(self, proc_root: Path = Path("/proc"), monotonic: Callable[[], float] = time.monotonic,
                 scan: ProcessScan | None = None) -> None:
        self.proc_root = proc_root
        self.own = _ident(proc_root / "self" / "net" / "tcp")
        self._scan = scan if scan is not None else ProcessScan(proc_root, monotonic=monotonic)
        self._members: dict[int, int] = {}  # namespace -> the process it was last read through
        # port -> [(a namespace listening on it, its LISTEN sockets there)], at the latest refresh
        self.listeners: dict[int, list[tuple[Namespace, set[int]]]] = {}
        self.tables_read = 0  # TCP tables the latest refresh read (each a walk of the connection hash)
        self._monotonic = monotonic
        # namespace -> (its socket count, its processes, the ports asked, monotonic time, what its
        # tables told) at its tables' latest read
        self._read: dict[int, tuple[tuple[int, int] | None, frozenset[int], frozenset[int], float,
                                    dict[int, set[int]], frozenset[int]]] = {}

    @property
    def processes_read(self) -> int:
        """Processes stat'ed by the latest scan (its cost grows with them)."""
        return self._scan.processes_read

    def refresh(self, ports: Iterable[int], *, fresh: bool = False) -> dict[int, list[Namespace]]:
        """Port -> the other namespaces with a socket listening on it, in a stable order; every
        process's namespace looked at anew (one may have entered another since), or as a shared
        scan of them found it, at most its ``reuse_s`` ago, unless ``fresh`` (ports just watched)."""
        wanted = frozenset(ports)
        self.listeners = {}
        if not wanted or self.own is None:
            return {}
        try:
            by_ident = self._scan.by_namespace(fresh)
        except OSError as exc:
            log.warning("cannot list %s (%s): servers in other network namespaces are not found", self.proc_root, exc)
            return {}
        members: dict[int, int] = {}
        for ident, pids in by_ident.items():
            if ident == self.own:
                continue
            kept = self._members.get(ident)
            members[ident] = kept if kept in pids else min(pids)
        self._members = members
        now = self._monotonic()
        self._read = {ident: read for ident, read in self._read.items() if ident in members}
        self.tables_read = 0
        found: dict[int, list[Namespace]] = {}
        for ident, pid in sorted(members.items()):
            listened, versions = self._listeners(ident, pid, frozenset(by_ident[ident]), wanted, now)
            namespace = Namespace(ident, pid, versions)
            for port, inodes in listened.items():
                found.setdefault(port, []).append(namespace)
                self.listeners.setdefault(port, []).append((namespace, inodes))
        return found

    @property
    def inodes(self) -> dict[int, set[int]]:
        """Port -> its LISTEN sockets in the other namespaces, at the latest refresh."""
        return {port: set().union(*(inodes for _, inodes in listened)) for port, listened in self.listeners.items()}

    def by_address(self, port: int) -> dict[str, set[int]]:
        """The address of each namespace listening on ``port`` at the latest refresh (its bridge's,
        ``Namespace.address``) -> its LISTEN sockets there; one without an address left out."""
        found: dict[str, set[int]] = {}
        for namespace, inodes in self.listeners.get(port, ()):
            address = namespace.address(self.proc_root)
            if address is not None:
                found.setdefault(address, set()).update(inodes)
        return found

    def _listeners(self, ident: int, pid: int, pids: frozenset[int], wanted: frozenset[int], now: float
                   ) -> tuple[dict[int, set[int]], frozenset[int]]:
        """(port -> LISTEN inodes, the tables that have them) of one namespace (its processes
        ``pids``). Its tables are read again only where its own count of TCP sockets moved since (a
        new listener moves it), its processes changed (a server restarted in a pod, its socket
        count back where it was: its listener is another socket), the ports asked changed, or
        REREAD_S passed: each read walks the kernel's whole connection hash, and a host may hold
        many containers that listen on no watched port."""
        count = _socket_count(self.proc_root / str(pid) / "net")
        before = self._read.get(ident)
        if (before is not None and count is not None and before[0] == count and before[1] == pids
                and before[2] == wanted and now - before[3] < REREAD_S):
            return before[4], before[5]
        listened: dict[int, set[int]] = {}
        versions: set[int] = set()
        for version, path in Namespace(ident, pid).tables(self.proc_root):
            try:
                text = path.read_text()
            except OSError:
                return {}, frozenset()  # it ended meanwhile: looked at again next time
            self.tables_read += 1
            for port, inodes in bound_inodes(text, wanted).items():
                listened.setdefault(port, set()).update(inodes)
                versions.add(version)
        self._read[ident] = (count, pids, wanted, now, listened, frozenset(versions))
        return listened, frozenset(versions)


class EngineAddresses:
    """The addresses to reach each watched port's engines at (their ``/metrics``): ``default``
    (the loopback) where the port is listened on in this namespace, a proxy's end included
    (Docker's docker-proxy forwards a published port); else the address of each other namespace
    that listens on it (a container on a network of its own, reached at its bridge address;
    several: pods of a node serving one port). Each port's answer is kept ``refresh_s``: the
    scraper asks at each scrape."""

    def __init__(self, listening_here: Callable[[set[int]], dict[int, set[int]]],
                 namespaces: NetNamespaces | None = None, *, default: str = "127.0.0.1",
                 refresh_s: float = 10.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._here = listening_here
        self._namespaces = namespaces if namespaces is not None else NetNamespaces()
        self.default = default
        self.refresh_s = refresh_s
        self._monotonic = monotonic
        self._known: dict[int, tuple[tuple[str, ...], float]] = {}  # port -> (addresses, monotonic time told)
        self._listening: dict[int, dict[str, frozenset[int]]] = {}  # port -> each address's LISTEN sockets

    def of(self, port: int) -> tuple[str, ...]:
        """The port's engines' addresses: one, but for a port several other namespaces serve."""
        now = self._monotonic()
        known = self._known.get(port)
        if known is not None and now - known[1] < self.refresh_s:
            return known[0]
        addresses = self._look(port)
        if addresses != (known[0] if known else (self.default,)):
            log.info("port %d: engine%s reached at %s", port, "s" if len(addresses) > 1 else "", ", ".join(addresses))
        self._known[port] = (addresses, now)
        return addresses

    def _look(self, port: int) -> tuple[str, ...]:
        try:
            if port in self._here({port}):
                return (self.default,)  # no look at the others (a stat of every process) for an engine here
        except OSError:
            pass  # not told: the other namespaces decide
        found = self._namespaces.refresh({port}, fresh=port not in self._known).get(port, [])
        by_address = self._namespaces.by_address(port)
        self._listening[port] = {address: frozenset(inodes) for address, inodes in by_address.items()}
        addresses = tuple(sorted(by_address))
        if not found or len(addresses) != len(found):  # nowhere yet, or a namespace without an address
            return (self.default,)
        return addresses  # one container's, or each of several serving the port

    def listening(self, port: int, address: str) -> frozenset[int] | None:
        """The LISTEN sockets on ``port`` at ``address`` (another namespace's) as of ``of``'s latest
        look; None where not known. Other sockets there later: another server process (a container
        restarted in its pod keeps the pod's address)."""
        return self._listening.get(port, {}).get(address)
