"""Prometheus metrics under vLLM's names, so dashboards, autoscalers and
inference gateways built for vLLM read kvserve unchanged, plus kvserve's own
admission, cancellation and SLO-attainment counters.

Every metric carries the `model_name` label. Counters are exported by
prometheus_client with a `_total` suffix (`vllm:prompt_tokens_total`), as
vLLM's are. Each server owns its CollectorRegistry, so two apps in one
process (tests) never share counts. Latencies come from the request's raw
timestamps through `kvserve.latency.derive_latency`, the one definition.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)

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


class ServerMetrics:
    """Records finished requests, scheduler samples and front-door decisions."""

    def __init__(self, model_name: str, ttft_slo_s: float, tpot_slo_s: float) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self._last_totals = (0, 0, 0)  # preemptions, prefix queries, prefix hits
        self._histograms()
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

    def _counters(self) -> None:
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens.")
        self.success = self._counter("vllm:request_success", "Finished requests by finish reason.",
                                     ["finished_reason"])
        self.preemptions = self._counter("vllm:num_preemptions", "Preemptions (by recompute).")
        self.prefix_queries = self._counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits",
                                         "Prompt tokens served from the prefix cache.")
        self.admission = self._counter("kvserve_admission_decisions",
                                       "Front-door decisions by outcome (" + "|".join(Outcome) + ") and reason.",
                                       ["outcome", "reason"])
        self.cancellations = self._counter("kvserve_cancellations",
                                           "Requests aborted by the client side (disconnect, stalled reader).",
                                           ["reason"])
        self.slo = self._counter("kvserve_slo_requests",
                                 "Every admitted request that ended, by target (ttft|tpot|both) and result: "
                                 "met, missed, cancelled (the client left), aborted (the server ended it "
                                 "early: queue timeout, deadline, shutdown, engine error).",
                                 ["slo", "result"])
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
        for counter in (self.prompt_tokens, self.generation_tokens, self.preemptions,
                        self.prefix_queries, self.prefix_hits):
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

    # ---- recording ---------------------------------------------------------

    def record_finished(self, timestamps: RequestTimestamps, num_prompt_tokens: int,
                        num_output_tokens: int, finish_reason: str, cancelled: bool = False) -> None:
        """One finished (or aborted) request; `cancelled`: aborted because
        the client left. Its SLO result is counted whatever ended it."""
        labels = {"model_name": self.model_name}
        self.prompt_tokens.labels(**labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(**labels).inc(num_output_tokens)
        self.success.labels(finished_reason=finish_reason, **labels).inc()
        lat = self._record_latency(timestamps)
        if finish_reason == "abort":
            self.record_slo_result("cancelled" if cancelled else "aborted")
        elif lat.ttft_s is None:
            self.record_slo_result("missed")  # ended normally without a token: no first token in time
        else:
            self._record_slo(lat.ttft_s, lat.tpot_s)

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

    def record_slo_result(self, result: str) -> None:
        """The same result for every target: a request that ended without
        being judged on its latencies (cancelled, aborted)."""
        for slo in ("ttft", "tpot", "both"):
            self.slo.labels(model_name=self.model_name, slo=slo, result=result).inc()

    def _record_slo(self, ttft_s: float, tpot_s: float | None) -> None:
        ttft_ok = ttft_s <= self.ttft_slo_s
        tpot_ok = tpot_s is None or tpot_s <= self.tpot_slo_s  # one token: no decode to judge
        for slo, ok in (("ttft", ttft_ok), ("tpot", tpot_ok), ("both", ttft_ok and tpot_ok)):
            self.slo.labels(model_name=self.model_name, slo=slo, result="met" if ok else "missed").inc()

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

    def record_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                           accepted_per_pos: list[int]) -> None:
        """One step's draft verifications (the first call exports every position at 0)."""
        labels = {"model_name": self.model_name}
        self.spec_drafts.labels(**labels).inc(num_drafts)
        self.spec_draft_tokens.labels(**labels).inc(num_draft_tokens)
        self.spec_accepted_tokens.labels(**labels).inc(num_accepted_tokens)
        for position, count in enumerate(accepted_per_pos):
            self.spec_accepted_per_pos.labels(position=str(position), **labels).inc(count)

    def record_stats(self, num_running: int, num_waiting: int, kv_usage: float, num_preemptions: int,
                     prefix_cache_queries: int, prefix_cache_hits: int) -> None:
        """A scheduler sample; the totals become counter increments."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        totals = (num_preemptions, prefix_cache_queries, prefix_cache_hits)
        for counter, new, old in zip((self.preemptions, self.prefix_queries, self.prefix_hits),
                                     totals, self._last_totals):
            if new > old:
                counter.labels(model_name=self.model_name).inc(new - old)
        self._last_totals = totals

    def record_startup(self, seconds_by_phase: dict[str, float]) -> None:
        for phase, seconds in seconds_by_phase.items():
            self.startup.labels(model_name=self.model_name, phase=phase).set(seconds)

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
