"""``auditor capture export`` and ``auditor replay``: prove a fix in staging before it ships.

``capture export`` writes a window of observed requests to a standalone file. ``replay`` sends
them again to an engine on this host with injected cancellations, runs the auditor's own pipeline
(probe on the target port, OTLP receiver the engine exports to, correlation) into the capture file,
and judges every cancelled request. Exit status: 0 no zombie and every cancel judged; 1 zombies;
2 the replay could not run; 3 no zombie, but some cancels got no verdict (inconclusive); 4 the run
was unsound: requests failed (4xx/5xx, refused, timed out) or fewer cancels happened than planned.
``capture import`` turns an AIPerf profile export or a mooncake trace into a capture.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from auditor.cli.util import (
    TIME,
    errors_as_click,
    now,
    open_store,
    reading_options,
    window_end,
)
from auditor.config import Config, apply_overrides, load_config
from auditor.errors import AuditorError
from auditor.params import FiniteFloatRange
from auditor.report.model import to_ns

EXIT_ZOMBIES, EXIT_ERROR, EXIT_INCONCLUSIVE, EXIT_UNSOUND = 1, 2, 3, 4
EXIT_BY_GATE = {"pass": 0, "zombies": EXIT_ZOMBIES, "inconclusive": EXIT_INCONCLUSIVE, "unsound": EXIT_UNSOUND}
F = TypeVar("F", bound=Callable[..., Any])


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
@reading_options
def export_command(config: Config, since: dt.datetime, until: dt.datetime | None, host: str | None, name: str,
                   stream_default: bool, output: Path, force: bool, as_json: bool) -> None:
    """Write the requests of a window to a standalone capture file for `auditor replay`.

    \b
    Example:
      auditor capture export --since 1h -o capture.db
    """
    from replay.capture import CaptureError, check_output, count_server_spans, export_capture

    until = window_end(since, until, now())
    store = open_store(config, create=False)
    try:
        # Every refusal, "exists" (which --force answers) too, before anything is read or written.
        check_output(output, force=force, store=store)
    except CaptureError as exc:
        store.close()
        raise click.BadParameter(str(exc), param_hint="-o/--output") from exc
    since_ns, until_ns = to_ns(since), to_ns(until)
    with errors_as_click(), _progress(max(1, count_server_spans(store, since_ns, until_ns, host)),
                                      "  exporting") as bar:
        capture_id, count = export_capture(store, output, since_ns=since_ns, until_ns=until_ns, host=host,
                                           name=name, stream_default=stream_default, force=force,
                                           on_progress=bar.update)
    if count == 0:  # on standard error, so --json's output stays one object
        click.echo(f"warning: no requests between {since.isoformat(timespec='seconds')} and "
                   f"{until.isoformat(timespec='seconds')}; the capture is empty", err=True)
    if as_json:
        click.echo(json.dumps({"capture_id": capture_id, "requests": count, "file": str(output)}))
        return
    click.echo(f"capture {capture_id}: {count} requests -> {output}\n"
               f"replay it: auditor replay {output} --target http://127.0.0.1:PORT")


@capture.command("import")
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["aiperf", "mooncake"]), required=True,
              help="aiperf: AIPerf's profile_export.jsonl; mooncake: a JSONL trace of timestamp (ms), "
                   "input_length, output_length[, hash_ids].")
@click.option("--model", help="Required: the model to send (neither format records it).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
              help="Replay to /v1/chat/completions or /v1/completions.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Replay as streaming requests.")
@click.option("--name", default="", help="A name for the capture [default: the source file's name].")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The capture file to write (SQLite).")
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def import_command(source: Path, fmt: str, model: str | None, endpoint: str, stream: bool, name: str,
                   output: Path, force: bool, as_json: bool) -> None:
    """Turn what a benchmark produced into a capture file for `auditor replay`.

    AIPerf's cancelled requests become captured disconnects (after the delay AIPerf waited, with
    FIN), so `auditor replay --as-captured` repeats the benchmark's cancellation plan.

    \b
    Examples:
      auditor capture import artifacts/run/profile_export.jsonl --format aiperf --model M -o capture.db
      auditor capture import trace.jsonl --format mooncake --model M -o capture.db
    """
    from replay.capture import CHAT_PATH, DEFAULT_PATH, CaptureError, check_output
    from replay.imports import KINDS, import_benchmark

    if not model:  # a usage error, as a missing option is: exit 2
        raise click.UsageError(f"{KINDS[fmt]} does not name the model; pass --model NAME, the model the "
                               "target engine serves")

    try:
        check_output(output, force=True)  # every refusal but "exists", which --force answers
    except CaptureError as exc:
        raise click.BadParameter(str(exc), param_hint="-o/--output") from exc
    with errors_as_click():
        capture_id, count = import_benchmark(source, fmt, output, model=model, name=name, force=force, stream=stream,
                                             path_route=CHAT_PATH if endpoint == "chat" else DEFAULT_PATH)
    if as_json:
        click.echo(json.dumps({"capture_id": capture_id, "requests": count, "file": str(output)}))
        return
    click.echo(f"capture {capture_id}: {count} requests from {source} ({fmt}) -> {output}\n"
               f"replay it: auditor replay {output} --target http://127.0.0.1:PORT"
               + (" --as-captured" if fmt == "aiperf" else " --cancel-rate 0.3"))


# -- replay -----------------------------------------------------------------------------------------
def _progress(length: int, label: str) -> Any:
    """A progress bar on standard error (standard output stays for the result); where standard
    error is no terminal (a CI log), a line of counts now and then instead, which a bar is not."""
    if not sys.stderr.isatty():
        return _LineProgress(length, label)
    progressbar: Any = click.progressbar  # its overloads confuse mypy
    return progressbar(length=length, label=label, width=30, file=sys.stderr)


class _LineProgress:
    """``label: done/total`` on standard error, at most every ``every_s`` seconds, and at the end."""

    def __init__(self, length: int, label: str, every_s: float = 10.0) -> None:
        self.length, self.label, self.every_s = length, label.strip(), every_s
        self.done, self._said_at, self._said = 0, time.monotonic(), -1

    def __enter__(self) -> _LineProgress:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._said != self.done:
            self._say()

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self._said_at >= self.every_s:
            self._say()

    def _say(self) -> None:
        click.echo(f"{self.label}: {self.done}/{self.length}", err=True)
        self._said_at, self._said = time.monotonic(), self.done


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _clip(text: str, width: int) -> str:
    """``text`` in ``width`` columns: cut, with an ellipsis, when longer."""
    return text if len(text) <= width else text[:width - 1] + "…"


def _verdict_rows(sides: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """"verdict (evidence)" rows over every side; a side that kept only counts shows them under "-"."""
    per_side = []
    for figures in sides:
        counts: dict[str, int] = {}
        evidence = figures.get("evidence") or {}
        for verdict, count in (figures.get("verdicts") or {}).items():
            for what, n in (evidence.get(verdict) or {"-": count}).items():
                counts[f"{verdict} ({what})"] = n
        per_side.append(counts)
    labels = sorted({label for counts in per_side for label in counts})
    return [(label, [_cell(counts.get(label)) for counts in per_side]) for label in labels]


def _comparison(summary: Any) -> list[tuple[str, list[str]]]:
    sides = ([summary.baseline] if summary.baseline is not None else []) + [summary.figures()]

    def row(label: str, key: str) -> tuple[str, list[str]]:
        return label, [_cell(side.get(key)) for side in sides]

    cancels = ("cancelled as planned", [
        "-" if side.get("cancelled") is None else
        f"{side['cancelled']} of {_cell(side.get('planned_cancels'))}" for side in sides])
    timeouts = ([row("timed out (client gave up)", "timed_out"), row("  zombies after it", "timed_out_zombies")]
                if any(side.get("timed_out") for side in sides) else [])
    # An engine that sent no spans: its port judged the run (replay.run._judge_by_port).
    by_port = ([row("judged by its port (no spans)", "judged_by_port"),
                row("  orphaned request-seconds", "orphaned_request_seconds"),
                row("  their GPU-seconds", "orphaned_wasted_gpu_seconds"),
                row("  their CPU-seconds", "orphaned_wasted_cpu_seconds")]
               if any(side.get("judged_by_port") for side in sides) else [])
    return [row("sent", "sent"), row("errors", "errors"), cancels, *_verdict_rows(sides), *timeouts, *by_port,
            row("zombies", "zombies"), row("zombie-seconds", "zombie_seconds"), row("tokens after disconnect", "wasted_tokens"),
            row("  zombies, tokens unknown", "zombies_without_tokens"),
            row("wasted GPU-seconds", "wasted_gpu_seconds"), row("wasted CPU-seconds", "wasted_cpu_seconds")]


# The receivers' settings as replay takes them: the pipeline names a listener that cannot bind by
# its configuration key, which replay users set with these flags.
RECEIVER_FLAGS = {"otlp.http": "--otlp-http", "otlp.grpc": "--otlp-grpc"}


def _as_replay_flags(message: str) -> str:
    for key, flag in RECEIVER_FLAGS.items():
        message = message.replace(f"cannot listen on {key} ", f"cannot listen on {flag} ").replace(
            f"set {key} to ", f"pass {flag} ")
    return message


def _print_summary(summary: Any, capture: Any) -> None:
    click.secho(f"replay run {summary.run_id} of capture {capture.id} ({capture.name}) against {summary.target}",
                bold=True)
    heads = (["baseline" if summary.baseline_run_id is None else f"run {summary.baseline_run_id}"]
             if summary.baseline is not None else []) + [f"run {summary.run_id}"]
    rows = _comparison(summary)
    width = max(len(label) for label, _ in rows)
    click.echo(f"  {'':<{width}}" + "".join(f" {head:>12}" for head in heads))
    for label, cells in rows:
        click.echo(f"  {label:<{width}}" + "".join(f" {cell:>12}" for cell in cells))
    if summary.errors:
        kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(summary.error_kinds.items()))
        click.secho(f"  errors: {kinds}", fg="red")
    if summary.unjudged or summary.provisional:
        click.echo(f"  cancels without a verdict {summary.unjudged}; still provisional {summary.provisional}")
    if summary.lag_p50_s is not None:
        click.echo(f"  lag p50 {summary.lag_p50_s:.2f} s, max {summary.lag_max_s:.2f} s")
    if summary.worst:
        # 80 columns: the trace id's first 16 hex digits (--json has all 32).
        click.echo(f"  {'request id':<20} {'trace id':<17} {'lag s':>7} {'tokens':>6} {'phase':<8} close (how)")
        for w in summary.worst:
            lag_s = f"{w['lag_seconds']:.2f}" if w["lag_seconds"] is not None else "-"
            request_id, trace_id, phase, close = (_clip(f"{w[key]}", width) for key, width in (
                ("request_id", 20), ("trace_id", 17), ("phase", 8), ("disconnect_kind", 5)))
            tokens = "-" if w["tokens_after_disconnect"] is None else w["tokens_after_disconnect"]  # unknown
            how = " (timeout)" if w.get("left") == "timeout" else ""
            click.echo(f"  {request_id:<20} {trace_id:<17} {lag_s:>7} {tokens:>6} {phase:<8} {close}{how}")
    for error in summary.first_errors:
        click.echo(f"  error: {error}", err=True)
    if summary.judged_by_port:
        click.echo(textwrap.fill(
            f"judged by the engine's port: it sent no spans, so no request has a verdict of its own; the "
            f"work it ran for clients that had left: {summary.orphaned_request_seconds:.1f} request-seconds "
            "(a lower bound)", 78, initial_indent="  ",
            subsequent_indent="  "))
    if summary.baseline_zombies is not None:
        against = (f"baseline run {summary.baseline_run_id}" if summary.baseline_run_id is not None
                   else "baseline: the capture's own verdicts")
        if summary.judged_by_port:
            before = (summary.baseline or {}).get("orphaned_request_seconds")
            click.secho(f"Orphaned request-seconds: {'-' if before is None else f'{before:.1f}'} → "
                        f"{summary.orphaned_request_seconds:.1f} ({against})", bold=True,
                        fg="green" if not summary.orphaned_stretches else "red")
        else:
            click.secho(f"Zombies: {summary.baseline_zombies} → {summary.zombies} ({against})", bold=True,
                        fg="green" if summary.zombies == 0 else "red")


def _options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func
    return apply


_cancel_options = _options(
    click.option("--cancel-rate", type=FiniteFloatRange(0.0, 1.0),
                 help="Fraction of requests cancelled by the client, chosen by --seed [default: 0.3; 0 with "
                      "--as-captured, where it adds cancels to requests the capture saw complete]."),
    click.option("--request-cancellation-rate", "aiperf_rate", type=FiniteFloatRange(0.0, 100.0), metavar="PERCENT",
                 help="AIPerf's spelling: the percentage of requests cancelled (10 = --cancel-rate 0.1)."),
    click.option("--cancel-after", type=FiniteFloatRange(min=0.0), metavar="SECONDS",
                 help="Cancel this long after the request was fully written (0: right after sending) "
                      "[default: 0.5]."),
    click.option("--request-cancellation-delay", "aiperf_delay", type=FiniteFloatRange(min=0.0), metavar="SECONDS",
                 help="AIPerf's spelling of --cancel-after (seconds after the request was fully sent)."),
    click.option("--as-captured", is_flag=True,
                 help="Replay the capture's own disconnects (delay and FIN/RST) instead of --cancel-rate."),
    click.option("--close", "close_with", type=click.Choice(["fin", "rst"]),
                 help="How cancelled clients close [default: as captured, else fin]."),
)

_load_options = _options(
    click.option("--speed", type=FiniteFloatRange(min=0.0), default=1.0, show_default=True,
                 help="Replay the capture's timing this many times faster; 0: as fast as --concurrency allows."),
    click.option("--concurrency", type=click.IntRange(1, 4096), default=16, show_default=True),
    click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests."),
    click.option("--seed", type=int, default=7, show_default=True),
    click.option("--model", help="Send this model name instead of the captured one (required where the "
                                 "capture has none)."),
    click.option("--request-timeout", "--request-timeout-seconds", "request_timeout", default=600.0,
                 type=FiniteFloatRange(min=0.1), show_default=True, metavar="SECONDS",
                 help="A request neither cancelled nor answered by then counts as an error."),
)

_receiver_options = _options(
    click.option("--otlp-http", default="127.0.0.1:4318", show_default=True, metavar="ADDR",
                 help="Where to receive the engine's spans (point its OTLP exporter here); '' to disable."),
    click.option("--otlp-grpc", default="", metavar="ADDR", help="OTLP/gRPC receiver address [default: off]."),
    click.option("--settle", type=FiniteFloatRange(min=1.0), default=60.0, show_default=True, metavar="SECONDS",
                 help="How long an engine span may follow its request's end and still count (a detached "
                      "engine reports when it finishes)."),
    click.option("--span-delay", type=FiniteFloatRange(min=0.0), default=5.0, show_default=True, metavar="SECONDS",
                 help="The engine exporter's batch delay (OTEL_BSP_SCHEDULE_DELAY): once its /metrics shows "
                      "it idle this long, no span can still come."),
    click.option("--wait", "wait_s", type=FiniteFloatRange(min=1.0), default=120.0, show_default=True,
                 metavar="SECONDS", help="The longest to wait for verdicts after the last request."),
)


def _one_of(ours: float | None, theirs: float | None, names: str) -> float | None:
    if ours is not None and theirs is not None:
        raise click.UsageError(f"{names}: give one spelling, not both")
    return ours if ours is not None else theirs


def replay_options(func: F) -> F:
    """The replay's options, grouped: cancellation and load become ``options`` (a ReplayOptions),
    the receiver and the waits ``receiver`` (keyword arguments of ReplaySettings)."""

    @_cancel_options
    @_load_options
    @_receiver_options
    @functools.wraps(func)
    def wrapper(*args: Any, cancel_rate: float | None, aiperf_rate: float | None, cancel_after: float | None,
                aiperf_delay: float | None, as_captured: bool, close_with: str | None, speed: float,
                concurrency: int, limit: int | None, seed: int, model: str | None, request_timeout: float,
                otlp_http: str, otlp_grpc: str, settle: float, span_delay: float, wait_s: float,
                **kwargs: Any) -> Any:
        from replay.run import ReplayOptions

        rate = _one_of(cancel_rate, None if aiperf_rate is None else aiperf_rate / 100,
                       "--cancel-rate and --request-cancellation-rate")
        delay = _one_of(cancel_after, aiperf_delay, "--cancel-after and --request-cancellation-delay")
        options = ReplayOptions(cancel_rate=rate if rate is not None else (0.0 if as_captured else 0.3),
                                cancel_after_s=0.5 if delay is None else delay, as_captured=as_captured,
                                close_with=close_with, speed=speed, concurrency=concurrency, limit=limit, seed=seed,
                                model=model, request_timeout_s=request_timeout)
        receiver = {"otlp_http": otlp_http, "otlp_grpc": otlp_grpc, "settle_s": settle, "span_delay_s": span_delay,
                    "wait_s": wait_s}
        return func(*args, options=options, receiver=receiver, **kwargs)

    return wrapper  # type: ignore[return-value]


@click.command("replay")
@click.argument("capture_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--target", required=True, metavar="URL", help="The engine on this host, e.g. http://127.0.0.1:8000.")
@click.option("--capture-id", type=click.IntRange(min=1), help="Which capture of the file [default: the newest].")
@replay_options
@click.option("--baseline", metavar="RUN|previous|capture",
              help="Compare with an earlier replay run in this file ('previous': the last one) or with "
                   "the verdicts the capture recorded ('capture').")
@click.option("--json", "as_json", is_flag=True, help="Print the run's result as JSON (docs/replay.md).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML configuration file.")
def replay_command(capture_file: Path, target: str, capture_id: int | None, options: Any, receiver: dict[str, Any],
                   baseline: str | None, as_json: bool, config_path: str | None) -> None:
    """Re-send captured traffic with injected cancellations and judge every cancel.

    Runs on the engine's host: the probe watches the target's port, and the engine must export
    its spans to --otlp-http. Results are kept in the capture file. AIPerf's
    --request-cancellation-rate (percent) and --request-cancellation-delay (seconds) are accepted.
    Exit status: 0 passed, 1 zombies, 2 could not run, 3 some cancels got no verdict
    (inconclusive), 4 unsound run: requests failed or fewer cancels happened than planned.

    \b
    Examples:
      auditor replay capture.db --target http://127.0.0.1:8000 --cancel-rate 0.3
      auditor replay capture.db --target http://127.0.0.1:8000 --as-captured --baseline previous
    """
    from replay.run import gate, gate_reasons
    from replay.session import ReplaySettings, local_target

    logging.basicConfig(level=logging.WARNING, format="auditor replay: %(levelname)s %(message)s", stream=sys.stderr)
    try:
        host, port = local_target(target)
        settings = ReplaySettings(capture_file=capture_file, host=host, port=port, options=options,
                                  capture_id=capture_id, baseline=baseline, **receiver)
        summary, capture_data = run_replay_here(load_config(config_path), settings)
    except AuditorError as exc:
        raise ReplayError(_as_replay_flags(str(exc))) from exc
    if as_json:
        click.echo(json.dumps(summary.as_json(), indent=2))
    else:
        _print_summary(summary, capture_data)
    decision, _ = gate(summary)
    reasons = gate_reasons(summary)
    if decision == "inconclusive":
        reasons.append((decision, f"check that the engine exports spans to {settings.otlp_http or settings.otlp_grpc} "
                                  f"and serves port {port}, or raise --wait"))
    for kind, reason in reasons:
        click.echo(f"{kind}: {reason}", err=True)
    if decision != "pass":
        raise SystemExit(EXIT_BY_GATE[decision])


def run_replay_here(config: Config, settings: Any) -> tuple[Any, Any]:
    """``replay.session.run_replay`` with this host's daemon as the pipeline, progress on stderr."""
    from auditor.daemon import Daemon
    from replay.session import run_replay

    return run_replay(settings, lambda overrides: Daemon(apply_overrides(config, overrides)),
                      say=lambda line: click.echo(line, err=True), progress=_progress)
