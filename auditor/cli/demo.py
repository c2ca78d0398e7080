"""``auditor demo``: the whole story on one machine in about a minute.

Starts the daemon (on free ports, its own store), runs the reference engine with a known
cancellation bug, sends traffic in which some clients give up, and shows what the auditor found;
then captures that traffic and replays it, disconnects included, against the fixed engine, as a
release gate would, and shows the zombies gone. Everything is real: the eBPF probe (or its
fallback), OTLP over HTTP, the engine's compute, the stores.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from sqlalchemy import func, select

from auditor.cli.util import errors_as_click
from auditor.config import apply_overrides, load_config
from auditor.report.model import ZOMBIE_VERDICTS
from auditor.store.schema import VerdictRow

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


def _act(daemon: Any, behavior: str, spec: Any, title: str, device: str) -> tuple[dict[str, int], int]:
    from replay.client import plan_load, run_load, summarize
    from replay.engine.launch import running_engine

    otlp = f"http://127.0.0.1:{daemon.status.http_port}"
    started_ns = time.time_ns()
    extra = ["--device", device]
    if daemon.status.live_port:
        extra += ["--live", f"127.0.0.1:{daemon.status.live_port}"]
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gate(config: Any, capture_path: Path, device: str) -> Any:
    """Replay the capture, its own disconnects included, against the fixed engine."""
    from auditor.cli.replay import run_replay_here
    from replay.engine.launch import running_engine
    from replay.run import ReplayOptions
    from replay.session import ReplaySettings

    otlp_port = _free_port()
    with running_engine(behavior=FIXED, otlp=f"http://127.0.0.1:{otlp_port}", step_ms=15, max_batch=8,
                        extra_args=["--device", device]) as engine:
        summary, _capture = run_replay_here(config, ReplaySettings(
            capture_file=capture_path, host="127.0.0.1", port=engine.port,
            options=ReplayOptions(as_captured=True, speed=0.0, concurrency=8), otlp_http=f"127.0.0.1:{otlp_port}",
            span_delay_s=1.0, wait_s=90.0, baseline="capture"))  # the engine exports every 200 ms
    return summary


def run_demo(output_dir: Path, device: str = "cpu") -> int:
    from auditor.cli.report import terminal_width
    from auditor.daemon import Daemon
    from auditor.report.model import ReportQuery
    from auditor.report.query import build_report
    from auditor.report.render_html import render_html
    from auditor.report.render_table import render_table
    from auditor.store import Store
    from replay.capture import export_capture
    from replay.client import LoadSpec

    output_dir.mkdir(parents=True, exist_ok=True)
    db_path = output_dir / "auditor.db"
    capture_path = output_dir / "capture.db"
    for stale in _stores_in(output_dir):  # refused by the command unless --force
        stale.unlink()
    click.secho("auditor demo: zombie requests found, costed, and a fix proven, on this machine", bold=True)
    config = _daemon_config(output_dir)
    daemon = Daemon(config)
    with errors_as_click():
        daemon.start()
    try:
        click.echo(f"  daemon: disconnect source {daemon.status.source}, OTLP/HTTP on "
                   f"127.0.0.1:{daemon.status.http_port}, /metrics on 127.0.0.1:{daemon.status.metrics_port}")
        start_ns = time.time_ns()
        spec = LoadSpec(requests=48, concurrency=8, cancel_fraction=0.35, cancel_delays_s=(0.0, 0.3, 0.8),
                        max_tokens=(48, 96, 160))
        before, cancelled = _act(daemon, BUGGY, replace(spec, tag="buggy"),
                                 f"1. An engine that keeps generating after the client left (--behavior {BUGGY}, "
                                 f"--device {device})", device)
        end_ns = time.time_ns()
        report = build_report(daemon.store, ReportQuery(since_ns=start_ns, until_ns=end_ns, top=5),
                              with_requests=True, with_series=True)
        click.secho("\n2. What the auditor found", bold=True)
        click.echo(render_table(report, terminal_width(sys.stdout)))
        html_path = output_dir / "report.html"
        html_path.write_text(render_html(report))
    finally:
        daemon.request_stop()
        daemon.stop()
    click.secho(f"\n3. The release gate: that traffic captured, replayed against the fixed engine "
                f"(--behavior {FIXED})", bold=True)
    with errors_as_click():
        _capture_id, captured = export_capture(Store(f"sqlite:///{db_path}"), capture_path, since_ns=start_ns,
                                               until_ns=end_ns)
        click.echo(f"  auditor capture export: {captured} requests -> {capture_path}")
        summary = _gate(config, capture_path, device)
    from replay.run import gate, gate_reasons

    zombies_before = sum(before.get(v, 0) for v in ZOMBIE_VERDICTS)
    click.echo(f"  auditor replay --as-captured: {summary.cancelled} of {summary.planned_cancels} planned cancels "
               f"happened, {summary.sent} requests sent, errors = {summary.errors}; verdicts: "
               + (", ".join(f"{count} {verdict}" for verdict, count in sorted(summary.verdicts.items())) or "none")
               + (f", {summary.unjudged} without one" if summary.unjudged else ""))
    decision, _ = gate(summary)
    for kind, reason in gate_reasons(summary):
        click.echo(f"  {kind}: {reason}")
    passed = decision == "pass" and zombies_before > 0
    click.secho(f"\nZombies: {zombies_before} → {summary.zombies} ({cancelled} requests cancelled by their clients "
                f"in production, replayed with the same disconnects; errors = {summary.errors}; gate "
                f"{'passed' if passed else 'failed'})", bold=True, fg="green" if passed else "red")
    since = dt.datetime.fromtimestamp(start_ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds")
    click.echo(f"HTML report: {html_path}\nStore: {db_path}  (try: auditor report --db sqlite:///{db_path} "
               f"--since {since})\nCapture: {capture_path}  (try: auditor replay {capture_path} --target "
               "http://127.0.0.1:PORT --baseline previous, against an engine of yours)")
    return 0 if passed else 1


def _stores_in(directory: Path) -> list[Path]:
    """The files a run in ``directory`` replaces: the stores and their journals."""
    return sorted([*directory.glob("auditor.db*"), *directory.glob("capture.db*")])


def _check_output_dir(directory: Path, force: bool) -> None:
    """Make -o's directory, refusing one this user cannot write (before any engine starts) and one
    that holds stores the demo would delete without --force: ``-o /var/lib/auditor`` would
    otherwise wipe the service's database."""
    hint = "-o/--output-dir"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        stores = _stores_in(directory)
    except OSError as exc:
        raise click.BadParameter(f"cannot use {directory} ({exc.strerror or exc}); give a directory this user "
                                 "can write, e.g. -o ./auditor-demo", param_hint=hint) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{directory} is not writable by this user; give a directory this user can "
                                 "write, e.g. -o ./auditor-demo", param_hint=hint)
    if stores and not force:
        raise click.BadParameter(f"{directory} holds {', '.join(p.name for p in stores)}, which the demo would "
                                 "delete (another store, a service's database?); give a new or empty directory, "
                                 "or --force to replace them", param_hint=hint)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@click.command("demo")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the store and the HTML report go [default: a new temporary directory].")
@click.option("--force", is_flag=True, help="Replace the auditor.db and capture.db that -o's directory holds.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="The engine's compute: cpu (NumPy), or cuda (PyTorch on this host's GPU, so the zombies' "
              "cost is NVML's GPU-seconds).")
def demo_command(output_dir: Path | None, device: str, force: bool) -> None:
    """Run the whole story on this machine: zombies found, costed, then fixed (about a minute)."""
    if device == "cuda":
        from replay.engine.compute import cuda_unavailable_reason

        problem = cuda_unavailable_reason()
        if problem:
            raise click.UsageError(problem)
    if output_dir is not None:
        _check_output_dir(output_dir, force)
    # Stopped by SIGTERM (systemd, timeout, kill), the demo unwinds as on Ctrl-C: its daemon and
    # engines stop and their scratch directories go, rather than an engine left generating.
    signal.signal(signal.SIGTERM, _interrupted)
    directory = output_dir or Path(tempfile.mkdtemp(prefix="auditor-demo-"))
    # The daemon's one journal line per zombie: the demo shows them in its own table instead.
    logging.getLogger("auditor.findings").setLevel(logging.ERROR)
    if device == "cpu":  # the engines run on the CPU, and the demo costs zombies in CPU-seconds
        logging.getLogger("collectors.nvml").setLevel(logging.ERROR)
    raise SystemExit(run_demo(directory, device))
