"""KV cache accounting per request: which blocks a request holds, prefix-cache
lookups, and allocation for the tokens a step will compute.

The manager answers narrow questions and never decides policy: when there is
no room, `allocate_slots` returns None and the scheduler chooses whom to
preempt. The scheduler's view is `get_computed_blocks`, `allocate_slots`,
`free`, `block_ids` and `cache_computed_blocks`; the one-block calls at the
end (`append_block`, `cache_next_block`, `cache_blocks_ahead`) serve the
simulator's multi-step decode runs (sim/fast_forward.py) alone.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from kvserve.config import CacheConfig
from kvserve.contract import Request
from kvserve.kv_cache.block_pool import BlockPool, KVBlock
from kvserve.kv_cache.hashing import (encoded_repeat, hash_block, hash_encoded_block, hash_prefix_blocks,
                                      namespace_root)


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: blocks whose KV is already computed for this request."""

    blocks: list[KVBlock]
    num_tokens: int


NO_HIT = ComputedBlocks([], 0)


class KVCacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, enable_caching=config.enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        # Block ids mirror `_blocks` so the runner reads a ready list each step.
        self._block_ids: dict[str, list[int]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # allocate_slots calls the pool could not satisfy (the scheduler then
        # preempts, or holds a waiting request back): the cache is full.
        self.num_allocation_failures = 0
        self._repeat_token_id = -1  # _encoded_repeat's last token id (none yet) and its encoding
        self._repeat_encoded = b""

    # -- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (evictable cached blocks are free)."""
        return self.pool.usage()

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: do not mutate)."""
        return self._block_ids.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of a request that holds no blocks yet.

        Never covers the last token: the model must run on at least one token
        to produce the logits the next token is sampled from. No state change."""
        if not self.enable_prefix_caching or request.request_id in self._blocks:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._request_hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def held_prefix_tokens(self, request: Request) -> int:
        """The part of get_computed_blocks' hit whose blocks some request
        holds: what an eviction cannot take before this request starts. No
        state change."""
        hit = 0
        for block in self.get_computed_blocks(request).blocks:
            if block.ref_count == 0:
                break
            hit += self.block_size
        return hit

    # -- state changes -------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed
        ones (plus the `computed` prefix hit, on a request's first allocation).

        Returns the newly allocated blocks (possibly empty), or None with no
        state change when the pool cannot supply them."""
        held = self._blocks.get(request.request_id)
        if computed is None and held is not None:
            return self._extend(request.request_id, held, request.num_computed_tokens + num_new_tokens)
        computed = computed or NO_HIT
        num_held = len(held) if held is not None else 0
        num_tokens_after = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        num_new_blocks = self.blocks_for_tokens(num_tokens_after) - num_held - len(computed.blocks)
        # Cached hits leave the free pool when taken.
        num_cached_hits = sum(1 for b in computed.blocks if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_cached_hits:
            self.num_allocation_failures += 1
            return None
        self.pool.take(computed.blocks)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0)) or []
        if held is None:
            held = self._blocks[request.request_id] = []
            self._block_ids[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(computed.blocks)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += computed.num_tokens
        held.extend(computed.blocks)
        held.extend(new_blocks)
        self._block_ids[request.request_id].extend([b.block_id for b in computed.blocks] +
                                                   [b.block_id for b in new_blocks])
        return new_blocks

    def _extend(self, request_id: str, held: list[KVBlock], num_tokens_after: int) -> list[KVBlock] | None:
        """allocate_slots for a request that holds blocks and brings no prefix
        hit (every step of a running request): the same result and state
        change with less work, since decode steps call it most."""
        num_new_blocks = -(-num_tokens_after // self.block_size) - len(held)
        if num_new_blocks <= 0:
            return []  # a decode step inside the last block
        if num_new_blocks == 1:  # a decode step entering a new block
            block = self.pool.allocate_one()
            if block is None:
                self.num_allocation_failures += 1
                return None
            held.append(block)
            self._block_ids[request_id].append(block.block_id)
            return [block]
        new_blocks = self.pool.allocate(num_new_blocks)
        if new_blocks is None:
            self.num_allocation_failures += 1
            return None
        held.extend(new_blocks)
        self._block_ids[request_id].extend([b.block_id for b in new_blocks])
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed (call after
        the step that computed them ran), so later requests can hit them."""
        # Every running request, every step: most calls complete no block.
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, num_full)
        if num_full > start:
            self._register_blocks(request, start, num_full, None)

    def _register_blocks(self, request: Request, start: int, num_full: int, pending_token_id: int | None) -> None:
        """Register the request's blocks start..num_full - 1 in the prefix
        cache; tokens past `request.num_tokens` are all `pending_token_id`
        (see cache_blocks_ahead)."""
        rid = request.request_id
        hashes = request.block_hashes
        if len(hashes) < num_full:
            self._request_hashes(request, num_full, pending_token_id)
        if num_full == start + 1:  # one block (a decode step completing it): most calls
            self.pool.cache_block(self._blocks[rid][start], hashes[start])
        else:
            self.pool.cache_blocks(self._blocks[rid][start:num_full], hashes[start:num_full])
        self._num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release every block of the request. Its tail blocks become the first
        to be evicted: a prefix's head is the part most likely shared."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        if blocks is None:
            return  # holds nothing (never started, or preempted)
        # The three maps gain and lose a request together (allocate_slots).
        del self._block_ids[rid]
        del self._num_cached_blocks[rid]
        if blocks:
            self.pool.release(reversed(blocks))

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past the first `num_tokens` tokens'
        (slots allocated for draft tokens that were rejected). Those blocks
        hold no registered prefix: only computed full blocks are registered."""
        rid = request.request_id
        held = self._blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if held is None or len(held) <= keep:
            return
        tail = held[keep:]
        del held[keep:]
        del self._block_ids[rid][keep:]
        self.pool.release(reversed(tail))

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks evicted from the prefix cache to make room, since start."""
        return self.pool.num_evictions

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds and zero the prefix-cache,
        eviction and allocation-failure totals (as vLLM's reset_prefix_cache
        resets its prefix stats): forgetting is not evicting."""
        self.pool.reset_prefix_cache()
        self.pool.num_evictions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.num_allocation_failures = 0

    def _request_hashes(self, request: Request, num_blocks: int, pending_token_id: int | None = None) -> list[bytes]:
        """The request's chained block hashes, extended to `num_blocks` (kept on
        the request: a full block's tokens never change, even across
        preemption). Positions past the request's tokens hold
        `pending_token_id` (see cache_blocks_ahead)."""
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return hashes
        size = self.block_size
        if not hashes and num_blocks * size <= request.num_tokens:
            # A prompt's first lookup (admission's prefix-hit projection, or
            # its first schedule): every block at once over one encoding.
            hashes += hash_prefix_blocks(request.token_ids_slice(0, num_blocks * size), size,
                                         request.cache_namespace)
            return hashes
        parent = hashes[-1] if hashes else namespace_root(request.cache_namespace)
        end = num_blocks * size
        if pending_token_id is None:
            num_known, pending = end, 0  # no position is pending: `pending` is never read
        else:
            num_known, pending = request.num_tokens, pending_token_id
        for start in range(len(hashes) * size, end, size):
            if start >= num_known:  # every token pending: a decode run's block
                parent = hash_encoded_block(parent, self._encoded_repeat(pending))
                hashes.append(parent)
                continue
            tokens = request.token_ids_slice(start, start + size)
            if start + size > num_known:
                if tokens.count(pending) == len(tokens):
                    # Known tokens all the pending one, then pending ones: a
                    # block of one repeated token (its encoding is cached).
                    parent = hash_encoded_block(parent, self._encoded_repeat(pending))
                    hashes.append(parent)
                    continue
                tokens += [pending] * (start + size - num_known)
            parent = hash_block(parent, tokens)
            hashes.append(parent)
        return hashes

    def _encoded_repeat(self, token_id: int) -> bytes:
        """encoded_repeat(token_id, block_size), the last one kept: a decode
        run hashes every block it fills with the same pending token."""
        if token_id != self._repeat_token_id:
            self._repeat_token_id = token_id
            self._repeat_encoded = encoded_repeat(token_id, self.block_size)
        return self._repeat_encoded

    def check_integrity(self) -> None:
        """Raise AssertionError unless pool states add up and every refcount
        equals the number of requests holding that block."""
        self.pool.check_integrity()
        holders = Counter(b.block_id for blocks in self._blocks.values() for b in blocks)
        for block in self.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} != holders "
                f"{holders.get(block.block_id, 0)}")
        for rid, blocks in self._blocks.items():
            assert self._block_ids[rid] == [b.block_id for b in blocks], f"{rid}: block ids out of sync"

    # -- a decode run's calls (sim/fast_forward.py), not the scheduler's -------
    # A `DecodeRun` applies a steady decode batch's steps as events: a token
    # entering a new block, a block completed. These calls do for exactly
    # those events what allocate_slots and cache_computed_blocks do, without
    # the general cases' work: they run for every block a decode run fills
    # (millions in a simulated hour). The run's tokens are appended to its
    # requests lazily, so a block is registered before its request holds
    # the tokens: those past `request.num_tokens` are all the run's token.

    def append_block(self, request_id: str) -> KVBlock | None:
        """allocate_slots for a request that holds blocks and whose next token
        enters a new block (the caller knows it does): one block from the
        pool at the end of its block table. None, with no change, when the
        pool has none."""
        block = self.pool.allocate_one()
        if block is None:
            return None
        self._blocks[request_id].append(block)
        self._block_ids[request_id].append(block.block_id)
        return block

    def cache_blocks_ahead(self, request: Request, num_computed_tokens: int, pending_token_id: int) -> None:
        """cache_computed_blocks as if the request had `num_computed_tokens`
        computed, its tokens past `request.num_tokens` all
        `pending_token_id`: the hashes are those its tokens will have once
        brought up to date."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, num_full)
        if num_full > start:
            self._register_blocks(request, start, num_full, pending_token_id)

    def cache_next_block(self, request: Request, num_computed_tokens: int, pending_token_id: int) -> None:
        """cache_blocks_ahead when that completes exactly the request's next
        unregistered block (a decode step ending on a block boundary), with
        less work; the general call otherwise."""
        rid = request.request_id
        index = self._num_cached_blocks.get(rid)
        size = self.block_size
        if index is None or num_computed_tokens // size != index + 1 or not self.enable_prefix_caching:
            self.cache_blocks_ahead(request, num_computed_tokens, pending_token_id)
            return
        hashes = request.block_hashes
        if index and len(hashes) == index and index * size >= request.num_tokens:
            # A block after the first that holds only tokens not yet appended:
            # all the pending one (what _request_hashes does for it, without
            # its loop).
            hashes.append(hash_encoded_block(hashes[index - 1], self._encoded_repeat(pending_token_id)))
        elif len(hashes) <= index:
            hashes = self._request_hashes(request, index + 1, pending_token_id)
        self.pool.cache_block(self._blocks[rid][index], hashes[index])
        self._num_cached_blocks[rid] = index + 1
