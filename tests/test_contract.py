import pytest

from kvserve.contract import (FINISH_REASONS, InvalidParameter, Request, RequestStatus, SamplingParams,
                              finish_reason)
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
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value)


def test_sampling_params_normalise_stop():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)


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
