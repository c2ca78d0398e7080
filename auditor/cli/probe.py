"""``auditor probe``: stream kernel disconnect events for some ports, like bcc's tcpstates, filtered.

With ``--json`` each event is one JSON object per line, flushed at once (schema in docs/probe.md);
otherwise an aligned table. Status lines and the lost-event total go to stderr, so stdout stays
clean for pipes. SIGINT and SIGTERM stop the stream cleanly.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click

from auditor.cli.util import PORT, common_options, errors_as_click
from auditor.config import Config
from auditor.model import ConnEvent
from auditor.timefmt import rfc3339
from probes.source import SOURCE_CHOICES, open_source

# 70 columns or so, to fit a terminal: the time of day in UTC to the microsecond, endpoints wide enough
# for any IPv4 one and IPv6 loopback. The date, nanoseconds and the socket's cookie are in --json.
TABLE_HEADER = f"{'TIME (UTC)':<15} {'KIND':<9} {'CLIENT':<22} SERVER"


def event_json(event: ConnEvent) -> dict[str, Any]:
    return {
        "ts": rfc3339(event.ts_ns), "kind": event.kind.value,
        "client_addr": event.client_addr, "client_port": event.client_port,
        "server_addr": event.server_addr, "server_port": event.server_port,
        "family": event.family, "cookie": event.cookie,
    }


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def event_row(event: ConnEvent) -> str:
    time_of_day = rfc3339(event.ts_ns)[11:26]  # HH:MM:SS.ffffff
    return (f"{time_of_day:<15} {event.kind.value:<9} "
            f"{_endpoint(event.client_addr, event.client_port):<22} "
            f"{_endpoint(event.server_addr, event.server_port)}")


@contextmanager
def _stop_on_signals() -> Iterator[list[bool]]:
    """A flag set by SIGINT/SIGTERM, so the loop finishes its poll and shuts down in order."""
    stop = [False]

    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop[0] = True

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@click.command()
@click.option("--port", "ports", type=PORT, multiple=True,
              help="Server port to watch; repeat for more [default: probe.ports of the config].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (see docs/probe.md).")
@click.option("--dump-bpf", is_flag=True, help="Print the BPF program that would be loaded, and exit.")
@click.option("--source", type=click.Choice(SOURCE_CHOICES), default=None,
              help="bpf (eBPF, root), procfs (/proc polling, no privileges) or auto "
                   "[default: probe.source of the config, auto].")
@common_options
def probe(config: Config, ports: tuple[int, ...], as_json: bool, dump_bpf: bool,
          source: str | None) -> None:
    """Stream client disconnects (FIN, RST) and closes on server PORTs as they happen.

    \b
    Examples:
      auditor probe --port 8000
      auditor probe --port 8000 --port 8001 --json | jq .
    """
    if dump_bpf:
        from probes.bpf import default_client_slot_bits, program_text

        try:
            text = program_text(config.probe.ring_buffer_pages, client_slot_bits=default_client_slot_bits())
        except PermissionError as exc:  # the program fits this kernel's tracepoint formats, in tracefs
            raise click.ClickException(_dump_refused(exc)) from None
        click.echo(text, nl=False)
        return
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s", stream=sys.stderr)
    watched = list(ports) or list(config.probe.ports)
    try:
        with errors_as_click():
            src = open_source(watched, prefer=source or config.probe.source,
                              host=config.host_id or None, poll_hz=config.probe.poll_hz,
                              ringbuf_pages=config.probe.ring_buffer_pages)
    except KeyboardInterrupt:  # Ctrl-C while the program compiles: nothing to clean up yet
        click.echo("stopped before the probe was loaded", err=True)
        sys.exit(130)
    shown = 0
    with _stop_on_signals() as stop:
        src.start()
        unique = sorted(set(watched))
        click.echo(f"watching port{'s' if len(unique) > 1 else ''} {', '.join(map(str, unique))} "
                   f"with {src.name}; Ctrl-C to stop", err=True)
        if not as_json:
            click.echo(TABLE_HEADER)
        try:
            while not stop[0]:
                for event in src.poll(timeout_s=0.1):
                    line = json.dumps(event_json(event)) if as_json else event_row(event)
                    sys.stdout.write(line + "\n")
                    sys.stdout.flush()
                    shown += 1
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, and keep Python from complaining
            # about stdout again at exit.
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115
        finally:
            kernel = kernel_time_text(src)
            # The probe's ring buffer, or the kernel's notices of freed sockets (the times it dropped
            # some); without either, the /proc poller cannot count what it missed.
            countable = src.name != "procfs" or getattr(src, "notices", None) is not None
            src.stop()
    if countable:
        lost_text = f"{src.lost_events()} lost"
    else:
        lost_text = "losses not countable: /proc polling misses what happens between polls"
    click.echo(f"stopped: {shown} events shown, {lost_text} ({src.name}){kernel}", err=True)


def _dump_refused(exc: OSError) -> str:
    """Why --dump-bpf cannot read the tracepoint formats the program is fitted to, in the words
    the probe itself uses when it cannot load."""
    from probes.caps import UNIT_CAPABILITIES, missing_bpf_capabilities

    missing = missing_bpf_capabilities() or ["CAP_DAC_READ_SEARCH"]
    return (f"--dump-bpf reads this kernel's tracepoint formats from {exc.filename or 'tracefs'}, which this "
            f"user cannot read; eBPF needs {', '.join(missing)} (missing from the effective set): run as root, "
            f"or grant AmbientCapabilities={UNIT_CAPABILITIES} (systemd/auditor.service does)")


def kernel_time_text(src: object) -> str:
    """The eBPF probe's runs in the kernel while it watched, where the kernel counted them
    (kernel.bpf_stats_enabled=1); empty otherwise."""
    runs: dict[str, Any] = getattr(src, "program_runs", dict)()
    count = sum(run.runs for run in runs.values())
    if not count:
        return ""
    run_ns = sum(run.run_ns for run in runs.values())
    return f"; in the kernel: {count:,} program runs, {run_ns / 1e6:,.1f} ms, {run_ns / count:,.0f} ns a run"
