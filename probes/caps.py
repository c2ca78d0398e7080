"""Whether this process may load the eBPF probe, decided from its effective capabilities.

The uid says nothing: the systemd unit runs as ``User=auditor`` with ambient capabilities, and a
root shell may have dropped some. bcc needs three things from the kernel:
- CAP_BPF to create maps and load programs (CAP_SYS_ADMIN before Linux 5.8),
- CAP_PERFMON to attach tracepoints with perf_event_open (CAP_SYS_ADMIN before 5.8),
- CAP_DAC_READ_SEARCH to read the tracepoint layouts in tracefs, which is mode 0700 root: bcc reads
  ``events/*/*/format`` and ``id`` while compiling and attaching (CAP_DAC_OVERRIDE also does). Root
  needs neither: it reads its own 0700 files as their owner.
This module is the one place that decides it: the probe, ``auditor doctor`` and the tests ask here.
"""

from __future__ import annotations

import os
from pathlib import Path

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 1, 2, 21, 38, 39

# Each capability bcc needs, with the capabilities that also grant it.
REQUIRED: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("CAP_BPF", (CAP_BPF, CAP_SYS_ADMIN)),
    ("CAP_PERFMON", (CAP_PERFMON, CAP_SYS_ADMIN)),
    ("CAP_DAC_READ_SEARCH", (CAP_DAC_READ_SEARCH, CAP_DAC_OVERRIDE)),
)
# What systemd/auditor.service grants; the fix printed for a missing capability names these.
UNIT_CAPABILITIES = " ".join(name for name, _ in REQUIRED)
# Every capability above, by bit, as ``present_capabilities`` names them.
NAMES = {CAP_DAC_OVERRIDE: "CAP_DAC_OVERRIDE", CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH",
         CAP_SYS_ADMIN: "CAP_SYS_ADMIN", CAP_PERFMON: "CAP_PERFMON", CAP_BPF: "CAP_BPF"}


def effective_capabilities(status: Path = Path("/proc/self/status")) -> int:
    """The CapEff bit mask of this process (0 when it cannot be read)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def missing_bpf_capabilities(caps: int | None = None, euid: int | None = None) -> list[str]:
    """The capabilities bcc needs that ``caps`` (default: this process's) lacks, by name. For root
    (``euid`` 0, default this process's), tracefs's files are its own: no DAC capability is needed."""
    mask = effective_capabilities() if caps is None else caps
    owner = (os.geteuid() if euid is None else euid) == 0
    return [name for name, grants in REQUIRED
            if not any(mask >> bit & 1 for bit in grants) and not (owner and name == "CAP_DAC_READ_SEARCH")]


def present_capabilities(caps: int | None = None) -> list[str]:
    """Those of the capabilities the probe may use that ``caps`` (default: this process's) holds."""
    mask = effective_capabilities() if caps is None else caps
    return [name for bit, name in sorted(NAMES.items(), key=lambda item: item[1]) if mask >> bit & 1]


def capability_mask(*bits: int) -> int:
    """A CapEff-style mask with these capability bits set."""
    mask = 0
    for bit in bits:
        mask |= 1 << bit
    return mask
