"""``pip install zombie-auditor`` is the daemon and the report; the reference engine's stack is the
``engine`` extra. Checked in a fresh interpreter where the extra's modules cannot be imported: the
core modules never try to, the core commands work, and the engine commands name the extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PACKAGES = {"numpy", "uvicorn", "starlette", "httpx", "opentelemetry-instrumentation-asgi"}

# Runs in a child interpreter: a meta-path finder refuses the engine's modules and records every
# attempt, then the core is imported and the CLI invoked.
CHILD = r"""
import json, sys
BLOCKED = ("numpy", "uvicorn", "starlette", "httpx", "opentelemetry.instrumentation.asgi")
attempts = []

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
import auditor.cli, auditor.cli.report, auditor.cli.run, auditor.cli.doctor, auditor.cli.probe
import auditor.cli.replay, auditor.cli.db, auditor.daemon, auditor.report, auditor.live
import collectors.otlp_http, collectors.otlp_grpc, collectors.nvml, collectors.procfs
import replay.session, replay.capture
imported = list(attempts)
from click.testing import CliRunner
results = {}
for args in (["--help"], ["report", "--help"], ["run", "--help"], ["replay", "--help"],
             ["engine", "--port", "0"], ["engine", "--help"], ["demo"]):
    result = CliRunner().invoke(auditor.cli.cli, args)
    results[" ".join(args)] = [result.exit_code, result.output]
print(json.dumps({"imported": imported, "results": results}))
"""


def run_child() -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_core_runs_without_the_engine_extra() -> None:
    child = run_child()
    assert child["imported"] == []  # the core never even tries to import the engine's stack
    results = child["results"]
    assert isinstance(results, dict)
    for args in ("--help", "report --help", "run --help", "replay --help"):
        code, output = results[args]
        assert code == 0, (args, output)
    assert "Usage: " in results["report --help"][1] and "--since" in results["report --help"][1]
    install = "pip install 'zombie-auditor[engine]'"
    for args, command in (("engine --port 0", "engine"), ("engine --help", "engine"), ("demo", "demo")):
        code, output = results[args]
        assert code == 1, (args, output)
        assert output.startswith(f"Error: `auditor {command}` needs numpy, uvicorn, starlette, httpx")
        assert output.rstrip().endswith(install) and output.count("\n") == 1, output


def test_the_engine_stack_is_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
                for r in requirements}

    assert not names(project["dependencies"]) & ENGINE_PACKAGES
    assert names(project["optional-dependencies"]["engine"]) == ENGINE_PACKAGES
    assert "zombie-auditor[engine,postgres]" in project["optional-dependencies"]["dev"]
