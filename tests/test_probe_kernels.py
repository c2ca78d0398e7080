"""The prebuilt probe on kernels other than this host's: Debian 11's 5.10 (whose tcp:* records
lack the family field and lay every address two bytes earlier: the loader moves the programs'
loads and takes the ones that read the family from the socket) and Debian 12's 6.1, each booted
in a virtual machine by bench/probe_kernels.py, with no bcc and no kernel headers there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_the_prebuilt_probe_loads_and_reports_on_5_10_and_6_1() -> None:
    missing = [tool for tool in ("qemu-system-x86_64", "busybox") if shutil.which(tool) is None]
    if missing:
        message = f"{', '.join(missing)} not installed (make setup installs qemu-system-x86 and busybox-static)"
        if os.environ.get("AUDITOR_REQUIRE_PRIVILEGED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run([sys.executable, "bench/probe_kernels.py", "--suites", "bullseye,bookworm", "--json",
                             "--timeout", "400"], cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {row.get("kernel", row["image"])[:4]: row for row in json.loads(result.stdout)}
    assert set(rows) == {"5.10", "6.1."}, result.stdout[-3000:]
    for release, row in rows.items():
        assert row["refused"] is None and "load_error" not in row, row
        closes = row["closes"]
        # Each close as the probe tells it on this host: a client's FIN then the close, a client's
        # reset alone, the server closing first.
        assert closes["client FIN"].startswith("peer_fin,closed ("), (release, closes)
        assert closes["client reset"].startswith("peer_rst ("), (release, closes)
        assert closes["server first"] == "local_fin", (release, closes)
