"""The when-to-speculate policy: a request speculates while its acceptance
beats a bar that rises with the step's batch; under it, it probes with one
draft, after a wait that doubles with each failed probe."""

from kvserve.config import SpeculativeConfig
from kvserve.scheduler.speculation import SpeculationPolicy


def steps_until_allowed(policy: SpeculationPolicy, rid: str, num_drafts: int = 4,
                        num_decode_seqs: int = 1) -> tuple[int, int]:
    """Steps asked until the policy allows drafts, and how many it allows."""
    for step in range(1, 10_000):
        allowed = policy.drafts_allowed(rid, num_drafts, num_decode_seqs)
        if allowed:
            return step, allowed
    raise AssertionError("never allowed")


def measured(policy: SpeculationPolicy, rid: str, num_proposed: int, num_accepted: int) -> SpeculationPolicy:
    """The request's EWMA settled on num_accepted / num_proposed (to 1e-6)."""
    for _ in range(24):
        policy.record(rid, num_proposed, num_accepted)
    return policy


def test_failed_probes_back_off_exponentially_and_an_accepted_one_resets():
    policy = SpeculationPolicy(SpeculativeConfig(probe_interval_steps=16))
    assert policy.drafts_allowed("r", 4, 1) == 4  # unmeasured: speculates
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
    assert policy.drafts_allowed("r", 4, 1) == 4
    for _ in range(2):  # 0.5 -> 0.25 -> 0.125: under again, the wait starts over
        policy.record("r", 4, 0)
    assert steps_until_allowed(policy, "r") == (16, 1)


def test_a_due_probe_waits_for_a_step_that_has_drafts():
    policy = SpeculationPolicy(SpeculativeConfig(probe_interval_steps=4))
    for _ in range(3):
        policy.record("r", 4, 0)
    assert steps_until_allowed(policy, "r") == (4, 1)
    # the proposer found nothing: no verification, so the probe stays due
    assert policy.drafts_allowed("r", 4, 1) == 1
    assert policy.drafts_allowed("r", 0, 1) == 0  # nothing to verify (e.g. max_tokens reached)


def test_the_acceptance_bar_rises_with_the_batch():
    """With the default 0.25 at batch 1 the bar is 0.40, 0.57, 0.73, 0.84 at
    batch 2, 4, 8, 16: a chat-like request (0.375 of drafts accepted) drafts
    only at batch 1, a copying one (0.83) up to batch 8."""
    config = SpeculativeConfig(probe_interval_steps=1000)
    chat = measured(SpeculationPolicy(config), "chat", 8, 3)
    assert [chat.drafts_allowed("chat", 4, b) for b in (1, 2, 4, 8)] == [4, 0, 0, 0]
    copying = measured(SpeculationPolicy(config), "copy", 6, 5)
    assert [copying.drafts_allowed("copy", 4, b) for b in (1, 2, 4, 8, 16)] == [4, 4, 4, 4, 0]
    # Each side of the bar at batch 4 (0.571): 0.5625 under, 0.5833 over.
    assert measured(SpeculationPolicy(config), "r", 16, 9).drafts_allowed("r", 4, 4) == 0
    assert measured(SpeculationPolicy(config), "r", 12, 7).drafts_allowed("r", 4, 4) == 4
    # A draft costs its row whatever k is: the bar is the same for 1 draft or 16.
    assert [copying.drafts_allowed("copy", k, 8) for k in (1, 16)] == [1, 16]
    assert [copying.drafts_allowed("copy", k, 16) for k in (1, 16)] == [0, 0]


def test_a_bar_of_zero_always_speculates_and_the_batch_limit_still_holds():
    always = measured(SpeculationPolicy(SpeculativeConfig(min_acceptance_rate=0.0)), "r", 4, 0)
    assert [always.drafts_allowed("r", 4, b) for b in (1, 64)] == [4, 4]
    limited = SpeculationPolicy(SpeculativeConfig(disable_by_batch_size=4))
    assert [limited.step_allows(b) for b in (1, 4, 5)] == [True, True, False]
    assert SpeculationPolicy(SpeculativeConfig()).step_allows(256)  # no limit by default


def test_a_request_under_the_bar_speculates_again_once_the_batch_is_small_enough():
    policy = measured(SpeculationPolicy(SpeculativeConfig(probe_interval_steps=1000)), "r", 2, 1)  # 0.5
    assert policy.drafts_allowed("r", 4, 4) == 0  # under 0.57
    assert policy.drafts_allowed("r", 4, 2) == 4  # over 0.40: no probe wait


def test_a_probe_fails_against_the_bar_of_its_own_step():
    """At batch 8 (bar 0.73) a rate of 0.6 probes; a failed probe (0.3, 0.15,
    ...) doubles the wait even while the rate is over batch 1's bar."""
    policy = measured(SpeculationPolicy(SpeculativeConfig(probe_interval_steps=16)), "r", 10, 6)
    waits = []
    for _ in range(3):
        wait, allowed = steps_until_allowed(policy, "r", num_decode_seqs=8)
        assert allowed == 1
        waits.append(wait)
        policy.record("r", 1, 0)
    assert waits == [16, 32, 64]
    # An accepted probe at batch 8 (0.075 -> 0.54, still under 0.73): the
    # next probe comes at the next step; a rejected one doubles the wait again.
    wait, _ = steps_until_allowed(policy, "r", num_decode_seqs=8)
    policy.record("r", 1, 1)
    assert wait == 128 and policy.drafts_allowed("r", 4, 8) == 1
    policy.record("r", 1, 0)
    assert steps_until_allowed(policy, "r", num_decode_seqs=8) == (256, 1)


def test_a_copying_request_recovers_from_one_miss_at_batch_8_in_two_probes():
    """At 0.9, a verification of 4 with none accepted drops the rate to 0.45:
    under batch 8's bar (0.73). One accepted probe (0.72) is not enough; the
    next comes at once, and a second (0.86) has it speculate again."""
    policy = measured(SpeculationPolicy(SpeculativeConfig(probe_interval_steps=16)), "r", 10, 9)
    policy.record("r", 4, 0)
    assert steps_until_allowed(policy, "r", num_decode_seqs=8) == (16, 1)
    policy.record("r", 1, 1)
    assert policy.drafts_allowed("r", 4, 8) == 1
    policy.record("r", 1, 1)
    assert policy.drafts_allowed("r", 4, 8) == 4
