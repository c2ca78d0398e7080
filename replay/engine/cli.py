"""``auditor engine``: run the reference engine, or a gateway in front of another engine."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

import click

from auditor.errors import AuditorError
from auditor.params import FiniteFloatRange
from replay.engine.behaviors import BEHAVIORS
from replay.engine.signals import METRIC_STYLES


class EngineStartError(AuditorError):
    """The engine cannot start with these settings."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EngineStartError(f"cannot listen on {host}:{port}: {exc.strerror}; "
                               "pick a free port, or --port 0 for any") from exc
    sock.set_inheritable(True)
    return sock


def _write_port_file(path: str, port: int) -> None:
    # Written atomically so a launcher polling the file never reads half a number.
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    try:
        temporary.write_text(f"{port}\n", encoding="ascii")
        os.replace(temporary, target)
    except OSError as exc:
        raise EngineStartError(f"cannot write the port file {target}: {exc.strerror}; "
                               "check that its directory exists and is writable") from exc


def exit_with_parent(parent_pid: int, every_s: float = 0.5, grace_s: float = 5.0) -> None:
    """Stop this engine once ``parent_pid`` (the launcher) is gone: a launcher killed outright
    runs no clean-up, and an engine left behind (a detached one generates on) holds a core.
    SIGTERM first (uvicorn's graceful stop), then exit regardless after ``grace_s``."""
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        logging.getLogger(__name__).warning("the launcher (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def serve(app: object, sock: socket.socket, log_level: str, keep_alive_s: float = 5.0) -> None:
    import uvicorn

    # proxy_headers=False keeps the real peer address in the ASGI scope (and so on the HTTP span),
    # which is what the auditor joins kernel events on.
    config = uvicorn.Config(app, proxy_headers=False, log_level=log_level, access_log=False,  # type: ignore[arg-type]
                            lifespan="on", timeout_graceful_shutdown=3, timeout_keep_alive=keep_alive_s)
    uvicorn.Server(config).run(sockets=[sock])


@click.command("engine")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on; 0 picks a free one (see --port-file).")
@click.option("--port-file", type=click.Path(dir_okay=False), help="Write the bound port to this file.")
@click.option("--behavior", type=click.Choice(BEHAVIORS), default="abort", show_default=True,
              help="What happens when a client disconnects (see docs/engine.md).")
@click.option("--late-seconds", type=FiniteFloatRange(0, 3600), default=2.0, show_default=True,
              help="Delay of the abort for --behavior late.")
@click.option("--max-batch", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Most requests in one batch; others wait in the queue.")
@click.option("--step-ms", type=FiniteFloatRange(0.1, 10000), default=20.0, show_default=True,
              help="Calibrated cost of one decode step.")
@click.option("--prefill-chunk", type=click.IntRange(1, 1 << 20), default=64, show_default=True,
              help="Prompt tokens prefilled per step (chunked prefill).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: NumPy; cuda: PyTorch on a GPU.")
@click.option("--model", default="ref-llm-1b", show_default=True, help="The one model name served.")
@click.option("--otlp", metavar="URL", help="http://HOST:PORT (OTLP/HTTP) or grpc://HOST:PORT (OTLP/gRPC); "
              "default: the OTEL_EXPORTER_OTLP_* variables, else no export.")
@click.option("--service-name", default=None, help="service.name of the spans [default: ref-engine, ref-gateway].")
@click.option("--live", metavar="HOST:PORT", help="Send span starts and ends to the auditor's live-notice "
              "socket, so zombies are flagged while they run.")
@click.option("--trace-aborted", is_flag=True, help="Emit llm_request spans for aborted requests too.")
@click.option("--engine-span", default="llm_request", show_default=True,
              help="Name of the engine span; 'genai': the GenAI conventions' '{operation} {model}'; "
              "'none' leaves HTTP server spans only.")
@click.option("--metrics-names", type=click.Choice(METRIC_STYLES), default="ref", show_default=True,
              help="Also export running/waiting/tokens under this engine's metric names.")
@click.option("--send-spans", is_flag=True, help="Record 'http send' sub-spans, the last one marked.")
@click.option("--gauges-on-steps", is_flag=True,
              help="The --metrics-names gauges change only when the engine steps, as vLLM's (SGLang's: when "
              "it logs a batch, every 40 steps, idle every 30 s): after every request was aborted at once "
              "they keep their last values until the next request.")
@click.option("--one-at-a-time", is_flag=True, help="Serve one request at a time; others wait unread.")
@click.option("--span-end-lag-ms", type=FiniteFloatRange(0, 10000), default=0.0, show_default=True,
              help="End each answer's HTTP span this long after its last byte was sent, as a server whose event "
              "loop is busy does: its client may read the whole answer and close first.")
@click.option("--no-process-pid", is_flag=True,
              help="Leave process.pid out of the span resource, as the OpenTelemetry SDK does by default.")
@click.option("--duplicate-server-span", is_flag=True,
              help="A second SERVER span per request, child of the first (FastAPI's own telemetry twice).")
@click.option("--truth-log", type=click.Path(dir_okay=False), help="Append one JSON line per finished request.")
@click.option("--gateway", "gateway_upstream", metavar="UPSTREAM_URL",
              help="Run as a gateway proxying to this engine instead of as an engine.")
@click.option("--propagate", type=click.Choice(["yes", "no"]), default="yes", show_default=True,
              help="Gateway: cancel the upstream request when the client leaves.")
@click.option("--trace-context", type=click.Choice(["yes", "no"]), default="yes", show_default=True,
              help="Gateway: send the trace context (traceparent) upstream.")
@click.option("--keep-alive-s", type=FiniteFloatRange(0.1, 86400), default=5.0, show_default=True,
              help="Close a kept-alive connection idle this long (uvicorn's default; llama.cpp's server also waits 5 "
              "s; TGI's axum server waits for its client, or 30 s in recent versions; gateways' pools a minute or more).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True)
@click.option("--exit-with-parent", "parent_pid", type=click.IntRange(1), hidden=True,
              help="Stop when the process of this pid (the launcher) is gone.")
def engine(host: str, port: int, port_file: str | None, behavior: str, late_seconds: float, max_batch: int,
           step_ms: float, prefill_chunk: int, device: str, model: str, otlp: str | None,
           service_name: str | None, live: str | None, trace_aborted: bool, truth_log: str | None,
           gateway_upstream: str | None, propagate: str, log_level: str, engine_span: str = "llm_request",
           metrics_names: str = "ref", send_spans: bool = False, one_at_a_time: bool = False,
           no_process_pid: bool = False, duplicate_server_span: bool = False,
           trace_context: str = "yes", parent_pid: int | None = None, gauges_on_steps: bool = False,
           span_end_lag_ms: float = 0.0, keep_alive_s: float = 5.0) -> None:
    """Run the reference engine: an OpenAI-compatible server with real batching and compute.

    It reproduces how real engines treat a client that disconnects (--behavior), traces like
    vLLM, and can write what really happened to each request (--truth-log).
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The engine thread runs Python between matrix products; a short GIL switch interval lets the
    # event loop notice a disconnect and issue the abort within a step or two.
    sys.setswitchinterval(0.001)
    try:
        if gateway_upstream is not None:
            from replay.engine.gateway import GatewaySettings, build_gateway

            app: object = build_gateway(GatewaySettings(
                upstream=gateway_upstream, propagate=propagate == "yes", otlp=otlp,
                service_name=service_name or "ref-gateway", live=live, trace_context=trace_context == "yes"))
            what = f"gateway to {gateway_upstream} (propagate={propagate})"
        else:
            from replay.engine.server import EngineServer, EngineSettings

            server = EngineServer(EngineSettings(
                model=model, behavior=behavior, late_seconds=late_seconds, max_batch=max_batch,
                step_ms=step_ms, prefill_chunk=prefill_chunk, device=device, otlp=otlp, truth_log=truth_log,
                service_name=service_name or "ref-engine", trace_aborted=trace_aborted, live=live,
                engine_span=engine_span, metrics_names=metrics_names, send_spans=send_spans,
                one_at_a_time=one_at_a_time, process_pid=not no_process_pid,
                duplicate_server_span=duplicate_server_span, gauges_on_steps=gauges_on_steps,
                span_end_lag_ms=span_end_lag_ms))
            app = server.app()
            what = (f"engine {model} behavior={behavior} max_batch={max_batch} step={step_ms}ms "
                    f"({server.engine.backend.layers} layers on {device})")
        sock = _bind(host, port)
        bound = sock.getsockname()[1]
        if port_file:
            _write_port_file(port_file, bound)
    except AuditorError as exc:  # a one-line error, exit 1, as every auditor command gives
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{what} listening on http://{host}:{bound} (pid {os.getpid()})", err=True)
    sys.stderr.flush()
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    serve(app, sock, log_level, keep_alive_s)
