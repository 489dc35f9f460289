"""Draft-model drafts: a smaller model with the target's vocabulary proposes
k tokens per request, autoregressively, in batched steps of its own.

The draft keeps its own paged KV cache (its own `ModelRunner`: weights and
cache tensor) under the same KV manager rules as the target's
(`KVCacheManager`, prefix caching off), sized to as many blocks as the
target's, so whatever the target holds the draft can hold too. Its weights
load before the target's cache is sized (`load_runner`): an automatic KV
size leaves room for them, and one budget pays for both caches. Each
request has a mirror `Request` there whose progress counter is the draft's:
after the target verified a request's drafts, only the accepted ones keep
their draft KV (the counter rolls back to them), and the next proposal
first catches up on the tokens the target added.

Greedy requests draft by argmax; sampled ones draw each draft from the
draft's distribution q (the request's temperature, top-k, top-p) with the
request's own generator (a stream apart from the target's), and q goes to
the verification, which needs it for the exact rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvserve.config import CacheConfig, SpeculativeConfig
from kvserve.contract import Request
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.model.device import resolve_dtype
from kvserve.model.loader import load_model
from kvserve.model.sampler import race, row_argmax
from kvserve.runner.model_runner import ModelRunner, kv_bytes_per_block
from kvserve.scheduler.scheduler import ScheduledChunk, Scheduler

DRAFT_STREAM = 1  # Sampler.generator_at stream of the draft's draws


class DraftModelProposer:
    def __init__(self, draft: ModelRunner, target: ModelRunner, scheduler: Scheduler) -> None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
                             f"target's ({target.config.vocab_size})")
        if draft.num_blocks != target.num_blocks:
            draft.resize_kv_cache(target.num_blocks)
        self.draft = draft
        self.sampler = target.sampler  # the target's generators: one seed rule for both
        self.scheduler = scheduler
        self.kv = KVCacheManager(CacheConfig(num_blocks=draft.num_blocks, block_size=draft.block_size,
                                             enable_prefix_caching=False))
        self._mirrors: dict[str, Request] = {}
        # request_id -> (its token count when drafted, the drafts): what to roll back to
        self._proposed: dict[str, tuple[int, list[int]]] = {}

    @staticmethod
    def load_runner(config: SpeculativeConfig, *, block_size: int, dtype: str | torch.dtype,
                    device: torch.device | str | None, max_model_len: int, quantization: str) -> ModelRunner:
        """The draft model at `config.model` on the target's device and dtype,
        computed in the target's `quantization` (model/quantized.prepare_weights:
        under "auto" a GGUF's Q8_0 / Q4_0 / Q4_1 matrices stay quantized, so its
        steps run the quantized kernels, the one-call decode included, and its
        resident weights are the file's blocks, not float32), its cache one
        block until the proposer gives it the target's block count (the
        target's cache is sized after this, net of the draft's weights and
        per-block KV)."""
        assert config.model is not None
        loaded = load_model(config.model, quantization=quantization)
        return ModelRunner(loaded.config, loaded.weights,
                           kv_cache_memory_bytes=kv_bytes_per_block(loaded.config, block_size, resolve_dtype(dtype)),
                           block_size=block_size, dtype=dtype, device=device, max_model_len=max_model_len,
                           enforce_eager=True, quantization=quantization)

    def sleep(self) -> int:
        """The engine sleeps: free the draft's KV cache (on CUDA its weights
        go to pinned host memory; they stay at level 2 too, since a wake
        reads only the target's again). Bytes freed from the device."""
        return self.draft.release_kv_cache() + self.draft.offload_weights()

    def wake_up(self, target: ModelRunner) -> None:
        """Undo sleep, beside `target` (a new runner after a level-2 wake,
        whose generators the draft must share)."""
        self.draft.restore_weights()
        self.draft.allocate_kv_cache()
        self.sampler = target.sampler

    @torch.inference_mode()
    def propose(self, chosen: Sequence[tuple[Request, int]]) -> dict[str, Tensor]:
        """Set `spec_token_ids` of each (request, k) to k drafts (none where the
        draft's cache has no room). Returns request_id -> [k, V] the
        distributions the drafts were drawn from, for sampled requests."""
        self._free_gone()
        mirrors = [(r, m, k) for r, k in chosen if (m := self._catch_up(r, k)) is not None]
        q_rows: dict[str, list[Tensor]] = {r.request_id: [] for r, _, k in mirrors
                                           if not r.sampling_params.greedy}
        step = 0
        active = mirrors
        while active:
            chunks = [ScheduledChunk(m, m.num_computed_tokens, m.num_tokens - m.num_computed_tokens,
                                     self.kv.block_ids(m.request_id), True) for _, m, _ in active]
            tokens = self._draft_step(chunks, [r for r, _, _ in active], q_rows)
            for (request, mirror, _), token in zip(active, tokens):
                mirror.num_computed_tokens = mirror.num_tokens
                mirror.output_token_ids.append(token)
            step += 1
            active = [a for a in active if a[2] > step]
        out = {}
        for request, mirror, k in mirrors:
            drafts = mirror.output_token_ids[-k:]
            request.spec_token_ids = drafts
            self._proposed[request.request_id] = (request.num_tokens, drafts)
            if request.request_id in q_rows:
                out[request.request_id] = torch.stack(q_rows[request.request_id])
        return out

    def _catch_up(self, request: Request, num_drafts: int) -> Request | None:
        """The request's mirror, rolled back to the draft KV still valid and
        holding the target's tokens; its slots for this proposal allocated.
        None when the draft's cache has no room."""
        rid = request.request_id
        mirror = self._mirrors.get(rid)
        if mirror is None:
            mirror = self._mirrors[rid] = Request(rid, request.prompt_token_ids, request.sampling_params, 0.0)
        # At least the last token runs: its logits give the first draft (a
        # request not scheduled since its last proposal brings no new token).
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, self._valid_prefix(request),
                                         request.num_tokens - 1)
        mirror.output_token_ids = list(request.output_token_ids)
        # Catch-up tokens, then k - 1 drafts run (the last draft's KV is never needed).
        if self.kv.allocate_slots(mirror, mirror.num_tokens - mirror.num_computed_tokens + num_drafts - 1) is None:
            return None
        return mirror

    def _valid_prefix(self, request: Request) -> int:
        """Tokens whose draft KV matches the request's tokens: up to its last
        proposal's base, then the drafts the target accepted."""
        proposed = self._proposed.get(request.request_id)
        if proposed is None:
            return 0
        base, drafts = proposed
        actual = request.token_ids_slice(base, base + len(drafts))
        matched = 0
        while matched < len(actual) and actual[matched] == drafts[matched]:
            matched += 1
        return base + min(matched, len(drafts) - 1)

    def _draft_step(self, chunks: list[ScheduledChunk], requests: list[Request],
                    q_rows: dict[str, list[Tensor]]) -> list[int]:
        """One forward pass of the draft over `chunks`; one draft token per request."""
        draft = self.draft
        batch = draft.step_batch(chunks)  # a draft has no prompt tiles: rows in chunk order
        hidden = draft.model.forward(batch.token_ids, draft.kv_caches, batch.meta)
        logits = draft.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        tokens = row_argmax(logits).tolist()
        sampled = [i for i, r in enumerate(requests) if r.request_id in q_rows]
        if not sampled:
            return tokens
        probs = self.sampler.probs(logits[sampled], [requests[i] for i in sampled])
        for row, i in enumerate(sampled):
            request = requests[i]
            position = request.num_output_tokens + len(q_rows[request.request_id])
            noise = torch.empty_like(probs[row]).exponential_(
                generator=self.sampler.generator_at(request, position, DRAFT_STREAM))
            tokens[i] = int(race(probs[row].clone(), noise))
            q_rows[request.request_id].append(probs[row])
        return tokens

    def free(self, request_id: str) -> None:
        mirror = self._mirrors.pop(request_id, None)
        self._proposed.pop(request_id, None)
        if mirror is not None:
            self.kv.free(mirror)

    def _free_gone(self) -> None:
        """Draft KV of requests no longer running (finished or preempted)."""
        running = self.scheduler.running
        for rid in [rid for rid in self._mirrors if rid not in running]:
            self.free(rid)
