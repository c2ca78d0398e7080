"""The ground-truth log: one JSON line per request, written when the request ends.

Times are integer nanoseconds since the Unix epoch (wall clock), the unit of OTLP spans and of the
auditor's kernel events, so comparisons are exact. ``disconnect_at`` is when the client's
disconnect reached the server, recorded whatever the behaviour then does; fields that did not
happen are ``null``. See docs/engine.md for the schema.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from auditor.errors import AuditorError

if TYPE_CHECKING:  # the engine's core is not imported by those who only read the log
    from replay.engine.core import RequestHandle

log = logging.getLogger(__name__)


def truth_record(request: RequestHandle, behavior: str) -> dict[str, Any]:
    return {
        "request_id": request.request_id,
        "arrival_at": request.arrival_at,
        "client_addr": request.client_addr,
        "client_port": request.client_port,
        "stream": request.stream,
        "queued_at": request.queued_at,
        "scheduled_at": request.scheduled_at,
        "first_token_at": request.first_token_at,
        "finished_at": request.finished_at,
        "finish_reason": request.finish_reason,
        "prompt_tokens": request.prompt_tokens,
        "max_tokens": request.max_tokens,
        "tokens_generated": request.tokens_generated,
        "disconnect_at": request.disconnect_at,
        "phase_at_disconnect": request.phase_at_disconnect,
        "tokens_after_disconnect": request.tokens_after_disconnect,
        "compute_seconds_after_disconnect": (None if request.disconnect_at is None
                                             else round(request.compute_after_disconnect_s, 6)),
        "behavior": behavior,
    }


def expected_verdict(truth: dict[str, Any], grace_s: float) -> str:
    """What became of a request whose client left (``disconnect_at`` set), by the engine's own
    record: the verdict the auditor owes it (DESIGN §5)."""
    lag_s = (truth["finished_at"] - truth["disconnect_at"]) / 1e9
    if truth["finish_reason"] in ("stop", "length") and lag_s <= 0:
        return "completed"
    return "aborted" if lag_s <= grace_s else "zombie"


class TruthLogError(AuditorError):
    """The truth log cannot be opened."""


class TruthLog:
    """Appends records as JSON lines, flushed line by line; safe from any thread; never raises."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise TruthLogError(f"cannot open the truth log {self.path}: {exc.strerror}; "
                                "check that its directory exists and is writable") from exc
        self._lock = threading.Lock()
        self.write_errors = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
                self._file.flush()
            except OSError:
                self.write_errors += 1
                if self.write_errors == 1:
                    log.exception("cannot write the truth log %s; further errors are only counted", self.path)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_truth(path: str | Path) -> list[dict[str, Any]]:
    """Parse a truth log; a torn last line (process killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
