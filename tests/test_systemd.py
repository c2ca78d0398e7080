"""The shipped unit: hardened enough (exposure <= 2.0) and clean under systemd-analyze verify."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[1] / "systemd" / "auditor.service"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def installed_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's auditor, so verify can resolve it."""
    auditor = Path(sys.executable).with_name("auditor")
    text = UNIT.read_text().replace("/opt/zombie-auditor/.venv/bin/auditor", str(auditor))
    path = tmp_path / "auditor.service"
    path.write_text(text)
    return path


def test_security_exposure_at_most_2_0(tmp_path: Path) -> None:
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", str(installed_copy(tmp_path))],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for auditor\.service: ([0-9.]+)", result.stdout)
    assert match, result.stdout[-2000:] + result.stderr
    assert float(match.group(1)) <= 2.0


def test_verify_is_clean(tmp_path: Path) -> None:
    result = subprocess.run(["systemd-analyze", "verify", str(installed_copy(tmp_path))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "auditor.service" not in result.stderr, result.stderr


def test_unit_is_notify_with_watchdog_and_state_directory() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "StateDirectory=auditor", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "CapabilityBoundingSet=CAP_BPF CAP_PERFMON CAP_DAC_READ_SEARCH"):
        assert line in text


def test_unit_grants_exactly_what_the_probe_checks() -> None:
    from probes.caps import UNIT_CAPABILITIES

    text = UNIT.read_text()
    assert f"AmbientCapabilities={UNIT_CAPABILITIES}\n" in text
    assert f"CapabilityBoundingSet={UNIT_CAPABILITIES}\n" in text
