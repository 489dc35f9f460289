"""The simulated replica's runner: steps take the cost model's time (slept,
back to back counted from the previous step's end), tokens come from the
fixed vocabulary and only for chunks that sample."""

from __future__ import annotations

from types import SimpleNamespace

from kvserve.sim.cost_model import LinearCostModel, chunk_shape
from kvserve.sim.simulated_runner import SimulatedRunner, word_vocabulary

COST = LinearCostModel(intercept_s=0.05, per_prefill_token_s=0.001, per_decode_seq_s=0.01,
                       per_kv_token_read_s=0.0, per_attention_pair_s=0.0)


class FakeTime:
    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def chunk(rid: str, start: int, n: int, samples: bool):
    return SimpleNamespace(request=SimpleNamespace(request_id=rid), start=start, num_new_tokens=n, samples=samples,
                           spec_token_ids=(),
                           is_decode=start > 0 and n == 1)


def test_steps_sleep_the_modelled_time_and_sample_from_the_vocabulary():
    t = FakeTime()
    runner = SimulatedRunner(COST, 64, [11, 12, 13], seed=1, clock=t.clock, sleep=t.sleep)
    prefill = [chunk("a", 0, 100, True), chunk("b", 0, 50, False)]
    out = runner.execute(SimpleNamespace(chunks=prefill))
    assert len(t.slept) == 1 and abs(t.slept[0] - COST.step_time_s(chunk_shape(prefill))) < 1e-9
    assert t.slept[0] > 0.1
    assert set(out.token_ids) == {"a"} and out.token_ids["a"] in (11, 12, 13)  # b is mid-prefill
    # The engine's own 2 ms between steps is inside the next step's modelled time.
    t.now += 0.002
    decode = [chunk("a", 100, 1, True)]
    runner.execute(SimpleNamespace(chunks=decode))
    assert abs(t.slept[-1] - (COST.step_time_s(chunk_shape(decode)) - 0.002)) < 1e-9
    # After an idle second the step starts when it is called.
    t.now += 1.0
    runner.execute(SimpleNamespace(chunks=decode))
    assert abs(t.slept[-1] - COST.step_time_s(chunk_shape(decode))) < 1e-9
    assert runner.execute(SimpleNamespace(chunks=[])).token_ids == {}


def test_vocabulary_skips_special_and_repeated_tokens():
    table = {" the": [5, 9], " of": [6], " and": [5], " to": [0]}
    ids = word_vocabulary(lambda text: table.get(text, []), excluded={0})
    assert ids == [5, 6]
