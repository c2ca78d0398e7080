"""Shared fixtures and the meaning of the markers.

- ``privileged``: needs root and a working eBPF stack. Where ``AUDITOR_REQUIRE_PRIVILEGED=1`` (CI),
  a missing capability fails the test loudly; elsewhere it is skipped with the reason.
- ``compiles``: a privileged test that also compiles the probe with bcc (kernel headers included);
  on a host where only the prebuilt probe loads it is skipped, the prebuilt ones run.
- ``gpu``: needs NVML and at least one GPU; skipped with the reason where NVML finds none.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from auditor.store import Store
from collectors.spanwriter import SpanWriter
from tests.pgserver import find_pg_bin, postgres_server


def _bpf_unavailable_reason(compiles: bool = True) -> str | None:
    # The probe's own judgement (capabilities, tracefs; with ``compiles``, bcc and kernel headers
    # too): one answer everywhere.
    from probes.bpf import bpf_unavailable_reason

    problem = bpf_unavailable_reason(compiles=compiles)
    return None if problem is None else str(problem)


def _gpu_unavailable_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return "NVML found no GPU"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound and friends
        return f"NVML unavailable here ({exc})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {compiles: _bpf_unavailable_reason(compiles) for compiles in (False, True)}
    gpu_reason = _gpu_unavailable_reason() if any("gpu" in i.keywords for i in items) else None
    required = os.environ.get("AUDITOR_REQUIRE_PRIVILEGED") == "1"
    for item in items:
        bpf_reason = reasons["compiles" in item.keywords]
        if "privileged" in item.keywords and bpf_reason and not required:
            item.add_marker(pytest.mark.skip(reason=f"privileged: {bpf_reason}"))
        if "gpu" in item.keywords and gpu_reason:
            item.add_marker(pytest.mark.skip(reason=f"gpu: {gpu_reason}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "privileged" in item.keywords and os.environ.get("AUDITOR_REQUIRE_PRIVILEGED") == "1":
        reason = _bpf_unavailable_reason("compiles" in item.keywords)
        if reason:
            pytest.fail(f"privileged test cannot run here, and CI requires it: {reason}", pytrace=False)


@pytest.fixture
def bpf_run_stats() -> Iterator[None]:
    """The kernel counts BPF programs' runs (kernel.bpf_stats_enabled) during the test; as it was after."""
    from probes.bpfsys import STATS_SYSCTL

    before = STATS_SYSCTL.read_text()
    STATS_SYSCTL.write_text("1")
    try:
        yield
    finally:
        STATS_SYSCTL.write_text(before)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A fresh SQLite store built by running the migrations."""
    s = Store(f"sqlite:///{tmp_path / 'auditor.db'}")
    yield s
    s.close()


@pytest.fixture
def writer(store: Store) -> Iterator[SpanWriter]:
    """A running SpanWriter on the fresh store, as the OTLP receivers are given."""
    w = SpanWriter(store).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """A real PostgreSQL server in a temporary directory, on loopback, for one test module."""
    if find_pg_bin() is None:
        if os.environ.get("AUDITOR_REQUIRE_PRIVILEGED") == "1":
            pytest.fail("PostgreSQL server binaries missing in CI: `make setup` should install them")
        pytest.skip("PostgreSQL server binaries not installed (make setup as root installs them)")
    with tempfile.TemporaryDirectory() as base, postgres_server(Path(base)) as url:
        yield url
