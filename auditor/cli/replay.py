"""``auditor capture export`` and ``auditor replay``: prove a fix in staging before it ships.

``capture export`` writes a window of observed requests to a standalone file. ``replay`` sends
them again to an engine on this host with injected cancellations, runs the auditor's own pipeline
(probe on the target port, OTLP receiver the engine exports to, correlation) into the capture file,
and judges every cancelled request. Exit status: 0 no zombie and every cancel judged; 1 zombies;
2 the replay could not run; 3 no zombie, but some cancels got no verdict (inconclusive).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from auditor.cli.util import TIME, common_options, errors_as_click, open_store
from auditor.config import Config, apply_overrides, load_config
from auditor.errors import AuditorError
from auditor.report.model import to_ns

EXIT_ZOMBIES, EXIT_ERROR, EXIT_INCONCLUSIVE = 1, 2, 3


class ReplayError(click.ClickException):
    exit_code = EXIT_ERROR


# -- capture export ---------------------------------------------------------------------------------
@click.group("capture")
def capture() -> None:
    """Captured traffic, kept for replay."""


@capture.command("export")
@click.option("--since", type=TIME, default="1h", show_default=True,
              help="Start of the window: a duration back from now (30m, 1h, 2d) or an RFC 3339 time.")
@click.option("--until", type=TIME, default=None, help="End of the window [default: now].")
@click.option("--host", help="Only requests seen on this host.")
@click.option("--name", default="", help="A name for the capture [default: the file's name].")
@click.option("--stream/--no-stream", "stream_default", default=True, show_default=True,
              help="Replay as streaming where the span does not say (spans rarely do).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The capture file to write (SQLite).")
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@common_options
def export_command(config: Config, since: dt.datetime, until: dt.datetime | None, host: str | None, name: str,
                   stream_default: bool, output: Path, force: bool, as_json: bool) -> None:
    """Write the requests of a window to a standalone capture file for `auditor replay`.

    \b
    Example:
      auditor capture export --since 1h -o capture.db
    """
    from replay.capture import count_server_spans, export_capture

    until = until or dt.datetime.now(dt.timezone.utc)
    if until <= since:
        raise click.BadParameter(f"{until.isoformat(timespec='seconds')} is not after --since "
                                 f"{since.isoformat(timespec='seconds')}; e.g. --since 2h --until 1h",
                                 param_hint="--until")
    store = open_store(config, create=False)
    since_ns, until_ns = to_ns(since), to_ns(until)
    with errors_as_click(), _progress(max(1, count_server_spans(store, since_ns, until_ns, host)),
                                      "  exporting") as bar:
        capture_id, count = export_capture(store, output, since_ns=since_ns, until_ns=until_ns, host=host,
                                           name=name, stream_default=stream_default, force=force,
                                           on_progress=bar.update)
    if as_json:
        click.echo(json.dumps({"capture_id": capture_id, "requests": count, "file": str(output)}))
        return
    if count == 0:
        click.echo(f"warning: no requests between {since.isoformat(timespec='seconds')} and "
                   f"{until.isoformat(timespec='seconds')}; the capture is empty", err=True)
    click.echo(f"capture {capture_id}: {count} requests -> {output}\n"
               f"replay it: auditor replay {output} --target http://127.0.0.1:PORT")


# -- replay -----------------------------------------------------------------------------------------
def _progress(length: int, label: str) -> Any:
    """A progress bar on standard error (standard output stays for the result)."""
    progressbar: Any = click.progressbar  # its overloads confuse mypy
    return progressbar(length=length, label=label, width=30, file=sys.stderr)


def _print_summary(summary: Any, capture: Any) -> None:
    click.secho(f"replay run {summary.run_id} of capture {capture.id} ({capture.name}) against {summary.target}",
                bold=True)
    click.echo(f"  sent {summary.sent}: {summary.completed} completed, {summary.cancelled} cancelled"
               + (f", {summary.errors} errors" if summary.errors else ""))
    judged = ", ".join(f"{name} {count}" for name, count in sorted(summary.verdicts.items())) or "none"
    click.echo(f"  verdicts for the cancelled: {judged}"
               + (f"; no verdict {summary.unjudged}" if summary.unjudged else "")
               + (f"; still provisional {summary.provisional}" if summary.provisional else ""))
    lag = (f"lag p50 {summary.lag_p50_s:.2f} s, max {summary.lag_max_s:.2f} s"
           if summary.lag_p50_s is not None else "lag -")
    click.echo(f"  zombies {summary.zombies}: {summary.zombie_seconds:.1f} zombie-seconds, {lag}, "
               f"{summary.wasted_tokens} tokens after disconnect")
    if summary.worst:
        click.echo(f"  {'request id':<20} {'trace id':<32} {'lag s':>7} {'tokens':>6} {'phase':<8} close")
        for w in summary.worst:
            lag_s = f"{w['lag_seconds']:.2f}" if w["lag_seconds"] is not None else "-"
            click.echo(f"  {w['request_id']:<20} {w['trace_id']:<32} {lag_s:>7} "
                       f"{w['tokens_after_disconnect'] or 0:>6} {w['phase']:<8} {w['disconnect_kind']}")
    for error in summary.first_errors:
        click.echo(f"  error: {error}", err=True)
    if summary.baseline_zombies is not None:
        good = summary.zombies == 0
        against = (f"baseline run {summary.baseline_run_id}" if summary.baseline_run_id is not None
                   else "baseline: the capture's own verdicts")
        click.secho(f"Zombies: {summary.baseline_zombies} → {summary.zombies} ({against})", bold=True,
                    fg="green" if good else "red")


@click.command("replay")
@click.argument("capture_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--target", required=True, metavar="URL", help="The engine on this host, e.g. http://127.0.0.1:8000.")
@click.option("--capture-id", type=click.IntRange(min=1), help="Which capture of the file [default: the newest].")
@click.option("--cancel-rate", type=click.FloatRange(0.0, 1.0),
              help="Fraction of requests cancelled by the client, chosen by --seed [default: 0.3; 0 with "
                   "--as-captured, where it adds cancels to requests the capture saw complete].")
@click.option("--cancel-after", type=click.FloatRange(min=0.0), default=0.5, show_default=True, metavar="SECONDS",
              help="Cancel this long after the request was fully written (0: right after sending).")
@click.option("--as-captured", is_flag=True,
              help="Replay the capture's own disconnects (delay and FIN/RST) instead of --cancel-rate.")
@click.option("--close", "close_with", type=click.Choice(["fin", "rst"]),
              help="How cancelled clients close [default: as captured, else fin].")
@click.option("--speed", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Replay the capture's timing this many times faster; 0: as fast as --concurrency allows.")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=16, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests.")
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--model", help="Send this model name instead of the captured one.")
@click.option("--otlp-http", default="127.0.0.1:4318", show_default=True, metavar="ADDR",
              help="Where to receive the engine's spans (point its OTLP exporter here); '' to disable.")
@click.option("--otlp-grpc", default="", metavar="ADDR", help="OTLP/gRPC receiver address [default: off].")
@click.option("--settle", type=click.FloatRange(min=1.0), default=60.0, show_default=True, metavar="SECONDS",
              help="How long an engine span may follow its request's end and still count (a detached "
                   "engine reports when it finishes).")
@click.option("--span-delay", type=click.FloatRange(min=0.0), default=5.0, show_default=True, metavar="SECONDS",
              help="The engine exporter's batch delay (OTEL_BSP_SCHEDULE_DELAY): once its /metrics shows "
                   "it idle this long, no span can still come.")
@click.option("--wait", "wait_s", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              metavar="SECONDS", help="The longest to wait for verdicts after the last request.")
@click.option("--baseline", metavar="RUN|previous|capture",
              help="Compare with an earlier replay run in this file ('previous': the last one) or with "
                   "the verdicts the capture recorded ('capture').")
@click.option("--json", "as_json", is_flag=True, help="Print the run's result as JSON (docs/replay.md).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML configuration file.")
def replay_command(capture_file: Path, target: str, capture_id: int | None, cancel_rate: float | None,
                   cancel_after: float, as_captured: bool, close_with: str | None, speed: float,
                   concurrency: int, limit: int | None, seed: int, model: str | None, otlp_http: str,
                   otlp_grpc: str, settle: float, span_delay: float, wait_s: float, baseline: str | None,
                   as_json: bool,
                   config_path: str | None) -> None:
    """Re-send captured traffic with injected cancellations and judge every cancel.

    Runs on the engine's host: the probe watches the target's port, and the engine must export
    its spans to --otlp-http. Results are kept in the capture file. Exit status: 0 no zombie,
    1 zombies, 2 could not run, 3 some cancels got no verdict (inconclusive).

    \b
    Examples:
      auditor replay capture.db --target http://127.0.0.1:8000 --cancel-rate 0.3
      auditor replay capture.db --target http://127.0.0.1:8000 --as-captured --baseline previous
    """
    from replay.run import ReplayOptions
    from replay.session import ReplaySettings, local_target

    logging.basicConfig(level=logging.WARNING, format="auditor replay: %(levelname)s %(message)s", stream=sys.stderr)
    if cancel_rate is None:
        cancel_rate = 0.0 if as_captured else 0.3
    options = ReplayOptions(cancel_rate=cancel_rate, cancel_after_s=cancel_after, as_captured=as_captured,
                            close_with=close_with, speed=speed, concurrency=concurrency, limit=limit, seed=seed,
                            model=model)
    try:
        host, port = local_target(target)
        settings = ReplaySettings(capture_file=capture_file, host=host, port=port, options=options,
                                  capture_id=capture_id, otlp_http=otlp_http, otlp_grpc=otlp_grpc, settle_s=settle,
                                  span_delay_s=span_delay, wait_s=wait_s, baseline=baseline)
        summary, capture_data = run_replay_here(load_config(config_path), settings)
    except AuditorError as exc:
        raise ReplayError(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(summary.as_json(), indent=2))
    else:
        _print_summary(summary, capture_data)
    if summary.zombies:
        raise SystemExit(EXIT_ZOMBIES)
    if summary.unjudged:
        click.echo(f"inconclusive: {summary.unjudged} cancelled requests got no verdict; check that the "
                   f"engine exports spans to {otlp_http or otlp_grpc} and serves port {port}", err=True)
        raise SystemExit(EXIT_INCONCLUSIVE)
    if summary.provisional:
        click.echo(f"inconclusive: {summary.provisional} verdicts could still become zombies when --wait ran "
                   "out (the engine was still busy, or shows no /metrics); raise --wait", err=True)
        raise SystemExit(EXIT_INCONCLUSIVE)


def run_replay_here(config: Config, settings: Any) -> tuple[Any, Any]:
    """``replay.session.run_replay`` with this host's daemon as the pipeline, progress on stderr."""
    from auditor.daemon import Daemon
    from replay.session import run_replay

    return run_replay(settings, lambda overrides: Daemon(apply_overrides(config, overrides)),
                      say=lambda line: click.echo(line, err=True), progress=_progress)
