"""The gateway's parts on their own: config files, the circuit breaker,
reading a backend's /metrics, fleet quotas and the wait refusal, what it
reads of a request, aliases, the desired replica count, and the Batch API
store (including a restart)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import pytest

from kvserve.admission.quotas import TenantLimits
from kvserve.admission.retry_after import ReturnSlots
from kvserve.admission.tenants import Tenant, TenantDirectory
from kvserve.fleet.autoscale import desired_replicas
from kvserve.fleet.backend_state import BackendState
from kvserve.fleet.door import FleetQuotas, wait_refusal
from kvserve.gateway import config as gw
from kvserve.gateway.backends import CLOSED, HALF_OPEN, OPEN, BackendView, CircuitBreaker, parse_metrics
from kvserve.gateway.batches import BatchStore
from kvserve.gateway.cli import add_arguments, build_config
from kvserve.gateway.inbound import read_inbound
from kvserve.gateway.pools import AliasPolicy
from kvserve.metrics import ServerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gateway_imports_no_torch():
    code = ("import sys, kvserve.gateway.app, kvserve.gateway.cli, kvserve.fleet.router\n"
            "assert 'torch' not in sys.modules, 'the gateway imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- config ---------------------------------------------------------------------

YAML = """
router: {policy: prefix-affinity, affinity_slack_s: 0.25}
pools:
  - model: large
    backends: [http://127.0.0.1:8001/, {url: "http://127.0.0.1:8002", name: l2, num_kv_blocks: 900, block_size: 16}]
    smaller: small
  - model: small
    backends: [http://127.0.0.1:8003]
aliases:
  auto: {default: large, rules: [{model: small, max_prompt_chars: 100, max_tokens_at_most: 32}]}
ladder: {"0": [cap_max_tokens, smaller_model, deferred, reject], "1": [deferred, reject], max_tokens_cap: 16}
admission: {max_queue_wait_s: 0.5, retry_budget: 0.2}
"""


def test_config_file_reads_pools_aliases_and_the_ladder(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(YAML)
    config = gw.from_mapping(gw.load_file(path), port=9000)
    assert [p.model for p in config.pools] == ["large", "small"]
    assert [b.name for b in config.pools[0].backends] == ["http://127.0.0.1:8001", "l2"]
    assert config.pools[0].backends[1].num_kv_blocks == 900 and config.pools[0].smaller == "small"
    assert config.router.policy == "prefix-affinity" and config.router.affinity_slack_s == 0.25
    assert config.aliases[0].rules[0].matches(50, 16) and not config.aliases[0].rules[0].matches(50, None)
    assert config.rungs_for(0) == ("cap_max_tokens", "smaller_model", "deferred", "reject")
    assert config.rungs_for(5) == ("deferred", "reject") and config.rungs_for(-3) == config.rungs_for(0)
    assert config.ladder_max_tokens == 16 and config.admission.max_wait_s(0) == 0.5 and config.admission.max_wait_s(1) == 8.0
    assert config.admission.retry_budget == 0.2 and config.port == 9000


@pytest.mark.parametrize("data,message", [
    ({"pools": []}, "at least one backend"),
    ({"pools": [{"model": "a", "backends": ["ftp://x"]}]}, "http://"),
    ({"pools": [{"model": "a", "backends": ["http://x"], "smaller": "b"}]}, "not a pool"),
    ({"pools": [{"model": "a", "backends": ["http://x"]}], "ladder": {"0": ["shrug"]}}, "rungs"),
    ({"pools": [{"model": "a", "backends": ["http://x"]}], "aliases": {"auto": {"default": "zz"}}}, "not pools"),
    ({"pools": [{"model": "a", "backends": ["http://x"]}], "colour": "blue"}, "unknown"),
    ({"pools": [{"model": "a", "backends": ["http://x"]}], "router": {"policy": "random"}}, "unknown router"),
    ({"pools": [{"model": "a", "backends": ["http://x", "http://x"]}]}, "unique"),
])
def test_bad_config_says_what_is_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        gw.from_mapping(data)


def test_cli_backends_and_flags_join_the_config_file(tmp_path):
    path = tmp_path / "gw.json"
    path.write_text(json.dumps({"router": {"policy": "kv-aware"}, "scrape_interval_s": 0.5}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2",
                              "--config", str(path), "--affinity-slack", "2"])
    config = build_config(args)
    assert [b.url for b in config.pools[0].backends] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert config.pools[0].model is None and config.router.policy == "kv-aware"
    assert config.router.affinity_slack_s == 2.0 and config.scrape_interval_s == 0.5
    assert config.host == "127.0.0.1" and config.port == 8080  # loopback by default
    with pytest.raises(ValueError, match="--backend"):
        build_config(parser.parse_args([]))


# ---- health -----------------------------------------------------------------------

def test_circuit_breaker_opens_probes_and_closes():
    clock = Clock()
    breaker = CircuitBreaker(gw.BreakerConfig(failures=3, cool_down_s=5.0), clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # not consecutive: reset
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state == CLOSED
    breaker.record_failure()
    assert breaker.state == OPEN and breaker.num_ejections == 1
    breaker.record_success()  # a late answer from before: stays open
    clock.now = 4.9
    assert breaker.state == OPEN
    clock.now = 5.0
    assert breaker.state == HALF_OPEN and not breaker.closed
    breaker.record_failure()  # the probe failed: open again, a fresh cool-down
    assert breaker.state == OPEN and breaker.num_ejections == 1
    clock.now = 10.0
    assert breaker.state == HALF_OPEN
    breaker.record_success()
    assert breaker.closed


def test_view_reads_a_kvserve_metrics_page_and_counts_its_own_sends():
    from kvserve.scheduler.scheduler import SchedulerStats

    metrics = ServerMetrics("tiny", 2.0, 0.1)
    metrics.record_stats(SchedulerStats(3, 2, 0, 0.5, 100, 40, 0, 0, 0))
    metrics.running_cap.set(4)
    scrape = parse_metrics(metrics.render().decode())
    assert (scrape.num_running, scrape.num_waiting, scrape.kv_usage, scrape.running_cap) == (3, 2, 0.5, 4)
    assert scrape.prefix_hits_total == 40 and scrape.prefix_queries_total == 100
    clock = Clock()
    view = BackendView(gw.BackendConfig("http://b", num_kv_blocks=100, block_size=16), gw.BreakerConfig(), clock)
    view.record_scrape(scrape, ready=True)
    assert view.eligible(stale_after_s=5.0) and view.num_kv_blocks == 100
    sent = view.on_send(320)  # 20 blocks the scrape does not show yet
    assert view.num_running == 4 and view.kv_usage == pytest.approx(0.7)
    view.on_done(sent)
    assert view.num_running == 3 and view.kv_usage == pytest.approx(0.5)
    clock.now = 6.0
    assert not view.eligible(stale_after_s=5.0)  # stale


def test_a_send_since_the_scrape_claims_the_blocks_its_cache_is_not_finding():
    # Between two scrapes the backend found 75% of prompt tokens cached: a
    # request sent after the second claims a quarter of its 320 tokens' blocks
    # (counted in full, requests behind one shared system prompt looked like
    # a full cache, and prefix-affinity routed them away from it).
    import dataclasses

    from kvserve.scheduler.scheduler import SchedulerStats

    metrics = ServerMetrics("tiny", 2.0, 0.1)
    metrics.record_stats(SchedulerStats(3, 2, 0, 0.5, 100, 40, 0, 0, 0))
    first = parse_metrics(metrics.render().decode())
    view = BackendView(gw.BackendConfig("http://b", num_kv_blocks=100, block_size=16), gw.BreakerConfig(), Clock())

    def scrape(hits, queries):
        view.record_scrape(dataclasses.replace(first, prefix_hits_total=hits, prefix_queries_total=queries), True)

    scrape(40, 100)
    assert view.prefix_hit_rate is None  # one reading is no interval yet: sends count in full
    sent = view.on_send(320)
    assert view.kv_usage == pytest.approx(0.5 + 20 / 100)
    view.on_done(sent)
    scrape(790, 1100)  # 750 of 1,000 prompt tokens hit
    assert view.prefix_hit_rate == pytest.approx(0.75)
    view.on_send(320)
    assert view.kv_usage == pytest.approx(0.5 + 5 / 100)
    scrape(10, 20)  # the backend restarted: its counters went back, the interval is skipped
    assert view.prefix_hit_rate == pytest.approx(0.75)
    scrape(35, 120)  # 25 of 100: recent intervals weigh most, the older still count
    assert 0.25 < view.prefix_hit_rate < 0.75


def test_view_reads_vllms_metric_names():
    page = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 5.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.125
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-0.6B"} 10.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:request_queue_time_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 12.0
"""
    scrape = parse_metrics(page)
    assert (scrape.num_running, scrape.num_waiting, scrape.kv_usage, scrape.finished_total) == (5, 1, 0.125, 12)
    assert (scrape.num_kv_blocks, scrape.block_size, scrape.running_cap) == (2048, 16, None)
    with pytest.raises(ValueError, match="vLLM-compatible"):
        parse_metrics("up 1\n")


# ---- admission --------------------------------------------------------------------

def test_fleet_quotas_count_concurrency_and_retries_once():
    clock = Clock()
    tenants = TenantDirectory({"k": Tenant("t", TenantLimits(max_concurrent=2))})
    quotas = FleetQuotas(tenants, retry_budget=0.5, retry_budget_burst=1.0, clock=clock)
    t = Tenant("t", TenantLimits(max_concurrent=2))
    assert quotas.admit("a", t, 10, 10, False) is None and quotas.admit("b", t, 10, 10, False) is None
    refusal = quotas.admit("c", t, 10, 10, False)
    assert refusal.status == 429 and refusal.reason == "tenant_quota" and refusal.retry_after_s >= 1
    quotas.on_finish("a")
    assert quotas.admit("c", t, 10, 10, False) is None
    free = Tenant("default")
    assert quotas.take_retry()  # the burst of one
    assert not quotas.take_retry()  # spent; each admission earns half a retry back
    assert quotas.admit("d", free, 1, 1, is_retry=True).reason == "retry_budget"
    quotas.admit("e", free, 1, 1, False)
    quotas.admit("f", free, 1, 1, False)
    assert quotas.admit("g", free, 1, 1, is_retry=True) is None


def test_wait_refusal_uses_the_smallest_expected_wait():
    busy = BackendState("a", num_running=8, num_waiting=6, running_cap=8, drain_rps=2.0)  # 3.5 s
    busier = BackendState("b", num_running=8, num_waiting=10, running_cap=8, drain_rps=2.0)  # 5.5 s
    refusal = wait_refusal([busier, busy], num_tokens=100, limit_s=1.0, return_slots=ReturnSlots(lambda: 0.0))
    # Back when its wait would be half the limit: ceil(3.5 - 0.5); a batch slot binds.
    assert (refusal.status, refusal.reason, refusal.retry_after_s) == (429, "batch_slots", 3)
    assert "3.50 s" in refusal.message
    assert wait_refusal([busy, BackendState("c", running_cap=8, drain_rps=2.0)], 100, 1.0,
                        ReturnSlots(lambda: 0.0)) is None


def test_wait_refusal_names_kv_blocks_when_they_bind():
    # A free batch slot but a cache too full for 60 blocks' worth of tokens.
    full_cache = BackendState("a", num_running=4, kv_usage=0.9, num_kv_blocks=100, block_size=16,
                              running_cap=8, drain_rps=1.0)
    refusal = wait_refusal([full_cache], num_tokens=60 * 16, limit_s=1.0, return_slots=ReturnSlots(lambda: 0.0))
    assert refusal.reason == "kv_cache" and "KV blocks" in refusal.message


def test_a_refused_burst_is_told_staggered_times_spaced_by_the_fleet_drain():
    # Two backends draining 1 request/s each: the fleet frees room every 0.5 s.
    backends = [BackendState(name, num_running=8, num_waiting=4, running_cap=8, drain_rps=1.0) for name in "ab"]
    slots = ReturnSlots(lambda: 0.0)
    retry_afters = [wait_refusal(backends, 100, 1.0, slots).retry_after_s for _ in range(8)]
    assert retry_afters == sorted(retry_afters) and retry_afters[-1] > retry_afters[0]
    # 5 s expected, back at 4.5 s, then one per 0.5 s: 8 clients over 4 whole seconds.
    assert retry_afters == [5, 5, 6, 6, 7, 7, 8, 8]


# ---- requests ---------------------------------------------------------------------

def test_inbound_reads_what_routing_needs_and_leaves_bad_fields_to_the_backend():
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 30, "service_tier": "flex", "stream": True}
    inbound = read_inbound("chat", "/v1/chat/completions", json.dumps(body).encode(), 2, {"x-stainless-retry-count": "1"})
    assert inbound.prompt_text == "system\nbe brief\nuser\nhi\n" and inbound.requested_max_tokens == 30
    assert inbound.priority == 3 and inbound.is_retry and inbound.stream  # tenant floor 2, flex +1
    assert json.loads(inbound.body_bytes("small", 8))["max_completion_tokens"] == 8
    assert inbound.body_bytes() == inbound.raw
    weird = read_inbound("completion", "/v1/completions", b'{"prompt": 5, "priority": "high", "max_tokens": "x"}',
                         None, {})
    assert (weird.priority, weird.requested_max_tokens, weird.prompt_text) == (0, None, "")
    assert read_inbound("completion", "/v1/completions", b"[1, 2]", None, {}).body is None
    for messages in (True, 5, "hi", {"role": "user"}, [1, "x", {"role": "user", "content": 5}]):
        odd = read_inbound("chat", "/v1/chat/completions", json.dumps({"messages": messages}).encode(), None, {})
        assert odd.prompt_text in ("", "user\n\n"), messages  # read as no text; the backend answers 400
    ids = read_inbound("completion", "/v1/completions", b'{"prompt": [1, 2, 3]}', None, {})
    assert ids.prompt_bytes == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"  # as the simulator keys tokens


def slow_classifier(text, max_tokens):
    time.sleep(0.2)
    return "small"


def junk_classifier(text, max_tokens):
    return "no-such-pool"


def test_alias_rules_then_classifier_within_budget_then_default():
    rules = (gw.AliasRule("small", max_prompt_chars=10),)
    policy = AliasPolicy(gw.AliasConfig("auto", "large", rules))
    assert asyncio.run(policy.choose("short", None, {"large", "small"})) == "small"
    assert asyncio.run(policy.choose("a much longer prompt", None, {"large", "small"})) == "large"
    slow = AliasPolicy(gw.AliasConfig("auto", "large", classifier=f"{__name__}:slow_classifier", budget_s=0.02))

    async def timed():
        started = time.monotonic()
        return await slow.choose("x", None, {"large", "small"}), time.monotonic() - started
    chosen, took_s = asyncio.run(timed())
    assert chosen == "large" and slow.num_over_budget == 1
    assert took_s < 0.19  # the budget, not the classifier's 0.2 s
    junk = AliasPolicy(gw.AliasConfig("auto", "large", classifier=f"{__name__}:junk_classifier"))
    assert asyncio.run(junk.choose("x", None, {"large", "small"})) == "large"
    with pytest.raises(ValueError, match="classifier"):
        AliasPolicy(gw.AliasConfig("auto", "large", classifier="no_module_here:f"))


def test_desired_replicas_follow_kv_usage_and_queue_wait():
    idle = [BackendState(f"b{i}", kv_usage=0.1, running_cap=8, drain_rps=1.0) for i in range(4)]
    assert desired_replicas(idle) == 1
    full = [BackendState(f"b{i}", kv_usage=0.9, running_cap=8, drain_rps=1.0) for i in range(4)]
    assert desired_replicas(full) == 5  # ceil(4 * 0.9 / 0.75)
    queued = [BackendState(f"b{i}", num_running=8, num_waiting=2, running_cap=8, drain_rps=4.0) for i in range(4)]
    assert desired_replicas(queued) == 6  # 0.75 s of wait against 0.5 s


# ---- the Batch API store ---------------------------------------------------------------

def _lines(*bodies) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": b}) + "\n"
                   for i, b in enumerate(bodies)).encode()


def test_batch_store_runs_lines_and_writes_openais_output_format(tmp_path):
    store = BatchStore(tmp_path)
    file = store.create_file("alice", "batch", "in.jsonl", _lines({"prompt": "a"}, {"prompt": "b"}))
    batch = store.create_batch("alice", file["id"], "/v1/completions", "24h")
    assert batch["status"] == "in_progress" and batch["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    with pytest.raises(ValueError):
        store.batch("mallory", batch["id"])  # another tenant's batch does not exist for it
    first, second = store.take_pending(5)
    assert store.take_pending(5) == []  # taken lines are not handed out twice
    store.record_result(first, 200, {"id": "cmpl-1", "choices": []}, None)
    assert store.batch("alice", batch["id"])["status"] == "in_progress"
    store.record_result(second, 400, {"error": {"message": "bad"}}, None)
    done = store.batch("alice", batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    output = [json.loads(x) for x in store.file_content("alice", done["output_file_id"]).splitlines()]
    assert output == [{"id": output[0]["id"], "custom_id": "c0", "error": None,
                       "response": {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1", "choices": []}}}]
    errors = [json.loads(x) for x in store.file_content("alice", done["error_file_id"]).splitlines()]
    assert errors[0]["custom_id"] == "c1" and errors[0]["response"]["status_code"] == 400


def test_batch_store_refuses_bad_input_files(tmp_path):
    store = BatchStore(tmp_path)
    bad = b'{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}\nnot json\n'
    file = store.create_file("t", "batch", "bad.jsonl", bad)
    failed = store.create_batch("t", file["id"], "/v1/completions", "24h")
    assert failed["status"] == "failed" and [e["line"] for e in failed["errors"]["data"]] == [1, 2]
    with pytest.raises(ValueError, match="endpoint"):
        store.create_batch("t", file["id"], "/v1/embeddings", "24h")
    with pytest.raises(ValueError, match="no file"):
        store.create_batch("t", "file-nope", "/v1/completions", "24h")


def test_accepted_batches_survive_a_restart_and_cancel(tmp_path):
    store = BatchStore(tmp_path)
    file = store.create_file("t", "batch", "in.jsonl", _lines({"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}))
    batch = store.create_batch("t", file["id"], "/v1/completions", "24h")
    taken = store.take_pending(1)  # in flight when the gateway dies
    store.close()
    again = BatchStore(tmp_path)
    assert again.batch("t", batch["id"])["status"] == "in_progress"
    assert [p.line for p in again.take_pending(10)] == [0, 1, 2]  # the one in flight is sent again
    assert taken[0].line == 0
    other = again.create_batch("t", file["id"], "/v1/completions", "24h")
    cancelled = again.cancel("t", other["id"])
    assert cancelled["status"] == "cancelled" and cancelled["request_counts"]["failed"] == 3
    again.close()
