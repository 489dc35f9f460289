"""The request log: one JSON line per finished request on the
`kvserve.requests` logger (`kvserve serve --request-log`), with ids, tenant,
priority, token counts, how it ended and its latencies by the shared
definitions; the prompt and output text only with `--log-prompts`, since
they may hold personal data."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from kvserve.latency import derive_latency


class RequestLog:
    """One JSON line per finished request on the `kvserve.requests` logger:
    ids, tenant, priority, token counts, outcome, latencies; the prompt and
    output text only with `log_prompts` (they may hold personal data)."""

    def __init__(self, model_name: str, detokenize: Callable[[list[int]], str], log_prompts: bool = False) -> None:
        self.log = logging.getLogger("kvserve.requests")
        self.model_name = model_name
        self.detokenize = detokenize
        self.log_prompts = log_prompts

    def finished(self, done) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        ts = done.timestamps
        latency = derive_latency(ts.arrival, [(t, 1) for t in ts.token_times], ts.finished, ts.scheduled)
        line: dict[str, object] = {
            "request_id": done.request_id, "model": self.model_name, "tenant": done.tenant,
            "priority": done.priority, "finish_reason": done.finish_reason, "abort_reason": done.abort_reason,
            "error": done.error, "prompt_tokens": done.num_prompt_tokens, "output_tokens": done.num_output_tokens,
            "cached_tokens": done.num_cached_tokens, "preemptions": done.num_preemptions,
            "queue_s": latency.queue_s, "ttft_s": latency.ttft_s, "tpot_s": latency.tpot_s, "e2e_s": latency.e2e_s}
        if self.log_prompts:
            line["prompt"] = self.detokenize(done.prompt_token_ids)
            line["output"] = self.detokenize(done.output_token_ids)
        self.log.info(json.dumps(line, ensure_ascii=False))
