"""Prometheus metrics under vLLM's names, so dashboards, autoscalers and
inference gateways built for vLLM read kvserve unchanged, plus kvserve's own:
admission, cancellation and SLO-attainment counters (by priority class and
tenant), the context lengths of running and waiting sequences sampled every
step (the distribution behind the KV occupancy), the memory split, prefix-cache
evictions, KV allocation failures and tokens recomputed after preemption.

Every metric carries the `model_name` label. Counters are exported by
prometheus_client with a `_total` suffix (`vllm:prompt_tokens_total`), as
vLLM's are. Each server owns its CollectorRegistry, so two apps in one
process (tests) never share counts. Latencies come from the request's raw
timestamps through `kvserve.latency.derive_latency`, the one definition.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)
from prometheus_client.core import HistogramMetricFamily

from kvserve.admission.decision import Outcome, Reason
from kvserve.contract import RequestTimestamps
from kvserve.latency import derive_latency

# Seconds. Fine at the bottom for loopback TTFT/ITL, long at the top for
# requests that queue or generate thousands of tokens.
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                   0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Actual minus predicted queue wait: both signs, finer near 0.
PREDICTION_ERROR_BUCKETS_S = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1,
                              0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


STEP_KINDS = ("decode", "prefill", "mixed")
# vLLM's buckets for tokens per engine step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MEMORY_KINDS = ("weights", "kv_cache", "workspace")
CANCELLATION_REASONS = ("disconnect", "stalled")
# Priority label values are clamped to this range: the body's priority is
# any integer, and one series per value would be unbounded.
PRIORITY_LABEL_RANGE = (-10, 10)
# The scheduler totals that become counter increments: (SchedulerStats field,
# metric name, help).
STAT_COUNTERS = (
    ("num_preemptions", "vllm:num_preemptions", "Preemptions (by recompute)."),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    ("num_evicted_blocks", "kvserve_prefix_cache_evicted_blocks",
     "Cached KV blocks evicted from the prefix cache to make room (their prefix is gone)."),
    ("num_allocation_failures", "kvserve_kv_allocation_failures",
     "KV block allocations the pool could not satisfy: a preemption followed, or a waiting request was "
     "held back (the cache is full)."),
    ("num_recomputed_tokens", "kvserve_recomputed_tokens",
     "Computed tokens whose KV a preemption dropped: recomputed when the request resumes (less any "
     "prefix-cache hit)."),
)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def priority_label(priority: int) -> str:
    low, high = PRIORITY_LABEL_RANGE
    return str(min(high, max(low, priority)))


class SampledHistogram:
    """A Prometheus histogram fed many values at once (every running
    sequence's context length, every step): one lock and a bisect per value
    instead of prometheus_client's per-observation locking, since it runs on
    the event loop beside the HTTP work. Exported as a cumulative histogram."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self._counts
        with self._lock:
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1
                self._sum += value

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric([self.model_name], buckets, total)
        yield family


class ServerMetrics:
    """Records finished requests, scheduler samples and front-door decisions."""

    def __init__(self, model_name: str, ttft_slo_s: float, tpot_slo_s: float, max_model_len: int = 8192,
                 max_loras: int | None = None) -> None:
        """max_loras: the LoRA slots when adapters are served (None: no
        vllm:lora_requests_info)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.max_loras = max_loras
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.max_model_len = max_model_len
        self._last_totals = {field: 0 for field, _, _ in STAT_COUNTERS}
        self._histograms()
        self._length_histograms()
        self._counters()
        self._gauges()

    def _hist(self, name: str, doc: str, buckets) -> object:
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str, labels=()) -> Counter:
        return Counter(name, doc, ["model_name", *labels], registry=self.registry)

    def _histograms(self) -> None:
        self.ttft = self._hist("vllm:time_to_first_token_seconds",
                               "Time to first token, from arrival at the server (s).", LATENCY_BUCKETS_S)
        self.itl = self._hist("vllm:inter_token_latency_seconds",
                              "Gap between consecutive output tokens (s).", TOKEN_BUCKETS_S)
        self.tpot = self._hist("vllm:request_time_per_output_token_seconds",
                               "Per request: decode time / (output tokens - 1) (s).", TOKEN_BUCKETS_S)
        self.e2e = self._hist("vllm:e2e_request_latency_seconds",
                              "Arrival to finish (s).", LATENCY_BUCKETS_S)
        self.queue = self._hist("vllm:request_queue_time_seconds",
                                "Arrival to first scheduled (s).", LATENCY_BUCKETS_S)
        self.prefill = self._hist("vllm:request_prefill_time_seconds",
                                  "First scheduled to first token (s).", LATENCY_BUCKETS_S)
        self.decode = self._hist("vllm:request_decode_time_seconds",
                                 "First token to last token (s).", LATENCY_BUCKETS_S)
        self.queue_predicted = self._hist("kvserve_queue_wait_predicted_seconds",
                                          "Per admitted request: the queue wait admission predicted when it "
                                          "admitted it (s); the outcome is vllm:request_queue_time_seconds.",
                                          LATENCY_BUCKETS_S)
        self.queue_error = self._hist("kvserve_queue_wait_prediction_error_seconds",
                                      "Per admitted request: actual queue wait (admitted -> first scheduled) "
                                      "minus the predicted one (s); positive = waited longer than promised.",
                                      PREDICTION_ERROR_BUCKETS_S)
        self.step = Histogram("kvserve_engine_step_seconds",
                              "Engine step (schedule, forward pass, sampling, update) by kind: decode (decodes "
                              "only), prefill (prefill chunks only) or mixed (s).",
                              ["model_name", "kind"], buckets=TOKEN_BUCKETS_S, registry=self.registry)
        for kind in STEP_KINDS:  # exported at 0 from the start
            self.step.labels(model_name=self.model_name, kind=kind)

    def _length_histograms(self) -> None:
        token_buckets = build_1_2_5_buckets(self.max_model_len)
        self.request_prompt_tokens = self._hist("vllm:request_prompt_tokens",
                                                "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = self._hist("vllm:request_generation_tokens",
                                                    "Generated tokens per finished request.", token_buckets)
        self.iteration_tokens = self._hist("vllm:iteration_tokens_total",
                                           "Tokens per engine step (decodes + prefill).", ITERATION_TOKEN_BUCKETS)
        context_buckets = tuple(sorted({*token_buckets, self.max_model_len}))
        self.running_contexts = SampledHistogram(
            "kvserve_running_context_tokens",
            "Context length (prompt + output so far, tokens) of each running sequence, sampled after every "
            "engine step: the distribution behind the KV occupancy.", self.model_name, context_buckets)
        self.waiting_contexts = SampledHistogram(
            "kvserve_waiting_context_tokens",
            "Context length (tokens) of each waiting sequence (new or preempted), sampled after every "
            "engine step.", self.model_name, context_buckets)
        self.registry.register(self.running_contexts)
        self.registry.register(self.waiting_contexts)

    def _counters(self) -> None:
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens.")
        self.success = self._counter("vllm:request_success", "Finished requests by finish reason.",
                                     ["finished_reason"])
        self.stat_counters = {field: self._counter(name, doc) for field, name, doc in STAT_COUNTERS}
        self.admission = self._counter("kvserve_admission_decisions",
                                       "Front-door decisions by outcome (" + "|".join(Outcome) + ") and reason.",
                                       ["outcome", "reason"])
        self.cancellations = self._counter("kvserve_cancellations",
                                           "Requests aborted by the client side (disconnect, stalled reader).",
                                           ["reason"])
        for reason in CANCELLATION_REASONS:  # at 0 from the start: rate() works from the first abort
            self.cancellations.labels(model_name=self.model_name, reason=reason)
        self.slo = self._counter("kvserve_slo_requests",
                                 "Every admitted request that ended, by target (ttft|tpot|both) and result: "
                                 "met, missed, cancelled (the client left), aborted (the server ended it "
                                 "early: queue timeout, deadline, shutdown, engine error); by priority "
                                 f"class (clamped to {PRIORITY_LABEL_RANGE}) and tenant.",
                                 ["slo", "result", "priority", "tenant"])
        # Speculative decoding, as vLLM counts it: a draft is one request's
        # drafts verified in one step.
        self.spec_drafts = self._counter("vllm:spec_decode_num_drafts",
                                         "Speculative drafts verified (one request's drafts in one step).")
        self.spec_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens",
                                                  "Draft tokens accepted.")
        self.spec_accepted_per_pos = self._counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                                   "Draft tokens accepted at each position of a draft (0-based).",
                                                   ["position"])
        # Export unlabelled-by-event counters at 0 from the start, as vLLM does.
        for counter in (self.prompt_tokens, self.generation_tokens, *self.stat_counters.values()):
            counter.labels(model_name=self.model_name)

    def _gauges(self) -> None:
        def gauge(name: str, doc: str) -> object:
            return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0..1).")
        self.running_cap = gauge("kvserve_running_cap",
                                 "Running-batch cap derived from measured step time and the TPOT target.")
        self.weight_bytes = Gauge("kvserve_model_weight_bytes",
                                  "Model weight bytes resident in memory, by storage format (float32, bfloat16, "
                                  "q8_0, q4_0, q4_1): quantized weights count at their block size.",
                                  ["model_name", "format"], registry=self.registry)
        self.step_token_budget = gauge("kvserve_step_token_budget",
                                       "Tokens one engine step may batch (decodes + prefill), derived from "
                                       "measured step time and the TPOT target.")
        self.sleeping = gauge("kvserve_sleeping",
                              "Sleep level: 0 awake, 1 KV cache freed (weights kept), 2 weights dropped too; "
                              "a sleeping server is not ready.")
        self.startup = Gauge("kvserve_startup_seconds",
                             "Start-to-ready by phase: imports, weight_load, kv_allocation, warm_up (on CUDA "
                             "with the decode graphs captured), wake_up (the latest wake) (s).",
                             ["model_name", "phase"], registry=self.registry)
        self.waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                                       "Waiting requests by reason: capacity (in the scheduler's queue, for KV, "
                                       "the token budget or the running cap) or deferred (outside it: a "
                                       "grammar compiling).", ["model_name", "reason"], registry=self.registry)
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(model_name=self.model_name, reason=reason)
        self.memory = Gauge("kvserve_memory_bytes",
                            "Memory by kind: weights (resident), kv_cache (the preallocated KV tensor), "
                            "workspace (CUDA: peak allocated beyond both; CPU: resident set beyond both).",
                            ["model_name", "kind"], registry=self.registry)
        slo_target = Gauge("kvserve_slo_target_seconds", "The promise: TTFT and TPOT targets (s).",
                           ["model_name", "slo"], registry=self.registry)
        slo_target.labels(model_name=self.model_name, slo="ttft").set(self.ttft_slo_s)
        slo_target.labels(model_name=self.model_name, slo="tpot").set(self.tpot_slo_s)
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the KV cache configuration.",
                                  ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching",
                                   "cache_dtype", "kv_cache_memory_bytes"], registry=self.registry)
        # vLLM's: one series whose labels name the adapters of running and
        # waiting requests (comma-separated), valued at the time it was set.
        self.lora_info = None if self.max_loras is None else Gauge(
            "vllm:lora_requests_info", "Running stats on LoRA requests.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=self.registry)
        self._lora_labels: tuple[str, str] | None = None
        if self.lora_info is not None:
            self.record_adapters([], [])

    # ---- recording ---------------------------------------------------------

    def record_finished(self, timestamps: RequestTimestamps, num_prompt_tokens: int,
                        num_output_tokens: int, finish_reason: str, cancelled: bool = False,
                        priority: int = 0, tenant: str = "default") -> None:
        """One finished (or aborted) request; `cancelled`: aborted because
        the client left. Its SLO result is counted whatever ended it, under
        its priority class and tenant."""
        labels = {"model_name": self.model_name}
        self.prompt_tokens.labels(**labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(**labels).inc(num_output_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        self.success.labels(finished_reason=finish_reason, **labels).inc()
        lat = self._record_latency(timestamps)
        if finish_reason == "abort":
            self.record_slo_result("cancelled" if cancelled else "aborted", priority, tenant)
        elif lat.ttft_s is None:  # ended normally without a token: no first token in time
            self.record_slo_result("missed", priority, tenant)
        else:
            self._record_slo(lat.ttft_s, lat.tpot_s, priority_label(priority), tenant)

    def _record_latency(self, ts: RequestTimestamps):
        lat = derive_latency(ts.arrival, [(t, 1) for t in ts.token_times], ts.finished, ts.scheduled)
        if lat.e2e_s is not None:
            self.e2e.observe(lat.e2e_s)
        if lat.queue_s is not None:
            self.queue.observe(lat.queue_s)
        if lat.ttft_s is None:
            return lat
        self.ttft.observe(lat.ttft_s)
        for gap_s in lat.itl_s:
            self.itl.observe(gap_s)
        if lat.tpot_s is not None:
            self.tpot.observe(lat.tpot_s)
        if ts.scheduled is not None:
            self.prefill.observe(ts.token_times[0] - ts.scheduled)
        self.decode.observe(ts.token_times[-1] - ts.token_times[0])
        return lat

    def record_slo_result(self, result: str, priority: int = 0, tenant: str = "default") -> None:
        """The same result for every target: a request that ended without
        being judged on its latencies (cancelled, aborted)."""
        for slo in ("ttft", "tpot", "both"):
            self.slo.labels(model_name=self.model_name, slo=slo, result=result,
                            priority=priority_label(priority), tenant=tenant).inc()

    def _record_slo(self, ttft_s: float, tpot_s: float | None, priority: str, tenant: str) -> None:
        ttft_ok = ttft_s <= self.ttft_slo_s
        tpot_ok = tpot_s is None or tpot_s <= self.tpot_slo_s  # one token: no decode to judge
        for slo, ok in (("ttft", ttft_ok), ("tpot", tpot_ok), ("both", ttft_ok and tpot_ok)):
            self.slo.labels(model_name=self.model_name, slo=slo, result="met" if ok else "missed",
                            priority=priority, tenant=tenant).inc()

    def record_queue_wait(self, predicted_s: float, actual_s: float) -> None:
        """An admitted request started: its predicted wait beside the actual one."""
        self.queue_predicted.observe(predicted_s)
        self.queue_error.observe(actual_s - predicted_s)

    def record_step(self, num_decode_seqs: int, num_prefill_tokens: int, step_s: float) -> None:
        """One engine step's time, by what it computed. Its spread for one
        kind of step is the machine's step jitter (what `kvserve profile`
        measures for the simulator); steps that did no work are not steps."""
        if num_decode_seqs and num_prefill_tokens:
            kind = "mixed"
        elif num_decode_seqs or num_prefill_tokens:
            kind = "decode" if num_decode_seqs else "prefill"
        else:
            return
        self.step.labels(model_name=self.model_name, kind=kind).observe(step_s)
        self.iteration_tokens.observe(num_decode_seqs + num_prefill_tokens)

    def record_step_report(self, report) -> None:
        """Everything one engine step (engine.async_engine.StepReport) says
        that needs nothing but these metrics: queue waits, the step's time,
        the scheduler's sample, the contexts in flight, draft verifications.
        The server records its finished requests, adapters and limits beside
        it; `kvserve profile`'s serving loop records the same, so its event
        loop does the server's work per step."""
        for wait in report.queue_waits:
            self.record_queue_wait(wait.predicted_s, wait.actual_s)
        self.record_step(report.num_decode_seqs, report.num_prefill_tokens, report.step_s)
        if report.stats is not None:
            self.record_stats(report.stats, report.num_deferred)
        if report.num_decode_seqs or report.num_prefill_tokens:
            self.record_contexts(report.running_context_tokens, report.waiting_context_tokens)
        if report.spec_decode is not None:
            spec = report.spec_decode
            self.record_spec_decode(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                                    spec.accepted_per_pos)

    def record_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                           accepted_per_pos: list[int]) -> None:
        """One step's draft verifications (the first call exports every position at 0)."""
        labels = {"model_name": self.model_name}
        self.spec_drafts.labels(**labels).inc(num_drafts)
        self.spec_draft_tokens.labels(**labels).inc(num_draft_tokens)
        self.spec_accepted_tokens.labels(**labels).inc(num_accepted_tokens)
        for position, count in enumerate(accepted_per_pos):
            self.spec_accepted_per_pos.labels(position=str(position), **labels).inc(count)

    def record_stats(self, stats, num_deferred: int = 0) -> None:
        """A scheduler sample (SchedulerStats); its totals become counter
        increments. `num_deferred`: requests waiting outside the scheduler."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.waiting_by_reason.labels(model_name=self.model_name, reason="capacity").set(stats.num_waiting)
        self.waiting_by_reason.labels(model_name=self.model_name, reason="deferred").set(num_deferred)
        last = self._last_totals
        for field, counter in self.stat_counters.items():
            new = getattr(stats, field)
            if new > last[field]:
                counter.labels(model_name=self.model_name).inc(new - last[field])
            last[field] = new

    def record_contexts(self, running_context_tokens: list[int], waiting_context_tokens: list[int]) -> None:
        """One step's sample of the context lengths in flight."""
        self.running_contexts.observe_many(running_context_tokens)
        self.waiting_contexts.observe_many(waiting_context_tokens)

    def record_cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool,
                            cache_dtype: str, kv_cache_memory_bytes: int) -> None:
        """vllm:cache_config_info: the KV cache's configuration as labels (value 1)."""
        self.cache_config.labels(model_name=self.model_name, block_size=str(block_size),
                                 num_gpu_blocks=str(num_blocks), enable_prefix_caching=str(enable_prefix_caching),
                                 cache_dtype=cache_dtype, kv_cache_memory_bytes=str(kv_cache_memory_bytes)).set(1)

    def record_ready(self, is_ready: Callable[[], bool]) -> None:
        """kvserve_ready: 1 while the server admits (model loaded, not
        draining, engine alive), read at each scrape."""
        ready = Gauge("kvserve_ready", "1 while the server admits requests (loaded, not draining, engine alive).",
                      ["model_name"], registry=self.registry)
        ready.labels(model_name=self.model_name).set_function(lambda: 1.0 if is_ready() else 0.0)

    def record_memory(self, memory_bytes: Callable[[], dict[str, int]]) -> None:
        """kvserve_memory_bytes{kind}, read from `memory_bytes()` at each scrape."""
        for kind in MEMORY_KINDS:
            self.memory.labels(model_name=self.model_name, kind=kind).set_function(
                lambda kind=kind: memory_bytes()[kind])

    def record_startup(self, seconds_by_phase: dict[str, float]) -> None:
        for phase, seconds in seconds_by_phase.items():
            self.startup.labels(model_name=self.model_name, phase=phase).set(seconds)

    def record_adapters(self, running: list[str], waiting: list[str]) -> None:
        """The LoRA adapters (names) of running and waiting requests now."""
        if self.lora_info is None:
            return
        labels = (",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        if labels != self._lora_labels:
            self.lora_info.clear()  # only the current state is exported
            self._lora_labels = labels
        self.lora_info.labels(model_name=self.model_name, max_lora=str(self.max_loras),
                              running_lora_adapters=labels[0], waiting_lora_adapters=labels[1]).set_to_current_time()

    def record_weights(self, bytes_by_format: dict[str, int]) -> None:
        """The resident weight bytes, set once the model is loaded."""
        for weight_format, num_bytes in bytes_by_format.items():
            self.weight_bytes.labels(model_name=self.model_name, format=weight_format).set(num_bytes)

    def record_admission(self, outcome: Outcome | str, reason: Reason | str | None) -> None:
        """One front-door decision; the labels are the wire strings (what
        str() of the enums gives)."""
        self.admission.labels(model_name=self.model_name, outcome=str(outcome),
                              reason="none" if reason is None else str(reason)).inc()

    def record_cancellation(self, reason: str) -> None:
        self.cancellations.labels(model_name=self.model_name, reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
