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
    replayed = re.search(r"--as-captured: .*; verdicts: (.*)", result.stdout)
    assert replayed and re.fullmatch(r"\d+ [a-z_]+(, \d+ [a-z_]+)*", replayed.group(1)), result.stdout[-3000:]
    assert (tmp_path / "report.html").read_text().count("<svg") >= 2
    assert (tmp_path / "capture.db").stat().st_size > 0 and (tmp_path / "auditor.db").stat().st_size > 0


def test_a_demo_stopped_by_sigterm_stops_its_engine_and_clears_its_scratch(tmp_path: Path) -> None:
    """SIGTERM (systemd, timeout, kill) unwinds the demo as Ctrl-C does: the engine it started is
    stopped by it (its scratch directory removed), not left generating with nobody to stop it."""
    import os
    import signal

    demo = subprocess.Popen([sys.executable, "-m", "auditor", "demo", "-o", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # the buggy engine serves its load from here on
            if " requests to http://" in line:
                break
        engines = []
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if entry.name.isdigit() and int(stat.rsplit(") ", 1)[1].split()[1]) == demo.pid and b"replay.engine" in argv:
                engines.append((int(entry.name), Path(argv[argv.index(b"--port-file") + 1].decode()).parent))
        assert len(engines) == 1, engines
        (engine_pid, scratch), = engines
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=30)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert not scratch.exists(), f"{scratch} left behind"
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
