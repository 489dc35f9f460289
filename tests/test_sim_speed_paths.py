"""The shortcuts the simulator's speed rests on give the numbers of the
plain definitions: prompt hashes computed once, summaries."""

import random

import pytest

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.contract import Request, SamplingParams
from kvserve.kv_cache.hashing import hash_block, hash_prefix_blocks, namespace_root
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.latency import PERCENTILES, percentile, summarize
from kvserve.scheduler.scheduler import Scheduler


@pytest.mark.parametrize("num_tokens", [0, 3, 4, 5, 17, 64])
def test_hash_prefix_blocks_is_the_chain_of_hash_block(num_tokens):
    tokens = [random.Random(num_tokens).randrange(2**32) for _ in range(num_tokens)]
    parent, chain = namespace_root("ns"), []
    for start in range(0, num_tokens - 3, 4):
        parent = hash_block(parent, tokens[start:start + 4])
        chain.append(parent)
    assert hash_prefix_blocks(tokens, 4, "ns") == chain


def test_prompt_hashes_computed_for_admission_serve_the_cache():
    # The simulator asks the prefix-hit question before admitting (the
    # scheduler's prefix_hit_tokens): the prompt is hashed once, all its
    # blocks over one encoding, the request keeps the hashes (those of the
    # chained definition) and its first schedule finds the same blocks.
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    scheduler = Scheduler(config, CacheConfig(num_blocks=32, block_size=4))
    kv = scheduler.kv_cache
    prompt = list(range(100, 118))  # 4 full blocks + 2 tokens
    first = Request("a", prompt, SamplingParams(max_tokens=2), 0.0, cache_namespace="ns")
    kv.allocate_slots(first, len(prompt), kv.get_computed_blocks(first))
    first.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(first)
    again = prompt[:13] + [999] * 5  # shares 3 full blocks
    second = Request("b", again, SamplingParams(max_tokens=2), 0.0, cache_namespace="ns")
    assert scheduler.prefix_hit_tokens(second) == 12
    assert second.block_hashes == hash_prefix_blocks(again[:-1], 4, "ns")
    computed = kv.get_computed_blocks(second)
    assert computed.num_tokens == 12
    assert [b.block_id for b in computed.blocks] == kv.block_ids("a")[:3]
    other = Request("c", again, SamplingParams(max_tokens=2), 0.0, cache_namespace="other")
    assert scheduler.prefix_hit_tokens(other) == 0


def _plain_summary(values):
    """The definition: Python's sorted() and left-to-right sum()."""
    data = sorted(v for v in values if v is not None)
    return {"count": len(data), "mean": sum(data) / len(data),
            **{f"p{q}": percentile(data, q) for q in PERCENTILES}}


@pytest.mark.parametrize("seed", range(5))
def test_summarize_gives_the_plain_definitions_numbers_exactly(seed):
    rng = random.Random(seed)
    floats = [rng.lognormvariate(-3, 2) for _ in range(rng.randint(1, 5000))] + [None] * 3
    ints = [rng.randint(1, 4000) for _ in range(rng.randint(1, 5000))]
    for values in (floats, ints, [0.1] * 1000 + [0.2], [7]):
        got = summarize(values)
        assert got == _plain_summary(values)
        assert all(type(got[k]) is float for k in got if k != "count")
    assert summarize([None])["mean"] is None


def test_hash_block_is_blake2b_of_the_parent_and_32_bit_token_ids():
    # The definition the prefix cache relies on (kv_cache/hashing.py), with
    # hashlib itself: the copied-hasher shortcut changes no hash.
    import hashlib
    from array import array

    from kvserve.kv_cache.hashing import encoded_repeat, hash_encoded_block

    parent, tokens = namespace_root("ns"), [3, 2**31 + 5, 0, 7]
    expected = hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()
    assert hash_block(parent, tokens) == expected
    assert hash_encoded_block(parent, encoded_repeat(9, 4)) == hash_block(parent, [9] * 4)


@pytest.mark.parametrize("num_prompt", [3, 4, 5, 9])
def test_blocks_registered_ahead_of_the_tokens_get_the_hashes_the_tokens_will_have(num_prompt):
    # A decode run registers a completed block before it appends the run's
    # tokens to the request: the positions past the request's tokens hold
    # the pending token. The hashes (and the blocks registered) equal those
    # of registering after the tokens are appended.
    ahead = KVCacheManager(CacheConfig(num_blocks=32, block_size=4))
    after = KVCacheManager(CacheConfig(num_blocks=32, block_size=4))
    prompt = list(range(100, 100 + num_prompt))
    requests = [Request(rid, list(prompt), SamplingParams(max_tokens=20), 0.0, cache_namespace="ns")
                for rid in ("a", "b")]
    for kv, request in zip((ahead, after), requests):
        kv.allocate_slots(request, num_prompt + 11)
        request.num_computed_tokens = num_prompt - 1  # the prompt's last token computes in the first decode step
    ahead.cache_blocks_ahead(requests[0], num_prompt + 10, pending_token_id=7)
    requests[1].output_token_ids += [7] * 11
    requests[1].num_computed_tokens = num_prompt + 10
    after.cache_computed_blocks(requests[1])
    full = (num_prompt + 10) // 4
    assert requests[0].block_hashes[:full] == requests[1].block_hashes[:full] == \
        hash_prefix_blocks(prompt + [7] * 11, 4, "ns")[:full]
    assert [ahead.pool.lookup(h).block_id for h in requests[0].block_hashes[:full]] == ahead.block_ids("a")[:full]
