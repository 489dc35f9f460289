"""The runner of a simulated replica (`kvserve serve --simulate`): stands in
for the torch model runner with the simulator's cost model, on the wall
clock. Each step sleeps the time the cost model gives its shape (sleep,
never spin: eight simulated replicas share a 2-core machine) and samples,
for every chunk that reaches its request's end, a token from a fixed
vocabulary of ordinary words, never EOS, from its own seeded generator.
With speculation (sim/speculation.py's SimSpeculation), the engine's own
speculator gives requests placeholder drafts (`draft_token_id`) under its
policy; here each verification's accepted count is drawn at the
acceptance rate, and the step also takes the proposer's time.

The engine's own work around a step (schedule, update, detokenize, and
the loop's handoff of the outputs to the event loop, which a profile's
serving overhead models) is counted inside the modelled step when steps
run back to back: a step starts where the previous one ended, not when
`execute` is called.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvserve.sim.cost_model import CostModel, chunk_shape
from kvserve.sim.speculation import SimSpeculation

# Steps closer than this to the previous one's end run back to back: the
# gap is the engine's own work, which the step time already covers.
BACK_TO_BACK_S = 0.005
WORDS = ("the of and to in is was for that with as on by at from his an were are which this be or has had not "
         "but one first new time year also their more two people after who they its been other when some over "
         "city there all into many most state can only during while world where part").split()


class SampledTokens(NamedTuple):
    """What the engine reads of a runner's step (SamplerOutput's fields)."""

    token_ids: dict[str, int]
    logprobs: dict
    num_accepted: dict[str, int] | None = None  # verifying requests' accepted drafts
    accepted_logprobs: dict | None = None


class NoWeights:
    """The runner's `model` as the server reads it: a simulated replica holds
    no weights (the kvserve_weight_bytes gauge stays empty)."""

    @staticmethod
    def weight_formats() -> dict[str, int]:
        return {}


class SimulatedRunner:
    num_graph_captures = 0  # no CUDA graphs to capture
    model = NoWeights()

    def __init__(self, cost_model: CostModel, num_blocks: int, vocabulary: Sequence[int], seed: int = 0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 speculation: SimSpeculation | None = None) -> None:
        if num_blocks < 1 or not vocabulary:
            raise ValueError("a simulated runner needs at least one KV block and one token to emit")
        self.cost_model = cost_model
        self.speculation = speculation
        # The drafts' token (the engine's speculator proposes k of it); None: no speculation.
        self.draft_token_id = None if speculation is None else vocabulary[0]
        self._spec_rng = random.Random(None if speculation is None else speculation.seed)
        self.num_blocks = num_blocks
        self.vocabulary = list(vocabulary)
        self.clock, self.sleep = clock, sleep
        self._rng = random.Random(seed)
        self._last_end_s: float | None = None
        self.busy_s = 0.0  # modelled step time so far

    @staticmethod
    def memory_bytes() -> dict[str, int]:
        """Nothing is resident: a simulated replica holds no weights and no KV tensor."""
        return {"weights": 0, "kv_cache": 0, "workspace": 0}

    def execute(self, scheduler_output, sampling_states=None, draft_probs=None,
                num_draft_passes: int = 0) -> SampledTokens:
        """One step: sleep its modelled time and the proposer's
        (`num_draft_passes`: the longest draft the engine's speculator
        proposed for this step, priced as asked, as the simulator does, even
        where the scheduler trimmed or dropped drafts for want of budget or
        room), sample a word for each chunk that samples, draw how many of
        each verification's drafts are accepted. sampling_states (the
        engine's per-request sampling: penalties, grammars) are not applied:
        a simulated replica emits words, not constrained output; draft_probs
        (a draft model's distributions) are not needed."""
        chunks = scheduler_output.chunks
        if not chunks:
            return SampledTokens({}, {})
        step_s = self.cost_model.step_time_s(chunk_shape(chunks))
        accepted = self._judge(chunks)
        if self.speculation is not None:
            step_s += self.speculation.proposer_time_s(num_draft_passes)
        now = self.clock()
        last = self._last_end_s
        start = last if last is not None and 0.0 <= now - last <= BACK_TO_BACK_S else now
        end = start + step_s
        if end > now:
            self.sleep(end - now)
        self._last_end_s = max(end, now)
        self.busy_s += step_s
        pick = self._rng.choice
        return SampledTokens({c.request.request_id: pick(self.vocabulary) for c in chunks if c.samples}, {},
                             accepted, {})

    def _judge(self, chunks) -> dict[str, int]:
        """request_id -> drafts accepted, for the step's verifying chunks."""
        if self.speculation is None:
            return {}
        return {c.request.request_id: self.speculation.num_accepted(self._spec_rng, len(c.spec_token_ids))
                for c in chunks if c.spec_token_ids}


def word_vocabulary(encode: Callable[[str], list[int]], excluded: set[int]) -> list[int]:
    """One token id per common word (its first token, with a leading
    space), none of them special or EOS."""
    ids = []
    for word in WORDS:
        tokens = encode(" " + word)
        if tokens and tokens[0] not in excluded and tokens[0] not in ids:
            ids.append(tokens[0])
    return ids
