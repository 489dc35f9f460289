"""`kvserve profile` machinery on a tiny random-weight engine: the timed steps
cover decode-only, prefill-only and mixed shapes, and the fit yields a usable
cost model."""

import json

import pytest

from kvserve.sim.cost_model import fit_linear_cost_model, load_profile, profile_json
from kvserve.sim.profile import ProfileGrid, time_engine_steps

from .tiny_models import tiny_engine, tiny_llama


def test_time_engine_steps_covers_the_grid_and_fits():
    core = tiny_engine(tiny_llama(), num_blocks=256, max_num_batched_tokens=64, max_num_seqs=16)
    grid = ProfileGrid(prefill_tokens=(0, 8, 32), decode_batch=(0, 1, 4), context=(8, 40),
                       repeats=2, time_budget_s=60)
    samples = time_engine_steps(core, grid)
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


def test_profile_document_is_accepted_by_simulate(tmp_path):
    core = tiny_engine(tiny_llama(), num_blocks=128, max_num_batched_tokens=64)
    samples = time_engine_steps(core, ProfileGrid((0, 8, 16), (0, 1, 2), (8, 24), 2, 30.0))
    model, stats = fit_linear_cost_model(samples, engine={"num_blocks": 128})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json(model, stats, {"num_blocks": 128}, {}, samples)))
    loaded = load_profile(path)
    assert loaded.intercept_s == pytest.approx(model.intercept_s)
    assert dict(loaded.engine) == {"num_blocks": 128}
