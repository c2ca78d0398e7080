"""The unprivileged fallback: poll the kernel's TCP socket list and diff socket states.

No root, no bcc, no headers: only what the kernel lists for this network namespace, read over
netlink sock_diag (``probes.sockdiag``: the kernel filters by port) or, where netlink is refused,
parsed from /proc/net/tcp and /proc/net/tcp6. What it cannot know, it says (docs/probe.md): an
event is an interval, not an instant: the socket was last seen unchanged at ``earliest_ns`` and
first seen changed at ``ts_ns``, and joins and verdicts use both.

With sock_diag it also reads the kernel's notices of the sockets it frees (``DestroyNotices``):
a connection that opens and closes between two polls is seen through its notice, and one that
vanishes from ESTABLISHED between two polls is told reset (``peer_rst``) from FINs both ways
(``peer_fin``, ``closed``). Without them the first is never seen and the second is reported as
``peer_rst`` either way. Sockets present when a port starts being watched are taken as the
baseline and produce no events.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from auditor.model import READ_UNKNOWN, ConnEvent, ConnEventKind, ListedClient
from probes.netns import Namespace, NetNamespaces, ProcessScan
from probes.sockdiag import (
    TCP_ESTABLISHED,
    TCP_TIME_WAIT,
    DestroyNotices,
    DiagEntry,
    Freed,
    SockDiag,
    TcpAccepts,
)
from probes.source import OwnEnd, validate_ports

log = logging.getLogger(__name__)

# /proc/net/tcp state codes (include/net/tcp_states.h), grouped by what they mean for a server
# socket: still open, closed by the peer, closed by us, or finished.
OPEN = {0x01, 0x03}  # ESTABLISHED, SYN_RECV
PEER_CLOSED = {0x08, 0x09}  # CLOSE_WAIT, LAST_ACK
LOCAL_CLOSED = {0x04, 0x05, 0x0B}  # FIN_WAIT1, FIN_WAIT2, CLOSING
DONE = {0x06, 0x07}  # TIME_WAIT, CLOSE: the full socket is gone
LISTEN = 0x0A
# Up to this many known sockets, asking for each (a hash lookup, ~15 us) beats a dump.
LOOKUPS_INSTEAD_OF_DUMP = 8
STOP_CHECK_S = 0.25  # the longest the poller sleeps without looking whether it should stop
# A connection of the daemon's own that closed is still left out this long: its server end closes
# after it, and its local port is not reused by another connection to the same port before.
OWN_LINGER_S = 120.0
# tcp_info's times are the kernel's jiffies, read in ms: a tick (4 ms at HZ=250; 10 at HZ=100) apart.
JIFFY_NS = 10_000_000
# Sockets seen to close whose free is still to come (a server holds a reset socket until it
# closes it): their notice is not a connection unseen. Oldest forgotten first beyond this many.
HELD_MAX = 4096
WHOLE_SCANS_KEPT = 256  # (start, end) of the latest full snapshots: 13 s at 20 Hz
# A quiet port (nothing listed, nothing accepted since the last dump) can only free the daemon's own
# scrape connections' server ends, or sockets held since they closed: their notices are read this
# often, not every poll (a read that finds none is most of an idle poll's added cost).
QUIET_NOTICES_EVERY_S = 1.0
# How often the other network namespaces that listen on a watched port are looked for (a stat of
# every process's TCP table: probes.netns), and at once when the ports change. A server that begins
# listening in one (a container started) is watched this long after at the latest.
NETNS_REFRESH_S = 10.0

SocketKey = tuple[int, str, int, str, int]  # family, server addr, server port, client addr, client port


@dataclass(slots=True)
class _Seen:
    state: int
    cookie: int | None  # the socket inode while it has one (TIME_WAIT entries show 0)
    freed_as: int = 0  # the kernel's cookie of the socket (sock_diag's), named by its notice when freed
    # The other network namespace whose /proc table listed it (its ident; 0: the daemon's own): there
    # TIME_WAIT is listed, and there is no tcp_info and no notice.
    namespace: int = 0


def _left_after(notice: Freed) -> int:
    """The earliest its client can have left: after its last data, which came ``last_data_recv``
    before the notice was made, itself after the read before began."""
    return notice.after_ns - notice.last_data_recv_ms * 1_000_000 - JIFFY_NS


def _own_end(key: SocketKey) -> OwnEnd:
    """The server socket ``key`` named as one of the daemon's own connections is (``OwnEnd``)."""
    return key[3], key[4], key[2], key[1]


def _phase(state: int | None) -> str:
    if state is None:
        return "gone"
    if state in OPEN:
        return "open"
    if state in PEER_CLOSED:
        return "peer_closed"
    if state in LOCAL_CLOSED:
        return "local_closed"
    return "done"


P, R, L, C = (ConnEventKind.PEER_FIN, ConnEventKind.PEER_RST, ConnEventKind.LOCAL_FIN,
              ConnEventKind.CLOSED)
# (phase before, phase now) -> events; "new" is a socket first seen after the baseline. As the
# probe does, a socket the server closed first ends with its local_fin, and one the client reset
# with its peer_rst: no `closed` after either.
TRANSITIONS: dict[tuple[str, str], tuple[ConnEventKind, ...]] = {
    ("open", "peer_closed"): (P,),
    ("open", "local_closed"): (L,),
    ("open", "done"): (L,),
    ("open", "gone"): (R,),  # a reset, or (with no notice of the free to tell) FIN both ways within one interval
    ("open", "finished"): (P, C),  # gone with FINs both ways, the client's first (the free's notice tells)
    ("peer_closed", "done"): (C,),
    ("peer_closed", "gone"): (C,),
    ("peer_closed", "finished"): (C,),
    ("new", "peer_closed"): (P,),
    ("new", "local_closed"): (L,),
    ("new", "done"): (L,),
    ("new", "gone"): (R,),  # a connection freed between two polls (DestroyNotices): as open -> gone
    ("new", "finished"): (P, C),
}


def _gone(notice: Freed | None) -> str:
    """The phase of a socket gone from the listing, not in TIME_WAIT: ``finished`` where the notice
    of its free says it ended with FINs both ways, else ``gone`` (a reset, where the notice says so)."""
    return "finished" if notice is not None and notice.fin_acked else "gone"


def _decode_address(family: int, text: str) -> str:
    # The kernel prints each 32-bit word of the address as a number in host byte order.
    words = [int(text[i:i + 8], 16) for i in range(0, len(text), 8)]
    packed = struct.pack(f"={len(words)}I", *words)
    return socket.inet_ntop(socket.AF_INET if family == 4 else socket.AF_INET6, packed)


def parse_proc_net_tcp(text: str, family: int, ports: frozenset[int]) -> dict[SocketKey, _Seen]:
    """Sockets of /proc/net/tcp{,6} ``text`` whose local port is in ``ports`` (listeners skipped)."""
    found: dict[SocketKey, _Seen] = {}
    # Busy hosts list tens of thousands of sockets 20 times a second: look at the local port
    # (4 hex digits) first and parse the rest only for watched ones.
    port_hex = {f"{port:04X}" for port in ports}
    for line in text.splitlines()[1:]:
        head = line.split(None, 2)
        if len(head) < 3 or head[1][-4:] not in port_hex:
            continue
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            local, remote, state = fields[1], fields[2], int(fields[3], 16)
            local_addr, _, local_port_hex = local.partition(":")
            local_port = int(local_port_hex, 16)
            if local_port not in ports or state == LISTEN:
                continue
            remote_addr, _, remote_port_hex = remote.partition(":")
            inode = int(fields[9])
            key = (family, _decode_address(family, local_addr), local_port,
                   _decode_address(family, remote_addr), int(remote_port_hex, 16))
        except (ValueError, OSError, struct.error):
            continue  # a line we cannot read is skipped, never fatal
        found[key] = _Seen(state, inode or None)
    return found


class ProcfsConnEventSource:
    """Connection events diffed from socket snapshots taken ``poll_hz`` times a second.

    Snapshots come from sock_diag when ``sock_diag`` is true (default: when ``proc_root`` is the
    real /proc and a netlink socket opens), else from ``proc_root``/net/tcp{,6}. With
    ``other_namespaces``, a watched port listened on in another network namespace (a container's
    engine) is also read from that namespace's ``/proc/<pid>/net/tcp{,6}`` (``probes.netns``): a
    connection that opens and closes between two polls there is not seen, one that vanished from
    ESTABLISHED is told reset, and the port's clients are listed with no time of their last data
    (``clients``). ``netns_scan``:
    the processes' namespaces, where the daemon shares one scan of them (``probes.netns.ProcessScan``).
    """

    name = "procfs"

    def __init__(self, ports: Iterable[int] = (), *, host: str = "", poll_hz: float = 20.0,
                 proc_root: Path = Path("/proc"), sock_diag: bool | None = None,
                 other_namespaces: bool = False, netns_scan: ProcessScan | None = None) -> None:
        if not poll_hz > 0:
            raise ValueError(f"poll_hz must be greater than 0, got {poll_hz}")
        self._ports = validate_ports(ports)
        self._host = host
        self.interval_s = 1.0 / poll_hz
        self._proc_root = proc_root
        self._tables = ((4, proc_root / "net" / "tcp"), (6, proc_root / "net" / "tcp6"))
        # Servers of watched ports in other network namespaces (containers), read from their tables.
        self._netns = NetNamespaces(proc_root, scan=netns_scan) if other_namespaces else None
        self._foreign: dict[int, list[Namespace]] = {}  # port -> the other namespaces listening on it
        self._netns_at = -1e9  # monotonic time of the latest look for them
        self._netns_ports: frozenset[int] = frozenset()
        # Per other namespace (by ident): its accept counter, the count at its latest read, and how
        # many sockets on watched ports that read listed: a namespace that listed none and accepted
        # none since is not read (the read walks the kernel's whole connection hash).
        self._foreign_accepts: dict[int, TcpAccepts | None] = {}
        self._foreign_read: dict[int, tuple[int | None, int]] = {}
        self._queue: queue.SimpleQueue[ConnEvent] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the port sets (set_ports runs on other threads)
        self._scan_lock = threading.Lock()  # one scan at a time: the poller's or a caller's
        self._baseline_ports: set[int] = set(self._ports)  # seen sockets are history, not events
        self._seen: dict[SocketKey, _Seen] = {}
        self._last_scan_ns: int | None = None
        self._snapshot_ns = 0  # when the latest snapshot's dump ended (wall clock)
        self._listed_at = -1e9  # monotonic start of the latest scan made for a listing (``clients``)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read_errors = 0
        self._diag: SockDiag | None = None
        self._accepts: TcpAccepts | None = None
        self._notices: DestroyNotices | None = None
        self._whole_scans: deque[tuple[int, int]] = deque(maxlen=WHOLE_SCANS_KEPT)
        self._held: dict[int, None] = {}  # kernel cookies, oldest first (see HELD_MAX)
        self._early: dict[int, Freed] = {}  # notices of sockets the snapshot before them still listed
        self._overflows = 0  # those of notices closed since (``lost_events``)
        self._notices_read_at = 0.0  # monotonic
        self._accepts_at_dump: int | None = None  # read just before the last full dump
        # The sockets of each port the latest listing (``clients``) named, and the ports on which a
        # connection freed unseen since it began (``_unseen``): what ``listing_complete`` compares.
        self._listed_keys: dict[int, set[SocketKey]] = {}
        self._unseen_on: set[int] = set()
        self._dumped_ports: frozenset[int] = frozenset()
        # The daemon's own connections to watched ports, by (its address, its port, server port): left out.
        self._own_open: frozenset[OwnEnd] = frozenset()
        self._own_closed: dict[OwnEnd, float] = {}  # -> monotonic time it stops being left out at the latest
        self._own: frozenset[OwnEnd] = frozenset()  # both of the above
        if sock_diag if sock_diag is not None else proc_root == Path("/proc"):
            try:
                self._diag = SockDiag()
                self._accepts = TcpAccepts()
            except OSError as exc:
                if sock_diag:
                    raise
                log.warning("netlink sock_diag unavailable (%s); parsing /proc/net/tcp instead", exc)
            else:
                try:
                    self._notices = DestroyNotices()
                    self._notices.set_ports(self._ports)
                except OSError as exc:
                    log.warning("the kernel's notices of freed sockets are unavailable (%s): a connection that "
                                "opens and closes between two polls is not seen", exc)

    @property
    def notices(self) -> DestroyNotices | None:
        """The kernel's notices of freed sockets, where it gives them (``DestroyNotices``)."""
        return self._notices

    @property
    def reader(self) -> str:
        """Where snapshots come from: ``sock_diag`` or ``/proc/net/tcp``."""
        return "sock_diag" if self._diag is not None else "/proc/net/tcp"

    def start(self) -> None:
        if self._thread is not None:
            return
        self.scan()  # the baseline, taken before start() returns
        self._thread = threading.Thread(target=self._run, name="procfs-conn-poller", daemon=True)
        self._thread.start()

    def set_ports(self, ports: Iterable[int]) -> None:
        new_ports = validate_ports(ports)
        with self._lock:
            self._baseline_ports |= new_ports - self._ports
            self._ports = new_ports
            notices = self._notices
        if notices is not None:  # from now on, not from the next poll: a socket freed before it is no news
            with contextlib.suppress(OSError):  # closed meanwhile: the poller reads /proc/net/tcp now
                notices.set_ports(new_ports)

    def set_own_endpoints(self, endpoints: Iterable[OwnEnd]) -> None:
        """Leave out the server ends of this process's own connections (the daemon's scrapes of its
        engines), each named by ``OwnEnd`` (its local address and port, the server's port and
        address: another pod's client on the same local port is someone else). Without
        them an idle engine's port lists nothing, and its poll costs a counter read, not also a
        lookup of the scrape's socket.

        One that closed stays out until a full snapshot no longer lists its server end, or for
        OWN_LINGER_S at most: a client of another port, or a later one of the same port on the
        same local port (loopback reuses a TIME_WAIT pair at once), is watched as any other."""
        # A dual-stack (IPv6) listener's end of an IPv4 connection names both addresses v4-mapped.
        endpoints = frozenset(endpoints)
        endpoints |= {(f"::ffff:{address}", port, server_port, f"::ffff:{server}")
                      for address, port, server_port, server in endpoints if ":" not in address}
        until = time.monotonic() + OWN_LINGER_S
        with self._lock:
            for closed in self._own_open - endpoints:
                self._own_closed[closed] = until
            for endpoint in endpoints:
                self._own_closed.pop(endpoint, None)
            self._own_open = endpoints
            self._own = endpoints | frozenset(self._own_closed)

    def _own_now(self) -> frozenset[OwnEnd]:
        """The endpoints left out now (under ``_lock``): those that closed long enough ago are not."""
        if self._own_closed:
            now = time.monotonic()
            expired = [endpoint for endpoint, until in self._own_closed.items() if until <= now]
            if expired:
                for endpoint in expired:
                    del self._own_closed[endpoint]
                self._own = self._own_open | frozenset(self._own_closed)
        return self._own

    def poll(self, timeout_s: float = 0.1) -> list[ConnEvent]:
        events: list[ConnEvent] = []
        try:
            events.append(self._queue.get(timeout=max(timeout_s, 0.0)) if timeout_s > 0
                          else self._queue.get_nowait())
        except queue.Empty:
            return events
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                return events

    def clients(self, ports: Iterable[int]) -> dict[int, tuple[ListedClient, ...]] | None:
        """The clients connected to each of ``ports`` now (``EngineLoad.connections``): address, port,
        when data from each last came in (wall-clock ns: tcp_info's last_data_recv, the kernel's
        receipt), and the server socket's address; a client kept alive between requests
        (``SockDiag.idle``) is left out: it holds no request. A port served in another network
        namespace (a container's engine) lists its clients there from that namespace's table, with
        READ_UNKNOWN for their last data (the table has no tcp_info), where that namespace's count
        of accepted connections can be read (``accepted`` adds it). A poll made at once, its dump asking each
        socket's tcp_info, that stands for the poller's next: the poller's ticks follow on a whole
        interval after it. So the engine scraper's listings cost no walk of the established hash
        beside the polls'. Not read from a poll made a moment before: a client that left since would
        be listed, and its request, still in the engine's gauges at the scrape, not counted an
        orphan there. None without sock_diag (or before ``start``); ports not watched are left out."""
        with self._scan_lock:
            if self._diag is None or self._last_scan_ns is None:
                return None
            self._listed_at = time.monotonic()
            self._unseen_on = set()
            self._scan(listing=True)
            diag, now = self._diag, self._snapshot_ns
            if diag is None:  # the dump failed: /proc/net/tcp from now on, which has no tcp_info
                return None
            # A port also served in another namespace whose accepts cannot be counted: a client
            # accepted there after the listing would go unnoticed, and its request read as an orphan.
            unsure = {port for port, namespaces in self._foreign.items()
                      if any(self._foreign_accepted(namespace) is None for namespace in namespaces)}
            wanted = set(ports) & self._dumped_ports - unsure
            self._listed_keys = {port: {key for key in self._seen if key[2] == port} for port in wanted}
            found: dict[int, list[ListedClient]] = {port: [] for port in wanted}
            for (_family, local, port, peer, peer_port), seen in self._seen.items():
                if port not in wanted or seen.state != TCP_ESTABLISHED:
                    continue
                if seen.namespace:
                    found[port].append((peer, peer_port, READ_UNKNOWN, local))
                elif not diag.idle(seen.freed_as):
                    last_ms = diag.last_data_recv(seen.freed_as) or 0
                    found[port].append((peer, peer_port, now - last_ms * 1_000_000, local))
        return {port: tuple(clients) for port, clients in found.items()}

    def accepted(self) -> int | None:
        """Connections this network namespace accepted so far, every port (``TcpAccepts``), and each
        other namespace serving a watched port whose count can be read (their clients are listed
        too); None when this one's cannot be read. Unchanged around a listing of ``clients``: none
        is missing from it."""
        with self._scan_lock:
            own = self._accepts.read() if self._accepts is not None else None
            if own is None:
                return None
            namespaces = {namespace.ident: namespace for found in self._foreign.values() for namespace in found}
            return own + sum(self._foreign_accepted(namespace) or 0 for namespace in namespaces.values())

    def listing_complete(self, port: int) -> bool | None:
        """Whether no client of ``port`` can be missing from the latest listing (``clients``), asked
        once ``accepted`` moved (a connection accepted on some port since the listing). A poll made
        at once, that stands for the poller's next: the listing is complete if it finds no socket
        on the port that the listing lacked, and no connection on the port was freed unseen since
        the listing began (one that opened and closed in between, told by the kernel's notices).
        None where it cannot tell (no sock_diag, no notices, or notices lost; a port served in
        another namespace, whose connections the kernel's notices do not tell): the namespaces'
        count decides, as without this."""
        with self._scan_lock:
            listed = self._listed_keys.get(port)
            notices = self._notices
            if listed is None or self._diag is None or notices is None or port in self._foreign:
                return None
            lost = notices.overflows
            self._listed_at = time.monotonic()
            self._scan()
            if self._diag is None or self._notices is not notices or notices.overflows != lost:
                return None
            return port not in self._unseen_on and all(key in listed for key in self._seen if key[2] == port)

    def other_namespaces(self) -> dict[int, list[Namespace]]:
        """Port -> the other network namespaces found listening on it at the latest look."""
        return dict(self._foreign)

    def server_pids(self) -> dict[int, int]:
        """Nothing: a poll sees sockets, not which process closed them (the eBPF probe does)."""
        return {}

    def server_pids_at(self) -> dict[int, dict[str, int]]:
        """Nothing, as ``server_pids``."""
        return {}

    def lost_events(self) -> int:
        """Times the kernel dropped notices of freed sockets (their buffer was full between two
        polls): at least one connection each may have gone unseen. Nothing else is dropped once
        seen; what happens between polls without the notices is invisible, not countable."""
        notices = self._notices
        return self._overflows + (notices.overflows if notices is not None else 0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._scan_lock:
            if self._diag is not None:
                self._diag.close()
                self._diag = None
            self._close_notices()
            if self._accepts is not None:
                self._accepts.close()
            for accepts in self._foreign_accepts.values():
                if accepts is not None:
                    accepts.close()
            self._foreign_accepts = {}

    # -- scanning ---------------------------------------------------------------------------
    def _run(self) -> None:
        # Drift-free: ticks are fixed on the monotonic clock; a slow scan skips ticks, not drifts.
        # A listing's scan (``clients``) is a poll too: the next tick is a whole interval after it,
        # and the ticks after that one follow on from it.
        # A plain sleep, not a wait on the stop event: twenty wake-ups a second, idle or not, and
        # one from time.sleep costs less (92 against 128 us at 50 ms here, bench/wakeup_cost.py).
        # A stop is seen within a tick, or STOP_CHECK_S at slow rates.
        tick = time.monotonic() + self.interval_s
        while True:
            while (remaining := (tick := max(tick, self._listed_at + self.interval_s)) - time.monotonic()) > 0:
                if self._stop.is_set():
                    return
                time.sleep(min(remaining, STOP_CHECK_S))
            if self._stop.is_set():
                return
            try:
                self.scan()
            except Exception:  # one bad scan must not end the poller
                log.exception("scanning /proc/net/tcp failed; trying again next tick")
            now = time.monotonic()
            tick += self.interval_s
            if tick < now:
                tick = now + self.interval_s - ((now - tick) % self.interval_s)

    def scan(self) -> list[ConnEvent]:
        """Take one snapshot, queue and return the events since the previous one."""
        with self._scan_lock:
            return self._scan()

    def _scan(self, listing: bool = False) -> list[ConnEvent]:
        with self._lock:
            ports = self._ports
        if self._netns is not None and (ports != self._netns_ports
                                        or time.monotonic() >= self._netns_at + NETNS_REFRESH_S):
            self._look_for_namespaces(ports)
        with self._lock:
            baseline_ports, self._baseline_ports = self._baseline_ports, set()
            own = self._own_now()
        scan_started_ns = time.time_ns()
        current, whole = self._snapshot(ports, listing)
        self._snapshot_ns = time.time_ns()
        if own:
            if whole and self._own_closed:
                self._forget_own_gone(current)
            others = {key: seen for key, seen in current.items() if _own_end(key) not in own}
            if self._notices is not None and len(others) < len(current):
                for key in current.keys() - others.keys():  # their free is no connection unseen
                    if current[key].freed_as:
                        self._hold(current[key].freed_as)
            current = others
        scan_ns = time.time_ns()
        if whole and self._diag is not None:
            self._whole_scans.append((scan_started_ns, scan_ns))
        freed = self._take_notices(current, quiet=not whole and not current and not self._seen)
        # The change happened after the previous snapshot began and before this one ended.
        earliest_ns = self._last_scan_ns if self._last_scan_ns is not None else scan_ns
        events: list[ConnEvent] = []
        for key, now in current.items():
            before = self._seen.get(key)
            if before is None:
                if key[2] in baseline_ports or self._last_scan_ns is None:
                    continue
                transition = ("new", _phase(now.state))
            else:
                if now.cookie is None:
                    now.cookie = before.cookie
                transition = (_phase(before.state), _phase(now.state))
            events += self._events(key, transition, now.cookie, earliest_ns, scan_ns)
        for key, before in self._seen.items():
            if key not in current and key[2] in ports and _own_end(key) not in own:
                after = self._vanished(key, before)
                if _phase(after) == "open":
                    current[key] = before  # came back between the dump and the lookup
                    continue
                first, last = earliest_ns, scan_ns
                notice = freed.pop(before.freed_as, None) if before.freed_as else None
                if notice is not None:
                    first, last = max(first, _left_after(notice)), min(last, notice.by_ns)
                elif before.freed_as:
                    self._hold(before.freed_as)
                phase = _phase(after) if after is not None else _gone(notice)
                events += self._events(key, (_phase(before.state), phase), before.cookie, first, last)
        if freed:
            events += self._unseen(freed, own)
        self._seen = current
        self._last_scan_ns = scan_started_ns
        for event in events:
            self._queue.put(event)
        return events

    def _look_for_namespaces(self, ports: frozenset[int]) -> None:
        """Find the other namespaces listening on the ports. A socket listed in one found anew (a
        container started since the last look, or a port watched since) is the baseline there: no
        event, as for a port newly watched."""
        assert self._netns is not None
        fresh = ports != self._netns_ports  # ports just watched: look at the processes as they are now
        self._netns_at, self._netns_ports = time.monotonic(), ports
        try:
            found = self._netns.refresh(ports, fresh=fresh)
        except OSError as exc:  # /proc unreadable: keep what was found before
            log.warning("looking for servers in other network namespaces failed (%s)", exc)
            return
        known = {(port, namespace.ident) for port, namespaces in self._foreign.items() for namespace in namespaces}
        new = {port for port, namespaces in found.items() for namespace in namespaces
               if (port, namespace.ident) not in known}
        for port in sorted(new):
            log.info("port %d is listened on in another network namespace (a container's; read through "
                     "/proc/%d/net)", port, found[port][0].pid)
        for port in sorted(self._foreign.keys() - found.keys()):
            log.info("port %d: no longer listened on in another network namespace", port)
        self._foreign = found
        idents = {namespace.ident for namespaces in found.values() for namespace in namespaces}
        # A namespace that listens no more (its container stopped) took its connections with it:
        # they ended with their server, not with their clients, so they leave no event.
        gone = {key for key, seen in self._seen.items() if seen.namespace and seen.namespace not in idents}
        for key in gone:
            del self._seen[key]
        for ident in self._foreign_accepts.keys() - idents:
            accepts = self._foreign_accepts.pop(ident)
            self._foreign_read.pop(ident, None)
            if accepts is not None:
                accepts.close()
        if new:
            with self._lock:
                self._baseline_ports |= new

    # -- the kernel's notices of freed sockets ------------------------------------------------
    def _take_notices(self, current: dict[SocketKey, _Seen], quiet: bool) -> dict[int, Freed]:
        """The notices since the last scan (and those held back by it), by the socket's cookie, less
        those of sockets that closed before and were held since (``_hold``). A notice of a socket
        this snapshot still lists (freed just after it) is held back for the next scan's. A
        ``quiet`` scan reads them at most every QUIET_NOTICES_EVERY_S."""
        if self._notices is None:
            return {}
        now = time.monotonic()
        if quiet and not self._early and now < self._notices_read_at + QUIET_NOTICES_EVERY_S:
            return {}
        self._notices_read_at = now
        try:
            taken = self._notices.take()
        except OSError as exc:
            log.warning("reading the kernel's notices of freed sockets failed (%s); polling alone from now "
                        "on: a connection that opens and closes between two polls is not seen", exc)
            self._close_notices()
            return {}
        freed, self._early = self._early, {}
        for notice in taken:
            if notice.cookie in self._held:  # a socket that closed before, freed now that its server let it go
                del self._held[notice.cookie]
                continue
            freed[notice.cookie] = notice
        if freed:
            listed = {seen.freed_as for seen in current.values()}
            for cookie in [cookie for cookie in freed if cookie in listed]:
                self._early[cookie] = freed.pop(cookie)
        return freed

    def _hold(self, cookie: int) -> None:
        """A socket whose free, when its notice comes, is not a connection unseen: one that left the
        listing with no notice yet (its server still holds it), or one of the daemon's own."""
        self._held.pop(cookie, None)  # the newest last: the oldest is forgotten first
        self._held[cookie] = None
        if len(self._held) > HELD_MAX:
            del self._held[next(iter(self._held))]

    def _unseen(self, freed: dict[int, Freed], own: frozenset[OwnEnd]) -> list[ConnEvent]:
        """The connections freed that no snapshot listed: each opened and its client left between two.

        Its client left after its last data (``_left_after``) and before the notice was read; and
        before the end of the first full snapshot that began once that data had come, which would
        have listed the connection still open (or its server end in CLOSE_WAIT) had the client not
        left yet. A reset, or FINs both ways (the notice tells which), unless its server end is in
        TIME_WAIT (the server closed first). A port's notices are kept from when it is watched
        (``set_ports``), not from its first poll: a connection freed in between is one too."""
        events: list[ConnEvent] = []
        for notice in freed.values():
            key = notice.key
            if _own_end(key) in own:
                continue
            self._unseen_on.add(key[2])
            data_by_ns = notice.by_ns - notice.last_data_recv_ms * 1_000_000 + JIFFY_NS
            last = min(notice.by_ns, self._listed_by(data_by_ns))
            # Only FINs both ways leave a TIME_WAIT to ask about (a lookup): which side was first.
            server_first = notice.fin_acked is not False and self._state_of(key) == TCP_TIME_WAIT
            events += self._events(key, ("new", "done" if server_first else _gone(notice)),
                                   notice.inode or None, min(_left_after(notice), last), last)
        return events

    def _listed_by(self, since_ns: int) -> int:
        """The end of the first full snapshot kept that began at or after ``since_ns`` (from the
        newest back: ``since_ns`` is most often within the last few)."""
        found = 1 << 63
        for started_ns, ended_ns in reversed(self._whole_scans):
            if started_ns < since_ns:
                break
            found = ended_ns
        return found

    def _close_notices(self) -> None:
        if self._notices is not None:
            self._overflows += self._notices.overflows
            self._notices.close()
            self._notices = None
        self._held, self._early = {}, {}

    def _forget_own_gone(self, listed: dict[SocketKey, _Seen]) -> None:
        """Stop leaving out the closed own connections whose server end a whole snapshot no longer
        lists: the next socket on that address pair is someone else's."""
        present = {_own_end(key) for key in listed}
        with self._lock:
            gone = [end for end in self._own_closed if end not in present]
            if gone:
                for end in gone:
                    del self._own_closed[end]
                self._own = self._own_open | frozenset(self._own_closed)

    def _vanished(self, key: SocketKey, before: _Seen) -> int | None:
        """The state of a socket missing from this snapshot: None (gone) from /proc/net/tcp, which
        lists every state. A sock_diag dump leaves out TIME_WAIT and CLOSE, so an open socket that
        left it is asked about alone: TIME_WAIT means both sides closed (not a reset)."""
        return self._state_of(key) if before.state in OPEN and not before.namespace else None

    def _state_of(self, key: SocketKey) -> int | None:
        """The state of the one socket ``key`` names, asked of sock_diag; None when there is none,
        or no sock_diag to ask."""
        if self._diag is None:
            return None
        try:
            return self._diag.state_of(key)
        except OSError:
            return None  # the next snapshot falls back to /proc/net/tcp if netlink broke

    def _diag_entries(self, ports: frozenset[int], listing: bool) -> tuple[list[DiagEntry], bool]:
        """A dump, or, when no TCP connection was accepted since the last one, a lookup of each
        socket it listed: an idle port costs a counter read instead of a walk of the whole
        established hash (about 1 ms here, most of the fallback's idle CPU). A ``listing`` always
        dumps, asking each socket's tcp_info. True with a dump."""
        assert self._diag is not None
        accepts = self._accepts.read() if self._accepts is not None else None
        if not listing and accepts is not None and accepts == self._accepts_at_dump and ports == self._dumped_ports:
            own = {key: seen for key, seen in self._seen.items() if not seen.namespace} if self._foreign else self._seen
            if len(own) <= LOOKUPS_INSTEAD_OF_DUMP:
                return self._diag.still_listed(own), False
        self._accepts_at_dump, self._dumped_ports = accepts, ports
        return list(self._diag.sockets(ports, info=listing)), True

    def _snapshot(self, ports: frozenset[int], listing: bool = False) -> tuple[dict[SocketKey, _Seen], bool]:
        """The sockets on the ports, and whether that is every one of them (not only those looked up)."""
        current, whole = self._own_snapshot(ports, listing)
        for namespace, namespace_ports in self._foreign_namespaces(ports):
            accepted = self._foreign_accepted(namespace)
            before = self._foreign_read.get(namespace.ident)
            if accepted is not None and before is not None and before == (accepted, 0):
                continue  # listed nothing, accepted nothing since: nothing to list
            try:
                read = {key: seen for version, path in namespace.tables(self._proc_root)
                        for key, seen in parse_proc_net_tcp(path.read_text(), version, namespace_ports).items()}
            except OSError:
                # The process it was read through ended: its sockets as they were, and a look at
                # once for another process there, or for the namespace gone (its sockets with it).
                self._netns_at = -1e9
                for key, seen in self._seen.items():
                    if seen.namespace == namespace.ident:
                        current.setdefault(key, seen)
                continue
            for key, seen in read.items():
                seen.namespace = namespace.ident
                current.setdefault(key, seen)
            self._foreign_read[namespace.ident] = (accepted, len(read))
        return current, whole

    def _foreign_namespaces(self, ports: frozenset[int]) -> list[tuple[Namespace, frozenset[int]]]:
        """Each other namespace listening on a watched port, with those ports."""
        found: dict[Namespace, set[int]] = {}
        for port, namespaces in self._foreign.items():
            if port in ports:
                for namespace in namespaces:
                    found.setdefault(namespace, set()).add(port)
        return [(namespace, frozenset(found_ports)) for namespace, found_ports in found.items()]

    def _foreign_accepted(self, namespace: Namespace) -> int | None:
        """The connections the namespace accepted so far (its PassiveOpens), None where unreadable.
        Its counters file is kept open: it stays that namespace's after the process ends."""
        if namespace.ident not in self._foreign_accepts:
            try:
                self._foreign_accepts[namespace.ident] = TcpAccepts(str(namespace.snmp(self._proc_root)))
            except OSError:
                self._foreign_accepts[namespace.ident] = None
        accepts = self._foreign_accepts[namespace.ident]
        return accepts.read() if accepts is not None else None

    def _own_snapshot(self, ports: frozenset[int], listing: bool) -> tuple[dict[SocketKey, _Seen], bool]:
        """The sockets on the ports in the daemon's own network namespace (see ``_snapshot``)."""
        if self._diag is not None:
            try:
                entries, whole = self._diag_entries(ports, listing)
                return {key: _Seen(state, inode or None, cookie) for key, state, inode, cookie in entries}, whole
            except OSError as exc:
                log.warning("sock_diag failed (%s); parsing /proc/net/tcp from now on", exc)
                self._diag.close()
                self._diag = None
                self._close_notices()  # no snapshot names its sockets' cookies any more
        current: dict[SocketKey, _Seen] = {}
        whole = True
        for family, path in self._tables:
            try:
                text = path.read_text()
            except OSError as exc:
                if self._read_errors == 0:
                    log.warning("cannot read %s (%s); its sockets are not watched", path, exc)
                self._read_errors += 1
                whole = False
                continue
            current.update(parse_proc_net_tcp(text, family, ports))
        return current, whole

    def _events(self, key: SocketKey, transition: tuple[str, str], cookie: int | None,
                earliest_ns: int, ts_ns: int) -> list[ConnEvent]:
        family, server_addr, server_port, client_addr, client_port = key
        return [ConnEvent(ts_ns=ts_ns, kind=kind, family=family, client_addr=client_addr,
                          client_port=client_port, server_addr=server_addr, server_port=server_port,
                          cookie=cookie, host=self._host, source="procfs", earliest_ns=earliest_ns)
                for kind in TRANSITIONS.get(transition, ())]
