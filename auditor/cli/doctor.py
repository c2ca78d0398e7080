"""``auditor doctor``: what works on this host, and the exact command that fixes what doesn't.

Each check is a small function returning a ``Check``. The daemon can run when the store is
writable and its ports are free; everything else degrades a feature (eBPF -> the /proc fallback,
NVML -> CPU-seconds instead of GPU-seconds) and is listed as such. The JSON form is documented in
docs/doctor.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from auditor.cli.util import common_options
from auditor.config import Config, host_pattern, loopback_only, parse_address
from auditor.errors import AuditorError, ConfigError
from auditor.socktable import TCP_LISTEN, UDP_UNCONNECTED, bound_inodes

SCHEMA = "auditor.cli.doctor/v1"

OK, DEGRADED, FAILED = "ok", "degraded", "failed"

TRACEFS_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
TEST_PROGRAM = r"""
TRACEPOINT_PROBE(sock, inet_sock_set_state) { return 0; }
"""


@dataclass(frozen=True)
class Check:
    name: str
    state: str  # ok | degraded | failed
    detail: str
    fix: str = ""  # the command (or step) that fixes it; empty when ok
    required: bool = False  # a failed required check means the daemon cannot run


def check_privileges() -> Check:
    """Judged by ``probes.caps``, the same function the probe uses: capabilities, not the uid."""
    from probes.caps import missing_bpf_capabilities, present_capabilities

    missing = missing_bpf_capabilities()
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    present = ", ".join(present_capabilities()) or "none of the probe's capabilities"
    if not missing:
        return Check("privileges", OK, f"{who}, {present} effective")
    return Check("privileges", DEGRADED, f"{who} without {', '.join(missing)} ({present} effective): "
                 "eBPF probe unavailable", root_or_unit())


def check_bpf_syscall() -> Check:
    """BPF_MAP_CREATE of a one-slot array: the cheapest real use of bpf(2)."""
    from probes.bpfsys import SYSCALL_NUMBERS  # the probe's own table: one owner

    number = SYSCALL_NUMBERS.get(platform.machine().lower())
    if number is None:
        return Check("bpf_syscall", DEGRADED, f"unknown bpf(2) number on {platform.machine()}")
    # union bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries (u32 each).
    attr = (ctypes.c_uint32 * 32)(2, 4, 4, 1)  # BPF_MAP_TYPE_ARRAY
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(number, 0, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd >= 0:
        os.close(fd)
        return Check("bpf_syscall", OK, "bpf(BPF_MAP_CREATE) works")
    err = ctypes.get_errno()
    return Check("bpf_syscall", DEGRADED, f"bpf(2) refused: {os.strerror(err)}",
                 "run as root (or grant CAP_BPF); check kernel.unprivileged_bpf_disabled")


def root_or_unit() -> str:
    """The fix for what only root, or the unit's capabilities, may do: naming what this process
    lacks, where it lacks any."""
    from probes.caps import UNIT_CAPABILITIES, missing_bpf_capabilities

    missing = missing_bpf_capabilities()
    lacking = f" (this process lacks {', '.join(missing)})" if missing else ""
    return f"run as root, or under systemd with AmbientCapabilities={UNIT_CAPABILITIES}{lacking}"


# A daemon picks its disconnect source once, at start: a fix to the probe's host needs a restart.
TRACEFS_FIX = ("mount -t tracefs nodev /sys/kernel/tracing (and at every boot: systemctl enable --now "
               "sys-kernel-tracing.mount); then restart the daemon (systemctl restart auditor): it picks "
               "its source at start")
# How the ``source`` check begins where the configuration asks for the fallback (probe_loader reads it).
PROCFS_BY_CONFIG = "probe.source = procfs"


def check_tracefs() -> Check:
    for base in TRACEFS_DIRS:
        try:
            present = (base / "events/sock/inet_sock_set_state").exists()
        except PermissionError:
            return Check("tracefs", DEGRADED, f"{base} is mounted but readable by root only: this user cannot see "
                         "the tracepoints the eBPF probe attaches to", root_or_unit())
        if present:
            detail = f"{base} mounted, sock:inet_sock_set_state present"
            missing = [name for name in ("tcp_receive_reset", "tcp_rcv_space_adjust")
                       if not (base / "events/tcp" / name).exists()]
            if missing:
                return Check("tracefs", DEGRADED, detail + f"; tcp:{', tcp:'.join(missing)} missing: the eBPF "
                             "probe cannot attach", "the probe needs Linux 4.16 or later; use --source procfs")
            return Check("tracefs", OK, detail + ", tcp:tcp_receive_reset and tcp:tcp_rcv_space_adjust present")
    return Check("tracefs", DEGRADED, "tracefs not mounted: the eBPF probe cannot attach", TRACEFS_FIX)


def check_prebuilt_probe() -> Check:
    """Load and attach the probe as bcc compiled it at build time (``probes.prebuilt``), then let it
    go: what the daemon tries first, needing neither bcc nor kernel headers."""
    from probes import ProbeUnavailable
    from probes.bpf import load_prebuilt
    from probes.caps import missing_bpf_capabilities

    started = time.monotonic()
    try:
        program = load_prebuilt()
    except PermissionError as exc:
        return Check("prebuilt_probe", DEGRADED, f"cannot load the prebuilt probe as this user ({exc.strerror}: "
                     f"{exc.filename})", root_or_unit())
    except ProbeUnavailable as exc:
        if exc.reason == "tracefs is not mounted":
            fix = TRACEFS_FIX
        elif missing_bpf_capabilities():  # refused for want of a capability: bcc would be refused too
            fix = root_or_unit()
        else:
            fix = "the daemon compiles the probe with bcc instead: see the kernel_headers and bcc checks"
        return Check("prebuilt_probe", DEGRADED, exc.reason, fix)
    program.close()
    fitted = f" (fitted to this kernel: {'; '.join(program.fitted)})" if program.fitted else ""
    return Check("prebuilt_probe", OK,
                 f"loaded and attached without bcc in {(time.monotonic() - started) * 1e3:.0f} ms{fitted}")


def check_kernel_headers() -> Check:
    build = Path("/lib/modules") / platform.release() / "build"
    if build.exists():
        return Check("kernel_headers", OK, f"{build} -> {build.resolve()}")
    return Check("kernel_headers", DEGRADED, f"{build} missing: bcc cannot compile the probe",
                 "make setup (as root), or: apt-get install linux-headers-$(uname -r)")


def check_bcc(timeout_s: float = 60.0) -> Check:
    """Import bcc and load a real tracepoint program, in a child so a crash cannot take us down."""
    code = (f"import time, bcc; t = time.monotonic(); b = bcc.BPF(text={TEST_PROGRAM!r}); "
            "print(round(time.monotonic() - t, 2)); b.cleanup()")
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Check("bcc", DEGRADED, f"test program did not load within {timeout_s:.0f} s")
    if result.returncode == 0:
        return Check("bcc", OK, f"bcc imported; test tracepoint program loaded in {result.stdout.strip()} s")
    last = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
    if "No module named 'bcc'" in result.stderr:
        return Check("bcc", DEGRADED, "bcc is not importable",
                     "make setup (as root), or: apt-get install python3-bpfcc and link "
                     "/usr/lib/python3/dist-packages/bcc into the venv")
    from probes.caps import missing_bpf_capabilities

    return Check("bcc", DEGRADED, f"test program failed to load: {last[:200]}",
                 root_or_unit() if missing_bpf_capabilities() else "see the kernel_headers and tracefs checks")


def check_fallback(poll_hz: float, walks: int = 100) -> Check:
    """What the unprivileged /proc fallback would cost on this host, measured: every poll that
    follows a newly accepted connection has the kernel walk its whole TCP established table
    (sock_diag), and that walk grows with the host's memory (the table's size) and with the
    sockets in it, TIME_WAIT included (docs/footprint.md). And whether the kernel gives its notices
    of freed sockets, without which the fallback misses a connection that opens and closes between
    two polls (docs/probe.md)."""
    from probes.sockdiag import DestroyNotices, tcp_socket_counts, walk_cpu_us

    try:
        walk_us = walk_cpu_us(walks)
    except OSError as exc:
        return Check("fallback", DEGRADED, f"sock_diag refused ({exc}): the /proc fallback would parse "
                     "/proc/net/tcp and /proc/net/tcp6 on every poll instead, at several times the CPU",
                     "allow AF_NETLINK sockets of protocol NETLINK_SOCK_DIAG (a seccomp filter or sandbox refuses them)")
    counts = tcp_socket_counts()
    sockets = (f"{counts['inuse']} TCP sockets in use, {counts['tw']} in TIME_WAIT" if {"inuse", "tw"} <= counts.keys()
               else "socket counts unreadable")
    cost = (f"a walk of the kernel's TCP table costs {walk_us:.0f} us of CPU here ({sockets}): "
            f"{walk_us * poll_hz / 1e4:.2f}% of a core at the /proc fallback's {poll_hz:g} polls a second "
            "while connections arrive")
    try:
        DestroyNotices().close()
    except OSError as exc:
        return Check("fallback", DEGRADED, f"{cost}; the kernel's notices of freed sockets are refused ({exc}): the "
                     "fallback would miss a connection that opens and closes between two polls, and read a FIN "
                     "and the server's close within one as a reset",
                     "Linux 4.9 or later gives them; a sandbox must allow joining sock_diag's netlink groups")
    return Check("fallback", OK, f"{cost}; the kernel's notices of freed sockets come (no connection shorter "
                 "than a poll is missed)")


def check_engines(ports: Iterable[int], proc_root: Path = Path("/proc"), otlp: Iterable[str] = ()) -> Check:
    """Where each watched port is listened on: in this network namespace, in a container's network
    of its own (``probes.netns``), both (the host's end a proxy's, as Docker's docker-proxy), or
    nowhere yet. The eBPF probe sees every namespace; the /proc fallback reads another's table
    through a process in it. Several other namespaces on one port (pods of a node serving one port)
    are told apart by the address their spans come from, and their engines' /metrics scraped each
    at its own address and summed. A container's engine sends its spans to its own loopback if
    ``otlp`` (the receivers' addresses) listen on this one only."""
    from collectors.listeners import listening_inodes
    from probes.netns import NetNamespaces

    wanted = sorted(set(ports))
    here = listening_inodes(wanted, proc_root)
    elsewhere = NetNamespaces(proc_root).refresh(wanted)
    parts = []
    for port in wanted:
        spaces = elsewhere.get(port, [])
        if not spaces:
            parts.append(f"port {port}: " + ("listened on here" if port in here else "nothing listens on it yet"))
            continue
        through = ", ".join(f"pid {space.pid}'s" for space in spaces)
        parts.append(f"port {port}: listened on in {len(spaces)} other network namespace(s) ({through})"
                     + (" and here (a proxy's end)" if port in here else ""))
    detail = "; ".join(parts) or "no port watched"
    if elsewhere:
        detail += ("; the eBPF probe sees every network namespace; the /proc fallback reads another's "
                   "/proc/<pid>/net/tcp, without the kernel's notices: a connection shorter than a poll is "
                   "missed there, and a client's FIN is told from a reset only when a poll sees it")
    several = [port for port in wanted if len(elsewhere.get(port, [])) > 1]
    if several:
        detail += (f"; port(s) {', '.join(map(str, several))}: several engines, each scraped at its own address "
                   "and their gauges summed; a request is costed to the engine at the address its spans came "
                   "from, so each engine must send them straight to this daemon (through a collector, name "
                   "each pod's address in its resource, k8s.pod.ip, or put process.pid there)")
    if elsewhere and loopback_only(otlp):
        return Check("engines", DEGRADED, detail, "the OTLP receivers listen on the loopback, which a container on "
                     "a network of its own cannot reach (its 127.0.0.1 is its own): set otlp.http (or otlp.grpc) "
                     "to this host's address on that network (the bridge's gateway, 172.17.0.1 on Docker's "
                     "default) or 0.0.0.0 with otlp.token, and the engine's OTLP endpoint to it")
    return Check("engines", OK, detail)


ENGINE_METRICS_FIX = ("expose the engine's Prometheus page on its serving port (llama.cpp: --metrics; SGLang: "
                      "--enable-metrics; vLLM without --disable-log-stats; TGI serves it), or set "
                      "engine_metrics.path to where it is")


def engine_flag_hint(argv: list[str]) -> str | None:
    """What in an engine's command line keeps its gauges off its /metrics, where it says: vLLM
    publishes them only from its stats loggers, which ``--disable-log-stats`` turns off (the page
    then holds no ``vllm:`` series), as some versions do themselves with several API servers
    (``--api-server-count`` over 1: vllm-project/vllm PR 22227 turned stats off there, later
    versions keep the Prometheus logger); SGLang serves the page only with ``--enable-metrics``;
    llama.cpp's server only with ``--metrics`` (or ``LLAMA_ARG_ENDPOINT_METRICS=1``, which a
    command line does not show)."""
    head = argv[:4]  # the program, or an interpreter and its -m module
    names = [Path(arg).name for arg in head]

    def runs(program: str, module: str) -> bool:
        return program in names or any(arg.startswith(module) for arg in head)

    if runs("vllm", "vllm.entrypoints") and "--disable-log-stats" in argv:
        return "its command line has vLLM's --disable-log-stats, which keeps every vllm: gauge off the page: drop it"
    if runs("vllm", "vllm.entrypoints") and _api_servers(argv) > 1:
        return ("its command line runs several vLLM API servers (--api-server-count), with which some vLLM "
                "versions turn their stats off, every vllm: gauge with them: run one API server, or a vLLM "
                "that keeps its Prometheus metrics with several")
    if runs("sglang", "sglang.launch_server") and "--enable-metrics" not in argv:
        return "its command line is SGLang's without --enable-metrics, without which it serves no /metrics"
    if any(name.startswith("llama-server") for name in names) and "--metrics" not in argv:
        return ("its command line is llama.cpp's server without --metrics, without which it serves no /metrics "
                "(unless LLAMA_ARG_ENDPOINT_METRICS=1 is in its environment)")
    return None


def _api_servers(argv: list[str]) -> int:
    """The API servers a vLLM command line asks for (``--api-server-count N``, ``=N``, ``-asc N``);
    1 where it says none, or nothing readable."""
    for at, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in ("--api-server-count", "-asc"):
            value = value or (argv[at + 1] if at + 1 < len(argv) else "")
            return int(value) if value.isdigit() else 1
    return 1


def check_engine_metrics(ports: Iterable[int], path: str = "/metrics", scrape: bool = True,
                         proc_root: Path = Path("/proc"), timeout_s: float = 1.0) -> Check:
    """One scrape of the engines' own ``/metrics`` on each watched port that is listened on, at each
    address the daemon would scrape (``probes.netns.EngineAddresses``: the loopback, a container's
    address, each pod's of a port several serve): whose gauges were read, and where none. Without
    them an abort the engine sends no span for (vLLM) cannot be confirmed, and a zombie is told by
    spans alone."""
    if not scrape:
        return Check("engine_metrics", DEGRADED, "engine_metrics.scrape = false: no engine's gauges are read, so "
                     "an abort the engine sends no span for (vLLM) is unconfirmed",
                     "set engine_metrics.scrape = true")
    from collectors.enginemetrics import EngineMetricsScraper
    from collectors.listeners import listening_inodes
    from probes.netns import EngineAddresses, NetNamespaces

    addresses = EngineAddresses(lambda wanted: listening_inodes(wanted, proc_root), NetNamespaces(proc_root))
    here = listening_inodes(set(ports), proc_root)
    read, unread = [], []

    def hint(port: int, address: str) -> str:
        """Why the engine listening there gives no gauges, where its command line says."""
        inodes = addresses.listening(port, address) or here.get(port, set())
        holder = socket_holder(set(inodes), proc_root)
        said = engine_flag_hint(holder[1]) if holder else None
        return f"; pid {holder[0]}: {said}" if holder and said else ""

    for port in sorted(set(ports)):
        at = addresses.of(port)
        if port not in here and addresses.listening(port, at[0]) is None:
            continue  # nothing listens on it yet (the engines check says so)
        for address in at:
            scraper = EngineMetricsScraper(lambda: [], lambda loads: None, host=address, path=path,
                                           timeout_s=timeout_s, filtered=False)
            where = f"port {port}" + (f" at {address}" if len(at) > 1 or address != "127.0.0.1" else "")
            try:
                load = scraper.scrape(port)
            except OSError as exc:
                unread.append(f"{where}: {path} not read ({exc}){hint(port, address)}")
                continue
            finally:
                scraper.close()
            if load is None:
                unread.append(f"{where}: {path} has no engine metric this daemon knows (vLLM, SGLang, TGI, "
                              f"llama.cpp){hint(port, address)}")
            else:
                read.append(f"{where}: {load.style or 'engine'} gauges read ({load.running} running, "
                            f"{load.waiting} waiting)")
    if not read and not unread:
        return Check("engine_metrics", OK, "no watched port is listened on yet")
    detail = "; ".join(read + unread)
    if unread:
        return Check("engine_metrics", DEGRADED, detail + ": there, an abort the engine sends no span for "
                     "(vLLM) stays unconfirmed", ENGINE_METRICS_FIX)
    return Check("engine_metrics", OK, detail)


def check_nvml(ports: Iterable[int] = ()) -> Check:
    """NVML and its GPUs; and, for each watched port whose engine is running, the GPU processes
    its cost will be read from (the listener and the processes it started). On a host with several
    GPUs, an engine with none is not costed: that is said here before its zombies are."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return Check("nvml", DEGRADED, f"NVML unavailable ({exc}): waste is measured in CPU-seconds",
                     "install the NVIDIA driver (libnvidia-ml.so) on GPU hosts")
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = [str(pynvml.nvmlDeviceGetName(handle)) for handle in handles]
        unmeasured = [index for index, handle in enumerate(handles) if not _utilization_readable(pynvml, handle)]
        unbuffered = [index for index, handle in enumerate(handles)
                      if index not in unmeasured and not _buffer_readable(pynvml, handle)]
        on_gpu = _gpu_processes(pynvml, handles)
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        return Check("nvml", DEGRADED, "NVML found no GPU: waste is measured in CPU-seconds")
    if unmeasured:
        return Check("nvml", DEGRADED, f"{count} GPU(s): {', '.join(names)}; NVML gives no utilization for GPU "
                     f"{', '.join(map(str, unmeasured))} (MIG mode?): GPU time on it is not costed",
                     "NVML measures no utilization of MIG-enabled GPUs; disable MIG there to cost zombies' GPU time")
    engines, uncosted = _engines_on_gpus(ports, on_gpu)
    detail = f"{count} GPU(s): {', '.join(names)}" + (f"; {'; '.join(engines)}" if engines else "")
    if unbuffered:
        detail += (f"; NVML keeps no sample buffer for GPU {', '.join(map(str, unbuffered))}: work begun while "
                   "the sampler rests (a GPU idle for a second is read once a second) is counted from its "
                   "first busy reading, up to a second late")
    if count > 1 and uncosted:
        return Check("nvml", DEGRADED, detail, f"NVML lists no process of the engine on port(s) "
                     f"{', '.join(map(str, uncosted))} or of one it started: with {count} GPUs here its zombies "
                     "are not costed. Run the auditor where it sees the host's pids (a container needs hostPID), "
                     "or ask again once the engine has loaded its model")
    return Check("nvml", OK, detail)


def _gpu_processes(pynvml: Any, handles: list[Any]) -> dict[int, list[int]]:
    """pid -> the GPUs NVML lists it on (compute processes)."""
    found: dict[int, list[int]] = {}
    for index, handle in enumerate(handles):
        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # unsupported, or no permission: the listing is this check's extra, not its verdict
            continue
        for process in processes:
            found.setdefault(int(process.pid), []).append(index)
    return found


def _engines_on_gpus(ports: Iterable[int], on_gpu: dict[int, list[int]],
                     proc_root: Path = Path("/proc")) -> tuple[list[str], list[int]]:
    """Per watched port with a listener: its GPU processes, as the cost will find them; and the
    ports whose engine has none."""
    from auditor.correlate.waste import ancestors_of, parent_pid

    def ancestors(pid: int) -> tuple[int, ...]:
        return ancestors_of(pid, lambda child: parent_pid(child, str(proc_root)))

    lines, uncosted = [], []
    for port in sorted(set(ports)):
        holder = socket_holder(socket_inodes(port, socket.SOCK_STREAM, proc_root), proc_root)
        if holder is None:
            continue
        listener = holder[0]
        mine = sorted(pid for pid in on_gpu if pid == listener or listener in ancestors(pid))
        if mine:
            lines.append(f"port {port}: pid {listener}, on the GPUs as " + ", ".join(
                f"{pid} (GPU {', '.join(map(str, on_gpu[pid]))})" for pid in mine))
        else:
            lines.append(f"port {port}: pid {listener}, no process on a GPU")
            uncosted.append(port)
    return lines, uncosted


def _utilization_readable(pynvml: Any, handle: Any) -> bool:
    """False only where NVML says it cannot measure this GPU; another failure is the sampler's to
    retry (it backs off), not a reason for this check to fail."""
    try:
        pynvml.nvmlDeviceGetUtilizationRates(handle)
    except pynvml.NVMLError_NotSupported:
        return False
    except pynvml.NVMLError:
        pass
    return True


def _buffer_readable(pynvml: Any, handle: Any) -> bool:
    """Whether NVML keeps its buffer of whole-GPU utilization samples for this GPU, which the
    sampler reads for the time it rested (collectors/nvml.py). None held yet is still a buffer."""
    from collectors.nvml import GPU_UTILIZATION_SAMPLES, NO_BUFFER

    try:
        pynvml.nvmlDeviceGetSamples(handle, GPU_UTILIZATION_SAMPLES, 0)
    except AttributeError:  # a pynvml without the call
        return False
    except pynvml.NVMLError as exc:  # the sampler's own rule: these mean never; NotFound, nothing held yet
        return type(exc).__name__ not in NO_BUFFER
    return True


# Where each listener's socket lives: TCP servers (SO_REUSEADDR, like Python's HTTP servers) and
# the UDP receiver of live notices.
LISTENERS = (("otlp.http", socket.SOCK_STREAM), ("otlp.grpc", socket.SOCK_STREAM),
             ("metrics.listen", socket.SOCK_STREAM), ("live.listen", socket.SOCK_DGRAM))


def socket_inodes(port: int, kind: int, proc_root: Path = Path("/proc")) -> set[int]:
    """Inodes of the listening (TCP) or unconnected (UDP) sockets bound to ``port``, any address."""
    proto, state = ("tcp", TCP_LISTEN) if kind == socket.SOCK_STREAM else ("udp", UDP_UNCONNECTED)
    inodes: set[int] = set()
    for table in (proc_root / "net" / proto, proc_root / "net" / f"{proto}6"):
        try:
            text = table.read_text()
        except OSError:
            continue
        inodes |= bound_inodes(text, (port,), state).get(port, set())
    return inodes


def socket_holder(inodes: set[int], proc_root: Path = Path("/proc")) -> tuple[int, list[str]] | None:
    """The process (pid, argv) that has one of these socket inodes open, found through its fds.
    Other users' fds need root (or CAP_SYS_PTRACE); unreadable processes are skipped."""
    links = {f"socket:[{inode}]" for inode in inodes}
    if not links:
        return None
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in links for fd in (entry / "fd").iterdir()):
                argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
                return int(entry.name), [a.decode(errors="replace") for a in argv]
        except OSError:
            continue
    return None


def is_auditor_daemon(argv: list[str]) -> bool:
    """``auditor run ...``, ``python -m auditor run ...`` or a path to the auditor script."""
    names = [Path(arg).name for arg in argv[:4]]
    return "auditor" in names and "run" in argv[names.index("auditor") + 1:names.index("auditor") + 2]


def port_in_use(host: str, port: int, kind: int) -> str | None:
    """Why this address cannot be bound now, or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as sock:
        if kind == socket.SOCK_STREAM:  # a TIME_WAIT left by the last run does not stop the servers
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_ports(config: Config) -> Check:
    """Each configured listener's address must be free, or held by the auditor daemon already
    running here (then ``doctor`` is being asked about a working install, not a conflict)."""
    addresses = {"otlp.http": config.otlp.http, "otlp.grpc": config.otlp.grpc,
                 "metrics.listen": config.metrics.listen, "live.listen": config.live.listen}
    free, ours, busy, unnamed = [], [], [], []
    for key, kind in LISTENERS:
        addr = addresses[key]
        if not addr:
            continue
        host, port = parse_address(addr, key)
        reason = port_in_use(host, port, kind) if port else None
        if reason is None:
            free.append(addr)
            continue
        holder = socket_holder(socket_inodes(port, kind))
        if holder is not None and is_auditor_daemon(holder[1]):
            ours.append((addr, holder[0]))
        elif holder is None:
            unnamed.append((key, addr, reason))
        else:
            busy.append(f"{key} {addr} ({reason}, held by pid {holder[0]} ({' '.join(holder[1])[:80]}))")
    # Another user's process (the service's, asked from a shell with fewer privileges) cannot be
    # named from /proc: an auditor answering on the metrics address says whose they are.
    service = bool(unnamed) and auditor_answers(config.metrics.listen)
    if not service:
        busy += [f"{key} {addr} ({reason})" for key, addr, reason in unnamed]
    if busy:
        return Check("ports", FAILED, "in use: " + "; ".join(busy),
                     "stop what holds them (ss -ltnup), or set other addresses in auditor.toml",
                     required=True)
    parts = [f"free: {', '.join(free)}"] if free else []
    for pid in sorted({pid for _, pid in ours}):
        held = ", ".join(addr for addr, holder_pid in ours if holder_pid == pid)
        parts.append(f"{held} held by the running auditor (pid {pid})")
    if service:
        parts.append(f"{', '.join(addr for _, addr, _ in unnamed)} held by the running auditor (it answers on "
                     f"metrics.listen {config.metrics.listen}; its process is another user's)")
    return Check("ports", OK, "; ".join(parts) or "no listeners configured", required=True)


def auditor_answers(metrics_listen: str, timeout_s: float = 1.0) -> bool:
    """Whether an auditor daemon serves ``/metrics`` at this address now."""
    if not metrics_listen:
        return False
    try:
        host, port = parse_address(metrics_listen, "metrics.listen")
    except ConfigError:  # a bad address is the config loader's to report
        return False
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    target = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{target}:{port}/metrics?name[]=auditor_build_info",
                                    timeout=timeout_s) as response:
            return b"auditor_build_info" in response.read(65536)
    except (OSError, ValueError):
        return False


def check_database(config: Config) -> Check:
    """The daemon's store, opened as it would open it, but never created: a database that does not
    exist yet is judged by its directory, so that asking leaves no empty file behind for a later
    ``auditor report`` to read as an empty store."""
    from auditor.store import Store, default_db_url, unwritable_sqlite

    url = config.db or default_db_url()
    shown = _without_password(url)
    fix = "pass a writable --db (sqlite:///PATH or postgresql+psycopg://...)"
    from auditor.cli.util import in_memory

    if in_memory(url):
        return Check("database", FAILED, f"{shown} is SQLite in memory: the daemon's threads and the child "
                     "that makes its schema would each see a database of their own, and nothing outlives it",
                     fix, required=True)
    path = _sqlite_path(url)
    if path is not None and not path.exists():
        directory = path.parent.resolve()
        if not directory.is_dir():
            return Check("database", FAILED, f"{shown}: directory {directory} does not exist",
                         f"create {directory}, or {fix}", required=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            return Check("database", FAILED, f"{shown}: not created yet, and {directory} is not writable",
                         f"make {directory} writable for the daemon's user, or {fix}", required=True)
        return Check("database", OK, f"{shown}: not created yet (the daemon creates it at start); "
                     f"{directory} writable", required=True)
    unwritable = unwritable_sqlite(url)
    if unwritable:
        return Check("database", FAILED, f"{shown}: {unwritable[0]}", unwritable[1], required=True)
    try:
        store = Store(url, check=False, create=False)
        try:
            current, head = store.current_revision(), store.head_revision()
            with store.engine.connect() as conn:
                if store.dialect == "sqlite":
                    # A write to the main file, rolled back: a temporary table goes to SQLite's
                    # temporary database, and BEGIN IMMEDIATE takes a WAL file's write lock, neither
                    # of which a read-only file refuses. The driver runs DDL outside a transaction
                    # of its own: hence the explicit BEGIN.
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                    conn.exec_driver_sql("CREATE TABLE main.auditor_doctor_probe (x INTEGER)")
                    conn.exec_driver_sql("ROLLBACK")
                else:
                    with conn.begin():  # a real write transaction, rolled back
                        conn.exec_driver_sql("CREATE TEMPORARY TABLE auditor_doctor_probe (x INTEGER)")
        finally:
            store.close()
    except AuditorError as exc:
        said = str(exc).splitlines()[0][:300]
        foreign = "no auditor schema" in said
        return Check("database", FAILED, said if shown in said else f"{shown}: {said}",
                     "the file is another application's: pass --db with the auditor's database, or a new "
                     "path the daemon creates" if foreign else fix, required=True)
    except Exception as exc:
        said = str(exc).splitlines()[0][:200]
        if path is not None and "readonly" in said:  # read-only mount, or a permission os.access missed
            fix = f"make {path} and its directory writable for the daemon's user (chown, chmod u+w), or {fix}"
        return Check("database", FAILED, f"{shown}: {said}", fix, required=True)
    if current is not None and current != head:
        state = f"schema {current}, will migrate to {head} at start"
    else:
        state = f"schema {current or 'empty, created at start'}"
    return Check("database", OK, f"{shown} writable; {state}", required=True)


SPANS_WINDOW_S = 3600


def check_spans(config: Config, now_ns: int | None = None) -> Check:
    """Whether each watched port's server sent spans in the last hour, as the store holds them: a
    port whose disconnects join no span gives no verdicts, only its orphaned work (llama.cpp's
    server and TGI alone send none that name a client). Asked of a store the daemon has written."""
    from sqlalchemy import func, select

    from auditor.store import Store, default_db_url, tables

    ports = sorted(set(config.probe.ports))
    url = config.db or default_db_url()
    path = _sqlite_path(url)
    if path is not None and not path.exists():
        return Check("spans", OK, "no store yet: asked once the daemon has run")
    since = (now_ns or time.time_ns()) - SPANS_WINDOW_S * 1_000_000_000
    host = config.host_id or socket.gethostname()  # as the daemon keys its rows: a fleet's store holds others'
    spans = tables.spans.c
    store = Store(url, check=False, create=False)
    try:
        with store.engine.connect() as conn:
            counts = {int(port): int(count) for port, count in conn.execute(
                select(spans.server_port, func.count()).where(
                    spans.host == host, spans.role == "http_server", spans.start_ns >= since,
                    spans.server_port.in_(ports))
                .group_by(spans.server_port))}
    finally:
        store.close()
    told = [f"port {port}: {counts[port]:,} server spans" for port in ports if counts.get(port)]
    silent = [port for port in ports if not counts.get(port)]
    if not silent:
        return Check("spans", OK, "in the last hour, " + "; ".join(told))
    names = ", ".join(map(str, silent))
    detail = (f"no server span in the last hour on port(s) {names} (no traffic, or a server that sends "
              "none): their disconnects join no request, so they give no verdicts; with their /metrics "
              "read, their zombies are told as orphaned work by port" + (f" ({'; '.join(told)})" if told else ""))
    return Check("spans", DEGRADED, detail,
                 "instrument the server (opentelemetry-instrument, exporting to otlp.http), or put an "
                 "instrumented proxy in front of it and watch the proxy's port (docs/engines.md)")


def _without_password(url: str) -> str:
    """The URL as the doctor prints it: a PostgreSQL password hidden (``u:***@host``)."""
    if url.startswith("sqlite"):
        return url  # SQLite has no password, and rendering would escape a file: URI's colon
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url  # no URL, so no password to find in it; --db's own check names it


def _sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (``sqlite:///PATH``, with or without options); None for another
    database, SQLite in memory, a ``file:`` URI, or a URL that is none."""
    from auditor.store import sqlite_database

    database = sqlite_database(url)
    return None if database is None or database.startswith("file:") else Path(database)


def check_postgres_driver() -> Check:
    try:
        import psycopg
    except ImportError:
        return Check("postgres_driver", DEGRADED, "psycopg not installed: SQLite only",
                     "pip install 'zombie-auditor[postgres]'")
    return Check("postgres_driver", OK, f"psycopg {psycopg.__version__}")


def check_otlp_reader() -> Check:
    """Whether the spans' bodies are read, and their records built, by the compiled code, or by
    the Python where the install found no C compiler or Python headers to build it (the same
    answers; the reader in Python doubles the CPU a span normalized, the builder in Python about
    doubles it again: docs/footprint.md, twenty-fourth and twenty-eighth passes)."""
    from collectors import normalize, otlp_wire

    in_python = [part for part, compiled in (("reader", otlp_wire.reader() == "compiled"),
                                             ("record builder", normalize.builder() == "compiled")) if not compiled]
    if not in_python:
        return Check("otlp_reader", OK, "compiled (collectors/_otlp_wire.c, collectors/_normalize.c)")
    return Check("otlp_reader", DEGRADED, f"the Python {' and '.join(in_python)}: spans cost two to three times "
                 "the CPU to normalize (not built: no C compiler or Python headers at install)",
                 "apt-get install gcc python3-dev, then reinstall (make setup, or pip install --force-reinstall .)")


def check_prices(config: Config) -> Check:
    """What an hour of this host's GPU and CPU costs in reports and on the dashboard (its
    ``auditor_hour_price``): the ``[report]`` pattern its name matches, else the price of the rest.
    Degraded where hosts are priced apart and none of the patterns names this one, with no price
    for the rest: its wasted time would be left unpriced in a fleet's report."""
    report = config.report
    host = config.host_id or socket.gethostname()
    parts = []
    for kind, unit, patterns, rest in (("GPU", "GPU-hour", report.gpu_hour_prices, report.gpu_hour_price),
                                       ("CPU", "CPU core-hour", report.cpu_hour_prices, report.cpu_hour_price)):
        matched = host_pattern(host, patterns)
        if matched is not None:
            parts.append(f"{patterns[matched]:,.10g} {report.currency} a {unit} (pattern {matched!r})")
        elif rest:
            parts.append(f"{rest:,.10g} {report.currency} a {unit}" + (" (no pattern names it)" if patterns else ""))
        elif patterns and kind == "GPU":
            return Check("prices", DEGRADED, f"{host}: no pattern of report.gpu_hour_prices names this host "
                         f"({', '.join(map(repr, patterns))}) and report.gpu_hour_price is 0: its wasted GPU "
                         "time would be left unpriced", "add a pattern for this host's name to "
                         "[report.gpu_hour_prices], or set report.gpu_hour_price for the hosts none names")
    if not parts:
        return Check("prices", OK, f"{host}: unpriced (report.gpu_hour_price): reports show wasted seconds only")
    return Check("prices", OK, f"{host}: " + "; ".join(parts))


def run_checks(config: Config) -> list[Check]:
    checks: list[Callable[[], Check]] = [
        check_privileges, check_bpf_syscall, check_tracefs, check_prebuilt_probe, check_kernel_headers, check_bcc,
        lambda: check_fallback(config.probe.poll_hz),
        lambda: check_engines(config.probe.ports, otlp=(config.otlp.http, config.otlp.grpc)),
        lambda: check_engine_metrics(config.probe.ports, config.engine_metrics.path, config.engine_metrics.scrape),
        lambda: check_nvml(config.probe.ports),
        lambda: check_ports(config),
        lambda: check_database(config),
        lambda: check_spans(config),
        check_postgres_driver, check_otlp_reader, lambda: check_prices(config),
    ]
    results = []
    for check in checks:
        try:
            results.append(check())
        except Exception as exc:  # a broken check must not hide the others
            name = getattr(check, "__name__", "check").removeprefix("check_")
            results.append(Check(name, DEGRADED, f"check itself failed: {exc}",
                                 root_or_unit() if isinstance(exc, PermissionError) else ""))
    results.append(check_source(config.probe.source, results))
    return results


def check_source(source: str, checks: list[Check]) -> Check:
    """``probe.source`` against what loads here, as ``auditor run`` decides: ``bpf`` where the eBPF
    probe cannot load is a daemon that exits 1 at start."""
    loaded = probe_loader(checks) is not None
    if source == "procfs":
        return Check("source", OK, f"{PROCFS_BY_CONFIG}: the /proc fallback, as configured"
                     + ("; the eBPF probe would load here (probe.source = auto uses it)" if loaded else ""),
                     required=True)
    if source == "bpf" and not loaded:
        return Check("source", FAILED, "probe.source = bpf, and the eBPF probe cannot load here (the checks "
                     "above say why): the daemon would exit at start",
                     "fix what the checks above name, or set probe.source = auto (the /proc fallback "
                     "where the probe cannot load)", required=True)
    return Check("source", OK, f"probe.source = {source}: "
                 + ("the eBPF probe" if loaded else "the /proc fallback, as the eBPF probe cannot load here"),
                 required=True)


def can_run(checks: list[Check]) -> bool:
    return not any(c.required and c.state == FAILED for c in checks)


def disconnect_source(checks: list[Check]) -> str:
    """``bpf`` or ``procfs``: the daemon's source of disconnects here (a label, as on /metrics)."""
    return "bpf" if probe_loader(checks) else "procfs"


def probe_loader(checks: list[Check]) -> str | None:
    """How the daemon would load the eBPF probe here: ``prebuilt`` (bcc's compile kept at build
    time), ``bcc`` (compiled at start), or None (the /proc fallback runs, by configuration when
    the ``source`` check says ``probe.source = procfs``)."""
    by_name = {c.name: c.state for c in checks}
    if any(c.name == "source" and c.detail.startswith(PROCFS_BY_CONFIG) for c in checks):
        return None
    if all(by_name.get(n) == OK for n in ("privileges", "bpf_syscall")):
        if by_name.get("prebuilt_probe") == OK:
            return "prebuilt"
        if by_name.get("bcc") == OK:
            return "bcc"
    return None


def render_text(checks: list[Check], elapsed_s: float, columns: int | None = None) -> list[str]:
    """The checks for people: name, state, then the detail and its fix wrapped to the terminal's
    width (80 columns when it has none) under a hanging indent."""
    columns = columns or shutil.get_terminal_size((80, 24)).columns
    marks = {OK: "ok", DEGRADED: "degraded", FAILED: "FAILED"}
    width = max(len(c.name) for c in checks)
    indent = " " * (width + 12)
    lines = []
    for c in checks:
        lines += _wrap(c.detail, columns, f"{c.name:<{width}}  {marks[c.state]:<8}  ", indent)
        if c.fix and c.state != OK:
            lines += _wrap(f"fix: {c.fix}", columns, indent, indent + "     ")
    verdict = "can run" if can_run(checks) else "cannot run"
    loader = {"prebuilt": ", the prebuilt probe", "bcc": ", compiled by bcc"}.get(
        probe_loader(checks) or "", " (fallback: poll-interval timing)")
    return [*lines, "", *_wrap(f"The daemon {verdict}; disconnect source: {disconnect_source(checks)}{loader} "
                               f"({elapsed_s:.1f} s)", columns, "", "  ")]


def _wrap(text: str, columns: int, first: str, rest: str) -> list[str]:
    """``text`` in lines of at most ``columns`` (but never narrower than 40 for the text itself),
    the first after ``first``, the others after ``rest``. A word longer than a line (a path, a
    URL) is cut rather than left to overflow."""
    width = max(columns, len(rest) + 40, len(first) + 40)
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first.rstrip()]


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="One JSON document (schema in docs/doctor.md).")
@common_options
def doctor_command(config: Config, as_json: bool) -> None:
    """Check what works on this host and how to fix what doesn't."""
    started = time.monotonic()
    checks = run_checks(config)
    runnable = can_run(checks)
    if as_json:
        click.echo(json.dumps({
            "schema": SCHEMA, "can_run": runnable, "disconnect_source": disconnect_source(checks),
            "probe_loader": probe_loader(checks),
            "checks": [dataclasses.asdict(c) for c in checks],
        }, indent=2))
    else:
        for line in render_text(checks, time.monotonic() - started):
            click.echo(line)
    sys.exit(0 if runnable else 1)
