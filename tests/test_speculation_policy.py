"""The when-to-speculate policy: a request under the acceptance threshold
probes with one draft, after a wait that doubles with each failed probe."""

from kvserve.config import SpeculativeConfig
from kvserve.scheduler.speculation import SpeculationPolicy


def steps_until_allowed(policy: SpeculationPolicy, rid: str, num_drafts: int = 4) -> tuple[int, int]:
    """Steps asked until the policy allows drafts, and how many it allows."""
    for step in range(1, 10_000):
        allowed = policy.drafts_allowed(rid, num_drafts)
        if allowed:
            return step, allowed
    raise AssertionError("never allowed")


def test_failed_probes_back_off_exponentially_and_an_accepted_one_resets():
    policy = SpeculationPolicy(SpeculativeConfig(probe_interval_steps=16))
    assert policy.drafts_allowed("r", 4) == 4  # unmeasured: speculates
    for _ in range(3):  # EWMA 1 -> 0.5 -> 0.25 -> 0.125
        policy.record("r", 4, 0)
    waits = []
    for _ in range(6):
        wait, allowed = steps_until_allowed(policy, "r")
        assert allowed == 1  # a probe verifies one draft
        waits.append(wait)
        policy.record("r", 1, 0)
    assert waits == [16, 32, 64, 128, 256, 256]
    _, allowed = steps_until_allowed(policy, "r")
    policy.record("r", allowed, 1)  # the probe's draft was accepted: rate 0.5
    assert policy.drafts_allowed("r", 4) == 4
    for _ in range(2):  # 0.5 -> 0.25 -> 0.125: under again, the wait starts over
        policy.record("r", 4, 0)
    assert steps_until_allowed(policy, "r") == (16, 1)


def test_a_due_probe_waits_for_a_step_that_has_drafts():
    policy = SpeculationPolicy(SpeculativeConfig(probe_interval_steps=4))
    for _ in range(3):
        policy.record("r", 4, 0)
    assert steps_until_allowed(policy, "r") == (4, 1)
    # the proposer found nothing: no verification, so the probe stays due
    assert policy.drafts_allowed("r", 4) == 1
    assert policy.drafts_allowed("r", 0) == 0  # nothing to verify (e.g. max_tokens reached)
