"""``auditor report``: what the zombies cost over a window, as a table, JSON, CSV or HTML."""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import click

from auditor.cli.util import (
    TIME,
    apply_flags,
    check_reachable,
    errors_as_click,
    now,
    open_store,
    reading_options,
    window_end,
)
from auditor.config import Config
from auditor.report.model import Prices, Report, ReportQuery, to_ns

FORMATS = ("table", "json", "csv", "html")
REPORT_FLAGS = {"report.gpu_hour_price": "--gpu-hour-price", "report.cpu_hour_price": "--cpu-hour-price",
                "report.gpu_hour_prices": "--gpu-hour-price", "report.cpu_hour_prices": "--cpu-hour-price",
                "report.currency": "--currency"}


FORMAT_BY_SUFFIX = {".html": "html", ".htm": "html", ".json": "json", ".csv": "csv", ".txt": "table"}


class HourPrice(click.ParamType):  # type: ignore[type-arg]
    """``PRICE`` or ``HOSTS=PRICE``: (None or the host pattern, the price)."""

    name = "hour price"

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> tuple[str | None, float]:
        if isinstance(value, tuple):
            return value
        pattern, _, text = str(value).rpartition("=")
        try:
            price = float(text)
        except ValueError:
            price = math.nan
        if not math.isfinite(price) or (pattern == "" and "=" in str(value)):
            self.fail(f"{value!r}: expected a price, or hosts and their price: 2.49, gpu-h100-*=2.49", param, ctx)
        return (pattern or None, price)


HOUR_PRICE = HourPrice()


@click.command()
@click.option("--since", type=TIME, default="1h", show_default=True,
              help="Start of the window: a duration back from now (30m, 1h, 2d) or an RFC 3339 time.")
@click.option("--until", type=TIME, default=None,
              help="End of the window, same forms as --since [default: now].")
@click.option("--host", help="Only this host (as the daemon names it).")
@click.option("--service", help="Only requests of this service (OTel service.name).")
@click.option("--route", help="Only this HTTP route, e.g. /v1/chat/completions.")
@click.option("--model", help="Only this model.")
@click.option("--client", metavar="ADDRESS", help="Only requests from this client address, e.g. 10.0.3.7.")
@click.option("--user-agent", metavar="TEXT", help="Only requests whose client sent this User-Agent, whole "
              "(as the report's breakdown by user agent shows it).")
@click.option("--top", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="How many of the worst zombies to list.")
@click.option("--format", "output_format", type=click.Choice(FORMATS), default="table",
              show_default=True, help="table for people; json and csv for machines; html for a "
              "self-contained page with plots.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="Write to this file instead of standard output ('-': standard output); without "
              "--format, its name's .html, .json, .csv or .txt picks the format. An existing file is "
              "replaced only if it holds a report, or with --force.")
@click.option("--force", is_flag=True, help="Replace the -o file even if it holds something other than a report.")
@click.option("--gpu-hour-price", type=HOUR_PRICE, metavar="[HOSTS=]PRICE", multiple=True,
              help="What an hour of one GPU costs: the wasted GPU time is priced at it; HOSTS=PRICE for "
              "the hosts a name or pattern names (gpu-h100-*=2.49), repeatable, the first match winning, "
              "PRICE alone for the rest [default: report.gpu_hour_price and gpu_hour_prices in the config "
              "file, else unpriced].")
@click.option("--cpu-hour-price", type=HOUR_PRICE, metavar="[HOSTS=]PRICE", multiple=True,
              help="What an hour of one CPU core costs (hosts whose engines run on CPUs); HOSTS=PRICE as above.")
@click.option("--currency", metavar="UNIT", help="The prices' unit, shown after each cost [default: USD].")
@reading_options
def report(config: Config, since: dt.datetime, until: dt.datetime | None, host: str | None,
           service: str | None, route: str | None, model: str | None, client: str | None,
           user_agent: str | None, top: int,
           output_format: str, as_json: bool, output: str | None, force: bool,
           gpu_hour_price: tuple[tuple[str | None, float], ...], cpu_hour_price: tuple[tuple[str | None, float], ...],
           currency: str | None) -> None:
    """Findings over a window: disconnects, zombies, and the GPU time they wasted.

    \b
    Examples:
      auditor report --since 1h
      auditor report --since 2026-11-22T10:00:00Z --until 2026-11-22T11:00:00Z --format json
      auditor report --since 1d --route /v1/chat/completions --format html -o zombies.html
      auditor report --since 7d --host gpu-h100-1 --gpu-hour-price 2.49
      auditor report --since 1d --gpu-hour-price 'gpu-h100-*=2.49' --gpu-hour-price 'gpu-l4-*=0.80'

    JSON and CSV are documented in docs/report.md (schema auditor.report/v1).
    """
    from auditor.report.query import build_report

    config = apply_flags(config, {**_hour_prices(config, "gpu", gpu_hour_price),
                                  **_hour_prices(config, "cpu", cpu_hour_price), "report.currency": currency},
                         REPORT_FLAGS)
    if as_json and output_format != "json" and _given("output_format"):
        raise click.UsageError(f"--json and --format {output_format} ask for two formats; give one, "
                               f"e.g. --format {output_format}")
    if as_json:
        output_format = "json"
    if output == "-":
        output = None
    if output is not None and not Path(output).name:
        raise click.BadParameter(f"{output!r} names no file; give one, e.g. -o zombies.html or leave -o out "
                                 "for standard output", param_hint="-o/--output")
    named = None if output is None else FORMAT_BY_SUFFIX.get(Path(output).suffix.lower())
    if named is not None and not (as_json or _given("output_format")):
        output_format = named  # -o zombies.html: the page, not a table in a file named .html
    elif named is not None and named != output_format:
        click.echo(f"warning: writing {output_format} to {output}, whose name says {named}", err=True)
    refusal = None if output is None or force else _not_replaceable(Path(output))
    if refusal:
        raise click.BadParameter(f"{output} {refusal} (renaming a report over it would lose it); give another "
                                 "name, or --force to replace it", param_hint="-o/--output")
    until = window_end(since, until, now())
    query = ReportQuery(since_ns=to_ns(since), until_ns=to_ns(until), host=host, service=service,
                        route=route, model=model, top=top, client=client, user_agent=user_agent)
    with errors_as_click():
        check_reachable(config.db)
    store = open_store(config, create=False)
    try:
        with errors_as_click():
            result = build_report(store, query, with_requests=output_format in ("json", "csv"),
                                  with_series=output_format == "html",
                                  requests_as_json=output_format == "json")
    finally:
        store.close()
    result.prices = prices_of(config)
    if result.empty and (output_format != "table" or output):
        click.echo(f"note: {result.empty_message()}", err=True)
    _write(result, output_format, output)


def prices_of(config: Config) -> Prices | None:
    """The report's prices from the ``[report]`` settings; None where no time has one."""
    settings = config.report
    prices = Prices(settings.gpu_hour_price, settings.cpu_hour_price, settings.currency,
                    tuple(settings.gpu_hour_prices.items()), tuple(settings.cpu_hour_prices.items()))
    return prices if prices.priced else None


def _hour_prices(config: Config, kind: str, given: tuple[tuple[str | None, float], ...]) -> dict[str, object]:
    """The ``[report]`` settings a repeated ``--gpu-hour-price`` / ``--cpu-hour-price`` sets: the one
    price without hosts for the rest, and the hosts' prices ahead of the configuration file's."""
    flag = f"--{kind}-hour-price"
    rest = [price for pattern, price in given if pattern is None]
    if len(rest) > 1:
        raise click.BadParameter(f"{len(rest)} prices for the hosts no pattern names; give one, and "
                                 "HOSTS=PRICE for the others", param_hint=f"'{flag}'")
    named = {pattern: price for pattern, price in given if pattern is not None}
    configured: dict[str, float] = getattr(config.report, f"{kind}_hour_prices")
    return {f"report.{kind}_hour_price": rest[0] if rest else None,
            f"report.{kind}_hour_prices": {**named, **{p: v for p, v in configured.items() if p not in named}}
            if named else None}


def _given(name: str) -> bool:
    """Whether the user gave this option (on the command line or from the environment)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _write(result: Report, output_format: str, output: str | None) -> None:
    if output is None:
        _render(result, output_format, sys.stdout)
        return
    target = Path(output)
    if target.exists() and not target.is_file():
        # /dev/null, a FIFO, /dev/stdout: write straight through; renaming over them would be wrong.
        try:
            with target.open("w", encoding="utf-8", newline="") as out:
                _render(result, output_format, out)
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from exc
        return
    # Write beside the target and rename, so a failed report never leaves half a file behind.
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
                _render(result, output_format, out)
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; honour the umask instead
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}; "
                                   "check the directory exists and is writable") from exc
    click.echo(f"wrote {output_format} report to {output}", err=True)


# How each format's report begins (JSON and table) or what its first lines hold (HTML, CSV): a file
# that -o may replace without --force.
_REPORT_OPENINGS = ('{\n  "schema": "auditor.report/', "Zombie requests  ")
# A CSV report's header as it began before lag_at_least_seconds was added after lag_seconds, and
# before evidence and unconfirmed_because were added at its end.
_CSV_HEADERS_BEFORE = ("request_id,trace_id,verdict,disconnect_at,disconnect_kind,work_end_at,lag_seconds,phase,",
                       "request_id,trace_id,verdict,disconnect_at,disconnect_kind,work_end_at,lag_seconds,"
                       "lag_at_least_seconds,phase,route,model,service,client,host,request_start_at,max_tokens,"
                       "wasted_tokens,tokens_exact,wasted_gpu_seconds,wasted_cpu_seconds\n")


def _not_replaceable(target: Path) -> str | None:
    """Why -o may not write ``target`` without --force, None where it may: a new or empty file, a
    device or FIFO (written through), or a report this command wrote before. Anything else (a
    typo'd config file, /etc/passwd for root) would be replaced by a rename and lost."""
    try:
        if not target.is_file() or target.stat().st_size == 0:
            return None
        with target.open("rb") as existing:
            head = existing.read(4096).decode("utf-8", errors="replace")
    except OSError as exc:
        return f"exists and cannot be read to tell whether it holds a report ({exc.strerror or exc})"
    from auditor.report.render_data import REQUEST_FIELDS

    if (head.startswith(_REPORT_OPENINGS) or head.startswith(",".join(REQUEST_FIELDS) + "\n")
            or head.startswith(_CSV_HEADERS_BEFORE)
            or (head.startswith("<!DOCTYPE html>") and "<title>Zombie requests " in head)):
        return None
    return "exists and holds no report"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def terminal_width(out: TextIO) -> int:
    """The width of the terminal standard output is (``COLUMNS`` first, as shells set it); 100 for
    ``-o FILE`` or a pipe, which no terminal narrows."""
    import shutil

    if out is not sys.stdout or ("COLUMNS" not in os.environ and not out.isatty()):
        return 100
    return shutil.get_terminal_size((100, 24)).columns


def _render(result: Report, output_format: str, out: TextIO) -> None:
    if output_format == "json":
        from auditor.report.render_data import write_json

        write_json(result, out)
    elif output_format == "csv":
        from auditor.report.render_data import write_csv

        write_csv(result.requests, out)
    elif output_format == "html":
        from auditor.report.render_html import render_html

        out.write(render_html(result))
    else:
        from auditor.report.render_table import render_table

        out.write(render_table(result, terminal_width(out)))
