"""``/healthz``: the liveness answer for what a scrape of /metrics (served on its own thread)
cannot tell, a correlator whose rounds stopped."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from auditor.daemon import stalled_after
from tests.e2e import running_daemon, wait_for


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_healthz_fails_while_the_correlator_is_stuck_and_recovers(tmp_path: Path) -> None:
    with running_daemon(tmp_path, **{"probe.source": "procfs"}) as daemon:
        port = daemon.status.metrics_port
        assert port is not None
        assert wait_for(lambda: daemon.status.ticks > 0, timeout_s=10)
        status, body = get(port, "/healthz")
        assert status == 200 and body.startswith("ok: last correlation round"), (status, body)

        # The correlator's round blocks (a hung database call, a deadlock): /metrics still answers.
        release = threading.Event()
        tick = daemon.correlator.tick

        def stuck(*args: Any, **kwargs: Any) -> None:
            release.wait(30)
            tick(*args, **kwargs)

        daemon.correlator.tick = stuck  # type: ignore[method-assign]
        time.sleep(0.5)  # the round now in progress is the stuck one
        ticks = daemon.status.ticks
        # Stand in for the wait: the last round ended longer ago than the watchdog allows.
        daemon._round_ended -= stalled_after(daemon.config.correlate.interval_seconds) + 1
        status, body = get(port, "/healthz")
        assert status == 503 and body.startswith("stalled: no correlation round for"), (status, body)
        assert daemon.status.ticks == ticks  # truly stuck, not merely slow
        assert get(port, "/metrics")[0] == 200  # what the old liveness check asked, and passed

        daemon.correlator.tick = tick  # type: ignore[method-assign]
        release.set()
        assert wait_for(lambda: get(port, "/healthz")[0] == 200, timeout_s=10)


def test_healthz_stays_up_while_rounds_fail(tmp_path: Path) -> None:
    """A failing round (the database away) is reported, not a reason to be restarted."""
    with running_daemon(tmp_path, **{"probe.source": "procfs"}) as daemon:
        port = daemon.status.metrics_port
        assert port is not None

        def failing(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("database is locked")

        daemon.correlator.tick = failing  # type: ignore[method-assign]
        assert wait_for(lambda: get(port, "/healthz")[1].startswith("ok, but correlation rounds fail"), timeout_s=10)
        assert get(port, "/healthz")[0] == 200


def test_stalled_after_is_the_units_watchdog_or_five_rounds() -> None:
    assert stalled_after(1.0) == 30.0
    assert stalled_after(10.0) == 50.0
