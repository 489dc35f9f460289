"""GET /dashboard in a real headless browser (Debian's chromium, which
`make install` installs): the page renders, fetches /metrics itself, and the
numbers it shows are the ones /metrics has; through `kvserve gateway`, one
such page per backend, drawn from that backend's /metrics."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest

from kvserve.dashboard import dashboard_page
from tests.fleet_helpers import gateway, start_all
from tests.load_helpers import metric, scrape
from tests.server_helpers import MODEL_NAME, live_server, tiny_core

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless chromium on PATH (make install installs Debian's chromium-headless-shell "
                "as root with apt-get; it could not here)")


class _Stats(HTMLParser):
    """data-stat elements' data-value, the admission table's rows and <body>'s scrape count."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, str] = {}
        self.admission: dict[tuple[str, str], float] = {}
        self.scrapes = 0
        self._row: tuple[str, str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-stat" in a and "data-value" in a:
            self.stats[a["data-stat"]] = a["data-value"]
        if tag == "body":
            self.scrapes = int(a.get("data-scrapes", 0))
        if tag == "tr" and "data-outcome" in a:
            self._row = (a["data-outcome"], a["data-reason"])
        if tag == "td" and self._row is not None and "data-value" in a:
            self.admission[self._row] = float(a["data-value"])
            self._row = None


def _rendered(url: str) -> _Stats:
    """The DOM after the page's scripts ran (virtual time lets its fetches finish)."""
    result = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--virtual-time-budget=4000", "--dump-dom", url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    parsed = _Stats()
    parsed.feed(result.stdout)
    return parsed


def test_the_dashboard_renders_and_its_numbers_match_metrics():
    core = tiny_core(num_blocks=16, max_model_len=512)
    with live_server(core, ttft_slo_s=1.5, tpot_slo_s=0.25) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as http:
        for i in range(4):
            assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": list(range(1 + i, 30 + i)),
                                                      "max_tokens": 5}).status_code == 200
        never = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2], "max_tokens": 400})
        assert never.status_code == 400
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<script src" not in page.text and "http" not in page.text.split("<script>")[1]  # no CDN
        assert http.get("/dashboard", params={"period_s": "abc"}).status_code == 400
        page = _rendered(srv.base_url + "/dashboard?period_s=0.5")
        s = scrape(srv.base_url)

    assert page.scrapes >= 1, "the page never fetched /metrics"
    stats = {k: float(v) for k, v in page.stats.items() if v not in ("", "?")}
    for stat, name, labels in [
            ("kv_usage", "vllm:kv_cache_usage_perc", {}), ("running", "vllm:num_requests_running", {}),
            ("waiting", "vllm:num_requests_waiting", {}), ("running_cap", "kvserve_running_cap", {}),
            ("step_token_budget", "kvserve_step_token_budget", {}),
            ("preemptions", "vllm:num_preemptions_total", {}),
            ("requests_finished", "vllm:request_success_total", {}),
            ("slo_total", "kvserve_slo_requests_total", {"slo": "both"}),
            ("memory_weights", "kvserve_memory_bytes", {"kind": "weights"}),
            ("memory_kv_cache", "kvserve_memory_bytes", {"kind": "kv_cache"}),
            ("evicted_blocks", "kvserve_prefix_cache_evicted_blocks_total", {}),
            ("allocation_failures", "kvserve_kv_allocation_failures_total", {})]:
        assert stats[stat] == metric(s, name, **labels), stat
    assert stats["requests_finished"] == 4
    assert stats["ttft_slo_s"] == 1.5 and stats["tpot_slo_s"] == 0.25
    assert stats["num_blocks"] == 16 and stats["block_size"] == 16
    ttft_mean = metric(s, "vllm:time_to_first_token_seconds_sum") / metric(s, "vllm:time_to_first_token_seconds_count")
    assert stats["ttft_mean_s"] == pytest.approx(ttft_mean, rel=1e-9)
    assert stats["running_context_total"] == metric(s, "kvserve_running_context_tokens_count") == 4 * 4
    assert stats["running_context_total_mean"] == pytest.approx(
        metric(s, "kvserve_running_context_tokens_sum") / metric(s, "kvserve_running_context_tokens_count"))
    assert stats["running_context_count"] == 0  # nothing ran since the page's previous scrape
    assert page.admission[("admit", "none")] == 4
    assert page.admission[("reject", "never_fits")] == 1


def test_the_gateway_draws_each_backends_dashboard_from_its_metrics(tmp_path):
    with live_server(tiny_core(num_blocks=16, max_model_len=512)) as backend:
        (gw,) = start_all(gateway([backend.base_url], "--state-dir", str(tmp_path / "state")))
        try:
            with httpx.Client(base_url=gw.url, timeout=30) as http:
                for i in range(3):
                    assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": f"hello {i}",
                                                              "max_tokens": 3}).status_code == 200
                index = http.get("/dashboard")
                assert index.status_code == 200 and 'href="/dashboard/0"' in index.text
                assert backend.base_url in index.text and "/dashboard/1" not in index.text
                page = http.get("/dashboard/0")
                assert page.status_code == 200 and '"metrics_url": "/dashboard/0/metrics"' in page.text
                missing = http.get("/dashboard/1/metrics")
                assert missing.status_code == 404 and missing.json()["error"]["code"] == "backend_not_found"
                assert http.get("/dashboard/1").status_code == 404
                assert http.get("/dashboard/0", params={"period_s": "0"}).status_code == 400
                through = http.get("/dashboard/0/metrics")
                assert through.status_code == 200 and "vllm:request_success_total" in through.text
            rendered = _rendered(gw.url + "/dashboard/0?period_s=0.5")
            direct = scrape(backend.base_url)
        finally:
            gw.stop()
    assert rendered.scrapes >= 1, "the page never fetched its backend's metrics"
    assert float(rendered.stats["requests_finished"]) == metric(direct, "vllm:request_success_total") == 3
    assert float(rendered.stats["num_blocks"]) == 16


def test_the_page_is_configured_without_breaking_its_script():
    page = dashboard_page("/gateway/metrics</script>", period_s=5)
    assert '"metrics_url": "/gateway/metrics<\\/script>"' in page and '"period_s": 5' in page
    with pytest.raises(ValueError):
        dashboard_page(period_s=0)
