"""The block pool's LRU (an intrusive list through the blocks) against a
plain model of the same rules: a free stack handed out first, then cached
blocks evicted least recently freed first, a hit taking a block back out of
the LRU. Random operations, every answer and the eviction order compared."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvserve.kv_cache.block_pool import BlockPool


class ModelPool:
    """The pool's contract, written the obvious way."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(reversed(range(num_blocks)))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free) + len(self.lru):
            return None
        out = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            else:
                block, _ = self.lru.popitem(last=False)
                del self.by_hash[self.hash_of.pop(block)]
                self.num_evictions += 1
            self.ref[block] = 1
            out.append(block)
        return out

    def take(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref[block] == 0:
                del self.lru[block]
            self.ref[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if block in self.hash_of:
                    self.lru[block] = None
                else:
                    self.free.append(block)

    def cache(self, block: int, block_hash: bytes) -> bool:
        if block in self.hash_of or block_hash in self.by_hash:
            return False
        self.hash_of[block] = block_hash
        self.by_hash[block_hash] = block
        return True


@pytest.mark.parametrize("seed", range(6))
def test_lru_matches_the_plain_model_over_random_operations(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([1, 3, 8, 32])
    pool, model = BlockPool(num_blocks), ModelPool(num_blocks)
    held: list[list[int]] = []  # what "requests" hold, released in order
    for _ in range(1500):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(0, 4)
            got = pool.allocate(n) if n != 1 or rng.random() < 0.5 else (
                None if (one := pool.allocate_one()) is None else [one])
            want = model.allocate(n)
            assert (None if got is None else [b.block_id for b in got]) == want
            if want:
                held.append(want)
        elif op < 0.55 and held:
            blocks = held.pop(rng.randrange(len(held)))
            order = blocks[::-1] if rng.random() < 0.5 else blocks
            pool.release([pool.blocks[b] for b in order])
            model.release(order)
        elif op < 0.8 and held:
            block = rng.choice(rng.choice(held))
            block_hash = rng.randbytes(2)  # small: duplicate hashes happen
            assert pool.cache_block(pool.blocks[block], block_hash) == model.cache(block, block_hash)
        else:  # a prefix hit on blocks that are cached or in use
            hashed = [b for b in model.hash_of if rng.random() < 0.3]
            assert [pool.lookup(model.hash_of[b]).block_id for b in hashed] == hashed
            pool.take([pool.blocks[b] for b in hashed])
            model.take(hashed)
            if hashed:
                held.append(hashed)
        assert pool.eviction_order() == list(model.lru)
        assert pool.num_free_blocks == len(model.free) + len(model.lru)
        assert pool.num_evictions == model.num_evictions
        pool.check_integrity()
    pool.reset_prefix_cache()
    assert pool.eviction_order() == [] and pool.num_cached_blocks == 0
    pool.check_integrity()

