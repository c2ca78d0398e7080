"""``auditor demo``: the whole story on one machine in about a minute.

Starts the daemon (on free ports, its own store), runs the reference engine with a known
cancellation bug, sends traffic in which some clients give up, and shows what the auditor found;
then runs the fixed engine under the same traffic and shows the zombies gone. Everything is real:
the eBPF probe (or its fallback), OTLP over HTTP, the engine's compute, the store.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from sqlalchemy import func, select

from auditor.cliutil import errors_as_click
from auditor.config import apply_overrides, load_config
from auditor.schema import VerdictRow

BUGGY, FIXED = "detached", "abort"


def _daemon_config(state_dir: Path) -> Any:
    config = load_config(environ={})
    return apply_overrides(config, {
        "db": f"sqlite:///{state_dir / 'auditor.db'}", "probe.ports": [1], "otlp.http": "127.0.0.1:0",
        "otlp.grpc": "", "metrics.listen": "127.0.0.1:0", "live.listen": "127.0.0.1:0",
        "correlate.interval_seconds": 0.25, "correlate.late_span_seconds": 10.0,
    })


def _count_verdicts(daemon: Any, since_ns: int) -> dict[str, int]:
    with daemon.store.session() as session:
        rows = session.execute(select(VerdictRow.verdict, func.count()).where(
            VerdictRow.disconnect_at_ns >= since_ns).group_by(VerdictRow.verdict)).all()
    return {verdict: count for verdict, count in rows}


def _act(daemon: Any, behavior: str, spec: Any, title: str) -> tuple[dict[str, int], int]:
    from replay.client import plan_load, run_load, summarize
    from replay.engine.launch import running_engine

    otlp = f"http://127.0.0.1:{daemon.status.http_port}"
    started_ns = time.time_ns()
    extra = ["--live", f"127.0.0.1:{daemon.status.live_port}"] if daemon.status.live_port else []
    click.secho(f"\n{title}", bold=True)
    with running_engine(behavior=behavior, otlp=otlp, step_ms=15, max_batch=8, extra_args=extra) as engine:
        daemon.set_ports({engine.port})
        plans = plan_load(spec)
        with click.progressbar(length=len(plans), label=f"  {len(plans)} requests to {engine.url}",
                               width=30) as bar:
            outcomes = asyncio.run(run_load("127.0.0.1", engine.port, plans, concurrency=spec.concurrency,
                                            on_done=lambda _outcome: bar.update(1)))
        summary = summarize(outcomes)
        click.echo(f"  {summary.completed} completed, {summary.cancelled} cancelled by their clients"
                   + (f", {len(summary.errors)} errors" if summary.errors else ""))
        # Let detached work finish and its spans arrive, then let correlation settle.
        deadline = time.monotonic() + 30
        with click.progressbar(length=100, label="  waiting for the engine to go idle", width=30) as bar:
            while time.monotonic() < deadline:
                inflight = daemon.correlator.stats.inflight_zombies + daemon.correlator.stats.pending_disconnects
                bar.update(1)
                if inflight == 0 and time.monotonic() > deadline - 25:
                    break
                time.sleep(0.25)
            bar.update(100)
    time.sleep(1.0)
    return _count_verdicts(daemon, started_ns), summary.cancelled


def run_demo(output_dir: Path) -> int:
    from auditor.daemon import Daemon
    from auditor.report.model import ReportQuery
    from auditor.report.query import build_report
    from auditor.report.render_html import render_html
    from auditor.report.render_table import render_table
    from replay.client import LoadSpec

    output_dir.mkdir(parents=True, exist_ok=True)
    db_path = output_dir / "auditor.db"
    for stale in output_dir.glob("auditor.db*"):
        stale.unlink()
    click.secho("auditor demo: zombie requests found, costed, and fixed, on this machine", bold=True)
    daemon = Daemon(_daemon_config(output_dir))
    with errors_as_click():
        daemon.start()
    try:
        click.echo(f"  daemon: disconnect source {daemon.status.source}, OTLP/HTTP on "
                   f"127.0.0.1:{daemon.status.http_port}, /metrics on 127.0.0.1:{daemon.status.metrics_port}")
        start_ns = time.time_ns()
        spec = LoadSpec(requests=48, concurrency=8, cancel_fraction=0.35, cancel_delays_s=(0.0, 0.3, 0.8),
                        max_tokens=(48, 96, 160))
        before, cancelled = _act(daemon, BUGGY, replace(spec, tag="buggy"),
                                 f"1. An engine that keeps generating after the client left (--behavior {BUGGY})")
        after, _ = _act(daemon, FIXED, replace(spec, tag="fixed"),
                        f"2. The same traffic against the fixed engine (--behavior {FIXED})")
        end_ns = time.time_ns()
        report = build_report(daemon.store, ReportQuery(since_ns=start_ns, until_ns=end_ns, top=5),
                              with_requests=True, with_series=True)
        click.secho("\n3. What the auditor found", bold=True)
        click.echo(render_table(report))
        html_path = output_dir / "report.html"
        html_path.write_text(render_html(report))
        zombies_before = before.get("zombie", 0) + before.get("inflight_zombie", 0)
        zombies_after = after.get("zombie", 0) + after.get("inflight_zombie", 0)
        click.secho(f"\nZombies: {zombies_before} → {zombies_after} "
                    f"({cancelled} cancelled requests each run; {before} then {after})", bold=True,
                    fg="green" if zombies_after == 0 < zombies_before else "red")
        since = dt.datetime.fromtimestamp(start_ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds")
        click.echo(f"HTML report: {html_path}\nStore: {db_path}  (try: auditor report --db sqlite:///{db_path} "
                   f"--since {since})")
        return 0 if zombies_after == 0 < zombies_before else 1
    finally:
        daemon.request_stop()
        daemon.stop()


@click.command("demo")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the store and the HTML report go [default: a new temporary directory].")
def demo_command(output_dir: Path | None) -> None:
    """Run the whole story on this machine: zombies found, costed, then fixed (about a minute)."""
    directory = output_dir or Path(tempfile.mkdtemp(prefix="auditor-demo-"))
    raise SystemExit(run_demo(directory))
