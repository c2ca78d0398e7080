"""The report as one self-contained HTML page: inline CSS and inline SVG plots, no scripts, no network.

It opens from a file on a laptop with no access to the GPU host or the internet. Every value from
the store is escaped (request ids, routes and models are chosen by clients).
"""

from __future__ import annotations

from auditor.report.model import Report, RequestFinding, Wasted
from auditor.report.render_table import (
    BREAKDOWN_ROWS_HTML,
    DIMENSION_TITLES,
    TIMEOUT_ADVICE,
    VERDICT_LABELS,
    callers_note,
    disconnects_note,
    duration,
    left_between,
    money,
    orphaned_notes,
    percent,
    tokens_value,
    wasted_cost,
    without_spans,
    zombie_work_note,
)
from auditor.report.svg import Series, age_chart, esc, time_chart, zombie_timelines
from auditor.timefmt import rfc3339, rfc3339_seconds

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:960px;
color:#1d2430;background:#fff;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde2ea}
.sub{color:#5b6575}.note{background:#fff6da;border:1px solid #e9d48a;padding:10px 14px;border-radius:6px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:10px;margin:16px 0}
.card{border:1px solid #dde2ea;border-radius:8px;padding:10px 12px}
.card b{display:block;font-size:20px}.card span{color:#5b6575;font-size:12px}
table{border-collapse:collapse;width:100%;margin:6px 0 12px;font-variant-numeric:tabular-nums}
th,td{padding:3px 8px;border-bottom:1px solid #eef1f5;text-align:right;vertical-align:top}
th:first-child,td:first-child{text-align:left}td.id,.mono{font-family:ui-monospace,Menlo,monospace;
font-size:12px;word-break:break-all;text-align:left}
svg{width:100%;height:auto;font:11px system-ui,sans-serif;fill:#5b6575}
svg .grid{stroke:#eef1f5}svg .serving{fill:#9fb3cc}svg .zombie{fill:#d9534f}
svg .util{fill:#f0ad4e;fill-opacity:.35;stroke:#f0ad4e}svg .cut{stroke:#1d2430;stroke-dasharray:3 2}
svg .small{font-size:10px}svg .serving-t{fill:#9fb3cc}svg .zombie-t{fill:#d9534f}
svg .util-t{fill:#f0ad4e}
"""


def render_html(report: Report) -> str:
    query = report.query
    title = f"Zombie requests {rfc3339_seconds(query.since_ns)} to {rfc3339_seconds(query.until_ns)}"
    filters = query.describe_filters()
    body = [
        f"<h1>{esc(title)}</h1>",
        f'<p class="sub">{esc(duration((query.until_ns - query.since_ns) / 1e9))} window'
        f'{"; " + esc(filters) if filters else ""}; generated {esc(rfc3339_seconds(report.generated_ns))}'
        "; times in UTC</p>",
    ]
    if report.empty:
        body.append(f'<p class="note">{esc(report.empty_message())}</p>')
        if report.has_coverage:  # lost events or closes seen in a window without requests: say so
            body += _coverage_table(report)
    else:
        body += _cards(report) + _plots(report) + _totals_table(report) + _coverage_table(report)
        body += _orphaned_table(report)
        body += _breakdowns(report) + _timeouts(report)
        body += _worst_table(report.worst_zombies, report.totals.cost_unit)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _cards(report: Report) -> list[str]:
    t = report.totals
    share = t.wasted_gpu_share
    if t.cost_unit == "CPU":
        wasted = (f"{t.wasted_cpu_seconds:,.1f} CPU-s", "wasted (no GPU on these hosts)")
    else:
        wasted = (f"{t.wasted_gpu_seconds:,.1f} GPU-s",
                  f"wasted, {share * 100:.2f}% of GPU time" if share is not None else "wasted (no GPU samples)")
    tokens, _ = tokens_value(t)
    cards = [
        (f"{t.requests:,}", "requests"),
        (f"{t.disconnects:,}", f"disconnects ({percent(t.disconnects, t.requests)})"
         if t.disconnects <= t.requests else "disconnects (some of requests begun before the window)"),
        (f"{t.zombies + t.inflight_zombies:,}", f"zombies ({t.inflight_zombies:,} still running)"),
        (duration(t.zombie_seconds), "zombie time"),
        wasted,
        (tokens, "tokens generated for nobody" + (" (at least)" if t.zombies_without_tokens and tokens != "unknown"
                                                  else "")),
    ]
    priced = wasted_cost(report)
    if priced:
        cards.insert(5, (priced[0], f"wasted, {priced[1]}"))
    return ['<div class="cards">'] + [
        f'<div class="card"><b>{esc(value)}</b><span>{esc(label)}</span></div>' for value, label in cards
    ] + ["</div>"]


def _plots(report: Report) -> list[str]:
    parts: list[str] = []
    if report.series:
        starts = [bucket.start_ns for bucket in report.series]
        minutes = report.bucket_ns / 60e9
        unit = report.totals.cost_unit
        wasted = [b.wasted_cpu_seconds if unit == "CPU" else b.wasted_gpu_seconds for b in report.series]
        parts += [f"<h2>Zombies and wasted {unit} time</h2>", time_chart(
            f"zombies and wasted {unit}-seconds over time", starts, report.bucket_ns,
            Series("zombies (by disconnect time)", [b.zombies for b in report.series], "#d9534f", "bar",
                   counts=True),
            Series(f"wasted {unit}-seconds", wasted, "#7a4fd9"))]
        completed = Series("completed requests / min", [b.completed_requests / minutes for b in report.series],
                           "#2f7ed8")
        if any(b.gpu_util_percent is not None for b in report.series) or \
                not any(b.engine_cores is not None for b in report.series):
            parts += ["<h2>Completed requests against GPU utilization</h2>",
                      '<p class="sub">Zombies show as the gap: the GPU stays busy while fewer requests '
                      "complete.</p>", time_chart(
                "completed requests per minute against GPU utilization", starts, report.bucket_ns, completed,
                Series("GPU utilization %", [b.gpu_util_percent for b in report.series], "#f0ad4e",
                       fixed_max=100.0))]
        else:  # no GPU samples, the engines' CPU read from /proc: that is where the work shows
            parts += ["<h2>Completed requests against the engines' CPU</h2>",
                      '<p class="sub">No GPU samples in the window. Zombies show as the gap: the engines '
                      "stay busy while fewer requests complete.</p>", time_chart(
                "completed requests per minute against the engine processes' CPU in cores", starts,
                report.bucket_ns, completed,
                Series("engine CPU, cores", [b.engine_cores for b in report.series], "#f0ad4e"))]
    parts += _orphaned_plot(report)
    parts += _ages(report)
    if report.timelines:
        parts += ["<h2>Worst zombies, request by request</h2>", zombie_timelines(report.timelines)]
    return parts


def _totals_table(report: Report) -> list[str]:
    t = report.totals
    gpu = (f"{percent(t.wasted_gpu_seconds, t.gpu_seconds)} of {t.gpu_seconds:,.0f} GPU-s "
           f"({t.gpus} GPUs x window)" if t.gpu_seconds else "no GPU samples in the window")
    tokens, tokens_note = tokens_value(t)
    priced = wasted_cost(report)
    rows = [
        ("requests", f"{t.requests:,}"), ("disconnects", f"{t.disconnects:,}; {disconnects_note(t)}"),
        ("completed", f"{t.completed:,}"), ("aborted", f"{t.aborted:,}"),
        ("zombie", f"{t.zombies:,}"), ("in-flight zombie", f"{t.inflight_zombies:,}"),
        ("unconfirmed", f"{t.unconfirmed:,}"
         + (f" ({t.unconfirmed_without_gauges:,} with no gauges of their engine read: its /metrics, scraped, could "
            "tell; auditor doctor says why it is not)" if t.unconfirmed_without_gauges else "")
         + (f" ({t.unconfirmed_raced:,} whose client closed as its answer ended: a whole answer, or one the "
            "server stopped at once; an engine span joined to the request would tell)" if t.unconfirmed_raced else "")),
        ("zombie time", f"{t.zombie_seconds:,.1f} s"),
        ("wasted tokens", f"{tokens} ({tokens_note})" if tokens_note else tokens),
        ("wasted GPU time", f"{t.wasted_gpu_seconds:,.1f} GPU-s, {gpu}"),
        ("wasted CPU time", f"{t.wasted_cpu_seconds:,.1f} CPU-s"),
        *([("wasted cost", ", ".join(priced))] if priced else []),
        ("disconnected requests without max_tokens (as engine spans tell)", f"{t.uncapped_disconnects:,}"),
        ("zombies not costed (details.cost_unmeasured says why)", f"{t.uncosted_zombies:,}"),
    ]
    return ["<h2>Totals</h2><table>"] + [
        f"<tr><td>{esc(label)}</td><td>{esc(value)}</td></tr>" for label, value in rows] + ["</table>"]


def _coverage_table(report: Report) -> list[str]:
    t = report.totals
    rows = [
        ("coverage: idle closes", f"{t.idle_closes:,}"),
        ("coverage: unjoined disconnects", f"{t.unjoined_disconnects:,}"),
        ("coverage: unjoined spans", f"{t.unjoined_spans:,}"),
        ("coverage: lost kernel events",
         f"{t.lost_kernel_events:,}" + (": findings may be missing" if t.lost_kernel_events else "")),
        ("coverage: proxy-rewritten peers", f"{t.proxy_rewritten_peers:,}"),
        ("coverage: peerless span joins", f"{t.peerless_span_joins:,}"),
    ]
    return ["<h2>Coverage (seen, but not a verdict)</h2><table>"] + [
        f"<tr><td>{esc(label)}</td><td>{esc(value)}</td></tr>" for label, value in rows] + ["</table>"]


def _orphaned_plot(report: Report) -> list[str]:
    """The work ports without spans ran for clients gone, over the window: shown where there is some."""
    if not report.series or not any(b.orphaned_requests for b in report.series):
        return []
    unit = report.totals.cost_unit
    starts = [bucket.start_ns for bucket in report.series]
    wasted = [b.orphaned_wasted_cpu_seconds if unit == "CPU" else b.orphaned_wasted_gpu_seconds
              for b in report.series]
    return ["<h2>Orphaned work on ports without spans</h2>",
            '<p class="sub">Requests the engines ran for clients that had left, told by their gauges and the '
            "kernel alone (no verdicts: the engines sent no spans). At least.</p>", time_chart(
                f"orphaned requests at once and their {unit}-seconds over time", starts, report.bucket_ns,
                Series("orphaned requests at once (mean)", [b.orphaned_requests for b in report.series], "#d9534f",
                       "bar"),
                Series(f"their {unit}-seconds", wasted, "#7a4fd9"))]


def _orphaned_table(report: Report) -> list[str]:
    """Work each engine port ran after its clients left, told by the port alone (lower bounds)."""
    ports = without_spans(report)
    if not ports:
        return []
    unit = report.totals.cost_unit
    parts = ["<h2>Orphaned work by port</h2>",
             '<p class="sub">Requests an engine ran beyond the clients connected to its port, by its own '
             "/metrics and the kernel alone: the zombie work of engines that send no spans, which give no "
             "verdicts. At least: a stretch starts at the first scrape that counts an orphan. Ports with "
             "spans count this work in their verdicts (the JSON lists theirs too).</p>",
             "<table><tr><th>host:port</th><th>model</th><th>stretches</th><th>longest</th><th>peak</th>"
             f"<th>request-s</th><th>{unit}-s</th>{_cost_head(report)}<th>note</th></tr>"]
    for port in ports:
        notes = orphaned_notes(port)
        wasted = port.wasted_gpu_seconds if unit == "GPU" else port.wasted_cpu_seconds
        parts.append(
            f"<tr><td>{esc(f'{port.host}:{port.server_port}')}</td><td>{esc(port.model or '-')}</td>"
            f"<td>{port.stretches:,}</td><td>{esc(duration(port.longest_seconds))}</td><td>{port.peak:,}</td>"
            f"<td>{port.request_seconds:,.1f}</td><td>{wasted:,.1f}</td>"
            f"{_cost_cell(report, port)}"
            f"<td>{esc('; '.join(n for n in notes if not n.startswith('model ')))}</td></tr>")
    return [*parts, "</table>"]


def _breakdowns(report: Report) -> list[str]:
    parts = []
    unit = report.totals.cost_unit
    priced = _cost_head(report)
    for dimension, rows in report.breakdowns.items():
        if not rows:
            continue
        parts.append(f"<h2>By {esc(DIMENSION_TITLES.get(dimension, dimension))}</h2><table><tr>"
                     "<th></th><th>disconnects</th><th>completed</th><th>aborted</th><th>zombie</th>"
                     f"<th>in-flight</th><th>unconfirmed</th><th>zombie s</th><th>tokens</th><th>{unit}-s</th>"
                     f"{priced}</tr>")
        for row in rows[:BREAKDOWN_ROWS_HTML]:
            parts.append(
                f"<tr><td>{esc(row.key if row.key is not None else '(none)')}</td>"
                f"<td>{row.disconnects:,}</td><td>{row.completed:,}</td><td>{row.aborted:,}</td>"
                f"<td>{row.zombies:,}</td><td>{row.inflight_zombies:,}</td><td>{row.unconfirmed:,}</td>"
                f"<td>{row.zombie_seconds:,.1f}</td><td>{row.wasted_tokens:,}</td>"
                f"<td>{row.wasted_seconds(unit):,.1f}</td>"
                f"{_cost_cell(report, row)}</tr>")
        if len(rows) > BREAKDOWN_ROWS_HTML:
            parts.append(f'<tr><td colspan="{11 if priced else 10}">... and {len(rows) - BREAKDOWN_ROWS_HTML:,} more '
                         "(all of them in --format json or csv)</td></tr>")
        parts.append("</table>")
    return parts


def _cost_head(report: Report) -> str:
    """A cost column's heading where the report is priced, else nothing."""
    return "" if report.prices is None else f"<th>cost, {esc(report.prices.currency)}</th>"


def _cost_cell(report: Report, wasted: Wasted) -> str:
    cost = report.cost(wasted)
    return "" if cost is None else f"<td>{esc(money(cost))}</td>"


def _ages(report: Report) -> list[str]:
    """When clients left, by their request's age, with a line at each timeout found."""
    if not report.ages:
        return []
    beyond = f" {report.ages_beyond:,} that left later still are not drawn." if report.ages_beyond else ""
    return ["<h2>When clients left</h2>",
            '<p class="sub">Seconds from each request\'s start to its client\'s leaving. A timeout shows as a '
            f"spike: every request it cut short left at one age.{esc(beyond)}</p>",
            age_chart(report.ages, report.age_bar_s, [t.after_seconds for t in report.client_timeouts])]


def _timeouts(report: Report) -> list[str]:
    if not report.client_timeouts:
        return []
    unit = report.totals.cost_unit
    parts = ["<h2>Client timeouts</h2><table><tr><th>after s</th><th>from-to s</th><th>disconnects</th>"
             "<th>completed</th><th>aborted</th><th>zombie</th><th>in-flight</th><th>unconfirmed</th>"
             f"<th>zombie s</th><th>{unit}-s</th>{_cost_head(report)}<th>left (UTC)</th><th>its zombies' work</th>"
             "<th>the default of</th><th>who</th></tr>"]
    for t in report.client_timeouts:
        worked = zombie_work_note(t).removeprefix("its zombies ") if t.zombie_work_max_seconds is not None else ""
        parts.append(
            f"<tr><td>{t.after_seconds:.2f}</td><td>{t.from_seconds:g}-{t.to_seconds:g}</td>"
            f"<td>{t.disconnects:,}</td><td>{t.completed:,}</td><td>{t.aborted:,}</td><td>{t.zombies:,}</td>"
            f"<td>{t.inflight_zombies:,}</td><td>{t.unconfirmed:,}</td><td>{t.zombie_seconds:,.1f}</td>"
            f"<td>{t.wasted_seconds(unit):,.1f}</td>{_cost_cell(report, t)}"
            f"<td>{esc(left_between(t.first_ns, t.last_ns))}</td>"
            f"<td>{esc(worked)}</td><td>{esc(t.default_of or '')}</td><td>{esc(callers_note(t))}</td></tr>")
    parts.append(f'</table><p class="sub">{esc(TIMEOUT_ADVICE)}</p>')
    return parts


def _lag(finding: RequestFinding) -> str:
    """A zombie's time, with how short it may have been where later leavers may own its orphans."""
    shown = f"{finding.lag_seconds or 0.0:,.1f}"
    if finding.lag_at_least_seconds is None:
        return shown
    return (f'<span title="its work may have stopped this soon after the client left: clients that left '
            f'after it may own the work the gauges gave it">{shown} (&ge; {finding.lag_at_least_seconds:,.1f})</span>')


def _worst_table(findings: list[RequestFinding], unit: str) -> list[str]:
    if not findings:
        return ["<h2>Worst zombies</h2><p>No zombies in the window.</p>"]
    parts = ["<h2>Worst zombies</h2><table><tr><th>request id</th><th>trace id</th><th>verdict</th>"
             "<th>zombie s</th><th>disconnect</th><th>route</th><th>model</th><th>host</th>"
             f'<th>{unit}-s</th><th title="the evidence that decided the verdict (docs/verdicts.md)">told by</th></tr>']
    for f in findings:
        parts.append(
            f'<tr><td class="id">{esc(f.request_id or "")}</td><td class="id">{esc(f.trace_id or "")}</td>'
            f"<td>{esc(VERDICT_LABELS.get(f.verdict, f.verdict))}</td>"
            f"<td>{_lag(f)}</td><td>{esc(rfc3339(f.disconnect_at_ns)[:23].replace('T', ' '))}</td>"
            f"<td>{esc(f.route or '')}</td><td>{esc(f.model or '')}</td><td>{esc(f.host)}</td>"
            f"<td>{f.wasted_seconds(unit):,.1f}</td><td>{esc(f.evidence or '')}</td></tr>")
    parts.append("</table>")
    return parts
