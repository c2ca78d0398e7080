"""The eBPF disconnect probe: loads ``disconnect.bpf.c`` and turns its ring buffer into
``ConnEvent`` records.

Three loaders (``default_loader``): the program as bcc compiled it at build time, loaded with
bpf(2) alone (``probes.prebuilt``: no bcc, headers or LLVM on the host, and no compile at start);
where this kernel refuses that, bcc compiles and attaches it in a short-lived child
(``probes.loader``, driven by ``probes.handoff``), so this process keeps descriptors and never
maps LLVM; where that cannot work, bcc runs in-process (``probes.inprocess``). Checks run before
bcc is touched, so a host without root, bcc, tracefs or kernel headers gets a ``ProbeUnavailable``
that says what to do, never a compiler dump. The program text is assembled
once (header inlined, settings as defines) and that exact text is loaded, so ``--dump-bpf`` shows
what runs. The port filter is the ``watched_ports`` map, changed with map updates while attached.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import mmap
import os
import platform
import re
import socket
import time
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from auditor.config import ProbeConfig
from auditor.errors import ConfigError
from auditor.model import ConnEvent, EventRun, ListedClient
from probes import bpfsys, prebuilt, ringbuf
from probes.bpfsys import ProgramRuns
from probes.caps import UNIT_CAPABILITIES, missing_bpf_capabilities
from probes.clock import MonotonicToWall
from probes.decode import EventBuilder, is_stored_layout
from probes.handoff import CLIENT, CLIENT_KEY, SERVER_KEY, LoadedProgram, load_in_child
from probes.inprocess import BccProgram
from probes.sockdiag import IDLE_QUIET_MS, SockDiag, SocketKey
from probes.source import OwnEnd, ProbeUnavailable, validate_ports

log = logging.getLogger(__name__)

PROGRAM_DIR = Path(__file__).resolve().parent
PROGRAM_FILE = PROGRAM_DIR / "disconnect.bpf.c"
HEADER_FILE = PROGRAM_DIR / "disconnect.h"
# The configuration's default (``probe.ring_buffer_mib``, 1 MiB: 16,384 events of headroom) in
# this host's pages, for a source opened without a configuration. The whole ring buffer is mapped
# into the reader and counts in its RSS.
DEFAULT_RINGBUF_PAGES = ProbeConfig().ring_buffer_pages
# Records per CPU between reader wake-ups (see disconnect.bpf.c). Each wake-up costs the reader
# a poll round trip (tens of µs in Python), so fewer is cheaper; the cap keeps the records that
# can sit unsignalled on all CPUs together under a quarter of the ring buffer.
MAX_WAKEUP_EVERY = 1024
RECORD_BYTES = 64  # struct event (56) plus the ring buffer's 8-byte record header
MAX_PORTS = 1024  # the size of the server_pids map in disconnect.bpf.c
# Quiet clients asked of sock_diag one at a time (``_idle_clients``) up to this many; more, in one
# walk of their ports. bench/idle_listing.py: a lookup about 8 us of CPU here, a walk 1.1 ms (it
# grows with the host's established hash: 262,144 buckets here, more on big hosts); 64 lookups
# about half a walk.
IDLE_LOOKUPS_AT_MOST = 64
PROGRAM_CFLAGS = [f"-I{PROGRAM_DIR}"]  # where the program's #include "disconnect.h" is found
TRACEPOINTS = ("sock/inet_sock_set_state", "tcp/tcp_receive_reset", "tcp/tcp_rcv_space_adjust")
TRACEPOINT_NAMES = tuple(tp.replace("/", ":") for tp in TRACEPOINTS)  # category:name, as loaders take them
TRACEFS_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

PID_MAX_LIMIT = 1 << 22  # the kernel's ceiling for pid_max (include/linux/threads.h)
# The clients table's slots (disconnect.bpf.c): 4,096 of 48 bytes, mapped into the reader. Sockets
# whose slot is held go to the hash: with n clients about n / 8,192 of them (at 1,000, one in nine).
CLIENT_SLOT_BITS = 12
ATOMICS_SINCE = (5, 12)  # BPF compare-and-swap; before it, every client goes to the hash


def default_client_slot_bits(release: str | None = None) -> int:
    """CLIENT_SLOT_BITS where the running kernel (``release``, as uname gives it) has BPF atomics;
    0 before, or where the release does not say."""
    found = re.match(r"(\d+)\.(\d+)", release if release is not None else os.uname().release)
    return CLIENT_SLOT_BITS if found and (int(found[1]), int(found[2])) >= ATOMICS_SINCE else 0


def _client_key(family: int, local: str, port: int, peer: str, peer_port: int) -> bytes:
    """``struct client_key`` of a server socket at ``local``:``port`` (``SockDiag`` families: 4 or 6)."""
    kind = socket.AF_INET if family == 4 else socket.AF_INET6
    return CLIENT_KEY.pack(port, peer_port, kind, 0, socket.inet_pton(kind, peer).ljust(16, b"\0"),
                           socket.inet_pton(kind, local).ljust(16, b"\0"))


def _socket_key(key: bytes) -> SocketKey:
    """The sock_diag key of the server socket a ``struct client_key`` names (``_client_key``'s inverse)."""
    port, peer_port, kind, _pad, peer, local = CLIENT_KEY.unpack_from(key)
    size = 4 if kind == socket.AF_INET else 16
    return (4 if kind == socket.AF_INET else 6, socket.inet_ntop(kind, local[:size]), port,
            socket.inet_ntop(kind, peer[:size]), peer_port)


def server_key(key: bytes) -> tuple[int, str | None]:
    """(port, address) of a ``struct server_key``: an IPv4-mapped IPv6 address as the IPv4 one (a
    dual-stack engine's socket), as the namespaces' addresses are named; None for an unknown family."""
    port, family, packed = SERVER_KEY.unpack_from(key)
    return port, server_address(family, packed)


def server_address(family: int, packed: bytes) -> str | None:
    """A server socket's address as the program keeps it (16 bytes, IPv4 in the first four): an
    IPv4-mapped IPv6 address as the IPv4 one; None for an unknown family."""
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, packed[:4])
    if family != socket.AF_INET6:
        return None
    if packed[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return socket.inet_ntop(socket.AF_INET6, packed)


def _is_live_pid(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``pid`` names a process that exists now (as seen from this pid namespace)."""
    return 0 < pid <= PID_MAX_LIMIT and (proc_root / str(pid)).is_dir()


def default_wakeup_every(ringbuf_pages: int, cpus: int | None = None) -> int:
    capacity = ringbuf_pages * mmap.PAGESIZE // RECORD_BYTES
    per_cpu = capacity // (4 * max(1, cpus or os.cpu_count() or 1))
    return max(1, min(MAX_WAKEUP_EVERY, per_cpu))


def program_text(ringbuf_pages: int = DEFAULT_RINGBUF_PAGES,
                 wakeup_every: int | None = None, client_slot_bits: int = 0, *,
                 family_from_socket: bool | None = None) -> str:
    """The program bcc compiles: settings as defines before the source, which #includes the shared
    event header from ``PROGRAM_DIR`` (see ``PROGRAM_CFLAGS``). ``family_from_socket``: the tcp:*
    programs read the socket's family from the socket, not the record (None: where this kernel's
    records lack it, ``tcp_records_lack_family``)."""
    if ringbuf_pages <= 0 or ringbuf_pages & (ringbuf_pages - 1):
        raise ValueError(f"ringbuf_pages must be a power of two, got {ringbuf_pages}")
    if wakeup_every is None:
        wakeup_every = default_wakeup_every(ringbuf_pages)
    if wakeup_every < 1:
        raise ValueError(f"wakeup_every must be at least 1, got {wakeup_every}")
    if not 0 <= client_slot_bits <= 20:
        raise ValueError(f"client_slot_bits must be 0 to 20, got {client_slot_bits}")
    if family_from_socket is None:
        family_from_socket = tcp_records_lack_family()
    source = PROGRAM_FILE.read_text()
    return (f"#define RINGBUF_PAGES {ringbuf_pages}\n#define WAKEUP_EVERY {wakeup_every}\n"
            f"#define CLIENT_SLOT_BITS {client_slot_bits}\n"
            + ("#define FAMILY_FROM_SOCKET 1\n" if family_from_socket else "") + source)


def tcp_records_lack_family(tracefs_roots: Iterable[Path] = TRACEFS_ROOTS) -> bool:
    """Whether this kernel's tcp:* tracepoint records lack the socket's family (5.10's do)."""
    root = next((root for root in tracefs_roots if (root / "events").is_dir()), None)
    if root is None:
        return False
    for tracepoint in prebuilt.FAMILY_TRACEPOINTS:
        try:
            if "family" not in prebuilt.record_fields(root, tracepoint):
                return True
        except OSError:
            continue
    return False


def _bcc_installed() -> bool:
    """Whether bcc can be imported, found without importing it (that maps LLVM)."""
    try:
        return importlib.util.find_spec("bcc") is not None
    except (ImportError, ValueError):
        return False


def bpf_unavailable_reason(*, tracefs_roots: Iterable[Path] = TRACEFS_ROOTS,
                           modules_root: Path = Path("/lib/modules"),
                           kheaders: Path = Path("/sys/kernel/kheaders.tar.xz"),
                           check_bcc: bool = True,
                           caps: int | None = None, euid: int | None = None,
                           compiles: bool = True) -> ProbeUnavailable | None:
    """Why the probe cannot load here (reason and fix), or None when every precondition holds.
    ``compiles``: bcc compiles it here (it needs bcc and kernel headers; the prebuilt probe not).

    Privilege is judged from effective capabilities (``probes.caps``), never the uid, so the unit's
    ``User=auditor`` with ambient capabilities loads the probe (the uid only tells whether tracefs's
    0700 files are this process's own). The same checks, in the same words, as ``auditor doctor``;
    the paths, the capability mask and the uid can be pointed elsewhere.
    """
    missing = missing_bpf_capabilities(caps, euid)
    if missing:
        return ProbeUnavailable(f"eBPF needs {', '.join(missing)} (missing from the effective set)",
                                f"run as root, or grant AmbientCapabilities={UNIT_CAPABILITIES} "
                                "(systemd/auditor.service does); or use --source procfs")
    if compiles and check_bcc and not _bcc_installed():
        return ProbeUnavailable("bcc is not importable",
                                "run `make setup` as root (apt-get install python3-bpfcc)")
    roots = [root for root in tracefs_roots if (root / "events").is_dir()]
    if not roots:
        return ProbeUnavailable("tracefs is not mounted",
                                "run `mount -t tracefs nodev /sys/kernel/tracing` (at boot: `systemctl enable --now "
                                "sys-kernel-tracing.mount`), then restart the daemon")
    for tracepoint in TRACEPOINTS:
        if not any((root / "events" / tracepoint / "format").exists() for root in roots):
            return ProbeUnavailable(f"this kernel has no {tracepoint.replace('/', ':')} tracepoint",
                                    "the probe needs Linux 4.16 or later; use --source procfs")
    build = modules_root / platform.release() / "build"
    if compiles and not (build / "include").is_dir() and not kheaders.exists():
        return ProbeUnavailable(
            f"kernel headers are missing at {build}",
            f"apt-get install linux-headers-{platform.release()} (or link the distribution's "
            "headers there as build and source, see docs/probe.md)")
    return None


def _checked_ports(ports: Iterable[int]) -> frozenset[int]:
    checked = validate_ports(ports)
    if len(checked) > MAX_PORTS:
        raise ConfigError(f"{len(checked)} ports to watch; the probe takes at most {MAX_PORTS}")
    return checked


LOADERS = ("prebuilt", "child", "inprocess")


def default_loader() -> str:
    """``prebuilt`` (bcc's compile kept at build time, ``probes.prebuilt``) where this machine can
    read the ring buffer and issue bpf(2) itself and the object is there; the source falls back to
    ``compiling_loader`` where this kernel refuses it."""
    return "prebuilt" if prebuilt.PREBUILT_FILE.is_file() and bpfsys.supported() and ringbuf.supported() \
        else compiling_loader()


def compiling_loader() -> str:
    """``child`` (compile in a short-lived process, keep descriptors) where this machine can read
    the ring buffer and issue bpf(2) itself; else ``inprocess`` (bcc stays loaded)."""
    return "child" if ringbuf.supported() and bpfsys.supported() else "inprocess"


def load_prebuilt(ringbuf_pages: int = DEFAULT_RINGBUF_PAGES, wakeup_every: int | None = None,
                  client_slot_bits: int | None = None) -> LoadedProgram:
    """The prebuilt probe loaded and attached with these settings (the daemon's defaults where None);
    ProbeUnavailable with the reason where it cannot be."""
    root = next((root for root in TRACEFS_ROOTS if (root / "events").is_dir()), None)
    if root is None:
        raise ProbeUnavailable("tracefs is not mounted", "run `mount -t tracefs nodev /sys/kernel/tracing` (at boot: `systemctl enable --now "
                                "sys-kernel-tracing.mount`), then restart the daemon")
    return prebuilt.load(
        ringbuf_bytes=ringbuf_pages * mmap.PAGESIZE, tracepoints=TRACEPOINT_NAMES, tracefs=root,
        wakeup_every=default_wakeup_every(ringbuf_pages) if wakeup_every is None else wakeup_every,
        client_slot_bits=default_client_slot_bits() if client_slot_bits is None else client_slot_bits)


class BpfConnEventSource:
    """Kernel connection events from the eBPF probe. Loading happens here (about 0.1 s prebuilt, a
    second of CPU compiled)."""

    name = "bpf"
    # ``clients`` reads the program's table (about 50 us), no walk of the kernel's sockets: the
    # engine scraper may list them with every scrape of a busy engine.
    listing_is_cheap = True
    # The kernel wakes the reader for a client's leaving (at most once in DEPARTURE_WAKEUP_NS,
    # disconnect.bpf.c), not only for a full batch.
    wakes_on_departure = True

    def __init__(self, ports: Iterable[int] = (), *, host: str = "",
                 ringbuf_pages: int = DEFAULT_RINGBUF_PAGES,
                 wakeup_every: int | None = None,
                 clock: MonotonicToWall | None = None,
                 mapped_reader: bool | None = None,
                 loader: str | None = None,
                 client_slot_bits: int | None = None) -> None:
        self._ports = _checked_ports(ports)
        self._host = host
        self._clock = clock or MonotonicToWall()
        self._raw: list[bytes] = []
        self._started = False
        self._stopped = False
        self._malformed = 0
        self._lost_at_stop = 0
        self._build = EventBuilder()
        self._client_keys: dict[bytes, tuple[int, str, int, str]] = {}  # key -> (port, address, its port, server's)
        self._idle_diag: SockDiag | bool | None = None  # for ``_idle_clients``; False: the kernel refused it
        self._backlog = False
        self.client_slot_bits = default_client_slot_bits() if client_slot_bits is None else client_slot_bits
        # bcc's per-record callback reader needs bcc in this process.
        self.loader = loader or ("inprocess" if mapped_reader is False else default_loader())
        if self.loader not in LOADERS:
            raise ConfigError(f"BPF loader {self.loader!r} is unknown; use one of {', '.join(LOADERS)}")
        if self.loader != "inprocess" and mapped_reader is False:
            raise ConfigError(f"the {self.loader} loader leaves only the mapped ring buffer to read; "
                              "mapped_reader=False needs loader='inprocess'")
        self._program: LoadedProgram | BccProgram
        # Why the prebuilt probe did not load, where the source compiled it instead.
        self.prebuilt_refused: str | None = None
        if self.loader == "prebuilt":
            problem = bpf_unavailable_reason(compiles=False)
            if problem is not None:
                raise problem
            try:
                self._program = load_prebuilt(ringbuf_pages, wakeup_every, self.client_slot_bits)
            except ProbeUnavailable as exc:
                if loader is not None:  # asked for by name: no other
                    raise
                log.warning("the prebuilt probe cannot load here (%s); compiling it with bcc instead", exc.reason)
                self.prebuilt_refused, self.loader = exc.reason, compiling_loader()
        if self.loader != "prebuilt":
            problem = bpf_unavailable_reason()
            if problem is not None:
                if self.prebuilt_refused:
                    raise ProbeUnavailable(f"{self.prebuilt_refused}; and to compile it, {problem.reason}",
                                           problem.fix)
                raise problem
        if self.loader == "child":
            self._program = load_in_child(
                program_text(ringbuf_pages, wakeup_every, self.client_slot_bits), PROGRAM_CFLAGS, ringbuf_bytes=ringbuf_pages * mmap.PAGESIZE,
                tracepoints=TRACEPOINT_NAMES,
                client_slot_bits=self.client_slot_bits)
        elif self.loader == "inprocess":
            self._program = BccProgram(program_text(ringbuf_pages, wakeup_every, self.client_slot_bits),
                                       PROGRAM_CFLAGS, self.client_slot_bits)
        log.info("eBPF probe loaded by the %s loader", self.loader)
        self._unpack = self._program.record
        self._mapped: ringbuf.MappedRingBuffer | None = None
        # Batch reads of the mapped ring (default where sound), else bcc's callback per record.
        # Descriptors alone offer only the mapped read.
        self._use_mapped = self.loader in ("child", "prebuilt") or (
            ringbuf.supported() if mapped_reader is None else mapped_reader)
        self._reads_runs = self._use_mapped and is_stored_layout(self._unpack)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Open the ring buffer and arm the port filter; events flow from here on."""
        if self._started:
            return
        program = self._program
        if self._use_mapped:
            self._mapped = ringbuf.MappedRingBuffer(program.events_fd, program.ringbuf_bytes,
                                                    self._unpack)
        else:
            assert isinstance(program, BccProgram)
            program.open_callbacks(self._on_event)
        self._apply_ports(self._ports, frozenset())
        self._started = True

    def set_ports(self, ports: Iterable[int]) -> None:
        """Replace the watched ports; takes effect at once, without reloading the program."""
        new_ports = _checked_ports(ports)
        if self._started and not self._stopped:
            self._apply_ports(new_ports, self._ports)
        self._ports = new_ports

    def set_own_endpoints(self, endpoints: Iterable[OwnEnd]) -> None:
        """Kept: the kernel reports the daemon's own connections at no cost to it, and their closes
        are idle closes to the correlator (the /proc poller leaves them out to save its lookups)."""

    @property
    def ports(self) -> frozenset[int]:
        return self._ports

    def stop(self) -> None:
        """Detach the tracepoints and free the maps; lost_events() keeps its last value."""
        if self._stopped:
            return
        self._lost_at_stop = self._read_lost()
        self._stopped = True
        if isinstance(self._idle_diag, SockDiag):
            self._idle_diag.close()
        if self._mapped is not None:
            self._mapped.close()
        try:
            self._program.close()
        except Exception:  # cleanup is best effort on the way out
            log.exception("detaching the BPF program failed")

    # -- events -----------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.1) -> list[ConnEvent]:
        """Events queued by the kernel, waiting up to ``timeout_s`` for a batch to build up.

        Returns early when the kernel signals a full batch; otherwise after ``timeout_s`` with
        whatever arrived, so a lone event is delivered within one call.
        """
        if not self._started or self._stopped:
            return []
        mapped = self._mapped
        if mapped is None:
            assert isinstance(self._program, BccProgram)
            self._program.poll(max(0, int(timeout_s * 1000)))
            raw, self._raw = self._raw, []
            return self._decode(self._unpack_raw(raw))
        if not self._backlog:
            mapped.wait(timeout_s)
        records = mapped.read()
        # A read is bounded: what it left waits for the next poll, which then does not sleep.
        self._backlog = mapped.pending_bytes() > 0 and len(records) >= ringbuf.MAX_BATCH_RECORDS
        return self._decode(records)

    @property
    def reads_runs(self) -> bool:
        """Whether ``poll_runs`` works here: the mapped reader, and bcc's record is the layout the
        store keeps (``auditor.kernelrecord.RECORD``) on a little-endian machine."""
        return self._reads_runs

    def poll_runs(self, timeout_s: float = 0.1) -> list[EventRun]:
        """``poll``, undecoded: the records as the ring buffer held them, for the store to keep
        as they are (the daemon's path; see ``reads_runs``). Waits as ``poll`` does."""
        if not self._started or self._stopped or not self.reads_runs:
            return []
        mapped = self._mapped
        assert mapped is not None
        if not self._backlog:
            mapped.wait(timeout_s)
        runs = mapped.read_runs()
        stride = mapped.stride
        count = sum(len(run) for run in runs) // stride
        self._backlog = mapped.pending_bytes() > 0 and count >= ringbuf.MAX_BATCH_RECORDS
        if not runs:
            return []
        self._clock.maybe_recalibrate()
        offset, found = self._clock.offset_ns, []
        for run in runs:
            words = array("Q")
            words.frombytes(run)
            times = words[1::stride // 8]  # ts_ns, just past each record's 8-byte header
            found.append(EventRun(run, len(run) // stride, stride, offset, min(times) + offset,
                                  max(times) + offset, self._host, "bpf"))
        return found

    def server_pids(self) -> dict[int, int]:
        """Watched port -> the process last seen closing one of its connections itself (its
        close() or shutdown(): see disconnect.bpf.c), for ports where one has; where it was seen
        at several local addresses, the one at the lowest (one engine reached at several is one
        process; several containers serving the port are told apart by ``server_pids_at``)."""
        return {port: by_address[min(by_address)] for port, by_address in self.server_pids_at().items()}

    def server_pids_at(self) -> dict[int, dict[str, int]]:
        """Watched port -> its local address (a container's, where several serve the port) -> the
        process last seen closing a connection there itself. The kernel's value is checked: one
        that names no live process (it exited, or it is not a pid) is left out."""
        if not self._started or self._stopped:
            return {}
        try:
            entries = self._program.server_pids()
        except Exception:  # an unreadable map names nobody; the events still flow
            log.debug("reading the server pids failed", exc_info=True)
            return {}
        found: dict[int, dict[str, int]] = {}
        for key, pid in sorted(entries.items()):
            port, address = server_key(key)
            if port in self._ports and address is not None and _is_live_pid(pid):
                found.setdefault(port, {})[address] = pid
        return found

    def clients(self, ports: Iterable[int]) -> dict[int, tuple[ListedClient, ...]] | None:
        """The clients connected to each of ``ports`` now (``EngineLoad.connections``): address,
        port, when the server last read data from each (wall-clock ns), and the server socket's
        address, from the program's ``clients`` map; None when it cannot be read. A client kept
        alive between requests is left out (``_idle_clients``)."""
        if not self._started or self._stopped:
            return None
        try:
            values = self._program.clients()
        except Exception:  # an unreadable map: the caller lists the clients otherwise
            log.debug("reading the clients map failed", exc_info=True)
            return None
        wanted = set(ports)
        offset = self._clock.offset_ns
        found: dict[int, list[ListedClient]] = {port: [] for port in wanted}
        decoded = self._client_keys
        if len(decoded) > len(values) * 4 + 1024:  # keys of clients long gone
            decoded.clear()
        quiet_since = time.monotonic_ns() - IDLE_QUIET_MS * 1_000_000  # bpf_ktime_get_ns's clock
        quiet: list[bytes] = []  # clients not read from since: maybe kept alive, idle
        kept: list[tuple[bytes, int, tuple[int, str, int, str]]] = []
        for key, value in values.items():
            client = decoded.get(key)
            if client is None:
                sport, dport, family, _pad, address, server = CLIENT_KEY.unpack_from(key)
                text = socket.inet_ntop(socket.AF_INET, address[:4]) if family == socket.AF_INET \
                    else socket.inet_ntop(socket.AF_INET6, address)
                client = decoded[key] = (sport, text, dport, server_address(family, server) or "")
            if client[0] in wanted:
                last_read = CLIENT.unpack_from(value)[1]
                if last_read <= quiet_since:
                    quiet.append(key)
                kept.append((key, last_read, client))
        idle = self._idle_clients(quiet) if quiet else frozenset()
        for key, last_read, client in kept:
            if key not in idle:
                found[client[0]].append((client[1], client[2], last_read + offset, client[3]))
        return {port: tuple(clients) for port, clients in found.items()}

    def _idle_clients(self, quiet: list[bytes]) -> frozenset[bytes]:
        """Of the ``clients`` keys ``quiet`` (clients not read from for IDLE_QUIET_MS, as an idle one
        was not), those kept alive between requests: answered, and quiet since (``SockDiag.idle``),
        which the program's table cannot tell (it keeps no send time). Asked of sock_diag one socket
        at a time (a hash lookup each) up to IDLE_LOOKUPS_AT_MOST, else in one walk of their ports
        (every bucket of the established hash: about a millisecond at 262,144). Clients in other
        network namespaces are not found here: never idle. Nothing where the kernel refuses it."""
        if self._idle_diag is False:
            return frozenset()
        try:
            if not isinstance(self._idle_diag, SockDiag):
                self._idle_diag = SockDiag()
            if len(quiet) <= IDLE_LOOKUPS_AT_MOST:
                keys = {_socket_key(key): key for key in quiet}
                return frozenset(keys[key] for key in self._idle_diag.idle_of(keys))
            found = self._idle_diag.established(frozenset(CLIENT_KEY.unpack_from(key)[0] for key in quiet))
        except OSError as exc:
            log.info("sock_diag is refused (%s): a client kept alive between requests is taken as holding one", exc)
            self._idle_diag = False
            return frozenset()
        return frozenset(_client_key(*key) for clients in found.values() for key, _last_ms, idle in clients if idle)

    def accepted(self) -> int | None:
        """Clients of the watched ports accepted so far, the program's count; None when it cannot
        be read. Unchanged around a listing of ``clients``: no client is missing from it."""
        if not self._started or self._stopped:
            return None
        try:
            return self._program.accepted()
        except Exception:
            log.debug("reading the accepted count failed", exc_info=True)
            return None

    def lost_events(self) -> int:
        """Events the kernel could not queue (ring buffer full) plus records that did not decode
        here (``poll``; records handed over undecoded by ``poll_runs`` are checked where they are
        read, and a bad one is logged there)."""
        malformed = self._malformed + (self._mapped.malformed if self._mapped else 0)
        if self._stopped:
            return self._lost_at_stop + malformed
        return self._read_lost() + malformed

    def clock_steps(self) -> int:
        """Steps of the wall clock seen since start (``probes.clock``): kernel events stamped just
        before each are off against the spans' times by the step."""
        return self._clock.steps

    def program_runs(self) -> dict[str, ProgramRuns]:
        """Per tracepoint, the kernel's run time and count of the probe's program there: the
        probe's own cost, charged to whichever process hit the tracepoint (an engine, a client),
        never to the daemon. Counted only while ``kernel.bpf_stats_enabled`` is 1 (see
        ``bpfsys.stats_enabled``); empty before start, after stop or when unreadable."""
        if not self._started or self._stopped:
            return {}
        try:
            return self._program.program_runs()
        except (OSError, ValueError):
            log.debug("reading the program's run counts failed", exc_info=True)
            return {}

    # -- internals --------------------------------------------------------------------------
    def _on_event(self, _ctx: Any, data: Any, size: int) -> int:
        # Runs once per event inside ring_buffer_poll: copy the bytes, decode later in bulk.
        self._raw.append(ctypes.string_at(data, size))
        return 0

    def _unpack_raw(self, raw: list[bytes]) -> list[tuple[Any, ...]]:
        """Records copied by the callback, as field tuples; a record of another size is lost."""
        unpack, size = self._unpack.unpack, self._unpack.size
        records = []
        for record in raw:
            if len(record) == size:
                records.append(unpack(record))
            else:
                self._count_malformed(f"record of {len(record)} bytes, expected {size}")
        return records

    def _count_malformed(self, why: object) -> None:
        if self._malformed == 0:
            log.error("dropping a kernel event that does not decode (%s); "
                      "counted as lost from now on", why)
        self._malformed += 1

    def _decode(self, records: list[tuple[Any, ...]]) -> list[ConnEvent]:
        if not records:
            return []
        self._clock.maybe_recalibrate()
        events, bad = self._build(records, self._clock.offset_ns, self._host)
        for record, exc in bad:
            self._count_malformed(f"{exc} in {record!r:.200}")
        return events

    def _apply_ports(self, new: frozenset[int], old: frozenset[int]) -> None:
        for port in new - old:
            self._program.add_port(port)
        for port in old - new:
            self._program.remove_port(port)
        if old - new:  # their clients' closes are no longer seen: their entries would stay
            try:
                self._program.remove_clients({key for key in self._program.clients()
                                              if CLIENT_KEY.unpack_from(key)[0] in old - new})
            except Exception:
                log.debug("forgetting the clients of ports %s failed", sorted(old - new), exc_info=True)
        if new - old:
            self._add_connected(new - old)

    def _add_connected(self, ports: frozenset[int]) -> None:
        """Put the clients already connected to newly watched ports in the ``clients`` table (the
        program adds those it sees accepted from now on), from a sock_diag walk, with tcp_info's
        last_data_recv for their last read. One that closed between the walk and its entry would
        stay listed (its close found no entry to delete): a second walk takes those out."""
        try:
            diag = SockDiag()
        except OSError:
            log.info("the clients already connected to ports %s cannot be listed: the engines' gauges are read "
                     "without them until they reconnect", sorted(ports))
            return
        try:
            def connected() -> dict[bytes, int]:  # key -> ms since the kernel last received data
                return {_client_key(family, local, port, peer, peer_port): last_ms
                        for clients in diag.established(ports).values()
                        for (family, local, port, peer, peer_port), last_ms, _idle in clients}

            now = time.monotonic_ns()  # bpf_ktime_get_ns's clock
            found = connected()
            self._program.add_clients({key: CLIENT.pack(0, now - ms * 1_000_000) for key, ms in found.items()})
            self._program.remove_clients(found.keys() - connected().keys())
        except Exception:  # the table then lacks them: read as without a listing, until they close
            log.debug("adding the connected clients of ports %s failed", sorted(ports), exc_info=True)
        finally:
            diag.close()

    def _read_lost(self) -> int:
        try:
            return self._program.lost()
        except Exception:  # a closed map after stop: the caller keeps the last value
            log.debug("reading the lost-event counter failed", exc_info=True)
            return self._lost_at_stop
