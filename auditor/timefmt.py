"""Times as people and machines read them: RFC 3339 in UTC with all nine digits, the one format
every report, table and JSON stream of the auditor prints (``...T10:00:00.000000001Z``).

``auditor.report.sqlite_json`` builds the same text inside SQLite for the JSON fast path; a test
holds the two equal.
"""

from __future__ import annotations

import functools
import time


@functools.lru_cache(maxsize=8192)
def _second_prefix(epoch_seconds: int) -> str:
    # Cached per second: a report formats many times that share their second, and strftime
    # dominates the cost of formatting a nanosecond time.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch_seconds))


def rfc3339(ns: int) -> str:
    """Wall-clock nanoseconds as RFC 3339 UTC with nanosecond precision."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    return f"{_second_prefix(seconds)}.{fraction:09d}Z"


def rfc3339_or_none(ns: int | None) -> str | None:
    return None if ns is None else rfc3339(ns)


def rfc3339_seconds(ns: int) -> str:
    """A time for people: RFC 3339 UTC to the second."""
    return _second_prefix(ns // 1_000_000_000) + "Z"
