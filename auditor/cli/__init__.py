"""The ``auditor`` command line: one root group whose commands load only when called.

Every command's click code lives in this package (``auditor.cli.<command>``), a thin layer over
the library it drives; the reference engine's own command stays with it in ``replay.engine.cli``.
``auditor --help`` shows exactly the ``COMMANDS`` list.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from auditor import __version__

# name -> "module:attribute"; importing lazily keeps `auditor --help` fast and bcc out of
# commands that do not need it.
COMMANDS: dict[str, str] = {
    "capture": "auditor.cli.replay:capture",
    "db": "auditor.cli.db:db",
    "demo": "auditor.cli.demo:demo_command",
    "doctor": "auditor.cli.doctor:doctor_command",
    "engine": "replay.engine.cli:engine",
    "probe": "auditor.cli.probe:probe",
    "replay": "auditor.cli.replay:replay_command",
    "report": "auditor.cli.report:report",
    "run": "auditor.cli.run:run_command",
}
# Commands that run the reference engine, whose dependencies are the `engine` extra.
NEEDS_ENGINE = {"demo", "engine"}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        if cmd_name in NEEDS_ENGINE:
            missing = _engine_missing(cmd_name)
            if missing is not None:
                return missing
        module_name, _, attribute = target.partition(":")
        command: Any = getattr(importlib.import_module(module_name), attribute)
        return command  # type: ignore[no-any-return]


def _engine_missing(cmd_name: str) -> click.Command | None:
    """A stand-in command that says which extra to install, or None when the engine can run."""
    from auditor.extras import MissingExtraError, require_engine

    try:
        require_engine(cmd_name)
    except MissingExtraError as exc:
        message = str(exc)

        def refuse(args: tuple[str, ...]) -> None:
            raise click.ClickException(message)

        return click.Command(cmd_name, callback=refuse, help=message, add_help_option=False,
                             params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
                             context_settings={"ignore_unknown_options": True})
    return None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="auditor")
def cli() -> None:
    """Find LLM inference that keeps running after its client disconnected.

    Joins kernel TCP close/reset events (eBPF), OpenTelemetry spans (OTLP) and GPU samples (NVML)
    by request, and says how long each zombie ran and what it cost.
    """


def main() -> None:
    cli()
