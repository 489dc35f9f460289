"""The KV cache manager's per-block calls for a decode run (`append_block`,
`cache_next_block`) leave exactly what the general `allocate_slots` /
`cache_blocks_ahead` leave (block ids, registrations, free list, LRU
order, evictions), and the hashes they register are those of the tokens
the requests end up holding."""

import random

import pytest

from kvserve.config import CacheConfig
from kvserve.contract import Request, SamplingParams
from kvserve.kv_cache.hashing import hash_prefix_blocks
from kvserve.kv_cache.manager import KVCacheManager

BS = 4
PENDING = 7  # the token every step of the run samples


def _specs(seed):
    """(request id, prompt, output tokens known when the run starts, steps
    until it finishes). Prompts share prefixes (shared blocks, duplicate
    hashes); known outputs are none, the run's token (an earlier run's), or
    others (the block mixes known and pending tokens)."""
    rng = random.Random(seed)
    specs = []
    for i in range(rng.randint(2, 7)):
        head = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [PENDING] * 5, []])
        prompt = head + [rng.randrange(100) for _ in range(rng.randint(1 if not head else 0, 9))]
        outputs = rng.choice([[], [PENDING] * rng.randint(1, 6), [PENDING, 3], [5] * rng.randint(1, 5)])
        specs.append((f"r{i}", prompt, outputs, rng.randint(1, 20)))
    return specs


def _drive(specs, num_blocks, run_calls):
    """Decode steps of a steady batch applied as a DecodeRun applies them
    (the requests' fields lag until they finish): step s allocates for
    every request entering a new block, in batch order, then registers the
    blocks it completes; a request's last step brings it up to date and
    frees it. Returns (manager, what the state looked like at each finish)."""
    kv = KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=BS))
    requests = []
    for rid, prompt, outputs, _ in specs:
        request = Request(rid, prompt, SamplingParams(max_tokens=1000), 0.0)
        request.output_token_ids = list(outputs)
        hit = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, request.num_tokens - 1 - hit.num_tokens, hit) is not None
        request.num_computed_tokens = request.num_tokens - 1  # steady: only the last token to run
        kv.cache_computed_blocks(request)
        requests.append(request)
    finishes = []
    for step in range(max(steps for *_, steps in specs)):
        live = [(r, steps) for r, (*_, steps) in zip(requests, specs) if step < steps]
        for request, _ in live:
            rid = request.request_id
            if request.num_computed_tokens + step == kv.num_held_blocks(rid) * BS:  # enters a new block
                block = kv.append_block(rid) if run_calls else kv.allocate_slots(request, step + 1)
                assert block is not None, "the pool is sized to the batch's peak"
        for request, steps in live:
            num_computed = request.num_computed_tokens + step + 1
            if num_computed % BS == 0:
                register = kv.cache_next_block if run_calls else kv.cache_blocks_ahead
                register(request, num_computed, PENDING)
            if step == steps - 1:
                request.output_token_ids += [PENDING] * steps
                request.num_computed_tokens += steps
                kv.check_integrity()
                finishes.append((request.request_id, list(kv.block_ids(request.request_id)),
                                 list(request.block_hashes), kv.num_free_blocks))
                kv.free(request)
    return kv, requests, finishes


def _peak_blocks(specs):
    """The most blocks the batch holds at once (just before a finish frees
    some): a pool of exactly this size runs its free list dry, so blocks
    come from evicting cached ones."""
    _, _, finishes = _drive(specs, 1000, run_calls=False)
    return 1000 - min(num_free for *_, num_free in finishes)


def _pool_state(kv):
    pool = kv.pool
    return ([b.block_id for b in pool._free], pool.eviction_order(),
            sorted((h, b.block_id) for h, b in pool._by_hash.items()), pool.num_evictions)


@pytest.mark.parametrize("seed", range(40))
def test_run_calls_leave_what_the_general_calls_leave(seed):
    specs = _specs(seed)
    peak = _peak_blocks(specs)
    general, general_requests, general_finishes = _drive(specs, peak, run_calls=False)
    run, run_requests, run_finishes = _drive(specs, peak, run_calls=True)
    assert run_finishes == general_finishes
    assert _pool_state(run) == _pool_state(general)
    assert [r.block_hashes for r in run_requests] == [r.block_hashes for r in general_requests]
    for request in run_requests:  # the registered hashes are the definition's
        expected = hash_prefix_blocks(request.prompt_token_ids + request.output_token_ids, BS, "")
        assert request.block_hashes == expected[:len(request.block_hashes)]
        assert len(request.block_hashes) >= request.num_computed_tokens // BS


def test_some_seeds_evict_and_share():
    # The comparison above is only as strong as the cases it meets.
    evictions = shared = 0
    for seed in range(40):
        specs = _specs(seed)
        kv, _, finishes = _drive(specs, _peak_blocks(specs), run_calls=True)
        evictions += kv.pool.num_evictions > 0
        ids = [block for _, blocks, _, _ in finishes for block in blocks]
        shared += len(ids) != len(set(ids))
    assert evictions >= 10 and shared >= 10


def test_cache_next_block_off_a_single_block_is_the_general_call():
    # Two blocks completed at once, or none: the general call's result.
    for num_computed in (8, 12, 3):
        managers = []
        for call in ("cache_next_block", "cache_blocks_ahead"):
            kv = KVCacheManager(CacheConfig(num_blocks=16, block_size=BS))
            request = Request("a", [1, 2, 3], SamplingParams(max_tokens=100), 0.0)
            assert kv.allocate_slots(request, 12) is not None
            getattr(kv, call)(request, num_computed, PENDING)
            managers.append((_pool_state(kv), list(request.block_hashes)))
        assert managers[0] == managers[1]
        assert len(managers[0][1]) == num_computed // BS


def test_append_block_returns_none_without_change_when_full():
    kv = KVCacheManager(CacheConfig(num_blocks=2, block_size=BS))
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=100), 0.0)
    assert kv.allocate_slots(request, 5) is not None
    assert kv.append_block("a") is None
    assert kv.block_ids("a") == [0, 1]
    kv.check_integrity()
