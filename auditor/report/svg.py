"""Small inline-SVG plots for the HTML report, generated here so the page needs no network or library.

Every string that reaches the markup goes through ``esc``: labels can come from the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from auditor.report.model import AgeBar, UtilPoint, ZombieTimeline
from auditor.timefmt import rfc3339_seconds

WIDTH, HEIGHT = 920, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 64, 16, 40
TICKS = 5  # axis intervals: 1, 2 and 5 x 10^k divide into round steps


def esc(text: object) -> str:
    """HTML-escaped, with control characters shown as escapes (``\\x1b``): a crafted request id
    must not recolour the terminal of whoever runs ``cat`` on the page."""
    value = str(text)
    if not value.isprintable():
        value = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)
    return escape(value, quote=True)


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= value (1 for nothing)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)


def _tick(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == 0 else f"{value:.2g}"


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float | None]
    color: str
    kind: str = "line"  # "line" or "bar"
    fixed_max: float | None = None  # e.g. 100 for a percentage
    counts: bool = False  # whole numbers: keep the axis ticks whole too


def time_chart(title: str, starts_ns: Sequence[int], width_ns: int, left: Series, right: Series) -> str:
    """A time-bucketed chart: ``left`` on the left axis, ``right`` on the right one."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    count = max(1, len(starts_ns))
    slot = plot_w / count
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'role="img" aria-label="{esc(title)}"><title>{esc(title)}</title>']
    scales = []
    for series, x_axis, anchor in ((left, LEFT - 6, "end"), (right, WIDTH - RIGHT + 6, "start")):
        present = [v for v in series.values if v is not None]
        top = series.fixed_max or nice_ceiling(max(present, default=0.0))
        if series.counts:
            top = max(top, float(TICKS))  # 1, 2, 5 x 10^k with five intervals: whole ticks from 5 up
        scales.append(top)
        for i in range(TICKS + 1):
            value = top * i / TICKS
            y = TOP + plot_h - plot_h * i / TICKS
            if series is left:
                parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                             'class="grid"/>')
            parts.append(f'<text x="{x_axis}" y="{y + 4:.1f}" text-anchor="{anchor}" '
                         f'fill="{series.color}">{esc(_tick(value))}</text>')
    for series, top in zip((left, right), scales, strict=True):
        parts.append(_draw(series, top, slot, plot_h))
    origin_ns, span_ns = (starts_ns[0] if starts_ns else 0), count * width_ns
    ticks, step_ns = time_ticks(origin_ns, origin_ns + span_ns)
    for tick in ticks:
        x = LEFT + plot_w * (tick - origin_ns) / span_ns
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}" y2="{TOP + plot_h + 4}" '
                     'stroke="#5b6575"/>')
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
                     f'{esc(tick_label(tick, step_ns))}</text>')
    parts.append(f'<text x="{LEFT}" y="{HEIGHT - 6}" class="legend">'
                 f'<tspan fill="{left.color}">■ {esc(left.name)}</tspan>'
                 f'<tspan dx="24" fill="{right.color}">■ {esc(right.name)}</tspan>'
                 f'<tspan dx="24">UTC; one {esc(_width_label(width_ns))} per '
                 f'{"bar" if "bar" in (left.kind, right.kind) else "point"}</tspan></text>')
    parts.append("</svg>")
    return "".join(parts)


# Steps between time-axis labels: round clock intervals, so labels fall on 10:15, 10:30, ...
LABEL_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
                 86400, 172800, 604800)
MAX_LABELS = 8
_NS = 1_000_000_000


def time_ticks(start_ns: int, end_ns: int, max_labels: int = MAX_LABELS) -> tuple[list[int], int]:
    """Label times for an axis from ``start_ns`` to ``end_ns``, and the step between them.

    The step is the smallest round interval (1/2/5/10/15/30 s or min, 1/2/3/6/12 h, days) that
    gives at most ``max_labels`` labels, and labels sit on multiples of it in UTC (10:15, 10:30,
    not 10:03:27, 10:18:27), whatever second the window starts at.
    """
    span_ns = max(1, end_ns - start_ns)
    step_s = next((step for step in LABEL_STEPS_S if span_ns <= step * _NS * max_labels), None)
    if step_s is None:  # longer than eight weeks: whole weeks
        week = LABEL_STEPS_S[-1]
        step_s = -(-span_ns // (week * _NS * max_labels)) * week
    step_ns = step_s * _NS
    first = -(-start_ns // step_ns) * step_ns
    return list(range(first, end_ns + 1, step_ns)), step_ns


def tick_label(tick_ns: int, step_ns: int) -> str:
    """``MM-DD`` for day steps, ``HH:MM`` for minute steps, ``HH:MM:SS`` below a minute (UTC)."""
    text = rfc3339_seconds(tick_ns)
    if step_ns >= 86400 * _NS:
        return text[5:10]
    return text[11:16] if step_ns >= 60 * _NS else text[11:19]


def _draw(series: Series, top: float, slot: float, plot_h: float) -> str:
    def y_of(value: float) -> float:
        return TOP + plot_h - plot_h * min(value, top) / top

    if series.kind == "bar":
        bars = []
        for index, value in enumerate(series.values):
            if value:
                y = y_of(value)
                bars.append(f'<rect x="{LEFT + slot * index + slot * 0.1:.1f}" y="{y:.1f}" '
                            f'width="{max(slot * 0.8, 1):.1f}" height="{TOP + plot_h - y:.1f}" '
                            f'fill="{series.color}"><title>{esc(_tick(value))}</title></rect>')
        return "".join(bars)
    runs: list[list[str]] = [[]]
    for index, value in enumerate(series.values):
        if value is None:  # a gap in the data is a gap in the line, not a drop to zero
            runs.append([])
            continue
        runs[-1].append(f"{LEFT + slot * (index + 0.5):.1f},{y_of(value):.1f}")
    # A point with gaps on both sides is no line: drawn as a dot, or it would not show at all.
    return "".join(f'<polyline fill="none" stroke="{series.color}" stroke-width="2" points="{" ".join(run)}"/>'
                   if len(run) > 1 else
                   f'<circle cx="{run[0].split(",")[0]}" cy="{run[0].split(",")[1]}" r="2.5" fill="{series.color}"/>'
                   for run in runs if run)


def _width_label(width_ns: int) -> str:
    seconds = width_ns / 1e9
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


ROW_H, LABEL_W = 56, 250


def age_chart(bars: Sequence[AgeBar], width_s: float, marks: Sequence[float]) -> str:
    """Disconnects by their request's age (seconds from its start to its client's leaving), the
    zombies among them drawn over them, and a dashed line at each timeout in ``marks``."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    count = max(1, len(bars))
    slot, span_s = plot_w / count, count * width_s
    origin = bars[0].start_s if bars else 0.0  # the first bar is centred on 0: it starts below
    title = "disconnects by how long after its start each request's client left"
    top = max(nice_ceiling(max((b.disconnects for b in bars), default=0)), float(TICKS))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'role="img" aria-label="{esc(title)}"><title>{esc(title)}</title>']
    for i in range(TICKS + 1):
        y = TOP + plot_h - plot_h * i / TICKS
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(_tick(top * i / TICKS))}</text>')
    for index, bar in enumerate(bars):
        x = LEFT + slot * index + slot * 0.1
        for value, css, what in ((bar.disconnects, "serving", "disconnects"), (bar.zombies, "zombie", "zombies")):
            if value:
                height = plot_h * min(value, top) / top
                parts.append(f'<rect x="{x:.1f}" y="{TOP + plot_h - height:.1f}" width="{max(slot * 0.8, 1):.1f}" '
                             f'height="{height:.1f}" class="{css}"><title>{esc(f"{value:,} {what}, ")}'
                             f'{esc(f"{max(bar.start_s, 0):g}-{bar.start_s + width_s:g} s")}</title></rect>')
    step = nice_ceiling(span_s / 8)
    tick = 0.0
    while tick <= origin + span_s + 1e-9:
        x = LEFT + plot_w * (tick - origin) / span_s
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}" y2="{TOP + plot_h + 4}" stroke="#5b6575"/>'
                     f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{esc(f"{tick:g} s")}</text>')
        tick = round(tick + step, 9)
    for mark in marks:
        if origin <= mark <= origin + span_s:
            x = LEFT + plot_w * (mark - origin) / span_s
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" class="cut"/>'
                         f'<text x="{x + 4:.1f}" y="{TOP + 12}" class="small">{esc(f"{mark:g} s")}</text>')
    parts.append(f'<text x="{LEFT}" y="{HEIGHT - 6}" class="legend"><tspan class="serving-t">■ disconnects'
                 '</tspan><tspan dx="16" class="zombie-t">■ zombies among them</tspan><tspan dx="16">'
                 f'{esc(f"seconds from the request start to the client leaving; one bar per {width_s:g} s")}'
                 '</tspan></text></svg>')
    return "".join(parts)


def zombie_timelines(timelines: Sequence[ZombieTimeline]) -> str:
    """One row per zombie: serving (start to disconnect), zombie (disconnect to end of work), and
    the host's GPU utilization over the same time drawn under the bars. Each row has its own scale."""
    height = ROW_H * len(timelines) + 28
    plot_w = WIDTH - LABEL_W - 16
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" role="img" '
             'aria-label="timeline of the worst zombies"><title>timeline of the worst zombies</title>']
    for row, timeline in enumerate(timelines):
        finding = timeline.finding
        top = row * ROW_H + 4
        start, end = finding.request_start_ns, max(timeline.end_ns, finding.request_start_ns + 1)

        def x_of(ns: int, start: int = start, end: int = end) -> float:
            return LABEL_W + plot_w * (min(max(ns, start), end) - start) / (end - start)

        label = finding.request_id or finding.trace_id or "(no id)"
        parts.append(f'<text x="4" y="{top + 16}" class="mono">{esc(_clip(label, 30))}'
                     f'<title>{esc(label)}</title></text>')
        parts.append(f'<text x="4" y="{top + 32}">{esc(f"{finding.lag_seconds or 0:,.1f} s zombie")}'
                     f', {esc(finding.phase)}</text>')
        parts.append(_util_area(timeline.utilization, x_of, top + 40, 36, end))
        disconnect = x_of(finding.disconnect_at_ns)
        parts.append(f'<rect x="{LABEL_W}" y="{top + 8}" width="{max(disconnect - LABEL_W, 1):.1f}" '
                     'height="14" class="serving"><title>serving: request start to disconnect</title></rect>')
        parts.append(f'<rect x="{disconnect:.1f}" y="{top + 8}" '
                     f'width="{max(LABEL_W + plot_w - disconnect, 1):.1f}" height="14" class="zombie">'
                     '<title>zombie: work going on after the client left</title></rect>')
        parts.append(f'<line x1="{disconnect:.1f}" x2="{disconnect:.1f}" y1="{top + 2}" '
                     f'y2="{top + 44}" class="cut"/>')
        end_label = "work end" if finding.work_end_ns is not None else "still running"
        parts.append(f'<text x="{LABEL_W + plot_w}" y="{top + 50}" text-anchor="end" class="small">'
                     f'{esc(end_label)} +{(end - start) / 1e9:,.1f} s</text>')
        parts.append(f'<text x="{LABEL_W}" y="{top + 50}" class="small">'
                     f'{esc(rfc3339_seconds(start))}</text>')
    parts.append(f'<text x="{LABEL_W}" y="{height - 6}" class="legend"><tspan class="serving-t">■ '
                 'serving</tspan><tspan dx="16" class="zombie-t">■ zombie</tspan><tspan dx="16" '
                 'class="util-t">■ GPU utilization (0-100%)</tspan></text></svg>')
    return "".join(parts)


def _util_area(points: Sequence[UtilPoint], x_of: Callable[[int], float], bottom: float,
               height: float, end_ns: int) -> str:
    if not points:
        return ""
    # Each point is the mean over the slice it starts; the last one holds until the end of work.
    steps = [*points, UtilPoint(ts_ns=end_ns, util_percent=points[-1].util_percent)]
    coords = [f"{x_of(p.ts_ns):.1f},{bottom - height * max(0.0, min(p.util_percent, 100.0)) / 100:.1f}"
              for p in steps]
    first, last = x_of(points[0].ts_ns), x_of(end_ns)
    return (f'<polygon class="util" points="{first:.1f},{bottom} {" ".join(coords)} {last:.1f},{bottom}">'
            f'<title>GPU utilization under this request</title></polygon>')


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
