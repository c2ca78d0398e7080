"""Why the eBPF probe cannot run: each missing piece is named with its fix, before bcc is touched."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from probes import ProbeUnavailable, open_source
from probes.bpf import (
    CLIENT_SLOT_BITS,
    bpf_unavailable_reason,
    default_client_slot_bits,
    default_wakeup_every,
)
from probes.caps import (
    CAP_BPF,
    CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    capability_mask,
    missing_bpf_capabilities,
)

UNIT_CAPS = capability_mask(CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH)


def fake_host(root: Path, *, tracefs: bool = True, tracepoints: bool = True,
              headers: bool = True) -> dict[str, object]:
    tracing = root / "tracing"
    if tracefs:
        (tracing / "events").mkdir(parents=True)
    if tracepoints:
        for name in ("sock/inet_sock_set_state", "tcp/tcp_receive_reset", "tcp/tcp_rcv_space_adjust"):
            (tracing / "events" / name).mkdir(parents=True)
            (tracing / "events" / name / "format").write_text("name: x\n")
    modules = root / "modules"
    if headers:
        (modules / platform.release() / "build" / "include").mkdir(parents=True)
    return {"tracefs_roots": [tracing], "modules_root": modules,
            "kheaders": root / "no-kheaders", "check_bcc": False, "caps": UNIT_CAPS, "euid": 65534}


def test_a_complete_host_has_no_reason(tmp_path: Path) -> None:
    assert bpf_unavailable_reason(**fake_host(tmp_path)) is None  # type: ignore[arg-type]


def test_the_prebuilt_probe_needs_no_kernel_headers_or_bcc(tmp_path: Path) -> None:
    host = fake_host(tmp_path, headers=False)
    host["check_bcc"] = True
    assert bpf_unavailable_reason(**host, compiles=False) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("setup", "reason", "fix"), [
    ({"caps": 0}, "eBPF needs CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH", "use --source procfs"),
    ({"caps": capability_mask(CAP_BPF, CAP_PERFMON)}, "eBPF needs CAP_DAC_READ_SEARCH",
     "AmbientCapabilities=CAP_BPF CAP_PERFMON CAP_DAC_READ_SEARCH"),
    ({"tracefs": False, "tracepoints": False}, "tracefs is not mounted",
     "mount -t tracefs nodev /sys/kernel/tracing` (at boot: `systemctl enable --now sys-kernel-tracing.mount`), "
     "then restart the daemon"),
    ({"tracepoints": False}, "no sock:inet_sock_set_state tracepoint", "Linux 4.16"),
    ({"headers": False}, "kernel headers are missing", "apt-get install linux-headers-"),
])
def test_each_missing_piece_is_named_with_its_fix(tmp_path: Path, setup: dict[str, object],
                                                  reason: str, fix: str) -> None:
    caps = setup.pop("caps", UNIT_CAPS)
    kwargs = fake_host(tmp_path, **setup)  # type: ignore[arg-type]
    kwargs["caps"] = caps
    problem = bpf_unavailable_reason(**kwargs)  # type: ignore[arg-type]
    assert problem is not None
    assert reason in problem.reason and fix in problem.fix
    assert str(problem) == f"{problem.reason}: {problem.fix}"


@pytest.mark.privileged
def test_without_bcc_the_prebuilt_probe_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bcc", None)
    source = open_source([8000], prefer="bpf")
    try:
        assert source.loader == "prebuilt" and source.prebuilt_refused is None  # type: ignore[attr-defined]
    finally:
        source.stop()


def test_prefer_bpf_without_bcc_or_a_prebuilt_probe_raises_the_doctor_message(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "bcc", None)
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", tmp_path / "missing.json")
    with pytest.raises(ProbeUnavailable) as caught:
        open_source([8000], prefer="bpf")
    message = str(caught.value)
    assert ("bcc is not importable: run `make setup` as root (apt-get install python3-bpfcc)"
            in message) or "eBPF needs CAP_" in message


def test_the_fallback_says_what_its_polls_cost_on_this_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A host whose tracefs is unmounted (an H200 micro-VM's image) ran the /proc fallback at 17.7%
    of a core: the log line says the walk's measured cost, not only what the fallback loses."""
    monkeypatch.setitem(sys.modules, "bcc", None)
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", tmp_path / "missing.json")
    monkeypatch.setattr("probes.sockdiag.walk_cpu_us", lambda repeats=100: 4708.0)
    with caplog.at_level("WARNING", logger="probes.source"):
        source = open_source([8000], prefer="auto", poll_hz=20)
    assert type(source).__name__ == "ProcfsConnEventSource"
    [line] = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert "4708 us of CPU here: about 9.4% of a core" in line and "auditor doctor" in line


def test_prefer_bpf_names_why_the_prebuilt_probe_was_refused_too(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "disconnect.prebuilt.json"
    broken.write_text("garbage")
    monkeypatch.setitem(sys.modules, "bcc", None)
    monkeypatch.setattr("probes.prebuilt.PREBUILT_FILE", broken)
    with pytest.raises(ProbeUnavailable) as caught:
        open_source([8000], prefer="bpf")
    message = str(caught.value)
    assert ("the prebuilt probe disconnect.prebuilt.json is not usable (not JSON" in message
            and "; and to compile it, bcc is not importable" in message) or "eBPF needs CAP_" in message


def test_unsignalled_records_never_fill_more_than_a_quarter_of_the_ring() -> None:
    for pages, cpus in [(4096, 2), (4096, 256), (1, 2), (16384, 64), (1, 512)]:
        every = default_wakeup_every(pages, cpus)
        assert 1 <= every <= 1024
        assert every == 1 or every * cpus * 64 <= pages * 4096 // 4
    assert default_wakeup_every(4096, 2) == 1024


@pytest.mark.parametrize(("bits", "missing"), [
    ((CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH), []),
    ((CAP_SYS_ADMIN, CAP_DAC_OVERRIDE), []),  # kernels before 5.8: CAP_SYS_ADMIN covers both
    ((CAP_BPF, CAP_PERFMON), ["CAP_DAC_READ_SEARCH"]),  # bcc cannot read tracefs formats
    ((CAP_DAC_READ_SEARCH,), ["CAP_BPF", "CAP_PERFMON"]),
])
def test_readiness_is_decided_by_capabilities(bits: tuple[int, ...], missing: list[str]) -> None:
    assert missing_bpf_capabilities(capability_mask(*bits), euid=65534) == missing


def test_root_reads_its_own_tracefs_without_a_dac_capability() -> None:
    """tracefs is 0700 root: root reads it as its owner. Root with only CAP_BPF and CAP_PERFMON
    loads the probe (the prebuilt one loads and attaches so); it used to be sent to the fallback
    and told to run as root."""
    assert missing_bpf_capabilities(capability_mask(CAP_BPF, CAP_PERFMON), euid=0) == []
    assert missing_bpf_capabilities(capability_mask(CAP_DAC_READ_SEARCH), euid=0) == ["CAP_BPF", "CAP_PERFMON"]


def test_doctor_and_probe_agree_on_this_process() -> None:
    from auditor.cli.doctor import OK, check_privileges

    probe_refuses = bool(missing_bpf_capabilities())
    assert (check_privileges().state != OK) == probe_refuses


@pytest.mark.parametrize(("release", "bits"), [
    ("6.1.0-18-cloud-amd64", CLIENT_SLOT_BITS), ("5.12.0", CLIENT_SLOT_BITS), ("6.18.44-fc-v1045", CLIENT_SLOT_BITS),
    ("5.11.22", 0), ("5.10.0-28-amd64", 0), ("4.18.0-553.el8_10.x86_64", 0), ("custom", 0), ("", 0),
])
def test_client_slots_only_where_the_kernel_has_bpf_compare_and_swap(release: str, bits: int) -> None:
    assert default_client_slot_bits(release) == bits


@pytest.mark.privileged
def test_doctor_says_what_the_prebuilt_probe_changed_to_fit_the_kernel(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    # A kernel whose tcp:* records lack the family (5.10's), as this one's tracefs told without it.
    from auditor.cli.doctor import OK, check_prebuilt_probe
    from tests.test_probe_bpf import tracefs_without_tcp_family

    monkeypatch.setattr("probes.bpf.TRACEFS_ROOTS", (tracefs_without_tcp_family(tmp_path),))
    check = check_prebuilt_probe()
    assert check.state == OK, check
    assert check.detail.startswith("loaded and attached without bcc in ")
    assert ("(fitted to this kernel: tcp:tcp_receive_reset: the record has no family field; the socket's is "
            "read instead; tcp:tcp_rcv_space_adjust: the record has no family field") in check.detail
