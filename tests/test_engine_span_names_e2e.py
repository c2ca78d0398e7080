"""Engine spans by convention, not one name: the reference engine names its engine span as the
GenAI semantic conventions do ("{operation} {model}" with ``gen_ai.operation.name``), or by a name
only the configuration knows, and the verdicts still match its truth log as with vLLM's
``llm_request`` (real eBPF, real OTLP export, real engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replay.engine.launch import running_engine
from tests.e2e import running_daemon
from tests.test_daemon_e2e import daemon_overrides, drive_and_judge, mismatches

pytestmark = [pytest.mark.privileged, pytest.mark.slow]


def judged(tmp_path: Path, behavior: str, span: str, **config: Any) -> tuple[list[str], list[Any]]:
    truth_log = tmp_path / "truth.jsonl"
    overrides = daemon_overrides("bpf", **{"correlate.late_span_seconds": 30.0, **config})
    with running_daemon(tmp_path, **overrides) as daemon, running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=2, extra_args=["--late-seconds", "1.0", "--trace-aborted",
                                                 "--engine-span", span]) as engine:
        _, truths, rows = drive_and_judge(daemon, engine, behavior)
    return mismatches(rows, truths, "bpf", set()), rows


@pytest.mark.parametrize("behavior", ["abort", "detached"])
def test_genai_convention_engine_span_gives_the_truths_verdicts(tmp_path: Path, behavior: str) -> None:
    problems, rows = judged(tmp_path, behavior, "genai")
    assert not problems, "\n".join(problems)
    cancelled = [r for r in rows if r.verdict != "completed"]
    # Decided by the renamed span itself, not by a weaker signal.
    assert cancelled and all(r.details["engine_span"] and r.details["evidence"] == "engine_span" for r in cancelled)


def test_a_configured_engine_span_name_gives_the_truths_verdicts(tmp_path: Path) -> None:
    problems, rows = judged(tmp_path, "detached", "generate_request", **{"spans.engine_names": ["generate_*"]})
    assert not problems, "\n".join(problems)
    assert any(r.verdict == "zombie" and r.details["evidence"] == "engine_span" for r in rows)
