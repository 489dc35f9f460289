"""report.html: the summary tables and inline SVG plots, no plotting library.

Plots: latency CDFs (TTFT, TPOT, ITL, E2E), TTFT and TPOT of each request over
its send time, and the server's KV usage, running and waiting requests over
time (when /metrics was scraped).
"""

from __future__ import annotations

import html
import math

WIDTH, HEIGHT = 460, 260
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 58, 12, 28, 40
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")

Series = dict[str, list[tuple[float, float]]]


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= step * m)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def svg_chart(series: Series, title: str, x_label: str, y_label: str,
              markers: bool = False) -> str:
    """A line (or scatter, markers=True) chart of named (x, y) series."""
    points = [p for values in series.values() for p in values]
    if not points:
        return f'<p class="empty">{html.escape(title)}: no data</p>'
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(0.0, min(p[1] for p in points)), max(p[1] for p in points)
    x_hi, y_hi = (x_hi if x_hi > x_lo else x_lo + 1), (y_hi if y_hi > y_lo else y_lo + 1)
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def sx(x: float) -> float:
        return MARGIN_LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return MARGIN_TOP + plot_h - (y - y_lo) / (y_hi - y_lo) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-weight="bold">'
             f'{html.escape(title)}</text>',
             f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_w}" height="{plot_h}" '
             'fill="none" stroke="#999"/>']
    parts += _axis_ticks(x_lo, x_hi, y_lo, y_hi, sx, sy)
    parts.append(f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{HEIGHT - 6}" text-anchor="middle">'
                 f'{html.escape(x_label)}</text>')
    parts.append(f'<text x="12" y="{MARGIN_TOP + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {MARGIN_TOP + plot_h / 2})">{html.escape(y_label)}</text>')
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        parts.append(_draw(values, sx, sy, color, markers))
        parts.append(f'<text x="{MARGIN_LEFT + 8}" y="{MARGIN_TOP + 14 + 13 * i}" fill="{color}">'
                     f'{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _axis_ticks(x_lo, x_hi, y_lo, y_hi, sx, sy) -> list[str]:
    out = []
    for x in _ticks(x_lo, x_hi):
        out.append(f'<text x="{sx(x):.1f}" y="{HEIGHT - MARGIN_BOTTOM + 14}" '
                   f'text-anchor="middle">{x:g}</text>')
    for y in _ticks(y_lo, y_hi):
        out.append(f'<text x="{MARGIN_LEFT - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
        out.append(f'<line x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" y1="{sy(y):.1f}" '
                   f'y2="{sy(y):.1f}" stroke="#eee"/>')
    return out


def _draw(values, sx, sy, color: str, markers: bool) -> str:
    if markers:
        return "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}"/>'
                       for x, y in values)
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>'


def cdf_points(values: list[float]) -> list[tuple[float, float]]:
    """(value, fraction <= value) for sorted values."""
    data = sorted(values)
    return [(v, (i + 1) / len(data)) for i, v in enumerate(data)]


def _charts(report: dict) -> list[str]:
    requests = [r for r in report["requests"] if r["outcome"] == "success"]
    charts = []
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
        values = [r[key] * 1000 for r in requests if r[key] is not None]
        charts.append(svg_chart({name: cdf_points(values)}, f"{name} CDF", "ms", "fraction"))
    charts.append(svg_chart(
        {"TTFT (ms)": [(r["sent_s"], r["ttft_s"] * 1000) for r in requests if r["ttft_s"]],
         "TPOT (ms)": [(r["sent_s"], r["tpot_s"] * 1000) for r in requests if r["tpot_s"]]},
        "TTFT and TPOT by send time", "send time (s)", "ms", markers=True))
    series = report.get("server_metrics", {}).get("series", {})
    if "kv_cache_usage_perc" in series:
        charts.append(svg_chart({"KV usage": [tuple(p) for p in series["kv_cache_usage_perc"]]},
                                "server KV cache usage", "time (s)", "fraction"))
    queue = {k: [tuple(p) for p in series[k]] for k in
             ("num_requests_running", "num_requests_waiting") if k in series}
    if queue:
        charts.append(svg_chart(queue, "server requests running / waiting", "time (s)", "requests"))
    return charts


def _summary_table(report: dict) -> str:
    s = report["summary"]
    rows = ["<tr><th>metric</th><th>mean</th><th>p50</th><th>p90</th><th>p95</th><th>p99</th></tr>"]
    for name in ("ttft", "tpot", "itl", "e2e", "queue_time"):
        cells = "".join(f"<td>{_ms(s[name][k])}</td>" for k in ("mean", "p50", "p90", "p95", "p99"))
        rows.append(f"<tr><td>{name} (ms)</td>{cells}</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _sample_note(report: dict) -> str:
    """A long simulation keeps every k-th request's row: say so above the plots."""
    every = report.get("config", {}).get("simulation", {}).get("requests_sampled_every", 1)
    if every <= 1:
        return ""
    return (f"<p>Per-request plots: 1 request in {every} ({len(report['requests'])} of "
            f"{report['summary']['num_requests']}); the tables cover all of them.</p>")


def render_html(report: dict, table_text: str) -> str:
    """A self-contained HTML page for the report dict, with `table_text` (the
    console table, report.format_table) under its summary."""
    charts = "\n".join(f'<div class="chart">{c}</div>' for c in _charts(report))
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in report.get("client", {}).get("warnings", []))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvserve bench report</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
.chart{{display:inline-block;margin:6px}} pre{{background:#f6f6f6;padding:8px}}</style></head>
<body><h1>kvserve bench report</h1>
{_summary_table(report)}
<pre>{html.escape(table_text)}</pre>
{f"<h2>warnings</h2><ul>{warnings}</ul>" if warnings else ""}
<h2>plots</h2>
{_sample_note(report)}
{charts}
</body></html>
"""
