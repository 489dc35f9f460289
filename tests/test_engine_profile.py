"""`kvserve profile` machinery on a tiny random-weight engine: the timed steps
cover decode-only, prefill-only and mixed shapes, and the fit yields a usable
cost model."""

import json

import pytest

from kvserve.sim.cost_model import fit_linear_cost_model, load_profile, profile_json
from kvserve.engine.profile import ProfileGrid, time_engine_steps

from .tiny_models import tiny_engine, tiny_llama


def test_time_engine_steps_covers_the_grid_and_fits():
    core = tiny_engine(tiny_llama(), num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16)
    grid = ProfileGrid(prefill_tokens=(0, 8, 32), decode_batch=(0, 1, 4), context=(8, 40),
                       repeats=2, time_budget_s=60)
    samples, jitter = time_engine_steps(core, grid)
    assert jitter == []  # the median of two repeats is one of them: no spread to keep
    assert not core.has_unfinished()
    shapes = [s for s, _ in samples]
    assert any(s.num_prefill_tokens == 0 and s.num_decode_seqs == 4 for s in shapes)
    assert any(s.num_prefill_tokens == 32 and s.num_decode_seqs == 0 for s in shapes)
    assert any(s.num_prefill_tokens == 8 and s.num_decode_seqs == 1 for s in shapes)
    # Decode at context 40 reads at least 41 KV tokens per sequence.
    assert max(s.kv_tokens_read for s in shapes if s.num_prefill_tokens == 0) >= 4 * 41
    assert all(t > 0 for _, t in samples)
    model, stats = fit_linear_cost_model(samples)
    assert stats["num_samples"] == len(samples)
    assert all(model.step_time_s(s) > 0 for s in shapes)


def test_decode_only_steps_are_timed_after_settling_decode_steps():
    """Each batch's decode-only steps are timed only after DECODE_SETTLE_STEPS
    untimed decode steps of that batch (not right after the prompt steps
    before them): every sequence has read that many more positions by then."""
    from kvserve.engine.profile import DECODE_SETTLE_STEPS

    core = tiny_engine(tiny_llama(), num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16)
    context = 8
    samples, _ = time_engine_steps(core, ProfileGrid(prefill_tokens=(0, 8), decode_batch=(0, 1, 4),
                                                     context=(context,), repeats=1, time_budget_s=60))
    decode_only = [s for s, _ in samples if s.num_prefill_tokens == 0]
    assert {s.num_decode_seqs for s in decode_only} == {1, 4}
    for shape in decode_only:
        assert shape.kv_tokens_read >= shape.num_decode_seqs * (context + 1 + DECODE_SETTLE_STEPS)


def test_profile_document_is_accepted_by_simulate(tmp_path):
    core = tiny_engine(tiny_llama(), num_blocks=128, max_num_batched_tokens=64)
    samples, _ = time_engine_steps(core, ProfileGrid((0, 8, 16), (0, 1, 2), (8, 24), 2, 30.0))
    model, stats = fit_linear_cost_model(samples, engine={"num_blocks": 128})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json(model, stats, {"num_blocks": 128}, {}, samples)))
    loaded = load_profile(path)
    assert loaded.intercept_s == pytest.approx(model.intercept_s)
    assert dict(loaded.engine) == {"num_blocks": 128}


def test_token_sweep_times_each_size_alone_and_becomes_the_curve(tmp_path):
    from kvserve.engine.profile import swept_tokens

    core = tiny_engine(tiny_llama(), num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16)
    grid = ProfileGrid(prefill_tokens=(0, 8), decode_batch=(0, 1, 4), context=(8, 40), repeats=2,
                       time_budget_s=60, tokens=(1, 4, 16, 64, 128))
    samples, _ = time_engine_steps(core, grid)
    assert not core.has_unfinished()
    alone = {s.num_tokens for s, _ in samples if s.num_decode_seqs == 0}
    assert {1, 4, 16, 64} <= alone
    # 128 exceeds the 64-token budget: it would run as two chunks, so it is skipped.
    assert swept_tokens(samples, grid) == (1, 4, 16, 64)
    model, stats = fit_linear_cost_model(samples, token_knots=swept_tokens(samples, grid))
    assert model.token_knots == (1, 4, 16, 64)
    assert all(t >= 0 for t in model.token_knot_s) and max(model.token_knot_s) > 0
    assert all(model.step_time_s(s) > 0 for s, _ in samples)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json(model, stats, {"num_blocks": 256}, {}, samples)))
    assert load_profile(path).token_knot_s == model.token_knot_s


def _row_blocks_step_s(num_tokens: int) -> float:
    """A step whose kernels work in blocks of 16 rows: a size just past a
    block pays for the next one (the AMX Xeon's prompt steps, about: 32
    tokens 24.6 ms, 33 tokens 26.9 ms)."""
    return 6e-3 + 0.45e-3 * num_tokens + 1.5e-3 * -(-num_tokens // 16)


def _curve_errors(sweep: tuple[int, ...], limit: int) -> list[float]:
    """Relative error, at every prompt size up to `limit`, of the model fitted
    to one prompt step of each swept size (what the sweep times)."""
    from kvserve.sim.cost_model import StepShape

    def shape(n: int) -> StepShape:
        return StepShape(n, 0, n, n * (n + 1) // 2)

    sizes = tuple(n for n in sweep if n <= limit)
    samples = [(shape(n), _row_blocks_step_s(n)) for n in sizes]
    # and the grid's decode steps, which the context's terms are fitted to
    samples += [(StepShape(0, d, d * (c + 1), d * (c + 1)), _row_blocks_step_s(d) + 2e-6 * d * (c + 1))
                for d in (1, 2, 4, 8, 16) for c in (32, 256, 768)]
    model, _ = fit_linear_cost_model(samples, token_knots=sizes)
    return [model.step_time_s(shape(n)) / _row_blocks_step_s(n) - 1 for n in range(1, limit + 1)]


def test_the_default_sweep_follows_a_staircase_of_row_blocks():
    """The default sizes are knots close enough that a curve through them
    prices every prompt size within 4% of a staircase step time, where the
    earlier sparse sweep read sizes just past a block 5-8% low (a short
    workload's TTFT simulated that much low)."""
    from kvserve.engine.profile import DEFAULT_SWEEP_TOKENS

    assert max(map(abs, _curve_errors(DEFAULT_SWEEP_TOKENS, 256))) < 0.04
    sparse = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert min(_curve_errors(sparse, 256)) < -0.05


def test_repeats_over_their_median_are_kept_as_step_jitter():
    core = tiny_engine(tiny_llama(), num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16)
    grid = ProfileGrid(prefill_tokens=(0, 8), decode_batch=(0, 1, 4), context=(8, 24), repeats=3,
                       time_budget_s=60, tokens=(1, 4, 16))
    samples, jitter = time_engine_steps(core, grid)
    # Every grid point is timed 3 times: three ratios each, one of them its
    # median (exactly 1), one at most 1, one at least 1.
    assert len(jitter) == 3 * len(samples)
    for i in range(0, len(jitter), 3):
        group = sorted(jitter[i:i + 3])
        assert group[0] <= 1.0 == group[1] <= group[2]
    assert all(r > 0 for r in jitter)


def test_profile_command_writes_a_curve_that_simulate_reads(tmp_path, capsys):
    from kvserve.cli import main

    from .test_loader import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "model", "llama")
    out = tmp_path / "profile.json"
    rc = main(["profile", "--model", str(folder), "--kv-cache-memory", "4MiB", "--device", "cpu",
               "--max-num-batched-tokens", "32", "--tokens", "1,4,16,32,64", "--prefill-tokens", "0,8",
               "--decode-batch", "0,1,2", "--context", "8,24", "--repeats", "3", "--drift-seconds", "1",
               "--out", str(out)])
    assert rc == 0
    document = json.loads(out.read_text())
    assert document["token_curve"]["tokens"] == [1, 4, 16, 32]  # 64 > the 32-token budget
    assert document["step_jitter"]["num_ratios"] == len(document["step_jitter"]["ratios"]) \
        == 3 * len(document["samples"])
    printed = capsys.readouterr().out
    assert "curve: 1:" in printed and "step jitter" in printed and "serving loop overhead" in printed
    drift = document["speed_drift"]
    # 1 s of back-to-back steps in 50 ms bins (one left out where a request
    # boundary leaves it thin is the machine's, not an error).
    assert f"speed drift ({drift['num_bins']} bins of 0.05 s)" in printed
    assert drift["num_bins"] == len(drift["factors"]) and 15 <= drift["num_bins"] <= 20
    # Each bin's mean step over the whole trace's: their mean is 1 up to
    # the bins' unequal step counts; how far they spread is the machine's,
    # so only the normalization is checked here (SpeedDrift.of_steps is
    # tested exactly in test_sim_cost_model.py).
    assert 0.8 < drift["mean"] < 1.25 and 0.5 < drift["p50"] < 2.0
    loop = document["serving_loop"]
    assert loop["num_steps"] == 6 * 23 and loop["overhead_per_step_s"] > 0  # 6 requests of 24 tokens
    rc = main(["simulate", "--model", str(folder), "--hardware", str(out), "--workload", "short",
               "--num-requests", "6", "--rate", "2", "--out", str(tmp_path / "sim")])
    assert rc == 0
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert report["summary"]["outcomes"]["success"] == 6
    applied = report["config"]["simulation"]["cost_model"]
    assert applied["step_jitter"]["num_ratios"] == document["step_jitter"]["num_ratios"]
    assert applied["step_jitter"]["seed"] == 0
    assert applied["serving_overhead_s"] == loop["overhead_per_step_s"]
    assert applied["speed_drift"]["num_bins"] == drift["num_bins"] and applied["speed_drift"]["seed"] == 0
    with pytest.raises(SystemExit):
        main(["profile", "--tokens", "1,x"])
    with pytest.raises(ValueError, match=">= 1"):
        ProfileGrid(tokens=(0, 4))


def test_the_serving_loop_times_each_decode_step_through_the_async_engine():
    import random

    from kvserve.engine.profile import time_serving_loop

    core = tiny_engine(tiny_llama(), num_blocks=128, max_num_batched_tokens=64)
    timing = time_serving_loop(core, random.Random(0), num_requests=3, prompt_tokens=8, new_tokens=6)
    assert not core.has_unfinished()
    assert timing.num_steps == 3 * 5  # one decode step per token after each request's first
    # The loop's own work between steps (the turn's bookkeeping, the handoff) is never free.
    assert timing.mean_step_s > 0 and timing.overhead_per_step_s > 0 and timing.predicted_step_s is None
    assert timing.overhead_per_step_s == pytest.approx(timing.mean_period_s - timing.mean_step_s)


def test_the_serving_overhead_is_what_a_token_takes_beyond_the_fitted_step():
    """Against a step model, the overhead is the mean period over what the
    model gives the very steps the loop ran (their exact shapes): a served
    step's own slowdown beside the event loop counts, not only the handoff."""
    import random

    from kvserve.engine.profile import time_serving_loop

    core = tiny_engine(tiny_llama(), num_blocks=128, max_num_batched_tokens=64)
    shapes = []

    def model(shape):  # a fitted step that grows with the context read
        shapes.append(shape)
        return 1e-5 * shape.kv_tokens_read

    timing = time_serving_loop(core, random.Random(0), num_requests=2, prompt_tokens=8, new_tokens=6,
                               step_model=model)
    assert [(s.num_decode_seqs, s.num_prefill_tokens) for s in shapes] == [(1, 0)] * (2 * 5)
    assert sorted(s.kv_tokens_read for s in shapes) == sorted([9, 10, 11, 12, 13] * 2)  # prompt 8, one more a step
    assert timing.predicted_step_s == pytest.approx(1e-5 * 11)
    assert timing.overhead_per_step_s == pytest.approx(timing.mean_period_s - timing.predicted_step_s)
    # A model slower than the loop leaves no negative overhead.
    slow = time_serving_loop(core, random.Random(0), num_requests=1, prompt_tokens=8, new_tokens=6,
                             step_model=lambda shape: 10.0)
    assert slow.overhead_per_step_s == 0.0


def test_the_speed_drift_is_a_trace_of_back_to_back_decode_steps_as_long_as_asked():
    import random

    from kvserve.engine.profile import time_speed_drift

    core = tiny_engine(tiny_llama(), num_blocks=128, max_num_batched_tokens=64)
    drift = time_speed_drift(core, random.Random(0), 0.6, bin_s=0.1, block_s=0.3)
    assert not core.has_unfinished()  # the request the deadline cut is aborted
    assert len(drift.factors) == 6 and drift.block_bins == 3
    assert min(drift.factors) <= 1.0 <= max(drift.factors)  # each bin over the whole trace's median step


def test_profile_refuses_a_negative_serving_loop(tmp_path, capsys):
    from kvserve.cli import main

    from .test_loader import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "model", "llama")
    rc = main(["profile", "--model", str(folder), "--kv-cache-memory", "4MiB", "--device", "cpu",
               "--serving-loop-requests", "-1", "--out", str(tmp_path / "p.json")])
    assert rc == 2 and "--serving-loop-requests must be >= 0" in capsys.readouterr().err
    rc = main(["profile", "--model", str(folder), "--kv-cache-memory", "4MiB", "--device", "cpu",
               "--drift-seconds", "-1", "--out", str(tmp_path / "p.json")])
    assert rc == 2 and "--drift-seconds must be >= 0" in capsys.readouterr().err
