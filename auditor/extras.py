"""Optional dependency sets: what ``pip install zombie-auditor`` leaves out, and how to say so.

The daemon and the report need none of the reference engine's stack (an ASGI server, NumPy, an
HTTP client). Commands that run the engine check for it before they start, so a missing package
is one line naming the extra to install instead of a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util

from auditor.errors import AuditorError

# Top-level import names of the `engine` extra (pyproject.toml), checked by what the engine imports.
ENGINE_MODULES = ("numpy", "uvicorn", "starlette", "httpx", "opentelemetry.instrumentation.asgi")
ENGINE_INSTALL = "pip install 'zombie-auditor[engine]'"


class MissingExtraError(AuditorError):
    """A command needs an optional dependency set that is not installed."""


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The names among ``names`` that cannot be imported here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package is missing, or a finder refused it
            found = False
        if not found:
            missing.append(name)
    return missing


def require_engine(command: str) -> None:
    """Raise MissingExtraError when ``auditor <command>`` cannot run the reference engine."""
    missing = missing_modules(ENGINE_MODULES)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtraError(f"`auditor {command}` needs {', '.join(missing)}, which {verb} not installed; "
                                f"{ENGINE_INSTALL}")
