"""The report for people at a terminal: aligned columns with units, 100 columns wide, or as narrow as
80 for a terminal that is (``width``): then the notes wrap, and the breakdowns and the worst zombies
keep the columns that tell where the zombies are (the others are in the totals and in JSON).

Text from the store (routes, models, request ids) is user-controlled: control characters are shown
escaped so that a crafted request id cannot move the cursor or recolour the terminal.
"""

from __future__ import annotations

import textwrap
import unicodedata
from collections.abc import Callable

from auditor.report.model import (
    BreakdownRow,
    ClientTimeout,
    OrphanedPort,
    Prices,
    Report,
    Totals,
    waste_by_host,
)
from auditor.timefmt import rfc3339_seconds

WIDTH = 100
HOST_PRICES_SHOWN = 3  # the host patterns, and the hosts left unpriced, a price note names
NARROWEST = 80
BREAKDOWN_ROWS = 10  # per dimension; the JSON output has them all
BREAKDOWN_ROWS_HTML = 50
DIMENSION_TITLES = {"service": "service", "route": "route", "model": "model", "phase": "phase at disconnect",
                    "disconnect_kind": "disconnect kind", "host": "host", "client_address": "client address",
                    "user_agent": "user agent"}
VERDICT_LABELS = {"completed": "completed", "aborted": "aborted", "zombie": "zombie",
                  "inflight_zombie": "in-flight", "unconfirmed": "unconfirmed"}


def printable(text: str | None, empty: str = "-") -> str:
    """``text`` with control characters escaped (``\\x1b``), or ``empty`` for None/""."""
    if not text:
        return empty
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def cells(text: str) -> int:
    """Terminal cells ``text`` takes: wide (East Asian) characters take two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` terminal cells, cut with an ellipsis."""
    if cells(text) <= width:
        return text
    kept, used = [], 1  # the ellipsis
    for ch in text:
        used += cells(ch)
        if used > width:
            break
        kept.append(ch)
    return "".join(kept) + "…"


def fit(text: str, width: int) -> str:
    """``text`` clipped and padded to exactly ``width`` terminal cells (a column)."""
    text = clip(text, width)
    return text + " " * (width - cells(text))


def duration(seconds: float) -> str:
    """``3h 25m``, ``4m 10s``, ``12.5s``: a span of time the way people say it."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def money(value: float, currency: str = "") -> str:
    """A cost to the cent, or to two significant digits below one: ``1,234.50 USD``, ``0.0042 USD``."""
    text = f"{value:,.2f}" if value == 0 or value >= 0.995 else f"{value:.2g}"
    return f"{text} {currency}" if currency else text


def price_note(prices: Prices, unpriced: list[tuple[str | None, str]]) -> str:
    """At what the wasted time was priced, and which kind of it was left out for want of a price
    (``unpriced``: host, kind; ``Prices.unpriced_hosts``)."""
    rates = [_rates(prices.gpu_hour, prices.gpu_hour_by_host, f"{prices.currency} a GPU-hour"),
             _rates(prices.cpu_hour, prices.cpu_hour_by_host, f"{prices.currency} a CPU core-hour")]
    rates = [rate for rate in rates if rate]
    note = f"at {' and '.join(rates)}" if rates else "unpriced"
    for kind in ("GPU", "CPU"):
        hosts = sorted({host or "" for host, left in unpriced if left == kind})
        if not hosts:
            continue
        key = "gpu_hour_price" if kind == "GPU" else "cpu_hour_price"
        if not prices.by_host:
            note += f"; {kind} time not priced (report.{key})"
        else:
            shown = ", ".join(hosts[:HOST_PRICES_SHOWN]) + (
                f" and {len(hosts) - HOST_PRICES_SHOWN} more" if len(hosts) > HOST_PRICES_SHOWN else "")
            note += f"; {kind} time of {shown} not priced (report.{key}s)"
    return note


def _rates(price: float, by_host: tuple[tuple[str, float], ...], unit: str) -> str:
    """``2.5 USD a GPU-hour``, or by host: ``9 USD a GPU-hour on gpu-b, 3 on gpu-*, 1 elsewhere``."""
    parts = [f"{value:,.10g} on {pattern}" for pattern, value in by_host[:HOST_PRICES_SHOWN]]
    if len(by_host) > HOST_PRICES_SHOWN:
        more = len(by_host) - HOST_PRICES_SHOWN
        parts.append(f"{more} more pattern{'s' if more > 1 else ''}")
    if price:
        parts.append(f"{price:,.10g} elsewhere" if by_host else f"{price:,.10g}")
    if not parts:
        return ""
    first, _, where = parts[0].partition(" ")
    return f"{first} {unit}{' ' + where if where else ''}" + "".join(f", {part}" for part in parts[1:])


def wasted_cost(report: Report) -> tuple[str, str] | None:
    """The window's wasted time in money and at what it was priced; None where the report is unpriced."""
    t, prices = report.totals, report.prices
    if prices is None:
        return None
    cost = report.cost(t)
    return (money(cost or 0.0, prices.currency), price_note(prices, prices.unpriced_hosts(waste_by_host(t))))


def render_table(report: Report, width: int = WIDTH) -> str:
    """The report in at most ``width`` columns (80 to 100; outside that, the nearest)."""
    width = max(NARROWEST, min(WIDTH, width))
    lines = _header(report, width)
    if report.empty:
        lines += ["", report.empty_message()]
        if report.has_coverage:  # lost events or closes seen in a window without requests: say so
            lines += _coverage(report, width)
        return "\n".join(line.rstrip() for line in lines) + "\n"
    lines += _totals(report, width) + _coverage(report, width) + _orphaned(report, width)
    if width < WIDTH and any(report.breakdowns.values()):
        lines += ["", "Breakdowns narrowed to this terminal: their completed, aborted and",
                  "unconfirmed counts are in --format json (or 100 columns)."]
    for dimension, rows in report.breakdowns.items():
        lines += _breakdown(DIMENSION_TITLES.get(dimension, dimension), rows, report.totals.cost_unit, width,
                            long_keys=dimension == "user_agent")
    lines += _timeouts(report, width) + _worst(report, width)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _header(report: Report, width: int) -> list[str]:
    query = report.query
    window = (f"{rfc3339_seconds(query.since_ns)} to {rfc3339_seconds(query.until_ns)} "
              f"({duration((query.until_ns - query.since_ns) / 1e9)})")
    lines = [f"Zombie requests  {window}"]
    filters = query.describe_filters()
    if filters:
        lines.append(clip(f"filters: {printable(filters)}", width))
    return lines


def _row_maker(width: int) -> Callable[..., str]:
    value_width = 16 if width >= WIDTH else 14

    def row(label: str, value: str, note: str = "") -> str:
        first = f"  {label:<22}{value:>{value_width}}  "
        if len(first) + len(note) <= width:
            return first + note
        wrapped = textwrap.wrap(note, width - len(first)) or [""]
        return "\n".join([first + wrapped[0], *(" " * len(first) + more for more in wrapped[1:])])

    return row


def disconnects_note(t: Totals) -> str:
    """Disconnects are counted by when the client left and requests by when they started: a window
    can hold more of the first, and a share over 100% would say nothing."""
    if t.disconnects <= t.requests:
        return f"{percent(t.disconnects, t.requests)} of requests: client left while in flight"
    return "client left while in flight (more than the requests begun in the window: some began before it)"


def tokens_value(t: Totals) -> tuple[str, str]:
    """Wasted tokens and their note: "unknown" where no zombie's count is known."""
    zombies = t.zombies + t.inflight_zombies
    if zombies and t.zombies_without_tokens == zombies and not t.wasted_tokens:
        return "unknown", "no engine span told the tokens of any zombie"
    notes = [f"{t.wasted_tokens_estimated:,} of them estimated"] if t.wasted_tokens_estimated else []
    if t.zombies_without_tokens:
        notes.append(f"at least: unknown for {t.zombies_without_tokens:,} zombie"
                     f"{'s' if t.zombies_without_tokens != 1 else ''}")
    return f"{t.wasted_tokens:,}", "; ".join(notes)


def _totals(report: Report, width: int) -> list[str]:
    t = report.totals
    row = _row_maker(width)
    gpu_note = (f"{percent(t.wasted_gpu_seconds, t.gpu_seconds)} of {t.gpu_seconds:,.0f} GPU-s "
                f"({t.gpus} GPU{'s' if t.gpus != 1 else ''} x window)"
                if t.gpu_seconds else "no GPU samples in the window")
    tokens, tokens_note = tokens_value(t)
    rows = [
        "",
        "Totals",
        row("requests", f"{t.requests:,}", "HTTP server spans that started in the window"),
        row("disconnects", f"{t.disconnects:,}", disconnects_note(t)),
        row("  completed", f"{t.completed:,}", "response was already complete"),
        row("  aborted", f"{t.aborted:,}", "work stopped within the grace period"),
        row("  zombie", f"{t.zombies:,}", "work went on after the client left"),
        row("  in-flight zombie", f"{t.inflight_zombies:,}", "still running, client gone"),
        row("  unconfirmed", f"{t.unconfirmed:,}", "client left early; nothing told if work stopped"),
        *([row("    no gauges read", f"{t.unconfirmed_without_gauges:,}",
               "the engine's /metrics could tell: auditor doctor")]
          if t.unconfirmed_without_gauges else []),
        *([row("    raced their answer", f"{t.unconfirmed_raced:,}",
               "closed as the answer ended: whole, or stopped?")]
          if t.unconfirmed_raced else []),
        row("zombie time", f"{t.zombie_seconds:,.1f} s",
            duration(t.zombie_seconds) if t.zombie_seconds >= 60 else ""),
        row("wasted tokens", tokens, tokens_note),
        row("wasted GPU time", f"{t.wasted_gpu_seconds:,.1f} GPU-s", gpu_note),
        row("wasted CPU time", f"{t.wasted_cpu_seconds:,.1f} CPU-s"),
        *([row("wasted cost", *priced)] if (priced := wasted_cost(report)) else []),
        row("no max_tokens cap", f"{t.uncapped_disconnects:,}",
            "disconnected requests that could run unbounded (as engine spans tell)"),
        *([row("zombies not costed", f"{t.uncosted_zombies:,}",
               "engine process unknown: details.cost_unmeasured")]
          if t.uncosted_zombies else []),
    ]
    return [line for text in rows for line in text.split("\n")]


def _coverage(report: Report, width: int) -> list[str]:
    t = report.totals
    row = _row_maker(width)
    rows = [
        "",
        "Coverage (seen, but not a verdict)",
        row("idle closes", f"{t.idle_closes:,}", "keep-alive closes between requests (normal)"),
        row("unjoined disconnects", f"{t.unjoined_disconnects:,}", "peer closes with no span to join"),
        row("unjoined spans", f"{t.unjoined_spans:,}", "server spans whose connection was not seen"),
        row("lost kernel events", f"{t.lost_kernel_events:,}",
            "dropped by the ring buffer" + (": findings may be missing" if t.lost_kernel_events else "")),
        row("proxy-rewritten peers", f"{t.proxy_rewritten_peers:,}", "peer from X-Forwarded-For, not joined"),
        row("peerless span joins", f"{t.peerless_span_joins:,}",
            "spans without a peer, joined by server port (inferred)"),
    ]
    return [line for text in rows for line in text.split("\n")]


def without_spans(report: Report) -> list[OrphanedPort]:
    """The ports whose orphaned work the table and the HTML show: those that sent no spans. A port
    that sent spans has verdicts for the same requests, told better (its stretches are a lower
    bound of the same zombie time, and a figure beside it that reads lower only puzzles): JSON
    keeps it."""
    return [port for port in report.orphaned_work or () if not port.with_spans]


def _orphaned(report: Report, width: int) -> list[str]:
    """Work each engine port ran after its clients left, told by the port alone: the zombie work
    of engines that send no spans. Shown where there is some."""
    ports = without_spans(report)
    if not ports:
        return []
    unit = report.totals.cost_unit
    priced = report.prices is not None
    lines = ["", "Orphaned work by port (the engine's gauges and the kernel alone; at least)",
             f"  {'':<20} {'stretches':>9} {'longest':>8} {'peak':>5} {'request-s':>10} {unit + '-s':>9}"
             + (f" {'cost':>10}" if priced else "")]
    for port in ports:
        wasted = port.wasted_gpu_seconds if unit == "GPU" else port.wasted_cpu_seconds
        line = (f"  {fit(printable(f'{port.host}:{port.server_port}'), 20)} {port.stretches:>9,} "
                f"{duration(port.longest_seconds):>8} {port.peak:>5,} {port.request_seconds:>10,.1f} {wasted:>9,.1f}")
        if report.prices is not None:
            line += f" {clip(money(report.cost(port) or 0.0), 10):>10}"
        lines.append(line)
        notes = orphaned_notes(port)
        if notes:
            lines += ["    " + text for text in textwrap.wrap(printable("; ".join(notes)), width - 4)]
    lines += textwrap.wrap("Ports that sent no spans, so no verdicts: work they ran for clients gone. Ports "
                           "with spans count it in their verdicts (JSON lists theirs too).", width - 2,
                           initial_indent="  ", subsequent_indent="  ")
    return lines


def orphaned_notes(port: OrphanedPort) -> list[str]:
    notes = [f"model {port.model}"] if port.model else []
    if port.running:
        notes.append(f"{port.running:,} still running when last seen")
    if port.cost_unmeasured:
        notes.append(f"not costed: {port.cost_unmeasured}")
    return notes


def _breakdown_header(unit: str, wide: bool) -> str:
    if not wide:
        return (f"  {'':<20} {'disconn':>7} {'zombie':>7} {'in-flight':>9} {'zombie s':>9} {'tokens':>8} "
                f"{unit + '-s':>8}")
    return (f"  {'':<20} {'disconn':>7} {'complete':>8} {'aborted':>7} {'zombie':>7} "
            f"{'in-flight':>9} {'unconf':>6} {'zombie s':>9} {'tokens':>8} {unit + '-s':>8}")


def _breakdown(title: str, rows: list[BreakdownRow], unit: str, width: int, *, long_keys: bool = False) -> list[str]:
    """A breakdown's rows; with ``long_keys``, a key longer than its column (a browser's User-Agent)
    on a line of its own above its figures, where cut to the column it would say little."""
    if not rows:
        return []
    wide = width >= WIDTH
    lines = ["", f"By {title}", _breakdown_header(unit, wide)]
    for row in rows[:BREAKDOWN_ROWS]:
        name = printable(row.key, "(none)")
        if long_keys and cells(name) > 20:
            lines.append(clip(f"  {name}", width))
            name = ""
        key = f"  {fit(name, 20)} {row.disconnects:>7,} "
        tail = (f"{row.zombies:>7,} {row.inflight_zombies:>9,} {row.zombie_seconds:>9,.1f} "
                f"{row.wasted_tokens:>8,} {row.wasted_seconds(unit):>8,.1f}")
        if not wide:
            lines.append(key + tail)
            continue
        lines.append(
            f"{key}{row.completed:>8,} {row.aborted:>7,} {row.zombies:>7,} {row.inflight_zombies:>9,} "
            f"{row.unconfirmed:>6,} {row.zombie_seconds:>9,.1f} {row.wasted_tokens:>8,} "
            f"{row.wasted_seconds(unit):>8,.1f}")
    if len(rows) > BREAKDOWN_ROWS:
        lines.append(f"  ... and {len(rows) - BREAKDOWN_ROWS} more (all of them in --format json)")
    return lines


TIMEOUT_ADVICE = ("A client or a proxy gave up on these a fixed time after they were sent. Where they are "
                  "zombies the engine ran on: raise the timeout above the answers' time, cap max_tokens, "
                  "or stream.")


def left_between(first_ns: int, last_ns: int) -> str:
    """``04:00:31 to 04:59:58`` within a day, ``11-22 04:00 to 11-23 09:12`` across days (UTC)."""
    first, last = rfc3339_seconds(first_ns), rfc3339_seconds(last_ns)
    if first[:10] == last[:10]:
        return f"{first[11:19]} to {last[11:19]}"
    return f"{first[5:16].replace('T', ' ')} to {last[5:16].replace('T', ' ')}"


def zombie_work_note(t: ClientTimeout) -> str:
    """What the answers a timeout cut needed, as its zombies' work tells."""
    return (f"its zombies worked {t.zombie_work_mean_seconds:,.1f} s from their start on average, "
            f"{t.zombie_work_max_seconds:,.1f} s at most: a timeout above that lets such answers end")


def callers_note(t: ClientTimeout) -> str:
    """Who a timeout cut: ``sent by A (8), B (4); from 10.0.0.7 (12)``, unnamed ones as ``-``."""
    def listed(pairs: tuple[tuple[str | None, int], ...]) -> str:
        return ", ".join(f"{printable(value)} ({n:,})" for value, n in pairs)

    parts = ([f"sent by {listed(t.user_agents)}"] if t.user_agents else []) + \
        ([f"from {listed(t.client_addresses)}"] if t.client_addresses else [])
    return "; ".join(parts)


def _timeouts(report: Report, width: int) -> list[str]:
    if not report.client_timeouts:
        return []
    unit = report.totals.cost_unit
    wide = width >= WIDTH  # narrower, the in-flight zombies are in the zombies (and apart in JSON)
    lines = ["", "Client timeouts (disconnects that came at one age of their request)",
             f"  {'after s':>7}  {'disconn':>7}  {'zombie':>6}  {'in-flight  ' if wide else ''}{'zombie s':>9}  "
             f"{unit + '-s':>8}  left (UTC)"]
    for t in report.client_timeouts:
        zombies = t.zombies if wide else t.zombies + t.inflight_zombies
        lines.append(clip(f"  {t.after_seconds:>7.2f}  {t.disconnects:>7,}  {zombies:>6,}  "
                          f"{f'{t.inflight_zombies:>9,}  ' if wide else ''}{t.zombie_seconds:>9,.1f}  "
                          f"{t.wasted_seconds(unit):>8,.1f}  {left_between(t.first_ns, t.last_ns)}", width))
        notes = [f"the default of {t.default_of}"] if t.default_of else []
        cost = report.cost(t)
        if cost and report.prices is not None:
            notes.append(f"the work past its disconnects cost {money(cost, report.prices.currency)}")
        if t.zombie_work_max_seconds is not None:
            notes.append(zombie_work_note(t))
        if t.user_agents or t.client_addresses:
            notes.append(callers_note(t))
        for note in notes:
            lines += textwrap.wrap(note, width, initial_indent=" " * 11, subsequent_indent=" " * 11)
    return lines + textwrap.wrap(TIMEOUT_ADVICE, width, initial_indent="  ", subsequent_indent="  ")


def _worst(report: Report, width: int) -> list[str]:
    if report.query.top == 0:
        return []
    if not report.worst_zombies:
        return ["", "No zombies in the window."]
    unit = report.totals.cost_unit
    wide = width >= WIDTH
    # Narrower: the disconnect's date without its year, routes and models clipped shorter.
    at_width, at_cut, route_width, model_width = (20, 0, 20, 14) if wide else (14, 5, 13, 10)
    lines = ["", "Worst zombies (by zombie time; ids are full, for lookup in a tracing backend)",
             f"  {'#':>2} {'zombie s':>9} {'verdict':<9} {'phase':<7} "
             f"{'disconnect (UTC)' if wide else 'left at (UTC)':<{at_width}} "
             f"{'route':<{route_width}} {'model':<{model_width}} {unit + '-s':>7}"]
    for rank, finding in enumerate(report.worst_zombies, 1):
        at = rfc3339_seconds(finding.disconnect_at_ns)[at_cut:]
        if not wide:
            at = at.replace("T", " ").removesuffix("Z")
        lines.append(
            f"  {rank:>2} {finding.lag_seconds or 0.0:>9,.1f} "
            f"{VERDICT_LABELS.get(finding.verdict, finding.verdict):<9} {clip(finding.phase, 7):<7} "
            f"{at:<{at_width}} "
            f"{fit(printable(finding.route), route_width)} "
            f"{fit(printable(finding.model), model_width)} "
            f"{finding.wasted_seconds(unit):>7,.1f}")
        if finding.lag_at_least_seconds is not None:  # within 80 columns
            lines.append(f"{'':5}ran on at least {finding.lag_at_least_seconds:,.1f} s: "
                         "clients that left later may own its work")
        lines += _id_lines("request", printable(finding.request_id), width)
        lines += _id_lines("trace", printable(finding.trace_id), width)
        told = f"  told by {printable(finding.evidence)}" if finding.evidence else ""
        lines.append(f"{'':5}host {printable(finding.host)}  client {printable(finding.client)}{told}")
    return lines


def _id_lines(label: str, identifier: str, width: int) -> list[str]:
    """An id printed whole; one longer than a line continues on the next rather than being cut."""
    prefix = f"{'':5}{label:<8}"
    room = width - len(prefix)
    chunks = [identifier[i:i + room] for i in range(0, len(identifier), room)] or [""]
    return [prefix + chunks[0]] + [" " * len(prefix) + chunk for chunk in chunks[1:]]


__all__ = ["render_table"]
