"""The Kubernetes DaemonSet keeps the promises of the systemd unit, and asks only for what exists.

Its ConfigMap is loaded by the real configuration loader and its command line is checked against
``auditor run --help``, so a renamed key or flag breaks this test instead of a rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from auditor.cli import cli
from auditor.config import load_config
from auditor.errors import ConfigError
from auditor.promtext import HEALTH_PATH

MANIFEST = Path(__file__).resolve().parent.parent / "docs" / "deploy" / "daemonset.yaml"


@pytest.fixture(scope="module")
def documents() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


@pytest.fixture(scope="module")
def pod(documents: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = documents["DaemonSet"]["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["containers"]
    return dict(only)


def test_runs_on_gpu_nodes_only(pod: dict[str, Any]) -> None:
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])


def test_sees_the_nodes_sockets_and_processes(pod: dict[str, Any]) -> None:
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_has_exactly_the_units_capabilities(container: dict[str, Any]) -> None:
    unit = (Path(__file__).resolve().parent.parent / "systemd" / "auditor.service").read_text()
    ambient = next(line for line in unit.splitlines() if line.startswith("AmbientCapabilities="))
    unit_caps = {cap.removeprefix("CAP_") for cap in ambient.split("=", 1)[1].split()}
    security = container["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == unit_caps == {"BPF", "PERFMON", "DAC_READ_SEARCH"}
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert not security.get("privileged", False)


def test_mounts_kernel_interfaces_read_only_and_state_writable(pod: dict[str, Any],
                                                                container: dict[str, Any]) -> None:
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug", "/lib/modules", "/usr/src"):
        assert mounts[path]["readOnly"] is True, path
        assert host_paths[mounts[path]["name"]] == path
    state = mounts["/var/lib/auditor"]
    assert not state.get("readOnly", False) and host_paths[state["name"]] == "/var/lib/auditor"
    assert "/tmp" in mounts  # bcc writes there; the root filesystem is read-only


def test_nvml_through_the_nvidia_runtime(pod: dict[str, Any], container: dict[str, Any]) -> None:
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert pod.get("runtimeClassName") == "nvidia" or env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})  # watches GPUs, takes none


def test_liveness_asks_the_health_of_the_metrics_listener(documents: dict[str, dict[str, Any]],
                                                          container: dict[str, Any], tmp_path: Path) -> None:
    """/healthz fails when the correlator stops (tests/test_daemon_health.py); /metrics would not."""
    config = load_config(_config_file(documents, tmp_path), environ={})
    host, _, port = config.metrics.listen.rpartition(":")
    probe = container["livenessProbe"]["httpGet"]
    assert (probe["host"], probe["port"], probe["path"]) == (host, int(port), HEALTH_PATH)
    ready = container["readinessProbe"]["httpGet"]
    assert (ready["host"], ready["port"]) == (host, int(port))


def test_services_put_no_variables_in_the_daemons_environment(pod: dict[str, Any]) -> None:
    """Kubernetes gives a pod AUDITOR_SERVICE_HOST, AUDITOR_PORT, ... for a Service named auditor in
    its namespace; every AUDITOR_* variable is configuration, and those would stop the daemon."""
    with pytest.raises(ConfigError, match="AUDITOR_PORT is not a configuration key"):
        load_config(None, environ={"AUDITOR_PORT": "tcp://10.0.0.1:9464"})
    assert pod["enableServiceLinks"] is False


def test_config_map_is_a_valid_configuration(documents: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    config = load_config(_config_file(documents, tmp_path), environ={})
    assert config.db == "sqlite:////var/lib/auditor/auditor.db"  # on the hostPath, where the unit keeps it


def test_command_uses_only_flags_auditor_run_accepts(container: dict[str, Any]) -> None:
    command = container["command"]
    assert command[:2] == ["auditor", "run"]
    flags = [arg.split("=", 1)[0] for arg in command[2:] if arg.startswith("-")]
    assert flags, "the command should pass --config"
    help_text = CliRunner().invoke(cli, ["run", "--help"]).output
    for flag in flags:
        assert f"{flag} " in help_text or f"{flag}," in help_text, f"`auditor run` has no {flag}"
    config_path = command[command.index("--config") + 1]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(config_path).parent) in mounts


def _config_file(documents: dict[str, dict[str, Any]], directory: Path) -> Path:
    path = directory / "auditor.toml"
    path.write_text(documents["ConfigMap"]["data"]["auditor.toml"])
    return path
