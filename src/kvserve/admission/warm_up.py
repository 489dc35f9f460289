"""The measured warm-up before serving: throwaway requests through the engine,
timing steps of varied shapes so admission's step-time fit exists before the
first real request (a cold server would admit a burst on guesses and then
make it wait).

Runs on the calling thread, before the engine thread starts. `kvserve
simulate`'s replicas run the same warm-up over their scheduler, each step
priced by the cost model (sim/replica.py), so a simulated replica starts
with the fit a live one starts with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

from kvserve.admission.step_time import MIN_FIT_STEPS
from kvserve.contract import Request, RequestFactory, SamplingParams

# Measured warm-up steps: admission fits the step time from MIN_FIT_STEPS
# (decayed weight) on; a few more leave margin for the decay.
WARM_UP_MIN_STEPS = MIN_FIT_STEPS + 4
# Prefix-cache namespace of warm-up requests: no served request hashes into
# it, so nothing a warm-up computes can ever be a real prefix hit.
WARM_UP_NAMESPACE = "kvserve-warm-up"
# Prefill lengths of the warm-up's chunks, as shares of the prefill room; the
# order mixes long and short chunks so prefill tokens do not grow with the
# number of decodes beside them (the fit must tell the two factors apart).
WARM_UP_PREFILL_SHARES = (0.125, 1.0, 0.25, 0.5, 0.0625, 0.75)
# Share of the KV cache the warm-up may hold at once.
WARM_UP_KV_SHARE = 0.75
# The longest warm-up prefill chunk should span at least this many blocks.
WARM_UP_MIN_PREFILL_BLOCKS = 4


class WarmUpStep(Protocol):
    """What a step reports to the warm-up (engine.core.StepResult)."""

    @property
    def num_decode_seqs(self) -> int: ...

    @property
    def num_prefill_tokens(self) -> int: ...

    @property
    def captured_graph(self) -> bool: ...


class WarmUpCore(Protocol):
    """What the warm-up drives: an EngineCore, or a simulated replica's
    scheduler (sim/replica.py, SimulatedWarmUpCore)."""

    @property
    def block_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def add_request(self, request: Request) -> None: ...

    def step(self) -> WarmUpStep: ...

    def abort(self, request_id: str) -> object: ...

    def reset_prefix_cache(self) -> None: ...


class MeasuredStep(NamedTuple):
    """One timed engine step: its shape and its wall time."""

    num_decode_seqs: int
    num_prefill_tokens: int
    step_s: float


def warm_up(core: WarmUpCore, num_steps: int = 12, max_decode_seqs: int = 16,
            time_budget_s: float = 10.0, timer: Callable[[], float] = time.perf_counter) -> list[MeasuredStep]:
    """Time at least `num_steps` engine steps of varied shapes on an idle
    engine. The ramp adds one request per step (decode batches of 0..N-1
    sequences beside prefill chunks of varied length, N <= max_decode_seqs),
    then decode-only steps at N and N/2 sequences. One unmeasured step first
    pays one-time costs (allocation, kernel selection); a step that captured
    a CUDA graph is not measured (its time holds the capture). The ramp stops
    early past half of `time_budget_s` (of `timer`: the wall clock, or a
    simulated replica's priced steps).

    Leaves no trace: the requests are aborted, their prefix-cache entries
    dropped, and the prefix-cache and preemption totals zeroed, so KV usage
    and every counter start at zero."""
    plan = _WarmUpPlan(core, num_steps, max_decode_seqs)
    requests = RequestFactory(core.eos_token_ids, WARM_UP_NAMESPACE, core.clock, id_prefix="warm-up-")
    added: list[str] = []
    measured: list[MeasuredStep] = []

    def add() -> None:
        request = requests.build(plan.prompt(len(added)), plan.params)
        core.add_request(request)
        added.append(request.request_id)

    try:
        add()
        core.step()  # unmeasured: one-time costs
        deadline = timer() + time_budget_s / 2
        while len(added) < plan.num_seqs and timer() < deadline:
            add()
            _timed_step(core, measured, timer)
        for i in range(max(plan.num_decode_steps, num_steps - len(measured))):
            if i == plan.num_decode_steps // 2:  # halve the batch for a second decode size
                for request_id in added[len(added) // 2 + 1:]:
                    core.abort(request_id)
            _timed_step(core, measured, timer)
    finally:
        for request_id in added:
            core.abort(request_id)
        core.reset_prefix_cache()
    return measured


def _timed_step(core: WarmUpCore, measured: list[MeasuredStep], timer: Callable[[], float]) -> None:
    """One step, appended to `measured` unless it paid a one-off graph capture."""
    t0 = timer()
    result = core.step()
    step_s = timer() - t0
    if not result.captured_graph:
        measured.append(MeasuredStep(result.num_decode_seqs, result.num_prefill_tokens, step_s))


class _WarmUpPlan:
    """Sizes of the warm-up: how many sequences, their prompts and outputs,
    within the engine's batch, token budget, context and a share of its KV."""

    def __init__(self, core: WarmUpCore, num_steps: int, max_decode_seqs: int) -> None:
        block_size = core.block_size
        self.num_decode_steps = 4
        num_seqs = max(1, min(core.max_num_seqs, max_decode_seqs))
        # Every request outlives the warm-up: one token per step it is in.
        max_tokens = num_seqs + max(self.num_decode_steps, num_steps) + 2
        kv_tokens = int(core.num_kv_blocks * WARM_UP_KV_SHARE) * block_size
        while True:
            step_room = core.max_num_batched_tokens - num_seqs
            room = min(step_room, core.max_model_len - max_tokens - 1,
                       kv_tokens // num_seqs - max_tokens - block_size)  # a block of rounding each
            # Fewer sequences rather than prefill chunks too short to measure.
            if room >= min(step_room, WARM_UP_MIN_PREFILL_BLOCKS * block_size) or num_seqs == 1:
                break
            num_seqs //= 2
            max_tokens = num_seqs + max(self.num_decode_steps, num_steps) + 2
        self.num_seqs = num_seqs
        self.room = max(1, room)
        self.vocab_size = core.vocab_size
        self.params = SamplingParams(max_tokens=max(1, max_tokens), temperature=0.0, ignore_eos=True)

    def prompt(self, index: int) -> list[int]:
        share = WARM_UP_PREFILL_SHARES[index % len(WARM_UP_PREFILL_SHARES)]
        length = max(1, int(self.room * share))
        # Distinct tokens per request: no warm-up prompt is a prefix hit on another.
        return [(index * 7919 + j * 31 + 1) % self.vocab_size for j in range(length)]
