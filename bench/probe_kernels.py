"""Whether the prebuilt eBPF probe loads and reports right on other kernels than this host's.

The prebuilt object (probes/disconnect.prebuilt.json, `make probe-object`) holds instructions bcc
compiled on one kernel. It runs on another kernel whose tracepoint records put the named fields
at the same offsets and whose verifier accepts it; this bench asks real kernels. For each kernel it
boots a virtual machine (qemu; emulated, or with ``--kvm``) on an initramfs made of this
host's Python, the repository and the virtual environment, no bcc and no kernel headers, as on a
GPU host that never installed them. Inside, as init, it:

- asks the object whether it fits the kernel (``probes.prebuilt.unusable_reason``, the check the
  daemon makes before it loads);
- loads the daemon's eBPF source with the prebuilt loader, timed, and closes loopback connections
  at a watched port three ways: a client FIN, a client reset, the server closing first;
- with ``--pytest``, runs the probe's own tests on that kernel (tests/test_probe_prebuilt.py and
  tests/test_probe_bpf.py; those marked ``compiles`` skip, as on any host without bcc), or with
  ``--tests PATH`` (repeatable) those test files instead: the daemon's own end-to-end ones too.

Kernels: Debian's cloud kernels by suite (bullseye 5.10, bookworm 6.1, trixie 6.12), fetched
from deb.debian.org once into ``--cache``, or any bzImage given with ``--vmlinuz``. Prints one row a
kernel; ``--json`` prints the rows as JSON.

Needs: qemu-system-x86 and busybox-static (``apt-get install qemu-system-x86 busybox-static``),
and a Debian/Ubuntu host with dpkg-deb. Emulated, a kernel takes a minute or two (more with
``--pytest``); ``--kvm`` is faster where the host's KVM runs guests (a nested one may hang at boot:
the run then ends at ``--timeout`` and says so). Load times under emulation are not the kernel's.

Usage: .venv/bin/python bench/probe_kernels.py [--suites bullseye,bookworm,trixie] [--vmlinuz PATH ...]
                                               [--pytest | --tests PATH ...] [--kvm] [--cache DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIRROR = "http://deb.debian.org/debian"
SUITES = ("bullseye", "bookworm", "trixie")
RESULT = "probe-kernels-result: "  # the guest's lines that carry its findings, on the serial console
# What the guest needs of the virtual environment: not the type checker, the linters or pip.
SITE_SKIPPED = re.compile(r"^(pip|setuptools|mypy|mypyc|mypy_extensions|ruff|.*__mypyc.*\.so|"
                          r"pip-.*|setuptools-.*|mypy-.*)$")
STDLIB_SKIPPED = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                  "config-3.11-x86_64-linux-gnu", "site-packages", "dist-packages"}
INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /tmp /run  # the initramfs is writable as it is: no tmpfs over the tree in it
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || mount -t debugfs debugfs /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
ip link set lo up
for module in /modules/*.ko; do [ -f "$module" ] && insmod "$module"; done
cd {repo}
HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={repo} {python} bench/probe_kernels.py --guest "$@"
echo "probe-kernels-exit: $?"
poweroff -f
"""


# --- the host: kernels, the initramfs, the virtual machine -------------------------------------

def fetch(url: str, to: Path) -> Path:
    if not to.exists():
        part = to.with_suffix(to.suffix + ".part")
        with urllib.request.urlopen(url, timeout=120) as response, open(part, "wb") as out:
            shutil.copyfileobj(response, out)
        part.rename(to)
    return to


def stanzas(text: str) -> Iterator[dict[str, str]]:
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(" "))
        if fields:
            yield fields


# Modules the daemon's sock_diag reads need where a kernel builds them as modules (Debian's cloud
# kernels do), in the order they load.
MODULES = ("sock_diag", "inet_diag", "tcp_diag")


def debian_kernel(suite: str, cache: Path) -> Path:
    """The bzImage of ``suite``'s current cloud kernel (the image its linux-image-cloud-amd64 names)."""
    index = fetch(f"{MIRROR}/dists/{suite}/main/binary-amd64/Packages.xz", cache / f"Packages-{suite}.xz")
    text = lzma.decompress(index.read_bytes()).decode()
    packages = {fields["Package"]: fields for fields in stanzas(text)
                if fields.get("Package", "").startswith("linux-image-")}
    meta = max((fields for fields in stanzas(text) if fields.get("Package") == "linux-image-cloud-amd64"),
               key=lambda fields: [int(part) for part in re.findall(r"\d+", fields["Version"])], default=None)
    if meta is None:
        raise SystemExit(f"{suite}: no linux-image-cloud-amd64 in its index")
    name = meta["Depends"].split()[0]
    deb = fetch(f"{MIRROR}/{packages[name]['Filename']}", cache / Path(packages[name]["Filename"]).name)
    unpacked = cache / name
    if not unpacked.exists():
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked) + ".part"], check=True)
        Path(str(unpacked) + ".part").rename(unpacked)
    images = sorted((unpacked / "boot").glob("vmlinuz-*"))
    if not images:
        raise SystemExit(f"{deb.name}: no vmlinuz in it")
    return images[0]


class Cpio:
    """An initramfs (cpio "newc", uncompressed: the kernel unpacks it as is) written as it is
    filled, each path once, its parent directories before it."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self._out = open(path, "ab" if append else "wb")  # noqa: SIM115  closed by close(), the trailer with it
        self._seen: set[str] = set()
        self._ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", mtime: int = 0) -> None:
        self._ino += 1
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, 1, mtime, len(data), 0, 0, 0, 0, len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % value for value in fields)
        self._out.write(header + encoded + b"\0" * (-(len(header) + len(encoded)) % 4))
        self._out.write(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        name = name.strip("/")
        if not name or name in self._seen:
            return
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        if name in self._seen:
            return
        self.directory(os.path.dirname(name))
        self._seen.add(name)
        self._entry(name, stat.S_IFREG | mode, data)

    def host_path(self, path: Path, *, skip: Iterable[str] = (), skip_re: re.Pattern[str] | None = None) -> None:
        """``path`` at the same place in the guest: a file, a link (and what it points to), or a
        tree (minus the names in ``skip`` and those ``skip_re`` matches, at any depth)."""
        name = str(path).strip("/")
        if name in self._seen:
            return
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            self.directory(os.path.dirname(name))
            self._seen.add(name)
            target = os.readlink(path)
            self._entry(name, stat.S_IFLNK | 0o777, target.encode())
            self.host_path((path.parent / target) if not os.path.isabs(target) else Path(target))
        elif stat.S_ISDIR(info.st_mode):
            self.directory(name)
            skipped = set(skip)
            for child in sorted(path.iterdir()):
                if child.name not in skipped and not (skip_re and skip_re.match(child.name)):
                    self.host_path(child, skip=skipped, skip_re=skip_re)
        elif stat.S_ISREG(info.st_mode):
            self.directory(os.path.dirname(name))
            self._seen.add(name)
            self._entry(name, stat.S_IFREG | stat.S_IMODE(info.st_mode), path.read_bytes(), int(info.st_mtime))

    def close(self) -> None:
        self._entry("TRAILER!!!", 0)
        self._out.close()


def shared_libraries(elves: Iterable[Path]) -> set[Path]:
    """The shared libraries these programs and extensions load, as ldd resolves them here."""
    found: set[Path] = set()
    for elf in elves:
        result = subprocess.run(["ldd", str(elf)], capture_output=True, text=True, check=False)
        for line in result.stdout.splitlines():
            match = re.search(r"(/\S+)\s+\(0x", line)
            if match:
                found.add(Path(match.group(1)))
    return found


def build_initramfs(path: Path) -> int:
    """This host's Python, stdlib, virtual environment and repository, busybox and /init."""
    python = Path(os.path.realpath(sys.base_prefix + "/bin/python3"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    venv = Path(sys.prefix)
    busybox = Path(shutil.which("busybox") or "/bin/busybox")
    if "statically linked" not in subprocess.run(["file", "-L", str(busybox)], capture_output=True,
                                                 text=True, check=False).stdout:
        raise SystemExit(f"{busybox} is not statically linked: apt-get install busybox-static")
    cpio = Cpio(path)
    cpio.file("bin/busybox", busybox.read_bytes(), 0o755)
    guest_python = venv / "bin" / "python"
    cpio.file("init", INIT.format(repo=REPO, python=guest_python).encode(), 0o755)
    cpio.host_path(python)
    cpio.host_path(stdlib, skip=STDLIB_SKIPPED | {"__pycache__"})
    cpio.host_path(venv / "pyvenv.cfg")
    cpio.host_path(guest_python)
    site = Path(sysconfig.get_paths()["purelib"])
    cpio.host_path(site, skip={"__pycache__"}, skip_re=SITE_SKIPPED)
    for part in ("auditor", "probes", "collectors", "replay", "systemd", "tests", "bench", "pyproject.toml"):
        cpio.host_path(REPO / part, skip={"__pycache__", ".pytest_cache"})
    elves = [python, *stdlib.glob("lib-dynload/*.so"), *site.rglob("*.so"), *REPO.glob("collectors/*.so")]
    for library in sorted(shared_libraries(elves)):
        cpio.host_path(library)
    cpio.close()
    return path.stat().st_size


def with_modules(base: Path, vmlinuz: Path, out: Path) -> Path:
    """``base`` and, after it, a second archive (the kernel unpacks both) with MODULES from the
    package ``vmlinuz`` came in, where it has them, numbered in load order."""
    shutil.copyfile(base, out)
    tree = vmlinuz.parent.parent
    cpio = Cpio(out, append=True)
    for order, name in enumerate(MODULES):
        found = sorted(tree.rglob(f"{name}.ko*"))
        if found:
            data = found[0].read_bytes()
            cpio.file(f"modules/{order}-{name}.ko", lzma.decompress(data) if found[0].suffix == ".xz" else data)
    cpio.close()
    return out


def boot(vmlinuz: Path, initramfs: Path, guest_args: list[str], timeout_s: float,
         kvm: bool) -> tuple[list[dict[str, Any]], str, float]:
    """Boot ``vmlinuz`` on the initramfs; the guest's result lines, its console's last lines, seconds."""
    command = ["qemu-system-x86_64", "-machine", "q35,accel=kvm" if kvm else "q35,accel=tcg",
               "-cpu", "host,-arch-capabilities" if kvm else "max", "-m", "2048", "-smp", "2", "-nographic", "-no-reboot",
               "-kernel", str(vmlinuz), "-initrd", str(initramfs),
               "-append", "console=ttyS0 panic=-1 loglevel=3 rdinit=/init -- " + " ".join(guest_args)]
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout_s,
                                check=False)
        console = result.stdout + result.stderr
    except subprocess.TimeoutExpired as exc:
        console = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        console += f"\n(no power-off within {timeout_s:.0f} s)"
    rows = [json.loads(line.split(RESULT, 1)[1]) for line in console.splitlines() if RESULT in line]
    return rows, "\n".join(console.splitlines()[-25:]), time.monotonic() - started


# --- the guest: runs as init inside the virtual machine -----------------------------------------

def say(what: dict[str, Any]) -> None:
    print(RESULT + json.dumps(what), flush=True)


def closes(source: Any, listener: socket.socket) -> dict[str, str]:
    """Close a connection at the watched port three ways; what the probe reported for each."""
    from auditor.model import ConnEventKind

    port = listener.getsockname()[1]
    seen: dict[str, str] = {}
    for how in ("client FIN", "client reset", "server first"):
        client = socket.create_connection(("127.0.0.1", port))
        server, _ = listener.accept()
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        server.recv(100)
        client_port = client.getsockname()[1]
        closed_ns = time.time_ns()
        if how == "client reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            client.close()
        elif how == "client FIN":
            client.close()
        else:
            server.close()
            client.recv(10)
            client.close()
        time.sleep(0.05)
        server.close()
        kinds: list[str] = []
        skew_ms: list[float] = []
        deadline = time.monotonic() + 3  # for the first event, then 0.3 s for any that follow it
        while time.monotonic() < deadline:
            for event in source.poll(timeout_s=0.05):
                if event.server_port == port and event.client_port == client_port:
                    if not kinds:
                        deadline = time.monotonic() + 0.3
                    kinds.append(event.kind.value)
                    if event.kind in (ConnEventKind.PEER_FIN, ConnEventKind.PEER_RST):
                        skew_ms.append((event.ts_ns - closed_ns) / 1e6)
        seen[how] = ",".join(kinds) + (f" ({skew_ms[0]:+.1f} ms)" if skew_ms else "")
    return seen


PROBE_TESTS = ["tests/test_probe_prebuilt.py", "tests/test_probe_bpf.py"]


def guest(tests: list[str]) -> int:
    from probes import bpf, prebuilt

    row: dict[str, Any] = {"kernel": os.uname().release}
    tracefs = next(root for root in bpf.TRACEFS_ROOTS if (root / "events").is_dir())
    bits = bpf.default_client_slot_bits()
    row["client_slot_bits"] = bits
    row["refused"] = prebuilt.unusable_reason(prebuilt.read(), bits, bpf.TRACEPOINT_NAMES, tracefs)
    if row["refused"]:  # the records as this kernel lays them out, for the row's reader
        row["fields"] = {tracepoint: prebuilt.record_fields(tracefs, tracepoint) for tracepoint in bpf.TRACEPOINT_NAMES}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    started = time.perf_counter()
    try:
        source = bpf.BpfConnEventSource([listener.getsockname()[1]], host="kernel-check", loader="prebuilt")
        source.start()
    except Exception as exc:  # the row says why; the guest goes on to its tests
        row["load_error"] = f"{type(exc).__name__}: {exc}"
    else:
        row["load_ms"] = round((time.perf_counter() - started) * 1e3, 1)
        row["closes"] = closes(source, listener)
        source.stop()
    say(row)
    if tests:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                capture_output=True, text=True, check=False, cwd=REPO,
                                env={**os.environ, "COLUMNS": "400"})
        lines = result.stdout.strip().splitlines()
        say({"kernel": row["kernel"], "pytest": lines[-1] if lines else result.stderr[-300:],
             "failures": [line[:400] for line in lines if line.startswith(("FAILED", "ERROR"))][:12],
             "errors": [line[:300] for line in lines if line.startswith("E ")][:12]})
    return 0


# --- the table ------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default=",".join(SUITES), help="Debian suites whose cloud kernel to boot "
                        "(comma-separated; empty for none)")
    parser.add_argument("--vmlinuz", type=Path, action="append", default=[], help="another kernel image to boot")
    parser.add_argument("--pytest", action="store_true", help="also run the probe's tests on each kernel")
    parser.add_argument("--tests", action="append", default=[], metavar="PATH",
                        help="run these test files on each kernel instead of the probe's (repeatable)")
    parser.add_argument("--cache", type=Path, default=Path("/var/tmp/auditor-kernels"),
                        help="where kernels are kept between runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a kernel may take, boot to power-off")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    parser.add_argument("--kvm", action="store_true", help="run the guests with KVM (/dev/kvm) instead of emulated")
    parser.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.guest:
        return guest(args.tests or (PROBE_TESTS if args.pytest else []))
    if not shutil.which("qemu-system-x86_64"):
        raise SystemExit("no qemu-system-x86_64: apt-get install qemu-system-x86 busybox-static")
    args.cache.mkdir(parents=True, exist_ok=True)
    kernels = [debian_kernel(suite, args.cache) for suite in filter(None, args.suites.split(","))] + args.vmlinuz
    guest_args = [f"--tests={path}" for path in args.tests] or (["--pytest"] if args.pytest else [])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="probe-kernels-") as scratch:
        initramfs = Path(scratch) / "initramfs.cpio"
        size = build_initramfs(initramfs)
        print(f"initramfs: {size / 2**20:.0f} MiB; {'KVM' if args.kvm else 'emulated'}",
              file=sys.stderr)
        for vmlinuz in kernels:
            kernel_initramfs = with_modules(initramfs, vmlinuz, Path(scratch) / "kernel.cpio")
            found, console, seconds = boot(vmlinuz, kernel_initramfs, guest_args, args.timeout, args.kvm)
            row: dict[str, Any] = {"image": vmlinuz.name, "boot_to_off_s": round(seconds, 1)}
            for part in found:
                row.update(part)
            if not found:
                row["error"] = "no result from the guest; its console ended:\n" + console
            rows.append(row)
            print(f"{vmlinuz.name}: {seconds:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'kernel':<26} {'fits':<5} {'load ms':>7}  {'client FIN':<24} {'client reset':<22} {'server first':<16}")
    for row in rows:
        if "error" in row:
            print(f"{row['image']:<26} {row['error']}")
            continue
        seen = row.get("closes", {})
        print(f"{row['kernel']:<26} {'yes' if not row['refused'] else 'no':<5} {row.get('load_ms', '-'):>7}  "
              f"{seen.get('client FIN', '-'):<24} {seen.get('client reset', '-'):<22} {seen.get('server first', '-'):<16}")
        for key in ("refused", "load_error"):
            if row.get(key):
                print(f"  {key}: {row[key]}")
        if "pytest" in row:
            print(f"  tests: {row['pytest']}")
            for failure in row.get("failures", []) + row.get("errors", []):
                print(f"    {failure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
