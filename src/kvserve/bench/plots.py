"""report.html: the summary tables and inline SVG plots, no plotting library.

Above the plots: what the run was (workload, arrivals, rate, SLO, server and
versions) and the per-tenant and per-priority breakdowns. Plots: latency CDFs
(TTFT, TPOT, E2E) with the SLO targets drawn, TTFT and TPOT of each request
over its send time against the targets, outcomes by reason over time, the
joint distribution of prompt and output lengths sent, and the server's KV
usage, running and waiting requests over time (when /metrics was scraped).
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
              markers: bool = False, x_lines: dict[str, float] | None = None,
              y_lines: dict[str, float] | None = None) -> str:
    """A line (or scatter, markers=True) chart of named (x, y) series, with
    dashed reference lines at x = value (x_lines) or y = value (y_lines)."""
    points = [p for values in series.values() for p in values]
    if not points:
        return f'<p class="empty">{html.escape(title)}: no data</p>'
    x_lines, y_lines = x_lines or {}, y_lines or {}
    xs = [p[0] for p in points] + list(x_lines.values())
    ys = [p[1] for p in points] + list(y_lines.values())
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(0.0, min(ys)), max(ys)
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
    parts += _reference_lines(x_lines, y_lines, sx, sy, plot_w, plot_h)
    parts.append("</svg>")
    return "\n".join(parts)


def _reference_lines(x_lines: dict[str, float], y_lines: dict[str, float], sx, sy, plot_w: float,
                     plot_h: float) -> list[str]:
    out = []
    for name, x in x_lines.items():
        out.append(f'<line class="target" x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{MARGIN_TOP}" '
                   f'y2="{MARGIN_TOP + plot_h}" stroke="#555" stroke-dasharray="4 3"/>'
                   f'<text x="{sx(x) + 3:.1f}" y="{MARGIN_TOP + plot_h - 4}" fill="#555">{html.escape(name)}</text>')
    for name, y in y_lines.items():
        out.append(f'<line class="target" x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT + plot_w}" y1="{sy(y):.1f}" '
                   f'y2="{sy(y):.1f}" stroke="#555" stroke-dasharray="4 3"/>'
                   f'<text x="{MARGIN_LEFT + plot_w - 4}" y="{sy(y) - 3:.1f}" text-anchor="end" '
                   f'fill="#555">{html.escape(name)}</text>')
    return out


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


def _targets_ms(report: dict) -> dict[str, float]:
    slo = report.get("slo") or {}
    out = {name: slo[key] * 1000 for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))
           if slo.get(key) is not None}
    return out


def _charts(report: dict) -> list[str]:
    requests = [r for r in report["requests"] if r["outcome"] == "success"]
    targets = _targets_ms(report)
    charts = []
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
        values = [r[key] * 1000 for r in requests if r[key] is not None]
        lines = {f"{name} target": targets[name]} if name in targets else None
        charts.append(svg_chart({name: cdf_points(values)}, f"{name} CDF", "ms", "fraction", x_lines=lines))
    charts.append(svg_chart(
        {"TTFT (ms)": [(r["sent_s"], r["ttft_s"] * 1000) for r in requests if r["ttft_s"]],
         "TPOT (ms)": [(r["sent_s"], r["tpot_s"] * 1000) for r in requests if r["tpot_s"]]},
        "TTFT and TPOT by send time", "send time (s)", "ms", markers=True,
        y_lines={f"{n} target": v for n, v in targets.items() if n in ("TTFT", "TPOT")}))
    charts.append(svg_chart(_outcomes_over_time(report["requests"]), "outcomes by reason over time",
                            "send time (s)", "requests per bin"))
    charts.append(svg_chart({"sent": [(r["prompt_tokens"], r["expected_output_tokens"]) for r in report["requests"]]},
                            "prompt and output lengths sent", "prompt tokens", "max output tokens", markers=True))
    series = report.get("server_metrics", {}).get("series", {})
    if "kv_cache_usage_perc" in series:
        charts.append(svg_chart({"KV usage": [tuple(p) for p in series["kv_cache_usage_perc"]]},
                                "server KV cache usage", "time (s)", "fraction"))
    queue = {k: [tuple(p) for p in series[k]] for k in
             ("num_requests_running", "num_requests_waiting") if k in series}
    if queue:
        charts.append(svg_chart(queue, "server requests running / waiting", "time (s)", "requests"))
    return charts


def _outcomes_over_time(requests: list[dict], num_bins: int = 20) -> Series:
    """Requests per send-time bin, one series per outcome (refusals by reason)."""
    sent = [r for r in requests if r.get("sent_s") is not None]
    if not sent:
        return {}
    t_lo, t_hi = min(r["sent_s"] for r in sent), max(r["sent_s"] for r in sent)
    width = max((t_hi - t_lo) / num_bins, 1e-9)
    counts: dict[str, list[int]] = {}
    for r in sent:
        label = r["outcome"] if r["outcome"] != "rejected" else f"rejected: {r.get('reject_reason') or r.get('status_code')}"
        bins = counts.setdefault(label, [0] * num_bins)
        bins[min(num_bins - 1, int((r["sent_s"] - t_lo) / width))] += 1
    return {label: [(t_lo + (i + 0.5) * width, float(n)) for i, n in enumerate(bins)]
            for label, bins in sorted(counts.items())}


RUN_FIELDS = (("workload", "workload"), ("arrival", "arrival"), ("rate", "rate (req/s)"),
              ("num_requests", "requests"), ("duration", "duration (s)"), ("concurrency", "concurrency"),
              ("tenants", "tenants"), ("priorities", "priorities"), ("endpoint", "endpoint"),
              ("base_url", "server"), ("model", "model"), ("server_versions", "server versions"),
              ("spawn_arg", "spawned with"), ("preset", "model preset"), ("hardware", "hardware"),
              ("replicas", "replicas"))


def _run_table(report: dict) -> str:
    """What the run was: the flags that shape the load, the SLO, the server."""
    config = report.get("config") or {}
    rows = []
    for key, label in RUN_FIELDS:
        value = config.get(key)
        if value in (None, [], {}, ""):
            continue
        rows.append(f"<tr><th>{html.escape(label)}</th><td>{html.escape(_plain(value))}</td></tr>")
    slo = report.get("slo")
    if slo:
        rows.append(f"<tr><th>SLO</th><td>{html.escape(slo['name'])}: TTFT &lt;= {slo['ttft_s']} s, TPOT &lt;= "
                    f"{slo['tpot_s']} s at p{slo['percentile']:g}</td></tr>")
    sim = config.get("simulation")
    if sim:
        rows.append(f"<tr><th>simulated</th><td>{html.escape(_plain(sim.get('cost_model', {}).get('kind')))} cost "
                    f"model, {sim.get('num_blocks')} KV blocks per replica</td></tr>")
    return '<table class="run">' + "".join(rows) + "</table>"


def _plain(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_plain(v)}" for k, v in value.items() if v is not None)
    if isinstance(value, (list, tuple)):
        return " ".join(_plain(v) for v in value)
    return str(value)


def _class_table(title: str, classes: dict) -> str:
    """Per-tenant or per-priority breakdown."""
    if not classes:
        return ""
    rows = [f"<tr><th>{html.escape(title)}</th><th>requests</th><th>success</th><th>rejected</th>"
            "<th>goodput (req/s)</th><th>attainment</th><th>TTFT p99 (ms)</th><th>TPOT p99 (ms)</th></tr>"]
    for name, s in classes.items():
        o = s["outcomes"]
        rows.append(f"<tr><td>{html.escape(str(name))}</td><td>{s['num_requests']}</td><td>{o['success']}</td>"
                    f"<td>{o['rejected']}</td><td>{_num(s.get('goodput'))}</td>"
                    f"<td>{_pct(s.get('slo_attainment'))}</td><td>{_ms(s['ttft']['p99'])}</td>"
                    f"<td>{_ms(s['tpot']['p99'])}</td></tr>")
    return f'<table class="by-{html.escape(title)}">' + "".join(rows) + "</table>"


def _failure_table(section: dict | None) -> str:
    """`kvserve simulate`'s failure scenarios: the run with them beside the
    same workload without, overall and per stretch of send times."""
    if not section:
        return ""
    base, fail = section["baseline"], section["with_failures"]
    rows = ["<tr><th></th><th>baseline</th><th>with failures</th></tr>"]
    for label, key, fmt in (("goodput (req/s)", "goodput", _num), ("good requests", "num_good", _plain),
                            ("SLO attainment", "slo_attainment", _pct), ("refused", "refused", _plain),
                            ("timed out", "timed_out", _plain), ("lost (stream broken)", "lost", _plain),
                            ("rerouted", "rerouted", _plain), ("routed per replica", "routed_by_replica", _plain)):
        rows.append(f"<tr><td>{label}</td><td>{fmt(base[key])}</td><td>{fmt(fail[key])}</td></tr>")
    phases = ["<tr><th>sent (s)</th><th>goodput baseline</th><th>goodput with failures</th>"
              "<th>attainment baseline</th><th>attainment with failures</th></tr>"]
    for p in section["phases"]:
        b, f = p["baseline"], p["with_failures"]
        phases.append(f"<tr><td>{p['from_s']:.1f}-{p['to_s']:.1f}</td><td>{_num(b['goodput'])}</td>"
                      f"<td>{_num(f['goodput'])}</td><td>{_pct(b['slo_attainment'])}</td>"
                      f"<td>{_pct(f['slo_attainment'])}</td></tr>")
    scenarios = html.escape("; ".join(section["scenarios"]))
    return (f"<h2>failure scenarios</h2><p>{scenarios}</p>"
            f'<table class="failures">{"".join(rows)}</table><table class="failure-phases">{"".join(phases)}</table>')


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _pct(value) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


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
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} table.run td{{text-align:left}}
table{{margin:4px 0}}
.chart{{display:inline-block;margin:6px}} pre{{background:#f6f6f6;padding:8px}}</style></head>
<body><h1>kvserve bench report</h1>
<h2>the run</h2>
{_run_table(report)}
<h2>summary</h2>
{_summary_table(report)}
<pre>{html.escape(table_text)}</pre>
{f"<h2>warnings</h2><ul>{warnings}</ul>" if warnings else ""}
{_failure_table(report.get("failure_scenarios"))}
<h2>by tenant and priority</h2>
{_class_table("tenant", report.get("by_tenant") or {})}
{_class_table("priority", report.get("by_priority") or {})}
<h2>plots</h2>
{_sample_note(report)}
{charts}
</body></html>
"""
