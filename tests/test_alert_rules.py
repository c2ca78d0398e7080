"""The Prometheus rules (docs/deploy/prometheus-alerts.yml) checked and run by Prometheus's own
promtool on series shaped as the daemon exports them (tests/alerts/rules.test.yml): a zombie counter
that first appears at 1, one that keeps its count, a restart, one daemon of a fleet down."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def promtool() -> str:
    # .ci/setup.sh puts Debian's promtool in the virtual environment for the tests.
    found = shutil.which("promtool", path=str(Path(sys.executable).parent)) or shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not found: .ci/setup.sh installs it (from Debian's prometheus package)")
    return found


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_the_rules_are_valid() -> None:
    result = run("check", "rules", "prometheus-alerts.yml", cwd=ROOT / "docs" / "deploy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_fire_when_they_should_and_only_then() -> None:
    result = run("test", "rules", "rules.test.yml", cwd=ROOT / "tests" / "alerts")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
