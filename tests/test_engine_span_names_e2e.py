"""Engine spans by convention, not one name: the reference engine names its engine span as the
GenAI semantic conventions do ("{operation} {model}" with ``gen_ai.operation.name``), or by a name
only the configuration knows, and the verdicts still match its truth log as with vLLM's
``llm_request`` (real eBPF, real OTLP export, real engine)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from replay.engine.launch import running_engine
from tests.e2e import running_daemon, verdict_rows, wait_for
from tests.test_daemon_e2e import daemon_overrides, drive, mismatches

pytestmark = [pytest.mark.privileged, pytest.mark.slow]


def judged(tmp_path: Path, behavior: str, span: str, **config: Any) -> tuple[list[str], list[Any]]:
    truth_log = tmp_path / "truth.jsonl"
    overrides = daemon_overrides("bpf", **{"correlate.late_span_seconds": 30.0, **config})
    with running_daemon(tmp_path, **overrides) as daemon, running_engine(
            behavior=behavior, otlp=f"http://127.0.0.1:{daemon.status.http_port}", truth_log=truth_log,
            step_ms=10, max_batch=2, extra_args=["--late-seconds", "1.0", "--trace-aborted",
                                                 "--engine-span", span]) as engine:
        daemon.set_ports({engine.port})
        drive(engine.port, behavior)
        cancelled = {f"cmpl-{behavior}-{name}" for name in ("queued", "decode-fin", "decode-rst", "prefill")}
        assert wait_for(lambda: cancelled <= {t["request_id"] for t in engine.truth()}, timeout_s=20)
        truths = [t for t in engine.truth() if t.get("disconnect_at")]
        assert wait_for(lambda: len(verdict_rows(daemon)) >= len(truths), timeout_s=15)
        time.sleep(1.0)
        rows = verdict_rows(daemon)
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
