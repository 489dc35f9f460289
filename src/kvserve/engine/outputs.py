"""RequestOutput: what the engine hands out for a request after a step, the
whole text so far plus this step's delta, so a stream can send deltas and a
batch caller can read the final record."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.contract import RequestTimestamps
from kvserve.latency import Latency, derive_latency
from kvserve.model.sampler import TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # all output text so far (ends before a stop string)
    new_text: str  # added by this step
    token_ids: list[int]  # all output tokens so far
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # The request's live timestamps on the engine clock (not a copy).
    timestamps: RequestTimestamps
    # Per output token, when the request asked for logprobs (else None):
    # `logprobs` covers token_ids, `new_logprobs` covers new_token_ids.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = field(default=None)

    @property
    def latency(self) -> Latency:
        """TTFT / TPOT / ITL / E2E / queue time, by the shared definitions."""
        stamps = self.timestamps
        return derive_latency(start=stamps.arrival, token_events=[(t, 1) for t in stamps.token_times],
                              end=stamps.finished, scheduled=stamps.scheduled)

    @property
    def metrics(self) -> Latency:
        """design.md's name for `latency`."""
        return self.latency
