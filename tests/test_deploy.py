"""The shipped Grafana dashboard and Prometheus alert rules ask only for metrics the daemon exports.

The list of metrics is not written down here: a real daemon is started and its /metrics scraped, so
a renamed metric breaks this test instead of silently emptying a panel or muting an alert.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from auditor.metrics import SourceReadings, readings_families
from tests.e2e import running_daemon

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
# Parts of PromQL that hold no metric name: strings, label matchers, ranges, grouping clauses, numbers.
NOT_NAMES = [r'"(?:[^"\\]|\\.)*"', r"\{[^}]*\}", r"\[[^\]]*\]",
             r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
             r"(?<![\w:])(?:\d+(?:ms|[smhdwy]))+\b", r"(?<![\w:])\d+(?:\.\d+)?(?:e[+-]?\d+)?"]


# Series Prometheus makes of each target itself (a daemon that is down exports nothing).
PROMETHEUS_OWN = {"up"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers left once everything else is removed,
    that are not a function call or an operator keyword."""
    label_values = re.fullmatch(r"\s*label_values\(\s*([\w:]+)\s*,\s*\w+\s*\)\s*", expr)
    if label_values:  # Grafana's variable query
        return {label_values.group(1)}
    for pattern in NOT_NAMES:
        expr = re.sub(pattern, " ", expr)
    return {m.group(1) for m in re.finditer(r"(?<![\w:$])([a-zA-Z_:][\w:]*)\b(?!\s*\()", expr)} - KEYWORDS


def exported_series_names(port: int) -> dict[str, set[str]]:
    """Each family of one scrape of the running daemon, with the series names a query may use."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {f.name: {f.name + suffix for suffix in SUFFIXES.get(f.type, ("",))}
            for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    with running_daemon(tmp_path_factory.mktemp("deploy"), **{"probe.source": "procfs"}) as daemon:
        assert daemon.status.metrics_port
        names = exported_series_names(daemon.status.metrics_port)
    # What only the eBPF source adds (the probe's kernel time), from the same code, with its readings.
    ebpf = SourceReadings(source="bpf", probe_runs={"sock:inet_sock_set_state": (1, 1)}, probe_run_stats=True)
    # And what a port with an engine, one several pods serve, adds (its scrapes; those left out;
    # the work it ran for clients that had left).
    engines = SourceReadings(engine_scrapes={(8000, "read"): 1}, engine_servers_left_out={8000: 0},
                             engine_listings={(8000, True): 1},
                             orphaned_work={(8000, False): (1.0, 0.5, 0.0)})
    for family in [*readings_families(ebpf), *readings_families(engines)]:
        names.setdefault(family.name, {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))})
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-auditor.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_metric_names_are_found_in_promql() -> None:
    # The checker itself must see through functions, matchers, ranges and grouping.
    expr = ('sum by (instance) (rate(a_total{verdict="zombie",x=~"$i"}[$__rate_interval])) / '
            'clamp_min(sum(rate(b_total[15m])), 1e-9) > 0.2 and on (instance) max(c) == 0')
    assert metric_names(expr) == {"a_total", "b_total", "c"}
    assert metric_names("histogram_quantile(0.95, sum by (le) (rate(h_bucket[5m])))") == {"h_bucket"}
    assert metric_names("label_values(auditor_build_info, instance)") == {"auditor_build_info"}
    assert metric_names("a unless a offset 10m or b offset 1h30m") == {"a", "b"}


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_names_only_exported_metrics(source: str, exported: dict[str, set[str]]) -> None:
    samples = set().union(*exported.values()) | PROMETHEUS_OWN
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= samples, f"{sorted(names - samples)} not exported; used in {expr}"


def test_alerts_cover_findings_divergence_and_health() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yml").read_text())
    used = set().union(*(metric_names(expr) for expr in alert_exprs()))
    for name in ("auditor_disconnect_verdicts_total", "auditor_inflight_zombies", "auditor_wasted_gpu_seconds_total",
                 "auditor_unjoined_disconnects_total", "auditor_kernel_events_lost_total",
                 "auditor_store_write_errors_total"):
        assert name in used, name
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


def test_dashboard_shows_every_exported_family(exported: dict[str, set[str]]) -> None:
    shown = set().union(*(metric_names(expr) for expr in dashboard_exprs()))
    # The per-second gauge stays for dashboards built on it; this one uses its counter.
    kept_for_compatibility = {"auditor_completed_requests_per_second"}
    missing = {family for family, series in exported.items()
               if family not in kept_for_compatibility and not series & shown}
    assert not missing, f"exported but on no panel: {sorted(missing)}"
