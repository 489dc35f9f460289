"""From raw per-request records to the promise: latencies, outcomes, goodput.

Both `kvserve bench` (real HTTP) and `kvserve simulate` (virtual clock) produce
`RequestRecord`s and call `build_report`, so their report.json files share one
schema (docs/bench.md). Latencies come from `kvserve.latency`, the definition
the server's metrics use too.

Definitions used here:
- A request's clock starts when the client first sent it (`sent_s`), so the
  wait behind a 429 and its retries counts: that is what the user felt.
- Latency percentiles are over successful requests; ITL pools every gap of
  every successful request.
- good request: success, TTFT <= slo.ttft_s and TPOT <= slo.tpot_s (a
  one-token answer has no TPOT and passes it), and E2E <= slo.e2e_s if set.
- goodput: good requests per second of run. slo_attainment: good requests /
  requests the client did not cancel itself.
- slo.passed: the `slo.percentile`-th percentile TTFT and TPOT are inside the
  targets AND at least that share of non-cancelled requests succeeded (a
  server cannot pass by rejecting the hard cases).
"""

from __future__ import annotations

import copy
import json
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvserve.gc_pause import cyclic_gc_paused
from kvserve.latency import PERCENTILES, derive_latency, itl_runs, percentile, summarize, summarize_runs

OUTCOMES = ("success", "cancelled", "rejected", "timed_out", "error")


@dataclass(frozen=True)
class RequestRecord:
    """Raw timestamps of one request, seconds from run start.

    token_events: (time, tokens delivered) per streamed chunk, in time order.
    sent_s is the first attempt's send; last_sent_s the final attempt's.
    queue_s: server-side queue time when the producer knows it (simulator).
    """

    index: int
    outcome: str
    scheduled_s: float | None
    sent_s: float | None
    headers_s: float | None = None
    token_events: tuple[tuple[float, int], ...] = ()
    end_s: float | None = None
    status_code: int | None = None
    reject_reason: str | None = None
    tenant: str = "default"
    priority: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    retries: int = 0
    last_sent_s: float | None = None
    queue_s: float | None = None
    error: str | None = None
    feature: str = "plain"  # bench.workload.REQUEST_FEATURES
    # The versions the server said shaped the answer: its x-kvserve-* version
    # headers and the system_fingerprint, as (name, value) pairs.
    versions: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")


@dataclass(frozen=True)
class SLO:
    """A latency promise judged at a percentile (seconds)."""

    ttft_s: float
    tpot_s: float
    percentile: float = 99.0
    e2e_s: float | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or (self.e2e_s is not None and self.e2e_s <= 0):
            raise ValueError("SLO targets must be > 0 seconds")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"SLO percentile must be in (0, 100], got {self.percentile}")


SLO_PRESETS = {
    "mlperf-server": SLO(2.0, 0.1, 99.0, name="mlperf-server"),
    "mlperf-interactive": SLO(0.5, 0.03, 99.0, name="mlperf-interactive"),
}


def parse_slo(text: str) -> SLO:
    """A preset name or 'ttft=2,tpot=0.1[,e2e=30][,p=99]' (seconds)."""
    if text in SLO_PRESETS:
        return SLO_PRESETS[text]
    from kvserve.bench.workload import parse_kv

    usage = f"bad SLO {text!r}: use {sorted(SLO_PRESETS)} or 'ttft=S,tpot=S[,e2e=S][,p=99]'"
    try:
        values = parse_kv(text)
    except ValueError:
        raise ValueError(usage) from None
    if set(values) - {"ttft", "tpot", "e2e", "p"} or not {"ttft", "tpot"} <= set(values):
        raise ValueError(usage)
    return SLO(values["ttft"], values["tpot"], values.get("p", 99.0), values.get("e2e"))


@dataclass(frozen=True)
class MetricsSample:
    """One scrape of the server's /metrics, `t_s` from run start.

    gauges: summed over label sets (kv_cache_usage_perc, num_requests_running,
    num_requests_waiting, num_preemptions). queue_buckets: cumulative
    (upper bound s, count) of vllm:request_queue_time_seconds. counters: every
    vllm:* and kvserve_* counter sample, keyed 'name{labels}'.
    """

    t_s: float
    gauges: dict[str, float] = field(default_factory=dict)
    queue_buckets: tuple[tuple[float, float], ...] = ()
    queue_sum_s: float | None = None
    queue_count: float | None = None
    counters: dict[str, float] = field(default_factory=dict)


# --- per-request derivation --------------------------------------------------

def record_latency(record: RequestRecord):
    """A record's latencies without the per-token ITL list (summaries pool
    `itl_runs`); None if it was never sent."""
    if record.sent_s is None:
        return None
    return derive_latency(record.sent_s, record.token_events, record.end_s, None, with_itl=False)


_latency = record_latency


def is_good(record: RequestRecord, latency, slo: SLO | None) -> bool:
    """Succeeded inside the SLO (`latency`: record_latency(record))."""
    if record.outcome != "success" or latency is None or slo is None:
        return False
    return (latency.ttft_s is not None and latency.ttft_s <= slo.ttft_s
            and (latency.tpot_s is None or latency.tpot_s <= slo.tpot_s)
            and (slo.e2e_s is None or (latency.e2e_s or 0.0) <= slo.e2e_s))


def summarize_records(records: Sequence[RequestRecord], duration_s: float,
                      slo: SLO | None, price_per_hour: float | None = None,
                      latencies: Sequence | None = None) -> dict:
    """The summary block for a set of records (a whole run or one class).
    latencies: each record's `_latency`, when the caller has them already."""
    summary, cost_inputs = _summary_without_cost(records, duration_s, slo, latencies)
    summary.update(_cost(price_per_hour, *cost_inputs))
    return summary


def _summary_without_cost(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None,
                          latencies: Sequence | None) -> tuple[dict, tuple]:
    """summarize_records but the cost fields, and what `_cost` needs besides
    the price: (duration_s, successes, good requests, output tokens)."""
    latencies = [_latency(r) for r in records] if latencies is None else latencies
    ok = [(r, lat) for r, lat in zip(records, latencies) if r.outcome == "success" and lat]
    counts = Counter(r.outcome for r in records)  # one pass, not one per outcome
    outcomes = {name: counts[name] for name in OUTCOMES}
    reasons: dict[str, int] = {}
    for r in records:
        if r.outcome == "rejected":
            key = r.reject_reason or f"http_{r.status_code}"
            reasons[key] = reasons.get(key, 0) + 1
    num_good = sum(is_good(r, lat, slo) for r, lat in zip(records, latencies))
    judged = len(records) - outcomes["cancelled"]
    output_tokens = sum(r.output_tokens for r, _ in ok)
    duration_s = max(duration_s, 1e-9)
    summary = {
        "num_requests": len(records),
        "duration_s": duration_s,
        "ttft": summarize(lat.ttft_s for _, lat in ok),
        "tpot": summarize(lat.tpot_s for _, lat in ok),
        "itl": summarize_runs(run for r, _ in ok for run in itl_runs(r.token_events)),
        "e2e": summarize(lat.e2e_s for _, lat in ok),
        "queue_time": summarize(r.queue_s for r in records),
        "output_length": summarize(r.output_tokens for r, _ in ok),
        "prompt_length": summarize(r.prompt_tokens for r in records),
        "outcomes": {**outcomes, "rejected_reasons": reasons},
        "retries": sum(r.retries for r in records),
        "request_throughput": outcomes["success"] / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "input_token_throughput": sum(r.prompt_tokens for r, _ in ok) / duration_s,
        "goodput": num_good / duration_s if slo else None,
        "num_good": num_good if slo else None,
        "slo_attainment": (num_good / judged if judged else None) if slo else None,
    }
    summary["slo_passed"] = _slo_passed(ok, outcomes, judged, slo)
    return summary, (duration_s, outcomes["success"], num_good, output_tokens)


def _slo_passed(ok: list, outcomes: dict, judged: int, slo: SLO | None) -> bool | None:
    if slo is None or judged == 0:
        return None
    if not ok or outcomes["success"] / judged < slo.percentile / 100.0:
        return False
    checks = [("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s), ("e2e_s", slo.e2e_s)]
    for attr, target in checks:
        if target is None:
            continue
        data = [v for _, lat in ok if (v := getattr(lat, attr)) is not None]
        if data and percentile(np.sort(np.array(data)), slo.percentile) > target:
            return False
    return True


def _cost(price_per_hour: float | None, duration_s: float, num_success: int, num_good: int,
          output_tokens: int) -> dict:
    if price_per_hour is None:
        return {"cost_total": None, "cost_per_successful_request": None,
                "cost_per_good_request": None, "cost_per_million_output_tokens": None}
    total = price_per_hour * duration_s / 3600.0
    return {
        "cost_total": total,
        "cost_per_successful_request": total / num_success if num_success else None,
        "cost_per_good_request": total / num_good if num_good else None,
        "cost_per_million_output_tokens": total / output_tokens * 1e6 if output_tokens else None,
    }


# --- server metrics ----------------------------------------------------------

SERIES_GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
                 "num_preemptions")


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Approximate q-quantile (0..1) from cumulative (upper bound, count) buckets.

    Like Prometheus' histogram_quantile: linear inside the bucket holding the
    rank, lower edge 0 for the first bucket; a rank in the +Inf bucket returns
    the highest finite bound. Accuracy is one bucket width.
    """
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            width = count - lower_count
            frac = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (bound - lower_bound) * frac
        lower_bound, lower_count = bound, count
    return lower_bound


def queue_time_from_server(samples: Sequence[MetricsSample]) -> dict | None:
    """Queue-time stats of this run from the server's histogram (last - first
    scrape, so requests from before the run are excluded); None if absent."""
    with_hist = [s for s in samples if s.queue_count is not None and s.queue_buckets]
    if len(with_hist) < 1:
        return None
    first, last = with_hist[0], with_hist[-1]
    if len(with_hist) == 1:
        first = MetricsSample(0.0, queue_buckets=tuple((b, 0.0) for b, _ in last.queue_buckets),
                              queue_sum_s=0.0, queue_count=0.0)
    count = last.queue_count - first.queue_count
    if count <= 0:
        return None
    before = dict(first.queue_buckets)
    delta = [(bound, n - before.get(bound, 0.0)) for bound, n in last.queue_buckets]
    mean = (last.queue_sum_s - first.queue_sum_s) / count
    out = {"count": int(count), "mean": mean}
    for q in PERCENTILES:
        # Queue times are >= 0, so by Markov's inequality the q-quantile is at
        # most mean / (1 - q): this tightens coarse buckets (all-zero waits
        # read 0, not half the first bucket).
        out[f"p{q}"] = min(histogram_quantile(delta, q / 100.0), max(mean, 0.0) / (1 - q / 100.0))
    return out


def server_metrics_block(samples: Sequence[MetricsSample]) -> dict:
    """Time series of the server's gauges and the run's counter deltas."""
    series = {name: [[s.t_s, s.gauges[name]] for s in samples if name in s.gauges]
              for name in SERIES_GAUGES}
    counters: dict[str, float] = {}
    if samples:
        first, last = samples[0].counters, samples[-1].counters
        counters = {k: v - first.get(k, 0.0) for k, v in last.items()}
    return {
        "num_samples": len(samples),
        "series": {k: v for k, v in series.items() if v},
        "queue_time": queue_time_from_server(samples),
        "counters_delta": counters,
        "spec_decode": spec_decode_block(counters),
    }


SPEC_DECODE_COUNTERS = {"num_drafts": "vllm:spec_decode_num_drafts",
                        "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                        "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_block(counters_delta: dict[str, float]) -> dict | None:
    """The server's speculative decoding over the run, from vLLM's
    spec_decode counters (None when the server reports none): acceptance
    rate (accepted / draft tokens), mean accepted length (tokens a verifying
    request gains per step: 1 + accepted / drafts) and acceptance by position."""
    def total(name: str) -> float:
        return sum(v for k, v in counters_delta.items() if k.split("{")[0] in (name, name + "_total"))

    block = {key: total(name) for key, name in SPEC_DECODE_COUNTERS.items()}
    if not any(k.split("{")[0].startswith("vllm:spec_decode") for k in counters_delta):
        return None
    drafts = block["num_drafts"]
    per_pos: dict[int, float] = {}
    for key, value in counters_delta.items():
        if key.split("{")[0] in (_PER_POS, _PER_POS + "_total") and 'position="' in key:
            position = int(key.split('position="')[1].split('"')[0])
            per_pos[position] = per_pos.get(position, 0.0) + value
    block["acceptance_rate"] = block["num_accepted_tokens"] / block["num_draft_tokens"] \
        if block["num_draft_tokens"] else None
    block["mean_accepted_length"] = 1 + block["num_accepted_tokens"] / drafts if drafts else None
    block["acceptance_by_position"] = [per_pos[p] / drafts if drafts else None for p in sorted(per_pos)]
    return block


# --- the report --------------------------------------------------------------

def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """From run start (0) to the last request's end."""
    ends = [r.end_s for r in records if r.end_s is not None]
    return max(ends) if ends else 0.0


def build_report(records: Sequence[RequestRecord], slo: SLO | None = None,
                 duration_s: float | None = None, price_per_hour: float | None = None,
                 metrics_samples: Sequence[MetricsSample] = (), config: dict | None = None,
                 client_stats: dict | None = None, rows_every: int = 1) -> dict:
    """The report.json dict (schema: docs/bench.md). The "requests" list
    holds every `rows_every`-th record's row (a long simulation keeps a
    sample for the plots; 0: none); the summaries cover every record."""
    # Paused: each collection the report triggered walked every live object
    # of the caller too (after a simulated hour, millions): ~40% of its time.
    with cyclic_gc_paused():
        return _build_report(records, slo, duration_s, price_per_hour, metrics_samples, config, client_stats,
                             rows_every)


def _build_report(records, slo, duration_s, price_per_hour, metrics_samples, config, client_stats,
                  rows_every) -> dict:
    duration_s = run_duration_s(records) if duration_s is None else duration_s
    # Derived once per record: the summary, each class and the per-request
    # list all read them (hundreds of thousands for an hour of simulation).
    latencies = [_latency(r) for r in records]
    # The run's summary without cost is also the summary of a class that
    # holds every request (one tenant, one priority: the usual case), so
    # it is computed once (an hour of simulation has 180k records).
    whole, cost_inputs = _summary_without_cost(records, duration_s, slo, latencies)
    summary = copy.deepcopy(whole)
    summary.update(_cost(price_per_hour, *cost_inputs))
    whole.update(_cost(None, *cost_inputs))
    server = server_metrics_block(metrics_samples)
    summary["queue_time"]["source"] = "records" if summary["queue_time"]["count"] else None
    if not summary["queue_time"]["count"] and server["queue_time"]:
        summary["queue_time"] = {**server["queue_time"], "source": "server_histogram"}
    return {
        "schema_version": 1,
        "config": config or {},
        "slo": asdict(slo) if slo else None,
        "summary": summary,
        "by_tenant": _by(records, latencies, "tenant", duration_s, slo, whole),
        "by_priority": _by(records, latencies, "priority", duration_s, slo, whole),
        "by_feature": _by(records, latencies, "feature", duration_s, slo, whole),
        "server_metrics": server,
        "client": client_stats or {},
        "requests": [_record_dict(r, lat) for r, lat in
                     zip(records[::rows_every], latencies[::rows_every])] if rows_every else [],
    }


def _by(records, latencies, field_name: str, duration_s, slo, whole: dict) -> dict:
    """Summaries per value of the records' `field_name` (keyed as strings);
    `whole` is summarize_records of all records without a price (copied
    when one class holds them all: the usual case, found without grouping)."""
    keys = list(map(operator.attrgetter(field_name), records))
    if len(set(keys)) == 1:
        return {str(keys[0]): copy.deepcopy(whole)}
    groups: dict[str, tuple[list, list]] = {}
    for key, r, lat in zip(keys, records, latencies):
        group = groups.setdefault(str(key), ([], []))
        group[0].append(r)
        group[1].append(lat)
    # Cost is not split per class: the hardware is shared.
    return {k: summarize_records(rs, duration_s, slo, None, lats) for k, (rs, lats) in sorted(groups.items())}


def _record_dict(record: RequestRecord, lat) -> dict:
    # Fields are scalars, strings and token_events (rebuilt below), so a
    # shallow copy of the instance dict equals asdict()'s deep copy at a
    # fraction of its cost.
    out = dict(vars(record))  # the fields, in declaration order
    out["token_events"] = [list(e) for e in record.token_events]
    out["versions"] = dict(record.versions)
    out["ttft_s"] = lat.ttft_s if lat else None
    out["tpot_s"] = lat.tpot_s if lat else None
    out["e2e_s"] = lat.e2e_s if lat else None
    return out


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json and report.html under out_dir; returns their paths."""
    from kvserve.bench.plots import render_html

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "html": out / "report.html"}
    paths["json"].write_text(report_json(report))
    paths["html"].write_text(render_html(report, format_table(report)))
    return paths


def report_json(report: dict) -> str:
    """report.json's text: the summary blocks indented for reading, then one
    compact line per request. Indenting forces json's pure-Python encoder,
    which on tens of thousands of requests with a timestamp per token took
    longer than the simulation itself (70 s for 15k requests, 160 MB); each
    request line goes through the C encoder instead. json.loads of the text
    equals the report."""
    head = {k: v for k, v in report.items() if k != "requests"}
    text = json.dumps(head, indent=1, allow_nan=False)
    if "requests" not in report:
        return text
    compact = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
    rows = ",\n  ".join(map(compact, report["requests"]))
    body = f"[\n  {rows}\n ]" if rows else "[]"
    return f'{text[:-2]},\n "requests": {body}\n}}' if head else f'{{\n "requests": {body}\n}}'


# --- console -----------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_table(report: dict) -> str:
    """A plain-text summary for the console."""
    s = report["summary"]
    lines = [f"{'metric (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e", "queue_time"):
        row = s[name]
        lines.append(f"{name:<14}" + "".join(f"{_ms(row[k]):>10}" for k in
                                               ("mean", "p50", "p90", "p95", "p99")))
    o = s["outcomes"]
    lines.append("outcomes: " + ", ".join(f"{k}={o[k]}" for k in OUTCOMES)
                 + (f"  rejected by reason: {o['rejected_reasons']}" if o["rejected_reasons"] else ""))
    lines.append(f"throughput: {s['request_throughput']:.2f} req/s, "
                 f"{s['output_token_throughput']:.1f} output tok/s over {s['duration_s']:.1f} s")
    if report.get("slo"):
        slo = report["slo"]
        lines.append(f"SLO {slo['name']} (TTFT<={slo['ttft_s']}s, TPOT<={slo['tpot_s']}s at "
                     f"p{slo['percentile']:g}): goodput {s['goodput']:.2f} req/s, attainment "
                     f"{_pct(s['slo_attainment'])}, passed={s['slo_passed']}")
    if s.get("cost_total") is not None:
        lines.append(f"cost: {_num(s['cost_total'])} total, {_num(s['cost_per_successful_request'])}"
                     f" per successful request, {_num(s['cost_per_good_request'])} per good "
                     f"request, {_num(s['cost_per_million_output_tokens'])} per 1M output tokens")
    spec = report.get("server_metrics", {}).get("spec_decode")
    if spec is not None:
        lines.append(_spec_decode_line(spec, s["tpot"]))
    lines += _capacity_lines(report)
    lines += _failure_lines(report.get("failure_scenarios"))
    server = report.get("server_metrics", {}).get("series", {})
    for name, points in server.items():
        values = [v for _, v in points]
        lines.append(f"server {name}: mean {sum(values) / len(values):.3g}, max {max(values):.3g}")
    return "\n".join(lines)


def _spec_decode_line(spec: dict, tpot: dict) -> str:
    """The server's acceptance beside the client's TPOT: what speculation bought."""
    by_position = ", ".join(_pct(v) for v in spec["acceptance_by_position"])
    return (f"server speculative decoding: {spec['num_drafts']:.0f} drafts, acceptance "
            f"{_pct(spec['acceptance_rate'])}, {_num(spec['mean_accepted_length'])} tokens per verifying step, "
            f"by position [{by_position}]; client TPOT p50 {_ms(tpot['p50'])} ms, p99 {_ms(tpot['p99'])} ms")


def _capacity_lines(report: dict) -> list[str]:
    """Resources, tasks, per-unit cost and energy, startup (bench/capacity.py), where present."""
    lines = []
    res, tasks, unit, startup = (report.get(k) for k in ("resources", "tasks", "per_unit", "startup"))
    if res and (res.get("server_cpu_utilization") is not None or res.get("energy_j") is not None):
        lines.append(f"server process: CPU {_num(res['server_cpu_utilization'])} cores busy on average, "
                     f"GPU {_pct(res['gpu_utilization'])}; energy {_num(res['energy_j'])} J "
                     f"({res['energy_source'] or 'not measured'})")
    if tasks:
        lines.append(f"tasks of {tasks['task_size']}: {tasks['successful_tasks']}/{tasks['num_tasks']} successful"
                     + (f", {tasks['good_tasks']} inside the SLO" if tasks["good_tasks"] is not None else ""))
    if unit and any(v is not None for v in unit.values()):
        lines.append(f"per successful request: cost {_num(unit['cost_per_successful_request'])}, energy "
                     f"{_num(unit['energy_per_successful_request_j'])} J; per successful task: cost "
                     f"{_num(unit['cost_per_successful_task'])}, energy {_num(unit['energy_per_successful_task_j'])} J")
    if startup:
        first = ", ".join("-" if t is None else f"{t:.3f}" for t in startup["first_requests_ttft_s"])
        ready = startup["time_to_ready_s"]
        lines.append(f"startup: {'ready after ' + format(ready, '.1f') + ' s; ' if ready is not None else ''}"
                     f"first requests' TTFT {first} s, later p50 {_num(startup['later_ttft']['p50'])} s")
    return lines


def _failure_lines(section: dict | None) -> list[str]:
    """`kvserve simulate`'s failure scenarios beside the same workload without them."""
    if not section:
        return []
    base, fail, cost = section["baseline"], section["with_failures"], section["cost"]
    lines = [f"failure scenarios: {'; '.join(section['scenarios'])}",
             f"{'':<22}{'baseline':>12}{'with failures':>15}"]
    for label, key, fmt in (("goodput (req/s)", "goodput", _num), ("good requests", "num_good", _num),
                            ("SLO attainment", "slo_attainment", _pct), ("refused", "refused", _num),
                            ("timed out", "timed_out", _num), ("lost (stream broken)", "lost", _num),
                            ("rerouted", "rerouted", _num)):
        lines.append(f"{label:<22}{fmt(base[key]):>12}{fmt(fail[key]):>15}")
    lines.append(f"routed per replica: baseline {base['routed_by_replica']}, with failures "
                 f"{fail['routed_by_replica']}")
    lines.append(f"cost: {_num(cost['goodput_lost'])} req/s of goodput ({_pct(cost['goodput_lost_share'])}), "
                 f"{cost['good_requests_lost']} good requests, {_pct(cost['slo_attainment_lost'])} of SLO attainment")
    for phase in section["phases"]:
        b, f = phase["baseline"], phase["with_failures"]
        lines.append(f"  sent {phase['from_s']:.1f}-{phase['to_s']:.1f} s: goodput {_num(b['goodput'])} -> "
                     f"{_num(f['goodput'])} req/s, SLO attainment {_pct(b['slo_attainment'])} -> "
                     f"{_pct(f['slo_attainment'])}")
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"
