"""The one dashboard: a self-contained HTML page (no CDN, no external script)
that polls a Prometheus endpoint and draws, in the browser, KV occupancy over
time beside the context-length distribution in flight, queue wait and the
admission outcomes, TTFT/TPOT against the SLO, the running cap and step
budget, the memory split, and preemptions, evictions and allocation failures.

It reads only metric names that `/metrics` exports (kvserve/metrics.py), so
the same page works against any server that exports them; `kvserve gateway`
serves it per backend (`/dashboard/<i>`, drawn from that backend's
`/metrics` fetched through the gateway) under an index of its backends
(`fleet_index_page`). The served numbers carry `data-stat` / `data-value` attributes so a headless
browser can check them against `/metrics`.
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib import resources

_CONFIG_START, _CONFIG_END = "/*CONFIG*/", "/*END*/"


@cache
def _template() -> str:
    return resources.files("kvserve").joinpath("dashboard.html").read_text(encoding="utf-8")


def dashboard_page(metrics_url: str = "/metrics", period_s: float = 2.0, history: int = 150) -> str:
    """The page, polling `metrics_url` every `period_s` seconds and keeping
    the last `history` scrapes for its time series."""
    if period_s <= 0 or history < 2:
        raise ValueError("period_s must be > 0 and history >= 2")
    page = _template()
    start = page.index(_CONFIG_START) + len(_CONFIG_START)
    end = page.index(_CONFIG_END)
    config = json.dumps({"metrics_url": metrics_url, "period_s": period_s, "history": history})
    # Inside <script>: a "</" in a URL must not end the element.
    return page[:start] + config.replace("</", "<\\/") + page[end:]


def fleet_index_page(backends: list[tuple[str, bool]]) -> str:
    """The gateway's /dashboard: its backends (name, ready), each linking to
    its dashboard at /dashboard/<index>."""
    rows = "".join(f'<li><a href="/dashboard/{i}">{html.escape(name)}</a> {"ready" if ready else "not ready"}</li>'
                   for i, (name, ready) in enumerate(backends))
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>kvserve gateway: dashboards</title>"
            "</head><body><h1>kvserve gateway: one dashboard per backend</h1>"
            f"<ul>{rows or '<li>no backends</li>'}</ul></body></html>")
