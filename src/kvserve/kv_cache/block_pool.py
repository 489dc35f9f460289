"""Fixed-size KV blocks with reference counts and an LRU of reusable ones.

Every block is in exactly one of three states:
- in use: ref_count > 0 (held by one or more running requests);
- cached: ref_count == 0 but holds a full, hashed block, so a later request
  with the same prefix can take it back (a prefix-cache hit) until it is
  evicted, least recently freed first;
- free: ref_count == 0 and no hash.

New blocks come from the free list first and only then by evicting the LRU
cached block, so cached KV lives as long as memory allows. All operations are
O(1) per block.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVBlock:
    # prev / next link a cached block into the pool's LRU (an intrusive list:
    # freeing, taking back and evicting a block are a few pointer stores,
    # with no dict entry or list node per cached block).
    __slots__ = ("block_id", "ref_count", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock = self
        self.next: KVBlock = self

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, hash={h})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Stack of unhashed free blocks; popped from the end (lowest ids first).
        self._free: list[KVBlock] = list(reversed(self.blocks))
        # Cached (ref 0, hashed) blocks in eviction order, a circular list
        # through this sentinel: _lru.next is evicted next, _lru.prev was
        # freed last.
        self._lru = KVBlock(-1)
        self._num_evictable = 0
        # Hash -> the block holding that prefix (in use or cached).
        self._by_hash: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    # -- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached."""
        return len(self._free) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self._num_evictable

    def eviction_order(self) -> list[int]:
        """The cached blocks' ids, the next to be evicted first."""
        return [b.block_id for b in self._lru_blocks()]

    def _lru_blocks(self) -> list[KVBlock]:
        blocks = []
        block = self._lru.next
        while block is not self._lru:
            assert block.next.prev is block, "LRU links out of sync"
            blocks.append(block)
            block = block.next
        return blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free ones count as free)."""
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        """The block holding this prefix hash, in use or cached; no state change."""
        return self._by_hash.get(block_hash)

    # -- state changes -----------------------------------------------------
    def take(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (prefix-cache hits); a cached block
        leaves the evictable LRU."""
        for block in blocks:
            if block.ref_count == 0:  # leaves the LRU
                block.prev.next = block.next
                block.next.prev = block.prev
                self._num_evictable -= 1
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """`num_blocks` fresh blocks with ref_count 1, or None (no change) if
        fewer are available. Evicts LRU cached blocks when the free list runs out."""
        free = self._free
        num_from_free = min(num_blocks, len(free))
        num_evicted = num_blocks - num_from_free
        if num_evicted > self._num_evictable:
            return None
        # The free list's top blocks, popped in one slice (the order of
        # popping them one by one), then the LRU's oldest: once a cache
        # fills, nearly every block comes from there (_evict_lru inline).
        out = free[len(free) - num_from_free:]
        del free[len(free) - num_from_free:]
        out.reverse()
        if num_evicted:
            lru, by_hash = self._lru, self._by_hash
            block = lru
            for _ in range(num_evicted):
                block = block.next
                assert block.block_hash is not None  # every evictable block is hashed
                del by_hash[block.block_hash]
                block.block_hash = None
                out.append(block)
            lru.next = block.next  # the evicted blocks leave the LRU at once
            block.next.prev = lru
            self._num_evictable -= num_evicted
            self.num_evictions += num_evicted
        for block in out:
            block.ref_count = 1
        return out

    def allocate_one(self) -> KVBlock | None:
        """allocate(1)'s block, or None (no change) when none is available."""
        if self._free:
            block = self._free.pop()
        elif self._num_evictable:  # a full cache's every decode block
            block = self._evict_lru()
        else:
            return None
        block.ref_count = 1
        return block

    def _evict_lru(self) -> KVBlock:
        """The least recently freed cached block, out of the LRU and the
        hash index (the caller checked there is one)."""
        lru = self._lru
        block = lru.next
        lru.next = block.next
        block.next.prev = lru
        self._num_evictable -= 1
        assert block.block_hash is not None  # every evictable block is hashed
        del self._by_hash[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
        return block

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order. Blocks that
        reach 0 become cached (if hashed) at the most-recent end of the LRU, so
        pass them in the order they should be evicted (a request's tail first)."""
        free, lru = self._free, self._lru
        newest = lru.prev
        num_evictable = self._num_evictable
        for block in blocks:  # every block of every finished request: locals
            ref_count = block.ref_count - 1
            block.ref_count = ref_count
            if ref_count > 0:
                continue  # still shared
            if block.block_hash is None:
                free.append(block)
            else:  # the LRU's newest
                newest.next = block
                block.prev = newest
                newest = block
                num_evictable += 1
        newest.next = lru
        lru.prev = newest
        self._num_evictable = num_evictable

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register an in-use, fully computed block under its prefix hash.

        Returns False when another block already holds that hash (two requests
        computed the same prefix concurrently); this one then stays unhashed
        and simply returns to the free list when released."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        return True

    def cache_blocks(self, blocks: Iterable[KVBlock], block_hashes: Iterable[bytes]) -> None:
        """cache_block for each block and its hash, in order (a prompt
        registers all its blocks at once)."""
        if not self.enable_caching:
            return
        by_hash = self._by_hash
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in by_hash:
                block.block_hash = block_hash
                by_hash[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached (free) block; in-use hashed blocks stay shared."""
        while self._num_evictable:
            self._free.append(self._evict_lru())

    def check_integrity(self) -> None:
        """Raise AssertionError if the accounting is inconsistent."""
        in_use = [b for b in self.blocks if b.ref_count > 0]
        cached = self._lru_blocks()
        assert len(cached) == self._num_evictable, f"LRU holds {len(cached)}, counted {self._num_evictable}"
        assert all(b.ref_count >= 0 for b in self.blocks), "negative refcount"
        assert len(self._free) + len(cached) + len(in_use) == self.num_blocks, (
            f"free {len(self._free)} + cached {len(cached)} + in use {len(in_use)}"
            f" != total {self.num_blocks}")
        assert all(b.ref_count == 0 and b.block_hash is None for b in self._free), "bad free block"
        assert all(b.ref_count == 0 and b.block_hash is not None for b in cached), "bad cached block"
        assert len({b.block_id for b in self._free}) == len(self._free), "duplicate free block"
        for h, b in self._by_hash.items():
            assert b.block_hash == h, "hash index out of sync"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self._by_hash), "hashed block missing from index"
