"""``auditor run``: the daemon in the foreground (systemd ``Type=notify``)."""

from __future__ import annotations

import gc
import logging
import signal
import sys
from types import FrameType

import click

from auditor.cli.util import PORT, apply_flags, common_options, errors_as_click, refuse_in_memory
from auditor.config import Config

GC_FIRST_GENERATION = 20_000


# The flag that sets each configuration key, for errors about a value the user typed as a flag.
RUN_FLAGS = {"probe.ports": "--port", "otlp.http": "--otlp-http", "otlp.grpc": "--otlp-grpc",
             "metrics.listen": "--metrics", "live.listen": "--live", "correlate.grace_seconds": "--grace",
             "host_id": "--host-id", "probe.source": "--source", "spans.engine_names": "--engine-span"}


@click.command("run")
@click.option("--port", "ports", type=PORT, multiple=True, help="Inference port to watch (repeatable).")
@click.option("--otlp-http", metavar="ADDR", help="OTLP/HTTP receiver address, '' to disable.")
@click.option("--otlp-grpc", metavar="ADDR", help="OTLP/gRPC receiver address, '' to disable.")
@click.option("--metrics", "metrics_listen", metavar="ADDR", help="Prometheus /metrics address, '' to disable.")
@click.option("--live", "live_listen", metavar="ADDR", help="UDP address for live span notices, '' to disable.")
@click.option("--grace", type=float, metavar="SECONDS", help="Work after a disconnect beyond this is a zombie.")
@click.option("--host-id", metavar="ID", help="This host's name in the store.")
@click.option("--source", type=click.Choice(["auto", "bpf", "procfs"]), help="Disconnect source.")
@click.option("--engine-span", "engine_spans", metavar="NAME", multiple=True,
              help="Another engine span name besides vLLM's llm_request (repeatable; NAME* is a prefix).")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
@common_options
def run_command(config: Config, ports: tuple[int, ...], otlp_http: str | None, otlp_grpc: str | None,
                metrics_listen: str | None, live_listen: str | None, grace: float | None,
                host_id: str | None, source: str | None, verbose: bool, engine_spans: tuple[str, ...] = ()) -> None:
    """Run the daemon: probe, OTLP receivers, samplers, correlation and /metrics."""
    from auditor.daemon import Daemon
    from auditor.service import limit_malloc_arenas

    limit_malloc_arenas()
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    overrides = {"probe.ports": list(ports) or None, "otlp.http": otlp_http, "otlp.grpc": otlp_grpc,
                 "metrics.listen": metrics_listen, "live.listen": live_listen,
                 "correlate.grace_seconds": grace, "host_id": host_id, "probe.source": source,
                 "spans.engine_names": list(engine_spans) or None}
    config = apply_flags(config, overrides, RUN_FLAGS)
    refuse_in_memory(config.db or "")
    with errors_as_click():
        daemon = Daemon(config)
        daemon.start()
    # The start-up's objects (modules, config, compiled queries) live as long as the process:
    # out of the collector's sight. A first generation of 20,000 instead of 700 stops the
    # collector from walking each batch of spans awaiting commit about 18 times per request
    # (7% of the receiver's CPU in bench/ingest.py); nothing here makes reference cycles in bulk.
    gc.freeze()
    gc.set_threshold(GC_FIRST_GENERATION, 10, 10)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        click.echo(f"auditor: {signal.Signals(signum).name}, flushing and stopping", err=True)
        daemon.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.wait()
    daemon.stop()
    click.echo("auditor: stopped", err=True)
