"""The shipped operations files (deploy/observability/): every metric name
the Grafana dashboard and the Prometheus alert rules query exists on a live
server's /metrics, and every row of docs/operations.md's failure taxonomy has
a rule (and every rule a row)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server_helpers import MODEL_NAME, live_server, tiny_core

ROOT = Path(__file__).resolve().parent.parent
OBSERVABILITY = ROOT / "deploy" / "observability"
# Series Prometheus makes itself, not the server.
PROMETHEUS_OWN = {"up"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                "unless", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not
    functions, keywords, label names, durations or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in PROMQL_WORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return names


def test_promql_names_are_read_as_prometheus_reads_them():
    expr = ('sum by (model_name, le) (rate(vllm:request_queue_time_seconds_bucket{model_name=~"$m",x="a b"}[5m] '
            'offset 1d)) / ignoring (reason) group_left histogram_quantile(0.9, up) > 1 and kvserve_ready == 0')
    assert promql_metric_names(expr) == {"vllm:request_queue_time_seconds_bucket", "up", "kvserve_ready"}


def _rules() -> list[dict]:
    groups = yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _grafana_exprs() -> list[str]:
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [v["query"].replace("label_values(", "").split(",")[0]
              for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_queried_metric_exists_on_a_live_server():
    with live_server(tiny_core()) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        # Traffic, so that labelled series (admission outcomes, SLO verdicts) exist.
        assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2, 3],
                                                  "max_tokens": 3}).status_code == 200
        text = http.get("/metrics").text
    exported = {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    queries = {"alerts.yml": [rule["expr"] for rule in _rules()], "grafana-dashboard.json": _grafana_exprs()}
    for source, exprs in queries.items():
        names = set().union(*(promql_metric_names(e) for e in exprs))
        assert len(names) > 10, (source, names)
        missing = names - exported - PROMETHEUS_OWN
        assert not missing, f"{source} queries metrics /metrics does not export: {sorted(missing)}"


def test_each_taxonomy_row_has_a_rule_with_its_signal_and_action():
    doc = (ROOT / "docs" / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", doc, re.MULTILINE))
    assert len(rows) >= 7, rows
    rules = _rules()
    assert {rule["labels"]["taxonomy"] for rule in rules} == rows
    for rule in rules:
        assert rule["alert"] in doc, rule["alert"]
        assert rule["annotations"]["signal"] and rule["annotations"]["action"], rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical")


def test_promtool_accepts_the_rules_where_installed():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (the PromQL names are checked by test_every_queried_metric_...)")
    result = subprocess.run([promtool, "check", "rules", str(OBSERVABILITY / "alerts.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
