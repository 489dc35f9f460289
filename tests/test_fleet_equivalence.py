"""The gateway and the simulator make the same routing decisions for the
same sequence of backend states: a simulation records every decision with
the states it saw; each state is rendered as the /metrics page a backend
would serve, parsed by the gateway into its views, and the gateway's
choice must be the simulator's, decision by decision."""

from __future__ import annotations

import pytest

from kvserve.config import AdmissionConfig
from kvserve.fleet.backend_state import BackendState, snapshot
from kvserve.fleet.router import RouteRequest
from kvserve.gateway.backends import parse_metrics
from kvserve.gateway.config import from_mapping
from kvserve.gateway.service import Gateway
from tests.test_sim_fast_forward import SHARING, _config, _simulate, _workload

NUM_REPLICAS = 3
EXPECTED_REASONS = {"round-robin": {"turn"}, "least-loaded": {"least_loaded"}, "kv-aware": {"kv_fit", "kv_short"},
                    "prefix-affinity": {"affine", "affine_overflow"}}


class _MeasuredDrain:
    """Stands in for a view's DrainMeter: the drain the simulator measured
    (the gateway's own meter integrates scrapes over time, tested apart)."""

    def __init__(self) -> None:
        self.value: float | None = None

    def observe(self, *_) -> None:
        pass

    def rate_rps(self, _now_s: float) -> float | None:
        return self.value


def metrics_page(state: BackendState) -> str:
    """What a kvserve backend in this state serves on /metrics."""
    lines = [f'vllm:num_requests_running{{model_name="m"}} {float(state.num_running)!r}',
             f'vllm:num_requests_waiting{{model_name="m"}} {float(state.num_waiting)!r}',
             f'vllm:kv_cache_usage_perc{{model_name="m"}} {state.kv_usage!r}',
             'vllm:request_success_total{finished_reason="length",model_name="m"} 3.0']
    if state.running_cap is not None:
        lines.append(f'kvserve_running_cap{{model_name="m"}} {float(state.running_cap)!r}')
    if state.num_kv_blocks is not None:
        lines.append(f'vllm:cache_config_info{{block_size="{state.block_size}",'
                     f'num_gpu_blocks="{state.num_kv_blocks}"}} 1.0')
    return "\n".join(["# HELP vllm:num_requests_running Requests in the running batch.", *lines]) + "\n"


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "kv-aware", "prefix-affinity"])
def test_gateway_routes_as_the_simulator_for_the_same_states(policy):
    # For prefix-affinity one tenant's hot prefix (60% of requests, longer
    # than the 64-token key): its backend's load bound sends some of them
    # on, so the overflow branch decides too (with SHARING's two tenants and
    # short prefixes, keys are placed evenly and never overflow).
    sharing = {**SHARING, "num_prefix_groups": 1, "prefix_tokens": 96, "tenants": (("a", 1.0),)} \
        if policy == "prefix-affinity" else SHARING
    specs = _workload(240, seed=7, **sharing)
    offsets = [i * 0.008 for i in range(len(specs))]
    sim = _simulate(_config(AdmissionConfig(max_queue_wait_s=0.5), num_blocks=150, num_replicas=NUM_REPLICAS,
                            router=policy), specs, offsets, fast_forward=True)
    trace = sim.route_trace
    # Every arrival the front door let through was routed, and a replica's
    # 429 routed once more over the replicas left.
    assert len(trace) == len(specs) - sim.num_door_refused + sim.num_door_resent
    # The gateway, configured as an operator would: the replicas by name, the same policy.
    config = from_mapping({"pools": [{"model": "m", "backends": [
        {"url": f"http://127.0.0.1:{9000 + i}", "name": f"replica-{i}"} for i in range(NUM_REPLICAS)]}],
        "router": {"policy": policy}})
    gateway = Gateway(config)
    pool = gateway.pools[0]
    views = {view.name: view for view in pool.views}
    for view in pool.views:
        view.drain = _MeasuredDrain()
    decisions = []
    for request, states, sim_decision in trace:
        for state in states:
            view = views[state.name]
            view.record_scrape(parse_metrics(metrics_page(state)), ready=True)
            view.drain.value = state.drain_rps
            assert snapshot(view) == state  # the view shows what the page said
        tried = set(views) - {state.name for state in states}  # a re-send goes to the others
        backend, decision = gateway.choose(pool, RouteRequest(*request),
                                           pool.eligible(config.stale_after_s, exclude=tried))
        assert backend.name == states[sim_decision.position].name
        decisions.append(decision)
    assert decisions == [d for _, _, d in trace]
    # The states varied enough for every branch of the policy to decide something.
    assert len({d.position for d in decisions}) == NUM_REPLICAS
    assert {d.reason for d in decisions} >= EXPECTED_REASONS[policy]
