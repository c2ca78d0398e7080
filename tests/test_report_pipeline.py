"""`auditor report` over a store the real pipeline filled: eBPF, OTLP from the engine, correlation."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from auditor.cli import cli
from replay.engine.launch import running_engine
from tests.e2e import cancel_after, complete, running_daemon, verdict_rows, wait_for

pytestmark = pytest.mark.privileged
SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    tmp_path = tmp_path_factory.mktemp("pipeline")
    with running_daemon(tmp_path) as daemon, running_engine(
            behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}", step_ms=10) as engine:
        daemon.set_ports({engine.port})
        threads = [complete(engine.port, stream=True, max_tokens=8, request_id="ok-1"),
                   cancel_after(engine.port, 0.2, "fin", stream=True, max_tokens=150, request_id="zombie-fin"),
                   cancel_after(engine.port, 0.2, "rst", stream=False, max_tokens=150, request_id="zombie-rst")]
        for thread in threads:
            thread.join()
        # ok-1's client closes right after [DONE]: at most a "completed" race, never a finding.
        assert wait_for(lambda: [r.verdict for r in verdict_rows(daemon)].count("zombie") == 2, 40)
        verdicts = {r.request_id: r.verdict for r in verdict_rows(daemon)}
        time.sleep(1)
    return f"sqlite:///{tmp_path / 'auditor.db'}", verdicts


def report(db: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["report", "--db", db, "--since", "10m", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_json_matches_the_verdicts_and_the_schema(filled: tuple[str, dict[str, str]]) -> None:
    db, verdicts = filled
    doc = json.loads(report(db, "--format", "json"))
    jsonschema.validate(doc, SCHEMA)
    assert doc["totals"]["zombies"] == 2 and doc["totals"]["disconnects"] == len(verdicts)
    assert verdicts.get("ok-1", "completed") == "completed"
    assert doc["totals"]["requests"] == 3 and doc["totals"]["wasted_tokens"] > 0
    assert doc["totals"]["zombie_seconds"] > 0.5 and doc["totals"]["wasted_cpu_seconds"] > 0
    assert {r["request_id"]: r["verdict"] for r in doc["requests"]} == verdicts
    kinds = {r["request_id"]: r["disconnect_kind"] for r in doc["requests"]}
    assert (kinds["zombie-fin"], kinds["zombie-rst"]) == ("fin", "rst")


def test_table_csv_and_html(filled: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    db, verdicts = filled
    table = report(db)
    assert all(len(line) <= 100 for line in table.splitlines())
    assert "zombie-fin" in table and "zombie-rst" in table
    rows = list(csv.DictReader(io.StringIO(report(db, "--format", "csv"))))
    assert {row["request_id"] for row in rows} == set(verdicts)
    out = tmp_path / "report.html"
    report(db, "--format", "html", "-o", str(out))
    html = out.read_text()
    assert "<svg" in html and "zombie-fin" in html and "http://" not in html.replace("http://www.w3.org", "")
