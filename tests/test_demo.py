"""`auditor demo`, the README's first command: zombies found against the buggy engine, the traffic
captured, and the replay against the fixed engine gating at zero, with a report and a capture file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.privileged, pytest.mark.slow]


def test_demo_finds_zombies_and_passes_the_gate_after_the_fix(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "auditor", "demo", "-o", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"Zombies: (\d+) → (\d+) \((\d+) requests cancelled", result.stdout)
    assert found, result.stdout[-3000:]
    before, after, cancelled = map(int, found.groups())
    assert 0 < before <= cancelled and after == 0
    assert "errors = 0; gate passed" in result.stdout and "Traceback" not in result.stderr
    assert (tmp_path / "report.html").read_text().count("<svg") >= 2
    assert (tmp_path / "capture.db").stat().st_size > 0 and (tmp_path / "auditor.db").stat().st_size > 0
