import pytest

from kvserve.contract import (FINISH_REASONS, InvalidParameter, Request, RequestStatus, ResolvedVersions,
                              SamplingParams, StructuredOutput, finish_reason)
from kvserve.latency import derive_latency, summarize


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {-3: 1}}, "logit_bias"),
    ({"logit_bias": {3: True}}, "logit_bias"),
    ({"logit_bias": {i: 1 for i in range(1025)}}, "logit_bias"),
    ({"structured_output": {"type": "json_object"}}, "structured_output"),
    ({"stop_token_ids": [5], "structured_output": StructuredOutput("regex", "a+")}, "stop"),
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value)


def test_sampling_params_normalise_stop():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)


def test_sampling_params_normalise_logit_bias_and_penalties():
    params = SamplingParams(logit_bias={"12": 3, 5: -100.0}, presence_penalty=1, repetition_penalty=1.1)
    assert params.logit_bias == ((5, -100.0), (12, 3.0))
    assert params.has_penalties and not SamplingParams().has_penalties
    assert hash(params) == hash(SamplingParams(logit_bias=[(12, 3), (5, -100)], presence_penalty=1,
                                               repetition_penalty=1.1))


@pytest.mark.parametrize("kind, spec, match", [
    ("xml", None, "kind must be one of"),
    ("json", "[1, 2", "not valid JSON"),
    ("json", [1, 2], "must be an object"),
    ("json", {"x": float("nan")}, "not JSON"),
    ("json", {"description": "x" * 100_001}, "longer than"),
    ("choice", ["a", ""], "non-empty string"),
    ("choice", "a", "list"),
    ("regex", "", "string of 1"),
    ("grammar", 5, "string of 1"),
])
def test_structured_output_shape_is_checked_at_construction(kind, spec, match):
    with pytest.raises(InvalidParameter, match=match) as err:
        StructuredOutput(kind, spec)
    assert err.value.param == "structured_output"


def test_versions_fingerprint_grows_with_what_the_request_brings():
    base = ResolvedVersions("a" * 64, "b" * 64, "c" * 64)
    assert base.fingerprint == "fp_aaaaaaaa_bbbbbb_cccccc"
    mine = base.for_request(SamplingParams(structured_output=StructuredOutput("choice", ["x", "y"])))
    assert mine.fingerprint == f"fp_aaaaaaaa_bbbbbb_cccccc_{mine.structured_output_hash[:6]}"
    adapter = ResolvedVersions("a" * 64, "b" * 64, "c" * 64, adapter_id="d" * 64, tool_schema_hash="e" * 64)
    assert adapter.fingerprint == "fp_aaaaaaaa_bbbbbb_cccccc_dddddd_eeeeee"


def test_status_order_and_finish_reasons():
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    assert not RequestStatus.PREEMPTED.is_finished and RequestStatus.FINISHED_STOPPED.is_finished
    assert {finish_reason(s) for s in FINISH_REASONS} == {"stop", "length", "abort"}
    assert finish_reason(RequestStatus.RUNNING) is None


def test_request_token_views():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=5), arrival_time=0.0)
    r.output_token_ids += [4, 5]
    assert r.num_tokens == 5 and r.max_num_tokens == 8
    assert r.token_ids_slice(1, 4) == [2, 3, 4] and r.token_ids_slice(3, 5) == [4, 5]
    assert r.all_token_ids == [1, 2, 3, 4, 5]
    with pytest.raises(InvalidParameter):
        Request("empty", [], SamplingParams(), arrival_time=0.0)


def test_latency_definitions_with_multi_token_chunks():
    # Sent at 10.0; 1 token at 10.5, then 3 tokens at 10.8, then 1 at 11.0; ends 11.1.
    lat = derive_latency(10.0, [(10.5, 1), (10.8, 3), (11.0, 1)], 11.1, scheduled=10.2)
    assert lat.ttft_s == pytest.approx(0.5)
    assert lat.tpot_s == pytest.approx(0.5 / 4)
    assert lat.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.2])
    assert lat.e2e_s == pytest.approx(1.1) and lat.queue_s == pytest.approx(0.2)
    assert lat.num_output_tokens == 5
    single = derive_latency(0.0, [(0.3, 1)], 0.4)
    assert single.tpot_s is None and single.itl_s == []
    none = derive_latency(0.0, [], 1.0)
    assert none.ttft_s is None and none.e2e_s == 1.0


def test_summarize_percentiles():
    s = summarize([None, *range(1, 101)])
    assert s["count"] == 100 and s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert summarize([])["p50"] is None


def test_the_request_factory_applies_one_engines_rules():
    from kvserve.contract import RequestFactory

    now = [5.0]
    factory = RequestFactory((2, 0), "rev1", lambda: now[0])
    params = SamplingParams(max_tokens=3)
    a = factory.build([1, 2, 3], params, tenant="alice", priority=1, deadline=9.0)
    b = factory.build((4, 5), params, request_id="chosen", arrival_time=1.5)
    assert (a.request_id, a.arrival_time, a.eos_token_ids, a.priority, a.deadline) == ("req-0", 5.0, (2, 0), 1, 9.0)
    assert (b.request_id, b.arrival_time, b.prompt_token_ids, b.tenant) == ("chosen", 1.5, [4, 5], "default")
    assert factory.build([1], params).request_id == "req-2"
    # Tenants never share cached KV, nor do different weights.
    assert a.cache_namespace == "rev1:alice" and b.cache_namespace == "rev1:default"
    other_weights = RequestFactory((2,), "rev2", lambda: 0.0).build([1, 2, 3], params, tenant="alice")
    assert len({a.cache_namespace, b.cache_namespace, other_weights.cache_namespace}) == 3
