"""The daemon's Prometheus metrics without a daemon: completions, label bounds."""

from __future__ import annotations

from types import SimpleNamespace

from auditor.daemon import completed_requests
from auditor.metrics import MAX_LABEL_VALUES, DaemonMetrics


def span(role: str, http_status: int | None = None, finish_reason: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(role=role, http_status=http_status, finish_reason=finish_reason)


def test_completions_come_from_engine_spans_once_an_engine_reports() -> None:
    # A cancelled stream ends its HTTP span "200 OK": only the engine knows it did not finish.
    rows = [span("http_server", 200), span("http_server", 200), span("engine", finish_reason="stop"),
            span("engine", finish_reason="abort"), span("engine", finish_reason="length")]
    assert completed_requests(rows, engine_spans_seen=False) == (2, True)
    # A later round with HTTP spans only still counts engine spans (none yet): no double counting.
    assert completed_requests([span("http_server", 200)], engine_spans_seen=True) == (0, True)


def test_completions_fall_back_to_http_spans_without_an_engine() -> None:
    rows = [span("http_server", 200), span("http_server", 499), span("http_server", None), span("other")]
    assert completed_requests(rows, engine_spans_seen=False) == (1, False)


def test_completed_rate_is_over_the_last_minute() -> None:
    metrics = DaemonMetrics()
    metrics.completed(120, now=1000.0)
    assert metrics.registry.get_sample_value("auditor_completed_requests_per_second") == 2.0
    metrics.completed(30, now=1061.0)  # the first 120 are older than a minute
    assert metrics.registry.get_sample_value("auditor_completed_requests_per_second") == 0.5


def test_label_values_are_bounded() -> None:
    metrics = DaemonMetrics()
    labels = [metrics._label("route", f"/r{i}") for i in range(MAX_LABEL_VALUES + 5)]
    assert labels[:MAX_LABEL_VALUES] == [f"/r{i}" for i in range(MAX_LABEL_VALUES)]
    assert set(labels[MAX_LABEL_VALUES:]) == {"other"}
    assert metrics._label("route", None) == "other"  # "unknown" is new too, and there is no room
    assert metrics._label("route", "/r0") == "/r0"
