"""Exact block ids and eviction order of the paged KV cache and prefix cache."""

import pytest

from kvserve.config import CacheConfig
from kvserve.contract import Request, SamplingParams
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager

BS = 4


def make_request(rid, tokens, namespace="", max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=0.0,
                   cache_namespace=namespace)


def prefill(manager, request):
    """Allocate and 'compute' a request's whole prompt, as the scheduler would."""
    hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    return hit


def test_allocation_takes_lowest_free_ids_and_free_returns_them():
    m = KVCacheManager(CacheConfig(num_blocks=8, block_size=BS, enable_prefix_caching=False))
    a = make_request("a", range(10))  # 3 blocks
    prefill(m, a)
    assert m.block_ids("a") == [0, 1, 2]
    b = make_request("b", range(100, 105))  # 2 blocks
    prefill(m, b)
    assert m.block_ids("b") == [3, 4]
    assert m.usage() == pytest.approx(5 / 8)
    m.free(a)
    m.check_integrity()
    assert m.num_free_blocks == 6 and m.pool.num_cached_blocks == 0


def test_prefix_hit_after_owner_finished_reuses_exact_blocks():
    m = KVCacheManager(CacheConfig(num_blocks=8, block_size=BS))
    a = make_request("a", range(1, 11))  # blocks [0,1] full, [2] partial
    prefill(m, a)
    m.free(a)
    assert m.pool.num_cached_blocks == 2  # only full blocks are cached
    b = make_request("b", list(range(1, 9)) + [99, 98, 97])
    hit = prefill(m, b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]
    assert hit.num_tokens == 8
    assert m.block_ids("b")[:2] == [0, 1]
    assert m.prefix_cache_queries == 10 + 11 and m.prefix_cache_hits == 8
    m.check_integrity()


def test_hit_never_covers_the_last_token():
    m = KVCacheManager(CacheConfig(num_blocks=8, block_size=BS))
    a = make_request("a", range(1, 9))  # exactly 2 full blocks
    prefill(m, a)
    b = make_request("b", range(1, 9))
    hit = m.get_computed_blocks(b)
    assert hit.num_tokens == 4  # the second block must be recomputed for logits


def test_two_requests_share_prefix_blocks_with_refcounts():
    m = KVCacheManager(CacheConfig(num_blocks=10, block_size=BS))
    a = make_request("a", range(1, 14))
    prefill(m, a)
    b = make_request("b", list(range(1, 9)) + [50, 51, 52])
    prefill(m, b)
    shared = m.block_ids("a")[:2]
    assert m.block_ids("b")[:2] == shared
    assert [m.pool.blocks[i].ref_count for i in shared] == [2, 2]
    m.free(a)
    assert [m.pool.blocks[i].ref_count for i in shared] == [1, 1]
    m.check_integrity()
    m.free(b)
    m.check_integrity()
    assert m.usage() == 0


def test_lru_eviction_order_evicts_least_recently_freed_and_tails_first():
    m = KVCacheManager(CacheConfig(num_blocks=6, block_size=BS))
    a = make_request("a", range(1, 10))  # blocks 0,1 full + 2 partial
    prefill(m, a)
    b = make_request("b", range(100, 109))  # blocks 3,4 full + 5 partial
    prefill(m, b)
    m.free(a)  # cached: a's tail block 1 first, then 0
    m.free(b)  # then b's 4, 3
    assert m.pool.eviction_order() == [1, 0, 4, 3]
    # Two uncached free blocks (2 and 5) are handed out before any eviction.
    c = make_request("c", range(200, 208))
    prefill(m, c)
    assert sorted(m.block_ids("c")) == [2, 5]
    assert m.pool.num_evictions == 0
    d = make_request("d", range(300, 306))  # needs 2 blocks: evicts 1 then 0
    prefill(m, d)
    assert m.block_ids("d") == [1, 0]
    assert m.pool.num_evictions == 2
    # a's prefix is gone; b's survives.
    assert m.get_computed_blocks(make_request("a2", range(1, 10))).num_tokens == 0
    assert m.get_computed_blocks(make_request("b2", range(100, 110))).num_tokens == 8
    m.check_integrity()


def test_hit_refreshes_lru_position():
    m = KVCacheManager(CacheConfig(num_blocks=4, block_size=BS))
    a = make_request("a", range(1, 6))  # block 0 full, 1 partial
    prefill(m, a)
    m.free(a)
    b = make_request("b", range(10, 15))  # reuses free block 1 (full), then 2 (partial)
    prefill(m, b)
    m.free(b)
    assert m.pool.eviction_order() == [0, 1]
    a2 = make_request("a2", range(1, 6))
    prefill(m, a2)  # touches block 0 again
    m.free(a2)
    assert m.pool.eviction_order()[-1] == 0  # now most recently used


def test_tenant_namespaces_never_share_blocks():
    m = KVCacheManager(CacheConfig(num_blocks=10, block_size=BS))
    a = make_request("a", range(1, 14), namespace="tenant-a")
    prefill(m, a)
    b = make_request("b", range(1, 14), namespace="tenant-b")
    hit = prefill(m, b)
    assert hit.num_tokens == 0
    assert not set(m.block_ids("a")) & set(m.block_ids("b"))
    same = make_request("a2", range(1, 14), namespace="tenant-a")
    assert m.get_computed_blocks(same).num_tokens == 12


def test_allocate_returns_none_without_side_effects_when_full():
    m = KVCacheManager(CacheConfig(num_blocks=3, block_size=BS, enable_prefix_caching=False))
    a = make_request("a", range(10))
    assert m.allocate_slots(a, 10) is not None
    b = make_request("b", range(5))
    assert m.allocate_slots(b, 5) is None
    assert m.num_held_blocks("b") == 0 and m.num_free_blocks == 0
    m.check_integrity()


def test_cached_hits_count_against_free_blocks():
    # A cached block that is hit leaves the free pool: allocation must account for it.
    m = KVCacheManager(CacheConfig(num_blocks=3, block_size=BS))
    a = make_request("a", range(1, 6))  # block 0 full (cached on free), block 1 partial
    prefill(m, a)
    m.free(a)
    b = make_request("b", list(range(1, 5)) + list(range(50, 58)))  # hit 1 block + needs 2 new
    hit = m.get_computed_blocks(b)
    assert hit.num_tokens == 4
    assert m.allocate_slots(b, 8, hit) is not None
    m.check_integrity()
    c = make_request("c", list(range(1, 5)) + list(range(60, 70)))  # hit shared + needs 3 new
    assert m.allocate_slots(c, 10, m.get_computed_blocks(c)) is None
    m.check_integrity()


def test_a_prefix_hit_lookup_is_side_effect_free():
    # Admission asks it of every arriving request: no blocks taken, no stats.
    m = KVCacheManager(CacheConfig(num_blocks=8, block_size=BS))
    prefill(m, make_request("a", range(1, 14)))
    before = (m.prefix_cache_queries, m.prefix_cache_hits, m.num_free_blocks)
    assert m.get_computed_blocks(make_request("b", range(1, 14))).num_tokens == 12
    assert m.get_computed_blocks(make_request("c", range(1, 14), namespace="other")).num_tokens == 0
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_free_blocks) == before


def test_integrity_check_detects_corruption():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    blocks[0].ref_count = 0  # leaked: neither free nor cached nor in use
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_duplicate_hash_keeps_one_cached_copy():
    # Two requests compute the same prefix in the same step: only one block is
    # registered, the other returns to the free list on release.
    m = KVCacheManager(CacheConfig(num_blocks=8, block_size=BS))
    a, b = make_request("a", range(1, 6)), make_request("b", range(1, 6))
    for r in (a, b):
        assert m.allocate_slots(r, 5, m.get_computed_blocks(r)) is not None
    for r in (a, b):
        r.num_computed_tokens = 5
        m.cache_computed_blocks(r)
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert m.pool.num_cached_blocks == 1
