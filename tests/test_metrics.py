"""/metrics after a known workload: vLLM's names, counts that match what was
sent, and kvserve's admission / SLO counters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from kvserve.contract import RequestTimestamps
from kvserve.metrics import ServerMetrics
from tests.load_helpers import metric, scrape
from tests.server_helpers import KV_BYTES_PER_TOKEN, MODEL_NAME, live_server, slow_steps, tiny_core

VLLM_NAMES = [
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total",
]


def test_counters_and_histograms_match_a_known_workload():
    core = tiny_core(num_blocks=16, max_model_len=512)  # 256 token slots
    with live_server(core) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        prompt = list(range(1, 11))  # 10 tokens
        for i in range(5):
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6,
                                                   "stream": i % 2 == 0})
            assert r.status_code == 200
        never = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 400})
        assert never.status_code == 400 and never.json()["error"]["code"] == "never_fits"
        shared = list(range(50, 90))  # 40 tokens: two full blocks can be reused
        for _ in range(2):
            assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": shared,
                                                      "max_tokens": 2}).status_code == 200
        s = scrape(srv.base_url)

    for name in VLLM_NAMES:
        assert any(k.startswith(name + "{") and 'model_name="tiny"' in k for k in s), name
    assert metric(s, "vllm:prompt_tokens_total") == 5 * 10 + 2 * 40
    assert metric(s, "vllm:generation_tokens_total") == 5 * 6 + 2 * 2
    assert metric(s, "vllm:request_success_total", finished_reason="length") == 7
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert metric(s, f"vllm:{name}_count") == 7, name
    assert metric(s, "vllm:inter_token_latency_seconds_count") == 5 * 5 + 2 * 1
    assert metric(s, "kvserve_admission_decisions_total", outcome="admit") == 7
    assert metric(s, "kvserve_admission_decisions_total", outcome="reject", reason="never_fits") == 1
    assert metric(s, "kvserve_slo_requests_total", slo="both") == 7
    assert metric(s, "kvserve_slo_requests_total", slo="ttft", result="met") == 7  # loopback, tiny model
    assert metric(s, "vllm:prefix_cache_hits_total") >= 32  # the second shared prompt reused 2 blocks
    assert metric(s, "vllm:prefix_cache_queries_total") >= metric(s, "vllm:prefix_cache_hits_total")
    assert metric(s, "vllm:num_requests_running") == 0
    assert metric(s, "vllm:kv_cache_usage_perc") == 0
    # One request at a time: a prefill step each, then a step per further token.
    assert metric(s, "kvserve_engine_step_seconds_count", kind="prefill") == 7
    assert metric(s, "kvserve_engine_step_seconds_count", kind="decode") == 5 * 5 + 2 * 1
    assert metric(s, "kvserve_engine_step_seconds_count", kind="mixed") == 0
    assert metric(s, "kvserve_engine_step_seconds_sum", kind="decode") > 0


def test_histogram_buckets_and_slo_counters_from_timestamps():
    metrics = ServerMetrics("m", ttft_slo_s=0.5, tpot_slo_s=0.05)
    fast = RequestTimestamps(arrival=10.0, queued=10.0, scheduled=10.01, first_token=10.05,
                             token_times=[10.05, 10.07, 10.09], finished=10.09)
    slow = RequestTimestamps(arrival=20.0, queued=20.0, scheduled=20.9, first_token=21.0,
                             token_times=[21.0, 21.2], finished=21.2)
    metrics.record_finished(fast, 4, 3, "length")
    metrics.record_finished(slow, 4, 2, "stop")
    text = metrics.render().decode()

    def value(line_prefix: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_prefix))

    assert value('vllm:time_to_first_token_seconds_bucket{le="0.06",model_name="m"}') == 1  # 0.05 s
    assert value('vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"}') == 2  # and 1.0 s
    assert value('vllm:inter_token_latency_seconds_count{model_name="m"}') == 3
    assert value('vllm:request_queue_time_seconds_bucket{le="0.01",model_name="m"}') == 1
    assert value('kvserve_slo_requests_total{model_name="m",priority="0",result="met",slo="ttft",tenant="default"}') == 1
    assert value('kvserve_slo_requests_total{model_name="m",priority="0",result="missed",slo="tpot",tenant="default"}') == 1
    assert value('kvserve_slo_requests_total{model_name="m",priority="0",result="missed",slo="both",tenant="default"}') == 1
    assert value('vllm:request_success_total{finished_reason="stop",model_name="m"}') == 1


def test_slo_counters_count_aborted_and_cancelled_requests_as_their_own_result():
    metrics = ServerMetrics("m", ttft_slo_s=0.5, tpot_slo_s=0.05)
    started = RequestTimestamps(arrival=1.0, queued=1.0, scheduled=1.01, first_token=1.05,
                                token_times=[1.05, 1.07], finished=1.2)
    never_started = RequestTimestamps(arrival=2.0, queued=2.0, finished=3.0)
    metrics.record_finished(started, 4, 2, "abort", cancelled=True)
    metrics.record_finished(never_started, 4, 0, "abort")
    text = metrics.render().decode()
    for slo in ("ttft", "tpot", "both"):
        for result in ("cancelled", "aborted"):
            assert (f'kvserve_slo_requests_total{{model_name="m",priority="0",result="{result}",slo="{slo}",'
                    'tenant="default"} 1.0') in text
    assert 'result="met"' not in text and 'result="missed"' not in text


def test_health_and_ready():
    with live_server(tiny_core()) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        assert httpx.get(srv.base_url + "/ready").status_code == 200
        srv.serving.draining = True
        ready = httpx.get(srv.base_url + "/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
        assert int(ready.headers["retry-after"]) >= 1
        refused = httpx.post(srv.base_url + "/v1/completions",
                             json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        srv.serving.draining = False


def test_warm_up_leaves_counters_kv_and_prefix_cache_empty():
    core = tiny_core(num_blocks=64)
    # A TPOT target no step meets (1 us: a fast machine's tiny-model step can come in under 1 ms):
    # a running cap below max_num_seqs shows the warm-up ran.
    with live_server(core, tpot_slo_s=1e-6) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        s = scrape(srv.base_url)
        assert metric(s, "kvserve_running_cap") < 16
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                     "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                     "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_count",
                     "kvserve_admission_decisions_total", "kvserve_slo_requests_total"):
            assert metric(s, name) == 0, name
        kv = core.scheduler.kv_cache
        assert kv.pool.num_cached_blocks == 0 and kv.num_free_blocks == kv.num_blocks
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": list(range(1, 41)), "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        s = scrape(srv.base_url)
        assert metric(s, "vllm:prompt_tokens_total") == 40
        assert metric(s, "vllm:prefix_cache_queries_total") == 40
        assert metric(s, "vllm:prefix_cache_hits_total") == 0
        assert metric(s, "vllm:request_success_total") == 1


def test_resident_weight_bytes_by_format():
    core = tiny_core()
    with live_server(core) as srv:
        samples = scrape(srv.base_url)
    assert metric(samples, "kvserve_model_weight_bytes", format="float32") > 0
    assert metric(samples, "kvserve_model_weight_bytes") == core.runner.weight_bytes
    metrics = ServerMetrics("m", 1.0, 0.1)
    metrics.record_weights({"q4_1": 1000, "q8_0": 24})
    text = metrics.render().decode()
    assert 'kvserve_model_weight_bytes{format="q4_1",model_name="m"} 1000.0' in text


def test_length_histograms_count_exactly_what_was_sent():
    core = tiny_core(num_blocks=16, max_model_len=512)
    sent = [(10, 4), (19, 5), (30, 6)]  # (prompt tokens, max_tokens); the tiny model has no EOS
    with live_server(core) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        for i, (num_prompt, max_tokens) in enumerate(sent):
            prompt = list(range(1 + 40 * i, 1 + 40 * i + num_prompt))  # no shared prefix
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                   "priority": 3 if i == 0 else 0})
            assert r.status_code == 200
        s = scrape(srv.base_url)

    assert metric(s, "vllm:request_prompt_tokens_count") == 3
    assert metric(s, "vllm:request_prompt_tokens_sum") == 59
    assert metric(s, "vllm:request_prompt_tokens_bucket", le="10.0") == 1  # vLLM's 1-2-5 buckets
    assert metric(s, "vllm:request_prompt_tokens_bucket", le="20.0") == 2
    assert metric(s, "vllm:request_prompt_tokens_bucket", le="50.0") == 3
    assert metric(s, "vllm:request_generation_tokens_sum") == 15
    assert metric(s, "vllm:request_generation_tokens_bucket", le="5.0") == 2
    # One request at a time: a prefill step of its prompt, then one token per decode step.
    assert metric(s, "vllm:iteration_tokens_total_count") == 3 + 3 + 4 + 5
    assert metric(s, "vllm:iteration_tokens_total_sum") == 59 + 3 + 4 + 5
    assert metric(s, "vllm:iteration_tokens_total_bucket", le="1.0") == 3 + 4 + 5
    # After each step the running request holds its prompt and the tokens so
    # far; after its last token it is no longer running.
    running = [p + k for p, m in sent for k in range(1, m)]
    assert metric(s, "kvserve_running_context_tokens_count") == len(running)
    assert metric(s, "kvserve_running_context_tokens_sum") == sum(running)
    assert 20 in running  # on a bucket's bound: counted in it (le)
    assert metric(s, "kvserve_running_context_tokens_bucket", le="20.0") == sum(1 for n in running if n <= 20)
    assert metric(s, "kvserve_waiting_context_tokens_count") == 0
    # SLO verdicts by priority class and tenant.
    assert metric(s, "kvserve_slo_requests_total", slo="both", priority="3", tenant="default") == 1
    assert metric(s, "kvserve_slo_requests_total", slo="both", priority="0", tenant="default") == 2
    assert metric(s, "vllm:cache_config_info", block_size="16", num_gpu_blocks="16",
                  enable_prefix_caching="True", cache_dtype="float32") == 1


def test_a_small_cache_shows_evictions_allocation_failures_and_waiting_lengths():
    core = slow_steps(tiny_core(num_blocks=8, max_model_len=512), 0.01)  # 128 token slots
    with live_server(core) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
        first = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": list(range(1, 41)),
                                                   "max_tokens": 2})
        assert first.status_code == 200  # leaves its two full blocks in the prefix cache
        s = scrape(srv.base_url)
        assert metric(s, "kvserve_prefix_cache_evicted_blocks_total") == 0
        assert metric(s, "kvserve_kv_allocation_failures_total") == 0
        # Three requests of 5 blocks each into 8: one runs, the others wait
        # for its blocks, and the cached blocks are evicted to make room.
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(http.post, "/v1/completions",
                                   json={"model": MODEL_NAME, "prompt": list(range(100 + 60 * i, 150 + 60 * i)),
                                         "max_tokens": 30}) for i in range(3)]
            statuses = [f.result().status_code for f in futures]
        s = scrape(srv.base_url)
    assert statuses.count(200) >= 2, statuses
    assert metric(s, "kvserve_prefix_cache_evicted_blocks_total") >= 2
    assert metric(s, "kvserve_kv_allocation_failures_total") >= 1
    waited = metric(s, "kvserve_waiting_context_tokens_count")
    assert waited >= 1
    # A request waits with its 50-token prompt, a preempted one with some of
    # its 30 output tokens too: every sample lies in (20, 100]. Which of the
    # two kinds is sampled depends on when the three arrive against the steps
    # (admission may hold a new one at the front door, outside the waiting
    # queue), so neither kind is required.
    assert metric(s, "kvserve_waiting_context_tokens_bucket", le="100.0") == waited
    assert metric(s, "kvserve_waiting_context_tokens_bucket", le="20.0") == 0
    assert metric(s, "kvserve_waiting_context_tokens_sum") >= 50 * waited
    assert metric(s, "kvserve_memory_bytes", kind="kv_cache") == (8 * 16 + 1) * KV_BYTES_PER_TOKEN  # + scratch slot
    assert metric(s, "kvserve_memory_bytes", kind="weights") == core.runner.weight_bytes
    assert metric(s, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0


def test_preemption_counts_the_tokens_it_drops():
    from kvserve.scheduler.scheduler import SchedulerStats

    metrics = ServerMetrics("m", 1.0, 0.1)
    for recomputed in (0, 40, 40, 70):
        metrics.record_stats(SchedulerStats(1, 2, 1, 0.5, 0, 0, 3, 4, recomputed), num_deferred=1)
    text = metrics.render().decode()
    assert 'kvserve_recomputed_tokens_total{model_name="m"} 70.0' in text
    assert 'kvserve_kv_allocation_failures_total{model_name="m"} 4.0' in text
    assert 'vllm:num_requests_waiting_by_reason{model_name="m",reason="deferred"} 1.0' in text
    assert 'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 2.0' in text
