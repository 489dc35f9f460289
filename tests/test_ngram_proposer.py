"""The incremental n-gram index proposes exactly what a scan of the whole
context does: the latest earlier occurrence of the longest n that matches."""

import random

from kvserve.runner.ngram_proposer import NgramProposer


def scanned_drafts(tokens: list[int], num_tokens: int, smallest: int, largest: int) -> list[int]:
    length = len(tokens)
    for n in range(min(largest, length - 1), smallest - 1, -1):
        suffix = tokens[length - n:]
        starts = [i for i in range(length - n) if tokens[i:i + n] == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + num_tokens]
    return []


def test_growing_contexts_get_the_drafts_of_a_full_scan():
    rng = random.Random(0)
    for smallest, largest in [(1, 3), (2, 4), (3, 3)]:
        proposer = NgramProposer(smallest, largest)
        for request in range(20):
            rid = f"r{request}"
            tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
            while len(tokens) < 80:
                assert proposer.propose(rid, tokens, 4) == scanned_drafts(tokens, 4, smallest, largest), tokens
                # a step adds 1..5 tokens (accepted drafts plus the bonus one)
                tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
            proposer.forget(rid)


def test_a_context_that_is_not_an_extension_is_indexed_anew():
    proposer = NgramProposer(2, 2)
    assert proposer.propose("r", [1, 2, 3, 1, 2], 2) == [3, 1]
    # the same request id with a different history (not an append)
    assert proposer.propose("r", [7, 8, 9, 4, 5, 6, 1, 2], 2) == []
    assert proposer.propose("r", [5, 5, 5], 1) == [5]
