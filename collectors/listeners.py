"""The process behind a listening TCP port, for engines whose spans carry no ``process.pid``.

The OpenTelemetry SDK leaves ``process.pid`` out of the resource unless a detector adds it, so the
auditor finds the engine itself: the kernel's LISTEN sockets on the port (asked over sock_diag
netlink where the daemon passes ``listening``, else read from ``/proc/net/tcp`` and
``/proc/net/tcp6``) give the socket inodes, and the process holding one of them is found by
reading the ``socket:[inode]`` links under ``/proc/<pid>/fd``.

Privileges: sock_diag's socket dumps and ``/proc/net/tcp*`` are open to every user. Listing
another user's ``/proc/<pid>/fd`` needs CAP_DAC_READ_SEARCH, and reading its links is a ptrace
read-access check (``PTRACE_MODE_READ``), which for a process of another user needs CAP_SYS_PTRACE. The unit runs as its own user, so it
finds engines of other users this way only with CAP_SYS_PTRACE in its capability set
(docs/verdicts.md, "Cost"). Without it, ``resolve`` takes the process a ``closers`` callable names
(the eBPF probe sees which process closes a connection on the port, no ptrace needed); a port still
unresolved stays so, and verdicts say why and what would help in ``cost_unmeasured``.

An engine in a container with a network of its own listens in that namespace, not the daemon's
(``probes.netns`` finds it, passed in by the daemon; looked for at most every ``rescan_s``). Where
both listen on a port, the other namespace's process is taken: the host's end is a proxy's
(Docker's ``docker-proxy`` holds each published port), the container's the engine. A port listened
on in several other namespaces (pods of one node serving the same port) names no process for the
port as a whole: ``shared`` names each namespace's, by its address, which is where its engine's
spans come from when it sends them straight to the daemon.

An answer that found every port's process holds while those processes live, checked again in full
every ``verify_s``; otherwise every ``refresh_s``. Found pids are cached by inode and checked
cheaply (their link still names the inode); the full scan of ``/proc`` runs only for inodes not yet
found, at most every ``rescan_s``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from auditor.socktable import bound_inodes

log = logging.getLogger(__name__)

CLOSERS_HINT = "; the eBPF probe names it once the engine has closed a connection on the port"
# The same for a port several containers serve, none of whose processes /proc gave.
SHARED_CLOSERS_HINT = "; the eBPF probe names each once it sees it close a connection"


def listening_inodes(ports: Iterable[int], proc_root: Path = Path("/proc")) -> dict[int, set[int]]:
    """Port -> inodes of the sockets listening on it (IPv4 and IPv6), from ``/proc/net/tcp*``.

    Reading those walks the kernel's whole connection hash, whose size grows with the host's
    memory however few sockets it holds: ``ListenerPids`` takes a cheaper way where it is given
    one (the daemon gives the kernel's sock_diag, ``probes.sockdiag``)."""
    return _listening_inodes_proc(set(ports), proc_root)


def _listening_inodes_proc(wanted: set[int], proc_root: Path) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            text = (proc_root / "net" / table).read_text()
        except OSError:
            continue
        for port, inodes in bound_inodes(text, wanted).items():
            found.setdefault(port, set()).update(inodes)
    return found


def holders(inodes: set[int], proc_root: Path = Path("/proc")) -> tuple[dict[int, int], int]:
    """Inode -> pid of a process holding it, and how many processes' descriptors could not be read."""
    links = {f"socket:[{inode}]": inode for inode in inodes}
    found: dict[int, int] = {}
    denied = 0
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit() or len(found) == len(links):
            continue
        fd_dir = os.path.join(entry.path, "fd")
        try:
            names = os.listdir(fd_dir)
        except PermissionError:
            denied += 1
            continue
        except OSError:
            continue  # gone meanwhile
        for name in names:
            try:
                inode = links.get(os.readlink(os.path.join(fd_dir, name)))
            except PermissionError:
                denied += 1
                break
            except OSError:
                continue
            if inode is not None and inode not in found:
                found[inode] = int(entry.name)
    return found, denied


class OtherNamespaces(Protocol):
    """The other network namespaces listening on ports (the daemon passes ``probes.netns``'s)."""

    @property
    def inodes(self) -> dict[int, set[int]]:
        """Port -> the LISTEN sockets there, at the latest refresh."""
        ...

    def refresh(self, ports: Iterable[int], *, fresh: bool = False) -> Mapping[int, Sequence[object]]:
        """Port -> the other namespaces listening on it (``fresh``: the processes looked at now)."""
        ...

    def by_address(self, port: int) -> Mapping[str, set[int]]:
        """The address of each namespace listening on ``port`` at the latest refresh -> its LISTEN sockets."""
        ...


class ListenerPids:
    """Port -> pid of the process listening on it, cached; why not, for the ports it cannot tell."""

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc", *, refresh_s: float = 2.0,
                 verify_s: float = 60.0, rescan_s: float = 10.0,
                 monotonic: Callable[[], float] = time.monotonic,
                 listening: Callable[[set[int]], dict[int, set[int]]] | None = None,
                 other_namespaces: OtherNamespaces | None = None) -> None:
        self.proc_root = Path(proc_root)
        self._netns = other_namespaces
        # (ports, monotonic time, port -> namespaces found, port -> their LISTEN inodes, and for a
        # port of several: port -> each one's address -> its LISTEN inodes)
        self._netns_answer: tuple[frozenset[int], float, dict[int, int], dict[int, set[int]],
                                  dict[int, dict[str, set[int]]]] | None = None
        # A port listened on in several other namespaces -> each one's address -> its process.
        self.shared: dict[int, dict[str, int]] = {}
        self._found_shared: dict[int, dict[str, int]] = {}  # the same, as /proc told (``shared`` adds closers)
        # The same ports -> every such namespace's address, its process found or not.
        self.servers: dict[int, frozenset[str]] = {}
        # Port -> listening inodes, a cheaper way than /proc/net/tcp (which stays the fallback).
        self._listening = listening
        self.refresh_s = refresh_s
        self.verify_s = verify_s
        self.rescan_s = rescan_s
        self._answer: tuple[frozenset[int], float, tuple[dict[int, int], dict[int, str]]] | None = None
        self._monotonic = monotonic
        self._pid_by_inode: dict[int, int] = {}
        self._scanned_at: float | None = None
        self._denied = 0  # processes whose descriptors the last scan could not read
        self._closers: dict[int, int] = {}  # port -> pid taken from ``closers``, to log changes once
        self._closers_at: dict[tuple[int, str], int] = {}  # the same, of ``closers_at``
        self.scans = 0

    def _still_holds(self, pid: int, inode: int) -> bool:
        fd_dir = self.proc_root / str(pid) / "fd"
        try:
            return any(os.readlink(fd_dir / name) == f"socket:[{inode}]" for name in os.listdir(fd_dir))
        except OSError:
            return False

    def resolve(self, ports: Iterable[int], closers: Callable[[], dict[int, int]] | None = None,
                closers_at: Callable[[], dict[int, dict[str, int]]] | None = None
                ) -> tuple[dict[int, int], dict[int, str]]:
        """(port -> pid, port -> why unknown) for the ports asked; the same answer for ``refresh_s``,
        and up to ``verify_s`` while every port has a process and they all live (the scan of
        ``/proc/*/fd`` for a new inode costs milliseconds on a busy host).
        ``closers`` (port -> pid of a process seen closing a connection on it) is asked, on every
        call, for the ports this lookup leaves unknown; ``closers_at`` (the same by local address)
        for the containers of a port several serve whose processes it did not find (``shared``)."""
        asked, now = frozenset(ports), self._monotonic()
        if self._answer is not None and self._answer[0] == asked:
            age, (pids, unknown) = now - self._answer[1], self._answer[2]
            if age < self.refresh_s or (age < self.verify_s and not unknown and all(
                    (self.proc_root / str(pid)).exists() for pid in pids.values())):
                self._shared_with_closers(closers_at)
                return self._with_closers(self._answer[2], closers)
        answer = self._resolve(set(asked))
        self._answer = (asked, now, answer)
        self._shared_with_closers(closers_at)
        return self._with_closers(answer, closers)

    def _shared_with_closers(self, closers_at: Callable[[], dict[int, dict[str, int]]] | None) -> None:
        """``shared``: the containers' processes found in /proc, and for those not found (another
        user's, read without CAP_SYS_PTRACE) the process the eBPF probe saw closing a connection at
        the container's address."""
        self.shared = {port: dict(found) for port, found in self._found_shared.items()}
        missing = {port: addresses - self.shared.get(port, {}).keys() for port, addresses in self.servers.items()}
        if closers_at is None or not any(missing.values()):
            return
        named, taken = closers_at(), {}
        for port, addresses in missing.items():
            for address in sorted(addresses):
                pid = named.get(port, {}).get(address)
                if pid is None:
                    continue
                self.shared.setdefault(port, {})[address] = taken[port, address] = pid
                if self._closers_at.get((port, address)) != pid:
                    log.info("port %d at %s: engine process %d, seen closing a connection by the eBPF probe",
                             port, address, pid)
        self._closers_at = taken

    def _with_closers(self, answer: tuple[dict[int, int], dict[int, str]],
                      closers: Callable[[], dict[int, int]] | None) -> tuple[dict[int, int], dict[int, str]]:
        """The answer, with ports it leaves unknown taken from ``closers`` (a new dict: the
        cached answer is not changed)."""
        pids, unknown = answer
        if closers is None or not unknown:
            return answer
        named = closers()
        pids, still = dict(pids), {}
        for port, why in unknown.items():
            # A port several containers serve: a process seen closing there is one of their engines,
            # named by its address (``_shared_with_closers``), not the port's.
            pid = named.get(port) if port not in self.servers else None
            if pid is None:
                still[port] = why + (CLOSERS_HINT if port not in self.servers
                                     else "" if self._found_shared.get(port) else SHARED_CLOSERS_HINT)
                continue
            pids[port] = pid
            if self._closers.get(port) != pid:
                log.info("port %d: engine process %d, seen closing a connection by the eBPF probe", port, pid)
        self._closers = {port: pids[port] for port in named.keys() & unknown.keys() if port in pids}
        return pids, still

    def _resolve(self, ports: set[int]) -> tuple[dict[int, int], dict[int, str]]:
        inodes: dict[int, set[int]] | None = None
        if self._listening is not None:
            try:
                inodes = self._listening(ports)
            except OSError as exc:
                log.debug("listening sockets not told (%s); reading /proc/net/tcp", exc)
        if inodes is None:
            inodes = listening_inodes(ports, self.proc_root)
        namespaces, elsewhere, addresses = self._elsewhere(ports)
        inodes = {**inodes, **elsewhere}
        self._pid_by_inode = {i: p for i, p in self._pid_by_inode.items()
                              if any(i in found for found in inodes.values()) and self._still_holds(p, i)}
        missing = {i for found in inodes.values() for i in found} - self._pid_by_inode.keys()
        now = self._monotonic()
        if missing and (self._scanned_at is None or now - self._scanned_at >= self.rescan_s):
            self._scanned_at, self.scans = now, self.scans + 1
            found, self._denied = holders(missing, self.proc_root)
            self._pid_by_inode.update(found)
        pids: dict[int, int] = {}
        unknown: dict[int, str] = {}
        self._found_shared = {}
        self.servers = {port: frozenset(by_address) for port, by_address in addresses.items()
                        if namespaces.get(port, 0) > 1}
        for port in sorted(ports):
            held = [self._pid_by_inode[i] for i in sorted(inodes.get(port, ())) if i in self._pid_by_inode]
            if namespaces.get(port, 0) > 1:
                shared = self._found_shared[port] = {
                    address: min(self._pid_by_inode[i] for i in found & self._pid_by_inode.keys())
                    for address, found in addresses.get(port, {}).items() if found & self._pid_by_inode.keys()}
                several = f"port {port} is listened on in {namespaces[port]} other network namespaces (containers)"
                if shared:
                    unknown[port] = (f"{several}, and the spans came from none of their addresses (relayed, or "
                                     "from elsewhere), so which one's process served the request is not known; "
                                     "send each engine's spans straight to the daemon, name each pod's address in "
                                     "its resource (k8s.pod.ip: a collector's k8sattributes processor adds it), or "
                                     "put process.pid in each engine's OpenTelemetry resource")
                else:
                    unknown[port] = (f"{several}, and none of their listening processes was found"
                                     + self._denied_hint() + "; put process.pid in each engine's OpenTelemetry "
                                     "resource")
            elif held:
                pids[port] = held[0]
            elif port not in inodes:
                unknown[port] = f"nothing listens on port {port} on this host"
            else:
                unknown[port] = (f"the process listening on port {port} was not found" + self._denied_hint()
                                 + "; to name it, put process.pid in the engine's OpenTelemetry resource")
        return pids, unknown

    def _denied_hint(self) -> str:
        return (f" ({self._denied} processes' descriptors unreadable: the daemon needs CAP_DAC_READ_SEARCH and "
                "CAP_SYS_PTRACE)" if self._denied else "")

    @property
    def in_other_namespaces(self) -> set[int]:
        """The ports other network namespaces listened on at the latest look."""
        return set(self._netns_answer[2]) if self._netns_answer is not None else set()

    def _elsewhere(self, ports: set[int]) -> tuple[dict[int, int], dict[int, set[int]], dict[int, dict[str, set[int]]]]:
        """(port -> how many other network namespaces listen on it, port -> their LISTEN inodes,
        and for a port listened on in several: port -> each one's address -> its LISTEN inodes),
        looked for at most every ``rescan_s`` (a stat of every process's TCP table)."""
        if self._netns is None:
            return {}, {}, {}
        asked, now = frozenset(ports), self._monotonic()
        cached = self._netns_answer
        if cached is None or cached[0] != asked or now - cached[1] >= self.rescan_s:
            found = self._netns.refresh(asked, fresh=cached is None or cached[0] != asked)
            cached = self._netns_answer = (
                asked, now, {port: len(spaces) for port, spaces in found.items()}, dict(self._netns.inodes),
                {port: dict(self._netns.by_address(port)) for port, spaces in found.items() if len(spaces) > 1})
        return cached[2], cached[3], cached[4]
