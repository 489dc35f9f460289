"""Cost models: roofline numbers checked by hand, the profile fit recovers
known coefficients, profile files round-trip into `--hardware`."""

import json

import pytest

from kvserve.plan.presets import preset
from kvserve.sim.cost_model import (JitteredCostModel, LinearCostModel, RooflineCostModel, StepShape,
                                    fit_linear_cost_model, jitter_summary, load_profile, profile_json,
                                    resolve_hardware, with_step_jitter)
from kvserve.plan.hardware import hardware_preset

LLAMA_8B = preset("llama-3.1-8b").config


def test_roofline_decode_is_bandwidth_bound_hand_checked():
    model = RooflineCostModel(LLAMA_8B, hardware_preset("h100"))
    # One sequence at 1,000 tokens of context: 16.06 GB of bf16 weights +
    # 1,000 x 128 KiB of KV = 16.19 GB at 80% of 3.35 TB/s = 6.04 ms, + 2 ms overhead.
    step = model.step_time_s(StepShape(0, 1, 1000, 1000))
    assert step == pytest.approx(0.00804, rel=0.01)
    # H200's 4.8 TB/s: 16.19 GB / 3.84 TB/s = 4.22 ms, + 2 ms.
    faster = RooflineCostModel(LLAMA_8B, hardware_preset("h200")).step_time_s(StepShape(0, 1, 1000, 1000))
    assert faster == pytest.approx(0.00622, rel=0.01)


def test_roofline_prefill_is_compute_bound_hand_checked():
    model = RooflineCostModel(LLAMA_8B, hardware_preset("h100"))
    # 2,048 fresh tokens: 2 x 8.03e9 x 2048 = 3.29e13 FLOPs in the weights plus
    # 2.1e6 query-key pairs x 4 x 32 layers x 32 heads x 128 = 1.1e12 in attention;
    # 3.40e13 at 50% of 989 TFLOP/s = 68.7 ms, + 2 ms.
    step = model.step_time_s(StepShape(2048, 0, 2048, 2048 * 2049 // 2))
    assert step == pytest.approx(0.0707, rel=0.02)


def test_roofline_grows_with_batch_and_context():
    model = RooflineCostModel(LLAMA_8B, hardware_preset("a100"))
    small = model.step_time_s(StepShape(0, 8, 8 * 512, 8 * 512))
    long_context = model.step_time_s(StepShape(0, 8, 8 * 32768, 8 * 32768))
    assert long_context > small * 1.5
    assert model.step_time_s(StepShape(0, 0, 0, 0)) == 0.0


def test_fit_recovers_known_coefficients():
    truth = LinearCostModel(0.004, 2e-5, 3e-4, 5e-8, 1e-9)
    shapes = [StepShape(p, d, d * c + p, d * c + p * (p + 1) // 2)
              for p in (0, 16, 64, 256) for d in (0, 1, 4, 16) for c in (64, 512) if p or d]
    samples = [(s, truth.step_time_s(s)) for s in shapes]
    fitted, stats = fit_linear_cost_model(samples)
    assert fitted.intercept_s == pytest.approx(0.004, rel=1e-6)
    assert fitted.per_prefill_token_s == pytest.approx(2e-5, rel=1e-6)
    assert fitted.per_decode_seq_s == pytest.approx(3e-4, rel=1e-6)
    assert fitted.per_kv_token_read_s == pytest.approx(5e-8, rel=1e-5)
    assert stats["r2"] == pytest.approx(1.0)


def test_fit_never_returns_negative_costs():
    # Decode cost falling with batch size is noise, not physics: clipped to 0.
    samples = [(StepShape(0, d, d * 100, d * 100), 0.05 - 0.001 * d) for d in range(1, 20)]
    fitted, _ = fit_linear_cost_model(samples)
    assert min(fitted.per_decode_seq_s, fitted.per_kv_token_read_s, fitted.per_attention_pair_s) >= 0
    assert fitted.step_time_s(StepShape(0, 1, 100, 100)) > 0


def test_profile_json_round_trips_into_hardware(tmp_path):
    model = LinearCostModel(0.01, 1e-4, 1e-3, 0.0)
    path = tmp_path / "profile.json"
    engine = {"num_blocks": 1456, "kv_cache_memory_bytes": 2**30}
    path.write_text(json.dumps(profile_json(model, {"r2": 1.0}, engine, {}, [])))
    loaded = resolve_hardware(str(path))
    assert isinstance(loaded, LinearCostModel)
    assert loaded.step_time_s(StepShape(100, 2, 300, 300)) == pytest.approx(0.01 + 0.01 + 0.002)
    assert dict(loaded.engine)["num_blocks"] == 1456


def test_bad_profiles_are_clear_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kind": "linear", "coefficients": {"intercept_s": 1}}))
    with pytest.raises(ValueError, match="lacks coefficients"):
        load_profile(path)
    with pytest.raises(ValueError, match="unknown hardware"):
        resolve_hardware("b300")


@pytest.mark.parametrize("model", [
    RooflineCostModel(LLAMA_8B, hardware_preset("h100")),
    LinearCostModel(0.004, 1e-5, 2e-5, 3e-8, 1e-11),
], ids=["roofline", "linear"])
def test_decode_step_ends_are_the_summed_step_times_exactly(model):
    # The simulator's decode runs take their step times from
    # decode_step_ends_s: the very floats one step_time_s per step gives.
    from kvserve.sim.cost_model import decode_step_ends_s

    shapes = [(n, n * 700 + 13 * i) for i, n in enumerate([1, 3, 3, 40, 256, 255, 7, 1])]
    t, expected = 12.345, []
    for num_seqs, kv_tokens in shapes:
        t = t + model.step_time_s(StepShape(0, num_seqs, kv_tokens, kv_tokens))
        expected.append(t)
    assert decode_step_ends_s(model, 12.345, shapes) == expected


# A CPU-like weight pass: the one-row GEMV is cheap, 2-16 rows cost more
# than 24 (a slow small-GEMM kernel), then time grows with tokens.
CPU_CURVE = LinearCostModel(0.0, 0.0, 2e-3, 4e-6, 2e-7, token_knots=(1, 4, 16, 24, 64, 256),
                            token_knot_s=(0.060, 0.095, 0.140, 0.115, 0.200, 0.650))


def _cpu_like_shapes():
    shapes = [StepShape(n, 0, n, n * (n + 1) // 2) for n in (1, 2, 4, 8, 16, 24, 32, 64, 128, 256)]
    shapes += [StepShape(0, d, d * (c + 1), d * (c + 1)) for d in (1, 2, 4, 8, 16) for c in (32, 256, 768)]
    shapes += [StepShape(p, d, p + d * (c + 1), p * (p + 1) // 2 + d * (c + 1))
               for p in (16, 48) for d in (1, 4) for c in (32, 768)]
    shapes += [StepShape(64, 0, 64 + 256, 64 * 256 + 64 * 65 // 2)]  # a second chunk of a prompt
    return shapes


def test_token_curve_interpolates_between_knots_and_extends_past_the_last():
    model = CPU_CURVE
    assert model.token_curve_s(1) == 0.060
    assert model.token_curve_s(0) == 0.060  # flat below the first knot
    assert model.token_curve_s(20) == pytest.approx((0.140 + 0.115) / 2)
    assert model.token_curve_s(512) == pytest.approx(0.650 + (0.650 - 0.200) / 192 * 256)
    falling = LinearCostModel(0.0, 0.0, 0.0, 0.0, token_knots=(1, 8), token_knot_s=(0.2, 0.1))
    assert falling.token_curve_s(100) == 0.1  # never falls past the last knot
    shape = StepShape(16, 2, 100, 300)
    assert model.step_time_s(shape) == pytest.approx(
        model.token_curve_s(18) + 2e-3 * 2 + 4e-6 * 100 + 2e-7 * 300)


def test_fit_with_knots_recovers_a_curve_a_line_cannot():
    samples = [(s, CPU_CURVE.step_time_s(s)) for s in _cpu_like_shapes()]
    fitted, stats = fit_linear_cost_model(samples, token_knots=CPU_CURVE.token_knots)
    assert fitted.token_knot_s == pytest.approx(CPU_CURVE.token_knot_s, rel=1e-6)
    assert fitted.per_decode_seq_s == pytest.approx(2e-3, rel=1e-6)
    assert fitted.per_kv_token_read_s == pytest.approx(4e-6, rel=1e-5)
    assert fitted.per_attention_pair_s == pytest.approx(2e-7, rel=1e-5)
    assert stats["mean_abs_rel_error"] < 1e-9
    # The five-term line misses the same steps by far more.
    _, line_stats = fit_linear_cost_model(samples)
    assert line_stats["mean_abs_rel_error"] > 0.05


# kvserve's CPU path: prompt rows on bfloat16 tiles, decode rows on the
# quantized weights, so a step streams one set of weights per kind of row it
# has (the 2026-12-06 Xeon: a 1-token prefill 18.6 ms, a 1-sequence decode
# step 10.4 ms, the two in one step about their sum).
TWO_PATHS = LinearCostModel(0.0, 0.0, 5e-4, 3e-6, 1e-8, token_knots=(1, 16, 64, 256),
                            token_knot_s=(0.003, 0.004, 0.014, 0.065), per_prefill_step_s=0.0155,
                            per_decode_step_s=0.0072)


def test_a_step_pays_once_for_prompt_rows_and_once_for_decode_rows():
    prefill, decode, mixed = StepShape(16, 0, 16, 136), StepShape(0, 4, 400, 400), StepShape(16, 4, 416, 536)
    m = TWO_PATHS
    assert m.step_time_s(prefill) == pytest.approx(m.token_curve_s(16) + 3e-6 * 16 + 1e-8 * 136 + 0.0155)
    assert m.step_time_s(decode) == pytest.approx(m.token_curve_s(4) + 5e-4 * 4 + 3e-6 * 400 + 1e-8 * 400 + 0.0072)
    assert m.step_time_s(mixed) == pytest.approx(
        m.token_curve_s(20) + 5e-4 * 4 + 3e-6 * 416 + 1e-8 * 536 + 0.0155 + 0.0072)


def test_fit_recovers_what_each_kind_of_row_costs_a_step():
    samples = [(s, TWO_PATHS.step_time_s(s)) for s in _cpu_like_shapes()]
    fitted, stats = fit_linear_cost_model(samples, token_knots=TWO_PATHS.token_knots)
    assert fitted.per_prefill_step_s == pytest.approx(0.0155, rel=1e-6)
    assert fitted.per_decode_step_s == pytest.approx(0.0072, rel=1e-6)
    assert fitted.token_knot_s == pytest.approx(TWO_PATHS.token_knot_s, rel=1e-6)
    assert stats["mean_abs_rel_error"] < 1e-9
    # One set of weights (a single pass): neither term is fitted.
    one_pass, _ = fit_linear_cost_model([(s, CPU_CURVE.step_time_s(s)) for s in _cpu_like_shapes()],
                                        token_knots=CPU_CURVE.token_knots)
    assert one_pass.per_prefill_step_s == pytest.approx(0.0, abs=1e-9)
    assert one_pass.per_decode_step_s == pytest.approx(0.0, abs=1e-9)


def test_a_profile_written_before_the_step_terms_loads_without_them(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "linear", "coefficients": {
        "intercept_s": 0.01, "per_prefill_token_s": 1e-4, "per_decode_seq_s": 1e-3, "per_kv_token_read_s": 0.0,
        "per_attention_pair_s": 0.0}}))
    loaded = load_profile(path)
    assert (loaded.per_prefill_step_s, loaded.per_decode_step_s) == (0.0, 0.0)
    assert loaded.step_time_s(StepShape(100, 2, 300, 300)) == pytest.approx(0.01 + 0.01 + 0.002)
    path.write_text(json.dumps(profile_json(TWO_PATHS, {"r2": 1.0}, {}, {}, [])))
    shape = StepShape(16, 4, 416, 536)
    assert load_profile(path).step_time_s(shape) == TWO_PATHS.step_time_s(shape)


def test_a_fit_never_extrapolates_past_its_knots():
    # Steps larger than the last knot on a falling curve: extending the last
    # segment would predict less than the model (which never falls past the
    # last knot) computes. The largest step becomes a knot of its own, so
    # every prediction of the fit is the model's own step time.
    times = {1: 0.200, 4: 0.150, 16: 0.100, 32: 0.120}
    samples = [(StepShape(n, 0, n, n), t) for n, t in times.items()]
    samples += [(StepShape(0, d, d * 40, d * 40), 0.2 + 0.01 * d) for d in (1, 2, 4)]
    fitted, stats = fit_linear_cost_model(samples, token_knots=(1, 4))
    assert fitted.token_knots == (1, 4, 32)
    errors = [abs(fitted.step_time_s(s) - t) / t for s, t in samples]
    assert sum(errors) / len(errors) == pytest.approx(stats["mean_abs_rel_error"], rel=1e-9, abs=1e-12)


# Steps of tests/test_engine_profile.py's tiny sweep timed on a machine with
# every core busy (the same 8-token step took 25 ms and 1.3 ms): (prefill
# tokens, decode seqs, KV tokens read, attention pairs), seconds.
NOISY_TINY_SWEEP = [((1, 0, 1, 1), 0.001492), ((4, 0, 4, 10), 0.009021), ((16, 0, 16, 136), 0.009848),
                    ((64, 0, 64, 2080), 0.010575), ((0, 4, 40, 40), 0.009346), ((8, 4, 56, 84), 0.010131),
                    ((0, 1, 14, 14), 0.00929), ((8, 1, 24, 52), 0.001265), ((8, 0, 8, 36), 0.025338),
                    ((0, 4, 172, 172), 0.001188), ((8, 4, 188, 216), 0.00567), ((0, 1, 48, 48), 0.005091),
                    ((8, 1, 58, 86), 0.005371), ((8, 0, 8, 36), 0.001336)]


def test_no_knot_is_fitted_below_the_first_so_no_step_takes_no_time():
    # An unconstrained knot at 4 tokens came out 0 s on these steps, and the
    # 4-token step was predicted to take no time at all.
    samples = [(StepShape(*shape), t) for shape, t in NOISY_TINY_SWEEP]
    fitted, _ = fit_linear_cost_model(samples, token_knots=(1, 4, 16, 64))
    assert fitted.token_knot_s[0] > 0
    assert all(t >= fitted.token_knot_s[0] for t in fitted.token_knot_s)
    assert all(fitted.step_time_s(s) > 0 for s, _ in samples)


def test_nonnegative_fit_matches_a_brute_force_search():
    # Noisy data whose unconstrained least squares wants a negative slope.
    import itertools

    import numpy as np

    from kvserve.sim.cost_model import _nnls

    rng = np.random.default_rng(0)
    a = rng.random((30, 4))
    b = a @ np.array([1.0, -0.5, 0.3, 0.0]) + 0.01 * rng.standard_normal(30)
    x = _nnls(a, b)
    assert (x >= 0).all()
    best = min(
        (float(np.linalg.norm(a[:, list(cols)] @ np.linalg.lstsq(a[:, list(cols)], b, rcond=None)[0] - b)), cols)
        for k in range(1, 5) for cols in itertools.combinations(range(4), k)
        if (np.linalg.lstsq(a[:, list(cols)], b, rcond=None)[0] >= 0).all())
    assert float(np.linalg.norm(a @ x - b)) == pytest.approx(best[0], rel=1e-9)


def test_profile_with_a_curve_round_trips(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_json(CPU_CURVE, {"r2": 1.0}, {"num_blocks": 64}, {}, [])))
    loaded = load_profile(path)
    assert loaded.token_knots == CPU_CURVE.token_knots
    assert loaded.token_knot_s == CPU_CURVE.token_knot_s
    shape = StepShape(40, 3, 500, 1200)
    assert loaded.step_time_s(shape) == CPU_CURVE.step_time_s(shape)
    path.write_text(json.dumps({"kind": "linear", "coefficients": dict.fromkeys(
        ["intercept_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_read_s",
         "per_attention_pair_s"], 0.0), "token_curve": {"tokens": [8, 4], "step_s": [0.1, 0.2]}}))
    with pytest.raises(ValueError, match="strictly increasing"):
        load_profile(path)


RATIOS = (0.8, 1.0, 1.0, 1.5, 2.5)


def test_jitter_multiplies_each_step_by_a_measured_ratio_reproducibly():
    base = LinearCostModel(0.004, 1e-5, 2e-5, 3e-8, 1e-11)
    shape = StepShape(16, 3, 500, 900)

    def draws(seed, n=400):
        model = JitteredCostModel(base, RATIOS, seed)
        return [model.step_time_s(shape) / base.step_time_s(shape) for _ in range(n)]

    first = draws(7)
    assert {round(r, 9) for r in first} == set(RATIOS)  # only measured ratios, and all of them
    assert first == draws(7)  # one seed, one sequence
    assert first != draws(8)
    # About 2 in 5 draws are the doubled 1.0.
    assert 0.3 < sum(1 for r in first if round(r, 9) == 1.0) / len(first) < 0.5


def test_jitter_summary_uses_the_projects_percentile():
    # Linear interpolation, as kvserve.latency.percentile and bench reports:
    # p90 of (1, 1, 1, 2) sits 0.7 of the way from the third value to the
    # fourth (nearest rank would say 2.0).
    summary = jitter_summary((2.0, 1.0, 1.0, 1.0))
    assert summary == {"num_ratios": 4, "p50": 1.0, "p90": pytest.approx(1.7), "p99": pytest.approx(1.97),
                       "max": 2.0, "mean": 1.25}


def test_jittered_decode_step_ends_draw_one_ratio_per_step():
    from kvserve.sim.cost_model import decode_step_ends_s

    base = RooflineCostModel(LLAMA_8B, hardware_preset("h100"))
    shapes = [(n, n * 700 + 13 * i) for i, n in enumerate([1, 3, 3, 40, 256, 255, 7, 1] * 20)]
    ends = decode_step_ends_s(JitteredCostModel(base, RATIOS, 1), 5.0, shapes)
    starts = [5.0] + ends[:-1]
    ratios = [(b - a) / base.step_time_s(StepShape(0, n, kv, kv)) for a, b, (n, kv) in zip(starts, ends, shapes)]
    assert all(min(abs(r - m) for m in RATIOS) < 1e-6 for r in ratios)
    assert len({round(r, 6) for r in ratios}) == len(set(RATIOS))
    assert ends == decode_step_ends_s(JitteredCostModel(base, RATIOS, 1), 5.0, shapes)


def test_step_jitter_applies_only_where_measured():
    measured = LinearCostModel(0.01, 0.0, 0.0, 0.0, step_jitter=RATIOS)
    plain = LinearCostModel(0.01, 0.0, 0.0, 0.0)
    roofline = RooflineCostModel(LLAMA_8B, hardware_preset("h100"))
    jittered = with_step_jitter(measured, "profile", 3)
    assert isinstance(jittered, JitteredCostModel) and jittered.ratios == RATIOS
    assert jittered.describe()["step_jitter"]["seed"] == 3
    assert with_step_jitter(measured, "none", 3) is measured
    assert with_step_jitter(plain, "profile", 3) is plain
    assert with_step_jitter(roofline, "profile", 3) is roofline
    with pytest.raises(ValueError, match="'profile' or 'none'"):
        with_step_jitter(measured, "gaussian", 3)
    with pytest.raises(ValueError, match="> 0"):
        LinearCostModel(0.01, 0.0, 0.0, 0.0, step_jitter=(1.0, 0.0))
    with pytest.raises(ValueError, match="> 0"):
        JitteredCostModel(plain, (1.0, float("nan")), 0)


def test_profile_jitter_round_trips_and_bad_jitter_is_a_clear_error(tmp_path):
    model = LinearCostModel(0.01, 1e-4, 1e-3, 0.0, step_jitter=RATIOS)
    document = profile_json(model, {"r2": 1.0}, {"num_blocks": 64}, {}, [])
    assert document["step_jitter"]["p50"] == 1.0 and document["step_jitter"]["max"] == 2.5
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    assert load_profile(path).step_jitter == RATIOS
    for bad in ({"ratios": ["fast"]}, {"ratios": [1.0, -2.0]}, ["not", "a", "dict"]):
        path.write_text(json.dumps({**document, "step_jitter": bad}))
        with pytest.raises(ValueError, match="step.jitter"):
            load_profile(path)


def test_serving_overhead_is_charged_to_every_step_and_round_trips(tmp_path):
    plain = LinearCostModel(0.01, 1e-4, 1e-3, 0.0)
    served = LinearCostModel(0.01, 1e-4, 1e-3, 0.0, serving_overhead_s=0.002)
    for shape in (StepShape(0, 1, 50, 50), StepShape(100, 0, 100, 5050), StepShape(16, 4, 300, 500)):
        assert served.step_time_s(shape) == pytest.approx(plain.step_time_s(shape) + 0.002)
    assert served.step_time_s(StepShape(0, 0, 0, 0)) == 0.0  # no step, no handoff
    assert served.describe()["serving_overhead_s"] == 0.002
    document = profile_json(served, {"r2": 1.0}, {"num_blocks": 64}, {}, [], {"num_steps": 40})
    assert document["serving_loop"]["overhead_per_step_s"] == 0.002
    assert document["serving_loop"]["num_steps"] == 40
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    assert load_profile(path).serving_overhead_s == 0.002
    del document["serving_loop"]  # a profile from before the serving loop was timed
    path.write_text(json.dumps(document))
    assert load_profile(path).serving_overhead_s == 0.0
    path.write_text(json.dumps({**document, "serving_loop": {"overhead_per_step_s": "slow"}}))
    with pytest.raises(ValueError, match="serving_loop"):
        load_profile(path)
    for bad in (-0.001, float("nan")):
        with pytest.raises(ValueError, match="serving_overhead_s"):
            LinearCostModel(0.01, 0.0, 0.0, 0.0, serving_overhead_s=bad)


def test_speed_drift_is_each_bins_mean_step_over_the_traces():
    from kvserve.sim.cost_model import SpeedDrift

    # 4 steps per 0.25 s bin at 10 ms, then a bin with a slow stretch
    # inside (a median would hide it), then one too thin to say anything
    # (2 steps, left out of the mean too), then 10 ms again.
    steps = [(100.0 + i * 0.0625, 0.010) for i in range(8)]
    steps += [(100.5 + i * 0.0625, t) for i, t in enumerate((0.010, 0.030, 0.030, 0.010))]
    steps += [(100.75, 0.5), (100.8, 0.5)]
    steps += [(101.0 + i * 0.0625, 0.010) for i in range(4)]
    drift = SpeedDrift.of_steps(steps, bin_s=0.25, block_s=0.5)
    mean = (14 * 0.010 + 2 * 0.030) / 16  # the 16 steps in bins kept
    assert drift.factors == pytest.approx((0.010 / mean, 0.010 / mean, 0.020 / mean, 0.010 / mean))
    assert drift.block_bins == 2
    assert drift.summary()["max"] == pytest.approx(0.020 / mean) and drift.summary()["mean"] == pytest.approx(1.0)
    assert SpeedDrift.of_steps([], 0.25, 1.0) is None
    assert SpeedDrift.of_steps([(0.0, 0.01), (0.3, 0.01)], 0.25, 1.0) is None  # no bin holds 3 steps
    with pytest.raises(ValueError, match="> 0"):
        SpeedDrift(0.25, (1.0, 0.0), 1.0)
    with pytest.raises(ValueError, match="> 0"):
        SpeedDrift(0.0, (1.0,), 1.0)


def test_a_jittered_model_replays_stretches_of_the_drift_against_time():
    from kvserve.sim.cost_model import SpeedDrift, decode_step_ends_s, step_time_at_s

    base = LinearCostModel(0.01, 0.0, 0.0, 0.0)
    shape = StepShape(0, 1, 10, 10)
    drift = SpeedDrift(bin_s=1.0, factors=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), block_s=2.0)
    model = JitteredCostModel(base, (), 7, drift)
    speeds = [step_time_at_s(model, shape, t + 0.5) / 0.01 for t in range(40)]
    assert all(round(s, 9) in drift.factors for s in speeds)
    # Within a 2 s block the trace runs on: each block is two consecutive bins.
    for block in range(20):
        first, second = speeds[2 * block], speeds[2 * block + 1]
        assert second == pytest.approx(first + 1.0)
    assert len({round(s, 9) for s in speeds[::2]}) > 2  # blocks start at different places
    assert speeds == [step_time_at_s(JitteredCostModel(base, (), 7, drift), shape, t + 0.5) / 0.01
                      for t in range(40)]
    other = model.for_replica(1)  # another machine: its own stretches
    assert [step_time_at_s(other, shape, t + 0.5) / 0.01 for t in range(40)] != speeds
    assert model.for_replica(0) is model
    assert model.step_time_s(shape) == 0.01  # no start time, no drift
    assert step_time_at_s(base, shape, 3.0) == 0.01  # a model without drift is the same at every time
    # The fast-forward path: each decode step at the speed of its start.
    ends = decode_step_ends_s(JitteredCostModel(base, (), 7, drift), 0.5, [(1, 10)] * 300)
    starts = [0.5] + ends[:-1]
    assert all((b - a) / 0.01 == pytest.approx(step_time_at_s(model, shape, a) / 0.01)
               for a, b in zip(starts, ends))
    described = model.describe()
    assert described["speed_drift"]["num_bins"] == 6 and "step_jitter" not in described


def test_profile_drift_round_trips_and_a_bad_one_is_a_clear_error(tmp_path):
    from kvserve.sim.cost_model import SpeedDrift

    drift = SpeedDrift(0.25, (0.9, 1.0, 1.3), 2.0)
    model = LinearCostModel(0.01, 1e-4, 1e-3, 0.0, speed_drift=drift)
    document = profile_json(model, {"r2": 1.0}, {"num_blocks": 64}, {}, [])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    loaded = load_profile(path)
    assert loaded.speed_drift == drift
    assert isinstance(with_step_jitter(loaded, "profile", 0), JitteredCostModel)  # drift alone is applied
    assert with_step_jitter(loaded, "none", 0) is loaded
    for bad in ({"bin_s": 0.25, "block_s": 2.0, "factors": [1.0, -1.0]}, {"factors": [1.0]}, [1, 2]):
        path.write_text(json.dumps({**document, "speed_drift": bad}))
        with pytest.raises(ValueError, match="speed_drift"):
            load_profile(path)
    del document["speed_drift"]  # a profile from before the drift was timed
    path.write_text(json.dumps(document))
    assert load_profile(path).speed_drift is None
