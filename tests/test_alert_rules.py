"""The Prometheus rules (docs/deploy/prometheus-alerts.yml) checked and run by Prometheus's own
promtool on series shaped as the daemon exports them (tests/alerts/rules.test.yml): a zombie counter
that first appears at 1, one that keeps its count, a restart, one daemon of a fleet down; and the
dashboard's counts over its range on such series."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


# The dashboard's counts over its time range, on series as the daemon exports them: a route and
# model's counters appear with its first verdict (the zombie's at 1, the others at 0). Grafana's
# variables are given the values a user would pick.
DASHBOARD_VARS = {"$__range": "30m", "$instance": ".*"}
DASHBOARD_SERIES = {
    # route a: its first zombie inside the range (10m-40m), and no other; four completed later
    ('zombie', '/a'): '_x15 1x25', ('completed', '/a'): '_x15 0x15 4x10',
    # route b: counters from before the range, no zombie in it
    ('zombie', '/b'): '3x40', ('completed', '/b'): '10x40',
    # route c: first zombie inside the range, two more later: three, not counted twice
    ('zombie', '/c'): '_x15 1x10 3x15', ('completed', '/c'): '_x15 0x25',
}


def dashboard_panel_exprs(title: str) -> list[str]:
    dashboard = json.loads((ROOT / "docs" / "deploy" / "grafana-auditor.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] if panel.get("title") == title
             for target in panel.get("targets", [])]
    assert exprs, title
    for name, value in DASHBOARD_VARS.items():
        exprs = [expr.replace(name, value) for expr in exprs]
    return exprs


def test_the_dashboards_counts_include_a_routes_first_zombie(tmp_path: Path) -> None:
    found = dashboard_panel_exprs("Zombies found")[0]  # the second target is the uncosted ones
    share, = dashboard_panel_exprs("Zombie share of disconnects")
    by_route, = dashboard_panel_exprs("Zombies by route and model")
    series = [{"series": f'auditor_disconnect_verdicts_total{{job="auditor",instance="gpu-1:9464",route="{route}",'
                         f'model="m",verdict="{verdict}"}}', "values": values}
              for (verdict, route), values in DASHBOARD_SERIES.items()]
    tests = [{"expr": found, "eval_time": "40m", "exp_samples": [{"labels": "{}", "value": 4}]},
             {"expr": share, "eval_time": "40m", "exp_samples": [{"labels": "{}", "value": 0.5}]},
             {"expr": by_route, "eval_time": "40m",
              "exp_samples": [{"labels": f'{{route="{route}", model="m"}}', "value": value}
                              for route, value in (("/a", 1), ("/b", 0), ("/c", 3))]}]
    (tmp_path / "dashboard.test.yml").write_text(yaml.safe_dump(
        {"evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series,
                                                 "promql_expr_test": tests}]}))
    result = run("test", "rules", "dashboard.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_dashboards_orphaned_work_is_a_rate_by_port(tmp_path: Path) -> None:
    requests, gpu, cpu = (expr.replace("$__rate_interval", "5m")
                          for expr in dashboard_panel_exprs("Orphaned work by port (request-seconds per second)"))
    labels = 'job="auditor",instance="gpu-1:9464",port="8080",spans="false"'
    spanned = 'job="auditor",instance="gpu-1:9464",port="8000",spans="true"'  # in the verdicts' panels
    # Two orphans at a time for ten minutes: 120 request-seconds a minute, half a GPU each.
    series = [{"series": f"auditor_orphaned_request_seconds_total{{{labels}}}", "values": "0+120x20"},
              {"series": f"auditor_orphaned_wasted_gpu_seconds_total{{{labels}}}", "values": "0+60x20"},
              {"series": f"auditor_orphaned_request_seconds_total{{{spanned}}}", "values": "0+600x20"}]
    tests = [{"expr": requests, "eval_time": "15m",
              "exp_samples": [{"labels": '{instance="gpu-1:9464", port="8080"}', "value": 2}]},
             {"expr": gpu, "eval_time": "15m",
              "exp_samples": [{"labels": '{instance="gpu-1:9464", port="8080"}', "value": 1}]},
             {"expr": cpu, "eval_time": "15m", "exp_samples": []}]
    (tmp_path / "orphaned.test.yml").write_text(yaml.safe_dump(
        {"evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series,
                                                 "promql_expr_test": tests}]}))
    result = run("test", "rules", "orphaned.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboards_cost_prices_each_host_at_its_own(tmp_path: Path) -> None:
    """Each daemon exports its own prices (auditor_hour_price, from its [report] settings): a fleet
    of GPU kinds is priced host by host, a host with no price adds nothing, and the orphaned work
    of ports without spans is added (with spans, its verdicts count the same work already)."""
    cost, = dashboard_panel_exprs("Wasted cost (hosts priced)")
    h100, a10, unpriced = ('job="auditor",instance="h100-1:9464"', 'job="auditor",instance="a10-1:9464"',
                           'job="auditor",instance="cpu-1:9464"')
    series = [
        # Fifteen minutes of counts by the evaluation (the range is longer). h100-1 at 2.40 an hour:
        # 36 GPU-s a minute of zombies (540: 0.36), 360 CPU-s a minute at 0.05 (5,400: 0.075); a
        # spanless port's orphans 18 GPU-s a minute (270: 0.18).
        {"series": f'auditor_hour_price{{{h100},kind="gpu",currency="USD"}}', "values": "2.4x20"},
        {"series": f'auditor_hour_price{{{h100},kind="cpu",currency="USD"}}', "values": "0.05x20"},
        {"series": f"auditor_wasted_gpu_seconds_total{{{h100}}}", "values": "0+36x20"},
        {"series": f"auditor_wasted_cpu_seconds_total{{{h100}}}", "values": "0+360x20"},
        {"series": f'auditor_orphaned_wasted_gpu_seconds_total{{{h100},port="8080",spans="false"}}',
         "values": "0+18x20"},
        {"series": f'auditor_orphaned_wasted_gpu_seconds_total{{{h100},port="8000",spans="true"}}',
         "values": "0+600x20"},
        # a10-1 at 0.90 an hour, GPU only: 36 GPU-s a minute (540: 0.135); its CPU-seconds unpriced.
        {"series": f'auditor_hour_price{{{a10},kind="gpu",currency="USD"}}', "values": "0.9x20"},
        {"series": f"auditor_wasted_gpu_seconds_total{{{a10}}}", "values": "0+36x20"},
        {"series": f"auditor_wasted_cpu_seconds_total{{{a10}}}", "values": "0+360x20"},
        # cpu-1 has no price: nothing.
        {"series": f"auditor_wasted_cpu_seconds_total{{{unpriced}}}", "values": "0+3600x20"},
    ]
    tests = [{"expr": cost, "eval_time": "15m",
              "exp_samples": [{"labels": '{currency="USD"}', "value": 0.36 + 0.075 + 0.18 + 0.135}]}]
    (tmp_path / "cost.test.yml").write_text(yaml.safe_dump(
        {"evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series,
                                                 "promql_expr_test": tests}]}))
    result = run("test", "rules", "cost.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
